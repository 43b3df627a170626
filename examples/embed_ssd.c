/*
 * embed_ssd.c: the SSD store as the prompt cache's cold tier. A first
 * process computes a 40-token prefix and shuts down; a second process
 * (forked before any kvtier object exists) gets it back from disk.
 * Shutdown order: the prompt cache hands its entries to the store and is
 * destroyed, then the store is flushed and closed.
 * Usage: embed_ssd DIR   (DIR is created; reuse it to resume)
 * Build: cc embed_ssd.c $(pkg-config --cflags --libs kvtier)
 */
#include <kvtier/prompt_cache.h>
#include <kvtier/store.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define L 2
#define D 4
#define CHECK(x) do { int rc_ = (x); if (rc_) { fprintf(stderr, "%s: %s (%s)\n", #x, \
    kvt_strerror(rc_), kvt_last_error()); exit(1); } } while (0)

static void fresh_caches(kvt_cache **caches)
{
    for (int l = 0; l < L; l++)
        CHECK(kvt_kv_create(D, 16, &caches[l]));
}

static void prefill(kvt_cache **caches, const int32_t *tokens, int64_t from, int64_t to)
{
    for (int64_t t = from; t < to; t++) {
        float kv[D] = {(float)tokens[t], (float)tokens[t], (float)tokens[t], (float)tokens[t]};
        const void *in[2] = {kv, kv};
        for (int l = 0; l < L; l++)
            CHECK(kvt_cache_append(caches[l], 1, in));
    }
}

/* Opens the store of this model under dir and a prompt cache over it. */
static void open_tiers(const char *dir, kvt_store **store, kvt_prompt_cache **pc, kvt_cold_tier *tier)
{
    kvt_cache *shape[L]; /* the fingerprint is read off a set of empty caches */
    fresh_caches(shape);
    char fp[KVT_STORE_FINGERPRINT_LEN];
    CHECK(kvt_store_config_fingerprint(shape, L, fp));
    kvt_caches_dispose(shape, L);
    kvt_store_identity id = {.model_id = "example-model", .config_fingerprint = fp,
                             .tokenizer_hash = "example-tokenizer"};
    CHECK(kvt_store_open(dir, &id, NULL, store));
    kvt_store_cold_tier(*store, tier);
    kvt_prompt_cache_config cfg = {.max_bytes = 1 << 20, .cold = tier};
    CHECK(kvt_prompt_cache_create(&cfg, pc));
}

/* The shutdown order: entries to the store, store flushed, cache, store. */
static void close_tiers(kvt_store *store, kvt_prompt_cache *pc)
{
    kvt_prompt_cache_stats st;
    kvt_prompt_cache_stats_get(pc, &st);
    CHECK(kvt_prompt_cache_evict(pc, st.entries, NULL)); /* spills each entry */
    CHECK(kvt_store_flush(store));                      /* makes the spills durable */
    kvt_prompt_cache_destroy(pc);                       /* would drop, not spill */
    CHECK(kvt_store_close(store));
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: embed_ssd DIR\n");
        return 2;
    }
    int32_t prompt[60];
    for (int i = 0; i < 60; i++)
        prompt[i] = 100 + i;
    kvt_store *store;
    kvt_prompt_cache *pc;
    kvt_cold_tier tier;
    pid_t child = fork();
    if (child == 0) { /* process 1: compute 40 tokens, keep them, shut down */
        open_tiers(argv[1], &store, &pc, &tier);
        kvt_cache *caches[L];
        fresh_caches(caches);
        prefill(caches, prompt, 0, 40);
        kvt_entry e = {.ns = "", .tokens = prompt, .n_tokens = 40, .caches = caches, .n_caches = L};
        CHECK(kvt_prompt_cache_put(pc, &e, NULL));
        close_tiers(store, pc);
        _exit(0);
    }
    int status;
    if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status))
        return 1;

    /* process 2: a fresh RAM tier; the prefix comes back from disk */
    open_tiers(argv[1], &store, &pc, &tier);
    kvt_hit hit;
    CHECK(kvt_prompt_cache_take(pc, prompt, 60, "", NULL, &hit));
    const float *k, *v;
    int32_t n;
    CHECK(kvt_kv_block(hit.entry.caches[0], 2, &k, &v, &n));
    printf("second process: %lld tokens reused from %s, block 2 starts with token %.0f\n",
           (long long)hit.prefix_len, hit.source == KVT_HIT_COLD ? "SSD" : "RAM", k[0]);
    int ok = hit.prefix_len == 40 && hit.source == KVT_HIT_COLD && k[0] == 132.0f;
    kvt_hit_dispose(&hit);
    close_tiers(store, pc);
    return ok ? 0 : 1;
}
