/*
 * cache_rotating.c: the "rotating" cache kind, a sliding-window ring of
 * `window` token slots with `keep` attention-sink slots (see kvtier/cache.h,
 * DESIGN.md section 2).
 * It owns one reference to its ring buffer, shared with clones; it must never
 * write into the ring while another holder shares it (refs > 1) or when the
 * ring is a retained foreign buffer (a decoded file region): it copies first.
 */
#include "cache_internal.h"
#include "internal.h"

#include <string.h>

#define KVT__ROT_MAX_TOKENS ((int64_t)1 << 50)

typedef struct rot_cache {
    kvt_cache base;
    int32_t kv_dim; /* floats per token of K (and of V) */
    int32_t window; /* slots W */
    int32_t keep;   /* sink slots [0, keep), never overwritten */
    int64_t offset; /* tokens seen */
    kvt_buf *ring;  /* (2, window, kv_dim) f32: K slots then V slots */
    bool heap;      /* ring made by this library: writable when refs == 1 */
} rot_cache;

static size_t rot_ring_bytes(const rot_cache *r)
{
    return 2 * (size_t)r->window * (size_t)r->kv_dim * sizeof(float);
}

static int64_t rot_valid(const rot_cache *r) { return KVT__MIN(r->offset, (int64_t)r->window); }

/* Ring slot of token t. */
static int64_t rot_slot(const rot_cache *r, int64_t t)
{
    return t < r->keep ? t : r->keep + (t - r->keep) % (r->window - r->keep);
}

static size_t rot_private_bytes(const kvt_cache *c) { return sizeof(rot_cache); }

static void rot_foreach_buf(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx)
{
    fn(((const rot_cache *)c)->ring, ctx);
}

static void rot_range(const kvt_cache *c, int64_t *min_offset, int64_t *offset)
{
    const rot_cache *r = (const rot_cache *)c;
    *offset = r->offset;
    *min_offset = r->offset <= r->window ? 0 : r->offset;
}

static int rot_trim(kvt_cache *c, int64_t length)
{
    rot_cache *r = (rot_cache *)c;
    if (r->offset > r->window && length != r->offset)
        return kvt__fail(KVT_ERANGE, "rotating trim: the ring has wrapped");
    r->offset = length; /* slots past the new offset are stale, never read */
    return 0;
}

static rot_cache *rot_alloc(int32_t kv_dim, int32_t window, int32_t keep)
{
    rot_cache *r = kvt__calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->base.ops = &kvt__rotating_ops;
    r->kv_dim = kv_dim;
    r->window = window;
    r->keep = keep;
    return r;
}

static void rot_dispose(kvt_cache *c)
{
    rot_cache *r = (rot_cache *)c;
    kvt_buf_release(r->ring);
    kvt__free(r);
}

static int rot_clone(const kvt_cache *c, kvt_cache **out)
{
    const rot_cache *src = (const rot_cache *)c;
    rot_cache *r = rot_alloc(src->kv_dim, src->window, src->keep);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "rotating clone: cannot allocate the cache");
    r->offset = src->offset;
    r->ring = kvt_buf_retain(src->ring);
    r->heap = src->heap;
    *out = &r->base;
    return 0;
}

static int rot_append(kvt_cache *c, int64_t n, const void *const *inputs)
{
    rot_cache *r = (rot_cache *)c;
    const float *k = inputs[0], *v = inputs[1];
    if (!k || !v)
        return kvt__fail(KVT_EINVAL, "rotating append: %s input is NULL", !k ? "K" : "V");
    if (n > KVT__ROT_MAX_TOKENS - r->offset)
        return kvt__fail(KVT_ERANGE, "rotating append: %lld + %lld tokens exceeds the limit",
                         (long long)r->offset, (long long)n);
    const size_t D = (size_t)r->kv_dim, W = (size_t)r->window;
    if (!r->heap || kvt_buf_refs(r->ring) > 1) {
        /* copy-on-write: the valid slots only */
        kvt_buf *ring;
        int rc = kvt_buf_new(rot_ring_bytes(r), &ring);
        if (rc)
            return rc;
        size_t n_bytes = (size_t)rot_valid(r) * D * sizeof(float);
        const float *src = kvt_buf_data(r->ring);
        float *dst = kvt_buf_data(ring);
        memcpy(dst, src, n_bytes);
        memcpy(dst + W * D, src + W * D, n_bytes);
        kvt_buf_count_copy(2 * n_bytes);
        kvt_buf_release(r->ring);
        r->ring = ring;
        r->heap = true;
    }
    float *ks = kvt_buf_data(r->ring), *vs = ks + W * D;
    const int64_t end = r->offset + n;
    /* Only tokens no later token of this batch overwrites are written: the
     * sinks, and the last (window - keep) tokens. */
    for (int64_t t = r->offset; t < KVT__MIN(end, (int64_t)r->keep); t++) {
        memcpy(ks + (size_t)t * D, k + (size_t)(t - r->offset) * D, D * sizeof(float));
        memcpy(vs + (size_t)t * D, v + (size_t)(t - r->offset) * D, D * sizeof(float));
    }
    int64_t start = KVT__MAX(r->offset, KVT__MAX((int64_t)r->keep, end - (r->window - r->keep)));
    for (int64_t t = start; t < end; t++) {
        size_t s = (size_t)rot_slot(r, t);
        memcpy(ks + s * D, k + (size_t)(t - r->offset) * D, D * sizeof(float));
        memcpy(vs + s * D, v + (size_t)(t - r->offset) * D, D * sizeof(float));
    }
    r->offset = end;
    return 0;
}

