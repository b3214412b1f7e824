"""The C backend: the CPU counterpart of the Triton backend, as TorchInductor's C++ backend is
the CPU counterpart of its Triton one.

Every fused pointwise group and every row-wise op of a graph (softmax, layer-norm, softmax
cross-entropy, their backwards, GELU, the AdamW group update) becomes a C function; one graph's
functions are one C file, compiled once with the system C compiler (``$CC``, else ``cc``) into
a shared library named by the hash of its source and flags, and called through ctypes. A
kernel is one pass over its rows: the temporaries numpy materialises between ufuncs stay in
registers, and the loops are SIMD-vectorised (``-O3 -march=native``; exp is a polynomial the
compiler can vectorise, since libm's is a scalar call). ctypes releases the GIL, so a large
kernel's rows are split over the threads of :func:`num_threads` and run in parallel.

Results match numpy's to float rounding, not bit for bit: the same formulas in the same order
(``-ffp-contract=off``: no fused multiply-adds numpy would not do), but exp, log and the
reductions' summation order differ in the last bits. Matmuls, collectives, gathers and anything
not listed stay numpy calls.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import queue
import re
import shutil
import subprocess
import threading

import numpy as np
from dtensor.compile import cache

from dtensor.graph import Graph, Node
from dtensor.ops.nn import logit_rows
from dtensor.ops.registry import OPS

__all__ = ["lower_graph", "num_threads", "CompilerNotFound"]

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-fPIC", "-shared")

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
          np.dtype(np.bool_): "uint8_t"}

# Helpers for one floating type: T is the type, F the literal suffix, S the name suffix. Float
# exp is Cephes' expf (< 2 ulp) written with selects so that loops calling it vectorise; the
# others mirror dtensor/ops/nn.py formula for formula (same constants, same operation order).
_HELPERS = r"""
static inline T dt_exp_S(T x) {
#if IS_FLOAT
    float xc = x < -87.9f ? -87.9f : (x > 88.72283f ? 88.72283f : x);
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round(x / ln 2) */
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t ni = (int32_t)n, h = ni >> 1;  /* 2^n as two factors: n may be 128 */
    union { int32_t i; float f; } s1, s2;
    s1.i = (h + 127) << 23;
    s2.i = (ni - h + 127) << 23;
    float y = p * s1.f * s2.f;
    y = x > 88.72283f ? INFINITY : y;  /* ln(FLT_MAX) = 88.722839 */
    y = x < -87.9f ? 0.0f : y;
    return x != x ? x : y;
#else
    return (exp)(x);
#endif
}

static inline T dt_log_S(T x) { return IS_FLOAT ? (logf)(x) : (log)(x); }
static inline T dt_sqrt_S(T x) { return IS_FLOAT ? (sqrtf)(x) : (sqrt)(x); }
static inline T dt_tanh_S(T x) { return IS_FLOAT ? (tanhf)(x) : (tanh)(x); }
static inline T dt_pow_S(T x, T y) { return IS_FLOAT ? (powf)(x, y) : (pow)(x, y); }
static inline T dt_cos_S(T x) { return IS_FLOAT ? (cosf)(x) : (cos)(x); }
static inline T dt_sin_S(T x) { return IS_FLOAT ? (sinf)(x) : (sin)(x); }
static inline T dt_abs_S(T x) { return IS_FLOAT ? (fabsf)(x) : (fabs)(x); }
static inline T dt_rsqrt_S(T x) { return 1.0F / dt_sqrt_S(x); }

static inline T dt_sigmoid_S(T x) {  /* _sigmoid_impl: exp(-|x|), never overflowing */
    T e = dt_exp_S(x < 0 ? x : -x);
    T s = 1.0F / (1.0F + e);
    return x < 0 ? e * s : s;
}

static inline T dt_clamp_S(T x, T lo, T hi) {  /* min(max(x, lo), hi): NaN stays NaN */
    T y = x < lo ? lo : x;
    return y > hi ? hi : y;
}

static inline T dt_erf_S(T x) {  /* erf_block: Numerical Recipes' erfc, a series below 1/2 */
    T z = x < 0 ? -x : x;
    if (z < 0.5F) {
        T x2 = x * x, acc = 1.2055332981789664e-4F;  /* 2/sqrt(pi) (-1)^n / (n! (2n+1)) */
        acc = acc * x2 - 8.548327023450852e-4F; acc = acc * x2 + 5.223977625442188e-3F;
        acc = acc * x2 - 2.6866170645131252e-2F; acc = acc * x2 + 0.11283791670955126F;
        acc = acc * x2 - 0.37612638903183754F; acc = acc * x2 + 1.1283791670955126F;
        return acc * x;
    }
    T t = 1.0F / (z * 0.5F + 1.0F);
    T p = t * 0.17087277F;
    p += -0.82215223F; p *= t; p += 1.48851587F; p *= t; p += -1.13520398F; p *= t;
    p += 0.27886807F; p *= t; p += -0.18628806F; p *= t; p += 0.09678418F; p *= t;
    p += 0.37409196F; p *= t; p += 1.00002368F; p *= t;
    p += -1.26551223F;
    p -= z * z;
    T e = dt_exp_S(p) * t;
    T r = 1.0F - e;
    return x < 0 ? -r : r;
}

