/*
 * test_kv_open_block.c: the 16-bit sealed blocks of the "qkvc" kind
 * (kvt_qkvc_create_dtype with F16 or BF16: the open block f32, a block
 * rounded to 16 bits only when the next block starts; kvtier/cache.h) and
 * the engine's f16 and bf16 schemes that store attention K/V in it:
 *  - the seal rule: the open block reads back the appended f32 rows bit for
 *    bit, a sealed block reads back exactly kvt_dtype_from_f32 of them; the
 *    range is [sealed tokens, offset]; any split of the appends gives the
 *    same bytes;
 *  - encode / decode: params {kv_dim, B, 1, dtype}, one "blk<i>" tensor of
 *    the dtype per sealed block (adopted without a copy), the f32 "tail";
 *    a decoded cache continues exactly as the original; refusals of another
 *    dtype, a wrong tensor dtype, an inconsistent offset;
 *  - the identity: each scheme's caches (and the old f16/bf16 "kv" caches)
 *    have their own config fingerprint, so one never serves another;
 *  - admission: kvt_service_layer_of counts 2 * kv_dim * 2 bytes per token
 *    and the f32 open block, as kvt_model_kv_row_bytes and
 *    kvt_model_fixed_state_bytes do; for every scheme
 *    kvt_model_kv_bytes_per_token_at(m, B) equals what it reads off caches
 *    of blocks of B;
 *  - the engine: while a prompt fits in the open block, the f16 and bf16
 *    schemes give logits equal to f32's bit for bit (the rows are read in
 *    f32); past it they differ;
 *  - the 8-bit codes: a step that makes code 255 read as infinity is refused
 *    by decode, and sealing rows of +-FLT_MAX never writes one; the int8
 *    kinds (qkv, an I8 rotating ring) alike: a scale above FLT_MAX / 128
 *    (code -128 would read as infinity) is refused, and quantizing rows of
 *    FLT_MAX and infinity writes states decode accepts, reading finite.
 * Randomized: prints and accepts its seed (KVT_TEST_SEED).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/cache.h"
#include "kvtier/common.h"
#include "kvtier/service.h"
#include "kvtier/store.h"
#include "model.h"
#include "test_rng.h"
#include "test_seed.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t g_seed;

#define D 6
#define B 4
#define N 11

static const kvt_dtype k_dtypes[2] = {KVT_DTYPE_F16, KVT_DTYPE_BF16};

/* N rows of K and of V (N, D), values that do not all fit 16 bits exactly. */
static void rows(uint64_t seed, float *k, float *v)
{
    uint64_t s = seed;
    for (int i = 0; i < N * D; i++) {
        k[i] = rng_sym(&s) * 3.0f;
        v[i] = rng_sym(&s) + 0.5f;
    }
}

static void append(kvt_cache *c, const float *k, const float *v, int t0, int n)
{
    const void *in[2] = {k + (size_t)t0 * D, v + (size_t)t0 * D};
    assert_int_equal(kvt_cache_append(c, n, in), 0);
}

static void range_is(const kvt_cache *c, int64_t lo, int64_t hi)
{
    int64_t a = -1, b = -1;
    kvt_cache_range(c, &a, &b);
    assert_int_equal(a, lo);
    assert_int_equal(b, hi);
}

/* Block `blk` of c holds rows [blk * B, ..) of k / v: the f32 rows when
 * open, kvt_dtype_from_f32 of them (bit for bit) when sealed. */
static void check_block(const kvt_cache *c, kvt_dtype dt, int blk, const float *k, const float *v, int sealed)
{
    kvt_kv_rows r;
    assert_int_equal(kvt_kv_block_rows(c, blk, &r), 0);
    assert_int_equal(r.dtype, sealed ? dt : KVT_DTYPE_F32);
    assert_null(r.k_scale);
    for (int h = 0; h < 2; h++) {
        const float *x = (h ? v : k) + (size_t)blk * B * D;
        if (!sealed) {
            assert_memory_equal(h ? r.v : r.k, x, sizeof(float) * (size_t)r.n * D);
            continue;
        }
        assert_int_equal(r.n, B);
        uint16_t want[B * D];
        assert_int_equal(kvt_dtype_from_f32(dt, x, want, B * D), 0);
        assert_memory_equal(h ? r.v : r.k, want, sizeof want);
    }
}

