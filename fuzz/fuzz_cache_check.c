/*
 * fuzz_cache_check.c: see fuzz_cache_check.h.
 */
#include "fuzz_cache_check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int fz_state_equal(const kvt_cache_state *a, const kvt_cache_state *b, const char **why)
{
    *why = NULL;
    if (strcmp(a->kind, b->kind))
        *why = "kind";
    else if (a->offset != b->offset || a->min_offset != b->min_offset)
        *why = "range";
    else if (a->n_params != b->n_params || memcmp(a->params, b->params, sizeof a->params[0] * (size_t)a->n_params))
        *why = "params";
    else if (a->n_tensors != b->n_tensors)
        *why = "tensor count";
    for (int32_t i = 0; !*why && i < a->n_tensors; i++) {
        const kvt_tensor *x = &a->tensors[i], *y = &b->tensors[i];
        if (strcmp(x->name, y->name))
            *why = "tensor name";
        else if (x->dtype != y->dtype || x->ndim != y->ndim ||
                 memcmp(x->shape, y->shape, sizeof x->shape[0] * (size_t)x->ndim))
            *why = "tensor dtype or shape";
        else if (x->tok_begin != y->tok_begin || x->tok_end != y->tok_end)
            *why = "tensor token range";
        else if (x->bytes != y->bytes || (x->bytes && memcmp(x->data, y->data, x->bytes)))
            *why = "tensor bytes";
    }
    return *why == NULL;
}

/* Bytes of one appended token's inputs, or 0 when the kind takes none we
 * can build here (recurrent: the whole state). */
static size_t kv_row_floats(const kvt_cache *c) { return (size_t)kvt_kv_dim(c); }

