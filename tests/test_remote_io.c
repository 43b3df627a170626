/*
 * test_remote_io.c: the remote tier on the I/O worker (kvtier/io.h), with a
 * real redis-server on loopback. With the worker's one thread held: the
 * same entry spilled twice is one write (the second joins the first), a
 * queued write can be withdrawn (it never reaches Redis), a full worker
 * queue is a counted drop with the entry left to the caller; eight
 * asynchronous restores of one handle make one read, each waiter with its
 * own exact entry; so do sixteen threads calling the synchronous restore at
 * once, and four synchronous stores of one entry are one write; the bytes
 * written per layer count only the records sent (blocks Redis held are
 * skipped); close waits for what is queued.
 *
 * What a case holds lives in file scope (C below) and a teardown releases
 * it: a case that fails while its gate holds the worker's one thread
 * (cmocka leaves the case by longjmp) must not leave the thread waiting on
 * a dead stack frame, the shim armed or the tier open.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "io_shim.h"
#include "redis_util.h"
#include "store_util.h"

#include "io_gate.h"
#include "kvtier/io.h"
#include "kvtier/remote.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};
static redis_srv g_srv;

static void seq(int32_t *t, int64_t n, int32_t base)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

typedef struct acb {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *n_done;
    int status;
    kvt_entry e;
} acb;

/* What the running case holds, for its teardown: its worker, its gate, its
 * tier, and the state its restore callbacks write into (a restore the
 * teardown's open gate lets run must find it alive). */
static struct {
    io_gate_case g; /* the worker, its gate, the tier */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_done;
    acb x[9];
} C = {.g = IO_GATE_CASE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static kvt_io *io_new(const kvt_io_options *o)
{
    assert_int_equal(kvt_io_create(o, &C.g.io), 0);
    return C.g.io;
}

/* Closes the case's tier (asserting it closed cleanly) and ends its worker. */
static void tier_end(void)
{
    kvt_remote *r = C.g.r;
    C.g.r = NULL;
    assert_int_equal(kvt_remote_close(r), 0);
    kvt_io_destroy(C.g.io);
    C.g.io = NULL;
}

/* Waits until n callbacks counted into C.n_done (bounded: io_gate_wait_count). */
static void wait_done(int n) { io_gate_wait_count(&C.mu, &C.cv, &C.n_done, n, "restore callbacks"); }

/* A callback's state in C.x[i], counting into C.n_done. */
static acb *cb(int i)
{
    C.x[i] = (acb){.mu = &C.mu, .cv = &C.cv, .n_done = &C.n_done};
    return &C.x[i];
}

/* After every case, passed or failed: the shim disarmed, the gate open (what
 * it held runs: restores call back into C.x), the tier closed (its queue
 * written), the worker ended, Redis emptied for the next case. */
static int case_teardown(void **state)
{
    (void)state;
    io_gate_case_release(&C.g);
    C.n_done = 0;
    return redis_cmd(g_srv.port, NULL, 0, NULL, "FLUSHALL");
}

static kvt_remote *open_tier(kvt_io *io, kvt_store_identity *id, char *fp)
{
    store_identity(&KV, "remote-io", fp, id);
    /* lookups get the same bound as other calls: under ASan on a loaded machine
     * the default 50 ms lookup bound can cut a find short (a shorter prefix is
     * a counted miss by design, but this test checks what was stored) */
    kvt_remote_options o = {.lookup_timeout_ms = 2000, .io_timeout_ms = 2000, .quiet = 1, .worker = io};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(g_srv.url, id, &o, &r), 0);
    C.g.r = r;
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
    kvt_io *io = io_new(&io_o);
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_remote *r = open_tier(io, &id, fp);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    io_gate_hold(io, &C.g.gate, (kvt_io_key){0x6a7e, 1}, KVT_IO_FOREGROUND); /* one of the three slots */
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
    io_gate_open(&C.g.gate);
    assert_int_equal(t.flush(t.self), 0);
    assert_int_equal(stats(r).queued_entries, 0);
    kvt_cold_hit h;
    assert_int_equal(t.find_exact(t.self, a, 12, "", &h), 0);
    assert_int_equal(t.find_exact(t.self, b, 16, "", &h), KVT_ENOTFOUND); /* withdrawn: never written */
    assert_int_equal(stats(r).writes, 1);
    tier_end();
}

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
    kvt_io *io = io_new(&io_o);
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
    io_gate_hold(io, &C.g.gate, (kvt_io_key){0x6a7e, 1}, KVT_IO_FOREGROUND);
    acb *x = C.x;
    C.n_done = 0;
    for (int i = 0; i < 8; i++)
        assert_int_equal(t.restore_async(t.self, h.handle, async_done, cb(i)), 0);
    uint64_t restores0 = stats(r).restores;
    io_gate_open(&C.g.gate);
    wait_done(8);
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
    acb *y = cb(8);
    assert_int_equal(t.restore_async(t.self, 987654321, async_done, y), 0);
    wait_done(9);
    assert_int_equal(y->status, KVT_ENOTFOUND);
    tier_end();
}

