/*
 * test_serve_models.c: a multi-model kvtier serve (kvt_server_opts.models)
 * in process over loopback: stories260K and a small synthetic hybrid model
 * (made here) served by one server under one pool. Requests for both
 * models, sent from two threads at once, get replies identical to two
 * separate single-model servers; a request without "model" gets the first
 * model, an unknown one 404 naming the served ids; /v1/models lists both;
 * /stats carries each model's report and the pool's (both services as
 * members, RAM and KV charged, high-water marks); /metrics carries the pool
 * lines (and passes promtool check metrics when promtool is installed).
 * A prefix a fresh server restores from Redis is reported as reused from
 * "remote" (usage, request records, /metrics), not from "ssd". `kvtier
 * serve --redis-cluster` on a cluster whose slots are not all held warns.
 * Skipped with a message when KVT_SHARED_DIR lacks stories260K.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "redis_util.h"
#include "server.h"
#include "serve_util.h"
#include "synth_util.h"
#include "tokenizer.h"

#define N_PROMPTS 6
#define MAX_TOKENS 12

static char stories[1024], stories_tok[1024], dir[256], synth[300], synth_tok[300];
static int have_model;

static const char *const prompts[N_PROMPTS] = {
    "Once upon a time", "Once upon a time there was", "The cat sat", "Lily liked the sun",
    "Once upon a time there was a little", "The dog ran to the park",
};

/* replies[model][prompt] of the single-model servers */
static char *expected[2][N_PROMPTS];

static kvt_server *start(const kvt_server_opts *o)
{
    kvt_server *s = NULL;
    assert_int_equal(kvt_server_start(o, &s), 0);
    if (kvt_server_load(s) != 0) {
        fprintf(stderr, "load: %s\n", kvt_last_error());
        fail();
    }
    return s;
}

/* POST /v1/completions (greedy); returns the reply text (malloc'd), or
 * NULL with *status the HTTP status when it is not 200. */
static char *complete(int port, const char *model, const char *prompt, int *status, char **body_out)
{
    char body[1024];
    if (model)
        snprintf(body, sizeof body,
                 "{\"model\": \"%s\", \"prompt\": \"%s\", \"max_tokens\": %d, \"temperature\": 0}", model, prompt,
                 MAX_TOKENS);
    else
        snprintf(body, sizeof body, "{\"prompt\": \"%s\", \"max_tokens\": %d, \"temperature\": 0}", prompt,
                 MAX_TOKENS);
    kvt_ts_resp r;
    *status = kvt_ts_http(port, "POST", "/v1/completions", NULL, body, 60, &r);
    char *text = NULL;
    if (*status == 200) {
        json_t *doc = json_loads(r.body, 0, NULL);
        json_t *t = json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "text");
        if (json_is_string(t))
            text = strdup(json_string_value(t));
        json_decref(doc);
    }
    if (body_out)
        *body_out = strdup(r.body ? r.body : "");
    kvt_ts_resp_free(&r);
    return text;
}

static json_t *get_json(int port, const char *path)
{
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", path, NULL, NULL, 30, &r), 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    kvt_ts_resp_free(&r);
    assert_non_null(doc);
    return doc;
}

static void single_model_replies(int which, const char *path, const char *tok, const char *name)
{
    kvt_server_opts o = {.model_path = path, .tok_path = tok, .model_name = name, .prompt_cache_bytes = 16u << 20};
    kvt_server *s = start(&o);
    for (int i = 0; i < N_PROMPTS; i++) {
        int st;
        expected[which][i] = complete(kvt_server_port(s), NULL, prompts[i], &st, NULL);
        assert_int_equal(st, 200);
        assert_non_null(expected[which][i]);
    }
    assert_int_equal(kvt_server_stop(s, 5000), 0);
    kvt_server_destroy(s);
}

typedef struct client {
    int port;
    const char *model;
    int which;
    int mismatches, failures;
} client;

static void *client_main(void *arg)
{
    client *c = arg;
    for (int round = 0; round < 2; round++) /* the second round reuses the prefixes */
        for (int i = 0; i < N_PROMPTS; i++) {
            int st;
            char *text = complete(c->port, c->model, prompts[i], &st, NULL);
            if (st != 200 || !text)
                c->failures++;
            else if (strcmp(text, expected[c->which][i])) {
                fprintf(stderr, "%s prompt %d: '%s' != '%s'\n", c->model, i, text, expected[c->which][i]);
                c->mismatches++;
            }
            free(text);
        }
    return NULL;
}

