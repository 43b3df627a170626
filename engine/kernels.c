/*
 * kernels.c: the decode path's vector kernels (kernels.h states the
 * summation-order rule they keep). Three sets: AVX-512 (16 lanes), AVX2+FMA
 * (8 lanes), plain C (8 lanes, multiply then add); the best one the CPU has
 * is picked once per process, so every forward pass of a process sums in the
 * same order. The AVX sets are compiled with target attributes and called
 * only after the CPU reported the feature, so the build needs no -march.
 * Attention over K/V stored as F16, BF16, I8 or U8 converts each element on
 * the fly (F16C / vcvtph2ps, a shift, code * scale, or fma(code, step, min)
 * per channel) inside the same loops,
 * in 16 lanes in the AVX-512 set and 8 in the AVX2 set (kernels.h).
 * This file owns no memory and no state beyond the chosen set.
 */
#include "kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVT__X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

/* Rows of W per tile: a tile (4 rows, n_in floats) stays in L1/L2 while
 * every input row passes over it. */
#define TILE_ROWS 4
/* While the AVX kernels multiply a tile of rows they prefetch the lines of
 * the tile PF_TILES ahead (one line per row per 16 floats, into L2: a tile
 * of long rows would push the current one out of L1), so the
 * stream of weights from memory overlaps the arithmetic instead of following
 * it: with several input rows per tile (batched decode) the arithmetic takes
 * long enough that the hardware prefetcher alone falls behind. Prefetches
 * change no result. */
#define PF_TILES 1
#define PF_HINT _MM_HINT_T1

/* ---- plain C (8 lanes) ------------------------------------------------------ */

#define C_LANES 8

static float c_dot_lanes(const float *w, const float *x, int n)
{
    float acc[C_LANES] = {0};
    int j = 0;
    for (; j + C_LANES <= n; j += C_LANES)
        for (int l = 0; l < C_LANES; l++)
            acc[l] += w[j + l] * x[j + l];
    for (int l = 0; j + l < n; l++)
        acc[l] += w[j + l] * x[j + l];
    /* fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs */
    float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6], s3 = acc[3] + acc[7];
    return (s0 + s2) + (s1 + s3);
}

static void c_matmul(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int i = 0; i < n; i++)
            out[(size_t)i * ldo + r] = c_dot_lanes(W + (size_t)r * n_in, x + (size_t)i * n_in, n_in);
}

static void c_scores(float *S, const float *q, const float *K, size_t ldk, int n, int hs, float scale)
{
    for (int t = 0; t < n; t++)
        S[t] = c_dot_lanes(q, K + (size_t)t * ldk, hs) * scale;
}

static void c_softmax(float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    float acc[C_LANES] = {0};
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        acc[i % C_LANES] += x[i];
    }
    float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6], s3 = acc[3] + acc[7];
    float sum = (s0 + s2) + (s1 + s3);
    for (int i = 0; i < n; i++)
        x[i] /= sum;
}

static void c_values(float *out, const float *S, const float *V, size_t ldv, int n, int hs, int accumulate)
{
    if (!accumulate)
        memset(out, 0, (size_t)hs * sizeof(float));
    for (int t = 0; t < n; t++)
        for (int i = 0; i < hs; i++)
            out[i] += S[t] * V[(size_t)t * ldv + i];
}

static void c_silu_mul(float *h, const float *g, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float v = h[i];
        v *= 1.0f / (1.0f + expf(-v));
        h[i] = v * g[i];
    }
}

/* ---- plain C over K/V in a storage scheme -------------------------------------- */

static float half_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu, x;
    if (e == 0x1f) {
        x = sign | 0x7f800000u | (mant << 13);
    } else if (e) {
        x = sign | ((e + 112u) << 23) | (mant << 13);
    } else {
        float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        memcpy(&x, &f, sizeof x);
        x |= sign;
    }
    float out;
    memcpy(&out, &x, sizeof out);
    return out;
}

/* Element e of row t of K (v = 0) or V (v = 1), as a float. */
static inline float row_elem(const kvt_kv_rows *r, int v, size_t t, size_t e, size_t ld)
{
    const void *base = v ? r->v : r->k;
    size_t i = t * ld + e;
    switch (r->dtype) {
    case KVT_DTYPE_F16:
        return half_to_f32(((const uint16_t *)base)[i]);
    case KVT_DTYPE_BF16: {
        uint32_t x = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &x, sizeof f);
        return f;
    }
    case KVT_DTYPE_I8: {
        const float *sc = v ? r->v_scale : r->k_scale;
        size_t gs = (size_t)r->group_size;
        return (float)((const int8_t *)base)[i] * sc[t * (ld / gs) + e / gs];
    }
    case KVT_DTYPE_U8:
        return fmaf((float)((const uint8_t *)base)[i], (v ? r->v_scale : r->k_scale)[e], (v ? r->v_min : r->k_min)[e]);
    default:
        return ((const float *)base)[i];
    }
}

/* c_dot_lanes(q, K_t) with K_t converted element by element. */
static void c_scores_rows(float *S, const float *q, const kvt_kv_rows *r, size_t off, size_t ld, int hs, float scale)
{
    for (int t = 0; t < r->n; t++) {
        float acc[C_LANES] = {0};
        int j = 0;
        for (; j + C_LANES <= hs; j += C_LANES)
            for (int l = 0; l < C_LANES; l++)
                acc[l] += q[j + l] * row_elem(r, 0, (size_t)t, off + (size_t)(j + l), ld);
        for (int l = 0; j + l < hs; l++)
            acc[l] += q[j + l] * row_elem(r, 0, (size_t)t, off + (size_t)(j + l), ld);
        float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6], s3 = acc[3] + acc[7];
        S[t] = ((s0 + s2) + (s1 + s3)) * scale;
    }
}

static void c_values_rows(float *out, const float *S, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                          int accumulate)
{
    if (!accumulate)
        memset(out, 0, (size_t)hs * sizeof(float));
    for (int t = 0; t < r->n; t++)
        for (int i = 0; i < hs; i++)
            out[i] += S[t] * row_elem(r, 1, (size_t)t, off + (size_t)i, ld);
}

