"""``parallelize_module`` (a plan of styles) and ``parallelize`` (the Megatron plan for
dtensor.nn Transformers, with data parallelism and FSDP on a 2-D mesh)."""
from __future__ import annotations

import os
from contextlib import ExitStack
from fnmatch import fnmatchcase

import numpy as np

from dtensor import autograd
# _redistribute: FSDP's gathers are layouts the framework derived itself (no agreement check).
from dtensor.dtensor import (DTensor, DTensorSpec, _agreed, _from_local, _redistribute,
                             distribute_tensor, implicit_replication)
from dtensor.mesh import DeviceMesh
from dtensor.nn.module import Module
from dtensor.ops.registry import Op
from dtensor.parallel.loss import loss_parallel as _loss_parallel
from dtensor.parallel.style import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                    PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                    distribute_param, wrap_forward)
from dtensor.placements import Partial, Replicate, Shard
from dtensor.redistribute import redistribute_local
from dtensor.tensor import Tensor, TensorMethods
from dtensor.validate import as_bool

__all__ = ["parallelize_module", "parallelize", "replicate"]

_PLAN_EXAMPLE = """    from dtensor.parallel import *
    parallelize_module(model, mesh, {
        "layers.*.fc1": ColwiseParallel(use_local_output=False),
        "layers.*.fc2": RowwiseParallel(use_local_output=False),
    })"""


def _tp_dim(mesh: DeviceMesh, tp_dim) -> int:
    if mesh.ndim > 2:
        raise ValueError(f"tensor parallelism takes a 1-D mesh or a 2-D ('dp', 'tp') mesh; got a "
                         f"{mesh.ndim}-D mesh {mesh._dims_text()}. Build it with "
                         f"init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp')).")
    if tp_dim is not None:
        return mesh._dim(tp_dim)
    if mesh.ndim == 1:
        return 0
    if not mesh.mesh_dim_names or "tp" not in mesh.mesh_dim_names:
        raise ValueError(f"on a 2-D mesh {mesh._dims_text()} say which dim is tensor-parallel: "
                         f"name it 'tp' (mesh_dim_names=('dp', 'tp')) or pass tp_dim=.")
    return mesh._dim("tp")


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


def _matches(pattern: str, path: str) -> bool:
    """fnmatch per dotted atom, as PyTorch: ``blocks.*.attn.q`` has ``*`` stand for one atom."""
    pa, na = pattern.split("."), path.split(".")
    return len(pa) == len(na) and all(fnmatchcase(n, p) for p, n in zip(pa, na))


def parallelize_module(module: Module, device_mesh: DeviceMesh, parallelize_plan=None, *,
                       tp_dim: int | str | None = None) -> Module:
    """Apply parallel styles to ``module``'s submodules, in plan order.

    Args:
        parallelize_plan: a ParallelStyle (applied to ``module`` itself) or a dict from module
            paths to styles; a path may use fnmatch wildcards per dotted atom
            (``"blocks.*.attn.q"``). A key that matches no submodule raises ValueError.
        tp_dim: on a 2-D mesh, the tensor-parallel dim; the plan goes on it and the model is
            data parallel over the other (``replicate``), as PyTorch's
            ``parallelize_module(m, mesh["tp"], plan)`` + data parallel over ``mesh["dp"]``. A
            2-D mesh without ``tp_dim`` is refused, as in PyTorch.

    Example (under ``dtlaunch --nproc 2``):
        >>> mesh = init_device_mesh("cpu", (2,))
        >>> parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    """
    _check_targets("parallelize_module", module, device_mesh)

    def check():
        if device_mesh.ndim == 2 and tp_dim is None:
            raise ValueError(
                f"parallelize_module takes the 1-D tensor-parallel mesh, got a 2-D mesh "
                f"{device_mesh._dims_text()}: the plan alone would leave the other dim's ranks "
                f"training apart (each on its own rows, gradients never combined). Either pass "
                f"the tp sub-mesh and add data parallelism:\n"
                f"    parallelize_module(model, mesh[\"tp\"], plan)\n"
                f"    model = replicate(model, mesh[\"dp\"])\n"
                f"or say which dim is tensor-parallel and get both in one call:\n"
                f"    parallelize_module(model, mesh, plan, tp_dim=\"tp\")")
        tp = _tp_dim(device_mesh, tp_dim)
        return tp, _plan_hits(module, parallelize_plan)

    tp, hits = _agree(device_mesh, "parallelize_module", check, plan=parallelize_plan,
                      tp_dim=tp_dim, params=_params_text(module))
    if device_mesh.ndim == 2:
        parallelize_module(module, device_mesh._sub([tp]), parallelize_plan)
        return replicate(module, device_mesh._sub([1 - tp]))
    for style, name, m in hits:
        style.apply(m, device_mesh, tp, name)
    return module


