/*
 * test_prompt_cache.c: the RAM tier rules of DESIGN.md section 3, one test
 * per rule (numbers in the test names), on real kv / recurrent / rotating
 * caches with blocks of 4 tokens, and the in-memory cold tier where a rule
 * involves one.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "kvtier/prompt_cache.h"
#include "mem_tier.h"
#include "oom_alloc.h"
#include "pc_util.h"

#define MB ((size_t)1 << 20)

/* The eviction, relieve, reclaim and demote_idle rules below are checked on
 * their own, as the only way state reaches the cold tier: those tests turn
 * write-behind off (the default writes every put at once: that rule is
 * tested in test_durability.c). */
#define EVICTION_ONLY KVT_PC_NO_WRITE_BEHIND

static kvt_prompt_cache *mk(size_t max_bytes, const kvt_cold_tier *cold, uint32_t flags)
{
    kvt_prompt_cache_config cfg = {.max_bytes = max_bytes, .block_tokens = 4, .cold = cold, .flags = flags};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    return pc;
}

static int hook_runs;
static void count_hook(void *ctx)
{
    (void)ctx;
    hook_runs++;
}

/* take, then extend the views with prompt[p..n) and put the result */
static void engine_turn(kvt_prompt_cache *pc, const char *ns, const int32_t *prompt, int64_t n, const char *kinds,
                        const char *session, int64_t *p_out)
{
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, prompt, n, ns, session, &h), 0);
    kvt_cache *c[8];
    int nc = (int)strlen(kinds);
    kvt_hook hook = {0};
    if (h.prefix_len > 0) {
        assert_int_equal(h.entry.n_caches, nc);
        for (int l = 0; l < nc; l++) {
            c[l] = h.entry.caches[l];
            h.entry.caches[l] = NULL;
        }
        hook = h.entry.hook;
        h.entry.hook = (kvt_hook){0};
        assert_int_equal(pcu_extend(c, nc, prompt + h.prefix_len, n - h.prefix_len), 0);
    } else {
        assert_int_equal(pcu_fresh(kinds, c, prompt, n), 0);
    }
    if (p_out)
        *p_out = h.prefix_len;
    kvt_hit_clear(&h);
    assert_int_equal(pcu_put(pc, ns, prompt, n, c, nc, NULL, 0, hook, session), 0);
}

/* 3.1: the budget is bytes; a block shared by entries counts once; removing
 * an entry frees only blocks nobody else holds */
static void test_r01_budget_bytes_shared_once(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[8], b[12];
    pcu_seq(a, 8, 100);
    pcu_seq(b, 12, 100);
    b[11] = 999; /* b extends a */
    kvt_cache *ca[2];
    assert_int_equal(pcu_fresh("kk", ca, a, 8), 0);
    size_t bytes_a = pcu_unique_bytes(ca, 2);
    assert_int_equal(pcu_put(pc, "", a, 8, ca, 2, NULL, 0, (kvt_hook){0}, NULL), 0);
    assert_int_equal(pcu_stats(pc).bytes, bytes_a);
    /* b: a view of a extended by 4 tokens (shares a's two blocks per layer) */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, b, 12, "", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 8);
    kvt_cache *cb[2] = {h.entry.caches[0], h.entry.caches[1]};
    h.entry.caches[0] = h.entry.caches[1] = NULL;
    kvt_hit_clear(&h);
    assert_int_equal(pcu_extend(cb, 2, b + 8, 4), 0);
    size_t bytes_b = pcu_unique_bytes(cb, 2);
    /* blocks of a held by b: 2 full blocks per layer */
    size_t block = 2 * PCU_BLOCK * PCU_KV_DIM * sizeof(float);
    /* in the same ns b would supersede a: put it under another ns so both
     * stay resident (the budget is global) */
    assert_int_equal(pcu_put(pc, "other", b, 12, cb, 2, NULL, 0, (kvt_hook){0}, NULL), 0);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.entries, 2);
    assert_int_equal(s.bytes, bytes_a + bytes_b - 2 * 2 * block);
    /* drop a: only its private bytes go, the shared blocks stay counted */
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(pcu_stats(pc).bytes, bytes_b);
    assert_false(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL));
    kvt_prompt_cache_destroy(pc);
}

/* 3.2: usable prefix capped at len - 1; views trimmed to p; donor kept */
static void test_r02_take_cap_views_donor_kept(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[10];
    pcu_seq(a, 10, 1);
    hook_runs = 0;
    kvt_cache *ca[2];
    assert_int_equal(pcu_fresh("kk", ca, a, 10), 0);
    assert_int_equal(pcu_put(pc, "", a, 10, ca, 2, NULL, 0, (kvt_hook){count_hook, NULL}, NULL), 0);
    size_t before = pcu_stats(pc).bytes;
    kvt_hit h1, h2;
    assert_int_equal(kvt_prompt_cache_lend(pc, a, 10, "", NULL, &h1), 0);
    assert_int_equal(h1.prefix_len, 9); /* one token must still run */
    assert_int_equal(kvt_cache_offset(h1.entry.caches[0]), 9);
    assert_int_equal(kvt_cache_offset(h1.entry.caches[1]), 9);
    assert_int_equal(h1.entry.n_tokens, 9);
    assert_memory_equal(h1.entry.tokens, a, 9 * sizeof(int32_t));
    int32_t b[6] = {1, 2, 3, 4, 50, 60};
    assert_int_equal(kvt_prompt_cache_lend(pc, b, 6, "", NULL, &h2), 0);
    assert_int_equal(h2.prefix_len, 4);
    assert_int_equal(kvt_cache_offset(h2.entry.caches[0]), 4);
    assert_int_equal(h1.entry_id, h2.entry_id);
    /* non-consuming: the donor is intact and the budget unchanged */
    assert_true(kvt_prompt_cache_find_exact(pc, a, 10, "", NULL));
    assert_int_equal(pcu_stats(pc).bytes, before);
    assert_int_equal(pcu_stats(pc).hits, 2);
    /* a 1-token prompt and an unknown one miss */
    kvt_hit h3;
    assert_int_equal(kvt_prompt_cache_lend(pc, a, 1, "", NULL, &h3), 0);
    assert_int_equal(h3.prefix_len, 0);
    assert_int_equal(h3.source, KVT_HIT_NONE);
    assert_int_equal(pcu_stats(pc).misses, 1);
    /* release hook: once, after the donor and both views are gone */
    kvt_prompt_cache_clear(pc);
    assert_int_equal(hook_runs, 0);
    kvt_hit_clear(&h1);
    assert_int_equal(hook_runs, 0);
    kvt_hit_clear(&h2);
    assert_int_equal(hook_runs, 1);
    kvt_prompt_cache_destroy(pc);
    assert_int_equal(hook_runs, 1);
}

