"""Fusion: chains of pointwise ops become one ``fused`` node (one kernel), and pointwise ops
mixed with last-dim reductions over the same rows one ``fused_rows`` node.

A pointwise op (registry ``shard == "pointwise"`` with a ``lower`` expression) joins the group of
an input when that input is the group's last node, has no other user, and has the same shape;
two groups that meet at one op merge. Intermediate values of a group are therefore never seen
outside it, and the fused node sits where its last op was, after every external input. Inputs
from outside may broadcast (a bias, a row statistic); scalars stay constants.

``fuse_adamw`` gathers the AdamW updates of all parameters (same hyperparameters and dtype) into
one ``adamw_group`` node, one kernel over every parameter, as PyTorch's fused/foreach AdamW: its
(3, total) result is cut back into each parameter's (3, ...) block by ``adamw_part`` views.

The fused node keeps its ops (``node.params["ops"]``: (name, op, inputs, params) with inputs
naming external inputs as ("in", k) and earlier ops as ("op", j)); each backend generates its
kernel from that list (compile/kernels.py).
"""
from __future__ import annotations

import numpy as np

from dtensor.graph import Graph, Node, Slot
from dtensor.ops.expr import E
from dtensor.ops.registry import OPS


def pointwise_op(n: Node):
    """The registry op of a fusible node, else None."""
    op = OPS.get(n.name)
    if (n.kind != "op" or op is None or op.shard != "pointwise" or n.variant != "impl"
            or op.lower is None):
        return None
    return op


def as_group(n: Node):
    """(ops, arrays, positions) of a ``fused`` node, or of one pointwise op as a group of one:
    its ops list, its array inputs, and their positions among its call arguments (the rest are
    constants; a 0-d value may arrive as a numpy scalar, so kernels pick arrays by position)."""
    positions = [k for k, a in enumerate(n.inputs) if isinstance(a, (Node, np.ndarray))]
    arrays = [n.inputs[k] for k in positions]
    if n.name == "fused":
        return n.params["ops"], arrays, positions
    refs = [("in", next(k for k, b in enumerate(arrays) if a is b))
            if isinstance(a, (Node, np.ndarray)) else ("const", a) for a in n.inputs]
    return [(n.name, pointwise_op(n), refs, dict(n.params))], arrays, positions


def row_reduction(n: Node) -> bool:
    """A sum or max over the last dim that keeps it (a (..., 1) column), on whole blocks."""
    if n.kind != "op" or n.name not in ("sum", "max") or n.variant != "impl":
        return False
    x = n.inputs[0] if n.inputs else None
    return (isinstance(x, Node) and len(x.shape) >= 1 and n.params.get("keepdims")
            and tuple(n.params.get("axis", ())) == (len(x.shape) - 1,))


def row_op(n: Node) -> bool:
    """A row-wise op (softmax, normalize, their backwards) whose inputs and output are the same
    whole rows: a row group can hold it, so the pointwise ops around it share its kernel (a
    LayerNorm's g * w and the normalize backward it feeds). Not a causal softmax (its column
    limit is the whole kernel's) nor an op with one value per row (cross-entropy)."""
    op = OPS.get(n.name)
    if not (n.kind == "op" and n.variant == "impl" and op is not None and op.shard == "rowwise"
            and op.lower is not None and not op.meta.get("per_row") and bool(n.shape)
            and all(isinstance(a, Node) and a.shape == n.shape for a in n.inputs)):
        return False
    leaves = [E("in", (), k) for k in range(len(n.inputs))]
    return op.lower(*leaves, **n.params).prim != "causal"


def random_source(n: Node) -> bool:
    """rand/randn on a whole tensor: element i is a pure function of (key, i), so a kernel can
    draw it where it is used (dropout's mask is computed, never stored)."""
    return n.kind == "op" and n.name in ("rand", "randn") and n.variant == "impl"


def _fusible(n: Node, row_ops: bool) -> bool:
    return bool(n.shape) and (pointwise_op(n) is not None or row_reduction(n)
                              or random_source(n) or (row_ops and row_op(n)))


def _fits(group_shape, shape) -> bool:
    """Same leading dims, and a last dim that is the group's or 1 (a per-row column)."""
    lead, last = group_shape
    return (len(shape) == len(lead) + 1 and tuple(shape[:-1]) == lead
            and (shape[-1] in (last, 1) or last == 1))


def _row_shape(shapes) -> tuple:
    return tuple(shapes[0][:-1]), max(s[-1] for s in shapes)


