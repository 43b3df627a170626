/*
 * test_long_residency.c (label long): the 30,000-token case of bounded
 * live-cache residency (kvtier/residency.h). A synthetic model with
 * seq-len 32768 (dim 32, 6 layers: small, so a 30,000-token prefill runs in
 * minutes on a loaded machine) prefills a 30,000-token prompt and decodes 128
 * greedy tokens fully resident, then with its full kv blocks bounded to 1/8
 * of the request's KV bytes: the 128 tokens are identical and so are the
 * logits of every step (bit for bit); the full blocks in RAM never passed
 * the bound plus the writes allowed in flight (4 blocks per layer), and the
 * blocks staged for attention never passed the window (8 blocks); every
 * paged block was read back checksummed, none failed.
 * KVT_LONG_RESIDENCY_TOKENS overrides the prompt length (e.g. 4000 for a
 * quick run).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/cache.h"
#include "kvtier/residency.h"
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { GEN = 128, BLOCK = 256 };

static char g_dir[256];

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* Prefill + GEN greedy tokens; logits of every step into lg ((GEN, V)). */
static void run(kvt_model *m, const int32_t *prompt, int64_t n, uint64_t bound, float *lg, int32_t *toks,
                kvt_residency_stats *st)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size;
    kvt_cache *caches[16];
    assert_int_equal(kvt_model_new_caches(m, BLOCK, caches), 0);
    kvt_residency *r = NULL;
    if (bound) {
        kvt_residency_options o = {.max_bytes = bound, .dir = g_dir};
        assert_int_equal(kvt_residency_create(&o, &r), 0);
        for (int l = 0; l < L; l++)
            assert_int_equal(kvt_kv_set_residency(caches[l], r, l), 0);
    }
    uint64_t t0 = kvt_now_ns();
    assert_int_equal(kvt_model_prefill(m, caches, prompt, n, lg), 0);
    uint64_t t1 = kvt_now_ns();
    for (int g = 0; g < GEN; g++) {
        toks[g] = argmax(lg + (size_t)g * V, V);
        if (g + 1 < GEN)
            assert_int_equal(kvt_model_decode(m, caches, toks[g], lg + (size_t)(g + 1) * V), 0);
    }
    uint64_t t2 = kvt_now_ns();
    for (int l = 0; r && l < L; l++)
        assert_int_equal(kvt_kv_residency_settle(caches[l]), 0);
    if (r)
        assert_int_equal(kvt_residency_stats_get(r, st), 0);
    printf("%s: prefill %lld tokens %.1f s (%.0f tok/s), decode %d tokens %.1f s (%.1f tok/s)\n",
           bound ? "bounded" : "fully resident", (long long)n, (double)(t1 - t0) / 1e9,
           (double)n / ((double)(t1 - t0) / 1e9), GEN - 1, (double)(t2 - t1) / 1e9,
           (GEN - 1) / ((double)(t2 - t1) / 1e9));
    kvt_caches_destroy(caches, L);
    kvt_residency_release(r);
}

static void test_30k_tokens_at_one_eighth(void **state)
{
    (void)state;
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 32, p.hidden_dim = 64, p.n_layers = 6, p.n_heads = 2, p.n_kv_heads = 2, p.vocab_size = 259;
    p.seq_len = 32768, p.seed = 7;
    char path[512];
    snprintf(path, sizeof path, "%s/m30k.bin", g_dir);
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    const char *env = getenv("KVT_LONG_RESIDENCY_TOKENS");
    int64_t n = env && atoll(env) > 0 ? atoll(env) : 30000;
    assert_true(n + GEN <= p.seq_len);
    int32_t *prompt = malloc((size_t)n * sizeof *prompt);
    assert_non_null(prompt);
    uint64_t s = 11;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = (int32_t)((s >> 33) % 259u);
    }
    int V = p.vocab_size;
    float *a = malloc((size_t)GEN * V * sizeof *a), *b = malloc((size_t)GEN * V * sizeof *b);
    int32_t ta[GEN], tb[GEN];
    assert_non_null(a);
    assert_non_null(b);
    /* the request's KV: 6 layers of whole blocks of (n + GEN - 1) tokens */
    size_t row = kvt_model_kv_row_bytes(m), blk = row * BLOCK;
    uint64_t kv = (uint64_t)((n + GEN - 1 + BLOCK - 1) / BLOCK) * blk * 6;
    kvt_residency_stats st;
    memset(&st, 0, sizeof st);
    run(m, prompt, n, 0, a, ta, &st);
    run(m, prompt, n, kv / 8, b, tb, &st);
    printf("KV %.1f MB, bound %.1f MB: paged out %llu blocks, in %llu blocks (%.1f GB), read-ahead hits %llu, "
           "stall %.1f s, peak full blocks in RAM %.2f MB, peak staged %.2f MB\n",
           kv / 1e6, kv / 8 / 1e6, (unsigned long long)st.blocks_out, (unsigned long long)st.blocks_in,
           st.bytes_in / 1e9, (unsigned long long)st.readahead_hits, (double)st.stall_ns / 1e9,
           st.peak_resident_bytes / 1e6, st.peak_staged_bytes / 1e6);
    assert_memory_equal(ta, tb, sizeof ta);
    assert_memory_equal(a, b, (size_t)GEN * V * sizeof *a);
    assert_true(st.peak_resident_bytes <= kv / 8 + 6 * 4 * blk);
    assert_true(st.blocks_out > 0);
    assert_int_equal(st.read_failures, 0);
    assert_int_equal(st.write_failures, 0);
    /* attention walks each layer's blocks through a window of 8: the staging
     * (read-ahead included) is the window, not a layer's share of the context */
    assert_true(st.peak_staged_bytes <= 8 * blk);
    printf("peak full blocks in RAM %.2f MB = bound %.2f MB + window %.2f MB at most (%.2f MB)\n",
           (st.peak_resident_bytes + st.peak_staged_bytes) / 1e6, kv / 8 / 1e6, 8 * blk / 1e6,
           (kv / 8 + 6 * 4 * blk + 8 * blk) / 1e6);
    free(a);
    free(b);
    free(prompt);
    kvt_model_free(m);
}

static int setup(void **state)
{
    (void)state;
    const char *t = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/kvt_long_res_XXXXXX", t && *t ? t : "/var/tmp");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_30k_tokens_at_one_eighth),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
