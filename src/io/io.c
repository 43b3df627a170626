/*
 * io.c: the bounded I/O worker of kvtier/io.h. Owns a fixed set of threads,
 * two FIFO queues (foreground before background), and a map from the exact
 * operation key (kind + content key) to the operations queued or running,
 * so an identical submission joins the existing one instead of running
 * again. One mutex guards all of it; run and free callbacks are always
 * called with it released. It never blocks a submitter on I/O: admission
 * either fits the bounds or is refused.
 *
 * Lifetime of one operation: `holds` counts the tickets not yet released
 * plus one for the worker until the operation completes or is discarded;
 * the last hold to go calls free_fn and frees it. `interest` counts the
 * tickets not cancelled; `pinned` marks a submission without a ticket, which
 * always runs. Interest reaching zero on a queued, unpinned operation
 * discards it; on a running one, its result is discarded on completion.
 */
#include "kvtier/io.h"

#include "hmap.h"
#include "internal.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { OP_QUEUED, OP_RUNNING, OP_DONE };

static const char *const kind_names[KVT_IO_KINDS] = {"restore", "write", "hash", "remote-get", "remote-set",
                                                     "prefetch", "find"};

typedef struct io_op {
    kvt_io_op op;
    struct io_op *qprev, *qnext; /* the queue of its priority, while queued */
    struct io_op *same_key;      /* chain of live operations with this content key */
    int state;                   /* OP_* */
    int status;                  /* run's return code (or KVT_ECANCELED / KVT_ECLOSED) once done */
    void *result;                /* set by run; shared by the tickets */
    char *msg;                   /* the kvt_last_error() its failed run left (NULL: none, or no memory) */
    uint32_t holds;              /* unreleased tickets + 1 for the worker until done */
    uint32_t interest;           /* tickets not cancelled */
    int pinned;                  /* submitted without a ticket: runs regardless of interest */
    int bg_slot;                 /* started from the background queue: holds one background slot */
    struct io_notify *notify;    /* waiters told on completion (kvt_io_submit_notify) */
} io_op;

/* A waiter without a ticket: told once, on completion. It holds one
 * interest and one hold until its function has run. */
typedef struct io_notify {
    kvt_io_notify_fn fn;
    void *arg;
    struct io_notify *next;
} io_notify;

struct kvt_io_ticket {
    kvt_io *io;
    io_op *op;
    int cancelled;
};

struct kvt_io {
    pthread_mutex_t mu;
    pthread_cond_t work; /* workers: a queue gained an operation, or closing */
    pthread_cond_t done; /* waiters: an operation completed or a ticket was cancelled */
    pthread_cond_t idle; /* kvt_io_flush: nothing queued or running */
    io_op *head[2], *tail[2];
    kvt__kmap live;     /* content key -> io_op chain (queued or running) */
    io_op *live_zero;   /* the chain of the zero key, which kvt__kmap cannot store */
    kvt_io_options opt;
    kvt_io_stats st;
    int closing;
    int nthreads;
    uint32_t running_bg; /* operations holding a background slot */
    pthread_t *threads;
};

/* ---- the live map (under mu) --------------------------------------------- */

static kvt__key kkey(kvt_io_key k) { return (kvt__key){k.lo, k.hi}; }
static int kzero(kvt_io_key k) { return k.lo == 0 && k.hi == 0; }

static io_op *live_head(kvt_io *io, kvt_io_key k)
{
    return kzero(k) ? io->live_zero : kvt__kmap_ptr(&io->live, kkey(k));
}

static int live_set_head(kvt_io *io, kvt_io_key k, io_op *head)
{
    if (kzero(k)) {
        io->live_zero = head;
        return 0;
    }
    if (!head) {
        kvt__kmap_del(&io->live, kkey(k));
        return 0;
    }
    return kvt__kmap_put_ptr(&io->live, kkey(k), head);
}

static io_op *live_find(kvt_io *io, kvt_io_kind kind, kvt_io_key k)
{
    for (io_op *o = live_head(io, k); o; o = o->same_key)
        if (o->op.kind == kind)
            return o;
    return NULL;
}

/* @return 0 or KVT_ENOMEM (nothing added). */
static int live_add(kvt_io *io, io_op *o)
{
    io_op *head = live_head(io, o->op.key);
    o->same_key = head;
    int rc = live_set_head(io, o->op.key, o);
    if (rc)
        o->same_key = NULL;
    return rc;
}

