/*
 * test_pool_limits.c: the process-wide limits of kvtier/pool.h. Two members
 * (two services, or two SSD roots) share one pool: a burst from several
 * threads that would pass an axis limit is refused naming the axis, a
 * sampling thread never sees the axis over its limit, high-water marks are
 * exact, reservations are dropped on every error path, and every allocation
 * of join / reserve / report fails in turn without leaking or charging.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <pthread.h>

#include "kvtier/pool.h"
#include "oom_alloc.h"

static kvt_pool *new_pool(uint64_t ram, uint64_t kv, uint64_t disk, uint64_t remote)
{
    kvt_pool_limits l = {{ram, kv, disk, remote}};
    kvt_pool *p = NULL;
    assert_int_equal(kvt_pool_create(&l, &p), 0);
    assert_non_null(p);
    return p;
}

static void test_two_phase(void **state)
{
    (void)state;
    kvt_pool *p = new_pool(1000, 0, 0, 0);
    kvt_pool_member *a = NULL, *b = NULL, *dup = NULL;
    assert_int_equal(kvt_pool_join(p, "service:a", &a), 0);
    assert_int_equal(kvt_pool_join(p, "service:b", &b), 0);
    assert_int_equal(kvt_pool_join(p, "service:a", &dup), KVT_EBUSY);
    assert_null(dup);
    assert_int_equal(kvt_pool_join(p, "", &dup), KVT_EINVAL);

    kvt_pool_reservation *ra = NULL, *rb = NULL, *rc = NULL;
    assert_int_equal(kvt_pool_reserve(a, KVT_POOL_RAM, 600, &ra), 0);
    assert_int_equal(kvt_pool_reservation_bytes(ra), 600);
    assert_int_equal(kvt_pool_reserve(b, KVT_POOL_RAM, 300, &rb), 0);
    /* 100 free: 101 does not fit now, 1001 never fits */
    assert_int_equal(kvt_pool_reserve(b, KVT_POOL_RAM, 101, &rc), KVT_EAGAIN);
    assert_null(rc);
    const char *msg = kvt_last_error();
    assert_non_null(strstr(msg, "pool axis ram"));
    assert_non_null(strstr(msg, "service:b"));
    assert_non_null(strstr(msg, "asked for 101 bytes"));
    assert_non_null(strstr(msg, "100 of the 1000-byte limit are free"));
    assert_int_equal(kvt_pool_reserve(b, KVT_POOL_RAM, 1001, &rc), KVT_ELIMIT);
    assert_non_null(strstr(kvt_last_error(), "pool axis ram"));
    /* other axes are independent (not limited here) */
    assert_int_equal(kvt_pool_reserve(b, KVT_POOL_KV, 1u << 30, &rc), 0);
    kvt_pool_drop(rc);

    kvt_pool_publish(ra); /* reserved -> published, still charged */
    kvt_pool_report r;
    assert_int_equal(kvt_pool_report_get(p, &r), 0);
    assert_int_equal(r.members, 2);
    assert_int_equal(r.axis[KVT_POOL_RAM].reserved, 300);
    assert_int_equal(r.axis[KVT_POOL_RAM].published, 600);
    assert_int_equal(r.axis[KVT_POOL_RAM].used, 900);
    assert_int_equal(r.axis[KVT_POOL_RAM].high_water, 900);
    assert_int_equal(r.axis[KVT_POOL_RAM].refusals, 2);
    assert_int_equal(r.axis[KVT_POOL_KV].used, 0);
    assert_int_equal(r.axis[KVT_POOL_KV].high_water, 1u << 30);

    kvt_pool_drop(rb);
    assert_int_equal(kvt_pool_release(a, KVT_POOL_RAM, 601), KVT_EINVAL); /* more than published */
    assert_int_equal(kvt_pool_release(a, KVT_POOL_RAM, 200), 0);
    kvt_pool_usage ua[KVT_POOL_AXES], ub[KVT_POOL_AXES];
    assert_int_equal(kvt_pool_member_usage(a, ua), 0);
    assert_int_equal(kvt_pool_member_usage(b, ub), 0);
    assert_int_equal(ua[KVT_POOL_RAM].published, 400);
    assert_int_equal(ua[KVT_POOL_RAM].high_water, 600);
    assert_int_equal(ub[KVT_POOL_RAM].used, 0);
    assert_int_equal(ub[KVT_POOL_RAM].high_water, 300);
    assert_int_equal(ub[KVT_POOL_RAM].refusals, 2);
    assert_int_equal(ub[KVT_POOL_KV].high_water, 1u << 30);

    char *json = NULL;
    assert_int_equal(kvt_pool_report_json(p, &json), 0);
    assert_non_null(strstr(json, "\"members\":2"));
    assert_non_null(strstr(json, "\"ram\":{\"limit\":1000,\"reserved\":0,\"published\":400,\"used\":400,"
                                 "\"high_water\":900,\"refusals\":2}"));
    assert_non_null(strstr(json, "{\"name\":\"service:a\",\"axes\":{\"ram\":{\"limit\":1000,\"reserved\":0,"
                                 "\"published\":400,\"used\":400,\"high_water\":600,\"refusals\":0}"));
    assert_non_null(strstr(json, "\"name\":\"service:b\""));
    kvt_string_free(json);

    /* leaving drops open reservations and releases published bytes */
    assert_int_equal(kvt_pool_reserve(a, KVT_POOL_RAM, 100, &ra), 0);
    kvt_pool_leave(a);
    assert_int_equal(kvt_pool_report_get(p, &r), 0);
    assert_int_equal(r.members, 1);
    assert_int_equal(r.axis[KVT_POOL_RAM].used, 0);
    kvt_pool_destroy(p); /* b still joined: left by destroy */
}

