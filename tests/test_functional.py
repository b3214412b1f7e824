"""dtensor.nn.functional against plain-numpy formulas (values) and finite differences (grads)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor import Tensor

rng = np.random.default_rng(11)
_erf = np.vectorize(math.erf)


def fd_check(f, arrays, tol=1e-5, eps=1e-6):
    """Gradient of sum(f(*tensors) * g) w.r.t. every array, autograd vs central differences."""
    ts = [Tensor(a, requires_grad=True) for a in arrays]
    out = f(*ts)
    g = rng.standard_normal(out.shape)
    (out * Tensor(g)).sum().backward()
    for t, a in zip(ts, arrays):
        num = np.zeros_like(a)
        for pos in np.ndindex(*a.shape):
            old = a[pos]
            a[pos] = old + eps
            hi = np.sum(f(*[Tensor(b) for b in arrays]).numpy() * g)
            a[pos] = old - eps
            lo = np.sum(f(*[Tensor(b) for b in arrays]).numpy() * g)
            a[pos] = old
            num[pos] = (hi - lo) / (2 * eps)
        np.testing.assert_allclose(t.grad.numpy(), num, rtol=tol, atol=tol)


def np_log_softmax(x):
    s = x - x.max(-1, keepdims=True)
    return s - np.log(np.exp(s).sum(-1, keepdims=True))


def test_cross_entropy_matches_numpy_with_ignore_index():
    logits = rng.standard_normal((6, 5))
    target = np.array([1, 4, -100, 0, 2, -100])
    loss = F.cross_entropy(Tensor(logits), Tensor(target))
    lp = np_log_softmax(logits)
    valid = target != -100
    want = -lp[np.arange(6)[valid], target[valid]].mean()
    np.testing.assert_allclose(loss.numpy(), want, rtol=1e-12)
    fd_check(lambda x: F.cross_entropy(x, Tensor(target)), [logits])
    np.testing.assert_allclose(F.cross_entropy(Tensor(logits), Tensor(target),
                                               reduction="sum").numpy(), want * valid.sum())
    none = F.cross_entropy(Tensor(logits), Tensor(target), reduction="none").numpy()
    assert none.shape == (6,) and none[2] == 0.0


def test_cross_entropy_class_dim_1():
    logits = rng.standard_normal((2, 5, 3))  # (N, C, d1)
    target = rng.integers(0, 5, (2, 3))
    got = F.cross_entropy(Tensor(logits), Tensor(target)).numpy()
    lp = np_log_softmax(logits.transpose(0, 2, 1))
    want = -np.take_along_axis(lp, target[..., None], -1).mean()
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_cross_entropy_errors():
    with pytest.raises(ValueError, match=r"target shape \(3,\).*\(4,\)"):
        F.cross_entropy(dtensor.ones(4, 5), Tensor(np.zeros(3, np.int64)))
    with pytest.raises(TypeError, match="integers"):
        F.cross_entropy(dtensor.ones(4, 5), dtensor.ones(4))
    for bad in (-2, 5):  # -100 is the ignore_index; -2 must not wrap round to class 3
        with pytest.raises(IndexError, match=rf"target {bad} is out of range for 5 classes"):
            F.cross_entropy(dtensor.ones(4, 5), Tensor(np.array([0, 1, bad, 2])))


@pytest.mark.parametrize("L,S", [(0, 5), (3, 0), (0, 0)])
def test_causal_attention_with_no_queries_or_keys(L, S):
    out = F.scaled_dot_product_attention(dtensor.ones(2, L, 4), dtensor.ones(2, S, 4),
                                         dtensor.ones(2, S, 4), is_causal=True)
    assert out.shape == (2, L, 4)


def np_sdpa(q, k, v, mask=None, causal=False):
    att = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = np.tril(np.ones((q.shape[-2], k.shape[-2]), bool))
    if mask is not None:
        att = np.where(mask, att, -np.inf) if mask.dtype == bool else att + mask
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    return att @ v


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float"])
def test_scaled_dot_product_attention(kind):
    q, k, v = (rng.standard_normal((2, 3, 4, 5)) for _ in range(3))
    mask = {"bool": rng.random((4, 4)) > 0.3, "float": rng.standard_normal((4, 4))}.get(kind)
    if kind == "bool":
        mask[:, 0] = True  # every row attends somewhere
    kwargs = dict(is_causal=kind == "causal")
    if mask is not None:
        kwargs["attn_mask"] = Tensor(mask)
    got = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), **kwargs)
    np.testing.assert_allclose(got.numpy(), np_sdpa(q, k, v, mask, kind == "causal"),
                               rtol=1e-10, atol=1e-12)
    fd_check(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs),
             [q[:1, :2], k[:1, :2], v[:1, :2]])


def test_layer_norm_and_rms_norm():
    x, w, b = rng.standard_normal((3, 4, 6)), rng.standard_normal(6), rng.standard_normal(6)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    want = (x - mu) / np.sqrt(var + 1e-5) * w + b
    np.testing.assert_allclose(F.layer_norm(Tensor(x), 6, Tensor(w), Tensor(b)).numpy(), want,
                               rtol=1e-10)
    fd_check(lambda a, c, d: F.layer_norm(a, (6,), c, d), [x[:2, :2], w, b])
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(F.rms_norm(Tensor(x), 6, Tensor(w), 1e-6).numpy(), want,
                               rtol=1e-10)
    fd_check(lambda a, c: F.rms_norm(a, 6, c, 1e-6), [x[:2, :2], w])
    with pytest.raises(ValueError, match=r"\(5,\).*\(3, 4, 6\)"):
        F.layer_norm(Tensor(x), 5)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_layer_norm_of_a_constant_row_is_zero_and_its_gradient_too(dtype):
    # The row's mean must be the value itself (a sum times a rounded 1/n is not).
    x = Tensor(np.full((2, 1000), 3.0, dtype), requires_grad=True)
    y = F.layer_norm(x, (1000,))
    np.testing.assert_array_equal(y.numpy(), 0)
    g = np.linspace(-1.0, 1.0, 2000).reshape(2, 1000)
    (y * Tensor(g.astype(dtype))).sum().backward()
    # the gradient of a constant row: rstd * (g - mean(g)), xhat = 0
    want = (g - g.mean(-1, keepdims=True)) / np.sqrt(1e-5)
    tol = {"rtol": 1e-2, "atol": 0.5} if dtype == np.float16 else {"rtol": 1e-4, "atol": 1e-3}
    np.testing.assert_allclose(x.grad.numpy(), want, **tol)  # (|want| up to ~316)


@pytest.mark.parametrize("dtype,spread,gscale,tol", [(np.float16, 30.0, 300.0, 4e-3),
                                                      (np.float32, 1e16, 1.0, 1e-6)])
def test_layer_norm_gradient_of_wide_rows(dtype, spread, gscale, tol):
    # float16: g . (x - mean) overflows (~1e5) though the forward's sum of squares does not;
    # float32: rstd^3 underflows for rows of spread 1e16. The backward works in at least
    # float32 and scales by rstd one factor at a time. Against the float64 gradient, to the
    # type's rounding of g's scale times rstd.
    x0 = np.linspace(-spread, spread, 256).reshape(2, 128) * np.array([[1.0], [0.5]])
    g = gscale * np.linspace(-1, 1, 256).reshape(2, 128) + np.cos(np.arange(256.0)).reshape(2, 128)
    grads = []
    for dt in (dtype, np.float64):
        x = Tensor(x0.astype(dt), requires_grad=True)
        (F.layer_norm(x, (128,)) * Tensor(g.astype(dt))).sum().backward()
        grads.append(x.grad.numpy().astype(np.float64))
    assert np.isfinite(grads[0]).all()
    np.testing.assert_allclose(grads[0], grads[1],
                               atol=tol * np.abs(g).max() / x0.std(axis=-1).min())


def test_activations():
    x = 3 * rng.standard_normal((4, 5))
    np.testing.assert_allclose(F.relu(Tensor(x)).numpy(), np.maximum(x, 0))
    np.testing.assert_allclose(F.gelu(Tensor(x)).numpy(), 0.5 * x * (1 + _erf(x / math.sqrt(2))),
                               atol=3e-7)
    np.testing.assert_allclose(F.silu(Tensor(x)).numpy(), x / (1 + np.exp(-x)), rtol=1e-12)
    fd_check(F.silu, [x.copy()])
    fd_check(F.relu, [x.copy()])
    sm = F.softmax(Tensor(x), dim=0).numpy()
    np.testing.assert_allclose(sm, np.exp(x) / np.exp(x).sum(0, keepdims=True), rtol=1e-12)
    fd_check(lambda a: F.softmax(a, 0), [x.copy()])
    with pytest.raises(ValueError, match="'fast'"):
        F.gelu(Tensor(x), approximate="fast")


def test_linear_and_embedding():
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)
    np.testing.assert_allclose(F.linear(Tensor(x), Tensor(w), Tensor(b)).numpy(), x @ w.T + b,
                               rtol=1e-12)
    fd_check(F.linear, [x, w, b])
    idx = np.array([[0, 3, 3], [1, 0, 2]])
    table = rng.standard_normal((4, 3))
    np.testing.assert_array_equal(F.embedding(Tensor(idx), Tensor(table)).numpy(), table[idx])
    fd_check(lambda t: F.embedding(Tensor(idx), t), [table])  # repeated rows accumulate
    with pytest.raises(ValueError, match=r"4 features.*expects 5"):
        F.linear(Tensor(x), Tensor(rng.standard_normal((2, 5))))
    with pytest.raises(IndexError, match="7"):
        F.embedding(Tensor(np.array([7])), Tensor(table))


def test_dropout_is_counter_based_and_unbiased():
    x = dtensor.ones(200, 500)
    dtensor.manual_seed(3)
    y = F.dropout(x, p=0.25).numpy()
    assert set(np.unique(y)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.01
    dtensor.manual_seed(3)
    np.testing.assert_array_equal(F.dropout(x, p=0.25).numpy(), y)
    # The mask is a pure function of (seed, call, element): element i keeps iff u_i >= p.
    dtensor.manual_seed(3)
    u = dtensor.rand(200, 500).numpy()
    np.testing.assert_array_equal(y != 0, u >= 0.25)
    assert F.dropout(x, 0.5, training=False) is x
    with pytest.raises(ValueError, match="1.5"):
        F.dropout(x, 1.5)
    xg = Tensor(rng.standard_normal((4, 6)), requires_grad=True)
    out = F.dropout(xg, 0.5)
    out.sum().backward()
    np.testing.assert_allclose(xg.grad.numpy(), (out.numpy() != 0) * 2.0)
