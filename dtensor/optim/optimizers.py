"""SGD and AdamW with PyTorch semantics, written with ops so they run on Tensor and DTensor and
can be traced by the compiler. Updates replace parameter values (``_assign``), never the
graph, and never write into a gradient (a gradient tensor may be shared)."""
from __future__ import annotations

import functools
import math

from dtensor.autograd import no_grad
from dtensor.ops.nn import adamw_step

__all__ = ["Optimizer", "SGD", "AdamW"]

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


class Optimizer:
    # Group entries a compiled step reads on every call (others are compiled in as constants,
    # and changing them recompiles).
    dynamic_hyperparameters: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict):
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list.")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.defaults = defaults
        self.param_groups = []
        for g in groups:
            group = {**defaults, **g, "params": list(g["params"])}
            for p in group["params"]:
                if not getattr(p, "requires_grad", False):
                    raise ValueError(f"{type(self).__name__}: a parameter of shape "
                                     f"{tuple(p.shape)} does not require grad.")
            self.param_groups.append(group)
        self.state: dict = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad = p.grad * 0.0

    def step(self) -> None:
        with no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, p.grad, self.state.setdefault(p, {}), group)

    def _update(self, p, g, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _init_state(self, p, state: dict) -> None:
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
                self._init_state(p, st)
                state[i] = st
                idx.append(i)
                i += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": idx})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take hyperparameters and per-parameter state from ``state_dict`` (as state_dict())."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(own["params"]) for g, own in zip(groups,
                                                                         self.param_groups)):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state has "
                f"{[len(g['params']) for g in groups]} parameters per group, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}; build it over the same "
                f"parameters.")
        states = {int(k): v for k, v in state_dict["state"].items()}
        for g, own in zip(groups, self.param_groups):
            for k, v in g.items():
                if k != "params":
                    own[k] = tuple(v) if isinstance(own.get(k), tuple) else v
            for i, p in zip(g["params"], own["params"]):
                if i in states:
                    self.state[p] = states[i]


def _check(name, value, lo=0.0, hi=math.inf):
    if not lo <= value < hi:
        raise ValueError(f"invalid {name}: {value} (must be in [{lo}, {hi})).")


class SGD(Optimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD)."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        _check("lr", lr)
        _check("momentum", momentum)
        _check("weight_decay", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0.")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

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

    def _init_state(self, p, state):
        if self.defaults["momentum"] and "momentum_buffer" not in state:
            with no_grad():
                state["momentum_buffer"] = p.detach() * 0.0
            state["step"] = 0


class AdamW(Optimizer):
    """Adam with decoupled weight decay and bias correction (torch.optim.AdamW)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        _check("lr", lr)
        _check("beta1", betas[0], 0.0, 1.0)
        _check("beta2", betas[1], 0.0, 1.0)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    dynamic_hyperparameters = ("lr",)

    def _init_state(self, p, state):
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

    def _update(self, p, g, state, group):
        (b1, b2) = group["betas"]
        scalars = _step_scalars(functools.partial(self._scalars, p, group))
        self._init_state(p, state)
        # One fused op: reads p, g, m, v once and returns the three new values stacked.
        new = adamw_step(p, g, state["exp_avg"], state["exp_avg_sq"], beta1=b1, beta2=b2,
                         eps=group["eps"], weight_decay=group["weight_decay"], **scalars)
        p._assign(new[0])
        state["exp_avg"], state["exp_avg_sq"] = new[1], new[2]
