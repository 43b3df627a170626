/*
 * cache_qkv.c: the "qkv" cache kind, int8-quantized K/V in blocks of B tokens
 * with one f32 scale per group of `group_size` floats of a token row (see
 * kvtier/cache.h, DESIGN.md section 2). Blocks, sharing and copy-on-write are
 * those of the kv kind (the block table in cache_kv.c).
 * It owns its block table and one reference per block; like kv it must never
 * write into a block that is shared (refs > 1) or foreign (decoded from a file
 * region) without copying that block first.
 */
#include "cache_internal.h"
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define KVT__QKV_MAX_TOKENS ((int64_t)1 << 40)

/* Block layout (one kvt_buf): scales (2, B, G) f32, K rows then V rows, then
 * codes (2, B, kv_dim) i8, K rows then V rows; G = kv_dim / group_size. The
 * scales come first so they stay 4-byte aligned. */
typedef struct qkv_cache {
    kvt_cache base;
    int32_t kv_dim;       /* floats per token of K (and of V) */
    int32_t group_size;   /* floats sharing one scale */
    int32_t block_tokens; /* B */
    int64_t offset;       /* tokens held */
    kvt__blocks blocks;
} qkv_cache;

static size_t qkv_groups(const qkv_cache *q) { return (size_t)(q->kv_dim / q->group_size); }

/* Bytes of the scales, then of the codes, of `rows` token rows (K and V). */
static size_t qkv_scale_bytes(const qkv_cache *q, int64_t rows)
{
    return 2 * (size_t)rows * qkv_groups(q) * sizeof(float);
}
static size_t qkv_code_bytes(const qkv_cache *q, int64_t rows) { return 2 * (size_t)rows * (size_t)q->kv_dim; }
static size_t qkv_block_bytes(const qkv_cache *q)
{
    return qkv_scale_bytes(q, q->block_tokens) + qkv_code_bytes(q, q->block_tokens);
}

/* Pointers into a block (or a compact tensor copy) laid out for `cap` rows. */
typedef struct qkv_view {
    float *ks, *vs;  /* (cap, G) scales */
    int8_t *kq, *vq; /* (cap, kv_dim) codes */
} qkv_view;

static qkv_view qkv_at(const qkv_cache *q, void *base, int64_t cap)
{
    qkv_view w;
    size_t G = qkv_groups(q), D = (size_t)q->kv_dim;
    w.ks = base;
    w.vs = w.ks + (size_t)cap * G;
    w.kq = (int8_t *)((char *)base + qkv_scale_bytes(q, cap));
    w.vq = w.kq + (size_t)cap * D;
    return w;
}

/* Copies rows [0, rows) of block `s` laid out for s_cap rows into `d` laid
 * out for d_cap rows; returns the bytes copied. */
static size_t qkv_copy_view(const qkv_cache *q, qkv_view d, qkv_view s, int64_t rows)
{
    size_t sb = (size_t)rows * qkv_groups(q) * sizeof(float), cb = (size_t)rows * (size_t)q->kv_dim;
    memcpy(d.ks, s.ks, sb);
    memcpy(d.vs, s.vs, sb);
    memcpy(d.kq, s.kq, cb);
    memcpy(d.vq, s.vq, cb);
    return 2 * (sb + cb);
}

static size_t qkv_copy_rows(void *dst, const void *src, int64_t rows, const void *ctx)
{
    const qkv_cache *q = ctx;
    return qkv_copy_view(q, qkv_at(q, dst, q->block_tokens), qkv_at(q, (void *)src, q->block_tokens), rows);
}

static size_t qkv_private_bytes(const kvt_cache *c)
{
    const qkv_cache *q = (const qkv_cache *)c;
    return sizeof *q + (size_t)q->blocks.cap * sizeof(kvt__blk);
}

static void qkv_foreach_buf(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx)
{
    kvt__blocks_foreach(&((const qkv_cache *)c)->blocks, fn, ctx);
}

static void qkv_range(const kvt_cache *c, int64_t *min_offset, int64_t *offset)
{
    *min_offset = 0;
    *offset = ((const qkv_cache *)c)->offset;
}

static int qkv_trim(kvt_cache *c, int64_t length)
{
    qkv_cache *q = (qkv_cache *)c;
    kvt__blocks_truncate(&q->blocks, (length + q->block_tokens - 1) / q->block_tokens);
    q->offset = length;
    return 0;
}

