"""Everything that runs inside a rank: environment, MPI start-up, failure reports, pool worker.

Two modes, both started by mpiexec (dtlaunch and RankPool build the command line)::

    python .../launcher/bootstrap.py script.py [args ...]   # dtlaunch: run a script as __main__
    python .../launcher/bootstrap.py -m module [args ...]   # dtlaunch -m: a module, as python -m
    python .../launcher/bootstrap.py --worker               # RankPool: serve cloudpickled tasks

``python -m dtensor.launcher.bootstrap script.py`` works too, but the launchers run this file by
path: ``-m`` would first import the ``dtensor`` package, which imports numpy (fixing the BLAS
thread count) and may initialise MPI (fixing the CVARs) before this file could set either. So this
file imports nothing from dtensor and only the standard library, mpi4py and cloudpickle.

The launcher talks to the ranks through environment variables and files in one private
directory (``DTENSOR_LAUNCH_DIR``): ``rank{r}.pid`` (pid and host, for SIGUSR1 and killing),
``rank{r}.stack`` (faulthandler's dump on SIGUSR1), ``rank{r}.err`` (the traceback of an uncaught
exception, written instead of printing it so that dtlaunch shows it exactly once, last),
``rank{r}.done`` (when and how the script ended without an error), ``rank{r}.orphan`` (the
rank's parent, MPI's process manager, died), ``rank{r}.blocked`` (since when the rank's main
thread has sat in one blocking MPI call, for dtlaunch's deadlock check) and, for the pool,
``rank{r}.out`` (the rank's stdout+stderr) and the AF_UNIX socket ``pool.sock``.
"""
from __future__ import annotations

import faulthandler
import json
import linecache
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import MutableMapping
from dataclasses import dataclass
from types import TracebackType

ENV_DIR = "DTENSOR_LAUNCH_DIR"
ENV_AUTHKEY = "DTENSOR_LAUNCH_AUTHKEY"
ENV_CAPTURE = "DTENSOR_LAUNCH_CAPTURE"
ENV_PARENT = "DTENSOR_LAUNCH_PARENT"  # "pid@host" of dtlaunch / the RankPool's process
ENV_HANG = "DTENSOR_LAUNCH_HANG"  # "1": keep rank{r}.blocked for dtlaunch's deadlock check

# Blocking mpi4py calls: a rank whose main thread sits in one of these waits for its peers.
# Lower-case names that are common outside MPI (wait, reduce, gather, scan: events, processes,
# ufuncs, asyncio) are left out, so a rank blocked in one of those is never taken for stuck.
MPI_WAIT = re.compile(
    r"\.(Barrier|Bcast|Gatherv?|Scatterv?|Allgatherv?|Alltoall[vw]?|Reduce|Allreduce"
    r"|Reduce_scatter(_block)?|Scan|Exscan|Send|Ssend|Bsend|Rsend|Recv|Sendrecv(_replace)?"
    r"|M?[Pp]robe|Wait(all|any|some)?|barrier|bcast|allreduce|allgather|alltoall|scatter"
    r"|send|ssend|recv|sendrecv)\)?\s*\(")  # ")(": a call through a conditional expression
_COMM_FILE = os.path.join("", "dtensor", "comm.py")
# A shared-memory all_reduce's wait: a Python loop in this file, called from comm.py.
SHM_FILE = os.path.join("", "dtensor", "_shm.py")


def in_mpi_call(file: str, source: str) -> bool:
    """Whether a thread whose innermost Python frame is at ``source`` (a line of ``file``) sits
    in a blocking MPI call: an mpi4py call on that line, or any line of dtensor's communicator
    (whose calls go through local names too: ``call(x, out, op=mpi_op)``)."""
    return file.endswith(_COMM_FILE) or bool(MPI_WAIT.search(source))
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# MPICH busy-polls while a rank waits (sched_yield every MPIR_CVAR_POLLS_BEFORE_YIELD=1000 polls,
# which CFS barely honours). With more ranks than cores the waiters take the cores from the ranks
# still computing. Measured with benchmarks/oversubscription.py, 8 ranks on 2 cores, medians of
# 5-7 runs:
#                          straggler   waiters' CPU   loop (latency-bound)
#   default                  2.41 s       3.73 s          0.199 s
#   CH4_PROGRESS_THROTTLE=1  2.19 s       3.38 s          0.191 s
#   ENABLE_HEAVY_YIELD=1     1.10 s       0.95 s          0.366 s
# (straggler: rank 0 computes 0.41 s of work alone while 7 ranks wait in a Barrier; loop: 200 x
# (64x64 matmul + 16-double Allreduce) on all ranks.) With another job loading the machine:
# straggler 2.76 -> 2.07 s, waiters' CPU 3.46 -> 1.33 s, loop 0.34 -> 0.50 s. Heavy yield
# (nanosleep instead of sched_yield) wins where oversubscription hurts: a rank doing the work gets
# the core back. It costs small-collective latency, so it is applied only when the ranks on a host
# outnumber its cores. The throttle (usleep(1) after 4096 idle polls) made no real difference.
OVERSUBSCRIBED_CVARS = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}

