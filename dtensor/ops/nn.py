"""Neural-network primitives with direct rules: erf, gelu, softmax, log_softmax, normalize,
softmax_cross_entropy, adamw_step, and the backwards.

Each is expressible with the pointwise and reduction primitives (tests/test_ops.py checks the
direct op against that composite, values and gradients). They are primitives because
benchmarks/gpt_step.py showed the composites' cost: GELU's erf is ~20 ufunc passes, and the
composite softmax backward re-derives what ``y * (g - sum(g * y))`` gives in three, the
composite layer norm is ~30 ops, cross-entropy through log_softmax writes and re-reads the
whole (tokens, vocab) log-probabilities, and AdamW's update ~14 passes over every parameter. As
single ops they run as fused, cache-blocked numpy kernels (see blockwise.py), and the compiler
lowers them as one fused group each.

Backward ops (``*_backward``) have no vjp: double backward is not supported.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from dtensor.ops import blockwise
from dtensor.ops import expr as K
from dtensor.ops.pointwise import pointwise_abstract
from dtensor.ops.registry import Aval, defop
from dtensor.ops.structural import accumulate_dtype, check_rows, matmul

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_C = 0.044715
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

# Numerical Recipes' erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2), |relative error| < 1.2e-7.
_ERFC_COEFFS = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                0.09678418, 0.37409196, 1.00002368, -1.26551223)


# erf's Maclaurin series 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1)) up to n = 6, for |x| <
# 1/2: there 1 - erfc(|x|) would cancel (erfc's 1.2e-7 is absolute in erf: 1% of erf(1e-5)),
# and the next term is under 1e-9 of the sum.
_ERF_SMALL = 0.5
_ERF_SERIES = tuple(_TWO_OVER_SQRT_PI * (-1) ** n / (math.factorial(n) * (2 * n + 1))
                    for n in range(7))


def erf_block(out, x):
    """erf(x) into ``out`` (may alias nothing of x); numpy has no erf of its own."""
    z = np.abs(x)
    t = z * 0.5
    t += 1.0
    np.reciprocal(t, out=t)
    p = t * _ERFC_COEFFS[0]
    for c in _ERFC_COEFFS[1:-1]:
        p += c
        p *= t
    p += _ERFC_COEFFS[-1]
    z *= z
    p -= z
    np.exp(p, out=p)
    p *= t  # erfc(|x|)
    np.subtract(1.0, p, out=p)
    np.copysign(p, x, out=out)
    small = np.flatnonzero(np.abs(x) < _ERF_SMALL)  # few in a block: fix up, not np.where
    if small.size:
        xs = x[small]
        x2, acc = xs * xs, np.full_like(xs, _ERF_SERIES[-1])
        for c in _ERF_SERIES[-2::-1]:
            acc *= x2
            acc += c
        out[small] = acc * xs


# Abramowitz & Stegun 7.1.26: erfc(z) = t P(t) exp(-z^2), t = 1 / (1 + p z), |error| < 1.5e-7.
# GELU uses it because its exp(-z^2) is the one transcendental pass (the slowest ufunc here);
# x Phi(x) comes within ~3e-7 of exact (checked against math.erf over [-12, 12]).
_AS_P = 0.3275911
_AS_COEFFS = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
# Q(a) = erfc(a / sqrt2) / 2, the normal upper tail, is t P(t) exp(-a^2 / 2) with
# t = 1 / (1 + p a / sqrt2): the 1/2 folded into P's coefficients, the 1/sqrt2 into p.
_Q_P = _AS_P * _SQRT_HALF
_Q_COEFFS = tuple(0.5 * c for c in _AS_COEFFS)


def _contig(a):
    return np.ascontiguousarray(a)


def _pointwise_new(kernel, x, *more):
    x = _contig(x)
    return blockwise.pointwise(kernel, np.empty_like(x), x, *[_contig(m) for m in more])


def _erf_lower(x):
    """erf_block as a kernel expression: 1 - erfc(|x|) with x's sign, the series below 1/2."""
    z = K.abs(x)
    t = 1.0 / (z * 0.5 + 1.0)
    r = 1.0 - K.exp(K.polynomial(t, _ERFC_COEFFS) - z * z) * t
    x2 = x * x
    return K.where(z < _ERF_SMALL, K.polynomial(x2, _ERF_SERIES[::-1]) * x,
                   K.where(x < 0, -r, r))


