/*
 * test_pool_service.c: cache services and SSD roots joined to one
 * process-wide pool (kvt_service_config.pool, kvt_store_options.pool).
 * Two SSD roots share the disk axis (a root whose budget does not fit is
 * refused before anything is created, naming the axis); two services share
 * the KV axis (a burst of admissions past the limit is refused naming the
 * axis, with exact high-water marks) and the RAM axis (a prompt cache grows
 * only as the pool grants, gives its share back, and never holds more than
 * it is charged); a sampling thread never sees an axis over its limit while
 * 8 threads run requests on both services; with write-behind held pending
 * (an in-memory cold tier that writes only when flushed) and the RAM axis
 * tight, no prompt cache holds more than it is charged, neither at a
 * sampling thread's moments nor at the moment each put hands its entry to
 * write-behind (sampled in the tier's spill, every time); reservations are dropped on every error path, with every
 * allocation of a request's life failed in turn.
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
#include <sys/stat.h>
#include <unistd.h>

#include "kvtier/pool.h"
#include "kvtier/remote.h"
#include "kvtier/service.h"
#include "kvtier/store.h"
#include "mem_tier.h"
#include "oom_alloc.h"
#include "redis_util.h"
#include "store_util.h"
#include "test_seed.h"

/* one kv layer, d 4, blocks of 16 tokens: 32 bytes a token, 512 a block */
#define D 4
#define B 16
#define REQ_BYTES 512u /* a request of 10 prompt + 6 generated tokens */

static int fail_new_caches; /* nonzero: new_caches fails (an acquire error path) */

static int new_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    if (fail_new_caches)
        return KVT_EIO;
    return kvt_kv_create(D, B, &c[0]);
}

static const kvt_service_layer layer = {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * D * 4,
                                        .block_tokens = B};

static kvt_pool *new_pool(uint64_t ram, uint64_t kv, uint64_t disk)
{
    kvt_pool_limits l = {{ram, kv, disk, 0}};
    kvt_pool *p = NULL;
    assert_int_equal(kvt_pool_create(&l, &p), 0);
    return p;
}

static int make_service(kvt_pool *p, const char *name, uint64_t pc_bytes, const kvt_cold_tier *cold,
                        kvt_service **out)
{
    kvt_service_config cfg = {.n_layers = 1, .layers = &layer, .max_positions = 4096, .new_caches = new_caches,
                              .prompt_cache_bytes = pc_bytes, .block_tokens = B, .cold = cold,
                              .pool = p, .pool_name = name};
    return kvt_service_create(&cfg, out);
}

static kvt_pool_usage axis_of(kvt_pool *p, kvt_pool_axis a)
{
    kvt_pool_report r;
    assert_int_equal(kvt_pool_report_get(p, &r), 0);
    return r.axis[a];
}

static kvt_pool_usage member_axis(kvt_pool *p, const char *name, kvt_pool_axis a)
{
    /* through the JSON report: members are named there */
    char *js = NULL;
    assert_int_equal(kvt_pool_report_json(p, &js), 0);
    json_t *doc = json_loads(js, 0, NULL);
    kvt_string_free(js);
    assert_non_null(doc);
    kvt_pool_usage u = {0};
    int found = 0;
    size_t i;
    json_t *m;
    json_array_foreach(json_object_get(doc, "member_list"), i, m)
    {
        if (strcmp(json_string_value(json_object_get(m, "name")), name) == 0) {
            json_t *x = json_object_get(json_object_get(m, "axes"), kvt_pool_axis_name(a));
            u.reserved = (uint64_t)json_integer_value(json_object_get(x, "reserved"));
            u.published = (uint64_t)json_integer_value(json_object_get(x, "published"));
            u.used = (uint64_t)json_integer_value(json_object_get(x, "used"));
            u.high_water = (uint64_t)json_integer_value(json_object_get(x, "high_water"));
            u.refusals = (uint64_t)json_integer_value(json_object_get(x, "refusals"));
            found = 1;
        }
    }
    json_decref(doc);
    assert_true(found);
    return u;
}

static int32_t toks[64];

static void fill_tokens(int32_t base)
{
    for (int i = 0; i < 64; i++)
        toks[i] = base + i;
}

/* Appends tokens [from, to) of deterministic state. */
static void run_tokens(kvt_cache *c, int64_t from, int64_t to)
{
    for (int64_t t = from; t < to; t++) {
        float k[D], v[D];
        for (int j = 0; j < D; j++) {
            k[j] = (float)(t * 10 + j);
            v[j] = -(float)(t * 10 + j);
        }
        const void *in[2] = {k, v};
        assert_int_equal(kvt_cache_append(c, 1, in), 0);
    }
}

/* One request's whole life: admit, acquire, prefill the prompt, publish,
 * release. Returns the admit error (nothing else may fail here). */
static int run_request(kvt_service *s, const int32_t *prompt, int64_t n)
{
    kvt_request r = {.prompt = prompt, .n_prompt = n, .max_tokens = 16 - n};
    kvt_admission *a = NULL;
    int rc = kvt_service_admit(s, &r, &a);
    if (rc)
        return rc;
    kvt_state st;
    assert_int_equal(kvt_service_acquire(s, a, &st), 0);
    run_tokens(st.caches[0], st.reused_tokens, n);
    assert_int_equal(kvt_service_publish(s, a, prompt, n, &st), 0);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    return 0;
}

