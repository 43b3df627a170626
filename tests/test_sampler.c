/*
 * test_sampler.c: the llama2.c sampler (engine/sampler.h): the xorshift
 * generator against values computed independently, argmax ties, softmax,
 * multinomial and top-p boundaries (the cutoff, the truncation point, tie
 * order), empirical frequencies over many fixed-seed draws, reproducibility
 * per seed, and parameter validation. Every random draw here is seeded with a
 * fixed value, so the frequencies are exact functions of the code.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_rng_values(void **state)
{
    (void)state;
    /* Reference values from a separate Python transcription of llama2.c's
     * random_u32 (xorshift64*). */
    uint64_t s = 42;
    assert_int_equal(kvt_rng_u32(&s), 1456360119u);
    assert_int_equal(kvt_rng_u32(&s), 3359763283u);
    assert_int_equal(kvt_rng_u32(&s), 3393612768u);
    assert_int_equal(s, 142435135655313518ull);
    s = 1;
    float f = kvt_rng_f32(&s);
    assert_true(f == (float)(1206177355u >> 8) / 16777216.0f);
    assert_true(fabsf(f - 0.280835f) < 1e-6f);
    /* Always in [0, 1). */
    s = 7;
    for (int i = 0; i < 100000; i++) {
        float x = kvt_rng_f32(&s);
        assert_true(x >= 0.0f && x < 1.0f);
    }
}

static void test_argmax(void **state)
{
    (void)state;
    float a[] = {1, 3, 3, 2};
    assert_int_equal(kvt_sample_argmax(a, 4), 1); /* first maximum on ties */
    float b[] = {-5, -2, -9};
    assert_int_equal(kvt_sample_argmax(b, 3), 1);
    float c[] = {4};
    assert_int_equal(kvt_sample_argmax(c, 1), 0);
    float d[] = {0, 0, 0, 7};
    assert_int_equal(kvt_sample_argmax(d, 4), 3);
}

static void test_softmax(void **state)
{
    (void)state;
    float x[] = {0.0f, logf(2.0f), 1000.0f - 1000.0f};
    kvt_softmax(x, 3);
    assert_true(fabsf(x[0] - 0.25f) < 1e-6f);
    assert_true(fabsf(x[1] - 0.5f) < 1e-6f);
    assert_true(fabsf(x[2] - 0.25f) < 1e-6f);
    float big[] = {1000.0f, 1000.0f}; /* max-subtracted: no overflow */
    kvt_softmax(big, 2);
    assert_true(big[0] == 0.5f && big[1] == 0.5f);
}

static void test_mult(void **state)
{
    (void)state;
    float p[] = {0.1f, 0.2f, 0.7f};
    assert_int_equal(kvt_sample_mult(p, 3, 0.0f), 0);
    assert_int_equal(kvt_sample_mult(p, 3, 0.05f), 0);
    assert_int_equal(kvt_sample_mult(p, 3, 0.29f), 1);
    assert_int_equal(kvt_sample_mult(p, 3, 0.31f), 2);
    assert_int_equal(kvt_sample_mult(p, 3, 0.9999f), 2);
    float q[] = {0.2f, 0.2f, 0.2f}; /* sums to 0.6: a coin past it gives n - 1 */
    assert_int_equal(kvt_sample_mult(q, 3, 0.9f), 2);
}

static void test_topp_sets(void **state)
{
    (void)state;
    kvt_prob_index scratch[8];
    /* cutoff (1 - 0.7) / 3 = 0.1 drops id 3; cumulative 0.5, 0.8 > 0.7 after
     * id 1: the nucleus is {0, 1}, sampled with r = coin * 0.8. */
    float p[] = {0.5f, 0.3f, 0.15f, 0.05f};
    assert_int_equal(kvt_sample_topp(p, 4, 0.7f, scratch, 0.0f), 0);
    assert_int_equal(kvt_sample_topp(p, 4, 0.7f, scratch, 0.62f), 0); /* r = 0.496 */
    assert_int_equal(kvt_sample_topp(p, 4, 0.7f, scratch, 0.63f), 1); /* r = 0.504 */
    assert_int_equal(kvt_sample_topp(p, 4, 0.7f, scratch, 0.99999f), 1);
    /* Same distribution, shuffled ids: the nucleus follows the probabilities. */
    float s[] = {0.05f, 0.15f, 0.5f, 0.3f};
    assert_int_equal(kvt_sample_topp(s, 4, 0.7f, scratch, 0.1f), 2);
    assert_int_equal(kvt_sample_topp(s, 4, 0.7f, scratch, 0.9f), 3);
    /* topp 0.97: the cutoff 0.03 / 3 = 0.01 keeps id 3; the running sum first
     * exceeds 0.97 at id 3, so a coin near 1 reaches it. */
    assert_int_equal(kvt_sample_topp(p, 4, 0.97f, scratch, 0.99f), 3);
    assert_int_equal(kvt_sample_topp(p, 4, 0.97f, scratch, 0.9f), 2);
    /* Ties sort by ascending id: with four equal probabilities and topp 0.6
     * the nucleus is ids {0, 1, 2} (cumulative 0.75 > 0.6 at the third). */
    float e[] = {0.25f, 0.25f, 0.25f, 0.25f};
    assert_int_equal(kvt_sample_topp(e, 4, 0.6f, scratch, 0.0f), 0);
    assert_int_equal(kvt_sample_topp(e, 4, 0.6f, scratch, 0.5f), 1);  /* r = 0.375 */
    assert_int_equal(kvt_sample_topp(e, 4, 0.6f, scratch, 0.99f), 2); /* never 3 */
    /* A single token: no candidate passes the cutoff (division by 0): argmax. */
    float one[] = {1.0f};
    assert_int_equal(kvt_sample_topp(one, 1, 0.9f, scratch, 0.5f), 0);
}

