/*
 * test_long_store_crash.c: crash safety of the SSD tier's write-behind (issue 5):
 * 200 trials of a child process writing many entries through the
 * write-behind queue, killed with SIGKILL at a random point; the parent then
 * reopens the store and checks that no partial shard is indexed or refused,
 * no temp file survives, and every indexed entry restores (SHA-256 verified)
 * to exactly the bytes that were written. Seed printed; KVT_TEST_SEED replays.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_seed.h"

#include "store_util.h"

#include <stdlib.h>
#include <time.h>

static void crash_trials(void **state)
{
    (void)state;
    uint64_t seed = test_seed("test_long_store_crash");
    assert_int_equal(store_crash_trials(200, seed, getenv("KVT_TEST_VERBOSE") != NULL), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(crash_trials)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
