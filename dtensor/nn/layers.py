"""Standard layers (PyTorch names, parameter layouts and default initialisation)."""
from __future__ import annotations

import math

import numpy as np

from dtensor.tensor import float_dtype, rand, randn
from dtensor.nn import functional as F
from dtensor.nn.module import Module, Parameter
from dtensor.validate import as_bool, as_int, as_real, as_shape

__all__ = ["Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "GELU", "ReLU"]


def _uniform(shape, bound, dtype):
    return rand(*shape, dtype=dtype) * (2 * bound) - bound


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
        self.weight = Parameter(randn(num_embeddings, embedding_dim, dtype=dtype))

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
        self.weight = Parameter(np.ones(self.normalized_shape, dtype)) if affine else None
        self.bias = Parameter(np.zeros(self.normalized_shape, dtype)) if affine and bias else None

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
