"""The C backend: the CPU counterpart of the Triton backend, as TorchInductor's C++ backend is
the CPU counterpart of its Triton one.

Every kernel of compile/kernels.py (fused pointwise groups, row groups, the row-wise ops:
softmax, layer-norm, cross-entropy and their backwards, random draws) is rendered as a C
function from its expression, and so are the AdamW group update and index_add; one graph's
functions are one C file, compiled once with the system C compiler (``$CC``, else ``cc``) into
a shared library named by the hash of its source and flags, and called through ctypes. A
kernel streams each row once per level of its row reductions: the temporaries numpy
materialises between ufuncs stay in registers, reductions run in 8 lanes, and the loops are
SIMD-vectorised (``-O3 -march=native``; exp is a polynomial the compiler can vectorise, since
libm's is a scalar call). ctypes releases the GIL, so a large kernel's rows are split over the
threads of :func:`num_threads` and run in parallel.

Results match numpy's to float rounding, not bit for bit: the same formulas in the same order
(``-ffp-contract=off``: no fused multiply-adds numpy would not do), but exp, log and the
reductions' summation order differ in the last bits. The attention kernels' products are the
exception: their register tiles multiply-add with one rounding where the CPU has FMA, as BLAS's
GEMMs in the math path do. Matmuls, collectives, gathers and anything not listed stay numpy
calls.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import queue
import re
import shutil
import subprocess
import threading

import numpy as np
from dtensor.compile import cache, kernels

from dtensor.graph import Graph, Node
from dtensor.ops import expr as X

__all__ = ["lower_graph", "num_threads", "CompilerNotFound"]

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-fPIC", "-shared")

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
          np.dtype(np.bool_): "uint8_t", np.dtype(np.int64): "int64_t"}
_SUFFIX = {"float": "f32", "double": "f64"}

# Float exp is Cephes' expf (< 2 ulp) written with selects so that loops calling it vectorise.
# Draws are dtensor/random.py's Philox4x32-10 and its conversions (rand bit for bit).
_COMMON = r"""#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#define DT_STREAM_f32(dst, src) _mm256_stream_ps((dst), _mm256_loadu_ps(src))
#define DT_STREAM_f64(dst, src) _mm256_stream_pd((dst), _mm256_loadu_pd(src))
#endif

/* 32-byte vectors for the attention kernels' register tiles (AVX, or pairs of SSE registers),
   multiply-added with one rounding where the machine has FMA. */
typedef float float_vec __attribute__((vector_size(32)));
typedef double double_vec __attribute__((vector_size(32)));
#define VEC(t) t##_vec
#define DT_W(t) ((int64_t)(32 / sizeof(t)))  /* lanes */
/* Attention's query rows per block: a block's products hold 2 accumulators a row, so 8 rows
   where the CPU has 32 vector registers (AVX-512) and 4 where it has 16. The order of every
   sum is the same either way. Min of 200 calls, one thread, AMD EPYC (Zen 4), forward and
   backward ms, 4 -> 8 rows: 32 heads x 128 x 32: 0.94 -> 0.73 and 1.74 -> 1.44; 24 x 256 x 64:
   5.6 -> 4.0 and 11.8 -> 8.1 (an AVX2 build there: 8 rows 4-7% slower than 4). */
#ifdef __AVX512VL__
#define DT_R 8
#else
#define DT_R 4
#endif

