"""Sharding propagation: per-op rules for ONE mesh dim, expanded to N-d meshes by the engine.

A rule maps input avals (and params) to candidate strategies ``(input placements, output
placement)``; the engine adds the Partial strategies an op's ``linearity`` allows, prices every
candidate by the bytes its input redistributions move (redistribute.transition_cost), and keeps
the cheapest, first listed on ties. Rules list "stay sharded" candidates first, so ties keep
data where it is; a candidate that would shard an input along a dim no input is already sharded
on is not considered (ops follow their inputs' layout, as in PyTorch). Results are cached on
(op, input specs, params).

A reduction or contraction over a sharded dim gives Partial. An op may name a template input
(``meta["template"]``: the weight whose gradient index_add builds, the input whose gradient
scatter_add builds): only its shape is read, it never moves, and the result takes its layout.
An op without a rule raises NotImplementedError naming the op and the placements.

Rules speak of Shard. For a StridedShard input (``S(d)/k``: k parts of dim d, each split), a
candidate that would keep it as Shard(d), on an op that carries dims through in order
(``_CARRIES``), keeps it strided and makes its other shards ``S(e)/k`` alike, where dim e keeps
the size of dim d. Slicing one whole part out of a strided dim gives that part as Shard (getitem),
and writing a Shard part into its place gives the strided whole (slice_scatter, the vjp).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard
from dtensor.redistribute import transition_cost

__all__ = ["Strategy", "propagate", "RULES"]

R = Replicate()
_LINEAR_REDUCE = ("sum", "avg")


def _is_scalar(a) -> bool:
    return isinstance(a, (int, float, bool))


# ----------------------------------------------------------------------------- rules
# rule(avals, params, out, op, current, pieces) -> [(ins, out_placement)], ins aligned with the
# args (None = scalar). ``current``: the args' placements on this mesh dim; ``pieces``: how many
# pieces the first input's sharded dim is cut into, over every mesh dim that shards it (for
# divisibility tests). Most rules need neither.


def _pointwise(avals, params, out, *_):
    nd = len(out.shape)
    cands = []
    for d in range(nd):
        ins = []
        for a in avals:
            if _is_scalar(a):
                ins.append(None)
                continue
            ad = d - (nd - len(a.shape))
            ins.append(R if ad < 0 or a.shape[ad] != out.shape[d] else Shard(ad))
        cands.append((ins, Shard(d)))
    return cands + [([None if _is_scalar(a) else R for a in avals], R)]


def _reduce(avals, params, out, op, current, pieces):
    (x,), axis, keep = avals, params["axis"], params["keepdims"]
    cands = []
    for d in range(len(x.shape)):
        if d in axis:
            cands.append(([Shard(d)], Partial(op.name)))  # sum -> P(sum), max -> P(max)
        else:
            cands.append(([Shard(d)], Shard(d if keep else d - sum(1 for a in axis if a < d))))
    if op.name == "max" and current[0] == Partial("max"):  # a max of maxes
        cands.append(([Partial("max")], Partial("max")))
    return cands + [([R], R)]


def _factory(avals, params, out, op, current, pieces):
    # The template input carries no data: the result takes its layout as it is.
    p = current[0]
    return [([p], R if isinstance(p, Partial) else p)]


def _matmul(avals, params, out, *_):
    x, y = avals
    nx, ny, no = len(x.shape), len(y.shape), len(out.shape)
    cands = []
    for b in range(no - 2):  # batch dims, aligned from the right
        bx, by = b - (no - nx), b - (no - ny)
        ix = Shard(bx) if bx >= 0 and x.shape[bx] == out.shape[b] else R
        iy = Shard(by) if by >= 0 and y.shape[by] == out.shape[b] else R
        cands.append(([ix, iy], Shard(b)))
    cands += [([Shard(nx - 2), R], Shard(no - 2)), ([R, Shard(ny - 1)], Shard(no - 1)),
              ([Shard(nx - 1), Shard(ny - 2)], Partial("sum")), ([R, R], R)]
    return cands


def _reshape_groups(src, dst):
    """Pair up runs of dims whose sizes multiply to the same number: [(src dims, dst dims)]."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        gi, gj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        groups.append((gi, gj))
    if groups:  # trailing size-1 dims join the last group
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