static void c_rows_to_f32(float *dst, const kvt_kv_rows *r, int v, size_t off, size_t ld, int hs)
{
    for (int t = 0; t < r->n; t++)
        for (int i = 0; i < hs; i++)
            dst[(size_t)t * (size_t)hs + (size_t)i] = row_elem(r, v, (size_t)t, off + (size_t)i, ld);
}

#ifdef KVT__X86

/* ---- AVX-512 (16 lanes) ------------------------------------------------------ */

#define AVX512 __attribute__((target("avx512f,fma")))

/* A tile of R rows x S inputs: R * S accumulators held in registers. */
static inline __attribute__((always_inline)) AVX512 void tile512_pf(float *out, size_t ldo, const float *x, int n_in,
                                                                     const float *W, size_t ldw, int r, const int R,
                                                                     const int S, const float *pf)
{
    __m512 acc[TILE_ROWS][4];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < S; b++)
            acc[a][b] = _mm512_setzero_ps();
    const float *w0 = W + (size_t)r * ldw;
    int j = 0;
    for (; j + 16 <= n_in; j += 16) {
        __m512 xv[4];
        if (pf) {
#pragma GCC unroll 4
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)(pf + (size_t)a * ldw + j), PF_HINT);
        }
#pragma GCC unroll 4
        for (int b = 0; b < S; b++)
            xv[b] = _mm512_loadu_ps(x + (size_t)b * n_in + j);
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            __m512 wv = _mm512_loadu_ps(w0 + (size_t)a * ldw + j);
#pragma GCC unroll 4
            for (int b = 0; b < S; b++)
                acc[a][b] = _mm512_fmadd_ps(wv, xv[b], acc[a][b]);
        }
    }
    if (j < n_in) {
        __mmask16 k = (__mmask16)((1u << (n_in - j)) - 1);
        __m512 xv[4];
#pragma GCC unroll 4
        for (int b = 0; b < S; b++)
            xv[b] = _mm512_maskz_loadu_ps(k, x + (size_t)b * n_in + j);
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            __m512 wv = _mm512_maskz_loadu_ps(k, w0 + (size_t)a * ldw + j);
#pragma GCC unroll 4
            for (int b = 0; b < S; b++)
                acc[a][b] = _mm512_fmadd_ps(wv, xv[b], acc[a][b]);
        }
    }
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < S; b++)
            out[(size_t)b * ldo + r + a] = _mm512_reduce_add_ps(acc[a][b]);
}

static inline __attribute__((always_inline)) AVX512 void tile512(float *out, size_t ldo, const float *x, int n_in,
                                                                  const float *W, size_t ldw, int r, const int R,
                                                                  const int S)
{
    tile512_pf(out, ldo, x, n_in, W, ldw, r, R, S, NULL);
}

static AVX512 void avx512_matmul(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0,
                                 int r1)
{
    int r = r0;
    for (; r + TILE_ROWS <= r1; r += TILE_ROWS) {
        const float *pf = r + PF_TILES * TILE_ROWS < r1 ? W + (size_t)(r + PF_TILES * TILE_ROWS) * n_in : NULL;
        int i = 0;
        for (; i + 4 <= n; i += 4, pf = NULL)
            tile512_pf(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 4, 4, pf);
        for (; i + 2 <= n; i += 2, pf = NULL)
            tile512_pf(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 4, 2, pf);
        for (; i < n; i++, pf = NULL)
            tile512_pf(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 4, 1, pf);
    }
    for (; r < r1; r++) {
        int i = 0;
        for (; i + 4 <= n; i += 4)
            tile512_pf(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 1, 4, NULL);
        for (; i < n; i++)
            tile512_pf(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 1, 1, NULL);
    }
}

/* exp as Cephes expf: n = round(x log2 e), r = x - n ln2 (in two parts),
 * e^r = 1 + r + r^2 p(r), times 2^n. */
static inline __attribute__((always_inline)) AVX512 __m512 exp512(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)), _mm512_set1_ps(88.3762626647949f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

static AVX512 void avx512_scores(float *S, const float *q, const float *K, size_t ldk, int n, int hs, float scale)
{
    int t = 0; /* keys as the rows of a product with the one query: 4 at a time */
    for (; t + 4 <= n; t += 4)
        tile512(S, 1, q, hs, K, ldk, t, 4, 1);
    for (; t < n; t++)
        tile512(S, 1, q, hs, K, ldk, t, 1, 1);
    for (t = 0; t < n; t++)
        S[t] *= scale;
}

static AVX512 void avx512_softmax(float *x, int n)
{
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    if (i < n)
        mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, x + i));
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv)), sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx));
        _mm512_storeu_ps(x + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
        __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mx)));
        _mm512_mask_storeu_ps(x + i, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 s = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    for (i = 0; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_div_ps(_mm512_loadu_ps(x + i), s));
    if (i < n)
        _mm512_mask_storeu_ps(x + i, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), s));
}

/* NV vectors (16 floats each, the last one masked by k) of out held in
 * registers while every value row passes. */
static inline __attribute__((always_inline)) AVX512 void values512(float *out, const float *S, const float *V,
                                                                    size_t ldv, int n, const int NV, __mmask16 k,
                                                                    int accumulate)
{
    __m512 acc[8];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++)
        acc[v] = !accumulate ? _mm512_setzero_ps()
                 : v < NV - 1 ? _mm512_loadu_ps(out + 16 * v)
                              : _mm512_maskz_loadu_ps(k, out + 16 * v);
    for (int t = 0; t < n; t++) {
        __m512 a = _mm512_set1_ps(S[t]);
        const float *row = V + (size_t)t * ldv;
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            acc[v] = _mm512_fmadd_ps(a, v < NV - 1 ? _mm512_loadu_ps(row + 16 * v) : _mm512_maskz_loadu_ps(k, row + 16 * v),
                                     acc[v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) {
        if (v < NV - 1)
            _mm512_storeu_ps(out + 16 * v, acc[v]);
        else
            _mm512_mask_storeu_ps(out + 16 * v, k, acc[v]);
    }
}

static AVX512 void avx512_values(float *out, const float *S, const float *V, size_t ldv, int n, int hs, int accumulate)
{
    for (int i0 = 0; i0 < hs; i0 += 128) { /* 128 output floats (8 registers) at a time */
        int w = hs - i0 < 128 ? hs - i0 : 128, nv = (w + 15) / 16;
        __mmask16 k = (__mmask16)(w % 16 ? (1u << (w % 16)) - 1 : 0xffffu);
        float *o = out + i0;
        const float *v0 = V + i0;
        switch (nv) {
        case 1: values512(o, S, v0, ldv, n, 1, k, accumulate); break;
        case 2: values512(o, S, v0, ldv, n, 2, k, accumulate); break;
        case 3: values512(o, S, v0, ldv, n, 3, k, accumulate); break;
        case 4: values512(o, S, v0, ldv, n, 4, k, accumulate); break;
        case 5: values512(o, S, v0, ldv, n, 5, k, accumulate); break;
        case 6: values512(o, S, v0, ldv, n, 6, k, accumulate); break;
        case 7: values512(o, S, v0, ldv, n, 7, k, accumulate); break;
        default: values512(o, S, v0, ldv, n, 8, k, accumulate); break;
        }
    }
}

static AVX512 void avx512_silu_mul(float *h, const float *g, size_t n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(h + i);
        __m512 sg = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), v))));
        _mm512_storeu_ps(h + i, _mm512_mul_ps(_mm512_mul_ps(v, sg), _mm512_loadu_ps(g + i)));
    }
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(k, h + i);
        __m512 sg = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), v))));
        _mm512_mask_storeu_ps(h + i, k, _mm512_mul_ps(_mm512_mul_ps(v, sg), _mm512_maskz_loadu_ps(k, g + i)));
    }
}

