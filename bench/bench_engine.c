/*
 * bench_engine.c: `kvtier bench engine`: prefill and decode tokens/s of the
 * reference engine on stories260K and on the built-in default model, with
 * two baselines measured in the same run: the same prompt fed one token at a
 * time through the engine's decode (what batching buys), and a plain
 * llama2.c-style decode loop written here (naive single-threaded matvec over
 * a contiguous KV array) that the engine's decode must at least match.
 * Reports medians. Owns nothing beyond the run; never writes files except
 * the default model on first use (kvt_default_model).
 */
#include "bench_util.h"
#include "cli.h"
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the plain llama2.c-style baseline (plain attention models only) ---- */

typedef struct {
    const kvt_model_config *c;
    const float *w; /* the checkpoint's floats after the header (read from the file) */
    const float *emb, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final, *wcls;
    float *x, *xb, *xb2, *q, *k, *v, *att, *hb, *hb2, *kc, *vc; /* kc, vc: (layer, seq_len, kv_dim) */
    void *file;
} plain_llama;

static void pl_rmsnorm(float *o, const float *x, const float *w, int n)
{
    float ss = 0;
    for (int j = 0; j < n; j++)
        ss += x[j] * x[j];
    ss = 1.0f / sqrtf(ss / n + 1e-5f);
    for (int j = 0; j < n; j++)
        o[j] = w[j] * (ss * x[j]);
}

static void pl_matmul(float *o, const float *x, const float *w, int n, int d)
{
    for (int i = 0; i < d; i++) {
        float val = 0;
        for (int j = 0; j < n; j++)
            val += w[(size_t)i * n + j] * x[j];
        o[i] = val;
    }
}

