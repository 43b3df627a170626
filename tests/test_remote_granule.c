/*
 * test_remote_granule.c: an f16, bf16 or q8 entry (the "qkvc" kind: sealed
 * blocks in the scheme, the open block in f32) through the remote tier
 * alone, against a real redis-server on loopback. The engine computes a
 * 283-token entry in blocks of 16 (272 tokens sealed, 11 in the open block)
 * and the remote tier stores it; the tier is closed and a new one opened on
 * the same server (a restart with nothing in RAM and no SSD tier), and a
 * prompt cache over it lends
 *  - to a prompt that parts from the entry at token 200: 192 tokens (the
 *    largest block boundary of the shared prefix, 12 sealed blocks), rebuilt
 *    from the block records alone;
 *  - to one that parts at 278 (inside the open block): 278, the entry record
 *    cut inside its open block;
 *  - to one that extends the whole entry: 283;
 * and each time the rest of the prompt fed on the lent caches gives the
 * uncached run's logits and states, bit for bit (both on the decode path,
 * kvt_model_forward_batch, invariant to how a prompt is split). The records keep what
 * makes the block boundaries reachable: the identity's layout says its
 * blocks rebuild a prefix at block ends only ("standalone=2"), each block
 * record's layers are reachable at the block's end only (min_offset), and
 * the entry record is marked as cut anywhere in its open block (the
 * trimmable flag). Skips (saying why) when redis-server is not installed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvtier/cache.h"
#include "kvtier/prompt_cache.h"
#include "kvtier/remote.h"
#include "model.h"
#include "redis_util.h"
#include "test_rng.h"
#include "test_seed.h"

enum { NA = 283, BT = 16, V = 50, NL = 2 };

static redis_srv g_srv;
static uint64_t g_seed;

static kvt_model *synth_model(char *dir, char *path, size_t cap)
{
    assert_non_null(mkdtemp(dir));
    snprintf(path, cap, "%s/m.bin", dir);
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 64, p.hidden_dim = 96, p.n_layers = NL, p.n_heads = 4, p.n_kv_heads = 2, p.vocab_size = V;
    p.seq_len = 512, p.seed = 11;
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    return m;
}

/* Feeds tokens[0..n) to caches through kvt_model_forward_batch, in passes
 * as long as kvt_model_pass_rows allows (KVT_MODEL_CHUNK rows, across block
 * boundaries of sealed K/V too): the decode path, whose logits and state do not depend on how
 * the tokens are split or whether a prefix came from a cache (bit for bit;
 * kvt_model_prefill's GEMM agrees only within float tolerance). logits:
 * NULL or V floats after the last token. */
static void feed(kvt_model *m, kvt_cache **caches, const int32_t *tokens, int64_t n, float *logits)
{
    float lg[V];
    for (int64_t t = 0; t < n;) {
        int64_t c = kvt_model_pass_rows(m, caches);
        int32_t cnt = (int32_t)(c < n - t ? c : n - t);
        kvt_cache **const cs[1] = {caches};
        assert_int_equal(kvt_model_forward_batch(m, 1, cs, &cnt, tokens + t, lg), 0);
        t += cnt;
    }
    if (logits)
        memcpy(logits, lg, sizeof lg);
}

static kvt_remote *open_tier(const kvt_store_identity *id)
{
    kvt_remote_options o = {.lookup_timeout_ms = 2000, .io_timeout_ms = 5000, .restore_timeout_ms = 20000,
                            .quiet = 1};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(g_srv.url, id, &o, &r), 0);
    return r;
}

static void states_equal(kvt_cache *a, kvt_cache *b)
{
    kvt_cache_state x, y;
    assert_int_equal(kvt_cache_encode(a, &x), 0);
    assert_int_equal(kvt_cache_encode(b, &y), 0);
    assert_string_equal(x.kind, y.kind);
    assert_int_equal(x.offset, y.offset);
    assert_int_equal(x.min_offset, y.min_offset);
    assert_int_equal(x.n_tensors, y.n_tensors);
    for (int32_t t = 0; t < x.n_tensors; t++) {
        assert_string_equal(x.tensors[t].name, y.tensors[t].name);
        assert_int_equal(x.tensors[t].bytes, y.tensors[t].bytes);
        assert_memory_equal(x.tensors[t].data, y.tensors[t].data, x.tensors[t].bytes);
    }
    kvt_cache_state_clear(&x);
    kvt_cache_state_clear(&y);
}

/* After a restart (a new tier on the same Redis, an empty prompt cache over
 * it), prompt tb (nb tokens) is lent `want` tokens from Redis, and the rest
 * fed on the lent caches equals tb fed on fresh caches. */
