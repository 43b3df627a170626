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
 *   - caches in blocks of --block-tokens (default 256; f16, bf16 and q8 keep
 *     a sequence's open block in f32 and store a block in the scheme once the
 *     next one starts, so smaller blocks round more of the context);
 *   - f16+open and bf16+open: the same policy simulated on f32 caches whose
 *     full blocks are rounded and written back, rounded by this file's own
 *     reference (kvt__round_ref, engine/kernels.h: the nearest multiple of each
 *     value's quantum in double, ties to even; not the library's conversion): a cross-check
 *     that the real f16 and bf16 rows compute exactly that (printed: equal
 *     greedy tokens and equal logit differences, bit for bit), so the
 *     scheme's conversion rounds as IEEE does and attention reads the
 *     stored values exactly;
 *   - per disagreeing prompt, its first divergence: the greedy step, f32's
 *     margin for its token over the scheme's and f32's top-2 gap, the
 *     scheme's margin for its own token, the largest |dlogit| there;
 *   - --rounding-check: every one of the 2^32 floats through
 *     kvt_dtype_from_f32 (F16, BF16) and back against kvt__round_ref;
 *   - the noise floor the schemes are read against: f32 again with only the
 *     order of its arithmetic changed: f32*isa on the next kernel set down
 *     (8 lanes instead of 16: every dot product, sum and exp), f32*pre with
 *     each prompt through kvt_model_prefill's GEMM.
 * The reference makes the prompts and feeds their last token one batched
 * decode step at a time; the schemes prefill them in batched passes over all
 * sequences of a group (kvt_model_forward_batch: one product per weight for
 * every row; bit-identical to decoding token by token), so they differ from
 * f32 only by their storage, and f32's prompt is computed once.
 * Owns nothing beyond the run; writes no file but the default model on first
 * use.
 */
#include "cli.h"
#include "kernels.h"
#include "model.h"
#include "sampler.h"
#include "tokenizer.h"
#include "kvtier/service.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define N_SCHEMES KVT_KV_SCHEME_COUNT
/* Rows: the schemes (row 0, f32, is the reference), two schemes simulated
 * with their open block kept in f32 until sealed, and two f32 rows with only
 * the order of the arithmetic changed (the noise floor). */
enum { ROW_F16_OPEN = N_SCHEMES, ROW_BF16_OPEN, ROW_ISA, ROW_PRE, N_ROWS };
#define KVD_MIN(a, b) ((a) < (b) ? (a) : (b))
#define NEAR_TIE 1e-2 /* a top-2 logit gap under this is a near-tie */
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
    int want[N_ROWS]; /* rows to run (the reference always runs) */
} kvd_opts;

/* A prompt's first greedy step whose token differs from f32's (the context
 * still equal): f32 picked a, the row b. */
typedef struct {
    int prompt, step;
    int32_t a, b;
    double gap;        /* f32's top-2 logit gap there */
    double ref_margin; /* f32's logit of a minus its logit of b (>= gap) */
    double row_margin; /* the row's logit of b minus its logit of a (>= 0) */
    double max_diff;   /* max |row logit - f32 logit| over the vocabulary at that step */
} kvd_div;

typedef struct {
    size_t kv_bytes[N_ROWS];
    double max_diff[N_ROWS], sum_diff[N_ROWS];
    long n_diff[N_ROWS];      /* logits compared */
    int agree[N_ROWS];        /* prompts whose greedy continuation equals f32's */
    int ran[N_ROWS];          /* 1: the row was run */
    double secs[N_ROWS];      /* wall time of the row (the reference: with making the prompts) */
    double ppl[N_ROWS];       /* 0: not measured */
    double *gap[N_ROWS];      /* (prompts) f32's top-2 gap at each disagreeing prompt's first divergence */
    kvd_div *div[N_ROWS];     /* (prompts) each disagreeing prompt's first divergence, in prompt order */
    int n_gap[N_ROWS];
    long ref_steps, ref_near; /* f32's greedy steps, and those whose top-2 gap is under NEAR_TIE */
    unsigned char *tied;      /* (prompts) 1 when f32's continuation passes a gap under NEAR_TIE */
    int clean;                /* prompts whose f32 continuation never does */
    int agree_clean[N_ROWS];  /* of those, the ones whose continuation equals f32's */
    int same_ids[N_ROWS];     /* f16+open, bf16+open: prompts whose greedy tokens equal the real row's; -1 not run */
    int held_tokens;
    char isa[16], alt_isa[16]; /* the reference's kernel set, and f32*isa's ("" when the CPU has one) */
} kvd_result;