/* ---- AVX2 + FMA (8 lanes) ---------------------------------------------------- */

#define AVX2 __attribute__((target("avx2,fma")))

static inline __attribute__((always_inline)) AVX2 float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* (0+4, 1+5, 2+6, 3+7) */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        /* (0+2, 1+3) */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) AVX2 __m256i tail_mask256(int left)
{
    static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(const void *)(m + 8 - left));
}

static inline __attribute__((always_inline)) AVX2 void tile256_pf(float *out, size_t ldo, const float *x, int n_in,
                                                                   const float *W, size_t ldw, int r, const int R,
                                                                   const int S, const float *pf)
{
    __m256 acc[TILE_ROWS][2];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 2
        for (int b = 0; b < S; b++)
            acc[a][b] = _mm256_setzero_ps();
    const float *w0 = W + (size_t)r * ldw;
    int j = 0;
    for (; j + 8 <= n_in; j += 8) {
        __m256 xv[2];
        if (pf && !(j & 15)) { /* a line (16 floats) of each row of the tile PF_TILES ahead */
#pragma GCC unroll 4
            for (int a = 0; a < R; a++)
                _mm_prefetch((const char *)(pf + (size_t)a * ldw + j), PF_HINT);
        }
#pragma GCC unroll 2
        for (int b = 0; b < S; b++)
            xv[b] = _mm256_loadu_ps(x + (size_t)b * n_in + j);
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            __m256 wv = _mm256_loadu_ps(w0 + (size_t)a * ldw + j);
#pragma GCC unroll 2
            for (int b = 0; b < S; b++)
                acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);
        }
    }
    if (j < n_in) {
        __m256i k = tail_mask256(n_in - j);
        __m256 xv[2];
#pragma GCC unroll 2
        for (int b = 0; b < S; b++)
            xv[b] = _mm256_maskload_ps(x + (size_t)b * n_in + j, k);
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            __m256 wv = _mm256_maskload_ps(w0 + (size_t)a * ldw + j, k);
#pragma GCC unroll 2
            for (int b = 0; b < S; b++)
                acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);
        }
    }
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 2
        for (int b = 0; b < S; b++)
            out[(size_t)b * ldo + r + a] = hsum256(acc[a][b]);
}

static inline __attribute__((always_inline)) AVX2 void tile256(float *out, size_t ldo, const float *x, int n_in,
                                                                const float *W, size_t ldw, int r, const int R,
                                                                const int S)
{
    tile256_pf(out, ldo, x, n_in, W, ldw, r, R, S, NULL);
}

static AVX2 void avx2_matmul(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0, int r1)
{
    int r = r0;
    for (; r + TILE_ROWS <= r1; r += TILE_ROWS) {
        const float *pf = r + PF_TILES * TILE_ROWS < r1 ? W + (size_t)(r + PF_TILES * TILE_ROWS) * n_in : NULL;
        int i = 0;
        for (; i + 2 <= n; i += 2, pf = NULL)
            tile256_pf(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 4, 2, pf);
        for (; i < n; i++, pf = NULL)
            tile256_pf(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 4, 1, pf);
    }
    for (; r < r1; r++)
        for (int i = 0; i < n; i++)
            tile256(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, (size_t)n_in, r, 1, 1);
}

static inline __attribute__((always_inline)) AVX2 __m256 exp256(__m256 x)
{
    /* as exp512; 2^n built in the exponent field, so x is kept where n is a
     * normal exponent */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static AVX2 void avx2_scores(float *S, const float *q, const float *K, size_t ldk, int n, int hs, float scale)
{
    int t = 0;
    for (; t + 4 <= n; t += 4)
        tile256(S, 1, q, hs, K, ldk, t, 4, 1);
    for (; t < n; t++)
        tile256(S, 1, q, hs, K, ldk, t, 1, 1);
    for (t = 0; t < n; t++)
        S[t] *= scale;
}

static AVX2 void avx2_softmax(float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    __m256 m = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (i < n) {
        __m256i k = tail_mask256(n - i);
        __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i, k), m)), _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(x + i, k, e);
        sum = _mm256_add_ps(sum, e);
    }
    float s = hsum256(sum);
    for (i = 0; i < n; i++)
        x[i] /= s;
}

