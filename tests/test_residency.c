/*
 * test_residency.c: bounded live-cache residency (kvtier/residency.h):
 *  - the block state machine: exactly the documented edges exist, every
 *    other (state, event) pair is refused and leaves the state alone;
 *  - a kv cache under a block bound: the oldest full blocks are written once
 *    and their RAM released, the newest stay, the tail is never paged; a pin
 *    reads them back bit for bit, an unpin releases them without rewriting;
 *    blocks shared with a clone stay shared (never paged); clones and encode
 *    read paged blocks; a trim into a paged block makes it the RAM tail;
 *  - attention through a window: two passes over the blocks stage at most
 *    the window, read ahead in the walk's order, blocks read back exact;
 *  - the engine: greedy decode and its logits under a bound of 1 block, and
 *    a byte bound, are bit-identical to fully resident, for prefill, decode
 *    and batched decode (and with 32 heads walked in groups), with
 *    read-ahead counted and no more than the window staged; prompt rows of a
 *    batched pass walk the window once per chunk, not once per row;
 *  - qkvc caches (f16, bf16, q8: sealed blocks, an f32 open block): their
 *    sealed blocks are paged under a strict bound and read back equal to an
 *    unbounded twin's; the engine's logits are bit-identical bounded vs
 *    resident, each attended sealed byte paged in once per decode step;
 *    through the service, a bounded reply equals the resident one; faults
 *    (ENOSPC, EIO, a corrupted page) behave as for kv;
 *  - faults through the io shim: ENOSPC on page writes keeps the blocks in
 *    RAM (counted, output unchanged); EIO on page reads fails the forward
 *    pass with KVT_EIO naming the block; a corrupted page file fails it with
 *    KVT_ECORRUPT: never a wrong token.
 * Randomized values print their seed (KVT_TEST_SEED replays).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "io_shim.h"
#include "kvtier/cache.h"
#include "kvtier/io.h"
#include "kvtier/residency.h"
#include "chat.h"
#include "model.h"
#include "sampler.h"
#include "seq.h"
#include "store_util.h"
#include "test_rng.h"
#include "test_seed.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[256];
static uint64_t g_seed;

/* ---- the state machine ------------------------------------------------------------- */

static void test_state_machine(void **state)
{
    (void)state;
    /* the edges docs/residency.md lists, and no other */
    static const int next[KVT_BLOCK_STATES][KVT_BLOCK_EVENTS] = {
        [KVT_BLOCK_RESIDENT] = {KVT_BLOCK_WRITING, -1, -1, -1, -1, -1, -1},
        [KVT_BLOCK_WRITING] = {-1, KVT_BLOCK_DURABLE_RESIDENT, KVT_BLOCK_FAILED, -1, -1, -1, -1},
        [KVT_BLOCK_DURABLE_RESIDENT] = {-1, -1, -1, KVT_BLOCK_DURABLE, -1, -1, -1},
        [KVT_BLOCK_DURABLE] = {-1, -1, -1, -1, KVT_BLOCK_RESTORING, -1, -1},
        [KVT_BLOCK_RESTORING] = {-1, -1, -1, -1, -1, KVT_BLOCK_DURABLE_RESIDENT, KVT_BLOCK_DURABLE},
        [KVT_BLOCK_FAILED] = {-1, -1, -1, -1, -1, -1, -1},
    };
    int edges = 0;
    for (int s = 0; s < KVT_BLOCK_STATES; s++) {
        assert_non_null(kvt_block_state_name((kvt_block_state)s));
        for (int e = 0; e < KVT_BLOCK_EVENTS; e++) {
            kvt_block_state st = (kvt_block_state)s;
            int rc = kvt_block_transition(&st, (kvt_block_event)e);
            if (next[s][e] < 0) {
                assert_int_equal(rc, KVT_EINVAL);
                assert_int_equal(st, s);
            } else {
                assert_int_equal(rc, 0);
                assert_int_equal(st, next[s][e]);
                edges++;
            }
        }
    }
    assert_int_equal(edges, 7);
    assert_null(kvt_block_state_name(KVT_BLOCK_STATES));
    kvt_block_state st = KVT_BLOCK_STATES;
    assert_int_equal(kvt_block_transition(&st, KVT_BLOCK_EV_WRITE), KVT_EINVAL);
    assert_int_equal(kvt_block_transition(NULL, KVT_BLOCK_EV_WRITE), KVT_EINVAL);
}

/* ---- a kv cache under a bound ---------------------------------------------------------- */

enum { D = 8, B = 4 };

static kvt_residency *residency(int64_t max_blocks, uint64_t max_bytes)
{
    kvt_residency_options o = {.max_blocks = max_blocks, .max_bytes = max_bytes, .dir = g_dir};
    kvt_residency *r = NULL;
    assert_int_equal(kvt_residency_create(&o, &r), 0);
    assert_non_null(r);
    return r;
}

/* Appends n tokens of seeded values (also written to ref: (n, 2, D)). */
static void append_rows(kvt_cache *c, int n, uint64_t *s, float *ref)
{
    for (int t = 0; t < n; t++) {
        float k[D], v[D];
        for (int j = 0; j < D; j++) {
            k[j] = rng_sym(s);
            v[j] = rng_sym(s);
        }
        if (ref) {
            memcpy(ref + (size_t)t * 2 * D, k, sizeof k);
            memcpy(ref + (size_t)t * 2 * D + D, v, sizeof v);
        }
        const void *in[2] = {k, v};
        assert_int_equal(kvt_cache_append(c, 1, in), 0);
    }
}

/* Every row of tokens [0, n) of c equals ref (c pinned). */
static void check_rows(kvt_cache *c, int n, const float *ref)
{
    assert_int_equal(kvt_kv_pin(c, n), 0);
    for (int t = 0; t < n; t++) {
        kvt_kv_rows rows;
        assert_int_equal(kvt_kv_block_rows(c, t / B, &rows), 0);
        const float *k = (const float *)rows.k + (size_t)(t % B) * D, *v = (const float *)rows.v + (size_t)(t % B) * D;
        assert_memory_equal(k, ref + (size_t)t * 2 * D, D * sizeof(float));
        assert_memory_equal(v, ref + (size_t)t * 2 * D + D, D * sizeof(float));
    }
    kvt_kv_unpin(c);
}

static kvt_block_state state_of(kvt_cache *c, int64_t i)
{
    kvt_block_state s = KVT_BLOCK_STATES;
    assert_int_equal(kvt_kv_block_state(c, i, &s), 0);
    return s;
}

static void test_kv_paging(void **state)
{
    (void)state;
    uint64_t s = g_seed;
    const size_t bb = 2 * B * D * sizeof(float);
    kvt_residency *r = residency(2, 0);
    kvt_cache *c = NULL;
    assert_int_equal(kvt_kv_create(D, B, &c), 0);
    assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
    float ref[42 * 2 * D];
    append_rows(c, 42, &s, ref); /* 10 full blocks and a tail of 2 */
    assert_int_equal(kvt_kv_residency_settle(c), 0);
    for (int i = 0; i < 8; i++)
        assert_int_equal(state_of(c, i), KVT_BLOCK_DURABLE);
    assert_int_equal(state_of(c, 8), KVT_BLOCK_RESIDENT);
    assert_int_equal(state_of(c, 9), KVT_BLOCK_RESIDENT);
    assert_int_equal(state_of(c, 10), KVT_BLOCK_RESIDENT); /* the tail */
    kvt_residency_stats st;
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    assert_int_equal(st.blocks_out, 8);
    assert_int_equal(st.bytes_out, 8 * bb);
    assert_int_equal(st.resident_blocks, 2);
    assert_int_equal(st.resident_bytes, 2 * bb);
    assert_true(st.peak_resident_bytes <= (2 + 4 + 1) * bb); /* the bound plus the writes allowed in flight */
    /* two full blocks and the tail in RAM, plus the block table (< 1 KiB) */
    assert_in_range(kvt_cache_bytes(c), 3 * bb, 3 * bb + 1023);
    kvt_kv_rows rows;
    assert_int_equal(kvt_kv_block_rows(c, 0, &rows), KVT_EINVAL); /* paged out: pin first */
    assert_non_null(strstr(kvt_last_error(), "paged out"));

    check_rows(c, 42, ref);
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    assert_int_equal(st.blocks_in, 8);
    assert_int_equal(st.bytes_in, 8 * bb);
    assert_int_equal(st.staged_bytes, 0);
    assert_int_equal(st.peak_staged_bytes, 8 * bb);
    for (int i = 0; i < 8; i++)
        assert_int_equal(state_of(c, i), KVT_BLOCK_DURABLE);
    /* a second pass reads again and writes nothing: written once */
    check_rows(c, 42, ref);
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    assert_int_equal(st.blocks_out, 8);
    assert_int_equal(st.blocks_in, 16);

    /* a clone shares the pages; encode reads them; the clone outlives the original */
    kvt_cache *k2 = NULL;
    assert_int_equal(kvt_cache_clone(c, &k2), 0);
    assert_int_equal(state_of(k2, 0), KVT_BLOCK_DURABLE);
    kvt_cache_state enc;
    memset(&enc, 0, sizeof enc);
    assert_int_equal(kvt_cache_encode(k2, &enc), 0);
    assert_int_equal(enc.n_tensors, 11);
    for (int i = 0; i < 10; i++) {
        const float *p = enc.tensors[i].data;
        for (int t = 0; t < B; t++) {
            assert_memory_equal(p + (size_t)t * D, ref + (size_t)(i * B + t) * 2 * D, D * sizeof(float));
            assert_memory_equal(p + (size_t)(B + t) * D, ref + (size_t)(i * B + t) * 2 * D + D, D * sizeof(float));
        }
    }
    kvt_cache_state_clear(&enc);
    kvt_cache_destroy(c);
    kvt_residency_release(r); /* the clone's pages keep the page file */
    check_rows(k2, 42, ref);

    /* a trim into a paged block makes it the private RAM tail; appends go on */
    assert_int_equal(kvt_cache_trim(k2, 6), 0);
    assert_int_equal(state_of(k2, 1), KVT_BLOCK_RESIDENT);
    float ref2[12 * 2 * D];
    memcpy(ref2, ref, 6 * 2 * D * sizeof(float));
    append_rows(k2, 6, &s, ref2 + 6 * 2 * D);
    check_rows(k2, 12, ref2);
    kvt_cache_destroy(k2);
}

