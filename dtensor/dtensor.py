"""DTensor: a global tensor laid out over a DeviceMesh as one placement per mesh dim.

Each rank holds its local block (``to_local()``). Every op goes through the same registry as
Tensor: the sharding rules (sharding.py) pick input and output placements, the inputs are
redistributed (redistribute.py, the only place collectives happen), and the op's numpy ``impl``
runs on the local blocks. Autograd records the op on the DTensor inputs, so the backward is a
DTensor program whose collectives come from the same rules.

Example (under ``dtlaunch --nproc 4``):
    >>> mesh = dtensor.init_device_mesh("cpu", (4,))
    >>> x = dtensor.distribute_tensor(dtensor.randn(8, 6), mesh, [Shard(0)])
    >>> (x @ x.T).full_tensor()       # the (8, 8) product on every rank
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from dtensor import autograd, random
from dtensor._flag import Flag
from dtensor.mesh import DeviceMesh
from dtensor.ops import registry, structural
from dtensor.ops.registry import Aval, Block, Op
from dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard, as_placements
from dtensor.redistribute import (index_runs, local_indices, local_pieces,
                                  local_shape_and_offset, redistribute_local)
from dtensor.sharding import propagate
from dtensor.tensor import (Tensor, TensorMethods, _shape_arg, fill_value, float_dtype,
                            resolve_dtype)
from dtensor.validate import as_bool

__all__ = ["DTensor", "DTensorSpec", "distribute_tensor", "implicit_replication", "zeros", "ones",
           "full", "rand", "randn", "visualize_sharding"]


@dataclass(frozen=True)
class DTensorSpec:
    """(mesh, placements, global shape, dtype): all a DTensor's layout is; nothing more."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self):
        # Hashed on every op (strategy cache key): compute it once.
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements, self.shape,
                                                self.dtype)))

    def __hash__(self) -> int:
        return self._hash

    def local_shape_and_offset(self):
        return _local_block(self)

    def local_pieces(self) -> list:
        """This rank's block as rectangles: [(local slices, global offsets, shape)]."""
        return local_pieces(self.shape, self.placements, self.mesh.shape,
                            self.mesh.get_coordinate())


_BLOCKS: dict = {}


def block_of(spec: DTensorSpec) -> Block:
    """Where this rank's block of ``spec`` sits: what an op's local kernel reads."""
    shape, offset = _local_block(spec)
    parts = [None] * len(spec.shape)
    for p in spec.placements:
        if isinstance(p, StridedShard):
            parts[p.dim] = p.parts
    return Block(spec.shape, tuple(shape), tuple(offset), tuple(local_indices(
        spec.shape, spec.placements, spec.mesh.shape, spec.mesh.get_coordinate())),
        tuple(parts))


def _local_block(spec: DTensorSpec):
    blk = _BLOCKS.get(spec)
    if blk is None:
        blk = _BLOCKS[spec] = local_shape_and_offset(spec.shape, spec.placements, spec.mesh.shape,
                                                     spec.mesh.get_coordinate())
    return blk