# ---------------------------------------------------------------- erf

# d erf(x)/dx = 2/sqrt(pi) exp(-x^2)
erf = defop(
    "erf", impl=lambda x: _pointwise_new(erf_block, x), abstract=pointwise_abstract,
    vjp=lambda g, out, x: (g * _TWO_OVER_SQRT_PI * (-(x * x)).exp(),),
    linearity="none", shard="pointwise", lower=_erf_lower)


# ---------------------------------------------------------------- gelu


def _gelu_erf_block(out, x):
    # x Phi(x) = relu(x) - |x| Q(|x|) for either sign of x: no sign fix-up pass, and no
    # 1 - Q cancellation for negative x. |x| is capped where Q is 0 anyway (exp(-x^2/2)
    # underflows in every type long before 64), so x = inf gives inf, not inf * 0.
    a = np.abs(x)
    np.minimum(a, 64.0, out=a)
    t = a * _Q_P
    t += 1.0
    np.reciprocal(t, out=t)
    q = t * _Q_COEFFS[0]
    for c in _Q_COEFFS[1:]:
        q += c
        q *= t
    e = np.multiply(x, x)
    e *= -0.5
    np.exp(e, out=e)
    q *= e
    q *= a
    np.maximum(x, 0.0, out=out)
    out -= q


# The tanh form as x s with s = (1 + tanh u) / 2 = sigmoid(2 u), from e = exp(-2 |u|): no
# 1 + tanh u that cancels to 0 for negative x (float32 tanh(-9.97) is -1: GELU(-5.4) would be
# 0 or 13 times too large), and s (1 - s) = e r^2 with r = 1 / (1 + e) for the gradient.


def _gelu_tanh_parts(x):
    """(u, e, r): u = a (x + c x^3), e = exp(-2 |u|), r = 1 / (1 + e)."""
    u = x * x
    u *= _TANH_C
    u += 1.0
    u *= x
    u *= _SQRT_2_OVER_PI
    e = np.abs(u)
    e *= -2.0
    np.exp(e, out=e)
    r = e + 1.0
    np.reciprocal(r, out=r)
    return u, e, r


def _gelu_tanh_block(out, x):
    u, e, r = _gelu_tanh_parts(x)
    e *= r  # sigmoid(-2 |u|)
    np.copyto(e, r, where=u >= 0)
    np.multiply(e, x, out=out)


# The erf form's backward reads the forward's output y = x Phi(x): Phi = y / x costs one division
# where recomputing it costs the polynomial and a reciprocal. At x = 0 that is 0 / 0, and for
# tiny x an absolute error in y (the sum of Partial shares, say) is magnified by 1 / |x|, so
# there it takes Phi's Taylor expansion 1/2 + x / sqrt(2 pi) - O(x^3), below float rounding for
# |x| < 1e-4 (float32) or 1e-6 (float64).
_NEAR_ZERO = {2: 1e-2, 4: 1e-4, 8: 1e-6}


def _gelu_erf_grad_block(out, g, x, y):
    # d/dx [x Phi(x)] = Phi(x) + x pdf(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = y / x
    e = np.multiply(x, x)
    # Usually no such x in a block (float32: |x| < 1e-4): fix up the few, not a whole-block
    # np.where (a quarter of the kernel's time).
    near = np.flatnonzero(e < _NEAR_ZERO[x.itemsize] ** 2)
    if near.size:
        phi[near] = x[near] * _INV_SQRT_2PI + 0.5
    e *= -0.5
    np.exp(e, out=e)
    e *= _INV_SQRT_2PI
    e *= x
    phi += e
    np.multiply(phi, g, out=out)