static void lend_after_restart(kvt_model *m, const kvt_store_identity *id, const int32_t *tb, int64_t nb,
                               int64_t want, const char *what)
{
    kvt_remote *r = open_tier(id);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_prompt_cache_config cfg = {.max_bytes = (size_t)64 << 20, .block_tokens = BT, .cold = &t};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    kvt_hit hit;
    memset(&hit, 0, sizeof hit);
    assert_int_equal(kvt_prompt_cache_lend(pc, tb, nb, "", NULL, &hit), 0);
    kvt_remote_stats st;
    assert_int_equal(kvt_remote_stats_get(r, &st), 0);
    print_message("  %s: %s: lent %lld of %lld tokens (remote restores %llu)\n",
                  kvt_kv_scheme_name(kvt_model_kv_scheme(m)), what, (long long)hit.prefix_len, (long long)nb,
                  (unsigned long long)st.restores);
    assert_int_equal(hit.prefix_len, want);
    assert_int_equal(st.restores, 1); /* from Redis: RAM held nothing */
    float lc[V], lr[V];
    kvt_cache *ref[NL];
    feed(m, hit.entry.caches, tb + want, nb - want, lc);
    assert_int_equal(kvt_model_new_caches(m, BT, ref), 0);
    feed(m, ref, tb, nb, lr);
    assert_memory_equal(lc, lr, sizeof lc);
    for (int l = 0; l < NL; l++)
        states_equal(hit.entry.caches[l], ref[l]);
    kvt_caches_destroy(ref, NL);
    kvt_hit_clear(&hit);
    kvt_prompt_cache_destroy(pc);
    assert_int_equal(kvt_remote_close(r), 0);
}

static void test_granule_after_restart(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvt_test_remote_granule_XXXXXX", path[256];
    kvt_model *m = synth_model(dir, path, sizeof path);
    int32_t ta[NA], t200[300], t278[290], tall[NA + 10];
    uint64_t s = g_seed;
    for (int i = 0; i < NA; i++)
        ta[i] = 1 + (int32_t)rng_below(&s, V - 1);
    memcpy(t200, ta, 200 * sizeof *ta);
    for (int i = 200; i < 300; i++)
        t200[i] = 1 + (int32_t)rng_below(&s, V - 1);
    t200[200] = ta[200] % (V - 1) + 1; /* parts at 200: inside sealed block 12 */
    memcpy(t278, ta, 278 * sizeof *ta);
    for (int i = 278; i < 290; i++)
        t278[i] = 1 + (int32_t)rng_below(&s, V - 1);
    t278[278] = ta[278] % (V - 1) + 1; /* parts at 278: inside the open block [272, 283) */
    memcpy(tall, ta, sizeof ta);
    for (int i = NA; i < NA + 10; i++)
        tall[i] = 1 + (int32_t)rng_below(&s, V - 1);
    const kvt_kv_scheme schemes[] = {KVT_KV_F16, KVT_KV_BF16, KVT_KV_Q8};
    for (size_t si = 0; si < sizeof schemes / sizeof *schemes; si++) {
        assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "FLUSHALL"), 0);
        assert_int_equal(kvt_model_set_kv_scheme(m, schemes[si]), 0);
        const kvt_store_identity id = {"remote-granule", kvt_kv_scheme_name(schemes[si]), "tok"};
        /* host A: the engine's entry, stored in Redis */
        kvt_remote *r = open_tier(&id);
        kvt_cold_tier t;
        kvt_remote_cold_tier(r, &t);
        kvt_cache *ca[NL];
        assert_int_equal(kvt_model_new_caches(m, BT, ca), 0);
        assert_string_equal(kvt_cache_kind(ca[0]), "qkvc");
        feed(m, ca, ta, NA, NULL);
        int64_t lo = -1;
        kvt_cache_range(ca[0], &lo, NULL);
        assert_int_equal(lo, NA / BT * BT); /* 272 sealed */
        kvt_entry e = {.ns = "", .tokens = ta, .n_tokens = NA, .caches = ca, .n_caches = NL};
        assert_int_equal(t.store(t.self, &e), 0);
        kvt_caches_destroy(ca, NL);
        assert_int_equal(kvt_remote_close(r), 0);
        /* what Redis holds: the layout and a block record's layers */
        char prefix[128], key[192], val[128];
        assert_int_equal(kvt_remote_key_prefix(&id, prefix, sizeof prefix), 0);
        snprintf(key, sizeof key, "%slayout", prefix);
        size_t vl = 0;
        assert_int_equal(redis_cmd(g_srv.port, val, sizeof val - 1, &vl, "GET %s", key), 0);
        val[vl < sizeof val ? vl : sizeof val - 1] = '\0';
        print_message("  %s: layout \"%s\", %lld block records\n", kvt_kv_scheme_name(schemes[si]), val,
                      redis_count_keys(g_srv.port, "kvt:*:b*"));
        assert_non_null(strstr(val, "block=16 standalone=2"));
        assert_int_equal(redis_count_keys(g_srv.port, "kvt:*:b*"), NA / BT);
        /* host B, after a restart: Redis alone */
        lend_after_restart(m, &id, t200, 300, 192, "parts at 200");
        lend_after_restart(m, &id, t278, 290, 278, "parts at 278");
        lend_after_restart(m, &id, tall, NA + 10, NA, "extends it");
    }
    kvt_model_free(m);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    if (!redis_available("test_remote_granule"))
        return 0;
    g_seed = test_seed("test_remote_granule");
    if (redis_start(&g_srv, 64, NULL) != 0) {
        fprintf(stderr, "test_remote_granule: redis-server did not start\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_granule_after_restart),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    redis_stop(&g_srv);
    return failed ? 1 : 0;
}
