"""The compiler's IR: a per-rank graph of op calls and collectives, one node a line.

A node is one call of an op's numpy ``impl`` (or of its DTensor local kernel) on this rank's
blocks, or one collective (``redistribute``: a transition of the table in
dtensor/redistribute.py), or a graph input. Node inputs are other nodes or constants; a param
may be a ``Slot``, a value the runtime supplies on every call (a random key, the AdamW bias
corrections of this step), so replaying the graph draws exactly what eager would.

    %12 = matmul %10 %11                      (64, 128) float32
    %13 = redistribute %12 [P(sum)] -> [R]    (64, 128) float32   # all_reduce
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtensor import observe

__all__ = ["Node", "Graph", "Slot"]


# Node kinds of generated kernels (compile/triton_backend.py, compile/c_backend.py): called as
# ops are, with their bound params and an optional out= buffer.
KERNEL_KINDS = ("triton", "c")


@dataclass(frozen=True)
class Slot:
    """A param whose value the runtime computes before each call (slot ``index``)."""

    index: int
    name: str  # "key", "lr", "bc1", ...

    def __repr__(self) -> str:
        return f"${self.name}{self.index}"


@dataclass(eq=False)
class Node:
    id: int
    kind: str  # "input" | "op" | "comm" (a redistribute's step), or a backend's kernel kind
    name: str  # op name, collective name (all_gather, all_reduce ...), or the input's label
    inputs: list = field(default_factory=list)  # Node or constant
    params: dict = field(default_factory=dict)
    shape: tuple = ()
    dtype: Any = None
    buffer: int | None = None  # preallocated result buffer (compile/passes/memory.py)
    # "impl" (the op's impl), or "local" (its DTensor local kernel, on ``blocks``)
    variant: str = "impl"
    blocks: tuple | None = None  # (input Blocks, output Block) of a "local" op
    # (input specs, output spec) of a DTensor op or a collective: mesh, placements, shape
    specs: tuple | None = None
    # what it was traced under (dtensor/observe.py): a collective's module, phase, op, rule and
    # placements, another node's module and phase; what the debugging tools report at run time
    cause: dict | None = None

    def __repr__(self) -> str:
        return f"%{self.id}"


def placements_text(specs) -> str:
    """``[S(0),R] _``: each spec's placements (``_`` for an input that is not distributed)."""
    return " ".join("[" + ",".join(map(repr, s.placements)) + "]" if s is not None else "_"
                    for s in specs)


def _arg(a) -> str:
    if isinstance(a, Node):
        return repr(a)
    if isinstance(a, np.ndarray):
        return f"const{tuple(a.shape)}"
    return repr(a)


@dataclass(eq=False)
class Graph:
    """Nodes in program order (a topological order); ``outputs`` are the values the runtime
    returns: the function's result leaves, then parameter and state write-backs."""

    inputs: list[Node] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list = field(default_factory=list)  # Node or constant
    slots: list = field(default_factory=list)  # runtime slot makers, by Slot.index
    buffers: list = field(default_factory=list)  # (shape, dtype, arena offset) of each buffer
    arena_bytes: int = 0  # the memory plan's arena, which holds every planned buffer
    _next: int = 0

    def new(self, kind: str, name: str, inputs=(), params=None, shape=(), dtype=None,
            variant: str = "impl", blocks=None, specs=None, cause=None) -> Node:
        if cause is None and observe.TRACKING and kind != "input":  # the module it came from
            cause = {k: observe.CAUSE[k] for k in ("module", "phase") if k in observe.CAUSE}
        node = Node(self._next, kind, name, list(inputs), dict(params or {}), tuple(shape),
                    np.dtype(dtype) if dtype is not None else None, None, variant, blocks,
                    specs, cause)
        self._next += 1
        (self.inputs if kind == "input" else self.nodes).append(node)
        return node

    def users(self) -> dict[int, list[Node]]:
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for a in n.inputs:
                if isinstance(a, Node):
                    out.setdefault(a.id, []).append(n)
        return out

    def __str__(self) -> str:
        lines = []
        for n in self.inputs:
            lines.append(f"{n!r:>5} = input {str(n.name):28s} {n.shape} {n.dtype}")
        for n in self.nodes:
            args = " ".join(_arg(a) for a in n.inputs)
            params = " ".join(f"{k}={list(v) if isinstance(v, tuple) and n.kind == 'comm' else v!r}"
                              for k, v in n.params.items() if k != "ops")
            text = f"{n.name} {args}" + (f" {params}" if params else "")
            if "ops" in n.params:  # a fused group: its ops, in order
                text += " [" + " ".join(op[0] for op in n.params["ops"]) + "]"
            if n.specs is not None:
                text += f" {placements_text(n.specs[0])} -> {placements_text([n.specs[1]])}"
            if n.buffer is not None:
                text += f" -> buf{n.buffer}"
            lines.append(f"{n!r:>5} = {text:60s} {n.shape} {n.dtype}")
        lines.append("return " + ", ".join(_arg(o) for o in self.outputs))
        return "\n".join(lines)
