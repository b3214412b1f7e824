"""The ops a Llama-style model needs (issue 19): cos, sin, rsqrt, sigmoid, abs, clamp, argmax,
cumsum, tril/triu, repeat_interleave, stack, outer and einsum, beyond the registry-wide tests
(tests/test_ops.py, test_dtensor_ops.py, test_compile.py): the generated C and Triton kernels of
the pointwise ones, integer inputs, einsum's table of subscripts against np.einsum with
gradients, the error cases, and DTensors on 2 ranks reducing or scanning over a sharded dim."""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_backends import ops_of, three_ways

import dtensor
from dtensor.comm import count_collectives

RNG = np.random.default_rng(19)


def arr(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def fd_grad(f, x, w, eps=1e-6):
    """d sum(f(x) * w) / dx by central differences of a plain-numpy f."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        grad[i] = ((f(x + d) * w).sum() - (f(x - d) * w).sum()) / (2 * eps)
    return grad


# ----------------------------------------------------------------------------- generated kernels

POINTWISE = {
    "cos": lambda x: x.cos(),
    "sin": lambda x: x.sin(),
    "rsqrt": lambda x: (x.abs() + 0.01).rsqrt(),
    "abs": lambda x: x.abs() * 2.0,
    "sigmoid": lambda x: (x * 30.0).sigmoid(),  # past exp's range both ways
    "silu": lambda x: x * x.sigmoid(),
    "clamp": lambda x: x.clamp(-0.5, 0.7),
    "clamp_min": lambda x: x.clamp(min=0.1) + 1.0,
    "clamp_max": lambda x: x.clamp_max(-0.2) * x,
    "clamp min > max": lambda x: x.clamp(0.5, -0.5),
    "rotary": lambda x: x * x.cos() + x.sin() * 0.5,
}


@pytest.mark.parametrize("backend", ["c", "triton"])
def test_pointwise_lowerings_equal_eager(backend):
    """Each new pointwise op's ``lower`` template in a generated C / Triton kernel (fused with
    its neighbours), forward and backward, equals the numpy backend and eager. One compiled
    function holds every case (one C library to build)."""
    def step(x):
        ys = [f(x) for f in POINTWISE.values()]
        grads = dtensor.autograd.grad(sum((y * y).sum() for y in ys), [x])
        return (*ys, *grads)

    x = arr(7, 33)
    x[0, :4] = [0.0, -0.0, 1e-30, -88.0]
    kernels = three_ways(step, x, backend=backend, rtol=2e-6, atol=1e-6)
    ops = " ".join(op for k in kernels for op in ops_of(k))
    for name in ("cos", "sin", "rsqrt", "abs", "sigmoid", "clamp"):
        assert name in ops.split(), f"{name} is in no generated kernel: {ops}"


@pytest.mark.parametrize("backend", ["numpy", "c", "triton"])
def test_structural_ops_compile(backend):
    """argmax, cumsum, tril, repeat_interleave, stack and einsum are extern calls (their
    impls) in every backend; values and gradients as eager."""
    def f(x, y):
        s = dtensor.einsum("bij,bkj->bik", x, y).tril(-1) + dtensor.stack([x, y], 1).sum(1)
        z = s.cumsum(2).repeat_interleave(2, dim=1).sigmoid()
        (gx,) = dtensor.autograd.grad((z * z).sum(), [x])
        return z, z.argmax(-1), gx

    a, b = arr(2, 5, 5), arr(2, 5, 5, seed=1)
    eager = f(*(dtensor.Tensor(v, requires_grad=True) for v in (a, b)))
    got = dtensor.compile(f, backend=backend)(*(dtensor.Tensor(v, requires_grad=True)
                                                for v in (a, b)))
    for g, e in zip(got, eager):
        assert g.dtype == e.dtype
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- dtypes

INT_CASES = [
    ("clamp int", lambda t: t.clamp(min=2), lambda a: np.maximum(a, 2), np.int64),
    ("clamp int both", lambda t: t.clamp(2, 5), lambda a: np.clip(a, 2, 5), np.int64),
    ("clamp int32", lambda t: t.astype(np.int32).clamp(max=3),
     lambda a: np.minimum(a.astype(np.int32), 3), np.int32),
    ("cumsum int", lambda t: t.cumsum(1), lambda a: np.cumsum(a, 1), np.int64),
    ("cumsum bool", lambda t: (t > 3).cumsum(0), lambda a: np.cumsum(a > 3, 0), np.int64),
    ("cumsum float32", lambda t: t.float().cumsum(-1), lambda a: np.cumsum(a, -1), np.float32),
    ("argmax ties", lambda t: t.argmax(1), lambda a: np.argmax(a, 1), np.int64),
    ("argmax flat", lambda t: t.argmax(), lambda a: np.argmax(a), np.int64),
    ("argmax flat keepdim", lambda t: t.argmax(keepdim=True),
     lambda a: np.argmax(a, keepdims=True), np.int64),
    ("abs int", lambda t: t.__sub__(4).abs(), lambda a: np.abs(a - 4), np.int64),
    ("tril int", lambda t: t.tril(), np.tril, np.int64),
    ("repeat_interleave flat", lambda t: t.repeat_interleave(2),
     lambda a: np.repeat(a.reshape(-1), 2), np.int64),
]


@pytest.mark.parametrize("label,call,ref,dtype", INT_CASES, ids=[c[0] for c in INT_CASES])
def test_integer_inputs_keep_torch_dtypes(label, call, ref, dtype):
    a = RNG.integers(0, 8, (4, 6))
    out = call(dtensor.tensor(a))
    want = ref(a)
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_array_equal(out.numpy(), want)


def test_float16_cumsum_accumulates_in_float32():
    # 2000 additions of 0.1 in float16 stall at 256 (its spacing there is 0.25); torch
    # accumulates in float32 and rounds each running sum once.
    x = dtensor.tensor(np.full(2000, 0.1, np.float16))
    got = x.cumsum(0).numpy()
    want = np.cumsum(np.full(2000, 0.1, np.float16).astype(np.float32)).astype(np.float16)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)


def test_sigmoid_abs_and_clamp_gradients_at_the_edges():
    x = dtensor.tensor(np.array([-700.0, -1.0, 0.0, 0.5, 700.0]), requires_grad=True)
    y = x.sigmoid()
    y.sum().backward()
    np.testing.assert_allclose(y.numpy(), 1 / (1 + np.exp(-np.array([-700.0, -1, 0, 0.5, 700]))),
                               rtol=1e-15, atol=0)
    s = y.numpy()
    np.testing.assert_allclose(x.grad.numpy(), s * (1 - s), rtol=1e-15, atol=0)
    x.grad = None
    x.abs().sum().backward()  # sign(x), 0 at 0 (torch's subgradient)
    np.testing.assert_array_equal(x.grad.numpy(), [-1, -1, 0, 1, 1])
    x.grad = None
    x.clamp(-1.0, 0.5).sum().backward()  # a tie goes to x, as torch's
    np.testing.assert_array_equal(x.grad.numpy(), [0, 1, 1, 1, 0])


def test_clamp_tensor_bounds_gradients():
    x, lo, hi = RNG.standard_normal((3, 4)), RNG.standard_normal(4), RNG.standard_normal((3, 1))
    ts = [dtensor.tensor(v, requires_grad=True) for v in (x, lo, hi)]
    w = RNG.standard_normal((3, 4))
    (dtensor.clamp(*ts[:1], min=ts[1], max=ts[2]) * dtensor.tensor(w)).sum().backward()
    for k, v in enumerate((x, lo, hi)):
        def f(a, k=k):
            args = [x, lo, hi]
            args[k] = a
            return np.clip(*args)
        np.testing.assert_allclose(ts[k].grad.numpy(), fd_grad(f, v.copy(), w), atol=1e-8)


# ----------------------------------------------------------------------------- functions

FUNCTIONS = [
    ("cos", lambda m: m.cos(x_()), lambda a: np.cos(a)),
    ("sin", lambda m: m.sin(x_()), lambda a: np.sin(a)),
    ("rsqrt", lambda m: m.rsqrt(m.abs(x_())), lambda a: 1 / np.sqrt(np.abs(a))),
    ("sigmoid", lambda m: m.sigmoid(x_()), lambda a: 1 / (1 + np.exp(-a))),
    ("abs", lambda m: m.abs(x_()), np.abs),
    ("clamp", lambda m: m.clamp(x_(), min=-0.3), lambda a: np.maximum(a, -0.3)),
    ("argmax", lambda m: m.argmax(x_(), 1, keepdim=True), lambda a: np.argmax(a, 1)[:, None]),
    ("cumsum", lambda m: m.cumsum(x_(), dim=0), lambda a: np.cumsum(a, 0)),
    ("tril", lambda m: m.tril(x_(), 1), lambda a: np.tril(a, 1)),
    ("triu", lambda m: m.triu(x_(), diagonal=-1), lambda a: np.triu(a, -1)),
    ("repeat_interleave", lambda m: m.repeat_interleave(x_(), 3, dim=0),
     lambda a: np.repeat(a, 3, 0)),
    ("outer", lambda m: m.outer(x_()[0], x_()[1]), lambda a: np.outer(a[0], a[1])),
    ("stack", lambda m: m.stack([x_(), x_() * 2.0], dim=-1), lambda a: np.stack([a, 2 * a], -1)),
    ("stack new last", lambda m: m.stack((x_()[0], x_()[1]), 1), lambda a: a[:2].T),
    ("einsum", lambda m: m.einsum("ij,kj->ik", x_(), x_()), lambda a: a @ a.T),
    ("einsum list", lambda m: m.einsum("ij,kj", [x_(), x_()]), lambda a: a @ a.T),
    ("float", lambda m: x_().astype(np.float64).float(), lambda a: a),
    ("view", lambda m: x_().view(-1, 2), lambda a: a.reshape(-1, 2)),
    ("masked_fill", lambda m: x_().masked_fill(x_() > 0, -1.0), lambda a: np.where(a > 0, -1, a)),
    ("expand", lambda m: x_()[:, :1].expand(-1, 5), lambda a: np.repeat(a[:, :1], 5, 1)),
    ("expand new dim", lambda m: x_().expand(2, -1, -1), lambda a: np.stack([a, a])),
]
_X = arr(4, 6)


def x_():
    return dtensor.tensor(_X)


@pytest.mark.parametrize("label,call,ref", FUNCTIONS, ids=[c[0] for c in FUNCTIONS])
def test_top_level_functions(label, call, ref):
    out, want = call(dtensor), ref(_X)
    assert out.shape == want.shape
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-6, atol=1e-6)


def test_sigmoid_and_abs_are_registry_ops():
    x = dtensor.tensor(_X, requires_grad=True)
    for name in ("sigmoid", "abs"):
        y = getattr(x, name)()
        assert y._node.op.name == name


# ----------------------------------------------------------------------------- einsum

EINSUM = [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),  # attention scores
    ("bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),  # attention output
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("i,j->ij", [(3,), (4,)]),
    ("...d,...d->...", [(2, 3, 4), (3, 4)]),  # batch dims broadcast from the right
    ("...d,...d", [(2, 3, 4), (2, 1, 4)]),  # implicit output: '...'
    ("ij->ji", [(3, 4)]),
    ("bij->jbi", [(2, 3, 4)]),
    ("ij->", [(3, 4)]),
    ("ij->j", [(3, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit: 'ik'
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("ij,ij->", [(3, 4), (3, 4)]),
    ("bnd,de->bne", [(2, 3, 4), (4, 5)]),  # a linear layer
    ("btd,hd->bht", [(2, 3, 4), (5, 4)]),
    ("abcd,cdef->abef", [(2, 3, 4, 2), (4, 2, 3, 2)]),  # two contracted dims grouped
    ("ijk,ik->j", [(3, 4, 5), (3, 5)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),  # three operands, left to right
    ("i,i->", [(5,), (5,)]),
    ("ab,cd->abcd", [(2, 3), (2, 2)]),
    ("bi,bj,bk->bijk", [(2, 2), (2, 3), (2, 2)]),
    ("ij,k->", [(2, 3), (4,)]),  # dims only one operand has, summed first
    (" b h q d , b h k d -> b h q k ", [(1, 2, 3, 4), (1, 2, 2, 4)]),  # spaces are ignored
    ("Ab,bC->AC", [(2, 3), (3, 4)]),
]


@pytest.mark.parametrize("subscripts,shapes", EINSUM, ids=[e[0].replace(" ", "") for e in EINSUM])
def test_einsum_values_and_gradients(subscripts, shapes):
    xs = [RNG.standard_normal(s) for s in shapes]
    ts = [dtensor.tensor(x, requires_grad=True) for x in xs]
    out = dtensor.einsum(subscripts, *ts)
    want = np.einsum(subscripts.replace(" ", ""), *xs)
    assert out.shape == want.shape
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)
    w = RNG.standard_normal(want.shape)
    (out * dtensor.tensor(w)).sum().backward()
    for k, x in enumerate(xs):
        def f(a, k=k):
            args = list(xs)
            args[k] = a
            return np.einsum(subscripts.replace(" ", ""), *args)
        np.testing.assert_allclose(ts[k].grad.numpy(), fd_grad(f, x.copy(), w), rtol=1e-6,
                                   atol=1e-8, err_msg=f"{subscripts} operand {k}")


EINSUM_ERRORS = [
    ("ii->i", [(3, 3)], NotImplementedError, r"'ii->i': subscript 'i' appears twice in operand 0"),
    ("ii", [(3, 3)], NotImplementedError, r"a diagonal or trace"),
    ("bii,bj->bj", [(2, 3, 3), (2, 4)], NotImplementedError, r"'i' appears twice"),
    ("ij,jk->ik", [(2, 3)], ValueError, r"2 operand subscripts for 1 operands"),
    ("ij->ik", [(2, 3)], ValueError, r"output subscript 'k' names no operand's dim"),
    ("ij->ii", [(2, 3)], ValueError, r"output subscript 'i' appears more than once"),
    ("ijk->ij", [(2, 3)], ValueError, r"shape \(2, 3\) \(2 dims\) but its subscripts 'ijk' "),
    ("i->i", [(2, 3)], ValueError, r"give one letter per dim, or '...'"),
    ("ij,jk->ik", [(2, 3), (4, 5)], ValueError, r"subscript 'j' has size 3 in one operand and 4"),
    ("...i,...i->...", [(2, 3), (4, 3)], ValueError, r"a '...' dim has size 2 .* and 4"),
    ("...i->i", [(2, 3)], ValueError, r"no '...' to put them in"),
    ("i1->i", [(2, 3)], ValueError, r"\['1'\]: subscripts are letters"),
    ("......i->i", [(2, 3)], ValueError, r"more than one '...'"),
]


@pytest.mark.parametrize("subscripts,shapes,error,pattern", EINSUM_ERRORS,
                         ids=[e[0] for e in EINSUM_ERRORS])
def test_einsum_errors_name_the_subscripts(subscripts, shapes, error, pattern):
    with pytest.raises(error, match=pattern):
        dtensor.einsum(subscripts, *[dtensor.zeros(*s) for s in shapes])


def test_einsum_subscripts_must_be_a_string():
    with pytest.raises(TypeError, match="subscripts must be a string"):
        dtensor.einsum(dtensor.zeros(2), dtensor.zeros(2))
    with pytest.raises(ValueError, match="no operands"):
        dtensor.einsum("i->i")


# ----------------------------------------------------------------------------- errors

ERRORS = [
    (lambda t: t.argmax(3), IndexError, r"argmax: dim 3 is out of range .* \(valid: -3..2\)"),
    (lambda t: t.cumsum(-4), IndexError, r"cumsum: dim -4 is out of range"),
    (lambda t: t.cumsum(1.0), TypeError, r"cumsum: dim must be an integer"),
    (lambda t: t.repeat_interleave(2, 5), IndexError, r"repeat_interleave: dim 5"),
    (lambda t: t.repeat_interleave(-1, 0), ValueError, r"repeats must be non-negative, got -1"),
    (lambda t: t.repeat_interleave(dtensor.tensor([1, 2]), 0), TypeError,
     r"repeats must be an int; per-entry counts"),
    (lambda t: t.argmax(1, keepdim="yes"), TypeError, r"keepdim must be True or False"),
    (lambda t: t.clamp(), ValueError, r"clamp: give min, max or both"),
    (lambda t: t.clamp("0"), TypeError, r"clamp: min must be a number or a tensor, got '0'"),
    (lambda t: t.clamp(max=[1.0]), TypeError, r"clamp: max must be a number or a tensor"),
    (lambda t: t[0, 0].tril(), ValueError, r"tril: the input must have at least 2 dims"),
    (lambda t: t.triu(0.5), TypeError, r"triu: diagonal must be an integer"),
    (lambda t: t.outer(t), ValueError, r"outer: both operands must be 1-D, got shapes \(2, 3, 4\)"),
    (lambda t: dtensor.stack([t, t[0]]), ValueError, r"stack: every tensor must have the same "),
    (lambda t: dtensor.stack([t, t], 4), IndexError, r"stack: dim 4 is out of range"),
    (lambda t: dtensor.stack(t), TypeError, r"stack takes a list or tuple of tensors"),
    (lambda t: dtensor.stack([]), ValueError, r"stack\(\) needs at least one tensor"),
]


@pytest.mark.parametrize("call,error,pattern", ERRORS, ids=[e[2][:30] for e in ERRORS])
def test_bad_arguments_say_what_is_wrong(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(dtensor.tensor(arr(2, 3, 4)))


def test_clamp_min_above_max_follows_torch():
    # torch.clamp(x, min=1, max=0) sets every entry to max; its gradient flows to nothing.
    x = dtensor.tensor(np.array([-2.0, 0.5, 3.0]), requires_grad=True)
    y = x.clamp(1.0, 0.0)
    y.sum().backward()
    np.testing.assert_array_equal(y.numpy(), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0, 0.0])


# ----------------------------------------------------------------------------- DTensor

def _dt_cases():
    from dtensor import Partial, Replicate, Shard
    return [
        # (label, placements of the input, call, numpy reference)
        ("argmax over the sharded dim", [Shard(2)], lambda t: t.argmax(2),
         lambda x: np.argmax(x, 2)),
        ("argmax over a sharded dim, keepdim", [Shard(0)], lambda t: t.argmax(0, keepdim=True),
         lambda x: np.argmax(x, 0)[None]),
        ("argmax along another dim", [Shard(0)], lambda t: t.argmax(-1),
         lambda x: np.argmax(x, -1)),
        ("argmax of a Partial", [Partial()], lambda t: t.argmax(1), lambda x: np.argmax(x, 1)),
        ("cumsum over the sharded dim", [Shard(1)], lambda t: t.cumsum(1),
         lambda x: np.cumsum(x, 1)),
        ("cumsum along another dim", [Shard(0)], lambda t: t.cumsum(2),
         lambda x: np.cumsum(x, 2)),
        ("cumsum of a Partial", [Partial()], lambda t: t.cumsum(0), lambda x: np.cumsum(x, 0)),
        ("tril of a sharded row dim", [Shard(1)], lambda t: t.tril(), np.tril),
        ("triu of a sharded batch", [Shard(0)], lambda t: t.triu(1), lambda x: np.triu(x, 1)),
        ("repeat_interleave over the sharded dim", [Shard(0)],
         lambda t: t.repeat_interleave(2, 0), lambda x: np.repeat(x, 2, 0)),
        ("repeat_interleave along another dim", [Shard(0)],
         lambda t: t.repeat_interleave(3, 1), lambda x: np.repeat(x, 3, 1)),
        ("stack", [Shard(1)], lambda t: dtensor.stack([t, t * 2.0], 1),
         lambda x: np.stack([x, 2 * x], 1)),
        ("sigmoid clamp", [Shard(2)], lambda t: t.sigmoid().clamp(0.3, 0.6),
         lambda x: np.clip(1 / (1 + np.exp(-x)), 0.3, 0.6)),
        ("cos sin rsqrt abs", [Shard(1)], lambda t: t.cos() * t.sin() + t.abs().rsqrt(),
         lambda x: np.cos(x) * np.sin(x) + 1 / np.sqrt(np.abs(x))),
        ("einsum bhqd,bhkd over sharded heads", [Shard(1)],
         lambda t: dtensor.einsum("bhqd,bhkd->bhqk", t[..., None], t[..., None]),
         lambda x: np.einsum("bhqd,bhkd->bhqk", x[..., None], x[..., None])),
        ("einsum contracting the sharded dim", [Shard(2)],
         lambda t: dtensor.einsum("bij,bkj->bik", t, t),
         lambda x: np.einsum("bij,bkj->bik", x, x)),
        ("einsum ...d,...d over a sharded d", [Shard(2)],
         lambda t: dtensor.einsum("...d,...d->...", t, t), lambda x: (x * x).sum(-1)),
        ("einsum outer of a Partial", [Partial()],
         lambda t: dtensor.einsum("i,j->ij", t[0, 0], t[1, 1]),
         lambda x: np.outer(x[0, 0], x[1, 1])),
        ("replicated", [Replicate()], lambda t: dtensor.einsum("ijk->kij", t).cumsum(0),
         lambda x: np.cumsum(x.transpose(2, 0, 1), 0)),
    ]


@pytest.mark.ranks(2, timeout=240)
def test_new_ops_on_dtensors_equal_one_process(rank):
    """Values and gradients on 2 ranks, each input sharded (or Partial) as listed; the
    sizes (5, 3, 6) split unevenly."""
    from dtensor import Replicate, distribute_tensor
    from dtensor.dtensor import DTensor
    mesh = dtensor.init_device_mesh("cpu", (2,))
    a = np.random.default_rng(5).standard_normal((5, 3, 6))
    for label, placements, call, ref in _dt_cases():
        d = distribute_tensor(dtensor.tensor(a), mesh, [Replicate()])
        d = d.redistribute(mesh, placements).detach()
        d.requires_grad = True
        out = call(d)
        want = ref(a)
        assert isinstance(out, DTensor)
        full = out.full_tensor().numpy()
        assert full.dtype == want.dtype, label
        np.testing.assert_allclose(full, want, rtol=1e-12, atol=1e-12, err_msg=label)
        if out.dtype.kind != "f":
            continue
        # the same gradient as one process
        t = dtensor.tensor(a, requires_grad=True)
        call(t).sum().backward()
        out.sum().backward()
        np.testing.assert_allclose(d.grad.full_tensor().numpy(), t.grad.numpy(), rtol=1e-12,
                                   atol=1e-12, err_msg=label)


@pytest.mark.ranks(2, timeout=120)
def test_collectives_of_sharded_reductions_and_einsum(rank):
    """argmax and cumsum over a sharded dim gather it (one all-gather); along another dim,
    and einsum over sharded heads, move nothing; contracting a sharded dim leaves a Partial
    that full_tensor all-reduces."""
    from dtensor import Partial, Shard, distribute_tensor
    mesh = dtensor.init_device_mesh("cpu", (2,))
    a = np.random.default_rng(6).standard_normal((2, 4, 6, 8))

    def on(p):
        return distribute_tensor(dtensor.tensor(a), mesh, [p])

    for call, placement, gathers, placed in [
            (lambda t: t.argmax(2), Shard(2), 1, Shard(2)),  # the result is whole (Replicate)
            (lambda t: t.cumsum(2), Shard(2), 1, Shard(2)),
            (lambda t: t.argmax(3), Shard(1), 0, Shard(1)),
            (lambda t: t.argmax(0), Shard(3), 0, Shard(2)),  # one dim lower past dim 0
            (lambda t: t.cumsum(0), Shard(3), 0, Shard(3))]:
        t = on(placement)
        with count_collectives() as log:
            out = call(t)
        assert log.count() == gathers == log.count("all_gather"), log.summary()
        if not gathers:
            assert out.placements == (placed,)
    q = on(Shard(1))
    with count_collectives() as log:
        s = dtensor.einsum("bhqd,bhkd->bhqk", q, q)
    assert log.count() == 0 and s.placements == (Shard(1),)
    x = on(Shard(3))
    with count_collectives() as log:
        p = dtensor.einsum("bhij,bhkj->bhik", x, x)
    assert log.count() == 0 and p.placements == (Partial("sum"),)
    np.testing.assert_allclose(p.full_tensor().numpy(), np.einsum("bhij,bhkj->bhik", a, a),
                               rtol=1e-12)


@pytest.mark.ranks(2, timeout=240)
def test_compiled_dtensor_function_with_new_ops(rank):
    """The tracer on DTensors: a compiled function of the new ops on a sharded input equals
    eager."""
    from dtensor import Shard, distribute_tensor
    mesh = dtensor.init_device_mesh("cpu", (2,))
    a = arr(4, 6, 8)

    def f(x):
        s = dtensor.einsum("bqd,bkd->bqk", x, x).tril() / math.sqrt(8)
        y = s.sigmoid().clamp(min=0.2).cumsum(-1) + x.abs().rsqrt().sum(-1, keepdims=True)
        return y, y.argmax(-1)

    x = distribute_tensor(dtensor.tensor(a), mesh, [Shard(0)])
    want = f(x)
    got = dtensor.compile(f)(distribute_tensor(dtensor.tensor(a), mesh, [Shard(0)]))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.full_tensor().numpy(), w.full_tensor().numpy())