/* The strict bound (write_slack < 0): after every append at most the share
 * of full private blocks is in RAM, with no settle, whatever the speed of
 * the writes; every block past it is already durable, so reading the
 * context pages each of them in. */
static void test_strict_bound(void **state)
{
    (void)state;
    uint64_t s = g_seed ^ 0x5157;
    const size_t bb = 2 * B * D * sizeof(float);
    kvt_residency_options o = {.max_blocks = 2, .dir = g_dir, .write_slack = -1};
    kvt_residency *r = NULL;
    assert_int_equal(kvt_residency_create(&o, &r), 0);
    kvt_cache *c = NULL;
    assert_int_equal(kvt_kv_create(D, B, &c), 0);
    assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
    float ref[42 * 2 * D];
    kvt_residency_stats st;
    for (int t = 0; t < 42; t++) {
        append_rows(c, 1, &s, ref + (size_t)t * 2 * D);
        assert_int_equal(kvt_residency_stats_get(r, &st), 0);
        int full = (t + 1) / B;
        assert_int_equal(st.resident_blocks, full < 2 ? full : 2);
        assert_true(st.peak_resident_bytes <= 2 * bb);
        assert_int_equal(st.blocks_out, full > 2 ? full - 2 : 0); /* written before the append returned */
        for (int i = 0; i + 2 < full; i++)
            assert_int_equal(state_of(c, i), KVT_BLOCK_DURABLE);
    }
    check_rows(c, 42, ref);
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    assert_int_equal(st.blocks_in, 8);
    assert_int_equal(st.write_failures, 0);
    kvt_cache_destroy(c);
    kvt_residency_release(r);
}

/* Attention through a window: two passes over the blocks (K, then V) hold
 * at most the window's blocks staged, read ahead in the walk's order, and
 * every block taken is the one written. */
static void test_window_walk(void **state)
{
    (void)state;
    uint64_t s = g_seed ^ 7;
    const size_t bb = 2 * B * D * sizeof(float);
    kvt_residency_options o = {.max_blocks = 2, .dir = g_dir, .window = 4};
    kvt_residency *r = NULL;
    assert_int_equal(kvt_residency_create(&o, &r), 0);
    kvt_cache *c = NULL, *plain = NULL;
    assert_int_equal(kvt_kv_create(D, B, &c), 0);
    assert_int_equal(kvt_kv_create(D, B, &plain), 0);
    assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
    float ref[42 * 2 * D], ref2[42 * 2 * D];
    append_rows(c, 42, &s, ref); /* 8 of the 10 full blocks paged out, 2 in RAM, a tail of 2 */
    append_rows(plain, 42, &s, ref2);
    assert_int_equal(kvt_kv_residency_settle(c), 0);
    assert_int_equal(kvt_kv_window_open(plain, 42, 2), 0); /* nothing paged: no window */
    kvt_kv_rows rows;
    assert_int_equal(kvt_kv_window_get(plain, 0, &rows), KVT_EINVAL); /* none open */
    assert_int_equal(kvt_kv_window_open(c, 43, 2), KVT_ERANGE);
    assert_int_equal(kvt_kv_window_open(c, 42, 0), KVT_EINVAL);
    assert_int_equal(kvt_kv_window_open(c, 42, 2), 4);
    assert_int_equal(kvt_kv_window_open(c, 42, 2), KVT_EINVAL); /* one at a time */
    kvt_residency_stats st;
    for (int pass = 0; pass < 2; pass++)
        for (int b = 0; b < 11; b++) {
            if (b == 3)
                assert_int_equal(kvt_kv_window_get(c, 5, &rows), KVT_EINVAL); /* out of order */
            assert_int_equal(kvt_kv_window_get(c, b, &rows), 0);
            for (int t = 0; t < rows.n; t++) {
                const float *k = (const float *)rows.k + (size_t)t * D, *v = (const float *)rows.v + (size_t)t * D;
                assert_memory_equal(k, ref + (size_t)(b * B + t) * 2 * D, D * sizeof(float));
                assert_memory_equal(v, ref + (size_t)(b * B + t) * 2 * D + D, D * sizeof(float));
            }
            assert_int_equal(kvt_residency_stats_get(r, &st), 0);
            assert_true(st.staged_bytes <= 4 * bb);
            kvt_kv_window_put(c, b);
        }
    assert_int_equal(kvt_kv_window_get(c, 0, &rows), KVT_EINVAL); /* the walk is over */
    kvt_kv_window_close(c);
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    printf("window 4 over 8 paged blocks, 2 passes: in %llu blocks, read-ahead hits %llu, peak staged %llu B\n",
           (unsigned long long)st.blocks_in, (unsigned long long)st.readahead_hits,
           (unsigned long long)st.peak_staged_bytes);
    assert_true(st.peak_staged_bytes <= 4 * bb); /* a pin would stage all 8 */
    assert_true(st.blocks_in >= 16);             /* each pass reads them: 8 blocks do not fit in 4 */
    assert_true(st.readahead_hits >= 12);
    assert_int_equal(st.read_failures, 0);
    for (int i = 0; i < 8; i++) /* nothing was rewritten: still durable (or read ahead for the next walk) */
        assert_true(state_of(c, i) == KVT_BLOCK_DURABLE || state_of(c, i) == KVT_BLOCK_RESTORING);
    assert_int_equal(st.blocks_out, 8);
    check_rows(c, 42, ref); /* a pin after the walk takes what was read ahead */
    kvt_cache_destroy(c);
    kvt_cache_destroy(plain);
    kvt_residency_release(r);
}

/* A window whose passes alternate K and V (kvt_kv_window_open_halves):
 * with more paged blocks than the window, each pass reads only the half it
 * uses (the other half's pointer NULL), so the K-then-V walk reads each
 * paged byte once; with all of them fitting the window, whole blocks are
 * read once and held from the K pass for the V pass. A pin afterwards
 * completes the halves read ahead for the next walk. */
static void test_window_halves(void **state)
{
    (void)state;
    const size_t bb = 2 * B * D * sizeof(float);
    const int32_t windows[2] = {4, 16};
    for (int w = 0; w < 2; w++) {
        uint64_t s = g_seed ^ 0x4a1f;
        kvt_residency_options o = {.max_blocks = 2, .dir = g_dir, .window = windows[w]};
        kvt_residency *r = NULL;
        assert_int_equal(kvt_residency_create(&o, &r), 0);
        kvt_cache *c = NULL;
        assert_int_equal(kvt_kv_create(D, B, &c), 0);
        assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
        float ref[42 * 2 * D];
        append_rows(c, 42, &s, ref); /* 8 of the 10 full blocks paged out */
        assert_int_equal(kvt_kv_residency_settle(c), 0);
        assert_int_equal(kvt_kv_window_open_halves(c, 42, 2), windows[w]);
        int split = w == 0;
        kvt_kv_rows rows;
        for (int pass = 0; pass < 2; pass++)
            for (int b = 0; b < 11; b++) {
                assert_int_equal(kvt_kv_window_get(c, b, &rows), 0);
                int paged = b < 8;
                if (split && paged) /* only the half this pass uses */
                    assert_true(pass == 0 ? rows.v == NULL && rows.k != NULL : rows.k == NULL && rows.v != NULL);
                else
                    assert_true(rows.k != NULL && rows.v != NULL);
                for (int t = 0; t < rows.n; t++) {
                    const float *want = ref + (size_t)(b * B + t) * 2 * D;
                    if (rows.k)
                        assert_memory_equal((const float *)rows.k + (size_t)t * D, want, D * sizeof(float));
                    if (rows.v)
                        assert_memory_equal((const float *)rows.v + (size_t)t * D, want + D, D * sizeof(float));
                }
                kvt_kv_window_put(c, b);
            }
        kvt_residency_stats st;
        assert_int_equal(kvt_residency_stats_get(r, &st), 0); /* before the close's read-ahead */
        printf("window %d over 8 paged blocks, K then V: %llu page-ins, %llu B (the paged blocks: %zu B), peak "
               "staged %llu B\n", (int)windows[w], (unsigned long long)st.blocks_in,
               (unsigned long long)st.bytes_in, 8 * bb, (unsigned long long)st.peak_staged_bytes);
        assert_int_equal(st.bytes_in, 8 * bb);         /* each paged byte once */
        assert_int_equal(st.blocks_in, split ? 16 : 8); /* halves, or whole blocks held for the V pass */
        assert_true(st.peak_staged_bytes <= (uint64_t)windows[w] * bb);
        assert_int_equal(st.read_failures, 0);
        kvt_kv_window_close(c);
        check_rows(c, 42, ref);
        kvt_cache_destroy(c);
        kvt_residency_release(r);
    }
}

