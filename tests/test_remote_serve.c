/*
 * test_remote_serve.c: two `kvtier serve` processes with separate
 * --ssd-cache directories share one Redis (--redis), and a client
 * alternates between them turn by turn, as a load balancer without affinity
 * would: each turn's reply equals a cache-off server's, and from turn 2 on
 * every server reuses the conversation's history even when the previous turn
 * ran on the other one (from Redis); server B's /metrics counts the remote
 * tier (promtool accepts it). Then the faults, each through `kvtier serve`
 * with a host that has nothing of its own and must restore from Redis:
 * CLIENT PAUSE longer than the timeout, every record corrupted with
 * SETRANGE, another identity's records planted under the keys, maxmemory
 * reached under load, and a real 3-node Redis Cluster (--redis-cluster)
 * with the node holding the block killed; every reply equals cache-off and
 * the fault is counted. Skips, saying why, without redis-server or the
 * stories260K model.
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
#include <pthread.h>

#include "kvtier/remote.h"

#include "child_guard.h"
#include "cli_run.h"
#include "redis_util.h"
#include "serve_util.h"
#include "store_util.h"

/* How many times slower this build runs a test (CMake: 10 under TSan, 3
 * under ASan, else 1): receive timeouts, waits and the hosts' generous
 * lookup and restore bounds are multiplied by it; the bounds a test checks
 * (f_serve_pause's host B keeps the defaults) are not. */
#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif
#define SLOW KVT_TEST_TIME_SCALE

static char g_model[600], g_tok[600], g_dir[512];
static char g_lookup_ms[16], g_restore_ms[16]; /* 1000 and 10000 ms, times SLOW */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

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

static char *turn_ex(int port, const char *const *users, char *const *replies, int n, long long *cached,
                     long long *prompt, double *engine_ms);

/* One turn of the conversation users[0..n) with replies[0..n-1) so far:
 * the reply text (caller frees) and the cached prompt tokens. */
static char *turn(int port, const char *const *users, char *const *replies, int n, long long *cached)
{
    return turn_ex(port, users, replies, n, cached, NULL, NULL);
}

/* turn() that also gives the prompt's token count and the request's engine
 * time in ms (usage.kvtier.engine_ms: its prefill and decode passes); either
 * may be NULL. */
static char *turn_ex(int port, const char *const *users, char *const *replies, int n, long long *cached,
                     long long *prompt, double *engine_ms)
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
    int st = kvt_ts_http(port, "POST", "/v1/chat/completions", NULL, body, 60 * SLOW, &r);
    free(body);
    if (st != 200)
        fail_msg("turn %d: HTTP %d %s", n, st, r.body ? r.body : "");
    json_t *res = json_loads(r.body, 0, NULL);
    assert_non_null(res);
    json_t *c = json_array_get(json_object_get(res, "choices"), 0);
    char *text = strdup(json_string_value(json_object_get(json_object_get(c, "message"), "content")));
    json_t *usage = json_object_get(res, "usage");
    *cached = json_integer_value(json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens"));
    if (prompt)
        *prompt = json_integer_value(json_object_get(usage, "prompt_tokens"));
    if (engine_ms)
        *engine_ms = json_number_value(json_object_get(json_object_get(usage, "kvtier"), "engine_ms"));
    json_decref(res);
    kvt_ts_resp_free(&r);
    return text;
}

/* The value of the metric line that starts with `name{model="stories260K"} `
 * (the remote tier's series carry the served model's id) in a Prometheus
 * text; -1 if none. */
static double metric(const char *text, const char *name)
{
    char series[160];
    snprintf(series, sizeof series, "%s{model=\"stories260K\"}", name);
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, series, n) && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

/* Server B reused A's turns through Redis: /metrics and /stats count the
 * remote tier's lookups, hits and restores, and promtool accepts /metrics. */