/* What a group of rows shares: caches of up to `group` sequences, logits,
 * the tokens and counts of a batched pass, seal scratch. */
typedef struct {
    kvt_model *m;
    const kvd_opts *o;
    const int32_t *prompts; /* (P, T) */
    kvt_cache **all, ***cs;
    float *logits;          /* (group, V) */
    int32_t *tok, *counts;  /* (group * KVT_MODEL_CHUNK), (group) */
    float *seal;            /* (2, B, kv_dim): a block being sealed */
    kvd_result *r;
} kvd_run;

static const char *row_name(int s)
{
    switch (s) {
    case ROW_F16_OPEN: return "f16+open";
    case ROW_BF16_OPEN: return "bf16+open";
    case ROW_ISA: return "f32*isa";
    case ROW_PRE: return "f32*pre";
    default: return kvt_kv_scheme_name((kvt_kv_scheme)s);
    }
}

/* The scheme a row's caches are made in: the simulated open-block rows and
 * the noise-floor rows hold f32 caches. */
static kvt_kv_scheme row_scheme(int s) { return s < N_SCHEMES ? (kvt_kv_scheme)s : KVT_KV_F32; }

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

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

/* --rounding-check: every float through kvt_dtype_from_f32 (F16, BF16) and
 * kvt_dtype_to_f32, against kvt__round_ref (NaN: a NaN of the same sign).
 * @return the floats that differ (0: none), or -1 out of memory. */
static long long rounding_check(kvt_dtype dt, double *secs)
{
    enum { CHUNK = 1 << 16 };
    float *x = malloc(sizeof(float) * CHUNK), *y = malloc(sizeof(float) * CHUNK);
    uint16_t *h = malloc(sizeof(uint16_t) * CHUNK);
    long long bad = 0;
    double t0 = now_s();
    if (!x || !y || !h) {
        free(x), free(y), free(h);
        return -1;
    }
    for (uint64_t base = 0; base < ((uint64_t)1 << 32); base += CHUNK) {
        for (uint32_t i = 0; i < CHUNK; i++) {
            uint32_t b = (uint32_t)base + i;
            memcpy(&x[i], &b, sizeof b);
        }
        (void)kvt_dtype_from_f32(dt, x, h, CHUNK);
        (void)kvt_dtype_to_f32(dt, h, y, CHUNK);
        for (uint32_t i = 0; i < CHUNK; i++) {
            if (isnan(x[i])) {
                bad += !isnan(y[i]) || signbit(y[i]) != signbit(x[i]);
                continue;
            }
            float w = kvt__round_ref(dt, x[i]);
            bad += memcmp(&w, &y[i], sizeof w) != 0;
        }
    }
    *secs = now_s() - t0;
    free(x), free(y), free(h);
    return bad;
}

/* The simulated open-block rows: when a sequence's kv caches have just
 * filled a block (offset a multiple of B), that block's K/V are rounded to
 * dt (f16 or bf16) by kvt__round_ref and written back (trim, append): the rows
 * before it were rounded when they filled, the open block stays f32, as the
 * 8-bit scheme's caches keep theirs. */