static AVX2 void avx2_values(float *out, const float *S, const float *V, size_t ldv, int n, int hs, int accumulate)
{
    for (int i0 = 0; i0 < hs; i0 += 64) { /* 64 output floats (8 registers) at a time */
        int w = hs - i0 < 64 ? hs - i0 : 64, nv = (w + 7) / 8;
        __m256i k = tail_mask256(w % 8 ? w % 8 : 8);
        __m256 acc[8];
        for (int v = 0; v < 8; v++)
            acc[v] = _mm256_setzero_ps();
        if (accumulate)
            for (int v = 0; v < nv; v++)
                acc[v] = v < nv - 1 ? _mm256_loadu_ps(out + i0 + 8 * v) : _mm256_maskload_ps(out + i0 + 8 * v, k);
        for (int t = 0; t < n; t++) {
            __m256 a = _mm256_set1_ps(S[t]);
            const float *row = V + (size_t)t * ldv + i0;
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++)
                if (v < nv)
                    acc[v] = _mm256_fmadd_ps(a, v < nv - 1 ? _mm256_loadu_ps(row + 8 * v) : _mm256_maskload_ps(row + 8 * v, k),
                                             acc[v]);
        }
        for (int v = 0; v < nv; v++) {
            if (v < nv - 1)
                _mm256_storeu_ps(out + i0 + 8 * v, acc[v]);
            else
                _mm256_maskstore_ps(out + i0 + 8 * v, k, acc[v]);
        }
    }
}

static AVX2 void avx2_silu_mul(float *h, const float *g, size_t n)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(h + i);
        __m256 sg = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), v))));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_mul_ps(v, sg), _mm256_loadu_ps(g + i)));
    }
    if (i < n) { /* the same arithmetic on the tail, so an element's value never depends on n */
        __m256i k = tail_mask256((int)(n - i));
        __m256 v = _mm256_maskload_ps(h + i, k);
        __m256 sg = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), v))));
        _mm256_maskstore_ps(h + i, k, _mm256_mul_ps(_mm256_mul_ps(v, sg), _mm256_maskload_ps(g + i, k)));
    }
}

/* ---- AVX2 + FMA + F16C over K/V in a storage scheme ------------------------- */

#define AVX2C __attribute__((target("avx2,fma,f16c")))

/* Most 8-float chunks of a head the I8 kernels plan scales for (hs <= 512). */
#define PLAN_CHUNKS 64

/* Where each chunk of 8 elements of a head finds its scales in a row's
 * scales: one group for the whole chunk (uni) or a gather of 8. */
typedef struct {
    int32_t g[PLAN_CHUNKS][8];
    uint8_t uni[PLAN_CHUNKS];
} q8_plan;

static void plan_scales(q8_plan *p, size_t off, int hs, int gs)
{
    for (int c = 0; c * 8 < hs; c++) {
        for (int l = 0; l < 8; l++) {
            size_t e = off + (size_t)(c * 8 + (c * 8 + l < hs ? l : hs - 1 - c * 8));
            p->g[c][l] = (int32_t)(e / (size_t)gs);
        }
        p->uni[c] = p->g[c][0] == p->g[c][7];
    }
}

static inline __attribute__((always_inline)) AVX2C __m256 plan_scale(const q8_plan *p, const float *srow, int c)
{
    return p->uni[c] ? _mm256_set1_ps(srow[p->g[c][0]])
                     : _mm256_i32gather_ps(srow, _mm256_loadu_si256((const __m256i *)(const void *)p->g[c]), 4);
}

/* Elements [e, e + 8) of a row of dtype dt as floats (I8: times sv; U8:
 * fma(code, sv, mv), sv and mv the channels' steps and minima). */
static inline __attribute__((always_inline)) AVX2C __m256 cvt8(const int dt, const void *row, size_t e, __m256 sv,
                                                                __m256 mv)
{
    if (dt == KVT_DTYPE_U8)
        return _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)((const uint8_t *)row + e)))),
            sv, mv);
    if (dt == KVT_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)row + e)));
    if (dt == KVT_DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)row + e))), 16));
    if (dt == KVT_DTYPE_I8)
        return _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)((const int8_t *)row + e)))),
            sv);
    return _mm256_loadu_ps((const float *)row + e);
}

/* The step (U8: channels [e, e + 8) of sc; I8: the planned scales of row
 * srow; else 1) and the minimum (U8: of mn; else 0) cvt8 takes. */
#define SV8(dt, p, srow, c, sc, e) \
    ((dt) == KVT_DTYPE_I8 ? plan_scale(p, srow, c) : (dt) == KVT_DTYPE_U8 ? _mm256_loadu_ps((sc) + (e)) : one)
#define MV8(dt, mn, e) ((dt) == KVT_DTYPE_U8 ? _mm256_loadu_ps((mn) + (e)) : _mm256_setzero_ps())

/* The last, partial chunk: `left` (< 8) elements of row t from e, the rest 0. */
static inline __attribute__((always_inline)) AVX2C __m256 tail8(const kvt_kv_rows *r, int v, size_t t, size_t e,
                                                                 size_t ld, int left)
{
    float b[8] = {0};
    for (int l = 0; l < left; l++)
        b[l] = row_elem(r, v, t, e + (size_t)l, ld);
    return _mm256_loadu_ps(b);
}

static inline __attribute__((always_inline)) AVX2C void scores_dt(const int dt, float *S, const float *q,
                                                                   const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                                                                   float scale, const q8_plan *p)
{
    const size_t es = dt == KVT_DTYPE_I8 || dt == KVT_DTYPE_U8 ? 1 : 2,
                 G = dt == KVT_DTYPE_I8 ? ld / (size_t)r->group_size : 0;
    const int full = hs / 8, left = hs % 8, n = r->n;
    const char *K = r->k;
    __m256 qt = left ? _mm256_maskload_ps(q + 8 * full, tail_mask256(left)) : _mm256_setzero_ps();
    __m256 one = _mm256_set1_ps(1.0f);
    int t = 0;
    for (; t + 4 <= n; t += 4) { /* four keys at a time, as tile256 (4 rows, 1 input) */
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = 0; c < full; c++) {
            __m256 qv = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 4
            for (int a = 0; a < 4; a++) {
                size_t row = (size_t)(t + a), e = off + (size_t)(8 * c);
                __m256 sv = SV8(dt, p, r->k_scale + row * G, c, r->k_scale, e);
                acc[a] = _mm256_fmadd_ps(cvt8(dt, K + row * ld * es, e, sv, MV8(dt, r->k_min, e)), qv, acc[a]);
            }
        }
        if (left)
            for (int a = 0; a < 4; a++)
                acc[a] = _mm256_fmadd_ps(tail8(r, 0, (size_t)(t + a), off + (size_t)(8 * full), ld, left), qt, acc[a]);
        for (int a = 0; a < 4; a++)
            S[t + a] = hsum256(acc[a]);
    }
    for (; t < n; t++) {
        __m256 acc = _mm256_setzero_ps();
        for (int c = 0; c < full; c++) {
            size_t e = off + (size_t)(8 * c);
            __m256 sv = SV8(dt, p, r->k_scale + (size_t)t * G, c, r->k_scale, e);
            acc = _mm256_fmadd_ps(cvt8(dt, K + (size_t)t * ld * es, e, sv, MV8(dt, r->k_min, e)),
                                  _mm256_loadu_ps(q + 8 * c), acc);
        }
        if (left)
            acc = _mm256_fmadd_ps(tail8(r, 0, (size_t)t, off + (size_t)(8 * full), ld, left), qt, acc);
        S[t] = hsum256(acc);
    }
    for (t = 0; t < n; t++)
        S[t] *= scale;
}