/* Draws n tokens from fixed logits with a fresh sampler; counts per id. */
static void histogram(const float *logits, int32_t V, float temp, float topp, uint64_t seed, int n, int *counts)
{
    kvt_sampler *s = NULL;
    assert_int_equal(kvt_sampler_create(V, temp, topp, seed, &s), 0);
    float *buf = malloc(sizeof(float) * (size_t)V);
    memset(counts, 0, sizeof(int) * (size_t)V);
    for (int i = 0; i < n; i++) {
        memcpy(buf, logits, sizeof(float) * (size_t)V);
        int32_t t = kvt_sampler_sample(s, buf);
        assert_true(t >= 0 && t < V);
        counts[t]++;
    }
    free(buf);
    kvt_sampler_free(s);
}

static void test_distributions(void **state)
{
    (void)state;
    const int N = 40000;
    int counts[4];
    float lp[] = {logf(0.1f), logf(0.2f), logf(0.7f)};
    /* Plain multinomial (topp 0 and topp 1 both mean "no top-p"). */
    histogram(lp, 3, 1.0f, 0.0f, 1234, N, counts);
    assert_true(fabs(counts[0] / (double)N - 0.1) < 0.01);
    assert_true(fabs(counts[1] / (double)N - 0.2) < 0.01);
    assert_true(fabs(counts[2] / (double)N - 0.7) < 0.01);
    histogram(lp, 3, 1.0f, 1.0f, 99, N, counts);
    assert_true(fabs(counts[0] / (double)N - 0.1) < 0.01);
    /* Temperature 0.5 squares and renormalises: 0.01, 0.04, 0.49 -> /0.54. */
    histogram(lp, 3, 0.5f, 0.0f, 5, N, counts);
    assert_true(fabs(counts[0] / (double)N - 0.01 / 0.54) < 0.01);
    assert_true(fabs(counts[2] / (double)N - 0.49 / 0.54) < 0.01);
    /* Top-p 0.7 over {0.5, 0.3, 0.15, 0.05}: only ids 0 and 1, as 5:3. */
    float lq[] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
    histogram(lq, 4, 1.0f, 0.7f, 77, N, counts);
    assert_int_equal(counts[2], 0);
    assert_int_equal(counts[3], 0);
    assert_true(fabs(counts[0] / (double)N - 0.625) < 0.01);
    /* Greedy never varies. */
    histogram(lq, 4, 0.0f, 0.9f, 3, 100, counts);
    assert_int_equal(counts[0], 100);
}

static void test_reproducible(void **state)
{
    (void)state;
    enum { V = 50, N = 500 };
    float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = sinf((float)i) * 3.0f;
    int32_t a[N], b[N], c[N];
    uint64_t seeds[3] = {2024, 2024, 2025};
    int32_t *out[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        kvt_sampler *s = NULL;
        assert_int_equal(kvt_sampler_create(V, 0.8f, 0.9f, seeds[k], &s), 0);
        assert_int_equal(kvt_sampler_vocab_size(s), V);
        for (int i = 0; i < N; i++) {
            float buf[V];
            memcpy(buf, logits, sizeof buf);
            out[k][i] = kvt_sampler_sample(s, buf);
        }
        kvt_sampler_free(s);
    }
    assert_memory_equal(a, b, sizeof a);
    int differ = 0;
    for (int i = 0; i < N; i++)
        differ += a[i] != c[i];
    assert_true(differ > N / 4);

    /* Greedy leaves the generator alone; sampling advances it once per call. */
    kvt_sampler *s = NULL;
    assert_int_equal(kvt_sampler_create(V, 0.0f, 0.9f, 11, &s), 0);
    float buf[V];
    memcpy(buf, logits, sizeof buf);
    kvt_sampler_sample(s, buf);
    assert_int_equal(kvt_sampler_rng_state(s), 11);
    assert_memory_equal(buf, logits, sizeof buf); /* greedy does not touch the logits */
    kvt_sampler_free(s);
    assert_int_equal(kvt_sampler_create(V, 1.0f, 0.0f, 11, &s), 0);
    kvt_sampler_sample(s, buf);
    uint64_t expect = 11;
    kvt_rng_u32(&expect);
    assert_int_equal(kvt_sampler_rng_state(s), expect);
    kvt_sampler_free(s);
}

static void test_create_errors(void **state)
{
    (void)state;
    kvt_sampler *s = NULL;
    assert_int_equal(kvt_sampler_create(0, 1.0f, 0.9f, 1, &s), KVT_EINVAL);
    assert_int_equal(kvt_sampler_create(10, -0.1f, 0.9f, 1, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "temperature"));
    assert_int_equal(kvt_sampler_create(10, NAN, 0.9f, 1, &s), KVT_EINVAL);
    assert_int_equal(kvt_sampler_create(10, INFINITY, 0.9f, 1, &s), KVT_EINVAL);
    assert_int_equal(kvt_sampler_create(10, 1.0f, NAN, 1, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "top-p"));
    assert_int_equal(kvt_sampler_create(10, 1.0f, 0.9f, 0, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "seed"));
    assert_int_equal(kvt_sampler_create(10, 1.0f, 0.9f, 1, NULL), KVT_EINVAL);
    assert_null(s);
    kvt_sampler_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng_values),  cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_softmax),     cmocka_unit_test(test_mult),
        cmocka_unit_test(test_topp_sets),   cmocka_unit_test(test_distributions),
        cmocka_unit_test(test_reproducible), cmocka_unit_test(test_create_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