class DTensor(TensorMethods):
    """A distributed tensor. Build one with ``distribute_tensor`` or ``DTensor.from_local``."""

    is_distributed = True

    __slots__ = ("_local", "_spec", "_work", "_reduced", "requires_grad", "grad", "_node",
                 "_is_param", "__weakref__")

    @staticmethod
    def _make(local: np.ndarray, spec: DTensorSpec, work=None) -> "DTensor":
        t = object.__new__(DTensor)
        t._local, t._spec, t._work, t._reduced = local, spec, work, None
        t.requires_grad, t.grad, t._node, t._is_param = False, None, None, False
        return t

    def _local_as(self, placements) -> np.ndarray:
        """The local block laid out as ``placements``.

        A Partial tensor remembers its reduced layouts: the backward of a nonlinear op reads
        the op's inputs again, and must not all-reduce them a second time.
        """
        if placements == self._spec.placements:
            return self._loc()
        if self._reduced is not None and placements in self._reduced:
            return self._reduced[placements]
        local = redistribute_local(self._loc(), self._spec, placements)
        if any(isinstance(p, Partial) for p in self._spec.placements):
            if self._reduced is None:
                self._reduced = {}
            self._reduced[placements] = local
        return local

    def _set_local(self, local: np.ndarray) -> None:
        self._local, self._work, self._reduced = local, None, None

    def _loc(self) -> np.ndarray:
        if self._work is not None:  # an async redistribute: wait on first use
            self._set_local(self._work.wait())
        return self._local

    # -- metadata
    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> np.dtype:
        return self._spec.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    def __repr__(self) -> str:
        return (f"DTensor(shape={self.shape}, dtype={self.dtype}, placements="
                f"{list(self.placements)}, mesh={self.device_mesh}, local="
                f"{np.array2string(self._loc(), threshold=8)})")

    # -- conversions
    @staticmethod
    def from_local(local, device_mesh: DeviceMesh, placements: Sequence[Placement], *,
                   run_check: bool = False, shape: Sequence[int] | None = None,
                   stride=None) -> "DTensor":
        """Wrap this rank's block as a DTensor (differentiable).

        Args:
            shape: the global shape. Needed for uneven shards; without it every shard is
                assumed to be the same size (global dim = local dim x mesh dim size).
            run_check: check (one metadata all-gather) that every rank passed consistent
                shapes and placements; raises ValueError on every rank otherwise.
        """
        t = local if isinstance(local, TensorMethods) else Tensor(local)
        arr = t.data if isinstance(t, Tensor) else np.asarray(local)

        def check() -> DTensorSpec:
            nonlocal shape
            ps = as_placements(placements, device_mesh, arr.shape)
            if shape is None:
                gshape = list(arr.shape)
                for m, p in enumerate(ps):
                    if isinstance(p, (Shard, StridedShard)):
                        gshape[p.dim] *= device_mesh.size(m)
                shape = tuple(gshape)
            spec = DTensorSpec(device_mesh, ps, _shape_arg(shape), arr.dtype)
            if not run_check and _local_block(spec)[0] != arr.shape:
                raise ValueError(f"from_local: this rank's block has shape {arr.shape} but "
                                 f"{list(ps)} of global shape {spec.shape} gives "
                                 f"{_local_block(spec)[0]} here; pass shape= (the global "
                                 f"shape).")
            return spec

        # Without shape= the global shape follows from the blocks, which must then be equal.
        spec = _agreed(device_mesh, "DTensor.from_local", check,
                       "Pass shape= (the global shape) for blocks of different sizes.",
                       shape=shape, block=arr.shape if shape is None else None,
                       placements=placements, dtype=str(arr.dtype))
        if run_check:
            _check_from_local(arr, spec)
        return _from_local(t, arr, spec)

    def to_local(self) -> Tensor:
        """This rank's block as a Tensor (gradients flow back to the DTensor)."""
        out = Tensor._wrap(self._loc())
        if autograd.is_grad_enabled() and self.requires_grad:
            autograd.record(_TO_LOCAL, (self,), {}, out)
        return out

    def full_tensor(self) -> Tensor:
        """The whole tensor on every rank (an all-gather / all-reduce as needed)."""
        return _redistribute(self, (Replicate(),) * self.device_mesh.ndim,
                             boundary=True).to_local()

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None, *,
                     async_op: bool = False) -> "DTensor":
        """The same tensor laid out as ``placements`` (collectives per the transition table).

        As in PyTorch, the result is a boundary for autograd even when the layout does not
        change: the gradient that reaches it goes back to this tensor's placements (a Partial
        gradient of a Replicate tensor is all-reduced here, once, however many ops used it).
        With ``async_op=True`` the collectives start now and the result waits on first use.
        """
        if device_mesh is not None and device_mesh != self.device_mesh:
            raise NotImplementedError(f"redistribute to another mesh ({device_mesh}) is not "
                                      f"supported; the tensor lives on {self.device_mesh}.")

        def check() -> tuple[Placement, ...]:
            ps = as_placements(placements or self.placements, self.device_mesh, self.shape)
            for m, p in enumerate(ps):
                # As PyTorch: a whole value becomes partials (for sum, one rank keeps it and
                # the others hold zeros; for avg/max/min every rank keeps it). Between two
                # reductions there is no such step.
                src = self.placements[m]
                if isinstance(p, Partial) and isinstance(src, Partial) and p != src:
                    raise ValueError(f"redistribute from {src} to {p} (mesh dim {m}) is not "
                                     f"allowed: reduce first (Replicate()), then make it {p}.")
            return ps

        ps = _agreed(self.device_mesh, "redistribute", check, placements=placements,
                     source=self._spec)
        return _redistribute(self, ps, async_op, boundary=True)

    # -- in-place updates (optimizers): replace the local block, never the graph
    def _assign(self, new: "DTensor") -> None:
        if type(self._loc()) is np.ndarray and type(new._loc()) is not np.ndarray:
            from dtensor.tensor import _untraced_update
            _untraced_update(self)
        if new.placements != self.placements:
            new = _redistribute(new, self.placements)
        self._set_local(new._loc().astype(self.dtype, copy=False))

    def _owned(self, taken: set) -> "DTensor":
        return self

    def _as_grad_of(self, leaf: "DTensor") -> "DTensor":
        """This gradient laid out as its leaf: a parameter's ``.grad`` always has the
        parameter's placements (a Partial gradient of a Replicate parameter is all-reduced, of a
        Shard one reduce-scattered, as DDP and FSDP do), so optimizers run without
        communication."""
        if self.placements == leaf.placements:
            return self
        return _redistribute(self, _grad_placements(leaf.placements, self.placements))

    def _ones_like(self) -> "DTensor":
        return DTensor._make(np.ones(_local_block(self._spec)[0], self.dtype),
                             replace(self._spec, placements=tuple(
                                 Replicate() if isinstance(p, Partial) else p
                                 for p in self.placements)))

    def detach(self) -> "DTensor":
        return DTensor._make(self._loc(), self._spec)

    def numpy(self) -> np.ndarray:
        raise TypeError("a DTensor has no single numpy array: use .to_local().numpy() for this "
                        "rank's block or .full_tensor().numpy() for the whole tensor.")

    def item(self):
        return self.full_tensor().item()

    def copy_(self, src) -> "DTensor":
        src = src if isinstance(src, DTensor) else distribute_tensor(
            src, self.device_mesh, [Replicate()] * self.device_mesh.ndim, src_data_rank=None)
        if src.shape != self.shape:
            raise ValueError(f"copy_: source shape {src.shape} differs from {self.shape}.")
        self._set_local(np.array(redistribute_local(src._loc(), src._spec, self.placements),
                                 dtype=self.dtype))
        return self

    def zero_(self) -> "DTensor":
        self._set_local(np.zeros_like(self._loc()))
        return self

    def normal_(self, mean: float = 0.0, std: float = 1.0) -> "DTensor":
        self._set_local((_random_like(structural.randn, self, self.dtype)._loc() * std + mean
                          ).astype(self.dtype))
        return self

    def uniform_(self, a: float = 0.0, b: float = 1.0) -> "DTensor":
        self._set_local((_random_like(structural.rand, self, self.dtype)._loc() * (b - a) + a
                          ).astype(self.dtype))
        return self


