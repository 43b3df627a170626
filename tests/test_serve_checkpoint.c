/*
 * test_serve_checkpoint.c: `kvtier serve --ssd-cache DIR --checkpoint-every 8`
 * and the Idempotency-Key header. A streamed completion with a key is cut
 * by SIGKILL of the server mid-generation; a new server on the same
 * directory gets the same request with the same key: the reply (the whole
 * of it, once) equals the one a server without checkpoints gives, and when
 * it resumed, usage.kvtier.resumed_tokens > 0 and nothing was prefilled.
 * Sampled with a seed (temperature 0.8, top-p 0.9), stories260K (skipped
 * with a message when absent). A repeat whose seed differs from the
 * interrupted request's is a 422 naming "seed"; a key with a control
 * character is a 400. The servers with checkpoints run --checkpoint-sync:
 * the checkpoints the stream passed are durable however fast the decode
 * runs against the disk (written behind decode, a fast CPU could finish
 * before the first one reached it). Needs KVT_BIN.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "cli_run.h"
#include "serve_util.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char model[1024], tok[1024], dir[512], ssd[600];
static const char *bin;

/* receive timeout of one request (s): a bound on the wait, scaled like the
 * suite's other waits (a Debug TSan server answered in over 60 s at load 17-23) */
#define RECV_S (60 * KVT_TEST_TIME_SCALE)

#define BODY(seed, stream)                                                                                    \
    "{\"prompt\": \"Once upon a time\", \"max_tokens\": 400, \"temperature\": 0.8, \"top_p\": 0.9, \"seed\": " \
    seed ", \"stream\": " stream "}"

/* choices[0].text and usage.kvtier fields of a completion response. */
static char *completion(const char *body, long long *resumed, long long *prefilled)
{
    json_error_t e;
    json_t *d = json_loads(body, 0, &e);
    if (!d)
        fail_msg("not JSON: %s", body);
    const char *text = json_string_value(json_object_get(json_array_get(json_object_get(d, "choices"), 0), "text"));
    assert_non_null(text);
    json_t *kv = json_object_get(json_object_get(d, "usage"), "kvtier");
    *resumed = json_integer_value(json_object_get(kv, "resumed_tokens"));
    *prefilled = json_integer_value(json_object_get(kv, "prefilled_tokens"));
    char *t = strdup(text);
    json_decref(d);
    return t;
}

static int start(kvt_ts_server *sv, int checkpoints, int n)
{
    char log[700];
    snprintf(log, sizeof log, "%s/serve%d.log", dir, n);
    const char *plain[] = {"--model", model, "--tokenizer", tok, "--threads", "1", NULL};
    const char *ck[] = {"--model", model, "--tokenizer", tok, "--threads", "1", "--ssd-cache", ssd,
                        "--checkpoint-every", "8", "--checkpoint-sync", NULL};
    return kvt_ts_server_start(sv, bin, log, checkpoints ? ck : plain);
}

/* Starts a streamed request with the key and kills the server once `after`
 * bytes of the stream arrived. */
static void interrupt(kvt_ts_server *sv, const char *key, size_t after)
{
    int fd = kvt_ts_connect(sv->port, 30);
    assert_true(fd >= 0);
    char h[300];
    snprintf(h, sizeof h, "Idempotency-Key: %s\r\n", key);
    kvt_ts_send_request(fd, "POST", "/v1/completions", h, BODY("5", "true"));
    size_t got = 0;
    char buf[256];
    while (got < after) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    kvt_ts_server_kill(sv);
    close(fd);
}

static void test_idempotency_key_resumes(void **state)
{
    (void)state;
    bin = getenv("KVT_BIN");
    if (!cli_inputs(model, sizeof model, tok, sizeof tok))
        return;
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvt_serve_ckpt_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    assert_non_null(mkdtemp(dir));
    snprintf(ssd, sizeof ssd, "%s/ssd", dir);

    /* the reference: a server without checkpoints */
    kvt_ts_server sv;
    int n = 0;
    assert_int_equal(start(&sv, 0, n++), 0);
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(sv.port, "POST", "/v1/completions", NULL, BODY("5", "false"), RECV_S, &r), 200);
    long long resumed, prefilled;
    char *ref = completion(r.body, &resumed, &prefilled);
    kvt_ts_resp_free(&r);
    assert_int_equal(kvt_ts_server_stop(&sv), 0);
    assert_true(strlen(ref) > 300);

    /* killed mid-stream, then the same request with the same key on a new
     * server: up to 5 attempts (a kill before the first checkpoint reached
     * the disk starts over, and must still give the same reply) */
    int resumed_once = 0;
    for (int attempt = 0; attempt < 5 && !resumed_once; attempt++) {
        char key[32];
        snprintf(key, sizeof key, "job-%d", attempt);
        assert_int_equal(start(&sv, 1, n++), 0);
        interrupt(&sv, key, 3000 + 3000 * (size_t)attempt);
        assert_int_equal(start(&sv, 1, n++), 0);
        char h[300];
        snprintf(h, sizeof h, "Idempotency-Key: %s\r\n", key);
        assert_int_equal(kvt_ts_http(sv.port, "POST", "/v1/completions", h, BODY("5", "false"), RECV_S, &r), 200);
        char *got = completion(r.body, &resumed, &prefilled);
        kvt_ts_resp_free(&r);
        print_message("  attempt %d: resumed %lld reply tokens, prefilled %lld\n", attempt, resumed, prefilled);
        assert_string_equal(got, ref);
        free(got);
        if (resumed > 0) {
            resumed_once = 1;
            assert_int_equal(resumed % 8, 7); /* a checkpoint at a multiple of 8 generated tokens */
            assert_int_equal(prefilled, 0);
        }
        assert_int_equal(kvt_ts_server_stop(&sv), 0);
    }
    assert_true(resumed_once);

    /* an interrupted request repeated with another seed: 422 naming it (again
     * up to 5 attempts: a kill before its first checkpoint was durable leaves
     * nothing to mismatch, and that repeat simply runs) */
    int refused = 0;
    for (int attempt = 0; attempt < 5 && !refused; attempt++) {
        char key[32], h[300];
        snprintf(key, sizeof key, "mismatch-%d", attempt);
        snprintf(h, sizeof h, "Idempotency-Key: %s\r\n", key);
        assert_int_equal(start(&sv, 1, n++), 0);
        interrupt(&sv, key, 8000 + 4000 * (size_t)attempt);
        assert_int_equal(start(&sv, 1, n++), 0);
        int st = kvt_ts_http(sv.port, "POST", "/v1/completions", h, BODY("6", "false"), RECV_S, &r);
        print_message("  other seed, attempt %d: %d %s\n", attempt, st, st == 422 ? r.body : "");
        if (st == 422) {
            refused = 1;
            assert_non_null(strstr(r.body, "seed"));
        } else {
            assert_int_equal(st, 200);
        }
        kvt_ts_resp_free(&r);
        if (!refused)
            assert_int_equal(kvt_ts_server_stop(&sv), 0);
    }
    assert_true(refused);
    /* a key with a control character */
    assert_int_equal(kvt_ts_http(sv.port, "POST", "/v1/completions", "Idempotency-Key: a\tb\r\n",
                                 BODY("5", "false"), RECV_S, &r), 400);
    kvt_ts_resp_free(&r);
    assert_int_equal(kvt_ts_server_stop(&sv), 0);
    free(ref);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_idempotency_key_resumes)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