# The values of dtensor/_threads.py's BLAS_SPIN_VARS (why, and the benchmark that shows it, are
# there; tests/test_threads.py checks they agree): this file imports nothing from dtensor, so that
# a rank's environment is set before numpy loads.
BLAS_SPIN_VARS = {"OPENBLAS_THREAD_TIMEOUT": "20"}


def available_cores() -> int:
    """Cores this process may run on (CPU affinity, so taskset/cgroup limits count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def apply_rank_env(env: MutableMapping[str, str], local_ranks: int,
                   cores: int | None = None) -> dict[str, str]:
    """Fill in per-rank defaults the user did not set: BLAS/OpenMP threads, how long idle BLAS
    threads spin, and MPICH yielding.

    Must run before numpy (BLAS reads its thread count when it loads) and before MPI_Init
    (CVARs are read there). Every variable already present in ``env`` is left alone.

    Args:
        env: the environment to complete, e.g. ``os.environ`` or a copy passed to mpiexec.
        local_ranks: ranks sharing this host.
        cores: cores of this host; defaults to :func:`available_cores`.

    Returns:
        The variables that were added.

    Example:
        >>> apply_rank_env({}, local_ranks=4, cores=2)["OMP_NUM_THREADS"]
        '1'
    """
    cores = available_cores() if cores is None else cores
    threads = max(1, cores // max(1, local_ranks))
    added = {var: str(threads) for var in THREAD_VARS}
    if threads > 1:
        added.update(BLAS_SPIN_VARS)
    if local_ranks > cores:
        added.update(OVERSUBSCRIBED_CVARS)
    added = {k: v for k, v in added.items() if k not in env}
    env.update(added)
    return added


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job (torchrun's names)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _local_ranks_from_env() -> int | None:
    # Hydra (MPICH) and Open MPI both tell a rank how many ranks share its host, before MPI_Init.
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def start_rank() -> RankInfo:
    """Set the rank's environment, initialise MPI and register the launcher's hooks.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; registers faulthandler on SIGUSR1
    (to ``rank{r}.stack`` in the launch directory, else stderr); records pid and host; makes
    stdout/stderr line-buffered, so that each line reaches mpiexec in one write and its
    ``[rank N]`` prefix lands at line starts even under PYTHONUNBUFFERED=1.
    """
    local = _local_ranks_from_env()
    if local is not None:  # dtlaunch already filled these in for a one-host job; hostfiles need it
        apply_rank_env(os.environ, local)
    from mpi4py import MPI  # initialises MPI (thread level "multiple", mpi4py's default)

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    info = RankInfo(world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size())
    node.Free()
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size),
                      LOCAL_RANK=str(info.local_rank), LOCAL_WORLD_SIZE=str(info.local_world_size))
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)
    report_dir = os.environ.get(ENV_DIR)
    if report_dir:
        global _stack_file  # faulthandler writes to its fd; the file must outlive this call
        _stack_file = open(os.path.join(report_dir, f"rank{info.rank}.stack"), "a")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
        # The parent (hydra's proxy) too: dtlaunch may first look after it already died.
        _write_atomic(os.path.join(report_dir, f"rank{info.rank}.pid"),
                      json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "ppid": os.getppid(), "parent": _process_name(os.getppid())}))
    else:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    _exit_when_orphaned(info.rank)
    return info


def _launcher_gone() -> bool:
    """True once the launcher on this host has exited (False when unknown or remote)."""
    pid_text, _, host = os.environ.get(ENV_PARENT, "").partition("@")
    if not pid_text or host != socket.gethostname():  # remote ranks cannot see the launcher
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's (pid reuse): keep going
        pass
    return False


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:  # not Linux
        return "parent process"


def _exit_when_orphaned(rank: int) -> None:
    """End this rank (and so, through mpiexec, the job) once its launcher or its parent is gone.

    mpiexec runs in a session of its own, so a launcher killed hard (SIGKILL, a CI timeout)
    would leave ranks stuck in a collective spinning forever. So would the death of the rank's
    parent, MPI's process manager (hydra's proxy): mpiexec does not notice it while the ranks
    live (they hold the proxy's socket to mpiexec open), and nobody is left to end them. A
    thread checks both every second; an orphaned rank leaves ``rank{r}.orphan`` for dtlaunch.
    """
    parent = os.getppid()
    name = _process_name(parent)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:  # re-parented: the process that started this rank died
                why = f"its MPI process manager {name} (pid {parent}) is gone"
                report_dir = os.environ.get(ENV_DIR)
                record = {"rank": rank, "time": time.time(), "pid": parent, "name": name}
                try:
                    if report_dir:
                        _write_atomic(os.path.join(report_dir, f"rank{rank}.orphan"),
                                      json.dumps(record))
                except OSError:  # the launch directory is on another host
                    pass
                break
            if _launcher_gone():
                why = "its launcher is gone"
                _remove_launch_dir()
                break
        try:  # stderr may be a pipe to the dead proxy
            os.write(2, f"rank {rank}: {why}; exiting\n".encode())
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="dtensor-launcher-watch", daemon=True).start()


def _remove_launch_dir() -> None:
    # Only when the launcher died: it cannot remove its directory any more, so the ranks do.
    shutil.rmtree(os.environ.get(ENV_DIR) or "/nonexistent", ignore_errors=True)


_stack_file = None


def _write_atomic(path: str, text: str) -> None:
    # The launcher polls these files; it must never read a half-written one.
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _user_tb(exc: BaseException) -> TracebackType | None:
    """The exception's traceback from the first frame that is neither this file's nor runpy's."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def run_script(info: RankInfo, argv: list[str], module: bool = False) -> None:
    """Run ``argv[0]`` as ``__main__`` like ``python -m mpi4py``: an uncaught exception aborts.

    ``module``: ``argv[0]`` names a module, run as ``python -m`` would (the current directory
    first on sys.path, sys.argv[0] the module's file). With a launch directory the traceback goes
    to ``rank{r}.err`` (dtlaunch prints it last) and stderr gets a one-line pointer; without one
    it is printed as usual.
    """
    from runpy import run_module, run_path

    from mpi4py.run import set_abort_status

    target = argv[0]
    sys.argv[:] = argv
    # sys.path[0] is this file's folder until here: the user's code must not see it.
    if module:
        sys.path[0] = os.getcwd()
    else:
        sys.path[0] = os.path.realpath(os.path.dirname(target))  # as `python script.py` would
    report_dir = os.environ.get(ENV_DIR)
    if report_dir and os.environ.get(ENV_HANG) == "1":
        _report_mpi_waits(report_dir, info.rank)
    try:
        if module:
            run_module(target, run_name="__main__", alter_sys=True)
        else:
            run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt) as exc:
        set_abort_status(exc)  # a non-zero exit on one rank ends every rank (MPI_Abort at exit)
        if report_dir and isinstance(exc, SystemExit) and exc.code in (None, 0):
            _report_finished(report_dir, info.rank, f"called sys.exit({exc.code!r})")
        raise
    except BaseException as exc:  # noqa: BLE001  (anything uncaught ends the job, as in mpi4py)
        set_abort_status(1)
        if not report_dir:  # started by hand: print it here, as python would
            tb = _user_tb(exc)  # the hook prints exc.__traceback__, so trim that one
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
            raise SystemExit(1) from None
        text = "".join(traceback.format_exception(type(exc), exc, _user_tb(exc)))
        report = {"rank": info.rank, "time": time.time(), "type": type(exc).__name__,
                  "traceback": text, "host": socket.gethostname()}
        _write_atomic(os.path.join(report_dir, f"rank{info.rank}.err"), json.dumps(report))
        print(f"dtlaunch: rank {info.rank} raised {type(exc).__name__}; its traceback is printed "
              "when the job has ended", file=sys.stderr)
        raise SystemExit(1) from None
    if report_dir:
        _report_finished(report_dir, info.rank, "returned")


