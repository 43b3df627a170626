/*
 * prompt_cache.c: the RAM tier (DESIGN.md section 3): resident entries, the
 * byte budget with shared buffers counted once, the radix index per
 * namespace, retention, sessions, pins, prefetch reads and objects, tiered
 * over an optional cold tier.
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
 * decides under the lock whether the tier still needs them (wb state below),
 * and hands them to the tier's spill after dropping it. An entry leaving RAM
 * is spilled only when the tier neither holds it, nor has it pending, nor is
 * about to receive it from a put in progress (see leaving()).
 */
#include "kvtier/prompt_cache.h"

#include "hmap.h"
#include "index.h"
#include "internal.h"
#include "pc_blocks.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

/* ---- refcounted release hook ------------------------------------------------ */

/* One share per holder (the donor entry, every lent view, every spill); the
 * hook runs once the last share is run. */
typedef struct pc_share {
    atomic_int_fast64_t refs;
    kvt_hook hook;
} pc_share;

static void share_run(void *ctx)
{
    pc_share *s = ctx;
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        kvt_hook_run(&s->hook);
        kvt__free(s);
    }
}

static kvt_hook share_acquire(pc_share *s)
{
    if (!s)
        return (kvt_hook){NULL, NULL};
    atomic_fetch_add(&s->refs, 1);
    return (kvt_hook){share_run, s};
}

