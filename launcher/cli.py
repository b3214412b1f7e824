"""``dtlaunch``: run a Python script on N MPI ranks (torchrun's job, on mpiexec).

    dtlaunch --nproc 4 train.py --lr 3e-4
    python -m dtensor.launcher --nproc 8 --timeout 600 train.py
    dtlaunch -m pkg.train --lr 3e-4          # a module, as python -m; one rank per usable core
    dtlaunch --nnodes 2 --nproc_per_node 8 --hostfile hosts train.py

Every rank runs the script as ``__main__`` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set,
BLAS/OpenMP threads = cores // local ranks (unless set), and output lines prefixed ``[rankN] ``.

torchrun's spellings work too: ``--nproc_per_node N|auto`` (total ranks = ``--nnodes`` x N; a
count given both ways must agree), ``--nnodes N`` with a hydra ``--hostfile`` of at least N hosts
(hydra's ``-ppn`` puts N ranks on each), ``-m module`` and ``--standalone``. Without any count
there is one rank per usable core (CPU affinity), as ``--nproc_per_node auto``, and a line on
stderr says so. Unlike torchrun, one dtlaunch starts every node's ranks and MPI connects them:
``--master_addr``, ``--master_port`` and ``--rdzv_*`` are ignored with a note, and ``--node_rank``
other than 0 is an error.

Prefixes are hydra's -prepend-pattern, applied to each chunk a rank writes; ranks write whole
lines (stdout/stderr are made line-buffered, also under PYTHONUNBUFFERED=1), so print, logging and
tracebacks come out one prefixed line each. Text flushed mid-line (``print(..., end="",
flush=True)``) can get a prefix in the middle of a line.

Failure contract: an uncaught exception on any rank ends every rank (MPI_Abort) within about a
second; the rank writes its traceback to the launch directory instead of printing it, and dtlaunch
prints it exactly once, as the last lines of its output, after the job's own output has drained.
With ``--timeout S`` dtlaunch prints every rank's Python stack after S seconds, kills every
process of the job and exits with 124.

Hangs: every rank keeps a flight recorder of its last collectives (dtensor/flight.py). When a
rank has waited in one for DTENSOR_WATCHDOG_S, or on SIGUSR1 to dtlaunch, every rank dumps it
and dtlaunch prints one diagnosis (the stuck collective and its line, the ranks that never
arrived and where they are, mismatched calls; launcher/hang.py) and ends the job with 124. On
several hosts, a host that stops answering on the network for DTENSOR_HOST_TIMEOUT ends the
job, naming it. Inside a Slurm or PBS allocation and given no --hostfile, the allocation's
hosts are used (launcher/allocation.py).

Ways a job can no longer finish that mpiexec does not notice, so dtlaunch watches for them
once a second and ends the job with status 1 and a message naming what happened:
- a rank finished its script (returned, or ``sys.exit(0)``) while others still run, and
  ``DTENSOR_EXIT_GRACE`` seconds (default 10) later every one of those others sits in a
  blocking MPI call, at the same place in two looks a second apart: they wait for the finished
  rank in a collective, forever. Others still computing (rank 0 writing a file or printing a
  sample after the rest are done) are left alone, however long they take.
- a child of mpiexec (hydra's proxy, or ssh to a remote host) died while mpiexec still runs;
  its ranks notice too (their parent is gone) and exit within a second.
- every rank has sat in one blocking MPI call for ``DTENSOR_HANG_TIMEOUT`` seconds (default 30)
  and shows the same stack in two looks a second apart: the ranks wait in different or
  mismatched collectives (rank 0 in an all_gather, rank 1 in an all_reduce), a deadlock. Each
  rank tells how long it has sat in its call without running any Python (``rank{r}.blocked``,
  see bootstrap.py), so ranks looping over collectives, or waiting while one rank computes, are
  never taken for deadlocked; a transfer that alone takes longer than the timeout would be.
  Checked when every rank runs on this host; ``inf`` turns the check off.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dtensor.flight import ENV_FLIGHT, REQUEST, read_disk_ring
from dtensor.launcher import allocation
from dtensor.launcher.bootstrap import ENV_HANG, available_cores
from dtensor.launcher.hang import HostProbe, diagnose, post_mortem
from dtensor.launcher.job import MpiJob, StuckWatch, find_mpiexec, pid_alive
from dtensor.launcher.job import ranks_text as _ranks

TIMEOUT_EXIT = 124  # as coreutils' timeout(1)
GRACE_VAR = "DTENSOR_EXIT_GRACE"
DEFAULT_GRACE = 10.0
HANG_VAR = "DTENSOR_HANG_TIMEOUT"
HOST_VAR = "DTENSOR_HOST_TIMEOUT"
# A host of a multi-host job that stops answering on the network for this long ends the job.
DEFAULT_HOST_TIMEOUT = 10.0
# Far above any one collective of a healthy single-host job (they take milliseconds, and a rank
# waiting for a computing peer is not counted: the peer is not in MPI), yet a deadlock ends
# within about half a minute.
DEFAULT_HANG = 30.0
# A normal end has hydra's proxy exit a moment before mpiexec; a proxy gone this long while
# mpiexec still runs was killed.
CHILD_GONE_S = 2.0
# After a flight-recorder request, how long the ranks get to write their reports.
FLIGHT_WAIT_S = 5.0
# torchrun's rendezvous options: each torchrun meets the others through them; here mpiexec
# starts and connects every rank, so they have nothing to set (--node_rank is checked instead).
IGNORED_TORCHRUN = ("--master_addr", "--master_port", "--rdzv_backend", "--rdzv_endpoint",
                    "--rdzv_id", "--rdzv_conf")


class _Terminated(BaseException):
    """SIGTERM to dtlaunch: end the job like Ctrl-C does."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtlaunch", description="Run a Python script (or -m module) on N MPI ranks.",
        epilog="Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE on every rank and "
               "OMP/OPENBLAS/MKL_NUM_THREADS = cores // local ranks unless already set. "
               "Exit status: the job's, 124 on --timeout, 130 on Ctrl-C.")
    p.add_argument("--nproc", "-n", type=int,
                   help="number of ranks in all (default: one per usable core of this host)")
    p.add_argument("--hostfile", help="hydra hostfile (one 'host[:slots]' per line)")
    c = p.add_argument_group("reaching the hosts (hydra's options, passed through)")
    c.add_argument("--launcher", help="how hydra starts its proxy on each host (ssh, rsh, slurm, "
                   "pbs, ...; hydra's -launcher)")
    c.add_argument("--launcher-exec", help="the program it runs for that (hydra's "
                   "-launcher-exec), e.g. a particular ssh")
    c.add_argument("--iface", help="network interface for MPI's control traffic (hydra's -iface)")
    p.add_argument("--timeout", type=float, help="seconds before the job is dumped and killed")
    p.add_argument("--trace", metavar="DIR",
                   help="write a Chrome trace of every rank to DIR/trace.json (dtensor.profiler)")
    p.add_argument("--mpiexec", help="mpiexec to use (default: the mpich wheel's)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix lines with [rankN]")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the module named by the script argument as __main__ on every rank, "
                        "like python -m (dtlaunch -m pkg.train --lr 3e-4)")
    t = p.add_argument_group(
        "torchrun's spellings", "One dtlaunch on one host starts every rank of every node; MPI's "
        "process manager connects them, so --master_addr, --master_port and --rdzv_* are "
        "accepted and ignored (with a note), and --node_rank may only be 0.")
    t.add_argument("--nproc_per_node", "--nproc-per-node", metavar="N|auto",
                   help="ranks per node; auto: one per usable core; "
                        "total ranks = --nnodes x this")
    t.add_argument("--nnodes", metavar="N",
                   help="number of nodes (default 1); more than 1 needs a --hostfile listing "
                        "at least that many hosts")
    t.add_argument("--standalone", action="store_true",
                   help="accepted for torchrun's sake; a job here is always self-contained")
    t.add_argument("--node_rank", "--node-rank", type=int, default=0, help=argparse.SUPPRESS)
    for name in IGNORED_TORCHRUN:
        t.add_argument(name, name.replace("_", "-"), help=argparse.SUPPRESS)
    p.add_argument("script", help="the Python script every rank runs as __main__ (with -m: a "
                                  "module name)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _check(opts: argparse.Namespace) -> None:
    if opts.nproc is not None:
        _count(str(opts.nproc), "--nproc")
    if opts.module:
        _check_module(opts.script)
    elif not os.path.isfile(opts.script):
        raise ValueError(f"script {opts.script!r} does not exist (relative to {os.getcwd()}); "
                         "pass the path of a Python file: dtlaunch --nproc 2 train.py")
    if opts.hostfile is not None and not os.path.isfile(opts.hostfile):
        raise ValueError(f"--hostfile {opts.hostfile!r} does not exist; pass a file with one "
                         "'host[:slots]' per line, or leave it out to run every rank here")
    if opts.timeout is not None and not opts.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {opts.timeout}")
    if opts.node_rank != 0:
        raise ValueError(f"--node_rank {opts.node_rank}: dtlaunch starts the ranks of every node "
                         "itself, from one host, through --hostfile; run it once, on one host, "
                         "without --node_rank")


def _check_module(name: str) -> None:
    """Fail here, not on every rank, when ``-m`` names no importable top-level package.

    Only the top level is looked up: finding ``pkg.mod`` would import ``pkg``, running user
    code in the launcher. The ranks search the current directory first, as ``python -m`` does.
    """
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name) or name.endswith(".py"):
        raise ValueError(f"-m {name!r} is not a module name; pass a dotted name (-m pkg.train), "
                         f"or drop -m to run a file (dtlaunch --nproc 2 {name})")
    top = name.split(".")[0]
    if top not in sys.builtin_module_names and importlib.machinery.PathFinder.find_spec(
            top, [os.getcwd(), *sys.path[1:]]) is None:
        raise ValueError(f"-m {name}: no module named {top!r} in {os.getcwd()} or on sys.path; "
                         "run dtlaunch from the directory that holds it, or add that directory "
                         "to PYTHONPATH")


