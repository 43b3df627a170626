/*
 * test_residency_store.c: a bounded live cache over a prefix restored from
 * the SSD tier (kvt_store_restore) pages the restored blocks out by
 * reference to their block shards instead of writing them again:
 *  - only the new blocks reach the page file (its size, from its open
 *    descriptor, is the bytes written), the restored ones are counted as
 *    paged by reference, and the logits of the prefill of the new tokens
 *    and of the decode after it are bit-identical to fully resident;
 *  - the referenced blocks are pinned: the budget's eviction of their entry
 *    (a second entry under a budget that holds one), the store's close and
 *    kvt_store_gc leave their files in place while the request runs, and
 *    its decode stays identical; once the request is gone gc removes them;
 *  - the same for the request's own blocks once a snapshot of them was
 *    written to the store (write-behind) and let go;
 *  - a block shard corrupted after the page-out (one flipped byte) fails the
 *    next forward pass with KVT_ECORRUPT naming the SSD-tier copy: an error,
 *    never a wrong token.
 * A small synthetic model made in the test; the prompt is seeded
 * (KVT_TEST_SEED replays).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/cache.h"
#include "kvtier/residency.h"
#include "kvtier/store.h"
#include "model.h"
#include "store_util.h"
#include "test_seed.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { BLOCK = 16, PRE = 160, NEW = 100, GEN = 12, L = 3 };

static char g_dir[256];
static uint64_t g_seed;
static kvt_model *g_model;
static int32_t g_prompt[PRE + NEW], g_other[PRE];
static float *g_ref; /* (1 + GEN, V): fully resident logits after the prompt and each decoded token */

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

static int vocab(void) { return kvt_model_get_config(g_model)->vocab_size; }

/* The logits of the prompt's last token then GEN greedy decodes, from
 * caches already holding the prompt's first `have` tokens. rc of the first
 * failing call (then *at is its step). */
static int finish(kvt_cache **caches, int64_t have, float *out, int *at)
{
    int V = vocab();
    *at = -1;
    int rc = kvt_model_prefill(g_model, caches, g_prompt + have, PRE + NEW - have, out);
    for (int g = 0; rc == 0 && g < GEN; g++)
        if ((rc = kvt_model_decode(g_model, caches, argmax(out + (size_t)g * V, V), out + (size_t)(g + 1) * V)))
            *at = g + 1;
    if (rc && *at < 0)
        *at = 0;
    return rc;
}

/* The open page file's size: the bytes its residency wrote. */
static int64_t page_file_bytes(void)
{
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    int64_t bytes = -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char link[300], target[1024];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(link, target, sizeof target - 1);
        if (k <= 0)
            continue;
        target[k] = '\0';
        struct stat st;
        if (strstr(target, g_dir) && strstr(target, "kvtier-live-") && stat(link, &st) == 0)
            bytes = (int64_t)st.st_size;
    }
    closedir(d);
    return bytes;
}

typedef struct store_run {
    char root[300], dir[700];
    kvt_store *s;
    kvt_entry restored;
} store_run;

static kvt_store *open_store(const char *root, uint64_t max_bytes)
{
    kvt_cache *c[L];
    assert_int_equal(kvt_model_new_caches(g_model, BLOCK, c), 0);
    char fp[KVT_STORE_FINGERPRINT_LEN];
    assert_int_equal(kvt_store_config_fingerprint(c, L, fp), 0);
    kvt_caches_destroy(c, L);
    kvt_store_identity id = {"residency-store-test", fp, "tok"};
    kvt_store_options o = {.max_bytes = max_bytes};
    kvt_store *s = NULL;
    assert_int_equal(kvt_store_open(root, &id, &o, &s), 0);
    return s;
}

/* Prefills tokens[0..n) into fresh caches and puts them in the store. */
static void put_prefix(kvt_store *s, const int32_t *tokens, int64_t n)
{
    kvt_entry e;
    assert_int_equal(kvt_entry_init(&e, "", tokens, n, L, 0), 0);
    assert_int_equal(kvt_model_new_caches(g_model, BLOCK, e.caches), 0);
    assert_int_equal(kvt_model_prefill(g_model, e.caches, tokens, n, NULL), 0);
    assert_int_equal(kvt_store_put(s, &e), 0);
    kvt_entry_clear(&e);
}

/* A store holding the prompt's first PRE tokens, restored as a request
 * would: r->restored's caches hold them (zero-copy from the block shards). */
