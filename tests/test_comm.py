"""Collectives on real MPI ranks against numpy references, with exact collective counts.

Each rank's input is a pure function of its rank, so every rank can compute the whole
reference locally.
"""
from __future__ import annotations

import numpy as np
import pytest

from dtensor.comm import count_collectives

DTYPES = ["float32", "float64", "int64"]
RANKS = [pytest.param(n, marks=pytest.mark.ranks(n), id=f"{n}ranks") for n in (1, 2, 3, 4)]


def data(r: int, shape, dtype) -> np.ndarray:
    a = (np.arange(int(np.prod(shape))).reshape(shape) * 7 + 3 * r + 1) % 23 - 11
    return a.astype(dtype)


def uneven(n: int) -> list[int]:
    return [(r * 2 + 1) % 3 for r in range(n)]  # 1, 0, 2, 1: empty shards included


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce(n, dtype, async_op, comm, rank, world_size):
    assert world_size == n and comm.size == n and comm.rank == rank
    inputs = [data(r, (3, 5), dtype) for r in range(n)]
    want = {"sum": np.sum(inputs, 0), "max": np.max(inputs, 0), "min": np.min(inputs, 0)}
    if dtype != "int64":
        want["avg"] = np.sum(inputs, 0) / n
    with count_collectives() as log:
        for op, ref in want.items():
            out = comm.all_reduce(inputs[rank], op=op, async_op=async_op)
            out = out.wait() if async_op else out
            assert out.dtype == np.dtype(dtype)
            np.testing.assert_allclose(out, ref.astype(dtype), rtol=1e-6)
            mine = inputs[rank].copy()  # out=x: reduced in place
            out = comm.all_reduce(mine, op=op, async_op=async_op, out=mine)
            assert (out.wait() if async_op else out) is mine
            np.testing.assert_allclose(mine, ref.astype(dtype), rtol=1e-6)
    assert log.summary() == {"all_reduce": (2 * len(want), 2 * len(want) * inputs[0].nbytes)}
    assert all(e.group == tuple(range(n)) for e in log.events)


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_even_and_uneven(n, dtype, async_op, comm, rank):
    sizes = uneven(n)
    with count_collectives() as log:
        for axis, lens in [(0, [2] * n), (1, [3] * n), (0, sizes), (1, sizes)]:
            shape = lambda r: (lens[r], 4) if axis == 0 else (2, lens[r])  # noqa: E731
            parts = [data(r, shape(r), dtype) for r in range(n)]
            out = comm.all_gather(parts[rank], axis=axis, sizes=lens, async_op=async_op)
            out = out.wait() if async_op else out
            np.testing.assert_array_equal(out, np.concatenate(parts, axis=axis))
    assert log.count("all_gather") == 4 and log.count() == 4


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_even_and_uneven(n, dtype, async_op, comm, rank):
    with count_collectives() as log:
        for axis, lens in [(0, None), (1, None), (0, uneven(n)), (1, uneven(n))]:
            total = 2 * n if lens is None else sum(lens)
            shape = (total, 3) if axis == 0 else (3, total)
            inputs = [data(r, shape, dtype) for r in range(n)]
            full = np.sum(inputs, 0).astype(dtype)
            out = comm.reduce_scatter(inputs[rank], axis=axis, sizes=lens, async_op=async_op)
            out = out.wait() if async_op else out
            lens = lens or [2] * n
            start = sum(lens[:rank])
            ref = np.take(full, range(start, start + lens[rank]), axis=axis)
            np.testing.assert_array_equal(out, ref)
    assert log.summary()["reduce_scatter"][0] == 4


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_to_all_even_and_uneven(n, dtype, async_op, comm, rank):
    # Each rank holds a row block of a global (R, C) matrix (uneven rows) and re-shards it into
    # column blocks (uneven columns): the S(0) -> S(1) transition.
    rows, cols = uneven(n), [(r + 2) % 3 for r in range(n)]
    R, C = sum(rows), sum(cols)
    full = data(0, (R, C), dtype)
    r0 = sum(rows[:rank])
    mine = full[r0:r0 + rows[rank]]
    with count_collectives() as log:
        out = comm.all_to_all(mine, split_axis=1, concat_axis=0, split_sizes=cols,
                              concat_sizes=rows, async_op=async_op)
        out = out.wait() if async_op else out
    c0 = sum(cols[:rank])
    np.testing.assert_array_equal(out, full[:, c0:c0 + cols[rank]])
    assert log.count("all_to_all") == 1


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("async_op", [False, True])
def test_broadcast_send_recv_barrier(n, async_op, comm, rank):
    src = n - 1
    x = data(rank, (4,), "float64")
    out = comm.broadcast(x, src=src, async_op=async_op)
    np.testing.assert_array_equal(out.wait() if async_op else out, data(src, (4,), "float64"))
    if n > 1:  # a ring: send to the right, receive from the left
        right, left = (rank + 1) % n, (rank - 1) % n
        buf = np.empty(4, np.int64)
        req = comm.recv(buf, src=left, tag=7, async_op=True)
        comm.send(data(rank, (4,), "int64"), dst=right, tag=7, async_op=async_op)
        np.testing.assert_array_equal(req.wait(), data(left, (4,), "int64"))
    comm.barrier(async_op=async_op)