static inline T dt_gelu_none_S(T x) {  /* _gelu_erf_block: relu(x) - |x| Q(|x|) */
    T a = x < 0 ? -x : x;
    a = a > 64.0F ? 64.0F : a;
    T t = 1.0F / (a * 0.2316418882663604F + 1.0F);
    T q = t * 0.5307027145F;
    q += -0.7265760135F; q *= t; q += 0.7107068705F; q *= t; q += -0.142248368F; q *= t;
    q += 0.127414796F; q *= t;
    q *= dt_exp_S(x * x * -0.5F);
    q *= a;
    return (x > 0 ? x : 0.0F) - q;
}

static inline T dt_gelu_tanh_S(T x) {  /* _gelu_tanh_block: x sigmoid(2 u) */
    T u = x * x * 0.044715F + 1.0F;
    u = u * x * 0.7978845608028654F;
    T e = dt_exp_S((u < 0 ? u : -u) * 2.0F);
    T r = 1.0F / (e + 1.0F);
    return (u >= 0 ? r : e * r) * x;
}

static inline T dt_gelu_none_grad_S(T g, T x, T y) {
    T ax = x < 0 ? -x : x;
    T phi = ax < NEAR_ZERO ? x * 0.3989422804014327F + 0.5F : y / x;
    T e = x * x * -0.5F;
    e = dt_exp_S(e) * 0.3989422804014327F * x;
    return (phi + e) * g;
}

static inline T dt_gelu_tanh_grad_S(T g, T x, T y) {  /* _gelu_tanh_grad_block */
    T x2 = x * x;
    T u = (x2 * 0.044715F + 1.0F) * x * 0.7978845608028654F;
    T e = dt_exp_S((u < 0 ? u : -u) * 2.0F);
    T r = 1.0F / (e + 1.0F);
    T du = (x2 * 0.134145F + 1.0F) * 1.5957691216057308F;  /* 3 c and 2 a, rounded once */
    du = du * x * e * r * r;
    return ((u >= 0 ? r : e * r) + du) * g;
}

/* Row reductions in 8 independent lanes, so the compiler vectorises them without
   reassociating anything itself (numpy's sums are lane-split too). */
static inline T dt_sum_S(const T *a, int64_t n) {
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[j + k];
    T s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; j++) s += a[j];
    return s;
}

static inline T dt_dot_S(const T *a, const T *b, int64_t n) {
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[j + k] * b[j + k];
    T s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

static inline T dt_max_S(const T *a, int64_t n) {
    T acc[8];
    for (int k = 0; k < 8; k++) acc[k] = -INFINITY;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] = a[j + k] > acc[k] ? a[j + k] : acc[k];
    T m = -INFINITY;
    for (int k = 0; k < 8; k++) m = acc[k] > m ? acc[k] : m;
    for (; j < n; j++) m = a[j] > m ? a[j] : m;
    return m;
}

/* ---- row-wise ops over the last dim (C columns), rows r0..r1 */

void softmax_S(const T *x, T *out, int64_t r0, int64_t r1, int64_t C, int64_t L, int causal) {
    for (int64_t r = r0; r < r1; r++) {
        const T *a = x + r * C;
        T *o = out + r * C;
        int64_t n = C;
        if (causal) n = r % L + 1 < C ? r % L + 1 : C;  /* entry (i, j) iff j <= i */
        T m = dt_max_S(a, n);
        for (int64_t j = 0; j < n; j++) o[j] = dt_exp_S(a[j] - m);
        T s = dt_sum_S(o, n);
        for (int64_t j = 0; j < n; j++) o[j] /= s;
        for (int64_t j = n; j < C; j++) o[j] = 0;
    }
}

void softmax_backward_S(const T *g, const T *y, T *out, int64_t r0, int64_t r1, int64_t C) {
    for (int64_t r = r0; r < r1; r++) {
        const T *gr = g + r * C, *yr = y + r * C;
        T *o = out + r * C;
        T s = dt_dot_S(gr, yr, C);
        for (int64_t j = 0; j < C; j++) o[j] = (gr[j] - s) * yr[j];
    }
}

void log_softmax_S(const T *x, T *out, int64_t r0, int64_t r1, int64_t C) {
    for (int64_t r = r0; r < r1; r++) {
        const T *a = x + r * C;
        T *o = out + r * C;
        T m = dt_max_S(a, C);
        for (int64_t j = 0; j < C; j++) o[j] = dt_exp_S(a[j] - m);
        T lse = dt_log_S(dt_sum_S(o, C));
        for (int64_t j = 0; j < C; j++) o[j] = (a[j] - m) - lse;
    }
}

void log_softmax_backward_S(const T *g, const T *lp, T *out, int64_t r0, int64_t r1,
                            int64_t C) {
    for (int64_t r = r0; r < r1; r++) {
        const T *gr = g + r * C, *l = lp + r * C;
        T *o = out + r * C;
        T s = dt_sum_S(gr, C);
        for (int64_t j = 0; j < C; j++) o[j] = gr[j] - dt_exp_S(l[j]) * s;
    }
}

static inline T dt_rstd_S(const T *a, int64_t C, T mean, T eps) {
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= C; j += 8)
        for (int k = 0; k < 8; k++) { T d = a[j + k] - mean; acc[k] += d * d; }
    T s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < C; j++) { T d = a[j] - mean; s += d * d; }
    return 1.0F / dt_sqrt_S(s / (T)C + eps);
}

void normalize_S(const T *x, T *out, int64_t r0, int64_t r1, int64_t C, double eps) {
    for (int64_t r = r0; r < r1; r++) {
        const T *a = x + r * C;
        T *o = out + r * C;
        T mean = dt_sum_S(a, C) / (T)C;
        T rstd = dt_rstd_S(a, C, mean, (T)eps);
        for (int64_t j = 0; j < C; j++) o[j] = (a[j] - mean) * rstd;
    }
}

