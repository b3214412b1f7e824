"""Parallel styles (PyTorch's names, arguments and defaults).

A style does two things to the module it is applied to: it lays the module's parameters out
over the mesh, and it converts activations at the module's boundary (forward pre- and post-hooks).
All the math inside runs through the op registry, so every other collective comes from the
sharding rules.

Layouts name ONE placement: the one on the tensor-parallel mesh dim. On a 2-D ("dp", "tp") mesh
the other dim keeps whatever the activation already has (the batch stays Shard(0) over "dp")
and parameters are Replicate over it (``parallelize(fsdp=True)`` shards them instead).

    ColwiseParallel   Linear weight Shard(0) (output features), bias Shard(0); Embedding weight
                      Shard(1). Input Replicate, output Shard(-1). With parts=k (a fused
                      projection read in k parts, as [q | k | v]) each part is split:
                      StridedShard(0, k) and StridedShard(-1, k) in place of the Shards.
    RowwiseParallel   Linear weight Shard(1) (input features), bias Replicate; Embedding weight
                      Shard(0) (vocab-parallel). Input Shard(-1) (Replicate for Embedding);
                      the output is Partial and leaves as Replicate (all-reduce) or, given
                      output_layouts=Shard(1), as sequence shards (reduce-scatter).
    SequenceParallel  parameters Replicate; input and output Shard(1) (norms, dropout).
    PrepareModuleInput / PrepareModuleOutput
                      convert a module's inputs / outputs. They always leave an autograd
                      boundary, so a Partial gradient arriving there is reduced once for every
                      consumer inside the module (q, k and v share one all-reduce).
"""
from __future__ import annotations

from typing import Sequence

# _redistribute: layouts the framework derived itself, so the public method's cross-rank
# agreement (a collective per call) would only add a sync point per layer.
from dtensor.dtensor import DTensor, _redistribute, distribute_tensor
from dtensor.nn.layers import Embedding, Linear
from dtensor.nn.module import Module, Parameter
from dtensor.placements import Placement, Replicate, Shard, StridedShard
from dtensor.tensor import TensorMethods
from dtensor.validate import as_bool, as_dim, as_int

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput"]


# ----------------------------------------------------------------------------- layout helpers

def _check_layout(style: str, name: str, p, optional: bool = True):
    """A style's layout argument: one Placement (the one on the tensor-parallel mesh dim)."""
    if isinstance(p, Placement) or (optional and p is None):
        return p
    raise TypeError(f"{style}: {name} takes one placement (Shard(d) or Replicate()"
                    f"{', or None' if optional else ''}), got {p!r}. It names the layout on "
                    f"the tensor-parallel mesh dim only.")


def _check_flag(style: str, name: str, value) -> bool:
    return as_bool(value, f"{style}: {name}")


def _with(placements, tp: int, p: Placement, ndim: int) -> tuple[Placement, ...]:
    """``placements`` with mesh dim ``tp`` set to ``p`` (negative Shard dims resolved)."""
    if isinstance(p, Shard):
        p = Shard(p.dim % ndim)
    elif isinstance(p, StridedShard):
        p = StridedShard(p.dim % ndim, p.parts)
    out = list(placements)
    out[tp] = p
    return tuple(out)


def to_layout(x, mesh, tp: int, src: Placement | None, dst: Placement | None, *,
              boundary: bool = False, last_dim: int | None = None):
    """Bring one activation to ``dst`` on mesh dim ``tp``.

    A plain tensor is this rank's block laid out as ``src`` on ``tp`` (Replicate on the other
    mesh dims) and becomes a DTensor with ``from_local``; ``last_dim``, the global size of its
    last dim when the module knows it (a Linear's in_features), makes uneven shards exact.
    ``boundary`` keeps an autograd node even when nothing moves, so the gradient is converted
    back to the forward layout here.
    """
    if dst is None and src is None:
        return x
    if not isinstance(x, DTensor):
        if not isinstance(x, TensorMethods) and not hasattr(x, "__array__"):
            return x  # not a tensor (a flag, a shape): styles leave it alone
        ndim = len(x.shape)
        placements = _with([Replicate()] * mesh.ndim, tp, src or Replicate(), ndim)
        shape = None
        if last_dim is not None and placements[tp] == Shard(ndim - 1):
            shape = tuple(x.shape[:-1]) + (last_dim,)
        x = DTensor.from_local(x, mesh, placements, shape=shape)
    if dst is None:
        return x
    target = _with(x.placements, tp, dst, x.ndim)
    if target != x.placements or boundary:
        x = _redistribute(x, target, boundary=True)
    return x


def _local_out(x, use_local_output: bool):
    return x.to_local() if use_local_output and isinstance(x, DTensor) else x


