"""Registry-wide tests: every op in dtensor.ops.OPS, against an independent numpy reference.

For each op and sample: the value equals a plain-numpy expression written here; the abstract
rule predicts the output's shape and dtype; and, for differentiable ops, the vjp equals float64
central finite differences. An op without an entry in SAMPLES and REFERENCE fails
test_every_op_is_covered, so a new op cannot slip in untested.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import dtensor
from dtensor.ops import OPS, Aval, apply
from dtensor.tensor import _index

rng = np.random.default_rng(1234)


def r(*shape, pos=False):
    a = rng.standard_normal(shape)
    return np.abs(a) + 0.5 if pos else a


def ints(high, *shape):
    return rng.integers(0, high, shape)


def key(k, shape):
    return _index(k, shape)


_erf = np.vectorize(math.erf)


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_attention(q, k, v, scale, causal):
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = np.where(np.tri(s.shape[-2], s.shape[-1], dtype=bool), s, -np.inf)
    return _np_softmax(s) @ v


def _np_attention_backward(g, q, k, v, scale, causal):
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = np.where(np.tri(s.shape[-2], s.shape[-1], dtype=bool), s, -np.inf)
    p = _np_softmax(s)
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return np.stack([ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale,
                     np.swapaxes(p, -1, -2) @ g])


def _np_log_softmax(x):
    s = x - x.max(-1, keepdims=True)
    return s - np.log(np.exp(s).sum(-1, keepdims=True))


def _np_gelu(x, approximate):
    if approximate == "none":
        return 0.5 * x * (1 + _erf(x / math.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_grad_args(approximate):
    """(g, x, y = gelu(x)): gelu_backward reads the forward's output; x holds a 0."""
    x = 2 * r(4, 5)
    x[0, 0] = 0.0
    return r(4, 5), x, _np_gelu(x, approximate)


def _np_gelu_grad(g, x, approximate):
    h = 1e-6
    return g * (_np_gelu(x + h, approximate) - _np_gelu(x - h, approximate)) / (2 * h)


