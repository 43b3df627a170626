/*
 * test_store_io.c: the SSD tier on the I/O worker (kvtier/io.h). Sixteen
 * asynchronous restores of one handle make one read (fifteen waiters
 * coalesced, each with its own exact entry), and so do sixteen threads
 * calling the synchronous kvt_store_restore at once; an asynchronous restore queued
 * behind write-behind still runs first (foreground priority); a full worker
 * queue is a counted write-behind drop with the entry left to the caller;
 * an identical write-behind joins the queued one; a large shard's hash is a
 * worker operation, and a put finishes even while every worker thread is
 * busy (the writer runs the hash itself); stores without a worker share the
 * process default, which the last close ends.
 *
 * What a case holds lives in file scope (C below) and a teardown releases
 * it: a case that fails while its gate holds the worker's one thread
 * (cmocka leaves the case by longjmp) must not leave the thread waiting on
 * a dead stack frame, the shim armed or the store open.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "io_shim.h"
#include "pc_util.h"
#include "store_util.h"

#include "kvtier/cache.h"
#include "io_gate.h"
#include "kvtier/io.h"
#include "kvtier/store.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const store_cfg CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};

/* ---- restore callbacks --------------------------------------------------------- */

typedef struct acb {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *n_done;
    int status, done;
    int pending_at_done; /* kvt_store_pending of `watch` when done ran */
    kvt_store *s;
    const int32_t *watch;
    int64_t n_watch;
    kvt_entry e;
} acb;

static void async_done(void *arg, int status, kvt_entry *e)
{
    acb *a = arg;
    int pend = a->watch ? kvt_store_pending(a->s, a->watch, a->n_watch, "") : -1;
    pthread_mutex_lock(a->mu);
    a->status = status;
    a->pending_at_done = pend;
    if (e) {
        a->e = *e;
        memset(e, 0, sizeof *e);
    }
    a->done = 1;
    (*a->n_done)++;
    pthread_cond_broadcast(a->cv);
    pthread_mutex_unlock(a->mu);
}

/* Waits until n callbacks ran (bounded: io_gate_wait_count). */
static void wait_done(pthread_mutex_t *mu, pthread_cond_t *cv, int *n_done, int n)
{
    io_gate_wait_count(mu, cv, n_done, n, "restore callbacks");
}

typedef struct fx {
    char root[512], fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    kvt_store *s; /* NULL once closed */
} fx;

/* What the running case holds, for its teardown: its worker, its gate, its
 * stores, and the state its restore callbacks write into (a restore the
 * teardown's open gate lets run must find it alive). */
static struct {
    kvt_io *io;
    io_gate gate;
    fx f[2];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_done;
    acb a[17];
} C = {.gate = IO_GATE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static kvt_io *io_new(const kvt_io_options *o)
{
    assert_int_equal(kvt_io_create(o, &C.io), 0);
    return C.io;
}

static void io_end(void)
{
    kvt_io_destroy(C.io);
    C.io = NULL;
}

/* A callback's state in C.a[i], counting into C.n_done. */
static acb *cb(int i)
{
    C.a[i] = (acb){.mu = &C.mu, .cv = &C.cv, .n_done = &C.n_done};
    return &C.a[i];
}

static kvt_store *fx_open(fx *f, const char *tag, const store_cfg *cfg, kvt_io *worker)
{
    store_tmpdir(f->root, sizeof f->root, tag);
    store_identity(cfg, "io-model", f->fp, &f->id);
    kvt_store_options o = {.worker = worker};
    assert_int_equal(kvt_store_open(f->root, &f->id, &o, &f->s), 0);
    return f->s;
}

static void fx_close(fx *f)
{
    kvt_store *s = f->s;
    f->s = NULL;
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f->root);
}

/* After every case, passed or failed: the shim disarmed, the gate open (what
 * it held runs: restores call back into C.a), the stores closed (their
 * write-behind flushed), the worker ended. */