def _reshape(avals, params, out, op, current, mesh_size):
    (x,), shape = avals, params["shape"]
    cands = []
    if 0 not in x.shape and 0 not in shape:
        for gi, gj in _reshape_groups(x.shape, shape):
            d = next((k for k in gi if x.shape[k] != 1), None)
            j = next((k for k in gj if shape[k] != 1), None)
            if d is None or j is None:
                continue
            # A dim that only gains or loses size-1 neighbours keeps its exact layout; a merge or
            # split keeps it when both outermost sizes divide evenly over the mesh dim.
            same = x.shape[d] == shape[j] == int(np.prod([x.shape[k] for k in gi]))
            if same or (x.shape[d] % mesh_size == 0 and shape[j] % mesh_size == 0):
                cands.append(([Shard(d)], Shard(j)))
    current = current[0]
    if isinstance(current, Shard) and [current] not in [c[0] for c in cands]:
        raise ValueError(
            f"reshape {tuple(x.shape)} -> {tuple(shape)} cannot keep tensor dim {current.dim} "
            f"sharded ({current}) over a mesh dim of size {mesh_size} without moving data: the "
            f"sharded dim must be the outermost of the dims it is merged with or split into, "
            f"and both sizes must divide by {mesh_size}. Redistribute first, e.g. "
            f"x.redistribute(mesh, [Replicate()]), or shard another dim.")
    return cands + [([R], R)]


def _permute(avals, params, out, *_):
    axes = params["axes"]
    return [([Shard(d)], Shard(axes.index(d))) for d in range(len(axes))] + [([R], R)]


def _broadcast(avals, params, out, *_):
    (x,), shape = avals, params["shape"]
    lead = len(shape) - len(x.shape)
    return [([Shard(d)], Shard(d + lead)) for d in range(len(x.shape))
            if x.shape[d] == shape[d + lead]] + [([R], R)]


def _key_positions(key, ndim):
    """For a canonical index: output position of each input dim (None if indexed by an int)."""
    pos, out_d, in_d = [None] * ndim, 0, 0
    for k in key:
        if k is None:
            out_d += 1
        elif isinstance(k, tuple):
            pos[in_d] = out_d
            in_d, out_d = in_d + 1, out_d + 1
        else:
            in_d += 1
    return pos


def _full(k, n) -> bool:
    return isinstance(k, tuple) and tuple(k) == (0, n, 1)


def part_of(k, n) -> int:
    """How many equal parts of a dim of ``n`` the slice ``k`` is one whole part of (0: none)."""
    if not isinstance(k, tuple) or k[2] != 1 or not 0 < k[1] - k[0] < n:
        return 0
    size = k[1] - k[0]
    return n // size if n % size == 0 and k[0] % size == 0 else 0


def _getitem(avals, params, out, op, current, pieces):
    (x,), key = avals, params["key"]
    real = [k for k in key if k is not None]
    pos = _key_positions(key, len(x.shape))
    cands = [([Shard(d)], Shard(pos[d])) for d in range(len(x.shape))
             if _full(real[d], x.shape[d])]
    p = current[0]
    if isinstance(p, StridedShard) and pos[p.dim] is not None \
            and part_of(real[p.dim], x.shape[p.dim]) == p.parts:
        cands.insert(0, ([p], Shard(pos[p.dim])))  # one part: the rank holds its shard of it
    return cands + [([R], R)]


def _slice_scatter(avals, params, out, op, current, pieces):
    shape, key = params["shape"], params["key"]
    real = [k for k in key if k is not None]
    pos = _key_positions(key, len(shape))
    cands = [([Shard(pos[d])], Shard(d)) for d in range(len(shape))
             if _full(real[d], shape[d])]
    for d in range(len(shape)):  # a Shard part put back in its place: the strided whole
        k = part_of(real[d], shape[d])
        if k and pos[d] is not None and current[0] == Shard(pos[d]):
            cands.insert(0, ([Shard(pos[d])], StridedShard(d, k)))
    return cands + [([R], R)]


def _cat(avals, params, out, *_):
    axis = params["axis"]
    return [([Shard(d)] * len(avals), Shard(d)) for d in range(len(out.shape)) if d != axis] + [
        ([R] * len(avals), R)]