def _report_mpi_waits(report_dir: str, rank: int) -> None:
    """Keep ``rank{r}.blocked`` (``{"rank", "since"}``) while the main thread has sat in one
    blocking MPI call since ``since``, and remove it once the thread moves on.

    A stack seen at the same MPI call twice does not tell a stuck rank from one looping over
    that call. A pending call (Py_AddPendingCall) does: the main thread runs it at its next
    bytecode, so one queued while the thread was in an MPI call and still pending a second later
    means the thread has not left that call since. A thread wakes once a second and reads one
    frame; it queues at most one pending call at a time, so a healthy job pays microseconds.
    """
    import ctypes

    path = os.path.join(report_dir, f"rank{rank}.blocked")
    main = threading.main_thread().ident
    ran = threading.Event()

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def probe(_: object) -> int:
        ran.set()
        return 0

    add_pending_call = ctypes.pythonapi.Py_AddPendingCall
    add_pending_call.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def watch() -> None:
        try:
            look()
        except Exception:  # noqa: BLE001 - a diagnostic must never end the rank it watches
            return

    def look() -> None:
        queued, written, since, polled = False, False, 0.0, None
        while True:
            time.sleep(1.0)
            queued = queued and not ran.is_set()
            frame = sys._current_frames().get(main)
            # (f_lineno is None while a frame starts or ends, e.g. as the script returns)
            lineno = frame.f_lineno if frame is not None else None
            line = linecache.getline(frame.f_code.co_filename, lineno) if lineno else ""
            waiting = bool(line) and in_mpi_call(frame.f_code.co_filename, line)
            del frame  # holding it would keep the user's locals alive
            # A shared-memory all_reduce waits in a Python loop (dtensor/_shm.py), which runs
            # the pending call: there the same wait seen a second apart is the sign instead.
            poll = getattr(sys.modules.get("dtensor._shm"), "POLLING", None)
            if poll is not None:
                waiting, queued, since = True, poll is polled, poll[0]
            elif polled is not None:
                queued = False  # (back to the pending-call test, afresh)
            polled = poll
            try:  # the launcher removes the directory as the job ends
                if waiting and queued:
                    if not written:
                        _write_atomic(path, json.dumps({"rank": rank, "since": since}))
                        written = True
                    continue
                if written:
                    written = False
                    os.remove(path)
            except OSError:
                pass
            if waiting and not queued and poll is None:
                ran.clear()
                queued = add_pending_call(probe, None) == 0  # -1: queue full, try next time
                since = time.time()

    threading.Thread(target=watch, name="dtensor-launcher-mpi-waits", daemon=True).start()


