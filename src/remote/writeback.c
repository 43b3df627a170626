/*
 * writeback.c: the remote tier's write-behind. spill queues an entry (the
 * queue is bounded in bytes and entries; a full queue, a full I/O worker
 * queue or a Redis marked down is a counted drop, never a wait) as one
 * background write operation of the process's I/O worker (kvtier/io.h),
 * keyed by the entry's content key, so the same entry queued twice is
 * written once; pending and withdraw look into the live jobs; flush waits
 * until none is left and reports the first failure since the last flush.
 */
#include "remote_internal.h"

#include <stdatomic.h>
#include <string.h>

uint64_t kvt__remote_entry_bytes(const kvt_entry *e)
{
    uint64_t b = (uint64_t)e->n_tokens * 4;
    for (int32_t l = 0; l < e->n_caches; l++)
        b += e->caches[l] ? kvt_cache_bytes(e->caches[l]) : 0;
    for (int32_t a = 0; a < e->n_attachments; a++)
        b += kvt_attachment_bytes(e->attachments[a]);
    return b;
}

/* A job's place in the live list (queued or being written; under q_mu). */
static void job_link(kvt_remote *r, kvt__rjob *j)
{
    j->prev = r->q_tail;
    j->next = NULL;
    if (r->q_tail)
        r->q_tail->next = j;
    else
        r->q_head = j;
    r->q_tail = j;
}

static void job_unlink(kvt_remote *r, kvt__rjob *j)
{
    if (j->prev)
        j->prev->next = j->next;
    else
        r->q_head = j->next;
    if (j->next)
        j->next->prev = j->prev;
    else
        r->q_tail = j->prev;
    j->next = j->prev = NULL;
}

/* The write operation (a worker thread): stores the job's entry, unless it
 * was withdrawn while queued. *result marks that it ran. */
static int job_run(void *task, void **result)
{
    kvt__rjob *j = task;
    kvt_remote *r = j->r;
    *result = task;
    pthread_mutex_lock(&r->q_mu);
    int withdrawn = j->state == KVT__RJOB_WITHDRAWN;
    if (!withdrawn)
        j->state = KVT__RJOB_RUNNING;
    pthread_mutex_unlock(&r->q_mu);
    if (withdrawn)
        return 0;
    int rc;
    if (kvt__remote_all_down(r)) {
        KVT__REMOTE_BUMP(r, dropped, 1);
        KVT__REMOTE_COUNT(r, behind_dropped);
        rc = kvt__fail(KVT_EIO, "remote write-behind: redis %s is unreachable; the write was dropped", r->host);
    } else if ((rc = kvt__remote_store(r, &j->e))) {
        KVT__REMOTE_COUNT(r, behind_failed);
    }
    pthread_mutex_lock(&r->q_mu);
    job_unlink(r, j); /* no longer pending: nothing reads the entry from here */
    pthread_mutex_unlock(&r->q_mu);
    kvt_entry_clear(&j->e);
    kvt__remote_pool_drop(j->res); /* no longer in flight */
    j->res = NULL;
    pthread_mutex_lock(&r->q_mu);
    r->q_n--;
    r->q_bytes -= j->bytes;
    if (rc && !r->flush_rc)
        r->flush_rc = rc;
    pthread_cond_broadcast(&r->idle_cv);
    pthread_mutex_unlock(&r->q_mu);
    return rc;
}

/* The write operation's free function: a job coalesced inside
 * kvt_io_submit is only marked (its submitter, holding q_mu, undoes it);
 * otherwise the worker lets go of the job (one discarded unrun, at a
 * worker's shutdown, leaves the queue as a failed write). */