static void check_remote_counters(int port)
{
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", "/metrics", NULL, NULL, 30 * SLOW, &r), 200);
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
    assert_int_equal(kvt_ts_http(port, "GET", "/stats", NULL, NULL, 30 * SLOW, &r), 200);
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

/* A remote counter from the /stats "remote" object of the server at port (-1: none). */
static long long remote_stat(int port, const char *name)
{
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", "/stats", NULL, NULL, 30 * SLOW, &r), 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    kvt_ts_resp_free(&r);
    assert_non_null(doc);
    json_t *v = json_object_get(json_object_get(doc, "remote"), name);
    long long n = v ? (long long)json_integer_value(v) : -1;
    json_decref(doc);
    return n;
}

/* Waits (up to 60 s times SLOW) until the server at port wrote at least
 * `records` records to Redis and its write-behind queue is empty. */
static void wait_written(int port, long long records)
{
    double t0 = now_ms();
    while (now_ms() - t0 < 60000.0 * SLOW) {
        if (remote_stat(port, "write_records") >= records && remote_stat(port, "queued_entries") == 0)
            return;
        sleep_ms(20);
    }
    fail_msg("the server on port %d did not write %lld records to Redis in %d s", port, records, 60 * SLOW);
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
    /* Lookups bounded by 1000 ms and restores by 10 s, not 50 ms and 1 s:
     * on a loaded machine a lookup over the default bound is a counted miss
     * by design, which would make a server recompute what this test checks
     * it reuses (f_serve_pause checks the 50 ms bound). */
    const char *ea[] = {"--ssd-cache", da, "--redis", rs.url, "--redis-timeout", g_lookup_ms,
                        "--redis-restore-timeout", g_restore_ms, NULL};
    const char *eb[] = {"--ssd-cache", db, "--redis", rs.url, "--redis-timeout", g_lookup_ms,
                        "--redis-restore-timeout", g_restore_ms, NULL};
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
        long long written = remote_stat(sv->port, "write_records");
        char *got = turn(sv->port, users, replies, t + 1, &cached);
        print_message("turn %d on server %c: %lld prompt tokens reused\n", t + 1, t % 2 ? 'B' : 'A', cached);
        assert_string_equal(got, want);
        assert_int_equal(cached_off, 0);
        if (t > 0)
            assert_true(cached > 0); /* the other server's turn, through Redis */
        replies[t] = got;
        free(want);
        /* write-behind: this turn's entry (published before the reply was
         * sent) reaches Redis before the other server is asked */
        wait_written(sv->port, written + 1);
    }
    for (int t = 0; t < 4; t++)
        free(replies[t]);
    check_remote_counters(b.port);
    assert_int_equal(kvt_ts_server_stop(&a), 0);
    assert_int_equal(kvt_ts_server_stop(&b), 0);
    assert_int_equal(kvt_ts_server_stop(&off), 0);
    redis_stop(&rs);
}

/* ---- faults through serve ------------------------------------------------------------
 *
 * Host A (its own SSD directory and RAM) runs turns 1-2 of a conversation
 * whose first message is longer than one 256-token block, so Redis holds a
 * block record and entry records, and stops (SIGTERM flushes its
 * write-behind). Host B, started with an empty SSD directory and RAM, so it
 * can only reuse through Redis, then gets turn 3 while Redis is faulty: its
 * reply must be byte-identical to a cache-off server's, and its /stats
 * "remote" object must count the fault. */

#define SENT "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her dog. "
static char g_long[1024];
static const char *g_fusers[3] = {g_long, "What did she see?", "Then what happened?"};
static char *g_fwant[3];    /* cache-off replies of g_fusers' turns */
static long long g_fprompt; /* prompt tokens of turn 3 */
static double g_off_ms;     /* the cache-off server's turn 3, in ms */
static kvt_ts_server g_off; /* the cache-off server of the fault tests */

/* A host with its own SSD directory. Its lookup timeout is 1000 ms and its
 * restore timeout 10 s (times SLOW), so a loaded machine does not turn a lookup or
 * restore the test relies on into a timeout miss; the pause test's host B
 * keeps the defaults (50 ms, 1 s): the bound it checks. */
static void start_host(kvt_ts_server *sv, const char *test, const char *host, const char *url, int cluster)
{
    char dir[600], name[128];
    snprintf(dir, sizeof dir, "%s/%s-%s", g_dir, test, host);
    snprintf(name, sizeof name, "%s-%s", test, host);
    int dflt = !strcmp(test, "pause") && !strcmp(host, "b");
    const char *e[] = {"--ssd-cache", dir, "--redis", url, "--redis-timeout", dflt ? "50" : g_lookup_ms,
                       "--redis-restore-timeout", dflt ? "1000" : g_restore_ms, cluster ? "--redis-cluster" : NULL,
                       NULL};
    start(sv, name, e);
}

/* Host A runs turns 1-2 (replies equal cache-off, no remote write failure)
 * and stops; host B starts with nothing of its own. */
