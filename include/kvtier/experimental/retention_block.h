/*
 * kvtier/experimental/retention_block.h: block-granular retention policies
 * for prefix caches: which resident kv block to evict next.
 *
 * Experimental (research API): it may change or go in any release. Define
 * KVT_EXPERIMENTAL before including it (or pass -DKVT_EXPERIMENTAL) to say
 * you accept that; without it the header refuses to compile. The trace
 * replay (`kvtier replay`) is its user; the prompt cache takes a policy
 * through kvt_prompt_cache_config.block_policy.
 *
 * A prefix cache holds kv blocks (B consecutive tokens each) that form a
 * radix tree: block d of a prompt is only useful while blocks 0..d-1 of the
 * same prompt are resident. A kvt_block_policy keeps the resident set's
 * eviction order. The owner (the prompt cache, the trace replay) tells it
 * which blocks a request used (kvt_block_policy_touch), asks for the next
 * victim when it is over its byte or block budget (kvt_block_policy_victim)
 * and reports removals (kvt_block_policy_remove). The policy never frees
 * anything itself and has no budget of its own.
 *
 * Leaf first: when the caller names a block's parent, the child's priority is
 * capped at the parent's, and ties go to the deeper block, so a victim never
 * has a resident child whose priority is higher (a long conversation loses its
 * cold end first, never its head).
 *
 * Policies (kvt_block_policy_names):
 *   lru       block-level LRU: priority = time of last use (the request
 *             clock the caller passes), deeper blocks first on ties.
 *   lfu-aged  recency plus frequency: priority = last use + capacity *
 *             min(uses - 1, 3), with uses counted in a count-min sketch of
 *             16 counters per capacity block (so history survives eviction,
 *             TinyLFU-style) and halved every 32 * capacity touches (aging).
 *             A block used once has to wait one capacity of newer traffic to
 *             outrank a block used twice: single-use blocks (most blocks of
 *             real chat traffic) leave first.
 *   lfu-learned lfu-aged plus a learned offset for a block's first use: the
 *             first use falls in one of 30 classes (where the request's new
 *             blocks start: depth 0, 1, 2-7, 8-31, 32+, times how far past
 *             that start the block is: 0-1, 2-7, 8-15, 16-31, 32-63, 64+);
 *             the policy counts, per class, first uses and the blocks that
 *             came back (a ghost table of 16 entries per capacity block
 *             remembers a first use's class after eviction; counts halve
 *             every 8 * capacity first uses) and moves a first use up or
 *             down by capacity * clamp(rate / mean rate - 1, -1, 1), so the
 *             new blocks of requests like those whose blocks came back
 *             outlast the rest. The offset is fixed at the first use (a
 *             second touch at the same clock keeps it); later uses are
 *             ranked by frequency as in lfu-aged. "Where the new blocks
 *             start" is the depth of the first block inserted at a clock:
 *             the caller inserts a request's new blocks in depth order.
 * All put a prompt's partial last block (KVT_BLOCK_TAIL) first in line:
 * the next turn re-sends it with more tokens, so it is rarely reused as is.
 *
 * Thread-safety: one policy object is used by one thread at a time (the
 * prompt cache calls it under its own lock).
 */
#ifndef KVTIER_RETENTION_BLOCK_H
#define KVTIER_RETENTION_BLOCK_H

#ifndef KVT_EXPERIMENTAL
#error "kvtier/experimental/retention_block.h is experimental API that may change in any release: define KVT_EXPERIMENTAL to use it"
#endif

#include "kvtier/common.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_block_policy kvt_block_policy;

/** Flag for kvt_block_policy_touch: the block is the partial last block of
 * a prompt (fewer than B tokens). */
#define KVT_BLOCK_TAIL 1u

/** Names of the block policies, in a fixed order (lru, lfu-aged,
 * lfu-learned).
 * @param names receives a static array of `count` static strings (may be NULL).
 * @return the count (>= 3). Thread-safe. */
KVT_API int kvt_block_policy_names(const char *const **names);

/** Creates a block policy.
 *
 * @param name            one of kvt_block_policy_names() (borrowed).
 * @param capacity_blocks the owner's budget in blocks (>= 1): scales the
 *        frequency bonus, the learned offset, the sketch and the ghost
 *        table (lfu-learned: 4 bytes per entry, 16 entries per block); the
 *        policy still holds any number of blocks.
 * @param out receives the policy; the caller frees it with
 *        kvt_block_policy_destroy().
 * @return 0; KVT_EINVAL (NULL argument, capacity < 1); KVT_ENOTFOUND
 *         (unknown name; kvt_last_error lists the names); KVT_ENOMEM.
 */
KVT_API int kvt_block_policy_create(const char *name, int64_t capacity_blocks,
                                    kvt_block_policy **out);

/** Frees the policy (NULL is a no-op). */
KVT_API void kvt_block_policy_destroy(kvt_block_policy *p);

/** The policy's name (static string; "" for NULL). Thread-safe. */
KVT_API const char *kvt_block_policy_name(const kvt_block_policy *p);

/** Records a use of block `key`, inserting it when absent.
 *
 * @param key    the block's identity (e.g. a chained hash of its prefix);
 *               any value but 0.
 * @param parent the key of the block before it in the prompt, or 0 for the
 *               first block. When the parent is tracked, the block's
 *               priority is capped at the parent's (leaf first).
 * @param now    the caller's clock, non-decreasing (the replay passes the
 *               count of blocks requested before this request, so every
 *               block of one request gets the same time).
 * @param depth  block index in its prompt (0 for the first block).
 * @param flags  0 or KVT_BLOCK_TAIL.
 * @return 0; KVT_EINVAL (NULL policy, key 0); KVT_ENOMEM (room for a new
 *         block: the policy is unchanged).
 */
KVT_API int kvt_block_policy_touch(kvt_block_policy *p, uint64_t key, uint64_t parent, int64_t now,
                                   int32_t depth, unsigned flags);

/** Whether block `key` is tracked (1) or not (0). */
KVT_API int kvt_block_policy_contains(const kvt_block_policy *p, uint64_t key);

/** The next block to evict (the lowest priority), without removing it.
 * @return 0; KVT_ENOTFOUND when no block is tracked. */
KVT_API int kvt_block_policy_victim(const kvt_block_policy *p, uint64_t *key);

/** Forgets block `key` (the owner evicted or dropped it). Its use count
 * stays in the sketch. @return 0 or KVT_ENOTFOUND. */
KVT_API int kvt_block_policy_remove(kvt_block_policy *p, uint64_t key);

/** Blocks tracked. */
KVT_API int64_t kvt_block_policy_count(const kvt_block_policy *p);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_RETENTION_BLOCK_H */
