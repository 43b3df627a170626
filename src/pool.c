/*
 * pool.c: the process-wide limits of kvtier/pool.h. Owns the per-axis
 * counters of every joined member and the open reservation handles; one
 * mutex guards all of it, so the check "fits under the limit" and the charge
 * are one step and the axis total never passes its limit. It never touches
 * the bytes it counts: managers call it around their own admission.
 */
#include "kvtier/pool.h"

#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define KVT__POOL_NAME_MAX 255

typedef struct kvt__pool_counts {
    uint64_t reserved, published, high_water, refusals;
} kvt__pool_counts;

struct kvt_pool_reservation {
    kvt_pool_member *member;
    kvt_pool_reservation *prev, *next; /* the member's open reservations */
    kvt_pool_axis axis;
    uint64_t bytes;
};

struct kvt_pool_member {
    kvt_pool *pool;
    kvt_pool_member *prev, *next; /* join order */
    kvt_pool_reservation *open;
    char *name;
    kvt__pool_counts axis[KVT_POOL_AXES];
};

struct kvt_pool {
    pthread_mutex_t mu;
    uint64_t limit[KVT_POOL_AXES];
    kvt__pool_counts axis[KVT_POOL_AXES];
    kvt_pool_member *first, *last;
    uint64_t members;
};

static const char *const kvt__axis_names[KVT_POOL_AXES] = {"ram", "kv", "disk", "remote"};

const char *kvt_pool_axis_name(kvt_pool_axis axis)
{
    return (unsigned)axis < KVT_POOL_AXES ? kvt__axis_names[axis] : "unknown";
}

int kvt_pool_create(const kvt_pool_limits *limits, kvt_pool **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_pool_create: out is NULL");
    *out = NULL;
    kvt_pool *p = kvt__calloc(1, sizeof *p);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "kvt_pool_create: out of memory");
    if (pthread_mutex_init(&p->mu, NULL) != 0) {
        kvt__free(p);
        return kvt__fail(KVT_ENOMEM, "kvt_pool_create: cannot create the mutex");
    }
    if (limits)
        memcpy(p->limit, limits->limit, sizeof p->limit);
    *out = p;
    return 0;
}

/* ---- counters (under pool->mu) ------------------------------------------ */

static uint64_t kvt__used(const kvt__pool_counts *c) { return c->reserved + c->published; }

static void kvt__note_high(kvt__pool_counts *c)
{
    uint64_t u = kvt__used(c);
    if (u > c->high_water)
        c->high_water = u;
}

static void kvt__unlink_res(kvt_pool_reservation *r)
{
    kvt_pool_member *m = r->member;
    if (r->prev)
        r->prev->next = r->next;
    else
        m->open = r->next;
    if (r->next)
        r->next->prev = r->prev;
}

/* Ends r (publish or drop) under the held mutex and frees it. */
static void kvt__end_res(kvt_pool_reservation *r, int publish)
{
    kvt_pool_member *m = r->member;
    kvt_pool *p = m->pool;
    kvt__unlink_res(r);
    m->axis[r->axis].reserved -= r->bytes;
    p->axis[r->axis].reserved -= r->bytes;
    if (publish) {
        m->axis[r->axis].published += r->bytes;
        p->axis[r->axis].published += r->bytes;
    }
    kvt__free(r);
}

static void kvt__leave_locked(kvt_pool_member *m)
{
    kvt_pool *p = m->pool;
    while (m->open)
        kvt__end_res(m->open, 0);
    for (int a = 0; a < KVT_POOL_AXES; a++)
        p->axis[a].published -= m->axis[a].published;
    if (m->prev)
        m->prev->next = m->next;
    else
        p->first = m->next;
    if (m->next)
        m->next->prev = m->prev;
    else
        p->last = m->prev;
    p->members--;
    kvt__free(m->name);
    kvt__free(m);
}

void kvt_pool_destroy(kvt_pool *pool)
{
    if (!pool)
        return;
    while (pool->first)
        kvt__leave_locked(pool->first);
    pthread_mutex_destroy(&pool->mu);
    kvt__free(pool);
}