def _np_normalize(x, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def _fd_vjp(f, g, x, h=1e-6):
    """g^T J_f(x) by central differences of a plain-numpy f."""
    out = np.zeros_like(x)
    for pos in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[pos] += h
        xm[pos] -= h
        out[pos] = np.sum(g * (f(xp) - f(xm))) / (2 * h)
    return out


def _np_adamw(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2):
    m2 = beta1 * m + (1 - beta1) * g
    v2 = beta2 * v + (1 - beta2) * g * g
    p2 = p * (1 - lr * weight_decay) - lr / bc1 * m2 / (np.sqrt(v2) / np.sqrt(bc2) + eps)
    return np.stack([p2, m2, v2])


def _np_getitem(x, key):
    return x[tuple(slice(*k) if isinstance(k, tuple) else k for k in key)]


def _np_slice_scatter(g, shape, key):
    out = np.zeros(shape, g.dtype)
    out[tuple(slice(*k) if isinstance(k, tuple) else k for k in key)] = g
    return out


def _np_index_add(g, idx, like):
    out = np.zeros((like.shape[0],) + g.shape[idx.ndim:], g.dtype)
    for pos in np.ndindex(*idx.shape):
        out[idx[pos]] += g[pos]
    return out


def _np_scatter_add(g, idx, like, axis):
    shape = list(g.shape)
    shape[axis] = like.shape[axis]
    out = np.zeros(shape, g.dtype)
    for pos in np.ndindex(*idx.shape):
        tgt = list(pos)
        tgt[axis] = idx[pos]
        out[tuple(tgt)] += g[pos]
    return out


def _np_philox_uniform(key, n):
    return dtensor.random.rand(key, np.arange(n, dtype=np.int64))


def _np_philox_normal(key, n):
    return dtensor.random.randn(key, np.arange(n, dtype=np.int64))


def _np_cumsum(x, axis, reverse):
    """Running sums as a product with a triangle of ones."""
    n = x.shape[axis]
    tri = np.tril(np.ones((n, n))) if reverse else np.triu(np.ones((n, n)))
    return np.moveaxis(np.moveaxis(x, axis, -1) @ tri, -1, axis)


def _np_triangle(x, diagonal, lower):
    rows, cols = np.arange(x.shape[-2])[:, None], np.arange(x.shape[-1])[None, :]
    keep = cols - rows <= diagonal if lower else cols - rows >= diagonal
    return np.where(keep, x, 0.0)


def _np_repeat_interleave(x, repeats, axis):
    copies = np.stack([x] * repeats, axis=axis + 1)
    shape = list(x.shape)
    shape[axis] *= repeats
    return copies.reshape(shape)


BIN = [((r(3, 4), r(3, 4)), {}), ((r(3, 4), r(4)), {}), ((r(2, 1, 4), r(3, 1)), {}),
       ((r(3, 4), 2.5), {}), ((1.5, r(3,)), {})]
CMP = [((r(3, 4), r(4)), {}), ((r(3, 4), 0.0), {})]
U = [((r(3, 4),), {})]

_WIDE = 30 * r(4, 9)  # rows of a large spread, less their max: exps from 1 down to 0
SAMPLES = {
    "add": BIN, "sub": BIN, "mul": BIN, "maximum": BIN[:3],
    "div": [((r(3, 4), r(3, 4, pos=True)), {}), ((r(2, 3), r(3, pos=True)), {}),
            ((2.0, r(4, pos=True)), {})],
    "pow": [((r(3, 4, pos=True), r(3, 4)), {}), ((r(3, 4, pos=True), 3.0), {}),
            ((2.0, r(5)), {}), ((r(2, 3, pos=True), r(3)), {})],
    "neg": U, "exp": U, "tanh": U, "erf": [((2 * r(4, 5),), {})],
    "log": [((r(3, 4, pos=True),), {})], "sqrt": [((r(3, 4, pos=True),), {})],
    "eq": CMP + [((ints(3, 4, 5), ints(3, 5)), {})], "ne": CMP, "lt": CMP, "le": CMP, "gt": CMP,
    "ge": CMP, "logical_not": [((r(3, 4) > 0,), {})],
    "where": [((r(3, 4) > 0, r(3, 4), r(4)), {}), ((r(4) > 0, r(3, 4), 0.0), {}),
              ((r(3, 1) > 0, -1.0, r(3, 4)), {})],
    "cast": [((r(3, 4),), {"dtype": np.dtype(np.float32)}),
             ((r(3, 4),), {"dtype": np.dtype(np.float64)})],
    "sum": [((r(3, 4, 5),), {"axis": (1,), "keepdims": False}),
            ((r(3, 4, 5),), {"axis": (0, 2), "keepdims": True}),
            ((r(3, 4),), {"axis": (0, 1), "keepdims": False})],
    "max": [((r(3, 4, 5),), {"axis": (2,), "keepdims": False}),
            ((r(3, 4, 5),), {"axis": (0, 1), "keepdims": True}),
            ((r(6),), {"axis": (0,), "keepdims": False})],
    "reshape": [((r(3, 4),), {"shape": (2, 6)}), ((r(2, 3, 4),), {"shape": (6, 4)}),
                ((r(1, 3, 4),), {"shape": (3, 4)})],  # a batch of one
    "permute": [((r(2, 3, 4),), {"axes": (2, 0, 1)}), ((r(3, 4),), {"axes": (1, 0)})],
    "broadcast_to": [((r(3, 1),), {"shape": (2, 3, 4)}), ((r(4),), {"shape": (3, 4)})],
    "getitem": [((r(4, 5),), {"key": key((1, slice(1, 4)), (4, 5))}),
                ((r(4, 5),), {"key": key((slice(None, None, 2),), (4, 5))}),
                ((r(2, 3, 4),), {"key": key((Ellipsis, -1), (2, 3, 4))}),
                ((r(3, 4),), {"key": key((None, slice(1, 3)), (3, 4))})],
    "slice_scatter": [((r(2, 3),), {"shape": (4, 5), "key": key((slice(1, 3), slice(0, 3)),
                                                                (4, 5))}),
                      ((r(5),), {"shape": (4, 5), "key": key((2,), (4, 5))})],
    "cat": [((r(2, 3), r(4, 3)), {"axis": 0}), ((r(2, 3), r(2, 1), r(2, 2)), {"axis": 1})],
    "matmul": [((r(3, 4), r(4, 5)), {}), ((r(2, 3, 4), r(4, 5)), {}),
               ((r(2, 1, 3, 4), r(3, 4, 2)), {})],
    # (rows named more than once: index_add sums them; negative indices are errors,
    # tests/test_numerics.py)
    "index_select": [((r(6, 3), ints(6, 2, 4)), {}), ((r(5, 2, 2), ints(5, 7)), {}),
                     ((r(6, 3), np.array([[5, 5, 0], [0, 2, 5]])), {})],
    "index_add": [((r(2, 4, 3), ints(6, 2, 4), r(6, 3)), {}),
                  ((r(7,), ints(3, 7), r(3)), {}),
                  ((r(2, 3, 3), np.array([[5, 5, 0], [0, 2, 5]]), r(6, 3)), {}),
                  ((r(4, 2), np.array([0, 255, 255, 7], np.uint8), r(256, 2)), {})],
    "gather": [((r(4, 6), ints(6, 4, 2)), {"axis": 1}), ((r(4, 6), ints(6, 4, 1)), {"axis": 1}),
               ((r(5, 3), ints(5, 2, 3)), {"axis": 0})],
    "scatter_add": [((r(4, 3), ints(6, 4, 3), r(4, 6)), {"axis": 1}),
                    ((r(4, 1), ints(6, 4, 1), r(4, 6)), {"axis": 1})],
    "cos": U, "sin": U, "abs": U, "rsqrt": [((r(3, 4, pos=True),), {})],
    "sigmoid": [((3 * r(3, 4),), {}), ((np.array([-800.0, -30.0, -1e-3, 0.0, 2.0, 40.0]),), {})],
    "clamp": [((r(3, 4), -0.5, 0.7), {}), ((r(3, 4), r(4), r(3, 1) + 0.5), {}),
              ((r(3, 4), 0.5, -0.5), {}),  # min > max: every entry is max, as torch
              ((r(3, 4), -math.inf, 0.2), {})],
    "argmax": [((r(3, 4, 5),), {"axis": 1, "keepdims": False}),
               ((r(3, 4),), {"axis": 0, "keepdims": True}),
               ((ints(3, 4, 6),), {"axis": 1, "keepdims": False})],  # ties: the first
    "cumsum": [((r(3, 4, 5),), {"axis": 1, "reverse": False}),
               ((r(3, 5),), {"axis": 1, "reverse": True})],
    "repeat_interleave": [((r(3, 4),), {"repeats": 2, "axis": 1}),
                          ((r(2, 3, 2),), {"repeats": 3, "axis": 0})],
    "group_sum": [((r(3, 8),), {"repeats": 2, "axis": 1}),
                  ((r(6, 3, 2),), {"repeats": 3, "axis": 0})],
    "tril": [((r(4, 5),), {"diagonal": 0}), ((r(2, 3, 4),), {"diagonal": -1}),
             ((r(3, 5),), {"diagonal": 2})],
    "triu": [((r(4, 5),), {"diagonal": 0}), ((r(2, 3, 4),), {"diagonal": 1}),
             ((r(5, 3),), {"diagonal": -2})],
    "rand": [((np.empty((3, 4)),), {"key": 123, "dtype": np.dtype(np.float32)})],
    "randn": [((np.empty((5, 3)),), {"key": 2 ** 40 + 7, "dtype": np.dtype(np.float64)})],
    "gelu": [((2 * r(4, 5),), {"approximate": "none"}), ((2 * r(4, 5),), {"approximate": "tanh"})],
    "gelu_backward": [(_gelu_grad_args(a), {"approximate": a}) for a in ("none", "tanh")],
    "softmax": [((r(3, 5),), {"causal": False}), ((3 * r(2, 3, 7),), {"causal": False}),
                ((3 * r(2, 4, 4),), {"causal": True}), ((r(3, 5),), {"causal": True})],
    "softmax_backward": [((r(3, 5), _np_softmax(r(3, 5))), {})],
    "log_softmax": [((r(3, 5),), {}), ((3 * r(2, 3, 7),), {})],
    "log_softmax_backward": [((r(3, 5), _np_log_softmax(r(3, 5))), {})],
    "sum_exp": [((3 * r(5, 7), 3 * r(5, 1)), {}), ((r(2, 3, 4), r(2, 3, 1)), {}),
                ((_WIDE, _WIDE.max(-1, keepdims=True)), {}),
                ((r(3, 0), r(3, 1)), {})],
    "softmax_cross_entropy": [((3 * r(5, 7), ints(7, 5)), {}), ((r(2, 3, 4), ints(4, 2, 3)), {})],
    "softmax_cross_entropy_backward": [((r(5), 3 * r(5, 7), ints(7, 5)), {}),
                                       ((r(2, 3), r(2, 3, 4), ints(4, 2, 3)), {})],
    "normalize": [((3 * r(4, 6) + 1,), {"eps": 1e-5}), ((r(2, 3, 5),), {"eps": 0.1})],
    "normalize_backward": [((r(4, 6), 3 * r(4, 6) + 1), {"eps": 1e-5})],
    "attention": [((r(2, 5, 3), r(2, 5, 3), r(2, 5, 3)), {"scale": 0.7, "causal": True}),
                  ((r(4, 3), r(4, 3), r(4, 3)), {"scale": 0.5, "causal": False})],
    "attention_backward": [((r(2, 5, 3), r(2, 5, 3), r(2, 5, 3), r(2, 5, 3)),
                            {"scale": 0.7, "causal": True})],
    "adamw_step": [((r(3, 4), r(3, 4), r(3, 4), r(3, 4, pos=True)),
                    dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                         bc1=1 - 0.9 ** 3, bc2=1 - 0.99 ** 3))],
}

