/*
 * cache_recurrent.c: the "recurrent" cache kind, a fixed-size state (SSM,
 * linear attention, conv state) valid at a single point (see kvtier/cache.h,
 * DESIGN.md section 2).
 * It owns one reference to its state buffer, shared with clones; it must
 * never write into that buffer while it is shared (refs > 1) or when it is a
 * retained foreign buffer (a decoded file region): it takes a new one.
 */
#include "cache_internal.h"
#include "internal.h"

#include <string.h>

#define KVT__REC_MAX_BYTES ((int64_t)1 << 40)
#define KVT__REC_MAX_TOKENS ((int64_t)1 << 62)

typedef struct rec_cache {
    kvt_cache base;
    size_t state_bytes;
    int64_t offset; /* tokens the state summarises */
    kvt_buf *state; /* (state_bytes) */
    bool heap;      /* made by this library: writable when refs == 1 */
} rec_cache;

static size_t rec_private_bytes(const kvt_cache *c) { return sizeof(rec_cache); }

static void rec_foreach_buf(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx)
{
    fn(((const rec_cache *)c)->state, ctx);
}

static void rec_range(const kvt_cache *c, int64_t *min_offset, int64_t *offset)
{
    *min_offset = *offset = ((const rec_cache *)c)->offset;
}

static int rec_trim(kvt_cache *c, int64_t length)
{
    if (length != ((rec_cache *)c)->offset)
        return kvt__fail(KVT_ERANGE, "recurrent trim: the state is valid at its offset only");
    return 0;
}

static rec_cache *rec_alloc(size_t state_bytes)
{
    rec_cache *r = kvt__calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->base.ops = &kvt__recurrent_ops;
    r->state_bytes = state_bytes;
    return r;
}

static void rec_dispose(kvt_cache *c)
{
    rec_cache *r = (rec_cache *)c;
    kvt_buf_release(r->state);
    kvt__free(r);
}

static int rec_clone(const kvt_cache *c, kvt_cache **out)
{
    const rec_cache *src = (const rec_cache *)c;
    rec_cache *r = rec_alloc(src->state_bytes);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "recurrent clone: cannot allocate the cache");
    r->offset = src->offset;
    r->state = kvt_buf_retain(src->state);
    r->heap = src->heap;
    *out = &r->base;
    return 0;
}

static int rec_append(kvt_cache *c, int64_t n, const void *const *inputs)
{
    rec_cache *r = (rec_cache *)c;
    if (!inputs[0])
        return kvt__fail(KVT_EINVAL, "recurrent append: the new state is NULL");
    if (n > KVT__REC_MAX_TOKENS - r->offset)
        return kvt__fail(KVT_ERANGE, "recurrent append: %lld + %lld tokens exceeds the limit",
                         (long long)r->offset, (long long)n);
    if (!r->heap || kvt_buf_refs(r->state) > 1) {
        /* the whole state is replaced: a fresh buffer, nothing to copy over */
        kvt_buf *b;
        int rc = kvt__buf_copy(inputs[0], r->state_bytes, false, &b);
        if (rc)
            return rc;
        kvt_buf_release(r->state);
        r->state = b;
        r->heap = true;
    } else {
        memcpy(kvt_buf_data(r->state), inputs[0], r->state_bytes);
    }
    r->offset += n;
    return 0;
}

static int rec_encode(const kvt_cache *c, kvt_cache_state *out)
{
    const rec_cache *r = (const rec_cache *)c;
    const int64_t params[1] = {(int64_t)r->state_bytes};
    int rc = kvt__state_begin(out, "recurrent", r->offset, r->offset, 1, params, 1);
    if (rc)
        return rc;
    const int64_t shape[1] = {(int64_t)r->state_bytes};
    kvt__tensor_set(&out->tensors[0], "state", KVT_DTYPE_U8, 1, shape, kvt_buf_data(r->state), r->state_bytes,
                    r->state, -1, -1);
    return 0;
}

static int rec_decode(const kvt_cache_state *st, kvt_cache **out)
{
    static const char *const names[1] = {"state_bytes"};
    static const int64_t lo[1] = {1}, hi[1] = {KVT__REC_MAX_BYTES};
    int rc = kvt__params_expect(st, 1, names, lo, hi);
    if (rc)
        return rc;
    if (st->min_offset != st->offset)
        return kvt__fail(KVT_EFORMAT, "recurrent state: range [%lld, %lld] is not a single point",
                         (long long)st->min_offset, (long long)st->offset);
    if (st->offset > KVT__REC_MAX_TOKENS)
        return kvt__fail(KVT_EFORMAT, "recurrent state: offset %lld exceeds the limit", (long long)st->offset);
    if (st->n_tensors != 1)
        return kvt__fail(KVT_EFORMAT, "recurrent state: %d tensors, expected 1", (int)st->n_tensors);
    const int64_t shape[1] = {st->params[0]};
    rc = kvt__tensor_expect(st, 0, "state", KVT_DTYPE_U8, 1, shape);
    if (rc)
        return rc;
    rec_cache *r = rec_alloc((size_t)st->params[0]);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "recurrent decode: cannot allocate the cache");
    rc = kvt__tensor_adopt(&st->tensors[0], &r->state, &r->heap);
    if (rc) {
        kvt__free(r);
        return rc;
    }
    r->offset = st->offset;
    *out = &r->base;
    return 0;
}

const kvt_cache_ops kvt__recurrent_ops = {
    .kind = "recurrent",
    .private_bytes = rec_private_bytes,
    .foreach_buf = rec_foreach_buf,
    .range = rec_range,
    .trim = rec_trim,
    .clone = rec_clone,
    .append = rec_append,
    .destroy = rec_dispose,
    .encode = rec_encode,
    .decode = rec_decode,
};

KVT_API int kvt_recurrent_create(size_t state_bytes, kvt_cache **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_recurrent_create: out is NULL");
    *out = NULL;
    if (state_bytes == 0 || state_bytes > (size_t)KVT__REC_MAX_BYTES)
        return kvt__fail(KVT_EINVAL, "kvt_recurrent_create: state_bytes %zu must be in [1, 2^40]", state_bytes);
    rec_cache *r = rec_alloc(state_bytes);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "kvt_recurrent_create: cannot allocate the cache");
    int rc = kvt_buf_new(state_bytes, &r->state);
    if (rc) {
        kvt__free(r);
        return rc;
    }
    r->heap = true;
    *out = &r->base;
    return 0;
}

KVT_API const void *kvt_recurrent_state(const kvt_cache *c)
{
    if (!c || c->ops != &kvt__recurrent_ops)
        return NULL;
    return kvt_buf_data(((const rec_cache *)c)->state);
}
