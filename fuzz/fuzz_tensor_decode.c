/*
 * fuzz_tensor_decode.c: kvt_cache_decode on untrusted cache states, the
 * step every SSD restore ends with. The first byte picks the kind (kv,
 * rotating, recurrent, qkv, qkvc; attachment: the blob an entry's attachment
 * tensor becomes); the rest is the state (fz_state_read: params, tensors,
 * token ranges, owners that fit or lie around the data, or none). A state
 * that decodes must give a cache that passes fz_cache_exercise (its range,
 * readers, re-encode, trim, append); a refusal must be KVT_EFORMAT,
 * KVT_EUNSUPPORTED or KVT_ENOMEM with a message. A qkvc state must be
 * accepted exactly when kvtier/cache.h's contract for the kind allows it
 * (qkvc_acceptable: checked from the state, not from the decoder).
 */
#include "fuzz_cache_check.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static void blob(const kvt_cache_state *st)
{
    if (st->n_tensors < 1)
        return;
    const kvt_tensor *t = &st->tensors[0];
    char name[KVT_TENSOR_NAME_MAX + 8];
    memcpy(name, t->name, sizeof t->name);
    name[sizeof t->name] = '\0';
    kvt_attachment *a = NULL, *b = NULL;
    int rc = kvt_attachment_blob(name, t->data, t->bytes, &a);
    if (rc) {
        FZ_CHECK(rc == KVT_EINVAL || rc == KVT_ENOMEM, "blob refused with %d", rc);
        return;
    }
    size_t n = 0;
    const void *p = kvt_attachment_blob_data(a, &n);
    FZ_CHECK(n == t->bytes && (!n || !memcmp(p, t->data, n)), "blob holds other bytes");
    FZ_CHECK(!strcmp(a->name, name), "blob name");
    if (!kvt_attachment_clone(a, &b)) {
        const void *q = kvt_attachment_blob_data(b, &n);
        FZ_CHECK(q == p && n == t->bytes, "a blob clone shares its bytes");
        const void *s = NULL;
        size_t sn = 0;
        FZ_CHECK(b->ops->serialize && !b->ops->serialize(b, &s, &sn) && sn == t->bytes, "serialize");
        kvt_attachment_destroy(b);
    }
    kvt_attachment_destroy(a);
}

/* Whether tensor i of st is `name` of dtype dt and shape (d0, d1[, d2]),
 * with the bytes that shape needs, inside its owner. */
static int tensor_is(const kvt_cache_state *st, int32_t i, const char *name, kvt_dtype dt, int ndim, int64_t d0,
                     int64_t d1, int64_t d2)
{
    const kvt_tensor *t = &st->tensors[i];
    const int64_t want[3] = {d0, d1, d2};
    if (strncmp(t->name, name, sizeof t->name) || t->dtype != dt || t->ndim != ndim)
        return 0;
    for (int d = 0; d < ndim; d++)
        if (t->shape[d] != want[d])
            return 0;
    size_t bytes = (size_t)(d0 * d1 * (ndim == 3 ? d2 : 1)) * kvt_dtype_size(dt);
    if (t->bytes != bytes || (bytes && !t->data))
        return 0;
    if (t->owner && bytes) {
        const char *lo = kvt_buf_data(t->owner), *p = t->data;
        if (p < lo || (size_t)(p - lo) > kvt_buf_bytes(t->owner) || bytes > kvt_buf_bytes(t->owner) - (size_t)(p - lo))
            return 0;
    }
    return 1;
}

/* What kvtier/cache.h promises a qkvc decode accepts, written out again
 * from that contract: params {kv_dim, block_tokens, layout 1} (8-bit codes)
 * or {kv_dim, block_tokens, layout 1, dtype F16 or BF16} with both
 * dimensions in [1, 2^20], offset at most 2^40, min_offset the sealed
 * tokens; per sealed block, 8-bit: "blk<i>.q" U8 (2, B, kv_dim) and
 * "blk<i>.s" F32 (4, kv_dim) whose mins and steps are finite, whose steps are
 * not below 0 and whose fmaf(255, step, min) is finite; 16-bit: "blk<i>" of
 * the dtype (2, B, kv_dim); then "tail" F32 (2, rows, kv_dim) exactly when the
 * open block holds rows (1 to B). */
