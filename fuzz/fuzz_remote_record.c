/*
 * fuzz_remote_record.c: the remote tier's record parser (kvt__rec_parse,
 * src/remote/record.c) on arbitrary Redis values. The first byte is a mode:
 * bit 0 rewrites the value's trailing XXH3-128 so that mutations reach the
 * header and payload checks behind the checksum; bit 1 rebuilds each layer
 * the way a restore does (its tensors aliasing the value through a wrapped
 * buffer, kvt_cache_decode) and each attachment (kvt_attachment_blob). The
 * rest is the value, copied into an allocation of exactly its size so any
 * read past it is caught.
 * A parsed record must point only inside the value: ns, tokens and block
 * keys in the header, every tensor and attachment in the payload, sized
 * dtype x shape; encoding what was parsed and parsing that again gives the
 * same record. A refusal is KVT_EFORMAT, KVT_EUNSUPPORTED, KVT_ECORRUPT or
 * KVT_ENOMEM with a message, and leaves nothing allocated.
 */
#include "fuzz_cache_check.h"

#include "internal.h"
#include "remote_internal.h"

#include "kvtier/buffer.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static int inside(const void *p, size_t n, const uint8_t *lo, const uint8_t *hi)
{
    const uint8_t *q = p;
    return n == 0 || (q >= lo && q <= hi && n <= (size_t)(hi - q));
}

/* Every view of r lies in its part of the value b[0..n). */
static void check_views(const kvt__rec *r, const uint8_t *b, size_t n)
{
    uint64_t H = (uint64_t)(b[8] | b[9] << 8 | b[10] << 16) | (uint64_t)b[11] << 24, P = le64(b + 64);
    FZ_CHECK(H + P + 16 == n, "header %llu + payload %llu + 16 != %zu", (unsigned long long)H,
             (unsigned long long)P, n);
    const uint8_t *hdr = b, *hend = b + H, *pay = b + H, *pend = b + H + P;
    FZ_CHECK(r->type == 'b' || r->type == 'e', "type %d", r->type);
    FZ_CHECK(inside(r->ns, r->ns_len, hdr, hend) && !memchr(r->ns, 0, r->ns_len), "ns outside the header");
    FZ_CHECK(r->n_tokens >= 0 && inside(r->tokens, 4 * (size_t)r->n_tokens, hdr, hend), "tokens outside the header");
    FZ_CHECK(r->n_blocks >= 0 && inside(r->block_keys, 16 * (size_t)r->n_blocks, hdr, hend),
             "block keys outside the header");
    for (int32_t l = 0; l < r->n_layers; l++) {
        const kvt__rec_layer *L = &r->layers[l];
        FZ_CHECK(L->kind[0] && memchr(L->kind, 0, sizeof L->kind), "layer %d kind", (int)l);
        FZ_CHECK(L->min_offset >= 0 && L->min_offset <= L->offset, "layer %d range", (int)l);
        FZ_CHECK(L->n_params >= 0 && L->n_params <= KVT_CACHE_PARAMS_MAX, "layer %d params", (int)l);
        for (int32_t t = 0; t < L->n_tensors; t++) {
            const kvt_tensor *x = &L->tensors[t];
            FZ_CHECK(x->name[0] && memchr(x->name, 0, sizeof x->name), "tensor name");
            FZ_CHECK(x->ndim >= 1 && x->ndim <= KVT_TENSOR_MAX_DIMS && kvt_dtype_size(x->dtype), "tensor %s rank",
                     x->name);
            uint64_t e = 1;
            for (int32_t d = 0; d < x->ndim; d++)
                e *= (uint64_t)x->shape[d];
            FZ_CHECK(x->bytes == e * kvt_dtype_size(x->dtype), "tensor %s: %zu bytes for its shape", x->name,
                     x->bytes);
            FZ_CHECK(inside(x->data, x->bytes, pay, pend), "tensor %s outside the payload", x->name);
        }
    }
    for (int32_t a = 0; a < r->n_atts; a++) {
        FZ_CHECK(r->atts[a].name[0] && memchr(r->atts[a].name, 0, sizeof r->atts[a].name), "attachment name");
        FZ_CHECK(inside(r->atts[a].data, r->atts[a].bytes, pay, pend), "attachment %d outside the payload", (int)a);
    }
}

static void check_same(const kvt__rec *a, const kvt__rec *b)
{
    FZ_CHECK(a->type == b->type && a->flags == b->flags && kvt__key_eq(a->seed, b->seed) &&
                 kvt__key_eq(a->key, b->key) && kvt__key_eq(a->parent, b->parent),
             "fixed fields differ after a re-encoding");
    FZ_CHECK(a->ns_len == b->ns_len && !memcmp(a->ns, b->ns, a->ns_len), "ns differs");
    FZ_CHECK(a->tok_begin == b->tok_begin && a->n_tokens == b->n_tokens &&
                 (!a->n_tokens || !memcmp(a->tokens, b->tokens, 4 * (size_t)a->n_tokens)),
             "tokens differ");
    FZ_CHECK(a->n_blocks == b->n_blocks && (!a->n_blocks || !memcmp(a->block_keys, b->block_keys, 16 * (size_t)a->n_blocks)),
             "block keys differ");
    FZ_CHECK(a->n_layers == b->n_layers && a->n_atts == b->n_atts, "counts differ");
    for (int32_t l = 0; l < a->n_layers; l++) {
        const kvt__rec_layer *x = &a->layers[l], *y = &b->layers[l];
        FZ_CHECK(!strcmp(x->kind, y->kind) && x->offset == y->offset && x->min_offset == y->min_offset &&
                     x->n_params == y->n_params && x->n_tensors == y->n_tensors,
                 "layer %d differs", (int)l);
        for (int32_t p = 0; p < x->n_params; p++)
            FZ_CHECK(x->params[p] == y->params[p], "layer %d param %d", (int)l, (int)p);
        for (int32_t t = 0; t < x->n_tensors; t++) {
            const kvt_tensor *u = &x->tensors[t], *v = &y->tensors[t];
            FZ_CHECK(!strcmp(u->name, v->name) && u->dtype == v->dtype && u->ndim == v->ndim && u->bytes == v->bytes &&
                         !memcmp(u->shape, v->shape, sizeof u->shape) &&
                         (!u->bytes || !memcmp(u->data, v->data, u->bytes)),
                     "layer %d tensor %d differs", (int)l, (int)t);
        }
    }
    for (int32_t i = 0; i < a->n_atts; i++)
        FZ_CHECK(!strcmp(a->atts[i].name, b->atts[i].name) && a->atts[i].bytes == b->atts[i].bytes &&
                     (!a->atts[i].bytes || !memcmp(a->atts[i].data, b->atts[i].data, a->atts[i].bytes)),
                 "attachment %d differs", (int)i);
}

