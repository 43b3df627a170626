/*
 * test_remote_queue_bound.c: the remote tier's write-behind queue is
 * bounded in bytes (kvt_remote_options.queue_max_bytes), with a real
 * redis-server on loopback. With the I/O worker's one thread held, spills
 * are queued until the queued bytes would pass the bound: the entry that
 * makes them exactly the bound is accepted, the next one (queued bytes at
 * the bound, not over it) is a counted drop that stays the caller's; a
 * withdrawn entry and the written ones give their bytes back, after which
 * the dropped entry goes through. Skips when redis-server is not installed.
 * The worker, its gate and the tier live in file scope (C below) and a
 * teardown releases them: a failed assertion (cmocka leaves the case by
 * longjmp) must not leave the worker's thread waiting on a dead stack frame.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "redis_util.h"
#include "store_util.h"

#include "io_gate.h"
#include "kvtier/io.h"
#include "kvtier/remote.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};
static redis_srv g_srv;

/* What the case holds (its worker, gate and tier), for its teardown. */
static io_gate_case C = IO_GATE_CASE_INIT;

/* After the case, passed or failed: the gate open, the tier closed (its
 * queue written), the worker ended, Redis emptied. */
static int case_teardown(void **state)
{
    (void)state;
    io_gate_case_release(&C);
    return redis_cmd(g_srv.port, NULL, 0, NULL, "FLUSHALL");
}

/* Closes the case's tier, asserting it closed cleanly. */
static void tier_close(void)
{
    kvt_remote *r = C.r;
    C.r = NULL;
    assert_int_equal(kvt_remote_close(r), 0);
}

static kvt_remote *open_tier(kvt_io *io, kvt_store_identity *id, uint64_t queue_max_bytes)
{
    kvt_remote_options o = {.lookup_timeout_ms = 2000, .io_timeout_ms = 2000, .quiet = 1, .worker = io,
                            .queue_max_bytes = queue_max_bytes};
    kvt_remote *r = NULL;
    int rc = kvt_remote_open(g_srv.url, id, &o, &r);
    if (rc)
        fprintf(stderr, "open: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    C.r = r;
    return r;
}

static kvt_remote_stats stats(kvt_remote *r)
{
    kvt_remote_stats st;
    assert_int_equal(kvt_remote_stats_get(r, &st), 0);
    return st;
}

/* Entry i: 10 tokens starting at 1 + 100 i (no two share a block). */
static void make(int i, int32_t *t, kvt_entry *e)
{
    for (int k = 0; k < 10; k++)
        t[k] = 1 + 100 * i + k;
    assert_int_equal(store_make_entry(&KV, "", t, 10, e), 0);
}

static void bound_in_bytes(void **state)
{
    (void)state;
    kvt_io_options io_o = {.threads = 1, .max_ops = 16};
    assert_int_equal(kvt_io_create(&io_o, &C.io), 0);
    kvt_io *io = C.io;
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    store_identity(&KV, "remote-qbound", fp, &id);
    io_gate *g = &C.gate;
    int32_t t[4][10];
    kvt_entry e[4];
    for (int i = 0; i < 4; i++)
        make(i, t[i], &e[i]);

    /* the bytes one such entry holds in the queue (all four alike); taken
     * back before it is written */
    kvt_remote *r = open_tier(io, &id, 0);
    kvt_cold_tier ct;
    kvt_remote_cold_tier(r, &ct);
    io_gate_hold(io, g, (kvt_io_key){0x6a7e, 2}, KVT_IO_FOREGROUND);
    assert_int_equal(ct.spill(ct.self, &e[3]), 0);
    uint64_t b = stats(r).queued_bytes;
    assert_true(b > 0);
    assert_int_equal(ct.withdraw(ct.self, t[3], 10, ""), 0);
    assert_int_equal(stats(r).queued_bytes, 0);
    io_gate_open(g);
    tier_close();

    /* bound = two entries */
    r = open_tier(io, &id, 2 * b);
    kvt_remote_cold_tier(r, &ct);
    io_gate_hold(io, g, (kvt_io_key){0x6a7e, 2}, KVT_IO_FOREGROUND);
    assert_int_equal(ct.spill(ct.self, &e[0]), 0);
    assert_int_equal(stats(r).queued_bytes, b);
    assert_int_equal(ct.spill(ct.self, &e[1]), 0); /* queued + this == the bound: fits */
    assert_null(e[1].caches);
    kvt_remote_stats st = stats(r);
    assert_int_equal(st.queued_entries, 2);
    assert_int_equal(st.queued_bytes, 2 * b);
    assert_int_equal(st.dropped, 0);
    assert_int_equal(ct.spill(ct.self, &e[2]), KVT_EAGAIN); /* would pass the bound */
    assert_non_null(e[2].caches);                            /* still the caller's */
    st = stats(r);
    assert_int_equal(st.queued_entries, 2);
    assert_int_equal(st.queued_bytes, 2 * b);
    assert_int_equal(st.dropped, 1);
    assert_int_equal(ct.pending(ct.self, t[2], 10, ""), 0);
    /* a withdrawn entry gives its bytes back at once: room for the dropped one */
    assert_int_equal(ct.withdraw(ct.self, t[1], 10, ""), 0);
    assert_int_equal(stats(r).queued_bytes, b);
    assert_int_equal(ct.spill(ct.self, &e[2]), 0);
    assert_int_equal(stats(r).queued_bytes, 2 * b);
    io_gate_open(g);
    assert_int_equal(ct.flush(ct.self), 0);
    st = stats(r);
    assert_int_equal(st.queued_entries, 0);
    assert_int_equal(st.queued_bytes, 0);
    assert_int_equal(st.writes, 2);
    kvt_cold_hit h;
    assert_int_equal(ct.find_exact(ct.self, t[0], 10, "", &h), 0);
    assert_int_equal(ct.find_exact(ct.self, t[1], 10, "", &h), KVT_ENOTFOUND); /* withdrawn */
    assert_int_equal(ct.find_exact(ct.self, t[2], 10, "", &h), 0);
    /* the written entries gave their bytes back: two more fit again */
    make(1, t[1], &e[1]);
    make(3, t[3], &e[3]);
    io_gate_hold(io, g, (kvt_io_key){0x6a7e, 2}, KVT_IO_FOREGROUND);
    assert_int_equal(ct.spill(ct.self, &e[1]), 0);
    assert_int_equal(ct.spill(ct.self, &e[3]), 0);
    assert_int_equal(stats(r).queued_bytes, 2 * b);
    io_gate_open(g);
    assert_int_equal(ct.flush(ct.self), 0);
    st = stats(r);
    assert_int_equal(st.queued_bytes, 0);
    assert_int_equal(st.dropped, 1);
    assert_int_equal(st.writes, 4);
    tier_close();
}

int main(void)
{
    if (!redis_available("test_remote_queue_bound"))
        return 0;
    if (redis_start(&g_srv, 64, NULL)) {
        fprintf(stderr, "test_remote_queue_bound: cannot start redis-server\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(bound_in_bytes, case_teardown),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    redis_stop(&g_srv);
    return failed ? 1 : 0;
}
