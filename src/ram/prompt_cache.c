/*
 * prompt_cache.c: the RAM tier (DESIGN.md section 3): resident entries, the
 * byte budget with shared buffers counted once, the radix index per
 * namespace, retention, sessions, pins, prefetch reads and objects, tiered
 * over an optional cold tier. This file holds the cache's lifetime (create,
 * close, destroy, clear, stats) and its entries (hook shares, shells,
 * measuring, the budget's accounting, unlinking, the "gone" list); take,
 * put, eviction, sessions with prefetch, and objects have their own files
 * (prompt_cache_internal.h lists them).
 *
 * Owns its entries (their caches, attachments and hook shares), the index,
 * the retention instance and the session table. One mutex guards all of it.
 * It never calls the cold tier under that lock: lookups (find, find_exact,
 * pending) may block on I/O, so the lock is dropped around each one and what
 * was found in RAM is checked again after it (pc->gen for lend's candidate,
 * entry ids plus length and write-behind state for victims, the epoch for a
 * publication); restore, spill, withdraw and store run outside it as well.
 * It must never dispose caches or run
 * release hooks under the lock except in relieve and reclaim, whose pressure
 * check must see the memory freed. Entries that leave are collected on a
 * local list ("gone") and spilled / disposed after the lock is dropped.
 *
 * Write-behind: put clones the new entry's views before taking the lock,
 * decides under the lock whether the tier still needs them (wb state, in
 * prompt_cache_internal.h), and hands them to the tier's spill after dropping
 * it. An entry leaving RAM is spilled only when the tier neither holds it,
 * nor has it pending, nor is about to receive it from a put in progress (see
 * leaving() in pc_evict.c).
 */
#include "prompt_cache_internal.h"

#include <time.h>

/* ---- refcounted release hook ------------------------------------------------ */

void kvt__pc_share_run(void *ctx)
{
    pc_share *s = ctx;
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        kvt_hook_run(&s->hook);
        kvt__free(s);
    }
}

/* A share holding hook with one reference, or NULL when out of memory. */
pc_share *kvt__pc_share_new(kvt_hook hook)
{
    pc_share *s = kvt__malloc(sizeof *s);
    if (s) {
        atomic_init(&s->refs, 1);
        s->hook = hook;
    }
    return s;
}

/* Fills out (kvt_entry_init) with ns, tokens[0..n) and zero-copy clones of
 * caches and attachments; no hook. On error out is left cleared. */
int kvt__pc_clone_parts(kvt_entry *out, const char *ns, const int32_t *tokens, int64_t n, kvt_cache *const *caches,
                        int32_t n_caches, kvt_attachment *const *atts, int32_t n_atts)
{
    int rc = kvt_entry_init(out, ns, tokens, n, n_caches, n_atts);
    if (rc)
        return rc;
    rc = n_caches ? kvt_caches_clone(caches, n_caches, out->caches) : 0;
    for (int32_t i = 0; rc == 0 && i < n_atts; i++)
        rc = kvt_attachment_clone(atts[i], &out->attachments[i]);
    if (rc)
        kvt_entry_clear(out);
    return rc;
}

/* ---- entries ----------------------------------------------------------------- */

/* Frees an entry shell whose parts were never adopted (or were moved out). */
void kvt__pc_entry_free_shell(pc_entry *e)
{
    if (!e)
        return;
    kvt__free(e->ns);
    kvt__free(e->tokens);
    kvt__free(e->caches);
    kvt__free(e->atts);
    kvt__free(e->bufs);
    kvt__free(e->bkeys);
    kvt__free(e);
}

/* A new entry shell: copies of ns and tokens[0..n_tokens), zeroed arrays
 * for n_caches caches and n_atts attachments (not filled); counts set.
 * NULL when out of memory. */
pc_entry *kvt__pc_entry_shell(const char *ns, const int32_t *tokens, int64_t n_tokens, int32_t n_caches,
                              int32_t n_atts)
{
    pc_entry *x = kvt__calloc(1, sizeof *x);
    if (!x)
        return NULL;
    x->ns = kvt__strdup(ns);
    x->tokens = kvt__malloc((size_t)(n_tokens ? n_tokens : 1) * sizeof(int32_t));
    x->caches = kvt__calloc((size_t)(n_caches ? n_caches : 1), sizeof *x->caches);
    x->atts = kvt__calloc((size_t)(n_atts ? n_atts : 1), sizeof *x->atts);
    if (!x->ns || !x->tokens || !x->caches || !x->atts) {
        kvt__pc_entry_free_shell(x);
        return NULL;
    }
    if (n_tokens)
        memcpy(x->tokens, tokens, (size_t)n_tokens * sizeof(int32_t));
    x->n_tokens = n_tokens;
    x->n_caches = n_caches;
    x->n_atts = n_atts;
    return x;
}

