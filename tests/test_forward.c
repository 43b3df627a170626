/*
 * test_forward.c: the forward pass (engine/forward.c). Batched prefill must
 * equal token-by-token decode (logits within 1e-4 relative to the largest
 * logit), prefill on caches already holding a prefix must equal a full
 * prefill, on stories260K and on synthetic plain, sliding-window (short
 * window, so the ring wraps) and recurrent models; greedy decoding of
 * stories260K from BOS must give the reference ids.
 *
 * Batched decode (kvt_model_decode_batch): batch invariance checked bit for
 * bit (memcmp): for n = 1..9 sequences (every remainder of the
 * kernels' 4- and 2-input tiles) at mixed positions (different prefix
 * lengths, chosen and ordered at random), for several steps, each sequence's
 * logits equal kvt_model_decode's for it alone; on stories260K and the
 * synthetic shapes above, under every kernel set the CPU has, and on a wider
 * model whose products and attention split over the threads. Also: prefill
 * of one token equals decode; the errors (n < 1, NULL, a sequence at
 * seq_len, a bad token, one cache in two sequences) leave every cache
 * untouched; out of memory at each allocation is a clean KVT_ENOMEM.
 *
 * Threads (kvt_model_set_threads): the count is honoured (kvt_model_get_threads
 * and the process's thread count in /proc/self/status), out-of-range counts
 * are refused and change nothing, and batched decode gives bit-identical
 * logits at 1, 2 and 3 threads.
 *
 * Token sequences and batch choices are random: the seed is printed and read
 * from KVT_TEST_SEED.
 *
 * KV storage schemes: KVT_TEST_KV_SCHEME (f32, f16, bf16, q8; ctest runs
 * test_forward_f16, _bf16 and _q8 beside this f32 run) sets the scheme of
 * every model loaded here, so each check above also holds with K/V stored
 * converted (greedy ids from BOS are f32 reference values: checked in f32).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "oom_alloc.h"
#include "test_rng.h"
#include "test_seed.h"

#include "kernels.h"
#include "model.h"

#include <math.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[256];
static uint64_t g_seed;
static kvt_kv_scheme g_scheme = KVT_KV_F32;

/* kvt_model_load, then the scheme under test. */
static int load_model(const char *path, kvt_model **m)
{
    int rc = kvt_model_load(path, m);
    if (rc == 0)
        rc = kvt_model_set_kv_scheme(*m, g_scheme);
    return rc;
}

static int setup(void **state)
{
    (void)state;
    g_seed = test_seed("test_forward");
    const char *scheme = getenv("KVT_TEST_KV_SCHEME");
    if (scheme && *scheme && kvt_kv_scheme_parse(scheme, &g_scheme) != 0)
        return -1;
    print_message("KV storage scheme %s\n", kvt_kv_scheme_name(g_scheme));
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
    assert_int_equal(load_model(path, &m), 0);
    return m;
}

