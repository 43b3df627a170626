/*
 * remote_key.h: the content keys the remote tier names records by: the one
 * key module (src/base/key.h) when it is present, else the same functions
 * over the same bytes (see the key module's file comment), so the remote
 * tier and the SSD tier name the same state with the same keys.
 */
#ifndef KVTIER_REMOTE_KEY_H
#define KVTIER_REMOTE_KEY_H

#if __has_include("key.h")
#include "key.h"
#else
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

typedef struct kvt__key {
    uint64_t lo, hi;
} kvt__key;
#define KVT__KEY_ZERO ((kvt__key){0, 0})
static inline int kvt__key_eq(kvt__key a, kvt__key b) { return a.lo == b.lo && a.hi == b.hi; }
static inline void kvt__key_hex(kvt__key k, char out[33])
{
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)k.hi, (unsigned long long)k.lo);
}
static inline kvt__key kvt__key_seed(const char *identity)
{
    if (!identity)
        return KVT__KEY_ZERO;
    XXH128_hash_t h = XXH3_128bits(identity, strlen(identity));
    return (kvt__key){h.low64, h.high64};
}
static inline kvt__key kvt__rkey_digest(XXH3_state_t *x)
{
    XXH128_hash_t h = XXH3_128bits_digest(x);
    return (kvt__key){h.low64, h.high64};
}
static inline kvt__key kvt__entry_key(kvt__key seed, const char *ns, const int32_t *tokens, int64_t n)
{
    XXH3_state_t x;
    XXH3_128bits_reset(&x);
    XXH3_128bits_update(&x, "e", 1);
    XXH3_128bits_update(&x, &seed, sizeof seed);
    XXH3_128bits_update(&x, ns, strlen(ns) + 1);
    if (n > 0)
        XXH3_128bits_update(&x, tokens, sizeof(int32_t) * (size_t)n);
    return kvt__rkey_digest(&x);
}
static inline kvt__key kvt__block_key(kvt__key seed, const char *ns, kvt__key parent, const int32_t *tokens,
                                      int64_t n)
{
    XXH3_state_t x;
    XXH3_128bits_reset(&x);
    XXH3_128bits_update(&x, "b", 1);
    XXH3_128bits_update(&x, &seed, sizeof seed);
    XXH3_128bits_update(&x, &parent, sizeof parent);
    XXH3_128bits_update(&x, ns, strlen(ns) + 1);
    if (n > 0)
        XXH3_128bits_update(&x, tokens, sizeof(int32_t) * (size_t)n);
    return kvt__rkey_digest(&x);
}
#endif

#endif
