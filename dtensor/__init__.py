"""dtensor: distributed tensor parallelism on numpy + MPI, with a tracing compiler.

Import as ``import dtensor``; the public surface mirrors PyTorch where a name exists there.
"""
from __future__ import annotations

import numpy as np

from dtensor import ops  # noqa: F401  (registers every op before first use)
from dtensor.autograd import enable_grad, is_grad_enabled, no_grad
from dtensor.random import initial_seed, manual_seed
from dtensor.tensor import (Tensor, arange, as_tensor, cat, full, ones, ones_like, rand, randn,
                            tensor, where, zeros, zeros_like, matmul)

float16, float32, float64 = np.float16, np.float32, np.float64
int32, int64, bool_ = np.int32, np.int64, np.bool_

__version__ = "0.1.0"
__all__ = ["Tensor", "tensor", "as_tensor", "zeros", "ones", "full", "zeros_like", "ones_like",
           "arange", "rand", "randn", "cat", "where", "matmul", "no_grad", "enable_grad",
           "is_grad_enabled", "manual_seed", "initial_seed", "float16", "float32", "float64",
           "int32", "int64", "bool_"]

from dtensor import nn, optim  # noqa: E402  (after the core they build on)
