/* serve_crash.c: SIGKILL crash trials of `kvtier serve --ssd-cache`, alone
 * or sharing a Redis with a survivor (serve_crash.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "serve_crash.h"

#include "test_seed.h"

#include "redis_util.h"
#include "serve_util.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N_CONV 8    /* conversations the clients run */
#define N_TURNS 3   /* turns of each */
#define N_CLIENTS 8
#define MAX_TOKENS 24
#define PROBE N_CONV /* one more conversation: the SSD reuse probe */

static const char *const g_system = "You are a storyteller. Tell short, happy stories for children.";
static const char *const g_users[N_TURNS] = {
    "Tell me a story about a little dog.",
    "What did the dog find in the garden?",
    "How did the story end?",
};
static const char *const g_names[N_CONV + 1] = {"Lily", "Tom", "Ben", "Sue", "Max", "Amy", "Sam", "Zoe", "Tim"};

/* reference replies of the cache-off server: g_ref[conversation][turn] */
static char *g_ref[N_CONV + 1][N_TURNS];

static char *user_text(int conv, int turn)
{
    char *s = NULL;
    if (asprintf(&s, "%s says: %s", g_names[conv], g_users[turn]) < 0)
        return NULL;
    return s;
}

/* The body of turn `turn` of conversation `conv`, its history made of the
 * reference replies (a correct server gave exactly those). */
static char *body_of(int conv, int turn)
{
    json_t *msgs = json_array();
    json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", g_system));
    for (int t = 0; t <= turn; t++) {
        char *u = user_text(conv, t);
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", u ? u : ""));
        free(u);
        if (t < turn)
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", g_ref[conv][t]));
    }
    char key[32];
    snprintf(key, sizeof key, "conv-%d", conv);
    json_t *doc = json_pack("{s:o, s:f, s:i, s:s}", "messages", msgs, "temperature", 0.0, "max_tokens", MAX_TOKENS,
                            "prompt_cache_key", key);
    char *s = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    return s;
}

/* POSTs turn `turn` of `conv`: the status, and on 200 the reply (caller
 * frees) and the prompt tokens reused from a tier below RAM: the SSD tier,
 * or Redis (after a wiped SSD directory only Redis can serve; usage names
 * each tier, "ssd" and "remote"). */
static int ask(int port, int conv, int turn, char **reply, int64_t *ssd)
{
    *reply = NULL;
    *ssd = 0;
    char *body = body_of(conv, turn);
    kvt_ts_resp r;
    int st = kvt_ts_http(port, "POST", "/v1/chat/completions", NULL, body, 60, &r);
    free(body);
    if (st == 200) {
        json_t *doc = json_loads(r.body, 0, NULL);
        json_t *c = json_array_get(json_object_get(doc, "choices"), 0);
        const char *text = json_string_value(json_object_get(json_object_get(c, "message"), "content"));
        json_t *u = json_object_get(doc, "usage");
        json_t *by = json_object_get(json_object_get(u, "kvtier"), "reused_tokens");
        *ssd = json_integer_value(json_object_get(by, "ssd")) + json_integer_value(json_object_get(by, "remote"));
        *reply = text ? strdup(text) : NULL;
        if (!text)
            st = -2; /* a 200 without a reply: counted as wrong */
        json_decref(doc);
    }
    kvt_ts_resp_free(&r);
    return st;
}

typedef struct client {
    pthread_t th;
    int id, port, survivor;
    uint64_t rng;
    atomic_int *stop;
    int64_t replies, wrong, errors, dropped, ssd_tokens;
} client;

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void *client_main(void *arg)
{
    client *c = arg;
    for (int k = 0; !atomic_load(c->stop); k++) {
        int conv = (int)((c->id + next_rand(&c->rng)) % N_CONV), turn = (int)(next_rand(&c->rng) % N_TURNS);
        char *reply;
        int64_t ssd;
        int st = ask(c->port, conv, turn, &reply, &ssd);
        if (st == 200) {
            c->replies++;
            c->ssd_tokens += ssd;
            if (strcmp(reply, g_ref[conv][turn])) {
                c->wrong++;
                fprintf(stderr, "serve_crash: WRONG reply to conversation %d turn %d:\n  got  \"%s\"\n  want \"%s\"\n",
                        conv, turn, reply, g_ref[conv][turn]);
            }
            free(reply);
        } else if (st == -2) {
            c->replies++;
            c->wrong++;
        } else if (st < 0 && !c->survivor) {
            c->dropped++;
            break; /* the server is gone */
        } else if (st < 0) {
            c->errors++; /* the survivor must not drop requests: counted, and its replies still compared */
            fprintf(stderr, "serve_crash: the survivor failed a request (%d)\n", st);
            usleep(20000);
        } else {
            c->errors++;
            usleep(20000);
        }
    }
    return NULL;
}

