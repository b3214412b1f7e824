"""Run a fused numpy kernel over cache-sized blocks of its arrays.

numpy runs one ufunc at a time over whole arrays: a fused expression of k ufuncs streams every
operand through memory k times. Calling the kernel on blocks of about a MiB keeps its
temporaries in cache, so only the inputs and the output travel to memory once.

Blocks run on the calling thread: a second thread does not pay here, since handing it work
costs a futex wake and a GIL hand-off each way, between GEMMs OpenBLAS's workers spin on the
other cores, and per-ufunc overhead holds the GIL (benchmarks/gpt_step.py, eager).
"""
from __future__ import annotations

import numpy as np

# 1 MiB per operand block: a kernel's few temporaries stay in L3, not L2, but every block costs
# each of its ufuncs' overhead, which smaller blocks pay more often (benchmarks/gpt_step.py,
# eager).
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
