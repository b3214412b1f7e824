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

import itertools
import os

import numpy as np

from dtensor.ops import registry
from dtensor.placements import (Partial, Placement, Replicate, Shard, StridedShard,
                                check_strided_alone, shard_size_and_offset, strided_indices)

__all__ = ["redistribute_local", "local_shape_and_offset", "local_indices", "index_runs",
           "local_pieces", "transition_cost", "dim_extent"]


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


def redistribute_local(local: np.ndarray, spec, placements: tuple[Placement, ...],
                       donate: bool = False) -> np.ndarray:
    """The local array of ``spec``'s tensor laid out as ``placements`` (same mesh and shape).

    ``donate``: the caller never reads ``local`` again, so a reduction may overwrite it (the
    compiler donates a partial sum's buffer that dies at its all-reduce)."""
    mesh, shape = spec.mesh, spec.shape
    src = tuple(spec.placements)
    if src == tuple(placements):
        return local
    coord = mesh.get_coordinate()
    tgt = list(placements)
    # Over a mesh dim of one rank every transition is the identity: relabel, move nothing.
    cur = [t if n == 1 else p for p, t, n in zip(src, tgt, mesh.shape)]
    if cur == tgt:
        return local
    if registry._trace is not None and type(local) is not np.ndarray:
        return registry._trace.comm(local, spec, tuple(placements))
    nd = mesh.ndim
    _debug(f"redistribute {tuple(shape)} {spec.dtype}: {list(src)} -> {list(placements)} "
           f"({int(np.prod(shape)) * np.dtype(spec.dtype).itemsize} bytes)")

    def shards(d, below):  # mesh dims > below that currently shard tensor dim d
        return [m for m in range(below + 1, nd) if cur[m] == Shard(d)]

    def settled_outer(d, m):  # no outer mesh dim still has to split or unsplit tensor dim d
        return all((cur[o] == Shard(d)) == (tgt[o] == Shard(d)) for o in range(m))

    # 0. Strided shards leave through Replicate (their dim is split by no other mesh dim).
    for m in range(nd):
        p = cur[m]
        if isinstance(p, StridedShard) and tgt[m] != p:
            group = mesh.get_group(m)
            whole = shape[p.dim]
            gathered = group.all_gather(local, axis=p.dim, sizes=[
                p.parts * shard_size_and_offset(whole // p.parts, group.size, r)[0]
                for r in range(group.size)])
            held = np.concatenate([strided_indices(whole, p.parts, group.size, r)
                                   for r in range(group.size)])
            local = np.take(gathered, np.argsort(held, kind="stable"), axis=p.dim)
            cur[m] = Replicate()

    # 1. Undo shards, innermost mesh dim first. A shard of the same tensor dim that changes on
    #    an outer mesh dim forces this inner one to be gathered too (outer dims split first).
    for m in reversed(range(nd)):
        p = cur[m]
        if not isinstance(p, Shard):
            continue
        outer_changes = any(p in (cur[o], tgt[o]) and cur[o] != tgt[o] for o in range(m))
        if tgt[m] == p and not outer_changes:
            continue
        group = mesh.get_group(m)
        d = p.dim
        if (isinstance(tgt[m], Shard) and not outer_changes and not shards(tgt[m].dim, m)
                and settled_outer(tgt[m].dim, m)):
            j = tgt[m].dim
            ext_d = dim_extent(shape, cur, mesh.shape, coord, d, m)
            ext_j = dim_extent(shape, cur, mesh.shape, coord, j, m)
            local = group.all_to_all(
                local, split_axis=j, concat_axis=d,
                split_sizes=[shard_size_and_offset(ext_j, group.size, r)[0]
                             for r in range(group.size)],
                concat_sizes=[shard_size_and_offset(ext_d, group.size, r)[0]
                              for r in range(group.size)])
            cur[m] = tgt[m]
            continue
        ext = dim_extent(shape, cur, mesh.shape, coord, d, m)
        sizes = [shard_size_and_offset(ext, group.size, r)[0] for r in range(group.size)]
        local = group.all_gather(local, axis=d, sizes=sizes)
        cur[m] = Replicate()

    # 2. Resolve pending reductions.
    for m in range(nd):
        p = cur[m]
        if not isinstance(p, Partial) or tgt[m] == p:
            continue
        group = mesh.get_group(m)
        t = tgt[m]
        if isinstance(t, Shard) and not shards(t.dim, m) and settled_outer(t.dim, m):
            ext = dim_extent(shape, cur, mesh.shape, coord, t.dim, m)
            sizes = [shard_size_and_offset(ext, group.size, r)[0] for r in range(group.size)]
            local = group.reduce_scatter(local, op=p.reduce_op, axis=t.dim, sizes=sizes)
            cur[m] = t
        else:
            mine = donate and local.flags.c_contiguous and local.flags.writeable
            local = group.all_reduce(local, op=p.reduce_op, out=local if mine else None)
            cur[m] = Replicate()

    # 3. Shard and make partial locally, outermost mesh dim first.
    for m in range(nd):
        t = tgt[m]
        if cur[m] == t:
            continue
        assert isinstance(cur[m], Replicate), (cur, tgt)
        if isinstance(t, Shard):
            ext = local.shape[t.dim]
            n, off = shard_size_and_offset(ext, mesh.shape[m], coord[m])
            piece = local[(slice(None),) * t.dim + (slice(off, off + n),)]
            # The shard is a copy, never a window on the replicated value: a write to one must
            # not reach the other. A read-only broadcast along the dim (a gradient of a sum,
            # say) is the exception: its slice is the same broadcast, and copying it would
            # write out every repeated element.
            broadcast = not local.flags.writeable and local.strides[t.dim] == 0
            local = piece if broadcast else piece.copy()
        elif isinstance(t, StridedShard):
            local = np.take(local, strided_indices(local.shape[t.dim], t.parts, mesh.shape[m],
                                                   coord[m]), axis=t.dim)
        elif isinstance(t, Partial) and t.reduce_op == "sum" and coord[m] != 0:
            # A replicated value as sum-partials: one rank keeps it, the others hold zeros.
            local = np.zeros_like(local)
        cur[m] = t
    return local
