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

#include "../src/internal.h"

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
    return 0;
}

void kvt__model_free_scratch(kvt_model *m)
{
    kvt__free(m->scratch_block);
    kvt__free(m->s.scores);
    m->scratch_block = NULL;
    m->s.scores = NULL;
}

/* Attention scores scratch: grown (never shrunk) to at least n floats;
 * *cap is the capacity in floats (kept in the model between calls). */
static int ensure_scores(kvt_model *m, size_t n, size_t *cap)
{
    if (n <= *cap)
        return 0;
    size_t want = n < 4096 ? 4096 : n;
    if (want < *cap * 2)
        want = *cap * 2;
    float *p = kvt__realloc(m->s.scores, want * sizeof(float));
    if (!p)
        return kvt__fail(KVT_ENOMEM, "%s: out of memory for %zu bytes of attention scores", m->path,
                         want * sizeof(float));
    m->s.scores = p;
    *cap = want;
    return 0;
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

/* out (T, n_out) = x (T, n_in) . W^T, W (n_out, n_in) row-major. */
static void matmul(float *out, const float *x, const float *W, int T, int n_in, int n_out)
{
    if (T == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n_out, n_in, 1.0f, W, n_in, x, 1, 0.0f, out, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, n_out, n_in, 1.0f, x, n_in, W, n_in, 0.0f, out,
                    n_out);
}

static void softmax(float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > mx)
            mx = x[i];
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    for (int i = 0; i < n; i++)
        x[i] /= sum;
}

/* cos/sin tables for positions pos0 .. pos0 + T - 1, exactly as llama2.c run.c
 * computes them: freq = 1 / 10000^(head_dim / head_size), val = pos * freq. */
