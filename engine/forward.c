/*
 * forward.c: the forward pass of a loaded model (model.h has the formulas):
 * batched prefill (one GEMM per projection over a chunk of tokens, attention
 * by GEMM over the kv cache's blocks) and single-token decode (GEMV). It owns
 * the model's scratch buffers and nothing else: K/V and recurrent state live
 * in the caller's kvtier caches, read through the cache.h API only. It must
 * never allocate per token (scratch grows only when the context outgrows it)
 * and never modify a cache before every argument has been checked.
 */
#include "model_internal.h"

#include "kernels.h"
#include "kvtier/residency.h"
#include "threads.h"

#include "util.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- scratch ------------------------------------------------------------ */

int kvt__model_alloc_scratch(kvt_model *m);
void kvt__model_free_scratch(kvt_model *m);

int kvt__model_alloc_scratch(kvt_model *m)
{
    const kvt_model_config *c = &m->cfg;
    size_t T = KVT_MODEL_CHUNK, d = (size_t)c->dim, kv = (size_t)c->kv_dim, h = (size_t)c->hidden_dim;
    size_t half = (size_t)c->head_size / 2;
    size_t total = T * (4 * d + 2 * kv + 2 * h) + d + 2 * T * half;
    float *p = kvt__malloc(total * sizeof(float));
    if (!p)
        return kvt__fail(KVT_ENOMEM, "%s: out of memory for %zu bytes of forward-pass scratch", m->path,
                         total * sizeof(float));
    m->scratch_block = p;
    kvt__scratch *s = &m->s;
    s->x = p, p += T * d;
    s->xb = p, p += T * d;
    s->q = p, p += T * d;
    s->att = p, p += T * d;
    s->k = p, p += T * kv;
    s->v = p, p += T * kv;
    s->hb = p, p += T * h;
    s->hb2 = p, p += T * h;
    s->state = p, p += d;
    s->rope_cos = p, p += T * half;
    s->rope_sin = p;
    s->scores = NULL;
    /* The engine splits work over its own threads; OpenBLAS runs each piece
     * single-threaded (its own threads would fight ours and spin). */
    openblas_set_num_threads(1);
    /* OpenBLAS falls back to its SSE3 "Prescott" kernels on a CPU it does not
     * know (e.g. 0.3.21 on Emerald Rapids): then the AVX kernels here are
     * faster for prefill too (OPENBLAS_CORETYPE=SkylakeX restores OpenBLAS's) */
    const char *core = openblas_get_corename();
    m->own_gemm = core && !strcmp(core, "Prescott") && strcmp(kvt__kernels_isa(), "c") != 0;
    return kvt_threads_create(0, &m->threads);
}

void kvt__model_free_scratch(kvt_model *m)
{
    kvt_threads_destroy(m->threads);
    kvt__free(m->scratch_block);
    kvt__free(m->s.scores);
    kvt__free(m->segs);
    kvt__free(m->conv);
    kvt__free(m->dec_block);
    m->threads = NULL;
    m->dec_block = NULL;
    m->dec_cap = 0;
    m->scratch_block = NULL;
    m->s.scores = NULL;
    m->segs = NULL;
    m->conv = NULL;
    m->conv_cap = 0;
}

/* Grows a scratch array (never shrinks) to at least n elements of `size`
 * bytes; *cap is its capacity in elements, kept in the model. */
static int ensure_array(kvt_model *m, void **arr, size_t *cap, size_t n, size_t size, const char *what)
{
    if (n <= *cap)
        return 0;
    size_t want = n < 1024 ? 1024 : n;
    if (want < *cap * 2)
        want = *cap * 2;
    void *p = kvt__realloc(*arr, want * size);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "%s: out of memory for %zu bytes of %s", m->path, want * size, what);
    *arr = p;
    *cap = want;
    return 0;
}

static int ensure_scores(kvt_model *m, size_t n)
{
    void *a = m->s.scores;
    int rc = ensure_array(m, &a, &m->scores_cap, n, sizeof(float), "attention scores");
    m->s.scores = a;
    return rc;
}

/* ---- kernels ---------------------------------------------------------- */

static void rmsnorm(float *o, const float *x, const float *w, int n)
{
    float ss = 0.0f;
    for (int j = 0; j < n; j++)
        ss += x[j] * x[j];
    ss /= (float)n;
    ss += 1e-5f;
    ss = 1.0f / sqrtf(ss);
    for (int j = 0; j < n; j++)
        o[j] = w[j] * (ss * x[j]);
}

/* Below this many multiply-adds a product runs on the calling thread only:
 * waking a worker costs more than it saves. */
#define PAR_MIN_MACS (1 << 17)
/* The same for the decode kernel's products (all products of one region
 * together): below about 0.5 M multiply-adds (a few tens of microseconds on
 * one core, e.g. every product of stories260K even batched 8 wide) the
 * hand-off to a worker and the wait for its part cost more than it saves. */
#define MM_PAR_MIN_MACS (1 << 19)
/* Parts per thread of a threaded product or decode attention: threads claim
 * parts as they come, so one the OS has not scheduled delays a run by at most
 * one part. */
#define PARTS_PER_THREAD 4
/* Products in one region of a decode step (Q, K and V read the same input) */
#define MM_MAX 3

typedef struct {
    float *out[MM_MAX];
    const float *W[MM_MAX];
    int n_out[MM_MAX];
    int n_mm;      /* products, each out[k] (T, n_out[k]) = x . W[k]^T */
    const float *x;
    int T, n_in;
    int rows;      /* 1: kvt__matmul_rows (decode), 0: OpenBLAS sgemm (prefill; one product) */
    int silu;      /* 1: then out[0] = silu(out[0]) * out[1] on the part's rows (n_out equal) */
} mm_job;

/* Rows [*r0, *r1) of n_out for part i of n, split on multiples of 8 rows so
 * every part's tiles are whole. */
static void part_rows(int n_out, int i, int n, int *r0, int *r1)
{
    *r0 = (int)((int64_t)n_out * i / n) & ~7;
    *r1 = i == n - 1 ? n_out : (int)((int64_t)n_out * (i + 1) / n) & ~7;
}

static void mm_part(void *vj, int i, int n)
{
    const mm_job *j = vj;
    for (int k = 0; k < j->n_mm; k++) {
        int r0, r1;
        part_rows(j->n_out[k], i, n, &r0, &r1);
        if (r1 <= r0)
            continue;
        if (j->rows)
            kvt__matmul_rows(j->out[k], (size_t)j->n_out[k], j->x, j->T, j->W[k], j->n_in, r0, r1);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->T, r1 - r0, j->n_in, 1.0f, j->x, j->n_in,
                        j->W[k] + (size_t)r0 * j->n_in, j->n_in, 0.0f, j->out[k] + r0, j->n_out[k]);
    }
    if (j->silu) {
        int r0, r1, no = j->n_out[0];
        part_rows(no, i, n, &r0, &r1);
        for (int t = 0; t < j->T && r1 > r0; t++)
            kvt__silu_mul(j->out[0] + (size_t)t * no + r0, j->out[1] + (size_t)t * no + r0, (size_t)(r1 - r0));
    }
}

/* Runs the job's products in one threaded region: a few parts per thread,
 * each part a slice of every product (>= 32 rows of the smallest), or one
 * part on the calling thread when the region is small. */
