/*
 * pc_session.c: what requests hold in the prompt cache (DESIGN.md 3.10,
 * 3.11): session affinity (a session id maps to its latest entry per
 * namespace; closing it drops the affinity, never the data), pins and the
 * leases that carry them, and prefetch reads (the cold read started early,
 * coalesced, published pinned, discarded when a clear ran meanwhile).
 */
#include "prompt_cache_internal.h"

#include <errno.h>
#include <time.h>

/* ---- sessions ------------------------------------------------------------------ */

void kvt__pc_session_release_slots(kvt_prompt_cache *pc, pc_session *s)
{
    for (size_t i = 0; i < s->n; i++) {
        pc_entry *e = kvt__pc_by_id(pc, s->slots[i].id);
        if (e)
            e->sessions--;
        kvt__free(s->slots[i].ns);
    }
    kvt__free(s->slots);
    kvt__free(s);
}

pc_slot *kvt__pc_session_slot(const kvt_prompt_cache *pc, const char *session, const char *ns)
{
    pc_session *s = kvt__smap_get(&pc->sessions, session);
    for (size_t i = 0; s && i < s->n; i++)
        if (strcmp(s->slots[i].ns, ns) == 0)
            return &s->slots[i];
    return NULL;
}

/* Points (session, ns) at e. Best effort: on out of memory the affinity is
 * simply not recorded (a session is a hint, never data). */
void kvt__pc_session_associate(kvt_prompt_cache *pc, const char *session, const char *ns, pc_entry *e)
{
    if (!session)
        return;
    pc_slot *slot = kvt__pc_session_slot(pc, session, ns);
    if (!slot) {
        pc_session *s = kvt__smap_get(&pc->sessions, session);
        if (!s) {
            s = kvt__calloc(1, sizeof *s);
            if (!s || kvt__smap_put(&pc->sessions, session, s) != 0) {
                kvt__free(s);
                return;
            }
        }
        pc_slot *v = kvt__realloc(s->slots, (s->n + 1) * sizeof *v);
        if (!v)
            return;
        s->slots = v;
        char *nsc = kvt__strdup(ns);
        if (!nsc)
            return;
        slot = &s->slots[s->n++];
        slot->ns = nsc;
        slot->id = 0;
    }
    if (slot->id == e->id)
        return;
    pc_entry *old = kvt__pc_by_id(pc, slot->id);
    if (old)
        old->sessions--;
    slot->id = e->id;
    e->sessions++;
}

typedef struct follow_ctx {
    const char *ns;
    uint64_t from, to;
} follow_ctx;

static void follow_session(const char *key, void *val, void *ctx)
{
    (void)key;
    pc_session *s = val;
    follow_ctx *f = ctx;
    for (size_t i = 0; i < s->n; i++)
        if (s->slots[i].id == f->from && strcmp(s->slots[i].ns, f->ns) == 0)
            s->slots[i].id = f->to;
}

/* `to` replaces `from` (equal tokens): sessions and pins follow (3.5). */
void kvt__pc_entry_follow(kvt_prompt_cache *pc, pc_entry *from, pc_entry *to)
{
    if (from->sessions > 0) {
        follow_ctx f = {from->ns, from->id, to->id};
        kvt__smap_foreach(&pc->sessions, follow_session, &f);
        to->sessions += from->sessions;
        from->sessions = 0;
    }
    if (from->pins > 0) {
        if (to->pins == 0)
            pc->pinned++;
        to->pins += from->pins;
        /* leases still name the old id: unpin follows this link */
        kvt__umap_put(&pc->forward, from->id, to->id);
    }
}

/* Session entry serving the prompt (strict prefix, resident), or NULL. */
pc_entry *kvt__pc_session_entry(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns,
                                const char *session)
{
    if (!session)
        return NULL;
    pc_slot *slot = kvt__pc_session_slot(pc, session, ns);
    pc_entry *e = slot ? kvt__pc_by_id(pc, slot->id) : NULL;
    if (e && e->n_tokens >= 1 && e->n_tokens < n && kvt__pc_tokens_equal(e->tokens, prompt, e->n_tokens))
        return e;
    return NULL;
}

/* ---- closing a session; pins and leases ---------------------------------------------- */

KVT_API void kvt_prompt_cache_close_session(kvt_prompt_cache *pc, const char *session)
{
    if (!pc || !session)
        return;
    pthread_mutex_lock(&pc->mu);
    pc_session *s = kvt__smap_del(&pc->sessions, session);
    if (s)
        kvt__pc_session_release_slots(pc, s);
    pthread_mutex_unlock(&pc->mu);
}

static void pin_locked(kvt_prompt_cache *pc, pc_entry *e)
{
    if (e->pins++ == 0)
        pc->pinned++;
}

