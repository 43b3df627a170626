/*
 * pc_evict.c: how entries leave the prompt cache's RAM (DESIGN.md 3.6-3.9):
 * the retention victim (unpinned, session-free first), the decision whether
 * a leaving entry is spilled, already covered by the cold tier or must stay
 * (its write is pending and only durable entries may leave), block cuts
 * under a block policy, budget eviction, relieve (writes finished now),
 * reclaim (no storage I/O) and demote_idle. The cold tier is asked about a
 * victim with the lock dropped; the victim is chosen again after each answer.
 */
#include "prompt_cache_internal.h"

/* ---- eviction ------------------------------------------------------------------- */

typedef struct elig_ctx {
    kvt_prompt_cache *pc;
    int session_free;
} elig_ctx;

static int eligible(void *ctx, uint64_t id)
{
    elig_ctx *c = ctx;
    pc_entry *e = kvt__pc_by_id(c->pc, id);
    return e && e->pins == 0 && (!c->session_free || e->sessions == 0);
}

/* Retention victim among unpinned entries, session-free ones first (3.6). */
static pc_entry *victim(kvt_prompt_cache *pc)
{
    uint64_t id;
    elig_ctx c = {pc, 1};
    if (pc->rops->victim(pc->ret, eligible, &c, &id) == 0)
        return kvt__pc_by_id(pc, id);
    c.session_free = 0;
    if (pc->rops->victim(pc->ret, eligible, &c, &id) == 0)
        return kvt__pc_by_id(pc, id);
    return NULL;
}

/* ---- asking the cold tier about a victim (the lock dropped meanwhile) ----------- */

/* What the cold tier said about one resident entry, asked off-lock by
 * tier_ask. It answers for the entry only while the entry is unchanged:
 * the same id (never reused), length and write-behind state. */
enum { ASK_PENDING = 1, ASK_HAS = 2 };
typedef struct tier_answer {
    uint64_t id;      /* 0: no answer */
    int64_t n_tokens;
    int wb;
    int asked;        /* ASK_* */
    int pending, has;
} tier_answer;

static int answer_for(const tier_answer *a, const pc_entry *e, int ask)
{
    return a->id == e->id && a->n_tokens == e->n_tokens && a->wb == e->wb && (a->asked & ask) == ask;
}

/* Asks the cold tier about e (ASK_PENDING: kvt__pc_tier_pending; ASK_HAS:
 * kvt__pc_tier_has, not asked when the write is pending and only durable
 * entries may leave).
 * Called with pc->mu held; drops it while the tier answers and takes it
 * again before returning, so every pointer into the cache the caller held
 * is stale afterwards (look e up again; answer_for says whether *a still
 * speaks for it). Out of memory for the copies: not pending, not held. */
static void tier_ask(kvt_prompt_cache *pc, const pc_entry *e, int ask, tier_answer *a)
{
    *a = (tier_answer){e->id, e->n_tokens, e->wb, ask, 0, 0};
    int64_t n = e->n_tokens;
    int32_t *tokens = kvt__malloc((size_t)(n ? n : 1) * sizeof *tokens);
    char *ns = kvt__strdup(e->ns);
    if (tokens && n)
        memcpy(tokens, e->tokens, (size_t)n * sizeof *tokens);
    pthread_mutex_unlock(&pc->mu);
    if (tokens && ns) {
        if (ask & ASK_PENDING)
            a->pending = kvt__pc_tier_pending(pc, ns, tokens, n);
        if ((ask & ASK_HAS) && !(a->pending && (pc->flags & KVT_PC_EVICT_ONLY_DURABLE)))
            a->has = kvt__pc_tier_has(pc, ns, tokens, n);
    }
    kvt__free(tokens);
    kvt__free(ns);
    pthread_mutex_lock(&pc->mu);
}

