/*
 * writeback.c: the remote tier's write-behind. spill queues an entry (the
 * queue is bounded in bytes and entries; a full queue or a Redis marked down
 * is a counted drop, never a wait) and one writer thread stores the queue in
 * order; pending and withdraw look into the queue; flush waits until it is
 * empty and reports the first failure since the last flush.
 */
#include "remote_internal.h"

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

void *kvt__remote_writer_main(void *arg)
{
    kvt_remote *r = arg;
    pthread_mutex_lock(&r->q_mu);
    for (;;) {
        while (!r->q_head && !r->closing)
            pthread_cond_wait(&r->q_cv, &r->q_mu);
        if (!r->q_head)
            break;
        kvt__rjob *j = r->q_head;
        r->q_head = j->next;
        if (!r->q_head)
            r->q_tail = NULL;
        r->q_n--;
        r->q_bytes -= j->bytes;
        r->inflight = j;
        pthread_mutex_unlock(&r->q_mu);
        int rc;
        if (kvt__remote_all_down(r)) {
            KVT__REMOTE_BUMP(r, dropped, 1);
            KVT__REMOTE_COUNT(r, behind_dropped);
            rc = kvt__fail(KVT_EIO, "remote write-behind: redis %s is unreachable; the write was dropped", r->host);
        } else if ((rc = kvt__remote_store(r, &j->e))) {
            KVT__REMOTE_COUNT(r, behind_failed);
        }
        /* readers (stats, pending) see inflight under q_mu: it leaves before
         * the job is freed; flush waits for `releasing` to drop as well */
        pthread_mutex_lock(&r->q_mu);
        r->inflight = NULL;
        r->releasing = 1;
        pthread_mutex_unlock(&r->q_mu);
        kvt_entry_clear(&j->e);
        kvt__remote_pool_drop(j->res); /* no longer in flight */
        kvt__free(j);
        pthread_mutex_lock(&r->q_mu);
        r->releasing = 0;
        if (rc && !r->flush_rc)
            r->flush_rc = rc;
        pthread_cond_broadcast(&r->idle_cv);
    }
    pthread_mutex_unlock(&r->q_mu);
    return NULL;
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
    memset(e, 0, sizeof *e);
    if (r->q_tail)
        r->q_tail->next = j;
    else
        r->q_head = j;
    r->q_tail = j;
    r->q_n++;
    r->q_bytes += b;
    pthread_cond_signal(&r->q_cv);
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
    if (r->inflight && same(&r->inflight->e, tokens, n, ns))
        found = 1;
    for (kvt__rjob *j = r->q_head; j && !found; j = j->next)
        found = same(&j->e, tokens, n, ns);
    pthread_mutex_unlock(&r->q_mu);
    return found;
}

int kvt__remote_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_remote *r = self;
    kvt__rjob *hit = NULL;
    pthread_mutex_lock(&r->q_mu);
    for (kvt__rjob **pp = &r->q_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next)
        if (same(&(*pp)->e, tokens, n, ns)) {
            hit = *pp;
            *pp = hit->next;
            if (r->q_tail == hit)
                r->q_tail = prev;
            r->q_n--;
            r->q_bytes -= hit->bytes;
            break;
        }
    pthread_cond_broadcast(&r->idle_cv);
    pthread_mutex_unlock(&r->q_mu);
    if (!hit)
        return KVT_ENOTFOUND;
    kvt_entry_clear(&hit->e);
    kvt__remote_pool_drop(hit->res);
    kvt__free(hit);
    return 0;
}

int kvt__remote_flush(void *self)
{
    kvt_remote *r = self;
    pthread_mutex_lock(&r->q_mu);
    while (r->q_head || r->inflight || r->releasing)
        pthread_cond_wait(&r->idle_cv, &r->q_mu);
    int rc = r->flush_rc;
    r->flush_rc = 0;
    pthread_mutex_unlock(&r->q_mu);
    return rc;
}