/* ---- membership --------------------------------------------------------- */

int kvt_pool_join(kvt_pool *pool, const char *name, kvt_pool_member **out)
{
    if (out)
        *out = NULL;
    if (!pool || !name || !out)
        return kvt__fail(KVT_EINVAL, "kvt_pool_join: pool, name and out must not be NULL");
    size_t n = strlen(name);
    if (n == 0 || n > KVT__POOL_NAME_MAX || !kvt__utf8_valid(name))
        return kvt__fail(KVT_EINVAL, "kvt_pool_join: a member name is 1..%d bytes of UTF-8 (got %zu bytes)",
                         KVT__POOL_NAME_MAX, n);
    kvt_pool_member *m = kvt__calloc(1, sizeof *m);
    char *copy = kvt__strdup(name);
    if (!m || !copy) {
        kvt__free(m);
        kvt__free(copy);
        return kvt__fail(KVT_ENOMEM, "kvt_pool_join: out of memory joining '%s'", name);
    }
    m->pool = pool;
    m->name = copy;
    pthread_mutex_lock(&pool->mu);
    for (kvt_pool_member *o = pool->first; o; o = o->next) {
        if (strcmp(o->name, name) == 0) {
            pthread_mutex_unlock(&pool->mu);
            kvt__free(copy);
            kvt__free(m);
            return kvt__fail(KVT_EBUSY, "kvt_pool_join: a member named '%s' is already joined", name);
        }
    }
    m->prev = pool->last;
    if (pool->last)
        pool->last->next = m;
    else
        pool->first = m;
    pool->last = m;
    pool->members++;
    pthread_mutex_unlock(&pool->mu);
    *out = m;
    return 0;
}

void kvt_pool_leave(kvt_pool_member *member)
{
    if (!member)
        return;
    kvt_pool *p = member->pool;
    pthread_mutex_lock(&p->mu);
    kvt__leave_locked(member);
    pthread_mutex_unlock(&p->mu);
}

/* ---- admission ---------------------------------------------------------- */

int kvt_pool_reserve(kvt_pool_member *member, kvt_pool_axis axis, uint64_t bytes, kvt_pool_reservation **out)
{
    if (out)
        *out = NULL;
    if (!member || !out)
        return kvt__fail(KVT_EINVAL, "kvt_pool_reserve: member and out must not be NULL");
    if ((unsigned)axis >= KVT_POOL_AXES)
        return kvt__fail(KVT_EINVAL, "kvt_pool_reserve: axis %d is not one of the %d pool axes", (int)axis,
                         KVT_POOL_AXES);
    /* allocated before the charge, so a failed allocation charges nothing */
    kvt_pool_reservation *r = kvt__calloc(1, sizeof *r);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "kvt_pool_reserve: out of memory reserving %llu %s bytes",
                         (unsigned long long)bytes, kvt__axis_names[axis]);
    kvt_pool *p = member->pool;
    pthread_mutex_lock(&p->mu);
    uint64_t limit = p->limit[axis], used = kvt__used(&p->axis[axis]);
    if (limit && (bytes > limit || bytes > limit - used)) {
        uint64_t free_bytes = used < limit ? limit - used : 0;
        p->axis[axis].refusals++;
        member->axis[axis].refusals++;
        pthread_mutex_unlock(&p->mu);
        kvt__free(r);
        int code = bytes > limit ? KVT_ELIMIT : KVT_EAGAIN;
        return kvt__fail(code, "pool axis %s: member '%s' asked for %llu bytes, %llu of the %llu-byte limit are free%s",
                         kvt__axis_names[axis], member->name, (unsigned long long)bytes,
                         (unsigned long long)free_bytes, (unsigned long long)limit,
                         code == KVT_ELIMIT ? " (more than the whole limit)" : "");
    }
    r->member = member;
    r->axis = axis;
    r->bytes = bytes;
    r->next = member->open;
    if (member->open)
        member->open->prev = r;
    member->open = r;
    member->axis[axis].reserved += bytes;
    p->axis[axis].reserved += bytes;
    kvt__note_high(&member->axis[axis]);
    kvt__note_high(&p->axis[axis]);
    pthread_mutex_unlock(&p->mu);
    *out = r;
    return 0;
}