def fuse_pointwise(graph: Graph, row_ops: bool = False) -> Graph:
    """Pointwise chains, and row groups: pointwise ops and last-dim reductions over the same
    rows (an RMSNorm: square, sum, scale, sqrt, divide, weight) become one node; with
    ``row_ops``, row-wise ops (``row_op``) join them too."""
    users = graph.users()
    out_ids = {o.id for o in graph.outputs if isinstance(o, Node)}
    group_of: dict[int, list[Node]] = {}  # node id -> its group (members in program order)
    for n in graph.nodes:
        if not _fusible(n, row_ops):
            continue
        members = []
        for a in ([] if random_source(n) else n.inputs):  # a draw starts a group
            g = group_of.get(a.id) if isinstance(a, Node) else None
            if (g is not None and g[-1] is a and len(users.get(a.id, ())) == 1
                    and a.id not in out_ids and g is not members):
                merged = sorted(set(members) | set(g), key=lambda m: m.id) if members else g
                shapes = [m.shape for m in merged] + [n.shape]
                rows = any(row_reduction(m) or row_op(m) for m in merged + [n])
                draws = any(random_source(m) for m in merged)
                if all(_fits(_row_shape(shapes), sh) for sh in shapes) and (
                        (rows and not draws) or all(sh == n.shape for sh in shapes)):
                    members = merged
        group = (members if members else []) + [n]
        for m in group:
            group_of[m.id] = group
    fused_at: dict[int, Node] = {}  # tail id -> fused node
    drop = set()
    seen = set()
    for group in group_of.values():
        if id(group) in seen or len(group) < 2:
            continue
        seen.add(id(group))
        group.sort(key=lambda m: m.id)
        tail = group[-1]
        inside = {m.id: j for j, m in enumerate(group)}
        externals: list = []
        ops = []
        keys = {}
        for m in group:
            refs = []
            if random_source(m):  # no inputs: its template only gave the shape
                keys[f"key{len(ops)}"] = m.params["key"]
                ops.append((m.name, OPS[m.name], [], {"dtype": m.params["dtype"]}))
                continue
            for a in m.inputs:
                if isinstance(a, Node) and a.id in inside:
                    refs.append(("op", inside[a.id]))
                elif isinstance(a, (Node, np.ndarray)):
                    if not any(a is e for e in externals):
                        externals.append(a)
                    refs.append(("in", next(k for k, e in enumerate(externals) if e is a)))
                else:
                    refs.append(("const", a))
            ops.append((m.name, OPS[m.name], refs, dict(m.params)))
        rows = any(row_reduction(m) or row_op(m) for m in group)
        # a key is a Slot: the runtime passes key<j>=...
        params = {"ops": ops, "row_shape": _row_shape([m.shape for m in group]), **keys}
        fused = Node(tail.id, "op", "fused_rows" if rows else "fused", externals, params,
                     tail.shape, tail.dtype)
        fused_at[tail.id] = fused
        drop.update(m.id for m in group[:-1])
    if fused_at:
        graph.nodes = [fused_at.get(n.id, n) for n in graph.nodes if n.id not in drop]
        graph.outputs = [fused_at.get(o.id, o) if isinstance(o, Node) else o
                         for o in graph.outputs]
        for n in graph.nodes:
            n.inputs = [fused_at.get(a.id, a) if isinstance(a, Node) else a for a in n.inputs]
    return graph


def _adamw_node(n: Node) -> bool:
    return n.kind == "op" and n.name == "adamw_step" and n.variant == "impl"


def adamw_part(flat, *, offset: int, shape: tuple):
    """One parameter's (3, ...) block of an adamw_group result: a view."""
    size = int(np.prod(shape[1:]))
    return flat[:, offset:offset + size].reshape(shape)


def fuse_adamw(graph: Graph) -> Graph:
    """All AdamW updates with the same hyperparameters become one ``adamw_group`` node where the
    last of them was, followed by a view of each block and the views taken of those (the
    optimizer's new param / m / v). Skipped when anything else reads an update before the last
    update runs (nothing in an optimizer step does). The group waits for every gradient, so a
    bucketed all-reduce no longer overlaps earlier updates; MPI progresses a non-blocking
    collective only inside MPI calls, so on CPU there was little overlap to lose."""
    from dtensor.compile.passes.memory import VIEW_OPS
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    groups: dict = {}
    for n in graph.nodes:
        if _adamw_node(n):  # runtime slots (lr, bias corrections) may differ per parameter
            key = (n.dtype.str, tuple(sorted((k, repr(v)) for k, v in n.params.items()
                                             if not isinstance(v, Slot))))
            groups.setdefault(key, []).append(n)
    users = graph.users()
    replace: dict[int, list[Node]] = {}  # id of the last update -> the nodes taking its place
    drop: set[int] = set()
    parts: dict[int, Node] = {}
    moved: set[int] = set()  # views of an update's result: they move behind the group
    for members in groups.values():
        last = index[members[-1].id]
        views, stack = set(), list(members)
        while stack:
            x = stack.pop()
            for u in users.get(x.id, ()):
                if u.name in VIEW_OPS and all(a is x for a in u.inputs if isinstance(a, Node)):
                    views.add(u.id)
                    stack.append(u)
        readers = [u for m in members for u in users.get(m.id, ()) if u.id not in views]
        readers += [u for v in views for u in users.get(v, ()) if u.id not in views]
        if any(index[u.id] <= last for u in readers):
            continue
        moved |= views
        sizes = [int(np.prod(m.shape[1:])) for m in members]
        inputs = [a for m in members for a in m.inputs]
        params = {k: v for k, v in members[0].params.items() if not isinstance(v, Slot)}
        each = tuple(k for k, v in members[0].params.items() if isinstance(v, Slot))
        for j, m in enumerate(members):
            params.update({f"{k}_{j}": m.params[k] for k in each})
        group = Node(graph._next, "op", "adamw_group", inputs,
                     {**params, "sizes": tuple(sizes), "each": each}, (3, sum(sizes)),
                     members[0].dtype)
        graph._next += 1
        nodes, offset = [group], 0
        for m, size in zip(members, sizes):
            part = Node(m.id, "op", "adamw_part", [group], {"offset": offset, "shape": m.shape},
                        m.shape, m.dtype)
            offset += size
            parts[m.id] = part
            nodes.append(part)
            drop.add(m.id)
        replace[members[-1].id] = nodes + [n for n in graph.nodes if n.id in views]
    if replace:
        new = []
        for n in graph.nodes:
            if n.id in replace:
                new.extend(replace[n.id])
            elif n.id not in drop and n.id not in moved:
                new.append(n)
        graph.nodes = new
        graph.outputs = [parts.get(o.id, o) if isinstance(o, Node) else o for o in graph.outputs]
        for n in graph.nodes:
            n.inputs = [parts.get(a.id, a) if isinstance(a, Node) else a for a in n.inputs]
    return graph
