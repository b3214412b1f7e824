"""Standard layers (PyTorch names, parameter layouts and default initialisation)."""
from __future__ import annotations

import math

import numpy as np

from dtensor.tensor import arange, as_tensor, cat, float_dtype, rand, randn
from dtensor.nn import functional as F
from dtensor.nn import init
from dtensor.nn.module import Module, Parameter
from dtensor.validate import as_bool, as_int, as_real, as_shape

__all__ = ["Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "GELU", "ReLU", "SiLU",
           "Identity", "CrossEntropyLoss", "RotaryEmbedding", "apply_rotary"]


def _initial(shape, dtype, make):
    """A new parameter's values, ``make()``, or a placeholder under nn.init.empty_parameters()."""
    return init.placeholder(shape, dtype) if init.building_empty() else make()


def _uniform(shape, bound, dtype):
    return _initial(shape, dtype, lambda: rand(*shape, dtype=dtype) * (2 * bound) - bound)


def _filled(shape, value, dtype):
    return _initial(shape, dtype, lambda: np.full(shape, value, dtype))


class Linear(Module):
    """y = x @ W.T + b with W of shape (out_features, in_features); U(+-1/sqrt(in)) init."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None):
        super().__init__()
        dtype = float_dtype(dtype, "Linear")
        bias = as_bool(bias, "Linear: bias")
        in_features = as_int(in_features, "Linear: in_features", low=0)
        out_features = as_int(out_features, "Linear: out_features", low=0)
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_uniform((out_features, in_features), bound, dtype))
        self.bias = Parameter(_uniform((out_features,), bound, dtype)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None):
        super().__init__()
        dtype = float_dtype(dtype, "Embedding")
        num_embeddings = as_int(num_embeddings, "Embedding: num_embeddings", low=0)
        embedding_dim = as_int(embedding_dim, "Embedding: embedding_dim", low=0)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(_initial((num_embeddings, embedding_dim), dtype,
                                         lambda: randn(num_embeddings, embedding_dim,
                                                       dtype=dtype)))

    def forward(self, idx):
        return F.embedding(idx, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class _Norm(Module):
    """Shared parameters of LayerNorm and RMSNorm: weight 1 (and bias 0) over the trailing dims."""

    def __init__(self, normalized_shape, eps, elementwise_affine: bool, bias: bool, dtype):
        super().__init__()
        name = type(self).__name__
        dtype = float_dtype(dtype, name)
        if isinstance(normalized_shape, (tuple, list)):
            self.normalized_shape = as_shape(normalized_shape, f"{name}: normalized_shape")
        else:
            self.normalized_shape = (as_int(normalized_shape, f"{name}: normalized_shape",
                                            low=0),)
        self.eps = eps if eps is None else as_real(eps, f"{name}: eps", low=0)
        affine = as_bool(elementwise_affine, f"{name}: elementwise_affine")
        bias = as_bool(bias, f"{name}: bias")
        self.weight = Parameter(_filled(self.normalized_shape, 1, dtype)) if affine else None
        self.bias = Parameter(_filled(self.normalized_shape, 0, dtype)) if affine and bias else \
            None

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class LayerNorm(_Norm):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, dtype)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(_Norm):
    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, False, dtype)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class Dropout(Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = as_real(p, "Dropout probability", low=0, high=1)

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}.")
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, self.approximate)


class ReLU(Module):
    def forward(self, x):
        return F.relu(x)


class SiLU(Module):
    def forward(self, x):
        return F.silu(x)


class Identity(Module):
    """Returns its input; takes and ignores any constructor arguments, as PyTorch's."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x


class CrossEntropyLoss(Module):
    """``F.cross_entropy`` as a module: logits (N, C) and class ids (N,)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index = as_int(ignore_index, "CrossEntropyLoss: ignore_index")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"CrossEntropyLoss: reduction must be 'mean', 'sum' or 'none', got "
                             f"{reduction!r}.")
        if as_real(label_smoothing, "CrossEntropyLoss: label_smoothing", low=0, high=1) != 0:
            raise NotImplementedError(
                f"CrossEntropyLoss: label_smoothing={label_smoothing} is not supported yet; "
                f"mix the smoothed term yourself: (1 - e) * F.cross_entropy(x, t) + e * "
                f"-F.log_softmax(x, -1).mean(-1).mean().")
        self.reduction = reduction

    def forward(self, input, target):
        return F.cross_entropy(input, target, ignore_index=self.ignore_index,
                               reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}"


class RotaryEmbedding(Module):
    """Rotary position embedding (RoFormer) in the Hugging Face Llama convention: a head vector
    is split into halves (x1, x2) rotated as (x1 cos - x2 sin, x2 cos + x1 sin), frequency
    theta^(-2i/dim) for pair i. Checkpoints trained with ``rotate_half`` (all Hugging Face Llama
    models) load without permuting q/k; Meta's original interleaved pairs would need that permute.

    ``forward(q, k, positions=None)`` with q, k of shape (..., T, dim) returns them rotated;
    positions default to 0 .. T-1. Angles are computed in float32, as Hugging Face does, for any
    input dtype.
    """

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        self.dim = as_int(dim, "RotaryEmbedding: dim", low=2)
        if self.dim % 2:
            raise ValueError(f"RotaryEmbedding: dim={dim} must be even (it rotates pairs).")
        self.theta = as_real(theta, "RotaryEmbedding: theta", low=0)
        exponent = np.arange(0, self.dim, 2, dtype=np.float32) / np.float32(self.dim)
        self.inv_freq = (1.0 / np.float32(self.theta) ** exponent).astype(np.float32)

    def cos_sin(self, positions):
        """cos and sin of every (position, frequency) angle, each of shape (T, dim)."""
        angles = positions.astype(np.float32)[:, None] * self.inv_freq  # (T, dim / 2)
        angles = angles.repeat(1, 2)  # Hugging Face's cat((freqs, freqs), -1)
        return angles.cos(), angles.sin()

    def forward(self, q, k, positions=None):
        for name, t in (("q", q), ("k", k)):
            if t.shape[-1] != self.dim:
                raise ValueError(f"RotaryEmbedding(dim={self.dim}): {name} has shape "
                                 f"{tuple(t.shape)}; its last dim must be {self.dim}.")
        if positions is None:
            positions = arange(q.shape[-2], dtype=np.int64)
        cos, sin = self.cos_sin(as_tensor(positions))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}"


def apply_rotary(x, cos, sin):
    """x (..., T, dim) rotated by the angles whose cos and sin are given, (T, dim) each."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = cat([-x2, x1], -1)  # rotate_half
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)
