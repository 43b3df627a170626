/*
 * test_service.c: the cache service (kvtier/service.h): namespaces with
 * adapter identity and version, KV projection per growth kind, admission
 * (position limit, budget alone, waiting beside others, blocking admit with
 * a timeout and across threads), acquire/publish through the prompt cache
 * (fresh state, reuse, namespace isolation, no_reuse, cache off), the
 * report as a struct and as JSON (every counter of the prompt cache and the
 * service by its one list, and each level of a tier chain), execution
 * boundaries under a pressure check, and close.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/service.h"
#include "kvtier/prompt_cache.h"
#include "kvtier/tier_chain.h"
#include "mem_tier.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- a small fake model: layer 0 kv (d 4, B 16), layer 1 window W 8 (d 4),
 * layer 2 recurrent (64 bytes) ------------------------------------------------ */

#define D 4
#define W 8
#define REC 64

static int new_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    int rc = kvt_kv_create(D, 16, &c[0]);
    if (!rc)
        rc = kvt_rotating_create(D, W, 0, &c[1]);
    if (!rc)
        rc = kvt_recurrent_create(REC, &c[2]);
    if (rc)
        kvt_caches_destroy(c, 3);
    return rc;
}

static const kvt_service_layer layers[3] = {
    {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * D * 4, .block_tokens = 16},
    {.growth = KVT_GROWTH_WINDOW, .bytes_per_token = 2 * D * 4, .window = W},
    {.growth = KVT_GROWTH_FIXED, .fixed_bytes = REC},
};

static kvt_service *make(uint64_t pc_bytes, uint64_t budget, int64_t max_pos)
{
    kvt_service_config cfg = {.n_layers = 3, .layers = layers, .max_positions = max_pos,
                              .new_caches = new_caches, .prompt_cache_bytes = pc_bytes,
                              .kv_budget_bytes = budget, .block_tokens = 16};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    assert_non_null(s);
    return s;
}

/* Appends tokens [from, to) of deterministic state to the three caches. */
static void run_tokens(kvt_cache **c, int64_t from, int64_t to)
{
    for (int64_t t = from; t < to; t++) {
        float k[D], v[D];
        for (int j = 0; j < D; j++) {
            k[j] = (float)(t * 10 + j);
            v[j] = -(float)(t * 10 + j);
        }
        const void *in[2] = {k, v};
        assert_int_equal(kvt_cache_append(c[0], 1, in), 0);
        assert_int_equal(kvt_cache_append(c[1], 1, in), 0);
        unsigned char st[REC];
        memset(st, (int)(t & 0xff), sizeof st);
        const void *rin[1] = {st};
        assert_int_equal(kvt_cache_append(c[2], 1, rin), 0);
    }
}

/* ---- namespaces ---------------------------------------------------------------- */

static void test_namespaces(void **state)
{
    (void)state;
    char b[64];
    assert_int_equal(kvt_service_ns(NULL, "3", b, sizeof b), 0);
    assert_string_equal(b, "");
    assert_int_equal(kvt_service_ns("", NULL, b, sizeof b), 0);
    assert_string_equal(b, "");
    assert_int_equal(kvt_service_ns("fr", "2", b, sizeof b), 0);
    assert_string_equal(b, "fr@2");
    char b3[64];
    assert_int_equal(kvt_service_ns("fr", "3", b3, sizeof b3), 0);
    assert_string_not_equal(b, b3); /* another version: another namespace */
    assert_int_equal(kvt_service_ns("fr", NULL, b, sizeof b), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "needs a version"));
    assert_int_equal(kvt_service_ns("fr", "", b, sizeof b), KVT_EINVAL);
    assert_int_equal(kvt_service_ns("a@1", "2", b, sizeof b), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "'@'"));
    assert_int_equal(kvt_service_ns("object:x", "1", b, sizeof b), KVT_EINVAL);
    assert_int_equal(kvt_service_ns("a\nb", "1", b, sizeof b), KVT_EINVAL);
    assert_int_equal(kvt_service_ns("a", "1\t", b, sizeof b), KVT_EINVAL);
    /* a namespace is UTF-8 text (tiers write it in JSON metadata) */
    assert_int_equal(kvt_service_ns("\xff\xfe", "1", b, sizeof b), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "UTF-8"));
    assert_int_equal(kvt_service_ns("fr", "1\xc3", b, sizeof b), KVT_EINVAL);
    assert_int_equal(kvt_service_ns("fr", "\xc0\xaf", b, sizeof b), KVT_EINVAL); /* overlong */
    assert_int_equal(kvt_service_ns("caf\xc3\xa9", "\xe2\x82\xac" "1", b, sizeof b), 0);
    assert_string_equal(b, "caf\xc3\xa9@\xe2\x82\xac" "1");
    char tiny[4];
    assert_int_equal(kvt_service_ns("lora", "1", tiny, sizeof tiny), KVT_ERANGE);
    assert_string_equal(tiny, "");
    assert_int_equal(kvt_service_ns("a", "1", NULL, 0), KVT_EINVAL);
}