static void test_shared_blocks_stay(void **state)
{
    (void)state;
    uint64_t s = g_seed ^ 1;
    kvt_residency *r = residency(1, 0);
    kvt_cache *c = NULL, *snap = NULL;
    assert_int_equal(kvt_kv_create(D, B, &c), 0);
    float ref[24 * 2 * D];
    append_rows(c, 12, &s, ref);
    assert_int_equal(kvt_cache_clone(c, &snap), 0); /* a prompt-cache snapshot shares blocks 0..2 */
    assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
    append_rows(c, 12, &s, ref + 12 * 2 * D);
    assert_int_equal(kvt_kv_residency_settle(c), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(state_of(c, i), KVT_BLOCK_RESIDENT); /* shared: never paged by this request */
    assert_int_equal(state_of(c, 3), KVT_BLOCK_DURABLE);
    assert_int_equal(state_of(c, 4), KVT_BLOCK_DURABLE);
    assert_int_equal(state_of(c, 5), KVT_BLOCK_RESIDENT);
    kvt_residency_stats st;
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    assert_int_equal(st.blocks_out, 2);
    assert_int_equal(st.resident_blocks, 1);
    check_rows(c, 24, ref);
    /* the snapshot lets go: now the request holds them alone and pages them */
    kvt_cache_destroy(snap);
    append_rows(c, 4, &s, NULL);
    assert_int_equal(kvt_kv_residency_settle(c), 0);
    for (int i = 0; i < 6; i++)
        assert_int_equal(state_of(c, i), KVT_BLOCK_DURABLE);
    /* a second cache cannot take layer 0; layer out of range refused */
    kvt_cache *o = NULL;
    assert_int_equal(kvt_kv_create(D, B, &o), 0);
    assert_int_equal(kvt_kv_set_residency(o, r, 0), KVT_EINVAL);
    assert_int_equal(kvt_kv_set_residency(o, r, -1), KVT_EINVAL);
    assert_int_equal(kvt_kv_set_residency(o, r, 1), 0);
    assert_int_equal(kvt_kv_set_residency(o, NULL, 0), 0);
    kvt_cache_destroy(o);
    kvt_cache_destroy(c);
    kvt_residency_release(r);
}

/* ---- the engine -------------------------------------------------------------------------- */

static kvt_model *g_model;

static kvt_model *model(void)
{
    if (g_model)
        return g_model;
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 32, p.hidden_dim = 64, p.n_layers = 3, p.n_heads = 4, p.n_kv_heads = 2, p.vocab_size = 97;
    p.seq_len = 1024, p.seed = 77;
    char path[512];
    snprintf(path, sizeof path, "%s/res.bin", g_dir);
    assert_int_equal(kvt_model_synth(&p, path), 0);
    assert_int_equal(kvt_model_load(path, &g_model), 0);
    return g_model;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

enum { PROMPT = 300, GEN = 24, BLOCK = 16 };

/* Prefills the seeded prompt and decodes GEN greedy tokens with caches under
 * r (NULL: fully resident); logits of every step into out ((GEN + 1), V).
 * Returns the first error (then *failed_at is the step, else -1). */
static int run(kvt_residency *r, float *out, int *failed_at)
{
    kvt_model *m = model();
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size, rc;
    kvt_cache *caches[8];
    assert_int_equal(kvt_model_new_caches(m, BLOCK, caches), 0);
    for (int l = 0; r && l < L; l++)
        assert_int_equal(kvt_kv_set_residency(caches[l], r, l), 0);
    int32_t prompt[PROMPT];
    uint64_t s = 99;
    for (int i = 0; i < PROMPT; i++)
        prompt[i] = (int32_t)(rng_below(&s, (uint64_t)V));
    *failed_at = -1;
    rc = kvt_model_prefill(m, caches, prompt, PROMPT, out);
    for (int g = 0; rc == 0 && g < GEN; g++) {
        int32_t tok = argmax(out + (size_t)g * V, V);
        rc = kvt_model_decode(m, caches, tok, out + (size_t)(g + 1) * V);
        if (rc)
            *failed_at = g + 1;
    }
    if (rc && *failed_at < 0)
        *failed_at = 0;
    for (int l = 0; r && l < L; l++) /* the writes in flight complete: the counters are final */
        assert_int_equal(kvt_kv_residency_settle(caches[l]), 0);
    kvt_caches_destroy(caches, L);
    return rc;
}

static void test_engine_identical(void **state)
{
    (void)state;
    kvt_model *m = model();
    int V = kvt_model_get_config(m)->vocab_size, at;
    size_t n = (size_t)(GEN + 1) * (size_t)V;
    float *full = malloc(n * sizeof *full), *bound = malloc(n * sizeof *bound);
    assert_non_null(full);
    assert_non_null(bound);
    assert_int_equal(run(NULL, full, &at), 0);
    /* one block in RAM over the 3 layers (0 per layer: only the tails), then a byte bound */
    size_t bb = kvt_model_kv_bytes_per_token(m) / 3 * BLOCK;
    const int64_t blocks[2] = {1, 0};
    const uint64_t bytes[2] = {0, 6 * bb};
    for (int k = 0; k < 2; k++) {
        kvt_residency *r = residency(blocks[k], bytes[k]);
        memset(bound, 0, n * sizeof *bound);
        assert_int_equal(run(r, bound, &at), 0);
        assert_memory_equal(full, bound, n * sizeof *full); /* bit for bit: same arithmetic */
        kvt_residency_stats st;
        assert_int_equal(kvt_residency_stats_get(r, &st), 0);
        printf("bound %lld blocks / %llu bytes: out %llu in %llu read-ahead hits %llu stall %.2f ms peak resident %llu\n",
               (long long)blocks[k], (unsigned long long)bytes[k], (unsigned long long)st.blocks_out,
               (unsigned long long)st.blocks_in, (unsigned long long)st.readahead_hits, (double)st.stall_ns / 1e6,
               (unsigned long long)st.peak_resident_bytes);
        int64_t full_blocks = 3 * ((PROMPT + GEN) / BLOCK);
        int64_t keep = k == 0 ? 0 : 6;
        assert_int_equal(st.blocks_out, full_blocks - keep);
        assert_true(st.blocks_in > 0);
        assert_true(st.readahead_hits > 0);
        assert_int_equal(st.resident_bytes, 0); /* the caches are gone */
        assert_true(st.peak_resident_bytes <= (uint64_t)(keep + 3 * 4) * bb);
        assert_int_equal(st.write_failures, 0);
        assert_int_equal(st.read_failures, 0);
        /* attention walked each layer through the window (8 blocks), not the whole layer (19) */
        printf("peak staged %llu B (window %zu B)\n", (unsigned long long)st.peak_staged_bytes, 8 * bb);
        assert_true(st.peak_staged_bytes > 0);
        assert_true(st.peak_staged_bytes <= 8 * bb);
        kvt_residency_release(r);
    }
    free(full);
    free(bound);
}

/* A model with 32 heads: a prefill chunk's scores (256 x ctx x 32 floats)
 * pass the window path's scores limit, so the heads go in groups, each
 * walking the blocks again: still bit-identical, still within the window. */
static void test_window_head_groups(void **state)
{
    (void)state;
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 64, p.hidden_dim = 64, p.n_layers = 2, p.n_heads = 32, p.n_kv_heads = 8, p.vocab_size = 97;
    p.seq_len = 1024, p.seed = 78;
    char path[512];
    snprintf(path, sizeof path, "%s/heads.bin", g_dir);
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    enum { N = 1000, STEPS = 4 };
    int V = p.vocab_size;
    static int32_t prompt[N];
    uint64_t s = g_seed ^ 3;
    for (int i = 0; i < N; i++)
        prompt[i] = (int32_t)(rng_below(&s, (uint64_t)V));
    float *lg[2];
    kvt_residency_stats st;
    size_t bb = kvt_model_kv_bytes_per_token(m) / 2 * BLOCK;
    for (int k = 0; k < 2; k++) {
        lg[k] = malloc((size_t)(STEPS + 1) * V * sizeof(float));
        assert_non_null(lg[k]);
        kvt_cache *caches[2];
        assert_int_equal(kvt_model_new_caches(m, BLOCK, caches), 0);
        kvt_residency *r = k ? residency(1, 0) : NULL;
        for (int l = 0; r && l < 2; l++)
            assert_int_equal(kvt_kv_set_residency(caches[l], r, l), 0);
        assert_int_equal(kvt_model_prefill(m, caches, prompt, N, lg[k]), 0);
        for (int g = 0; g < STEPS; g++)
            assert_int_equal(
                kvt_model_decode(m, caches, argmax(lg[k] + (size_t)g * V, V), lg[k] + (size_t)(g + 1) * V), 0);
        for (int l = 0; r && l < 2; l++)
            assert_int_equal(kvt_kv_residency_settle(caches[l]), 0);
        if (r)
            assert_int_equal(kvt_residency_stats_get(r, &st), 0);
        kvt_caches_destroy(caches, 2);
        kvt_residency_release(r);
    }
    printf("32 heads: paged out %llu blocks, in %llu, peak staged %llu B (window %zu B)\n",
           (unsigned long long)st.blocks_out, (unsigned long long)st.blocks_in,
           (unsigned long long)st.peak_staged_bytes, 8 * bb);
    assert_memory_equal(lg[0], lg[1], (size_t)(STEPS + 1) * V * sizeof(float));
    assert_true(st.blocks_out > 0);
    assert_true(st.peak_staged_bytes <= 8 * bb);
    free(lg[0]);
    free(lg[1]);
    kvt_model_free(m);
}

static void test_batched_decode_identical(void **state)
{
    (void)state;
    kvt_model *m = model();
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size;
    /* two sequences, one bounded, one fully resident, decoded in one batch:
     * each gets the logits it gets alone and unbounded */
    kvt_residency *r = residency(2, 0);
    kvt_cache *a[8], *b[8], *solo[8];
    assert_int_equal(kvt_model_new_caches(m, BLOCK, a), 0);
    assert_int_equal(kvt_model_new_caches(m, BLOCK, b), 0);
    assert_int_equal(kvt_model_new_caches(m, BLOCK, solo), 0);
    for (int l = 0; l < L; l++)
        assert_int_equal(kvt_kv_set_residency(a[l], r, l), 0);
    int32_t pa[200], pb[120];
    uint64_t s = 5;
    for (int i = 0; i < 200; i++)
        pa[i] = (int32_t)(rng_below(&s, (uint64_t)V));
    for (int i = 0; i < 120; i++)
        pb[i] = (int32_t)(rng_below(&s, (uint64_t)V));
    float *la = malloc((size_t)V * 4), *ls = malloc((size_t)V * 4), *lb = malloc(2 * (size_t)V * 4);
    assert_int_equal(kvt_model_prefill(m, a, pa, 200, la), 0);
    assert_int_equal(kvt_model_prefill(m, solo, pa, 200, ls), 0);
    assert_memory_equal(la, ls, (size_t)V * 4);
    assert_int_equal(kvt_model_prefill(m, b, pb, 120, lb + V), 0);
    for (int g = 0; g < 10; g++) {
        int32_t toks[2] = {argmax(la, V), argmax(lb + V, V)};
        kvt_cache **cs[2] = {a, b};
        assert_int_equal(kvt_model_decode_batch(m, 2, cs, toks, lb), 0);
        assert_int_equal(kvt_model_decode(m, solo, toks[0], ls), 0);
        assert_memory_equal(lb, ls, (size_t)V * 4);
        memcpy(la, lb, (size_t)V * 4);
    }
    kvt_residency_stats st;
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    assert_true(st.blocks_in > 0);
    assert_true(st.peak_staged_bytes <= 8 * (kvt_model_kv_bytes_per_token(m) / (size_t)L * BLOCK)); /* the window */
    kvt_caches_destroy(a, L);
    kvt_caches_destroy(b, L);
    kvt_caches_destroy(solo, L);
    kvt_residency_release(r);
    free(la);
    free(ls);
    free(lb);
}

/* Prompt rows of a batched pass (kvt_model_forward_batch, the server's
 * prefill) on a bounded cache: a chunk's rows attend through the window
 * together, each block of a walk paged in once per chunk and layer pass,
 * not once per row; the logits are bit-identical to the same chunks fully
 * resident, beside a resident sequence in the same passes. */
static void test_batched_prefill_walks_once(void **state)
{
    (void)state;
    kvt_model *m = model();
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size;
    enum { N = PROMPT, ROWS = 50 };
    /* f32 (kv: one walk per layer and chunk), then q8 (qkvc: a chunk's rows
     * attend block by block, a walk per piece, each piece's window closed
     * before the next opens with no read-ahead of the next layer between) */
    static const kvt_kv_scheme schemes[2] = {KVT_KV_F32, KVT_KV_Q8};
    for (int k = 0; k < 2; k++) {
        assert_int_equal(kvt_model_set_kv_scheme(m, schemes[k]), 0);
        kvt_residency *r = residency(1, 0);
        kvt_cache *a[8], *b[8], *solo[8];
        assert_int_equal(kvt_model_new_caches(m, BLOCK, a), 0);
        assert_int_equal(kvt_model_new_caches(m, BLOCK, b), 0);
        assert_int_equal(kvt_model_new_caches(m, BLOCK, solo), 0);
        assert_string_equal(kvt_cache_kind(a[0]), k ? "qkvc" : "kv");
        for (int l = 0; l < L; l++)
            assert_int_equal(kvt_kv_set_residency(a[l], r, l), 0);
        static int32_t prompt[N], toks[2 * ROWS];
        uint64_t s = g_seed ^ 11;
        for (int i = 0; i < N; i++)
            prompt[i] = (int32_t)(rng_below(&s, (uint64_t)V));
        float *lg = malloc(2 * (size_t)V * sizeof(float)), *ls = malloc(2 * (size_t)V * sizeof(float));
        assert_non_null(lg);
        assert_non_null(ls);
        int chunks = 0, walks = 0;
        for (int at = 0; at < N; at += ROWS, chunks++) {
            int n = N - at < ROWS ? N - at : ROWS;
            walks += k ? (at + n - 1) / BLOCK - at / BLOCK + 1 : 1; /* the blocks the chunk's rows lie in */
            memcpy(toks, prompt + at, (size_t)n * sizeof(int32_t));
            memcpy(toks + n, prompt + at, (size_t)n * sizeof(int32_t));
            int32_t counts[2] = {n, n};
            kvt_cache **cs[2] = {a, b}, **ref[1] = {solo};
            assert_int_equal(kvt_model_forward_batch(m, 2, cs, counts, toks, lg), 0);
            assert_int_equal(kvt_model_forward_batch(m, 1, ref, counts, toks, ls), 0);
            assert_memory_equal(lg, ls, (size_t)V * sizeof(float));     /* bounded = fully resident */
            assert_memory_equal(lg + V, ls, (size_t)V * sizeof(float)); /* its resident neighbour too */
        }
        for (int l = 0; l < L; l++)
            assert_int_equal(kvt_kv_residency_settle(a[l]), 0);
        kvt_residency_stats st;
        assert_int_equal(kvt_residency_stats_get(r, &st), 0);
        /* each walk goes over each layer's blocks twice (K pass, V pass) at most */
        uint64_t once = (uint64_t)walks * (uint64_t)L * 2 * (N / BLOCK + 1);
        size_t bb = 2 * (size_t)BLOCK * (size_t)c->kv_dim * (k ? 1 : 4); /* a full block's K and V */
        printf("%s batched prefill, %d chunks of %d rows, %d walks: paged out %llu blocks, in %llu (once per walk: "
               "<= %llu), peak staged %llu B (window %llu B)\n", kvt_kv_scheme_name(schemes[k]), chunks, ROWS,
               walks, (unsigned long long)st.blocks_out, (unsigned long long)st.blocks_in, (unsigned long long)once,
               (unsigned long long)st.peak_staged_bytes, (unsigned long long)(8 * bb));
        assert_true(st.blocks_out > 0);
        assert_true(st.blocks_in > 0);
        assert_true(st.blocks_in <= once);
        assert_int_equal(st.read_failures, 0);
        assert_true(st.peak_staged_bytes <= 8 * bb); /* the window, over every layer */
        kvt_caches_destroy(a, L);
        kvt_caches_destroy(b, L);
        kvt_caches_destroy(solo, L);
        kvt_residency_release(r);
        free(lg);
        free(ls);
    }
    assert_int_equal(kvt_model_set_kv_scheme(m, KVT_KV_F32), 0);
}

/* Decode under a strict bound of no full block per layer: every full block
 * is paged out before attention reads it, and one token's walk of a layer
 * (a K pass, then a V pass) pages each block in once in all, each pass
 * reading only the half it uses: the decode's page-in bytes are the paged
 * bytes of its steps (within one read-ahead of the next layer at either end
 * of the measurement), not twice them; logits bit-identical to fully
 * resident; each half read is checked against its own checksum. For f32
 * (kv blocks) and f16, bf16 and q8 (qkvc: their sealed blocks are the full
 * blocks, the f32 open block stays in RAM). */
static void test_decode_reads_once(void **state)
{
    (void)state;
    kvt_model *m = model();
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size, at;
    size_t n = (size_t)(GEN + 1) * (size_t)V;
    float *full = malloc(n * sizeof *full), *bound = malloc(n * sizeof *bound), *f32 = malloc(n * sizeof *f32);
    assert_non_null(full);
    assert_non_null(bound);
    assert_non_null(f32);
    /* f32 (kv blocks), then f16, bf16 and q8 (qkvc: sealed blocks, the open block f32) */
    static const kvt_kv_scheme schemes[4] = {KVT_KV_F32, KVT_KV_F16, KVT_KV_BF16, KVT_KV_Q8};
    for (int k = 0; k < 4; k++) {
        assert_int_equal(kvt_model_set_kv_scheme(m, schemes[k]), 0);
        size_t bb = 2 * (size_t)BLOCK * (size_t)c->kv_dim * (k == 0 ? 4 : k == 3 ? 1 : 2); /* a full block */
        assert_int_equal(run(NULL, k == 0 ? f32 : full, &at), 0);
        if (k == 0)
            memcpy(full, f32, n * sizeof *full);
        else
            assert_true(memcmp(full, f32, n * sizeof *full) != 0); /* the scheme is in use */
        /* 1 block over 3 layers: a share of 0 each; strict: paged before the append returns */
        kvt_residency_options o = {.max_blocks = 1, .dir = g_dir, .write_slack = -1};
        kvt_residency *r = NULL;
        assert_int_equal(kvt_residency_create(&o, &r), 0);
        kvt_cache *caches[8];
        assert_int_equal(kvt_model_new_caches(m, BLOCK, caches), 0);
        assert_string_equal(kvt_cache_kind(caches[0]), k == 0 ? "kv" : "qkvc");
        for (int l = 0; l < L; l++)
            assert_int_equal(kvt_kv_set_residency(caches[l], r, l), 0);
        int32_t prompt[PROMPT];
        uint64_t s = 99; /* run()'s prompt */
        for (int i = 0; i < PROMPT; i++)
            prompt[i] = (int32_t)(rng_below(&s, (uint64_t)V));
        memset(bound, 0, n * sizeof *bound);
        assert_int_equal(kvt_model_prefill(m, caches, prompt, PROMPT, bound), 0);
        kvt_residency_stats s0, s1;
        assert_int_equal(kvt_residency_stats_get(r, &s0), 0);
        uint64_t once = 0; /* the bytes of the full blocks each decode step attends */
        for (int g = 0; g < GEN; g++) {
            int32_t tok = argmax(bound + (size_t)g * V, V);
            assert_int_equal(kvt_model_decode(m, caches, tok, bound + (size_t)(g + 1) * V), 0);
            int64_t ctx = PROMPT + g + 1; /* kv: ctx / B full blocks; qkvc: (ctx - 1) / B sealed */
            once += (uint64_t)L * (uint64_t)((k == 0 ? ctx : ctx - 1) / BLOCK) * bb;
        }
        assert_int_equal(kvt_residency_stats_get(r, &s1), 0);
        assert_memory_equal(full, bound, n * sizeof *full); /* bit for bit */
        uint64_t got = s1.bytes_in - s0.bytes_in;
        /* a read ahead of the next layer (at most the window's 8 K halves) may land on either side */
        uint64_t slack = 8 * bb / 2;
        printf("%s: decode of %d tokens, every full block paged: %llu B paged in, the attended blocks hold %llu B "
               "(two passes of whole blocks: %llu B); %llu page-ins, %llu read-ahead hits, peak staged %llu B; "
               "%llu blocks paged out, prefill paged in %llu B\n", kvt_kv_scheme_name(schemes[k]), GEN,
               (unsigned long long)got, (unsigned long long)once, (unsigned long long)(2 * once),
               (unsigned long long)(s1.blocks_in - s0.blocks_in), (unsigned long long)s1.readahead_hits,
               (unsigned long long)s1.peak_staged_bytes, (unsigned long long)s1.blocks_out,
               (unsigned long long)s0.bytes_in);
        assert_true(got + slack >= once);
        assert_true(got <= once + slack);
        assert_int_equal(s1.blocks_out, (uint64_t)L * ((PROMPT + GEN - (k > 0)) / BLOCK));
        assert_int_equal(s1.bytes_out, s1.blocks_out * bb);
        assert_true(s0.bytes_in > 0); /* the prefill attended paged blocks too */
        assert_true(s1.readahead_hits > 0);
        assert_true(s1.peak_resident_bytes <= bb); /* strict: at most the one block being written */
        assert_int_equal(s1.read_failures, 0);
        assert_int_equal(s1.write_failures, 0);
        assert_true(s1.peak_staged_bytes <= 8 * bb); /* still the window */
        kvt_caches_destroy(caches, L);
        kvt_residency_release(r);
    }
    assert_int_equal(kvt_model_set_kv_scheme(m, KVT_KV_F32), 0);
    free(full);
    free(bound);
    free(f32);
}

/* ---- qkvc caches (f16, bf16, q8 sealed blocks) under a bound --------------------------------- */

static int page_fd(void);

static const kvt_dtype g_sealed[3] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_U8};

/* Every block of tokens [0, n) of c holds the bytes of the same block of
 * ref (c pinned): the sealed rows (and U8 scales), and the f32 open block. */
static void same_rows(kvt_cache *c, kvt_cache *ref, int64_t n)
{
    assert_int_equal(kvt_kv_pin(c, n), 0);
    for (int64_t b = 0; b < (n + B - 1) / B; b++) {
        kvt_kv_rows x, y;
        assert_int_equal(kvt_kv_block_rows(c, b, &x), 0);
        assert_int_equal(kvt_kv_block_rows(ref, b, &y), 0);
        assert_int_equal(x.dtype, y.dtype);
        assert_int_equal(x.n, y.n);
        size_t bytes = (size_t)x.n * D * kvt_dtype_size(x.dtype);
        assert_memory_equal(x.k, y.k, bytes);
        assert_memory_equal(x.v, y.v, bytes);
        if (x.dtype == KVT_DTYPE_U8) {
            assert_memory_equal(x.k_min, y.k_min, D * sizeof(float));
            assert_memory_equal(x.k_scale, y.k_scale, D * sizeof(float));
            assert_memory_equal(x.v_min, y.v_min, D * sizeof(float));
            assert_memory_equal(x.v_scale, y.v_scale, D * sizeof(float));
        }
    }
    kvt_kv_unpin(c);
}

/* A qkvc cache of each sealed dtype under a strict bound of 2 blocks: its
 * sealed blocks (K rows, then V rows, of the sealed dtype) past the bound
 * are written once and their RAM released before the append returns, the
 * open block stays; pins read them back equal to an unbounded twin's,
 * encode and a clone read them, and the clone outlives the original. */
static void test_qkvc_paging(void **state)
{
    (void)state;
    for (int k = 0; k < 3; k++) {
        uint64_t s = g_seed ^ (0x9c00u + (unsigned)k), s2 = s;
        const size_t bb = 2 * B * D * kvt_dtype_size(g_sealed[k]); /* one sealed block */
        kvt_residency_options o = {.max_blocks = 2, .dir = g_dir, .write_slack = -1};
        kvt_residency *r = NULL;
        assert_int_equal(kvt_residency_create(&o, &r), 0);
        kvt_cache *c = NULL, *ref = NULL;
        assert_int_equal(kvt_qkvc_create_dtype(D, B, g_sealed[k], &c), 0);
        assert_int_equal(kvt_qkvc_create_dtype(D, B, g_sealed[k], &ref), 0);
        assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
        kvt_residency_stats st;
        for (int t = 0; t < 42; t++) { /* 10 sealed blocks and an open block of 2 */
            append_rows(c, 1, &s, NULL);
            append_rows(ref, 1, &s2, NULL);
            assert_int_equal(kvt_residency_stats_get(r, &st), 0);
            int sealed = t / B; /* a full open block is sealed when the next row comes */
            assert_int_equal(st.resident_blocks, sealed < 2 ? sealed : 2);
            assert_int_equal(st.blocks_out, sealed > 2 ? sealed - 2 : 0);
        }
        assert_int_equal(kvt_kv_block_count(c), 11);
        for (int i = 0; i < 8; i++)
            assert_int_equal(state_of(c, i), KVT_BLOCK_DURABLE);
        assert_int_equal(state_of(c, 8), KVT_BLOCK_RESIDENT);
        assert_int_equal(state_of(c, 9), KVT_BLOCK_RESIDENT);
        assert_int_equal(st.bytes_out, 8 * bb);
        assert_true(st.peak_resident_bytes <= 2 * bb);
        kvt_kv_rows rows;
        assert_int_equal(kvt_kv_block_rows(c, 0, &rows), KVT_EINVAL);
        assert_non_null(strstr(kvt_last_error(), "paged out"));
        assert_int_equal(kvt_kv_block_rows(c, 10, &rows), 0); /* the open block: f32, in RAM */
        assert_int_equal(rows.dtype, KVT_DTYPE_F32);
        assert_int_equal(rows.n, 2);
        same_rows(c, ref, 42);
        assert_int_equal(kvt_residency_stats_get(r, &st), 0);
        assert_int_equal(st.blocks_in, 8);
        assert_int_equal(st.bytes_in, 8 * bb);
        assert_int_equal(st.staged_bytes, 0);
        /* encode reads the paged blocks: the same state as the twin's */
        kvt_cache_state e1, e2;
        memset(&e1, 0, sizeof e1);
        memset(&e2, 0, sizeof e2);
        assert_int_equal(kvt_cache_encode(c, &e1), 0);
        assert_int_equal(kvt_cache_encode(ref, &e2), 0);
        assert_int_equal(e1.n_tensors, e2.n_tensors);
        for (int i = 0; i < e1.n_tensors; i++) {
            assert_int_equal(e1.tensors[i].bytes, e2.tensors[i].bytes);
            assert_memory_equal(e1.tensors[i].data, e2.tensors[i].data, e1.tensors[i].bytes);
        }
        kvt_cache_state_clear(&e1);
        kvt_cache_state_clear(&e2);
        /* a clone shares the pages and outlives the original and the residency */
        kvt_cache *k2 = NULL;
        assert_int_equal(kvt_cache_clone(c, &k2), 0);
        kvt_cache_destroy(c);
        kvt_residency_release(r);
        same_rows(k2, ref, 42);
        /* appends go on in both: equal again */
        append_rows(k2, 9, &s, NULL);
        append_rows(ref, 9, &s2, NULL);
        same_rows(k2, ref, 51);
        kvt_cache_destroy(k2);
        kvt_cache_destroy(ref);
    }
}

/* A flipped byte in a qkvc cache's page file (a sealed block's V half) is
 * KVT_ECORRUPT naming the block, as for kv; the block stays durable.
 * (ENOSPC and EIO: test_enospc_keeps_blocks, test_eio_fails_request run
 * every scheme.) */
static void test_qkvc_corrupt_page_refused(void **state)
{
    (void)state;
    for (int k = 0; k < 3; k++) { /* a corrupted sealed block in the page file */
        uint64_t s = g_seed ^ (0xc0u + (unsigned)k);
        kvt_residency *r = residency(1, 0);
        kvt_cache *c = NULL;
        assert_int_equal(kvt_qkvc_create_dtype(D, B, g_sealed[k], &c), 0);
        assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
        append_rows(c, 20, &s, NULL); /* 4 sealed blocks, 3 of them paged */
        assert_int_equal(kvt_kv_residency_settle(c), 0);
        assert_int_equal(state_of(c, 2), KVT_BLOCK_DURABLE);
        int fd = page_fd();
        assert_true(fd >= 0);
        size_t bb = 2 * B * D * kvt_dtype_size(g_sealed[k]);
        uint8_t junk = 0x5a, was = 0;
        assert_int_equal(pread(fd, &was, 1, (off_t)(2 * bb + bb / 2 + 3)), 1); /* block 2's V half */
        junk ^= was;
        assert_int_equal(pwrite(fd, &junk, 1, (off_t)(2 * bb + bb / 2 + 3)), 1);
        assert_int_equal(kvt_kv_pin(c, 20), KVT_ECORRUPT);
        assert_non_null(strstr(kvt_last_error(), "checksum"));
        assert_non_null(strstr(kvt_last_error(), "block 2"));
        kvt_kv_unpin(c);
        assert_int_equal(state_of(c, 2), KVT_BLOCK_DURABLE);
        kvt_cache_destroy(c);
        kvt_residency_release(r);
    }
}

/* ---- through the service: kvt_seq / kvt_chat_generate and admission ------------------------ */

/* Open page files of this process (unlinked live-cache files still open). */
static int open_page_files(void)
{
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char link[300], target[1024];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(link, target, sizeof target - 1);
        if (k > 0) {
            target[k] = '\0';
            n += strstr(target, "kvtier-live-") != NULL;
        }
    }
    closedir(d);
    return n;
}

