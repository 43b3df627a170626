/*
 * record.c: the remote tier's self-describing record (layout in
 * remote_internal.h): one value holds a header (format version, identity
 * seed, its own key, parent key, ns, tokens, layer descriptions with tensor
 * names, dtypes and shapes, attachments), the payload and an XXH3-128 of
 * both. Encoding reads cache states made by the cache kinds' encode op;
 * parsing checks every count, offset, size and the checksum and hands out
 * views into the value, for the tier to check against what it asked for and
 * to rebuild caches with the kinds' decode op.
 * It must never read outside the value, whatever its bytes.
 */
#include "remote_internal.h"

#include <string.h>
#include <xxhash.h>

#define FIXED 104        /* bytes before the ns */
#define LAYER_FIXED 120  /* kind[32] + 2 i64 + 2 u32 + 8 i64 */
#define TENSOR_BYTES 120 /* name[64] + 2 u32 + 4 i64 + 2 u64 */
#define ATT_BYTES 80     /* name[64] + 2 u64 */
#define ALIGN 64
#define ELEMS_MAX ((uint64_t)1 << 56) /* elements of one tensor: x 8 bytes stays far from overflow */

static size_t up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void putkey(uint8_t *p, kvt__key k)
{
    put64(p, k.lo);
    put64(p + 8, k.hi);
}
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}
static kvt__key getkey(const uint8_t *p) { return (kvt__key){get64(p), get64(p + 8)}; }

kvt__key kvt__rec_block_key(const kvt__rec *r, int32_t i) { return getkey(r->block_keys + 16 * (size_t)i); }

/* Header bytes of *r before padding. */
static size_t header_bytes(const kvt__rec *r)
{
    size_t h = FIXED + up(r->ns_len, 8) + up(4 * (size_t)r->n_tokens, 8) + 16 * (size_t)r->n_blocks;
    for (int32_t l = 0; l < r->n_layers; l++)
        h += LAYER_FIXED + TENSOR_BYTES * (size_t)r->layers[l].n_tensors;
    return h + ATT_BYTES * (size_t)r->n_atts;
}