enum { SHAPE_PLAIN, SHAPE_WINDOW, SHAPE_RECURRENT, SHAPE_HYBRID_SEP, SHAPE_WIDE };

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
    case SHAPE_WIDE: /* big enough that products and attention split over the threads */
        p.dim = 256, p.hidden_dim = 768, p.n_layers = 2, p.n_heads = 8, p.n_kv_heads = 4, p.vocab_size = 300;
        p.layer_kind[1] = KVT_LAYER_RECURRENT;
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
    assert_int_equal(load_model(path, &m), 0);
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
    kvt_caches_destroy(cd, L);
    free(cd);
    print_message("  n %d prefix %d block %d: prefill vs decode %.3g, prefix+rest vs full %.3g (donor %.3g)\n", n,
                  p, block, e1, e2, e3);
    /* f32: float tolerance. A converted scheme rounds K/V to its step, and
     * the float-tolerance differences between the two orders of arithmetic
     * can move a value across a rounding boundary (one step, then carried
     * through the deeper layers): the bound scales with the step (f16
     * 2^-11, bf16 2^-8, q8 1/254 of a group's largest value). */
    const double tol = g_scheme == KVT_KV_F32 ? 1e-4 : g_scheme == KVT_KV_F16 ? 4e-3 : 3e-2;
    assert_true(e1 <= tol);
    assert_true(e2 <= tol);
    assert_true(e3 <= tol);
    /* the argmax agrees too (what greedy decoding sees) */
    int aa = 0;
    for (int i = 1; i < V; i++)
        aa = la[i] > la[aa] ? i : aa;
    assert_int_equal(aa, decode_argmax);
    kvt_caches_destroy(ca, L);
    kvt_caches_destroy(cb, L);
    kvt_caches_destroy(cc, L);
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
    assert_int_equal(load_model(path, &m), 0);
    int32_t a[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, b[10] = {30, 31, 32, 33, 34, 6, 7, 8, 9, 10};
    float la[40], lb[40];
    kvt_cache *ca[1], *cb[1];
    assert_int_equal(kvt_model_new_caches(m, 16, ca), 0);
    assert_int_equal(kvt_model_new_caches(m, 16, cb), 0);
    assert_int_equal(kvt_model_prefill(m, ca, a, 10, la), 0);
    assert_int_equal(kvt_model_prefill(m, cb, b, 10, lb), 0);
    /* RoPE is relative, the last 4 tokens and positions match: equal logits */
    assert_true(rel_err(la, lb, 40) < 1e-5);
    kvt_caches_destroy(ca, 1);
    kvt_caches_destroy(cb, 1);
    /* while a window of 6 sees token 4 (a[4] = 5 vs b[4] = 34) and differs */
    kvt_model_free(m);
    p.sliding_window = 6;
    assert_int_equal(kvt_model_synth(&p, path), 0);
    assert_int_equal(load_model(path, &m), 0);
    assert_int_equal(kvt_model_new_caches(m, 16, ca), 0);
    assert_int_equal(kvt_model_new_caches(m, 16, cb), 0);
    assert_int_equal(kvt_model_prefill(m, ca, a, 10, la), 0);
    assert_int_equal(kvt_model_prefill(m, cb, b, 10, lb), 0);
    assert_true(rel_err(la, lb, 40) > 1e-3);
    kvt_caches_destroy(ca, 1);
    kvt_caches_destroy(cb, 1);
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
    if (g_scheme != KVT_KV_F32) {
        print_message("skip: the reference ids are f32's (scheme %s)\n", kvt_kv_scheme_name(g_scheme));
        skip();
    }
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
    kvt_caches_destroy(c, 5);
    /* the same through one prefill of BOS + the first 15 ids */
    int32_t seq[16] = {1};
    memcpy(seq + 1, k_stories_greedy, 15 * sizeof(int32_t));
    assert_int_equal(kvt_model_new_caches(m, 4, c), 0);
    assert_int_equal(kvt_model_prefill(m, c, seq, 16, logits), 0);
    assert_int_equal(argmax(logits, 512), k_stories_greedy[15]);
    kvt_caches_destroy(c, 5);
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
    kvt_cache_destroy(wrong[0]);
    kvt_cache *fresh[3];
    assert_int_equal(kvt_model_new_caches(m, 16, fresh), 0);
    wrong[0] = fresh[0], wrong[1] = fresh[1], wrong[2] = c[2];
    assert_int_equal(kvt_model_decode(m, wrong, 0, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "layer 2 cache holds 600 tokens, layer 0 holds 0"));
    kvt_caches_destroy(fresh, 3);
    kvt_caches_destroy(c, 3);
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
        int rc = load_model(path, &m);
        if (rc == 0)
            rc = kvt_model_new_caches(m, 4, c);
        if (rc == 0)
            rc = kvt_model_prefill(m, c, tok, 20, logits);
        if (rc == 0)
            rc = kvt_model_decode(m, c, 3, logits);
        if (c[0])
            kvt_caches_destroy(c, 3);
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

/* ---- batched decode ------------------------------------------------------- */

#define NSEQ 9

/* NSEQ sequences with prefixes of different lengths (0 = fresh caches, so
 * a batch mixes a sequence's first token with others deep in context); for
 * every n in 1..NSEQ a random subset in random order decodes `steps` greedy
 * steps batched, on clones, while each member decodes alone on its own
 * clones: the logits must be equal bit for bit at every step. */
static void check_batch_invariance(kvt_model *m, int32_t block, const int *prefix, int steps, uint64_t salt)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size;
    uint64_t rs = g_seed ^ (salt * 0x2545F4914F6CDD1DULL);
    kvt_cache *base[NSEQ][KVT_MODEL_MAX_LAYERS];
    int32_t next[NSEQ];
    float *lg = malloc(sizeof(float) * (size_t)V);
    for (int i = 0; i < NSEQ; i++) {
        assert_int_equal(kvt_model_new_caches(m, block, base[i]), 0);
        int32_t *tok = malloc(sizeof *tok * (size_t)(prefix[i] + 1));
        for (int t = 0; t < prefix[i]; t++)
            tok[t] = (int32_t)(rng_next(&rs) % (uint64_t)V);
        if (prefix[i] > 0)
            assert_int_equal(kvt_model_prefill(m, base[i], tok, prefix[i], NULL), 0);
        next[i] = (int32_t)(rng_next(&rs) % (uint64_t)V);
        free(tok);
    }
    float *batch = malloc(sizeof(float) * (size_t)V * NSEQ), *alone = malloc(sizeof(float) * (size_t)V);
    long compared = 0;
    for (int n = 1; n <= NSEQ; n++) {
        int pick[NSEQ];
        for (int i = 0; i < NSEQ; i++)
            pick[i] = i;
        for (int i = NSEQ - 1; i > 0; i--) { /* shuffle, take the first n */
            int j = (int)(rng_next(&rs) % (uint64_t)(i + 1)), t = pick[i];
            pick[i] = pick[j], pick[j] = t;
        }
        kvt_cache *bc[NSEQ][KVT_MODEL_MAX_LAYERS], *ac[NSEQ][KVT_MODEL_MAX_LAYERS];
        kvt_cache **bp[NSEQ];
        int32_t tok_b[NSEQ], tok_a[NSEQ];
        for (int i = 0; i < n; i++) {
            assert_int_equal(kvt_caches_clone(base[pick[i]], L, bc[i]), 0);
            assert_int_equal(kvt_caches_clone(base[pick[i]], L, ac[i]), 0);
            bp[i] = bc[i];
            tok_b[i] = tok_a[i] = next[pick[i]];
        }
        for (int s = 0; s < steps; s++) {
            assert_int_equal(kvt_model_decode_batch(m, n, bp, tok_b, batch), 0);
            for (int i = 0; i < n; i++) {
                assert_int_equal(kvt_model_decode(m, ac[i], tok_a[i], alone), 0);
                const float *row = batch + (size_t)i * V;
                if (memcmp(row, alone, sizeof(float) * (size_t)V) != 0) {
                    int at = 0;
                    while (row[at] == alone[at])
                        at++;
                    fail_msg("n %d step %d: sequence %d (prefix %d) logit %d is %.9g batched, %.9g alone", n, s,
                             pick[i], prefix[pick[i]], at, row[at], alone[at]);
                }
                compared++;
                int a = 0; /* greedy next token, the same on both sides */
                for (int v = 1; v < V; v++)
                    a = alone[v] > alone[a] ? v : a;
                tok_b[i] = tok_a[i] = a;
                assert_int_equal(kvt_cache_offset(bc[i][L - 1]), prefix[pick[i]] + s + 1);
            }
        }
        for (int i = 0; i < n; i++) {
            kvt_caches_destroy(bc[i], L);
            kvt_caches_destroy(ac[i], L);
        }
    }
    print_message("  [%s kernels] block %d: %ld logit rows equal bit for bit (n = 1..%d, %d steps)\n",
                  kvt__kernels_isa(), block, compared, NSEQ, steps);
    for (int i = 0; i < NSEQ; i++)
        kvt_caches_destroy(base[i], L);
    free(batch);
    free(alone);
    free(lg);
}