/* ---- projection and admission -------------------------------------------------------- */

static void test_projection(void **state)
{
    (void)state;
    kvt_service *s = make(0, 0, 1000);
    /* n = 0: only the recurrent state. */
    assert_int_equal(kvt_service_project_bytes(s, 0), REC);
    /* n = 1: one whole kv block of 16 tokens, one window slot, the state. */
    assert_int_equal(kvt_service_project_bytes(s, 1), 16 * 32 + 1 * 32 + REC);
    /* n = 20: two kv blocks, the window capped at 8 tokens. */
    assert_int_equal(kvt_service_project_bytes(s, 20), 32 * 32 + 8 * 32 + REC);
    assert_int_equal(kvt_service_project_bytes(s, 32), 32 * 32 + 8 * 32 + REC);
    assert_int_equal(kvt_service_project_bytes(s, 33), 48 * 32 + 8 * 32 + REC);
    kvt_service_destroy(s);
}

static void test_bad_config(void **state)
{
    (void)state;
    kvt_service *s = (kvt_service *)1;
    kvt_service_layer bad[1] = {{.growth = KVT_GROWTH_WINDOW, .bytes_per_token = 8, .window = 0}};
    kvt_service_config cfg = {.n_layers = 1, .layers = bad, .max_positions = 10, .new_caches = new_caches};
    assert_int_equal(kvt_service_create(&cfg, &s), KVT_EINVAL);
    assert_null(s);
    assert_non_null(strstr(kvt_last_error(), "layer 0"));
    cfg.layers = layers;
    cfg.n_layers = 0;
    assert_int_equal(kvt_service_create(&cfg, &s), KVT_EINVAL);
    cfg.n_layers = 3;
    cfg.max_positions = 0;
    assert_int_equal(kvt_service_create(&cfg, &s), KVT_EINVAL);
    cfg.max_positions = 10;
    cfg.new_caches = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), KVT_EINVAL);
    assert_int_equal(kvt_service_create(NULL, &s), KVT_EINVAL);
}

static int32_t prompt100[100];

static void test_admit_context_limit(void **state)
{
    (void)state;
    kvt_service *s = make(0, 0, 100);
    kvt_request r = {.prompt = prompt100, .n_prompt = 60, .max_tokens = 50};
    kvt_admission *a = (kvt_admission *)1;
    assert_int_equal(kvt_service_admit(s, &r, &a), KVT_ELIMIT);
    assert_null(a);
    const char *msg = kvt_last_error();
    assert_non_null(strstr(msg, "prompt 60"));
    assert_non_null(strstr(msg, "max_tokens 50"));
    assert_non_null(strstr(msg, "100 positions"));
    assert_int_equal(kvt_service_fits(s, &r), KVT_ELIMIT);
    r.max_tokens = 41; /* one position over the limit */
    assert_int_equal(kvt_service_fits(s, &r), KVT_ELIMIT);
    r.max_tokens = 40; /* exactly the limit */
    assert_int_equal(kvt_service_fits(s, &r), 1);
    assert_int_equal(kvt_service_admit(s, &r, &a), 0);
    assert_non_null(a);
    kvt_service_release(s, a, 1);
    /* malformed requests */
    r.n_prompt = 0;
    assert_int_equal(kvt_service_admit(s, &r, &a), KVT_EINVAL);
    r.n_prompt = 5;
    r.max_tokens = -1;
    assert_int_equal(kvt_service_admit(s, &r, &a), KVT_EINVAL);
    kvt_service_stats rep;
    assert_int_equal(kvt_service_get_stats(s, &rep), 0);
    assert_int_equal(rep.rejected, 1); /* fits() asked, admit() refused once */
    kvt_service_destroy(s);
}