static json_t *member(json_t *pool, const char *name)
{
    size_t i;
    json_t *m;
    json_array_foreach(json_object_get(pool, "member_list"), i, m)
    {
        if (!strcmp(json_string_value(json_object_get(m, "name")), name))
            return m;
    }
    return NULL;
}

static uint64_t axis_field(json_t *axes, const char *axis, const char *field)
{
    return (uint64_t)json_integer_value(json_object_get(json_object_get(axes, axis), field));
}

static void test_two_models(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    single_model_replies(0, stories, stories_tok, NULL);
    single_model_replies(1, synth, synth_tok, "tiny");
    /* the synthetic model answers differently from stories260K: a mix-up would show */
    assert_string_not_equal(expected[0][0], expected[1][0]);

    kvt_server_model models[2] = {{.model_path = stories, .tok_path = stories_tok},
                                  {.model_path = synth, .tok_path = synth_tok, .model_name = "tiny"}};
    kvt_server_opts o = {.models = models, .n_models = 2, .prompt_cache_bytes = 16u << 20,
                         .pool_ram_bytes = 24u << 20, .pool_kv_bytes = 64u << 20};
    kvt_server *s = start(&o);
    int port = kvt_server_port(s);
    assert_int_equal(kvt_server_model_count(s), 2);
    assert_string_equal(kvt_server_model_id(s, 0), "stories260K");
    assert_string_equal(kvt_server_model_id(s, 1), "tiny");

    /* /v1/models lists both; each answers by id */
    json_t *doc = get_json(port, "/v1/models");
    json_t *data = json_object_get(doc, "data");
    assert_int_equal(json_array_size(data), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(data, 0), "id")), "stories260K");
    assert_string_equal(json_string_value(json_object_get(json_array_get(data, 1), "id")), "tiny");
    json_decref(doc);
    doc = get_json(port, "/v1/models/tiny");
    assert_string_equal(json_string_value(json_object_get(doc, "id")), "tiny");
    json_decref(doc);

    /* both models at once, from two threads: replies as from their own servers */
    client c[2] = {{.port = port, .model = "stories260K", .which = 0}, {.port = port, .model = "tiny", .which = 1}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&th[i], NULL, client_main, &c[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(c[i].failures, 0);
        assert_int_equal(c[i].mismatches, 0);
    }
    /* and interleaved one by one */
    for (int i = 0; i < N_PROMPTS; i++)
        for (int m = 0; m < 2; m++) {
            int st;
            char *text = complete(port, m ? "tiny" : "stories260K", prompts[i], &st, NULL);
            assert_int_equal(st, 200);
            assert_string_equal(text, expected[m][i]);
            free(text);
        }
    /* no "model": the first one; an unknown one: 404 naming what is served */
    int st;
    char *text = complete(port, NULL, prompts[2], &st, NULL);
    assert_int_equal(st, 200);
    assert_string_equal(text, expected[0][2]);
    free(text);
    char *body = NULL;
    assert_null(complete(port, "nope", prompts[0], &st, &body));
    assert_int_equal(st, 404);
    assert_non_null(strstr(body, "model_not_found"));
    assert_non_null(strstr(body, "'stories260K', 'tiny'"));
    free(body);
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", "/v1/models/nope", NULL, NULL, 30, &r), 404);
    kvt_ts_resp_free(&r);
    /* /tokenize and /detokenize pick the model too */
    assert_int_equal(kvt_ts_http(port, "POST", "/tokenize", NULL, "{\"model\": \"tiny\", \"prompt\": \"ab\"}", 30, &r),
                     200);
    assert_non_null(strstr(r.body, "\"max_model_len\":256"));
    kvt_ts_resp_free(&r);
    assert_int_equal(kvt_ts_http(port, "POST", "/detokenize", NULL, "{\"model\": \"x\", \"tokens\": [1]}", 30, &r), 404);
    kvt_ts_resp_free(&r);

    /* /stats: each model's report and the pool's */
    doc = get_json(port, "/stats");
    json_t *list = json_object_get(doc, "models");
    assert_int_equal(json_array_size(list), 2);
    for (int m = 0; m < 2; m++) {
        json_t *rep = json_object_get(json_array_get(list, (size_t)m), "report");
        uint64_t acquires = (uint64_t)json_integer_value(json_object_get(json_object_get(rep, "requests"), "acquires"));
        /* 2 rounds + the interleaved ones (+ the default-model one for the first) */
        assert_int_equal(acquires, (uint64_t)(3 * N_PROMPTS + (m == 0)));
        json_t *sp = json_object_get(rep, "pool");
        assert_string_equal(json_string_value(json_object_get(sp, "member")), m ? "service:tiny" : "service:stories260K");
    }
    /* per-layer residency of each model: its own layer count, RAM bytes adding up */
    for (int m = 0; m < 2; m++) {
        json_t *rep = json_object_get(json_array_get(list, (size_t)m), "report");
        json_t *layers = json_object_get(rep, "layers");
        assert_int_equal(json_array_size(layers), m ? 3 : 5);
        uint64_t sum = 0;
        size_t li;
        json_t *l;
        json_array_foreach(layers, li, l)
        {
            sum += (uint64_t)json_integer_value(json_object_get(l, "ram_bytes"));
        }
        assert_int_equal(sum, (uint64_t)json_integer_value(json_object_get(json_object_get(rep, "prefixes"), "bytes")));
    }
    json_t *pool = json_object_get(doc, "pool");
    assert_int_equal(json_integer_value(json_object_get(pool, "members")), 2);
    json_t *axes = json_object_get(pool, "axes");
    assert_int_equal(axis_field(axes, "ram", "limit"), 24u << 20);
    assert_int_equal(axis_field(axes, "kv", "limit"), 64u << 20);
    assert_int_equal(axis_field(axes, "kv", "used"), 0); /* nothing admitted now */
    assert_true(axis_field(axes, "kv", "high_water") > 0);
    assert_true(axis_field(axes, "ram", "used") > 0);
    assert_true(axis_field(axes, "ram", "high_water") >= axis_field(axes, "ram", "used"));
    uint64_t ram_sum = 0;
    for (int m = 0; m < 2; m++) {
        json_t *mm = member(pool, m ? "service:tiny" : "service:stories260K");
        assert_non_null(mm);
        uint64_t pub = axis_field(json_object_get(mm, "axes"), "ram", "published");
        /* each service is charged what its prompt cache holds */
        json_t *rep = json_object_get(json_array_get(list, (size_t)m), "report");
        uint64_t held = (uint64_t)json_integer_value(json_object_get(json_object_get(rep, "prefixes"), "bytes"));
        assert_true(held > 0);
        assert_int_equal(pub, held);
        ram_sum += pub;
    }
    assert_int_equal(axis_field(axes, "ram", "used"), ram_sum);
    json_decref(doc);

    /* /metrics carries the pool lines */
    assert_int_equal(kvt_ts_http(port, "GET", "/metrics", NULL, NULL, 30, &r), 200);
    assert_non_null(strstr(r.body, "kvtier_pool_members 2"));
    assert_non_null(strstr(r.body, "kvtier_pool_limit_bytes{axis=\"ram\"} 25165824"));
    assert_non_null(strstr(r.body, "kvtier_pool_member_published_bytes{member=\"service:tiny\",axis=\"ram\"}"));
    assert_non_null(strstr(r.body, "kvtier_pool_refusals_total{axis=\"kv\"}"));
    assert_non_null(strstr(r.body, "kvtier_layer_ram_bytes{model=\"stories260K\",layer=\"0\"}"));
    assert_non_null(strstr(r.body, "kvtier_layer_evictions_total{model=\"stories260K\",layer=\"4\"}"));
    assert_null(strstr(r.body, "stories260K\",layer=\"5\"}")); /* stories260K has 5 layers */
    if (system("command -v promtool >/dev/null 2>&1") == 0) {
        char path[300];
        snprintf(path, sizeof path, "%s/metrics.txt", dir);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(r.body, f);
        fclose(f);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
        assert_int_equal(system(cmd), 0);
        unlink(path);
    }
    kvt_ts_resp_free(&r);
    assert_int_equal(kvt_server_stop(s, 5000), 0);
    kvt_server_destroy(s);
}