@pytest.mark.ranks(4)
def test_nonblocking_overlap_and_order(comm, rank):
    # Several handles in flight at once, waited in reverse order.
    works = [comm.all_reduce(np.full(1000, rank + k, np.float64), async_op=True)
             for k in range(3)]
    for k, w in reversed(list(enumerate(works))):
        np.testing.assert_array_equal(w.wait(), np.full(1000, 6 + 4 * k))
        assert w.is_completed()


@pytest.mark.ranks(2)
def test_fresh_results_reuse_only_dropped_arrays(comm, rank):
    # A result nobody holds any more is handed out again (no page faults on the next call); one
    # that is still held, directly, through a view, or by a Work in flight, never is.
    x = [data(r, (64, 64), "float32") for r in range(2)]
    want = x[0] + x[1]
    first = comm.all_reduce(x[rank])
    address = first.ctypes.data
    del first
    again = comm.all_reduce(x[rank])
    assert again.ctypes.data == address
    view = again[3:]
    del again
    work = comm.all_reduce(2 * x[rank], async_op=True)
    kept = comm.all_reduce(3 * x[rank])
    scattered = comm.reduce_scatter(x[rank])
    gathered = comm.all_gather(x[rank])
    addresses = {a.ctypes.data for a in (view.base, kept, scattered, gathered)}
    assert len(addresses) == 4
    np.testing.assert_array_equal(view, want[3:])
    np.testing.assert_array_equal(kept, 3 * want)
    np.testing.assert_array_equal(work.wait(), 2 * want)
    np.testing.assert_array_equal(scattered, want[32 * rank:32 * (rank + 1)])
    np.testing.assert_array_equal(gathered, np.concatenate(x))


def test_result_cache_keeps_a_bounded_number_of_idle_bytes():
    from dtensor.comm import _Results
    cache = _Results()
    cache._BYTES = 3 * 800
    in_use = cache.take((100,), np.dtype("float64"))
    for n in range(101, 111):  # ten results of other shapes, each dropped at once
        newest = cache.take((n,), np.dtype("float64")).ctypes.data
    cached = [a for held in cache._held.values() for a in held]
    idle = sum(a.nbytes for a in cached if a is not in_use)
    assert any(a is in_use for a in cached)  # still handed out: kept, not counted
    assert idle <= 3 * 800 + 8 * 110  # the bound, plus the latest result (idle only since)
    del cached  # (a reference of ours would make every array look in use)
    assert cache.take((110,), np.dtype("float64")).ctypes.data == newest  # the newest is kept
    assert cache.take((10 ** 6,), np.dtype("float32")).nbytes > cache._BYTES  # too big to keep
    assert (10 ** 6,) not in {shape for shape, _ in cache._held}


