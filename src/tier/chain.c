/*
 * chain.c: kvt_tier_chain (kvtier/tier_chain.h), N cold tiers composed into
 * one kvt_cold_tier: ordered lookup with the strictly-longer rule between
 * levels, restore with write-behind promotion upward, writes to the first
 * writable level, demotion of evictions downward, per-level lookup budgets.
 *
 * Owns: the copied level tables, a bounded FIFO queue of promotion/demotion
 * writes drained by one background write operation at a time on the
 * process's I/O worker (kvtier/io.h: the writes of a chain run in queue
 * order, one after the other, never on a private thread), the budgeted
 * lookups (each a foreground find operation on the same worker, waited for
 * at most the level's budget), and the chain's per-level counters. It starts
 * no thread. Locks: c->mu guards the write queue, the counts of find
 * operations and the counters (lock order: c->mu, then the worker's). No
 * level's table is ever called with it held, so a slow or blocking level
 * never holds up another thread's bookkeeping. Never calls back into the chain's caller.
 */
#include "kvtier/tier_chain.h"

#include "kvtier/io.h"

#include "internal.h"
#include "tier_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define LEVEL_SHIFT 60
#define INNER_MASK ((UINT64_C(1) << LEVEL_SHIFT) - 1)
#define LOOKUP_WAITING_MAX 4
#define WRITES_PER_RUN 16 /* writes one drain operation does before it queues the next */

enum { OP_FIND, OP_FIND_EXACT };
enum { W_PROMOTE, W_DEMOTE, W_SPILL };

typedef struct kvt_tier_chain kvt_tier_chain;

/* ---- lookups with a time budget ----------------------------------------------------- */

struct level;

/* One budgeted find: a foreground find operation on the I/O worker. The
 * task is the operation's: its free_fn (find_free) runs once the level's
 * find returned and no ticket holds it, or at once when the waiter gave up
 * before it started (discarded unrun). It holds its own copy of the prompt,
 * so a waiter that gave up never frees what the find still reads. */
typedef struct find_task {
    struct level *l;
    int op;          /* OP_FIND / OP_FIND_EXACT */
    int rc;          /* the level's answer (0 or KVT_ENOTFOUND) */
    kvt_cold_hit hit;
    char *ns;        /* points past tokens */
    int64_t n;
    int32_t tokens[]; /* (n) the prompt, then ns and its NUL */
} find_task;

typedef struct level {
    kvt_tier_chain *chain;
    int index;
    char name[KVT_TIER_NAME_MAX];
    kvt_cold_tier t;
    int32_t budget_ms;
    uint32_t flags;
    int writable;
    int hooked;            /* its eviction hook points at the chain */
    int finds_live;        /* its find operations not yet freed (queued, running, or a late answer); under chain->mu */
    kvt_tier_stats st;     /* the chain's view, under chain->mu */
} level;

/* A promotion, demotion or write-behind spill waiting in the write queue. */
typedef struct wjob {
    struct wjob *next;
    int level;             /* the level written into */
    int from;              /* the level it came from (demotions) */
    int kind;              /* W_PROMOTE / W_DEMOTE / W_SPILL */
    kvt_entry e;           /* owned */
} wjob;

struct kvt_tier_chain {
    level lv[KVT_TIER_CHAIN_MAX];
    int n;
    pthread_mutex_t mu;
    pthread_cond_t idle;   /* drain: queue empty and no drain operation; destroy: no find operation left */
    wjob *head, *tail;
    int queued, cap;
    int writing;           /* a drain operation is inside a level's table */
    int scheduled;         /* a drain operation is queued or running on the worker */
    int stop;
    uint64_t seq;          /* drain operations submitted (their keys) */
    uint64_t find_seq;     /* find operations submitted (their keys) */
    int finds_live;        /* find operations of every level not yet freed */
    kvt_io *io;            /* the process's default I/O worker (a reference) */
};

static void count(kvt_tier_chain *c, int lvl, size_t field_offset, uint64_t by)
{
    pthread_mutex_lock(&c->mu);
    *(uint64_t *)((char *)&c->lv[lvl].st + field_offset) += by;
    pthread_mutex_unlock(&c->mu);
}
#define COUNT(c, lvl, field) count((c), (lvl), offsetof(kvt_tier_stats, field), 1)

