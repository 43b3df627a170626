/*
 * tier_internal.h: helpers shared by the tier modules (src/tier/) and the
 * RAM tier, not part of the public API.
 */
#ifndef KVT_TIER_INTERNAL_H
#define KVT_TIER_INTERNAL_H

#include "kvtier/tier.h"

/** Gives *copy a share of the release hook *h: after the call *h and *copy
 * are shares of one refcounted hook whose fn runs once, when the last share
 * is run (kvt_hook_run). The first call wraps *h (allocates the refcount);
 * later calls on a share only add a reference. An empty *h gives an empty
 * *copy. @return 0; KVT_ENOMEM (then *h is unchanged and *copy empty).
 * Thread-safe for distinct hooks; shares may run on any thread. */
int kvt__hook_share(kvt_hook *h, kvt_hook *copy);

#endif
