"""Run a fused numpy kernel over cache-sized blocks of its arrays.

numpy runs one ufunc at a time over whole arrays: a fused expression of k ufuncs streams every
operand through memory k times. Calling the kernel on blocks of about a MiB keeps its
temporaries in cache, so only the inputs and the output travel to memory once.

Blocks run on the calling thread. Splitting them over a second thread was measured slower on the
benchmark machine (2 cores): between GEMMs, OpenBLAS's worker threads spin on the other core,
and per-ufunc overhead holds the GIL. A pool of dtensor's own (OpenBLAS set to one thread, GEMMs
and row ranges split over two threads) was no faster either: handing work to a waiting thread
costs ~125 us there (a futex wake and a GIL hand-off each way), as much as the split saves.
"""
from __future__ import annotations

import numpy as np

# 1 MiB per operand block: a kernel's few temporaries stay in L3, not L2, but every block costs
# each of its ufuncs' overhead (1.5-3 us), and that weighs more here. The standard workload's
# eager step, paired A/B runs: 512 KiB blocks 2-4% faster than 256 KiB, 1 MiB another ~1%,
# 2 MiB no better.
_BLOCK_BYTES = 1 << 20


def run_rows(kernel, rows: int, row_bytes: int) -> None:
    """Call ``kernel(lo, hi)`` over consecutive row ranges of ~_BLOCK_BYTES covering ``rows``."""
    per = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    for lo in range(0, rows, per):
        kernel(lo, min(lo + per, rows))


def pointwise(kernel, out: np.ndarray, *ins: np.ndarray) -> np.ndarray:
    """``kernel(out_block, *in_blocks)`` over flat blocks of same-shape C-contiguous arrays."""
    flat = [a.reshape(-1) for a in (out,) + ins]
    run_rows(lambda lo, hi: kernel(*[a[lo:hi] for a in flat]), flat[0].size, out.itemsize)
    return out


def rowwise(kernel, out: np.ndarray, *ins: np.ndarray) -> np.ndarray:
    """``kernel(out_rows, *in_rows)`` over blocks of rows of arrays viewed as (rows, last dim)."""
    d = out.shape[-1] if out.ndim else 1
    views = [a.reshape(-1, d) for a in (out,) + ins]
    run_rows(lambda lo, hi: kernel(*[v[lo:hi] for v in views]), views[0].shape[0],
             d * out.itemsize)
    return out
