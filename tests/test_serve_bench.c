/*
 * test_serve_bench.c: `kvtier bench serve` on stories260K with one-token
 * decode streams (--decode-tokens 1): every stream's tokens arrive in one
 * server-sent event, which is a reply, not a request error (the bench
 * counted each such stream as an error and exited 1); the server's overhead
 * per request is printed beside its baseline (a GET /health round trip of the
 * same run). Skipped with a message
 * when KVT_BIN or the model is missing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* The number printed right after the first `label` in `from` (the test
 * fails when the label is missing). */
static double number_after(const char *from, const char *label)
{
    const char *p = strstr(from, label);
    assert_non_null(p);
    return strtod(p + strlen(label), NULL);
}

static void test_one_event_streams(void **state)
{
    (void)state;
    const char *bin = getenv("KVT_BIN"), *shared = getenv("KVT_SHARED_DIR");
    char model[1024], tok[1024];
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tok, sizeof tok, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    if (!bin || access(model, R_OK) || access(tok, R_OK)) {
        printf("test_serve_bench: skipped: needs KVT_BIN and %s with tok512.bin (set KVT_SHARED_DIR)\n", model);
        skip();
    }
    char out[] = "/tmp/kvt_serve_bench_XXXXXX";
    int fd = mkstemp(out);
    assert_true(fd >= 0);
    close(fd);
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "'%s' bench serve --model '%s' --tokenizer '%s' --streams 3 --turns 2 --max-tokens 4 "
             "--decode-tokens 1 --decode-rounds 1 --overhead-requests 3 >'%s' 2>&1",
             bin, model, tok, out);
    int st = system(cmd);
    FILE *f = fopen(out, "r");
    assert_non_null(f);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
    unlink(out);
    printf("%s", text);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_non_null(strstr(text, "request errors: 0\n"));
    assert_non_null(strstr(text, "replies identical with and without the cache: yes"));
    /* one round per server: 1 stream, then 3 streams, each in one event */
    assert_non_null(strstr(text, "4 streams got all their tokens in one event"));
    /* the overhead is printed beside its baseline, both measured (a GET
     * /health round trip is not free and the completion's overhead is not
     * below it by more than noise allows: both > 0) */
    const char *o = strstr(text, "server overhead per request");
    assert_non_null(o);
    /* ... on one kept-alive connection (as SDK clients send requests), and
     * again with a new connection per request, each beside its baseline */
    assert_non_null(strstr(o, "kept-alive HTTP/1.1 connection"));
    const char *nw = strstr(o, "with a new HTTP/1.0 connection per request");
    assert_non_null(nw);
    double over = number_after(o, "): "), base = number_after(o, "alternating with them: ");
    double over_new = number_after(nw, "counted): "), base_new = number_after(nw, "alternating with them: ");
    printf("overhead %.3f ms, GET /health %.3f ms (kept-alive connection)\n", over, base);
    printf("overhead %.3f ms, GET /health %.3f ms (a new connection per request)\n", over_new, base_new);
    assert_true(over > 0.0 && over < 1000.0);
    assert_true(base > 0.0 && base < 1000.0);
    assert_true(over_new > 0.0 && over_new < 1000.0);
    assert_true(base_new > 0.0 && base_new < 1000.0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_event_streams),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
