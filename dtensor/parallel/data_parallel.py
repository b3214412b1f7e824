"""Data parallelism for any module, PyTorch's composable way.

``replicate(module, mesh=dp)`` (DDP): every rank keeps whole parameters; the gradients are summed
over the data-parallel ranks in buckets, one all-reduce of a flat buffer per bucket, started
when the bucket's last gradient is ready and finished before ``backward()`` returns.

``fully_shard(module, mesh=dp)`` (FSDP2): the module's parameters (those no inner fully_shard
manages) are stored Shard(0) over "dp", so the optimizer state is sharded too; they are
all-gathered for the module's forward and freed after it, and their gradients are
reduce-scattered in the backward. The gather is a differentiable redistribute
(Shard -> Replicate), so the reduce-scatter is its backward; ``parallelize(fsdp=True)`` uses
the same ``_ShardedParams`` on its one 2-D mesh.

Both compose with tensor parallelism applied first on another dim of the same mesh
(``parallelize_module(model, mesh["tp"], plan)``): the module still sees the "tp" DTensors the
styles made; fully_shard stores every parameter on the whole parent mesh with "dp" innermost,
a "tp" parameter sharded over "dp" inside its "tp" block.

Batch and outputs: the outermost data-parallel module of a forward takes a plain array input
for the global batch (each rank keeps batch / n rows) and hands back a 0-d float output (a
loss averaged over the rank's rows) as the global average, Partial over "dp", and an output
with a row per input row as Shard(0); inner fully_shard'ed modules only gather.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from dtensor import autograd
from dtensor._flag import Flag
from dtensor.dtensor import DTensor, DTensorSpec, _agreed, _from_local, _redistribute
from dtensor.mesh import DeviceMesh
from dtensor.nn.module import Module, Parameter
from dtensor.ops import registry
from dtensor.ops.registry import Op
from dtensor.parallel.style import wrap_forward
from dtensor.placements import Partial, Replicate, Shard, StridedShard
from dtensor.redistribute import redistribute_local
from dtensor.tensor import Tensor, TensorMethods
from dtensor.validate import as_bool, as_real

__all__ = ["replicate", "fully_shard"]


# ----------------------------------------------------------------------------- checks

def _check_targets(what: str, module, mesh) -> None:
    if not isinstance(module, Module):
        raise TypeError(f"{what}: the model must be a dtensor.nn.Module, got {module!r} (type "
                        f"{type(module).__name__}).")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: the mesh must be a DeviceMesh (init_device_mesh('cpu', "
                        f"shape, mesh_dim_names=...)), got {mesh!r} (type {type(mesh).__name__}).")


def _agree(mesh: DeviceMesh, what: str, check, **fields):
    """``check()`` (this rank's validation; returns what it checked), agreed over the mesh: a
    rank whose arguments or model differ, or whose check failed, makes every rank raise the
    same error, before any collective that would otherwise hang or mix layouts."""
    return _agreed(mesh, what, check, "Build the same model and call this with the same "
                   "arguments on every rank.", **fields)


def _params_text(module: Module) -> list:
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]


def _dp_mesh(what: str, mesh, device_mesh) -> DeviceMesh:
    """The data-parallel mesh from ``mesh=`` (the issue's and FSDP2's spelling) or
    ``device_mesh=`` (composable replicate's)."""
    if mesh is not None and device_mesh is not None and mesh is not device_mesh:
        raise ValueError(f"{what}: got both mesh={mesh} and device_mesh={device_mesh}; pass "
                         f"one of them.")
    mesh = mesh if mesh is not None else device_mesh
    if mesh is None:
        raise TypeError(f"{what} needs the data-parallel mesh: {what}(model, mesh=mesh['dp']).")
    return mesh


def _check_1d(what: str, mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"{what} takes a 1-D data-parallel mesh, got {mesh._dims_text()}; pass "
                         f"mesh['dp'] (and put tensor parallelism on mesh['tp'] first).")


def _claim(what: str, module: Module) -> None:
    if "_data_parallel" in module.__dict__:
        raise ValueError(f"{what}: {type(module).__name__} is already under "
                         f"{module.__dict__['_data_parallel']}; apply data parallelism to a "
                         f"module once.")


# ----------------------------------------------------------------------------- batch, outputs

_in_forward = Flag(False)  # a data-parallel forward is running: inner modules only gather


def _batch(x) -> bool:
    return isinstance(x, (DTensor, TensorMethods, np.ndarray))


def _check_rows(what: str, batch: dict, mesh: DeviceMesh) -> None:
    """Each rank takes batch / n whole rows of every batch input (the loss averages over equal
    shares); a DTensor input must live on the data-parallel mesh."""
    n = mesh.size()
    for name, x in batch.items():
        if isinstance(x, DTensor) and x.device_mesh != mesh:
            raise ValueError(f"{what}: {name} is a DTensor on {x.device_mesh}, not on the "
                             f"data-parallel mesh {mesh}; pass the global batch as an array or "
                             f"DTensor.from_local(rows, mesh['dp'], [Shard(0)]).")
        rows = x.shape[0] if len(x.shape) else None
        if rows is not None and rows % n:
            raise ValueError(
                f"{what}: {name} of shape {tuple(x.shape)} has batch size {rows}, which the "
                f"{n} data-parallel ranks of {mesh._dims_text()} cannot split evenly (each "
                f"takes batch / {n} rows, and the loss averages over equal shares). Use a batch "
                f"size that is a multiple of {n}, e.g. {max(n, rows - rows % n)}.")


def _local_rows(x, mesh: DeviceMesh):
    """This rank's rows of a checked batch input: a plain array is the global batch; a DTensor
    (``DTensor.from_local(rows, mesh, [Shard(0)])``) is laid out as Shard(0)."""
    if isinstance(x, DTensor):
        return _redistribute(x, (Shard(0),)).to_local() if x.ndim else x.full_tensor()
    if not len(x.shape):
        return x
    k = x.shape[0] // mesh.size()
    r = mesh.get_local_rank()
    return x[r * k:(r + 1) * k]


def _take_rows(what: str, mesh: DeviceMesh, args: tuple, kwargs: dict):
    """The forward's arguments with each batch input cut to this rank's rows, and their count."""
    batch = {f"argument {i}": a for i, a in enumerate(args) if _batch(a)}
    batch.update((f"argument {k!r}", v) for k, v in kwargs.items() if _batch(v))
    # One agreement per forward: the outputs' layouts follow from it.
    _agree(mesh, f"{what}: the model's forward", lambda: _check_rows(what, batch, mesh),
           batch=[(k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()])
    args = tuple(_local_rows(a, mesh) if _batch(a) else a for a in args)
    kwargs = {k: _local_rows(v, mesh) if _batch(v) else v for k, v in kwargs.items()}
    rows = next((a.shape[0] for a in (*args, *kwargs.values()) if _batch(a) and a.ndim), None)
    return args, kwargs, rows


def _dp_outputs(out, mesh: DeviceMesh, rows):
    if isinstance(out, (tuple, list)):
        return type(out)(_dp_outputs(o, mesh, rows) for o in out)
    if not isinstance(out, TensorMethods):
        return out
    if isinstance(out, DTensor):  # the tensor-parallel model's own output: whole on this rank
        out = out.full_tensor()
    dtype = np.dtype(out.dtype)
    if out.ndim == 0 and dtype.kind == "f":
        share = out * (1.0 / mesh.size())
        return _from_local(share, share.data, DTensorSpec(mesh, (Partial(),), (), dtype))
    if out.ndim and rows is not None and out.shape[0] == rows:
        shape = (rows * mesh.size(),) + tuple(out.shape[1:])
        return _from_local(out, out.data, DTensorSpec(mesh, (Shard(0),), shape, dtype))
    return out


def _owners(module: Module, skip: set) -> list:
    """(owner module, name, parameter) of every parameter under ``module`` not in ``skip``; a
    tied parameter appears once per owner."""
    return [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
            if p is not None and id(p) not in skip]


def _unique(owners: list) -> list:
    seen, out = set(), []
    for _, _, p in owners:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _install(what: str, module: Module, mesh: DeviceMesh, swap) -> None:
    """``module``'s forward runs inside ``swap(outermost)`` (a context manager that puts the
    parameters the module computes with in place); the outermost data-parallel module of a
    forward also lays out the batch and the outputs."""
    def around(inner, *args, **kwargs):
        outer = not _in_forward.on
        rows = None
        if outer:
            args, kwargs, rows = _take_rows(what, mesh, args, kwargs)
        with _in_forward.set(True), swap(outer):
            out = inner(*args, **kwargs)
        return _dp_outputs(out, mesh, rows) if outer else out

    wrap_forward(module, around)


@contextmanager
def _swapped(owners: list, values: dict):
    """Each owner's parameter replaced by ``values[id(parameter)]`` for the block."""
    for m, name, p in owners:
        m._parameters[name] = values[id(p)]
    try:
        yield
    finally:
        for m, name, p in owners:
            m._parameters[name] = p


# ----------------------------------------------------------------------------- fully_shard

_LOCAL = "local"  # the module computes with the gathered parameter's local block, a Tensor


def _view_vjp(g, out, full):
    # The module's gradient of the gathered block is this rank's share of the sum over "dp"
    # (the innermost storage dim): Partial there, so the gather's backward reduce-scatters it.
    # Over the storage dims the module's mesh does not have, every rank computed it whole.
    local, placements = (g._loc(), g.placements) if isinstance(g, DTensor) else (g.data, ())
    mesh = full.device_mesh
    whole = (Replicate(),) * (mesh.ndim - 1 - len(placements))
    spec = DTensorSpec(mesh, whole + tuple(placements) + (Partial(),), full.shape,
                       np.dtype(g.dtype))
    return (DTensor._make(local, spec),)


# The gathered parameter as the module saw it before fully_shard: its local block (a plain
# parameter) or a DTensor on the tensor-parallel mesh; no data moves either way.
_FSDP_VIEW = Op("fsdp_view", impl=None, abstract=None, linearity="all", vjp=_view_vjp)


def _as_view(full: DTensor, view):
    local = full._loc()
    if view == _LOCAL:
        out = Tensor._wrap(local)
    else:
        out = DTensor._make(local, DTensorSpec(view, full.placements[-1 - view.ndim:-1],
                                               full.shape, full.dtype))
    if autograd.is_grad_enabled() and full.requires_grad:
        autograd.record(_FSDP_VIEW, (full,), {}, out)
    return out


def _set_data(t, local) -> None:
    if isinstance(t, DTensor):
        t._set_local(local)
    else:
        t.data = local


class _ShardedParams:
    """Parameters stored sharded over data-parallel mesh dim ``dp`` of their storage mesh, and
    how one module's forward sees them: gathered over ``dp`` (the rest of the layout kept),
    then shown as ``view`` (None: the gathered DTensor itself; ``_LOCAL``: its local block; a
    mesh: a DTensor on that mesh, the storage mesh less its last dim)."""

    def __init__(self, owners: list, dp: dict, views: dict):
        self.owners, self.dp, self.views = owners, dp, views
        self.params = _unique(owners)

    def _gathered_placements(self, p):
        out = list(p.placements)
        out[self.dp[id(p)]] = Replicate()
        return tuple(out)

    @contextmanager
    def gathered(self, reshard: bool):
        full = {id(p): _redistribute(p, self._gathered_placements(p), boundary=True)
                for p in self.params}
        seen = {k: f if self.views[k] is None else _as_view(f, self.views[k])
                for k, f in full.items()}
        with _swapped(self.owners, seen):
            yield
        if reshard and autograd.is_grad_enabled() and registry._trace is None:
            for p in self.params:
                self._free(p, full[id(p)], seen[id(p)])

    def _free(self, p, full: DTensor, seen) -> None:
        """Drop the gathered block now; the backward gathers it again where it first needs it
        (a vjp that reads the parameter), as FSDP's reshard_after_forward."""
        if not seen.requires_grad:
            return
        placements = self._gathered_placements(p)
        local = full._loc()
        empty = np.broadcast_to(np.zeros((), local.dtype), local.shape)
        _set_data(full, empty)
        _set_data(seen, empty)

        def fill():
            again = redistribute_local(p._loc(), p._spec, placements)
            _set_data(full, again)
            _set_data(seen, again)

        autograd.refill_before_backward(seen, fill)


def _stored(p, mesh: DeviceMesh, placements: tuple, source: tuple) -> DTensor:
    """``p`` (whole over "dp", laid out as ``source`` on ``mesh``) as its block of
    ``placements``: a local slice, no communication."""
    local = p._loc() if isinstance(p, DTensor) else p.data
    spec = DTensorSpec(mesh, source, tuple(p.shape), np.dtype(p.dtype))
    block = redistribute_local(local, spec, placements)
    return Parameter(DTensor._make(block, DTensorSpec(mesh, placements, tuple(p.shape),
                                                      np.dtype(p.dtype))))


def _fsdp_layout(name: str, p, mesh: DeviceMesh):
    """(storage mesh, stored placements, view) of parameter ``name`` under fully_shard over
    the 1-D mesh ``mesh``, a dim of a root mesh (itself when built whole). Every parameter is
    stored on the whole root, its dims reordered as (others..., the parameter's own mesh's...,
    "dp"): Replicate over the others, the tensor-parallel layout kept, Shard(0) over "dp".
    Covering the root keeps one writer per block in a checkpoint and one mesh for every
    parameter; "dp" innermost splits the "tp" block, so gathering it is one all-gather over
    "dp" whatever "tp" shards (PyTorch reaches the same with _StridedShard on ("dp", "tp"))."""
    # Shard(0), or the first dim no "tp" StridedShard splits (its dp pieces would not be one
    # range of the global tensor); a 0-d parameter, or a vector "tp" splits strided, is
    # replicated and its gradient all-reduced.
    strided = {q.dim for q in getattr(p, "placements", ()) if isinstance(q, StridedShard)}
    free = [d for d in range(p.ndim) if d not in strided]
    split = Shard(free[0]) if free else Replicate()
    root, ddims = mesh._root
    if isinstance(p, DTensor):
        own = p.device_mesh
        oroot, dims = own._root
        if oroot != root or set(dims) & set(ddims):
            why = ("it is already laid out over the data-parallel mesh" if oroot == root else
                   "its mesh and the data-parallel mesh are not slices of one mesh")
            raise ValueError(
                f"fully_shard: parameter {name!r} is a DTensor on {own} ({list(p.placements)}):"
                f" {why}, so it cannot be sharded over {mesh}. Apply data parallelism once, "
                f"over a sibling of the tensor-parallel mesh: mesh = init_device_mesh('cpu', "
                f"(dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(model, "
                f"mesh['tp'], plan); fully_shard(model, mesh=mesh['dp']).")
        placements, view = tuple(p.placements), own
    else:
        dims, placements, view = (), (), _LOCAL
    others = tuple(d for d in range(root.ndim) if d not in dims and d not in ddims)
    storage = root._sub(others + tuple(dims) + tuple(ddims))
    return storage, (Replicate(),) * len(others) + placements + (split,), view


def fully_shard(module: Module, *, mesh: DeviceMesh, reshard_after_forward: bool = True
                ) -> Module:
    """Fully sharded data parallelism (PyTorch's FSDP2 ``fully_shard``) over a 1-D mesh.

    The parameters of ``module`` that no earlier ``fully_shard`` of a submodule manages become
    DTensors stored Shard(0) over ``mesh`` (a parameter tensor parallelism made a DTensor on a
    sibling mesh, ``mesh["tp"]``, is stored on the parent mesh, sharded over both), so
    ``model.parameters()``, the optimizer built from them and its state are sharded. Before
    ``module``'s forward they are all-gathered (one all-gather each), the forward sees them as
    it did before (plain tensors, or the "tp" DTensors), and their gradients are
    reduce-scattered in the backward, so each rank's ``.grad`` is its block of the sum over the
    data-parallel ranks. Apply it to each block, then to the root, to gather block by block.

    Args:
        mesh: the 1-D data-parallel mesh (``mesh["dp"]``); a mesh of one rank is a no-op.
        reshard_after_forward: free the gathered parameters after the forward and gather them
            again in the backward, where a vjp first reads them; the module that lays out the
            batch (the outermost) keeps them, as FSDP2's root does.

    Inputs and outputs of the outermost data-parallel module follow ``replicate``.

    Example (under ``dtlaunch --nproc 2``):
        >>> dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        >>> for block in model.blocks:
        ...     fully_shard(block, mesh=dp)
        >>> fully_shard(model, mesh=dp)
        >>> logits, loss = model(idx, targets)      # the global batch
    """
    _check_targets("fully_shard", module, mesh)

    def check():
        _check_1d("fully_shard", mesh)
        _claim("fully_shard", module)
        reshard = as_bool(reshard_after_forward, "fully_shard: reshard_after_forward")
        inner = set().union(*(m.__dict__.get("_fsdp_managed", set())
                              for m in module.modules() if m is not module))
        owners = _owners(module, inner)
        names = {id(p): n for n, p in module.named_parameters()}
        return reshard, owners, {id(p): _fsdp_layout(names[id(p)], p, mesh)
                                 for p in _unique(owners)}

    reshard, owners, layouts = _agree(mesh, "fully_shard", check, params=_params_text(module),
                                      reshard_after_forward=reshard_after_forward)
    module.__dict__["_data_parallel"] = f"fully_shard(mesh={mesh})"
    if mesh.size() == 1:
        return module
    stored, dp, views = {}, {}, {}
    for p in _unique(owners):
        storage, placements, view = layouts[id(p)]
        source = placements[:-1] + (Replicate(),)
        new = _stored(p, storage, placements, source)
        stored[id(p)], dp[id(new)], views[id(new)] = new, storage.ndim - 1, view
    owners = [(m, name, stored[id(p)]) for m, name, p in owners]
    for m, name, p in owners:
        m._parameters[name] = p
    module.__dict__["_fsdp_managed"] = set(dp)
    group = _ShardedParams(owners, dp, views)
    _install("fully_shard", module, mesh,
             lambda outer: group.gathered(reshard and not outer))
    return module


# ----------------------------------------------------------------------------- replicate

def _summed(g, mesh: DeviceMesh):
    """``g``'s block summed over the data-parallel ranks: each rank's block is one partial of
    a Partial(sum) value on ``mesh``, made whole by the redistribute table (so a compiled step
    traces it as a collective like any other)."""
    local = g._loc() if isinstance(g, DTensor) else g.data
    spec = DTensorSpec(mesh, (Partial(),), tuple(local.shape), np.dtype(local.dtype))
    whole = redistribute_local(local, spec, (Replicate(),))
    return DTensor._make(whole, g._spec) if isinstance(g, DTensor) else Tensor._wrap(whole)


class _Buckets:
    """DDP's gradient buckets: the parameters in reverse order (the backward produces their
    gradients roughly so), cut into runs of one dtype of at most ``cap`` bytes (a larger
    parameter alone), each summed with one all-reduce of a flat buffer."""

    def __init__(self, params: list, mesh: DeviceMesh, cap: int):
        self.mesh, self.slot, self.sizes, self.dtypes = mesh, {}, [], []
        for p in reversed(params):
            local = p._loc() if isinstance(p, DTensor) else p.data
            n, dtype = int(local.size), np.dtype(local.dtype)
            if not self.sizes or self.dtypes[-1] != dtype or (
                    self.sizes[-1] and (self.sizes[-1] + n) * dtype.itemsize > cap):
                self.sizes.append(0)
                self.dtypes.append(dtype)
            self.slot[id(p)] = (len(self.sizes) - 1, self.sizes[-1])
            self.sizes[-1] += n
        self.count = [0] * len(self.sizes)
        for b, _ in self.slot.values():
            self.count[b] += 1
        self._pass = None  # the running backward's buffers, left counts and handles

    def add(self, p, g):
        """``g``, this rank's gradient of ``p``, into its bucket; the bucket's all-reduce starts
        when it is the last to arrive. Returns the summed gradient, to be read once the
        backward ends."""
        local = g._loc() if isinstance(g, DTensor) else g.data
        if type(local) is not np.ndarray:  # traced by dtensor.compile: one collective each
            return _summed(g, self.mesh)
        if self._pass is None:
            self._pass = ({}, list(self.count), {})
            autograd.queue_callback(self._finish)
        bufs, left, work = state = self._pass
        b, off = self.slot[id(p)]
        if b not in bufs:
            bufs[b] = np.zeros(self.sizes[b], self.dtypes[b])
        bufs[b][off:off + local.size] = local.reshape(-1)
        left[b] -= 1
        if not left[b]:
            self._start(state, b)
        spec, shape = (g._spec if isinstance(g, DTensor) else None), local.shape

        def summed():
            piece = work[b].wait()[off:off + local.size].reshape(shape)
            return DTensor._make(piece, spec) if spec is not None else Tensor._wrap(piece)

        return autograd.Deferred(summed)

    def _start(self, state, b: int) -> None:
        bufs, _, work = state
        work[b] = self.mesh.get_group(0).all_reduce(bufs[b], async_op=True, out=bufs[b])

    def _finish(self) -> None:
        """End of the backward: a bucket some of whose parameters got no gradient (unused in
        this forward: the same on every rank) is reduced now, zeros in their place; then every
        reduction is waited for."""
        state, self._pass = self._pass, None
        bufs, _, work = state
        for b in sorted(bufs):
            if b not in work:
                self._start(state, b)
        for b in sorted(work):
            work[b].wait()


# Identity forward; the backward hands the gradient to the parameter's bucket (DDP's
# all-reduce as an autograd node, so it runs wherever the backward does).
_DP_GRAD_SUM = Op("dp_grad_sum", impl=None, abstract=None, linearity="all", lower="collective",
                  vjp=lambda g, out, x, buckets: (buckets.add(x, g),))


def _grad_summed(p, buckets: _Buckets):
    out = DTensor._make(p._loc(), p._spec) if isinstance(p, DTensor) else Tensor._wrap(p.data)
    if autograd.is_grad_enabled() and p.requires_grad:
        autograd.record(_DP_GRAD_SUM, (p,), {"buckets": buckets}, out)
    return out


def replicate(module: Module, device_mesh: DeviceMesh | None = None, *,
              mesh: DeviceMesh | None = None, bucket_cap_mb: float = 25) -> Module:
    """Data parallelism over a 1-D mesh, PyTorch's composable ``replicate`` (DDP): every rank
    holds the whole model (or its tensor-parallel shard, after ``parallelize_module`` on the
    other mesh dim) and computes on its share of the batch; the gradients are summed over the
    mesh in buckets of about ``bucket_cap_mb`` MiB (parameters in reverse order), one
    non-blocking all-reduce each, started as soon as the bucket's last gradient is computed
    and finished before ``backward()`` returns. A compiled step (``dtensor.compile``) sums each
    gradient with its own all-reduce.

    Inputs: a plain array is the global batch (each rank takes batch / n rows); a DTensor on
    the mesh gives each rank its Shard(0) rows. Outputs come back as DTensors on the mesh: a
    0-d output is taken for a loss averaged over the rank's rows, so it comes back as the
    global average (Partial over the ranks: ``.item()`` reads the one-process value,
    ``.backward()`` gives the one-process gradients); an output with a row per input row is
    Shard(0); anything else stays this rank's own.

    Args:
        mesh / device_mesh: the 1-D data-parallel mesh (either name); one rank is a no-op.
        bucket_cap_mb: the most gradient MiB one all-reduce carries (a larger parameter goes
            alone), as DDP's.

    Example (under ``dtlaunch --nproc 4``):
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> parallelize_module(model, mesh["tp"], plan)
        >>> model = replicate(model, mesh=mesh["dp"])
        >>> logits, loss = model(idx, targets)      # the global batch
    """
    mesh = _dp_mesh("replicate", mesh, device_mesh)
    _check_targets("replicate", module, mesh)

    def check():
        _check_1d("replicate", mesh)
        _claim("replicate", module)
        return as_real(bucket_cap_mb, "replicate: bucket_cap_mb", low=0, high=2 ** 20,
                       fix="It is the most MiB of gradients one all-reduce carries, e.g. 25.")

    cap = _agree(mesh, "replicate", check, params=_params_text(module),
                 bucket_cap_mb=bucket_cap_mb)
    module.__dict__["_data_parallel"] = f"replicate(mesh={mesh})"
    if mesh.size() == 1:
        return module
    owners = _owners(module, set())
    buckets = _Buckets(_unique(owners), mesh, int(cap * 2 ** 20))

    def swap(outer):
        # a tied parameter: one node, one slot in one bucket
        return _swapped(owners, {id(p): _grad_summed(p, buckets) for p in _unique(owners)})

    _install("replicate", module, mesh, swap)
    return module
