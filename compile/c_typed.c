/* index_add, attention and the AdamW group, written once over the floating type T: the C
   backend (compile/c_backend.py) includes this file once for float and once for double, with
   T, DT_S (the names' suffix: DT_FN(f) is f_f32 or f_f64) and DT_ADAMW_BODY (the update of
   element i: the adamw_step op's expression, rendered for T) defined. */
/* index_add (an embedding's gradient): row i of g (n rows of C) added into row idx[i] - off
   of zeros (rows, C) when that row lies in [0, rows) (a vocab-parallel shard holds rows
   off..off+rows), in order of i (numpy's reduceat associates a row's terms pairwise: the
   sums agree to rounding). Threads split the columns [c0, c1). */
void DT_FN(index_add)(const T *g, const int64_t *idx, T *out, int64_t n, int64_t off, int64_t rows,
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
static inline void DT_FN(dt_rows_product)(const T *a, int64_t as, const T *b, int64_t bs, T *o,
                                          int64_t os, int64_t K, int64_t C) {
    const int64_t W = DT_W(T);
    for (int64_t c = 0; c < C; c += 2 * W) {
        VEC(T) acc[DT_R][2];
        for (int r = 0; r < DT_R; r++) acc[r][0] = acc[r][1] = (VEC(T)){0};
        for (int64_t k = 0; k < K; k++) {
            VEC(T) b0 = DT_FN(dt_vload)(b + k * bs + c), b1 = DT_FN(dt_vload)(b + k * bs + c + W);
            for (int r = 0; r < DT_R; r++) {
                VEC(T) x = DT_FN(dt_vset)(a[r * as + k]);
                acc[r][0] = DT_FN(dt_vfma)(b0, x, acc[r][0]);
                acc[r][1] = DT_FN(dt_vfma)(b1, x, acc[r][1]);
            }
        }
        for (int r = 0; r < DT_R; r++) {
            DT_FN(dt_vstore)(o + r * os + c, acc[r][0]);
            DT_FN(dt_vstore)(o + r * os + c + W, acc[r][1]);
        }
    }
}

static inline void DT_FN(dt_rows_scatter)(const T *p, const T *x, T *acc, int64_t n, int64_t Lp,
                                          int64_t Ep) {  /* acc[j][:] += sum_r p[r][j] x[r][:] */
    const int64_t W = DT_W(T);
    for (int64_t c = 0; c < Ep; c += 2 * W) {
        VEC(T) xv[DT_R][2];
        for (int r = 0; r < DT_R; r++) {
            xv[r][0] = DT_FN(dt_vload)(x + r * Ep + c);
            xv[r][1] = DT_FN(dt_vload)(x + r * Ep + c + W);
        }
        for (int64_t j = 0; j < n; j++) {
            T *d = acc + j * Ep + c;
            VEC(T) d0 = DT_FN(dt_vload)(d), d1 = DT_FN(dt_vload)(d + W);
            for (int r = 0; r < DT_R; r++) {
                VEC(T) y = DT_FN(dt_vset)(p[r * Lp + j]);
                d0 = DT_FN(dt_vfma)(xv[r][0], y, d0);
                d1 = DT_FN(dt_vfma)(xv[r][1], y, d1);
            }
            DT_FN(dt_vstore)(d, d0);
            DT_FN(dt_vstore)(d + W, d1);
        }
    }
}

static inline T DT_FN(dt_dot)(const T *a, const T *b, int64_t n) {  /* in 8 lanes */
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[j + l] * b[j + l];
    sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; j++) sum += a[j] * b[j];
    return sum;
}

static inline void DT_FN(dt_pad_t)(const T *a, int64_t rs, T *to, int64_t L, int64_t E,
                                   int64_t Lp) {  /* L rows of E -> (E, Lp), zero past L */
    const int64_t L8 = L / 8 * 8, E8 = E / 8 * 8;
    for (int64_t j = 0; j < L8; j += 8)  /* 8 rows at a time, each read once */
        for (int64_t e = 0; e < E8; e += 8) DT_FN(dt_t8)(a + j * rs + e, rs, to + e * Lp + j, Lp);
    for (int64_t j = 0; j < L; j++)  /* what is left: the last E % 8 columns, L % 8 rows */
        for (int64_t e = j < L8 ? E8 : 0; e < E; e++) to[e * Lp + j] = a[j * rs + e];
    for (int64_t e = 0; e < E; e++)
        for (int64_t j = L; j < Lp; j++) to[e * Lp + j] = 0;
}

