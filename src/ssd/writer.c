/*
 * writer.c: the SSD tier's write-behind queue (kvt_store_put_async),
 * bounded in bytes: each job is one background write operation of the
 * process's I/O worker (kvtier/io.h), keyed by the entry's content key, so
 * an identical write already queued or running is joined, not repeated. A
 * queued job stays findable (the pending index) and restorable (restore.c
 * clones its caches) until its write ends; flush waits for the store's jobs
 * to end and reports the first failure. It never blocks a caller on I/O:
 * put_async enqueues or refuses (a full worker queue is a counted drop).
 */
#include "hmap.h"
#include "index.h"
#include "internal.h"
#include "store_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

static uint64_t entry_bytes(const kvt_entry *e)
{
    uint64_t b = 0;
    for (int32_t l = 0; l < e->n_caches; l++)
        b += kvt_cache_bytes(e->caches[l]);
    for (int32_t a = 0; a < e->n_attachments; a++)
        if (e->attachments[a])
            b += kvt_attachment_bytes(e->attachments[a]);
    return b;
}

/* Pending writes per entry key (a count; absent = 0). */
static int pending_add(kvt_store *s, kvt__key k, int delta)
{
    uint64_t *v = kvt__kmap_get(&s->pending, k);
    int64_t c = (v ? (int64_t)*v : 0) + delta;
    if (c <= 0) {
        kvt__kmap_del(&s->pending, k);
        return 0;
    }
    return kvt__kmap_put(&s->pending, k, (uint64_t)c);
}

/* Drops a job from the pending lookups (call with mu held). */
static void pjob_unindex(kvt_store *s, wjob *j)
{
    const kvt_entry *e = &j->e;
    wjob *head = kvt__index_exact(s->ptree, e->ns, e->tokens, e->n_tokens);
    if (head == j) {
        void *was;
        if (j->twin) /* the next older twin takes the node: it exists, nothing is allocated */
            kvt__index_insert_g(s->ptree, e->ns, e->tokens, e->n_tokens, j->twin,
                                kvt__store_trimmable(e->n_tokens, j->twin->min_reach, j->twin->granule),
                                j->twin->min_reach, j->twin->granule, &was);
        else
            kvt__index_remove(s->ptree, e->ns, e->tokens, e->n_tokens);
    } else {
        for (wjob *x = head; x; x = x->twin)
            if (x->twin == j) {
                x->twin = j->twin;
                break;
            }
    }
    j->twin = NULL;
    kvt__kmap_del(&s->pjobs, kvt__store_id_key(j->id));
}

/* Drops one reference to a job; the last clears its entry (caches,
 * attachments, then its hook) and frees it. Needs no store: a clone may
 * outlive it. */
void kvt__store_job_release(wjob *j)
{
    if (atomic_fetch_sub(&j->refs, 1) != 1)
        return;
    kvt_entry_clear(&j->e);
    kvt__free(j);
}

void kvt__store_job_hook(void *ctx) { kvt__store_job_release(ctx); }

/* Ends a job (its write ran with status rc, or never ran): it leaves the
 * pending lookups, its entry goes now or with the last clone, and only then
 * does it stop counting as pending, so a flush returns after all of that. */
static void job_finish(kvt_store *s, wjob *j, int rc)
{
    kvt__key key = j->key;
    uint64_t bytes = j->bytes;
    char msg[sizeof s->flush_msg];
    if (rc)
        snprintf(msg, sizeof msg, "%s", kvt_last_error());
    pthread_mutex_lock(&s->mu);
    pjob_unindex(s, j);
    pthread_mutex_unlock(&s->mu);
    kvt__store_job_release(j);
    pthread_mutex_lock(&s->mu);
    if (rc) {
        s->flush_rc = rc;
        memcpy(s->flush_msg, msg, sizeof msg);
        if (rc == KVT_ECLOSED)
            s->behind_dropped++; /* discarded unrun (job_free) */
        else
            s->behind_failed++;
    }
    pending_add(s, key, -1);
    s->st.pending--;
    s->st.pending_bytes -= bytes;
    pthread_cond_broadcast(&s->idle_cv);
    pthread_mutex_unlock(&s->mu);
}

/* The write operation (on a worker thread). *result marks that it ran:
 * the job is finished (maybe freed) by then. */
static int job_run(void *task, void **result)
{
    wjob *j = task;
    kvt_store *s = j->s;
    int rc = kvt__store_write(s, &j->e, j->id);
    job_finish(s, j, rc);
    *result = task;
    return rc;
}

/* The write operation's free function: nothing left after a run; a job
 * coalesced inside kvt_io_submit is only marked (its submitter, holding
 * mu, undoes it); a queued job the worker discarded unrun (it shut down)
 * ends as a failed write. */
static void job_free(void *task, void *result)
{
    wjob *j = task;
    if (result)
        return;
    if (j->state == KVT__WJOB_SUBMITTING) {
        j->state = KVT__WJOB_COALESCED;
        return;
    }
    kvt__fail(KVT_ECLOSED, "store write-behind: the I/O worker shut down before the write ran");
    job_finish(j->s, j, KVT_ECLOSED);
}

/* Undoes the indexing of a job that will not be written by the worker
 * (call with mu held). */
static void job_unqueue(kvt_store *s, wjob *j)
{
    pjob_unindex(s, j);
    pending_add(s, j->key, -1);
}

