"""Learning-rate schedulers with torch.optim.lr_scheduler's semantics: ``LambdaLR``,
``CosineAnnealingLR``, ``LinearLR`` and ``SequentialLR``.

A scheduler only writes ``param_groups[i]["lr"]``. Adam and AdamW read their lr afresh on every
call of a compiled step (``Optimizer.dynamic_hyperparameters``), so a schedule runs one compiled
graph; SGD compiles its lr in, and each new lr recompiles.

As torch: building a scheduler (``last_epoch=-1``) records ``group["initial_lr"]`` and does the
first step (epoch 0) at once; ``step()`` after each ``optimizer.step()`` moves to the next epoch
with the recursive ("chainable") formulas of torch's get_lr, in its order of operations (the
lrs drift from the closed forms by rounding as torch's do); ``state_dict()`` holds the epoch
counters, base and last lrs and the arguments (never a callable), as plain JSON values that
``dtensor.checkpoint.save`` can store next to the optimizer's state. Unlike torch, bad
arguments, an lr a schedule makes invalid (a lambda returning NaN) and an optimizer that gained
a param group since are errors, raised before anything changes; and every rank of a multi-rank
mesh must build the same schedule (checked once, at construction).
"""
from __future__ import annotations

import math
import types
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dtensor.optim.optimizers import Optimizer, _is_int, _Real, _show

__all__ = ["LRScheduler", "LambdaLR", "CosineAnnealingLR", "LinearLR", "SequentialLR"]


@dataclass(frozen=True)
class _Int:
    """An int >= lo (an epoch count); the rule interface of optimizers' ``_Real``."""
    example: int
    lo: int

    def check(self, name: str, v):
        if not _is_int(v):
            raise TypeError(f"invalid {name}: {_show(v)} has type {type(v).__name__}, not an "
                            f"int")
        if v < self.lo:
            raise ValueError(f"invalid {name}: {v!r} (must be an int >= {self.lo})")
        return int(v)

    def fix(self, name: str) -> str:
        return f"pass e.g. {name}={self.example!r}"


_LAST_EPOCH = _Int(-1, lo=-1)
_STEP_COUNT = _Int(1, lo=0)
_LR = _Real(1e-3)
_SAME = "load the state_dict() of a scheduler built like this one, over the same optimizer"


def _checked(owner: str, rules: dict, values: dict) -> dict:
    """``values`` checked against ``rules`` (name -> rule) as JSON-able numbers (a numpy
    float32 eta_min becomes the float it holds); the error names ``owner`` and the fix."""
    out = {}
    for name, rule in rules.items():
        try:
            v = rule.check(name, values[name])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner}: {e}; {rule.fix(name)}.") from None
        out[name] = float(v) if isinstance(rule, _Real) else v
    return out


def _lr_list(owner: str, label: str, v, n: int, fix: str) -> list[float]:
    """``v``, one lr per param group, as floats; ``label.format(i)`` names entry i."""
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"{owner}: {label.format('')} must be a list of {n} lrs (one per param "
                        f"group), got {_show(v)} (type {type(v).__name__}); {fix}.")
    if len(v) != n:
        raise ValueError(f"{owner}: {label.format('')} holds {len(v)} lrs, the optimizer has "
                         f"{n} param groups; {fix}.")
    out = []
    for i, x in enumerate(v):
        try:
            out.append(float(_LR.check(label.format(i), x)))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner}: {e}; {fix}.") from None
    return out


