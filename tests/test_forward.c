/*
 * test_forward.c: the forward pass (engine/forward.c). Batched prefill must
 * equal token-by-token decode (logits within 1e-4 relative to the largest
 * logit), prefill on caches already holding a prefix must equal a full
 * prefill, on stories260K and on synthetic plain, sliding-window (short
 * window, so the ring wraps) and recurrent models; greedy decoding of
 * stories260K from BOS must give the reference ids. Token sequences are
 * random: the seed is printed and read from KVT_TEST_SEED.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_seed.h"

#include "model.h"

#include <math.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[256];
static uint64_t g_seed;

static int setup(void **state)
{
    (void)state;
    g_seed = test_seed("test_forward");
    snprintf(g_dir, sizeof g_dir, "/tmp/kvt_test_forward_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void random_tokens(int32_t *t, int n, int vocab, uint64_t salt)
{
    uint64_t s = g_seed ^ (salt * 0x2545F4914F6CDD1DULL);
    for (int i = 0; i < n; i++)
        t[i] = (int32_t)(rng_next(&s) % (uint64_t)vocab);
}

/* max |a - b| / max |b| over n floats. */
static double rel_err(const float *a, const float *b, int n)
{
    double md = 0, mb = 1e-30;
    for (int i = 0; i < n; i++) {
        assert_true(isfinite(a[i]) && isfinite(b[i]));
        md = fmax(md, fabs((double)a[i] - b[i]));
        mb = fmax(mb, fabs((double)b[i]));
    }
    return md / mb;
}

static kvt_model *load_or_skip_stories(void)
{
    const char *shared = getenv("KVT_SHARED_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/data/models/stories260K.bin", shared ? shared : "");
    if (!shared || access(path, R_OK) != 0) {
        print_message("skip: %s not found (KVT_SHARED_DIR unset or ../shared absent)\n", path);
        return NULL;
    }
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    return m;
}

enum { SHAPE_PLAIN, SHAPE_WINDOW, SHAPE_RECURRENT, SHAPE_HYBRID_SEP };