/* Whether everything the server at port kept is durable: its SSD tier
 * wrote at least one entry and has no write pending, and (with_redis) its
 * remote tier wrote at least one record and has none queued. 0 when /stats
 * cannot be read. */
static int all_written(int port, int with_redis)
{
    kvt_ts_resp r;
    int done = 0;
    if (kvt_ts_http(port, "GET", "/stats", NULL, NULL, 10, &r) == 200) {
        json_t *doc = json_loads(r.body, 0, NULL);
        json_t *ssd = json_object_get(doc, "ssd"), *rem = json_object_get(doc, "remote");
        done = json_integer_value(json_object_get(ssd, "written")) > 0 &&
               json_is_integer(json_object_get(ssd, "pending")) &&
               json_integer_value(json_object_get(ssd, "pending")) == 0;
        if (with_redis)
            done = done && json_integer_value(json_object_get(rem, "write_records")) > 0 &&
                   json_is_integer(json_object_get(rem, "queued_entries")) &&
                   json_integer_value(json_object_get(rem, "queued_entries")) == 0;
        json_decref(doc);
    }
    kvt_ts_resp_free(&r);
    return done;
}

static double mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The remote tier's counters in /stats (for a probe that missed), into buf. */
static void stats_remote(int port, char *buf, size_t cap)
{
    kvt_ts_resp r;
    snprintf(buf, cap, "(no /stats)");
    if (kvt_ts_http(port, "GET", "/stats", NULL, NULL, 10, &r) == 200) {
        json_t *doc = json_loads(r.body, 0, NULL);
        char *s = json_dumps(json_object_get(doc, "remote"), JSON_COMPACT);
        snprintf(buf, cap, "%s", s ? s : "(no remote object)");
        free(s);
        json_decref(doc);
    }
    kvt_ts_resp_free(&r);
}