static void test_admit_budget(void **state)
{
    (void)state;
    /* 20 + 12 = 32 tokens: 32*32 + 8*32 + 64 = 1344 bytes per request. */
    const uint64_t one = 32 * 32 + 8 * 32 + REC;
    kvt_service *s = make(0, 2 * one + 10, 1000);
    kvt_request r = {.prompt = prompt100, .n_prompt = 20, .max_tokens = 12};
    assert_int_equal(kvt_service_project_bytes(s, 32), one);
    kvt_admission *a1 = NULL, *a2 = NULL, *a3 = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a1), 0);
    assert_int_equal(kvt_service_admit(s, &r, &a2), 0);
    assert_int_equal(kvt_service_fits(s, &r), 0);
    assert_int_equal(kvt_service_admit(s, &r, &a3), KVT_EAGAIN); /* waits: does not fit beside two */
    assert_null(a3);
    kvt_service_stats rep;
    kvt_service_get_stats(s, &rep);
    assert_int_equal(rep.admitted, 2);
    assert_int_equal(rep.kv_projected_bytes, 2 * one);
    assert_int_equal(rep.kv_budget_bytes, 2 * one + 10);
    assert_int_equal(rep.waited, 1);
    /* a request over the whole budget alone is an error only when alone */
    kvt_request big = {.prompt = prompt100, .n_prompt = 100, .max_tokens = 500};
    assert_int_equal(kvt_service_admit(s, &big, &a3), KVT_EAGAIN);
    kvt_service_release(s, a1, 1);
    assert_int_equal(kvt_service_fits(s, &r), 1);
    kvt_service_release(s, a2, 1);
    kvt_service_get_stats(s, &rep);
    assert_int_equal(rep.admitted, 0);
    assert_int_equal(rep.kv_projected_bytes, 0);
    assert_int_equal(kvt_service_admit(s, &big, &a3), KVT_ELIMIT);
    const char *msg = kvt_last_error();
    char need[64];
    snprintf(need, sizeof need, "needs %llu bytes", (unsigned long long)kvt_service_project_bytes(s, 600));
    assert_non_null(strstr(msg, need));
    assert_non_null(strstr(msg, "lower max_tokens"));
    /* the library names its own option, never a command's flag */
    assert_non_null(strstr(msg, "kvt_service_config.kv_budget_bytes"));
    assert_null(strstr(msg, "--kv-budget"));
    kvt_service_destroy(s);
}

static void test_admit_wait_timeout(void **state)
{
    (void)state;
    const uint64_t one = 32 * 32 + 8 * 32 + REC;
    kvt_service *s = make(0, one, 1000);
    kvt_request r = {.prompt = prompt100, .n_prompt = 20, .max_tokens = 12};
    kvt_admission *a1 = NULL, *a2 = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a1), 0);
    uint64_t t0 = kvt_now_ms();
    assert_int_equal(kvt_service_admit_wait(s, &r, 50, &a2), KVT_EAGAIN);
    uint64_t dt = kvt_now_ms() - t0;
    assert_true(dt >= 45);
    assert_true(dt < 5000);
    assert_null(a2);
    kvt_service_release(s, a1, 1);
    kvt_service_destroy(s);
}

typedef struct {
    kvt_service *s;
    kvt_request *r;
    int rc;
    kvt_admission *a;
} waiter;

static void *wait_thread(void *arg)
{
    waiter *w = arg;
    w->rc = kvt_service_admit_wait(w->s, w->r, -1, &w->a);
    return NULL;
}

static void test_admit_wait_release(void **state)
{
    (void)state;
    const uint64_t one = 32 * 32 + 8 * 32 + REC;
    kvt_service *s = make(0, one, 1000);
    kvt_request r = {.prompt = prompt100, .n_prompt = 20, .max_tokens = 12};
    kvt_admission *a1 = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a1), 0);
    waiter w = {.s = s, .r = &r, .rc = 1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, wait_thread, &w), 0);
    /* let the waiter block, then make room */
    for (int i = 0; i < 100; i++) {
        kvt_service_stats rep;
        kvt_service_get_stats(s, &rep);
        if (rep.waited > 0)
            break;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    kvt_service_release(s, a1, 1);
    pthread_join(th, NULL);
    assert_int_equal(w.rc, 0);
    assert_non_null(w.a);
    kvt_service_stats rep;
    kvt_service_get_stats(s, &rep);
    assert_int_equal(rep.admitted, 1);
    kvt_service_release(s, w.a, 1);
    kvt_service_destroy(s);
}

/* ---- acquire / publish ---------------------------------------------------------------- */

static int32_t toks[64];

static void setup_tokens(void)
{
    for (int i = 0; i < 64; i++)
        toks[i] = 100 + i;
}

/* Admits and acquires a request for toks[0..n) in ns; returns the state. */
static kvt_admission *start(kvt_service *s, int64_t n, const char *ns, const char *session, int no_reuse,
                            kvt_state *st)
{
    kvt_request r = {.prompt = toks, .n_prompt = n, .max_tokens = 4, .ns = ns, .session = session,
                     .no_reuse = no_reuse};
    kvt_admission *a = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a), 0);
    assert_int_equal(kvt_service_acquire(s, a, st), 0);
    assert_int_equal(st->n_layers, 3);
    for (int i = 0; i < 3; i++)
        assert_non_null(st->caches[i]);
    return a;
}

