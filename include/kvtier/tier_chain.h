/*
 * kvtier/tier_chain.h: a chain of cold tiers (SSD -> remote -> published)
 * composed into one kvt_cold_tier, so the RAM prompt cache sits on a whole
 * hierarchy the way it sits on one tier.
 *
 * Levels are ordered top (fastest) first. The chain's table does:
 *   find / find_exact  ask the levels in order and keep the longest usable
 *                      prefix; a lower level wins only with a STRICTLY longer
 *                      prefix (the RAM tier's rule, applied at every level),
 *                      and the walk stops once a prefix of n - 1 tokens (the
 *                      most any level can offer) is found. A level with a
 *                      lookup time budget answers within it or counts as a
 *                      miss for that prompt (a slow remote never stalls a
 *                      prompt for longer than its budget): its find is a
 *                      foreground find operation on the process's I/O
 *                      worker (kvtier/io.h, KVT_IO_KIND_FIND), waited for
 *                      at most the budget;
 *   restore            reads from the level that holds the entry, then
 *                      promotes it upward: a copy sharing the same buffers
 *                      (zero bytes copied) is queued for every writable level
 *                      above it and written from the chain's write queue
 *                      on the process's I/O worker (write-behind: the request never waits for it);
 *   store / spill      go to the first writable level (not read-only, with
 *                      a store or spill operation), and a zero-copy copy to
 *                      each write-behind level (KVT_LEVEL_WRITE_BEHIND);
 *                      pending and withdraw
 *                      see spills still in the chain's queue and ask the
 *                      levels;
 *   eviction           a level whose tier has set_evict hands what it evicts
 *                      to the next writable level below it (demotion,
 *                      written from the write queue) instead of deleting it
 *                      (e.g. the SSD store's budget evictions into a Redis
 *                      tier). Before writing, the chain asks that level
 *                      whether it already holds the entry or has its write
 *                      queued (pending, find_exact): then nothing is written
 *                      (demotions_skipped). This is how demotion coexists
 *                      with KVT_LEVEL_WRITE_BEHIND: a write-behind level got
 *                      every kept prefix when it was put, so only what it
 *                      lacks (its write was dropped, or its own eviction
 *                      removed it) is demoted into it, once.
 * The write queue is bounded in entries: a promotion or demotion that finds
 * it full (or an I/O worker that refuses its drain operation) is dropped and
 * counted (promotions_dropped, demotions_dropped), never waited for. The
 * queue is written in order, one write at a time, by one background write
 * operation at a time on the process's default I/O worker (kvtier/io.h;
 * kvt_io_default_acquire): the chain has no writer thread of its own.
 *
 * Every level has a name (kvt_tier_level.name, e.g. "ssd", "redis",
 * "published"), which the service report and the server's metrics show
 * beside its counters.
 *
 * Thread-safety: every operation of the chain's table may be called from any
 * thread at any time, as tier.h requires; the chain never calls back into
 * its caller. It calls each level's table from the caller's thread (find,
 * find_exact without a budget, restore, store, spill, pending, flush) and
 * from an I/O worker thread (find, find_exact with a budget; promotion and
 * demotion writes), so every level must be callable from any thread, as
 * tier.h already requires. The chain has no thread of its own.
 */
#ifndef KVTIER_TIER_CHAIN_H
#define KVTIER_TIER_CHAIN_H

#include "kvtier/common.h"
#include "kvtier/tier.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The most levels a chain holds. */
#define KVT_TIER_CHAIN_MAX 8

/** A level name's storage, NUL included: names are 1..31 characters. */
#define KVT_TIER_NAME_MAX 32

/** kvt_tier_level.flags: never write promotions into this level. */
#define KVT_LEVEL_NO_PROMOTE 1u
/** kvt_tier_level.flags: do not hand this level's evictions to the level
 * below (its tier deletes them, as without a chain). */
#define KVT_LEVEL_NO_DEMOTE 2u
/** kvt_tier_level.flags: every store and spill that goes to the first
 * writable level is also handed to this level (a zero-copy copy given to
 * its spill, which must queue and return: write-behind), e.g. a shared
 * remote tier under a host's own SSD tier. A copy the level refuses is
 * dropped and counted (write_failures); the first level's write is
 * unaffected. The level needs a spill operation. */
#define KVT_LEVEL_WRITE_BEHIND 4u

/** One level of a chain. */
typedef struct kvt_tier_level {
    /** The level's table, copied by create; tier.self is borrowed and must
     * stay valid until kvt_tier_chain_destroy returns. find and restore are
     * required; store and spill are ignored when tier.flags has
     * KVT_TIER_READ_ONLY. */
    kvt_cold_tier tier;
    /** Lookup time budget in milliseconds. 0: find and find_exact run on the
     * caller's thread, unbounded. > 0: each is a foreground find operation
     * on the process's default I/O worker (KVT_IO_KIND_FIND: it starts
     * before write-behind) and the chain waits at most this long; a late
     * answer is a miss for that prompt (counted in finds_over_budget): the
     * operation is discarded unrun if it has not started, else its answer
     * is discarded when it arrives. At most 4 finds of a level are on the
     * worker at once (a late one counts until it returns); a fifth, or one
     * the worker refuses (its queue is full), is a miss at once, counted
     * the same way. */
    int32_t find_budget_ms;
    /** KVT_LEVEL_NO_PROMOTE | KVT_LEVEL_NO_DEMOTE | KVT_LEVEL_WRITE_BEHIND,
     * or 0 (promote and demote). */
    uint32_t flags;
    /** The level's name in reports and metric labels: 1..31 characters of
     * [A-Za-z0-9_.:-], e.g. "ssd", "redis", "published"; copied by create.
     * NULL: "level<i>" (i its index, 0 on top). */
    const char *name;
} kvt_tier_level;