/* The level's find on an I/O worker thread. A miss is an answer (0, with
 * rc KVT_ENOTFOUND); only the level's errors are the operation's. */
static int find_run(void *task, void **result)
{
    find_task *t = task;
    const kvt_cold_tier *lt = &t->l->t;
    kvt_cold_hit hit = {0};
    int rc;
    if (t->op == OP_FIND)
        rc = lt->find(lt->self, t->tokens, t->n, t->ns, &hit);
    else
        rc = lt->find_exact ? lt->find_exact(lt->self, t->tokens, t->n, t->ns, &hit) : KVT_ENOTFOUND;
    t->rc = rc;
    t->hit = hit;
    *result = t;
    return rc == KVT_ENOTFOUND ? 0 : rc;
}

/* Frees a find task; the last one wakes a destroy waiting for them. */
static void find_free(void *task, void *result)
{
    (void)result;
    find_task *t = task;
    level *l = t->l;
    kvt_tier_chain *c = l->chain;
    kvt__free(t);
    pthread_mutex_lock(&c->mu);
    l->finds_live--;
    if (--c->finds_live == 0)
        pthread_cond_broadcast(&c->idle);
    pthread_mutex_unlock(&c->mu); /* c is not touched after this: destroy may free it */
}

/* Asks level l for (op, tokens, ns) within its budget: a foreground find
 * operation on the I/O worker (a request waits for it, so it starts before
 * write-behind), waited for at most budget_ms. A late answer is
 * KVT_ENOTFOUND for this caller (counted in finds_over_budget): the ticket
 * is released, so the operation is discarded unrun if it has not started,
 * and its answer is discarded when it arrives if it has. So is a find the
 * worker refuses (its queue is full), and one beyond the level's
 * LOOKUP_WAITING_MAX finds still on the worker. */
static int budgeted_lookup(level *l, int op, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_tier_chain *c = l->chain;
    size_t ns_len = strlen(ns);
    find_task *t = kvt__malloc(sizeof *t + (size_t)n * sizeof(int32_t) + ns_len + 1);
    if (!t)
        return KVT_ENOMEM;
    memset(t, 0, sizeof *t);
    t->l = l;
    t->op = op;
    t->n = n;
    if (n)
        memcpy(t->tokens, tokens, (size_t)n * sizeof(int32_t));
    t->ns = (char *)(t->tokens + n);
    memcpy(t->ns, ns, ns_len + 1);
    pthread_mutex_lock(&c->mu);
    if (l->finds_live >= LOOKUP_WAITING_MAX) {
        l->st.finds_over_budget++;
        pthread_mutex_unlock(&c->mu);
        kvt__free(t);
        return KVT_ENOTFOUND;
    }
    l->finds_live++;
    c->finds_live++;
    uint64_t seq = ++c->find_seq;
    pthread_mutex_unlock(&c->mu);
    /* a key of its own: a find answers for the moment it was asked, never
     * with the answer of an earlier find still running */
    kvt_io_op o = {.kind = KVT_IO_KIND_FIND,
                   .key = {(uint64_t)(uintptr_t)l ^ UINT64_C(0x66696e64c2b2ae3d), seq ^ UINT64_C(0x1f83d9ab00000000)},
                   .priority = KVT_IO_FOREGROUND,
                   .run = find_run,
                   .free_fn = find_free,
                   .task = t};
    kvt_io_ticket *tk = NULL;
    int rc = kvt_io_submit(c->io, &o, &tk);
    if (rc) { /* refused: the task stays with this thread */
        find_free(t, NULL);
        COUNT(c, l->index, finds_over_budget);
        return KVT_ENOTFOUND;
    }
    kvt_io_disposition d = KVT_IO_DISCARD;
    void *res = NULL;
    rc = kvt_io_wait(tk, (uint64_t)l->budget_ms, &d, &res);
    kvt_cold_hit hit = {0};
    if (rc == 0 && d == KVT_IO_PUBLISH && res) {
        const find_task *r = res;
        rc = r->rc;
        hit = r->hit;
    }
    kvt_io_ticket_release(tk); /* a late answer is discarded: now, or when it arrives */
    if (rc == KVT_EAGAIN) {
        COUNT(c, l->index, finds_over_budget);
        return KVT_ENOTFOUND;
    }
    if (rc == KVT_ECLOSED)
        return KVT_ENOTFOUND;
    if (rc == 0)
        *out = hit;
    return rc;
}

