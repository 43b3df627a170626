/*
 * mem_tier.c: the in-memory cold tier of mem_tier.h, for tests only. Owns
 * zero-copy clones of every entry written to it; never touches the prompt
 * cache that calls it. One mutex guards its state; async reads run on their
 * own threads.
 */
#include "mem_tier.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct stored {
    uint64_t handle;
    kvt_entry e; /* owned clones */
    int pending; /* spilled, not yet written */
    int64_t bytes; /* cache bytes while pending */
    uint64_t seq;  /* insertion order: capacity eviction drops the oldest */
} stored;

struct mem_tier {
    kvt_cold_tier iface;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    stored *v;
    size_t n, cap;
    uint64_t next_handle;
    int fail_writes, refuse_spills, manual_spills, delay_ms, gate_closed, no_async, loose, fail_restores;
    int queue_bytes;
    int active_async;
    int capacity;               /* > 0: at most this many entries (mem_tier_capacity) */
    uint64_t next_seq, evictions;
    kvt_tier_evict_fn evict_fn; /* the eviction hook (kvt_cold_tier.set_evict) */
    void *evict_arg;
    mem_tier_counts c;
    atomic_int_fast64_t hooks_run;
};

static void hook_done(void *ctx)
{
    mem_tier *t = ctx;
    atomic_fetch_add(&t->hooks_run, 1);
}

static int64_t entry_bytes(const kvt_entry *e)
{
    int64_t b = 0;
    for (int32_t i = 0; i < e->n_caches; i++)
        b += (int64_t)kvt_cache_bytes(e->caches[i]);
    for (int32_t i = 0; i < e->n_attachments; i++)
        b += (int64_t)kvt_attachment_bytes(e->attachments[i]);
    return b;
}

/* Cache bytes and count of the pending spills; locked. */
static int64_t pending_bytes(const mem_tier *t, int64_t *count)
{
    int64_t b = 0, c = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i].pending) {
            b += t->v[i].bytes;
            c++;
        }
    *count = c;
    return b;
}

static int clone_entry(const kvt_entry *src, kvt_entry *out)
{
    int rc = kvt_entry_init(out, src->ns, src->tokens, src->n_tokens, src->n_caches, src->n_attachments);
    if (rc)
        return rc;
    rc = src->n_caches ? kvt_caches_clone(src->caches, src->n_caches, out->caches) : 0;
    for (int32_t i = 0; rc == 0 && i < src->n_attachments; i++)
        rc = kvt_attachment_clone(src->attachments[i], &out->attachments[i]);
    if (rc)
        kvt_entry_clear(out);
    return rc;
}

static int64_t common_prefix(const int32_t *a, int64_t na, const int32_t *b, int64_t nb)
{
    int64_t i = 0, n = na < nb ? na : nb;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* Usable prefix of a stored entry for a prompt (the DESIGN.md 3.2 rule). */
static int64_t usable(const kvt_entry *e, const int32_t *prompt, int64_t n)
{
    int64_t p = common_prefix(e->tokens, e->n_tokens, prompt, n);
    if (p > n - 1)
        p = n - 1;
    if (p < 1)
        return 0;
    int64_t reach;
    int trimmable = kvt_entry_trimmable(e, &reach);
    if (p == e->n_tokens)
        return p;
    return trimmable && p >= reach ? p : 0;
}

static stored *find_stored(mem_tier *t, const char *ns, const int32_t *tokens, int64_t n)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i].e.n_tokens == n && strcmp(t->v[i].e.ns, ns) == 0 &&
            (n == 0 || memcmp(t->v[i].e.tokens, tokens, (size_t)n * 4) == 0))
            return &t->v[i];
    return NULL;
}

static stored *by_handle(mem_tier *t, uint64_t h)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i].handle == h)
            return &t->v[i];
    return NULL;
}

static void remove_at(mem_tier *t, size_t i);

/* Over capacity: drops the oldest durable entry other than `keep`, handing
 * it to the eviction hook when one is set; locked. */
