/*
 * test_prompt_cache_tier.c: the tiering rules of DESIGN.md 3.4 and 3.11
 * against the in-memory cold tier (tests/support/mem_tier.c): the cold tier
 * wins only when strictly longer; an untrimmable divergent cold tail is
 * dropped and the RAM candidate serves; restored prefixes are promoted when
 * configured; prefetch coalesces identical reads, pins what it loads and is
 * discarded by a clear during the read; restore failures fall back to RAM.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvtier/prompt_cache.h"
#include "mem_tier.h"
#include "oom_alloc.h"
#include "pc_util.h"

#define MB ((size_t)1 << 20)

static kvt_prompt_cache *mk(mem_tier *mt, uint32_t flags)
{
    kvt_prompt_cache_config cfg = {.max_bytes = 64 * MB, .cold = mem_tier_iface(mt), .flags = flags};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    return pc;
}

/* stores (ns, tokens) with fresh caches of `kinds` in the cold tier */
static void tier_put(mem_tier *mt, const char *ns, const int32_t *t, int64_t n, const char *kinds)
{
    kvt_entry e;
    int nc = (int)strlen(kinds);
    assert_int_equal(kvt_entry_init(&e, ns, t, n, nc, 0), 0);
    assert_int_equal(pcu_fresh(kinds, e.caches, t, n), 0);
    assert_int_equal(mem_tier_insert(mt, &e), 0);
}

static void test_cold_only_when_strictly_longer(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(mt, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 8, "k", NULL), 0);
    tier_put(mt, "", t, 8, "k");
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 12, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM); /* equal length: RAM serves */
    assert_int_equal(h.prefix_len, 8);
    kvt_hit_clear(&h);
    assert_int_equal(mem_tier_counts_get(mt).restores, 0);
    tier_put(mt, "", t, 10, "k");
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 12, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 10);
    assert_int_equal(kvt_cache_offset(h.entry.caches[0]), 10);
    assert_memory_equal(h.entry.tokens, t, 10 * sizeof(int32_t));
    kvt_hit_clear(&h);
    /* longer than the prompt allows: the cold entry is trimmed to n - 1 */
    tier_put(mt, "", t, 16, "k");
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 12, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 11);
    assert_int_equal(kvt_cache_offset(h.entry.caches[0]), 11);
    kvt_hit_clear(&h);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.hits, 3); /* RAM candidacy only */
    assert_int_equal(s.misses, 0);
    assert_int_equal(s.cold_restores, 2);
    assert_int_equal(mem_tier_counts_get(mt).restores, 2);
    /* RAM miss, cold hit: a miss for RAM */
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 12, "lora", NULL, &h), 0);
    assert_int_equal(h.prefix_len, 0);
    assert_int_equal(pcu_stats(pc).misses, 1);
    kvt_prompt_cache_destroy(pc);
    mem_tier_counts c = mem_tier_counts_get(mt);
    mem_tier_destroy(mt);
    assert_int_equal(c.hooks_given, c.hooks_run);
}

static void test_untrimmable_cold_tail_dropped(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    mem_tier_loose_find(mt, 1);
    kvt_prompt_cache *pc = mk(mt, KVT_PC_PROMOTE_RESTORES);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 6, "k", NULL), 0);
    tier_put(mt, "", t, 12, "kr"); /* recurrent layer: single point */
    int32_t p[14];
    memcpy(p, t, sizeof p);
    p[9] = -1; /* diverges at 9: the cold entry would need a trim */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 14, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM);
    assert_int_equal(h.prefix_len, 6);
    kvt_hit_clear(&h);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.cold_unusable, 1);
    assert_int_equal(s.cold_restores, 0);
    assert_int_equal(s.promotions, 0);
    assert_int_equal(s.entries, 1);
    mem_tier_counts c = mem_tier_counts_get(mt);
    assert_int_equal(c.restores, 1);
    assert_int_equal(c.hooks_given, c.hooks_run); /* the dropped restore was released */
    /* a prompt extending all of it: served from the cold tier */
    int32_t q[14];
    pcu_seq(q, 14, 1);
    assert_int_equal(kvt_prompt_cache_lend(pc, q, 14, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 12);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* A custom cold tier whose find does not cap at n - 1: it reports the whole
 * prompt when it holds all of it. */
static kvt_cold_tier g_inner;
static int whole_prompt_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    int rc = g_inner.find(self, prompt, n, ns, out);
    if (rc == 0 && out->n_tokens >= n)
        out->prefix_len = n;
    return rc;
}

/* The prompt cache checks what a cold tier claims itself, whatever the
 * tier's own index checked: a hit covering the whole prompt (no token left
 * to run) is never served, and an entry with an attachment, or with a layer
 * whose range does not reach the length it was found at, is dropped and
 * the RAM candidate serves. */