static void check_readers(const kvt_cache *c)
{
    const char *kind = kvt_cache_kind(c);
    int64_t lo, off;
    kvt_cache_range(c, &lo, &off);
    if (!strcmp(kind, "kv")) {
        int32_t B = kvt_kv_block_tokens(c);
        FZ_CHECK(B >= 1, "kv block_tokens %d", (int)B);
        int64_t nb = (off + B - 1) / B, total = 0;
        size_t D = (size_t)kvt_kv_dim(c);
        for (int64_t i = 0; i < nb; i++) {
            kvt_kv_rows r;
            FZ_CHECK(kvt_kv_block_rows(c, i, &r) == 0 && r.n >= 1 && r.n <= B, "kv block %lld", (long long)i);
            /* touch the first and last byte: ASan sees a short block */
            size_t bytes = (size_t)r.n * D * (r.dtype == KVT_DTYPE_F32 ? 4u : r.dtype == KVT_DTYPE_I8 ? 1u : 2u);
            const unsigned char *kb = r.k, *vb = r.v;
            volatile unsigned s = kb[0] + vb[0] + kb[bytes - 1] + vb[bytes - 1];
            (void)s;
            if (r.dtype == KVT_DTYPE_F32) { /* the F32 reader agrees with the rows */
                const float *k = NULL, *v = NULL;
                int32_t n = -1;
                FZ_CHECK(kvt_kv_block(c, i, &k, &v, &n) == 0 && n == r.n && (const void *)k == r.k,
                         "kv block %lld (F32 reader)", (long long)i);
            }
            total += r.n;
        }
        FZ_CHECK(total == off, "kv blocks hold %lld of %lld tokens", (long long)total, (long long)off);
        kvt_kv_rows r;
        FZ_CHECK(kvt_kv_block_rows(c, nb, &r) == KVT_ERANGE, "kv block past the end");
    } else if (!strcmp(kind, "rotating")) {
        const float *k = NULL, *v = NULL;
        int32_t n = -1;
        FZ_CHECK(kvt_rotating_view(c, &k, &v, &n) == 0 && n >= 0 && n <= off, "rotating view");
        if (n) {
            size_t D = (size_t)kvt_kv_dim(c);
            volatile float s = k[0] + v[0] + k[(size_t)n * D - 1] + v[(size_t)n * D - 1];
            (void)s;
        }
    } else if (!strcmp(kind, "recurrent")) {
        FZ_CHECK(kvt_recurrent_state(c) != NULL, "recurrent state");
        FZ_CHECK(lo == off, "recurrent range [%lld, %lld]", (long long)lo, (long long)off);
    } else if (!strcmp(kind, "qkvc")) {
        /* sealed blocks: U8 codes of B rows with per-channel (min, step), each
         * finite with step >= 0, or F16/BF16 rows; then the open block's F32
         * rows, if any */
        int32_t B = kvt_kv_block_tokens(c);
        size_t D = (size_t)kvt_kv_dim(c);
        FZ_CHECK(B >= 1 && D >= 1 && lo % B == 0 && off - lo <= B, "qkvc B %d, range [%lld, %lld]", (int)B,
                 (long long)lo, (long long)off);
        int64_t sealed = lo / B, total = 0;
        for (int64_t i = 0; i < sealed && kvt_kv_dtype(c) != KVT_DTYPE_U8; i++) {
            kvt_kv_rows r;
            FZ_CHECK(kvt_kv_block_rows(c, i, &r) == 0 && r.dtype == kvt_kv_dtype(c) && r.n == B && !r.k_scale &&
                         (r.dtype == KVT_DTYPE_F16 || r.dtype == KVT_DTYPE_BF16),
                     "qkvc 16-bit sealed block %lld", (long long)i);
            const uint16_t *kb = r.k, *vb = r.v;
            volatile unsigned s = kb[0] + vb[0] + kb[(size_t)B * D - 1] + vb[(size_t)B * D - 1];
            (void)s;
            total += r.n;
        }
        for (int64_t i = 0; i < sealed && kvt_kv_dtype(c) == KVT_DTYPE_U8; i++) {
            kvt_kv_rows r;
            FZ_CHECK(kvt_kv_block_rows(c, i, &r) == 0 && r.dtype == KVT_DTYPE_U8 && r.n == B && r.k_min &&
                         r.k_scale && r.v_min && r.v_scale,
                     "qkvc sealed block %lld", (long long)i);
            for (size_t ch = 0; ch < D; ch++)
                FZ_CHECK(isfinite(r.k_min[ch]) && isfinite(r.v_min[ch]) && isfinite(r.k_scale[ch]) &&
                             isfinite(r.v_scale[ch]) && !(r.k_scale[ch] < 0) && !(r.v_scale[ch] < 0),
                         "qkvc block %lld channel %zu: min %g %g step %g %g", (long long)i, ch,
                         (double)r.k_min[ch], (double)r.v_min[ch], (double)r.k_scale[ch], (double)r.v_scale[ch]);
            const uint8_t *kb = r.k, *vb = r.v;
            volatile unsigned s = kb[0] + vb[0] + kb[(size_t)B * D - 1] + vb[(size_t)B * D - 1];
            (void)s;
            total += r.n;
        }
        kvt_kv_rows r;
        if (off > lo) {
            FZ_CHECK(kvt_kv_block_rows(c, sealed, &r) == 0 && r.dtype == KVT_DTYPE_F32 && r.n == off - lo,
                     "qkvc open block of %lld rows", (long long)(off - lo));
            const float *k = r.k, *v = r.v;
            volatile float s = k[0] + v[0] + k[(size_t)r.n * D - 1] + v[(size_t)r.n * D - 1];
            (void)s;
            total += r.n;
        }
        FZ_CHECK(total == off, "qkvc blocks hold %lld of %lld tokens", (long long)total, (long long)off);
        FZ_CHECK(kvt_kv_block_rows(c, sealed + (off > lo), &r) == KVT_ERANGE, "qkvc block past the end");
    } else if (!strcmp(kind, "qkv")) {
        int32_t B = kvt_kv_block_tokens(c), D = kvt_kv_dim(c);
        if ((uint64_t)B * (uint64_t)D <= (1u << 20)) {
            float *k = malloc(sizeof(float) * (size_t)B * (size_t)D), *v = malloc(sizeof(float) * (size_t)B * (size_t)D);
            int64_t nb = (off + B - 1) / B, total = 0;
            for (int64_t i = 0; k && v && i < nb; i++) {
                int32_t n = -1;
                FZ_CHECK(kvt_qkv_read_block(c, i, k, v, &n) == 0 && n >= 1 && n <= B, "qkv block %lld",
                         (long long)i);
                total += n;
            }
            FZ_CHECK(!k || !v || total == off, "qkv blocks hold %lld of %lld tokens", (long long)total,
                     (long long)off);
            free(k);
            free(v);
        }
    }
}

