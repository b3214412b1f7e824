"""Functional neural-network ops, written as composites of the registry's primitives.

They get autograd, sharding and codegen from their primitives. Where a composite's structure
matters for the gradient (a max subtracted for stability, a mask) a comment says why.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import reprlib

import numpy as np

from dtensor import random, tracer
from dtensor.ops import nn as nnops
from dtensor.ops import pointwise as pw
from dtensor.ops import structural as st
from dtensor.placements import Shard
from dtensor.tensor import TensorMethods, as_tensor, need_floating, over_last_dim
from dtensor.validate import as_bool, as_int, as_real, as_shape

__all__ = ["relu", "gelu", "silu", "softmax", "log_softmax", "layer_norm", "rms_norm", "dropout",
           "embedding", "linear", "cross_entropy", "scaled_dot_product_attention", "sdpa_kernel"]

def _input(x, op: str, what: str = "input"):
    """``x`` as a tensor: tensors pass, numpy arrays, nested lists and numbers are converted
    (as a numpy array is everywhere), anything else is named."""
    if isinstance(x, TensorMethods):
        return x
    if isinstance(x, (np.ndarray, list, tuple, numbers.Number)) and not isinstance(x, bool):
        return as_tensor(x)
    raise TypeError(f"{op}: {what} must be a tensor (or a numpy array), got {reprlib.repr(x)} "
                    f"(a {type(x).__name__}).")


def _same_dtype(op: str, **tensors) -> None:
    """The input and the parameters of a layer share one dtype, as in PyTorch: numpy would
    promote a float64 batch fed to a float32 model and run (and differentiate) it in float64."""
    named = {k: np.dtype(t.dtype) for k, t in tensors.items() if t is not None}
    (first, want), *rest = named.items()
    for k, dt in rest:
        if dt != want:
            fix = (f"x.astype(np.{dt}) for a numpy array, or dtensor.tensor(x, dtype=dtensor.{dt})"
                   if first == "input" else f"{first}.astype(np.{dt})")
            raise TypeError(f"{op}: {first} is {want} but {k} is {dt}; they must match. Cast the "
                            f"{first}: {fix}.")


def _floating(x, op: str, what: str = "input"):
    return need_floating(_input(x, op, what), op, what)


def _eps(eps, op: str) -> float:
    return as_real(eps, f"{op}: eps", low=0, fix="eps keeps the division away from zero.")


def _param(t, shape: tuple, op: str, what: str, fix: str):
    """A weight or bias of exactly ``shape``; a wrong one would broadcast or fail in a mul."""
    if t is None:
        return None
    t = _input(t, op, what)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {what} has shape {tuple(t.shape)}, expected {tuple(shape)}. "
                         f"{fix}")
    return t


def relu(x):
    return x.relu()


def gelu(x, approximate: str = "none"):
    """GELU: exact ``0.5 x (1 + erf(x / sqrt 2))`` or, with approximate="tanh", the tanh form."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}.")
    return nnops.gelu(_floating(x, "gelu"), approximate=approximate)


def silu(x):
    return x * x.sigmoid()


def softmax(x, dim: int = -1):
    return over_last_dim(nnops.softmax, _floating(x, "softmax"), dim, causal=False)


def log_softmax(x, dim: int = -1):
    return over_last_dim(nnops.log_softmax, _floating(x, "log_softmax"), dim)