static void job_free(void *task, void *result)
{
    kvt__rjob *j = task;
    if (j->state == KVT__RJOB_SUBMITTING) {
        j->state = KVT__RJOB_COALESCED;
        return;
    }
    kvt_remote *r = j->r;
    int unrun = !result && j->state == KVT__RJOB_QUEUED;
    if (unrun)
        KVT__REMOTE_COUNT(r, behind_dropped); /* before ops_live lets close free r */
    pthread_mutex_lock(&r->q_mu);
    if (unrun) {
        job_unlink(r, j);
        r->q_n--;
        r->q_bytes -= j->bytes;
        if (!r->flush_rc)
            r->flush_rc = kvt__fail(KVT_ECLOSED, "remote write-behind: the I/O worker shut down before the write ran");
    }
    r->ops_live--;
    pthread_cond_broadcast(&r->idle_cv);
    pthread_mutex_unlock(&r->q_mu);
    if (unrun)
        kvt_entry_clear(&j->e);
    kvt__remote_pool_drop(j->res);
    kvt__free(j);
}

int kvt__remote_spill(void *self, kvt_entry *e)
{
    kvt_remote *r = self;
    if (!e)
        return kvt__fail(KVT_EINVAL, "remote spill: NULL entry");
    if (kvt__remote_all_down(r)) {
        KVT__REMOTE_BUMP(r, dropped, 1);
        return kvt__fail(KVT_EAGAIN, "remote spill: redis %s is unreachable", r->host);
    }
    uint64_t b = kvt__remote_entry_bytes(e);
    kvt__rjob *j = kvt__calloc(1, sizeof *j);
    if (!j)
        return kvt__fail(KVT_ENOMEM, "remote spill: out of memory");
    kvt__key ekey = kvt__entry_key(r->seed, e->ns ? e->ns : "", e->tokens, e->n_tokens);
    /* charged on the pool's remote axis before it is queued, until it is written */
    int prc = kvt__remote_pool_reserve(r, b, &j->res);
    if (prc) {
        kvt__free(j);
        KVT__REMOTE_BUMP(r, dropped, 1);
        return prc == KVT_ENOMEM ? prc : KVT_EAGAIN;
    }
    pthread_mutex_lock(&r->q_mu);
    if (r->closing || r->q_n >= r->queue_max_entries || r->q_bytes + b > r->queue_max_bytes) {
        pthread_mutex_unlock(&r->q_mu);
        kvt__remote_pool_drop(j->res);
        kvt__free(j);
        KVT__REMOTE_BUMP(r, dropped, 1);
        return kvt__fail(KVT_EAGAIN, "remote spill: the write-behind queue is full");
    }
    j->e = *e;
    j->bytes = b;
    j->r = r;
    j->state = KVT__RJOB_SUBMITTING;
    job_link(r, j);
    r->q_n++;
    r->q_bytes += b;
    r->ops_live++;
    /* Submitted with q_mu held (lock order: q_mu, then the worker's), so the
     * job is never seen half-submitted. The same entry (ns, tokens) already
     * queued or being written is joined: that write serves. */
    kvt_io_op op = {.kind = KVT_IO_KIND_REMOTE_SET,
                    .key = {ekey.lo ^ r->io_seed.lo, ekey.hi ^ r->io_seed.hi},
                    .priority = KVT_IO_BACKGROUND,
                    .bytes = b,
                    .run = job_run,
                    .free_fn = job_free,
                    .task = j};
    int rc = kvt_io_submit(r->worker, &op, NULL);
    if (rc == KVT_ETOOBIG && r->q_n == 1) { /* one entry always fits an empty queue */
        op.bytes = 0;
        rc = kvt_io_submit(r->worker, &op, NULL);
    }
    if (rc || j->state == KVT__RJOB_COALESCED) {
        job_unlink(r, j);
        r->q_n--;
        r->q_bytes -= b;
        r->ops_live--;
        pthread_mutex_unlock(&r->q_mu);
        kvt__remote_pool_drop(j->res);
        kvt__free(j);
        if (rc) { /* a full worker queue is a full write-behind queue: a counted drop */
            KVT__REMOTE_BUMP(r, dropped, 1);
            return kvt__fail(KVT_EAGAIN, "remote spill: the I/O worker's queue is full");
        }
        kvt_entry_clear(e); /* ownership passed: the identical queued entry is written */
        memset(e, 0, sizeof *e);
        return 0;
    }
    j->state = KVT__RJOB_QUEUED;
    memset(e, 0, sizeof *e);
    pthread_mutex_unlock(&r->q_mu);
    return 0;
}