static int qkvc_acceptable(const kvt_cache_state *st)
{
    if (st->n_params < 3 || st->n_params > 4 || st->params[2] != 1 || st->params[0] < 1 ||
        st->params[0] > (1 << 20) || st->params[1] < 1 || st->params[1] > (1 << 20) || st->offset < 0 ||
        st->offset > ((int64_t)1 << 40) || st->n_tensors < 0 || st->min_offset < 0 || st->min_offset > st->offset)
        return 0;
    const int64_t D = st->params[0], B = st->params[1];
    if (st->n_params == 4) { /* 16-bit sealed blocks */
        const int64_t dt = st->params[3], rows = st->offset - st->min_offset, nb = st->n_tensors - (rows > 0);
        if ((dt != KVT_DTYPE_F16 && dt != KVT_DTYPE_BF16) || rows > B || nb < 0 || st->min_offset != nb * B)
            return 0;
        for (int32_t i = 0; i < (int32_t)nb; i++) {
            char name[32];
            snprintf(name, sizeof name, "blk%d", (int)i);
            if (!tensor_is(st, i, name, (kvt_dtype)dt, 3, 2, B, D))
                return 0;
        }
        return rows == 0 || tensor_is(st, (int32_t)nb, "tail", KVT_DTYPE_F32, 3, 2, rows, D);
    }
    const int64_t nb = st->n_tensors / 2;
    const int64_t rows = st->offset - nb * B;
    if (st->min_offset != nb * B || rows < 0 || rows > B || (rows > 0) != (st->n_tensors % 2))
        return 0;
    for (int32_t i = 0; i < (int32_t)nb; i++) {
        char q[32], sc[32];
        snprintf(q, sizeof q, "blk%d.q", (int)i);
        snprintf(sc, sizeof sc, "blk%d.s", (int)i);
        if (!tensor_is(st, 2 * i, q, KVT_DTYPE_U8, 3, 2, B, D) ||
            !tensor_is(st, 2 * i + 1, sc, KVT_DTYPE_F32, 2, 4, D, 0))
            return 0;
        const unsigned char *p = st->tensors[2 * i + 1].data;
        for (int64_t j = 0; j < 4 * D; j++) {
            float x;
            memcpy(&x, p + 4 * j, 4);
            if (!isfinite(x) || ((j / D) % 2 == 1 && x < 0))
                return 0;
        }
        for (int64_t j = 0; j < 2 * D; j++) { /* the largest value a channel reads */
            float mn, step;
            memcpy(&mn, p + 4 * ((j / D) * 2 * D + j % D), 4);
            memcpy(&step, p + 4 * ((j / D) * 2 * D + D + j % D), 4);
            if (!isfinite(fmaf(255.0f, step, mn)))
                return 0;
        }
    }
    return rows == 0 || tensor_is(st, (int32_t)(2 * nb), "tail", KVT_DTYPE_F32, 3, 2, rows, D);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size};
    kvt_cache_state st;
    int sel;
    if (fz_state_read(&in, &st, &sel)) {
        fz_state_free(&st);
        return 0;
    }
    if (sel == FZ_KIND_ATTACHMENT) {
        blob(&st);
        fz_state_free(&st);
        return 0;
    }
    int acceptable = sel == FZ_KIND_QKVC ? qkvc_acceptable(&st) : -1;
    kvt_cache *c = NULL;
    int rc = kvt_cache_decode(&st, &c);
    /* qkvc: decode accepts exactly what its contract allows */
    FZ_CHECK(acceptable < 0 || rc == KVT_ENOMEM || (rc == 0) == acceptable, "qkvc decode %s a state its contract %s: %s",
             rc ? "refused" : "accepted", acceptable ? "allows" : "refuses", rc ? kvt_last_error() : "");
    if (rc) {
        FZ_CHECK(!c, "a failed decode returned a cache");
        FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED || rc == KVT_ENOMEM, "decode returned %d (%s)", rc,
                 kvt_last_error());
        FZ_CHECK(kvt_last_error()[0], "refusal %d without a message", rc);
    } else {
        FZ_CHECK(c && !strcmp(kvt_cache_kind(c), st.kind), "decoded kind %s", c ? kvt_cache_kind(c) : "-");
        int64_t lo, off;
        kvt_cache_range(c, &lo, &off);
        FZ_CHECK(off == st.offset, "decoded offset %lld, state says %lld", (long long)off, (long long)st.offset);
        /* the cache must not depend on the state's buffers beyond their references */
        fz_state_free(&st);
        fz_cache_exercise(c, &in);
        kvt_cache_destroy(c);
    }
    fz_state_free(&st);
    return 0;
}
