/*
 * test_kernels.c: the decode path's vector kernels (engine/kernels.h), under
 * every kernel set the CPU has: the matrix product against a double
 * reference for every tail length, and each output element bit-identical
 * whatever rows it is computed with (the summation-order rule); scores,
 * softmax (vectorised exp) and silu against double references, silu finite
 * at +-90; the weighted sum of values split over segments equal bit for bit
 * to one call. Attention over K/V stored as F16, BF16, I8 and U8 (kvt_kv_rows,
 * from real kv, qkv and qkvc caches): scores, values and the conversion for
 * prefill equal bit for bit the F32 kernels over the converted rows, for
 * every head size tail (16- and 8-lane), head offset and group size, each
 * set against its own F32 kernels (an I8 head wider than 512 against the C
 * set). Random inputs: the seed is printed (KVT_TEST_SEED).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_seed.h"

#include "kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t g_seed;
static const char *k_sets[] = {"c", "avx2", "avx512"};

static float frand(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *rand_floats(size_t n, uint64_t *s)
{
    float *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = frand(s);
    return v;
}

/* Every input-row count a tile shape can leave over (1, 3, 7, 8, 9, 17 ...
 * rows against tiles of 4 and 2 inputs) and row counts with remainders of
 * the 4-row tiles and tiles ahead to prefetch (5, 37 rows): each input row's
 * outputs have the bits that row gives alone, whatever rows come with it and
 * wherever a row range starts. */
static void matmul_tiles(int n_in, uint64_t *s)
{
    static const int ns[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 17};
    static const int outs[] = {5, 37};
    for (size_t o = 0; o < sizeof outs / sizeof outs[0]; o++) {
        int n_out = outs[o], nmax = ns[sizeof ns / sizeof ns[0] - 1];
        float *W = rand_floats((size_t)n_out * n_in, s), *x = rand_floats((size_t)nmax * n_in, s);
        float *alone = malloc(sizeof(float) * (size_t)nmax * n_out), *all = malloc(sizeof(float) * (size_t)nmax * n_out);
        for (int i = 0; i < nmax; i++)
            kvt__matmul_rows(alone + (size_t)i * n_out, (size_t)n_out, x + (size_t)i * n_in, 1, W, n_in, 0, n_out);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            int n = ns[k];
            for (int first = 0; first + n <= nmax; first += nmax - n > 0 ? nmax - n : 1) {
                memset(all, 0xff, sizeof(float) * (size_t)n * n_out);
                int cut = n_out > 8 ? 8 : n_out; /* a row range that starts at a part's boundary */
                kvt__matmul_rows(all, (size_t)n_out, x + (size_t)first * n_in, n, W, n_in, 0, cut);
                kvt__matmul_rows(all, (size_t)n_out, x + (size_t)first * n_in, n, W, n_in, cut, n_out);
                for (int i = 0; i < n; i++)
                    if (memcmp(all + (size_t)i * n_out, alone + (size_t)(first + i) * n_out,
                               sizeof(float) * (size_t)n_out) != 0)
                        fail_msg("[%s] n_in %d n_out %d: input row %d of %d (from %d) differs from it alone",
                                 kvt__kernels_isa(), n_in, n_out, i, n, first);
                if (first + n == nmax)
                    break;
            }
        }
        free(W), free(x), free(alone), free(all);
    }
}