/* 3.2: a candidate needs p inside every layer's reachable range */
static void test_r02_reachable_range_every_layer(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[8];
    pcu_seq(a, 8, 1);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "kr", NULL), 0); /* kv + recurrent */
    int32_t div[9] = {1, 2, 3, 4, 5, 0, 0, 0, 0};
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, div, 9, "", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 0); /* recurrent layer cannot go back to 5 */
    assert_int_equal(kvt_prompt_cache_peek(pc, div, 9, "", NULL), 0);
    int32_t ext[9];
    pcu_seq(ext, 9, 1);
    assert_int_equal(kvt_prompt_cache_lend(pc, ext, 9, "", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 8); /* full prefix: no trim needed */
    kvt_hit_clear(&h);
    /* equal prompt: cap 7 would need a trim: miss */
    assert_int_equal(kvt_prompt_cache_peek(pc, a, 8, "", NULL), 0);
    /* a wrapped rotating layer (window 6, 8 tokens) is untrimmable too */
    int32_t w[8];
    pcu_seq(w, 8, 500);
    assert_int_equal(pcu_put_fresh(pc, "", w, 8, "kw", NULL), 0);
    int32_t wdiv[9] = {500, 501, 502, 9, 9, 9, 9, 9, 9};
    assert_int_equal(kvt_prompt_cache_peek(pc, wdiv, 9, "", NULL), 0);
    /* not yet wrapped (5 tokens): trimmable */
    int32_t w5[5];
    pcu_seq(w5, 5, 700);
    assert_int_equal(pcu_put_fresh(pc, "", w5, 5, "kw", NULL), 0);
    int32_t w5d[6] = {700, 701, 702, 0, 0, 0};
    assert_int_equal(kvt_prompt_cache_peek(pc, w5d, 6, "", NULL), 3);
    kvt_prompt_cache_destroy(pc);
}

/* 3.3: the tree walk finds the longest candidate; ns never mix */
static void test_r03_walk_longest_and_namespaces(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 2, 3, 9, 9, 9}, c[4] = {1, 2, 8, 8};
    assert_int_equal(pcu_put_fresh(pc, "", a, 6, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "", b, 6, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "lora:x", c, 4, "k", NULL), 0);
    int32_t p[7] = {1, 2, 3, 9, 9, 1, 1};
    uint64_t id_b, got;
    assert_true(kvt_prompt_cache_find_exact(pc, b, 6, "", &id_b));
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 7, "", &got), 5);
    assert_int_equal(got, id_b);
    int32_t q[5] = {1, 2, 8, 8, 0};
    assert_int_equal(kvt_prompt_cache_peek(pc, q, 5, "", NULL), 2);
    assert_int_equal(kvt_prompt_cache_peek(pc, q, 5, "lora:x", NULL), 4);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.prefix_walks, 0); /* peek does not count */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 7, "", NULL, &h), 0);
    kvt_hit_clear(&h);
    assert_int_equal(pcu_stats(pc).prefix_walks, 1);
    kvt_prompt_cache_destroy(pc);
}

/* 3.5: equal tokens replace the entry; sessions follow the new one */
static void test_r05_equal_replacement_sessions_follow(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[8];
    pcu_seq(a, 8, 1);
    hook_runs = 0;
    kvt_cache *c[1];
    assert_int_equal(pcu_fresh("k", c, a, 8), 0);
    assert_int_equal(pcu_put(pc, "", a, 8, c, 1, NULL, 0, (kvt_hook){count_hook, NULL}, "s1"), 0);
    uint64_t id1, id2;
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", &id1));
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "kr", NULL), 0); /* untrimmable: still replaces */
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", &id2));
    assert_int_not_equal(id1, id2);
    assert_int_equal(hook_runs, 1); /* the replaced entry was released */
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.entries, 1);
    assert_int_equal(s.replacements, 1);
    int32_t p[10];
    pcu_seq(p, 10, 1);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 10, "", "s1", &h), 0);
    assert_int_equal(h.source, KVT_HIT_SESSION);
    assert_int_equal(h.entry_id, id2);
    assert_int_equal(h.prefix_len, 8);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(pc);
}

/* 3.5: a trimmable entry supersedes strict prefix ancestors; an
 * untrimmable one supersedes nothing */
static void test_r05_supersede_only_trimmable(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 4, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "x", t, 4, "k", NULL), 0); /* other ns */
    assert_int_equal(pcu_put_fresh(pc, "", t, 8, "k", NULL), 0);
    assert_false(kvt_prompt_cache_find_exact(pc, t, 4, "", NULL));
    assert_true(kvt_prompt_cache_find_exact(pc, t, 4, "x", NULL));
    assert_true(kvt_prompt_cache_find_exact(pc, t, 8, "", NULL));
    assert_int_equal(pcu_stats(pc).supersedes, 1);
    /* untrimmable (recurrent) new entry: the 8-token one survives */
    assert_int_equal(pcu_put_fresh(pc, "", t, 12, "kr", NULL), 0);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 8, "", NULL));
    assert_true(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    assert_int_equal(pcu_stats(pc).supersedes, 1);
    /* a divergent prompt is served by the 8-token snapshot */
    int32_t p[14];
    memcpy(p, t, sizeof p);
    p[10] = -1;
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 14, "", NULL), 8);
    /* a sibling that is not a prefix is never superseded */
    int32_t s[9] = {1, 2, 3, 4, 5, 6, 7, 99, 99};
    assert_int_equal(pcu_put_fresh(pc, "", s, 9, "k", NULL), 0);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 8, "", NULL));
    kvt_prompt_cache_destroy(pc);
}

/* Puts a kv-only entry of tokens[0..n) with one attachment (untrimmable). */
static void put_with_attachment(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n)
{
    kvt_cache *c[1];
    assert_int_equal(pcu_fresh("k", c, tokens, n), 0);
    kvt_attachment *a = NULL;
    assert_int_equal(kvt_attachment_blob("draft.hidden", "state", 5, &a), 0);
    assert_int_equal(pcu_put(pc, "", tokens, n, c, 1, &a, 1, (kvt_hook){NULL, NULL}, NULL), 0);
}