def _gelu_tanh_grad_block(out, g, x, y):
    # y = x s, s = sigmoid(2 u), u = a (x + c x^3): dy/dx = s + x s (1 - s) 2 a (1 + 3 c x^2),
    # recomputed from x (y / x would cancel where s is near 1).
    u, e, r = _gelu_tanh_parts(x)
    du = x * x
    du *= 3.0 * _TANH_C
    du += 1.0
    du *= 2.0 * _SQRT_2_OVER_PI
    du *= x
    du *= e
    du *= r
    du *= r  # x s (1 - s) 2 du/dx
    e *= r
    np.copyto(e, r, where=u >= 0)  # s
    np.add(e, du, out=out)
    out *= g


def _tanh_parts_lower(x):
    u = (x * x * _TANH_C + 1.0) * x * _SQRT_2_OVER_PI
    e = K.exp(K.abs(u) * -2.0)
    r = 1.0 / (e + 1.0)
    return u, e, r, K.where(u >= 0, r, e * r)


def _gelu_lower(x, approximate):
    """_gelu_erf_block / _gelu_tanh_block as kernel expressions."""
    if approximate == "tanh":
        return _tanh_parts_lower(x)[3] * x
    a = K.minimum(K.abs(x), 64.0)
    t = 1.0 / (a * _Q_P + 1.0)
    q = K.polynomial(t, _Q_COEFFS) * t * K.exp(x * x * -0.5) * a
    return K.maximum(x, 0.0) - q


def _gelu_backward_lower(g, x, y, approximate):
    """_gelu_erf_grad_block / _gelu_tanh_grad_block as kernel expressions."""
    if approximate == "tanh":
        u, e, r, s = _tanh_parts_lower(x)
        du = (x * x * (3.0 * _TANH_C) + 1.0) * (2.0 * _SQRT_2_OVER_PI) * x * e * r * r
        return (s + du) * g
    near = x * x < K.lift({k: v * v for k, v in _NEAR_ZERO.items()})
    phi = K.where(near, x * _INV_SQRT_2PI + 0.5, y / K.where(near, 1.0, x))
    return (phi + K.exp(x * x * -0.5) * _INV_SQRT_2PI * x) * g


def _gelu_impl(x, approximate):
    return _pointwise_new(_gelu_erf_block if approximate == "none" else _gelu_tanh_block, x)


def _gelu_backward_impl(g, x, y, approximate):
    x = _contig(x)
    g, y = (_contig(np.broadcast_to(a, x.shape)) for a in (g, y))
    kernel = _gelu_erf_grad_block if approximate == "none" else _gelu_tanh_grad_block
    return blockwise.pointwise(kernel, np.empty_like(x), g, x, y)


gelu = defop(
    "gelu", impl=_gelu_impl, abstract=lambda x, approximate: Aval(x.shape, x.dtype),
    vjp=lambda g, out, x, approximate: (gelu_backward(g, x, out, approximate=approximate),),
    shard="pointwise", lower=_gelu_lower, params={"approximate": ("none", "tanh")})

# gelu_backward(g, x, y): the gradient through y = gelu(x), given the forward's output y.
gelu_backward = defop(
    "gelu_backward", impl=_gelu_backward_impl,
    abstract=lambda g, x, y, approximate: pointwise_abstract(g, x, y), shard="pointwise",
    lower=_gelu_backward_lower, params={"approximate": ("none", "tanh")})

# ---------------------------------------------------------------- softmax over the last dim


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    v = np.ones(n, dtype)
    v.flags.writeable = False
    return v


# The types BLAS reduces (a matrix-vector product with ones); others keep numpy's reductions.
_BLAS_TYPES = (np.float32, np.float64)