static void test_matmul(void **state)
{
    (void)state;
    char best[16];
    snprintf(best, sizeof best, "%s", kvt__kernels_isa());
    for (size_t k = 0; k < 3; k++) {
        if (kvt__kernels_select(k_sets[k]) != 0)
            continue;
        uint64_t s = g_seed | 1;
        for (int n_in = 1; n_in <= 70; n_in += 3) { /* every tail of 8 and 16 lanes */
            int n_out = 13, n = 9;
            matmul_tiles(n_in, &s);
            float *W = rand_floats((size_t)n_out * n_in, &s), *x = rand_floats((size_t)n * n_in, &s);
            float *all = malloc(sizeof(float) * n * n_out), *one = malloc(sizeof(float) * n_out);
            kvt__matmul_rows(all, n_out, x, n, W, n_in, 0, n_out);
            for (int i = 0; i < n; i++) {
                for (int r = 0; r < n_out; r++) {
                    double ref = 0, mag = 0;
                    for (int j = 0; j < n_in; j++)
                        ref += (double)W[r * n_in + j] * x[i * n_in + j], mag += fabs(W[r * n_in + j] * x[i * n_in + j]);
                    assert_true(fabs(all[i * n_out + r] - ref) <= 1e-6 * (mag + 1e-30) + 1e-30);
                }
                /* row i alone, and rows split at an odd place: the same bits */
                kvt__matmul_rows(one, n_out, x + (size_t)i * n_in, 1, W, n_in, 0, 5);
                kvt__matmul_rows(one, n_out, x + (size_t)i * n_in, 1, W, n_in, 5, n_out);
                assert_memory_equal(one, all + (size_t)i * n_out, sizeof(float) * n_out);
            }
            free(W), free(x), free(all), free(one);
        }
        print_message("  [%s] matmul: matches double, batch-invariant\n", k_sets[k]);
    }
    assert_int_equal(kvt__kernels_select(best), 0);
}

static void test_attention_pieces(void **state)
{
    (void)state;
    char best[16];
    snprintf(best, sizeof best, "%s", kvt__kernels_isa());
    for (size_t k = 0; k < 3; k++) {
        if (kvt__kernels_select(k_sets[k]) != 0)
            continue;
        uint64_t s = g_seed ^ 0x9e3779b97f4a7c15ULL;
        int hs_list[] = {1, 8, 13, 16, 64, 130};
        for (size_t h = 0; h < sizeof hs_list / sizeof hs_list[0]; h++) {
            int hs = hs_list[h], n = 77, ld = hs + 3;
            float *q = rand_floats((size_t)hs, &s), *K = rand_floats((size_t)n * ld, &s), *V = rand_floats((size_t)n * ld, &s);
            float S[77], P[77];
            kvt__attn_scores(S, q, K, (size_t)ld, n, hs, 0.5f);
            for (int t = 0; t < n; t++) {
                double ref = 0;
                for (int i = 0; i < hs; i++)
                    ref += (double)q[i] * K[t * ld + i];
                assert_true(fabs(S[t] - 0.5 * ref) <= 1e-6 * hs);
                S[t] *= 8.0f; /* a spread that makes exp work */
            }
            memcpy(P, S, sizeof S);
            kvt__softmax(P, n);
            double mx = S[0], sum = 0;
            for (int t = 1; t < n; t++)
                mx = fmax(mx, S[t]);
            for (int t = 0; t < n; t++)
                sum += exp((double)S[t] - mx);
            for (int t = 0; t < n; t++) {
                double ref = exp((double)S[t] - mx) / sum;
                if (!(fabs(P[t] - ref) <= 1e-5 * ref + 1e-30)) /* x - max is rounded to float */
                    fail_msg("[%s] hs %d softmax[%d] = %.9g, double %.9g", k_sets[k], hs, t, P[t], ref);
            }
            /* values: one call == split over three segments, bit for bit */
            float *a = malloc(sizeof(float) * hs), *b = malloc(sizeof(float) * hs);
            kvt__attn_values(a, P, V, (size_t)ld, n, hs, 0);
            kvt__attn_values(b, P, V, (size_t)ld, 10, hs, 0);
            kvt__attn_values(b, P + 10, V + 10 * ld, (size_t)ld, 1, hs, 1);
            kvt__attn_values(b, P + 11, V + 11 * ld, (size_t)ld, n - 11, hs, 1);
            assert_memory_equal(a, b, sizeof(float) * hs);
            for (int i = 0; i < hs; i++) {
                double ref = 0;
                for (int t = 0; t < n; t++)
                    ref += (double)P[t] * V[t * ld + i];
                assert_true(fabs(a[i] - ref) <= 1e-6);
            }
            free(q), free(K), free(V), free(a), free(b);
        }
        /* silu(h) * g over every tail, against double; -90 and 90 stay finite */
        float h[41], g[41], o[41];
        for (int i = 0; i < 41; i++)
            h[i] = (float)(i - 20) * 0.9f, g[i] = frand(&s);
        h[0] = -90.0f, h[40] = 90.0f;
        for (size_t n = 1; n <= 41; n++) {
            memcpy(o, h, sizeof h);
            kvt__silu_mul(o, g, n);
            for (size_t i = 0; i < n; i++) {
                double ref = (double)h[i] / (1.0 + exp(-(double)h[i])) * g[i];
                assert_true(isfinite(o[i]));
                assert_true(fabs(o[i] - ref) <= 1e-6 * fabs(ref) + 1e-30);
            }
        }
        print_message("  [%s] scores, softmax, values, silu: match double; split values bit-identical\n", k_sets[k]);
    }
    assert_int_equal(kvt__kernels_select(best), 0);
}