class LRScheduler:
    """The base of the schedulers: epoch counting, the initial step, state_dict.

    A subclass gives ``arguments`` (name -> rule for each constructor argument it keeps, the
    rules of dtensor.optim.optimizers) and ``_lrs``; ``_closed_form`` where the schedule has a
    closed form (SequentialLR restarts a child with it, as torch does).
    """

    arguments: dict = {}

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        name = type(self).__name__
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{name}: {_show(optimizer)} (type {type(optimizer).__name__}) is "
                            f"not an Optimizer; pass a dtensor.optim optimizer.")
        self.optimizer = optimizer
        last_epoch = _checked(name, {"last_epoch": _LAST_EPOCH}, {"last_epoch": last_epoch})[
            "last_epoch"]
        groups = optimizer.param_groups
        if last_epoch == -1:
            for g in groups:
                g.setdefault("initial_lr", g["lr"])
        else:
            missing = [i for i, g in enumerate(groups) if "initial_lr" not in g]
            if missing:
                raise KeyError(f"{name}: param 'initial_lr' is not specified in param_groups"
                               f"{missing} when resuming (last_epoch={last_epoch}); build "
                               f"the scheduler with last_epoch=-1 and load its state_dict() "
                               f"instead.")
        self.base_lrs: list[float] = _lr_list(
            name, "param_groups[{}]['initial_lr']", [g["initial_lr"] for g in groups],
            len(groups), "set each group's initial_lr to its starting lr")
        self.last_epoch = last_epoch
        self._initial_step()
        self._agree()

    def _agree(self) -> None:
        """Over a multi-rank mesh every rank must build the same schedule: a replicated
        parameter stepped with another lr on one rank diverges silently. One small allgather
        of the state (arguments, lrs; a lambda by the lrs it gave), at construction only."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        mesh = next((p.device_mesh for p in params if p.is_distributed), None)
        if mesh is not None and mesh.size() > 1:
            mesh.check_same(type(self).__name__, "Build the scheduler with the same arguments "
                                                 "on every rank.", state=self.state_dict())

    def _initial_step(self) -> None:
        # torch's step counter: kept for its state_dict keys; no formula here reads it.
        self._step_count = 0
        self._advance(initial=True)

    def step(self) -> None:
        """Move to the next epoch and set every param group's lr (after ``optimizer.step()``,
        as in torch)."""
        self._advance(initial=False)

    def _advance(self, initial: bool) -> None:
        epoch = self.last_epoch + 1
        self._set(epoch, self._lrs(epoch, self._current(), initial))
        self._step_count += 1
        self.last_epoch = epoch

    def _restart(self) -> None:
        """Jump to epoch 0 (SequentialLR at a milestone): the closed form if there is one."""
        lrs = self._closed_form(0)
        self._set(0, self._lrs(0, self._current(), False) if lrs is None else lrs)
        self.last_epoch = 0

    def _lrs(self, epoch: int, current: list[float], initial: bool) -> list[float]:
        """The lrs at ``epoch`` from the groups' ``current`` ones (torch's get_lr);
        ``initial``: the step the constructor does."""
        raise NotImplementedError

    def _closed_form(self, epoch: int) -> list[float] | None:
        return None

    def _current(self) -> list[float]:
        """The groups' lrs, checked (anyone may have assigned one), one per base lr."""
        groups = self.optimizer.param_groups
        name = type(self).__name__
        if len(groups) != len(self.base_lrs):
            raise ValueError(f"{name}: the optimizer has {len(groups)} param groups, but the "
                             f"scheduler was built over {len(self.base_lrs)} (a group added "
                             f"since would keep its lr); build the scheduler after the last "
                             f"add_param_group.")
        return _lr_list(name, "param_groups[{}]['lr']", [g["lr"] for g in groups], len(groups),
                        "assign a group's lr a float >= 0")

    def _set(self, epoch: int, lrs: list) -> None:
        """Check every new lr (before any is assigned), assign them, record them."""
        lrs = _lr_list(f"{type(self).__name__} at epoch {epoch}", "new lr for param_groups[{}]",
                       lrs, len(self.base_lrs), "the schedule's arguments give it: fix them")
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = lrs

    def get_last_lr(self) -> list[float]:
        """The lr of each param group as this scheduler last set it."""
        return list(self._last_lr)

    # -- state: torch's keys; plain JSON values
    def state_dict(self) -> dict:
        """``{"base_lrs", "last_epoch", "_step_count", "_last_lr", **arguments}``: ints, floats
        and lists of them (JSON). The optimizer's lrs are in its own state_dict."""
        return {**{k: getattr(self, k) for k in self.arguments},
                "base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch,
                "_step_count": self._step_count, "_last_lr": list(self._last_lr)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from ``state_dict`` (as state_dict() returns it, or its JSON round trip).
        Everything is checked before anything changes; the optimizer's lrs are not touched
        (load the optimizer's state_dict too, as in torch)."""
        self._apply(self._read_state(state_dict, f"{type(self).__name__}.load_state_dict"))

    def _apply(self, values: dict) -> None:
        for k, v in values.items():
            setattr(self, k, v)

    def _check_keys(self, state, at: str) -> None:
        """``state`` is a dict with exactly the keys this scheduler's state_dict() has."""
        keys = set(self.state_dict())
        if not isinstance(state, Mapping):
            raise TypeError(f"{at}: expected the dict state_dict() returns, got {_show(state)} "
                            f"(type {type(state).__name__}).")
        if set(state) != keys:
            raise ValueError(f"{at}: the state has keys {sorted(map(str, state))}, a "
                             f"{type(self).__name__} {sorted(keys)}; pass what "
                             f"{type(self).__name__}.state_dict() returned.")

    def _read_state(self, state, at: str) -> dict:
        """``state`` checked against this scheduler: {attribute: value} to set."""
        self._check_keys(state, at)
        n = len(self.base_lrs)
        out = _checked(at, {**self.arguments, "last_epoch": _LAST_EPOCH,
                            "_step_count": _STEP_COUNT}, state)
        out["base_lrs"] = _lr_list(at, "base_lrs[{}]", state["base_lrs"], n, _SAME)
        out["_last_lr"] = _lr_list(at, "_last_lr[{}]", state["_last_lr"], n, _SAME)
        return out


def _as_lambdas(lr_lambda, n: int) -> list:
    if isinstance(lr_lambda, (list, tuple)):
        if len(lr_lambda) != n:
            raise ValueError(f"LambdaLR: expected {n} lr_lambdas (one per param group), got "
                             f"{len(lr_lambda)}; pass one function, or one per group.")
        fns = list(lr_lambda)
    else:
        fns = [lr_lambda] * n
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"LambdaLR: lr_lambda for param_groups[{i}] is {_show(fn)} (type "
                            f"{type(fn).__name__}), not callable; pass a function of the epoch, "
                            f"e.g. lambda epoch: 0.95 ** epoch.")
    return fns


class LambdaLR(LRScheduler):
    """lr = initial lr * ``lr_lambda(epoch)`` (torch.optim.lr_scheduler.LambdaLR).

    Args:
        optimizer: the optimizer whose param groups' lrs this sets.
        lr_lambda: a function of the epoch (an int) returning a real factor, or a list of
            them, one per param group.
        last_epoch: -1 to start a schedule; k >= 0 resumes after epoch k (each group must
            hold ``initial_lr``).

    Example:
        >>> sched = LambdaLR(opt, lambda epoch: min(1.0, (epoch + 1) / 100))  # warmup
        >>> for batch in data:
        ...     train_step(batch); opt.step(); sched.step()
    """

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable | list, last_epoch: int = -1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"LambdaLR: {_show(optimizer)} (type {type(optimizer).__name__}) "
                            f"is not an Optimizer; pass a dtensor.optim optimizer.")
        self.lr_lambdas = _as_lambdas(lr_lambda, len(optimizer.param_groups))
        super().__init__(optimizer, last_epoch)

    def _lrs(self, epoch, current, initial):
        out = []
        for i, (fn, base) in enumerate(zip(self.lr_lambdas, self.base_lrs)):
            factor = fn(epoch)
            try:
                _Real(1.0, lo=-math.inf).check(f"factor for param_groups[{i}]", factor)
            except (TypeError, ValueError) as e:
                raise type(e)(f"LambdaLR at epoch {epoch}: lr_lambda returned an {e}; return "
                              f"a finite float.") from None
            out.append(base * factor)
        return out

    def state_dict(self) -> dict:
        """As LRScheduler's, plus ``lr_lambdas``: None for a function, as torch saves (the
        ``__dict__`` of a callable object, which must hold JSON values to be checkpointed)."""
        return {**super().state_dict(), "lr_lambdas": [
            None if isinstance(fn, types.FunctionType) or not hasattr(fn, "__dict__")
            else dict(vars(fn)) for fn in self.lr_lambdas]}

    def _read_state(self, state, at):
        out = super()._read_state(state, at)
        saved = state["lr_lambdas"]
        if (not isinstance(saved, (list, tuple)) or len(saved) != len(self.lr_lambdas)
                or not all(s is None or isinstance(s, Mapping) for s in saved)):
            raise ValueError(f"{at}: lr_lambdas must be a list of {len(self.lr_lambdas)} "
                             f"entries, each None or a dict, got {_show(saved)}; pass what "
                             f"state_dict() returned.")
        for fn, s in zip(self.lr_lambdas, saved):
            if s is not None and not hasattr(fn, "__dict__"):
                raise ValueError(f"{at}: lr_lambdas holds {_show(s)} for {_show(fn)}, which "
                                 f"keeps no attributes; build the scheduler with the same "
                                 f"lr_lambda objects.")
        out["lr_lambdas"] = saved
        return out

    def _apply(self, values):
        # The callables stay; a callable object gets its saved attributes (torch's
        # __dict__.update).
        for fn, s in zip(self.lr_lambdas, values.pop("lr_lambdas")):
            if s is not None:
                vars(fn).update(s)
        super()._apply(values)


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from the initial lr to ``eta_min`` over ``T_max`` epochs
    (torch.optim.lr_scheduler.CosineAnnealingLR).

    At epoch t the lr is eta_min + (base - eta_min) (1 + cos(pi t / T_max)) / 2 when nothing
    else changes it; as torch, each step computes it from the previous lr (the recursive form,
    so that other changes to the lr compose), and past T_max the cosine climbs back up (period
    2 T_max) rather than stopping.

    Args:
        optimizer: the optimizer whose param groups' lrs this sets.
        T_max: the number of epochs of one half period, an int >= 1.
        eta_min: the lowest lr, >= 0.
        last_epoch: -1 to start a schedule; k >= 0 resumes after epoch k.

    Example:
        >>> sched = CosineAnnealingLR(opt, T_max=1000, eta_min=1e-5)
    """

    arguments = {"T_max": _Int(100, lo=1), "eta_min": _Real(0.0)}

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1):
        args = _checked("CosineAnnealingLR", self.arguments, dict(T_max=T_max, eta_min=eta_min))
        self.T_max, self.eta_min = args["T_max"], args["eta_min"]
        super().__init__(optimizer, last_epoch)

    def _lrs(self, epoch, current, initial):
        T, lo = self.T_max, self.eta_min
        if initial:
            return current
        if (epoch - 1 - T) % (2 * T) == 0:
            # The step out of the trough, where the ratio below would divide by 1 + cos(pi) = 0.
            return [lr + (base - lo) * (1 - math.cos(math.pi / T)) / 2
                    for lr, base in zip(current, self.base_lrs)]
        return [(1 + math.cos(math.pi * epoch / T)) / (1 + math.cos(math.pi * (epoch - 1) / T))
                * (lr - lo) + lo for lr in current]

    def _closed_form(self, epoch):
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * epoch / self.T_max))
                / 2 for base in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale the initial lr by a factor going linearly from ``start_factor`` to ``end_factor``
    over ``total_iters`` epochs, then keep it (torch.optim.lr_scheduler.LinearLR).

    Args:
        optimizer: the optimizer whose param groups' lrs this sets.
        start_factor: the factor at epoch 0, in (0, 1].
        end_factor: the factor from epoch ``total_iters`` on, in [0, 1].
        total_iters: epochs of the ramp, an int >= 1.
        last_epoch: -1 to start a schedule; k >= 0 resumes after epoch k.

    Example:
        >>> warmup = LinearLR(opt, start_factor=0.01, total_iters=100)
    """

    arguments = {"start_factor": _Real(0.1, lo=0.0, hi=1.0, closed=True, open_lo=True),
                 "end_factor": _Real(1.0, lo=0.0, hi=1.0, closed=True),
                 "total_iters": _Int(5, lo=1)}

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3,
                 end_factor: float = 1.0, total_iters: int = 5, last_epoch: int = -1):
        args = _checked("LinearLR", self.arguments, dict(
            start_factor=start_factor, end_factor=end_factor, total_iters=total_iters))
        self.start_factor, self.end_factor = args["start_factor"], args["end_factor"]
        self.total_iters = args["total_iters"]
        super().__init__(optimizer, last_epoch)

    def _lrs(self, epoch, current, initial):
        a, b, n = self.start_factor, self.end_factor, self.total_iters
        if epoch == 0:
            return [lr * a for lr in current]
        if initial or epoch > n:
            return current
        # factor(e) / factor(e - 1), factor(e) = a + (b - a) e / n, so other changes compose.
        return [lr * (1.0 + (b - a) / (n * a + (epoch - 1) * (b - a))) for lr in current]

    def _closed_form(self, epoch):
        a, b, n = self.start_factor, self.end_factor, self.total_iters
        return [base * (a + (b - a) * min(n, epoch) / n) for base in self.base_lrs]


