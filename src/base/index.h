/*
 * index.h: the prompt cache's radix tree over token sequences, one tree per
 * namespace (DESIGN.md 3.3). Internal; not installed; not thread-safe (the
 * prompt cache calls it under its lock).
 *
 * Each value (an entry) sits at the node where its tokens end. Edges carry
 * token spans (compressed: one node per branch point, not per token). Every
 * node knows the smallest reach among the trimmable values of its subtree,
 * so the longest candidate for a prompt is found by one walk along the
 * prompt: O(prompt length + branching), never a scan of all entries.
 */
#ifndef KVTIER_INDEX_H
#define KVTIER_INDEX_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvt__index kvt__index;

/** Creates an empty index. @return 0 or KVT_ENOMEM. */
int kvt__index_create(kvt__index **out);
/** Frees every node (not the values). NULL is a no-op. */
void kvt__index_destroy(kvt__index *ix);

/** Puts `val` (non-NULL) at tokens[0..n) of `ns`.
 * trimmable: the value can be cut back to any length >= reach (tokens);
 * an untrimmable value serves only prompts extending all its tokens.
 * If a value already sits there it is replaced and returned in *replaced
 * (else *replaced = NULL). @return 0 or KVT_ENOMEM (index unchanged in
 * content: no value added or removed). */
int kvt__index_insert(kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n, void *val,
                      int trimmable, int64_t reach, void **replaced);

/** kvt__index_insert with a granule: a trimmable value with granule g > 0
 * can also be cut back to every multiple of g below reach (a qkvc entry:
 * whole sealed blocks; kvt_entry_trim_granule). kvt__index_insert is this
 * with granule 0. */
int kvt__index_insert_g(kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n, void *val,
                        int trimmable, int64_t reach, int64_t granule, void **replaced);

/** Removes the value at exactly tokens[0..n) of ns; returns it (NULL if none). */
void *kvt__index_remove(kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n);

/** The value at exactly tokens[0..n) of ns, or NULL. */
void *kvt__index_exact(const kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n);

/** Longest candidate for `prompt` (n tokens): the largest p in [1, n-1] such
 * that some value shares p tokens with the prompt and either ends exactly at
 * p or is trimmable with reach <= p, or with a granule g dividing p (the
 * smallest granule of the values below a branch is the one tried: values of
 * one cache share one block size). Ties prefer the value ending at p.
 * @return p (0 = none) and *val (NULL when p = 0). */
int64_t kvt__index_lookup(const kvt__index *ix, const char *ns, const int32_t *prompt, int64_t n,
                          void **val);

/** Calls fn(val, depth, ctx) for every value whose tokens are a strict
 * prefix of tokens[0..n) (shortest first). fn must not modify the index. */
void kvt__index_prefixes(const kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n,
                         void (*fn)(void *val, int64_t depth, void *ctx), void *ctx);

/** Number of tree nodes (for tests and benchmarks). */
size_t kvt__index_nodes(const kvt__index *ix);

#endif