/* Rows of n tokens, ld elements each, stored in a cache of dtype dt (I8: a
 * qkv cache with group gs): *rows borrows the cache (*c, caller destroys),
 * deq (n, ld) receives what each element reads as. */
static void stored_rows(kvt_dtype dt, int n, int ld, int gs, uint64_t *s, kvt_cache **c, kvt_kv_rows *rows,
                        float *deq_k, float *deq_v)
{
    /* U8: one more row, so the first block of n is sealed */
    float *k = rand_floats((size_t)(n + 1) * ld, s), *v = rand_floats((size_t)(n + 1) * ld, s);
    for (int i = 0; i < n * ld; i += 7)
        k[i] *= 40.0f, v[i] *= 1e-3f; /* uneven magnitudes within a group */
    if (dt == KVT_DTYPE_I8)
        assert_int_equal(kvt_qkv_create(ld, gs, n, c), 0);
    else if (dt == KVT_DTYPE_U8)
        assert_int_equal(kvt_qkvc_create(ld, n, c), 0);
    else
        assert_int_equal(kvt_kv_create_dtype(ld, n, dt, c), 0);
    const void *in[2] = {k, v};
    assert_int_equal(kvt_cache_append(*c, n + (dt == KVT_DTYPE_U8), in), 0);
    assert_int_equal(kvt_kv_block_rows(*c, 0, rows), 0);
    assert_int_equal(rows->n, n);
    assert_int_equal(rows->dtype, dt);
    if (dt == KVT_DTYPE_I8) {
        assert_int_equal(kvt_qkv_read_block(*c, 0, deq_k, deq_v, NULL), 0);
    } else if (dt == KVT_DTYPE_U8) { /* per channel: fmaf(code, step, min) */
        for (int t = 0; t < n; t++)
            for (int i = 0; i < ld; i++) {
                size_t e = (size_t)t * ld + (size_t)i;
                deq_k[e] = fmaf((float)((const uint8_t *)rows->k)[e], rows->k_scale[i], rows->k_min[i]);
                deq_v[e] = fmaf((float)((const uint8_t *)rows->v)[e], rows->v_scale[i], rows->v_min[i]);
            }
    } else {
        assert_int_equal(kvt_dtype_to_f32(dt, rows->k, deq_k, (size_t)n * ld), 0);
        assert_int_equal(kvt_dtype_to_f32(dt, rows->v, deq_v, (size_t)n * ld), 0);
    }
    free(k), free(v);
}