void fz_cache_exercise(const kvt_cache *c, fz_in *in)
{
    int64_t lo = -1, off = -1;
    kvt_cache_range(c, &lo, &off);
    FZ_CHECK(lo >= 0 && lo <= off && off == kvt_cache_offset(c), "range [%lld, %lld]", (long long)lo,
             (long long)off);
    (void)kvt_cache_bytes(c);
    check_readers(c);

    /* encode -> decode -> encode is the same state */
    kvt_cache_state s1, s2;
    int rc = kvt_cache_encode(c, &s1);
    if (rc) {
        FZ_CHECK(rc == KVT_ENOMEM, "encode failed: %s", kvt_last_error());
        return;
    }
    FZ_CHECK(s1.offset == off && s1.min_offset == lo, "encoded range differs");
    kvt_cache *d = NULL;
    rc = kvt_cache_decode(&s1, &d);
    FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "a state encode made does not decode: %s", kvt_last_error());
    if (!rc) {
        FZ_CHECK(kvt_cache_encode(d, &s2) == 0, "re-encode failed");
        const char *why;
        FZ_CHECK(fz_state_equal(&s1, &s2, &why), "decode(encode(x)) differs from x: %s", why);
        kvt_cache_state_clear(&s2);
        kvt_cache_destroy(d);
    }
    kvt_cache_state_clear(&s1);

    /* trim a clone to a length inside the range (and one outside) */
    kvt_cache *t = NULL;
    if (kvt_cache_clone(c, &t))
        return;
    int64_t span = off - lo + 1;
    int64_t len = lo + (int64_t)(fz_u32(in) % (uint64_t)span);
    FZ_CHECK(kvt_cache_can_trim(t, len), "length %lld inside [%lld, %lld] refused", (long long)len,
             (long long)lo, (long long)off);
    rc = kvt_cache_trim(t, len);
    FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "trim to %lld failed: %s", (long long)len, kvt_last_error());
    if (!rc) {
        FZ_CHECK(kvt_cache_offset(t) == len, "trimmed to %lld, holds %lld", (long long)len,
                 (long long)kvt_cache_offset(t));
        check_readers(t);
    }
    FZ_CHECK(kvt_cache_trim(t, kvt_cache_offset(t) + 1) == KVT_ERANGE, "trim past the offset accepted");

    /* append a few tokens when the row size is small */
    const char *kind = kvt_cache_kind(t);
    size_t D = kv_row_floats(t);
    int64_t n = 1 + fz_u8(in) % 4;
    int blocked = !strcmp(kind, "kv") || !strcmp(kind, "qkv") || !strcmp(kind, "qkvc");
    uint64_t block_bytes = blocked ? (uint64_t)kvt_kv_block_tokens(t) * D * 8 : D * 8;
    if (strcmp(kind, "recurrent") && D && D * (size_t)n <= (1u << 16) && block_bytes <= (16u << 20)) {
        float *kv = calloc(2 * D * (size_t)n, sizeof(float));
        if (kv) {
            for (size_t i = 0; i < 2 * D * (size_t)n; i++)
                kv[i] = (float)(int8_t)fz_u8(in) / 16.0f;
            const void *inputs[2] = {kv, kv + D * (size_t)n};
            int64_t before = kvt_cache_offset(t);
            rc = kvt_cache_append(t, n, inputs);
            FZ_CHECK(rc == 0 || rc == KVT_ERANGE || rc == KVT_ENOMEM, "append failed: %s", kvt_last_error());
            if (!rc) {
                FZ_CHECK(kvt_cache_offset(t) == before + n, "append of %lld tokens", (long long)n);
                check_readers(t);
            }
            free(kv);
        }
    }
    kvt_cache_destroy(t);
}