static uint64_t pc_bytes_of(kvt_service *s)
{
    kvt_service_stats st;
    assert_int_equal(kvt_service_get_stats(s, &st), 0);
    return st.bytes;
}

static void open_root(kvt_pool *p, const char *tag, uint64_t max_bytes, char *root, size_t cap,
                      kvt_store **out, int want)
{
    char fp[KVT_STORE_FINGERPRINT_LEN];
    static const store_cfg cfg = {.n_kv = 1, .kv_dim = D, .block = B};
    kvt_store_identity id;
    store_identity(&cfg, "model-pool", fp, &id);
    store_tmpdir(root, cap, tag);
    store_rmtree(root); /* a refused open must not create the root */
    kvt_store_options o = {.max_bytes = max_bytes, .pool = p};
    *out = NULL;
    assert_int_equal(kvt_store_open(root, &id, &o, out), want);
}

/* ---- disk: two SSD roots share the axis ------------------------------------- */

static void test_two_roots_disk(void **state)
{
    (void)state;
    kvt_pool *p = new_pool(0, 0, 10000);
    char ra[512], rb[512], rc[512];
    kvt_store *a = NULL, *b = NULL, *c = NULL;
    open_root(p, "pool-a", 6000, ra, sizeof ra, &a, 0);
    /* 5000 do not fit beside 6000: refused naming the axis, nothing created */
    open_root(p, "pool-b", 5000, rb, sizeof rb, &b, KVT_EAGAIN);
    assert_null(b);
    const char *msg = kvt_last_error();
    assert_non_null(strstr(msg, "pool axis disk"));
    assert_non_null(strstr(msg, "asked for 5000 bytes, 4000 of the 10000-byte limit are free"));
    struct stat sb;
    assert_int_not_equal(stat(rb, &sb), 0);
    open_root(p, "pool-b", 4000, rb, sizeof rb, &b, 0);
    open_root(p, "pool-c", 20000, rc, sizeof rc, &c, KVT_ELIMIT);
    assert_non_null(strstr(kvt_last_error(), "pool axis disk"));
    open_root(p, "pool-c", 0, rc, sizeof rc, &c, KVT_EINVAL); /* an unlimited root cannot be charged */
    assert_non_null(strstr(kvt_last_error(), "byte budget"));
    kvt_pool_usage d = axis_of(p, KVT_POOL_DISK);
    assert_int_equal(d.used, 10000);
    assert_int_equal(d.published, 10000);
    assert_int_equal(d.high_water, 10000);
    assert_int_equal(d.refusals, 2);
    char name[600];
    snprintf(name, sizeof name, "ssd:%s", ra);
    assert_int_equal(member_axis(p, name, KVT_POOL_DISK).published, 6000);
    assert_int_equal(kvt_store_close(a), 0);
    d = axis_of(p, KVT_POOL_DISK);
    assert_int_equal(d.used, 4000);
    assert_int_equal(d.high_water, 10000);
    assert_int_equal(kvt_store_close(b), 0);
    assert_int_equal(axis_of(p, KVT_POOL_DISK).used, 0);
    kvt_pool_report r;
    kvt_pool_report_get(p, &r);
    assert_int_equal(r.members, 0);
    store_rmtree(ra);
    store_rmtree(rb);
    kvt_pool_destroy(p);
}

/* ---- KV: a burst over two services is refused at the limit ------------------ */

