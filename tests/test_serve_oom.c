/*
 * test_serve_oom.c: allocation failure at every allocation of the server's
 * request path (tests/support/serve_oom.c): a chat the cache has never seen,
 * a chat reusing a cached prefix, a streamed chat and a completion of token
 * ids, each with the N-th allocation of its request failed, for every N
 * (about 120 a request): each faulted request is answered with the
 * cache-off reply or an OpenAI error object (or, for a failure inside
 * libmicrohttpd, its connection is closed), and the same request then
 * succeeds. Skipped under ASan/TSan (they own malloc). KVT_TEST_VERBOSE=1
 * prints each failure and where it was.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "serve_util.h"
#include "server.h"

#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SERVE_OOM_OFF 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SERVE_OOM_OFF 1
#endif
#endif

#define SERVE_OOM_KINDS 4

typedef struct serve_oom_report {
    const char *kind[SERVE_OOM_KINDS];
    int64_t allocations[SERVE_OOM_KINDS]; /* allocations one request of the kind made (last count) */
    int64_t failed[SERVE_OOM_KINDS];      /* allocations failed (one per faulted request) */
    int64_t ok[SERVE_OOM_KINDS];          /* faulted requests answered 200 with the right reply */
    int64_t errors[SERVE_OOM_KINDS];      /* answered with an error object */
    int64_t dropped[SERVE_OOM_KINDS];     /* connection closed (failure inside libmicrohttpd) */
    int64_t bad;                          /* violations (printed): wrong reply, no answer outside MHD, ... */
} serve_oom_report;

/** Walks N over the allocations of each request kind, every `stride`-th
 * (1: all), starting at an offset drawn from `seed`. @return 0 when run
 * (check report.bad), 77 to skip (sanitizer build, or KVT_SHARED_DIR lacks
 * stories260K), -1 when a server cannot start. */

#ifndef SERVE_OOM_OFF

/* ---- the process's allocator, failing the armed allocation ------------------------- */

extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);
extern void __libc_free(void *p);
extern void *__libc_memalign(size_t align, size_t n);

static _Thread_local int tl_exempt;  /* the test's own thread is never failed */
static atomic_long g_fail_at;        /* 0: disarmed */
static atomic_long g_count;
static atomic_int g_injected;
#define SITE_FRAMES 24
static void *g_site[SITE_FRAMES];
static int g_site_n;

static int inject(void)
{
    if (tl_exempt || atomic_load_explicit(&g_fail_at, memory_order_relaxed) == 0)
        return 0;
    long k = atomic_fetch_add(&g_count, 1) + 1;
    if (k != atomic_load(&g_fail_at))
        return 0;
    g_site_n = backtrace(g_site, SITE_FRAMES); /* warmed up in serve_oom_walk: no allocation */
    atomic_store(&g_injected, 1);
    errno = ENOMEM;
    return 1;
}

void *malloc(size_t n) { return inject() ? NULL : __libc_malloc(n); }
void *calloc(size_t n, size_t size) { return inject() ? NULL : __libc_calloc(n, size); }
void *realloc(void *p, size_t n) { return inject() ? NULL : __libc_realloc(p, n); }
void free(void *p) { __libc_free(p); }
void *memalign(size_t align, size_t n) { return inject() ? NULL : __libc_memalign(align, n); }
void *aligned_alloc(size_t align, size_t n) { return inject() ? NULL : __libc_memalign(align, n); }
int posix_memalign(void **out, size_t align, size_t n)
{
    if (inject())
        return ENOMEM;
    void *p = __libc_memalign(align, n);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}
void *valloc(size_t n) { return inject() ? NULL : __libc_memalign((size_t)sysconf(_SC_PAGESIZE), n); }

static void arm(long fail_at)
{
    atomic_store(&g_count, 0);
    atomic_store(&g_injected, 0);
    g_site_n = 0;
    atomic_store(&g_fail_at, fail_at);
}

/* Disarms; whether the armed allocation was failed. */
static int disarm(void)
{
    atomic_store(&g_fail_at, 0);
    return atomic_load(&g_injected);
}

/* The library of the first frame of the failed allocation's caller chain
 * outside libc and this file: "libmicrohttpd", "libjansson", "kvtier" (the
 * server, engine and library are linked into the test), ... */