static void evict_locked(mem_tier *t, const stored *keep)
{
    while (t->capacity > 0 && t->n > (size_t)t->capacity) {
        size_t victim = t->n;
        for (size_t i = 0; i < t->n; i++)
            if (&t->v[i] != keep && !t->v[i].pending && (victim == t->n || t->v[i].seq < t->v[victim].seq))
                victim = i;
        if (victim == t->n)
            return;
        t->evictions++;
        if (t->evict_fn && t->evict_fn(t->evict_arg, &t->v[victim].e) == 0)
            memset(&t->v[victim].e, 0, sizeof t->v[victim].e); /* the hook owns it */
        if (keep == &t->v[t->n - 1])
            keep = &t->v[victim]; /* remove_at moves the last slot into victim's */
        remove_at(t, victim);
    }
}

/* Adds or replaces (ns, tokens) with an owned entry; locked. */
static int add_locked(mem_tier *t, kvt_entry *owned, int pending)
{
    int64_t bytes = pending ? entry_bytes(owned) : 0;
    if (!pending)
        t->c.writes++;
    stored *s = find_stored(t, owned->ns, owned->tokens, owned->n_tokens);
    if (s) {
        kvt_entry_clear(&s->e);
        s->e = *owned;
        s->pending = pending;
        s->bytes = bytes;
        s->handle = ++t->next_handle;
        s->seq = ++t->next_seq;
        return 0;
    }
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        stored *v = realloc(t->v, cap * sizeof *v);
        if (!v)
            return KVT_ENOMEM;
        t->v = v;
        t->cap = cap;
    }
    t->v[t->n].e = *owned;
    t->v[t->n].pending = pending;
    t->v[t->n].bytes = bytes;
    t->v[t->n].handle = ++t->next_handle;
    t->v[t->n].seq = ++t->next_seq;
    t->n++;
    evict_locked(t, &t->v[t->n - 1]);
    return 0;
}

static void remove_at(mem_tier *t, size_t i)
{
    kvt_entry_clear(&t->v[i].e);
    t->v[i] = t->v[--t->n];
}

static int mt_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.finds++;
    int64_t best = 0;
    stored *bs = NULL;
    for (size_t i = 0; i < t->n; i++) {
        if (t->v[i].pending || strcmp(t->v[i].e.ns, ns) != 0)
            continue;
        int64_t p = usable(&t->v[i].e, prompt, n);
        if (t->loose) {
            p = common_prefix(t->v[i].e.tokens, t->v[i].e.n_tokens, prompt, n);
            p = p > n - 1 ? n - 1 : p;
        }
        if (p > best) {
            best = p;
            bs = &t->v[i];
        }
    }
    if (bs) {
        out->prefix_len = best;
        out->n_tokens = bs->e.n_tokens;
        out->handle = bs->handle;
    }
    pthread_mutex_unlock(&t->mu);
    return bs ? 0 : KVT_ENOTFOUND;
}

static int mt_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.find_exacts++;
    stored *s = find_stored(t, ns, tokens, n);
    if (s && s->pending)
        s = NULL;
    if (s) {
        out->prefix_len = n;
        out->n_tokens = n;
        out->handle = s->handle;
    }
    pthread_mutex_unlock(&t->mu);
    return s ? 0 : KVT_ENOTFOUND;
}

static int restore_locked(mem_tier *t, uint64_t handle, kvt_entry *out)
{
    memset(out, 0, sizeof *out);
    if (t->fail_restores)
        return KVT_EIO;
    stored *s = by_handle(t, handle);
    if (!s || s->pending)
        return KVT_ENOTFOUND;
    int rc = clone_entry(&s->e, out);
    if (rc == 0) {
        out->hook = (kvt_hook){hook_done, t};
        t->c.hooks_given++;
    }
    return rc;
}

static int mt_restore(void *self, uint64_t handle, kvt_entry *out)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.restores++;
    int rc = restore_locked(t, handle, out);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

typedef struct async_job {
    mem_tier *t;
    uint64_t handle;
    kvt_restore_done_fn done;
    void *arg;
} async_job;

