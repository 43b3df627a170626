/*
 * writer.c: the SSD tier's write-behind queue (kvt_store_put_async) and its
 * writer thread, bounded in bytes. A queued job stays findable (the pending
 * index) and restorable (restore.c clones its caches) until its write ends;
 * flush waits for the queue to drain and reports the first failure.
 * It never blocks a caller on I/O: put_async enqueues or refuses.
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
            kvt__index_insert(s->ptree, e->ns, e->tokens, e->n_tokens, j->twin,
                              kvt__store_trimmable(e->n_tokens, j->min_reach), j->min_reach, &was);
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
    j->bytes = entry_bytes(e);
    j->key = kvt__entry_key(s->id_seed, e->ns, e->tokens, e->n_tokens);
    int64_t min_reach = 0;
    kvt_entry_trimmable(e, &min_reach);
    if (e->n_attachments)
        min_reach = e->n_tokens;
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
    j->id = ++s->next_id;
    atomic_init(&j->refs, 1);
    if (pending_add(s, j->key, 1)) {
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    }
    if (kvt__kmap_put_ptr(&s->pjobs, kvt__store_id_key(j->id), j) ||
        kvt__index_insert(s->ptree, j->e.ns, j->e.tokens, j->e.n_tokens, j, kvt__store_trimmable(j->e.n_tokens, min_reach),
                          min_reach, (void **)&j->twin)) {
        kvt__kmap_del(&s->pjobs, kvt__store_id_key(j->id));
        pending_add(s, j->key, -1);
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    }
    memset(e, 0, sizeof *e);
    if (s->q_tail)
        s->q_tail->next = j;
    else
        s->q_head = j;
    s->q_tail = j;
    s->st.pending++;
    s->st.pending_bytes += j->bytes;
    pthread_cond_signal(&s->q_cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void *kvt__store_writer_main(void *arg)
{
    kvt_store *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->q_head && !s->closing)
            pthread_cond_wait(&s->q_cv, &s->mu);
        wjob *j = s->q_head;
        if (!j)
            break; /* closing and drained */
        s->q_head = j->next;
        if (!s->q_head)
            s->q_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        int rc = kvt__store_write(s, &j->e, j->id);
        kvt__key key = j->key;
        uint64_t bytes = j->bytes;
        char msg[sizeof s->flush_msg];
        if (rc)
            snprintf(msg, sizeof msg, "%s", kvt_last_error());
        pthread_mutex_lock(&s->mu);
        pjob_unindex(s, j);
        pthread_mutex_unlock(&s->mu);
        /* the entry goes now, or with the last clone; before the job stops
         * counting as pending, so a flush returns after it */
        kvt__store_job_release(j);
        pthread_mutex_lock(&s->mu);
        if (rc) {
            s->flush_rc = rc;
            memcpy(s->flush_msg, msg, sizeof msg);
            s->behind_failed++;
        }
        pending_add(s, key, -1);
        s->st.pending--;
        s->st.pending_bytes -= bytes;
        pthread_cond_broadcast(&s->idle_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
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