static int level_lookup(level *l, int op, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    if (l->budget_ms > 0)
        return budgeted_lookup(l, op, tokens, n, ns, out);
    if (op == OP_FIND)
        return l->t.find(l->t.self, tokens, n, ns, out);
    return l->t.find_exact ? l->t.find_exact(l->t.self, tokens, n, ns, out) : KVT_ENOTFOUND;
}

/* ---- entries shared between the caller and the write queue ------------------------- */

/* Makes *copy a kvtier-allocated entry holding zero-copy clones of e's caches and
 * attachments. e's hook (if any) becomes shared by e and the copy. */
static int entry_share(kvt_entry *e, kvt_entry *copy)
{
    int rc = kvt_entry_init(copy, e->ns, e->tokens, e->n_tokens, e->n_caches, e->n_attachments);
    if (rc)
        return rc;
    rc = e->n_caches ? kvt_caches_clone(e->caches, e->n_caches, copy->caches) : 0;
    for (int32_t i = 0; rc == 0 && i < e->n_attachments; i++)
        rc = kvt_attachment_clone(e->attachments[i], &copy->attachments[i]);
    if (rc == 0)
        rc = kvt__hook_share(&e->hook, &copy->hook);
    if (rc)
        kvt_entry_clear(copy);
    return rc;
}

/* ---- the write queue (drained on the I/O worker) ----------------------------------- */

static int drain_run(void *task, void **result);

/* Submits the chain's next drain operation (c->mu held: the worker accepts
 * or refuses it before another write is queued). Its key is unique, so it
 * never joins an earlier drain that is about to return. */
static int submit_drain(kvt_tier_chain *c)
{
    kvt_io_op op = {.kind = KVT_IO_KIND_WRITE,
                    .key = {(uint64_t)(uintptr_t)c ^ UINT64_C(0x63686169e3779b97), ++c->seq ^ UINT64_C(0x7432c4a1d0000000)},
                    .priority = KVT_IO_BACKGROUND,
                    .run = drain_run,
                    .task = c};
    return kvt_io_submit(c->io, &op, NULL);
}

/* Queues a kvtier-allocated entry for the write queue; ownership passes on
 * 0. KVT_EAGAIN when the queue holds cap writes or the chain is stopping;
 * the I/O worker's error when it cannot take a drain operation (its queue
 * is full or it is shutting down): the write is not queued. */