static AVX2C void avx2_scores_rows(float *S, const float *q, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                                   float scale)
{
    q8_plan p;
    switch (r->dtype) {
    case KVT_DTYPE_F16: scores_dt(KVT_DTYPE_F16, S, q, r, off, ld, hs, scale, NULL); break;
    case KVT_DTYPE_BF16: scores_dt(KVT_DTYPE_BF16, S, q, r, off, ld, hs, scale, NULL); break;
    case KVT_DTYPE_I8:
        if (hs > 8 * PLAN_CHUNKS) {
            c_scores_rows(S, q, r, off, ld, hs, scale);
            break;
        }
        plan_scales(&p, off, hs, r->group_size);
        scores_dt(KVT_DTYPE_I8, S, q, r, off, ld, hs, scale, &p);
        break;
    case KVT_DTYPE_U8: scores_dt(KVT_DTYPE_U8, S, q, r, off, ld, hs, scale, NULL); break;
    default: avx2_scores(S, q, (const float *)r->k + off, ld, r->n, hs, scale); break;
    }
}

static inline __attribute__((always_inline)) AVX2C void values_dt(const int dt, float *out, const float *S,
                                                                   const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                                                                   int accumulate, const q8_plan *p)
{
    const size_t es = dt == KVT_DTYPE_I8 || dt == KVT_DTYPE_U8 ? 1 : 2,
                 G = dt == KVT_DTYPE_I8 ? ld / (size_t)r->group_size : 0;
    const char *V = r->v;
    __m256 one = _mm256_set1_ps(1.0f);
    for (int i0 = 0; i0 < hs; i0 += 64) { /* 64 output floats (8 registers) at a time, as avx2_values */
        int w = hs - i0 < 64 ? hs - i0 : 64, nv = (w + 7) / 8, left = w % 8;
        __m256i k = tail_mask256(left ? left : 8);
        __m256 acc[8];
        for (int v = 0; v < 8; v++)
            acc[v] = _mm256_setzero_ps();
        if (accumulate)
            for (int v = 0; v < nv; v++)
                acc[v] = v < nv - 1 ? _mm256_loadu_ps(out + i0 + 8 * v) : _mm256_maskload_ps(out + i0 + 8 * v, k);
        for (int t = 0; t < r->n; t++) {
            __m256 a = _mm256_set1_ps(S[t]);
            const char *row = V + (size_t)t * ld * es;
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                if (v >= nv)
                    break;
                size_t e = off + (size_t)(i0 + 8 * v);
                __m256 x;
                if (v == nv - 1 && left)
                    x = tail8(r, 1, (size_t)t, e, ld, left);
                else
                    x = cvt8(dt, row, e, SV8(dt, p, r->v_scale + (size_t)t * G, i0 / 8 + v, r->v_scale, e),
                             MV8(dt, r->v_min, e));
                acc[v] = _mm256_fmadd_ps(a, x, acc[v]);
            }
        }
        for (int v = 0; v < nv; v++) {
            if (v < nv - 1)
                _mm256_storeu_ps(out + i0 + 8 * v, acc[v]);
            else
                _mm256_maskstore_ps(out + i0 + 8 * v, k, acc[v]);
        }
    }
}

static AVX2C void avx2_values_rows(float *out, const float *S, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                                   int accumulate)
{
    q8_plan p;
    switch (r->dtype) {
    case KVT_DTYPE_F16: values_dt(KVT_DTYPE_F16, out, S, r, off, ld, hs, accumulate, NULL); break;
    case KVT_DTYPE_BF16: values_dt(KVT_DTYPE_BF16, out, S, r, off, ld, hs, accumulate, NULL); break;
    case KVT_DTYPE_I8:
        if (hs > 8 * PLAN_CHUNKS) {
            c_values_rows(out, S, r, off, ld, hs, accumulate);
            break;
        }
        plan_scales(&p, off, hs, r->group_size);
        values_dt(KVT_DTYPE_I8, out, S, r, off, ld, hs, accumulate, &p);
        break;
    case KVT_DTYPE_U8: values_dt(KVT_DTYPE_U8, out, S, r, off, ld, hs, accumulate, NULL); break;
    default: avx2_values(out, S, (const float *)r->v + off, ld, r->n, hs, accumulate); break;
    }
}

static inline __attribute__((always_inline)) AVX2C void to_f32_dt(const int dt, float *dst, const kvt_kv_rows *r,
                                                                   int v, size_t off, size_t ld, int hs,
                                                                   const q8_plan *p)
{
    const size_t es = dt == KVT_DTYPE_I8 || dt == KVT_DTYPE_U8 ? 1 : 2,
                 G = dt == KVT_DTYPE_I8 ? ld / (size_t)r->group_size : 0;
    const char *base = v ? r->v : r->k;
    const float *sc = v ? r->v_scale : r->k_scale, *mn = v ? r->v_min : r->k_min;
    const int full = hs / 8, left = hs % 8;
    __m256 one = _mm256_set1_ps(1.0f);
    for (int t = 0; t < r->n; t++) {
        float *d = dst + (size_t)t * (size_t)hs;
        const char *row = base + (size_t)t * ld * es;
        for (int c = 0; c < full; c++) {
            size_t e = off + (size_t)(8 * c);
            _mm256_storeu_ps(d + 8 * c, cvt8(dt, row, e, SV8(dt, p, sc + (size_t)t * G, c, sc, e), MV8(dt, mn, e)));
        }
        for (int l = 0; l < left; l++)
            d[8 * full + l] = row_elem(r, v, (size_t)t, off + (size_t)(8 * full + l), ld);
    }
}