#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1 /* CMake: 10 under TSan, 3 under ASan, else 1 */
#endif

/* Open page files once they number `want`, polled for at most 30 s times
 * KVT_TEST_TIME_SCALE: a page file closes with its residency's last
 * reference, and a page-out write still in flight when a request returns
 * holds one (on a slow disk, for a while); a file something keeps open for
 * good is still counted when the wait ends. */
static int page_files_settle(int want)
{
    int n = open_page_files();
    for (int i = 0; n != want && i < 3000 * KVT_TEST_TIME_SCALE; i++) {
        usleep(10 * 1000);
        n = open_page_files();
    }
    return n;
}

static void test_service_bounded(void **state)
{
    (void)state;
    kvt_model *m = model();
    int V = kvt_model_get_config(m)->vocab_size;
    size_t row = kvt_model_kv_row_bytes(m), blk = row * BLOCK; /* one layer's block */
    int32_t prompt[PROMPT], ra[GEN], rb[GEN];
    uint64_t s = 17;
    for (int i = 0; i < PROMPT; i++)
        prompt[i] = (int32_t)(rng_below(&s, (uint64_t)V));
    /* a budget the whole context (324 tokens, 3 layers, whole blocks) does not fit in,
     * but a bound of 2 blocks (plus the 3 tails) does */
    kvt_service *svc = NULL;
    uint64_t whole = 3 * 21 * blk, bounded = (2 + 3) * blk;
    kvt_chat_service_opts so = {.prompt_cache_bytes = 64 << 20, .block_tokens = BLOCK, .kv_budget_bytes = bounded};
    assert_int_equal(kvt_chat_service_create(m, &so, &svc), 0);
    assert_int_equal(kvt_service_project_bytes(svc, PROMPT + GEN), whole);
    assert_int_equal(kvt_service_project_live_bytes(svc, PROMPT + GEN, 2, 0), bounded);
    assert_int_equal(kvt_service_project_live_bytes(svc, PROMPT + GEN, 0, blk + 1), blk + 1 + 3 * blk);
    assert_int_equal(kvt_service_project_live_bytes(svc, PROMPT + GEN, 1000, 0), whole); /* never more */
    assert_int_equal(kvt_service_project_live_bytes(svc, PROMPT + GEN, 0, 0), whole);
    kvt_sampler *sa = NULL;
    assert_int_equal(kvt_sampler_create(V, 0.0f, 0.9f, 1, &sa), 0);
    kvt_gen_opts o = {.max_tokens = GEN, .admit_timeout_ms = 0, .prefill_checkpoint_stride = -1};
    int64_t na = 0, nb = 0;
    kvt_turn_stats ta, tb;
    /* fully resident: can never fit the budget */
    assert_int_equal(kvt_chat_generate(m, svc, sa, prompt, PROMPT, &o, ra, GEN, &na, &ta), KVT_ELIMIT);
    o.live_cache_blocks = 2;
    o.live_cache_dir = g_dir;
    int files = page_files_settle(0); /* 0 once earlier requests' writes end, unless one failed half-way */
    assert_int_equal(kvt_chat_generate(m, svc, sa, prompt, PROMPT, &o, rb, GEN, &nb, &tb), 0);
    assert_int_equal(nb, GEN);
    assert_true(tb.paged_out_blocks > 0);
    /* the published entries (prompt boundary, prompt + reply) are resident:
     * the page file went with the request (once its writes end), not with the kept state */
    assert_int_equal(page_files_settle(files), files);
    kvt_service_stats kept;
    assert_int_equal(kvt_service_get_stats(svc, &kept), 0);
    assert_true(kept.entries > 0);
    assert_true(kept.bytes >= (uint64_t)(PROMPT / BLOCK) * 3 * blk); /* charged their whole RAM */
    assert_true(tb.paged_in_blocks > 0);
    assert_true(tb.live_peak_bytes <= (2 + 3 * 4) * blk);
    kvt_service_stats rep;
    assert_int_equal(kvt_service_get_stats(svc, &rep), 0); /* the report counts what the request paged */
    assert_int_equal(rep.live_paged_out_blocks, tb.paged_out_blocks);
    assert_int_equal(rep.live_paged_in_bytes, tb.paged_in_bytes);
    assert_int_equal(rep.live_page_failures, 0);
    char *json = NULL;
    assert_int_equal(kvt_service_stats_json(svc, &json), 0);
    assert_non_null(strstr(json, "\"live_paged_in_blocks\""));
    kvt_string_free(json);
    kvt_service_destroy(svc);
    /* the same reply as fully resident without a budget (the service keeps state:
     * the bounded caches were published and detached) */
    so.kv_budget_bytes = 0;
    assert_int_equal(kvt_chat_service_create(m, &so, &svc), 0);
    o.live_cache_blocks = 0;
    assert_int_equal(kvt_chat_generate(m, svc, sa, prompt, PROMPT, &o, ra, GEN, &na, &ta), 0);
    assert_int_equal(na, nb);
    assert_memory_equal(ra, rb, (size_t)na * sizeof *ra);
    assert_int_equal(ta.paged_out_blocks, 0);
    /* a bounded repeat reuses the kept prefix and still gives the same reply */
    o.live_cache_blocks = 1;
    assert_int_equal(kvt_chat_generate(m, svc, sa, prompt, PROMPT, &o, rb, GEN, &nb, &tb), 0);
    assert_true(tb.reused_tokens > 0);
    assert_memory_equal(ra, rb, (size_t)na * sizeof *ra);
    kvt_service_destroy(svc);
    kvt_sampler_free(sa);
}

