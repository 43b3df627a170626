/*
 * bench_lookup.c: `kvtier bench lookup`: the time of one prefix lookup in
 * the prompt cache (kvt_prompt_cache_lend: find the longest cached prefix of
 * the prompt and lend zero-copy views of it, then kvt_hit_clear releases
 * them) through the radix index, next to a baseline measured in the same
 * run: a linear scan over the same entries (common prefix per entry, range
 * check, then the same clone+trim+release), written here. Then the same
 * lookup on a 1 MB entry vs a 1 GB entry of the same token count, with the
 * bytes copied (kvt_buf_bytes_copied) counted, to show views are zero-copy.
 *
 * Workload: N entries (default 10,000) sharing a system prompt (4,096
 * tokens), then one of 100 group trunks cut at varied lengths, then a
 * distinct 256-token tail; prompts of 32,768 tokens copy an entry's first q
 * tokens (q varied) and continue with fresh tokens. Entries are built by
 * cloning and extending, so they share blocks (memory stays sane).
 * Owns nothing beyond the run; writes no files.
 */
#include "args.h"
#include "bench_util.h"
#include "cli.h"

#include "kvtier/prompt_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SYS_TOKENS 4096
#define TRUNK_TOKENS 16384
#define TAIL_TOKENS 256
#define GROUPS 100

typedef struct bl_entry {
    int32_t *tokens; /* (n) */
    int64_t n;
    kvt_cache **caches; /* (layers) clones the baseline owns (same blocks as the cache's) */
} bl_entry;

static uint64_t rng = 88172645463325252ULL;
static uint32_t rnd32(void) { return kvt_bench_util_rnd32(&rng); }

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double median_us(uint64_t *ns, int n)
{
    qsort(ns, (size_t)n, sizeof *ns, cmp_u64);
    return (double)ns[n / 2] / 1000.0;
}

static int64_t lcp(const int32_t *a, int64_t na, const int32_t *b, int64_t nb)
{
    int64_t n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* The baseline: a linear scan over every entry, then the same lending work
 * take does (token copy, clone, trim, dispose). Returns p. */
static int64_t baseline_take(bl_entry *es, int n_entries, int layers, const int32_t *prompt, int64_t n)
{
    int64_t best = 0;
    int bi = -1;
    for (int i = 0; i < n_entries; i++) {
        int64_t p = lcp(es[i].tokens, es[i].n, prompt, n);
        if (p > n - 1)
            p = n - 1;
        if (p <= best)
            continue;
        int ok = 1;
        for (int l = 0; l < layers && ok; l++)
            ok = kvt_cache_can_trim(es[i].caches[l], p);
        if (ok) {
            best = p;
            bi = i;
        }
    }
    if (bi < 0)
        return 0;
    int32_t *tok = malloc((size_t)best * sizeof *tok);
    kvt_cache *views[8];
    if (tok)
        memcpy(tok, prompt, (size_t)best * sizeof *tok);
    if (kvt_caches_clone(es[bi].caches, layers, views) == 0) {
        for (int l = 0; l < layers; l++)
            kvt_cache_trim(views[l], best);
        kvt_caches_destroy(views, layers);
    }
    free(tok);
    return best;
}

static int put_entry(kvt_prompt_cache *pc, const char *ns, const int32_t *tokens, int64_t n, kvt_cache **caches,
                     int layers)
{
    kvt_entry e = {ns, tokens, n, caches, layers, NULL, 0, {0}};
    int rc = kvt_prompt_cache_put(pc, &e, NULL);
    if (rc)
        kvt_caches_destroy(caches, layers);
    return rc;
}

/* lookup + lend + release on one big entry (32,768 tokens, one layer of kv_dim) */
static int size_run(int32_t kv_dim, int reps, double *med_us, uint64_t *copied, size_t *bytes)
{
    const int64_t n = 32768;
    kvt_prompt_cache_config cfg = {.max_bytes = (size_t)1 << 40};
    kvt_prompt_cache *pc;
    kvt_cache *c[1];
    int32_t *tok = malloc((size_t)(n + 1) * sizeof *tok);
    uint64_t *t = malloc((size_t)reps * sizeof *t);
    if (!tok || !t || kvt_prompt_cache_create(&cfg, &pc) != 0) {
        free(tok);
        free(t);
        return 1;
    }
    for (int64_t i = 0; i <= n; i++)
        tok[i] = (int32_t)(i * 7 + 1);
    int rc = kvt_kv_create(kv_dim, 256, &c[0]);
    if (rc == 0)
        rc = kvt_bench_util_append(c, 1, kv_dim, n);
    *bytes = rc == 0 ? kvt_cache_bytes(c[0]) : 0;
    if (rc == 0)
        rc = put_entry(pc, "", tok, n, c, 1);
    uint64_t before = kvt_buf_bytes_copied();
    for (int r = 0; r < reps && rc == 0; r++) {
        /* alternate a full-prefix hit and one that trims inside a block */
        int64_t plen = r % 2 ? n + 1 : 30001;
        uint64_t t0 = kvt_now_ns();
        kvt_hit h;
        rc = kvt_prompt_cache_lend(pc, tok, plen, "", NULL, &h);
        kvt_hit_clear(&h);
        t[r] = kvt_now_ns() - t0;
    }
    *copied = kvt_buf_bytes_copied() - before;
    if (rc == 0)
        *med_us = median_us(t, reps);
    kvt_prompt_cache_destroy(pc);
    free(tok);
    free(t);
    return rc != 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier bench lookup [--entries N] [--prompt TOKENS] [--layers L] [--reps R] [--quick]\n"
               "\n"
               "Times one prefix lookup in the prompt cache: find the longest cached prefix of a prompt,\n"
               "lend zero-copy views of it, release them (kvt_prompt_cache_lend + kvt_hit_clear), through\n"
               "the radix index and, as the baseline of the same run, a linear scan of every entry; then\n"
               "the same lookup on a 1 MB and a 1 GB entry of 32768 tokens, with the bytes copied.\n"
               "  --entries N     resident entries (default 10000), at least 1\n"
               "  --prompt TOKENS prompt length (default 32768), at least %d\n"
               "  --layers L      kv layers per entry, 1 to 8 (default 2)\n"
               "  --reps R        prompts timed (default 101; the scan times at most 21)\n"
               "  --quick         500 entries, 21 prompts, no 1 MB / 1 GB run\n"
               "Exit status: 0 success, 1 failure (or prefix lengths that differ from the baseline's),\n"
               "2 usage error.\n", SYS_TOKENS + TRUNK_TOKENS + 2);
}

