/*
 * index.c: the radix tree of index.h. Owns its nodes and their token spans;
 * never owns, frees or inspects the values (entries) stored in it, and never
 * scans all entries: every query walks the tree along its tokens.
 */
#include "index.h"

#include "hmap.h"
#include "internal.h"

#include <string.h>

#define NO_REACH INT64_MAX

typedef struct inode {
    struct inode *parent;
    int32_t *edge;          /* (edge_len) tokens from the parent's end to ours */
    int64_t edge_len;
    int64_t depth;          /* tokens from the root to the end of this node */
    struct inode **kids;    /* (n_kids) sorted by kids[i]->edge[0] */
    uint32_t n_kids, cap_kids;
    void *val;              /* value ending exactly here, or NULL */
    int val_trimmable;
    int64_t val_reach;
    int64_t val_granule;    /* > 0: also cut back to its multiples below reach */
    int64_t sub_reach;      /* min reach of trimmable values in the subtree
                               (this node included); NO_REACH if none */
    int64_t sub_granule;    /* min granule of trimmable values in the subtree
                               that have one; NO_REACH if none */
} inode;

struct kvt__index {
    kvt__smap roots; /* ns -> inode* */
    size_t n_nodes;
};

int kvt__index_create(kvt__index **out)
{
    *out = kvt__calloc(1, sizeof **out);
    return *out ? 0 : kvt__fail(KVT_ENOMEM, "index: out of memory");
}

/* Frees the subtree under `root` (root included) without recursion: a
 * chain of nodes can be as deep as a prompt is long. */
static void free_tree(inode *root)
{
    inode *nd = root;
    while (nd) {
        if (nd->n_kids > 0) {
            nd = nd->kids[--nd->n_kids]; /* detach the last kid, go down */
            continue;
        }
        inode *up = nd == root ? NULL : nd->parent;
        kvt__free(nd->kids);
        kvt__free(nd->edge);
        kvt__free(nd);
        nd = up;
    }
}

static void free_root(const char *key, void *val, void *ctx)
{
    (void)key;
    (void)ctx;
    free_tree(val);
}

void kvt__index_destroy(kvt__index *ix)
{
    if (!ix)
        return;
    kvt__smap_foreach(&ix->roots, free_root, NULL);
    kvt__smap_free(&ix->roots);
    kvt__free(ix);
}

size_t kvt__index_nodes(const kvt__index *ix) { return ix->n_nodes; }

/* Index of the kid whose edge starts with token t, or where it would go. */
static uint32_t kid_slot(const inode *nd, int32_t t, int *found)
{
    uint32_t lo = 0, hi = nd->n_kids;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int32_t k = nd->kids[mid]->edge[0];
        if (k < t)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = lo < nd->n_kids && nd->kids[lo]->edge[0] == t;
    return lo;
}

static inode *kid_of(const inode *nd, int32_t t)
{
    int found;
    uint32_t i = kid_slot(nd, t, &found);
    return found ? nd->kids[i] : NULL;
}

/* Leading tokens of kid's edge that t[0..avail) matches (<= edge_len). */
static int64_t edge_match(const inode *kid, const int32_t *t, int64_t avail)
{
    int64_t m = 0, lim = KVT__MIN(kid->edge_len, avail);
    while (m < lim && kid->edge[m] == t[m])
        m++;
    return m;
}

/* Whether t[0..avail) starts with kid's whole edge. */
static int edge_within(const inode *kid, const int32_t *t, int64_t avail)
{
    return kid->edge_len <= avail && memcmp(kid->edge, t, (size_t)kid->edge_len * sizeof(int32_t)) == 0;
}