def _count(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{flag} must be a positive number, got {text}; e.g. {flag} 2")
    return value


def _nnodes(text: str | None) -> int:
    if text is not None and ":" in text:  # torchrun's elastic MIN:MAX
        low, _, high = text.partition(":")
        if low != high:
            raise ValueError(f"--nnodes {text}: elastic node ranges are not supported; pass a "
                             "fixed number of nodes, e.g. --nnodes 2")
        text = low
    return 1 if text is None else _count(text, "--nnodes")


def _hosts(hostfile: str) -> list[str]:
    """The distinct hosts of a hydra hostfile, in order (``host[:slots]`` lines, # comments)."""
    return list(dict.fromkeys(h for h, _ in _host_slots(hostfile)))


def _host_slots(hostfile: str) -> list[tuple[str, int]]:
    """(host, slots) of each line of a hydra hostfile (slots default 1)."""
    out = []
    with open(hostfile) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                host, _, slots = words[0].partition(":")
                out.append((host, int(slots) if slots.isdigit() else 1))
    return out


def _placement(hostfile: str, nproc: int, per_node: int | None) -> list[str]:
    """The host of each rank as hydra places them: each host's slots (or ``per_node``) in
    turn, round again if the ranks outnumber them."""
    slots = [(h, per_node or n) for h, n in _host_slots(hostfile)]
    out: list[str] = []
    while len(out) < nproc and slots:
        for host, n in slots:
            out += [host] * min(n, nproc - len(out))
    return out


def _allocation(opts: argparse.Namespace) -> tuple[str, str] | None:
    """Inside a Slurm or PBS allocation and given no --hostfile: its hosts as a hostfile
    (``opts.hostfile`` is set to it) and, without a count, its slots as --nproc. Returns (the
    hostfile made, a line saying what was found), or None outside an allocation."""
    if opts.hostfile is not None:
        return None
    alloc = allocation.from_env()
    if alloc is None:
        return None
    if opts.nproc is None and opts.nproc_per_node is None:
        opts.nproc = alloc.slots
    if opts.nproc is not None and opts.nproc > alloc.slots:
        raise ValueError(f"--nproc {opts.nproc} but the {alloc.kind} allocation holds "
                         f"{alloc.slots} ranks ({alloc.describe()}); pass --nproc {alloc.slots} "
                         f"or fewer, or ask the scheduler for more tasks")
    fd, path = tempfile.mkstemp(prefix="dtensor-hosts-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(alloc.hostfile_text())
    opts.hostfile = path
    return path, (f"dtlaunch: running in a {alloc.kind} allocation: {len(alloc.hosts)} host(s), "
                  f"{alloc.describe()}; {opts.nproc or alloc.slots} rank(s)")


def _hydra_options(opts: argparse.Namespace) -> list[str]:
    """--launcher, --launcher-exec and --iface as hydra spells them."""
    out = []
    for flag, value in (("-launcher", opts.launcher), ("-launcher-exec", opts.launcher_exec),
                        ("-iface", opts.iface)):
        if value is not None:
            out += [flag, value]
    return out


@dataclass(frozen=True)
class _Layout:
    """How many ranks to start and how to place them.

    Attributes:
        nproc: ranks in all.
        per_node: ranks per host (hydra's ``-ppn``) when --nnodes is given with a hostfile.
        note: a line for stderr when dtlaunch chose or ignored something the user should know.
    """

    nproc: int
    per_node: int | None
    note: str | None


def _layout(opts: argparse.Namespace) -> _Layout:
    """The job's size from dtlaunch's and torchrun's options: --nproc counts every rank,
    --nproc_per_node x --nnodes does too; with neither, one rank per usable core here."""
    nodes = _nnodes(opts.nnodes)
    if nodes > 1:
        if opts.hostfile is None:
            raise ValueError(f"--nnodes {nodes} needs a --hostfile listing the {nodes} hosts "
                             "(one 'host[:slots]' per line); dtlaunch starts every node's ranks "
                             "from here")
        hosts = _hosts(opts.hostfile)
        if len(hosts) < nodes:
            raise ValueError(f"--nnodes {nodes} but --hostfile {opts.hostfile} lists "
                             f"{len(hosts)} host(s) ({', '.join(hosts) or 'none'}); list one "
                             f"line per node or pass --nnodes {len(hosts)}")
    per_node = opts.nproc_per_node
    if per_node == "auto" or (per_node is None and opts.nproc is None):
        per_node = available_cores()
    elif per_node is not None:
        per_node = _count(per_node, "--nproc_per_node")
    note = None
    if opts.nproc is None and opts.nproc_per_node is None:
        what = f"{per_node} ranks" if nodes == 1 else f"{nodes} nodes x {per_node} ranks"
        note = (f"dtlaunch: no --nproc given; using {what} (one per usable core"
                f"{' of this host' if nodes > 1 else ''})")
    if per_node is None:  # --nproc alone
        nproc = opts.nproc
        if opts.nnodes is not None and nproc % nodes:
            raise ValueError(f"--nproc {nproc} does not split evenly over --nnodes {nodes}; pass "
                             f"--nproc_per_node N for N ranks on each of the {nodes} nodes")
        per_node = nproc // nodes
    elif opts.nproc is not None and opts.nproc != nodes * per_node:
        raise ValueError(f"--nproc {opts.nproc} and --nproc_per_node {opts.nproc_per_node} "
                         f"disagree: --nproc counts every rank, here {nodes} node(s) x {per_node} "
                         f"= {nodes * per_node}; pass only one of them")
    ignored = [n for n in IGNORED_TORCHRUN if getattr(opts, n[2:]) is not None]
    if ignored:
        note = "\n".join(filter(None, [note, (
            f"dtlaunch: ignoring {', '.join(ignored)}: MPI's process manager connects the ranks "
            "(for several nodes pass --hostfile and --nnodes, and run dtlaunch once)")]))
    spread = opts.hostfile is not None and opts.nnodes is not None
    return _Layout(nodes * per_node, per_node if spread else None, note)


def _seconds(var: str, default: float, off: str) -> float:
    text = os.environ.get(var, str(default))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{var}={text!r} must be a number of seconds >= 0 (default "
                         f"{default:g}; 'inf' turns {off} off)")
    return value


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 10)}"


