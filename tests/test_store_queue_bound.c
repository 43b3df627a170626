/*
 * test_store_queue_bound.c: the SSD tier's write-behind queue is bounded in
 * bytes (DESIGN.md 4). With the writer held inside its first pwrite, entries
 * are queued until the pending bytes would pass the bound: an entry that
 * makes them exactly the bound is accepted, the next one (pending bytes
 * still at the bound, not over it) is a counted drop that stays the
 * caller's; the pending bytes go back to 0 once the writes are done, and
 * the dropped entry then goes through. One entry alone larger than the
 * bound is accepted into an empty queue (never a drop of everything), but
 * nothing joins it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "pc_util.h"
#include "store_util.h"

#include "kvtier/cache.h"
#include "kvtier/store.h"

#include <stdio.h>
#include <string.h>

static const store_cfg CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};

typedef struct fx {
    char root[512];
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    store_faults fl;
    kvt_store_io io;
    kvt_store *s;
} fx;

/* The bytes the write-behind queue charges for an entry: its caches' bytes
 * (the entries here have no attachment). */
static uint64_t queued_bytes(const kvt_entry *e)
{
    uint64_t b = 0;
    for (int32_t l = 0; l < e->n_caches; l++)
        b += kvt_cache_bytes(e->caches[l]);
    return b;
}

/* Entry i: 10 tokens starting at 1 + 100 i (no two share a block). */
static void make(int i, int32_t *t, kvt_entry *e)
{
    pcu_seq(t, 10, 1 + 100 * i);
    assert_int_equal(store_make_entry(&CFG, "", t, 10, e), 0);
}