/* The check under every kernel set this CPU has (the default one last). */
static void check_all_kernels(kvt_model *m, int32_t block, const int *prefix, int steps, uint64_t salt)
{
    static const char *sets[] = {"c", "avx2", "avx512"};
    char best[16];
    snprintf(best, sizeof best, "%s", kvt__kernels_isa());
    for (size_t k = 0; k < sizeof sets / sizeof sets[0]; k++)
        if (strcmp(sets[k], best) != 0 && kvt__kernels_select(sets[k]) == 0)
            check_batch_invariance(m, block, prefix, steps, salt);
    assert_int_equal(kvt__kernels_select(best), 0);
    check_batch_invariance(m, block, prefix, steps, salt);
}

static void test_batch_stories(void **state)
{
    (void)state;
    kvt_model *m = load_or_skip_stories();
    if (!m)
        skip();
    const int prefix[NSEQ] = {0, 1, 9, 33, 64, 100, 257, 400, 31};
    check_all_kernels(m, 16, prefix, 3, 1);
    kvt_model_free(m);
}

static void test_batch_synth_plain(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_PLAIN);
    const int prefix[NSEQ] = {0, 2, 3, 15, 16, 17, 120, 300, 47};
    check_all_kernels(m, 16, prefix, 3, 2);
    check_batch_invariance(m, 1, prefix, 2, 3); /* one token per block */
    kvt_model_free(m);
}