/* L rows of E, rs apart -> rows of Ep, zero past E; a itself when its rows are that already.
   (Rows a power-of-two stride apart, the heads of a (T, heads, E) projection, fall in a few
   cache sets: read in place they thrash L1, slower than this copy; benchmarks/attention.py.) */
static inline const T *DT_FN(dt_pad)(const T *a, int64_t rs, T *to, int64_t L, int64_t E,
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
static inline int64_t DT_FN(dt_block_rows)(const T *a, int64_t rs, T *x, T *xp, int64_t i0,
                                           int64_t nr, int64_t L, int64_t E, int64_t Ep, T scale,
                                           int causal) {
    memset(xp, 0, sizeof(T) * DT_R * Ep);
    for (int64_t r = 0; r < DT_R; r++)
        for (int64_t e = 0; e < E; e++)
            x[r * E + e] = xp[r * Ep + e] = r < nr ? a[(i0 + r) * rs + e] * scale : 0;
    return causal ? i0 + nr : L;
}

static inline int64_t DT_FN(dt_keys)(int64_t i, int64_t n, int causal) {  /* row i's keys */
    return causal && i + 1 < n ? i + 1 : n;
}

/* a[j] -> exp(a[j] - m) for j < n, 0 where a[j] is -inf: element-wise and bound by the exp, so
   built for the widest vectors (DT_WIDE), apart from the 8-lane row sums that follow it; not
   inlined, since GCC builds an inlined function with its caller's vector width */
static DT_WIDE __attribute__((noinline)) void DT_FN(dt_exp_shifted)(T *a, int64_t n, T m) {
    for (int64_t j = 0; j < n; j++) {
        T x = a[j] - m;
        a[j] = x == -INFINITY ? 0 : DT_FN(dt_exp_upto)(x == -INFINITY ? 0 : x, INFINITY);
    }
}

/* A block's DT_R rows of scores (ss apart; row r is query i0 + r's) -> exp(s - the row's max)
   over its keys, 0 from there to nv; each row's sum into total. Loops run to nv, whole vectors,
   the keys past a row's at -inf (a scalar tail of up to 15 exps a row costs more); their exp
   is taken of 0 and replaced by 0, since exp(-inf)'s scaling underflows, which the CPU
   finishes slowly. The rows go side by side, 8 lanes each, so their chains of latencies (max,
   sum) overlap; one row at a time, those chains bound the kernel (benchmarks/attention.py). */
static inline void DT_FN(dt_exp_rows)(T *s, int64_t ss, int64_t i0, int64_t n, int causal,
                                      int64_t nv, T *total) {
    T mx[DT_R][8], acc[DT_R][8], m[DT_R];
    for (int r = 0; r < DT_R; r++) {
        for (int64_t j = DT_FN(dt_keys)(i0 + r, n, causal); j < nv; j++) s[r * ss + j] = -INFINITY;
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
    for (int r = 0; r < DT_R; r++) DT_FN(dt_exp_shifted)(s + r * ss, nv, m[r]);
    for (int64_t j = 0; j < nv; j += 8)
        for (int r = 0; r < DT_R; r++)
            for (int l = 0; l < 8; l++) acc[r][l] += s[r * ss + j + l];
    for (int r = 0; r < DT_R; r++)
        total[r] = ((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]))
                   + ((acc[r][4] + acc[r][5]) + (acc[r][6] + acc[r][7]));
}

/* Rows i0 .. i0 + nr of a (rs apart, E wide) toward L2, to be read or (write) written. Each
   block of a head fetches the same rows of the next head's inputs and outputs: in a training
   step they come cold (the projections were two or more GEMMs earlier, the outputs' lines
   last used long before), and so their misses overlap this head's arithmetic
   (benchmarks/attention.py --cold). */
static inline void DT_FN(dt_prefetch_rows)(const T *a, int64_t rs, int64_t i0, int64_t nr,
                                           int64_t E, int write) {
    for (int64_t r = i0; r < i0 + nr; r++)
        for (int64_t e = 0; e < E; e += 64 / (int64_t)sizeof(T)) {
            if (write)
                __builtin_prefetch(a + r * rs + e, 1, 2);
            else
                __builtin_prefetch(a + r * rs + e, 0, 2);
        }
}

/* The scratch one call of attention (backward 0) or attention_backward (1) needs, in T's:
   the caller passes that many, on a cache line (a vector never straddles two). */
int64_t DT_FN(attention_scratch)(int64_t L, int64_t E, int64_t backward) {
    const int64_t W = DT_W(T), Lp = (L + 2 * W - 1) / (2 * W) * 2 * W;
    const int64_t Ep = (E + 2 * W - 1) / (2 * W) * 2 * W;
    return backward ? 2 * E * Lp + 3 * Lp * Ep + DT_R * (2 * Lp + 2 * E + 3 * Ep)
                    : E * Lp + Lp * Ep + DT_R * (Lp + E + 2 * Ep);
}

/* q, k, v, out: tensors 0-3 of off and rs. */
void DT_FN(attention)(const T *q, const T *k, const T *v, T *out, const int64_t *off,
                      const int64_t *rs, T *kt, int64_t h0, int64_t h1, int64_t H, int64_t L,
                      int64_t E, T scale, int causal) {
    const int64_t W = DT_W(T), Lp = (L + 2 * W - 1) / (2 * W) * 2 * W;
    const int64_t Ep = (E + 2 * W - 1) / (2 * W) * 2 * W;
    T *vp = kt + E * Lp, *s = vp + Lp * Ep, *qs = s + DT_R * Lp, *qp = qs + DT_R * E;
    T *o = qp + DT_R * Ep;
    for (int64_t h = h0; h < h1; h++) {
        T *oh = out + off[3 * H + h];
        DT_FN(dt_pad_t)(k + off[H + h], rs[1], kt, L, E, Lp);
        const T *vh = DT_FN(dt_pad)(v + off[2 * H + h], rs[2], vp, L, E, Ep);
        for (int64_t i0 = 0; i0 < L; i0 += DT_R) {
            int64_t nr = L - i0 < DT_R ? L - i0 : DT_R;
            int64_t n = DT_FN(dt_block_rows)(q + off[h], rs[0], qs, qp, i0, nr, L, E, Ep, scale,
                                             causal);
            for (int t = 0; h + 1 < h1 && t < 4; t++)  /* the next head's q, k, v, out */
                DT_FN(dt_prefetch_rows)((t == 0 ? q : t == 1 ? k : t == 2 ? v : out)
                                        + off[t * H + h + 1], rs[t], i0, nr, E, t == 3);
            int64_t nv = (n + 2 * W - 1) / (2 * W) * 2 * W;
            T total[DT_R];
            DT_FN(dt_rows_product)(qs, E, kt, Lp, s, Lp, E, nv);
            DT_FN(dt_exp_rows)(s, Lp, i0, n, causal, nv, total);
            DT_FN(dt_rows_product)(s, Lp, vh, Ep, o, Ep, n, Ep);
            for (int64_t r = 0; r < nr; r++)
                for (int64_t e = 0; e < E; e++)
                    oh[(i0 + r) * rs[3] + e] = o[r * Ep + e] / total[r];
        }
    }
}

/* The gradients of q, k, v from the output's gradient g (tensors 0-6 of off and rs: g, q, k, v,
   dq, dk, dv), recomputing each block's p: ds_ij = p_ij (dp_ij - sum_j p_ij dp_ij) with
   dp = g v^T; dq = scale ds k, dk = ds^T (scale q), dv = p^T g. */
void DT_FN(attention_backward)(const T *g, const T *q, const T *k, const T *v, T *out,
                               const int64_t *off, const int64_t *rs, T *kt, int64_t h0,
                               int64_t h1, int64_t H, int64_t L, int64_t E, T scale, int causal) {
    const int64_t W = DT_W(T), Lp = (L + 2 * W - 1) / (2 * W) * 2 * W;
    const int64_t Ep = (E + 2 * W - 1) / (2 * W) * 2 * W;
    T *vt = kt + E * Lp, *kp = vt + E * Lp, *dk = kp + Lp * Ep, *dv = dk + Lp * Ep;
    T *p = dv + Lp * Ep, *dp = p + DT_R * Lp, *qs = dp + DT_R * Lp, *gs = qs + DT_R * E;
    T *qp = gs + DT_R * E, *gp = qp + DT_R * Ep, *o = gp + DT_R * Ep;
    for (int64_t h = h0; h < h1; h++) {
        T *dqh = out + off[4 * H + h], *dkh = out + off[5 * H + h], *dvh = out + off[6 * H + h];
        DT_FN(dt_pad_t)(k + off[2 * H + h], rs[2], kt, L, E, Lp);
        DT_FN(dt_pad_t)(v + off[3 * H + h], rs[3], vt, L, E, Lp);
        const T *kh = DT_FN(dt_pad)(k + off[2 * H + h], rs[2], kp, L, E, Ep);
        /* K's and V's gradients accumulate where they go when those rows are Ep apart */
        int inplace = E == Ep && rs[5] == Ep && rs[6] == Ep;
        T *dka = inplace ? dkh : dk, *dva = inplace ? dvh : dv;
        memset(dka, 0, sizeof(T) * L * Ep);
        memset(dva, 0, sizeof(T) * L * Ep);
        for (int64_t i0 = 0; i0 < L; i0 += DT_R) {
            int64_t nr = L - i0 < DT_R ? L - i0 : DT_R;
            int64_t n = DT_FN(dt_block_rows)(q + off[H + h], rs[1], qs, qp, i0, nr, L, E, Ep,
                                             scale, causal);
            for (int t = 0; h + 1 < h1 && t < 7; t++)  /* the next head's g, q, k, v, dq, dk, dv */
                DT_FN(dt_prefetch_rows)((t == 0 ? g : t == 1 ? q : t == 2 ? k : t == 3 ? v : out)
                                        + off[t * H + h + 1], rs[t], i0, nr, E, t >= 4);
            int64_t nv = (n + 2 * W - 1) / (2 * W) * 2 * W;
            DT_FN(dt_block_rows)(g + off[h], rs[0], gs, gp, i0, nr, L, E, Ep, 1, causal);
            DT_FN(dt_rows_product)(qs, E, kt, Lp, p, Lp, E, nv);
            DT_FN(dt_rows_product)(gs, E, vt, Lp, dp, Lp, E, nv);
            T totals[DT_R];
            DT_FN(dt_exp_rows)(p, Lp, i0, n, causal, nv, totals);
            for (int64_t r = 0; r < DT_R; r++) {
                int64_t lim = DT_FN(dt_keys)(i0 + r, n, causal);
                T *pr = p + r * Lp, *dr = dp + r * Lp, total = totals[r];
                for (int64_t j = 0; j < lim; j++) pr[j] /= total;
                T d = DT_FN(dt_dot)(pr, dr, lim);
                for (int64_t j = 0; j < nv; j++) dr[j] = pr[j] * (dr[j] - d);
            }
            DT_FN(dt_rows_product)(dp, Lp, kh, Ep, o, Ep, n, Ep);
            for (int64_t r = 0; r < nr; r++)
                for (int64_t e = 0; e < E; e++) dqh[(i0 + r) * rs[4] + e] = o[r * Ep + e] * scale;
            DT_FN(dt_rows_scatter)(dp, qp, dka, n, Lp, Ep);
            DT_FN(dt_rows_scatter)(p, gp, dva, n, Lp, Ep);
        }
        for (int64_t j = 0; !inplace && j < L; j++)
            for (int64_t e = 0; e < E; e++) {
                dkh[j * rs[5] + e] = dk[j * Ep + e];
                dvh[j * rs[6] + e] = dv[j * Ep + e];
            }
    }
}

/* p, m, v may be po, mo, vo themselves (an update in place): no restrict on those. */
static inline void DT_FN(dt_adamw_rows)(const T *p, const T *restrict g, const T *m, const T *v,
                                        T *po, T *mo, T *vo, int64_t n, const T *k) {
    for (int64_t i = 0; i < n; i++) {
DT_ADAMW_BODY
    }
}

/* The AdamW update of parameters q0..q1 (addresses in tab: p, g, m, v of each in turn) into
   the rows of out (3, total); hp: the 7 constants of each parameter's update (adamw_constants),
   rounded to T first, as numpy rounds a Python float against a T array.
   The three results go out with non-temporal stores where the rows line up on 32 bytes: they
   are not read again this step, and a plain store first reads each line of out from memory
   (benchmarks/gpt_step.py). */
void DT_FN(adamw_group)(const int64_t *tab, const int64_t *sizes, const int64_t *offsets,
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
        DT_FN(dt_adamw_rows)(p, g, m, v, po, mo, vo, i, k);
        if ((((uintptr_t)(po + i) | (uintptr_t)(mo + i) | (uintptr_t)(vo + i)) & 31) == 0) {
            enum { L = 32 / sizeof(T) };
            for (; i + 64 <= n; i += 64) {  /* 64 results to the stack, then streamed out */
                T r[3][64];
                DT_FN(dt_adamw_rows)(p + i, g + i, m + i, v + i, r[0], r[1], r[2], 64, k);
                for (int j = 0; j < 64; j += L) {
                    DT_FN(DT_STREAM)(po + i + j, r[0] + j);
                    DT_FN(DT_STREAM)(mo + i + j, r[1] + j);
                    DT_FN(DT_STREAM)(vo + i + j, r[2] + j);
                }
            }
            _mm_sfence();  /* the streamed lines are visible before the caller reads out */
        }
#endif
        DT_FN(dt_adamw_rows)(p + i, g + i, m + i, v + i, po + i, mo + i, vo + i, n - i, k);
    }
}
