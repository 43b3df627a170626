/*
 * bench_util.h: small pieces the `kvtier bench` commands (bench/bench_*.c
 * files) share: a median, a seeded xorshift, synthetic K/V appends.
 * Command-line code only; not part of the library API.
 */
#ifndef KVT_BENCH_UTIL_H
#define KVT_BENCH_UTIL_H

#include "kvtier/cache.h"

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

#endif