def _row_sums(x):
    """Sums over the last dim of a 2-D block, as a column. float32/float64: a BLAS
    matrix-vector product, ~3x faster than ``x.sum(axis=1)`` on rows of a few hundred (numpy
    reduces each row on its own); other types keep numpy's reduction (BLAS has none for them)."""
    if x.dtype in _BLAS_TYPES:
        return (x @ _ones(x.shape[1], x.dtype))[:, None]
    return x.sum(axis=1, keepdims=True)


def _row_means(x):
    """Means of the rows of a 2-D block: the sums divided by n (not multiplied by a rounded
    1/n, which moves a constant row's mean off its value)."""
    if x.dtype in _BLAS_TYPES:
        s = _row_sums(x)
        s /= x.shape[1]
        return s
    return x.mean(axis=1, keepdims=True)


def _softmax_block(out, x):
    m = x.max(axis=1, keepdims=True)
    np.subtract(x, m, out=out)
    np.exp(out, out=out)
    out /= _row_sums(out)


def _log_softmax_block(out, x):
    m = x.max(axis=1, keepdims=True)
    np.subtract(x, m, out=out)
    e = np.exp(out)
    out -= np.log(_row_sums(e))


def _softmax_backward_block(out, g, y):
    # dx = y * (g - sum(g * y)): the Jacobian of softmax is diag(y) - y y^T.
    np.multiply(g, y, out=out)
    s = _row_sums(out)
    np.subtract(g, s, out=out)
    out *= y


def _log_softmax_backward_block(out, g, logp):
    # dx = g - softmax * sum(g)
    np.exp(logp, out=out)
    out *= _row_sums(g)
    np.subtract(g, out, out=out)


def _accumulating(kernel, dtype):
    """``kernel`` as it runs on rows of ``dtype``: float16 blocks are widened to float32, run,
    and rounded once into the output (as PyTorch accumulates them), so every row sum, mean,
    sum of squares and dot product of these kernels is a float32 one. The blocks are cache
    sized (blockwise.py), so the widened copies never reach memory."""
    acc = accumulate_dtype(dtype)
    if acc == dtype:
        return kernel

    def widened(out, *ins):
        wide = np.empty(out.shape, acc)
        kernel(wide, *[a.astype(acc) for a in ins])
        with np.errstate(over="ignore"):  # a result past float16's range is inf, as PyTorch's
            out[...] = wide
    return widened


def _rowwise_new(kernel, *arrays):
    shape = arrays[-1].shape
    arrays = [_contig(np.broadcast_to(a, shape)) for a in arrays]
    out = np.empty_like(arrays[-1])
    return blockwise.rowwise(_accumulating(kernel, out.dtype), out, *arrays)


def _last_dim_abstract(*xs):
    return Aval(xs[-1].shape, xs[-1].dtype)


def _softmax_impl(x, causal):
    if x.size == 0:
        return np.empty_like(x)
    if not causal:
        return _rowwise_new(_softmax_block, x)
    # Causal: entry (i, j) of each trailing (L, S) matrix takes part iff j <= i (top-left
    # aligned, as torch's is_causal): an additive 0 / -inf mask over whole matrices.
    L, S = x.shape[-2], x.shape[-1]
    add = np.where(np.tri(L, S, dtype=bool), 0.0, -np.inf).astype(x.dtype)  # (L, S)
    x = _contig(x)
    out = np.empty_like(x)
    shape = (math.prod(x.shape[:-2]), L, S)
    xs, outs = x.reshape(shape), out.reshape(shape)
    softmax_rows = _accumulating(_softmax_block, x.dtype)

    def run(lo, hi):  # whole (L, S) matrices: the mask broadcasts, no per-row gather
        block = outs[lo:hi]
        np.add(xs[lo:hi], add, out=block)
        rows = block.reshape(-1, S)
        softmax_rows(rows, rows)

    blockwise.run_rows(run, xs.shape[0], L * S * x.itemsize)
    return out


