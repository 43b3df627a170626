/*
 * test_serve.c: `kvtier serve` end to end over HTTP on a free loopback port
 * (the server is the built kvtier binary, started with --port 0 and stopped
 * with SIGTERM; a small HTTP/1.0 client over sockets drives it). On
 * stories260K (skipped with a message when KVT_SHARED_DIR lacks it):
 * health and models; every error the server answers (malformed JSON, wrong
 * types, missing fields, n > 1, context overflow, unknown model/path, wrong
 * method, body over --max-body, queue full, API key) as an OpenAI error
 * object; streaming as OpenAI sends it; a multi-turn chat whose later turns
 * reuse the cache, with replies byte-identical to a --prompt-cache 0 server
 * (run with --threads 1) and to `kvtier chat`; 64 concurrent 3-turn conversations identical to the
 * cache-off replies; a client that disconnects cancels its request;
 * tokenize/detokenize; /metrics through promtool; SIGTERM flushing the SSD
 * tier so a restarted server reuses from disk; an --ssd-cache directory that
 * cannot be written degrading the tier (one warning) instead of the server.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "sampler.h"
#include "serve_util.h"
#include "test_seed.h"
#include "tokenizer.h"

static char model[1024], tokenizer[1024], tmpdir[256];
static const char *bin;

/* ---- the server process ------------------------------------------------------------------ */

typedef kvt_ts_server server;

#define read_file kvt_ts_read_file

/* Servers started and not yet stopped: killed by the group teardown when a
 * test fails half-way. */
#define MAX_LIVE 16
static pid_t live[MAX_LIVE];

static void forget(pid_t pid)
{
    for (int i = 0; i < MAX_LIVE; i++)
        if (live[i] == pid)
            live[i] = 0;
}