# ----------------------------------------------------------------------------- autograd nodes

def _grad_placements(src, gp):
    """Where the gradient of a redistribute's input goes: back to ``src``, except that a
    Partial source takes the gradient as it comes (a replicated gradient of a sum of partials is
    each partial's gradient: no communication)."""
    return tuple(g if isinstance(s, Partial) and isinstance(g, (Replicate, Partial)) else
                 (Replicate() if isinstance(s, Partial) else s) for s, g in zip(src, gp))


def _redistribute(x: DTensor, placements, async_op: bool = False,
                  boundary: bool = False) -> DTensor:
    placements = tuple(placements)
    if placements == x.placements:
        if not (boundary and autograd.is_grad_enabled() and x.requires_grad):
            return x
        out = DTensor._make(x._loc(), x._spec)
        autograd.record(_REDISTRIBUTE, (x,), {"placements": placements}, out)
        return out
    spec = replace(x._spec, placements=placements)
    if async_op:
        from dtensor.comm import Work
        src = x
        out = DTensor._make(None, spec, Work(None, lambda: redistribute_local(
            src._loc(), src._spec, placements)))
    else:
        out = DTensor._make(redistribute_local(x._loc(), x._spec, placements), spec)
    if autograd.is_grad_enabled() and x.requires_grad:
        autograd.record(_REDISTRIBUTE, (x,), {"placements": placements}, out)
    return out


