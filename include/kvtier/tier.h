/*
 * kvtier/tier.h: an entry's parts (kvt_entry), the release hook, and the
 * cold-tier interface (kvt_cold_tier) the RAM prompt cache tiers over.
 *
 * An entry (a checkpoint) is (ns, tokens, layer caches,
 * attachments, release hook). The same struct carries an entry in three
 * ownership forms; every call that takes or returns one says which:
 *   - kvtier-allocated: every pointer in it (ns, tokens, the two arrays and their
 *     elements) was allocated by kvtier's allocator (kvt_entry_init) and is
 *     released, hook last, by kvt_entry_clear();
 *   - borrowed: the caller's memory, read during the call only;
 *   - adopted elements: kvt_prompt_cache_put() reads ns/tokens and takes the
 *     caches, attachments and hook (see prompt_cache.h).
 *
 * The SSD tier (kvtier/store.h, kvt_store_cold_tier) implements the cold
 * tier; an embedder may bring its own. No operation is ever called with the
 * prompt cache's lock held. The prompt cache calls it as follows:
 *   find / find_exact / pending  lookups; may block on I/O (a remote tier's
 *                                round trip; a tier chain waits at most a
 *                                level's lookup budget), so the prompt cache
 *                                asks them WITHOUT its lock and checks what
 *                                it found in RAM again after the answer;
 *   spill                        write-behind: enqueue and return, never
 *                                block on I/O; called WITHOUT the lock, for
 *                                every entry put (kept) and for entries
 *                                leaving RAM the tier does not hold yet;
 *   withdraw                     drops a queued write the prompt cache no
 *                                longer needs; called WITHOUT the lock;
 *   restore / restore_async      real reads; called WITHOUT the lock;
 *   store                        synchronous write; called WITHOUT the lock
 *                                by demote_idle, relieve and close.
 * A tier must never call back into the prompt cache from any of these.
 * Every function may be called from any thread at any time: the tier does its
 * own locking.
 */
#ifndef KVTIER_TIER_H
#define KVTIER_TIER_H

#include "kvtier/cache.h"
#include "kvtier/common.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the release hook ------------------------------------------------------ */

/** A release hook: `fn(ctx)`, e.g. unmapping the file
 * the bytes of a restored entry live in. Whoever holds a kvt_hook with a
 * non-NULL fn must call kvt_hook_run() on it exactly once, after destroying
 * every cache and attachment that may alias the memory it releases. A hook
 * with fn NULL is empty (nothing to run). The prompt cache refcounts an
 * entry's hook: the donor entry and every lent view hold one share each and
 * the underlying fn runs once, after the last share is run. */
typedef struct kvt_hook {
    void (*fn)(void *ctx);
    void *ctx;
} kvt_hook;

/** Runs `h->fn(h->ctx)` if fn is set, then empties *h (so a second call is a
 * no-op). NULL is a no-op. Thread-safe for distinct hooks. */
KVT_API void kvt_hook_run(kvt_hook *h);

/* ---- an entry's parts ------------------------------------------------------ */

/** The parts of one entry. Ownership depends on the call (see the file
 * comment). Shapes: tokens (n_tokens) int32 ids; caches (n_caches) one per
 * model layer, each with offset == n_tokens; attachments (n_attachments). */
typedef struct kvt_entry {
    const char *ns;                /* namespace, "" = base model; NUL-terminated.
                                      NULL means "" where kvtier reads it
                                      (put, kvt_entry_init); kvtier never
                                      hands a NULL ns to a cold tier */
    const int32_t *tokens;         /* (n_tokens) */
    int64_t n_tokens;              /* >= 0; 0 for objects (ns "object:<key>") */
    kvt_cache **caches;            /* (n_caches) */
    int32_t n_caches;              /* >= 0 */
    kvt_attachment **attachments;  /* (n_attachments); any makes it untrimmable */
    int32_t n_attachments;         /* >= 0 */
    kvt_hook hook;                 /* runs after caches and attachments are gone */
} kvt_entry;

