"""Every kernel kind (fused pointwise groups, row groups, row-wise ops joined by their pointwise
neighbours, attention, draws, index_add, the AdamW group), forward and backward, compiled on
every backend (numpy, C, Triton under its interpreter) against eager, on inputs that reach the
tails: values up to |x| = 10 through GELU and exp-based ops, rows whose entries spread over 1e3.

The tolerance comes from float32 rounding: eager (float32) and a kernel compute the same formula
with different rounding, so each is within a few roundings of the float64 result. A kernel
passes where its error against float64 is at most twice eager's own plus k eps times the
result's scale (k = 16: up to ~8 roundings on a path, each within an ulp, the C exp within 3),
plus how far 16 roundings of the values the kernel reads move the result (measured in float64
on nudged inputs): where a result is a difference of larger terms, a rounding anywhere before
the difference is amplified, in eager and kernel alike.

For pointwise results both are taken element by element. For row results they are taken over
the row, twice the largest: a row's sums and cancellations put the error of intermediates
larger than the result into every element (a softmax backward's g - sum(g y) is near 0 where
both terms are near 2, and an ulp of the forward's y moves it by 4 ulp of 1), so the scale is
the row's largest |value| among the forward result and the gradients through those rows. A
kernel whose formula drifted (a 4% GELU at x = -5, a 0 for 7.7e-23 at -10) fails by orders of
magnitude.
"""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor.ops import OPS, apply

EPS = 2.0 ** -24
BACKENDS = ["numpy", "c", "triton"]


def _x(*shape, seed=0, spread=10.0):
    return np.random.default_rng(seed).uniform(-spread, spread, shape).astype(np.float32)


def _grads(f, params):
    """f's outputs and the gradients of the sum of their squares (so backwards run too)."""
    def run(*ts):
        for k in params:
            ts[k].requires_grad = True
        ys = f(*ts)
        loss = sum((y * y).sum() for y in ys)
        return tuple(ys) + tuple(dtensor.autograd.grad(loss, [ts[k] for k in params]))
    return run


def _rms(x, w):
    return (x * (((x * x).mean(-1, keepdims=True) + 1e-6).rsqrt()) * w,)


def _flash(q, k, v, **kw):
    with F.sdpa_kernel("flash"):  # the attention op and its kernels
        return F.scaled_dot_product_attention(q, k, v, **kw)


