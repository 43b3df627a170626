/*
 * sampler.c: next-token selection with llama2.c run.c semantics (argmax,
 * temperature softmax, multinomial, top-p) and its xorshift generator. It
 * owns the sampler settings, the generator state and the top-p scratch
 * buffer. It must never change the arithmetic order of llama2.c (float sums,
 * comparisons, the sort order of ties): a seeded run has to reproduce the
 * reference bit for bit.
 */
#include "sampler.h"

#include "util.h"

#include <math.h>
#include <stdlib.h>

struct kvt_sampler {
    int32_t vocab_size;        /* logits per call */
    float temperature;         /* 0 = greedy */
    float topp;                /* nucleus threshold; outside (0, 1) = multinomial */
    uint64_t seed;             /* the state the generator started from */
    uint64_t rng_state;        /* xorshift64* state, never 0 */
    uint64_t draws;            /* coins drawn since creation (or restore) */
    kvt_prob_index *probindex; /* (vocab_size,) top-p scratch */
};

uint32_t kvt_rng_u32(uint64_t *state)
{
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

float kvt_rng_f32(uint64_t *state)
{
    return (float)(kvt_rng_u32(state) >> 8) / 16777216.0f;
}

int32_t kvt_sample_argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    float best_v = x[0];
    for (int32_t i = 1; i < n; i++) {
        if (x[i] > best_v) {
            best = i;
            best_v = x[i];
        }
    }
    return best;
}

void kvt_softmax(float *x, int32_t n)
{
    float max_v = x[0];
    for (int32_t i = 1; i < n; i++)
        if (x[i] > max_v)
            max_v = x[i];
    float sum = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - max_v);
        sum += x[i];
    }
    for (int32_t i = 0; i < n; i++)
        x[i] /= sum;
}

int32_t kvt_sample_mult(const float *probs, int32_t n, float coin)
{
    float cdf = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        cdf += probs[i];
        if (coin < cdf)
            return i;
    }
    return n - 1;
}

/* Descending probability, then ascending id: the result of llama2.c's
 * comparator under glibc's stable merge-sort qsort on id-ordered input. */
static int cmp_prob_desc(const void *a, const void *b)
{
    const kvt_prob_index *x = a, *y = b;
    if (x->prob > y->prob)
        return -1;
    if (x->prob < y->prob)
        return 1;
    return (x->index > y->index) - (x->index < y->index);
}

int32_t kvt_sample_topp(const float *probs, int32_t n, float topp, kvt_prob_index *scratch, float coin)
{
    int32_t n0 = 0;
    const float cutoff = (1.0f - topp) / (float)(n - 1);
    for (int32_t i = 0; i < n; i++) {
        if (probs[i] >= cutoff) {
            scratch[n0].index = i;
            scratch[n0].prob = probs[i];
            n0++;
        }
    }
    if (n0 == 0)
        return kvt_sample_argmax(probs, n);
    qsort(scratch, (size_t)n0, sizeof *scratch, cmp_prob_desc);
    float cumulative = 0.0f;
    int32_t last = n0 - 1;
    for (int32_t i = 0; i < n0; i++) {
        cumulative += scratch[i].prob;
        if (cumulative > topp) {
            last = i;
            break;
        }
    }
    float r = coin * cumulative;
    float cdf = 0.0f;
    for (int32_t i = 0; i <= last; i++) {
        cdf += scratch[i].prob;
        if (r < cdf)
            return scratch[i].index;
    }
    return scratch[last].index;
}

int kvt_sampler_create(int32_t vocab_size, float temperature, float topp, uint64_t seed, kvt_sampler **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_sampler_create: NULL out");
    if (vocab_size < 1)
        return kvt__fail(KVT_EINVAL, "sampler: vocab_size %d must be >= 1", (int)vocab_size);
    if (!isfinite(temperature) || temperature < 0.0f)
        return kvt__fail(KVT_EINVAL, "sampler: temperature %g must be finite and >= 0", (double)temperature);
    if (isnan(topp))
        return kvt__fail(KVT_EINVAL, "sampler: top-p is NaN");
    if (seed == 0)
        return kvt__fail(KVT_EINVAL, "sampler: seed 0 would freeze the xorshift generator; use a nonzero seed");
    kvt_sampler *s = kvt__calloc(1, sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "sampler: no memory");
    s->probindex = kvt__calloc((size_t)vocab_size, sizeof *s->probindex);
    if (!s->probindex) {
        kvt__free(s);
        return kvt__fail(KVT_ENOMEM, "sampler: no memory for %d candidates", (int)vocab_size);
    }
    s->vocab_size = vocab_size;
    s->temperature = temperature;
    s->topp = topp;
    s->seed = seed;
    s->rng_state = seed;
    *out = s;
    return 0;
}

void kvt_sampler_free(kvt_sampler *s)
{
    if (!s)
        return;
    kvt__free(s->probindex);
    kvt__free(s);
}

int32_t kvt_sampler_vocab_size(const kvt_sampler *s)
{
    return s ? s->vocab_size : 0;
}

uint64_t kvt_sampler_rng_state(const kvt_sampler *s)
{
    return s ? s->rng_state : 0;
}

uint64_t kvt_sampler_seed(const kvt_sampler *s) { return s ? s->seed : 0; }

uint64_t kvt_sampler_rng_draws(const kvt_sampler *s) { return s ? s->draws : 0; }

float kvt_sampler_temperature(const kvt_sampler *s) { return s ? s->temperature : 0.0f; }

float kvt_sampler_topp(const kvt_sampler *s) { return s ? s->topp : 0.0f; }

uint64_t kvt_sampler_state_after(uint64_t seed, uint64_t draws)
{
    uint64_t st = seed;
    for (uint64_t i = 0; i < draws; i++)
        (void)kvt_rng_u32(&st);
    return st;
}

int kvt_sampler_restore(kvt_sampler *s, uint64_t seed, uint64_t rng_state, uint64_t draws)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "sampler restore: NULL sampler");
    if (seed == 0 || rng_state == 0)
        return kvt__fail(KVT_EINVAL, "sampler restore: seed or generator state 0 would never change");
    s->seed = seed;
    s->rng_state = rng_state;
    s->draws = draws;
    return 0;
}

int32_t kvt_sampler_sample(kvt_sampler *s, float *logits)
{
    if (s->temperature == 0.0f)
        return kvt_sample_argmax(logits, s->vocab_size);
    for (int32_t q = 0; q < s->vocab_size; q++)
        logits[q] /= s->temperature;
    kvt_softmax(logits, s->vocab_size);
    float coin = kvt_rng_f32(&s->rng_state);
    s->draws++;
    if (s->topp <= 0.0f || s->topp >= 1.0f)
        return kvt_sample_mult(logits, s->vocab_size, coin);
    return kvt_sample_topp(logits, s->vocab_size, s->topp, s->probindex, coin);
}