/* ---- burst from several threads under a sampling thread ----------------- */

#define BURST_THREADS 8
#define BURST_ROUNDS 2000
#define DISK_LIMIT (64u * 4096u)
#define HELD 3

typedef struct burst {
    kvt_pool *pool;
    kvt_pool_member *member[2];
    pthread_barrier_t start;
    int stop;                       /* atomic */
    long admitted[BURST_THREADS];   /* per thread */
    long refused[BURST_THREADS];    /* per thread */
    long bad_message[BURST_THREADS];
    uint64_t max_seen, samples, over;
} burst;

typedef struct burst_arg {
    burst *b;
    int id;
} burst_arg;

static void *burst_thread(void *arg)
{
    burst_arg *ba = arg;
    burst *b = ba->b;
    kvt_pool_member *m = b->member[ba->id % 2];
    pthread_barrier_wait(&b->start);
    /* each thread holds up to HELD publications at once (a window of
     * written shards), so even one thread alone passes the free bytes */
    uint64_t held[HELD] = {0};
    for (int i = 0; i < BURST_ROUNDS; i++) {
        uint64_t bytes = 4096u * (uint64_t)(1 + (i + ba->id) % 8);
        int slot = i % HELD;
        if (held[slot]) { /* evicted */
            kvt_pool_release(m, KVT_POOL_DISK, held[slot]);
            held[slot] = 0;
        }
        kvt_pool_reservation *r = NULL;
        int rc = kvt_pool_reserve(m, KVT_POOL_DISK, bytes, &r);
        if (rc == KVT_EAGAIN) {
            b->refused[ba->id]++;
            if (!strstr(kvt_last_error(), "pool axis disk"))
                b->bad_message[ba->id]++;
            continue;
        }
        if (rc != 0) {
            b->bad_message[ba->id]++;
            continue;
        }
        b->admitted[ba->id]++;
        if (i % 5 == 0) { /* the write failed: dropped */
            kvt_pool_drop(r);
        } else { /* written: published, held until evicted */
            kvt_pool_publish(r);
            held[slot] = bytes;
        }
    }
    for (int j = 0; j < HELD; j++)
        if (held[j])
            kvt_pool_release(m, KVT_POOL_DISK, held[j]);
    return NULL;
}

static void *sampler_thread(void *arg)
{
    burst *b = arg;
    pthread_barrier_wait(&b->start);
    while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
        kvt_pool_report r;
        kvt_pool_report_get(b->pool, &r);
        uint64_t used = r.axis[KVT_POOL_DISK].used;
        if (used > DISK_LIMIT)
            b->over++;
        if (used > b->max_seen)
            b->max_seen = used;
        if (r.axis[KVT_POOL_DISK].high_water < used)
            b->over++;
        b->samples++;
    }
    return NULL;
}

