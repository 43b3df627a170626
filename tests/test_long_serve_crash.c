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

static void crash_trials(void **state)
{
    (void)state;
    serve_crash_run("test_long_serve_crash", 200);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(crash_trials)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