static void seed_then_start_b(const char *test, const char *url, int cluster, kvt_ts_server *b)
{
    kvt_ts_server a;
    start_host(&a, test, "a", url, cluster);
    for (int t = 0; t < 2; t++) {
        long long cached;
        char *got = turn(a.port, g_fusers, g_fwant, t + 1, &cached);
        assert_string_equal(got, g_fwant[t]);
        free(got);
    }
    wait_written(a.port, 2);
    assert_int_equal(remote_stat(a.port, "write_failures"), 0);
    assert_int_equal(kvt_ts_server_stop(&a), 0);
    start_host(b, test, "b", url, cluster);
}

/* A fresh Redis (64 MB) seeded by host A; host B started. */
static void fault_open(const char *test, redis_srv *rs, kvt_ts_server *b)
{
    assert_int_equal(redis_start(rs, 64, NULL), 0);
    seed_then_start_b(test, rs->url, 0, b);
}

/* Host B stops cleanly (a Redis fault is never the server's error) and Redis goes. */
static void fault_close(redis_srv *rs, kvt_ts_server *b)
{
    assert_int_equal(kvt_ts_server_stop(b), 0);
    redis_stop(rs);
}

/* Host B's turn 3: the reply equals cache-off; the cached tokens and the
 * request's wall time in ms. */
static long long b_turn3(const kvt_ts_server *b, double *ms)
{
    long long cached;
    double t0 = now_ms();
    char *got = turn(b->port, g_fusers, g_fwant, 3, &cached);
    if (ms)
        *ms = now_ms() - t0;
    assert_string_equal(got, g_fwant[2]);
    free(got);
    return cached;
}

/* Record keys (blocks 'b', entries 'e') on the server at port. */
static long long record_keys(int port, char (*keys)[160], long long cap)
{
    long long nb = redis_keys(port, "kvt:*:b*", keys ? keys[0] : NULL, 160, cap);
    long long ne = redis_keys(port, "kvt:*:e*", keys && nb < cap ? keys[nb] : NULL, 160, nb < cap ? cap - nb : 0);
    return nb + ne;
}

/* the fault-free baseline: host B reuses turns 1-2 from Redis */
static void f_serve_baseline(void **state)
{
    redis_srv rs;
    kvt_ts_server b;
    fault_open("base", &rs, &b);
    assert_true(redis_count_keys(rs.port, "kvt:*:b*") >= 1); /* the first message fills a block */
    long long cached = b_turn3(&b, NULL);
    print_message("no fault: host B reused %lld of %lld prompt tokens from Redis\n", cached, g_fprompt);
    assert_true(cached > 256);
    assert_true(remote_stat(b.port, "restores") >= 1);
    fault_close(&rs, &b);
}

/* CLIENT PAUSE far longer than the lookup timeout: a miss within the
 * timeout (counted), the turn prefilled, not held until the pause ends */
static void f_serve_pause(void **state)
{
    redis_srv rs;
    kvt_ts_server b;
    fault_open("pause", &rs, &b);
    /* The cache-off server's turn 3 now: what the turn costs at this
     * moment's load (the pause below outlasts it 3 times over, so host B's
     * turn ends inside the pause unless B waits for Redis). */
    long long off_cached;
    double off_engine = 0, t_off = now_ms();
    char *off_got = turn_ex(g_off.port, g_fusers, g_fwant, 3, &off_cached, NULL, &off_engine);
    double off_ms = now_ms() - t_off;
    assert_string_equal(off_got, g_fwant[2]);
    free(off_got);
    int pause_ms = 6000 + 3 * (int)off_ms;
    double t_pause = now_ms();
    assert_int_equal(redis_cmd(rs.port, NULL, 0, NULL, "CLIENT PAUSE %d ALL", pause_ms), 0);
    long long cached;
    double b_engine = 0, t_b = now_ms();
    char *got = turn_ex(b.port, g_fusers, g_fwant, 3, &cached, NULL, &b_engine);
    double b_ms = now_ms() - t_b, b_end = now_ms() - t_pause;
    assert_string_equal(got, g_fwant[2]);
    free(got);
    long long timeouts = remote_stat(b.port, "failures_timeout");
    print_message("CLIENT PAUSE %d ms: host B reused %lld tokens, answered in %.0f ms (%.0f ms in its engine), "
                  "%.0f ms into the pause; the cache-off server's turn: %.0f ms at start, %.0f ms now (%.0f ms in its "
                  "engine); %lld timeouts counted\n",
                  pause_ms, cached, b_ms, b_engine, b_end, g_off_ms, off_ms, off_engine, timeouts);
    assert_int_equal(cached, 0);
    assert_true(timeouts >= 1);
    assert_int_equal(remote_stat(b.port, "lookup_hits"), 0);
    /* The turn did not wait for the pause: it answered while Redis was
     * still paused (a stall ends no earlier than the pause does)... */
    assert_true(b_end < pause_ms);
    /* ...and apart from its compute (the engine's passes, which the load
     * makes vary from one request to the next) it took a few 50 ms lookup
     * bounds more than the cache-off server's request, not seconds. */
    assert_true(b_ms - b_engine < off_ms - off_engine + 1500);
    double left = pause_ms - (now_ms() - t_pause);
    sleep_ms(left > 0 ? (int)left + 50 : 0); /* B's write-behind then reaches Redis */
    fault_close(&rs, &b);
}