static qkv_cache *qkv_alloc(int32_t kv_dim, int32_t group_size, int32_t block_tokens)
{
    qkv_cache *q = kvt__calloc(1, sizeof *q);
    if (!q)
        return NULL;
    q->base.ops = &kvt__qkv_ops;
    q->kv_dim = kv_dim;
    q->group_size = group_size;
    q->block_tokens = block_tokens;
    return q;
}

static void qkv_dispose(kvt_cache *c)
{
    qkv_cache *q = (qkv_cache *)c;
    kvt__blocks_free(&q->blocks);
    kvt__free(q);
}

static int qkv_clone(const kvt_cache *c, kvt_cache **out)
{
    const qkv_cache *src = (const qkv_cache *)c;
    qkv_cache *q = qkv_alloc(src->kv_dim, src->group_size, src->block_tokens);
    if (!q)
        return kvt__fail(KVT_ENOMEM, "qkv clone: cannot allocate the cache");
    int rc = kvt__blocks_clone(&src->blocks, &q->blocks);
    if (rc) {
        kvt__free(q);
        return rc;
    }
    q->offset = src->offset;
    *out = &q->base;
    return 0;
}

static int qkv_append(kvt_cache *c, int64_t n, const void *const *inputs)
{
    qkv_cache *q = (qkv_cache *)c;
    const float *k = inputs[0], *v = inputs[1];
    if (!k || !v)
        return kvt__fail(KVT_EINVAL, "qkv append: %s input is NULL", !k ? "K" : "V");
    if (n > KVT__QKV_MAX_TOKENS - q->offset)
        return kvt__fail(KVT_ERANGE, "qkv append: %lld + %lld tokens exceeds the limit", (long long)q->offset,
                         (long long)n);
    int rc = kvt__blocks_prepare(&q->blocks, q->offset, n, q->block_tokens, qkv_block_bytes(q), qkv_copy_rows, q);
    if (rc)
        return rc;
    const int64_t B = q->block_tokens;
    const size_t D = (size_t)q->kv_dim, G = qkv_groups(q);
    for (int64_t r = 0; r < n; r++) {
        int64_t t = q->offset + r, row = t % B;
        qkv_view w = qkv_at(q, kvt_buf_data(q->blocks.v[t / B].buf), B);
        kvt__q8_quantize_row(k + (size_t)r * D, D, (size_t)q->group_size, w.ks + (size_t)row * G, w.kq + (size_t)row * D);
        kvt__q8_quantize_row(v + (size_t)r * D, D, (size_t)q->group_size, w.vs + (size_t)row * G, w.vq + (size_t)row * D);
    }
    q->offset += n;
    return 0;
}

static int qkv_encode(const kvt_cache *c, kvt_cache_state *out)
{
    const qkv_cache *q = (const qkv_cache *)c;
    const int64_t B = q->block_tokens, D = q->kv_dim, G = (int64_t)qkv_groups(q);
    const int64_t params[3] = {q->kv_dim, q->block_tokens, q->group_size};
    if (q->blocks.n > INT32_MAX / 2)
        return kvt__fail(KVT_ENOMEM, "qkv encode: %lld blocks is too many", (long long)q->blocks.n);
    int rc = kvt__state_begin(out, "qkv", q->offset, 0, 3, params, (int32_t)(2 * q->blocks.n));
    if (rc)
        return rc;
    for (int64_t i = 0; i < q->blocks.n; i++) {
        int64_t rows = KVT__MIN(B, q->offset - i * B);
        kvt_buf *buf = q->blocks.v[i].buf;
        int64_t tb = -1, te = -1;
        if (rows == B) {
            tb = i * B;
            te = tb + B;
        } else {
            /* the partial tail: a compact copy laid out for `rows` rows */
            kvt_buf *tail;
            rc = kvt_buf_new(qkv_scale_bytes(q, rows) + qkv_code_bytes(q, rows), &tail);
            if (rc)
                return rc;
            kvt_buf_count_copy(qkv_copy_view(q, qkv_at(q, kvt_buf_data(tail), rows), qkv_at(q, kvt_buf_data(buf), B),
                                             rows));
            buf = tail;
        }
        qkv_view w = qkv_at(q, kvt_buf_data(buf), rows);
        char name[KVT_TENSOR_NAME_MAX];
        const int64_t qshape[3] = {2, rows, D}, sshape[3] = {2, rows, G};
        snprintf(name, sizeof name, "blk%lld.q", (long long)i);
        kvt__tensor_set(&out->tensors[2 * i], name, KVT_DTYPE_I8, 3, qshape, w.kq, qkv_code_bytes(q, rows), buf, tb,
                        te);
        snprintf(name, sizeof name, "blk%lld.s", (long long)i);
        kvt__tensor_set(&out->tensors[2 * i + 1], name, KVT_DTYPE_F32, 3, sshape, w.ks, qkv_scale_bytes(q, rows),
                        buf, tb, te);
        if (rows != B)
            kvt_buf_release(buf);
    }
    return 0;
}