static void fx_open(fx *f, const char *tag, uint64_t queue_max_bytes)
{
    memset(f, 0, sizeof *f);
    store_tmpdir(f->root, sizeof f->root, tag);
    assert_true(f->root[0] != '\0');
    store_identity(&CFG, "model-a", f->fp, &f->id);
    store_faults_init(&f->fl, &f->io);
    kvt_store_options o = {.io = &f->io, .queue_max_bytes = queue_max_bytes};
    int rc = kvt_store_open(f->root, &f->id, &o, &f->s);
    if (rc)
        fprintf(stderr, "open: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
}

static void fx_close(fx *f)
{
    store_faults_gate(&f->fl, 0);
    assert_int_equal(kvt_store_close(f->s), 0);
    f->s = NULL;
    store_rmtree(f->root);
}

/* The case's store, closed here also when an assertion failed with the
 * writer held at the gate (else the next case's writes would wait behind
 * it on the shared I/O worker). */
static fx F;

static int fx_teardown(void **state)
{
    (void)state;
    if (F.s) {
        store_faults_gate(&F.fl, 0);
        (void)kvt_store_close(F.s);
        F.s = NULL;
        store_rmtree(F.root);
    }
    return 0;
}

static kvt_store_stats stats(kvt_store *s)
{
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    return st;
}

/* bound = two entries: the second fills it exactly, the third is dropped */
static void bound_in_bytes(void **state)
{
    (void)state;
    int32_t t[3][10];
    kvt_entry e[3];
    for (int i = 0; i < 3; i++)
        make(i, t[i], &e[i]);
    uint64_t b = queued_bytes(&e[0]);
    assert_true(b > 0);
    assert_int_equal(queued_bytes(&e[1]), b);
    assert_int_equal(queued_bytes(&e[2]), b);
    fx_open(&F, "qbound", 2 * b);
    store_faults_gate(&F.fl, 1);
    assert_int_equal(kvt_store_put_async(F.s, &e[0]), 0);
    store_faults_wait_blocked(&F.fl, 1); /* the writer is inside e[0]'s first pwrite */
    assert_int_equal(stats(F.s).pending_bytes, b);
    /* pending + this entry == the bound: it fits */
    assert_int_equal(kvt_store_put_async(F.s, &e[1]), 0);
    assert_null(e[1].caches); /* the queue's now */
    kvt_store_stats st = stats(F.s);
    assert_int_equal(st.pending, 2);
    assert_int_equal(st.pending_bytes, 2 * b);
    assert_int_equal(st.dropped, 0);
    /* the pending bytes are at the bound, not over it: this one would pass it */
    assert_int_equal(kvt_store_put_async(F.s, &e[2]), KVT_EAGAIN);
    assert_non_null(e[2].caches); /* still the caller's */
    st = stats(F.s);
    assert_int_equal(st.pending, 2);
    assert_int_equal(st.pending_bytes, 2 * b);
    assert_int_equal(st.dropped, 1);
    assert_int_equal(kvt_store_pending(F.s, t[2], 10, ""), 0);
    /* the writes finish: the bytes leave the queue's count */
    store_faults_gate(&F.fl, 0);
    assert_int_equal(kvt_store_flush(F.s), 0);
    st = stats(F.s);
    assert_int_equal(st.pending, 0);
    assert_int_equal(st.pending_bytes, 0);
    assert_int_equal(kvt_store_contains(F.s, t[0], 10, ""), 1);
    assert_int_equal(kvt_store_contains(F.s, t[1], 10, ""), 1);
    assert_int_equal(kvt_store_contains(F.s, t[2], 10, ""), 0);
    /* room again: the dropped entry goes through, and so do two more rounds
     * (the bytes of the finished writes were given back each time) */
    assert_int_equal(kvt_store_put_async(F.s, &e[2]), 0);
    assert_int_equal(kvt_store_flush(F.s), 0);
    assert_int_equal(kvt_store_contains(F.s, t[2], 10, ""), 1);
    for (int round = 0; round < 2; round++) {
        int32_t u[2][10];
        kvt_entry g[2];
        store_faults_gate(&F.fl, 1);
        for (int i = 0; i < 2; i++) {
            make(3 + 2 * round + i, u[i], &g[i]);
            assert_int_equal(kvt_store_put_async(F.s, &g[i]), 0);
            if (i == 0)
                store_faults_wait_blocked(&F.fl, 1);
        }
        assert_int_equal(stats(F.s).pending_bytes, 2 * b);
        store_faults_gate(&F.fl, 0);
        assert_int_equal(kvt_store_flush(F.s), 0);
        assert_int_equal(stats(F.s).pending_bytes, 0);
    }
    st = stats(F.s);
    assert_int_equal(st.dropped, 1);
    assert_int_equal(st.written, 7);
    kvt_entry_clear(&e[2]);
    fx_close(&F);
}

/* bound below one entry: a lone entry is accepted, nothing joins it */
static void lone_entry_over_bound(void **state)
{
    (void)state;
    int32_t t[2][10];
    kvt_entry e[2];
    for (int i = 0; i < 2; i++)
        make(i, t[i], &e[i]);
    uint64_t b = queued_bytes(&e[0]);
    fx_open(&F, "qlone", b / 2);
    store_faults_gate(&F.fl, 1);
    assert_int_equal(kvt_store_put_async(F.s, &e[0]), 0);
    store_faults_wait_blocked(&F.fl, 1);
    kvt_store_stats st = stats(F.s);
    assert_int_equal(st.pending, 1);
    assert_int_equal(st.pending_bytes, b);
    assert_int_equal(kvt_store_put_async(F.s, &e[1]), KVT_EAGAIN);
    assert_non_null(e[1].caches);
    assert_int_equal(stats(F.s).dropped, 1);
    store_faults_gate(&F.fl, 0);
    assert_int_equal(kvt_store_flush(F.s), 0);
    assert_int_equal(kvt_store_contains(F.s, t[0], 10, ""), 1);
    /* the queue is empty again: the other entry is accepted alone */
    assert_int_equal(kvt_store_put_async(F.s, &e[1]), 0);
    assert_int_equal(kvt_store_flush(F.s), 0);
    assert_int_equal(kvt_store_contains(F.s, t[1], 10, ""), 1);
    assert_int_equal(stats(F.s).pending_bytes, 0);
    fx_close(&F);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(bound_in_bytes, fx_teardown),
        cmocka_unit_test_teardown(lone_entry_over_bound, fx_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