static void test_acquire_publish_reuse(void **state)
{
    (void)state;
    setup_tokens();
    kvt_service *s = make(1 << 20, 0, 1000);
    /* a miss: fresh caches */
    kvt_state st;
    kvt_admission *a = start(s, 6, "", "s1", 0, &st);
    assert_int_equal(st.reused_tokens, 0);
    assert_int_equal(kvt_cache_offset(st.caches[0]), 0);
    assert_int_equal(kvt_service_keeps(s, a), 1);
    run_tokens(st.caches, 0, 6);
    /* wrong token count is refused and ownership stays */
    assert_int_equal(kvt_service_publish(s, a, toks, 5, &st), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "holds 6 tokens"));
    assert_non_null(st.caches);
    assert_int_equal(kvt_service_publish(s, a, toks, 6, &st), 0);
    assert_null(st.caches); /* adopted */
    kvt_service_release(s, a, 1);
    assert_int_equal(kvt_service_peek(s, toks, 10, ""), 6);

    /* The entry (recurrent layer: untrimmable) serves a prompt extending it. */
    a = start(s, 10, "", "s1", 0, &st);
    assert_int_equal(st.reused_tokens, 6);
    assert_int_equal(kvt_cache_offset(st.caches[0]), 6);
    assert_int_equal(kvt_cache_offset(st.caches[2]), 6);
    const unsigned char *rs = kvt_recurrent_state(st.caches[2]);
    assert_int_equal(rs[0], 5); /* the state after token 5 */
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);

    /* Another namespace, or another version of an adapter, never reuses it. */
    a = start(s, 10, "fr@1", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 0);
    run_tokens(st.caches, 0, 10);
    assert_int_equal(kvt_service_publish(s, a, toks, 10, &st), 0);
    kvt_service_release(s, a, 1);
    a = start(s, 12, "fr@2", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 0);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    a = start(s, 12, "fr@1", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 10);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);

    /* A request without prefix identity reuses nothing and keeps nothing. */
    a = start(s, 10, "", NULL, 1, &st);
    assert_int_equal(st.reused_tokens, 0);
    assert_int_equal(kvt_service_keeps(s, a), 0);
    run_tokens(st.caches, 0, 10);
    assert_int_equal(kvt_service_publish(s, a, toks, 10, &st), KVT_EUNSUPPORTED);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);

    kvt_service_stats rep;
    assert_int_equal(kvt_service_get_stats(s, &rep), 0);
    assert_int_equal(rep.acquires, 6);
    assert_int_equal(rep.reused_tokens, 16);
    assert_int_equal(rep.publishes, 2);
    assert_int_equal(rep.entries, 2);
    assert_true(rep.bytes > 0);
    assert_int_equal(rep.max_bytes, 1 << 20);
    assert_true(rep.hits >= 2);
    kvt_service_destroy(s);
}

static void test_cache_off(void **state)
{
    (void)state;
    setup_tokens();
    kvt_service *s = make(0, 0, 1000);
    kvt_state st;
    kvt_admission *a = start(s, 6, "", NULL, 0, &st);
    assert_int_equal(kvt_service_keeps(s, a), 0);
    run_tokens(st.caches, 0, 6);
    assert_int_equal(kvt_service_publish(s, a, toks, 6, &st), KVT_EUNSUPPORTED);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    a = start(s, 8, "", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 0);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    assert_int_equal(kvt_service_peek(s, toks, 8, ""), 0);
    kvt_service_destroy(s);
}

/* ---- report JSON and close -------------------------------------------------------------- */

/* The report's JSON document, parsed. */
static json_t *report_doc(kvt_service *s)
{
    char *text = NULL;
    assert_int_equal(kvt_service_stats_json(s, &text), 0);
    json_error_t err;
    json_t *doc = json_loads(text, 0, &err);
    assert_non_null(doc);
    kvt_string_free(text);
    return doc;
}

static void test_report_json_close(void **state)
{
    (void)state;
    setup_tokens();
    kvt_service *s = make(1 << 20, 100000, 1000);
    kvt_state st;
    kvt_admission *a = start(s, 6, "", NULL, 0, &st);
    json_t *doc = report_doc(s);
    json_t *kv = json_object_get(doc, "kv");
    assert_int_equal(json_integer_value(json_object_get(kv, "projected_bytes")),
                     (json_int_t)kvt_service_project_bytes(s, 10));
    assert_int_equal(json_integer_value(json_object_get(kv, "budget_bytes")), 100000);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(doc, "requests"), "admitted")), 1);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(doc, "prefixes"), "max_bytes")), 1 << 20);
    json_decref(doc);
    run_tokens(st.caches, 0, 6);
    assert_int_equal(kvt_service_publish(s, a, toks, 6, &st), 0);

    assert_int_equal(kvt_service_close(s), 0);
    assert_int_equal(kvt_service_close(s), 0); /* idempotent */
    kvt_service_stats rep;
    kvt_service_get_stats(s, &rep);
    assert_int_equal(rep.entries, 0); /* cleared */
    kvt_request r = {.prompt = toks, .n_prompt = 4, .max_tokens = 1};
    kvt_admission *b = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &b), KVT_ECLOSED);
    kvt_state st2;
    assert_int_equal(kvt_service_acquire(s, a, &st2), KVT_ECLOSED);
    kvt_service_release(s, a, 0); /* still valid after close */
    kvt_service_destroy(s);

    /* unlimited budget reports null */
    s = make(0, 0, 1000);
    doc = report_doc(s);
    assert_true(json_is_null(json_object_get(json_object_get(doc, "kv"), "budget_bytes")));
    json_decref(doc);
    kvt_service_destroy(s);
    kvt_service_destroy(NULL);
}

