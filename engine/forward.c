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

#include "pool.h"
#include "sampler.h"

#include "internal.h"

#include <cblas.h>
#include <math.h>
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
    return kvt__pool_create(0, &m->pool);
}

void kvt__model_free_scratch(kvt_model *m)
{
    kvt__pool_free(m->pool);
    kvt__free(m->scratch_block);
    kvt__free(m->s.scores);
    kvt__free(m->segs);
    m->pool = NULL;
    m->scratch_block = NULL;
    m->s.scores = NULL;
    m->segs = NULL;
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

typedef struct {
    float *out;
    const float *x, *W;
    int T, n_in, n_out;
} mm_job;

static void mm_part(void *vj, int i, int n)
{
    const mm_job *j = vj;
    int r0 = (int)((int64_t)j->n_out * i / n) & ~7, r1 = i == n - 1 ? j->n_out : (int)((int64_t)j->n_out * (i + 1) / n) & ~7;
    if (r1 <= r0)
        return;
    const float *W = j->W + (size_t)r0 * j->n_in;
    if (j->T == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, r1 - r0, j->n_in, 1.0f, W, j->n_in, j->x, 1, 0.0f, j->out + r0, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->T, r1 - r0, j->n_in, 1.0f, j->x, j->n_in, W, j->n_in,
                    0.0f, j->out + r0, j->n_out);
}

/* out (T, n_out) = x (T, n_in) . W^T, W (n_out, n_in) row-major; rows of W
 * split over the pool. */
static void matmul(kvt_model *m, float *out, const float *x, const float *W, int T, int n_in, int n_out)
{
    mm_job j = {out, x, W, T, n_in, n_out};
    double macs = (double)T * n_in * n_out;
    int parts = macs >= PAR_MIN_MACS && n_out >= 16 ? kvt__pool_size(m->pool) : 1;
    kvt__pool_run(m->pool, mm_part, &j, parts);
}

/* cos/sin tables for positions pos0 .. pos0 + T - 1, exactly as llama2.c run.c
 * computes them: freq = 1 / 10000^(head_dim / head_size), val = pos * freq. */
static void rope_tables(kvt_model *m, int64_t pos0, int T)
{
    int hs = m->cfg.head_size, half = hs / 2;
    for (int j = 0; j < half; j++) {
        float freq = 1.0f / powf(10000.0f, (float)(2 * j) / (float)hs); /* once per j, not per token */
        for (int t = 0; t < T; t++) {
            float val = (float)(int)(pos0 + t) * freq;
            m->s.rope_cos[(size_t)t * half + j] = cosf(val);
            m->s.rope_sin[(size_t)t * half + j] = sinf(val);
        }
    }
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

/* One attention job: T queries (s.q rows, RoPE applied) at positions p0..
 * over n_segs segments of keys/values holding ctx tokens in position order
 * (or, for a ring, any order with T = 1). Heads are split over the parts;
 * each part uses its own stripe of s.scores (stride floats). */
typedef struct {
    kvt_model *m;
    const kvt__seg *segs;
    int n_segs;
    int64_t p0, ctx;
    int T;
    const float *q; /* (T, dim) */
    float *out;     /* (T, dim) */
    size_t stride;  /* floats of scores per part */
} attn_job;

static void attn_part(void *vj, int part, int n_parts)
{
    const attn_job *j = vj;
    const kvt_model_config *c = &j->m->cfg;
    int hs = c->head_size, d = c->dim, kv = c->kv_dim, kv_mul = c->n_heads / c->n_kv_heads;
    int h0 = c->n_heads * part / n_parts, h1 = c->n_heads * (part + 1) / n_parts;
    float scale = 1.0f / sqrtf((float)hs);
    float *S = j->m->s.scores + (size_t)part * j->stride; /* (T, ctx) */
    int ctx = (int)j->ctx;
    for (int h = h0; h < h1; h++) {
        size_t koff = (size_t)(h / kv_mul) * hs;
        const float *qh = j->q + (size_t)h * hs;
        float *oh = j->out + (size_t)h * hs;
        int base = 0;
        for (int s = 0; s < j->n_segs; s++) {
            const kvt__seg *g = &j->segs[s];
            /* causal: rows before t0 sit before this segment's first key */
            int t0 = base > j->p0 ? (int)(base - j->p0) : 0;
            if (j->T == 1)
                cblas_sgemv(CblasRowMajor, CblasNoTrans, g->n, hs, scale, g->k + koff, kv, qh, 1, 0.0f, S + base, 1);
            else if (t0 < j->T)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->T - t0, g->n, hs, scale, qh + (size_t)t0 * d,
                            d, g->k + koff, kv, 0.0f, S + (size_t)t0 * ctx + base, ctx);
            base += g->n;
        }
        for (int t = 0; t < j->T; t++) {
            float *row = S + (size_t)t * ctx;
            int n = j->T == 1 ? ctx : (int)(j->p0 + t + 1); /* causal inside the batch */
            kvt_softmax(row, n);
            if (n < ctx) /* zero the future keys this row's segments multiply */
                memset(row + n, 0, (size_t)(ctx - n) * sizeof(float));
        }
        base = 0;
        for (int s = 0; s < j->n_segs; s++) {
            const kvt__seg *g = &j->segs[s];
            int t0 = base > j->p0 ? (int)(base - j->p0) : 0; /* segment 0 always has t0 = 0 */
            if (j->T == 1)
                cblas_sgemv(CblasRowMajor, CblasTrans, g->n, hs, 1.0f, g->v + koff, kv, S + base, 1, s ? 1.0f : 0.0f,
                            oh, 1);
            else if (t0 < j->T)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, j->T - t0, hs, g->n, 1.0f,
                            S + (size_t)t0 * ctx + base, ctx, g->v + koff, kv, s ? 1.0f : 0.0f, oh + (size_t)t0 * d, d);
            base += g->n;
        }
    }
}