static AVX2C void avx2_rows_to_f32(float *dst, const kvt_kv_rows *r, int v, size_t off, size_t ld, int hs)
{
    q8_plan p;
    switch (r->dtype) {
    case KVT_DTYPE_F16: to_f32_dt(KVT_DTYPE_F16, dst, r, v, off, ld, hs, NULL); break;
    case KVT_DTYPE_BF16: to_f32_dt(KVT_DTYPE_BF16, dst, r, v, off, ld, hs, NULL); break;
    case KVT_DTYPE_I8:
        if (hs > 8 * PLAN_CHUNKS) {
            c_rows_to_f32(dst, r, v, off, ld, hs);
            break;
        }
        plan_scales(&p, off, hs, r->group_size);
        to_f32_dt(KVT_DTYPE_I8, dst, r, v, off, ld, hs, &p);
        break;
    case KVT_DTYPE_U8: to_f32_dt(KVT_DTYPE_U8, dst, r, v, off, ld, hs, NULL); break;
    default: c_rows_to_f32(dst, r, v, off, ld, hs); break;
    }
}

/* ---- AVX-512 (F, BW, VL) over K/V in a storage scheme ----------------------- */

/* Most 16-float chunks of a head the 16-lane I8 kernels plan scales for
 * (hs <= 512, as the 8-lane ones). */
#define PLAN16_CHUNKS 32

/* plan_scales in 16 lanes: the chunk that holds the head's last elements
 * (a partial one) points its lanes past the head at the last element's
 * group, so every lane's scale is a real one. */
typedef struct {
    int32_t g[PLAN16_CHUNKS][16];
    uint8_t uni[PLAN16_CHUNKS];
} q8_plan16;

static void plan_scales16(q8_plan16 *p, size_t off, int hs, int gs)
{
    for (int c = 0; c * 16 < hs; c++) {
        for (int l = 0; l < 16; l++) {
            size_t e = off + (size_t)(c * 16 + l < hs ? c * 16 + l : hs - 1);
            p->g[c][l] = (int32_t)(e / (size_t)gs);
        }
        p->uni[c] = p->g[c][0] == p->g[c][15];
    }
}

static inline __attribute__((always_inline)) AVX512 __m512 plan_scale16(const q8_plan16 *p, const float *srow, int c)
{
    return p->uni[c] ? _mm512_set1_ps(srow[p->g[c][0]])
                     : _mm512_i32gather_ps(_mm512_loadu_si512((const void *)p->g[c]), srow, 4);
}

#define AVX512C __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

/* cvt16's step and minimum, as SV8 / MV8 (masked loads: nothing past the head). */
#define SV16(dt, p, srow, c, sc, e, k) \
    ((dt) == KVT_DTYPE_I8 ? plan_scale16(p, srow, c) : (dt) == KVT_DTYPE_U8 ? _mm512_maskz_loadu_ps(k, (sc) + (e)) : one)
#define MV16(dt, mn, e, k) ((dt) == KVT_DTYPE_U8 ? _mm512_maskz_loadu_ps(k, (mn) + (e)) : _mm512_setzero_ps())

/* Elements [e, e + 16) of a row of dtype dt as floats (I8: times sv); the
 * lanes of k that are off read nothing and give +0 (as the F32 kernels'
 * zero-masked loads do). */
static inline __attribute__((always_inline)) AVX512C __m512 cvt16(const int dt, const void *row, size_t e, __m512 sv,
                                                                   __m512 mv, __mmask16 k)
{
    if (dt == KVT_DTYPE_U8) /* fma(code, step, min); lanes off give +0 */
        return _mm512_maskz_fmadd_ps(k, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, (const uint8_t *)row + e))),
                                     sv, mv);
    if (dt == KVT_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)row + e));
    if (dt == KVT_DTYPE_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)row + e)), 16));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, (const int8_t *)row + e))),
                         sv);
}

/* avx512_scores (tile512 with 4 keys, then 1) on converted keys: per key a
 * 16-lane fma over the chunks, the last one zero-masked, then
 * _mm512_reduce_add_ps, then the scale. */
static inline __attribute__((always_inline)) AVX512C void scores16_dt(const int dt, float *S, const float *q,
                                                                       const kvt_kv_rows *r, size_t off, size_t ld,
                                                                       int hs, float scale, const q8_plan16 *p)
{
    const size_t es = dt == KVT_DTYPE_I8 || dt == KVT_DTYPE_U8 ? 1 : 2,
                 G = dt == KVT_DTYPE_I8 ? ld / (size_t)r->group_size : 0;
    const int nc = (hs + 15) / 16, left = hs % 16, n = r->n;
    const __mmask16 tail = (__mmask16)(left ? (1u << left) - 1 : 0xffffu);
    const char *K = r->k;
    const __m512 one = _mm512_set1_ps(1.0f);
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int c = 0; c < nc; c++) {
            __mmask16 k = c == nc - 1 ? tail : (__mmask16)0xffffu;
            __m512 qv = _mm512_maskz_loadu_ps(k, q + 16 * c);
#pragma GCC unroll 4
            for (int a = 0; a < 4; a++) {
                size_t row = (size_t)(t + a), e = off + (size_t)(16 * c);
                __m512 sv = SV16(dt, p, r->k_scale + row * G, c, r->k_scale, e, k);
                acc[a] = _mm512_fmadd_ps(cvt16(dt, K + row * ld * es, e, sv, MV16(dt, r->k_min, e, k), k), qv, acc[a]);
            }
        }
        for (int a = 0; a < 4; a++)
            S[t + a] = _mm512_reduce_add_ps(acc[a]);
    }
    for (; t < n; t++) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < nc; c++) {
            __mmask16 k = c == nc - 1 ? tail : (__mmask16)0xffffu;
            size_t e = off + (size_t)(16 * c);
            __m512 sv = SV16(dt, p, r->k_scale + (size_t)t * G, c, r->k_scale, e, k);
            acc = _mm512_fmadd_ps(cvt16(dt, K + (size_t)t * ld * es, e, sv, MV16(dt, r->k_min, e, k), k),
                                  _mm512_maskz_loadu_ps(k, q + 16 * c), acc);
        }
        S[t] = _mm512_reduce_add_ps(acc);
    }
    for (t = 0; t < n; t++)
        S[t] *= scale;
}

