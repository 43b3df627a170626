/*
 * store_index.c: the SSD tier's in-memory index structures: an open-addressing
 * map from 128-bit keys to pointers, and a radix tree over token sequences
 * that answers "longest usable prefix" in one walk of the prompt.
 * It owns only its nodes and slot arrays, never the entries it points at, and
 * does no I/O and no locking (store.c holds its mutex around every call).
 */
#include "internal.h"
#include "store_internal.h"

#include <string.h>

/* ---- key map ---------------------------------------------------------------- */

#define TOMB ((void *)1)

static size_t slot_of(kvt__key k, size_t cap) { return (size_t)(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)) & (cap - 1); }

void *kvt__kmap_get(const kvt__kmap *m, kvt__key k)
{
    if (!m->cap)
        return NULL;
    for (size_t i = slot_of(k, m->cap), n = 0; n < m->cap; i = (i + 1) & (m->cap - 1), n++) {
        if (!m->vals[i])
            return NULL;
        if (m->vals[i] != TOMB && kvt__key_eq(m->keys[i], k))
            return m->vals[i];
    }
    return NULL;
}

static int grow(kvt__kmap *m)
{
    size_t cap = m->cap ? m->cap * 2 : 64;
    if (m->live * 4 < m->cap) /* mostly tombstones: rehash at the same size */
        cap = m->cap;
    kvt__key *keys = kvt__calloc(cap, sizeof *keys);
    void **vals = kvt__calloc(cap, sizeof *vals);
    if (!keys || !vals) {
        kvt__free(keys);
        kvt__free(vals);
        return KVT_ENOMEM;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->vals[i] || m->vals[i] == TOMB)
            continue;
        size_t j = slot_of(m->keys[i], cap);
        while (vals[j])
            j = (j + 1) & (cap - 1);
        keys[j] = m->keys[i];
        vals[j] = m->vals[i];
    }
    kvt__free(m->keys);
    kvt__free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    m->used = m->live;
    return 0;
}

int kvt__kmap_put(kvt__kmap *m, kvt__key k, void *v)
{
    if ((m->used + 1) * 4 > m->cap * 3 && grow(m))
        return KVT_ENOMEM;
    size_t tomb = SIZE_MAX;
    size_t i = slot_of(k, m->cap);
    for (;; i = (i + 1) & (m->cap - 1)) {
        if (!m->vals[i])
            break;
        if (m->vals[i] == TOMB) {
            if (tomb == SIZE_MAX)
                tomb = i;
            continue;
        }
        if (kvt__key_eq(m->keys[i], k)) {
            m->vals[i] = v;
            return 0;
        }
    }
    if (tomb != SIZE_MAX)
        i = tomb;
    else
        m->used++;
    m->keys[i] = k;
    m->vals[i] = v;
    m->live++;
    return 0;
}

void kvt__kmap_del(kvt__kmap *m, kvt__key k)
{
    if (!m->cap)
        return;
    for (size_t i = slot_of(k, m->cap), n = 0; n < m->cap; i = (i + 1) & (m->cap - 1), n++) {
        if (!m->vals[i])
            return;
        if (m->vals[i] != TOMB && kvt__key_eq(m->keys[i], k)) {
            m->vals[i] = TOMB;
            m->live--;
            return;
        }
    }
}

void kvt__kmap_free(kvt__kmap *m)
{
    kvt__free(m->keys);
    kvt__free(m->vals);
    memset(m, 0, sizeof *m);
}

/* ---- radix tree --------------------------------------------------------------- */

struct kvt__rnode {
    int32_t *label;        /* (label_len) tokens of the edge into this node */
    int64_t label_len;
    int64_t depth;         /* tokens from the root to the end of this node */
    kvt__rnode *parent;
    kvt__rnode **kids;     /* (n_kids) */
    int32_t n_kids, cap_kids;
    kvt__rent **ents;      /* (n_ents) entries whose tokens end exactly here */
    int32_t n_ents, cap_ents;
    int64_t sub_min_reach; /* min over the subtree's entries; INT64_MAX when none */
};

