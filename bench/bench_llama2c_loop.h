/*
 * bench_llama2c_loop.h: the loop of the llama2.c baseline (bench_llama2c.h),
 * included by bench_llama2c.c (built -Ofast -march=native, as run.c's `make
 * runfast`) and bench_llama2c_omp.c (the same plus -fopenmp, as `make
 * runomp`). The structure is run.c's: rmsnorm, a matmul that is one plain
 * dot-product loop per output row (`#pragma omp parallel for` over rows),
 * RoPE computed per pair with powf/cosf/sinf, attention head by head over a
 * contiguous KV array (`#pragma omp parallel for` over heads), softmax, the
 * SwiGLU FFN, the classifier. Private to the two files; state only.
 */
#ifndef KVT_BENCH_LLAMA2C_LOOP_H
#define KVT_BENCH_LLAMA2C_LOOP_H

#include "bench_llama2c.h"

#include <math.h>
#include <string.h>

#ifdef _OPENMP
#define L2C_OMP_FOR _Pragma("omp parallel for")
#else
#define L2C_OMP_FOR
#endif

struct kvt_llama2c {
    kvt_model_config c;
    void *map;        /* the checkpoint, mmap'ed read-only */
    size_t map_bytes;
    const float *emb, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final, *wcls;
    float *x, *xb, *xb2, *q, *att, *hb, *hb2; /* att (n_heads, seq_len) */
    float *kc, *vc;                           /* (layer, seq_len, kv_dim) */
};

static void l2c_rmsnorm(float *o, const float *x, const float *w, int n)
{
    float ss = 0.0f;
    for (int j = 0; j < n; j++)
        ss += x[j] * x[j];
    ss /= n;
    ss += 1e-5f;
    ss = 1.0f / sqrtf(ss);
    for (int j = 0; j < n; j++)
        o[j] = w[j] * (ss * x[j]);
}

static void l2c_softmax(float *x, int n)
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

/* out (d) = W (d, n) . x (n) */
static void l2c_matmul(float *out, const float *x, const float *w, int n, int d)
{
    int i;
    L2C_OMP_FOR
    for (i = 0; i < d; i++) {
        float val = 0.0f;
        for (int j = 0; j < n; j++)
            val += w[(size_t)i * n + j] * x[j];
        out[i] = val;
    }
}

static void l2c_forward(struct kvt_llama2c *p, int token, int pos, float *logits)
{
    const kvt_model_config *c = &p->c;
    int d = c->dim, kv = c->kv_dim, hs = c->head_size, hd = c->hidden_dim, kv_mul = c->n_heads / c->n_kv_heads;
    size_t dd = (size_t)d * d, kd = (size_t)kv * d, hdd = (size_t)hd * d;
    float *x = p->x;
    memcpy(x, p->emb + (size_t)token * d, (size_t)d * sizeof(float));
    for (int l = 0; l < c->n_layers; l++) {
        l2c_rmsnorm(p->xb, x, p->rms_att + (size_t)l * d, d);
        size_t loff = (size_t)l * c->seq_len * kv;
        float *k = p->kc + loff + (size_t)pos * kv, *v = p->vc + loff + (size_t)pos * kv;
        l2c_matmul(p->q, p->xb, p->wq + l * dd, d, d);
        l2c_matmul(k, p->xb, p->wk + l * kd, d, kv);
        l2c_matmul(v, p->xb, p->wv + l * kd, d, kv);
        for (int i = 0; i < d; i += 2) {
            float freq = 1.0f / powf(10000.0f, (float)(i % hs) / (float)hs), val = pos * freq;
            float fcr = cosf(val), fci = sinf(val);
            for (int r = 0; r < (i < kv ? 2 : 1); r++) {
                float *vec = r == 0 ? p->q : k, v0 = vec[i], v1 = vec[i + 1];
                vec[i] = v0 * fcr - v1 * fci;
                vec[i + 1] = v0 * fci + v1 * fcr;
            }
        }
        int h;
        L2C_OMP_FOR
        for (h = 0; h < c->n_heads; h++) {
            const float *q = p->q + (size_t)h * hs;
            float *att = p->att + (size_t)h * c->seq_len;
            for (int t = 0; t <= pos; t++) {
                const float *kt = p->kc + loff + (size_t)t * kv + (size_t)(h / kv_mul) * hs;
                float score = 0.0f;
                for (int i = 0; i < hs; i++)
                    score += q[i] * kt[i];
                att[t] = score / sqrtf((float)hs);
            }
            l2c_softmax(att, pos + 1);
            float *o = p->xb + (size_t)h * hs;
            memset(o, 0, (size_t)hs * sizeof(float));
            for (int t = 0; t <= pos; t++) {
                const float *vt = p->vc + loff + (size_t)t * kv + (size_t)(h / kv_mul) * hs;
                float a = att[t];
                for (int i = 0; i < hs; i++)
                    o[i] += a * vt[i];
            }
        }
        l2c_matmul(p->xb2, p->xb, p->wo + l * dd, d, d);
        for (int i = 0; i < d; i++)
            x[i] += p->xb2[i];
        l2c_rmsnorm(p->xb, x, p->rms_ffn + (size_t)l * d, d);
        l2c_matmul(p->hb, p->xb, p->w1 + l * hdd, d, hd);
        l2c_matmul(p->hb2, p->xb, p->w3 + l * hdd, d, hd);
        for (int i = 0; i < hd; i++) {
            float val = p->hb[i];
            val *= 1.0f / (1.0f + expf(-val));
            p->hb[i] = val * p->hb2[i];
        }
        l2c_matmul(p->xb, p->hb, p->w2 + l * hdd, hd, d);
        for (int i = 0; i < d; i++)
            x[i] += p->xb[i];
    }
    l2c_rmsnorm(x, x, p->rms_final, d);
    l2c_matmul(logits, x, p->wcls, d, c->vocab_size);
}

#endif
