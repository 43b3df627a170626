/*
 * test_remote_serve.c: two `kvtier serve` processes with separate
 * --ssd-cache directories share one Redis (--redis), and a client
 * alternates between them turn by turn, as a load balancer without affinity
 * would: each turn's reply equals a cache-off server's, and from turn 2 on
 * every server reuses the conversation's history even when the previous turn
 * ran on the other one (from Redis). Skips, saying why, without redis-server
 * or the stories260K model.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "cli_run.h"
#include "redis_util.h"
#include "serve_util.h"
#include "store_util.h"

static char g_model[600], g_tok[600], g_dir[512];

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void start(kvt_ts_server *sv, const char *name, const char *const *extra)
{
    char log[700];
    snprintf(log, sizeof log, "%s/%s.log", g_dir, name);
    const char *args[32] = {"--model", g_model, "--tokenizer", g_tok};
    int n = 4;
    for (int i = 0; extra && extra[i]; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(kvt_ts_server_start(sv, getenv("KVT_BIN"), log, args), 0);
}

/* One turn of the conversation users[0..n) with replies[0..n-1) so far:
 * the reply text (caller frees) and the cached prompt tokens. */
static char *turn(int port, const char *const *users, char *const *replies, int n, long long *cached)
{
    json_t *msgs = json_array();
    for (int i = 0; i < n; i++) {
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", users[i]));
        if (i < n - 1)
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", replies[i]));
    }
    json_t *doc = json_pack("{s:o, s:f, s:i}", "messages", msgs, "temperature", 0.0, "max_tokens", 12);
    char *body = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    kvt_ts_resp r;
    int st = kvt_ts_http(port, "POST", "/v1/chat/completions", NULL, body, 60, &r);
    free(body);
    if (st != 200)
        fail_msg("turn %d: HTTP %d %s", n, st, r.body ? r.body : "");
    json_t *res = json_loads(r.body, 0, NULL);
    assert_non_null(res);
    json_t *c = json_array_get(json_object_get(res, "choices"), 0);
    char *text = strdup(json_string_value(json_object_get(json_object_get(c, "message"), "content")));
    *cached = json_integer_value(
        json_object_get(json_object_get(json_object_get(res, "usage"), "prompt_tokens_details"), "cached_tokens"));
    json_decref(res);
    kvt_ts_resp_free(&r);
    return text;
}

/* The value of the metric line that starts with `name ` in a Prometheus text; -1 if none. */
static double metric(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, name, n) && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

/* Server B reused A's turns through Redis: /metrics and /stats count the
 * remote tier's lookups, hits and restores, and promtool accepts /metrics. */