static void test_cold_claims_checked(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    g_inner = *mem_tier_iface(mt);
    kvt_cold_tier tier = g_inner;
    tier.find = whole_prompt_find;
    kvt_prompt_cache_config cfg = {.max_bytes = 64 * MB, .cold = &tier};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    tier_put(mt, "", t, 10, "k");
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 10, "", NULL, &h), 0);
    assert_true(h.prefix_len <= 9);
    assert_int_not_equal(h.source, KVT_HIT_COLD);
    kvt_hit_clear(&h);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);

    /* an attachment: untrimmable even though its kv layer could be cut */
    assert_int_equal(mem_tier_create(&mt), 0);
    mem_tier_loose_find(mt, 1);
    pc = mk(mt, KVT_PC_PROMOTE_RESTORES);
    assert_int_equal(pcu_put_fresh(pc, "", t, 6, "k", NULL), 0);
    kvt_entry e;
    assert_int_equal(kvt_entry_init(&e, "", t, 12, 1, 1), 0);
    assert_int_equal(pcu_fresh("k", e.caches, t, 12), 0);
    assert_int_equal(kvt_attachment_blob("draft.hidden", "state", 5, &e.attachments[0]), 0);
    assert_int_equal(mem_tier_insert(mt, &e), 0);
    int32_t p[14];
    memcpy(p, t, sizeof p);
    p[9] = -1; /* diverges at 9: the cold entry would need a trim */
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 14, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM);
    assert_int_equal(h.prefix_len, 6);
    kvt_hit_clear(&h);
    assert_int_equal(pcu_stats(pc).cold_unusable, 1);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);

    /* a recurrent layer (range [12, 12]) found at 9: outside that layer's
     * range, so the restore is dropped and the RAM candidate serves */
    assert_int_equal(mem_tier_create(&mt), 0);
    mem_tier_loose_find(mt, 1);
    pc = mk(mt, KVT_PC_PROMOTE_RESTORES);
    assert_int_equal(pcu_put_fresh(pc, "", t, 6, "k", NULL), 0);
    tier_put(mt, "", t, 12, "kr");
    assert_int_equal(kvt_prompt_cache_lend(pc, p, 14, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM);
    assert_int_equal(h.prefix_len, 6);
    kvt_hit_clear(&h);
    kvt_prompt_cache_stats st = pcu_stats(pc);
    assert_int_equal(st.cold_unusable, 1);
    assert_int_equal(st.cold_restores, 0);
    assert_int_equal(st.promotions, 0);
    mem_tier_counts c = mem_tier_counts_get(mt);
    assert_int_equal(c.hooks_given, c.hooks_run); /* the dropped restore was released */
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

static void test_promotion(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    tier_put(mt, "", t, 12, "kk");
    kvt_prompt_cache *plain = mk(mt, 0);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(plain, t, 14, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    kvt_hit_clear(&h);
    assert_false(kvt_prompt_cache_find_exact(plain, t, 12, "", NULL)); /* not promoted */
    kvt_prompt_cache_destroy(plain);

    kvt_prompt_cache *pc = mk(mt, KVT_PC_PROMOTE_RESTORES);
    int64_t runs0 = mem_tier_counts_get(mt).hooks_run;
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 14, "", "s", &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 12);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    assert_int_equal(pcu_stats(pc).promotions, 1);
    /* a second request reuses RAM before the first one finishes */
    kvt_hit h2;
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 15, "", NULL, &h2), 0);
    assert_int_equal(h2.source, KVT_HIT_RAM);
    assert_int_equal(h2.prefix_len, 12);
    assert_int_equal(mem_tier_counts_get(mt).restores, 2);
    /* the session follows the promoted entry */
    kvt_hit h3;
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 16, "", "s", &h3), 0);
    assert_int_equal(h3.source, KVT_HIT_SESSION);
    kvt_hit_clear(&h3);
    /* the restore's release hook runs once: after the views and the RAM copy */
    kvt_hit_clear(&h);
    kvt_hit_clear(&h2);
    assert_int_equal(mem_tier_counts_get(mt).hooks_run, runs0);
    kvt_prompt_cache_clear(pc);
    assert_int_equal(mem_tier_counts_get(mt).hooks_run, runs0 + 1);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

