/*
 * buffer.c: refcounted immutable host buffers (see kvtier/buffer.h).
 * Owns only the buffer header and, for kvt_buf_new, the bytes. Never writes
 * into a buffer's bytes after creation.
 */
#include "kvtier/buffer.h"
#include "internal.h"

#include <stdatomic.h>
#include <string.h>

struct kvt_buf {
    _Atomic int64_t refs;
    void *data;      /* (bytes) */
    size_t bytes;
    void (*release)(void *ctx, void *data, size_t bytes); /* NULL: data is inline */
    void *ctx;
    _Atomic(kvt__origin *) origin; /* a durable copy of the bytes elsewhere (internal.h), NULL none */
    _Alignas(16) unsigned char inline_data[]; /* (bytes) for kvt_buf_new; 16 = what malloc guarantees */
};

static _Atomic uint64_t kvt__copied;

int kvt__buf_new_uninit(size_t bytes, kvt_buf **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_buf_new: out is NULL");
    *out = NULL;
    if (bytes > SIZE_MAX - sizeof(kvt_buf))
        return kvt__fail(KVT_ENOMEM, "kvt_buf_new: %zu bytes is too large", bytes);
    kvt_buf *b = kvt__malloc(sizeof(kvt_buf) + bytes);
    if (!b)
        return kvt__fail(KVT_ENOMEM, "kvt_buf_new: cannot allocate %zu bytes", bytes);
    atomic_init(&b->refs, 1);
    b->data = b->inline_data;
    b->bytes = bytes;
    b->release = NULL;
    b->ctx = NULL;
    atomic_init(&b->origin, NULL);
    *out = b;
    return 0;
}

KVT_API int kvt_buf_new(size_t bytes, kvt_buf **out)
{
    int rc = kvt__buf_new_uninit(bytes, out);
    if (!rc)
        memset((*out)->inline_data, 0, bytes);
    return rc;
}

KVT_API int kvt_buf_wrap(void *data, size_t bytes, void (*release)(void *, void *, size_t), void *ctx,
                         kvt_buf **out)
{
    if (out) /* cleared before any check */
        *out = NULL;
    if (!out || (!data && bytes))
        return kvt__fail(KVT_EINVAL, "kvt_buf_wrap: %s", !out ? "out is NULL" : "data is NULL");
    kvt_buf *b = kvt__malloc(sizeof(kvt_buf));
    if (!b)
        return kvt__fail(KVT_ENOMEM, "kvt_buf_wrap: cannot allocate the buffer header");
    atomic_init(&b->refs, 1);
    b->data = data ? data : b->inline_data;
    b->bytes = bytes;
    b->release = release;
    b->ctx = ctx;
    atomic_init(&b->origin, NULL);
    *out = b;
    return 0;
}

KVT_API kvt_buf *kvt_buf_retain(kvt_buf *b)
{
    if (b)
        atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
    return b;
}

KVT_API void kvt_buf_release(kvt_buf *b)
{
    if (!b)
        return;
    if (atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1)
        return;
    if (b->release)
        b->release(b->ctx, b->data, b->bytes);
    kvt__origin_release(atomic_load(&b->origin));
    kvt__free(b);
}

kvt__origin *kvt__origin_retain(kvt__origin *o)
{
    if (o)
        atomic_fetch_add(&o->refs, 1);
    return o;
}

void kvt__origin_release(kvt__origin *o)
{
    if (o && atomic_fetch_sub(&o->refs, 1) == 1)
        o->ops->free_fn(o);
}

void kvt__buf_set_origin(kvt_buf *b, kvt__origin *o)
{
    kvt__origin *none = NULL;
    if (!b || !atomic_compare_exchange_strong(&b->origin, &none, o))
        kvt__origin_release(o);
}

kvt__origin *kvt__buf_origin(const kvt_buf *b) { return b ? atomic_load(&((kvt_buf *)b)->origin) : NULL; }

KVT_API void *kvt_buf_data(const kvt_buf *b) { return b->data; }
KVT_API size_t kvt_buf_bytes(const kvt_buf *b) { return b->bytes; }
KVT_API int64_t kvt_buf_refs(const kvt_buf *b)
{
    return atomic_load_explicit(&((kvt_buf *)b)->refs, memory_order_acquire);
}

KVT_API uint64_t kvt_buf_bytes_copied(void) { return atomic_load_explicit(&kvt__copied, memory_order_relaxed); }
KVT_API void kvt_buf_count_copy(uint64_t n) { atomic_fetch_add_explicit(&kvt__copied, n, memory_order_relaxed); }
