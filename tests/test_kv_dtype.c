/*
 * test_kv_dtype.c: KV storage schemes in the cache kinds and the engine's
 * caches (kvtier/cache.h, engine/model.h):
 *  - f32 <-> f16 / bf16 conversion: every one of the 65536 values of each
 *    comes back unchanged; ties round to even; overflow, subnormals, -0 and
 *    NaN; other dtypes refused;
 *  - f32 -> f16 / bf16 against an independent reference (kvt__round_ref,
 *    engine/kernels.h: the nearest multiple of the value's quantum in
 *    double, ties to even by nearbyint): every f16/bf16 value's neighbourhood (its own bits, the
 *    ties halfway to each neighbour and the floats next to them) and random
 *    floats; a NaN keeps its sign and stays a NaN, infinities stay;
 *  - kv caches of F16 and BF16: what append stores is the rounded input,
 *    clones share and copy on write, trims, the encoded params and tensor
 *    dtypes, decode round trips and refuses a dtype that does not match;
 *  - rotating rings of F16, BF16 and I8 (wrapping, with sinks): slot values,
 *    encode / decode (zero-copy for I8 when the tensors are the ring),
 *    refused mismatches, the F32-only views refuse other schemes;
 *  - the engine: the caches kvt_model_new_caches makes per scheme (kinds,
 *    dtypes), KV bytes per token (f16 and bf16 half of f32, q8 a quarter plus
 *    scales), and the SSD tier's config fingerprint differing per scheme.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/cache.h"
#include "kvtier/store.h"
#include "kernels.h"
#include "model.h"
#include "test_rng.h"
#include "test_seed.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static float bits_f(uint32_t x)
{
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static uint16_t to16(kvt_dtype dt, float f)
{
    uint16_t h;
    assert_int_equal(kvt_dtype_from_f32(dt, &f, &h, 1), 0);
    return h;
}

/* One float through kvt_dtype_from_f32 and back, checked against kvt__round_ref. */
static void check_round(kvt_dtype dt, uint32_t bits)
{
    float x = bits_f(bits), got;
    uint16_t h = to16(dt, x);
    assert_int_equal(kvt_dtype_to_f32(dt, &h, &got, 1), 0);
    if (isnan(x)) { /* a NaN stays a NaN of the same sign */
        if (!isnan(got) || signbit(got) != signbit(x))
            fail_msg("%s: NaN 0x%08x -> 0x%04x", kvt_dtype_name(dt), (unsigned)bits, (unsigned)h);
        return;
    }
    float want = kvt__round_ref(dt, x);
    uint32_t gb, wb;
    memcpy(&gb, &got, sizeof gb);
    memcpy(&wb, &want, sizeof wb);
    if (gb != wb)
        fail_msg("%s: %a (0x%08x) -> %a, the nearest (ties to even) is %a", kvt_dtype_name(dt), (double)x,
                 (unsigned)bits, (double)got, (double)want);
}