static void live_del(kvt_io *io, io_op *o)
{
    io_op *head = live_head(io, o->op.key);
    if (head == o) {
        live_set_head(io, o->op.key, o->same_key); /* replacing or deleting allocates nothing */
    } else {
        for (io_op *x = head; x; x = x->same_key)
            if (x->same_key == o) {
                x->same_key = o->same_key;
                break;
            }
    }
    o->same_key = NULL;
}

/* ---- the queues (under mu) ------------------------------------------------ */

static void q_push(kvt_io *io, io_op *o)
{
    int p = o->op.priority;
    o->qnext = NULL;
    o->qprev = io->tail[p];
    if (io->tail[p])
        io->tail[p]->qnext = o;
    else
        io->head[p] = o;
    io->tail[p] = o;
}

static void q_unlink(kvt_io *io, io_op *o)
{
    int p = o->op.priority;
    if (o->qprev)
        o->qprev->qnext = o->qnext;
    else
        io->head[p] = o->qnext;
    if (o->qnext)
        o->qnext->qprev = o->qprev;
    else
        io->tail[p] = o->qprev;
    o->qprev = o->qnext = NULL;
}

static void note_idle(kvt_io *io)
{
    if (io->st.queued_ops == 0 && io->st.running_ops == 0)
        pthread_cond_broadcast(&io->idle);
}

/* Takes a queued operation out without running it; status is what its
 * tickets see. @return 1 when the worker's hold was the last (free it). */
static int discard_queued(kvt_io *io, io_op *o, int status)
{
    q_unlink(io, o);
    live_del(io, o);
    o->state = OP_DONE;
    o->status = status;
    io->st.discarded++;
    io->st.queued_ops--;
    io->st.queued_bytes -= o->op.bytes;
    io->st.by_kind[o->op.kind].queued_ops--;
    io->st.by_kind[o->op.kind].queued_bytes -= o->op.bytes;
    note_idle(io);
    pthread_cond_broadcast(&io->done);
    return --o->holds == 0;
}

static void op_free(io_op *o)
{
    if (o->op.free_fn)
        o->op.free_fn(o->op.task, o->result);
    kvt__free(o->msg);
    kvt__free(o);
}

/* Runs o (without mu) on this thread. A failed run's message is kept in o,
 * so every waiter, on any thread, is told the sentence the run set
 * (kvt_last_error is per thread) and not only its code; when the message
 * cannot be copied (no memory) or the run set none, waiters get a generic
 * one. */
static int run_op(io_op *o, void **result)
{
    kvt__clear_error(); /* what is kept is this run's message, or none */
    int rc = o->op.run(o->op.task, result);
    if (rc && kvt_last_error()[0]) {
        size_t n = strlen(kvt_last_error()) + 1;
        o->msg = kvt__malloc(n);
        if (o->msg)
            memcpy(o->msg, kvt_last_error(), n);
    }
    return rc;
}

/* Sets this thread's message for a waiter of o, which failed with rc:
 * the run's own sentence when o kept one, else `the <kind> failed`. */
static int tell_failure(const io_op *o, int rc)
{
    if (o->msg && rc == o->status)
        return kvt__fail(rc, "%s", o->msg);
    return kvt__fail(rc, "kvt_io_wait: the %s failed: %s", kind_names[o->op.kind], kvt_strerror(rc));
}

/* ---- running and completing ------------------------------------------------- */

/* Takes queued o off its queue to run it (under mu). */
static void start_locked(kvt_io *io, io_op *o, int bg_slot)
{
    q_unlink(io, o);
    o->state = OP_RUNNING;
    o->bg_slot = bg_slot;
    io->running_bg += (uint32_t)bg_slot;
    io->st.queued_ops--;
    io->st.running_ops++;
}

/* Records the end of a run (under mu, which it may release and take again
 * to tell the notify waiters), then drops the worker's hold; the last hold
 * frees the operation (with mu released). Returns with mu held. */