static void test_kv_burst_two_services(void **state)
{
    (void)state;
    kvt_pool *p = new_pool(0, 5 * REQ_BYTES, 0);
    kvt_service *s[2] = {NULL, NULL};
    assert_int_equal(make_service(p, "service:a", 0, NULL, &s[0]), 0);
    assert_int_equal(make_service(p, "service:b", 0, NULL, &s[1]), 0);
    kvt_service *dup = NULL;
    assert_int_equal(make_service(p, "service:a", 0, NULL, &dup), KVT_EBUSY);
    fill_tokens(100);
    kvt_request r = {.prompt = toks, .n_prompt = 10, .max_tokens = 6};
    assert_int_equal(kvt_service_project_bytes(s[0], 16), REQ_BYTES);
    kvt_admission *held[8] = {0};
    int n = 0;
    for (; n < 8; n++) {
        int rc = kvt_service_admit(s[n % 2], &r, &held[n]);
        if (rc) {
            assert_int_equal(rc, KVT_EAGAIN);
            break;
        }
        assert_int_equal(kvt_service_fits(s[(n + 1) % 2], &r), n + 1 < 5 ? 1 : 0);
    }
    assert_int_equal(n, 5); /* exactly what the limit holds */
    const char *msg = kvt_last_error();
    assert_non_null(strstr(msg, "pool axis kv"));
    assert_non_null(strstr(msg, "service:b"));
    assert_non_null(strstr(msg, "asked for 512 bytes, 0 of the 2560-byte limit are free"));
    kvt_pool_usage kv = axis_of(p, KVT_POOL_KV);
    assert_int_equal(kv.reserved, 5 * REQ_BYTES); /* admitted, not yet acquired */
    assert_int_equal(kv.used, 5 * REQ_BYTES);
    assert_int_equal(kv.high_water, 5 * REQ_BYTES);
    assert_int_equal(kv.refusals, 1);
    kvt_service_stats st;
    kvt_service_get_stats(s[1], &st);
    assert_int_equal(st.waited, 1);
    /* acquire publishes an admission's bytes; release gives them back */
    kvt_state cs;
    assert_int_equal(kvt_service_acquire(s[0], held[0], &cs), 0);
    kv = axis_of(p, KVT_POOL_KV);
    assert_int_equal(kv.reserved, 4 * REQ_BYTES);
    assert_int_equal(kv.published, REQ_BYTES);
    kvt_state_clear(&cs);
    for (int i = 0; i < n; i++)
        kvt_service_release(s[i % 2], held[i], 1);
    kv = axis_of(p, KVT_POOL_KV);
    assert_int_equal(kv.used, 0);
    assert_int_equal(kv.high_water, 5 * REQ_BYTES);
    /* a request larger than the whole axis can never be admitted */
    kvt_request big = {.prompt = toks, .n_prompt = 10, .max_tokens = 100};
    kvt_admission *a = NULL;
    assert_int_equal(kvt_service_admit(s[0], &big, &a), KVT_ELIMIT);
    assert_non_null(strstr(kvt_last_error(), "pool axis kv"));
    assert_int_equal(kvt_service_fits(s[0], &big), KVT_ELIMIT);
    /* admit_wait sees room another service's release made */
    assert_int_equal(kvt_service_admit(s[0], &r, &held[0]), 0);
    for (int i = 1; i < 5; i++)
        assert_int_equal(kvt_service_admit(s[1], &r, &held[i]), 0);
    assert_int_equal(kvt_service_admit_wait(s[0], &r, 20, &a), KVT_EAGAIN); /* times out */
    kvt_service_release(s[1], held[4], 1);
    assert_int_equal(kvt_service_admit_wait(s[0], &r, 2000, &a), 0);
    kvt_service_release(s[0], a, 1);
    kvt_service_release(s[0], held[0], 1);
    for (int i = 1; i < 4; i++)
        kvt_service_release(s[1], held[i], 1);
    /* the report names the member and carries the pool's totals */
    char *js = NULL;
    assert_int_equal(kvt_service_stats_json(s[1], &js), 0);
    json_t *doc = json_loads(js, 0, NULL);
    kvt_string_free(js);
    json_t *pool = json_object_get(doc, "pool");
    assert_string_equal(json_string_value(json_object_get(pool, "member")), "service:b");
    assert_int_equal(json_integer_value(json_object_get(pool, "members")), 2);
    json_t *tkv = json_object_get(json_object_get(pool, "totals"), "kv");
    assert_int_equal(json_integer_value(json_object_get(tkv, "limit")), 5 * REQ_BYTES);
    assert_int_equal(json_integer_value(json_object_get(tkv, "high_water")), 5 * REQ_BYTES);
    assert_int_equal(json_integer_value(json_object_get(tkv, "used")), 0);
    assert_true(json_is_null(json_object_get(json_object_get(json_object_get(pool, "totals"), "ram"), "limit")));
    json_decref(doc);
    kvt_service_destroy(s[0]);
    kvt_service_destroy(s[1]);
    kvt_pool_report rep;
    kvt_pool_report_get(p, &rep);
    assert_int_equal(rep.members, 0);
    kvt_pool_destroy(p);
}

/* ---- RAM: prompt caches grow only as the pool grants ------------------------ */

static void test_ram_shared(void **state)
{
    (void)state;
    kvt_service *s[2] = {NULL, NULL};
    /* entry bytes: one block of 16 tokens once a 10-token prompt is kept */
    kvt_pool *probe = new_pool(0, 0, 0);
    assert_int_equal(make_service(probe, "probe", 1 << 20, NULL, &s[0]), 0);
    fill_tokens(1000);
    assert_int_equal(run_request(s[0], toks, 10), 0);
    uint64_t e = pc_bytes_of(s[0]);
    assert_true(e > 0);
    assert_int_equal(member_axis(probe, "probe", KVT_POOL_RAM).published, e);
    kvt_service_destroy(s[0]);
    kvt_pool_destroy(probe);

    kvt_pool *p = new_pool(2 * e + e / 2, 0, 0);
    assert_int_equal(make_service(p, "service:a", 1 << 20, NULL, &s[0]), 0);
    assert_int_equal(make_service(p, "service:b", 1 << 20, NULL, &s[1]), 0);
    assert_int_equal(axis_of(p, KVT_POOL_RAM).used, 0); /* nothing is charged before a publish */
    for (int i = 0; i < 3; i++) {
        fill_tokens(2000 + 100 * i);
        assert_int_equal(run_request(s[0], toks, 10), 0);
        uint64_t held = pc_bytes_of(s[0]);
        /* charged is exactly what is held, and never over the limit */
        assert_int_equal(member_axis(p, "service:a", KVT_POOL_RAM).published, held);
        assert_true(axis_of(p, KVT_POOL_RAM).used <= 2 * e + e / 2);
        assert_int_equal(held, (uint64_t)(i < 2 ? i + 1 : 2) * e); /* the third evicted the first */
    }
    kvt_service_stats st;
    kvt_service_get_stats(s[0], &st);
    assert_int_equal(st.evictions, 1);
    /* b gets only what is free (half an entry): its entry does not fit */
    fill_tokens(5000);
    assert_int_equal(run_request(s[1], toks, 10), 0);
    kvt_service_get_stats(s[1], &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.oversize_drops, 1);
    assert_int_equal(member_axis(p, "service:b", KVT_POOL_RAM).published, 0);
    assert_true(member_axis(p, "service:b", KVT_POOL_RAM).refusals >= 1);
    assert_int_equal(axis_of(p, KVT_POOL_RAM).high_water, 2 * e + e / 2); /* a's 2e, then b's e/2 */
    /* a closes: its share goes back and b's next entry fits */
    assert_int_equal(kvt_service_close(s[0]), 0);
    assert_int_equal(member_axis(p, "service:a", KVT_POOL_RAM).used, 0);
    assert_int_equal(run_request(s[1], toks, 10), 0);
    assert_int_equal(pc_bytes_of(s[1]), e);
    assert_int_equal(member_axis(p, "service:b", KVT_POOL_RAM).published, e);
    kvt_service_destroy(s[0]);
    kvt_service_destroy(s[1]);
    assert_int_equal(axis_of(p, KVT_POOL_RAM).used, 0);
    kvt_pool_destroy(p);
}

