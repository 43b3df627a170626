/*
 * pc_blocks.c: block keys, holder counts and tail owners behind the prompt
 * cache's block-granular eviction (pc_blocks.h). It only keeps books and
 * asks the block policy for victims; it must never free, trim or unlink an
 * entry itself (the prompt cache does, then reports it here).
 */
#include "pc_blocks.h"

#include "hmap.h"
#include "internal.h"
#include "key.h"

#include <string.h>

struct kvt__pc_blocks {
    kvt_block_policy *policy; /* borrowed */
    int32_t block_tokens;
    int64_t clock;            /* blocks requested so far (the policy's time) */
    kvt__umap holders;        /* key -> (depth << 32) | holder count */
    kvt__umap tails;          /* key -> entry ending in that block */
};

int kvt__pc_blocks_create(kvt_block_policy *policy, int32_t block_tokens, kvt__pc_blocks **out)
{
    if (!policy || !out || block_tokens < 1)
        return kvt__fail(KVT_EINVAL, "block eviction: NULL policy or block_tokens %d < 1", (int)block_tokens);
    kvt__pc_blocks *b = kvt__calloc(1, sizeof *b);
    if (!b)
        return kvt__fail(KVT_ENOMEM, "block eviction: out of memory");
    b->policy = policy;
    b->block_tokens = block_tokens;
    *out = b;
    return 0;
}

void kvt__pc_blocks_destroy(kvt__pc_blocks *b)
{
    if (!b)
        return;
    kvt__umap_free(&b->holders);
    kvt__umap_free(&b->tails);
    kvt__free(b);
}

int32_t kvt__pc_blocks_block_tokens(const kvt__pc_blocks *b) { return b->block_tokens; }

void kvt__pc_blocks_clock(kvt__pc_blocks *b, int64_t n_tokens)
{
    b->clock += (n_tokens + b->block_tokens - 1) / b->block_tokens;
}

int kvt__pc_blocks_keys(const kvt__pc_blocks *b, const char *ns, const int32_t *tokens, int64_t n,
                        uint64_t **keys, int64_t *n_keys)
{
    int64_t B = b->block_tokens, nk = (n + B - 1) / B;
    *keys = NULL;
    *n_keys = 0;
    if (nk == 0)
        return 0;
    uint64_t *k = kvt__malloc((size_t)nk * sizeof *k);
    if (!k)
        return kvt__fail(KVT_ENOMEM, "block eviction: out of memory for %lld keys", (long long)nk);
    /* the content keys every tier uses (key.h), without an identity: the
     * RAM tier holds one model; the policy and the maps take 64 bits */
    kvt__key parent = KVT__KEY_ZERO;
    for (int64_t i = 0; i < nk; i++) {
        int64_t len = KVT__MIN(B, n - i * B);
        parent = kvt__block_key(KVT__KEY_ZERO, ns, parent, tokens + i * B, len);
        k[i] = kvt__key_word(parent); /* never 0: reserved by the policy and the map */
    }
    *keys = k;
    *n_keys = nk;
    return 0;
}

static unsigned flags_of(const kvt__pc_blocks *b, int64_t i, int64_t n_keys, int64_t n_tokens)
{
    return (i == n_keys - 1 && n_tokens % b->block_tokens) ? KVT_BLOCK_TAIL : 0;
}

/* One holder of key lets go; a block with none left leaves the policy. */
static void unhold(kvt__pc_blocks *b, uint64_t key)
{
    uint64_t *v = kvt__umap_get(&b->holders, key);
    if (v && (--*v & 0xffffffffu) == 0) {
        kvt__umap_del(&b->holders, key);
        kvt_block_policy_remove(b->policy, key);
    }
}