int kvt__rec_encode(const kvt__rec *r, void **out, size_t *out_bytes)
{
    *out = NULL;
    *out_bytes = 0;
    if (r->n_layers < 0 || r->n_layers > KVT__REC_MAX_LAYERS || r->n_atts < 0 || r->n_atts > KVT__REC_MAX_TENSORS ||
        r->n_blocks < 0 || r->n_tokens < 0 || r->n_tokens > ((int64_t)1 << 36))
        return kvt__fail(KVT_EINVAL, "remote record: counts out of range");
    size_t payload = 0;
    for (int32_t l = 0; l < r->n_layers; l++) {
        if (r->layers[l].n_tensors < 0 || r->layers[l].n_tensors > KVT__REC_MAX_TENSORS ||
            r->layers[l].n_params < 0 || r->layers[l].n_params > KVT_CACHE_PARAMS_MAX)
            return kvt__fail(KVT_EINVAL, "remote record: layer %d has too many tensors or params", (int)l);
        for (int32_t t = 0; t < r->layers[l].n_tensors; t++)
            payload = up(payload, ALIGN) + r->layers[l].tensors[t].bytes;
    }
    for (int32_t a = 0; a < r->n_atts; a++)
        payload = up(payload, ALIGN) + r->atts[a].bytes;
    size_t H = up(header_bytes(r), ALIGN), total = H + payload + 16;
    if (H > UINT32_MAX)
        return kvt__fail(KVT_EINVAL, "remote record: header of %zu bytes is too large", H);
    uint8_t *b = kvt__calloc(1, total);
    if (!b)
        return kvt__fail(KVT_ENOMEM, "remote record: cannot allocate %zu bytes", total);
    memcpy(b, "KVTR", 4);
    put16(b + 4, KVT__REC_VERSION);
    b[6] = (uint8_t)r->type;
    b[7] = r->flags;
    put32(b + 8, (uint32_t)H);
    putkey(b + 16, r->seed);
    putkey(b + 32, r->key);
    putkey(b + 48, r->parent);
    put64(b + 64, payload);
    put64(b + 72, (uint64_t)r->tok_begin);
    put64(b + 80, (uint64_t)r->n_tokens);
    put32(b + 88, r->ns_len);
    put32(b + 92, (uint32_t)r->n_layers);
    put32(b + 96, (uint32_t)r->n_atts);
    put32(b + 100, (uint32_t)r->n_blocks);
    size_t at = FIXED;
    memcpy(b + at, r->ns, r->ns_len);
    at += up(r->ns_len, 8);
    for (int64_t i = 0; i < r->n_tokens; i++)
        put32(b + at + 4 * (size_t)i, (uint32_t)r->tokens[i]);
    at += up(4 * (size_t)r->n_tokens, 8);
    if (r->n_blocks)
        memcpy(b + at, r->block_keys, 16 * (size_t)r->n_blocks);
    at += 16 * (size_t)r->n_blocks;
    size_t poff = 0;
    for (int32_t l = 0; l < r->n_layers; l++) {
        const kvt__rec_layer *L = &r->layers[l];
        memcpy(b + at, L->kind, sizeof L->kind);
        put64(b + at + 32, (uint64_t)L->offset);
        put64(b + at + 40, (uint64_t)L->min_offset);
        put32(b + at + 48, (uint32_t)L->n_params);
        put32(b + at + 52, (uint32_t)L->n_tensors);
        for (int p = 0; p < KVT_CACHE_PARAMS_MAX; p++)
            put64(b + at + 56 + 8 * (size_t)p, (uint64_t)(p < L->n_params ? L->params[p] : 0));
        at += LAYER_FIXED;
        for (int32_t t = 0; t < L->n_tensors; t++) {
            const kvt_tensor *x = &L->tensors[t];
            memcpy(b + at, x->name, KVT_TENSOR_NAME_MAX);
            b[at + KVT_TENSOR_NAME_MAX - 1] = 0;
            put32(b + at + 64, (uint32_t)x->dtype);
            put32(b + at + 68, (uint32_t)x->ndim);
            for (int d = 0; d < KVT_TENSOR_MAX_DIMS; d++)
                put64(b + at + 72 + 8 * (size_t)d, (uint64_t)(d < x->ndim ? x->shape[d] : 0));
            poff = up(poff, ALIGN);
            put64(b + at + 104, x->bytes);
            put64(b + at + 112, poff);
            if (x->bytes)
                memcpy(b + H + poff, x->data, x->bytes);
            poff += x->bytes;
            at += TENSOR_BYTES;
        }
    }
    for (int32_t a = 0; a < r->n_atts; a++) {
        memcpy(b + at, r->atts[a].name, KVT_TENSOR_NAME_MAX);
        b[at + KVT_TENSOR_NAME_MAX - 1] = 0;
        poff = up(poff, ALIGN);
        put64(b + at + 64, r->atts[a].bytes);
        put64(b + at + 72, poff);
        if (r->atts[a].bytes)
            memcpy(b + H + poff, r->atts[a].data, r->atts[a].bytes);
        poff += r->atts[a].bytes;
        at += ATT_BYTES;
    }
    XXH128_hash_t h = XXH3_128bits(b, H + payload);
    putkey(b + H + payload, (kvt__key){h.low64, h.high64});
    *out = b;
    *out_bytes = total;
    return 0;
}

void kvt__rec_clear(kvt__rec *r)
{
    if (!r)
        return;
    if (r->layers)
        for (int32_t l = 0; l < r->n_layers; l++)
            kvt__free(r->layers[l].tensors);
    kvt__free(r->layers);
    kvt__free(r->atts);
    memset(r, 0, sizeof *r);
}

/* A NUL inside a fixed-size name field, and the name not empty. */
static int name_ok(const uint8_t *p) { return p[0] && memchr(p, 0, KVT_TENSOR_NAME_MAX) != NULL; }

