"""The op registry: every computation in dtensor is ``apply(op, *inputs, **params)``.

An op is declared once, in one ``defop`` block, with all of its rules side by side:

- ``impl(*arrays, **params)``: numpy on local arrays;
- ``abstract(*avals, **params)``: output ``Aval`` (shape, dtype) from input avals, used by the
  tracer and by DTensor to know an output without computing it;
- ``vjp(g, out, *inputs, **params)``: the backward rule written with ops (never raw numpy), so
  that one rule serves Tensor, DTensor and tracer. It returns one entry per input: a gradient,
  ``None``, or a zero-argument callable producing the gradient; callables are only evaluated for
  inputs that need a gradient (so ``matmul`` does not pay for the weight-gradient GEMM of a
  frozen weight);
- ``linearity``: which inputs may stay ``Partial`` through the op: "all" (jointly linear: add,
  sub, reshape ...), "one" (linear in each input separately: mul, matmul), a tuple of the input
  positions it is linear in (div: ``(0,)``), or "none" (exp, max ...); read by the DTensor engine;
- ``shard``: the op's sharding rule for one mesh dim (filled in by the DTensor layer);
- ``lower``: how codegen emits it (a pointwise expression template, or a kind such as
  ``"reduce"`` / ``"extern"``), read by the compiler;
- ``local(*arrays, in_blocks, out_block, **params)``: for the few ops whose result on one
  rank's block depends on where the block sits (a lookup into vocabulary rows, random values
  drawn by global index), the kernel the DTensor interpreter runs on the blocks; ``Block``
  says where each sits. Other ops run ``impl`` on the blocks;
- ``localize(params, in_blocks, out_block)``: params that name global sizes (a reshape's
  shape, getitem's key) rewritten for this rank's blocks.

The interpretation follows the input types: ``Tensor`` runs ``impl`` eagerly; other tensor types
(DTensor, tracer) register an interpreter with :func:`register_interpreter`. Autograd recording
is the same for all of them and lives in :func:`apply`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from dtensor import autograd

__all__ = ["Aval", "Block", "Op", "defop", "apply", "OPS", "register_interpreter"]


class Aval(NamedTuple):
    """Abstract value: what is known about a tensor without its data."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


class Block(NamedTuple):
    """Where this rank's block of a distributed tensor sits in the global tensor: what an op's
    local kernel knows besides the block's data."""

    shape: tuple[int, ...]  # the global shape
    local_shape: tuple[int, ...]
    offset: tuple  # per dim, the first global index held (None on a StridedShard dim)
    indices: tuple  # per dim, the global indices held: a slice, or an array of them
    parts: tuple  # per dim, a StridedShard's part count (None elsewhere)

    def rows(self, axis: int) -> tuple:
        """(first global index, count) held along ``axis``."""
        return self.offset[axis], self.local_shape[axis]

    def local_key(self, key: tuple) -> tuple:
        """A canonical index (getitem's key) on the global shape as one on this block: a full
        slice of a split dim becomes a full slice of the block, and one whole part of a
        StridedShard dim (the only other slice a split dim allows) the block's piece of it."""
        real_d, out = 0, []
        for k in key:
            if isinstance(k, tuple) and k == (0, self.shape[real_d], 1):
                k = (0, self.local_shape[real_d], 1)
            elif isinstance(k, tuple) and self.parts[real_d]:
                n = self.parts[real_d]
                piece, part = self.local_shape[real_d] // n, k[0] * n // self.shape[real_d]
                k = (part * piece, (part + 1) * piece, 1)
            out.append(k)
            if k is not None:
                real_d += 1
        return tuple(out)

    def flat_offsets(self) -> np.ndarray:
        """The global row-major flat index of every element of the block."""
        strides = np.cumprod((1,) + tuple(reversed(self.shape[1:])))[::-1]
        flat = np.zeros(self.local_shape, np.int64)
        for d, idx in enumerate(self.indices):
            idx = np.arange(idx.start, idx.stop) if isinstance(idx, slice) else idx
            flat += (idx.astype(np.int64) * int(strides[d])).reshape(
                (-1,) + (1,) * (flat.ndim - d - 1))
        return flat


@dataclass(eq=False)
class Op:
    name: str
    impl: Callable[..., Any]
    abstract: Callable[..., Aval]
    vjp: Callable[..., tuple] | None = None
    linearity: str = "none"
    shard: Any = None
    lower: Any = None
    # Inputs that are never differentiated (integer indices, boolean conditions).
    nondiff: tuple[int, ...] = ()
    # Extra facts for the registry-wide tests (input domain, example params).
    meta: dict = field(default_factory=dict)
    local: Callable[..., Any] | None = None
    localize: Callable[..., dict] | None = None

    def __repr__(self) -> str:
        return f"<op {self.name}>"

    def __call__(self, *args, **params):
        return apply(self, *args, **params)


