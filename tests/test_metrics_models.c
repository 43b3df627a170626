/*
 * test_metrics_models.c: what /metrics and /stats say of each model when
 * one kvtier serve (in process, over loopback) serves two: stories260K and
 * a small synthetic model made here (named ti"ny\, a quote and a
 * backslash in its id, escaped in the label values), each with its own engine
 * thread. The engine thread's families (queue and running gauges, the
 * decode batch-size histogram, decode steps, engine steps, prefill passes
 * and tokens, phase and step seconds, streamed events) carry model="id",
 * one series per model and no unlabelled one, each equal to that model's
 * "engine" in /stats "models" (the two differ: two requests against three);
 * one HELP and TYPE line per family; promtool accepts the text. With two
 * published prompt cache directories mounted, /stats lists both in
 * "published_caches" (in order, with their tier names) and keeps
 * "published_cache" as the first one's, the form a single directory has;
 * `kvtier chat --stats` (a child process) reports them the same way.
 * Skipped with a message when KVT_SHARED_DIR lacks stories260K.
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
#include <sys/stat.h>
#include <unistd.h>

#include "cli_run.h"
#include "server.h"
#include "serve_util.h"
#include "synth_util.h"
#include "tokenizer.h"

static char stories[1024], stories_tok[1024], dir[256], synth[300], synth_tok[300], pub[2][300];
static int have_model;

/* the second id has a quote and a backslash: escaped as \" and \\ both in
 * a JSON string and in a Prometheus label value */
static const char *const ids[2] = {"stories260K", "ti\"ny\\"};
static const char *const esc_ids[2] = {"stories260K", "ti\\\"ny\\\\"};

