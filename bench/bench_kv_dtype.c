/*
 * bench_kv_dtype.c: `kvtier bench kv-dtype`: what each KV storage scheme
 * (f16, bf16, q8) costs in quality against f32, measured in the same run, on
 * stories260K and on the built-in default model:
 *   - prompts: P prompts of T tokens (default 64 of 256), BOS then tokens
 *     sampled (temperature 1) from the model itself in f32, one seed each;
 *   - logits: max and mean |logit - f32 logit| over the prompt's last
 *     position and every greedy step whose context still equals f32's;
 *   - greedy agreement: the share of prompts whose N greedy tokens (default
 *     128) equal f32's, token for token;
 *   - perplexity of stories260K on a held text (a few short stories written
 *     for this benchmark, embedded below; never used to make the model);
 *   - KV bytes per token (every attention layer's K and V);
 *   - near-ties: for each prompt that disagrees, f32's top-2 logit gap at
 *     the first step whose greedy token differs (the context still equal):
 *     how many are under 1e-2, and their median; and how often f32's greedy
 *     steps have a gap under 1e-2 at all (the density of near-ties); and the
 *     greedy agreement counted over only the prompts whose f32 continuation
 *     never passes such a gap;
 *   - caches in blocks of --block-tokens (default 256; q8 keeps a sequence's
 *     open block in f32, so smaller blocks quantize more of the context);
 *   - the noise floor the schemes are read against: f32 again with only the
 *     order of its arithmetic changed (each prompt prefilled as T - 1 tokens,
 *     then its last one through decode), row "f32*".
 * Prompts run batched (kvt_model_decode_batch, bit-identical to one at a
 * time) in groups, so the default model's caches stay a few hundred MB.
 * Owns nothing beyond the run; writes no file but the default model on first
 * use.
 */
#include "cli.h"
#include "model.h"
#include "sampler.h"
#include "tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N_SCHEMES KVT_KV_SCHEME_COUNT
#define N_ROWS (N_SCHEMES + 1) /* the schemes, then f32* (f32, prompt prefilled in two pieces) */
#define NEAR_TIE 1e-2          /* a top-2 logit gap under this is a near-tie */

/* Held text for the perplexity (written for this benchmark). */
static const char k_held_text[] =
    "Once upon a time, there was a small dog named Max. Max liked to run in the green grass behind the house. "
    "One day, Max saw a red ball under a big tree. He ran to the ball and picked it up with his mouth. A little "
    "girl named Sue came out of the house. \"Max, do you want to play?\" she asked. Max wagged his tail. Sue threw "
    "the ball far away and Max ran after it. They played all afternoon until the sun went down. Then they went "
    "inside and ate dinner. Max was tired and happy. He slept next to Sue's bed and dreamed of the red ball.\n"
    "Tom had a new toy car. It was blue and shiny. He wanted to show it to his friend Ben. Tom went to Ben's "
    "house and knocked on the door. Ben opened the door and smiled. \"Look at my car!\" Tom said. Ben looked at "
    "the car and said, \"It is very nice. Can I try it?\" Tom was not sure. He liked his car very much. But then "
    "he thought about how Ben always shared his toys. So Tom gave the car to Ben. Ben pushed the car on the "
    "floor and it went very fast. Both boys laughed. Tom learned that sharing makes playing more fun.\n"
    "Lily and her mom went to the park. The sky was bright and the birds were singing. Lily saw a big slide and "
    "wanted to go down it. She climbed up the steps, one by one. At the top she felt a little scared. Her mom "
    "said, \"You can do it, Lily!\" Lily took a deep breath and slid down. It was so much fun that she did it "
    "again and again.\n";

typedef struct {
    int prompts, prompt_tokens, gen_tokens, group, block_tokens;
} kvd_opts;

