"""Collective passes: merge independent small gradient all-reduces into buckets."""
from __future__ import annotations

import operator

import numpy as np

from dtensor.compile.graph import Graph, Node
from dtensor.placements import Partial, Replicate

BUCKET_BYTES = 25 << 20  # as PyTorch DDP's default bucket cap


def _all_reduce_dim(n: Node):
    """The mesh dim of a redistribute that is exactly one Partial(sum) -> Replicate, else None."""
    if n.kind != "comm":
        return None
    src, dst = n.params["spec"].placements, n.params["placements"]
    changed = [m for m, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(changed) == 1 and src[changed[0]] == Partial("sum") and dst[changed[0]] == Replicate():
        return changed[0]
    return None


def _bucket_fn(group, shapes):
    sizes = [int(np.prod(s)) for s in shapes]

    def run(*arrays):
        flat = np.concatenate([np.ravel(a) for a in arrays])
        flat = group.all_reduce(flat)
        out, start = [], 0
        for n, s in zip(sizes, shapes):
            out.append(flat[start:start + n].reshape(s))
            start += n
        return tuple(out)

    return run


def bucket_all_reduces(graph: Graph) -> Graph:
    """Merge all-reduces (P(sum) -> R on one mesh dim) whose results are first used only after
    the last of them was issued: the gradient all-reduces of data parallelism, one per
    parameter in eager, become one per ~25 MB. Activation all-reduces, used right away, stay."""
    first_use: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for a in n.inputs:
            if isinstance(a, Node) and a.id not in first_use:
                first_use[a.id] = i
    out_ids = {o.id for o in graph.outputs if isinstance(o, Node)}
    buckets, cur, key, deadline, size = [], [], None, 0, 0
    for i, n in enumerate(graph.nodes):
        m = _all_reduce_dim(n)
        if m is None:
            continue
        k = (n.params["spec"].mesh, m, n.dtype)
        nbytes = int(np.prod(n.shape)) * n.dtype.itemsize
        if cur and (k != key or i >= deadline or size + nbytes > BUCKET_BYTES):
            buckets.append(cur)
            cur = []
        if not cur:
            key, deadline, size = k, len(graph.nodes), 0
        cur.append((i, n))
        size += nbytes
        deadline = min(deadline, first_use.get(n.id, len(graph.nodes) if n.id not in out_ids
                                                else len(graph.nodes)))
    if cur:
        buckets.append(cur)
    replace: dict[int, list[Node]] = {}  # node index -> nodes to put there instead
    drop = set()
    for b in buckets:
        if len(b) < 2:
            continue
        members = [n for _, n in b]
        mesh, m, _ = members[0].params["spec"].mesh, _all_reduce_dim(members[0]), None
        shapes = [n.shape for n in members]
        bucket = Node(graph._next, "comm", "all_reduce_bucket", [n.inputs[0] for n in members],
                      {}, (), members[0].dtype,
                      fn=_bucket_fn(mesh.get_group(m), shapes),
                      note=f"{len(members)} gradients over mesh dim {m}")
        graph._next += 1
        for j, n in enumerate(members):  # each member now reads its part of the bucket
            n.kind, n.name, n.inputs, n.params = "op", "bucket_part", [bucket], {}
            n.fn, n.note = operator.itemgetter(j), ""
        last = b[-1][0]
        drop.update(i for i, _ in b)
        replace[last] = [bucket] + members
    if replace:
        nodes = []
        for i, n in enumerate(graph.nodes):
            if i in replace:
                nodes.extend(replace[i])
            elif i not in drop:
                nodes.append(n)
        graph.nodes = nodes
    return graph
