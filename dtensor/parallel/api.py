"""``parallelize_module`` (a plan of styles) and ``parallelize`` (any model: a plan found by
dtensor/parallel/planner.py, with data parallelism or FSDP on a 2-D mesh)."""
from __future__ import annotations

import os
from contextlib import ExitStack
from fnmatch import fnmatchcase

import numpy as np

from dtensor.dtensor import DTensor, distribute_tensor, implicit_replication
from dtensor.mesh import DeviceMesh
from dtensor.nn.module import Module, Parameter
from dtensor.parallel.data_parallel import (_agree, _check_targets, _params_text,
                                            _ShardedParams, replicate)
from dtensor.parallel.loss import loss_parallel as _loss_parallel
from dtensor.parallel.style import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                    PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                    distribute_param, wrap_forward)
from dtensor.placements import Replicate, Shard, StridedShard
from dtensor.tensor import TensorMethods
from dtensor.validate import as_int

__all__ = ["parallelize_module", "parallelize", "replicate", "distribute_module", "gpt_plan",
           "llama_tp_plan", "from_pretrained"]

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
    _apply_plan(module, hits, device_mesh, tp)
    return module


def _tied(module: Module) -> list:
    """Groups of (path, owner, name) holding one parameter object under several paths."""
    owners: dict[int, list] = {}
    for prefix, m in module.named_modules():
        for n, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((f"{prefix}.{n}".lstrip("."), m, n))
    return [g for g in owners.values() if len(g) > 1]


def _apply_plan(module: Module, hits: list, mesh: DeviceMesh, tp: int, rest=None) -> None:
    """Apply the plan's styles (then ``rest()``, the layout of what they left), keeping tied
    parameters tied: each style lays out its own module's parameters, so a weight shared by two
    modules (a tied embedding and lm_head) would come out as two, or as one laid out and one
    left behind. Every use must lay it out alike; then every path holds one DTensor, whose
    gradient sums the uses."""
    tied = [(group, group[0][1]._parameters[group[0][2]]) for group in _tied(module)]
    for style, name, m in hits:
        style.apply(m, mesh, tp, name)
    _retie(tied)
    if rest is not None:
        rest()
        _retie(tied)


def _retie(tied: list) -> None:
    for group, original in tied:
        laid = [(path, m._parameters[n]) for path, m, n in group
                if m._parameters[n] is not original]
        if not laid:
            continue
        path0, first = laid[0]
        for path, p in laid[1:]:
            if p is not first and p._spec != first._spec:
                where = {q: m._parameters[n].placements for q, m, n in group
                         if m._parameters[n] is not original}
                raise ValueError(
                    f"{path0} and {path} are one parameter (tied), but the plan lays them out "
                    f"differently: {where}. Give both modules styles that shard the weight the "
                    f"same way (a vocab-parallel embedding and a column-parallel lm_head both "
                    f"shard it by rows), or untie them.")
        for _, m, n in group:
            m._parameters[n] = first


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


def llama_tp_plan(model=None, tp: int | None = None, sequence_parallel: bool = False,
                  loss_parallel: bool = True) -> dict:
    """torchtitan's tensor-parallel plan for a dtensor.nn.Llama: q/k/v and gate/up
    column-parallel, o/down row-parallel, the embedding vocab-parallel (rowwise over its
    vocabulary rows), lm_head column-parallel with the vocab-parallel loss; norms replicated, or
    sequence-parallel (Shard(1) residual stream) with ``sequence_parallel``.

    With ``model`` and the tensor-parallel degree ``tp`` the plan is checked: ``tp`` must
    divide the query heads (the MLP width and the vocabulary may shard unevenly). Key/value
    heads that do not split evenly over the ranks (tp 4 over 2 of them) are shared: k and v
    projections stay replicated, as Megatron replicates key/value heads across the ranks that
    share them. Each rank computes the key/value heads and attention reads those of its own
    query heads (a local slice, no communication); their gradients come back as partial sums,
    so the backward adds one all-reduce per projection weight and nothing activation-sized."""
    shared_kv = False
    if model is not None and tp is not None:
        c = model.config
        tp = as_int(tp, "llama_tp_plan: tp", low=1)
        if c.n_heads % tp:
            raise ValueError(f"llama_tp_plan: tensor-parallel degree {tp} does not divide "
                             f"n_heads={c.n_heads}; column-parallel q projections give each "
                             f"rank whole heads. Pick tp from the divisors of {c.n_heads}.")
        shared_kv = c.n_kv_heads % tp != 0
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream,
                                        use_local_output=False),
        "layers.*.self_attn": PrepareModuleInput(input_layouts=(stream, None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
        "layers.*.self_attn.q_proj": ColwiseParallel(use_local_output=False),
        "layers.*.self_attn.k_proj": ColwiseParallel(use_local_output=False),
        "layers.*.self_attn.v_proj": ColwiseParallel(use_local_output=False),
        "layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=stream,
                                                     use_local_output=False),
        "layers.*.mlp": PrepareModuleInput(input_layouts=(stream,),
                                           desired_input_layouts=(Replicate(),)),
        "layers.*.mlp.gate_proj": ColwiseParallel(use_local_output=False),
        "layers.*.mlp.up_proj": ColwiseParallel(use_local_output=False),
        "layers.*.mlp.down_proj": RowwiseParallel(output_layouts=stream, use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=stream,
                                   output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=False),
    }
    if shared_kv:
        del plan["layers.*.self_attn.k_proj"], plan["layers.*.self_attn.v_proj"]
    if sequence_parallel:
        for key in ("layers.*.input_layernorm", "layers.*.post_attention_layernorm", "norm"):
            plan[key] = SequenceParallel()
    else:
        plan["norm"] = PrepareModuleOutput(output_layouts=(Replicate(),),
                                           desired_output_layouts=(Replicate(),),
                                           use_local_output=False)
    return plan