class _Watch:
    """Notices, between mpiexec's polls, a job that can no longer finish (see the module doc).

    :meth:`check` returns the report to print, its last line naming what failed, or None.
    """

    def __init__(self, job: MpiJob, grace: float, hang: float) -> None:
        self.job, self.grace, self.hang = job, grace, hang
        self.children: dict[int, str] = {}
        self.child_gone_at: float | None = None
        self.first_done_at: float | None = None
        self.waits = StuckWatch(job)
        self.deadlock = StuckWatch(job)
        self.status = 1  # the exit status of the job that check() reports
        self.asked_at: float | None = None
        self.probe, self.rank_hosts, self.host_timeout = None, [], DEFAULT_HOST_TIMEOUT

    def check(self) -> str | None:
        return (self._hang_report() or self._host_lost() or self._lost_child()
                or self._left_waiting() or self._deadlocked())

    def _host_lost(self) -> str | None:
        """A host of the job stopped answering on the network (launcher/hang.py HostProbe)."""
        if self.probe is None:
            return None
        lost = self.probe.lost(self.host_timeout)
        if not lost:
            return None
        host, silent = max(lost.items(), key=lambda kv: kv[1])
        ranks = [r for r, h in enumerate(self.rank_hosts) if h == host]
        return (f"dtlaunch: host {host} ({_ranks(ranks)}) has not answered on the network for "
                f"{silent:.0f} s ({HOST_VAR}={self.host_timeout:g}): its link is down or the "
                f"host is gone, and its ranks cannot reach the others; the job was ended\n"
                f"dtlaunch: job failed: lost host {host} ({_ranks(ranks)}); exit status 1\n")

    def ask(self) -> None:
        """SIGUSR1 to dtlaunch: every rank dumps its flight recorder, then the job ends."""
        path = self.job.path(REQUEST)
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write('{"rank": null, "why": "SIGUSR1 to dtlaunch"}')

    def _hang_report(self) -> str | None:
        """A rank's watchdog fired (or ask()): once every rank has written its flight report,
        or FLIGHT_WAIT_S later, the diagnosis (launcher/hang.py)."""
        if not os.path.exists(self.job.path(REQUEST)):
            return None
        now = time.monotonic()
        self.asked_at = self.asked_at or now
        reports, done = self.job.records("flight"), self.job.records("done")
        silent = [r for r in range(self.job.nproc) if r not in reports and r not in done]
        if silent and now - self.asked_at < FLIGHT_WAIT_S:
            return None
        stacks = ({r: s for r, s in self.job.dump_stacks().items() if r in silent}
                  if silent else {})
        self.status = TIMEOUT_EXIT
        return diagnose(reports, sorted(done), stacks, self.status)

    def _lost_child(self) -> str | None:
        if not self.children:  # hydra starts them once, at once
            # ... and the ranks recorded theirs: a proxy killed before this first look is
            # no longer mpiexec's child, but it is still the ranks' parent that died.
            self.children = {**self.job.rank_parents(), **self.job.children()}
            return None
        if self.child_gone_at is None:
            # Under an mpiexec that forks the ranks itself (gforker, Open MPI), they are its
            # children too, and one may end before the others: that is not this failure.
            ranks = set(self.job.rank_pids().values())
            gone = {p: n for p, n in self.children.items() if p not in ranks and not pid_alive(p)}
            if not gone:
                return None
            self.child_gone_at, self.children = time.monotonic(), gone
        if time.monotonic() - self.child_gone_at < CHILD_GONE_S:
            return None
        return self.lost_child_report(1, seen_here=True)

    def lost_child_report(self, status: int, seen_here: bool = False) -> str | None:
        """Why the job ended if a child of mpiexec died while the job ran, else None.

        Seen from here (``seen_here``: a child of mpiexec gone for seconds while mpiexec runs)
        or by the ranks it started (their ``orphan`` records): once they exit, mpiexec notices
        and exits too, possibly before this watch looked again. A child seen gone just before
        mpiexec exited is no evidence: hydra's proxy also ends when its ranks were killed.
        """
        dead = {pid: (name, []) for pid, name in self.children.items() if seen_here}
        for rank, record in sorted(self.job.records("orphan").items()):
            dead.setdefault(record["pid"], (record["name"], []))[1].append(rank)
        if not dead:
            return None
        what = ", ".join(f"{name} (pid {pid}" + (f", parent of {_ranks(ranks)})" if ranks else ")")
                         for pid, (name, ranks) in sorted(dead.items()))
        return (f"dtlaunch: mpiexec's child process {what} died while the job ran (killed?); "
                "it was the MPI process manager of its host's ranks, which cannot go on without "
                "it: the job was ended\n"
                f"dtlaunch: job failed: {what} died; exit status {status}\n")

    def _left_waiting(self) -> str | None:
        done = self.job.records("done")
        if not done or self.job.failures():  # nobody finished yet, or an abort is under way
            return None
        now = time.monotonic()
        self.first_done_at = self.first_done_at or now
        running = sorted(self.job.rank_pids().keys() - done.keys())
        if not running or now - self.first_done_at < self.grace:
            return None
        waits = self.waits.stuck(running)
        if not waits:
            return None
        first = min(done.values(), key=lambda d: d["time"])
        left = ", ".join(f"rank {r} {d['how']} at {_clock(d['time'])}"
                         for r, d in sorted(done.items()))
        lines = [f"dtlaunch: {left} while {_ranks(running)} still ran; {self.grace:g} s later "
                 f"({GRACE_VAR}) {'it waits' if len(running) == 1 else 'they wait'} in an MPI "
                 "call that the finished ranks will never join. Python stacks:\n"]
        lines += [f"--- rank {r} ---\n{stack}" for r, (_, stack) in sorted(waits.items())]
        lines.append("dtlaunch: a rank that leaves early makes its peers wait forever in their "
                     "next collective: make every rank run the same collectives (to stop the job "
                     "on an error, raise: that ends every rank)\n")
        how = (first["how"] if len(done) == 1 else f"first: rank {first['rank']}, {first['how']}")
        lines.append(f"dtlaunch: job failed: {_ranks(sorted(done))} finished ({how}) while "
                     f"{_ranks(running)} waited in a collective; exit status 1\n")
        return "".join(lines)


    def _deadlocked(self) -> str | None:
        ranks = range(self.job.nproc)
        blocked = self.job.records("blocked")  # only ranks in an MPI call have one
        now = time.time()
        if (len(blocked) < len(ranks) or any(now - b["since"] < self.hang
                                             for b in blocked.values())
                or self.job.records("done") or self.job.failures()):
            self.deadlock.seen = None
            return None
        waits = self.deadlock.stuck(ranks)  # the stacks: a second look confirms the first
        if not waits:
            return None
        lines = [f"dtlaunch: every rank has waited in a blocking MPI call for over "
                 f"{self.hang:g} s ({HANG_VAR}), at the same place in two looks: the ranks are "
                 "in different or mismatched collectives, a deadlock:\n"]
        lines += [f"  rank {r}: {where}\n" for r, (where, _) in sorted(waits.items())]
        lines.append("dtlaunch: Python stacks:\n")
        lines += [f"--- rank {r} ---\n{stack}" for r, (_, stack) in sorted(waits.items())]
        lines.append("dtlaunch: every rank must issue the same collectives in the same order "
                     "(same operation, root, shape and dtype): look for a collective inside a "
                     "rank-dependent `if`, or ranks taking different paths through the code\n")
        calls = "; ".join(f"rank {r} in {where.split(' (in ')[0]}"
                          for r, (where, _) in sorted(waits.items()))
        lines.append(f"dtlaunch: job failed: deadlock in mismatched collectives: {calls}; "
                     "exit status 1\n")
        return "".join(lines)