@pytest.mark.ranks(2)
def test_bad_input_is_a_clear_error_on_every_rank(comm, rank):
    with pytest.raises(ValueError, match="unknown reduce op 'prod'"):
        comm.all_reduce(np.ones(2), op="prod")
    with pytest.raises(TypeError, match="floating dtype"):
        comm.all_reduce(np.ones(2, np.int64), op="avg")
    with pytest.raises(ValueError, match=r"does not split evenly over 2 ranks"):
        comm.reduce_scatter(np.ones(3))
    with pytest.raises(ValueError, match=r"one non-negative length per rank \(2 ranks\)"):
        comm.all_gather(np.ones(2), sizes=[2, 2, 2])
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        comm.send(np.ones(1), dst=2)
    # Mismatched shapes across ranks are caught (DTENSOR_COMM_CHECK) on every rank, no hang.
    comm._check = True
    try:
        with pytest.raises(ValueError, match=r"rank 0: .*\(3,\).*rank 1: .*\(4,\)"):
            comm.all_reduce(np.ones(3 + rank))
    finally:
        comm._check = False


@pytest.mark.ranks(2)
def test_out_buffers_are_checked_and_non_builtin_dtypes_take_the_slow_path(comm, rank):
    x = np.arange(4, dtype=np.float32) + rank
    # A dtype equal to float32 but not numpy's float32 singleton (it carries metadata) is not
    # the identity fast path's, and still works.
    tagged = np.dtype(np.float32, metadata={"unit": "m"})
    out = np.empty(8, tagged)
    assert comm.all_gather(x, out=out) is out
    np.testing.assert_array_equal(out, np.r_[np.arange(4), np.arange(4) + 1])
    np.testing.assert_array_equal(comm.all_reduce(x.astype(tagged)), 2 * np.arange(4) + 1)
    for bad in (np.empty(7, np.float32), np.empty(8, np.float64), np.empty((2, 8))[:, ::2]):
        with pytest.raises(ValueError, match=r"all_gather: out must be a C-contiguous float32 "
                                             r"array of shape \(8,\)"):
            comm.all_gather(x, out=bad)
    with pytest.raises(ValueError, match=r"reduce_scatter: out must be .* shape \(2,\)"):
        comm.reduce_scatter(x, out=np.empty(4, np.float32))
    with pytest.raises(ValueError, match=r"all_reduce: out must be .* shape \(4,\)"):
        comm.all_reduce(x, out=np.empty(3, np.float32))
    # A transposed (F-ordered) input is gathered in its logical (C) order.
    base = np.arange(6, dtype=np.float64).reshape(2, 3).T
    gathered = comm.all_gather(base + 10 * rank)
    np.testing.assert_array_equal(gathered, np.concatenate([base, base + 10]))


def test_count_collectives_records_only_its_own_thread():
    import threading

    from dtensor import comm as comm_module
    world = comm_module.get_world()
    x = np.ones(3)
    with count_collectives() as log:
        with count_collectives() as inner:
            world.all_reduce(x)
        other = threading.Thread(target=lambda: world.all_reduce(x))
        other.start()
        other.join()
        world.all_gather(x)
    assert [e.kind for e in log.events] == ["all_reduce", "all_gather"]
    assert [e.kind for e in inner.events] == ["all_reduce"]
    assert comm_module._LOGGING == 0  # every block closed: the hot path skips the lookup
    with count_collectives() as after:
        pass
    world.all_reduce(x)
    assert after.events == []


# ----------------------------------------------------------------------------- agreement