/* every record corrupted with SETRANGE: each restore refuses its record
 * (counted, deleted) and the turn is prefilled */
static void f_serve_setrange(void **state)
{
    redis_srv rs;
    kvt_ts_server b;
    fault_open("setrange", &rs, &b);
    static char keys[64][160];
    long long n = record_keys(rs.port, keys, 64);
    assert_true(n >= 2 && n <= 64);
    for (long long i = 0; i < n; i++) {
        long long len = redis_cmd(rs.port, NULL, 0, NULL, "STRLEN %s", keys[i]);
        assert_true(len > 200);
        assert_true(redis_cmd(rs.port, NULL, 0, NULL, "SETRANGE %s %lld %s", keys[i], len / 2, "kvtier!") > 0);
    }
    long long cached = b_turn3(&b, NULL);
    long long bad = remote_stat(b.port, "bad_records");
    print_message("SETRANGE on %lld records: host B reused %lld tokens, %lld bad records counted\n", n, cached, bad);
    assert_int_equal(cached, 0);
    assert_true(bad >= 1);
    assert_true(remote_stat(b.port, "restore_failures") >= 1);
    assert_int_equal(remote_stat(b.port, "restores"), 0);
    long long still_bad = 0;
    for (long long i = 0; i < n; i++) {
        char got[16] = {0};
        long long len = redis_cmd(rs.port, NULL, 0, NULL, "STRLEN %s", keys[i]);
        if (len > 0 && redis_cmd(rs.port, got, sizeof got - 1, NULL, "GETRANGE %s %lld %lld", keys[i], len / 2,
                                 len / 2 + 6) == 0)
            still_bad += !strcmp(got, "kvtier!");
    }
    assert_true(still_bad < n); /* a refused record is deleted (B may write a good one again) */
    fault_close(&rs, &b);
}

/* a record of another identity planted under every key: refused
 * (KVT_EIDENTITY, counted, deleted), the turn prefilled */
static void f_serve_foreign(void **state)
{
    redis_srv rs;
    kvt_ts_server b;
    fault_open("foreign", &rs, &b);
    /* the foreign records: an entry of another model's identity, stored
     * through the library (2 blocks of 4 tokens and an entry record) */
    static const kvt_store_identity fid = {"another-model", "cfg", "tok"};
    static const store_cfg fcfg = {.n_kv = 2, .kv_dim = 8, .block = 4};
    char fprefix[64], pat[80];
    assert_int_equal(kvt_remote_key_prefix(&fid, fprefix, sizeof fprefix), 0);
    kvt_remote_options o = {.quiet = 1};
    kvt_remote *fr = NULL;
    assert_int_equal(kvt_remote_open(rs.url, &fid, &o, &fr), 0);
    kvt_cold_tier ft;
    kvt_remote_cold_tier(fr, &ft);
    int32_t tok[10];
    for (int i = 0; i < 10; i++)
        tok[i] = 7 + i;
    kvt_entry e;
    assert_int_equal(store_make_entry(&fcfg, "", tok, 10, &e), 0);
    assert_int_equal(ft.store(ft.self, &e), 0);
    kvt_entry_clear(&e);
    kvt_remote_close(fr);
    static char fval[2][1 << 16], keys[64][160];
    size_t flen[2];
    for (int t = 0; t < 2; t++) {
        char k[160];
        snprintf(pat, sizeof pat, "%s%c*", fprefix, t ? 'e' : 'b');
        assert_int_equal(redis_first_key(rs.port, pat, k, sizeof k), 0);
        assert_int_equal(redis_cmd(rs.port, fval[t], sizeof fval[t], &flen[t], "GET %s", k), 0);
        assert_true(flen[t] > 0 && flen[t] < sizeof fval[t]);
    }
    long long n = record_keys(rs.port, keys, 64), planted = 0;
    assert_true(n <= 64);
    for (long long i = 0; i < n; i++) {
        if (!strncmp(keys[i], fprefix, strlen(fprefix)))
            continue;
        int is_e = keys[i][strlen(fprefix)] == 'e';
        assert_int_equal(redis_set_bin(rs.port, keys[i], fval[is_e], flen[is_e]), 0);
        planted++;
    }
    assert_true(planted >= 2);
    long long cached = b_turn3(&b, NULL);
    long long bad = remote_stat(b.port, "bad_records");
    print_message("another identity's records planted under %lld keys: host B reused %lld tokens, %lld bad records "
                  "counted\n",
                  planted, cached, bad);
    assert_int_equal(cached, 0);
    assert_true(bad >= 1);
    assert_int_equal(remote_stat(b.port, "restores"), 0);
    fault_close(&rs, &b);
}