static void test_round_reference(void **state)
{
    (void)state;
    /* bf16: the high half of a float is a bf16 value; the low halves at and
     * around 0 (the value), 0x8000 (halfway to the next), 0xffff (next to it) */
    static const uint32_t low[] = {0x0000, 0x0001, 0x0002, 0x3fff, 0x7ffe, 0x7fff, 0x8000,
                                   0x8001, 0x8002, 0xbfff, 0xfffe, 0xffff};
    for (uint32_t hi = 0; hi < 65536; hi++)
        for (size_t i = 0; i < sizeof low / sizeof *low; i++)
            check_round(KVT_DTYPE_BF16, hi << 16 | low[i]);
    /* f16: every f16 value as a float, and the floats around the ties
     * halfway to its neighbours (the float's 13 dropped bits, or more below
     * 2^-14) */
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f;
        assert_int_equal(kvt_dtype_to_f32(KVT_DTYPE_F16, &h, &f, 1), 0);
        uint16_t n = (uint16_t)(i + 1);
        float g;
        assert_int_equal(kvt_dtype_to_f32(KVT_DTYPE_F16, &n, &g, 1), 0);
        if (isnan(f) || isinf(f) || isnan(g) || (i & 0x7fff) == 0x7fff)
            continue;
        if (isinf(g)) /* past the largest finite: the tie is 65520 */
            g = copysignf(65536.0f, f);
        float mid = (float)(((double)f + (double)g) / 2); /* exact: one more bit than f16 */
        uint32_t mb, fb;
        memcpy(&mb, &mid, sizeof mb);
        memcpy(&fb, &f, sizeof fb);
        for (int d = -2; d <= 2; d++) {
            check_round(KVT_DTYPE_F16, mb + (uint32_t)d);
            check_round(KVT_DTYPE_F16, fb + (uint32_t)d);
        }
    }
    /* random floats over every exponent (the test's seed, printed) */
    uint64_t s = test_seed("test_kv_dtype");
    for (int i = 0; i < 1 << 20; i++) {
        uint64_t z = rng_next(&s);
        check_round(KVT_DTYPE_BF16, (uint32_t)z);
        check_round(KVT_DTYPE_F16, (uint32_t)(z >> 32));
    }
    /* infinities stay; NaN payloads: quiet, sign kept */
    assert_int_equal(to16(KVT_DTYPE_BF16, INFINITY), 0x7f80);
    assert_int_equal(to16(KVT_DTYPE_BF16, -INFINITY), 0xff80);
    assert_int_equal(to16(KVT_DTYPE_BF16, bits_f(0xff800001u)) & 0x8000, 0x8000);
    assert_int_equal(to16(KVT_DTYPE_BF16, bits_f(0x7fc00000u)), 0x7fc0);
    /* the reference itself: ties to even on both sides of a bf16 value */
    assert_true(kvt__round_ref(KVT_DTYPE_BF16, 1.0f + 0x1p-8f) == 1.0f);
    assert_true(kvt__round_ref(KVT_DTYPE_BF16, 1.0f + 3 * 0x1p-8f) == 1.0f + 4 * 0x1p-8f);
    assert_true(kvt__round_ref(KVT_DTYPE_BF16, 0x1.ffp127f) == INFINITY); /* halfway past the largest: to even, 2^128 */
    assert_true(kvt__round_ref(KVT_DTYPE_F16, 0x1p-24f) == 0x1p-24f);
    assert_true(kvt__round_ref(KVT_DTYPE_F16, 0x1p-25f) == 0.0f); /* halfway to the smallest subnormal: even */
    assert_true(kvt__round_ref(KVT_DTYPE_F16, 65520.0f) == INFINITY);
}

