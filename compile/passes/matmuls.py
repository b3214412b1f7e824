"""Sibling matmuls as one GEMM (XLA's DotMerger): Linear layers that read the same input
(attention's q, k and v projections) multiply it by their weights side by side, and in the
backward their input gradients (summed) and their weight gradients are each one GEMM over the
output gradients side by side.

    q = x @ Wq^T, k = x @ Wk^T, v = x @ Wv^T   ->   [q k v] = x @ [Wq; Wk; Wv]^T
    dx = dq Wq + dk Wk + dv Wv                 ->   dx = [dq dk dv] @ [Wq; Wk; Wv]
    dWq = dq^T x, dWk = dk^T x, dWv = dv^T x   ->   [dWq; dWk; dWv] = [dq dk dv]^T x

One GEMM of N = 384 beats three of N = 128 at the standard GPT's shapes (x read once, one
call's packing and set-up; benchmarks/gpt_step.py: ~2% of the TP=2 step on an AVX-512 Xeon),
at the cost of copying the weights (and in the backward the output gradients) side by side.
The projections are then column blocks of one result (with their biases side by side added
once), views whose rows are the merged width apart: merged only where every reader takes such
a block as it lies (a GEMM, attention). The input gradient's sum runs inside one GEMM
instead of two adds: the same terms, summed in another order (equal to float32 rounding).
"""
from __future__ import annotations

import math

from dtensor.compile.passes.simplify import dce
from dtensor.graph import Graph, Node
from dtensor.ops.registry import OPS


def _is(n, name: str) -> bool:
    return isinstance(n, Node) and n.kind == "op" and n.name == name and n.variant == "impl"


def _transposed(n) -> Node | None:
    """``n``'s input when ``n`` transposes a matrix, else None."""
    if (_is(n, "permute") and tuple(n.params["axes"]) == (1, 0)
            and isinstance(n.inputs[0], Node)):
        return n.inputs[0]
    return None


def _linear(n) -> tuple | None:
    """(x, W, W^T) of ``n`` = x @ W^T (2-D, floating), else None."""
    if not (_is(n, "matmul") and len(n.shape) == 2 and n.dtype.kind == "f"):
        return None
    x, wt = n.inputs
    w = _transposed(wt)
    if not (isinstance(x, Node) and w is not None and len(x.shape) == 2 and len(w.shape) == 2
            and x.dtype == w.dtype == n.dtype):
        return None
    return x, w, wt


# Ops whose kernels take a row-major operand whose rows are further apart as it lies: BLAS
# (its leading dimension) and the attention kernels (each tensor's row stride). An element-wise
# kernel would first copy it, or numpy walk it slower (a Llama's rotary and SwiGLU: merged,
# its step was no faster, its GEMMs' 2.8 ms saved and spent again there).
_STRIDED_READERS = ("matmul", "attention")
_VIEWS = ("reshape", "permute")


def _readers(n, users) -> list:
    """The nodes that read ``n``'s value, through its views."""
    found = []
    for u in users.get(n.id, ()):
        found += _readers(u, users) if u.kind == "op" and u.name in _VIEWS else [u]
    return found


def _read_as_is(n, users) -> bool:
    """Whether every reader of ``n`` takes a strided operand as it lies."""
    return all(u.kind == "op" and u.name in OPS and OPS[u.name].shard in _STRIDED_READERS
               for u in _readers(n, users))


def _bias(mm, users) -> tuple:
    """(the Linear's result, its bias): ``mm + b`` with b one value per column when that add
    is mm's only reader (F.linear's bias), else (mm, None)."""
    readers = users.get(mm.id, ())
    add = readers[0] if len(readers) == 1 else None
    if _is(add, "add") and len(add.inputs) == 2 and add.shape == mm.shape:
        b = add.inputs[1] if add.inputs[0] is mm else add.inputs[0]
        if (isinstance(b, Node) and b is not mm and tuple(b.shape) == (mm.shape[1],)
                and b.dtype == mm.dtype):
            return add, b
    return mm, None


