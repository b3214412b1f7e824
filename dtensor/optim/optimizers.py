"""SGD, Adam and AdamW with PyTorch semantics, written with ops so they run on Tensor and
DTensor and can be traced by the compiler. Updates replace parameter values (``_assign``),
never the graph, and never write into a gradient (a gradient tensor may be shared).

Every way a value reaches an optimizer goes through one check each: ``_param_list`` for the
parameters (constructor and ``add_param_group``), ``_check_hyperparameters`` for a group's
hyperparameters (constructor, ``add_param_group``, ``load_state_dict`` and ``step``, which sees
what a scheduler assigned), and ``_check_state`` for per-parameter state (``load_state_dict``).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from dtensor.autograd import no_grad
from dtensor.ops.nn import adamw_step
from dtensor.tensor import TensorMethods
from dtensor.validate import as_bool

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]

# dtensor.compile sets this while tracing: per-step scalars (AdamW's learning rate and bias
# corrections) then become values the compiled step recomputes on every call.
_scalar_hook = None


def set_scalar_hook(hook):
    """Install ``hook(make) -> dict`` (None to remove); returns the previous one."""
    global _scalar_hook
    prev, _scalar_hook = _scalar_hook, hook
    return prev


def _step_scalars(make) -> dict:
    return make() if _scalar_hook is None else _scalar_hook(make)


_INTS = (int, np.integer)
_MISSING = object()
_REALS = (int, float, np.integer, np.floating)


def _finite(v) -> bool:
    # math.isfinite(10**400) raises OverflowError; an int past float range is no usable value.
    return abs(v) < 2 ** 1024 if isinstance(v, _INTS) else math.isfinite(v)


# -- hyperparameter rules: ``check`` returns the value (normalised) or raises naming it;
# ``fix`` is the advice ``Optimizer._check_hyperparameters`` appends.
@dataclass(frozen=True)
class _Real:
    """A finite real number in [lo, hi), or [lo, hi] when ``closed``; (lo, ...) when
    ``open_lo``."""
    example: float
    lo: float = 0.0
    hi: float = math.inf
    closed: bool = False
    open_lo: bool = False

    def check(self, label: str, v):
        # Not numbers.Real: a Fraction or Decimal would turn the update into object arrays.
        if isinstance(v, bool) or not isinstance(v, _REALS):
            raise TypeError(f"invalid {label}: {v!r} has type {type(v).__name__}, not a real "
                            f"number")
        above = self.lo < v if self.open_lo else self.lo <= v
        below = v <= self.hi if self.closed else v < self.hi
        if not (above and below and _finite(v)):
            low = f"{'(' if self.open_lo else '['}{self.lo:g}"
            bound = (f"a finite number {'>' if self.open_lo else '>='} {self.lo:g}"
                     if self.hi == math.inf else
                     f"in {low}, {self.hi:g}{']' if self.closed else ')'}")
            raise ValueError(f"invalid {label}: {v!r} (must be {bound})")
        return v

    def fix(self, name: str) -> str:
        return f"pass e.g. {name}={self.example!r}"


@dataclass(frozen=True)
class _Pair:
    """Two reals, each following ``item`` (AdamW's betas)."""
    item: _Real
    example: tuple

    def check(self, name: str, v):
        if not isinstance(v, (tuple, list)):
            raise TypeError(f"invalid {name}: {v!r} has type {type(v).__name__}, not a pair")
        if len(v) != 2:
            raise ValueError(f"invalid {name}: {v!r} has length {len(v)}, not 2")
        for i, b in enumerate(v):
            self.item.check(f"beta parameter at index {i} ({name}[{i}])", b)
        return v if isinstance(v, tuple) else tuple(v)

    def fix(self, name: str) -> str:
        return f"pass e.g. {name}={self.example!r}"


@dataclass(frozen=True)
class _Flag:
    def check(self, name: str, v):
        # A truthy non-bool (nesterov="False", nesterov=0.0) would switch the option silently.
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"invalid {name}: {v!r} has type {type(v).__name__}, not a bool")
        return bool(v)

    def fix(self, name: str) -> str:
        return f"pass {name}=True or {name}=False"


