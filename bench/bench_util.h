/*
 * bench_util.h: small pieces the `kvtier bench` commands (bench/bench_*.c
 * files) share: a median, a seeded xorshift, synthetic K/V appends, a
 * synthetic entry sized in bytes or tokens.
 * Command-line code only; not part of the library API.
 */
#ifndef KVT_BENCH_UTIL_H
#define KVT_BENCH_UTIL_H

#include "kvtier/cache.h"
#include "kvtier/tier.h"

#include <stdint.h>

/** Median of v[0..n) (n >= 1; the mean of the middle two when n is even).
 * Sorts v in place. */
double kvt_bench_util_median(double *v, long n);

/** Next 32 bits of the xorshift64 generator whose state is *state (nonzero;
 * the caller seeds it, so a run is reproducible). */
uint32_t kvt_bench_util_rnd32(uint64_t *state);

/** Appends n tokens of synthetic K/V (values do not matter) to each of the
 * `layers` kv caches c[0..layers), in chunks of 256 tokens.
 * @return 0, KVT_ENOMEM, or kvt_cache_append's error. */
int kvt_bench_util_append(kvt_cache **c, int layers, int32_t kv_dim, int64_t n);

/** Tokens of f32 kv state (K and V) of n_layers layers of kv_dim that hold
 * about `bytes` bytes, rounded down to a multiple of `round` (>= 1; a block
 * size keeps the state in whole blocks), and at least max(round, 2). */
int64_t kvt_bench_util_state_tokens(uint64_t bytes, int n_layers, int32_t kv_dim, int64_t round);

/** Builds *e, an entry of n (>= 1) tokens in ns "" with n_layers f32 kv
 * caches of kv_dim and `block`-token blocks filled with deterministic K/V.
 * *tokens_out gets n + 1 deterministic tokens (the entry's, then one more,
 * so a prompt of n + 1 tokens finds all n); caller frees it with free() and
 * clears *e with kvt_entry_clear. On error neither is set.
 * @return 0, KVT_ENOMEM, or kvt_kv_create's / kvt_cache_append's error. */
int kvt_bench_util_entry(int64_t n, int n_layers, int32_t kv_dim, int32_t block, kvt_entry *e, int32_t **tokens_out);

#endif