static int case_teardown(void **state)
{
    (void)state;
    kvt__io_disarm();
    io_gate_open(&C.gate);
    for (int i = 0; i < 2; i++)
        if (C.f[i].s) {
            (void)kvt_store_close(C.f[i].s);
            C.f[i].s = NULL;
            store_rmtree(C.f[i].root);
        }
    if (C.io)
        io_end();
    C.n_done = 0;
    return 0;
}

static void put_tokens(kvt_store *s, const store_cfg *cfg, const int32_t *t, int64_t n)
{
    kvt_entry e;
    assert_int_equal(store_make_entry(cfg, "", t, n, &e), 0);
    assert_int_equal(kvt_store_put(s, &e), 0);
    kvt_entry_clear(&e);
}

/* ---- tests ---------------------------------------------------------------------- */

/* 16 asynchronous restores of one handle while the worker's one thread is
 * busy: one read, 15 coalesced, every waiter its own exact entry. */
static void sixteen_restores_one_read(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1};
    kvt_io *io = io_new(&io_o);
    kvt_store *s = fx_open(&C.f[0], "io-16", &CFG, io);
    int32_t t[21];
    pcu_seq(t, 21, 3);
    put_tokens(s, &CFG, t, 21);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 21, "", &hit), 0);
    kvt_store_stats st0;
    kvt_store_get_stats(s, &st0);

    io_gate_hold(io, &C.gate, (kvt_io_key){1, 0x6a7e}, KVT_IO_FOREGROUND);
    acb *a = C.a;
    C.n_done = 0;
    for (int i = 0; i < 16; i++)
        assert_int_equal(kvt_store_restore_async(s, hit.handle, async_done, cb(i)), 0);
    kvt_io_stats ios;
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].submitted, 16);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].coalesced, 15);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].queued_ops, 1);
    io_gate_open(&C.gate);
    wait_done(&C.mu, &C.cv, &C.n_done, 16);
    kvt_entry want;
    assert_int_equal(store_make_entry(&CFG, "", t, 21, &want), 0);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(a[i].status, 0);
        assert_int_equal(store_entry_diff(&a[i].e, &want), 0);
        for (int j = 0; j < i; j++)
            assert_ptr_not_equal(a[i].e.caches[0], a[j].e.caches[0]); /* each its own clone */
    }
    for (int i = 0; i < 16; i++)
        kvt_entry_clear(&a[i].e);
    kvt_entry_clear(&want);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.restores - st0.restores, 1); /* one read */
    assert_int_equal(kvt_io_flush(io, UINT64_MAX), 0);
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].ran, 1);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].queued_ops, 0);
    /* a later restore of the same handle is a new read */
    acb *b = cb(16);
    assert_int_equal(kvt_store_restore_async(s, hit.handle, async_done, b), 0);
    wait_done(&C.mu, &C.cv, &C.n_done, 17);
    assert_int_equal(b->status, 0);
    kvt_entry_clear(&b->e);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.restores - st0.restores, 2);
    fx_close(&C.f[0]);
    io_end();
}

/* ---- sixteen synchronous restores ----------------------------------------------- */

typedef struct sync_fx {
    kvt_store *s;
    kvt_io *io;
    uint64_t handle;
    pthread_barrier_t start;
    atomic_int held;   /* the read was held at its first file call */
    kvt_entry e[16];
    int status[16];
} sync_fx;

typedef struct sync_arg {
    sync_fx *fx;
    int i;
} sync_arg;

/* The shim's hook on the reading thread: its first file call waits until
 * the other fifteen restores have joined the read (at most 20 s). */
