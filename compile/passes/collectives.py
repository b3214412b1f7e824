"""Collective passes: drop redistributes that move nothing (a broadcast split into shards),
merge independent small gradient all-reduces into buckets."""
from __future__ import annotations

import numpy as np

from dtensor.graph import Graph, Node

BUCKET_BYTES = 25 << 20  # as PyTorch DDP's default bucket cap


def _all_reduce_dim(n: Node):
    """The mesh dim of a sum all_reduce (Partial(sum) -> Replicate), else None."""
    if n.kind == "comm" and n.name == "all_reduce" and n.params["op"] == "sum":
        return n.params["mesh_dim"]
    return None


def shard_broadcasts(graph: Graph) -> Graph:
    """A shard (Replicate -> Shard) of a broadcast along the split dim (the gradient of a sum
    over a sharded dim: a (rows, 1) column broadcast to (rows, vocab)) moves no data: each rank
    broadcasts the source to its own block. Pointwise users with another full-shape input that
    stays full read the source as it is (they broadcast it themselves, and a fused kernel reads
    it by its strides); otherwise the shard becomes a broadcast_to view. Eager slices the
    broadcast view, which is no copy either."""
    from dtensor.compile.passes.fusion import pointwise_op
    users = graph.users()
    outputs = {o.id for o in graph.outputs if isinstance(o, Node)}
    new: dict[int, object] = {}  # shard id -> what replaces it

    def resolve(a):
        while isinstance(a, Node) and a.id in new and new[a.id] is not a:
            a = new[a.id]
        return a

    def source(n):  # the broadcast's source if n is such a shard, else None
        if not (n.kind == "comm" and n.name == "shard" and "parts" not in n.params):
            return None
        src = resolve(n.inputs[0])
        if not (isinstance(src, Node) and src.kind == "op" and src.name == "broadcast_to"
                and src.variant == "impl"):
            return None
        base = resolve(src.inputs[0])
        shape = tuple(base.shape if isinstance(base, Node) else np.shape(base))
        padded = (1,) * (len(src.shape) - len(shape)) + shape
        return base if padded[n.params["axis"]] == 1 else None

    candidates = {n.id for n in graph.nodes if source(n) is not None}

    def reads_broadcast(u, n):  # u broadcasts n's source itself and keeps its own shape
        return pointwise_op(u) is not None and any(
            a is not n and (not isinstance(a, Node) or a.id not in candidates)
            and tuple(a.shape) == u.shape for a in u.inputs if isinstance(a, (Node, np.ndarray)))

    for i, n in enumerate(graph.nodes):
        base = source(n)  # a shard of an earlier one's replacement too (two mesh dims)
        if base is None:
            continue
        if n.id not in outputs and all(reads_broadcast(u, n) for u in users.get(n.id, ())):
            new[n.id] = base
        else:
            graph.nodes[i] = Node(n.id, "op", "broadcast_to", [base], {"shape": n.shape},
                                  n.shape, n.dtype)
            new[n.id] = graph.nodes[i]
    if new:
        graph.nodes = [n for n in graph.nodes if new.get(n.id, n) is n]
        for n in graph.nodes:
            n.inputs = [resolve(a) for a in n.inputs]
        graph.outputs = [resolve(o) for o in graph.outputs]
    return graph


def bucket_start(*arrays, group):
    """Flatten a bucket's gradients into one buffer and issue its non-blocking all-reduce."""
    return group.all_reduce(np.concatenate([np.ravel(a) for a in arrays]), async_op=True)


def bucket_wait(work, shapes):
    """Complete a bucket's all-reduce: its gradients, as views of the result."""
    flat = work.wait()
    out, begin = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(flat[begin:begin + n].reshape(s))
        begin += n
    return tuple(out)


def bucket_part(parts, index):
    """One gradient of a completed bucket."""
    return parts[index]


def bucket_all_reduces(graph: Graph) -> Graph:
    """Merge all-reduces (P(sum) -> R on one mesh dim) whose results are first used only after
    the last of them was issued: the gradient all-reduces of data parallelism, one per
    parameter in eager, become one per ~25 MB. Activation all-reduces, used right away, stay.

    Scheduling: a bucket starts (non-blocking) where its last gradient is ready and is waited
    for just before the first node that reads one of its gradients."""
    first_use: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for a in n.inputs:
            if isinstance(a, Node) and a.id not in first_use:
                first_use[a.id] = i
    buckets, cur, key, deadline, size = [], [], None, 0, 0
    for i, n in enumerate(graph.nodes):
        m = _all_reduce_dim(n)
        if m is None:
            continue
        k = (n.specs[1].mesh, m, n.dtype)
        nbytes = int(np.prod(n.shape)) * n.dtype.itemsize
        if cur and (k != key or i >= deadline or size + nbytes > BUCKET_BYTES):
            buckets.append(cur)
            cur = []
        if not cur:
            key, deadline, size = k, len(graph.nodes), 0
        cur.append((i, n))
        size += nbytes
        deadline = min(deadline, first_use.get(n.id, len(graph.nodes)))
    if cur:
        buckets.append(cur)
    at: dict[int, list[Node]] = {}  # node index -> nodes to put just before it
    drop = set()
    end = len(graph.nodes)
    for b in buckets:
        if len(b) < 2:
            continue
        members = [n for _, n in b]
        start = Node(graph._next, "comm", "all_reduce_bucket", [n.inputs[0] for n in members],
                     {"mesh_dim": _all_reduce_dim(members[0])}, (), members[0].dtype,
                     specs=((), members[0].specs[1]))
        wait = Node(graph._next + 1, "op", "wait", [start],
                    {"shapes": tuple(n.shape for n in members)}, (), members[0].dtype)
        graph._next += 2
        for j, n in enumerate(members):  # each member now reads its part of the bucket
            n.kind, n.name, n.inputs, n.params = "op", "bucket_part", [wait], {"index": j}
        first = min([first_use.get(n.id, end) for n in members] + [end])
        drop.update(i for i, _ in b)
        at.setdefault(b[-1][0] + 1, []).append(start)
        at.setdefault(max(first, b[-1][0] + 1), []).extend([wait] + members)
    if at:
        nodes = []
        for i, n in enumerate(graph.nodes + [None]):
            nodes.extend(at.get(i, ()))
            if n is not None and i not in drop:
                nodes.append(n)
        graph.nodes = nodes
    return graph