static int add_kid(inode *nd, inode *kid, uint32_t at)
{
    if (nd->n_kids == nd->cap_kids) {
        uint32_t cap = nd->cap_kids ? nd->cap_kids * 2 : 2;
        inode **k = kvt__realloc(nd->kids, cap * sizeof *k);
        if (!k)
            return KVT_ENOMEM;
        nd->kids = k;
        nd->cap_kids = cap;
    }
    memmove(nd->kids + at + 1, nd->kids + at, (nd->n_kids - at) * sizeof *nd->kids);
    nd->kids[at] = kid;
    nd->n_kids++;
    kid->parent = nd;
    return 0;
}

static void drop_kid(inode *nd, const inode *kid)
{
    int found;
    uint32_t i = kid_slot(nd, kid->edge[0], &found);
    if (!found)
        return;
    memmove(nd->kids + i, nd->kids + i + 1, (nd->n_kids - i - 1) * sizeof *nd->kids);
    nd->n_kids--;
}

static inode *new_node(kvt__index *ix, const int32_t *edge, int64_t len, int64_t depth)
{
    inode *nd = kvt__calloc(1, sizeof *nd);
    if (!nd)
        return NULL;
    nd->edge = kvt__malloc((size_t)(len ? len : 1) * sizeof(int32_t));
    if (!nd->edge) {
        kvt__free(nd);
        return NULL;
    }
    if (len)
        memcpy(nd->edge, edge, (size_t)len * sizeof(int32_t));
    nd->edge_len = len;
    nd->depth = depth;
    nd->sub_reach = NO_REACH;
    nd->sub_granule = NO_REACH;
    ix->n_nodes++;
    return nd;
}

static int64_t own_reach(const inode *nd)
{
    return nd->val && nd->val_trimmable ? nd->val_reach : NO_REACH;
}

static int64_t own_granule(const inode *nd)
{
    return nd->val && nd->val_trimmable && nd->val_granule > 0 ? nd->val_granule : NO_REACH;
}

/* Recomputes sub_reach and sub_granule from nd up to the root, stopping
 * once both are unchanged. */
static void fix_up(inode *nd)
{
    for (; nd; nd = nd->parent) {
        int64_t r = own_reach(nd), g = own_granule(nd);
        for (uint32_t i = 0; i < nd->n_kids; i++) {
            r = KVT__MIN(r, nd->kids[i]->sub_reach);
            g = KVT__MIN(g, nd->kids[i]->sub_granule);
        }
        if (r == nd->sub_reach && g == nd->sub_granule)
            return;
        nd->sub_reach = r;
        nd->sub_granule = g;
    }
}

/* Lowers sub_reach to at most r and sub_granule to at most g from nd up
 * (cheap path for inserts). */
static void lower_up(inode *nd, int64_t r, int64_t g)
{
    for (; nd && (r < nd->sub_reach || g < nd->sub_granule); nd = nd->parent) {
        nd->sub_reach = KVT__MIN(nd->sub_reach, r);
        nd->sub_granule = KVT__MIN(nd->sub_granule, g);
    }
}

/* Whether a trimmable value (or a subtree's, by its sub_ fields) is
 * reachable at p tokens: p >= reach, or p a multiple of the granule. */
static int reaches(int64_t reach, int64_t granule, int64_t p)
{
    return reach <= p || (granule > 0 && granule != NO_REACH && p % granule == 0);
}

/* Splits kid's edge after `at` tokens (0 < at < edge_len): a new middle node
 * takes the first `at` tokens and kid hangs below it. */