static const char *site_owner(char *fn, size_t cap)
{
    snprintf(fn, cap, "?");
    for (int i = 2; i < g_site_n; i++) { /* 0: inject, 1: malloc/calloc/realloc here */
        Dl_info di;
        if (!dladdr(g_site[i], &di) || !di.dli_fname)
            continue;
        const char *base = strrchr(di.dli_fname, '/');
        base = base ? base + 1 : di.dli_fname;
        if (!strncmp(base, "libc.so", 7)) /* strdup, asprintf, ...: their caller decides */
            continue;
        snprintf(fn, cap, "%s", di.dli_sname ? di.dli_sname : "?");
        if (!strncmp(base, "libmicrohttpd", 13))
            return "libmicrohttpd";
        if (!strncmp(base, "libjansson", 10))
            return "libjansson";
        if (!strncmp(base, "libcrypto", 9))
            return "libcrypto";
        if (strstr(base, ".so"))
            return "other library";
        return "kvtier";
    }
    return "?";
}

/* ---- requests ----------------------------------------------------------------------- */

enum { K_CHAT_MISS, K_CHAT_HIT, K_STREAM, K_COMPLETION };
static const char *const kind_names[SERVE_OOM_KINDS] = {"chat (new prompt)", "chat (cached prefix)",
                                                        "chat (streamed)", "completion (token ids)"};
static char *g_turn1; /* the cache-off reply to the first turn of the cached chat */

static char *body_of(int kind, int64_t n)
{
    json_t *doc;
    if (kind == K_COMPLETION) {
        doc = json_pack("{s:[i, i, i, i], s:i, s:f}", "prompt", 1, (int)(100 + n % 300), 50, 70, "max_tokens", 8,
                        "temperature", 0.0);
    } else if (kind == K_CHAT_MISS || n == 0 || !g_turn1) { /* n 0: the first turn of the cached chat */
        char u[96];
        snprintf(u, sizeof u, kind == K_CHAT_MISS ? "Story number %lld: a cat and a hat." : "Tell me about a dog.",
                 (long long)n);
        doc = json_pack("{s:[{s:s, s:s}], s:i, s:f}", "messages", "role", "user", "content", u, "max_tokens", 8,
                        "temperature", 0.0);
    } else {
        doc = json_pack("{s:[{s:s, s:s}, {s:s, s:s}, {s:s, s:s}], s:i, s:f, s:s}", "messages", "role", "user",
                        "content", "Tell me about a dog.", "role", "assistant", "content", g_turn1, "role", "user",
                        "content", "What did it eat?", "max_tokens", 8, "temperature", 0.0, "prompt_cache_key",
                        "dog");
        if (kind == K_STREAM) {
            json_object_set_new(doc, "stream", json_true());
            json_object_set_new(doc, "stream_options", json_pack("{s:b}", "include_usage", 1));
        }
    }
    char *s = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    return s;
}

enum { A_OK, A_ERROR, A_DROPPED, A_BAD };

/* Classifies an answer: the reply text (caller frees) on A_OK. */
static int classify(int kind, const kvt_ts_resp *r, char **text, char *why, size_t cap)
{
    *text = NULL;
    if (r->status < 0) {
        snprintf(why, cap, "no answer");
        return A_DROPPED;
    }
    if (kind == K_STREAM && r->status == 200) {
        /* events: content deltas, maybe an error event, the usage chunk, [DONE] */
        size_t cap_t = r->len + 1, n = 0;
        char *t = calloc(1, cap_t);
        int done = 0, err = 0;
        const char *p = r->body;
        while (t && *p && !strncmp(p, "data: ", 6)) {
            const char *e = strstr(p, "\n\n");
            if (!e)
                break;
            if (!strncmp(p + 6, "[DONE]", 6)) {
                done = 1;
                p = e + 2;
                continue;
            }
            json_t *doc = json_loadb(p + 6, (size_t)(e - p - 6), 0, NULL);
            if (json_object_get(doc, "error"))
                err = 1;
            json_t *d = json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "delta");
            const char *piece = json_string_value(json_object_get(d, "content"));
            if (piece && n + strlen(piece) < cap_t) {
                memcpy(t + n, piece, strlen(piece));
                n += strlen(piece);
            }
            json_decref(doc);
            p = e + 2;
        }
        if (err) {
            free(t);
            snprintf(why, cap, "stream error event");
            return A_ERROR;
        }
        if (!done || *p) {
            free(t);
            snprintf(why, cap, "stream cut without an error event: %.200s", r->body);
            return A_DROPPED;
        }
        *text = t;
        return t ? A_OK : A_BAD;
    }
    json_t *doc = json_loads(r->body, 0, NULL);
    if (r->status == 200) {
        json_t *c = json_array_get(json_object_get(doc, "choices"), 0);
        const char *s = kind == K_COMPLETION ? json_string_value(json_object_get(c, "text"))
                                             : json_string_value(json_object_get(json_object_get(c, "message"), "content"));
        *text = s ? strdup(s) : NULL;
        json_decref(doc);
        if (!*text)
            snprintf(why, cap, "200 without a reply: %.200s", r->body);
        return *text ? A_OK : A_BAD;
    }
    json_t *err = json_object_get(doc, "error");
    int ok = r->status >= 400 && r->status <= 599 && json_is_string(json_object_get(err, "message"));
    snprintf(why, cap, "%d %.200s", r->status, r->body);
    json_decref(doc);
    return ok ? A_ERROR : A_BAD;
}