static int seal_full_blocks(kvd_run *x, int n, kvt_dtype dt)
{
    const kvt_model_config *c = kvt_model_get_config(x->m);
    const int B = x->o->block_tokens;
    const size_t kv = (size_t)c->kv_dim, elems = (size_t)B * kv;
    for (int i = 0; i < n; i++) {
        for (int l = 0; l < c->n_layers; l++) {
            kvt_cache *cache = x->cs[i][l];
            int64_t off = kvt_cache_offset(cache);
            if (c->layer_kind[l] != KVT_LAYER_ATTN || off == 0 || off % B)
                continue;
            const float *k, *v;
            int32_t nt = 0;
            int rc = kvt_kv_block(cache, off / B - 1, &k, &v, &nt);
            if (rc || nt != B)
                return rc ? rc : KVT_EINVAL;
            float *kr = x->seal, *vr = x->seal + elems;
            memcpy(kr, k, elems * sizeof(float));
            memcpy(vr, v, elems * sizeof(float));
            for (size_t e = 0; e < 2 * elems; e++)
                kr[e] = kvt__round_ref(dt, kr[e]);
            const void *in[2] = {kr, vr};
            if ((rc = kvt_cache_trim(cache, off - B)) || (rc = kvt_cache_append(cache, B, in)))
                return rc ? rc : KVT_EINVAL;
        }
    }
    return 0;
}

/* N greedy steps of sequences g0 .. g0 + n from the prompt-end logits in
 * x->logits, batched. ids (P, N) receive the greedy tokens; ref_ids /
 * ref_last (f32's, NULL when this is f32) are compared while the context
 * still equals f32's. */
static int greedy(kvd_run *x, int s, int g0, int n, int32_t *ids, float *last, const int32_t *ref_ids,
                  const float *ref_last)
{
    const int V = kvt_model_get_config(x->m)->vocab_size, N = x->o->gen_tokens;
    kvd_result *r = x->r;
    kvt_dtype seal = s == ROW_F16_OPEN ? KVT_DTYPE_F16 : s == ROW_BF16_OPEN ? KVT_DTYPE_BF16 : KVT_DTYPE_F32;
    int same[4096], rc = 0;
    for (int i = 0; i < n; i++)
        same[i] = 1;
    for (int step = 0; step < N && !rc; step++) {
        for (int i = 0; i < n; i++) {
            const float *lg = x->logits + (size_t)i * V;
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
                double step_max = 0;
                for (int v = 0; v < V; v++) {
                    double d = fabs((double)lg[v] - ref[v]);
                    step_max = d > step_max ? d : step_max;
                    r->sum_diff[s] += d;
                }
                r->max_diff[s] = step_max > r->max_diff[s] ? step_max : r->max_diff[s];
                r->n_diff[s] += V;
                same[i] = ids[row] == ref_ids[row];
                if (!same[i]) { /* the first divergence: how close was f32's own choice? */
                    int32_t a = ref_ids[row], b = ids[row];
                    r->div[s][r->n_gap[s]] = (kvd_div){g0 + i, step, a, b, top2_gap(ref, V),
                                                       (double)ref[a] - (double)ref[b], (double)lg[b] - (double)lg[a],
                                                       step_max};
                    r->gap[s][r->n_gap[s]++] = top2_gap(ref, V);
                }
            }
            x->tok[i] = ids[row];
        }
        if (step + 1 < N && seal != KVT_DTYPE_F32)
            rc = seal_full_blocks(x, n, seal);
        if (step + 1 < N && !rc)
            rc = kvt_model_decode_batch(x->m, n, x->cs + 0, x->tok, x->logits);
    }
    for (int i = 0; i < n && ref_ids && !rc; i++) {
        int same_all = !memcmp(ids + (size_t)(g0 + i) * N, ref_ids + (size_t)(g0 + i) * N, sizeof(int32_t) * N);
        r->agree[s] += same_all;
        r->agree_clean[s] += same_all && !r->tied[g0 + i];
    }
    for (int i = 0; i < n && !ref_ids && !rc; i++)
        r->clean += !r->tied[g0 + i];
    return rc;
}

/* The reference (row 0): makes the prompts (BOS then T - 1 tokens sampled
 * in f32, prompt i from seed 1000 + i) one batched decode step at a time,
 * feeds each prompt's last token, then its greedy continuation. The same
 * arithmetic as a batched prefill of the prompt (batch invariance), so the
 * schemes' rows, prefilled that way, differ from it only by their storage. */