static void test_batch_synth_window(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_WINDOW);
    const int prefix[NSEQ] = {0, 1, 5, 6, 7, 8, 30, 201, 2}; /* before, at and past the window of 7 */
    check_all_kernels(m, 8, prefix, 4, 4);
    kvt_model_free(m);
}

static void test_batch_synth_recurrent(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_RECURRENT);
    const int prefix[NSEQ] = {0, 1, 2, 40, 41, 99, 256, 333, 7};
    check_all_kernels(m, 32, prefix, 3, 5);
    kvt_model_free(m);
}

static void test_batch_synth_hybrid(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_HYBRID_SEP);
    const int prefix[NSEQ] = {0, 4, 5, 6, 50, 51, 170, 390, 3};
    check_all_kernels(m, 4, prefix, 3, 6);
    kvt_model_free(m);
}

static void test_batch_synth_wide_threaded(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_WIDE);
    const int prefix[NSEQ] = {0, 3, 16, 80, 150, 255, 256, 390, 33};
    check_batch_invariance(m, 16, prefix, 2, 7);
    kvt_model_free(m);
}

/* kvt_model_prefill of one token (what a chat does for a prompt's last
 * token) gives decode's logits exactly. */
static void test_prefill_one_is_decode(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_HYBRID_SEP);
    const kvt_model_config *c = kvt_model_get_config(m);
    kvt_cache *a[3], *b[3];
    float la[97], lb[97];
    int32_t tok[12] = {5, 9, 1, 0, 96, 33, 7, 7, 7, 2, 40, 11};
    assert_int_equal(kvt_model_new_caches(m, 4, a), 0);
    assert_int_equal(kvt_model_prefill(m, a, tok, 11, NULL), 0);
    assert_int_equal(kvt_caches_clone(a, c->n_layers, b), 0);
    assert_int_equal(kvt_model_prefill(m, a, tok + 11, 1, la), 0);
    assert_int_equal(kvt_model_decode(m, b, tok[11], lb), 0);
    assert_memory_equal(la, lb, sizeof la);
    kvt_caches_destroy(a, 3);
    kvt_caches_destroy(b, 3);
    kvt_model_free(m);
}

static void assert_offsets(kvt_cache *c[][3], int n, const int64_t *want)
{
    for (int i = 0; i < n; i++)
        for (int l = 0; l < 3; l++)
            assert_int_equal(kvt_cache_offset(c[i][l]), want[i]);
}