_REDISTRIBUTE = Op("redistribute", impl=None, abstract=None, linearity="all", lower="collective",
                   vjp=lambda g, out, x, placements: (
                       _redistribute(g, _grad_placements(x.placements, g.placements)),))
_TO_LOCAL = Op("to_local", impl=None, abstract=None, linearity="all",
               vjp=lambda g, out, x: (DTensor._make(g.data, replace(
                   x._spec, dtype=g.dtype)),))
_FROM_LOCAL = Op("from_local", impl=None, abstract=None, linearity="all",
                 vjp=lambda g, out, t: (Tensor._wrap(redistribute_local(
                     g._loc(), g._spec, _grad_placements(out.placements, g.placements))),))


def _from_local(t, arr: np.ndarray, spec: DTensorSpec) -> DTensor:
    """``arr`` (``t``'s array) as this rank's block of ``spec``, differentiable: from_local
    once its arguments are checked, or for a caller that derived ``spec`` itself."""
    out = DTensor._make(arr, spec)
    if autograd.is_grad_enabled() and t.requires_grad:
        autograd.record(_FROM_LOCAL, (t,), {}, out)
    return out


def _agreed(mesh: DeviceMesh, what: str, check, fix: str = "", **fields):
    """``check()`` (this rank's validation, returning the checked value), agreed on by every
    rank of ``mesh``: ranks that passed different ``fields``, or where ``check`` failed on some
    ranks only, raise the same error on every rank instead of hanging in the collective that
    follows or computing a silently wrong result (DESIGN section 5)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: device_mesh must be a DeviceMesh (init_device_mesh('cpu', "
                        f"shape)), got {type(mesh).__name__} {mesh!r}.")
    error, result = None, None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
        error = e
    if mesh.size() > 1:
        # ([Shard(0)] and (Shard(0),) are one argument, as are [4, 6] and (4, 6))
        mesh.check_same(what, fix, error=error, **{
            k: (list if k == "placements" else tuple)(v) if isinstance(v, (list, tuple)) else v
            for k, v in fields.items()})
    elif error is not None:
        raise error
    return result


def _check_from_local(arr: np.ndarray, spec: DTensorSpec) -> None:
    from dtensor.comm import get_world
    mine = (arr.shape, str(arr.dtype), _local_block(spec)[0], tuple(map(repr, spec.placements)),
            spec.shape)
    theirs = get_world()._c.allgather(mine)  # metadata only: not a data-path collective
    bad = [r for r, t in enumerate(theirs) if t[0] != t[2] or t[1] != theirs[0][1]
           or t[3:] != theirs[0][3:]]
    if bad:
        raise ValueError(
            "from_local(run_check=True): inconsistent blocks: "
            + "; ".join(f"rank {r}: local {theirs[r][0]} {theirs[r][1]}, expected "
                        f"{theirs[r][2]} for {list(theirs[r][3])} of {theirs[r][4]}"
                        for r in bad)
            + ". Pass shape= with the global shape, or fix the local blocks.")


# ----------------------------------------------------------------------------- dispatch

_implicit = Flag(False)


def implicit_replication():
    """Inside the block, plain Tensors in an op with DTensors count as Replicate DTensors."""
    return _implicit.set(True)


def _as_arg(a, mesh):
    if isinstance(a, Tensor):
        if not _implicit.on:
            raise TypeError(
                f"an op mixes a plain Tensor (shape {tuple(a.shape)}) with DTensors on {mesh}. "
                f"Make it a DTensor (distribute_tensor(t, mesh, [Replicate()] * mesh.ndim) or "
                f"DTensor.from_local), or run the op inside dtensor.implicit_replication().")
        out = _distribute(a, mesh, (Replicate(),) * mesh.ndim, None)  # per op: no agreement
        if autograd.is_grad_enabled() and a.requires_grad:
            # Differentiable, as from_local: the gradient reaches the plain tensor (a parameter
            # no plan distributed) whole, instead of stopping at this temporary.
            autograd.record(_FROM_LOCAL, (a,), {}, out)
        return out
    if isinstance(a, np.ndarray):
        return _as_arg(Tensor(a), mesh)
    return a


_CACHE: dict = {}


def _param_key(params):
    return tuple(sorted(params.items()))


def _convert(args):
    """Plain tensors among a DTensor op's inputs: Replicate under implicit_replication(), else a
    TypeError that says how to fix it."""
    mesh = next(a._spec.mesh for a in args if isinstance(a, DTensor))
    return tuple(_as_arg(a, mesh) for a in args)


def _interpret(op: Op, args, params):
    key = (op, tuple(a._spec if isinstance(a, DTensor) else (type(a), a == 0) for a in args),
           _param_key(params))
    entry = _CACHE.get(key)
    if entry is None:
        if len(_CACHE) > 8192:  # params such as a scheduled learning rate change every step
            _CACHE.clear()
        entry = _CACHE[key] = _plan(op, args, params)
    targets, out_spec, local_params, in_specs, blocks = entry
    locals_ = [a._local_as(t) if t is not None else a for a, t in zip(args, targets)]
    if registry._trace is not None:
        return DTensor._make(registry._trace.local(op, locals_, local_params, in_specs,
                                                   out_spec, blocks), out_spec)
    if blocks is None:
        out = op.impl(*locals_, **local_params)
    else:
        out = op.local(*locals_, in_blocks=blocks[0], out_block=blocks[1], **local_params)
    return DTensor._make(out, out_spec)


def _plan(op: Op, args, params):
    """Everything about running ``op`` on inputs with these specs that does not depend on data:
    input layouts, output spec, localized params, and where the blocks sit for an op with a
    local kernel."""
    mesh = next(a._spec.mesh for a in args if isinstance(a, DTensor))
    for a in args:
        if isinstance(a, DTensor) and a._spec.mesh != mesh:
            raise ValueError(f"op {op.name!r} mixes DTensors on different meshes: {mesh} and "
                             f"{a._spec.mesh}; redistribute onto one mesh first.")
    avals = [Aval(a.shape, a.dtype) if isinstance(a, DTensor) else a for a in args]
    out = op.abstract(*avals, **params)
    strat = propagate(op, avals, params,
                      [a.placements if isinstance(a, DTensor) else None for a in args], out, mesh)
    out_spec = DTensorSpec(mesh, strat.out, tuple(out.shape), np.dtype(out.dtype))
    in_specs = [replace(a._spec, placements=t) if t is not None else None
                for a, t in zip(args, strat.inputs)]
    where = None
    if op.local is not None or op.localize is not None:
        where = ([block_of(s) if s is not None else None for s in in_specs], block_of(out_spec))
    local_params = params if op.localize is None else op.localize(params, *where)
    return (strat.inputs, out_spec, local_params, in_specs,
            where if op.local is not None else None)


registry.register_interpreter(DTensor, _interpret, _convert)


# ----------------------------------------------------------------------------- construction

def distribute_tensor(tensor, device_mesh: DeviceMesh, placements: Sequence[Placement], *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Lay a full tensor out over ``device_mesh``.

    Args:
        src_data_rank: the rank whose data is used (broadcast first, so ranks that passed
            different values agree); None uses each rank's own data without communication.
    """
    t = tensor if isinstance(tensor, Tensor) else Tensor(tensor)
    placements = _agreed(device_mesh, "distribute_tensor",
                         lambda: as_placements(placements, device_mesh, t.shape),
                         shape=tuple(t.shape), dtype=str(t.dtype), placements=placements,
                         src_data_rank=src_data_rank)
    return _distribute(t, device_mesh, placements, src_data_rank)