def failure_summary(failures: Sequence[dict[str, Any]], status: int,
                    hosts: bool = False) -> str:
    """The closing lines for ranks that raised: the first rank's traceback once, then one line.

    Ranks with the same traceback (a failure every rank hits) share one copy; a different
    failure on another rank gets its exception line. ``hosts``: the job ran on several hosts,
    so the first failing rank's host is named too.
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
    where = f" on host {first['host']}" if hosts and "host" in first else ""
    what = (first["type"] + where if len(failed) == 1
            else f"an exception (first: rank {first['rank']}{where}, {first['type']})")
    lines.append(f"dtlaunch: job failed: {_ranks(failed)} raised {what}; exit status {status}\n")
    return "".join(lines)


def _wait(job: MpiJob, timeout: float | None, watch: _Watch) -> tuple[int, str | None]:
    """mpiexec's status, or (1, the watch's report) for a job that can no longer finish."""
    proc = job.proc
    assert proc is not None, "start the job first"
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        step = 1.0 if end is None else min(1.0, end - time.monotonic())
        if step <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0)
        try:
            return proc.wait(timeout=step), None
        except subprocess.TimeoutExpired:
            report = watch.check()
            if report is not None:
                return watch.status, report


def _run(job: MpiJob, timeout: float | None, grace: float, hang: float,
         placement: Sequence[str] = (), host_timeout: float = DEFAULT_HOST_TIMEOUT) -> int:
    """Wait for the job and report how it ended. ``placement``: each rank's host, when they
    are on several (a host that stops answering for ``host_timeout`` s ends the job)."""
    assert job.proc is not None, "start the job first"
    watch = _Watch(job, grace, hang)
    if len(set(placement)) > 1:
        watch.rank_hosts, watch.host_timeout = list(placement), host_timeout
        if host_timeout < float("inf"):
            watch.probe = HostProbe(list(dict.fromkeys(placement)))
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = (signal.signal(signal.SIGUSR1, lambda signum, frame: watch.ask())
                if in_main_thread else None)
    try:
        return _outcome(job, timeout, watch)
    finally:
        if watch.probe is not None:
            watch.probe.close()
        if in_main_thread:
            signal.signal(signal.SIGUSR1, previous)


def _outcome(job: MpiJob, timeout: float | None, watch: _Watch) -> int:
    proc = job.proc
    try:
        status, report = _wait(job, timeout, watch)
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
    if report is not None:
        job.kill()
        sys.stderr.write(report)
        return status
    failures = job.failures()
    lost = watch.lost_child_report(status) if status > 0 else None
    # where each rank was, if the job ended inside a collective (from the ranks' disk rings)
    inside = post_mortem({r: read_disk_ring(job.path(f"rank{r}.ring"))
                          for r in range(job.nproc)}, status) if status else None
    if failures:
        status = status or 1
        if inside is not None and inside[1] is not None:  # a mismatch: name every rank's call
            sys.stderr.write(inside[0])
        sys.stderr.write(failure_summary(failures, status, hosts=bool(watch.rank_hosts)))
    elif lost is not None:  # mpiexec may notice the ranks it lost once they exit, or not
        sys.stderr.write(lost)
    elif status < 0:
        sys.stderr.write(f"dtlaunch: mpiexec was killed by signal {-status}\n")
        status = 128 - status
    elif status != 0:
        if inside is not None:
            sys.stderr.write(inside[0])
        sys.stderr.write(inside[1] if inside is not None and inside[1] is not None else
                         f"dtlaunch: job failed with exit status {status} (a rank exited early "
                         "or was killed; see mpiexec's message above)\n")
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
    made_hostfile = None
    try:
        found = _allocation(opts)
        if found is not None:
            made_hostfile, note = found
            print(note, file=sys.stderr)
        _check(opts)
        grace = _seconds(GRACE_VAR, DEFAULT_GRACE, "the check for ranks left waiting")
        hang = _seconds(HANG_VAR, DEFAULT_HANG, "the check for deadlocked ranks")
        host_timeout = _seconds(HOST_VAR, DEFAULT_HOST_TIMEOUT, "the check for lost hosts")
        size = _layout(opts)
        mpiexec = find_mpiexec(opts.mpiexec)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dtlaunch: error: {exc}", file=sys.stderr)
        if made_hostfile:
            os.unlink(made_hostfile)
        return 2
    if size.note:
        print(size.note, file=sys.stderr)
    # A terminal on stdin is not forwarded: mpiexec runs in its own session (so that dtlaunch
    # alone decides how the job ends) and must not read the user's keystrokes.
    stdin = subprocess.DEVNULL if sys.stdin is None or sys.stdin.isatty() else None
    sys.stdout.flush()
    sys.stderr.flush()

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _Terminated

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    job = MpiJob(size.nproc, ["-m"] * opts.module + [opts.script, *opts.args], mpiexec=mpiexec,
                 hostfile=opts.hostfile, per_node=size.per_node, prefix=not opts.no_prefix,
                 launcher=_hydra_options(opts),
                 hosts=opts.hostfile is not None and len(_hosts(opts.hostfile)) > 1,
                 env={ENV_HANG: "1" if hang < float("inf") else "0", ENV_FLIGHT: "1",
                      **({"DTENSOR_TRACE": os.path.abspath(opts.trace)} if opts.trace else {})})
    try:
        job.start(stdin=stdin)
        status = _run(job, opts.timeout, grace, hang, _placement(
            opts.hostfile, size.nproc, size.per_node) if opts.hostfile else (), host_timeout)
        trace = os.path.join(os.path.abspath(opts.trace), "trace.json") if opts.trace else None
        if trace and os.path.exists(trace):
            print(f"dtlaunch: every rank's timeline is in {trace} (open it in Perfetto; "
                  f"python -m dtensor.profiler summary {trace})", file=sys.stderr)
        return status
    finally:
        job.close()
        if made_hostfile:
            os.unlink(made_hostfile)
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
