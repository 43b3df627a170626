/*
 * test_durability.c: write-behind of every kept prefix (prompt_cache.h,
 * service.h) against the in-memory cold tier (tests/support/mem_tier.c),
 * whose "durable" state the test controls (manual spills stay pending until
 * drained, a byte bound on pending spills plays the bounded write queue):
 * a put reaches the tier without any eviction; leaving RAM (eviction,
 * relieve, demote_idle) writes nothing for an entry the tier holds; a full
 * queue is a counted drop and that entry is spilled at eviction; a pending
 * write blocks eviction under the tier policy until it lands; flush makes
 * everything durable; equal-token replacements, re-published prefixes and
 * restored (promoted) prefixes queue nothing; superseded queued writes are
 * withdrawn; several threads putting and evicting lose nothing; the service
 * publishes through write-behind and reports the counters in its JSON.
 * test_durability_store.c runs this file unchanged over the real SSD tier.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <pthread.h>

#include <cmocka.h>

#include "kvtier/prompt_cache.h"
#include "kvtier/service.h"
#include "mem_tier.h"
#include "pc_util.h"
#include "test_seed.h"

#define MB ((size_t)1 << 20)

static kvt_prompt_cache *mk(size_t max_bytes, mem_tier *mt, uint32_t flags)
{
    kvt_prompt_cache_config cfg = {.max_bytes = max_bytes, .block_tokens = 4, .cold = mem_tier_iface(mt),
                                   .flags = flags};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    return pc;
}

static mem_tier *tier_new(void)
{
    mem_tier *mt = NULL;
    assert_int_equal(mem_tier_create(&mt), 0);
    return mt;
}

/* a put reaches the cold tier at once: no eviction, no close, no flush */
static void test_put_reaches_tier_without_eviction(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    kvt_prompt_cache *pc = mk(64 * MB, mt, 0);
    int32_t a[8];
    pcu_seq(a, 8, 10);
    int64_t writes0 = mem_tier_counts_get(mt).writes;
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    assert_true(mem_tier_has(mt, "", a, 8));
    assert_int_equal(mem_tier_counts_get(mt).writes, writes0 + 1);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.write_behind_queued, 1);
    assert_int_equal(s.evictions, 0);
    assert_int_equal(s.spills, 0);
    assert_int_equal(s.entries, 1); /* still resident: the tier got views */
    /* what the tier holds restores to the same state (a new cache over it) */
    kvt_prompt_cache *fresh = mk(64 * MB, mt, 0);
    int32_t p[9];
    pcu_seq(p, 9, 10);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(fresh, p, 9, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 8);
    const float *k, *v;
    int32_t nt;
    assert_int_equal(kvt_kv_block(h.entry.caches[0], 0, &k, &v, &nt), 0);
    assert_true(k[0] == 100.0f); /* token 10 * 10 + dim 0 at position 0 */
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(fresh);
    /* with the write held pending, the tier says so right after put */
    mem_tier_manual_spills(mt, 1);
    int32_t b[8];
    pcu_seq(b, 8, 50);
    assert_int_equal(pcu_put_fresh(pc, "", b, 8, "k", NULL), 0);
    assert_int_equal(mem_tier_iface(mt)->pending(mem_tier_iface(mt)->self, b, 8, ""), 1);
    assert_false(mem_tier_has(mt, "", b, 8));
    assert_int_equal(mem_tier_drain(mt), 1);
    assert_true(mem_tier_has(mt, "", b, 8));
    assert_int_equal(pcu_stats(pc).write_behind_queued, 2);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* evicting (relieving, demoting) what the tier already holds writes nothing */
static int64_t over_left;
static int over_n(void *ctx)
{
    (void)ctx;
    return over_left-- > 0;
}

