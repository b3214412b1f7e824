"""A timeline of every rank in one Chrome trace (Perfetto, chrome://tracing), and its summary.

    with dtensor.profiler.profile("trace.json"):       # collective: every rank enters it
        for _ in range(3):
            train_step(x, y)

or ``DTENSOR_TRACE=dir`` (``dtlaunch --trace dir``) for a whole job: ``dir/trace.json`` at exit.

The trace holds one process row per rank, with spans for each module's forward and backward
(``GPT.blocks.0.attn (forward)``), each op (eager) or node of a compiled graph (its kernel,
op or collective), each collective (kind, bytes, shape, group, placements, the module that
caused it) and, inside it, the time the rank waited for the last rank of its group to arrive
(``wait``), and each optimizer step. Ranks align their clocks with two barriers at the start;
rank 0 gathers every rank's events at the end and writes one file.

    python -m dtensor.profiler summary trace.json

prints the top spans and, per rank, its time split into compute (inside some span but not in
a collective), communication (in a collective, not waiting) and waiting; what is left of the
profiled time (Python between spans outside any module) is shown as ``other``.

With no profile open nothing of this runs: its hooks (``registry.apply``, ``Module.__call__``,
``Optimizer.step``/``zero_grad``, autograd's backward pass, a compiled function's call and its
graph's call table) are swapped in on entry and out on exit.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from contextlib import contextmanager

import numpy as np

from dtensor import autograd, observe
from dtensor.graph import Node
from dtensor.ops import registry

__all__ = ["profile", "summary", "totals", "load"]

_ACTIVE: "profile | None" = None


class profile:
    """Record a timeline of the block on every rank; rank 0 writes ``path`` on exit (see the
    module doc). ``path`` None: keep the merged events in ``.events`` on rank 0 only."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.events: list[dict] = []
        self._spans: list[tuple] = []  # (name, cat, start, end, args)
        self._open: list[tuple] = []  # the module spans open now: (name, start)
        self._started: dict = {}  # id(flight entry) -> perf_counter at its start
        self._tables: dict = {}  # id(compiled entry) -> its call table with spans
        self._saved: tuple = ()

    # -- entry and exit
    def __enter__(self) -> "profile":
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("dtensor.profiler.profile: a profile is already open; profiles "
                               "do not nest (close the first one, or record one longer block).")
        from dtensor.comm import get_world
        from dtensor.debug import _Tracking
        from dtensor.optim.optimizers import Optimizer
        world = get_world()
        if world.size > 1:  # two barriers: the second one's exit is the common zero
            world.barrier()
            world.barrier()
        self._t0 = time.perf_counter()
        self._rank, self._world = world.rank, world
        plain = (registry.apply, Optimizer.step, Optimizer.zero_grad, autograd._run)
        spans, now = self._spans, time.perf_counter

        def apply(op, *args, **params):
            start = now()
            try:
                return plain[0](op, *args, **params)
            finally:
                spans.append((op.name, "op", start, now(), None))

        def timed(f, cat, name=None):
            def call(*args, **kwargs):
                start = now()
                try:
                    return f(*args, **kwargs)
                finally:
                    spans.append((name or f"{type(args[0]).__name__}.{f.__name__}", cat, start,
                                  now(), None))
            return call

        self._saved = (Optimizer, plain)
        registry.apply = apply
        Optimizer.step = timed(plain[1], "optimizer")
        Optimizer.zero_grad = timed(plain[2], "optimizer")
        autograd._run = timed(plain[3], "autograd", "backward")  # the whole backward pass
        _Tracking.acquire()
        observe.OBSERVERS.append(self)
        observe.SPANS = self
        _ACTIVE = self
        self.on_where(observe.CAUSE.get("module"), observe.CAUSE.get("phase"))
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        from dtensor.debug import _Tracking
        end = time.perf_counter()
        self.on_where(None, None)
        Optimizer, plain = self._saved
        registry.apply, Optimizer.step, Optimizer.zero_grad, autograd._run = plain
        observe.SPANS = None
        observe.OBSERVERS.remove(self)
        _Tracking.release()
        _ACTIVE = None
        self._spans.append(("profile", "profile", self._t0, end, None))
        mine = [self._event(*s) for s in self._spans]
        gathered = self._world._c.gather(mine, root=0) if self._world.size > 1 else [mine]
        if self._rank == 0:
            self.events = merge(gathered)
            if self.path is not None:
                d = os.path.dirname(os.path.abspath(self.path))
                os.makedirs(d, exist_ok=True)
                tmp = f"{self.path}.tmp"
                with open(tmp, "w") as f:
                    json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
                os.replace(tmp, self.path)

    def _event(self, name, cat, start, end, args) -> dict:
        e = {"name": name, "cat": cat, "ph": "X", "ts": round((start - self._t0) * 1e6, 3),
             "dur": round((end - start) * 1e6, 3), "pid": self._rank, "tid": 0}
        if args:
            e["args"] = args
        return e

    # -- what the hooks report
    def on_where(self, module: str | None, phase: str | None) -> None:
        """Module spans: close those the new place is not inside, open the new ones."""
        want = []
        if module is not None:
            parts = module.split(".")
            want = [f"{'.'.join(parts[:i])} ({phase})" for i in range(1, len(parts) + 1)]
        keep = 0
        while keep < min(len(want), len(self._open)) and self._open[keep][0] == want[keep]:
            keep += 1
        t = time.perf_counter()
        for name, start in reversed(self._open[keep:]):
            self._spans.append((name, "module", start, t, None))
        del self._open[keep:]
        self._open += [(name, t) for name in want[keep:]]

    def on_collective(self, entry, done: bool) -> None:
        if not done:
            self._started[id(entry)] = time.perf_counter()
            return
        start = self._started.pop(id(entry), None)
        if start is None:
            return
        c = entry.cause or {}
        args = {"bytes": entry.bytes, "shape": list(entry.shape), "dtype": str(entry.dtype),
                "group": list(entry.group), "seq": entry.seq, "site": entry.site,
                **{k: v for k, v in c.items() if v}}
        self._spans.append((entry.kind, "collective", start, time.perf_counter(), args))

    @contextmanager
    def span(self, name: str, cat: str, **args):
        """A span around a block (a compiled graph's whole call)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._spans.append((name, cat, start, time.perf_counter(), args or None))

    def table(self, entry) -> list:
        """A compiled graph's call table (its ``F``) with a span around each node's call."""
        table = self._tables.get(id(entry))
        if table is None:
            spans, now, where = self._spans, time.perf_counter, self.on_where

            def timed(f, node):
                name, cause = node.name, node.cause or {}
                module, phase = cause.get("module"), cause.get("phase")
                args = {"bytes": _node_bytes(node)} if node.kind != "comm" else None

                def call(*a, **kwargs):
                    if module is not None:  # the module spans, from where it was traced
                        where(module, phase)
                    start = now()
                    try:
                        return f(*a, **kwargs)
                    finally:
                        spans.append((name, "kernel", start, now(), args))
                return call

            table = self._tables[id(entry)] = [timed(f, n) for f, n in
                                               zip(entry.tables["F"], entry.graph.nodes)]
        return table


def _node_bytes(node) -> int:
    """The bytes a graph node's arrays hold: its array inputs and its result, each counted
    once, at its shape. Over a span's time it gives the rate the summary prints; against the
    machine's copy rate it shows whether a kernel that reads and writes all of them is bound by
    memory or by its arithmetic. A node that touches part of an array (a view, a gather, a
    scatter) counts all of it, so its rate can pass the copy rate."""
    def size(n: Node) -> int:
        if n.dtype is None or n.shape is None:  # a node with no array value
            return 0
        return math.prod(n.shape) * np.dtype(n.dtype).itemsize
    inputs = {id(a): a for a in node.inputs if isinstance(a, Node)}
    return size(node) + sum(map(size, inputs.values()))


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """Every rank's events in one list, with each rank's row named, and a ``wait`` span inside
    each collective for the time until the last rank of its group arrived."""
    out = []
    arrivals: dict = {}  # (group, seq) -> latest start over the group's ranks
    for events in per_rank:
        for e in events:
            if e["cat"] == "collective":
                key = (tuple(e["args"]["group"]), e["args"]["seq"])
                arrivals[key] = max(arrivals.get(key, e["ts"]), e["ts"])
    for rank, events in enumerate(per_rank):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        for e in events:
            out.append(e)
            if e["cat"] == "collective":
                last = arrivals[(tuple(e["args"]["group"]), e["args"]["seq"])]
                wait = min(last - e["ts"], e["dur"])
                if wait > 0:
                    out.append({"name": "wait", "cat": "wait", "ph": "X", "ts": e["ts"],
                                "dur": round(wait, 3), "pid": e["pid"], "tid": 0,
                                "args": {"for": f"{e['name']} #{e['args']['seq']}"}})
    return out


# ----------------------------------------------------------------------------- reading

def load(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def breakdown(events: list[dict]) -> dict[int, dict[str, float]]:
    """Per rank, in ms: ``profiled`` (the profile's span), ``compute``, ``communication``,
    ``waiting`` and ``other`` (see the module doc); the four add up to ``profiled``."""
    out = {}
    for rank in sorted({e["pid"] for e in events if e.get("ph") == "X"}):
        mine = [e for e in events if e.get("ph") == "X" and e["pid"] == rank]
        window = next((e["dur"] for e in mine if e["cat"] == "profile"), None)
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] != "profile"]
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == "collective"]
        waiting = sum(e["dur"] for e in mine if e["cat"] == "wait")
        covered, in_comm = _union(spans), _union(comm)
        if window is None:
            window = covered
        out[rank] = {"profiled": window / 1e3, "compute": (covered - in_comm) / 1e3,
                     "communication": (in_comm - waiting) / 1e3, "waiting": waiting / 1e3,
                     "other": (window - covered) / 1e3}
    return out


def totals(events: list[dict]) -> dict:
    """(category, name) -> (spans, total us, bytes) over the events' spans (bytes: compiled
    nodes' arrays; 0 for other spans)."""
    by_name: dict = {}
    for e in events:
        if e.get("ph") == "X" and e["cat"] != "profile":
            n, total, nbytes = by_name.get((e["cat"], e["name"]), (0, 0.0, 0))
            b = (e.get("args") or {}).get("bytes", 0) if e["cat"] == "kernel" else 0
            by_name[e["cat"], e["name"]] = (n + 1, total + e["dur"], nbytes + b)
    return by_name


def summary(events: list[dict], top: int = 15) -> str:
    """The text ``python -m dtensor.profiler summary`` prints."""
    by_name = totals(events)
    ranks = len({e["pid"] for e in events if e.get("ph") == "X"})
    lines = [f"top spans (all {ranks} ranks; module spans include what runs inside them; GB/s: "
             f"a compiled node's arrays, read and written, over its time)",
             f"{'category':<11} {'name':<44} {'count':>7} {'total ms':>10} {'mean us':>9} "
             f"{'GB/s':>7}"]
    for (cat, name), (n, total, nbytes) in sorted(by_name.items(),
                                                   key=lambda kv: -kv[1][1])[:top]:
        rate = f"{nbytes / total / 1e3:>7.1f}" if nbytes and total else ""
        lines.append(f"{cat:<11} {name[:44]:<44} {n:>7} {total / 1e3:>10.2f} {total / n:>9.1f} "
                     f"{rate}".rstrip())
    lines += ["", f"{'rank':>4} {'profiled ms':>12} {'compute':>9} {'comm':>9} {'waiting':>9} "
                  f"{'other':>9}"]
    for rank, b in breakdown(events).items():
        lines.append(f"{rank:>4} {b['profiled']:>12.2f} {b['compute']:>9.2f} "
                     f"{b['communication']:>9.2f} {b['waiting']:>9.2f} {b['other']:>9.2f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- DTENSOR_TRACE

def start_from_env() -> None:
    """DTENSOR_TRACE=dir: profile the whole job; ``dir/trace.json`` is written at exit (by
    rank 0, after every rank's events are gathered)."""
    folder = os.environ.get("DTENSOR_TRACE")
    if not folder or _ACTIVE is not None:
        return
    p = profile(os.path.join(folder, "trace.json"))
    p.__enter__()
    atexit.register(lambda: _ACTIVE is p and p.__exit__(None, None, None))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "summary":
        print("usage: python -m dtensor.profiler summary trace.json", file=sys.stderr)
        return 2
    print(summary(load(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
