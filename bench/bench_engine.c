/*
 * bench_engine.c: `kvtier bench engine`: the reference engine on stories260K
 * and on the built-in default model, each figure next to a baseline measured
 * in the same run:
 *   prefill    one batched prefill of P tokens vs the same tokens fed one at
 *              a time through decode (what batching buys);
 *   decode     greedy decode from BOS vs a copy of llama2.c run.c's loop built
 *              as run.c is built (-Ofast -march=native, bench_llama2c.h), on
 *              one thread and with OpenMP on the engine's thread count;
 *   batched    aggregate tokens/s of kvt_model_decode_batch over 1, 2, 4, 8
 *              sequences at mixed positions vs one sequence;
 *   context    decode tokens/s at 1k, 2k and 4k tokens of context (default
 *              model), for each KV storage scheme (f32 the baseline; the
 *              schemes take turns within each run), next to llama.cpp on
 *              the same weights (bench_llamacpp.h; its runs alternate with
 *              the engine's) when `make bench-deps` installed it.
 * Reports medians of runs. Owns nothing beyond the run; never writes files
 * except the default model on first use (kvt_default_model).
 */
#include "bench_llama2c.h"
#include "bench_llamacpp.h"
#include "bench_util.h"
#include "cli.h"
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N_BATCH 4
static const int k_batch_n[N_BATCH] = {1, 2, 4, 8};
#define N_CTX 3

typedef struct {
    int runs, slow_runs, prompt, decode, batch_steps, ctx_runs, threads;
    int context_only; /* --context-only: the decode at context (default model) alone */
    int decode_only;  /* --decode-only: greedy decode vs run.c and batched decode alone */
    int llamacpp;     /* 1: llama.cpp's decode at context beside the engine's (--no-llamacpp: 0) */
    const char *tok_path; /* the default model's tokenizer (for the GGUF export) */
} bench_opts;

typedef struct {
    int prompt;
    double prefill_tps, single_tps;
    int dec_steps;                  /* greedy steps from BOS */
    double dec_tps, l2c_tps, omp_tps;
    int l2c_same, omp_same;         /* -1: not run; 1: the same greedy ids as the engine */
    double batch_tps[N_BATCH];
    int batch_same;                 /* sequence 0 chose the same ids whatever n */
    int ctx[N_CTX];
    double ctx_tps[KVT_KV_SCHEME_COUNT][N_CTX]; /* per scheme; 0: not run */
    double llama_tps[2][KVT_LLAMACPP_CONFIGS][N_CTX]; /* llama.cpp [clock, own counters] per configuration */
    char llama_info[1024];                         /* "" when llama.cpp did not run */
} bench_result;

static int argmax(const float *v, int n)
{
    int a = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[a])
            a = i;
    return a;
}

static double tps(long tokens, uint64_t t0, uint64_t t1) { return tokens / ((double)(t1 - t0) * 1e-9); }

/* Batched prefill of P tokens vs the same tokens one at a time. */
static int bench_prefill(kvt_model *m, const int32_t *tok, int prompt, const bench_opts *o, int slow_runs,
                         bench_result *r)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, rc = 0;
    kvt_cache **caches = calloc((size_t)L, sizeof *caches);
    float *logits = malloc(sizeof(float) * (size_t)c->vocab_size);
    double t[64];
    int runs = (o->runs);
    for (int run = 0; run < runs && rc == 0; run++) {
        if ((rc = kvt_model_new_caches(m, 256, caches)) != 0)
            break;
        uint64_t t0 = kvt_now_ns();
        rc = kvt_model_prefill(m, caches, tok, prompt, logits);
        t[run] = tps(prompt, t0, kvt_now_ns());
        kvt_caches_destroy(caches, L);
    }
    if (rc == 0)
        r->prefill_tps = kvt_bench_util_median(t, runs);
    runs = (slow_runs);
    for (int run = 0; run < runs && rc == 0; run++) {
        if ((rc = kvt_model_new_caches(m, 256, caches)) != 0)
            break;
        uint64_t t0 = kvt_now_ns();
        for (int i = 0; i < prompt && rc == 0; i++)
            rc = kvt_model_decode(m, caches, tok[i], logits);
        t[run] = tps(prompt, t0, kvt_now_ns());
        kvt_caches_destroy(caches, L);
    }
    if (rc == 0)
        r->single_tps = kvt_bench_util_median(t, runs);
    r->prompt = prompt;
    free(caches);
    free(logits);
    return rc;
}