/* ---- 8 threads, two services, two roots, one pool, a sampling thread -------- */

#define THREADS 8
#define ROUNDS 60

typedef struct burst {
    kvt_pool *pool;
    kvt_service *svc[2];
    uint64_t limit[KVT_POOL_AXES];
    uint64_t seed;
    volatile int stop, started;
    uint64_t samples, over, max_seen[KVT_POOL_AXES];
    int refused[THREADS], bad_msg[THREADS];
} burst;

static void *sampler(void *arg)
{
    burst *b = arg;
    while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
        kvt_pool_report r;
        kvt_pool_report_get(b->pool, &r);
        for (int a = 0; a < KVT_POOL_AXES; a++) {
            if (b->limit[a] && r.axis[a].used > b->limit[a])
                b->over++;
            if (r.axis[a].used > b->max_seen[a])
                b->max_seen[a] = r.axis[a].used;
        }
        b->samples++;
        __atomic_store_n(&b->started, 1, __ATOMIC_RELEASE);
        sched_yield();
    }
    return NULL;
}

typedef struct worker {
    burst *b;
    int id;
} worker;

static void *burst_worker(void *arg)
{
    worker *w = arg;
    burst *b = w->b;
    uint64_t x = b->seed ^ (uint64_t)(w->id + 1) * 0x9e3779b97f4a7c15ull;
    int32_t prompt[12];
    for (int round = 0; round < ROUNDS; round++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        kvt_service *s = b->svc[x & 1];
        int64_t n = 4 + (int64_t)((x >> 8) % 8);
        for (int i = 0; i < 12; i++)
            prompt[i] = (int32_t)(((x >> 16) % 5) * 100 + (uint64_t)i); /* 5 prefixes: hits and misses */
        kvt_request r = {.prompt = prompt, .n_prompt = n, .max_tokens = 16 - n};
        kvt_admission *a = NULL;
        int rc = kvt_service_admit(s, &r, &a);
        if (rc) {
            b->refused[w->id]++;
            if (rc != KVT_EAGAIN || !strstr(kvt_last_error(), "pool axis kv"))
                b->bad_msg[w->id]++;
            usleep((useconds_t)(50 + (x >> 40) % 200)); /* a refused client comes back a little later */
            continue;
        }
        kvt_state st;
        if (kvt_service_acquire(s, a, &st) == 0) {
            for (int64_t t = st.reused_tokens; t < n; t++) {
                float k[D], v[D];
                for (int j = 0; j < D; j++)
                    k[j] = v[j] = (float)(prompt[t] + j);
                const void *in[2] = {k, v};
                (void)kvt_cache_append(st.caches[0], 1, in);
            }
            usleep((useconds_t)(100 + (x >> 32) % 300)); /* hold the admission: the burst overlaps */
            (void)kvt_service_publish(s, a, prompt, n, &st);
            kvt_state_clear(&st);
        }
        kvt_service_release(s, a, 1);
        usleep((useconds_t)(50 + (x >> 24) % 200)); /* the client's next turn comes later */
    }
    return NULL;
}