/* Frees a built entry that was never linked (or failed to link): its share,
 * never run (the hook stays with the caller), and its shell. */
void kvt__pc_entry_discard(pc_entry *x)
{
    if (!x)
        return;
    kvt__free(x->share);
    x->share = NULL;
    kvt__pc_entry_free_shell(x);
}

/* Disposes an entry and its parts: caches, attachments, then its hook share. */
void kvt__pc_entry_dispose(pc_entry *e)
{
    for (int32_t i = 0; i < e->n_caches; i++)
        kvt_cache_destroy(e->caches[i]);
    for (int32_t i = 0; i < e->n_atts; i++)
        kvt_attachment_destroy(e->atts[i]);
    if (e->share)
        kvt__pc_share_run(e->share);
    e->share = NULL;
    kvt__pc_entry_free_shell(e);
}

typedef struct buf_list {
    kvt_buf **v;
    size_t n, cap;
    int failed;
} buf_list;

static void collect_buf(kvt_buf *b, void *ctx)
{
    buf_list *l = ctx;
    if (l->failed)
        return;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        kvt_buf **v = kvt__realloc(l->v, cap * sizeof *v);
        if (!v) {
            l->failed = 1;
            return;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = b;
}

/* Measures an entry: trimmability, reach, private bytes and its buffers.
 * *standalone receives the bytes it holds alone (each buffer once). */
int kvt__pc_entry_measure(pc_entry *e, size_t *standalone)
{
    kvt_entry view = {e->ns, e->tokens, e->n_tokens, e->caches, e->n_caches, e->atts, e->n_atts, {0}};
    e->trimmable = kvt_entry_trimmable(&view, &e->reach);
    e->granule = kvt_entry_trim_granule(&view);
    size_t priv = 0;
    buf_list l = {0};
    for (int32_t i = 0; i < e->n_caches; i++) {
        priv += e->caches[i]->ops->private_bytes(e->caches[i]);
        e->caches[i]->ops->foreach_buf(e->caches[i], collect_buf, &l);
    }
    for (int32_t i = 0; i < e->n_atts; i++)
        priv += kvt_attachment_bytes(e->atts[i]);
    if (l.failed) {
        kvt__free(l.v);
        return kvt__fail(KVT_ENOMEM, "prompt cache: out of memory listing an entry's buffers");
    }
    kvt__free(e->bufs);
    e->bufs = l.v;
    e->n_bufs = l.n;
    e->private_bytes = priv;
    size_t alone = priv;
    kvt__umap seen = {0};
    for (size_t i = 0; i < l.n; i++) {
        if (kvt__umap_get(&seen, (uint64_t)(uintptr_t)l.v[i]))
            continue;
        if (kvt__umap_put(&seen, (uint64_t)(uintptr_t)l.v[i], 1) != 0) {
            kvt__umap_free(&seen);
            return kvt__fail(KVT_ENOMEM, "prompt cache: out of memory measuring an entry");
        }
        alone += kvt_buf_bytes(l.v[i]);
    }
    kvt__umap_free(&seen);
    *standalone = alone;
    return 0;
}

/* Budget accounting: a buffer counts once however many entries hold it. */
void kvt__pc_account_remove(kvt_prompt_cache *pc, pc_entry *e)
{
    for (size_t i = 0; i < e->n_bufs; i++) {
        uint64_t key = (uint64_t)(uintptr_t)e->bufs[i];
        uint64_t *c = kvt__umap_get(&pc->buf_refs, key);
        if (!c)
            continue;
        if (--*c == 0) {
            kvt__umap_del(&pc->buf_refs, key);
            pc->buf_bytes -= kvt_buf_bytes(e->bufs[i]);
        }
    }
    pc->private_bytes -= e->private_bytes;
}

int kvt__pc_account_add(kvt_prompt_cache *pc, pc_entry *e)
{
    for (size_t i = 0; i < e->n_bufs; i++) {
        uint64_t key = (uint64_t)(uintptr_t)e->bufs[i];
        uint64_t *c = kvt__umap_get(&pc->buf_refs, key);
        if (c) {
            ++*c;
            continue;
        }
        if (kvt__umap_put(&pc->buf_refs, key, 1) != 0) {
            size_t added = i;
            e->n_bufs = added; /* undo exactly what was added */
            pc->private_bytes += e->private_bytes;
            kvt__pc_account_remove(pc, e);
            return kvt__fail(KVT_ENOMEM, "prompt cache: out of memory counting buffers");
        }
        pc->buf_bytes += kvt_buf_bytes(e->bufs[i]);
    }
    pc->private_bytes += e->private_bytes;
    return 0;
}

/* Unlinks a resident entry from every structure (index, id map, retention,
 * budget, list) and pushes it on *gone. Sessions pointing at it dangle (a
 * dangling id is simply not resident). */
void kvt__pc_entry_unlink(kvt_prompt_cache *pc, pc_entry *e, int spill, pc_entry **gone)
{
    void *at = kvt__index_exact(pc->ix, e->ns, e->tokens, e->n_tokens);
    if (at == e)
        kvt__index_remove(pc->ix, e->ns, e->tokens, e->n_tokens);
    kvt__umap_del(&pc->by_id, e->id);
    pc->rops->on_remove(pc->ret, e->id);
    if (pc->blocks)
        kvt__pc_blocks_drop(pc->blocks, e, e->bkeys, 0, e->n_bkeys);
    kvt__pc_account_remove(pc, e);
    if (e->prev)
        e->prev->next = e->next;
    else
        pc->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    e->prev = e->next = NULL;
    if (e->pins > 0)
        pc->pinned--;
    pc->gen++;
    e->spill = spill;
    e->gone = *gone;
    *gone = e;
    pc->st.entries--;
}

/* Builds the owned kvt_entry a spill hands to the tier, moving the parts of
 * a leaving entry (no copy: the entry is gone from the cache). */
static int entry_to_owned(pc_entry *e, kvt_entry *out)
{
    int rc = kvt_entry_init(out, e->ns, e->tokens, e->n_tokens, e->n_caches, e->n_atts);
    if (rc)
        return rc;
    for (int32_t i = 0; i < e->n_caches; i++) {
        out->caches[i] = e->caches[i];
        e->caches[i] = NULL;
    }
    for (int32_t i = 0; i < e->n_atts; i++) {
        out->attachments[i] = e->atts[i];
        e->atts[i] = NULL;
    }
    out->hook = (kvt_hook){e->share ? kvt__pc_share_run : NULL, e->share};
    e->share = NULL;
    return 0;
}

/* Processes leaving entries off-lock: spill (write-behind) then dispose.
 * Superseded entries marked `withdraw` have their queued write withdrawn
 * when `withdraw_ok` says the superseding entry's state is queued too. */
void kvt__pc_gone_process_wb(kvt_prompt_cache *pc, pc_entry *gone, int withdraw_ok)
{
    while (gone) {
        pc_entry *e = gone;
        gone = e->gone;
        if (e->withdraw && withdraw_ok && pc->has_cold && pc->cold.withdraw &&
            pc->cold.withdraw(pc->cold.self, e->tokens, e->n_tokens, e->ns) == 0)
            atomic_fetch_add(&pc->wb_withdrawn, 1);
        if (e->spill && pc->has_cold && pc->cold.spill) {
            kvt_entry owned;
            if (entry_to_owned(e, &owned) == 0) {
                if (pc->cold.spill(pc->cold.self, &owned) == 0) {
                    atomic_fetch_add(&pc->spills, 1);
                } else {
                    atomic_fetch_add(&pc->spill_failures, 1);
                    kvt_entry_clear(&owned); /* degrades to no spill (3.6) */
                }
            } else {
                atomic_fetch_add(&pc->spill_failures, 1);
            }
        }
        kvt__pc_entry_dispose(e);
    }
}

void kvt__pc_gone_process(kvt_prompt_cache *pc, pc_entry *gone) { kvt__pc_gone_process_wb(pc, gone, 0); }

/* ---- asking the cold tier (always WITHOUT the lock) ------------------------------ */

/* These three may block on I/O (a remote tier's lookup): they are called
 * only with pc->mu NOT held, on borrowed copies of an entry's ns and tokens.
 * They read only what create set (cold, flags). */

int kvt__pc_tier_pending(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n)
{
    return pc->has_cold && pc->cold.pending && pc->cold.pending(pc->cold.self, tokens, n, ns) == 1;
}

int kvt__pc_tier_holds(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n)
{
    kvt_cold_hit h;
    return pc->has_cold && pc->cold.find_exact && pc->cold.find_exact(pc->cold.self, tokens, n, ns, &h) == 0;
}

/* Whether the cold tier serves all of (ns, tokens): it holds them exactly,
 * or (with write-behind) a longer entry it can cut back to them, e.g. the
 * one that superseded them there (find on the tokens plus one). */
int kvt__pc_tier_has(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n)
{
    if (kvt__pc_tier_holds(pc, ns, tokens, n))
        return 1;
    if (!kvt__pc_write_behind_on(pc) || n < 1)
        return 0;
    int32_t *p = kvt__malloc((size_t)(n + 1) * sizeof *p);
    if (!p)
        return 0; /* unknown: treated as not held, so it is written */
    memcpy(p, tokens, (size_t)n * sizeof *p);
    p[n] = p[n - 1]; /* any token: the prefix is capped at n */
    kvt_cold_hit h;
    int has = pc->cold.find(pc->cold.self, p, n + 1, ns, &h) == 0 && h.prefix_len >= n;
    kvt__free(p);
    return has;
}

/* ---- create / destroy ------------------------------------------------------------- */

KVT_API int kvt_prompt_cache_create(const kvt_prompt_cache_config *cfg, kvt_prompt_cache **out)
{
    if (!cfg || !out)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_create: cfg or out is NULL");
    *out = NULL;
    if (cfg->block_tokens < 0)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_create: block_tokens %d < 0", (int)cfg->block_tokens);
    if (cfg->cold && (!cfg->cold->find || !cfg->cold->restore || !cfg->cold->store))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_create: the cold tier lacks find, restore or store");
    if (cfg->new_caches && (cfg->n_layers < 1 || cfg->n_layers > 256))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_create: new_caches with n_layers %d (1..256)",
                         (int)cfg->n_layers);
    kvt_prompt_cache *pc = kvt__calloc(1, sizeof *pc);
    if (!pc)
        return kvt__fail(KVT_ENOMEM, "kvt_prompt_cache_create: out of memory");
    pc->max_bytes = cfg->max_bytes;
    pc->flags = cfg->flags;
    pc->new_caches = cfg->new_caches;
    pc->new_caches_ctx = cfg->new_caches_ctx;
    pc->n_layers = cfg->new_caches ? cfg->n_layers : 0;
    if (cfg->cold) {
        pc->cold = *cfg->cold;
        pc->has_cold = 1;
    }
    pc->rops = cfg->retention ? cfg->retention : &kvt_retention_lru;
    int rc = pc->rops->create(&pc->ret);
    if (rc == 0)
        rc = kvt__index_create(&pc->ix);
    if (rc == 0 && cfg->block_policy)
        rc = kvt__pc_blocks_create(cfg->block_policy, cfg->block_tokens ? cfg->block_tokens : 256, &pc->blocks);
    if (rc) {
        if (pc->ret)
            pc->rops->destroy(pc->ret);
        kvt__index_destroy(pc->ix);
        kvt__free(pc);
        return rc;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&pc->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&pc->mu, NULL);
    *out = pc;
    return 0;
}

