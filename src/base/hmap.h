/*
 * hmap.h: the internal hash maps: kvt__kmap (128-bit content key -> 64-bit
 * value, open addressing with linear probing and backward-shift deletion),
 * kvt__umap (the same map keyed by a nonzero 64-bit word) and kvt__smap
 * (string key -> pointer, chained). The RAM tier, the index and the SSD tier
 * use them. None is thread-safe; none is installed.
 */
#ifndef KVTIER_HMAP_H
#define KVTIER_HMAP_H

#include <stddef.h>
#include <stdint.h>

#include "key.h"

/* ---- kvt__kmap: 128-bit key -> 64-bit value ------------------------------- */

/** Open addressing with linear probing and backward-shift deletion (no
 * tombstones: a map that sees many puts and deletes never degrades). The
 * zero key marks an empty slot and cannot be stored. Zero-initialise to get
 * an empty map. */
typedef struct kvt__kmap {
    kvt__key *keys; /* (cap); KVT__KEY_ZERO = empty slot */
    uint64_t *vals; /* (cap) */
    size_t cap;     /* power of two or 0 */
    size_t n;       /* keys stored */
} kvt__kmap;

/** Frees the arrays (not what values point at) and zeroes the map. */
void kvt__kmap_free(kvt__kmap *m);
/** Pointer to the value of k, NULL if absent (or k is zero); valid until the
 * next put or del. */
uint64_t *kvt__kmap_get(const kvt__kmap *m, kvt__key k);
/** Sets k -> v, replacing. @return 0; KVT_EINVAL (k is the zero key);
 * KVT_ENOMEM (map unchanged). */
int kvt__kmap_put(kvt__kmap *m, kvt__key k, uint64_t v);
/** Removes k. @return 1 removed, 0 absent. */
int kvt__kmap_del(kvt__kmap *m, kvt__key k);
/** Calls fn for every (key, value); fn must not modify the map. */
void kvt__kmap_foreach(const kvt__kmap *m, void (*fn)(kvt__key k, uint64_t v, void *ctx), void *ctx);

/** A pointer stored as a value: the pointer under k, NULL if absent. */
static inline void *kvt__kmap_ptr(const kvt__kmap *m, kvt__key k)
{
    uint64_t *v = kvt__kmap_get(m, k);
    return v ? (void *)(uintptr_t)*v : NULL;
}
/** Sets k -> the pointer p. @return as kvt__kmap_put. */
static inline int kvt__kmap_put_ptr(kvt__kmap *m, kvt__key k, void *p)
{
    return kvt__kmap_put(m, k, (uint64_t)(uintptr_t)p);
}

/* ---- kvt__umap: nonzero 64-bit key -> 64-bit value (a kvt__kmap) ---------- */

/** The same map keyed by a nonzero 64-bit word (stored as the key {k, 0}). */
typedef kvt__kmap kvt__umap;

static inline kvt__key kvt__umap_key(uint64_t k) { return (kvt__key){k, 0}; }
/** Frees the arrays and zeroes the map. */
static inline void kvt__umap_free(kvt__umap *m) { kvt__kmap_free(m); }
/** Pointer to the value of key k (nonzero), NULL if absent; valid until the
 * next put or del. */
static inline uint64_t *kvt__umap_get(const kvt__umap *m, uint64_t k) { return kvt__kmap_get(m, kvt__umap_key(k)); }
/** Sets k -> v (k nonzero). @return 0; KVT_EINVAL (k is 0); KVT_ENOMEM (map
 * unchanged). */
static inline int kvt__umap_put(kvt__umap *m, uint64_t k, uint64_t v) { return kvt__kmap_put(m, kvt__umap_key(k), v); }
/** Removes k. @return 1 removed, 0 absent. */
static inline int kvt__umap_del(kvt__umap *m, uint64_t k) { return kvt__kmap_del(m, kvt__umap_key(k)); }

/* ---- kvt__smap: string key -> pointer ------------------------------------- */

typedef struct kvt__snode {
    struct kvt__snode *next;
    uint64_t hash;
    void *val;
    char key[]; /* NUL-terminated copy */
} kvt__snode;

typedef struct kvt__smap {
    kvt__snode **buckets; /* (cap) */
    size_t cap;           /* power of two or 0 */
    size_t n;
} kvt__smap;

/** Frees every node (not the values) and zeroes the map. */
void kvt__smap_free(kvt__smap *m);
/** Value stored under key, NULL if absent. */
void *kvt__smap_get(const kvt__smap *m, const char *key);
/** Node of key, NULL if absent (its key is stable until it is deleted). */
kvt__snode *kvt__smap_node(const kvt__smap *m, const char *key);
/** Sets key -> val (copies the key). @return 0 or KVT_ENOMEM. */
int kvt__smap_put(kvt__smap *m, const char *key, void *val);
/** Removes key; returns its value (NULL if absent). */
void *kvt__smap_del(kvt__smap *m, const char *key);
/** Calls fn for every (key, value); fn must not modify the map. */
void kvt__smap_foreach(const kvt__smap *m, void (*fn)(const char *key, void *val, void *ctx), void *ctx);

/** 64-bit mix of a 64-bit key (splitmix64 finalizer). */
static inline uint64_t kvt__mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

#endif
