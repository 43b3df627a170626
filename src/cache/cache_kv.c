/*
 * cache_kv.c: the "kv" cache kind (plain attention K/V in blocks of B tokens)
 * and the block table it shares with the "qkv" kind (see kvtier/cache.h,
 * DESIGN.md section 2).
 * A kv cache owns its block table and one reference to each block buffer.
 * Full blocks are immutable and shared by clones; the partial tail is written
 * in place only when this cache holds the sole reference to a buffer the
 * library allocated. It must never write into a buffer whose refs > 1 or that
 * it did not allocate (a decoded file region): it copies that one block first.
 */
#include "cache_internal.h"
#include "internal.h"

#include <stdio.h>
#include <string.h>

/* Tokens a blocked cache may hold (keeps every product far from overflow). */
#define KVT__MAX_TOKENS ((int64_t)1 << 40)

/* ---- block table ------------------------------------------------------------ */

static int kvt__blocks_reserve(kvt__blocks *b, int64_t need)
{
    if (need <= b->cap)
        return 0;
    int64_t cap = KVT__MAX(need, KVT__MAX(b->cap * 2, 4));
    if ((uint64_t)cap > SIZE_MAX / sizeof(kvt__blk))
        return kvt__fail(KVT_ENOMEM, "block table of %lld blocks is too large", (long long)cap);
    if (b->res && b->res->x) { /* the page-file side grows first: on failure nothing changed */
        kvt__blkres *x = kvt__realloc(b->res->x, (size_t)cap * sizeof(kvt__blkres));
        if (!x)
            return kvt__fail(KVT_ENOMEM, "cannot grow the page table to %lld blocks", (long long)cap);
        memset(x + b->cap, 0, (size_t)(cap - b->cap) * sizeof *x);
        b->res->x = x;
    }
    kvt__blk *v = kvt__realloc(b->v, (size_t)cap * sizeof(kvt__blk));
    if (!v)
        return kvt__fail(KVT_ENOMEM, "cannot grow the block table to %lld blocks", (long long)cap);
    b->v = v;
    b->cap = cap;
    return 0;
}

int kvt__blocks_prepare(kvt__blocks *b, int64_t offset, int64_t n, int32_t block_tokens, size_t block_bytes,
                        kvt__copy_rows_fn copy_rows, const void *ctx)
{
    int64_t fill = offset % block_tokens; /* rows in the partial tail, 0 if none */
    int64_t nb = (offset + n + block_tokens - 1) / block_tokens;
    int rc = kvt__blocks_reserve(b, nb);
    if (rc)
        return rc;
    kvt_buf *tail = NULL;
    kvt__blk *old = fill ? &b->v[b->n - 1] : NULL;
    /* Blocks unfilled past their rows: a partial block is read, encoded
     * (a compact copy) and paged only up to its rows, so its bytes are not
     * zero-filled (internal.h, kvt__buf_new_uninit). */
    if (old && (!old->heap || kvt_buf_refs(old->buf) > 1)) {
        rc = kvt__buf_new_uninit(block_bytes, &tail);
        if (rc)
            return rc;
    }
    for (int64_t i = b->n; i < nb; i++) {
        kvt_buf *buf;
        rc = kvt__buf_new_uninit(block_bytes, &buf);
        if (rc) {
            while (--i >= b->n)
                kvt_buf_release(b->v[i].buf);
            kvt_buf_release(tail);
            return rc;
        }
        b->v[i] = (kvt__blk){.buf = buf, .heap = true};
    }
    if (tail) {
        kvt_buf_count_copy(copy_rows(kvt_buf_data(tail), kvt_buf_data(old->buf), fill, ctx));
        kvt_buf_release(old->buf);
        old->buf = tail;
        old->heap = true;
    }
    b->n = nb;
    return 0;
}

