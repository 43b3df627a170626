/*
 * embed_ram.c: the RAM prefix cache from an engine's side. The five steps
 * (create caches, put, take, extend, miss) are one code path: take lends
 * the longest cached prefix, or fresh caches on a miss; the engine prefills
 * only what is new; put_hit puts the longer state back. Two plain kv
 * layers; "prefill" appends K = V = the token id, so reuse can be checked.
 * Build: cc embed_ram.c $(pkg-config --cflags --libs kvtier)
 */
#include <kvtier/prompt_cache.h>
#include <stdio.h>
#include <stdlib.h>

#define L 2  /* layers */
#define D 4  /* floats per token of K (and of V) */
#define B 16 /* tokens per kv block */
#define CHECK(x) do { int rc_ = (x); if (rc_) { fprintf(stderr, "%s: %s (%s)\n", #x, \
    kvt_strerror(rc_), kvt_last_error()); exit(1); } } while (0)

/* The model's fresh state: what a miss lends. */
static int new_caches(void *ctx, kvt_cache **caches)
{
    (void)ctx;
    int rc = 0;
    for (int l = 0; l < L && !rc; l++)
        rc = kvt_kv_create(D, B, &caches[l]);
    return rc; /* on error the library disposes what was made */
}

/* One request: reuse what the cache holds, prefill the rest, keep it all. */
static int64_t serve(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n)
{
    kvt_hit hit;
    CHECK(kvt_prompt_cache_take(pc, prompt, n, "", NULL, &hit));
    for (int64_t t = hit.prefix_len; t < n; t++) { /* prefill only the new tokens */
        float kv[D] = {(float)prompt[t], (float)prompt[t], (float)prompt[t], (float)prompt[t]};
        const void *in[2] = {kv, kv};
        for (int l = 0; l < L; l++)
            CHECK(kvt_cache_append(hit.entry.caches[l], 1, in));
    }
    int64_t reused = hit.prefix_len;
    CHECK(kvt_prompt_cache_put_hit(pc, &hit, prompt, n, NULL)); /* adopts the caches */
    kvt_hit_dispose(&hit);                                      /* a no-op after put_hit */
    return reused;
}

int main(void)
{
    int32_t prompt[60], other[8] = {7, 7, 7, 7, 7, 7, 7, 7};
    for (int i = 0; i < 60; i++)
        prompt[i] = 100 + i;
    kvt_prompt_cache_config cfg = {.max_bytes = 1 << 20, .new_caches = new_caches, .n_layers = L};
    kvt_prompt_cache *pc;
    CHECK(kvt_prompt_cache_create(&cfg, &pc));
    int64_t a = serve(pc, prompt, 40); /* miss: fresh caches, 40 tokens prefilled, put */
    int64_t b = serve(pc, prompt, 60); /* take reuses 40 (zero-copy), extends to 60 */
    int64_t c = serve(pc, other, 8);   /* another prompt: a miss again */
    kvt_hit hit;                       /* what the cache lends now */
    CHECK(kvt_prompt_cache_take(pc, prompt, 60, "", NULL, &hit));
    const float *k;
    CHECK(kvt_kv_block(hit.entry.caches[0], 3, &k, NULL, NULL));
    printf("reused %lld, %lld, %lld tokens; now %lld, block 3 starts with token %.0f\n", (long long)a,
           (long long)b, (long long)c, (long long)hit.prefix_len, k[0]);
    int ok = a == 0 && b == 40 && c == 0 && hit.prefix_len == 59 && k[0] == 148.0f;
    kvt_hit_dispose(&hit);
    kvt_prompt_cache_destroy(pc);
    return ok ? 0 : 1;
}