static void test_burst_sampled(void **state)
{
    (void)state;
    burst b;
    memset(&b, 0, sizeof b);
    b.seed = test_seed("test_pool_service burst");
    b.limit[KVT_POOL_RAM] = 6 * 512;
    b.limit[KVT_POOL_KV] = 4 * REQ_BYTES;
    b.limit[KVT_POOL_DISK] = 1 << 20;
    b.pool = new_pool(b.limit[KVT_POOL_RAM], b.limit[KVT_POOL_KV], b.limit[KVT_POOL_DISK]);
    char root[2][512];
    kvt_store *st[2];
    open_root(b.pool, "burst-a", 1 << 19, root[0], sizeof root[0], &st[0], 0);
    open_root(b.pool, "burst-b", 1 << 19, root[1], sizeof root[1], &st[1], 0);
    kvt_cold_tier cold[2];
    for (int i = 0; i < 2; i++) {
        kvt_store_cold_tier(st[i], &cold[i]);
        assert_int_equal(make_service(b.pool, i ? "service:b" : "service:a", 1 << 20, &cold[i], &b.svc[i]), 0);
    }
    pthread_t smp, th[THREADS];
    worker w[THREADS];
    assert_int_equal(pthread_create(&smp, NULL, sampler, &b), 0);
    while (!__atomic_load_n(&b.started, __ATOMIC_ACQUIRE))
        sched_yield();
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker){.b = &b, .id = i};
        assert_int_equal(pthread_create(&th[i], NULL, burst_worker, &w[i]), 0);
    }
    for (int i = 0; i < THREADS; i++)
        pthread_join(th[i], NULL);
    __atomic_store_n(&b.stop, 1, __ATOMIC_RELEASE);
    pthread_join(smp, NULL);
    int refused = 0, bad = 0;
    for (int i = 0; i < THREADS; i++) {
        refused += b.refused[i];
        bad += b.bad_msg[i];
    }
    kvt_pool_report r;
    kvt_pool_report_get(b.pool, &r);
    printf("burst: %llu samples, %d admissions refused (pool kv refusals %llu), kv high water %llu of %llu, "
           "ram high water %llu of %llu\n",
           (unsigned long long)b.samples, refused, (unsigned long long)r.axis[KVT_POOL_KV].refusals,
           (unsigned long long)r.axis[KVT_POOL_KV].high_water, (unsigned long long)b.limit[KVT_POOL_KV],
           (unsigned long long)r.axis[KVT_POOL_RAM].high_water, (unsigned long long)b.limit[KVT_POOL_RAM]);
    printf("burst: kv refusals service:a %llu, service:b %llu\n",
           (unsigned long long)member_axis(b.pool, "service:a", KVT_POOL_KV).refusals,
           (unsigned long long)member_axis(b.pool, "service:b", KVT_POOL_KV).refusals);
    assert_true(b.samples > 0);
    assert_int_equal(b.over, 0);  /* never over a limit at a sampled moment */
    assert_int_equal(bad, 0);     /* every refusal names the kv axis */
    assert_int_equal(r.axis[KVT_POOL_KV].refusals, (uint64_t)refused);
    for (int a = 0; a < KVT_POOL_AXES; a++) {
        assert_true(r.axis[a].high_water >= b.max_seen[a]);
        if (b.limit[a])
            assert_true(r.axis[a].high_water <= b.limit[a]);
    }
    assert_int_equal(r.axis[KVT_POOL_KV].used, 0); /* every admission released */
    assert_int_equal(r.axis[KVT_POOL_KV].reserved, 0);
    assert_int_equal(r.axis[KVT_POOL_RAM].reserved, 0);
    assert_int_equal(r.axis[KVT_POOL_DISK].used, 2u << 19);
    assert_int_equal(r.members, 4);
    /* at rest, each service is charged at least what its prompt cache holds */
    for (int i = 0; i < 2; i++) {
        assert_int_equal(kvt_service_flush(b.svc[i]), 0);
        assert_true(member_axis(b.pool, i ? "service:b" : "service:a", KVT_POOL_RAM).published >=
                    pc_bytes_of(b.svc[i]));
        assert_int_equal(kvt_service_close(b.svc[i]), 0);
        kvt_service_destroy(b.svc[i]);
        assert_int_equal(kvt_store_close(st[i]), 0);
        store_rmtree(root[i]);
    }
    kvt_pool_report_get(b.pool, &r);
    for (int a = 0; a < KVT_POOL_AXES; a++)
        assert_int_equal(r.axis[a].used, 0);
    assert_int_equal(r.members, 0);
    kvt_pool_destroy(b.pool);
}

/* ---- RAM: never held past the charge while writes are pending --------------- */

typedef struct pending_run {
    kvt_pool *pool;
    kvt_service *svc[2];
    volatile int stop, started;
    uint64_t samples, over, worst;
} pending_run;

static const char *const svc_name[2] = {"service:a", "service:b"};