static void run_mm_job(kvt_model *m, mm_job *j)
{
    double macs = 0;
    int min_out = j->n_out[0];
    for (int k = 0; k < j->n_mm; k++)
        macs += (double)j->T * j->n_in * j->n_out[k], min_out = KVT__MIN(min_out, j->n_out[k]);
    int parts = 1;
    if (macs >= (j->rows ? MM_PAR_MIN_MACS : PAR_MIN_MACS) && min_out >= 64)
        parts = KVT__MIN(PARTS_PER_THREAD * kvt_threads_size(m->threads), min_out / 32);
    kvt_threads_run(m->threads, mm_part, j, parts);
}

static void run_matmul(kvt_model *m, float *out, const float *x, const float *W, int T, int n_in, int n_out, int rows)
{
    mm_job j = {{out}, {W}, {n_out}, 1, x, T, n_in, rows, 0};
    run_mm_job(m, &j);
}

/* out (T, n_out) = x (T, n_in) . W^T, W (n_out, n_in) row-major; rows of W
 * split over the worker threads. A prefill chunk (T > 1) runs OpenBLAS sgemm unless
 * OpenBLAS runs its generic SSE3 kernels on a CPU where ours are wider
 * (m->own_gemm); a single row runs the decode kernel. */
static void matmul(kvt_model *m, float *out, const float *x, const float *W, int T, int n_in, int n_out)
{
    run_matmul(m, out, x, W, T, n_in, n_out, T == 1 || m->own_gemm);
}

/* The same product for the n rows of a (batched) decode: always the decode
 * kernel, whose every output element is summed in an order that does not
 * depend on n (kernels.h), so a sequence's logits do not depend on what it is
 * batched with. */
static void matmul_rows(kvt_model *m, float *out, const float *x, const float *W, int n, int n_in, int n_out)
{
    run_matmul(m, out, x, W, n, n_in, n_out, 1);
}

/* Two or three products of the same n input rows through the decode kernel
 * in one threaded region (decode's Q, K, V; a recurrent layer's two gates):
 * each element has the bits matmul_rows gives it. */
static void matmul_rows3(kvt_model *m, const float *x, int n, int n_in, int n_mm, float *const *out,
                         const float *const *W, const int *n_out)
{
    mm_job j = {{NULL}, {NULL}, {0}, n_mm, x, n, n_in, 1, 0};
    for (int k = 0; k < n_mm; k++)
        j.out[k] = out[k], j.W[k] = W[k], j.n_out[k] = n_out[k];
    run_mm_job(m, &j);
}

/* cos/sin of one position, exactly as llama2.c run.c computes them:
 * freq = 1 / 10000^(head_dim / head_size), val = pos * freq. */
static void rope_row(int hs, int64_t pos, float *fcos, float *fsin)
{
    for (int j = 0; j < hs / 2; j++) {
        float freq = 1.0f / powf(10000.0f, (float)(2 * j) / (float)hs);
        float val = (float)(int)pos * freq;
        fcos[j] = cosf(val);
        fsin[j] = sinf(val);
    }
}

/* cos/sin tables (chunk, head_size / 2) for positions pos0 .. pos0 + T - 1. */
static void rope_tables(kvt_model *m, int64_t pos0, int T)
{
    size_t half = (size_t)m->cfg.head_size / 2;
    for (int t = 0; t < T; t++)
        rope_row(m->cfg.head_size, pos0 + t, m->s.rope_cos + t * half, m->s.rope_sin + t * half);
}

static void rope_apply(float *vec, int n, int hs, const float *fcos, const float *fsin)
{
    for (int i = 0; i < n; i += 2) {
        int j = (i % hs) / 2;
        float v0 = vec[i], v1 = vec[i + 1];
        vec[i] = v0 * fcos[j] - v1 * fsin[j];
        vec[i + 1] = v0 * fsin[j] + v1 * fcos[j];
    }
}

/* ---- attention ---------------------------------------------------------- */

/* One query head of a decode token (the one query at the end of its context)
 * over the first ctx keys held in n_segs segments (K/V in the cache's storage scheme,
 * converted on the fly by the kernels): scores into S (ctx floats), softmax,
 * then the weighted sum of the values into out (head_size floats). koff is
 * the head's kv head offset within a kv row. Used by decode and by prefill's
 * window layers, so a decode's attention is one code path. */
static void decode_head(const kvt_model_config *c, const kvt_kv_rows *segs, int n_segs, int ctx, const float *q,
                        size_t koff, float *S, float *out)
{
    int hs = c->head_size;
    size_t kv = (size_t)c->kv_dim;
    float scale = 1.0f / sqrtf((float)hs);
    /* the first ctx rows of the segments: a prompt row of a batched pass
     * reads the same keys its decode would, though later rows are in the
     * cache already */
    int base = 0;
    for (int s = 0; s < n_segs && base < ctx; s++) {
        kvt_kv_rows g = segs[s];
        g.n = KVT__MIN(g.n, ctx - base);
        kvt__attn_scores_rows(S + base, q, &g, koff, kv, hs, scale);
        base += g.n;
    }
    kvt__softmax(S, ctx);
    base = 0;
    for (int s = 0; s < n_segs && base < ctx; s++) {
        kvt_kv_rows g = segs[s];
        g.n = KVT__MIN(g.n, ctx - base);
        kvt__attn_values_rows(out, S + base, &g, koff, kv, hs, s > 0);
        base += g.n;
    }
}

/* K (v = 0) or V (v = 1) of one head of segment g as GEMM reads it: the
 * cache's own rows (ld kv_dim) when they are F32, else the head's slice
 * converted into conv (n, hs) (ld hs). */
static const float *seg_f32(const kvt_kv_rows *g, int v, size_t koff, size_t kv, int hs, float *conv, int *ld)
{
    if (g->dtype == KVT_DTYPE_F32) {
        *ld = (int)kv;
        return (const float *)(v ? g->v : g->k) + koff;
    }
    kvt__rows_to_f32(conv, g, v, koff, kv, hs);
    *ld = hs;
    return conv;
}

/* One attention job: T queries (s.q rows, RoPE applied) at positions p0..
 * over n_segs segments of keys/values holding ctx tokens in position order
 * (or, for a ring, any order with T = 1: then it is decode_head per head). Heads are split over the parts;
 * each part uses its own stripe of s.scores (stride floats). */
typedef struct {
    kvt_model *m;
    const kvt_kv_rows *segs;
    int n_segs;
    int64_t p0, ctx;
    int T;
    const float *q;     /* (T, dim) */
    float *out;         /* (T, dim) */
    size_t stride;      /* floats of scores per part */
    size_t conv_stride; /* floats of m->conv per part (0: every segment is F32) */
} attn_job;