static void *async_main(void *p)
{
    async_job *j = p;
    mem_tier *t = j->t;
    pthread_mutex_lock(&t->mu);
    int delay = t->delay_ms;
    pthread_mutex_unlock(&t->mu);
    if (delay > 0) {
        struct timespec ts = {delay / 1000, (long)(delay % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&t->mu);
    while (t->gate_closed)
        pthread_cond_wait(&t->cv, &t->mu);
    kvt_entry e;
    int rc = restore_locked(t, j->handle, &e);
    pthread_mutex_unlock(&t->mu);
    j->done(j->arg, rc, rc == 0 ? &e : NULL);
    if (rc == 0)
        kvt_entry_clear(&e); /* no-op if the callee moved it out */
    pthread_mutex_lock(&t->mu);
    t->active_async--;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    free(j);
    return NULL;
}

static int mt_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    mem_tier *t = self;
    async_job *j = malloc(sizeof *j);
    if (!j)
        return KVT_ENOMEM;
    *j = (async_job){t, handle, done, arg};
    pthread_mutex_lock(&t->mu);
    t->c.async_restores++;
    if (t->no_async) {
        pthread_mutex_unlock(&t->mu);
        free(j);
        return KVT_EAGAIN;
    }
    t->active_async++;
    pthread_mutex_unlock(&t->mu);
    pthread_t th;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    int err = pthread_create(&th, &a, async_main, j);
    pthread_attr_destroy(&a);
    if (err) {
        pthread_mutex_lock(&t->mu);
        t->active_async--;
        pthread_mutex_unlock(&t->mu);
        free(j);
        return KVT_EAGAIN;
    }
    return 0;
}

static int mt_store(void *self, const kvt_entry *e)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.stores++;
    if (t->fail_writes) {
        t->c.failed_writes++;
        pthread_mutex_unlock(&t->mu);
        return KVT_EIO;
    }
    kvt_entry copy;
    int rc = clone_entry(e, &copy);
    if (rc == 0 && (rc = add_locked(t, &copy, 0)) != 0)
        kvt_entry_clear(&copy);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

static int mt_spill(void *self, kvt_entry *e)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.spills++;
    if (t->refuse_spills) {
        t->c.refused_spills++;
        pthread_mutex_unlock(&t->mu);
        return KVT_EAGAIN;
    }
    int rc = 0;
    int64_t queued = 0, qbytes = pending_bytes(t, &queued);
    if (t->manual_spills && t->queue_bytes > 0 && queued > 0 && qbytes + entry_bytes(e) > t->queue_bytes) {
        t->c.refused_spills++;
        pthread_mutex_unlock(&t->mu);
        return KVT_EAGAIN; /* the bounded write-behind queue is full */
    }
    if (t->manual_spills) {
        rc = add_locked(t, e, 1);
    } else if (t->fail_writes) {
        t->c.failed_writes++;
        kvt_entry_clear(e); /* accepted; the write fails later */
    } else {
        rc = add_locked(t, e, 0);
        if (rc == 0)
            t->c.spill_writes++;
    }
    if (rc == 0)
        memset(e, 0, sizeof *e);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

static int mt_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.pendings++;
    stored *s = find_stored(t, ns, tokens, n);
    int p = s && s->pending;
    pthread_mutex_unlock(&t->mu);
    return p;
}

static int mt_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    stored *s = find_stored(t, ns, tokens, n);
    int found = s && s->pending;
    if (found) {
        t->c.withdrawn++;
        remove_at(t, (size_t)(s - t->v));
    }
    pthread_mutex_unlock(&t->mu);
    return found ? 0 : KVT_ENOTFOUND;
}

static int mt_flush(void *self)
{
    mem_tier_drain(self);
    return 0;
}

int mem_tier_drain(mem_tier *t)
{
    int n = 0;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n;) {
        if (!t->v[i].pending) {
            i++;
            continue;
        }
        if (t->fail_writes) {
            t->c.failed_writes++;
            remove_at(t, i);
            continue;
        }
        t->v[i].pending = 0;
        t->v[i].bytes = 0;
        t->c.spill_writes++;
        t->c.writes++;
        n++;
        i++;
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

static int mt_stats(void *self, kvt_tier_stats *out)
{
    mem_tier *t = self;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&t->mu);
    out->finds = (uint64_t)t->c.finds;
    out->restores = (uint64_t)t->c.restores;
    out->stores = (uint64_t)(t->c.stores + t->c.spill_writes);
    out->write_failures = (uint64_t)(t->c.failed_writes + t->c.refused_spills);
    out->evictions = t->evictions;
    for (size_t i = 0; i < t->n; i++) {
        if (t->v[i].pending)
            continue;
        out->entries++;
        out->bytes += (uint64_t)entry_bytes(&t->v[i].e);
    }
    pthread_mutex_unlock(&t->mu);
    return 0;
}

