/*
 * retention_block.c: block-granular retention policies (lru, lfu-aged): an
 * indexed min-heap of resident blocks ordered by (priority, -depth), a key
 * to slot hash table and, for lfu-aged, a count-min sketch of use counts.
 * It only orders blocks its owner reports; it must never free or evict
 * anything itself, and never allocate per touch once its tables have grown.
 */
#include "kvtier/retention_block.h"

#include "internal.h"

#include <string.h>

enum { POL_LRU = 0, POL_LFU_AGED = 1 };

static const char *const kvt__block_policy_names[] = {"lru", "lfu-aged"};
#define KVT__N_BLOCK_POLICIES 2

/* Tail blocks sort below every normal block. */
#define KVT__TAIL_PENALTY ((int64_t)1 << 52)
#define KVT__FREQ_CAP 3
#define KVT__SKETCH_PER_BLOCK 16
#define KVT__AGE_PERIOD 32

typedef struct slot {
    uint64_t key;
    int64_t prio;  /* higher = kept longer */
    int64_t last;  /* clock of its last use */
    int32_t depth; /* block index in its prompt; deeper goes first on ties */
    int32_t heap;  /* position in heap[] */
} slot;

struct kvt_block_policy {
    int kind;
    int64_t capacity;
    /* resident blocks */
    slot *slots;      /* (n_slots) */
    int32_t n_slots, cap_slots;
    int32_t *free;    /* (n_free) free slot indices */
    int32_t n_free, cap_free;
    int32_t *heap;    /* (n_heap) slot indices, min-heap on (prio, -depth) */
    int32_t n_heap;
    /* open addressing key -> slot+1 (0 empty, -1 deleted) */
    int32_t *table;   /* (table_size) */
    int64_t table_size, table_used;
    /* lfu-aged: count-min sketch, two rows of sketch_size uint8 counters */
    uint8_t *sketch;  /* (2, sketch_size) */
    int64_t sketch_size;
    int64_t touches;
};

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

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
    for (uint64_t i = mix64(key) & mask;; i = (i + 1) & mask) {
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
    uint64_t i = mix64(key) & mask;
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
    uint64_t h = mix64(key ^ 0x9e3779b97f4a7c15ULL);
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
        return kvt__fail(KVT_ENOTFOUND, "block policy '%s' unknown (known: lru, lfu-aged)", name);
    kvt_block_policy *p = kvt__calloc(1, sizeof *p);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "block policy: no memory");
    p->kind = kind;
    p->capacity = capacity_blocks;
    if (kind == POL_LFU_AGED) {
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
    int64_t prio = now;
    int64_t ti = table_find(p, key);
    if (p->kind == POL_LFU_AGED) {
        /* a second touch at the same clock (take, then put, of one request)
         * is the same use: counted once */
        int uses = ti >= 0 && p->slots[p->table[ti] - 1].last == now ? sketch_get(p, key)
                                                                       : sketch_add(p, key);
        prio += p->capacity * KVT__MIN(KVT__MAX(uses - 1, 0), KVT__FREQ_CAP);
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
        if (prio > s->prio) { /* never lowers: keeps every child <= its parent */
            s->prio = prio;
            s->depth = depth;
            sift_down(p, s->heap);
        }
        return 0;
    }
    int rc = reserve_slot(p);
    if (rc == 0)
        rc = table_reserve(p);
    if (rc)
        return rc;
    int32_t si = p->n_free > 0 ? p->free[--p->n_free] : p->n_slots++;
    p->slots[si] = (slot){.key = key, .prio = prio, .last = now, .depth = depth, .heap = p->n_heap};
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