static void attn_part(void *vj, int part, int n_parts)
{
    const attn_job *j = vj;
    const kvt_model_config *c = &j->m->cfg;
    int hs = c->head_size, d = c->dim, kv = c->kv_dim, kv_mul = c->n_heads / c->n_kv_heads;
    int h0 = c->n_heads * part / n_parts, h1 = c->n_heads * (part + 1) / n_parts;
    float scale = 1.0f / sqrtf((float)hs);
    float *S = j->m->s.scores + (size_t)part * j->stride; /* (T, ctx) */
    float *conv = j->conv_stride ? j->m->conv + (size_t)part * j->conv_stride : NULL;
    int ctx = (int)j->ctx;
    if (j->T == 1) {
        for (int h = h0; h < h1; h++)
            decode_head(c, j->segs, j->n_segs, ctx, j->q + (size_t)h * hs, (size_t)(h / kv_mul) * hs, S,
                        j->out + (size_t)h * hs);
        return;
    }
    for (int h = h0; h < h1; h++) {
        size_t koff = (size_t)(h / kv_mul) * hs;
        const float *qh = j->q + (size_t)h * hs;
        float *oh = j->out + (size_t)h * hs;
        int base = 0;
        for (int s = 0; s < j->n_segs; s++) {
            const kvt_kv_rows *g = &j->segs[s];
            /* causal: rows before t0 sit before this segment's first key */
            int t0 = base > j->p0 ? (int)(base - j->p0) : 0, ldk;
            if (t0 < j->T) {
                const float *K = seg_f32(g, 0, koff, (size_t)kv, hs, conv, &ldk);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->T - t0, g->n, hs, scale, qh + (size_t)t0 * d,
                            d, K, ldk, 0.0f, S + (size_t)t0 * ctx + base, ctx);
            }
            base += g->n;
        }
        for (int t = 0; t < j->T; t++) {
            float *row = S + (size_t)t * ctx;
            int n = (int)(j->p0 + t + 1); /* causal inside the batch */
            kvt__softmax(row, n);
            if (n < ctx) /* zero the future keys this row's segments multiply */
                memset(row + n, 0, (size_t)(ctx - n) * sizeof(float));
        }
        base = 0;
        for (int s = 0; s < j->n_segs; s++) {
            const kvt_kv_rows *g = &j->segs[s];
            int t0 = base > j->p0 ? (int)(base - j->p0) : 0, ldv; /* segment 0 always has t0 = 0 */
            if (t0 < j->T) {
                const float *V = seg_f32(g, 1, koff, (size_t)kv, hs, conv, &ldv);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, j->T - t0, hs, g->n, 1.0f,
                            S + (size_t)t0 * ctx + base, ctx, V, ldv, s ? 1.0f : 0.0f, oh + (size_t)t0 * d, d);
            }
            base += g->n;
        }
    }
}

static int run_attention(kvt_model *m, const kvt_kv_rows *segs, int n_segs, int64_t p0, int64_t ctx, int T,
                         const float *q, float *out)
{
    const kvt_model_config *c = &m->cfg;
    double macs = 2.0 * T * (double)ctx * c->dim;
    int parts = macs >= PAR_MIN_MACS ? kvt_threads_size(m->threads) : 1;
    if (parts > c->n_heads)
        parts = c->n_heads;
    size_t stride = (size_t)T * (size_t)ctx;
    int rc = ensure_scores(m, stride * (size_t)parts);
    if (rc != 0)
        return rc;
    size_t conv_stride = 0; /* prefill over converted K/V: the longest segment's head slice per part */
    for (int s = 0; T > 1 && s < n_segs; s++)
        if (segs[s].dtype != KVT_DTYPE_F32)
            conv_stride = KVT__MAX(conv_stride, (size_t)segs[s].n * (size_t)c->head_size);
    if (conv_stride) {
        void *a = m->conv;
        if ((rc = ensure_array(m, &a, &m->conv_cap, conv_stride * (size_t)parts, sizeof(float),
                               "converted K/V")) != 0)
            return rc;
        m->conv = a;
    }
    attn_job j = {m, segs, n_segs, p0, ctx, T, q, out, stride, conv_stride};
    kvt_threads_run(m->threads, attn_part, &j, parts);
    return 0;
}

/* The first ctx tokens of a kv cache as (ctx + B - 1) / B segments, one
 * per block (B = its block tokens), written to out. */
static int kv_segs(const kvt_model *m, const kvt_cache *cache, int64_t ctx, kvt_kv_rows *out)
{
    int32_t B = kvt_kv_block_tokens(cache);
    int64_t total = 0;
    for (int64_t b = 0; b < (ctx + B - 1) / B; b++) {
        int rc = kvt_kv_block_rows(cache, b, &out[b]);
        if (rc != 0)
            return rc;
        total += out[b].n;
    }
    if (total != ctx)
        return kvt__fail(KVT_EINVAL, "%s: kv cache blocks hold %lld tokens, expected %lld", m->path,
                         (long long)total, (long long)ctx);
    return 0;
}

/* Attention over a kv cache with paged-out blocks through a window of its
 * blocks (kvt_kv_window_*): for each group of heads, a pass over the K
 * blocks (the scores), the softmax of every score row over the whole
 * context, a pass over the V blocks (the values), a few blocks at a time.
 * Per head these are the operations of attn_part (T > 1) and decode_head
 * (T = 1, or every row when per_row) over resident blocks, in the same order
 * on the same bytes, so the result is the same bit for bit; only the
 * window's blocks are in RAM. per_row: the T rows are the prompt rows of a
 * batched pass, each attending as its own decode would (decode_head over
 * its first p0 + t + 1 keys), all of them against each block the walk
 * stages, so a chunk of rows walks the window once, not once per row. */
typedef struct {
    kvt_model *m;
    const kvt_kv_rows *segs; /* the chunk: blocks first .. first + n_segs - 1 */
    int n_segs;
    int64_t first;
    int32_t B;
    int64_t p0, ctx;
    int T, h0, h1; /* the head group */
    int per_row;   /* 1: each row attends as decode_head (T = 1 always does) */
    int pass;      /* WIN_SCORES, WIN_SOFTMAX or WIN_VALUES */
    const float *q;
    float *out;
    size_t stride;      /* floats of scores per head */
    size_t conv_stride; /* floats of m->conv per part (0: every block is F32) */
} win_job;

enum { WIN_SCORES, WIN_SOFTMAX, WIN_VALUES };

static void win_part(void *vj, int part, int n_parts)
{
    const win_job *j = vj;
    const kvt_model_config *c = &j->m->cfg;
    int hs = c->head_size, d = c->dim, kv = c->kv_dim, kv_mul = c->n_heads / c->n_kv_heads, G = j->h1 - j->h0;
    int a = j->h0 + G * part / n_parts, b = j->h0 + G * (part + 1) / n_parts, ctx = (int)j->ctx;
    float scale = 1.0f / sqrtf((float)hs);
    float *conv = j->conv_stride ? j->m->conv + (size_t)part * j->conv_stride : NULL;
    for (int h = a; h < b; h++) {
        size_t koff = (size_t)(h / kv_mul) * hs;
        const float *qh = j->q + (size_t)h * hs;
        float *oh = j->out + (size_t)h * hs;
        float *S = j->m->s.scores + (size_t)(h - j->h0) * j->stride; /* (T, ctx) */
        if (j->pass == WIN_SOFTMAX) {
            for (int t = 0; j->per_row && t < j->T; t++) /* row t: its first p0 + t + 1 keys */
                kvt__softmax(S + (size_t)t * ctx, (int)(j->p0 + t + 1));
            for (int t = 0; !j->per_row && t < j->T; t++) {
                float *row = S + (size_t)t * ctx;
                int n = (int)(j->p0 + t + 1);
                kvt__softmax(row, n);
                if (n < ctx)
                    memset(row + n, 0, (size_t)(ctx - n) * sizeof(float));
            }
            continue;
        }
        for (int s = 0; s < j->n_segs; s++) {
            const kvt_kv_rows *g = &j->segs[s];
            int64_t blk = j->first + s;
            int base = (int)(blk * j->B), ld;
            if (j->per_row) { /* row t: the first p0 + t + 1 keys (it sees no later row) */
                for (int t = 0; t < j->T; t++) {
                    kvt_kv_rows gt = *g;
                    gt.n = (int32_t)KVT__MIN((int64_t)gt.n, j->p0 + t + 1 - base);
                    if (gt.n <= 0)
                        continue;
                    float *St = S + (size_t)t * ctx;
                    if (j->pass == WIN_SCORES)
                        kvt__attn_scores_rows(St + base, qh + (size_t)t * d, &gt, koff, (size_t)kv, hs, scale);
                    else
                        kvt__attn_values_rows(oh + (size_t)t * d, St + base, &gt, koff, (size_t)kv, hs, blk > 0);
                }
                continue;
            }
            int t0 = base > j->p0 ? (int)(base - j->p0) : 0;
            if (t0 >= j->T)
                continue;
            if (j->pass == WIN_SCORES) {
                const float *K = seg_f32(g, 0, koff, (size_t)kv, hs, conv, &ld);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->T - t0, g->n, hs, scale, qh + (size_t)t0 * d,
                            d, K, ld, 0.0f, S + (size_t)t0 * ctx + base, ctx);
            } else {
                const float *V = seg_f32(g, 1, koff, (size_t)kv, hs, conv, &ld);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, j->T - t0, hs, g->n, 1.0f,
                            S + (size_t)t0 * ctx + base, ctx, V, ld, blk ? 1.0f : 0.0f, oh + (size_t)t0 * d, d);
            }
        }
    }
}