static inode *split(kvt__index *ix, inode *kid, int64_t at)
{
    inode *parent = kid->parent;
    inode *mid = new_node(ix, kid->edge, at, kid->depth - kid->edge_len + at);
    if (!mid)
        return NULL;
    int32_t *rest = kvt__malloc((size_t)(kid->edge_len - at) * sizeof(int32_t));
    inode **kids = kvt__malloc(2 * sizeof *kids);
    if (!rest || !kids) {
        kvt__free(rest);
        kvt__free(kids);
        free_tree(mid);
        ix->n_nodes--;
        return NULL;
    }
    memcpy(rest, kid->edge + at, (size_t)(kid->edge_len - at) * sizeof(int32_t));
    int found;
    uint32_t slot = kid_slot(parent, kid->edge[0], &found);
    parent->kids[slot] = mid; /* same first token: order kept */
    mid->parent = parent;
    kvt__free(kid->edge);
    kid->edge = rest;
    kid->edge_len -= at;
    mid->kids = kids;
    mid->cap_kids = 2;
    mid->kids[0] = kid;
    mid->n_kids = 1;
    kid->parent = mid;
    mid->sub_reach = kid->sub_reach;
    mid->sub_granule = kid->sub_granule;
    return mid;
}

static inode *root_of(const kvt__index *ix, const char *ns) { return kvt__smap_get(&ix->roots, ns); }

int kvt__index_insert(kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n, void *val,
                      int trimmable, int64_t reach, void **replaced)
{
    return kvt__index_insert_g(ix, ns, tokens, n, val, trimmable, reach, 0, replaced);
}

int kvt__index_insert_g(kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n, void *val,
                        int trimmable, int64_t reach, int64_t granule, void **replaced)
{
    *replaced = NULL;
    inode *nd = root_of(ix, ns);
    if (!nd) {
        nd = new_node(ix, NULL, 0, 0);
        if (!nd || kvt__smap_put(&ix->roots, ns, nd) != 0) {
            if (nd) {
                free_tree(nd);
                ix->n_nodes--;
            }
            return kvt__fail(KVT_ENOMEM, "index: out of memory");
        }
    }
    int64_t d = 0;
    while (d < n) {
        int found;
        uint32_t slot = kid_slot(nd, tokens[d], &found);
        if (!found) {
            inode *leaf = new_node(ix, tokens + d, n - d, n);
            if (!leaf)
                return kvt__fail(KVT_ENOMEM, "index: out of memory");
            if (add_kid(nd, leaf, slot) != 0) {
                free_tree(leaf);
                ix->n_nodes--;
                return kvt__fail(KVT_ENOMEM, "index: out of memory");
            }
            nd = leaf;
            d = n;
            break;
        }
        inode *kid = nd->kids[slot];
        int64_t m = edge_match(kid, tokens + d, n - d);
        if (m < kid->edge_len) {
            kid = split(ix, kid, m); /* a valueless node with one kid: a valid tree */
            if (!kid)
                return kvt__fail(KVT_ENOMEM, "index: out of memory");
        }
        nd = kid;
        d += m;
    }
    *replaced = nd->val;
    nd->val = val;
    nd->val_trimmable = trimmable;
    nd->val_reach = reach;
    nd->val_granule = granule > 0 ? granule : 0;
    if (*replaced)
        fix_up(nd);
    else
        lower_up(nd, own_reach(nd), own_granule(nd));
    return 0;
}

static inode *find_node(const kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n)
{
    inode *nd = root_of(ix, ns);
    int64_t d = 0;
    while (nd && d < n) {
        inode *kid = kid_of(nd, tokens[d]);
        if (!kid || !edge_within(kid, tokens + d, n - d))
            return NULL;
        d += kid->edge_len;
        nd = kid;
    }
    return nd;
}

void *kvt__index_exact(const kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n)
{
    inode *nd = find_node(ix, ns, tokens, n);
    return nd ? nd->val : NULL;
}

/* Merges a valueless single-kid node with its kid (best effort: skipped when
 * memory is short, which leaves a valid but less compact tree). */
