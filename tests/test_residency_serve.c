/*
 * test_residency_serve.c: `kvtier serve --live-cache-blocks N` end to end
 * over HTTP on stories260K (skipped with a message when KVT_SHARED_DIR lacks
 * it). A bounded server (every full kv block paged: one block over five
 * layers, --live-cache-strict) and an unbounded one, both --threads 1: a multi-turn chat whose
 * context passes a whole 256-token block gets byte-identical replies; eight
 * concurrent completions (decoded batched) get the replies each gets alone
 * from the unbounded server; /stats kv.live_* and /metrics kvtier_live_*
 * show the paging (promtool accepts /metrics); and under one --kv-budget
 * between the bounded and the whole projection a long request is refused
 * (400 kv_budget_exceeded) unbounded and served bounded, with the same reply.
 * Every server this test starts is killed when the test ends in any way: a
 * failed assertion (the group teardown), a failed setup or exit (atexit), or
 * SIGTERM/SIGINT/SIGHUP (a handler), so none outlives the test.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chat.h"
#include "model.h"
#include "serve_util.h"

static char model[1024], tokenizer[1024], tmpdir[256];
static const char *bin;
static int have_model;
static kvt_ts_server unb, bnd; /* fully resident; --live-cache-blocks 1 */
static kvt_ts_server ku, kb;   /* test_admission_bounded's budget servers */
static kvt_ts_server *const servers[] = {&unb, &bnd, &ku, &kb};
enum { N_SERVERS = sizeof servers / sizeof servers[0] };

/* SIGKILLs and reaps every server still running (a no-op for stopped ones). */
static void kill_servers(void)
{
    for (int i = 0; i < N_SERVERS; i++)
        kvt_ts_server_kill(servers[i]);
}

/* A signal that ends the test: SIGKILL the servers (kill() is async-signal
 * safe), then die of the signal as before. */
static void on_fatal_signal(int sig)
{
    for (int i = 0; i < N_SERVERS; i++)
        if (servers[i]->pid > 0)
            kill(servers[i]->pid, SIGKILL);
    signal(sig, SIG_DFL);
    raise(sig);
}

