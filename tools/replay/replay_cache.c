/*
 * replay_cache.c: trace replay through the real RAM prompt cache: every
 * request is taken, extended with synthetic kv state and put back, and the
 * hits are counted the way an engine would see them. It drives the public
 * prompt-cache API only; it must never reach into the cache's internals.
 */
#include "replay.h"

#include "kvtier/prompt_cache.h"
#include "kvtier/experimental/retention_block.h"
#include "kvtier/store.h"

#include "util.h"

#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PRIVATE_SLACK_PER_BLOCK 64 /* bytes: kv caches' own bookkeeping */

static const char *const kvt__cache_names[] = {"lru", "lfu-aged", "lfu-learned", "entry-lru", "entry-slru"};

KVT_API int kvt_replay_cache_policies(const char *const **names)
{
    if (names)
        *names = kvt__cache_names;
    return (int)(sizeof kvt__cache_names / sizeof kvt__cache_names[0]);
}

/* Counts request r's hits for a reused prefix of p tokens (p <= n - 1). */
static void count_prefix(kvt_replay_result *res, const kvt_trace_request *r, int64_t p, int cold)
{
    int64_t n = r->input_length;
    for (int32_t b = 0; b < r->n_blocks; b++) {
        int64_t need = KVT__MIN((int64_t)(b + 1) * KVT_TRACE_BLOCK_TOKENS, n - 1);
        if (p < need || p == 0)
            break;
        res->block_hits++;
        res->prefix_block_hits++;
        if (cold)
            res->ssd_block_hits++;
        else
            res->ram_block_hits++;
    }
    res->blocks += r->n_blocks;
    res->tokens += n;
    res->token_hits += p;
}

/* One request: take, extend, put. */
static int replay_one(kvt_prompt_cache *pc, const kvt_trace_request *r, const int32_t *prompt,
                      int32_t kv_dim, const float *zeros, kvt_replay_result *res)
{
    int64_t n = r->input_length;
    kvt_hit hit;
    int rc = kvt_prompt_cache_lend(pc, prompt, n, "", NULL, &hit);
    if (rc)
        return rc;
    int64_t p = hit.prefix_len;
    count_prefix(res, r, p, hit.source == KVT_HIT_COLD);
    kvt_cache *own = NULL;
    kvt_entry e;
    if (p > 0 && hit.entry.n_caches == 1) {
        e = hit.entry; /* its caches array: put NULLs the slot it adopts */
    } else {
        kvt_hit_clear(&hit);
        if ((rc = kvt_kv_create(kv_dim, KVT_TRACE_BLOCK_TOKENS, &own)))
            return rc;
        e = (kvt_entry){.ns = "", .caches = &own, .n_caches = 1};
        p = 0;
    }
    const void *in[2] = {zeros, zeros};
    rc = kvt_cache_append(e.caches[0], n - p, in);
    if (rc == 0) {
        e.tokens = prompt;
        e.n_tokens = n;
        rc = kvt_prompt_cache_put(pc, &e, NULL);
    }
    if (own)
        kvt_cache_destroy(own); /* NULL when put adopted it */
    else {
        hit.entry.hook = e.hook; /* emptied when put adopted it */
        kvt_hit_clear(&hit);
    }
    return rc;
}

/* ---- the SSD tier ------------------------------------------------------------ */

typedef struct ssd {
    kvt_store *store;
    kvt_cold_tier tier;
    char dir[64];  /* temporary root we created ("" = the caller's) */
} ssd;

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path) ? -1 : 0;
}

static int ssd_open(ssd *d, const kvt_replay_config *cfg, int32_t kv_dim, size_t block_bytes)
{
    const char *root = cfg->ssd_dir;
    if (!root) {
        snprintf(d->dir, sizeof d->dir, "/tmp/kvtier-replay-XXXXXX");
        if (!mkdtemp(d->dir))
            return kvt__fail(-errno, "replay: cannot create a temporary SSD directory: %s", strerror(errno));
        root = d->dir;
    }
    kvt_cache *empty = NULL;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    int rc = kvt_kv_create(kv_dim, KVT_TRACE_BLOCK_TOKENS, &empty);
    if (rc == 0)
        rc = kvt_store_config_fingerprint(&empty, 1, fp);
    kvt_cache_destroy(empty);
    if (rc)
        return rc;
    kvt_store_identity id = {.model_id = "kvtier-replay", .config_fingerprint = fp,
                             .tokenizer_hash = "mooncake-hash-ids"};
    kvt_store_options opts = {.max_bytes = (uint64_t)cfg->ssd_blocks * block_bytes};
    if ((rc = kvt_store_open(root, &id, &opts, &d->store)))
        return rc;
    kvt_store_cold_tier(d->store, &d->tier);
    return 0;
}

