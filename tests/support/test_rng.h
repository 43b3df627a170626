/*
 * test_rng.h: the one pseudo-random generator of the tests: splitmix64
 * (Steele, Lea, Flood 2014; the seeding generator of xoshiro), a 64-bit
 * state that any value seeds, so a test seeded by test_seed() (test_seed.h)
 * replays exactly. Header-only (static inline), no global state: each test
 * keeps its own state, one per thread when threads draw. Tests only.
 */
#ifndef KVT_TEST_RNG_H
#define KVT_TEST_RNG_H

#include <stdint.h>

/** The next value of state *s (any value, 0 included, is a valid state). */
static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/** Uniform in [0, n) (modulo reduction: bias below 2^-32 for n < 2^32);
 * 0 when n is 0. */
static inline uint64_t rng_below(uint64_t *s, uint64_t n) { return n ? rng_next(s) % n : 0; }

/** Uniform in [lo, hi] (lo <= hi). */
static inline int rng_range(uint64_t *s, int lo, int hi)
{
    return lo + (int)(rng_next(s) % (uint64_t)((int64_t)hi - lo + 1));
}

/** Uniform in [0, 1), 53 bits. */
static inline double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }

/** Uniform in [-1, 1), as a float (test data for tensors). */
static inline float rng_sym(uint64_t *s) { return (float)(rng_unit(s) * 2.0 - 1.0); }

#endif
