/*
 * pc_util.h: helpers for the prompt-cache tests: deterministic kv /
 * recurrent / rotating layer caches, an "engine step" that extends views
 * with new tokens, and a put wrapper that disposes on failure.
 */
#ifndef KVT_TEST_PC_UTIL_H
#define KVT_TEST_PC_UTIL_H

#include "kvtier/prompt_cache.h"

#include <stdint.h>

#define PCU_KV_DIM 4
#define PCU_BLOCK 4

/** Appends tokens[0..n) to every cache (K/V values derived from token and
 * position; recurrent state = running hash). @return 0 or an error. */
int pcu_extend(kvt_cache **caches, int nc, const int32_t *tokens, int64_t n);
/** Fresh caches for `kinds` (a string: 'k' kv, 'r' recurrent, 'w' rotating
 * window 6) holding tokens[0..n). */
int pcu_fresh(const char *kinds, kvt_cache **caches, const int32_t *tokens, int64_t n);
/** put with caches (adopted on success, disposed on failure). */
int pcu_put(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n, kvt_cache **caches, int nc,
            kvt_attachment **atts, int na, kvt_hook hook, const char *session);
/** Builds fresh caches of `kinds` for tokens and puts them. */
int pcu_put_fresh(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n, const char *kinds,
                  const char *session);
/** Bytes of the unique buffers + private bytes of a set of caches (each
 * buffer once), the way the prompt cache budgets them. */
size_t pcu_unique_bytes(kvt_cache *const *caches, int nc);

/** t[i] = base + i for i in [0, n): a token run no other run overlaps
 * when the bases are far apart. */
void pcu_seq(int32_t *t, int64_t n, int32_t base);
/** The cache's statistics (kvt_prompt_cache_get_stats), by value. */
kvt_prompt_cache_stats pcu_stats(kvt_prompt_cache *pc);

#endif
