"""Placements: how a tensor is laid out along one mesh dim. ``Shard(d)``, ``StridedShard(d, k)``,
``Replicate()``, ``Partial(op)``, frozen value types with short reprs: ``S(0)``, ``S(0)/3``,
``R``, ``P(sum)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dtensor.validate import as_int

__all__ = ["Placement", "Shard", "StridedShard", "Replicate", "Partial", "shard_size_and_offset",
           "strided_indices", "check_strided_alone", "as_placements"]


class Placement:
    """Base of the three placement kinds."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


def shard_size_and_offset(size: int, num_shards: int, index: int) -> tuple[int, int]:
    """Local length and global offset of shard ``index`` of a dim of ``size`` (torch.chunk rule).

    Every shard but the trailing ones holds ceil(size / num_shards); trailing shards may be
    short or empty: size 5 over 4 -> lengths 2, 2, 1, 0 at offsets 0, 2, 4, 5.
    """
    if num_shards <= 0 or not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is out of range for {num_shards} shards.")
    chunk = -(-size // num_shards)
    start = min(size, index * chunk)
    return min(size, start + chunk) - start, start


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Split tensor dim ``dim`` over the mesh dim with torch.chunk semantics.

    Rank r holds [r * c, min(T, (r + 1) * c)) where c = ceil(T / n); see
    :func:`shard_size_and_offset`. Uneven and empty trailing shards are exact, not padded.
    """

    dim: int

    def __post_init__(self):
        if type(self.dim) is not int:  # a numpy int becomes an int; a float is an error
            object.__setattr__(self, "dim", as_int(
                self.dim, "Shard(dim): dim", fix="Shard takes the tensor dim to split, e.g. "
                "Shard(0)."))

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard(Placement):
    """Cut tensor dim ``dim`` into ``parts`` equal parts and split EACH part over the mesh dim.

    Rank r holds shard r (torch.chunk rule) of part 0, then shard r of part 1, and so on: the
    layout of a fused projection whose output is read part by part. A Linear computing
    [q | k | v] at once, as nanoGPT's ``c_attn(x).split(C, dim=2)`` reads it, splits q, k and v
    each when its weight's output features are ``StridedShard(0, 3)``; ``Shard(0)`` would give
    rank 0 all of q. Slicing one part out gives that part as ``Shard(dim)`` with no data moved.
    ``parts=1`` is ``Shard(dim)``; it is a separate type so that code reading a Shard's offset
    never meets a block that has none.
    """

    dim: int
    parts: int

    def __post_init__(self):
        fix = "StridedShard takes the tensor dim and the number of parts, e.g. StridedShard(0, 3)."
        if type(self.dim) is not int:
            object.__setattr__(self, "dim", as_int(self.dim, "StridedShard(dim, parts): dim",
                                                   fix=fix))
        if type(self.parts) is not int or self.parts < 1:
            object.__setattr__(self, "parts", as_int(
                self.parts, "StridedShard(dim, parts): parts", low=1, fix=fix))

    def __repr__(self) -> str:
        return f"S({self.dim})/{self.parts}"


def strided_indices(size: int, parts: int, num_shards: int, index: int):
    """Global indices, in local order, that shard ``index`` of a StridedShard dim holds."""
    part = size // parts
    n, o = shard_size_and_offset(part, num_shards, index)
    return (np.arange(parts)[:, None] * part + np.arange(o, o + n)[None, :]).reshape(-1)


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole tensor."""

    def __repr__(self) -> str:
        return "R"


_REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Each rank holds a partial value; the tensor is their element-wise ``reduce_op``."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {_REDUCE_OPS}, got "
                             f"{self.reduce_op!r}.")

    def __repr__(self) -> str:
        return f"P({self.reduce_op})"


def as_placements(placements, mesh, shape: Sequence[int]) -> tuple[Placement, ...]:
    """``placements`` checked against ``mesh`` (a DeviceMesh) and a tensor of ``shape``: a
    sequence of exactly one Placement per mesh dim, each Shard's dim in range; negative Shard
    dims come back resolved."""
    if isinstance(placements, Placement):
        ctor = {Shard: lambda p: f"Shard({p.dim})",
                StridedShard: lambda p: f"StridedShard({p.dim}, {p.parts})",
                Replicate: lambda p: "Replicate()",
                Partial: lambda p: f"Partial({p.reduce_op!r})"}[type(placements)](placements)
        example = ", ".join([ctor] + ["Replicate()"] * (mesh.ndim - 1))
        raise TypeError(f"placements takes one placement per mesh dim, as a list; got the single "
                        f"placement {placements!r} for the {mesh.ndim}-d mesh {mesh}. Pass "
                        f"[{example}].")
    if not isinstance(placements, (list, tuple)):
        raise TypeError(f"placements must be a list with one placement per mesh dim, e.g. "
                        f"[Shard(0)] for a 1-d mesh, got {placements!r}.")
    if len(placements) != mesh.ndim:
        raise ValueError(f"got {len(placements)} placements {list(placements)} for a "
                         f"{mesh.ndim}-d mesh {mesh}; give exactly one per mesh dim.")
    ndim = len(shape)
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"placements must be Shard(d), StridedShard(d, parts), Replicate() or "
                            f"Partial(op), got {p!r} in {list(placements)!r}.")
        if isinstance(p, (Shard, StridedShard)):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{p} is out of range for a tensor of shape {tuple(shape)} "
                                 f"({ndim} dims).")
            if p.dim < 0:
                p = Shard(p.dim % ndim) if isinstance(p, Shard) else StridedShard(p.dim % ndim,
                                                                                 p.parts)
        out.append(p)
    for p in out:
        if isinstance(p, StridedShard) and shape[p.dim] % p.parts:
            raise ValueError(f"{p} cuts tensor dim {p.dim} of size {shape[p.dim]} into "
                             f"{p.parts} equal parts, but {shape[p.dim]} does not divide by "
                             f"{p.parts} (tensor shape {tuple(shape)}); give a parts count that "
                             f"divides it, or use Shard({p.dim}).")
    check_strided_alone(out)
    return tuple(out)


def check_strided_alone(placements) -> None:
    """A StridedShard's dim is split by its mesh dim only (a strided piece of a shard, or a
    shard of strided pieces, is no layout the transitions know)."""
    for m, p in enumerate(placements):
        if not isinstance(p, StridedShard):
            continue
        others = [q for k, q in enumerate(placements)
                  if k != m and isinstance(q, (Shard, StridedShard)) and q.dim == p.dim]
        if others:
            raise NotImplementedError(
                f"{p} shares tensor dim {p.dim} with {others[0]} on another mesh dim "
                f"(placements {list(placements)}); a strided dim is split by one mesh dim only. "
                f"Shard another tensor dim on the other mesh dim, or Replicate there.")