/* dx of layer-norm's core from the gradient gr of its output. */
static inline void dt_normalize_backward_row_S(const T *gr, const T *a, T *o, int64_t C,
                                               double eps) {
    T mean = dt_sum_S(a, C) / (T)C;
    T rstd = dt_rstd_S(a, C, mean, (T)eps);
    T gm = dt_sum_S(gr, C) / (T)C;
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= C; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += gr[j + k] * ((a[j + k] - mean) * rstd);
    T gx = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < C; j++) gx += gr[j] * ((a[j] - mean) * rstd);
    gx /= (T)C;
    for (int64_t j = 0; j < C; j++)
        o[j] = ((gr[j] - gm) - ((a[j] - mean) * rstd) * gx) * rstd;
}

void normalize_backward_S(const T *g, const T *x, T *out, int64_t r0, int64_t r1, int64_t C,
                          double eps) {
    for (int64_t r = r0; r < r1; r++)
        dt_normalize_backward_row_S(g + r * C, x + r * C, out + r * C, C, eps);
}

/* The same with the output's gradient g * w (a LayerNorm's weight along the row), the
   product made a row at a time on the stack (C <= _WEIGHTED_ROW_MAX) instead of as a tensor of
   its own. */
void normalize_backward_w_S(const T *g, const T *w, const T *x, T *out, int64_t r0, int64_t r1,
                            int64_t C, double eps) {
    T gw[C];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t j = 0; j < C; j++) gw[j] = g[r * C + j] * w[j];
        dt_normalize_backward_row_S(gw, x + r * C, out + r * C, C, eps);
    }
}

/* softmax cross-entropy: out[r] = logsumexp(x[r]) - x[r, t[r]]; the backward
   g[r] * (softmax(x[r]) - onehot(t[r])). */
void cross_entropy_S(const T *x, const int64_t *t, T *out, int64_t r0, int64_t r1, int64_t C,
                     T *scratch) {
    for (int64_t r = r0; r < r1; r++) {
        const T *a = x + r * C;
        T m = dt_max_S(a, C);
        for (int64_t j = 0; j < C; j++) scratch[j] = dt_exp_S(a[j] - m);
        out[r] = (dt_log_S(dt_sum_S(scratch, C)) + m) - a[t[r]];
    }
}

void cross_entropy_backward_S(const T *g, const T *x, const int64_t *t, T *out, int64_t r0,
                              int64_t r1, int64_t C) {
    for (int64_t r = r0; r < r1; r++) {
        const T *a = x + r * C;
        T *o = out + r * C;
        T m = dt_max_S(a, C);
        for (int64_t j = 0; j < C; j++) o[j] = dt_exp_S(a[j] - m);
        T k = g[r] / dt_sum_S(o, C);
        for (int64_t j = 0; j < C; j++) o[j] *= k;
        o[t[r]] -= g[r];
    }
}

/* index_add (an embedding's gradient): row i of g (n rows of C) added into row idx[i] - off
   of zeros (rows, C) when that row lies in [0, rows) (a vocab-parallel shard holds rows
   off..off+rows), in order of i (numpy's reduceat associates a row's terms pairwise: the
   sums agree to rounding). Threads split the columns [c0, c1). */
void index_add_S(const T *g, const int64_t *idx, T *out, int64_t n, int64_t off, int64_t rows,
                 int64_t C, int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = c0; c < c1; c++) out[r * C + c] = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = idx[i] - off;
        if (r < 0 || r >= rows) continue;
        const T *src = g + i * C;
        T *dst = out + r * C;
        for (int64_t c = c0; c < c1; c++) dst[c] += src[c];
    }
}

/* p, m, v may be po, mo, vo themselves (an update in place): no restrict on those. */
static inline void dt_adamw_rows_S(const T *p, const T *restrict g, const T *m, const T *v,
                                    T *po, T *mo, T *vo, int64_t n, const T *k) {
    T b1 = k[0], c1 = k[1], b2 = k[2], c2 = k[3], eps = k[4], step = k[5], decay = k[6];
    for (int64_t i = 0; i < n; i++) {
        T mi = m[i] * b1 + g[i] * c1;
        T vi = v[i] * b2 + (g[i] * g[i]) * c2;
        T den = dt_sqrt_S(vi) + eps;
        mo[i] = mi;
        vo[i] = vi;
        po[i] = p[i] * decay - (mi / den) * step;
    }
}

/* The AdamW update of parameters q0..q1 (addresses in tab: p, g, m, v of each in turn) into
   the rows of out (3, total); hp: 7 hyperparameters a parameter, numpy_backend's order. The
   constants are rounded to T first, as numpy rounds a Python float against a T array.
   The three results go out with non-temporal stores where the rows line up on 32 bytes: they
   are not read again this step, and a plain store first reads each line of out from memory
   (measured, the standard workload's 5.28M float parameters on one thread: 15-18 -> 12-13
   ms). */