def _plan_hits(module: Module, plan) -> list:
    """(style, path, submodule) for every submodule a plan applies to, in plan order."""
    if plan is None:
        return []
    if isinstance(plan, ParallelStyle):
        return [(plan, "", module)]
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict of module path -> "
                        f"ParallelStyle, got {type(plan).__name__}:\n{_PLAN_EXAMPLE}")
    named = list(module.named_modules())
    out, claimed = [], {}
    for key, style in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"plan key {key!r} must be a dotted module path such as "
                            f"'blocks.*.attn.q', got type {type(key).__name__}.")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan key {key!r}: {style!r} is not a ParallelStyle (use "
                            f"ColwiseParallel(), RowwiseParallel(), SequenceParallel(), ...).")
        hits = [(name, m) for name, m in named if _matches(key, name)]
        if not hits:
            paths = [n for n, _ in named if n][:12]
            raise ValueError(f"plan key {key!r} matches no submodule of {type(module).__name__}; "
                             f"its module paths include {paths}. Keys are dotted paths with "
                             f"fnmatch wildcards per atom, e.g. 'blocks.*.attn.q'.")
        for name, m in hits:
            if name in claimed:  # two styles would shard one module twice, or undo each other
                raise ValueError(f"plan keys {claimed[name]!r} and {key!r} both match module "
                                 f"{name!r} ({type(m).__name__}); give each module one style: "
                                 f"narrow the wildcard or drop one key.")
            claimed[name] = key
        out += [(style, name, m) for name, m in hits]
    return out


# ----------------------------------------------------------------------------- parallelize


def _gpt_parts(model) -> dict:
    """The Transformer pieces parallelize() knows, or a TypeError that shows how to pass a plan."""
    try:
        blocks = list(model.blocks)
        attn, mlp = blocks[0].attn, blocks[0].mlp
        parts = dict(n_head=attn.n_head, n_embd=attn.q.in_features,
                     hidden=mlp.fc1.out_features, vocab=model.wte.num_embeddings,
                     n_layer=len(blocks))
        for b in blocks:
            b.ln1, b.ln2, b.attn.k, b.attn.v, b.attn.proj, b.mlp.fc2  # noqa: B018 (presence)
        model.wpe, model.ln_f, model.lm_head  # noqa: B018
    except (AttributeError, TypeError, IndexError) as e:
        raise TypeError(
            f"parallelize() recognises dtensor.nn.GPT-shaped models (wte, wpe, blocks[i].ln1/"
            f"attn.q/k/v/proj/ln2/mlp.fc1/fc2, ln_f, lm_head); {type(model).__name__} is not one "
            f"({e}). Describe its layout with a plan instead:\n{_PLAN_EXAMPLE}") from None
    return parts


def _check_divisible(parts: dict, tp: int) -> None:
    if parts["n_head"] % tp:
        raise ValueError(
            f"tp={tp} does not divide n_head={parts['n_head']}: column-parallel q/k/v give each "
            f"rank whole attention heads (the (B, T, C) -> (B, T, heads, head_dim) reshape keeps "
            f"the heads dim sharded only if the heads split evenly). Pick tp from the divisors "
            f"of {parts['n_head']}.")


