"""Numerics and index checks: float16 reductions accumulate in float32 (as PyTorch), row indices
and cross-entropy targets outside [0, n) are one IndexError on every path, and examples/train.py
stops at a non-finite loss."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import dtensor
import dtensor.nn.functional as F
from dtensor import Replicate, Shard, Tensor
from dtensor.ops import structural as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rng = np.random.default_rng(17)

# ----------------------------------------------------------------------------- float16 reductions


def _layer_norm(x):
    d = x - x.mean(-1, keepdims=True)
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _cross_entropy(x, t):
    return -_log_softmax(x)[np.arange(len(t)), t].mean()


TARGETS = rng.integers(0, 16, 40_000)

# (id, input of float64 values, the op on a Tensor, the float64 reference). The inputs are
# rounded to the tested type first and the reference reads the rounded values, so what is
# compared is the op's own arithmetic.
CASES = [
    ("layer_norm-std16", rng.normal(0, 16, (64, 256)), lambda t: F.layer_norm(t, 256),
     _layer_norm),
    ("layer_norm-std100", rng.normal(300, 100, (64, 256)), lambda t: F.layer_norm(t, 256),
     _layer_norm),
    ("rms_norm-std300", rng.normal(0, 300, (64, 256)), lambda t: F.rms_norm(t, 256),
     lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + float(np.finfo(np.float16).eps))),
    ("mean-100000x1000", np.full(100_000, 1000.0), lambda t: t.mean(), np.mean),
    ("mean-rows", rng.normal(1000, 4, (8, 20_000)), lambda t: t.mean(1), lambda x: x.mean(1)),
    ("var-100000", rng.normal(1000, 4, 100_000), lambda t: t.var(), lambda x: x.var(ddof=1)),
    ("var-wide", rng.normal(0, 200, (4, 5000)), lambda t: t.var(1), lambda x: x.var(1, ddof=1)),
    ("cross_entropy-40000", rng.normal(0, 2, (40_000, 16)),
     lambda t: F.cross_entropy(t, TARGETS), lambda x: _cross_entropy(x, TARGETS)),
    ("softmax-70000", rng.normal(0, 0.5, (4, 70_000)), lambda t: F.softmax(t, -1),
     lambda x: np.exp(_log_softmax(x))),
    ("log_softmax-70000", rng.normal(0, 0.5, (4, 70_000)), lambda t: F.log_softmax(t, -1),
     _log_softmax),
    ("causal-softmax", rng.normal(0, 0.5, (2, 300, 300)),
     lambda t: dtensor.ops.nn.softmax(t, causal=True),
     lambda x: np.exp(_log_softmax(np.where(np.tri(300, dtype=bool), x, -np.inf)))),
    ("sum-down-columns", rng.uniform(0, 0.2, (1000, 8)), lambda t: t.sum(0), lambda x: x.sum(0)),
    ("sum-all", rng.uniform(0, 0.2, 30_000), lambda t: t.sum(), np.sum),
]


def ulps(got, want):
    """|got - want| in units of the float16 spacing at want (the spacing of float16's
    subnormals, 2^-24, near 0)."""
    spacing = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / spacing


# Computed in float32 and rounded once to float16, a result is within half a float16 ulp of
# the exact value, plus float32's accumulation error (~1e-7 relative: 2^-13 of a float16 ulp
# at most). Cross-entropy's mean also reads per-row losses that were each rounded to float16
# (half an ulp each, relative, so half an ulp of their mean). 1 ulp bounds both; a float16
# accumulation misses by hundreds (100 vs 105.2 down a column) or gives inf / NaN / zeros.
F16_ULPS = 1.0


@pytest.mark.parametrize("name,x,fn,ref", CASES, ids=[c[0] for c in CASES])
def test_float16_reductions_accumulate_in_float32(name, x, fn, ref):
    x16 = x.astype(np.float16)
    want = np.asarray(ref(x16.astype(np.float64)))
    got = fn(Tensor(x16)).numpy()
    assert got.dtype == np.float16 and got.shape == want.shape
    assert np.isfinite(got).all(), got
    assert ulps(got, want).max() <= F16_ULPS, (ulps(got, want).max(), got, want)


@pytest.mark.parametrize("name,x,fn,ref", CASES, ids=[c[0] for c in CASES])
def test_float32_reductions_unchanged(name, x, fn, ref):
    """float32 keeps its own kernels (no widening): within float32 rounding of float64."""
    x32 = x.astype(np.float32)
    want = np.asarray(ref(x32.astype(np.float64)))
    got = fn(Tensor(x32)).numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


# Backwards that read the forward's float16 output y (softmax's y, log_softmax's log-probabilities,
# as PyTorch's do) inherit its half-ulp rounding, multiplied by sum(g) (70,000 and 300 here) and
# cancelled in g - y sum(g): that error is measured against the gradient's largest entry.
READS_ROUNDED_OUTPUT = {"softmax-70000", "log_softmax-70000", "causal-softmax"}


@pytest.mark.parametrize("name,x,fn,ref", CASES, ids=[c[0] for c in CASES])
def test_float16_gradients_are_finite_and_close(name, x, fn, ref):
    """d sum(fn(x) * w) / dx in float16 against the same graph in float64 (same rounded x and
    w): finite wherever the reference is, and within 2 float16 ulps of it (the backward kernels
    also run widened and round once; the incoming gradient was rounded to float16 too)."""
    x16 = x.astype(np.float16)
    grads = {}
    for dtype in (np.float16, np.float64):
        t = Tensor(x16.astype(dtype), requires_grad=True)
        y = fn(t)
        w = np.random.default_rng(3).uniform(0.5, 1.5, y.shape).astype(np.float16)
        (y * Tensor(w.astype(dtype))).sum().backward()
        grads[dtype] = t.grad.numpy()
    got, want = grads[np.float16], grads[np.float64]
    assert got.dtype == np.float16
    assert np.isfinite(got[np.isfinite(want)]).all()
    err = np.abs(got.astype(np.float64) - want)
    slack = 16 * 2.0 ** -11 * np.abs(want).max() if name in READS_ROUNDED_OUTPUT else 0.0
    spacing = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    assert (err <= 2 * spacing + slack).all(), (ulps(got, want).max(), err.max())


def test_float16_sum_past_its_range_is_inf_silently():
    """sum keeps the tensor's type: a true sum past 65504 is inf (PyTorch's too), with no
    overflow warning (warnings are errors here); the mean of the same values is finite."""
    x = Tensor(np.full(100_000, 1000.0, np.float16))
    assert x.sum().numpy() == np.inf
    assert x.mean().numpy() == 1000.0


@pytest.mark.ranks(2, timeout=120)
def test_float16_reductions_of_a_sharded_dtensor(rank):
    """Over 2 ranks, a float16 reduction of a sharded dim is a Partial whose per-rank sums are
    rounded to float16 and all-reduced in float16 (as PyTorch's DTensor): mean and var divide in
    float32 first, so their partials stay in range, and the result is within 1 ulp as in one
    process; sum adds one more rounding (so 1.5 ulps)."""
    mesh = dtensor.init_device_mesh("cpu", (2,))
    for name, dim, bound in (("mean-100000x1000", 0, 1.0), ("mean-rows", 1, 1.0),
                             ("var-100000", 0, 1.0), ("var-wide", 1, 1.0),
                             ("sum-down-columns", 0, 1.5), ("sum-all", 0, 1.5)):
        _, x, fn, ref = next(c for c in CASES if c[0] == name)
        x16 = x.astype(np.float16)
        d = dtensor.distribute_tensor(x16, mesh, [Shard(dim)])  # the reduced dim
        got = fn(d).full_tensor().numpy()
        want = np.asarray(ref(x16.astype(np.float64)))
        assert got.dtype == np.float16
        assert ulps(got, want).max() <= bound, (name, ulps(got, want).max())


# ----------------------------------------------------------------------------- index checks

V = 11  # uneven over 2 ranks: rows 0-5 and 6-10
BAD = [-1, V, V + 5, -101]


def _embedding_eager(bad):
    idx = np.array([[0, 3, bad], [2, 10, 1]])
    return F.embedding(Tensor(idx), Tensor(np.ones((V, 4), np.float32)))


def _cross_entropy_eager(bad):
    t = np.array([0, 3, -100, bad, 10])
    return F.cross_entropy(Tensor(np.zeros((5, V), np.float32)), Tensor(t))


def _message(fn, bad) -> str:
    with pytest.raises(IndexError) as info:
        fn(bad)
    return str(info.value)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("path,what,pos,unit", [
    (_embedding_eager, "embedding: index", "(0, 2)", "rows"),
    (_cross_entropy_eager, "cross_entropy: target", "(3,)", "classes"),
], ids=["embedding", "cross_entropy"])
def test_bad_index_is_an_index_error(path, what, pos, unit, bad):
    msg = _message(path, bad)
    assert msg.startswith(f"{what} {bad} is out of range for {V} {unit} (at position {pos})")
    assert f"[0, {V})" in msg and "not counted from the end" in msg
    assert ("ignore_index (-100)" in msg) == (what.startswith("cross"))


def test_ignore_index_and_plain_indexing_are_unchanged():
    x = rng.standard_normal((3, V)).astype(np.float32)
    got = F.cross_entropy(Tensor(x), Tensor(np.array([4, -100, 0]))).numpy()
    want = -(_log_softmax(x.astype(np.float64))[[0, 2], [4, 0]]).mean()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(IndexError, match="target -100 is out of range"):  # another ignore_index
        F.cross_entropy(Tensor(x), Tensor(np.array([4, -100, 0])), ignore_index=-1)
    t = Tensor(np.arange(6.0).reshape(2, 3))
    assert t[-1, -1].item() == 5.0  # basic indexing keeps numpy's negative indices


@pytest.mark.parametrize("call,unit", [
    (lambda w, i: st.index_select(w, i), "rows"),
    (lambda w, i: st.index_add(Tensor(np.ones(i.shape + (4,), np.float32)), i, w), "rows"),
    (lambda w, i: st.gather(w.mT, Tensor(np.tile(i.numpy(), (4, 1))), axis=1),
     "entries along dim 1"),
    (lambda w, i: st.scatter_add(Tensor(np.ones((4, 3), np.float32)),
                                 Tensor(np.tile(i.numpy(), (4, 1))), w.mT, axis=1),
     "entries along dim 1"),
], ids=["index_select", "index_add", "gather", "scatter_add"])
@pytest.mark.parametrize("bad", BAD)
def test_lookup_ops_reject_bad_rows(call, unit, bad):
    """The ops themselves (the compiled step and direct callers reach these, not F.embedding;
    gather picks the target's logit under loss_parallel)."""
    w = Tensor(np.ones((V, 4), np.float32))
    with pytest.raises(IndexError, match=rf"index {bad} is out of range for {V} {unit}"):
        call(w, Tensor(np.array([1, bad, 2])))


def _lookup_cases():
    """(name, call, args, placements of the DTensor args): each vocab-parallel lookup op with
    a non-finite value at both blocks' first row/column (global 0 and 6: where a rank's
    kernel stands in for an index outside its block) and indices that name neither."""
    rng = np.random.default_rng(0)
    idx = np.array([1, 7, 3, 9])
    cols = np.tile(idx, (4, 1))
    w = rng.standard_normal((V, 4)).astype(np.float32)
    w[[0, 6]] = np.inf
    x = rng.standard_normal((4, V)).astype(np.float32)
    x[:, [0, 6]] = -np.inf  # masked classes, as a padded vocabulary's logits are
    g = rng.standard_normal((4, 4)).astype(np.float32)
    g[cols == 7] = np.inf  # a gradient one block's rows hold and the other's do not
    g[0, 0] = np.nan
    return [
        ("index_select", st.index_select, (w, idx), [Shard(0), Replicate()]),
        ("index_add", st.index_add, (g, idx, w), [Replicate(), Replicate(), Shard(0)]),
        ("gather", lambda a, i: st.gather(a, i, axis=1), (x, cols), [Shard(1), Replicate()]),
        ("scatter_add", lambda a, i, like: st.scatter_add(a, i, like, axis=1), (g, cols, x),
         [Replicate(), Replicate(), Shard(1)]),
    ]


@pytest.mark.ranks(2, timeout=120)
def test_an_index_outside_a_block_contributes_exactly_zero(rank):
    """A vocab-parallel kernel looks an index outside its block up at entry 0 of the block
    and must add exactly zero for it, whatever that entry holds: an inf or NaN there (a
    -inf-masked logit) multiplied by a 0/1 mask is NaN, which the sum over ranks spreads to
    results the one-process op computes finite. Each op against the one-process run."""
    mesh = dtensor.init_device_mesh("cpu", (2,))
    for name, call, args, placements in _lookup_cases():
        want = call(*map(Tensor, args)).numpy()
        got = call(*(dtensor.distribute_tensor(a, mesh, [p])
                     for a, p in zip(args, placements))).full_tensor().numpy()
        np.testing.assert_array_equal(got, want, err_msg=name)  # NaN only where g's own is


@pytest.mark.ranks(2, timeout=120)
def test_bad_index_raises_on_every_rank_with_the_eager_message(rank, comm):
    """Vocab-parallel embedding and loss_parallel cross-entropy over 2 ranks (each holds a
    block of the 11 rows/classes): every rank raises, with the message of the one-process
    path, checked against the whole vocabulary; -100 with ignore_index still works."""
    from mpi4py import MPI

    from dtensor.parallel import loss_parallel

    mesh = dtensor.init_device_mesh("cpu", (2,))
    w = dtensor.distribute_tensor(np.ones((V, 4), np.float32), mesh, [Shard(0)])
    logits = np.zeros((5, V), np.float32)

    def embedding_sharded(bad):
        idx = np.array([[0, 3, bad], [2, 10, 1]])
        return F.embedding(dtensor.distribute_tensor(idx, mesh, [Replicate()]), w)

    def cross_entropy_loss_parallel(bad):
        x = dtensor.distribute_tensor(logits, mesh, [Shard(1)])
        with loss_parallel():
            return F.cross_entropy(x, np.array([0, 3, -100, bad, 10]))

    def index_select_local(bad):  # the op's vocab-parallel kernel, past F.embedding's check
        return st.index_select(w, dtensor.distribute_tensor(np.array([1, bad]), mesh,
                                                            [Replicate()]))

    for bad in BAD:
        for eager, sharded in ((_embedding_eager, embedding_sharded),
                               (_cross_entropy_eager, cross_entropy_loss_parallel)):
            want = _message(eager, bad)
            got = _message(sharded, bad)
            assert got == want
            assert MPI.COMM_WORLD.allgather(got) == [want, want]
        got = _message(index_select_local, bad)
        assert got.startswith(f"index {bad} is out of range for {V} rows (at position (1,))")
    x = dtensor.distribute_tensor(logits, mesh, [Shard(1)])
    with loss_parallel():
        loss = F.cross_entropy(x, np.array([0, 3, -100, 6, 10]))
    assert loss.full_tensor().item() == pytest.approx(math.log(V), rel=1e-6)


# ----------------------------------------------------------------------------- train.py


def test_train_stops_at_a_non_finite_loss():
    """lr 1e4 sends the loss to NaN within a few steps: the run stops there, names the step
    and the learning rate, and exits non-zero (before, it printed a sample and exited 0)."""
    cmd = [sys.executable, "examples/train.py", "--lr", "1e4", "--warmup", "1", "--steps", "30",
           "--log-every", "1", "--eval-every", "0", "--corpus-chars", "20000", "--n-layer", "1",
           "--n-embd", "32", "--n-head", "2", "--batch-size", "4", "--block-size", "16",
           "--sample-chars", "5"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert out.returncode != 0, out.stdout[-2000:]
    m = re.search(r"step (\d+): loss is (nan|inf|-inf); training diverged, stopping\. The "
                  r"learning rate \(--lr 10000, ", out.stderr)
    assert m, out.stderr[-2000:]
    assert f"step {int(m.group(1)) - 1:5d}" in out.stdout  # the step before still logged
    assert "sample:" not in out.stdout


def test_a_compiled_float16_row_sum_accumulates_in_float32_as_eager():
    """The numpy backend's fused row reductions call the ops' impls: a compiled float16 row
    sum of 3000 values equals eager's bits, within one rounding of the float64 sum."""
    x = dtensor.Tensor((np.random.default_rng(0).standard_normal((4, 3000)) * 0.01 + 1.0)
                       .astype(np.float16))

    def f(t):
        return (t * 0.5).sum(-1, keepdims=True)
    eager = f(x).numpy()
    compiled = dtensor.compile(f)(x).numpy()
    np.testing.assert_array_equal(compiled, eager)
    ref = (x.numpy().astype(np.float64) * 0.5).sum(-1, keepdims=True)
    assert np.all(np.abs(compiled - ref) <= np.spacing(np.float16(1500)))  # one rounding
