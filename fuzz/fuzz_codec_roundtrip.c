/*
 * fuzz_codec_roundtrip.c: differential check of the cache codec. A cache of
 * the kind the first byte picks (kv, rotating, recurrent, qkv, qkvc;
 * attachment: a blob) is built with its public create/append/trim/clone
 * calls driven by the input, beside a plain model of what it must hold
 * (every appended row for kv, exactly for the open block of qkvc and within
 * half a quantization step for its sealed blocks, the last state for
 * recurrent). Then decode(encode(x)) must equal
 * x: the same state tensor for tensor, the same rows through the readers,
 * the same model contents, and a cache that passes fz_cache_exercise.
 */
#include "fuzz_cache_check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct model {
    float *rows; /* (cap, 2, D) K row then V row per token: kv and qkvc */
    int64_t n, cap;
    uint8_t *state; /* (state_bytes): recurrent only */
} model;

static kvt_cache *create(int sel, fz_in *in, size_t *state_bytes)
{
    kvt_cache *c = NULL;
    int32_t D = 1 + fz_u8(in) % 16, B = 1 + fz_u8(in) % 8;
    int rc = 0;
    switch (sel) {
    case FZ_KIND_KV:
        rc = kvt_kv_create(D, B, &c);
        break;
    case FZ_KIND_ROTATING: {
        int32_t W = 1 + fz_u8(in) % 16;
        rc = kvt_rotating_create(D, W, fz_u8(in) % W, &c);
        break;
    }
    case FZ_KIND_RECURRENT:
        *state_bytes = 1 + fz_u8(in) % 64;
        rc = kvt_recurrent_create(*state_bytes, &c);
        break;
    case FZ_KIND_QKVC:
        rc = kvt_qkvc_create(D, B, &c);
        break;
    default: {
        int32_t g = 1 + fz_u8(in) % 4;
        rc = kvt_qkv_create(g * (1 + D % 4), g, B, &c);
        break;
    }
    }
    FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "create of a valid %s cache failed: %s", fz_kind_names[sel],
             kvt_last_error());
    return c;
}

/* Whether the model keeps every appended row for this kind. */
static int has_rows(int sel) { return sel == FZ_KIND_KV || sel == FZ_KIND_QKVC; }

/* qkvc: the open block's rows are the appended f32 rows; a sealed block's
 * rows read back within half a step of each channel (plus rounding) of what
 * was appended, and each (min, step) is finite with step >= 0. */
static void qkvc_check(const kvt_cache *c, const model *m)
{
    size_t D = (size_t)kvt_kv_dim(c);
    int32_t B = kvt_kv_block_tokens(c);
    FZ_CHECK(kvt_cache_offset(c) == m->n, "qkvc holds %lld tokens, model %lld", (long long)kvt_cache_offset(c),
             (long long)m->n);
    for (int64_t b = 0; b * B < m->n; b++) {
        kvt_kv_rows r;
        FZ_CHECK(kvt_kv_block_rows(c, b, &r) == 0, "qkvc block %lld", (long long)b);
        for (int32_t t = 0; t < r.n; t++) {
            const float *want = m->rows + (size_t)(b * B + t) * 2 * D;
            for (size_t ch = 0; ch < D; ch++) {
                if (r.dtype == KVT_DTYPE_F32) {
                    FZ_CHECK(((const float *)r.k)[(size_t)t * D + ch] == want[ch] &&
                                 ((const float *)r.v)[(size_t)t * D + ch] == want[D + ch],
                             "qkvc open row %lld channel %zu differs from what was appended", (long long)(b * B + t), ch);
                    continue;
                }
                FZ_CHECK(r.dtype == KVT_DTYPE_U8 && r.n == B, "qkvc sealed block %lld", (long long)b);
                for (int half = 0; half < 2; half++) {
                    const uint8_t *code = half ? r.v : r.k;
                    float mn = (half ? r.v_min : r.k_min)[ch], step = (half ? r.v_scale : r.k_scale)[ch];
                    float got = fmaf((float)code[(size_t)t * D + ch], step, mn), x = want[half * D + ch];
                    float tol = 0.5f * step + 1e-5f * (fabsf(x) + fabsf(mn) + 255.0f * step + 1.0f);
                    FZ_CHECK(isfinite(mn) && isfinite(step) && step >= 0 && fabsf(got - x) <= tol,
                             "qkvc row %lld channel %zu %c: %g reads back as %g (min %g, step %g)",
                             (long long)(b * B + t), ch, half ? 'V' : 'K', (double)x, (double)got, (double)mn,
                             (double)step);
                }
            }
        }
    }
}

static void model_check(const kvt_cache *c, const model *m, int sel, size_t state_bytes)
{
    if (sel == FZ_KIND_RECURRENT) {
        FZ_CHECK(!memcmp(kvt_recurrent_state(c), m->state, state_bytes), "recurrent state differs from the last append");
        return;
    }
    if (sel == FZ_KIND_QKVC) {
        qkvc_check(c, m);
        return;
    }
    if (sel != FZ_KIND_KV)
        return;
    size_t D = (size_t)kvt_kv_dim(c);
    int32_t B = kvt_kv_block_tokens(c);
    FZ_CHECK(kvt_cache_offset(c) == m->n, "kv holds %lld tokens, model %lld", (long long)kvt_cache_offset(c),
             (long long)m->n);
    for (int64_t t = 0; t < m->n; t++) {
        const float *k, *v;
        int32_t n;
        FZ_CHECK(kvt_kv_block(c, t / B, &k, &v, &n) == 0, "block of token %lld", (long long)t);
        int64_t r = t % B;
        FZ_CHECK(!memcmp(k + r * D, m->rows + (size_t)t * 2 * D, D * 4) &&
                     !memcmp(v + r * D, m->rows + (size_t)t * 2 * D + D, D * 4),
                 "token %lld differs from what was appended", (long long)t);
    }
}

