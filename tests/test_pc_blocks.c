/*
 * test_pc_blocks.c: block-granular eviction in the prompt cache
 * (kvt_prompt_cache_config.block_policy, src/ram/pc_blocks.c, issue 6): a
 * trimmable entry loses its tail blocks, not its whole history; partial
 * tails go first; leaf first along shared prefixes; untrimmable and pinned
 * entries keep entry-level rules; lfu-aged keeps reused blocks over newer
 * single-use ones; and a randomized run (seed printed, KVT_TEST_SEED to
 * replay) keeps the budget and lends only correct prefixes.
 * kv caches with blocks of 4 tokens (pc_util.h).
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

#include "test_seed.h"

#include "kvtier/prompt_cache.h"
#include "kvtier/experimental/retention_block.h"
#include "mem_tier.h"
#include "oom_alloc.h"
#include "pc_util.h"

typedef struct fixture {
    kvt_block_policy *bp;
    kvt_prompt_cache *pc;
} fixture;

static fixture mk(const char *policy, int64_t capacity_blocks)
{
    fixture f = {0};
    assert_int_equal(kvt_block_policy_create(policy, capacity_blocks, &f.bp), 0);
    kvt_prompt_cache_config cfg = {.max_bytes = (size_t)1 << 30, .block_tokens = PCU_BLOCK,
                                   .block_policy = f.bp};
    assert_int_equal(kvt_prompt_cache_create(&cfg, &f.pc), 0);
    return f;
}

static fixture mk_cold(const char *policy, int64_t capacity_blocks, const kvt_cold_tier *cold)
{
    fixture f = {0};
    assert_int_equal(kvt_block_policy_create(policy, capacity_blocks, &f.bp), 0);
    kvt_prompt_cache_config cfg = {.max_bytes = (size_t)1 << 30, .block_tokens = PCU_BLOCK,
                                   .block_policy = f.bp, .cold = cold};
    assert_int_equal(kvt_prompt_cache_create(&cfg, &f.pc), 0);
    return f;
}

static void done(fixture *f)
{
    kvt_prompt_cache_destroy(f->pc);
    kvt_block_policy_destroy(f->bp);
}

static int has(kvt_prompt_cache *pc, const int32_t *t, int64_t n)
{
    return kvt_prompt_cache_find_exact(pc, t, n, "", NULL);
}

/* Lowers the budget by `bytes` below what the cache holds now. */
static void squeeze(kvt_prompt_cache *pc, size_t bytes)
{
    size_t now = pcu_stats(pc).bytes;
    assert_int_equal(kvt_prompt_cache_set_max_bytes(pc, now > bytes ? now - bytes : 0), 0);
    assert_true(pcu_stats(pc).bytes <= pcu_stats(pc).max_bytes);
}

/* take of prompt (n), then the engine extends and puts the whole prompt. */
static int64_t turn(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n)
{
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(pc, prompt, n, "", NULL, &h), 0);
    int64_t p = h.prefix_len;
    if (p > 0)
        assert_memory_equal(h.entry.tokens, prompt, (size_t)p * sizeof *prompt);
    kvt_cache *c[1];
    if (p > 0 && h.entry.n_caches == 1) {
        c[0] = h.entry.caches[0];
        h.entry.caches[0] = NULL;
        assert_int_equal(pcu_extend(c, 1, prompt + p, n - p), 0);
    } else {
        p = 0;
        assert_int_equal(pcu_fresh("k", c, prompt, n), 0);
    }
    kvt_hit_clear(&h);
    assert_int_equal(pcu_put(pc, "", prompt, n, c, 1, NULL, 0, (kvt_hook){0}, NULL), 0);
    return p;
}

static void test_cut_tail_not_entry(void **state)
{
    (void)state;
    fixture f = mk("lru", 16);
    int32_t a[13];
    pcu_seq(a, 13, 100);
    assert_int_equal(pcu_put_fresh(f.pc, "", a, 12, "k", NULL), 0);
    squeeze(f.pc, 1);
    assert_true(has(f.pc, a, 8));
    assert_false(has(f.pc, a, 12));
    kvt_prompt_cache_stats s = pcu_stats(f.pc);
    assert_int_equal(s.block_cuts, 1);
    assert_int_equal(s.blocks_cut, 1);
    assert_int_equal(s.evictions, 0);
    assert_int_equal(s.entries, 1);
    /* what is left still serves */
    assert_int_equal(kvt_prompt_cache_peek(f.pc, a, 13, "", NULL), 8);
    done(&f);
}

