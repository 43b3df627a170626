/*
 * remote_pool.c: the remote tier's membership of a process-wide pool
 * (kvt_remote_options.pool): every write in flight holds its entry's bytes
 * on the pool's remote axis, reserved when the write is accepted and dropped
 * when it ends (written, failed, withdrawn or discarded at close).
 */
#include "kvtier/pool.h"

#include "remote_internal.h"

#include <stdio.h>

int kvt__remote_pool_join(kvt_remote *r, const kvt_remote_options *o)
{
    if (!o->pool)
        return 0;
    char name[256];
    snprintf(name, sizeof name, "remote:%.240s", r->host);
    return kvt_pool_join(o->pool, o->pool_name ? o->pool_name : name, &r->pool_member);
}

void kvt__remote_pool_leave(kvt_remote *r)
{
    kvt_pool_leave(r->pool_member);
    r->pool_member = NULL;
}

int kvt__remote_pool_reserve(kvt_remote *r, uint64_t bytes, kvt_pool_reservation **res)
{
    *res = NULL;
    if (!r->pool_member)
        return 0;
    return kvt_pool_reserve(r->pool_member, KVT_POOL_REMOTE, bytes, res);
}

void kvt__remote_pool_drop(kvt_pool_reservation *res) { kvt_pool_drop(res); }