def _along(avals, params, out, *_):
    # Ops along one dim (argmax, cumsum): every result there reads the whole
    # dim, so it stays whole (a shard of it is gathered); the other dims keep their shards, one
    # lower past a dim argmax drops.
    x, axis = avals[0], params["axis"]
    drop = len(out.shape) < len(x.shape)
    return [([Shard(d)], Shard(d - 1 if drop and d > axis else d))
            for d in range(len(x.shape)) if d != axis] + [([R], R)]


def _repeat(avals, params, out, op, current, pieces):
    # repeat_interleave: a dim split evenly stays sharded along the repeats (each rank repeats
    # its own entries, which is its block of the result); other dims keep their shards.
    x, axis = avals[0], params["axis"]
    cands = [([Shard(d)], Shard(d)) for d in range(len(x.shape)) if d != axis]
    if x.shape[axis] % pieces == 0:
        cands.insert(0, ([Shard(axis)], Shard(axis)))
    return cands + [([R], R)]


def _group_sum(avals, params, out, op, current, pieces):
    # repeat_interleave's adjoint: a shard of whole groups stays sharded; a shard that cuts
    # groups sums what it holds into the groups it touches, a Partial sum.
    g, axis = avals[0], params["axis"]
    cands = [([Shard(d)], Shard(d)) for d in range(len(g.shape)) if d != axis]
    cands.insert(0, ([Shard(axis)], Shard(axis) if out.shape[axis] % pieces == 0 else
                     Partial("sum")))
    return cands + [([R], R)]


def _matrix(avals, params, out, *_):
    # Ops on the trailing matrix as a whole (tril, triu): its two dims stay whole, the batch
    # dims keep their shards.
    return [([Shard(d)], Shard(d)) for d in range(len(out.shape) - 2)] + [([R], R)]


def _attention(avals, params, out, *_):
    # Attention and its stacked backward read whole (L, E) matrices of each head: the batch and
    # head dims keep their shards (one lower in the backward's (3, ...) result), the last two
    # stay whole.
    n, lead = len(avals), len(out.shape) - len(avals[-1].shape)
    return [([Shard(d)] * n, Shard(d + lead)) for d in range(len(avals[-1].shape) - 2)] + [
        ([R] * n, R)]


def _index_select(avals, params, out, *_):
    w, idx = avals
    ni = len(idx.shape)
    return ([([R, Shard(d)], Shard(d)) for d in range(ni)]
            + [([Shard(j), R], Shard(ni + j - 1)) for j in range(1, len(w.shape))]
            + [([Shard(0), R], Partial("sum")), ([R, R], R)])


def _index_add(avals, params, out, op, current, pieces):
    # The template (the forward's weight) never moves; the gradient takes its layout where the
    # rows allow it. A vocab-parallel weight (Shard(0)) gets its rows summed where they live.
    g, idx, like = avals
    ni, t = len(idx.shape), current[2]
    if isinstance(t, Shard) and t.dim == 0:
        return [([R, R, t], t)]
    if isinstance(t, Shard):  # a feature dim j of the weight is g's dim ni + j - 1
        return [([Shard(ni + t.dim - 1), R, t], t), ([R, R, t], R)]
    return ([([Shard(d), Shard(d), t], Partial("sum")) for d in range(ni)]
            + [([Shard(d), R, t], Shard(d - ni + 1)) for d in range(ni, len(g.shape))]
            + [([R, R, t], R)])


def _gather(avals, params, out, *_):
    x, idx = avals
    axis = params["axis"]
    return ([([Shard(d), Shard(d)], Shard(d)) for d in range(len(x.shape)) if d != axis]
            + [([Shard(axis), R], Partial("sum")), ([R, R], R)])


def _scatter_add(avals, params, out, op, current, pieces):
    # As index_add: the template (the gather's input) never moves and lends its layout.
    g, idx, like = avals
    axis, t = params["axis"] % len(g.shape), current[2]
    if t == Shard(axis):  # vocab-parallel cross-entropy: each rank fills the columns it holds
        return [([R, R, t], t)]
    if isinstance(t, Shard):
        return [([t, t, t], t), ([R, R, t], R)]
    return ([([Shard(d), Shard(d), t], Shard(d)) for d in range(len(g.shape)) if d != axis]
            + [([R, R, t], R)])