/* f16, bf16 and q8 ("qkvc" layers: sealed blocks and an f32 open block)
 * are bounded like f32: a strict bound of 1 block gives the fully resident
 * reply token for token, pages their sealed blocks out and in, publishes
 * resident state, and the report counts it; the library's int8 "qkv" kind
 * (which no engine scheme makes) is still refused, naming the layer. */
static void test_qkvc_service_bounded(void **state)
{
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/res.bin", g_dir);
    (void)model(); /* writes the checkpoint */
    static const kvt_kv_scheme schemes[3] = {KVT_KV_F16, KVT_KV_BF16, KVT_KV_Q8};
    for (int k = 0; k < 3; k++) {
        kvt_model *m = NULL;
        assert_int_equal(kvt_model_load(path, &m), 0);
        assert_int_equal(kvt_model_set_kv_scheme(m, schemes[k]), 0);
        int V = kvt_model_get_config(m)->vocab_size;
        int32_t prompt[PROMPT], ra[GEN], rb[GEN];
        uint64_t s = 5;
        for (int i = 0; i < PROMPT; i++)
            prompt[i] = (int32_t)(rng_below(&s, (uint64_t)V));
        kvt_sampler *sa = NULL;
        assert_int_equal(kvt_sampler_create(V, 0.0f, 0.9f, 1, &sa), 0);
        kvt_chat_service_opts so = {.prompt_cache_bytes = 64 << 20, .block_tokens = BLOCK};
        kvt_service *svc = NULL;
        assert_int_equal(kvt_chat_service_create(m, &so, &svc), 0);
        kvt_gen_opts o = {.max_tokens = GEN, .admit_timeout_ms = 0, .prefill_checkpoint_stride = -1};
        int64_t na = 0, nb = 0;
        kvt_turn_stats ta, tb;
        assert_int_equal(kvt_chat_generate(m, svc, sa, prompt, PROMPT, &o, ra, GEN, &na, &ta), 0);
        kvt_service_destroy(svc);
        assert_int_equal(kvt_chat_service_create(m, &so, &svc), 0); /* nothing kept: the same prefill */
        o.live_cache_blocks = 1;
        o.live_cache_strict = 1;
        o.live_cache_dir = g_dir;
        int files = page_files_settle(0);
        assert_int_equal(kvt_chat_generate(m, svc, sa, prompt, PROMPT, &o, rb, GEN, &nb, &tb), 0);
        printf("%s bounded: paged out %lld blocks, in %lld blocks (%lld B)\n", kvt_kv_scheme_name(schemes[k]),
               (long long)tb.paged_out_blocks, (long long)tb.paged_in_blocks, (long long)tb.paged_in_bytes);
        assert_int_equal(nb, na);
        assert_memory_equal(ra, rb, (size_t)na * sizeof *ra);
        assert_int_equal(tb.paged_out_blocks, 3 * ((PROMPT + GEN - 1) / BLOCK)); /* every sealed block */
        assert_true(tb.paged_in_blocks > 0);
        assert_int_equal(page_files_settle(files), files); /* published state is resident */
        kvt_service_stats rep;
        assert_int_equal(kvt_service_get_stats(svc, &rep), 0);
        assert_int_equal(rep.live_paged_out_blocks, tb.paged_out_blocks);
        assert_int_equal(rep.live_page_failures, 0);
        /* the kept state serves a bounded repeat: the same reply again */
        assert_int_equal(kvt_chat_generate(m, svc, sa, prompt, PROMPT, &o, rb, GEN, &nb, &tb), 0);
        assert_true(tb.reused_tokens > 0);
        assert_memory_equal(ra, rb, (size_t)na * sizeof *ra);
        kvt_service_destroy(svc);
        kvt_sampler_free(sa);
        kvt_model_free(m);
    }
    /* the qkv kind is never paged: refused, naming the layer */
    kvt_residency *r = residency(2, 0);
    kvt_cache *q = NULL;
    assert_int_equal(kvt_qkv_create(D, 4, B, &q), 0);
    assert_int_equal(kvt_seq_live_attach(&q, 1, r), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "layer 0"));
    assert_non_null(strstr(kvt_last_error(), "qkv"));
    kvt_cache_destroy(q);
    kvt_residency_release(r);
}