static void check_remote_counters(int port)
{
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", "/metrics", NULL, NULL, 30, &r), 200);
    print_message("server B: kvtier_remote_lookups_total %g, lookup_hits %g, restores %g, restored bytes %g, "
                  "round trips %g\n",
                  metric(r.body, "kvtier_remote_lookups_total"), metric(r.body, "kvtier_remote_lookup_hits_total"),
                  metric(r.body, "kvtier_remote_restores_total"), metric(r.body, "kvtier_remote_restored_bytes_total"),
                  metric(r.body, "kvtier_remote_round_trips_total"));
    assert_true(metric(r.body, "kvtier_remote_lookups_total") >= 2);
    assert_true(metric(r.body, "kvtier_remote_lookup_hits_total") >= 1);
    assert_true(metric(r.body, "kvtier_remote_restores_total") >= 1);
    assert_true(metric(r.body, "kvtier_remote_restored_bytes_total") > 0);
    assert_true(metric(r.body, "kvtier_remote_restore_seconds_total") >= 0);
    assert_true(metric(r.body, "kvtier_remote_writes_total") >= 1);
    assert_int_equal((long long)metric(r.body, "kvtier_remote_healthy"), 1);
    assert_int_equal((long long)metric(r.body, "kvtier_remote_nodes"), 1);
    assert_int_equal((long long)metric(r.body, "kvtier_remote_bad_records_total"), 0);
    assert_non_null(strstr(r.body, "# TYPE kvtier_remote_lookups_total counter\n"));
    assert_non_null(strstr(r.body, "# TYPE kvtier_remote_queued_bytes gauge\n"));
    char path[600], cmd[800];
    snprintf(path, sizeof path, "%s/metrics.txt", g_dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fwrite(r.body, 1, r.len, f);
    fclose(f);
    double hits = metric(r.body, "kvtier_remote_lookup_hits_total");
    kvt_ts_resp_free(&r);
    if (system("command -v promtool >/dev/null 2>&1") == 0) {
        snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
        assert_int_equal(system(cmd), 0);
    } else {
        print_message("promtool is not installed (Debian package prometheus): lint skipped\n");
    }
    /* /stats: the same counters, one object */
    assert_int_equal(kvt_ts_http(port, "GET", "/stats", NULL, NULL, 30, &r), 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    kvt_ts_resp_free(&r);
    assert_non_null(doc);
    json_t *rem = json_object_get(doc, "remote");
    assert_non_null(rem);
    assert_true(json_integer_value(json_object_get(rem, "lookup_hits")) >= (json_int_t)hits);
    assert_true(json_integer_value(json_object_get(rem, "restores")) >= 1);
    assert_int_equal(json_integer_value(json_object_get(rem, "healthy")), 1);
    json_decref(doc);
}

static void t_alternating_servers(void **state)
{
    redis_srv rs;
    assert_int_equal(redis_start(&rs, 64, NULL), 0);
    char da[600], db[600];
    snprintf(da, sizeof da, "%s/ssd-a", g_dir);
    snprintf(db, sizeof db, "%s/ssd-b", g_dir);
    kvt_ts_server off, a, b;
    const char *eoff[] = {"--prompt-cache", "0", NULL};
    const char *ea[] = {"--ssd-cache", da, "--redis", rs.url, NULL};
    const char *eb[] = {"--ssd-cache", db, "--redis", rs.url, NULL};
    start(&off, "off", eoff);
    start(&a, "a", ea);
    start(&b, "b", eb);
    const char *users[4] = {"Hello, how are you today?", "Tell me about the ocean.", "What lives there?",
                            "Is it deep?"};
    char *replies[4] = {0};
    for (int t = 0; t < 4; t++) {
        long long cached_off, cached;
        char *want = turn(off.port, users, replies, t + 1, &cached_off);
        kvt_ts_server *sv = t % 2 ? &b : &a; /* A, B, A, B */
        char *got = turn(sv->port, users, replies, t + 1, &cached);
        print_message("turn %d on server %c: %lld prompt tokens reused\n", t + 1, t % 2 ? 'B' : 'A', cached);
        assert_string_equal(got, want);
        assert_int_equal(cached_off, 0);
        if (t > 0)
            assert_true(cached > 0); /* the other server's turn, through Redis */
        replies[t] = got;
        free(want);
        /* write-behind: let this turn's prefix reach Redis before the other
         * server is asked */
        long long keys = -1, now = 0;
        for (int w = 0; w < 100 && now != keys; w++) {
            keys = now;
            sleep_ms(30);
            now = redis_count_keys(rs.port, "kvt:*");
        }
    }
    for (int t = 0; t < 4; t++)
        free(replies[t]);
    check_remote_counters(b.port);
    assert_int_equal(kvt_ts_server_stop(&a), 0);
    assert_int_equal(kvt_ts_server_stop(&b), 0);
    assert_int_equal(kvt_ts_server_stop(&off), 0);
    redis_stop(&rs);
}

int main(void)
{
    if (!redis_available("test_remote_serve") || !cli_inputs(g_model, sizeof g_model, g_tok, sizeof g_tok))
        return 0;
    store_tmpdir(g_dir, sizeof g_dir, "remote-serve");
    const struct CMUnitTest tests[] = {cmocka_unit_test(t_alternating_servers)};
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    store_rmtree(g_dir);
    return failed ? 1 : 0;
}