def _rowwise(avals, params, out, *_):
    # Ops along the last dim of their widest input (softmax, layer norm, cross-entropy against
    # per-row targets): the row dims shard alike on every input and the output; the last dim
    # (and, causal, the one before it) stays whole.
    free = max(len(a.shape) for a in avals) - (2 if params.get("causal") else 1)
    return [([Shard(d)] * len(avals), Shard(d)) for d in range(free)] + [([R] * len(avals), R)]


def _row_reduce(avals, params, out, *_):
    # A reduction over the last dim of the first input whose other inputs hold one value per
    # row ((..., 1) columns; sum_exp): the row dims shard alike; with the last dim sharded each
    # rank reduces its block, a Partial(sum) of the whole row's, the per-row inputs whole.
    free, rest = len(avals[0].shape) - 1, len(avals) - 1
    return ([([Shard(d)] * len(avals), Shard(d)) for d in range(free)]
            + [([Shard(free)] + [R] * rest, Partial("sum")), ([R] * len(avals), R)])


def _pointwise_stacked(avals, params, out, *_):
    nd = len(avals[0].shape)
    return [([Shard(d)] * len(avals), Shard(d + 1)) for d in range(nd)] + [([R] * len(avals), R)]


RULES = {
    "pointwise": _pointwise, "matmul": _matmul, "reshape": _reshape, "permute": _permute,
    "broadcast": _broadcast, "getitem": _getitem, "slice_scatter": _slice_scatter, "cat": _cat,
    "index_select": _index_select, "index_add": _index_add, "gather": _gather,
    "scatter_add": _scatter_add, "rowwise": _rowwise, "row_reduce": _row_reduce,
    "pointwise_stacked": _pointwise_stacked, "reduce": _reduce, "factory": _factory,
    "along": _along, "matrix": _matrix, "attention": _attention, "repeat": _repeat,
    "group_sum": _group_sum,
}


# ----------------------------------------------------------------------------- engine

def _linear_candidates(op, avals, current):
    """Partial strategies that the op's linearity allows, for the reduce ops present."""
    lin = op.linearity
    if lin == "none":
        return []
    present = {p.reduce_op for p in current if isinstance(p, Partial)} & set(_LINEAR_REDUCE)
    diff = [k for k, a in enumerate(avals) if not _is_scalar(a) and k not in op.nondiff]
    cands = []
    for r in sorted(present):
        P = Partial(r)
        base = [None if _is_scalar(a) else R for a in avals]
        if lin == "all":
            # Jointly linear: every tensor input partial; a non-zero constant would be added
            # once per rank, so only zero constants may join.
            if any(_is_scalar(a) and a != 0 and k not in op.nondiff for k, a in enumerate(avals)):
                continue
            cands.append(([P if k in diff else b for k, b in enumerate(base)], P))
        else:
            for k in (diff if lin == "one" else [k for k in lin if k in diff]):
                ins = list(base)
                ins[k] = P
                cands.append((ins, P))
    return cands


# Rules whose Shard(d) -> Shard(e) candidates carry dim d's entries to dim e in order, so a
# strided layout survives them. The index rules read a shard's offset and are not among them.
_CARRIES = {"pointwise", "matmul", "reshape", "permute", "broadcast", "getitem", "slice_scatter",
            "cat", "reduce", "rowwise", "pointwise_stacked", "along", "matrix", "factory",
            "attention"}


def _strided(cands, avals, out, current):
    """A rule's candidates for StridedShard inputs: one that asks for a strided input as
    Shard of its dim has every Shard in it made strided alike where the dim keeps its size, and
    is dropped where it would not (a reshape splitting the dim: a gather to Replicate remains)."""
    keep = []
    for ins, o in cands:
        carried = [c for c, need in zip(current, ins)
                   if isinstance(c, StridedShard) and need == Shard(c.dim)]
        if not carried:
            keep.append((ins, o))
            continue
        c = carried[0]
        size = next(a.shape[c.dim] for a, p in zip(avals, current) if p == c)

        def strided(p, shape):
            return StridedShard(p.dim, c.parts) if isinstance(p, Shard) and \
                shape[p.dim] == size else p

        new_ins = [need if need is None else strided(need, a.shape) for need, a in zip(ins, avals)]
        new_o = strided(o, out.shape)
        if any(isinstance(p, Shard) for p in new_ins + [new_o]):
            continue
        keep.append((new_ins, new_o))
    return keep


