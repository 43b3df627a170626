/*
 * test_seed.c: test_seed() of test_seed.h, for tests only. Reads the
 * environment and the clock; owns no state.
 */
#include "test_seed.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

uint64_t test_seed(const char *what)
{
    const char *env = getenv("KVT_TEST_SEED");
    if (!env || !*env)
        env = getenv("KVT_SEED");
    uint64_t seed;
    if (env && *env) {
        seed = strtoull(env, NULL, 0);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    }
    printf("%s: seed %llu (set KVT_TEST_SEED to replay)\n", what, (unsigned long long)seed);
    fflush(stdout);
    return seed;
}
