/*
 * hmap.h: two small internal hash maps used by the prompt cache and its
 * index: kvt__umap (nonzero 64-bit key -> 64-bit value, open addressing with
 * linear probing and backward-shift deletion) and kvt__smap (string key ->
 * pointer, chained). Neither is thread-safe; neither is installed.
 */
#ifndef KVTIER_HMAP_H
#define KVTIER_HMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvt__umap {
    uint64_t *keys; /* (cap); 0 = empty slot */
    uint64_t *vals; /* (cap) */
    size_t cap;     /* power of two or 0 */
    size_t n;
} kvt__umap;

/** Frees the arrays and zeroes the map. */
void kvt__umap_free(kvt__umap *m);
/** Pointer to the value of key k (nonzero), NULL if absent; valid until the
 * next put or del. */
uint64_t *kvt__umap_get(const kvt__umap *m, uint64_t k);
/** Sets k -> v. @return 0 or KVT_ENOMEM (map unchanged). */
int kvt__umap_put(kvt__umap *m, uint64_t k, uint64_t v);
/** Removes k. @return 1 removed, 0 absent. */
int kvt__umap_del(kvt__umap *m, uint64_t k);

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
