"""``dtensor.nn.utils.clip_grad_norm_``, where PyTorch users look for it."""
from dtensor.optim.clip import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
