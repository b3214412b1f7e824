"""Gradient clipping by global norm."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from dtensor.autograd import no_grad
from dtensor.optim.optimizers import _REALS, _show
from dtensor.tensor import TensorMethods, where


def clip_grad_norm_(parameters, max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False):
    """Scale all gradients so their joint ``norm_type``-norm is at most ``max_norm``.

    As torch.nn.utils.clip_grad_norm_: the gradients are multiplied by
    ``min(max_norm / (total + 1e-6), 1)``, so a non-finite total norm makes them NaN (or zero)
    unless ``error_if_nonfinite`` raises first. Gradients are replaced, not scaled in place,
    because one gradient tensor may be shared. Unlike torch, parameters without any gradient
    are an error (clipping before backward() is a bug), as is a parameter listed twice (it
    would be scaled twice).

    Args:
        parameters: a tensor or an iterable of tensors (a generator is read once).
        max_norm: the largest norm the gradients keep, a number >= 0 (inf: no clipping).
        norm_type: p of the p-norm, > 0; ``math.inf`` or ``"inf"`` for the max-norm.
        error_if_nonfinite: raise RuntimeError if the total norm is NaN or infinite (reads the
            norm back: one synchronisation, and not inside dtensor.compile).

    Returns:
        The total norm before clipping (a 0-d tensor).

    Example:
        >>> loss.backward(); dtensor.optim.clip_grad_norm_(model.parameters(), 1.0)
    """
    params = _params_with_grad(parameters)
    if isinstance(max_norm, bool) or not isinstance(max_norm, _REALS):
        raise TypeError(f"clip_grad_norm_: max_norm must be a number, got {max_norm!r} (type "
                        f"{type(max_norm).__name__}); pass e.g. max_norm=1.0.")
    if not max_norm >= 0:  # a negative max_norm flips every gradient's sign
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0 (inf for no clipping), got "
                         f"{max_norm!r}; pass e.g. max_norm=1.0.")
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        norm_type = math.inf
    if isinstance(norm_type, str):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type!r} is not a p-norm; pass a "
                         f"number > 0 (2.0 for the Euclidean norm) or 'inf'.")
    if isinstance(norm_type, bool) or not isinstance(norm_type, _REALS):
        raise TypeError(f"clip_grad_norm_: norm_type must be a number or 'inf', got "
                        f"{norm_type!r} (type {type(norm_type).__name__}); pass e.g. 2.0.")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}; "
                         f"pass e.g. norm_type=2.0.")
    if not isinstance(error_if_nonfinite, (bool, np.bool_)):
        raise TypeError(f"clip_grad_norm_: error_if_nonfinite must be a bool, got "
                        f"{error_if_nonfinite!r} (type {type(error_if_nonfinite).__name__}).")
    with no_grad():
        if norm_type == math.inf:
            total = params[0].grad.abs().max()
            for p in params[1:]:
                total = total.maximum(p.grad.abs().max())
        elif norm_type == 2.0:
            total = sum((p.grad * p.grad).sum() for p in params) ** 0.5
        else:
            total = sum((p.grad.abs() ** norm_type).sum() for p in params) ** (1.0 / norm_type)
        if error_if_nonfinite and not math.isfinite(total.item()):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} for gradients from "
                f"`parameters` is non-finite ({total.item()}), so it cannot be clipped. To "
                f"disable this error and scale the gradients by the non-finite norm anyway, "
                f"set `error_if_nonfinite=False`.")
        coef = max_norm / (total + 1e-6)
        # torch's clamp(max=1): a NaN coefficient stays NaN (where(coef < 1, ...) would drop it).
        scale = where(coef >= 1.0, 1.0, coef)
        for p in params:
            p.grad = p.grad * scale
    return total


def _params_with_grad(parameters) -> list:
    """``parameters`` (one tensor or an iterable, read once) as a list of the distinct tensors
    that have a gradient."""
    if isinstance(parameters, TensorMethods):
        parameters = [parameters]
    elif (parameters is None or isinstance(parameters, (str, bytes, Mapping))
          or not isinstance(parameters, Iterable)):
        raise TypeError(f"clip_grad_norm_: parameters must be a tensor or an iterable of "
                        f"tensors, got {_show(parameters)} (type {type(parameters).__name__}); "
                        f"pass model.parameters().")
    params, first = [], {}
    for i, p in enumerate(parameters):
        if not isinstance(p, TensorMethods):
            raise TypeError(f"clip_grad_norm_: parameters[{i}] is {_show(p)} (type "
                            f"{type(p).__name__}), not a tensor; pass model.parameters().")
        if id(p) in first:
            raise ValueError(f"clip_grad_norm_: parameters[{i}] is parameters[{first[id(p)]}] "
                             f"again (shape {tuple(p.shape)}): its gradient would be counted "
                             f"and scaled twice; list each parameter once.")
        first[id(p)] = i
        if p.grad is not None:
            if not isinstance(p.grad, TensorMethods):
                raise TypeError(f"clip_grad_norm_: the gradient of parameters[{i}] has type "
                                f"{type(p.grad).__name__}, not a tensor; assign p.grad a "
                                f"tensor.")
            params.append(p)
    if not first:
        raise ValueError(f"clip_grad_norm_: got no parameters ({_show(parameters)}); pass "
                         f"model.parameters(), and note a generator is used up after one pass.")
    if not params:
        raise ValueError(f"clip_grad_norm_: none of the {len(first)} parameters has a "
                         f"gradient; call backward() first.")
    return params