static void test_seal_rule(void **state)
{
    (void)state;
    float k[N * D], v[N * D];
    rows(g_seed, k, v);
    kvt_cache *c = NULL;
    assert_int_equal(kvt_qkvc_create_dtype(D, B, KVT_DTYPE_F32, &c), KVT_EINVAL);
    assert_null(c);
    assert_non_null(strstr(kvt_last_error(), "not U8, F16 or BF16"));
    assert_int_equal(kvt_qkvc_create_dtype(D, B, KVT_DTYPE_I8, &c), KVT_EINVAL);
    assert_int_equal(kvt_qkvc_create_dtype(0, B, KVT_DTYPE_F16, &c), KVT_EINVAL);
    for (int d = 0; d < 2; d++) {
        const kvt_dtype dt = k_dtypes[d];
        assert_int_equal(kvt_qkvc_create_dtype(D, B, dt, &c), 0);
        assert_string_equal(kvt_cache_kind(c), "qkvc");
        assert_int_equal(kvt_kv_dtype(c), dt);
        assert_int_equal(kvt_kv_dim(c), D);
        assert_int_equal(kvt_kv_block_tokens(c), B);
        append(c, k, v, 0, B); /* a full block, still open: f32 */
        range_is(c, 0, B);
        check_block(c, dt, 0, k, v, 0);
        append(c, k, v, B, 1); /* a token of the next block seals it */
        range_is(c, B, B + 1);
        assert_int_equal(kvt_kv_block_count(c), 2);
        check_block(c, dt, 0, k, v, 1);
        check_block(c, dt, 1, k, v, 0);
        assert_int_equal(kvt_cache_trim(c, B - 1), KVT_ERANGE); /* inside a sealed block */
        assert_int_equal(kvt_cache_trim(c, B), 0);
        append(c, k, v, B, N - B);
        range_is(c, 2 * B, N);
        check_block(c, dt, 0, k, v, 1);
        check_block(c, dt, 1, k, v, 1);
        check_block(c, dt, 2, k, v, 0);
        /* the same rows in other pieces: the same state */
        kvt_cache *each = NULL;
        assert_int_equal(kvt_qkvc_create_dtype(D, B, dt, &each), 0);
        append(each, k, v, 0, 3), append(each, k, v, 3, 1), append(each, k, v, 4, 6), append(each, k, v, 10, 1);
        kvt_cache_state s1, s2;
        assert_int_equal(kvt_cache_encode(c, &s1), 0);
        assert_int_equal(kvt_cache_encode(each, &s2), 0);
        assert_int_equal(s1.n_tensors, s2.n_tensors);
        for (int32_t i = 0; i < s1.n_tensors; i++) {
            assert_int_equal(s1.tensors[i].bytes, s2.tensors[i].bytes);
            assert_memory_equal(s1.tensors[i].data, s2.tensors[i].data, s1.tensors[i].bytes);
        }
        kvt_cache_state_clear(&s1), kvt_cache_state_clear(&s2);
        kvt_cache_destroy(each);
        kvt_cache_destroy(c);
    }
}