static void start(kvt_ts_server *sv, const char *name, const char *const *extra)
{
    char log[400];
    snprintf(log, sizeof log, "%s/%s.log", tmpdir, name);
    const char *args[32] = {"--model", model, "--tokenizer", tokenizer, "--threads", "1"};
    int n = 6;
    for (int i = 0; extra && extra[i]; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(kvt_ts_server_start(sv, bin, log, args), 0);
}

static int setup(void **state)
{
    (void)state;
    bin = getenv("KVT_BIN");
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tokenizer, sizeof tokenizer, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    have_model = bin && access(model, R_OK) == 0 && access(tokenizer, R_OK) == 0;
    if (!have_model) {
        printf("test_residency_serve: skipped: needs KVT_BIN and %s with tok512.bin (set KVT_SHARED_DIR)\n", model);
        return 0;
    }
    atexit(kill_servers); /* a failed setup skips the group teardown */
    signal(SIGTERM, on_fatal_signal);
    signal(SIGINT, on_fatal_signal);
    signal(SIGHUP, on_fatal_signal);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvt_live_serve_XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
    start(&unb, "unbounded", NULL);
    /* strict: a block past the bound is released once written, before the request goes on, so the
     * decode pages it in however fast the engine is against the disk (with the default slack of 4
     * writes in flight per layer, a fast engine can finish a 48-token decode before any write of
     * its one full block per layer completes, and read nothing back) */
    const char *b[] = {"--live-cache-blocks", "1", "--live-cache-dir", tmpdir, "--live-cache-strict", NULL};
    start(&bnd, "bounded", b);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (!have_model)
        return 0;
    int su = kvt_ts_server_stop(&unb), sb = kvt_ts_server_stop(&bnd);
    kill_servers(); /* and any a failed test left running (its budget servers) */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", tmpdir);
    assert_int_equal(su, 0);
    assert_int_equal(sb, 0);
    return 0;
}

#define NEED_MODEL()          \
    do {                      \
        if (!have_model) {    \
            skip();           \
            return;           \
        }                     \
    } while (0)

/* How many times slower this build runs a test (CMake: 10 under TSan, 3
 * under ASan, else 1): the receive timeouts below are multiplied by it
 * (under TSan at load 25 the concurrent case's 8 completions ran past 300 s). */
#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif

static json_t *post(int port, const char *path, json_t *body, int *status)
{
    char *text = json_dumps(body, JSON_COMPACT);
    kvt_ts_resp r;
    *status = kvt_ts_http(port, "POST", path, NULL, text, 300 * KVT_TEST_TIME_SCALE, &r);
    free(text);
    json_t *doc = json_loads(r.body ? r.body : "", 0, NULL);
    if (!doc || *status != 200)
        fprintf(stderr, "POST %s: %d %s\n", path, *status, r.body ? r.body : "");
    kvt_ts_resp_free(&r);
    return doc;
}

static json_t *get_json(int port, const char *path)
{
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", path, NULL, NULL, 60 * KVT_TEST_TIME_SCALE, &r), 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    assert_non_null(doc);
    kvt_ts_resp_free(&r);
    return doc;
}

static int64_t kv_counter(int port, const char *key)
{
    json_t *doc = get_json(port, "/stats");
    json_t *v = json_object_get(json_object_get(doc, "kv"), key);
    if (!json_is_integer(v))
        fprintf(stderr, "/stats has no kv.%s\n", key);
    assert_true(json_is_integer(v));
    int64_t n = json_integer_value(v);
    json_decref(doc);
    return n;
}

/* A long story opening: about 130 tokens a round, so a request's context passes a whole 256-token block. */
static char *long_text(int variant, int rounds)
{
    static const char *const s[] = {
        "Once upon a time there was a little girl named Lily. She loved to play outside in the park. ",
        "One day she saw a big red ball under a tall green tree, and she ran to get it. ",
        "Her friend Tom came too. They played with the ball all day and laughed a lot. ",
        "When the sun went down, their mom called them home for dinner and a warm bath. ",
    };
    char *out = calloc(1, 4096);
    snprintf(out, 4096, "Story %d. ", variant);
    for (int k = 0; k < rounds; k++)
        for (int i = 0; i < 4; i++)
            strcat(out, s[(i + variant) % 4]);
    return out;
}

/* ---- a multi-turn chat ---------------------------------------------------------------------- */

static const char *const users[] = {"Tell me what happened next.", "What did Lily say?", "How did it end?"};

static char *chat(int port, const char *opening, char *const *replies, int turns, int64_t *prompt_tokens)
{
    json_t *msgs = json_array();
    json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", opening));
    for (int t = 0; t < turns; t++) {
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", users[t]));
        if (t < turns - 1)
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", replies[t]));
    }
    json_t *body = json_pack("{s:o, s:f, s:i}", "messages", msgs, "temperature", 0.0, "max_tokens", 40);
    int status;
    json_t *doc = post(port, "/v1/chat/completions", body, &status);
    json_decref(body);
    assert_int_equal(status, 200);
    json_t *c = json_array_get(json_object_get(doc, "choices"), 0);
    char *text = strdup(json_string_value(json_object_get(json_object_get(c, "message"), "content")));
    *prompt_tokens = json_integer_value(json_object_get(json_object_get(doc, "usage"), "prompt_tokens"));
    json_decref(doc);
    return text;
}

static void test_multi_turn_identical(void **state)
{
    (void)state;
    NEED_MODEL();
    char *opening = long_text(0, 2);
    char *a[3] = {0}, *b[3] = {0};
    int64_t out0 = kv_counter(bnd.port, "live_paged_out_blocks");
    for (int t = 0; t < 3; t++) {
        int64_t pa, pb;
        a[t] = chat(unb.port, opening, a, t + 1, &pa);
        b[t] = chat(bnd.port, opening, b, t + 1, &pb);
        printf("turn %d: prompt %lld tokens, reply '%s'\n", t + 1, (long long)pa, a[t]);
        assert_int_equal(pa, pb);
        assert_true(pa > 256); /* a whole block: something to page */
        assert_string_equal(a[t], b[t]);
    }
    /* the first turn wrote its full block of each layer (the bound is one block over five layers:
     * a share of 0 each); later turns reuse that prefix from the prompt cache, whose blocks are
     * shared and stay resident (charged to the prompt cache) */
    int64_t out = kv_counter(bnd.port, "live_paged_out_blocks") - out0;
    printf("bounded: paged out %lld blocks over the 3 turns\n", (long long)out);
    assert_true(out >= 5);
    for (int t = 0; t < 3; t++) {
        free(a[t]);
        free(b[t]);
    }
    free(opening);
}

/* ---- concurrent completions ------------------------------------------------------------------ */

enum { CLIENTS = 8 };

typedef struct {
    int port, variant, status;
    char *text;
} job;

static void *complete(void *arg)
{
    job *j = arg;
    char *prompt = long_text(j->variant, 3);
    json_t *body = json_pack("{s:s, s:f, s:i}", "prompt", prompt, "temperature", 0.0, "max_tokens", 48);
    json_t *doc = post(j->port, "/v1/completions", body, &j->status);
    json_decref(body);
    free(prompt);
    const char *t = json_string_value(json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "text"));
    j->text = strdup(t ? t : "");
    json_decref(doc);
    return NULL;
}