def _check_norm_shape(x, normalized_shape, name):
    what = f"{name}: normalized_shape"
    ns = (as_shape(normalized_shape, what) if isinstance(normalized_shape, (tuple, list))
          else (as_int(normalized_shape, what, low=0),))
    if tuple(x.shape[-len(ns):]) != ns:
        raise ValueError(f"{name}: normalized_shape {ns} does not match the trailing dims of the "
                         f"input shape {tuple(x.shape)}.")
    return ns


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the trailing ``normalized_shape`` dims."""
    x = _floating(x, "layer_norm")
    ns = _check_norm_shape(x, normalized_shape, "layer_norm")
    dims = tuple(range(x.ndim - len(ns), x.ndim))
    eps = _eps(eps, "layer_norm")
    fix = "It holds one value per normalized element (normalized_shape)."
    weight = _param(weight, ns, "layer_norm", "weight", fix)
    bias = _param(bias, ns, "layer_norm", "bias", fix)
    lead = tuple(x.shape[:x.ndim - len(dims)])
    # normalize works on the last dim (biased variance, as PyTorch); fold trailing dims into it.
    y = nnops.normalize(x.reshape(lead + (-1,)) if len(dims) > 1 else x, eps=eps)
    y = y.reshape(tuple(x.shape)) if len(dims) > 1 else y
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None):
    x = _floating(x, "rms_norm")
    ns = _check_norm_shape(x, normalized_shape, "rms_norm")
    dims = tuple(range(x.ndim - len(ns), x.ndim))
    eps = float(np.finfo(x.dtype).eps) if eps is None else _eps(eps, "rms_norm")
    weight = _param(weight, ns, "rms_norm", "weight",
                    "It holds one value per normalized element (normalized_shape).")
    # In float32 for float16 x, as PyTorch: x * x is past float16's range from |x| = 256.
    xa = x.astype(st.accumulate_dtype(x.dtype))
    y = (xa / ((xa * xa).mean(dims, keepdims=True) + eps).sqrt()).astype(x.dtype)
    return y if weight is None else y * weight


def dropout(x, p: float = 0.5, training: bool = True):
    """Zero each element with probability p, scale the rest by 1/(1-p).

    The mask of element i is a pure function of (seed, call, i) (counter-based Philox), so it is
    the same for every sharding of ``x`` and for compiled code.
    """
    p = as_real(p, "dropout probability", low=0, high=1)
    if not as_bool(training, "dropout: training") or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = st.rand(x, key=random.next_key(), dtype=np.dtype(np.float32)) >= p
    return pw.where(keep, x * (1.0 / (1.0 - p)), 0.0)


def _index_values(t) -> np.ndarray | None:
    """The values of an index tensor on this rank (a DTensor's local block), or None while
    dtensor.compile traces: the compiled step's lookup and loss kernels check them instead."""
    if isinstance(t, np.ndarray):
        return t
    local = (t.to_local() if t.is_distributed else t).data
    return local if isinstance(local, np.ndarray) else None


def _check_index(t, what: str, check) -> None:
    """``check`` this rank's index values. Where a DTensor of indices is sharded its blocks
    differ by rank: a bad index in one block must raise on every rank (one small allgather),
    not leave the others waiting in the lookup's collectives."""
    values = _index_values(t)
    if values is None:
        return
    spec = getattr(t, "_spec", None)
    if spec is None or spec.mesh.size() == 1 or not any(
            isinstance(p, Shard) for p in spec.placements):
        check(values)
        return
    error = None
    try:
        check(values)
    except IndexError as e:
        error = e
    spec.mesh.check_same(what, error=error)


def embedding(idx, weight):
    """Rows ``weight[idx]``: (..., ) int indices -> (..., D).

    An index outside [0, num_embeddings), negative ones included, is an IndexError, as in
    PyTorch (numpy's take would count a negative one from the end).
    """
    idx = as_tensor(idx) if not hasattr(idx, "dtype") else idx
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"embedding indices must be integers, got dtype {idx.dtype}.")
    weight = _input(weight, "embedding", "weight")
    if weight.ndim != 2:
        raise ValueError(f"embedding: weight must be 2-d (num_embeddings, embedding_dim), got "
                         f"shape {tuple(weight.shape)}; check the argument order: "
                         f"embedding(indices, weight).")
    # Here, not in the lookup, for one message eager and sharded.
    _check_index(idx, "embedding", lambda values: st.check_rows(
        values, weight.shape[0], "embedding: index",
        fix=f"Fix the indices, or make the embedding's num_embeddings ({weight.shape[0]}) "
            f"larger."))
    return st.index_select(weight, idx)