static kvt__rnode *node_new(kvt__rnode *parent, const int32_t *label, int64_t len)
{
    kvt__rnode *n = kvt__calloc(1, sizeof *n);
    if (!n)
        return NULL;
    if (len) {
        n->label = kvt__malloc(sizeof(int32_t) * (size_t)len);
        if (!n->label) {
            kvt__free(n);
            return NULL;
        }
        memcpy(n->label, label, sizeof(int32_t) * (size_t)len);
    }
    n->label_len = len;
    n->parent = parent;
    n->depth = (parent ? parent->depth : 0) + len;
    n->sub_min_reach = INT64_MAX;
    return n;
}

static void node_free(kvt__rnode *n)
{
    if (!n)
        return;
    for (int32_t i = 0; i < n->n_kids; i++)
        node_free(n->kids[i]);
    kvt__free(n->kids);
    kvt__free(n->ents);
    kvt__free(n->label);
    kvt__free(n);
}

static int push_ptr(void ***arr, int32_t *n, int32_t *cap, void *p)
{
    if (*n == *cap) {
        int32_t c = *cap ? *cap * 2 : 2;
        void **a = kvt__realloc(*arr, sizeof(void *) * (size_t)c);
        if (!a)
            return KVT_ENOMEM;
        *arr = a;
        *cap = c;
    }
    (*arr)[(*n)++] = p;
    return 0;
}

static void recompute_up(kvt__rnode *n)
{
    for (; n; n = n->parent) {
        int64_t m = INT64_MAX;
        for (int32_t i = 0; i < n->n_ents; i++)
            m = KVT__MIN(m, n->ents[i]->min_reach);
        for (int32_t i = 0; i < n->n_kids; i++)
            m = KVT__MIN(m, n->kids[i]->sub_min_reach);
        n->sub_min_reach = m;
    }
}

static kvt__rnode *child_for(const kvt__rnode *n, int32_t tok)
{
    for (int32_t i = 0; i < n->n_kids; i++)
        if (n->kids[i]->label[0] == tok)
            return n->kids[i];
    return NULL;
}