static void decode_counters(int port, int64_t *steps, int64_t *seqs)
{
    json_t *doc = get_json(port, "/stats");
    json_t *c = json_object_get(json_object_get(doc, "server"), "counters");
    *steps = json_integer_value(json_object_get(c, "decode_steps"));
    *seqs = json_integer_value(json_object_get(c, "decode_batch_sequences"));
    json_decref(doc);
}

static void test_concurrent_identical(void **state)
{
    (void)state;
    NEED_MODEL();
    job on[CLIENTS], ref[CLIENTS];
    pthread_t th[CLIENTS];
    int64_t steps0, seqs0, steps1, seqs1, in0 = kv_counter(bnd.port, "live_paged_in_blocks");
    decode_counters(bnd.port, &steps0, &seqs0);
    for (int i = 0; i < CLIENTS; i++) {
        on[i] = (job){.port = bnd.port, .variant = 10 + i};
        assert_int_equal(pthread_create(&th[i], NULL, complete, &on[i]), 0);
    }
    for (int i = 0; i < CLIENTS; i++)
        pthread_join(th[i], NULL);
    decode_counters(bnd.port, &steps1, &seqs1);
    double mean = (double)(seqs1 - seqs0) / (double)(steps1 - steps0 > 0 ? steps1 - steps0 : 1);
    printf("bounded: %lld decode steps, mean batch %.1f sequences\n", (long long)(steps1 - steps0), mean);
    assert_true(mean > 1.5); /* decoded batched */
    assert_true(kv_counter(bnd.port, "live_paged_in_blocks") > in0);
    int differ = 0;
    for (int i = 0; i < CLIENTS; i++) { /* the reference: each alone, fully resident */
        ref[i] = (job){.port = unb.port, .variant = 10 + i};
        complete(&ref[i]);
        assert_int_equal(on[i].status, 200);
        assert_int_equal(ref[i].status, 200);
        if (strcmp(on[i].text, ref[i].text)) {
            fprintf(stderr, "client %d: bounded '%s' vs alone '%s'\n", i, on[i].text, ref[i].text);
            differ++;
        }
        free(on[i].text);
        free(ref[i].text);
    }
    assert_int_equal(differ, 0);
}

/* ---- counters ------------------------------------------------------------------------------- */

/* The value of the Prometheus sample `name{model="stories260K"}` (the
 * served model's series), -1 when absent. */
