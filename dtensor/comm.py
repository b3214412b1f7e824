"""Communication: the Comm interface over MPI (mpi4py's buffer API, no pickling on the data path).

Every collective takes and returns contiguous numpy arrays and has a non-blocking form
(``async_op=True`` returns a :class:`Work` whose ``wait()`` gives the result). Uneven sizes use
MPI's v-collectives (Allgatherv, Reduce_scatter with counts, Alltoallv), so nothing is padded.
A world of one needs no mpiexec: MPI starts as a singleton. Sub-communicators are made once per
partition of ranks with ``Split`` and cached. all_reduce within one node goes through shared
memory instead of MPI's messages (dtensor/_shm.py; ``DTENSOR_SHM_ALLREDUCE=0`` turns it off).

``count_collectives()`` records every collective issued (kind, group, bytes) so tests can assert
exact counts. ``bytes`` is the size of the logical buffer of the collective: the input of
all_reduce / reduce_scatter / all_to_all / broadcast / send, the gathered output of all_gather.

Example (run under ``dtlaunch --nproc 2``):
    >>> comm = dtensor.comm.get_world()
    >>> comm.all_reduce(np.ones(3) * comm.rank)       # [1., 1., 1.] on both ranks
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from dtensor import _shm, flight, observe
from dtensor.errors import CollectiveError

__all__ = ["Comm", "Work", "get_world", "count_collectives", "CollectiveLog", "CollectiveEvent",
           "REDUCE_OPS", "collective_timeout"]

REDUCE_OPS = ("sum", "avg", "max", "min")


# ----------------------------------------------------------------------------- debug counter

@dataclass(frozen=True)
class CollectiveEvent:
    kind: str
    group: tuple[int, ...]  # global ranks of the communicator
    bytes: int
    dtype: str


@dataclass
class CollectiveLog:
    """The collectives issued inside one ``count_collectives()`` block, in order."""

    events: list[CollectiveEvent] = field(default_factory=list)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for e in self.events if kind is None or e.kind == kind)

    def bytes(self, kind: str | None = None) -> int:
        return sum(e.bytes for e in self.events if kind is None or e.kind == kind)

    def summary(self) -> dict[str, tuple[int, int]]:
        """kind -> (count, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.events:
            n, b = out.get(e.kind, (0, 0))
            out[e.kind] = (n + 1, b + e.bytes)
        return out


class _Logs(threading.local):
    active: list = []


_logs = _Logs()
# Flight entries that are not the program's own collectives: a recv (its send is counted) and
# a ranks' agreement check. The debug counter and CommDebugMode skip them.
UNCOUNTED = frozenset({"recv", "agreement"})
# the collectives of a whole group (not send/recv, nor agreement checks, which must time out
# when a rank never comes): the first of them opens the group's shared window
_OPENS_SHM = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                        "broadcast", "barrier"})
# Open count_collectives() blocks over all threads: the collectives test this plain global
# first, a thread-local lookup only when some block is open (see _ready on why it matters).
_LOGGING = 0
_LOGGING_LOCK = threading.Lock()


@contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every collective issued by this thread inside the block.

    Example:
        >>> with count_collectives() as log:
        ...     comm.all_reduce(x)
        >>> log.count("all_reduce")
        1
    """
    global _LOGGING
    log = CollectiveLog()
    _logs.active = _logs.active + [log]
    with _LOGGING_LOCK:
        _LOGGING += 1
    try:
        yield log
    finally:
        with _LOGGING_LOCK:
            _LOGGING -= 1
        _logs.active = [x for x in _logs.active if x is not log]


# ----------------------------------------------------------------------------- handles

class Work:
    """Handle of a non-blocking collective. ``wait()`` completes it and returns its result."""

    __slots__ = ("_req", "_finish", "_result", "_done", "_entry")

    def __init__(self, req, finish: Callable[[], object], entry=None):
        self._req, self._finish, self._done, self._result = req, finish, False, None
        self._entry = entry  # the collective's flight entry: ends when the wait does

    def wait(self):
        if not self._done:
            if self._req is not None:
                flight.WAITING = self._entry
                try:
                    self._req.Wait()
                finally:
                    flight.WAITING = None
            self._result = self._finish()
            self._done = True
            self._req = self._finish = None
            if self._entry is not None:
                _ended(self._entry)
        return self._result

    def is_completed(self) -> bool:
        if not self._done and self._req is not None and self._req.Test():
            self.wait()
        return self._done or self._req is None


def _ended(entry) -> None:
    flight.ended(entry)
    for o in observe.OBSERVERS:
        o.on_collective(entry, True)


def _done(value) -> Work:
    w = Work(None, lambda: value)
    w.wait()
    return w


# ----------------------------------------------------------------------------- Comm

_MPI = None


def _mpi():
    global _MPI
    if _MPI is None:
        from mpi4py import MPI  # imported on first use: single-process dtensor never starts MPI
        _MPI = MPI
    return _MPI


# Checked per call: a set of dtype objects (dtype.name is a slow property on the hot path).
_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", "int8", "int16",
                                          "int32", "int64", "uint8", "bool"))


# numpy's builtin dtypes are singletons: id() tells a supported one without hashing a dtype.
_DTYPE_IDS = frozenset(id(d) for d in _DTYPES)


_BYTE = np.dtype(np.uint8)


def _ready(x) -> bool:
    """Whether ``x`` goes to MPI as it is: a C-contiguous ndarray of a supported builtin dtype.

    The collectives' Python runs right after the previous large collective's copies have
    flushed the CPU caches, where every distinct numpy attribute read or helper call misses
    (benchmarks/collectives.py, a 4 MB all_gather at 2 ranks). So the common case reads as
    few as it can: dtype identity, one flags read, each array's shape once.
    """
    return type(x) is np.ndarray and id(x.dtype) in _DTYPE_IDS and x.flags.c_contiguous


def _contig(x) -> np.ndarray:
    if _ready(x):
        return x
    x = np.asarray(x)
    if x.dtype not in _DTYPES:
        raise TypeError(f"collectives take numeric numpy arrays, got dtype {x.dtype}.")
    # (np.ascontiguousarray would turn a 0-d array into a 1-d one.)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(x.shape)


def _held_refs(held: list, i: int) -> int:
    return sys.getrefcount(held[i])


# What _held_refs counts for an array that only its list holds, measured on this interpreter.
_ONLY_HELD = _held_refs([np.empty(1)], 0)


class _Results:
    """Result arrays of collectives, handed out again once the caller has dropped them.

    A fresh ``np.empty`` per call costs a page fault per 4 KiB page whenever the allocator has
    given the memory back to the OS, which glibc does after MPI's own large temporaries come and
    go (benchmarks/collectives.py, ``ratio`` against ``ratio_out``). This keeps the last few
    results of each shape and dtype, as PyTorch's caching allocator does, and reuses one only
    when no other object references it (a view of it holds a reference through ``.base``, an
    in-flight ``Work`` through its closure). Arrays that only the cache holds take at most
    ``_BYTES`` (checked when a new array is made, so the latest result comes on top); arrays
    still in use are not counted: they would exist anyway.
    """

    _PER_KEY = 2
    _BYTES = 256 << 20

    def __init__(self):
        self._held: dict[tuple, list] = {}  # (shape, dtype) -> arrays, least recent key first
        self._lock = threading.Lock()

    def take(self, shape: tuple, dtype) -> np.ndarray:
        key = (shape, dtype)
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                self._held[key] = held  # most recently used last
                for i in range(len(held)):
                    if _held_refs(held, i) <= _ONLY_HELD:
                        return held[i]
            return self._miss(key, held)

    def _miss(self, key: tuple, held: list | None) -> np.ndarray:
        shape, dtype = key
        if math.prod(shape) * dtype.itemsize > self._BYTES:  # more than may be kept idle
            return np.empty(shape, dtype)
        if held is None:
            held = self._held[key] = []
        arr = np.empty(shape, dtype)
        held.append(arr)
        if len(held) > self._PER_KEY:
            del held[0]
        self._evict()
        return arr

    def _evict(self) -> None:
        """Drop idle arrays, least recently used keys first, until the idle ones fit."""
        total = sum(held[i].nbytes for held in self._held.values() for i in range(len(held))
                    if _held_refs(held, i) <= _ONLY_HELD)
        for key in list(self._held):
            held, i = self._held[key], 0
            while i < len(held) and total > self._BYTES:
                if _held_refs(held, i) <= _ONLY_HELD:
                    total -= held.pop(i).nbytes
                else:
                    i += 1
            if not held:
                del self._held[key]
            if total <= self._BYTES:
                return


_RESULTS = _Results()


def _out(out, shape, dtype, what: str) -> np.ndarray:
    if out is None:
        return _RESULTS.take(shape, dtype)
    # (dtype identity first: a dtype comparison is slow numpy code, see _ready)
    if (out.shape != shape or not (out.dtype is dtype or out.dtype == dtype)
            or not out.flags.c_contiguous):
        raise ValueError(f"{what}: out must be a C-contiguous {np.dtype(dtype)} array of shape "
                         f"{tuple(shape)}, got {out.dtype} {out.shape}"
                         f"{'' if out.flags.c_contiguous else ' (not C-contiguous)'}.")
    return out


def _axis_first(x: np.ndarray, axis: int, out, what: str) -> np.ndarray:
    """``x`` with ``axis`` moved to the front, contiguous: MPI gathers and scatters along dim 0
    (the result is moved back, so a preallocated ``out`` cannot be written directly)."""
    if out is not None:
        raise ValueError(f"{what}(out=...) needs axis=0; {what} along dim 0 and move the "
                         f"result's dim yourself.")
    return np.ascontiguousarray(np.moveaxis(x, axis, 0))


_REDUCE: dict = {}


def _reduce_table() -> dict:
    MPI = _mpi()
    _REDUCE.update(sum=MPI.SUM, avg=MPI.SUM, max=MPI.MAX, min=MPI.MIN)
    return _REDUCE


_NUMPY_OPS: dict = {}
_ABANDONED: list = []  # (request, buffer) of agreement waits that timed out


def _numpy_op(op: str, dtype: np.dtype):
    """A reduction as numpy computes it, for the dtypes where MPI's builtin ops differ.

    MPI_MAX/MIN drop NaN (C's comparisons), so a "replicated" max could differ by rank from
    numpy's, which propagates it; and MPICH has no MAX or SUM for bools (numpy's bool sum of
    two arrays is their OR). The op is declared non-commutative so that MPI combines the
    operands in rank order: every rank then gets the same bits (which of two NaNs, or of -0.0
    and 0.0, survives).
    """
    key = (op, dtype)
    if key not in _NUMPY_OPS:
        ufunc = _shm.UFUNCS[op]

        def combine(inbuf, inoutbuf, datatype):  # inoutbuf = inbuf (lower rank) op inoutbuf
            a = np.frombuffer(inbuf, dtype)
            b = np.frombuffer(inoutbuf, dtype)
            ufunc(a, b, out=b)

        _NUMPY_OPS[key] = _mpi().Op.Create(combine, commute=False)
    return _NUMPY_OPS[key]


def _even_sizes(total: int, n: int, what: str) -> list[int]:
    if total % n:
        raise ValueError(f"{what}: dim of size {total} does not split evenly over {n} ranks; "
                         f"pass sizes=[...] (one length per rank) for an uneven split.")
    return [total // n] * n


class Comm:
    """A communicator: the ranks of one process group and its collectives.

    Attributes:
        rank: this process's rank in the group. size: number of ranks.
        ranks: the group's members as global (world) ranks, in group order.
    """

    def __init__(self, mpi_comm, ranks: tuple[int, ...]):
        self._c = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.ranks = ranks
        self._groups: dict[tuple, Comm] = {}
        self._seq = 0  # collectives issued on this group: the flight recorder's numbers
        _mpi()  # the collectives read _MPI (IN_PLACE) without a call
        self._check = os.environ.get("DTENSOR_COMM_CHECK", "0") not in ("0", "")
        # all_reduce through shared memory (dtensor/_shm.py): the window once opened, and
        # whether the group has one (None: not asked yet)
        self._shm: _shm.Segments | None = None
        self._shm_ok: bool | None = None if self.size > 1 else False

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, size={self.size}, ranks={list(self.ranks)})"

    # -- bookkeeping
    def _record(self, kind: str, shape, nbytes: int, dtype) -> flight.Entry:
        """Start a collective: its flight entry (the debug counter's event, the observers'
        call). Finished by _blocking, or by its Work's wait."""
        self._seq += 1
        e = flight.Entry(self._seq, kind, self.ranks, tuple(shape), dtype, int(nbytes),
                         flight.user_site(3), dict(observe.CAUSE) if observe.CAUSE else None)
        flight.record(e)
        if self.size > 1 and flight.watchdog is None:
            flight.start_watchdog()
        # a send and its recv: one message; an agreement check is not the program's own
        if _LOGGING and _logs.active and kind not in UNCOUNTED:
            ev = CollectiveEvent(kind, self.ranks, int(nbytes), str(np.dtype(dtype)))
            for log in _logs.active:
                log.events.append(ev)
        for o in observe.OBSERVERS:
            o.on_collective(e, False)
        if self._shm_ok is None and kind in _OPENS_SHM:
            self._blocking(e, self._open_shared, end=False)
        return e

    @staticmethod
    def _blocking(entry: flight.Entry, call, *args, end: bool = True, **kwargs):
        """A blocking MPI call of the collective ``entry``, seen by the watchdog while it waits
        (``end``: the call completes the collective)."""
        flight.WAITING = entry
        try:
            out = call(*args, **kwargs)
        except _MPI.Exception as exc:  # left unfinished in the rings: dtlaunch's post-mortem
            raise CollectiveError(     # compares it with the other ranks' calls
                f"MPI failed {flight.describe(entry.as_dict())}: "
                f"{_MPI.Get_error_string(exc.Get_error_class())}"
                + (" -- the ranks passed buffers of different sizes to this collective (a shape "
                   "mismatch): every rank must pass the same shape and dtype (for uneven "
                   "gathers and scatters, pass sizes=[...])." if exc.Get_error_class()
                   == _MPI.ERR_TRUNCATE else "")) from None
        finally:
            flight.WAITING = None
        if end:
            _ended(entry)
        return out

    @staticmethod
    def _op(op: str, dtype):
        """The MPI op of ``op`` on ``dtype``: MPI's own, except max/min of floats and bools."""
        mpi_op = _REDUCE.get(op) if type(op) is str else None
        if mpi_op is None:
            if op not in REDUCE_OPS:
                raise ValueError(f"unknown reduce op {op!r}; use one of {REDUCE_OPS}.")
            mpi_op = _reduce_table()[op]
        if dtype.kind == "f":
            return _numpy_op(op, dtype) if op == "max" or op == "min" else mpi_op
        if op == "avg":
            raise TypeError(f"reduce op 'avg' needs a floating dtype, got {dtype}.")
        return _numpy_op(op, dtype) if dtype.kind == "b" else mpi_op

    def _agree(self, what: str, mine: tuple) -> None:
        """With DTENSOR_COMM_CHECK=1: every rank checks that its peers passed matching buffers.

        One small allgather of (dtype, shape) per collective; a mismatch raises on every rank
        (instead of corrupting data or hanging inside MPI).
        """
        if self.size == 1:
            return
        theirs = self._c.allgather(mine)
        if any(t != theirs[0] for t in theirs):
            raise ValueError(
                f"{what}: ranks passed mismatched buffers: "
                + ", ".join(f"rank {r}: {t}" for r, t in enumerate(theirs))
                + ". Every rank must pass the same dtype and shape (use sizes=[...] for "
                  "uneven gathers/scatters).")

    def _open_shared(self) -> None:
        """Open the group's shared window for all_reduce (dtensor/_shm.py) if it can have one.

        Collective: done by the group's first collective, so that a later mismatch of calls
        (an all_reduce on some ranks, another collective on the others) hangs where the
        watchdog names both, not inside this. The ranks agree that they share one node, all
        enabled it, and on a slot size that /dev/shm has room for."""
        MPI = _mpi()
        node = self._c.Split_type(MPI.COMM_TYPE_SHARED)
        whole = node.Get_size() == self.size
        node.Free()
        mine = _shm.slot_bytes(self.size) if whole and _shm.enabled() else 0
        slot = self._c.allreduce(mine, op=MPI.MIN)
        seg = None
        if slot:
            try:
                seg = _shm.Segments(self._c, slot)
            except MPI.Exception:  # no shared windows here (MPI's transport, the OS's limits)
                seg = None
            if not self._c.allreduce(seg is not None, op=MPI.LAND):
                seg = None  # not on every rank: all stay with MPI (a window made is left be)
        self._shm, self._shm_ok = seg, seg is not None

    def _avg(self, out: np.ndarray, op: str) -> np.ndarray:
        if op == "avg":
            out /= self.size
        return out

    # -- collectives
    def all_reduce(self, x, op: str = "sum", async_op: bool = False,
                   out: np.ndarray | None = None):
        """Element-wise reduction of ``x`` over all ranks; every rank gets the result.

        ``out``: an optional preallocated result buffer (reusing one keeps it hot in cache);
        ``out=x`` reduces in place (MPI_IN_PLACE: no copy of x into the result first).
        A group on one node reduces through shared memory (dtensor/_shm.py), each rank folding
        the operands in rank order, so all get the same bits; operands over a slot's size
        (DTENSOR_SHM_BYTES) and groups across nodes go through MPI.
        """
        x = _contig(x)
        dtype = x.dtype
        mpi_op = self._op(op, dtype)
        if self._check:
            self._agree("all_reduce", (str(dtype), x.shape, op))
        e = self._record("all_reduce", x.shape, x.nbytes, dtype)
        seg = self._shm
        if seg is not None:
            if x.nbytes <= seg.slot_bytes:
                out = out if out is x else _out(out, x.shape, dtype, "all_reduce")
                k = self._blocking(e, seg.post, x, _shm.UFUNCS[op], out,
                                   kept=out is x or not async_op, end=False)
                if async_op:
                    return Work(_shm.Posted(seg, k), lambda: self._avg(seg.reduce(k), op), e)
                return self._avg(self._blocking(e, seg.reduce, k), op)
            # too large for a slot: MPI's, once the ranks agree on the size
            k = self._blocking(e, seg.post, x, end=False)
            self._blocking(e, seg.agree, k, "all_reduce", end=False)
        if out is x:
            send = _MPI.IN_PLACE
        else:
            send, out = x, _out(out, x.shape, dtype, "all_reduce")
        if async_op:
            return Work(self._c.Iallreduce(send, out, op=mpi_op), lambda: self._avg(out, op), e)
        self._blocking(e, self._c.Allreduce, send, out, op=mpi_op)
        return self._avg(out, op)

    def all_gather(self, x, axis: int = 0, sizes: Sequence[int] | None = None,
                   async_op: bool = False, out: np.ndarray | None = None):
        """Concatenate every rank's ``x`` along ``axis`` (rank order).

        Args:
            sizes: each rank's length along ``axis`` when they differ (uneven shards); by
                default all ranks are assumed to pass the same shape.
            out: an optional preallocated result buffer (``axis=0`` only).
        """
        # The even, axis-0 path reads as little as it can: it runs with cold caches (_ready).
        x = _contig(x)
        shape, dtype = x.shape, x.dtype
        if axis:
            axis %= max(len(shape), 1)
        if sizes is None:
            total, even = shape[axis] * self.size, True
        else:
            sizes = [int(s) for s in sizes]
            self._check_sizes("all_gather", sizes, shape[axis])
            total, even = sum(sizes), len(set(sizes)) == 1
        if self._check:
            self._agree("all_gather", (str(dtype), shape[:axis] + shape[axis + 1:]))
        if axis:
            x = _axis_first(x, axis, out, "all_gather")
            shape = x.shape
        out = _out(out, (total,) + shape[1:], dtype, "all_gather")
        e = self._record("all_gather", x.shape, out.nbytes, dtype)
        # Equal sizes take Allgather: MPICH's Allgatherv algorithms are several times slower.
        if even:
            call, args = (self._c.Iallgather if async_op else self._c.Allgather), (x, out)
        else:
            row = math.prod(shape[1:])
            counts = [s * row for s in sizes]
            spec = [out, (counts, np.cumsum([0] + counts[:-1]).tolist())]
            call, args = (self._c.Iallgatherv if async_op else self._c.Allgatherv), (x, spec)
        req = call(*args) if async_op else self._blocking(e, call, *args)
        if not axis:
            return Work(req, lambda: out, e) if async_op else out

        def finish():
            return np.ascontiguousarray(np.moveaxis(out, 0, axis))

        return Work(req, finish, e) if async_op else finish()

    def reduce_scatter(self, x, op: str = "sum", axis: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False,
                       out: np.ndarray | None = None):
        """Reduce ``x`` over all ranks and give rank r the r-th block along ``axis``.

        Args:
            sizes: the length of each rank's block along ``axis``; by default an even split.
            out: an optional preallocated result buffer (``axis=0`` only).
        """
        x = _contig(x)
        shape, dtype = x.shape, x.dtype
        if axis:
            axis %= max(len(shape), 1)
        mpi_op = self._op(op, dtype)
        if sizes is None:
            n = shape[axis] // self.size
            if n * self.size != shape[axis]:
                _even_sizes(shape[axis], self.size, "reduce_scatter")  # raises, says how
            mine, even = n, True
        else:
            sizes = [int(s) for s in sizes]
            if sum(sizes) != shape[axis] or len(sizes) != self.size:
                raise ValueError(f"reduce_scatter: sizes {sizes} must have one entry per rank "
                                 f"({self.size}) and add up to dim {axis} of size "
                                 f"{shape[axis]}.")
            mine, even = sizes[self.rank], len(set(sizes)) == 1
        if self._check:
            self._agree("reduce_scatter", (str(dtype), shape, op))
        e = self._record("reduce_scatter", x.shape, x.nbytes, dtype)
        if axis:
            x = _axis_first(x, axis, out, "reduce_scatter")
            shape = x.shape
        out = _out(out, (mine,) + shape[1:], dtype, "reduce_scatter")
        if even:
            call = self._c.Ireduce_scatter_block if async_op else self._c.Reduce_scatter_block
            args = (x, out)
        else:
            row = math.prod(shape[1:])
            call = self._c.Ireduce_scatter if async_op else self._c.Reduce_scatter
            args = (x, out, [s * row for s in sizes])
        req = call(*args, op=mpi_op) if async_op else self._blocking(e, call, *args, op=mpi_op)
        if not (async_op or axis):
            return self._avg(out, op)

        def finish():
            res = self._avg(out, op)
            return np.ascontiguousarray(np.moveaxis(res, 0, axis)) if axis else res

        return Work(req, finish, e) if async_op else finish()

    def all_to_all(self, x, split_axis: int, concat_axis: int,
                   split_sizes: Sequence[int] | None = None,
                   concat_sizes: Sequence[int] | None = None, async_op: bool = False):
        """Split ``x`` along ``split_axis`` into one block per rank, send block j to rank j, and
        concatenate the received blocks along ``concat_axis`` (rank order).

        Args:
            split_sizes: block lengths along ``split_axis`` (default: an even split).
            concat_sizes: every rank's length of ``x`` along ``concat_axis`` (default: equal).
        """
        x = _contig(x)
        nd = max(x.ndim, 1)
        split_axis, concat_axis = split_axis % nd, concat_axis % nd
        split_sizes = (_even_sizes(x.shape[split_axis], self.size, "all_to_all")
                       if split_sizes is None else [int(s) for s in split_sizes])
        concat_sizes = ([x.shape[concat_axis]] * self.size if concat_sizes is None
                        else [int(s) for s in concat_sizes])
        if sum(split_sizes) != x.shape[split_axis] or len(split_sizes) != self.size:
            raise ValueError(f"all_to_all: split_sizes {split_sizes} must have one entry per "
                             f"rank and add up to {x.shape[split_axis]}.")
        self._check_sizes("all_to_all", concat_sizes, x.shape[concat_axis])
        if self._check:
            self._agree("all_to_all", (str(x.dtype), x.ndim, split_sizes))
        e = self._record("all_to_all", x.shape, x.nbytes, x.dtype)
        starts = np.cumsum([0] + split_sizes).tolist()
        blocks = [np.take(x, range(starts[j], starts[j + 1]), axis=split_axis)
                  for j in range(self.size)]
        send = np.concatenate([b.reshape(-1) for b in blocks]) if blocks else x.reshape(-1)
        send_counts = [b.size for b in blocks]
        mine = split_sizes[self.rank]

        def recv_shape(r):
            s = list(x.shape)
            s[split_axis], s[concat_axis] = mine, concat_sizes[r]
            return s

        recv_counts = [int(np.prod(recv_shape(r))) for r in range(self.size)]
        recv = np.empty(sum(recv_counts), x.dtype)
        sendspec = [send, (send_counts, np.cumsum([0] + send_counts[:-1]).tolist())]
        recvspec = [recv, (recv_counts, np.cumsum([0] + recv_counts[:-1]).tolist())]

        def finish():
            offs = np.cumsum([0] + recv_counts).tolist()
            parts = [recv[offs[r]:offs[r + 1]].reshape(recv_shape(r)) for r in range(self.size)]
            return np.concatenate(parts, axis=concat_axis)

        if async_op:
            return Work(self._c.Ialltoallv(sendspec, recvspec), finish, e)
        self._blocking(e, self._c.Alltoallv, sendspec, recvspec)
        return finish()

    def broadcast(self, x, src: int = 0, async_op: bool = False):
        """Rank ``src``'s ``x`` on every rank (others pass an array of the same shape/dtype)."""
        self._check_rank("broadcast", src)
        x = _contig(x)
        if self._check:
            self._agree("broadcast", (str(x.dtype), x.shape))
        e = self._record("broadcast", x.shape, x.nbytes, x.dtype)
        out = x.copy()
        if async_op:
            return Work(self._c.Ibcast(out, root=src), lambda: out, e)
        self._blocking(e, self._c.Bcast, out, root=src)
        return out

    def send(self, x, dst: int, tag: int = 0, async_op: bool = False):
        """Send ``x`` to rank ``dst`` (the receiver calls ``recv`` with a same-shaped buffer)."""
        self._check_rank("send", dst)
        x = _contig(x)
        e = self._record("send", x.shape, x.nbytes, x.dtype)
        if async_op:
            return Work(self._c.Isend(x, dest=dst, tag=tag), lambda: None, e)
        self._blocking(e, self._c.Send, x, dest=dst, tag=tag)
        return None

    def recv(self, out: np.ndarray, src: int, tag: int = 0, async_op: bool = False):
        """Receive into ``out`` (shape/dtype of the message) from rank ``src``; returns it."""
        self._check_rank("recv", src)
        if not (isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable):
            raise TypeError("recv needs a writeable C-contiguous numpy array to receive into.")
        e = self._record("recv", out.shape, out.nbytes, out.dtype)
        if async_op:
            return Work(self._c.Irecv(out, source=src, tag=tag), lambda: out, e)
        self._blocking(e, self._c.Recv, out, source=src, tag=tag)
        return out

    def barrier(self, async_op: bool = False):
        e = self._record("barrier", (), 0, _BYTE)
        if async_op:
            return Work(self._c.Ibarrier(), lambda: None, e)
        self._blocking(e, self._c.Barrier)
        return None

    # -- agreement: collective entry points that take user metadata, and blocks that may fail
    def check_same(self, what: str, fix: str = "", *, error: BaseException | None = None,
                   **fields) -> None:
        """Collective: raise the same error on every rank unless all passed equal ``fields``.

        Ranks that disagree on metadata would otherwise hang inside MPI or silently compute
        garbage. One allgather of an 8-byte digest of ``repr(fields)`` and ``error``
        (microseconds); only on a mismatch a second one carries the values, so the error names
        the ranks and what each passed. ``error``: this rank's own validation failure, if any:
        when some ranks failed it, every rank raises the lowest failing rank's error (same type
        and message); otherwise a ValueError lists the fields that differ, with ``fix``.
        """
        if self.size == 1:
            if error is not None:
                raise error
            return
        mine = None if error is None else (type(error).__module__, type(error).__qualname__,
                                           str(error))
        text = repr((what, sorted(fields.items()), mine))
        digest = np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), np.int64)
        got = self._allgather_digest(what, digest)
        if (got == got[0]).all():
            if error is not None:  # every rank failed alike: its own error, traceback and all
                raise error
            return
        theirs = self._c.allgather(({k: v if type(v) is str else repr(v)
                                     for k, v in fields.items()}, mine, what))
        calls = {t[2] for t in theirs}
        if len(calls) > 1:  # ranks in different collective calls: a program-order bug
            where = ", ".join(f"rank {self.ranks[r]} in {t[2]}" for r, t in enumerate(theirs))
            raise RuntimeError(f"ranks are in different collective calls ({where}): every rank "
                               f"must make the same collective calls in the same order.")
        failed = [r for r, (_, e, _) in enumerate(theirs) if e is not None]
        if failed:
            mod, name, msg = theirs[failed[0]][1]
            raise _rebuild_error(mod, name, f"{what} failed on rank {self.ranks[failed[0]]}: "
                                            f"{msg}", error) from error
        lines = []
        for k in fields:
            by_value: dict[str, list[int]] = {}
            for r, (t, _, _) in enumerate(theirs):
                by_value.setdefault(t[k], []).append(self.ranks[r])
            if len(by_value) > 1:
                lines.append(f"{k}: " + ", ".join(f"{v} on ranks {rs}"
                                                 for v, rs in by_value.items()))
        raise ValueError(f"{what}: ranks passed different arguments ({'; '.join(lines)}). A "
                         f"collective call needs the same arguments on every rank."
                         + (f" {fix}" if fix else ""))

    def _allgather_digest(self, what: str, digest: np.ndarray) -> np.ndarray:
        """Allgather of one int64 per rank that fails (instead of hanging) when a rank never
        arrives: a collective entry point called on some ranks only."""
        got = np.empty(self.size, np.int64)
        # in the flight recorder and the profiler's timeline too: ranks wait here for each other
        entry = self._record("agreement", digest.shape, digest.nbytes, digest.dtype)
        req = self._c.Iallgather(digest, got)
        if req.Test():
            _ended(entry)
            return got
        limit = collective_timeout()
        start = time.monotonic()
        pause = 1e-4
        flight.WAITING = entry  # the watchdog sees this wait too
        try:
            while not req.Test():
                waited = time.monotonic() - start
                if waited < 0.05:  # peers are usually close behind: yield the core, don't sleep
                    os.sched_yield()
                    continue
                if waited > limit:
                    # A late rank still completes this request: its buffer must outlive us.
                    _ABANDONED.append((req, got))
                    raise TimeoutError(
                        f"{what} is collective: every rank of the group {list(self.ranks)} "
                        f"must call it, and rank {self.ranks[self.rank]} waited {limit:g} s for "
                        f"the others. "
                        f"Call it on every rank (not under `if rank == 0:`), or raise "
                        f"DTENSOR_COLLECTIVE_TIMEOUT if a rank is just slow to get there.")
                time.sleep(pause)
                pause = min(pause * 2, 1e-2)
        finally:
            flight.WAITING = None
        _ended(entry)
        return got

    @contextmanager
    def fail_together(self, what: str) -> Iterator[None]:
        """Collective: run a block on every rank; if it raised on any, raise on every rank.

        A rank whose part of a collective operation fails (a bad path, a full disk) must not
        leave its peers waiting in the next collective: on exit the ranks agree (check_same's
        one allgather) and the lowest failing rank's error is raised everywhere with the same
        type and message, naming that rank. The block must not run collectives that a failing
        rank would skip.
        """
        err: BaseException | None = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every error is shared, then re-raised
            err = e
        self.check_same(what, error=err)

    # -- groups
    def subgroup(self, partition: Sequence[Sequence[int]]) -> "Comm":
        """The communicator of the part of ``partition`` (group-local ranks) containing us.

        Collective: every rank of this group calls it with the same partition. Made once with
        MPI ``Split`` and cached on the partition.
        """
        key = tuple(tuple(int(r) for r in part) for part in partition)
        if key not in self._groups:
            flat = sorted(r for part in key for r in part)
            if flat != list(range(self.size)):
                raise ValueError(f"subgroup: {[list(p) for p in key]} is not a partition of the "
                                 f"{self.size} ranks 0..{self.size - 1} of this group.")
            color = next(i for i, part in enumerate(key) if self.rank in part)
            part = key[color]
            sub = self._c.Split(color, part.index(self.rank))
            self._groups[key] = Comm(sub, tuple(self.ranks[r] for r in part))
        return self._groups[key]

    # -- validation
    def _check_rank(self, what: str, r: int) -> None:
        if not 0 <= r < self.size:
            raise ValueError(f"{what}: rank {r} is out of range for a group of {self.size} "
                             f"ranks (0..{self.size - 1}).")

    def _check_sizes(self, what: str, sizes: list[int], mine: int) -> None:
        if len(sizes) != self.size or any(s < 0 for s in sizes):
            raise ValueError(f"{what}: sizes {sizes} must list one non-negative length per rank "
                             f"({self.size} ranks).")
        if sizes[self.rank] != mine:
            raise ValueError(f"{what}: rank {self.rank} passed length {mine} along the gathered "
                             f"dim but sizes[{self.rank}] = {sizes[self.rank]}.")