/* ---- faults -------------------------------------------------------------------------------- */

/* Every scheme: f32 (kv blocks) and f16, bf16, q8 (qkvc sealed blocks). */
static const kvt_kv_scheme g_schemes[4] = {KVT_KV_F32, KVT_KV_F16, KVT_KV_BF16, KVT_KV_Q8};

static void test_enospc_keeps_blocks(void **state)
{
    (void)state;
    kvt_model *m = model();
    int V = kvt_model_get_config(m)->vocab_size, at;
    size_t n = (size_t)(GEN + 1) * (size_t)V;
    float *full = malloc(n * sizeof *full), *bound = malloc(n * sizeof *bound);
    for (int k = 0; k < 4; k++) {
        assert_int_equal(kvt_model_set_kv_scheme(m, g_schemes[k]), 0);
        assert_int_equal(run(NULL, full, &at), 0);
        kvt_residency *r = residency(1, 0);
        kvt__io_fault f = {.ops = 1u << KVT_IO_PWRITE, .path_has = NULL, .fail_at = 5, .err = ENOSPC};
        kvt__io_arm(&f);
        assert_int_equal(run(r, bound, &at), 0); /* one write fails: that block stays in RAM */
        int64_t failures = kvt__io_failures();
        kvt__io_disarm();
        assert_int_equal(failures, 1);
        assert_memory_equal(full, bound, n * sizeof *full);
        kvt_residency_stats st;
        assert_int_equal(kvt_residency_stats_get(r, &st), 0);
        assert_int_equal(st.write_failures, 1);
        /* 324 tokens: 20 full kv blocks, and 20 sealed qkvc blocks ((324 - 1) / 16) */
        assert_int_equal(st.blocks_out, 3 * ((PROMPT + GEN) / BLOCK) - 1);
        kvt_residency_release(r);
    }
    assert_int_equal(kvt_model_set_kv_scheme(m, KVT_KV_F32), 0);
    free(full);
    free(bound);
}