def _distribute(t: Tensor, device_mesh: DeviceMesh, placements: tuple[Placement, ...],
                src_data_rank: int | None) -> DTensor:
    arr = t.data
    if src_data_rank is not None and device_mesh.size() > 1:
        from dtensor.comm import get_world
        if arr.size > 1 and not any(arr.strides):
            # One value broadcast to a shape (a placeholder of nn.init.empty_parameters): send
            # the value, so no rank ever allocates the whole tensor.
            one = get_world().broadcast(np.ascontiguousarray(arr.reshape(-1)[:1]),
                                        src=src_data_rank)
            arr = np.broadcast_to(one.reshape(()), arr.shape)
        else:
            arr = get_world().broadcast(arr, src=src_data_rank)
    spec = DTensorSpec(device_mesh, tuple(Replicate() for _ in placements), tuple(t.shape),
                       arr.dtype)
    local = redistribute_local(arr, spec, placements)
    if isinstance(local, np.ndarray):
        local = np.ascontiguousarray(local)
    out = DTensor._make(local, replace(spec, placements=placements))
    out.requires_grad = t.requires_grad
    return out


def _factory_spec(shape, dtype, device_mesh, placements):
    shape = _shape_arg(shape)
    return DTensorSpec(device_mesh, as_placements(placements, device_mesh, shape), shape,
                       np.dtype(np.float32) if dtype is None else resolve_dtype(dtype))


