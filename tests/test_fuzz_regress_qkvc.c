/*
 * test_fuzz_regress_qkvc.c: the qkvc kind (8-bit K/V per channel) sealing
 * rows that are not finite, which fuzz_tensor_decode found: a decoded open
 * block holding NaN or inf (decode does not look at f32 rows) was sealed by
 * the next append into (min, step) pairs that were NaN or inf, so the
 * cache's own encoding was refused by decode and every reader got NaN
 * scales. Sealing now keeps every min and step finite with step >= 0. The
 * fuzzer's input is kept as fuzz/corpus/fuzz_tensor_decode/regress-qkvc-nan-open-block.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kvtier/cache.h"

#include <float.h>
#include <math.h>
#include <string.h>

static void append_rows(kvt_cache *c, const float *k, const float *v, int64_t n)
{
    const void *in[2] = {k, v};
    assert_int_equal(kvt_cache_append(c, n, in), 0);
}

/* Every (min, step) of sealed block i is finite and every step >= 0. */
static void assert_scales_finite(const kvt_cache *c, int64_t i, kvt_kv_rows *r)
{
    assert_int_equal(kvt_kv_block_rows(c, i, r), 0);
    assert_int_equal(r->dtype, KVT_DTYPE_U8);
    for (int32_t ch = 0; ch < kvt_kv_dim(c); ch++) {
        assert_true(isfinite(r->k_min[ch]) && isfinite(r->v_min[ch]));
        assert_true(isfinite(r->k_scale[ch]) && isfinite(r->v_scale[ch]));
        assert_true(r->k_scale[ch] >= 0 && r->v_scale[ch] >= 0);
    }
}

/* decode(encode(c)) is accepted and encodes to the same bytes. */
static void assert_roundtrip(const kvt_cache *c)
{
    kvt_cache_state s1, s2;
    assert_int_equal(kvt_cache_encode(c, &s1), 0);
    kvt_cache *d = NULL;
    assert_int_equal(kvt_cache_decode(&s1, &d), 0);
    assert_int_equal(kvt_cache_encode(d, &s2), 0);
    assert_int_equal(s1.n_tensors, s2.n_tensors);
    for (int32_t i = 0; i < s1.n_tensors; i++) {
        assert_int_equal(s1.tensors[i].bytes, s2.tensors[i].bytes);
        assert_memory_equal(s1.tensors[i].data, s2.tensors[i].data, s1.tensors[i].bytes);
    }
    kvt_cache_state_clear(&s2);
    kvt_cache_state_clear(&s1);
    kvt_cache_destroy(d);
}

/* Channels of K: all NaN; +inf beside 2; 1 beside -inf. Of V: FLT_MAX
 * beside -FLT_MAX (a range over FLT_MAX); 1 beside 3; -inf beside 5. */
static void seal_nonfinite_rows(void **state)
{
    (void)state;
    kvt_cache *c = NULL;
    assert_int_equal(kvt_qkvc_create(3, 2, &c), 0);
    const float k[6] = {NAN, INFINITY, 1.0f, NAN, 2.0f, -INFINITY};
    const float v[6] = {FLT_MAX, 1.0f, -INFINITY, -FLT_MAX, 3.0f, 5.0f};
    append_rows(c, k, v, 2);
    const float k2[3] = {0.5f, 0.5f, 0.5f}, v2[3] = {0.25f, 0.25f, 0.25f};
    append_rows(c, k2, v2, 1); /* seals block 0 */
    kvt_kv_rows r;
    assert_scales_finite(c, 0, &r);
    assert_true(r.k_min[0] == 0.0f && r.k_scale[0] == 0.0f); /* no finite value */
    assert_true(r.k_min[1] == 2.0f && r.k_scale[1] == 0.0f);
    assert_true(r.k_min[2] == 1.0f && r.k_scale[2] == 0.0f);
    assert_true(r.v_min[0] == -FLT_MAX && r.v_scale[0] == (float)(2.0 * FLT_MAX / 255.0));
    assert_true(r.v_min[1] == 1.0f && r.v_scale[1] == 2.0f / 255.0f);
    assert_true(r.v_min[2] == 5.0f && r.v_scale[2] == 0.0f);
    const uint8_t *vc = r.v;
    assert_int_equal(vc[0], 255); /* FLT_MAX: the top of the range */
    assert_int_equal(vc[3], 0);   /* -FLT_MAX */
    assert_true(fabsf(fmaf(vc[4], r.v_scale[1], r.v_min[1]) - 3.0f) < 1e-5f);
    assert_roundtrip(c);
    kvt_cache_destroy(c);
}

/* The fuzzer's path: a full open block holding NaN and inf is decoded (f32
 * rows are not checked), then sealed by an append on the decoded cache. */
static void seal_decoded_open_block(void **state)
{
    (void)state;
    kvt_cache *c = NULL, *d = NULL;
    assert_int_equal(kvt_qkvc_create(2, 2, &c), 0);
    const float k[4] = {NAN, 1.0f, -INFINITY, 2.0f}, v[4] = {INFINITY, NAN, 4.0f, NAN};
    append_rows(c, k, v, 2);
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    assert_int_equal(kvt_cache_decode(&st, &d), 0);
    kvt_cache_state_clear(&st);
    const float k2[2] = {1.0f, 1.0f}, v2[2] = {1.0f, 1.0f};
    append_rows(d, k2, v2, 1);
    kvt_kv_rows r;
    assert_scales_finite(d, 0, &r);
    assert_true(r.k_min[0] == 0.0f && r.k_scale[0] == 0.0f);
    assert_true(r.k_min[1] == 1.0f && r.k_scale[1] == 1.0f / 255.0f);
    assert_true(r.v_min[0] == 4.0f && r.v_scale[0] == 0.0f);
    assert_true(r.v_min[1] == 0.0f && r.v_scale[1] == 0.0f);
    assert_roundtrip(d);
    kvt_cache_destroy(d);
    kvt_cache_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(seal_nonfinite_rows),
        cmocka_unit_test(seal_decoded_open_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