static void test_leaving_durable_writes_nothing(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    kvt_prompt_cache *pc = mk(64 * MB, mt, KVT_PC_EVICT_ONLY_DURABLE);
    int32_t t[6][8];
    for (int i = 0; i < 6; i++) {
        pcu_seq(t[i], 8, 100 * (i + 1));
        assert_int_equal(pcu_put_fresh(pc, "", t[i], 8, "k", NULL), 0);
    }
    mem_tier_counts c0 = mem_tier_counts_get(mt);
    assert_int_equal(c0.spills, 6);
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 2, &n), 0);
    assert_int_equal(n, 2);
    over_left = 2;
    assert_int_equal(kvt_prompt_cache_relieve(pc, over_n, NULL, &n), 0);
    assert_int_equal(n, 2);
    struct timespec ts = {0, 3000000};
    nanosleep(&ts, NULL);
    assert_int_equal(kvt_prompt_cache_demote_idle(pc, 1, &n), 0);
    assert_int_equal(n, 2);
    mem_tier_counts c1 = mem_tier_counts_get(mt);
    assert_int_equal(c1.writes, c0.writes); /* nothing written again */
    assert_int_equal(c1.spills, c0.spills);
    assert_int_equal(c1.stores, c0.stores);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.entries, 0);
    assert_int_equal(s.durable_evictions, 6);
    assert_int_equal(s.evictions, 2);
    assert_int_equal(s.demotions, 4);
    assert_int_equal(s.spills, 0);
    for (int i = 0; i < 6; i++)
        assert_true(mem_tier_has(mt, "", t[i], 8));
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* a full write-behind queue is a counted drop at put; that entry is spilled
 * when it is evicted, and durable after the flush */
static void test_full_queue_drop_then_spill_at_eviction(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    mem_tier_queue_bytes(mt, 1); /* room for one pending write */
    mem_tier_manual_spills(mt, 1);
    kvt_prompt_cache *pc = mk(64 * MB, mt, 0);
    int32_t a[8], b[8];
    pcu_seq(a, 8, 10);
    pcu_seq(b, 8, 50);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "", b, 8, "k", NULL), 0);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.write_behind_queued, 1);
    assert_int_equal(s.write_behind_dropped, 1);
    assert_int_equal(mem_tier_counts_get(mt).refused_spills, 1);
    assert_int_equal(mem_tier_drain(mt), 1);
    assert_true(mem_tier_has(mt, "", a, 8));
    assert_false(mem_tier_has(mt, "", b, 8));
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 2, &n), 0);
    assert_int_equal(n, 2);
    s = pcu_stats(pc);
    assert_int_equal(s.spills, 1);            /* b, the dropped one */
    assert_int_equal(s.durable_evictions, 1); /* a, durable already */
    assert_int_equal(mem_tier_iface(mt)->flush(mem_tier_iface(mt)->self), 0);
    assert_true(mem_tier_has(mt, "", b, 8));
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* the tier policy: a victim whose write-behind is pending stays (over
 * budget) until the write lands, then leaves without a second write */
