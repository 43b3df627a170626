/*
 * retention_block.c: block-granular retention policies (lru, lfu-aged,
 * lfu-learned): an indexed min-heap of resident blocks ordered by (priority,
 * -depth), a key to slot hash table, for the lfu policies a count-min sketch
 * of use counts and, for lfu-learned, a direct-mapped ghost table of
 * first-use classes with their learned reuse rates.
 * It only orders blocks its owner reports; it must never free or evict
 * anything itself, and never allocate per touch once its tables have grown.
 */
#include "kvtier/experimental/retention_block.h"

#include "hmap.h"
#include "internal.h"

#include <string.h>

enum { POL_LRU = 0, POL_LFU_AGED = 1, POL_LFU_LEARNED = 2 };

static const char *const kvt__block_policy_names[] = {"lru", "lfu-aged", "lfu-learned"};
#define KVT__N_BLOCK_POLICIES 3

/* Tail blocks sort below every normal block. */
#define KVT__TAIL_PENALTY ((int64_t)1 << 52)
#define KVT__FREQ_CAP 3
#define KVT__SKETCH_PER_BLOCK 16
#define KVT__AGE_PERIOD 32
/* lfu-learned: first uses fall in KVT__N_CLASSES classes (5 buckets of the
 * depth where the request's new blocks start x 6 buckets of the depth past
 * it); a first use is moved by up to KVT__LEARN_GAIN capacities up or down
 * by its class's reuse rate against the mean (prior weight KVT__LEARN_PRIOR
 * uses); the rates halve every KVT__LEARN_PERIOD capacities of first uses;
 * the ghost table holds KVT__GHOST_PER_BLOCK entries per capacity block. */
#define KVT__N_CLASSES 30
#define KVT__LEARN_GAIN 1.0
#define KVT__LEARN_PRIOR 20.0
#define KVT__LEARN_PERIOD 8
#define KVT__GHOST_PER_BLOCK 16

typedef struct slot {
    uint64_t key;
    int64_t prio;  /* higher = kept longer */
    int64_t last;  /* clock of its last use */
    int32_t depth; /* block index in its prompt; deeper goes first on ties */
    int32_t heap;  /* position in heap[] */
    int64_t adj;   /* lfu-learned: first-use offset, reapplied at the same clock */
} slot;

struct kvt_block_policy {
    int kind;
    int64_t capacity;
    /* resident blocks */
    slot *slots;      /* (n_slots) */
    int32_t n_slots, cap_slots;
    int32_t *free;    /* (n_free) free slot indices */
    int32_t n_free;   /* the list has room for cap_slots */
    int32_t *heap;    /* (n_heap) slot indices, min-heap on (prio, -depth) */
    int32_t n_heap;
    /* open addressing key -> slot+1 (0 empty, -1 deleted) */
    int32_t *table;   /* (table_size) */
    int64_t table_size, table_used;
    /* lfu-aged: count-min sketch, two rows of sketch_size uint8 counters */
    uint8_t *sketch;  /* (2, sketch_size) */
    int64_t sketch_size;
    int64_t touches;
    /* lfu-learned: ghost entries (tag << 5 | class + 1; low bits 0 = none or
     * reused already), first uses and first reuses per class (halved
     * periodically), the request being inserted (clock, depth of its first
     * new block) */
    uint32_t *ghost;  /* (ghost_size) */
    int64_t ghost_size;
    double firsts[KVT__N_CLASSES], reuses[KVT__N_CLASSES], all_firsts, all_reuses;
    int64_t n_firsts;
    int64_t req_clock;
    int32_t req_first_new;
};

/* ---- heap ---------------------------------------------------------------- */

static int before(const kvt_block_policy *p, int32_t a, int32_t b)
{
    const slot *x = &p->slots[a], *y = &p->slots[b];
    if (x->prio != y->prio)
        return x->prio < y->prio;
    if (x->depth != y->depth)
        return x->depth > y->depth;
    return x->key < y->key;
}

static void heap_set(kvt_block_policy *p, int32_t pos, int32_t s)
{
    p->heap[pos] = s;
    p->slots[s].heap = pos;
}

static void sift_up(kvt_block_policy *p, int32_t pos)
{
    int32_t s = p->heap[pos];
    while (pos > 0) {
        int32_t parent = (pos - 1) / 2;
        if (!before(p, s, p->heap[parent]))
            break;
        heap_set(p, pos, p->heap[parent]);
        pos = parent;
    }
    heap_set(p, pos, s);
}

