"""The kernel layer: one backend-neutral description of every generated kernel, which the
numpy, C and Triton backends render.

A kernel runs over R rows of C columns: a fused pointwise group's output split at its last dim,
a row group's rows, or a row-wise op's. Its math is the expression its ops' ``lower`` rules
build (dtensor/ops/expr.py). What the description settles for every renderer:

- each input's layout: the terms of its row offset (``(r // inner) % n * stride``) and its
  column stride, 0 for a value per row (a (..., 1) column, a cross-entropy target);
- each expression node's kind: row-valued (one value per row: reductions, per-row inputs,
  constants and what is computed only from them) or column-valued, and its level (how many
  row reductions must be complete before it can be computed). A renderer that streams a row
  (C) makes one pass per level; one that holds whole rows in a tile (Triton, numpy blocks)
  computes in program order;
- each value once: equal subexpressions (a lower that spells rowmax(x) twice) are one node;
- which inputs are read (a draw's template is not), and the call: contiguous arrays in, the
  output allocated or the memory plan's buffer, the op's own input check (``check``) first.
"""
from __future__ import annotations

import ctypes
import math
from typing import NamedTuple

import numpy as np

from dtensor.graph import Node
from dtensor.ops import expr as X
from dtensor.ops.registry import OPS


_ADDRESS, _BYTES = ctypes.addressof, ctypes.c_char.from_buffer


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first byte. Through the buffer protocol where ``a`` allows it (C
    contiguous, writable, not empty): several times cheaper than ``a.ctypes.data``, and a
    step takes hundreds (its C kernels' arguments, the AdamW group's tables)."""
    try:
        return _ADDRESS(_BYTES(a))
    except (TypeError, ValueError):  # read-only, strided or empty
        return a.ctypes.data


class Layout(NamedTuple):
    dtype: np.dtype
    terms: tuple  # ((inner, n, stride), ...): the row offset of row r is their sum
    col_stride: int  # 0: one value per row


def _layout(shape, dtype, lead: tuple, C: int) -> Layout:
    """Where row r, column c of an input broadcast to (lead, C) is, in elements."""
    dtype = np.dtype(dtype)
    strides = np.cumprod((1,) + tuple(reversed(shape[1:])))[::-1] if shape else ()
    tiny = np.lib.stride_tricks.as_strided(np.empty(1, dtype), tuple(shape),
                                           [int(s) * dtype.itemsize for s in strides])
    st = [s // dtype.itemsize for s in np.broadcast_to(tiny, lead + (C,)).strides]
    terms, inner = [], 1
    for d in reversed(range(len(lead))):
        if st[d]:
            terms.append((inner, lead[d], st[d]))
        inner *= lead[d]
    return Layout(dtype, tuple(terms), st[-1])


def _last_dim_sum(n: Node) -> bool:
    """A sum of whole rows over their last dim, kept or not (a (..., 1) or (...) result): a
    row kernel of its own (numpy's pairwise sums along contiguous rows run slower, as
    cross-entropy's over its block of exps; benchmarks/gpt_step.py). Not a max:
    numpy's propagates a NaN, a kernel's row max (in a softmax, whose exp gives the NaN
    back) skips it."""
    x = n.inputs[0] if n.inputs else None
    return (n.name == "sum" and n.variant == "impl" and isinstance(x, (Node, np.ndarray))
            and len(x.shape) >= 1 and tuple(n.params.get("axis") or ()) == (len(x.shape) - 1,))


def elementwise(n: Node) -> bool:
    """Whether node ``n`` computes each result element from the same element of its
    full-shape inputs alone (a pointwise op, or a group of them), so that its result may be
    written over such an input as it goes."""
    if n.name == "fused":
        return True
    op = OPS.get(n.name)
    return op is not None and op.shard == "pointwise" and n.variant == "impl"


def members(n: Node):
    """(ops, array inputs, their call positions, row shape) of a node a kernel can run, else
    None. ops: (name, op, refs, params) with refs ("in", k) / ("op", j) / ("const", v)."""
    arrays = [(k, a) for k, a in enumerate(n.inputs) if isinstance(a, (Node, np.ndarray))]
    if n.name in ("fused", "fused_rows"):
        lead, C = n.params["row_shape"]
        return n.params["ops"], [a for _, a in arrays], [k for k, _ in arrays], (tuple(lead), C)
    op = OPS.get(n.name)
    if (n.kind != "op" or op is None or not callable(op.lower) or not n.shape
            or (op.shard == "reduce" and not _last_dim_sum(n))
            or op.shard == "pointwise_stacked"
            or (n.variant != "impl" and op.shard != "factory")):
        return None
    refs = [("in", next(j for j, (_, b) in enumerate(arrays) if b is a))
            if isinstance(a, (Node, np.ndarray)) else ("const", a) for a in n.inputs]
    params = {k: v for k, v in n.params.items() if k != "key"}
    if op.shard == "factory":  # a draw: its key comes at run time; a block's draws sit at
        params["key"] = "key"  # their global offsets, an input of the kernel
        if n.variant != "impl":
            offsets = n.blocks[-1].flat_offsets()
            refs.append(("in", len(arrays)))
            arrays.append((None, offsets))
            params["offset"] = None
    if op.shard in ("rowwise", "reduce", "row_reduce"):  # the rows are its input's
        x = max((a for _, a in arrays), key=lambda a: len(a.shape))
        shape = tuple(x.shape)
        if not shape[-1]:  # rows of nothing: the op's own impl gives the reduction's identity
            return None
    else:
        shape = tuple(n.shape)
    ops = [(n.name, op, refs, params)]
    return (ops, [a for _, a in arrays], [k for k, _ in arrays if k is not None],
            (shape[:-1], shape[-1]))


def expression(ops) -> X.E:
    """The group's result as one expression over inputs ``in k``."""
    vals = []
    for j, (name, op, refs, params) in enumerate(ops):
        args = [X.E("in", (), r) if kind == "in" else vals[r] if kind == "op" else X.lift(r)
                for kind, r in refs]
        params = dict(params)
        if op.shard == "factory":
            params["key"] = params.get("key", f"key{j}")
            if "offset" in params:
                params["offset"] = args.pop()
            vals.append(op.lower(None, **params))
        else:
            vals.append(op.lower(*args, **params))
    return vals[-1]


class Kernel:
    """One kernel, described for a renderer: subclasses render ``self`` (in ``__init__``) and
    launch it (``launch(arrays, out, keys)``)."""

    accepts_out = True

    def __init__(self, node: Node, found):
        ops, inputs, positions, (lead, C) = found
        self.shape, self.dtype = tuple(node.shape), np.dtype(node.dtype)
        self.lead, self.C, self.R = lead, C, math.prod(lead)
        self.L = lead[-1] if lead else 1
        self.label = f"{node.name} " + " ".join(name for name, *_ in ops)
        op = ops[0][1] if len(ops) == 1 else None
        self.check = op.meta.get("check") if op is not None else None
        per_row = op.meta.get("per_row", ()) if op is not None else ()
        root = X.shared(expression(ops))
        self.causal = root.prim == "causal"
        self.root = root.args[0] if self.causal else root
        self.nodes = X.topo([self.root])
        used = sorted({e.attr for e in self.nodes if e.prim == "in"})
        self.positions = [positions[k] if k < len(positions) else inputs[k] for k in used]
        renumber = {k: i for i, k in enumerate(used)}
        for e in self.nodes:
            if e.prim == "in":
                e.attr = renumber[e.attr]
        self.in_shapes = [tuple(inputs[k].shape) + ((1,) if k in per_row else ())
                          for k in used]  # a per-row input (a target) as a column
        self.inputs = [_layout(s, inputs[k].dtype, lead, C)
                       for s, k in zip(self.in_shapes, used)]
        self.keys = sorted({e.attr for e in self.nodes if e.prim in ("rand", "randn")})
        self.out_cols = 1 if math.prod(self.shape) == self.R and C != 1 else C
        self.index = {id(e): i for i, e in enumerate(self.nodes)}
        self.row_valued, self.level = {}, {}
        for e in self.nodes:
            args = [id(a) for a in e.args]
            if e.prim in X.REDUCTIONS:
                rv, lv = True, self.level[args[0]] + 1
            elif e.prim == "in":
                rv, lv = self.inputs[e.attr].col_stride == 0 and C != 1, 0
            else:
                rv = e.prim != "col" and all(self.row_valued[a] for a in args)
                lv = max((self.level[a] for a in args), default=0)
            self.row_valued[id(e)], self.level[id(e)] = rv, lv

    def literal(self, v):
        """A constant's value for this kernel (a {itemsize: value} table resolved)."""
        return v[self.dtype.itemsize] if isinstance(v, dict) else v

    def needed(self, targets, known=()) -> list:
        """Column-valued nodes that ``targets`` read (through column-valued nodes), in order,
        not looking past those in ``known`` (ids of values the caller already has)."""
        want, stack = set(), [t for t in targets if not self.row_valued[id(t)]]
        while stack:
            e = stack.pop()
            if id(e) not in want:
                want.add(id(e))
                if id(e) not in known:
                    stack.extend(a for a in e.args if not self.row_valued[id(a)])
        return [e for e in self.nodes if id(e) in want]

    def bind(self, params: dict) -> dict:
        """The node's params this kernel is called with: its draws' keys."""
        return {k: v for k, v in params.items() if k in self.keys}

    def __call__(self, *inputs, out=None, **keys):
        if self.check is not None:
            self.check(*inputs)
        arrays = [np.ascontiguousarray(inputs[p] if isinstance(p, int) else p)
                  for p in self.positions]
        out = np.empty(self.shape, self.dtype) if out is None else out
        if self.R and self.C:
            if self.keys:
                keys = {k: int(keys[k]) & ((1 << 64) - 1) for k in self.keys}
            self.launch(arrays, out, keys)
        return out


class Named:
    """A kernel kind of its own, not an expression (index_add, attention, the AdamW group):
    called with its node's inputs, into ``out`` when the memory plan gives one."""

    accepts_out = True
    source = ""  # (the C ones live in the backend's prelude)

    def bind(self, params: dict) -> dict:
        return {}

    def alloc(self, out):
        return np.empty(self.shape, self.dtype) if out is None else out


class IndexAdd(Named):
    """index_add, an embedding's gradient: the whole op, or a vocab-parallel rank's rows
    ``off`` .. ``off + rows`` of it (its local kernel's output block; other indices add
    nothing). ``rows_of`` checks the indices and gives them and g as the kernel reads them."""

    def __init__(self, n: Node):
        self.shape, self.dtype = tuple(n.shape), np.dtype(n.dtype)
        self.rows, self.C = self.shape[0], math.prod(self.shape[1:])
        out = n.blocks[1] if n.variant != "impl" else None
        self.off, self.total_rows = (out.rows(0)[0], out.shape[0]) if out else (0, self.rows)

    def rows_of(self, g, idx):
        from dtensor.ops.structural import check_rows
        flat = np.ascontiguousarray(check_rows(idx, self.total_rows), dtype=np.int64)
        return np.ascontiguousarray(g, dtype=self.dtype), flat


class Attention(Named):
    """attention or its backward (dtensor/ops/nn.py) over H heads of (L, E)."""

    def __init__(self, n: Node):
        self.backward = n.name == "attention_backward"
        self.shape, self.dtype = tuple(n.shape), np.dtype(n.dtype)
        q = n.inputs[1 if self.backward else 0]
        self.L, self.E, self.H = *q.shape[-2:], math.prod(q.shape[:-2])
        self.scale, self.causal = float(n.params["scale"]), bool(n.params["causal"])


def straight_line(roots, spell) -> tuple[list, list]:
    """Assignments ``(name, text)`` computing ``roots`` in order, and the roots' names: a
    leaf (input, constant) is spelled in place, every other node once, as ``t<i>``;
    ``spell(node, argument names)`` is the renderer's text for one node."""
    names, lines = {}, []
    for i, e in enumerate(X.topo(roots)):
        text = spell(e, [names[id(a)] for a in e.args])
        if e.prim in ("in", "const"):
            names[id(e)] = text
        else:
            names[id(e)] = f"t{i}"
            lines.append((f"t{i}", text))
    return lines, [names[id(r)] for r in roots]


def adamw_body(spell) -> tuple[list, list]:
    """The AdamW update of one element as straight-line code: inputs 0-3 are p, g, m, v, 4-10
    the update's seven constants; returns (assignments, names of the new p, m, v)."""
    leaves = [X.E("in", (), k) for k in range(11)]
    return straight_line(OPS["adamw_step"].lower(*leaves), spell)
