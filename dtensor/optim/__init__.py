"""Optimizers: ``SGD``, ``AdamW`` and ``clip_grad_norm_`` (PyTorch semantics)."""
from dtensor.optim.clip import clip_grad_norm_
from dtensor.optim.optimizers import SGD, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "AdamW", "clip_grad_norm_"]