/* Greedy decode of `steps` tokens from BOS: the engine, then the llama2.c
 * loop on one thread and with OpenMP (plain attention models only). */
static int bench_decode(kvt_model *m, const char *path, int steps, const bench_opts *o, int base_runs,
                        bench_result *r)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size, rc = 0;
    kvt_cache **caches = calloc((size_t)L, sizeof *caches);
    float *logits = malloc(sizeof(float) * (size_t)V);
    int32_t *eng = malloc(sizeof *eng * (size_t)steps), *base = malloc(sizeof *base * (size_t)steps);
    double t[64];
    int runs = (o->runs);
    r->dec_steps = steps;
    for (int run = 0; run < runs && rc == 0; run++) {
        if ((rc = kvt_model_new_caches(m, 256, caches)) != 0)
            break;
        int32_t tok = 1; /* BOS */
        uint64_t t0 = kvt_now_ns();
        for (int i = 0; i < steps && rc == 0; i++) {
            rc = kvt_model_decode(m, caches, tok, logits);
            eng[i] = tok = argmax(logits, V);
        }
        t[run] = tps(steps, t0, kvt_now_ns());
        kvt_caches_destroy(caches, L);
    }
    if (rc == 0)
        r->dec_tps = kvt_bench_util_median(t, runs);
    r->l2c_same = r->omp_same = -1;
    int plain = 1;
    for (int l = 0; l < L; l++)
        plain &= c->layer_kind[l] == KVT_LAYER_ATTN;
    kvt_llama2c *p = NULL;
    if (rc != 0 || !plain || kvt_llama2c_open(path, c, &p) != 0)
        goto done;
    for (int variant = 0; variant < 2; variant++) {
        if (variant == 1 && !kvt_llama2c_omp_available())
            break;
        int same = 1;
        runs = (base_runs);
        for (int run = 0; run < runs; run++) {
            int32_t tok = 1;
            uint64_t t0 = kvt_now_ns();
            for (int i = 0; i < steps; i++) {
                if (variant == 0)
                    kvt_llama2c_forward(p, tok, i, logits);
                else
                    kvt_llama2c_forward_omp(p, tok, i, logits, o->threads);
                base[i] = tok = argmax(logits, V);
            }
            t[run] = tps(steps, t0, kvt_now_ns());
            same &= !memcmp(base, eng, sizeof *eng * (size_t)steps);
        }
        if (variant == 0)
            r->l2c_tps = kvt_bench_util_median(t, runs), r->l2c_same = same;
        else
            r->omp_tps = kvt_bench_util_median(t, runs), r->omp_same = same;
    }
    kvt_llama2c_close(p);
done:
    free(caches);
    free(logits);
    free(eng);
    free(base);
    return rc;
}

/* Aggregate tokens/s of batched decode over n = 1, 2, 4, 8 sequences, each
 * after a prompt of its own length (8 + 24 i tokens: mixed positions). */