/* 2 / 3.2 / 3.5: an entry with an attachment is untrimmable though its kv
 * layer could be cut: it supersedes none of its kv-only ancestors, and no
 * prompt takes it at a length shorter than its tokens, even when a
 * trimmable entry below it in the tree makes the walk descend through it. */
static void test_r05_attachment_entries(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t t[32];
    pcu_seq(t, 32, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 10, "k", NULL), 0);
    put_with_attachment(pc, t, 20);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 10, "", NULL)); /* not superseded */
    assert_true(kvt_prompt_cache_find_exact(pc, t, 20, "", NULL));
    assert_int_equal(pcu_stats(pc).supersedes, 0);
    int32_t p[18];
    memcpy(p, t, sizeof p);
    p[15] = -1; /* shares 15 tokens with the attachment entry */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 18, "", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 10); /* the kv-only ancestor, not 15 inside the other */
    assert_int_equal(h.entry.n_attachments, 0);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(pc);

    /* a trimmable entry below the attachment entry: the walk descends
     * through the attachment entry's node and must pass it by */
    pc = mk(64 * MB, NULL, 0);
    assert_int_equal(pcu_put_fresh(pc, "", t, 30, "k", NULL), 0);
    put_with_attachment(pc, t, 20);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 30, "", NULL));
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 18, "", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 15);
    assert_int_equal(h.entry.n_attachments, 0); /* the 30-token kv entry, cut back */
    for (int32_t i = 0; i < h.entry.n_caches; i++)
        assert_int_equal(kvt_cache_offset(h.entry.caches[i]), 15);
    kvt_hit_clear(&h);
    /* a prompt extending all of it takes the attachment entry */
    int32_t q[22];
    memcpy(q, t, sizeof q);
    q[20] = -1;
    assert_int_equal(kvt_prompt_cache_lend(pc, q, 22, "", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 20);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(pc);
}

/* 3.5: an entry larger than the whole budget is spilled and dropped */
static void test_r05_oversize_spilled_and_dropped(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(1000, mem_tier_iface(mt), 0);
    int32_t t[64];
    pcu_seq(t, 64, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 64, "kk", NULL), 0);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.entries, 0);
    assert_int_equal(s.bytes, 0);
    assert_int_equal(s.oversize_drops, 1);
    assert_int_equal(s.spills, 1);
    assert_true(mem_tier_has(mt, "", t, 64));
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* 3.6: the victim is the LRU unpinned entry, session-free ones first */
static void test_r06_victim_unpinned_session_free(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[4] = {1, 1, 1, 1}, b[4] = {2, 2, 2, 2}, c[4] = {3, 3, 3, 3}, d[4] = {4, 4, 4, 4};
    assert_int_equal(pcu_put_fresh(pc, "", a, 4, "k", "sa"), 0); /* oldest, session */
    assert_int_equal(pcu_put_fresh(pc, "", b, 4, "k", NULL), 0); /* pinned */
    assert_int_equal(pcu_put_fresh(pc, "", c, 4, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "", d, 4, "k", NULL), 0);
    kvt_lease *pin;
    assert_int_equal(kvt_prompt_cache_pin(pc, b, 4, "", &pin), 0);
    assert_int_equal(pcu_stats(pc).pinned, 1);
    /* use c so d is older than c */
    int32_t pc5[5] = {3, 3, 3, 3, 0};
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, pc5, 5, "", NULL, &h), 0);
    kvt_hit_clear(&h);
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_false(kvt_prompt_cache_find_exact(pc, d, 4, "", NULL)); /* LRU session-free */
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_false(kvt_prompt_cache_find_exact(pc, c, 4, "", NULL));
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_false(kvt_prompt_cache_find_exact(pc, a, 4, "", NULL)); /* then session ones */
    assert_int_equal(kvt_prompt_cache_evict(pc, 5, &n), 0);
    assert_int_equal(n, 0); /* only the pinned one is left */
    assert_true(kvt_prompt_cache_find_exact(pc, b, 4, "", NULL));
    kvt_lease_release(pin);
    assert_int_equal(pcu_stats(pc).pinned, 0);
    assert_int_equal(kvt_prompt_cache_evict(pc, 5, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(pcu_stats(pc).evictions, 4);
    kvt_prompt_cache_destroy(pc);
}

/* 3.6: eviction spills to the cold tier; a failing sink degrades to no spill */
static void test_r06_spill_on_eviction_and_failure(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(64 * MB, mem_tier_iface(mt), EVICTION_ONLY);
    int32_t a[8], b[8];
    pcu_seq(a, 8, 10);
    pcu_seq(b, 8, 50);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(pc, "", b, 8, "k", NULL), 0);
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_true(mem_tier_has(mt, "", a, 8));
    assert_int_equal(pcu_stats(pc).spills, 1);
    /* the spilled copy restores to the same values */
    kvt_hit h;
    int32_t p[9];
    pcu_seq(p, 9, 10);
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 9, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 8);
    const float *k, *v;
    int32_t nt;
    assert_int_equal(kvt_kv_block(h.entry.caches[0], 0, &k, &v, &nt), 0);
    assert_true(k[0] == 100.0f); /* token 10 * 10 + dim 0 + 0.001 * 0 */
    kvt_hit_clear(&h);
    mem_tier_refuse_spills(mt, 1);
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_int_equal(n, 1); /* eviction never unwinds */
    assert_false(kvt_prompt_cache_find_exact(pc, b, 8, "", NULL));
    assert_false(mem_tier_has(mt, "", b, 8));
    assert_int_equal(pcu_stats(pc).spill_failures, 1);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

static int64_t pressure_left;
static int pressure(void *ctx)
{
    (void)ctx;
    return pressure_left-- > 0;
}

