/*
 * test_pc_point_range.c: an entry with a layer whose reachable range is a
 * single point (a recurrent state, a sliding-window ring that has wrapped) is
 * untrimmable (DESIGN.md 2), and block-granular eviction keeps entry-level
 * rules for it: its blocks are not tracked by the block policy and, while a
 * trimmable entry has a block that can go, it stays whole even when it is
 * the older one (kvt_prompt_cache_config.block_policy: "untrimmable entries
 * ... still leave whole by `retention`"). Counting such an entry trimmable
 * (its reach is its whole length, so every lookup still treats it as
 * untrimmable) puts its blocks under the block policy, which then evicts it
 * whole before the newer trimmable entry loses a block.
 * kv caches with blocks of 4 tokens (pc_util.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/prompt_cache.h"
#include "kvtier/experimental/retention_block.h"
#include "pc_util.h"

/* u (8 tokens, layers `kinds`, a point range after 8 tokens) then t (12
 * tokens, one kv layer) in a block-mode cache; then one byte less budget. */
static void check_point_range_stays(const char *kinds)
{
    kvt_block_policy *bp = NULL;
    assert_int_equal(kvt_block_policy_create("lru", 16, &bp), 0);
    kvt_prompt_cache_config cfg = {.max_bytes = (size_t)1 << 30, .block_tokens = PCU_BLOCK, .block_policy = bp};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    int32_t u[8], t[12];
    pcu_seq(u, 8, 100);
    pcu_seq(t, 12, 300);
    kvt_cache *c[2];
    assert_int_equal(pcu_fresh(kinds, c, u, 8), 0);
    int64_t lo = -1, off = -1;
    kvt_cache_range(c[1], &lo, &off);
    assert_int_equal(lo, 8); /* the point range [8, 8] */
    assert_int_equal(off, 8);
    assert_int_equal(pcu_put(pc, "", u, 8, c, 2, NULL, 0, (kvt_hook){0}, NULL), 0);
    assert_int_equal(kvt_block_policy_count(bp), 0); /* u's blocks are not the block policy's */
    assert_int_equal(pcu_put_fresh(pc, "", t, 12, "k", NULL), 0);
    assert_int_equal(kvt_block_policy_count(bp), 3); /* t's 3 blocks only */
    /* u is older, but a block of t can go: t is cut back one block, u stays whole */
    size_t now = pcu_stats(pc).bytes;
    assert_int_equal(kvt_prompt_cache_set_max_bytes(pc, now - 1), 0);
    kvt_prompt_cache_stats s = pcu_stats(pc);
    if (!kvt_prompt_cache_find_exact(pc, u, 8, "", NULL))
        fail_msg("%s: the untrimmable entry was evicted (evictions %llu, block cuts %llu) while a trimmable "
                 "block could go", kinds, (unsigned long long)s.evictions, (unsigned long long)s.block_cuts);
    assert_true(kvt_prompt_cache_find_exact(pc, t, 8, "", NULL));
    assert_false(kvt_prompt_cache_find_exact(pc, t, 12, "", NULL));
    assert_int_equal(s.block_cuts, 1);
    assert_int_equal(s.evictions, 0);
    assert_int_equal(s.entries, 2);
    /* the prompt extending u is served by u at its whole length only */
    int32_t p[9];
    pcu_seq(p, 9, 100);
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 9, "", NULL), 8);
    assert_int_equal(kvt_prompt_cache_peek(pc, p, 7, "", NULL), 0);
    kvt_prompt_cache_destroy(pc);
    kvt_block_policy_destroy(bp);
}

static void test_recurrent_layer_stays_whole(void **state)
{
    (void)state;
    check_point_range_stays("kr");
}

static void test_wrapped_ring_stays_whole(void **state)
{
    (void)state;
    check_point_range_stays("kw"); /* a ring of 6 after 8 tokens has wrapped */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_recurrent_layer_stays_whole),
        cmocka_unit_test(test_wrapped_ring_stays_whole),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
