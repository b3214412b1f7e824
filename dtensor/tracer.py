"""Tracing: run the function once with ``Traced`` arrays in place of this rank's numpy data.

Tracing happens where the eager code touches arrays, so everything above runs unchanged: the
op registry and autograd (the backward and the optimizer update are traced too), the DTensor
interpreter with its sharding rules, the parallel styles' hooks, and the redistribute table.
What is recorded is therefore the per-rank program eager runs: every op ``impl`` (or DTensor
local kernel) call and every collective, in order, with this rank's block shapes.

Values that change from call to call without being arrays become ``Slot`` params that the
runtime recomputes: random keys (``dtensor.random.next_key``) and optimizer scalars
(``dtensor.optim``'s per-step learning rate and bias corrections).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from dtensor import observe
from dtensor.errors import TracingError, user_line
from dtensor.graph import Graph, Node, Slot

__all__ = ["Traced", "Tracer", "TracingError"]

def _data_dependent_message(what: str) -> str:
    return (f"dtensor.compile: {what} needs a value the traced graph only knows at run time, "
            f"at {user_line()}. Python control flow and conversions must not depend on tensor "
            f"values inside a compiled function: use dtensor.where(...) for a data-dependent "
            f"choice, and read .item() on what the compiled function returns.")


def _data_dependent(what: str):
    raise TracingError(_data_dependent_message(what))


class Traced:
    """Stands in for one numpy array of this rank while tracing: shape and dtype, no data."""

    __slots__ = ("node",)
    __array_priority__ = 1000

    def __init__(self, node: Node):
        self.node = node

    shape = property(lambda self: self.node.shape)
    dtype = property(lambda self: self.node.dtype)
    ndim = property(lambda self: len(self.node.shape))
    size = property(lambda self: int(np.prod(self.node.shape)))
    itemsize = property(lambda self: self.node.dtype.itemsize)

    def __len__(self) -> int:
        return self.node.shape[0]

    def astype(self, dtype, copy: bool = True):
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        from dtensor.ops.pointwise import cast
        return _ACTIVE.eager(cast, [self], {"dtype": dtype})

    def __bool__(self):
        _data_dependent("bool(tensor) (an if/while on a tensor)")

    def __float__(self):
        _data_dependent("float(tensor)")

    def __int__(self):
        _data_dependent("int(tensor)")

    def __index__(self):
        _data_dependent("using a tensor as an index")

    def item(self):
        _data_dependent(".item()")

    def tolist(self):
        _data_dependent(".tolist()")

    def __array__(self, *a, **k):
        _data_dependent("converting a tensor to numpy (.numpy(), np.asarray)")

    def __array_ufunc__(self, *a, **k):
        _data_dependent("a numpy function on a tensor's data")

    def __array_function__(self, *a, **k):
        _data_dependent("a numpy function on a tensor's data")

    def __iter__(self):
        _data_dependent("iterating over a tensor's data")

    def __getitem__(self, index):
        _data_dependent("indexing a tensor's data (.numpy() / .data)")

    def __setitem__(self, index, value):
        _data_dependent("writing into a tensor's data (.numpy() / .data)")

    def __getattr__(self, name):
        # Reached only for what a numpy array has and a tracer not (``t.numpy().sum()``).
        # Also an AttributeError: hasattr() and numpy's protocol probes keep working.
        if name.startswith("__"):
            raise AttributeError(name)
        raise _NumpyUse(_data_dependent_message(f"numpy's .{name} on a tensor's data "
                                                f"(.numpy() / .data)"))

    __hash__ = object.__hash__  # identity, as the dicts the tracer keeps need

    def __repr__(self) -> str:
        return f"Traced({self.node!r}, {self.shape}, {self.dtype})"


class _NumpyUse(TracingError, AttributeError):
    """A numpy attribute of a tracer (it has only shape and dtype)."""


_SYMBOLS = dict(eq="==", ne="!=", lt="<", le="<=", gt=">", ge=">=", add="+", sub="-", mul="*",
                truediv="/", floordiv="//", mod="%", pow="**", matmul="@", and_="&", or_="|",
                xor="^", lshift="<<", rshift=">>", neg="unary -", pos="unary +", invert="~")


def _numpy_operator(name: str):
    base = name.removeprefix("r") if name not in ("round", "rshift") else name
    base = base.removeprefix("i") if base not in ("invert",) else base
    shown = _SYMBOLS.get(base, _SYMBOLS.get(base + "_", f"{base}()"))

    def refuse(self, *other):
        _data_dependent(f"'{shown}' on a tensor's data (.numpy() / .data); use the tensor "
                        f"itself, whose operators are traced")
    refuse.__name__ = f"__{name}__"
    return refuse


# Comparison and arithmetic on a tracer would otherwise fall back to identity (``==``) or a
# TypeError eager numpy never raises: a data-dependent mask became a constant silently.
for _op in ("eq ne lt le gt ge add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv "
            "mod rmod pow rpow matmul rmatmul and rand or ror xor rxor lshift rlshift rshift "
            "rrshift divmod rdivmod neg pos abs invert iadd isub imul itruediv ifloordiv imod "
            "ipow imatmul iand ior ixor round").split():
    setattr(Traced, f"__{_op}__", _numpy_operator(_op))
del _op


_ACTIVE: "Tracer | None" = None


def _contains_traced(xs) -> bool:
    return any(type(x) is Traced for x in xs)


def _unwrap(x):
    return x.node if type(x) is Traced else x


def _at_run_time(params) -> bool:
    """Whether a param is only known when the compiled function runs (a draw's key)."""
    return any(isinstance(v, Slot) for v in params.values())


def fused_kernels() -> bool:
    """Whether the code running now is traced for a backend with fused kernels (dtensor.compile
    with backend "c" or "triton")."""
    return _ACTIVE is not None and _ACTIVE.kernels


class Tracer:
    """Records a graph while active (``with Tracer() as t: ...``). ``kernels``: the graph goes
    to a backend that renders fused ops (attention) as kernels of their own, so a layer that
    has a choice takes the fused op (see fused_kernels)."""

    def __init__(self, kernels: bool = False):
        self.graph = Graph()
        self.kernels = kernels

    def __enter__(self) -> "Tracer":
        global _ACTIVE
        from dtensor.ops import registry
        if _ACTIVE is not None:
            raise TracingError("dtensor.compile: a compiled function called while another one "
                               "is being traced; compile the outer function only.")
        _ACTIVE = self
        registry.set_trace_hooks(self)
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        from dtensor.ops import registry
        _ACTIVE = None
        registry.set_trace_hooks(None)

    # -- inputs and slots
    def input(self, label: str, array: np.ndarray) -> Traced:
        return Traced(self.graph.new("input", label, shape=array.shape, dtype=array.dtype))

    def slot(self, name: str, make) -> Slot:
        """A param recomputed by ``make()`` before every call (in trace order)."""
        self.graph.slots.append(make)
        return Slot(len(self.graph.slots) - 1, name)

    # -- hooks the eager code calls while tracing
    def eager(self, op, arrays, params):
        """An eager op on arrays: recorded if any input is traced or a param is only known at
        run time (a draw's key), else run now."""
        if not _contains_traced(arrays) and not _at_run_time(params):
            return op.impl(*arrays, **params)
        from dtensor.ops.registry import Aval
        avals = [Aval(a.shape, a.dtype) if isinstance(a, (Traced, np.ndarray)) else a
                 for a in arrays]
        out = op.abstract(*avals, **params)
        return Traced(self.graph.new("op", op.name, [_unwrap(a) for a in arrays], params,
                                     out.shape, out.dtype))

    def local(self, op, locals_, params, in_specs, out_spec, blocks):
        """A DTensor op on this rank's blocks: its impl, or with ``blocks`` (where the blocks
        sit) its local kernel."""
        from dtensor.dtensor import _local_block
        if not _contains_traced(locals_) and not _at_run_time(params):  # compute now
            if blocks is None:
                return op.impl(*locals_, **params)
            return op.local(*locals_, in_blocks=blocks[0], out_block=blocks[1], **params)
        return Traced(self.graph.new("op", op.name, [_unwrap(a) for a in locals_], params,
                                     _local_block(out_spec)[0], out_spec.dtype,
                                     variant="impl" if blocks is None else "local",
                                     blocks=blocks, specs=(tuple(in_specs), out_spec)))

    def comm(self, local, spec, steps):
        """One redistribute of a block: a node per step of its plan, each collective by name
        (all_gather, all_reduce ...) with the layout it leaves."""
        from dtensor.dtensor import _local_block
        node, before = _unwrap(local), spec
        for st in steps:
            out = replace(spec, placements=st.after)
            node = self.graph.new(
                "comm", st.kind, [node], {"mesh_dim": st.mesh_dim, **dict(st.params)},
                _local_block(out)[0], spec.dtype, specs=((before,), out),
                cause=dict(observe.CAUSE))
            before = out
        return Traced(node)