/* 3.6: the tier policy forbids evicting an entry whose write is pending */
static void test_r06_pending_write_blocks_eviction(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    mem_tier_manual_spills(mt, 1);
    const kvt_cold_tier *tier = mem_tier_iface(mt);
    kvt_prompt_cache *pc = mk(64 * MB, tier, KVT_PC_EVICT_ONLY_DURABLE | EVICTION_ONLY);
    int32_t a[8];
    pcu_seq(a, 8, 10);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    /* the engine's write-behind snapshot of a: queued, not durable */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend_exact(pc, a, 8, "", &h), 0);
    assert_int_equal(tier->spill(tier->self, &h.entry), 0);
    kvt_hit_clear(&h);
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_int_equal(n, 0);
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL));
    assert_int_equal(kvt_prompt_cache_set_max_bytes(pc, 0), 0);
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL)); /* over budget, kept */
    /* neither idle demotion nor reclaim takes it while the write is pending */
    int64_t stores = mem_tier_counts_get(mt).stores;
    assert_int_equal(kvt_prompt_cache_demote_idle(pc, 0, &n), 0);
    assert_int_equal(n, 0);
    assert_int_equal(mem_tier_counts_get(mt).stores, stores);
    pressure_left = 5;
    assert_int_equal(kvt_prompt_cache_reclaim(pc, pressure, NULL, &n), 0);
    assert_int_equal(n, 0);
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL));
    assert_int_equal(mem_tier_drain(mt), 1);
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_int_equal(n, 1);
    /* durable already: no second write */
    assert_int_equal(mem_tier_counts_get(mt).spills, 1);
    assert_int_equal(pcu_stats(pc).spills, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

static int relieve_calls;
static mem_tier *relieve_mt;
static int over_twice_then_fail(void *ctx)
{
    (void)ctx;
    relieve_calls++;
    if (relieve_calls == 3)
        mem_tier_fail_writes(relieve_mt, 1);
    return 1;
}

/* 3.7: relieve writes now; stops at the first failed write, keeping it */
static void test_r07_relieve(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    relieve_mt = mt;
    kvt_prompt_cache *pc = mk(64 * MB, mem_tier_iface(mt), EVICTION_ONLY);
    int32_t t[4][8];
    for (int i = 0; i < 4; i++) {
        pcu_seq(t[i], 8, 100 * i);
        assert_int_equal(pcu_put_fresh(pc, "", t[i], 8, "k", NULL), 0);
    }
    relieve_calls = 0;
    int64_t n;
    int rc = kvt_prompt_cache_relieve(pc, over_twice_then_fail, NULL, &n);
    assert_int_equal(rc, KVT_EIO);
    assert_int_equal(n, 2);
    assert_true(mem_tier_has(mt, "", t[0], 8));
    assert_true(mem_tier_has(mt, "", t[1], 8));
    assert_false(mem_tier_has(mt, "", t[2], 8));
    assert_true(kvt_prompt_cache_find_exact(pc, t[2], 8, "", NULL)); /* kept */
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.demotions, 2);
    assert_int_equal(s.entries, 2);
    assert_int_equal(mem_tier_counts_get(mt).stores, 3);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* 3.8: reclaim drops entries with no storage I/O */
static void test_r08_reclaim_no_io(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(64 * MB, mem_tier_iface(mt), EVICTION_ONLY);
    int32_t t[3][8];
    for (int i = 0; i < 3; i++) {
        pcu_seq(t[i], 8, 100 * i);
        assert_int_equal(pcu_put_fresh(pc, "", t[i], 8, "k", NULL), 0);
    }
    pressure_left = 2;
    int64_t n;
    assert_int_equal(kvt_prompt_cache_reclaim(pc, pressure, NULL, &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(pcu_stats(pc).entries, 1);
    mem_tier_counts c = mem_tier_counts_get(mt);
    assert_int_equal(c.stores, 0);
    assert_int_equal(c.spills, 0);
    assert_int_equal(c.restores, 0);
    assert_int_equal(c.entries, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* 3.9: demote_idle: idle entries leave RAM once the cold tier holds them */
static void test_r09_demote_idle(void **state)
{
    (void)state;
    kvt_prompt_cache *ram = mk(64 * MB, NULL, 0);
    int32_t t[3][8];
    for (int i = 0; i < 3; i++)
        pcu_seq(t[i], 8, 100 * i);
    assert_int_equal(pcu_put_fresh(ram, "", t[0], 8, "k", NULL), 0);
    int64_t n = -1;
    assert_int_equal(kvt_prompt_cache_demote_idle(ram, 0, &n), 0);
    assert_int_equal(n, 0); /* no-op without a cold tier */
    kvt_prompt_cache_destroy(ram);

    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(64 * MB, mem_tier_iface(mt), EVICTION_ONLY);
    for (int i = 0; i < 3; i++)
        assert_int_equal(pcu_put_fresh(pc, "", t[i], 8, "k", NULL), 0);
    kvt_lease *pin;
    assert_int_equal(kvt_prompt_cache_pin(pc, t[2], 8, "", &pin), 0);
    assert_int_equal(kvt_prompt_cache_demote_idle(pc, 60000, &n), 0);
    assert_int_equal(n, 0); /* nothing idle for a minute */
    sleep_ms(5);
    mem_tier_fail_writes(mt, 1);
    assert_int_equal(kvt_prompt_cache_demote_idle(pc, 1, &n), 0);
    assert_int_equal(n, 0); /* a failed write is never a demotion */
    assert_int_equal(pcu_stats(pc).entries, 3);
    mem_tier_fail_writes(mt, 0);
    assert_int_equal(kvt_prompt_cache_demote_idle(pc, 1, &n), 0);
    assert_int_equal(n, 2);
    assert_true(mem_tier_has(mt, "", t[0], 8));
    assert_true(mem_tier_has(mt, "", t[1], 8));
    assert_true(kvt_prompt_cache_find_exact(pc, t[2], 8, "", NULL)); /* pinned */
    assert_int_equal(pcu_stats(pc).demotions, 2);
    kvt_lease_release(pin);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* 3.10: a session hit skips the walk; close_session keeps the data */
static void test_r10_sessions(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t t[32];
    pcu_seq(t, 32, 1);
    int64_t p;
    engine_turn(pc, "", t, 8, "k", "chat", &p);
    assert_int_equal(p, 0);
    engine_turn(pc, "", t, 16, "k", "chat", &p);
    assert_int_equal(p, 8);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.session_hits, 1);
    assert_int_equal(s.session_misses, 1);
    assert_int_equal(s.prefix_walks, 1);
    assert_int_equal(s.entries, 1); /* 16 superseded 8 */
    /* a session in another ns does not see it */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 20, "other", "chat", &h), 0);
    assert_int_equal(h.prefix_len, 0);
    /* a prompt that edits the history falls back to the walk */
    int32_t e[20];
    memcpy(e, t, sizeof e);
    e[3] = -5;
    assert_int_equal(kvt_prompt_cache_lend(pc, e, 20, "", "chat", &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM);
    assert_int_equal(h.prefix_len, 3);
    kvt_hit_clear(&h);
    kvt_prompt_cache_close_session(pc, "chat");
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 20, "", "chat", &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM); /* walk, not session */
    assert_int_equal(h.prefix_len, 16);
    kvt_hit_clear(&h);
    s = pcu_stats(pc);
    assert_int_equal(s.session_hits, 1);
    assert_int_equal(s.session_misses, 4);
    assert_int_equal(s.entries, 1);
    kvt_prompt_cache_close_session(pc, "nobody");
    kvt_prompt_cache_destroy(pc);
}

/* 3.11 (pins part): a pinned entry survives the budget until released */
static void test_r11_pins(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[8];
    pcu_seq(a, 8, 1);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    kvt_lease *l1, *l2, *none = (kvt_lease *)&none;
    assert_int_equal(kvt_prompt_cache_pin(pc, a, 8, "", &l1), 0);
    assert_int_equal(kvt_prompt_cache_pin(pc, a, 7, "", &none), KVT_ENOTFOUND);
    assert_null(none);
    assert_int_equal(kvt_prompt_cache_pin(pc, a, 8, "", &l2), 0);
    /* replacement carries the pins */
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    assert_int_equal(pcu_stats(pc).replacements, 1);
    assert_int_equal(pcu_stats(pc).pinned, 1);
    assert_int_equal(kvt_prompt_cache_set_max_bytes(pc, 0), 0);
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL));
    kvt_lease_release(l1);
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL));
    kvt_lease_release(l2);
    assert_false(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL)); /* evicted to budget */
    assert_int_equal(pcu_stats(pc).pinned, 0);
    kvt_prompt_cache_destroy(pc);
}