/* ---- synchronous restores and stores from many threads ---------------------------- */

typedef struct sync_fx {
    kvt_cold_tier t;
    kvt_io *io;
    kvt_io_kind kind;      /* what the held call waits for: this kind's coalesced count */
    uint64_t want;         /* ... reaching this */
    uint64_t handle;
    const kvt_entry *store; /* NULL: restore */
    pthread_barrier_t start;
    atomic_int held;
    kvt_entry e[16];
    int status[16];
} sync_fx;

typedef struct sync_arg {
    sync_fx *fx;
    int i;
} sync_arg;

/* The shim's hook: the first network send (of the one thread doing the
 * I/O) waits until the other callers have joined its operation (at most 20 s). */
static void hold_send(void *ctx, kvt__io_op op)
{
    sync_fx *fx = ctx;
    if (op != KVT_IO_SEND || atomic_exchange(&fx->held, 1))
        return;
    for (int i = 0; i < 20000; i++) {
        kvt_io_stats ios;
        if (kvt_io_stats_get(fx->io, &ios) == 0 && ios.by_kind[fx->kind].coalesced >= fx->want)
            return;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

static void *sync_main(void *p)
{
    sync_arg *a = p;
    sync_fx *fx = a->fx;
    pthread_barrier_wait(&fx->start);
    fx->status[a->i] = fx->store ? fx->t.store(fx->t.self, fx->store) : fx->t.restore(fx->t.self, fx->handle, &fx->e[a->i]);
    return NULL;
}

/* Runs n threads at once (restores of fx->handle, or stores of fx->store)
 * with the first network send held; returns the sends counted. */
static int64_t run_held(sync_fx *fx, int n)
{
    assert_int_equal(pthread_barrier_init(&fx->start, NULL, (unsigned)n), 0);
    atomic_store(&fx->held, 0);
    kvt__io_fault hold = {.ops = 1u << KVT_IO_SEND, .before = hold_send, .before_ctx = fx};
    kvt__io_arm(&hold);
    pthread_t th[16];
    sync_arg args[16];
    for (int i = 0; i < n; i++) {
        args[i] = (sync_arg){fx, i};
        assert_int_equal(pthread_create(&th[i], NULL, sync_main, &args[i]), 0);
    }
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    int64_t sends = kvt__io_calls();
    kvt__io_disarm();
    pthread_barrier_destroy(&fx->start);
    assert_int_equal(atomic_load(&fx->held), 1);
    return sends;
}

/* 16 threads restore one handle through the synchronous restore: one read
 * (one pipeline of GETs, the remote tier counts one restore), each caller
 * its own exact entry; 4 threads store one entry: one write. */
static void sync_calls_coalesce(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1};
    kvt_io *io = io_new(&io_o);
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_remote *r = open_tier(io, &id, fp);
    sync_fx *fx = calloc(1, sizeof *fx);
    assert_non_null(fx);
    kvt_remote_cold_tier(r, &fx->t);
    fx->io = io;
    int32_t a[24];
    seq(a, 24, 70);
    kvt_entry e, want;
    assert_int_equal(store_make_entry(&KV, "", a, 22, &e), 0);
    /* four stores of one entry at once: one write (the others join it) */
    fx->kind = KVT_IO_KIND_REMOTE_SET;
    fx->want = 3;
    fx->store = &e;
    uint64_t writes0 = stats(r).writes;
    run_held(fx, 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(fx->status[i], 0);
    assert_int_equal(stats(r).writes - writes0, 1);
    kvt_entry_clear(&e);
    kvt_cold_hit h;
    assert_int_equal(fx->t.find(fx->t.self, a, 24, "", &h), 0);
    assert_int_equal(h.prefix_len, 22);
    /* the sends of one restore, alone */
    kvt__io_fault count = {.ops = 1u << KVT_IO_SEND};
    kvt__io_arm(&count);
    kvt_entry one;
    assert_int_equal(fx->t.restore(fx->t.self, h.handle, &one), 0);
    int64_t sends_one = kvt__io_calls();
    kvt__io_disarm();
    kvt_entry_clear(&one);
    assert_true(sends_one >= 1);
    kvt_io_stats io0;
    assert_int_equal(kvt_io_stats_get(io, &io0), 0);
    uint64_t restores0 = stats(r).restores;
    fx->kind = KVT_IO_KIND_REMOTE_GET;
    fx->want = io0.by_kind[KVT_IO_KIND_REMOTE_GET].coalesced + 15;
    fx->store = NULL;
    fx->handle = h.handle;
    int64_t sends = run_held(fx, 16);
    kvt_io_stats ios;
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    print_message("16 synchronous restores: %lld sends (one restore alone: %lld)\n", (long long)sends,
                  (long long)sends_one);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_GET].submitted - io0.by_kind[KVT_IO_KIND_REMOTE_GET].submitted, 16);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_GET].coalesced - io0.by_kind[KVT_IO_KIND_REMOTE_GET].coalesced, 15);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_REMOTE_GET].ran - io0.by_kind[KVT_IO_KIND_REMOTE_GET].ran, 1);
    assert_int_equal(sends, sends_one);
    assert_int_equal(stats(r).restores - restores0, 1);
    assert_int_equal(store_make_entry(&KV, "", a, 22, &want), 0);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(fx->status[i], 0);
        assert_int_equal(store_entry_diff(&fx->e[i], &want), 0);
        for (int j = 0; j < i; j++)
            assert_ptr_not_equal(fx->e[i].caches[0], fx->e[j].caches[0]);
    }
    for (int i = 0; i < 16; i++)
        kvt_entry_clear(&fx->e[i]);
    kvt_entry_clear(&want);
    /* a stale handle fails cleanly through the same path */
    assert_int_equal(fx->t.restore(fx->t.self, 987654321, &one), KVT_ENOTFOUND);
    free(fx);
    tier_end();
}