static void sift_down(kvt_block_policy *p, int32_t pos)
{
    int32_t s = p->heap[pos];
    for (;;) {
        int32_t c = 2 * pos + 1;
        if (c >= p->n_heap)
            break;
        if (c + 1 < p->n_heap && before(p, p->heap[c + 1], p->heap[c]))
            c++;
        if (!before(p, p->heap[c], s))
            break;
        heap_set(p, pos, p->heap[c]);
        pos = c;
    }
    heap_set(p, pos, s);
}

/* ---- key table ------------------------------------------------------------ */

static int64_t table_find(const kvt_block_policy *p, uint64_t key)
{
    if (!p->table)
        return -1;
    uint64_t mask = (uint64_t)p->table_size - 1;
    for (uint64_t i = kvt__mix64(key) & mask;; i = (i + 1) & mask) {
        int32_t v = p->table[i];
        if (v == 0)
            return -1;
        if (v > 0 && p->slots[v - 1].key == key)
            return (int64_t)i;
    }
}

static void table_put(kvt_block_policy *p, uint64_t key, int32_t s)
{
    uint64_t mask = (uint64_t)p->table_size - 1;
    uint64_t i = kvt__mix64(key) & mask;
    while (p->table[i] > 0)
        i = (i + 1) & mask;
    if (p->table[i] == 0)
        p->table_used++;
    p->table[i] = s + 1;
}

/* Keeps the table at most half used (live + deleted) for one more key. */
static int table_reserve(kvt_block_policy *p)
{
    if (p->table && (p->table_used + 1) * 2 <= p->table_size)
        return 0;
    int64_t size = 1024;
    while (size < ((int64_t)p->n_heap + 1) * 4)
        size *= 2;
    int32_t *t = kvt__calloc((size_t)size, sizeof *t);
    if (!t)
        return kvt__fail(KVT_ENOMEM, "block policy: no memory for a %lld-slot table", (long long)size);
    kvt__free(p->table);
    p->table = t;
    p->table_size = size;
    p->table_used = 0;
    for (int32_t h = 0; h < p->n_heap; h++)
        table_put(p, p->slots[p->heap[h]].key, p->heap[h]);
    return 0;
}

/* ---- sketch ------------------------------------------------------------- */

static void sketch_cells(kvt_block_policy *p, uint64_t key, uint8_t **a, uint8_t **b)
{
    uint64_t h = kvt__mix64(key ^ 0x9e3779b97f4a7c15ULL);
    uint64_t mask = (uint64_t)p->sketch_size - 1;
    *a = &p->sketch[h & mask];
    *b = &p->sketch[p->sketch_size + ((h >> 32) & mask)];
}

static int sketch_get(kvt_block_policy *p, uint64_t key)
{
    uint8_t *a, *b;
    sketch_cells(p, key, &a, &b);
    return KVT__MIN(*a, *b);
}

static int sketch_add(kvt_block_policy *p, uint64_t key)
{
    uint8_t *a, *b;
    sketch_cells(p, key, &a, &b);
    if (*a < 255)
        (*a)++;
    if (*b < 255)
        (*b)++;
    if (++p->touches >= KVT__AGE_PERIOD * p->capacity) {
        p->touches = 0;
        for (int64_t i = 0; i < 2 * p->sketch_size; i++)
            p->sketch[i] >>= 1;
    }
    return KVT__MIN(*a, *b);
}

/* ---- lfu-learned ---------------------------------------------------------- */

static int bucket_of(int32_t d, const int32_t *edges, int n)
{
    int b = 0;
    while (b < n && d >= edges[b])
        b++;
    return b;
}

/* Class of a first use: where the request's new blocks start (0, 1, 2-7,
 * 8-31, 32+: a new prompt, one past a shared first block, a continuation of
 * growing length) and how far past that start the block is (0-1, 2-7, 8-15,
 * 16-31, 32-63, 64+). */
static int first_use_class(int32_t first_new, int32_t depth)
{
    static const int32_t start_edges[] = {1, 2, 8, 32}, past_edges[] = {2, 8, 16, 32, 64};
    int32_t past = KVT__MAX(depth - first_new, 0);
    return bucket_of(first_new, start_edges, 4) * 6 + bucket_of(past, past_edges, 5);
}

static uint32_t *ghost_cell(kvt_block_policy *p, uint64_t key, uint32_t *tag)
{
    uint64_t h = kvt__mix64(key ^ 0x6a09e667f3bcc909ULL);
    *tag = (uint32_t)(h >> 37) << 5; /* 27 bits */
    return &p->ghost[h & (uint64_t)(p->ghost_size - 1)];
}

/* A new use (not at the block's last clock) with `uses` counted: a first
 * use gets its class, is remembered and returns its offset; a later use
 * credits the class its first use had, once. */
