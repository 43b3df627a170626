/*
 * cache_qkvc.c: the "qkvc" cache kind, K and V in sealed blocks of B tokens
 * and an open block kept in f32 (see kvtier/cache.h, DESIGN.md section 2).
 * The sealed blocks are stored as one of: 8-bit codes quantized per channel
 * over the block (U8: KIVI's layout for K, used here for V too), or IEEE
 * binary16 / bfloat16 values (F16, BF16: rounded to nearest even when the
 * block is sealed). The 8-bit layout is described first; the 16-bit ones
 * have no scales and follow the same open-block rule.
 *
 * A sealed block holds, for K and for V, one (min, step) pair per channel
 * taken over the block's B tokens, and one code per element: element c of
 * row t is fmaf(code, step[c], min[c]), code = round((x - min[c]) / step[c])
 * in [0, 255]. A channel's scale depends on every token of its block, so the
 * open block (the tail) stays f32 until a token of the next block arrives:
 * only then is it sealed. Attention therefore reads a query's own block in
 * f32 and every earlier block quantized, whatever the chunking of the
 * prefill was (the engine never lets one chunk cross a block boundary), and a
 * cached run equals an uncached one. The reachable range is [sealed tokens,
 * offset]: cutting into a sealed block would need f32 rows that are gone.
 * Below it the cache can still be cut at every block boundary (granule B,
 * kvt_cache_trim_granule): whole sealed blocks are dropped.
 *
 * It owns its two block tables (codes and scales, one reference per block)
 * and its tail; sealed blocks are immutable, and the tail is copied before a
 * write when it is shared (refs > 1) or foreign (decoded from a file region).
 *
 * Under a residency policy (kvtier/residency.h, kvt_kv_set_residency) the
 * codes table is paged like a kv cache's blocks: each sealed block (its K
 * rows, then its V rows: the halves a page-in reads) is written once to the
 * page file and its RAM released past the bound; the open block and a U8
 * cache's scales (4 x kv_dim floats per block) stay in RAM.
 */
#include "cache_internal.h"
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define KVT__QKVC_MAX_TOKENS ((int64_t)1 << 40)
/* params[2] of an encoded state: the byte layout this file reads and writes */
#define KVT__QKVC_LAYOUT 1

typedef struct qkvc_cache {
    kvt_cache base;
    int32_t kv_dim;       /* elements per token of K (and of V) */
    int32_t block_tokens; /* B */
    int64_t offset;       /* tokens held: codes.n * B + tail_rows */
    int64_t tail_rows;    /* rows of the open block, [0, B] */
    kvt_dtype sealed;     /* storage of the sealed blocks: U8 (codes and scales), F16 or BF16 */
    size_t es;            /* bytes per sealed element */
    kvt__blocks codes;    /* sealed blocks, each (2, B, kv_dim) of `sealed`: K rows then V rows */
    kvt__blocks scales;   /* U8 only: of each sealed block (4, kv_dim) f32: K min, K step, V min, V step */
    kvt_buf *tail;        /* (2, B, kv_dim) f32: K rows then V rows of the open block; NULL when none */
    bool tail_heap;       /* tail was made here (may be written once no one else holds it) */
} qkvc_cache;

static size_t block_elems(const qkvc_cache *q) { return 2 * (size_t)q->block_tokens * (size_t)q->kv_dim; }
static size_t code_bytes(const qkvc_cache *q) { return block_elems(q) * q->es; }
static size_t scale_bytes(const qkvc_cache *q) { return 4 * (size_t)q->kv_dim * sizeof(float); }
static size_t tail_bytes(const qkvc_cache *q) { return block_elems(q) * sizeof(float); }
static bool has_scales(const qkvc_cache *q) { return q->sealed == KVT_DTYPE_U8; }
static int64_t sealed_tokens(const qkvc_cache *q) { return q->codes.n * q->block_tokens; }

static size_t qkvc_private_bytes(const kvt_cache *c)
{
    const qkvc_cache *q = (const qkvc_cache *)c;
    const kvt__blocks_res *res = q->codes.res;
    return sizeof *q + (size_t)(q->codes.cap + q->scales.cap) * sizeof(kvt__blk) +
           (res ? sizeof *res + (res->x ? (size_t)q->codes.cap * sizeof(kvt__blkres) : 0) : 0);
}