int kvt_pool_fits(kvt_pool_member *member, kvt_pool_axis axis, uint64_t bytes)
{
    if (!member)
        return kvt__fail(KVT_EINVAL, "kvt_pool_fits: member is NULL");
    if ((unsigned)axis >= KVT_POOL_AXES)
        return kvt__fail(KVT_EINVAL, "kvt_pool_fits: axis %d is not one of the %d pool axes", (int)axis,
                         KVT_POOL_AXES);
    kvt_pool *p = member->pool;
    pthread_mutex_lock(&p->mu);
    uint64_t limit = p->limit[axis], used = kvt__used(&p->axis[axis]);
    pthread_mutex_unlock(&p->mu);
    if (limit && bytes > limit)
        return kvt__fail(KVT_ELIMIT, "pool axis %s: member '%s' asked for %llu bytes, more than the whole "
                         "%llu-byte limit", kvt__axis_names[axis], member->name, (unsigned long long)bytes,
                         (unsigned long long)limit);
    return !limit || bytes <= limit - used;
}

uint64_t kvt_pool_free(kvt_pool *pool, kvt_pool_axis axis)
{
    if (!pool || (unsigned)axis >= KVT_POOL_AXES)
        return 0;
    pthread_mutex_lock(&pool->mu);
    uint64_t limit = pool->limit[axis], used = kvt__used(&pool->axis[axis]);
    pthread_mutex_unlock(&pool->mu);
    if (!limit)
        return UINT64_MAX;
    return used < limit ? limit - used : 0;
}

kvt_pool *kvt_pool_of(const kvt_pool_member *member) { return member ? member->pool : NULL; }

const char *kvt_pool_member_name(const kvt_pool_member *member) { return member ? member->name : ""; }

static void kvt__end(kvt_pool_reservation *res, int publish)
{
    if (!res)
        return;
    kvt_pool *p = res->member->pool;
    pthread_mutex_lock(&p->mu);
    kvt__end_res(res, publish);
    pthread_mutex_unlock(&p->mu);
}

void kvt_pool_publish(kvt_pool_reservation *res) { kvt__end(res, 1); }

void kvt_pool_drop(kvt_pool_reservation *res) { kvt__end(res, 0); }

uint64_t kvt_pool_reservation_bytes(const kvt_pool_reservation *res) { return res ? res->bytes : 0; }

int kvt_pool_release(kvt_pool_member *member, kvt_pool_axis axis, uint64_t bytes)
{
    if (!member)
        return kvt__fail(KVT_EINVAL, "kvt_pool_release: member is NULL");
    if ((unsigned)axis >= KVT_POOL_AXES)
        return kvt__fail(KVT_EINVAL, "kvt_pool_release: axis %d is not one of the %d pool axes", (int)axis,
                         KVT_POOL_AXES);
    kvt_pool *p = member->pool;
    pthread_mutex_lock(&p->mu);
    uint64_t have = member->axis[axis].published;
    if (bytes > have) {
        pthread_mutex_unlock(&p->mu);
        return kvt__fail(KVT_EINVAL, "kvt_pool_release: member '%s' releases %llu %s bytes but has %llu published",
                         member->name, (unsigned long long)bytes, kvt__axis_names[axis], (unsigned long long)have);
    }
    member->axis[axis].published -= bytes;
    p->axis[axis].published -= bytes;
    pthread_mutex_unlock(&p->mu);
    return 0;
}

/* ---- reports ------------------------------------------------------------ */

static kvt_pool_usage kvt__usage(const kvt__pool_counts *c, uint64_t limit)
{
    return (kvt_pool_usage){.limit = limit,
                            .reserved = c->reserved,
                            .published = c->published,
                            .used = kvt__used(c),
                            .high_water = c->high_water,
                            .refusals = c->refusals};
}

