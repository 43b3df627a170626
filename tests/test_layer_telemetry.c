/*
 * test_layer_telemetry.c: the service's per-layer residency telemetry
 * (kvt_service_layer_stats, the report's "layers"): RAM bytes per layer are
 * each layer's own (a kv layer, a sliding window, a recurrent state), blocks
 * two entries share are counted once and reported as shared (kv layer
 * only), write-behind to the cold tier and restores from it are counted per
 * layer in that layer's bytes, the entry counters (promotions, evictions)
 * reach every layer, and a 70-layer model reports 64 layers one by one and
 * one overflow group "64-69". Over an SSD store, each layer's ssd_bytes is
 * what the store's index holds of it (a shared block file once), down when
 * an entry leaves the index, and the same figures come back from the
 * startup scan of a reopened store.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "kvtier/service.h"
#include "kvtier/store.h"
#include "mem_tier.h"

#include <stdlib.h>
#include <unistd.h>

#define D 4
#define W 8
#define REC 64
#define B 16

static int new_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    int rc = kvt_kv_create(D, B, &c[0]);
    if (!rc)
        rc = kvt_rotating_create(D, W, 0, &c[1]);
    if (!rc)
        rc = kvt_recurrent_create(REC, &c[2]);
    return rc;
}

static int32_t toks[64];

/* Admits, acquires, runs prompt[reused..n) and publishes toks[0..n). */
static int64_t run(kvt_service *s, int64_t n)
{
    kvt_request r = {.prompt = toks, .n_prompt = n, .max_tokens = 1};
    kvt_admission *a = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a), 0);
    kvt_state st;
    assert_int_equal(kvt_service_acquire(s, a, &st), 0);
    int64_t reused = st.reused_tokens;
    for (int64_t t = reused; t < n; t++) {
        float k[D], v[D];
        for (int j = 0; j < D; j++)
            k[j] = v[j] = (float)(toks[t] + j);
        const void *in[2] = {k, v};
        assert_int_equal(kvt_cache_append(st.caches[0], 1, in), 0);
        assert_int_equal(kvt_cache_append(st.caches[1], 1, in), 0);
        unsigned char rs[REC];
        memset(rs, (int)(t & 0xff), sizeof rs);
        const void *rin[1] = {rs};
        assert_int_equal(kvt_cache_append(st.caches[2], 1, rin), 0);
    }
    assert_int_equal(kvt_service_publish(s, a, toks, n, &st), 0);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    return reused;
}

static void test_layers_ram_and_cold(void **state)
{
    (void)state;
    for (int i = 0; i < 64; i++)
        toks[i] = 100 + i;
    mem_tier *mt = NULL;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_service_config cfg = {.n_layers = 3, .max_positions = 1000, .new_caches = new_caches,
                              .prompt_cache_bytes = 1 << 20, .block_tokens = B, .cold = mem_tier_iface(mt)};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    assert_int_equal(kvt_service_layer_groups(s), 3);
    kvt_layer_stats g[3];
    assert_int_equal(kvt_service_layer_stats(s, g, 2), KVT_EINVAL); /* room for too few */
    assert_int_equal(kvt_service_layer_stats(s, g, 3), 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(g[i].first_layer, i);
        assert_int_equal(g[i].ram_bytes, 0);
    }

    /* one entry of 40 tokens: each layer holds its own bytes */
    run(s, 40);
    assert_int_equal(kvt_service_flush(s), 0);
    assert_int_equal(kvt_service_layer_stats(s, g, 3), 3);
    kvt_service_stats ps;
    kvt_service_get_stats(s, &ps);
    assert_int_equal(g[0].ram_bytes + g[1].ram_bytes + g[2].ram_bytes, ps.bytes);
    assert_true(g[0].ram_bytes >= 40 * 2 * D * 4);          /* kv: every token (whole blocks) */
    assert_true(g[1].ram_bytes >= W * 2 * D * 4);           /* window: W tokens */
    assert_true(g[1].ram_bytes < g[0].ram_bytes);
    assert_true(g[2].ram_bytes >= REC && g[2].ram_bytes < g[1].ram_bytes); /* recurrent: fixed */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(g[i].ram_shared_blocks, 0);
        assert_int_equal(g[i].written, 1); /* write-behind of the kept state, every layer */
        assert_true(g[i].written_bytes > 0);
    }
    assert_true(g[0].written_bytes > g[2].written_bytes);
    uint64_t kv_alone = g[0].ram_bytes;

    /* a longer prompt extending it: its full kv blocks are shared with the
     * first entry, counted once; the other layers share nothing */
    run(s, 56);
    assert_int_equal(kvt_service_layer_stats(s, g, 3), 3);
    kvt_service_get_stats(s, &ps);
    assert_int_equal(g[0].ram_bytes + g[1].ram_bytes + g[2].ram_bytes, ps.bytes);
    printf("two entries: %lld resident, kv %llu bytes, %llu shared kv blocks\n", (long long)ps.entries,
           (unsigned long long)g[0].ram_bytes, (unsigned long long)g[0].ram_shared_blocks);
    /* untrimmable (the recurrent layer): the shorter entry stays beside the longer one */
    assert_int_equal(ps.entries, 2);
    assert_int_equal(g[0].ram_shared_blocks, 40 / B); /* its two full blocks, held by both */
    assert_true(g[0].ram_bytes < kv_alone + 56 * 2 * D * 4);
    assert_int_equal(g[1].ram_shared_blocks, 0);
    assert_int_equal(g[2].ram_shared_blocks, 0);

    /* out of RAM, then back from the cold tier: a restore per layer */
    assert_int_equal(kvt_service_flush(s), 0);
    kvt_service_close(s);
    kvt_service_destroy(s);
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    int64_t reused = run(s, 60);
    assert_true(reused > 0);
    assert_int_equal(kvt_service_layer_stats(s, g, 3), 3);
    kvt_service_get_stats(s, &ps);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(g[i].restores, 1);
        assert_true(g[i].restored_bytes > 0);
        assert_int_equal(g[i].promotions, ps.promotions);
        assert_int_equal(g[i].evictions, ps.evictions);
    }
    assert_true(g[0].restored_bytes > g[2].restored_bytes);
    /* the report carries the same figures */
    char *js = NULL;
    assert_int_equal(kvt_service_stats_json(s, &js), 0);
    json_t *doc = json_loads(js, 0, NULL);
    kvt_string_free(js);
    json_t *layers = json_object_get(doc, "layers");
    assert_int_equal(json_array_size(layers), 3);
    assert_string_equal(json_string_value(json_object_get(json_array_get(layers, 2), "layer")), "2");
    assert_int_equal(json_integer_value(json_object_get(json_array_get(layers, 0), "restores")), 1);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(layers, 1), "ram_bytes")), g[1].ram_bytes);
    json_decref(doc);
    kvt_service_close(s);
    kvt_service_destroy(s);
    mem_tier_destroy(mt);
}