static void complete_locked(kvt_io *io, io_op *o, int rc, void *result)
{
    live_del(io, o);
    o->state = OP_DONE;
    o->status = rc;
    o->result = result;
    kvt_io_kind_stats *k = &io->st.by_kind[o->op.kind];
    io->st.ran++;
    k->ran++;
    if (rc) {
        io->st.failed++;
        k->failed++;
    }
    if (o->interest == 0 && !o->pinned)
        io->st.results_discarded++;
    io->running_bg -= (uint32_t)o->bg_slot;
    o->bg_slot = 0;
    io_notify *n = o->notify;
    o->notify = NULL;
    uint32_t told = 0;
    if (n) { /* interest and holds stay until each has been told */
        pthread_cond_broadcast(&io->done);
        pthread_mutex_unlock(&io->mu);
        while (n) {
            io_notify *next = n->next;
            if (rc)
                tell_failure(o, rc); /* the waiter's kvt_last_error() is the run's */
            n->fn(n->arg, rc, rc ? KVT_IO_DISCARD : KVT_IO_PUBLISH, rc ? NULL : result);
            kvt__free(n);
            told++;
            n = next;
        }
        pthread_mutex_lock(&io->mu);
        o->interest -= told;
        o->holds -= told;
    }
    /* the gauges last: a flush returns once every waiter was told and, when
     * no ticket holds the operation, once its free_fn has run (a caller that
     * flushes and then tears down what a task's free_fn touches must not race
     * with it) */
    uint64_t bytes = o->op.bytes;
    if (--o->holds == 0) {
        pthread_mutex_unlock(&io->mu);
        op_free(o);
        pthread_mutex_lock(&io->mu);
    }
    io->st.running_ops--;
    io->st.queued_bytes -= bytes;
    k->queued_ops--;
    k->queued_bytes -= bytes;
    note_idle(io);
    pthread_cond_broadcast(&io->done);
}

/* ---- the worker threads ---------------------------------------------------- */

/* The next operation a worker may start (under mu): foreground first; a
 * background one only while a background slot is free. */
static io_op *next_locked(kvt_io *io, int *bg)
{
    *bg = 0;
    if (io->head[KVT_IO_FOREGROUND])
        return io->head[KVT_IO_FOREGROUND];
    if (io->head[KVT_IO_BACKGROUND] && io->running_bg < (uint32_t)io->opt.max_background) {
        *bg = 1;
        return io->head[KVT_IO_BACKGROUND];
    }
    return NULL;
}