int kvt__blocks_clone(const kvt__blocks *src, kvt__blocks *dst)
{
    *dst = (kvt__blocks){0};
    int rc = kvt__blocks_reserve(dst, KVT__MAX(src->n, 1));
    if (rc == 0 && src->res && src->res->x)
        rc = kvt__blocks_ensure_res(dst);
    if (rc) {
        kvt__blocks_free(dst);
        return rc;
    }
    for (int64_t i = 0; i < src->n; i++)
        kvt__blk_clone(src, dst, i);
    dst->n = src->n;
    return 0;
}

void kvt__blocks_truncate(kvt__blocks *b, int64_t keep)
{
    while (b->n > keep)
        kvt__blk_release(b, --b->n);
}

void kvt__blocks_free(kvt__blocks *b)
{
    kvt__blocks_detach(b);
    kvt__blocks_truncate(b, 0);
    kvt__free(b->v);
    if (b->res)
        kvt__free(b->res->x);
    kvt__free(b->res);
    *b = (kvt__blocks){0};
}

int kvt__blocks_push(kvt__blocks *b, kvt_buf *buf, bool heap)
{
    int rc = kvt__blocks_reserve(b, b->n + 1);
    if (rc)
        return rc;
    b->v[b->n++] = (kvt__blk){.buf = buf, .heap = heap};
    return 0;
}

void kvt__blocks_foreach(const kvt__blocks *b, void (*fn)(kvt_buf *buf, void *ctx), void *ctx)
{
    for (int64_t i = 0; i < b->n; i++)
        if (b->v[i].buf)
            fn(b->v[i].buf, ctx);
}

/* ---- the kv kind ------------------------------------------------------------ */

typedef struct kv_cache {
    kvt_cache base;
    int32_t kv_dim;       /* elements per token of K (and of V) */
    int32_t block_tokens; /* B */
    kvt_dtype dtype;      /* storage scheme: F32, F16 or BF16 */
    uint32_t es;          /* bytes per element of dtype (32 bits: the struct stays 64 bytes) */
    int64_t offset;       /* tokens held */
    kvt__blocks blocks;   /* each (2, B, kv_dim) of dtype: K rows then V rows */
} kv_cache;

static size_t kv_block_bytes(const kv_cache *kv)
{
    return 2 * (size_t)kv->block_tokens * (size_t)kv->kv_dim * kv->es;
}

/* Copies K rows [0, rows) and V rows [0, rows) between two blocks. */
static size_t kv_copy_rows(void *dst, const void *src, int64_t rows, const void *ctx)
{
    const kv_cache *kv = ctx;
    size_t half = (size_t)kv->block_tokens * (size_t)kv->kv_dim * kv->es; /* bytes */
    size_t n = (size_t)rows * (size_t)kv->kv_dim * kv->es;
    memcpy(dst, src, n);
    memcpy((char *)dst + half, (const char *)src + half, n);
    return 2 * n;
}

static size_t kv_private_bytes(const kvt_cache *c)
{
    const kv_cache *kv = (const kv_cache *)c;
    return sizeof *kv + (size_t)kv->blocks.cap * (sizeof(kvt__blk) + (kv->blocks.res && kv->blocks.res->x ? sizeof(kvt__blkres) : 0)) +
           (kv->blocks.res ? sizeof *kv->blocks.res : 0);
}

static void kv_foreach_buf(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx)
{
    kvt__blocks_foreach(&((const kv_cache *)c)->blocks, fn, ctx);
}

static void kv_range(const kvt_cache *c, int64_t *min_offset, int64_t *offset)
{
    *min_offset = 0;
    *offset = ((const kv_cache *)c)->offset;
}

static int kv_trim(kvt_cache *c, int64_t length)
{
    kv_cache *kv = (kv_cache *)c;
    int64_t keep = (length + kv->block_tokens - 1) / kv->block_tokens;
    /* a block cut into becomes the mutable tail again: RAM, private, no page */
    if (length % kv->block_tokens && keep <= kv->blocks.n) {
        int rc = kvt__blk_make_private(&kv->blocks, keep - 1, kv_block_bytes(kv));
        if (rc)
            return rc;
    }
    kvt__blocks_truncate(&kv->blocks, keep);
    kv->offset = length;
    (void)kvt__blocks_enforce(&kv->blocks, length / kv->block_tokens, kv_block_bytes(kv));
    return 0;
}