static void test_batch_errors(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_HYBRID_SEP); /* seq_len 600, 3 layers, vocab 97 */
    kvt_cache *c[3][3];
    kvt_cache **cp[3] = {c[0], c[1], c[2]};
    int32_t *tok = calloc(600, sizeof *tok);
    int64_t len[3] = {10, 599, 600};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvt_model_new_caches(m, 16, c[i]), 0);
        assert_int_equal(kvt_model_prefill(m, c[i], tok, len[i], NULL), 0);
    }
    float logits[3 * 97];
    int32_t t3[3] = {1, 2, 3};
    assert_int_equal(kvt_model_decode_batch(m, 0, cp, t3, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "0 sequences"));
    assert_int_equal(kvt_model_decode_batch(m, -1, cp, t3, logits), KVT_EINVAL);
    assert_int_equal(kvt_model_decode_batch(NULL, 1, cp, t3, logits), KVT_EINVAL);
    assert_int_equal(kvt_model_decode_batch(m, 1, NULL, t3, logits), KVT_EINVAL);
    assert_int_equal(kvt_model_decode_batch(m, 1, cp, NULL, logits), KVT_EINVAL);
    assert_int_equal(kvt_model_decode_batch(m, 1, cp, t3, NULL), KVT_EINVAL);
    /* sequence 2 is at seq_len: nothing moves, not even sequences 0 and 1 */
    assert_int_equal(kvt_model_decode_batch(m, 3, cp, t3, logits), KVT_ELIMIT);
    assert_non_null(strstr(kvt_last_error(), "sequence 2"));
    assert_non_null(strstr(kvt_last_error(), "600 cached + 1 new tokens = 601 exceeds seq_len 600"));
    assert_offsets(c, 3, len);
    /* a bad token in sequence 1 */
    int32_t bad[2] = {4, 97};
    assert_int_equal(kvt_model_decode_batch(m, 2, cp, bad, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "sequence 1: "));
    assert_non_null(strstr(kvt_last_error(), "id 97"));
    assert_offsets(c, 3, len);
    /* one sequence twice, and one layer's cache shared by two sequences */
    kvt_cache **twice[2] = {c[0], c[0]};
    assert_int_equal(kvt_model_decode_batch(m, 2, twice, t3, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "one cache is passed in two sequences"));
    kvt_cache *mixed[3] = {c[1][0], c[1][1], c[0][2]};
    kvt_cache **shared[2] = {c[0], mixed};
    assert_int_equal(kvt_model_decode_batch(m, 2, shared, t3, logits), KVT_EINVAL);
    assert_offsets(c, 3, len);
    /* a NULL sequence entry, a wrong kind */
    kvt_cache **hole[2] = {c[0], NULL};
    assert_int_equal(kvt_model_decode_batch(m, 2, hole, t3, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "sequence 1"));
    kvt_cache *wrong[3];
    assert_int_equal(kvt_kv_create(16, 16, &wrong[0]), 0);
    wrong[1] = c[1][1], wrong[2] = c[1][2];
    kvt_cache **wk[2] = {c[0], wrong};
    assert_int_equal(kvt_model_decode_batch(m, 2, wk, t3, logits), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "needs a \"rotating\" cache"));
    kvt_cache_destroy(wrong[0]);
    assert_offsets(c, 3, len);
    /* and the two that can still step do */
    assert_int_equal(kvt_model_decode_batch(m, 2, cp, t3, logits), 0);
    int64_t after[3] = {11, 600, 600};
    assert_offsets(c, 3, after);
    for (int i = 0; i < 3; i++)
        kvt_caches_destroy(c[i], 3);
    free(tok);
    kvt_model_free(m);
}

/* More sequences than one group (KVT_MODEL_CHUNK): still each as alone. */
static void test_batch_more_than_a_chunk(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_PLAIN);
    int n = KVT_MODEL_CHUNK + 3, L = 3, V = 97;
    kvt_cache **c = calloc((size_t)n * L, sizeof *c);
    kvt_cache ***cp = calloc((size_t)n, sizeof *cp);
    int32_t *tok = calloc((size_t)n, sizeof *tok);
    float *lg = malloc(sizeof(float) * (size_t)n * V), alone[97];
    for (int i = 0; i < n; i++) {
        cp[i] = c + (size_t)i * L;
        assert_int_equal(kvt_model_new_caches(m, 8, cp[i]), 0);
        int32_t t[3] = {(int32_t)(i % V), 5, 6};
        assert_int_equal(kvt_model_prefill(m, cp[i], t, 1 + i % 3, NULL), 0);
        tok[i] = (int32_t)((i * 7) % V);
    }
    assert_int_equal(kvt_model_decode_batch(m, n, cp, tok, lg), 0);
    for (int i = 0; i < n; i++)
        assert_int_equal(kvt_cache_offset(cp[i][0]), 2 + i % 3);
    /* compare a sample against decode alone on fresh copies of the same state */
    for (int i = 0; i < n; i += 37) {
        kvt_cache *f[3];
        assert_int_equal(kvt_model_new_caches(m, 8, f), 0);
        int32_t t[3] = {(int32_t)(i % V), 5, 6};
        assert_int_equal(kvt_model_prefill(m, f, t, 1 + i % 3, NULL), 0);
        assert_int_equal(kvt_model_decode(m, f, tok[i], alone), 0);
        assert_memory_equal(lg + (size_t)i * V, alone, sizeof alone);
        kvt_caches_destroy(f, 3);
    }
    for (int i = 0; i < n; i++)
        kvt_caches_destroy(cp[i], L);
    free(c);
    free(cp);
    free(tok);
    free(lg);
    kvt_model_free(m);
}