static void *io_thread(void *arg)
{
    kvt_io *io = arg;
    pthread_mutex_lock(&io->mu);
    for (;;) {
        int bg;
        io_op *o = next_locked(io, &bg);
        if (!o) {
            if (io->closing && !io->head[KVT_IO_FOREGROUND] && !io->head[KVT_IO_BACKGROUND])
                break;
            pthread_cond_wait(&io->work, &io->mu);
            continue;
        }
        start_locked(io, o, bg);
        pthread_mutex_unlock(&io->mu);

        void *result = NULL;
        int rc = run_op(o, &result);

        pthread_mutex_lock(&io->mu);
        int freed_bg = o->bg_slot;
        complete_locked(io, o, rc, result);
        if (freed_bg && io->head[KVT_IO_BACKGROUND])
            pthread_cond_signal(&io->work); /* a slot is free: an idle thread may take the next */
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

/* ---- create / destroy -------------------------------------------------------- */

int kvt_io_create(const kvt_io_options *opt, kvt_io **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_io_create: out is NULL");
    *out = NULL;
    kvt_io_options o = opt ? *opt : (kvt_io_options){0};
    if (o.threads == 0)
        o.threads = 2;
    if (o.max_ops == 0)
        o.max_ops = 1024;
    if (o.max_background == 0)
        o.max_background = o.threads > 1 ? o.threads - 1 : 1;
    if (o.max_bytes == 0)
        o.max_bytes = 256ull << 20;
    if (o.threads < 1 || o.threads > 64)
        return kvt__fail(KVT_EINVAL, "kvt_io_create: threads is %d; it must be 1..64", o.threads);
    if (o.max_ops > (1u << 20))
        return kvt__fail(KVT_EINVAL, "kvt_io_create: max_ops is %u; it must be 1..1048576", o.max_ops);
    if (o.max_background < 1 || o.max_background > o.threads)
        return kvt__fail(KVT_EINVAL, "kvt_io_create: max_background is %d; it must be 1..threads (%d)",
                         o.max_background, o.threads);
    kvt_io *io = kvt__calloc(1, sizeof *io);
    pthread_t *threads = kvt__calloc((size_t)o.threads, sizeof *threads);
    if (!io || !threads) {
        kvt__free(io);
        kvt__free(threads);
        return kvt__fail(KVT_ENOMEM, "kvt_io_create: out of memory");
    }
    io->opt = o;
    io->threads = threads;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->work, &ca);
    pthread_cond_init(&io->done, &ca);
    pthread_cond_init(&io->idle, &ca);
    pthread_condattr_destroy(&ca);
    for (int i = 0; i < o.threads; i++) {
        int rc = pthread_create(&io->threads[i], NULL, io_thread, io);
        if (rc) {
            kvt_io_destroy(io);
            return kvt__fail(-rc, "kvt_io_create: cannot start I/O thread %d of %d: %s", i + 1, o.threads,
                             strerror(rc));
        }
        io->nthreads++;
    }
    *out = io;
    return 0;
}

void kvt_io_destroy(kvt_io *io)
{
    if (!io)
        return;
    io_op *to_free = NULL;      /* chained through qnext */
    io_notify *to_tell = NULL;  /* waiters of discarded operations */
    pthread_mutex_lock(&io->mu);
    io->closing = 1;
    for (int p = 0; p < 2; p++)
        while (io->head[p]) {
            io_op *o = io->head[p];
            for (io_notify *n = o->notify, *next; n; n = next) {
                next = n->next;
                n->next = to_tell;
                to_tell = n;
                o->interest--;
                o->holds--;
            }
            o->notify = NULL;
            if (discard_queued(io, o, KVT_ECLOSED)) {
                o->qnext = to_free;
                to_free = o;
            }
        }
    pthread_cond_broadcast(&io->work);
    pthread_mutex_unlock(&io->mu);
    while (to_tell) {
        io_notify *n = to_tell;
        to_tell = n->next;
        n->fn(n->arg, KVT_ECLOSED, KVT_IO_DISCARD, NULL);
        kvt__free(n);
    }
    for (int i = 0; i < io->nthreads; i++)
        pthread_join(io->threads[i], NULL);
    while (to_free) {
        io_op *o = to_free;
        to_free = o->qnext;
        op_free(o);
    }
    kvt__kmap_free(&io->live);
    pthread_cond_destroy(&io->idle);
    pthread_cond_destroy(&io->done);
    pthread_cond_destroy(&io->work);
    pthread_mutex_destroy(&io->mu);
    kvt__free(io->threads);
    kvt__free(io);
}

/* ---- submission ---------------------------------------------------------------- */

const char *kvt_io_kind_name(kvt_io_kind kind)
{
    return (unsigned)kind < KVT_IO_KINDS ? kind_names[kind] : "unknown";
}

/* Submits op with a ticket (ticket != NULL), a notify waiter (fn != NULL)
 * or neither (pinned: runs regardless of interest). */
static int submit(kvt_io *io, const kvt_io_op *op, kvt_io_ticket **ticket, kvt_io_notify_fn fn, void *arg)
{
    if (ticket)
        *ticket = NULL;
    if (!io || !op || !op->run)
        return kvt__fail(KVT_EINVAL, "kvt_io_submit: io, op and op->run must not be NULL");
    if ((unsigned)op->kind >= KVT_IO_KINDS || (unsigned)op->priority > KVT_IO_BACKGROUND)
        return kvt__fail(KVT_EINVAL, "kvt_io_submit: kind %d or priority %d out of range", (int)op->kind,
                         (int)op->priority);
    if (op->bytes > io->opt.max_bytes)
        return kvt__fail(KVT_ETOOBIG, "kvt_io_submit: a %s of %llu bytes is larger than the queue's %llu-byte bound",
                         kind_names[op->kind], (unsigned long long)op->bytes, (unsigned long long)io->opt.max_bytes);
    /* allocated before the lock; whichever is not needed is freed after */
    kvt_io_ticket *t = NULL;
    io_notify *nt = NULL;
    if (ticket && !(t = kvt__calloc(1, sizeof *t)))
        return kvt__fail(KVT_ENOMEM, "kvt_io_submit: out of memory");
    if (fn && !(nt = kvt__calloc(1, sizeof *nt))) {
        kvt__free(t);
        return kvt__fail(KVT_ENOMEM, "kvt_io_submit: out of memory");
    }
    io_op *fresh = kvt__calloc(1, sizeof *fresh);
    if (!fresh) {
        kvt__free(t);
        kvt__free(nt);
        return kvt__fail(KVT_ENOMEM, "kvt_io_submit: out of memory");
    }

    pthread_mutex_lock(&io->mu);
    int rc = 0;
    io_op *o = NULL;
    if (io->closing) {
        rc = kvt__fail(KVT_ECLOSED, "kvt_io_submit: the I/O worker is shutting down");
        goto fail;
    }
    o = live_find(io, op->kind, op->key);
    if (o) { /* coalesced: one more interest on the queued or running operation */
        if (o->state == OP_QUEUED && op->priority == KVT_IO_FOREGROUND && o->op.priority == KVT_IO_BACKGROUND) {
            q_unlink(io, o);
            o->op.priority = KVT_IO_FOREGROUND;
            q_push(io, o);
            pthread_cond_signal(&io->work); /* it may start now, past the background bound */
        }
        io->st.coalesced++;
        io->st.by_kind[op->kind].coalesced++;
    } else {
        uint64_t live_ops = io->st.queued_ops + io->st.running_ops;
        if (live_ops >= io->opt.max_ops) {
            io->st.refused++;
            io->st.by_kind[op->kind].refused++;
            rc = kvt__fail(KVT_EAGAIN, "io queue full: %llu of %u operations are queued or running; %s refused",
                           (unsigned long long)live_ops, io->opt.max_ops, kind_names[op->kind]);
            goto fail;
        }
        if (op->bytes > io->opt.max_bytes - io->st.queued_bytes) {
            io->st.refused++;
            io->st.by_kind[op->kind].refused++;
            rc = kvt__fail(KVT_EAGAIN,
                           "io queue full: %llu of %llu bytes are queued or running; a %s of %llu bytes does not fit",
                           (unsigned long long)io->st.queued_bytes, (unsigned long long)io->opt.max_bytes,
                           kind_names[op->kind], (unsigned long long)op->bytes);
            goto fail;
        }
        o = fresh;
        fresh = NULL;
        o->op = *op;
        o->state = OP_QUEUED;
        o->holds = 1;
        if (live_add(io, o)) {
            fresh = o;
            o = NULL;
            rc = kvt__fail(KVT_ENOMEM, "kvt_io_submit: out of memory");
            goto fail;
        }
        q_push(io, o);
        io->st.queued_ops++;
        io->st.queued_bytes += op->bytes;
        io->st.by_kind[op->kind].queued_ops++;
        io->st.by_kind[op->kind].queued_bytes += op->bytes;
        if (io->st.queued_ops + io->st.running_ops > io->st.max_queued_ops)
            io->st.max_queued_ops = io->st.queued_ops + io->st.running_ops;
        pthread_cond_signal(&io->work);
    }
    io->st.submitted++;
    io->st.by_kind[op->kind].submitted++;
    if (t) {
        t->io = io;
        t->op = o;
        o->holds++;
        o->interest++;
    } else if (nt) {
        nt->fn = fn;
        nt->arg = arg;
        nt->next = o->notify;
        o->notify = nt;
        o->holds++;
        o->interest++;
    } else {
        o->pinned = 1;
    }
    pthread_mutex_unlock(&io->mu);
    if (fresh) { /* coalesced: the caller's prepared task is not needed */
        kvt__free(fresh);
        if (op->free_fn)
            op->free_fn(op->task, NULL);
    }
    if (ticket)
        *ticket = t;
    return 0;

fail:
    pthread_mutex_unlock(&io->mu);
    kvt__free(fresh);
    kvt__free(t);
    kvt__free(nt);
    return rc;
}

int kvt_io_submit(kvt_io *io, const kvt_io_op *op, kvt_io_ticket **ticket)
{
    return submit(io, op, ticket, NULL, NULL);
}

int kvt_io_submit_notify(kvt_io *io, const kvt_io_op *op, kvt_io_notify_fn fn, void *arg)
{
    if (!fn)
        return kvt__fail(KVT_EINVAL, "kvt_io_submit_notify: fn is NULL");
    return submit(io, op, NULL, fn, arg);
}

/* ---- tickets ------------------------------------------------------------------- */

/* Cancels t under mu. The ticket still holds the operation, so a discard
 * here never drops its last hold. */
static void cancel_locked(kvt_io_ticket *t)
{
    io_op *o = t->op;
    if (t->cancelled || o->state == OP_DONE)
        return;
    t->cancelled = 1;
    o->interest--;
    pthread_cond_broadcast(&t->io->done);
    if (o->interest == 0 && !o->pinned && o->state == OP_QUEUED)
        discard_queued(t->io, o, KVT_ECANCELED);
}

void kvt_io_cancel(kvt_io_ticket *ticket)
{
    if (!ticket)
        return;
    kvt_io *io = ticket->io;
    pthread_mutex_lock(&io->mu);
    cancel_locked(ticket);
    pthread_mutex_unlock(&io->mu);
}

void kvt_io_ticket_release(kvt_io_ticket *ticket)
{
    if (!ticket)
        return;
    kvt_io *io = ticket->io;
    io_op *o = ticket->op;
    pthread_mutex_lock(&io->mu);
    cancel_locked(ticket);
    int last = --o->holds == 0;
    pthread_mutex_unlock(&io->mu);
    if (last)
        op_free(o);
    kvt__free(ticket);
}

int kvt_io_wait(kvt_io_ticket *ticket, uint64_t timeout_ms, kvt_io_disposition *disposition, void **result)
{
    if (disposition)
        *disposition = KVT_IO_DISCARD;
    if (result)
        *result = NULL;
    if (!ticket)
        return kvt__fail(KVT_EINVAL, "kvt_io_wait: ticket is NULL");
    kvt_io *io = ticket->io;
    io_op *o = ticket->op;
    struct timespec until = {0};
    if (timeout_ms && timeout_ms != UINT64_MAX)
        until = kvt__deadline(CLOCK_MONOTONIC, timeout_ms);
    pthread_mutex_lock(&io->mu);
    int rc;
    for (;;) {
        if (ticket->cancelled) {
            rc = kvt__fail(KVT_ECANCELED, "kvt_io_wait: the ticket was cancelled");
            break;
        }
        if (o->state == OP_DONE) {
            rc = o->status;
            if (rc == 0) {
                if (disposition)
                    *disposition = KVT_IO_PUBLISH;
                if (result)
                    *result = o->result;
            } else {
                rc = tell_failure(o, rc);
            }
            break;
        }
        if (timeout_ms == 0) {
            rc = kvt__fail(KVT_EAGAIN, "kvt_io_wait: the %s has not completed", kind_names[o->op.kind]);
            break;
        }
        if (timeout_ms == UINT64_MAX) {
            pthread_cond_wait(&io->done, &io->mu);
        } else if (pthread_cond_timedwait(&io->done, &io->mu, &until) == ETIMEDOUT && o->state != OP_DONE &&
                   !ticket->cancelled) {
            rc = kvt__fail(KVT_EAGAIN, "kvt_io_wait: the %s did not complete within %llu ms",
                           kind_names[o->op.kind], (unsigned long long)timeout_ms);
            break;
        }
    }
    pthread_mutex_unlock(&io->mu);
    return rc;
}

int kvt_io_flush(kvt_io *io, uint64_t timeout_ms)
{
    if (!io)
        return kvt__fail(KVT_EINVAL, "kvt_io_flush: io is NULL");
    struct timespec until = {0};
    if (timeout_ms != UINT64_MAX)
        until = kvt__deadline(CLOCK_MONOTONIC, timeout_ms);
    int rc = 0;
    pthread_mutex_lock(&io->mu);
    while (io->st.queued_ops + io->st.running_ops > 0) {
        if (timeout_ms == UINT64_MAX) {
            pthread_cond_wait(&io->idle, &io->mu);
        } else if (pthread_cond_timedwait(&io->idle, &io->mu, &until) == ETIMEDOUT &&
                   io->st.queued_ops + io->st.running_ops > 0) {
            rc = kvt__fail(KVT_EAGAIN, "kvt_io_flush: %llu operations still queued or running after %llu ms",
                           (unsigned long long)(io->st.queued_ops + io->st.running_ops),
                           (unsigned long long)timeout_ms);
            break;
        }
    }
    pthread_mutex_unlock(&io->mu);
    return rc;
}

int kvt_io_stats_get(kvt_io *io, kvt_io_stats *out)
{
    if (!io || !out)
        return kvt__fail(KVT_EINVAL, "kvt_io_stats_get: io and out must not be NULL");
    pthread_mutex_lock(&io->mu);
    *out = io->st;
    pthread_mutex_unlock(&io->mu);
    return 0;
}

int kvt_io_run_here(kvt_io_ticket *ticket)
{
    if (!ticket)
        return kvt__fail(KVT_EINVAL, "kvt_io_run_here: ticket is NULL");
    kvt_io *io = ticket->io;
    io_op *o = ticket->op;
    pthread_mutex_lock(&io->mu);
    if (o->state != OP_QUEUED || ticket->cancelled) {
        pthread_mutex_unlock(&io->mu);
        return 0;
    }
    start_locked(io, o, 0);
    pthread_mutex_unlock(&io->mu);
    void *result = NULL;
    int rc = run_op(o, &result);
    pthread_mutex_lock(&io->mu);
    complete_locked(io, o, rc, result); /* the ticket's hold keeps o */
    pthread_mutex_unlock(&io->mu);
    return 1;
}

/* ---- the process's default worker ---------------------------------------------- */

static pthread_mutex_t default_mu = PTHREAD_MUTEX_INITIALIZER;
static kvt_io *default_io;
static uint64_t default_refs;

int kvt_io_default_acquire(kvt_io **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_io_default_acquire: out is NULL");
    *out = NULL;
    pthread_mutex_lock(&default_mu);
    int rc = 0;
    if (!default_io)
        rc = kvt_io_create(NULL, &default_io);
    if (!rc) {
        default_refs++;
        *out = default_io;
    }
    pthread_mutex_unlock(&default_mu);
    return rc;
}

void kvt_io_default_release(kvt_io *io)
{
    if (!io)
        return;
    kvt_io *last = NULL;
    pthread_mutex_lock(&default_mu);
    if (io == default_io && default_refs && --default_refs == 0) {
        last = default_io;
        default_io = NULL;
    }
    pthread_mutex_unlock(&default_mu);
    if (last) {
        kvt_io_flush(last, UINT64_MAX);
        kvt_io_destroy(last);
    }
}

int kvt_io_default_stats_get(kvt_io_stats *out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_io_default_stats_get: out is NULL");
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&default_mu);
    int rc = default_io ? kvt_io_stats_get(default_io, out) : KVT_ENOTFOUND;
    pthread_mutex_unlock(&default_mu);
    return rc == KVT_ENOTFOUND ? kvt__fail(rc, "kvt_io_default_stats_get: no default I/O worker exists") : rc;
}

