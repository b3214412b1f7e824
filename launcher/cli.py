"""``dtlaunch``: run a Python script on N MPI ranks (torchrun's job, on mpiexec).

    dtlaunch --nproc 4 train.py --lr 3e-4
    python -m dtensor.launcher --nproc 8 --timeout 600 train.py

Every rank runs the script as ``__main__`` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set,
BLAS/OpenMP threads = cores // local ranks (unless set), and output lines prefixed ``[rankN] ``.

Prefixes are hydra's -prepend-pattern, applied to each chunk a rank writes; ranks write whole
lines (stdout/stderr are made line-buffered, also under PYTHONUNBUFFERED=1), so print, logging and
tracebacks come out one prefixed line each. Text flushed mid-line (``print(..., end="",
flush=True)``) can get a prefix in the middle of a line.

Failure contract: an uncaught exception on any rank ends every rank (MPI_Abort) within about a
second; the rank writes its traceback to the launch directory instead of printing it, and dtlaunch
prints it exactly once, as the last lines of its output, after the job's own output has drained.
With ``--timeout S`` dtlaunch prints every rank's Python stack after S seconds, kills every
process of the job and exits with 124.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from dtensor.launcher.job import MpiJob, find_mpiexec

TIMEOUT_EXIT = 124  # as coreutils' timeout(1)


class _Terminated(BaseException):
    """SIGTERM to dtlaunch: end the job like Ctrl-C does."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtlaunch", description="Run a Python script on N MPI ranks.",
        epilog="Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE on every rank and "
               "OMP/OPENBLAS/MKL_NUM_THREADS = cores // local ranks unless already set. "
               "Exit status: the job's, 124 on --timeout, 130 on Ctrl-C.")
    p.add_argument("--nproc", "-n", type=int, required=True, help="number of ranks")
    p.add_argument("--hostfile", help="hydra hostfile (one 'host[:slots]' per line)")
    p.add_argument("--timeout", type=float, help="seconds before the job is dumped and killed")
    p.add_argument("--mpiexec", help="mpiexec to use (default: the mpich wheel's)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix lines with [rankN]")
    p.add_argument("script", help="the Python script every rank runs as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _check(opts: argparse.Namespace) -> None:
    if opts.nproc < 1:
        raise ValueError(f"--nproc must be a positive number of ranks, got {opts.nproc}; "
                         "e.g. --nproc 4")
    if not os.path.isfile(opts.script):
        raise ValueError(f"script {opts.script!r} does not exist (relative to {os.getcwd()}); "
                         "pass the path of a Python file: dtlaunch --nproc 2 train.py")
    if opts.hostfile is not None and not os.path.isfile(opts.hostfile):
        raise ValueError(f"--hostfile {opts.hostfile!r} does not exist; pass a file with one "
                         "'host[:slots]' per line, or leave it out to run every rank here")
    if opts.timeout is not None and not opts.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {opts.timeout}")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def failure_summary(failures: Sequence[dict[str, Any]], status: int) -> str:
    """The closing lines for ranks that raised: the first rank's traceback once, then one line.

    Ranks with the same traceback (a failure every rank hits) share one copy; a different
    failure on another rank gets its exception line.
    """
    first = failures[0]
    same = [f["rank"] for f in failures if f["traceback"] == first["traceback"]]
    lines = [f"dtlaunch: traceback of {_ranks(same)} (the first to fail):\n",
             first["traceback"].rstrip("\n") + "\n"]
    for f in failures:
        if f["traceback"] != first["traceback"]:
            last = f["traceback"].rstrip("\n").rsplit("\n", 1)[-1]
            lines.append(f"dtlaunch: rank {f['rank']} also failed: {last}\n")
    failed = sorted(f["rank"] for f in failures)
    what = (first["type"] if len(failed) == 1
            else f"an exception (first: rank {first['rank']}, {first['type']})")
    lines.append(f"dtlaunch: job failed: {_ranks(failed)} raised {what}; exit status {status}\n")
    return "".join(lines)


def _run(job: MpiJob, timeout: float | None) -> int:
    proc = job.proc
    assert proc is not None, "start the job first"
    try:
        status = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = job.dump_stacks()
        job.kill()
        out = [(f"dtlaunch: timed out after {timeout:g} s (--timeout); Python stack of every "
                "rank follows, then the job was killed\n")]
        out += [f"--- rank {rank} ---\n{stack}" for rank, stack in sorted(stacks.items())]
        out.append(f"dtlaunch: job killed after {timeout:g} s; exit status {TIMEOUT_EXIT}\n")
        sys.stderr.write("".join(out))
        return TIMEOUT_EXIT
    except (KeyboardInterrupt, _Terminated):
        # hydra forwards SIGINT to every rank (KeyboardInterrupt there); kill what lingers.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        job.kill()
        sys.stderr.write("dtlaunch: interrupted; job ended\n")
        return 130
    failures = job.failures()
    if failures:
        status = status or 1
        sys.stderr.write(failure_summary(failures, status))
    elif status < 0:
        sys.stderr.write(f"dtlaunch: mpiexec was killed by signal {-status}\n")
        status = 128 - status
    elif status != 0:
        sys.stderr.write(f"dtlaunch: job failed with exit status {status} (a rank exited early or "
                         "was killed; see mpiexec's message above)\n")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dtlaunch``; returns the exit status (the console script exits with it).

    Args:
        argv: command-line arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The job's exit status: 0, a rank's non-zero status, 124 on ``--timeout``, 130 on Ctrl-C,
        2 on a usage error.

    Example:
        >>> main(["--nproc", "2", "train.py"])  # doctest: +SKIP
        0
    """
    opts = _parser().parse_args(argv)
    try:
        _check(opts)
        mpiexec = find_mpiexec(opts.mpiexec)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dtlaunch: error: {exc}", file=sys.stderr)
        return 2
    # A terminal on stdin is not forwarded: mpiexec runs in its own session (so that dtlaunch
    # alone decides how the job ends) and must not read the user's keystrokes.
    stdin = subprocess.DEVNULL if sys.stdin is None or sys.stdin.isatty() else None
    sys.stdout.flush()
    sys.stderr.flush()

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _Terminated

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    job = MpiJob(opts.nproc, [opts.script, *opts.args], mpiexec=mpiexec, hostfile=opts.hostfile,
                 prefix=not opts.no_prefix)
    try:
        job.start(stdin=stdin)
        return _run(job, opts.timeout)
    finally:
        job.close()
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
