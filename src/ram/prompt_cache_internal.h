/*
 * prompt_cache_internal.h: what the files of the RAM tier (the prompt cache,
 * DESIGN.md section 3) share. Internal; not installed.
 *
 * The prompt cache is one object split by concept over these files:
 *   prompt_cache.c  lifetime (create, close, destroy, clear, stats), entries
 *                   (shells, hook shares, measuring, the byte budget's
 *                   accounting, unlinking, the off-lock "gone" list) and the
 *                   cold tier's off-lock questions (holds, pending, has);
 *   pc_lend.c       take: lend, lend_exact, peek, find_exact, cold restores
 *                   and their promotion;
 *   pc_put.c        put: building and linking an entry, equal-token
 *                   replacement, supersede, write-behind, trim in place;
 *   pc_evict.c      leaving RAM: the victim, eviction and block cuts, budget
 *                   changes, relieve, reclaim, demote_idle;
 *   pc_session.c    sessions, pins, leases and prefetch reads;
 *   pc_object.c     exact-key objects.
 *
 * The lock rule of prompt_cache.c's opening holds in every file: one mutex
 * (kvt_prompt_cache.mu) guards everything below; the cold tier is never
 * called under it; entries that leave are collected on a "gone" list under
 * the lock and spilled / disposed after it is dropped. Every function named
 * *_locked, and every one whose comment says "under the lock", runs with
 * pc->mu held.
 */
#ifndef KVTIER_PROMPT_CACHE_INTERNAL_H
#define KVTIER_PROMPT_CACHE_INTERNAL_H

#include "kvtier/prompt_cache.h"

#include "hmap.h"
#include "index.h"
#include "internal.h"
#include "pc_blocks.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/* ---- types ----------------------------------------------------------------------- */


/* One share per holder (the donor entry, every lent view, every spill); the
 * hook runs once the last share is run. */
typedef struct pc_share {
    atomic_int_fast64_t refs;
    kvt_hook hook;
} pc_share;

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
    int64_t granule;          /* > 0: also cut to its multiples below reach (kvt_entry_trim_granule) */
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

/* ---- prompt_cache.c: hook shares, entries, budget accounting, the cold tier --------- */

/* Runs one share of a hook (a kvt_hook fn): the hook runs with the last. */
void kvt__pc_share_run(void *ctx);
/* A share holding hook with one reference, or NULL when out of memory. */
pc_share *kvt__pc_share_new(kvt_hook hook);
/* out = (ns, tokens[0..n)) with zero-copy clones of caches and attachments,
 * no hook; on error out is left cleared. */
int kvt__pc_clone_parts(kvt_entry *out, const char *ns, const int32_t *tokens, int64_t n, kvt_cache *const *caches,
                        int32_t n_caches, kvt_attachment *const *atts, int32_t n_atts);
/* Frees an entry shell whose parts were never adopted (or were moved out). */
void kvt__pc_entry_free_shell(pc_entry *e);
/* A new entry shell (copies of ns and tokens, zeroed arrays), or NULL. */
pc_entry *kvt__pc_entry_shell(const char *ns, const int32_t *tokens, int64_t n_tokens, int32_t n_caches,
                              int32_t n_atts);
/* Frees a built entry that was never linked; its hook is not run. */
void kvt__pc_entry_discard(pc_entry *x);
/* Disposes an entry and its parts, then runs its hook share. */
void kvt__pc_entry_dispose(pc_entry *e);
/* Trimmability, reach, private bytes and buffers of e; *standalone = the
 * bytes it holds alone. 0 or KVT_ENOMEM. */
int kvt__pc_entry_measure(pc_entry *e, size_t *standalone);
/* The byte budget's accounting of e (a buffer counts once). Under the lock. */
void kvt__pc_account_remove(kvt_prompt_cache *pc, pc_entry *e);
int kvt__pc_account_add(kvt_prompt_cache *pc, pc_entry *e);
/* Unlinks resident e from every structure and pushes it on *gone (spilled
 * there when `spill`). Under the lock. */
void kvt__pc_entry_unlink(kvt_prompt_cache *pc, pc_entry *e, int spill, pc_entry **gone);
/* Spills (write-behind) and disposes leaving entries. Off-lock. */
void kvt__pc_gone_process_wb(kvt_prompt_cache *pc, pc_entry *gone, int withdraw_ok);
void kvt__pc_gone_process(kvt_prompt_cache *pc, pc_entry *gone);
/* The cold tier's answers about (ns, tokens). Off-lock only: they may block
 * on I/O. */