static void test_convert(void **state)
{
    (void)state;
    static const kvt_dtype dts[2] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};
    for (int d = 0; d < 2; d++) {
        int nans = 0;
        for (uint32_t i = 0; i < 65536; i++) {
            uint16_t h = (uint16_t)i, back;
            float f;
            assert_int_equal(kvt_dtype_to_f32(dts[d], &h, &f, 1), 0);
            assert_int_equal(kvt_dtype_from_f32(dts[d], &f, &back, 1), 0);
            if (isnan(f)) {
                nans++;
                assert_true((back & 0x7fff) > (d ? 0x7f80 : 0x7c00)); /* still a NaN */
                continue;
            }
            if (back != h)
                fail_msg("%s 0x%04x -> %a -> 0x%04x", kvt_dtype_name(dts[d]), (unsigned)h, (double)f, (unsigned)back);
        }
        assert_int_equal(nans, d ? 2 * 127 : 2 * 1023);
    }
    /* f16: ties to even, the largest finite value, overflow, subnormals, -0 */
    assert_int_equal(to16(KVT_DTYPE_F16, 1.0f), 0x3c00);
    assert_int_equal(to16(KVT_DTYPE_F16, 1.0f + 0x1p-11f), 0x3c00);       /* tie, down to even */
    assert_int_equal(to16(KVT_DTYPE_F16, 1.0f + 3 * 0x1p-11f), 0x3c02);   /* tie, up to even */
    assert_int_equal(to16(KVT_DTYPE_F16, 1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    assert_int_equal(to16(KVT_DTYPE_F16, 65504.0f), 0x7bff);
    assert_int_equal(to16(KVT_DTYPE_F16, 65519.0f), 0x7bff);
    assert_int_equal(to16(KVT_DTYPE_F16, 65520.0f), 0x7c00);
    assert_int_equal(to16(KVT_DTYPE_F16, -1e30f), 0xfc00);
    assert_int_equal(to16(KVT_DTYPE_F16, INFINITY), 0x7c00);
    assert_int_equal(to16(KVT_DTYPE_F16, 0x1p-24f), 0x0001);
    assert_int_equal(to16(KVT_DTYPE_F16, 0x1p-25f), 0x0000);     /* tie, to even (0) */
    assert_int_equal(to16(KVT_DTYPE_F16, 3 * 0x1p-25f), 0x0002); /* tie, to even (2) */
    assert_int_equal(to16(KVT_DTYPE_F16, 0x1p-14f), 0x0400);     /* smallest normal */
    assert_int_equal(to16(KVT_DTYPE_F16, -0.0f), 0x8000);
    assert_true((to16(KVT_DTYPE_F16, NAN) & 0x7fff) > 0x7c00);
    /* bf16 */
    assert_int_equal(to16(KVT_DTYPE_BF16, 1.0f), 0x3f80);
    assert_int_equal(to16(KVT_DTYPE_BF16, 1.0f + 0x1p-8f), 0x3f80);
    assert_int_equal(to16(KVT_DTYPE_BF16, 1.0f + 3 * 0x1p-8f), 0x3f82);
    assert_int_equal(to16(KVT_DTYPE_BF16, bits_f(0x7f7fffffu)), 0x7f80); /* FLT_MAX rounds to inf */
    assert_int_equal(to16(KVT_DTYPE_BF16, -0.0f), 0x8000);
    assert_true((to16(KVT_DTYPE_BF16, bits_f(0x7f800001u)) & 0x7fff) > 0x7f80); /* a NaN stays one */
    /* F32 copies; the others are refused */
    float a[3] = {1.5f, -2.0f, 3.25f}, b[3];
    assert_int_equal(kvt_dtype_from_f32(KVT_DTYPE_F32, a, b, 3), 0);
    assert_memory_equal(a, b, sizeof a);
    int8_t q[3];
    assert_int_equal(kvt_dtype_from_f32(KVT_DTYPE_I8, a, q, 3), KVT_EINVAL);
    assert_int_equal(kvt_dtype_to_f32(KVT_DTYPE_U8, q, b, 3), KVT_EINVAL);
    assert_int_equal(kvt_dtype_from_f32(KVT_DTYPE_F16, NULL, q, 3), KVT_EINVAL);
    assert_int_equal(kvt_dtype_from_f32(KVT_DTYPE_F16, NULL, NULL, 0), 0);
}

/* K and V of token t, element j: values that need rounding in f16 and bf16. */
static float kval(int64_t t, int j) { return (float)(t + 1) * 0.1234567f + (float)j * 1.0009765f; }
static float vval(int64_t t, int j) { return -(float)(t + 3) * 0.0301f - (float)j * 7.77f; }

static void append_n(kvt_cache *c, int64_t t0, int64_t n, int d)
{
    float *k = malloc(sizeof(float) * (size_t)(n * d)), *v = malloc(sizeof(float) * (size_t)(n * d));
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < d; j++)
            k[i * d + j] = kval(t0 + i, j), v[i * d + j] = vval(t0 + i, j);
    const void *in[2] = {k, v};
    assert_int_equal(kvt_cache_append(c, n, in), 0);
    free(k);
    free(v);
}

/* Element j of row r of K (which 0) or V (1) of rows, as a float. */
static float row_val(const kvt_kv_rows *r, int which, int64_t t, int j, int d)
{
    const void *base = which ? r->v : r->k;
    size_t i = (size_t)t * (size_t)d + (size_t)j;
    if (r->dtype == KVT_DTYPE_I8) {
        const float *sc = which ? r->v_scale : r->k_scale;
        return (float)((const int8_t *)base)[i] * sc[(size_t)t * (size_t)(d / r->group_size) + (size_t)(j / r->group_size)];
    }
    float f;
    size_t es = kvt_dtype_size(r->dtype);
    assert_int_equal(kvt_dtype_to_f32(r->dtype, (const char *)base + i * es, &f, 1), 0);
    return f;
}

/* What token t's element is stored as, in a non-I8 dtype. */
static float stored(kvt_dtype dt, float x)
{
    uint16_t h;
    float f;
    if (dt == KVT_DTYPE_F32)
        return x;
    assert_int_equal(kvt_dtype_from_f32(dt, &x, &h, 1), 0);
    assert_int_equal(kvt_dtype_to_f32(dt, &h, &f, 1), 0);
    return f;
}