/* The value of the series `series` (name and labels, exactly) in a
 * Prometheus text; -1 when it is not there. */
static double series_value(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, series, n) && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

/* How many times `needle` occurs in `text`. */
static int occurrences(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static uint64_t jint(json_t *o, const char *a, const char *b)
{
    return (uint64_t)json_integer_value(json_object_get(json_object_get(o, a), b));
}

/* Two models with an SSD tier: /metrics gives every model's service, tier,
 * SSD and per-layer series, told apart by model="id", each equal to that
 * model's report in /stats, with one HELP and TYPE per family; /stats
 * "models" has each model's whole report (SSD and tier levels included);
 * promtool accepts the text. */
static void test_metrics_every_model(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    char ssd[300];
    snprintf(ssd, sizeof ssd, "%s/ssd", dir);
    kvt_server_model models[2] = {{.model_path = stories, .tok_path = stories_tok},
                                  {.model_path = synth, .tok_path = synth_tok, .model_name = "tiny"}};
    kvt_server_opts o = {.models = models, .n_models = 2, .prompt_cache_bytes = 16u << 20, .ssd_dir = ssd};
    kvt_server *s = start(&o);
    int port = kvt_server_port(s);
    /* two prompts to the first model, three to the second: their counters differ */
    for (int i = 0; i < 5; i++) {
        int st;
        char *text = complete(port, i < 2 ? "stories260K" : "tiny", prompts[i], &st, NULL);
        assert_int_equal(st, 200);
        free(text);
    }
    kvt_server_poll_tiers(s); /* each model's tier levels' health, as the CLI polls it */
    /* the write-behind lands: nothing changes between /stats and /metrics then */
    json_t *doc = NULL;
    for (int tries = 0; tries < 1200; tries++) { /* 60 s */
        json_decref(doc);
        doc = get_json(port, "/stats");
        json_t *list = json_object_get(doc, "models");
        uint64_t pending = 0, written = 1;
        for (size_t m = 0; m < 2; m++) {
            json_t *rep = json_object_get(json_array_get(list, m), "report");
            pending += jint(rep, "ssd", "pending");
            written = written && jint(rep, "ssd", "written") > 0;
        }
        if (!pending && written)
            break;
        usleep(50 * 1000);
    }
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", "/metrics", NULL, NULL, 30, &r), 200);
    const char *ids[2] = {"stories260K", "tiny"};
    const int n_layers[2] = {5, 3};
    json_t *list = json_object_get(doc, "models");
    assert_int_equal(json_array_size(list), 2);
    for (int m = 0; m < 2; m++) {
        json_t *rep = json_object_get(json_array_get(list, (size_t)m), "report");
        /* each model's /stats report is whole: its SSD tier and its tier levels */
        assert_true(json_is_object(json_object_get(rep, "ssd")));
        assert_true(json_is_object(json_object_get(rep, "ssd_cache")));
        assert_int_equal(json_array_size(json_object_get(rep, "tiers")), 1);
        assert_int_equal(json_array_size(json_object_get(rep, "layers")), (size_t)n_layers[m]);
        char ser[200];
        snprintf(ser, sizeof ser, "kvtier_tier_bytes{model=\"%s\",tier=\"ram\"}", ids[m]);
        assert_int_equal((uint64_t)series_value(r.body, ser), jint(rep, "prefixes", "bytes"));
        assert_true(jint(rep, "prefixes", "bytes") > 0);
        snprintf(ser, sizeof ser, "kvtier_tier_entries{model=\"%s\",tier=\"ssd\"}", ids[m]);
        assert_int_equal((uint64_t)series_value(r.body, ser), jint(rep, "ssd", "entries"));
        snprintf(ser, sizeof ser, "kvtier_ssd_written_entries_total{model=\"%s\"}", ids[m]);
        assert_int_equal((uint64_t)series_value(r.body, ser), jint(rep, "ssd", "written"));
        snprintf(ser, sizeof ser, "kvtier_prompt_cache_misses_total{model=\"%s\"}", ids[m]);
        assert_int_equal((uint64_t)series_value(r.body, ser), jint(rep, "prefixes", "misses"));
        snprintf(ser, sizeof ser, "kvtier_tier_level_stores_total{model=\"%s\",level=\"0\",tier=\"ssd\"}", ids[m]);
        json_t *lvl = json_array_get(json_object_get(rep, "tiers"), 0);
        assert_int_equal((uint64_t)series_value(r.body, ser),
                         (uint64_t)json_integer_value(json_object_get(lvl, "stores")));
        /* each layer's series equal the model's own "layers" */
        size_t li;
        json_t *l;
        json_array_foreach(json_object_get(rep, "layers"), li, l)
        {
            snprintf(ser, sizeof ser, "kvtier_layer_ram_bytes{model=\"%s\",layer=\"%s\"}", ids[m],
                     json_string_value(json_object_get(l, "layer")));
            assert_int_equal((uint64_t)series_value(r.body, ser),
                             (uint64_t)json_integer_value(json_object_get(l, "ram_bytes")));
            snprintf(ser, sizeof ser, "kvtier_layer_written_total{model=\"%s\",layer=\"%s\"}", ids[m],
                     json_string_value(json_object_get(l, "layer")));
            assert_int_equal((uint64_t)series_value(r.body, ser),
                             (uint64_t)json_integer_value(json_object_get(l, "written")));
        }
        snprintf(ser, sizeof ser, "kvtier_layer_ram_bytes{model=\"%s\",layer=\"%d\"}", ids[m], n_layers[m]);
        assert_null(strstr(r.body, ser)); /* no layer past the model's own */
    }
    /* the two models' figures differ (2 and 3 requests): a mix-up would show */
    assert_int_equal(series_value(r.body, "kvtier_prompt_cache_misses_total{model=\"stories260K\"}") +
                         series_value(r.body, "kvtier_prompt_cache_hits_total{model=\"stories260K\"}"),
                     2);
    assert_int_equal(series_value(r.body, "kvtier_prompt_cache_misses_total{model=\"tiny\"}") +
                         series_value(r.body, "kvtier_prompt_cache_hits_total{model=\"tiny\"}"),
                     3);
    /* one HELP and one TYPE per family, whatever the number of models */
    const char *fams[] = {"tier_bytes", "prompt_cache_hits_total", "ssd_written_entries_total",
                          "tier_level_stores_total", "layer_ram_bytes", "kv_budget_bytes"};
    for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++) {
        char h[120];
        snprintf(h, sizeof h, "# TYPE kvtier_%s ", fams[i]);
        assert_int_equal(occurrences(r.body, h), 1);
        snprintf(h, sizeof h, "# HELP kvtier_%s ", fams[i]);
        assert_int_equal(occurrences(r.body, h), 1);
    }
    if (system("command -v promtool >/dev/null 2>&1") == 0) {
        char path[300];
        snprintf(path, sizeof path, "%s/metrics2.txt", dir);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(r.body, f);
        fclose(f);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
        assert_int_equal(system(cmd), 0);
        unlink(path);
    }
    kvt_ts_resp_free(&r);
    json_decref(doc);
    assert_int_equal(kvt_server_stop(s, 5000), 0);
    kvt_server_destroy(s);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ssd);
    assert_int_equal(system(cmd), 0);
}

