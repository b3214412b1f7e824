"""A per-thread switch that a context manager sets for the length of a block."""
from __future__ import annotations

import threading
from contextlib import contextmanager


class Flag(threading.local):
    """``flag.on`` is this thread's value; ``with flag.set(v):`` sets it and restores it after
    (the context manager also works as a decorator)."""

    def __init__(self, default: bool):
        self.on = default

    @contextmanager
    def set(self, value: bool = True):
        prev = self.on
        self.on = value
        try:
            yield
        finally:
            self.on = prev