static void no_free(void *ctx, void *data, size_t bytes)
{
    (void)data;
    (void)bytes;
    (*(int *)ctx)--;
}

/* What a restore does with a parsed layer: its tensors aliasing the value
 * (through buffers whose release is counted), then the kind's decode. */
static void rebuild(const kvt__rec *r)
{
    for (int32_t l = 0; l < r->n_layers; l++) {
        const kvt__rec_layer *L = &r->layers[l];
        kvt_cache_state st;
        memset(&st, 0, sizeof st);
        memcpy(st.kind, L->kind, sizeof st.kind);
        st.offset = L->offset;
        st.min_offset = L->min_offset;
        st.n_params = L->n_params;
        memcpy(st.params, L->params, sizeof st.params);
        st.tensors = calloc((size_t)(L->n_tensors ? L->n_tensors : 1), sizeof *st.tensors);
        if (!st.tensors)
            return;
        int live = 0;
        for (int32_t t = 0; t < L->n_tensors && t < 64; t++) {
            kvt_tensor *x = &st.tensors[st.n_tensors];
            *x = L->tensors[t];
            x->owner = NULL;
            if (x->bytes) {
                if (kvt_buf_wrap((void *)x->data, x->bytes, no_free, &live, &x->owner))
                    break;
                live++;
            }
            st.n_tensors++;
        }
        kvt_cache *c = NULL;
        int rc = kvt_cache_decode(&st, &c);
        for (int32_t t = 0; t < st.n_tensors; t++)
            kvt_buf_release(st.tensors[t].owner);
        free(st.tensors);
        if (rc) {
            FZ_CHECK(!c, "a failed decode returned a cache");
            FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED || rc == KVT_ENOMEM, "decode returned %d (%s)", rc,
                     kvt_last_error());
            FZ_CHECK(kvt_last_error()[0], "refusal %d without a message", rc);
            FZ_CHECK(live == 0, "a refused decode kept %d of the value's buffers", live);
            continue;
        }
        FZ_CHECK(kvt_cache_offset(c) == L->offset, "decoded offset %lld, the record says %lld",
                 (long long)kvt_cache_offset(c), (long long)L->offset);
        fz_in none = {NULL, 0};
        fz_cache_exercise(c, &none);
        kvt_cache_destroy(c);
        FZ_CHECK(live == 0, "a destroyed cache kept %d of the value's buffers", live);
    }
    for (int32_t a = 0; a < r->n_atts; a++) {
        kvt_attachment *at = NULL;
        int rc = kvt_attachment_blob(r->atts[a].name, r->atts[a].data, r->atts[a].bytes, &at);
        FZ_CHECK(rc == 0 || rc == KVT_EINVAL || rc == KVT_ENOMEM, "attachment blob %d", rc);
        kvt_attachment_destroy(at);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int mode = data[0];
    size_t n = size - 1;
    /* Redis hands replies out in malloc'd buffers: aligned, exactly sized */
    uint8_t *b = malloc(n ? n : 1);
    if (!b)
        return 0;
    if (n)
        memcpy(b, data + 1, n);
    if ((mode & 1) && n >= 16) {
        XXH128_hash_t h = XXH3_128bits(b, n - 16);
        for (int i = 0; i < 8; i++) {
            b[n - 16 + i] = (uint8_t)(h.low64 >> (8 * i));
            b[n - 8 + i] = (uint8_t)(h.high64 >> (8 * i));
        }
    }
    kvt__rec r;
    kvt__clear_error();
    int rc = kvt__rec_parse(b, n, &r);
    if (rc) {
        FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED || rc == KVT_ECORRUPT || rc == KVT_ENOMEM,
                 "parse returned %d (%s)", rc, kvt_last_error());
        FZ_CHECK(kvt_last_error()[0], "refusal %d without a message", rc);
        FZ_CHECK(!r.layers && !r.atts && !r.n_layers, "a refused record left state behind");
        free(b);
        return 0;
    }
    check_views(&r, b, n);
    /* encode(parse(x)) parses to the same record */
    void *again = NULL;
    size_t an = 0;
    rc = kvt__rec_encode(&r, &again, &an);
    FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "a parsed record does not encode (%d: %s)", rc, kvt_last_error());
    if (!rc) {
        kvt__rec r2;
        rc = kvt__rec_parse(again, an, &r2);
        FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "a re-encoded record does not parse (%d: %s)", rc, kvt_last_error());
        if (!rc) {
            check_views(&r2, again, an);
            check_same(&r, &r2);
            kvt__rec_clear(&r2);
        }
        kvt__free(again);
    }
    if (mode & 2)
        rebuild(&r);
    kvt__rec_clear(&r);
    free(b);
    return 0;
}