static void test_prefetch_coalesces_and_pins(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(mt, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    tier_put(mt, "", t, 12, "kk");
    mem_tier_gate(mt, 1);
    kvt_lease *l1, *l2, *l3;
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 14, "", NULL, &l1), 0);
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 13, "", NULL, &l2), 0); /* same stored entry */
    assert_int_equal(kvt_lease_wait(l1, 0), KVT_EAGAIN);
    assert_int_equal(kvt_lease_wait(l1, 20), KVT_EAGAIN);
    assert_int_equal(mem_tier_counts_get(mt).async_restores, 1);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.prefetch_reads, 1);
    assert_int_equal(s.prefetch_coalesced, 1);
    mem_tier_gate(mt, 0);
    assert_int_equal(kvt_lease_wait(l1, UINT64_MAX), 0);
    assert_int_equal(kvt_lease_wait(l2, 5000), 0);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    assert_int_equal(pcu_stats(pc).pinned, 1);
    /* RAM holds it now: another prefetch reads nothing */
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 14, "", NULL, &l3), 0);
    assert_int_equal(kvt_lease_wait(l3, 0), 0);
    kvt_lease_release(l3);
    assert_int_equal(mem_tier_counts_get(mt).async_restores, 1);
    /* pinned while any interest remains */
    assert_int_equal(kvt_prompt_cache_set_max_bytes(pc, 0), 0);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    kvt_lease_release(l1);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    kvt_lease_release(l2);
    assert_false(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    assert_int_equal(pcu_stats(pc).pinned, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

static void test_prefetch_session_and_refusal(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(mt, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 8, "k", "s"), 0);
    kvt_lease *l;
    /* the session's resident entry serves: pinned, no read (the cold index
     * is asked, 3.4, and holds nothing longer) */
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 12, "", "s", &l), 0);
    assert_int_equal(pcu_stats(pc).pinned, 1);
    assert_int_equal(mem_tier_counts_get(mt).restores, 0);
    assert_int_equal(mem_tier_counts_get(mt).async_restores, 0);
    assert_int_equal(pcu_stats(pc).prefetch_reads, 0);
    kvt_lease_release(l);
    assert_int_equal(pcu_stats(pc).pinned, 0);
    /* a tier that refuses the async read: the error comes back, no lease */
    tier_put(mt, "", t, 12, "k");
    mem_tier_no_async(mt, 1);
    l = (kvt_lease *)&l;
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 14, "", NULL, &l), KVT_EAGAIN);
    assert_null(l);
    assert_int_equal(pcu_stats(pc).pinned, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* 3.4 + 3.10: a session hit skips the tree walk, not the cold tier; a
 * strictly longer cold prefix wins over the session's entry (a restarted
 * process whose session entry is shorter than what the SSD holds) */
static void test_session_hit_asks_cold(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(mt, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 8, "k", "s"), 0);
    tier_put(mt, "", t, 8, "k");
    kvt_hit h;
    /* equal length in the cold tier: the session's entry serves, no restore */
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 14, "", "s", &h), 0);
    assert_int_equal(h.source, KVT_HIT_SESSION);
    assert_int_equal(h.prefix_len, 8);
    kvt_hit_clear(&h);
    assert_int_equal(mem_tier_counts_get(mt).restores, 0);
    /* strictly longer in the cold tier: it serves */
    tier_put(mt, "", t, 12, "k");
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 14, "", "s", &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 12);
    assert_int_equal(kvt_cache_offset(h.entry.caches[0]), 12);
    assert_memory_equal(h.entry.tokens, t, 12 * sizeof(int32_t));
    kvt_hit_clear(&h);
    /* the cold restore fails: the session's entry still serves */
    mem_tier_fail_restores(mt, 1);
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 14, "", "s", &h), 0);
    assert_int_equal(h.source, KVT_HIT_SESSION);
    assert_int_equal(h.prefix_len, 8);
    assert_int_equal(kvt_cache_offset(h.entry.caches[0]), 8);
    kvt_hit_clear(&h);
    mem_tier_fail_restores(mt, 0);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.session_hits, 3); /* RAM candidacy: the session's entry each time */
    assert_int_equal(s.hits, 3);
    assert_int_equal(s.prefix_walks, 0);
    assert_int_equal(s.cold_restores, 1);
    assert_int_equal(s.cold_failures, 1);
    /* prefetch: the session's entry does not hide a longer cold prefix either */
    kvt_lease *l;
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 14, "", "s", &l), 0);
    assert_int_equal(kvt_lease_wait(l, 10000), 0);
    mem_tier_quiesce(mt);
    assert_int_equal(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL), 1);
    kvt_lease_release(l);
    kvt_prompt_cache_destroy(pc);
    mem_tier_counts c = mem_tier_counts_get(mt);
    mem_tier_destroy(mt);
    assert_int_equal(c.hooks_given, c.hooks_run);
}

