/*
 * key.h: the one 128-bit content key of kvtier (XXH3-128), for entries and
 * for the chained keys of kv blocks. Internal; not installed. Every tier that
 * names stored state by content uses these functions, so the SSD tier, the
 * remote tier and the RAM tier's block bookkeeping name the same state with
 * the same key. Pure functions: no allocation, no failure, thread-safe.
 *
 * Exact bytes hashed (XXH3-128, no secret, seed 0, over the concatenation):
 *
 *   seed      = XXH3-128(identity bytes, without the NUL)
 *               identity: the store's canonical identity JSON, or "" where
 *               there is none (kvt__key_seed(NULL) is the zero key)
 *   entry key = XXH3-128( 'e'                       1 byte (0x65)
 *                         seed                      16 bytes: lo, then hi,
 *                                                   each 8 bytes little-endian
 *                         ns                        its bytes and a NUL
 *                         tokens[0..n)              4n bytes, int32 little-endian )
 *   block key = XXH3-128( 'b'                       1 byte (0x62)
 *                         seed                      16 bytes as above
 *                         parent                    16 bytes as above; the first
 *                                                   block's parent is the zero key
 *                         ns                        its bytes and a NUL
 *                         block tokens[0..n)        4n bytes, int32 little-endian )
 *
 * The key's lo/hi are XXH3-128's low64/high64. Its text form (file names,
 * shard metadata, remote keys) is XXH3's canonical form: 32 lowercase hex
 * digits, hi's 8 bytes big-endian then lo's (kvt__key_hex).
 *
 * A block key chains every token before the block (through parent), so two
 * sequences share a block key exactly when they share (identity, ns) and all
 * tokens up to the block's end. Keys are content names, not integrity checks:
 * shards and records still carry a checksum of their payload.
 */
#ifndef KVTIER_KEY_H
#define KVTIER_KEY_H

#include <stddef.h>
#include <stdint.h>

/** A 128-bit content key: XXH3-128's low64 (lo) and high64 (hi). */
typedef struct kvt__key {
    uint64_t lo, hi;
} kvt__key;

/** The zero key: the parent of a sequence's first block. */
#define KVT__KEY_ZERO ((kvt__key){0, 0})

static inline int kvt__key_eq(kvt__key a, kvt__key b) { return a.lo == b.lo && a.hi == b.hi; }

/** A well-mixed 64-bit word of k (its lo), never 0: for 64-bit maps and
 * policies that reserve 0. */
static inline uint64_t kvt__key_word(kvt__key k) { return k.lo ? k.lo : 1; }

/** Writes k's canonical text form, 32 lowercase hex digits and a NUL, to out. */
void kvt__key_hex(kvt__key k, char out[33]);

/** Parses exactly 32 lowercase hex digits (the form kvt__key_hex writes;
 * anything else, uppercase included, is refused). @return 0, or -1 with
 * *out untouched. */
int kvt__key_parse(const char *s, kvt__key *out);

/** The identity seed: XXH3-128 of the identity string (see the file
 * comment); NULL gives the zero key (the RAM tier's blocks, which have no
 * identity). */
kvt__key kvt__key_seed(const char *identity);

/** Key of an entry: (seed, ns, all its tokens). ns must not be NULL (the
 * base model is ""); tokens may be NULL when n is 0. */
kvt__key kvt__entry_key(kvt__key seed, const char *ns, const int32_t *tokens, int64_t n);

/** Key of one kv block: (seed, ns, the previous block's key or
 * KVT__KEY_ZERO for the first, the block's tokens tokens[0..n)). */
kvt__key kvt__block_key(kvt__key seed, const char *ns, kvt__key parent, const int32_t *tokens, int64_t n);

/** Lowercase hex of n bytes into out (2n + 1 bytes, NUL-terminated). */
void kvt__hex(const uint8_t *bytes, size_t n, char *out);
/** Parses exactly 2n lowercase hex digits into out[0..n). @return 0 or -1. */
int kvt__unhex(const char *s, uint8_t *out, size_t n);

#endif