/* pool_remote_bytes (--pool-remote) with two models on one Redis: the
 * pool's remote axis carries the limit, both remote tiers are members,
 * what was in flight never passed the limit and nothing stays charged; a
 * limit below one entry's bytes refuses every write-behind (counted as
 * remote drops and remote-axis refusals), and the replies stay the same. */
static void test_pool_remote(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    if (!redis_available("test_serve_models (pool remote)"))
        skip();
    redis_srv rs;
    assert_int_equal(redis_start(&rs, 64, NULL), 0);
    const uint64_t limits[2] = {64u << 20, 1024};
    for (int k = 0; k < 2; k++) {
        kvt_server_model models[2] = {{.model_path = stories, .tok_path = stories_tok},
                                      {.model_path = synth, .tok_path = synth_tok, .model_name = "tiny"}};
        kvt_server_opts o = {.models = models, .n_models = 2, .prompt_cache_bytes = 16u << 20,
                             .redis_url = rs.url, .pool_remote_bytes = limits[k]};
        kvt_server *s = start(&o);
        int port = kvt_server_port(s);
        for (int i = 0; i < 4; i++) {
            int st;
            char *text = complete(port, i % 2 ? "tiny" : "stories260K", prompts[i], &st, NULL);
            assert_int_equal(st, 200);
            if (expected[i % 2][i])
                assert_string_equal(text, expected[i % 2][i]);
            free(text);
        }
        /* the write-behind ends (written or dropped): nothing in flight, and the tiers' own
         * counters asserted below caught up (kvt__remote_spill: the pool's axis counts a
         * refusal before the tier counts the drop, so one snapshot can hold the one and not
         * yet the other) */
        json_t *doc = NULL, *axes = NULL;
        for (int tries = 0; tries < 1200; tries++) { /* 60 s */
            json_decref(doc);
            doc = get_json(port, "/stats");
            axes = json_object_get(json_object_get(doc, "pool"), "axes");
            uint64_t w = 0, d = 0;
            for (size_t m = 0; m < 2; m++) {
                json_t *rep = json_object_get(json_array_get(json_object_get(doc, "models"), m), "report");
                w += jint(rep, "remote", "writes");
                d += jint(rep, "remote", "dropped");
            }
            /* k == 1 never charges the axis (nothing fits): its high water stays 0 */
            if (axis_field(axes, "remote", "used") == 0 &&
                (k == 0 ? axis_field(axes, "remote", "high_water") > 0 && w > 0
                        : axis_field(axes, "remote", "refusals") >= 2 && d >= 2))
                break;
            usleep(50 * 1000);
        }
        json_t *pool = json_object_get(doc, "pool");
        assert_int_equal(axis_field(axes, "remote", "limit"), limits[k]);
        assert_int_equal(axis_field(axes, "remote", "used"), 0);
        assert_true(axis_field(axes, "remote", "high_water") <= limits[k]);
        assert_non_null(member(pool, "remote:stories260K"));
        assert_non_null(member(pool, "remote:tiny"));
        json_t *list = json_object_get(doc, "models");
        uint64_t writes = 0, dropped = 0;
        for (size_t m = 0; m < 2; m++) {
            json_t *rep = json_object_get(json_array_get(list, m), "report");
            writes += jint(rep, "remote", "writes");
            dropped += jint(rep, "remote", "dropped");
        }
        print_message("pool remote limit %llu: high water %llu, refusals %llu, writes %llu, dropped %llu\n",
                      (unsigned long long)limits[k], (unsigned long long)axis_field(axes, "remote", "high_water"),
                      (unsigned long long)axis_field(axes, "remote", "refusals"), (unsigned long long)writes,
                      (unsigned long long)dropped);
        if (k == 0) {
            assert_true(axis_field(axes, "remote", "high_water") > 0);
            assert_true(writes > 0);
            assert_int_equal(axis_field(axes, "remote", "refusals"), 0);
        } else { /* every entry is over 1,024 bytes: none fits */
            assert_int_equal(writes, 0);
            assert_true(dropped >= 2);
            assert_true(axis_field(axes, "remote", "refusals") >= 2);
        }
        json_decref(doc);
        kvt_ts_resp r;
        assert_int_equal(kvt_ts_http(port, "GET", "/metrics", NULL, NULL, 30, &r), 200);
        char want[96];
        snprintf(want, sizeof want, "kvtier_pool_limit_bytes{axis=\"remote\"} %llu\n", (unsigned long long)limits[k]);
        assert_non_null(strstr(r.body, want));
        kvt_ts_resp_free(&r);
        assert_int_equal(kvt_server_stop(s, 5000), 0);
        kvt_server_destroy(s);
        assert_int_equal(redis_cmd(rs.port, NULL, 0, NULL, "FLUSHALL"), 0);
    }
    redis_stop(&rs);
}