def gpt_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The Megatron-LM plan over the "tp" dim for a dtensor.nn.GPT.

    Attention and MLP each take one whole (Replicate) input at a PrepareModuleInput boundary,
    so the backward reduces the three q/k/v input gradients with one all-reduce; with sequence
    parallelism the residual stream is Shard(1) and those boundaries are all-gathers forward and
    reduce-scatters backward.
    """
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream,
                               use_local_output=False),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(stream,),
                                            desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.q": ColwiseParallel(use_local_output=False),
        "blocks.*.attn.k": ColwiseParallel(use_local_output=False),
        "blocks.*.attn.v": ColwiseParallel(use_local_output=False),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=stream, use_local_output=False),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(stream,),
                                           desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc1": ColwiseParallel(use_local_output=False),
        "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=stream, use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=stream,
                                   output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=False),
    }
    if sequence_parallel:
        for key in ("drop", "blocks.*.ln1", "blocks.*.ln2", "ln_f"):
            plan[key] = SequenceParallel()
    else:
        # ln_f's output feeds only lm_head: a boundary there all-reduces lm_head's input gradient
        # before ln_f's backward (Megatron's "f"), so ln_f's weight gradient is whole.
        plan["ln_f"] = PrepareModuleOutput(output_layouts=(Replicate(),),
                                           desired_output_layouts=(Replicate(),),
                                           use_local_output=False)
    return plan


def _fsdp_dim(p: DTensor, tp: int | None) -> int:
    """The tensor dim FSDP shards over "dp": dim 0, or dim 1 when "tp" shards dim 0 of a
    matrix, so gathering it is a plain all-gather over "dp". A vector "tp" already shards
    (a column-parallel bias) is nested-sharded on dim 0; the redistribute table orders that."""
    taken = p.placements[tp].dim if tp is not None and isinstance(p.placements[tp], Shard) else None
    return 1 if taken == 0 and p.ndim > 1 else 0


def _shard_params_fsdp(model: Module, mesh: DeviceMesh, dp: int, tp: int | None) -> None:
    """Store every parameter Shard(k) over "dp"; gather it (a differentiable redistribute, so
    the backward reduce-scatters the gradient) for the duration of its module's forward."""
    for _, m in model.named_modules():
        names = [n for n, p in m._parameters.items() if p is not None]
        if not names:
            continue
        for n in names:  # parallelize() made every parameter a DTensor already
            distribute_param(m, n, mesh, dp, Shard(_fsdp_dim(m._parameters[n], tp)))

        def around(inner, *args, _m=m, _names=tuple(names), **kwargs):
            stored = {n: _m._parameters[n] for n in _names}
            for n, p in stored.items():
                gathered = list(p.placements)
                gathered[dp] = Replicate()
                _m._parameters[n] = _redistribute(p, gathered, boundary=True)
            try:
                return inner(*args, **kwargs)
            finally:
                _m._parameters.update(stored)

        wrap_forward(m, around)


def _plain(x) -> bool:
    """A plain array input: the global batch, the same on every rank (not a DTensor)."""
    return not isinstance(x, DTensor) and isinstance(x, (TensorMethods, np.ndarray))