/* How an entry leaving RAM by eviction goes (3.6). */
enum {
    PC_LEAVE_DROP,    /* no tier to write to: dropped */
    PC_LEAVE_SPILL,   /* spilled first */
    PC_LEAVE_COVERED, /* the tier holds it, has it pending, or a put is
                         handing it over: nothing written again */
    PC_LEAVE_STOP,    /* tier policy: its write is pending, it stays */
    PC_LEAVE_ASK      /* the tier must be asked first (tier_ask, ASK_PENDING
                         | ASK_HAS), then the victim chosen again */
};

/* Under the lock. Decides from RAM state where it can, else from *a when
 * it answers for e. */
static int leaving(kvt_prompt_cache *pc, const pc_entry *e, const tier_answer *a)
{
    if (!pc->has_cold)
        return PC_LEAVE_DROP;
    int wb = kvt__pc_write_behind_on(pc), only_durable = (pc->flags & KVT_PC_EVICT_ONLY_DURABLE) != 0;
    if (wb && e->wb == PC_WB_QUEUING)
        return only_durable ? PC_LEAVE_STOP : PC_LEAVE_COVERED;
    if (!wb && !only_durable)
        return pc->cold.spill ? PC_LEAVE_SPILL : PC_LEAVE_DROP;
    if (!answer_for(a, e, ASK_PENDING | ASK_HAS))
        return PC_LEAVE_ASK;
    if (only_durable && a->pending)
        return PC_LEAVE_STOP; /* a pending write is not a copy, even one the tier serves */
    if (!pc->cold.spill)
        return PC_LEAVE_DROP;
    /* a tier without `pending` cannot say; trust the write-behind it took */
    if (a->has || (wb && (a->pending || (!pc->cold.pending && e->wb == PC_WB_SENT))))
        return PC_LEAVE_COVERED;
    return PC_LEAVE_SPILL;
}

/* Unlinks an entry leaving by eviction as `how` (leaving()) says. */
static void evict_unlink(kvt_prompt_cache *pc, pc_entry *e, int how, pc_entry **gone)
{
    if (how == PC_LEAVE_COVERED)
        pc->st.durable_evictions++;
    kvt__pc_entry_unlink(pc, e, how == PC_LEAVE_SPILL, gone);
    pc->st.evictions++;
}

/* Queues a spill-only copy of e (zero-copy clones of its caches, its tokens,
 * a share of its hook) on *gone, so the cold tier gets e's whole prefix
 * before a block cut drops its tail (3.6: evicted state goes to the cold
 * tier first). Best effort: out of memory means no spill. */
static void spill_copy(pc_entry *e, pc_entry **gone)
{
    /* cut entries have no attachments */
    pc_entry *x = kvt__pc_entry_shell(e->ns, e->tokens, e->n_tokens, e->n_caches, 0);
    if (!x)
        return;
    if (e->n_caches && kvt_caches_clone(e->caches, e->n_caches, x->caches) != 0) {
        kvt__pc_entry_free_shell(x);
        return;
    }
    if (e->share) {
        atomic_fetch_add(&e->share->refs, 1);
        x->share = e->share;
    }
    x->id = e->id;
    x->spill = 1;
    x->gone = *gone;
    *gone = x;
}

/* Block-granular eviction (issue 6): cuts the block policy's victim block,
 * and every block after it, off the entry that ends in it; an entry cut back
 * to nothing (or below its reach) leaves whole, spilled as by evict. A cut
 * tail is dropped without a spill: the prefix that stays is what serves.
 * @return 1 when something went (or an uncuttable block was forgotten, or
 * the cold tier was asked about the victim's entry: the lock was dropped,
 * the caller looks again), 0 when no block can go now (none tracked, or the
 * victim's entry is pinned or has a pending lower-tier write): the caller
 * falls back to entries. */
