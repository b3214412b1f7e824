"""Static memory plan: results of out= capable nodes (ufuncs, matmul) go to preallocated
buffers, placed in one arena of bytes and reused across nodes and calls when their values are
dead.

A buffer is busy from the node that writes it to the last use of its value or of any view of
it (reshape, permute, getitem, broadcast_to, a collective that may hand its input back, a
bucket part); values the graph returns never get one, because they outlive the call. Buffers
are placed by liveness, not by shape: a dead value's bytes serve the next value of any shape
(best fit, freed neighbours merged), so the arena is about the most bytes live at once, as
eager's allocator holds, not one pool per shape. An element-wise result goes over an input
that dies there (``_dying_input``), whose lines are still in cache.
"""
from __future__ import annotations


import numpy as np

from dtensor.compile.kernels import address, elementwise
from dtensor.graph import KERNEL_KINDS, Graph, Node

# Ops whose result may share memory with their (first) input.
VIEW_OPS = frozenset({"reshape", "permute", "getitem", "broadcast_to", "bucket_part", "wait",
                      "adamw_part", "add_at"})


def _out_capable(n: Node) -> bool:
    if n.kind not in ("op", *KERNEL_KINDS) or n.dtype is None or n.dtype.kind not in "fiub":
        return False
    if n.kind in KERNEL_KINDS or n.name in ("fused", "fused_rows"):
        return True
    if n.name == "matmul" and n.variant == "impl":
        return len(n.shape) >= 2
    from dtensor.compile.numpy_backend import runner
    fn = runner(n, {})
    if getattr(fn, "accepts_out", False):
        return True
    if isinstance(fn, np.ufunc) and fn.nout == 1:
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
    users = graph.users()
    arena = _Arena()
    busy: list[tuple[int, int, int]] = []  # (end index, offset, bytes)
    graph.buffers = []
    for i, n in enumerate(graph.nodes):
        still = []
        for e, off, size in busy:  # a buffer whose last reader ran before node i is free again
            (arena.free(off, size) if e < i else still.append((e, off, size)))
        busy = still
        if n.name == "adamw_group" and _updates_in_place(n, i, index, users):
            n.params["in_place"] = True
        if n.name == "add_at":  # its input's buffer is its own: nothing else reads it
            n.params["in_place"] = n.inputs[0].buffer is not None
        if n.id in escaping or not _out_capable(n):
            continue
        heir = _dying_input(n, i, end, escaping, root)
        if heir is not None:  # written over element by element: its bytes become n's
            at = graph.buffers[heir.buffer][2]
            n.buffer = len(graph.buffers)
            graph.buffers.append((tuple(n.shape), n.dtype, at))
            busy = [(max(e, end[n.id]) if off == at else e, off, size) for e, off, size in busy]
            continue
        size = -(-max(1, int(np.prod(n.shape)) * n.dtype.itemsize) // _ALIGN) * _ALIGN
        off = arena.take(size)
        n.buffer = len(graph.buffers)
        graph.buffers.append((tuple(n.shape), n.dtype, off))
        busy.append((end[n.id], off, size))
    graph.arena_bytes = arena.top
    _donate_to_collectives(graph)
    return graph


def _dying_input(n: Node, i: int, end: dict, escaping: set, root: dict) -> Node | None:
    """An input of element-wise node ``n`` (node ``i``) whose buffer ``n`` may write its
    result into: one of the same size and dtype, read last by ``n``, itself or through
    reshapes and all-reduces of it. Its lines are in cache, just written or read, where a
    free buffer's are likely not, and a store to a line not in cache first reads it from
    memory. Element-wise: result element k reads only element k of each full-size input; a
    numpy ufunc, or a kernel of pointwise ops (the C renderer drops ``restrict`` there). No
    other input may read that buffer (``y + y[0:1]``: row 0 would be overwritten before the
    later rows read it)."""
    from dtensor.compile.numpy_backend import runner
    if n.kind in KERNEL_KINDS:
        if not elementwise(n):
            return None
    elif not (n.kind == "op" and isinstance(runner(n, {}), np.ufunc)):
        return None
    size = int(np.prod(n.shape))
    inputs = [x for x in n.inputs if isinstance(x, Node)]
    for x in inputs:
        a = x
        while a.buffer is None and a.inputs and isinstance(a.inputs[0], Node) and (
                (a.name == "reshape" and a.variant == "impl")
                or (a.kind == "comm" and a.name == "all_reduce")):
            a = a.inputs[0]  # the same elements in the same order: its buffer's
        if (a.buffer is not None and end.get(a.id) == i and a.id not in escaping
                and int(np.prod(a.shape)) == size and a.dtype == n.dtype
                and all(y is x or root.get(y.id, y.id) != a.id for y in inputs)):
            return a
    return None


def _updates_in_place(n: Node, i: int, index: dict, users: dict) -> bool:
    """Whether an adamw_group may write over its parameter and moment inputs: no node reads
    them after it. Its result's parts become the parameters and moments, so from the second
    step on they are views of the last result, which the group then updates in place
    (numpy_backend.update_target) instead of making a fresh copy of every parameter and
    moment each step."""
    state = [a for j, a in enumerate(n.inputs) if j % 4 != 1 and isinstance(a, Node)]
    return (all(a.kind == "input" for a in state)
            and all(index[u.id] <= i for a in state for u in users.get(a.id, ())))


_ALIGN = 64  # a cache line: every buffer starts on one (the arena starts on a page)
_PAGE = 4096


def arena_buffers(graph: Graph) -> list[np.ndarray]:
    """The plan's buffers, in an arena allocated to start on a page, so that every buffer
    (at a multiple of 64 bytes in it) starts on a cache line: numpy's allocation is only
    16-byte aligned (malloc's), and a buffer off a line has every vector straddle two
    (benchmarks/gpt_step.py)."""
    raw = np.empty(graph.arena_bytes + _PAGE, np.uint8)
    start = -address(raw) % _PAGE
    arena = raw[start:start + graph.arena_bytes]
    return [np.ndarray(shape, dtype, buffer=arena, offset=off)
            for shape, dtype, off in graph.buffers]


class _Arena:
    """Offsets in one block of bytes: best-fit among the free ranges, else the top grows (into
    a free range that ends there)."""

    def __init__(self):
        self.top = 0
        self.holes: list[list[int]] = []  # [offset, bytes], by offset, never adjacent

    def take(self, size: int) -> int:
        fits = [h for h in self.holes if h[1] >= size]
        if fits:
            h = min(fits, key=lambda h: h[1])
            off = h[0]
            h[0], h[1] = h[0] + size, h[1] - size
            if not h[1]:
                self.holes.remove(h)
            return off
        if self.holes and sum(self.holes[-1]) == self.top:  # grow the free range at the top
            off = self.holes.pop()[0]
        else:
            off = self.top
        self.top = off + size
        return off

    def free(self, off: int, size: int) -> None:
        holes = self.holes
        k = next((j for j, h in enumerate(holes) if h[0] > off), len(holes))
        holes.insert(k, [off, size])
        if k + 1 < len(holes) and off + size == holes[k + 1][0]:  # merge with the next
            holes[k][1] += holes.pop(k + 1)[1]
        if k and sum(holes[k - 1]) == off:  # and with the previous
            holes[k - 1][1] += holes.pop(k)[1]


def _donate_to_collectives(graph: Graph) -> None:
    """A planned buffer whose only reader is an all-reduce (through views) is given to it: it
    then reduces in place, with no copy of the input into a separate result
    (benchmarks/collectives.py). The result keeps the buffer, whose lifetime the plan already
    extends over the collective's result (see ``root`` above). The producer does not write
    straight into the all-reduce's shared slot: the GEMM would then write the lines the peer
    read last, and pay for them what the copy into the slot does."""
    users = graph.users()
    for n in graph.nodes:
        a = n.inputs[0] if n.kind == "comm" and n.name == "all_reduce" else None
        while (isinstance(a, Node) and len(users.get(a.id, ())) == 1 and a.buffer is None
               and a.kind == "op" and a.name in VIEW_OPS):
            a = a.inputs[0]
        if isinstance(a, Node) and len(users.get(a.id, ())) == 1 and a.buffer is not None:
            n.params["donate"] = True