def from_pretrained(cls, folder, device_mesh: DeviceMesh, *, sequence_parallel: bool = False,
                    loss_parallel: bool = True, fsdp: bool = False):
    """``cls.from_pretrained(folder)`` laid out over ``device_mesh`` before its weights load
    (``parallelize``: a 1-D mesh is tensor parallel, a 2-D one needs dims "dp" and "tp";
    ``fsdp`` shards the parameters over "dp" too), so each rank reads only its own slice of
    each tensor and no rank ever holds the whole model.

    Example:
        >>> model = dtensor.parallel.from_pretrained(Llama, folder, mesh, fsdp=True)
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"from_pretrained: device_mesh must be a DeviceMesh "
                        f"(dtensor.init_device_mesh), got {type(device_mesh).__name__}.")
    return cls.from_pretrained(folder, lambda model: parallelize(
        model, device_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
        fsdp=fsdp))


def _fsdp_dim(p: DTensor, tp: int | None) -> int | None:
    """The tensor dim FSDP shards over "dp": dim 0, or dim 1 when "tp" shards dim 0 of a
    matrix, so gathering it is a plain all-gather over "dp". None for a vector "tp" already
    shards (a column-parallel bias): nested in the tp shard, its dp pieces would gather
    through the whole vector, an all-gather over "tp" too on every forward, to save a few
    bytes; it stays whole over "dp" and its gradient is all-reduced as in data parallel."""
    split = p.placements[tp] if tp is not None else None
    taken = split.dim if isinstance(split, (Shard, StridedShard)) else None
    if taken == 0 and p.ndim == 1:
        return None
    return 1 if taken == 0 else 0


def _shard_params_fsdp(model: Module, mesh: DeviceMesh, dp: int, tp: int | None) -> None:
    """Store every parameter Shard(k) over "dp" on the model's own mesh (but see _fsdp_dim);
    each module with parameters gathers its own for its forward (fully_shard's mechanism,
    without its batch handling: parallelize lays the batch out itself). A parameter tied
    between modules is laid out once and gathered by the model for its whole forward, so every
    use reads the one parameter."""
    tied = {id(group[0][1]._parameters[group[0][2]]) for group in _tied(model)}
    groups = [(m, [(m, n, p) for n, p in m._parameters.items()
                   if p is not None and id(p) not in tied]) for _, m in model.named_modules()]
    groups.append((model, [(m, n, p) for _, m in model.named_modules()
                           for n, p in m._parameters.items() if p is not None and id(p) in tied]))
    for m, owners in groups:
        owners = [(o, n, p) for o, n, p in owners if _fsdp_dim(p, tp) is not None]
        if not owners:
            continue
        done: dict = {}
        for o, n, p in owners:  # parallelize() made every parameter a DTensor already
            if id(p) not in done:
                distribute_param(o, n, mesh, dp, Shard(_fsdp_dim(p, tp)))
                done[id(p)] = o._parameters[n]
            o._parameters[n] = done[id(p)]
        owners = [(o, n, o._parameters[n]) for o, n, _ in owners]
        params = {id(p) for _, _, p in owners}
        group = _ShardedParams(owners, dict.fromkeys(params, dp), dict.fromkeys(params))

        def around(inner, *args, _group=group, **kwargs):
            with _group.gathered(reshard=False):
                return inner(*args, **kwargs)

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
                loss_parallel: bool = True, fsdp: bool | None = None, example_inputs=None,
                max_bytes_per_rank: int | None = None) -> Module:
    """Parallelize any dtensor.nn model over ``mesh``, in place; returns the model.

    ``parallelize(model, mesh, ...)`` is ``dtensor.parallel.plan(model, mesh, example_inputs,
    ...).apply(model)``: the plan is found from the traced forward (dtensor/parallel/planner.py),
    not from names.

    * "tp" dim: Megatron's layout wherever the model computes it: Linear chains column- then
      row-parallel, vocabulary tables vocab-parallel, the head column-parallel with the
      vocab-parallel loss (``loss_parallel``); what cannot split stays replicated. The stream
      between chains is replicated, or sequence-parallel with ``sequence_parallel=True``.
    * "dp" dim: plain array inputs are the global batch and each "dp" rank takes its rows
      (Shard(0)); parameters are Replicate over "dp" and their gradients are all-reduced when
      stored, or, with ``fsdp=True`` (or when ``max_bytes_per_rank`` needs it), parameters and
      optimizer state are Shard over "dp", all-gathered for each module's forward and their
      gradients reduce-scattered.

    ``example_inputs``: the forward's arguments to plan on (a tuple, a dict of keywords, or one
    array); without them the planner guesses a small batch from the first layer. A 1-D mesh is
    "tp" unless its dim is named "dp". With DTENSOR_DEBUG=1 rank 0 prints the plan's
    explanation.

    Example (under ``dtlaunch --nproc 4``):
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> model = parallelize(GPT(cfg), mesh, sequence_parallel=True)
        >>> logits, loss = model(idx, targets)   # idx, targets: the global batch
    """
    from dtensor.parallel.planner import plan
    _check_targets("parallelize", model, mesh)
    flags = dict(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, fsdp=fsdp)
    found = _agree(mesh, "parallelize", lambda: plan(
        model, mesh, example_inputs, max_bytes_per_rank=max_bytes_per_rank, **flags),
        params=_params_text(model), budget=max_bytes_per_rank, **flags)
    return found.apply(model)


def _parallelize(model: Module, mesh: DeviceMesh, plan: dict, dp: int | None, tp: int | None, *,
                 sequence_parallel: bool, loss_parallel: bool, fsdp: bool,
                 explained=None) -> Module:
    """Lay ``model`` out by a "tp" plan of styles, data parallel over "dp"."""
    _check_targets("parallelize", model, mesh)
    hits = _agree(mesh, "parallelize", lambda: _plan_hits(model, plan) if tp is not None else [],
                  params=_params_text(model), plan=plan, sequence_parallel=sequence_parallel,
                  loss_parallel=loss_parallel, fsdp=fsdp)

    def rest():  # what the plan left: Replicate everywhere
        for _, m in model.named_modules():
            for n, p in list(m._parameters.items()):
                if p is not None and not isinstance(p, DTensor):
                    distribute_param(m, n, mesh, 0, Replicate())

    _apply_plan(model, hits, mesh, tp, rest)
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
        print(explained if explained is not None else _describe(model, plan, mesh, fsdp),
              flush=True)
    return model


def distribute_module(module, device_mesh: DeviceMesh, partition_fn=None, input_fn=None,
                      output_fn=None):
    """Distribute a module's parameters (torch semantics).

    ``partition_fn(name, submodule, mesh)`` may replace parameters with DTensor parameters; by
    default every parameter is replicated. ``input_fn(module, inputs, mesh)`` and
    ``output_fn(module, outputs, mesh)`` become forward pre/post hooks.
    """
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, device_mesh)
        for pname, p in list(sub._parameters.items()):
            if p is not None and not isinstance(p, DTensor):
                sub._parameters[pname] = Parameter(distribute_tensor(
                    p.detach(), device_mesh, [Replicate()] * device_mesh.ndim))
    if input_fn is not None:
        module.register_forward_pre_hook(lambda m, args: input_fn(m, args, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda m, args, out: output_fn(m, out, device_mesh))
    return module