static void test_pending_write_blocks_eviction(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    mem_tier_manual_spills(mt, 1);
    kvt_prompt_cache *pc = mk(64 * MB, mt, KVT_PC_EVICT_ONLY_DURABLE);
    int32_t a[8];
    pcu_seq(a, 8, 10);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    assert_int_equal(kvt_prompt_cache_set_max_bytes(pc, 0), 0);
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL)); /* pending: kept */
    assert_int_equal(pcu_stats(pc).evictions, 0);
    assert_int_equal(mem_tier_drain(mt), 1);
    int64_t spills = mem_tier_counts_get(mt).spills;
    assert_int_equal(kvt_prompt_cache_set_max_bytes(pc, 0), 0);
    assert_false(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL));
    assert_int_equal(mem_tier_counts_get(mt).spills, spills);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.evictions, 1);
    assert_int_equal(s.durable_evictions, 1);
    assert_int_equal(s.spills, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* flush makes every queued write durable */
static void test_flush_makes_all_durable(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    mem_tier_manual_spills(mt, 1);
    kvt_prompt_cache *pc = mk(64 * MB, mt, 0);
    int32_t t[5][8];
    for (int i = 0; i < 5; i++) {
        pcu_seq(t[i], 8, 100 * (i + 1));
        assert_int_equal(pcu_put_fresh(pc, "", t[i], 8, i % 2 ? "kr" : "k", NULL), 0);
        assert_false(mem_tier_has(mt, "", t[i], 8));
    }
    const kvt_cold_tier *ct = mem_tier_iface(mt);
    assert_int_equal(ct->flush(ct->self), 0);
    for (int i = 0; i < 5; i++) {
        assert_true(mem_tier_has(mt, "", t[i], 8));
        assert_int_equal(ct->pending(ct->self, t[i], 8, ""), 0);
    }
    assert_int_equal(pcu_stats(pc).write_behind_queued, 5);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* nothing is queued for state the tier already has: an equal-token
 * replacement, the same prefix put by a new process (a restart), and a
 * prefix the tier itself served (promotion) */
static void test_no_useless_writes(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    kvt_prompt_cache *pc = mk(64 * MB, mt, KVT_PC_PROMOTE_RESTORES);
    int32_t a[16];
    pcu_seq(a, 16, 10);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "kr", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "kr", NULL), 0); /* equal tokens: replaced */
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.replacements, 1);
    assert_int_equal(s.write_behind_queued, 1);
    assert_int_equal(s.write_behind_skipped, 1);
    assert_int_equal(mem_tier_counts_get(mt).spills, 1);
    kvt_prompt_cache_destroy(pc);
    /* a restarted process publishes the same prefix again */
    pc = mk(64 * MB, mt, KVT_PC_PROMOTE_RESTORES);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "kr", NULL), 0);
    assert_int_equal(pcu_stats(pc).write_behind_skipped, 1);
    assert_int_equal(mem_tier_counts_get(mt).spills, 1);
    kvt_prompt_cache_destroy(pc);
    /* a restore promoted into RAM is not written back */
    pc = mk(64 * MB, mt, KVT_PC_PROMOTE_RESTORES);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, a, 12, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 8);
    kvt_hit_clear(&h);
    s = pcu_stats(pc);
    assert_int_equal(s.promotions, 1);
    assert_int_equal(s.write_behind_queued, 0);
    assert_int_equal(mem_tier_counts_get(mt).spills, 1);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* a trimmable put supersedes its shorter ancestor: the ancestor's write,
 * still queued, is withdrawn once the longer one is queued behind it */
static void test_superseded_write_withdrawn(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    mem_tier_manual_spills(mt, 1);
    kvt_prompt_cache *pc = mk(64 * MB, mt, 0);
    int32_t a[12];
    pcu_seq(a, 12, 10);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "", a, 12, "k", NULL), 0);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.supersedes, 1);
    assert_int_equal(s.write_behind_queued, 2);
    mem_tier_counts c = mem_tier_counts_get(mt);
#ifndef STORE_TIER_COVERED
    /* the in-memory tier withdraws queued writes */
    assert_int_equal(s.write_behind_withdrawn, 1);
    assert_int_equal(c.withdrawn, 1);
    assert_int_equal(mem_tier_drain(mt), 1); /* only the 12-token entry */
#else
    /* a tier without withdraw writes both: what it withdrew must match */
    assert_int_equal(s.write_behind_withdrawn, (uint64_t)c.withdrawn);
    mem_tier_drain(mt);
#endif
    assert_true(mem_tier_has(mt, "", a, 12));
    /* the superseded prefix is still served, from the longer entry */
    kvt_prompt_cache *fresh = mk(64 * MB, mt, 0);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(fresh, a, 9, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 8);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(fresh);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* the old rule stays available: KVT_PC_NO_WRITE_BEHIND writes only on eviction */
static void test_write_behind_off(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    kvt_prompt_cache *pc = mk(64 * MB, mt, KVT_PC_NO_WRITE_BEHIND);
    int32_t a[8];
    pcu_seq(a, 8, 10);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    assert_false(mem_tier_has(mt, "", a, 8));
    assert_int_equal(mem_tier_counts_get(mt).spills, 0);
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_true(mem_tier_has(mt, "", a, 8));
    assert_int_equal(pcu_stats(pc).spills, 1);
    assert_int_equal(pcu_stats(pc).write_behind_queued, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* ---- several threads: nothing kept is lost ----------------------------------------------- */

#define NTH 4
#define PUTS 60
#define LEN 24
#ifndef STORE_TIER_COVERED
#define WB_MANUAL 1 /* writes held pending, drained by the threads at random */
#else
#define WB_MANUAL 0 /* the store twin's drain is not for several threads at once */
#endif

typedef struct wb_arg {
    kvt_prompt_cache *pc;
    mem_tier *mt;
    int id;
    unsigned seed;
    int64_t kept[PUTS]; /* tokens of conversation c's longest put */
} wb_arg;

static unsigned rnd(unsigned *s, unsigned n)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) % n;
}