def _block(node, start: int, stop: int, axis: int) -> tuple:
    """getitem's key for [start, stop) along ``axis`` of a 2-D ``node``."""
    key = [(0, node.shape[0], 1), (0, node.shape[1], 1)]
    key[axis] = (start, stop, 1)
    return tuple(key)


def _sum_of(root, leaves: set, size: int) -> bool:
    """Whether ``root`` is an add tree (through reshapes) whose leaves are exactly ``leaves``
    (node ids), each reached once, every value in it ``size`` elements (no add broadcasts):
    the sum its value is."""
    seen = []

    def walk(n, inner: bool) -> bool:
        if math.prod(n.shape) != size:
            return False
        if n.id in leaves:
            seen.append(n.id)
            return True
        if inner and _is(n, "reshape") and isinstance(n.inputs[0], Node):
            return walk(n.inputs[0], True)
        return (_is(n, "add") and len(n.inputs) == 2
                and all(isinstance(a, Node) and walk(a, True) for a in n.inputs))
    return walk(root, False) and sorted(seen) == sorted(leaves)


def merge_matmuls(graph: Graph) -> Graph:
    """Merge each run of at least two ``x @ W^T`` (``+ b``) with the same x that all run before
    any of them is read (whose weights and biases exist where the run's first matmul runs),
    then their input and weight gradients where the backward holds them whole: ``g_i @ W_i``
    summed by element-wise adds and nothing else, and ``g_i^T @ x``."""
    original = list(graph.nodes)  # Graph.new appends the merged nodes; placed below
    index = {n.id: i for i, n in enumerate(original)}
    groups: dict = {}
    users = graph.users()
    for n in graph.nodes:
        found = _linear(n)
        if found is not None:
            x, w, _ = found
            out, b = _bias(n, users)
            if _read_as_is(out, users):  # biased or not, a group's members are all alike
                key = (x.id, w.shape[1], n.dtype.str, b is not None)
                groups.setdefault(key, []).append((n, w, out, b))
    replace: dict[int, Node] = {}  # old node id -> the node now computing its value
    after: dict[int, list[Node]] = {}  # node id -> new nodes placed right after it
    for members in (run for group in groups.values() for run in _runs(group, index, users)):
        first = index[members[0][0].id]
        members = [(n, w, out, b) for n, w, out, b in members
                   if all(index.get(a.id, -1) < first for a in (w, b) if a is not None)]
        if len(members) < 2:
            continue
        mms, ws, outs, bs = (list(column) for column in zip(*members))
        x = mms[0].inputs[0]
        sizes = [w.shape[0] for w in ws]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        width, mark = sum(sizes), len(graph.nodes)
        wcat = graph.new("op", "cat", ws, {"axis": 0}, (width, ws[0].shape[1]), x.dtype)
        wt = graph.new("op", "permute", [wcat], {"axes": (1, 0)}, wcat.shape[::-1], x.dtype)
        both = graph.new("op", "matmul", [x, wt], {}, (x.shape[0], width), x.dtype)
        if bs[0] is not None:  # the biases side by side, added once
            bcat = graph.new("op", "cat", bs, {"axis": 0}, (width,), x.dtype)
            both = graph.new("op", "add", [both, bcat], {}, both.shape, x.dtype)
        for out, start, size in zip(outs, starts, sizes):
            replace[out.id] = graph.new("op", "getitem", [both], {
                "key": _block(both, start, start + size, 1)}, out.shape, x.dtype)
        after.setdefault(original[first - 1].id if first else -1, []).extend(graph.nodes[mark:])
        _merge_backward(graph, mms, x, wcat, starts, sizes, index, users, replace, after)
    if not replace:
        return graph
    nodes = after.get(-1, [])
    for n in original:
        nodes.append(n)
        nodes.extend(after.get(n.id, ()))
    for n in nodes:
        n.inputs = [replace.get(a.id, a) if isinstance(a, Node) else a for a in n.inputs]
    graph.outputs = [replace.get(o.id, o) if isinstance(o, Node) else o for o in graph.outputs]
    graph.nodes = _in_order(graph, [n for n in nodes if n.id not in replace])
    return dce(graph)