static int blob_hooks;
static void blob_hook(void *ctx)
{
    (void)ctx;
    blob_hooks++;
}

/* 3.12: objects: exact-key blobs sharing the budget, eviction and writer */
static void test_r12_objects(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(64 * MB, mem_tier_iface(mt), 0);
    kvt_attachment *a;
    const char data[] = "encoder output of image 1";
    assert_int_equal(kvt_attachment_blob("vision", data, sizeof data, &a), 0);
    kvt_hook hk = {blob_hook, NULL};
    blob_hooks = 0;
    assert_int_equal(kvt_prompt_cache_object_put(pc, "img1", &a, 1, &hk), 0);
    assert_null(a);
    assert_null(hk.fn);
    assert_int_equal(kvt_prompt_cache_object_put(pc, "", &a, 0, NULL), KVT_EINVAL);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_object_lend(pc, "img1", &h), 0);
    assert_int_equal(h.entry.n_attachments, 1);
    size_t nb;
    const void *got = kvt_attachment_blob_data(h.entry.attachments[0], &nb);
    assert_int_equal(nb, sizeof data);
    assert_memory_equal(got, data, sizeof data);
    assert_string_equal(h.entry.ns, "object:img1");
    kvt_hit_clear(&h);
    assert_int_equal(kvt_prompt_cache_object_lend(pc, "img2", &h), KVT_ENOTFOUND);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.object_hits, 1);
    assert_int_equal(s.object_misses, 1);
    assert_true(s.bytes >= sizeof data); /* shares the budget */
    /* evicted: spilled like any entry, then restored from the cold tier */
    int64_t n;
    assert_int_equal(kvt_prompt_cache_evict(pc, 1, &n), 0);
    assert_int_equal(n, 1);
    assert_true(mem_tier_has(mt, "object:img1", NULL, 0));
    assert_int_equal(blob_hooks, 0); /* the spilled copy holds a share */
    assert_int_equal(kvt_prompt_cache_object_lend(pc, "img1", &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    got = kvt_attachment_blob_data(h.entry.attachments[0], &nb);
    assert_memory_equal(got, data, sizeof data);
    kvt_hit_clear(&h);
    s = pcu_stats(pc);
    assert_int_equal(s.object_restores, 1);
    assert_int_equal(s.object_misses, 2);
    assert_int_equal(s.entries, 1);
    /* objects are never served to token prompts */
    int32_t p[3] = {1, 2, 3};
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 3, "object:img1", NULL), 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
    assert_int_equal(blob_hooks, 1);
}

/* 3.13: peek, find_exact, clear with an epoch, counters */
static void test_r13_peek_find_clear_counters(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[8];
    pcu_seq(a, 8, 1);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", "s"), 0);
    uint64_t id, pid;
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", &id));
    assert_false(kvt_prompt_cache_find_exact(pc, a, 7, "", NULL));
    assert_int_equal(kvt_prompt_cache_peek(pc, a, 8, "", &pid), 7);
    assert_int_equal(pid, id);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.hits + s.misses, 0); /* peek counts nothing */
    assert_int_equal(s.entries, 1);
    assert_int_equal(s.epoch, 0);
    assert_int_equal(s.max_bytes, 64 * MB);
    kvt_prompt_cache_clear(pc);
    s = pcu_stats(pc);
    assert_int_equal(s.entries, 0);
    assert_int_equal(s.bytes, 0);
    assert_int_equal(s.epoch, 1);
    assert_int_equal(kvt_prompt_cache_peek(pc, a, 8, "", NULL), 0);
    /* sessions are gone too */
    int32_t p[9];
    pcu_seq(p, 9, 1);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "k", NULL), 0);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 9, "", "s", &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(pc);
}

/* 3.14: the prompt-boundary snapshot beside an untrimmable prompt+gen entry
 * keeps drifted multi-turn traffic hitting */
static void test_r14_prompt_boundary_snapshot(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t prompt[10], full[14];
    pcu_seq(prompt, 10, 1);
    memcpy(full, prompt, sizeof prompt);
    full[10] = 70; /* generated tokens */
    full[11] = 71;
    full[12] = 72;
    full[13] = 73;
    kvt_cache *c[2];
    assert_int_equal(pcu_fresh("kw", c, prompt, 10), 0); /* window 6: wrapped at 10 */
    kvt_cache *snap[2];
    assert_int_equal(kvt_caches_clone(c, 2, snap), 0); /* zero-copy, at the boundary */
    assert_int_equal(pcu_extend(c, 2, full + 10, 4), 0);
    assert_int_equal(pcu_put(pc, "", prompt, 10, snap, 2, NULL, 0, (kvt_hook){0}, NULL), 0);
    assert_int_equal(pcu_put(pc, "", full, 14, c, 2, NULL, 0, (kvt_hook){0}, NULL), 0);
    assert_int_equal(pcu_stats(pc).entries, 2); /* untrimmable: no supersede */
    /* next turn re-tokenizes the reply differently: only the snapshot serves */
    int32_t next[16];
    memcpy(next, prompt, sizeof prompt);
    for (int i = 10; i < 16; i++)
        next[i] = 80 + i;
    assert_int_equal(kvt_prompt_cache_peek(pc, next, 16, "", NULL), 10);
    kvt_prompt_cache_destroy(pc);
}