def distribute_param(module: Module, name: str, mesh, tp: int, p: Placement) -> None:
    """Lay parameter ``name`` of ``module`` out as ``p`` on mesh dim ``tp`` (Replicate on the
    other dims, or its current placement there if it is already a DTensor on ``mesh``)."""
    param = module._parameters.get(name)
    if param is None:
        return
    if isinstance(param, DTensor):
        if param.device_mesh != mesh:
            raise ValueError(f"parameter {name!r} already lives on {param.device_mesh}, not on "
                             f"{mesh}; parallelize a module once, on one mesh.")
        new = param.detach().redistribute(placements=_with(param.placements, tp, p, param.ndim))
    else:
        new = distribute_tensor(param.detach(), mesh,
                                _with([Replicate()] * mesh.ndim, tp, p, param.ndim))
    module._parameters[name] = Parameter(new)


# ----------------------------------------------------------------------------- styles

class ParallelStyle:
    """Base class: ``apply(module, mesh, tp, path)`` lays out parameters and installs hooks."""

    def apply(self, module: Module, mesh, tp: int, path: str) -> Module:
        raise NotImplementedError

    def _unsupported(self, module: Module, path: str, what: str):
        return TypeError(f"{type(self).__name__} applies to {what}; plan key matched "
                         f"{path or '<root>'!r}, a {type(module).__name__}. Apply it to the "
                         f"Linear/Embedding submodules instead, or use PrepareModuleInput / "
                         f"PrepareModuleOutput on this module.")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class _LinearStyle(ParallelStyle):
    _linear: tuple[Placement, Placement | None]  # weight, bias
    _embedding: Placement
    _in: Placement  # default input layout (Linear)
    _out: Placement  # default output layout

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        style = type(self).__name__
        self.input_layouts = _check_layout(style, "input_layouts", input_layouts)
        self.output_layouts = _check_layout(style, "output_layouts", output_layouts)
        self.use_local_output = _check_flag(style, "use_local_output", use_local_output)

    def apply(self, module, mesh, tp, path):
        if isinstance(module, Linear):
            w, b = self._linear
            distribute_param(module, "weight", mesh, tp, w)
            distribute_param(module, "bias", mesh, tp, b)
            src = self.input_layouts or self._in
            desired = self._in
            features = module.in_features
        elif isinstance(module, Embedding):
            distribute_param(module, "weight", mesh, tp, self._embedding)
            src = self.input_layouts or Replicate()
            desired = Replicate()  # token ids are whole on every rank
            features = None
        else:
            raise self._unsupported(module, path, "Linear and Embedding modules")
        dst_out = self.output_layouts or self._out

        def pre(m, args):
            return ((to_layout(args[0], mesh, tp, src, desired, last_dim=features),)
                    + tuple(args[1:]))

        def post(m, args, out):
            return _local_out(to_layout(out, mesh, tp, None, dst_out), self.use_local_output)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


class ColwiseParallel(_LinearStyle):
    """Shard a Linear's output features (an Embedding's embedding dim) over the mesh.

    ``parts=k``: the output is read as k equal parts (a fused q/k/v projection sliced
    ``[q | k | v]``), so each part is split over the mesh instead of the whole width: rank r
    holds its shard of q, of k and of v, and slicing q out moves nothing (StridedShard)."""

    _linear = (Shard(0), Shard(0))
    _embedding = Shard(1)
    _in = Replicate()
    _out = Shard(-1)

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True,
                 parts: int = 1):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.parts = as_int(parts, "ColwiseParallel: parts", low=1,
                            fix="Give the number of equal parts the output is read in, e.g. "
                                "parts=3 for a fused [q | k | v] projection.")
        if self.parts > 1:
            self._linear = (StridedShard(0, self.parts),) * 2
            self._embedding = StridedShard(1, self.parts)
            self._out = StridedShard(-1, self.parts)


class RowwiseParallel(_LinearStyle):
    """Shard a Linear's input features (an Embedding's rows: vocab-parallel) over the mesh."""

    _linear = (Shard(1), Replicate())
    _embedding = Shard(0)
    _in = Shard(-1)
    _out = Replicate()


