"""Redistribute: move a DTensor's local data from one placement per mesh dim to another.

One transition per mesh dim, from a table (DESIGN 4):

    S(i) -> R      all_gather          P -> R      all_reduce
    S(i) -> S(j)   all_to_all          P -> S(i)   reduce_scatter
    R -> S(i)      local slice         R -> P      local (only inside sharding rules)

A StridedShard (``S(i)/k``: each of k parts of dim i split over the mesh dim) leaves by an
all_gather whose pieces are put back in part order, and is entered from Replicate by taking the
rank's piece of every part; its other transitions pass through Replicate.

Uneven shards use the v-collectives with exact sizes, so nothing is padded. Order matters when
several mesh dims shard one tensor dim (mesh dim 0 splits first): gathers run from the last
mesh dim to the first, slices from the first to the last.
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import NamedTuple

import numpy as np

from dtensor import observe
from dtensor.ops import registry
from dtensor.placements import (Partial, Placement, Replicate, Shard, StridedShard,
                                check_strided_alone, shard_size_and_offset, strided_indices)

__all__ = ["redistribute_local", "plan_redistribute", "run_step", "Step", "COLLECTIVES",
           "local_shape_and_offset", "local_indices", "index_runs", "local_pieces",
           "transition_cost", "dim_extent"]


def dim_extent(shape, placements, mesh_shape, coord, d: int, upto: int) -> int:
    """Length of tensor dim ``d`` on this rank after the splits of mesh dims < ``upto``."""
    n = shape[d]
    for m in range(upto):
        p = placements[m]
        if isinstance(p, Shard) and p.dim == d:
            n, _ = shard_size_and_offset(n, mesh_shape[m], coord[m])
    return n


def local_shape_and_offset(shape, placements, mesh_shape, coord):
    """This rank's block of a global ``shape``: (local shape, global offset per dim).

    A StridedShard dim's block is not one range: its offset is None (see local_indices)."""
    if any(isinstance(p, StridedShard) for p in placements):
        check_strided_alone(placements)
    size, off = list(shape), [0] * len(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            n, o = shard_size_and_offset(size[p.dim], mesh_shape[m], coord[m])
            size[p.dim], off[p.dim] = n, off[p.dim] + o
        elif isinstance(p, StridedShard):
            n, _ = shard_size_and_offset(size[p.dim] // p.parts, mesh_shape[m], coord[m])
            size[p.dim], off[p.dim] = n * p.parts, None
    return tuple(size), tuple(off)


def local_indices(shape, placements, mesh_shape, coord) -> list:
    """Per tensor dim, the global indices this rank's block holds, in local order: a slice for
    a range, an index array for a StridedShard dim."""
    size, off = local_shape_and_offset(shape, placements, mesh_shape, coord)
    out = [slice(o, o + n) if o is not None else None for n, o in zip(size, off)]
    for m, p in enumerate(placements):
        if isinstance(p, StridedShard):
            out[p.dim] = strided_indices(shape[p.dim], p.parts, mesh_shape[m], coord[m])
    return out


def index_runs(idx) -> list:
    """One dim of local_indices as runs of consecutive indices: [(local start, global start,
    length)]; an empty strided block has none."""
    if isinstance(idx, slice):
        return [(0, idx.start, idx.stop - idx.start)]
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [idx.size]])
    return [(int(a), int(idx[a]), int(b - a)) for a, b in zip(starts, ends) if b > a]


def local_pieces(shape, placements, mesh_shape, coord) -> list:
    """This rank's block as rectangles of the global tensor: [(local slices, global offsets,
    shape)]. One rectangle, unless a StridedShard dim holds one run per part."""
    runs = [index_runs(idx) or [(0, 0, 0)]
            for idx in local_indices(shape, placements, mesh_shape, coord)]
    out = []
    for combo in itertools.product(*runs):
        out.append((tuple(slice(a, a + n) for a, _, n in combo), tuple(o for _, o, _ in combo),
                    tuple(n for _, _, n in combo)))
    return out


def transition_cost(src: Placement, dst: Placement, nbytes: int, n: int) -> float:
    """Bytes a rank moves for one mesh-dim transition of a tensor of ``nbytes`` (global) over
    ``n`` ranks; inf for a transition the table does not allow."""
    if src == dst or n == 1:
        return 0.0
    if isinstance(dst, Partial):
        return 0.0 if isinstance(src, Replicate) else float("inf")
    if isinstance(src, (Shard, StridedShard)):  # an all_to_all between shards, else a gather
        both = isinstance(src, Shard) and isinstance(dst, Shard)
        return nbytes * (n - 1) / n / (n if both else 1)
    if isinstance(src, Partial):
        return nbytes * (n - 1) / n * (1 if isinstance(dst, Shard) else 2)
    return 0.0  # R -> S: a local slice