static void test_partial_tail_first(void **state)
{
    (void)state;
    fixture f = mk("lru", 16);
    int32_t a[10], b[8];
    pcu_seq(b, 8, 500);
    pcu_seq(a, 10, 100);
    assert_int_equal(turn(f.pc, b, 8), 0);  /* older */
    assert_int_equal(turn(f.pc, a, 10), 0); /* newer, ends in a 2-token tail */
    squeeze(f.pc, 1);
    assert_true(has(f.pc, a, 8));
    assert_true(has(f.pc, b, 8));
    assert_int_equal(pcu_stats(f.pc).blocks_cut, 1);
    /* then plain recency: b's last block */
    squeeze(f.pc, 1);
    assert_true(has(f.pc, b, 4));
    assert_true(has(f.pc, a, 8));
    done(&f);
}

static void test_leaf_first_shared_prefix(void **state)
{
    (void)state;
    fixture f = mk("lru", 16);
    int32_t a[12], b[12];
    pcu_seq(a, 12, 100);
    memcpy(b, a, 8 * sizeof *a);
    pcu_seq(b + 8, 4, 900);
    assert_int_equal(turn(f.pc, a, 12), 0);
    assert_int_equal(turn(f.pc, b, 12), 8);
    size_t before = pcu_stats(f.pc).bytes;
    /* a's own tail is the oldest block */
    squeeze(f.pc, 1);
    assert_true(has(f.pc, a, 8));
    assert_true(has(f.pc, b, 12));
    assert_true(pcu_stats(f.pc).bytes < before);
    /* then b's tail (deeper than the shared blocks it was used with); b cut
     * back to the shared prefix replaces a's remainder */
    squeeze(f.pc, 1);
    assert_true(has(f.pc, b, 8));
    assert_false(has(f.pc, b, 12));
    kvt_prompt_cache_stats s = pcu_stats(f.pc);
    assert_int_equal(s.entries, 1);
    assert_true(s.replacements >= 1);
    /* then the shared prefix from its end, never its head first */
    squeeze(f.pc, 1);
    assert_true(has(f.pc, a, 4));
    squeeze(f.pc, 1);
    assert_int_equal(pcu_stats(f.pc).entries, 0);
    assert_int_equal(pcu_stats(f.pc).evictions, 1);
    done(&f);
}

static void test_untrimmable_whole(void **state)
{
    (void)state;
    fixture f = mk("lru", 16);
    int32_t u[8], t[12];
    pcu_seq(u, 8, 100);
    pcu_seq(t, 12, 300);
    kvt_cache *c[1];
    kvt_attachment *att[1];
    assert_int_equal(pcu_fresh("k", c, u, 8), 0);
    assert_int_equal(kvt_attachment_blob("img", "xyz", 3, &att[0]), 0);
    assert_int_equal(pcu_put(f.pc, "", u, 8, c, 1, att, 1, (kvt_hook){0}, NULL), 0);
    assert_int_equal(pcu_put_fresh(f.pc, "", t, 12, "k", NULL), 0);
    /* the older untrimmable entry stays while a trimmable block can go */
    squeeze(f.pc, 1);
    assert_true(has(f.pc, u, 8));
    assert_true(has(f.pc, t, 8));
    /* at budget 0 the trimmable entry is cut to nothing, then u leaves whole */
    assert_int_equal(kvt_prompt_cache_set_max_bytes(f.pc, 0), 0);
    kvt_prompt_cache_stats s = pcu_stats(f.pc);
    assert_int_equal(s.entries, 0);
    assert_int_equal(s.bytes, 0);
    assert_int_equal(s.evictions, 2);
    assert_int_equal(kvt_block_policy_count(f.bp), 0);
    done(&f);
}

static void test_pinned_not_cut(void **state)
{
    (void)state;
    fixture f = mk("lru", 16);
    int32_t t[12], v[12];
    pcu_seq(t, 12, 100);
    pcu_seq(v, 12, 300);
    assert_int_equal(turn(f.pc, t, 12), 0);
    assert_int_equal(turn(f.pc, v, 12), 0);
    kvt_lease *lease = NULL;
    assert_int_equal(kvt_prompt_cache_pin(f.pc, t, 12, "", &lease), 0);
    /* t's tail is the lowest block but t is pinned: v leaves whole instead */
    squeeze(f.pc, 1);
    assert_true(has(f.pc, t, 12));
    assert_false(has(f.pc, v, 12));
    assert_int_equal(pcu_stats(f.pc).evictions, 1);
    kvt_lease_release(lease);
    done(&f);
}

