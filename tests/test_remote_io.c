/*
 * test_remote_io.c: the remote tier on the I/O worker (kvtier/io.h), with a
 * real redis-server on loopback. With the worker's one thread held: the
 * same entry spilled twice is one write (the second joins the first), a
 * queued write can be withdrawn (it never reaches Redis), a full worker
 * queue is a counted drop with the entry left to the caller; eight
 * asynchronous restores of one handle make one read, each waiter with its
 * own exact entry; close waits for what is queued.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "redis_util.h"
#include "store_util.h"

#include "kvtier/io.h"
#include "kvtier/remote.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};
static redis_srv g_srv;

typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open, entered;
} gate;

static int gate_run(void *task, void **result)
{
    (void)result;
    gate *g = task;
    pthread_mutex_lock(&g->mu);
    g->entered = 1;
    pthread_cond_broadcast(&g->cv);
    while (!g->open)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
    return 0;
}

static void gate_hold(kvt_io *io, gate *g)
{
    kvt_io_op op = {.kind = KVT_IO_KIND_PREFETCH, .key = {0x6a7e, 1}, .priority = KVT_IO_FOREGROUND,
                    .run = gate_run, .task = g};
    assert_int_equal(kvt_io_submit(io, &op, NULL), 0);
    pthread_mutex_lock(&g->mu);
    while (!g->entered)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static void gate_open(gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void seq(int32_t *t, int64_t n, int32_t base)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

static kvt_remote *open_tier(kvt_io *io, kvt_store_identity *id, char *fp)
{
    store_identity(&KV, "remote-io", fp, id);
    kvt_remote_options o = {.io_timeout_ms = 2000, .quiet = 1, .worker = io};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(g_srv.url, id, &o, &r), 0);
    return r;
}

static kvt_remote_stats stats(kvt_remote *r)
{
    kvt_remote_stats st;
    assert_int_equal(kvt_remote_stats_get(r, &st), 0);
    return st;
}

/* spills: joined, withdrawn, dropped on a full worker queue */
static void spills_on_the_worker(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1, .max_ops = 3};
    kvt_io *io = NULL;
    assert_int_equal(kvt_io_create(&io_o, &io), 0);
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_remote *r = open_tier(io, &id, fp);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    gate g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
    gate_hold(io, &g); /* one of the three slots */
    int32_t a[12], b[16], c[20];
    seq(a, 12, 10);
    seq(b, 16, 500);
    seq(c, 20, 900);
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", a, 12, &e), 0);
    assert_int_equal(t.spill(t.self, &e), 0);
    assert_null(e.caches);
    assert_int_equal(store_make_entry(&KV, "", a, 12, &e), 0);
    assert_int_equal(t.spill(t.self, &e), 0); /* the same entry: joins */
    assert_null(e.caches);
    assert_int_equal(store_make_entry(&KV, "", b, 16, &e), 0);
    assert_int_equal(t.spill(t.self, &e), 0); /* the third slot */
    assert_int_equal(store_make_entry(&KV, "", c, 20, &e), 0);
    assert_int_equal(t.spill(t.self, &e), KVT_EAGAIN); /* the worker's queue is full: dropped, still ours */
    assert_non_null(e.caches);
    kvt_entry_clear(&e);
    kvt_remote_stats st = stats(r);
    assert_int_equal(st.dropped, 1);
    assert_int_equal(st.queued_entries, 2);
    assert_int_equal(t.pending(t.self, a, 12, ""), 1);
    assert_int_equal(t.pending(t.self, b, 16, ""), 1);
    assert_int_equal(t.pending(t.self, c, 20, ""), 0);
    assert_int_equal(t.withdraw(t.self, b, 16, ""), 0); /* queued: taken back */
    assert_int_equal(t.pending(t.self, b, 16, ""), 0);
    assert_int_equal(t.withdraw(t.self, b, 16, ""), KVT_ENOTFOUND);
    kvt_io_stats ios;
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_SET].submitted, 3);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_SET].coalesced, 1);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_SET].refused, 1);
    gate_open(&g);
    assert_int_equal(t.flush(t.self), 0);
    assert_int_equal(stats(r).queued_entries, 0);
    kvt_cold_hit h;
    assert_int_equal(t.find_exact(t.self, a, 12, "", &h), 0);
    assert_int_equal(t.find_exact(t.self, b, 16, "", &h), KVT_ENOTFOUND); /* withdrawn: never written */
    assert_int_equal(stats(r).writes, 1);
    assert_int_equal(kvt_remote_close(r), 0);
    kvt_io_destroy(io);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "FLUSHALL"), 0);
}