static double metric(const char *text, const char *name)
{
    char series[160];
    snprintf(series, sizeof series, "%s{model=\"stories260K\"}", name);
    size_t n = strlen(series);
    for (const char *p = text; (p = strstr(p, series)) != NULL; p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

static void test_counters_visible(void **state)
{
    (void)state;
    NEED_MODEL();
    int64_t out = kv_counter(bnd.port, "live_paged_out_blocks"), in = kv_counter(bnd.port, "live_paged_in_blocks");
    int64_t out_b = kv_counter(bnd.port, "live_paged_out_bytes");
    printf("bounded /stats: paged out %lld blocks (%lld B), in %lld blocks, stall %lld ms, failures %lld\n",
           (long long)out, (long long)out_b, (long long)in, (long long)kv_counter(bnd.port, "live_page_stall_ms"),
           (long long)kv_counter(bnd.port, "live_page_failures"));
    assert_true(out > 0);
    assert_true(in > 0);
    /* serve's default scheme is f16: a sealed 256-token block of one layer is
     * 256 tokens x 2 (K and V) x kv_dim 32 x 2 bytes = 256 x 128 bytes */
    assert_int_equal(out_b, out * 256 * 128);
    assert_int_equal(kv_counter(bnd.port, "live_page_failures"), 0);
    assert_int_equal(kv_counter(unb.port, "live_paged_out_blocks"), 0);
    assert_int_equal(kv_counter(unb.port, "live_paged_in_blocks"), 0);
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(bnd.port, "GET", "/metrics", NULL, NULL, 60 * KVT_TEST_TIME_SCALE, &r), 200);
    assert_true(metric(r.body, "kvtier_live_paged_out_blocks_total") == (double)out);
    assert_true(metric(r.body, "kvtier_live_paged_in_blocks_total") >= (double)in);
    assert_true(metric(r.body, "kvtier_live_paged_out_bytes_total") == (double)out_b);
    assert_true(metric(r.body, "kvtier_live_page_stall_seconds_total") >= 0);
    assert_true(metric(r.body, "kvtier_live_page_failures_total") == 0);
    char path[400];
    snprintf(path, sizeof path, "%s/metrics.txt", tmpdir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(r.body, f);
    fclose(f);
    kvt_ts_resp_free(&r);
    if (system("command -v promtool >/dev/null 2>&1") != 0) {
        printf("promtool is not installed (Debian package prometheus): lint skipped\n");
        return;
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
    assert_int_equal(system(cmd), 0);
}

/* ---- admission ------------------------------------------------------------------------------ */

static void test_admission_bounded(void **state)
{
    (void)state;
    NEED_MODEL();
    enum { MAX_TOKENS = 48 };
    /* the prompt's tokens, then both projections as the server's service makes them */
    char *prompt = long_text(3, 3);
    json_t *tb = json_pack("{s:s}", "prompt", prompt);
    int status;
    json_t *td = post(unb.port, "/tokenize", tb, &status);
    json_decref(tb);
    assert_int_equal(status, 200);
    int64_t n = (int64_t)json_array_size(json_object_get(td, "tokens"));
    json_decref(td);
    assert_true(n > 256);
    kvt_model *m;
    assert_int_equal(kvt_model_load(model, &m), 0);
    kvt_chat_service_opts so = {.prompt_cache_bytes = 1 << 20};
    kvt_service *svc;
    assert_int_equal(kvt_chat_service_create(m, &so, &svc), 0);
    uint64_t whole = kvt_service_project_bytes(svc, n + MAX_TOKENS);
    uint64_t bound = kvt_service_project_live_bytes(svc, n + MAX_TOKENS, 1, 0);
    kvt_service_destroy(svc);
    kvt_model_free(m);
    printf("%lld + %d tokens: whole context %llu B, bounded %llu B\n", (long long)n, MAX_TOKENS,
           (unsigned long long)whole, (unsigned long long)bound);
    assert_true(bound < whole);
    char budget[32];
    snprintf(budget, sizeof budget, "%llu", (unsigned long long)((bound + whole) / 2));
    const char *u[] = {"--kv-budget", budget, NULL};
    const char *b[] = {"--kv-budget", budget, "--live-cache-blocks", "1", "--live-cache-dir", tmpdir, NULL};
    start(&ku, "budget_unbounded", u);
    start(&kb, "budget_bounded", b);
    json_t *body = json_pack("{s:s, s:f, s:i}", "prompt", prompt, "temperature", 0.0, "max_tokens", MAX_TOKENS);
    json_t *refused = post(ku.port, "/v1/completions", body, &status);
    assert_int_equal(status, 400);
    assert_string_equal(json_string_value(json_object_get(json_object_get(refused, "error"), "code")),
                        "kv_budget_exceeded");
    json_decref(refused);
    json_t *served = post(kb.port, "/v1/completions", body, &status);
    assert_int_equal(status, 200);
    json_t *ref = post(unb.port, "/v1/completions", body, &status);
    assert_int_equal(status, 200);
    const char *got = json_string_value(json_object_get(json_array_get(json_object_get(served, "choices"), 0), "text"));
    const char *want = json_string_value(json_object_get(json_array_get(json_object_get(ref, "choices"), 0), "text"));
    assert_non_null(got);
    assert_non_null(want);
    assert_string_equal(got, want);
    assert_true(kv_counter(kb.port, "live_paged_out_blocks") > 0);
    json_decref(served);
    json_decref(ref);
    json_decref(body);
    free(prompt);
    assert_int_equal(kvt_ts_server_stop(&ku), 0);
    assert_int_equal(kvt_ts_server_stop(&kb), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_multi_turn_identical),
        cmocka_unit_test(test_concurrent_identical),
        cmocka_unit_test(test_counters_visible),
        cmocka_unit_test(test_admission_bounded),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