/* ---- cold tier: idle demotion, graceful close ---------------------------------------------- */

static void test_cold_tier_demote_and_close(void **state)
{
    (void)state;
    setup_tokens();
    mem_tier *mt = NULL;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_service_config cfg = {.n_layers = 3, .layers = layers, .max_positions = 1000, .new_caches = new_caches,
                              .prompt_cache_bytes = 1 << 20, .block_tokens = 16, .cold = mem_tier_iface(mt),
                              .demote_idle_ms = 20};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    kvt_state st;
    kvt_admission *a = start(s, 10, "", "c", 0, &st);
    run_tokens(st.caches, 0, 10);
    assert_int_equal(kvt_service_publish(s, a, toks, 10, &st), 0);
    kvt_service_release(s, a, 1);
    /* the demoter thread moves the idle entry to the cold tier */
    kvt_service_stats rep;
    for (int i = 0; i < 200; i++) {
        mem_tier_drain(mt);
        kvt_service_get_stats(s, &rep);
        if (rep.entries == 0 && rep.demotions > 0)
            break;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(rep.entries, 0);
    assert_true(rep.demotions >= 1);
    assert_true(mem_tier_has(mt, "", toks, 10));
    /* and the next request gets it back from there */
    a = start(s, 14, "", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 10);
    kvt_service_get_stats(s, &rep);
    assert_int_equal(rep.cold_restores, 1);
    run_tokens(st.caches, 10, 14);
    assert_int_equal(kvt_service_publish(s, a, toks, 14, &st), 0);
    kvt_service_release(s, a, 1);
    assert_int_equal(kvt_service_flush(s), 0);
    /* prefetch: the demoted entry comes back to RAM before the request */
    for (int i = 0; i < 200; i++) {
        mem_tier_drain(mt);
        kvt_service_get_stats(s, &rep);
        if (rep.entries == 0)
            break;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(rep.entries, 0);
    assert_int_equal(kvt_service_peek(s, toks, 20, ""), 0);
    kvt_lease *pl = NULL;
    assert_int_equal(kvt_service_prefetch(s, toks, 20, "", NULL, &pl), 0);
    assert_non_null(pl);
    assert_int_equal(kvt_lease_wait(pl, UINT64_MAX), 0);
    assert_int_equal(kvt_service_peek(s, toks, 20, ""), 14);
    a = start(s, 20, "", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 14);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    kvt_lease_release(pl);
    /* close hands what RAM holds to the cold tier and flushes it */
    mem_tier_manual_spills(mt, 0);
    assert_int_equal(kvt_service_close(s), 0);
    mem_tier_drain(mt);
    assert_true(mem_tier_has(mt, "", toks, 14));
    kvt_service_get_stats(s, &rep);
    assert_int_equal(rep.entries, 0);
    kvt_service_destroy(s);
    mem_tier_destroy(mt);
}

/* ---- several threads sharing one service ------------------------------------------------ */

typedef struct {
    kvt_service *s;
    int id;
    int fails;
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    char session[16];
    snprintf(session, sizeof session, "w%d", w->id);
    for (int it = 0; it < 40; it++) {
        int64_t n = 8 + (it % 5) * 4 + w->id;
        kvt_request r = {.prompt = toks, .n_prompt = n, .max_tokens = 4, .session = session};
        kvt_admission *a = NULL;
        kvt_state st;
        if (kvt_service_admit_wait(w->s, &r, -1, &a) || kvt_service_acquire(w->s, a, &st)) {
            w->fails++;
            kvt_service_release(w->s, a, 0);
            continue;
        }
        int64_t R = st.reused_tokens;
        if (R >= n || kvt_cache_offset(st.caches[0]) != R)
            w->fails++;
        run_tokens(st.caches, R, n);
        if (kvt_service_publish(w->s, a, toks, n, &st))
            w->fails++;
        kvt_state_clear(&st);
        (void)kvt_service_peek(w->s, toks, n, "");
        kvt_service_release(w->s, a, 1);
    }
    return NULL;
}

/* close flushes the cold tier without holding the service mutex: report
 * answers during a slow flush, and a second close returns only after the
 * first has finished (it held the mutex across the flush before). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int in_flush, open;
    kvt_cold_tier real;
} slow = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, {0}};

static int slow_flush(void *self)
{
    pthread_mutex_lock(&slow.mu);
    slow.in_flush = 1;
    pthread_cond_broadcast(&slow.cv);
    while (!slow.open)
        pthread_cond_wait(&slow.cv, &slow.mu);
    pthread_mutex_unlock(&slow.mu);
    return slow.real.flush(self);
}

static void *close_thread(void *arg)
{
    return (void *)(intptr_t)kvt_service_close(arg);
}

static void test_close_flushes_outside_the_mutex(void **state)
{
    (void)state;
    setup_tokens();
    mem_tier *mt = NULL;
    assert_int_equal(mem_tier_create(&mt), 0);
    slow.real = *mem_tier_iface(mt);
    kvt_cold_tier tier = slow.real;
    tier.flush = slow_flush;
    kvt_service_config cfg = {.n_layers = 3, .layers = layers, .max_positions = 1000, .new_caches = new_caches,
                              .prompt_cache_bytes = 1 << 20, .block_tokens = 16, .cold = &tier};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    kvt_state st;
    kvt_admission *a = start(s, 10, "", NULL, 0, &st);
    run_tokens(st.caches, 0, 10);
    assert_int_equal(kvt_service_publish(s, a, toks, 10, &st), 0);
    kvt_service_release(s, a, 1);
    pthread_t t1, t2;
    assert_int_equal(pthread_create(&t1, NULL, close_thread, s), 0);
    pthread_mutex_lock(&slow.mu);
    while (!slow.in_flush)
        pthread_cond_wait(&slow.cv, &slow.mu);
    pthread_mutex_unlock(&slow.mu);
    /* the first close is inside the flush: report must answer now */
    kvt_service_stats rep;
    assert_int_equal(kvt_service_get_stats(s, &rep), 0);
    kvt_request r = {.prompt = toks, .n_prompt = 10, .max_tokens = 4, .ns = ""};
    kvt_admission *none = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &none), KVT_ECLOSED);
    assert_int_equal(pthread_create(&t2, NULL, close_thread, s), 0);
    pthread_mutex_lock(&slow.mu);
    slow.open = 1;
    pthread_cond_broadcast(&slow.cv);
    pthread_mutex_unlock(&slow.mu);
    void *r1, *r2;
    pthread_join(t2, &r2);
    /* the second close returned: the first's flush and clear are done */
    assert_int_equal(kvt_service_get_stats(s, &rep), 0);
    assert_int_equal(rep.entries, 0);
    assert_true(mem_tier_has(mt, "", toks, 10));
    pthread_join(t1, &r1);
    assert_int_equal((intptr_t)r1, 0);
    assert_int_equal((intptr_t)r2, 0);
    kvt_service_destroy(s);
    mem_tier_destroy(mt);
}

