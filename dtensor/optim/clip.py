"""Gradient clipping by global norm."""
from __future__ import annotations

import math

from dtensor.autograd import no_grad
from dtensor.tensor import where


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0):
    """Scale all gradients so their joint ``norm_type``-norm is at most ``max_norm``.

    Returns the total norm before clipping (a 0-d tensor), as torch.nn.utils.clip_grad_norm_.
    Gradients are replaced, not scaled in place, because one gradient tensor may be shared.

    Example:
        >>> loss.backward(); dtensor.optim.clip_grad_norm_(model.parameters(), 1.0)
    """
    params = [p for p in ([parameters] if hasattr(parameters, "grad") else parameters)
              if p.grad is not None]
    if not params:
        raise ValueError("clip_grad_norm_: no parameter has a gradient; call backward() first.")
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}.")
    with no_grad():
        if norm_type == math.inf:
            total = params[0].grad.abs().max()
            for p in params[1:]:
                total = total.maximum(p.grad.abs().max())
        elif norm_type == 2.0:
            total = sum((p.grad * p.grad).sum() for p in params) ** 0.5
        else:
            total = sum((p.grad.abs() ** norm_type).sum() for p in params) ** (1.0 / norm_type)
        coef = max_norm / (total + 1e-6)
        scale = where(coef < 1.0, coef, 1.0)
        for p in params:
            p.grad = p.grad * scale
    return total