/* Scores of this many floats (16 MB) at most are held for one group of
 * heads (but never fewer heads than the parts the threads run); a larger
 * T x ctx x heads is split into groups of heads, each walking the blocks
 * again. */
#define WIN_SCORES_MAX ((size_t)4 << 20)

/* T rows at positions p0.. (q and out rows of dim floats), per_row as in
 * win_job (forced for T = 1); more: the next walk is over this cache again
 * (another piece of the pass: kv_piece), so its close starts no read-ahead
 * of the next layer (kvt_kv_window_close_same). @return 1 (attended through a window), 0 (no
 * block is paged out: nothing done, attend the resident blocks), or an
 * error. */
static int attn_windowed(kvt_model *m, kvt_cache *cache, int64_t p0, int T, int per_row, int more, const float *q,
                         float *out)
{
    const kvt_model_config *c = &m->cfg;
    int64_t ctx = p0 + T;
    int32_t B = kvt_kv_block_tokens(cache);
    int64_t nb = (ctx + B - 1) / B;
    int H = c->n_heads;
    int parts = 2.0 * T * (double)ctx * c->dim >= PAR_MIN_MACS ? kvt_threads_size(m->threads) : 1;
    size_t stride = (size_t)T * (size_t)ctx;
    int G = H; /* heads per group */
    while (G > KVT__MAX(parts, 1) && (size_t)G * stride > WIN_SCORES_MAX)
        G = KVT__MAX((G + 1) / 2, parts); /* never fewer heads than the threads run */
    parts = KVT__MIN(parts, G);
    int groups = (H + G - 1) / G;
    /* the walk: per group of heads, K blocks then V blocks, each pass paging
     * in only the half of a block it reads */
    int window = kvt_kv_window_open_halves(cache, ctx, 2 * groups);
    if (window <= 0)
        return window;
    int chunk = KVT__MAX(window / 2, 1); /* the rest of the window reads ahead */
    per_row = per_row || T == 1;
    size_t conv_stride = !per_row && kvt_kv_dtype(cache) != KVT_DTYPE_F32 ? (size_t)B * (size_t)c->head_size : 0;
    void *a = m->segs;
    int rc = ensure_array(m, &a, &m->segs_cap, (size_t)chunk, sizeof(kvt_kv_rows), "block pointers");
    m->segs = a;
    if (rc == 0)
        rc = ensure_scores(m, stride * (size_t)G);
    if (rc == 0 && conv_stride) {
        a = m->conv;
        rc = ensure_array(m, &a, &m->conv_cap, conv_stride * (size_t)parts, sizeof(float), "converted K/V");
        m->conv = a;
    }
    for (int h0 = 0; h0 < H && rc == 0; h0 += G) {
        win_job j = {m, m->segs, 0, 0, B, p0, ctx, T, h0, KVT__MIN(h0 + G, H), per_row, WIN_SCORES, q, out,
                     stride, conv_stride};
        for (int pass = WIN_SCORES; pass <= WIN_VALUES && rc == 0; pass++) {
            j.pass = pass;
            if (pass == WIN_SOFTMAX) {
                kvt_threads_run(m->threads, win_part, &j, parts);
                continue;
            }
            for (int64_t b0 = 0; b0 < nb && rc == 0; b0 += chunk) {
                int n = (int)KVT__MIN((int64_t)chunk, nb - b0), got = 0;
                while (got < n && (rc = kvt_kv_window_get(cache, b0 + got, &m->segs[got])) == 0)
                    got++;
                if (rc == 0) {
                    j.first = b0;
                    j.n_segs = n;
                    kvt_threads_run(m->threads, win_part, &j, parts);
                }
                for (int i = 0; i < got; i++)
                    kvt_kv_window_put(cache, b0 + i);
            }
        }
    }
    if (more)
        kvt_kv_window_close_same(cache);
    else
        kvt_kv_window_close(cache);
    return rc ? rc : 1;
}

/* Causal attention of T queries (q: rows of dim floats) at positions p0..
 * over a kv cache that already holds p0 + T tokens (their K/V appended).
 * Writes T rows of out; more as attn_windowed. */
static int attn_kv(kvt_model *m, kvt_cache *cache, int64_t p0, int T, int more, const float *q, float *out)
{
    int64_t ctx = p0 + T;
    int32_t B = kvt_kv_block_tokens(cache);
    int64_t n_blocks = (ctx + B - 1) / B;
    void *a = m->segs;
    int rc = ensure_array(m, &a, &m->segs_cap, (size_t)n_blocks, sizeof(kvt_kv_rows), "block pointers");
    m->segs = a;
    if (rc != 0)
        return rc;
    /* blocks paged out under a residency bound are read through a window */
    if ((rc = attn_windowed(m, cache, p0, T, 0, more, q, out)) != 0)
        return rc < 0 ? rc : 0;
    if ((rc = kv_segs(m, cache, ctx, m->segs)) == 0)
        rc = run_attention(m, m->segs, (int)n_blocks, p0, ctx, T, q, out);
    return rc;
}

/* Rows of the next piece of n rows at position pos that a kv layer's cache
 * takes and attends at once: all n, or up to the end of the open block of a
 * cache that seals blocks ("qkvc"). Appending a token of the next block
 * seals (converts) the open one, and each row must read its own block in
 * f32 and the blocks before it sealed, as its decode does; so the rows of
 * one block attend before the next block's rows are appended. Only
 * attention is split this way: the pass's products stay one. */
static int64_t kv_piece(kvt_cache *cache, int64_t pos, int64_t n)
{
    if (strcmp(kvt_cache_kind(cache), "qkvc") != 0)
        return n;
    int64_t B = kvt_kv_block_tokens(cache);
    return KVT__MIN(n, B - pos % B);
}

/* A kv layer of a chunk of T rows at positions p0..: appends the K/V rows
 * (s.k, s.v) and attends s.q into s.att, piece by piece (kv_piece). */
