/*
 * pc_put.c: the prompt cache's put (DESIGN.md 3.5): an entry is built and
 * measured off-lock, linked under the lock (an equal-token entry is
 * replaced, sessions and pins following; a trimmable entry supersedes its
 * strict prefix ancestors; an entry over the whole budget is spilled and
 * dropped), written behind to the cold tier after the lock is dropped, then
 * the budget is enforced. Also trim in place, which re-indexes an entry.
 */
#include "prompt_cache_internal.h"

/* ---- insert --------------------------------------------------------------------- */

/* Builds an entry from e: copies ns and tokens and the pointer arrays (the
 * elements are not yet adopted). */
static int entry_build(const kvt_entry *e, pc_entry **out)
{
    if (!e)
        return kvt__fail(KVT_EINVAL, "prompt cache put: entry is NULL");
    if (e->n_tokens < 0 || e->n_caches < 0 || e->n_attachments < 0)
        return kvt__fail(KVT_EINVAL, "prompt cache put: negative count (tokens %lld, caches %d, attachments %d)",
                         (long long)e->n_tokens, (int)e->n_caches, (int)e->n_attachments);
    if (!e->tokens && e->n_tokens > 0)
        return kvt__fail(KVT_EINVAL, "prompt cache put: tokens NULL with %lld tokens", (long long)e->n_tokens);
    if ((e->n_caches && !e->caches) || (e->n_attachments && !e->attachments))
        return kvt__fail(KVT_EINVAL, "prompt cache put: caches or attachments array is NULL");
    for (int32_t i = 0; i < e->n_caches; i++) {
        if (!e->caches[i])
            return kvt__fail(KVT_EINVAL, "prompt cache put: cache %d is NULL", (int)i);
        int64_t off = kvt_cache_offset(e->caches[i]);
        if (off != e->n_tokens)
            return kvt__fail(KVT_EINVAL, "prompt cache put: cache %d holds %lld tokens, the entry has %lld",
                             (int)i, (long long)off, (long long)e->n_tokens);
    }
    for (int32_t i = 0; i < e->n_attachments; i++)
        if (!e->attachments[i])
            return kvt__fail(KVT_EINVAL, "prompt cache put: attachment %d is NULL", (int)i);
    pc_entry *x = kvt__pc_entry_shell(kvt__ns(e->ns), e->tokens, e->n_tokens, e->n_caches, e->n_attachments);
    if (!x)
        return kvt__fail(KVT_ENOMEM, "prompt cache put: out of memory for %lld tokens", (long long)e->n_tokens);
    for (int32_t i = 0; i < e->n_caches; i++)
        x->caches[i] = e->caches[i];
    for (int32_t i = 0; i < e->n_attachments; i++)
        x->atts[i] = e->attachments[i];
    *out = x;
    return 0;
}

typedef struct super_ctx {
    pc_entry **v; /* (n) strict prefix ancestors to supersede */
    size_t n, cap;
    int64_t reach, granule; /* the new entry's (granule 0: none) */
} super_ctx;

/* Whether the new entry serves every length ancestor e (depth tokens, a
 * strict prefix of it) serves: e's lengths inside the new entry's reach, or
 * e reaching only its own end (nothing open) at a multiple of the new
 * entry's granule, its own granule a multiple of it, so every length e can
 * be cut to is a block boundary the new entry can be cut to as well. */
static int covered(const pc_entry *e, int64_t depth, const super_ctx *s)
{
    if (depth >= s->reach)
        return 1;
    return s->granule > 0 && e->trimmable && e->reach == depth && depth % s->granule == 0 &&
           e->granule % s->granule == 0 && e->granule > 0;
}

static void collect_ancestor(void *val, int64_t depth, void *ctx)
{
    super_ctx *s = ctx;
    pc_entry *e = val;
    if (!covered(e, depth, s) || e->pins > 0)
        return;
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        pc_entry **v = kvt__realloc(s->v, cap * sizeof *v);
        if (!v)
            return; /* best effort: an ancestor left in place still serves */
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = e;
}

