"""all_reduce through shared memory (dtensor/_shm.py) on real MPI ranks: the same results as
MPI's path, the same bits on every rank, any number of calls in flight waited in any order,
handles never waited, operands too large for a slot, and mismatched calls that fail on every
rank instead of hanging or reading past a slot.

Each test makes a fresh communicator (a duplicate of the world) so that it opens its own window
under the environment the test sets.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from dtensor.comm import Comm, count_collectives
from dtensor.errors import CollectiveError

RANKS = [pytest.param(n, marks=pytest.mark.ranks(n, timeout=120), id=f"{n}ranks")
         for n in (2, 3, 4)]


def fresh(comm, monkeypatch, **env) -> Comm:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    group = Comm(comm._c.Dup(), comm.ranks)
    group.barrier()  # its first collective opens the window
    return group


def operand(r: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(100 + r)
    if np.dtype(dtype).kind == "f":
        a = rng.standard_normal(shape) * 10 ** rng.uniform(-3, 3, shape)
    elif dtype == "bool":
        a = rng.random(shape) < 0.3
    else:
        a = rng.integers(-1000, 1000, shape)
    return np.asarray(a, dtype)


CASES = [  # (shape, dtype, op)
    ((1000,), "float32", "sum"), ((64, 33), "float64", "sum"), ((257,), "float32", "avg"),
    ((300,), "float32", "max"), ((7, 5), "float64", "min"), ((4096,), "int64", "sum"),
    ((100,), "int32", "max"), ((50,), "bool", "sum"), ((), "float32", "sum"),
    ((0, 3), "float32", "sum"),
]


@pytest.mark.parametrize("n", RANKS)
def test_results_are_the_rank_order_fold_with_the_same_bits_everywhere(n, comm, rank,
                                                                        monkeypatch):
    """Each case through the shared window equals numpy's fold of the operands in rank order
    bit for bit (so every rank holds the same bits), and MPI's path to rounding."""
    group = fresh(comm, monkeypatch)
    assert group._shm is not None  # one node: the window opened
    ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}
    for shape, dtype, op in CASES:
        parts = [operand(r, shape, dtype) for r in range(n)]
        with count_collectives() as log:
            want = functools.reduce(ufunc[op], parts)
            if op == "avg":
                want = want / n
            for async_op in (False, True):
                got = group.all_reduce(parts[rank], op=op, async_op=async_op)
                got = got.wait() if async_op else got
                assert got.dtype == np.dtype(dtype) and got.shape == shape
                np.testing.assert_array_equal(got, want.astype(dtype))
            mine = parts[rank].copy()  # in place (out=x), as a compiled step donates its buffer
            assert group.all_reduce(mine, op=op, out=mine) is mine
            np.testing.assert_array_equal(mine, want.astype(dtype))
            mpi = comm.all_reduce(parts[rank], op=op)  # the world: opened with its first call
            np.testing.assert_allclose(mpi, want, rtol=1e-6 if dtype == "float32" else 1e-12)
        # each call counted once, as on MPI's path
        assert log.summary() == {"all_reduce": (4, 4 * parts[0].nbytes)}, (shape, dtype, op)


@pytest.mark.parametrize("n", RANKS)
def test_an_operand_written_over_after_an_async_call_does_not_change_its_result(n, comm, rank,
                                                                              monkeypatch):
    """A reduction may read the caller's operand instead of its copy in the slot only while the
    caller leaves it alone: a blocking call, or one whose result goes over the operand. An async
    call's operand written over before the wait (the copy is what was posted) still gives the
    posted values' sum, and a later in-place call's result is its own."""
    group = fresh(comm, monkeypatch)
    x = np.full(1000, rank + 1.0, np.float32)
    with count_collectives() as log:
        work = group.all_reduce(x, async_op=True)
        x[:] = 1e6  # the caller reuses its buffer before waiting
        y = np.full(1000, 10.0 * (rank + 1), np.float32)
        inplace = group.all_reduce(y, async_op=True, out=y)
        np.testing.assert_array_equal(work.wait(), np.full(1000, n * (n + 1) / 2, np.float32))
        assert inplace.wait() is y
    assert log.summary() == {"all_reduce": (2, 2 * x.nbytes)}
    np.testing.assert_array_equal(y, np.full(1000, 10 * n * (n + 1) / 2, np.float32))


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("order", ["reversed", "interleaved", "never"])
def test_many_calls_in_flight_waited_in_any_order_or_never(n, order, comm, rank, monkeypatch):
    """More calls in flight than the window has slots, waited in reverse, interleaved with new
    ones, or dropped unwaited: every waited result is right and nothing hangs (a slot's call
    not yet reduced is reduced when its slot comes round again)."""
    group = fresh(comm, monkeypatch)
    calls = 11
    works = [group.all_reduce(np.full(500, rank + 10 * k, np.float32), async_op=True)
             for k in range(calls if order != "interleaved" else 3)]
    want = lambda k: np.full(500, n * (n - 1) / 2 + n * 10 * k, np.float32)  # noqa: E731
    if order == "reversed":
        for k in reversed(range(calls)):
            np.testing.assert_array_equal(works[k].wait(), want(k))
    elif order == "interleaved":
        for k in range(3, calls):
            np.testing.assert_array_equal(works[k - 3].wait(), want(k - 3))
            works.append(group.all_reduce(np.full(500, rank + 10 * k, np.float32),
                                          async_op=True))
        for k in range(calls - 3, calls):
            np.testing.assert_array_equal(works[k].wait(), want(k))
    # afterwards (the dropped handles too) the group goes on as before
    for k in range(6):
        np.testing.assert_array_equal(group.all_reduce(np.full(3, rank + 1.0)),
                                      np.full(3, n * (n + 1) / 2))