int kvt__pc_blocks_add(kvt__pc_blocks *b, void *owner, const uint64_t *keys, int64_t n_keys,
                       int64_t n_tokens)
{
    int64_t i;
    int rc = 0;
    for (i = 0; i < n_keys; i++) {
        uint64_t *v = kvt__umap_get(&b->holders, keys[i]);
        if (v) {
            ++*v;
            continue;
        }
        if ((rc = kvt__umap_put(&b->holders, keys[i], ((uint64_t)i << 32) | 1u)))
            break;
        if ((rc = kvt_block_policy_touch(b->policy, keys[i], i ? keys[i - 1] : 0, b->clock, (int32_t)i,
                                         flags_of(b, i, n_keys, n_tokens)))) {
            kvt__umap_del(&b->holders, keys[i]);
            break;
        }
    }
    if (rc == 0 && n_keys > 0)
        rc = kvt__umap_put(&b->tails, keys[n_keys - 1], (uint64_t)(uintptr_t)owner);
    if (rc) {
        /* undo the holders added so far (blocks new to the policy leave it) */
        for (int64_t j = 0; j < i; j++)
            unhold(b, keys[j]);
        return kvt__fail(KVT_ENOMEM, "block eviction: out of memory tracking %lld blocks", (long long)n_keys);
    }
    kvt__pc_blocks_touch(b, keys, n_keys, n_keys, n_tokens);
    return 0;
}

void kvt__pc_blocks_touch(kvt__pc_blocks *b, const uint64_t *keys, int64_t k, int64_t n_keys,
                          int64_t n_tokens)
{
    for (int64_t i = 0; i < k && i < n_keys; i++)
        if (kvt_block_policy_contains(b->policy, keys[i]))
            (void)kvt_block_policy_touch(b->policy, keys[i], i ? keys[i - 1] : 0, b->clock, (int32_t)i,
                                         flags_of(b, i, n_keys, n_tokens)); /* tracked: no allocation */
}

void kvt__pc_blocks_drop(kvt__pc_blocks *b, void *owner, const uint64_t *keys, int64_t from,
                         int64_t n_keys)
{
    if (n_keys > 0) {
        uint64_t *t = kvt__umap_get(&b->tails, keys[n_keys - 1]);
        if (t && *t == (uint64_t)(uintptr_t)owner)
            kvt__umap_del(&b->tails, keys[n_keys - 1]);
    }
    for (int64_t i = from; i < n_keys; i++)
        unhold(b, keys[i]);
    /* a cut entry ends in keys[from-1] now; the put may fail on OOM, then the
     * block simply has no tail owner and is dropped when it is the victim */
    if (from > 0 && from <= n_keys)
        (void)kvt__umap_put(&b->tails, keys[from - 1], (uint64_t)(uintptr_t)owner);
}

int kvt__pc_blocks_victim(kvt__pc_blocks *b, void **owner, int64_t *depth)
{
    uint64_t key;
    *owner = NULL;
    *depth = 0;
    if (kvt_block_policy_victim(b->policy, &key) != 0)
        return KVT_ENOTFOUND;
    uint64_t *t = kvt__umap_get(&b->tails, key);
    uint64_t *v = kvt__umap_get(&b->holders, key);
    if (!t || !v) {
        /* not the end of any entry: cannot be cut on its own; forget it */
        kvt_block_policy_remove(b->policy, key);
        return 0;
    }
    *owner = (void *)(uintptr_t)*t;
    *depth = (int64_t)(*v >> 32);
    return 0;
}

int64_t kvt__pc_blocks_extend(kvt__pc_blocks *b, const uint64_t *keys, int64_t depth, int64_t max_blocks)
{
    int64_t d = depth;
    while (depth - d + 1 < max_blocks && d > 0) {
        uint64_t v;
        if (kvt_block_policy_victim(b->policy, &v) != 0 || v != keys[d])
            break;
        uint64_t *h = kvt__umap_get(&b->holders, keys[d - 1]);
        if (!h || (*h & 0xffffffffu) != 1)
            break;
        kvt_block_policy_remove(b->policy, keys[d]); /* cut either way */
        if (kvt_block_policy_victim(b->policy, &v) != 0 || v != keys[d - 1])
            break;
        d--;
    }
    return d;
}