static void restore_prefix(store_run *r, const char *tag, uint64_t max_bytes)
{
    snprintf(r->root, sizeof r->root, "%s/%s", g_dir, tag);
    r->s = open_store(r->root, max_bytes);
    snprintf(r->dir, sizeof r->dir, "%s", kvt_store_dir(r->s));
    put_prefix(r->s, g_prompt, PRE);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find(r->s, g_prompt, PRE + NEW, "", &hit), 0);
    assert_int_equal(hit.prefix_len, PRE);
    assert_int_equal(kvt_store_restore(r->s, hit.handle, g_prompt, PRE + NEW, &r->restored), 0);
    assert_int_equal(kvt_cache_offset(r->restored.caches[0]), PRE);
}

static kvt_residency *bounded(kvt_cache **caches)
{
    kvt_residency_options o = {.max_blocks = 1, .dir = g_dir}; /* one block over 3 layers: 0 each */
    kvt_residency *r = NULL;
    assert_int_equal(kvt_residency_create(&o, &r), 0);
    for (int l = 0; l < L; l++)
        assert_int_equal(kvt_kv_set_residency(caches[l], r, l), 0);
    return r;
}

#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1 /* CMake: 10 under TSan, 3 under ASan, else 1 */
#endif

static void settle(kvt_cache **caches, kvt_residency *r, kvt_residency_stats *st)
{
    for (int l = 0; l < L; l++)
        assert_int_equal(kvt_kv_residency_settle(caches[l]), 0);
    assert_int_equal(kvt_residency_stats_get(r, st), 0);
}

static size_t block_bytes(void) { return kvt_model_kv_bytes_per_token(g_model) / L * BLOCK; }

/* ---- only the new blocks are written --------------------------------------------------------- */

static void test_restored_prefix_not_rewritten(void **state)
{
    (void)state;
    int V = vocab(), at;
    store_run r;
    restore_prefix(&r, "rewrite", 0);
    kvt_residency *res = bounded(r.restored.caches); /* pages the restored blocks out at once */
    kvt_residency_stats st;
    settle(r.restored.caches, res, &st);
    printf("after attach: by reference %llu blocks (%llu B), written %llu\n", (unsigned long long)st.blocks_ref,
           (unsigned long long)st.bytes_ref, (unsigned long long)st.blocks_out);
    float *out = calloc((size_t)(GEN + 1) * V, sizeof(float));
    assert_non_null(out);
    assert_int_equal(finish(r.restored.caches, PRE, out, &at), 0);
    settle(r.restored.caches, res, &st);
    int64_t restored_full = L * (PRE / BLOCK), all_full = L * ((PRE + NEW + GEN) / BLOCK); /* GEN decodes: GEN tokens appended */
    int64_t file = page_file_bytes();
    printf("by reference %llu blocks, written %llu blocks (%llu B; page file %lld B), paged in %llu, "
           "read failures %llu\n", (unsigned long long)st.blocks_ref, (unsigned long long)st.blocks_out,
           (unsigned long long)st.bytes_out, (long long)file, (unsigned long long)st.blocks_in,
           (unsigned long long)st.read_failures);
    assert_memory_equal(out, g_ref, (size_t)(GEN + 1) * V * sizeof(float)); /* bit for bit */
    assert_int_equal(st.blocks_ref, restored_full);
    assert_int_equal(st.bytes_ref, (uint64_t)restored_full * block_bytes());
    assert_int_equal(st.blocks_out, all_full - restored_full); /* only the new blocks */
    assert_int_equal(st.bytes_out, (uint64_t)(all_full - restored_full) * block_bytes());
    assert_int_equal(file, (int64_t)st.bytes_out);
    assert_true(st.blocks_in > 0);
    assert_int_equal(st.read_failures, 0);
    kvt_entry_clear(&r.restored);
    kvt_residency_release(res);
    assert_int_equal(kvt_store_close(r.s), 0);
    free(out);
}

/* ---- pinned against the budget and gc --------------------------------------------------------- */