/* A share holding hook with one reference, or NULL when out of memory. */
static pc_share *share_new(kvt_hook hook)
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
static int clone_parts(kvt_entry *out, const char *ns, const int32_t *tokens, int64_t n, kvt_cache *const *caches,
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

typedef struct pc_entry {
    uint64_t id;              /* unique for the life of the cache, never 0 */
    char *ns;
    int32_t *tokens;          /* (n_tokens) */
    int64_t n_tokens;
    kvt_cache **caches;       /* (n_caches) owned */
    int32_t n_caches;
    kvt_attachment **atts;    /* (n_atts) owned */
    int32_t n_atts;
    pc_share *share;          /* the donor's share holder, NULL = no hook */
    int trimmable;
    int64_t reach;            /* shortest length every layer reaches (tokens) */
    size_t private_bytes;     /* bytes outside refcounted buffers */
    kvt_buf **bufs;           /* (n_bufs) buffers held, as counted in the budget */
    size_t n_bufs;
    int64_t pins;
    int64_t sessions;         /* session slots pointing here */
    uint64_t last_used_ms;
    uint64_t *bkeys;          /* (n_bkeys) block keys when block eviction
                                 tracks the entry (pc_blocks.h), else NULL */
    int64_t n_bkeys;
    int cut_spilled;          /* a block cut handed its whole tokens to the
                                 cold tier since it became resident */
    int wb;                   /* write-behind state, PC_WB_* */
    int withdraw;             /* when gone (superseded): withdraw its queued
                                 write once the superseding entry's is queued */
    int spill;                /* when gone: hand to the cold tier first */
    struct pc_entry *prev, *next; /* all resident entries */
    struct pc_entry *gone;        /* leaving entries, processed off-lock */
} pc_entry;

/* Write-behind state of an entry (guarded by the cache lock). */
enum {
    PC_WB_NONE = 0,   /* nothing handed to the tier by put */
    PC_WB_QUEUING,    /* put decided to queue it; its spill has not returned */
    PC_WB_SENT        /* the tier accepted its write-behind */
};

typedef struct pc_slot {
    char *ns;
    uint64_t id;
} pc_slot;

typedef struct pc_session {
    pc_slot *slots; /* (n) one per namespace */
    size_t n;
} pc_session;

typedef struct pc_read pc_read;

struct kvt_prompt_cache {
    pthread_mutex_t mu;
    pthread_cond_t cv;         /* prefetch reads ending */
    size_t max_bytes;
    uint32_t flags;
    int has_cold;
    kvt_cold_tier cold;
    const kvt_retention_ops *rops;
    kvt_retention *ret;
    kvt__pc_blocks *blocks;    /* block-granular eviction, or NULL */
    kvt__index *ix;
    kvt__umap by_id;           /* id -> pc_entry* */
    kvt__umap buf_refs;        /* kvt_buf* -> resident holders */
    kvt__umap forward;         /* replaced id -> replacing id (pins follow) */
    kvt__smap sessions;        /* session -> pc_session* */
    pc_entry *head;            /* resident entries, most recently inserted first */
    size_t buf_bytes, private_bytes;
    uint64_t next_id;
    uint64_t epoch;
    uint64_t gen;              /* advanced whenever an entry leaves or is cut
                                  in place: a lookup that dropped the lock
                                  re-finds its RAM candidate when it moved */
    pc_read *reads;            /* prefetch reads in flight */
    int64_t pinned;
    kvt_prompt_cache_stats st;
    atomic_uint_fast64_t spills, spill_failures;
    atomic_uint_fast64_t wb_queued, wb_dropped, wb_withdrawn;
    kvt_new_caches_fn new_caches; /* fresh caches on a miss, or NULL */
    void *new_caches_ctx;
    int32_t n_layers;
};

struct pc_read {
    kvt_prompt_cache *pc;
    uint64_t handle;
    char *ns;
    char *session;
    uint64_t epoch;
    int64_t refs;      /* leases holding it + the read in flight */
    int64_t interest;  /* live leases waiting */
    int done;
    int status;
    uint64_t entry_id; /* published entry (0 = none) */
    pc_read *next;
};

struct kvt_lease {
    kvt_prompt_cache *pc;
    uint64_t entry_id; /* pinned entry, 0 = none */
    pc_read *read;     /* prefetch read, or NULL */
};

/* ---- small helpers ----------------------------------------------------------- */

static int tokens_equal(const int32_t *a, const int32_t *b, int64_t n)
{
    return n == 0 || memcmp(a, b, (size_t)n * sizeof(int32_t)) == 0;
}

static pc_entry *by_id(const kvt_prompt_cache *pc, uint64_t id)
{
    uint64_t *v = kvt__umap_get(&pc->by_id, id);
    return v ? (pc_entry *)(uintptr_t)*v : NULL;
}

static size_t total_bytes(const kvt_prompt_cache *pc) { return pc->buf_bytes + pc->private_bytes; }

/* Frees an entry shell whose parts were never adopted (or were moved out). */
static void entry_free_shell(pc_entry *e)
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
static pc_entry *entry_shell(const char *ns, const int32_t *tokens, int64_t n_tokens, int32_t n_caches,
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
        entry_free_shell(x);
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
static void entry_discard(pc_entry *x)
{
    if (!x)
        return;
    kvt__free(x->share);
    x->share = NULL;
    entry_free_shell(x);
}

/* Disposes an entry and its parts: caches, attachments, then its hook share. */
static void entry_dispose(pc_entry *e)
{
    for (int32_t i = 0; i < e->n_caches; i++)
        kvt_cache_destroy(e->caches[i]);
    for (int32_t i = 0; i < e->n_atts; i++)
        kvt_attachment_destroy(e->atts[i]);
    if (e->share)
        share_run(e->share);
    e->share = NULL;
    entry_free_shell(e);
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
static int entry_measure(pc_entry *e, size_t *standalone)
{
    kvt_entry view = {e->ns, e->tokens, e->n_tokens, e->caches, e->n_caches, e->atts, e->n_atts, {0}};
    e->trimmable = kvt_entry_trimmable(&view, &e->reach);
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
static void account_remove(kvt_prompt_cache *pc, pc_entry *e)
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

static int account_add(kvt_prompt_cache *pc, pc_entry *e)
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
            account_remove(pc, e);
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
static void entry_unlink(kvt_prompt_cache *pc, pc_entry *e, int spill, pc_entry **gone)
{
    void *at = kvt__index_exact(pc->ix, e->ns, e->tokens, e->n_tokens);
    if (at == e)
        kvt__index_remove(pc->ix, e->ns, e->tokens, e->n_tokens);
    kvt__umap_del(&pc->by_id, e->id);
    pc->rops->on_remove(pc->ret, e->id);
    if (pc->blocks)
        kvt__pc_blocks_drop(pc->blocks, e, e->bkeys, 0, e->n_bkeys);
    account_remove(pc, e);
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
    out->hook = (kvt_hook){e->share ? share_run : NULL, e->share};
    e->share = NULL;
    return 0;
}

/* Processes leaving entries off-lock: spill (write-behind) then dispose.
 * Superseded entries marked `withdraw` have their queued write withdrawn
 * when `withdraw_ok` says the superseding entry's state is queued too. */
static void gone_process_wb(kvt_prompt_cache *pc, pc_entry *gone, int withdraw_ok)
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
        entry_dispose(e);
    }
}

static void gone_process(kvt_prompt_cache *pc, pc_entry *gone) { gone_process_wb(pc, gone, 0); }

/* ---- sessions ------------------------------------------------------------------ */

static void session_release_slots(kvt_prompt_cache *pc, pc_session *s)
{
    for (size_t i = 0; i < s->n; i++) {
        pc_entry *e = by_id(pc, s->slots[i].id);
        if (e)
            e->sessions--;
        kvt__free(s->slots[i].ns);
    }
    kvt__free(s->slots);
    kvt__free(s);
}

static pc_slot *session_slot(const kvt_prompt_cache *pc, const char *session, const char *ns)
{
    pc_session *s = kvt__smap_get(&pc->sessions, session);
    for (size_t i = 0; s && i < s->n; i++)
        if (strcmp(s->slots[i].ns, ns) == 0)
            return &s->slots[i];
    return NULL;
}

/* Points (session, ns) at e. Best effort: on out of memory the affinity is
 * simply not recorded (a session is a hint, never data). */
static void session_associate(kvt_prompt_cache *pc, const char *session, const char *ns, pc_entry *e)
{
    if (!session)
        return;
    pc_slot *slot = session_slot(pc, session, ns);
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
    pc_entry *old = by_id(pc, slot->id);
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
static void entry_follow(kvt_prompt_cache *pc, pc_entry *from, pc_entry *to)
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

/* ---- eviction ------------------------------------------------------------------- */

typedef struct elig_ctx {
    kvt_prompt_cache *pc;
    int session_free;
} elig_ctx;

static int eligible(void *ctx, uint64_t id)
{
    elig_ctx *c = ctx;
    pc_entry *e = by_id(c->pc, id);
    return e && e->pins == 0 && (!c->session_free || e->sessions == 0);
}

/* Retention victim among unpinned entries, session-free ones first (3.6). */
static pc_entry *victim(kvt_prompt_cache *pc)
{
    uint64_t id;
    elig_ctx c = {pc, 1};
    if (pc->rops->victim(pc->ret, eligible, &c, &id) == 0)
        return by_id(pc, id);
    c.session_free = 0;
    if (pc->rops->victim(pc->ret, eligible, &c, &id) == 0)
        return by_id(pc, id);
    return NULL;
}

/* ---- asking the cold tier (always WITHOUT the lock) ------------------------------ */

/* These four may block on I/O (a remote tier's lookup): they are called
 * only with pc->mu NOT held, on borrowed copies of an entry's ns and tokens.
 * They read only what create set (cold, flags). */

static int tier_pending(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n)
{
    return pc->has_cold && pc->cold.pending && pc->cold.pending(pc->cold.self, tokens, n, ns) == 1;
}

static int tier_holds(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n)
{
    kvt_cold_hit h;
    return pc->has_cold && pc->cold.find_exact && pc->cold.find_exact(pc->cold.self, tokens, n, ns, &h) == 0;
}

static int write_behind_on(const kvt_prompt_cache *pc)
{
    return pc->has_cold && pc->cold.spill && !(pc->flags & KVT_PC_NO_WRITE_BEHIND);
}

/* Whether the cold tier serves all of (ns, tokens): it holds them exactly,
 * or (with write-behind) a longer entry it can cut back to them, e.g. the
 * one that superseded them there (find on the tokens plus one). */
static int tier_has(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n)
{
    if (tier_holds(pc, ns, tokens, n))
        return 1;
    if (!write_behind_on(pc) || n < 1)
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

/* Asks the cold tier about e (ASK_PENDING: tier_pending; ASK_HAS: tier_has,
 * not asked when the write is pending and only durable entries may leave).
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
            a->pending = tier_pending(pc, ns, tokens, n);
        if ((ask & ASK_HAS) && !(a->pending && (pc->flags & KVT_PC_EVICT_ONLY_DURABLE)))
            a->has = tier_has(pc, ns, tokens, n);
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
    int wb = write_behind_on(pc), only_durable = (pc->flags & KVT_PC_EVICT_ONLY_DURABLE) != 0;
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
    entry_unlink(pc, e, how == PC_LEAVE_SPILL, gone);
    pc->st.evictions++;
}

static int trim_locked(kvt_prompt_cache *pc, pc_entry *e, int64_t new_len, pc_entry **gone);

/* Queues a spill-only copy of e (zero-copy clones of its caches, its tokens,
 * a share of its hook) on *gone, so the cold tier gets e's whole prefix
 * before a block cut drops its tail (3.6: evicted state goes to the cold
 * tier first). Best effort: out of memory means no spill. */
static void spill_copy(pc_entry *e, pc_entry **gone)
{
    /* cut entries have no attachments */
    pc_entry *x = entry_shell(e->ns, e->tokens, e->n_tokens, e->n_caches, 0);
    if (!x)
        return;
    if (e->n_caches && kvt_caches_clone(e->caches, e->n_caches, x->caches) != 0) {
        entry_free_shell(x);
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
    } else if (how == PC_LEAVE_COVERED && write_behind_on(pc)) {
        e->cut_spilled = 1; /* the tier has its whole prefix: it serves the cut one */
    }
    /* cut as many of its tail blocks at once as the budget needs, when they
     * are the next victims anyway (one re-index instead of one per block) */
    size_t buf = 0;
    for (size_t i = 0; i < e->n_bufs; i++)
        buf += kvt_buf_bytes(e->bufs[i]);
    size_t per_block = e->n_bkeys > 0 ? buf / (size_t)e->n_bkeys : 0;
    size_t over = total_bytes(pc) - pc->max_bytes; /* evict calls us only when over */
    if (per_block > 0 && over > per_block) {
        int64_t want = (int64_t)((over + per_block - 1) / per_block);
        depth = kvt__pc_blocks_extend(pc->blocks, e->bkeys, depth, want);
        new_len = depth * kvt__pc_blocks_block_tokens(pc->blocks);
        if (new_len < 1 || new_len < e->reach) {
            entry_unlink(pc, e, 0, gone); /* its whole prefix was just spilled */
            pc->st.evictions++;
            return 1;
        }
    }
    if (trim_locked(pc, e, new_len, gone) == 0) {
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
static int64_t evict(kvt_prompt_cache *pc, int64_t limit, pc_entry **gone)
{
    int64_t n = 0;
    tier_answer a = {0};
    while (limit < 0 ? total_bytes(pc) > pc->max_bytes : n < limit) {
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
    pc_entry *x = entry_shell(kvt__ns(e->ns), e->tokens, e->n_tokens, e->n_caches, e->n_attachments);
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
    int64_t reach;
} super_ctx;

static void collect_ancestor(void *val, int64_t depth, void *ctx)
{
    super_ctx *s = ctx;
    pc_entry *e = val;
    if (depth < s->reach || e->pins > 0)
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
 * put's rules except the budget: the caller runs evict() next, once it no
 * longer needs x (evict may drop the lock, and x may leave meanwhile). On
 * error nothing is linked and x is untouched. `pins` pins the new entry at
 * once (prefetch publication). `wb` (NULL: none) is 1 when the caller holds
 * write-behind views of x; insert sets it to 0 when the tier does not need
 * them because x is spilled as oversize, to 2 when the tier already holds or
 * has pending its tokens (`tier_have`, asked by the caller before taking the
 * lock, or an entry of equal tokens being written behind), else leaves it 1
 * and marks x PC_WB_QUEUING. */
static int insert_locked(kvt_prompt_cache *pc, pc_entry *x, size_t standalone, const char *session,
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
    rc = account_add(pc, x);
    if (rc) {
        pc->rops->on_remove(pc->ret, x->id);
        kvt__umap_del(&pc->by_id, x->id);
        return rc;
    }
    void *replaced = NULL;
    rc = kvt__index_insert(pc->ix, x->ns, x->tokens, x->n_tokens, x, x->trimmable, x->reach, &replaced);
    if (rc) {
        account_remove(pc, x);
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
        entry_follow(pc, old, x);
        entry_unlink(pc, old, 0, gone);
        pc->st.replacements++;
    }
    if (x->trimmable && x->n_tokens > 0) {
        /* supersede strict prefix ancestors it can be trimmed back to; the
         * queued writes of those that were written behind are withdrawn once
         * x's own is queued (gone_process_wb) */
        super_ctx s = {NULL, 0, 0, x->reach};
        kvt__index_prefixes(pc->ix, x->ns, x->tokens, x->n_tokens, collect_ancestor, &s);
        for (size_t i = 0; i < s.n; i++) {
            s.v[i]->withdraw = s.v[i]->wb != PC_WB_NONE && write_behind_on(pc);
            entry_unlink(pc, s.v[i], 0, gone);
            pc->st.supersedes++;
        }
        kvt__free(s.v);
    }
    session_associate(pc, session, x->ns, x);
    return 0;
}

/* ---- lending ---------------------------------------------------------------------- */

/* Fills out with views of e at p tokens (under the lock: clones only; the
 * views are trimmed by lend_finish off-lock). */
static int lend_locked(kvt_prompt_cache *pc, pc_entry *e, int64_t p, kvt_hit *out)
{
    int rc = clone_parts(&out->entry, e->ns, e->tokens, p, e->caches, e->n_caches, e->atts, e->n_atts);
    if (rc)
        return rc;
    out->entry.hook = share_acquire(e->share);
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
    session_release_slots(ctx, val);
}

/* Drops every entry and session (under the lock); entries go to *gone. */
static void clear_locked(kvt_prompt_cache *pc, pc_entry **gone)
{
    kvt__smap_foreach(&pc->sessions, free_session, pc);
    kvt__smap_free(&pc->sessions);
    while (pc->head)
        entry_unlink(pc, pc->head, 0, gone);
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
        entry_dispose(e);
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
        e->spill = pc->has_cold && !tier_holds(pc, e->ns, e->tokens, e->n_tokens) &&
                   !tier_pending(pc, e->ns, e->tokens, e->n_tokens);
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

/* ---- put -------------------------------------------------------------------------- */

/* Takes e's parts on success: NULLs the slots and empties the hook. */
static void adopt_parts(kvt_entry *e)
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
static int entry_prepare(kvt_prompt_cache *pc, const kvt_entry *e, pc_entry **out, size_t *standalone)
{
    pc_entry *x = NULL;
    int rc = entry_build(e, &x);
    if (rc)
        return rc;
    rc = entry_measure(x, standalone);
    if (rc == 0 && pc->blocks && x->trimmable)
        rc = kvt__pc_blocks_keys(pc->blocks, x->ns, x->tokens, x->n_tokens, &x->bkeys, &x->n_bkeys);
    if (rc == 0 && e->hook.fn && !(x->share = share_new(e->hook)))
        rc = kvt__fail(KVT_ENOMEM, "prompt cache put: out of memory");
    if (rc) {
        entry_discard(x);
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
    pc_entry *x = by_id(pc, id);
    if (x && x->wb == PC_WB_QUEUING)
        x->wb = taken ? PC_WB_SENT : PC_WB_NONE;
    pthread_mutex_unlock(&pc->mu);
    return taken;
}

/* put's body. `wb`: the entry is new state (a put, not a restore being
 * published), so it is written behind when write-behind is on. */
static int put_common(kvt_prompt_cache *pc, kvt_entry *e, const char *session, int64_t pins,
                      uint64_t *id_out, uint64_t epoch_check, int wb)
{
    pc_entry *x = NULL;
    size_t standalone = 0;
    int rc = entry_prepare(pc, e, &x, &standalone);
    if (rc)
        return rc;
    /* zero-copy views for the tier, made before the lock (the caller's
     * caches are not shared with anyone yet) */
    kvt_entry views;
    memset(&views, 0, sizeof views);
    wb = wb && write_behind_on(pc);
    if (wb && clone_parts(&views, x->ns, x->tokens, x->n_tokens, x->caches, x->n_caches, x->atts, x->n_atts)) {
        wb = 0;
        atomic_fetch_add(&pc->wb_dropped, 1); /* out of memory: spilled on leaving RAM */
    }
    int tier_have = 0;
    if (wb) {
        views.hook = share_acquire(x->share);
        /* asked before the lock: the tier may block on I/O */
        tier_have = tier_has(pc, x->ns, x->tokens, x->n_tokens) || tier_pending(pc, x->ns, x->tokens, x->n_tokens);
    }
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    if (epoch_check != UINT64_MAX && epoch_check != pc->epoch) {
        pthread_mutex_unlock(&pc->mu);
        kvt_entry_clear(&views);
        entry_discard(x);
        return kvt__fail(KVT_ESTALE, "prompt cache: cleared while the entry was read");
    }
    rc = insert_locked(pc, x, standalone, session, pins, &gone, &wb, tier_have);
    uint64_t id = rc == 0 ? x->id : 0;
    if (rc == 0 && id_out)
        *id_out = id;
    if (rc == 0)
        evict(pc, -1, &gone); /* x may leave from here on */
    pthread_mutex_unlock(&pc->mu);
    if (rc) {
        kvt_entry_clear(&views);
        entry_discard(x);
        return rc;
    }
    adopt_parts(e);
    int queued = 0;
    if (wb == 1)
        queued = write_behind(pc, id, &views);
    else
        kvt_entry_clear(&views); /* not needed: the tier has (or gets) this state */
    gone_process_wb(pc, gone, queued || wb == 2);
    return 0;
}

KVT_API int kvt_prompt_cache_put(kvt_prompt_cache *pc, kvt_entry *e, const char *session)
{
    if (!pc)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_put: cache is NULL");
    return put_common(pc, e, session, 0, NULL, UINT64_MAX, 1);
}

KVT_API int kvt_prompt_cache_put_hit(kvt_prompt_cache *pc, kvt_hit *hit, const int32_t *tokens,
                                     int64_t n_tokens, const char *session)
{
    if (!pc || !hit || (!tokens && n_tokens > 0))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_put_hit: cache, hit or tokens is NULL");
    if (hit->entry.n_caches < 1)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_put_hit: the hit lends no caches (a miss, and the "
                         "cache has no new_caches)");
    if (n_tokens < hit->prefix_len || !tokens_equal(tokens, hit->entry.tokens, hit->prefix_len))
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

/* ---- take ------------------------------------------------------------------------- */

static int check_prompt(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns, const void *out,
                        const char *fn)
{
    if (!pc || !out)
        return kvt__fail(KVT_EINVAL, "%s: cache or out is NULL", fn);
    if (n < 0 || (!prompt && n > 0))
        return kvt__fail(KVT_EINVAL, "%s: prompt NULL or negative length %lld", fn, (long long)n);
    return 0;
}

/* Session entry serving the prompt (strict prefix, resident), or NULL. */
static pc_entry *session_entry(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns,
                               const char *session)
{
    if (!session)
        return NULL;
    pc_slot *slot = session_slot(pc, session, ns);
    pc_entry *e = slot ? by_id(pc, slot->id) : NULL;
    if (e && e->n_tokens >= 1 && e->n_tokens < n && tokens_equal(e->tokens, prompt, e->n_tokens))
        return e;
    return NULL;
}

/* Validates and trims a restored entry to p tokens of the prompt.
 * @return 1 usable, 0 not. */
static int restored_usable(kvt_entry *r, const int32_t *prompt, int64_t p)
{
    if (r->n_tokens < p || !tokens_equal(r->tokens, prompt, p))
        return 0;
    for (int32_t i = 0; i < r->n_caches; i++)
        if (!r->caches[i] || kvt_cache_offset(r->caches[i]) != r->n_tokens)
            return 0;
    int64_t reach;
    int trimmable = kvt_entry_trimmable(r, &reach);
    if (r->n_tokens > p && (!trimmable || p < reach))
        return 0; /* untrimmable divergent tail (3.4) */
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
    if (clone_parts(&copy, r->ns, r->tokens, r->n_tokens, r->caches, r->n_caches, r->attachments,
                    r->n_attachments) != 0)
        return;
    /* one hook, two holders: the served views and the promoted entry */
    pc_share *s = share_new(r->hook);
    if (!s) {
        kvt_entry_clear(&copy);
        return;
    }
    r->hook = (kvt_hook){share_run, s};
    copy.hook = share_acquire(s);
    if (put_common(pc, &copy, session, 0, NULL, epoch, 0) == 0) {
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
    if (*se && !(*se = session_entry(pc, prompt, n, ns, session)))
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
    ns = kvt__ns(ns);
    int rc = check_prompt(pc, prompt, n, ns, out, "kvt_prompt_cache_lend");
    if (rc)
        return rc;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&pc->mu);
    if (pc->blocks)
        kvt__pc_blocks_clock(pc->blocks, n); /* one use time per request */
    /* a session hit skips the walk (3.10), never the cold tier (3.4) */
    void *val = NULL;
    pc_entry *se = session_entry(pc, prompt, n, ns, session);
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
        rc = lend_locked(pc, e, p, out);
        if (rc == 0 && se) {
            out->source = KVT_HIT_SESSION;
        } else if (rc == 0) {
            out->source = KVT_HIT_RAM;
            session_associate(pc, session, ns, e);
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
    ns = kvt__ns(ns);
    int rc = check_prompt(pc, tokens, n, ns, out, "kvt_prompt_cache_lend_exact");
    if (rc)
        return rc;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__index_exact(pc->ix, ns, tokens, n);
    if (!e) {
        pthread_mutex_unlock(&pc->mu);
        return kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_lend_exact: no entry of %lld tokens in ns '%s'",
                         (long long)n, ns);
    }
    rc = lend_locked(pc, e, n, out);
    if (rc == 0)
        out->source = KVT_HIT_RAM;
    pthread_mutex_unlock(&pc->mu);
    return rc;
}

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
static int trim_locked(kvt_prompt_cache *pc, pc_entry *e, int64_t new_len, pc_entry **gone)
{
    int rc = 0;
    pc->gen++;
    kvt__index_remove(pc->ix, e->ns, e->tokens, e->n_tokens);
    account_remove(pc, e);
    for (int32_t i = 0; i < e->n_caches && rc == 0; i++)
        rc = kvt_cache_trim(e->caches[i], new_len);
    e->n_tokens = new_len;
    size_t standalone;
    int accounted = 0;
    if (rc == 0)
        rc = entry_measure(e, &standalone);
    if (rc == 0)
        accounted = (rc = account_add(pc, e)) == 0;
    void *replaced = NULL;
    if (rc == 0)
        rc = kvt__index_insert(pc->ix, e->ns, e->tokens, e->n_tokens, e, e->trimmable, e->reach, &replaced);
    if (rc) {
        /* layers may disagree now: the entry cannot stay. Unless its budget
         * share was added back, it is already removed: unlink without
         * removing it twice */
        if (!accounted) {
            e->n_bufs = 0;
            e->private_bytes = 0;
        }
        entry_unlink(pc, e, 0, gone);
        return rc;
    }
    blocks_after_trim(pc, e);
    if (replaced && replaced != e) {
        entry_follow(pc, replaced, e);
        entry_unlink(pc, replaced, 0, gone);
        pc->st.replacements++;
    }
    return 0;
}

/* ---- trim in place ---------------------------------------------------------------- */

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
    rc = trim_locked(pc, e, new_len, &gone);
out:
    pthread_mutex_unlock(&pc->mu);
    gone_process(pc, gone);
    return rc;
}

/* ---- budget, eviction, pressure ---------------------------------------------------- */

KVT_API int kvt_prompt_cache_set_max_bytes(kvt_prompt_cache *pc, size_t max_bytes)
{
    if (!pc)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_set_max_bytes: cache is NULL");
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    pc->max_bytes = max_bytes;
    evict(pc, -1, &gone);
    pthread_mutex_unlock(&pc->mu);
    gone_process(pc, gone);
    return 0;
}

KVT_API int kvt_prompt_cache_evict(kvt_prompt_cache *pc, int64_t count, int64_t *n_out)
{
    if (!pc || count < 0)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_evict: cache NULL or negative count");
    pc_entry *gone = NULL;
    pthread_mutex_lock(&pc->mu);
    int64_t n = evict(pc, count, &gone);
    pthread_mutex_unlock(&pc->mu);
    gone_process(pc, gone);
    if (n_out)
        *n_out = n;
    return 0;
}

/* Unlinks and disposes v at once, under the lock (relieve and reclaim: the
 * next pressure check must see the memory freed); no spill. */
static void demote_now(kvt_prompt_cache *pc, pc_entry *v)
{
    pc_entry *gone = NULL;
    entry_unlink(pc, v, 0, &gone);
    entry_dispose(v);
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
    int check = pc->has_cold && write_behind_on(pc);
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
            rc = clone_parts(&views, v->ns, v->tokens, v->n_tokens, v->caches, v->n_caches, v->atts, v->n_atts);
            if (rc) {
                kvt__fail(rc, "kvt_prompt_cache_relieve: out of memory for the views of %lld tokens; kept",
                          (long long)v->n_tokens);
                break;
            }
            views.hook = share_acquire(v->share);
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
            v = by_id(pc, id);
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
        if (clone_parts(&j->copy, e->ns, e->tokens, e->n_tokens, e->caches, e->n_caches, e->atts, e->n_atts) != 0)
            break;
        j->copy.hook = share_acquire(e->share);
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
        if (tier_pending(pc, ns, j->copy.tokens, j->n_tokens))
            j->leave = 0; /* a pending write is not a copy: keep it for now */
        else if (tier_has(pc, ns, j->copy.tokens, j->n_tokens))
            j->leave = 1;
        else if (pc->cold.store(pc->cold.self, &j->copy) == 0)
            j->leave = 2;
        /* else: a failed write is never a demotion */
        kvt_entry_clear(&j->copy);
    }
    /* drop what is durable now, if it is still there unchanged and unpinned */
    pthread_mutex_lock(&pc->mu);
    for (size_t i = 0; i < n_jobs; i++) {
        pc_entry *e = jobs[i].leave ? by_id(pc, jobs[i].id) : NULL;
        if (!e || e->pins > 0 || e->n_tokens != jobs[i].n_tokens || e->wb == PC_WB_QUEUING)
            continue;
        entry_unlink(pc, e, 0, &gone);
        pc->st.demotions++;
        if (jobs[i].leave == 1)
            pc->st.durable_evictions++;
        n++;
    }
    pthread_mutex_unlock(&pc->mu);
    kvt__free(jobs);
    gone_process(pc, gone);
    if (n_out)
        *n_out = n;
    return 0;
}

/* ---- sessions, pins ------------------------------------------------------------------ */

KVT_API void kvt_prompt_cache_close_session(kvt_prompt_cache *pc, const char *session)
{
    if (!pc || !session)
        return;
    pthread_mutex_lock(&pc->mu);
    pc_session *s = kvt__smap_del(&pc->sessions, session);
    if (s)
        session_release_slots(pc, s);
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
    pc_entry *e = by_id(pc, id);
    for (int hops = 0; !e && hops < 64; hops++) {
        uint64_t *f = kvt__umap_get(&pc->forward, id);
        if (!f)
            break;
        id = *f;
        e = by_id(pc, id);
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
    int rc = check_prompt(pc, tokens, n, ns, out, "kvt_prompt_cache_pin");
    if (rc)
        return rc;
    *out = NULL;
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
    int rc = status ? status : entry_prepare(pc, &mine, &x, &standalone);
    pc_entry *gone = NULL;
    int adopted = 0;
    pthread_mutex_lock(&pc->mu);
    if (rc == 0 && r->epoch != pc->epoch) {
        rc = KVT_ESTALE; /* a clear ran during the read (3.11) */
        pc->st.prefetch_discarded++;
    }
    if (rc == 0) {
        rc = insert_locked(pc, x, standalone, r->session, r->interest, &gone, NULL, 0);
        if (rc == 0) {
            adopted = 1;
            r->entry_id = x->id;
            evict(pc, -1, &gone); /* x may leave from here on */
        }
    }
    r->status = rc;
    r->done = 1;
    pthread_cond_broadcast(&pc->cv);
    pthread_mutex_unlock(&pc->mu);
    if (adopted)
        adopt_parts(&mine);
    else
        entry_discard(x);
    kvt_entry_clear(&mine);
    gone_process(pc, gone);
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
    int rc = check_prompt(pc, prompt, n, ns, out, "kvt_prompt_cache_prefetch");
    if (rc)
        return rc;
    *out = NULL;
    kvt_lease *l;
    if ((rc = lease_new(pc, &l)) != 0)
        return rc;
    /* the cold tier first, without the lock (a lookup may block on I/O);
     * every RAM decision below is then made under the lock at once */
    kvt_cold_hit ch;
    void *val;
    int cold = pc->has_cold && pc->cold.find(pc->cold.self, prompt, n, ns, &ch) == 0;
    pthread_mutex_lock(&pc->mu);
    pc_entry *se = session_entry(pc, prompt, n, ns, session);
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
    evict(pc, -1, &gone);
    pthread_mutex_unlock(&pc->mu);
    kvt__free(lease);
    gone_process(pc, gone);
}

/* ---- objects --------------------------------------------------------------------------- */

static char *object_ns(const char *key)
{
    size_t n = strlen(key);
    char *ns = kvt__malloc(n + 8);
    if (ns) {
        memcpy(ns, "object:", 7);
        memcpy(ns + 7, key, n + 1);
    }
    return ns;
}

KVT_API int kvt_prompt_cache_object_put(kvt_prompt_cache *pc, const char *key, kvt_attachment **attachments,
                                        int32_t n_attachments, kvt_hook *hook)
{
    if (!pc || !key || !*key || n_attachments < 0 || (n_attachments && !attachments))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_object_put: bad arguments (key empty or NULL?)");
    char *ns = object_ns(key);
    if (!ns)
        return kvt__fail(KVT_ENOMEM, "kvt_prompt_cache_object_put: out of memory");
    kvt_entry e = {ns, NULL, 0, NULL, 0, attachments, n_attachments, hook ? *hook : (kvt_hook){NULL, NULL}};
    int rc = put_common(pc, &e, NULL, 0, NULL, UINT64_MAX, 1);
    if (rc == 0 && hook)
        *hook = (kvt_hook){NULL, NULL};
    kvt__free(ns);
    return rc;
}

KVT_API int kvt_prompt_cache_object_lend(kvt_prompt_cache *pc, const char *key, kvt_hit *out)
{
    if (!pc || !key || !*key || !out)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_object_lend: bad arguments");
    memset(out, 0, sizeof *out);
    char *ns = object_ns(key);
    if (!ns)
        return kvt__fail(KVT_ENOMEM, "kvt_prompt_cache_object_lend: out of memory");
    int rc;
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__index_exact(pc->ix, ns, NULL, 0);
    if (e) {
        pc->st.object_hits++;
        rc = lend_locked(pc, e, 0, out);
        if (rc == 0)
            out->source = KVT_HIT_RAM;
        pthread_mutex_unlock(&pc->mu);
        kvt__free(ns);
        return rc;
    }
    pc->st.object_misses++;
    uint64_t epoch = pc->epoch;
    pthread_mutex_unlock(&pc->mu);
    /* the cold tier is asked without the lock (a lookup may block on I/O);
     * a clear meanwhile makes the publication below refuse (epoch) */
    kvt_cold_hit ch;
    if (!pc->has_cold || !pc->cold.find_exact || pc->cold.find_exact(pc->cold.self, NULL, 0, ns, &ch) != 0) {
        rc = kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_object_lend: no object '%s' in any tier", key);
        kvt__free(ns);
        return rc;
    }
    kvt_entry r;
    memset(&r, 0, sizeof r);
    rc = pc->cold.restore(pc->cold.self, ch.handle, &r);
    if (rc) {
        kvt__free(ns);
        return kvt__fail(rc, "kvt_prompt_cache_object_lend: restoring '%s' failed (%s)", key, kvt_strerror(rc));
    }
    pthread_mutex_lock(&pc->mu);
    pc->st.object_restores++;
    pthread_mutex_unlock(&pc->mu);
    /* publish (if another request published it meanwhile, this equal-key
     * copy replaces it: the same immutable object), then lend from RAM */
    kvt__free((void *)r.ns);
    r.ns = ns; /* freed by kvt_entry_clear below */
    rc = put_common(pc, &r, NULL, 0, NULL, epoch, 0);
    if (rc == 0) {
        pthread_mutex_lock(&pc->mu);
        e = kvt__index_exact(pc->ix, ns, NULL, 0);
        rc = e ? lend_locked(pc, e, 0, out)
               : kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_object_lend: '%s' did not fit the budget", key);
        if (rc == 0)
            out->source = KVT_HIT_COLD;
        pthread_mutex_unlock(&pc->mu);
    }
    kvt_entry_clear(&r);
    return rc;
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
    gone_process(pc, gone);
}

KVT_API void kvt_prompt_cache_get_stats(kvt_prompt_cache *pc, kvt_prompt_cache_stats *out)
{
    if (!pc || !out)
        return;
    pthread_mutex_lock(&pc->mu);
    *out = pc->st;
    out->pinned = pc->pinned;
    out->bytes = total_bytes(pc);
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
    pc_entry *e = by_id(pc, id);
    if (e) {
        *sessions = e->sessions;
        *pins = e->pins;
        *n_bufs = e->n_bufs;
        *private_bytes = e->private_bytes;
    }
    pthread_mutex_unlock(&pc->mu);
    return e ? 0 : KVT_ENOTFOUND;
}