def linear(x, weight, bias=None):
    """``x @ weight.T + bias`` with weight (out, in), as torch.nn.functional.linear.

    Leading dims are flattened first so the product is one GEMM (and so is the weight gradient,
    instead of a batched product summed afterwards).
    """
    x = _input(x, "linear")
    weight = _input(weight, "linear", "weight")
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must be 2-d (out_features, in_features), got shape "
                         f"{tuple(weight.shape)}.")
    bias = _param(bias, weight.shape[:1], "linear", "bias",
                  "It holds one value per output feature (weight.shape[0]).")
    if x.ndim == 0:
        raise ValueError("linear: the input needs a features dim, got a 0-d tensor; reshape it "
                         "to (1,) first.")
    _same_dtype("linear", input=x, weight=weight, bias=bias)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features (shape {tuple(x.shape)}) but "
                         f"the weight expects {weight.shape[-1]} (weight shape "
                         f"{tuple(weight.shape)}, stored as (out_features, in_features)).")
    lead = tuple(x.shape[:-1])
    y = x.reshape(-1, x.shape[-1]) @ weight.mT  # (N, out)
    if bias is not None:
        y = y + bias
    return y.reshape(lead + (weight.shape[0],))


# Composites whose computation an upper layer takes over for some inputs, filled by that layer
# (PyTorch's seam for loss_parallel): "cross_entropy" -> handler(logits, target, ignore_index)
# giving (per-token nll, valid mask), or None to leave the inputs to the code here.
HANDLERS: dict = {}


def cross_entropy(input, target, ignore_index: int = -100, reduction: str = "mean"):
    """Cross-entropy of logits ``input`` (N, C) or (N, C, d1, ...) against class indices.

    Targets equal to ``ignore_index`` contribute nothing; "mean" divides by the number of the
    others, as PyTorch.
    """
    if not isinstance(reduction, str) or reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got "
                         f"{reduction!r}.")
    ignore_index = as_int(ignore_index, "cross_entropy: ignore_index",
                          fix="It is the class index whose targets are skipped (default -100).")
    input = _floating(input, "cross_entropy")
    if input.ndim > 2:  # class dim 1 -> last
        input = input.permute((0,) + tuple(range(2, input.ndim)) + (1,))
    target = as_tensor(target) if not hasattr(target, "dtype") else target
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"cross_entropy: target shape {tuple(target.shape)} does not match the "
                         f"input's non-class dims {tuple(input.shape[:-1])} (input shape "
                         f"{tuple(input.shape)}).")
    if not np.issubdtype(target.dtype, np.integer):
        raise TypeError(f"cross_entropy: target must hold class indices (integers), got dtype "
                        f"{target.dtype}.")
    # Against the global class count: under loss_parallel each rank holds a block of the
    # classes, and the vocab-parallel gather would let a target no block holds give 0.
    _check_index(target, "cross_entropy", lambda values: st.check_rows(
        values, input.shape[-1], "cross_entropy: target", "classes", nnops.CE_FIX,
        ignore_index=ignore_index))
    handler = HANDLERS.get("cross_entropy")
    taken = handler(input, target, ignore_index) if handler is not None else None
    if taken is not None:
        nll, valid = taken
    else:
        valid = target != ignore_index
        safe = pw.where(valid, target, 0)  # an ignored row still needs an in-range index
        nll = pw.where(valid, nnops.softmax_cross_entropy(input, safe), 0.0)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    # Mean over non-ignored targets; an all-ignored batch gives 0/0 = nan, as PyTorch. float16
    # losses are summed and divided in float32: 40,000 rows of ~10 sum past 65504.
    acc = st.accumulate_dtype(input.dtype)
    mean = nll.astype(acc).sum() / valid.astype(acc).sum()
    return mean.astype(input.dtype)


_SDPA = {"kernel": "auto"}


