"""What the debugging tools see: the cause of the work being done now, and who listens.

The layers above keep ``CAUSE`` up to date only while an observer listens (CommDebugMode,
the profiler): the module whose forward (or backward) runs, the op whose sharding rule asked
for a redistribute, and its placements before and after. comm.py copies it into every
collective's flight entry and hands the entry to each observer in ``OBSERVERS`` when the
collective starts and ends. With nobody listening nothing on the dispatch path reads this
module: the observers swap their hooks in on entry and out on exit (debug.py, profiler.py).
"""
from __future__ import annotations

__all__ = ["CAUSE", "OBSERVERS", "OWNERS", "TRACKING", "where"]

# module: "GPT.h.0.attn" (the module path), phase: "forward" | "backward",
# op / rule: the op and sharding rule that redistributed, placements: "[S(0)] -> [R]".
CAUSE: dict = {}
OBSERVERS: list = []  # objects with on_collective(entry, done: bool), maybe on_where
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