static int send_kind(int port, int kind, int64_t n, kvt_ts_resp *r, double *ms)
{
    char *body = body_of(kind, n);
    const char *path = kind == K_COMPLETION ? "/v1/completions" : "/v1/chat/completions";
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvt_ts_http(port, "POST", path, NULL, body, 10, r);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    free(body);
    return r->status;
}

/* The reply of a request that must succeed (disarmed), or NULL. */
static char *must_answer(int port, int kind, int64_t n)
{
    kvt_ts_resp r;
    double ms;
    send_kind(port, kind, n, &r, &ms);
    char *text = NULL, why[300];
    int a = classify(kind, &r, &text, why, sizeof why);
    if (a != A_OK)
        fprintf(stderr, "serve_oom: %s %lld: unfaulted request failed: %s\n", kind_names[kind], (long long)n, why);
    kvt_ts_resp_free(&r);
    return text;
}

static int serve_oom_walk(int64_t stride, uint64_t seed, int verbose, serve_oom_report *out)
{
    memset(out, 0, sizeof *out);
    for (int k = 0; k < SERVE_OOM_KINDS; k++)
        out->kind[k] = kind_names[k];
    const char *shared = getenv("KVT_SHARED_DIR");
    char model[1024], tok[1024];
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tok, sizeof tok, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    if (access(model, R_OK) || access(tok, R_OK)) {
        printf("serve_oom: skipped: needs %s with tok512.bin (set KVT_SHARED_DIR)\n", model);
        return 77;
    }
    tl_exempt = 1;
    void *warm[4];
    backtrace(warm, 4); /* loads what backtrace needs now, not inside malloc */
    char tmp[64] = "/tmp/kvt_serve_oom_XXXXXX", ssd[128];
    if (!mkdtemp(tmp))
        return -1;
    snprintf(ssd, sizeof ssd, "%s/ssd", tmp);
    kvt_server *srv = NULL, *off = NULL;
    kvt_server_opts o = {.model_path = model, .tok_path = tok, .prompt_cache_bytes = 8u << 20, .ssd_dir = ssd};
    kvt_server_opts oo = {.model_path = model, .tok_path = tok, .prompt_cache_bytes = 0};
    int rc = -1;
    if (kvt_server_start(&o, &srv) || kvt_server_load(srv) || kvt_server_start(&oo, &off) || kvt_server_load(off))
        goto out;
    int port = kvt_server_port(srv), off_port = kvt_server_port(off);
    g_turn1 = must_answer(off_port, K_CHAT_HIT, 0); /* the first turn of the cached chat */
    char *warmup = g_turn1 ? must_answer(port, K_CHAT_HIT, 0) : NULL;
    free(warmup);
    if (!g_turn1 || !warmup)
        goto out;
    char *g_ref_hit = must_answer(off_port, K_CHAT_HIT, 1); /* its second turn */
    free(must_answer(port, K_CHAT_HIT, 1));                 /* cached on the server */
    if (!g_ref_hit)
        goto out;
    uint64_t rng = seed ? seed : 1;
    for (int kind = 0; kind < SERVE_OOM_KINDS; kind++) {
        int64_t start = stride > 1 ? (int64_t)(1 + (rng = rng * 6364136223846793005ull + 1442695040888963407ull) %
                                                         (uint64_t)stride)
                                   : 1;
        for (int64_t n = start;; n += stride) {
            char *ref = kind == K_CHAT_MISS || kind == K_COMPLETION ? must_answer(off_port, kind, n)
                                                                    : strdup(g_ref_hit);
            if (!ref) {
                out->bad++;
                break;
            }
            kvt_ts_resp r;
            double ms;
            arm((long)n);
            send_kind(port, kind, n, &r, &ms);
            usleep(2000); /* work after the answer (the put, the write-behind) is still on the path */
            int injected = disarm();
            long calls = atomic_load(&g_count);
            char *text = NULL, why[300], fn[128];
            int a = classify(kind, &r, &text, why, sizeof why);
            const char *owner = injected ? site_owner(fn, sizeof fn) : "-";
            kvt_ts_resp_free(&r);
            if (!injected) {
                out->allocations[kind] = calls;
                if (a != A_OK || strcmp(text, ref)) {
                    fprintf(stderr, "serve_oom: %s: no fault injected and still: %s\n", kind_names[kind], why);
                    out->bad++;
                }
                free(text);
                free(ref);
                break;
            }
            out->failed[kind]++;
            if (ms >= 9500) {
                a = A_BAD;
                snprintf(why, sizeof why, "hung (%.0f ms)", ms);
            }
            if (a == A_OK && strcmp(text, ref)) {
                a = A_BAD;
                snprintf(why, sizeof why, "a wrong reply \"%s\" (want \"%s\")", text, ref);
            }
            if (a == A_DROPPED && strcmp(owner, "libmicrohttpd")) {
                a = A_BAD;
                snprintf(why + strlen(why), sizeof why - strlen(why), " (no answer though the failure was not in "
                         "libmicrohttpd)");
            }
            if (a == A_OK)
                out->ok[kind]++;
            else if (a == A_ERROR)
                out->errors[kind]++;
            else if (a == A_DROPPED)
                out->dropped[kind]++;
            else
                out->bad++;
            if (a == A_BAD || verbose)
                fprintf(a == A_BAD ? stderr : stdout, "serve_oom: %s: allocation %lld failed (%s %s): %s%s\n",
                        kind_names[kind], (long long)n, owner, fn,
                        a == A_OK ? "200, the right reply" : a == A_ERROR ? "error: " : a == A_DROPPED ? "" : "BAD: ",
                        a == A_OK ? "" : why);
            if (a == A_BAD && getenv("KVT_TEST_VERBOSE"))
                for (int i = 0; i < g_site_n; i++) { /* addr2line -e <file> <offset> */
                    Dl_info di;
                    if (dladdr(g_site[i], &di) && di.dli_fname)
                        fprintf(stderr, "    %s +0x%lx\n", di.dli_fname,
                                (unsigned long)((char *)g_site[i] - (char *)di.dli_fbase));
                }
            free(text);
            /* the server keeps serving: the same request, unfaulted */
            char *again = must_answer(port, kind, n);
            if (!again || strcmp(again, ref)) {
                fprintf(stderr, "serve_oom: %s: after allocation %lld failed, the same request gave %s\n",
                        kind_names[kind], (long long)n, again ? again : "no reply");
                out->bad++;
            }
            free(again);
            free(ref);
        }
    }
    free(g_ref_hit);
    rc = 0;
out:
    kvt_server_destroy(srv);
    kvt_server_destroy(off);
    free(g_turn1);
    g_turn1 = NULL;
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "serve_oom: cannot remove %s\n", tmp);
    return rc;
}