/* trim in place (the primitive block-granular eviction uses) */
static void test_trim_in_place(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[12];
    pcu_seq(a, 12, 1);
    assert_int_equal(pcu_put_fresh(pc, "", a, 12, "kk", "s"), 0);
    size_t before = pcu_stats(pc).bytes;
    assert_int_equal(kvt_prompt_cache_trim(pc, a, 12, "", 5), 0);
    assert_false(kvt_prompt_cache_find_exact(pc, a, 12, "", NULL));
    assert_true(kvt_prompt_cache_find_exact(pc, a, 5, "", NULL));
    size_t block = 2 * PCU_BLOCK * PCU_KV_DIM * sizeof(float);
    assert_int_equal(pcu_stats(pc).bytes, before - 2 * block * 1); /* 3 blocks -> 2 per layer */
    assert_int_equal(kvt_prompt_cache_trim(pc, a, 5, "", 0), KVT_ERANGE);
    assert_int_equal(kvt_prompt_cache_trim(pc, a, 12, "", 4), KVT_ENOTFOUND);
    assert_int_equal(pcu_put_fresh(pc, "", a, 8, "kr", NULL), 0);
    assert_int_equal(kvt_prompt_cache_trim(pc, a, 8, "", 6), KVT_ERANGE); /* recurrent */
    kvt_hit h;
    int32_t p[6];
    pcu_seq(p, 6, 1);
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 6, "", "s", &h), 0);
    assert_int_equal(h.source, KVT_HIT_SESSION); /* the session stayed on it */
    assert_int_equal(h.prefix_len, 5);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(pc);
}

static void test_retention_policies(void **state)
{
    (void)state;
    const kvt_retention_ops *ops[2] = {&kvt_retention_lru, &kvt_retention_slru};
    assert_ptr_equal(kvt_retention_by_name("slru"), &kvt_retention_slru);
    assert_null(kvt_retention_by_name("fifo"));
    for (int k = 0; k < 2; k++) {
        kvt_retention *r;
        assert_int_equal(ops[k]->create(&r), 0);
        for (uint64_t id = 1; id <= 4; id++)
            assert_int_equal(ops[k]->on_insert(r, id, 100, 10), 0);
        ops[k]->on_access(r, 1, 5); /* 1 used twice */
        uint64_t v;
        assert_int_equal(ops[k]->victim(r, NULL, NULL, &v), 0);
        /* lru: 2 is least recent; slru: 2 too (probation first) */
        assert_int_equal(v, 2);
        ops[k]->on_remove(r, 2);
        ops[k]->on_access(r, 3, 5);
        ops[k]->on_access(r, 4, 5);
        ops[k]->on_access(r, 1, 5);
        assert_int_equal(ops[k]->victim(r, NULL, NULL, &v), 0);
        /* lru: 3 (least recent); slru: everything protected but one demoted */
        if (k == 0)
            assert_int_equal(v, 3);
        else
            assert_true(v == 3);
        ops[k]->on_remove(r, 1);
        ops[k]->on_remove(r, 3);
        ops[k]->on_remove(r, 4);
        assert_int_equal(ops[k]->victim(r, NULL, NULL, &v), KVT_ENOTFOUND);
        ops[k]->destroy(r);
    }
    /* frequency matters for slru: a twice-used old entry outlives new ones */
    kvt_retention *r;
    assert_int_equal(kvt_retention_slru.create(&r), 0);
    for (uint64_t id = 1; id <= 10; id++)
        assert_int_equal(kvt_retention_slru.on_insert(r, id, 1, 1), 0);
    kvt_retention_slru.on_access(r, 1, 1);
    for (uint64_t id = 11; id <= 20; id++)
        assert_int_equal(kvt_retention_slru.on_insert(r, id, 1, 1), 0);
    uint64_t v;
    for (int i = 0; i < 19; i++) {
        assert_int_equal(kvt_retention_slru.victim(r, NULL, NULL, &v), 0);
        assert_int_not_equal(v, 1);
        kvt_retention_slru.on_remove(r, v);
    }
    assert_int_equal(kvt_retention_slru.victim(r, NULL, NULL, &v), 0);
    assert_int_equal(v, 1);
    kvt_retention_slru.destroy(r);
}

/* A NULL namespace is "" (the base model) in every call: put (kvt_entry.ns),
 * find_exact, peek, lend, lend_exact, pin, prefetch, trim and
 * kvt_entry_init answer for NULL exactly as for "", and NULL never reaches
 * another namespace's entry. */