/* Starts `kvtier serve` on stories260K with the given extra flags (NULL-terminated). */
static void server_start_model(server *sv, const char *name, const char *m, const char *t,
                               const char *const *extra)
{
    char log[300];
    snprintf(log, sizeof log, "%s/%s.log", tmpdir, name);
    const char *args[64] = {"--model", m, "--tokenizer", t};
    int n = 4;
    for (int i = 0; extra && extra[i]; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(kvt_ts_server_start(sv, bin, log, args), 0);
    for (int i = 0; i < MAX_LIVE; i++)
        if (!live[i]) {
            live[i] = sv->pid;
            break;
        }
}

static void server_start(server *sv, const char *name, const char *const *extra)
{
    server_start_model(sv, name, model, tokenizer, extra);
}

/* SIGTERM, then the exit status (-1 when it did not exit within 30 s). */
static int server_stop(server *sv)
{
    forget(sv->pid);
    return kvt_ts_server_stop(sv);
}

/* ---- a small HTTP/1.0 client (tests/support/serve_util.c) ----------------------------------------- */

typedef kvt_ts_resp resp;
#define resp_free kvt_ts_resp_free
#define send_all kvt_ts_send_all
#define send_request kvt_ts_send_request
#define read_response kvt_ts_read_response

#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1 /* CMake: 10 under TSan, 3 under ASan, else 1 */
#endif

/* A connection whose receives time out after 120 s (times the build's
 * slowness: a TSan build's test_queue_full waited longer than 120 s for the
 * second of two 300-token replies of the slow model served one at a time). */
static int connect_to(int port)
{
    int fd = kvt_ts_connect(port, 120 * KVT_TEST_TIME_SCALE);
    assert_true(fd >= 0);
    return fd;
}

static void http(int port, const char *method, const char *path, const char *headers, const char *body, resp *r)
{
    int fd = connect_to(port);
    send_request(fd, method, path, headers, body);
    read_response(fd, r);
}

static json_t *parse(const resp *r)
{
    json_error_t e;
    json_t *doc = json_loads(r->body, 0, &e);
    if (!doc)
        fprintf(stderr, "not JSON (status %d): %s\n", r->status, r->body);
    assert_non_null(doc);
    return doc;
}

/* Asserts an OpenAI error object with this status, param (NULL: null) and
 * a message holding `needle`. */
static void expect_error(const resp *r, int status, const char *param, const char *needle)
{
    if (r->status != status)
        fprintf(stderr, "expected %d, got %d: %s\n", status, r->status, r->body);
    assert_int_equal(r->status, status);
    json_t *doc = parse(r);
    json_t *err = json_object_get(doc, "error");
    assert_true(json_is_object(err));
    const char *msg = json_string_value(json_object_get(err, "message"));
    assert_non_null(msg);
    assert_true(json_is_string(json_object_get(err, "type")));
    assert_non_null(json_object_get(err, "code"));
    json_t *p = json_object_get(err, "param");
    if (param)
        assert_string_equal(json_string_value(p), param);
    else
        assert_true(json_is_null(p));
    if (needle && !strstr(msg, needle))
        fprintf(stderr, "message '%s' lacks '%s'\n", msg, needle);
    if (needle)
        assert_non_null(strstr(msg, needle));
    json_decref(doc);
}

/* ---- fixtures ------------------------------------------------------------------------------------ */

static int have_model;
static server main_srv;     /* cache on */
static server off_srv;      /* --prompt-cache 0 */

static int setup(void **state)
{
    bin = getenv("KVT_BIN");
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tokenizer, sizeof tokenizer, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    have_model = bin && access(model, R_OK) == 0 && access(tokenizer, R_OK) == 0;
    if (!have_model) {
        printf("test_serve: skipped: needs KVT_BIN and %s with tok512.bin (set KVT_SHARED_DIR)\n", model);
        return 0;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvt_serve_XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
    const char *on[] = {"--max-body", "64K", NULL};
    server_start(&main_srv, "main", on);
    /* one engine thread: every comparison with main_srv (online CPUs, at
     * most 8) also checks that replies do not depend on --threads */
    const char *off[] = {"--prompt-cache", "0", "--threads", "1", NULL};
    server_start(&off_srv, "off", off);
    return 0;
}

static int teardown(void **state)
{
    if (!have_model)
        return 0;
    for (int i = 0; i < MAX_LIVE; i++)
        if (live[i] && live[i] != main_srv.pid && live[i] != off_srv.pid) {
            kill(live[i], SIGKILL);
            waitpid(live[i], NULL, 0);
        }
    assert_int_equal(server_stop(&main_srv), 0);
    assert_int_equal(server_stop(&off_srv), 0);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", tmpdir);
    return 0;
}

#define NEED_MODEL()          \
    do {                      \
        if (!have_model) {    \
            skip();           \
            return;           \
        }                     \
    } while (0)

/* ---- chat helpers ---------------------------------------------------------------------------------- */

static const char *const script[] = {
    "Hello! Can you tell me a short story about a cat?",
    "What was the name of the cat?",
    "Where did the cat live?",
    "What happened at the end?",
    "Thank you, that was lovely.",
};

/* Body of a chat request over turns [0, n): user messages from `users`,
 * assistant messages from `replies`. Caller frees. */
static char *chat_body(const char *const *users, char *const *replies, int n, int stream, int max_tokens,
                       const char *session)
{
    json_t *msgs = json_array();
    for (int i = 0; i < n; i++) {
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", users[i]));
        if (i < n - 1)
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", replies[i]));
    }
    json_t *doc = json_pack("{s:o, s:f, s:i, s:b}", "messages", msgs, "temperature", 0.0, "max_tokens", max_tokens,
                            "stream", stream);
    if (stream)
        json_object_set_new(doc, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (session)
        json_object_set_new(doc, "prompt_cache_key", json_string(session));
    char *s = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    return s;
}

/* Collects a streamed reply: content concatenated, checks the framing. */
static char *collect_stream(const resp *r, json_t **usage, const char *object)
{
    assert_int_equal(r->status, 200);
    assert_non_null(strstr(r->head, "text/event-stream"));
    size_t cap = r->len + 1, n = 0;
    char *text = calloc(1, cap);
    const char *p = r->body;
    int events = 0, done = 0, finished = 0;
    *usage = NULL;
    while (*p) {
        assert_memory_equal(p, "data: ", 6);
        const char *e = strstr(p, "\n\n");
        assert_non_null(e);
        char *data = strndup(p + 6, (size_t)(e - p - 6));
        p = e + 2;
        assert_false(done); /* nothing after [DONE] */
        if (!strcmp(data, "[DONE]")) {
            done = 1;
            free(data);
            continue;
        }
        json_t *doc = json_loads(data, 0, NULL);
        assert_non_null(doc);
        assert_string_equal(json_string_value(json_object_get(doc, "object")), object);
        json_t *choices = json_object_get(doc, "choices");
        assert_true(json_is_array(choices));
        if (json_array_size(choices) == 0) { /* the usage chunk: last before [DONE] */
            assert_true(finished);
            *usage = json_incref(json_object_get(doc, "usage"));
            assert_true(json_is_object(*usage));
        } else {
            assert_null(*usage);
            json_t *c = json_array_get(choices, 0);
            json_t *delta = json_object_get(c, "delta");
            const char *piece = delta ? json_string_value(json_object_get(delta, "content"))
                                      : json_string_value(json_object_get(c, "text"));
            if (delta && events == 0)
                assert_string_equal(json_string_value(json_object_get(delta, "role")), "assistant");
            if (piece) {
                memcpy(text + n, piece, strlen(piece));
                n += strlen(piece);
            }
            if (!json_is_null(json_object_get(c, "finish_reason")))
                finished = 1;
            json_t *uu = json_object_get(doc, "usage"); /* include_usage: null until the end; else absent */
            assert_true(!uu || json_is_null(uu));
        }
        events++;
        json_decref(doc);
        free(data);
    }
    assert_true(done);
    assert_true(finished);
    return text;
}

/* One chat turn; returns the reply (caller frees) and the usage (caller decrefs). */
static char *chat_turn(int port, const char *const *users, char *const *replies, int n, int stream,
                       const char *session, json_t **usage)
{
    char *body = chat_body(users, replies, n, stream, 40, session);
    resp r;
    http(port, "POST", "/v1/chat/completions", NULL, body, &r);
    free(body);
    char *text;
    if (stream)
        text = collect_stream(&r, usage, "chat.completion.chunk");
    else {
        if (r.status != 200)
            fprintf(stderr, "chat turn: %d %s\n", r.status, r.body);
        assert_int_equal(r.status, 200);
        json_t *doc = parse(&r);
        json_t *c = json_array_get(json_object_get(doc, "choices"), 0);
        text = strdup(json_string_value(json_object_get(json_object_get(c, "message"), "content")));
        *usage = json_incref(json_object_get(doc, "usage"));
        json_decref(doc);
    }
    resp_free(&r);
    return text;
}

static int64_t usage_int(json_t *u, const char *a, const char *b)
{
    json_t *v = json_object_get(u, a);
    if (b)
        v = json_object_get(v, b);
    assert_true(json_is_integer(v));
    return json_integer_value(v);
}

/* ---- tests ---------------------------------------------------------------------------------------- */

static void test_health_models(void **state)
{
    NEED_MODEL();
    resp r;
    http(main_srv.port, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    http(main_srv.port, "GET", "/v1/models", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    json_t *doc = parse(&r);
    assert_string_equal(json_string_value(json_object_get(doc, "object")), "list");
    json_t *m = json_array_get(json_object_get(doc, "data"), 0);
    assert_string_equal(json_string_value(json_object_get(m, "id")), "stories260K");
    json_decref(doc);
    resp_free(&r);
    http(main_srv.port, "GET", "/v1/models/stories260K", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    http(main_srv.port, "GET", "/v1/models/gpt-4", NULL, NULL, &r);
    expect_error(&r, 404, "model", "gpt-4");
    resp_free(&r);
}

static void test_errors(void **state)
{
    NEED_MODEL();
    int port = main_srv.port;
    resp r;
    http(port, "POST", "/v1/chat/completions", NULL, "{\"messages\": [\n  {\"role\": \"user\",, }]}", &r);
    expect_error(&r, 400, NULL, "line 2, column");
    resp_free(&r);
    http(port, "POST", "/v1/chat/completions", NULL, "[1, 2]", &r);
    expect_error(&r, 400, NULL, "JSON object");
    resp_free(&r);
    http(port, "POST", "/v1/chat/completions", NULL,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": \"7\"}", &r);
    expect_error(&r, 400, "max_tokens", "integer");
    resp_free(&r);
    http(port, "POST", "/v1/chat/completions", NULL,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": \"hot\"}", &r);
    expect_error(&r, 400, "temperature", "number");
    resp_free(&r);
    http(port, "POST", "/v1/chat/completions", NULL, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", &r);
    expect_error(&r, 400, "messages[0].content", "string");
    resp_free(&r);
    http(port, "POST", "/v1/chat/completions", NULL, "{\"model\": \"stories260K\"}", &r);
    expect_error(&r, 400, "messages", "required");
    resp_free(&r);
    http(port, "POST", "/v1/completions", NULL, "{\"max_tokens\": 4}", &r);
    expect_error(&r, 400, "prompt", "required");
    resp_free(&r);
    http(port, "POST", "/v1/completions", NULL, "{\"prompt\": \"Once\", \"n\": 2}", &r);
    expect_error(&r, 400, "n", "must be 1");
    resp_free(&r);
    /* stories260K's context is 512 tokens: 5 prompt tokens + 600 */
    http(port, "POST", "/v1/completions", NULL, "{\"prompt\": \"Once upon a time\", \"max_tokens\": 600}", &r);
    expect_error(&r, 400, "max_tokens", "context is 512 tokens; the prompt has 5 tokens and max_tokens asks for 600");
    resp_free(&r);
    http(port, "POST", "/v1/completions", NULL, "{\"prompt\": [1, 99999]}", &r);
    expect_error(&r, 400, "prompt", "outside the vocabulary");
    resp_free(&r);
    http(port, "POST", "/v1/completions", NULL, "{\"prompt\": \"Once\", \"model\": \"gpt-4o\"}", &r);
    expect_error(&r, 404, "model", "gpt-4o");
    resp_free(&r);
    http(port, "GET", "/v1/nothing", NULL, NULL, &r);
    expect_error(&r, 404, NULL, "no endpoint GET /v1/nothing; the endpoints are: POST /v1/chat/completions, "
                                "POST /v1/completions, GET /v1/models, GET /v1/models/{model}, GET /health, "
                                "POST /tokenize, POST /detokenize, GET /stats, GET /metrics, GET /dashboard, "
                                "GET /events");
    resp_free(&r);
    http(port, "GET", "/v1/chat/completions", NULL, NULL, &r);
    expect_error(&r, 405, NULL, "POST");
    assert_non_null(strstr(r.head, "Allow: POST"));
    resp_free(&r);
    http(port, "POST", "/health", NULL, "{}", &r);
    expect_error(&r, 405, NULL, "GET");
    resp_free(&r);
    /* --max-body 64K: a 100 KB body is refused from its Content-Length */
    char *big = malloc(100001);
    memset(big, ' ', 100000);
    big[0] = '{';
    big[99999] = '}';
    big[100000] = '\0';
    http(port, "POST", "/v1/completions", NULL, big, &r);
    expect_error(&r, 413, NULL, "65536");
    resp_free(&r);
    free(big);
    /* the server still answers */
    http(port, "POST", "/v1/completions", NULL, "{\"prompt\": \"Once upon a time\", \"max_tokens\": 3, \"temperature\": 0}", &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
}

static void test_api_key(void **state)
{
    NEED_MODEL();
    server sv;
    const char *extra[] = {"--api-key", "sekrit-key-42", NULL};
    server_start(&sv, "key", extra);
    resp r;
    const char *body = "{\"prompt\": \"Once\", \"max_tokens\": 2}";
    http(sv.port, "POST", "/v1/completions", NULL, body, &r);
    expect_error(&r, 401, NULL, "API key");
    resp_free(&r);
    http(sv.port, "POST", "/v1/completions", "Authorization: Bearer sekrit-key-43\r\n", body, &r);
    expect_error(&r, 401, NULL, "API key");
    resp_free(&r);
    http(sv.port, "GET", "/stats", "Authorization: Bearer sekrit\r\n", NULL, &r);
    expect_error(&r, 401, NULL, "API key");
    resp_free(&r);
    http(sv.port, "POST", "/v1/completions", "Authorization: Bearer sekrit-key-42\r\n", body, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    http(sv.port, "GET", "/health", NULL, NULL, &r); /* probes need no key */
    assert_int_equal(r.status, 200);
    resp_free(&r);
    assert_int_equal(server_stop(&sv), 0);
    char log[8192];
    assert_true(read_file(sv.log, log, sizeof log) > 0);
    assert_null(strstr(log, "sekrit")); /* never logged */
}

/* Several long requests at once against --max-running 1 --max-queue 1:
 * one runs, one waits, the rest get 429 with Retry-After. */
/* A synthetic model slow enough (a few ms per token) that requests sent
 * together all arrive while the first still runs; byte tokenizer. */
static char slow_model[400], slow_tok[400];

static void make_slow_model(void)
{
    if (slow_model[0])
        return;
    snprintf(slow_model, sizeof slow_model, "%s/slow.bin", tmpdir);
    snprintf(slow_tok, sizeof slow_tok, "%s/slow_tok.bin", tmpdir);
    kvt_synth_params p = {.dim = 256, .hidden_dim = 768, .n_layers = 6, .n_heads = 8, .n_kv_heads = 8,
                          .vocab_size = KVT_DEFAULT_VOCAB, .seq_len = 1024, .seed = 7, .separate_classifier = 1};
    assert_int_equal(kvt_model_synth(&p, slow_model), 0);
    assert_int_equal(kvt_tokenizer_write_default(slow_tok, KVT_DEFAULT_VOCAB), 0);
}

static void test_queue_full(void **state)
{
    NEED_MODEL();
    make_slow_model();
    const char *mpath = slow_model, *tpath = slow_tok;
    server sv;
    const char *extra[] = {"--max-running", "1", "--max-queue", "1", NULL};
    server_start_model(&sv, "queue", mpath, tpath, extra);
    enum { N = 6 };
    int fds[N];
    const char *body = "{\"prompt\": [1, 40, 41], \"max_tokens\": 300, \"temperature\": 1, \"seed\": 3}";
    for (int i = 0; i < N; i++) {
        fds[i] = connect_to(sv.port);
        send_request(fds[i], "POST", "/v1/completions", NULL, body);
    }
    int ok = 0, full = 0;
    for (int i = 0; i < N; i++) {
        resp r;
        read_response(fds[i], &r);
        if (r.status == 200)
            ok++;
        else {
            expect_error(&r, 429, NULL, "queue is full");
            assert_non_null(strstr(r.head, "Retry-After: 1"));
            full++;
        }
        resp_free(&r);
    }
    printf("queue: %d served, %d refused with 429\n", ok, full);
    assert_true(ok >= 2);
    assert_true(full >= 1);
    assert_int_equal(server_stop(&sv), 0);
}

static void test_stream_format(void **state)
{
    NEED_MODEL();
    json_t *u1 = NULL, *u2 = NULL;
    const char *users[] = {"Once there was a dog. What did the dog like?"};
    char *plain = chat_turn(off_srv.port, users, NULL, 1, 0, NULL, &u1);
    char *streamed = chat_turn(off_srv.port, users, NULL, 1, 1, NULL, &u2);
    assert_string_equal(plain, streamed);
    assert_true(strlen(plain) > 0);
    assert_int_equal(usage_int(u1, "prompt_tokens", NULL), usage_int(u2, "prompt_tokens", NULL));
    assert_int_equal(usage_int(u1, "completion_tokens", NULL), usage_int(u2, "completion_tokens", NULL));
    assert_int_equal(usage_int(u2, "total_tokens", NULL),
                     usage_int(u2, "prompt_tokens", NULL) + usage_int(u2, "completion_tokens", NULL));
    assert_int_equal(usage_int(u2, "prompt_tokens_details", "cached_tokens"), 0); /* cache off */
    free(plain);
    free(streamed);
    json_decref(u1);
    json_decref(u2);
    /* completions stream "text_completion" chunks */
    resp r;
    http(off_srv.port, "POST", "/v1/completions", NULL,
         "{\"prompt\": \"Once upon a time\", \"max_tokens\": 12, \"temperature\": 0, \"stream\": true}", &r);
    json_t *u = NULL;
    char *t = collect_stream(&r, &u, "text_completion");
    assert_null(u); /* no include_usage: no usage chunk */
    resp_free(&r);
    http(off_srv.port, "POST", "/v1/completions", NULL,
         "{\"prompt\": \"Once upon a time\", \"max_tokens\": 12, \"temperature\": 0}", &r);
    json_t *doc = parse(&r);
    assert_string_equal(t, json_string_value(json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "text")));
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(doc, "choices"), 0),
                                                          "finish_reason")), "length");
    json_decref(doc);
    resp_free(&r);
    free(t);
    /* a stop sequence cuts the reply before it, streamed or not */
    http(off_srv.port, "POST", "/v1/completions", NULL,
         "{\"prompt\": \"Once upon a time\", \"max_tokens\": 30, \"temperature\": 0, \"stop\": [\"Lily\"]}", &r);
    doc = parse(&r);
    json_t *c0 = json_array_get(json_object_get(doc, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c0, "text")), ", there was a little girl named ");
    assert_string_equal(json_string_value(json_object_get(c0, "finish_reason")), "stop");
    json_decref(doc);
    resp_free(&r);
    http(off_srv.port, "POST", "/v1/completions", NULL,
         "{\"prompt\": \"Once upon a time\", \"max_tokens\": 30, \"temperature\": 0, \"stop\": \"Lily\", \"stream\": true}",
         &r);
    t = collect_stream(&r, &u, "text_completion");
    assert_string_equal(t, ", there was a little girl named ");
    free(t);
    resp_free(&r);
}

/* Reads `kvtier chat`'s replies for the first n script lines (one per line of stdout). */
static char **kvtier_chat_replies(int n)
{
    char path[400], cmd[3000];
    snprintf(path, sizeof path, "%s/script.txt", tmpdir);
    FILE *f = fopen(path, "w");
    for (int i = 0; i < n; i++)
        fprintf(f, "%s\n", script[i]);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s chat --model %s --tokenizer %s --script %s --max-tokens 40 2>/dev/null", bin, model,
             tokenizer, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char **out = calloc((size_t)n, sizeof *out);
    char line[4096];
    for (int i = 0; i < n && fgets(line, sizeof line, p); i++) {
        line[strcspn(line, "\n")] = '\0';
        out[i] = strdup(line);
    }
    assert_int_equal(pclose(p), 0);
    return out;
}

static void test_multi_turn_cache(void **state)
{
    NEED_MODEL();
    enum { T = 5 };
    char **ref = kvtier_chat_replies(T);
    for (int stream = 0; stream <= 1; stream++) {
        char *on[T] = {0}, *off[T] = {0};
        for (int t = 0; t < T; t++) {
            json_t *uon = NULL, *uoff = NULL;
            on[t] = chat_turn(main_srv.port, script, on, t + 1, stream, stream ? "s-stream" : "s-plain", &uon);
            off[t] = chat_turn(off_srv.port, script, off, t + 1, stream, NULL, &uoff);
            int64_t cached = usage_int(uon, "prompt_tokens_details", "cached_tokens");
            int64_t prompt = usage_int(uon, "prompt_tokens", NULL);
            printf("%s turn %d: prompt %lld, cached %lld, prefilled %lld\n", stream ? "stream" : "plain", t + 1,
                   (long long)prompt, (long long)cached, (long long)usage_int(uon, "kvtier", "prefilled_tokens"));
            assert_int_equal(cached + usage_int(uon, "kvtier", "prefilled_tokens"), prompt);
            assert_int_equal(usage_int(uoff, "prompt_tokens_details", "cached_tokens"), 0);
            if (t > 0)
                assert_true(cached > prompt / 2); /* the history comes from the cache */
            assert_string_equal(on[t], off[t]);   /* byte-identical to cache off */
            assert_string_equal(on[t], ref[t]);   /* and to kvtier chat */
            json_decref(uon);
            json_decref(uoff);
        }
        for (int t = 0; t < T; t++) {
            free(on[t]);
            free(off[t]);
        }
    }
    for (int t = 0; t < T; t++)
        free(ref[t]);
    free(ref);
}

/* ---- concurrency ---------------------------------------------------------------------------------------- */

enum { CLIENTS = 64, TURNS = 3 };

typedef struct {
    int port, id;
    char users[TURNS][128];
    char *replies[TURNS];
    int errors;
} client;

static void *client_main(void *arg)
{
    client *c = arg;
    const char *users[TURNS];
    for (int t = 0; t < TURNS; t++)
        users[t] = c->users[t];
    for (int t = 0; t < TURNS; t++) {
        char *body = chat_body(users, c->replies, t + 1, c->id % 2, 24, NULL);
        resp r;
        http(c->port, "POST", "/v1/chat/completions", NULL, body, &r);
        free(body);
        if (r.status != 200) {
            fprintf(stderr, "client %d turn %d (port %d): status %d: %.300s\n", c->id, t + 1, c->port, r.status,
                    r.body ? r.body : "");
            c->errors++;
            resp_free(&r);
            return NULL;
        }
        if (c->id % 2) {
            /* streamed: concatenate the content deltas */
            size_t n = 0;
            char *text = calloc(1, r.len + 1);
            for (const char *p = strstr(r.body, "data: "); p; p = strstr(p + 1, "data: ")) {
                const char *e = strstr(p, "\n\n");
                char *data = strndup(p + 6, (size_t)(e - p - 6));
                json_t *doc = json_loads(data, 0, NULL);
                json_t *delta = json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "delta");
                const char *piece = json_string_value(json_object_get(delta, "content"));
                if (piece) {
                    memcpy(text + n, piece, strlen(piece));
                    n += strlen(piece);
                }
                json_decref(doc);
                free(data);
            }
            c->replies[t] = text;
        } else {
            json_t *doc = json_loads(r.body, 0, NULL);
            json_t *ch = json_array_get(json_object_get(doc, "choices"), 0);
            const char *s = json_string_value(json_object_get(json_object_get(ch, "message"), "content"));
            c->replies[t] = strdup(s ? s : "");
            json_decref(doc);
        }
        resp_free(&r);
    }
    return NULL;
}

static void decode_counters(int port, int64_t *steps, int64_t *seqs)
{
    resp r;
    http(port, "GET", "/stats", NULL, NULL, &r);
    json_t *doc = parse(&r);
    json_t *c = json_object_get(json_object_get(doc, "server"), "counters");
    *steps = json_integer_value(json_object_get(c, "decode_steps"));
    *seqs = json_integer_value(json_object_get(c, "decode_batch_sequences"));
    json_decref(doc);
    resp_free(&r);
}

static void test_concurrent_clients(void **state)
{
    NEED_MODEL();
    static client on[CLIENTS], ref[CLIENTS];
    static const char *const topics[] = {"cat", "dog", "bird", "frog", "ball", "tree", "car", "boat"};
    for (int i = 0; i < CLIENTS; i++) {
        on[i] = (client){.port = main_srv.port, .id = i};
        snprintf(on[i].users[0], 128, "Client %d asks: tell me a story about a %s.", i, topics[i % 8]);
        snprintf(on[i].users[1], 128, "What did the %s do next?", topics[(i / 8) % 8]);
        snprintf(on[i].users[2], 128, "How did it end for number %d?", i);
        ref[i] = on[i];
        ref[i].port = off_srv.port;
    }
    int64_t steps0, seqs0, steps1, seqs1;
    decode_counters(main_srv.port, &steps0, &seqs0);
    pthread_t th[CLIENTS];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < CLIENTS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, client_main, &on[i]), 0);
    for (int i = 0; i < CLIENTS; i++)
        pthread_join(th[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    decode_counters(main_srv.port, &steps1, &seqs1);
    double mean_batch = (double)(seqs1 - seqs0) / (double)(steps1 - steps0 > 0 ? steps1 - steps0 : 1);
    printf("decode steps %lld, mean batch %.1f sequences\n", (long long)(steps1 - steps0), mean_batch);
    assert_true(mean_batch > 2.0); /* the replies below were decoded batched */
    for (int i = 0; i < CLIENTS; i++) /* the reference: each conversation alone, cache off */
        client_main(&ref[i]);
    int errors = 0, differ = 0;
    for (int i = 0; i < CLIENTS; i++) {
        errors += on[i].errors + ref[i].errors;
        for (int t = 0; t < TURNS; t++) {
            if (on[i].replies[t] && ref[i].replies[t] && strcmp(on[i].replies[t], ref[i].replies[t])) {
                if (!differ)
                    fprintf(stderr, "client %d turn %d: '%s' vs alone '%s'\n", i, t + 1, on[i].replies[t],
                            ref[i].replies[t]);
                differ++;
            }
            free(on[i].replies[t]);
            free(ref[i].replies[t]);
        }
    }
    printf("%d concurrent clients x %d turns in %.2f s: %d errors, %d replies differing from cache-off alone\n",
           CLIENTS, TURNS, (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9, errors, differ);
    assert_int_equal(errors, 0);
    assert_int_equal(differ, 0);
}

/* ---- the rest -------------------------------------------------------------------------------------------- */

static void test_tokenize(void **state)
{
    NEED_MODEL();
    resp r;
    http(main_srv.port, "POST", "/tokenize", NULL, "{\"prompt\": \"Once upon a time\"}", &r);
    assert_int_equal(r.status, 200);
    json_t *doc = parse(&r);
    assert_int_equal(json_integer_value(json_object_get(doc, "count")), 5);
    assert_int_equal(json_integer_value(json_object_get(doc, "max_model_len")), 512);
    json_t *toks = json_object_get(doc, "tokens");
    assert_int_equal(json_integer_value(json_array_get(toks, 0)), 1); /* BOS */
    json_t *req = json_pack("{s:O}", "tokens", toks);
    char *body = json_dumps(req, 0);
    json_decref(req);
    json_decref(doc);
    resp_free(&r);
    http(main_srv.port, "POST", "/detokenize", NULL, body, &r);
    free(body);
    assert_int_equal(r.status, 200);
    doc = parse(&r);
    assert_string_equal(json_string_value(json_object_get(doc, "prompt")), "Once upon a time");
    json_decref(doc);
    resp_free(&r);
    http(main_srv.port, "POST", "/detokenize", NULL, "{\"tokens\": [1, -4]}", &r);
    expect_error(&r, 400, "tokens", "[0, 512)");
    resp_free(&r);
}

static void test_metrics_promtool(void **state)
{
    NEED_MODEL();
    resp r;
    http(main_srv.port, "GET", "/metrics", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.head, "text/plain; version=0.0.4"));
    assert_non_null(strstr(r.body, "kvtier_prefix_cache_queries_total "));
    assert_non_null(strstr(r.body, "kvtier_cached_tokens_total{tier=\"ram\"} "));
    assert_non_null(strstr(r.body, "kvtier_time_to_first_token_seconds_bucket{le=\"0.001\"} "));
    assert_non_null(strstr(r.body, "kvtier_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} "));
    assert_non_null(strstr(r.body, "kvtier_tier_max_bytes{model=\"stories260K\",tier=\"ram\"} 1073741824"));
    char path[400], cmd[800];
    snprintf(path, sizeof path, "%s/metrics.txt", tmpdir);
    FILE *f = fopen(path, "w");
    fwrite(r.body, 1, r.len, f);
    fclose(f);
    resp_free(&r);
    if (system("command -v promtool >/dev/null 2>&1") != 0) {
        printf("test_metrics_promtool: promtool is not installed (Debian package prometheus): lint skipped\n");
        return;
    }
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
    assert_int_equal(system(cmd), 0);
}

/* SIGTERM flushes the SSD tier: a restarted server reuses the conversation from disk. */
static void test_shutdown_ssd(void **state)
{
    NEED_MODEL();
    char ssd[400];
    snprintf(ssd, sizeof ssd, "%s/ssd", tmpdir);
    const char *extra[] = {"--ssd-cache", ssd, NULL};
    server sv;
    server_start(&sv, "ssd1", extra);
    json_t *u = NULL;
    char *r1[2] = {0};
    r1[0] = chat_turn(sv.port, script, r1, 1, 0, NULL, &u);
    json_decref(u);
    assert_int_equal(server_stop(&sv), 0);
    char log[8192];
    read_file(sv.log, log, sizeof log);
    assert_non_null(strstr(log, "kvtier serve: stopped"));
    server_start(&sv, "ssd2", extra);
    r1[1] = chat_turn(sv.port, script, r1, 2, 0, NULL, &u);
    int64_t ssd_reused = json_integer_value(json_object_get(json_object_get(json_object_get(u, "kvtier"), "reused_tokens"), "ssd"));
    printf("after a restart: %lld tokens reused from the SSD tier (prompt %lld)\n", (long long)ssd_reused,
           (long long)usage_int(u, "prompt_tokens", NULL));
    assert_true(ssd_reused > 0);
    json_decref(u);
    assert_int_equal(server_stop(&sv), 0);
    free(r1[0]);
    free(r1[1]);
}

/* kill -9 loses nothing that reached the SSD tier: with --demote-idle the
 * idle conversation is written behind; a restarted server reuses it. */
static void test_kill9_ssd(void **state)
{
    NEED_MODEL();
    char ssd[400];
    snprintf(ssd, sizeof ssd, "%s/ssd9", tmpdir);
    const char *extra[] = {"--ssd-cache", ssd, "--demote-idle", "50", NULL};
    server sv;
    server_start(&sv, "kill9a", extra);
    json_t *u = NULL;
    char *r1[2] = {0};
    r1[0] = chat_turn(sv.port, script, r1, 1, 0, NULL, &u);
    json_decref(u);
    int64_t written = 0, pending = 1;
    for (int i = 0; i < 3000 && (written == 0 || pending != 0); i++) { /* wait for the write-behind (60 s) */
        usleep(20000);
        resp r;
        http(sv.port, "GET", "/stats", NULL, NULL, &r);
        json_t *doc = parse(&r);
        written = json_integer_value(json_object_get(json_object_get(doc, "ssd"), "written"));
        pending = json_integer_value(json_object_get(json_object_get(doc, "ssd"), "pending"));
        json_decref(doc);
        resp_free(&r);
    }
    assert_true(written > 0);
    assert_int_equal(pending, 0);
    forget(sv.pid);
    kill(sv.pid, SIGKILL);
    waitpid(sv.pid, NULL, 0);
    server_start(&sv, "kill9b", extra);
    r1[1] = chat_turn(sv.port, script, r1, 2, 0, NULL, &u);
    int64_t ssd_reused =
        json_integer_value(json_object_get(json_object_get(json_object_get(u, "kvtier"), "reused_tokens"), "ssd"));
    printf("after kill -9 and a restart: %lld tokens reused from the SSD tier\n", (long long)ssd_reused);
    assert_true(ssd_reused > 0);
    json_decref(u);
    assert_int_equal(server_stop(&sv), 0);
    free(r1[0]);
    free(r1[1]);
}

/* How many times `needle` occurs in `hay`. */
static int occurrences(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* n turns of the script against the server on `port` and against the
 * cache-off server: the same replies. @return the prompt tokens the server
 * reused from its SSD tier over the n turns. */
static int64_t same_replies_as_off(int port, int n)
{
    char *on[3] = {0}, *off[3] = {0};
    int64_t ssd = 0;
    assert_true(n <= 3);
    for (int t = 0; t < n; t++) {
        json_t *u = NULL, *uoff = NULL;
        on[t] = chat_turn(port, script, on, t + 1, 0, NULL, &u);
        off[t] = chat_turn(off_srv.port, script, off, t + 1, 0, NULL, &uoff);
        ssd += json_integer_value(json_object_get(json_object_get(json_object_get(u, "kvtier"), "reused_tokens"), "ssd"));
        json_decref(u);
        json_decref(uoff);
        assert_string_equal(on[t], off[t]);
    }
    for (int t = 0; t < n; t++) {
        free(on[t]);
        free(off[t]);
    }
    return ssd;
}

/* The "mode" of the "ssd_cache" object of /stats (static buffer). */
static const char *ssd_mode(int port)
{
    static char mode[32];
    resp r;
    http(port, "GET", "/stats", NULL, NULL, &r);
    json_t *doc = parse(&r);
    const char *m = json_string_value(json_object_get(json_object_get(doc, "ssd_cache"), "mode"));
    snprintf(mode, sizeof mode, "%s", m ? m : "(none)");
    json_decref(doc);
    resp_free(&r);
    return mode;
}

/* An --ssd-cache directory the server cannot write does not stop it from
 * serving (it did: the store's open error failed the load): the tier turns
 * off (nothing there to read) or read-only (another process holds the lock:
 * what the directory holds still serves), with one warning naming the
 * directory and the cause, and replies as a cache-off server. */
static void test_unwritable_ssd(void **state)
{
    NEED_MODEL();
    char log[16384], want[700];
    /* a path under a regular file: neither writable nor readable */
    char file[400], bad[500];
    snprintf(file, sizeof file, "%s/not-a-dir", tmpdir);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fclose(f);
    snprintf(bad, sizeof bad, "%s/cache", file);
    server sv;
    server_start(&sv, "ssd_off", (const char *const[]){"--ssd-cache", bad, NULL});
    assert_int_equal(same_replies_as_off(sv.port, 2), 0);
    assert_string_equal(ssd_mode(sv.port), "off");
    assert_int_equal(server_stop(&sv), 0);
    read_file(sv.log, log, sizeof log);
    printf("off: %s", log);
    snprintf(want, sizeof want, "kvtier serve: warning: SSD cache %s", bad);
    assert_int_equal(occurrences(log, "warning: SSD cache "), 1);
    assert_non_null(strstr(log, want));
    assert_non_null(strstr(log, "continuing without it"));
    assert_non_null(strstr(log, "kvtier serve: stopped"));

    /* a directory whose lock another process holds: read-only, still serves */
    char dir[400];
    snprintf(dir, sizeof dir, "%s/ssd_locked", tmpdir);
    server_start(&sv, "ssd_fill", (const char *const[]){"--ssd-cache", dir, NULL});
    (void)same_replies_as_off(sv.port, 1);
    assert_int_equal(server_stop(&sv), 0);
    char cmd[600], lock[800];
    snprintf(cmd, sizeof cmd, "ls -d '%s'/*/ | head -1", dir);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(lock, 700, p));
    pclose(p);
    lock[strcspn(lock, "\n")] = '\0';
    strcat(lock, ".lock");
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    pid_t holder = fork();
    assert_true(holder >= 0);
    if (holder == 0) {
        int fd = open(lock, O_RDWR);
        if (fd < 0 || flock(fd, LOCK_EX) || write(pipefd[1], "x", 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    char x;
    assert_int_equal(read(pipefd[0], &x, 1), 1);
    server_start(&sv, "ssd_ro", (const char *const[]){"--ssd-cache", dir, NULL});
    int64_t ssd_reused = same_replies_as_off(sv.port, 2);
    assert_string_equal(ssd_mode(sv.port), "read-only");
    assert_int_equal(server_stop(&sv), 0);
    kill(holder, SIGKILL);
    waitpid(holder, NULL, 0);
    close(pipefd[0]);
    close(pipefd[1]);
    read_file(sv.log, log, sizeof log);
    printf("read-only: %s(%lld tokens reused from the SSD tier)\n", log, (long long)ssd_reused);
    snprintf(want, sizeof want, "kvtier serve: warning: SSD cache %s", dir);
    assert_int_equal(occurrences(log, "warning: SSD cache "), 1);
    assert_non_null(strstr(log, want));
    assert_non_null(strstr(log, "its lock is held by another process"));
    assert_non_null(strstr(log, "continuing read-only"));
    assert_true(ssd_reused > 0);
}

/* Random bytes and mutated requests at every POST endpoint: each is
 * answered (200 or an error object), and the server stays up. */
static void test_garbage(void **state)
{
    NEED_MODEL();
    uint64_t seed = test_seed("test_garbage");
    const char *paths[] = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"};
    const char *valid[] = {
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi there\"}], \"max_tokens\": 4, \"temperature\": 0}",
        "{\"prompt\": [1, 20, 30], \"max_tokens\": 3, \"stop\": [\"a\"], \"stream\": true}",
        "{\"prompt\": \"Once\"}",
        "{\"tokens\": [1, 50, 60]}",
    };
    int counts[600] = {0};
    for (int i = 0; i < 300; i++) {
        int k = (int)(kvt_rng_u32(&seed) % 4);
        size_t n = strlen(valid[k]);
        char body[512];
        memcpy(body, valid[k], n + 1);
        int mode = (int)(kvt_rng_u32(&seed) % 3);
        if (mode == 0) { /* random bytes */
            n = kvt_rng_u32(&seed) % 200;
            for (size_t b = 0; b < n; b++)
                body[b] = (char)(kvt_rng_u32(&seed) % 255 + 1);
            body[n] = '\0';
        } else { /* flip, drop or duplicate a few bytes of a valid body */
            for (int m = 0; m < 1 + (int)(kvt_rng_u32(&seed) % 4); m++) {
                size_t at = kvt_rng_u32(&seed) % n;
                int op = (int)(kvt_rng_u32(&seed) % 3);
                if (op == 0)
                    body[at] = (char)(kvt_rng_u32(&seed) % 255 + 1);
                else if (op == 1 && n > 1) {
                    memmove(body + at, body + at + 1, n - at);
                    n--;
                } else if (n < sizeof body - 2) {
                    memmove(body + at + 1, body + at, n - at + 1);
                    n++;
                }
            }
        }
        resp r;
        http(main_srv.port, "POST", paths[k], NULL, body, &r);
        if (r.status != 200 && r.status != 400 && r.status != 404) {
            fprintf(stderr, "body %s -> %d %s\n", body, r.status, r.body);
            fail();
        }
        if (r.status != 200) { /* an OpenAI error object */
            json_t *doc = parse(&r);
            json_t *err = json_object_get(doc, "error");
            assert_true(json_is_string(json_object_get(err, "message")));
            assert_true(json_is_string(json_object_get(err, "type")));
            assert_non_null(json_object_get(err, "param"));
            json_decref(doc);
        }
        counts[r.status]++;
        resp_free(&r);
    }
    printf("garbage: %d answered 200, %d 400, %d 404\n", counts[200], counts[400], counts[404]);
    resp r;
    http(main_srv.port, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
}

/* The last finished request in /stats (its JSON record; caller decrefs),
 * waiting up to 60 s for `count` requests to have finished. */
static json_t *last_record(int port, int64_t count)
{
    for (int i = 0; i < 6000; i++) {
        resp r;
        http(port, "GET", "/stats", NULL, NULL, &r);
        json_t *doc = parse(&r);
        resp_free(&r);
        json_t *srv = json_object_get(doc, "server");
        json_t *rec = json_object_get(srv, "recent");
        if ((int64_t)json_array_size(rec) >= count && json_integer_value(json_object_get(srv, "running")) == 0) {
            json_t *last = json_incref(json_array_get(rec, json_array_size(rec) - 1));
            assert_int_equal(json_integer_value(json_object_get(json_object_get(doc, "kv"), "projected_bytes")), 0);
            json_decref(doc);
            return last;
        }
        json_decref(doc);
        usleep(10000);
    }
    fail_msg("no finished request in /stats");
    return NULL;
}

/* Waits (up to 60 s) until /stats says a request is running in the engine. */
static void wait_running(int port)
{
    for (int i = 0; i < 6000; i++) {
        resp r;
        http(port, "GET", "/stats", NULL, NULL, &r);
        json_t *doc = parse(&r);
        resp_free(&r);
        json_int_t running = json_integer_value(json_object_get(json_object_get(doc, "server"), "running"));
        json_decref(doc);
        if (running >= 1)
            return;
        usleep(10000);
    }
    fail_msg("no request running in /stats after 60 s");
}

/* A client that goes away cancels its request: the engine stops it within a
 * step (far short of max_tokens), releases its admission, and records 499. */
static void test_disconnect_cancels(void **state)
{
    NEED_MODEL();
    make_slow_model();
    server sv;
    server_start_model(&sv, "cancel", slow_model, slow_tok, NULL);
    for (int stream = 1; stream >= 0; stream--) {
        int fd = connect_to(sv.port);
        send_request(fd, "POST", "/v1/completions", NULL,
                     stream ? "{\"prompt\": [1, 50], \"max_tokens\": 900, \"temperature\": 1, \"seed\": 5, \"stream\": true}"
                            : "{\"prompt\": [1, 51], \"max_tokens\": 900, \"temperature\": 1, \"seed\": 5}");
        char buf[256];
        if (stream)
            assert_true(recv(fd, buf, sizeof buf, 0) > 0); /* the stream began */
        else
            wait_running(sv.port); /* the request runs (a fixed sleep could end before it arrived) */
        close(fd);
        json_t *rec = last_record(sv.port, 2 - stream);
        int64_t made = json_integer_value(json_object_get(rec, "completion_tokens"));
        printf("%s client gone: status %lld after %lld of 900 tokens\n", stream ? "streaming" : "waiting",
               (long long)json_integer_value(json_object_get(rec, "status")), (long long)made);
        assert_int_equal(json_integer_value(json_object_get(rec, "status")), 499);
        assert_true(made < 900);
        json_decref(rec);
    }
    resp r;
    http(sv.port, "GET", "/metrics", NULL, NULL, &r);
    assert_non_null(strstr(r.body, "kvtier_cancelled_total 2\n"));
    resp_free(&r);
    assert_int_equal(server_stop(&sv), 0);
}

/* Slow or stalled clients are bounded: past --max-connections a new
 * connection waits unserved (libmicrohttpd stops accepting), and a stalled
 * connection is closed after --conn-timeout, which lets the waiting one in. */
static void test_slow_clients(void **state)
{
    NEED_MODEL();
    server sv;
    const char *extra[] = {"--conn-timeout", "2", "--max-connections", "3", NULL};
    int idle[3], extra_fd = -1;
    char buf[64];
    ssize_t k = 0;
    struct timespec t0, t1;
    double took = 0;
    /* the waiting connection must not be served while the three are open;
     * they are open for sure only within --conn-timeout of their connect: a
     * machine too slow to look within it tries again (3 tries) */
    for (int attempt = 0; attempt < 3; attempt++) {
        server_start(&sv, "slow", extra);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int i = 0; i < 3; i++)
            idle[i] = connect_to(sv.port);
        send_all(idle[0], "GET /heal", 9); /* a request that never completes */
        usleep(200000);
        extra_fd = connect_to(sv.port); /* one more than the limit */
        send_request(extra_fd, "GET", "/health", NULL, NULL);
        struct timeval tv = {.tv_usec = 700000};
        setsockopt(extra_fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        k = recv(extra_fd, buf, sizeof buf, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
        if (k < 0 || took < 2.0)
            break;
        printf("the check took %.1f s, past --conn-timeout: again\n", took);
        close(extra_fd);
        for (int i = 0; i < 3; i++)
            close(idle[i]);
        assert_int_equal(server_stop(&sv), 0);
    }
    assert_true(k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)); /* not served while 3 are open */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    k = recv(idle[0], buf, sizeof buf, 0); /* the server closes the stalled one */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double waited = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("stalled connection closed after %.1f s more (recv %zd)\n", waited, k);
    assert_true(k <= 0);
    assert_true(waited < 10);
    struct timeval tv = {.tv_sec = 20};
    setsockopt(extra_fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    resp r;
    read_response(extra_fd, &r); /* now it is let in */
    assert_int_equal(r.status, 200);
    resp_free(&r);
    for (int i = 0; i < 3; i++)
        close(idle[i]);
    assert_int_equal(server_stop(&sv), 0);
}

/* ---- published prompt caches --------------------------------------------------------------------- */

/* Publishes "System: SYS\n" (the server's rendering of a system message)
 * into dir with `kvtier cache publish`; returns its token count. */
static int64_t publish_system(const char *dir, const char *sys, const char *name)
{
    char path[400], cmd[3000];
    snprintf(path, sizeof path, "%s/%s.jsonl", tmpdir, name);
    char text[1024];
    snprintf(text, sizeof text, "System: %s\n", sys);
    json_t *line = json_pack("{s:s}", "text", text);
    char *js = json_dumps(line, JSON_COMPACT);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", js);
    fclose(f);
    free(js);
    json_decref(line);
    snprintf(cmd, sizeof cmd, "%s cache publish --model %s --tokenizer %s --prompts %s --out %s >/dev/null 2>&1", bin,
             model, tokenizer, path, dir);
    assert_int_equal(system(cmd), 0);
    kvt_tokenizer *tok;
    assert_int_equal(kvt_tokenizer_load(tokenizer, 512, &tok), 0);
    int32_t ids[1024];
    int64_t n = 0;
    assert_int_equal(kvt_tokenizer_encode(tok, text, 1, 0, ids, 1024, &n), 0);
    kvt_tokenizer_free(tok);
    return n;
}

static char *system_body(const char *sys, const char *user)
{
    json_t *doc = json_pack("{s:[{s:s, s:s}, {s:s, s:s}], s:f, s:i}", "messages", "role", "system", "content", sys,
                            "role", "user", "content", user, "temperature", 0.0, "max_tokens", 32);
    char *b = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    return b;
}

/* One request; returns the reply text (caller frees) and the usage (caller decrefs). */
static char *system_turn(int port, const char *sys, const char *user, json_t **usage)
{
    char *body = system_body(sys, user);
    resp r;
    http(port, "POST", "/v1/chat/completions", NULL, body, &r);
    free(body);
    if (r.status != 200)
        fprintf(stderr, "system turn: %d %s\n", r.status, r.body);
    assert_int_equal(r.status, 200);
    json_t *doc = parse(&r);
    json_t *c = json_array_get(json_object_get(doc, "choices"), 0);
    char *text = strdup(json_string_value(json_object_get(json_object_get(c, "message"), "content")));
    *usage = json_incref(json_object_get(doc, "usage"));
    json_decref(doc);
    resp_free(&r);
    return text;
}

/* Waits (up to 60 s) until /stats says the server's published level mounted
 * the generation dir/CURRENT names (the poll thread re-reads it every second,
 * /stats shows the state of the server's last poll, about every second). */
static void wait_published(int port, const char *dir)
{
    char path[512], id[80] = "";
    snprintf(path, sizeof path, "%s/CURRENT", dir);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    assert_non_null(fgets(id, sizeof id, f));
    fclose(f);
    id[strcspn(id, "\r\n")] = '\0';
    const char *got = NULL;
    for (int i = 0; i < 1200; i++) {
        resp r;
        http(port, "GET", "/stats", NULL, NULL, &r);
        json_t *doc = parse(&r);
        resp_free(&r);
        json_t *pub = json_array_get(json_object_get(doc, "published_caches"), 0);
        got = json_string_value(json_object_get(pub, "generation"));
        int done = got && !strcmp(got, id);
        json_decref(doc);
        if (done)
            return;
        usleep(50000);
    }
    fail_msg("/stats did not show generation %s mounted within 60 s", id);
}

/* A published system prompt mounted with --prompt-cache-dir: the first
 * request of a fresh server reuses the whole published prefix (cached_tokens
 * equal to its length), with a reply identical to cache-off; a publication
 * made while the server runs is picked up without a restart. */
static void test_published_prompt(void **state)
{
    NEED_MODEL();
    const char *sys1 = "You are a kind storyteller who tells short tales about a little dog named Max.";
    const char *sys2 = "You are a poet. Every answer rhymes and talks about the sea and the moon.";
    char dir[400];
    snprintf(dir, sizeof dir, "%s/published", tmpdir);
    int64_t n1 = publish_system(dir, sys1, "sys1");
    const char *extra[] = {"--prompt-cache-dir", dir, NULL};
    server sv;
    server_start(&sv, "published", extra);
    json_t *u, *uoff;
    char *on = system_turn(sv.port, sys1, "Tell me a story.", &u);
    char *off = system_turn(off_srv.port, sys1, "Tell me a story.", &uoff);
    int64_t cached = usage_int(u, "prompt_tokens_details", "cached_tokens");
    printf("published system prompt of %lld tokens: first request of a fresh server reused %lld of %lld prompt "
           "tokens\n",
           (long long)n1, (long long)cached, (long long)usage_int(u, "prompt_tokens", NULL));
    assert_int_equal(cached, n1);
    /* reported under the tier that held it (it was reported as "ssd") */
    assert_int_equal(usage_int(json_object_get(u, "kvtier"), "reused_tokens", "published"), n1);
    assert_int_equal(usage_int(json_object_get(u, "kvtier"), "reused_tokens", "ssd"), 0);
    assert_int_equal(usage_int(json_object_get(u, "kvtier"), "reused_tokens", "ram"), 0);
    assert_int_equal(usage_int(uoff, "prompt_tokens_details", "cached_tokens"), 0);
    assert_string_equal(on, off);
    json_decref(u);
    json_decref(uoff);
    free(on);
    free(off);

    int64_t n2 = publish_system(dir, sys2, "sys2");
    wait_published(sv.port, dir); /* CURRENT is re-read every second: until the server mounted it */
    on = system_turn(sv.port, sys2, "Tell me about the night.", &u);
    off = system_turn(off_srv.port, sys2, "Tell me about the night.", &uoff);
    printf("after a new publication (%lld tokens) while running: %lld tokens reused\n", (long long)n2,
           (long long)usage_int(u, "prompt_tokens_details", "cached_tokens"));
    assert_int_equal(usage_int(u, "prompt_tokens_details", "cached_tokens"), n2);
    assert_string_equal(on, off);
    json_decref(u);
    json_decref(uoff);
    free(on);
    free(off);
    assert_int_equal(server_stop(&sv), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_health_models),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_api_key),
        cmocka_unit_test(test_queue_full),
        cmocka_unit_test(test_stream_format),
        cmocka_unit_test(test_multi_turn_cache),
        cmocka_unit_test(test_concurrent_clients),
        cmocka_unit_test(test_tokenize),
        cmocka_unit_test(test_metrics_promtool),
        cmocka_unit_test(test_shutdown_ssd),
        cmocka_unit_test(test_kill9_ssd),
        cmocka_unit_test(test_unwritable_ssd),
        cmocka_unit_test(test_disconnect_cancels),
        cmocka_unit_test(test_slow_clients),
        cmocka_unit_test(test_garbage),
        cmocka_unit_test(test_published_prompt),
    };
    if (getenv("KVT_TEST_ONLY")) /* a cmocka pattern: run only the tests it names */
        cmocka_set_test_filter(getenv("KVT_TEST_ONLY"));
    return cmocka_run_group_tests(tests, setup, teardown);
}