static int kv_layer(kvt_model *m, kvt_cache *cache, int64_t p0, int T)
{
    size_t kvd = (size_t)m->cfg.kv_dim, d = (size_t)m->cfg.dim;
    for (int t0 = 0, n; t0 < T; t0 += n) {
        n = (int)kv_piece(cache, p0 + t0, T - t0);
        const void *in[2] = {m->s.k + (size_t)t0 * kvd, m->s.v + (size_t)t0 * kvd};
        int rc = kvt_cache_append(cache, n, in);
        if (rc == 0)
            rc = attn_kv(m, cache, p0 + t0, n, t0 + n < T, m->s.q + (size_t)t0 * d, m->s.att + (size_t)t0 * d);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* Sliding-window attention: token by token, append then attend the ring
 * (slot order is not position order; softmax attention does not care). */
static int attn_window(kvt_model *m, kvt_cache *cache, int T)
{
    const kvt_model_config *c = &m->cfg;
    int rc;
    for (int t = 0; t < T; t++) {
        const void *in[2] = {m->s.k + (size_t)t * c->kv_dim, m->s.v + (size_t)t * c->kv_dim};
        if ((rc = kvt_cache_append(cache, 1, in)) != 0)
            return rc;
        kvt_kv_rows seg;
        if ((rc = kvt_rotating_rows(cache, &seg)) != 0)
            return rc;
        if ((rc = run_attention(m, &seg, 1, 0, seg.n, 1, m->s.q + (size_t)t * c->dim,
                                m->s.att + (size_t)t * c->dim)) != 0)
            return rc;
    }
    return 0;
}

/* Gated linear recurrence over the chunk; leaves out (T, dim), already
 * through wo, in s.xb (its input, read before). */
static int recurrent(kvt_model *m, kvt_cache *cache, int l, int T)
{
    const kvt_model_config *c = &m->cfg;
    int d = c->dim;
    const float *h0 = kvt_recurrent_state(cache);
    if (!h0)
        return kvt__fail(KVT_EINVAL, "layer %d: cache is not recurrent", l);
    float *A = m->s.q, *U = m->s.att, *h = m->s.state;
    memcpy(h, h0, (size_t)d * sizeof(float));
    matmul(m, A, m->s.xb, m->w.rec_wa[l], T, d, d);
    matmul(m, U, m->s.xb, m->w.rec_wx[l], T, d, d);
    for (int t = 0; t < T; t++) {
        float *a = A + (size_t)t * d;
        const float *u = U + (size_t)t * d;
        for (int j = 0; j < d; j++) {
            float g = 1.0f / (1.0f + expf(-a[j]));
            h[j] = g * h[j] + (1.0f - g) * u[j];
            a[j] = h[j];
        }
    }
    const void *in[1] = {h};
    int rc = kvt_cache_append(cache, T, in);
    if (rc != 0)
        return rc;
    matmul(m, m->s.xb, A, m->w.wo + (size_t)l * d * d, T, d, d);
    return 0;
}

/* The end of layer l for T rows: x += xb (the attention or recurrent
 * branch's output), then x += w2 (silu(w1 xb) * (w3 xb)) with xb =
 * rmsnorm(x). rows: products through the decode kernel (else OpenBLAS). */
static void ffn_residual(kvt_model *m, int l, int T, int rows)
{
    const kvt__weights *w = &m->w;
    kvt__scratch *s = &m->s;
    int d = m->cfg.dim, hd = m->cfg.hidden_dim;
    size_t hdd = (size_t)hd * d;
    for (size_t i = 0; i < (size_t)T * d; i++)
        s->x[i] += s->xb[i];
    for (int t = 0; t < T; t++)
        rmsnorm(s->xb + (size_t)t * d, s->x + (size_t)t * d, w->rms_ffn + (size_t)l * d, d);
    if (rows) { /* w1, w3 and silu(h) * g in one threaded region, each part on its rows */
        mm_job j = {{s->hb, s->hb2}, {w->w1 + l * hdd, w->w3 + l * hdd}, {hd, hd}, 2, s->xb, T, d, 1, 1};
        run_mm_job(m, &j);
    } else {
        run_matmul(m, s->hb, s->xb, w->w1 + l * hdd, T, d, hd, rows);
        run_matmul(m, s->hb2, s->xb, w->w3 + l * hdd, T, d, hd, rows);
        kvt__silu_mul(s->hb, s->hb2, (size_t)T * hd);
    }
    run_matmul(m, s->xb, s->hb, w->w2 + l * hdd, T, hd, d, rows);
    for (size_t i = 0; i < (size_t)T * d; i++)
        s->x[i] += s->xb[i];
}

/* One chunk of T tokens at positions p0.. through every layer. */
static int forward_chunk(kvt_model *m, kvt_cache **caches, const int32_t *tokens, int T, int64_t p0)
{
    const kvt_model_config *c = &m->cfg;
    const kvt__weights *w = &m->w;
    kvt__scratch *s = &m->s;
    int d = c->dim, kv = c->kv_dim, half = c->head_size / 2;
    size_t dd = (size_t)d * d, kd = (size_t)kv * d;
    int rc;
    for (int t = 0; t < T; t++)
        memcpy(s->x + (size_t)t * d, w->token_embedding + (size_t)tokens[t] * d, (size_t)d * sizeof(float));
    rope_tables(m, p0, T);
    for (int l = 0; l < c->n_layers; l++) {
        for (int t = 0; t < T; t++)
            rmsnorm(s->xb + (size_t)t * d, s->x + (size_t)t * d, w->rms_att + (size_t)l * d, d);
        if (c->layer_kind[l] == KVT_LAYER_RECURRENT) {
            if ((rc = recurrent(m, caches[l], l, T)) != 0)
                return rc;
        } else {
            matmul(m, s->q, s->xb, w->wq + l * dd, T, d, d);
            matmul(m, s->k, s->xb, w->wk + l * kd, T, d, kv);
            matmul(m, s->v, s->xb, w->wv + l * kd, T, d, kv);
            for (int t = 0; t < T; t++) {
                const float *fc_ = s->rope_cos + (size_t)t * half, *fs = s->rope_sin + (size_t)t * half;
                rope_apply(s->q + (size_t)t * d, d, c->head_size, fc_, fs);
                rope_apply(s->k + (size_t)t * kv, kv, c->head_size, fc_, fs);
            }
            if (c->layer_kind[l] == KVT_LAYER_WINDOW) {
                rc = attn_window(m, caches[l], T);
            } else {
                rc = kv_layer(m, caches[l], p0, T);
            }
            if (rc != 0)
                return rc;
            matmul(m, s->xb, s->att, w->wo + l * dd, T, d, d);
        }
        ffn_residual(m, l, T, T == 1);
    }
    return 0;
}

/* Checks caches and tokens; returns the start position in *p0. */
static int check_args(const kvt_model *m, kvt_cache **caches, const int32_t *tokens, int64_t n, int64_t *p0)
{
    const kvt_model_config *c = &m->cfg;
    if (!caches || !tokens)
        return kvt__fail(KVT_EINVAL, "%s: forward pass: NULL caches or tokens", m->path);
    if (n < 1)
        return kvt__fail(KVT_EINVAL, "%s: forward pass: %lld tokens; need at least 1", m->path, (long long)n);
    for (int32_t l = 0; l < c->n_layers; l++) {
        static const char *want[3] = {"kv", "rotating", "recurrent"};
        const char *k = caches[l] ? kvt_cache_kind(caches[l]) : NULL;
        int q8 = k && c->layer_kind[l] == KVT_LAYER_ATTN && (!strcmp(k, "qkv") || !strcmp(k, "qkvc")); /* sealed K/V */
        if (!k || (!q8 && strcmp(k, want[c->layer_kind[l]]) != 0))
            return kvt__fail(KVT_EINVAL, "%s: layer %d needs a \"%s\" cache, got %s%s%s", m->path, l,
                             want[c->layer_kind[l]], k ? "\"" : "", k ? k : "none", k ? "\"" : "");
        if (c->layer_kind[l] != KVT_LAYER_RECURRENT && kvt_kv_dim(caches[l]) != c->kv_dim)
            return kvt__fail(KVT_EINVAL, "%s: layer %d cache has kv_dim %d, the model needs %d", m->path, l,
                             kvt_kv_dim(caches[l]), c->kv_dim);
        if (c->layer_kind[l] == KVT_LAYER_RECURRENT && kvt_cache_bytes(caches[l]) < (size_t)c->dim * 4)
            return kvt__fail(KVT_EINVAL, "%s: layer %d recurrent state is smaller than %d floats", m->path, l,
                             c->dim);
    }
    *p0 = kvt_cache_offset(caches[0]);
    for (int32_t l = 1; l < c->n_layers; l++)
        if (kvt_cache_offset(caches[l]) != *p0)
            return kvt__fail(KVT_EINVAL, "%s: layer %d cache holds %lld tokens, layer 0 holds %lld", m->path, l,
                             (long long)kvt_cache_offset(caches[l]), (long long)*p0);
    if (*p0 + n > c->seq_len)
        return kvt__fail(KVT_ELIMIT, "%s: %lld cached + %lld new tokens = %lld exceeds seq_len %d", m->path,
                         (long long)*p0, (long long)n, (long long)(*p0 + n), c->seq_len);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return kvt__fail(KVT_EINVAL, "%s: token %lld is id %d, outside the vocabulary [0, %d)", m->path,
                             (long long)i, tokens[i], c->vocab_size);
    return 0;
}

KVT_API int kvt_model_prefill(kvt_model *m, kvt_cache **caches, const int32_t *tokens, int64_t n_tokens,
                              float *logits)
{
    if (!m)
        return kvt__fail(KVT_EINVAL, "kvt_model_prefill: NULL model");
    int64_t p0 = 0;
    int rc = check_args(m, caches, tokens, n_tokens, &p0);
    if (rc != 0)
        return rc;
    if (n_tokens == 1 && logits) /* one token: exactly what kvt_model_decode computes */
        return kvt_model_decode(m, caches, tokens[0], logits);
    int last = 0;
    for (int64_t i = 0, T; i < n_tokens; i += T) {
        T = KVT__MIN((int64_t)KVT_MODEL_CHUNK, n_tokens - i);
        rc = forward_chunk(m, caches, tokens + i, (int)T, p0 + i);
        if (rc != 0)
            return rc;
        last = (int)T - 1;
    }
    if (logits) {
        rmsnorm(m->s.xb, m->s.x + (size_t)last * m->cfg.dim, m->w.rms_final, m->cfg.dim);
        matmul_rows(m, logits, m->s.xb, m->w.wcls, 1, m->cfg.dim, m->cfg.vocab_size);
    }
    return 0;
}

/* ---- batched passes: decode rows and prompt rows of several sequences ---------- */

/* Grows the per-sequence arrays of a batched pass to n sequences. */
static int ensure_decode(kvt_model *m, size_t n)
{
    if (n <= m->dec_cap)
        return 0;
    size_t L = (size_t)m->cfg.n_layers, R = KVT_MODEL_CHUNK;
    size_t bytes = n * (L * sizeof(void *) + sizeof(int64_t)) + R * (sizeof(int64_t) + 3 * sizeof(int32_t));
    void *p = kvt__malloc(bytes);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "%s: out of memory for %zu bytes of batched-decode scratch", m->path, bytes);
    kvt__free(m->dec_block);
    m->dec_block = p;
    m->dec_ptrs = p;
    m->dec_pos = (int64_t *)(void *)(m->dec_ptrs + n * L);
    m->dec_ctx = m->dec_pos + n;
    m->dec_seg0 = (int32_t *)(void *)(m->dec_ctx + R);
    m->dec_nseg = m->dec_seg0 + R;
    m->dec_row = m->dec_nseg + R;
    m->dec_cap = n;
    return 0;
}

static int cmp_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)*(const void *const *)a, y = (uintptr_t)*(const void *const *)b;
    return x < y ? -1 : x > y;
}