/* Links a built, measured entry into the cache (under the lock) and applies
 * put's rules except the budget: the caller runs kvt__pc_evict() next, once it no
 * longer needs x (evict may drop the lock, and x may leave meanwhile). On
 * error nothing is linked and x is untouched. `pins` pins the new entry at
 * once (prefetch publication). `wb` (NULL: none) is 1 when the caller holds
 * write-behind views of x; insert sets it to 0 when the tier does not need
 * them because x is spilled as oversize, to 2 when the tier already holds or
 * has pending its tokens (`tier_have`, asked by the caller before taking the
 * lock, or an entry of equal tokens being written behind), else leaves it 1
 * and marks x PC_WB_QUEUING. */
int kvt__pc_insert_locked(kvt_prompt_cache *pc, pc_entry *x, size_t standalone, const char *session,
                          int64_t pins, pc_entry **gone, int *wb, int tier_have)
{
    if (standalone > pc->max_bytes && pins == 0) {
        if (wb)
            *wb = 0; /* the oversize spill below writes it */
        /* larger than the whole budget: spilled and dropped (3.5) */
        x->id = ++pc->next_id;
        x->spill = pc->has_cold && pc->cold.spill;
        x->gone = *gone;
        *gone = x;
        pc->st.oversize_drops++;
        return 0;
    }
    x->id = ++pc->next_id;
    x->last_used_ms = kvt_now_ms();
    int rc = kvt__umap_put(&pc->by_id, x->id, (uint64_t)(uintptr_t)x);
    if (rc)
        return kvt__fail(KVT_ENOMEM, "prompt cache put: out of memory");
    rc = pc->rops->on_insert(pc->ret, x->id, standalone, x->n_tokens);
    if (rc) {
        kvt__umap_del(&pc->by_id, x->id);
        return rc;
    }
    rc = kvt__pc_account_add(pc, x);
    if (rc) {
        pc->rops->on_remove(pc->ret, x->id);
        kvt__umap_del(&pc->by_id, x->id);
        return rc;
    }
    void *replaced = NULL;
    rc = kvt__index_insert_g(pc->ix, x->ns, x->tokens, x->n_tokens, x, x->trimmable, x->reach, x->granule, &replaced);
    if (rc) {
        kvt__pc_account_remove(pc, x);
        pc->rops->on_remove(pc->ret, x->id);
        kvt__umap_del(&pc->by_id, x->id);
        return rc;
    }
    x->next = pc->head;
    if (pc->head)
        pc->head->prev = x;
    pc->head = x;
    pc->st.entries++;
    if (pins > 0) {
        x->pins = pins;
        pc->pinned++;
    }
    if (pc->blocks && x->bkeys && kvt__pc_blocks_add(pc->blocks, x, x->bkeys, x->n_bkeys, x->n_tokens) != 0) {
        kvt__free(x->bkeys); /* untracked: entry-level eviction still covers it */
        x->bkeys = NULL;
        x->n_bkeys = 0;
    }
    if (wb && *wb) {
        /* the tier already holds these tokens (a prefix published again, or
         * an equal-token replacement of an entry written behind): the same
         * state, so nothing is queued again */
        pc_entry *old = replaced;
        int have = tier_have ||
                   (old && (old->wb == PC_WB_QUEUING || (!pc->cold.pending && old->wb == PC_WB_SENT)));
        if (have) {
            *wb = 2;
            x->wb = PC_WB_SENT; /* no spill of x's own will report back */
            pc->st.write_behind_skipped++;
        } else {
            x->wb = PC_WB_QUEUING;
        }
    }
    if (replaced) {
        /* equal tokens: the new entry replaces the old (sessions follow) */
        pc_entry *old = replaced;
        kvt__pc_entry_follow(pc, old, x);
        kvt__pc_entry_unlink(pc, old, 0, gone);
        pc->st.replacements++;
    }
    if (x->trimmable && x->n_tokens > 0) {
        /* supersede strict prefix ancestors it can be trimmed back to (at
         * every length they serve: covered()); the
         * queued writes of those that were written behind are withdrawn once
         * x's own is queued (kvt__pc_gone_process_wb) */
        super_ctx s = {NULL, 0, 0, x->reach, x->granule};
        kvt__index_prefixes(pc->ix, x->ns, x->tokens, x->n_tokens, collect_ancestor, &s);
        for (size_t i = 0; i < s.n; i++) {
            s.v[i]->withdraw = s.v[i]->wb != PC_WB_NONE && kvt__pc_write_behind_on(pc);
            kvt__pc_entry_unlink(pc, s.v[i], 0, gone);
            pc->st.supersedes++;
        }
        kvt__free(s.v);
    }
    kvt__pc_session_associate(pc, session, x->ns, x);
    return 0;
}