class _Odd(Exception):
    """An error type whose constructor takes two arguments."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


@pytest.mark.ranks(3, timeout=120)
def test_check_same_names_the_ranks_that_differ_on_every_rank(comm, rank):
    comm.check_same("op", shape=(4, 2), placements="[S(0)]")  # equal: no error
    cases = [  # (fields on this rank, what the message must hold)
        (dict(shape=(4, 2) if rank != 2 else (4, 3)), r"shape: \(4, 2\) on ranks \[0, 1\], "
                                                      r"\(4, 3\) on ranks \[2\]\)"),
        (dict(dtype=np.dtype("float32"), placements=[f"S({rank % 2})"]),
         r"placements: \['S\(0\)'\] on ranks \[0, 2\], \['S\(1\)'\] on ranks \[1\]\)"),
    ]
    for fields, pattern in cases:
        with pytest.raises(ValueError, match=r"^op: ranks passed different arguments \("
                           + pattern + r"\. .*Pass the same\.$"):
            comm.check_same("op", "Pass the same.", **fields)  # only differing fields listed


@pytest.mark.ranks(2, timeout=120)
def test_check_same_called_on_one_rank_times_out_instead_of_hanging(comm, rank, monkeypatch):
    import time
    if rank == 0:
        monkeypatch.setenv("DTENSOR_COLLECTIVE_TIMEOUT", "0.5")
        t = time.perf_counter()
        with pytest.raises(TimeoutError, match=r"save is collective.*rank 0 waited 0\.5 s"):
            comm.check_same("save", path="x")
        assert time.perf_counter() - t < 5
        comm.barrier()
    else:
        comm.barrier()  # rank 0 gave up; its request completes when rank 1 arrives late
        comm.check_same("save", path="x")


@pytest.mark.ranks(2, timeout=120)
@pytest.mark.parametrize("make", [
    lambda: KeyError("k"), lambda: OSError(28, "No space left on device"),
    lambda: ValueError("bad"), lambda: _Odd(1, 2)], ids=["key", "os", "value", "odd"])
def test_fail_together_raises_the_same_error_on_every_rank(comm, rank, make):
    error = make()
    for failing in (0, 1):
        with pytest.raises(Exception) as info:
            with comm.fail_together("save"):
                if rank == failing:
                    raise error
        want = type(error) if not isinstance(error, _Odd) else RuntimeError
        assert type(info.value) is want, info.value
        msg = info.value.args[0] if isinstance(info.value, KeyError) else str(info.value)
        assert f"save failed on rank {failing}: " in msg
        assert str(error) in msg
        theirs = comm._c.allgather(msg)
        assert theirs[0] == theirs[1]
    with comm.fail_together("save"):  # no error anywhere: nothing raised
        pass


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("n", RANKS[1:])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bool", "int8", "uint8"])
def test_max_min_follow_numpy_nan_semantics_with_the_same_bits_everywhere(n, dtype, comm, rank):
    """MPI_MAX drops NaN and has no bool form; numpy's max propagates NaN and takes bools."""
    def block(r):
        a = data(r, (4, 6), "float64")
        if np.dtype(dtype).kind == "f":
            a[r % 4, :: r + 1] = np.nan  # a NaN on some ranks only, in different places
            a[3, 5] = -0.0 if r % 2 else 0.0
        return a.astype(dtype) if dtype != "bool" else a > 0
    inputs = [block(r) for r in range(n)]
    for op, ref in (("max", np.max(inputs, 0)), ("min", np.min(inputs, 0))):
        out = comm.all_reduce(inputs[rank], op=op)
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, ref)  # NaN where numpy has NaN
        theirs = comm._c.allgather(_bits(out))
        assert len(set(theirs)) == 1, f"{op}: ranks got different bits"
        got = comm.reduce_scatter(np.concatenate([inputs[rank]] * n), op=op)
        np.testing.assert_array_equal(got, ref)
    if dtype == "bool":  # numpy's sum of bool arrays is their OR; MPICH has no SUM for bools
        np.testing.assert_array_equal(comm.all_reduce(inputs[rank]), np.logical_or.reduce(inputs))
        with pytest.raises(TypeError, match=r"'avg' needs a floating dtype, got bool"):
            comm.all_reduce(inputs[rank], op="avg")


@pytest.mark.ranks(2, timeout=120)
def test_ranks_in_different_checked_calls_fail_together_naming_each(comm, rank):
    with pytest.raises(RuntimeError, match=r"different collective calls \(rank 0 in "
                                           r"distribute_tensor, rank 1 in checkpoint\.save\)"):
        if rank == 0:
            comm.check_same("distribute_tensor", shape=(2, 3))
        else:
            comm.check_same("checkpoint.save", path="ck")
