/*
 * service_pool.c: a cache service's membership of a process-wide pool
 * (service_pool.h): the prompt cache's budget as the member's RAM bytes, the
 * admissions' projected KV bytes as reservations, and the "pool" object of
 * the service's report. It never touches cache bytes itself: it moves the
 * prompt cache's budget and the pool's counters around the service's own
 * admission and put.
 */
#include "service_pool.h"

#include "internal.h"

#include <string.h>

int kvt__svc_pool_init(kvt__svc_pool *sp, kvt_pool *pool, const char *name, uint64_t ram_cap)
{
    memset(sp, 0, sizeof *sp);
    if (!pool)
        return 0;
    if (pthread_mutex_init(&sp->mu, NULL))
        return kvt__fail(KVT_ENOMEM, "service: cannot create the pool mutex");
    int rc = kvt_pool_join(pool, name, &sp->m);
    if (rc) {
        pthread_mutex_destroy(&sp->mu);
        return rc;
    }
    sp->ram_cap = ram_cap;
    return 0;
}

void kvt__svc_pool_fini(kvt__svc_pool *sp)
{
    if (!sp->m)
        return;
    kvt_pool_leave(sp->m);
    sp->m = NULL;
    pthread_mutex_destroy(&sp->mu);
}

/* Publishes up to `want` more RAM bytes: all of it when it fits, else what
 * is free now (a refusal is counted by the pool). Returns the bytes added. */
static uint64_t ram_grow(kvt__svc_pool *sp, uint64_t want)
{
    kvt_pool_reservation *r = NULL;
    if (kvt_pool_reserve(sp->m, KVT_POOL_RAM, want, &r) != 0) {
        uint64_t f = kvt_pool_free(kvt_pool_of(sp->m), KVT_POOL_RAM);
        if (f == 0 || f >= want || kvt_pool_reserve(sp->m, KVT_POOL_RAM, f, &r) != 0)
            return 0;
    }
    uint64_t got = kvt_pool_reservation_bytes(r);
    kvt_pool_publish(r);
    return got;
}

/* Makes every kept entry evictable (its write-behind durable) and evicts
 * down to `bytes`; then the budget is the charge (sp->mu held). */
static void evict_to(kvt__svc_pool *sp, kvt_prompt_cache *pc, const kvt_cold_tier *cold, uint64_t bytes)
{
    if (cold && cold->flush)
        (void)cold->flush(cold->self); /* a failed write keeps its entry: counted by the tier */
    (void)kvt_prompt_cache_set_max_bytes(pc, (size_t)bytes);
    (void)kvt_prompt_cache_set_max_bytes(pc, (size_t)sp->ram_charged);
}

static uint64_t held_bytes(kvt_prompt_cache *pc)
{
    kvt_prompt_cache_stats ps;
    kvt_prompt_cache_get_stats(pc, &ps);
    return (uint64_t)ps.bytes;
}

void kvt__svc_pool_put_begin(kvt__svc_pool *sp, kvt_prompt_cache *pc, uint64_t entry_bytes, const kvt_cold_tier *cold)
{
    if (!sp->m || !pc)
        return;
    pthread_mutex_lock(&sp->mu);
    uint64_t held = held_bytes(pc);
    uint64_t need = held > UINT64_MAX - entry_bytes ? UINT64_MAX : held + entry_bytes;
    uint64_t want = need > sp->ram_cap ? sp->ram_cap : need;
    if (want > sp->ram_charged) {
        /* charged before the budget grows: the bytes the put may add are
         * counted before they exist */
        sp->ram_charged += ram_grow(sp, want - sp->ram_charged);
        (void)kvt_prompt_cache_set_max_bytes(pc, (size_t)sp->ram_charged);
    }
    /* Not room for the entry: the put would insert it over the charge and
     * then evict, and an entry whose write-behind is pending is not evicted
     * (a pending write is not a copy), so it could stay over the charge
     * until the write lands. Room is made first instead. An entry over the
     * whole charge is dropped by the put itself: nothing is evicted for it. */
    if (need > sp->ram_charged && held > 0 && entry_bytes <= sp->ram_charged)
        evict_to(sp, pc, cold, sp->ram_charged - entry_bytes);
}

