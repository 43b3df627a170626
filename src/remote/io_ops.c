/*
 * io_ops.c: the remote tier's asynchronous restore (kvt_cold_tier's
 * restore_async, e.g. a prompt cache's prefetch) as a foreground operation
 * of the I/O worker (kvtier/io.h), keyed by the handle: identical restores
 * make one pipeline of GETs and each waiter gets its own zero-copy clone.
 * Every waiter is told exactly once; close waits until all were told.
 */
#include "io_entry.h"
#include "remote_internal.h"

#include <string.h>

/* One restore operation: read once, shared by every waiter. */
typedef struct rtask {
    kvt_remote *r;
    uint64_t handle;
    kvt_entry e; /* the result once run */
} rtask;

/* One restore_async call waiting for an operation. */
typedef struct rwait {
    kvt_remote *r;
    kvt_restore_done_fn done;
    void *arg;
} rwait;

static int rtask_run(void *task, void **result)
{
    rtask *t = task;
    int rc = kvt__remote_restore(t->r, t->handle, &t->e);
    if (!rc)
        *result = &t->e;
    return rc;
}

static void rtask_free(void *task, void *result)
{
    (void)result;
    rtask *t = task;
    kvt_entry_clear(&t->e);
    kvt__free(t);
}

static void waiter_gone(kvt_remote *r)
{
    pthread_mutex_lock(&r->q_mu);
    r->restores_live--;
    pthread_cond_broadcast(&r->idle_cv);
    pthread_mutex_unlock(&r->q_mu);
}

/* Gives one waiter its clone of the shared result (or the error). */
static void rwait_tell(void *arg, int status, kvt_io_disposition d, void *result)
{
    rwait w = *(rwait *)arg;
    kvt__free(arg);
    kvt_entry mine;
    status = kvt__entry_from_result(status, d, result, &mine);
    w.done(w.arg, status, status ? NULL : &mine);
    waiter_gone(w.r);
}

int kvt__remote_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    kvt_remote *r = self;
    if (!r || !done)
        return kvt__fail(KVT_EINVAL, "remote restore_async: bad arguments");
    rtask *t = kvt__calloc(1, sizeof *t);
    rwait *w = kvt__calloc(1, sizeof *w);
    if (!t || !w) {
        kvt__free(t);
        kvt__free(w);
        return kvt__fail(KVT_ENOMEM, "remote restore_async: out of memory");
    }
    t->r = r;
    t->handle = handle;
    *w = (rwait){r, done, arg};
    pthread_mutex_lock(&r->q_mu);
    if (r->closing) {
        pthread_mutex_unlock(&r->q_mu);
        kvt__free(t);
        kvt__free(w);
        return kvt__fail(KVT_ECLOSED, "remote restore_async: the tier is closing");
    }
    r->restores_live++;
    pthread_mutex_unlock(&r->q_mu);
    kvt_io_op op = {.kind = KVT_IO_KIND_REMOTE_GET,
                    .key = {handle ^ r->io_seed.lo, 0x6e7 ^ r->io_seed.hi},
                    .priority = KVT_IO_FOREGROUND,
                    .run = rtask_run,
                    .free_fn = rtask_free,
                    .task = t};
    int rc = kvt_io_submit_notify(r->worker, &op, rwait_tell, w);
    if (rc) {
        kvt__free(t);
        kvt__free(w);
        waiter_gone(r);
        return kvt__fail(rc, "remote restore_async: %s", kvt_strerror(rc));
    }
    return 0;
}