REFERENCE = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "maximum": np.maximum, "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "tanh": np.tanh, "erf": _erf, "eq": np.equal, "ne": np.not_equal, "lt": np.less,
    "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "logical_not": np.logical_not,
    "where": np.where, "cast": lambda x, dtype: x.astype(dtype),
    "sum": lambda x, axis, keepdims: x.sum(axis=axis, keepdims=keepdims),
    "max": lambda x, axis, keepdims: x.max(axis=axis, keepdims=keepdims),
    "reshape": lambda x, shape: x.reshape(shape),
    "permute": lambda x, axes: x.transpose(axes),
    "broadcast_to": lambda x, shape: np.broadcast_to(x, shape),
    "getitem": _np_getitem, "slice_scatter": _np_slice_scatter,
    "cat": lambda *xs, axis: np.concatenate(xs, axis),
    "matmul": lambda x, y: np.einsum("...ij,...jk->...ik", x, y),
    "index_select": lambda w, idx: w[idx], "index_add": _np_index_add,
    "gather": lambda x, idx, axis: np.take_along_axis(x, idx, axis),
    "scatter_add": _np_scatter_add,
    "cos": np.cos, "sin": np.sin, "abs": np.fabs, "rsqrt": lambda x: x ** -0.5,
    "sigmoid": lambda x: np.exp(-np.logaddexp(0.0, -x)),
    "clamp": np.clip,
    "argmax": lambda x, axis, keepdims: np.argmax(x, axis, keepdims=keepdims),
    "cumsum": _np_cumsum, "repeat_interleave": _np_repeat_interleave,
    "group_sum": lambda g, repeats, axis: np.add.reduceat(
        g, np.arange(0, g.shape[axis], repeats), axis=axis),
    "tril": lambda x, diagonal: _np_triangle(x, diagonal, True),
    "triu": lambda x, diagonal: _np_triangle(x, diagonal, False),
    "rand": lambda like, key, dtype: _np_philox_uniform(key, like.size).reshape(
        like.shape).astype(dtype),
    "randn": lambda like, key, dtype: _np_philox_normal(key, like.size).reshape(
        like.shape).astype(dtype),
    "gelu": _np_gelu,
    "gelu_backward": lambda g, x, y, approximate: _np_gelu_grad(g, x, approximate),
    "softmax": lambda x, causal: _np_softmax(
        np.where(np.tri(*x.shape[-2:], dtype=bool), x, -np.inf) if causal else x),
    "log_softmax": _np_log_softmax,
    "softmax_backward": lambda g, y: y * (g - (g * y).sum(-1, keepdims=True)),
    "log_softmax_backward": lambda g, lp: g - np.exp(lp) * g.sum(-1, keepdims=True),
    "sum_exp": lambda x, m: np.exp(x - m).sum(-1),
    "softmax_cross_entropy": lambda x, t: -np.take_along_axis(
        _np_log_softmax(x), t[..., None], -1)[..., 0],
    "softmax_cross_entropy_backward": lambda g, x, t: g[..., None] * (
        _np_softmax(x) - (np.arange(x.shape[-1]) == t[..., None])),
    "normalize": _np_normalize,
    "normalize_backward": lambda g, x, eps: _fd_vjp(lambda a: _np_normalize(a, eps), g, x),
    "adamw_step": _np_adamw,
    "attention": _np_attention, "attention_backward": _np_attention_backward,
}

