"""One mpiexec job of N ranks: find mpiexec, start it, ask its ranks for stacks, end it completely.

Shared by ``dtlaunch`` (a script on every rank) and :class:`~dtensor.launcher.pool.RankPool`
(a worker loop on every rank). Hydra (MPICH's mpiexec) puts its proxy and every rank in a
session of their own, so killing mpiexec's process group would leave the ranks running: ending
a job means finding its processes (mpiexec's descendants, plus anything carrying this job's
launch directory in its environment) and killing each.
"""
from __future__ import annotations

import importlib.util
import json
import linecache
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from dtensor.launcher.bootstrap import (ENV_DIR, ENV_PARENT, SHM_FILE, apply_rank_env,
                                       in_mpi_call)

BOOTSTRAP = str(Path(__file__).with_name("bootstrap.py"))
PREFIX_PATTERN = "[rank%r] "  # hydra replaces %r with the rank
HOST_PREFIX_PATTERN = "[rank%r@%h] "  # ... and %h with the rank's host (of the hostfile)


def ranks_text(ranks) -> str:
    """``rank 3`` or ``ranks 0, 2``: the ranks a launcher message names, sorted."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def find_mpiexec(explicit: str | None = None) -> str:
    """Locate mpiexec: ``explicit``, else the MPICH wheel's, else one on PATH (with a note).

    Args:
        explicit: a path or command name given by the user (``--mpiexec``).

    Returns:
        An absolute path to an executable mpiexec.

    Raises:
        FileNotFoundError: nothing usable was found; the message lists where it looked.

    Example:
        >>> find_mpiexec()  # doctest: +SKIP
        '/work/venv/bin/mpiexec'
    """
    if explicit is not None:
        found = shutil.which(explicit)
        if found is None:
            raise FileNotFoundError(f"--mpiexec {explicit!r} is not an executable file; pass the "
                                    "path of an mpiexec (e.g. /usr/bin/mpiexec) or leave --mpiexec "
                                    "out to use the one from the mpich wheel")
        return os.path.abspath(found)
    # The mpich wheel installs bin/mpiexec into the environment's scripts directory, which is
    # where sys.executable lives in a venv (do not resolve the symlink: that leaves the venv).
    candidates = [Path(sys.executable).parent / "mpiexec"]
    try:
        candidates += [Path(f.locate()) for f in metadata.files("mpich") or ()
                       if f.name == "mpiexec"]
    except metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path.resolve())
    system = shutil.which("mpiexec")
    if system is not None:
        print(f"dtensor.launcher: the mpich wheel's mpiexec was not found next to "
              f"{sys.executable}; using {system} from PATH (it must belong to the MPI that mpi4py "
              "was built against)", file=sys.stderr)
        return system
    looked = ", ".join(str(p) for p in candidates) or "(none)"
    raise FileNotFoundError(f"no mpiexec found (looked at {looked} and on PATH); install MPICH "
                            "with `pip install mpich` or pass --mpiexec /path/to/mpiexec")


def _proc_ppids() -> dict[int, int]:
    ppids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # exited while we looked
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            ppids[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return ppids


_FRAME = re.compile(r'\s*File "(.+)", line (\d+) in ')

def _main_thread_frames(stack: str) -> list[tuple[str, int]]:
    """(file, line) of each frame of the main thread in a faulthandler dump, innermost first.

    The main thread is the one whose outermost frame is bootstrap.py's module code.
    """
    for block in re.split(r"\n(?=\S)", stack):
        frames = [m for m in map(_FRAME.match, block.splitlines()) if m]
        if frames and frames[-1][1] == BOOTSTRAP and block.rstrip().endswith("in <module>"):
            return [(m[1], int(m[2])) for m in frames]
    return []


def _library_dirs() -> tuple[str, ...]:
    import dtensor

    dirs = [*dtensor.__path__, os.path.dirname(__file__)]
    spec = importlib.util.find_spec("dtensor.compile")
    dirs += (spec.submodule_search_locations or []) if spec is not None else []
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _mpi_wait_site(stack: str) -> str | None:
    """Where the main thread waits, if in a blocking MPI call: ``"file:line: source"`` of the
    user's frame (the innermost outside dtensor), followed by the MPI call's own when dtensor
    made it."""
    frames = _main_thread_frames(stack)
    while frames and frames[0][0].endswith(SHM_FILE):  # a shared-memory wait's poll loop:
        frames = frames[1:]  # where it waits is its caller in comm.py
    if not frames:
        return None
    source = [linecache.getline(file, line).strip() for file, line in frames]
    if not in_mpi_call(frames[0][0], source[0]):
        return None
    library = _library_dirs()
    user = next((i for i, (file, _) in enumerate(frames)
                 if not os.path.realpath(file).startswith(library) and file != BOOTSTRAP), 0)
    site = f"{frames[user][0]}:{frames[user][1]}: {source[user]}"
    return site if user == 0 else f"{site} (in {frames[0][0]}:{frames[0][1]}: {source[0]})"


def _user_frames(stack: str) -> str:
    """faulthandler's dump without the launcher's own frames (runpy, bootstrap.py) and threads
    (its watch thread), each frame followed by its source line as in a traceback (faulthandler
    cannot read files)."""
    blocks = [b for b in re.split(r"(?<=\n)(?=\S)", stack)
              if f'File "{BOOTSTRAP}"' not in b or "in <module>" in b]
    lines = "".join(blocks).splitlines(keepends=True)
    kept = [line for line in lines
            if not line.lstrip().startswith(('File "<frozen runpy>"', f'File "{BOOTSTRAP}"'))]
    if not any(_FRAME.match(line) for line in kept):  # an idle worker: its loop is the story
        kept = lines
    out = []
    for line in kept:
        out.append(line)
        frame = _FRAME.match(line)
        source = linecache.getline(frame[1], int(frame[2])).strip() if frame else ""
        if source:
            out.append(f"    {source}\n")
    return "".join(out)


class MpiJob:
    """``mpiexec -n nproc python bootstrap.py *rank_args`` with a private launch directory.

    Construct, put what the ranks need into :attr:`dir` (the pool's socket), then :meth:`start`.

    Args:
        nproc: number of ranks.
        rank_args: arguments of bootstrap.py (a script and its args, ``-m``, a module and its
            args, or ``["--worker"]``).
        mpiexec: path of mpiexec (see :func:`find_mpiexec`).
        hostfile: hydra hostfile; without one every rank is local and the per-rank defaults
            (threads, yielding) are computed here, else each rank computes its own.
        per_node: ranks per host (hydra's ``-ppn``); default: as the hostfile's slots say.
        prefix: prefix each output line with ``[rankN] `` (hydra's -prepend-pattern), or
            ``[rankN@host] `` when ``hosts`` is set (a job over several hosts).
        env: extra environment variables for the ranks.
        launcher: hydra's options for reaching the hosts (``-launcher ssh``, ``-launcher-exec
            SCRIPT``, ``-iface NAME``), passed as they are.
    """

    def __init__(self, nproc: int, rank_args: Sequence[str], *, mpiexec: str,
                 hostfile: str | None = None, per_node: int | None = None, prefix: bool = True,
                 env: Mapping[str, str] | None = None, launcher: Sequence[str] = (),
                 hosts: bool = False) -> None:
        self.nproc = nproc
        # Short, private (0700) path: it also holds an AF_UNIX socket (108-byte path limit).
        self.dir = tempfile.mkdtemp(prefix="dtensor-",
                                    dir="/tmp" if os.path.isdir("/tmp") else None)
        self.env = dict(os.environ)
        self.env.update(env or {})
        if hostfile is None:
            apply_rank_env(self.env, local_ranks=nproc)
        self.env[ENV_DIR] = self.dir
        self.env[ENV_PARENT] = f"{os.getpid()}@{socket.gethostname()}"  # ranks die with us
        self.cmd = [mpiexec, "-n", str(nproc)]
        if hostfile is not None:
            self.cmd += ["-f", hostfile]
        if per_node is not None:
            self.cmd += ["-ppn", str(per_node)]
        if prefix:
            self.cmd += ["-prepend-pattern", HOST_PREFIX_PATTERN if hosts else PREFIX_PATTERN]
        self.cmd += [*launcher, sys.executable, BOOTSTRAP, *rank_args]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, stdin: Any = subprocess.DEVNULL, stdout: IO[Any] | int | None = None,
              stderr: IO[Any] | int | None = None) -> None:
        """Start mpiexec; ``stdin``/``stdout``/``stderr`` as for :class:`subprocess.Popen`."""
        # A session of its own: the terminal's Ctrl-C reaches the launcher only, which then
        # decides how to end the job.
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=stdin, stdout=stdout,
                                     stderr=stderr, start_new_session=True)

    def path(self, name: str) -> str:
        """A file in the launch directory."""
        return os.path.join(self.dir, name)

    def rank_pids(self) -> dict[int, int]:
        """Pids of the ranks that have started on this host, by rank."""
        pids = {}
        host = socket.gethostname()  # as the rank recorded it
        for rank in range(self.nproc):
            try:
                record = json.loads(Path(self.path(f"rank{rank}.pid")).read_text())
            except (OSError, ValueError):
                continue
            if record["host"] == host:
                pids[rank] = int(record["pid"])
        return pids

    def rank_parents(self) -> dict[int, str]:
        """The processes that started this host's ranks (hydra's proxy), as the ranks recorded
        them at start: pid -> name; mpiexec itself left out (it forks the ranks under some
        process managers)."""
        found = {}
        for rank in self.rank_pids():
            try:
                record = json.loads(Path(self.path(f"rank{rank}.pid")).read_text())
            except (OSError, ValueError):
                continue
            if "ppid" in record and self.proc is not None and record["ppid"] != self.proc.pid:
                found[int(record["ppid"])] = str(record["parent"])
        return found

    def dump_stacks(self, wait: float = 3.0) -> dict[int, str]:
        """Every rank's Python stack, from faulthandler on SIGUSR1, by rank.

        Works while a rank is blocked inside MPI: faulthandler writes from the signal handler.
        A rank that has not started (or runs on another host) gets a line saying so.
        """
        pids = self.rank_pids()
        stacks = {r: _user_frames(s) for r, s in self._raw_stacks(pids, wait).items()}
        for rank in range(self.nproc):
            if rank not in stacks:
                why = "did not answer SIGUSR1" if rank in pids else "has not started on this host"
                stacks[rank] = f"(no stack: rank {rank} {why})\n"
        return stacks

    def mpi_waits(self, ranks: Sequence[int], wait: float = 3.0) -> dict[int, tuple[str, str]]:
        """The ranks among ``ranks`` whose main thread is inside a blocking MPI call.

        Returns:
            ``{rank: (where, stack)}``: ``where`` is ``"file:line: source"`` of the user's call
            (see :func:`_mpi_wait_site`), and ``stack`` the rank's Python stack as
            :meth:`dump_stacks` gives it. Ranks elsewhere, not started, or silent are left out.
        """
        pids = {r: p for r, p in self.rank_pids().items() if r in ranks}
        found = {}
        for rank, stack in self._raw_stacks(pids, wait).items():
            where = _mpi_wait_site(stack)
            if where is not None:
                found[rank] = (where, _user_frames(stack))
        return found

    def _raw_stacks(self, pids: Mapping[int, int], wait: float) -> dict[int, str]:
        """faulthandler's dump of each rank in ``pids`` that answers SIGUSR1 within ``wait`` s."""
        start = {r: self.file_size(f"rank{r}.stack") for r in pids}
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:  # already gone
                pass
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + wait
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline and len(stacks) < len(pids):
            time.sleep(0.1)
            for rank in pids:
                size = self.file_size(f"rank{rank}.stack")
                # faulthandler writes in many small pieces: done when it stops growing
                if rank not in stacks and size > start[rank] and sizes.get(rank) == size:
                    stacks[rank] = self.read(f"rank{rank}.stack", start[rank])
                sizes[rank] = size
        return stacks

    def records(self, kind: str) -> dict[int, dict[str, Any]]:
        """The ranks' JSON reports of one kind, by rank: ``"err"`` (raised), ``"done"`` (the
        script ended without an error), ``"orphan"`` (the rank's parent died) or ``"blocked"``
        (since when it has sat in one MPI call), see bootstrap.py."""
        found = {}
        for rank in range(self.nproc):
            try:
                found[rank] = json.loads(Path(self.path(f"rank{rank}.{kind}")).read_text())
            except (OSError, ValueError):
                continue
        return found

    def children(self) -> dict[int, str]:
        """mpiexec's child processes (hydra's proxy, or ssh to each remote host): pid -> name."""
        if self.proc is None or self.proc.poll() is not None:
            return {}
        found = {}
        for pid, ppid in _proc_ppids().items():
            if ppid == self.proc.pid:
                try:
                    found[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
        return found

    def read(self, name: str, start: int = 0) -> str:
        """A launch-directory file's text from byte ``start`` ("" if it does not exist yet)."""
        try:
            with open(self.path(name), errors="replace") as f:
                f.seek(start)
                return f.read()
        except OSError:
            return ""

    def file_size(self, name: str) -> int:
        """Size of a file in the launch directory (0 if it does not exist yet)."""
        try:
            return os.path.getsize(self.path(name))
        except OSError:
            return 0

    def failures(self) -> list[dict[str, Any]]:
        """Reports of ranks that raised (rank, time, type, traceback), earliest first."""
        return sorted(self.records("err").values(), key=lambda r: (r["time"], r["rank"]))

    def _job_pids(self) -> list[int]:
        ppids = _proc_ppids()
        children: dict[int, list[int]] = {}
        for pid, ppid in ppids.items():
            children.setdefault(ppid, []).append(pid)
        # Walk from mpiexec only while it is unreaped: after wait() its pid may be reused.
        found: set[int] = set()
        todo = [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []
        while todo:
            pid = todo.pop()
            found.add(pid)
            todo += children.get(pid, [])
        # Processes whose parent already died were re-parented: find them by the launch
        # directory every process of this job inherited in its environment.
        marker = f"{ENV_DIR}={self.dir}\0".encode()
        for pid in ppids.keys() - found:
            try:
                if marker in Path(f"/proc/{pid}/environ").read_bytes():
                    found.add(pid)
            except OSError:
                continue
        return sorted(found - {self.proc.pid if self.proc is not None else -1})

    def kill(self) -> None:
        """End every process of the job: SIGTERM to mpiexec, then SIGKILL to whatever is left."""
        if self.proc is not None and self.proc.poll() is None:
            # hydra passes SIGTERM to every rank on every host and exits (~0.1 s, measured);
            # ranks busy in MPI calls die of it since Python leaves SIGTERM at its default.
            self.proc.terminate()
            try:
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        pids = self._job_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # SIGKILL is delivered asynchronously (a rank freeing a large heap takes a while to go):
        # return only once they are gone, so "the pool was shut down" is true when it is said.
        deadline = time.monotonic() + 5
        while any(map(pid_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=2)  # hydra notices its ranks are gone and exits by itself
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Kill what is left of the job and remove the launch directory."""
        if (self.proc is not None and self.proc.poll() is None) or self._job_pids():
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class StuckWatch:
    """Tells ranks that wait in MPI for good: every one of them in a blocking MPI call, at the
    same place in two consecutive looks (call :meth:`stuck` at intervals; each look is a stack
    dump, see :meth:`MpiJob.mpi_waits`).

    Used where another rank has finished and will never join: a rank merely computing, or
    blocked outside MPI, is never taken for stuck. A survivor that keeps looping over
    collectives with other survivors, on one line, would be.
    """

    def __init__(self, job: MpiJob) -> None:
        self.job = job
        self.seen: dict[int, str] | None = None

    def stuck(self, ranks: Sequence[int]) -> dict[int, tuple[str, str]]:
        """``{rank: (where, stack)}`` for ``ranks`` if they are stuck (see above), else {}."""
        waits = self.job.mpi_waits(ranks)
        where = {r: w for r, (w, _) in waits.items()}
        complete = len(waits) == len(ranks)
        stuck = complete and where == self.seen
        self.seen = where if complete else None
        return waits if stuck else {}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