class SequenceParallel(ParallelStyle):
    """Run a module (norm, dropout) on sequence shards: parameters Replicate, the input and
    output Shard(sequence_dim). The parameters' gradients then arrive Partial and are all-reduced
    when stored (the leaf keeps its Replicate layout)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = as_int(sequence_dim, "SequenceParallel: sequence_dim")
        self.use_local_output = _check_flag("SequenceParallel", "use_local_output",
                                            use_local_output)

    def apply(self, module, mesh, tp, path):
        for name in list(module._parameters):
            distribute_param(module, name, mesh, tp, Replicate())
        seq = Shard(self.sequence_dim)

        def pre(m, args):
            if args and hasattr(args[0], "shape"):  # else Shard(d) fails deep in a redistribute
                as_dim(self.sequence_dim, tuple(args[0].shape), what="sequence_dim",
                       op=f"SequenceParallel on {path!r}")
            return (to_layout(args[0], mesh, tp, seq, seq),) + tuple(args[1:])

        def post(m, args, out):
            return _local_out(to_layout(out, mesh, tp, None, seq), self.use_local_output)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


def _per_arg(layouts) -> tuple:
    if layouts is None:
        return ()
    return tuple(layouts) if isinstance(layouts, Sequence) else (layouts,)


def _layout_pairs(style: str, names: tuple[str, str], src, dst, hint: str):
    """The two layout lists of a Prepare style, one entry per value; a length mismatch raises."""
    src, dst = _per_arg(src), _per_arg(dst)
    if len(src) != len(dst):
        raise ValueError(f"{style}: {names[0]} {src} and {names[1]} {dst} must have {hint}.")
    for name, layouts in zip(names, (src, dst)):
        for p in layouts:
            _check_layout(style, f"each entry of {name} {layouts}", p)
    return src, dst


def wrap_forward(module: Module, around) -> None:
    """Run ``around(inner_forward, *args, **kwargs)`` in place of ``module.forward``."""
    inner = module.forward

    def forward(*args, **kwargs):
        return around(inner, *args, **kwargs)

    module.__dict__["forward"] = forward


class PrepareModuleInput(ParallelStyle):
    """Convert positional (and keyword) inputs from ``input_layouts`` to
    ``desired_input_layouts``; None entries are left alone. Parameters are not touched."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts: dict | None = None,
                 desired_input_kwarg_layouts: dict | None = None, use_local_output: bool = False):
        self.input_layouts, self.desired_input_layouts = _layout_pairs(
            "PrepareModuleInput", ("input_layouts", "desired_input_layouts"), input_layouts,
            desired_input_layouts, "one entry per positional input (None to leave one alone)")
        for name, table in (("input_kwarg_layouts", input_kwarg_layouts),
                            ("desired_input_kwarg_layouts", desired_input_kwarg_layouts)):
            if table is not None and not isinstance(table, dict):
                raise TypeError(f"PrepareModuleInput: {name} must be a dict of keyword -> "
                                f"placement, got {table!r}.")
            for k, p in (table or {}).items():
                _check_layout("PrepareModuleInput", f"{name}[{k!r}]", p)
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        self.use_local_output = _check_flag("PrepareModuleInput", "use_local_output",
                                            use_local_output)

    def _convert(self, x, mesh, tp, src, dst):
        return _local_out(to_layout(x, mesh, tp, src, dst, boundary=True), self.use_local_output)

    def apply(self, module, mesh, tp, path):
        pairs = list(zip(self.input_layouts, self.desired_input_layouts))

        def pre(m, args):
            if any(s is not None or d is not None for s, d in pairs[len(args):]):
                raise ValueError(f"PrepareModuleInput on {path!r} ({type(m).__name__}): "
                                 f"{len(pairs)} input layouts {self.input_layouts} for a "
                                 f"forward called with {len(args)} positional argument(s); give "
                                 f"one layout per positional argument.")
            head = tuple(self._convert(a, mesh, tp, s, d) for a, (s, d) in zip(args, pairs))
            return head + tuple(args[len(pairs):])

        module.register_forward_pre_hook(pre)
        if self.desired_input_kwarg_layouts:
            def convert_kwargs(inner, *args, **kwargs):
                kwargs = {k: self._convert(v, mesh, tp, self.input_kwarg_layouts.get(k),
                                           self.desired_input_kwarg_layouts.get(k))
                          if k in self.desired_input_kwarg_layouts else v
                          for k, v in kwargs.items()}
                return inner(*args, **kwargs)

            wrap_forward(module, convert_kwargs)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's output(s) from ``output_layouts`` to ``desired_output_layouts``."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts, self.desired_output_layouts = _layout_pairs(
            "PrepareModuleOutput", ("output_layouts", "desired_output_layouts"), output_layouts,
            desired_output_layouts, "the same length")
        self.use_local_output = _check_flag("PrepareModuleOutput", "use_local_output",
                                            use_local_output)

    def apply(self, module, mesh, tp, path):
        pairs = list(zip(self.output_layouts, self.desired_output_layouts))

        def post(m, args, out):
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            if len(outs) != len(pairs):
                raise ValueError(f"PrepareModuleOutput on {path or '<root>'!r}: the module "
                                 f"returned {len(outs)} outputs but {len(pairs)} layouts were "
                                 f"given.")
            conv = tuple(_local_out(to_layout(o, mesh, tp, s, d, boundary=True),
                                    self.use_local_output) for o, (s, d) in zip(outs, pairs))
            return conv[0] if single else conv

        module.register_forward_hook(post)
        return module
