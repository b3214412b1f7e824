"""How long idle BLAS threads spin, arranged when dtensor loads (in every process, not only
under dtlaunch), so that ``python train.py`` runs at a dtlaunch rank's speed.
"""
from __future__ import annotations

import ctypes
import os

# After each multi-threaded GEMM, OpenBLAS's workers spin (sched_yield) for 2^28 cycles, ~0.1 s,
# before they sleep, taking the cores that the C backend's kernel threads (and any other work)
# run on next; 2^20 cycles (~0.3 ms) still outlasts the gap between back-to-back GEMMs, and 2^4
# made eager steps slower (workers asleep between GEMMs). Shown by
# ``python benchmarks/gpt_step.py --compile --backend c`` against the same with
# OPENBLAS_THREAD_TIMEOUT=28 (OpenBLAS's default). dtlaunch sets the same for its ranks
# (launcher/bootstrap.py keeps its own copy: it imports nothing from dtensor).
BLAS_SPIN_VARS = {"OPENBLAS_THREAD_TIMEOUT": "20"}


def shorten_blas_spin() -> None:
    """Set :data:`BLAS_SPIN_VARS` where the user has not, and make an OpenBLAS that is already
    loaded use them.

    OpenBLAS reads the variables when it loads and its worker threads keep the timeout they
    started with. Where numpy was imported first, each loaded OpenBLAS re-reads its
    environment and stops its workers (what it does itself before a fork); its next threaded
    call starts them again with the new timeout. A user's own value is never overridden.
    """
    added = {k: v for k, v in BLAS_SPIN_VARS.items() if k not in os.environ}
    if not added:
        return
    os.environ.update(added)
    for path in _loaded_openblas():
        try:  # RTLD_NOLOAD: the handle of the copy already mapped, never a new load
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        # Both are exported by pthreads builds (numpy's and scipy's wheels, distributions'
        # libopenblas); a build without them keeps its timeout.
        if hasattr(lib, "openblas_read_env") and hasattr(lib, "blas_thread_shutdown_"):
            lib.openblas_read_env()
            lib.blas_thread_shutdown_()


def _loaded_openblas() -> list[str]:
    """Shared libraries of this process whose file name says OpenBLAS (Linux; else none)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line}
    except OSError:  # no procfs (macOS, Windows): only a BLAS loaded after dtensor is arranged
        return []
    return sorted(p for p in paths if "openblas" in os.path.basename(p).lower())