static void qkvc_foreach_buf(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx)
{
    const qkvc_cache *q = (const qkvc_cache *)c;
    kvt__blocks_foreach(&q->codes, fn, ctx);
    kvt__blocks_foreach(&q->scales, fn, ctx);
    if (q->tail)
        fn(q->tail, ctx);
}

static void qkvc_range(const kvt_cache *c, int64_t *min_offset, int64_t *offset)
{
    const qkvc_cache *q = (const qkvc_cache *)c;
    *min_offset = sealed_tokens(q);
    *offset = q->offset;
}

static int qkvc_trim(kvt_cache *c, int64_t length)
{
    qkvc_cache *q = (qkvc_cache *)c; /* kvt_cache_trim checked length is reachable */
    if (length < sealed_tokens(q)) {
        /* a block boundary below the sealed tokens: whole sealed blocks go and
         * the open block is empty. The blocks kept are what an uncached run
         * holds there (its block length/B - 1, still open and f32, is sealed
         * from the same rows when the next token comes), so a run continuing
         * from here equals it. */
        int64_t keep = length / q->block_tokens;
        kvt__blocks_truncate(&q->codes, keep);
        kvt__blocks_truncate(&q->scales, keep);
        kvt_buf_release(q->tail);
        q->tail = NULL;
        q->tail_heap = false;
        q->tail_rows = 0;
    } else
        q->tail_rows = length - sealed_tokens(q);
    q->offset = length;
    return 0;
}

static qkvc_cache *qkvc_alloc(int32_t kv_dim, int32_t block_tokens, kvt_dtype sealed)
{
    qkvc_cache *q = kvt__calloc(1, sizeof *q);
    if (!q)
        return NULL;
    q->base.ops = &kvt__qkvc_ops;
    q->kv_dim = kv_dim;
    q->block_tokens = block_tokens;
    q->sealed = sealed;
    q->es = kvt_dtype_size(sealed);
    return q;
}

static void qkvc_dispose(kvt_cache *c)
{
    qkvc_cache *q = (qkvc_cache *)c;
    kvt__blocks_free(&q->codes);
    kvt__blocks_free(&q->scales);
    kvt_buf_release(q->tail);
    kvt__free(q);
}

static int qkvc_clone(const kvt_cache *c, kvt_cache **out)
{
    const qkvc_cache *src = (const qkvc_cache *)c;
    qkvc_cache *q = qkvc_alloc(src->kv_dim, src->block_tokens, src->sealed);
    if (!q)
        return kvt__fail(KVT_ENOMEM, "qkvc clone: cannot allocate the cache");
    int rc = kvt__blocks_clone(&src->codes, &q->codes);
    if (!rc)
        rc = kvt__blocks_clone(&src->scales, &q->scales);
    if (rc) {
        qkvc_dispose(&q->base);
        return rc;
    }
    q->offset = src->offset;
    q->tail_rows = src->tail_rows;
    q->tail = src->tail ? kvt_buf_retain(src->tail) : NULL;
    q->tail_heap = src->tail_heap;
    *out = &q->base;
    return 0;
}

/* One half (K or V) of a full tail (B rows x D) into codes (B, D) and
 * (min, step) (D each): per channel over the B rows. min and step are
 * always finite with step >= 0 (what decode accepts), whatever the rows
 * hold: min and max are taken over the finite values only (0 when there are
 * none), so +inf reads back as the channel's max and -inf and NaN as its
 * min, and a range wider than FLT_MAX is divided in double. */
static void seal_half(const float *x, size_t B, size_t D, uint8_t *codes, float *mn, float *step)
{
    float *mx = step; /* the maxima first, then the steps in place */
    for (size_t c = 0; c < D; c++) {
        mn[c] = INFINITY;
        mx[c] = -INFINITY;
    }
    for (size_t t = 0; t < B; t++)
        for (size_t c = 0; c < D; c++) {
            float v = x[t * D + c];
            if (isfinite(v)) {
                mn[c] = fminf(mn[c], v);
                mx[c] = fmaxf(mx[c], v);
            }
        }
    for (size_t c = 0; c < D; c++) {
        if (mn[c] > mx[c]) /* no finite value in this channel */
            mn[c] = mx[c] = 0.0f;
        float range = mx[c] - mn[c];
        step[c] = isfinite(range) ? range / 255.0f : (float)(((double)mx[c] - (double)mn[c]) / 255.0);
        while (!isfinite(fmaf(255.0f, step[c], mn[c]))) /* rounded up past FLT_MAX: what decode refuses */
            step[c] = nextafterf(step[c], 0.0f);
    }
    for (size_t t = 0; t < B; t++)
        for (size_t c = 0; c < D; c++) {
            float v = step[c] > 0 ? rintf((x[t * D + c] - mn[c]) / step[c]) : 0.0f;
            codes[t * D + c] = (uint8_t)fminf(fmaxf(v, 0.0f), 255.0f); /* fmaxf drops a NaN */
        }
}