/* ---- put -------------------------------------------------------------------------- */

/* Takes e's parts on success: NULLs the slots and empties the hook. */
void kvt__pc_adopt_parts(kvt_entry *e)
{
    for (int32_t i = 0; i < e->n_caches; i++)
        e->caches[i] = NULL;
    for (int32_t i = 0; i < e->n_attachments; i++)
        e->attachments[i] = NULL;
    e->hook = (kvt_hook){NULL, NULL};
}

/* Everything an entry needs before it is linked, done off-lock for put and
 * for prefetch reads alike: built from e (parts not yet adopted), measured,
 * block keys when block eviction tracks it, a share of e's hook. On error
 * nothing is left allocated and e is untouched. */
int kvt__pc_entry_prepare(kvt_prompt_cache *pc, const kvt_entry *e, pc_entry **out, size_t *standalone)
{
    pc_entry *x = NULL;
    int rc = entry_build(e, &x);
    if (rc)
        return rc;
    rc = kvt__pc_entry_measure(x, standalone);
    if (rc == 0 && pc->blocks && x->trimmable)
        rc = kvt__pc_blocks_keys(pc->blocks, x->ns, x->tokens, x->n_tokens, &x->bkeys, &x->n_bkeys);
    if (rc == 0 && e->hook.fn && !(x->share = kvt__pc_share_new(e->hook)))
        rc = kvt__fail(KVT_ENOMEM, "prompt cache put: out of memory");
    if (rc) {
        kvt__pc_entry_discard(x);
        return rc;
    }
    *out = x;
    return 0;
}

/* Hands the write-behind views of the entry `id` (just put) to the tier's
 * spill, off-lock, then records the outcome on the entry if it is still
 * resident. @return 1 when the tier took them. */
static int write_behind(kvt_prompt_cache *pc, uint64_t id, kvt_entry *views)
{
    int taken = pc->cold.spill(pc->cold.self, views) == 0;
    if (taken) {
        atomic_fetch_add(&pc->wb_queued, 1);
    } else {
        atomic_fetch_add(&pc->wb_dropped, 1); /* spilled when it leaves RAM instead */
        kvt_entry_clear(views);
    }
    pthread_mutex_lock(&pc->mu);
    pc_entry *x = kvt__pc_by_id(pc, id);
    if (x && x->wb == PC_WB_QUEUING)
        x->wb = taken ? PC_WB_SENT : PC_WB_NONE;
    pthread_mutex_unlock(&pc->mu);
    return taken;
}

/* put's body. `wb`: the entry is new state (a put, not a restore being
 * published), so it is written behind when write-behind is on. */