static int enqueue_write(kvt_tier_chain *c, int lvl, int from, int kind, kvt_entry *e)
{
    wjob *j = kvt__malloc(sizeof *j);
    if (!j)
        return KVT_ENOMEM;
    pthread_mutex_lock(&c->mu);
    if (c->queued >= c->cap || c->stop) {
        pthread_mutex_unlock(&c->mu);
        kvt__free(j);
        return KVT_EAGAIN;
    }
    if (!c->scheduled) {
        int rc = submit_drain(c);
        if (rc) {
            pthread_mutex_unlock(&c->mu);
            kvt__free(j);
            return rc;
        }
        c->scheduled = 1;
    }
    *j = (wjob){NULL, lvl, from, kind, *e};
    memset(e, 0, sizeof *e);
    if (c->tail)
        c->tail->next = j;
    else
        c->head = j;
    c->tail = j;
    c->queued++;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Writes j->e into its level (spill when the level has it, else store);
 * consumes the entry. @return 0 when the level took it. */
static int write_entry(level *l, kvt_entry *e)
{
    int rc;
    if (l->t.spill) {
        rc = l->t.spill(l->t.self, e);
        if (rc == 0)
            return 0; /* the level owns it now */
    } else {
        rc = l->t.store(l->t.self, e);
    }
    kvt_entry_clear(e);
    return rc;
}

/* Whether level l already holds e, or has its write queued: a demotion of
 * it is not written again (a write-behind level got every kept prefix when
 * it was put; a restored entry was promoted from there). Asks the level
 * (may block on I/O: runs in a drain operation, within the level's lookup
 * budget). A budgeted level's find is then an operation of the same worker
 * waited for from one of its threads: the wait is timed, so with every
 * other thread busy it is a miss after the budget (the demotion is
 * written), never a wait on a queue nobody serves. */
static int level_holds(level *l, const kvt_entry *e)
{
    if (l->t.pending && l->t.pending(l->t.self, e->tokens, e->n_tokens, e->ns))
        return 1;
    kvt_cold_hit h;
    return level_lookup(l, OP_FIND_EXACT, e->tokens, e->n_tokens, e->ns, &h) == 0;
}

/* The drain operation (on an I/O worker thread): writes the queued jobs in
 * order, WRITES_PER_RUN at most, then queues the next drain operation when
 * jobs are left (so other background I/O gets its turn) or clears
 * c->scheduled and wakes kvt_tier_chain_drain. Never touches c after its
 * last unlock (the chain may be destroyed then). */
static int drain_run(void *task, void **result)
{
    kvt_tier_chain *c = task;
    (void)result;
    pthread_mutex_lock(&c->mu);
    for (int done = 0;; done++) {
        if (c->head && done >= WRITES_PER_RUN && submit_drain(c) == 0)
            break; /* the next operation goes on; if the worker refused it, this one does */
        if (!c->head) {
            c->scheduled = 0;
            pthread_cond_broadcast(&c->idle);
            break;
        }
        wjob *j = c->head;
        c->head = j->next;
        if (!c->head)
            c->tail = NULL;
        c->queued--;
        c->writing = 1;
        pthread_mutex_unlock(&c->mu);
        int held = j->kind == W_DEMOTE && level_holds(&c->lv[j->level], &j->e);
        int rc = 0;
        if (held)
            kvt_entry_clear(&j->e);
        else
            rc = write_entry(&c->lv[j->level], &j->e);
        pthread_mutex_lock(&c->mu);
        kvt_tier_stats *to = &c->lv[j->level].st;
        if (held) {
            c->lv[j->from].st.demotions_skipped++;
        } else if (rc == 0) {
            to->stores++;
            if (j->kind == W_PROMOTE)
                to->promotions++;
            if (j->kind == W_DEMOTE)
                c->lv[j->from].st.demotions++;
        } else {
            to->write_failures++;
            if (j->kind == W_PROMOTE)
                to->promotions_dropped++;
            if (j->kind == W_DEMOTE)
                c->lv[j->from].st.demotions_dropped++;
        }
        c->writing = 0;
        kvt__free(j);
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Queues a zero-copy copy of e for every writable level above `from` that
 * takes promotions. e's hook becomes shared with the copies. */
static void promote(kvt_tier_chain *c, int from, kvt_entry *e)
{
    for (int i = 0; i < from; i++) {
        level *l = &c->lv[i];
        if (!l->writable || (l->flags & KVT_LEVEL_NO_PROMOTE))
            continue;
        kvt_entry copy;
        if (entry_share(e, &copy) != 0) {
            COUNT(c, i, promotions_dropped);
            continue;
        }
        if (enqueue_write(c, i, from, W_PROMOTE, &copy) != 0) {
            kvt_entry_clear(&copy);
            COUNT(c, i, promotions_dropped);
        }
    }
}

/* The eviction hook of a demoting level: queue e for the next writable
 * level below. Ownership passes on 0. */
static int evict_hook(void *arg, kvt_entry *e)
{
    level *l = arg;
    kvt_tier_chain *c = l->chain;
    COUNT(c, l->index, evictions);
    for (int i = l->index + 1; i < c->n; i++)
        if (c->lv[i].writable) {
            int rc = enqueue_write(c, i, l->index, W_DEMOTE, e);
            if (rc)
                COUNT(c, l->index, demotions_dropped); /* the tier deletes it as without a hook */
            return rc;
        }
    return KVT_ENOTFOUND;
}

/* ---- the chain's kvt_cold_tier table ----------------------------------------------- */

static int ch_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_tier_chain *c = self;
    int found = 0;
    kvt_cold_hit best = {0};
    for (int i = 0; i < c->n; i++) {
        if (found && best.prefix_len >= n - 1)
            break; /* no lower level can be strictly longer */
        kvt_cold_hit h = {0};
        int rc = level_lookup(&c->lv[i], OP_FIND, prompt, n, ns, &h);
        COUNT(c, i, finds);
        if (rc != 0 || h.prefix_len <= 0 || h.handle > INNER_MASK)
            continue;
        COUNT(c, i, find_hits);
        if (!found || h.prefix_len > best.prefix_len) {
            best = h;
            best.handle = h.handle | ((uint64_t)i << LEVEL_SHIFT);
            found = 1;
        }
    }
    if (!found)
        return KVT_ENOTFOUND;
    *out = best;
    return 0;
}

static int ch_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_tier_chain *c = self;
    for (int i = 0; i < c->n; i++) {
        kvt_cold_hit h = {0};
        int rc = level_lookup(&c->lv[i], OP_FIND_EXACT, tokens, n, ns, &h);
        if (rc == 0 && h.handle <= INNER_MASK) {
            *out = h;
            out->handle |= (uint64_t)i << LEVEL_SHIFT;
            return 0;
        }
    }
    return KVT_ENOTFOUND;
}

static int handle_level(kvt_tier_chain *c, uint64_t handle, uint64_t *inner)
{
    int lvl = (int)(handle >> LEVEL_SHIFT);
    *inner = handle & INNER_MASK;
    return lvl < c->n ? lvl : -1;
}

static int ch_restore(void *self, uint64_t handle, kvt_entry *out)
{
    kvt_tier_chain *c = self;
    uint64_t inner;
    int lvl = handle_level(c, handle, &inner);
    if (lvl < 0) {
        memset(out, 0, sizeof *out);
        return kvt__fail(KVT_ENOTFOUND, "tier chain restore: handle %llu names no level",
                         (unsigned long long)handle);
    }
    int rc = c->lv[lvl].t.restore(c->lv[lvl].t.self, inner, out);
    if (rc != 0) {
        COUNT(c, lvl, restore_failures);
        return rc;
    }
    COUNT(c, lvl, restores);
    promote(c, lvl, out);
    return 0;
}

typedef struct async_ctx {
    kvt_tier_chain *c;
    int lvl;
    kvt_restore_done_fn done;
    void *arg;
} async_ctx;

static void ch_async_done(void *arg, int status, kvt_entry *entry)
{
    async_ctx *a = arg;
    if (status == 0) {
        COUNT(a->c, a->lvl, restores);
        promote(a->c, a->lvl, entry);
    } else {
        COUNT(a->c, a->lvl, restore_failures);
    }
    kvt_restore_done_fn done = a->done;
    void *done_arg = a->arg;
    kvt__free(a);
    done(done_arg, status, entry);
}

static int ch_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    kvt_tier_chain *c = self;
    uint64_t inner;
    int lvl = handle_level(c, handle, &inner);
    if (lvl < 0)
        return kvt__fail(KVT_ENOTFOUND, "tier chain restore: handle %llu names no level",
                         (unsigned long long)handle);
    level *l = &c->lv[lvl];
    if (!l->t.restore_async) {
        /* the level reads synchronously: done runs inline, as tier.h allows */
        kvt_entry e;
        int rc = ch_restore(c, handle, &e);
        done(arg, rc, rc == 0 ? &e : NULL);
        if (rc == 0)
            kvt_entry_clear(&e); /* no-op if done moved it out */
        return 0;
    }
    async_ctx *a = kvt__malloc(sizeof *a);
    if (!a)
        return KVT_ENOMEM;
    *a = (async_ctx){c, lvl, done, arg};
    int rc = l->t.restore_async(l->t.self, inner, ch_async_done, a);
    if (rc != 0)
        kvt__free(a);
    return rc;
}