static AVX512C void avx512_scores_conv(float *S, const float *q, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                                       float scale)
{
    q8_plan16 p;
    switch (r->dtype) {
    case KVT_DTYPE_F16: scores16_dt(KVT_DTYPE_F16, S, q, r, off, ld, hs, scale, NULL); break;
    case KVT_DTYPE_BF16: scores16_dt(KVT_DTYPE_BF16, S, q, r, off, ld, hs, scale, NULL); break;
    case KVT_DTYPE_U8: scores16_dt(KVT_DTYPE_U8, S, q, r, off, ld, hs, scale, NULL); break;
    default:
        if (hs > 16 * PLAN16_CHUNKS) {
            c_scores_rows(S, q, r, off, ld, hs, scale);
            break;
        }
        plan_scales16(&p, off, hs, r->group_size);
        scores16_dt(KVT_DTYPE_I8, S, q, r, off, ld, hs, scale, &p);
        break;
    }
}

/* avx512_values (128 output floats, 8 registers, at a time) on converted
 * values. */
static inline __attribute__((always_inline)) AVX512C void values16_dt(const int dt, float *out, const float *S,
                                                                       const kvt_kv_rows *r, size_t off, size_t ld,
                                                                       int hs, int accumulate, const q8_plan16 *p)
{
    const size_t es = dt == KVT_DTYPE_I8 || dt == KVT_DTYPE_U8 ? 1 : 2,
                 G = dt == KVT_DTYPE_I8 ? ld / (size_t)r->group_size : 0;
    const char *V = r->v;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i0 = 0; i0 < hs; i0 += 128) {
        int w = hs - i0 < 128 ? hs - i0 : 128, nv = (w + 15) / 16;
        __mmask16 last = (__mmask16)(w % 16 ? (1u << (w % 16)) - 1 : 0xffffu);
        __m512 acc[8];
        for (int v = 0; v < 8; v++)
            acc[v] = _mm512_setzero_ps();
        if (accumulate)
            for (int v = 0; v < nv; v++)
                acc[v] = _mm512_maskz_loadu_ps(v < nv - 1 ? (__mmask16)0xffffu : last, out + i0 + 16 * v);
        for (int t = 0; t < r->n; t++) {
            __m512 a = _mm512_set1_ps(S[t]);
            const char *row = V + (size_t)t * ld * es;
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                if (v >= nv)
                    break;
                __mmask16 k = v < nv - 1 ? (__mmask16)0xffffu : last;
                size_t e = off + (size_t)(i0 + 16 * v);
                __m512 sv = SV16(dt, p, r->v_scale + (size_t)t * G, i0 / 16 + v, r->v_scale, e, k);
                acc[v] = _mm512_fmadd_ps(a, cvt16(dt, row, e, sv, MV16(dt, r->v_min, e, k), k), acc[v]);
            }
        }
        for (int v = 0; v < nv; v++)
            _mm512_mask_storeu_ps(out + i0 + 16 * v, v < nv - 1 ? (__mmask16)0xffffu : last, acc[v]);
    }
}

static AVX512C void avx512_values_conv(float *out, const float *S, const kvt_kv_rows *r, size_t off, size_t ld,
                                       int hs, int accumulate)
{
    q8_plan16 p;
    switch (r->dtype) {
    case KVT_DTYPE_F16: values16_dt(KVT_DTYPE_F16, out, S, r, off, ld, hs, accumulate, NULL); break;
    case KVT_DTYPE_BF16: values16_dt(KVT_DTYPE_BF16, out, S, r, off, ld, hs, accumulate, NULL); break;
    case KVT_DTYPE_U8: values16_dt(KVT_DTYPE_U8, out, S, r, off, ld, hs, accumulate, NULL); break;
    default:
        if (hs > 16 * PLAN16_CHUNKS) {
            c_values_rows(out, S, r, off, ld, hs, accumulate);
            break;
        }
        plan_scales16(&p, off, hs, r->group_size);
        values16_dt(KVT_DTYPE_I8, out, S, r, off, ld, hs, accumulate, &p);
        break;
    }
}

static inline __attribute__((always_inline)) AVX512C void to_f32_16_dt(const int dt, float *dst, const kvt_kv_rows *r,
                                                                        int v, size_t off, size_t ld, int hs,
                                                                        const q8_plan16 *p)
{
    const size_t es = dt == KVT_DTYPE_I8 || dt == KVT_DTYPE_U8 ? 1 : 2,
                 G = dt == KVT_DTYPE_I8 ? ld / (size_t)r->group_size : 0;
    const char *base = v ? r->v : r->k;
    const float *sc = v ? r->v_scale : r->k_scale, *mn = v ? r->v_min : r->k_min;
    const int nc = (hs + 15) / 16, left = hs % 16;
    const __mmask16 tail = (__mmask16)(left ? (1u << left) - 1 : 0xffffu);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int t = 0; t < r->n; t++) {
        float *d = dst + (size_t)t * (size_t)hs;
        const char *row = base + (size_t)t * ld * es;
        for (int c = 0; c < nc; c++) {
            __mmask16 k = c == nc - 1 ? tail : (__mmask16)0xffffu;
            size_t e = off + (size_t)(16 * c);
            __m512 sv = SV16(dt, p, sc + (size_t)t * G, c, sc, e, k);
            _mm512_mask_storeu_ps(d + 16 * c, k, cvt16(dt, row, e, sv, MV16(dt, mn, e, k), k));
        }
    }
}

static AVX512C void avx512_rows_to_f32_conv(float *dst, const kvt_kv_rows *r, int v, size_t off, size_t ld, int hs)
{
    q8_plan16 p;
    switch (r->dtype) {
    case KVT_DTYPE_F16: to_f32_16_dt(KVT_DTYPE_F16, dst, r, v, off, ld, hs, NULL); break;
    case KVT_DTYPE_BF16: to_f32_16_dt(KVT_DTYPE_BF16, dst, r, v, off, ld, hs, NULL); break;
    case KVT_DTYPE_U8: to_f32_16_dt(KVT_DTYPE_U8, dst, r, v, off, ld, hs, NULL); break;
    default:
        if (hs > 16 * PLAN16_CHUNKS) {
            c_rows_to_f32(dst, r, v, off, ld, hs);
            break;
        }
        plan_scales16(&p, off, hs, r->group_size);
        to_f32_16_dt(KVT_DTYPE_I8, dst, r, v, off, ld, hs, &p);
        break;
    }
}