KVT_API int kvt_store_put_async(kvt_store *s, kvt_entry *e)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_store_put_async: store is NULL");
    int rc = kvt__store_check_entry(e, "kvt_store_put_async");
    if (rc)
        return rc;
    if (s->opts.read_only)
        return kvt__store_refuse_write(s, "kvt_store_put_async");
    wjob *j = kvt__calloc(1, sizeof *j);
    if (!j)
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    j->s = s;
    j->bytes = entry_bytes(e);
    j->key = kvt__entry_key(s->id_seed, e->ns, e->tokens, e->n_tokens);
    int64_t min_reach = 0;
    kvt_entry_trimmable(e, &min_reach);
    if (e->n_attachments)
        min_reach = e->n_tokens;
    int64_t granule = kvt_entry_trim_granule(e);
    pthread_mutex_lock(&s->mu);
    if (s->closing || (s->st.pending && s->st.pending_bytes + j->bytes > s->opts.queue_max_bytes)) {
        s->st.dropped++;
        int closing = s->closing;
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return closing ? kvt__fail(KVT_ECLOSED, "kvt_store_put_async: the store is closing")
                       : kvt__fail(KVT_EAGAIN, "kvt_store_put_async: the write-behind queue is full");
    }
    j->e = *e;
    j->min_reach = min_reach;
    j->granule = granule;
    j->id = ++s->next_id;
    atomic_init(&j->refs, 1);
    if (pending_add(s, j->key, 1)) {
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    }
    if (kvt__kmap_put_ptr(&s->pjobs, kvt__store_id_key(j->id), j) ||
        kvt__index_insert_g(s->ptree, j->e.ns, j->e.tokens, j->e.n_tokens, j,
                            kvt__store_trimmable(j->e.n_tokens, min_reach, granule), min_reach, granule,
                            (void **)&j->twin)) {
        kvt__kmap_del(&s->pjobs, kvt__store_id_key(j->id));
        pending_add(s, j->key, -1);
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    }
    /* Submitted with mu held (the lock order is store, then worker), so no
     * clone of the indexed job can be handed out before the worker has
     * accepted or refused it. An identical write queued or running (the
     * same tokens in the same ns) is joined: that one serves, this entry is
     * not needed. One entry is always accepted into an empty queue, also
     * when it is larger than the worker's byte bound. */
    j->state = KVT__WJOB_SUBMITTING;
    kvt_io_op op = {.kind = KVT_IO_KIND_WRITE,
                    .key = kvt__store_io_key(s, j->key),
                    .priority = KVT_IO_BACKGROUND,
                    .bytes = j->bytes,
                    .run = job_run,
                    .free_fn = job_free,
                    .task = j};
    rc = kvt_io_submit(s->worker, &op, NULL);
    if (rc == KVT_ETOOBIG && !s->st.pending) {
        op.bytes = 0;
        rc = kvt_io_submit(s->worker, &op, NULL);
    }
    if (rc) { /* a full worker queue is a full write-behind queue: a counted drop */
        char why[256];
        snprintf(why, sizeof why, "%s", kvt_last_error());
        job_unqueue(s, j);
        s->st.dropped++;
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(rc, "kvt_store_put_async: dropped: %s", why);
    }
    if (j->state == KVT__WJOB_COALESCED) {
        job_unqueue(s, j);
        s->st.skipped++;
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        kvt_entry_clear(e); /* ownership passed: the identical queued entry is written */
        memset(e, 0, sizeof *e);
        return 0;
    }
    j->state = KVT__WJOB_QUEUED;
    memset(e, 0, sizeof *e);
    s->st.pending++;
    s->st.pending_bytes += j->bytes;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

KVT_API int kvt_store_flush(kvt_store *s)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_store_flush: store is NULL");
    pthread_mutex_lock(&s->mu);
    while (s->st.pending)
        pthread_cond_wait(&s->idle_cv, &s->mu);
    int rc = s->flush_rc;
    char msg[sizeof s->flush_msg];
    memcpy(msg, s->flush_msg, sizeof msg);
    s->flush_rc = 0;
    pthread_mutex_unlock(&s->mu);
    if (rc)
        return kvt__fail(rc, "store flush: a write-behind write failed: %s", msg);
    return 0;
}


/* ---- the store's I/O worker ---------------------------------------------------- */

int kvt__store_worker_open(kvt_store *s)
{
    static _Atomic uint64_t seq;
    s->io_seed = (kvt__key){(uint64_t)(uintptr_t)s * 0x9e3779b97f4a7c15ull,
                            atomic_fetch_add(&seq, 1) * 0xc2b2ae3d27d4eb4full + 1};
    if (s->opts.worker) {
        s->worker = s->opts.worker;
        return 0;
    }
    int rc = kvt_io_default_acquire(&s->worker);
    if (rc)
        return kvt__fail(rc, "kvt_store_open: cannot start the I/O worker: %s", kvt_strerror(rc));
    s->worker_default = 1;
    return 0;
}

int kvt__store_worker_close(kvt_store *s)
{
    int rc = kvt_store_flush(s);
    pthread_mutex_lock(&s->mu);
    s->closing = 1;
    /* a write queued after the flush (raced with close) and the waiters of
     * asynchronous restores: the worker lets go of the store first */
    while (s->st.pending || s->restores_live)
        pthread_cond_wait(&s->idle_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return rc;
}