static int store_verify(const char *bin, const char *dir, const char *log)
{
    char cmd[2000];
    snprintf(cmd, sizeof cmd, "'%s' store verify '%s' > '%s' 2>&1", bin, dir, log);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Turn `turn` of the probe on port: counts the reply; 1 when it reused
 * cached tokens, 0 when not, -1 when it was not answered. */
static int probe(int port, int turn, serve_crash_report *out, const char *when, int trial)
{
    char *reply;
    int64_t s1 = 0;
    int st = ask(port, PROBE, turn, &reply, &s1);
    if (st != 200) {
        out->errors++;
        fprintf(stderr, "serve_crash: %s %d: the probe got status %d\n", when, trial, st);
        return -1;
    }
    out->replies++;
    if (strcmp(reply, g_ref[PROBE][turn])) {
        out->wrong++;
        fprintf(stderr, "serve_crash: WRONG probe reply %s %d\n", when, trial);
    }
    free(reply);
    out->ssd_tokens += s1;
    return s1 > 0;
}

int serve_crash_trials(int trials, uint64_t seed, int verbose, serve_crash_report *out)
{
    return serve_crash_trials_opts(trials, seed, verbose, NULL, out);
}

int serve_crash_trials_opts(int trials, uint64_t seed, int verbose, const serve_crash_opts *o, serve_crash_report *out)
{
    memset(out, 0, sizeof *out);
    int with_redis = o && o->redis;
    if (with_redis && !redis_available("serve_crash"))
        return 77;
    const char *bin = getenv("KVT_BIN"), *shared = getenv("KVT_SHARED_DIR");
    char model[1024], tok[1024];
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tok, sizeof tok, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    if (!bin || access(model, R_OK) || access(tok, R_OK)) {
        printf("serve_crash: skipped: needs KVT_BIN and %s with tok512.bin (set KVT_SHARED_DIR)\n", model);
        return 77;
    }
    char tmp[64] = "/tmp/kvt_serve_crash_XXXXXX";
    if (!mkdtemp(tmp))
        return -1;
    char ssd[128], ssd_b[128], log[160], vlog[160];
    snprintf(ssd, sizeof ssd, "%s/ssd", tmp);
    snprintf(ssd_b, sizeof ssd_b, "%s/ssd-survivor", tmp);
    snprintf(vlog, sizeof vlog, "%s/verify.log", tmp);
    int rc = -1;
    redis_srv rs = {0};
    kvt_ts_server surv = {0};
    if (with_redis && redis_start(&rs, 64, NULL))
        goto out;

    /* the cache-off reference, turn by turn (each turn's history holds the
     * reference replies before it) */
    kvt_ts_server ref;
    snprintf(log, sizeof log, "%s/ref.log", tmp);
    const char *ref_args[] = {"--model", model, "--tokenizer", tok, "--prompt-cache", "0", "--threads", "1", NULL};
    if (kvt_ts_server_start(&ref, bin, log, ref_args))
        goto out;
    for (int t = 0; t < N_TURNS; t++)
        for (int c = 0; c <= N_CONV; c++) {
            int64_t ssd_tok;
            if (ask(ref.port, c, t, &g_ref[c][t], &ssd_tok) != 200) {
                fprintf(stderr, "serve_crash: the cache-off server did not answer conversation %d turn %d\n", c, t);
                kvt_ts_server_kill(&ref);
                goto out;
            }
        }
    kvt_ts_server_stop(&ref);

    /* a small RAM cache so the SSD tier serves, write-behind and idle
     * demotion; with Redis, the remote tier below it. Its lookups are
     * bounded by 1 s, not the default 50 ms: on a loaded machine (2 cores,
     * load 30) a restarted server's first lookups took longer than 50 ms
     * plus the chain's 10 ms, and a late answer is a miss by design (a probe
     * after a wiped SSD directory then reused nothing: 3 of 66 such
     * restarts in one 200-trial run, each with lookup hits counted by the
     * remote tier after the chain had given up). Restores likewise get 10 s,
     * not 1. What the trials check is reuse through Redis, not those bounds */
    const char *args[] = {"--model", model, "--tokenizer", tok, "--ssd-cache", ssd, "--ssd-cache-max", "48M",
                          "--prompt-cache", "4M", "--demote-idle", "100", with_redis ? "--redis" : NULL, rs.url,
                          "--redis-timeout", "1000", "--redis-restore-timeout", "10000", NULL};
    const char *args_b[] = {"--model", model, "--tokenizer", tok, "--ssd-cache", ssd_b, "--ssd-cache-max", "48M",
                            "--prompt-cache", "4M", "--demote-idle", "100", "--redis", rs.url, "--redis-timeout",
                            "1000", "--redis-restore-timeout", "10000", NULL};
    if (with_redis) {
        snprintf(log, sizeof log, "%s/survivor.log", tmp);
        if (kvt_ts_server_start(&surv, bin, log, args_b))
            goto out;
    }
    uint64_t rng = seed ? seed : 1;
    for (int trial = 0; trial < trials; trial++) {
        kvt_ts_server sv;
        /* with Redis, every third restart is on an empty SSD directory:
         * only Redis can serve the probe */
        int wiped = with_redis && trial > 0 && trial % 3 == 0;
        if (wiped) {
            char cmd[300];
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", ssd);
            if (system(cmd) != 0)
                goto out;
            out->redis_wipes++;
        }
        snprintf(log, sizeof log, "%s/serve-%d.log", tmp, trial % 2);
        if (kvt_ts_server_start(&sv, bin, log, args))
            goto out;
        int probe_hit = 0;
        if (trial == 0) {
            /* the probe's first turn, until it is on the SSD tier (and in
             * Redis): every later probe counts on it */
            probe(sv.port, 0, out, "trial", trial);
            double t0 = mono_ms();
            while (!all_written(sv.port, with_redis) && mono_ms() - t0 < 60000)
                usleep(20000);
            if (!all_written(sv.port, with_redis)) {
                fprintf(stderr, "serve_crash: the probe's first turn was not written to the SSD tier%s in 60 s\n",
                        with_redis ? " and Redis" : "");
                kvt_ts_server_kill(&sv);
                goto out;
            }
        } else {
            probe_hit = probe(sv.port, 1, out, "restart", trial) == 1;
            if (!probe_hit) {
                char rem[1500];
                stats_remote(sv.port, rem, sizeof rem);
                fprintf(stderr, "serve_crash: trial %d: the probe reused nothing%s; the remote tier: %s\n", trial,
                        wiped ? " (SSD wiped)" : "", with_redis ? rem : "(none)");
            }
            out->probe_ssd_hits += probe_hit;
            out->redis_probe_hits += wiped && probe_hit;
        }
        atomic_int stop = 0;
        client cl[N_CLIENTS];
        for (int i = 0; i < N_CLIENTS; i++) {
            memset(&cl[i], 0, sizeof cl[i]);
            cl[i].id = i;
            cl[i].survivor = with_redis && i >= N_CLIENTS / 2; /* half the load on the survivor */
            cl[i].port = cl[i].survivor ? surv.port : sv.port;
            cl[i].rng = next_rand(&rng) | 1;
            cl[i].stop = &stop;
            pthread_create(&cl[i].th, NULL, client_main, &cl[i]);
        }
        /* kill at a random moment: 50 ms to 1.5 s into the load */
        useconds_t wait_us = (useconds_t)(50000 + next_rand(&rng) % 1450000);
        usleep(wait_us);
        kvt_ts_server_kill(&sv);
        atomic_store(&stop, 1);
        int64_t rep = 0, wr = 0, dr = 0;
        for (int i = 0; i < N_CLIENTS; i++) {
            pthread_join(cl[i].th, NULL);
            if (cl[i].survivor)
                out->survivor_replies += cl[i].replies;
            rep += cl[i].replies;
            wr += cl[i].wrong;
            dr += cl[i].dropped;
            out->errors += cl[i].errors;
            out->ssd_tokens += cl[i].ssd_tokens;
        }
        out->replies += rep;
        out->wrong += wr;
        out->dropped += dr;
        int v = store_verify(bin, ssd, vlog);
        if (v != 0) {
            out->unclean++;
            char buf[4096] = "";
            FILE *f = fopen(vlog, "r");
            if (f) {
                size_t n = fread(buf, 1, sizeof buf - 1, f);
                buf[n] = '\0';
                fclose(f);
            }
            fprintf(stderr, "serve_crash: trial %d: store verify exited %d:\n%s\n", trial, v, buf);
        }
        out->trials++;
        if (verbose)
            printf("  trial %3d: killed after %4u ms, %3lld replies (%lld wrong), %lld cut, verify %d, probe from "
                   "a cold tier %s%s\n",
                   trial, (unsigned)(wait_us / 1000), (long long)rep, (long long)wr, (long long)dr, v,
                   trial ? (probe_hit ? "yes" : "no") : "-", wiped ? " (SSD wiped: Redis)" : "");
    }
    /* a last restart, stopped cleanly */
    {
        kvt_ts_server sv;
        snprintf(log, sizeof log, "%s/serve-last.log", tmp);
        if (kvt_ts_server_start(&sv, bin, log, args))
            goto out;
        out->probe_ssd_hits += probe(sv.port, 1, out, "last restart", trials) == 1;
        out->final_stop_rc = kvt_ts_server_stop(&sv);
        if (store_verify(bin, ssd, vlog) != 0)
            out->unclean++;
    }
    if (with_redis) {
        int src = kvt_ts_server_stop(&surv);
        surv.pid = 0;
        if (src != 0)
            out->final_stop_rc = src;
        if (store_verify(bin, ssd_b, vlog) != 0)
            out->unclean++;
    }
    rc = 0;
out:
    if (surv.pid > 0)
        kvt_ts_server_kill(&surv);
    if (rs.pid > 0)
        redis_stop(&rs);
    for (int c = 0; c <= N_CONV; c++)
        for (int t = 0; t < N_TURNS; t++) {
            free(g_ref[c][t]);
            g_ref[c][t] = NULL;
        }
    char cmd[200];
    if (getenv("KVT_TEST_KEEP")) {
        printf("serve_crash: kept %s\n", tmp);
        return rc;
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "serve_crash: cannot remove %s\n", tmp);
    return rc;
}

void serve_crash_run(const char *name, int trials) { serve_crash_run_opts(name, trials, NULL); }

void serve_crash_run_opts(const char *name, int trials, const serve_crash_opts *o)
{
    uint64_t seed = test_seed(name);
    serve_crash_report r;
    int rc = serve_crash_trials_opts(trials, seed, getenv("KVT_TEST_VERBOSE") != NULL, o, &r);
    if (rc == 77) {
        skip();
        return;
    }
    assert_int_equal(rc, 0);
    printf("  %d trials: %lld replies compared with cache-off, %lld wrong; %lld cut by a kill, %lld errors; "
           "%d unclean stores; probe served from the SSD tier after %d of %d restarts; %lld tokens reused from "
           "SSD; last stop exit %d\n",
           r.trials, (long long)r.replies, (long long)r.wrong, (long long)r.dropped, (long long)r.errors, r.unclean,
           r.probe_ssd_hits, r.trials, (long long)r.ssd_tokens, r.final_stop_rc);
    assert_int_equal(r.trials, trials);
    assert_int_equal(r.wrong, 0);
    assert_int_equal(r.unclean, 0);
    assert_true(r.replies > trials);
    assert_int_equal(r.probe_ssd_hits, trials); /* every restart (trials - 1) and the last one */
    assert_true(r.ssd_tokens > 0);
    assert_int_equal(r.final_stop_rc, 0);
    if (o && o->redis) {
        printf("  with Redis: the survivor answered %lld requests; %d restarts on a wiped SSD directory, %d probes "
               "served through Redis\n",
               (long long)r.survivor_replies, r.redis_wipes, r.redis_probe_hits);
        assert_true(r.survivor_replies > 0);
        assert_int_equal(r.redis_probe_hits, r.redis_wipes);
    }
}