static int bench_batch(kvt_model *m, const int32_t *tok, const bench_opts *o, int runs, bench_result *r)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size, S = o->batch_steps, nmax = k_batch_n[N_BATCH - 1], rc = 0;
    kvt_cache **store = calloc((size_t)nmax * L, sizeof *store), **seq[8];
    float *logits = malloc(sizeof(float) * (size_t)V * nmax);
    int32_t next[8], *first = malloc(sizeof *first * (size_t)S), *ids = malloc(sizeof *ids * (size_t)S);
    double t[64];
    runs = (runs);
    r->batch_same = 1;
    for (int i = 0; i < nmax; i++)
        seq[i] = store + (size_t)i * L;
    for (int b = 0; b < N_BATCH && rc == 0; b++) {
        int n = k_batch_n[b];
        for (int run = 0; run < runs && rc == 0; run++) {
            for (int i = 0; i < n && rc == 0; i++) {
                if ((rc = kvt_model_new_caches(m, 256, seq[i])) != 0)
                    break;
                int len = 8 + 24 * i;
                rc = kvt_model_prefill(m, seq[i], tok, len, logits);
                next[i] = argmax(logits, V);
            }
            uint64_t t0 = kvt_now_ns();
            for (int s = 0; s < S && rc == 0; s++) {
                ids[s] = next[0];
                rc = kvt_model_decode_batch(m, n, seq, next, logits);
                for (int i = 0; i < n; i++)
                    next[i] = argmax(logits + (size_t)i * V, V);
            }
            t[run] = tps((long)n * S, t0, kvt_now_ns());
            for (int i = 0; i < n; i++)
                kvt_caches_destroy(seq[i], L);
            if (b == 0 && run == 0)
                memcpy(first, ids, sizeof *ids * (size_t)S);
            else
                r->batch_same &= !memcmp(first, ids, sizeof *ids * (size_t)S);
        }
        if (rc == 0)
            r->batch_tps[b] = kvt_bench_util_median(t, runs);
    }
    free(store);
    free(logits);
    free(first);
    free(ids);
    return rc;
}

/* Decode tokens/s at 1k, 2k and seq_len - steps tokens of context, per KV
 * storage scheme: one sequence per scheme prefilled up to each length in
 * turn, then `steps` greedy tokens for each, the schemes taking turns token
 * by token (each token timed alone), so every scheme sees the same load. */
static int bench_context(kvt_model *m, const int32_t *tok, int n_tok, const bench_opts *o, bench_result *r)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size, S = o->batch_steps, rc = 0;
    int want[N_CTX] = {1024, 2048, c->seq_len - S};
    kvt_cache **caches = calloc((size_t)L * KVT_KV_SCHEME_COUNT, sizeof *caches);
    float *logits = malloc(sizeof(float) * (size_t)V * KVT_KV_SCHEME_COUNT);
    double t[KVT_KV_SCHEME_COUNT][N_CTX][64] = {{{0}}};
    int runs = o->ctx_runs;
    if (!caches || !logits)
        rc = KVT_ENOMEM;
    for (int k = 0; k < N_CTX; k++)
        r->ctx[k] = want[k] <= c->seq_len - S && want[k] <= n_tok ? want[k] : 0;
    for (int run = 0; run < runs && rc == 0; run++) {
        for (int sc = 0; sc < KVT_KV_SCHEME_COUNT && rc == 0; sc++) {
            kvt_model_set_kv_scheme(m, (kvt_kv_scheme)sc);
            rc = kvt_model_new_caches(m, 256, caches + (size_t)sc * L);
        }
        int at = 0;
        for (int k = 0; k < N_CTX && rc == 0; k++) {
            if (!r->ctx[k] || r->ctx[k] < at)
                continue;
            for (int sc = 0; sc < KVT_KV_SCHEME_COUNT && rc == 0 && r->ctx[k] > at; sc++)
                rc = kvt_model_prefill(m, caches + (size_t)sc * L, tok + at, r->ctx[k] - at, logits + (size_t)sc * V);
            at = r->ctx[k];
            for (int s = 0; s < S && rc == 0; s++)
                for (int sc = 0; sc < KVT_KV_SCHEME_COUNT && rc == 0; sc++) {
                    float *lg = logits + (size_t)sc * V;
                    uint64_t t0 = kvt_now_ns();
                    rc = kvt_model_decode(m, caches + (size_t)sc * L, argmax(lg, V), lg);
                    t[sc][k][run] += (double)(kvt_now_ns() - t0) * 1e-9;
                }
            at += S; /* every scheme's sequence is S tokens further on */
        }
        for (int sc = 0; sc < KVT_KV_SCHEME_COUNT; sc++)
            kvt_caches_destroy(caches + (size_t)sc * L, L);
    }
    kvt_model_set_kv_scheme(m, KVT_KV_F32);
    for (int sc = 0; sc < KVT_KV_SCHEME_COUNT && rc == 0; sc++)
        for (int k = 0; k < N_CTX; k++)
            if (r->ctx[k]) {
                for (int run = 0; run < runs; run++)
                    t[sc][k][run] = S / t[sc][k][run];
                r->ctx_tps[sc][k] = kvt_bench_util_median(t[sc][k], runs);
            }
    free(caches);
    free(logits);
    return rc;
}