static level *first_writable(kvt_tier_chain *c)
{
    for (int i = 0; i < c->n; i++)
        if (c->lv[i].writable)
            return &c->lv[i];
    return NULL;
}

/* Hands a zero-copy copy of e to every write-behind level other than
 * `primary` (KVT_LEVEL_WRITE_BEHIND): its spill queues it and returns. e's
 * hook becomes shared with the copies. A copy a level refuses is dropped
 * and counted. */
static void write_behind(kvt_tier_chain *c, const level *primary, kvt_entry *e)
{
    for (int i = 0; i < c->n; i++) {
        level *l = &c->lv[i];
        if (l == primary || !l->writable || !(l->flags & KVT_LEVEL_WRITE_BEHIND) || !l->t.spill)
            continue;
        kvt_entry copy;
        int rc = entry_share(e, &copy);
        if (rc == 0 && (rc = l->t.spill(l->t.self, &copy)) != 0)
            kvt_entry_clear(&copy);
        if (rc == 0)
            COUNT(c, i, stores);
        else
            COUNT(c, i, write_failures);
    }
}

static int ch_store(void *self, const kvt_entry *e)
{
    kvt_tier_chain *c = self;
    level *l = first_writable(c);
    if (!l)
        return kvt__fail(KVT_EREADONLY, "tier chain store: every level is read-only");
    write_behind(c, l, (kvt_entry *)e);
    if (!l->t.store) {
        /* a spill-only level: write behind, then wait for it */
        kvt_entry copy;
        int rc = entry_share((kvt_entry *)e, &copy);
        if (rc == 0 && (rc = l->t.spill(l->t.self, &copy)) != 0)
            kvt_entry_clear(&copy);
        if (rc == 0 && l->t.flush)
            rc = l->t.flush(l->t.self);
        COUNT(c, l->index, stores);
        return rc;
    }
    int rc = l->t.store(l->t.self, e);
    if (rc == 0)
        COUNT(c, l->index, stores);
    else
        COUNT(c, l->index, write_failures);
    return rc;
}