/* conversation c of thread id: tokens depend on (id, c) only */
static void conv_tokens(int id, int c, int32_t *t, int64_t n)
{
    pcu_seq(t, n, 1000 * (id * PUTS + c) + 1);
}

static void *wb_worker(void *p)
{
    wb_arg *a = p;
    int32_t t[LEN];
    for (int c = 0; c < PUTS; c++) {
        conv_tokens(a->id, c, t, LEN);
        int64_t n = 4 + rnd(&a->seed, LEN - 4);
        a->kept[c] = n;
        /* a turn: the prompt, then a longer one (supersedes the first) */
        if (pcu_put_fresh(a->pc, "", t, n - 2, "k", NULL) != 0 || pcu_put_fresh(a->pc, "", t, n, "k", NULL) != 0)
            return (void *)1;
        if (rnd(&a->seed, 4) == 0) {
            int64_t ev;
            kvt_prompt_cache_evict(a->pc, 2, &ev);
        }
        if (WB_MANUAL && rnd(&a->seed, 8) == 0)
            mem_tier_drain(a->mt);
    }
    return NULL;
}

static void test_threads_lose_nothing(void **state)
{
    (void)state;
    uint64_t seed = test_seed("test_threads_lose_nothing");
    mem_tier *mt = tier_new();
    mem_tier_manual_spills(mt, WB_MANUAL);
    /* a budget of a few entries: evictions run beside the puts */
    kvt_prompt_cache *pc = mk(4096, mt, KVT_PC_EVICT_ONLY_DURABLE);
    pthread_t th[NTH];
    wb_arg args[NTH];
    for (int i = 0; i < NTH; i++) {
        args[i] = (wb_arg){pc, mt, i, (unsigned)(seed + (uint64_t)i * 7919u), {0}};
        assert_int_equal(pthread_create(&th[i], NULL, wb_worker, &args[i]), 0);
    }
    for (int i = 0; i < NTH; i++) {
        void *r;
        pthread_join(th[i], &r);
        assert_null(r);
    }
    const kvt_cold_tier *ct = mem_tier_iface(mt);
    assert_int_equal(ct->flush(ct->self), 0);
    /* every conversation's longest kept state is served by the tier */
    kvt_prompt_cache *fresh = mk(64 * MB, mt, 0);
    int lost = 0;
    for (int id = 0; id < NTH; id++) {
        for (int c = 0; c < PUTS; c++) {
            int32_t t[LEN + 1];
            conv_tokens(id, c, t, LEN + 1);
            kvt_hit h;
            assert_int_equal(kvt_prompt_cache_lend(fresh, t, LEN + 1, "", NULL, &h), 0);
            if (h.prefix_len < args[id].kept[c])
                lost++;
            kvt_hit_clear(&h);
        }
    }
    kvt_prompt_cache_stats st = pcu_stats(pc);
    printf("  %d puts: write-behind queued %llu, skipped %llu, withdrawn %llu, evictions %llu (durable %llu), "
           "spills %llu, lost %d\n", NTH * PUTS * 2, (unsigned long long)st.write_behind_queued,
           (unsigned long long)st.write_behind_skipped, (unsigned long long)st.write_behind_withdrawn,
           (unsigned long long)st.evictions, (unsigned long long)st.durable_evictions,
           (unsigned long long)st.spills, lost);
    assert_int_equal(lost, 0);
    assert_true(st.write_behind_queued >= (uint64_t)(NTH * PUTS));
    kvt_prompt_cache_destroy(fresh);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* ---- the service: every publish is written behind --------------------------------------- */

static int svc_new_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    return kvt_kv_create(PCU_KV_DIM, PCU_BLOCK, &c[0]);
}

static const kvt_service_layer svc_layer = {.growth = KVT_GROWTH_PER_TOKEN,
                                            .bytes_per_token = 2 * PCU_KV_DIM * sizeof(float),
                                            .block_tokens = PCU_BLOCK};