static int pl_open(plain_llama *p, const char *path, const kvt_model_config *c)
{
    memset(p, 0, sizeof *p);
    p->c = c;
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    p->file = malloc((size_t)n);
    if (!p->file || fread(p->file, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        return -1;
    }
    fclose(f);
    size_t d = (size_t)c->dim, L = (size_t)c->n_layers, h = (size_t)c->hidden_dim, kv = (size_t)c->kv_dim;
    const float *w = (const float *)((const char *)p->file + 28);
    p->emb = w, w += (size_t)c->vocab_size * d;
    p->rms_att = w, w += L * d;
    p->wq = w, w += L * d * d;
    p->wk = w, w += L * kv * d;
    p->wv = w, w += L * kv * d;
    p->wo = w, w += L * d * d;
    p->rms_ffn = w, w += L * d;
    p->w1 = w, w += L * h * d;
    p->w2 = w, w += L * d * h;
    p->w3 = w, w += L * h * d;
    p->rms_final = w, w += d;
    w += (size_t)c->seq_len * c->head_size;
    p->wcls = c->shared_classifier ? p->emb : w;
    p->x = calloc(d, 4), p->xb = calloc(d, 4), p->xb2 = calloc(d, 4), p->q = calloc(d, 4);
    p->k = calloc(kv, 4), p->v = calloc(kv, 4), p->att = calloc((size_t)c->n_heads * c->seq_len, 4);
    p->hb = calloc(h, 4), p->hb2 = calloc(h, 4);
    p->kc = calloc(L * c->seq_len * kv, 4), p->vc = calloc(L * c->seq_len * kv, 4);
    return p->kc && p->vc ? 0 : -1;
}

static void pl_close(plain_llama *p)
{
    void *ptrs[] = {p->file, p->x, p->xb, p->xb2, p->q, p->k, p->v, p->att, p->hb, p->hb2, p->kc, p->vc};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        free(ptrs[i]);
}

static void pl_forward(plain_llama *p, int token, int pos, float *logits)
{
    const kvt_model_config *c = p->c;
    int d = c->dim, kv = c->kv_dim, hs = c->head_size, hd = c->hidden_dim, kv_mul = c->n_heads / c->n_kv_heads;
    size_t dd = (size_t)d * d, kd = (size_t)kv * d, hdd = (size_t)hd * d;
    memcpy(p->x, p->emb + (size_t)token * d, (size_t)d * 4);
    for (int l = 0; l < c->n_layers; l++) {
        pl_rmsnorm(p->xb, p->x, p->rms_att + (size_t)l * d, d);
        float *kr = p->kc + ((size_t)l * c->seq_len + pos) * kv, *vr = p->vc + ((size_t)l * c->seq_len + pos) * kv;
        pl_matmul(p->q, p->xb, p->wq + l * dd, d, d);
        pl_matmul(kr, p->xb, p->wk + l * kd, d, kv);
        pl_matmul(vr, p->xb, p->wv + l * kd, d, kv);
        for (int i = 0; i < d; i += 2) {
            float freq = 1.0f / powf(10000.0f, (float)(i % hs) / (float)hs), val = pos * freq;
            float fcr = cosf(val), fci = sinf(val);
            for (int v = 0; v < (i < kv ? 2 : 1); v++) {
                float *vec = v == 0 ? p->q : kr, v0 = vec[i], v1 = vec[i + 1];
                vec[i] = v0 * fcr - v1 * fci;
                vec[i + 1] = v0 * fci + v1 * fcr;
            }
        }
        for (int h = 0; h < c->n_heads; h++) {
            float *q = p->q + h * hs, *att = p->att + (size_t)h * c->seq_len;
            for (int t = 0; t <= pos; t++) {
                const float *k = p->kc + ((size_t)l * c->seq_len + t) * kv + (h / kv_mul) * hs;
                float s = 0;
                for (int i = 0; i < hs; i++)
                    s += q[i] * k[i];
                att[t] = s / sqrtf((float)hs);
            }
            float mx = att[0], sum = 0;
            for (int t = 1; t <= pos; t++)
                mx = att[t] > mx ? att[t] : mx;
            for (int t = 0; t <= pos; t++)
                sum += (att[t] = expf(att[t] - mx));
            float *o = p->xb + h * hs;
            memset(o, 0, (size_t)hs * 4);
            for (int t = 0; t <= pos; t++) {
                const float *v = p->vc + ((size_t)l * c->seq_len + t) * kv + (h / kv_mul) * hs;
                float a = att[t] / sum;
                for (int i = 0; i < hs; i++)
                    o[i] += a * v[i];
            }
        }
        pl_matmul(p->xb2, p->xb, p->wo + l * dd, d, d);
        for (int i = 0; i < d; i++)
            p->x[i] += p->xb2[i];
        pl_rmsnorm(p->xb, p->x, p->rms_ffn + (size_t)l * d, d);
        pl_matmul(p->hb, p->xb, p->w1 + l * hdd, d, hd);
        pl_matmul(p->hb2, p->xb, p->w3 + l * hdd, d, hd);
        for (int i = 0; i < hd; i++) {
            float v = p->hb[i];
            p->hb[i] = v * (1.0f / (1.0f + expf(-v))) * p->hb2[i];
        }
        pl_matmul(p->xb, p->hb, p->w2 + l * hdd, hd, d);
        for (int i = 0; i < d; i++)
            p->x[i] += p->xb[i];
    }
    pl_rmsnorm(p->x, p->x, p->rms_final, d);
    pl_matmul(logits, p->x, p->wcls, d, c->vocab_size);
}

/* ---- measurements --------------------------------------------------------- */

static int argmax(const float *v, int n)
{
    int a = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[a])
            a = i;
    return a;
}

typedef struct {
    int runs, slow_runs, prompt, decode;
} bench_opts;

typedef struct {
    double prefill_tps, single_tps, decode_tps, short_decode_tps, plain_tps, plain_long_tps;
    int prompt, decode;
    int agree; /* engine and plain loop chose the same greedy tokens */
} bench_result;

