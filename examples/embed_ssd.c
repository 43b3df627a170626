/*
 * embed_ssd.c: the SSD store as the prompt cache's cold tier. A first
 * process computes a 40-token prefix and shuts down; a second process
 * (forked before any kvtier object exists) gets it back from disk.
 * Shutdown order: the prompt cache first (destroy hands every entry to the
 * store and flushes it), then the store (kvt_store_close).
 * Usage: embed_ssd DIR   (created if absent; run again to resume from it)
 * Build: cc embed_ssd.c $(pkg-config --cflags --libs kvtier)
 */
#define _POSIX_C_SOURCE 200809L
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

static int new_caches(void *ctx, kvt_cache **caches)
{
    (void)ctx;
    int rc = 0;
    for (int l = 0; l < L && !rc; l++)
        rc = kvt_kv_create(D, 16, &caches[l]);
    return rc;
}

/* One request: reuse, prefill the new tokens, put back; returns the reuse. */
static int64_t serve(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n, kvt_hit_source *from)
{
    kvt_hit hit;
    CHECK(kvt_prompt_cache_lend(pc, prompt, n, "", NULL, &hit));
    for (int64_t t = hit.prefix_len; t < n; t++) {
        float kv[D] = {(float)prompt[t], (float)prompt[t], (float)prompt[t], (float)prompt[t]};
        const void *in[2] = {kv, kv};
        for (int l = 0; l < L; l++)
            CHECK(kvt_cache_append(hit.entry.caches[l], 1, in));
    }
    int64_t reused = hit.prefix_len;
    *from = hit.source;
    CHECK(kvt_prompt_cache_put_hit(pc, &hit, prompt, n, NULL));
    kvt_hit_clear(&hit);
    return reused;
}

/* Opens this model's store under dir (the identity says which model wrote
 * a shard: another model's are never served) and a prompt cache over it. */
static void open_tiers(const char *dir, kvt_store **store, kvt_cold_tier *tier, kvt_prompt_cache **pc)
{
    char fp[KVT_STORE_FINGERPRINT_LEN];
    CHECK(kvt_store_config_fingerprint_of(new_caches, NULL, L, fp));
    kvt_store_identity id = {.model_id = "example-model", .config_fingerprint = fp,
                             .tokenizer_hash = "example-tokenizer"};
    CHECK(kvt_store_open(dir, &id, NULL, store));
    kvt_store_cold_tier(*store, tier);
    kvt_prompt_cache_config cfg = {.max_bytes = 1 << 20, .cold = tier, .new_caches = new_caches,
                                   .n_layers = L};
    CHECK(kvt_prompt_cache_create(&cfg, pc));
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
    kvt_cold_tier tier;
    kvt_prompt_cache *pc;
    kvt_hit_source from;
    pid_t child = fork();
    if (child == 0) { /* process 1: compute 40 tokens, keep them, shut down */
        open_tiers(argv[1], &store, &tier, &pc);
        serve(pc, prompt, 40, &from);
        kvt_prompt_cache_destroy(pc); /* hands the entry to the store, flushes it */
        CHECK(kvt_store_close(store));
        _exit(0);
    }
    int status;
    if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status))
        return 1;
    open_tiers(argv[1], &store, &tier, &pc); /* process 2: empty RAM, the prefix on disk */
    int64_t reused = serve(pc, prompt, 60, &from);
    printf("second process: reused %lld tokens from %s\n", (long long)reused,
           from == KVT_HIT_COLD ? "the SSD store" : "RAM");
    CHECK(kvt_prompt_cache_close(pc)); /* the same as destroy does, with its status */
    kvt_prompt_cache_destroy(pc);
    CHECK(kvt_store_close(store));
    /* 40 on a fresh DIR; a DIR of an earlier run holds all 60 (an exact
     * repeat reuses all but the last token: 59) */
    return reused >= 40 && from == KVT_HIT_COLD ? 0 : 1;
}
