"""Argument checks shared by the public entry points: an integer, a real number in a range, a
flag, a dim of a shape, a shape.

Each raises TypeError for the wrong kind of value and ValueError (IndexError for a dim, as
PyTorch) for a wrong value, naming the value, what it was for and the fix, so a bad argument
reads the same wherever it enters. Python's own errors for these (``'float' object is not
iterable``, ``tuple indices must be integers``, ``ZeroDivisionError``) say neither.

It sits below every other layer (it imports only numpy), so placements, meshes, tensors,
modules and the parallel API all call the same checks.
"""
from __future__ import annotations

import numbers
import operator
from typing import Sequence

import numpy as np

__all__ = ["as_int", "as_real", "as_bool", "as_dim", "as_shape"]


def _tail(fix: str) -> str:
    return f" {fix}" if fix else ""


def _kind(value) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def as_int(value, what: str, *, low: int | None = None, fix: str = "") -> int:
    """``value`` as a Python int: an int or numpy integer (anything with ``__index__``), not a
    bool, float or string, and at least ``low`` when given.

    A float is refused even when whole (``2.0``): PyTorch refuses it too, and accepting it
    would let ``Shard(1.5)`` or a shape ``(2.5, 3)`` through half-checked.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer, got the bool {value!r}.{_tail(fix)}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r} ({_kind(value)})."
                        f"{_tail(fix)}") from None
    if low is not None and out < low:
        bound = "positive" if low == 1 else "non-negative" if low == 0 else f">= {low}"
        raise ValueError(f"{what} must be {bound}, got {out}.{_tail(fix)}")
    return out


def as_real(value, what: str, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, high_open: bool = False, fix: str = "") -> float:
    """``value`` as a float: a real number (not a bool or string) in [low, high]; ``low_open``
    / ``high_open`` exclude the bound. NaN is never in range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {value!r} ("
                        f"{_kind(value)}).{_tail(fix)}")
    out = float(value)
    below = low is not None and (out <= low if low_open else out < low)
    above = high is not None and (out >= high if high_open else out > high)
    if below or above or out != out:
        lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
        hi = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
        raise ValueError(f"{what} must lie in {lo}, {hi}, got {value!r}.{_tail(fix)}")
    return out


def as_bool(value, what: str, *, fix: str = "") -> bool:
    """``value`` as a bool: True or False (a numpy bool too), nothing merely truthy: "no" or
    "False" would otherwise switch a flag on."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{what} must be True or False, got {value!r} ({_kind(value)})."
                    f"{_tail(fix)}")


def as_dim(dim, shape: Sequence[int] | int, *, op: str = "", what: str = "dim",
           ndim: int | None = None) -> int:
    """``dim`` of a tensor of ``shape`` (or of that many dims, given an int) as a
    non-negative int: an integer in [-n, n), n = ``ndim`` (default the tensor's; one more for
    unsqueeze's new dim, at least 1 where a 0-d tensor takes dim 0 or -1 as PyTorch's
    reductions do)."""
    rank = shape if isinstance(shape, int) else len(shape)
    n = rank if ndim is None else ndim
    head = f"{op}: {what}" if op else what
    d = as_int(dim, head)
    if not -n <= d < n:
        valid = f"valid: {-n}..{n - 1}" if n else "it has no dims"
        of = f"a {rank}-d tensor" if isinstance(shape, int) else \
            f"a tensor of shape {tuple(shape)}"
        raise IndexError(f"{head} {d} is out of range for {of} ({valid}).")
    return d % n


def as_shape(shape, what: str = "shape", *, infer: bool = False, positive: bool = False,
             fix: str = "") -> tuple:
    """``shape`` as a tuple of non-negative ints (positive ones with ``positive``); with
    ``infer``, entries may also be -1 (a size worked out by the caller: reshape's inferred
    dim, expand's kept one)."""
    if type(shape) is tuple:  # the common case, on every reshape: no per-entry conversion
        for n in shape:
            if type(n) is not int or n <= 0:
                break
        else:
            return shape

    def fine(n):
        return n > 0 or n == 0 and not positive or n == -1 and infer

    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise TypeError(f"{what} must be a sequence of integers such as (2, 3), got {shape!r} "
                        f"({_kind(shape)}).{_tail(fix)}")
    out = []
    for i, n in enumerate(shape):
        try:
            out.append(as_int(n, what))
        except TypeError:
            raise TypeError(f"{what} {tuple(shape)!r} must hold integers; entry {i} is {n!r} "
                            f"({_kind(n)}).{_tail(fix)}") from None
    bad = [n for n in out if not fine(n)]
    if bad:
        allowed = "positive sizes" if positive else "non-negative sizes"
        allowed += ", or -1" if infer else ""
        raise ValueError(f"{what} {tuple(out)} has {bad[0]}: it takes {allowed}.{_tail(fix)}")
    return tuple(out)
