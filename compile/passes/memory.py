"""Static memory plan: results of out= capable nodes (ufuncs, matmul) go to preallocated
buffers, reused across nodes and calls when their values are dead.

A buffer is busy from the node that writes it to the last use of its value or of any view of
it (reshape, permute, getitem, broadcast_to, a collective that may hand its input back, a
bucket part); values the graph returns never get one, because they outlive the call.
"""
from __future__ import annotations

import functools

import numpy as np

from dtensor.graph import KERNEL_KINDS, Graph, Node

# Ops whose result may share memory with their (first) input.
VIEW_OPS = frozenset({"reshape", "permute", "getitem", "broadcast_to", "bucket_part", "wait",
                      "adamw_part"})


def _out_capable(n: Node) -> bool:
    if n.kind not in ("op", *KERNEL_KINDS) or n.dtype is None or n.dtype.kind not in "fiub":
        return False
    if (n.name in ("fused", "fused_rows") and n.fn is None) or getattr(n.fn, "accepts_out",
                                                                         False):
        return True
    if n.name == "matmul" and n.variant == "impl":
        return len(n.shape) >= 2
    if isinstance(n.fn, np.ufunc) and n.fn.nout == 1:
        arrays = [a for a in n.inputs if isinstance(a, (Node, np.ndarray))]
        return bool(arrays) and all(a.dtype == n.dtype for a in arrays)
    return False


def plan_memory(graph: Graph) -> Graph:
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    root: dict[int, int] = {}
    for n in graph.nodes:
        if (n.name in VIEW_OPS or n.kind == "comm") and n.inputs and isinstance(n.inputs[0],
                                                                                 Node):
            root[n.id] = root.get(n.inputs[0].id, n.inputs[0].id)
        else:
            root[n.id] = n.id
    end: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for a in n.inputs:
            if isinstance(a, Node):
                r = root.get(a.id, a.id)
                end[r] = max(end.get(r, -1), i)
        end.setdefault(root[n.id], index[n.id])
    escaping = {root.get(o.id, o.id) for o in graph.outputs if isinstance(o, Node)}
    free: dict[tuple, list[int]] = {}
    busy: list[tuple[int, int, tuple]] = []  # (end index, buffer, key)
    graph.buffers = []
    for i, n in enumerate(graph.nodes):
        still = []
        for e, b, key in busy:  # a buffer whose last reader ran before node i is free again
            (free.setdefault(key, []).append(b) if e < i else still.append((e, b, key)))
        busy = still
        if n.id in escaping or not _out_capable(n):
            continue
        key = (tuple(n.shape), n.dtype.str)
        if free.get(key):
            b = free[key].pop()
        else:
            b = len(graph.buffers)
            graph.buffers.append((tuple(n.shape), n.dtype))
        n.buffer = b
        busy.append((end[n.id], b, key))
    _donate_to_collectives(graph)
    return graph


def _donate_to_collectives(graph: Graph) -> None:
    """A planned buffer whose only reader is a redistribute (through views) is given to it: an
    all-reduce of a partial sum then reduces in place, skipping MPI's copy of the input into a
    separate result (0.67 -> 0.48 ms for 1 MB at 2 ranks). The result keeps the buffer, whose
    lifetime the plan already extends over the collective's result (see ``root`` above)."""
    users = graph.users()
    for n in graph.nodes:
        a = n.inputs[0] if n.kind == "comm" and n.name == "all_reduce" else None
        while (isinstance(a, Node) and len(users.get(a.id, ())) == 1 and a.buffer is None
               and a.kind == "op" and a.name in VIEW_OPS):
            a = a.inputs[0]
        if isinstance(a, Node) and len(users.get(a.id, ())) == 1 and a.buffer is not None:
            n.fn = functools.partial(n.fn, donate=True)