#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1 /* CMake: 10 under TSan, 3 under ASan, else 1 */
#endif

/* The number at the start of the /metrics line that begins with `series`, -1 when absent. */
static long long metric_value(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, series, n) && p[n] == ' ')
            return atoll(p + n + 1);
    return -1;
}

/* POST /v1/completions of a prompt of any length (greedy, MAX_TOKENS);
 * returns the response body (malloc'd) and *status. */
static char *complete_long(int port, const char *prompt, int *status)
{
    json_t *req = json_pack("{s:s, s:i, s:f}", "prompt", prompt, "max_tokens", MAX_TOKENS, "temperature", 0.0);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    kvt_ts_resp r;
    *status = kvt_ts_http(port, "POST", "/v1/completions", NULL, body, 60 * KVT_TEST_TIME_SCALE, &r);
    free(body);
    char *out = strdup(r.body ? r.body : "");
    kvt_ts_resp_free(&r);
    return out;
}

/* A prefix reused from a tier below RAM is reported under that tier's name:
 * host A (RAM and Redis, no SSD tier) serves a prompt longer than one
 * 256-token block and stops (its write-behind reached Redis first); host B,
 * fresh, serves the prompt extended: its usage, its request record (/events
 * and the dashboard's table read it) and /metrics count the reused tokens
 * as "remote", none as "ssd" or "ram" (they were all reported as "ssd"). */