static int ch_spill(void *self, kvt_entry *e)
{
    kvt_tier_chain *c = self;
    level *l = first_writable(c);
    if (!l)
        return kvt__fail(KVT_EREADONLY, "tier chain spill: every level is read-only");
    write_behind(c, l, e);
    if (!l->t.spill) /* a store-only level: a drain operation on the I/O worker stores it */
        return enqueue_write(c, l->index, l->index, W_SPILL, e);
    int rc = l->t.spill(l->t.self, e);
    if (rc == 0)
        COUNT(c, l->index, stores);
    else
        COUNT(c, l->index, write_failures);
    return rc;
}

static int same_entry(const kvt_entry *e, const int32_t *tokens, int64_t n, const char *ns)
{
    return e->n_tokens == n && strcmp(e->ns, ns) == 0 &&
           (n == 0 || memcmp(e->tokens, tokens, (size_t)n * sizeof(int32_t)) == 0);
}

static int ch_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_tier_chain *c = self;
    pthread_mutex_lock(&c->mu);
    int queued = c->queued > 0 || c->writing;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->n; i++)
        if (c->lv[i].t.pending && c->lv[i].t.pending(c->lv[i].t.self, tokens, n, ns))
            return 1;
    if (!queued)
        return 0;
    /* a write-behind spill still in the chain's own queue */
    pthread_mutex_lock(&c->mu);
    int p = 0;
    for (wjob *j = c->head; j && !p; j = j->next)
        p = j->kind == W_SPILL && same_entry(&j->e, tokens, n, ns);
    pthread_mutex_unlock(&c->mu);
    return p;
}

/* Withdraws a write-behind spill still in the chain's queue, else asks the
 * first writable level (where spills go) to withdraw it. */
static int ch_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_tier_chain *c = self;
    wjob *found = NULL;
    pthread_mutex_lock(&c->mu);
    for (wjob **pp = &c->head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        wjob *j = *pp;
        if (j->kind == W_SPILL && same_entry(&j->e, tokens, n, ns)) {
            *pp = j->next;
            if (c->tail == j)
                c->tail = prev;
            c->queued--;
            found = j;
            break;
        }
    }
    if (found && !c->head)
        pthread_cond_broadcast(&c->idle);
    pthread_mutex_unlock(&c->mu);
    if (found) {
        kvt_entry_clear(&found->e);
        kvt__free(found);
        return 0;
    }
    level *l = first_writable(c);
    if (l && l->t.withdraw)
        return l->t.withdraw(l->t.self, tokens, n, ns);
    return KVT_ENOTFOUND;
}