static void test_lfu_keeps_reused(void **state)
{
    (void)state;
    for (int pass = 0; pass < 2; pass++) {
        fixture f = mk(pass ? "lfu-aged" : "lru", 4);
        int32_t x[9], y[8];
        pcu_seq(x, 9, 100);
        pcu_seq(y, 8, 700);
        assert_int_equal(turn(f.pc, x, 8), 0);
        assert_int_equal(turn(f.pc, x, 9), 8); /* x's blocks used twice */
        assert_int_equal(turn(f.pc, y, 8), 0); /* y once, later */
        assert_int_equal(kvt_prompt_cache_trim(f.pc, x, 9, "", 8), 0); /* drop x's 1-token tail */
        squeeze(f.pc, 1);
        if (pass) { /* lfu-aged: the newer single-use block goes */
            assert_true(has(f.pc, x, 8));
            assert_true(has(f.pc, y, 4));
        } else { /* lru: the older block goes */
            assert_true(has(f.pc, x, 4));
            assert_true(has(f.pc, y, 8));
        }
        done(&f);
    }
}

/* With a cold tier, the first cut of an entry spills its whole prefix (once),
 * and a later take restores the longer prefix from the cold tier. */
static void test_cut_spills_once(void **state)
{
    (void)state;
    mem_tier *mt = NULL;
    assert_int_equal(mem_tier_create(&mt), 0);
    fixture f = mk_cold("lru", 16, mem_tier_iface(mt));
    int32_t a[13];
    pcu_seq(a, 13, 100);
    assert_int_equal(pcu_put_fresh(f.pc, "", a, 12, "k", NULL), 0);
    squeeze(f.pc, 1);
    assert_true(has(f.pc, a, 8));
    assert_int_equal(mem_tier_counts_get(mt).spills, 1);
    assert_true(mem_tier_has(mt, "", a, 12));
    squeeze(f.pc, 1);
    assert_true(has(f.pc, a, 4));
    assert_int_equal(mem_tier_counts_get(mt).spills, 1);
    /* cut to nothing: the cold tier already holds a longer prefix */
    squeeze(f.pc, 1);
    assert_int_equal(pcu_stats(f.pc).entries, 0);
    assert_int_equal(mem_tier_counts_get(mt).spills, 1);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(f.pc, a, 13, "", NULL, &h), 0);
    assert_int_equal(h.source, KVT_HIT_COLD);
    assert_int_equal(h.prefix_len, 12);
    assert_memory_equal(h.entry.tokens, a, 12 * sizeof *a);
    kvt_hit_clear(&h);
    done(&f);
    mem_tier_destroy(mt);
}

/* Out of memory at each allocation of a sequence that cuts blocks: every
 * call fails cleanly or succeeds, what find_exact reports is what peek
 * serves, and after clear neither bytes nor tracked blocks are left. */
static void test_out_of_memory(void **state)
{
    (void)state;
    int failures = 0;
    long k;
    for (k = 1; k < 5000; k++) {
        fixture f = mk(k % 2 ? "lru" : "lfu-aged", 8);
        int32_t a[20], b[20];
        pcu_seq(a, 20, 1);
        memcpy(b, a, 8 * sizeof *a);
        pcu_seq(b + 8, 12, 900);
        assert_int_equal(pcu_put_fresh(f.pc, "", a, 14, "k", NULL), 0);
        size_t one = pcu_stats(f.pc).bytes;
        assert_int_equal(kvt_prompt_cache_set_max_bytes(f.pc, one + one / 4), 0);
        kvt_cache *c[1];
        assert_int_equal(pcu_fresh("k", c, b, 16), 0);
        oom_arm(k);
        int rc1 = pcu_put(f.pc, "", b, 16, c, 1, NULL, 0, (kvt_hook){0}, NULL); /* cuts a */
        kvt_hit h;
        int rc2 = kvt_prompt_cache_lend(f.pc, a, 20, "", NULL, &h);
        if (rc2 == 0)
            kvt_hit_clear(&h);
        int rc3 = kvt_prompt_cache_trim(f.pc, b, 16, "", 10);
        int rc4 = kvt_prompt_cache_set_max_bytes(f.pc, one / 2);
        kvt_set_allocator(NULL);
        int rcs[4] = {rc1, rc2, rc3, rc4};
        for (int i = 0; i < 4; i++) {
            if (rcs[i] == KVT_ENOMEM)
                failures++;
            else if (!(rcs[i] == 0 || (i == 2 && rcs[i] == KVT_ENOTFOUND)))
                fail_msg("allocation %ld: call %d returned %d (%s)", k, i, rcs[i], kvt_last_error());
        }
        kvt_prompt_cache_stats s = pcu_stats(f.pc);
        assert_true(s.bytes <= s.max_bytes);
        for (int64_t n = 1; n <= 16; n++) {
            int64_t pa = kvt_prompt_cache_peek(f.pc, a, 20, "", NULL);
            if (has(f.pc, a, n))
                assert_true(pa >= n);
            int64_t pb = kvt_prompt_cache_peek(f.pc, b, 20, "", NULL);
            if (has(f.pc, b, n))
                assert_true(pb >= n);
        }
        kvt_prompt_cache_clear(f.pc);
        assert_int_equal(pcu_stats(f.pc).bytes, 0);
        assert_int_equal(kvt_block_policy_count(f.bp), 0);
        done(&f);
        if (oom_calls() < k)
            break; /* every allocation of the sequence has failed once */
    }
    printf("  out of memory injected at each of %ld allocations: %d calls failed cleanly\n", k - 1, failures);
    assert_true(k < 5000);
    assert_true(failures > 0);
}

