/*
 * test_long_serve_crash.c: SIGKILL crash trials of `kvtier serve --ssd-cache`, 200 trials (label long; a short version is test_serve_crash):
 * 8 clients run multi-turn chats against the server, which is killed at a
 * random moment and restarted on the same SSD directory. Every reply before
 * and after each restart equals the cache-off server's; `kvtier store
 * verify` passes after every kill; the SSD tier is still reused after the
 * restarts; a last restart stops cleanly. Then the same with a Redis shared
 * with a survivor server (every third restart on a wiped SSD directory must
 * still reuse tokens, through Redis). Seed printed; KVT_TEST_SEED
 * replays; KVT_TEST_VERBOSE=1 prints each trial; KVT_TEST_FILTER=crash_trials_redis
 * runs one of the two. (tests/support/serve_crash.c)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>

#include "serve_crash.h"

static void crash_trials(void **state)
{
    (void)state;
    serve_crash_run("test_long_serve_crash", 200);
}

/* The same with Redis: a survivor shares it, and every third restart is on
 * a wiped SSD directory, served through Redis. */
static void crash_trials_redis(void **state)
{
    (void)state;
    serve_crash_opts o = {.redis = 1};
    serve_crash_run_opts("test_long_serve_crash_redis", 200, &o);
}

int main(void)
{
    const char *only = getenv("KVT_TEST_FILTER"); /* e.g. crash_trials_redis: run that test alone */
    if (only && *only)
        cmocka_set_test_filter(only);
    const struct CMUnitTest tests[] = {cmocka_unit_test(crash_trials), cmocka_unit_test(crash_trials_redis)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
