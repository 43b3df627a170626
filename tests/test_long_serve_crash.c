/*
 * test_long_serve_crash.c: SIGKILL crash trials of `kvtier serve --ssd-cache`, 200 trials (label long; a short version is test_serve_crash):
 * 8 clients run multi-turn chats against the server, which is killed at a
 * random moment and restarted on the same SSD directory. Every reply before
 * and after each restart equals the cache-off server's; `kvtier store
 * verify` passes after every kill; the SSD tier is still reused after the
 * restarts; a last restart stops cleanly. Seed printed; KVT_TEST_SEED
 * replays; KVT_TEST_VERBOSE=1 prints each trial. (tests/support/serve_crash.c)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "serve_crash.h"
#include "test_seed.h"

#include <stdio.h>
#include <stdlib.h>

#define TRIALS 200

static void crash_trials(void **state)
{
    (void)state;
    uint64_t seed = test_seed("test_long_serve_crash");
    serve_crash_report r;
    int rc = serve_crash_trials(TRIALS, seed, getenv("KVT_TEST_VERBOSE") != NULL, &r);
    if (rc == 77) {
        skip();
        return;
    }
    assert_int_equal(rc, 0);
    printf("  %d trials: %lld replies compared with cache-off, %lld wrong; %lld cut by a kill, %lld errors; "
           "%d unclean stores; probe served from the SSD tier after %d of %d restarts; %lld tokens reused from "
           "SSD; last stop exit %d\n",
           r.trials, (long long)r.replies, (long long)r.wrong, (long long)r.dropped, (long long)r.errors, r.unclean,
           r.probe_ssd_hits, r.trials, (long long)r.ssd_tokens, r.final_stop_rc);
    assert_int_equal(r.trials, TRIALS);
    assert_int_equal(r.wrong, 0);
    assert_int_equal(r.unclean, 0);
    assert_true(r.replies > TRIALS);
    assert_int_equal(r.probe_ssd_hits, TRIALS); /* every restart (TRIALS - 1) and the last one */
    assert_true(r.ssd_tokens > 0);
    assert_int_equal(r.final_stop_rc, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(crash_trials)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