def _debug(msg: str) -> None:
    if os.environ.get("DTENSOR_DEBUG", "0") not in ("", "0"):
        from dtensor.comm import get_world
        if get_world().rank == 0:
            print(f"[dtensor] {msg}", flush=True)


class Step(NamedTuple):
    """One move of a redistribute on this rank: a collective over mesh dim ``mesh_dim``
    (all_gather, all_to_all, reduce_scatter, all_reduce) or a local one (shard: take this rank's
    slice; zeros: a sum's partials on the ranks that do not keep it). ``params`` are the
    collective's arguments (axis, sizes, op ...); ``after`` the layout once it is done."""

    kind: str
    mesh_dim: int
    params: tuple  # (name, value) pairs, hashable
    after: tuple

    def __repr__(self) -> str:
        args = " ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in self.params)
        return (f"{self.kind}(mesh_dim={self.mesh_dim}{' ' + args if args else ''}) -> "
                f"[{','.join(map(repr, self.after))}]")


COLLECTIVES = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")
_PLANS: dict = {}


def plan_redistribute(spec, placements: tuple[Placement, ...]) -> tuple[Step, ...]:
    """The steps that lay ``spec``'s tensor out as ``placements`` on this rank, from the table
    above; none when nothing moves. Depends on layouts only, so it is cached."""
    key = (spec, tuple(placements))
    steps = _PLANS.get(key)
    if steps is None:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        steps = _PLANS[key] = _plan(spec.mesh, spec.shape, tuple(spec.placements),
                                    tuple(placements))
    return steps