/** Makes *e a kvtier-allocated entry: copies ns (NULL means "") and
 * tokens[0..n_tokens) and allocates zeroed caches (n_caches) and attachments (n_attachments) arrays for the
 * caller to fill (slots left NULL are skipped by kvt_entry_clear). The hook
 * is empty. Used by cold tiers to build what restore returns and by the
 * prompt cache to build what spill receives.
 * @param tokens may be NULL when n_tokens is 0.
 * @return 0; KVT_EINVAL (e NULL, n_tokens/n_caches/n_attachments
 * negative, tokens NULL with n_tokens > 0); KVT_ENOMEM (then *e is zeroed and
 * nothing is left allocated). Thread-safe. */
KVT_API int kvt_entry_init(kvt_entry *e, const char *ns, const int32_t *tokens, int64_t n_tokens,
                           int32_t n_caches, int32_t n_attachments);

/** Releases a kvtier-allocated entry: destroys every non-NULL cache and
 * attachment, then runs the hook, then frees ns, tokens and the arrays, and zeroes *e.
 * NULL, and an all-zero entry, are no-ops. Never call it on a borrowed entry.
 * Thread-safe for distinct entries. */
KVT_API void kvt_entry_clear(kvt_entry *e);

/** Whether an entry is trimmable: no attachment and no
 * layer whose reachable range is a single point (an entry with 0 tokens
 * counts as trimmable). *min_reach (optional) receives the largest
 * min_offset over its layers: the shortest length every layer can be cut
 * back to. Reads only; thread-safe as the caches are. */
KVT_API int kvt_entry_trimmable(const kvt_entry *e, int64_t *min_reach);

/** Block granule of an entry below its min_reach: g > 0 when every layer
 * whose min_offset is above 0 can also be cut back to every multiple of its
 * kvt_cache_trim_granule() (a qkvc layer: whole sealed blocks); g is the
 * least common multiple of those granules, and the entry can then be cut to
 * every multiple of g below min_reach. 0 when there is none (an attachment,
 * a layer without a granule, NULL). A layer with a single-point range but a
 * granule (a qkvc cache whose open block is empty) does not make the entry
 * untrimmable. Reads only; thread-safe as the caches are. */
KVT_API int64_t kvt_entry_trim_granule(const kvt_entry *e);

/* ---- the cold tier -------------------------------------------------------- */

/** What find / find_exact report: the usable prefix and an opaque handle. */
typedef struct kvt_cold_hit {
    int64_t prefix_len;  /* tokens of the prompt the stored entry can serve */
    int64_t n_tokens;    /* tokens the stored entry holds (>= prefix_len) */
    uint64_t handle;     /* the tier's id of the stored entry; a handle whose
                            entry has gone makes restore fail KVT_ENOTFOUND */
} kvt_cold_hit;

/** Completion of restore_async. On status 0, *entry is a kvtier-allocated
 * entry and ownership of its contents passes to the callee, which must move them out
 * (struct copy) or kvt_entry_clear() it before returning; on error entry is
 * NULL. Runs exactly once per accepted restore_async, on a tier worker
 * thread (or inline, before restore_async returns). */
typedef void (*kvt_restore_done_fn)(void *arg, int status, kvt_entry *entry);

/** A tier's counters, one list: X(name, kind, help) with kind counter (only
 * grows) or gauge (a current value). It generates kvt_tier_stats, the
 * service report's "tiers" objects and the server's kvtier_tier_level_*
 * Prometheus lines. behind_failures and behind_dropped are what a tier sees
 * after its spill returned 0 (its own write-behind queue: a write that
 * failed, or that it dropped, e.g. its remote unreachable): only the tier can
 * count them, and its stats operation must, or they are lost to the report. */