static int run_ref(kvd_run *x, int32_t *prompts, int32_t *ids, float *last)
{
    const kvd_opts *o = x->o;
    const int V = kvt_model_get_config(x->m)->vocab_size, T = o->prompt_tokens;
    kvt_model_set_kv_scheme(x->m, KVT_KV_F32);
    for (int g0 = 0; g0 < o->prompts; g0 += o->group) {
        int n = o->prompts - g0 < o->group ? o->prompts - g0 : o->group, rc;
        uint64_t seed[4096];
        if ((rc = group_caches(x->m, n, o->block_tokens, x->all, x->cs)))
            return rc;
        for (int i = 0; i < n; i++) {
            seed[i] = 1000 + (uint64_t)(g0 + i);
            prompts[(size_t)(g0 + i) * T] = 1; /* BOS */
        }
        for (int t = 0; t < T && !rc; t++) {
            for (int i = 0; i < n; i++)
                x->tok[i] = prompts[(size_t)(g0 + i) * T + t];
            if ((rc = kvt_model_decode_batch(x->m, n, x->cs, x->tok, x->logits)))
                break;
            for (int i = 0; t + 1 < T && i < n; i++)
                prompts[(size_t)(g0 + i) * T + t + 1] = sample(x->logits + (size_t)i * V, V, &seed[i]);
        }
        if (!rc)
            rc = greedy(x, 0, g0, n, ids, last, NULL, NULL);
        group_free(x->m, n, x->cs);
        if (rc)
            return rc;
    }
    return 0;
}

/* The prompts of sequences g0 .. g0 + n through batched passes (every
 * sequence's next chunk in one pass; a chunk ends at a block boundary for
 * the 8-bit scheme and the simulated open-block rows); x->logits gets each
 * prompt's last logits. */
static int prefill_batched(kvd_run *x, int s, int g0, int n)
{
    const int T = x->o->prompt_tokens, B = x->o->block_tokens;
    for (int t0 = 0; t0 < T;) {
        int64_t c = kvt_model_pass_rows(x->m, x->cs[0]);
        if (s == ROW_F16_OPEN || s == ROW_BF16_OPEN)
            c = KVD_MIN(c, B - t0 % B);
        c = KVD_MIN(c, T - t0);
        for (int i = 0; i < n; i++) {
            x->counts[i] = (int32_t)c;
            memcpy(x->tok + (size_t)i * c, x->prompts + (size_t)(g0 + i) * T + t0, sizeof(int32_t) * (size_t)c);
        }
        int rc = kvt_model_forward_batch(x->m, n, x->cs, x->counts, x->tok, x->logits);
        t0 += (int)c;
        if (!rc && t0 < T && (s == ROW_F16_OPEN || s == ROW_BF16_OPEN))
            rc = seal_full_blocks(x, n, s == ROW_F16_OPEN ? KVT_DTYPE_F16 : KVT_DTYPE_BF16);
        if (rc)
            return rc;
    }
    return 0;
}

/* One row other than the reference over every prompt: its prefill, then N
 * greedy steps compared with f32's (ref_ids, ref_last). */