OPS: dict[str, Op] = {}

_LINEARITY = ("all", "one", "none")


def defop(name: str, *, impl, abstract, vjp=None, linearity="none", shard=None, lower=None,
          nondiff=(), local=None, localize=None, **meta) -> Op:
    """Declare an op once, with all of its rules. Returns the ``Op``, also kept in ``OPS``."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already registered")
    if linearity not in _LINEARITY and not isinstance(linearity, tuple):
        raise ValueError(f"op {name!r}: linearity must be one of {_LINEARITY} or a tuple of "
                         f"input positions, got {linearity!r}")
    op = Op(name, impl, abstract, vjp, linearity, shard, lower, tuple(nondiff), meta, local,
            localize)
    OPS[name] = op
    return op


# type -> interpreter(op, args, params) returning the output tensor (DTensor, tracer...).
_INTERPRETERS: dict[type, Callable] = {}
# Eager tensor types (Tensor, Parameter) and the constructor of eager outputs; set by tensor.py,
# which imports this module, so the hot path needs no import or isinstance chain.
_EAGER: set[type] = set()
_wrap: Callable[[np.ndarray], Any] = None  # type: ignore[assignment]


# type -> convert(args): makes the other tensors of an op the interpreter's type (or raises),
# before the op runs and before autograd records it, so the backward sees the same inputs.
_CONVERTERS: dict[type, Callable] = {}


# The active tracer of dtensor.compile (None when not tracing): eager impl calls, DTensor local
# kernels and redistributes report to it instead of running (dtensor/tracer.py).
_trace = None


def set_trace_hooks(tracer) -> None:
    global _trace
    _trace = tracer


def register_interpreter(cls: type, interpret: Callable, convert: Callable | None = None) -> None:
    _INTERPRETERS[cls] = interpret
    if convert is not None:
        _CONVERTERS[cls] = convert


def apply(op: Op, *args, **params):
    """Run ``op`` on ``args`` under the interpretation their types select, recording autograd."""
    interp = convert = None
    needs_grad = False
    grad_on = autograd._state.on
    eager = _EAGER
    mixed = False
    for a in args:
        t = type(a)
        if t in eager:
            mixed = True
            if grad_on and a.requires_grad:
                needs_grad = True
        elif t in _INTERPRETERS:
            interp = _INTERPRETERS[t]
            if t in _CONVERTERS:
                convert = _CONVERTERS[t]
            if grad_on and a.requires_grad:
                needs_grad = True
        elif isinstance(a, np.ndarray):
            mixed = True
        elif not isinstance(a, _SCALARS):
            raise _bad_operand(op, a)
    if interp is not None and mixed and convert is not None:
        args = convert(args)
    if interp is None:
        arrays = [a.data if type(a) in eager else a for a in args]
        if _trace is not None:
            out = _wrap(_trace.eager(op, arrays, params))
        else:
            try:
                out = _wrap(op.impl(*arrays, **params))
            except (ValueError, IndexError) as e:
                raise _explain(op, arrays, params, e) from e
    else:
        out = interp(op, args, params)
    if needs_grad and op.vjp is not None:
        autograd.record(op, args, params, out)
    return out


# What an op takes besides tensors and arrays: numbers, as weak-typed constants.
_SCALARS = (int, float, np.number, np.bool_)


def _bad_operand(op: Op, value) -> TypeError:
    """A string, None or list given to an op would fail inside numpy (a UFuncTypeError, 'has no
    attribute'), or a list broadcast silently; name it instead."""
    import reprlib
    return TypeError(f"{op.name}: operand {reprlib.repr(value)} (a {type(value).__name__}) is "
                     f"not a tensor; tensor ops take tensors, numpy arrays and Python numbers "
                     f"(wrap a list with dtensor.tensor(...)).")


def _explain(op: Op, arrays, params, err: Exception) -> Exception:
    """A clear error for a failed eager op: the abstract rule's own message if it has one."""
    avals = [Aval(a.shape, a.dtype) if isinstance(a, np.ndarray) else a for a in arrays]
    try:
        op.abstract(*avals, **params)
    except (ValueError, IndexError) as clear:
        if "shape mismatch" not in str(clear):
            return type(clear)(str(clear))
    shapes = [tuple(a.shape) if isinstance(a, np.ndarray) else a for a in arrays]
    hint = (" Each dim must be equal or 1 to broadcast; reshape or unsqueeze one operand."
            if op.shard == "pointwise" else "")
    return type(err)(f"{op.name}: invalid inputs {shapes}: {err}.{hint}")
