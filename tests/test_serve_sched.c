/*
 * test_serve_sched.c: `kvtier serve` while it loads and while it schedules,
 * on a synthetic model made here (the default model's tokenizer and
 * classifier, a smaller shape with a 4096-token context).
 *
 * - Loading: the server is held in its loading window by the
 *   KVTIER_TEST_LOAD_GATE hook (server.h): it listens, but has read nothing
 *   yet. /health, /v1/models and /v1/chat/completions must answer 503 with an
 *   OpenAI error object (code "loading") for as long as the gate is closed;
 *   a 200 then fails the test. Once the gate opens, /health turns 200 and a
 *   chat completion sent right after the first 200 is served.
 * - A long prompt arriving while streams decode: it is prefilled in chunks
 *   of KVT_MODEL_CHUNK tokens, one chunk per engine step, each step also
 *   decoding the running streams. While it is prefilled (from its request to
 *   its first token) every running stream must keep receiving tokens; the
 *   largest gap between two tokens of a stream is printed with and without
 *   the long prefill, beside the chunk size and the prefill time.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "serve_util.h"
#include "tokenizer.h"

/* How many times slower this build runs a test (CMake: 10 under TSan, 3
 * under ASan, else 1): the waits and receive timeouts below are multiplied by
 * it, never a bound the test asserts on what it measures. */
#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif

static const char *bin;
static char tmpdir[256], model[400], tok[400];

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int setup(void **state)
{
    (void)state;
    bin = getenv("KVT_BIN");
    if (!bin)
        return 0;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvt_serve_sched_XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
    snprintf(model, sizeof model, "%s/m.bin", tmpdir);
    snprintf(tok, sizeof tok, "%s/tok.bin", tmpdir);
    /* the default model's classifier (printable text, seldom EOS) on a
     * shape whose 256-token prefill chunk takes some ms (more than a decode
 * step of the streams) */
    kvt_synth_params p;
    kvt_default_model_params(&p);
    p.dim = 128;
    p.hidden_dim = 384;
    p.n_layers = 4;
    p.n_heads = 4;
    p.n_kv_heads = 4;
    p.seq_len = 4096;
    assert_int_equal(kvt_model_synth(&p, model), 0);
    assert_int_equal(kvt_tokenizer_write_default(tok, KVT_DEFAULT_VOCAB), 0);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (!tmpdir[0])
        return 0;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

#define NEED_BIN()                                                                                                     \
    do {                                                                                                               \
        if (!bin) {                                                                                                    \
            printf("skipped: KVT_BIN is not set\n");                                                                   \
            skip();                                                                                                    \
        }                                                                                                              \
    } while (0)

/* Asserts an OpenAI error object with status 503 and code "loading". */
static void expect_loading(const kvt_ts_resp *r, const char *what)
{
    if (r->status != 503)
        fprintf(stderr, "%s answered %d while the model loads: %s\n", what, r->status, r->body);
    assert_int_equal(r->status, 503);
    json_error_t je;
    json_t *doc = json_loads(r->body, 0, &je);
    assert_non_null(doc);
    json_t *err = json_object_get(doc, "error");
    assert_true(json_is_object(err));
    assert_string_equal(json_string_value(json_object_get(err, "code")), "loading");
    assert_string_equal(json_string_value(json_object_get(err, "type")), "server_error");
    const char *msg = json_string_value(json_object_get(err, "message"));
    assert_non_null(msg);
    assert_non_null(strstr(msg, "loading"));
    json_decref(doc);
}

static const char *CHAT = "{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 4, "
                          "\"temperature\": 0}";

/* /health is 503 (JSON, code "loading") for the whole loading window and
 * 200 only once the model serves: the chat sent right after the first 200
 * gets its reply. */
static void test_health_while_loading(void **state)
{
    (void)state;
    NEED_BIN();
    char gate[400], log[400];
    snprintf(gate, sizeof gate, "%s/gate", tmpdir);
    snprintf(log, sizeof log, "%s/loading.log", tmpdir);
    unlink(gate);
    setenv("KVTIER_TEST_LOAD_GATE", gate, 1);
    kvt_ts_server sv;
    const char *args[] = {"--model", model, "--tokenizer", tok, NULL};
    int rc = kvt_ts_server_spawn(&sv, bin, log, args);
    unsetenv("KVTIER_TEST_LOAD_GATE");
    assert_int_equal(rc, 0);

    /* held in the loading window: every model endpoint answers 503 */
    double t0 = now_ms();
    int checks = 0;
    while (now_ms() - t0 < 300) {
        kvt_ts_resp r;
        kvt_ts_http(sv.port, "GET", "/health", NULL, NULL, 10, &r);
        expect_loading(&r, "GET /health");
        kvt_ts_resp_free(&r);
        checks++;
        usleep(20000);
    }
    kvt_ts_resp r;
    kvt_ts_http(sv.port, "POST", "/v1/chat/completions", NULL, CHAT, 10, &r);
    expect_loading(&r, "POST /v1/chat/completions");
    kvt_ts_resp_free(&r);
    kvt_ts_http(sv.port, "GET", "/v1/models", NULL, NULL, 10, &r);
    expect_loading(&r, "GET /v1/models");
    kvt_ts_resp_free(&r);
    char text[8192];
    assert_true(kvt_ts_read_file(log, text, sizeof text) > 0);
    assert_null(strstr(text, "ready, model")); /* it really has not loaded */

    /* the gate opens: 503 until the model serves, then 200 */
    int fd = open(gate, O_WRONLY | O_CREAT, 0644);
    assert_true(fd >= 0);
    close(fd);
    double opened = now_ms();
    int loading_after = 0, status = 0;
    while (now_ms() - opened < 30000.0 * KVT_TEST_TIME_SCALE) {
        kvt_ts_http(sv.port, "GET", "/health", NULL, NULL, 10, &r);
        status = r.status;
        if (status == 200) {
            json_error_t je;
            json_t *doc = json_loads(r.body, 0, &je);
            assert_non_null(doc);
            assert_string_equal(json_string_value(json_object_get(doc, "status")), "ok");
            json_decref(doc);
            kvt_ts_resp_free(&r);
            break;
        }
        expect_loading(&r, "GET /health after the gate opened");
        kvt_ts_resp_free(&r);
        loading_after++;
        usleep(2000);
    }
    assert_int_equal(status, 200);
    kvt_ts_http(sv.port, "POST", "/v1/chat/completions", NULL, CHAT, 60 * KVT_TEST_TIME_SCALE, &r);
    if (r.status != 200)
        fprintf(stderr, "chat right after /health said 200: %d %s\n", r.status, r.body);
    assert_int_equal(r.status, 200);
    json_error_t je;
    json_t *doc = json_loads(r.body, 0, &je);
    assert_non_null(doc);
    json_t *choice = json_array_get(json_object_get(doc, "choices"), 0);
    assert_non_null(json_string_value(json_object_get(json_object_get(choice, "message"), "content")));
    assert_int_equal(json_integer_value(json_object_get(json_object_get(doc, "usage"), "completion_tokens")), 4);
    json_decref(doc);
    kvt_ts_resp_free(&r);
    print_message("loading window: %d /health checks answered 503 while held, %d more after the gate opened "
                  "(%.0f ms to 200)\n", checks, loading_after, now_ms() - opened);
    assert_int_equal(kvt_ts_server_stop(&sv), 0);
}

/* ---- a long prompt while streams decode ------------------------------------------------- */

#define STREAMS 3
#define MAX_EVENTS 4096

/* One streaming completion: the arrival time of each text event. */
typedef struct stream {
    int port;
    int fd;
    pthread_t th;
    atomic_int n;            /* events seen */
    double at[MAX_EVENTS];   /* their arrival, ms (now_ms) */
    atomic_int ended;        /* [DONE] or the connection closed */
    int done_seen;
} stream;

static void *stream_main(void *arg)
{
    stream *s = arg;
    char buf[65536];
    size_t have = 0;
    for (;;) {
        ssize_t k = recv(s->fd, buf + have, sizeof buf - 1 - have, 0);
        if (k <= 0)
            break;
        double t = now_ms();
        have += (size_t)k;
        buf[have] = '\0';
        /* count whole events ("data: ...\n\n") with text in them */
        char *p = buf, *end;
        while ((end = strstr(p, "\n\n"))) {
            *end = '\0';
            if (strstr(p, "data: [DONE]"))
                s->done_seen = 1;
            else if (strstr(p, "\"text\":\"") && !strstr(p, "\"text\":\"\"")) {
                int i = atomic_load(&s->n);
                if (i < MAX_EVENTS) {
                    s->at[i] = t;
                    atomic_store(&s->n, i + 1);
                }
            }
            p = end + 2;
        }
        have = strlen(p);
        memmove(buf, p, have + 1);
    }
    atomic_store(&s->ended, 1);
    return NULL;
}

/* The running streams of the case and its server, in file scope so that
 * streams_teardown can end them when an assertion failed midway (else the
 * stream threads are left unjoined and the server running). */
static stream g_streams[STREAMS];
static int g_started;
static kvt_ts_server *g_sv;

static int streams_teardown(void **state)
{
    (void)state;
    for (int i = 0; i < g_started; i++) {
        shutdown(g_streams[i].fd, SHUT_RDWR);
        pthread_join(g_streams[i].th, NULL);
        close(g_streams[i].fd);
    }
    g_started = 0;
    if (g_sv)
        kvt_ts_server_kill(g_sv);
    g_sv = NULL;
    return 0;
}

static void stream_start(stream *s, int port, int i)
{
    memset(s, 0, sizeof *s);
    s->port = port;
    s->fd = kvt_ts_connect(port, 120 * KVT_TEST_TIME_SCALE);
    assert_true(s->fd >= 0);
    char body[256];
    snprintf(body, sizeof body,
             "{\"prompt\": [1, %d, %d, %d], \"max_tokens\": 1500, \"temperature\": 0, \"stream\": true}", 40 + i,
             60 + i, 80 + i);
    kvt_ts_send_request(s->fd, "POST", "/v1/completions", NULL, body);
    assert_int_equal(pthread_create(&s->th, NULL, stream_main, s), 0);
    g_started++;
}

/* Waits until every stream has seen at least n events. */
static void wait_events(stream *s, int n)
{
    double t0 = now_ms();
    for (int i = 0; i < STREAMS; i++)
        while (atomic_load(&s[i].n) < n) {
            assert_false(atomic_load(&s[i].ended));
            assert_true(now_ms() - t0 < 60000.0 * KVT_TEST_TIME_SCALE);
            usleep(1000);
        }
}

/* Largest gap between two consecutive events of any stream that overlaps
 * [from, to] (the gap that ends after `to` included: the caller waits for
 * it), and the fewest events a stream got in [from, to]. */
static void gaps(stream *s, double from, double to, double *max_gap, int *min_events)
{
    *max_gap = 0;
    *min_events = MAX_EVENTS;
    for (int i = 0; i < STREAMS; i++) {
        int n = atomic_load(&s[i].n), in = 0;
        for (int k = 1; k < n; k++) {
            if (s[i].at[k] >= from && s[i].at[k] <= to)
                in++;
            if (s[i].at[k] >= from && s[i].at[k - 1] <= to && s[i].at[k] - s[i].at[k - 1] > *max_gap)
                *max_gap = s[i].at[k] - s[i].at[k - 1];
        }
        if (in < *min_events)
            *min_events = in;
    }
}

/* A 1536-token prompt arriving while STREAMS streams decode is prefilled in
 * chunks: the streams get tokens all through its prefill. */
static void test_long_prompt_no_stall(void **state)
{
    (void)state;
    NEED_BIN();
    char log[400];
    snprintf(log, sizeof log, "%s/stall.log", tmpdir);
    kvt_ts_server sv;
    const char *args[] = {"--model", model, "--tokenizer", tok, "--prompt-cache", "0", NULL};
    assert_int_equal(kvt_ts_server_start(&sv, bin, log, args), 0);
    g_sv = &sv;
    stream *s = g_streams;
    for (int i = 0; i < STREAMS; i++)
        stream_start(&s[i], sv.port, i);
    wait_events(s, 10); /* all running, decoding together */

    /* without a long prompt: the gaps over the next 30 events */
    double base_from = now_ms();
    int n0 = atomic_load(&s[0].n);
    wait_events(s, n0 + 30);
    double base_to = now_ms();
    wait_events(s, atomic_load(&s[0].n) + 2); /* the gaps that end after base_to */
    double gap_without;
    int ev_without;
    gaps(s, base_from, base_to, &gap_without, &ev_without);

    /* the long prompt: 1536 token ids (6 chunks), one token generated */
    enum { LONG = 1536 };
    size_t cap = 32 + LONG * 6;
    char *body = malloc(cap);
    assert_non_null(body);
    size_t o = (size_t)snprintf(body, cap, "{\"max_tokens\": 1, \"temperature\": 0, \"prompt\": [1");
    for (int i = 1; i < LONG; i++)
        o += (size_t)snprintf(body + o, cap - o, ", %d", 3 + (i * 37) % 250);
    snprintf(body + o, cap - o, "]}");
    kvt_ts_resp r;
    double sent = now_ms();
    /* under TSan at load 19 this prefill took 100 s (each chunk ~17 s) */
    kvt_ts_http(sv.port, "POST", "/v1/completions", NULL, body, 120 * KVT_TEST_TIME_SCALE, &r);
    double answered = now_ms();
    free(body);
    if (r.status != 200)
        fprintf(stderr, "long prompt: %d %s\n", r.status, r.body);
    assert_int_equal(r.status, 200);
    json_error_t je;
    json_t *doc = json_loads(r.body, 0, &je);
    assert_non_null(doc);
    json_t *kv = json_object_get(json_object_get(doc, "usage"), "kvtier");
    int64_t prefilled = json_integer_value(json_object_get(kv, "prefilled_tokens"));
    double ttft = json_real_value(json_object_get(kv, "ttft_ms"));
    json_decref(doc);
    kvt_ts_resp_free(&r);
    assert_int_equal(prefilled, LONG);
    int n_now = 0;
    for (int i = 0; i < STREAMS; i++)
        n_now = atomic_load(&s[i].n) > n_now ? atomic_load(&s[i].n) : n_now;
    wait_events(s, n_now + 1); /* the gaps that end after the reply */
    double gap_with;
    int ev_with;
    gaps(s, sent, answered, &gap_with, &ev_with);
    int chunks = (LONG + KVT_MODEL_CHUNK - 1) / KVT_MODEL_CHUNK;
    print_message("long prompt of %d tokens, prefill chunk %d tokens (%d chunks): its TTFT %.1f ms, reply %.1f ms\n",
                  LONG, KVT_MODEL_CHUNK, chunks, ttft, answered - sent);
    print_message("max inter-token gap of %d running streams: %.1f ms without the long prefill (%d+ events), "
                  "%.1f ms while it is prefilled (each stream got %d+ events meanwhile)\n",
                  STREAMS, gap_without, ev_without, gap_with, ev_with);
    for (int i = 0; i < STREAMS; i++) {
        assert_false(atomic_load(&s[i].ended)); /* still running: the window was theirs too */
        shutdown(s[i].fd, SHUT_RDWR);           /* disconnect: the server cancels them */
        pthread_join(s[i].th, NULL);
        close(s[i].fd);
    }
    g_started = 0;
    /* one decode step per prefill chunk: a stream stalled for the whole
     * prefill would get no event in the window (1 at most at its edge) */
    assert_true(ev_with >= chunks / 2);
    assert_true(gap_with < answered - sent);
    g_sv = NULL;
    assert_int_equal(kvt_ts_server_stop(&sv), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_health_while_loading),
        cmocka_unit_test_teardown(test_long_prompt_no_stall, streams_teardown),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
