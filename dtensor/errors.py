"""Errors raised at more than one layer, and where in the user's code they arose.

This module sits at the bottom of the layers (it imports nothing of dtensor), so the tensor
layer can raise a tracing error without importing the tracer above it.
"""
from __future__ import annotations

import importlib.util
import os
import traceback

__all__ = ["OWN_DIRS", "CollectiveError", "TracingError", "user_line"]


def _own_dirs() -> tuple:
    """The folders of dtensor's own code. The compiler and the launcher are found by spec, not
    imported: in a source checkout they live beside the package (compile/, launcher/)."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    dirs = [here]
    for name in ("dtensor.compile", "dtensor.launcher"):
        spec = importlib.util.find_spec(name)
        for d in (spec.submodule_search_locations or []) if spec else []:
            d = os.path.abspath(d) + os.sep
            if not d.startswith(here):
                dirs.append(d)
    return tuple(dirs)


# Frames in these folders are dtensor's own; an error names the first frame outside them.
OWN_DIRS = _own_dirs()


class TracingError(RuntimeError):
    """The traced function did something a graph cannot hold."""


class CollectiveError(RuntimeError):
    """MPI failed a collective: most often the ranks passed buffers of different sizes."""


def user_line() -> str:
    """``file:line: code`` of the innermost frame outside dtensor itself."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if not path.startswith(OWN_DIRS):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "<unknown>"