static kvt_model *synth_model(int shape)
{
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 48;
    p.hidden_dim = 80;
    p.n_layers = 3;
    p.n_heads = 6;
    p.n_kv_heads = 2;
    p.vocab_size = 97;
    p.seq_len = 600;
    p.seed = 1234 + (uint64_t)shape;
    switch (shape) {
    case SHAPE_WINDOW: /* every layer a short window: wraps many times */
        p.sliding_window = 7;
        for (int l = 0; l < 3; l++)
            p.layer_kind[l] = KVT_LAYER_WINDOW;
        break;
    case SHAPE_RECURRENT:
        p.layer_kind[0] = KVT_LAYER_RECURRENT;
        p.layer_kind[2] = KVT_LAYER_RECURRENT;
        break;
    case SHAPE_HYBRID_SEP:
        p.separate_classifier = 1;
        p.sliding_window = 5;
        p.layer_kind[0] = KVT_LAYER_WINDOW;
        p.layer_kind[1] = KVT_LAYER_RECURRENT;
        break;
    default:
        break;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/shape%d.bin", g_dir, shape);
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    return m;
}

/* prefill(n) == decode x n, and prefill(p) + prefill(n - p) on the same
 * caches == full prefill, with blocks of `block` tokens. */
static void check_equivalence(kvt_model *m, int n, int p, int32_t block, uint64_t salt)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size;
    int32_t *tok = malloc(sizeof *tok * (size_t)n);
    float *la = malloc(sizeof(float) * (size_t)V), *lb = malloc(sizeof(float) * (size_t)V);
    float *lc = malloc(sizeof(float) * (size_t)V);
    kvt_cache **ca = calloc((size_t)L, sizeof *ca), **cb = calloc((size_t)L, sizeof *cb);
    kvt_cache **cc = calloc((size_t)L, sizeof *cc);
    random_tokens(tok, n, V, salt);

    assert_int_equal(kvt_model_new_caches(m, block, ca), 0);
    assert_int_equal(kvt_model_prefill(m, ca, tok, n, la), 0);
    for (int l = 0; l < L; l++)
        assert_int_equal(kvt_cache_offset(ca[l]), n);

    assert_int_equal(kvt_model_new_caches(m, block, cb), 0);
    for (int i = 0; i < n; i++)
        assert_int_equal(kvt_model_decode(m, cb, tok[i], lb), 0);
    double e1 = rel_err(la, lb, V);
    int decode_argmax = 0;
    for (int i = 1; i < V; i++)
        decode_argmax = lb[i] > lb[decode_argmax] ? i : decode_argmax;

    /* a reused prefix: caches holding p tokens, cloned (zero-copy, as the
     * prompt cache lends them), then only the rest prefilled on the clone;
     * the donor, continued afterwards, must not see the clone's writes */
    kvt_cache **cd = calloc((size_t)L, sizeof *cd);
    assert_int_equal(kvt_model_new_caches(m, block, cc), 0);
    assert_int_equal(kvt_model_prefill(m, cc, tok, p, NULL), 0);
    assert_int_equal(kvt_caches_clone(cc, L, cd), 0);
    assert_int_equal(kvt_model_prefill(m, cd, tok + p, n - p, lc), 0);
    double e2 = rel_err(lc, la, V);
    assert_int_equal(kvt_model_prefill(m, cc, tok + p, n - p, lb), 0);
    double e3 = rel_err(lb, la, V);
    kvt_caches_dispose(cd, L);
    free(cd);
    print_message("  n %d prefix %d block %d: prefill vs decode %.3g, prefix+rest vs full %.3g (donor %.3g)\n", n,
                  p, block, e1, e2, e3);
    assert_true(e1 <= 1e-4);
    assert_true(e2 <= 1e-4);
    assert_true(e3 <= 1e-4);
    /* the argmax agrees too (what greedy decoding sees) */
    int aa = 0;
    for (int i = 1; i < V; i++)
        aa = la[i] > la[aa] ? i : aa;
    assert_int_equal(aa, decode_argmax);
    kvt_caches_dispose(ca, L);
    kvt_caches_dispose(cb, L);
    kvt_caches_dispose(cc, L);
    free(ca);
    free(cb);
    free(cc);
    free(tok);
    free(la);
    free(lb);
    free(lc);
}

static void test_stories_prefill_equals_decode(void **state)
{
    (void)state;
    kvt_model *m = load_or_skip_stories();
    if (!m)
        skip();
    check_equivalence(m, 300, 137, 16, 1); /* two chunks, many blocks */
    check_equivalence(m, 40, 1, 256, 2);
    kvt_model_free(m);
}

static void test_synth_plain(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_PLAIN);
    check_equivalence(m, 270, 100, 32, 3);
    check_equivalence(m, 5, 4, 1, 4);
    kvt_model_free(m);
}

static void test_synth_window_wraps(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_WINDOW);
    check_equivalence(m, 60, 23, 8, 5);
    check_equivalence(m, 3, 1, 8, 6); /* shorter than the window */
    kvt_model_free(m);
}

static void test_synth_recurrent(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_RECURRENT);
    check_equivalence(m, 280, 257, 16, 7);
    kvt_model_free(m);
}

static void test_synth_hybrid_separate_classifier(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_HYBRID_SEP);
    check_equivalence(m, 50, 9, 4, 8);
    kvt_model_free(m);
}

/* A window of W means the logits depend on the last W tokens of context
 * only (at layer 0; deeper layers see further, so use one window layer). */