static void test_pinned_against_budget_and_gc(void **state)
{
    (void)state;
    int V = vocab(), at;
    /* one entry's files: the budget below holds one entry, not two */
    store_run probe;
    snprintf(probe.root, sizeof probe.root, "%s/probe", g_dir);
    kvt_store *ps = open_store(probe.root, 0);
    put_prefix(ps, g_prompt, PRE);
    kvt_store_stats pst;
    kvt_store_get_stats(ps, &pst);
    assert_int_equal(kvt_store_close(ps), 0);
    uint64_t one = pst.bytes;
    store_run r;
    restore_prefix(&r, "pinned", one + one / 2);
    assert_int_equal(store_count_files(r.dir, "b"), PRE / BLOCK);
    char names[PRE / BLOCK][64];
    DIR *d = opendir(r.dir);
    assert_non_null(d);
    int nn = 0;
    for (struct dirent *de; (de = readdir(d)) != NULL;)
        if (de->d_name[0] == 'b' && nn < PRE / BLOCK)
            snprintf(names[nn++], sizeof names[0], "%.63s", de->d_name);
    closedir(d);
    assert_int_equal(nn, PRE / BLOCK);
    kvt_residency *res = bounded(r.restored.caches);
    float *out = calloc((size_t)(GEN + 1) * V, sizeof(float));
    assert_non_null(out);
    /* the request's prompt, then the budget evicts its restored entry for another one */
    assert_int_equal(kvt_model_prefill(g_model, r.restored.caches, g_prompt + PRE, NEW, out), 0);
    put_prefix(r.s, g_other, PRE);
    assert_int_equal(kvt_store_close(r.s), 0); /* the budget's last word: waits for the lock */
    kvt_store *again = open_store(r.root, one + one / 2);
    kvt_cold_hit hit;
    int found = kvt_store_find(again, g_prompt, PRE + NEW, "", &hit);
    kvt_store_stats st2;
    kvt_store_get_stats(again, &st2);
    assert_int_equal(kvt_store_close(again), 0);
    uint64_t freed = 0;
    assert_int_equal(kvt_store_gc(r.root, 0, &freed), 0); /* the directory is held while pins remain */
    int left = store_count_files(r.dir, "b"), kept = 0;
    for (int i = 0; i < nn; i++) {
        char path[800];
        snprintf(path, sizeof path, "%.700s/%.63s", r.dir, names[i]);
        kept += access(path, F_OK) == 0;
    }
    printf("budget %llu B (one entry %llu B): the request's entry found %d, entries %llu; block files %d, %d of "
           "them the request's %d pinned ones; gc freed %llu B\n", (unsigned long long)(one + one / 2),
           (unsigned long long)one, found, (unsigned long long)st2.entries, left, kept, nn,
           (unsigned long long)freed);
    /* the pinned blocks count against the budget: both entries went, the pinned blocks stayed */
    assert_int_equal(found, KVT_ENOTFOUND);
    assert_int_equal(kept, nn);
    assert_int_equal(left, nn);
    /* the request goes on: its paged blocks read back from the pinned files */
    for (int g = 0; g < GEN; g++)
        assert_int_equal(
            kvt_model_decode(g_model, r.restored.caches, argmax(out + (size_t)g * V, V), out + (size_t)(g + 1) * V), 0);
    assert_memory_equal(out, g_ref, (size_t)(GEN + 1) * V * sizeof(float));
    kvt_residency_stats st;
    settle(r.restored.caches, res, &st);
    assert_int_equal(st.blocks_ref, L * (PRE / BLOCK));
    assert_int_equal(st.read_failures, 0);
    kvt_entry_clear(&r.restored); /* the pins go with the request */
    kvt_residency_release(res);
    /* a read-ahead the decode started may still be running on the page-in worker: its task
     * holds its page, and so the pin, until the worker lets it go; gc frees the directory once
     * the last pin is gone (polled, bounded: 10 s times the build's slowness) */
    int files = -1;
    for (int tries = 0; tries < 1000 * KVT_TEST_TIME_SCALE; tries++) {
        assert_int_equal(kvt_store_gc(r.root, 0, &freed), 0);
        if ((files = store_count_files(r.dir, "b")) == 0)
            break;
        usleep(10 * 1000);
    }
    printf("after the request: gc freed %llu B, block files %d\n", (unsigned long long)freed, files);
    assert_int_equal(files, 0);
    (void)at;
    free(out);
}

/* ---- blocks the request wrote behind ---------------------------------------------------------- */

/* The request's own prefix, published (a snapshot sharing its blocks) and
 * written to the store: once the snapshot is gone the request holds the
 * blocks alone, and they are paged out by reference to the shards the put
 * wrote from these very buffers, not written again. */