/* Whether block tensors qt, st are the two halves of one owner laid out as a
 * full block (scales then codes): decode can retain that owner. */
static bool qkv_is_whole_block(const kvt_tensor *qt, const kvt_tensor *st)
{
    if (!qt->owner || qt->owner != st->owner)
        return false;
    const char *base = kvt_buf_data(st->owner);
    return st->data == base && (uintptr_t)base % sizeof(float) == 0 && (const char *)qt->data == base + st->bytes &&
           st->bytes + qt->bytes == kvt_buf_bytes(st->owner);
}

static int qkv_decode(const kvt_cache_state *st, kvt_cache **out)
{
    static const char *const names[3] = {"kv_dim", "block_tokens", "group_size"};
    int64_t lo[3] = {1, 1, 1}, hi[3] = {KVT__DIM_MAX, KVT__DIM_MAX, KVT__DIM_MAX};
    if (st->n_params == 3 && st->params[0] >= 1)
        hi[2] = KVT__MIN(st->params[0], (int64_t)KVT__DIM_MAX); /* group_size <= kv_dim */
    int rc = kvt__params_expect(st, 3, names, lo, hi);
    if (rc)
        return rc;
    const int64_t D = st->params[0], B = st->params[1], gs = st->params[2];
    if (D % gs)
        return kvt__fail(KVT_EFORMAT, "qkv state: group_size %lld does not divide kv_dim %lld", (long long)gs,
                         (long long)D);
    if (st->min_offset != 0)
        return kvt__fail(KVT_EFORMAT, "qkv state: min_offset is %lld, a qkv cache reaches 0",
                         (long long)st->min_offset);
    if (st->offset > KVT__QKV_MAX_TOKENS)
        return kvt__fail(KVT_EFORMAT, "qkv state: offset %lld exceeds the limit", (long long)st->offset);
    int64_t nb = (st->offset + B - 1) / B;
    if (2 * nb != st->n_tensors)
        return kvt__fail(KVT_EFORMAT, "qkv state: %d tensors, %lld tokens in blocks of %lld need %lld",
                         (int)st->n_tensors, (long long)st->offset, (long long)B, (long long)(2 * nb));
    for (int32_t i = 0; i < (int32_t)nb; i++) {
        char name[KVT_TENSOR_NAME_MAX];
        int64_t rows = KVT__MIN(B, st->offset - (int64_t)i * B);
        const int64_t qshape[3] = {2, rows, D}, sshape[3] = {2, rows, D / gs};
        snprintf(name, sizeof name, "blk%d.q", (int)i);
        if ((rc = kvt__tensor_expect(st, 2 * i, name, KVT_DTYPE_I8, 3, qshape)))
            return rc;
        snprintf(name, sizeof name, "blk%d.s", (int)i);
        if ((rc = kvt__tensor_expect(st, 2 * i + 1, name, KVT_DTYPE_F32, 3, sshape)))
            return rc;
        if ((rc = kvt__q8_check_scales(&st->tensors[2 * i + 1], "qkv")))
            return rc;
    }
    qkv_cache *q = qkv_alloc((int32_t)D, (int32_t)gs, (int32_t)B);
    if (!q)
        return kvt__fail(KVT_ENOMEM, "qkv decode: cannot allocate the cache");
    for (int32_t i = 0; i < (int32_t)nb; i++) {
        const kvt_tensor *qt = &st->tensors[2 * i], *sc = &st->tensors[2 * i + 1];
        int64_t rows = qt->shape[1];
        kvt_buf *buf;
        bool heap = true;
        if (rows == B && qkv_is_whole_block(qt, sc)) {
            buf = kvt_buf_retain(qt->owner); /* zero-copy restore */
            heap = false;
        } else {
            rc = kvt_buf_new(qkv_block_bytes(q), &buf);
            if (rc)
                goto fail;
            qkv_view d = qkv_at(q, kvt_buf_data(buf), B);
            size_t half_s = sc->bytes / 2, half_q = qt->bytes / 2;
            memcpy(d.ks, sc->data, half_s);
            memcpy(d.vs, (const char *)sc->data + half_s, half_s);
            memcpy(d.kq, qt->data, half_q);
            memcpy(d.vq, (const char *)qt->data + half_q, half_q);
            kvt_buf_count_copy(sc->bytes + qt->bytes);
        }
        rc = kvt__blocks_push(&q->blocks, buf, heap);
        if (rc) {
            kvt_buf_release(buf);
            goto fail;
        }
    }
    q->offset = st->offset;
    *out = &q->base;
    return 0;
fail:
    qkv_dispose(&q->base);
    return rc;
}