class SequentialLR(LRScheduler):
    """Run ``schedulers`` one after another, switching at each of ``milestones``
    (torch.optim.lr_scheduler.SequentialLR): epochs [0, m0) follow schedulers[0], [m0, m1)
    schedulers[1] restarted at its epoch 0, and so on.

    Args:
        optimizer: the optimizer every scheduler was built on.
        schedulers: the schedulers, in order (built with last_epoch=-1 just before).
        milestones: the epochs where the next scheduler takes over: len(schedulers) - 1
            increasing ints >= 1.
        last_epoch: -1 to start a schedule.

    Example:
        >>> warmup = LinearLR(opt, start_factor=0.01, total_iters=100)
        >>> decay = CosineAnnealingLR(opt, T_max=900)
        >>> sched = SequentialLR(opt, [warmup, decay], milestones=[100])
    """

    def __init__(self, optimizer: Optimizer, schedulers: list, milestones: list,
                 last_epoch: int = -1):
        name = "SequentialLR"
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{name}: {_show(optimizer)} (type {type(optimizer).__name__}) is "
                            f"not an Optimizer; pass a dtensor.optim optimizer.")
        self._schedulers = _children(schedulers, optimizer)
        self._milestones = _milestones(milestones, len(self._schedulers))
        self.optimizer = optimizer
        self.last_epoch = _checked(name, {"last_epoch": _LAST_EPOCH},
                                   {"last_epoch": last_epoch})["last_epoch"] + 1
        # Building the children stepped each once: back to the initial lrs and epoch -1, then
        # the first child takes its first step again.
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"]
        for s in self._schedulers:
            s.last_epoch -= 1
        self._schedulers[0]._initial_step()
        self._last_lr = self._schedulers[0].get_last_lr()
        self._agree()

    def step(self) -> None:
        epoch = self.last_epoch + 1
        i = bisect_right(self._milestones, epoch)
        child = self._schedulers[i]
        if i > 0 and self._milestones[i - 1] == epoch:
            child._restart()
        else:
            child.step()
        self.last_epoch = epoch
        self._last_lr = child.get_last_lr()

    def state_dict(self) -> dict:
        """``{"_milestones", "last_epoch", "_last_lr", "_schedulers": [each child's]}``."""
        return {"_milestones": list(self._milestones), "last_epoch": self.last_epoch,
                "_last_lr": list(self._last_lr),
                "_schedulers": [s.state_dict() for s in self._schedulers]}

    def _read_state(self, state, at):
        self._check_keys(state, at)
        kids = state["_schedulers"]
        if not isinstance(kids, (list, tuple)) or len(kids) != len(self._schedulers):
            raise ValueError(f"{at}: _schedulers must be a list of {len(self._schedulers)} "
                             f"states (one per scheduler), got {_show(kids)}; build the "
                             f"SequentialLR over the same schedulers.")
        children = [s._read_state(k, f"{at}: _schedulers[{i}]")
                    for i, (s, k) in enumerate(zip(self._schedulers, kids))]
        n = len(self._schedulers[0].base_lrs)
        return {"_milestones": _milestones(state["_milestones"], len(self._schedulers), at),
                "last_epoch": _checked(at, {"last_epoch": _Int(0, lo=0)}, state)["last_epoch"],
                "_last_lr": _lr_list(at, "_last_lr[{}]", state["_last_lr"], n, _SAME),
                "_children": children}

    def _apply(self, values):
        for s, st in zip(self._schedulers, values.pop("_children")):
            s._apply(st)
        super()._apply(values)