GROUPS = {  # id: (function of tensors, inputs, differentiated inputs, row results?)
    "gelu_chain": (lambda x, w, b: (F.gelu(x * w + b),),
                   lambda: [_x(6, 64), _x(64, seed=1, spread=1.0), _x(64, seed=2)], (0, 1), False),
    "gelu_tanh_chain": (lambda x, b: (F.gelu(x + b, approximate="tanh") * 0.5,),
                        lambda: [_x(6, 64), _x(64, seed=2)], (0,), False),
    "swiglu": (lambda x, y: (F.silu(x) * y,), lambda: [_x(6, 64), _x(6, 64, seed=1)], (0, 1),
               False),
    "erf_exp_tanh": (lambda x: ((x * 0.5).erf() + (x * -0.3).exp() * x.tanh(),),
                     lambda: [_x(6, 64)], (0,), False),
    "rms_norm": (_rms, lambda: [_x(6, 64, spread=1e3), _x(64, seed=1, spread=2.0)], (0, 1), True),
    "layer_norm": (lambda x, w, b: (F.layer_norm(x, (64,), w, b),),
                   lambda: [_x(6, 64, spread=1e3) + 50.0, _x(64, seed=1, spread=2.0),
                            _x(64, seed=2)], (0, 1, 2), True),
    "softmax_scaled": (lambda x, m: (F.softmax(x * 0.7, -1) * m,),
                       lambda: [_x(6, 64), _x(6, 64, seed=1)], (0,), True),
    "causal_attention_probs": (lambda x: (apply(OPS["softmax"], x * 1.0, causal=True),),
                               lambda: [_x(2, 16, 16)], (0,), True),
    "causal_attention": (lambda q, k, v: (_flash(q, k, v, is_causal=True),),
                         lambda: [_x(2, 3, 20, 8, spread=2.0), _x(2, 3, 20, 8, seed=1, spread=2.0),
                                  _x(2, 3, 20, 8, seed=2)], (0, 1, 2), True),
    "attention": (lambda q, k, v: (_flash(q, k, v) * 2.0,),
                  lambda: [_x(6, 17, 16, spread=2.0), _x(6, 17, 16, seed=1, spread=2.0),
                           _x(6, 17, 16, seed=2)], (0, 1, 2), True),
    # the C kernel reads heads where they lie and writes token-major: (B, T, heads, E)
    # projections transposed in and out, heads cut from one fused qkv projection (rows 3x
    # wider than a head's), five dims with E padded to whole vectors
    "attention_token_major": (
        lambda q, k, v: (_flash(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
                         .transpose(1, 2).reshape(2, 13, 48),),
        lambda: [_x(2, 13, 3, 16, spread=2.0), _x(2, 13, 3, 16, seed=1, spread=2.0),
                 _x(2, 13, 3, 16, seed=2)], (0, 1, 2), True),
    "attention_fused_qkv": (
        lambda x: (_flash(*(x.reshape(2, 11, 3, 2, 32)[:, :, j].transpose(1, 2)
                            for j in range(3)), is_causal=True),),
        lambda: [_x(2, 11, 192, spread=2.0)], (0,), True),
    "attention_5d": (lambda q, k, v: (_flash(q, k, v),),
                     lambda: [_x(2, 2, 2, 9, 24, spread=2.0),
                              _x(2, 2, 2, 9, 24, seed=1, spread=2.0),
                              _x(2, 2, 2, 9, 24, seed=2)], (0, 1, 2), True),
    "log_softmax_mix": (lambda x: (F.log_softmax(x, -1) * 0.25 + x,), lambda: [_x(6, 64)],
                        (0,), True),
    "cross_entropy": (lambda x, t: (F.cross_entropy(x, t),),
                      lambda: [_x(12, 64), np.random.default_rng(3).integers(0, 64, 12)], (0,),
                      True),
    "embedding": (lambda w, i: (F.embedding(i, w) * 1.5,),
                  lambda: [_x(20, 16, spread=1.0),
                           np.random.default_rng(4).integers(0, 20, (6, 9))],
                  (0,), False),
}


def _row_max(a):
    return np.broadcast_to(np.abs(a).max(-1, keepdims=True), a.shape)


def _compare(got, want, ref, row, rows, moved):
    scale, err_want = np.abs(ref), np.abs(want.astype(np.float64) - ref)
    if row and ref.ndim:  # a row's error is its intermediates' (sums, cancellations) error
        scale = 2 * np.max([_row_max(r) for r in rows if r.shape == ref.shape], axis=0)
        err_want = 2 * _row_max(err_want)
    bound = 2 * err_want + 16 * EPS * scale + moved + float(np.finfo(np.float32).tiny)
    err_got = np.abs(got - ref)
    bad = np.flatnonzero(~(err_got <= bound))
    assert bad.size == 0, [(float(got.flat[i]), float(ref.flat[i]), float(bound.flat[i]))
                           for i in bad[:5]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(GROUPS))
def test_group_equals_eager_to_float32_rounding(case, backend):
    f, make, params, row = GROUPS[case]
    args = make()
    run = _grads(f, params)
    want = [t.numpy() for t in run(*map(dtensor.Tensor, args))]
    wide = [a.astype(np.float64) if a.dtype == np.float32 else a for a in args]
    ref = [t.numpy() for t in run(*map(dtensor.Tensor, wide))]
    # How far 16 roundings of every value read move each result (cancellation amplifies them:
    # a gradient that is a difference of larger terms), in float64, the largest of 3 draws.
    moved = [np.zeros_like(r) for r in ref]
    for seed in range(3):
        signs = np.random.default_rng(seed)
        nudged = [a * (1 + 16 * EPS * signs.choice([-1.0, 1.0], a.shape)) if a.dtype.kind == "f"
                  else a for a in wide]
        for m, r, o in zip(moved, ref, run(*map(dtensor.Tensor, nudged))):
            np.maximum(m, np.abs(o.numpy() - r), out=m)
    compiled = dtensor.compile(run, backend=backend)
    got = [t.numpy().astype(np.float64) for t in compiled(*map(dtensor.Tensor, args))]
    if backend != "numpy":
        assert any(n.kind == backend for n in compiled.last.graph.nodes), "no kernel generated"
    for g, w, r, m in zip(got, want, ref, moved):
        _compare(g, w, r, row, ref, m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_draws_equal_eager(backend):
    """Dropout's uniform draws bit for bit (the same Philox words), normal draws (Box-Muller
    through each backend's log and cos) to float32 rounding, in kernels of their own and
    fused with their users."""
    x = _x(8, 40)

    def f(a):
        return (F.dropout(a, 0.3), dtensor.randn(8, 40) * a, dtensor.rand(3, 5))

    dtensor.manual_seed(11)
    want = f(dtensor.Tensor(x))
    compiled = dtensor.compile(f, backend=backend)
    dtensor.manual_seed(11)
    got = compiled(dtensor.Tensor(x))
    if backend != "numpy":
        assert any(n.kind == backend for n in compiled.last.graph.nodes)
    np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
    np.testing.assert_array_equal(got[2].numpy(), want[2].numpy())
    # randn: sqrt(-2 log u1) cos(2 pi u2), each call within an ulp or two: 8 eps relative
    np.testing.assert_allclose(got[1].numpy(), want[1].numpy(), rtol=8 * EPS * 2,
                               atol=float(np.finfo(np.float32).tiny))


@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_of_one_and_of_many_parameters(backend):
    """The AdamW group kernel for one parameter and for several, two steps, as eager."""
    from dtensor import nn, optim

    def train(compile_with):
        dtensor.manual_seed(5)
        layers = [nn.Linear(8, 8) for _ in range(2)]
        outs = []
        for params in ([layers[0].weight], [p for m in layers for p in m.parameters()]):
            opt = optim.AdamW(params, lr=0.1, weight_decay=0.1)

            def step(x):
                loss = (layers[1](layers[0](x)) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                return loss

            run = step if compile_with is None else dtensor.compile(step, backend=compile_with)
            for _ in range(2):
                run(dtensor.Tensor(_x(4, 8, spread=1.0)))
            outs.append([p.numpy().copy() for p in params])
        return outs

    for got, want in zip(train(backend), train(None)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=4e-6, atol=1e-7)


@pytest.mark.ranks(2, timeout=300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_draws_inside_a_compiled_function(backend, rank):
    """DTensor draws made inside the compiled function (no traced input: the key is a run-time
    slot) hold the one-process numbers on each rank's block, uniform bit for bit."""
    from dtensor.placements import Shard
    mesh = dtensor.init_device_mesh("cpu", (2,))

    def f(a):
        u = dtensor.rand(6, 8, device_mesh=mesh, placements=[Shard(1)])
        n = dtensor.randn(6, 8, device_mesh=mesh, placements=[Shard(0)])
        return u * a, n

    x = dtensor.distribute_tensor(dtensor.Tensor(_x(6, 8)), mesh, [Shard(1)])
    dtensor.manual_seed(4)
    want = [t.full_tensor().numpy() for t in f(x)]
    compiled = dtensor.compile(f, backend=backend)
    dtensor.manual_seed(4)
    got = [t.full_tensor().numpy() for t in compiled(x)]
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=16 * EPS, atol=1e-30)
    dtensor.manual_seed(4)
    np.testing.assert_array_equal(dtensor.rand(6, 8).numpy() * _x(6, 8), want[0])  # 1 process
