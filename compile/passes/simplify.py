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