/* Seals the full tail into the new buffers codes and (U8) scales: F16 and
 * BF16 round each value to nearest even (kvt_dtype_from_f32), U8 quantizes
 * each half per channel (seal_half). */
static void seal_into(const qkvc_cache *q, kvt_buf *codes, kvt_buf *scales)
{
    const size_t B = (size_t)q->block_tokens, D = (size_t)q->kv_dim;
    const float *x = kvt_buf_data(q->tail);
    if (!has_scales(q)) {
        (void)kvt_dtype_from_f32(q->sealed, x, kvt_buf_data(codes), block_elems(q)); /* F16/BF16: cannot fail */
        return;
    }
    uint8_t *cd = kvt_buf_data(codes);
    float *sc = kvt_buf_data(scales);
    seal_half(x, B, D, cd, sc, sc + D);
    seal_half(x + B * D, B, D, cd + B * D, sc + 2 * D, sc + 3 * D);
}

/* Makes the tail private and writable, keeping its first tail_rows rows. */
static int tail_writable(qkvc_cache *q)
{
    if (q->tail && q->tail_heap && kvt_buf_refs(q->tail) == 1)
        return 0;
    kvt_buf *t; /* rows past tail_rows are never read (internal.h, kvt__buf_new_uninit) */
    int rc = kvt__buf_new_uninit(tail_bytes(q), &t);
    if (rc)
        return rc;
    if (q->tail && q->tail_rows) { /* copy-on-write of the rows held */
        const size_t B = (size_t)q->block_tokens, D = (size_t)q->kv_dim, rb = (size_t)q->tail_rows * D * sizeof(float);
        const float *s = kvt_buf_data(q->tail);
        float *d = kvt_buf_data(t);
        memcpy(d, s, rb);
        memcpy(d + B * D, s + B * D, rb);
        kvt_buf_count_copy(2 * rb);
    }
    kvt_buf_release(q->tail);
    q->tail = t;
    q->tail_heap = true;
    return 0;
}