static void hold_read(void *ctx, kvt__io_op op)
{
    (void)op;
    sync_fx *fx = ctx;
    if (atomic_exchange(&fx->held, 1))
        return;
    for (int i = 0; i < 20000; i++) {
        kvt_io_stats ios;
        if (kvt_io_stats_get(fx->io, &ios) == 0 && ios.by_kind[KVT_IO_KIND_RESTORE].coalesced >= 15)
            return;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

static void *sync_main(void *p)
{
    sync_arg *a = p;
    pthread_barrier_wait(&a->fx->start);
    a->fx->status[a->i] = kvt_store_restore(a->fx->s, a->fx->handle, NULL, 0, &a->fx->e[a->i]);
    return NULL;
}

/* 16 threads call kvt_store_restore on one handle at once: the read is
 * one operation of the worker (run by one of the callers), the other 15
 * join it, each caller gets its own exact entry; the shards are opened once
 * (the I/O shim counts the file calls) and the store counts one restore. */
static void sixteen_sync_restores_one_read(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1};
    kvt_io *io = io_new(&io_o);
    kvt_store *s = fx_open(&C.f[0], "io-sync16", &CFG, io);
    int32_t t[21];
    pcu_seq(t, 21, 5);
    put_tokens(s, &CFG, t, 21);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 21, "", &hit), 0);
    /* the file calls of one restore, alone */
    kvt__io_fault count = {.ops = 1u << KVT_IO_OPEN};
    kvt__io_arm(&count);
    kvt_entry one;
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 21, &one), 0);
    int64_t opens_one = kvt__io_calls();
    kvt__io_disarm();
    kvt_entry_clear(&one);
    assert_true(opens_one >= 2); /* the entry shard and its blocks */
    kvt_store_stats st0;
    kvt_store_get_stats(s, &st0);
    kvt_io_stats io0;
    assert_int_equal(kvt_io_stats_get(io, &io0), 0);

    sync_fx *sf = calloc(1, sizeof *sf);
    assert_non_null(sf);
    sf->s = s;
    sf->io = io;
    sf->handle = hit.handle;
    assert_int_equal(pthread_barrier_init(&sf->start, NULL, 16), 0);
    kvt__io_fault hold = {.ops = 1u << KVT_IO_OPEN, .before = hold_read, .before_ctx = sf};
    kvt__io_arm(&hold);
    pthread_t th[16];
    sync_arg args[16];
    for (int i = 0; i < 16; i++) {
        args[i] = (sync_arg){sf, i};
        assert_int_equal(pthread_create(&th[i], NULL, sync_main, &args[i]), 0);
    }
    for (int i = 0; i < 16; i++)
        pthread_join(th[i], NULL);
    int64_t opens = kvt__io_calls();
    kvt__io_disarm();
    kvt_io_stats ios;
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    print_message("16 synchronous restores: %lld file opens (one restore alone: %lld), %llu coalesced\n",
                  (long long)opens, (long long)opens_one,
                  (unsigned long long)(ios.by_kind[KVT_IO_KIND_RESTORE].coalesced -
                                       io0.by_kind[KVT_IO_KIND_RESTORE].coalesced));
    assert_int_equal(atomic_load(&sf->held), 1);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].submitted - io0.by_kind[KVT_IO_KIND_RESTORE].submitted, 16);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].coalesced - io0.by_kind[KVT_IO_KIND_RESTORE].coalesced, 15);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_RESTORE].ran - io0.by_kind[KVT_IO_KIND_RESTORE].ran, 1);
    assert_int_equal(opens, opens_one); /* one read */
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.restores - st0.restores, 1);
    kvt_entry want;
    assert_int_equal(store_make_entry(&CFG, "", t, 21, &want), 0);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(sf->status[i], 0);
        assert_int_equal(store_entry_diff(&sf->e[i], &want), 0);
        for (int j = 0; j < i; j++)
            assert_ptr_not_equal(sf->e[i].caches[0], sf->e[j].caches[0]); /* each its own clone */
    }
    for (int i = 0; i < 16; i++)
        kvt_entry_clear(&sf->e[i]);
    kvt_entry_clear(&want);
    /* a stale handle still fails cleanly through the same path */
    kvt_entry none;
    assert_int_equal(kvt_store_restore(s, hit.handle + 1000, NULL, 0, &none), KVT_ENOTFOUND);
    pthread_barrier_destroy(&sf->start);
    free(sf);
    fx_close(&C.f[0]);
    io_end();
}

/* With the one worker thread busy, write-behind is queued, then a restore
 * is asked for: the restore runs first (the write is still pending when
 * its callback runs), then the write. */