static void rope_tables(kvt_model *m, int64_t pos0, int T)
{
    int hs = m->cfg.head_size, half = hs / 2;
    for (int t = 0; t < T; t++) {
        int pos = (int)(pos0 + t);
        for (int j = 0; j < half; j++) {
            float freq = 1.0f / powf(10000.0f, (float)(2 * j) / (float)hs);
            float val = (float)pos * freq;
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

/* One segment of keys/values: n rows of kv_dim floats. */
typedef struct {
    const float *k, *v;
    int32_t n;
} kv_seg;

/* Attention of one query token (q: dim floats, RoPE applied) over the
 * concatenated segments (n_total keys); writes dim floats to out. scores
 * holds n_total floats. */
static void attend_one(const kvt_model_config *c, const float *q, const kv_seg *segs, int n_segs, int n_total,
                       float *scores, float *out)
{
    int hs = c->head_size, kv = c->kv_dim, kv_mul = c->n_heads / c->n_kv_heads;
    float scale = 1.0f / sqrtf((float)hs);
    for (int h = 0; h < c->n_heads; h++) {
        const float *qh = q + (size_t)h * hs;
        size_t koff = (size_t)(h / kv_mul) * hs;
        int base = 0;
        for (int s = 0; s < n_segs; s++) {
            cblas_sgemv(CblasRowMajor, CblasNoTrans, segs[s].n, hs, scale, segs[s].k + koff, kv, qh, 1, 0.0f,
                        scores + base, 1);
            base += segs[s].n;
        }
        softmax(scores, n_total);
        float *oh = out + (size_t)h * hs;
        base = 0;
        for (int s = 0; s < n_segs; s++) {
            cblas_sgemv(CblasRowMajor, CblasTrans, segs[s].n, hs, 1.0f, segs[s].v + koff, kv, scores + base, 1,
                        s ? 1.0f : 0.0f, oh, 1);
            base += segs[s].n;
        }
    }
}

/* ---- layers ----------------------------------------------------------- */

typedef struct {
    kvt_model *m;
    size_t scores_cap; /* floats allocated at m->s.scores */
} fwd_ctx;

/* Causal attention of T queries at positions p0.. over a kv cache that
 * already holds p0 + T tokens (the chunk's K/V appended). att (T, dim). */
static int attn_kv(fwd_ctx *fc, const kvt_cache *cache, int64_t p0, int T)
{
    kvt_model *m = fc->m;
    const kvt_model_config *c = &m->cfg;
    int64_t ctx = p0 + T;
    int32_t B = kvt_kv_block_tokens(cache);
    int64_t n_blocks = (ctx + B - 1) / B;
    int rc;
    if (T == 1) {
        /* decode: segments = blocks; at most ctx scores + block pointers */
        if ((rc = ensure_scores(m, (size_t)ctx, &fc->scores_cap)) != 0)
            return rc;
        enum { SEG_BATCH = 64 };
        /* attend_one needs all segments at once for the softmax; gather them
         * in a small on-stack array per group of blocks when it fits, else
         * score block by block below. */
        if (n_blocks <= SEG_BATCH) {
            kv_seg segs[SEG_BATCH];
            int total = 0;
            for (int64_t b = 0; b < n_blocks; b++) {
                if ((rc = kvt_kv_block(cache, b, &segs[b].k, &segs[b].v, &segs[b].n)) != 0)
                    return rc;
                total += segs[b].n;
            }
            attend_one(c, m->s.q, segs, (int)n_blocks, total, m->s.scores, m->s.att);
            return 0;
        }
    }
    /* batched (or decode over many blocks): per head, S (T, ctx) = Q_h K_h^T by
     * blocks, causal mask + softmax per row, O_h = S V_h by blocks. */
    if ((rc = ensure_scores(m, (size_t)T * (size_t)ctx, &fc->scores_cap)) != 0)
        return rc;
    int hs = c->head_size, d = c->dim, kv = c->kv_dim, kv_mul = c->n_heads / c->n_kv_heads;
    float scale = 1.0f / sqrtf((float)hs);
    float *S = m->s.scores;
    for (int h = 0; h < c->n_heads; h++) {
        size_t koff = (size_t)(h / kv_mul) * hs;
        const float *qh = m->s.q + (size_t)h * hs;
        for (int64_t b = 0; b < n_blocks; b++) {
            const float *kb, *vb;
            int32_t nb;
            if ((rc = kvt_kv_block(cache, b, &kb, &vb, &nb)) != 0)
                return rc;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, nb, hs, scale, qh, d, kb + koff, kv, 0.0f,
                        S + b * B, (int)ctx);
        }
        for (int t = 0; t < T; t++) {
            float *row = S + (size_t)t * ctx;
            int64_t n = p0 + t + 1;
            softmax(row, (int)n);
            if (n < ctx)
                memset(row + n, 0, (size_t)(ctx - n) * sizeof(float));
        }
        float *oh = m->s.att + (size_t)h * hs;
        for (int64_t b = 0; b < n_blocks; b++) {
            const float *kb, *vb;
            int32_t nb;
            if ((rc = kvt_kv_block(cache, b, &kb, &vb, &nb)) != 0)
                return rc;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, nb, 1.0f, S + b * B, (int)ctx, vb + koff,
                        kv, b ? 1.0f : 0.0f, oh, d);
        }
    }
    return 0;
}

/* Sliding-window attention: token by token, append then attend the ring. */
static int attn_window(fwd_ctx *fc, kvt_cache *cache, int T)
{
    kvt_model *m = fc->m;
    const kvt_model_config *c = &m->cfg;
    int rc;
    if ((rc = ensure_scores(m, (size_t)c->sliding_window, &fc->scores_cap)) != 0)
        return rc;
    for (int t = 0; t < T; t++) {
        const void *in[2] = {m->s.k + (size_t)t * c->kv_dim, m->s.v + (size_t)t * c->kv_dim};
        if ((rc = kvt_cache_append(cache, 1, in)) != 0)
            return rc;
        kv_seg seg;
        if ((rc = kvt_rotating_view(cache, &seg.k, &seg.v, &seg.n)) != 0)
            return rc;
        attend_one(c, m->s.q + (size_t)t * c->dim, &seg, 1, seg.n, m->s.scores, m->s.att + (size_t)t * c->dim);
    }
    return 0;
}

/* Gated linear recurrence over the chunk; leaves out (T, dim) in s.att. */
static int recurrent(fwd_ctx *fc, kvt_cache *cache, int l, int T)
{
    kvt_model *m = fc->m;
    const kvt_model_config *c = &m->cfg;
    int d = c->dim;
    const float *h0 = kvt_recurrent_state(cache);
    if (!h0)
        return kvt__fail(KVT_EINVAL, "layer %d: cache is not recurrent", l);
    float *A = m->s.q, *U = m->s.att, *h = m->s.state;
    memcpy(h, h0, (size_t)d * sizeof(float));
    matmul(A, m->s.xb, m->w.rec_wa[l], T, d, d);
    matmul(U, m->s.xb, m->w.rec_wx[l], T, d, d);
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
    matmul(m->s.att, A, m->w.wo + (size_t)l * d * d, T, d, d);
    return 0;
}

/* One chunk of T tokens at positions p0.. through every layer. */
static int forward_chunk(fwd_ctx *fc, kvt_cache **caches, const int32_t *tokens, int T, int64_t p0)
{
    kvt_model *m = fc->m;
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
            if ((rc = recurrent(fc, caches[l], l, T)) != 0)
                return rc;
        } else {
            matmul(s->q, s->xb, w->wq + l * dd, T, d, d);
            matmul(s->k, s->xb, w->wk + l * kd, T, d, kv);
            matmul(s->v, s->xb, w->wv + l * kd, T, d, kv);
            for (int t = 0; t < T; t++) {
                const float *fc_ = s->rope_cos + (size_t)t * half, *fs = s->rope_sin + (size_t)t * half;
                rope_apply(s->q + (size_t)t * d, d, c->head_size, fc_, fs);
                rope_apply(s->k + (size_t)t * kv, kv, c->head_size, fc_, fs);
            }
            if (c->layer_kind[l] == KVT_LAYER_WINDOW) {
                rc = attn_window(fc, caches[l], T);
            } else {
                const void *in[2] = {s->k, s->v};
                rc = kvt_cache_append(caches[l], T, in);
                if (rc == 0)
                    rc = attn_kv(fc, caches[l], p0, T);
            }
            if (rc != 0)
                return rc;
            matmul(s->xb, s->att, w->wo + l * dd, T, d, d);
            for (size_t i = 0; i < (size_t)T * d; i++)
                s->x[i] += s->xb[i];
            goto ffn;
        }
        for (size_t i = 0; i < (size_t)T * d; i++)
            s->x[i] += s->att[i];
    ffn:
        for (int t = 0; t < T; t++)
            rmsnorm(s->xb + (size_t)t * d, s->x + (size_t)t * d, w->rms_ffn + (size_t)l * d, d);
        matmul(s->hb, s->xb, w->w1 + l * hdd, T, d, hd);
        matmul(s->hb2, s->xb, w->w3 + l * hdd, T, d, hd);
        for (size_t i = 0; i < (size_t)T * hd; i++) {
            float v = s->hb[i];
            v *= 1.0f / (1.0f + expf(-v));
            s->hb[i] = v * s->hb2[i];
        }
        matmul(s->xb, s->hb, w->w2 + l * hdd, T, hd, d);
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
    fwd_ctx fc = {m, m->scores_cap};
    int last = 0;
    for (int64_t i = 0; i < n_tokens; i += KVT_MODEL_CHUNK) {
        int T = (int)KVT__MIN((int64_t)KVT_MODEL_CHUNK, n_tokens - i);
        rc = forward_chunk(&fc, caches, tokens + i, T, p0 + i);
        m->scores_cap = fc.scores_cap;
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