static int same(const kvt_entry *e, const int32_t *tokens, int64_t n, const char *ns)
{
    return e->n_tokens == n && strcmp(e->ns ? e->ns : "", ns) == 0 &&
           (n == 0 || memcmp(e->tokens, tokens, sizeof(int32_t) * (size_t)n) == 0);
}

int kvt__remote_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_remote *r = self;
    int found = 0;
    pthread_mutex_lock(&r->q_mu);
    for (kvt__rjob *j = r->q_head; j && !found; j = j->next)
        found = same(&j->e, tokens, n, ns);
    pthread_mutex_unlock(&r->q_mu);
    return found;
}

int kvt__remote_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_remote *r = self;
    int hit = 0;
    kvt_entry gone;
    struct kvt_pool_reservation *res = NULL;
    memset(&gone, 0, sizeof gone);
    pthread_mutex_lock(&r->q_mu);
    for (kvt__rjob *j = r->q_head; j; j = j->next)
        if (j->state == KVT__RJOB_QUEUED && same(&j->e, tokens, n, ns)) {
            hit = 1;
            job_unlink(r, j);
            j->state = KVT__RJOB_WITHDRAWN; /* its operation runs as a no-op and frees the job */
            gone = j->e;                    /* taken out under the lock: the job may go at any time after */
            memset(&j->e, 0, sizeof j->e);
            res = j->res;
            j->res = NULL;
            r->q_n--;
            r->q_bytes -= j->bytes;
            break;
        }
    pthread_cond_broadcast(&r->idle_cv);
    pthread_mutex_unlock(&r->q_mu);
    if (!hit)
        return KVT_ENOTFOUND;
    kvt_entry_clear(&gone);
    kvt__remote_pool_drop(res);
    return 0;
}

int kvt__remote_flush(void *self)
{
    kvt_remote *r = self;
    pthread_mutex_lock(&r->q_mu);
    while (r->q_n)
        pthread_cond_wait(&r->idle_cv, &r->q_mu);
    int rc = r->flush_rc;
    r->flush_rc = 0;
    pthread_mutex_unlock(&r->q_mu);
    return rc;
}

/* ---- the tier's I/O worker ------------------------------------------------------- */

int kvt__remote_worker_open(kvt_remote *r, kvt_io *worker)
{
    static _Atomic uint64_t seq;
    r->io_seed = (kvt__key){(uint64_t)(uintptr_t)r * 0x9e3779b97f4a7c15ull,
                            atomic_fetch_add(&seq, 1) * 0xc2b2ae3d27d4eb4full + 0x7e};
    if (worker) {
        r->worker = worker;
        return 0;
    }
    int rc = kvt_io_default_acquire(&r->worker);
    if (rc)
        return kvt__fail(rc, "kvt_remote_open: cannot start the I/O worker: %s", kvt_strerror(rc));
    r->worker_default = 1;
    return 0;
}

int kvt__remote_worker_close(kvt_remote *r)
{
    if (!r->worker)
        return 0;
    pthread_mutex_lock(&r->q_mu);
    r->closing = 1;
    while (r->q_n || r->ops_live || r->restores_live)
        pthread_cond_wait(&r->idle_cv, &r->q_mu);
    int rc = r->flush_rc;
    pthread_mutex_unlock(&r->q_mu);
    if (r->worker_default)
        kvt_io_default_release(r->worker);
    r->worker = NULL;
    return rc;
}