/* Unpins the entry a lease names, following replacements. */
static void unpin_locked(kvt_prompt_cache *pc, uint64_t id)
{
    pc_entry *e = kvt__pc_by_id(pc, id);
    for (int hops = 0; !e && hops < 64; hops++) {
        uint64_t *f = kvt__umap_get(&pc->forward, id);
        if (!f)
            break;
        id = *f;
        e = kvt__pc_by_id(pc, id);
    }
    if (e && e->pins > 0 && --e->pins == 0)
        pc->pinned--;
}

static int lease_new(kvt_prompt_cache *pc, kvt_lease **out)
{
    *out = kvt__calloc(1, sizeof **out);
    if (!*out)
        return kvt__fail(KVT_ENOMEM, "prompt cache: out of memory for a lease");
    (*out)->pc = pc;
    return 0;
}

KVT_API int kvt_prompt_cache_pin(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n, const char *ns,
                                 kvt_lease **out)
{
    ns = kvt__ns(ns);
    if (out) /* cleared before any check: a release after an error frees nothing */
        *out = NULL;
    int rc = kvt__pc_check_prompt(pc, tokens, n, ns, out, "kvt_prompt_cache_pin");
    if (rc)
        return rc;
    kvt_lease *l;
    if ((rc = lease_new(pc, &l)) != 0)
        return rc;
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__index_exact(pc->ix, ns, tokens, n);
    if (e) {
        pin_locked(pc, e);
        l->entry_id = e->id;
    }
    pthread_mutex_unlock(&pc->mu);
    if (!e) {
        kvt__free(l);
        return kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_pin: no entry of %lld tokens in ns '%s'", (long long)n, ns);
    }
    *out = l;
    return 0;
}

/* ---- prefetch ------------------------------------------------------------------------- */

static void read_unref_locked(pc_read *r)
{
    if (--r->refs > 0)
        return;
    kvt__free(r->ns);
    kvt__free(r->session);
    kvt__free(r);
}

static void read_unlist_locked(kvt_prompt_cache *pc, pc_read *r)
{
    for (pc_read **pp = &pc->reads; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            return;
        }
}

/* Completion of a prefetch read (any thread, never under the lock). */
static void read_done(void *arg, int status, kvt_entry *loaded)
{
    pc_read *r = arg;
    kvt_prompt_cache *pc = r->pc;
    kvt_entry mine;
    memset(&mine, 0, sizeof mine);
    if (status == 0 && loaded) {
        mine = *loaded;
        memset(loaded, 0, sizeof *loaded);
    }
    pc_entry *x = NULL;
    size_t standalone = 0;
    int rc = status ? status : kvt__pc_entry_prepare(pc, &mine, &x, &standalone);
    pc_entry *gone = NULL;
    int adopted = 0;
    pthread_mutex_lock(&pc->mu);
    if (rc == 0 && r->epoch != pc->epoch) {
        rc = KVT_ESTALE; /* a clear ran during the read (3.11) */
        pc->st.prefetch_discarded++;
    }
    if (rc == 0) {
        rc = kvt__pc_insert_locked(pc, x, standalone, r->session, r->interest, &gone, NULL, 0);
        if (rc == 0) {
            adopted = 1;
            r->entry_id = x->id;
            kvt__pc_evict(pc, -1, &gone); /* x may leave from here on */
        }
    }
    r->status = rc;
    r->done = 1;
    pthread_cond_broadcast(&pc->cv);
    pthread_mutex_unlock(&pc->mu);
    if (adopted)
        kvt__pc_adopt_parts(&mine);
    else
        kvt__pc_entry_discard(x);
    kvt_entry_clear(&mine);
    kvt__pc_gone_process(pc, gone);
    /* last: destroy waits for the list to empty before freeing pc */
    pthread_mutex_lock(&pc->mu);
    read_unlist_locked(pc, r);
    read_unref_locked(r);
    pthread_cond_broadcast(&pc->cv);
    pthread_mutex_unlock(&pc->mu);
}

