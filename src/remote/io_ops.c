/*
 * io_ops.c: the remote tier's restores (kvt_cold_tier's restore and
 * restore_async, e.g. a prompt cache's prefetch) as foreground operations
 * of the I/O worker (kvtier/io.h), keyed by the handle: identical restores,
 * synchronous or not, make one pipeline of GETs and each waiter gets its
 * own zero-copy clone; and its synchronous store, keyed by the entry's
 * content: identical stores at the same time are one write. Every
 * asynchronous waiter is told exactly once; close waits until all were told.
 * A synchronous waiter whose operation failed on another thread (the
 * worker's, or an identical call's) gets the message the run left there:
 * kvt_io_wait keeps it (src/io/io.c).
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
    int rc = kvt__remote_restore_direct(t->r, t->handle, &t->e);
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

/* The key of the restore of `handle`: the synchronous and the asynchronous
 * restore of one handle are one operation. */
static kvt_io_key restore_key(const kvt_remote *r, uint64_t handle)
{
    return (kvt_io_key){handle ^ r->io_seed.lo, 0x6e7 ^ r->io_seed.hi};
}

int kvt__remote_restore(void *self, uint64_t handle, kvt_entry *out)
{
    kvt_remote *r = self;
    memset(out, 0, sizeof *out);
    rtask *t = kvt__calloc(1, sizeof *t);
    if (!t)
        return kvt__fail(KVT_ENOMEM, "remote restore: out of memory");
    t->r = r;
    t->handle = handle;
    kvt_io_op op = {.kind = KVT_IO_KIND_REMOTE_GET,
                    .key = restore_key(r, handle),
                    .priority = KVT_IO_FOREGROUND,
                    .run = rtask_run,
                    .free_fn = rtask_free,
                    .task = t};
    kvt_io_ticket *tk = NULL;
    int rc = kvt_io_submit(r->worker, &op, &tk);
    if (rc) { /* queue full or shutting down: this thread reads */
        kvt__free(t);
        return kvt__remote_restore_direct(r, handle, out);
    }
    /* on failure kvt_last_error() is the sentence its run left, on whichever thread (kvt_io_wait) */
    rc = kvt__entry_wait(tk, out);
    if (rc == KVT_ECLOSED) /* the worker shut down before it ran */
        return kvt__remote_restore_direct(r, handle, out);
    return rc;
}

/* One synchronous store: the caller's entry, borrowed while it waits, and
 * its bytes' reservation on the pool's remote axis (NULL: no pool), held
 * while the write is in flight and dropped by the free function (at once
 * for a store that joined an identical one: that one's reservation counts). */
typedef struct stask {
    kvt_remote *r;
    const kvt_entry *e;
    struct kvt_pool_reservation *res;
} stask;

static int stask_run(void *task, void **result)
{
    stask *t = task;
    *result = task;
    return kvt__remote_store(t->r, t->e);
}

static void stask_free(void *task, void *result)
{
    (void)result;
    stask *t = task;
    kvt__remote_pool_drop(t->res);
    kvt__free(t);
}

int kvt__remote_store_sync(void *self, const kvt_entry *e)
{
    kvt_remote *r = self;
    if (!e)
        return kvt__remote_store_now(r, e);
    stask *t = kvt__calloc(1, sizeof *t);
    if (!t)
        return kvt__fail(KVT_ENOMEM, "remote store: out of memory");
    *t = (stask){r, e, NULL};
    /* in flight from here: a refusal names the axis on this thread */
    int rc = kvt__remote_pool_reserve(r, kvt__remote_entry_bytes(e), &t->res);
    if (rc) {
        kvt__free(t);
        return rc;
    }
    /* keyed by content, apart from write-behind's keys (a queued write-behind
     * may be withdrawn: a store must not count on it) */
    kvt__key ek = kvt__entry_key(r->seed, e->ns ? e->ns : "", e->tokens, e->n_tokens);
    kvt_io_op op = {.kind = KVT_IO_KIND_REMOTE_SET,
                    .key = {ek.lo ^ r->io_seed.lo ^ 0x5c5c5c5c5c5c5c5cull, ek.hi ^ r->io_seed.hi},
                    .priority = KVT_IO_FOREGROUND,
                    .run = stask_run,
                    .free_fn = stask_free,
                    .task = t};
    kvt_io_ticket *tk = NULL;
    rc = kvt_io_submit(r->worker, &op, &tk);
    if (rc) { /* the worker cannot take it: written on this thread */
        stask_free(t, NULL);
        return kvt__remote_store_now(r, e);
    }
    /* still queued: written on this thread; on failure kvt_last_error() is
     * the sentence its run left, on whichever thread (kvt_io_wait) */
    (void)kvt_io_run_here(tk);
    rc = kvt_io_wait(tk, UINT64_MAX, NULL, NULL);
    kvt_io_ticket_release(tk);
    if (rc == KVT_ECLOSED)
        return kvt__remote_store_now(r, e);
    return rc;
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
                    .key = restore_key(r, handle),
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