static int64_t learn(kvt_block_policy *p, uint64_t key, int uses, int32_t depth)
{
    uint32_t tag, *g = ghost_cell(p, key, &tag);
    if (uses > 1) {
        if ((*g & ~31u) == tag && (*g & 31u)) {
            p->reuses[(*g & 31u) - 1] += 1.0;
            p->all_reuses += 1.0;
            *g = tag; /* counted: reuses after this one are frequency's */
        }
        return 0;
    }
    int c = first_use_class(p->req_first_new, depth);
    *g = tag | (uint32_t)(c + 1);
    p->firsts[c] += 1.0;
    p->all_firsts += 1.0;
    if (++p->n_firsts >= KVT__LEARN_PERIOD * p->capacity) {
        p->n_firsts = 0;
        for (int i = 0; i < KVT__N_CLASSES; i++) {
            p->firsts[i] *= 0.5;
            p->reuses[i] *= 0.5;
        }
        p->all_firsts *= 0.5;
        p->all_reuses *= 0.5;
    }
    double mean = (p->all_reuses + 1.0) / (p->all_firsts + 4.0);
    double rate = (p->reuses[c] + KVT__LEARN_PRIOR * mean) / (p->firsts[c] + KVT__LEARN_PRIOR);
    double rel = rate / mean - 1.0;
    rel = rel < -1.0 ? -1.0 : rel > 1.0 ? 1.0 : rel;
    return (int64_t)(KVT__LEARN_GAIN * (double)p->capacity * rel);
}

/* ---- API ----------------------------------------------------------------- */

KVT_API int kvt_block_policy_names(const char *const **names)
{
    if (names)
        *names = kvt__block_policy_names;
    return KVT__N_BLOCK_POLICIES;
}

KVT_API int kvt_block_policy_create(const char *name, int64_t capacity_blocks,
                                    kvt_block_policy **out)
{
    if (!name || !out)
        return kvt__fail(KVT_EINVAL, "block policy: NULL name or out");
    *out = NULL;
    if (capacity_blocks < 1)
        return kvt__fail(KVT_EINVAL, "block policy: capacity %lld blocks, need >= 1",
                         (long long)capacity_blocks);
    int kind = -1;
    for (int i = 0; i < KVT__N_BLOCK_POLICIES; i++)
        if (!strcmp(name, kvt__block_policy_names[i]))
            kind = i;
    if (kind < 0)
        return kvt__fail(KVT_ENOTFOUND, "block policy '%s' unknown (known: lru, lfu-aged, lfu-learned)", name);
    kvt_block_policy *p = kvt__calloc(1, sizeof *p);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "block policy: no memory");
    p->kind = kind;
    p->capacity = capacity_blocks;
    if (kind == POL_LFU_AGED || kind == POL_LFU_LEARNED) {
        int64_t size = 64;
        while (size < capacity_blocks * (KVT__SKETCH_PER_BLOCK / 2))
            size *= 2;
        p->sketch_size = size;
        p->sketch = kvt__calloc(2, (size_t)size);
        if (!p->sketch) {
            kvt__free(p);
            return kvt__fail(KVT_ENOMEM, "block policy: no memory for a %lld-counter sketch",
                             (long long)(2 * size));
        }
    }
    if (kind == POL_LFU_LEARNED) {
        int64_t size = 64;
        while (size < capacity_blocks * KVT__GHOST_PER_BLOCK)
            size *= 2;
        p->ghost_size = size;
        p->ghost = kvt__calloc((size_t)size, sizeof *p->ghost);
        if (!p->ghost) {
            kvt__free(p->sketch);
            kvt__free(p);
            return kvt__fail(KVT_ENOMEM, "block policy: no memory for a %lld-entry ghost table",
                             (long long)size);
        }
        p->req_clock = INT64_MIN;
    }
    *out = p;
    return 0;
}

KVT_API void kvt_block_policy_destroy(kvt_block_policy *p)
{
    if (!p)
        return;
    kvt__free(p->slots);
    kvt__free(p->free);
    kvt__free(p->heap);
    kvt__free(p->table);
    kvt__free(p->sketch);
    kvt__free(p->ghost);
    kvt__free(p);
}

KVT_API const char *kvt_block_policy_name(const kvt_block_policy *p)
{
    return p ? kvt__block_policy_names[p->kind] : "";
}

KVT_API int64_t kvt_block_policy_count(const kvt_block_policy *p) { return p ? p->n_heap : 0; }

KVT_API int kvt_block_policy_contains(const kvt_block_policy *p, uint64_t key)
{
    return p && key && table_find(p, key) >= 0;
}