static void test_window_forgets(void **state)
{
    (void)state;
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 32, p.hidden_dim = 48, p.n_layers = 1, p.n_heads = 4, p.n_kv_heads = 4, p.vocab_size = 40;
    p.seq_len = 64, p.seed = 9, p.sliding_window = 4, p.layer_kind[0] = KVT_LAYER_WINDOW;
    char path[512];
    snprintf(path, sizeof path, "%s/win1.bin", g_dir);
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    int32_t a[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, b[10] = {30, 31, 32, 33, 34, 6, 7, 8, 9, 10};
    float la[40], lb[40];
    kvt_cache *ca[1], *cb[1];
    assert_int_equal(kvt_model_new_caches(m, 16, ca), 0);
    assert_int_equal(kvt_model_new_caches(m, 16, cb), 0);
    assert_int_equal(kvt_model_prefill(m, ca, a, 10, la), 0);
    assert_int_equal(kvt_model_prefill(m, cb, b, 10, lb), 0);
    /* RoPE is relative, the last 4 tokens and positions match: equal logits */
    assert_true(rel_err(la, lb, 40) < 1e-5);
    kvt_caches_dispose(ca, 1);
    kvt_caches_dispose(cb, 1);
    /* while a window of 6 sees token 4 (a[4] = 5 vs b[4] = 34) and differs */
    kvt_model_free(m);
    p.sliding_window = 6;
    assert_int_equal(kvt_model_synth(&p, path), 0);
    assert_int_equal(kvt_model_load(path, &m), 0);
    assert_int_equal(kvt_model_new_caches(m, 16, ca), 0);
    assert_int_equal(kvt_model_new_caches(m, 16, cb), 0);
    assert_int_equal(kvt_model_prefill(m, ca, a, 10, la), 0);
    assert_int_equal(kvt_model_prefill(m, cb, b, 10, lb), 0);
    assert_true(rel_err(la, lb, 40) > 1e-3);
    kvt_caches_dispose(ca, 1);
    kvt_caches_dispose(cb, 1);
    kvt_model_free(m);
}

static const int32_t k_stories_greedy[16] = {403, 407, 261, 378, 432, 383, 286, 261,
                                             376, 298, 315, 421, 395, 317, 426, 338};

static int argmax(const float *v, int n)
{
    int a = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[a])
            a = i;
    return a;
}

static void test_stories_greedy_from_bos(void **state)
{
    (void)state;
    kvt_model *m = load_or_skip_stories();
    if (!m)
        skip();
    kvt_cache *c[5];
    float logits[512];
    assert_int_equal(kvt_model_new_caches(m, 256, c), 0);
    int32_t tok = 1; /* BOS */
    for (int i = 0; i < 16; i++) {
        assert_int_equal(kvt_model_decode(m, c, tok, logits), 0);
        tok = argmax(logits, 512);
        assert_int_equal(tok, k_stories_greedy[i]);
    }
    kvt_caches_dispose(c, 5);
    /* the same through one prefill of BOS + the first 15 ids */
    int32_t seq[16] = {1};
    memcpy(seq + 1, k_stories_greedy, 15 * sizeof(int32_t));
    assert_int_equal(kvt_model_new_caches(m, 4, c), 0);
    assert_int_equal(kvt_model_prefill(m, c, seq, 16, logits), 0);
    assert_int_equal(argmax(logits, 512), k_stories_greedy[15]);
    kvt_caches_dispose(c, 5);
    kvt_model_free(m);
}