/* The SSD tier's per-layer residency through the service's telemetry. */
static void test_layers_ssd_resident(void **state)
{
    (void)state;
    for (int i = 0; i < 64; i++)
        toks[i] = 300 + i;
    char root[] = "/tmp/kvt_test_layer_ssd_XXXXXX";
    assert_non_null(mkdtemp(root));
    kvt_store_identity id = {"layer-telemetry", "cfg", "tok"};
    kvt_store *st = NULL;
    assert_int_equal(kvt_store_open(root, &id, NULL, &st), 0);
    kvt_cold_tier cold;
    kvt_store_cold_tier(st, &cold);
    assert_non_null(cold.layer_bytes);
    kvt_service_config cfg = {.n_layers = 3, .max_positions = 1000, .new_caches = new_caches,
                              .prompt_cache_bytes = 1 << 20, .block_tokens = B, .cold = &cold};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    kvt_layer_stats g[3];
    assert_int_equal(kvt_service_layer_stats(s, g, 3), 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(g[i].ssd_bytes, 0);
    /* 40 tokens, then 48 over the same start (both kept: the recurrent
     * layer is untrimmable); write-behind makes both durable */
    run(s, 40);
    run(s, 48);
    assert_int_equal(kvt_service_flush(s), 0);
    assert_int_equal(kvt_service_layer_stats(s, g, 3), 3);
    uint64_t lb[3];
    assert_int_equal(kvt_store_layer_bytes(st, 3, lb), 0);
    kvt_store_stats ss;
    kvt_store_get_stats(st, &ss);
    printf("ssd per layer: %llu %llu %llu of %llu file bytes, %llu entries %llu blocks\n",
           (unsigned long long)lb[0], (unsigned long long)lb[1], (unsigned long long)lb[2],
           (unsigned long long)ss.bytes, (unsigned long long)ss.entries, (unsigned long long)ss.blocks);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(g[i].ssd_bytes, lb[i]);
        assert_int_equal(g[i].remote_written_bytes, 0); /* no remote tier */
        assert_true(lb[i] > 0);
    }
    assert_int_equal(ss.entries, 2);
    assert_int_equal(ss.blocks, 48 / B);
    /* kv: three 16-token blocks, each file once though both entries use the
     * first two, and the 40-token entry's 8-token tail: K and V, D floats */
    const uint64_t per_token = 2 * D * 4;
    assert_int_equal(lb[0], 48 * per_token + 8 * per_token);
    assert_int_equal(lb[2], 2 * REC); /* one recurrent state per entry */
    assert_true(lb[0] + lb[1] + lb[2] < ss.bytes); /* headers belong to no layer */
    kvt_service_close(s);
    kvt_service_destroy(s);

    /* the 40-token entry leaves the index: its tail and states go, the
     * blocks the 48-token entry uses stay */
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(st, toks, 40, "", &hit), 0);
    assert_int_equal(kvt_store_remove(st, hit.handle), 0);
    uint64_t lb2[3];
    assert_int_equal(kvt_store_layer_bytes(st, 3, lb2), 0);
    assert_int_equal(lb2[0], 48 * per_token);
    assert_int_equal(lb2[2], REC);
    assert_true(lb2[1] > 0 && lb2[1] < lb[1]);
    uint64_t via[3] = {0, 0, 0};
    assert_int_equal(cold.layer_bytes(cold.self, 3, via), KVT_LAYER_BYTES_RESIDENT);
    for (int i = 0; i < 3; i++)
        assert_int_equal(via[i], lb2[i]);
    /* the startup scan of the same files gives the same figures */
    assert_int_equal(kvt_store_close(st), 0);
    assert_int_equal(kvt_store_open(root, &id, NULL, &st), 0);
    uint64_t lb3[4] = {9, 9, 9, 9};
    assert_int_equal(kvt_store_layer_bytes(st, 4, lb3), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(lb3[i], lb2[i]);
    assert_int_equal(lb3[3], 0); /* past the layers the files hold */
    assert_int_equal(kvt_store_layer_bytes(NULL, 3, lb3), KVT_EINVAL);
    assert_int_equal(kvt_store_layer_bytes(st, -1, lb3), KVT_EINVAL);
    assert_int_equal(kvt_store_layer_bytes(st, 3, NULL), KVT_EINVAL);
    assert_int_equal(kvt_store_close(st), 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    assert_int_equal(system(cmd), 0);
}

/* 70 layers: 64 named, then one overflow group summing the rest */
#define MANY 70

static int many_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    for (int i = 0; i < MANY; i++) {
        int rc = kvt_recurrent_create(16 + i, &c[i]);
        if (rc)
            return rc;
    }
    return 0;
}