/* A flag's integer value in [lo, hi]; 2 (said) when it is not one. */
static int int_arg(int argc, char **argv, int *i, long long lo, long long hi, long long *out)
{
    if (*i + 1 >= argc) {
        fprintf(stderr, "kvtier bench lookup: %s needs a value\n", argv[*i]);
        return 2;
    }
    const char *flag = argv[*i];
    return kvt_cli_int_arg("kvtier bench lookup", flag, argv[++*i], lo, hi, out);
}

int kvt_bench_lookup(int argc, char **argv)
{
    int n_entries = 10000, layers = 2, reps = 101, base_reps = 21;
    int64_t prompt_len = 32768;
    int32_t kv_dim = 4, block = 256;
    int skip_size = 0;
    for (int i = 1; i < argc; i++) {
        long long v = 0;
        int rc = 0;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--entries")) {
            if (!(rc = int_arg(argc, argv, &i, 1, 10000000, &v)))
                n_entries = (int)v;
        } else if (!strcmp(argv[i], "--prompt")) {
            if (!(rc = int_arg(argc, argv, &i, SYS_TOKENS + TRUNK_TOKENS + 2, 1 << 24, &v)))
                prompt_len = v;
        } else if (!strcmp(argv[i], "--layers")) {
            if (!(rc = int_arg(argc, argv, &i, 1, 8, &v)))
                layers = (int)v;
        } else if (!strcmp(argv[i], "--reps")) {
            if (!(rc = int_arg(argc, argv, &i, 1, 1000000, &v)))
                reps = (int)v;
        } else if (!strcmp(argv[i], "--quick")) {
            n_entries = 500;
            reps = 21;
            base_reps = 5;
            skip_size = 1;
        } else {
            fprintf(stderr, "kvtier bench lookup: unknown argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
        if (rc)
            return rc;
    }
    if (base_reps > reps)
        base_reps = reps;

    /* ---- build: system prompt -> 100 trunks -> entries ---------------------- */
    uint64_t t_build = kvt_now_ns();
    int32_t *sys = malloc(SYS_TOKENS * sizeof *sys);
    int32_t *trunk = malloc((size_t)GROUPS * TRUNK_TOKENS * sizeof *trunk);
    kvt_cache *sysc[8], *trunkc[GROUPS][8];
    bl_entry *es = calloc((size_t)n_entries, sizeof *es);
    kvt_prompt_cache_config cfg = {.max_bytes = (size_t)1 << 40, .block_tokens = block};
    kvt_prompt_cache *pc = NULL;
    if (!sys || !trunk || !es || kvt_prompt_cache_create(&cfg, &pc) != 0) {
        fprintf(stderr, "kvtier bench lookup: out of memory\n");
        return 1;
    }
    for (int i = 0; i < SYS_TOKENS; i++)
        sys[i] = (int32_t)(rnd32() % 32000);
    for (int i = 0; i < GROUPS * TRUNK_TOKENS; i++)
        trunk[i] = (int32_t)(rnd32() % 32000);
    int rc = 0;
    for (int l = 0; l < layers && rc == 0; l++)
        rc = kvt_kv_create(kv_dim, block, &sysc[l]);
    if (rc == 0)
        rc = kvt_bench_util_append(sysc, layers, kv_dim, SYS_TOKENS);
    for (int g = 0; g < GROUPS && rc == 0; g++) {
        rc = kvt_caches_clone(sysc, layers, trunkc[g]);
        if (rc == 0)
            rc = kvt_bench_util_append(trunkc[g], layers, kv_dim, TRUNK_TOKENS);
    }
    int64_t total_tokens = 0;
    for (int i = 0; i < n_entries && rc == 0; i++) {
        int g = i % GROUPS;
        int64_t cut = (int64_t)(rnd32() % TRUNK_TOKENS);
        int64_t n = SYS_TOKENS + cut + TAIL_TOKENS;
        es[i].tokens = malloc((size_t)n * sizeof(int32_t));
        es[i].caches = calloc((size_t)layers, sizeof(kvt_cache *));
        if (!es[i].tokens || !es[i].caches) {
            rc = KVT_ENOMEM;
            break;
        }
        memcpy(es[i].tokens, sys, SYS_TOKENS * sizeof(int32_t));
        memcpy(es[i].tokens + SYS_TOKENS, trunk + (size_t)g * TRUNK_TOKENS, (size_t)cut * sizeof(int32_t));
        for (int64_t k = SYS_TOKENS + cut; k < n; k++)
            es[i].tokens[k] = (int32_t)(32000 + rnd32() % 32000); /* distinct tail */
        es[i].n = n;
        total_tokens += n;
        kvt_cache *c[8];
        rc = kvt_caches_clone(trunkc[g], layers, c);
        for (int l = 0; l < layers && rc == 0; l++)
            rc = kvt_cache_trim(c[l], SYS_TOKENS + cut);
        if (rc == 0)
            rc = kvt_bench_util_append(c, layers, kv_dim, TAIL_TOKENS);
        if (rc == 0)
            rc = kvt_caches_clone(c, layers, es[i].caches);
        if (rc == 0)
            rc = put_entry(pc, "", es[i].tokens, n, c, layers);
        else
            kvt_caches_destroy(c, layers);
    }
    if (rc) {
        fprintf(stderr, "kvtier bench lookup: building entries failed: %s (%s)\n", kvt_strerror(rc),
                kvt_last_error());
        return 1;
    }
    kvt_prompt_cache_stats st;
    kvt_prompt_cache_get_stats(pc, &st);
    printf("lookup: %d entries (mean %lld tokens, %d layers, kv_dim %d, blocks of %d), %.1f MB held, built in %.1f s\n",
           n_entries, (long long)(total_tokens / n_entries), layers, kv_dim, block, (double)st.bytes / 1e6,
           (double)(kvt_now_ns() - t_build) / 1e9);

    /* ---- prompts ------------------------------------------------------------------ */
    int32_t **prompts = calloc((size_t)reps, sizeof *prompts);
    uint64_t *t_radix = malloc((size_t)reps * sizeof(uint64_t));
    uint64_t *t_base = malloc((size_t)reps * sizeof(uint64_t));
    int64_t *p_radix = malloc((size_t)reps * sizeof(int64_t));
    if (!prompts || !t_radix || !t_base || !p_radix)
        return 1;
    for (int r = 0; r < reps; r++) {
        prompts[r] = malloc((size_t)prompt_len * sizeof(int32_t));
        if (!prompts[r])
            return 1;
        bl_entry *e = &es[rnd32() % (uint32_t)n_entries];
        int64_t q = SYS_TOKENS / 2 + (int64_t)(rnd32() % (uint32_t)(e->n - SYS_TOKENS / 2 + 1)); /* varied */
        memcpy(prompts[r], e->tokens, (size_t)q * sizeof(int32_t));
        for (int64_t k = q; k < prompt_len; k++)
            prompts[r][k] = (int32_t)(64000 + rnd32() % 1000);
    }
    uint64_t copied0 = kvt_buf_bytes_copied();
    double sum_p = 0;
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = kvt_now_ns();
        kvt_hit h;
        rc = kvt_prompt_cache_lend(pc, prompts[r], prompt_len, "", NULL, &h);
        p_radix[r] = h.prefix_len;
        kvt_hit_clear(&h);
        t_radix[r] = kvt_now_ns() - t0;
        sum_p += (double)p_radix[r];
        if (rc)
            return 1;
    }
    uint64_t copied_radix = kvt_buf_bytes_copied() - copied0;
    int mismatches = 0;
    for (int r = 0; r < base_reps; r++) {
        uint64_t t0 = kvt_now_ns();
        int64_t p = baseline_take(es, n_entries, layers, prompts[r], prompt_len);
        t_base[r] = kvt_now_ns() - t0;
        mismatches += p != p_radix[r];
    }
    double mr = median_us(t_radix, reps), mb = median_us(t_base, base_reps);
    printf("  prompts of %lld tokens, mean reused prefix %.0f tokens\n", (long long)prompt_len, sum_p / reps);
    printf("  per prompt: find the longest cached prefix, lend zero-copy views of it, release them\n");
    printf("  radix index: median %10.1f us   (%d prompts; %llu bytes copied)\n", mr, reps,
           (unsigned long long)copied_radix);
    printf("  linear scan: median %10.1f us   (%d prompts; baseline: every entry compared, the same lending)\n",
           mb, base_reps);
    printf("  speedup %.0fx (goal >= 100x); prefix lengths %s\n", mb / mr,
           mismatches ? "DIFFER from the baseline" : "equal to the baseline's");

    for (int r = 0; r < reps; r++)
        free(prompts[r]);
    free(prompts);
    free(t_radix);
    free(t_base);
    free(p_radix);
    for (int i = 0; i < n_entries; i++) {
        free(es[i].tokens);
        if (es[i].caches)
            kvt_caches_destroy(es[i].caches, layers);
        free(es[i].caches);
    }
    free(es);
    for (int g = 0; g < GROUPS; g++)
        kvt_caches_destroy(trunkc[g], layers);
    kvt_caches_destroy(sysc, layers);
    kvt_prompt_cache_destroy(pc);
    free(sys);
    free(trunk);
    if (mismatches)
        return 1;

    /* ---- 1 MB vs 1 GB entry ---------------------------------------------------------- */
    if (!skip_size) {
        double small_us = 0, big_us = 0;
        uint64_t small_cp = 0, big_cp = 0;
        size_t small_b = 0, big_b = 0;
        if (size_run(4, 201, &small_us, &small_cp, &small_b) || size_run(4096, 201, &big_us, &big_cp, &big_b)) {
            fprintf(stderr, "kvtier bench lookup: the 1 MB / 1 GB run failed: %s\n", kvt_last_error());
            return 1;
        }
        printf("size: lookup + lend + release on one 32768-token entry (hits of 32768 and 30000 tokens "
               "alternate)\n");
        printf("  %8.1f MB entry: median %8.1f us, %llu bytes copied\n", (double)small_b / 1e6, small_us,
               (unsigned long long)small_cp);
        printf("  %8.1f MB entry: median %8.1f us, %llu bytes copied\n", (double)big_b / 1e6, big_us,
               (unsigned long long)big_cp);
        printf("  ratio %.2f (goal within 2x)\n", big_us / small_us);
    }
    return 0;
}