const kvt_cache_ops kvt__qkv_ops = {
    .kind = "qkv",
    .private_bytes = qkv_private_bytes,
    .foreach_buf = qkv_foreach_buf,
    .range = qkv_range,
    .trim = qkv_trim,
    .clone = qkv_clone,
    .append = qkv_append,
    .destroy = qkv_dispose,
    .encode = qkv_encode,
    .decode = qkv_decode,
};

KVT_API int kvt_qkv_create(int32_t kv_dim, int32_t group_size, int32_t block_tokens, kvt_cache **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_qkv_create: out is NULL");
    *out = NULL;
    if (kv_dim < 1 || kv_dim > KVT__DIM_MAX || block_tokens < 1 || block_tokens > KVT__DIM_MAX)
        return kvt__fail(KVT_EINVAL, "kvt_qkv_create: kv_dim %d and block_tokens %d must be in [1, %d]",
                         (int)kv_dim, (int)block_tokens, KVT__DIM_MAX);
    if (group_size < 1 || kv_dim % group_size)
        return kvt__fail(KVT_EINVAL, "kvt_qkv_create: group_size %d must be >= 1 and divide kv_dim %d",
                         (int)group_size, (int)kv_dim);
    qkv_cache *q = qkv_alloc(kv_dim, group_size, block_tokens);
    if (!q)
        return kvt__fail(KVT_ENOMEM, "kvt_qkv_create: cannot allocate the cache");
    *out = &q->base;
    return 0;
}

KVT_API int kvt_qkv_read_block(const kvt_cache *c, int64_t index, float *k_out, float *v_out, int32_t *n_tokens)
{
    if (!c || c->ops != &kvt__qkv_ops)
        return kvt__fail(KVT_EINVAL, "kvt_qkv_read_block: not a qkv cache");
    const qkv_cache *q = (const qkv_cache *)c;
    if (index < 0 || index >= q->blocks.n)
        return kvt__fail(KVT_ERANGE, "kvt_qkv_read_block: block %lld of %lld", (long long)index,
                         (long long)q->blocks.n);
    const int64_t B = q->block_tokens, rows = KVT__MIN(B, q->offset - index * B);
    const size_t D = (size_t)q->kv_dim, G = qkv_groups(q);
    qkv_view w = qkv_at(q, kvt_buf_data(q->blocks.v[index].buf), B);
    for (int64_t r = 0; r < rows; r++) {
        if (k_out)
            kvt__q8_dequantize_row(w.ks + (size_t)r * G, w.kq + (size_t)r * D, D, (size_t)q->group_size, k_out + (size_t)r * D);
        if (v_out)
            kvt__q8_dequantize_row(w.vs + (size_t)r * G, w.vq + (size_t)r * D, D, (size_t)q->group_size, v_out + (size_t)r * D);
    }
    if (n_tokens)
        *n_tokens = (int32_t)rows;
    return 0;
}

int kvt__qkv_block_rows(const kvt_cache *c, int64_t index, kvt_kv_rows *out)
{
    const qkv_cache *q = (const qkv_cache *)c;
    if (index < 0 || index >= q->blocks.n)
        return kvt__fail(KVT_ERANGE, "kvt_kv_block_rows: block %lld of %lld", (long long)index,
                         (long long)q->blocks.n);
    const int64_t B = q->block_tokens;
    qkv_view w = qkv_at(q, kvt_buf_data(q->blocks.v[index].buf), B);
    *out = (kvt_kv_rows){.dtype = KVT_DTYPE_I8, .k = w.kq, .v = w.vq, .k_scale = w.ks, .v_scale = w.vs,
                         .group_size = q->group_size, .n = (int32_t)KVT__MIN(B, q->offset - index * B)};
    return 0;
}

int32_t kvt__qkv_kv_dim(const kvt_cache *c) { return ((const qkv_cache *)c)->kv_dim; }
int32_t kvt__qkv_block_tokens(const kvt_cache *c) { return ((const qkv_cache *)c)->block_tokens; }
