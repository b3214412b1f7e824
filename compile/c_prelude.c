/* The C backend's hand-written part (compile/c_backend.py): the helpers every generated
   kernel may call, and then compile/c_typed.c once per floating type. Float exp is Cephes'
   expf (< 2 ulp) written with selects so that loops calling it vectorise. Draws are
   dtensor/random.py's Philox4x32-10 and its conversions (rand bit for bit). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#define DT_STREAM_f32(dst, src) _mm256_stream_ps((dst), _mm256_loadu_ps(src))
#define DT_STREAM_f64(dst, src) _mm256_stream_pd((dst), _mm256_loadu_pd(src))
#endif

/* What a kernel that takes an exp a column is built with: such a kernel is bound by
   arithmetic, not memory, and runs 12-30% faster in 64-byte vectors on an AVX-512 Xeon (GELU,
   its backward, exp(x - max)), a row kernel's sum of exponentials 30% faster (1024 x 2048:
   0.66 against 0.94 ms alone, 1.03 against 1.52 with a second rank running it at once on the
   VM's other core, which slows such a kernel 1.7x); GCC's tuning for AVX-512 CPUs prefers 32-byte
   ones, which suit the memory-bound rest. The row sums' 8-lane accumulators are vector types
   of their own, whatever the width. Per element it is the same arithmetic at either width. */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define DT_WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define DT_WIDE
#endif

/* The attention kernels' register tiles: vectors as wide as the CPU's (64 bytes with AVX-512,
   else 32: AVX, or pairs of SSE registers), multiply-added with one rounding where the machine
   has FMA. Every output element is the same chain of multiply-adds at either width, so the
   width changes no bit of a result; at 64 bytes each instruction does twice the work
   (benchmarks/attention.py). */
#ifdef __AVX512F__
#define DT_VBYTES 64
#else
#define DT_VBYTES 32
#endif
typedef float float_vec __attribute__((vector_size(DT_VBYTES)));
typedef double double_vec __attribute__((vector_size(DT_VBYTES)));
/* c_typed.c's names for its type T: DT_FN(f) is f_f32 or f_f64 (DT_S, the suffix), VEC(T) the
   type's vector */
#define DT_CAT_(a, b) a##_##b
#define DT_CAT(a, b) DT_CAT_(a, b)
#define DT_FN(f) DT_CAT(f, DT_S)
#define VEC(t) DT_CAT(t, vec)
#define DT_W(t) ((int64_t)(DT_VBYTES / sizeof(t)))  /* lanes */
/* Attention's query rows per block: a block's products hold 2 accumulators a row, so 8 rows
   where the CPU has 32 vector registers (AVX-512) and 4 where it has 16, which 8 rows would
   spill. The order of every sum is the same either way (benchmarks/attention.py). */
#ifdef __AVX512VL__
#define DT_R 8
#else
#define DT_R 4
#endif

static inline float_vec dt_vfma_f32(float_vec a, float_vec b, float_vec c) {
#if defined(__AVX512F__)
    return (float_vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (float_vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline double_vec dt_vfma_f64(double_vec a, double_vec b, double_vec c) {
#if defined(__AVX512F__)
    return (double_vec)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__FMA__)
    return (double_vec)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    return a * b + c;
#endif
}

/* every lane x (not 0 + x: without -ffast-math the compiler must keep that addition, for -0;
   and GCC 12 builds a 64-byte vector from its 16 lanes one masked insert at a time) */
static inline float_vec dt_vset_f32(float x) {
#ifdef __AVX512F__
    return (float_vec)_mm512_set1_ps(x);
#else
    return (float_vec){x, x, x, x, x, x, x, x};
#endif
}
static inline double_vec dt_vset_f64(double x) {
#ifdef __AVX512F__
    return (double_vec)_mm512_set1_pd(x);
#else
    return (double_vec){x, x, x, x};
#endif
}
static inline float_vec dt_vload_f32(const float *p) {
    float_vec v; memcpy(&v, p, sizeof v); return v;
}
static inline double_vec dt_vload_f64(const double *p) {
    double_vec v; memcpy(&v, p, sizeof v); return v;
}
static inline void dt_vstore_f32(float *p, float_vec v) { memcpy(p, &v, sizeof v); }
static inline void dt_vstore_f64(double *p, double_vec v) { memcpy(p, &v, sizeof v); }

/* to[e ts + j] = a[j as + e] for j, e < 8: an 8 x 8 block transposed in registers (AVX's
   unpack, shuffle and lane-swap network): one element at a time, each row's 8 stores go to
   8 lines ts apart, and attention copies K^T once a head (benchmarks/attention.py). */
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
   compiles 8-lane arrays accumulated in place into shuffles and scalar adds: at 512-bit width
   always, at 256-bit width when a pass carries two sums, as layer-norm's backward does
   (benchmarks/kernels.py). */
typedef float float_8 __attribute__((vector_size(8 * sizeof(float))));
typedef double double_8 __attribute__((vector_size(8 * sizeof(double))));

static inline float dt_exp_upto_f32(float x, float hi) {
    /* Clamped to where the scale's two factors stay normal: past 88.8 the product overflows
       to inf, below -110 it underflows to 0, and a NaN passes through the clamp and the
       arithmetic. ``hi`` INFINITY: x is known <= 0 (a softmax row less its max), and the
       upper clamp goes. The clamps pick bits by integer masks: written as float selects, GCC
       12 carries the clamped constants through the whole polynomial and blends its results
       (~45 instructions for 8 lanes in its output against 33; exp(x - max) over 128 x 2048
       floats in cache 10% slower). */
    union { float f; int32_t i; } b = {x}, lo = {-110.0f}, up = {hi};
    int32_t below = -(int32_t)(x < -110.0f), above = -(int32_t)(x > hi);
    b.i = (b.i & ~below) | (lo.i & below);
    b.i = (b.i & ~above) | (up.i & above);
    float xc = b.f;
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