typedef struct {
    size_t kv_bytes[N_ROWS];
    double max_diff[N_ROWS], sum_diff[N_ROWS];
    long n_diff[N_ROWS];      /* logits compared */
    int agree[N_ROWS];        /* prompts whose greedy continuation equals f32's */
    double ppl[N_ROWS];       /* 0: not measured */
    double *gap[N_ROWS];      /* (prompts) f32's top-2 gap at each disagreeing prompt's first divergence */
    int n_gap[N_ROWS];
    long ref_steps, ref_near; /* f32's greedy steps, and those whose top-2 gap is under NEAR_TIE */
    unsigned char *tied;      /* (prompts) 1 when f32's continuation passes a gap under NEAR_TIE */
    int clean;                /* prompts whose f32 continuation never does */
    int agree_clean[N_ROWS];  /* of those, the ones whose continuation equals f32's */
    int held_tokens;
} kvd_result;

/* Samples from softmax(logits) with a splitmix64 stream (temperature 1). */
static int32_t sample(const float *logits, int V, uint64_t *s)
{
    float mx = logits[0];
    for (int i = 1; i < V; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int i = 0; i < V; i++)
        sum += exp((double)logits[i] - mx);
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    double u = (double)(z >> 11) / 9007199254740992.0 * sum, acc = 0;
    for (int i = 0; i < V; i++) {
        acc += exp((double)logits[i] - mx);
        if (u < acc)
            return i;
    }
    return V - 1;
}

/* Largest minus second largest of x[0..n). */
static double top2_gap(const float *x, int n)
{
    float a = -INFINITY, b = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (x[i] > a)
            b = a, a = x[i];
        else if (x[i] > b)
            b = x[i];
    }
    return (double)a - (double)b;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Caches for n sequences in blocks of B tokens: cs[i] points at n_layers
 * slots of all[]. */
static int group_caches(kvt_model *m, int n, int B, kvt_cache **all, kvt_cache ***cs)
{
    int L = kvt_model_get_config(m)->n_layers;
    for (int i = 0; i < n; i++) {
        cs[i] = all + (size_t)i * L;
        int rc = kvt_model_new_caches(m, B, cs[i]);
        if (rc) {
            for (int j = 0; j < i; j++)
                kvt_caches_destroy(cs[j], L);
            return rc;
        }
    }
    return 0;
}

static void group_free(kvt_model *m, int n, kvt_cache ***cs)
{
    for (int i = 0; i < n; i++)
        kvt_caches_destroy(cs[i], kvt_model_get_config(m)->n_layers);
}

/* Prompts: BOS then T - 1 tokens sampled in f32, prompt i from seed i. */
static int make_prompts(kvt_model *m, const kvd_opts *o, int32_t *prompts, kvt_cache **all, kvt_cache ***cs,
                        float *logits, int32_t *tok)
{
    const int V = kvt_model_get_config(m)->vocab_size, T = o->prompt_tokens;
    kvt_model_set_kv_scheme(m, KVT_KV_F32);
    for (int g0 = 0; g0 < o->prompts; g0 += o->group) {
        int n = o->prompts - g0 < o->group ? o->prompts - g0 : o->group, rc;
        uint64_t seed[1024];
        if ((rc = group_caches(m, n, o->block_tokens, all, cs)))
            return rc;
        for (int i = 0; i < n; i++) {
            seed[i] = 1000 + (uint64_t)(g0 + i);
            prompts[(size_t)(g0 + i) * T] = 1; /* BOS */
        }
        for (int t = 0; t + 1 < T && !rc; t++) {
            for (int i = 0; i < n; i++)
                tok[i] = prompts[(size_t)(g0 + i) * T + t];
            if ((rc = kvt_model_decode_batch(m, n, cs, tok, logits)))
                break;
            for (int i = 0; i < n; i++)
                prompts[(size_t)(g0 + i) * T + t + 1] = sample(logits + (size_t)i * V, V, &seed[i]);
        }
        group_free(m, n, cs);
        if (rc)
            return rc;
    }
    return 0;
}

/* One row (a scheme, or f32* for row N_SCHEMES) over every prompt: prefill,
 * then N greedy steps batched. ids (P, N) receive the greedy tokens;
 * ref_ids / ref_logits (f32's, NULL when this is f32) are compared while the
 * context still equals f32's. */