def _show(v) -> str:
    """``repr(v)`` on one line, cut to 80 characters (a tensor's repr spans lines)."""
    return " ".join(repr(v).split())[:80]


def _what(p) -> str:
    return f"a {type(p).__name__} of shape {tuple(p.shape)}, dtype {p.dtype}"


class Optimizer:
    # Group entries a compiled step reads on every call (others are compiled in as constants,
    # and changing them recompiles).
    dynamic_hyperparameters: tuple[str, ...] = ()
    # name -> rule for every hyperparameter a group holds; ``_check_hyperparameters`` reads it.
    hyperparameters: dict = {}
    # The per-parameter state a step keeps: tensors shaped like the parameter, and the step count.
    state_tensors: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict):
        name = type(self).__name__
        self.defaults = dict(defaults)
        self._check_hyperparameters(self.defaults, name)
        self.param_groups: list[dict] = []
        self.state: dict = {}
        for gi, (group, params_loc) in enumerate(self._as_groups(params)):
            self._add_group(group, name, f"param_groups[{gi}]", params_loc)
        self._agree(name)

    def _agree(self, name: str) -> None:
        """Over a multi-rank mesh, every rank must build the same optimizer: a replicated
        parameter stepped with another lr on one rank diverges silently (one small allgather,
        at construction only)."""
        params = [p for g in self.param_groups for p in g["params"]]
        mesh = next((p.device_mesh for p in params if p.is_distributed), None)
        if mesh is None or mesh.size() == 1:
            return
        mesh.check_same(
            name, "Build the optimizer with the same parameters and hyperparameters on every "
                  "rank.",  # (a group's own extra keys, say a callable, are the user's)
            hyperparameters=[{k: g[k] for k in self.hyperparameters if k in g}
                             for g in self.param_groups],
            parameters=[(tuple(p.shape), str(p.dtype), tuple(getattr(p, "placements", ())))
                        for p in params])

    def _as_groups(self, params) -> list[tuple[dict, str]]:
        """torch.optim's ``params`` (an ordered iterable of tensors, or of group dicts) as
        groups, each with the name its parameters go by in messages."""
        name = type(self).__name__
        usage = ("params argument given to the optimizer should be an iterable of Tensors or "
                 "dicts")
        if isinstance(params, TensorMethods):
            raise TypeError(f"{name}: {usage}, but got {_what(params)}; pass [param] or "
                            f"model.parameters().")
        if isinstance(params, Mapping):
            raise TypeError(f"{name}: {usage}, but got one dict (keys {sorted(params)}); pass a "
                            f"list of groups: [{{'params': ..., 'lr': ...}}].")
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"{name}: params is a {type(params).__name__}, whose order changes "
                            f"between runs and ranks (state_dict() numbers parameters by "
                            f"order); pass a list.")
        if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
            raise TypeError(f"{name}: {usage}, but got {params!r} (type {type(params).__name__}); "
                            f"pass model.parameters() or a list of tensors.")
        items = list(params)
        if not items:
            raise ValueError(f"{name} got an empty parameter list ({params!r}); pass the "
                             f"tensors to train, and note a generator such as "
                             f"model.parameters() is used up after one pass.")
        dicts = [isinstance(x, Mapping) for x in items]
        if any(dicts) and not all(dicts):
            i, j = dicts.index(True), dicts.index(False)
            raise TypeError(f"{name}: params[{i}] is a dict but params[{j}] has type "
                            f"{type(items[j]).__name__}; pass either tensors or group dicts "
                            f"({{'params': [...]}}), not both.")
        if not dicts[0]:
            return [({"params": items}, "params")]
        return [(g, f"param_groups[{gi}]['params']") for gi, g in enumerate(items)]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters with its own hyperparameters (torch.optim semantics).

        Args:
            param_group: ``{"params": tensors, **hyperparameters}``; hyperparameters left out
                take the constructor's values. Each is checked as a constructor argument is.

        Example:
            >>> opt.add_param_group({"params": head.parameters(), "lr": 1e-4})
        """
        self._add_group(param_group, f"{type(self).__name__}.add_param_group", "param_group",
                        "param_group['params']")

    def _add_group(self, group, owner: str, loc: str, params_loc: str) -> None:
        """Check ``group`` (``loc`` names it, ``params_loc`` its parameters) and append it."""
        if not isinstance(group, Mapping):
            raise TypeError(f"{owner}: {loc} must be a dict {{'params': [...], ...}}, got "
                            f"{_show(group)} (type {type(group).__name__}).")
        if "params" not in group:
            raise ValueError(f"{owner}: {loc} has no 'params' entry (keys {sorted(group)}); "
                             f"pass {{'params': [...], ...}}.")
        params = self._param_list(group["params"], owner, params_loc)
        home = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        for i, p in enumerate(params):
            if id(p) in home:
                raise ValueError(f"{owner}: some parameters appear in more than one parameter "
                                 f"group: {params_loc}[{i}] ({_what(p)}) is already in "
                                 f"param_groups[{home[id(p)]}]; list each parameter in one "
                                 f"group.")
        new = {**self.defaults, **group, "params": params}
        self._check_hyperparameters(new, f"{owner}: {loc}")
        self.param_groups.append(new)

    @staticmethod
    def _param_list(params, owner: str, loc: str) -> list:
        """One group's ``params`` as a list of distinct trainable leaf tensors."""
        if isinstance(params, TensorMethods):
            return Optimizer._param_list([params], owner, loc)
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"{owner}: {loc} is a {type(params).__name__}: optimizer parameters "
                            f"need to be organized in ordered collections (a set's order "
                            f"changes between runs and ranks); pass a list.")
        if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
            raise TypeError(f"{owner}: {loc} must be a tensor or an iterable of tensors, got "
                            f"{_show(params)} (type {type(params).__name__}).")
        out, first = [], {}
        for i, p in enumerate(params):
            at = f"{owner}: {loc}[{i}]"
            if not isinstance(p, TensorMethods):
                raise TypeError(f"{at} is {_show(p)} (type {type(p).__name__}): optimizer can "
                                f"only optimize Tensors; pass nn.Parameter (or DTensor) values.")
            if not np.issubdtype(p.dtype, np.floating):
                raise TypeError(f"{at} is {_what(p)}; an optimizer updates floating-point "
                                f"tensors: make it a float Parameter (a.astype(np.float32)).")
            if not p.requires_grad:
                raise ValueError(f"{at} ({_what(p)}) does not require grad; pass trainable "
                                 f"parameters (nn.Parameter, or .requires_grad_()).")
            if not p.is_leaf:
                raise ValueError(f"{at} ({_what(p)}) is not a leaf: can't optimize a tensor "
                                 f"computed by an op; optimize the leaf it came from.")
            if id(p) in first:
                raise ValueError(f"{at} is {loc}[{first[id(p)]}] again ({_what(p)}): a "
                                 f"parameter listed twice is updated twice per step; list "
                                 f"each parameter once.")
            first[id(p)] = i
            out.append(p)
        return out

    def _check_hyperparameters(self, group: dict, where: str) -> None:
        """Check every hyperparameter of ``group`` against ``hyperparameters`` (normalising in
        place, e.g. betas to a tuple): the one check behind the constructor,
        ``add_param_group``, ``load_state_dict`` and ``step``."""
        for name, rule in self.hyperparameters.items():
            v = group.get(name, _MISSING)
            try:
                if v is _MISSING:
                    raise ValueError(f"missing hyperparameter {name!r}")
                checked = rule.check(name, v)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{where}: {e}; {rule.fix(name)}.") from None
            if checked is not v:
                group[name] = checked
        try:
            self._check_relations(group)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def _check_relations(self, group: dict) -> None:
        """Rules between hyperparameters (each alone already checked)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        set_to_none = as_bool(set_to_none, "zero_grad: set_to_none")
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad = p.grad * 0.0

    def step(self) -> None:
        self._check_step()
        with no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, p.grad, self.state.setdefault(p, {}), group)

    def _check_step(self) -> None:
        """What a step reads and the constructor could not check: hyperparameters assigned
        since (a scheduler), gradients anyone may assign. A few comparisons per group and per
        parameter, all before any update, so a bad value leaves every parameter as it was."""
        name = type(self).__name__
        for gi, group in enumerate(self.param_groups):
            self._check_hyperparameters(group, f"{name}.step: param_groups[{gi}]")
            for p in group["params"]:
                g = p.grad
                if g is not None and getattr(g, "shape", None) != p.shape:
                    i = next(i for i, q in enumerate(group["params"]) if q is p)
                    at = f"{name}.step: the gradient of param_groups[{gi}]['params'][{i}]"
                    if not hasattr(g, "shape"):
                        raise TypeError(f"{at} is {_show(g)} (type {type(g).__name__}), not a "
                                        f"tensor; assign p.grad a tensor of shape {p.shape}.")
                    raise ValueError(f"{at} has shape {tuple(g.shape)}, the parameter "
                                     f"{tuple(p.shape)}; assign p.grad a tensor of the "
                                     f"parameter's shape.")

    def _update(self, p, g, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _init_state(self, p, state: dict, group: dict) -> None:
        """Create a parameter's state as its first step would (zeros), so that a fresh
        optimizer's state_dict() has every entry a checkpoint can be loaded into."""

    # -- state (PyTorch's format: parameters by index in group order)
    def state_dict(self) -> dict:
        """``{"state": {index: {name: value}}, "param_groups": [{hyper..., "params": [index]}]}``.

        The per-parameter dicts and their tensors are the live ones (a checkpoint load fills
        them in place); missing state is created first, as zeros.
        """
        state, groups, i = {}, [], 0
        for group in self.param_groups:
            idx = []
            for p in group["params"]:
                st = self.state.setdefault(p, {})
                self._init_state(p, st, group)
                state[i] = st
                idx.append(i)
                i += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": idx})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take hyperparameters and a copy of the per-parameter state from ``state_dict`` (as
        state_dict() returns it).

        Everything is checked before anything changes: the group count and sizes, each group's
        hyperparameters (as the constructor checks them) and each parameter's state (its keys,
        and every tensor's shape, dtype and layout against the parameter).
        """
        at = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{at}: expected the dict state_dict() returns, got "
                            f"{_show(state_dict)} (type {type(state_dict).__name__}).")
        missing = [k for k in ("state", "param_groups") if k not in state_dict]
        if missing:
            raise ValueError(f"{at}: the state dict has no {missing} (keys "
                             f"{sorted(map(str, state_dict))}); pass what state_dict() returned.")
        groups, states = state_dict["param_groups"], state_dict["state"]
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping)
                                                            for g in groups):
            raise TypeError(f"{at}: 'param_groups' must be a list of dicts, got {_show(groups)}.")
        if not isinstance(states, Mapping):
            raise TypeError(f"{at}: 'state' must be a dict {{index: {{name: value}}}}, got "
                            f"{_show(states)} (type {type(states).__name__}).")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{at}: loaded state dict has a different number of parameter "
                             f"groups: {len(groups)}, this optimizer {len(self.param_groups)}; "
                             f"build it over the same parameter groups.")
        indices: dict[int, object] = {}
        new_groups = []
        for gi, (g, own) in enumerate(zip(groups, self.param_groups)):
            where = f"{at}: param_groups[{gi}]"
            idx = g.get("params")
            if not isinstance(idx, (list, tuple)) or not all(_is_int(i) for i in idx):
                raise TypeError(f"{where}['params'] must be a list of int indices, got "
                                f"{_show(idx)}.")
            if len(idx) != len(own["params"]):
                raise ValueError(f"{where}: loaded state dict contains a parameter group that "
                                 f"doesn't match the size of optimizer's group: {len(idx)} "
                                 f"parameters, this optimizer's group {len(own['params'])}; "
                                 f"build it over the same parameters.")
            for i, p in zip(idx, own["params"]):
                if int(i) in indices:
                    raise ValueError(f"{where}['params'] lists index {i} twice (in all groups); "
                                     f"each parameter has one index.")
                indices[int(i)] = p
            merged = {**own, **{k: v for k, v in g.items() if k != "params"}}
            self._check_hyperparameters(merged, where)
            new_groups.append(merged)
        new_state = {}
        for k, entry in states.items():
            i = _as_index(k)
            if i is None or i not in indices:
                raise ValueError(f"{at}: state has an entry for index {k!r}, which no param "
                                 f"group lists (indices {sorted(indices)}); pass the state "
                                 f"dict of an optimizer over the same parameters.")
            self._check_state(entry, indices[i], f"{at}: state[{k!r}]")
            # A copy, as torch's deepcopy: the live dicts of another optimizer's state_dict()
            # would otherwise be shared, and each step of one would move the other.
            with no_grad():
                new_state[indices[i]] = {n: v.detach() * 1.0 if isinstance(v, TensorMethods)
                                         else v for n, v in entry.items()}
        for own, merged in zip(self.param_groups, new_groups):
            own.update(merged)
        self.state = new_state

    def _check_state(self, entry, p, where: str) -> None:
        """Raise unless ``entry`` is a full state for ``p``: no state at all (the parameter has
        not stepped), or exactly ``state_tensors`` shaped like ``p`` plus an int step count."""
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where} must be a dict {{name: value}}, got {_show(entry)} (type "
                            f"{type(entry).__name__}).")
        if not entry:
            return
        want = {*self.state_tensors, "step"} if self.state_tensors else set()
        if set(entry) != want:
            raise ValueError(f"{where}: {type(self).__name__} state for {_what(p)} holds keys "
                             f"{sorted(map(str, entry))}, expected {sorted(want)} (or none); "
                             f"pass what {type(self).__name__}.state_dict() returned.")
        step = entry["step"]
        if not _is_int(step):
            raise TypeError(f"{where}['step'] must be an int >= 0, got {step!r} (type "
                            f"{type(step).__name__}).")
        if step < 0:
            raise ValueError(f"{where}['step'] must be an int >= 0, got {step!r}.")
        for name in self.state_tensors:
            v = entry[name]
            if not isinstance(v, TensorMethods):
                raise TypeError(f"{where}[{name!r}] must be a tensor like the parameter "
                                f"({_what(p)}), got {_show(v)} (type {type(v).__name__}).")
            if (v.is_distributed != p.is_distributed or v.shape != p.shape
                    or v.dtype != p.dtype or
                    getattr(v, "placements", None) != getattr(p, "placements", None)):
                layout = f", placements {list(p.placements)}" if p.is_distributed else ""
                got = f", placements {list(v.placements)}" if v.is_distributed else ""
                raise ValueError(f"{where}[{name!r}] is {_what(v)}{got}, but its parameter is "
                                 f"{_what(p)}{layout}; pass the state of an optimizer over "
                                 f"the same parameters.")


def _is_int(v) -> bool:
    return isinstance(v, _INTS) and not isinstance(v, bool)


def _as_index(k) -> int | None:
    """A state key: an int, or its decimal string (JSON keys)."""
    if _is_int(k):
        return int(k)
    if isinstance(k, str) and k.isdigit():
        return int(k)
    return None


class SGD(Optimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD)."""

    hyperparameters = {"lr": _Real(1e-3), "momentum": _Real(0.9), "dampening":
                       _Real(0.0, hi=1.0, closed=True), "weight_decay": _Real(0.0),
                       "nesterov": _Flag()}
    state_tensors = ("momentum_buffer",)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _check_relations(self, group):
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"Nesterov momentum requires a momentum and zero dampening, got "
                             f"momentum={group['momentum']!r}, dampening="
                             f"{group['dampening']!r}; set momentum > 0 (e.g. 0.9) and "
                             f"dampening=0, or nesterov=False.")

    def _update(self, p, g, state, group):
        if group["weight_decay"]:
            g = g + group["weight_decay"] * p
        mu = group["momentum"]
        if mu:
            buf = state.get("momentum_buffer")
            first = buf is None or not state.get("step", 1)  # torch: the first buffer is g
            buf = g * 1.0 if first else buf * mu + (1.0 - group["dampening"]) * g
            state["momentum_buffer"] = buf
            state["step"] = state.get("step", 0) + 1
            g = g + mu * buf if group["nesterov"] else buf
        p._assign(p - group["lr"] * g)

    def _init_state(self, p, state, group):
        if group["momentum"] and "momentum_buffer" not in state:
            with no_grad():
                state["momentum_buffer"] = p.detach() * 0.0
            state["step"] = 0