/* The decode at context with llama.cpp beside it: run i of the engine
 * (bench_context, one run) then run i of llama.cpp on a GGUF export of the
 * same model, so both see the same stretch of load; medians of the runs.
 * Without the baseline (not installed, --no-llamacpp) bench_context alone. */
static int bench_context_vs_llamacpp(kvt_model *m, const int32_t *tok, int n_tok, const bench_opts *o, bench_result *r)
{
    kvt_llamacpp *lc = NULL;
    int rc = o->llamacpp && o->tok_path ? kvt_llamacpp_open(m, o->tok_path, tok, n_tok, o->threads, &lc) : 0;
    if (rc != 0 || !lc)
        return rc != 0 ? rc : bench_context(m, tok, n_tok, o, r);
    bench_opts one = *o;
    one.ctx_runs = 1;
    double t[KVT_KV_SCHEME_COUNT][N_CTX][64];
    int ctx[N_CTX], nk = 0, done = 0, llama_ok = 1;
    for (int run = 0; run < o->ctx_runs && rc == 0 && llama_ok; run++) {
        uint64_t t0 = kvt_now_ns();
        if ((rc = bench_context(m, tok, n_tok, &one, r)) != 0)
            break;
        uint64_t t1 = kvt_now_ns();
        for (int sc = 0; sc < KVT_KV_SCHEME_COUNT; sc++)
            for (int k = 0; k < N_CTX; k++)
                t[sc][k][run] = r->ctx_tps[sc][k];
        done++;
        nk = 0;
        for (int k = 0; k < N_CTX; k++)
            if (r->ctx[k])
                ctx[nk++] = r->ctx[k];
        fprintf(stderr, "kvtier bench engine: llama.cpp decode at context, run %d of %d\n", run + 1, o->ctx_runs);
        if (kvt_llamacpp_run(lc, ctx, nk, o->batch_steps) != 0) {
            /* the engine's figures stand without the baseline */
            fprintf(stderr, "kvtier bench engine: %s; the engine's figures of %d run(s) follow without llama.cpp\n",
                    kvt_last_error(), done);
            llama_ok = 0;
        }
        fprintf(stderr, "kvtier bench engine: run %d took %.0f s (engine) + %.0f s (llama.cpp)\n", run + 1,
                (double)(t1 - t0) * 1e-9, (double)(kvt_now_ns() - t1) * 1e-9);
    }
    for (int sc = 0; sc < KVT_KV_SCHEME_COUNT && rc == 0; sc++)
        for (int k = 0; k < N_CTX; k++)
            r->ctx_tps[sc][k] = kvt_bench_util_median(t[sc][k], done);
    for (int i = 0; i < KVT_LLAMACPP_CONFIGS && rc == 0 && llama_ok; i++)
        for (int k = 0, j = 0; k < N_CTX; k++)
            if (r->ctx[k])
                r->llama_tps[0][i][k] = kvt_llamacpp_tps(lc, i, j, 0), r->llama_tps[1][i][k] = kvt_llamacpp_tps(lc, i, j++, 1);
    if (rc == 0 && llama_ok)
        snprintf(r->llama_info, sizeof r->llama_info, "%s", kvt_llamacpp_info(lc));
    kvt_llamacpp_close(lc);
    return rc;
}