static void test_written_behind_not_rewritten(void **state)
{
    (void)state;
    int V = vocab(), at;
    char root[300];
    snprintf(root, sizeof root, "%s/behind", g_dir);
    kvt_store *s = open_store(root, 0);
    kvt_cache *c[L];
    assert_int_equal(kvt_model_new_caches(g_model, BLOCK, c), 0);
    assert_int_equal(kvt_model_prefill(g_model, c, g_prompt, PRE, NULL), 0);
    kvt_entry snap;
    assert_int_equal(kvt_entry_init(&snap, "", g_prompt, PRE, L, 0), 0);
    for (int l = 0; l < L; l++)
        assert_int_equal(kvt_cache_clone(c[l], &snap.caches[l]), 0);
    assert_int_equal(kvt_store_put(s, &snap), 0);
    kvt_entry_clear(&snap);
    kvt_residency *res = bounded(c);
    float *out = calloc((size_t)(GEN + 1) * V, sizeof(float));
    assert_non_null(out);
    assert_int_equal(finish(c, PRE, out, &at), 0);
    kvt_residency_stats st;
    settle(c, res, &st);
    int64_t stored = L * (PRE / BLOCK), all_full = L * ((PRE + NEW + GEN) / BLOCK);
    printf("written behind: by reference %llu blocks, written %llu (page file %lld B)\n",
           (unsigned long long)st.blocks_ref, (unsigned long long)st.blocks_out, (long long)page_file_bytes());
    assert_memory_equal(out, g_ref, (size_t)(GEN + 1) * V * sizeof(float));
    assert_int_equal(st.blocks_ref, stored);
    assert_int_equal(st.blocks_out, all_full - stored);
    assert_int_equal(page_file_bytes(), (int64_t)st.bytes_out);
    assert_int_equal(st.read_failures, 0);
    kvt_caches_destroy(c, L);
    kvt_residency_release(res);
    assert_int_equal(kvt_store_close(s), 0);
    free(out);
}

/* Another computation of the same prefix: an entry of the prompt's first
 * PRE + 32 tokens is in the store (computed as PRE, then 32 more) when a
 * request that computed the first PRE tokens itself puts its snapshot: the
 * put finds its 10 chain blocks there already and writes none of them; when
 * the stored payloads hold exactly the request's bytes (the XXH3-128 of its
 * buffers against each shard's header) its blocks get their origin all the
 * same, so the request pages them out by reference. When the stored entry
 * was computed by other weights of the same shape (same keys, other bytes)
 * the check fails: nothing by reference, every block written to the page
 * file, logits still identical (referring to them would fail the request
 * with KVT_ECORRUPT at its first page-in). */
static void test_same_prefix_computed_twice(void **state)
{
    (void)state;
    int V = vocab(), at;
    kvt_model *other = NULL; /* the same shape and store fingerprint, other weights */
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 32, p.hidden_dim = 64, p.n_layers = L, p.n_heads = 4, p.n_kv_heads = 2, p.vocab_size = 97;
    p.seq_len = 1024, p.seed = 80;
    char mpath[400];
    snprintf(mpath, sizeof mpath, "%s/other.bin", g_dir);
    assert_int_equal(kvt_model_synth(&p, mpath), 0);
    assert_int_equal(kvt_model_load(mpath, &other), 0);
    for (int k = 0; k < 2; k++) {
        kvt_model *am = k ? other : g_model;
        char root[300];
        snprintf(root, sizeof root, "%s/twice%d", g_dir, k);
        kvt_store *s = open_store(root, 0);
        kvt_entry a;
        assert_int_equal(kvt_entry_init(&a, "", g_prompt, PRE + 32, L, 0), 0);
        assert_int_equal(kvt_model_new_caches(am, BLOCK, a.caches), 0);
        assert_int_equal(kvt_model_prefill(am, a.caches, g_prompt, PRE, NULL), 0);
        assert_int_equal(kvt_model_prefill(am, a.caches, g_prompt + PRE, 32, NULL), 0);
        assert_int_equal(kvt_store_put(s, &a), 0);
        kvt_entry_clear(&a);
        kvt_cache *c[L];
        assert_int_equal(kvt_model_new_caches(g_model, BLOCK, c), 0);
        assert_int_equal(kvt_model_prefill(g_model, c, g_prompt, PRE, NULL), 0);
        kvt_entry snap;
        assert_int_equal(kvt_entry_init(&snap, "", g_prompt, PRE, L, 0), 0);
        for (int l = 0; l < L; l++)
            assert_int_equal(kvt_cache_clone(c[l], &snap.caches[l]), 0);
        assert_int_equal(kvt_store_put(s, &snap), 0);
        kvt_entry_clear(&snap);
        kvt_residency *res = bounded(c);
        float *out = calloc((size_t)(GEN + 1) * V, sizeof(float));
        assert_non_null(out);
        int rc = finish(c, PRE, out, &at);
        if (rc)
            printf("failed at step %d: %s\n", at, kvt_last_error());
        assert_int_equal(rc, 0);
        kvt_residency_stats st;
        settle(c, res, &st);
        int64_t stored = L * (PRE / BLOCK), all_full = L * ((PRE + NEW + GEN) / BLOCK);
        printf("same prefix computed twice%s: by reference %llu blocks, written %llu\n",
               k ? " (stored by other weights)" : "", (unsigned long long)st.blocks_ref,
               (unsigned long long)st.blocks_out);
        assert_memory_equal(out, g_ref, (size_t)(GEN + 1) * V * sizeof(float));
        assert_int_equal(st.blocks_ref, k ? 0 : stored);
        assert_int_equal(st.blocks_out, k ? all_full : all_full - stored);
        assert_int_equal(st.read_failures, 0);
        kvt_caches_destroy(c, L);
        kvt_residency_release(res);
        assert_int_equal(kvt_store_close(s), 0);
        free(out);
    }
    kvt_model_free(other);
}