# erf/GELU use polynomial fits (|error| < 1.5e-7), so compare them a little more loosely.
TOL = {"erf": 3e-7, "gelu": 3e-7, "gelu_backward": 1e-6, "normalize_backward": 1e-7}

CASES = [(name, i) for name in sorted(SAMPLES) for i in range(len(SAMPLES[name]))]


def _wrap(args, op):
    return [dtensor.Tensor(a) if isinstance(a, np.ndarray) else a for a in args]


def test_every_op_is_covered():
    missing = sorted(set(OPS) - set(SAMPLES) | set(OPS) - set(REFERENCE))
    assert not missing, f"ops without registry tests (add SAMPLES and REFERENCE): {missing}"
    # (61 with attention and its backward, direct rules for issue 21's fused kernel)
    assert 25 <= len(OPS) <= 64, f"the primitive set should stay small; it has {len(OPS)}"


@pytest.mark.parametrize("name,i", CASES)
def test_value_and_abstract(name, i):
    op = OPS[name]
    args, params = SAMPLES[name][i]
    out = apply(op, *_wrap(args, op), **params)
    expect = np.asarray(REFERENCE[name](*args, **params))
    tol = TOL.get(name, 1e-12)
    assert out.shape == expect.shape
    if name in ("rand", "randn"):
        np.testing.assert_array_equal(out.numpy(), expect)
    else:
        np.testing.assert_allclose(out.numpy(), expect, rtol=tol, atol=tol)
    avals = [Aval(a.shape, a.dtype) if isinstance(a, np.ndarray) else a for a in args]
    assert op.abstract(*avals, **params) == Aval(out.shape, out.dtype)