static json_t *get_json(int port, const char *path)
{
    kvt_ts_resp r;
    assert_int_equal(kvt_ts_http(port, "GET", path, NULL, NULL, 30, &r), 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    kvt_ts_resp_free(&r);
    assert_non_null(doc);
    return doc;
}

/* `model` escaped for JSON. */
static void complete(int port, const char *model, const char *prompt, int max_tokens)
{
    char body[512];
    snprintf(body, sizeof body, "{\"model\": \"%s\", \"prompt\": \"%s\", \"max_tokens\": %d, \"temperature\": 0}",
             model, prompt, max_tokens);
    kvt_ts_resp r;
    int st = kvt_ts_http(port, "POST", "/v1/completions", NULL, body, 60, &r);
    if (st != 200)
        fprintf(stderr, "%s: HTTP %d: %s\n", model, st, r.body ? r.body : "");
    kvt_ts_resp_free(&r);
    assert_int_equal(st, 200);
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

static int occurrences(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static double num(json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

/* Each model's "engine" object of /stats "models" (new references). */
static void engines(json_t *doc, json_t *out[2])
{
    json_t *list = json_object_get(doc, "models");
    assert_int_equal(json_array_size(list), 2);
    for (size_t m = 0; m < 2; m++) {
        json_t *one = json_array_get(list, m);
        assert_string_equal(json_string_value(json_object_get(one, "id")), ids[m]);
        out[m] = json_incref(json_object_get(one, "engine"));
        assert_true(json_is_object(out[m]));
    }
}

/* The engine families that are whole counts, with the /stats "engine" field
 * each equals. */
static const struct {
    const char *fam, *field;
} counts[] = {
    {"kvtier_decode_steps_total", "decode_steps"},
    {"kvtier_decode_batch_sequences_total", "batch_sequences"},
    {"kvtier_decode_batch_size_count", "decode_steps"},
    {"kvtier_decode_batch_size_sum", "batch_sequences"},
    {"kvtier_engine_steps_total", "steps"},
    {"kvtier_engine_mixed_steps_total", "mixed_steps"},
    {"kvtier_engine_prefill_passes_total", "prefill_passes"},
    {"kvtier_engine_prefill_tokens_total", "prefill_tokens"},
    {"kvtier_engine_joined_total", "joined"},
    {"kvtier_engine_left_early_total", "left_early"},
    {"kvtier_sse_events_total", "sse_events"},
};
#define N_COUNTS (sizeof counts / sizeof counts[0])

static void test_engine_series_per_model(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    const char *dirs[2] = {pub[0], pub[1]};
    kvt_server_model models[2] = {{.model_path = stories, .tok_path = stories_tok},
                                  {.model_path = synth, .tok_path = synth_tok, .model_name = ids[1]}};
    kvt_server_opts o = {.models = models, .n_models = 2, .prompt_cache_bytes = 16u << 20,
                         .prompt_cache_dirs = dirs, .n_prompt_cache_dirs = 2};
    kvt_server *s = NULL;
    assert_int_equal(kvt_server_start(&o, &s), 0);
    if (kvt_server_load(s) != 0) {
        fprintf(stderr, "load: %s\n", kvt_last_error());
        fail();
    }
    int port = kvt_server_port(s);
    /* two requests to the first model, three longer ones to the second */
    complete(port, esc_ids[0], "Once upon a time", 6);
    complete(port, esc_ids[0], "The cat sat", 6);
    complete(port, esc_ids[1], "Lily liked the sun", 10);
    complete(port, esc_ids[1], "The dog ran to the park", 10);
    complete(port, esc_ids[1], "Once upon a time there was a little", 10);
    kvt_server_poll_tiers(s);

    /* the engine threads are idle once the replies are in; a step still
     * finishing is waited for: /stats read twice the same around /metrics */
    json_t *before[2], *after[2], *final_doc = NULL;
    kvt_ts_resp r = {0};
    int settled = 0;
    for (int tries = 0; tries < 200 && !settled; tries++) {
        if (tries)
            usleep(50 * 1000);
        json_t *d1 = get_json(port, "/stats");
        kvt_ts_resp_free(&r);
        assert_int_equal(kvt_ts_http(port, "GET", "/metrics", NULL, NULL, 30, &r), 200);
        json_t *d2 = get_json(port, "/stats");
        engines(d1, before);
        engines(d2, after);
        settled = 1;
        for (int m = 0; m < 2; m++)
            for (size_t k = 0; k < N_COUNTS; k++)
                settled &= num(before[m], counts[k].field) == num(after[m], counts[k].field);
        if (settled) {
            /* the top-level "engine" is every model's, summed */
            json_t *sum = json_object_get(d2, "engine");
            for (size_t k = 0; k < N_COUNTS; k++)
                assert_true(num(sum, counts[k].field) ==
                            num(after[0], counts[k].field) + num(after[1], counts[k].field));
            final_doc = json_incref(d2);
        }
        for (int m = 0; m < 2; m++) {
            json_decref(before[m]);
            if (!settled)
                json_decref(after[m]);
        }
        json_decref(d1);
        json_decref(d2);
    }
    assert_true(settled);
    const char *text = r.body;
    char ser[200];
    for (int m = 0; m < 2; m++) {
        for (size_t k = 0; k < N_COUNTS; k++) {
            snprintf(ser, sizeof ser, "%s{model=\"%s\"}", counts[k].fam, esc_ids[m]);
            double v = series_value(text, ser);
            if (v != num(after[m], counts[k].field))
                fprintf(stderr, "%s = %g, /stats %s %g\n", ser, v, counts[k].field, num(after[m], counts[k].field));
            assert_true(v == num(after[m], counts[k].field));
        }
        assert_true(num(after[m], "decode_steps") > 0);
        /* the histogram's last bucket holds every decode step */
        snprintf(ser, sizeof ser, "kvtier_decode_batch_size_bucket{model=\"%s\",le=\"+Inf\"}", esc_ids[m]);
        assert_true(series_value(text, ser) == num(after[m], "decode_steps"));
        snprintf(ser, sizeof ser, "kvtier_decode_batch_size_bucket{model=\"%s\",le=\"1\"}", esc_ids[m]);
        assert_true(series_value(text, ser) >= 0);
        snprintf(ser, sizeof ser, "kvtier_engine_phase_seconds_total{model=\"%s\",phase=\"decode\"}", esc_ids[m]);
        assert_true(series_value(text, ser) > 0);
        snprintf(ser, sizeof ser, "kvtier_engine_step_seconds_total{model=\"%s\"}", esc_ids[m]);
        assert_true(series_value(text, ser) > 0);
        snprintf(ser, sizeof ser, "kvtier_queue_depth{model=\"%s\"}", esc_ids[m]);
        assert_true(series_value(text, ser) == 0);
        snprintf(ser, sizeof ser, "kvtier_running_requests{model=\"%s\"}", esc_ids[m]);
        assert_true(series_value(text, ser) == 0);
    }
    /* the two models' figures differ: a sum, or one model's figures under
     * both labels, would show */
    assert_true(num(after[0], "prefill_tokens") != num(after[1], "prefill_tokens"));
    assert_true(num(after[0], "decode_steps") != num(after[1], "decode_steps"));
    for (int m = 0; m < 2; m++)
        json_decref(after[m]);
    /* no unlabelled engine series is left, and each family has one HELP and TYPE */
    const char *fams[] = {"queue_depth", "running_requests", "decode_batch_size", "decode_steps_total",
                          "decode_batch_sequences_total", "engine_steps_total", "engine_prefill_tokens_total",
                          "engine_phase_seconds_total", "engine_step_seconds_total", "sse_events_total",
                          "sse_lag_seconds_total"};
    for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++) {
        char h[120];
        snprintf(h, sizeof h, "\nkvtier_%s ", fams[i]);
        assert_null(strstr(text, h));
        snprintf(h, sizeof h, "\nkvtier_%s{le=", fams[i]);
        assert_null(strstr(text, h));
        snprintf(h, sizeof h, "\nkvtier_%s_bucket{le=", fams[i]);
        assert_null(strstr(text, h));
        snprintf(h, sizeof h, "\nkvtier_%s{phase=", fams[i]);
        assert_null(strstr(text, h));
        snprintf(h, sizeof h, "# TYPE kvtier_%s ", fams[i]);
        assert_int_equal(occurrences(text, h), 1);
        snprintf(h, sizeof h, "# HELP kvtier_%s ", fams[i]);
        assert_int_equal(occurrences(text, h), 1);
    }
    if (system("command -v promtool >/dev/null 2>&1") == 0) {
        char path[300], cmd[400];
        snprintf(path, sizeof path, "%s/metrics.txt", dir);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(text, f);
        fclose(f);
        snprintf(cmd, sizeof cmd, "promtool check metrics < %s", path);
        assert_int_equal(system(cmd), 0);
        unlink(path);
    } else {
        printf("test_metrics_models: promtool is not installed (Debian package prometheus): lint skipped\n");
    }
    kvt_ts_resp_free(&r);

    /* "published_cache" keeps its one-directory form (the first
     * directory's), "published_caches" lists every one in order: at the top
     * level (the first model's report) and in each model's report */
    json_t *list = json_object_get(final_doc, "models");
    for (size_t m = 0; m < 3; m++) {
        json_t *rep = m < 2 ? json_object_get(json_array_get(list, m), "report") : final_doc;
        json_t *first = json_object_get(rep, "published_cache");
        assert_true(json_is_object(first));
        assert_string_equal(json_string_value(json_object_get(first, "dir")), pub[0]);
        json_t *all = json_object_get(rep, "published_caches");
        assert_int_equal(json_array_size(all), 2);
        for (size_t i = 0; i < 2; i++) {
            json_t *p = json_array_get(all, i);
            char tier[32];
            snprintf(tier, sizeof tier, "published:%d", (int)i + 1);
            assert_string_equal(json_string_value(json_object_get(p, "dir")), pub[i]);
            assert_string_equal(json_string_value(json_object_get(p, "tier")), tier);
            assert_string_equal(json_string_value(json_object_get(p, "mode")), "off"); /* nothing published */
        }
        assert_int_equal(json_array_size(json_object_get(rep, "tiers")), 2);
    }
    json_decref(final_doc);
    assert_int_equal(kvt_server_stop(s, 5000), 0);
    kvt_server_destroy(s);
}

/* kvtier chat --stats with two published directories: its report (the
 * JSON line on stderr) lists both in "published_caches" and keeps the
 * first under "published_cache". */
static void test_chat_stats_published(void **state)
{
    (void)state;
    char model[1024], tok[1024];
    if (!have_model || !cli_inputs(model, sizeof model, tok, sizeof tok))
        skip();
    char script[400];
    snprintf(script, sizeof script, "%s/script.txt", dir);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs("Hello there\n", f);
    fclose(f);
    const char *args[] = {"chat", "--model", model, "--tokenizer", tok, "--script", script, "--max-tokens", "4",
                          "--stats", "--prompt-cache-dir", pub[0], "--prompt-cache-dir", pub[1], NULL};
    cli_child c;
    cli_result r;
    assert_int_equal(cli_start(&c, dir, args, NULL, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 120, &r), 0);
    if (r.status != 0)
        fprintf(stderr, "%s\n", r.err);
    assert_int_equal(r.status, 0);
    /* the report is the last line of stderr that is a JSON object with "published_caches" */
    json_t *doc = NULL;
    for (char *line = strtok(r.err, "\n"); line; line = strtok(NULL, "\n"))
        if (line[0] == '{' && strstr(line, "\"published_caches\"")) {
            json_decref(doc);
            doc = json_loads(line, 0, NULL);
        }
    assert_non_null(doc);
    assert_string_equal(json_string_value(json_object_get(json_object_get(doc, "published_cache"), "dir")), pub[0]);
    json_t *all = json_object_get(doc, "published_caches");
    assert_int_equal(json_array_size(all), 2);
    for (size_t i = 0; i < 2; i++)
        assert_string_equal(json_string_value(json_object_get(json_array_get(all, i), "dir")), pub[i]);
    json_decref(doc);
}

static int setup(void **state)
{
    (void)state;
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(stories, sizeof stories, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(stories_tok, sizeof stories_tok, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    have_model = access(stories, R_OK) == 0 && access(stories_tok, R_OK) == 0;
    if (!have_model) {
        printf("test_metrics_models: skipped: needs %s with tok512.bin (set KVT_SHARED_DIR)\n", stories);
        return 0;
    }
    snprintf(dir, sizeof dir, "/tmp/kvt_test_metrics_models_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(synth, sizeof synth, "%s/synth.bin", dir);
    snprintf(synth_tok, sizeof synth_tok, "%s/synth_tok.bin", dir);
    if (kvt_tokenizer_write_default(synth_tok, 259))
        return -1;
    su_synth(SU_PLAIN, synth, 259, 256, 41, 0);
    for (int i = 0; i < 2; i++) {
        snprintf(pub[i], sizeof pub[i], "%s/pub%d", dir, i + 1);
        if (mkdir(pub[i], 0700))
            return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (have_model) {
        unlink(synth);
        unlink(synth_tok);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            printf("test_metrics_models: could not remove %s\n", dir);
    }
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_engine_series_per_model),
        cmocka_unit_test(test_chat_stats_published),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
