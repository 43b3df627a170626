/*
 * pc_blocks.h: block-granular eviction for the prompt cache.
 * Internal; not installed; not thread-safe (the prompt cache calls it under
 * its lock).
 *
 * The prompt cache cuts trimmable entries block by block instead of dropping
 * them whole. This layer names every block of a resident trimmable entry by a
 * chained content key (key.h's kvt__block_key over ns, the parent block's
 * key and the block's tokens, with no identity; its 64-bit word), so blocks
 * that two entries share have one key; counts the entries holding each
 * block; remembers which entry ends in each block (its tail owner); and feeds
 * uses to a kvt_block_policy. The victim is the policy's lowest block: with
 * leaf-first priorities that is a block no resident entry extends past, so
 * cutting its tail owner back to the block's start frees it.
 */
#ifndef KVTIER_PC_BLOCKS_H
#define KVTIER_PC_BLOCKS_H

#include "kvtier/experimental/retention_block.h"

#include <stdint.h>

typedef struct kvt__pc_blocks kvt__pc_blocks;

/** Creates the layer over `policy` (borrowed; used under the caller's lock
 * only) with blocks of `block_tokens` tokens (>= 1).
 * @return 0, KVT_EINVAL, KVT_ENOMEM. */
int kvt__pc_blocks_create(kvt_block_policy *policy, int32_t block_tokens, kvt__pc_blocks **out);
/** Frees the layer (not the policy). NULL is a no-op. */
void kvt__pc_blocks_destroy(kvt__pc_blocks *b);

/** Tokens per block. */
int32_t kvt__pc_blocks_block_tokens(const kvt__pc_blocks *b);

/** Advances the use clock by a request of n_tokens tokens (take calls it
 * once per prompt, before touching). */
void kvt__pc_blocks_clock(kvt__pc_blocks *b, int64_t n_tokens);

/** Keys of the blocks of tokens[0..n) in ns: ceil(n / B) keys, the last one
 * over a partial tail when n is not a multiple of B (its fewer tokens give
 * it a key no full block has). Each is kvt__key_word of the block's
 * 128-bit key, so never 0.
 * @param keys receives an array the caller frees with kvt__free (NULL when
 *        n is 0). @return 0 or KVT_ENOMEM. */
int kvt__pc_blocks_keys(const kvt__pc_blocks *b, const char *ns, const int32_t *tokens, int64_t n,
                        uint64_t **keys, int64_t *n_keys);

/** Entry `owner` (n_tokens tokens, keys from kvt__pc_blocks_keys) became
 * resident: counts it as a holder of every key, makes it the tail owner of
 * its last key and touches every key (a use at the current clock).
 * @return 0 or KVT_ENOMEM (then nothing changed). */
int kvt__pc_blocks_add(kvt__pc_blocks *b, void *owner, const uint64_t *keys, int64_t n_keys,
                       int64_t n_tokens);

/** Touches keys[0..k) (a take served them), at the current clock. */
void kvt__pc_blocks_touch(kvt__pc_blocks *b, const uint64_t *keys, int64_t k, int64_t n_keys,
                          int64_t n_tokens);

/** `owner` no longer holds keys[from..n_keys): each loses a holder (a block
 * with none leaves the policy), and owner stops being the tail owner of
 * keys[n_keys-1]. With from > 0 owner becomes the tail owner of
 * keys[from-1] (it was cut back to that block's end). */
void kvt__pc_blocks_drop(kvt__pc_blocks *b, void *owner, const uint64_t *keys, int64_t from,
                         int64_t n_keys);

/** The next block to evict: *owner = the entry ending in it and *depth =
 * its index in that entry (cut the entry back to depth * B tokens).
 * @return 0; KVT_ENOTFOUND (no block tracked). A lowest block without a
 * tail owner (it cannot be cut) is dropped from the policy and reported as
 * *owner = NULL (the caller just asks again). */
int kvt__pc_blocks_victim(kvt__pc_blocks *b, void **owner, int64_t *depth);

/** Extends a cut to several blocks at once. keys[depth] is the victim just
 * reported for this entry (its tail, about to be cut); while fewer than
 * max_blocks blocks are taken and the next victim would be the block before
 * it, held by this entry alone, moves the cut one block up. Blocks passed
 * over leave the policy (the caller cuts them).
 * @return the depth to cut the entry back to (<= depth). */
int64_t kvt__pc_blocks_extend(kvt__pc_blocks *b, const uint64_t *keys, int64_t depth, int64_t max_blocks);

#endif