int kvt__pc_put_common(kvt_prompt_cache *pc, kvt_entry *e, const char *session, int64_t pins,
                       uint64_t *id_out, uint64_t epoch_check, int wb)
{
    pc_entry *x = NULL;
    size_t standalone = 0;
    int rc = kvt__pc_entry_prepare(pc, e, &x, &standalone);
    if (rc)
        return rc;
    /* zero-copy views for the tier, made before the lock (the caller's
     * caches are not shared with anyone yet) */
    kvt_entry views;
    memset(&views, 0, sizeof views);
    wb = wb && kvt__pc_write_behind_on(pc);
    if (wb && kvt__pc_clone_parts(&views, x->ns, x->tokens, x->n_tokens, x->caches, x->n_caches, x->atts, x->n_atts)) {
        wb = 0;
        atomic_fetch_add(&pc->wb_dropped, 1); /* out of memory: spilled on leaving RAM */
    }
    int tier_have = 0;
    if (wb) {
        views.hook = kvt__pc_share_acquire(x->share);
        /* asked before the lock: the tier may block on I/O */
        tier_have = kvt__pc_tier_has(pc, x->ns, x->tokens, x->n_tokens) ||
                    kvt__pc_tier_pending(pc, x->ns, x->tokens, x->n_tokens);
    }
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    if (epoch_check != UINT64_MAX && epoch_check != pc->epoch) {
        pthread_mutex_unlock(&pc->mu);
        kvt_entry_clear(&views);
        kvt__pc_entry_discard(x);
        return kvt__fail(KVT_ESTALE, "prompt cache: cleared while the entry was read");
    }
    rc = kvt__pc_insert_locked(pc, x, standalone, session, pins, &gone, &wb, tier_have);
    uint64_t id = rc == 0 ? x->id : 0;
    if (rc == 0 && id_out)
        *id_out = id;
    if (rc == 0)
        kvt__pc_evict(pc, -1, &gone); /* x may leave from here on */
    pthread_mutex_unlock(&pc->mu);
    if (rc) {
        kvt_entry_clear(&views);
        kvt__pc_entry_discard(x);
        return rc;
    }
    kvt__pc_adopt_parts(e);
    int queued = 0;
    if (wb == 1)
        queued = write_behind(pc, id, &views);
    else
        kvt_entry_clear(&views); /* not needed: the tier has (or gets) this state */
    kvt__pc_gone_process_wb(pc, gone, queued || wb == 2);
    return 0;
}

KVT_API int kvt_prompt_cache_put(kvt_prompt_cache *pc, kvt_entry *e, const char *session)
{
    if (!pc)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_put: cache is NULL");
    return kvt__pc_put_common(pc, e, session, 0, NULL, UINT64_MAX, 1);
}

KVT_API int kvt_prompt_cache_put_hit(kvt_prompt_cache *pc, kvt_hit *hit, const int32_t *tokens,
                                     int64_t n_tokens, const char *session)
{
    if (!pc || !hit || (!tokens && n_tokens > 0))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_put_hit: cache, hit or tokens is NULL");
    if (hit->entry.n_caches < 1)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_put_hit: the hit lends no caches (a miss, and the "
                         "cache has no new_caches)");
    if (n_tokens < hit->prefix_len || !kvt__pc_tokens_equal(tokens, hit->entry.tokens, hit->prefix_len))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_put_hit: the %lld tokens do not begin with the "
                         "%lld-token prefix the hit lent", (long long)n_tokens, (long long)hit->prefix_len);
    kvt_entry e = hit->entry; /* the same arrays: put NULLs the hit's slots */
    e.tokens = tokens;
    e.n_tokens = n_tokens;
    int rc = kvt_prompt_cache_put(pc, &e, session);
    if (rc)
        return rc; /* nothing adopted: the hit is unchanged */
    hit->entry.hook = (kvt_hook){NULL, NULL}; /* the share moved with the entry */
    kvt_hit_clear(hit);
    return 0;
}

/* ---- trim in place ---------------------------------------------------------------- */

/* Block keys of an entry cut back in place: a cut at a block boundary keeps
 * the first keys; any other cut re-keys the entry (its last block changed). */