def collective_timeout() -> float:
    """Seconds a rank waits at a checked collective entry point for the others
    (DTENSOR_COLLECTIVE_TIMEOUT, default 120)."""
    text = os.environ.get("DTENSOR_COLLECTIVE_TIMEOUT", "120")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"DTENSOR_COLLECTIVE_TIMEOUT={text!r} must be a positive number of "
                         f"seconds.")
    return value


def _rebuild_error(module: str, qualname: str, message: str, local: BaseException | None):
    """An exception of the failing rank's type carrying ``message`` (RuntimeError if that type
    cannot be rebuilt from one string here)."""
    if local is not None and (type(local).__module__, type(local).__qualname__) == (module,
                                                                                   qualname):
        cls = type(local)
    else:
        cls = sys.modules.get(module)
        for part in qualname.split("."):
            cls = getattr(cls, part, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            e = cls(message)
            if str(e) == message or isinstance(e, KeyError):
                return e
        except Exception:  # noqa: BLE001 - a constructor with other arguments
            pass
    return RuntimeError(f"{qualname}: {message}")


_world: Comm | None = None


def get_world() -> Comm:
    """The world communicator (all ranks of the job; a world of one outside mpiexec)."""
    global _world
    if _world is None:
        MPI = _mpi()
        c = MPI.COMM_WORLD
        # An error in a collective (a truncated message: mismatched shapes) raises on the rank
        # that saw it, naming the call, instead of MPICH aborting with its own error stack.
        c.Set_errhandler(MPI.ERRORS_RETURN)
        _world = Comm(c, tuple(range(c.Get_size())))
        if _world.size > 1:  # a rank stuck before its first collective is reported too
            flight.start_watchdog()
    return _world