def _children(schedulers, optimizer) -> list:
    at = "SequentialLR"
    if not isinstance(schedulers, (list, tuple)) or not schedulers:
        raise (TypeError if not isinstance(schedulers, (list, tuple)) else ValueError)(
            f"{at}: schedulers must be a non-empty list of schedulers, got {_show(schedulers)}; "
            f"pass e.g. [LinearLR(opt, ...), CosineAnnealingLR(opt, ...)].")
    seen: dict[int, int] = {}
    for i, s in enumerate(schedulers):
        if not isinstance(s, LRScheduler):
            raise TypeError(f"{at}: schedulers[{i}] is {_show(s)} (type {type(s).__name__}), "
                            f"not a scheduler; pass dtensor.optim.lr_scheduler schedulers.")
        if isinstance(s, SequentialLR):
            raise TypeError(f"{at}: schedulers[{i}] is a SequentialLR, which cannot restart at "
                            f"a milestone (torch fails there too); list its schedulers and "
                            f"milestones in this one.")
        if s.optimizer is not optimizer:
            raise ValueError(f"{at}: schedulers[{i}] ({type(s).__name__}) was built on another "
                             f"optimizer ({type(s.optimizer).__name__} at {id(s.optimizer):#x}) "
                             f"than this SequentialLR's ({type(optimizer).__name__} at "
                             f"{id(optimizer):#x}); build every scheduler on the same one.")
        if id(s) in seen:
            raise ValueError(f"{at}: schedulers[{i}] is schedulers[{seen[id(s)]}] again; each "
                             f"phase needs its own scheduler object.")
        seen[id(s)] = i
    return list(schedulers)


def _milestones(milestones, n: int, at: str = "SequentialLR") -> list[int]:
    if not isinstance(milestones, (list, tuple)):
        raise TypeError(f"{at}: milestones must be a list of ints, got {_show(milestones)} "
                        f"(type {type(milestones).__name__}); pass e.g. milestones=[100].")
    if len(milestones) != n - 1:
        raise ValueError(f"{at}: {n} schedulers need {n - 1} milestones (where each next one "
                         f"takes over), got {len(milestones)}: {_show(milestones)}.")
    out = list(_checked(at, {f"milestones[{i}]": _Int(100, lo=1) for i in range(n - 1)},
                        {f"milestones[{i}]": m for i, m in enumerate(milestones)}).values())
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            raise ValueError(f"{at}: milestones must be increasing, got {out} (milestones[{i}] "
                             f"= {out[i]} <= milestones[{i - 1}] = {out[i - 1]}); a scheduler "
                             f"between two equal milestones would never run.")
    return out
