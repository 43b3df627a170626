/*
 * test_seed.h: the seed of a randomized test, one rule for every test file:
 * taken from the environment when set (to replay a failure), else from the
 * clock, and printed either way.
 */
#ifndef KVT_TEST_SEED_H
#define KVT_TEST_SEED_H

#include <stdint.h>

/** The seed: KVT_TEST_SEED (decimal, or 0x hex), else KVT_SEED, else the
 * clock (ns). Prints "<what>: seed N (set KVT_TEST_SEED to replay)" to
 * stdout. `what` names the test. */
uint64_t test_seed(const char *what);

#endif