int kvt__rec_parse(const void *buf, size_t n, kvt__rec *out)
{
    memset(out, 0, sizeof *out);
    const uint8_t *b = buf;
    if (n < FIXED + 16 || memcmp(b, "KVTR", 4) != 0)
        return kvt__fail(KVT_EFORMAT, "remote record: not a kvtier record (%zu bytes)", n);
    if (get16(b + 4) != KVT__REC_VERSION)
        return kvt__fail(KVT_EUNSUPPORTED, "remote record: format version %u, this build reads %u",
                         (unsigned)get16(b + 4), (unsigned)KVT__REC_VERSION);
    uint64_t H = get32(b + 8), P = get64(b + 64);
    if (H < FIXED || H % ALIGN || H > n || P > n - H || n - H - P != 16)
        return kvt__fail(KVT_EFORMAT, "remote record: header %llu and payload %llu bytes do not fit %zu",
                         (unsigned long long)H, (unsigned long long)P, n);
    XXH128_hash_t h = XXH3_128bits(b, (size_t)(H + P));
    if (!kvt__key_eq(getkey(b + H + P), (kvt__key){h.low64, h.high64}))
        return kvt__fail(KVT_ECORRUPT, "remote record: checksum mismatch");
    out->type = (char)b[6];
    out->flags = b[7];
    if (out->type != 'b' && out->type != 'e')
        return kvt__fail(KVT_EFORMAT, "remote record: unknown type %d", b[6]);
    out->seed = getkey(b + 16);
    out->key = getkey(b + 32);
    out->parent = getkey(b + 48);
    out->tok_begin = (int64_t)get64(b + 72);
    out->n_tokens = (int64_t)get64(b + 80);
    out->ns_len = get32(b + 88);
    uint32_t nl = get32(b + 92), na = get32(b + 96), nk = get32(b + 100);
    if (out->tok_begin < 0 || out->n_tokens < 0 || (uint64_t)out->n_tokens > H / 4 || out->ns_len > H ||
        nl > KVT__REC_MAX_LAYERS || na > KVT__REC_MAX_TENSORS || nk > H / 16)
        return kvt__fail(KVT_EFORMAT, "remote record: counts out of range");
    size_t at = FIXED;
    if (at + up(out->ns_len, 8) > H)
        return kvt__fail(KVT_EFORMAT, "remote record: ns past the header");
    out->ns = (const char *)b + at;
    if (memchr(out->ns, 0, out->ns_len))
        return kvt__fail(KVT_EFORMAT, "remote record: NUL inside the ns");
    at += up(out->ns_len, 8);
    size_t tb = up(4 * (size_t)out->n_tokens, 8);
    if (tb > H - at)
        return kvt__fail(KVT_EFORMAT, "remote record: tokens past the header");
    out->tokens = (const int32_t *)(const void *)(b + at); /* 8-aligned in an aligned value */
    at += tb;
    if (16 * (size_t)nk > H - at)
        return kvt__fail(KVT_EFORMAT, "remote record: block keys past the header");
    out->block_keys = b + at;
    out->n_blocks = (int32_t)nk;
    at += 16 * (size_t)nk;
    out->layers = kvt__calloc(nl ? nl : 1, sizeof *out->layers);
    out->atts = kvt__calloc(na ? na : 1, sizeof *out->atts);
    if (!out->layers || !out->atts) {
        kvt__rec_clear(out);
        return kvt__fail(KVT_ENOMEM, "remote record: out of memory");
    }
    out->n_layers = (int32_t)nl;
    out->n_atts = (int32_t)na;
    int rc = 0;
    for (uint32_t l = 0; l < nl; l++) {
        kvt__rec_layer *L = &out->layers[l];
        if (LAYER_FIXED > H - at) {
            rc = kvt__fail(KVT_EFORMAT, "remote record: layer %u past the header", l);
            goto bad;
        }
        memcpy(L->kind, b + at, sizeof L->kind);
        if (!L->kind[0] || !memchr(L->kind, 0, sizeof L->kind)) {
            rc = kvt__fail(KVT_EFORMAT, "remote record: layer %u has a bad kind name", l);
            goto bad;
        }
        L->offset = (int64_t)get64(b + at + 32);
        L->min_offset = (int64_t)get64(b + at + 40);
        uint32_t np = get32(b + at + 48), nt = get32(b + at + 52);
        /* the tensor table follows the layer's fixed part: both inside the header */
        if (np > KVT_CACHE_PARAMS_MAX || nt > KVT__REC_MAX_TENSORS ||
            (uint64_t)nt * TENSOR_BYTES > H - at - LAYER_FIXED ||
            L->offset < 0 || L->min_offset < 0 || L->min_offset > L->offset) {
            rc = kvt__fail(KVT_EFORMAT, "remote record: layer %u out of range", l);
            goto bad;
        }
        L->n_params = (int32_t)np;
        for (uint32_t p = 0; p < KVT_CACHE_PARAMS_MAX; p++)
            L->params[p] = (int64_t)get64(b + at + 56 + 8 * (size_t)p);
        at += LAYER_FIXED;
        L->n_tensors = (int32_t)nt;
        L->tensors = kvt__calloc(nt ? nt : 1, sizeof *L->tensors);
        if (!L->tensors) {
            rc = kvt__fail(KVT_ENOMEM, "remote record: out of memory");
            goto bad;
        }
        for (uint32_t t = 0; t < nt; t++, at += TENSOR_BYTES) {
            kvt_tensor *x = &L->tensors[t];
            if (!name_ok(b + at)) {
                rc = kvt__fail(KVT_EFORMAT, "remote record: layer %u tensor %u has a bad name", l, t);
                goto bad;
            }
            memcpy(x->name, b + at, KVT_TENSOR_NAME_MAX);
            uint32_t dt = get32(b + at + 64), nd = get32(b + at + 68);
            size_t es = dt < KVT_DTYPE_COUNT ? kvt_dtype_size((kvt_dtype)dt) : 0;
            if (!es || nd < 1 || nd > KVT_TENSOR_MAX_DIMS) {
                rc = kvt__fail(KVT_EFORMAT, "remote record: layer %u tensor %s: bad dtype or rank", l, x->name);
                goto bad;
            }
            x->dtype = (kvt_dtype)dt;
            x->ndim = (int32_t)nd;
            /* the running product of the dims is bounded by a constant, not
             * by this value's payload, so whether a shape is accepted never
             * depends on how much payload other tensors take */
            uint64_t elems = 1;
            for (uint32_t d = 0; d < nd; d++) {
                uint64_t s = get64(b + at + 72 + 8 * (size_t)d);
                if (s > ELEMS_MAX || (s && elems > ELEMS_MAX / s)) {
                    rc = kvt__fail(KVT_EFORMAT, "remote record: tensor %s: shape too large", x->name);
                    goto bad;
                }
                x->shape[d] = (int64_t)s;
                elems *= s;
            }
            uint64_t bytes = get64(b + at + 104), off = get64(b + at + 112);
            if (bytes != elems * es || off > P || bytes > P - off) {
                rc = kvt__fail(KVT_EFORMAT, "remote record: tensor %s: %llu bytes at %llu do not fit", x->name,
                               (unsigned long long)bytes, (unsigned long long)off);
                goto bad;
            }
            x->bytes = (size_t)bytes;
            x->data = b + H + off;
            x->owner = NULL;
            x->tok_begin = x->tok_end = -1;
        }
    }
    for (uint32_t a = 0; a < na; a++, at += ATT_BYTES) {
        if (ATT_BYTES > H - at || !name_ok(b + at)) {
            rc = kvt__fail(KVT_EFORMAT, "remote record: attachment %u malformed", a);
            goto bad;
        }
        memcpy(out->atts[a].name, b + at, KVT_TENSOR_NAME_MAX);
        uint64_t bytes = get64(b + at + 64), off = get64(b + at + 72);
        if (off > P || bytes > P - off) {
            rc = kvt__fail(KVT_EFORMAT, "remote record: attachment %u past the payload", a);
            goto bad;
        }
        out->atts[a].bytes = (size_t)bytes;
        out->atts[a].data = b + H + off;
    }
    return 0;
bad:
    kvt__rec_clear(out);
    return rc;
}