static int bench_model(const char *name, const char *path, int is_default, const bench_opts *o, bench_result *r)
{
    kvt_model *m = NULL;
    int rc = kvt_model_load(path, &m);
    if (rc != 0) {
        fprintf(stderr, "kvtier bench engine: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
        return 1;
    }
    const kvt_model_config *c = kvt_model_get_config(m);
    memset(r, 0, sizeof *r);
    int n_tok = c->seq_len;
    int32_t *tok = malloc(sizeof *tok * (size_t)n_tok);
    uint64_t s = 42;
    for (int i = 0; i < n_tok; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        tok[i] = (int32_t)((s >> 33) % (uint64_t)c->vocab_size);
    }
    int prompt = o->prompt > c->seq_len ? c->seq_len : o->prompt;
    int steps = is_default ? (o->decode < c->seq_len ? o->decode : c->seq_len) : c->seq_len;
    int slow_runs = is_default ? o->slow_runs : 3, base_runs = is_default ? (o->runs < 3 ? o->runs : 3) : o->runs;
    fprintf(stderr, "%s: %d layers, dim %d, seq_len %d, %d threads; prefill %d tokens, decode %d tokens from BOS, "
            "%d runs\n", name, c->n_layers, c->dim, c->seq_len, o->threads, prompt, steps, o->runs);
    rc = o->context_only || o->decode_only ? 0 : bench_prefill(m, tok, prompt, o, slow_runs, r);
    if (rc == 0 && !o->context_only)
        rc = bench_decode(m, path, steps, o, base_runs, r);
    if (rc == 0 && !o->context_only)
        rc = bench_batch(m, tok, o, base_runs, r);
    if (rc == 0 && is_default && !o->decode_only)
        rc = bench_context_vs_llamacpp(m, tok, n_tok, o, r);
    if (rc != 0)
        fprintf(stderr, "kvtier bench engine: %s: %s (%s)\n", name, kvt_last_error(), kvt_strerror(rc));
    free(tok);
    kvt_model_free(m);
    return rc ? 1 : 0;
}

static const char *yes_no(int v) { return v < 0 ? "-" : v ? "yes" : "NO"; }

/* llama.cpp's figures per configuration, then kvtier against llama.cpp's
 * faster flash setting for each scheme, with a verdict line. */
static void print_llamacpp(const bench_result *r, const bench_opts *o)
{
    int last = 0;
    for (int k = 0; k < N_CTX; k++)
        last = r->ctx[k] ? r->ctx[k] : last;
    printf("\nllama.cpp decode at context (the same weights as GGUF f32, %d threads, the same tokens and steps, a\n"
           "%d-token context so it never shifts it; its runs alternate with the engine's), tokens/s by llama.cpp's\n"
           "own decode counters [by the clock around each call from JavaScript, sampling included]\n"
           "  %s\n  %-6s %-5s",
           o->threads, last + o->batch_steps + 1, r->llama_info, "KV", "flash");
    for (int k = 0; k < N_CTX; k++)
        if (r->ctx[k])
            printf("  C = %5d       ", r->ctx[k]);
    printf("\n");
    for (int i = 0; i < KVT_LLAMACPP_CONFIGS; i++) {
        printf("  %-6s %-5s", kvt_llamacpp_kv_name(i), kvt_llamacpp_flash(i) ? "on" : "off");
        for (int k = 0; k < N_CTX; k++)
            if (r->ctx[k])
                printf("  %6.1f [%6.1f]  ", r->llama_tps[1][i][k], r->llama_tps[0][i][k]);
        printf("\n");
    }
    printf("\nkvtier vs llama.cpp per KV scheme (tokens/s: kvtier / llama.cpp's faster flash setting for the same\n"
           "KV type by its own counters = ratio; q8 is kvtier's int8 KV, q8_0 llama.cpp's)\n  %-6s", "scheme");
    for (int k = 0; k < N_CTX; k++)
        if (r->ctx[k])
            printf("  C = %5d                ", r->ctx[k]);
    printf("\n");
    int behind = 0;
    for (int sc = 0; sc < KVT_KV_SCHEME_COUNT; sc++) {
        int have_cfg = 0;
        for (int i = 0; i < KVT_LLAMACPP_CONFIGS; i++)
            have_cfg |= kvt_llamacpp_scheme(i) == (kvt_kv_scheme)sc;
        if (!have_cfg)
            continue;
        printf("  %-6s", kvt_kv_scheme_name((kvt_kv_scheme)sc));
        for (int k = 0; k < N_CTX; k++) {
            if (!r->ctx[k])
                continue;
            int best = -1;
            for (int i = 0; i < KVT_LLAMACPP_CONFIGS; i++)
                if (kvt_llamacpp_scheme(i) == (kvt_kv_scheme)sc &&
                    (best < 0 || r->llama_tps[1][i][k] > r->llama_tps[1][best][k]))
                    best = i;
            double ratio = r->ctx_tps[sc][k] / r->llama_tps[1][best][k];
            behind += ratio < 1;
            printf("  %5.1f / %5.1f %-3s= %4.2fx", r->ctx_tps[sc][k], r->llama_tps[1][best][k],
                   kvt_llamacpp_flash(best) ? "on" : "off", ratio);
        }
        printf("\n");
    }
    printf("  kvtier at least llama.cpp at every context and scheme: %s\n", behind ? "NO" : "yes");
    printf("  (with flash attention on, llama.cpp converts an f32 KV cache to f16 at every step, so f32 runs with it\n"
           "  off; q8_0 needs it on. Figures from a loaded machine are noise: llama.cpp's threads wait for each\n"
           "  other by spinning, which costs it far more than kvtier when the cores are shared)\n");
}

static void print_tables(const char *const *names, const bench_result *rs, const int *have, const bench_opts *o)
{
    if (o->context_only)
        goto context;
    if (!o->decode_only) {
        printf("prefill (tokens/s)\n%-12s %6s %10s %10s %8s\n", "model", "prompt", "prefill", "1-by-1", "batched");
        for (int i = 0; i < 2; i++)
            if (have[i])
                printf("%-12s %6d %10.1f %10.1f %7.1fx\n", names[i], rs[i].prompt, rs[i].prefill_tps,
                       rs[i].single_tps, rs[i].prefill_tps / rs[i].single_tps);
        printf("\n");
    }
    printf("greedy decode from BOS (tokens/s) vs llama2.c run.c's loop (-Ofast -march=native)\n"
           "%-12s %6s %9s %9s %7s %10s %7s %s\n", "model", "steps", "kvtier", "run.c", "ratio", "run.c-omp", "ratio",
           "same ids");
    for (int i = 0; i < 2; i++) {
        if (!have[i])
            continue;
        const bench_result *r = &rs[i];
        char a[16] = "-", b[16] = "-", cc[16] = "-", d[16] = "-";
        if (r->l2c_tps > 0)
            snprintf(a, sizeof a, "%.1f", r->l2c_tps), snprintf(b, sizeof b, "%.2fx", r->dec_tps / r->l2c_tps);
        if (r->omp_tps > 0)
            snprintf(cc, sizeof cc, "%.1f", r->omp_tps), snprintf(d, sizeof d, "%.2fx", r->dec_tps / r->omp_tps);
        printf("%-12s %6d %9.1f %9s %7s %10s %7s %s/%s\n", names[i], r->dec_steps, r->dec_tps, a, b, cc, d,
               yes_no(r->l2c_same), yes_no(r->omp_same));
    }
    printf("\nbatched decode (kvt_model_decode_batch, aggregate tokens/s, %d steps; sequence i after 8 + 24 i "
           "tokens)\n%-12s", o->batch_steps, "model");
    for (int b = 0; b < N_BATCH; b++)
        printf(" %8s%d", "n=", k_batch_n[b]);
    printf(" %9s %s\n", "8 vs 1", "same ids");
    for (int i = 0; i < 2; i++) {
        if (!have[i])
            continue;
        printf("%-12s", names[i]);
        for (int b = 0; b < N_BATCH; b++)
            printf(" %9.1f", rs[i].batch_tps[b]);
        printf(" %8.2fx %s\n", rs[i].batch_tps[N_BATCH - 1] / rs[i].batch_tps[0], yes_no(rs[i].batch_same));
    }
context:
    if (have[1] && !o->decode_only) {
        const bench_result *r = &rs[1];
        printf("\ndecode at context (default model, tokens/s, %d steps after a prefill to C tokens; K/V stored\n"
               "in each scheme, the schemes taking turns token by token; ratio to f32 in brackets)\n  %-6s", o->batch_steps, "scheme");
        for (int k = 0; k < N_CTX; k++)
            if (r->ctx[k])
                printf("  C = %5d     ", r->ctx[k]);
        printf("\n");
        for (int sc = 0; sc < KVT_KV_SCHEME_COUNT; sc++) {
            printf("  %-6s", kvt_kv_scheme_name((kvt_kv_scheme)sc));
            for (int k = 0; k < N_CTX; k++)
                if (r->ctx[k])
                    printf("  %7.1f (%.2fx)", r->ctx_tps[sc][k], r->ctx_tps[sc][k] / r->ctx_tps[0][k]);
            printf("\n");
        }
    }
    if (have[1] && rs[1].llama_info[0])
        print_llamacpp(&rs[1], o);
    printf("\nAll figures medians of runs. prefill: one batched prefill of `prompt` tokens vs the same tokens fed\n"
           "through decode one at a time. decode: greedy from BOS, the engine vs a copy of llama2.c run.c's forward\n"
           "loop built as `make runfast` builds it (run.c) and as `make runomp` does on %d threads (run.c-omp);\n"
           "same ids: both chose the engine's greedy tokens. batched: n sequences at mixed positions decoded\n"
           "together, one pass over the weights per step; same ids: sequence 0 chose the same tokens for every n\n"
           "(batch invariance).\n",
           o->threads);
}

int kvt_bench_engine(int argc, char **argv)
{
    bench_opts o = {5, 1, 1024, 64, 32, 1, 0, 0, 0, 1, NULL};
    const char *model = NULL;
    int skip_default = 0;
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
            o.slow_runs = atoi(v), i++;
        else if (!strcmp(a, "--batch-steps") && v)
            o.batch_steps = atoi(v), i++;
        else if (!strcmp(a, "--context-runs") && v)
            o.ctx_runs = atoi(v), i++;
        else if (!strcmp(a, "--no-default"))
            skip_default = 1;
        else if (!strcmp(a, "--context-only"))
            o.context_only = 1;
        else if (!strcmp(a, "--decode-only"))
            o.decode_only = 1;
        else if (!strcmp(a, "--no-llamacpp"))
            o.llamacpp = 0;
        else {
            fprintf(a && !strcmp(a, "--help") ? stdout : stderr,
                    "usage: kvtier bench engine [--model stories260K.bin] [--runs N (5)] [--prompt TOKENS (1024)]\n"
                    "       [--decode TOKENS (64, default model; stories260K decodes its whole seq_len)]\n"
                    "       [--slow-runs N (1, one-at-a-time prefill runs on the default model)]\n"
                    "       [--batch-steps N (32, steps of the batched and at-context decode)]\n"
                    "       [--context-runs N (1, runs of the decode at 1k/2k/4k context)] [--no-default]\n"
                    "       [--context-only (only the decode at 1k/2k/4k context per KV scheme, default model)]\n"
                    "       [--decode-only (only greedy decode vs run.c and batched decode)]\n"
                    "       [--no-llamacpp (no llama.cpp beside the decode at context; it runs when `make\n"
                    "       bench-deps` installed it: the default model exported as GGUF to a temporary directory)]\n");
            return strcmp(a, "--help") ? 2 : 0;
        }
    }
    if (o.runs < 1 || o.runs > 64 || o.prompt < 1 || o.decode < 1 || o.slow_runs < 1 || o.slow_runs > 64 ||
        o.batch_steps < 1 || o.ctx_runs < 1 || o.ctx_runs > 64) {
        fprintf(stderr, "kvtier bench engine: --runs, --slow-runs, --context-runs must be in [1, 64]; --prompt, "
                "--decode, --batch-steps >= 1\n");
        return 2;
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    o.threads = ncpu < 1 ? 1 : ncpu > 8 ? 8 : (int)ncpu; /* what the engine's pool uses */
    char stories[4096];
    if (!model) {
        const char *shared = getenv("KVT_SHARED_DIR");
        snprintf(stories, sizeof stories, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
        model = stories;
    }
    bench_result rs[2];
    const char *names[2] = {"stories260K", "default"};
    int have[2] = {0, 0}, status = 0;
    if (o.context_only) {
        /* the default model alone */
    } else if (access(model, R_OK) == 0) {
        status |= bench_model(names[0], model, 0, &o, &rs[0]);
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
        o.tok_path = tp;
        int st = bench_model(names[1], mp, 1, &o, &rs[1]);
        status |= st;
        have[1] = !st;
    }
    print_tables(names, rs, have, &o);
    return status;
}