static kv_cache *kv_alloc(int32_t kv_dim, int32_t block_tokens, kvt_dtype dtype)
{
    kv_cache *kv = kvt__calloc(1, sizeof *kv);
    if (!kv)
        return NULL;
    kv->base.ops = &kvt__kv_ops;
    kv->kv_dim = kv_dim;
    kv->block_tokens = block_tokens;
    kv->dtype = dtype;
    kv->es = (uint32_t)kvt_dtype_size(dtype);
    return kv;
}

static void kv_dispose(kvt_cache *c)
{
    kv_cache *kv = (kv_cache *)c;
    kvt__blocks_free(&kv->blocks);
    kvt__free(kv);
}

static int kv_clone(const kvt_cache *c, kvt_cache **out)
{
    const kv_cache *src = (const kv_cache *)c;
    kv_cache *kv = kv_alloc(src->kv_dim, src->block_tokens, src->dtype);
    if (!kv)
        return kvt__fail(KVT_ENOMEM, "kv clone: cannot allocate the cache");
    int rc = kvt__blocks_clone(&src->blocks, &kv->blocks);
    if (rc) {
        kvt__free(kv);
        return rc;
    }
    kv->offset = src->offset;
    *out = &kv->base;
    return 0;
}

static int kv_append(kvt_cache *c, int64_t n, const void *const *inputs)
{
    kv_cache *kv = (kv_cache *)c;
    const float *k = inputs[0], *v = inputs[1];
    if (!k || !v)
        return kvt__fail(KVT_EINVAL, "kv append: %s input is NULL", !k ? "K" : "V");
    if (n > KVT__MAX_TOKENS - kv->offset)
        return kvt__fail(KVT_ERANGE, "kv append: %lld + %lld tokens exceeds the limit of %lld",
                         (long long)kv->offset, (long long)n, (long long)KVT__MAX_TOKENS);
    const int64_t B = kv->block_tokens;
    const size_t D = (size_t)kv->kv_dim;
    int rc = kvt__blocks_prepare(&kv->blocks, kv->offset, n, kv->block_tokens, kv_block_bytes(kv), kv_copy_rows,
                                 kv);
    if (rc)
        return rc;
    for (int64_t t = kv->offset, r = 0; r < n;) {
        int64_t row = t % B, cnt = KVT__MIN(B - row, n - r);
        char *dst = kvt_buf_data(kv->blocks.v[t / B].buf);
        /* F32 copies; F16/BF16 round (the dtype was checked at create) */
        (void)kvt_dtype_from_f32(kv->dtype, k + (size_t)r * D, dst + (size_t)row * D * kv->es, (size_t)cnt * D);
        (void)kvt_dtype_from_f32(kv->dtype, v + (size_t)r * D, dst + ((size_t)B + (size_t)row) * D * kv->es,
                                 (size_t)cnt * D);
        t += cnt;
        r += cnt;
    }
    kv->offset += n;
    /* under a residency bound: page out what the new full blocks pushed past it
     * (best effort: a failure leaves the blocks in RAM, the next append retries) */
    if (kv->blocks.res && kv->blocks.res->r && kv->offset / B > (kv->offset - n) / B)
        (void)kvt__blocks_enforce(&kv->blocks, kv->offset / B, kv_block_bytes(kv));
    return 0;
}