static void test_encode_decode(void **state)
{
    (void)state;
    float k[N * D], v[N * D];
    rows(g_seed + 1, k, v);
    static const int held[3] = {2 * B, 2 * B + 2, B - 1}; /* a full open block, a partial one, no sealed one */
    for (int d = 0; d < 2; d++)
        for (int h = 0; h < 3; h++) {
            const kvt_dtype dt = k_dtypes[d];
            kvt_cache *c = NULL, *r = NULL;
            assert_int_equal(kvt_qkvc_create_dtype(D, B, dt, &c), 0);
            append(c, k, v, 0, held[h]);
            const int64_t n = held[h], sealed = (n - 1) / B;
            kvt_cache_state st;
            assert_int_equal(kvt_cache_encode(c, &st), 0);
            assert_string_equal(st.kind, "qkvc");
            assert_int_equal(st.n_params, 4);
            assert_int_equal(st.params[0], D);
            assert_int_equal(st.params[1], B);
            assert_int_equal(st.params[2], 1);
            assert_int_equal(st.params[3], dt);
            assert_int_equal(st.min_offset, sealed * B);
            assert_int_equal(st.n_tensors, sealed + 1);
            for (int64_t i = 0; i < sealed; i++) {
                char name[16];
                snprintf(name, sizeof name, "blk%d", (int)i);
                assert_string_equal(st.tensors[i].name, name);
                assert_int_equal(st.tensors[i].dtype, dt);
                assert_int_equal(st.tensors[i].bytes, 2 * B * D * 2);
                assert_int_equal(st.tensors[i].tok_begin, i * B);
                assert_int_equal(st.tensors[i].tok_end, (i + 1) * B);
            }
            const kvt_tensor *tail = &st.tensors[st.n_tensors - 1];
            assert_string_equal(tail->name, "tail");
            assert_int_equal(tail->dtype, KVT_DTYPE_F32);
            assert_int_equal(tail->tok_begin, -1);
            assert_int_equal(tail->shape[1], n - sealed * B);
            uint64_t copied = kvt_buf_bytes_copied();
            assert_int_equal(kvt_cache_decode(&st, &r), 0);
            assert_int_equal(kvt_buf_bytes_copied() - copied, tail->shape[1] < B ? tail->bytes : 0);
            if (sealed) {
                kvt_kv_rows a;
                assert_int_equal(kvt_kv_block_rows(r, 0, &a), 0);
                assert_ptr_equal(a.k, st.tensors[0].data); /* adopted, not copied */
            }
            range_is(r, sealed * B, n);
            kvt_cache_state_clear(&st);
            append(c, k, v, (int)n, N - (int)n); /* both continue the same way */
            append(r, k, v, (int)n, N - (int)n);
            kvt_cache_state s1, s2;
            assert_int_equal(kvt_cache_encode(c, &s1), 0);
            assert_int_equal(kvt_cache_encode(r, &s2), 0);
            assert_int_equal(s1.n_tensors, s2.n_tensors);
            for (int32_t i = 0; i < s1.n_tensors; i++) {
                assert_string_equal(s1.tensors[i].name, s2.tensors[i].name);
                assert_int_equal(s1.tensors[i].bytes, s2.tensors[i].bytes);
                assert_memory_equal(s1.tensors[i].data, s2.tensors[i].data, s1.tensors[i].bytes);
            }
            kvt_cache_state_clear(&s1), kvt_cache_state_clear(&s2);
            for (int b = 0; b < 2; b++)
                check_block(r, dt, b, k, v, 1);
            kvt_cache_destroy(c);
            kvt_cache_destroy(r);
        }
}

/* Decodes st; expects KVT_EFORMAT naming `what`. */
static void refused(const kvt_cache_state *st, const char *what)
{
    kvt_cache *r = NULL;
    assert_int_equal(kvt_cache_decode(st, &r), KVT_EFORMAT);
    assert_null(r);
    if (!strstr(kvt_last_error(), what))
        fail_msg("error \"%s\" does not name \"%s\"", kvt_last_error(), what);
}

static void test_refusals(void **state)
{
    (void)state;
    float k[N * D], v[N * D];
    rows(g_seed + 2, k, v);
    kvt_cache *c = NULL;
    assert_int_equal(kvt_qkvc_create_dtype(D, B, KVT_DTYPE_F16, &c), 0);
    append(c, k, v, 0, N);
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    static const int64_t bad_dt[4] = {KVT_DTYPE_F32, KVT_DTYPE_I8, KVT_DTYPE_U8, 99};
    for (int i = 0; i < 4; i++) {
        st.params[3] = bad_dt[i];
        refused(&st, "param dtype");
    }
    st.params[3] = KVT_DTYPE_BF16; /* the params say bf16, the tensors are f16 */
    refused(&st, "has dtype F16, expected BF16");
    st.params[3] = KVT_DTYPE_F16;
    st.min_offset = B;
    refused(&st, "min_offset 4");
    st.min_offset = 2 * B;
    st.offset = 3 * B + 1;
    refused(&st, "offset 13");
    st.offset = 2 * B; /* no open block, but a tail tensor */
    refused(&st, "offset 8");
    st.offset = N;
    st.n_params = 3; /* read as 8-bit codes: the tensors do not match */
    refused(&st, "do not describe sealed blocks");
    st.n_params = 4;
    kvt_cache *ok = NULL;
    assert_int_equal(kvt_cache_decode(&st, &ok), 0);
    kvt_cache_destroy(ok);
    kvt_cache_state_clear(&st);
    kvt_cache_destroy(c);
}