static void test_reused_by_tier(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    if (!redis_available("test_serve_models (reused by tier)"))
        skip();
    redis_srv rs;
    assert_int_equal(redis_start(&rs, 64, NULL), 0);
    static const char sent[] = "Once upon a time, there was a little girl named Lily. She loved to play outside. ";
    char prompt[2048] = "", longer[2200];
    for (int i = 0; i < 12; i++)
        strcat(prompt, sent);
    snprintf(longer, sizeof longer, "%sOne day she saw a big red ball.", prompt);
    kvt_server_opts o = {.model_path = stories, .tok_path = stories_tok, .prompt_cache_bytes = 16u << 20,
                         .redis_url = rs.url, .redis_timeout_ms = 1000 * KVT_TEST_TIME_SCALE,
                         .redis_restore_timeout_ms = 10000 * KVT_TEST_TIME_SCALE};
    kvt_server *a = start(&o);
    int st;
    char *body = complete_long(kvt_server_port(a), prompt, &st);
    if (st != 200)
        fprintf(stderr, "host A: %d %s\n", st, body);
    assert_int_equal(st, 200);
    json_t *doc = json_loads(body, 0, NULL);
    free(body);
    long long n_prompt = (long long)json_integer_value(json_object_get(json_object_get(doc, "usage"), "prompt_tokens"));
    json_decref(doc);
    assert_true(n_prompt > 256); /* a whole block reaches Redis */
    long long written = 0, queued = -1;
    for (int tries = 0; tries < 1200 * KVT_TEST_TIME_SCALE && !(written > 0 && queued == 0); tries++) { /* 60 s */
        if (tries)
            usleep(50 * 1000);
        doc = get_json(kvt_server_port(a), "/stats");
        written = (long long)jint(doc, "remote", "write_records");
        queued = (long long)jint(doc, "remote", "queued_entries");
        json_decref(doc);
    }
    assert_true(written > 0);
    assert_int_equal(queued, 0);
    assert_int_equal(kvt_server_stop(a, 5000), 0);
    kvt_server_destroy(a);

    kvt_server *b = start(&o);
    int port = kvt_server_port(b);
    body = complete_long(port, longer, &st);
    if (st != 200)
        fprintf(stderr, "host B: %d %s\n", st, body);
    assert_int_equal(st, 200);
    doc = json_loads(body, 0, NULL);
    free(body);
    json_t *u = json_object_get(doc, "usage");
    json_t *by = json_object_get(json_object_get(u, "kvtier"), "reused_tokens");
    long long cached = (long long)jint(u, "prompt_tokens_details", "cached_tokens");
    print_message("host B reused %lld tokens: ram %lld, ssd %lld, remote %lld, published %lld\n", cached,
                  (long long)json_integer_value(json_object_get(by, "ram")),
                  (long long)json_integer_value(json_object_get(by, "ssd")),
                  (long long)json_integer_value(json_object_get(by, "remote")),
                  (long long)json_integer_value(json_object_get(by, "published")));
    assert_true(cached >= 256);
    assert_true(json_is_integer(json_object_get(by, "remote")));
    assert_int_equal(json_integer_value(json_object_get(by, "remote")), cached);
    assert_int_equal(json_integer_value(json_object_get(by, "ssd")), 0);
    assert_int_equal(json_integer_value(json_object_get(by, "ram")), 0);
    assert_int_equal(json_integer_value(json_object_get(by, "published")), 0);
    json_decref(doc);
    /* the request's record, as /stats lists the recent ones */
    doc = get_json(port, "/stats");
    json_t *recent = json_object_get(json_object_get(doc, "server"), "recent");
    json_t *rec = json_array_get(recent, json_array_size(recent) - 1);
    assert_non_null(rec);
    assert_int_equal(jint(rec, "reused_tokens", "remote"), (uint64_t)cached);
    assert_int_equal(jint(rec, "reused_tokens", "ssd"), 0);
    json_decref(doc);
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", "/metrics", NULL, NULL, 30, &r), 200);
    assert_int_equal(metric_value(r.body, "kvtier_cached_tokens_total{tier=\"remote\"}"), cached);
    assert_int_equal(metric_value(r.body, "kvtier_cached_tokens_total{tier=\"ssd\"}"), 0);
    assert_int_equal(metric_value(r.body, "kvtier_cached_tokens_total{tier=\"ram\"}"), 0);
    assert_int_equal(metric_value(r.body, "kvtier_cached_tokens_total{tier=\"published\"}"), 0);
    kvt_ts_resp_free(&r);
    assert_int_equal(kvt_server_stop(b, 5000), 0);
    kvt_server_destroy(b);
    redis_stop(&rs);
}

