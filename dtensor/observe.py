"""What the debugging tools see: the cause of the work being done now, and who listens.

``CAUSE`` says what the collectives issued now are for. A redistribute always sets its
``placements`` (cheap: a collective follows); the module path and phase, and the op and
sharding rule, are kept only while hooks are in (``TRACKING``: CommDebugMode, the profiler, or
compile's tracing, see dtensor/debug.py), which swap themselves into Module.__call__,
autograd.record and the DTensor interpreter, so that with no tool open nothing of this runs on
the dispatch path. comm.py copies CAUSE into each collective's flight entry
(dtensor/flight.py) and hands the entry to each of ``OBSERVERS`` when the collective starts
and when it ends.
"""
from __future__ import annotations

__all__ = ["CAUSE", "OBSERVERS", "OWNERS", "SPANS", "TRACKING", "where"]

# module: "GPT.h.0.attn" (the module path), phase: "forward" | "backward",
# op / rule: the op and sharding rule that redistributed, placements: "[S(0)] -> [R]".
CAUSE: dict = {}
OBSERVERS: list = []  # objects with on_collective(entry, done: bool), maybe on_where
SPANS = None  # the open dtensor.profiler.profile: a compiled graph times its nodes through it
TRACKING = False  # the hooks that keep CAUSE's module are in (dtensor/debug.py)
OWNERS: dict = {}  # id(parameter) -> the path of the module that holds it, while listening


def where(module: str | None, phase: str | None) -> None:
    """The work from now on is ``module``'s ``phase`` ("forward" or "backward"; None: outside
    any module); observers with an ``on_where`` (the profiler's module spans) are told."""
    for key, value in (("module", module), ("phase", phase)):
        if value is None:
            CAUSE.pop(key, None)
        else:
            CAUSE[key] = value
    for o in OBSERVERS:
        hook = getattr(o, "on_where", None)
        if hook is not None:
            hook(module, phase)