static void test_rows_kernels(void **state)
{
    (void)state;
    char best[16];
    snprintf(best, sizeof best, "%s", kvt__kernels_isa());
    static const kvt_dtype dts[] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_I8, KVT_DTYPE_U8};
    static const int hs_list[] = {8, 13, 16, 24, 64, 130, 200, 520};
    static const int gs_list[] = {8, 4, 32, 2, 16};
    int checked = 0;
    for (size_t k = 0; k < 3; k++) {
        if (kvt__kernels_select(k_sets[k]) != 0)
            continue;
        uint64_t s = g_seed ^ 0x5851f42d4c957f2dULL;
        for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++)
            for (size_t h = 0; h < sizeof hs_list / sizeof hs_list[0]; h++)
                for (size_t g = 0; g < (dts[d] == KVT_DTYPE_I8 ? sizeof gs_list / sizeof gs_list[0] : 1u); g++) {
                    int hs = hs_list[h], gs = gs_list[g], n = 37, ld = 2 * hs + 2 * gs * 8;
                    if (dts[d] == KVT_DTYPE_I8 && ld % gs)
                        continue;
                    /* the reference set: the one whose F32 kernels these equal */
                    const char *ref = k_sets[k];
                    if (dts[d] == KVT_DTYPE_I8 && hs > 512)
                        ref = "c";
                    float *dk = malloc(sizeof(float) * (size_t)n * ld), *dv = malloc(sizeof(float) * (size_t)n * ld);
                    float *q = rand_floats((size_t)hs, &s), S[37], R[37], P[37];
                    float *a = malloc(sizeof(float) * hs), *b = malloc(sizeof(float) * hs);
                    float *conv = malloc(sizeof(float) * (size_t)n * hs);
                    kvt_cache *c = NULL;
                    kvt_kv_rows rows;
                    stored_rows(dts[d], n, ld, gs, &s, &c, &rows, dk, dv);
                    for (size_t off = 0; off <= (size_t)hs; off += (size_t)hs) { /* two heads */
                        assert_int_equal(kvt__kernels_select(k_sets[k]), 0);
                        kvt__attn_scores_rows(S, q, &rows, off, (size_t)ld, hs, 0.25f);
                        for (int t = 0; t < n; t++)
                            P[t] = 1.0f / (float)(t + 1);
                        kvt__attn_values_rows(a, P, &rows, off, (size_t)ld, hs, 0);
                        kvt_kv_rows head = rows, tail = rows; /* values split in two, accumulated */
                        head.n = 11;
                        tail.n = n - 11;
                        tail.v = (const char *)rows.v + (size_t)11 * ld * kvt_dtype_size(rows.dtype);
                        if (rows.dtype == KVT_DTYPE_I8) /* U8's steps and minima are per channel */
                            tail.v_scale = rows.v_scale + (size_t)11 * (ld / gs);
                        kvt__attn_values_rows(b, P, &head, off, (size_t)ld, hs, 0);
                        kvt__attn_values_rows(b, P + 11, &tail, off, (size_t)ld, hs, 1);
                        assert_memory_equal(a, b, sizeof(float) * hs);
                        for (int v = 0; v < 2; v++) {
                            kvt__rows_to_f32(conv, &rows, v, off, (size_t)ld, hs);
                            for (int t = 0; t < n; t++)
                                assert_memory_equal(conv + (size_t)t * hs, (v ? dv : dk) + (size_t)t * ld + off,
                                                    sizeof(float) * hs);
                        }
                        assert_int_equal(kvt__kernels_select(ref), 0);
                        kvt__attn_scores(R, q, dk + off, (size_t)ld, n, hs, 0.25f);
                        kvt__attn_values(b, P, dv + off, (size_t)ld, n, hs, 0);
                        if (memcmp(S, R, sizeof(float) * n) || memcmp(a, b, sizeof(float) * hs))
                            fail_msg("[%s] %s hs %d gs %d off %zu: differs from %s's F32 kernels on the converted rows",
                                     k_sets[k], kvt_dtype_name(dts[d]), hs, gs, off, ref);
                        checked++;
                    }
                    kvt_cache_destroy(c);
                    free(dk), free(dv), free(q), free(a), free(b), free(conv);
                }
        print_message("  [%s] F16/BF16/I8/U8 scores, values, conversion: bit-identical to F32 on converted rows\n",
                      k_sets[k]);
    }
    assert_true(checked > 0);
    assert_int_equal(kvt__kernels_select(best), 0);
}

static void test_select(void **state)
{
    (void)state;
    assert_int_equal(kvt__kernels_select("nope"), -1);
    assert_int_equal(kvt__kernels_select(NULL), -1);
    assert_int_equal(kvt__kernels_select("c"), 0);
    assert_string_equal(kvt__kernels_isa(), "c");
}

int main(void)
{
    g_seed = test_seed("test_kernels");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_rows_kernels),
        cmocka_unit_test(test_attention_pieces),
        cmocka_unit_test(test_select),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