static void blocks_after_trim(kvt_prompt_cache *pc, pc_entry *e)
{
    if (!pc->blocks || !e->bkeys)
        return;
    int64_t B = kvt__pc_blocks_block_tokens(pc->blocks);
    if (e->n_tokens % B == 0 && e->n_tokens / B <= e->n_bkeys) {
        kvt__pc_blocks_drop(pc->blocks, e, e->bkeys, e->n_tokens / B, e->n_bkeys);
        e->n_bkeys = e->n_tokens / B;
        return;
    }
    kvt__pc_blocks_drop(pc->blocks, e, e->bkeys, 0, e->n_bkeys);
    kvt__free(e->bkeys);
    e->bkeys = NULL;
    e->n_bkeys = 0;
    uint64_t *keys;
    int64_t nk;
    if (kvt__pc_blocks_keys(pc->blocks, e->ns, e->tokens, e->n_tokens, &keys, &nk) != 0)
        return; /* untracked from now on: entry-level eviction still covers it */
    if (kvt__pc_blocks_add(pc->blocks, e, keys, nk, e->n_tokens) != 0) {
        kvt__free(keys);
        return;
    }
    e->bkeys = keys;
    e->n_bkeys = nk;
}

/* Cuts resident entry e back to new_len tokens in place (checked by the
 * caller: inside every layer's range, no attachments) and re-indexes it; an
 * entry of the shorter tokens is replaced by it. On failure e is unlinked
 * (its layers may disagree) and the error returned. */
int kvt__pc_trim_locked(kvt_prompt_cache *pc, pc_entry *e, int64_t new_len, pc_entry **gone)
{
    int rc = 0;
    pc->gen++;
    kvt__index_remove(pc->ix, e->ns, e->tokens, e->n_tokens);
    kvt__pc_account_remove(pc, e);
    for (int32_t i = 0; i < e->n_caches && rc == 0; i++)
        rc = kvt_cache_trim(e->caches[i], new_len);
    e->n_tokens = new_len;
    size_t standalone;
    int accounted = 0;
    if (rc == 0)
        rc = kvt__pc_entry_measure(e, &standalone);
    if (rc == 0)
        accounted = (rc = kvt__pc_account_add(pc, e)) == 0;
    void *replaced = NULL;
    if (rc == 0)
        rc = kvt__index_insert_g(pc->ix, e->ns, e->tokens, e->n_tokens, e, e->trimmable, e->reach, e->granule,
                                 &replaced);
    if (rc) {
        /* layers may disagree now: the entry cannot stay. Unless its budget
         * share was added back, it is already removed: unlink without
         * removing it twice */
        if (!accounted) {
            e->n_bufs = 0;
            e->private_bytes = 0;
        }
        kvt__pc_entry_unlink(pc, e, 0, gone);
        return rc;
    }
    blocks_after_trim(pc, e);
    if (replaced && replaced != e) {
        kvt__pc_entry_follow(pc, replaced, e);
        kvt__pc_entry_unlink(pc, replaced, 0, gone);
        pc->st.replacements++;
    }
    return 0;
}

KVT_API int kvt_prompt_cache_trim(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n, const char *ns,
                                  int64_t new_len)
{
    ns = kvt__ns(ns);
    if (!pc || !ns || n < 0 || (!tokens && n > 0))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_trim: bad arguments");
    pc_entry *gone = NULL;
    int rc = 0;
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__index_exact(pc->ix, ns, tokens, n);
    if (!e) {
        rc = kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_trim: no entry of %lld tokens in ns '%s'", (long long)n, ns);
        goto out;
    }
    if (new_len == n)
        goto out;
    if (new_len < 1 || new_len > n || e->n_atts > 0) {
        rc = kvt__fail(KVT_ERANGE, "kvt_prompt_cache_trim: cannot cut %lld tokens to %lld%s", (long long)n,
                       (long long)new_len, e->n_atts ? " (the entry has attachments)" : "");
        goto out;
    }
    for (int32_t i = 0; i < e->n_caches; i++)
        if (!kvt_cache_can_trim(e->caches[i], new_len)) {
            rc = kvt__fail(KVT_ERANGE, "kvt_prompt_cache_trim: layer %d cannot reach %lld tokens", (int)i,
                           (long long)new_len);
            goto out;
        }
    rc = kvt__pc_trim_locked(pc, e, new_len, &gone);
out:
    pthread_mutex_unlock(&pc->mu);
    kvt__pc_gone_process(pc, gone);
    return rc;
}