/* A kv cache holds tokens [0, n) as append_n made them, rounded to dt. */
static void check_kv_rows(const kvt_cache *c, int64_t n, kvt_dtype dt)
{
    int32_t B = kvt_kv_block_tokens(c), d = kvt_kv_dim(c);
    assert_int_equal(kvt_cache_offset(c), n);
    assert_int_equal(kvt_kv_block_count(c), (n + B - 1) / B);
    for (int64_t b = 0; b < kvt_kv_block_count(c); b++) {
        kvt_kv_rows r;
        assert_int_equal(kvt_kv_block_rows(c, b, &r), 0);
        assert_int_equal(r.dtype, dt);
        assert_int_equal(r.n, b * B + B <= n ? B : n - b * B);
        for (int32_t t = 0; t < r.n; t++)
            for (int j = 0; j < d; j++) {
                assert_true(row_val(&r, 0, t, j, d) == stored(dt, kval(b * B + t, j)));
                assert_true(row_val(&r, 1, t, j, d) == stored(dt, vval(b * B + t, j)));
            }
    }
}

static void test_kv_dtypes(void **state)
{
    (void)state;
    const int d = 6, B = 4;
    kvt_cache *f32 = NULL;
    assert_int_equal(kvt_kv_create(d, B, &f32), 0);
    append_n(f32, 0, 10, d);
    static const kvt_dtype dts[2] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};
    for (int k = 0; k < 2; k++) {
        kvt_dtype dt = dts[k];
        kvt_cache *c = NULL, *cl = NULL, *dec = NULL;
        assert_int_equal(kvt_kv_create_dtype(d, B, dt, &c), 0);
        assert_int_equal(kvt_kv_dtype(c), dt);
        append_n(c, 0, 3, d);
        append_n(c, 3, 7, d);
        check_kv_rows(c, 10, dt);
        /* half the bytes of f32 in every block */
        assert_int_equal(kvt_cache_bytes(f32) - kvt_cache_bytes(c), 3 * 2 * B * d * 2);
        /* the F32-only accessor refuses */
        const float *kp;
        assert_int_equal(kvt_kv_block(c, 0, &kp, NULL, NULL), KVT_EINVAL);
        /* clone shares; a write to the clone's shared tail copies it */
        assert_int_equal(kvt_cache_clone(c, &cl), 0);
        append_n(cl, 10, 5, d);
        check_kv_rows(cl, 15, dt);
        check_kv_rows(c, 10, dt);
        assert_int_equal(kvt_cache_trim(cl, 5), 0);
        append_n(cl, 5, 2, d);
        check_kv_rows(cl, 7, dt);
        /* encode: three params, the dtype on every tensor; decode round trips */
        kvt_cache_state st;
        assert_int_equal(kvt_cache_encode(c, &st), 0);
        assert_int_equal(st.n_params, 3);
        assert_int_equal(st.params[2], dt);
        assert_int_equal(st.n_tensors, 3);
        for (int i = 0; i < st.n_tensors; i++) {
            assert_int_equal(st.tensors[i].dtype, dt);
            assert_int_equal(st.tensors[i].bytes, 2 * (size_t)st.tensors[i].shape[1] * d * 2);
        }
        assert_int_equal(kvt_cache_decode(&st, &dec), 0);
        check_kv_rows(dec, 10, dt);
        append_n(dec, 10, 3, d); /* writes copy the retained (foreign) tail */
        check_kv_rows(dec, 13, dt);
        kvt_cache_destroy(dec);
        /* a tensor dtype that is not the params' is refused */
        st.tensors[1].dtype = KVT_DTYPE_F32;
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        st.tensors[1].dtype = dt == KVT_DTYPE_F16 ? KVT_DTYPE_BF16 : KVT_DTYPE_F16; /* same size, other dtype */
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        assert_non_null(strstr(kvt_last_error(), "blk1"));
        st.tensors[1].dtype = dt;
        st.params[2] = KVT_DTYPE_F32; /* F32 never encodes three params */
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        st.params[2] = KVT_DTYPE_I8;
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        st.params[2] = dt;
        st.n_params = 2; /* two params mean F32: the F16 tensors do not fit */
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        kvt_cache_state_clear(&st);
        kvt_cache_destroy(cl);
        kvt_cache_destroy(c);
    }
    /* F32 keeps its two params; I8 and the rest are not kv dtypes */
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(f32, &st), 0);
    assert_int_equal(st.n_params, 2);
    kvt_cache_state_clear(&st);
    assert_int_equal(kvt_kv_dtype(f32), KVT_DTYPE_F32);
    kvt_cache *bad = NULL;
    assert_int_equal(kvt_kv_create_dtype(d, B, KVT_DTYPE_I8, &bad), KVT_EINVAL);
    assert_int_equal(kvt_kv_create_dtype(d, B, KVT_DTYPE_COUNT, &bad), KVT_EINVAL);
    assert_null(bad);
    kvt_kv_rows r;
    assert_int_equal(kvt_kv_block_rows(f32, 0, NULL), KVT_EINVAL);
    assert_int_equal(kvt_kv_block_rows(f32, 3, &r), KVT_ERANGE);
    kvt_cache_destroy(f32);
}