void kvt__svc_pool_put_end(kvt__svc_pool *sp, kvt_prompt_cache *pc, const kvt_cold_tier *cold)
{
    if (!sp->m || !pc)
        return;
    uint64_t held = held_bytes(pc);
    if (held < sp->ram_charged) {
        /* the budget shrinks first (nothing to evict: it is what is held),
         * then the share it no longer covers goes back to the pool */
        (void)kvt_prompt_cache_set_max_bytes(pc, (size_t)held);
        (void)kvt_pool_release(sp->m, KVT_POOL_RAM, sp->ram_charged - held);
        sp->ram_charged = held;
    } else if (held > sp->ram_charged) {
        /* held past the charge (the entry added more than it was said to,
         * or a write failed): charge it when the pool has room, else make
         * every entry durable and evict to the charge now */
        if (held <= sp->ram_cap)
            sp->ram_charged += ram_grow(sp, held - sp->ram_charged);
        if (held > sp->ram_charged)
            evict_to(sp, pc, cold, sp->ram_charged);
    }
    pthread_mutex_unlock(&sp->mu);
}

void kvt__svc_pool_settle(kvt__svc_pool *sp, kvt_prompt_cache *pc, const kvt_cold_tier *cold)
{
    if (!sp->m || !pc)
        return;
    pthread_mutex_lock(&sp->mu);
    kvt__svc_pool_put_end(sp, pc, cold);
}

void kvt__svc_pool_ram_clear(kvt__svc_pool *sp, kvt_prompt_cache *pc)
{
    if (!sp->m || !pc)
        return;
    pthread_mutex_lock(&sp->mu);
    (void)kvt_prompt_cache_set_max_bytes(pc, 0);
    (void)kvt_pool_release(sp->m, KVT_POOL_RAM, sp->ram_charged);
    sp->ram_charged = 0;
    pthread_mutex_unlock(&sp->mu);
}

int kvt__svc_pool_kv_reserve(kvt__svc_pool *sp, uint64_t bytes, kvt_pool_reservation **res)
{
    *res = NULL;
    if (!sp->m || bytes == 0)
        return 0;
    return kvt_pool_reserve(sp->m, KVT_POOL_KV, bytes, res);
}

int kvt__svc_pool_kv_fits(kvt__svc_pool *sp, uint64_t bytes)
{
    if (!sp->m || bytes == 0)
        return 1;
    return kvt_pool_fits(sp->m, KVT_POOL_KV, bytes);
}

void kvt__svc_pool_kv_release(kvt__svc_pool *sp, uint64_t bytes)
{
    if (sp->m && bytes)
        (void)kvt_pool_release(sp->m, KVT_POOL_KV, bytes);
}

static int put_u64(json_t *o, const char *k, uint64_t v)
{
    return json_object_set_new(o, k, json_integer(v > (uint64_t)INT64_MAX ? INT64_MAX : (json_int_t)v));
}

json_t *kvt__pool_usage_json(const kvt_pool_usage *u)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    int bad = 0;
    /* every field of the one list; a limit of 0 (not limited) is null */
#define KVT__USAGE_JSON(name, kind, help)                                                          \
    bad |= !strcmp(#name, "limit") && u->name == 0 ? json_object_set_new(o, #name, json_null())   \
                                                   : put_u64(o, #name, u->name);
    KVT_POOL_USAGE_FIELDS(KVT__USAGE_JSON)
#undef KVT__USAGE_JSON
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* {"ram":{..},..} from one usage per axis. */
static json_t *axes_json(const kvt_pool_usage *u)
{
    json_t *o = json_object();
    for (int a = 0; o && a < KVT_POOL_AXES; a++) {
        json_t *x = kvt__pool_usage_json(&u[a]);
        if (!x || json_object_set_new(o, kvt_pool_axis_name((kvt_pool_axis)a), x)) {
            json_decref(o);
            return NULL;
        }
    }
    return o;
}

json_t *kvt__svc_pool_json(kvt__svc_pool *sp)
{
    if (!sp->m)
        return json_null();
    kvt_pool_usage mine[KVT_POOL_AXES];
    kvt_pool_report all;
    if (kvt_pool_member_usage(sp->m, mine) || kvt_pool_report_get(kvt_pool_of(sp->m), &all))
        return NULL;
    json_t *o = json_object(), *axes = axes_json(mine), *tot = axes_json(all.axis);
    int bad = !o || !axes || !tot;
    if (!bad)
        bad = json_object_set_new(o, "member", json_string(kvt_pool_member_name(sp->m))) |
              json_object_set(o, "axes", axes) | json_object_set(o, "totals", tot) |
              put_u64(o, "members", all.members);
    json_decref(axes);
    json_decref(tot);
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
}