#else /* sanitizer build: they own malloc */

static int serve_oom_walk(int64_t stride, uint64_t seed, int verbose, serve_oom_report *out)
{
    (void)stride;
    (void)seed;
    (void)verbose;
    memset(out, 0, sizeof *out);
    printf("serve_oom: skipped: the sanitizer owns malloc in this build\n");
    return 77;
}

#endif

/* ---- the test ---------------------------------------------------------------------- */

static void oom_walk(void **state)
{
    (void)state;
    serve_oom_report r;
    int rc = serve_oom_walk(1, 0, getenv("KVT_TEST_VERBOSE") != NULL, &r);
    if (rc == 77) {
        skip();
        return;
    }
    assert_int_equal(rc, 0);
    int64_t failed = 0;
    for (int k = 0; k < SERVE_OOM_KINDS; k++) {
        printf("  %-24s %5lld allocations a request; %4lld failed: %4lld answered right, %4lld with an error, "
               "%3lld connections closed (libmicrohttpd)\n",
               r.kind[k], (long long)r.allocations[k], (long long)r.failed[k], (long long)r.ok[k],
               (long long)r.errors[k], (long long)r.dropped[k]);
        assert_true(r.allocations[k] > 0);
        assert_true(r.failed[k] > 0);
        failed += r.failed[k];
    }
    assert_int_equal(r.bad, 0);
    assert_true(failed >= 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(oom_walk)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