def held_pieces(t):
    """(local shape, [(local slices, global offsets, shape)]) of what tensor ``t`` holds on this
    rank: a plain tensor is one rectangle, a DTensor its spec's (one per part of a strided dim).
    """
    if isinstance(t, DTensor):
        return tuple(_local_block(t._spec)[0]), t._spec.local_pieces()
    shape = tuple(t.shape)
    return shape, [(tuple(slice(0, n) for n in shape), (0,) * len(shape), shape)]


def _template(spec: DTensorSpec) -> DTensor:
    """A data-free DTensor with ``spec``: the shape/placement argument of random factories."""
    return DTensor._make(np.broadcast_to(np.empty((), np.bool_), _local_block(spec)[0]),
                         replace(spec, dtype=np.dtype(np.bool_)))


def _random_like(op, like: DTensor, dtype) -> DTensor:
    # Element i is a pure function of (key, i): ranks whose RNG states differ would hold blocks
    # of different tensors, and a "replicated" one would differ by rank, silently.
    key = _agreed(like.device_mesh, f"dtensor.{op.name}", random.next_key,
                  "Call dtensor.manual_seed(s) with the same s on every rank, and draw the same "
                  "random tensors in the same order.", rng_state=random.get_rng_state())
    return op(_template(like._spec), key=key, dtype=np.dtype(dtype))


def full(shape, value, *, dtype=None, device_mesh: DeviceMesh,
         placements: Sequence[Placement], requires_grad: bool = False) -> DTensor:
    """A DTensor filled with ``value``; each rank allocates only its block."""
    value = fill_value(value, "full")
    spec = _factory_spec(shape, dtype, device_mesh, placements)
    out = DTensor._make(np.full(_local_block(spec)[0], value, spec.dtype), spec)
    out.requires_grad = as_bool(requires_grad, "requires_grad")
    return out


