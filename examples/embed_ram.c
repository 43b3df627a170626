/*
 * embed_ram.c: the RAM prefix cache from an engine's side, in five steps:
 * create caches, put, take, extend, miss. Two plain kv layers; "prefill"
 * appends K = V = the token id so what comes back can be checked.
 * Build: cc embed_ram.c $(pkg-config --cflags --libs kvtier)
 */
#include <kvtier/prompt_cache.h>
#include <stdio.h>
#include <stdlib.h>

#define L 2 /* layers */
#define D 4 /* floats per token of K (and of V) */
#define CHECK(x) do { int rc_ = (x); if (rc_) { fprintf(stderr, "%s: %s (%s)\n", #x, \
    kvt_strerror(rc_), kvt_last_error()); exit(1); } } while (0)

static void prefill(kvt_cache **caches, const int32_t *tokens, int64_t from, int64_t to)
{
    for (int64_t t = from; t < to; t++) {
        float kv[D] = {(float)tokens[t], (float)tokens[t], (float)tokens[t], (float)tokens[t]};
        const void *in[2] = {kv, kv};
        for (int l = 0; l < L; l++)
            CHECK(kvt_cache_append(caches[l], 1, in));
    }
}

static void fresh_caches(kvt_cache **caches)
{
    for (int l = 0; l < L; l++)
        CHECK(kvt_kv_create(D, 16, &caches[l]));
}

int main(void)
{
    int32_t prompt[60];
    for (int i = 0; i < 60; i++)
        prompt[i] = 100 + i;
    kvt_prompt_cache_config cfg = {.max_bytes = 1 << 20};
    kvt_prompt_cache *pc;
    CHECK(kvt_prompt_cache_create(&cfg, &pc));

    /* 1-2. create caches, prefill 40 tokens, put them (the cache adopts them) */
    kvt_cache *caches[L];
    fresh_caches(caches);
    prefill(caches, prompt, 0, 40);
    kvt_entry e = {.ns = "", .tokens = prompt, .n_tokens = 40, .caches = caches, .n_caches = L};
    CHECK(kvt_prompt_cache_put(pc, &e, NULL));

    /* 3. take: the 60-token prompt reuses the first 40 (zero-copy views) */
    kvt_hit hit;
    CHECK(kvt_prompt_cache_take(pc, prompt, 60, "", NULL, &hit));
    const float *k, *v;
    int32_t n;
    CHECK(kvt_kv_block(hit.entry.caches[0], 2, &k, &v, &n));
    printf("hit: %lld tokens reused, block 2 starts with token %.0f\n", (long long)hit.prefix_len, k[0]);

    /* 4. extend: prefill only the new tokens, put the longer entry back */
    prefill(hit.entry.caches, prompt, hit.prefix_len, 60);
    kvt_entry longer = {.ns = "", .tokens = prompt, .n_tokens = 60, .caches = hit.entry.caches,
                        .n_caches = L, .hook = hit.entry.hook};
    hit.entry.hook = (kvt_hook){0}; /* the hook share moves to the new entry */
    int rc = kvt_prompt_cache_put(pc, &longer, NULL);
    if (rc)
        hit.entry.hook = longer.hook; /* not adopted: give it back */
    kvt_hit_dispose(&hit);
    CHECK(rc);

    /* 5. miss: another prompt; nothing lent, so the engine makes fresh caches */
    int32_t other[8] = {7, 7, 7, 7, 7, 7, 7, 7};
    CHECK(kvt_prompt_cache_take(pc, other, 8, "", NULL, &hit));
    printf("miss: %lld tokens reused\n", (long long)hit.prefix_len);
    kvt_hit_dispose(&hit);
    fresh_caches(caches);
    prefill(caches, other, 0, 8);
    kvt_caches_dispose(caches, L);

    kvt_prompt_cache_stats st;
    kvt_prompt_cache_stats_get(pc, &st);
    printf("entries %lld, bytes %zu, hits %llu, misses %llu\n", (long long)st.entries, st.bytes,
           (unsigned long long)st.hits, (unsigned long long)st.misses);
    kvt_prompt_cache_destroy(pc);
    return st.entries == 1 && st.hits == 1 && st.misses == 1 ? 0 : 1;
}
