/* io_gate.c: a gate operation that holds one worker thread (io_gate.h). */
#include "io_gate.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

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
    pthread_mutex_lock(&g->mu);
    while (g->entered == before)
        pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

void io_gate_open(io_gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}
