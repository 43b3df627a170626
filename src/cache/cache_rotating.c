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
    int32_t kv_dim;     /* elements per token of K (and of V) */
    int32_t window;     /* slots W */
    int32_t keep;       /* sink slots [0, keep), never overwritten */
    kvt_dtype dtype;    /* storage scheme: F32, F16, BF16 or I8 */
    int32_t group_size; /* I8: elements per scale; 0 otherwise */
    int64_t offset;     /* tokens seen */
    kvt_buf *ring;      /* F32/F16/BF16: (2, window, kv_dim) of dtype, K slots then V slots;
                           I8: scales (2, window, kv_dim / group_size) f32, then codes
                           (2, window, kv_dim) i8 */
    bool heap;          /* ring made by this library: writable when refs == 1 */
} rot_cache;

/* The ring is one or two parts (elements; or I8 scales then codes), each
 * (2, window, row bytes): K slots then V slots. */
static int rot_parts(const rot_cache *r) { return r->dtype == KVT_DTYPE_I8 ? 2 : 1; }

static size_t rot_row_bytes(const rot_cache *r, int part)
{
    if (r->dtype == KVT_DTYPE_I8)
        return part == 0 ? (size_t)(r->kv_dim / r->group_size) * sizeof(float) : (size_t)r->kv_dim;
    return (size_t)r->kv_dim * kvt_dtype_size(r->dtype);
}

/* K (v = 0) or V (v = 1) slots of one part of the ring at base. */
static char *rot_at(const rot_cache *r, const void *base, int part, int v)
{
    size_t off = 0;
    for (int p = 0; p < part; p++)
        off += 2 * (size_t)r->window * rot_row_bytes(r, p);
    return (char *)base + off + (size_t)v * (size_t)r->window * rot_row_bytes(r, part);
}

static size_t rot_ring_bytes(const rot_cache *r)
{
    size_t n = 0;
    for (int p = 0; p < rot_parts(r); p++)
        n += 2 * (size_t)r->window * rot_row_bytes(r, p);
    return n;
}

