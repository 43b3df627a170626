/*
 * test_serve_io.c: the I/O worker's report in a running `kvtier serve
 * --ssd-cache` (stories260K): after a completion, /stats holds an "io"
 * object whose write-behind counters show the SSD write ran on the worker
 * and nothing is left queued, and /metrics has the kvtier_io_* families,
 * one series per kind, and passes `promtool check metrics`. Every
 * worker-wide counter of /stats "io" (KVT_IO_WORKER_COUNTERS) is in /metrics
 * as kvtier_io_worker_* with the same value: max_queued_ops >= 1 after the
 * write-behind, submitted the sum of the kinds' submitted, nothing queued or
 * running.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "serve_util.h"

static json_t *get_json(int port, const char *path)
{
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", path, NULL, NULL, 30, &r), 200);
    json_error_t err;
    json_t *doc = json_loads(r.body, 0, &err);
    kvt_ts_resp_free(&r);
    assert_non_null(doc);
    return doc;
}

static json_int_t io_field(json_t *stats, const char *kind, const char *name)
{
    json_t *io = json_object_get(stats, "io");
    assert_non_null(io);
    json_t *k = json_object_get(json_object_get(io, "by_kind"), kind);
    assert_non_null(k);
    json_t *v = json_object_get(k, name);
    assert_true(json_is_integer(v));
    return json_integer_value(v);
}

static void io_report(void **state)
{
    (void)state;
    const char *bin = getenv("KVT_BIN");
    const char *shared = getenv("KVT_SHARED_DIR");
    char model[1024], tok[1024];
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tok, sizeof tok, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    if (!bin || access(model, R_OK) || access(tok, R_OK)) {
        printf("test_serve_io: skipped: needs KVT_BIN and %s with tok512.bin (set KVT_SHARED_DIR)\n", model);
        return;
    }
    char dir[] = "/tmp/kvt_serve_io_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char ssd[300], log[300];
    snprintf(ssd, sizeof ssd, "%s/ssd", dir);
    snprintf(log, sizeof log, "%s/serve.log", dir);
    const char *args[] = {"--model", model, "--tokenizer", tok, "--ssd-cache", ssd, NULL};
    kvt_ts_server sv;
    assert_int_equal(kvt_ts_server_start(&sv, bin, log, args), 0);
    kvt_ts_resp r;
    const char *body = "{\"prompt\": \"Once upon a time, there was a little girl named Lily.\", \"max_tokens\": 8, "
                       "\"temperature\": 0}";
    assert_int_equal(kvt_ts_http(sv.port, "POST", "/v1/completions", NULL, body, 60, &r), 200);
    kvt_ts_resp_free(&r);
    /* write-behind is queued when the entry is put: wait for it to run */
    json_t *st = NULL;
    for (int i = 0; i < 1200; i++) { /* 60 s */
        st = get_json(sv.port, "/stats");
        if (io_field(st, "write", "ran") >= 1 && io_field(st, "write", "queued_ops") == 0)
            break;
        json_decref(st);
        st = NULL;
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
    }
    assert_non_null(st);
    assert_true(io_field(st, "write", "submitted") >= 1);
    assert_int_equal(io_field(st, "write", "failed"), 0);
    assert_int_equal(io_field(st, "write", "refused"), 0);
    assert_int_equal(io_field(st, "write", "queued_bytes"), 0);
    assert_int_equal(io_field(st, "restore", "queued_ops"), 0);
    json_t *io = json_object_get(st, "io");
    assert_int_equal(json_integer_value(json_object_get(io, "queued_ops")), 0);
    assert_true(json_integer_value(json_object_get(io, "submitted")) >= 1);
    assert_true(json_integer_value(json_object_get(io, "max_queued_ops")) >= 1);
    assert_int_equal(json_integer_value(json_object_get(io, "running_ops")), 0);
    json_int_t kinds_submitted = 0;
    const char *kinds[] = {"restore", "write", "hash", "remote-get", "remote-set", "prefetch", "find"};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
        kinds_submitted += io_field(st, kinds[k], "submitted");
    assert_int_equal(json_integer_value(json_object_get(io, "submitted")), kinds_submitted);

    assert_int_equal(kvt_ts_http(sv.port, "GET", "/metrics", NULL, NULL, 30, &r), 200);
    /* the server is idle (the write-behind ran): /metrics holds the same
     * worker-wide values as the /stats read before it */
    const char *worker[][2] = {{"submitted", "_total"},       {"coalesced", "_total"}, {"refused", "_total"},
                               {"ran", "_total"},             {"failed", "_total"},    {"discarded", "_total"},
                               {"results_discarded", "_total"}, {"queued_ops", ""},   {"running_ops", ""},
                               {"queued_bytes", ""},          {"max_queued_ops", ""}};
    for (size_t w = 0; w < sizeof worker / sizeof worker[0]; w++) {
        char line[160];
        snprintf(line, sizeof line, "\nkvtier_io_worker_%s%s %lld\n", worker[w][0], worker[w][1],
                 (long long)json_integer_value(json_object_get(io, worker[w][0])));
        if (!strstr(r.body, line))
            fprintf(stderr, "test_serve_io: /metrics lacks \"%s\"\n", line + 1);
        assert_non_null(strstr(r.body, line));
        snprintf(line, sizeof line, "# TYPE kvtier_io_worker_%s%s %s\n", worker[w][0], worker[w][1],
                 worker[w][1][0] ? "counter" : "gauge");
        assert_non_null(strstr(r.body, line));
    }
    assert_int_equal(json_object_size(io) - 1 /* by_kind */, sizeof worker / sizeof worker[0]);
    json_decref(st);
    assert_non_null(strstr(r.body, "# TYPE kvtier_io_submitted_total counter"));
    assert_non_null(strstr(r.body, "kvtier_io_ran_total{kind=\"write\"} "));
    assert_non_null(strstr(r.body, "kvtier_io_coalesced_total{kind=\"restore\"} "));
    assert_non_null(strstr(r.body, "kvtier_io_queued_bytes{kind=\"remote-set\"} 0"));
    char path[400], cmd[900];
    snprintf(path, sizeof path, "%s/metrics.txt", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fwrite(r.body, 1, r.len, f);
    fclose(f);
    kvt_ts_resp_free(&r);
    if (system("command -v promtool >/dev/null 2>&1") == 0) {
        snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
        assert_int_equal(system(cmd), 0);
    } else {
        printf("test_serve_io: promtool is not installed (Debian package prometheus): lint skipped\n");
    }
    assert_int_equal(kvt_ts_server_stop(&sv), 0);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(io_report)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