/* Bytes written per layer: the tensors of the records sent, so a block
 * Redis already holds adds nothing; the table's layer_bytes says they are
 * bytes written (Redis evicts on its own), with the same figures. */
static void layer_written_bytes(void **state)
{
    (void)state;
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_remote *r = open_tier(NULL, &id, fp);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    assert_non_null(t.layer_bytes);
    uint64_t w[3] = {7, 7, 7};
    assert_int_equal(kvt_remote_layer_written_bytes(r, 3, w), 0);
    assert_int_equal(w[0] + w[1] + w[2], 0);
    int32_t a[30];
    seq(a, 30, 300);
    kvt_entry e;
    /* 22 tokens: blocks [0,20) of 4 tokens and the entry record's tail [20,22) */
    assert_int_equal(store_make_entry(&KV, "", a, 22, &e), 0);
    assert_int_equal(t.store(t.self, &e), 0);
    kvt_entry_clear(&e);
    assert_int_equal(kvt_remote_layer_written_bytes(r, 3, w), 0);
    assert_true(w[0] > 0);
    assert_int_equal(w[0] % 22, 0);
    uint64_t per_token = w[0] / 22; /* every token's K and V of one layer */
    assert_int_equal(w[1], w[0]); /* both kv layers alike */
    assert_int_equal(w[2], 0);    /* no third layer */
    /* 30 tokens over the same start: blocks [0,20) are in Redis (skipped);
     * blocks [20,28) and the tail [28,30) are sent: 10 tokens */
    assert_int_equal(store_make_entry(&KV, "", a, 30, &e), 0);
    assert_int_equal(t.store(t.self, &e), 0);
    kvt_entry_clear(&e);
    uint64_t w2[2];
    assert_int_equal(kvt_remote_layer_written_bytes(r, 2, w2), 0);
    assert_int_equal(w2[0] - w[0], 10 * per_token);
    assert_int_equal(w2[1] - w[1], 10 * per_token);
    assert_true(stats(r).writes_skipped >= 5);
    uint64_t via[2] = {0, 0};
    assert_int_equal(t.layer_bytes(t.self, 2, via), KVT_LAYER_BYTES_WRITTEN);
    assert_int_equal(via[0], w2[0]);
    assert_int_equal(via[1], w2[1]);
    assert_int_equal(kvt_remote_layer_written_bytes(NULL, 2, w2), KVT_EINVAL);
    assert_int_equal(kvt_remote_layer_written_bytes(r, 2, NULL), KVT_EINVAL);
    tier_end();
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
        cmocka_unit_test_teardown(spills_on_the_worker, case_teardown),
        cmocka_unit_test_teardown(restores_coalesce, case_teardown),
        cmocka_unit_test_teardown(sync_calls_coalesce, case_teardown),
        cmocka_unit_test_teardown(layer_written_bytes, case_teardown),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    redis_stop(&g_srv);
    return failed ? 1 : 0;
}