def _softmax_lower(x, causal=False):
    e = K.exp(x - K.rowmax(x))
    y = e / K.rowsum(e)
    return K.causal(y) if causal else y


def _log_softmax_lower(x):
    z = x - K.rowmax(x)
    return z - K.log(K.rowsum(K.exp(z)))


softmax = defop(
    "softmax", impl=_softmax_impl, abstract=lambda x, causal: Aval(x.shape, x.dtype),
    vjp=lambda g, out, x, causal: (softmax_backward(g, out),), shard="rowwise",
    lower=_softmax_lower)

softmax_backward = defop(
    "softmax_backward", impl=lambda g, y: _rowwise_new(_softmax_backward_block, g, y),
    abstract=_last_dim_abstract, shard="rowwise",
    lower=lambda g, y: (g - K.rowsum(g * y)) * y)

log_softmax = defop(
    "log_softmax", impl=lambda x: _rowwise_new(_log_softmax_block, x), abstract=_last_dim_abstract,
    vjp=lambda g, out, x: (log_softmax_backward(g, out),), shard="rowwise",
    lower=_log_softmax_lower)

log_softmax_backward = defop(
    "log_softmax_backward", impl=lambda g, logp: _rowwise_new(_log_softmax_backward_block, g, logp),
    abstract=_last_dim_abstract, shard="rowwise",
    lower=lambda g, lp: g - K.exp(lp) * K.rowsum(g))


# ---------------------------------------------------------------- attention
# softmax(q k^T scale) v over the last two dims of same-shape q, k, v (..., L, E): one op, so a
# backend can run it as one kernel that never writes the (L, L) scores whole (FlashAttention's
# blocking), and autograd keeps q, k, v instead of the probabilities: the backward recomputes
# them. The impl is the composite's own computation, so eager's numbers do not change.


def _attention_probs(q, k, scale, causal):
    """(q scale, softmax(q scale k^T)), as the composite (q * scale) @ k.mT, softmax forms them."""
    qs = np.multiply(q, scale)
    return qs, _softmax_impl(matmul.impl(qs, np.swapaxes(k, -1, -2)), causal)


def _attention_backward_impl(g, q, k, v, scale, causal):
    """(dq, dk, dv) stacked: ds = softmax_backward(g v^T, p), dq = ds k scale, dk = ds^T q
    scale, dv = p^T g."""
    qs, p = _attention_probs(q, k, scale, causal)
    ds = softmax_backward.impl(matmul.impl(g, np.swapaxes(v, -1, -2)), p)
    return np.stack([np.multiply(matmul.impl(ds, k), scale),
                     matmul.impl(np.swapaxes(ds, -1, -2), qs),
                     matmul.impl(np.swapaxes(p, -1, -2), g)])


def _attention_abstract(q, k, v, scale, causal):
    if not tuple(q.shape) == tuple(k.shape) == tuple(v.shape):
        raise ValueError(f"attention: query, key and value need one shape (..., L, E), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; "
                         f"scaled_dot_product_attention takes other shapes.")
    return Aval(tuple(q.shape), np.result_type(q.dtype, k.dtype, v.dtype))


def _attention_vjp(g, out, q, k, v, scale, causal):
    grads = attention_backward(g, q, k, v, scale=scale, causal=causal)
    return grads[0], grads[1], grads[2]


attention = defop(
    "attention", impl=lambda q, k, v, scale, causal: matmul.impl(
        _attention_probs(q, k, scale, causal)[1], v),
    abstract=_attention_abstract, vjp=_attention_vjp, shard="attention")

attention_backward = defop(
    "attention_backward", impl=_attention_backward_impl,
    abstract=lambda g, q, k, v, scale, causal: Aval((3,) + tuple(q.shape), q.dtype),
    shard="attention")


# ---------------------------------------------------------------- layer-norm core