def _candidates(op, avals, params, out, current, mesh_size):
    """Candidates on one mesh dim. ``mesh_size`` is the number of pieces the first input's
    sharded dim is cut into (the product over every mesh dim sharding that tensor dim)."""
    rule = RULES.get(op.shard)
    if rule is None:
        raise NotImplementedError(
            f"op {op.name!r} has no sharding rule (shard={op.shard!r}); inputs are "
            f"{[c for c in current]}. Add a rule to dtensor/sharding.py or call it on "
            f"full tensors (dt.full_tensor()).")
    cands = rule(avals, params, out, op, current, mesh_size)
    if op.shard in _CARRIES and any(isinstance(c, StridedShard) for c in current):
        cands = _strided(cands, avals, out, current)
    return cands + _linear_candidates(op, avals, current)


@dataclass(frozen=True)
class Strategy:
    """Where each DTensor input must be (None for scalars) and the output's placements."""

    inputs: tuple[tuple[Placement, ...] | None, ...]
    out: tuple[Placement, ...]


def propagate(op, avals, params, placements, out, mesh) -> Strategy:
    """Choose input and output placements for ``op`` on every mesh dim (greedy, in order).

    Args:
        avals: global Aval per arg, or the Python scalar itself.
        placements: each arg's current placements (None for scalars).
        out: the op's output Aval (global).
    """
    nbytes = [0 if _is_scalar(a) else int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
              for a in avals]
    ins = [None if p is None else [None] * mesh.ndim for p in placements]
    outp = []
    for m in range(mesh.ndim):
        n = mesh.shape[m]
        current = [None if p is None else p[m] for p in placements]
        # A dim sharded over several mesh dims is cut into the product of their sizes: what a
        # rule's divisibility test (reshape, repeat_interleave, group_sum) must see.
        pieces = n
        if isinstance(current[0], Shard):
            pieces = int(np.prod([mesh.shape[k] for k, p in enumerate(placements[0])
                                  if p == current[0]]))
        best, best_cost = None, (float("inf"), 0)
        template = op.meta.get("template")
        try:
            cands = _candidates(op, avals, params, out, current, pieces)
        except ValueError:  # a layout the rule cannot keep (reshape's refusal)
            if n > 1:
                raise
            cands = []
        for cand_in, cand_out in cands:
            if template is not None and cand_in[template] != current[template]:
                continue  # a template carries no data to move (a linear candidate's R)
            # (bytes moved, inputs that change placement): free re-layouts (R -> S) lose ties
            # to keeping every input where it is.
            moved, changed, follows, introduces = 0.0, 0, False, False
            for k, need in enumerate(cand_in):
                if need is None or current[k] is None:
                    continue
                if need != current[k]:
                    moved += transition_cost(current[k], need, nbytes[k], n)
                    changed += 1
                    introduces |= isinstance(need, (Shard, StridedShard))
                elif isinstance(need, (Shard, StridedShard)):
                    follows = True
            # Ops follow their inputs' shards: a shard no input has is never invented (so a
            # Partial feeding a nonlinear op is all-reduced, not silently scattered).
            if introduces and not follows:
                continue
            if (moved, changed) < best_cost:
                best, best_cost = (cand_in, cand_out), (moved, changed)
        if n == 1 and (best is None or best_cost[1] > 0):
            # One rank holds the whole extent along this mesh dim: Shard, Partial and Replicate
            # are the same data there. Where the rule cannot keep the inputs as they are (a
            # reshape (1, T, C) -> (T, C) of a batch of one "sharded" over dp=1), nothing moves
            # and the result is replicated; otherwise the rule's layout is kept (an optimizer's
            # state keeps its parameter's placements).
            best = (list(current), R)
        if best is None:
            raise NotImplementedError(
                f"op {op.name!r}: no sharding strategy for inputs {current} on mesh dim {m}.")
        for k, need in enumerate(best[0]):
            if ins[k] is not None:
                ins[k][m] = need if need is not None else current[k]
        outp.append(best[1])
    return Strategy(tuple(None if i is None else tuple(i) for i in ins), tuple(outp))
