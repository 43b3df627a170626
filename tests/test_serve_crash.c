/*
 * test_serve_crash.c: SIGKILL crash trials of `kvtier serve --ssd-cache`, a few trials (make test; 200 in test_long_serve_crash):
 * 8 clients run multi-turn chats against the server, which is killed at a
 * random moment and restarted on the same SSD directory. Every reply before
 * and after each restart equals the cache-off server's; `kvtier store
 * verify` passes after every kill; the SSD tier is still reused after the
 * restarts; a last restart stops cleanly. Then the same with a Redis shared
 * with a survivor server (every third restart on a wiped SSD directory must
 * still reuse tokens, through Redis). Seed printed; KVT_TEST_SEED
 * replays; KVT_TEST_VERBOSE=1 prints each trial. (tests/support/serve_crash.c)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "child_guard.h"
#include "serve_crash.h"

static void crash_trials(void **state)
{
    (void)state;
    serve_crash_run("test_serve_crash", 5);
}

/* The same with Redis: a survivor shares it, and every third restart is on
 * a wiped SSD directory, served through Redis. */
static void crash_trials_redis(void **state)
{
    (void)state;
    serve_crash_opts o = {.redis = 1};
    serve_crash_run_opts("test_serve_crash_redis", 4, &o);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test_teardown(crash_trials, child_guard_teardown),
                                       cmocka_unit_test_teardown(crash_trials_redis, child_guard_teardown)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