KVT_API int kvt_tier_chain_drain(kvt_tier_chain *c)
{
    if (!c)
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_drain: chain is NULL");
    pthread_mutex_lock(&c->mu);
    while (c->head || c->writing || c->scheduled)
        pthread_cond_wait(&c->idle, &c->mu);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

static int ch_flush(void *self)
{
    kvt_tier_chain *c = self;
    kvt_tier_chain_drain(c);
    int first = 0;
    for (int i = 0; i < c->n; i++) {
        if (!c->lv[i].t.flush)
            continue;
        int rc = c->lv[i].t.flush(c->lv[i].t.self);
        if (rc && !first)
            first = rc;
    }
    return first;
}

KVT_API int32_t kvt_tier_chain_levels(const kvt_tier_chain *c) { return c ? c->n : 0; }

KVT_API int kvt_tier_chain_level_stats(kvt_tier_chain *c, int32_t lvl, kvt_tier_stats *out)
{
    if (!c || !out)
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_level_stats: %s is NULL", c ? "out" : "chain");
    if (lvl < 0 || lvl >= c->n)
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_level_stats: level %d outside 0..%d", (int)lvl, c->n - 1);
    kvt_tier_stats own = {0};
    if (c->lv[lvl].t.stats)
        c->lv[lvl].t.stats(c->lv[lvl].t.self, &own);
    pthread_mutex_lock(&c->mu);
    *out = c->lv[lvl].st;
    pthread_mutex_unlock(&c->mu);
    /* what only the level sees: its gauges, and the write-behind writes it
     * accepted (spill returned 0) that failed or that it dropped later */
    out->entries = own.entries;
    out->bytes = own.bytes;
    out->behind_failures = own.behind_failures;
    out->behind_dropped = own.behind_dropped;
    return 0;
}

KVT_API int kvt_tier_chain_level_layer_bytes(kvt_tier_chain *c, int32_t lvl, int32_t n_layers, uint64_t *bytes)
{
    if (!c || (n_layers > 0 && !bytes))
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_level_layer_bytes: %s is NULL", c ? "bytes" : "chain");
    if (lvl < 0 || lvl >= c->n)
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_level_layer_bytes: level %d outside 0..%d", (int)lvl, c->n - 1);
    const kvt_cold_tier *t = &c->lv[lvl].t;
    return t->layer_bytes && n_layers > 0 ? t->layer_bytes(t->self, n_layers, bytes) : 0;
}

KVT_API const char *kvt_tier_chain_level_name(const kvt_tier_chain *c, int32_t lvl)
{
    return c && lvl >= 0 && lvl < c->n ? c->lv[lvl].name : NULL;
}

static int ch_stats(void *self, kvt_tier_stats *out)
{
    kvt_tier_chain *c = self;
    memset(out, 0, sizeof *out);
    for (int i = 0; i < c->n; i++) {
        kvt_tier_stats s;
        kvt_tier_chain_level_stats(c, i, &s);
#define KVT__TIER_ADD(name, kind, help) out->name += s.name;
        KVT_TIER_COUNTERS(KVT__TIER_ADD)
#undef KVT__TIER_ADD
    }
    return 0;
}

KVT_API void kvt_tier_chain_cold_tier(kvt_tier_chain *c, kvt_cold_tier *out)
{
    if (!out)
        return;
    *out = (kvt_cold_tier){.self = c,
                           .find = ch_find,
                           .find_exact = ch_find_exact,
                           .restore = ch_restore,
                           .restore_async = ch_restore_async,
                           .store = ch_store,
                           .spill = ch_spill,
                           .pending = ch_pending,
                           .flush = ch_flush,
                           .withdraw = ch_withdraw,
                           .stats = ch_stats,
                           .flags = c && first_writable(c) ? 0 : KVT_TIER_READ_ONLY};
}

/* ---- create / destroy --------------------------------------------------------------- */

KVT_API void kvt_tier_chain_destroy(kvt_tier_chain *c)
{
    if (!c)
        return;
    for (int i = 0; i < c->n; i++)
        if (c->lv[i].hooked)
            c->lv[i].t.set_evict(c->lv[i].t.self, NULL, NULL);
    if (c->io) {
        /* every queued write is written (the close/flush guarantee), then
         * no drain operation refers to the chain any more */
        kvt_tier_chain_drain(c);
        /* a find that went over its budget may still be inside a level's
         * table on the worker: wait until every find operation is freed */
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        while (c->finds_live)
            pthread_cond_wait(&c->idle, &c->mu);
        pthread_mutex_unlock(&c->mu);
        kvt_io_default_release(c->io);
    }
    for (wjob *j = c->head, *next; j; j = next) { /* only when no worker was acquired */
        next = j->next;
        kvt_entry_clear(&j->e);
        kvt__free(j);
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->idle);
    kvt__free(c);
}

static int name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= KVT_TIER_NAME_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
              ch == '.' || ch == ':' || ch == '-'))
            return 0;
    }
    return 1;
}

