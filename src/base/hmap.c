/*
 * hmap.c: the internal hash maps of hmap.h. Owns only the maps' own arrays
 * and nodes; never frees or touches the values stored in them.
 */
#include "hmap.h"

#include "internal.h"

#include <string.h>

/* ---- kvt__kmap ----------------------------------------------------------- */

static int is_empty(kvt__key k) { return !k.lo && !k.hi; }

/* Home slot of k: content keys are random already; {k, 0} keys of kvt__umap
 * get the splitmix finalizer of k, as the 64-bit map always did. */
static size_t home(kvt__key k, size_t mask) { return (size_t)kvt__mix64(k.lo ^ kvt__mix64(k.hi)) & mask; }

void kvt__kmap_free(kvt__kmap *m)
{
    kvt__free(m->keys);
    kvt__free(m->vals);
    memset(m, 0, sizeof *m);
}

uint64_t *kvt__kmap_get(const kvt__kmap *m, kvt__key k)
{
    if (!m->cap || is_empty(k))
        return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = home(k, mask);; i = (i + 1) & mask) {
        if (kvt__key_eq(m->keys[i], k))
            return &m->vals[i];
        if (is_empty(m->keys[i]))
            return NULL;
    }
}

static void kmap_insert(kvt__key *keys, uint64_t *vals, size_t cap, kvt__key k, uint64_t v)
{
    size_t mask = cap - 1;
    size_t i = home(k, mask);
    while (!is_empty(keys[i]) && !kvt__key_eq(keys[i], k))
        i = (i + 1) & mask;
    keys[i] = k;
    vals[i] = v;
}

int kvt__kmap_put(kvt__kmap *m, kvt__key k, uint64_t v)
{
    if (is_empty(k))
        return KVT_EINVAL;
    uint64_t *slot = kvt__kmap_get(m, k);
    if (slot) {
        *slot = v;
        return 0;
    }
    if ((m->n + 1) * 4 > m->cap * 3) {
        size_t cap = m->cap ? m->cap * 2 : 16;
        kvt__key *keys = kvt__calloc(cap, sizeof *keys);
        uint64_t *vals = kvt__calloc(cap, sizeof *vals);
        if (!keys || !vals) {
            kvt__free(keys);
            kvt__free(vals);
            return KVT_ENOMEM;
        }
        for (size_t i = 0; i < m->cap; i++)
            if (!is_empty(m->keys[i]))
                kmap_insert(keys, vals, cap, m->keys[i], m->vals[i]);
        kvt__free(m->keys);
        kvt__free(m->vals);
        m->keys = keys;
        m->vals = vals;
        m->cap = cap;
    }
    kmap_insert(m->keys, m->vals, m->cap, k, v);
    m->n++;
    return 0;
}

int kvt__kmap_del(kvt__kmap *m, kvt__key k)
{
    if (!m->cap || is_empty(k))
        return 0;
    size_t mask = m->cap - 1;
    size_t i = home(k, mask);
    while (!kvt__key_eq(m->keys[i], k)) {
        if (is_empty(m->keys[i]))
            return 0;
        i = (i + 1) & mask;
    }
    /* backward-shift deletion keeps probe chains intact without tombstones */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (is_empty(m->keys[j]))
            break;
        size_t h = home(m->keys[j], mask);
        /* move j into the hole at i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (h > i && h <= j) : (h > i || h <= j);
        if (stays)
            continue;
        m->keys[i] = m->keys[j];
        m->vals[i] = m->vals[j];
        i = j;
    }
    m->keys[i] = KVT__KEY_ZERO;
    m->vals[i] = 0;
    m->n--;
    return 1;
}

void kvt__kmap_foreach(const kvt__kmap *m, void (*fn)(kvt__key k, uint64_t v, void *ctx), void *ctx)
{
    for (size_t i = 0; i < m->cap; i++)
        if (!is_empty(m->keys[i]))
            fn(m->keys[i], m->vals[i], ctx);
}

/* ---- kvt__smap ----------------------------------------------------------- */

static uint64_t str_hash(const char *s)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

void kvt__smap_free(kvt__smap *m)
{
    for (size_t i = 0; i < m->cap; i++) {
        kvt__snode *nd = m->buckets[i];
        while (nd) {
            kvt__snode *next = nd->next;
            kvt__free(nd);
            nd = next;
        }
    }
    kvt__free(m->buckets);
    memset(m, 0, sizeof *m);
}

kvt__snode *kvt__smap_node(const kvt__smap *m, const char *key)
{
    if (!m->cap)
        return NULL;
    uint64_t h = str_hash(key);
    for (kvt__snode *nd = m->buckets[h & (m->cap - 1)]; nd; nd = nd->next)
        if (nd->hash == h && strcmp(nd->key, key) == 0)
            return nd;
    return NULL;
}

void *kvt__smap_get(const kvt__smap *m, const char *key)
{
    kvt__snode *nd = kvt__smap_node(m, key);
    return nd ? nd->val : NULL;
}

int kvt__smap_put(kvt__smap *m, const char *key, void *val)
{
    kvt__snode *nd = kvt__smap_node(m, key);
    if (nd) {
        nd->val = val;
        return 0;
    }
    if (m->n + 1 > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 16;
        kvt__snode **b = kvt__calloc(cap, sizeof *b);
        if (!b)
            return KVT_ENOMEM;
        for (size_t i = 0; i < m->cap; i++) {
            kvt__snode *x = m->buckets[i];
            while (x) {
                kvt__snode *next = x->next;
                x->next = b[x->hash & (cap - 1)];
                b[x->hash & (cap - 1)] = x;
                x = next;
            }
        }
        kvt__free(m->buckets);
        m->buckets = b;
        m->cap = cap;
    }
    size_t len = strlen(key);
    nd = kvt__malloc(sizeof *nd + len + 1);
    if (!nd)
        return KVT_ENOMEM;
    memcpy(nd->key, key, len + 1);
    nd->hash = str_hash(key);
    nd->val = val;
    nd->next = m->buckets[nd->hash & (m->cap - 1)];
    m->buckets[nd->hash & (m->cap - 1)] = nd;
    m->n++;
    return 0;
}

void *kvt__smap_del(kvt__smap *m, const char *key)
{
    if (!m->cap)
        return NULL;
    uint64_t h = str_hash(key);
    for (kvt__snode **pp = &m->buckets[h & (m->cap - 1)]; *pp; pp = &(*pp)->next) {
        kvt__snode *nd = *pp;
        if (nd->hash == h && strcmp(nd->key, key) == 0) {
            void *val = nd->val;
            *pp = nd->next;
            kvt__free(nd);
            m->n--;
            return val;
        }
    }
    return NULL;
}

void kvt__smap_foreach(const kvt__smap *m, void (*fn)(const char *key, void *val, void *ctx), void *ctx)
{
    for (size_t i = 0; i < m->cap; i++)
        for (kvt__snode *nd = m->buckets[i]; nd; nd = nd->next)
            fn(nd->key, nd->val, ctx);
}