/* The AVX-512 set over K/V of any dtype: F32 rows through its own 16-lane
 * kernels, the other dtypes through the 16-lane conversion kernels above
 * (bit for bit what the F32 kernels give on the converted rows). */
static AVX512C void avx512_scores_rows(float *S, const float *q, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                                       float scale)
{
    if (r->dtype == KVT_DTYPE_F32)
        avx512_scores(S, q, (const float *)r->k + off, ld, r->n, hs, scale);
    else
        avx512_scores_conv(S, q, r, off, ld, hs, scale);
}

static AVX512C void avx512_values_rows(float *out, const float *S, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                                       int accumulate)
{
    if (r->dtype == KVT_DTYPE_F32)
        avx512_values(out, S, (const float *)r->v + off, ld, r->n, hs, accumulate);
    else
        avx512_values_conv(out, S, r, off, ld, hs, accumulate);
}

static AVX512C void avx512_rows_to_f32(float *dst, const kvt_kv_rows *r, int v, size_t off, size_t ld, int hs)
{
    if (r->dtype == KVT_DTYPE_F32)
        c_rows_to_f32(dst, r, v, off, ld, hs);
    else
        avx512_rows_to_f32_conv(dst, r, v, off, ld, hs);
}

#endif /* KVT__X86 */

/* ---- dispatch ------------------------------------------------------------------ */

typedef struct {
    const char *name;
    void (*matmul)(float *, size_t, const float *, int, const float *, int, int, int);
    void (*scores)(float *, const float *, const float *, size_t, int, int, float);
    void (*softmax)(float *, int);
    void (*values)(float *, const float *, const float *, size_t, int, int, int);
    void (*silu_mul)(float *, const float *, size_t);
    void (*scores_rows)(float *, const float *, const kvt_kv_rows *, size_t, size_t, int, float);
    void (*values_rows)(float *, const float *, const kvt_kv_rows *, size_t, size_t, int, int);
    void (*rows_to_f32)(float *, const kvt_kv_rows *, int, size_t, size_t, int);
} kernel_set;

static const kernel_set k_sets[] = {
#ifdef KVT__X86
    {"avx512", avx512_matmul, avx512_scores, avx512_softmax, avx512_values, avx512_silu_mul, avx512_scores_rows,
     avx512_values_rows, avx512_rows_to_f32},
    {"avx2", avx2_matmul, avx2_scores, avx2_softmax, avx2_values, avx2_silu_mul, avx2_scores_rows, avx2_values_rows,
     avx2_rows_to_f32},
#endif
    {"c", c_matmul, c_scores, c_softmax, c_values, c_silu_mul, c_scores_rows, c_values_rows, c_rows_to_f32},
};

static const kernel_set *g_set;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#ifdef KVT__X86
/* F16C from CPUID leaf 1 (ECX bit 29): the conversion kernels of both AVX
 * sets use it. */
static int cpu_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

static int cpu_has(const char *name)
{
#ifdef KVT__X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_f16c();
    if (!strcmp(name, "avx512")) /* BW and VL: the conversion kernels' masked 8- and 16-bit loads */
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && avx2;
    if (!strcmp(name, "avx2"))
        return avx2;
#endif
    return !strcmp(name, "c");
}

static void pick_best(void)
{
    for (size_t i = 0; i < sizeof k_sets / sizeof k_sets[0]; i++)
        if (cpu_has(k_sets[i].name)) {
            g_set = &k_sets[i];
            return;
        }
}

static const kernel_set *set(void)
{
    pthread_once(&g_once, pick_best);
    return g_set;
}

void kvt__matmul_rows(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0, int r1)
{
    set()->matmul(out, ldo, x, n, W, n_in, r0, r1);
}

void kvt__attn_scores(float *S, const float *q, const float *K, size_t ldk, int n, int hs, float scale)
{
    set()->scores(S, q, K, ldk, n, hs, scale);
}

void kvt__softmax(float *x, int n) { set()->softmax(x, n); }

void kvt__attn_values(float *out, const float *S, const float *V, size_t ldv, int n, int hs, int accumulate)
{
    set()->values(out, S, V, ldv, n, hs, accumulate);
}

void kvt__silu_mul(float *h, const float *g, size_t n) { set()->silu_mul(h, g, n); }

void kvt__attn_scores_rows(float *S, const float *q, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                           float scale)
{
    if (r->dtype == KVT_DTYPE_F32)
        set()->scores(S, q, (const float *)r->k + off, ld, r->n, hs, scale);
    else
        set()->scores_rows(S, q, r, off, ld, hs, scale);
}

void kvt__attn_values_rows(float *out, const float *S, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                           int accumulate)
{
    if (r->dtype == KVT_DTYPE_F32)
        set()->values(out, S, (const float *)r->v + off, ld, r->n, hs, accumulate);
    else
        set()->values_rows(out, S, r, off, ld, hs, accumulate);
}

void kvt__rows_to_f32(float *dst, const kvt_kv_rows *r, int v, size_t off, size_t ld, int hs)
{
    set()->rows_to_f32(dst, r, v, off, ld, hs);
}

const char *kvt__kernels_isa(void) { return set()->name; }

float kvt__round_ref(kvt_dtype dt, float x)
{
    const int p = dt == KVT_DTYPE_F16 ? 11 : 8, emin = dt == KVT_DTYPE_F16 ? -14 : -126;
    const double max = dt == KVT_DTYPE_F16 ? 65504.0 : 0x1.fep127;
    if (isnan(x) || isinf(x) || x == 0.0f)
        return x;
    double ax = fabs((double)x);
    int e = ilogb(ax);
    double q = ldexp(1.0, (e < emin ? emin : e) - (p - 1));
    double r = nearbyint(ax / q) * q;
    return (float)copysign(r > max ? INFINITY : r, (double)x);
}

int kvt__kernels_select(const char *isa)
{
    set();
    for (size_t i = 0; i < sizeof k_sets / sizeof k_sets[0]; i++)
        if (isa && !strcmp(k_sets[i].name, isa) && cpu_has(isa)) {
            g_set = &k_sets[i];
            return 0;
        }
    return -1;
}
