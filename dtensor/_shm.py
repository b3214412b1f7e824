"""all_reduce through memory the ranks of one node share: the path comm.py takes when a group's
ranks all sit on one node (NCCL and vLLM keep such an intra-node path beside the network one).

Each rank owns a segment of an MPI shared window: a header and ``SLOTS`` slots. For its k-th
all_reduce a rank posts the call (its operand copied into slot k % SLOTS, then the operand's
size and dtype, then k), waits until every peer has posted call k, and reduces the peers' slots
itself, in rank order, so every rank computes the same bits; then it marks the slot read. No
message has to be moved along by anyone: a rank that posts early goes on with its work, and
the reduction needs no MPI call, where MPICH's shared-memory path copies through its own
cells, in a reduce-scatter and an all-gather (benchmarks/collectives.py).

Every call of the group posts its size and dtype, also one too large for a slot (those then go
to MPI, together): ranks that passed different sizes or dtypes all raise, naming each rank's.

A slot is reused SLOTS calls later, once every rank has read it. A rank that comes back to a
slot whose call it has not reduced yet (a handle not waited for, or waited later) reduces it
then, into that call's result. So with the group's collectives issued in the same order on
every rank (as MPI requires), a rank waiting for a slot waits only for peers that will get
there, in whatever order the ranks wait for their handles.
"""
from __future__ import annotations

import os
import time

import numpy as np

from dtensor.errors import CollectiveError

SLOTS = 4
_LINE = 8  # int64s in a cache line: each header row on lines of its own
_HEADER = 3 * 2 * _LINE * 8  # posted[SLOTS], read[SLOTS], meta[SLOTS]
MIN_SLOT = 64 << 10
# each reduce op's ufunc: for this path, and for comm.py's numpy-semantics MPI ops (max/min of
# floats, bools)
UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


def enabled() -> bool:
    """DTENSOR_SHM_ALLREDUCE: ``0`` sends every all_reduce through MPI."""
    return os.environ.get("DTENSOR_SHM_ALLREDUCE", "1") not in ("0", "")