static int qkvc_append(kvt_cache *c, int64_t n, const void *const *inputs)
{
    qkvc_cache *q = (qkvc_cache *)c;
    const float *k = inputs[0], *v = inputs[1];
    if (!k || !v)
        return kvt__fail(KVT_EINVAL, "qkvc append: %s input is NULL", !k ? "K" : "V");
    if (n > KVT__QKVC_MAX_TOKENS - q->offset)
        return kvt__fail(KVT_ERANGE, "qkvc append: %lld + %lld tokens exceeds the limit", (long long)q->offset,
                         (long long)n);
    const int64_t B = q->block_tokens;
    const size_t D = (size_t)q->kv_dim;
    /* Every allocation first, so a failure leaves the cache as it was: the
     * blocks this append seals (a full tail is sealed when the next row
     * comes), their table slots, and a writable tail. */
    int64_t seals = (q->tail_rows + n - 1) / B;
    kvt_buf *nb[2 * 64];
    if (seals > 64) /* a long append: in pieces, each one all or nothing */
        for (int64_t done = 0; done < n;) {
            int64_t part = KVT__MIN(n - done, 32 * B);
            const void *in[2] = {k + (size_t)done * D, v + (size_t)done * D};
            int rc = qkvc_append(c, part, in);
            if (rc)
                return rc;
            done += part;
            if (done == n)
                return 0;
        }
    int rc = 0;
    int64_t made = 0;
    for (; made < seals && !rc; made++) {
        nb[2 * made + 1] = NULL; /* F16/BF16: no scales */
        if ((rc = kvt_buf_new(code_bytes(q), &nb[2 * made])) == 0 && has_scales(q) &&
            (rc = kvt_buf_new(scale_bytes(q), &nb[2 * made + 1])) != 0)
            kvt_buf_release(nb[2 * made]);
    }
    if (rc)
        made--;
    int64_t n0 = q->codes.n;
    for (int64_t i = 0; i < seals && !rc; i++) /* table slots: push placeholders, then drop them */
        if ((rc = kvt__blocks_push(&q->codes, NULL, true)) == 0 && has_scales(q))
            rc = kvt__blocks_push(&q->scales, NULL, true);
    kvt__blocks_truncate(&q->codes, n0);
    kvt__blocks_truncate(&q->scales, n0);
    if (!rc)
        rc = tail_writable(q);
    if (rc) {
        for (int64_t i = 0; i < 2 * made; i++)
            kvt_buf_release(nb[i]);
        return rc;
    }
    for (int64_t r = 0, s = 0; r < n;) {
        if (q->tail_rows == B) { /* seal the full block; the reserved slots make these pushes succeed */
            if (kvt_buf_refs(q->tail) != 1 && (rc = tail_writable(q)) != 0)
                return rc; /* unreachable: the tail was made writable above and nothing retained it */
            seal_into(q, nb[2 * s], nb[2 * s + 1]);
            (void)kvt__blocks_push(&q->codes, nb[2 * s], true);
            if (has_scales(q))
                (void)kvt__blocks_push(&q->scales, nb[2 * s + 1], true);
            s++;
            q->tail_rows = 0;
        }
        int64_t cnt = KVT__MIN(B - q->tail_rows, n - r);
        float *t = kvt_buf_data(q->tail);
        size_t rb = (size_t)cnt * D * sizeof(float);
        memcpy(t + (size_t)q->tail_rows * D, k + (size_t)r * D, rb);
        memcpy(t + ((size_t)B + (size_t)q->tail_rows) * D, v + (size_t)r * D, rb);
        q->tail_rows += cnt;
        r += cnt;
    }
    q->offset += n;
    /* under a residency bound: page out what the sealed blocks pushed past it
     * (best effort: a failure leaves the blocks in RAM, the next seal retries) */
    if (seals > 0 && q->codes.res && q->codes.res->r)
        (void)kvt__blocks_enforce(&q->codes, q->codes.n, code_bytes(q));
    return 0;
}

static int qkvc_encode(const kvt_cache *c, kvt_cache_state *out)
{
    const qkvc_cache *q = (const qkvc_cache *)c;
    const int64_t B = q->block_tokens, D = q->kv_dim, nb = q->codes.n;
    const int64_t params[4] = {q->kv_dim, q->block_tokens, KVT__QKVC_LAYOUT, q->sealed};
    const int64_t per = has_scales(q) ? 2 : 1; /* tensors per sealed block */
    if (nb > INT32_MAX / 2 - 1)
        return kvt__fail(KVT_ENOMEM, "qkvc encode: %lld blocks is too many", (long long)nb);
    int rc = kvt__state_begin(out, "qkvc", q->offset, sealed_tokens(q), has_scales(q) ? 3 : 4, params,
                              (int32_t)(per * nb + (q->tail_rows > 0)));
    if (rc)
        return rc;
    for (int64_t i = 0; i < nb; i++) {
        char name[KVT_TENSOR_NAME_MAX];
        const int64_t qshape[3] = {2, B, D}, sshape[2] = {4, D};
        kvt_buf *cb;
        /* a block paged out (residency.h) is read back for the state */
        if ((rc = kvt__blk_read(&q->codes, i, code_bytes(q), &cb)) != 0)
            return rc;
        snprintf(name, sizeof name, has_scales(q) ? "blk%lld.q" : "blk%lld", (long long)i);
        kvt__tensor_set(&out->tensors[per * i], name, q->sealed, 3, qshape, kvt_buf_data(cb), kvt_buf_bytes(cb), cb,
                        i * B, (i + 1) * B);
        kvt_buf_release(cb);
        if (!has_scales(q))
            continue;
        kvt_buf *sb = q->scales.v[i].buf;
        snprintf(name, sizeof name, "blk%lld.s", (long long)i);
        kvt__tensor_set(&out->tensors[2 * i + 1], name, KVT_DTYPE_F32, 2, sshape, kvt_buf_data(sb),
                        kvt_buf_bytes(sb), sb, i * B, (i + 1) * B);
    }
    if (q->tail_rows > 0) { /* the open block, f32, this entry's own (no token range) */
        const int64_t rows = q->tail_rows, shape[3] = {2, rows, D};
        kvt_buf *buf = q->tail;
        if (rows < B) { /* K rows and V rows are not adjacent: a compact copy */
            size_t rb = (size_t)rows * (size_t)D * sizeof(float);
            if ((rc = kvt_buf_new(2 * rb, &buf)))
                return rc;
            const float *s = kvt_buf_data(q->tail);
            memcpy(kvt_buf_data(buf), s, rb);
            memcpy((char *)kvt_buf_data(buf) + rb, s + (size_t)B * (size_t)D, rb);
            kvt_buf_count_copy(2 * rb);
        }
        kvt__tensor_set(&out->tensors[per * nb], "tail", KVT_DTYPE_F32, 3, shape, kvt_buf_data(buf),
                        2 * (size_t)rows * (size_t)D * sizeof(float), buf, -1, -1);
        if (rows < B)
            kvt_buf_release(buf);
    }
    return 0;
}