static int run_row(kvd_run *x, int s, int32_t *ids, const int32_t *ref_ids, const float *ref_last)
{
    const kvd_opts *o = x->o;
    const int V = kvt_model_get_config(x->m)->vocab_size, T = o->prompt_tokens;
    kvt_model_set_kv_scheme(x->m, row_scheme(s));
    for (int g0 = 0; g0 < o->prompts; g0 += o->group) {
        int n = o->prompts - g0 < o->group ? o->prompts - g0 : o->group, rc;
        if ((rc = group_caches(x->m, n, o->block_tokens, x->all, x->cs)))
            return rc;
        if (s == ROW_PRE) { /* f32*pre: each prompt through kvt_model_prefill (GEMM over its tokens) */
            for (int i = 0; i < n && !rc; i++)
                rc = kvt_model_prefill(x->m, x->cs[i], x->prompts + (size_t)(g0 + i) * T, T,
                                       x->logits + (size_t)i * V);
        } else {
            rc = prefill_batched(x, s, g0, n);
        }
        if (!rc)
            rc = greedy(x, s, g0, n, ids, NULL, ref_ids, ref_last);
        group_free(x->m, n, x->cs);
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

/* The kernel set f32*isa runs on: the next one down from the best ("" when
 * the CPU has only one). */
static const char *alt_isa(const char *best)
{
    static const char *const order[] = {"avx512", "avx2", "c"};
    for (int i = 0; i + 1 < 3; i++)
        if (!strcmp(best, order[i]))
            return order[i + 1];
    return "";
}

/* KV bytes a token costs in caches of blocks of B in the model's scheme: the
 * per-token growth the service projects for admission (kvt_service_layer_of:
 * K and V, 8-bit codes with their per-block scales), summed over layers. */
static int kv_bytes_per_token(kvt_model *m, int B, size_t *out)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    kvt_cache *caches[KVT_MODEL_MAX_LAYERS] = {0};
    int rc = kvt_model_new_caches(m, B, caches);
    *out = 0;
    if (rc)
        return rc;
    for (int l = 0; l < c->n_layers && !rc; l++) {
        kvt_service_layer sl;
        if (!(rc = kvt_service_layer_of(caches[l], &sl)) && sl.growth == KVT_GROWTH_PER_TOKEN)
            *out += sl.bytes_per_token;
    }
    kvt_caches_destroy(caches, c->n_layers);
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
    if (o.group > o.prompts)
        o.group = o.prompts;
    const int P = o.prompts, T = o.prompt_tokens, N = o.gen_tokens, V = c->vocab_size, G = o.group;
    for (int s = 0; s < N_ROWS; s++)
        free(r->gap[s]), free(r->div[s]);
    free(r->tied);
    memset(r, 0, sizeof *r);
    snprintf(r->isa, sizeof r->isa, "%s", kvt__kernels_isa());
    snprintf(r->alt_isa, sizeof r->alt_isa, "%s", alt_isa(r->isa));
    for (int s = 0; s < N_ROWS; s++)
        r->gap[s] = calloc((size_t)P, sizeof(double)), r->div[s] = calloc((size_t)P, sizeof(kvd_div));
    r->tied = calloc((size_t)P, 1);
    int32_t *prompts = malloc(sizeof(int32_t) * (size_t)P * T);
    int32_t *ids[N_ROWS] = {0};
    float *ref_last = malloc(sizeof(float) * (size_t)P * N * V);
    size_t seal_elems = (size_t)o.block_tokens * (size_t)c->kv_dim;
    kvd_run x = {m, &o, prompts, calloc((size_t)G * c->n_layers, sizeof(kvt_cache *)),
                 calloc((size_t)G, sizeof(kvt_cache **)), malloc(sizeof(float) * (size_t)G * V),
                 malloc(sizeof(int32_t) * (size_t)G * KVT_MODEL_CHUNK), malloc(sizeof(int32_t) * (size_t)G),
                 malloc(sizeof(float) * 2 * seal_elems), r};
    for (int s = 0; s < N_ROWS; s++)
        ids[s] = malloc(sizeof(int32_t) * (size_t)P * N);
    rc = prompts && ref_last && x.all && x.cs && x.logits && x.tok && x.counts && x.seal && r->tied
             ? 0
             : KVT_ENOMEM;
    for (int s = 0; s < N_ROWS && !rc; s++)
        rc = ids[s] && r->gap[s] && r->div[s] ? 0 : KVT_ENOMEM;
    r->same_ids[ROW_F16_OPEN] = r->same_ids[ROW_BF16_OPEN] = -1;
    fprintf(stderr, "%s: %d prompts of %d tokens, %d greedy tokens each, groups of %d, blocks of %d, %s kernels\n",
            name, P, T, N, G, o.block_tokens, r->isa);
    for (int s = 0; s < N_ROWS && !rc; s++) {
        if (s && (!o.want[s] || (s == ROW_ISA && !r->alt_isa[0])))
            continue;
        kvt_model_set_kv_scheme(m, row_scheme(s));
        if ((rc = kv_bytes_per_token(m, o.block_tokens, &r->kv_bytes[s])))
            break;
        if (s == ROW_F16_OPEN || s == ROW_BF16_OPEN) /* as stored once sealed (the open block aside) */
            r->kv_bytes[s] /= 2;
        double t0 = now_s();
        if (s == 0) {
            rc = run_ref(&x, prompts, ids[0], ref_last);
        } else {
            if (s == ROW_ISA && kvt__kernels_select(r->alt_isa) != 0)
                rc = KVT_EUNSUPPORTED;
            if (!rc)
                rc = run_row(&x, s, ids[s], ids[0], ref_last);
            if (s == ROW_ISA)
                kvt__kernels_select(r->isa);
        }
        r->secs[s] = now_s() - t0;
        r->ran[s] = !rc;
        int real = s == ROW_F16_OPEN ? KVT_KV_F16 : s == ROW_BF16_OPEN ? KVT_KV_BF16 : -1;
        if (real > 0 && r->ran[s] && r->ran[real]) { /* the simulation against the real scheme */
            r->same_ids[s] = 0;
            for (int i = 0; i < P; i++)
                r->same_ids[s] += !memcmp(ids[s] + (size_t)i * N, ids[real] + (size_t)i * N, sizeof(int32_t) * N);
        }
        if (s && !rc) /* the row's figures as it ends, so a long run shows them before its table */
            fprintf(stderr, "%s: %s done in %.1f s: %d/%d agree, max|dlogit| %.3g, mean %.3g\n", name,
                    row_name(s), r->secs[s], r->agree[s], P, r->max_diff[s],
                    r->n_diff[s] ? r->sum_diff[s] / (double)r->n_diff[s] : 0.0);
        else
            fprintf(stderr, "%s: %s done in %.1f s\n", name, row_name(s), r->secs[s]);
    }
    if (!rc && tok_path && !(rc = kvt_tokenizer_load(tok_path, V, &tk))) {
        int32_t held[4096];
        int64_t nh = 0;
        rc = kvt_tokenizer_encode(tk, k_held_text, 1, 0, held, 4096, &nh);
        if (nh > c->seq_len)
            nh = c->seq_len; /* one window of the model's positions */
        for (int s = 0; s < N_SCHEMES && !rc; s++)
            if (!s || o.want[s])
                rc = perplexity(m, (kvt_kv_scheme)s, o.block_tokens, held, (int)nh, &r->ppl[s]);
        r->held_tokens = (int)nh;
    }
    if (rc)
        fprintf(stderr, "kvtier bench kv-dtype: %s: %s (%s)\n", name, kvt_last_error(), kvt_strerror(rc));
    for (int s = 0; s < N_ROWS; s++)
        free(ids[s]);
    free(prompts), free(ref_last), free(x.all), free(x.cs), free(x.logits), free(x.tok), free(x.counts);
    free(x.seal);
    kvt_tokenizer_free(tk);
    kvt_model_free(m);
    return rc;
}

static void print_result(const char *name, const kvd_opts *o, const kvd_result *r)
{
    printf("\n%s (%d prompts; greedy agreement over %d tokens; KV blocks of %d tokens; %s kernels)\n", name,
           o->prompts, o->gen_tokens, o->block_tokens, r->isa);
    printf("  %-9s %10s %8s %12s %13s %16s %8s %s\n", "scheme", "KV B/tok", "vs f32", "max|dlogit|", "mean|dlogit|",
           "greedy agree", "time", r->ppl[0] > 0 ? "perplexity (held text)" : "");
    for (int s = 0; s < N_ROWS; s++) {
        char ppl[64] = "";
        if (!r->ran[s])
            continue;
        if (r->ppl[s] > 0)
            snprintf(ppl, sizeof ppl, "%.4f (%d tokens)", r->ppl[s], r->held_tokens);
        if (s == 0) {
            printf("  %-9s %10zu %7.3fx %12s %13s %16s %7.1fs %s\n", "f32", r->kv_bytes[0], 1.0, "-", "-",
                   "reference", r->secs[0], ppl);
            continue;
        }
        printf("  %-9s %10zu %7.3fx %12.3g %13.3g %9d/%d %4.1f%% %7.1fs %s\n", row_name(s), r->kv_bytes[s],
               (double)r->kv_bytes[s] / (double)r->kv_bytes[0], r->max_diff[s],
               r->n_diff[s] ? r->sum_diff[s] / (double)r->n_diff[s] : 0.0, r->agree[s], o->prompts,
               100.0 * r->agree[s] / o->prompts, r->secs[s], ppl);
    }
    printf("  near-ties: f32's top-2 logit gap is under %g at %ld of its %ld greedy steps (%.2f%%)\n", NEAR_TIE,
           r->ref_near, r->ref_steps, r->ref_steps ? 100.0 * (double)r->ref_near / (double)r->ref_steps : 0.0);
    printf("  prompts whose f32 continuation never passes a gap under %g: %d of %d; greedy agreement among them:",
           NEAR_TIE, r->clean, o->prompts);
    for (int s = 1; s < N_ROWS; s++)
        if (r->ran[s])
            printf(" %s %d/%d;", row_name(s), r->agree_clean[s], r->clean);
    printf("\n");
    for (int s = 1; s < N_ROWS; s++) {
        if (!r->ran[s] || !r->n_gap[s])
            continue;
        int near = 0;
        for (int i = 0; i < r->n_gap[s]; i++)
            near += r->gap[s][i] < NEAR_TIE;
        qsort(r->gap[s], (size_t)r->n_gap[s], sizeof(double), cmp_double);
        printf("  %-9s %d disagreements: %d at a near-tie (f32's gap at the first divergence < %g); gap median "
               "%.3g, max %.3g\n",
               row_name(s), r->n_gap[s], near, NEAR_TIE, r->gap[s][r->n_gap[s] / 2], r->gap[s][r->n_gap[s] - 1]);
        for (int i = 0; i < r->n_gap[s]; i++) {
            const kvd_div *d = &r->div[s][i];
            printf("    prompt %2d, greedy step %3d: f32 picks %d by %.3g over %s's %d (f32's top-2 gap %.3g), %s picks "
                   "%d by %.3g; max|dlogit| there %.3g\n",
                   d->prompt, d->step, (int)d->a, d->ref_margin, row_name(s), (int)d->b, d->gap, row_name(s),
                   (int)d->b, d->row_margin, d->max_diff);
        }
    }
    for (int s = ROW_F16_OPEN; s <= ROW_BF16_OPEN; s++) {
        int real = s == ROW_F16_OPEN ? KVT_KV_F16 : KVT_KV_BF16;
        if (r->same_ids[s] < 0)
            continue;
        int bits = r->same_ids[s] == o->prompts && r->max_diff[s] == r->max_diff[real] &&
                   r->sum_diff[s] == r->sum_diff[real] && r->n_diff[s] == r->n_diff[real];
        printf("  %s (real) vs %s (simulated): greedy tokens equal on %d/%d prompts; logit differences %s\n",
               row_name(real), row_name(s), r->same_ids[s], o->prompts,
               bits ? "equal bit for bit" : "DIFFER");
    }
    if (r->ran[ROW_ISA])
        printf("  f32*isa: f32 on the %s kernels (every dot product, sum and exp in another order)\n", r->alt_isa);
    else if (o->want[ROW_ISA])
        printf("  f32*isa: not run (this CPU has one kernel set)\n");
}

/* --rows LIST: comma-separated row names (the reference always runs). */
static int parse_rows(const char *list, int *want)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (int s = 1; s < N_ROWS; s++)
        want[s] = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int s = 1;
        while (s < N_ROWS && strcmp(t, row_name(s)))
            s++;
        if (s == N_ROWS)
            return -1;
        want[s] = 1;
    }
    return 0;
}