KVT_API int kvt_tier_chain_create(const kvt_tier_chain_config *cfg, kvt_tier_chain **out)
{
    if (out)
        *out = NULL;
    if (!cfg || !out)
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_create: %s is NULL", cfg ? "out" : "cfg");
    if (cfg->n_levels < 1 || cfg->n_levels > KVT_TIER_CHAIN_MAX || !cfg->levels)
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_create: %d levels (1..%d, levels set)", (int)cfg->n_levels,
                         KVT_TIER_CHAIN_MAX);
    if (cfg->write_queue < 0)
        return kvt__fail(KVT_EINVAL, "kvt_tier_chain_create: write_queue %d is negative", (int)cfg->write_queue);
    for (int i = 0; i < cfg->n_levels; i++) {
        const kvt_tier_level *l = &cfg->levels[i];
        if (!l->tier.find || !l->tier.restore)
            return kvt__fail(KVT_EINVAL, "kvt_tier_chain_create: level %d has no %s", i,
                             l->tier.find ? "restore" : "find");
        if (l->find_budget_ms < 0)
            return kvt__fail(KVT_EINVAL, "kvt_tier_chain_create: level %d find_budget_ms %d is negative", i,
                             (int)l->find_budget_ms);
        if (l->name && !name_ok(l->name))
            return kvt__fail(KVT_EINVAL,
                             "kvt_tier_chain_create: level %d's name is not 1..%d characters of [A-Za-z0-9_.:-]", i,
                             KVT_TIER_NAME_MAX - 1);
    }
    kvt_tier_chain *c = kvt__calloc(1, sizeof *c);
    if (!c)
        return KVT_ENOMEM;
    c->n = cfg->n_levels;
    c->cap = cfg->write_queue ? cfg->write_queue : 64;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->idle, NULL);
    int rc = 0;
    for (int i = 0; i < c->n; i++) {
        level *l = &c->lv[i];
        l->chain = c;
        l->index = i;
        if (cfg->levels[i].name)
            snprintf(l->name, sizeof l->name, "%s", cfg->levels[i].name);
        else
            snprintf(l->name, sizeof l->name, "level%d", i);
        l->t = cfg->levels[i].tier;
        l->budget_ms = cfg->levels[i].find_budget_ms;
        l->flags = cfg->levels[i].flags;
        l->writable = !(l->t.flags & KVT_TIER_READ_ONLY) && (l->t.store || l->t.spill);
    }
    if (rc == 0 && (rc = kvt_io_default_acquire(&c->io)) != 0) {
        c->io = NULL;
        rc = kvt__fail(rc, "tier chain: cannot start the I/O worker: %s", kvt_strerror(rc));
    }
    if (rc) {
        kvt_tier_chain_destroy(c);
        return rc;
    }
    for (int i = 0; i < c->n; i++) {
        level *l = &c->lv[i];
        if ((l->flags & KVT_LEVEL_NO_DEMOTE) || !l->t.set_evict)
            continue;
        int below = 0;
        for (int j = i + 1; j < c->n && !below; j++)
            below = c->lv[j].writable;
        if (!below)
            continue;
        l->t.set_evict(l->t.self, evict_hook, l);
        l->hooked = 1;
    }
    *out = c;
    return 0;
}