/* Attention of n_rows rows, one job per (row, head): row r reads query row
 * dec_row[r] of s.q over the first dec_ctx[r] keys of segments
 * segs[dec_seg0[r] .. + dec_nseg[r]) and writes that row of s.att. */
typedef struct {
    kvt_model *m;
    int n_rows;
    size_t stride; /* floats of scores per part */
} dec_attn_job;

static void dec_attn_part(void *vj, int part, int n_parts)
{
    const dec_attn_job *j = vj;
    kvt_model *m = j->m;
    const kvt_model_config *c = &m->cfg;
    int H = c->n_heads, hs = c->head_size, kv_mul = c->n_heads / c->n_kv_heads;
    int jobs = j->n_rows * H, j0 = (int)((int64_t)jobs * part / n_parts),
        j1 = (int)((int64_t)jobs * (part + 1) / n_parts);
    float *S = m->s.scores + (size_t)part * j->stride;
    for (int idx = j0; idx < j1; idx++) {
        int r = idx / H, h = idx % H;
        size_t row = (size_t)m->dec_row[r] * c->dim + (size_t)h * hs;
        decode_head(c, m->segs + m->dec_seg0[r], m->dec_nseg[r], (int)m->dec_ctx[r], m->s.q + row,
                    (size_t)(h / kv_mul) * hs, S, m->s.att + row);
    }
}

static int run_rows_attention(kvt_model *m, int n_rows)
{
    const kvt_model_config *c = &m->cfg;
    double macs = 0;
    int64_t max_ctx = 0;
    for (int r = 0; r < n_rows; r++) {
        macs += 2.0 * (double)m->dec_ctx[r] * c->dim;
        max_ctx = KVT__MAX(max_ctx, m->dec_ctx[r]);
    }
    int parts = macs >= PAR_MIN_MACS ? PARTS_PER_THREAD * kvt_threads_size(m->threads) : 1;
    if (parts > n_rows * c->n_heads)
        parts = n_rows * c->n_heads;
    int rc = ensure_scores(m, (size_t)max_ctx * (size_t)parts);
    if (rc != 0)
        return rc;
    dec_attn_job j = {m, n_rows, (size_t)max_ctx};
    kvt_threads_run(m->threads, dec_attn_part, &j, parts);
    return 0;
}

/* Rows of the n sequences of a pass: sequence i has cnt(i) rows from row
 * row0[i], at positions pos[i] ... */
#define CNT(counts, i) ((counts) ? (counts)[i] : 1)

/* Attention of one stage of a batched kv layer l: sequence i's piece[i]
 * rows from row row0[i] + done[i] (at position pos[i] + done[i]; their K/V
 * already appended) attend, every such row to the keys up to its own;
 * total: blocks of all those sequences' contexts; counts as dec_attention. */