/* Whether every (min, step) of a sealed block's scales is finite, every
 * step >= 0, and every code reads back finite: fmaf(255, step, min) is the
 * largest value a channel reads (step >= 0), so it must not overflow. One
 * pass over the bits, no branch per value. */
static bool scales_ok(const float *s, size_t D)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < 4 * D; i++) {
        uint32_t b;
        memcpy(&b, &s[i], sizeof b);
        bad |= (uint32_t)((b & 0x7f800000u) == 0x7f800000u);               /* inf or NaN */
        bad |= (uint32_t)(((i / D) & 1u) && (b & 0x80000000u) && (b << 1)); /* a step below 0 */
    }
    for (size_t h = 0; h < 2 && !bad; h++)
        for (size_t c = 0; c < D; c++)
            bad |= (uint32_t)!isfinite(fmaf(255.0f, s[(2 * h + 1) * D + c], s[2 * h * D + c]));
    return !bad;
}

/* Decodes a state as qkvc_encode writes it: U8 params {kv_dim,
 * block_tokens, layout}, tensors "blk<i>.q" and "blk<i>.s" per sealed block;
 * F16/BF16 params {kv_dim, block_tokens, layout, dtype}, one tensor "blk<i>"
 * of that dtype per sealed block; then the open block's "tail" F32. */
