"""Run a numpy kernel over row blocks of its arrays, on this rank's threads.

numpy runs one ufunc at a time over whole arrays, single-threaded: a fused expression of k
ufuncs streams every operand through memory k times on one core. Splitting the arrays into
cache-sized row blocks keeps a fused kernel's temporaries in cache, and ufuncs release the GIL,
so blocks run in parallel on ``num_threads()`` threads (one per core available to this rank;
set ``DTENSOR_NUM_THREADS`` or ``OMP_NUM_THREADS``, as dtlaunch does per rank).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_BLOCK_BYTES = 1 << 17  # ~128 KiB per operand block: a kernel's few temporaries stay in L2
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def num_threads() -> int:
    for var in ("DTENSOR_NUM_THREADS", "OMP_NUM_THREADS"):
        v = os.environ.get(var)
        if v and v.isdigit() and int(v) > 0:
            return int(v)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _get_pool(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
    if _pool is None or _pool_threads != n:
        _pool = ThreadPoolExecutor(n, thread_name_prefix="dtensor-blockwise")
        _pool_threads = n
    return _pool


def run_rows(kernel, arrays: list[np.ndarray], rows: int, row_bytes: int) -> None:
    """Call ``kernel(lo, hi)`` for row ranges covering ``rows`` (the kernel slices ``arrays``).

    Ranges hold about _BLOCK_BYTES of one operand; they are split across threads in contiguous
    groups so each thread streams its own part of memory.
    """
    per = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    starts = list(range(0, rows, per))
    threads = min(num_threads(), len(starts))

    def work(group):
        for s in group:
            kernel(s, min(s + per, rows))

    if threads <= 1:
        work(starts)
        return
    size = -(-len(starts) // threads)
    groups = [starts[i:i + size] for i in range(0, len(starts), size)]
    for f in [_get_pool(threads).submit(work, g) for g in groups]:
        f.result()


def pointwise(kernel, out: np.ndarray, *ins: np.ndarray) -> np.ndarray:
    """``kernel(out_block, *in_blocks)`` over flat blocks of same-shape C-contiguous arrays."""
    flat = [a.reshape(-1) for a in (out,) + ins]
    n = flat[0].size

    def run(lo, hi):
        kernel(*[a[lo:hi] for a in flat])

    run_rows(run, flat, n, out.itemsize)
    return out


def rowwise(kernel, out: np.ndarray, *ins: np.ndarray) -> np.ndarray:
    """``kernel(out_rows, *in_rows)`` over blocks of rows of arrays viewed as (rows, last dim)."""
    d = out.shape[-1] if out.ndim else 1
    views = [a.reshape(-1, d) for a in (out,) + ins]

    def run(lo, hi):
        kernel(*[v[lo:hi] for v in views])

    run_rows(run, views, views[0].shape[0], d * out.itemsize)
    return out