static int kv_encode(const kvt_cache *c, kvt_cache_state *out)
{
    const kv_cache *kv = (const kv_cache *)c;
    const int64_t B = kv->block_tokens, D = kv->kv_dim;
    const int64_t params[3] = {kv->kv_dim, kv->block_tokens, kv->dtype};
    /* F32 keeps the two parameters it always had (stored state stays valid) */
    int rc = kvt__state_begin(out, "kv", kv->offset, 0, kv->dtype == KVT_DTYPE_F32 ? 2 : 3, params,
                              (int32_t)kv->blocks.n);
    if (rc)
        return rc;
    for (int64_t i = 0; i < kv->blocks.n; i++) {
        char name[KVT_TENSOR_NAME_MAX];
        snprintf(name, sizeof name, "blk%lld", (long long)i);
        int64_t rows = KVT__MIN(B, kv->offset - i * B);
        const int64_t shape[3] = {2, rows, D};
        kvt_buf *buf = kv->blocks.v[i].buf;
        if (rows == B) {
            /* a block paged out (residency.h) is read back for the state */
            rc = kvt__blk_read(&kv->blocks, i, kv_block_bytes(kv), &buf);
            if (rc)
                return rc;
            kvt__tensor_set(&out->tensors[i], name, kv->dtype, 3, shape, kvt_buf_data(buf), kvt_buf_bytes(buf),
                            buf, i * B, (i + 1) * B);
            kvt_buf_release(buf);
            continue;
        }
        /* The partial tail: K rows and V rows are not adjacent in the block,
         * so the tensor gets a compact copy. */
        kvt_buf *tail;
        rc = kvt_buf_new(2 * (size_t)rows * (size_t)D * kv->es, &tail);
        if (rc)
            return rc;
        const char *src = kvt_buf_data(buf);
        char *dst = kvt_buf_data(tail);
        size_t n = (size_t)rows * (size_t)D * kv->es;
        memcpy(dst, src, n);
        memcpy(dst + n, src + (size_t)B * (size_t)D * kv->es, n);
        kvt_buf_count_copy(2 * n);
        kvt__tensor_set(&out->tensors[i], name, kv->dtype, 3, shape, dst, 2 * n, tail, -1, -1);
        kvt_buf_release(tail);
    }
    return 0;
}

static int kv_decode(const kvt_cache_state *st, kvt_cache **out)
{
    static const char *const names[3] = {"kv_dim", "block_tokens", "dtype"};
    static const int64_t lo[3] = {1, 1, KVT_DTYPE_F16}, hi[3] = {KVT__DIM_MAX, KVT__DIM_MAX, KVT_DTYPE_BF16};
    /* two parameters: F32; three: F16 or BF16 (F32 always encodes two) */
    int rc = kvt__params_expect(st, st->n_params == 3 ? 3 : 2, names, lo, hi);
    if (rc)
        return rc;
    const int64_t D = st->params[0], B = st->params[1];
    const kvt_dtype dt = st->n_params == 3 ? (kvt_dtype)st->params[2] : KVT_DTYPE_F32;
    if (st->min_offset != 0)
        return kvt__fail(KVT_EFORMAT, "kv state: min_offset is %lld, a kv cache reaches 0",
                         (long long)st->min_offset);
    if (st->offset > KVT__MAX_TOKENS)
        return kvt__fail(KVT_EFORMAT, "kv state: offset %lld exceeds the limit", (long long)st->offset);
    int64_t nb = (st->offset + B - 1) / B;
    if (nb != st->n_tensors)
        return kvt__fail(KVT_EFORMAT, "kv state: %d tensors, %lld tokens in blocks of %lld need %lld",
                         (int)st->n_tensors, (long long)st->offset, (long long)B, (long long)nb);
    for (int32_t i = 0; i < st->n_tensors; i++) {
        char name[KVT_TENSOR_NAME_MAX];
        snprintf(name, sizeof name, "blk%d", (int)i);
        const int64_t shape[3] = {2, KVT__MIN(B, st->offset - (int64_t)i * B), D};
        rc = kvt__tensor_expect(st, i, name, dt, 3, shape);
        if (rc)
            return rc;
    }
    kv_cache *kv = kv_alloc((int32_t)D, (int32_t)B, dt);
    if (!kv)
        return kvt__fail(KVT_ENOMEM, "kv decode: cannot allocate the cache");
    for (int32_t i = 0; i < st->n_tensors; i++) {
        const kvt_tensor *t = &st->tensors[i];
        int64_t rows = t->shape[1];
        kvt_buf *buf;
        bool heap = true;
        if (rows == B && kvt__tensor_is_whole_owner(t)) {
            buf = kvt_buf_retain(t->owner); /* zero-copy restore */
            heap = false;
        } else {
            rc = kvt_buf_new(kv_block_bytes(kv), &buf);
            if (rc)
                goto fail;
            size_t n = (size_t)rows * (size_t)D * kv->es;
            char *dst = kvt_buf_data(buf);
            memcpy(dst, t->data, n);
            memcpy(dst + (size_t)B * (size_t)D * kv->es, (const char *)t->data + n, n);
            kvt_buf_count_copy(2 * n);
        }
        rc = kvt__blocks_push(&kv->blocks, buf, heap);
        if (rc) {
            kvt_buf_release(buf);
            goto fail;
        }
    }
    kv->offset = st->offset;
    *out = &kv->base;
    return 0;
fail:
    kv_dispose(&kv->base);
    return rc;
}