/** Settings of kvt_tier_chain_create. */
typedef struct kvt_tier_chain_config {
    const kvt_tier_level *levels; /* (n_levels), top first; borrowed for the call */
    int32_t n_levels;             /* 1 .. KVT_TIER_CHAIN_MAX */
    int32_t write_queue;          /* promotions + demotions waiting to be
                                     written, in entries (0 = 64) */
} kvt_tier_chain_config;

typedef struct kvt_tier_chain kvt_tier_chain;

/** Makes a chain over cfg->levels: copies the tables, takes a reference on
 * the process's default I/O worker (its writes and budgeted lookups run
 * there; it starts no thread of its own), and installs the
 * eviction hook of every level that demotes (not KVT_LEVEL_NO_DEMOTE, has
 * set_evict, and has a writable level below it).
 * @return 0 and *out (released by kvt_tier_chain_destroy); KVT_EINVAL (cfg
 * or out NULL, n_levels outside 1..KVT_TIER_CHAIN_MAX, a level without find
 * or restore, find_budget_ms < 0, a name that is empty, too long or has
 * another character, write_queue < 0); KVT_ENOMEM; kvt_io_default_acquire's
 * errors (the worker could not start). On error nothing is left running. */
KVT_API int kvt_tier_chain_create(const kvt_tier_chain_config *cfg, kvt_tier_chain **out);

/** Removes the eviction hooks it installed, writes every queued promotion
 * and demotion, waits for every find operation it submitted (a lookup that
 * went over its budget may still be running in a level), drops its
 * reference on the default I/O worker and frees the chain. Never call it from an I/O worker thread. The levels' tiers are not closed: the caller
 * closes them afterwards, upper levels first (an entry promoted into a level
 * holds a share of the release hook of the level it was restored from, e.g.
 * the mapping of an SSD shard). NULL is a no-op. Call it once no other
 * thread uses the chain's table. */
KVT_API void kvt_tier_chain_destroy(kvt_tier_chain *c);

/** Fills *out with the chain's kvt_cold_tier table (self = c, borrowed until
 * destroy). Every operation is set; flags is KVT_TIER_READ_ONLY when no
 * level is writable. Its handles carry the level (top 4 bits): a level's
 * own handles must be below 2^60 (a hit with a larger one is ignored). */
KVT_API void kvt_tier_chain_cold_tier(kvt_tier_chain *c, kvt_cold_tier *out);

/** The number of levels (cfg->n_levels at create); 0 for NULL. Thread-safe. */
KVT_API int32_t kvt_tier_chain_levels(const kvt_tier_chain *c);

/** The level's name (kvt_tier_level.name, or "level<i>"): borrowed, valid
 * until destroy; NULL for a NULL chain or a level outside 0..n_levels-1.
 * Thread-safe. */
KVT_API const char *kvt_tier_chain_level_name(const kvt_tier_chain *c, int32_t level);

/** The chain's view of one level: what the chain did through it (finds,
 * find_hits, finds_over_budget, restores, restore_failures, stores,
 * write_failures, promotions, promotions_dropped, demotions,
 * demotions_dropped, demotions_skipped, evictions handed to the chain),
 * with what only the level itself sees from its own stats (0 when it has
 * none): entries and bytes, and behind_failures / behind_dropped, the
 * write-behind writes it accepted that failed or that it dropped later
 * (e.g. the SSD writer's failed writes, a remote tier's writes dropped while
 * it was unreachable). The table's stats operation sums this over the levels.
 * @return 0; KVT_EINVAL (c or out NULL, level outside 0..n_levels-1).
 * Thread-safe. */
KVT_API int kvt_tier_chain_level_stats(kvt_tier_chain *c, int32_t level, kvt_tier_stats *out);

/** The level's per-layer figures: its table's layer_bytes (see
 * kvt_cold_tier.layer_bytes), added to bytes[0..n_layers).
 * @return KVT_LAYER_BYTES_RESIDENT or KVT_LAYER_BYTES_WRITTEN (what they
 *   mean); 0 when the level has no layer_bytes (nothing added); KVT_EINVAL
 *   (c NULL, bytes NULL with n_layers > 0, level outside 0..n_levels-1).
 * Thread-safe. */
KVT_API int kvt_tier_chain_level_layer_bytes(kvt_tier_chain *c, int32_t level, int32_t n_layers, uint64_t *bytes);

/** Waits until every promotion and demotion queued so far is written (or
 * has failed). Does not flush the levels (the table's flush does both).
 * @return 0; KVT_EINVAL (c NULL). Thread-safe. */
KVT_API int kvt_tier_chain_drain(kvt_tier_chain *c);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_TIER_CHAIN_H */