def _numeric_grad(op, args, params, which, g, eps=1e-6):
    base = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    x = base[which]
    grad = np.zeros_like(x, dtype=np.float64)
    for pos in np.ndindex(*np.shape(x)):
        old = x[pos]
        x[pos] = old + eps
        hi = np.sum(apply(op, *_wrap(base, op), **params).numpy().astype(np.float64) * g)
        x[pos] = old - eps
        lo = np.sum(apply(op, *_wrap(base, op), **params).numpy().astype(np.float64) * g)
        x[pos] = old
        grad[pos] = (hi - lo) / (2 * eps)
    return grad


GRAD_CASES = [(n, i) for n, i in CASES if OPS[n].vjp is not None]


@pytest.mark.parametrize("name,i", GRAD_CASES)
def test_vjp_matches_finite_differences(name, i):
    op = OPS[name]
    args, params = SAMPLES[name][i]
    diff = [k for k, a in enumerate(args) if isinstance(a, np.ndarray) and
            a.dtype == np.float64 and k not in op.nondiff]
    assert diff, f"{name} sample {i} has no differentiable input"
    tensors = [dtensor.Tensor(a, requires_grad=k in diff) if isinstance(a, np.ndarray) else a
               for k, a in enumerate(args)]
    out = apply(op, *tensors, **params)
    g = rng.standard_normal(out.shape)
    out.backward(dtensor.Tensor(g.astype(out.dtype)))
    # float32 outputs (cast) are differentiated with a larger step and a looser tolerance.
    lossy = out.dtype != np.float64
    for k in diff:
        num = _numeric_grad(op, args, params, k, g, eps=1e-3 if lossy else 1e-6)
        got = tensors[k].grad
        assert got.dtype == args[k].dtype and got.shape == args[k].shape
        tol = 1e-3 if lossy else 1e-5
        np.testing.assert_allclose(got.numpy(), num, rtol=tol, atol=tol,
                                   err_msg=f"{name} sample {i}, input {k}")