static void test_null_ns_is_base_model(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t a[8], p[9], b[8];
    pcu_seq(a, 8, 1);
    pcu_seq(p, 9, 1); /* a, extended by one token */
    pcu_seq(b, 8, 500);
    kvt_cache *c[1];
    assert_int_equal(pcu_fresh("k", c, a, 8), 0);
    kvt_entry e = {NULL, a, 8, c, 1, NULL, 0, {0}};
    assert_int_equal(kvt_prompt_cache_put(pc, &e, "s"), 0);
    assert_null(c[0]); /* adopted */
    assert_int_equal(pcu_put_fresh(pc, "lora:x", b, 8, "k", NULL), 0);
    uint64_t id = 0, id2 = 0;
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, "", &id));
    assert_true(kvt_prompt_cache_find_exact(pc, a, 8, NULL, &id2));
    assert_int_equal(id2, id);
    assert_false(kvt_prompt_cache_find_exact(pc, b, 8, NULL, NULL));
    assert_true(kvt_prompt_cache_find_exact(pc, b, 8, "lora:x", NULL));
    id2 = 0;
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 9, NULL, &id2), 8);
    assert_int_equal(id2, id);
    assert_int_equal(kvt_prompt_cache_peek(pc, b, 8, NULL, NULL), 0);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 9, NULL, NULL, &h), 0);
    assert_int_equal(h.prefix_len, 8);
    assert_int_equal(h.entry_id, id);
    assert_string_equal(h.entry.ns, "");
    kvt_hit_clear(&h);
    assert_int_equal(kvt_prompt_cache_lend_exact(pc, a, 8, NULL, &h), 0);
    assert_int_equal(h.prefix_len, 8);
    assert_int_equal(h.entry_id, id);
    kvt_hit_clear(&h);
    assert_int_equal(kvt_prompt_cache_lend_exact(pc, b, 8, NULL, &h), KVT_ENOTFOUND);
    kvt_lease *l = NULL;
    assert_int_equal(kvt_prompt_cache_pin(pc, a, 8, NULL, &l), 0);
    assert_int_equal(pcu_stats(pc).pinned, 1);
    kvt_lease_release(l);
    assert_int_equal(pcu_stats(pc).pinned, 0);
    l = NULL;
    assert_int_equal(kvt_prompt_cache_prefetch(pc, p, 9, NULL, "s", &l), 0);
    assert_non_null(l);
    assert_int_equal(kvt_lease_wait(l, 0), 0);
    assert_int_equal(pcu_stats(pc).pinned, 1); /* the session's entry in "" serves: pinned */
    kvt_lease_release(l);
    assert_int_equal(kvt_prompt_cache_trim(pc, a, 8, NULL, 5), 0);
    assert_false(kvt_prompt_cache_find_exact(pc, a, 8, "", NULL));
    assert_true(kvt_prompt_cache_find_exact(pc, a, 5, "", NULL));
    kvt_entry x;
    assert_int_equal(kvt_entry_init(&x, NULL, a, 3, 1, 0), 0);
    assert_non_null(x.ns);
    assert_string_equal(x.ns, "");
    assert_int_equal(x.n_tokens, 3);
    kvt_entry_clear(&x);
    kvt_prompt_cache_destroy(pc);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    kvt_hit h;
    int32_t a[4] = {1, 2, 3, 4};
    assert_int_equal(kvt_prompt_cache_lend(pc, NULL, 4, "", NULL, &h), KVT_EINVAL);
    assert_int_equal(kvt_prompt_cache_lend(pc, a, 4, NULL, NULL, &h), 0); /* NULL ns is "": a miss */
    kvt_hit_clear(&h);
    assert_int_equal(kvt_prompt_cache_lend(pc, a, -1, "", NULL, &h), KVT_EINVAL);
    kvt_cache *c[1];
    assert_int_equal(pcu_fresh("k", c, a, 3), 0);
    kvt_entry e = {"", a, 4, c, 1, NULL, 0, {0}};
    assert_int_equal(kvt_prompt_cache_put(pc, &e, NULL), KVT_EINVAL); /* 3 tokens in cache, 4 claimed */
    assert_non_null(c[0]);                                           /* not adopted */
    assert_true(strstr(kvt_last_error(), "holds 3 tokens") != NULL);
    e.n_tokens = 3;
    assert_int_equal(kvt_prompt_cache_put(pc, &e, NULL), 0);
    assert_null(c[0]); /* adopted */
    kvt_prompt_cache_config cfg = {0};
    kvt_cold_tier bad = {0};
    cfg.cold = &bad;
    kvt_prompt_cache *x;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &x), KVT_EINVAL);
    /* a refused call leaves its out cleared (common.h: call, then clear): a clear or a release
     * after the error frees nothing, even when out held garbage */
    memset(&h, 0xab, sizeof h);
    assert_int_equal(kvt_prompt_cache_lend(pc, NULL, 4, "", NULL, &h), KVT_EINVAL);
    assert_null(h.entry.caches);
    assert_int_equal(h.entry.n_caches, 0);
    assert_int_equal(h.prefix_len, 0);
    kvt_hit_clear(&h);
    memset(&h, 0xab, sizeof h);
    assert_int_equal(kvt_prompt_cache_lend_exact(pc, a, -1, "", &h), KVT_EINVAL);
    assert_null(h.entry.caches);
    kvt_hit_clear(&h);
    memset(&h, 0xab, sizeof h);
    assert_int_equal(kvt_prompt_cache_object_lend(pc, "", &h), KVT_EINVAL);
    assert_null(h.entry.caches);
    kvt_hit_clear(&h);
    kvt_lease *l = (kvt_lease *)(uintptr_t)0xabababab;
    assert_int_equal(kvt_prompt_cache_prefetch(pc, NULL, 4, "", NULL, &l), KVT_EINVAL);
    assert_null(l);
    l = (kvt_lease *)(uintptr_t)0xabababab;
    assert_int_equal(kvt_prompt_cache_pin(pc, a, -1, "", &l), KVT_EINVAL);
    assert_null(l);
    kvt_buf *b = (kvt_buf *)(uintptr_t)0xabababab;
    assert_int_equal(kvt_buf_wrap(NULL, 8, NULL, NULL, &b), KVT_EINVAL);
    assert_null(b);
    kvt_prompt_cache_destroy(NULL);
    kvt_hit_clear(NULL);
    kvt_lease_release(NULL);
    kvt_prompt_cache_destroy(pc);
}

/* out of memory at every allocation of put / take / object put / trim in
 * turn: each call either succeeds or fails KVT_ENOMEM leaving the cache
 * consistent (the caller keeps what put did not adopt; ASan checks leaks) */
static void test_out_of_memory_paths(void **state)
{
    (void)state;
    int failures = 0;
    long k;
    for (k = 1; k < 2000; k++) {
        kvt_prompt_cache *pc = mk(4000, NULL, 0);
        int32_t t[20];
        pcu_seq(t, 20, 1);
        assert_int_equal(pcu_put_fresh(pc, "", t, 8, "k", "s"), 0);
        kvt_cache *c[2];
        assert_int_equal(pcu_fresh("kk", c, t, 12), 0);
        oom_arm(k);
        int rc1 = pcu_put(pc, "", t, 12, c, 2, NULL, 0, (kvt_hook){0}, "s");
        kvt_hit h;
        int rc2 = kvt_prompt_cache_lend(pc, t, 16, "", "s", &h);
        if (rc2 == 0)
            kvt_hit_clear(&h);
        kvt_attachment *a = NULL;
        int rc3 = kvt_attachment_blob("x", "abc", 3, &a);
        if (rc3 == 0 && (rc3 = kvt_prompt_cache_object_put(pc, "k", &a, 1, NULL)) != 0)
            kvt_attachment_destroy(a);
        int rc4 = kvt_prompt_cache_trim(pc, t, 12, "", 6);
        kvt_set_allocator(NULL);
        int rcs[4] = {rc1, rc2, rc3, rc4};
        for (int i = 0; i < 4; i++) {
            if (rcs[i] == KVT_ENOMEM)
                failures++;
            else if (!(rcs[i] == 0 || (i == 3 && rcs[i] == KVT_ENOTFOUND)))
                fail_msg("allocation %ld: call %d returned %d (%s)", k, i, rcs[i], kvt_last_error());
        }
        /* consistent: what find_exact reports is what take serves */
        kvt_prompt_cache_stats s = pcu_stats(pc);
        assert_true(s.bytes <= 4000 || s.entries <= 1);
        int has12 = kvt_prompt_cache_find_exact(pc, t, 12, "", NULL);
        int has6 = kvt_prompt_cache_find_exact(pc, t, 6, "", NULL);
        int has8 = kvt_prompt_cache_find_exact(pc, t, 8, "", NULL);
        int64_t want = has12 ? 12 : has8 ? 8 : has6 ? 6 : 0;
        assert_int_equal(kvt_prompt_cache_peek(pc, t, 20, "", NULL), want);
        kvt_prompt_cache_clear(pc);
        if (pcu_stats(pc).bytes != 0)
            fail_msg("allocation %ld (rcs %d %d %d %d): %zu bytes left after clear", k, rc1, rc2, rc3, rc4,
                     pcu_stats(pc).bytes);
        kvt_prompt_cache_destroy(pc);
        if (oom_calls() < k)
            break; /* every allocation of the sequence has failed once */
    }
    printf("  out of memory injected at each of %ld allocations: %d calls failed cleanly\n", k - 1, failures);
    assert_true(k < 2000); /* the whole sequence was covered */
    assert_true(failures > 0);
}

