/*
 * pc_object.c: exact-key objects in the prompt cache (DESIGN.md 3.12):
 * blobs such as encoder outputs under namespace "object:<key>" with no
 * tokens, sharing the budget, eviction and writer with prompt entries; a
 * miss in RAM asks the cold tier (without the lock) and publishes what it
 * restores.
 */
#include "prompt_cache_internal.h"

/* ---- objects --------------------------------------------------------------------------- */

static char *object_ns(const char *key)
{
    size_t n = strlen(key);
    char *ns = kvt__malloc(n + 8);
    if (ns) {
        memcpy(ns, "object:", 7);
        memcpy(ns + 7, key, n + 1);
    }
    return ns;
}

KVT_API int kvt_prompt_cache_object_put(kvt_prompt_cache *pc, const char *key, kvt_attachment **attachments,
                                        int32_t n_attachments, kvt_hook *hook)
{
    if (!pc || !key || !*key || n_attachments < 0 || (n_attachments && !attachments))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_object_put: bad arguments (key empty or NULL?)");
    char *ns = object_ns(key);
    if (!ns)
        return kvt__fail(KVT_ENOMEM, "kvt_prompt_cache_object_put: out of memory");
    kvt_entry e = {ns, NULL, 0, NULL, 0, attachments, n_attachments, hook ? *hook : (kvt_hook){NULL, NULL}};
    int rc = kvt__pc_put_common(pc, &e, NULL, 0, NULL, UINT64_MAX, 1);
    if (rc == 0 && hook)
        *hook = (kvt_hook){NULL, NULL};
    kvt__free(ns);
    return rc;
}

KVT_API int kvt_prompt_cache_object_lend(kvt_prompt_cache *pc, const char *key, kvt_hit *out)
{
    if (out) /* cleared before any check, as kvt_prompt_cache_lend */
        memset(out, 0, sizeof *out);
    if (!pc || !key || !*key || !out)
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_object_lend: bad arguments");
    char *ns = object_ns(key);
    if (!ns)
        return kvt__fail(KVT_ENOMEM, "kvt_prompt_cache_object_lend: out of memory");
    int rc;
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = kvt__index_exact(pc->ix, ns, NULL, 0);
    if (e) {
        pc->st.object_hits++;
        rc = kvt__pc_lend_locked(pc, e, 0, out);
        if (rc == 0)
            out->source = KVT_HIT_RAM;
        pthread_mutex_unlock(&pc->mu);
        kvt__free(ns);
        return rc;
    }
    pc->st.object_misses++;
    uint64_t epoch = pc->epoch;
    pthread_mutex_unlock(&pc->mu);
    /* the cold tier is asked without the lock (a lookup may block on I/O);
     * a clear meanwhile makes the publication below refuse (epoch) */
    kvt_cold_hit ch;
    if (!pc->has_cold || !pc->cold.find_exact || pc->cold.find_exact(pc->cold.self, NULL, 0, ns, &ch) != 0) {
        rc = kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_object_lend: no object '%s' in any tier", key);
        kvt__free(ns);
        return rc;
    }
    kvt_entry r;
    memset(&r, 0, sizeof r);
    rc = pc->cold.restore(pc->cold.self, ch.handle, &r);
    if (rc) {
        kvt__free(ns);
        return kvt__fail(rc, "kvt_prompt_cache_object_lend: restoring '%s' failed (%s)", key, kvt_strerror(rc));
    }
    pthread_mutex_lock(&pc->mu);
    pc->st.object_restores++;
    pthread_mutex_unlock(&pc->mu);
    /* publish (if another request published it meanwhile, this equal-key
     * copy replaces it: the same immutable object), then lend from RAM */
    kvt__free((void *)r.ns);
    r.ns = ns; /* freed by kvt_entry_clear below */
    rc = kvt__pc_put_common(pc, &r, NULL, 0, NULL, epoch, 0);
    if (rc == 0) {
        pthread_mutex_lock(&pc->mu);
        e = kvt__index_exact(pc->ix, ns, NULL, 0);
        rc = e ? kvt__pc_lend_locked(pc, e, 0, out)
               : kvt__fail(KVT_ENOTFOUND, "kvt_prompt_cache_object_lend: '%s' did not fit the budget", key);
        if (rc == 0)
            out->source = KVT_HIT_COLD;
        pthread_mutex_unlock(&pc->mu);
    }
    kvt_entry_clear(&r);
    return rc;
}