static int64_t common(const int32_t *a, const int32_t *b, int64_t n)
{
    int64_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* Splits the edge into `c` after `at` tokens; returns the new middle node. */
static kvt__rnode *split(kvt__rnode *c, int64_t at)
{
    kvt__rnode *p = c->parent;
    kvt__rnode *mid = node_new(p, c->label, at);
    if (!mid)
        return NULL;
    int32_t *rest = kvt__malloc(sizeof(int32_t) * (size_t)(c->label_len - at));
    if (!rest || push_ptr((void ***)&mid->kids, &mid->n_kids, &mid->cap_kids, c)) {
        kvt__free(rest);
        node_free(mid);
        return NULL;
    }
    memcpy(rest, c->label + at, sizeof(int32_t) * (size_t)(c->label_len - at));
    kvt__free(c->label);
    c->label = rest;
    c->label_len -= at;
    c->parent = mid;
    mid->sub_min_reach = c->sub_min_reach;
    for (int32_t i = 0; i < p->n_kids; i++)
        if (p->kids[i] == c)
            p->kids[i] = mid;
    return mid;
}

int kvt__radix_insert(kvt__radix *r, kvt__rent *e)
{
    if (!r->root && !(r->root = node_new(NULL, NULL, 0)))
        return KVT_ENOMEM;
    kvt__rnode *n = r->root;
    int64_t d = 0;
    while (d < e->n_tokens) {
        kvt__rnode *c = child_for(n, e->tokens[d]);
        if (!c) {
            kvt__rnode *leaf = node_new(n, e->tokens + d, e->n_tokens - d);
            if (!leaf || push_ptr((void ***)&n->kids, &n->n_kids, &n->cap_kids, leaf)) {
                node_free(leaf);
                return KVT_ENOMEM;
            }
            n = leaf;
            d = e->n_tokens;
            break;
        }
        int64_t m = common(c->label, e->tokens + d, KVT__MIN(c->label_len, e->n_tokens - d));
        if (m < c->label_len && !(c = split(c, m)))
            return KVT_ENOMEM;
        n = c;
        d += m;
    }
    if (push_ptr((void ***)&n->ents, &n->n_ents, &n->cap_ents, e))
        return KVT_ENOMEM;
    e->node = n;
    recompute_up(n);
    return 0;
}

void kvt__radix_remove(kvt__radix *r, kvt__rent *e)
{
    kvt__rnode *n = e->node;
    if (!n)
        return;
    for (int32_t i = 0; i < n->n_ents; i++)
        if (n->ents[i] == e) {
            n->ents[i] = n->ents[--n->n_ents];
            break;
        }
    e->node = NULL;
    /* Drop empty leaves upward (interior single-child nodes are kept). */
    while (n->parent && !n->n_ents && !n->n_kids) {
        kvt__rnode *p = n->parent;
        for (int32_t i = 0; i < p->n_kids; i++)
            if (p->kids[i] == n) {
                p->kids[i] = p->kids[--p->n_kids];
                break;
            }
        node_free(n);
        n = p;
    }
    recompute_up(n);
    (void)r;
}

kvt__rent *kvt__radix_find(const kvt__radix *r, const int32_t *prompt, int64_t n, int64_t *prefix_len)
{
    if (!r->root || n < 2)
        return NULL;
    int64_t cap = n - 1, best = 0;
    const kvt__rnode *best_node = NULL, *node = r->root;
    int64_t d = 0;
    while (d < n) {
        const kvt__rnode *c = child_for(node, prompt[d]);
        if (!c)
            break;
        int64_t m = d + common(c->label, prompt + d, KVT__MIN(c->label_len, n - d));
        int64_t p = KVT__MIN(m, cap);
        if (c->sub_min_reach <= p && p > best) {
            best = p;
            best_node = c;
        }
        if (m < c->depth)
            break;
        node = c;
        d = m;
    }
    if (!best_node)
        return NULL;
    /* Descend to the shortest entry usable at `best`. */
    const kvt__rnode *x = best_node;
    for (;;) {
        kvt__rent *pick = NULL;
        for (int32_t i = 0; i < x->n_ents; i++)
            if (x->ents[i]->min_reach <= best && (!pick || x->ents[i]->n_tokens < pick->n_tokens))
                pick = x->ents[i];
        if (pick) {
            *prefix_len = best;
            return pick;
        }
        const kvt__rnode *next = NULL;
        for (int32_t i = 0; i < x->n_kids && !next; i++)
            if (x->kids[i]->sub_min_reach <= best)
                next = x->kids[i];
        if (!next)
            return NULL; /* unreachable while sub_min_reach is kept exact */
        x = next;
    }
}

static const kvt__rnode *walk_exact(const kvt__radix *r, const int32_t *tokens, int64_t n)
{
    const kvt__rnode *node = r->root;
    int64_t d = 0;
    while (node && d < n) {
        const kvt__rnode *c = child_for(node, tokens[d]);
        if (!c || c->label_len > n - d || common(c->label, tokens + d, c->label_len) != c->label_len)
            return NULL;
        node = c;
        d += c->label_len;
    }
    return node;
}

kvt__rent *kvt__radix_exact(const kvt__radix *r, const int32_t *tokens, int64_t n)
{
    const kvt__rnode *node = walk_exact(r, tokens, n);
    if (!node)
        return NULL;
    for (int32_t i = 0; i < node->n_ents; i++)
        if (node->ents[i]->n_tokens == n)
            return node->ents[i];
    return NULL;
}

void kvt__radix_ancestors(const kvt__radix *r, const int32_t *tokens, int64_t n,
                          void (*fn)(kvt__rent *e, void *ctx), void *ctx)
{
    /* Collect first: fn may remove entries (and free nodes). */
    kvt__rent *stack[256];
    int32_t k = 0;
    const kvt__rnode *node = r->root;
    int64_t d = 0;
    while (node && d < n) {
        for (int32_t i = 0; i < node->n_ents && k < 256; i++)
            stack[k++] = node->ents[i];
        const kvt__rnode *c = child_for(node, tokens[d]);
        if (!c || c->label_len > n - d || common(c->label, tokens + d, c->label_len) != c->label_len)
            break;
        node = c;
        d += c->label_len;
    }
    for (int32_t i = 0; i < k; i++)
        if (stack[i]->n_tokens < n)
            fn(stack[i], ctx);
}

void kvt__radix_free(kvt__radix *r)
{
    node_free(r->root);
    r->root = NULL;
}