int kvt_bench_kv_dtype(int argc, char **argv)
{
    kvd_opts o = {64, 256, 128, 64, 256, {0}}, od;
    const char *model = NULL, *tok_path = NULL;
    int skip_default = 0, skip_stories = 0, check_rounding = 0;
    for (int s = 0; s < N_ROWS; s++)
        o.want[s] = 1;
    od = o;
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
        else if (!strcmp(a, "--group") && v && x >= 1 && x <= 4096)
            o.group = od.group = x, i++;
        else if (!strcmp(a, "--rows") && v && !parse_rows(v, o.want))
            memcpy(od.want, o.want, sizeof o.want), i++;
        else if (!strcmp(a, "--no-default"))
            skip_default = 1;
        else if (!strcmp(a, "--no-stories"))
            skip_stories = 1;
        else if (!strcmp(a, "--rounding-check"))
            check_rounding = 1;
        else {
            int help = !strcmp(a, "--help");
            fprintf(help ? stdout : stderr,
                    "usage: kvtier bench kv-dtype [--model stories260K.bin --tokenizer tok512.bin] [--prompts N (64)]\n"
                    "       [--prompt-tokens T (256)] [--gen-tokens N (128)] [--default-prompts N (--prompts)]\n"
                    "       [--block-tokens B (256)] [--group N (64)] [--rows LIST] [--no-default] [--no-stories]\n"
                    "       [--rounding-check]\n"
                    "Quality of each KV storage scheme (f16, bf16, q8) against f32 in the same run: max and mean\n"
                    "|logit difference|, greedy agreement (prompts whose greedy continuation equals f32's),\n"
                    "perplexity of stories260K on a held text, KV bytes per token. Goals: f16 and bf16 agree\n"
                    "on >= 95%% of the prompts on stories260K, q8 on >= 85%%.\n"
                    "Rows besides f32 (--rows picks some, comma-separated; default all): f16, bf16, q8 (each\n"
                    "keeps a sequence's open block in f32 and stores a block in the scheme once it is full);\n"
                    "f16+open, bf16+open (that policy simulated on f32 caches whose blocks are rounded to\n"
                    "f16/bf16 when they fill: a cross-check, printed against f16 and bf16); the noise floor,\n"
                    "f32 with only the order of its arithmetic changed: f32*isa (the next kernel set down:\n"
                    "avx2 under avx512) and f32*pre (each prompt through kvt_model_prefill's GEMM instead of the batched pass).\n"
                    "Sequences run batched, --group at a time (one set of caches per sequence). The simulated\n"
                    "rows round with this benchmark's own reference (nearest multiple of each value's quantum,\n"
                    "ties to even, in double), not the library's conversion; each disagreeing prompt's first\n"
                    "divergence is printed (step, f32's margin and top-2 gap, the scheme's margin).\n"
                    "--rounding-check first runs all 2^32 floats through the F16 and BF16 conversion against\n"
                    "that reference and prints how many differ.\n");
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
        printf("load average at start: %.2f (quality figures do not depend on it; times do)\n", load[0]);
    for (int d = 0; check_rounding && d < 2; d++) {
        const kvt_dtype dt = d ? KVT_DTYPE_BF16 : KVT_DTYPE_F16;
        double secs = 0;
        long long bad = rounding_check(dt, &secs);
        printf("rounding check: f32 -> %s -> f32 over all 4294967296 floats: %lld differ from the reference "
               "(nearest, ties to even; NaN stays NaN of its sign) (%.1f s)\n",
               kvt_dtype_name(dt), bad, secs);
        status |= bad != 0;
    }
    if (skip_stories) {
    } else if (access(model, R_OK) == 0) {
        if (!(status |= bench_model("stories260K", model, tok_path && !access(tok_path, R_OK) ? tok_path : NULL, &o,
                                    &r))) {
            print_result("stories260K", &o, &r);
            if (o.want[KVT_KV_F16] && o.want[KVT_KV_BF16] && o.want[KVT_KV_Q8]) {
                int ok = r.agree[KVT_KV_F16] * 100 >= 95 * o.prompts &&
                         r.agree[KVT_KV_BF16] * 100 >= 95 * o.prompts && r.agree[KVT_KV_Q8] * 100 >= 85 * o.prompts;
                printf("  goals (f16, bf16 >= 95%%; q8 >= 85%% greedy agreement): %s\n", ok ? "met" : "MISSED");
            }
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
    if (getloadavg(load, 1) == 1)
        printf("\nload average at the end: %.2f\n", load[0]);
    printf("logit differences: the prompt's last position and every greedy step whose context still equals\n"
           "f32's; prompts: BOS + tokens sampled from the model in f32 (seed per prompt). f32 and the schemes\n"
           "run the prompt through batched passes (the decode kernels; bit-identical to decoding it token by\n"
           "token), so a scheme differs from f32 only by its storage. f32*isa and f32*pre: f32 again with the\n"
           "order of its arithmetic changed: how far float rounding alone moves greedy text (the noise floor).\n");
    for (int s = 0; s < N_ROWS; s++)
        free(r.gap[s]), free(r.div[s]);
    free(r.tied);
    return status ? 1 : 0;
}