def _report_finished(report_dir: str, rank: int, how: str) -> None:
    # dtlaunch watches for ranks that finish while their peers still wait in a collective.
    _write_atomic(os.path.join(report_dir, f"rank{rank}.done"),
                  json.dumps({"rank": rank, "time": time.time(), "how": how}))


def serve(info: RankInfo) -> None:
    """The RankPool worker loop: connect back to the parent, run tasks until told to stop.

    A task is pickle bytes of ``(parent's sys.path, cloudpickle bytes of (fn, args, kwargs))``;
    the reply ``("ok", value)`` or ``("err", type_name, traceback, time)``. A ``None`` task or
    EOF (the parent is gone) ends the loop, and MPI is finalised on the way out.
    """
    from multiprocessing.connection import Client

    import cloudpickle

    report_dir = os.environ[ENV_DIR]
    if os.environ.get(ENV_CAPTURE) == "1":
        # Ranks must never write into the parent's fds (pytest's capture files): one file each.
        fd = os.open(os.path.join(report_dir, f"rank{info.rank}.out"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        for stream, target in ((sys.stdout, 1), (sys.stderr, 2)):
            stream.flush()
            os.dup2(fd, target)
        os.close(fd)
    authkey = bytes.fromhex(os.environ.pop(ENV_AUTHKEY))
    conn = Client(os.path.join(report_dir, "pool.sock"), family="AF_UNIX", authkey=authkey)
    conn.send((info.rank, os.getpid()))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone: nothing left to serve
            if _launcher_gone():
                _remove_launch_dir()
            return
        reply = _run_task(message)
        if reply is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            payload = cloudpickle.dumps(reply)
        except Exception as exc:  # noqa: BLE001  (any pickling failure is the task's error)
            why = f"rank {info.rank}: the return value could not be pickled: {exc!r}\n"
            payload = cloudpickle.dumps(("err", "PicklingError", why, time.time()))
        conn.send_bytes(payload)


def _run_task(message: bytes) -> tuple | None:
    import pickle

    import cloudpickle

    try:
        # Two layers: the parent's sys.path must be in place before the task is unpickled, since
        # unpickling imports the modules that the function's globals refer to.
        task = pickle.loads(message)
        if task is None:
            return None
        sys_path, body = task
        sys.path[:] = sys_path
        fn, args, kwargs = cloudpickle.loads(body)
        return ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001  (SystemExit in a task is a failure too)
        return ("err", type(exc).__name__, _format_task_error(exc), time.time())


def _format_task_error(exc: BaseException) -> str:
    # Leave out this file's frames and any marked `__tracebackhide__ = True` (pytest's
    # convention, used by the test plugin's wrapper): the report should start at user code.
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename != __file__ and not frame.f_locals.get("__tracebackhide__"):
            frames.append((frame, tb.tb_lineno))
        tb = tb.tb_next
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    report.stack = traceback.StackSummary.extract(iter(frames))
    return "".join(report.format())


def main(argv: list[str] | None = None) -> None:
    """Entry point of a rank: ``bootstrap.py script.py [args]``, ``bootstrap.py -m module [args]``
    or ``bootstrap.py --worker``."""
    argv = sys.argv[1:] if argv is None else argv
    module = argv[:1] == ["-m"]
    if not argv or argv == ["-m"]:
        sys.exit("usage: bootstrap.py script.py [args ...] | -m module [args ...] | --worker")
    info = start_rank()
    if argv == ["--worker"]:
        serve(info)
    else:
        run_script(info, argv[1:] if module else argv, module)


if __name__ == "__main__":
    main()