def zeros(*shape, dtype=None, device_mesh: DeviceMesh, placements, requires_grad=False):
    return full(shape, 0, dtype=dtype, device_mesh=device_mesh, placements=placements,
                requires_grad=requires_grad)


def ones(*shape, dtype=None, device_mesh: DeviceMesh, placements, requires_grad=False):
    return full(shape, 1, dtype=dtype, device_mesh=device_mesh, placements=placements,
                requires_grad=requires_grad)


def rand(*shape, dtype=None, device_mesh: DeviceMesh, placements, requires_grad=False):
    """Uniform [0, 1): exactly the numbers dtensor.rand(*shape) gives in one process."""
    spec = _factory_spec(shape, float_dtype(dtype, "dtensor.rand"), device_mesh, placements)
    out = _random_like(structural.rand, DTensor._make(None, spec), spec.dtype)
    out.requires_grad = as_bool(requires_grad, "requires_grad")
    return out


def randn(*shape, dtype=None, device_mesh: DeviceMesh, placements, requires_grad=False):
    """Standard normal: exactly the numbers dtensor.randn(*shape) gives in one process."""
    spec = _factory_spec(shape, float_dtype(dtype, "dtensor.randn"), device_mesh, placements)
    out = _random_like(structural.randn, DTensor._make(None, spec), spec.dtype)
    out.requires_grad = as_bool(requires_grad, "requires_grad")
    return out


def visualize_sharding(dt: DTensor, header: str = "") -> str:
    """A text picture of which ranks hold which block of a 1-d or 2-d DTensor: one line per
    block, then a grid like ``jax.debug.visualize_array_sharding`` (printed on the first rank
    of the mesh, returned on every rank).

    Args:
        dt: the DTensor to draw.
        header: a first line to print above the picture.
    Returns:
        The text printed. The grid cuts the tensor where any rank's range starts or ends; each
        cell names the ranks holding it, its size and, for a Partial placement, ``P(op)`` (the
        cell's values are the reduction of the ranks' local values). A strided dim's block is
        several cells. Column ranges head the grid, row ranges sit on its left.

    Example (under ``dtlaunch --nproc 4``):
        >>> mesh = dtensor.init_device_mesh("cpu", (2, 2))
        >>> dtensor.visualize_sharding(distribute_tensor(np.zeros((4, 6)), mesh,
        ...                                              [Shard(0), Shard(1)]))
        (4, 6) [S(0), S(1)] on DeviceMesh('cpu', [[0, 1], [2, 3]])
          [0:2, 0:3] -> ranks [0]
          [0:2, 3:6] -> ranks [1]
          [2:4, 0:3] -> ranks [2]
          [2:4, 3:6] -> ranks [3]
                0:3   3:6
              +-----+-----+
          0:2 |  0  |  1  |
              | 2x3 | 2x3 |
              +-----+-----+
          2:4 |  2  |  3  |
              | 2x3 | 2x3 |
              +-----+-----+
    """
    if dt.ndim not in (1, 2):
        raise ValueError(f"visualize_sharding draws 1-d and 2-d tensors, got {dt.ndim}-d.")
    mesh = dt.device_mesh
    spec = dt._spec
    blocks: dict = {}
    for coord in np.ndindex(*mesh.shape):
        # a strided dim's block is several ranges (each part's piece), drawn joined by "+"
        rng = tuple(tuple((g, g + n) for _, g, n in index_runs(i))
                    for i in local_indices(spec.shape, spec.placements, mesh.shape, list(coord)))
        blocks.setdefault(rng, []).append(int(mesh.mesh[coord]))
    lines = [header] if header else []
    lines.append(f"{tuple(dt.shape)} {list(dt.placements)} on {mesh}")
    for rng, ranks in sorted(blocks.items()):
        where = ", ".join("+".join(f"{a}:{b}" for a, b in r) or "-" for r in rng)
        lines.append(f"  [{where}] -> ranks {ranks}")
    lines += _draw_sharding_grid(dt)
    text = "\n".join(lines)
    if mesh.get_rank() == int(mesh.mesh.reshape(-1)[0]):
        print(text, flush=True)
    return text