static int cut_block(kvt_prompt_cache *pc, pc_entry **gone, tier_answer *a)
{
    void *owner;
    int64_t depth;
    if (kvt__pc_blocks_victim(pc->blocks, &owner, &depth) != 0)
        return 0;
    if (!owner)
        return 1;
    pc_entry *e = owner;
    if (e->pins > 0)
        return 0;
    int how = leaving(pc, e, a);
    if (how == PC_LEAVE_ASK) {
        tier_ask(pc, e, ASK_PENDING | ASK_HAS, a);
        return 1;
    }
    if (how == PC_LEAVE_STOP)
        return 0;
    if (e->cut_spilled && how == PC_LEAVE_SPILL)
        how = PC_LEAVE_DROP; /* its whole prefix went to the tier at the first cut */
    int64_t new_len = depth * kvt__pc_blocks_block_tokens(pc->blocks), before = e->n_bkeys;
    if (new_len < 1 || new_len < e->reach) {
        /* a cut already spilled a longer prefix that serves this one */
        evict_unlink(pc, e, how, gone);
        return 1;
    }
    if (how == PC_LEAVE_SPILL) {
        spill_copy(e, gone);
        e->cut_spilled = 1;
    } else if (how == PC_LEAVE_COVERED && kvt__pc_write_behind_on(pc)) {
        e->cut_spilled = 1; /* the tier has its whole prefix: it serves the cut one */
    }
    /* cut as many of its tail blocks at once as the budget needs, when they
     * are the next victims anyway (one re-index instead of one per block) */
    size_t buf = 0;
    for (size_t i = 0; i < e->n_bufs; i++)
        buf += kvt_buf_bytes(e->bufs[i]);
    size_t per_block = e->n_bkeys > 0 ? buf / (size_t)e->n_bkeys : 0;
    size_t over = kvt__pc_total_bytes(pc) - pc->max_bytes; /* evict calls us only when over */
    if (per_block > 0 && over > per_block) {
        int64_t want = (int64_t)((over + per_block - 1) / per_block);
        depth = kvt__pc_blocks_extend(pc->blocks, e->bkeys, depth, want);
        new_len = depth * kvt__pc_blocks_block_tokens(pc->blocks);
        if (new_len < 1 || new_len < e->reach) {
            kvt__pc_entry_unlink(pc, e, 0, gone); /* its whole prefix was just spilled */
            pc->st.evictions++;
            return 1;
        }
    }
    if (kvt__pc_trim_locked(pc, e, new_len, gone) == 0) {
        pc->st.block_cuts++;
        pc->st.blocks_cut += (uint64_t)(before - depth);
    }
    return 1; /* a failed trim unlinked the entry: progress either way */
}

/* Evicts until the budget holds, or at most `limit` entries when limit >= 0.
 * With a block policy, budget eviction cuts blocks first (cut_block).
 * Called with pc->mu held and returns with it held, but drops it while the
 * cold tier is asked about a victim (tier_ask): the caller must hold no
 * pointer into the cache across the call. After each answer the budget and
 * the victim are looked at again, so what changed meanwhile is seen. */
int64_t kvt__pc_evict(kvt_prompt_cache *pc, int64_t limit, pc_entry **gone)
{
    int64_t n = 0;
    tier_answer a = {0};
    while (limit < 0 ? kvt__pc_total_bytes(pc) > pc->max_bytes : n < limit) {
        if (pc->blocks && limit < 0 && cut_block(pc, gone, &a))
            continue;
        pc_entry *v = victim(pc);
        if (!v)
            break;
        int how = leaving(pc, v, &a);
        if (how == PC_LEAVE_ASK) {
            tier_ask(pc, v, ASK_PENDING | ASK_HAS, &a);
            continue;
        }
        if (how == PC_LEAVE_STOP)
            break; /* tier policy: a pending write is not a copy (3.6) */
        evict_unlink(pc, v, how, gone);
        n++;
    }
    return n;
}

/* ---- budget, eviction, pressure ---------------------------------------------------- */

KVT_API int kvt_prompt_cache_set_max_bytes(kvt_prompt_cache *pc, size_t max_bytes)
{
    if (!pc)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_set_max_bytes: cache is NULL");
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    pc->max_bytes = max_bytes;
    kvt__pc_evict(pc, -1, &gone);
    pthread_mutex_unlock(&pc->mu);
    kvt__pc_gone_process(pc, gone);
    return 0;
}