def _plan(mesh, shape, src, placements) -> tuple[Step, ...]:
    if src == placements:
        return ()
    coord = mesh.get_coordinate()
    tgt = list(placements)
    # Over a mesh dim of one rank every transition is the identity: relabel, move nothing.
    cur = [t if n == 1 else p for p, t, n in zip(src, tgt, mesh.shape)]
    nd = mesh.ndim
    steps: list[Step] = []

    def step(kind, m, placement, **params):
        cur[m] = placement
        steps.append(Step(kind, m, tuple(params.items()), tuple(cur)))

    def sizes(d, m):  # each rank's length of tensor dim d when split over mesh dim m
        ext = dim_extent(shape, cur, mesh.shape, coord, d, m)
        return tuple(shard_size_and_offset(ext, mesh.shape[m], r)[0]
                     for r in range(mesh.shape[m]))

    def shards(d, below):  # mesh dims > below that currently shard tensor dim d
        return [m for m in range(below + 1, nd) if cur[m] == Shard(d)]

    def settled_outer(d, m):  # no outer mesh dim still has to split or unsplit tensor dim d
        return all((cur[o] == Shard(d)) == (tgt[o] == Shard(d)) for o in range(m))

    # 0. Strided shards leave through Replicate (their dim is split by no other mesh dim): an
    #    all_gather whose pieces are put back in part order.
    for m in range(nd):
        p = cur[m]
        if isinstance(p, StridedShard) and tgt[m] != p:
            whole, n = shape[p.dim], mesh.shape[m]
            step("all_gather", m, Replicate(), axis=p.dim, sizes=tuple(
                p.parts * shard_size_and_offset(whole // p.parts, n, r)[0] for r in range(n)),
                parts=p.parts)

    # 1. Undo shards, innermost mesh dim first. A shard of the same tensor dim that changes on
    #    an outer mesh dim forces this inner one to be gathered too (outer dims split first).
    for m in reversed(range(nd)):
        p = cur[m]
        if not isinstance(p, Shard):
            continue
        outer_changes = any(p in (cur[o], tgt[o]) and cur[o] != tgt[o] for o in range(m))
        if tgt[m] == p and not outer_changes:
            continue
        if (isinstance(tgt[m], Shard) and not outer_changes and not shards(tgt[m].dim, m)
                and settled_outer(tgt[m].dim, m)):
            j = tgt[m].dim
            step("all_to_all", m, tgt[m], split_axis=j, concat_axis=p.dim,
                 split_sizes=sizes(j, m), concat_sizes=sizes(p.dim, m))
            continue
        step("all_gather", m, Replicate(), axis=p.dim, sizes=sizes(p.dim, m))

    # 2. Resolve pending reductions.
    for m in range(nd):
        p = cur[m]
        if not isinstance(p, Partial) or tgt[m] == p:
            continue
        t = tgt[m]
        if isinstance(t, Shard) and not shards(t.dim, m) and settled_outer(t.dim, m):
            step("reduce_scatter", m, t, op=p.reduce_op, axis=t.dim, sizes=sizes(t.dim, m))
        else:
            step("all_reduce", m, Replicate(), op=p.reduce_op)

    # 3. Shard and make partial locally, outermost mesh dim first.
    for m in range(nd):
        t = tgt[m]
        if cur[m] == t:
            continue
        assert isinstance(cur[m], Replicate), (cur, tgt)
        if isinstance(t, Shard):
            n, off = shard_size_and_offset(dim_extent(shape, cur, mesh.shape, coord, t.dim, m),
                                           mesh.shape[m], coord[m])
            step("shard", m, t, axis=t.dim, start=off, stop=off + n)
        elif isinstance(t, StridedShard):
            step("shard", m, t, axis=t.dim, parts=t.parts, whole=shape[t.dim])
        elif isinstance(t, Partial) and t.reduce_op == "sum" and coord[m] != 0:
            step("zeros", m, t)  # one rank keeps the value, the others hold zeros
        else:
            cur[m] = t
            if steps:
                steps[-1] = steps[-1]._replace(after=tuple(cur))
    return tuple(steps)


def run_step(local: np.ndarray, step: Step, mesh, donate: bool = False) -> np.ndarray:
    """Carry out one step on this rank's array. ``donate``: the caller never reads ``local``
    again, so an all_reduce may overwrite it."""
    kind, p = step.kind, dict(step.params)
    if kind == "shard":
        if "parts" in p:
            n, r = mesh.shape[step.mesh_dim], mesh.get_coordinate()[step.mesh_dim]
            return np.take(local, strided_indices(p["whole"], p["parts"], n, r), axis=p["axis"])
        piece = local[(slice(None),) * p["axis"] + (slice(p["start"], p["stop"]),)]
        # The shard is a copy, never a window on the replicated value: a write to one must not
        # reach the other. A read-only broadcast along the dim (a gradient of a sum, say) is
        # the exception: its slice is the same broadcast, and copying it would write out every
        # repeated element.
        broadcast = not local.flags.writeable and local.strides[p["axis"]] == 0
        return piece if broadcast else piece.copy()
    if kind == "zeros":
        return np.zeros_like(local)
    group = mesh.get_group(step.mesh_dim)
    if kind == "all_gather":
        out = group.all_gather(local, axis=p["axis"], sizes=list(p["sizes"]))
        if "parts" not in p:
            return out
        whole = sum(p["sizes"])
        held = np.concatenate([strided_indices(whole, p["parts"], group.size, r)
                               for r in range(group.size)])
        return np.take(out, np.argsort(held, kind="stable"), axis=p["axis"])
    if kind == "all_to_all":
        return group.all_to_all(local, split_axis=p["split_axis"], concat_axis=p["concat_axis"],
                                split_sizes=list(p["split_sizes"]),
                                concat_sizes=list(p["concat_sizes"]))
    if kind == "reduce_scatter":
        return group.reduce_scatter(local, op=p["op"], axis=p["axis"], sizes=list(p["sizes"]))
    mine = donate and local.flags.c_contiguous and local.flags.writeable
    return group.all_reduce(local, op=p["op"], out=local if mine else None)


def redistribute_local(local: np.ndarray, spec, placements: tuple[Placement, ...],
                       donate: bool = False) -> np.ndarray:
    """The local array of ``spec``'s tensor laid out as ``placements`` (same mesh and shape).

    ``donate``: the caller never reads ``local`` again, so a reduction may overwrite it (the
    compiler donates a partial sum's buffer that dies at its all-reduce)."""
    steps = plan_redistribute(spec, tuple(placements))
    if not steps:
        return local
    # what the flight recorder and the debug tools say caused these collectives (a traced
    # graph's collectives keep it too)
    outer = observe.CAUSE.get("placements")
    observe.CAUSE["placements"] = _transition_text(spec.placements, tuple(placements))
    try:
        if registry._trace is not None and type(local) is not np.ndarray:
            return registry._trace.comm(local, spec, steps)
        _debug(f"redistribute {tuple(spec.shape)} {spec.dtype}: {list(spec.placements)} -> "
               f"{list(placements)} ({int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize}"
               f" bytes)")
        for i, st in enumerate(steps):
            # the arrays between steps are this function's own: a reduction may overwrite them
            local = run_step(local, st, spec.mesh, donate=donate or i > 0)
    finally:
        if outer is None:
            del observe.CAUSE["placements"]
        else:
            observe.CAUSE["placements"] = outer
    return local


@functools.lru_cache(maxsize=1024)
def _transition_text(src: tuple, dst: tuple) -> str:
    """``[S(0), R] -> [R, R]``, made once per transition (it is read on every redistribute)."""
    return " -> ".join("[" + ", ".join(map(repr, p)) + "]" for p in (src, dst))