static void free_session(const char *key, void *val, void *ctx)
{
    (void)key;
    kvt__pc_session_release_slots(ctx, val);
}

/* Drops every entry and session (under the lock); entries go to *gone. */
static void clear_locked(kvt_prompt_cache *pc, pc_entry **gone)
{
    kvt__smap_foreach(&pc->sessions, free_session, pc);
    kvt__smap_free(&pc->sessions);
    while (pc->head)
        kvt__pc_entry_unlink(pc, pc->head, 0, gone);
    kvt__umap_free(&pc->forward);
    pc->epoch++;
}

/* Close's hand-over, off-lock: each leaving entry marked `spill` goes to
 * the cold tier by write-behind, or, when the tier refuses it (queue full,
 * no spill op), by a synchronous store; then every entry is disposed.
 * Returns the first failure (the entry it concerns is lost, counted). */
static int close_hand_over(kvt_prompt_cache *pc, pc_entry *gone)
{
    int rc = 0;
    while (gone) {
        pc_entry *e = gone;
        gone = e->gone;
        if (e->spill) {
            kvt_entry owned;
            int wrc = entry_to_owned(e, &owned);
            if (wrc == 0 && pc->cold.spill && pc->cold.spill(pc->cold.self, &owned) == 0) {
                atomic_fetch_add(&pc->spills, 1);
            } else if (wrc == 0) {
                wrc = pc->cold.store(pc->cold.self, &owned); /* durable on return */
                kvt_entry_clear(&owned);
            }
            if (wrc) {
                atomic_fetch_add(&pc->spill_failures, 1);
                if (!rc)
                    rc = kvt__fail(wrc, "prompt cache close: an entry of %lld tokens could not be handed "
                                   "to the cold tier: %s", (long long)e->n_tokens, kvt_strerror(wrc));
            }
        }
        kvt__pc_entry_dispose(e);
    }
    return rc;
}