/* `kvtier serve --redis URL --redis-cluster` on a 3-node Redis Cluster whose
 * slots 0-99 no node holds (CLUSTER DELSLOTSRANGE on every node): the server
 * warns, naming the cluster and the 100 uncovered slots, and /stats gives
 * the covered count. */
static void test_cluster_uncovered_slots(void **state)
{
    (void)state;
    const char *bin = getenv("KVT_BIN");
    if (!have_model || !bin)
        skip();
    if (!redis_available("test_serve_models (cluster slots)"))
        skip();
    redis_srv nodes[3];
    assert_int_equal(redis_cluster_start(nodes, 3), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(redis_cmd(nodes[i].port, NULL, 0, NULL, "CLUSTER DELSLOTSRANGE 0 99"), 0);
    char log[400];
    snprintf(log, sizeof log, "%s/cluster-serve.log", dir);
    const char *args[] = {"--model", stories, "--tokenizer", stories_tok, "--redis", nodes[0].url,
                          "--redis-cluster", NULL};
    kvt_ts_server sv;
    assert_int_equal(kvt_ts_server_start(&sv, bin, log, args), 0);
    char want[200], text[16384] = "";
    snprintf(want, sizeof want, "warning: Redis Cluster 127.0.0.1:%d (model stories260K) assigns only 16284 of the "
             "16384 hash slots to a node: 100 slots are not covered", nodes[0].port);
    for (int tries = 0; tries < 200 * KVT_TEST_TIME_SCALE && !strstr(text, want); tries++) { /* 10 s */
        if (tries)
            usleep(50 * 1000);
        kvt_ts_read_file(log, text, sizeof text);
    }
    if (!strstr(text, want))
        fprintf(stderr, "the server's log lacks '%s':\n%s\n", want, text);
    assert_non_null(strstr(text, want));
    json_t *doc = get_json(sv.port, "/stats");
    assert_int_equal(jint(doc, "remote", "slots_covered"), 16284);
    json_decref(doc);
    assert_int_equal(kvt_ts_server_stop(&sv), 0);
    unlink(log);
    redis_cluster_stop(nodes, 3);
}

/* two models with one id, and bad model lists, are refused */
static void test_bad_model_lists(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    kvt_server_model models[2] = {{.model_path = stories, .tok_path = stories_tok},
                                  {.model_path = stories, .tok_path = stories_tok}};
    kvt_server_opts o = {.models = models, .n_models = 2, .prompt_cache_bytes = 1u << 20};
    kvt_server *s = NULL;
    assert_int_equal(kvt_server_start(&o, &s), 0);
    assert_int_equal(kvt_server_load(s), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "both have the id 'stories260K'"));
    kvt_server_destroy(s);
    o.n_models = KVT_SERVER_MAX_MODELS + 1;
    assert_int_equal(kvt_server_start(&o, &s), KVT_EINVAL);
    o.n_models = 2;
    o.model_path = stories;
    o.tok_path = stories_tok;
    assert_int_equal(kvt_server_start(&o, &s), KVT_EINVAL);
    o.model_path = o.tok_path = NULL;
    models[1].tok_path = NULL;
    assert_int_equal(kvt_server_start(&o, &s), KVT_EINVAL);
}