KVT_API int kvt_prompt_cache_prefetch(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns,
                                      const char *session, kvt_lease **out)
{
    ns = kvt__ns(ns);
    if (out) /* cleared before any check, as kvt_prompt_cache_pin */
        *out = NULL;
    int rc = kvt__pc_check_prompt(pc, prompt, n, ns, out, "kvt_prompt_cache_prefetch");
    if (rc)
        return rc;
    kvt_lease *l;
    if ((rc = lease_new(pc, &l)) != 0)
        return rc;
    /* the cold tier first, without the lock (a lookup may block on I/O);
     * every RAM decision below is then made under the lock at once */
    kvt_cold_hit ch;
    void *val;
    int cold = pc->has_cold && pc->cold.find(pc->cold.self, prompt, n, ns, &ch) == 0;
    pthread_mutex_lock(&pc->mu);
    pc_entry *se = kvt__pc_session_entry(pc, prompt, n, ns, session);
    if (se && !(cold && ch.prefix_len > se->n_tokens)) { /* 3.4: only a longer cold prefix beats it */
        pin_locked(pc, se);
        l->entry_id = se->id;
        pthread_mutex_unlock(&pc->mu);
        *out = l;
        return 0;
    }
    if (!cold || ch.prefix_len <= kvt__index_lookup(pc->ix, ns, prompt, n, &val)) {
        pthread_mutex_unlock(&pc->mu);
        *out = l; /* nothing to read */
        return 0;
    }
    for (pc_read *r = pc->reads; r; r = r->next)
        if (!r->done && r->handle == ch.handle && strcmp(r->ns, ns) == 0 && r->epoch == pc->epoch) {
            r->refs++;
            r->interest++;
            l->read = r;
            pc->st.prefetch_coalesced++;
            pthread_mutex_unlock(&pc->mu);
            *out = l;
            return 0;
        }
    pc_read *r = kvt__calloc(1, sizeof *r);
    char *nsc = kvt__strdup(ns);
    char *sc = session ? kvt__strdup(session) : NULL;
    if (!r || !nsc || (session && !sc)) {
        pthread_mutex_unlock(&pc->mu);
        kvt__free(r);
        kvt__free(nsc);
        kvt__free(sc);
        kvt__free(l);
        return kvt__fail(KVT_ENOMEM, "kvt_prompt_cache_prefetch: out of memory");
    }
    r->pc = pc;
    r->handle = ch.handle;
    r->ns = nsc;
    r->session = sc;
    r->epoch = pc->epoch;
    r->refs = 2; /* the lease and the read in flight */
    r->interest = 1;
    r->next = pc->reads;
    pc->reads = r;
    l->read = r;
    pc->st.prefetch_reads++;
    pthread_mutex_unlock(&pc->mu);
    if (pc->cold.restore_async) {
        rc = pc->cold.restore_async(pc->cold.self, ch.handle, read_done, r);
        if (rc) {
            pthread_mutex_lock(&pc->mu);
            r->status = rc;
            r->done = 1;
            read_unlist_locked(pc, r);
            read_unref_locked(r); /* the read that never started */
            r->interest--;
            read_unref_locked(r); /* our lease */
            pthread_cond_broadcast(&pc->cv);
            pthread_mutex_unlock(&pc->mu);
            kvt__free(l);
            return kvt__fail(rc, "kvt_prompt_cache_prefetch: the cold tier refused the read (%s)", kvt_strerror(rc));
        }
    } else {
        kvt_entry loaded;
        memset(&loaded, 0, sizeof loaded);
        int st = pc->cold.restore(pc->cold.self, ch.handle, &loaded);
        read_done(r, st, st == 0 ? &loaded : NULL);
    }
    *out = l;
    return 0;
}

KVT_API int kvt_lease_wait(kvt_lease *lease, uint64_t timeout_ms)
{
    if (!lease)
        return kvt__fail(KVT_EINVAL, "kvt_lease_wait: lease is NULL");
    if (!lease->read)
        return 0;
    kvt_prompt_cache *pc = lease->pc;
    pc_read *r = lease->read;
    struct timespec dl = kvt__deadline(CLOCK_MONOTONIC, timeout_ms == UINT64_MAX ? 0 : timeout_ms);
    pthread_mutex_lock(&pc->mu);
    while (!r->done) {
        if (timeout_ms == UINT64_MAX)
            pthread_cond_wait(&pc->cv, &pc->mu);
        else if (pthread_cond_timedwait(&pc->cv, &pc->mu, &dl) == ETIMEDOUT)
            break;
    }
    int rc = r->done ? r->status : KVT_EAGAIN;
    pthread_mutex_unlock(&pc->mu);
    if (rc)
        return kvt__fail(rc, "kvt_lease_wait: %s", kvt_strerror(rc));
    return 0;
}

KVT_API void kvt_lease_release(kvt_lease *lease)
{
    if (!lease)
        return;
    kvt_prompt_cache *pc = lease->pc;
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    if (lease->entry_id)
        unpin_locked(pc, lease->entry_id);
    pc_read *r = lease->read;
    if (r) {
        if (r->done) {
            if (r->status == 0 && r->entry_id)
                unpin_locked(pc, r->entry_id);
        } else {
            r->interest--;
        }
        read_unref_locked(r);
    }
    kvt__pc_evict(pc, -1, &gone);
    pthread_mutex_unlock(&pc->mu);
    kvt__free(lease);
    kvt__pc_gone_process(pc, gone);
}