/* Stores the f32 row x (kv_dim) as K (v = 0) or V (v = 1) of `slot`. */
static void rot_put(rot_cache *r, int v, size_t slot, const float *x)
{
    void *base = kvt_buf_data(r->ring);
    if (r->dtype == KVT_DTYPE_I8)
        kvt__q8_quantize_row(x, (size_t)r->kv_dim, (size_t)r->group_size,
                             (float *)(void *)(rot_at(r, base, 0, v) + slot * rot_row_bytes(r, 0)),
                             (int8_t *)(rot_at(r, base, 1, v) + slot * rot_row_bytes(r, 1)));
    else /* the dtype was checked at create */
        (void)kvt_dtype_from_f32(r->dtype, x, rot_at(r, base, 0, v) + slot * rot_row_bytes(r, 0), (size_t)r->kv_dim);
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

static rot_cache *rot_alloc(int32_t kv_dim, int32_t window, int32_t keep, kvt_dtype dtype, int32_t group_size)
{
    rot_cache *r = kvt__calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->base.ops = &kvt__rotating_ops;
    r->kv_dim = kv_dim;
    r->window = window;
    r->keep = keep;
    r->dtype = dtype;
    r->group_size = dtype == KVT_DTYPE_I8 ? group_size : 0;
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
    rot_cache *r = rot_alloc(src->kv_dim, src->window, src->keep, src->dtype, src->group_size);
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
    const size_t D = (size_t)r->kv_dim;
    if (!r->heap || kvt_buf_refs(r->ring) > 1) {
        /* copy-on-write: the valid slots only */
        kvt_buf *ring;
        int rc = kvt_buf_new(rot_ring_bytes(r), &ring);
        if (rc)
            return rc;
        size_t copied = 0;
        for (int p = 0; p < rot_parts(r); p++)
            for (int kv = 0; kv < 2; kv++) {
                size_t n_bytes = (size_t)rot_valid(r) * rot_row_bytes(r, p);
                memcpy(rot_at(r, kvt_buf_data(ring), p, kv), rot_at(r, kvt_buf_data(r->ring), p, kv), n_bytes);
                copied += n_bytes;
            }
        kvt_buf_count_copy(copied);
        kvt_buf_release(r->ring);
        r->ring = ring;
        r->heap = true;
    }
    const int64_t end = r->offset + n;
    /* Only tokens no later token of this batch overwrites are written: the
     * sinks, and the last (window - keep) tokens. */
    for (int64_t t = r->offset; t < KVT__MIN(end, (int64_t)r->keep); t++) {
        rot_put(r, 0, (size_t)t, k + (size_t)(t - r->offset) * D);
        rot_put(r, 1, (size_t)t, v + (size_t)(t - r->offset) * D);
    }
    int64_t start = KVT__MAX(r->offset, KVT__MAX((int64_t)r->keep, end - (r->window - r->keep)));
    for (int64_t t = start; t < end; t++) {
        size_t s = (size_t)rot_slot(r, t);
        rot_put(r, 0, s, k + (size_t)(t - r->offset) * D);
        rot_put(r, 1, s, v + (size_t)(t - r->offset) * D);
    }
    r->offset = end;
    return 0;
}

static int rot_encode(const kvt_cache *c, kvt_cache_state *out)
{
    const rot_cache *r = (const rot_cache *)c;
    const int64_t params[5] = {r->kv_dim, r->window, r->keep, r->dtype, r->group_size};
    int64_t lo, hi;
    rot_range(c, &lo, &hi);
    /* F32 keeps the three parameters it always had (stored state stays valid) */
    int rc = kvt__state_begin(out, "rotating", hi, lo, r->dtype == KVT_DTYPE_F32 ? 3 : 5, params, rot_parts(r));
    if (rc)
        return rc;
    const int64_t shape[3] = {2, r->window, r->kv_dim};
    const void *base = kvt_buf_data(r->ring);
    if (r->dtype != KVT_DTYPE_I8) {
        kvt__tensor_set(&out->tensors[0], "ring", r->dtype, 3, shape, base, kvt_buf_bytes(r->ring), r->ring, -1,
                        -1);
        return 0;
    }
    const int64_t sshape[3] = {2, r->window, r->kv_dim / r->group_size};
    kvt__tensor_set(&out->tensors[0], "ring.q", KVT_DTYPE_I8, 3, shape, rot_at(r, base, 1, 0),
                    2 * (size_t)r->window * rot_row_bytes(r, 1), r->ring, -1, -1);
    kvt__tensor_set(&out->tensors[1], "ring.s", KVT_DTYPE_F32, 3, sshape, base,
                    2 * (size_t)r->window * rot_row_bytes(r, 0), r->ring, -1, -1);
    return 0;
}

static int rot_decode(const kvt_cache_state *st, kvt_cache **out)
{
    static const char *const names[5] = {"kv_dim", "window", "keep", "dtype", "group_size"};
    int64_t lo[5] = {1, 1, 0, KVT_DTYPE_F16, 0}, hi[5] = {KVT__DIM_MAX, KVT__DIM_MAX, KVT__DIM_MAX, KVT_DTYPE_I8, 0};
    /* three parameters: F32; five: F16, BF16 or I8 (F32 always encodes three) */
    const int32_t np = st->n_params == 5 ? 5 : 3;
    if (st->n_params >= 3 && st->params[1] >= 1)
        hi[2] = st->params[1] - 1; /* keep < window */
    if (np == 5 && st->params[3] == KVT_DTYPE_I8) { /* 1 <= group_size <= kv_dim */
        lo[4] = 1;
        hi[4] = KVT__MAX(1, KVT__MIN(st->params[0], (int64_t)KVT__DIM_MAX));
    }
    int rc = kvt__params_expect(st, np, names, lo, hi);
    if (rc)
        return rc;
    const int64_t D = st->params[0], W = st->params[1], keep = st->params[2];
    const kvt_dtype dt = np == 5 ? (kvt_dtype)st->params[3] : KVT_DTYPE_F32;
    const int64_t gs = np == 5 ? st->params[4] : 0;
    if (dt == KVT_DTYPE_I8 && D % gs)
        return kvt__fail(KVT_EFORMAT, "rotating state: group_size %lld does not divide kv_dim %lld", (long long)gs,
                         (long long)D);
    if (st->offset > KVT__ROT_MAX_TOKENS)
        return kvt__fail(KVT_EFORMAT, "rotating state: offset %lld exceeds the limit", (long long)st->offset);
    int64_t want_min = st->offset <= W ? 0 : st->offset;
    if (st->min_offset != want_min)
        return kvt__fail(KVT_EFORMAT, "rotating state: min_offset is %lld, a window of %lld at offset %lld gives %lld",
                         (long long)st->min_offset, (long long)W, (long long)st->offset, (long long)want_min);
    const int want_tensors = dt == KVT_DTYPE_I8 ? 2 : 1;
    if (st->n_tensors != want_tensors)
        return kvt__fail(KVT_EFORMAT, "rotating state: %d tensors, expected %d", (int)st->n_tensors, want_tensors);
    const int64_t shape[3] = {2, W, D};
    if (dt != KVT_DTYPE_I8) {
        rc = kvt__tensor_expect(st, 0, "ring", dt, 3, shape);
    } else {
        const int64_t sshape[3] = {2, W, D / gs};
        if (!(rc = kvt__tensor_expect(st, 0, "ring.q", KVT_DTYPE_I8, 3, shape)) &&
            !(rc = kvt__tensor_expect(st, 1, "ring.s", KVT_DTYPE_F32, 3, sshape)))
            rc = kvt__q8_check_scales(&st->tensors[1], "rotating");
    }
    if (rc)
        return rc;
    rot_cache *r = rot_alloc((int32_t)D, (int32_t)W, (int32_t)keep, dt, (int32_t)gs);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "rotating decode: cannot allocate the cache");
    if (dt != KVT_DTYPE_I8) {
        rc = kvt__tensor_adopt(&st->tensors[0], &r->ring, &r->heap);
    } else {
        const kvt_tensor *qt = &st->tensors[0], *sc = &st->tensors[1];
        const char *ob = qt->owner ? kvt_buf_data(qt->owner) : NULL;
        if (ob && qt->owner == sc->owner && sc->data == ob && (uintptr_t)ob % sizeof(float) == 0 &&
            (const char *)qt->data == ob + sc->bytes && sc->bytes + qt->bytes == kvt_buf_bytes(qt->owner)) {
            r->ring = kvt_buf_retain(qt->owner); /* zero-copy restore: laid out as the ring */
            r->heap = false;
        } else if (!(rc = kvt_buf_new(rot_ring_bytes(r), &r->ring))) {
            memcpy(kvt_buf_data(r->ring), sc->data, sc->bytes);
            memcpy((char *)kvt_buf_data(r->ring) + sc->bytes, qt->data, qt->bytes);
            kvt_buf_count_copy(sc->bytes + qt->bytes);
            r->heap = true;
        }
    }
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
    return kvt_rotating_create_dtype(kv_dim, window, keep, KVT_DTYPE_F32, 0, out);
}