/* The ring of a rotating cache after `n` tokens of append_n (window W, keep):
 * each valid slot holds the token that maps to it, stored as dt. */
static void check_ring(const kvt_cache *c, int64_t n, int W, int keep, kvt_dtype dt, int gs)
{
    int d = kvt_kv_dim(c);
    kvt_kv_rows r;
    assert_int_equal(kvt_rotating_rows(c, &r), 0);
    assert_int_equal(r.dtype, dt);
    assert_int_equal(r.n, n < W ? n : W);
    assert_int_equal(r.group_size, dt == KVT_DTYPE_I8 ? gs : 0);
    for (int64_t t = 0; t < n; t++) {
        if (t >= keep && t < n - (W - keep))
            continue; /* overwritten */
        int64_t s = t < keep ? t : keep + (t - keep) % (W - keep);
        for (int j = 0; j < d; j++) {
            float gk = row_val(&r, 0, s, j, d), gv = row_val(&r, 1, s, j, d);
            if (dt != KVT_DTYPE_I8) {
                assert_true(gk == stored(dt, kval(t, j)));
                assert_true(gv == stored(dt, vval(t, j)));
                continue;
            }
            /* int8: within half a step of the group's scale = max|x| / 127 */
            float mk = 0, mv = 0;
            for (int i = j / gs * gs; i < j / gs * gs + gs; i++)
                mk = fmaxf(mk, fabsf(kval(t, i))), mv = fmaxf(mv, fabsf(vval(t, i)));
            assert_true(fabsf(gk - kval(t, j)) <= mk / 254.0f * 1.001f);
            assert_true(fabsf(gv - vval(t, j)) <= mv / 254.0f * 1.001f);
        }
    }
}

