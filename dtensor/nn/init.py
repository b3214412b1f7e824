"""Parameter initialisation with PyTorch's names (``dtensor.nn.init.normal_`` ...), and
``empty_parameters()``: build a model whose parameters hold no memory until they are laid out.

Every function fills its tensor in place, without recording gradients, and returns it. Draws come
from the counter-based generator, so a sharded parameter gets the values the whole one would: the
same model on any mesh. Fans are PyTorch's: fan_in = size(1) * receptive field, fan_out =
size(0) * receptive field.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from dtensor.autograd import no_grad
from dtensor.ops.pointwise import where
from dtensor.tensor import TensorMethods
from dtensor.validate import as_real

__all__ = ["calculate_gain", "uniform_", "normal_", "trunc_normal_", "constant_", "zeros_",
           "ones_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
           "empty_parameters", "is_placeholder"]

_EMPTY = [False]


@contextlib.contextmanager
def empty_parameters():
    """Modules built inside hold placeholder parameters: the right shape and dtype, one zero
    broadcast (no memory), read-only. Initialisers skip them. Lay the model out
    (``parallelize_module``, ``distribute_tensor``) and each rank allocates only its own block;
    then load weights into it (``Llama.from_pretrained`` does all three). PyTorch's
    ``torch.device("meta")`` plays this part there."""
    before = _EMPTY[0]
    _EMPTY[0] = True
    try:
        yield
    finally:
        _EMPTY[0] = before


def placeholder(shape, dtype) -> np.ndarray:
    shape = tuple(shape)
    if math.prod(shape) <= 1:  # nothing to save, and it must stay writable
        return np.zeros(shape, np.dtype(dtype))
    return np.broadcast_to(np.zeros((), np.dtype(dtype)), shape)


def building_empty() -> bool:
    return _EMPTY[0]


def is_placeholder(t) -> bool:
    """True for a parameter made under ``empty_parameters()`` and not laid out or loaded yet."""
    data = (t._loc() if t.is_distributed else t.data) if isinstance(t, TensorMethods) else t
    return (isinstance(data, np.ndarray) and data.size > 1 and not data.flags.writeable
            and not any(data.strides))


def calculate_gain(nonlinearity: str, param=None) -> float:
    """PyTorch's recommended gains: 1 for linear and sigmoid, 5/3 tanh, sqrt(2) relu,
    sqrt(2 / (1 + a^2)) leaky_relu (a = param, default 0.01), 3/4 selu."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                        "conv_transpose2d", "conv_transpose3d", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        a = 0.01 if param is None else as_real(param, "calculate_gain: negative_slope")
        return math.sqrt(2.0 / (1 + a * a))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}; use one of "
                     f"linear, sigmoid, tanh, relu, leaky_relu, selu.")


def _fans(t) -> tuple[int, int]:
    shape = tuple(t.shape)
    if len(shape) < 2:
        raise ValueError(f"fan in and fan out need a tensor of 2 or more dims, got shape "
                         f"{shape}; use normal_ or uniform_ for a vector.")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _fan(t, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}.")
    fan_in, fan_out = _fans(t)
    return fan_in if mode == "fan_in" else fan_out


def _filled(t, fill):
    if not is_placeholder(t):
        with no_grad():
            fill()
    return t


def uniform_(tensor, a: float = 0.0, b: float = 1.0):
    return _filled(tensor, lambda: tensor.uniform_(a, b))


def normal_(tensor, mean: float = 0.0, std: float = 1.0):
    return _filled(tensor, lambda: tensor.normal_(mean, std))


# Rounds of redrawing out-of-range elements: a whole-tensor draw each, the same count on every
# rank (so the generator stays in step across ranks). At the usual +-2 std, 0.046 of the elements
# fall outside per round, so 1 in 10^13 is still out after 10 rounds; those are clamped.
_TRUNC_ROUNDS = 10


def trunc_normal_(tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0):
    """N(mean, std) restricted to [a, b] (absolute bounds, as PyTorch), by redrawing the
    elements that fall outside."""
    mean, std = as_real(mean, "trunc_normal_: mean"), as_real(std, "trunc_normal_: std", low=0)
    a, b = as_real(a, "trunc_normal_: a"), as_real(b, "trunc_normal_: b")
    if not a < b:
        raise ValueError(f"trunc_normal_: the bounds need a < b, got a={a}, b={b}.")

    def fill():
        tensor.normal_(mean, std)
        for _ in range(_TRUNC_ROUNDS):
            fresh = (tensor * 0.0).normal_(mean, std)  # a new tensor of the same layout
            tensor.copy_(where(tensor < a, fresh, where(tensor > b, fresh, tensor)))
        tensor.copy_(where(tensor < a, a, where(tensor > b, b, tensor)))
    return _filled(tensor, fill)


def constant_(tensor, val: float):
    return _filled(tensor, lambda: tensor.fill_(val))


def zeros_(tensor):
    return _filled(tensor, tensor.zero_)


def ones_(tensor):
    return _filled(tensor, lambda: tensor.fill_(1.0))


def xavier_uniform_(tensor, gain: float = 1.0):
    fan_in, fan_out = _fans(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor, gain: float = 1.0):
    fan_in, fan_out = _fans(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def kaiming_uniform_(tensor, a: float = 0.0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu"):
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor, a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu"):
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode)))

