"""The hosts of a scheduler allocation dtlaunch runs inside: Slurm's or PBS's environment.

Slurm: ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``), a host list such as ``node[01-03,07],gpu5``,
with the tasks per node from ``SLURM_TASKS_PER_NODE`` (``2(x3),1``), else
``SLURM_NTASKS_PER_NODE``, else one per node. PBS: ``PBS_NODEFILE``, one line per slot.
dtlaunch writes them as a hydra hostfile, starts as many ranks as the allocation holds unless
told fewer, and refuses more.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Allocation", "from_env", "expand_hostlist"]


@dataclass(frozen=True)
class Allocation:
    """Where it came from ("Slurm" or "PBS") and its (host, slots) in order."""

    kind: str
    hosts: tuple[tuple[str, int], ...]

    @property
    def slots(self) -> int:
        return sum(n for _, n in self.hosts)

    def describe(self) -> str:
        return ", ".join(f"{h}:{n}" for h, n in self.hosts)

    def hostfile_text(self) -> str:
        return "".join(f"{h}:{n}\n" for h, n in self.hosts)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list: ``a[01-03,7],b`` -> a01 a02 a03 a7 b (ranges keep their
    zero padding)."""
    hosts: list[str] = []
    parts, depth, cur = [], 0, ""
    for ch in text:  # split at the commas outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    for part in filter(None, parts + [cur]):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if m is None:
            hosts.append(part)
            continue
        prefix, ranges, rest = m.groups()
        for piece in ranges.split(","):
            lo, _, hi = piece.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts += [prefix + str(i).zfill(width) + tail for tail in
                          (expand_hostlist(rest) if "[" in rest else [rest])]
    return hosts


def _tasks_per_node(env: Mapping[str, str], count: int) -> list[int]:
    text = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if not text:
        return [1] * count
    out: list[int] = []
    for piece in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r} is not Slurm's form, e.g. '2(x3),1'")
        out += [int(m[1])] * int(m[2] or 1)
    if len(out) == 1:
        out *= count
    if len(out) != count:
        raise ValueError(f"SLURM_TASKS_PER_NODE={text!r} gives {len(out)} nodes' tasks for the "
                         f"{count} nodes of the node list")
    return out


def from_env(env: Mapping[str, str] = os.environ) -> Allocation | None:
    """The allocation this process runs in, or None outside one."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        hosts = expand_hostlist(nodelist)
        return Allocation("Slurm", tuple(zip(hosts, _tasks_per_node(env, len(hosts)))))
    nodefile = env.get("PBS_NODEFILE")
    if nodefile:
        counts: dict[str, int] = {}
        with open(nodefile) as f:
            for line in f:
                if line.strip():
                    counts[line.strip()] = counts.get(line.strip(), 0) + 1
        return Allocation("PBS", tuple(counts.items()))
    return None