# Row dot products: numpy >= 2's vecdot is ~2x faster than the einsum it replaces.
_vecdot = getattr(np, "vecdot", None) or (lambda a, b: np.einsum("ij,ij->i", a, b))


def _normalize_stats(x, eps):
    d = x - _row_means(x)
    rstd = _vecdot(d, d)[:, None]  # sum of squares without a temporary
    rstd /= x.shape[1]
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    return d, rstd


def _normalize_block(out, x, eps):
    d, rstd = _normalize_stats(x, eps)
    np.multiply(d, rstd, out=out)


def _normalize_backward_block(out, g, x, eps):
    # xhat = d rstd (d = x - mean); dx = rstd (g - mean(g) - xhat mean(g xhat))
    #                                  = (g - mean(g)) rstd - d (rstd^3 mean(g d)).
    # The per-row factors are formed first: one pass over the block fewer than scaling d to
    # xhat (a column broadcast, the slowest of these passes). They are scaled by rstd one factor
    # at a time (rstd^3 underflows for rows of spread ~1e13); float16 rows arrive widened
    # (_accumulating), where g . d overflowed for a spread of ~10.
    d, rstd = _normalize_stats(x, eps)
    c = _vecdot(g, d)[:, None]
    c *= rstd
    c *= rstd
    c *= rstd
    c /= x.shape[1]
    np.subtract(g, _row_means(g), out=out)
    out *= rstd
    np.multiply(d, c, out=d)
    out -= d


def _normalize_lower(x, eps, g=None):
    """(x - mean) rstd; with g, normalize's backward as _normalize_backward_block forms it."""
    d = x - K.rowsum(x) / K.cols
    rstd = 1.0 / K.sqrt(K.rowsum(d * d) / K.cols + eps)
    if g is None:
        return d * rstd
    c = K.rowsum(g * d) * rstd * rstd * rstd / K.cols
    return (g - K.rowsum(g) / K.cols) * rstd - d * c


normalize = defop(
    "normalize", impl=lambda x, eps: _rowwise_new(
        lambda o, a: _normalize_block(o, a, eps), x),
    abstract=lambda x, eps: Aval(x.shape, x.dtype),
    vjp=lambda g, out, x, eps: (normalize_backward(g, x, eps=eps),),
    shard="rowwise", lower=_normalize_lower)

normalize_backward = defop(
    "normalize_backward", impl=lambda g, x, eps: _rowwise_new(
        lambda o, a, b: _normalize_backward_block(o, a, b, eps), g, x),
    abstract=lambda g, x, eps: Aval(x.shape, x.dtype), shard="rowwise",
    lower=lambda g, x, eps: _normalize_lower(x, eps, g))

# ---------------------------------------------------------------- softmax cross-entropy


def _lse_block(x):
    """Row maxima m and sums of exp(x - m) (so logsumexp = m + log s), and exp(x - m)."""
    m = x.max(axis=1, keepdims=True)
    e = x - m
    np.exp(e, out=e)
    return m, _row_sums(e), e


CE_FIX = ("Targets are class indices below the logits' class count; mark a row to skip with "
          "cross_entropy's ignore_index.")


def logit_rows(x, target):
    """(rows, classes) logits and flat targets, checked to lie in [0, classes) (cross_entropy
    has replaced its ignored ones)."""
    classes = x.shape[-1]
    ts = check_rows(target, classes, "softmax_cross_entropy: target", "classes", CE_FIX)
    return _contig(x).reshape(math.prod(x.shape[:-1]), classes), ts


# float16 logits are widened a block at a time (see _accumulating): in float16 a row's sum of
# exponentials drops terms below 1/2048 of it, and passes 65504 for a vocabulary that large.