def _check_batch(inputs: dict, mesh: DeviceMesh, dp: int | None, tp: int | None,
                 sequence_parallel: bool) -> None:
    """The user's batch, checked before the plan lays it out: each "dp" rank takes
    batch / dp whole rows (the (B, T, C) -> (B * T, C) reshapes keep dim 0 sharded only for
    equal blocks), and under sequence parallelism each "tp" rank needs some positions.
    Otherwise the error would come from a reshape deep inside the model."""
    for name, x in inputs.items():
        shape = tuple(x.shape)
        if dp is not None and shape and shape[0] % mesh.size(dp):
            n = mesh.size(dp)
            raise ValueError(
                f"parallelize: {name} of shape {shape} has batch size {shape[0]}, which mesh "
                f"dim 'dp' of size {n} cannot split evenly (each dp rank takes batch / {n} "
                f"rows). Use a batch size that is a multiple of {n}, e.g. "
                f"{max(n, shape[0] - shape[0] % n)}.")
        if sequence_parallel and tp is not None and len(shape) >= 2:
            n, t = mesh.size(tp), shape[1]
            if (n - 1) * -(-t // n) >= t:
                raise ValueError(
                    f"parallelize(sequence_parallel=True): {name} has shape {shape}: its "
                    f"sequence length {t} leaves some of the {n} ranks of mesh dim 'tp' without "
                    f"positions (Shard(1) gives each ceil({t} / {n}) of them). Use a sequence "
                    f"length that is a multiple of {n}, or sequence_parallel=False.")


def _batch_input(x, mesh: DeviceMesh, dp: int | None):
    """A plain array input is the global batch (the same on every rank): each "dp" rank keeps
    its rows. DTensors (say, from_local of per-rank batches) pass through."""
    if not _plain(x):
        return x
    placements = [Replicate()] * mesh.ndim
    if dp is not None and len(x.shape):
        placements[dp] = Shard(0)
    return distribute_tensor(x, mesh, placements, src_data_rank=None)


def _describe(model: Module, plan: dict, mesh: DeviceMesh, fsdp: bool) -> str:
    lines = [f"parallelize: mesh {mesh._dims_text()}{', fsdp' if fsdp else ''}; plan:"]
    lines += [f"  {k:22s} {v!r}" for k, v in plan.items()]
    lines.append("  parameters:")
    for name, p in model.named_parameters():
        where = list(p.placements) if isinstance(p, DTensor) else "local"
        lines.append(f"    {name:28s} {tuple(p.shape)} {where}")
    return "\n".join(lines)


def parallelize(model: Module, mesh: DeviceMesh, *, sequence_parallel: bool = False,
                loss_parallel: bool = True, fsdp: bool = False) -> Module:
    """Parallelize a dtensor.nn Transformer over ``mesh``, in place; returns the model.

    * "tp" dim: the Megatron plan (``gpt_plan``): q/k/v and fc1 column-parallel, proj and fc2
      row-parallel, the token embedding vocab-parallel, lm_head column-parallel with the
      vocab-parallel loss (``loss_parallel``); norms replicated, or sequence-parallel with
      ``sequence_parallel=True``.
    * "dp" dim: plain array inputs are the global batch and each "dp" rank takes its rows
      (Shard(0)); parameters are Replicate over "dp" and their gradients are all-reduced when
      stored, or, with ``fsdp=True``, parameters and optimizer state are Shard over "dp",
      all-gathered for each module's forward and their gradients reduce-scattered.

    A 1-D mesh is "tp" unless its dim is named "dp". With DTENSOR_DEBUG=1 rank 0 prints the
    plan and every parameter's placements.

    Example (under ``dtlaunch --nproc 4``):
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> model = parallelize(GPT(cfg), mesh, sequence_parallel=True)
        >>> logits, loss = model(idx, targets)   # idx, targets: the global batch
    """
    _check_targets("parallelize", model, mesh)
    flags = dict(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, fsdp=fsdp)

    def check():
        for k, v in flags.items():
            as_bool(v, f"parallelize: {k}")
        if mesh.ndim > 2:
            _tp_dim(mesh, None)  # raises with the fix
        names = mesh.mesh_dim_names or ()
        if mesh.ndim == 2 and not {"dp", "tp"} <= set(names):
            raise ValueError(f"parallelize on a 2-D mesh needs dims named 'dp' and 'tp', got "
                             f"{mesh._dims_text()}; use init_device_mesh('cpu', (dp, tp), "
                             f"mesh_dim_names=('dp', 'tp')).")
        dp = mesh._dim("dp") if "dp" in names else None
        tp = None if (mesh.ndim == 1 and dp == 0) else _tp_dim(mesh, None)
        if fsdp and dp is None:
            raise ValueError(f"fsdp=True shards parameters over a 'dp' mesh dim, and mesh "
                             f"{mesh._dims_text()} has none; name one 'dp'.")
        plan, hits = {}, []
        if tp is not None:
            _check_divisible(_gpt_parts(model), mesh.size(tp))
            plan = gpt_plan(sequence_parallel, loss_parallel)
            hits = _plan_hits(model, plan)
        return dp, tp, plan, hits

    dp, tp, plan, hits = _agree(mesh, "parallelize", check, params=_params_text(model), **flags)
    for style, name, m in hits:
        style.apply(m, mesh, tp, name)
    for _, m in model.named_modules():  # what the plan left: Replicate everywhere
        for n, p in list(m._parameters.items()):
            if p is not None and not isinstance(p, DTensor):
                distribute_param(m, n, mesh, 0, Replicate())
    if fsdp:
        _shard_params_fsdp(model, mesh, dp, tp)

    def around(inner, *args, **kwargs):
        inputs = {f"argument {i}": a for i, a in enumerate(args) if _plain(a)}
        inputs.update((f"argument {k!r}", v) for k, v in kwargs.items() if _plain(v))
        _agree(mesh, "parallelize: the model's forward",
               lambda: _check_batch(inputs, mesh, dp, tp, sequence_parallel),
               batch=[(k, tuple(v.shape), str(v.dtype)) for k, v in inputs.items()])
        args = tuple(_batch_input(a, mesh, dp) for a in args)
        kwargs = {k: _batch_input(v, mesh, dp) for k, v in kwargs.items()}
        with ExitStack() as stack:
            stack.enter_context(implicit_replication())  # position ids are a plain arange
            if loss_parallel and tp is not None:
                stack.enter_context(_loss_parallel())
            return inner(*args, **kwargs)

    wrap_forward(model, around)
    if os.environ.get("DTENSOR_DEBUG", "0") not in ("", "0") and mesh.get_rank() == 0:
        print(_describe(model, plan, mesh, fsdp), flush=True)
    return model


# ----------------------------------------------------------------------------- replicate


def _summed(g, mesh: DeviceMesh):
    """``g``'s block summed over the data-parallel ranks: each rank's block is one partial of
    a Partial(sum) value on ``mesh``, made whole by the redistribute table (so a compiled step
    traces it as a collective like any other)."""
    local = g._loc() if isinstance(g, DTensor) else g.data
    spec = DTensorSpec(mesh, (Partial(),), tuple(local.shape), np.dtype(local.dtype))
    whole = redistribute_local(local, spec, (Replicate(),))
    return DTensor._make(whole, g._spec) if isinstance(g, DTensor) else Tensor._wrap(whole)


# Identity forward; the backward sums the gradient over the data-parallel ranks (DDP's
# all-reduce, per parameter, as an autograd node, so it runs wherever the backward does).
_DP_GRAD_SUM = Op("dp_grad_sum", impl=None, abstract=None, linearity="all", lower="collective",
                  vjp=lambda g, out, x, mesh: (_summed(g, mesh),))


def _grad_summed(p, mesh: DeviceMesh):
    out = DTensor._make(p._loc(), p._spec) if isinstance(p, DTensor) else Tensor._wrap(p.data)
    if autograd.is_grad_enabled() and p.requires_grad:
        autograd.record(_DP_GRAD_SUM, (p,), {"mesh": mesh}, out)
    return out


def _check_rows(batch: dict, mesh: DeviceMesh) -> None:
    """Each rank takes batch / n whole rows of every batch input (the loss averages over equal
    shares); a DTensor input must live on the data-parallel mesh."""
    n = mesh.size()
    for name, x in batch.items():
        if isinstance(x, DTensor) and x.device_mesh != mesh:
            raise ValueError(f"replicate: {name} is a DTensor on {x.device_mesh}, not on the "
                             f"data-parallel mesh {mesh}; pass the global batch as an array or "
                             f"DTensor.from_local(rows, mesh['dp'], [Shard(0)]).")
        rows = x.shape[0] if len(x.shape) else None
        if rows is not None and rows % n:
            raise ValueError(
                f"replicate: {name} of shape {tuple(x.shape)} has batch size {rows}, which the "
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


def replicate(module: Module, device_mesh: DeviceMesh) -> Module:
    """Data parallelism over a 1-D mesh, PyTorch's composable ``replicate`` (DDP): every rank
    holds the whole model (or its tensor-parallel shard, after ``parallelize_module`` on the
    other mesh dim) and computes on its share of the batch; each parameter's gradient is summed
    over the mesh as the backward reaches it.

    Inputs: a plain array is the global batch (each rank takes batch / n rows); a DTensor on
    ``device_mesh`` gives each rank its Shard(0) rows. Outputs come back as DTensors on
    ``device_mesh``: a 0-d output is taken for a loss averaged over the rank's rows, so it comes
    back as the global average (Partial over the ranks: ``.item()`` reads the one-process value,
    ``.backward()`` gives the one-process gradients); an output with a row per input row is
    Shard(0); anything else stays this rank's own.

    Example (under ``dtlaunch --nproc 4``):
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> parallelize_module(model, mesh["tp"], plan)
        >>> model = replicate(model, mesh["dp"])
        >>> logits, loss = model(idx, targets)      # the global batch
    """
    _check_targets("replicate", module, device_mesh)

    def check():
        if device_mesh.ndim != 1:
            raise ValueError(f"replicate takes a 1-D data-parallel mesh, got "
                             f"{device_mesh._dims_text()}; pass mesh['dp'].")

    _agree(device_mesh, "replicate", check, params=_params_text(module))
    if device_mesh.size() == 1:
        return module

    def around(inner, *args, **kwargs):
        batch = {f"argument {i}": a for i, a in enumerate(args) if _batch(a)}
        batch.update((f"argument {k!r}", v) for k, v in kwargs.items() if _batch(v))
        # One agreement per forward, as parallelize's: the outputs' layouts follow from it.
        _agree(device_mesh, "replicate: the model's forward",
               lambda: _check_rows(batch, device_mesh),
               batch=[(k, tuple(v.shape), str(v.dtype)) for k, v in batch.items()])
        args = tuple(_local_rows(a, device_mesh) if _batch(a) else a for a in args)
        kwargs = {k: _local_rows(v, device_mesh) if _batch(v) else v for k, v in kwargs.items()}
        rows = next((a.shape[0] for a in (*args, *kwargs.values()) if _batch(a) and a.ndim),
                    None)
        owners = [(m, name, p) for m in module.modules()
                  for name, p in m._parameters.items() if p is not None]
        stored = {(id(m), name): p for m, name, p in owners}
        summed = {id(p): _grad_summed(p, device_mesh) for _, _, p in owners}
        for m, name, p in owners:
            m._parameters[name] = summed[id(p)]  # a tied parameter: one node, one all-reduce
        try:
            out = inner(*args, **kwargs)
        finally:
            for m, name, _ in owners:
                m._parameters[name] = stored[(id(m), name)]
        return _dp_outputs(out, device_mesh, rows)

    wrap_forward(module, around)
    return module


def _batch(x) -> bool:
    return isinstance(x, (DTensor, TensorMethods, np.ndarray))


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