static void merge_down(kvt__index *ix, inode *nd)
{
    inode *kid = nd->kids[0];
    int32_t *edge = kvt__malloc((size_t)(nd->edge_len + kid->edge_len) * sizeof(int32_t));
    if (!edge)
        return;
    memcpy(edge, nd->edge, (size_t)nd->edge_len * sizeof(int32_t));
    memcpy(edge + nd->edge_len, kid->edge, (size_t)kid->edge_len * sizeof(int32_t));
    inode *parent = nd->parent;
    int found;
    uint32_t slot = kid_slot(parent, nd->edge[0], &found);
    parent->kids[slot] = kid;
    kid->parent = parent;
    kvt__free(kid->edge);
    kid->edge = edge;
    kid->edge_len += nd->edge_len;
    nd->n_kids = 0;
    free_tree(nd);
    ix->n_nodes--;
}

void *kvt__index_remove(kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n)
{
    inode *nd = find_node(ix, ns, tokens, n);
    if (!nd || !nd->val)
        return NULL;
    void *val = nd->val;
    nd->val = NULL;
    nd->val_trimmable = 0;
    nd->val_reach = 0;
    nd->val_granule = 0;
    fix_up(nd);
    /* prune empty leaves upward, then re-compress a single-kid node */
    while (nd->parent && !nd->val && nd->n_kids == 0) {
        inode *parent = nd->parent;
        drop_kid(parent, nd);
        free_tree(nd);
        ix->n_nodes--;
        nd = parent;
    }
    if (nd->parent && !nd->val && nd->n_kids == 1)
        merge_down(ix, nd);
    else if (!nd->parent && !nd->val && nd->n_kids == 0) {
        kvt__smap_del(&ix->roots, ns);
        free_tree(nd);
        ix->n_nodes--;
    }
    return val;
}

int64_t kvt__index_lookup(const kvt__index *ix, const char *ns, const int32_t *prompt, int64_t n,
                          void **val)
{
    *val = NULL;
    inode *nd = root_of(ix, ns);
    int64_t cap = n - 1;
    if (!nd || cap < 1)
        return 0;
    int64_t best_a = 0, best_b = 0, d = 0;
    inode *a_node = NULL, *b_node = NULL;
    while (d < cap) {
        inode *kid = kid_of(nd, prompt[d]);
        if (!kid)
            break;
        int64_t m = edge_match(kid, prompt + d, cap - d);
        /* every value below kid shares d + m tokens with the prompt; one of
         * them reaches d + m, or the largest multiple of the smallest granule */
        int64_t s = d + m;
        int64_t c = kid->sub_reach <= s ? s : kid->sub_granule != NO_REACH ? s / kid->sub_granule * kid->sub_granule : 0;
        if (c > best_b) {
            best_b = c;
            b_node = kid;
        }
        if (m < kid->edge_len)
            break;
        d += m;
        nd = kid;
        if (nd->val) {
            best_a = d;
            a_node = nd;
        }
    }
    if (a_node && best_a >= best_b) {
        *val = a_node->val;
        return best_a;
    }
    if (!b_node)
        return 0;
    /* descend to a trimmable value reachable at best_b (exists by sub_reach) */
    nd = b_node;
    for (;;) {
        if (nd->val && nd->val_trimmable && reaches(nd->val_reach, nd->val_granule, best_b)) {
            *val = nd->val;
            return best_b;
        }
        inode *next = NULL;
        for (uint32_t i = 0; i < nd->n_kids && !next; i++)
            if (reaches(nd->kids[i]->sub_reach, nd->kids[i]->sub_granule, best_b))
                next = nd->kids[i];
        if (!next)
            return 0; /* unreachable while sub_reach is consistent */
        nd = next;
    }
}

void kvt__index_prefixes(const kvt__index *ix, const char *ns, const int32_t *tokens, int64_t n,
                         void (*fn)(void *val, int64_t depth, void *ctx), void *ctx)
{
    inode *nd = root_of(ix, ns);
    int64_t d = 0;
    while (nd && d < n) {
        if (nd->val)
            fn(nd->val, d, ctx);
        inode *kid = kid_of(nd, tokens[d]);
        if (!kid || !edge_within(kid, tokens + d, n - d))
            return;
        d += kid->edge_len;
        nd = kid;
    }
}