static void test_clear_during_read_discards(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(mt, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    tier_put(mt, "", t, 12, "kk");
    mem_tier_gate(mt, 1);
    kvt_lease *l;
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 14, "", NULL, &l), 0);
    kvt_prompt_cache_clear(pc);
    mem_tier_gate(mt, 0);
    assert_int_equal(kvt_lease_wait(l, UINT64_MAX), KVT_ESTALE);
    kvt_lease_release(l);
    mem_tier_quiesce(mt);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    assert_int_equal(s.entries, 0);
    assert_int_equal(s.prefetch_discarded, 1);
    mem_tier_counts c = mem_tier_counts_get(mt);
    assert_int_equal(c.hooks_given, 1);
    assert_int_equal(c.hooks_run, 1); /* the discarded read was released */
    /* a delayed read with no interest left is still published */
    mem_tier_async_delay(mt, 10);
    assert_int_equal(kvt_prompt_cache_prefetch(pc, t, 14, "", NULL, &l), 0);
    kvt_lease_release(l);
    mem_tier_quiesce(mt);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    assert_int_equal(pcu_stats(pc).pinned, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

static void test_restore_failure_falls_back(void **state)
{
    (void)state;
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache *pc = mk(mt, 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    assert_int_equal(pcu_put_fresh(pc, "", t, 4, "k", NULL), 0);
    tier_put(mt, "", t, 12, "k");
    mem_tier_fail_restores(mt, 1);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, t, 14, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_RAM);
    assert_int_equal(h.prefix_len, 4);
    kvt_hit_clear(&h);
    assert_int_equal(pcu_stats(pc).cold_failures, 1);
    kvt_prompt_cache_destroy(pc);
    mem_tier_destroy(mt);
}

/* out of memory at each allocation of a cold take (restore + promotion), an
 * object restore and a prefetch: every call succeeds or fails cleanly, the
 * cache stays consistent and every restored entry's hook runs once */
static void test_out_of_memory_cold_paths(void **state)
{
    (void)state;
    long k;
    int failures = 0;
    for (k = 1; k < 3000; k++) {
        mem_tier *mt;
        assert_int_equal(mem_tier_create(&mt), 0);
        kvt_prompt_cache *pc = mk(mt, KVT_PC_PROMOTE_RESTORES);
        int32_t t[16];
        pcu_seq(t, 16, 1);
        tier_put(mt, "", t, 12, "kk");
        int32_t u[16];
        pcu_seq(u, 16, 500);
        tier_put(mt, "", u, 10, "k");
        kvt_entry obj;
        assert_int_equal(kvt_entry_init(&obj, "object:img", NULL, 0, 0, 1), 0);
        assert_int_equal(kvt_attachment_blob("v", "pixels", 6, &obj.attachments[0]), 0);
        assert_int_equal(mem_tier_insert(mt, &obj), 0);
        oom_arm(k);
        kvt_hit h;
        int rc1 = kvt_prompt_cache_lend(pc, t, 14, "", "s", &h);
        if (rc1 == 0)
            kvt_hit_clear(&h);
        int rc2 = kvt_prompt_cache_object_lend(pc, "img", &h);
        if (rc2 == 0)
            kvt_hit_clear(&h);
        kvt_lease *l = NULL;
        int rc3 = kvt_prompt_cache_prefetch(pc, u, 12, "", NULL, &l);
        int rc4 = rc3 == 0 ? kvt_lease_wait(l, UINT64_MAX) : 0;
        kvt_lease_release(l);
        mem_tier_quiesce(mt);
        kvt_set_allocator(NULL);
        int rcs[4] = {rc1, rc2, rc3, rc4};
        for (int i = 0; i < 4; i++) {
            if (rcs[i] == KVT_ENOMEM || (i == 1 && rcs[i] == KVT_ENOTFOUND))
                failures += rcs[i] != 0;
            else if (rcs[i] != 0)
                fail_msg("allocation %ld: call %d returned %d (%s)", k, i, rcs[i], kvt_last_error());
        }
        kvt_prompt_cache_stats s = pcu_stats(pc);
        assert_int_equal(s.pinned, 0);
        kvt_prompt_cache_clear(pc);
        assert_int_equal(pcu_stats(pc).bytes, 0);
        kvt_prompt_cache_destroy(pc);
        mem_tier_clear(mt);
        mem_tier_counts c = mem_tier_counts_get(mt);
        assert_int_equal(c.hooks_run, c.hooks_given);
        mem_tier_destroy(mt);
        if (oom_calls() < k)
            break; /* every allocation of the sequence has failed once */
    }
    printf("  out of memory injected at each of %ld allocations: %d calls failed cleanly\n", k - 1, failures);
    assert_true(k < 3000);
    assert_true(failures > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cold_only_when_strictly_longer),
        cmocka_unit_test(test_untrimmable_cold_tail_dropped),
        cmocka_unit_test(test_cold_claims_checked),
        cmocka_unit_test(test_promotion),
        cmocka_unit_test(test_prefetch_coalesces_and_pins),
        cmocka_unit_test(test_prefetch_session_and_refusal),
        cmocka_unit_test(test_session_hit_asks_cold),
        cmocka_unit_test(test_clear_during_read_discards),
        cmocka_unit_test(test_restore_failure_falls_back),
        cmocka_unit_test(test_out_of_memory_cold_paths),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