static void *held_sampler(void *arg)
{
    pending_run *p = arg;
    while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
        for (int i = 0; i < 2; i++) {
            /* the charge read before and after: it grows before the bytes
             * do and shrinks after them, so held <= either read when the
             * cache is never over its charge */
            uint64_t c1 = member_axis(p->pool, svc_name[i], KVT_POOL_RAM).published;
            uint64_t h = pc_bytes_of(p->svc[i]);
            uint64_t c2 = member_axis(p->pool, svc_name[i], KVT_POOL_RAM).published;
            uint64_t c = c1 > c2 ? c1 : c2;
            if (h > c) {
                p->over++;
                if (h - c > p->worst)
                    p->worst = h - c;
            }
        }
        p->samples++;
        __atomic_store_n(&p->started, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* Every write-behind the services hand their cold tier is sampled at the
 * moment it is handed over: the put has inserted its entry and evicted what
 * it could, and the budget is not yet settled (the put still holds the
 * member's charge). Where a put inserts over the charge and cannot evict the
 * pending entries, this sample sees the cache hold more than it is charged,
 * every time, whatever the threads' timing. */
typedef struct spill_probe {
    const kvt_cold_tier *inner; /* the mem_tier's table */
    pending_run *p;
    uint64_t samples, over, worst;
} spill_probe;

static spill_probe probes[2];

static int probe_spill(int i, void *self, kvt_entry *e)
{
    spill_probe *q = &probes[i];
    uint64_t c = member_axis(q->p->pool, svc_name[i], KVT_POOL_RAM).published;
    uint64_t h = pc_bytes_of(q->p->svc[i]);
    __atomic_fetch_add(&q->samples, 1, __ATOMIC_RELAXED);
    if (h > c) {
        __atomic_fetch_add(&q->over, 1, __ATOMIC_RELAXED);
        if (h - c > q->worst)
            q->worst = h - c;
    }
    return q->inner->spill(self, e);
}

static int probe_spill_a(void *self, kvt_entry *e) { return probe_spill(0, self, e); }
static int probe_spill_b(void *self, kvt_entry *e) { return probe_spill(1, self, e); }

typedef struct pending_worker {
    pending_run *p;
    int id;
} pending_worker;

static void *pending_main(void *arg)
{
    pending_worker *w = arg;
    kvt_service *s = w->p->svc[w->id];
    int32_t prompt[10];
    for (int round = 0; round < 24; round++) {
        for (int i = 0; i < 10; i++)
            prompt[i] = 10000 * (w->id + 1) + 100 * round + i; /* a new prefix each time: every put adds */
        kvt_request r = {.prompt = prompt, .n_prompt = 10, .max_tokens = 6};
        kvt_admission *a = NULL;
        if (kvt_service_admit(s, &r, &a))
            continue;
        kvt_state st;
        if (kvt_service_acquire(s, a, &st) == 0) {
            run_tokens(st.caches[0], st.reused_tokens, 10);
            (void)kvt_service_publish(s, a, prompt, 10, &st);
            kvt_state_clear(&st);
        }
        kvt_service_release(s, a, 1);
    }
    return NULL;
}

static void test_ram_pending_sampled(void **state)
{
    (void)state;
    /* one entry's bytes, measured */
    kvt_pool *probe = new_pool(0, 0, 0);
    kvt_service *one = NULL;
    assert_int_equal(make_service(probe, "probe", 1 << 20, NULL, &one), 0);
    fill_tokens(7000);
    assert_int_equal(run_request(one, toks, 10), 0);
    uint64_t e = pc_bytes_of(one);
    kvt_service_destroy(one);
    kvt_pool_destroy(probe);

    pending_run p;
    memset(&p, 0, sizeof p);
    p.pool = new_pool(5 * e, 0, 0); /* five entries over both services */
    mem_tier *mt[2];
    kvt_cold_tier probed[2];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(mem_tier_create(&mt[i]), 0);
        mem_tier_manual_spills(mt[i], 1); /* write-behind stays pending until a flush */
        probes[i] = (spill_probe){.inner = mem_tier_iface(mt[i]), .p = &p};
        probed[i] = *mem_tier_iface(mt[i]);
        probed[i].spill = i ? probe_spill_b : probe_spill_a;
        /* each service may hold three entries: the two share the five the pool has */
        assert_int_equal(make_service(p.pool, svc_name[i], 3 * e, &probed[i], &p.svc[i]), 0);
    }
    pthread_t smp, th[2];
    pending_worker w[2];
    assert_int_equal(pthread_create(&smp, NULL, held_sampler, &p), 0);
    while (!__atomic_load_n(&p.started, __ATOMIC_ACQUIRE))
        sched_yield();
    for (int i = 0; i < 2; i++) {
        w[i] = (pending_worker){&p, i};
        assert_int_equal(pthread_create(&th[i], NULL, pending_main, &w[i]), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    __atomic_store_n(&p.stop, 1, __ATOMIC_RELEASE);
    pthread_join(smp, NULL);
    kvt_pool_report r;
    kvt_pool_report_get(p.pool, &r);
    kvt_service_stats st[2];
    mem_tier_counts mc[2];
    for (int i = 0; i < 2; i++) {
        kvt_service_get_stats(p.svc[i], &st[i]);
        mc[i] = mem_tier_counts_get(mt[i]);
    }
    printf("pending write-behind: %llu samples, %llu over the charge (worst %llu bytes); ram high water %llu of "
           "%llu; evictions %llu + %llu, tier writes %lld + %lld\n",
           (unsigned long long)p.samples, (unsigned long long)p.over, (unsigned long long)p.worst,
           (unsigned long long)r.axis[KVT_POOL_RAM].high_water, (unsigned long long)(5 * e),
           (unsigned long long)st[0].evictions, (unsigned long long)st[1].evictions, (long long)mc[0].writes,
           (long long)mc[1].writes);
    printf("sampled at each write-behind hand-over: %llu + %llu samples (spills %lld + %lld), %llu + %llu over the "
           "charge (worst %llu, %llu bytes)\n",
           (unsigned long long)probes[0].samples, (unsigned long long)probes[1].samples, (long long)mc[0].spills,
           (long long)mc[1].spills, (unsigned long long)probes[0].over, (unsigned long long)probes[1].over,
           (unsigned long long)probes[0].worst, (unsigned long long)probes[1].worst);
    assert_true(p.samples > 0);
    assert_int_equal(p.over, 0); /* never held past the charge */
    for (int i = 0; i < 2; i++) {
        /* every spill was sampled, both services kept entries past the
         * point where the axis is tight, and none was held over its charge */
        assert_int_equal(probes[i].samples, (uint64_t)mc[i].spills);
        assert_true(probes[i].samples > 5);
        assert_int_equal(probes[i].over, 0);
        assert_true(st[i].evictions > 0);
    }
    assert_true(r.axis[KVT_POOL_RAM].high_water <= 5 * e);
    assert_true(st[0].evictions + st[1].evictions > 0); /* the axis was tight: entries left */
    assert_true(mc[0].writes + mc[1].writes > 0);         /* made durable to be evicted */
    for (int i = 0; i < 2; i++) {
        assert_true(pc_bytes_of(p.svc[i]) <= member_axis(p.pool, svc_name[i], KVT_POOL_RAM).published);
        assert_int_equal(kvt_service_close(p.svc[i]), 0);
        kvt_service_destroy(p.svc[i]);
        mem_tier_destroy(mt[i]);
    }
    kvt_pool_report_get(p.pool, &r);
    assert_int_equal(r.axis[KVT_POOL_RAM].used, 0);
    kvt_pool_destroy(p.pool);
}

/* ---- error paths --------------------------------------------------------------- */

static void assert_nothing_charged_but_ram(kvt_pool *p, kvt_service *s, const char *name)
{
    kvt_pool_usage kv = axis_of(p, KVT_POOL_KV), ram = axis_of(p, KVT_POOL_RAM);
    assert_int_equal(kv.used, 0);
    assert_int_equal(ram.reserved, 0);
    if (s)
        assert_true(member_axis(p, name, KVT_POOL_RAM).published >= pc_bytes_of(s));
}

static void test_acquire_failure_drops(void **state)
{
    (void)state;
    kvt_pool *p = new_pool(1 << 20, 4 * REQ_BYTES, 0);
    kvt_service *s = NULL;
    assert_int_equal(make_service(p, "service:x", 1 << 20, NULL, &s), 0);
    fill_tokens(300);
    kvt_request r = {.prompt = toks, .n_prompt = 10, .max_tokens = 6};
    for (int i = 0; i < 20; i++) {
        kvt_admission *a = NULL;
        assert_int_equal(kvt_service_admit(s, &r, &a), 0);
        fail_new_caches = 1;
        kvt_state st;
        assert_int_equal(kvt_service_acquire(s, a, &st), KVT_EIO);
        fail_new_caches = 0;
        kvt_service_release(s, a, 0);
        assert_nothing_charged_but_ram(p, s, "service:x");
    }
    /* a closed service refuses and charges nothing */
    assert_int_equal(kvt_service_close(s), 0);
    kvt_admission *a = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a), KVT_ECLOSED);
    assert_int_equal(axis_of(p, KVT_POOL_KV).used, 0);
    assert_int_equal(axis_of(p, KVT_POOL_KV).high_water, REQ_BYTES);
    kvt_service_destroy(s);
    /* a service whose pool has no name is refused; so is a second join of a name */
    kvt_service_config cfg = {.n_layers = 1, .layers = &layer, .max_positions = 64, .new_caches = new_caches,
                              .pool = p};
    assert_int_equal(kvt_service_create(&cfg, &s), KVT_EINVAL);
    kvt_pool_destroy(p);
}

/* One request's life on a pooled service, every step allowed to fail (an
 * allocation failure); returns the first error. */
static int oom_request(kvt_service *s, int32_t base)
{
    int32_t prompt[10];
    for (int i = 0; i < 10; i++)
        prompt[i] = base + i;
    kvt_request r = {.prompt = prompt, .n_prompt = 10, .max_tokens = 6};
    kvt_admission *a = NULL;
    int rc = kvt_service_admit(s, &r, &a);
    if (rc)
        return rc;
    kvt_state st;
    rc = kvt_service_acquire(s, a, &st);
    if (!rc) {
        for (int64_t t = st.reused_tokens; !rc && t < 10; t++) {
            float k[D], v[D];
            for (int j = 0; j < D; j++)
                k[j] = v[j] = (float)(t + j);
            const void *in[2] = {k, v};
            rc = kvt_cache_append(st.caches[0], 1, in);
        }
        if (!rc)
            rc = kvt_service_publish(s, a, prompt, 10, &st);
        kvt_state_clear(&st);
    }
    kvt_service_release(s, a, 1);
    return rc;
}

/* create, a request that misses, one that hits, destroy: the k-th
 * allocation fails */
static int oom_sequence(kvt_pool *p, const char *root)
{
    char fp[KVT_STORE_FINGERPRINT_LEN];
    static const store_cfg cfg = {.n_kv = 1, .kv_dim = D, .block = B};
    kvt_store_identity id;
    store_identity(&cfg, "model-oom", fp, &id);
    kvt_store_options o = {.max_bytes = 1 << 20, .pool = p};
    kvt_store *st = NULL;
    int rc = kvt_store_open(root, &id, &o, &st);
    if (rc)
        return rc;
    kvt_cold_tier cold;
    kvt_store_cold_tier(st, &cold);
    kvt_service *s = NULL;
    rc = make_service(p, "service:oom", 1 << 20, &cold, &s);
    if (!rc) {
        rc = oom_request(s, 700);
        int rc2 = oom_request(s, 700); /* the same prompt: a hit */
        rc = rc ? rc : rc2;
        assert_nothing_charged_but_ram(p, NULL, NULL);
        (void)kvt_service_close(s);
        kvt_service_destroy(s);
    }
    (void)kvt_store_close(st);
    return rc;
}

static void test_alloc_failures(void **state)
{
    (void)state;
    kvt_pool *p = new_pool(1 << 20, 4 * REQ_BYTES, 2 << 20);
    char root[512];
    store_tmpdir(root, sizeof root, "pool-oom");
    int failed = 0;
    for (long k = 1;; k++) {
        store_rmtree(root);
        oom_arm(k);
        int rc = oom_sequence(p, root);
        long calls = oom_calls();
        kvt_set_allocator(NULL);
        /* whatever failed, nothing is left charged or joined */
        kvt_pool_report r;
        kvt_pool_report_get(p, &r);
        for (int a = 0; a < KVT_POOL_AXES; a++) {
            assert_int_equal(r.axis[a].used, 0);
            assert_int_equal(r.axis[a].reserved, 0);
        }
        assert_int_equal(r.members, 0);
        if (calls < k) {
            assert_int_equal(rc, 0);
            break;
        }
        if (rc)
            failed++;
    }
    store_rmtree(root);
    printf("alloc failures: %d of the sequence's allocations failed it, each leaving nothing charged\n", failed);
    assert_true(failed >= 20);
    kvt_pool_destroy(p);
}

/* ---- remote: write bytes in flight on the remote axis --------------------------- */

static uint64_t entry_write_bytes(const kvt_entry *e)
{
    uint64_t b = (uint64_t)e->n_tokens * 4;
    for (int32_t l = 0; l < e->n_caches; l++)
        b += kvt_cache_bytes(e->caches[l]);
    return b;
}

static void test_remote_in_flight(void **state)
{
    (void)state;
    if (!redis_available("test_pool_service remote"))
        skip();
    redis_srv srv;
    assert_int_equal(redis_start(&srv, 64, NULL), 0);
    static const store_cfg cfg = {.n_kv = 1, .kv_dim = D, .block = B};
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    store_identity(&cfg, "model-pool-remote", fp, &id);
    int32_t t[64];
    for (int i = 0; i < 64; i++)
        t[i] = 900 + i;
    kvt_entry small;
    assert_int_equal(store_make_entry(&cfg, "", t, 16, &small), 0);
    uint64_t one = entry_write_bytes(&small);
    kvt_entry_clear(&small);
    kvt_pool *p = NULL;
    kvt_pool_limits lim = {{0, 0, 0, 3 * one}};
    assert_int_equal(kvt_pool_create(&lim, &p), 0);
    kvt_remote_options o = {.pool = p, .quiet = 1};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(srv.url, &id, &o, &r), 0);
    char name[128];
    snprintf(name, sizeof name, "remote:127.0.0.1:%d", srv.port);
    kvt_cold_tier tier;
    kvt_remote_cold_tier(r, &tier);
    /* an entry of 64 tokens is more than the whole axis: refused, named */
    kvt_entry big;
    assert_int_equal(store_make_entry(&cfg, "", t, 64, &big), 0);
    assert_true(entry_write_bytes(&big) > 3 * one);
    assert_int_equal(tier.store(tier.self, &big), KVT_ELIMIT);
    assert_non_null(strstr(kvt_last_error(), "pool axis remote"));
    assert_int_equal(tier.spill(tier.self, &big), KVT_EAGAIN); /* write-behind: a drop, still ours */
    assert_non_null(big.caches);
    kvt_entry_clear(&big);
    /* a burst of small write-behinds under a sampling eye: never over the limit */
    burst b;
    memset(&b, 0, sizeof b);
    b.pool = p;
    b.limit[KVT_POOL_REMOTE] = 3 * one;
    pthread_t smp;
    assert_int_equal(pthread_create(&smp, NULL, sampler, &b), 0);
    while (!__atomic_load_n(&b.started, __ATOMIC_ACQUIRE))
        sched_yield();
    int accepted = 0, refused = 0;
    for (int i = 0; i < 40; i++) {
        int32_t u[16];
        for (int k = 0; k < 16; k++)
            u[k] = 5000 + i * 16 + k;
        kvt_entry e;
        assert_int_equal(store_make_entry(&cfg, "", u, 16, &e), 0);
        if (tier.spill(tier.self, &e) == 0) {
            accepted++;
        } else {
            assert_non_null(strstr(kvt_last_error(), "pool axis remote"));
            refused++;
            kvt_entry_clear(&e);
            usleep(500); /* the writer drains meanwhile: later ones fit again */
        }
    }
    assert_int_equal(tier.flush(tier.self), 0);
    __atomic_store_n(&b.stop, 1, __ATOMIC_RELEASE);
    pthread_join(smp, NULL);
    kvt_pool_usage u = axis_of(p, KVT_POOL_REMOTE);
    printf("remote: %d write-behinds accepted, %d refused by the %llu-byte axis; high water %llu, %llu samples\n",
           accepted, refused, (unsigned long long)(3 * one), (unsigned long long)u.high_water,
           (unsigned long long)b.samples);
    assert_int_equal(b.over, 0);
    assert_true(accepted >= 3);
    assert_int_equal(u.used, 0); /* every write ended: nothing in flight */
    assert_true(u.high_water >= one && u.high_water <= 3 * one);
    assert_int_equal(u.refusals, (uint64_t)refused + 2);
    assert_int_equal(member_axis(p, name, KVT_POOL_REMOTE).used, 0);
    /* a synchronous store holds its bytes only while it is sent */
    kvt_entry e;
    assert_int_equal(store_make_entry(&cfg, "", t, 16, &e), 0);
    assert_int_equal(tier.store(tier.self, &e), 0);
    kvt_entry_clear(&e);
    assert_int_equal(axis_of(p, KVT_POOL_REMOTE).used, 0);
    assert_int_equal(kvt_remote_close(r), 0);
    kvt_pool_report rep;
    kvt_pool_report_get(p, &rep);
    assert_int_equal(rep.members, 0);
    kvt_pool_destroy(p);
    redis_stop(&srv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_roots_disk),
        cmocka_unit_test(test_kv_burst_two_services),
        cmocka_unit_test(test_ram_shared),
        cmocka_unit_test(test_burst_sampled),
        cmocka_unit_test(test_ram_pending_sampled),
        cmocka_unit_test(test_acquire_failure_drops),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_remote_in_flight),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
