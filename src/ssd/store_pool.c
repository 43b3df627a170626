/*
 * store_pool.c: an SSD root's membership of a process-wide pool
 * (kvt_store_options.pool): the root's byte budget is its charge on the
 * pool's disk axis, reserved and published at open, released at close.
 */
#include "kvtier/pool.h"

#include "internal.h"
#include "store_internal.h"

#include <stdio.h>
#include <string.h>

/* "ssd:<root>", or "ssd:..." and the root's tail (cut at a character
 * boundary) when that is over the member-name limit. */
static void member_name(const char *root, char *out, size_t cap)
{
    size_t n = strlen(root);
    if (4 + n < cap) {
        snprintf(out, cap, "ssd:%s", root);
        return;
    }
    const char *tail = root + n - (cap - 8);
    while ((unsigned char)*tail >= 0x80 && (unsigned char)*tail < 0xc0) /* UTF-8 continuation */
        tail++;
    snprintf(out, cap, "ssd:...%s", tail);
}

int kvt__store_pool_join(kvt_store *s)
{
    kvt_pool *pool = s->opts.pool;
    const char *given = s->opts.pool_name;
    s->opts.pool_name = NULL; /* borrowed for the call only */
    if (!pool)
        return 0;
    uint64_t charge = s->opts.read_only ? 0 : s->opts.max_bytes;
    if (!s->opts.read_only && !charge && kvt_pool_free(pool, KVT_POOL_DISK) != UINT64_MAX)
        return kvt__fail(KVT_EINVAL, "%s: an SSD root under a disk-limited pool needs a byte budget "
                         "(max_bytes, --ssd-cache-max): an unlimited root cannot be charged", s->root);
    char name[256];
    member_name(s->root, name, sizeof name);
    kvt_pool_member *m = NULL;
    int rc = kvt_pool_join(pool, given ? given : name, &m);
    if (rc)
        return rc;
    kvt_pool_reservation *r = NULL;
    rc = kvt_pool_reserve(m, KVT_POOL_DISK, charge, &r);
    if (rc) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvt_last_error());
        kvt_pool_leave(m);
        return kvt__fail(rc, "%s: the SSD budget does not fit the pool: %s", s->root, msg);
    }
    kvt_pool_publish(r); /* the budget is the most the root holds from now on */
    s->pool_member = m;
    return 0;
}

void kvt__store_pool_leave(kvt_store *s)
{
    kvt_pool_leave(s->pool_member); /* releases the published budget */
    s->pool_member = NULL;
}
