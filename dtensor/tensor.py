"""Tensor: a numpy array plus autograd metadata. Every operator and method calls ``ops.apply``.

The method surface lives in ``TensorMethods`` so that DTensor and the compiler's tracer, which
inherit it, behave exactly like Tensor under the same user code.
"""
from __future__ import annotations

import builtins
import math
import numbers
import reprlib
import sys
from typing import Any, Sequence

import numpy as np

from dtensor import autograd, random
from dtensor.ops import nn as nnops
from dtensor.ops import pointwise as pw
from dtensor.ops import registry
from dtensor.ops import structural as st
from dtensor.errors import TracingError, user_line
from dtensor.validate import as_bool, as_dim, as_int, as_real, as_shape

__all__ = ["Tensor", "tensor", "as_tensor", "zeros", "ones", "full", "zeros_like", "ones_like",
           "arange", "rand", "randn", "cat", "where", "stack", "cos", "sin", "rsqrt", "sigmoid",
           "abs", "clamp", "argmax", "cumsum", "tril", "triu", "repeat_interleave", "outer",
           "resolve_dtype", "float_dtype", "fill_value", "DTYPES"]

DTYPES = {name: np.dtype(name) for name in
          ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")}


def resolve_dtype(dtype) -> np.dtype:
    """A numpy dtype from a name, numpy type or dtype; a clear TypeError otherwise."""
    try:
        dt = None if dtype is None else np.dtype(dtype)  # np.dtype(None) is float64
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise TypeError(f"invalid dtype {dtype!r}; use one of {', '.join(DTYPES)} "
                        f"(for example dtensor.float32 or 'float32').")
    return dt


def float_dtype(dtype, what: str) -> np.dtype:
    """A floating dtype (float32 for None): what random factories and parameters hold. An
    integer or bool dtype would round every draw to 0 or 1 silently."""
    dt = np.dtype(np.float32) if dtype is None else resolve_dtype(dtype)
    if dt.kind != "f":
        raise TypeError(f"{what}: dtype must be floating point (float16, float32 or float64), "
                        f"got {dt}. Draw floats and cast: .astype({str(dt)!r}).")
    return dt


def fill_value(value, what: str):
    """A fill value: a Python or numpy number (not a string, list or tensor)."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, numbers.Real):
        return value
    raise TypeError(f"{what}: the fill value must be a number, got {reprlib.repr(value)} (a "
                    f"{type(value).__name__}).")


def _operand_error(op: str, value) -> TypeError:
    return TypeError(f"{op}: operand {reprlib.repr(value)} (a {type(value).__name__}) is not a "
                     f"tensor; tensor ops take tensors, numpy arrays and Python numbers.")


def _bool_mask(mask, op: str) -> None:
    """PyTorch's masks and where conditions are bool: a float mask of 0.5s would select by
    truthiness, silently."""
    dt = getattr(mask, "dtype", None)
    if dt is None or np.dtype(dt) != np.bool_:
        got = f"dtype {dt}" if dt is not None else f"{reprlib.repr(mask)} (a " \
            f"{type(mask).__name__})"
        raise TypeError(f"{op}: the mask must be a bool tensor, got {got}; build one with a "
                        f"comparison (x > 0) or .astype(bool).")


def _keep(keepdims, keepdim) -> bool:
    """``keepdim`` (PyTorch's name) if given, else ``keepdims``, checked as flags."""
    if keepdim is not None:
        return as_bool(keepdim, "keepdim")
    return as_bool(keepdims, "keepdims")


def _axes(axis, ndim: int) -> tuple[int, ...]:
    """Canonical reduction axes: a sorted tuple of non-negative ints (all axes for None).
    A 0-d tensor takes axis 0 or -1, as PyTorch's reductions."""
    if axis is None:
        return tuple(range(ndim))
    seq = isinstance(axis, (tuple, list))
    out = [as_dim(a, ndim, what="axis", ndim=builtins.max(ndim, 1))
           for a in (axis if seq else (axis,))]
    return tuple(sorted(set(out)))


def _shape_arg(shape, what: str = "shape", infer: bool = False) -> tuple[int, ...]:
    """A shape given as varargs ``(2, 3)`` or as one sequence ``((2, 3),)``, checked: ints
    (numpy ints too), non-negative (one -1 with ``infer``)."""
    if len(shape) == 1 and not isinstance(shape[0], (str, bytes)) and \
            hasattr(shape[0], "__len__"):
        shape = shape[0]
    return as_shape(shape, what, infer=infer)


def _resolve_reshape(numel: int, old: tuple, shape: tuple) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: only one dim may be -1, got {shape}.")
    if -1 in shape:
        known = math.prod([n for n in shape if n != -1])
        if known == 0 or numel % known:
            raise ValueError(f"cannot reshape a tensor of shape {old} ({numel} elements) "
                             f"into {shape}.")
        shape = tuple(numel // known if n == -1 else n for n in shape)
    if math.prod(shape) != numel:
        raise ValueError(f"cannot reshape a tensor of shape {old} ({numel} elements) into "
                         f"{shape} ({math.prod(shape)} elements).")
    return shape


def _index(key, shape: tuple) -> tuple:
    """Canonical hashable form of a basic index: int | (start, stop, step) | None per entry."""
    if not isinstance(key, tuple):
        key = (key,)
    n_real = builtins.sum(1 for k in key if k is not None and k is not Ellipsis)
    if builtins.sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...').")
    if n_real > len(shape):
        raise IndexError(f"too many indices for a tensor of shape {shape}: {key!r}.")
    out, d = [], 0
    for k in key:
        if k is Ellipsis:
            fill = len(shape) - n_real
            out.extend((0, shape[d + i], 1) for i in range(fill))
            d += fill
        elif k is None:
            out.append(None)
        elif isinstance(k, slice):
            try:
                out.append(k.indices(shape[d]))
            except TypeError:
                raise TypeError(f"slice {k!r} in index {key!r}: slice bounds and step must be "
                                f"integers or None.") from None
            if out[-1][2] <= 0:  # numpy would reverse; PyTorch refuses, and so do the rules
                raise ValueError(f"slice {k!r} in index {key!r}: step must be greater than "
                                 f"zero; to reverse a dim, index it with a positive step and "
                                 f"flip the result another way.")
            d += 1
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            if not -shape[d] <= k < shape[d]:
                raise IndexError(f"index {k} is out of bounds for dim {d} of size {shape[d]} "
                                 f"(tensor shape {shape}).")
            out.append(int(k) % shape[d])
            d += 1
        else:
            raise TypeError(
                f"unsupported index {k!r} (type {type(k).__name__}): tensors take basic "
                f"indexing (ints, slices, None, ...). For integer-array lookup use "
                f"dtensor.nn.functional.embedding or index_select.")
    out.extend((0, shape[i], 1) for i in range(d, len(shape)))
    return tuple(out)


def _dtype_bounds(dtype) -> tuple:
    """(lowest, highest) value of ``dtype``: clamp's stand-ins for a missing bound, so that
    clamp(min=0) of an int tensor stays int."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return -math.inf, math.inf
    if dtype.kind == "b":
        return False, True
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _triangle(op, x, diagonal):
    name = op.name
    diagonal = as_int(diagonal, f"{name}: diagonal")
    if x.ndim < 2:
        raise ValueError(f"{name}: the input must have at least 2 dims (a matrix or a batch of "
                         f"them), got shape {tuple(x.shape)}.")
    return op(x, diagonal=diagonal)


def _base_refs(d: np.ndarray) -> int:
    return sys.getrefcount(d.base)


# References _base_refs counts for a view whose base nothing else holds, measured on this
# interpreter (what getrefcount reports for locals and arguments differs between versions).
_SOLE_VIEW_REFS = _base_refs(np.empty(4).reshape(2, 2))


def _sole(d: np.ndarray) -> bool:
    """Whether no other array shares d's memory: d owns it, or d is a view of all of a buffer
    that no other object references (a GEMM result seen through its transpose). Whether some
    object holds ``d`` itself is the caller's concern."""
    base = d.base
    if base is None:
        return True
    if type(base) is not np.ndarray or base.base is not None or base.nbytes != d.nbytes:
        return False
    del base  # counted as _SOLE_VIEW_REFS was: no local reference
    return _base_refs(d) <= _SOLE_VIEW_REFS


class TensorMethods:
    """Operators and methods shared by Tensor, DTensor and tracer tensors; all go through ops."""

    __slots__ = ()
    __array_ufunc__ = None  # numpy defers `ndarray + tensor` to Tensor.__radd__
    # True for a DTensor: code below the DTensor layer asks this instead of importing it.
    is_distributed = False

    # -- arithmetic
    def __add__(self, o): return pw.add(self, o)
    def __radd__(self, o): return pw.add(o, self)
    def __sub__(self, o): return pw.sub(self, o)
    def __rsub__(self, o): return pw.sub(o, self)
    def __mul__(self, o): return pw.mul(self, o)
    def __rmul__(self, o): return pw.mul(o, self)
    def __truediv__(self, o): return pw.div(self, o)
    def __rtruediv__(self, o): return pw.div(o, self)
    def __pow__(self, o): return pw.pow(self, o)
    def __rpow__(self, o): return pw.pow(o, self)
    def __neg__(self): return pw.neg(self)
    def __matmul__(self, o): return matmul(self, o)
    def __rmatmul__(self, o): return matmul(o, self)
    def __lt__(self, o): return pw.lt(self, o)
    def __le__(self, o): return pw.le(self, o)
    def __gt__(self, o): return pw.gt(self, o)
    def __ge__(self, o): return pw.ge(self, o)
    def __eq__(self, o): return pw.eq(self, o)  # type: ignore[override]
    def __ne__(self, o): return pw.ne(self, o)  # type: ignore[override]
    def __invert__(self): return pw.logical_not(self)
    __hash__ = object.__hash__

    def exp(self): return pw.exp(self)
    def log(self): return pw.log(self)
    def sqrt(self): return pw.sqrt(self)
    def tanh(self): return pw.tanh(self)
    def erf(self): return nnops.erf(self)
    def sigmoid(self): return pw.sigmoid(self)
    def relu(self): return pw.where(self > 0, self, 0.0)
    def abs(self): return pw.abs(self)
    def maximum(self, o): return pw.maximum(self, o)
    def cos(self): return pw.cos(self)
    def sin(self): return pw.sin(self)
    def rsqrt(self): return pw.rsqrt(self)

    def clamp(self, min=None, max=None):
        """min(max(x, min), max), as torch.clamp: either bound may be None (not both) or a
        tensor; with min > max every entry is max. The gradient goes to whichever of x, min
        and max each entry came from (to x at a tie)."""
        if min is None and max is None:
            raise ValueError("clamp: give min, max or both; with neither it would return the "
                             "tensor unchanged.")
        for name, bound in (("min", min), ("max", max)):
            if bound is not None and not isinstance(bound, (TensorMethods, np.ndarray,
                                                            numbers.Real)):
                raise TypeError(f"clamp: {name} must be a number or a tensor, got "
                                f"{reprlib.repr(bound)} (a {type(bound).__name__}).")
        low, high = _dtype_bounds(self.dtype)
        return pw.clamp(self, low if min is None else min, high if max is None else max)

    def clamp_min(self, min): return self.clamp(min=min)
    def clamp_max(self, max): return self.clamp(max=max)

    def argmax(self, dim: int | None = None, keepdim: bool = False):
        """Index of the first largest entry along ``dim`` (of the flattened tensor for None),
        as int64; NaN counts as the largest, as in torch.argmax."""
        keepdim = as_bool(keepdim, "argmax: keepdim")
        if dim is None or self.ndim == 0:
            if dim is not None:
                as_dim(dim, 0, op="argmax", ndim=1)
            i = st.argmax(self.reshape(-1), axis=0, keepdims=False)
            return i.reshape((1,) * self.ndim) if keepdim else i
        return st.argmax(self, axis=as_dim(dim, tuple(self.shape), op="argmax"),
                         keepdims=keepdim)

    def cumsum(self, dim: int):
        """Running sums along ``dim``, as torch.cumsum (integers and bools sum in int64)."""
        if self.ndim == 0:
            as_dim(dim, 0, op="cumsum", ndim=1)
            return st.cumsum(self.reshape(1), axis=0, reverse=False).reshape(())
        return st.cumsum(self, axis=as_dim(dim, tuple(self.shape), op="cumsum"), reverse=False)

    def tril(self, diagonal: int = 0): return _triangle(st.tril, self, diagonal)
    def triu(self, diagonal: int = 0): return _triangle(st.triu, self, diagonal)

    def repeat_interleave(self, repeats: int, dim: int | None = None):
        """Each entry ``repeats`` times in a row along ``dim`` (of the flattened tensor for
        None), as torch.repeat_interleave with an int."""
        if isinstance(repeats, (TensorMethods, np.ndarray)):
            raise TypeError("repeat_interleave: repeats must be an int; per-entry counts (a "
                            "tensor) are not supported, since the result's shape would depend "
                            "on their values.")
        repeats = as_int(repeats, "repeat_interleave: repeats", low=0)
        if dim is None or self.ndim == 0:
            if dim is not None:
                as_dim(dim, 0, op="repeat_interleave", ndim=1)
            return st.repeat_interleave(self.reshape(-1), repeats=repeats, axis=0)
        return st.repeat_interleave(self, repeats=repeats,
                                    axis=as_dim(dim, tuple(self.shape), op="repeat_interleave"))

    def outer(self, vec2):
        """The outer product of two 1-D tensors, as torch.outer: a broadcasting multiply."""
        vec2 = as_tensor(vec2)
        if self.ndim != 1 or vec2.ndim != 1:
            raise ValueError(f"outer: both operands must be 1-D, got shapes "
                             f"{tuple(self.shape)} and {tuple(vec2.shape)}; flatten them first "
                             f"(.reshape(-1)).")
        return self.reshape(-1, 1) * vec2.reshape(1, -1)

    def astype(self, dtype):
        dtype = resolve_dtype(dtype)
        return self if dtype == self.dtype else pw.cast(self, dtype=dtype)

    to = astype

    def float(self): return self.astype(np.float32)
    def double(self): return self.astype(np.float64)
    def type_as(self, other): return self.astype(other.dtype)
    def pow(self, exponent): return pw.pow(self, exponent)

    def contiguous(self):
        # No strides to fix: every op hands its kernel arrays it may read in any layout.
        return self

    def softmax(self, dim: int):
        return over_last_dim(nnops.softmax, need_floating(self, "softmax"), dim, causal=False)

    def masked_fill(self, mask, value):
        _bool_mask(mask, "masked_fill")
        return pw.where(mask, value, self)

    # -- reductions (``dim`` is accepted as PyTorch's name for ``axis``)
    def sum(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
        axis, keepdims = (dim if dim is not None else axis), _keep(keepdims, keepdim)
        return st.sum(self, axis=_axes(axis, self.ndim), keepdims=keepdims)

    def mean(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
        axis = _axes(dim if dim is not None else axis, self.ndim)
        n = math.prod([self.shape[a] for a in axis])
        # float16 sums and divides in float32 before rounding back (as PyTorch): 100,000
        # values of 1000 sum past float16's 65504, their mean does not.
        x = self.astype(st.accumulate_dtype(self.dtype))
        m = x.sum(axis, _keep(keepdims, keepdim)) / n
        return m if x is self else m.astype(self.dtype)

    def var(self, axis=None, keepdims=False, *, correction=1, dim=None, keepdim=None):
        axis = _axes(dim if dim is not None else axis, self.ndim)
        n = math.prod([self.shape[a] for a in axis])
        correction = as_real(correction, "var: correction")
        x = self.astype(st.accumulate_dtype(self.dtype))  # float16: each d * d too (d ~ 256)
        d = x - x.mean(axis, keepdims=True)
        s = (d * d).sum(axis, _keep(keepdims, keepdim))
        if n - correction > 0:
            v = s / (n - correction)
        else:  # as PyTorch: a sum over no degrees of freedom is inf (nan for 0 / 0)
            v = pw.where(s > 0, s + math.inf, s + math.nan)
        return v if x is self else v.astype(self.dtype)

    def max(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
        axis, keepdims = (dim if dim is not None else axis), _keep(keepdims, keepdim)
        return st.max(self, axis=_axes(axis, self.ndim), keepdims=keepdims)

    def amax(self, axis=None, keepdims=False):
        return self.max(axis, keepdims)

    # -- shape
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: int | None = None):
        if dim is None:
            return tuple(self.shape)
        return self.shape[as_dim(dim, tuple(self.shape), op="size")]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def reshape(self, *shape):
        shape = _resolve_reshape(self.numel(), tuple(self.shape),
                                 _shape_arg(shape, "reshape: shape", infer=True))
        return self if shape == tuple(self.shape) else st.reshape(self, shape=shape)

    view = reshape

    def flatten(self, start_dim: int = 0, end_dim: int = -1):
        s = tuple(self.shape)
        if not s:  # PyTorch: a 0-d tensor flattens to one element
            return self.reshape(1)
        start = as_dim(start_dim, s, op="flatten", what="start_dim")
        end = as_dim(end_dim, s, op="flatten", what="end_dim")
        if start > end:
            raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} "
                             f"for a tensor of shape {s}; give start_dim <= end_dim.")
        return self.reshape(s[:start] + (-1,) + s[end + 1:])

    def unsqueeze(self, dim: int):
        s = list(self.shape)
        s.insert(as_dim(dim, tuple(s), op="unsqueeze", ndim=len(s) + 1), 1)
        return self.reshape(tuple(s))

    def squeeze(self, dim: int | None = None):
        s = tuple(self.shape)
        if dim is None:
            return self.reshape(tuple(n for n in s if n != 1))
        dim = as_dim(dim, s, op="squeeze", ndim=builtins.max(len(s), 1))
        return self if not s or s[dim] != 1 else self.reshape(s[:dim] + s[dim + 1:])

    def permute(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        s = tuple(self.shape)
        dims = tuple(as_dim(a, s, op="permute") for a in axes)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {axes} is not a permutation of the {self.ndim} dims "
                             f"of a tensor of shape {s}.")
        return self if dims == tuple(range(self.ndim)) else st.permute(self, axes=dims)

    def transpose(self, dim0: int, dim1: int):
        s = tuple(self.shape)
        dim0 = as_dim(dim0, s, op="transpose", what="dim0")
        dim1 = as_dim(dim1, s, op="transpose", what="dim1")
        axes = list(range(self.ndim))
        axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
        return self.permute(tuple(axes))

    @property
    def T(self):
        return self.permute(tuple(reversed(range(self.ndim))))

    @property
    def mT(self):
        return self.transpose(-2, -1)

    def broadcast_to(self, *shape):
        shape = _shape_arg(shape, "broadcast_to: shape")
        try:
            np.broadcast_shapes(tuple(self.shape), shape)
        except ValueError:
            raise ValueError(f"cannot broadcast a tensor of shape {tuple(self.shape)} to "
                             f"{shape}: each dim must match or be 1.") from None
        return self if shape == tuple(self.shape) else st.broadcast_to(self, shape=shape)

    def expand(self, *shape):
        sizes = _shape_arg(shape, "expand: sizes", infer=True)
        lead = len(sizes) - self.ndim
        if lead < 0 or -1 in sizes[:lead]:
            raise ValueError(f"expand: sizes {sizes} for a tensor of shape {tuple(self.shape)} "
                             f"must give at least its {self.ndim} dims, and -1 (keep the size) "
                             f"only for dims it has.")
        shape = tuple(self.shape[i - lead] if n == -1 else n for i, n in enumerate(sizes))
        return self.broadcast_to(shape)

    def unflatten(self, dim: int, sizes):
        """Split dim ``dim`` into ``sizes`` (one of them may be -1), as torch.Tensor.unflatten."""
        s = tuple(self.shape)
        d = as_dim(dim, s, op="unflatten")
        sizes = _shape_arg((sizes,), "unflatten: sizes", infer=True)
        try:
            sizes = _resolve_reshape(s[d], (s[d],), sizes)
        except ValueError:
            raise ValueError(f"unflatten: sizes {sizes} do not split dim {d} of size {s[d]} "
                             f"(shape {s}); their product must be {s[d]}, with at most one "
                             f"-1.") from None
        return self.reshape(s[:d] + sizes + s[d + 1:])

    def repeat(self, *sizes):
        """Tile the tensor ``sizes[i]`` times along dim i (new leading dims for extra sizes), as
        torch.Tensor.repeat and np.tile: a broadcast of interleaved size-1 dims, then a reshape,
        so the gradient is the sum over the copies."""
        reps = _shape_arg(sizes, "repeat: sizes")
        if len(reps) < self.ndim:
            raise ValueError(f"repeat: {len(reps)} sizes {reps} for a {self.ndim}-d tensor of "
                             f"shape {tuple(self.shape)}; give one per dim (1 keeps a dim).")
        s = (1,) * (len(reps) - self.ndim) + tuple(self.shape)
        spread = tuple(n for k in s for n in (1, k))
        tiled = tuple(n for r, k in zip(reps, s) for n in (r, k))
        return self.reshape(spread).broadcast_to(tiled).reshape(
            tuple(r * k for r, k in zip(reps, s)))

    def __getitem__(self, key):
        return st.getitem(self, key=_index(key, tuple(self.shape)))

    def split(self, split_size_or_sections, dim: int = 0):
        """torch.split: pieces of ``split_size`` along ``dim`` (last may be smaller), or sizes."""
        s = tuple(self.shape)
        dim = as_dim(dim, s, op="split")
        n = s[dim]
        if isinstance(split_size_or_sections, (tuple, list)):
            sizes = list(as_shape(split_size_or_sections, "split: sizes"))
            if builtins.sum(sizes) != n:
                raise ValueError(f"split: sizes {sizes} add up to {builtins.sum(sizes)}, not "
                                 f"to dim {dim} of size {n} (tensor shape {s}).")
        else:
            size = as_int(split_size_or_sections, "split: split_size", low=1,
                          fix="Give the length of each piece, or a list of lengths.")
            sizes = [size] * (n // size)
            if n % size:
                sizes.append(n % size)
        out, start = [], 0
        for s in sizes:
            out.append(self[(slice(None),) * dim + (slice(start, start + s),)])
            start += s
        return tuple(out)

    def chunk(self, chunks: int, dim: int = 0):
        """torch.chunk: ceil(n / chunks) per piece; fewer pieces when n is small."""
        n = self.shape[as_dim(dim, tuple(self.shape), op="chunk")]
        chunks = as_int(chunks, "chunk: chunks", low=1, fix="Give the number of pieces.")
        return self.split(builtins.max(1, -(-n // chunks)), dim)

    # -- autograd
    def backward(self, gradient=None, retain_graph: bool = False) -> None:
        if gradient is not None and not isinstance(gradient, (TensorMethods, np.ndarray,
                                                               numbers.Real)):
            raise TypeError(f"backward: gradient must be a tensor of shape "
                            f"{tuple(self.shape)} (or None for a scalar), got "
                            f"{reprlib.repr(gradient)} (a {type(gradient).__name__}).")
        autograd.backward(self, gradient, as_bool(retain_graph, "backward: retain_graph"))

    def requires_grad_(self, requires_grad: bool = True):
        requires_grad = as_bool(requires_grad, "requires_grad")
        if requires_grad and not np.issubdtype(self.dtype, np.floating):
            raise TypeError(f"only floating-point tensors can require gradients, this one is "
                            f"{self.dtype}; cast it first (.float()).")
        self.requires_grad = requires_grad
        return self


def need_floating(x, op: str, what: str = "input"):
    """Ops whose result is fractional (normalisation, exp, erf) need a floating input: numpy
    would fail casting its float result back to an integer dtype."""
    if np.dtype(x.dtype).kind != "f":
        raise TypeError(f"{op}: {what} must be floating point, got dtype {x.dtype}; cast it "
                        f"first (x.float()).")
    return x


def over_last_dim(op, x, dim, **params):
    """Apply a last-dim op along ``dim`` by moving that dim last and back."""
    dim = as_dim(dim, tuple(x.shape), op=op.name, ndim=max(x.ndim, 1))
    if x.ndim == 0:  # a 0-d tensor is a row of one (softmax 1, log_softmax 0, as PyTorch)
        return op(x.reshape(1), **params).reshape(())
    if dim == x.ndim - 1:
        return op(x, **params)
    return op(x.transpose(dim, -1), **params).transpose(dim, -1)


def _untraced_update(t) -> None:
    """A tensor dtensor.compile did not take as an input is being updated with a traced value:
    the update would be lost and the tensor left without data."""
    raise TracingError(
        f"dtensor.compile: a tensor of shape {tuple(t.shape)} that the compiled function does "
        f"not reach as an input is updated at {user_line()}. Compile a function whose "
        f"closure, globals or self attributes hold the model and optimizer it updates.")


class Tensor(TensorMethods):
    """An n-dimensional array with autograd. ``Tensor(data, requires_grad=False)``.

    Example:
        >>> x = dtensor.tensor([[1.0, 2.0]], requires_grad=True)
        >>> (x * x).sum().backward(); x.grad.numpy()
        array([[2., 4.]], dtype=float32)
    """

    __slots__ = ("data", "requires_grad", "grad", "_node", "__weakref__")

    def __init__(self, data: Any, requires_grad: bool = False, dtype=None):
        if isinstance(data, TensorMethods):
            data = data.numpy()
        try:
            arr = np.asarray(data)
        except ValueError:
            raise ValueError(f"cannot make a tensor from {reprlib.repr(data)}: the nested lists "
                             f"are ragged; every row must have the same length.") from None
        if dtype is not None:
            arr = arr.astype(resolve_dtype(dtype), copy=False)
        elif arr.dtype == np.float64 and not isinstance(data, np.ndarray):
            arr = arr.astype(np.float32)  # Python floats default to float32, as in PyTorch
        elif arr.dtype.name not in DTYPES:
            raise TypeError(f"cannot make a tensor from {type(data).__name__} with numpy dtype "
                            f"{arr.dtype}; supported dtypes: {', '.join(DTYPES)}.")
        self.data = arr
        self.grad = None
        self._node = None
        self.requires_grad = False
        if as_bool(requires_grad, "requires_grad"):
            self.requires_grad_(True)

    @staticmethod
    def _wrap(arr: np.ndarray) -> "Tensor":
        t = object.__new__(Tensor)
        t.data = arr
        t.requires_grad = False
        t.grad = None
        t._node = None
        return t

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    def numpy(self) -> np.ndarray:
        return self.data

    def _scalar(self, what: str):
        if type(self.data) is np.ndarray and self.data.size != 1:
            raise RuntimeError(f"{what}: a tensor of shape {tuple(self.shape)} has "
                               f"{self.data.size} elements, not one; reduce it first (.sum(), "
                               f".max()) or index one element.")
        return self.data

    def item(self):
        return self._scalar("item()").item()

    def tolist(self):
        return self.data.tolist()

    def __array__(self, dtype=None, copy=None):
        # Traced data raises here (np.asarray of a tracer is a TracingError naming the line).
        return np.array(self.data, dtype=dtype, copy=True) if copy else np.asarray(self.data,
                                                                                    dtype=dtype)

    def __float__(self) -> float:
        return float(self._scalar("float()"))

    def __bool__(self) -> bool:
        return builtins.bool(self.data)

    def detach(self) -> "Tensor":
        return Tensor._wrap(self.data)

    def clone(self) -> "Tensor":
        return pw.add(self, 0)  # a recorded copy keeps the gradient path

    def _ones_like(self) -> "Tensor":
        return Tensor._wrap(np.ones(self.data.shape, self.data.dtype))

    # -- in-place updates (optimizers, init). They change the values, never the graph.
    def copy_(self, src) -> "Tensor":
        """Copy ``src``'s values into this tensor (its memory; nothing aliases ``src``)."""
        if isinstance(src, TensorMethods) and not isinstance(src, Tensor):
            src = src.full_tensor()  # a DTensor: its whole value
        src = src.data if isinstance(src, Tensor) else np.asarray(src)
        if src.shape != self.data.shape:
            raise ValueError(f"copy_: source shape {src.shape} differs from {self.data.shape}.")
        if self.data.flags.writeable:
            np.copyto(self.data, src, casting="unsafe")
        else:
            self.data = np.array(src, dtype=self.data.dtype)
        return self

    def _assign(self, new: "Tensor") -> None:
        """Make ``new`` (a result this tensor's owner computed and owns) the value: no copy.

        The optimizers' update path; the tracer records it as a write-back.
        """
        data = new.data
        if isinstance(data, np.generic):  # a 0-d result: numpy gives a scalar, not a tracer
            data = np.asarray(data)
        elif type(self.data) is np.ndarray and type(data) is not np.ndarray:
            _untraced_update(self)
        self.data = data.astype(self.data.dtype, copy=False)

    def _as_grad_of(self, leaf) -> "Tensor":
        return self

    def _owned(self, taken: set) -> "Tensor":
        """This gradient if it is writeable, C-ordered, computed by the engine (``taken`` holds
        the ids of gradients already stored and of the caller's own) and shares its memory with
        no other array; else a C-ordered copy, so a stored ``.grad`` is never an alias."""
        d = self.data
        if type(d) is not np.ndarray:  # traced by dtensor.compile: no memory to share yet
            return self
        if d.flags.writeable and d.flags.c_contiguous and id(self) not in taken and _sole(d):
            taken.add(id(self))
            return self
        return Tensor._wrap(np.array(d, order="C"))

    def zero_(self) -> "Tensor":
        self.data = np.zeros_like(self.data)
        return self

    def normal_(self, mean: float = 0.0, std: float = 1.0) -> "Tensor":
        mean = as_real(mean, "normal_: mean")
        std = as_real(std, "normal_: std", low=0, fix="std is a standard deviation.")
        return self.copy_(randn(*self.shape, dtype=self.dtype) * std + mean)

    def uniform_(self, a: float = 0.0, b: float = 1.0) -> "Tensor":
        a = as_real(a, "uniform_: a")
        b = as_real(b, "uniform_: b", low=a, fix="The range [a, b) needs a <= b.")
        return self.copy_(rand(*self.shape, dtype=self.dtype) * (b - a) + a)

    def fill_(self, value) -> "Tensor":
        self.data = np.full_like(self.data, fill_value(value, "fill_"))
        return self

    def __repr__(self) -> str:
        body = np.array2string(self.data, separator=", ", prefix="tensor(")
        extra = ", requires_grad=True" if self.requires_grad else ""
        if self.dtype != np.float32:
            extra = f", dtype={self.dtype}" + extra
        return f"tensor({body}{extra})"


registry._EAGER.add(Tensor)
registry._wrap = Tensor._wrap


def matmul(x, y):
    """Matrix product with numpy semantics (1-D operands are promoted and squeezed back)."""
    for v in (x, y):
        if not isinstance(v, (TensorMethods, np.ndarray)):
            raise _operand_error("matmul", v)
    xs, ys = tuple(x.shape), tuple(y.shape)
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"matmul: both operands need at least one dim, got shapes "
                         f"{xs} @ {ys}; multiply by a 0-d tensor with `*` instead.")
    # Checked on the user's shapes: after 1-d promotion numpy would report (1, 3) @ (4, 1).
    inner = ys[0] if y.ndim == 1 else ys[-2]
    if xs[-1] != inner:
        raise ValueError(f"matmul: shapes {xs} @ {ys} do not fit ({xs[-1]} != {inner}): the "
                         f"left operand's last dim must equal the right one's "
                         f"{'only' if y.ndim == 1 else 'second-last'} dim.")
    try:
        np.broadcast_shapes(xs[:-2], ys[:-2])
    except ValueError:
        raise ValueError(f"matmul: shapes {xs} @ {ys}: the batch dims {xs[:-2]} and {ys[:-2]} "
                         f"do not broadcast (each dim must match or be 1).") from None
    xv, yv = x.ndim == 1, y.ndim == 1
    if xv:
        x = x.reshape(1, -1)
    if yv:
        y = y.reshape(-1, 1)
    out = st.matmul(x, y)
    if xv:
        out = out.reshape(out.shape[:-2] + out.shape[-1:])
    if yv:
        out = out.reshape(out.shape[:-1])
    return out


def tensor(data, dtype=None, requires_grad: bool = False) -> Tensor:
    """Make a Tensor (float lists default to float32). ``dtensor.tensor([1.0, 2.0])``."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def as_tensor(x, dtype=None) -> Tensor:
    """``x`` itself if it is already a tensor (Tensor or DTensor) of ``dtype``, else a Tensor."""
    if isinstance(x, TensorMethods) and (dtype is None or resolve_dtype(dtype) == x.dtype):
        return x
    return Tensor(x, dtype=dtype)


def _factory_dtype(dtype):
    return np.dtype(np.float32) if dtype is None else resolve_dtype(dtype)


def _allocate(make, shape, dtype, op: str) -> np.ndarray:
    """``make()``, with numpy's MemoryError turned into one naming the shape and the bytes."""
    try:
        return make()
    except MemoryError:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        raise MemoryError(f"{op}: a tensor of shape {shape} and dtype {np.dtype(dtype)} needs "
                          f"{nbytes:,} bytes ({nbytes / 2**30:,.1f} GiB), more than this "
                          f"machine can allocate; check the sizes.") from None


def zeros(*shape, dtype=None, requires_grad: bool = False):
    """Zeros of ``shape`` (float32 unless ``dtype``)."""
    shape, dtype = _shape_arg(shape), _factory_dtype(dtype)
    return Tensor(_allocate(lambda: np.zeros(shape, dtype), shape, dtype, "zeros"),
                  requires_grad)


def ones(*shape, dtype=None, requires_grad: bool = False):
    """Ones of ``shape`` (float32 unless ``dtype``)."""
    shape, dtype = _shape_arg(shape), _factory_dtype(dtype)
    return Tensor(_allocate(lambda: np.ones(shape, dtype), shape, dtype, "ones"),
                  requires_grad)


def full(shape: Sequence[int], value, dtype=None, requires_grad: bool = False) -> Tensor:
    """``value`` in every element of ``shape``."""
    shape, dtype, value = _shape_arg((shape,)), _factory_dtype(dtype), fill_value(value, "full")
    return Tensor(_allocate(lambda: np.full(shape, value, dtype), shape, dtype, "full"),
                  requires_grad)


def _like(t, op: str):
    if not isinstance(t, (TensorMethods, np.ndarray)):
        raise TypeError(f"{op} takes a tensor (or numpy array) to copy the shape and dtype of, "
                        f"got {reprlib.repr(t)} (a {type(t).__name__}).")
    return t


def zeros_like(t, dtype=None) -> Tensor:
    t = _like(t, "zeros_like")
    return zeros(*t.shape, dtype=dtype or t.dtype)


def ones_like(t, dtype=None) -> Tensor:
    t = _like(t, "ones_like")
    return ones(*t.shape, dtype=dtype or t.dtype)


def arange(start, stop=None, step=1, dtype=None) -> Tensor:
    if stop is None:
        start, stop = 0, start
    for name, v in (("start", start), ("end", stop), ("step", step)):
        if not math.isfinite(as_real(v, f"arange: {name}")):
            raise ValueError(f"arange: {name} must be finite, got arange({start}, {stop}, "
                             f"{step}).")
    if step == 0:
        raise ValueError(f"arange: step must not be 0, got arange({start}, {stop}, {step}).")
    dt = None if dtype is None else resolve_dtype(dtype)
    n = builtins.max(math.ceil((stop - start) / step), 0)
    return Tensor(_allocate(lambda: np.arange(start, stop, step, dtype=dt), (n,),
                            np.float64 if dt is None else dt, f"arange({start}, {stop}, {step})"))


def _template(shape) -> Tensor:
    """A data-free tensor of ``shape``: the shape argument of the random factory ops."""
    return Tensor._wrap(np.broadcast_to(np.empty((), np.bool_), shape))


def _random(op, shape, dtype, requires_grad):
    dtype = float_dtype(dtype, f"dtensor.{op.name}")
    out = op(_template(_shape_arg(shape)), key=random.next_key(), dtype=dtype)
    return out.requires_grad_() if as_bool(requires_grad, "requires_grad") else out


def rand(*shape, dtype=None, requires_grad: bool = False):
    """Uniform [0, 1) from the counter-based generator: element i depends only on (seed, call, i).
    """
    return _random(st.rand, shape, dtype, requires_grad)


def randn(*shape, dtype=None, requires_grad: bool = False):
    """Standard normal from the counter-based generator (Box-Muller over Philox, as Triton)."""
    return _random(st.randn, shape, dtype, requires_grad)


def _tensor_list(tensors, op: str) -> list:
    """cat's and stack's first argument: a non-empty list or tuple of tensors."""
    if isinstance(tensors, (TensorMethods, np.ndarray)) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"{op} takes a list or tuple of tensors, got a "
                        f"{type(tensors).__name__}; write {op}([a, b], dim).")
    tensors = [as_tensor(t) for t in tensors]
    if not tensors:
        raise ValueError(f"{op}() needs at least one tensor.")
    return tensors


def cat(tensors: Sequence, dim: int = 0):
    tensors = _tensor_list(tensors, "cat")
    nd = tensors[0].ndim
    if nd == 0:
        raise ValueError(f"cat: 0-d tensors have no dim to join along (shapes "
                         f"{[tuple(x.shape) for x in tensors]}); reshape each to (1,) first: "
                         f"cat([t.reshape(1) for t in tensors]).")
    axis = as_dim(dim, tuple(tensors[0].shape), op="cat")
    for t in tensors[1:]:
        if t.ndim != nd or any(a != b for i, (a, b) in enumerate(zip(t.shape, tensors[0].shape))
                               if i != axis):
            raise ValueError(f"cat along dim {dim}: shapes {[tuple(x.shape) for x in tensors]} "
                             f"must match except in dim {dim}.")
    return st.cat(*tensors, axis=axis)


def where(condition, x, y):
    _bool_mask(condition, "where")
    return pw.where(condition, x, y)


def stack(tensors: Sequence, dim: int = 0):
    """Join tensors of one shape along a new dim ``dim``, as torch.stack: each gains a dim of
    size 1 there and they are concatenated (so gradients and placements come from cat)."""
    tensors = _tensor_list(tensors, "stack")
    shapes = [tuple(t.shape) for t in tensors]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"stack: every tensor must have the same shape, got {shapes}.")
    axis = as_dim(dim, shapes[0], op="stack", ndim=len(shapes[0]) + 1)
    return cat([t.unsqueeze(axis) for t in tensors], axis)


def _unary_function(name: str):
    def f(input, *args, **kwargs):
        return getattr(as_tensor(input), name)(*args, **kwargs)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"dtensor.{name}(input, ...) is ``input.{name}(...)`` (as torch.{name})."
    return f


cos, sin, rsqrt, sigmoid, abs, clamp, argmax, cumsum, tril, triu, repeat_interleave, outer = (
    _unary_function(n) for n in ("cos", "sin", "rsqrt", "sigmoid", "abs", "clamp", "argmax",
                                 "cumsum", "tril", "triu", "repeat_interleave", "outer"))