static int kv_stage(kvt_model *m, kvt_cache **const *caches, const int64_t *pos, const int32_t *counts,
                    const int32_t *row0, int l, int n, const int32_t *done, const int32_t *piece, size_t total)
{
    const kvt_model_config *c = &m->cfg;
    void *a = m->segs;
    int rc = ensure_array(m, &a, &m->segs_cap, total, sizeof(kvt_kv_rows), "block pointers");
    m->segs = a;
    if (rc != 0)
        return rc;
    /* a sequence with paged-out blocks attends alone through a window, all
     * its rows against each staged block (per row the operations of the
     * batch's decode_head) */
    int windowed[KVT_MODEL_CHUNK] = {0}, pinned[KVT_MODEL_CHUNK] = {0};
    for (int i = 0; i < n; i++) {
        if (!piece[i])
            continue;
        size_t r = (size_t)(row0[i] + done[i]);
        rc = attn_windowed(m, caches[i][l], pos[i] + done[i], piece[i], 1, done[i] + piece[i] < CNT(counts, i),
                           m->s.q + r * c->dim, m->s.att + r * c->dim);
        if (rc < 0)
            return rc;
        windowed[i] = rc == 1; /* 0: nothing paged out: it attends in the batch */
    }
    rc = 0;
    int32_t k = 0;
    int nr = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        if (!piece[i] || windowed[i])
            continue;
        kvt_cache *cache = caches[i][l];
        int64_t ctx = pos[i] + done[i] + piece[i];
        int32_t B = kvt_kv_block_tokens(cache), nseg = (int32_t)((ctx + B - 1) / B);
        /* nothing of [0, ctx) is paged out (attn_windowed said so), so the pin
         * only starts the next layer's read-ahead: not before this layer's
         * last piece (as kvt_kv_window_close_same) */
        pinned[i] = done[i] + piece[i] == CNT(counts, i);
        if ((pinned[i] && (rc = kvt_kv_pin(cache, ctx)) != 0) || (rc = kv_segs(m, cache, ctx, m->segs + k)) != 0)
            break;
        for (int t = done[i]; t < done[i] + piece[i]; t++, nr++) {
            m->dec_row[nr] = row0[i] + t;
            m->dec_seg0[nr] = k;
            m->dec_nseg[nr] = nseg;
            m->dec_ctx[nr] = pos[i] + t + 1;
        }
        k += nseg;
    }
    if (rc == 0 && nr > 0)
        rc = run_rows_attention(m, nr);
    for (int i = 0; i < n; i++)
        if (pinned[i])
            kvt_kv_unpin(caches[i][l]);
    return rc;
}

/* Appends the new K/V rows (s.k, s.v) of layer l to every sequence and
 * attends: s.att (rows, dim) from s.q (rows, dim). Every row attends to the
 * keys up to and including its own, as its decode would. A window layer's
 * ring is written and read one row of each sequence at a time (its slots
 * are reused), a kv layer's rows a piece at a time (kv_piece: all at once
 * unless the rows cross a block boundary of a cache that seals blocks). */
static int dec_attention(kvt_model *m, kvt_cache **const *caches, const int64_t *pos, const int32_t *counts,
                         const int32_t *row0, int l, int n)
{
    const kvt_model_config *c = &m->cfg;
    size_t kvd = (size_t)c->kv_dim;
    int rc, window = c->layer_kind[l] == KVT_LAYER_WINDOW;
    if (window) {
        void *a = m->segs;
        rc = ensure_array(m, &a, &m->segs_cap, (size_t)n, sizeof(kvt_kv_rows), "block pointers");
        m->segs = a;
        int waves = 0;
        for (int i = 0; i < n; i++)
            waves = KVT__MAX(waves, CNT(counts, i));
        for (int w = 0; rc == 0 && w < waves; w++) {
            int nr = 0;
            for (int i = 0; rc == 0 && i < n; i++) {
                if (CNT(counts, i) <= w)
                    continue;
                int r = row0[i] + w;
                const void *in[2] = {m->s.k + (size_t)r * kvd, m->s.v + (size_t)r * kvd};
                if ((rc = kvt_cache_append(caches[i][l], 1, in)) != 0 ||
                    (rc = kvt_rotating_rows(caches[i][l], &m->segs[nr])) != 0)
                    break;
                m->dec_row[nr] = r;
                m->dec_seg0[nr] = nr;
                m->dec_nseg[nr] = 1;
                m->dec_ctx[nr] = m->segs[nr].n;
                nr++;
            }
            if (rc == 0)
                rc = run_rows_attention(m, nr);
        }
        return rc;
    }
    /* kv layers in stages: each stage appends every unfinished sequence's
     * next piece of rows (kv_piece: all of them, unless a sealing cache's
     * block ends first) and attends those rows together */
    int32_t done[KVT_MODEL_CHUNK] = {0}, piece[KVT_MODEL_CHUNK];
    for (;;) {
        size_t total = 0;
        int any = 0;
        for (int i = 0; i < n; i++) {
            piece[i] = 0;
            if (done[i] == CNT(counts, i))
                continue;
            kvt_cache *cache = caches[i][l];
            int64_t at = pos[i] + done[i];
            piece[i] = (int32_t)kv_piece(cache, at, CNT(counts, i) - done[i]);
            size_t r = (size_t)(row0[i] + done[i]);
            const void *in[2] = {m->s.k + r * kvd, m->s.v + r * kvd};
            if ((rc = kvt_cache_append(cache, piece[i], in)) != 0)
                return rc;
            int32_t B = kvt_kv_block_tokens(cache);
            total += (size_t)((at + piece[i] + B - 1) / B);
            any = 1;
        }
        if (!any)
            return 0;
        if ((rc = kv_stage(m, caches, pos, counts, row0, l, n, done, piece, total)) != 0)
            return rc;
        for (int i = 0; i < n; i++)
            done[i] += piece[i];
    }
}

/* Recurrent layer l for the rows of the n sequences: s.xb (rows, dim) in,
 * out (rows, dim) through wo left in s.xb. A sequence's rows run its
 * recurrence in turn; its cache receives the state after its last row. */
static int dec_recurrent(kvt_model *m, kvt_cache **const *caches, const int32_t *counts, const int32_t *row0, int l,
                         int n, int rows)
{
    int d = m->cfg.dim, rc;
    float *A = m->s.q, *U = m->s.att;
    float *au[2] = {A, U};
    const float *wau[2] = {m->w.rec_wa[l], m->w.rec_wx[l]};
    const int nau[2] = {d, d};
    matmul_rows3(m, m->s.xb, rows, d, 2, au, wau, nau);
    for (int i = 0; i < n; i++) {
        const float *h = kvt_recurrent_state(caches[i][l]);
        float *a = NULL;
        for (int t = 0; t < CNT(counts, i); t++) {
            a = A + (size_t)(row0[i] + t) * d;
            const float *u = U + (size_t)(row0[i] + t) * d;
            for (int j = 0; j < d; j++) {
                float g = 1.0f / (1.0f + expf(-a[j]));
                a[j] = g * h[j] + (1.0f - g) * u[j];
            }
            h = a;
        }
        const void *in[1] = {a};
        if ((rc = kvt_cache_append(caches[i][l], CNT(counts, i), in)) != 0)
            return rc;
    }
    matmul_rows(m, m->s.xb, A, m->w.wo + (size_t)l * d * d, rows, d, d);
    return 0;
}

/* n checked sequences with cnt(i) new tokens each (all rows <=
 * KVT_MODEL_CHUNK) at positions pos[i].. through every layer; logits (n,
 * vocab) of each sequence's last row. Row r's arithmetic depends only on its
 * own sequence's earlier tokens: every kernel works row by row, and every
 * row attends to exactly the keys its own decode would. */