static int qkvc_decode(const kvt_cache_state *st, kvt_cache **out)
{
    if (st->n_params >= 3 && st->params[2] != KVT__QKVC_LAYOUT)
        return kvt__fail(KVT_EFORMAT, "qkvc state: byte layout %lld is not one this build reads (layout %d)",
                         (long long)st->params[2], KVT__QKVC_LAYOUT);
    /* 3 params: 8-bit codes; a 4th names the 16-bit dtype of the sealed blocks */
    static const char *const names[4] = {"kv_dim", "block_tokens", "layout", "dtype"};
    const int64_t lo[4] = {1, 1, KVT__QKVC_LAYOUT, KVT_DTYPE_F16},
                  hi[4] = {KVT__DIM_MAX, KVT__DIM_MAX, KVT__QKVC_LAYOUT, KVT_DTYPE_BF16};
    const int32_t np = st->n_params == 4 ? 4 : 3;
    int rc = kvt__params_expect(st, np, names, lo, hi);
    if (rc)
        return rc;
    const kvt_dtype sealed = np == 4 ? (kvt_dtype)st->params[3] : KVT_DTYPE_U8;
    const int64_t per = np == 4 ? 1 : 2; /* tensors per sealed block */
    const int64_t D = st->params[0], B = st->params[1];
    if (st->offset > KVT__QKVC_MAX_TOKENS)
        return kvt__fail(KVT_EFORMAT, "qkvc state: offset %lld exceeds the limit", (long long)st->offset);
    int64_t n_sealed, tail = -1;
    bool has_tail = false;
    if (per == 2) { /* codes and scales per block, an odd last tensor is the open block */
        n_sealed = st->n_tensors / 2;
        has_tail = st->n_tensors % 2;
        tail = st->offset - n_sealed * B;
    } else if (st->min_offset >= 0 && st->min_offset <= st->offset) { /* one tensor per block */
        tail = st->offset - st->min_offset;
        has_tail = tail > 0;
        n_sealed = st->n_tensors - has_tail;
    } else {
        n_sealed = 0;
    }
    if (n_sealed < 0 || tail < 0 || tail > B || (tail > 0) != has_tail || st->min_offset != n_sealed * B)
        return kvt__fail(KVT_EFORMAT,
                         "qkvc state: %d tensors, offset %lld and min_offset %lld do not describe sealed blocks "
                         "of %lld tokens plus an open block",
                         (int)st->n_tensors, (long long)st->offset, (long long)st->min_offset, (long long)B);
    for (int32_t i = 0; i < (int32_t)n_sealed; i++) {
        char name[KVT_TENSOR_NAME_MAX];
        const int64_t qshape[3] = {2, B, D}, sshape[2] = {4, D};
        if (per == 1) {
            snprintf(name, sizeof name, "blk%d", (int)i);
            if ((rc = kvt__tensor_expect(st, i, name, sealed, 3, qshape)))
                return rc;
            continue;
        }
        snprintf(name, sizeof name, "blk%d.q", (int)i);
        if ((rc = kvt__tensor_expect(st, 2 * i, name, KVT_DTYPE_U8, 3, qshape)))
            return rc;
        snprintf(name, sizeof name, "blk%d.s", (int)i);
        if ((rc = kvt__tensor_expect(st, 2 * i + 1, name, KVT_DTYPE_F32, 2, sshape)))
            return rc;
    }
    if (has_tail) {
        const int64_t tshape[3] = {2, tail, D};
        if ((rc = kvt__tensor_expect(st, (int32_t)(per * n_sealed), "tail", KVT_DTYPE_F32, 3, tshape)))
            return rc;
    }
    qkvc_cache *q = qkvc_alloc((int32_t)D, (int32_t)B, sealed);
    if (!q)
        return kvt__fail(KVT_ENOMEM, "qkvc decode: cannot allocate the cache");
    for (int32_t i = 0; i < (int32_t)n_sealed; i++) {
        kvt_buf *cb = NULL, *sb = NULL;
        bool ch, sh = true;
        /* zero-copy: each tensor covering its own buffer is retained as is */
        if ((rc = kvt__tensor_adopt(&st->tensors[per * i], &cb, &ch)) ||
            (per == 2 && (rc = kvt__tensor_adopt(&st->tensors[2 * i + 1], &sb, &sh))))
            goto fail_block;
        if (per == 2 && !scales_ok(kvt_buf_data(sb), (size_t)D)) {
            rc = kvt__fail(KVT_EFORMAT, "qkvc state: blk%d.s holds a min or step that is not finite, a step "
                           "below 0, or a step that makes code 255 read as infinity", (int)i);
            goto fail_block;
        }
        if ((rc = kvt__blocks_push(&q->codes, cb, ch)))
            goto fail_block;
        cb = NULL;
        if (per == 2 && (rc = kvt__blocks_push(&q->scales, sb, sh)))
            goto fail_block;
        continue;
    fail_block:
        kvt_buf_release(cb);
        kvt_buf_release(sb);
        goto fail;
    }
    if (has_tail) {
        const kvt_tensor *t = &st->tensors[per * n_sealed];
        if (tail == B && kvt__tensor_is_whole_owner(t)) {
            q->tail = kvt_buf_retain(t->owner); /* zero-copy; copied before a write */
        } else {
            if ((rc = kvt__buf_new_uninit(tail_bytes(q), &q->tail))) /* rows past `tail` unread */
                goto fail;
            size_t rb = (size_t)tail * (size_t)D * sizeof(float);
            float *d = kvt_buf_data(q->tail);
            memcpy(d, t->data, rb);
            memcpy(d + (size_t)B * (size_t)D, (const char *)t->data + rb, rb);
            kvt_buf_count_copy(2 * rb);
            q->tail_heap = true;
        }
    }
    q->tail_rows = tail;
    q->offset = st->offset;
    *out = &q->base;
    return 0;
fail:
    qkvc_dispose(&q->base);
    return rc;
}

const kvt_cache_ops kvt__qkvc_ops = {
    .kind = "qkvc",
    .private_bytes = qkvc_private_bytes,
    .foreach_buf = qkvc_foreach_buf,
    .range = qkvc_range,
    .trim = qkvc_trim,
    .clone = qkvc_clone,
    .append = qkvc_append,
    .destroy = qkvc_dispose,
    .encode = qkvc_encode,
    .decode = qkvc_decode,
};

