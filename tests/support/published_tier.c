/*
 * published_tier.c: the published read-only tier as a conformance-suite
 * implementation (tier_suite.h). Its put publishes a new generation from
 * the current one plus the entry (kvt_publish_options.from_current) and
 * refreshes the tier onto it, so every test runs against a tier that only
 * ever saw whole, validated generations.
 */
#include <stdlib.h>

#include "kvtier/publish.h"
#include "store_util.h"
#include "tier_suite.h"

typedef struct pub_fx {
    char dir[512];
    kvt_published *p;
} pub_fx;

static const kvt_store_identity PUB_ID = {"tier-suite", "any", "tok"};

static int pub_open(void **ctx, kvt_cold_tier *tier)
{
    pub_fx *f = calloc(1, sizeof *f);
    if (!f)
        return KVT_ENOMEM;
    store_tmpdir(f->dir, sizeof f->dir, "tier-suite-pub");
    kvt_published_options o = {.poll_ms = -1};
    int rc = f->dir[0] ? kvt_published_open(f->dir, &PUB_ID, &o, &f->p) : KVT_EIO;
    if (rc) {
        free(f);
        return rc;
    }
    kvt_published_cold_tier(f->p, tier);
    *ctx = f;
    return 0;
}

static void pub_close(void *ctx)
{
    pub_fx *f = ctx;
    kvt_published_close(f->p);
    store_rmtree(f->dir);
    free(f);
}

static int pub_put(void *ctx, const kvt_entry *e)
{
    pub_fx *f = ctx;
    kvt_publisher *w;
    kvt_publish_options o = {.from_current = 1};
    int rc = kvt_publish_begin(f->dir, &PUB_ID, &o, &w);
    if (rc)
        return rc;
    if ((rc = kvt_publish_put(w, e))) {
        kvt_publish_abort(w);
        return rc;
    }
    if ((rc = kvt_publish_commit(w, 2, NULL)))
        return rc;
    return kvt_published_refresh(f->p);
}

const tier_impl tier_impl_published = {"published (read-only)", pub_open, pub_close, pub_put};