const kvt_cache_ops kvt__kv_ops = {
    .kind = "kv",
    .private_bytes = kv_private_bytes,
    .foreach_buf = kv_foreach_buf,
    .range = kv_range,
    .trim = kv_trim,
    .clone = kv_clone,
    .append = kv_append,
    .destroy = kv_dispose,
    .encode = kv_encode,
    .decode = kv_decode,
};

/* ---- public kv calls ---------------------------------------------------------- */

KVT_API int kvt_kv_create(int32_t kv_dim, int32_t block_tokens, kvt_cache **out)
{
    return kvt_kv_create_dtype(kv_dim, block_tokens, KVT_DTYPE_F32, out);
}

KVT_API int kvt_kv_create_dtype(int32_t kv_dim, int32_t block_tokens, kvt_dtype dtype, kvt_cache **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_kv_create: out is NULL");
    *out = NULL;
    if (kv_dim < 1 || kv_dim > KVT__DIM_MAX || block_tokens < 1 || block_tokens > KVT__DIM_MAX)
        return kvt__fail(KVT_EINVAL, "kvt_kv_create: kv_dim %d and block_tokens %d must be in [1, %d]",
                         (int)kv_dim, (int)block_tokens, KVT__DIM_MAX);
    if (dtype != KVT_DTYPE_F32 && dtype != KVT_DTYPE_F16 && dtype != KVT_DTYPE_BF16)
        return kvt__fail(KVT_EINVAL, "kvt_kv_create: dtype %s: a kv cache stores F32, F16 or BF16 "
                         "(int8 K/V: the qkv kind)", kvt_dtype_name(dtype) ? kvt_dtype_name(dtype) : "(unknown)");
    kv_cache *kv = kv_alloc(kv_dim, block_tokens, dtype);
    if (!kv)
        return kvt__fail(KVT_ENOMEM, "kvt_kv_create: cannot allocate the cache");
    *out = &kv->base;
    return 0;
}

KVT_API int kvt_kv_block(const kvt_cache *c, int64_t index, const float **k, const float **v, int32_t *n_tokens)
{
    if (!c || c->ops != &kvt__kv_ops)
        return kvt__fail(KVT_EINVAL, "kvt_kv_block: not a kv cache");
    const kv_cache *kv = (const kv_cache *)c;
    if (kv->dtype != KVT_DTYPE_F32)
        return kvt__fail(KVT_EINVAL, "kvt_kv_block: the cache stores %s, not F32 (read it with kvt_kv_block_rows)",
                         kvt_dtype_name(kv->dtype));
    if (index < 0 || index >= kv->blocks.n)
        return kvt__fail(KVT_ERANGE, "kvt_kv_block: block %lld of %lld", (long long)index,
                         (long long)kv->blocks.n);
    if (!kv->blocks.v[index].buf)
        return kvt__fail(KVT_EINVAL, "kvt_kv_block: block %lld is paged out (kvt_kv_pin it first)", (long long)index);
    const float *base = kvt_buf_data(kv->blocks.v[index].buf);
    int64_t B = kv->block_tokens;
    if (k)
        *k = base;
    if (v)
        *v = base + (size_t)B * (size_t)kv->kv_dim;
    if (n_tokens)
        *n_tokens = (int32_t)KVT__MIN(B, kv->offset - index * B);
    return 0;
}

