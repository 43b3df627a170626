/* io_gate.h: a foreground operation that holds one thread of a kvt_io
 * worker until the test opens it, so a test can fill the worker's queue or
 * order what runs next. Test support only. */
#ifndef KVT_TEST_IO_GATE_H
#define KVT_TEST_IO_GATE_H

#include "kvtier/io.h"
#include "kvtier/remote.h"

#include <pthread.h>

typedef struct io_gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;    /* 1: every gate operation returns */
    int entered; /* gate operations that started running */
} io_gate;

#define IO_GATE_INIT {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0}

/* Closes g, submits a gate operation (kind PREFETCH, content key `key`,
 * priority `prio`) to io and waits until a worker thread runs it (at most
 * 60 s times KVT_TEST_TIME_SCALE); a refused submission or a gate no thread
 * runs fails the test. Call io_gate_open before the worker is destroyed; a
 * case that can fail while it holds the gate keeps g in file scope and opens
 * it in its teardown (a failed assertion leaves the case by longjmp). */
void io_gate_hold(kvt_io *io, io_gate *g, kvt_io_key key, kvt_io_priority prio);

/* Opens g: every gate operation of it returns. */
void io_gate_open(io_gate *g);

/* What a remote-tier case that holds a gate owns, kept in file scope so its
 * teardown finds it after a failed assertion left the case. */
/* Waits under mu until *count reaches n (whoever counts holds mu and
 * broadcasts cv), for at most 60 s times KVT_TEST_TIME_SCALE; fails the test
 * ("<got> of <n> <what> ran within ...") otherwise, so a callback that never
 * comes fails the case instead of holding the program to its timeout. */
void io_gate_wait_count(pthread_mutex_t *mu, pthread_cond_t *cv, const int *count, int n, const char *what);

typedef struct io_gate_case {
    kvt_io *io;     /* the case's worker, or NULL */
    io_gate gate;
    kvt_remote *r;  /* the case's open tier, or NULL */
} io_gate_case;

#define IO_GATE_CASE_INIT {NULL, IO_GATE_INIT, NULL}

/* A teardown's release: disarms the I/O shim, opens the gate (what it held
 * runs), closes the tier (its queue written; errors ignored), destroys the
 * worker, and clears c->io and c->r. */
void io_gate_case_release(io_gate_case *c);

#endif
