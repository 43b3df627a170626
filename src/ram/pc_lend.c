/*
 * pc_lend.c: the prompt cache's take (DESIGN.md 3.2-3.4, 3.10, 3.13): lend
 * (a session hit, else the radix walk, then the cold tier when it may hold a
 * strictly longer prefix, asked without the lock), lend_exact, peek and
 * find_exact. A lend leaves the donor in place and hands out views trimmed
 * to the usable prefix; a cold restore may be promoted into RAM.
 * Never calls the cold tier under the lock (prompt_cache.c states the rule).
 */
#include "prompt_cache_internal.h"

/* ---- lending ---------------------------------------------------------------------- */

/* Fills out with views of e at p tokens (under the lock: clones only; the
 * views are trimmed by lend_finish off-lock). */
int kvt__pc_lend_locked(kvt_prompt_cache *pc, pc_entry *e, int64_t p, kvt_hit *out)
{
    int rc = kvt__pc_clone_parts(&out->entry, e->ns, e->tokens, p, e->caches, e->n_caches, e->atts, e->n_atts);
    if (rc)
        return rc;
    out->entry.hook = kvt__pc_share_acquire(e->share);
    out->prefix_len = p;
    out->entry_id = e->id;
    e->last_used_ms = kvt_now_ms();
    pc->rops->on_access(pc->ret, e->id, p);
    if (pc->blocks) {
        int64_t B = kvt__pc_blocks_block_tokens(pc->blocks);
        kvt__pc_blocks_touch(pc->blocks, e->bkeys, (p + B - 1) / B, e->n_bkeys, e->n_tokens);
    }
    return 0;
}

static int lend_finish(kvt_hit *out)
{
    for (int32_t i = 0; i < out->entry.n_caches; i++) {
        if (kvt_cache_offset(out->entry.caches[i]) == out->prefix_len)
            continue;
        int rc = kvt_cache_trim(out->entry.caches[i], out->prefix_len);
        if (rc) {
            kvt_hit_clear(out);
            return rc;
        }
    }
    return 0;
}

/* A miss with new_caches: lends n_layers fresh caches (ns set, no tokens). */
static int lend_fresh(kvt_prompt_cache *pc, const char *ns, kvt_hit *out)
{
    if (!pc->new_caches)
        return 0;
    int rc = kvt_entry_init(&out->entry, ns, NULL, 0, pc->n_layers, 0);
    if (rc)
        return rc;
    rc = pc->new_caches(pc->new_caches_ctx, out->entry.caches);
    if (rc) {
        kvt_hit_clear(out);
        return kvt__fail(rc, "prompt cache: new_caches failed on a miss: %s", kvt_strerror(rc));
    }
    return 0;
}

KVT_API void kvt_hit_clear(kvt_hit *hit)
{
    if (!hit)
        return;
    kvt_entry_clear(&hit->entry);
    memset(hit, 0, sizeof *hit);
}

/* ---- lend, peek, find_exact ------------------------------------------------------- */

int kvt__pc_check_prompt(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns, const void *out,
                         const char *fn)
{
    if (!pc || !out)
        return kvt__fail(KVT_EINVAL, "%s: cache or out is NULL", fn);
    if (n < 0 || (!prompt && n > 0))
        return kvt__fail(KVT_EINVAL, "%s: prompt NULL or negative length %lld", fn, (long long)n);
    return 0;
}

/* Validates and trims a restored entry to p tokens of the prompt.
 * @return 1 usable, 0 not. */
static int restored_usable(kvt_entry *r, const int32_t *prompt, int64_t p)
{
    if (r->n_tokens < p || !kvt__pc_tokens_equal(r->tokens, prompt, p))
        return 0;
    for (int32_t i = 0; i < r->n_caches; i++)
        if (!r->caches[i] || kvt_cache_offset(r->caches[i]) != r->n_tokens)
            return 0;
    int64_t reach;
    int trimmable = kvt_entry_trimmable(r, &reach);
    if (r->n_tokens > p && (!trimmable || p < reach)) {
        /* below reach only at a multiple of the entry's block granule (whole
         * sealed qkvc blocks dropped) */
        int64_t g = trimmable ? kvt_entry_trim_granule(r) : 0;
        if (g <= 0 || p % g != 0)
            return 0; /* untrimmable divergent tail (3.4) */
    }
    for (int32_t i = 0; i < r->n_caches; i++)
        if (kvt_cache_offset(r->caches[i]) > p && kvt_cache_trim(r->caches[i], p) != 0)
            return 0;
    r->n_tokens = p;
    return 1;
}