void adamw_group_S(const int64_t *tab, const int64_t *sizes, const int64_t *offsets,
                   const double *hp, T *out, int64_t total, int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; q++) {
        const T *p = (const T *)tab[4 * q], *g = (const T *)tab[4 * q + 1];
        const T *m = (const T *)tab[4 * q + 2], *v = (const T *)tab[4 * q + 3];
        const double *h = hp + 7 * q;  /* lr, beta1, beta2, eps, weight_decay, bc1, bc2 */
        /* numpy's _adamw_block: the bias corrections folded into eps and the step size */
        const T k[7] = {(T)h[1], (T)(1.0 - h[1]), (T)h[2], (T)(1.0 - h[2]),
                        (T)(h[3] * (sqrt)(h[6])), (T)(h[0] * (sqrt)(h[6]) / h[5]),
                        (T)(1.0 - h[0] * h[4])};
        T *po = out + offsets[q], *mo = po + total, *vo = po + 2 * total;
        int64_t i = 0, n = sizes[q];
#ifdef __AVX__
        i = (int64_t)(((32 - ((uintptr_t)po & 31)) & 31) / sizeof(T));  /* to an aligned po */
        i = i < n ? i : n;
        dt_adamw_rows_S(p, g, m, v, po, mo, vo, i, k);
        if ((((uintptr_t)(po + i) | (uintptr_t)(mo + i) | (uintptr_t)(vo + i)) & 31) == 0) {
            enum { L = 32 / sizeof(T) };
            for (; i + 64 <= n; i += 64) {  /* 64 results to the stack, then streamed out */
                T r[3][64];
                dt_adamw_rows_S(p + i, g + i, m + i, v + i, r[0], r[1], r[2], 64, k);
                for (int j = 0; j < 64; j += L) {
                    DT_STREAM_S(po + i + j, r[0] + j);
                    DT_STREAM_S(mo + i + j, r[1] + j);
                    DT_STREAM_S(vo + i + j, r[2] + j);
                }
            }
            _mm_sfence();  /* the streamed lines are visible before the caller reads out */
        }
#endif
        dt_adamw_rows_S(p + i, g + i, m + i, v + i, po + i, mo + i, vo + i, n - i, k);
    }
}
"""

_TYPE_DEFS = {"float": ("f32", "1", "1e-4f"), "double": ("f64", "0", "1e-6")}


def _helpers(ctype: str) -> str:
    """_HELPERS for one floating type: T the type, _S( the name suffix, a literal's F suffix
    (float literals stay float: numpy rounds a Python float to the array's type)."""
    suffix, is_float, near = _TYPE_DEFS[ctype]
    text = re.sub(r"\bT\b", ctype, _HELPERS).replace("_S(", f"_{suffix}(")
    text = text.replace("IS_FLOAT", is_float).replace("NEAR_ZERO", near)
    return re.sub(r"(\d)F\b", r"\1f" if ctype == "float" else r"\1", text)


PRELUDE = ("#include <math.h>\n#include <stdint.h>\n#ifdef __AVX__\n#include <immintrin.h>\n"
           "#define DT_STREAM_f32(dst, src) _mm256_stream_ps((dst), _mm256_loadu_ps(src))\n"
           "#define DT_STREAM_f64(dst, src) _mm256_stream_pd((dst), _mm256_loadu_pd(src))\n"
           "#endif\n\n" + _helpers("float") + _helpers("double")
           + r"""
/* Names the ops' ``lower`` templates use (dtensor/ops/*.py), by argument type. */
#define DT_GENERIC(name, x) _Generic((x), float: dt_##name##_f32, default: dt_##name##_f64)
#define exp(x) DT_GENERIC(exp, x)(x)
#define log(x) DT_GENERIC(log, x)(x)
#define sqrt(x) DT_GENERIC(sqrt, x)(x)
#define tanh(x) DT_GENERIC(tanh, x)(x)
#define erf(x) DT_GENERIC(erf, x)(x)
#define pow(x, y) DT_GENERIC(pow, x)(x, y)
#define cos(x) DT_GENERIC(cos, x)(x)
#define sin(x) DT_GENERIC(sin, x)(x)
#define abs(x) DT_GENERIC(abs, x)(x)
#define rsqrt(x) DT_GENERIC(rsqrt, x)(x)
#define sigmoid(x) DT_GENERIC(sigmoid, x)(x)
#define clamp(x, lo, hi) DT_GENERIC(clamp, x)(x, lo, hi)
#define gelu_none(x) DT_GENERIC(gelu_none, x)(x)
#define gelu_tanh(x) DT_GENERIC(gelu_tanh, x)(x)
#define gelu_none_grad(g, x, y) DT_GENERIC(gelu_none_grad, x)(g, x, y)
#define gelu_tanh_grad(g, x, y) DT_GENERIC(gelu_tanh_grad, x)(g, x, y)
#define where(c, x, y) ((c) ? (x) : (y))
#define maximum(x, y) ((x) != (x) || (x) > (y) ? (x) : (y))
""")


class CompilerNotFound(RuntimeError):
    """backend='c' found no C compiler to run (none on PATH, or $CC does not run)."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CompilerNotFound(
            "dtensor.compile(backend='c') needs a C compiler: none on PATH (cc, gcc) and $CC is "
            "unset. Install one (Debian: apt-get install gcc) or use backend='numpy'.")
    return cc


def _cpu() -> str:
    """What -march=native depends on: a library built here must not load on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _library_stem(source: str, cc: str) -> str:
    """Cache path (no suffix) of ``source``'s library: named by the hash of the source,
    compiler, flags and CPU."""
    key = "\n".join([source, cc, " ".join(FLAGS), _cpu(), platform.machine()])
    return os.path.join(cache.cache_dir(), f"dtc_c_{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def build(source: str) -> ctypes.CDLL:
    """Compile ``source`` to a shared library in the compile cache unless it is there, and
    load it. A cached library is loaded only if its bytes match the SHA-256 kept beside it
    (``.so.sha256``, written after the library): a truncated, corrupt or foreign one is
    rebuilt."""
    cc = _compiler()
    path = _library_stem(source, cc)
    lib = path + ".so"
    loaded = _LOADED.get(lib)
    if loaded is not None:
        return loaded
    opened = _open_checked(lib)
    if opened is None:
        # Every file this process writes is its own until renamed into place (atomically):
        # ranks building the same library at once never read each other's half-written files.
        # All compile the one path.c (the same bytes, replaced atomically): the library
        # records its source's file name, so builders' libraries, and digests, are identical.
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            cache.write_atomic(tmp + ".c", source.encode())
            os.replace(tmp + ".c", path + ".c")  # kept for the error's line numbers too
            try:
                done = subprocess.run([cc, *FLAGS, "-o", tmp + ".so", path + ".c", "-lm"],
                                      capture_output=True, text=True)
            except OSError as e:
                raise CompilerNotFound(f"dtensor.compile(backend='c'): cannot run the C "
                                       f"compiler {cc!r} ({e}); set $CC to one, or use "
                                       f"backend='numpy'.")
            if done.returncode:
                raise RuntimeError(f"dtensor.compile(backend='c'): {cc} failed on {path}.c:\n"
                                   f"{done.stderr[-4000:]}")
            with open(tmp + ".so", "rb") as f:
                digest = _digest(f.read())
            os.replace(tmp + ".so", lib)
            cache.write_atomic(lib + ".sha256", digest)
        finally:
            for leftover in (tmp + ".c", tmp + ".so"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        opened = _open_checked(lib)
        if opened is None:
            raise cache.CacheDirError(f"dtensor.compile(backend='c'): the library just built "
                                      f"at {lib} changed before it could be loaded; check who "
                                      f"else writes to {os.path.dirname(lib)}.")
    # Loaded through the descriptor the bytes were checked from: a name swapped after the
    # check cannot change what runs. The descriptor stays open for the process's life, as the
    # library does: dlopen knows a library by the name it was given, and a closed descriptor's
    # number (hence /proc/self/fd/N) would be reused for the next one.
    proc = f"/proc/self/fd/{opened}"
    if os.path.exists(proc):
        _LOADED[lib] = ctypes.CDLL(proc)
    else:  # no /proc (not Linux): by name, right after the check
        os.close(opened)
        _LOADED[lib] = ctypes.CDLL(lib)
    return _LOADED[lib]


_LOADED: dict[str, ctypes.CDLL] = {}


def _open_checked(lib: str) -> int | None:
    """A descriptor on ``lib`` if it is a private regular file whose bytes match the SHA-256
    kept beside it, else None (closed)."""
    so = cache.open_private(lib)
    if so is None:
        return None
    fd, data = so
    digest = cache.open_private(lib + ".sha256")
    if digest is not None:
        os.close(digest[0])
    if digest is None or digest[1] != _digest(data):
        os.close(fd)
        return None
    return fd


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest().encode()


# ----------------------------------------------------------------------------- threads


def num_threads() -> int:
    """Threads a kernel's rows are split over: DTENSOR_NUM_THREADS, else the BLAS / OpenMP
    thread count the environment sets (dtlaunch sets it to cores / local ranks), else the
    cores this process may use."""
    for var in ("DTENSOR_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Splitting pays once a kernel runs for well over the ~0.1 ms it takes to wake a waiting
# thread, longer right after a GEMM, whose BLAS workers still spin on the other cores. Measured
# in the standard step at 1 rank on 2 cores: the 1 MB adds, multiplies and layer norms (~0.8M
# elements touched) ran 1.5-1.7x faster unsplit (the step's 5 ms); GELU (2M) still gains.
_SPLIT_ELEMENTS = 1 << 20


class _Pool:
    """Workers for a kernel's row ranges; the caller runs the first range itself. Each call
    brings its own completion queue, so callers on several threads at once each wait for
    exactly their own ranges."""

    def __init__(self, n: int):
        self.inbox = [queue.SimpleQueue() for _ in range(n - 1)]
        for i, q in enumerate(self.inbox):
            threading.Thread(target=self._work, args=(q,), daemon=True,
                             name=f"dtensor-c-{i}").start()

    @staticmethod
    def _work(inbox) -> None:
        while True:
            fn, args, done = inbox.get()
            try:
                fn(*args)
                done.put(None)
            except BaseException as e:  # re-raised by the caller
                done.put(e)

    def run(self, fn, calls: list) -> None:
        """fn(*args) for every args in ``calls``, at once."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        for q, args in zip(self.inbox, calls[1:]):
            q.put((fn, args, done))
        error = None
        try:
            fn(*calls[0])
        finally:  # always collect the workers: they write into the caller's arrays
            for _ in calls[1:]:
                error = done.get() or error
        if error is not None:
            raise error


_pools: dict = {}
_pools_lock = threading.Lock()
# A forked child has none of the parent's threads: it starts its own pools.
os.register_at_fork(after_in_child=_pools.clear)


def _parallel(fn, calls: list) -> None:
    if len(calls) == 1:
        fn(*calls[0])
        return
    with _pools_lock:
        pool = _pools.get(len(calls))
        if pool is None:
            pool = _pools[len(calls)] = _Pool(len(calls))
    pool.run(fn, calls)


def _cuts(rows: int, work: int) -> list:
    """Row ranges, one a thread, when ``work`` (elements touched) is worth splitting."""
    n = min(num_threads(), rows) if work >= _SPLIT_ELEMENTS else 1
    cuts = [rows * k // n for k in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _run_rows(fn, head: tuple, rows: int, work: int, tail: tuple = ()) -> None:
    """fn(*head, r0, r1, *tail) over rows [0, rows), split over threads if worth it."""
    _parallel(fn, [head + r + tail for r in _cuts(rows, work)])


# ----------------------------------------------------------------------------- kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _c_literal(v, single: bool) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return f"{int(v)}"
    v = float(v)
    if not np.isfinite(v):
        return "NAN" if np.isnan(v) else ("INFINITY" if v > 0 else "(-INFINITY)")
    return repr(v) + ("f" if single else "")


class _Pointwise:
    """A fused pointwise group (or one pointwise op): rows of the output's last dim, each input
    read through its broadcast strides (a bias: the same row; a (..., 1) column: one value)."""

    accepts_out = True

    def __init__(self, name: str, ops, shape, dtype, in_shapes, in_dtypes, label: str,
                 positions):
        self.name, self.shape, self.dtype = name, tuple(shape), np.dtype(dtype)
        self.positions = positions  # which call arguments are arrays (the rest: constants)
        self.C = self.shape[-1] if self.shape else 1
        self.R = int(np.prod(self.shape[:-1])) if self.shape else 1
        lead = self.shape[:-1]
        ctype = _CTYPE[self.dtype]
        single = self.dtype == np.float32
        params = [f"const {_CTYPE[np.dtype(dt)]} *restrict in{k}" for k, dt in
                  enumerate(in_dtypes)]
        lines = [f"/* {label} */",
                 f"void {name}({', '.join(params + [f'{ctype} *restrict out'])}, "
                 "int64_t r0, int64_t r1) {",
                 "    for (int64_t r = r0; r < r1; r++) {"]
        loads = []
        for k, (s, dt) in enumerate(zip(in_shapes, in_dtypes)):
            st = [x // np.dtype(dt).itemsize for x in
                  np.broadcast_to(np.empty(s, dt), self.shape).strides] if self.shape else []
            row, inner = [], 1
            for d in reversed(range(len(lead))):
                if st[d]:
                    row.append(f"((r / {inner}) % {lead[d]}) * {st[d]}")
                inner *= lead[d]
            lines.append(f"        const {_CTYPE[np.dtype(dt)]} *p{k} = in{k} + "
                         f"({' + '.join(row) or '0'});")
            col = st[-1] if st else 0
            loads.append(f"p{k}[c * {col}]" if col else f"p{k}[0]")
        lines += [f"        {ctype} *o = out + r * {self.C};",
                  f"        for (int64_t c = 0; c < {self.C}; c++) {{"]
        lines += [f"            {_CTYPE[np.dtype(dt)]} a{k} = {ld};"
                  for k, (ld, dt) in enumerate(zip(loads, in_dtypes))]
        for j, (op_name, op, refs, p) in enumerate(ops):
            args = [f"a{r}" if kind == "in" else f"t{r}" if kind == "op" else
                    _c_literal(r, single) for kind, r in refs]
            expr = ("(!" + args[0] + ")" if op_name == "logical_not" else
                    op.lower.format(*args, **p))
            lines.append(f"            __auto_type t{j} = {expr};")
        lines += [f"            o[c] = ({ctype})(t{len(ops) - 1});", "        }", "    }", "}"]
        self.source = "\n".join(lines) + "\n"
        self.argtypes = [_P] * (len(in_shapes) + 1) + [_I, _I]

    def __call__(self, *inputs, out=None):
        # (a 0-d value, e.g. a full reduction's, arrives as a numpy scalar)
        arrays = [np.ascontiguousarray(inputs[k]) for k in self.positions]
        out = np.empty(self.shape, self.dtype) if out is None else out
        _run_rows(self.fn, tuple(_ptr(a) for a in arrays) + (_ptr(out),), self.R,
                  self.R * self.C * (len(arrays) + 1))
        return out


class _Rowwise:
    """softmax / log_softmax / normalize and their backwards: whole rows of the last dim."""

    accepts_out = True

    def __init__(self, name: str, params: dict, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.name = f"{name}_{_TYPE_DEFS[_CTYPE[self.dtype]][0]}"
        self.C = self.shape[-1]
        self.R = int(np.prod(self.shape[:-1]))
        self.source = ""
        self.weighted = name == "normalize_backward_w"
        n_in = 3 if self.weighted else 2 if name.endswith("_backward") else 1
        if name == "softmax":
            L = self.shape[-2] if len(self.shape) > 1 else 1
            self.tail = (self.C, L, int(bool(params.get("causal", False))))
            self.argtypes = [_P] * 2 + [_I] * 4 + [ctypes.c_int]
        elif name.startswith("normalize"):
            self.tail = (self.C, float(params["eps"]))
            self.argtypes = [_P] * (n_in + 1) + [_I] * 3 + [ctypes.c_double]
        else:
            self.tail = (self.C,)
            self.argtypes = [_P] * (n_in + 1) + [_I] * 3

    def __call__(self, *inputs, out=None):
        if self.weighted:  # (g, w, x): w one row of C
            g, w, x = inputs
            arrays = [np.ascontiguousarray(np.broadcast_to(g, self.shape)),
                      np.ascontiguousarray(np.reshape(w, -1)), np.ascontiguousarray(x)]
        else:
            arrays = [np.ascontiguousarray(np.broadcast_to(x, self.shape)) for x in inputs]
        out = np.empty(self.shape, self.dtype) if out is None else out
        if self.R and self.C:
            _run_rows(self.fn, tuple(_ptr(a) for a in arrays) + (_ptr(out),), self.R,
                      self.R * self.C * (len(arrays) + 1), self.tail)
        return out


class _CrossEntropy:
    """softmax_cross_entropy (x, target) and its backward (g, x, target)."""

    accepts_out = True

    def __init__(self, name: str, shape, dtype, classes: int):
        self.backward = name.endswith("_backward")
        self.shape, self.dtype, self.C = tuple(shape), np.dtype(dtype), classes
        suffix = _TYPE_DEFS[_CTYPE[self.dtype]][0]
        self.name = f"cross_entropy{'_backward' if self.backward else ''}_{suffix}"
        self.source = ""
        self.argtypes = ([_P] * 4 + [_I] * 3 if self.backward else
                         [_P] * 3 + [_I] * 3 + [_P])

    def __call__(self, *inputs, out=None):
        g, x, t = inputs if self.backward else (None, *inputs)
        xs, ts = logit_rows(x, t)  # raises for a target outside [0, classes)
        ts = np.ascontiguousarray(ts, dtype=np.int64)
        R = xs.shape[0]
        out = np.empty(self.shape, self.dtype) if out is None else out
        if not (R and self.C):
            return out
        if self.backward:
            gs = np.ascontiguousarray(np.broadcast_to(g, np.shape(t)).reshape(-1),
                                      dtype=self.dtype)
            _run_rows(self.fn, (_ptr(gs), _ptr(xs), _ptr(ts), _ptr(out)), R, 2 * R * self.C,
                      (self.C,))
        else:  # a row of scratch per thread for the exponentials
            ranges = _cuts(R, R * self.C)
            scratch = np.empty((len(ranges), self.C), self.dtype)
            _parallel(self.fn, [(_ptr(xs), _ptr(ts), _ptr(out), lo, hi, self.C, _ptr(s))
                                for (lo, hi), s in zip(ranges, scratch)])
        return out


class _IndexAdd:
    """index_add, the gradient of an embedding lookup: the whole op, or a vocab-parallel rank's
    block of it (rows ``off`` .. ``off + rows`` of the weight; other indices add nothing)."""

    accepts_out = True

    def __init__(self, shape, dtype, off: int, total_rows: int):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.rows, self.C = self.shape[0], math.prod(self.shape[1:])
        self.off, self.total_rows = off, total_rows
        self.name = f"index_add_{_TYPE_DEFS[_CTYPE[self.dtype]][0]}"
        self.source = ""
        self.argtypes = [_P] * 3 + [_I] * 6

    def __call__(self, g, idx, like, out=None):
        from dtensor.ops.structural import check_rows
        flat = np.ascontiguousarray(check_rows(idx, self.total_rows), dtype=np.int64)
        g = np.ascontiguousarray(g, dtype=self.dtype)
        out = np.empty(self.shape, self.dtype) if out is None else out
        n = min(num_threads(), -(-self.C // 8)) if flat.size * self.C >= _SPLIT_ELEMENTS else 1
        cuts = [self.C * k // n // 8 * 8 for k in range(n)] + [self.C]  # whole vectors
        head = (_ptr(g), _ptr(flat), _ptr(out), flat.size, self.off, self.rows, self.C)
        _parallel(self.fn, [head + (a, b) for a, b in zip(cuts[:-1], cuts[1:])])
        return out


class _AdamWGroup:
    """adamw_group (compile/passes/fusion.py): every parameter's update in one call, the
    parameters split over threads by size."""

    accepts_out = True

    def __init__(self, sizes, dtype):
        self.sizes = np.array(sizes, np.int64)
        self.total = int(self.sizes.sum())
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.dtype = np.dtype(dtype)
        self.name = f"adamw_group_{_TYPE_DEFS[_CTYPE[self.dtype]][0]}"
        self.source = ""
        self.argtypes = [_P] * 5 + [_I] * 3
        n = num_threads() if self.total >= _SPLIT_ELEMENTS else 1
        cum = np.cumsum(self.sizes)  # cut where the running size passes k / n of the total
        cuts = [0] + [int(np.searchsorted(cum, self.total * k / n)) + 1 for k in range(1, n)]
        cuts = sorted(set(min(c, len(self.sizes)) for c in cuts + [len(self.sizes)]))
        self.ranges = list(zip(cuts[:-1], cuts[1:]))

    def __call__(self, *arrays, each=(), out=None, in_place=False, **hp):
        from dtensor.compile.numpy_backend import adamw_table, update_target
        arrays = [np.ascontiguousarray(a) for a in arrays]  # kept alive through the call
        tab = np.array([_ptr(a) for a in arrays], np.int64)
        hps = adamw_table(hp, len(self.sizes), np.float64)
        out = update_target(arrays, self.sizes, in_place) if out is None else out
        head = (_ptr(tab), _ptr(self.sizes), _ptr(self.offsets), _ptr(hps), _ptr(out),
                self.total)
        _parallel(self.fn, [head + r for r in self.ranges])
        return out


_ROW_OPS = ("softmax", "softmax_backward", "log_softmax", "log_softmax_backward", "normalize",
            "normalize_backward")


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _pointwise_ok(ops, in_dtypes, dtype) -> bool:
    """Groups of one floating dtype in which a boolean (an input or a comparison's result) is
    only ever a where() condition: C computes on a comparison's int where numpy has bool
    arithmetic (True + True is True) and its own promotions, so anything else stays numpy."""
    if dtype not in (np.float32, np.float64) or any(
            name in ("cast", "rand", "randn", "logical_not") for name, *_ in ops) or any(
            dt not in (dtype, np.bool_) for dt in in_dtypes):
        return False
    boolean = {("in", k) for k, dt in enumerate(in_dtypes) if dt == np.bool_}
    boolean |= {("op", j) for j, (name, *_) in enumerate(ops) if name in _COMPARISONS}
    for name, _, refs, _ in ops:
        for pos, ref in enumerate(refs):
            if ref in boolean and not (name == "where" and pos == 0):
                return False
    return True


def _index_add_for(n: Node):
    """The whole index_add op, or its local kernel on this rank's rows of the result."""
    if n.variant == "impl":
        return _IndexAdd(n.shape, n.dtype, 0, n.shape[0]), {}
    out = n.blocks[1]
    return _IndexAdd(n.shape, n.dtype, out.rows(0)[0], out.shape[0]), {}


def _kernel_for(n: Node, name: str):
    """A C kernel for node ``n`` and the params it is then called with, or None."""
    from dtensor.compile.passes.fusion import as_group, pointwise_op
    arrays = [a for a in n.inputs if isinstance(a, (Node, np.ndarray))]
    if n.dtype not in (np.float32, np.float64) or not n.shape:
        return None
    if n.name == "fused" or pointwise_op(n) is not None:
        ops, arrays, positions = as_group(n)
        dtypes = [np.dtype(a.dtype) for a in arrays]
        if not _pointwise_ok(ops, dtypes, n.dtype):  # (random draws included: numpy's)
            return None
        return _Pointwise(name, ops, n.shape, n.dtype, [a.shape for a in arrays], dtypes,
                          f"{n.name} {n.note}".strip(), positions), {}
    if n.name == "adamw_group":
        if all(a.dtype == n.dtype for a in arrays):
            return _AdamWGroup(n.params["sizes"], n.dtype), {
                k: v for k, v in n.params.items() if k != "sizes"}
        return None
    if n.name == "index_add" and arrays[0].dtype == n.dtype and arrays[1].dtype.kind in "iu":
        return _index_add_for(n)
    if n.name not in OPS or n.variant != "impl":
        return None
    if n.name in _ROW_OPS and all(a.dtype == n.dtype for a in arrays):
        return _Rowwise(n.name, n.params, n.shape, n.dtype), {}
    if n.name in ("softmax_cross_entropy", "softmax_cross_entropy_backward"):
        x = n.inputs[1] if n.name.endswith("_backward") else n.inputs[0]  # (g, x, t) / (x, t)
        if x.dtype != n.dtype:
            return None
        return _CrossEntropy(n.name, n.shape, n.dtype, x.shape[-1]), {}
    return None


_WEIGHTED_ROW_MAX = 8192  # normalize_backward_w's row of g * w lives on the stack


def _weighted_gradient(n: Node, users: dict, outputs: set):
    """(g, w) when a normalize_backward's gradient is only ever g * w with w one row of C (a
    LayerNorm weight's gradient path), else None."""
    from dtensor.compile.passes.fusion import pointwise_op
    m = n.inputs[0] if (n.name == "normalize_backward" and n.variant == "impl"
                        and n.dtype in (np.float32, np.float64)
                        and n.inputs[1].dtype == n.dtype) else None
    if not (isinstance(m, Node) and m.name == "mul" and pointwise_op(m) is not None
            and len(users.get(m.id, ())) == 1 and m.id not in outputs
            and n.shape and n.shape[-1] <= _WEIGHTED_ROW_MAX):
        return None
    def shape(a):
        return tuple(a.shape) if isinstance(a, (Node, np.ndarray)) else None

    for g, w in (m.inputs, m.inputs[::-1]):
        if (shape(g) == tuple(n.shape) and shape(w) is not None and shape(w)[-1:] == n.shape[-1:]
                and math.prod(shape(w)) == n.shape[-1] and g.dtype == w.dtype == n.dtype):
            return g, w
    return None


def lower_graph(graph: Graph) -> list:
    """Give every node a C kernel can run its kernel (``node.fn``, with the params it is called
    with), all of the graph's kernels built as one library; returns [(node, kernel)]."""
    users, outputs = graph.users(), {o.id for o in graph.outputs if isinstance(o, Node)}
    weighted = {n.id: gw for n in graph.nodes
                if (gw := _weighted_gradient(n, users, outputs)) is not None}
    absorbed = {n.inputs[0].id for n in graph.nodes if n.id in weighted}  # their g * w
    found = []
    for n in graph.nodes:
        if n.id in weighted:
            n.inputs = [*weighted[n.id], n.inputs[1]]
            k = _Rowwise("normalize_backward_w", n.params, n.shape, n.dtype), {}
        else:
            k = None if n.id in absorbed else _kernel_for(n, f"k{n.id}")
        if k is not None:
            found.append((n, *k))
    graph.nodes = [n for n in graph.nodes if n.id not in absorbed]
    if not found:
        return []
    lib = build(PRELUDE + "\n" + "".join(k.source for _, k, _ in found))
    for n, kernel, params in found:
        kernel.fn = getattr(lib, kernel.name)
        kernel.fn.argtypes = kernel.argtypes
        kernel.fn.restype = None
        kernel.lib = lib  # keeps the library loaded as long as the kernel lives
        n.fn, n.params, n.kind = kernel, params, "c"
    return [(n, k) for n, k, _ in found]
