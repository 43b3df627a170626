/* io_gate.c: a gate operation that holds one worker thread (io_gate.h). */
#include "io_gate.h"

#include "io_shim.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <time.h>

#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif

static int gate_run(void *task, void **result)
{
    (void)result;
    io_gate *g = task;
    pthread_mutex_lock(&g->mu);
    g->entered++;
    pthread_cond_broadcast(&g->cv);
    while (!g->open)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
    return 0;
}

void io_gate_hold(kvt_io *io, io_gate *g, kvt_io_key key, kvt_io_priority prio)
{
    pthread_mutex_lock(&g->mu);
    g->open = 0;
    int before = g->entered;
    pthread_mutex_unlock(&g->mu);
    kvt_io_op op = {.kind = KVT_IO_KIND_PREFETCH, .key = key, .priority = prio, .run = gate_run, .task = g};
    assert_int_equal(kvt_io_submit(io, &op, NULL), 0);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 60 * KVT_TEST_TIME_SCALE;
    pthread_mutex_lock(&g->mu);
    int rc = 0;
    while (g->entered == before && rc == 0)
        rc = pthread_cond_timedwait(&g->cv, &g->mu, &dl);
    int entered = g->entered != before;
    pthread_mutex_unlock(&g->mu);
    if (!entered)
        fail_msg("no worker thread ran the gate operation within %d s", 60 * KVT_TEST_TIME_SCALE);
}

void io_gate_open(io_gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

void io_gate_wait_count(pthread_mutex_t *mu, pthread_cond_t *cv, const int *count, int n, const char *what)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 60 * KVT_TEST_TIME_SCALE;
    pthread_mutex_lock(mu);
    int rc = 0;
    while (*count < n && rc == 0)
        rc = pthread_cond_timedwait(cv, mu, &dl);
    int got = *count;
    pthread_mutex_unlock(mu);
    if (got < n)
        fail_msg("%d of %d %s ran within %d s", got, n, what, 60 * KVT_TEST_TIME_SCALE);
}

void io_gate_case_release(io_gate_case *c)
{
    kvt__io_disarm();
    io_gate_open(&c->gate);
    if (c->r)
        (void)kvt_remote_close(c->r);
    c->r = NULL;
    kvt_io_destroy(c->io); /* NULL: a no-op */
    c->io = NULL;
}