/* Promotes a restored prefix into RAM: zero-copy clones put as an entry
 * sharing the hook of the served views (3.4). Best effort. */
static void promote(kvt_prompt_cache *pc, kvt_entry *r, const char *session, uint64_t epoch)
{
    kvt_entry copy;
    if (kvt__pc_clone_parts(&copy, r->ns, r->tokens, r->n_tokens, r->caches, r->n_caches, r->attachments,
                            r->n_attachments) != 0)
        return;
    /* one hook, two holders: the served views and the promoted entry */
    pc_share *s = kvt__pc_share_new(r->hook);
    if (!s) {
        kvt_entry_clear(&copy);
        return;
    }
    r->hook = (kvt_hook){kvt__pc_share_run, s};
    copy.hook = kvt__pc_share_acquire(s);
    if (kvt__pc_put_common(pc, &copy, session, 0, NULL, epoch, 0) == 0) {
        pthread_mutex_lock(&pc->mu);
        pc->st.promotions++;
        pthread_mutex_unlock(&pc->mu);
    }
    kvt_entry_clear(&copy); /* what put did not adopt */
}

/* The RAM candidate of a lend found again after the lock was dropped
 * (under the lock): the session's entry while it still serves, else a walk.
 * A walk is counted when the session entry that served before has left. */
static int64_t ram_refind(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns,
                          const char *session, pc_entry **se, void **val)
{
    if (*se && !(*se = kvt__pc_session_entry(pc, prompt, n, ns, session)))
        pc->st.prefix_walks++; /* the session's entry left meanwhile */
    if (*se) {
        *val = *se;
        return (*se)->n_tokens;
    }
    return kvt__index_lookup(pc->ix, ns, prompt, n, val);
}

/* Restores the cold tier's hit *ch, strictly longer than the RAM candidate,
 * into out (called and returning WITHOUT the lock); promotes it when the
 * flags say so, `epoch` being the cache's epoch when the lend began.
 * @return 1 served (out filled); 0 not (out untouched): the failure or the
 * untrimmable tail is counted and the RAM candidate serves (3.4). */
static int lend_cold(kvt_prompt_cache *pc, const int32_t *prompt, const char *session, const kvt_cold_hit *ch,
                     uint64_t epoch, kvt_hit *out)
{
    kvt_entry r;
    memset(&r, 0, sizeof r);
    int rrc = pc->cold.restore(pc->cold.self, ch->handle, &r);
    int usable = rrc == 0 && restored_usable(&r, prompt, ch->prefix_len);
    if (usable) {
        if (pc->flags & KVT_PC_PROMOTE_RESTORES)
            promote(pc, &r, session, epoch);
        out->entry = r;
        out->prefix_len = ch->prefix_len;
        out->source = KVT_HIT_COLD;
    } else {
        kvt_entry_clear(&r);
    }
    pthread_mutex_lock(&pc->mu);
    if (usable)
        pc->st.cold_restores++;
    else if (rrc)
        pc->st.cold_failures++;
    else
        pc->st.cold_unusable++;
    pthread_mutex_unlock(&pc->mu);
    return usable;
}