def test_max_ties_share_the_gradient():
    x = dtensor.tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]]), requires_grad=True)
    x.max(axis=1).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[0, 0.5, 0.5], [0.5, 0, 0.5]])


# The direct-rule nn ops against the composites of primitives they replace: values and grads.
_TARGETS = ints(6, 3, 4)
_M = np.full((3, 4, 1), 2.0)
COMPOSITES = {
    "gelu": (lambda x: dtensor.nn.functional.gelu(x),
             lambda x: 0.5 * x * (1.0 + (x * (1 / math.sqrt(2))).erf())),
    "gelu_tanh": (lambda x: dtensor.nn.functional.gelu(x, "tanh"),
                  lambda x: 0.5 * x * (1.0 + (math.sqrt(2 / math.pi) *
                                              (x + 0.044715 * x * x * x)).tanh())),
    "softmax": (lambda x: dtensor.nn.functional.softmax(x, -1),
                lambda x: (x - x.max(-1, keepdims=True)).exp() /
                (x - x.max(-1, keepdims=True)).exp().sum(-1, keepdims=True)),
    "log_softmax": (lambda x: dtensor.nn.functional.log_softmax(x, 1),
                    lambda x: x - x.max(1, keepdims=True) -
                    (x - x.max(1, keepdims=True)).exp().sum(1, keepdims=True).log()),
    "sum_exp": (lambda x: OPS["sum_exp"](x, dtensor.Tensor(_M)),
                lambda x: (x - dtensor.Tensor(_M)).exp().sum(-1)),
    "softmax_cross_entropy": (
        lambda x: OPS["softmax_cross_entropy"](x, dtensor.Tensor(_TARGETS)),
        lambda x: -OPS["gather"](dtensor.nn.functional.log_softmax(x, -1),
                                 dtensor.Tensor(_TARGETS[..., None]), axis=2).squeeze(-1)),
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_direct_rule_equals_composite(name):
    direct, composite = COMPOSITES[name]
    x0 = 2 * r(3, 4, 6)
    results = []
    for f in (direct, composite):
        x = dtensor.Tensor(x0, requires_grad=True)
        y = f(x)
        y.backward(dtensor.Tensor(np.linspace(-1, 2, math.prod(y.shape)).reshape(y.shape)))
        results.append((y.numpy(), x.grad.numpy()))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_gelu_at_the_ends_of_the_line(dtype):
    # GELU(x) -> x as x -> inf and -> 0 as x -> -inf; NaN stays NaN.
    x = np.array([np.inf, -np.inf, np.nan, 6e4, -6e4, 30.0, -40.0], dtype)
    with np.errstate(over="ignore"):
        y = OPS["gelu"].impl(x, approximate="none")
    np.testing.assert_array_equal(y, np.array([np.inf, 0, np.nan, 6e4, 0, 30.0, 0], dtype))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_backward_near_zero(approximate, dtype):
    # gelu_backward divides the forward's output by x: at and near 0 the slope must still be
    # GELU's, 1/2 + O(x).
    x = np.array([0.0, 1e-38, -1e-35, 1e-30, -1e-20, 1e-7, -3e-4, 2.5], dtype)
    y = apply(OPS["gelu"], dtensor.Tensor(x), approximate=approximate)
    g = apply(OPS["gelu_backward"], dtensor.Tensor(np.ones_like(x)), dtensor.Tensor(x), y,
              approximate=approximate)
    expect = _np_gelu_grad(np.ones(x.size), x.astype(np.float64), approximate)
    np.testing.assert_allclose(g.numpy(), expect, rtol=2e-6, atol=1e-6)


_BLOCKED = {  # the cache-blocked kernels (dtensor/ops/blockwise.py), on arrays of 7 x 5 x 11
    "erf": lambda x, t: [x],
    "gelu": lambda x, t: [x],
    "gelu_backward": lambda x, t: [x[::-1].copy(), x, x * 0.5],
    "softmax": lambda x, t: [x.reshape(5, 7, 11)[:, :, :7].copy()],
    "softmax_backward": lambda x, t: [x, np.abs(x)],
    "log_softmax": lambda x, t: [x],
    "log_softmax_backward": lambda x, t: [x, -np.abs(x)],
    "normalize": lambda x, t: [x],
    "normalize_backward": lambda x, t: [x[::-1].copy(), x],
    "sum_exp": lambda x, t: [x, x.max(-1, keepdims=True)],
    "softmax_cross_entropy": lambda x, t: [x, t],
    "softmax_cross_entropy_backward": lambda x, t: [x[..., 0], x, t],
    "adamw_step": lambda x, t: [x, x[::-1].copy(), 0.1 * x, x * x],
}
_PARAMS = {"gelu": {"approximate": "none"}, "gelu_backward": {"approximate": "none"},
           "normalize": {"eps": 1e-5}, "normalize_backward": {"eps": 1e-5},
           "adamw_step": dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                              bc1=0.19, bc2=0.002)}