static void mt_set_evict(void *self, kvt_tier_evict_fn fn, void *arg)
{
    mem_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->evict_fn = fn;
    t->evict_arg = arg;
    pthread_mutex_unlock(&t->mu);
}

void mem_tier_capacity(mem_tier *t, int max_entries)
{
    pthread_mutex_lock(&t->mu);
    t->capacity = max_entries;
    evict_locked(t, NULL);
    pthread_mutex_unlock(&t->mu);
}

int mem_tier_create(mem_tier **out)
{
    mem_tier *t = calloc(1, sizeof *t);
    if (!t)
        return KVT_ENOMEM;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    t->iface = (kvt_cold_tier){.self = t,
                               .find = mt_find,
                               .find_exact = mt_find_exact,
                               .restore = mt_restore,
                               .restore_async = mt_restore_async,
                               .store = mt_store,
                               .spill = mt_spill,
                               .pending = mt_pending,
                               .flush = mt_flush,
                               .withdraw = mt_withdraw,
                               .stats = mt_stats,
                               .set_evict = mt_set_evict};
    *out = t;
    return 0;
}

void mem_tier_clear(mem_tier *t)
{
    pthread_mutex_lock(&t->mu);
    while (t->n > 0)
        remove_at(t, t->n - 1);
    pthread_mutex_unlock(&t->mu);
}

void mem_tier_quiesce(mem_tier *t)
{
    pthread_mutex_lock(&t->mu);
    while (t->active_async > 0)
        pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
}

void mem_tier_destroy(mem_tier *t)
{
    if (!t)
        return;
    mem_tier_gate(t, 0);
    mem_tier_quiesce(t);
    for (size_t i = 0; i < t->n; i++)
        kvt_entry_clear(&t->v[i].e);
    free(t->v);
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

const kvt_cold_tier *mem_tier_iface(mem_tier *t) { return &t->iface; }

#define MT_SETTER(fname, field)              \
    void fname(mem_tier *t, int v)           \
    {                                        \
        pthread_mutex_lock(&t->mu);          \
        t->field = v;                        \
        pthread_cond_broadcast(&t->cv);      \
        pthread_mutex_unlock(&t->mu);        \
    }
MT_SETTER(mem_tier_fail_writes, fail_writes)
MT_SETTER(mem_tier_refuse_spills, refuse_spills)
MT_SETTER(mem_tier_manual_spills, manual_spills)
MT_SETTER(mem_tier_queue_bytes, queue_bytes)
MT_SETTER(mem_tier_async_delay, delay_ms)
MT_SETTER(mem_tier_gate, gate_closed)
MT_SETTER(mem_tier_no_async, no_async)
MT_SETTER(mem_tier_loose_find, loose)
MT_SETTER(mem_tier_fail_restores, fail_restores)

mem_tier_counts mem_tier_counts_get(mem_tier *t)
{
    pthread_mutex_lock(&t->mu);
    mem_tier_counts c = t->c;
    c.entries = (int64_t)t->n;
    pthread_mutex_unlock(&t->mu);
    c.hooks_run = atomic_load(&t->hooks_run);
    return c;
}

int mem_tier_has(mem_tier *t, const char *ns, const int32_t *tokens, int64_t n)
{
    pthread_mutex_lock(&t->mu);
    stored *s = find_stored(t, ns, tokens, n);
    int has = s && !s->pending;
    pthread_mutex_unlock(&t->mu);
    return has;
}

int mem_tier_insert(mem_tier *t, kvt_entry *owned)
{
    pthread_mutex_lock(&t->mu);
    int rc = add_locked(t, owned, 0);
    if (rc == 0)
        memset(owned, 0, sizeof *owned);
    pthread_mutex_unlock(&t->mu);
    return rc;
}