int kvt_io_options_get(kvt_io *io, kvt_io_options *out)
{
    if (!io || !out)
        return kvt__fail(KVT_EINVAL, "kvt_io_options_get: io and out must not be NULL");
    *out = io->opt;
    return 0;
}

/* ---- the io report ------------------------------------------------------------------ */

static int put_u64(json_t *o, const char *k, uint64_t v)
{
    return json_object_set_new(o, k, json_integer(v > (uint64_t)INT64_MAX ? INT64_MAX : (json_int_t)v));
}

int kvt_io_stats_json(const kvt_io_stats *s, const kvt_io_options *opt, char **out)
{
    if (out)
        *out = NULL;
    if (!s || !out)
        return kvt__fail(KVT_EINVAL, "kvt_io_stats_json: s and out must not be NULL");
    json_t *o = json_object(), *by = json_object();
    int bad = !o || !by;
    if (!bad && opt)
        bad |= put_u64(o, "threads", (uint64_t)opt->threads) | put_u64(o, "max_ops", opt->max_ops) |
               put_u64(o, "max_bytes", opt->max_bytes) | put_u64(o, "max_background", (uint64_t)opt->max_background);
#define KVT__IO_JSON(name, kind, help) bad |= bad ? 0 : put_u64(o, #name, s->name);
    KVT_IO_WORKER_COUNTERS(KVT__IO_JSON)
#undef KVT__IO_JSON
    for (int k = 0; !bad && k < KVT_IO_KINDS; k++) {
        json_t *ko = json_object();
        const kvt_io_kind_stats *ks = &s->by_kind[k];
        bad |= !ko;
#define KVT__IO_JSON(name, kind, help) bad |= ko ? put_u64(ko, #name, ks->name) : 0;
        KVT_IO_KIND_COUNTERS(KVT__IO_JSON)
#undef KVT__IO_JSON
        bad |= ko ? json_object_set_new(by, kind_names[k], ko) : 0;
    }
    if (!bad)
        bad |= json_object_set(o, "by_kind", by);
    char *text = bad ? NULL : json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(by);
    json_decref(o);
    if (!text)
        return kvt__fail(KVT_ENOMEM, "kvt_io_stats_json: cannot build the JSON document");
    *out = kvt__strdup(text);
    free(text);
    return *out ? 0 : kvt__fail(KVT_ENOMEM, "kvt_io_stats_json: out of memory");
}