def _softmax_cross_entropy_impl(x, target):
    xs, ts = logit_rows(x, target)
    out = np.empty(ts.shape, x.dtype)
    acc = accumulate_dtype(x.dtype)

    def run(lo, hi):
        m, s, _ = _lse_block(xs[lo:hi].astype(acc, copy=False))
        np.log(s, out=s)
        s += m
        np.subtract(s[:, 0], xs[np.arange(lo, hi), ts[lo:hi]], out=out[lo:hi])

    blockwise.run_rows(run, xs.shape[0], xs.shape[1] * x.itemsize)
    return out.reshape(x.shape[:-1])


def _softmax_cross_entropy_backward_impl(g, x, target):
    # d nll / dx = softmax(x) - onehot(target), times the row's gradient
    xs, ts = logit_rows(x, target)
    gs = np.broadcast_to(g, np.shape(target)).reshape(-1, 1)
    out = np.empty_like(xs)
    acc = accumulate_dtype(x.dtype)

    def run(lo, hi):
        _, s, e = _lse_block(xs[lo:hi].astype(acc, copy=False))
        np.divide(gs[lo:hi], s, out=s)
        np.multiply(e, s, out=out[lo:hi])
        out[np.arange(lo, hi), ts[lo:hi]] -= gs[lo:hi, 0]

    blockwise.run_rows(run, xs.shape[0], xs.shape[1] * x.itemsize)
    return out.reshape(x.shape)


def _cross_entropy_abstract(x, target):
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"softmax_cross_entropy: target shape {tuple(target.shape)} must be the "
                         f"logits' shape without the class dim, {tuple(x.shape[:-1])}.")
    return Aval(tuple(x.shape[:-1]), x.dtype)


# -log softmax(x)[target] per row, from logits over the last dim: one pass over the logits
# forward (max, exp, sum, and the target's logit), one backward (softmax - onehot), and nothing
# of the (rows, classes) size stored in between.
def _cross_entropy_lower(x, target, g=None):
    """Per row: logsumexp(x) - x[target]; with g (one per row), g (softmax(x) - onehot)."""
    m = K.rowmax(x)
    e = K.exp(x - m)
    if g is not None:
        return e * (g / K.rowsum(e)) - K.where(K.eq(K.col, target), g, 0.0)
    return (K.log(K.rowsum(e)) + m) - K.rowsum(K.where(K.eq(K.col, target), x, 0.0))


softmax_cross_entropy = defop(
    "softmax_cross_entropy", impl=_softmax_cross_entropy_impl, abstract=_cross_entropy_abstract,
    vjp=lambda g, out, x, target: (softmax_cross_entropy_backward(g, x, target), None),
    shard="rowwise", lower=_cross_entropy_lower, nondiff=(1,), per_row=(1,),
    check=lambda x, target: logit_rows(x, target))

softmax_cross_entropy_backward = defop(
    "softmax_cross_entropy_backward", impl=_softmax_cross_entropy_backward_impl,
    abstract=lambda g, x, target: Aval(tuple(x.shape), x.dtype), shard="rowwise",
    lower=lambda g, x, target: _cross_entropy_lower(x, target, g), nondiff=(2,),
    per_row=(0, 2), check=lambda g, x, target: logit_rows(x, target))

# sum_j exp(x_j - m) per row, m one value a row (its max, or a larger one): a vocab-parallel
# cross-entropy's sum of exponentials over one rank's block of classes (its sharding rule:
# a sharded class dim gives Partial(sum)), one pass over the logits and nothing of their size
# kept for the backward, whose exp(x - m) g is computed from the logits again (pointwise ops,
# which a compiled backward fuses into one kernel that may write over the logits).
def _sum_exp_impl(x, m):
    C = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    xs, ms = _contig(x).reshape(rows, C), np.reshape(m, (rows, 1))
    out = np.zeros(rows, x.dtype)
    acc = accumulate_dtype(x.dtype)

    def run(lo, hi):
        e = np.subtract(xs[lo:hi], ms[lo:hi], dtype=acc)
        np.exp(e, out=e)
        out[lo:hi] = _row_sums(e)[:, 0]

    if C:
        blockwise.run_rows(run, rows, C * x.itemsize)
    return out.reshape(x.shape[:-1])