static void blob_roundtrip(fz_in *in)
{
    size_t n = fz_u8(in);
    const uint8_t *p = fz_take(in, n);
    if (!p)
        return;
    kvt_attachment *a = NULL, *b = NULL;
    if (kvt_attachment_blob("fuzz.blob", p, n, &a))
        return;
    const void *s = NULL;
    size_t sn = 0;
    FZ_CHECK(!a->ops->serialize(a, &s, &sn) && sn == n, "serialize");
    if (!kvt_attachment_blob(a->name, s, sn, &b)) {
        size_t bn = 0;
        const void *q = kvt_attachment_blob_data(b, &bn);
        FZ_CHECK(bn == n && (!n || !memcmp(q, p, n)), "blob(serialize(x)) != x");
        kvt_attachment_destroy(b);
    }
    kvt_attachment_destroy(a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size};
    int sel = fz_u8(&in) % FZ_KIND_COUNT;
    if (sel == FZ_KIND_ATTACHMENT) {
        blob_roundtrip(&in);
        return 0;
    }
    size_t state_bytes = 0;
    kvt_cache *c = create(sel, &in, &state_bytes), *keep = NULL;
    if (!c)
        return 0;
    model m = {0};
    m.state = calloc(state_bytes ? state_bytes : 1, 1);
    size_t D = (size_t)kvt_kv_dim(c);
    for (int step = 0; step < 64 && in.n; step++) {
        int op = fz_u8(&in) % 4;
        if (op == 0) { /* append */
            int64_t n = 1 + fz_u8(&in) % 5;
            if (sel == FZ_KIND_RECURRENT) {
                uint8_t *st = malloc(state_bytes);
                for (size_t i = 0; i < state_bytes; i++)
                    st[i] = fz_u8(&in);
                const void *inputs[1] = {st};
                if (!kvt_cache_append(c, n, inputs))
                    memcpy(m.state, st, state_bytes);
                free(st);
                continue;
            }
            float *k = malloc(sizeof(float) * D * (size_t)n), *v = malloc(sizeof(float) * D * (size_t)n);
            for (size_t i = 0; i < D * (size_t)n; i++) {
                k[i] = (float)(int16_t)fz_u16(&in) / 256.0f;
                v[i] = (float)(int16_t)fz_u16(&in) / 256.0f;
            }
            const void *inputs[2] = {k, v};
            int rc = kvt_cache_append(c, n, inputs);
            FZ_CHECK(rc == 0 || rc == KVT_ERANGE || rc == KVT_ENOMEM, "append failed: %s", kvt_last_error());
            if (!rc && has_rows(sel)) {
                if (m.n + n > m.cap) {
                    m.cap = 2 * (m.n + n);
                    m.rows = realloc(m.rows, sizeof(float) * 2 * D * (size_t)m.cap);
                }
                for (int64_t t = 0; t < n; t++) {
                    memcpy(m.rows + (size_t)(m.n + t) * 2 * D, k + (size_t)t * D, D * 4);
                    memcpy(m.rows + (size_t)(m.n + t) * 2 * D + D, v + (size_t)t * D, D * 4);
                }
                m.n += n;
            }
            free(k);
            free(v);
        } else if (op == 1) { /* trim inside the range */
            int64_t lo, off;
            kvt_cache_range(c, &lo, &off);
            int64_t len = lo + fz_u8(&in) % (off - lo + 1);
            if (!kvt_cache_trim(c, len) && has_rows(sel))
                m.n = len;
        } else if (op == 2) { /* continue on a clone (shared blocks, copy on write) */
            kvt_cache *d = NULL;
            if (!kvt_cache_clone(c, &d)) {
                kvt_cache_destroy(c);
                c = d;
            }
        } else { /* keep a clone alive beside it */
            kvt_cache_destroy(keep);
            keep = NULL;
            kvt_cache_clone(c, &keep);
        }
        model_check(c, &m, sel, state_bytes);
    }
    kvt_cache_state s1, s2;
    if (!kvt_cache_encode(c, &s1)) {
        kvt_cache *d = NULL;
        int rc = kvt_cache_decode(&s1, &d);
        FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "decode(encode(x)) failed: %s", kvt_last_error());
        if (!rc) {
            int64_t lo1, off1, lo2, off2;
            kvt_cache_range(c, &lo1, &off1);
            kvt_cache_range(d, &lo2, &off2);
            FZ_CHECK(lo1 == lo2 && off1 == off2, "range [%lld, %lld] decodes as [%lld, %lld]", (long long)lo1,
                     (long long)off1, (long long)lo2, (long long)off2);
            FZ_CHECK(kvt_kv_dim(d) == kvt_kv_dim(c) && kvt_kv_block_tokens(d) == kvt_kv_block_tokens(c),
                     "shape differs after decode");
            model_check(d, &m, sel, state_bytes);
            if (!kvt_cache_encode(d, &s2)) {
                const char *why;
                FZ_CHECK(fz_state_equal(&s1, &s2, &why), "encode(decode(encode(x))) != encode(x): %s", why);
                kvt_cache_state_clear(&s2);
            }
            fz_cache_exercise(d, &in);
            kvt_cache_destroy(d);
        }
        kvt_cache_state_clear(&s1);
    }
    fz_cache_exercise(c, &in);
    kvt_cache_destroy(keep);
    kvt_cache_destroy(c);
    free(m.rows);
    free(m.state);
    return 0;
}