static int run_attention(kvt_model *m, const kvt__seg *segs, int n_segs, int64_t p0, int64_t ctx, int T,
                         const float *q, float *out)
{
    const kvt_model_config *c = &m->cfg;
    double macs = 2.0 * T * (double)ctx * c->dim;
    int parts = macs >= PAR_MIN_MACS ? kvt__pool_size(m->pool) : 1;
    if (parts > c->n_heads)
        parts = c->n_heads;
    size_t stride = (size_t)T * (size_t)ctx;
    int rc = ensure_scores(m, stride * (size_t)parts);
    if (rc != 0)
        return rc;
    attn_job j = {m, segs, n_segs, p0, ctx, T, q, out, stride};
    kvt__pool_run(m->pool, attn_part, &j, parts);
    return 0;
}

/* Causal attention of T queries at positions p0.. over a kv cache that
 * already holds p0 + T tokens (the chunk's K/V appended). Writes s.att. */
static int attn_kv(kvt_model *m, const kvt_cache *cache, int64_t p0, int T)
{
    int64_t ctx = p0 + T;
    int32_t B = kvt_kv_block_tokens(cache);
    int64_t n_blocks = (ctx + B - 1) / B;
    void *a = m->segs;
    int rc = ensure_array(m, &a, &m->segs_cap, (size_t)n_blocks, sizeof(kvt__seg), "block pointers");
    m->segs = a;
    if (rc != 0)
        return rc;
    int64_t total = 0;
    for (int64_t b = 0; b < n_blocks; b++) {
        kvt__seg *g = &m->segs[b];
        if ((rc = kvt_kv_block(cache, b, &g->k, &g->v, &g->n)) != 0)
            return rc;
        total += g->n;
    }
    if (total != ctx)
        return kvt__fail(KVT_EINVAL, "%s: kv cache blocks hold %lld tokens, expected %lld", m->path,
                         (long long)total, (long long)ctx);
    return run_attention(m, m->segs, (int)n_blocks, p0, ctx, T, m->s.q, m->s.att);
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
        kvt__seg seg;
        if ((rc = kvt_rotating_view(cache, &seg.k, &seg.v, &seg.n)) != 0)
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

/* One chunk of T tokens at positions p0.. through every layer. */
static int forward_chunk(kvt_model *m, kvt_cache **caches, const int32_t *tokens, int T, int64_t p0)
{
    const kvt_model_config *c = &m->cfg;
    const kvt__weights *w = &m->w;
    kvt__scratch *s = &m->s;
    int d = c->dim, kv = c->kv_dim, hd = c->hidden_dim, half = c->head_size / 2;
    size_t dd = (size_t)d * d, kd = (size_t)kv * d, hdd = (size_t)hd * d;
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
                const void *in[2] = {s->k, s->v};
                rc = kvt_cache_append(caches[l], T, in);
                if (rc == 0)
                    rc = attn_kv(m, caches[l], p0, T);
            }
            if (rc != 0)
                return rc;
            matmul(m, s->xb, s->att, w->wo + l * dd, T, d, d);
        }
        for (size_t i = 0; i < (size_t)T * d; i++) /* residual: both branches leave out in xb */
            s->x[i] += s->xb[i];
        for (int t = 0; t < T; t++)
            rmsnorm(s->xb + (size_t)t * d, s->x + (size_t)t * d, w->rms_ffn + (size_t)l * d, d);
        matmul(m, s->hb, s->xb, w->w1 + l * hdd, T, d, hd);
        matmul(m, s->hb2, s->xb, w->w3 + l * hdd, T, d, hd);
        for (size_t i = 0; i < (size_t)T * hd; i++) {
            float v = s->hb[i];
            v *= 1.0f / (1.0f + expf(-v));
            s->hb[i] = v * s->hb2[i];
        }
        matmul(m, s->xb, s->hb, w->w2 + l * hdd, T, hd, d);
        for (size_t i = 0; i < (size_t)T * d; i++)
            s->x[i] += s->xb[i];
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
        if (!k || strcmp(k, want[c->layer_kind[l]]) != 0)
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

static void final_logits(kvt_model *m, int last, float *logits)
{
    const kvt_model_config *c = &m->cfg;
    rmsnorm(m->s.xb, m->s.x + (size_t)last * c->dim, m->w.rms_final, c->dim);
    cblas_sgemv(CblasRowMajor, CblasNoTrans, c->vocab_size, c->dim, 1.0f, m->w.wcls, c->dim, m->s.xb, 1, 0.0f,
                logits, 1);
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
    int last = 0;
    for (int64_t i = 0; i < n_tokens; i += KVT_MODEL_CHUNK) {
        int T = (int)KVT__MIN((int64_t)KVT_MODEL_CHUNK, n_tokens - i);
        rc = forward_chunk(m, caches, tokens + i, T, p0 + i);
        if (rc != 0)
            return rc;
        last = T - 1;
    }
    if (logits)
        final_logits(m, last, logits);
    return 0;
}

KVT_API int kvt_model_decode(kvt_model *m, kvt_cache **caches, int32_t token, float *logits)
{
    if (!m || !logits)
        return kvt__fail(KVT_EINVAL, "kvt_model_decode: NULL %s", m ? "logits" : "model");
    return kvt_model_prefill(m, caches, &token, 1, logits);
}