static void test_burst_sampled(void **state)
{
    (void)state;
    burst b = {0};
    b.pool = new_pool(0, 0, DISK_LIMIT, 0);
    assert_int_equal(kvt_pool_join(b.pool, "ssd:/root/a", &b.member[0]), 0);
    assert_int_equal(kvt_pool_join(b.pool, "ssd:/root/b", &b.member[1]), 0);
    /* a long-lived publication so the burst runs near the limit */
    kvt_pool_reservation *base = NULL;
    assert_int_equal(kvt_pool_reserve(b.member[0], KVT_POOL_DISK, DISK_LIMIT - 16 * 4096u, &base), 0);
    kvt_pool_publish(base);
    pthread_barrier_init(&b.start, NULL, BURST_THREADS + 1);
    pthread_t t[BURST_THREADS], s;
    burst_arg args[BURST_THREADS];
    assert_int_equal(pthread_create(&s, NULL, sampler_thread, &b), 0);
    for (int i = 0; i < BURST_THREADS; i++) {
        args[i] = (burst_arg){&b, i};
        assert_int_equal(pthread_create(&t[i], NULL, burst_thread, &args[i]), 0);
    }
    /* the sampler joins the barrier too: BURST_THREADS + 1 parties */
    for (int i = 0; i < BURST_THREADS; i++)
        pthread_join(t[i], NULL);
    __atomic_store_n(&b.stop, 1, __ATOMIC_RELEASE);
    pthread_join(s, NULL);
    pthread_barrier_destroy(&b.start);

    long admitted = 0, refused = 0, bad = 0;
    for (int i = 0; i < BURST_THREADS; i++) {
        admitted += b.admitted[i];
        refused += b.refused[i];
        bad += b.bad_message[i];
    }
    printf("burst: %ld admitted, %ld refused, %llu samples, max sampled %llu of %u\n", admitted, refused,
           (unsigned long long)b.samples, (unsigned long long)b.max_seen, DISK_LIMIT);
    assert_int_equal(admitted + refused, BURST_THREADS * BURST_ROUNDS);
    assert_true(refused > 0); /* 3 held x up to 32 KiB per thread against 64 KiB free */
    assert_int_equal(bad, 0);
    assert_int_equal(b.over, 0);
    assert_true(b.samples > 0);

    kvt_pool_report r;
    assert_int_equal(kvt_pool_report_get(b.pool, &r), 0);
    assert_int_equal(r.axis[KVT_POOL_DISK].used, DISK_LIMIT - 16 * 4096u); /* only the base is left */
    assert_int_equal(r.axis[KVT_POOL_DISK].reserved, 0);
    assert_int_equal(r.axis[KVT_POOL_DISK].refusals, (uint64_t)refused);
    assert_true(r.axis[KVT_POOL_DISK].high_water <= DISK_LIMIT);
    assert_true(r.axis[KVT_POOL_DISK].high_water >= b.max_seen);
    kvt_pool_usage u0[KVT_POOL_AXES], u1[KVT_POOL_AXES];
    kvt_pool_member_usage(b.member[0], u0);
    kvt_pool_member_usage(b.member[1], u1);
    assert_int_equal(u0[KVT_POOL_DISK].refusals + u1[KVT_POOL_DISK].refusals, (uint64_t)refused);
    assert_int_equal(u1[KVT_POOL_DISK].used, 0);
    assert_true(u0[KVT_POOL_DISK].high_water <= DISK_LIMIT);
    assert_true(u1[KVT_POOL_DISK].high_water <= 16 * 4096u); /* member b only ever had the free part */
    kvt_pool_destroy(b.pool);
}

/* ---- error paths: an admission that fails midway drops its reservation -- */

/* A manager's admission: reserve, then "allocate the bytes" (fails when
 * asked to), publish on success, drop on failure. */