/* maxmemory reached under load: Redis evicts (allkeys-lru), every write
 * still succeeds, and host B, whose conversation was evicted, misses and
 * prefills with the cache-off reply */
#define N_CONV 12
static char g_conv_first[N_CONV][1100];
static char *g_conv_want[N_CONV][3];

typedef struct load_arg {
    int port, from, step, bad;
} load_arg;

static const char *const *conv_users(int c, const char **u)
{
    u[0] = g_conv_first[c];
    u[1] = g_fusers[1];
    u[2] = g_fusers[2];
    return u;
}

static void *load_main(void *p)
{
    load_arg *a = p;
    for (int c = a->from; c < N_CONV; c += a->step)
        for (int t = 0; t < 2; t++) {
            const char *u[3];
            long long cached;
            char *got = turn(a->port, conv_users(c, u), g_conv_want[c], t + 1, &cached);
            a->bad += strcmp(got, g_conv_want[c][t]) != 0;
            free(got);
        }
    return NULL;
}

static void f_serve_maxmemory(void **state)
{
    redis_srv rs;
    assert_int_equal(redis_start(&rs, 4, NULL), 0); /* 4 MB: about 6 of these conversations */
    for (int c = 0; c < N_CONV; c++) {
        snprintf(g_conv_first[c], sizeof g_conv_first[c], "Story %d. %s", c, g_long);
        const char *u[3];
        for (int t = 0; t < (c ? 2 : 3); t++) {
            long long cached;
            g_conv_want[c][t] = turn(g_off.port, conv_users(c, u), g_conv_want[c], t + 1, &cached);
        }
    }
    kvt_ts_server a, b;
    start_host(&a, "maxmem", "a", rs.url, 0);
    pthread_t th[3];
    load_arg la[3];
    for (int i = 0; i < 3; i++) {
        la[i] = (load_arg){.port = a.port, .from = i, .step = 3};
        assert_int_equal(pthread_create(&th[i], NULL, load_main, &la[i]), 0);
    }
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(la[i].bad, 0);
    }
    assert_int_equal(remote_stat(a.port, "write_failures"), 0);
    long long written = remote_stat(a.port, "write_records");
    assert_int_equal(kvt_ts_server_stop(&a), 0);
    long long evicted = redis_info_field(rs.port, "stats", "evicted_keys");
    start_host(&b, "maxmem", "b", rs.url, 0);
    const char *u[3];
    long long cached;
    char *got = turn(b.port, conv_users(0, u), g_conv_want[0], 3, &cached);
    assert_string_equal(got, g_conv_want[0][2]);
    free(got);
    long long hits = remote_stat(b.port, "lookup_hits"), partial = remote_stat(b.port, "restore_partial");
    print_message("maxmemory 4 MB, %d conversations on 3 threads: %lld records written, Redis evicted %lld keys; "
                  "host B reused %lld tokens of the first conversation (%lld lookup hits, %lld partial restores)\n",
                  N_CONV, written, evicted, cached, hits, partial);
    assert_true(evicted > 0);
    assert_int_equal(remote_stat(b.port, "bad_records"), 0); /* eviction is a miss, never a bad record */
    assert_int_equal(remote_stat(b.port, "restore_failures"), 0);
    assert_true(cached < 256); /* the first conversation's block, the oldest record, was evicted */
    assert_int_equal(kvt_ts_server_stop(&b), 0);
    for (int c = 0; c < N_CONV; c++)
        for (int t = 0; t < 3; t++)
            free(g_conv_want[c][t]);
    memset(g_conv_want, 0, sizeof g_conv_want);
    redis_stop(&rs);
}