#define KVT_TIER_COUNTERS(X)                                                                     \
    X(finds, counter, "find calls answered")                                                    \
    X(find_hits, counter, "finds that reported a usable prefix")                                \
    X(finds_over_budget, counter, "finds not answered within the lookup time budget (a miss)")  \
    X(restores, counter, "entries restored")                                                    \
    X(restore_failures, counter, "restores that failed")                                        \
    X(stores, counter, "entries written by store, spill, promotion or demotion")                \
    X(write_failures, counter, "writes that failed or were refused")                            \
    X(behind_failures, counter, "write-behind writes this tier accepted that failed later")     \
    X(behind_dropped, counter, "write-behind writes this tier accepted, then dropped unwritten") \
    X(promotions, counter, "entries written into this tier because a lower tier restored them") \
    X(promotions_dropped, counter, "promotions not written (queue full or the write failed)")   \
    X(demotions, counter, "entries this tier evicted that a lower tier took")                   \
    X(demotions_dropped, counter, "evicted entries not demoted (queue full or the write failed)") \
    X(demotions_skipped, counter, "evicted entries not written again: the tier below held them") \
    X(evictions, counter, "entries this tier evicted")                                          \
    X(entries, gauge, "entries held")                                                           \
    X(bytes, gauge, "bytes held")

/** Counters and bytes of one tier (see KVT_TIER_COUNTERS); all uint64. */
typedef struct kvt_tier_stats {
#define KVT__TIER_FIELD(name, kind, help) uint64_t name;
    KVT_TIER_COUNTERS(KVT__TIER_FIELD)
#undef KVT__TIER_FIELD
} kvt_tier_stats;

/** kvt_cold_tier.flags: the tier is read-only (a published cache): store and
 * spill are NULL or refuse with KVT_EREADONLY, and no chain writes into it. */
#define KVT_TIER_READ_ONLY 1u

/** kvt_cold_tier.layer_bytes results: what the figures mean. */
#define KVT_LAYER_BYTES_RESIDENT 1
#define KVT_LAYER_BYTES_WRITTEN 2

/** A tier's eviction hook: the tier hands `e`, a kvtier-allocated entry it is about to
 * drop, to the tier below (demotion). Ownership passes to the hook on 0 (the
 * hook writes it behind and releases it with kvt_entry_clear); on error it
 * stays with the evicting tier, which drops it as it would without a hook.
 * Never blocks on I/O; never calls back into the evicting tier. */
typedef int (*kvt_tier_evict_fn)(void *arg, kvt_entry *e);

/** A cold (lower) tier: a table of functions over `self`. `find`, `restore`
 * and `store` are required; the others are optional (NULL). All tokens and
 * ns arguments are borrowed for the call; the prompt cache never passes a
 * NULL ns (a NULL ns given to kvtier is "" by then). */