static int bench_model(const char *name, const char *path, const bench_opts *o, bench_result *r)
{
    kvt_model *m = NULL;
    int rc = kvt_model_load(path, &m);
    if (rc != 0) {
        fprintf(stderr, "kvtier bench engine: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
        return 1;
    }
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size;
    int prompt = o->prompt, dec = o->decode;
    if (prompt + dec > c->seq_len)
        prompt = c->seq_len - dec;
    memset(r, 0, sizeof *r);
    r->prompt = prompt;
    r->decode = dec;
    int32_t *tok = malloc(sizeof *tok * (size_t)(prompt + dec));
    float *logits = malloc(sizeof(float) * (size_t)V), *pl_logits = malloc(sizeof(float) * (size_t)V);
    kvt_cache **caches = calloc((size_t)L, sizeof *caches);
    double *t = calloc((size_t)(o->runs + o->slow_runs + 2), sizeof *t);
    uint64_t s = 42;
    for (int i = 0; i < prompt; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        tok[i] = (int32_t)((s >> 33) % (uint64_t)V);
    }
    fprintf(stderr, "%s: %d layers, dim %d, prompt %d tokens, decode %d tokens, %d runs\n", name, L, c->dim,
            prompt, dec, o->runs);
    /* batched prefill, then greedy decode on the same caches */
    double *td = calloc((size_t)o->runs, sizeof *td);
    for (int run = 0; run < o->runs && rc == 0; run++) {
        if ((rc = kvt_model_new_caches(m, 256, caches)) != 0)
            break;
        uint64_t t0 = kvt_now_ns();
        rc = kvt_model_prefill(m, caches, tok, prompt, logits);
        uint64_t t1 = kvt_now_ns();
        for (int i = 0; i < dec && rc == 0; i++) {
            tok[prompt + i] = argmax(logits, V);
            rc = kvt_model_decode(m, caches, tok[prompt + i], logits);
        }
        uint64_t t2 = kvt_now_ns();
        t[run] = prompt / ((t1 - t0) * 1e-9);
        td[run] = dec / ((t2 - t1) * 1e-9);
        kvt_caches_dispose(caches, L);
    }
    r->prefill_tps = kvt_bench_util_median(t, o->runs);
    r->decode_tps = kvt_bench_util_median(td, o->runs);
    /* the same prompt fed one token at a time through decode */
    for (int run = 0; run < o->slow_runs && rc == 0; run++) {
        if ((rc = kvt_model_new_caches(m, 256, caches)) != 0)
            break;
        uint64_t t0 = kvt_now_ns();
        for (int i = 0; i < prompt && rc == 0; i++)
            rc = kvt_model_decode(m, caches, tok[i], logits);
        t[run] = prompt / ((kvt_now_ns() - t0) * 1e-9);
        kvt_caches_dispose(caches, L);
    }
    r->single_tps = kvt_bench_util_median(t, o->slow_runs);
    /* plain llama2.c-style decode of the same tokens after a short prompt */
    int plain_ok = 1;
    for (int l = 0; l < L; l++)
        plain_ok &= c->layer_kind[l] == KVT_LAYER_ATTN;
    /* short-context decode: engine (median of runs) vs the plain loop, both
     * greedy from the same 8-token prompt, same positions */
    plain_llama pl;
    int warm = 8;
    int32_t *eng_ids = calloc((size_t)dec, sizeof *eng_ids), *pl_ids = calloc((size_t)dec, sizeof *pl_ids);
    for (int run = 0; run < o->runs && rc == 0; run++) {
        if ((rc = kvt_model_new_caches(m, 256, caches)) != 0)
            break;
        rc = kvt_model_prefill(m, caches, tok, warm, logits);
        uint64_t t0 = kvt_now_ns();
        for (int i = 0; i < dec && rc == 0; i++) {
            eng_ids[i] = argmax(logits, V);
            rc = kvt_model_decode(m, caches, eng_ids[i], logits);
        }
        td[run] = dec / ((kvt_now_ns() - t0) * 1e-9);
        kvt_caches_dispose(caches, L);
    }
    r->short_decode_tps = kvt_bench_util_median(td, o->runs);
    if (rc == 0 && plain_ok && pl_open(&pl, path, c) == 0) {
        for (int i = 0; i < warm; i++)
            pl_forward(&pl, tok[i], i, pl_logits);
        uint64_t t0 = kvt_now_ns();
        for (int i = 0; i < dec; i++) {
            pl_ids[i] = argmax(pl_logits, V);
            pl_forward(&pl, pl_ids[i], warm + i, pl_logits);
        }
        r->plain_tps = dec / ((kvt_now_ns() - t0) * 1e-9);
        r->agree = !memcmp(eng_ids, pl_ids, sizeof *pl_ids * (size_t)dec);
        /* the same after the whole prompt, when the plain loop can feed it in
         * under ~20 s (not the default model: it would take minutes) */
        if ((prompt + dec) / r->plain_tps < 20.0) {
            for (int i = 0; i < prompt; i++)
                pl_forward(&pl, tok[i], i, pl_logits);
            t0 = kvt_now_ns();
            for (int i = 0; i < dec; i++) {
                pl_ids[i] = argmax(pl_logits, V);
                pl_forward(&pl, pl_ids[i], prompt + i, pl_logits);
            }
            r->plain_long_tps = dec / ((kvt_now_ns() - t0) * 1e-9);
            r->agree &= !memcmp(tok + prompt, pl_ids, sizeof *pl_ids * (size_t)dec);
        }
        pl_close(&pl);
    }
    free(eng_ids);
    free(pl_ids);
    if (rc != 0)
        fprintf(stderr, "kvtier bench engine: %s: %s (%s)\n", name, kvt_last_error(), kvt_strerror(rc));
    free(td);
    free(t);
    free(caches);
    free(tok);
    free(logits);
    free(pl_logits);
    kvt_model_free(m);
    return rc ? 1 : 0;
}

static void print_row(const char *name, const bench_result *r)
{
    char pl_long[32] = "-", ratio_long[32] = "-", same[8] = "-";
    if (r->plain_long_tps > 0) {
        snprintf(pl_long, sizeof pl_long, "%.1f", r->plain_long_tps);
        snprintf(ratio_long, sizeof ratio_long, "%.2fx", r->decode_tps / r->plain_long_tps);
    }
    if (r->plain_tps > 0)
        snprintf(same, sizeof same, "%s", r->agree ? "yes" : "NO");
    printf("%-12s %6d %10.1f %10.1f %7.1fx %9.1f %9s %7s %9.1f %9.1f %7.2fx %s\n", name, r->prompt, r->prefill_tps,
           r->single_tps, r->prefill_tps / r->single_tps, r->decode_tps, pl_long, ratio_long, r->short_decode_tps,
           r->plain_tps, r->plain_tps > 0 ? r->short_decode_tps / r->plain_tps : 0.0, same);
}

int kvt_bench_engine(int argc, char **argv)
{
    bench_opts o = {5, 3, 1024, 64};
    const char *model = NULL;
    int skip_default = 0, default_slow_runs = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--model") && v)
            model = v, i++;
        else if (!strcmp(a, "--runs") && v)
            o.runs = atoi(v), i++;
        else if (!strcmp(a, "--prompt") && v)
            o.prompt = atoi(v), i++;
        else if (!strcmp(a, "--decode") && v)
            o.decode = atoi(v), i++;
        else if (!strcmp(a, "--slow-runs") && v)
            default_slow_runs = atoi(v), i++;
        else if (!strcmp(a, "--no-default"))
            skip_default = 1;
        else {
            fprintf(a && !strcmp(a, "--help") ? stdout : stderr,
                    "usage: kvtier bench engine [--model stories260K.bin] [--runs N (5)] [--prompt TOKENS (1024)]\n"
                    "       [--decode TOKENS (64)] [--slow-runs N (1, one-at-a-time prefill runs on the default "
                    "model)] [--no-default]\n");
            return strcmp(a, "--help") ? 2 : 0;
        }
    }
    if (o.runs < 1 || o.prompt < 1 || o.decode < 1 || default_slow_runs < 1) {
        fprintf(stderr, "kvtier bench engine: --runs, --prompt, --decode, --slow-runs must be >= 1\n");
        return 2;
    }
    char stories[4096];
    if (!model) {
        const char *shared = getenv("KVT_SHARED_DIR");
        snprintf(stories, sizeof stories, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
        model = stories;
    }
    bench_result rs[2];
    const char *names[2] = {"stories260K", "default"};
    int have[2] = {0, 0}, status = 0;
    if (access(model, R_OK) == 0) {
        status |= bench_model(names[0], model, &o, &rs[0]);
        have[0] = !status;
    } else {
        fprintf(stderr, "kvtier bench engine: %s not found; skipping it (pass --model)\n", model);
    }
    if (!skip_default) {
        char mp[4096], tp[4096];
        int rc = kvt_default_model(mp, sizeof mp, tp, sizeof tp);
        if (rc != 0) {
            fprintf(stderr, "kvtier bench engine: default model: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
            return 1;
        }
        bench_opts od = o;
        od.slow_runs = default_slow_runs;
        int st = bench_model(names[1], mp, &od, &rs[1]);
        status |= st;
        have[1] = !st;
    }
    printf("%-12s %6s %10s %10s %8s %9s %9s %7s %9s %9s %8s %s\n", "model", "prompt", "prefill", "1-by-1",
           "batched", "dec@P", "plain@P", "ratio", "dec@8", "plain@8", "ratio", "same ids");
    for (int i = 0; i < 2; i++)
        if (have[i])
            print_row(names[i], &rs[i]);
    printf("all figures tokens/s. prefill: median of runs, one batched prefill of P = `prompt` tokens; 1-by-1:\n"
           "the same tokens fed through decode one at a time (batched = the ratio). dec@P: greedy decode right after\n"
           "the prompt; dec@8: after an 8-token prompt. plain@P / plain@8: a naive single-threaded llama2.c-style\n"
           "loop (contiguous KV, scalar matvec) run here at the same positions (plain@P skipped when feeding it the\n"
           "prompt would take minutes); same ids: engine and plain loop chose the same greedy tokens.\n");
    return status;
}
