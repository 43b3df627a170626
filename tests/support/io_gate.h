/* io_gate.h: a foreground operation that holds one thread of a kvt_io
 * worker until the test opens it, so a test can fill the worker's queue or
 * order what runs next. Test support only. */
#ifndef KVT_TEST_IO_GATE_H
#define KVT_TEST_IO_GATE_H

#include "kvtier/io.h"

#include <pthread.h>

typedef struct io_gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;    /* 1: every gate operation returns */
    int entered; /* gate operations that started running */
} io_gate;

#define IO_GATE_INIT {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0}

/* Closes g, submits a gate operation (kind PREFETCH, content key `key`,
 * priority `prio`) to io and waits until a worker thread runs it; a refused
 * submission fails the test. Call io_gate_open before the worker is
 * destroyed. */
void io_gate_hold(kvt_io *io, io_gate *g, kvt_io_key key, kvt_io_priority prio);

/* Opens g: every gate operation of it returns. */
void io_gate_open(io_gate *g);

#endif