typedef struct kvt_cold_tier {
    void *self;

    /** Longest usable stored prefix for `prompt` (n tokens) in `ns`: a
     * stored entry whose common prefix with the prompt, capped at n - 1, is
     * inside the reachable range of every stored layer (an untrimmable
     * stored entry only when all its tokens are a prefix of the prompt).
     * May block on I/O (a lookup round trip); a slow tier should bound its
     * own wait (a chain level's lookup budget does).
     * @return 0 and *out filled; KVT_ENOTFOUND (nothing usable, prefix 0). */
    int (*find)(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out);

    /** The stored entry holding exactly `tokens` (n, may be 0 for objects)
     * in `ns`; out->prefix_len = n. May block on I/O, like find.
     * @return 0; KVT_ENOTFOUND. Optional (NULL: never found). */
    int (*find_exact)(void *self, const int32_t *tokens, int64_t n, const char *ns,
                      kvt_cold_hit *out);

    /** Reads the stored entry `handle` into *out, a kvtier-allocated entry (built with
     * kvt_entry_init; the caller releases it with kvt_entry_clear). The
     * caches own their bytes, or alias a mapping that out->hook releases.
     * The entry is returned whole (untrimmed); the caller trims.
     * @return 0; KVT_ENOTFOUND (stale handle); KVT_EIO / KVT_ECORRUPT /
     * KVT_EFORMAT / KVT_ENOMEM / -errno (then *out is zeroed). */
    int (*restore)(void *self, uint64_t handle, kvt_entry *out);

    /** Starts reading `handle` and returns at once; `done(arg, status,
     * entry)` runs exactly once when the read ends (see kvt_restore_done_fn).
     * @return 0 (accepted: done will run); KVT_EAGAIN (queue full) or
     * another error (done never runs). Optional (NULL: the prompt cache
     * restores synchronously instead). */
    int (*restore_async)(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg);

    /** Writes *e (borrowed: caches and attachments are read, never kept or
     * destroyed) and returns once it is durable.
     * @return 0 (durable); KVT_EIO / -errno / KVT_ENOMEM (nothing new is
     * durable; the caller keeps its entry). */
    int (*store)(void *self, const kvt_entry *e);

    /** Write-behind: takes *e, a kvtier-allocated entry (zero-copy views and a token
     * copy made for the tier, with a share of the release hook), queues its
     * write and returns without blocking on I/O. The prompt cache spills
     * every entry it keeps when it is put, and an entry leaving RAM that
     * the tier neither holds (find_exact) nor has pending. The queue must
     * stay bounded: refuse with KVT_EAGAIN rather than grow without limit.
     * Ownership passes to the tier on 0 (it calls kvt_entry_clear when the
     * write ends, on success and failure alike); on error it stays with the
     * caller, which clears it (kvt_entry_clear): the spill degrades to no spill.
     * @return 0; KVT_EAGAIN (queue full, refused); another error.
     * Optional (NULL: the prompt cache never spills). */
    int (*spill)(void *self, kvt_entry *e);

    /** Whether a write of exactly (ns, tokens) is still pending (queued or in
     * flight, not yet durable). May block on I/O, like find.
     * @return 1 pending, 0 not.
     * Optional (NULL: never pending). */
    int (*pending)(void *self, const int32_t *tokens, int64_t n, const char *ns);

    /** Makes every queued write durable before returning.
     * @return 0 (all durable) or the first write error. Optional. */
    int (*flush)(void *self);

    /** Withdraws a queued write of exactly (ns, tokens) that has not started
     * (the prompt cache calls it when the entry was superseded by a longer
     * one whose write is queued behind it): the tier drops the job and
     * releases its entry (kvt_entry_clear) before returning. Never blocks
     * on I/O. @return 0 withdrawn; KVT_ENOTFOUND (no such queued write, or
     * it is already being written: it completes as usual).
     * Optional (NULL: queued writes always complete). */
    int (*withdraw)(void *self, const int32_t *tokens, int64_t n, const char *ns);

    /* ---- tier-chain extensions (zero in a table that predates them) ---- */

    /** Fills *out with the tier's counters and bytes (kvt_tier_stats).
     * Never blocks on I/O. @return 0. Optional (NULL: no counters). */
    int (*stats)(void *self, kvt_tier_stats *out);

    /** Installs the eviction hook (fn NULL removes it): from the next
     * eviction on, the tier hands what it evicts to fn(arg, entry) instead
     * of only deleting it (see kvt_tier_evict_fn). An entry that cannot be
     * handed over whole (or that the hook refuses) is deleted as before.
     * Once set_evict returns, the previous hook is never called again (calls
     * in flight have returned). Optional (NULL: evictions are deleted). */
    void (*set_evict)(void *self, kvt_tier_evict_fn fn, void *arg);

    /** Adds to bytes[i], for each layer i < n_layers, the bytes of layer i's
     * state the tier accounts for (tensor bytes; headers and metadata
     * belong to no layer; layers past the tier's own add nothing). Never
     * blocks on I/O (an index or counters, no disk or network access).
     * @return KVT_LAYER_BYTES_RESIDENT: what the tier holds now (its index:
     *   every removal is subtracted, a shared block counted once);
     *   KVT_LAYER_BYTES_WRITTEN: bytes this process wrote into the tier since
     *   it opened, which the tier may have evicted since without saying so
     *   (a remote tier whose server evicts on its own): not residency.
     * Optional (NULL: no per-layer figures). */
    int (*layer_bytes)(void *self, int32_t n_layers, uint64_t *bytes);

    /** KVT_TIER_READ_ONLY or 0. */
    uint32_t flags;
} kvt_cold_tier;

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_TIER_H */