/* Out of memory at each allocation of load + caches + prefill + a batched
 * decode of 3 sequences in turn: a clean KVT_ENOMEM each time (ASan: no
 * leak), until the sequence makes fewer allocations than the one armed. */
static void test_batch_out_of_memory(void **state)
{
    (void)state;
    kvt_model_free(synth_model(SHAPE_HYBRID_SEP));
    char path[512];
    snprintf(path, sizeof path, "%s/shape%d.bin", g_dir, SHAPE_HYBRID_SEP);
    int32_t tok[20] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
    float logits[3 * 97];
    int failures = 0;
    for (long k = 1;; k++) {
        oom_arm(k);
        kvt_model *m = NULL;
        kvt_cache *c[3][3] = {{NULL}};
        kvt_cache **cp[3] = {c[0], c[1], c[2]};
        int rc = load_model(path, &m);
        for (int i = 0; i < 3 && rc == 0; i++)
            if ((rc = kvt_model_new_caches(m, 4, c[i])) == 0)
                rc = kvt_model_prefill(m, c[i], tok, 3 + 7 * i, NULL);
        if (rc == 0)
            rc = kvt_model_decode_batch(m, 3, cp, tok, logits);
        long calls = oom_calls();
        for (int i = 0; i < 3; i++)
            if (c[i][0])
                kvt_caches_destroy(c[i], 3);
        kvt_model_free(m);
        kvt_set_allocator(NULL);
        if (calls < k) {
            assert_int_equal(rc, 0);
            break;
        }
        assert_int_equal(rc, KVT_ENOMEM);
        failures++;
        assert_true(k < 10000);
    }
    print_message("  %d allocation failures, each a clean KVT_ENOMEM\n", failures);
    assert_true(failures > 5);
}

/* Threads of the process, from /proc/self/status; -1 when unreadable. */
static int os_threads(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    int n = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1)
            break;
    fclose(f);
    return n;
}

/* The process's thread count once it settles on `want`, polled for up to 2 s:
 * a joined thread can still be counted by the kernel for a moment after
 * pthread_join returns (its task is reaped after it clears its tid), so a
 * single read may see one thread too many. Returns the last count read. */
static int os_threads_settle(int want)
{
    int n = os_threads();
    for (int i = 0; i < 200 && n != want; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
        n = os_threads();
    }
    return n;
}

/* A baseline thread count: the same value read 3 times 10 ms apart (threads
 * of earlier tests that are still being reaped are gone by then), at most
 * 2 s of tries. */
static int os_threads_baseline(void)
{
    int n = os_threads(), same = 0;
    for (int i = 0; i < 200 && same < 3; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
        int m = os_threads();
        same = m == n ? same + 1 : 0;
        n = m;
    }
    return n;
}

/* kvt_model_set_threads: the pool gets the count asked for (workers really
 * start and stop), bad counts change nothing, and 3 steps of batched decode
 * over 4 sequences at mixed positions give the same logits bit for bit at 1,
 * 2 and 3 threads, on a model wide enough that products and attention split
 * over the threads. */