KVT_API int kvt_prompt_cache_evict(kvt_prompt_cache *pc, int64_t count, int64_t *n_out)
{
    if (!pc || count < 0)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_evict: cache NULL or negative count");
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    int64_t n = kvt__pc_evict(pc, count, &gone);
    pthread_mutex_unlock(&pc->mu);
    kvt__pc_gone_process(pc, gone);
    if (n_out)
        *n_out = n;
    return 0;
}

/* Unlinks and disposes v at once, under the lock (relieve and reclaim: the
 * next pressure check must see the memory freed); no spill. */
static void demote_now(kvt_prompt_cache *pc, pc_entry *v)
{
    pc_entry *gone = NULL;
    kvt__pc_entry_unlink(pc, v, 0, &gone);
    kvt__pc_entry_dispose(v);
    pc->st.demotions++;
}

/* The retention victim with the cold tier's answer about it in *a (when
 * `ask` is nonzero and there is a cold tier), or NULL. Under the lock; it is
 * dropped while the tier answers, and the victim chosen again after. */
static pc_entry *victim_asked(kvt_prompt_cache *pc, int ask, tier_answer *a)
{
    for (;;) {
        pc_entry *v = victim(pc);
        if (!v || !ask || !pc->has_cold || answer_for(a, v, ask))
            return v;
        tier_ask(pc, v, ask, a);
    }
}

KVT_API int kvt_prompt_cache_relieve(kvt_prompt_cache *pc, kvt_over_budget_fn over_budget, void *ctx,
                                     int64_t *n_out)
{
    if (n_out)
        *n_out = 0;
    if (!pc || !over_budget)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_relieve: cache or over_budget is NULL");
    int rc = 0;
    int64_t n = 0;
    int check = pc->has_cold && kvt__pc_write_behind_on(pc);
    tier_answer a = {0};
    pthread_mutex_lock(&pc->mu);
    while (over_budget(ctx)) {
        pc_entry *v = victim_asked(pc, check ? ASK_PENDING | ASK_HAS : 0, &a);
        if (!v)
            break;
        if (check && !a.pending && a.has) {
            pc->st.durable_evictions++; /* durable already: nothing to finish */
        } else if (pc->has_cold) {
            /* the write must finish now (3.7), written off-lock from zero-copy
             * views; the entry leaves only if it is still there, unpinned */
            kvt_entry views;
            rc = kvt__pc_clone_parts(&views, v->ns, v->tokens, v->n_tokens, v->caches, v->n_caches, v->atts, v->n_atts);
            if (rc) {
                kvt__fail(rc, "kvt_prompt_cache_relieve: out of memory for the views of %lld tokens; kept",
                          (long long)v->n_tokens);
                break;
            }
            views.hook = kvt__pc_share_acquire(v->share);
            uint64_t id = v->id;
            int64_t len = v->n_tokens;
            pthread_mutex_unlock(&pc->mu);
            rc = pc->cold.store(pc->cold.self, &views); /* must finish now (3.7) */
            kvt_entry_clear(&views); /* v still holds the buffers: nothing is freed here */
            pthread_mutex_lock(&pc->mu);
            if (rc) {
                kvt__fail(rc, "kvt_prompt_cache_relieve: writing %lld tokens to the cold tier failed (%s); kept",
                          (long long)len, kvt_strerror(rc));
                break;
            }
            v = kvt__pc_by_id(pc, id);
            if (!v || v->pins > 0 || v->n_tokens != len)
                continue; /* it changed meanwhile: what it wrote stays durable */
        }
        demote_now(pc, v);
        n++;
    }
    pthread_mutex_unlock(&pc->mu);
    if (n_out)
        *n_out = n;
    return rc;
}

