"""dtlaunch's hang report: one diagnosis from every rank's flight recorder (dtensor/flight.py).

A rank's report holds the collective its main thread waits in (or none), its last collectives
(sequence number on their group, kind, shape, dtype, the user's source line, the cause) and
its Python stack. The diagnosis names the collective the job is stuck in (the waiting entry
that started first), which ranks of its group wait there, which never arrived (where each one's
last collective on that group was, and its stack now), and ranks that reached the same place
in the group's sequence with a different call: a mismatch.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from dtensor.flight import describe
from dtensor.launcher.job import ranks_text as _ranks


def _call(e: Mapping[str, Any]) -> tuple:
    return e["kind"], tuple(e["shape"]), e["dtype"]


def _last_on(report: Mapping[str, Any], group: tuple) -> dict | None:
    for e in reversed(report["ring"]):
        if tuple(e["group"]) == group:
            return e
    return None


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" for line in text.rstrip("\n").split("\n"))


def diagnose(reports: Mapping[int, Mapping[str, Any]], done: list[int],
             stacks: Mapping[int, str], status: int) -> str:
    """The text dtlaunch prints, ending with its ``job failed`` line.

    Args:
        reports: each answering rank's flight report (``rank{r}.flight``), by rank.
        done: the ranks whose script had ended.
        stacks: Python stacks of ranks that wrote no report (from faulthandler), by rank.
        status: the exit status the job ends with.
    """
    fired = sorted((r for r in reports.values() if r["why"] != "asked by dtlaunch"),
                   key=lambda r: r["time"])
    why = (f"rank {fired[0]['rank']} {fired[0]['why']}; diagnosed "
           f"{time.time() - fired[0]['time']:.1f} s later" if fired
           else "asked by dtlaunch (SIGUSR1)")
    lines = [f"dtlaunch: flight recorder: {why}\n"]
    waiting = {r: rep["waiting"] for r, rep in reports.items() if rep["waiting"]}
    if not waiting:
        lines.append("dtlaunch: no rank waits in a collective; Python stacks:\n")
        lines += [f"--- rank {r} ---\n{_indent(rep['stack'])}" for r, rep in sorted(
            reports.items())]
        lines += [f"--- rank {r} ---\n{s}" for r, s in sorted(stacks.items())]
        lines.append(f"dtlaunch: job ended on request with no collective waiting; exit status "
                     f"{status}\n")
        return "".join(lines)
    # the group of the wait that began first; in it, the place most of its ranks wait at
    group = tuple(waiting[min(waiting, key=lambda r: waiting[r]["start"])]["group"])
    on_group = [r for r in group if r in waiting and tuple(waiting[r]["group"]) == group]
    seqs = [waiting[r]["seq"] for r in on_group]
    seq = max(sorted(set(seqs)), key=seqs.count)
    here = [r for r in on_group if waiting[r]["seq"] == seq]
    calls: dict[tuple, list[int]] = {}
    for r in here:
        calls.setdefault(_call(waiting[r]), []).append(r)
    # the call most of them make is the one the others mismatch
    stuck = waiting[max(calls.values(), key=len)[0]]
    lines.append(f"dtlaunch: {_ranks(calls[_call(stuck)])} waiting in {describe(stuck)}\n")
    problems = []
    for call, rs in calls.items():
        if call != _call(stuck):
            e = waiting[rs[0]]
            lines.append(f"dtlaunch: mismatch: {_ranks(rs)} called {describe(e)} as the same "
                         f"collective #{e['seq']} of the group\n")
            problems.append(f"mismatched collective #{stuck['seq']}: {_ranks(rs)} in "
                            f"{call[0]} {call[1]} at {e['site']}")
    for r in sorted(set(group) - set(here)):
        rep = reports.get(r)
        if rep is None and r in done:
            lines.append(f"dtlaunch: rank {r} never arrived: its script had ended\n")
            problems.append(f"rank {r} never arrived (its script had ended)")
            continue
        if rep is None:
            lines.append(f"dtlaunch: rank {r} never arrived and wrote no flight report; its "
                         f"Python stack:\n" + stacks.get(r, "    (none)\n"))
            problems.append(f"rank {r} never arrived")
            continue
        last = _last_on(rep, group)
        before = (f"its last collective on this group was {describe(last)}"
                  + ("" if last["end"] else " (not finished)") if last
                  else "it issued no collective on this group")
        mine = rep["waiting"]
        if mine is not None and tuple(mine["group"]) == group:
            lines.append(f"dtlaunch: rank {r} is at a different place in the group's sequence: "
                         f"it waits in {describe(mine)}\n")
            problems.append(f"rank {r} in {mine['kind']} #{mine['seq']} at {mine['site']}")
        elif mine is not None:
            lines.append(f"dtlaunch: rank {r} never arrived: it waits in another group's "
                         f"{describe(mine)}; {before}\n")
            problems.append(f"rank {r} never arrived (waits in {mine['kind']} on ranks "
                            f"{list(mine['group'])} at {mine['site']})")
        else:
            lines.append(f"dtlaunch: rank {r} never arrived: {before}; it is now at:\n"
                         f"{_indent(rep['stack'])}")
            problems.append(f"rank {r} never arrived")
    lines.append("dtlaunch: each rank's last collectives, oldest first:\n")
    for r, rep in sorted(reports.items()):
        lines.append(f"--- rank {r} ({rep['host']}, pid {rep['pid']}) ---\n")
        lines += [f"    {describe(e)}{'' if e['end'] else '  (waiting)'}\n" for e in rep["ring"]]
    lines.append("dtlaunch: every rank must issue the same collectives in the same order (same "
                 "operation, shape and dtype): look for a collective under a rank-dependent "
                 "`if`, a rank that returns early, or ranks taking different paths\n")
    summary = "; ".join(problems) or "all its ranks are there (a slow transfer?)"
    lines.append(f"dtlaunch: job failed: hang in {stuck['kind']} #{stuck['seq']} at "
                 f"{stuck['site']}: {summary}; exit status {status}\n")
    return "".join(lines)


def post_mortem(rings: Mapping[int, list], status: int) -> tuple[str, str | None] | None:
    """For a job that ended while ranks were inside collectives (MPICH aborts a rank on some
    mismatched sizes): which collective each rank was in, from their disk rings
    (dtensor/flight.py), and what every rank of that group called at the same place.

    Returns None if no rank was inside one, else (the report, its ``job failed`` line if the
    ranks' calls differ, else None)."""
    inside = {r: e for r, ring in rings.items() for e in ring[-1:] if e["end"] is None}
    if not inside:
        return None
    lines = ["dtlaunch: flight recorder: when the job ended, "
             + ", ".join(f"rank {r} was inside {describe(e)}" for r, e in sorted(inside.items()))
             + "\n"]
    problems = []
    for key in dict.fromkeys((tuple(e["group"]), e["seq"]) for e in inside.values()):
        calls: dict[tuple, list] = {}
        for r in key[0]:
            e = next((e for e in rings.get(r, ()) if (tuple(e["group"]), e["seq"]) == key), None)
            if e is not None:
                calls.setdefault(_call(e), []).append((r, e))
        if len(calls) > 1:
            for call, held in calls.items():
                lines.append(f"dtlaunch: at collective #{key[1]} of ranks {list(key[0])}, "
                             f"{_ranks([r for r, _ in held])} called {describe(held[0][1])}\n")
            problems.append(f"ranks called different collectives or shapes at #{key[1]} of "
                            f"ranks {list(key[0])}: " + "; ".join(
                                f"{_ranks([r for r, _ in held])} {call[0]} {call[1]} at "
                                f"{held[0][1]['site']}" for call, held in calls.items()))
    if not problems:
        return "".join(lines), None
    lines.append("dtlaunch: every rank must pass the same shape and dtype to a collective (for "
                 "uneven gathers and scatters, pass sizes=[...])\n")
    return "".join(lines), (f"dtlaunch: job failed: mismatched collective: "
                            f"{'; '.join(problems)}; exit status {status}\n")


class HostProbe:
    """Whether each host of a multi-host job still answers on the network.

    A thread knocks on each host every ``every`` seconds with a TCP connection to a port
    nobody listens on (``PORT``): a host that is up answers at once, refusing it; a host whose
    link is down (or that is gone) does not answer at all. A host that has never answered (a
    firewall that drops such packets silently) is never taken for lost. Costs one packet each
    way per host per knock.
    """

    PORT = 1

    def __init__(self, hosts: list[str], every: float = 2.0):
        self.hosts, self.every = hosts, every
        self.answered: dict[str, float] = {}  # host -> when it last answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtlaunch-hosts", daemon=True)
        self._thread.start()

    def _knock(self, host: str) -> bool:
        try:
            socket.create_connection((host, self.PORT), timeout=self.every).close()
        except ConnectionRefusedError:
            return True
        except OSError:  # timed out, host or network unreachable
            return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            for host in self.hosts:
                if self._knock(host):
                    self.answered[host] = time.monotonic()
            self._stop.wait(self.every)

    def lost(self, after: float) -> dict[str, float]:
        """Hosts that answered once but not for ``after`` seconds: host -> seconds silent."""
        now = time.monotonic()
        return {h: now - t for h, t in list(self.answered.items()) if now - t > after}

    def close(self) -> None:
        self._stop.set()