/* Every pair among f16/bf16 qkvc, f16/bf16 kv (the layout before the open
 * block) and U8 qkvc has its own config fingerprint. */
static void test_identity(void **state)
{
    (void)state;
    kvt_cache *c[5] = {NULL};
    assert_int_equal(kvt_qkvc_create_dtype(32, 256, KVT_DTYPE_F16, &c[0]), 0);
    assert_int_equal(kvt_qkvc_create_dtype(32, 256, KVT_DTYPE_BF16, &c[1]), 0);
    assert_int_equal(kvt_qkvc_create(32, 256, &c[2]), 0);
    assert_int_equal(kvt_kv_create_dtype(32, 256, KVT_DTYPE_F16, &c[3]), 0);
    assert_int_equal(kvt_kv_create_dtype(32, 256, KVT_DTYPE_BF16, &c[4]), 0);
    char fp[5][KVT_STORE_FINGERPRINT_LEN];
    for (int i = 0; i < 5; i++) {
        assert_int_equal(kvt_store_config_fingerprint(&c[i], 1, fp[i]), 0);
        for (int j = 0; j < i; j++)
            assert_string_not_equal(fp[i], fp[j]);
    }
    for (int i = 0; i < 5; i++)
        kvt_cache_destroy(c[i]);
}

static kvt_model *synth_model(char *dir, char *path, size_t path_len)
{
    assert_non_null(mkdtemp(dir));
    snprintf(path, path_len, "%s/m.bin", dir);
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 64, p.hidden_dim = 96, p.n_layers = 2, p.n_heads = 4, p.n_kv_heads = 2, p.vocab_size = 50;
    p.seq_len = 64, p.seed = 11;
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    return m;
}

/* Admission's projection of an f16/bf16 layer: 2 * kv_dim * 2 bytes a token
 * in blocks of B, plus the f32 open block, from the cache and from the model. */
static void test_layer_bytes(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvt_test_kv_open_block_XXXXXX", path[256];
    kvt_model *m = synth_model(dir, path, sizeof path);
    const size_t kv = 32;
    for (int d = 0; d < 2; d++) {
        assert_int_equal(kvt_model_set_kv_scheme(m, d ? KVT_KV_BF16 : KVT_KV_F16), 0);
        kvt_cache *c[2];
        assert_int_equal(kvt_model_new_caches(m, 16, c), 0);
        assert_string_equal(kvt_cache_kind(c[0]), "qkvc");
        assert_int_equal(kvt_kv_dtype(c[0]), k_dtypes[d]);
        kvt_service_layer l;
        assert_int_equal(kvt_service_layer_of(c[0], &l), 0);
        assert_int_equal(l.growth, KVT_GROWTH_PER_TOKEN);
        assert_int_equal(l.bytes_per_token, 2 * kv * 2);
        assert_int_equal(l.block_tokens, 16);
        assert_int_equal(l.fixed_bytes, 2 * kv * 4 * 16); /* the open block, f32 */
        assert_int_equal(kvt_model_kv_row_bytes(m), 2 * kv * 2);
        assert_int_equal(kvt_model_fixed_state_bytes(m), 2 * (2 * kv * 4 * 64)); /* two layers, min(256, 64) */
        kvt_caches_destroy(c, 2);
    }
    /* every scheme: the model's projection at a block size equals what the
     * service reads off caches of that block (q8's scales are shared by the
     * block's tokens: 16 * kv_dim bytes over 16 tokens, not over 256) */
    for (int s = 0; s < KVT_KV_SCHEME_COUNT; s++) {
        assert_int_equal(kvt_model_set_kv_scheme(m, (kvt_kv_scheme)s), 0);
        kvt_cache *c[2];
        assert_int_equal(kvt_model_new_caches(m, 16, c), 0);
        size_t sum = 0;
        for (int l = 0; l < 2; l++) {
            kvt_service_layer sl;
            assert_int_equal(kvt_service_layer_of(c[l], &sl), 0);
            sum += sl.bytes_per_token;
        }
        assert_int_equal(kvt_model_kv_bytes_per_token_at(m, 16), sum);
        assert_int_equal(kvt_model_kv_row_bytes_at(m, 16), sum / 2);
        assert_int_equal(kvt_model_kv_row_bytes_at(m, 1000), kvt_model_kv_row_bytes_at(m, 64)); /* capped at seq_len */
        if (s == KVT_KV_Q8) {
            assert_int_equal(sum / 2, 2 * kv + 16 * kv / 16);
            assert_int_equal(kvt_model_kv_row_bytes(m), 2 * kv + (16 * kv + 255) / 256); /* the 256-token default */
        }
        kvt_caches_destroy(c, 2);
    }
    assert_int_equal(kvt_model_kv_row_bytes_at(m, 0), 0);
    assert_int_equal(kvt_model_kv_bytes_per_token_at(NULL, 16), 0);
    kvt_model_free(m);
    unlink(path);
    rmdir(dir);
}