KVT_API int kvt_prompt_cache_reclaim(kvt_prompt_cache *pc, kvt_over_budget_fn pressure, void *ctx,
                                     int64_t *n_out)
{
    if (n_out)
        *n_out = 0;
    if (!pc || !pressure)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_reclaim: cache or pressure is NULL");
    int64_t n = 0;
    int only_durable = (pc->flags & KVT_PC_EVICT_ONLY_DURABLE) != 0;
    tier_answer a = {0};
    pthread_mutex_lock(&pc->mu);
    while (pressure(ctx)) {
        pc_entry *v = victim_asked(pc, only_durable ? ASK_PENDING : 0, &a);
        if (!v)
            break;
        if (only_durable && pc->has_cold && a.pending)
            break;
        demote_now(pc, v); /* no storage I/O at a reclaim boundary (3.8) */
        n++;
    }
    pthread_mutex_unlock(&pc->mu);
    if (n_out)
        *n_out = n;
    return 0;
}

/* One idle entry demote_idle looks at: zero-copy views of it, asked about
 * and written (when the tier lacks it) off-lock. */
typedef struct demote_job {
    uint64_t id;
    int64_t n_tokens;
    int leave;        /* 0 keep, 1 the tier had it, 2 written now */
    kvt_entry copy;
} demote_job;

KVT_API int kvt_prompt_cache_demote_idle(kvt_prompt_cache *pc, uint64_t idle_ms, int64_t *n_out)
{
    if (n_out)
        *n_out = 0;
    if (!pc)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_demote_idle: cache is NULL");
    if (!pc->has_cold)
        return 0;
    int64_t n = 0;
    pc_entry *gone = NULL;
    demote_job *jobs = NULL;
    size_t n_jobs = 0, cap_jobs = 0;
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&pc->mu);
    for (pc_entry *e = pc->head; e; e = e->next) {
        if (e->pins > 0 || now - e->last_used_ms < idle_ms || e->wb == PC_WB_QUEUING)
            continue; /* pinned, used lately, or its write is being queued */
        if (n_jobs == cap_jobs) {
            size_t cap = cap_jobs ? cap_jobs * 2 : 8;
            demote_job *j = kvt__realloc(jobs, cap * sizeof *j);
            if (!j)
                break;
            jobs = j;
            cap_jobs = cap;
        }
        demote_job *j = &jobs[n_jobs];
        if (kvt__pc_clone_parts(&j->copy, e->ns, e->tokens, e->n_tokens, e->caches, e->n_caches, e->atts,
                                e->n_atts) != 0)
            break;
        j->copy.hook = kvt__pc_share_acquire(e->share);
        j->id = e->id;
        j->n_tokens = e->n_tokens;
        j->leave = 0;
        n_jobs++;
    }
    pthread_mutex_unlock(&pc->mu);
    /* ask the tier and write what it does not hold yet, off-lock */
    for (size_t i = 0; i < n_jobs; i++) {
        demote_job *j = &jobs[i];
        const char *ns = j->copy.ns;
        if (kvt__pc_tier_pending(pc, ns, j->copy.tokens, j->n_tokens))
            j->leave = 0; /* a pending write is not a copy: keep it for now */
        else if (kvt__pc_tier_has(pc, ns, j->copy.tokens, j->n_tokens))
            j->leave = 1;
        else if (pc->cold.store(pc->cold.self, &j->copy) == 0)
            j->leave = 2;
        /* else: a failed write is never a demotion */
        kvt_entry_clear(&j->copy);
    }
    /* drop what is durable now, if it is still there unchanged and unpinned */
    pthread_mutex_lock(&pc->mu);
    for (size_t i = 0; i < n_jobs; i++) {
        pc_entry *e = jobs[i].leave ? kvt__pc_by_id(pc, jobs[i].id) : NULL;
        if (!e || e->pins > 0 || e->n_tokens != jobs[i].n_tokens || e->wb == PC_WB_QUEUING)
            continue;
        kvt__pc_entry_unlink(pc, e, 0, &gone);
        pc->st.demotions++;
        if (jobs[i].leave == 1)
            pc->st.durable_evictions++;
        n++;
    }
    pthread_mutex_unlock(&pc->mu);
    kvt__free(jobs);
    kvt__pc_gone_process(pc, gone);
    if (n_out)
        *n_out = n;
    return 0;
}