static void test_rotating_dtypes(void **state)
{
    (void)state;
    const int d = 6, W = 5, keep = 1, gs = 3;
    static const kvt_dtype dts[3] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_I8};
    kvt_cache *f32 = NULL;
    assert_int_equal(kvt_rotating_create(d, W, keep, &f32), 0);
    for (int k = 0; k < 3; k++) {
        kvt_dtype dt = dts[k];
        kvt_cache *c = NULL, *cl = NULL, *dec = NULL;
        assert_int_equal(kvt_rotating_create_dtype(d, W, keep, dt, gs, &c), 0);
        assert_int_equal(kvt_kv_dtype(c), dt);
        assert_int_equal(kvt_kv_dim(c), d);
        for (int t = 0; t < 3; t++)
            append_n(c, t, 1, d);
        check_ring(c, 3, W, keep, dt, gs);
        size_t ring = kvt_cache_bytes(c) - kvt_cache_bytes(f32) + 2 * (size_t)W * d * 4;
        assert_int_equal(ring, dt == KVT_DTYPE_I8 ? 2 * (size_t)W * (d + d / gs * 4) : 2 * (size_t)W * d * 2);
        /* the F32 view refuses */
        const float *kp;
        assert_int_equal(kvt_rotating_view(c, &kp, NULL, NULL), KVT_EINVAL);
        /* a clone shares the ring; its writes wrap it on a copy */
        assert_int_equal(kvt_cache_clone(c, &cl), 0);
        append_n(cl, 3, 9, d); /* one batch longer than the window */
        check_ring(cl, 12, W, keep, dt, gs);
        check_ring(c, 3, W, keep, dt, gs);
        append_n(cl, 12, 1, d);
        check_ring(cl, 13, W, keep, dt, gs);
        /* encode: five params; I8 as codes + scales; decode round trips */
        kvt_cache_state st;
        assert_int_equal(kvt_cache_encode(cl, &st), 0);
        assert_int_equal(st.n_params, 5);
        assert_int_equal(st.params[3], dt);
        assert_int_equal(st.params[4], dt == KVT_DTYPE_I8 ? gs : 0);
        assert_int_equal(st.n_tensors, dt == KVT_DTYPE_I8 ? 2 : 1);
        if (dt == KVT_DTYPE_I8) {
            assert_string_equal(st.tensors[0].name, "ring.q");
            assert_int_equal(st.tensors[0].dtype, KVT_DTYPE_I8);
            assert_string_equal(st.tensors[1].name, "ring.s");
            assert_int_equal(st.tensors[1].dtype, KVT_DTYPE_F32);
            assert_int_equal(st.tensors[1].shape[2], d / gs);
        } else {
            assert_int_equal(st.tensors[0].dtype, dt);
        }
        assert_int_equal(kvt_cache_decode(&st, &dec), 0);
        check_ring(dec, 13, W, keep, dt, gs);
        kvt_kv_rows a, b;
        assert_int_equal(kvt_rotating_rows(cl, &a), 0);
        assert_int_equal(kvt_rotating_rows(dec, &b), 0);
        assert_ptr_equal(a.k, b.k); /* zero-copy: the decoded cache retains the ring */
        append_n(dec, 13, 2, d);    /* ... and copies it before writing */
        check_ring(dec, 15, W, keep, dt, gs);
        check_ring(cl, 13, W, keep, dt, gs);
        kvt_cache_destroy(dec);
        /* mismatches are refused */
        kvt_dtype was = st.tensors[0].dtype;
        st.tensors[0].dtype = was == KVT_DTYPE_F16 ? KVT_DTYPE_BF16 : KVT_DTYPE_F16;
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        st.tensors[0].dtype = was;
        st.params[3] = dt == KVT_DTYPE_I8 ? KVT_DTYPE_F16 : KVT_DTYPE_I8; /* other scheme, same tensors */
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        st.params[3] = dt;
        if (dt == KVT_DTYPE_I8) {
            st.params[4] = 4; /* does not divide kv_dim */
            assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
            st.params[4] = gs;
            float *sc = (float *)(uintptr_t)st.tensors[1].data, keep_s = sc[2];
            sc[2] = -1.0f; /* a negative scale (the owner is this cache's ring) */
            assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
            sc[2] = keep_s;
        }
        st.n_params = 3; /* three params mean F32 */
        assert_int_equal(kvt_cache_decode(&st, &dec), KVT_EFORMAT);
        kvt_cache_state_clear(&st);
        kvt_cache_destroy(cl);
        kvt_cache_destroy(c);
    }
    kvt_cache *bad = NULL;
    assert_int_equal(kvt_rotating_create_dtype(d, W, keep, KVT_DTYPE_I8, 4, &bad), KVT_EINVAL);
    assert_int_equal(kvt_rotating_create_dtype(d, W, keep, KVT_DTYPE_I8, 0, &bad), KVT_EINVAL);
    assert_int_equal(kvt_rotating_create_dtype(d, W, keep, KVT_DTYPE_U8, 0, &bad), KVT_EINVAL);
    assert_null(bad);
    kvt_kv_rows r;
    assert_int_equal(kvt_rotating_rows(f32, NULL), KVT_EINVAL);
    assert_int_equal(kvt_rotating_rows(NULL, &r), KVT_EINVAL);
    kvt_cache_destroy(f32);
}