def _runs(members, index, users) -> list:
    """A group's members cut into runs of siblings that all run before any of them is read
    (a layer's q, k and v), so that one merged GEMM does not hold a value read early (one
    layer's) until a later member's reader (another layer's)."""
    runs, limit = [], -1
    for m in members:
        if index[m[0].id] > limit:
            runs.append([])
            limit = len(index)
        runs[-1].append(m)
        limit = min([limit] + [index[u.id] for u in _readers(m[2], users)])
    return runs


def _merge_backward(graph, mms, x, wcat, starts, sizes, index, users, replace, after) -> None:
    """The backward of a merged group: for each matmul ``x @ W_i^T`` (``W_i^T`` the node wt_i),
    its output gradient g_i reaches ``g_i @ wt_i^T`` (into x's gradient) and ``g_i^T @ x``
    (W_i's). Merged when every g_i has both and the first kind are summed by adds alone."""
    wts = [mm.inputs[1] for mm in mms]
    dx, dw, grads = [], [], []
    for wt in wts:
        back = [u for u in users.get(wt.id, ()) if _transposed(u) is wt]
        uses = [m for b in back for m in users.get(b.id, ()) if _is(m, "matmul")
                and m.inputs[1] is b and len(m.shape) == 2]
        if len(uses) != 1:
            return
        g = uses[0].inputs[0]
        if not isinstance(g, Node):
            return
        w_uses = [m for t in users.get(g.id, ()) if _transposed(t) is g
                  for m in users.get(t.id, ()) if _is(m, "matmul") and m.inputs[0] is t
                  and m.inputs[1] is x]
        if len(w_uses) != 1:
            return
        dx.append(uses[0])
        dw.append(w_uses[0])
        grads.append(g)
    leaves = {d.id for d in dx}
    roots = {u.id: u for d in dx for u in _adds_above(d, users)}
    size = math.prod(dx[0].shape)
    root = next((r for r in roots.values() if _sum_of(r, leaves, size)), None)
    if root is None or any(g.id not in index for g in grads):  # (a gradient fed in: left)
        return
    last = max(grads, key=lambda g: index[g.id])
    rows, width, mark = grads[0].shape[0], sum(sizes), len(graph.nodes)
    gcat = graph.new("op", "cat", grads, {"axis": 1}, (rows, width), x.dtype)
    dx_all = graph.new("op", "matmul", [gcat, wcat], {}, (rows, wcat.shape[1]), x.dtype)
    replace[root.id] = graph.new("op", "reshape", [dx_all], {"shape": tuple(root.shape)},
                                 root.shape, x.dtype)
    gt = graph.new("op", "permute", [gcat], {"axes": (1, 0)}, (width, rows), x.dtype)
    dw_all = graph.new("op", "matmul", [gt, x], {}, (width, x.shape[1]), x.dtype)
    for m, start, size in zip(dw, starts, sizes):
        replace[m.id] = graph.new("op", "getitem", [dw_all], {
            "key": _block(dw_all, start, start + size, 0)}, m.shape, x.dtype)
    after.setdefault(last.id, []).extend(graph.nodes[mark:])


def _adds_above(n, users) -> list:
    """The adds that read ``n``, through reshapes and other adds."""
    found, stack = [], [n]
    while stack:
        for u in users.get(stack.pop().id, ()):
            if _is(u, "add") or _is(u, "reshape"):
                if _is(u, "add"):
                    found.append(u)
                stack.append(u)
    return found


def _in_order(graph: Graph, nodes: list) -> list:
    """``nodes`` in their order, each moved after its inputs where a merge put an input later
    (a view of a weight gradient now cut from a GEMM that runs after it)."""
    done = {n.id for n in graph.inputs}
    waiting: dict[int, list[Node]] = {}
    out: list[Node] = []

    def missing(n):
        return next((a.id for a in n.inputs if isinstance(a, Node) and a.id not in done), None)

    def emit(n):
        stack = [n]
        while stack:
            m = stack.pop()
            need = missing(m)
            if need is not None:
                waiting.setdefault(need, []).append(m)
                continue
            out.append(m)
            done.add(m.id)
            stack.extend(reversed(waiting.pop(m.id, [])))
    for n in nodes:
        emit(n)
    assert not waiting, "merge_matmuls: a node's input is never computed"
    return out
