/*
 * store_fingerprint.c: the SSD tier's config fingerprint from a model's
 * recipe for fresh caches (kvtier/store.h). Owns nothing past the call: the
 * caches it has made are disposed before it returns; it never opens a store.
 */
#include "kvtier/store.h"

#include "internal.h"

KVT_API int kvt_store_config_fingerprint_of(kvt_new_caches_fn new_caches, void *ctx, int32_t n_layers,
                                            char out[KVT_STORE_FINGERPRINT_LEN])
{
    if (!new_caches || !out || n_layers < 1 || n_layers > 256)
        return kvt__fail(KVT_EINVAL, "kvt_store_config_fingerprint_of: NULL new_caches or out, or %d layers "
                         "(1..256)", (int)n_layers);
    kvt_cache **c = kvt__calloc((size_t)n_layers, sizeof *c);
    if (!c)
        return kvt__fail(KVT_ENOMEM, "kvt_store_config_fingerprint_of: out of memory");
    int rc = new_caches(ctx, c);
    if (rc)
        kvt__fail(rc, "kvt_store_config_fingerprint_of: new_caches failed: %s", kvt_strerror(rc));
    for (int32_t i = 0; !rc && i < n_layers; i++)
        if (!c[i])
            rc = kvt__fail(KVT_EINVAL, "kvt_store_config_fingerprint_of: new_caches left layer %d NULL", i);
    if (!rc)
        rc = kvt_store_config_fingerprint(c, n_layers, out);
    kvt_caches_dispose(c, n_layers);
    kvt__free(c);
    return rc;
}