/* ---- a corrupted block shard ------------------------------------------------------------------ */

static void test_corrupt_block_refused(void **state)
{
    (void)state;
    int V = vocab(), at;
    store_run r;
    restore_prefix(&r, "corrupt", 0);
    kvt_residency *res = bounded(r.restored.caches);
    kvt_residency_stats st;
    settle(r.restored.caches, res, &st);
    assert_int_equal(st.blocks_ref, L * (PRE / BLOCK));
    /* every restored block is paged out by reference: flip the last byte of a block shard (a V row) */
    char name[256], path[1100];
    assert_int_equal(store_first_file(r.dir, "b", name, sizeof name), 0);
    snprintf(path, sizeof path, "%s/%s", r.dir, name);
    assert_int_equal(store_flip_byte(path, 1, 0x40), 0);
    float *out = calloc((size_t)(GEN + 1) * V, sizeof(float));
    assert_non_null(out);
    int rc = finish(r.restored.caches, PRE, out, &at);
    settle(r.restored.caches, res, &st);
    printf("corrupted %s: rc %d at step %d (%s); read failures %llu\n", name, rc, at, kvt_last_error(),
           (unsigned long long)st.read_failures);
    assert_int_equal(rc, KVT_ECORRUPT);
    assert_int_equal(at, 0); /* the prefill of the new tokens reads every block: no logits came out */
    assert_non_null(strstr(kvt_last_error(), "SSD-tier copy"));
    assert_true(st.read_failures > 0);
    kvt_entry_clear(&r.restored);
    kvt_residency_release(res);
    assert_int_equal(kvt_store_close(r.s), 0);
    free(out);
}

static int setup(void **state)
{
    (void)state;
    g_seed = test_seed("test_residency_store");
    store_tmpdir(g_dir, sizeof g_dir, "kvt_res_store");
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 32, p.hidden_dim = 64, p.n_layers = L, p.n_heads = 4, p.n_kv_heads = 2, p.vocab_size = 97;
    p.seq_len = 1024, p.seed = 79;
    char path[400];
    snprintf(path, sizeof path, "%s/model.bin", g_dir);
    if (kvt_model_synth(&p, path) || kvt_model_load(path, &g_model))
        return -1;
    uint64_t s = g_seed | 1;
    for (int i = 0; i < PRE + NEW; i++)
        g_prompt[i] = (int32_t)(rnd(&s) % (uint64_t)p.vocab_size);
    for (int i = 0; i < PRE; i++)
        g_other[i] = (int32_t)(rnd(&s) % (uint64_t)p.vocab_size);
    g_ref = calloc((size_t)(GEN + 1) * p.vocab_size, sizeof(float));
    kvt_cache *c[L];
    int at;
    if (!g_ref || kvt_model_new_caches(g_model, BLOCK, c))
        return -1;
    /* the prefix as the stored entry was made, then the rest as the restored request runs it */
    int rc = kvt_model_prefill(g_model, c, g_prompt, PRE, NULL);
    if (rc == 0)
        rc = finish(c, PRE, g_ref, &at);
    kvt_caches_destroy(c, L);
    return rc ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    kvt_model_free(g_model);
    free(g_ref);
    store_rmtree(g_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_restored_prefix_not_rewritten),
        cmocka_unit_test(test_pinned_against_budget_and_gc),
        cmocka_unit_test(test_written_behind_not_rewritten),
        cmocka_unit_test(test_same_prefix_computed_twice),
        cmocka_unit_test(test_corrupt_block_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