KVT_API int kvt_prompt_cache_lend(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns,
                                  const char *session, kvt_hit *out)
{
    if (out) /* cleared before any check: a kvt_hit_clear after an error frees nothing */
        memset(out, 0, sizeof *out);
    ns = kvt__ns(ns);
    int rc = kvt__pc_check_prompt(pc, prompt, n, ns, out, "kvt_prompt_cache_lend");
    if (rc)
        return rc;
    pthread_mutex_lock(&pc->mu);
    if (pc->blocks)
        kvt__pc_blocks_clock(pc->blocks, n); /* one use time per request */
    /* a session hit skips the walk (3.10), never the cold tier (3.4) */
    void *val = NULL;
    pc_entry *se = kvt__pc_session_entry(pc, prompt, n, ns, session);
    int64_t p = se ? se->n_tokens : 0;
    if (se) {
        val = se;
        pc->st.hits++;
        pc->st.session_hits++;
    } else {
        if (session)
            pc->st.session_misses++;
        pc->st.prefix_walks++;
        p = kvt__index_lookup(pc->ix, ns, prompt, n, &val);
        if (p > 0)
            pc->st.hits++;
        else
            pc->st.misses++;
    }
    if (pc->has_cold && p < n - 1) {
        /* the cold tier may hold a strictly longer prefix: asked without
         * the lock (a lookup may block on I/O), then the RAM candidate is
         * checked again (gen) before it is lent */
        uint64_t gen = pc->gen, epoch = pc->epoch;
        pthread_mutex_unlock(&pc->mu);
        kvt_cold_hit ch;
        int found = pc->cold.find(pc->cold.self, prompt, n, ns, &ch) == 0 && ch.prefix_len <= n - 1;
        if (found && ch.prefix_len > p) {
            if (lend_cold(pc, prompt, session, &ch, epoch, out))
                return 0;
            pthread_mutex_lock(&pc->mu);
            p = ram_refind(pc, prompt, n, ns, session, &se, &val); /* the RAM candidate as it is now */
        } else {
            pthread_mutex_lock(&pc->mu);
            if (pc->gen != gen) {
                /* an entry left or was cut meanwhile: the candidate may be gone */
                pc->st.relookups++;
                p = ram_refind(pc, prompt, n, ns, session, &se, &val);
                if (found && ch.prefix_len > p) {
                    /* the RAM candidate is now shorter than the cold prefix */
                    epoch = pc->epoch;
                    pthread_mutex_unlock(&pc->mu);
                    if (lend_cold(pc, prompt, session, &ch, epoch, out))
                        return 0;
                    pthread_mutex_lock(&pc->mu);
                    p = ram_refind(pc, prompt, n, ns, session, &se, &val);
                }
            }
        }
    }
    if (p > 0) {
        pc_entry *e = val;
        rc = kvt__pc_lend_locked(pc, e, p, out);
        if (rc == 0 && se) {
            out->source = KVT_HIT_SESSION;
        } else if (rc == 0) {
            out->source = KVT_HIT_RAM;
            kvt__pc_session_associate(pc, session, ns, e);
        }
    }
    pthread_mutex_unlock(&pc->mu);
    if (rc)
        return rc;
    return p > 0 ? lend_finish(out) : lend_fresh(pc, ns, out);
}

KVT_API int64_t kvt_prompt_cache_peek(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns,
                                      uint64_t *out_id)
{
    ns = kvt__ns(ns);
    if (out_id)
        *out_id = 0;
    if (!pc || !ns || n < 0 || (!prompt && n > 0))
        return 0;
    void *val = NULL;
    pthread_mutex_lock(&pc->mu);
    int64_t p = kvt__index_lookup(pc->ix, ns, prompt, n, &val);
    if (p > 0 && out_id)
        *out_id = ((pc_entry *)val)->id;
    pthread_mutex_unlock(&pc->mu);
    return p;
}

KVT_API int kvt_prompt_cache_find_exact(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n, const char *ns,
                                        uint64_t *out_id)
{
    ns = kvt__ns(ns);
    if (out_id)
        *out_id = 0;
    if (!pc || !ns || n < 0 || (!tokens && n > 0))
        return 0;
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__index_exact(pc->ix, ns, tokens, n);
    if (e && out_id)
        *out_id = e->id;
    pthread_mutex_unlock(&pc->mu);
    return e != NULL;
}

KVT_API int kvt_prompt_cache_lend_exact(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n, const char *ns,
                                       kvt_hit *out)
{
    if (out) /* cleared before any check, as kvt_prompt_cache_lend */
        memset(out, 0, sizeof *out);
    ns = kvt__ns(ns);
    int rc = kvt__pc_check_prompt(pc, tokens, n, ns, out, "kvt_prompt_cache_lend_exact");
    if (rc)
        return rc;
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__index_exact(pc->ix, ns, tokens, n);
    if (!e) {
        pthread_mutex_unlock(&pc->mu);
        return kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_lend_exact: no entry of %lld tokens in ns '%s'",
                         (long long)n, ns);
    }
    rc = kvt__pc_lend_locked(pc, e, n, out);
    if (rc == 0)
        out->source = KVT_HIT_RAM;
    pthread_mutex_unlock(&pc->mu);
    return rc;
}