static void test_eio_fails_request(void **state)
{
    (void)state;
    kvt_model *m = model();
    int V = kvt_model_get_config(m)->vocab_size, at;
    size_t n = (size_t)(GEN + 1) * (size_t)V;
    float *full = malloc(n * sizeof *full), *bound = malloc(n * sizeof *bound);
    for (int k = 1; k <= 40; k += 13) { /* f32, then f16, bf16, q8 */
        assert_int_equal(kvt_model_set_kv_scheme(m, g_schemes[k / 13]), 0);
        assert_int_equal(run(NULL, full, &at), 0);
        kvt_residency *r = residency(1, 0);
        memset(bound, 0, n * sizeof *bound);
        kvt__io_fault f = {.ops = 1u << KVT_IO_PREAD, .fail_at = k, .err = EIO};
        kvt__io_arm(&f);
        int rc = run(r, bound, &at);
        kvt__io_disarm();
        assert_int_equal(rc, KVT_EIO);
        assert_non_null(strstr(kvt_last_error(), "paging block"));
        assert_true(at >= 0);
        /* every step before the failure gave exactly the resident logits */
        assert_memory_equal(full, bound, (size_t)at * (size_t)V * sizeof *full);
        kvt_residency_stats st;
        assert_int_equal(kvt_residency_stats_get(r, &st), 0);
        assert_int_equal(st.read_failures, 1);
        kvt_residency_release(r);
    }
    assert_int_equal(kvt_model_set_kv_scheme(m, KVT_KV_F32), 0);
    free(full);
    free(bound);
}

/* The descriptor of this process's (unlinked) page file, -1 when none. */
static int page_fd(void)
{
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    struct dirent *e;
    int fd = -1;
    while ((e = readdir(d))) {
        char link[300], target[512];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(link, target, sizeof target - 1);
        if (k > 0) {
            target[k] = 0;
            if (strstr(target, "kvtier-live-"))
                fd = atoi(e->d_name);
        }
    }
    closedir(d);
    return fd;
}

static void test_corrupt_page_refused(void **state)
{
    (void)state;
    uint64_t s = g_seed ^ 2;
    kvt_residency *r = residency(1, 0);
    kvt_cache *c = NULL;
    assert_int_equal(kvt_kv_create(D, B, &c), 0);
    assert_int_equal(kvt_kv_set_residency(c, r, 0), 0);
    append_rows(c, 20, &s, NULL);
    assert_int_equal(kvt_kv_residency_settle(c), 0);
    int fd = page_fd();
    assert_true(fd >= 0);
    float junk = 1.0f;
    assert_int_equal(pwrite(fd, &junk, sizeof junk, 2 * 2 * B * D * 4 + 12), (ssize_t)sizeof junk); /* block 2 */
    assert_int_equal(kvt_kv_pin(c, 20), KVT_ECORRUPT);
    assert_non_null(strstr(kvt_last_error(), "checksum"));
    kvt_kv_unpin(c);
    kvt_residency_stats st;
    assert_int_equal(kvt_residency_stats_get(r, &st), 0);
    assert_int_equal(st.read_failures, 1);
    assert_int_equal(state_of(c, 2), KVT_BLOCK_DURABLE);
    kvt_cache_destroy(c);
    kvt_residency_release(r);
}

/* A split window's read-ahead stages only the K halves of the next layer's
 * blocks. When the worker refuses a read (its byte bound here: every read
 * is done on the spot), such a block is resident with its K half only; the
 * next layer must still read its V half before attending. With prompt rows
 * crossing sealed blocks (f16, q8: a window per block) the next layer often
 * holds no block paged out, only those halves: before the fix its window
 * was skipped and attention read a V half never read (f16 and q8 logits and
 * states differed from decode in every run). Batched passes and
 * kvt_model_prefill on bounded caches must equal unbounded ones bit for
 * bit. Hybrid model: attention, window, recurrent, attention, attention. */