/* Grows slots, free list and heap so one more block fits. */
static int reserve_slot(kvt_block_policy *p)
{
    if (p->n_free > 0 || p->n_slots < p->cap_slots)
        return 0;
    int32_t cap = p->cap_slots ? p->cap_slots * 2 : 1024;
    if (cap <= p->cap_slots)
        return kvt__fail(KVT_ENOMEM, "block policy: more than %d blocks", p->cap_slots);
    slot *s = kvt__realloc(p->slots, (size_t)cap * sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "block policy: no memory for %d blocks", cap);
    p->slots = s;
    int32_t *h = kvt__realloc(p->heap, (size_t)cap * sizeof *h);
    if (!h)
        return kvt__fail(KVT_ENOMEM, "block policy: no memory for %d blocks", cap);
    p->heap = h;
    int32_t *f = kvt__realloc(p->free, (size_t)cap * sizeof *f);
    if (!f)
        return kvt__fail(KVT_ENOMEM, "block policy: no memory for %d blocks", cap);
    p->free = f;
    p->cap_slots = cap;
    return 0;
}

KVT_API int kvt_block_policy_touch(kvt_block_policy *p, uint64_t key, uint64_t parent, int64_t now,
                                   int32_t depth, unsigned flags)
{
    if (!p || key == 0)
        return kvt__fail(KVT_EINVAL, "block policy touch: %s", p ? "key 0 is reserved" : "NULL policy");
    int64_t prio = now, adj = 0;
    int64_t ti = table_find(p, key);
    if (ti < 0) { /* room first: on ENOMEM nothing has changed */
        int rc = reserve_slot(p);
        if (rc == 0)
            rc = table_reserve(p);
        if (rc)
            return rc;
    }
    if (p->kind == POL_LFU_LEARNED && ti < 0 && p->req_clock != now) {
        p->req_clock = now; /* the first block this request inserts */
        p->req_first_new = depth;
    }
    if (p->kind != POL_LRU) {
        /* a second touch at the same clock (take, then put, of one request)
         * is the same use: counted once */
        int same = ti >= 0 && p->slots[p->table[ti] - 1].last == now;
        int uses = same ? sketch_get(p, key) : sketch_add(p, key);
        prio += p->capacity * KVT__MIN(KVT__MAX(uses - 1, 0), KVT__FREQ_CAP);
        if (p->kind == POL_LFU_LEARNED)
            adj = same ? p->slots[p->table[ti] - 1].adj : learn(p, key, uses, depth);
        prio += adj;
    }
    if (flags & KVT_BLOCK_TAIL)
        prio -= KVT__TAIL_PENALTY;
    if (parent) {
        int64_t pi = table_find(p, parent);
        if (pi >= 0) {
            int64_t cap = p->slots[p->table[pi] - 1].prio;
            prio = KVT__MIN(prio, cap);
        }
    }
    if (ti >= 0) {
        slot *s = &p->slots[p->table[ti] - 1];
        s->last = KVT__MAX(s->last, now);
        s->adj = adj;
        if (prio > s->prio) { /* never lowers: keeps every child <= its parent */
            s->prio = prio;
            s->depth = depth;
            sift_down(p, s->heap);
        }
        return 0;
    }
    int32_t si = p->n_free > 0 ? p->free[--p->n_free] : p->n_slots++;
    p->slots[si] = (slot){.key = key, .prio = prio, .last = now, .depth = depth, .heap = p->n_heap,
                          .adj = adj};
    p->heap[p->n_heap++] = si;
    sift_up(p, p->n_heap - 1);
    table_put(p, key, si);
    return 0;
}

KVT_API int kvt_block_policy_victim(const kvt_block_policy *p, uint64_t *key)
{
    if (!p || p->n_heap == 0)
        return KVT_ENOTFOUND;
    if (key)
        *key = p->slots[p->heap[0]].key;
    return 0;
}

KVT_API int kvt_block_policy_remove(kvt_block_policy *p, uint64_t key)
{
    int64_t ti = p && key ? table_find(p, key) : -1;
    if (ti < 0)
        return KVT_ENOTFOUND;
    int32_t si = p->table[ti] - 1;
    p->table[ti] = -1; /* deleted marker: still counts in table_used */
    int32_t pos = p->slots[si].heap;
    int32_t last = p->heap[--p->n_heap];
    if (pos < p->n_heap) {
        heap_set(p, pos, last);
        sift_down(p, pos);
        sift_up(p, p->slots[last].heap);
    }
    p->free[p->n_free++] = si;
    return 0;
}