/* A prompt inside the open block reads its K/V in f32: f16 and bf16 logits
 * equal f32's bit for bit; once a block is sealed they differ. (That rows
 * fed across block boundaries in one chunk read their own block in f32 and
 * the earlier ones sealed, as decode does, is test_qkvc.c's
 * test_engine_split_at_blocks, for f16, bf16 and q8.) */
static void test_engine_open_block(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvt_test_kv_open_block_XXXXXX", path[256];
    kvt_model *m = synth_model(dir, path, sizeof path);
    int32_t tok[40];
    uint64_t s = g_seed + 3;
    for (int i = 0; i < 40; i++)
        tok[i] = 1 + (int32_t)((rng_sym(&s) + 1.0f) * 24.0f) % 49;
    float ref[2][50];
    kvt_cache *c[2];
    assert_int_equal(kvt_model_set_kv_scheme(m, KVT_KV_F32), 0);
    for (int i = 0; i < 2; i++) { /* 16 tokens (one full open block), then 40 */
        assert_int_equal(kvt_model_new_caches(m, 16, c), 0);
        assert_int_equal(kvt_model_prefill(m, c, tok, i ? 40 : 16, ref[i]), 0);
        kvt_caches_destroy(c, 2);
    }
    for (int d = 0; d < 2; d++) {
        assert_int_equal(kvt_model_set_kv_scheme(m, d ? KVT_KV_BF16 : KVT_KV_F16), 0);
        float l1[50];
        assert_int_equal(kvt_model_new_caches(m, 16, c), 0);
        assert_int_equal(kvt_model_prefill(m, c, tok, 16, l1), 0);
        assert_memory_equal(l1, ref[0], sizeof l1); /* all 16 rows in the open block */
        kvt_caches_destroy(c, 2);
        kvt_cache *one[2];
        assert_int_equal(kvt_model_new_caches(m, 16, one), 0);
        assert_int_equal(kvt_model_prefill(m, one, tok, 40, l1), 0);
        assert_true(memcmp(l1, ref[1], sizeof l1) != 0); /* two sealed blocks read in 16 bits */
        float dmax = 0;
        for (int i = 0; i < 50; i++)
            dmax = fmaxf(dmax, fabsf(l1[i] - ref[1][i]));
        print_message("%s: 40 tokens, max |logit - f32| %g\n", d ? "bf16" : "f16", (double)dmax);
        assert_true(dmax < 0.5f);
        kvt_caches_destroy(one, 2);
    }
    kvt_model_free(m);
    unlink(path);
    rmdir(dir);
}

/* 8-bit codes: a finite step whose code 255 reads as infinity is refused;
 * rows of -FLT_MAX and FLT_MAX seal into a state decode accepts, whose every
 * value reads back finite. */