static int decode_group(kvt_model *m, int n, kvt_cache **const *caches, const int32_t *counts,
                        const int32_t *tokens, const int64_t *pos, float *logits)
{
    const kvt_model_config *c = &m->cfg;
    const kvt__weights *w = &m->w;
    kvt__scratch *s = &m->s;
    int d = c->dim, kv = c->kv_dim, hs = c->head_size, rc;
    size_t dd = (size_t)d * d, kd = (size_t)kv * d, half = (size_t)hs / 2;
    int32_t row0[KVT_MODEL_CHUNK + 1];
    int R = 0;
    for (int i = 0; i < n; i++) {
        row0[i] = R;
        for (int t = 0; t < CNT(counts, i); t++, R++) {
            memcpy(s->x + (size_t)R * d, w->token_embedding + (size_t)tokens[R] * d, (size_t)d * sizeof(float));
            rope_row(hs, pos[i] + t, s->rope_cos + R * half, s->rope_sin + R * half);
        }
    }
    for (int l = 0; l < c->n_layers; l++) {
        for (int r = 0; r < R; r++)
            rmsnorm(s->xb + (size_t)r * d, s->x + (size_t)r * d, w->rms_att + (size_t)l * d, d);
        if (c->layer_kind[l] == KVT_LAYER_RECURRENT) {
            if ((rc = dec_recurrent(m, caches, counts, row0, l, n, R)) != 0)
                return rc;
        } else {
            float *qkv[3] = {s->q, s->k, s->v};
            const float *wqkv[3] = {w->wq + l * dd, w->wk + l * kd, w->wv + l * kd};
            const int nqkv[3] = {d, kv, kv};
            matmul_rows3(m, s->xb, R, d, 3, qkv, wqkv, nqkv);
            for (int r = 0; r < R; r++) {
                rope_apply(s->q + (size_t)r * d, d, hs, s->rope_cos + r * half, s->rope_sin + r * half);
                rope_apply(s->k + (size_t)r * kv, kv, hs, s->rope_cos + r * half, s->rope_sin + r * half);
            }
            if ((rc = dec_attention(m, caches, pos, counts, row0, l, n)) != 0)
                return rc;
            matmul_rows(m, s->xb, s->att, w->wo + l * dd, R, d, d);
        }
        ffn_residual(m, l, R, 1);
    }
    for (int i = 0; i < n; i++)
        rmsnorm(s->xb + (size_t)i * d, s->x + (size_t)(row0[i] + CNT(counts, i) - 1) * d, w->rms_final, d);
    matmul_rows(m, logits, s->xb, w->wcls, n, d, c->vocab_size);
    return 0;
}

/* Checks every sequence, then runs them in groups of at most
 * KVT_MODEL_CHUNK rows. counts NULL: one token each. */
static int forward_rows(kvt_model *m, int n, kvt_cache **const *caches, const int32_t *counts,
                        const int32_t *tokens, float *logits)
{
    int rc = ensure_decode(m, (size_t)n);
    if (rc != 0)
        return rc;
    size_t L = (size_t)m->cfg.n_layers;
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        int32_t k = CNT(counts, i);
        if (k < 1 || k > KVT_MODEL_CHUNK)
            return kvt__fail(KVT_EINVAL, "%s: batched pass, sequence %d: %d tokens; need 1 to %d", m->path, i,
                             (int)k, KVT_MODEL_CHUNK);
        if ((rc = check_args(m, caches[i], tokens + at, k, &m->dec_pos[i])) != 0) {
            char why[512];
            snprintf(why, sizeof why, "%s", kvt_last_error());
            return n == 1 ? rc : kvt__fail(rc, "batched decode, sequence %d: %s", i, why);
        }
        memcpy(m->dec_ptrs + (size_t)i * L, caches[i], L * sizeof(void *));
        at += k;
    }
    if (n > 1) { /* a cache in two sequences would get two tokens */
        qsort(m->dec_ptrs, (size_t)n * L, sizeof(void *), cmp_ptr);
        for (size_t i = 1; i < (size_t)n * L; i++)
            if (m->dec_ptrs[i] == m->dec_ptrs[i - 1])
                return kvt__fail(KVT_EINVAL, "%s: batched decode: one cache is passed in two sequences", m->path);
    }
    size_t V = (size_t)m->cfg.vocab_size;
    at = 0;
    for (int i = 0; i < n;) {
        int g = 0, rows = 0;
        while (i + g < n && rows + CNT(counts, i + g) <= KVT_MODEL_CHUNK) {
            rows += CNT(counts, i + g);
            g++;
        }
        if ((rc = decode_group(m, g, caches + i, counts ? counts + i : NULL, tokens + at, m->dec_pos + i,
                               logits + (size_t)i * V)) != 0)
            return rc;
        i += g;
        at += rows;
    }
    return 0;
}

KVT_API int kvt_model_decode_batch(kvt_model *m, int n, kvt_cache **const *caches, const int32_t *tokens,
                                   float *logits)
{
    if (!m || !caches || !tokens || !logits)
        return kvt__fail(KVT_EINVAL, "kvt_model_decode_batch: NULL %s",
                         !m ? "model" : !caches ? "caches" : !tokens ? "tokens" : "logits");
    if (n < 1)
        return kvt__fail(KVT_EINVAL, "%s: batched decode of %d sequences; need at least 1", m->path, n);
    return forward_rows(m, n, caches, NULL, tokens, logits);
}

KVT_API int64_t kvt_model_pass_rows(const kvt_model *m, kvt_cache **caches)
{
    return m && caches && caches[0] ? KVT_MODEL_CHUNK : 0;
}

KVT_API int kvt_model_forward_batch(kvt_model *m, int n, kvt_cache **const *caches, const int32_t *counts,
                                    const int32_t *tokens, float *logits)
{
    if (!m || !caches || !counts || !tokens || !logits)
        return kvt__fail(KVT_EINVAL, "kvt_model_forward_batch: NULL %s",
                         !m ? "model" : !caches ? "caches" : !counts ? "counts" : !tokens ? "tokens" : "logits");
    if (n < 1)
        return kvt__fail(KVT_EINVAL, "%s: batched pass over %d sequences; need at least 1", m->path, n);
    return forward_rows(m, n, caches, counts, tokens, logits);
}

KVT_API int kvt_model_decode(kvt_model *m, kvt_cache **caches, int32_t token, float *logits)
{
    if (!m || !logits)
        return kvt__fail(KVT_EINVAL, "kvt_model_decode: NULL %s", m ? "logits" : "model");
    if (!caches)
        return kvt__fail(KVT_EINVAL, "%s: forward pass: NULL caches or tokens", m->path);
    return kvt_model_decode_batch(m, 1, &caches, &token, logits);
}

/* ---- threads ------------------------------------------------------------ */

KVT_API int kvt_model_set_threads(kvt_model *m, int n_threads)
{
    if (!m)
        return kvt__fail(KVT_EINVAL, "kvt_model_set_threads: NULL model");
    if (n_threads < 1 || n_threads > KVT_MODEL_MAX_THREADS)
        return kvt__fail(KVT_EINVAL, "%s: %d threads: wants 1 to %d", m->path, n_threads, KVT_MODEL_MAX_THREADS);
    if (kvt_threads_size(m->threads) == n_threads)
        return 0;
    /* the new threads first: if they cannot start, the old ones stay */
    kvt_threads *p = NULL;
    int rc = kvt_threads_create(n_threads, &p);
    if (rc)
        return rc;
    kvt_threads_destroy(m->threads);
    m->threads = p;
    return 0;
}

KVT_API int kvt_model_get_threads(const kvt_model *m) { return m ? kvt_threads_size(m->threads) : 0; }