static void restore_before_write_behind(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1};
    kvt_io *io = io_new(&io_o);
    kvt_store *s = fx_open(&C.f[0], "io-prio", &CFG, io);
    int32_t a_t[12], b_t[16];
    pcu_seq(a_t, 12, 100);
    pcu_seq(b_t, 16, 200);
    put_tokens(s, &CFG, a_t, 12);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, a_t, 12, "", &hit), 0);

    io_gate_hold(io, &C.gate, (kvt_io_key){2, 0x6a7e}, KVT_IO_FOREGROUND);
    kvt_entry e;
    assert_int_equal(store_make_entry(&CFG, "", b_t, 16, &e), 0);
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    assert_int_equal(kvt_store_pending(s, b_t, 16, ""), 1);
    C.n_done = 0;
    acb *a = cb(0);
    a->s = s;
    a->watch = b_t;
    a->n_watch = 16;
    assert_int_equal(kvt_store_restore_async(s, hit.handle, async_done, a), 0);
    io_gate_open(&C.gate);
    wait_done(&C.mu, &C.cv, &C.n_done, 1);
    assert_int_equal(a->status, 0);
    assert_int_equal(a->pending_at_done, 1); /* the write-behind had not run yet */
    kvt_entry_clear(&a->e);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(kvt_store_pending(s, b_t, 16, ""), 0);
    assert_int_equal(kvt_store_contains(s, b_t, 16, ""), 1);
    fx_close(&C.f[0]);
    io_end();
}

/* A worker queue that holds nothing more refuses the write-behind: a
 * counted drop, the entry left to the caller, nothing pending. An
 * identical write-behind joins a queued one. */
static void full_queue_drops_and_identical_joins(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1, .max_ops = 2};
    kvt_io *io = io_new(&io_o);
    kvt_store *s = fx_open(&C.f[0], "io-full", &CFG, io);
    io_gate_hold(io, &C.gate, (kvt_io_key){3, 0x6a7e}, KVT_IO_FOREGROUND); /* one of the two slots */
    int32_t a_t[12], b_t[16];
    pcu_seq(a_t, 12, 300);
    pcu_seq(b_t, 16, 400);
    kvt_entry e;
    assert_int_equal(store_make_entry(&CFG, "", a_t, 12, &e), 0);
    assert_int_equal(kvt_store_put_async(s, &e), 0); /* the second slot */
    assert_null(e.caches);
    assert_int_equal(store_make_entry(&CFG, "", a_t, 12, &e), 0);
    assert_int_equal(kvt_store_put_async(s, &e), 0); /* identical: joins, takes no slot */
    assert_null(e.caches);
    assert_int_equal(store_make_entry(&CFG, "", b_t, 16, &e), 0);
    assert_int_equal(kvt_store_put_async(s, &e), KVT_EAGAIN);
    assert_non_null(e.caches); /* still the caller's */
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.dropped, 1);
    assert_int_equal(st.pending, 1);
    assert_int_equal(kvt_store_pending(s, b_t, 16, ""), 0);
    assert_int_equal(kvt_store_pending(s, a_t, 12, ""), 1);
    kvt_cold_hit h;
    assert_int_equal(kvt_store_find_exact(s, b_t, 16, "", &h), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_find_exact(s, a_t, 12, "", &h), 0); /* pending: findable */
    kvt_io_stats ios;
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_WRITE].refused, 1);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_WRITE].coalesced, 1);
    io_gate_open(&C.gate);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(kvt_store_contains(s, a_t, 12, ""), 1);
    assert_int_equal(kvt_store_contains(s, b_t, 16, ""), 0);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.written, 1);
    assert_int_equal(st.pending, 0);
    assert_int_equal(st.pending_bytes, 0);
    /* once there is room again, the dropped entry goes through */
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(kvt_store_contains(s, b_t, 16, ""), 1);
    fx_close(&C.f[0]);
    io_end();
}

/* Blocks of 4 MiB and more are hashed as worker operations; with the
 * worker's only thread busy the put still finishes (the writer runs the
 * queued hash itself), and what it wrote verifies. */