static int admit(kvt_pool_member *m, uint64_t bytes, int fail_after_reserve)
{
    kvt_pool_reservation *r = NULL;
    int rc = kvt_pool_reserve(m, KVT_POOL_KV, bytes, &r);
    if (rc)
        return rc;
    if (fail_after_reserve) {
        kvt_pool_drop(r);
        return KVT_EIO;
    }
    kvt_pool_publish(r);
    return 0;
}

static void test_error_paths_drop(void **state)
{
    (void)state;
    kvt_pool *p = new_pool(0, 1000, 0, 0);
    kvt_pool_member *m = NULL;
    assert_int_equal(kvt_pool_join(p, "service:x", &m), 0);
    for (int i = 0; i < 50; i++)
        assert_int_equal(admit(m, 900, 1), KVT_EIO);
    kvt_pool_report r;
    kvt_pool_report_get(p, &r);
    assert_int_equal(r.axis[KVT_POOL_KV].used, 0);
    assert_int_equal(r.axis[KVT_POOL_KV].high_water, 900);
    /* nothing was left charged: the full 1000 still fits */
    assert_int_equal(admit(m, 1000, 0), 0);
    assert_int_equal(admit(m, 1, 0), KVT_EAGAIN);
    assert_int_equal(kvt_pool_release(m, KVT_POOL_KV, 1000), 0);
    /* bad arguments charge nothing */
    kvt_pool_reservation *res = (kvt_pool_reservation *)&r;
    assert_int_equal(kvt_pool_reserve(m, (kvt_pool_axis)7, 1, &res), KVT_EINVAL);
    assert_null(res);
    assert_int_equal(kvt_pool_reserve(NULL, KVT_POOL_KV, 1, &res), KVT_EINVAL);
    assert_int_equal(kvt_pool_reserve(m, KVT_POOL_KV, 1, NULL), KVT_EINVAL);
    kvt_pool_publish(NULL);
    kvt_pool_drop(NULL);
    kvt_pool_leave(NULL);
    kvt_pool_destroy(NULL);
    kvt_pool_report_get(p, &r);
    assert_int_equal(r.axis[KVT_POOL_KV].used, 0);
    kvt_pool_destroy(p);
}

/* every allocation of create / join / reserve / report fails in turn */
static int oom_sequence(void)
{
    kvt_pool *p = NULL;
    kvt_pool_member *a = NULL;
    kvt_pool_reservation *r = NULL;
    char *json = NULL;
    int rc = kvt_pool_create(NULL, &p);
    if (rc)
        return rc;
    if ((rc = kvt_pool_join(p, "service:oom", &a)) != 0)
        goto out;
    if ((rc = kvt_pool_reserve(a, KVT_POOL_RAM, 4096, &r)) != 0)
        goto out;
    kvt_pool_publish(r);
    if ((rc = kvt_pool_reserve(a, KVT_POOL_RAM, 4096, &r)) != 0)
        goto out;
    if ((rc = kvt_pool_report_json(p, &json)) != 0) {
        kvt_pool_drop(r);
        goto out;
    }
    kvt_pool_drop(r);
    kvt_string_free(json);
out:;
    if (p && a) {
        /* whatever failed, only the published first reservation may remain */
        kvt_pool_report rep;
        kvt_pool_report_get(p, &rep);
        assert_int_equal(rep.axis[KVT_POOL_RAM].reserved, 0);
        assert_true(rep.axis[KVT_POOL_RAM].published == 0 || rep.axis[KVT_POOL_RAM].published == 4096);
    }
    kvt_pool_destroy(p);
    return rc;
}

static void test_alloc_failures(void **state)
{
    (void)state;
    int failed = 0;
    for (long k = 1;; k++) {
        oom_arm(k);
        int rc = oom_sequence();
        long calls = oom_calls();
        kvt_set_allocator(NULL);
        if (calls < k) {
            assert_int_equal(rc, 0);
            break;
        }
        assert_int_equal(rc, KVT_ENOMEM);
        failed++;
    }
    printf("alloc failures: %d allocations failed in turn\n", failed);
    assert_true(failed >= 5); /* pool, member, name, two reservations (and the report) */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_phase),
        cmocka_unit_test(test_burst_sampled),
        cmocka_unit_test(test_error_paths_drop),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
