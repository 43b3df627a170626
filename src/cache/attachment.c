/*
 * attachment.c: method attachments (opaque per-entry state such as a
 * speculative decoder's hidden state) and the built-in "blob" kind, a copy of
 * some bytes in a refcounted buffer that clones share (see kvtier/cache.h).
 * Generic calls dispatch through the attachment's ops. A blob owns one
 * reference to its buffer and must never write into it after creation.
 */
#include "kvtier/cache.h"
#include "internal.h"

#include <string.h>

typedef struct blob_att {
    kvt_attachment base;
    kvt_buf *buf; /* (bytes), immutable, shared by clones */
} blob_att;

static const kvt_attachment_ops kvt__blob_ops;

static size_t blob_bytes(const kvt_attachment *a)
{
    return sizeof(blob_att) + kvt_buf_bytes(((const blob_att *)a)->buf);
}

static blob_att *blob_alloc(const char *name)
{
    blob_att *b = kvt__calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->base.ops = &kvt__blob_ops;
    memcpy(b->base.name, name, strlen(name) + 1);
    return b;
}

static int blob_clone(const kvt_attachment *a, kvt_attachment **out)
{
    const blob_att *src = (const blob_att *)a;
    blob_att *b = blob_alloc(src->base.name);
    if (!b)
        return kvt__fail(KVT_ENOMEM, "blob attachment \"%s\": cannot allocate a clone", src->base.name);
    b->buf = kvt_buf_retain(src->buf);
    *out = &b->base;
    return 0;
}

static void blob_dispose(kvt_attachment *a)
{
    blob_att *b = (blob_att *)a;
    kvt_buf_release(b->buf);
    kvt__free(b);
}

static int blob_serialize(const kvt_attachment *a, const void **data, size_t *bytes)
{
    const blob_att *b = (const blob_att *)a;
    *data = kvt_buf_data(b->buf);
    *bytes = kvt_buf_bytes(b->buf);
    return 0;
}

static const kvt_attachment_ops kvt__blob_ops = {
    .kind = "blob",
    .bytes = blob_bytes,
    .clone = blob_clone,
    .destroy = blob_dispose,
    .serialize = blob_serialize,
};

KVT_API int kvt_attachment_blob(const char *name, const void *data, size_t bytes, kvt_attachment **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_attachment_blob: out is NULL");
    *out = NULL;
    if (!name)
        return kvt__fail(KVT_EINVAL, "kvt_attachment_blob: name is NULL");
    /* the check and the message from one constant: name[] holds the NUL too */
    if (strnlen(name, KVT_TENSOR_NAME_MAX) >= KVT_TENSOR_NAME_MAX)
        return kvt__fail(KVT_EINVAL, "kvt_attachment_blob: name is %d bytes or longer; at most %d fit "
                         "(KVT_TENSOR_NAME_MAX %d with the NUL)", KVT_TENSOR_NAME_MAX, KVT_TENSOR_NAME_MAX - 1,
                         KVT_TENSOR_NAME_MAX);
    if (!data && bytes)
        return kvt__fail(KVT_EINVAL, "kvt_attachment_blob: data is NULL for %zu bytes", bytes);
    blob_att *b = blob_alloc(name);
    if (!b)
        return kvt__fail(KVT_ENOMEM, "kvt_attachment_blob: cannot allocate \"%s\"", name);
    int rc = kvt_buf_new(bytes, &b->buf);
    if (rc) {
        kvt__free(b);
        return rc;
    }
    if (bytes)
        memcpy(kvt_buf_data(b->buf), data, bytes);
    *out = &b->base;
    return 0;
}

KVT_API const void *kvt_attachment_blob_data(const kvt_attachment *a, size_t *bytes)
{
    if (bytes)
        *bytes = 0;
    if (!a || a->ops != &kvt__blob_ops)
        return NULL;
    const blob_att *b = (const blob_att *)a;
    if (bytes)
        *bytes = kvt_buf_bytes(b->buf);
    return kvt_buf_data(b->buf);
}

KVT_API size_t kvt_attachment_bytes(const kvt_attachment *a) { return a ? a->ops->bytes(a) : 0; }

KVT_API int kvt_attachment_clone(const kvt_attachment *a, kvt_attachment **out)
{
    if (out)
        *out = NULL;
    if (!a || !out)
        return kvt__fail(KVT_EINVAL, "kvt_attachment_clone: %s is NULL", !a ? "attachment" : "out");
    return a->ops->clone(a, out);
}

KVT_API void kvt_attachment_destroy(kvt_attachment *a)
{
    if (a)
        a->ops->destroy(a);
}