static int ssd_close(ssd *d, kvt_replay_result *out)
{
    int rc = 0;
    if (d->store) {
        kvt_store_flush(d->store);
        kvt_store_stats st;
        kvt_store_get_stats(d->store, &st);
        out->bytes_spilled = (int64_t)st.bytes_written;
        out->bytes_restored = (int64_t)st.restore_bytes;
        rc = kvt_store_close(d->store);
        d->store = NULL;
    }
    if (d->dir[0])
        nftw(d->dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}

KVT_API int kvt_replay_cache(const kvt_trace *t, const kvt_replay_config *cfg,
                             kvt_replay_progress_fn progress, void *ctx, kvt_replay_result *out)
{
    if (!t || !cfg || !cfg->policy || !out)
        return kvt__fail(KVT_EINVAL, "replay: NULL argument");
    memset(out, 0, sizeof *out);
    if (cfg->capacity_blocks < 1 || cfg->capacity_blocks > KVT_REPLAY_MAX_BLOCKS ||
        cfg->ssd_blocks < 0 || cfg->ssd_blocks > KVT_REPLAY_MAX_BLOCKS || cfg->bytes_per_token < 8 ||
        cfg->bytes_per_token > KVT_REPLAY_MAX_BYTES_PER_TOKEN || cfg->bytes_per_token % 8)
        return kvt__fail(KVT_EINVAL, "replay: capacity %lld blocks (need 1 to %lld), SSD %lld blocks "
                                     "(need 0 to %lld), %d bytes per token (need a multiple of 8, "
                                     "8 to %d)",
                         (long long)cfg->capacity_blocks, (long long)KVT_REPLAY_MAX_BLOCKS,
                         (long long)cfg->ssd_blocks, (long long)KVT_REPLAY_MAX_BLOCKS,
                         (int)cfg->bytes_per_token, KVT_REPLAY_MAX_BYTES_PER_TOKEN);
    kvt_prompt_cache_config pcfg = {.block_tokens = KVT_TRACE_BLOCK_TOKENS};
    size_t block_bytes = (size_t)KVT_TRACE_BLOCK_TOKENS * (size_t)cfg->bytes_per_token;
    pcfg.max_bytes = (size_t)cfg->capacity_blocks * (block_bytes + PRIVATE_SLACK_PER_BLOCK);
    kvt_block_policy *bp = NULL;
    int rc;
    if (!strncmp(cfg->policy, "entry-", 6)) {
        pcfg.retention = kvt_retention_by_name(cfg->policy + 6);
        if (!pcfg.retention)
            return kvt__fail(KVT_ENOTFOUND, "replay: unknown policy '%s'", cfg->policy);
    } else if ((rc = kvt_block_policy_create(cfg->policy, cfg->capacity_blocks, &bp))) {
        return rc;
    }
    pcfg.block_policy = bp;
    int32_t kv_dim = cfg->bytes_per_token / 8;
    int32_t max_len = 1;
    for (int64_t q = 0; q < t->n_requests; q++)
        max_len = KVT__MAX(max_len, t->requests[q].input_length);
    int32_t *prompt = kvt__malloc((size_t)max_len * sizeof *prompt);
    float *zeros = kvt__calloc((size_t)max_len * (size_t)kv_dim, sizeof *zeros);
    kvt_prompt_cache *pc = NULL;
    ssd d = {0};
    if (!prompt || !zeros) {
        rc = kvt__fail(KVT_ENOMEM, "replay: no memory for a %d-token prompt", (int)max_len);
        goto out;
    }
    if (cfg->ssd_blocks > 0) {
        if ((rc = ssd_open(&d, cfg, kv_dim, block_bytes)))
            goto out;
        pcfg.cold = &d.tier;
    }
    if ((rc = kvt_prompt_cache_create(&pcfg, &pc)))
        goto out;
    uint64_t t0 = kvt_now_ns();
    for (int64_t q = 0; q < t->n_requests; q++) {
        const kvt_trace_request *r = &t->requests[q];
        kvt_trace_prompt(t, r, prompt);
        if ((rc = replay_one(pc, r, prompt, kv_dim, zeros, out)))
            break;
        if (d.store)
            kvt_store_flush(d.store); /* spills land before the next arrival */
        kvt_prompt_cache_stats st;
        kvt_prompt_cache_get_stats(pc, &st);
        out->peak_blocks = KVT__MAX(out->peak_blocks, (int64_t)(st.bytes / block_bytes));
        out->requests = q + 1;
        if (progress && ((q + 1) % 256 == 0 || q + 1 == t->n_requests) &&
            progress(q + 1, t->n_requests, ctx))
            break;
    }
    out->seconds = (double)(kvt_now_ns() - t0) / 1e9;
    kvt_prompt_cache_stats st;
    kvt_prompt_cache_get_stats(pc, &st);
    out->entries_evicted = (int64_t)(st.evictions + st.oversize_drops);
    out->blocks_trimmed = (int64_t)st.blocks_cut;
out:
    kvt_prompt_cache_clear(pc); /* a replay's state is dropped, not handed to the store */
    kvt_prompt_cache_destroy(pc);
    int src = ssd_close(&d, out);
    if (rc == 0 && src)
        rc = kvt__fail(src, "replay: the SSD store reported a failed write (%s)", kvt_strerror(src));
    kvt_block_policy_destroy(bp);
    kvt__free(prompt);
    kvt__free(zeros);
    return rc;
}