int kvt_pool_report_get(kvt_pool *pool, kvt_pool_report *out)
{
    if (!pool || !out)
        return kvt__fail(KVT_EINVAL, "kvt_pool_report_get: pool and out must not be NULL");
    pthread_mutex_lock(&pool->mu);
    for (int a = 0; a < KVT_POOL_AXES; a++)
        out->axis[a] = kvt__usage(&pool->axis[a], pool->limit[a]);
    out->members = pool->members;
    pthread_mutex_unlock(&pool->mu);
    return 0;
}

int kvt_pool_member_usage(kvt_pool_member *member, kvt_pool_usage out[KVT_POOL_AXES])
{
    if (!member || !out)
        return kvt__fail(KVT_EINVAL, "kvt_pool_member_usage: member and out must not be NULL");
    kvt_pool *p = member->pool;
    pthread_mutex_lock(&p->mu);
    for (int a = 0; a < KVT_POOL_AXES; a++)
        out[a] = kvt__usage(&member->axis[a], p->limit[a]);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

/* A growing string for the JSON report; on allocation failure it stays
 * failed and the caller sees ok == 0. */
typedef struct kvt__sb {
    char *s;
    size_t len, cap;
    int ok;
} kvt__sb;

static void kvt__sb_put(kvt__sb *b, const char *fmt, ...) KVT_PRINTF(2, 3);
static void kvt__sb_put(kvt__sb *b, const char *fmt, ...)
{
    if (!b->ok)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->ok = 0;
            return;
        }
        if (b->s && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = KVT__MAX(b->cap * 2, b->len + (size_t)n + 256);
        char *s = kvt__realloc(b->s, cap);
        if (!s) {
            b->ok = 0;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
}

static void kvt__sb_axes(kvt__sb *b, const kvt__pool_counts *c, const uint64_t *limit)
{
    kvt__sb_put(b, "{");
    for (int a = 0; a < KVT_POOL_AXES; a++) {
        kvt_pool_usage u = kvt__usage(&c[a], limit[a]);
        kvt__sb_put(b, "%s\"%s\":{", a ? "," : "", kvt__axis_names[a]);
        const char *sep = "";
#define KVT__POOL_JSON(name, kind, help)                                                          \
    kvt__sb_put(b, "%s\"" #name "\":%llu", sep, (unsigned long long)u.name);                      \
    sep = ",";
        KVT_POOL_USAGE_FIELDS(KVT__POOL_JSON)
#undef KVT__POOL_JSON
        kvt__sb_put(b, "}");
    }
    kvt__sb_put(b, "}");
}

/* A JSON string body: quotes, backslashes and control bytes escaped (the
 * name is valid UTF-8, checked at join). */
static void kvt__sb_string(kvt__sb *b, const char *s)
{
    kvt__sb_put(b, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            kvt__sb_put(b, "\\%c", c);
        else if (c < 0x20)
            kvt__sb_put(b, "\\u%04x", c);
        else
            kvt__sb_put(b, "%c", c);
    }
    kvt__sb_put(b, "\"");
}

int kvt_pool_report_json(kvt_pool *pool, char **out)
{
    if (out)
        *out = NULL;
    if (!pool || !out)
        return kvt__fail(KVT_EINVAL, "kvt_pool_report_json: pool and out must not be NULL");
    kvt__sb b = {.ok = 1};
    pthread_mutex_lock(&pool->mu);
    kvt__sb_put(&b, "{\"members\":%llu,\"axes\":", (unsigned long long)pool->members);
    kvt__sb_axes(&b, pool->axis, pool->limit);
    kvt__sb_put(&b, ",\"member_list\":[");
    for (kvt_pool_member *m = pool->first; m; m = m->next) {
        kvt__sb_put(&b, "%s{\"name\":", m == pool->first ? "" : ",");
        kvt__sb_string(&b, m->name);
        kvt__sb_put(&b, ",\"axes\":");
        kvt__sb_axes(&b, m->axis, pool->limit);
        kvt__sb_put(&b, "}");
    }
    kvt__sb_put(&b, "]}");
    pthread_mutex_unlock(&pool->mu);
    if (!b.ok) {
        kvt__free(b.s);
        return kvt__fail(KVT_ENOMEM, "kvt_pool_report_json: out of memory");
    }
    *out = b.s;
    return 0;
}
