/*
 * engine/util.h: the helpers of the engine (and of server/ and tools/replay,
 * built on it), over kvtier's public API only (kvtier/common.h): the
 * engine never includes the library's private headers, so it builds against
 * an installed kvtier and links against the shared library.
 *
 * The names are those the library uses inside, so engine code reads like
 * library code, each mapped onto its public call:
 *   kvt__fail(code, fmt, ...)  kvt_set_error: records the sentence for
 *                              kvt_last_error() and returns code;
 *   kvt__malloc, kvt__calloc, kvt__realloc, kvt__free, kvt__strdup
 *                              through the allocator kvt_set_allocator
 *                              installed (out-of-memory tests reach the
 *                              engine too);
 *   KVT__MIN, KVT__MAX.
 * Never installed. Thread-safe as the calls they map to.
 */
#ifndef KVT_ENGINE_UTIL_H
#define KVT_ENGINE_UTIL_H

#include "kvtier/common.h"

#include <string.h>

#define kvt__fail kvt_set_error
#define kvt__malloc kvt_malloc
#define kvt__calloc kvt_calloc
#define kvt__realloc kvt_realloc
#define kvt__free kvt_free

/* A copy of s through kvt_malloc (free with kvt__free); NULL when out of memory. */
static inline char *kvt__eng_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = kvt_malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}
#define kvt__strdup kvt__eng_strdup

#define KVT__MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVT__MAX(a, b) ((a) > (b) ? (a) : (b))

#endif /* KVT_ENGINE_UTIL_H */
