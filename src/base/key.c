/*
 * key.c: the content keys of key.h. xxHash is compiled inline here, so the
 * hash state lives on the stack: computing a key never allocates and never
 * fails. It owns nothing and keeps no state between calls.
 */
#include "key.h"

#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#define KVT__KEY_SWAP 1 /* tokens are hashed little-endian: convert on big-endian hosts */
#endif

/* ---- hex --------------------------------------------------------------------- */

void kvt__hex(const uint8_t *bytes, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    out[2 * n] = '\0';
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int kvt__unhex(const char *s, uint8_t *out, size_t n)
{
    if (strlen(s) != 2 * n)
        return -1;
    for (size_t i = 0; i < n; i++) {
        int h = hexval(s[2 * i]), l = hexval(s[2 * i + 1]);
        if (h < 0 || l < 0)
            return -1;
        out[i] = (uint8_t)(h << 4 | l);
    }
    return 0;
}

void kvt__key_hex(kvt__key k, char out[33])
{
    uint8_t b[16];
    for (int i = 0; i < 8; i++) {
        b[i] = (uint8_t)(k.hi >> (56 - 8 * i));
        b[8 + i] = (uint8_t)(k.lo >> (56 - 8 * i));
    }
    kvt__hex(b, 16, out);
}

int kvt__key_parse(const char *s, kvt__key *out)
{
    uint8_t b[16];
    if (kvt__unhex(s, b, 16))
        return -1;
    kvt__key k = KVT__KEY_ZERO;
    for (int i = 0; i < 8; i++) {
        k.hi = k.hi << 8 | b[i];
        k.lo = k.lo << 8 | b[8 + i];
    }
    *out = k;
    return 0;
}

/* ---- keys -------------------------------------------------------------------- */

static kvt__key digest(XXH3_state_t *x)
{
    XXH128_hash_t h = XXH3_128bits_digest(x);
    return (kvt__key){h.low64, h.high64};
}

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* A key as 16 bytes: lo then hi, each little-endian. */
static void update_key(XXH3_state_t *x, kvt__key k)
{
    uint8_t b[16];
    put_le64(b, k.lo);
    put_le64(b + 8, k.hi);
    XXH3_128bits_update(x, b, sizeof b);
}

/* n int32 tokens, little-endian. */
static void update_tokens(XXH3_state_t *x, const int32_t *tokens, int64_t n)
{
    if (n <= 0)
        return;
#ifndef KVT__KEY_SWAP
    XXH3_128bits_update(x, tokens, sizeof(int32_t) * (size_t)n);
#else
    uint8_t b[1024];
    for (int64_t i = 0; i < n;) {
        size_t k = 0;
        for (; i < n && k + 4 <= sizeof b; i++, k += 4) {
            uint32_t v = (uint32_t)tokens[i];
            b[k] = (uint8_t)v, b[k + 1] = (uint8_t)(v >> 8), b[k + 2] = (uint8_t)(v >> 16), b[k + 3] = (uint8_t)(v >> 24);
        }
        XXH3_128bits_update(x, b, k);
    }
#endif
}

kvt__key kvt__key_seed(const char *identity)
{
    if (!identity)
        return KVT__KEY_ZERO;
    XXH128_hash_t h = XXH3_128bits(identity, strlen(identity));
    return (kvt__key){h.low64, h.high64};
}

kvt__key kvt__entry_key(kvt__key seed, const char *ns, const int32_t *tokens, int64_t n)
{
    XXH3_state_t x;
    XXH3_128bits_reset(&x);
    XXH3_128bits_update(&x, "e", 1);
    update_key(&x, seed);
    XXH3_128bits_update(&x, ns, strlen(ns) + 1);
    update_tokens(&x, tokens, n);
    return digest(&x);
}

kvt__key kvt__block_key(kvt__key seed, const char *ns, kvt__key parent, const int32_t *tokens, int64_t n)
{
    XXH3_state_t x;
    XXH3_128bits_reset(&x);
    XXH3_128bits_update(&x, "b", 1);
    update_key(&x, seed);
    update_key(&x, parent);
    XXH3_128bits_update(&x, ns, strlen(ns) + 1);
    update_tokens(&x, tokens, n);
    return digest(&x);
}