KVT_API int kvt_rotating_create_dtype(int32_t kv_dim, int32_t window, int32_t keep, kvt_dtype dtype,
                                      int32_t group_size, kvt_cache **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_rotating_create: out is NULL");
    *out = NULL;
    if (kv_dim < 1 || kv_dim > KVT__DIM_MAX || window < 1 || window > KVT__DIM_MAX || keep < 0 || keep >= window)
        return kvt__fail(KVT_EINVAL,
                         "kvt_rotating_create: need 1 <= kv_dim, window <= %d and 0 <= keep < window "
                         "(kv_dim %d, window %d, keep %d)",
                         KVT__DIM_MAX, (int)kv_dim, (int)window, (int)keep);
    if (dtype != KVT_DTYPE_F32 && dtype != KVT_DTYPE_F16 && dtype != KVT_DTYPE_BF16 && dtype != KVT_DTYPE_I8)
        return kvt__fail(KVT_EINVAL, "kvt_rotating_create: dtype %s: a rotating cache stores F32, F16, BF16 or I8",
                         kvt_dtype_name(dtype) ? kvt_dtype_name(dtype) : "(unknown)");
    if (dtype == KVT_DTYPE_I8 && (group_size < 1 || kv_dim % group_size))
        return kvt__fail(KVT_EINVAL, "kvt_rotating_create: group_size %d must be >= 1 and divide kv_dim %d",
                         (int)group_size, (int)kv_dim);
    rot_cache *r = rot_alloc(kv_dim, window, keep, dtype, group_size);
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
    if (r->dtype != KVT_DTYPE_F32)
        return kvt__fail(KVT_EINVAL, "kvt_rotating_view: the ring stores %s, not F32 (read it with kvt_rotating_rows)",
                         kvt_dtype_name(r->dtype));
    const float *base = kvt_buf_data(r->ring);
    if (k)
        *k = base;
    if (v)
        *v = base + (size_t)r->window * (size_t)r->kv_dim;
    if (n_valid)
        *n_valid = (int32_t)rot_valid(r);
    return 0;
}

KVT_API int kvt_rotating_rows(const kvt_cache *c, kvt_kv_rows *out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_rotating_rows: out is NULL");
    if (!c || c->ops != &kvt__rotating_ops)
        return kvt__fail(KVT_EINVAL, "kvt_rotating_rows: not a rotating cache");
    const rot_cache *r = (const rot_cache *)c;
    const void *base = kvt_buf_data(r->ring);
    int last = rot_parts(r) - 1; /* the elements (codes for I8) */
    *out = (kvt_kv_rows){.dtype = r->dtype, .k = rot_at(r, base, last, 0), .v = rot_at(r, base, last, 1),
                         .group_size = r->group_size, .n = (int32_t)rot_valid(r)};
    if (r->dtype == KVT_DTYPE_I8) {
        out->k_scale = (const float *)(const void *)rot_at(r, base, 0, 0);
        out->v_scale = (const float *)(const void *)rot_at(r, base, 0, 1);
    }
    return 0;
}

int32_t kvt__rotating_kv_dim(const kvt_cache *c) { return ((const rot_cache *)c)->kv_dim; }
kvt_dtype kvt__rotating_dtype(const kvt_cache *c) { return ((const rot_cache *)c)->dtype; }