static int run_scheme(kvt_model *m, int s, const kvd_opts *o, const int32_t *prompts, int32_t *ids,
                      float *last, const int32_t *ref_ids, const float *ref_last, kvt_cache **all, kvt_cache ***cs,
                      float *logits, int32_t *tok, kvd_result *r)
{
    const int V = kvt_model_get_config(m)->vocab_size, T = o->prompt_tokens, N = o->gen_tokens;
    kvt_model_set_kv_scheme(m, s == N_SCHEMES ? KVT_KV_F32 : (kvt_kv_scheme)s);
    for (int g0 = 0; g0 < o->prompts; g0 += o->group) {
        int n = o->prompts - g0 < o->group ? o->prompts - g0 : o->group, rc;
        int same[1024];
        if ((rc = group_caches(m, n, o->block_tokens, all, cs)))
            return rc;
        for (int i = 0; i < n && !rc; i++) {
            float *lg = logits + (size_t)i * V;
            const int32_t *p = prompts + (size_t)(g0 + i) * T;
            if (s == N_SCHEMES) /* f32*: T - 1 tokens, then the last one through decode */
                rc = kvt_model_prefill(m, cs[i], p, T - 1, NULL) || kvt_model_decode(m, cs[i], p[T - 1], lg);
            else
                rc = kvt_model_prefill(m, cs[i], p, T, lg);
            same[i] = 1;
        }
        for (int step = 0; step < N && !rc; step++) {
            for (int i = 0; i < n; i++) {
                const float *lg = logits + (size_t)i * V;
                size_t row = (size_t)(g0 + i) * (size_t)N + (size_t)step;
                ids[row] = kvt_sample_argmax(lg, V);
                if (!ref_ids) { /* f32: keep the logits the others compare with */
                    memcpy(last + row * (size_t)V, lg, sizeof(float) * (size_t)V);
                    r->ref_steps++;
                    int near = top2_gap(lg, V) < NEAR_TIE;
                    r->ref_near += near;
                    r->tied[g0 + i] |= (unsigned char)near;
                } else if (same[i]) {
                    const float *ref = ref_last + row * (size_t)V;
                    for (int v = 0; v < V; v++) {
                        double d = fabs((double)lg[v] - ref[v]);
                        r->max_diff[s] = d > r->max_diff[s] ? d : r->max_diff[s];
                        r->sum_diff[s] += d;
                    }
                    r->n_diff[s] += V;
                    same[i] = ids[row] == ref_ids[row];
                    if (!same[i]) /* the first divergence: how close was f32's own choice? */
                        r->gap[s][r->n_gap[s]++] = top2_gap(ref, V);
                }
                tok[i] = ids[row];
            }
            if (step + 1 < N)
                rc = kvt_model_decode_batch(m, n, cs, tok, logits);
        }
        for (int i = 0; i < n && ref_ids; i++) {
            int same_all = !memcmp(ids + (size_t)(g0 + i) * N, ref_ids + (size_t)(g0 + i) * N, sizeof(int32_t) * N);
            r->agree[s] += same_all;
            r->agree_clean[s] += same_all && !r->tied[g0 + i];
        }
        for (int i = 0; i < n && !ref_ids; i++)
            r->clean += !r->tied[g0 + i];
        group_free(m, n, cs);
        if (rc)
            return rc;
    }
    return 0;
}

/* Perplexity of the held text: exp(mean -log p(token | the text before)). */
static int perplexity(kvt_model *m, kvt_kv_scheme s, int B, const int32_t *ids, int n, double *out)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    kvt_cache *caches[KVT_MODEL_MAX_LAYERS] = {0};
    float *lg = malloc(sizeof(float) * (size_t)c->vocab_size);
    kvt_model_set_kv_scheme(m, s);
    int rc = lg ? kvt_model_new_caches(m, B, caches) : KVT_ENOMEM;
    double nll = 0;
    for (int t = 0; t + 1 < n && !rc; t++) {
        if ((rc = kvt_model_decode(m, caches, ids[t], lg)))
            break;
        float mx = lg[0];
        for (int v = 1; v < c->vocab_size; v++)
            mx = lg[v] > mx ? lg[v] : mx;
        double sum = 0;
        for (int v = 0; v < c->vocab_size; v++)
            sum += exp((double)lg[v] - mx);
        nll += log(sum) - ((double)lg[ids[t + 1]] - mx);
    }
    if (!rc)
        *out = exp(nll / (n - 1));
    kvt_caches_destroy(caches, c->n_layers);
    free(lg);
    return rc;
}