static void test_concurrent_requests(void **state)
{
    (void)state;
    setup_tokens();
    /* room for two requests at a time (each <= 48 tokens: 48*32 + 8*32 + 64) */
    const uint64_t one = 48 * 32 + 8 * 32 + REC;
    kvt_service *s = make(1 << 16, 2 * one, 1000);
    enum { T = 4 };
    pthread_t th[T];
    worker w[T];
    for (int i = 0; i < T; i++) {
        w[i] = (worker){.s = s, .id = i};
        assert_int_equal(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(w[i].fails, 0);
    }
    kvt_service_stats rep;
    kvt_service_get_stats(s, &rep);
    assert_int_equal(rep.acquires, T * 40);
    assert_int_equal(rep.publishes, T * 40);
    assert_int_equal(rep.admitted, 0);
    assert_int_equal(rep.kv_projected_bytes, 0);
    assert_true(rep.reused_tokens > 0);
    assert_true(rep.bytes <= 1 << 16);
    kvt_service_destroy(s);
}

/* ---- the report's lists, and the tiers of a chain ------------------------------------------ */

/* Every name of the counter lists is in the JSON with the struct's value. */
static void check_report_lists(kvt_service *s, json_t *doc)
{
    kvt_service_stats r;
    assert_int_equal(kvt_service_get_stats(s, &r), 0);
    json_t *prefixes = json_object_get(doc, "prefixes"), *requests = json_object_get(doc, "requests"),
           *kv = json_object_get(doc, "kv");
    assert_non_null(prefixes);
    assert_non_null(requests);
    assert_non_null(kv);
#define CHECK_PC(type, name, kind, help)                                                           \
    assert_non_null(json_object_get(prefixes, #name));                                             \
    assert_int_equal(json_integer_value(json_object_get(prefixes, #name)), (json_int_t)r.name);
    KVT_PROMPT_CACHE_COUNTERS(CHECK_PC)
#undef CHECK_PC
#define CHECK_SVC(name, group, key, kind, help)                                                    \
    assert_non_null(json_object_get(group, #key));                                                 \
    if (!json_is_null(json_object_get(group, #key)))                                               \
        assert_int_equal(json_integer_value(json_object_get(group, #key)), (json_int_t)r.name);
    KVT_SERVICE_COUNTERS(CHECK_SVC)
#undef CHECK_SVC
    json_t *tiers = json_object_get(doc, "tiers");
    assert_true(json_is_array(tiers));
    assert_int_equal(json_array_size(tiers), kvt_service_tier_count(s));
    for (int32_t i = 0; i < kvt_service_tier_count(s); i++) {
        kvt_tier_stats t;
        assert_int_equal(kvt_service_tier_stats(s, i, &t), 0);
        json_t *o = json_array_get(tiers, (size_t)i);
        assert_int_equal(json_integer_value(json_object_get(o, "level")), i);
#define CHECK_TIER(name, kind, help) assert_int_equal(json_integer_value(json_object_get(o, #name)), (json_int_t)t.name);
        KVT_TIER_COUNTERS(CHECK_TIER)
#undef CHECK_TIER
    }
}

static int64_t tier_field(json_t *doc, size_t level, const char *name)
{
    return json_integer_value(json_object_get(json_array_get(json_object_get(doc, "tiers"), level), name));
}

static void test_report_tiers_of_a_chain(void **state)
{
    (void)state;
    setup_tokens();
    /* RAM only: no tiers */
    kvt_service *s = make(1 << 20, 0, 1000);
    json_t *doc = report_doc(s);
    check_report_lists(s, doc);
    assert_int_equal(json_array_size(json_object_get(doc, "tiers")), 0);
    json_decref(doc);
    kvt_tier_stats ts;
    assert_int_equal(kvt_service_tier_stats(s, 0, &ts), KVT_EINVAL);
    kvt_service_destroy(s);

    /* a chain of two in-memory tiers: the entry is only in the lower one */
    mem_tier *top = NULL, *low = NULL;
    assert_int_equal(mem_tier_create(&top), 0);
    assert_int_equal(mem_tier_create(&low), 0);
    kvt_entry e;
    assert_int_equal(kvt_entry_init(&e, "", toks, 10, 3, 0), 0);
    assert_int_equal(new_caches(NULL, e.caches), 0);
    run_tokens(e.caches, 0, 10);
    assert_int_equal(mem_tier_insert(low, &e), 0);
    kvt_tier_level lv[2] = {{.tier = *mem_tier_iface(top)}, {.tier = *mem_tier_iface(low)}};
    kvt_tier_chain_config cc = {.levels = lv, .n_levels = 2};
    kvt_tier_chain *chain = NULL;
    assert_int_equal(kvt_tier_chain_create(&cc, &chain), 0);
    kvt_cold_tier table;
    kvt_tier_chain_cold_tier(chain, &table);
    kvt_service_config cfg = {.n_layers = 3, .layers = layers, .max_positions = 1000, .new_caches = new_caches,
                              .prompt_cache_bytes = 1 << 20, .block_tokens = 16, .cold = &table,
                              .chain = chain};
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    assert_int_equal(kvt_service_tier_count(s), 2);
    kvt_state st;
    kvt_admission *a = start(s, 14, "", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 10); /* restored from level 1 */
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    assert_int_equal(kvt_tier_chain_drain(chain), 0); /* the promotion into level 0 is written */
    doc = report_doc(s);
    check_report_lists(s, doc);
    assert_int_equal(json_array_size(json_object_get(doc, "tiers")), 2);
    assert_int_equal(tier_field(doc, 1, "restores"), 1);
    assert_int_equal(tier_field(doc, 1, "find_hits"), 1);
    assert_int_equal(tier_field(doc, 1, "entries"), 1);
    assert_int_equal(tier_field(doc, 0, "restores"), 0);
    assert_int_equal(tier_field(doc, 0, "promotions"), 1);
    assert_int_equal(tier_field(doc, 0, "entries"), 1);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(doc, "prefixes"), "cold_restores")), 1);
    json_decref(doc);
    assert_int_equal(kvt_service_tier_stats(s, 2, &ts), KVT_EINVAL);
    kvt_service_destroy(s);
    kvt_tier_chain_destroy(chain);
    mem_tier_destroy(top);
    mem_tier_destroy(low);

    /* one cold tier, no chain: listed once, from its stats operation */
    assert_int_equal(mem_tier_create(&top), 0);
    cfg.cold = mem_tier_iface(top);
    cfg.chain = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    a = start(s, 6, "", NULL, 0, &st);
    run_tokens(st.caches, 0, 6);
    assert_int_equal(kvt_service_publish(s, a, toks, 6, &st), 0); /* written behind */
    kvt_service_release(s, a, 1);
    doc = report_doc(s);
    check_report_lists(s, doc);
    assert_int_equal(json_array_size(json_object_get(doc, "tiers")), 1);
    assert_int_equal(tier_field(doc, 0, "stores"), 1);
    json_decref(doc);
    kvt_service_destroy(s);
    mem_tier_destroy(top);
}

/* ---- execution boundaries ------------------------------------------------------------------ */

static int pressure_left; /* how many more checks say "over" */
static int pressure_calls;

static int pressure_n(void *ctx)
{
    assert_ptr_equal(ctx, &pressure_left);
    pressure_calls++;
    return pressure_left-- > 0;
}

/* One boundary while the check says "over" `over` times; the checks made. */
static int boundary_over(kvt_service *s, int over)
{
    pressure_left = over;
    pressure_calls = 0;
    kvt_service_boundary(s);
    return pressure_calls;
}

static void assert_ram(kvt_service *s, uint64_t entries, uint64_t demotions)
{
    kvt_service_stats rep;
    assert_int_equal(kvt_service_get_stats(s, &rep), 0);
    assert_int_equal(rep.entries, entries);
    assert_int_equal(rep.demotions, demotions);
}

static void publish_n(kvt_service *s, int64_t n, const char *ns)
{
    kvt_state st;
    kvt_admission *a = start(s, n, ns, NULL, 0, &st);
    run_tokens(st.caches + 0, st.reused_tokens, n);
    assert_int_equal(kvt_service_publish(s, a, toks, n, &st), 0);
    kvt_service_release(s, a, 1);
}

static void test_boundary(void **state)
{
    (void)state;
    setup_tokens();
    /* no pressure check: a boundary releases nothing */
    kvt_service *s = make(1 << 20, 0, 1000);
    publish_n(s, 6, "a@1");
    kvt_service_boundary(s);
    assert_ram(s, 1, 0);
    kvt_service_boundary(NULL);
    kvt_service_destroy(s);

    /* with one: while it says "over", retention victims leave RAM, no I/O */
    mem_tier *mt = NULL;
    assert_int_equal(mem_tier_create(&mt), 0);
    mem_tier_manual_spills(mt, 1); /* writes stay pending until drained */
    kvt_service_config cfg = {.n_layers = 3, .layers = layers, .max_positions = 1000, .new_caches = new_caches,
                              .prompt_cache_bytes = 1 << 20, .block_tokens = 16, .cold = mem_tier_iface(mt),
                              .pressure = pressure_n, .pressure_ctx = &pressure_left};
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    publish_n(s, 6, "a@1");
    publish_n(s, 6, "b@1");
    publish_n(s, 6, "c@1");
    /* every write is pending: a pending write is not a copy, nothing leaves */
    assert_int_equal(boundary_over(s, 2), 1);
    assert_ram(s, 3, 0);
    /* once durable, two victims leave (the oldest first); the third check passes */
    assert_int_equal(mem_tier_drain(mt), 3);
    int64_t writes = mem_tier_counts_get(mt).writes;
    assert_int_equal(boundary_over(s, 2), 3);
    assert_ram(s, 1, 2);
    assert_int_equal(mem_tier_counts_get(mt).writes, writes); /* no storage I/O at a boundary */
    assert_int_equal(kvt_service_peek(s, toks, 8, "a@1"), 0);
    assert_int_equal(kvt_service_peek(s, toks, 8, "b@1"), 0);
    assert_int_equal(kvt_service_peek(s, toks, 8, "c@1"), 6);
    /* after close a boundary does nothing */
    assert_int_equal(kvt_service_close(s), 0);
    assert_int_equal(boundary_over(s, 5), 0);
    kvt_service_destroy(s);
    mem_tier_destroy(mt);

    /* a running request is never changed: the entry it borrowed its prefix
     * from leaves RAM at a boundary, and the request's caches (sharing that
     * entry's blocks) keep every value, run on and publish */
    cfg.cold = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    publish_n(s, 20, "r@1");
    kvt_state st;
    kvt_admission *a = start(s, 30, "r@1", NULL, 0, &st);
    assert_int_equal(st.reused_tokens, 20);
    assert_int_equal(boundary_over(s, 5), 2); /* the one entry leaves, then the check passes */
    assert_ram(s, 0, 1);
    const float *k, *v;
    int32_t nt;
    assert_int_equal(kvt_cache_offset(st.caches[0]), 20);
    assert_int_equal(kvt_kv_block(st.caches[0], 0, &k, &v, &nt), 0);
    assert_int_equal(nt, 16);
    for (int t = 0; t < 16; t++)
        for (int j = 0; j < D; j++) {
            assert_true(k[t * D + j] == (float)(t * 10 + j));
            assert_true(v[t * D + j] == -(float)(t * 10 + j));
        }
    const unsigned char *rec = kvt_recurrent_state(st.caches[2]);
    for (int i = 0; i < REC; i++)
        assert_int_equal(rec[i], 19);
    run_tokens(st.caches, 20, 30);
    assert_int_equal(kvt_service_publish(s, a, toks, 30, &st), 0);
    kvt_service_release(s, a, 1);
    assert_ram(s, 1, 1);
    assert_int_equal(kvt_service_peek(s, toks, 31, "r@1"), 30);
    kvt_service_destroy(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_namespaces),
        cmocka_unit_test(test_projection),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_admit_context_limit),
        cmocka_unit_test(test_admit_budget),
        cmocka_unit_test(test_admit_wait_timeout),
        cmocka_unit_test(test_admit_wait_release),
        cmocka_unit_test(test_acquire_publish_reuse),
        cmocka_unit_test(test_cache_off),
        cmocka_unit_test(test_report_json_close),
        cmocka_unit_test(test_cold_tier_demote_and_close),
        cmocka_unit_test(test_close_flushes_outside_the_mutex),
        cmocka_unit_test(test_concurrent_requests),
        cmocka_unit_test(test_report_tiers_of_a_chain),
        cmocka_unit_test(test_boundary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
