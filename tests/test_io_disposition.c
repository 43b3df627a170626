/*
 * test_io_disposition.c: two rules of the I/O worker (kvtier/io.h) that
 * test_io does not reach. An operation submitted without a ticket (pinned:
 * a write-behind write nobody waits for) always runs, even when a ticketed
 * submission joined it and was then cancelled: cancelling the last ticket
 * discards a queued operation only when it is not pinned. And a notify
 * waiter of an operation whose run failed is told to discard it, with no
 * result, while a waiter of one that succeeded is told to publish it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>
#include <pthread.h>

#include "kvtier/io.h"

/* A run that blocks until the gate opens (the one worker thread is busy). */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open, entered;
} gate;

static gate g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

static int gated_run(void *task, void **result)
{
    (void)task;
    (void)result;
    pthread_mutex_lock(&g.mu);
    g.entered = 1;
    pthread_cond_broadcast(&g.cv);
    while (!g.open)
        pthread_cond_wait(&g.cv, &g.mu);
    pthread_mutex_unlock(&g.mu);
    return 0;
}

static int runs, frees;
static pthread_mutex_t count_mu = PTHREAD_MUTEX_INITIALIZER;

/* task: the value run returns (0: a result, 1000 + nothing else). */
static int counted_run(void *task, void **result)
{
    pthread_mutex_lock(&count_mu);
    runs++;
    pthread_mutex_unlock(&count_mu);
    int fail = (int)(intptr_t)task;
    if (fail)
        return fail;
    static int value = 42;
    *result = &value;
    return 0;
}

static void counted_free(void *task, void *result)
{
    (void)task;
    (void)result;
    pthread_mutex_lock(&count_mu);
    frees++;
    pthread_mutex_unlock(&count_mu);
}

static kvt_io_op op_of(uint64_t key, int fail)
{
    return (kvt_io_op){.kind = KVT_IO_KIND_WRITE,
                       .key = {key, ~key},
                       .priority = KVT_IO_FOREGROUND,
                       .bytes = 10,
                       .run = counted_run,
                       .free_fn = counted_free,
                       .task = (void *)(intptr_t)fail};
}

/* One worker thread held by a gated operation; returns the io. */
static kvt_io *busy_io(void)
{
    kvt_io_options o = {.threads = 1};
    kvt_io *io = NULL;
    assert_int_equal(kvt_io_create(&o, &io), 0);
    g.open = g.entered = 0;
    kvt_io_op blocker = {.kind = KVT_IO_KIND_HASH, .key = {1, 1}, .run = gated_run};
    assert_int_equal(kvt_io_submit(io, &blocker, NULL), 0);
    pthread_mutex_lock(&g.mu);
    while (!g.entered)
        pthread_cond_wait(&g.cv, &g.mu);
    pthread_mutex_unlock(&g.mu);
    return io;
}

static void open_gate(void)
{
    pthread_mutex_lock(&g.mu);
    g.open = 1;
    pthread_cond_broadcast(&g.cv);
    pthread_mutex_unlock(&g.mu);
}

static void test_pinned_survives_cancelled_joiner(void **state)
{
    (void)state;
    runs = frees = 0;
    kvt_io *io = busy_io();
    kvt_io_op w = op_of(77, 0);
    assert_int_equal(kvt_io_submit(io, &w, NULL), 0); /* pinned: queued behind the blocker */
    kvt_io_op same = op_of(77, 0);
    kvt_io_ticket *t = NULL;
    assert_int_equal(kvt_io_submit(io, &same, &t), 0); /* joins it */
    kvt_io_stats st;
    assert_int_equal(kvt_io_stats_get(io, &st), 0);
    assert_int_equal(st.coalesced, 1);
    assert_int_equal(st.queued_ops, 1);
    kvt_io_cancel(t); /* the only ticket goes: the pinned write must still run */
    kvt_io_ticket_release(t);
    assert_int_equal(kvt_io_stats_get(io, &st), 0);
    assert_int_equal(st.discarded, 0);
    assert_int_equal(st.queued_ops, 1);
    open_gate();
    assert_int_equal(kvt_io_flush(io, UINT64_MAX), 0);
    assert_int_equal(kvt_io_stats_get(io, &st), 0);
    if (runs != 1)
        fail_msg("the pinned write ran %d times (discarded %llu): cancelling a joined ticket dropped it", runs,
                 (unsigned long long)st.discarded);
    kvt_io_destroy(io);
    assert_int_equal(frees, 2); /* its task and the joiner's unneeded one */
}

typedef struct told {
    int count, rc;
    kvt_io_disposition d;
    void *result;
} told;

static void notify(void *arg, int rc, kvt_io_disposition d, void *result)
{
    told *x = arg;
    x->count++;
    x->rc = rc;
    x->d = d;
    x->result = result;
}

static void test_notify_failed_discards(void **state)
{
    (void)state;
    runs = frees = 0;
    kvt_io_options o = {.threads = 1};
    kvt_io *io = NULL;
    assert_int_equal(kvt_io_create(&o, &io), 0);
    told bad = {0, 0, KVT_IO_PUBLISH, (void *)&bad}, good = {0, 0, KVT_IO_DISCARD, NULL};
    kvt_io_op f = op_of(5, KVT_EIO);
    assert_int_equal(kvt_io_submit_notify(io, &f, notify, &bad), 0);
    kvt_io_op s = op_of(6, 0);
    assert_int_equal(kvt_io_submit_notify(io, &s, notify, &good), 0);
    assert_int_equal(kvt_io_flush(io, UINT64_MAX), 0);
    assert_int_equal(bad.count, 1);
    assert_int_equal(bad.rc, KVT_EIO);
    if (bad.d != KVT_IO_DISCARD || bad.result != NULL)
        fail_msg("a failed run was told %s with result %p", bad.d == KVT_IO_PUBLISH ? "publish" : "discard",
                 bad.result);
    assert_int_equal(good.count, 1);
    assert_int_equal(good.rc, 0);
    assert_int_equal(good.d, KVT_IO_PUBLISH);
    assert_non_null(good.result);
    assert_int_equal(*(int *)good.result, 42);
    kvt_io_destroy(io);
    assert_int_equal(runs, 2);
    assert_int_equal(frees, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pinned_survives_cancelled_joiner),
        cmocka_unit_test(test_notify_failed_discards),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