static int bench_model(const char *name, const char *path, const char *tok_path, const kvd_opts *o0, kvd_result *r)
{
    kvt_model *m = NULL;
    kvt_tokenizer *tk = NULL;
    int rc = kvt_model_load(path, &m);
    if (rc) {
        fprintf(stderr, "kvtier bench kv-dtype: %s: %s\n", name, kvt_last_error());
        return rc;
    }
    const kvt_model_config *c = kvt_model_get_config(m);
    kvd_opts o = *o0;
    if (o.prompt_tokens + o.gen_tokens > c->seq_len)
        o.prompt_tokens = c->seq_len - o.gen_tokens;
    const int P = o.prompts, T = o.prompt_tokens, N = o.gen_tokens, V = c->vocab_size, G = o.group;
    for (int s = 0; s < N_ROWS; s++)
        free(r->gap[s]);
    free(r->tied);
    memset(r, 0, sizeof *r);
    for (int s = 0; s < N_ROWS; s++)
        r->gap[s] = calloc((size_t)P, sizeof(double));
    r->tied = calloc((size_t)P, 1);
    int32_t *prompts = malloc(sizeof(int32_t) * (size_t)P * T), *tok = malloc(sizeof(int32_t) * (size_t)G);
    int32_t *ids[N_ROWS] = {0};
    float *ref_last = malloc(sizeof(float) * (size_t)P * N * V), *logits = malloc(sizeof(float) * (size_t)G * V);
    kvt_cache **all = calloc((size_t)G * c->n_layers, sizeof *all);
    kvt_cache ***cs = calloc((size_t)G, sizeof *cs);
    for (int s = 0; s < N_ROWS; s++)
        ids[s] = malloc(sizeof(int32_t) * (size_t)P * N);
    rc = prompts && tok && ref_last && logits && all && cs && r->tied ? 0 : KVT_ENOMEM;
    for (int s = 0; s < N_ROWS && !rc; s++)
        rc = ids[s] && r->gap[s] ? 0 : KVT_ENOMEM;
    fprintf(stderr, "%s: %d prompts of %d tokens, %d greedy tokens each, groups of %d, blocks of %d\n", name, P, T,
            N, G, o.block_tokens);
    if (!rc)
        rc = make_prompts(m, &o, prompts, all, cs, logits, tok);
    for (int s = 0; s < N_ROWS && !rc; s++) {
        kvt_model_set_kv_scheme(m, s == N_SCHEMES ? KVT_KV_F32 : (kvt_kv_scheme)s);
        r->kv_bytes[s] = kvt_model_kv_bytes_per_token(m);
        rc = run_scheme(m, s, &o, prompts, ids[s], ref_last, s ? ids[0] : NULL, s ? ref_last : NULL,
                        all, cs, logits, tok, r);
    }
    if (!rc && tok_path && !(rc = kvt_tokenizer_load(tok_path, V, &tk))) {
        int32_t held[4096];
        int64_t nh = 0;
        rc = kvt_tokenizer_encode(tk, k_held_text, 1, 0, held, 4096, &nh);
        r->held_tokens = (int)nh;
        if (nh > c->seq_len)
            nh = c->seq_len; /* one window of the model's positions */
        for (int s = 0; s < N_SCHEMES && !rc; s++)
            rc = perplexity(m, (kvt_kv_scheme)s, o.block_tokens, held, (int)nh, &r->ppl[s]);
        r->held_tokens = (int)nh;
    }
    if (rc)
        fprintf(stderr, "kvtier bench kv-dtype: %s: %s (%s)\n", name, kvt_last_error(), kvt_strerror(rc));
    for (int s = 0; s < N_ROWS; s++)
        free(ids[s]);
    free(prompts), free(tok), free(ref_last), free(logits), free(all), free(cs);
    kvt_tokenizer_free(tk);
    kvt_model_free(m);
    return rc;
}