static int rot_encode(const kvt_cache *c, kvt_cache_state *out)
{
    const rot_cache *r = (const rot_cache *)c;
    const int64_t params[3] = {r->kv_dim, r->window, r->keep};
    int64_t lo, hi;
    rot_range(c, &lo, &hi);
    int rc = kvt__state_begin(out, "rotating", hi, lo, 3, params, 1);
    if (rc)
        return rc;
    const int64_t shape[3] = {2, r->window, r->kv_dim};
    kvt__tensor_set(&out->tensors[0], "ring", KVT_DTYPE_F32, 3, shape, kvt_buf_data(r->ring),
                    kvt_buf_bytes(r->ring), r->ring, -1, -1);
    return 0;
}

static int rot_decode(const kvt_cache_state *st, kvt_cache **out)
{
    static const char *const names[3] = {"kv_dim", "window", "keep"};
    int64_t lo[3] = {1, 1, 0}, hi[3] = {KVT__DIM_MAX, KVT__DIM_MAX, KVT__DIM_MAX};
    if (st->n_params == 3 && st->params[1] >= 1)
        hi[2] = st->params[1] - 1; /* keep < window */
    int rc = kvt__params_expect(st, 3, names, lo, hi);
    if (rc)
        return rc;
    const int64_t D = st->params[0], W = st->params[1], keep = st->params[2];
    if (st->offset > KVT__ROT_MAX_TOKENS)
        return kvt__fail(KVT_EFORMAT, "rotating state: offset %lld exceeds the limit", (long long)st->offset);
    int64_t want_min = st->offset <= W ? 0 : st->offset;
    if (st->min_offset != want_min)
        return kvt__fail(KVT_EFORMAT, "rotating state: min_offset is %lld, a window of %lld at offset %lld gives %lld",
                         (long long)st->min_offset, (long long)W, (long long)st->offset, (long long)want_min);
    if (st->n_tensors != 1)
        return kvt__fail(KVT_EFORMAT, "rotating state: %d tensors, expected 1", (int)st->n_tensors);
    const int64_t shape[3] = {2, W, D};
    rc = kvt__tensor_expect(st, 0, "ring", KVT_DTYPE_F32, 3, shape);
    if (rc)
        return rc;
    rot_cache *r = rot_alloc((int32_t)D, (int32_t)W, (int32_t)keep);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "rotating decode: cannot allocate the cache");
    rc = kvt__tensor_adopt(&st->tensors[0], &r->ring, &r->heap);
    if (rc) {
        kvt__free(r);
        return rc;
    }
    r->offset = st->offset;
    *out = &r->base;
    return 0;
}

const kvt_cache_ops kvt__rotating_ops = {
    .kind = "rotating",
    .private_bytes = rot_private_bytes,
    .foreach_buf = rot_foreach_buf,
    .range = rot_range,
    .trim = rot_trim,
    .clone = rot_clone,
    .append = rot_append,
    .destroy = rot_dispose,
    .encode = rot_encode,
    .decode = rot_decode,
};

KVT_API int kvt_rotating_create(int32_t kv_dim, int32_t window, int32_t keep, kvt_cache **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_rotating_create: out is NULL");
    *out = NULL;
    if (kv_dim < 1 || kv_dim > KVT__DIM_MAX || window < 1 || window > KVT__DIM_MAX || keep < 0 || keep >= window)
        return kvt__fail(KVT_EINVAL,
                         "kvt_rotating_create: need 1 <= kv_dim, window <= %d and 0 <= keep < window "
                         "(kv_dim %d, window %d, keep %d)",
                         KVT__DIM_MAX, (int)kv_dim, (int)window, (int)keep);
    rot_cache *r = rot_alloc(kv_dim, window, keep);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "kvt_rotating_create: cannot allocate the cache");
    int rc = kvt_buf_new(rot_ring_bytes(r), &r->ring);
    if (rc) {
        kvt__free(r);
        return rc;
    }
    r->heap = true;
    *out = &r->base;
    return 0;
}

KVT_API int kvt_rotating_view(const kvt_cache *c, const float **k, const float **v, int32_t *n_valid)
{
    if (!c || c->ops != &kvt__rotating_ops)
        return kvt__fail(KVT_EINVAL, "kvt_rotating_view: not a rotating cache");
    const rot_cache *r = (const rot_cache *)c;
    const float *base = kvt_buf_data(r->ring);
    if (k)
        *k = base;
    if (v)
        *v = base + (size_t)r->window * (size_t)r->kv_dim;
    if (n_valid)
        *n_valid = (int32_t)rot_valid(r);
    return 0;
}

int32_t kvt__rotating_kv_dim(const kvt_cache *c) { return ((const rot_cache *)c)->kv_dim; }