@contextlib.contextmanager
def sdpa_kernel(kernel: str):
    """How scaled_dot_product_attention computes self-attention with no mask tensor or dropout
    inside the block (as torch.nn.attention.sdpa_kernel): "math", as matmul, softmax, matmul;
    "flash", as one attention op, whose C and Triton kernels never write the (L, L) scores
    whole and whose backward recomputes them: autograd keeps q, k and v, not the (L, L)
    probabilities; "auto", the default: "flash" where a kernel runs it (in a function traced
    by dtensor.compile for the C or Triton backend), "math" elsewhere (eager, and the numpy
    backend, whose attention would be numpy's GEMMs plus a recomputing backward). The C kernel
    is register-tiled and skips the keys a causal block cannot see; against BLAS's GEMMs plus
    the C softmax kernels (benchmarks/attention.py, AVX-512) it takes 0.75x the time at the
    standard workload's TP=2 shape, 0.57x at GPT-2 small's and 0.70x at L = 1024, while never
    holding the (L, L) probabilities. A compiled function keeps the choice it was traced
    with."""
    if kernel not in ("auto", "math", "flash"):
        raise ValueError(f"sdpa_kernel: kernel must be 'auto', 'math' or 'flash', got "
                         f"{kernel!r}.")
    before, _SDPA["kernel"] = _SDPA["kernel"], kernel
    try:
        yield
    finally:
        _SDPA["kernel"] = before


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 training: bool = True, enable_gqa: bool = False):
    """softmax(q k^T * scale + mask) v over (..., L, E) x (..., S, E) -> (..., L, Ev).

    ``attn_mask`` is boolean (True = may attend) or additive float, broadcastable to (..., L, S).
    ``enable_gqa``: key and value may have fewer heads (dim -3) than query, a divisor of its
    count; query head h reads key/value head h // (Hq / Hkv) (grouped-query attention).
    """
    op = "scaled_dot_product_attention"
    query, key, value = (_floating(t, op, n) for t, n in
                         ((query, "query"), (key, "key"), (value, "value")))
    is_causal = as_bool(is_causal, f"{op}: is_causal")
    if as_bool(enable_gqa, f"{op}: enable_gqa"):
        key, value = _grouped(query, key, value)
    dropout_p = as_real(dropout_p, f"{op}: dropout_p", low=0, high=1)
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"scaled_dot_product_attention: query dim {query.shape[-1]} != key dim "
                         f"{key.shape[-1]} (shapes {tuple(query.shape)}, {tuple(key.shape)}).")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: pass either attn_mask or "
                         "is_causal=True, not both.")
    kernel = _SDPA["kernel"]
    flash = kernel == "flash" or (kernel == "auto" and tracer.fused_kernels())
    if (flash and attn_mask is None and (dropout_p == 0.0 or not training)
            and tuple(query.shape) == tuple(key.shape) == tuple(value.shape)):
        return nnops.attention(query, key, value, scale=float(scale), causal=is_causal)
    att = (query * scale) @ key.mT  # (..., L, S); scaling q touches L*E, not L*S, elements
    if attn_mask is not None:
        attn_mask = _input(attn_mask, op, "attn_mask")
        try:
            fits = np.broadcast_shapes(tuple(attn_mask.shape), tuple(att.shape)) == \
                tuple(att.shape)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"{op}: attn_mask of shape {tuple(attn_mask.shape)} does not "
                             f"broadcast to the scores' shape {tuple(att.shape)} (..., L, S) "
                             f"for query {tuple(query.shape)} and key {tuple(key.shape)}.")
        if attn_mask.dtype == np.bool_:
            # An additive 0/-inf mask, built on the mask's own (usually (L, S)) shape, is exact:
            # masked scores get probability 0, so softmax's backward sends them no gradient.
            attn_mask = pw.where(attn_mask, 0.0, -np.inf).astype(att.dtype)
        att = att + attn_mask
    # The causal mask lives in the softmax kernel: no (L, S) mask tensor, no extra pass.
    att = nnops.softmax(att, causal=True) if is_causal else softmax(att, -1)
    if dropout_p > 0.0:
        att = dropout(att, dropout_p, training)
    return att @ value


def _grouped(query, key, value):
    """key and value with each head repeated for the query heads of its group."""
    if query.ndim < 3 or key.ndim < 3 or value.ndim < 3:
        raise ValueError(f"scaled_dot_product_attention(enable_gqa=True) needs heads at dim -3: "
                         f"shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)} should be (..., heads, L or S, E).")
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hk != hv or hq % hk:
        raise ValueError(f"scaled_dot_product_attention(enable_gqa=True): key and value need "
                         f"the same number of heads, a divisor of the query's {hq}; got key "
                         f"{hk}, value {hv} heads.")
    if hq == hk:
        return key, value
    return (key.repeat_interleave(hq // hk, dim=-3), value.repeat_interleave(hq // hk, dim=-3))