@pytest.mark.parametrize("name,causal", [(n, False) for n in sorted(_BLOCKED)] +
                         [("softmax", True)])
def test_blocked_kernels_do_not_depend_on_the_block_size(name, causal, monkeypatch):
    # Run in one block and in blocks of a few elements, rows or matrices, each size leaving
    # an uneven last block: the row offsets (cross-entropy's targets, causal matrices) must
    # line up in every block.
    from dtensor.ops import blockwise
    rng = np.random.default_rng(11)
    x = rng.standard_normal((7, 5, 11)).astype(np.float32)
    args = _BLOCKED[name](x, rng.integers(0, 11, (7, 5)))
    params = dict(_PARAMS.get(name, {}), **({"causal": causal} if name == "softmax" else {}))
    results = []
    for block in (1 << 40, 24, 100, 400):
        monkeypatch.setattr(blockwise, "_BLOCK_BYTES", block)
        results.append(OPS[name].impl(*args, **params))
    # To float32 rounding of O(1) terms: BLAS's row sums may associate differently per block.
    for got in results[1:]:
        np.testing.assert_allclose(got, results[0], rtol=1e-5, atol=1e-6)


def test_float32_stays_float32():
    x = dtensor.randn(4, 8)
    w = dtensor.randn(3, 8, requires_grad=True)
    y = dtensor.nn.functional.gelu(dtensor.nn.functional.linear(x, w) * 2.0 + 1).sum()
    y.backward()
    assert y.dtype == np.float32 and w.grad.dtype == np.float32