/* a real 3-node Redis Cluster through serve (--redis-cluster): host B
 * reuses turns 1-2 from the cluster; then the node that holds the block is
 * killed and host C, with nothing of its own, misses (counted) and
 * prefills with the cache-off reply */
static void f_serve_cluster(void **state)
{
    redis_srv nodes[3];
    assert_int_equal(redis_cluster_start(nodes, 3), 0);
    kvt_ts_server b, c;
    seed_then_start_b("cluster", nodes[0].url, 1, &b);
    long long cached = b_turn3(&b, NULL);
    long long n_nodes = remote_stat(b.port, "nodes");
    print_message("3-node cluster: host B reused %lld of %lld prompt tokens, %lld nodes known, %lld redirects\n",
                  cached, g_fprompt, n_nodes, remote_stat(b.port, "redirects"));
    assert_true(cached > 256);
    assert_int_equal(n_nodes, 3);
    assert_int_equal(kvt_ts_server_stop(&b), 0);
    int kb = -1;
    for (int i = 0; i < 3 && kb < 0; i++)
        if (redis_count_keys(nodes[i].port, "kvt:*:b*") > 0)
            kb = i;
    assert_true(kb >= 0);
    redis_kill(&nodes[kb]);
    start_host(&c, "cluster", "c", nodes[(kb + 1) % 3].url, 1);
    double ms;
    cached = b_turn3(&c, &ms);
    long long fails = remote_stat(c.port, "failures_conn") + remote_stat(c.port, "failures_timeout");
    print_message("node %d (the block's) killed: host C reused %lld tokens, answered in %.0f ms, %lld failures "
                  "counted\n",
                  kb, cached, ms, fails);
    assert_int_equal(cached, 0);
    assert_true(fails >= 1);
    assert_int_equal(remote_stat(c.port, "bad_records"), 0);
    assert_int_equal(kvt_ts_server_stop(&c), 0);
    redis_cluster_stop(nodes, 3);
}

int main(void)
{
    if (!redis_available("test_remote_serve") || !cli_inputs(g_model, sizeof g_model, g_tok, sizeof g_tok))
        return 0;
    store_tmpdir(g_dir, sizeof g_dir, "remote-serve");
    snprintf(g_lookup_ms, sizeof g_lookup_ms, "%d", 1000 * SLOW);
    snprintf(g_restore_ms, sizeof g_restore_ms, "%d", 10000 * SLOW);
    /* a test that fails midway leaves no server or Redis running */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(t_alternating_servers, child_guard_teardown),
        cmocka_unit_test_teardown(f_serve_baseline, child_guard_teardown),
        cmocka_unit_test_teardown(f_serve_pause, child_guard_teardown),
        cmocka_unit_test_teardown(f_serve_setrange, child_guard_teardown),
        cmocka_unit_test_teardown(f_serve_foreign, child_guard_teardown),
        cmocka_unit_test_teardown(f_serve_maxmemory, child_guard_teardown),
        cmocka_unit_test_teardown(f_serve_cluster, child_guard_teardown),
    };
    for (int i = 0; i < 8; i++)
        strcat(g_long, SENT);
    const char *eoff[] = {"--prompt-cache", "0", NULL};
    start(&g_off, "fault-off", eoff);
    for (int t = 0; t < 3; t++) {
        long long cached;
        double t0 = now_ms();
        g_fwant[t] = turn_ex(g_off.port, g_fusers, g_fwant, t + 1, &cached, t == 2 ? &g_fprompt : NULL, NULL);
        g_off_ms = now_ms() - t0;
    }
    child_guard_keep_current(); /* the cache-off server serves every test */
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    kvt_ts_server_stop(&g_off);
    for (int t = 0; t < 3; t++)
        free(g_fwant[t]);
    store_rmtree(g_dir);
    return failed ? 1 : 0;
}
