/*
 * bench_dedup.c: `kvtier bench dedup`: 200 entries that share a 16,384-token
 * system prompt and differ after it, built the way an engine builds them
 * (take the system prompt's views, prefill the tail into them, put). Prints
 * the RAM bytes the prompt cache holds next to the ideal (one copy of the
 * shared prefix plus the distinct tails, in exact token bytes) and next to a
 * baseline measured in the same run: the bytes the same entries hold when
 * each is counted whole (no sharing), i.e. what a cache that copies or
 * counts per entry would hold. Goal: within 10% of the ideal.
 * Owns nothing beyond the run; writes no files.
 */
#include "bench_util.h"
#include "cli.h"

#include "kvtier/prompt_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd32(void) { return kvt_bench_util_rnd32(&rng); }

static void usage(FILE *f) { fprintf(f, "usage: kvtier bench dedup [--entries N] [--system TOKENS] [--block B]\n"); }

int kvt_bench_dedup(int argc, char **argv)
{
    int n_entries = 200, layers = 2, sys_tokens = 16384, tail_min = 1000, tail_max = 3000;
    int32_t kv_dim = 16, block = 256;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--entries") && i + 1 < argc)
            n_entries = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--block") && i + 1 < argc)
            block = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--system") && i + 1 < argc)
            sys_tokens = atoi(argv[++i]);
        else {
            usage(stderr);
            return 2;
        }
    }
    if (n_entries < 1 || block < 1 || sys_tokens < 2) {
        fprintf(stderr, "kvtier bench dedup: need entries >= 1, block >= 1, system >= 2\n");
        return 2;
    }
    kvt_prompt_cache_config cfg = {.max_bytes = (size_t)1 << 40, .block_tokens = block};
    kvt_prompt_cache *pc;
    if (kvt_prompt_cache_create(&cfg, &pc) != 0)
        return 1;
    int64_t max_n = (int64_t)sys_tokens + tail_max;
    int32_t *tok = malloc((size_t)max_n * sizeof *tok);
    if (!tok)
        return 1;
    for (int i = 0; i < sys_tokens; i++)
        tok[i] = (int32_t)(rnd32() % 32000);
    size_t per_token = (size_t)layers * 2 * (size_t)kv_dim * sizeof(float);

    /* the system prompt, prefilled once */
    kvt_cache *c[8];
    int rc = 0;
    for (int l = 0; l < layers && rc == 0; l++)
        rc = kvt_kv_create(kv_dim, block, &c[l]);
    if (rc == 0)
        rc = kvt_bench_util_append(c, layers, kv_dim, sys_tokens);
    kvt_entry e = {"", tok, sys_tokens, c, layers, NULL, 0, {0}};
    if (rc == 0)
        rc = kvt_prompt_cache_put(pc, &e, NULL);
    if (rc) {
        fprintf(stderr, "kvtier bench dedup: %s (%s)\n", kvt_strerror(rc), kvt_last_error());
        return 1;
    }

    int64_t tails = 0;
    size_t whole = 0; /* baseline: every entry counted whole */
    for (int i = 0; i < n_entries && rc == 0; i++) {
        int64_t tail = tail_min + (int64_t)(rnd32() % (uint32_t)(tail_max - tail_min + 1));
        int64_t n = sys_tokens + tail;
        for (int64_t k = sys_tokens; k < n; k++)
            tok[k] = (int32_t)(32000 + rnd32() % 32000); /* differs right after the system prompt */
        kvt_hit h;
        rc = kvt_prompt_cache_lend(pc, tok, n, "", NULL, &h);
        if (rc == 0 && h.prefix_len != sys_tokens) {
            fprintf(stderr, "kvtier bench dedup: entry %d reused %lld tokens, expected %d\n", i,
                    (long long)h.prefix_len, sys_tokens);
            rc = 1;
        }
        if (rc == 0) {
            for (int l = 0; l < layers; l++) {
                c[l] = h.entry.caches[l];
                h.entry.caches[l] = NULL;
            }
            rc = kvt_bench_util_append(c, layers, kv_dim, tail);
            for (int l = 0; l < layers && rc == 0; l++)
                whole += kvt_cache_bytes(c[l]);
            kvt_entry x = {"", tok, n, c, layers, NULL, 0, {0}};
            if (rc == 0)
                rc = kvt_prompt_cache_put(pc, &x, NULL);
            if (rc)
                kvt_caches_destroy(c, layers);
        }
        kvt_hit_clear(&h);
        tails += tail;
    }
    if (rc) {
        fprintf(stderr, "kvtier bench dedup: building failed: %s\n", kvt_last_error());
        return 1;
    }
    kvt_prompt_cache_stats st;
    kvt_prompt_cache_get_stats(pc, &st);
    size_t ideal = ((size_t)sys_tokens + (size_t)tails) * per_token;
    double ratio = (double)st.bytes / (double)ideal;
    printf("dedup: %lld entries sharing a %d-token system prompt, tails of %d..%d tokens (mean %.0f), "
           "%d layers x kv_dim %d, blocks of %d tokens\n",
           (long long)st.entries, sys_tokens, tail_min, tail_max, (double)tails / n_entries, layers, (int)kv_dim, block);
    printf("  RAM bytes held by the prompt cache:          %12zu\n", st.bytes);
    printf("  one shared prefix + the distinct tails:      %12zu  (ideal, exact token bytes)\n", ideal);
    printf("  entries counted whole (no sharing, baseline): %11zu  (%.1fx the ideal)\n", whole,
           (double)whole / (double)ideal);
    printf("  held / ideal = %.3f (goal within 10%%: %s)\n", ratio, ratio <= 1.10 ? "met" : "NOT met");
    kvt_prompt_cache_destroy(pc);
    free(tok);
    return ratio <= 1.10 ? 0 : 1;
}
