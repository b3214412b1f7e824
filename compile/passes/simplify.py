"""Dead-code elimination and common-subexpression elimination."""
from __future__ import annotations

import numpy as np

from dtensor.graph import Graph, Node


def dce(graph: Graph) -> Graph:
    """Drop nodes no output depends on (a forward value the backward never reads, a gradient
    zero_grad() threw away). Ops have no side effects; collectives are kept only if used, and
    every rank drops the same ones because every rank traces the same program."""
    live = {o.id for o in graph.outputs if isinstance(o, Node)}
    kept = []
    for n in reversed(graph.nodes):
        if n.id in live:
            kept.append(n)
            live.update(a.id for a in n.inputs if isinstance(a, Node))
    graph.nodes = kept[::-1]
    return graph


def _key(value):
    if isinstance(value, Node):
        return ("node", value.id)
    if isinstance(value, np.ndarray):
        return ("array", id(value))
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value


def cse(graph: Graph) -> Graph:
    """Merge nodes that call the same function on the same inputs with the same params (the
    backward re-reading a forward value's transpose, a mask built twice)."""
    seen: dict = {}
    alias: dict[int, Node] = {}

    def sub(a):
        return alias.get(a.id, a) if isinstance(a, Node) else a

    kept = []
    for n in graph.nodes:
        n.inputs = [sub(a) for a in n.inputs]
        # A collective is a function of its input too, and every rank traces the same program:
        # the same redistribute of the same value twice (a Partial read by two consumers that
        # each reduce it) is issued once on every rank.
        # (a local kernel's result depends on where its blocks sit: its specs)
        key = (n.kind, n.name, n.variant, n.specs if n.kind == "comm" or n.variant != "impl"
               else None, _key(n.inputs), _key(n.params))
        if n.kind in ("op", "comm") and n.name != "all_reduce_bucket" and key in seen:
            alias[n.id] = seen[key]
            continue
        seen[key] = n
        kept.append(n)
    graph.nodes = kept
    graph.outputs = [sub(o) for o in graph.outputs]
    return graph


def _one_hot_scatter(s, shape) -> bool:
    """Whether ``s`` is a scatter_add of one index per row along its axis into zeros of
    ``shape`` (a gather's gradient: cross-entropy's target column)."""
    if not (isinstance(s, Node) and s.kind == "op" and s.name == "scatter_add"
            and tuple(s.shape) == tuple(shape)):
        return False
    idx = s.inputs[1]
    axis = s.params["axis"] % len(s.shape)
    return isinstance(idx, Node) and idx.shape[axis] == 1


def fold_scatter_adds(graph: Graph) -> Graph:
    """``a + scatter_add(g, idx)``, one index per row, where nothing else reads ``a`` or the
    scatter: ``g`` added into ``a`` at ``idx`` (``add_at``), in place. The scatter wrote a
    whole tensor of zeros and the sum read it back for a handful of values: cross-entropy's
    backward over a (tokens, vocab) block, softmax minus the one-hot target, read and wrote
    3 vocab-wide arrays instead of 1. The same values: each element at an index is a + g
    rounded once, as before; the others keep a's bits (the sum's a + 0 gave the same value,
    +0 for a -0)."""
    users = graph.users()
    outputs = {o.id for o in graph.outputs if isinstance(o, Node)}
    drop = set()
    for n in graph.nodes:  # (a "fused" add has not formed yet: fuse_pointwise runs later)
        if not (n.kind == "op" and n.name == "add" and n.variant == "impl"
                and len(n.inputs) == 2):
            continue
        for k, (a, s) in enumerate((n.inputs, n.inputs[::-1])):
            if (_one_hot_scatter(s, n.shape) and isinstance(a, Node)
                    and tuple(a.shape) == tuple(n.shape)
                    and a.dtype == n.dtype == s.dtype
                    and a.id not in outputs and s.id not in outputs
                    and len(users[s.id]) == 1  # (a may be the scatter's shape template too)
                    and all(u is n or u is s for u in users[a.id])):
                axis = s.params["axis"] % len(s.shape)
                block = s.blocks[1].rows(axis) if s.variant == "local" else None
                n.name, n.inputs = "add_at", [a, s.inputs[0], s.inputs[1]]
                n.params = {"axis": axis, "block": block}
                if n.specs is not None and s.specs is not None:  # (what the graph prints)
                    n.specs = ((n.specs[0][k], *s.specs[0][:2]), n.specs[1])
                drop.add(s.id)
                break
    graph.nodes = [n for n in graph.nodes if n.id not in drop]
    return graph


def add_at(a, g, idx, *, axis: int, block=None, in_place: bool = False):
    """``a`` with ``g`` added at ``idx`` along ``axis`` (one index per row); ``block``: (first
    index, count) of a vocab-parallel rank's block along ``axis``, where an index outside it
    adds exactly 0, as in scatter_add's local kernel. ``in_place``: into ``a``, which the
    memory plan gave a buffer of its own (plan_memory), else into a copy."""
    if not in_place:
        a = a.copy()
    if block is not None:
        from dtensor.ops.structural import in_block
        idx, hit = in_block(idx, *block)
        g = np.where(hit, g, 0)
    np.put_along_axis(a, idx, np.take_along_axis(a, idx, axis) + g, axis)
    return a


def fold_product_sums(graph: Graph) -> Graph:
    """``sum(a * b)`` over every dim but the last, nothing else reading the product: one
    ``sum_of_products`` pass that never writes the product (a LayerNorm's weight gradient,
    g * x_hat summed over the tokens: a (1024, 256) product written and read back, 80 -> 53
    us). numpy sums the leading dims row by row, as einsum does: the same order."""
    users = graph.users()
    outputs = {o.id for o in graph.outputs if isinstance(o, Node)}
    drop = set()
    for n in graph.nodes:
        m = n.inputs[0] if n.kind == "op" and n.name == "sum" and n.inputs else None
        if not (isinstance(m, Node) and n.variant == "impl" and len(m.shape) >= 2
                and tuple(n.params["axis"] or ()) == tuple(range(len(m.shape) - 1))
                and m.kind == "op" and m.name == "mul" and m.variant == "impl"
                and m.id not in outputs and len(users[m.id]) == 1 and len(m.inputs) == 2
                and all(isinstance(a, Node) and tuple(a.shape) == tuple(m.shape)
                        and a.dtype == m.dtype for a in m.inputs)
                and m.dtype.kind == "f"):
            continue
        n.name, n.inputs = "sum_of_products", list(m.inputs)
        if n.specs is not None and m.specs is not None:  # (what the graph prints)
            n.specs = (m.specs[0], n.specs[1])
        n.params = {"keepdims": bool(n.params.get("keepdims"))}
        drop.add(m.id)
    graph.nodes = [n for n in graph.nodes if n.id not in drop]
    return graph


def sum_of_products(a, b, *, keepdims: bool):
    """(a * b) summed over every dim but the last."""
    c = a.shape[-1]
    out = np.einsum("rc,rc->c", a.reshape(-1, c), b.reshape(-1, c))
    return out.reshape((1,) * (a.ndim - 1) + (c,)) if keepdims else out