static void print_result(const char *name, const kvd_opts *o, const kvd_result *r)
{
    printf("\n%s (%d prompts; greedy agreement over %d tokens; KV blocks of %d tokens)\n", name, o->prompts,
           o->gen_tokens, o->block_tokens);
    printf("  %-6s %10s %8s %12s %13s %16s %s\n", "scheme", "KV B/tok", "vs f32", "max|dlogit|", "mean|dlogit|",
           "greedy agree", r->ppl[0] > 0 ? "perplexity (held text)" : "");
    for (int s = 0; s < N_ROWS; s++) {
        char ppl[64] = "";
        if (r->ppl[s] > 0)
            snprintf(ppl, sizeof ppl, "%.4f (%d tokens)", r->ppl[s], r->held_tokens);
        if (s == 0) {
            printf("  %-6s %10zu %7.3fx %12s %13s %16s %s\n", "f32", r->kv_bytes[0], 1.0, "-", "-", "reference", ppl);
            continue;
        }
        printf("  %-6s %10zu %7.3fx %12.3g %13.3g %9d/%d %4.1f%% %s\n",
               s == N_SCHEMES ? "f32*" : kvt_kv_scheme_name((kvt_kv_scheme)s),
               r->kv_bytes[s], (double)r->kv_bytes[s] / (double)r->kv_bytes[0], r->max_diff[s],
               r->n_diff[s] ? r->sum_diff[s] / (double)r->n_diff[s] : 0.0, r->agree[s], o->prompts,
               100.0 * r->agree[s] / o->prompts, ppl);
    }
    printf("  near-ties: f32's top-2 logit gap is under %g at %ld of its %ld greedy steps (%.2f%%)\n", NEAR_TIE,
           r->ref_near, r->ref_steps, r->ref_steps ? 100.0 * (double)r->ref_near / (double)r->ref_steps : 0.0);
    printf("  prompts whose f32 continuation never passes a gap under %g: %d of %d; greedy agreement among them:",
           NEAR_TIE, r->clean, o->prompts);
    for (int s = 1; s < N_ROWS; s++)
        printf(" %s %d/%d%s", s == N_SCHEMES ? "f32*" : kvt_kv_scheme_name((kvt_kv_scheme)s), r->agree_clean[s],
               r->clean, s + 1 < N_ROWS ? "," : "\n");
    for (int s = 1; s < N_ROWS; s++) {
        if (!r->n_gap[s])
            continue;
        int near = 0;
        for (int i = 0; i < r->n_gap[s]; i++)
            near += r->gap[s][i] < NEAR_TIE;
        qsort(r->gap[s], (size_t)r->n_gap[s], sizeof(double), cmp_double);
        printf("  %-6s %d disagreements: %d at a near-tie (f32's gap at the first divergence < %g); gap median "
               "%.3g, max %.3g\n",
               s == N_SCHEMES ? "f32*" : kvt_kv_scheme_name((kvt_kv_scheme)s), r->n_gap[s], near, NEAR_TIE,
               r->gap[s][r->n_gap[s] / 2], r->gap[s][r->n_gap[s] - 1]);
    }
}

