"""Optimizers (``SGD``, ``Adam``, ``AdamW``), learning-rate schedulers
(``dtensor.optim.lr_scheduler``) and ``clip_grad_norm_``, with PyTorch semantics."""
from dtensor.optim import lr_scheduler
from dtensor.optim.clip import clip_grad_norm_
from dtensor.optim.optimizers import SGD, Adam, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm_", "lr_scheduler"]
