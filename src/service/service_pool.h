/*
 * service_pool.h: a cache service's membership of a process-wide pool
 * (kvtier/pool.h), private to src/service/.
 *
 * RAM axis: the prompt cache's byte budget is what the member has published
 * on the axis. Before a put the budget grows (reserve, then publish) by what
 * the entry may add, up to the service's own prompt_cache_bytes; after the
 * put it shrinks to the bytes the cache holds and the rest is released, so
 * an idle service gives its unused share back. The prompt cache never holds
 * more than its budget (beyond what its own rules allow: a pending
 * write-behind keeps an entry past the budget until the write lands), so the
 * bytes it holds are charged before they exist.
 *
 * KV axis: an admission reserves its projected KV bytes; acquire publishes
 * them (the request's caches now exist); release releases them, or drops the
 * reservation of a request that never acquired.
 *
 * Without a pool every call is a no-op that succeeds.
 */
#ifndef KVT_SERVICE_POOL_H
#define KVT_SERVICE_POOL_H

#include "kvtier/pool.h"
#include "kvtier/prompt_cache.h"

#include <jansson.h>
#include <pthread.h>

typedef struct kvt__svc_pool {
    kvt_pool_member *m;   /* NULL: no pool */
    pthread_mutex_t mu;   /* one budget change and its put at a time */
    uint64_t ram_cap;     /* the service's prompt_cache_bytes */
    uint64_t ram_charged; /* RAM bytes published = the prompt cache's budget */
} kvt__svc_pool;

/* Joins `pool` as `name` (pool NULL: no pool, 0). 0; the errors of
 * kvt_pool_join (KVT_EINVAL, KVT_EBUSY, KVT_ENOMEM). */
int kvt__svc_pool_init(kvt__svc_pool *sp, kvt_pool *pool, const char *name, uint64_t ram_cap);

/* Leaves the pool (what is still charged is released). */
void kvt__svc_pool_fini(kvt__svc_pool *sp);

/* Brackets one put of an entry of at most entry_bytes: begin grows the
 * prompt cache's budget toward bytes held + entry_bytes (as far as the pool
 * lets it) and holds sp->mu; when that is not enough room for the entry, it
 * first flushes `cold` (every queued write-behind made durable, so every
 * kept entry can be evicted; NULL: no cold tier) and evicts down to the
 * charge less entry_bytes, so the cache never holds more than it is charged,
 * not even while the put inserts the entry before it evicts (an entry over
 * the whole charge is dropped by the put, nothing is evicted for it). end
 * shrinks the budget to the bytes held, releases the rest and unlocks; were
 * the cache still over its charge, it flushes and evicts to it at once. */
void kvt__svc_pool_put_begin(kvt__svc_pool *sp, kvt_prompt_cache *pc, uint64_t entry_bytes, const kvt_cold_tier *cold);
void kvt__svc_pool_put_end(kvt__svc_pool *sp, kvt_prompt_cache *pc, const kvt_cold_tier *cold);

/* After a flush: the budget is brought back to what is held (entries kept
 * past it are evicted now, or charged). */
void kvt__svc_pool_settle(kvt__svc_pool *sp, kvt_prompt_cache *pc, const kvt_cold_tier *cold);

/* The prompt cache was cleared (close): its whole budget goes back. */
void kvt__svc_pool_ram_clear(kvt__svc_pool *sp, kvt_prompt_cache *pc);

/* KV admission: 0 with *res the reservation (NULL without a pool or for 0
 * bytes); KVT_EAGAIN or KVT_ELIMIT (the pool's message: axis, member, bytes
 * asked and free); KVT_ENOMEM. */
int kvt__svc_pool_kv_reserve(kvt__svc_pool *sp, uint64_t bytes, kvt_pool_reservation **res);

/* 1 when `bytes` of KV fit the pool now, 0 not now, KVT_ELIMIT never. */
int kvt__svc_pool_kv_fits(kvt__svc_pool *sp, uint64_t bytes);

/* Release of published KV bytes (no-op without a pool). */
void kvt__svc_pool_kv_release(kvt__svc_pool *sp, uint64_t bytes);

/* The "pool" object of the service's report: {"member": name, "axes":
 * {"ram":{..},"kv":{..},"disk":{..},"remote":{..}}, "totals": {same axes,
 * the whole pool}}; json null without a pool; NULL on allocation failure. */
json_t *kvt__svc_pool_json(kvt__svc_pool *sp);

/* One axis usage as a JSON object (limit null when unlimited). */
json_t *kvt__pool_usage_json(const kvt_pool_usage *u);

#endif