/* Random turns over a few conversations at a small budget: the budget holds
 * after every turn and every lent prefix matches the prompt. */
static void test_random_turns(void **state)
{
    (void)state;
    unsigned seed = (unsigned)test_seed("test_random_turns");
    srand(seed);
    for (int pass = 0; pass < 2; pass++) {
        fixture f = mk(pass ? "lfu-aged" : "lru", 12);
        size_t one = 0;
        { /* bytes of one 4-token entry, to size the budget */
            int32_t p[4];
            pcu_seq(p, 4, 5000);
            assert_int_equal(pcu_put_fresh(f.pc, "", p, 4, "k", NULL), 0);
            one = pcu_stats(f.pc).bytes;
        }
        assert_int_equal(kvt_prompt_cache_set_max_bytes(f.pc, one * 12), 0);
        enum { CONV = 6, MAXLEN = 64 };
        int32_t conv[CONV][MAXLEN];
        int64_t len[CONV] = {0};
        for (int c = 0; c < CONV; c++)
            pcu_seq(conv[c], 5, 10000 * (c % 3)); /* three shared system prompts */
        int64_t hits = 0;
        for (int step = 0; step < 400; step++) {
            int c = rand() % CONV;
            if (len[c] + 8 > MAXLEN)
                len[c] = 0; /* conversation restarts */
            int64_t add = 1 + rand() % 7;
            for (int64_t i = len[c]; i < len[c] + add; i++)
                conv[c][i] = i < 5 ? 10000 * (c % 3) + (int32_t)i : (int32_t)(c * 1000 + i * 7 + step % 3);
            len[c] += add;
            int64_t p = turn(f.pc, conv[c], len[c]);
            hits += p > 0;
            kvt_prompt_cache_stats s = pcu_stats(f.pc);
            assert_true(s.bytes <= s.max_bytes);
        }
        assert_true(hits > 0);
        assert_true(pcu_stats(f.pc).blocks_cut > 0);
        done(&f);
    }
}

/* An entry a prefetch read publishes is block-tracked like a put one: its
 * blocks enter the policy and a squeeze cuts its tail, not the whole entry
 * (the read's entry used to skip the block keys and only left whole). */
static void test_prefetched_entry_is_cut(void **state)
{
    (void)state;
    mem_tier *mt = NULL;
    assert_int_equal(mem_tier_create(&mt), 0);
    fixture f = mk_cold("lru", 16, mem_tier_iface(mt));
    int32_t a[13];
    pcu_seq(a, 13, 300);
    assert_int_equal(pcu_put_fresh(f.pc, "", a, 12, "k", NULL), 0);
    int64_t n_ev = 0;
    assert_int_equal(kvt_prompt_cache_evict(f.pc, 1, &n_ev), 0);
    assert_int_equal(n_ev, 1);
    mem_tier_quiesce(mt);
    assert_true(mem_tier_has(mt, "", a, 12));
    assert_int_equal(kvt_block_policy_count(f.bp), 0);
    kvt_lease *l = NULL;
    assert_int_equal(kvt_prompt_cache_prefetch(f.pc, a, 13, "", NULL, &l), 0);
    assert_int_equal(kvt_lease_wait(l, UINT64_MAX), 0);
    kvt_lease_release(l);
    assert_true(has(f.pc, a, 12));
    assert_int_equal(kvt_block_policy_count(f.bp), 3);
    squeeze(f.pc, 1);
    assert_true(has(f.pc, a, 8));
    assert_false(has(f.pc, a, 12));
    assert_int_equal(pcu_stats(f.pc).block_cuts, 1);
    done(&f);
    mem_tier_destroy(mt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cut_tail_not_entry),
        cmocka_unit_test(test_partial_tail_first),
        cmocka_unit_test(test_leaf_first_shared_prefix),
        cmocka_unit_test(test_untrimmable_whole),
        cmocka_unit_test(test_pinned_not_cut),
        cmocka_unit_test(test_lfu_keeps_reused),
        cmocka_unit_test(test_cut_spills_once),
        cmocka_unit_test(test_out_of_memory),
        cmocka_unit_test(test_random_turns),
        cmocka_unit_test(test_prefetched_entry_is_cut),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
