/*
 * pc_util.c: the prompt-cache test helpers of pc_util.h. Test code only:
 * owns nothing between calls and never touches a prompt cache's internals.
 */
#include "pc_util.h"

#include <stdlib.h>
#include <string.h>

int pcu_extend(kvt_cache **caches, int nc, const int32_t *tokens, int64_t n)
{
    if (n == 0)
        return 0;
    for (int l = 0; l < nc; l++) {
        int64_t off = kvt_cache_offset(caches[l]);
        const char *kind = kvt_cache_kind(caches[l]);
        int rc;
        if (strcmp(kind, "recurrent") == 0) {
            uint32_t st[4] = {0};
            const uint32_t *cur = kvt_recurrent_state(caches[l]);
            if (cur)
                memcpy(st, cur, sizeof st);
            for (int64_t i = 0; i < n; i++)
                st[i % 4] = st[i % 4] * 31u + (uint32_t)tokens[i] + 7u;
            const void *in[1] = {st};
            rc = kvt_cache_append(caches[l], n, in);
        } else {
            float *k = malloc((size_t)n * PCU_KV_DIM * sizeof(float));
            float *v = malloc((size_t)n * PCU_KV_DIM * sizeof(float));
            if (!k || !v) {
                free(k);
                free(v);
                return KVT_ENOMEM;
            }
            for (int64_t i = 0; i < n; i++)
                for (int d = 0; d < PCU_KV_DIM; d++) {
                    k[i * PCU_KV_DIM + d] = (float)(tokens[i] * 10 + d) + 0.001f * (float)(off + i);
                    v[i * PCU_KV_DIM + d] = -(float)(tokens[i] * 10 + d) + (float)l;
                }
            const void *in[2] = {k, v};
            rc = kvt_cache_append(caches[l], n, in);
            free(k);
            free(v);
        }
        if (rc)
            return rc;
    }
    return 0;
}

int pcu_fresh(const char *kinds, kvt_cache **caches, const int32_t *tokens, int64_t n)
{
    int nc = (int)strlen(kinds);
    for (int l = 0; l < nc; l++) {
        int rc;
        switch (kinds[l]) {
        case 'r': rc = kvt_recurrent_create(16, &caches[l]); break;
        case 'w': rc = kvt_rotating_create(PCU_KV_DIM, 6, 0, &caches[l]); break;
        default: rc = kvt_kv_create(PCU_KV_DIM, PCU_BLOCK, &caches[l]); break;
        }
        if (rc) {
            kvt_caches_destroy(caches, l);
            return rc;
        }
    }
    int rc = pcu_extend(caches, nc, tokens, n);
    if (rc)
        kvt_caches_destroy(caches, nc);
    return rc;
}

int pcu_put(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n, kvt_cache **caches, int nc,
            kvt_attachment **atts, int na, kvt_hook hook, const char *session)
{
    kvt_entry e = {ns, tokens, n, caches, nc, atts, na, hook};
    int rc = kvt_prompt_cache_put(pc, &e, session);
    if (rc) {
        kvt_caches_destroy(caches, nc);
        for (int i = 0; i < na; i++)
            kvt_attachment_destroy(atts[i]);
        kvt_hook_run(&e.hook);
    }
    return rc;
}

int pcu_put_fresh(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n, const char *kinds,
                  const char *session)
{
    kvt_cache *c[8];
    int rc = pcu_fresh(kinds, c, tokens, n);
    if (rc)
        return rc;
    return pcu_put(pc, ns, tokens, n, c, (int)strlen(kinds), NULL, 0, (kvt_hook){0}, session);
}

typedef struct ub_ctx {
    kvt_buf **seen;
    size_t n, cap;
    size_t bytes;
} ub_ctx;

static void ub_add(kvt_buf *b, void *p)
{
    ub_ctx *c = p;
    for (size_t i = 0; i < c->n; i++)
        if (c->seen[i] == b)
            return;
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 64;
        c->seen = realloc(c->seen, c->cap * sizeof *c->seen);
    }
    c->seen[c->n++] = b;
    c->bytes += kvt_buf_bytes(b);
}

size_t pcu_unique_bytes(kvt_cache *const *caches, int nc)
{
    ub_ctx c = {0};
    size_t priv = 0;
    for (int l = 0; l < nc; l++) {
        priv += caches[l]->ops->private_bytes(caches[l]);
        caches[l]->ops->foreach_buf(caches[l], ub_add, &c);
    }
    free(c.seen);
    return c.bytes + priv;
}

void pcu_seq(int32_t *t, int64_t n, int32_t base)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

kvt_prompt_cache_stats pcu_stats(kvt_prompt_cache *pc)
{
    kvt_prompt_cache_stats s;
    kvt_prompt_cache_get_stats(pc, &s);
    return s;
}