static void test_engine_schemes(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvt_test_kv_dtype_XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/m.bin", dir);
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 64, p.hidden_dim = 96, p.n_layers = 3, p.n_heads = 4, p.n_kv_heads = 2, p.vocab_size = 50;
    p.seq_len = 64, p.seed = 5, p.sliding_window = 6;
    p.layer_kind[1] = KVT_LAYER_WINDOW;
    p.layer_kind[2] = KVT_LAYER_RECURRENT;
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    assert_int_equal(kvt_model_kv_scheme(m), KVT_KV_F32);
    assert_int_equal(kvt_model_q8_group_size(m), 16); /* head_size 16 */
    const size_t kv = 32; /* n_kv_heads * head_size */
    static const kvt_dtype want[4] = {KVT_DTYPE_F32, KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_U8};
    static const kvt_dtype want_ring[4] = {KVT_DTYPE_F32, KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_I8};
    /* q8: codes + a 256-token block's per-channel scales (16 * 32 bytes) per token; its ring per-group scales */
    static const size_t row[4] = {2 * 32 * 4, 2 * 32 * 2, 2 * 32 * 2, 2 * 32 + (16 * 32 + 255) / 256};
    static const size_t ring[4] = {2 * 32 * 4, 2 * 32 * 2, 2 * 32 * 2, 2 * (32 + 32 / 16 * 4)};
    /* f16, bf16, q8: the f32 K and V of the open block, min(256, seq_len) tokens */
    static const size_t open_block[4] = {0, 2 * 4 * 32 * 64, 2 * 4 * 32 * 64, 2 * 4 * 32 * 64};
    char fp[4][KVT_STORE_FINGERPRINT_LEN];
    for (int s = 0; s < KVT_KV_SCHEME_COUNT; s++) {
        kvt_kv_scheme k;
        assert_int_equal(kvt_kv_scheme_parse(kvt_kv_scheme_name((kvt_kv_scheme)s), &k), 0);
        assert_int_equal(k, s);
        assert_int_equal(kvt_model_set_kv_scheme(m, k), 0);
        assert_int_equal(kvt_model_kv_row_bytes(m), row[s]);
        assert_int_equal(kvt_model_kv_bytes_per_token(m), row[s]); /* one attention layer */
        assert_int_equal(kvt_model_window_row_bytes(m), ring[s]);
        assert_int_equal(kvt_model_fixed_state_bytes(m), 6 * ring[s] + 64 * 4 + open_block[s]);
        kvt_cache *c[3] = {NULL, NULL, NULL};
        assert_int_equal(kvt_model_new_caches(m, 8, c), 0);
        assert_string_equal(kvt_cache_kind(c[0]), s == KVT_KV_F32 ? "kv" : "qkvc");
        assert_string_equal(kvt_cache_kind(c[1]), "rotating");
        assert_string_equal(kvt_cache_kind(c[2]), "recurrent"); /* f32 state in every scheme */
        assert_int_equal(kvt_kv_dtype(c[0]), want[s]);
        assert_int_equal(kvt_kv_dtype(c[1]), want_ring[s]);
        int32_t tok[5] = {1, 2, 3, 4, 5};
        float logits[50];
        assert_int_equal(kvt_model_prefill(m, c, tok, 5, logits), 0);
        kvt_kv_rows r;
        assert_int_equal(kvt_kv_block_rows(c[0], 0, &r), 0);
        assert_int_equal(r.dtype, KVT_DTYPE_F32); /* the open block is f32 in every scheme */
        assert_int_equal(r.n, 5);
        int32_t more[4] = {6, 7, 8, 9}; /* 9 tokens: block 0 (8 tokens) sealed in the scheme */
        assert_int_equal(kvt_model_prefill(m, c, more, 4, logits), 0);
        assert_int_equal(kvt_kv_block_rows(c[0], 0, &r), 0);
        assert_int_equal(r.dtype, want[s]);
        assert_int_equal(r.n, 8);
        assert_int_equal(kvt_kv_block_rows(c[0], 1, &r), 0);
        assert_int_equal(r.dtype, KVT_DTYPE_F32);
        assert_int_equal(r.n, 1);
        assert_int_equal(kvt_store_config_fingerprint(c, 3, fp[s]), 0);
        for (int o = 0; o < s; o++)
            assert_string_not_equal(fp[o], fp[s]); /* a directory of its own per scheme */
        kvt_caches_destroy(c, 3);
    }
    /* f16 and bf16: half of f32; q8: a quarter plus the scales */
    assert_int_equal(2 * row[1], row[0]);
    assert_int_equal(row[3], row[0] / 4 + (16 * kv + 255) / 256);
    kvt_kv_scheme k = KVT_KV_F16;
    assert_int_equal(kvt_kv_scheme_parse("fp16", &k), KVT_EINVAL);
    assert_int_equal(k, KVT_KV_F16);
    assert_int_equal(kvt_kv_scheme_parse(NULL, &k), KVT_EINVAL);
    assert_int_equal(kvt_model_set_kv_scheme(m, KVT_KV_SCHEME_COUNT), KVT_EINVAL);
    assert_int_equal(kvt_model_set_kv_scheme(NULL, KVT_KV_F16), KVT_EINVAL);
    assert_null(kvt_kv_scheme_name(KVT_KV_SCHEME_COUNT));
    kvt_model_free(m);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_convert),
        cmocka_unit_test(test_round_reference),
        cmocka_unit_test(test_kv_dtypes),
        cmocka_unit_test(test_rotating_dtypes),
        cmocka_unit_test(test_engine_schemes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