static inline float_vec dt_vfma_f32(float_vec a, float_vec b, float_vec c) {
#ifdef __FMA__
    return (float_vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline double_vec dt_vfma_f64(double_vec a, double_vec b, double_vec c) {
#ifdef __FMA__
    return (double_vec)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    return a * b + c;
#endif
}

/* (not 0 + x: without -ffast-math the compiler must keep that addition, for -0) */
static inline float_vec dt_vset_f32(float x) { return (float_vec){x, x, x, x, x, x, x, x}; }
static inline double_vec dt_vset_f64(double x) { return (double_vec){x, x, x, x}; }
static inline float_vec dt_vload_f32(const float *p) { float_vec v; memcpy(&v, p, 32); return v; }
static inline double_vec dt_vload_f64(const double *p) {
    double_vec v; memcpy(&v, p, 32); return v;
}
static inline void dt_vstore_f32(float *p, float_vec v) { memcpy(p, &v, 32); }
static inline void dt_vstore_f64(double *p, double_vec v) { memcpy(p, &v, 32); }

/* to[e ts + j] = a[j as + e] for j, e < 8: an 8 x 8 block transposed in registers (AVX's
   unpack, shuffle and lane-swap network). One element at a time, each row's 8 stores went to
   8 lines ts apart: attention's per-head K^T copy took 15% of the forward kernel. */
static inline void dt_t8_f32(const float *a, int64_t as, float *to, int64_t ts) {
#ifdef __AVX__
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(a + i * as);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(to + i * ts, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(to + (i + 4) * ts, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
#else
    for (int j = 0; j < 8; j++)
        for (int e = 0; e < 8; e++) to[e * ts + j] = a[j * as + e];
#endif
}

static inline void dt_t8_f64(const double *a, int64_t as, double *to, int64_t ts) {
    for (int j = 0; j < 8; j++)
        for (int e = 0; e < 8; e++) to[e * ts + j] = a[j * as + e];
}

/* A row reduction's 8 lanes, one vector: each 8 columns' terms are computed lane by lane
   into an array, then added (or maxed) into the accumulator as one vector operation. GCC 12
   compiled 8-lane arrays accumulated in place into shuffles and scalar adds: at 512-bit width
   always, at 256-bit width when a pass carries two sums. Each kernel compiled on its own, min
   of 100 calls, AMD EPYC (Zen 4), rows of 256: layer-norm backward (two sums a pass) 462 ->
   98 us; normalize 76 -> 70 us, and no longer needs 256-bit vectors to get there. */
typedef float float_8 __attribute__((vector_size(8 * sizeof(float))));
typedef double double_8 __attribute__((vector_size(8 * sizeof(double))));

static inline float dt_exp_upto_f32(float x, float hi) {
    /* Clamped to where the scale's two factors stay normal: past 88.8 the product overflows
       to inf, below -110 it underflows to 0, and a NaN passes through the clamp and the
       arithmetic. ``hi`` INFINITY: x is known <= 0 (a softmax row less its max), and the
       upper clamp goes (GCC 12 builds the clamps from AVX-512 masks, which Zen 4 runs slowly:
       the attention kernels' exps 255 -> 210 us a call). */
    float xc = x < -110.0f ? -110.0f : (x > hi ? hi : x);
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round(x / ln 2) */
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    int32_t ni = (int32_t)n, h = ni >> 1;  /* 2^n as two factors: n may be -159 .. 128 */
    union { int32_t i; float f; } s1, s2;
    s1.i = (h + 127) << 23;
    s2.i = (ni - h + 127) << 23;
    return p * s1.f * s2.f;
}

static inline float dt_exp_f32(float x) { return dt_exp_upto_f32(x, 88.8f); }
static inline double dt_exp_f64(double x) { return exp(x); }
static inline double dt_exp_upto_f64(double x, double hi) { return exp(x); }

static inline void dt_philox(uint64_t key, int64_t off, uint32_t c[4]) {
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    c[0] = (uint32_t)off; c[1] = (uint32_t)(off >> 32); c[2] = 0; c[3] = 0;
    for (int i = 0; i < 10; i++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        c[0] = (uint32_t)(p1 >> 32) ^ c[1] ^ k0; c[1] = (uint32_t)p1;
        c[2] = (uint32_t)(p0 >> 32) ^ c[3] ^ k1; c[3] = (uint32_t)p0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
}

static inline float dt_uniform(uint32_t x) {
    int32_t i = (int32_t)x;
    return (float)(i < 0 ? ~i : i) * 4.6566127342e-10f;
}

static inline float dt_rand(uint64_t key, int64_t off) {
    uint32_t c[4];
    dt_philox(key, off, c);
    return dt_uniform(c[0]);
}

static inline float dt_randn(uint64_t key, int64_t off) {  /* Box-Muller, as random.randn */
    uint32_t c[4];
    dt_philox(key, off, c);
    float u1 = dt_uniform(c[0]), u2 = dt_uniform(c[1]);
    u1 = u1 > 1.0e-7f ? u1 : 1.0e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
}
"""

# index_add and the AdamW group for one floating type: T is the type, _S the name suffix; the
# update's arithmetic is the adamw_step op's expression, rendered into ADAMW_BODY.
_TYPED = r"""
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

/* Causal (or full) attention over heads h0..h1 of (L, E) blocks, as FlashAttention does on a
   CPU: DT_R query rows at a time, whose scores (DT_R rows of at most L) stay in L1 and never make
   an (L, L) matrix; a causal block reads only the keys up to its last row. The products are
   register-tiled: dt_rows_product (scores = rows x K^T, and rows of p x V) and
   dt_rows_scatter (K's and V's gradients += p^T x rows), each holding DT_R x 2 vectors of
   accumulators. One head's K and V sit transposed (E rows of Lp) or padded (rows of Ep), Lp
   and Ep whole pairs of vectors, zero past L and E, so no loop has a tail.
   Every tensor is read and written where it lies: head h of tensor t starts at off[t H + h]
   and its rows are rs[t] apart (the (B, T, heads, E) projections need no transposing copy). */

/* o[r][c] = sum_{k<K} a[r as + k] b[k bs + c] for the DT_R rows of a and c < C, a whole number
   of vector pairs (rows of o os apart): the scores (a = q's rows, b = K^T) and the products of
   p with V or of ds with K (a = p's rows, b = V), 2 vectors of accumulators a row in registers. */
static inline void dt_rows_product_S(const T *a, int64_t as, const T *b, int64_t bs, T *o,
                                     int64_t os, int64_t K, int64_t C) {
    const int64_t W = DT_W(T);
    for (int64_t c = 0; c < C; c += 2 * W) {
        VEC(T) acc[DT_R][2];
        for (int r = 0; r < DT_R; r++) acc[r][0] = acc[r][1] = (VEC(T)){0};
        for (int64_t k = 0; k < K; k++) {
            VEC(T) b0 = dt_vload_S(b + k * bs + c), b1 = dt_vload_S(b + k * bs + c + W);
            for (int r = 0; r < DT_R; r++) {
                VEC(T) x = dt_vset_S(a[r * as + k]);
                acc[r][0] = dt_vfma_S(b0, x, acc[r][0]);
                acc[r][1] = dt_vfma_S(b1, x, acc[r][1]);
            }
        }
        for (int r = 0; r < DT_R; r++) {
            dt_vstore_S(o + r * os + c, acc[r][0]);
            dt_vstore_S(o + r * os + c + W, acc[r][1]);
        }
    }
}

static inline void dt_rows_scatter_S(const T *p, const T *x, T *acc, int64_t n, int64_t Lp,
                                     int64_t Ep) {  /* acc[j][:] += sum_r p[r][j] x[r][:] */
    const int64_t W = DT_W(T);
    for (int64_t c = 0; c < Ep; c += 2 * W) {
        VEC(T) xv[DT_R][2];
        for (int r = 0; r < DT_R; r++) {
            xv[r][0] = dt_vload_S(x + r * Ep + c);
            xv[r][1] = dt_vload_S(x + r * Ep + c + W);
        }
        for (int64_t j = 0; j < n; j++) {
            T *d = acc + j * Ep + c;
            VEC(T) d0 = dt_vload_S(d), d1 = dt_vload_S(d + W);
            for (int r = 0; r < DT_R; r++) {
                VEC(T) y = dt_vset_S(p[r * Lp + j]);
                d0 = dt_vfma_S(xv[r][0], y, d0);
                d1 = dt_vfma_S(xv[r][1], y, d1);
            }
            dt_vstore_S(d, d0);
            dt_vstore_S(d + W, d1);
        }
    }
}

static inline T dt_dot_S(const T *a, const T *b, int64_t n) {  /* in 8 lanes */
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[j + l] * b[j + l];
    sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; j++) sum += a[j] * b[j];
    return sum;
}

static inline void dt_pad_t_S(const T *a, int64_t rs, T *to, int64_t L, int64_t E,
                              int64_t Lp) {  /* L rows of E -> (E, Lp), zero past L */
    const int64_t L8 = L / 8 * 8, E8 = E / 8 * 8;
    for (int64_t j = 0; j < L8; j += 8)  /* 8 rows at a time, each read once */
        for (int64_t e = 0; e < E8; e += 8) dt_t8_S(a + j * rs + e, rs, to + e * Lp + j, Lp);
    for (int64_t j = 0; j < L; j++)  /* what is left: the last E % 8 columns, L % 8 rows */
        for (int64_t e = j < L8 ? E8 : 0; e < E; e++) to[e * Lp + j] = a[j * rs + e];
    for (int64_t e = 0; e < E; e++)
        for (int64_t j = L; j < Lp; j++) to[e * Lp + j] = 0;
}

/* L rows of E, rs apart -> rows of Ep, zero past E; a itself when its rows are that already.
   (Rows a power-of-two stride apart, the heads of a (T, heads, E) projection, fall in a few
   cache sets: read in place they thrashed L1, measured slower than this copy.) */
static inline const T *dt_pad_S(const T *a, int64_t rs, T *to, int64_t L, int64_t E,
                                int64_t Ep) {
    if (E == Ep && rs == Ep) return a;
    for (int64_t j = 0; j < L; j++) {
        memcpy(to + j * Ep, a + j * rs, sizeof(T) * E);
        memset(to + j * Ep + E, 0, sizeof(T) * (Ep - E));
    }
    return to;
}

/* Rows i0.. of a block (nr of them, rs apart; the rest zero): a (scaled) into x (DT_R rows
   of E) and xp (DT_R rows of Ep). Returns the keys the block reads: up to its last row if
   causal. */
static inline int64_t dt_block_rows_S(const T *a, int64_t rs, T *x, T *xp, int64_t i0,
                                      int64_t nr, int64_t L, int64_t E, int64_t Ep, T scale,
                                      int causal) {
    memset(xp, 0, sizeof(T) * DT_R * Ep);
    for (int64_t r = 0; r < DT_R; r++)
        for (int64_t e = 0; e < E; e++)
            x[r * E + e] = xp[r * Ep + e] = r < nr ? a[(i0 + r) * rs + e] * scale : 0;
    return causal ? i0 + nr : L;
}

static inline int64_t dt_keys_S(int64_t i, int64_t n, int causal) {  /* row i's keys */
    return causal && i + 1 < n ? i + 1 : n;
}

/* A block's DT_R rows of scores (ss apart; row r is query i0 + r's) -> exp(s - the row's max)
   over its keys, 0 from there to nv; each row's sum into total. Loops run to nv, whole vectors,
   the keys past a row's at -inf (a scalar tail of up to 15 exps a row cost more); their exp is
   taken of 0 and replaced by 0, since exp(-inf)'s scaling underflows, which the CPU finishes
   slowly (forward -5%, backward -2%, same bits). The rows go side by side, 8 lanes each, so
   their chains of latencies (max, sum) overlap; one row at a time, the rows took half the
   forward kernel's time (side by side: forward -12%, backward -9%, same bits). */
static inline void dt_exp_rows_S(T *s, int64_t ss, int64_t i0, int64_t n, int causal,
                                 int64_t nv, T *total) {
    T mx[DT_R][8], acc[DT_R][8], m[DT_R];
    for (int r = 0; r < DT_R; r++) {
        for (int64_t j = dt_keys_S(i0 + r, n, causal); j < nv; j++) s[r * ss + j] = -INFINITY;
        for (int l = 0; l < 8; l++) mx[r][l] = -INFINITY, acc[r][l] = 0;
    }
    for (int64_t j = 0; j < nv; j += 8)
        for (int r = 0; r < DT_R; r++)
            for (int l = 0; l < 8; l++)
                mx[r][l] = s[r * ss + j + l] > mx[r][l] ? s[r * ss + j + l] : mx[r][l];
    for (int r = 0; r < DT_R; r++) {
        m[r] = -INFINITY;
        for (int l = 0; l < 8; l++) m[r] = mx[r][l] > m[r] ? mx[r][l] : m[r];
    }
    for (int64_t j = 0; j < nv; j += 8)
        for (int r = 0; r < DT_R; r++)
            for (int l = 0; l < 8; l++) {
                T x = s[r * ss + j + l] - m[r];
                T e = x == -INFINITY ? 0 : dt_exp_upto_S(x == -INFINITY ? 0 : x, INFINITY);
                s[r * ss + j + l] = e;
                acc[r][l] += e;
            }
    for (int r = 0; r < DT_R; r++)
        total[r] = ((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]))
                   + ((acc[r][4] + acc[r][5]) + (acc[r][6] + acc[r][7]));
}

/* The scratch one call of attention_S (backward 0) or attention_backward_S (1) needs, in T's:
   the caller passes that many, on a cache line (a vector never straddles two). */
int64_t attention_scratch_S(int64_t L, int64_t E, int64_t backward) {
    const int64_t W = DT_W(T), Lp = (L + 2 * W - 1) / (2 * W) * 2 * W;
    const int64_t Ep = (E + 2 * W - 1) / (2 * W) * 2 * W;
    return backward ? 2 * E * Lp + 3 * Lp * Ep + DT_R * (2 * Lp + 2 * E + 3 * Ep)
                    : E * Lp + Lp * Ep + DT_R * (Lp + E + 2 * Ep);
}

/* q, k, v, out: tensors 0-3 of off and rs. */
void attention_S(const T *q, const T *k, const T *v, T *out, const int64_t *off,
                 const int64_t *rs, T *kt, int64_t h0, int64_t h1, int64_t H, int64_t L,
                 int64_t E, T scale, int causal) {
    const int64_t W = DT_W(T), Lp = (L + 2 * W - 1) / (2 * W) * 2 * W;
    const int64_t Ep = (E + 2 * W - 1) / (2 * W) * 2 * W;
    T *vp = kt + E * Lp, *s = vp + Lp * Ep, *qs = s + DT_R * Lp, *qp = qs + DT_R * E;
    T *o = qp + DT_R * Ep;
    for (int64_t h = h0; h < h1; h++) {
        T *oh = out + off[3 * H + h];
        dt_pad_t_S(k + off[H + h], rs[1], kt, L, E, Lp);
        const T *vh = dt_pad_S(v + off[2 * H + h], rs[2], vp, L, E, Ep);
        for (int64_t i0 = 0; i0 < L; i0 += DT_R) {
            int64_t nr = L - i0 < DT_R ? L - i0 : DT_R;
            int64_t n = dt_block_rows_S(q + off[h], rs[0], qs, qp, i0, nr, L, E, Ep, scale,
                                        causal);
            int64_t nv = (n + 2 * W - 1) / (2 * W) * 2 * W;
            T total[DT_R];
            dt_rows_product_S(qs, E, kt, Lp, s, Lp, E, nv);
            dt_exp_rows_S(s, Lp, i0, n, causal, nv, total);
            dt_rows_product_S(s, Lp, vh, Ep, o, Ep, n, Ep);
            for (int64_t r = 0; r < nr; r++)
                for (int64_t e = 0; e < E; e++)
                    oh[(i0 + r) * rs[3] + e] = o[r * Ep + e] / total[r];
        }
    }
}

/* The gradients of q, k, v from the output's gradient g (tensors 0-6 of off and rs: g, q, k, v,
   dq, dk, dv), recomputing each block's p: ds_ij = p_ij (dp_ij - sum_j p_ij dp_ij) with
   dp = g v^T; dq = scale ds k, dk = ds^T (scale q), dv = p^T g. */
void attention_backward_S(const T *g, const T *q, const T *k, const T *v, T *out,
                          const int64_t *off, const int64_t *rs, T *kt, int64_t h0,
                          int64_t h1, int64_t H, int64_t L, int64_t E, T scale, int causal) {
    const int64_t W = DT_W(T), Lp = (L + 2 * W - 1) / (2 * W) * 2 * W;
    const int64_t Ep = (E + 2 * W - 1) / (2 * W) * 2 * W;
    T *vt = kt + E * Lp, *kp = vt + E * Lp, *dk = kp + Lp * Ep, *dv = dk + Lp * Ep;
    T *p = dv + Lp * Ep, *dp = p + DT_R * Lp, *qs = dp + DT_R * Lp, *gs = qs + DT_R * E;
    T *qp = gs + DT_R * E, *gp = qp + DT_R * Ep, *o = gp + DT_R * Ep;
    for (int64_t h = h0; h < h1; h++) {
        T *dqh = out + off[4 * H + h], *dkh = out + off[5 * H + h], *dvh = out + off[6 * H + h];
        dt_pad_t_S(k + off[2 * H + h], rs[2], kt, L, E, Lp);
        dt_pad_t_S(v + off[3 * H + h], rs[3], vt, L, E, Lp);
        const T *kh = dt_pad_S(k + off[2 * H + h], rs[2], kp, L, E, Ep);
        /* K's and V's gradients accumulate where they go when those rows are Ep apart */
        int inplace = E == Ep && rs[5] == Ep && rs[6] == Ep;
        T *dka = inplace ? dkh : dk, *dva = inplace ? dvh : dv;
        memset(dka, 0, sizeof(T) * L * Ep);
        memset(dva, 0, sizeof(T) * L * Ep);
        for (int64_t i0 = 0; i0 < L; i0 += DT_R) {
            int64_t nr = L - i0 < DT_R ? L - i0 : DT_R;
            int64_t n = dt_block_rows_S(q + off[H + h], rs[1], qs, qp, i0, nr, L, E, Ep, scale,
                                        causal);
            int64_t nv = (n + 2 * W - 1) / (2 * W) * 2 * W;
            dt_block_rows_S(g + off[h], rs[0], gs, gp, i0, nr, L, E, Ep, 1, causal);
            dt_rows_product_S(qs, E, kt, Lp, p, Lp, E, nv);
            dt_rows_product_S(gs, E, vt, Lp, dp, Lp, E, nv);
            T totals[DT_R];
            dt_exp_rows_S(p, Lp, i0, n, causal, nv, totals);
            for (int64_t r = 0; r < DT_R; r++) {
                int64_t lim = dt_keys_S(i0 + r, n, causal);
                T *pr = p + r * Lp, *dr = dp + r * Lp, total = totals[r];
                for (int64_t j = 0; j < lim; j++) pr[j] /= total;
                T d = dt_dot_S(pr, dr, lim);
                for (int64_t j = 0; j < nv; j++) dr[j] = pr[j] * (dr[j] - d);
            }
            dt_rows_product_S(dp, Lp, kh, Ep, o, Ep, n, Ep);
            for (int64_t r = 0; r < nr; r++)
                for (int64_t e = 0; e < E; e++) dqh[(i0 + r) * rs[4] + e] = o[r * Ep + e] * scale;
            dt_rows_scatter_S(dp, qp, dka, n, Lp, Ep);
            dt_rows_scatter_S(p, gp, dva, n, Lp, Ep);
        }
        for (int64_t j = 0; !inplace && j < L; j++)
            for (int64_t e = 0; e < E; e++) {
                dkh[j * rs[5] + e] = dk[j * Ep + e];
                dvh[j * rs[6] + e] = dv[j * Ep + e];
            }
    }
}

/* p, m, v may be po, mo, vo themselves (an update in place): no restrict on those. */
static inline void dt_adamw_rows_S(const T *p, const T *restrict g, const T *m, const T *v,
                                    T *po, T *mo, T *vo, int64_t n, const T *k) {
    for (int64_t i = 0; i < n; i++) {
ADAMW_BODY
    }
}

/* The AdamW update of parameters q0..q1 (addresses in tab: p, g, m, v of each in turn) into
   the rows of out (3, total); hp: the 7 constants of each parameter's update (adamw_constants),
   rounded to T first, as numpy rounds a Python float against a T array.
   The three results go out with non-temporal stores where the rows line up on 32 bytes: they
   are not read again this step, and a plain store first reads each line of out from memory
   (measured, the standard workload's 5.28M float parameters on one thread: 15-18 -> 12-13
   ms). */
void adamw_group_S(const int64_t *tab, const int64_t *sizes, const int64_t *offsets,
                   const double *hp, T *out, int64_t total, int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; q++) {
        const T *p = (const T *)tab[4 * q], *g = (const T *)tab[4 * q + 1];
        const T *m = (const T *)tab[4 * q + 2], *v = (const T *)tab[4 * q + 3];
        const double *h = hp + 7 * q;
        const T k[7] = {(T)h[0], (T)h[1], (T)h[2], (T)h[3], (T)h[4], (T)h[5], (T)h[6]};
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


def _typed(ctype: str) -> str:
    leaves = ["p[i]", "g[i]", "m[i]", "v[i]"] + [f"k[{j}]" for j in range(7)]
    lines, (po, mo, vo) = kernels.adamw_body(
        lambda e, args: leaves[e.attr] if e.prim == "in" else _spell(e, args, ctype))
    body = [f"        {ctype} {name} = {expr};" for name, expr in lines]
    body += [f"        mo[i] = {mo};", f"        vo[i] = {vo};", f"        po[i] = {po};"]
    text = re.sub(r"\bT\b", ctype, _TYPED).replace("_S(", f"_{_SUFFIX[ctype]}(")
    return text.replace("ADAMW_BODY", "\n".join(body))


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

_P, _I, _U = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64


_ptr = kernels.address


def _c_literal(v, single: bool) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return f"{int(v)}" if v >= 0 else f"({int(v)})"
    v = float(v)
    if not np.isfinite(v):
        return "NAN" if np.isnan(v) else ("INFINITY" if v > 0 else "(-INFINITY)")
    text = repr(v) + ("f" if single else "")
    return f"({text})" if v < 0 else text


# How C spells each primitive of dtensor/ops/expr.py: {f} is the float functions' suffix, {s}
# the type's name suffix, {T} the type. Arguments are always a name or a literal.
_SPELL = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
          "neg": "-{0}", "not": "!{0}", "lt": "{0} < {1}", "le": "{0} <= {1}",
          "gt": "{0} > {1}", "ge": "{0} >= {1}", "eq": "{0} == {1}", "ne": "{0} != {1}",
          "where": "{0} ? {1} : {2}", "maximum": "{0} != {0} || {0} > {1} ? {0} : {1}",
          "minimum": "{0} != {0} || {0} < {1} ? {0} : {1}", "abs": "fabs{f}({0})",
          "exp": "dt_exp_{s}({0})", "log": "log{f}({0})", "sqrt": "sqrt{f}({0})",
          "tanh": "tanh{f}({0})", "sin": "sin{f}({0})", "cos": "cos{f}({0})",
          "pow": "pow{f}({0}, {1})", "cast": "({T})({0})", "rand": "dt_rand({a}, {0})",
          "randn": "dt_randn({a}, {0})"}
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_TRANSCENDENTAL = ("exp", "log", "tanh", "sin", "cos", "pow", "rand", "randn")


def _spell(e, args, ctype: str) -> str:
    if e.prim == "const":
        return _c_literal(e.attr, ctype == "float")
    fmt = {"f": "f" if ctype == "float" else "", "s": _SUFFIX[ctype], "T": ctype}
    if e.prim == "exp" and _sign(e.args[0]) < 0:  # no upper clamp (dt_exp_upto_f32)
        return f"(dt_exp_upto_{fmt['s']}({args[0]}, INFINITY))"
    return "(" + _SPELL[e.prim].format(*args, a=e.attr, **fmt) + ")"


def _sign(e) -> int:
    """-1: ``e`` is never above 0, 1: never below 0 (a NaN aside), 0: unknown. GELU's
    exp(-x^2 / 2) and softmax's exp(x - rowmax(x)) then skip exp's upper clamp."""
    a = e.args
    if e.prim == "const":
        vals = e.attr.values() if isinstance(e.attr, dict) else [e.attr]
        if all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
               for v in vals):
            return 1 if all(v >= 0 for v in vals) else -1 if all(v <= 0 for v in vals) else 0
        return 0
    if e.prim in ("abs", "exp", "sqrt") or (e.prim == "mul" and a[0] is a[1]):
        return 1
    if e.prim == "neg":
        return -_sign(a[0])
    if e.prim == "mul":
        return _sign(a[0]) * _sign(a[1])
    if e.prim == "sub" and a[1].prim == "rowmax" and a[1].args[0] is a[0]:
        return -1
    return 0


def _supported(k: kernels.Kernel) -> bool:
    """Kernels of one float type in which a boolean (an input or a comparison's result) is only
    a where() condition or not()'s argument and an integer input only a comparison's argument:
    C computes on ints where numpy has bool arithmetic (True + True is True) and its own
    promotions (int64 with float32 is float64), so anything else stays numpy."""
    if k.dtype not in (np.float32, np.float64) or any(
            lay.dtype not in (k.dtype, np.bool_, np.int64) for lay in k.inputs):
        return False
    boolean = {id(e) for e in k.nodes if e.prim in _COMPARE + ("not",) or (
        e.prim == "in" and k.inputs[e.attr].dtype == np.bool_)}
    integer = {id(e) for e in k.nodes if e.prim == "in" and k.inputs[e.attr].dtype == np.int64}
    for e in k.nodes:
        for pos, a in enumerate(e.args):
            if id(a) in boolean and not (e.prim == "where" and pos == 0 or e.prim == "not"):
                return False
            if id(a) in integer and e.prim not in _COMPARE:
                return False
        if e.prim == "cast" and e.attr not in (np.float32, np.float64):
            return False
    return True


class _Kernel(kernels.Kernel):
    """A kernel rendered as a C function over rows r0..r1: one streaming pass over a row per
    level of its reductions (8-lane accumulators), then the pass that stores the row."""

    def __init__(self, node: Node, found, name: str):
        super().__init__(node, found)
        self.name = name
        T = _CTYPE[self.dtype]
        self.names: dict = {}
        single = T == "float"
        for e in self.nodes:  # leaves every pass reads by the same name
            if e.prim in ("const", "cols", "row", "col"):
                self.names[id(e)] = (
                    _c_literal(self.literal(e.attr), single) if e.prim == "const" else
                    str(self.C) if e.prim == "cols" else "r" if e.prim == "row" else "cc")
        ins = [f"const {_CTYPE[lay.dtype]} *restrict in{k}"
               for k, lay in enumerate(self.inputs)]
        keys = "".join(f", uint64_t {key}" for key in self.keys)
        C, L = self.C, self.L
        lines = [f"/* {self.label} */",
                 f"void {name}({', '.join(ins + [f'{T} *restrict out'])}, int64_t r0, "
                 f"int64_t r1{keys}) {{", "    for (int64_t r = r0; r < r1; r++) {"]
        for k, lay in enumerate(self.inputs):
            off = " + ".join(f"((r / {i}) % {n}) * {st}" for i, n, st in lay.terms) or "0"
            lines.append(f"        const {_CTYPE[lay.dtype]} *p{k} = in{k} + ({off});")
        n = f"r % {L} + 1 < {C} ? r % {L} + 1 : {C}" if self.causal else C  # causal: j <= i
        lines += [f"        {T} *o = out + r * {self.out_cols};",
                  f"        const int64_t n = {n};"]
        top = self.level[id(self.root)]
        kept = None
        for level in range(top + 1):
            for e in self.nodes:  # this level's row values: once a row
                if (self.row_valued[id(e)] and id(e) not in self.names
                        and self.level[id(e)] == level and e.prim not in X.REDUCTIONS):
                    lines.append(f"        __auto_type v{self.index[id(e)]} = {self._expr(e)};")
                    self.names[id(e)] = f"v{self.index[id(e)]}"
            reductions = [e for e in self.nodes if e.prim in X.REDUCTIONS
                          and self.level[id(e)] == level + 1]
            if reductions:
                kept = self._kept(reductions) if level == top - 1 else None
                lines += self._reduce(reductions, T, kept)
        if kept is not None:  # the last pass reads it back instead of computing it again
            self.names[id(kept)] = "o[cc]"
        root = self.names.get(id(self.root))
        if root is not None:
            lines.append(f"        for (int64_t c = 0; c < {self.out_cols}; c++) "
                         f"o[c] = ({T})({root});")
        else:
            lines += ["        for (int64_t c = 0; c < n; c++) {",
                      "            const int64_t cc = c;"]
            lines += self._body([self.root], "            ")
            lines += [f"            o[c] = ({T})(t{self.index[id(self.root)]});", "        }"]
            if self.causal:
                lines.append(f"        for (int64_t c = n; c < {C}; c++) o[c] = 0;")
        self.source = "\n".join(lines + ["    }", "}", ""])
        self.argtypes = [_P] * (len(self.inputs) + 1) + [_I, _I] + [_U] * len(self.keys)

    def _expr(self, e) -> str:
        args = [self._name(a) for a in e.args]
        if e.prim == "in":
            return f"p{e.attr}[0]" if self.row_valued[id(e)] else (
                f"p{e.attr}[cc * {self.inputs[e.attr].col_stride}]")
        return _spell(e, args, _CTYPE[self.dtype])

    def _name(self, e) -> str:
        return self.names.get(id(e)) or f"t{self.index[id(e)]}"

    def _body(self, targets, pad) -> list:
        return [f"{pad}__auto_type t{self.index[id(e)]} = {self._expr(e)};"
                for e in self.needed(targets, self.names) if id(e) not in self.names]

    def _kept(self, reductions):
        """The value the last reduction pass stores in the output row for the final pass, or
        None: the costliest column value both passes compute that holds a transcendental
        (softmax's exp(x - max), which the final pass divides by the sum). It is a value of
        the kernel's type, so reading it back gives the bits computing it again would: a
        (1024, 2048) softmax, one thread, 2.51 -> 1.78 ms."""
        if self.out_cols != self.C or self.root.prim in X.REDUCTIONS:
            return None
        later = {id(e) for e in self.needed([self.root])}
        best, cost = None, 0
        for e in self.needed([e.args[0] for e in reductions]):
            tree = X.topo([e])
            prims = {d.prim for d in tree}
            if (id(e) in later and e.prim not in _COMPARE + ("not",)  # a value of type T
                    and prims & set(_TRANSCENDENTAL) and "cast" not in prims
                    and len(tree) > cost):
                best, cost = e, len(tree)
        return best

    def _reduce(self, reductions, T, kept=None) -> list:
        """One pass over the row for ``reductions``: 16 columns a step (a sum's 8 lanes of
        each half into its own vector accumulator, added at the end: two chains of
        latencies, not one, as a 2048-column row's sum was bound by), then the tail, in
        order; ``kept`` also goes to the output row."""
        def fold(e, acc, x):  # acc takes x in, as e's reduction does
            return (f"{acc} = {acc} + {x};" if e.prim == "rowsum" else
                    f"{acc} = {x} > {acc} ? {x} : {acc};")

        out = [f"        {T} v{self.index[id(e)]};" for e in reductions] + ["        {"]
        steps, ends = [], []  # per reduction: its vector step, and its lanes folded into v
        for e in reductions:
            i = self.index[id(e)]
            init = "{" + ", ".join(["0" if e.prim == "rowsum" else "-INFINITY"] * 8) + "}"
            out.append(f"        {T} s{i}[16];")
            if e.prim == "rowsum":
                out.append(f"        {T}_8 a{i} = {init}, b{i} = {init};")
                steps.append(f"            {{ {T}_8 t, u; memcpy(&t, s{i}, sizeof t); "
                             f"memcpy(&u, s{i} + 8, sizeof u); a{i} = a{i} + t; "
                             f"b{i} = b{i} + u; }}")
                ends += [f"        a{i} = a{i} + b{i};",
                         f"        v{i} = ((a{i}[0] + a{i}[1]) + (a{i}[2] + a{i}[3])) + "
                         f"((a{i}[4] + a{i}[5]) + (a{i}[6] + a{i}[7]));"]
            else:
                # a max's lanes as a plain array: its lane-by-lane fold into a vector type was
                # left scalar (GCC 12: "unsupported use"), as an array it is one vector
                # compare and blend (a (1024, 2048) softmax's max pass, 8 MB: ~1 ms -> 0.29 ms)
                out.append(f"        {T} a{i}[8] = {init};")
                steps.append(f"            for (int l = 0; l < 16; l++) "
                             f"{fold(e, f'a{i}[l % 8]', f's{i}[l]')}")
                ends += [f"        v{i} = a{i}[0];",
                         f"        for (int l = 1; l < 8; l++) {fold(e, f'v{i}', f'a{i}[l]')}"]
        args = [e.args[0] for e in reductions]
        out += ["        int64_t c = 0;", "        for (; c + 16 <= n; c += 16) {",
                "            for (int l = 0; l < 16; l++) {",
                "                const int64_t cc = c + l;"]
        keep = [] if kept is None else [f"o[cc] = {self._name(kept)};"]
        out += self._body(args, " " * 16)
        out += [f"                s{self.index[id(e)]}[l] = {self._name(e.args[0])};"
                for e in reductions] + ["                " + k for k in keep]
        out += ["            }"] + steps + ["        }"] + ends
        out += ["        for (; c < n; c++) {", "            const int64_t cc = c;"]
        out += self._body(args, " " * 12) + ["            " + k for k in keep]
        out += [f"            {fold(e, f'v{self.index[id(e)]}', self._name(e.args[0]))}"
                for e in reductions]
        out += ["        }", "        }"]
        for e in reductions:
            self.names[id(e)] = f"v{self.index[id(e)]}"
        return out

    def launch(self, arrays, out, keys):
        _run_rows(self.fn, tuple(_ptr(a) for a in arrays) + (_ptr(out),), self.R,
                  self.R * self.C * (len(arrays) + 1), tuple(keys[k] for k in self.keys))


class _IndexAdd(kernels.IndexAdd):
    """index_add, threads splitting the columns."""

    def __init__(self, n: Node):
        super().__init__(n)
        self.name = f"index_add_{_SUFFIX[_CTYPE[self.dtype]]}"
        self.argtypes = [_P] * 3 + [_I] * 6

    def __call__(self, g, idx, like, out=None):
        (g, flat), out = self.rows_of(g, idx), self.alloc(out)
        n = min(num_threads(), -(-self.C // 8)) if flat.size * self.C >= _SPLIT_ELEMENTS else 1
        cuts = [self.C * k // n // 8 * 8 for k in range(n)] + [self.C]  # whole vectors
        head = (_ptr(g), _ptr(flat), _ptr(out), flat.size, self.off, self.rows, self.C)
        _parallel(self.fn, [head + (a, b) for a, b in zip(cuts[:-1], cuts[1:])])
        return out


class _Attention(kernels.Attention):
    """attention and its backward, heads split over threads: a query row's scores are a row of
    the stack, never an (L, L) matrix. The kernel reads its inputs where they lie (each head's
    offset and the row stride), and its results go out token-major, as PyTorch's CPU flash
    kernel does: a (..., heads, L, E) result is a view of (..., L, heads, E) memory, so the
    model's usual transpose back to (B, T, heads, E) and reshape to (B, T, C) copy nothing."""

    def __init__(self, n: Node):
        super().__init__(n)
        self.name = f"{n.name}_{_SUFFIX[_CTYPE[self.dtype]]}"
        real = ctypes.c_float if self.dtype == np.float32 else ctypes.c_double
        self.argtypes = [_P] * (8 if self.backward else 7) + [_I] * 5 + [real, ctypes.c_int]
        self._tables: dict = {}  # (shape, strides) of the inputs and out -> (off, rs)
        self._rooms: list = []  # each thread's scratch, kept from call to call

    @staticmethod
    def _rows(a: np.ndarray) -> bool:
        """Whether the kernel reads ``a`` where it lies: contiguous rows, whole-element steps."""
        return a.strides[-1] == a.itemsize and not any(s % a.itemsize for s in a.strides)

    @staticmethod
    def _layout(a: np.ndarray):
        """(offset of each (L, E) block, row stride) in elements, of an array with _rows."""
        item, steps = a.itemsize, a.strides
        off = np.zeros((), np.int64)
        for n, s in zip(a.shape[:-2], steps[:-2]):
            off = np.add.outer(off, np.arange(n, dtype=np.int64) * (s // item))
        return off.ravel(), steps[-2] // item

    def _table(self, arrays, out):
        """Every head's offset for each tensor (inputs, then out or dq, dk, dv: those from out's
        start, one pointer for the three) and each tensor's row stride, once per layout."""
        key = tuple((a.shape, a.strides) for a in (*arrays, out))
        if key not in self._tables:
            layouts = [self._layout(a) for a in arrays]
            for part in (out[0], out[1], out[2]) if self.backward else (out,):
                o, r = self._layout(part)
                layouts.append((o + (_ptr(part) - _ptr(out)) // out.itemsize, r))
            self._tables[key] = (np.concatenate([o for o, _ in layouts]),
                                 np.array([r for _, r in layouts], np.int64))
        return self._tables[key]

    def _scratch(self, threads: int) -> list:
        """Each thread's scratch, starting on a cache line (a vector never straddles two),
        sized by the library's attention_scratch."""
        if len(self._rooms) < threads:
            size = getattr(self.lib, f"attention_scratch_{_SUFFIX[_CTYPE[self.dtype]]}")
            size.argtypes, size.restype = [_I] * 3, _I
            n = size(self.L, self.E, int(self.backward)) + 64 // self.dtype.itemsize
            self._rooms += [np.empty(n, self.dtype) for _ in range(threads - len(self._rooms))]
        return [_ptr(a) + (-_ptr(a) % 64) for a in self._rooms[:threads]]

    def __call__(self, *inputs, out=None):
        out = self.alloc(out)
        if out.ndim >= 3 + self.backward and out.flags.c_contiguous:
            lead, (heads, L, E) = out.shape[:-3], out.shape[-3:]  # (..., L, heads, E) memory
            out = out.reshape(*lead, L, heads, E).swapaxes(-2, -3)
        if not (self.H and self.L and self.E):
            return out
        arrays = [a if self._rows(a) else np.ascontiguousarray(a) for a in inputs]
        off, rs = self._table(arrays, out)
        head = tuple(_ptr(a) for a in arrays) + (_ptr(out), _ptr(off), _ptr(rs))
        tail = (self.H, self.L, self.E, self.scale, int(self.causal))
        cuts = _cuts(self.H, self.H * self.L * self.L * self.E)  # (L^2 E a head)
        _parallel(self.fn, [head + (room,) + r + tail
                            for room, r in zip(self._scratch(len(cuts)), cuts)])
        return out


class _AdamWGroup(kernels.Named):
    """adamw_group (compile/passes/fusion.py): every parameter's update in one call, the
    parameters split over threads by size."""

    def __init__(self, sizes, dtype):
        self.sizes = np.array(sizes, np.int64)
        self.total = int(self.sizes.sum())
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.dtype = np.dtype(dtype)
        self.name = f"adamw_group_{_SUFFIX[_CTYPE[self.dtype]]}"
        self.argtypes = [_P] * 5 + [_I] * 3
        n = num_threads() if self.total >= _SPLIT_ELEMENTS else 1
        cum = np.cumsum(self.sizes)  # cut where the running size passes k / n of the total
        cuts = [0] + [int(np.searchsorted(cum, self.total * k / n)) + 1 for k in range(1, n)]
        cuts = sorted(set(min(c, len(self.sizes)) for c in cuts + [len(self.sizes)]))
        self.ranges = list(zip(cuts[:-1], cuts[1:]))

    def bind(self, params: dict) -> dict:
        return {k: v for k, v in params.items() if k != "sizes"}

    def __call__(self, *arrays, each=(), out=None, in_place=False, **hp):
        from dtensor.compile.numpy_backend import adamw_table, update_target
        arrays = [np.ascontiguousarray(a) for a in arrays]  # kept alive through the call
        tab = np.array([_ptr(a) for a in arrays], np.int64)
        hps = adamw_table(hp, len(self.sizes), np.float64)
        out = update_target(arrays, self.sizes, in_place, tab) if out is None else out
        head = (_ptr(tab), _ptr(self.sizes), _ptr(self.offsets), _ptr(hps), _ptr(out),
                self.total)
        _parallel(self.fn, [head + r for r in self.ranges])
        return out


def _kernel_for(n: Node, name: str):
    """A C kernel for node ``n``, or None."""
    arrays = [a for a in n.inputs if isinstance(a, (Node, np.ndarray))]
    if n.dtype not in (np.float32, np.float64):
        return None
    if n.name in ("attention", "attention_backward") and n.kind == "op":
        ok = all(a.dtype == n.dtype for a in arrays) and len(arrays) == len(n.inputs)
        return _Attention(n) if ok else None
    if n.name == "adamw_group":
        ok = all(a.dtype == n.dtype for a in arrays)
        return _AdamWGroup(n.params["sizes"], n.dtype) if ok else None
    if n.name == "index_add":
        ok = arrays[0].dtype == n.dtype and arrays[1].dtype.kind in "iu"
        return _IndexAdd(n) if ok else None
    found = kernels.members(n)
    kernel = _Kernel(n, found, name) if found is not None else None
    return kernel if kernel is not None and _supported(kernel) else None


def lower_graph(graph: Graph) -> list:
    """Kernels for the nodes a C kernel can run, all of the graph's built as one library; each
    such node becomes kind "c". Returns [(node, kernel)]."""
    found = [(n, k) for n in graph.nodes if (k := _kernel_for(n, f"k{n.id}")) is not None]
    if not found:
        return []
    lib = build(PRELUDE + "\n" + "".join(k.source for _, k in found))
    for n, kernel in found:
        kernel.fn = getattr(lib, kernel.name)
        kernel.fn.argtypes = kernel.argtypes
        kernel.fn.restype = None
        kernel.lib = lib  # keeps the library loaded as long as the kernel lives
        n.kind = "c"
    return found


PRELUDE = _COMMON + _typed("float") + _typed("double")  # (its spellings are defined above)
