"""What the debugging tools see: the cause of the work being done now, and who listens.

The layers above keep ``CAUSE`` up to date only while an observer listens (CommDebugMode,
the profiler): the module whose forward (or backward) runs, the op whose sharding rule asked
for a redistribute, and its placements before and after. comm.py copies it into every
collective's flight entry and hands the entry to each observer in ``OBSERVERS`` when the
collective starts and ends. With nobody listening nothing on the dispatch path reads this
module: the observers swap their hooks in on entry and out on exit (debug.py, profiler.py).
"""
from __future__ import annotations

__all__ = ["CAUSE", "OBSERVERS", "listening", "cause"]

# module: "GPT.h.0.attn" (the module path), phase: "forward" | "backward",
# op / rule: the op and sharding rule that redistributed, placements: "[S(0)] -> [R]".
CAUSE: dict = {}
OBSERVERS: list = []  # objects with on_collective(entry, done: bool)


def listening() -> bool:
    return bool(OBSERVERS)


def cause() -> dict | None:
    """A copy of CAUSE for a collective's entry (None when nobody listens: the flight recorder
    alone keeps no cause, so the dispatch path never has to set it)."""
    return dict(CAUSE) if OBSERVERS else None