static void test_set_threads(void **state)
{
    (void)state;
    kvt_model *m = synth_model(SHAPE_WIDE);
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size;
    assert_int_equal(kvt_model_set_threads(m, 1), 0);
    assert_int_equal(kvt_model_get_threads(m), 1);
    int base_os = os_threads_baseline();
    assert_int_equal(kvt_model_set_threads(m, 3), 0);
    assert_int_equal(kvt_model_get_threads(m), 3);
    if (base_os > 0)
        assert_int_equal(os_threads_settle(base_os + 2), base_os + 2);
    assert_int_equal(kvt_model_set_threads(m, 0), KVT_EINVAL);
    assert_int_equal(kvt_model_set_threads(m, -1), KVT_EINVAL);
    assert_int_equal(kvt_model_set_threads(m, KVT_MODEL_MAX_THREADS + 1), KVT_EINVAL);
    assert_int_equal(kvt_model_set_threads(NULL, 2), KVT_EINVAL);
    assert_int_equal(kvt_model_get_threads(m), 3);
    assert_int_equal(kvt_model_get_threads(NULL), 0);
    assert_int_equal(kvt_model_set_threads(m, 1), 0);
    if (base_os > 0)
        assert_int_equal(os_threads_settle(base_os), base_os);

    enum { N = 4, STEPS = 3 };
    const int prefix[N] = {0, 17, 130, 300};
    uint64_t rs = g_seed ^ 0x7468726561647331ULL;
    kvt_cache *base[N][KVT_MODEL_MAX_LAYERS];
    int32_t first[N];
    for (int i = 0; i < N; i++) {
        assert_int_equal(kvt_model_new_caches(m, 16, base[i]), 0);
        int32_t tok[300];
        for (int t = 0; t < prefix[i]; t++)
            tok[t] = (int32_t)(rng_next(&rs) % (uint64_t)V);
        if (prefix[i] > 0)
            assert_int_equal(kvt_model_prefill(m, base[i], tok, prefix[i], NULL), 0);
        first[i] = (int32_t)(rng_next(&rs) % (uint64_t)V);
    }
    size_t row_bytes = sizeof(float) * (size_t)V * N;
    float *ref = malloc(row_bytes * STEPS), *got = malloc(row_bytes);
    assert_non_null(ref);
    assert_non_null(got);
    static const int counts[] = {1, 2, 3};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        assert_int_equal(kvt_model_set_threads(m, counts[k]), 0);
        assert_int_equal(kvt_model_get_threads(m), counts[k]);
        kvt_cache *cc[N][KVT_MODEL_MAX_LAYERS];
        kvt_cache **cp[N];
        int32_t tok[N];
        for (int i = 0; i < N; i++) {
            assert_int_equal(kvt_caches_clone(base[i], L, cc[i]), 0);
            cp[i] = cc[i];
            tok[i] = first[i];
        }
        for (int s = 0; s < STEPS; s++) {
            float *out = k == 0 ? ref + (size_t)s * V * N : got;
            assert_int_equal(kvt_model_decode_batch(m, N, cp, tok, out), 0);
            if (k > 0 && memcmp(out, ref + (size_t)s * V * N, row_bytes) != 0) {
                const float *r = ref + (size_t)s * V * N;
                int at = 0;
                while (out[at] == r[at])
                    at++;
                fail_msg("%d threads, step %d: logit %d of the batch is %.9g, %.9g at 1 thread", counts[k], s, at,
                         out[at], r[at]);
            }
            for (int i = 0; i < N; i++) { /* greedy, so every count follows the same tokens */
                const float *row = out + (size_t)i * V;
                int a = 0;
                for (int v = 1; v < V; v++)
                    a = row[v] > row[a] ? v : a;
                tok[i] = a;
            }
        }
        for (int i = 0; i < N; i++)
            kvt_caches_destroy(cc[i], L);
    }
    print_message("  batched decode bit-identical at 1, 2 and 3 threads (%d sequences, %d steps)\n", N, STEPS);
    for (int i = 0; i < N; i++)
        kvt_caches_destroy(base[i], L);
    free(ref);
    free(got);
    kvt_model_free(m);
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
        cmocka_unit_test(test_batch_stories),
        cmocka_unit_test(test_batch_synth_plain),
        cmocka_unit_test(test_batch_synth_window),
        cmocka_unit_test(test_batch_synth_recurrent),
        cmocka_unit_test(test_batch_synth_hybrid),
        cmocka_unit_test(test_batch_synth_wide_threaded),
        cmocka_unit_test(test_prefill_one_is_decode),
        cmocka_unit_test(test_batch_errors),
        cmocka_unit_test(test_batch_more_than_a_chunk),
        cmocka_unit_test(test_batch_out_of_memory),
        cmocka_unit_test(test_set_threads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
