/*
 * pc_layers.c: the prompt cache's residency by layer
 * (kvt_prompt_cache_layer_usage): a walk of the resident entries under the
 * cache's lock that gives each layer its bytes (every buffer counted once,
 * as the budget counts it, plus the layer's private bytes) and the number of
 * its buffers more than one entry holds (shared blocks). Report-time only:
 * it adds nothing to put, lend or eviction.
 */
#include "prompt_cache_internal.h"

#include <string.h>

typedef struct layer_walk {
    kvt_prompt_cache *pc;
    kvt__umap *seen;
    uint64_t *bytes, *shared;
    int failed;
} layer_walk;

static void visit_buf(kvt_buf *b, void *ctx)
{
    layer_walk *w = ctx;
    uint64_t key = (uint64_t)(uintptr_t)b;
    if (w->failed || kvt__umap_get(w->seen, key))
        return;
    if (kvt__umap_put(w->seen, key, 1) != 0) {
        w->failed = 1;
        return;
    }
    *w->bytes += kvt_buf_bytes(b);
    uint64_t *refs = kvt__umap_get(&w->pc->buf_refs, key);
    if (refs && *refs > 1)
        ++*w->shared;
}

KVT_API int kvt_prompt_cache_layer_usage(kvt_prompt_cache *pc, int32_t n_layers, uint64_t *bytes, uint64_t *shared)
{
    if (!pc || n_layers < 0 || (n_layers && (!bytes || !shared)))
        return kvt__fail(KVT_EINVAL, "kvt_prompt_cache_layer_usage: NULL argument or %d layers", (int)n_layers);
    for (int32_t i = 0; i < n_layers; i++)
        bytes[i] = shared[i] = 0;
    kvt__umap seen = {0};
    layer_walk w = {.pc = pc, .seen = &seen};
    pthread_mutex_lock(&pc->mu);
    for (pc_entry *e = pc->head; e && !w.failed; e = e->next)
        for (int32_t i = 0; i < e->n_caches && i < n_layers; i++) {
            const kvt_cache *c = e->caches[i];
            bytes[i] += c->ops->private_bytes(c);
            w.bytes = &bytes[i];
            w.shared = &shared[i];
            c->ops->foreach_buf(c, visit_buf, &w);
        }
    pthread_mutex_unlock(&pc->mu);
    kvt__umap_free(&seen);
    if (w.failed)
        return kvt__fail(KVT_ENOMEM, "kvt_prompt_cache_layer_usage: out of memory walking the entries");
    return 0;
}
