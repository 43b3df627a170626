/*
 * kvtier/retention.h: the retention policy of the RAM prompt cache: which
 * resident entry leaves first when the byte budget is exceeded. A policy
 * sees entries only as 64-bit ids with their size and cost;
 * the prompt cache tells it about inserts, accesses and removals and asks
 * it for a victim among the entries an `eligible` predicate accepts (the
 * cache excludes pinned entries, and asks first among entries no session
 * points at).
 *
 * Built-in policies: kvt_retention_lru (least recently used, the default)
 * and kvt_retention_slru (segmented LRU: frequency-aware; an entry used
 * twice or more is protected and leaves only after every once-used one).
 * Users may bring their own by filling a kvt_retention_ops table.
 *
 * Thread-safety: a policy instance is not thread-safe; the prompt cache
 * calls it under its own lock only.
 */
#ifndef KVTIER_RETENTION_H
#define KVTIER_RETENTION_H

#include "kvtier/common.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A policy instance (opaque; each kind defines its own struct). */
typedef struct kvt_retention kvt_retention;

/** Predicate the cache passes to victim(): nonzero when entry `id` may go. */
typedef int (*kvt_retention_eligible_fn)(void *ctx, uint64_t id);

/** Operations of a retention policy. Every pointer is required. */
typedef struct kvt_retention_ops {
    const char *name; /* e.g. "lru" */
    /** Creates an empty instance. @return 0 or KVT_ENOMEM. */
    int (*create)(kvt_retention **out);
    /** Frees the instance (NULL is a no-op). */
    void (*destroy)(kvt_retention *r);
    /** A new entry `id` (never seen, or removed before) holding `bytes`
     * bytes and `cost` tokens of work; counts as an access.
     * @return 0 or KVT_ENOMEM (then the policy is unchanged). */
    int (*on_insert)(kvt_retention *r, uint64_t id, size_t bytes, int64_t cost);
    /** Entry `id` served a prompt (cost = tokens reused). Unknown ids are
     * ignored. */
    void (*on_access)(kvt_retention *r, uint64_t id, int64_t cost);
    /** Entry `id` left the cache (evicted, replaced, cleared...). Unknown ids
     * are ignored. */
    void (*on_remove)(kvt_retention *r, uint64_t id);
    /** Chooses the entry to evict among those `eligible(ctx, id)` accepts;
     * does not remove it (the cache calls on_remove when it goes).
     * @return 0 and *out set; KVT_ENOTFOUND when no entry is eligible. */
    int (*victim)(kvt_retention *r, kvt_retention_eligible_fn eligible, void *ctx, uint64_t *out);
} kvt_retention_ops;

/** Least recently used (the default). O(1) per insert/access/remove; victim
 * walks from the least recent end past ineligible entries. */
KVT_API extern const kvt_retention_ops kvt_retention_lru;

/** Segmented LRU (frequency-aware): entries start in a probation segment and
 * move to a protected segment on their second access; victims come from the
 * least recent end of probation first, then of protected. The protected
 * segment holds at most 80% of the entries (its least recent entry falls
 * back to probation). O(1) per call except the victim walk. */
KVT_API extern const kvt_retention_ops kvt_retention_slru;

/** The built-in policy named `name` ("lru" or "slru"), NULL if unknown.
 * Thread-safe. */
KVT_API const kvt_retention_ops *kvt_retention_by_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_RETENTION_H */