KVT_API int kvt_prompt_cache_close(kvt_prompt_cache *pc)
{
    if (!pc)
        return 0;
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    while (pc->reads)
        pthread_cond_wait(&pc->cv, &pc->mu);
    /* every entry (pinned ones too) leaves; those the tier neither holds nor
     * has a write pending for are handed to it (asked once off-lock: the
     * entries are this call's alone by then) */
    clear_locked(pc, &gone);
    pthread_mutex_unlock(&pc->mu);
    for (pc_entry *e = gone; e; e = e->gone)
        e->spill = pc->has_cold && !kvt__pc_tier_holds(pc, e->ns, e->tokens, e->n_tokens) &&
                   !kvt__pc_tier_pending(pc, e->ns, e->tokens, e->n_tokens);
    int rc = close_hand_over(pc, gone);
    if (pc->has_cold && pc->cold.flush) {
        int frc = pc->cold.flush(pc->cold.self);
        if (frc && !rc)
            rc = kvt__fail(frc, "prompt cache close: flushing the cold tier failed: %s", kvt_strerror(frc));
    }
    return rc;
}

KVT_API void kvt_prompt_cache_destroy(kvt_prompt_cache *pc)
{
    if (!pc)
        return;
    (void)kvt_prompt_cache_close(pc);
    kvt__index_destroy(pc->ix);
    kvt__pc_blocks_destroy(pc->blocks);
    pc->rops->destroy(pc->ret);
    kvt__umap_free(&pc->by_id);
    kvt__umap_free(&pc->buf_refs);
    pthread_cond_destroy(&pc->cv);
    pthread_mutex_destroy(&pc->mu);
    kvt__free(pc);
}