static void test_u8_step_overflow(void **state)
{
    (void)state;
    float k[2 * B * D], v[2 * B * D];
    for (int i = 0; i < 2 * B * D; i++) {
        k[i] = (i / D) % 2 ? FLT_MAX : -FLT_MAX;
        v[i] = (i / D) % 2 ? -FLT_MAX : FLT_MAX * 0.999f;
    }
    kvt_cache *c = NULL, *r = NULL;
    assert_int_equal(kvt_qkvc_create(D, B, &c), 0);
    const void *in[2] = {k, v};
    assert_int_equal(kvt_cache_append(c, B + 1, in), 0); /* seals block 0 */
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    assert_int_equal(kvt_cache_decode(&st, &r), 0); /* what sealing writes, decode reads */
    kvt_kv_rows rw;
    assert_int_equal(kvt_kv_block_rows(r, 0, &rw), 0);
    assert_int_equal(rw.dtype, KVT_DTYPE_U8);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < B * D; i++) {
            const uint8_t *q = h ? rw.v : rw.k;
            const float *mn = h ? rw.v_min : rw.k_min, *sc = h ? rw.v_scale : rw.k_scale;
            float x = fmaf((float)q[i], sc[i % D], mn[i % D]);
            if (!isfinite(x))
                fail_msg("%s element %d reads as %g", h ? "V" : "K", i, (double)x);
        }
    kvt_cache_destroy(r);
    r = NULL;
    float *sc = (float *)(void *)st.tensors[1].data; /* blk0.s: K min, K step, V min, V step */
    float keep[2] = {sc[0], sc[D]};
    sc[0] = FLT_MAX / 2, sc[D] = FLT_MAX / 200; /* both finite; 255 * step + min is not */
    refused(&st, "code 255 read as infinity");
    sc[0] = keep[0], sc[D] = keep[1];
    sc[3 * D + 2] = FLT_MAX / 100; /* a V step: min + 255 * step overflows */
    refused(&st, "blk0.s");
    kvt_cache_state_clear(&st);
    kvt_cache_destroy(c);
}

/* qkv and an I8 rotating ring: rows of +-FLT_MAX and +inf quantize into a
 * state decode accepts, every value finite; a scale of FLT_MAX / 64 (finite,
 * but code -128 times it is not) is refused. */
static void test_i8_scale_overflow(void **state)
{
    (void)state;
    float k[B * D], v[B * D];
    for (int i = 0; i < B * D; i++) {
        k[i] = i % 3 == 0 ? FLT_MAX : i % 3 == 1 ? -FLT_MAX : 1.0f;
        v[i] = i % 2 ? INFINITY : 2.0f;
    }
    for (int kind = 0; kind < 2; kind++) {
        kvt_cache *c = NULL, *r = NULL;
        if (kind == 0)
            assert_int_equal(kvt_qkv_create(D, 3, B, &c), 0);
        else
            assert_int_equal(kvt_rotating_create_dtype(D, 2 * B, 0, KVT_DTYPE_I8, 3, &c), 0);
        const void *in[2] = {k, v};
        assert_int_equal(kvt_cache_append(c, B, in), 0);
        kvt_cache_state st;
        assert_int_equal(kvt_cache_encode(c, &st), 0);
        assert_int_equal(kvt_cache_decode(&st, &r), 0);
        kvt_kv_rows rw;
        assert_int_equal(kind ? kvt_rotating_rows(r, &rw) : kvt_kv_block_rows(r, 0, &rw), 0);
        assert_int_equal(rw.dtype, KVT_DTYPE_I8);
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < B * D; i++) {
                const int8_t *q = h ? rw.v : rw.k;
                const float *sc = h ? rw.v_scale : rw.k_scale;
                float x = (float)q[i] * sc[i / rw.group_size];
                if (!isfinite(x))
                    fail_msg("kind %d %s element %d reads as %g", kind, h ? "V" : "K", i, (double)x);
            }
        kvt_cache_destroy(r);
        /* the scales tensor: qkv blk0.s (index 1), the ring's ring.s (index 1) */
        assert_int_equal(st.tensors[1].dtype, KVT_DTYPE_F32);
        float *sc = (float *)(void *)st.tensors[1].data, keep = sc[0];
        sc[0] = FLT_MAX / 64.0f;
        refused(&st, "at most FLT_MAX / 128");
        sc[0] = FLT_MAX / 128.0f; /* the largest accepted */
        r = NULL;
        assert_int_equal(kvt_cache_decode(&st, &r), 0);
        kvt_cache_destroy(r);
        sc[0] = keep;
        kvt_cache_state_clear(&st);
        kvt_cache_destroy(c);
    }
}

int main(void)
{
    g_seed = test_seed("test_kv_open_block");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_seal_rule),         cmocka_unit_test(test_encode_decode),
        cmocka_unit_test(test_refusals),          cmocka_unit_test(test_identity),
        cmocka_unit_test(test_layer_bytes),       cmocka_unit_test(test_engine_open_block),
        cmocka_unit_test(test_u8_step_overflow),  cmocka_unit_test(test_i8_scale_overflow),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