int kvt__pc_tier_pending(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n);
int kvt__pc_tier_holds(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n);
int kvt__pc_tier_has(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n);

/* ---- pc_lend.c -------------------------------------------------------------------- */

/* Views of e at p tokens into out (clones only; trimmed off-lock). Under
 * the lock. */
int kvt__pc_lend_locked(kvt_prompt_cache *pc, pc_entry *e, int64_t p, kvt_hit *out);
/* The argument check of the prompt-taking calls; `fn` names the caller. */
int kvt__pc_check_prompt(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns, const void *out,
                         const char *fn);

/* ---- pc_put.c --------------------------------------------------------------------- */

/* Links a built, measured entry and applies put's rules except the budget
 * (the caller runs kvt__pc_evict next). Under the lock. */
int kvt__pc_insert_locked(kvt_prompt_cache *pc, pc_entry *x, size_t standalone, const char *session,
                          int64_t pins, pc_entry **gone, int *wb, int tier_have);
/* Takes e's parts after a successful put (NULLs its slots, empties its hook). */
void kvt__pc_adopt_parts(kvt_entry *e);
/* Builds, measures and keys an entry from e before it is linked. Off-lock. */
int kvt__pc_entry_prepare(kvt_prompt_cache *pc, const kvt_entry *e, pc_entry **out, size_t *standalone);
/* put's body (also publishes restores and objects). Takes the lock. */
int kvt__pc_put_common(kvt_prompt_cache *pc, kvt_entry *e, const char *session, int64_t pins, uint64_t *id_out,
                       uint64_t epoch_check, int wb);
/* Cuts resident e back to new_len tokens in place and re-indexes it. Under
 * the lock. */
int kvt__pc_trim_locked(kvt_prompt_cache *pc, pc_entry *e, int64_t new_len, pc_entry **gone);

/* ---- pc_evict.c ------------------------------------------------------------------- */

/* Evicts to budget (limit < 0) or `limit` entries. Called and returns with
 * the lock held, but drops it while the cold tier is asked: the caller
 * holds no pointer into the cache across the call. */
int64_t kvt__pc_evict(kvt_prompt_cache *pc, int64_t limit, pc_entry **gone);

/* ---- pc_session.c ----------------------------------------------------------------- */

/* Frees a session and its slots, releasing the entries they point at. */
void kvt__pc_session_release_slots(kvt_prompt_cache *pc, pc_session *s);
/* The (session, ns) slot, or NULL. */
pc_slot *kvt__pc_session_slot(const kvt_prompt_cache *pc, const char *session, const char *ns);
/* Points (session, ns) at e; best effort. */
void kvt__pc_session_associate(kvt_prompt_cache *pc, const char *session, const char *ns, pc_entry *e);
/* `to` replaces `from` (equal tokens): sessions and pins follow. */
void kvt__pc_entry_follow(kvt_prompt_cache *pc, pc_entry *from, pc_entry *to);
/* The session's entry serving the prompt (strict prefix, resident), or NULL. */
pc_entry *kvt__pc_session_entry(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, const char *ns,
                                const char *session);

/* ---- small helpers ---------------------------------------------------------------- */

static inline kvt_hook kvt__pc_share_acquire(pc_share *s)
{
    if (!s)
        return (kvt_hook){NULL, NULL};
    atomic_fetch_add(&s->refs, 1);
    return (kvt_hook){kvt__pc_share_run, s};
}

static inline int kvt__pc_tokens_equal(const int32_t *a, const int32_t *b, int64_t n)
{
    return n == 0 || memcmp(a, b, (size_t)n * sizeof(int32_t)) == 0;
}

static inline pc_entry *kvt__pc_by_id(const kvt_prompt_cache *pc, uint64_t id)
{
    uint64_t *v = kvt__umap_get(&pc->by_id, id);
    return v ? (pc_entry *)(uintptr_t)*v : NULL;
}

static inline size_t kvt__pc_total_bytes(const kvt_prompt_cache *pc) { return pc->buf_bytes + pc->private_bytes; }

static inline int kvt__pc_write_behind_on(const kvt_prompt_cache *pc)
{
    return pc->has_cold && pc->cold.spill && !(pc->flags & KVT_PC_NO_WRITE_BEHIND);
}

#endif /* KVTIER_PROMPT_CACHE_INTERNAL_H */