class _AdamFamily(Optimizer):
    """Adam's moments and bias corrections, shared by Adam and AdamW, which differ only in
    how weight decay enters (``_decay``)."""

    hyperparameters = {"lr": _Real(1e-3), "betas": _Pair(_Real(0.9, hi=1.0), (0.9, 0.999)),
                       "eps": _Real(1e-8), "weight_decay": _Real(1e-2)}
    state_tensors = ("exp_avg", "exp_avg_sq")
    dynamic_hyperparameters = ("lr",)

    def _init_state(self, p, state, group):
        if "exp_avg" not in state:
            with no_grad():
                state["exp_avg"] = p.detach() * 0.0
                state["exp_avg_sq"] = p.detach() * 0.0
            state.setdefault("step", 0)

    def _scalars(self, p, group) -> dict:
        """This step's learning rate and bias corrections; advances the parameter's step."""
        b1, b2 = group["betas"]
        state = self.state.setdefault(p, {})
        t = state["step"] = state.get("step", 0) + 1
        return {"lr": group["lr"], "bc1": 1.0 - b1 ** t, "bc2": 1.0 - b2 ** t}

    def _decay(self, p, g, group) -> tuple:
        """(the gradient the moments see, the decoupled decay rate)."""
        raise NotImplementedError

    def _update(self, p, g, state, group):
        (b1, b2) = group["betas"]
        scalars = _step_scalars(functools.partial(self._scalars, p, group))
        self._init_state(p, state, group)
        g, decoupled = self._decay(p, g, group)
        # One fused op: reads p, g, m, v once and returns the three new values stacked.
        new = adamw_step(p, g, state["exp_avg"], state["exp_avg_sq"], beta1=b1, beta2=b2,
                         eps=group["eps"], weight_decay=decoupled, **scalars)
        p._assign(new[0])
        state["exp_avg"], state["exp_avg_sq"] = new[1], new[2]


class Adam(_AdamFamily):
    """Adam with bias correction and L2 weight decay (torch.optim.Adam, amsgrad=False).

    The decay is added to the gradient (``g + weight_decay * p``) before the moments, so it is
    scaled by Adam's per-entry step size like the loss gradient; AdamW decays the parameter
    directly instead.

    Args:
        params: an iterable of tensors, or of group dicts ``{"params": ..., "lr": ...}``.
        lr: learning rate (a compiled step reads it on every call: a scheduler does not
            recompile).
        betas: decay rates of the first and second moment, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 penalty coefficient, >= 0.
        amsgrad: only False (AMSGrad is not implemented).

    Example:
        >>> opt = dtensor.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    hyperparameters = {**_AdamFamily.hyperparameters, "weight_decay": _Real(0.0)}

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        if amsgrad is not False:
            raise NotImplementedError(f"Adam: amsgrad={amsgrad!r} is not implemented; pass "
                                      f"amsgrad=False.")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _decay(self, p, g, group):
        wd = group["weight_decay"]
        return (g + wd * p if wd else g), 0.0


class AdamW(_AdamFamily):
    """Adam with decoupled weight decay and bias correction (torch.optim.AdamW)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _decay(self, p, g, group):
        return g, group["weight_decay"]
