/*
 * test_long_store_multiproc.c: several processes on one SSD root with a byte
 * budget. Six writer processes share one identity directory (and so each
 * other's blocks), each putting and restoring entries that share prefixes,
 * under a budget a few entries large. Budget eviction in one process must
 * never delete a block another process's entry references: afterwards
 * kvt_store_walk with verify (`kvtier store verify`) finds every shard good,
 * every restore in every child returned the bytes that were written, and the
 * root is within its budget plus one shard. The long version of
 * test_store_multiproc: 8 trials of 6 writers x 300 rounds. Randomized: prints its seed
 * (KVT_TEST_SEED replays).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "store_util.h"
#include "test_seed.h"

#include <stdio.h>

static void six_writers_one_budget(void **state)
{
    (void)state;
    uint64_t seed = test_seed("six_writers_one_budget");
    const int rounds = 300;
    const uint64_t max = 24u << 10;
    for (int trial = 0; trial < 8; trial++) {
        char root[512];
        store_tmpdir(root, sizeof root, "mprocL");
        store_mp_result r;
        assert_int_equal(store_multiproc_run(root, 6, rounds, max, seed + (uint64_t)trial, &r), 0);
        printf("6 writers x %d rounds, budget %llu: root %llu bytes in %d shards (largest %llu), %d refused\n", rounds,
               (unsigned long long)max, (unsigned long long)r.bytes, r.shards, (unsigned long long)r.biggest, r.bad);
        assert_int_equal(r.failed_writers, 0);
        assert_int_equal(r.bad, 0);
        assert_true(r.shards > 0);
        if (r.bytes > max + r.biggest)
            fail_msg("root holds %llu bytes: over the budget %llu plus one shard (%llu)", (unsigned long long)r.bytes,
                     (unsigned long long)max, (unsigned long long)r.biggest);
        store_rmtree(root);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(six_writers_one_budget)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