static void publish_turn(kvt_service *s, const int32_t *t, int64_t n, int64_t want_reused)
{
    kvt_request req = {.prompt = t, .n_prompt = n, .max_tokens = 1, .session = "chat"};
    kvt_admission *adm = NULL;
    assert_int_equal(kvt_service_admit(s, &req, &adm), 0);
    kvt_state st;
    assert_int_equal(kvt_service_acquire(s, adm, &st), 0);
    assert_int_equal(st.reused_tokens, want_reused);
    assert_int_equal(pcu_extend(st.caches, 1, t + st.reused_tokens, n - st.reused_tokens), 0);
    assert_int_equal(kvt_service_publish(s, adm, t, n, &st), 0);
    kvt_service_release(s, adm, 1);
}

static void test_service_publish_writes_behind(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    kvt_service_config cfg = {.n_layers = 1, .layers = &svc_layer, .max_positions = 1000,
                              .new_caches = svc_new_caches, .prompt_cache_bytes = 1u << 30,
                              .block_tokens = PCU_BLOCK, .cold = mem_tier_iface(mt)};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    int32_t t[40];
    pcu_seq(t, 40, 7);
    publish_turn(s, t, 10, 0);
    publish_turn(s, t, 20, 10);
    /* no eviction, no close: the default 1 GB budget keeps everything, and
     * the tier has it anyway */
    assert_true(mem_tier_has(mt, "", t, 20));
    kvt_service_stats r;
    assert_int_equal(kvt_service_get_stats(s, &r), 0);
    assert_int_equal(r.evictions, 0);
    assert_int_equal(r.write_behind_queued, 2);
    assert_int_equal(r.write_behind_dropped, 0);
    char *json = NULL;
    assert_int_equal(kvt_service_stats_json(s, &json), 0);
    assert_non_null(strstr(json, "\"write_behind_queued\":2"));
    assert_non_null(strstr(json, "\"write_behind_dropped\":0"));
    assert_non_null(strstr(json, "\"durable_evictions\":0"));
    kvt_string_free(json);
    /* a new process over the same tier reuses the whole history */
    kvt_service *s2 = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s2), 0);
    publish_turn(s2, t, 30, 20);
    /* close hands RAM to the tier: all of it is there already */
    int64_t writes = mem_tier_counts_get(mt).writes;
    assert_int_equal(kvt_service_close(s), 0);
    assert_int_equal(mem_tier_counts_get(mt).writes, writes);
    assert_int_equal(kvt_service_get_stats(s, &r), 0);
    assert_int_equal(r.durable_evictions, 1);
    assert_int_equal(r.spills, 0);
    kvt_service_destroy(s);
    kvt_service_destroy(s2);
    mem_tier_destroy(mt);
}

/* the service's flush makes every queued publish durable */
static void test_service_flush(void **state)
{
    (void)state;
    mem_tier *mt = tier_new();
    mem_tier_manual_spills(mt, 1);
    kvt_service_config cfg = {.n_layers = 1, .layers = &svc_layer, .max_positions = 1000,
                              .new_caches = svc_new_caches, .prompt_cache_bytes = 1u << 30,
                              .block_tokens = PCU_BLOCK, .cold = mem_tier_iface(mt)};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    int32_t t[40];
    pcu_seq(t, 40, 7);
    publish_turn(s, t, 10, 0);
    assert_false(mem_tier_has(mt, "", t, 10));
    assert_int_equal(kvt_service_flush(s), 0);
    assert_true(mem_tier_has(mt, "", t, 10));
    kvt_service_destroy(s);
    mem_tier_destroy(mt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_reaches_tier_without_eviction),
        cmocka_unit_test(test_leaving_durable_writes_nothing),
        cmocka_unit_test(test_full_queue_drop_then_spill_at_eviction),
        cmocka_unit_test(test_pending_write_blocks_eviction),
        cmocka_unit_test(test_flush_makes_all_durable),
        cmocka_unit_test(test_no_useless_writes),
        cmocka_unit_test(test_superseded_write_withdrawn),
        cmocka_unit_test(test_write_behind_off),
        cmocka_unit_test(test_threads_lose_nothing),
        cmocka_unit_test(test_service_publish_writes_behind),
        cmocka_unit_test(test_service_flush),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
