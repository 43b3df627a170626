/*
 * test_store_pending.c: an entry whose write-behind is queued or in flight
 * is found by kvt_store_find / kvt_store_find_exact and restored from the
 * queue's own caches (zero-copy clones), synchronously and on the restore
 * threads, while the write path is held up (the store's io hooks block every
 * pwrite); the handle stays valid once the write is durable; the queued
 * entry's hook runs only after the writer is done AND the last restored clone
 * is gone; a longer pending prefix beats a shorter durable one.
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

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

static const store_cfg CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};

/* The fault gate a case closed and its store, opened and closed by
 * gate_teardown when an assertion failed while the writer was held (else
 * that writer waits forever and every later case's writes queue behind it
 * on the shared I/O worker: the program hangs instead of failing; closing
 * runs the held entry's hook before the next case counts hooks). The gated
 * case keeps its fault layer static, so it outlives the case's stack. */
static store_faults *g_gate;
static kvt_store *g_store;

static int gate_teardown(void **state)
{
    (void)state;
    if (g_gate)
        store_faults_gate(g_gate, 0);
    if (g_store)
        (void)kvt_store_close(g_store);
    g_gate = NULL;
    g_store = NULL;
    return 0;
}

static _Atomic int hook_runs;
static void count_hook(void *ctx)
{
    (void)ctx;
    atomic_fetch_add(&hook_runs, 1);
}

typedef struct acb {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, status;
    kvt_entry e;
} acb;

static void async_done(void *arg, int status, kvt_entry *e)
{
    acb *a = arg;
    pthread_mutex_lock(&a->mu);
    a->status = status;
    if (e) {
        a->e = *e; /* moved out */
        memset(e, 0, sizeof *e);
    }
    a->done = 1;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

static void found_and_restored_while_pending(void **state)
{
    (void)state;
    char root[512], fp[KVT_STORE_FINGERPRINT_LEN];
    store_tmpdir(root, sizeof root, "pend");
    kvt_store_identity id;
    store_identity(&CFG, "model-p", fp, &id);
    static store_faults fl;
    static kvt_store_io io;
    store_faults_init(&fl, &io);
    g_gate = &fl;
    kvt_store_options o = {.io = &io};
    kvt_store *s = NULL;
    assert_int_equal(kvt_store_open(root, &id, &o, &s), 0);
    g_store = s;
    int32_t t[16];
    pcu_seq(t, 16, 1);
    /* a short durable entry first */
    kvt_entry e;
    assert_int_equal(store_make_entry(&CFG, "", t, 6, &e), 0);
    assert_int_equal(kvt_store_put(s, &e), 0);
    kvt_entry_clear(&e);
    /* then a longer one whose write is held inside pwrite */
    store_faults_gate(&fl, 1);
    assert_int_equal(store_make_entry(&CFG, "", t, 10, &e), 0);
    atomic_store(&hook_runs, 0);
    e.hook = (kvt_hook){count_hook, NULL};
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    store_faults_wait_blocked(&fl, 1);
    assert_int_equal(kvt_store_pending(s, t, 10, ""), 1);
    assert_int_equal(kvt_store_contains(s, t, 10, ""), 0); /* not durable */
    kvt_cold_hit hit, hx;
    assert_int_equal(kvt_store_find(s, t, 16, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 10); /* the pending one, not the durable 6 */
    assert_int_equal(hit.n_tokens, 10);
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hx), 0);
    assert_int_equal(hx.handle, hit.handle);
    assert_int_equal(kvt_store_find(s, t, 16, "other", &hx), KVT_ENOTFOUND);
    /* restored from the queue: identical state */
    kvt_entry got, want;
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 16, &got), 0);
    assert_int_equal(store_make_entry(&CFG, "", t, 10, &want), 0);
    assert_int_equal(store_entry_diff(&got, &want), 0);
    /* a prompt that differs is a miss, never the pending state */
    int32_t other[16];
    memcpy(other, t, sizeof other);
    other[3] = 777;
    kvt_entry bad;
    assert_int_equal(kvt_store_restore(s, hit.handle, other, 16, &bad), KVT_ENOTFOUND);
    /* and on a restore thread */
    acb a = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, {0}};
    assert_int_equal(kvt_store_restore_async(s, hit.handle, async_done, &a), 0);
    pthread_mutex_lock(&a.mu);
    while (!a.done)
        pthread_cond_wait(&a.cv, &a.mu);
    pthread_mutex_unlock(&a.mu);
    assert_int_equal(a.status, 0);
    assert_int_equal(store_entry_diff(&a.e, &want), 0);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.pending_hits, 2);
    assert_int_equal(st.pending, 1);
    assert_int_equal(store_count_files(kvt_store_dir(s), "e"), 1); /* only the short one is on disk */
    /* the write finishes: same handle, now durable; the queued entry's hook
     * waits for the clones still out */
    store_faults_gate(&fl, 0);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(kvt_store_contains(s, t, 10, ""), 1);
    assert_int_equal(kvt_store_find(s, t, 16, "", &hx), 0);
    assert_int_equal(hx.handle, hit.handle);
    assert_int_equal(atomic_load(&hook_runs), 0);
    kvt_entry_clear(&a.e);
    assert_int_equal(atomic_load(&hook_runs), 0);
    assert_int_equal(store_entry_diff(&got, &want), 0); /* still intact */
    kvt_entry_clear(&got);
    assert_int_equal(atomic_load(&hook_runs), 1);
    /* the durable copy restores the same state */
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 16, &got), 0);
    assert_int_equal(store_entry_diff(&got, &want), 0);
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.pending_hits, 2);
    g_gate = NULL;
    g_store = NULL;
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(root);
}

/* Without clones the queued entry is released as soon as its write is done
 * (nothing is held longer than before). */
static void released_after_write(void **state)
{
    (void)state;
    char root[512], fp[KVT_STORE_FINGERPRINT_LEN];
    store_tmpdir(root, sizeof root, "pend2");
    kvt_store_identity id;
    store_identity(&CFG, "model-p", fp, &id);
    kvt_store *s = NULL;
    assert_int_equal(kvt_store_open(root, &id, NULL, &s), 0);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    kvt_entry e;
    assert_int_equal(store_make_entry(&CFG, "", t, 10, &e), 0);
    atomic_store(&hook_runs, 0);
    e.hook = (kvt_hook){count_hook, NULL};
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(atomic_load(&hook_runs), 1);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(found_and_restored_while_pending, gate_teardown),
        cmocka_unit_test(released_after_write),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