static void test_refused_reads_fill_halves(void **state)
{
    (void)state;
    enum { NL = 5, NV = 50, BT = 4, NT = 600 };
    kvt_io_options io_opt = {.threads = 1, .max_ops = 4, .max_bytes = 1};
    kvt_io *io = NULL;
    assert_int_equal(kvt_io_create(&io_opt, &io), 0);
    char path[400];
    snprintf(path, sizeof path, "%s/halves.bin", g_dir);
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 64, p.hidden_dim = 96, p.n_layers = NL, p.n_heads = 4, p.n_kv_heads = 2, p.vocab_size = NV;
    p.seq_len = NT, p.seed = 7, p.sliding_window = 5;
    p.layer_kind[1] = KVT_LAYER_WINDOW;
    p.layer_kind[2] = KVT_LAYER_RECURRENT;
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    static int32_t tok[NT];
    uint64_t s = g_seed ^ 0x4a1f;
    for (int i = 0; i < NT; i++)
        tok[i] = (int32_t)rng_below(&s, NV);
    static const kvt_kv_scheme schemes[3] = {KVT_KV_Q8, KVT_KV_F16, KVT_KV_F32};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(kvt_model_set_kv_scheme(m, schemes[k]), 0);
        kvt_residency_options o = {.max_blocks = 1, .dir = g_dir, .window = 2, .write_slack = -1, .io = io};
        kvt_residency *rb[2] = {NULL, NULL}, *rp = NULL;
        assert_int_equal(kvt_residency_create(&o, &rb[0]), 0);
        assert_int_equal(kvt_residency_create(&o, &rb[1]), 0);
        assert_int_equal(kvt_residency_create(&o, &rp), 0);
        kvt_cache *ref[2][NL], *bat[2][NL], *pb[NL], *pu[NL];
        for (int q = 0; q < 2; q++) {
            assert_int_equal(kvt_model_new_caches(m, BT, ref[q]), 0);
            assert_int_equal(kvt_model_new_caches(m, BT, bat[q]), 0);
        }
        assert_int_equal(kvt_model_new_caches(m, BT, pb), 0);
        assert_int_equal(kvt_model_new_caches(m, BT, pu), 0);
        for (int l = 0; l < NL; l++)
            if (kvt_model_get_config(m)->layer_kind[l] == KVT_LAYER_ATTN) {
                assert_int_equal(kvt_kv_set_residency(bat[0][l], rb[0], l), 0);
                assert_int_equal(kvt_kv_set_residency(bat[1][l], rb[1], l), 0);
                assert_int_equal(kvt_kv_set_residency(pb[l], rp, l), 0);
            }
        static const int32_t rows0[] = {1, 7, 2 * BT, BT + 3, 37, 100, 3, 250};
        static const int32_t rows1[] = {5, 1, 50, 2, 3 * BT + 1, 30, 1, 2};
        int at[2] = {0, 0};
        float lr[2][NV], lb[2 * NV], lp[NV], lu[NV];
        for (int step = 0; step < 8; step++) {
            int32_t c[2] = {rows0[step], rows1[step]}, bt[2 * KVT_MODEL_CHUNK];
            for (int q = 0; q < 2; q++)
                for (int i = 0; i < c[q]; i++)
                    assert_int_equal(kvt_model_decode(m, ref[q], tok[at[q] + i], lr[q]), 0);
            memcpy(bt, tok + at[0], (size_t)c[0] * sizeof(int32_t));
            memcpy(bt + c[0], tok + at[1], (size_t)c[1] * sizeof(int32_t));
            kvt_cache **cs[2] = {bat[0], bat[1]};
            assert_int_equal(kvt_model_forward_batch(m, 2, cs, c, bt, lb), 0);
            for (int q = 0; q < 2; q++)
                if (memcmp(lr[q], lb + q * NV, sizeof lr[q]))
                    fail_msg("%s pass %d: sequence %d differs from its decode", kvt_kv_scheme_name(schemes[k]),
                             step, q);
            assert_int_equal(kvt_model_prefill(m, pb, tok + at[0], c[0], lp), 0);
            assert_int_equal(kvt_model_prefill(m, pu, tok + at[0], c[0], lu), 0);
            if (memcmp(lp, lu, sizeof lp))
                fail_msg("%s prefill %d: bounded differs from unbounded", kvt_kv_scheme_name(schemes[k]), step);
            at[0] += c[0];
            at[1] += c[1];
        }
        kvt_residency_stats st;
        assert_int_equal(kvt_residency_stats_get(rb[1], &st), 0);
        printf("%s, every page-in read on the spot: %llu blocks out, %llu in, peak staged %llu B; passes == decode, "
               "bounded prefill == unbounded\n",
               kvt_kv_scheme_name(schemes[k]), (unsigned long long)st.blocks_out, (unsigned long long)st.blocks_in,
               (unsigned long long)st.peak_staged_bytes);
        assert_true(st.blocks_out > 0);
        assert_true(st.blocks_in > 0);
        for (int l = 0; l < NL; l++) {
            assert_int_equal(kvt_kv_make_resident(bat[0][l]), 0);
            assert_int_equal(kvt_kv_make_resident(bat[1][l]), 0);
            assert_int_equal(kvt_kv_make_resident(pb[l]), 0);
            assert_int_equal(store_cache_diff(ref[0][l], bat[0][l]), 0);
            assert_int_equal(store_cache_diff(ref[1][l], bat[1][l]), 0);
            assert_int_equal(store_cache_diff(pu[l], pb[l]), 0);
        }
        for (int q = 0; q < 2; q++) {
            kvt_caches_destroy(ref[q], NL);
            kvt_caches_destroy(bat[q], NL);
        }
        kvt_caches_destroy(pb, NL);
        kvt_caches_destroy(pu, NL);
        kvt_residency_release(rb[0]);
        kvt_residency_release(rb[1]);
        kvt_residency_release(rp);
    }
    kvt_model_free(m);
    unlink(path);
    kvt_io_destroy(io);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    kvt_residency *r = NULL;
    kvt_residency_options o = {.max_blocks = -1};
    assert_int_equal(kvt_residency_create(&o, &r), KVT_EINVAL);
    assert_null(r);
    o = (kvt_residency_options){.dir = "/nonexistent/dir"};
    assert_true(kvt_residency_create(&o, &r) < 0);
    assert_non_null(strstr(kvt_last_error(), "/nonexistent/dir"));
    assert_int_equal(kvt_residency_create(NULL, NULL), KVT_EINVAL);
    r = residency(0, 0);
    assert_int_equal(kvt_residency_bounded(r), 0);
    assert_int_equal(kvt_residency_bound_bytes(r, 100), UINT64_MAX);
    kvt_residency_release(r);
    r = residency(3, 250);
    assert_int_equal(kvt_residency_bounded(r), 1);
    assert_int_equal(kvt_residency_bound_bytes(r, 100), 200); /* the smaller: 2 blocks of bytes, 3 of count */
    kvt_cache *q = NULL;
    assert_int_equal(kvt_rotating_create(D, 8, 0, &q), 0);
    assert_int_equal(kvt_kv_set_residency(q, r, 0), KVT_EINVAL); /* only the kv kind pages */
    assert_int_equal(kvt_kv_pin(q, 0), 0);                        /* other kinds: always resident */
    kvt_cache_destroy(q);
    kvt_cache *c = NULL;
    assert_int_equal(kvt_kv_create(D, B, &c), 0);
    assert_int_equal(kvt_kv_pin(c, 1), KVT_ERANGE);
    assert_int_equal(kvt_kv_pin(NULL, 0), KVT_EINVAL);
    kvt_cache_destroy(c);
    kvt_residency_release(r);
    kvt_residency_release(NULL);
}

static int setup(void **state)
{
    (void)state;
    const char *t = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/kvt_res_XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(g_dir))
        return -1;
    g_seed = test_seed("test_residency");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvt_model_free(g_model);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_state_machine),
        cmocka_unit_test(test_kv_paging),
        cmocka_unit_test(test_strict_bound),
        cmocka_unit_test(test_window_walk),
        cmocka_unit_test(test_window_halves),
        cmocka_unit_test(test_shared_blocks_stay),
        cmocka_unit_test(test_engine_identical),
        cmocka_unit_test(test_batched_decode_identical),
        cmocka_unit_test(test_batched_prefill_walks_once),
        cmocka_unit_test(test_decode_reads_once),
        cmocka_unit_test(test_window_head_groups),
        cmocka_unit_test(test_service_bounded),
        cmocka_unit_test(test_qkvc_service_bounded),
        cmocka_unit_test(test_qkvc_paging),
        cmocka_unit_test(test_qkvc_corrupt_page_refused),
        cmocka_unit_test(test_enospc_keeps_blocks),
        cmocka_unit_test(test_eio_fails_request),
        cmocka_unit_test(test_corrupt_page_refused),
        cmocka_unit_test(test_refused_reads_fill_halves),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