int kvt_bench_kv_dtype(int argc, char **argv)
{
    kvd_opts o = {64, 256, 128, 64, 256}, od = {64, 256, 128, 8, 256};
    const char *model = NULL, *tok_path = NULL;
    int skip_default = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int x = v ? atoi(v) : 0;
        if (!strcmp(a, "--model") && v)
            model = v, i++;
        else if (!strcmp(a, "--tokenizer") && v)
            tok_path = v, i++;
        else if (!strcmp(a, "--prompts") && v && x >= 1 && x <= 4096)
            o.prompts = od.prompts = x, i++;
        else if (!strcmp(a, "--prompt-tokens") && v && x >= 1)
            o.prompt_tokens = od.prompt_tokens = x, i++;
        else if (!strcmp(a, "--gen-tokens") && v && x >= 1 && x <= 4096)
            o.gen_tokens = od.gen_tokens = x, i++;
        else if (!strcmp(a, "--default-prompts") && v && x >= 1 && x <= 4096)
            od.prompts = x, i++;
        else if (!strcmp(a, "--block-tokens") && v && x >= 1 && x <= 65536)
            o.block_tokens = od.block_tokens = x, i++;
        else if (!strcmp(a, "--no-default"))
            skip_default = 1;
        else {
            int help = !strcmp(a, "--help");
            fprintf(help ? stdout : stderr,
                    "usage: kvtier bench kv-dtype [--model stories260K.bin --tokenizer tok512.bin] [--prompts N (64)]\n"
                    "       [--prompt-tokens T (256)] [--gen-tokens N (128)] [--default-prompts N (--prompts)]\n"
                    "       [--block-tokens B (256)] [--no-default]\n"
                    "Quality of each KV storage scheme (f16, bf16, q8) against f32 in the same run: max and mean\n"
                    "|logit difference|, greedy agreement (prompts whose greedy continuation equals f32's),\n"
                    "perplexity of stories260K on a held text, KV bytes per token. Goals: f16 and bf16 agree\n"
                    "on >= 95%% of the prompts on stories260K, q8 on >= 85%%.\n");
            return help ? 0 : 2;
        }
    }
    if (o.prompt_tokens < 2) {
        fprintf(stderr, "kvtier bench kv-dtype: --prompt-tokens must be >= 2\n");
        return 2;
    }
    char stories[4096], stok[4096];
    if (!model) {
        const char *shared = getenv("KVT_SHARED_DIR");
        snprintf(stories, sizeof stories, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
        snprintf(stok, sizeof stok, "%s/data/models/tok512.bin", shared ? shared : "../shared");
        model = stories;
        tok_path = stok;
    }
    int status = 0;
    kvd_result r = {0};
    double load[1] = {0};
    if (getloadavg(load, 1) == 1)
        printf("load average at start: %.2f (quality figures do not depend on it)\n", load[0]);
    if (access(model, R_OK) == 0) {
        if (!(status |= bench_model("stories260K", model, tok_path && !access(tok_path, R_OK) ? tok_path : NULL, &o,
                                    &r))) {
            print_result("stories260K", &o, &r);
            int ok = r.agree[KVT_KV_F16] * 100 >= 95 * o.prompts && r.agree[KVT_KV_BF16] * 100 >= 95 * o.prompts &&
                     r.agree[KVT_KV_Q8] * 100 >= 85 * o.prompts;
            printf("  goals (f16, bf16 >= 95%%; q8 >= 85%% greedy agreement): %s\n", ok ? "met" : "MISSED");
        }
    } else {
        fprintf(stderr, "kvtier bench kv-dtype: %s not found; skipping it (pass --model)\n", model);
    }
    if (!skip_default) {
        char mp[4096], tp[4096];
        int rc = kvt_default_model(mp, sizeof mp, tp, sizeof tp);
        if (rc) {
            fprintf(stderr, "kvtier bench kv-dtype: default model: %s\n", kvt_last_error());
            return 1;
        }
        if (!(rc = bench_model("default", mp, NULL, &od, &r)))
            print_result("default model (random weights: no perplexity)", &od, &r);
        status |= rc;
    }
    printf("\nlogit differences: the prompt's last position and every greedy step whose context still equals\n"
           "f32's; prompts: BOS + tokens sampled from the model in f32 (seed per prompt), run batched.\n"
           "f32*: f32 again with the order of its arithmetic changed (the prompt prefilled as T - 1 tokens, its\n"
           "last one through decode): how far float rounding alone moves greedy text (the noise floor).\n");
    for (int s = 0; s < N_ROWS; s++)
        free(r.gap[s]);
    free(r.tied);
    return status ? 1 : 0;
}