/* ---- clear, stats ------------------------------------------------------------------------ */

KVT_API void kvt_prompt_cache_clear(kvt_prompt_cache *pc)
{
    if (!pc)
        return;
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    clear_locked(pc, &gone);
    pthread_mutex_unlock(&pc->mu);
    kvt__pc_gone_process(pc, gone);
}

KVT_API void kvt_prompt_cache_get_stats(kvt_prompt_cache *pc, kvt_prompt_cache_stats *out)
{
    if (!pc || !out)
        return;
    pthread_mutex_lock(&pc->mu);
    *out = pc->st;
    out->pinned = pc->pinned;
    out->bytes = kvt__pc_total_bytes(pc);
    out->max_bytes = pc->max_bytes;
    out->epoch = pc->epoch;
    pthread_mutex_unlock(&pc->mu);
    out->spills = atomic_load(&pc->spills);
    out->spill_failures = atomic_load(&pc->spill_failures);
    out->write_behind_queued = atomic_load(&pc->wb_queued);
    out->write_behind_dropped = atomic_load(&pc->wb_dropped);
    out->write_behind_withdrawn = atomic_load(&pc->wb_withdrawn);
}

/* ---- test hook ------------------------------------------------------------------------ */

/* Internal (tests only): the session-slot count, pin count, buffer count and
 * private bytes of resident entry `id`. @return 0, or KVT_ENOTFOUND when it is not resident. */
int kvt__prompt_cache_entry_info(kvt_prompt_cache *pc, uint64_t id, int64_t *sessions, int64_t *pins,
                                  size_t *n_bufs, size_t *private_bytes);
int kvt__prompt_cache_entry_info(kvt_prompt_cache *pc, uint64_t id, int64_t *sessions, int64_t *pins,
                                  size_t *n_bufs, size_t *private_bytes)
{
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__pc_by_id(pc, id);
    if (e) {
        *sessions = e->sessions;
        *pins = e->pins;
        *n_bufs = e->n_bufs;
        *private_bytes = e->private_bytes;
    }
    pthread_mutex_unlock(&pc->mu);
    return e ? 0 : KVT_ENOTFOUND;
}