KVT_API int kvt_kv_block_rows(const kvt_cache *c, int64_t index, kvt_kv_rows *out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_kv_block_rows: out is NULL");
    if (c && c->ops == &kvt__qkv_ops)
        return kvt__qkv_block_rows(c, index, out);
    if (c && c->ops == &kvt__qkvc_ops)
        return kvt__qkvc_block_rows(c, index, out);
    if (!c || c->ops != &kvt__kv_ops)
        return kvt__fail(KVT_EINVAL, "kvt_kv_block_rows: not a kv or qkv cache");
    const kv_cache *kv = (const kv_cache *)c;
    if (index < 0 || index >= kv->blocks.n)
        return kvt__fail(KVT_ERANGE, "kvt_kv_block_rows: block %lld of %lld", (long long)index,
                         (long long)kv->blocks.n);
    if (!kv->blocks.v[index].buf || kv->blocks.v[index].state == KVT_BLOCK_RESTORING)
        return kvt__fail(KVT_EINVAL, "kvt_kv_block_rows: block %lld is paged out (%s): kvt_kv_pin it first",
                         (long long)index, kvt_block_state_name((kvt_block_state)kv->blocks.v[index].state));
    const char *base = kvt_buf_data(kv->blocks.v[index].buf);
    int64_t B = kv->block_tokens;
    *out = (kvt_kv_rows){.dtype = kv->dtype, .k = base, .v = base + (size_t)B * (size_t)kv->kv_dim * kv->es,
                         .n = (int32_t)KVT__MIN(B, kv->offset - index * B)};
    return 0;
}

KVT_API kvt_dtype kvt_kv_dtype(const kvt_cache *c)
{
    if (c && c->ops == &kvt__kv_ops)
        return ((const kv_cache *)c)->dtype;
    if (c && c->ops == &kvt__qkv_ops)
        return KVT_DTYPE_I8;
    if (c && c->ops == &kvt__qkvc_ops)
        return kvt__qkvc_sealed_dtype(c);
    if (c && c->ops == &kvt__rotating_ops)
        return kvt__rotating_dtype(c);
    return KVT_DTYPE_COUNT;
}

KVT_API int64_t kvt_kv_block_count(const kvt_cache *c)
{
    if (c && c->ops == &kvt__kv_ops)
        return ((const kv_cache *)c)->blocks.n;
    int64_t B = kvt_kv_block_tokens(c), n = c ? kvt_cache_offset(c) : 0;
    return B > 0 ? (n + B - 1) / B : 0;
}

KVT_API int32_t kvt_kv_block_tokens(const kvt_cache *c)
{
    if (c && c->ops == &kvt__kv_ops)
        return ((const kv_cache *)c)->block_tokens;
    if (c && c->ops == &kvt__qkv_ops)
        return kvt__qkv_block_tokens(c);
    if (c && c->ops == &kvt__qkvc_ops)
        return kvt__qkvc_block_tokens(c);
    return 0;
}

KVT_API int32_t kvt_kv_dim(const kvt_cache *c)
{
    if (c && c->ops == &kvt__kv_ops)
        return ((const kv_cache *)c)->kv_dim;
    if (c && c->ops == &kvt__rotating_ops)
        return kvt__rotating_kv_dim(c);
    if (c && c->ops == &kvt__qkv_ops)
        return kvt__qkv_kv_dim(c);
    if (c && c->ops == &kvt__qkvc_ops)
        return kvt__qkvc_kv_dim(c);
    return 0;
}

kvt__blocks *kvt__kv_table(const kvt_cache *c, int32_t *block_tokens, size_t *block_bytes, int64_t *offset)
{
    if (c && c->ops == &kvt__qkvc_ops)
        return kvt__qkvc_table(c, block_tokens, block_bytes, offset);
    if (!c || c->ops != &kvt__kv_ops)
        return NULL;
    kv_cache *kv = (kv_cache *)c;
    *block_tokens = kv->block_tokens;
    *block_bytes = kv_block_bytes(kv);
    *offset = kv->offset;
    return &kv->blocks;
}
