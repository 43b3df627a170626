/*
 * kernels.c: the decode path's vector kernels (kernels.h states the
 * summation-order rule they keep). Three sets: AVX-512 (16 lanes), AVX2+FMA
 * (8 lanes), plain C (8 lanes, multiply then add); the best one the CPU has
 * is picked once per process, so every forward pass of a process sums in the
 * same order. The AVX sets are compiled with target attributes and called
 * only after the CPU reported the feature, so the build needs no -march.
 * This file owns no memory and no state beyond the chosen set.
 */
#include "kernels.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVT__X86 1
#include <immintrin.h>
#endif

/* Rows of W per tile: a tile (4 rows, n_in floats) stays in L1/L2 while
 * every input row passes over it. */
#define TILE_ROWS 4

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

static void c_axpy(float *y, float a, const float *x, int n)
{
    for (int j = 0; j < n; j++)
        y[j] += a * x[j];
}

#ifdef KVT__X86

/* ---- AVX-512 (16 lanes) ------------------------------------------------------ */

#define AVX512 __attribute__((target("avx512f,fma")))

/* A tile of R rows x S inputs: R * S accumulators held in registers. */
static inline __attribute__((always_inline)) AVX512 void tile512(float *out, size_t ldo, const float *x, int n_in,
                                                                  const float *W, int r, const int R, const int S)
{
    __m512 acc[TILE_ROWS][4];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int b = 0; b < S; b++)
            acc[a][b] = _mm512_setzero_ps();
    const float *w0 = W + (size_t)r * n_in;
    int j = 0;
    for (; j + 16 <= n_in; j += 16) {
        __m512 xv[4];
#pragma GCC unroll 4
        for (int b = 0; b < S; b++)
            xv[b] = _mm512_loadu_ps(x + (size_t)b * n_in + j);
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            __m512 wv = _mm512_loadu_ps(w0 + (size_t)a * n_in + j);
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
            __m512 wv = _mm512_maskz_loadu_ps(k, w0 + (size_t)a * n_in + j);
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

static AVX512 void avx512_matmul(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0,
                                 int r1)
{
    int r = r0;
    for (; r + TILE_ROWS <= r1; r += TILE_ROWS) {
        int i = 0;
        for (; i + 4 <= n; i += 4)
            tile512(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 4, 4);
        for (; i + 2 <= n; i += 2)
            tile512(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 4, 2);
        for (; i < n; i++)
            tile512(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 4, 1);
    }
    for (; r < r1; r++) {
        int i = 0;
        for (; i + 4 <= n; i += 4)
            tile512(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 1, 4);
        for (; i < n; i++)
            tile512(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 1, 1);
    }
}

static AVX512 float avx512_dot(const float *a, const float *b, int n)
{
    float out;
    tile512(&out, 1, b, n, a, 0, 1, 1);
    return out;
}

static AVX512 void avx512_axpy(float *y, float a, const float *x, int n)
{
    __m512 av = _mm512_set1_ps(a);
    int j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(y + j, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + j), _mm512_loadu_ps(y + j)));
    if (j < n) {
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(y + j, k,
                              _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(k, x + j), _mm512_maskz_loadu_ps(k, y + j)));
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

static inline __attribute__((always_inline)) AVX2 void tile256(float *out, size_t ldo, const float *x, int n_in,
                                                                const float *W, int r, const int R, const int S)
{
    __m256 acc[TILE_ROWS][2];
#pragma GCC unroll 4
    for (int a = 0; a < R; a++)
#pragma GCC unroll 2
        for (int b = 0; b < S; b++)
            acc[a][b] = _mm256_setzero_ps();
    const float *w0 = W + (size_t)r * n_in;
    int j = 0;
    for (; j + 8 <= n_in; j += 8) {
        __m256 xv[2];
#pragma GCC unroll 2
        for (int b = 0; b < S; b++)
            xv[b] = _mm256_loadu_ps(x + (size_t)b * n_in + j);
#pragma GCC unroll 4
        for (int a = 0; a < R; a++) {
            __m256 wv = _mm256_loadu_ps(w0 + (size_t)a * n_in + j);
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
            __m256 wv = _mm256_maskload_ps(w0 + (size_t)a * n_in + j, k);
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

static AVX2 void avx2_matmul(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0, int r1)
{
    int r = r0;
    for (; r + TILE_ROWS <= r1; r += TILE_ROWS) {
        int i = 0;
        for (; i + 2 <= n; i += 2)
            tile256(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 4, 2);
        for (; i < n; i++)
            tile256(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 4, 1);
    }
    for (; r < r1; r++)
        for (int i = 0; i < n; i++)
            tile256(out + (size_t)i * ldo, ldo, x + (size_t)i * n_in, n_in, W, r, 1, 1);
}

static AVX2 float avx2_dot(const float *a, const float *b, int n)
{
    float out;
    tile256(&out, 1, b, n, a, 0, 1, 1);
    return out;
}

static AVX2 void avx2_axpy(float *y, float a, const float *x, int n)
{
    __m256 av = _mm256_set1_ps(a);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(y + j, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
    if (j < n) {
        __m256i k = tail_mask256(n - j);
        _mm256_maskstore_ps(y + j, k, _mm256_fmadd_ps(av, _mm256_maskload_ps(x + j, k), _mm256_maskload_ps(y + j, k)));
    }
}

#endif /* KVT__X86 */

/* ---- dispatch ------------------------------------------------------------------ */

typedef struct {
    const char *name;
    void (*matmul)(float *, size_t, const float *, int, const float *, int, int, int);
    float (*dot)(const float *, const float *, int);
    void (*axpy)(float *, float, const float *, int);
} kernel_set;

static const kernel_set k_sets[] = {
#ifdef KVT__X86
    {"avx512", avx512_matmul, avx512_dot, avx512_axpy},
    {"avx2", avx2_matmul, avx2_dot, avx2_axpy},
#endif
    {"c", c_matmul, c_dot_lanes, c_axpy},
};

static const kernel_set *g_set;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int cpu_has(const char *name)
{
#ifdef KVT__X86
    __builtin_cpu_init();
    if (!strcmp(name, "avx512"))
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    if (!strcmp(name, "avx2"))
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

float kvt__dot(const float *a, const float *b, int n) { return set()->dot(a, b, n); }

void kvt__axpy(float *y, float a, const float *x, int n) { set()->axpy(y, a, x, n); }

const char *kvt__kernels_isa(void) { return set()->name; }

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