static void test_errors_leave_caches_untouched(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_HYBRID_SEP); /* seq_len 600, 3 layers */
    kvt_cache *c[3], *wrong[3];
    float logits[97];
    int32_t *tok = calloc(601, sizeof *tok);
    assert_int_equal(kvt_model_new_caches(m, 16, c), 0);
    assert_int_equal(kvt_model_prefill(m, c, tok, 590, NULL), 0);
    assert_int_equal(kvt_model_prefill(m, c, tok, 11, logits), KVT_ELIMIT);
    assert_non_null(strstr(kvt_last_error(), "590 cached + 11 new tokens = 601 exceeds seq_len 600"));
    assert_int_equal(kvt_cache_offset(c[0]), 590);
    tok[3] = 97;
    assert_int_equal(kvt_model_prefill(m, c, tok, 5, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "token 3 is id 97"));
    tok[3] = -1;
    assert_int_equal(kvt_model_decode(m, c, -1, logits), KVT_EINVAL);
    assert_int_equal(kvt_model_prefill(m, c, tok, 0, logits), KVT_EINVAL);
    assert_int_equal(kvt_model_decode(m, c, 0, NULL), KVT_EINVAL);
    for (int l = 0; l < 3; l++)
        assert_int_equal(kvt_cache_offset(c[l]), 590);
    assert_int_equal(kvt_model_prefill(m, c, tok + 4, 10, logits), 0);
    /* wrong kinds, and layers out of step */
    assert_int_equal(kvt_kv_create(16, 16, &wrong[0]), 0);
    wrong[1] = c[1], wrong[2] = c[2];
    assert_int_equal(kvt_model_decode(m, wrong, 0, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "layer 0 needs a \"rotating\" cache, got \"kv\""));
    kvt_cache_dispose(wrong[0]);
    kvt_cache *fresh[3];
    assert_int_equal(kvt_model_new_caches(m, 16, fresh), 0);
    wrong[0] = fresh[0], wrong[1] = fresh[1], wrong[2] = c[2];
    assert_int_equal(kvt_model_decode(m, wrong, 0, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "layer 2 cache holds 600 tokens, layer 0 holds 0"));
    kvt_caches_dispose(fresh, 3);
    kvt_caches_dispose(c, 3);
    assert_int_equal(kvt_model_new_caches(m, 0, c), KVT_EINVAL);
    assert_null(c[0]);
    free(tok);
    kvt_model_free(m);
}

/* Allocator that fails every allocation after the first `g_budget`. */
static long g_budget;
static void *fail_malloc(size_t n, void *ctx)
{
    (void)ctx;
    return g_budget-- > 0 ? malloc(n ? n : 1) : NULL;
}
static void *fail_realloc(void *p, size_t n, void *ctx)
{
    (void)ctx;
    return g_budget-- > 0 ? realloc(p, n ? n : 1) : NULL;
}
static void plain_free(void *p, void *ctx)
{
    (void)ctx;
    free(p);
}

/* Out of memory at every allocation of load + caches + prefill + decode:
 * a clean KVT_ENOMEM each time (ASan checks nothing leaks), then success. */
static void test_out_of_memory(void **state)
{
    (void)state;
    kvt_model *probe = synth_model(SHAPE_HYBRID_SEP);
    kvt_model_free(probe);
    char path[512];
    snprintf(path, sizeof path, "%s/shape%d.bin", g_dir, SHAPE_HYBRID_SEP);
    int32_t tok[20] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
    float logits[97];
    int failures = 0;
    for (long budget = 0;; budget++) {
        kvt_allocator a = {fail_malloc, fail_realloc, plain_free, NULL};
        g_budget = budget;
        kvt_set_allocator(&a);
        kvt_model *m = NULL;
        kvt_cache *c[3] = {NULL, NULL, NULL};
        int rc = kvt_model_load(path, &m);
        if (rc == 0)
            rc = kvt_model_new_caches(m, 4, c);
        if (rc == 0)
            rc = kvt_model_prefill(m, c, tok, 20, logits);
        if (rc == 0)
            rc = kvt_model_decode(m, c, 3, logits);
        if (c[0])
            kvt_caches_dispose(c, 3);
        kvt_model_free(m);
        kvt_set_allocator(NULL);
        if (rc == 0)
            break;
        assert_int_equal(rc, KVT_ENOMEM);
        failures++;
        assert_true(budget < 10000);
    }
    print_message("  %d allocation failures, each a clean KVT_ENOMEM\n", failures);
    assert_true(failures > 5);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stories_greedy_from_bos),
        cmocka_unit_test(test_stories_prefill_equals_decode),
        cmocka_unit_test(test_synth_plain),
        cmocka_unit_test(test_synth_window_wraps),
        cmocka_unit_test(test_synth_recurrent),
        cmocka_unit_test(test_synth_hybrid_separate_classifier),
        cmocka_unit_test(test_window_forgets),
        cmocka_unit_test(test_errors_leave_caches_untouched),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
