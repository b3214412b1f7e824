"""What the C backend needs from the machine: a C compiler run on one source into a shared
library kept in the compile cache (checked against its SHA-256 before it is loaded), and a
pool of threads to split a kernel's rows over (ctypes releases the GIL during a call).
compile/c_backend.py renders the kernels; this module builds and runs them."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import queue
import shutil
import subprocess
import threading

from dtensor.compile import cache

__all__ = ["build", "CompilerNotFound", "FLAGS", "num_threads", "parallel", "cuts",
           "SPLIT_ELEMENTS"]

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-fPIC", "-shared")


class CompilerNotFound(RuntimeError):
    """backend='c' found no C compiler to run (none on PATH, or $CC does not run)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CompilerNotFound(
            "dtensor.compile(backend='c') needs a C compiler: none on PATH (cc, gcc) and $CC is "
            "unset. Install one (Debian: apt-get install gcc) or use backend='numpy'.")
    return cc


def _cpu() -> str:
    """What -march=native depends on: a library built here must not load on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _library_stem(source: str, cc: str) -> str:
    """Cache path (no suffix) of ``source``'s library: named by the hash of the source,
    compiler, flags and CPU."""
    key = "\n".join([source, cc, " ".join(FLAGS), _cpu(), platform.machine()])
    return os.path.join(cache.cache_dir(), f"dtc_c_{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def build(source: str) -> ctypes.CDLL:
    """Compile ``source`` to a shared library in the compile cache unless it is there, and
    load it. A cached library is loaded only if its bytes match the SHA-256 kept beside it
    (``.so.sha256``, written after the library): a truncated, corrupt or foreign one is
    rebuilt."""
    cc = _compiler()
    path = _library_stem(source, cc)
    lib = path + ".so"
    loaded = _LOADED.get(lib)
    if loaded is not None:
        return loaded
    opened = _open_checked(lib)
    if opened is None:
        # Every file this process writes is its own until renamed into place (atomically):
        # ranks building the same library at once never read each other's half-written files.
        # All compile the one path.c (the same bytes, replaced atomically): the library
        # records its source's file name, so builders' libraries, and digests, are identical.
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            cache.write_atomic(tmp + ".c", source.encode())
            os.replace(tmp + ".c", path + ".c")  # kept for the error's line numbers too
            try:
                done = subprocess.run([cc, *FLAGS, "-o", tmp + ".so", path + ".c", "-lm"],
                                      capture_output=True, text=True)
            except OSError as e:
                raise CompilerNotFound(f"dtensor.compile(backend='c'): cannot run the C "
                                       f"compiler {cc!r} ({e}); set $CC to one, or use "
                                       f"backend='numpy'.")
            if done.returncode:
                raise RuntimeError(f"dtensor.compile(backend='c'): {cc} failed on {path}.c:\n"
                                   f"{done.stderr[-4000:]}")
            with open(tmp + ".so", "rb") as f:
                digest = _digest(f.read())
            os.replace(tmp + ".so", lib)
            cache.write_atomic(lib + ".sha256", digest)
        finally:
            for leftover in (tmp + ".c", tmp + ".so"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        opened = _open_checked(lib)
        if opened is None:
            raise cache.CacheDirError(f"dtensor.compile(backend='c'): the library just built "
                                      f"at {lib} changed before it could be loaded; check who "
                                      f"else writes to {os.path.dirname(lib)}.")
    # Loaded through the descriptor the bytes were checked from: a name swapped after the
    # check cannot change what runs. The descriptor stays open for the process's life, as the
    # library does: dlopen knows a library by the name it was given, and a closed descriptor's
    # number (hence /proc/self/fd/N) would be reused for the next one.
    proc = f"/proc/self/fd/{opened}"
    if os.path.exists(proc):
        _LOADED[lib] = ctypes.CDLL(proc)
    else:  # no /proc (not Linux): by name, right after the check
        os.close(opened)
        _LOADED[lib] = ctypes.CDLL(lib)
    return _LOADED[lib]


_LOADED: dict[str, ctypes.CDLL] = {}


def _open_checked(lib: str) -> int | None:
    """A descriptor on ``lib`` if it is a private regular file whose bytes match the SHA-256
    kept beside it, else None (closed)."""
    so = cache.open_private(lib)
    if so is None:
        return None
    fd, data = so
    digest = cache.open_private(lib + ".sha256")
    if digest is not None:
        os.close(digest[0])
    if digest is None or digest[1] != _digest(data):
        os.close(fd)
        return None
    return fd


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest().encode()


# ----------------------------------------------------------------------------- threads


def num_threads() -> int:
    """Threads a kernel's rows are split over: DTENSOR_NUM_THREADS, else the BLAS / OpenMP
    thread count the environment sets (dtlaunch sets it to cores / local ranks), else the
    cores this process may use."""
    for var in ("DTENSOR_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Splitting pays once a kernel runs for well over the time it takes to wake a waiting thread,
# longer right after a GEMM, whose BLAS workers still spin on the other cores: the standard
# step's 1 MB adds and layer norms run faster unsplit, its GELU split (benchmarks/gpt_step.py
# at 1 rank).
SPLIT_ELEMENTS = 1 << 20


class _Pool:
    """Workers for a kernel's row ranges; the caller runs the first range itself. Each call
    brings its own completion queue, so callers on several threads at once each wait for
    exactly their own ranges."""

    def __init__(self, n: int):
        self.inbox = [queue.SimpleQueue() for _ in range(n - 1)]
        for i, q in enumerate(self.inbox):
            threading.Thread(target=self._work, args=(q,), daemon=True,
                             name=f"dtensor-c-{i}").start()

    @staticmethod
    def _work(inbox) -> None:
        while True:
            fn, args, done = inbox.get()
            try:
                fn(*args)
                done.put(None)
            except BaseException as e:  # re-raised by the caller
                done.put(e)

    def run(self, fn, calls: list) -> None:
        """fn(*args) for every args in ``calls``, at once."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        for q, args in zip(self.inbox, calls[1:]):
            q.put((fn, args, done))
        error = None
        try:
            fn(*calls[0])
        finally:  # always collect the workers: they write into the caller's arrays
            for _ in calls[1:]:
                error = done.get() or error
        if error is not None:
            raise error


_pools: dict = {}
_pools_lock = threading.Lock()
# A forked child has none of the parent's threads: it starts its own pools.
os.register_at_fork(after_in_child=_pools.clear)


def parallel(fn, calls: list) -> None:
    """fn(*args) for every args in ``calls``: the first on this thread, the others at once on
    a pool's workers (one pool per number of calls, started on first use)."""
    if len(calls) == 1:
        fn(*calls[0])
        return
    with _pools_lock:
        pool = _pools.get(len(calls))
        if pool is None:
            pool = _pools[len(calls)] = _Pool(len(calls))
    pool.run(fn, calls)


def cuts(rows: int, work: int) -> list:
    """Row ranges, one a thread, when ``work`` (elements touched) is worth splitting."""
    n = min(num_threads(), rows) if work >= SPLIT_ELEMENTS else 1
    edges = [rows * k // n for k in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))
