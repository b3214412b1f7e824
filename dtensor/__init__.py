"""dtensor: distributed tensor parallelism on numpy + MPI, with a tracing compiler.

Import as ``import dtensor``; the public surface mirrors PyTorch where a name exists there.
"""
from __future__ import annotations

import ctypes
import os
import sys

from dtensor import _threads

# Before numpy where dtensor is imported first: its OpenBLAS reads the variables as it loads.
_threads.shorten_blas_spin()

import numpy as np  # noqa: E402


def _keep_freed_memory() -> None:
    """Keep large freed blocks in glibc's heap instead of returning them to the kernel.

    Every eager op allocates its output; by default glibc serves blocks over 128 KiB-32 MiB with
    fresh mmaps and unmaps them on free, so each step page-faults its activations back in
    (benchmarks/gpt_step.py, eager, with DTENSOR_MALLOC_TUNING=0). Raising the
    mmap and trim thresholds makes freed activations reusable, as a caching allocator would.
    DTENSOR_MALLOC_TUNING=0 turns it off.
    """
    if os.environ.get("DTENSOR_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


_keep_freed_memory()

from dtensor import ops  # noqa: F401  (registers every op before first use)
from dtensor.autograd import enable_grad, is_grad_enabled, no_grad
from dtensor.random import initial_seed, manual_seed
from dtensor.tensor import (Tensor, arange, as_tensor, cat, ones_like, tensor, where, zeros_like,
                            matmul, stack, cos, sin, rsqrt, sigmoid, abs, clamp, argmax, cumsum,
                            tril, triu, repeat_interleave, outer)
from dtensor.creation import full, ones, rand, randn, zeros
from dtensor._einsum import einsum

float16, float32, float64 = np.float16, np.float32, np.float64
int32, int64, bool_ = np.int32, np.int64, np.bool_

__version__ = "0.1.0"
__all__ = ["Tensor", "tensor", "as_tensor", "zeros", "ones", "full", "zeros_like", "ones_like",
           "arange", "rand", "randn", "cat", "where", "matmul", "stack", "einsum", "cos", "sin",
           "rsqrt", "sigmoid", "abs", "clamp", "argmax", "cumsum", "tril", "triu",
           "repeat_interleave", "outer", "no_grad", "enable_grad",
           "is_grad_enabled", "manual_seed", "initial_seed", "float16", "float32", "float64",
           "int32", "int64", "bool_", "nn", "optim", "Shard", "StridedShard", "Replicate",
           "Partial", "DTensor", "DeviceMesh", "init_device_mesh", "distribute_tensor",
           "distribute_module", "implicit_replication", "visualize_sharding"]

from dtensor import nn, optim  # noqa: E402  (after the core they build on)
from dtensor.placements import Partial, Replicate, Shard, StridedShard  # noqa: E402


# Documented subpackages reachable as attributes after ``import dtensor``, loaded on first use.
# ``compile`` is the callable module dtensor.compile (compile/ in the repository).
_SUBMODULES = ("checkpoint", "comm", "compile", "debug", "distributed", "launcher", "parallel",
               "profiler")


def __getattr__(name):
    # The distributed layer imports MPI lazily: single-process users never start it.
    if name == "distribute_module":
        from dtensor.parallel import api as _api
        return _api.distribute_module
    if name in ("DTensor", "distribute_tensor", "implicit_replication", "visualize_sharding"):
        from dtensor import dtensor as _dt
        return getattr(_dt, name)
    if name in _SUBMODULES:  # importing them starts no MPI: comm opens it on first use
        import importlib
        return importlib.import_module(f"dtensor.{name}")
    if name in ("DeviceMesh", "init_device_mesh"):
        from dtensor import mesh as _mesh
        return getattr(_mesh, name)
    raise AttributeError(f"module 'dtensor' has no attribute {name!r}")


if os.environ.get("DTENSOR_TRACE"):  # dtlaunch --trace DIR: the whole job's timeline
    from dtensor import profiler as _profiler
    _profiler.start_from_env()