typedef struct acb {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *n_done;
    int status;
    kvt_entry e;
} acb;

static void async_done(void *arg, int status, kvt_entry *e)
{
    acb *x = arg;
    pthread_mutex_lock(x->mu);
    x->status = status;
    if (e) {
        x->e = *e;
        memset(e, 0, sizeof *e);
    }
    (*x->n_done)++;
    pthread_cond_broadcast(x->cv);
    pthread_mutex_unlock(x->mu);
}

/* eight asynchronous restores of one handle: one read */
static void restores_coalesce(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1};
    kvt_io *io = NULL;
    assert_int_equal(kvt_io_create(&io_o, &io), 0);
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_remote *r = open_tier(io, &id, fp);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    assert_non_null(t.restore_async);
    int32_t a[24];
    seq(a, 24, 40);
    kvt_entry e, want;
    assert_int_equal(store_make_entry(&KV, "", a, 22, &e), 0);
    assert_int_equal(t.store(t.self, &e), 0);
    kvt_entry_clear(&e);
    kvt_cold_hit h;
    assert_int_equal(t.find(t.self, a, 24, "", &h), 0);
    assert_int_equal(h.prefix_len, 22);
    gate g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
    gate_hold(io, &g);
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int n_done = 0;
    acb x[8];
    for (int i = 0; i < 8; i++) {
        x[i] = (acb){.mu = &mu, .cv = &cv, .n_done = &n_done};
        assert_int_equal(t.restore_async(t.self, h.handle, async_done, &x[i]), 0);
    }
    uint64_t restores0 = stats(r).restores;
    gate_open(&g);
    pthread_mutex_lock(&mu);
    while (n_done < 8)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    assert_int_equal(store_make_entry(&KV, "", a, 22, &want), 0);
    for (int i = 0; i < 8; i++) {
        assert_int_equal(x[i].status, 0);
        assert_int_equal(store_entry_diff(&x[i].e, &want), 0);
        kvt_entry_clear(&x[i].e);
    }
    kvt_entry_clear(&want);
    assert_int_equal(stats(r).restores - restores0, 1);
    assert_int_equal(kvt_io_flush(io, UINT64_MAX), 0);
    kvt_io_stats ios;
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_GET].ran, 1);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_GET].coalesced, 7);
    /* a stale handle: told once, with the error */
    int n2 = 0;
    acb y = {.mu = &mu, .cv = &cv, .n_done = &n2};
    assert_int_equal(t.restore_async(t.self, 987654321, async_done, &y), 0);
    pthread_mutex_lock(&mu);
    while (n2 < 1)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    assert_int_equal(y.status, KVT_ENOTFOUND);
    assert_int_equal(kvt_remote_close(r), 0);
    kvt_io_destroy(io);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "FLUSHALL"), 0);
}

int main(void)
{
    if (!redis_available("test_remote_io"))
        return 0;
    if (redis_start(&g_srv, 64, NULL)) {
        fprintf(stderr, "test_remote_io: cannot start redis-server\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(spills_on_the_worker),
        cmocka_unit_test(restores_coalesce),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    redis_stop(&g_srv);
    return failed ? 1 : 0;
}