static void test_overflow_group(void **state)
{
    (void)state;
    kvt_service_config cfg = {.n_layers = MANY, .max_positions = 100, .new_caches = many_caches,
                              .prompt_cache_bytes = 1 << 20};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    assert_int_equal(kvt_service_layer_groups(s), KVT_LAYER_REPORT_LIMIT + 1);
    kvt_request r = {.prompt = toks, .n_prompt = 3, .max_tokens = 1};
    kvt_admission *a = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a), 0);
    kvt_state st;
    assert_int_equal(kvt_service_acquire(s, a, &st), 0);
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < MANY; i++) {
            unsigned char buf[16 + MANY];
            memset(buf, t, sizeof buf);
            const void *in[1] = {buf};
            assert_int_equal(kvt_cache_append(st.caches[i], 1, in), 0);
        }
    assert_int_equal(kvt_service_publish(s, a, toks, 3, &st), 0);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    kvt_layer_stats g[KVT_LAYER_REPORT_LIMIT + 1];
    assert_int_equal(kvt_service_layer_stats(s, g, KVT_LAYER_REPORT_LIMIT + 1), KVT_LAYER_REPORT_LIMIT + 1);
    assert_int_equal(g[63].first_layer, 63);
    assert_int_equal(g[63].last_layer, 63);
    assert_int_equal(g[64].first_layer, 64);
    assert_int_equal(g[64].last_layer, MANY - 1);
    /* the group holds its six layers' bytes: each at least its state */
    uint64_t want = 0;
    for (int i = 64; i < MANY; i++)
        want += 16 + (uint64_t)i;
    assert_true(g[64].ram_bytes >= want);
    assert_true(g[64].ram_bytes > g[63].ram_bytes * 5);
    kvt_service_stats ps;
    kvt_service_get_stats(s, &ps);
    uint64_t sum = 0;
    for (int i = 0; i <= KVT_LAYER_REPORT_LIMIT; i++)
        sum += g[i].ram_bytes;
    assert_int_equal(sum, ps.bytes);
    char *js = NULL;
    assert_int_equal(kvt_service_stats_json(s, &js), 0);
    json_t *doc = json_loads(js, 0, NULL);
    kvt_string_free(js);
    json_t *layers = json_object_get(doc, "layers");
    assert_int_equal(json_array_size(layers), KVT_LAYER_REPORT_LIMIT + 1);
    assert_string_equal(json_string_value(json_object_get(json_array_get(layers, 64), "layer")), "64-69");
    json_decref(doc);
    kvt_service_destroy(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layers_ram_and_cold),
        cmocka_unit_test(test_layers_ssd_resident),
        cmocka_unit_test(test_overflow_group),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