/* a backend kind through the ops table: it can be cut back by at most 4
 * tokens (range [offset - 4, offset]): a trimmable entry with reach > 0 */
typedef struct tail4 {
    kvt_cache base;
    int64_t offset;
} tail4;
static size_t t4_private(const kvt_cache *c) { return sizeof(tail4); }
static void t4_foreach(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx) {}
static void t4_range(const kvt_cache *c, int64_t *lo, int64_t *off)
{
    *off = ((const tail4 *)c)->offset;
    *lo = *off > 4 ? *off - 4 : 0;
}
static int t4_trim(kvt_cache *c, int64_t n)
{
    ((tail4 *)c)->offset = n;
    return 0;
}
static const kvt_cache_ops t4_ops;
static int t4_clone(const kvt_cache *c, kvt_cache **out)
{
    tail4 *t = malloc(sizeof *t);
    if (!t)
        return KVT_ENOMEM;
    *t = *(const tail4 *)c;
    *out = &t->base;
    return 0;
}
static int t4_append(kvt_cache *c, int64_t n, const void *const *in)
{
    ((tail4 *)c)->offset += n;
    return 0;
}
static void t4_dispose(kvt_cache *c) { free(c); }
static int t4_encode(const kvt_cache *c, kvt_cache_state *out) { return KVT_EUNSUPPORTED; }
static int t4_decode(const kvt_cache_state *st, kvt_cache **out) { return KVT_EUNSUPPORTED; }
static const kvt_cache_ops t4_ops = {"test.tail4", t4_private, t4_foreach, t4_range, t4_trim,
                                     t4_clone,     t4_append,  t4_dispose, t4_encode, t4_decode};

static int put_tail4(kvt_prompt_cache *pc, const int32_t *t, int64_t n)
{
    kvt_cache *c[2];
    if (pcu_fresh("k", c, t, n) != 0)
        return -1;
    tail4 *x = malloc(sizeof *x);
    x->base.ops = &t4_ops;
    x->offset = n;
    c[1] = &x->base;
    return pcu_put(pc, "", t, n, c, 2, NULL, 0, (kvt_hook){0}, NULL);
}

/* 3.2 / 3.5 with a partially trimmable layer: candidates need p >= reach and
 * a new entry supersedes only ancestors it can be cut back to */
static void test_backend_kind_reach(void **state)
{
    (void)state;
    kvt_prompt_cache *pc = mk(64 * MB, NULL, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    assert_int_equal(put_tail4(pc, t, 3), 0);
    assert_int_equal(put_tail4(pc, t, 7), 0); /* reach 3: it can serve 3, so 3 is superseded */
    assert_false(kvt_prompt_cache_find_exact(pc, t, 3, "", NULL));
    assert_int_equal(put_tail4(pc, t, 12), 0); /* reach 8: it cannot serve 7, so 7 stays */
    assert_true(kvt_prompt_cache_find_exact(pc, t, 7, "", NULL));
    assert_int_equal(pcu_stats(pc).supersedes, 1);
    int32_t p[16];
    memcpy(p, t, sizeof p);
    p[9] = -1; /* diverges at 9: the 12-token entry reaches back to 8 */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 16, "", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 9);
    assert_int_equal(kvt_cache_offset(h.entry.caches[1]), 9);
    kvt_hit_clear(&h);
    p[9] = 10;
    p[6] = -1; /* diverges at 6: below 12's reach; the 7-token entry reaches 3..7 */
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 16, "", NULL), 6);
    p[6] = 7;
    p[2] = -1; /* diverges at 2: no entry reaches back that far */
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 16, "", NULL), 0);
    assert_int_equal(kvt_prompt_cache_trim(pc, t, 12, "", 7), KVT_ERANGE);
    assert_int_equal(kvt_prompt_cache_trim(pc, t, 12, "", 8), 0);
    kvt_prompt_cache_destroy(pc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_r01_budget_bytes_shared_once),
        cmocka_unit_test(test_r02_take_cap_views_donor_kept),
        cmocka_unit_test(test_r02_reachable_range_every_layer),
        cmocka_unit_test(test_r03_walk_longest_and_namespaces),
        cmocka_unit_test(test_r05_equal_replacement_sessions_follow),
        cmocka_unit_test(test_r05_supersede_only_trimmable),
        cmocka_unit_test(test_r05_attachment_entries),
        cmocka_unit_test(test_r05_oversize_spilled_and_dropped),
        cmocka_unit_test(test_r06_victim_unpinned_session_free),
        cmocka_unit_test(test_r06_spill_on_eviction_and_failure),
        cmocka_unit_test(test_r06_pending_write_blocks_eviction),
        cmocka_unit_test(test_r07_relieve),
        cmocka_unit_test(test_r08_reclaim_no_io),
        cmocka_unit_test(test_r09_demote_idle),
        cmocka_unit_test(test_r10_sessions),
        cmocka_unit_test(test_r11_pins),
        cmocka_unit_test(test_r12_objects),
        cmocka_unit_test(test_r13_peek_find_clear_counters),
        cmocka_unit_test(test_r14_prompt_boundary_snapshot),
        cmocka_unit_test(test_trim_in_place),
        cmocka_unit_test(test_retention_policies),
        cmocka_unit_test(test_backend_kind_reach),
        cmocka_unit_test(test_null_ns_is_base_model),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_out_of_memory_paths),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
