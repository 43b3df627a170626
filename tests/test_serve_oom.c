/*
 * test_serve_oom.c: allocation failure at every allocation of the server's
 * request path (tests/support/serve_oom.c): a chat the cache has never seen,
 * a chat reusing a cached prefix, a streamed chat and a completion of token
 * ids, each with the N-th allocation of its request failed, for every N
 * (about 120 a request): each faulted request is answered with the
 * cache-off reply or an OpenAI error object (or, for a failure inside
 * libmicrohttpd, its connection is closed), and the same request then
 * succeeds. Skipped under ASan/TSan (they own malloc). KVT_TEST_VERBOSE=1
 * prints each failure and where it was.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "serve_oom.h"

#include <stdio.h>
#include <stdlib.h>

static void oom_walk(void **state)
{
    (void)state;
    serve_oom_report r;
    int rc = serve_oom_walk(1, 0, getenv("KVT_TEST_VERBOSE") != NULL, &r);
    if (rc == 77) {
        skip();
        return;
    }
    assert_int_equal(rc, 0);
    int64_t failed = 0;
    for (int k = 0; k < SERVE_OOM_KINDS; k++) {
        printf("  %-24s %5lld allocations a request; %4lld failed: %4lld answered right, %4lld with an error, "
               "%3lld connections closed (libmicrohttpd)\n",
               r.kind[k], (long long)r.allocations[k], (long long)r.failed[k], (long long)r.ok[k],
               (long long)r.errors[k], (long long)r.dropped[k]);
        assert_true(r.allocations[k] > 0);
        assert_true(r.failed[k] > 0);
        failed += r.failed[k];
    }
    assert_int_equal(r.bad, 0);
    assert_true(failed >= 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(oom_walk)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