def _sum_exp_abstract(x, m):
    if not x.shape or tuple(m.shape) != tuple(x.shape[:-1]) + (1,):
        raise ValueError(f"sum_exp: m must hold one value per row of x, shape "
                         f"{tuple(x.shape[:-1]) + (1,)}; got x {tuple(x.shape)}, m "
                         f"{tuple(m.shape)}.")
    return Aval(tuple(x.shape[:-1]), x.dtype)


sum_exp = defop(
    "sum_exp", impl=_sum_exp_impl, abstract=_sum_exp_abstract,
    vjp=lambda g, out, x, m: (g.reshape(tuple(g.shape) + (1,)) * (x - m).exp(), None),
    shard="row_reduce", lower=lambda x, m: K.rowsum(K.exp(x - m)), nondiff=(1,))

# ---------------------------------------------------------------- AdamW update


def adamw_constants(lr, beta1, beta2, eps, weight_decay, bc1, bc2) -> tuple:
    """The update's seven constants, in double: lr/bc1 m / (sqrt(v / bc2) + eps) is
    (lr sqrt(bc2) / bc1) m / (sqrt(v) + eps sqrt(bc2)), the bias corrections moved onto the
    scalars (one pass fewer). Every backend rounds them to the parameter's type. Arrays of
    float64 give every parameter's at once, with the same float operations."""
    rs = math.sqrt(bc2) if np.ndim(bc2) == 0 else np.sqrt(bc2)
    return (beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps * rs, lr * rs / bc1,
            1.0 - lr * weight_decay)


def _adamw_lower(p, g, m, v, *k):
    """(new p, m, v) from the seven constants (adamw_constants): the expression the kernels of
    the AdamW group render."""
    mo = m * k[0] + g * k[1]
    vo = v * k[2] + (g * g) * k[3]
    return p * k[6] - (mo / (K.sqrt(vo) + k[4])) * k[5], mo, vo


def _adamw_block(out, p, g, m, v, **hp):
    b1, c1, b2, c2, eps, step, decay = adamw_constants(**hp)
    po, mo, vo = out
    np.multiply(m, b1, out=mo)
    tmp = g * c1
    mo += tmp
    np.multiply(g, g, out=tmp)
    tmp *= c2
    np.multiply(v, b2, out=vo)
    vo += tmp
    np.sqrt(vo, out=tmp)
    tmp += eps
    np.divide(mo, tmp, out=tmp)
    tmp *= step
    np.multiply(p, decay, out=po)
    po -= tmp


def adamw_update(p, g, m, v, out=None, **hp):
    """The update of one parameter into ``out`` (new param, m, v as rows of a (3, size) array,
    possibly a column range of a larger one)."""
    p, g, m, v = (_contig(a).reshape(-1) for a in (p, g, m, v))
    out = np.empty((3, p.size), p.dtype) if out is None else out

    def run(lo, hi):
        _adamw_block(out[:, lo:hi], p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], **hp)

    blockwise.run_rows(run, p.size, p.itemsize)
    return out


# One AdamW step (PyTorch semantics: decoupled decay, bias corrections bc1 = 1 - beta1^t and
# bc2 = 1 - beta2^t) for one parameter. The three results (new param, first and second moment)
# come stacked as (3, ...) so the op keeps a single output; the optimizer takes views of it.
adamw_step = defop(
    "adamw_step", impl=lambda p, g, m, v, **hp: adamw_update(p, g, m, v, **hp).reshape(
        (3,) + p.shape),
    abstract=lambda p, g, m, v, **hp: Aval((3,) + tuple(p.shape), p.dtype),
    shard="pointwise_stacked", lower=_adamw_lower)  # as the AdamW group's kernels run it