def slot_bytes(ranks: int) -> int:
    """The largest operand (bytes) a slot takes: DTENSOR_SHM_BYTES (default 8 MiB), less where
    /dev/shm could not hold every rank's slots twice over (a tmpfs page is charged when first
    written, and a window that outgrows it fails then, with SIGBUS); 0: no room."""
    text = os.environ.get("DTENSOR_SHM_BYTES", str(8 << 20))
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"DTENSOR_SHM_BYTES={text!r} must be a number of bytes (0 or more).")
    try:
        st = os.statvfs("/dev/shm")
        limit = min(limit, st.f_bavail * st.f_frsize // (2 * SLOTS * ranks))
    except OSError:
        pass  # no /dev/shm: MPI maps its windows elsewhere, and says so if it cannot
    return limit if limit >= MIN_SLOT else 0


def yield_seconds(ranks: int) -> float:
    """How long a waiting rank polls, yielding its core, before it sleeps between polls: 50 ms
    while each rank of the node has a core, none when the node's ranks (LOCAL_WORLD_SIZE, else
    the group's) outnumber its cores. There CFS barely honours sched_yield, and a rank that polls
    keeps the core from the one it waits for (launcher/bootstrap.py measured MPICH's polling:
    nanosleep-based waiting halved a straggler's time at 8 ranks on 2 cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or ranks
    return 0.05 if local <= cores else 0.0


# The wait the main thread polls in now, a new 1-tuple (its start, time.time()) for each wait,
# else None. dtlaunch's deadlock check (launcher/bootstrap.py) reads it: a rank blocked in MPI
# runs no Python, which that check tests for, but this wait is a Python loop; the same wait
# seen twice tells instead.
POLLING: tuple | None = None


def spin(ready, patience: float) -> None:
    """Return once ``ready()``: poll and yield for ``patience`` seconds, then sleep between
    polls in growing steps up to 1 ms."""
    global POLLING
    if ready():
        return
    start, pause = time.monotonic(), 1e-5
    POLLING = (time.time(),)
    try:
        while not ready():
            if time.monotonic() - start < patience:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
    finally:
        POLLING = None


class Segments:
    """One group's shared window: every rank's header and its slots of ``slot_bytes``."""

    def __init__(self, mpi_comm, slot_bytes: int):
        from mpi4py import MPI
        self.slot_bytes = slot_bytes
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        size = _HEADER + SLOTS * slot_bytes
        self.win = MPI.Win.Allocate_shared(size, 1, comm=mpi_comm)
        self.win.Lock_all()  # one passive epoch for the window's life: Sync is its barrier
        self.posted, self.read, self.meta, self.slots = [], [], [], []
        for p in range(self.size):
            buf, _ = self.win.Shared_query(p)
            mem = np.frombuffer(buf, np.uint8, count=size)
            head = mem[:_HEADER].view(np.int64)
            for row, name in enumerate((self.posted, self.read, self.meta)):
                name.append(head[2 * _LINE * row:2 * _LINE * row + SLOTS])
            self.slots.append([mem[_HEADER + s * slot_bytes:_HEADER + (s + 1) * slot_bytes]
                               for s in range(SLOTS)])
        for row in (self.posted, self.read, self.meta):
            row[self.rank][:] = 0
        self.patience = yield_seconds(self.size)
        self.seq = 0
        # k -> (ufunc, out, own) of this rank's calls not reduced yet; own: the operand
        # itself where it stays unchanged until the reduction, else None
        self.unreduced: dict = {}
        self.done: dict = {}  # k -> out of those reduced early, until their handle asks
        mpi_comm.Barrier()  # every header zeroed before anyone posts

    def post(self, x: np.ndarray, ufunc=None, out=None, kept: bool = False) -> int:
        """Post this rank's next call: ``x`` copied into a slot when ``ufunc`` (the reduction
        into ``out``) is given, else its size and dtype only. ``kept``: the caller leaves ``x``
        as it is until the call is reduced (a blocking call, or ``out`` is ``x``), so the
        reduction may read it instead of its copy. Returns the call's number."""
        self.seq += 1
        k, s = self.seq, self.seq % SLOTS
        if k - SLOTS in self.unreduced:  # the slot's last call, not reduced here yet
            self.done[k - SLOTS] = self.reduce(k - SLOTS)
        if k > SLOTS:  # ... and read by every peer
            spin(lambda: all(self.read[p][s] >= k - SLOTS for p in range(self.size)),
                 self.patience)
        if ufunc is not None:
            mine = self.slots[self.rank][s][:x.nbytes].view(x.dtype).reshape(x.shape)
            np.copyto(mine, x)
            self.unreduced[k] = (ufunc, out, x if kept else None)
        self.meta[self.rank][s] = x.nbytes << 8 | x.dtype.num
        self.win.Sync()  # the operand and its size before the call's number
        self.posted[self.rank][s] = k
        return k

    def arrived(self, k: int) -> bool:
        s = k % SLOTS
        return all(self.posted[p][s] >= k for p in range(self.size))

    def agree(self, k: int, what: str) -> None:
        """Wait until every rank has posted call ``k``; raise on every rank if their sizes or
        dtypes differ. A call with no operand (one for MPI) is then read."""
        spin(lambda: self.arrived(k), self.patience)
        self.win.Sync()
        s = k % SLOTS
        metas = [int(self.meta[p][s]) for p in range(self.size)]
        differ = len(set(metas)) > 1
        if differ:
            self.unreduced.pop(k, None)  # (nothing to reduce)
        if k not in self.unreduced:
            self.read[self.rank][s] = k
        if differ:
            each = ", ".join(f"rank {p}: {m >> 8} bytes of {_DTYPE_OF.get(m & 255, m & 255)}"
                             for p, m in enumerate(metas))
            raise CollectiveError(f"{what} #{k} on a shared-memory group: the ranks passed "
                                  f"buffers of different sizes or dtypes ({each}); every rank "
                                  f"must pass the same shape and dtype.")

    def reduce(self, k: int) -> np.ndarray:
        """Call ``k``'s result: the peers' operands reduced in rank order into its ``out``."""
        if k in self.done:
            return self.done.pop(k)
        self.agree(k, "all_reduce")
        ufunc, out, own = self.unreduced.pop(k)
        s, n = k % SLOTS, out.nbytes
        parts = [self.slots[p][s][:n].view(out.dtype).reshape(out.shape)
                 for p in range(self.size)]
        if own is not None and self.rank < 2:
            # The operand itself, not its copy (the same bits): it is in cache, and reduced in
            # place (out is x) the sum then writes only lines it has just read (1 MB at 2 ranks
            # 0.23 -> 0.15 ms, benchmarks/collectives.py). Ranks 0 and 1 only: the first fold
            # reads their parts before anything is written to out, which may be x.
            parts[self.rank] = own
        ufunc(parts[0], parts[1], out=out)
        for part in parts[2:]:
            ufunc(out, part, out=out)
        self.win.Sync()  # done reading before the slot is given back
        self.read[self.rank][s] = k
        return out


_DTYPE_OF = {np.dtype(t).num: np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
    "float32", "float64", "complex64", "complex128")}


class Posted:
    """A posted call as a request (Work's interface): ``Test`` whether every rank has posted
    it, ``Wait`` till then; the reduction is the Work's finish."""

    __slots__ = ("seg", "k")

    def __init__(self, seg: Segments, k: int):
        self.seg, self.k = seg, k

    def Test(self) -> bool:  # noqa: N802 - MPI's request spelling, which Work calls
        return self.k in self.seg.done or self.seg.arrived(self.k)

    def Wait(self) -> None:  # noqa: N802
        spin(self.Test, self.seg.patience)
