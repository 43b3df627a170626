/*
 * retention.c: the built-in retention policies of retention.h: LRU and
 * segmented LRU (frequency-aware). Each keeps intrusive doubly linked lists
 * of nodes found by id through a hash map. Owns only its nodes; never sees
 * an entry's caches and never frees anything of the prompt cache.
 */
#include "kvtier/retention.h"

#include "hmap.h"
#include "internal.h"

#include <string.h>

typedef struct ret_node {
    struct ret_node *prev, *next; /* toward the more / less recently used end */
    uint64_t id;
    int seg;                      /* 0 probation (or the LRU list), 1 protected */
} ret_node;

typedef struct ret_list {
    ret_node *head, *tail; /* head = most recent, tail = least recent */
    size_t n;
} ret_list;

struct kvt_retention {
    kvt__umap by_id; /* id -> (uintptr_t) ret_node* */
    ret_list seg[2];
    int segmented;   /* 0 = LRU, 1 = SLRU */
};

static void list_unlink(ret_list *l, ret_node *nd)
{
    if (nd->prev)
        nd->prev->next = nd->next;
    else
        l->head = nd->next;
    if (nd->next)
        nd->next->prev = nd->prev;
    else
        l->tail = nd->prev;
    nd->prev = nd->next = NULL;
    l->n--;
}

static void list_push_head(ret_list *l, ret_node *nd)
{
    nd->prev = NULL;
    nd->next = l->head;
    if (l->head)
        l->head->prev = nd;
    else
        l->tail = nd;
    l->head = nd;
    l->n++;
}

static ret_node *find_node(kvt_retention *r, uint64_t id)
{
    uint64_t *v = kvt__umap_get(&r->by_id, id);
    return v ? (ret_node *)(uintptr_t)*v : NULL;
}

static int ret_create(kvt_retention **out, int segmented)
{
    kvt_retention *r = kvt__calloc(1, sizeof *r);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "retention: out of memory");
    r->segmented = segmented;
    *out = r;
    return 0;
}

static int lru_create(kvt_retention **out) { return ret_create(out, 0); }
static int slru_create(kvt_retention **out) { return ret_create(out, 1); }

static void ret_destroy(kvt_retention *r)
{
    if (!r)
        return;
    for (int s = 0; s < 2; s++) {
        ret_node *nd = r->seg[s].head;
        while (nd) {
            ret_node *next = nd->next;
            kvt__free(nd);
            nd = next;
        }
    }
    kvt__umap_free(&r->by_id);
    kvt__free(r);
}

static int ret_insert(kvt_retention *r, uint64_t id, size_t bytes, int64_t cost)
{
    ret_node *nd = find_node(r, id);
    if (nd) { /* re-insert of a known id counts as an access */
        list_unlink(&r->seg[nd->seg], nd);
        list_push_head(&r->seg[nd->seg], nd);
        return 0;
    }
    nd = kvt__calloc(1, sizeof *nd);
    if (!nd)
        return kvt__fail(KVT_ENOMEM, "retention: out of memory");
    nd->id = id;
    if (kvt__umap_put(&r->by_id, id, (uint64_t)(uintptr_t)nd) != 0) {
        kvt__free(nd);
        return kvt__fail(KVT_ENOMEM, "retention: out of memory");
    }
    list_push_head(&r->seg[0], nd);
    return 0;
}

static void ret_access(kvt_retention *r, uint64_t id, int64_t cost)
{
    ret_node *nd = find_node(r, id);
    if (!nd)
        return;
    list_unlink(&r->seg[nd->seg], nd);
    if (r->segmented)
        nd->seg = 1; /* second use: protected */
    list_push_head(&r->seg[nd->seg], nd);
    if (r->segmented) {
        size_t total = r->seg[0].n + r->seg[1].n;
        /* protected holds at most 80% of the entries */
        while (r->seg[1].n > 1 && r->seg[1].n * 5 > total * 4) {
            ret_node *old = r->seg[1].tail;
            list_unlink(&r->seg[1], old);
            old->seg = 0;
            list_push_head(&r->seg[0], old);
        }
    }
}

static void ret_remove(kvt_retention *r, uint64_t id)
{
    ret_node *nd = find_node(r, id);
    if (!nd)
        return;
    list_unlink(&r->seg[nd->seg], nd);
    kvt__umap_del(&r->by_id, id);
    kvt__free(nd);
}

static int ret_victim(kvt_retention *r, kvt_retention_eligible_fn eligible, void *ctx, uint64_t *out)
{
    for (int s = 0; s < 2; s++)
        for (ret_node *nd = r->seg[s].tail; nd; nd = nd->prev)
            if (!eligible || eligible(ctx, nd->id)) {
                *out = nd->id;
                return 0;
            }
    return KVT_ENOTFOUND;
}

KVT_API const kvt_retention_ops kvt_retention_lru = {
    "lru", lru_create, ret_destroy, ret_insert, ret_access, ret_remove, ret_victim,
};

KVT_API const kvt_retention_ops kvt_retention_slru = {
    "slru", slru_create, ret_destroy, ret_insert, ret_access, ret_remove, ret_victim,
};

KVT_API const kvt_retention_ops *kvt_retention_by_name(const char *name)
{
    if (!name)
        return NULL;
    if (strcmp(name, "lru") == 0)
        return &kvt_retention_lru;
    if (strcmp(name, "slru") == 0)
        return &kvt_retention_slru;
    return NULL;
}