static int setup(void **state)
{
    (void)state;
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(stories, sizeof stories, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(stories_tok, sizeof stories_tok, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    have_model = access(stories, R_OK) == 0 && access(stories_tok, R_OK) == 0;
    if (!have_model) {
        printf("test_serve_models: skipped: needs %s with tok512.bin (set KVT_SHARED_DIR)\n", stories);
        return 0;
    }
    snprintf(dir, sizeof dir, "/tmp/kvt_test_serve_models_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(synth, sizeof synth, "%s/synth.bin", dir);
    snprintf(synth_tok, sizeof synth_tok, "%s/synth_tok.bin", dir);
    if (kvt_tokenizer_write_default(synth_tok, 259))
        return -1;
    su_synth(SU_HYBRID, synth, 259, 256, 31, 32);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int m = 0; m < 2; m++)
        for (int i = 0; i < N_PROMPTS; i++)
            free(expected[m][i]);
    if (have_model) {
        unlink(synth);
        unlink(synth_tok);
        rmdir(dir);
    }
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_models),
        cmocka_unit_test(test_metrics_every_model),
        cmocka_unit_test(test_pool_remote),
        cmocka_unit_test(test_reused_by_tier),
        cmocka_unit_test(test_cluster_uncovered_slots),
        cmocka_unit_test(test_bad_model_lists),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