def _sharding_grid(dt: DTensor) -> tuple[list, dict, list]:
    """The grid visualize_sharding draws: (cut points per tensor dim, {cell: sorted ranks},
    ranks whose block is empty). A cut is wherever any rank's range starts or ends, so every
    rank's block (each piece of it, for a strided dim) is a union of whole cells; a cell is its
    interval index per dim."""
    mesh, spec = dt.device_mesh, dt._spec
    held = []  # (rank, its ranges per tensor dim)
    for coord in np.ndindex(*mesh.shape):
        idx = local_indices(spec.shape, spec.placements, mesh.shape, list(coord))
        held.append((int(mesh.mesh[coord]), [[(g, g + n) for _, g, n in index_runs(i) if n]
                                              for i in idx]))
    cuts = [sorted({e for _, rng in held for r in rng[d] for e in r}) for d in range(dt.ndim)]
    cells: dict = {}
    empty = sorted(rank for rank, rng in held if not all(rng))
    if any(len(c) < 2 for c in cuts):  # an empty tensor: no cells
        return cuts, cells, empty
    for rank, rng in sorted(held):
        inside = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
        inside[np.ix_(*[[k for a, b in rng[d]
                         for k in range(cuts[d].index(a), cuts[d].index(b))]
                        for d in range(dt.ndim)])] = True
        for cell in zip(*np.nonzero(inside)):
            cells.setdefault(tuple(int(k) for k in cell), []).append(rank)
    return cuts, cells, empty


def _draw_sharding_grid(dt: DTensor) -> list[str]:
    """_sharding_grid as ASCII boxes, one row of cells for a 1-d tensor. Every cell reads
    ranks / size [/ P(op)] top to bottom; a column is as wide as its widest label."""
    cuts, cells, empty = _sharding_grid(dt)
    if not cells:
        return ["  (no grid: the tensor is empty)"]
    span = [[f"{a}:{b}" for a, b in zip(c, c[1:])] for c in cuts]
    cols, rows = span[-1], (span[0] if dt.ndim == 2 else [""])
    partial = ",".join(dict.fromkeys(repr(p) for p in dt.placements if isinstance(p, Partial)))

    def label(i: int, j: int) -> list[str]:
        cell = (i, j) if dt.ndim == 2 else (j,)
        size = "x".join(str(cuts[d][k + 1] - cuts[d][k]) for d, k in enumerate(cell))
        return [",".join(map(str, cells.get(cell, []))) or "-", size] + [partial] * bool(partial)

    labels = [[label(i, j) for j in range(len(cols))] for i in range(len(rows))]
    width = [2 + max(len(cols[j]), *(len(s) for row in labels for s in row[j]))
             for j in range(len(cols))]
    margin = max(len(r) for r in rows) + 1 if dt.ndim == 2 else 0
    border = " " * margin + "+" + "+".join("-" * w for w in width) + "+"
    out = [(" " * (margin + 1) + " ".join(c.center(w) for c, w in zip(cols, width))).rstrip(),
           border]
    middle = (len(labels[0][0]) - 1) // 2  # the label line the row's range sits on
    for i, row in enumerate(labels):
        for k in range(len(row[0])):
            left = (rows[i] if k == middle else "").ljust(margin)
            out.append(left + "|" + "|".join(c[k].center(w) for c, w in zip(row, width)) + "|")
        out.append(border)
    if empty:
        out.append(f"(ranks {empty} hold empty blocks)")
    return ["  " + line for line in out]