@pytest.mark.parametrize("n", RANKS)
def test_an_operand_larger_than_a_slot_goes_to_mpi(n, comm, rank, monkeypatch):
    group = fresh(comm, monkeypatch, DTENSOR_SHM_BYTES=str(64 << 10))
    assert group._shm.slot_bytes == 64 << 10
    sizes = (16 << 10, 100 << 10, 16 << 10)  # elements of float32: in, over, in a slot
    with count_collectives() as log:
        for size in sizes:
            parts = [operand(r, (size,), "float32") for r in range(n)]
            got = group.all_reduce(parts[rank])
            np.testing.assert_allclose(got, functools.reduce(np.add, parts), rtol=1e-5,
                                       atol=1e-5 * np.abs(parts).sum(0).max())
    assert log.summary() == {"all_reduce": (3, 4 * sum(sizes))}  # the size agreement uncounted


@pytest.mark.ranks(2, timeout=120)
@pytest.mark.parametrize("env", [{"DTENSOR_SHM_ALLREDUCE": "0"}, {"DTENSOR_SHM_BYTES": "100"}])
def test_disabled_or_no_room_means_mpi(env, comm, rank, monkeypatch):
    group = fresh(comm, monkeypatch, **env)
    assert group._shm is None and group._shm_ok is False
    np.testing.assert_array_equal(group.all_reduce(np.full(4, rank + 1.0)), np.full(4, 3.0))


MISMATCHES = [  # rank 1's operand against the others' (shape, dtype), slot 64 KiB
    ("size, both in a slot", ((100,), "float32"), ((101,), "float32")),
    ("dtype of the same size", ((100,), "float32"), ((100,), "int32")),
    ("one in a slot, one for MPI", ((100,), "float32"), ((40000,), "float32")),
]


@pytest.mark.ranks(3, timeout=120)
@pytest.mark.parametrize("what, mine, theirs", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatched_operands_fail_on_every_rank_naming_each(what, mine, theirs, comm, rank,
                                                            monkeypatch):
    """Different sizes or dtypes raise on every rank, each rank's named (MPI's own path would
    truncate on some ranks and hang or abort on others), and the group stays usable."""
    group = fresh(comm, monkeypatch, DTENSOR_SHM_BYTES=str(64 << 10))
    shape, dtype = theirs if rank == 1 else mine
    with pytest.raises(CollectiveError, match=r"all_reduce #\d+ on a shared-memory group: the "
                       r"ranks passed buffers of different sizes or dtypes \(rank 0: \d+ bytes "
                       r"of \w+, rank 1: .*\); every rank must pass the same shape and dtype"):
        group.all_reduce(np.ones(shape, dtype))
    np.testing.assert_array_equal(group.all_reduce(np.full(2, rank + 1.0)), np.full(2, 6.0))


@pytest.mark.ranks(3, timeout=120)
def test_a_window_that_fails_on_one_rank_leaves_every_rank_on_mpi(comm, rank, monkeypatch):
    """MPI may refuse a shared window (its transport, the OS's limits): if it does on any rank,
    every rank of the group stays with MPI's path, and all_reduce still agrees."""
    from mpi4py import MPI

    from dtensor import _shm
    made = _shm.Segments

    def refusing(mpi_comm, slot):
        seg = made(mpi_comm, slot)  # collective: every rank makes it, one then refuses
        if rank == 1:
            raise MPI.Exception(MPI.ERR_NO_MEM)
        return seg

    monkeypatch.setattr(_shm, "Segments", refusing)
    group = fresh(comm, monkeypatch)
    assert group._shm is None and group._shm_ok is False
    np.testing.assert_array_equal(group.all_reduce(np.full(4, rank + 1.0)), np.full(4, 6.0))