KVT_API int kvt_qkvc_create_dtype(int32_t kv_dim, int32_t block_tokens, kvt_dtype sealed, kvt_cache **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_qkvc_create: out is NULL");
    *out = NULL;
    if (kv_dim < 1 || kv_dim > KVT__DIM_MAX || block_tokens < 1 || block_tokens > KVT__DIM_MAX)
        return kvt__fail(KVT_EINVAL, "kvt_qkvc_create: kv_dim %d and block_tokens %d must be in [1, %d]",
                         (int)kv_dim, (int)block_tokens, KVT__DIM_MAX);
    if (sealed != KVT_DTYPE_U8 && sealed != KVT_DTYPE_F16 && sealed != KVT_DTYPE_BF16)
        return kvt__fail(KVT_EINVAL, "kvt_qkvc_create: sealed dtype %s is not U8, F16 or BF16",
                         kvt_dtype_name(sealed) ? kvt_dtype_name(sealed) : "(unknown)");
    qkvc_cache *q = qkvc_alloc(kv_dim, block_tokens, sealed);
    if (!q)
        return kvt__fail(KVT_ENOMEM, "kvt_qkvc_create: cannot allocate the cache");
    *out = &q->base;
    return 0;
}

KVT_API int kvt_qkvc_create(int32_t kv_dim, int32_t block_tokens, kvt_cache **out)
{
    return kvt_qkvc_create_dtype(kv_dim, block_tokens, KVT_DTYPE_U8, out);
}

int kvt__qkvc_block_rows(const kvt_cache *c, int64_t index, kvt_kv_rows *out)
{
    const qkvc_cache *q = (const qkvc_cache *)c;
    const int64_t nb = q->codes.n, B = q->block_tokens;
    const size_t D = (size_t)q->kv_dim;
    if (index >= 0 && index < nb && (!q->codes.v[index].buf || q->codes.v[index].state == KVT_BLOCK_RESTORING))
        return kvt__fail(KVT_EINVAL, "kvt_kv_block_rows: block %lld is paged out (%s): kvt_kv_pin it first",
                         (long long)index, kvt_block_state_name((kvt_block_state)q->codes.v[index].state));
    if (index >= 0 && index < nb && !has_scales(q)) {
        const char *b = kvt_buf_data(q->codes.v[index].buf);
        *out = (kvt_kv_rows){.dtype = q->sealed, .k = b, .v = b + (size_t)B * D * q->es, .n = (int32_t)B};
        return 0;
    }
    if (index >= 0 && index < nb) {
        const uint8_t *cd = kvt_buf_data(q->codes.v[index].buf);
        const float *s = kvt_buf_data(q->scales.v[index].buf);
        *out = (kvt_kv_rows){.dtype = KVT_DTYPE_U8, .k = cd, .v = cd + (size_t)B * D, .k_min = s, .k_scale = s + D,
                             .v_min = s + 2 * D, .v_scale = s + 3 * D, .n = (int32_t)B};
        return 0;
    }
    if (index == nb && q->tail_rows > 0) {
        const float *t = kvt_buf_data(q->tail);
        *out = (kvt_kv_rows){.dtype = KVT_DTYPE_F32, .k = t, .v = t + (size_t)B * D, .n = (int32_t)q->tail_rows};
        return 0;
    }
    return kvt__fail(KVT_ERANGE, "kvt_kv_block_rows: block %lld of %lld", (long long)index,
                     (long long)(nb + (q->tail_rows > 0)));
}

int32_t kvt__qkvc_kv_dim(const kvt_cache *c) { return ((const qkvc_cache *)c)->kv_dim; }
int32_t kvt__qkvc_block_tokens(const kvt_cache *c) { return ((const qkvc_cache *)c)->block_tokens; }
kvt_dtype kvt__qkvc_sealed_dtype(const kvt_cache *c) { return ((const qkvc_cache *)c)->sealed; }

kvt__blocks *kvt__qkvc_table(const kvt_cache *c, int32_t *block_tokens, size_t *block_bytes, int64_t *offset)
{
    qkvc_cache *q = (qkvc_cache *)c;
    *block_tokens = q->block_tokens;
    *block_bytes = code_bytes(q);
    *offset = q->offset;
    return &q->codes;
}