static void hash_on_the_worker(void **state)
{
    (void)state;
    static const store_cfg BIG = {.n_kv = 2, .kv_dim = 2048, .block = 256}; /* 4 MiB K+V per block */
    kvt_io_options io_o = {.threads = 1};
    kvt_io *io = io_new(&io_o);
    fx *f = &C.f[0];
    kvt_store *s = fx_open(f, "io-hash", &BIG, io);
    int32_t t[513];
    pcu_seq(t, 513, 9);
    put_tokens(s, &BIG, t, 512); /* two full blocks, the thread free */
    kvt_io_stats ios;
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_HASH].ran, 2);
    io_gate_hold(io, &C.gate, (kvt_io_key){4, 0x6a7e}, KVT_IO_FOREGROUND);
    int32_t u[513];
    pcu_seq(u, 513, 77);
    put_tokens(s, &BIG, u, 512); /* every thread busy: the put runs its hashes */
    assert_int_equal(kvt_io_stats_get(io, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_HASH].ran, 4);
    io_gate_open(&C.gate);
    f->s = NULL;
    assert_int_equal(kvt_store_close(s), 0);
    kvt_store_options o = {.worker = io, .verify = 1}; /* SHA-256 checked too */
    assert_int_equal(kvt_store_open(f->root, &f->id, &o, &f->s), 0);
    kvt_cold_hit h;
    kvt_entry got, want;
    const int32_t *seqs[2] = {t, u};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(kvt_store_find_exact(f->s, seqs[i], 512, "", &h), 0);
        assert_int_equal(kvt_store_restore(f->s, h.handle, seqs[i], 512, &got), 0);
        assert_int_equal(store_make_entry(&BIG, "", seqs[i], 512, &want), 0);
        assert_int_equal(store_entry_diff(&got, &want), 0);
        kvt_entry_clear(&got);
        kvt_entry_clear(&want);
    }
    fx_close(f);
    io_end();
}

/* Stores opened without a worker share the process default: one worker
 * while any is open, a fresh one after the last close. */
static void default_worker_shared(void **state)
{
    (void)state;
    fx *a = &C.f[0], *b = &C.f[1];
    fx_open(a, "io-def-a", &CFG, NULL);
    fx_open(b, "io-def-b", &CFG, NULL);
    kvt_io *d = NULL;
    assert_int_equal(kvt_io_default_acquire(&d), 0);
    int32_t t[8];
    pcu_seq(t, 8, 5);
    kvt_entry e;
    assert_int_equal(store_make_entry(&CFG, "", t, 8, &e), 0);
    assert_int_equal(kvt_store_put_async(a->s, &e), 0);
    assert_int_equal(store_make_entry(&CFG, "", t, 8, &e), 0);
    assert_int_equal(kvt_store_put_async(b->s, &e), 0); /* another store: not joined */
    assert_int_equal(kvt_store_flush(a->s), 0);
    assert_int_equal(kvt_store_flush(b->s), 0);
    assert_int_equal(kvt_store_contains(a->s, t, 8, ""), 1);
    assert_int_equal(kvt_store_contains(b->s, t, 8, ""), 1);
    kvt_io_stats ios;
    assert_int_equal(kvt_io_flush(d, UINT64_MAX), 0); /* a store's flush may return before the worker counts the run */
    assert_int_equal(kvt_io_stats_get(d, &ios), 0);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_WRITE].ran, 2);
    assert_int_equal(ios.by_kind[KVT_IO_KIND_WRITE].coalesced, 0);
    fx_close(a);
    fx_close(b);
    kvt_io_default_release(d); /* the last reference: destroyed */
    kvt_io *d2 = NULL;
    assert_int_equal(kvt_io_default_acquire(&d2), 0);
    assert_int_equal(kvt_io_stats_get(d2, &ios), 0);
    assert_int_equal(ios.submitted, 0); /* a new worker */
    kvt_io_default_release(d2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(sixteen_restores_one_read, case_teardown),
        cmocka_unit_test_teardown(sixteen_sync_restores_one_read, case_teardown),
        cmocka_unit_test_teardown(restore_before_write_behind, case_teardown),
        cmocka_unit_test_teardown(full_queue_drops_and_identical_joins, case_teardown),
        cmocka_unit_test_teardown(hash_on_the_worker, case_teardown),
        cmocka_unit_test_teardown(default_worker_shared, case_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
