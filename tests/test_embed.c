/*
 * test_embed.c: the library as an embedder meets it, through the public
 * headers only: one ownership rule for arrays of caches (a snapshot in a
 * stack array, arrays from a custom allocator, publish and dispose on every
 * kind of state), a graceful shutdown through the obvious function, the
 * calls that spare an engine its hand-over code (put back what take lent,
 * fresh caches on a miss), the model described once (projection read off
 * the caches, a store fingerprint from the recipe), and small helpers.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/prompt_cache.h"
#include "kvtier/service.h"
#include "kvtier/store.h"
#include "store_util.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a small model: layer 0 kv (d 4, B 16), layer 1 kv (d 4, B 16) ---------- */

#define L 2
#define D 4
#define B 16

static int new_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    for (int l = 0; l < L; l++) {
        int rc = kvt_kv_create(D, B, &c[l]);
        if (rc) {
            kvt_caches_destroy(c, l);
            return rc;
        }
    }
    return 0;
}

static int32_t toks[256];

static void setup_tokens(void)
{
    for (int i = 0; i < 256; i++)
        toks[i] = 1000 + i;
}

/* Appends tokens [from, to) (K = V = the token id) to every layer. */
static void run_tokens(kvt_cache **c, int64_t from, int64_t to)
{
    for (int64_t t = from; t < to; t++) {
        float kv[D];
        for (int j = 0; j < D; j++)
            kv[j] = (float)toks[t];
        const void *in[2] = {kv, kv};
        for (int l = 0; l < L; l++)
            assert_int_equal(kvt_cache_append(c[l], 1, in), 0);
    }
}

static const kvt_service_layer layers[L] = {
    {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * D * 4, .block_tokens = B},
    {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * D * 4, .block_tokens = B},
};

static kvt_service *make_service(void)
{
    kvt_service_config cfg = {.n_layers = L, .layers = layers, .max_positions = 1000,
                              .new_caches = new_caches, .prompt_cache_bytes = 1 << 20, .block_tokens = B};
    kvt_service *s = NULL;
    assert_int_equal(kvt_service_create(&cfg, &s), 0);
    return s;
}

static kvt_admission *start(kvt_service *s, int64_t n, kvt_state *st)
{
    kvt_request r = {.prompt = toks, .n_prompt = n, .max_tokens = 4};
    kvt_admission *a = NULL;
    assert_int_equal(kvt_service_admit(s, &r, &a), 0);
    assert_int_equal(kvt_service_acquire(s, a, st), 0);
    return a;
}

/* ---- arrays of caches: one rule --------------------------------------------- */

/* The snapshot made the natural way: clones into a stack array, published.
 * The service adopts the caches and never frees the caller's array (it used
 * to hand it to free(): "free(): invalid size"). */
static void test_publish_stack_array_snapshot(void **state)
{
    (void)state;
    setup_tokens();
    kvt_service *s = make_service();
    kvt_state live;
    kvt_admission *a = start(s, 40, &live);
    run_tokens(live.caches, 0, 40);
    kvt_cache *snap_caches[L] = {NULL, NULL};
    assert_int_equal(kvt_caches_clone(live.caches, L, snap_caches), 0);
    kvt_state snap = {.n_layers = L, .caches = snap_caches};
    assert_int_equal(kvt_service_publish(s, a, toks, 40, &snap), 0);
    assert_null(snap_caches[0]); /* the caches were adopted: the slots are empty */
    assert_null(snap_caches[1]);
    kvt_state_clear(&snap);    /* harmless after a publish, also on a stack array */
    assert_int_equal(kvt_service_peek(s, toks, 60, ""), 40);
    /* the live state keeps running after the snapshot, then is ended */
    run_tokens(live.caches, 40, 44);
    assert_int_equal(kvt_cache_offset(live.caches[0]), 44);
    kvt_state_clear(&live);
    kvt_service_release(s, a, 1);

    /* a refused publish takes nothing: the caller's array still holds its caches */
    kvt_state st;
    a = start(s, 50, &st);
    assert_int_equal(st.reused_tokens, 40);
    kvt_cache *mine[L] = {NULL, NULL};
    assert_int_equal(kvt_caches_clone(st.caches, L, mine), 0);
    kvt_state bad = {.n_layers = L, .caches = mine};
    assert_int_equal(kvt_service_publish(s, a, toks, 41, &bad), KVT_EINVAL); /* holds 40 */
    assert_non_null(mine[0]);
    assert_ptr_equal(bad.caches, mine);
    kvt_state_clear(&bad); /* disposes the caches, leaves the stack array alone */
    assert_null(mine[0]);
    assert_null(mine[1]);
    kvt_state_clear(&st);
    kvt_service_release(s, a, 1);
    kvt_service_destroy(s);
}

/* A tagging allocator: every block kvtier allocates carries a header; a free
 * of anything else (a caller's array) is counted as foreign. */
#define TAG 0x6b767469657221ull
static atomic_long tag_live, tag_foreign;

static void *tag_malloc(size_t n, void *ctx)
{
    (void)ctx;
    uint64_t *p = malloc(n + 16);
    if (!p)
        return NULL;
    p[0] = TAG;
    atomic_fetch_add(&tag_live, 1);
    return p + 2;
}

static void tag_free(void *q, void *ctx)
{
    (void)ctx;
    if (!q)
        return;
    uint64_t *p = (uint64_t *)q - 2;
    if (p[0] != TAG) {
        atomic_fetch_add(&tag_foreign, 1);
        return; /* not ours: leave it (freeing it would crash) */
    }
    p[0] = 0;
    atomic_fetch_sub(&tag_live, 1);
    free(p);
}

static void *tag_realloc(void *q, size_t n, void *ctx)
{
    if (!q)
        return tag_malloc(n, ctx);
    uint64_t *p = (uint64_t *)q - 2;
    assert_true(p[0] == TAG);
    uint64_t *r = realloc(p, n + 16);
    return r ? r + 2 : NULL;
}

/* kvt_state_init builds what publish adopts from kvtier's (custom)
 * allocator; publish, dispose and clone free exactly what kvtier allocated,
 * through it, and never a caller's array. */
static void test_state_arrays_custom_allocator(void **state)
{
    (void)state;
    setup_tokens();
    static const kvt_allocator tagging = {tag_malloc, tag_realloc, tag_free, NULL};
    atomic_store(&tag_live, 0);
    atomic_store(&tag_foreign, 0);
    kvt_set_allocator(&tagging);
    kvt_service *s = make_service();

    kvt_state live;
    kvt_admission *a = start(s, 40, &live);
    assert_true(live.kvtier_arrays);
    run_tokens(live.caches, 0, 40);
    /* the snapshot through kvt_state_clone: arrays from the allocator */
    kvt_state snap;
    assert_int_equal(kvt_state_clone(&live, &snap), 0);
    assert_true(snap.kvtier_arrays);
    assert_int_equal(snap.n_layers, L);
    assert_ptr_not_equal(snap.caches[0], live.caches[0]);
    assert_int_equal(kvt_cache_offset(snap.caches[1]), 40);
    assert_int_equal(kvt_service_publish(s, a, toks, 40, &snap), 0);
    assert_null(snap.caches); /* publish ended it: arrays freed, struct zeroed */
    kvt_state_clear(&snap);
    /* kvt_state_init: the builder of a state to publish */
    kvt_state built;
    assert_int_equal(kvt_state_init(&built, L, 0), 0);
    assert_true(built.kvtier_arrays);
    assert_null(built.caches[0]);
    assert_int_equal(kvt_caches_clone(live.caches, L, built.caches), 0);
    run_tokens(built.caches, 40, 42);
    assert_int_equal(kvt_service_publish(s, a, toks, 42, &built), 0);
    kvt_state_clear(&built);
    /* a caller's malloc array: adopted caches, the array stays the caller's */
    kvt_cache **own = malloc(L * sizeof *own);
    assert_non_null(own);
    assert_int_equal(kvt_caches_clone(live.caches, L, own), 0);
    kvt_state mine = {.n_layers = L, .caches = own};
    assert_int_equal(kvt_service_publish(s, a, toks, 40, &mine), 0);
    kvt_state_clear(&mine);
    free(own);
    kvt_state_clear(&live);
    kvt_service_release(s, a, 1);
    assert_int_equal(atomic_load(&tag_foreign), 0);
    assert_int_equal(kvt_service_peek(s, toks, 60, ""), 42);
    kvt_service_destroy(s);
    assert_int_equal(atomic_load(&tag_live), 0);
    assert_int_equal(atomic_load(&tag_foreign), 0);
    kvt_set_allocator(NULL);

    /* bad arguments */
    assert_int_equal(kvt_state_init(NULL, 1, 0), KVT_EINVAL);
    assert_int_equal(kvt_state_init(&built, 0, 0), KVT_EINVAL);
    assert_null(built.caches);
    assert_int_equal(kvt_state_clone(NULL, &built), KVT_EINVAL);
    kvt_state empty = {.n_layers = 1};
    assert_int_equal(kvt_state_clone(&empty, &built), KVT_EINVAL);
    assert_null(built.caches);
}

/* ---- shutdown: destroying the prompt cache loses nothing --------------------- */

static int fp_of(const char *dir, kvt_store **out)
{
    char fp[KVT_STORE_FINGERPRINT_LEN];
    int rc = kvt_store_config_fingerprint_of(new_caches, NULL, L, fp);
    if (rc)
        return rc;
    kvt_store_identity id = {.model_id = "embed-test", .config_fingerprint = fp, .tokenizer_hash = "t"};
    kvt_store_options opts = {.queue_max_bytes = 1}; /* one entry at a time: spills get refused */
    return kvt_store_open(dir, &id, &opts, out);
}

/* Entries put into a prompt cache over the SSD store survive a restart when
 * the program ends the obvious way: kvt_prompt_cache_destroy, then
 * kvt_store_close. With a write-behind queue of one entry most spills are
 * refused; close writes those synchronously. (destroy used to drop them.) */
static void test_destroy_hands_everything_to_the_store(void **state)
{
    (void)state;
    setup_tokens();
    char dir[512];
    store_tmpdir(dir, sizeof dir, "embed-close");
    kvt_store *store = NULL;
    assert_int_equal(fp_of(dir, &store), 0);
    kvt_cold_tier tier;
    kvt_store_cold_tier(store, &tier);
    kvt_prompt_cache_config cfg = {.max_bytes = 1 << 20, .cold = &tier};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    /* 8 entries in 8 namespaces (none supersedes another), one pinned */
    char ns[8][8];
    for (int i = 0; i < 8; i++) {
        snprintf(ns[i], sizeof ns[i], "n%d", i);
        kvt_cache *c[L];
        assert_int_equal(new_caches(NULL, c), 0);
        run_tokens(c, 0, 20 + i);
        kvt_entry e = {.ns = ns[i], .tokens = toks, .n_tokens = 20 + i, .caches = c, .n_caches = L};
        assert_int_equal(kvt_prompt_cache_put(pc, &e, NULL), 0);
    }
    kvt_lease *pin = NULL;
    assert_int_equal(kvt_prompt_cache_pin(pc, toks, 23, "n3", &pin), 0);
    kvt_lease_release(pin); /* destroy wants every lease released */
    kvt_prompt_cache_destroy(pc);
    assert_int_equal(kvt_store_close(store), 0);

    /* a restarted process finds all eight on disk */
    assert_int_equal(fp_of(dir, &store), 0);
    for (int i = 0; i < 8; i++)
        assert_int_equal(kvt_store_contains(store, toks, 20 + i, ns[i]), 1);
    /* close on its own: reports success, the cache is empty and usable */
    kvt_store_cold_tier(store, &tier);
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    kvt_cache *c[L];
    assert_int_equal(new_caches(NULL, c), 0);
    run_tokens(c, 0, 40);
    kvt_entry e = {.ns = "later", .tokens = toks, .n_tokens = 40, .caches = c, .n_caches = L};
    assert_int_equal(kvt_prompt_cache_put(pc, &e, NULL), 0);
    assert_int_equal(kvt_prompt_cache_close(pc), 0);
    kvt_prompt_cache_stats st;
    kvt_prompt_cache_get_stats(pc, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(kvt_store_contains(store, toks, 40, "later"), 1);
    assert_int_equal(kvt_prompt_cache_close(pc), 0); /* nothing new: a no-op */
    kvt_prompt_cache_destroy(pc);
    assert_int_equal(kvt_store_close(store), 0);
    store_rmtree(dir);

    /* RAM only: close is a clear */
    kvt_prompt_cache_config ram = {.max_bytes = 1 << 20};
    assert_int_equal(kvt_prompt_cache_create(&ram, &pc), 0);
    assert_int_equal(new_caches(NULL, c), 0);
    run_tokens(c, 0, 10);
    kvt_entry r = {.ns = "", .tokens = toks, .n_tokens = 10, .caches = c, .n_caches = L};
    assert_int_equal(kvt_prompt_cache_put(pc, &r, NULL), 0);
    assert_int_equal(kvt_prompt_cache_close(pc), 0);
    kvt_prompt_cache_get_stats(pc, &st);
    assert_int_equal(st.entries, 0);
    kvt_prompt_cache_destroy(pc);
    assert_int_equal(kvt_prompt_cache_close(NULL), 0);
}

/* ---- one code path for hit and miss ------------------------------------------ */

static int fail_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    (void)c;
    return KVT_ENOMEM;
}

/* take lends fresh caches on a miss (config new_caches) and put_hit puts back
 * what was lent, extended: the same five lines serve three turns. */
static void test_put_hit_and_fresh_miss(void **state)
{
    (void)state;
    setup_tokens();
    kvt_prompt_cache_config cfg = {.max_bytes = 1 << 20, .new_caches = new_caches, .n_layers = L};
    kvt_prompt_cache *pc = NULL;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    const int64_t lens[3] = {20, 45, 70};
    const int64_t want_reuse[3] = {0, 20, 45};
    for (int turn = 0; turn < 3; turn++) {
        kvt_hit hit;
        assert_int_equal(kvt_prompt_cache_lend(pc, toks, lens[turn], "chat", "s", &hit), 0);
        assert_int_equal(hit.prefix_len, want_reuse[turn]);
        assert_int_equal(hit.entry.n_caches, L);              /* fresh ones on the miss */
        assert_int_equal(kvt_cache_offset(hit.entry.caches[1]), want_reuse[turn]);
        assert_int_equal(hit.source, turn == 0 ? KVT_HIT_NONE : KVT_HIT_SESSION); /* the session's entry */
        run_tokens(hit.entry.caches, hit.prefix_len, lens[turn]);
        assert_int_equal(kvt_prompt_cache_put_hit(pc, &hit, toks, lens[turn], "s"), 0);
        assert_null(hit.entry.caches); /* adopted and released */
        kvt_hit_clear(&hit);         /* a no-op now */
    }
    kvt_prompt_cache_stats st;
    kvt_prompt_cache_get_stats(pc, &st);
    assert_int_equal(st.entries, 1); /* each longer entry superseded the one before */
    assert_int_equal(st.hits, 2);
    assert_int_equal(st.misses, 1);
    const float *k;
    int32_t n;
    kvt_hit hit;
    assert_int_equal(kvt_prompt_cache_lend(pc, toks, 71, "chat", NULL, &hit), 0);
    assert_int_equal(hit.prefix_len, 70);
    assert_int_equal(kvt_kv_block(hit.entry.caches[0], 4, &k, NULL, &n), 0);
    assert_true(k[0] == (float)toks[64]);
    assert_int_equal(n, 6);

    /* refusals leave the hit as it was */
    assert_int_equal(kvt_prompt_cache_put_hit(pc, &hit, toks, 71, NULL), KVT_EINVAL); /* holds 70 */
    assert_non_null(hit.entry.caches[0]);
    int32_t other[70];
    memcpy(other, toks, sizeof other);
    other[5] = -1;
    assert_int_equal(kvt_prompt_cache_put_hit(pc, &hit, other, 70, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "do not begin with"));
    assert_non_null(hit.entry.caches[0]);
    assert_int_equal(kvt_prompt_cache_put_hit(pc, NULL, toks, 70, NULL), KVT_EINVAL);
    kvt_hit_clear(&hit);
    kvt_prompt_cache_destroy(pc);

    /* without new_caches a miss lends nothing and put_hit says why */
    kvt_prompt_cache_config plain = {.max_bytes = 1 << 20};
    assert_int_equal(kvt_prompt_cache_create(&plain, &pc), 0);
    assert_int_equal(kvt_prompt_cache_lend(pc, toks, 10, "", NULL, &hit), 0);
    assert_null(hit.entry.caches);
    assert_int_equal(kvt_prompt_cache_put_hit(pc, &hit, toks, 10, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "lends no caches"));
    kvt_prompt_cache_destroy(pc);

    /* a failing recipe fails the take, lending nothing; a bad n_layers is refused */
    kvt_prompt_cache_config failing = {.max_bytes = 1 << 20, .new_caches = fail_caches, .n_layers = L};
    assert_int_equal(kvt_prompt_cache_create(&failing, &pc), 0);
    assert_int_equal(kvt_prompt_cache_lend(pc, toks, 10, "", NULL, &hit), KVT_ENOMEM);
    assert_null(hit.entry.caches);
    kvt_prompt_cache_destroy(pc);
    kvt_prompt_cache_config bad = {.max_bytes = 1 << 20, .new_caches = new_caches};
    assert_int_equal(kvt_prompt_cache_create(&bad, &pc), KVT_EINVAL);
}

/* ---- the model described once --------------------------------------------------- */

static int hybrid_caches(void *ctx, kvt_cache **c)
{
    (void)ctx;
    int rc = kvt_kv_create(D, B, &c[0]);
    if (!rc)
        rc = kvt_rotating_create(D, 8, 0, &c[1]);
    if (!rc)
        rc = kvt_recurrent_create(64, &c[2]);
    if (!rc)
        rc = kvt_qkv_create(8, 4, B, &c[3]);
    if (rc)
        kvt_caches_destroy(c, 4);
    return rc;
}

/* layers NULL: the service reads each layer's growth off fresh caches and
 * projects exactly as with the table written by hand. */
static void test_service_layers_from_caches(void **state)
{
    (void)state;
    const kvt_service_layer by_hand[4] = {
        {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * D * 4, .block_tokens = B},
        {.growth = KVT_GROWTH_WINDOW, .bytes_per_token = 2 * D * 4, .window = 8},
        {.growth = KVT_GROWTH_FIXED, .fixed_bytes = 64},
        {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * 8 + 2 * 2 * 4, .block_tokens = B},
    };
    kvt_service_config cfg = {.n_layers = 4, .layers = by_hand, .max_positions = 1000,
                              .new_caches = hybrid_caches};
    kvt_service *hand = NULL, *derived = NULL;
    assert_int_equal(kvt_service_create(&cfg, &hand), 0);
    cfg.layers = NULL;
    assert_int_equal(kvt_service_create(&cfg, &derived), 0);
    const int64_t ns[6] = {0, 1, 7, 8, 17, 999};
    for (int i = 0; i < 6; i++)
        assert_int_equal(kvt_service_project_bytes(derived, ns[i]), kvt_service_project_bytes(hand, ns[i]));
    /* kv 32 B/token in blocks of 16, window 8 slots, 64 fixed, qkv 32 B/token */
    assert_int_equal(kvt_service_project_bytes(derived, 17), 32 * 32 + 8 * 32 + 64 + 32 * 32);
    kvt_service_destroy(hand);
    kvt_service_destroy(derived);

    kvt_service_layer l;
    assert_int_equal(kvt_service_layer_of(NULL, &l), KVT_EINVAL);
    /* the storage scheme sets the bytes a token costs (kv_dim 8: K and V) */
    const kvt_dtype kv_dt[3] = {KVT_DTYPE_F32, KVT_DTYPE_F16, KVT_DTYPE_BF16};
    const size_t kv_bpt[3] = {64, 32, 32};
    for (int i = 0; i < 3; i++) {
        kvt_cache *c;
        assert_int_equal(kvt_kv_create_dtype(8, 16, kv_dt[i], &c), 0);
        assert_int_equal(kvt_service_layer_of(c, &l), 0);
        assert_int_equal(l.growth, KVT_GROWTH_PER_TOKEN);
        assert_int_equal(l.bytes_per_token, kv_bpt[i]);
        assert_int_equal(l.block_tokens, 16);
        kvt_cache_destroy(c);
        assert_int_equal(kvt_rotating_create_dtype(8, 4, 0, kv_dt[i], 0, &c), 0);
        assert_int_equal(kvt_service_layer_of(c, &l), 0);
        assert_int_equal(l.growth, KVT_GROWTH_WINDOW);
        assert_int_equal(l.bytes_per_token, kv_bpt[i]);
        assert_int_equal(l.window, 4);
        kvt_cache_destroy(c);
    }
    kvt_cache *rq;
    assert_int_equal(kvt_rotating_create_dtype(8, 4, 0, KVT_DTYPE_I8, 4, &rq), 0);
    assert_int_equal(kvt_service_layer_of(rq, &l), 0);
    assert_int_equal(l.bytes_per_token, 2 * (8 + 2 * 4)); /* codes + one f32 scale per 4 */
    kvt_cache_destroy(rq);
    cfg.new_caches = fail_caches;
    assert_int_equal(kvt_service_create(&cfg, &derived), KVT_ENOMEM);
    assert_null(derived);
    assert_non_null(strstr(kvt_last_error(), "new_caches"));
}

/* ---- small helpers ---------------------------------------------------------------- */

static void test_block_count_and_fingerprint(void **state)
{
    (void)state;
    setup_tokens();
    kvt_cache *c[4];
    assert_int_equal(hybrid_caches(NULL, c), 0);
    assert_int_equal(kvt_kv_block_count(c[0]), 0);
    char fp_caches[KVT_STORE_FINGERPRINT_LEN], fp_recipe[KVT_STORE_FINGERPRINT_LEN];
    assert_int_equal(kvt_store_config_fingerprint(c, 4, fp_caches), 0);
    assert_int_equal(kvt_store_config_fingerprint_of(hybrid_caches, NULL, 4, fp_recipe), 0);
    assert_string_equal(fp_caches, fp_recipe);
    assert_int_equal(kvt_store_config_fingerprint_of(new_caches, NULL, L, fp_recipe), 0);
    assert_string_not_equal(fp_caches, fp_recipe);
    assert_int_equal(kvt_store_config_fingerprint_of(NULL, NULL, 4, fp_recipe), KVT_EINVAL);
    assert_int_equal(kvt_store_config_fingerprint_of(fail_caches, NULL, 4, fp_recipe), KVT_ENOMEM);
    for (int64_t t = 0; t < 33; t++) {
        float kv[8];
        for (int j = 0; j < 8; j++)
            kv[j] = (float)t;
        const void *in[2] = {kv, kv};
        assert_int_equal(kvt_cache_append(c[0], 1, in), 0);
        assert_int_equal(kvt_cache_append(c[3], 1, in), 0);
    }
    /* 33 tokens in blocks of 16: two full blocks and a tail of one token */
    assert_int_equal(kvt_kv_block_count(c[0]), 3);
    assert_int_equal(kvt_kv_block_count(c[3]), 3);
    int32_t n;
    assert_int_equal(kvt_kv_block(c[0], 2, NULL, NULL, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(kvt_kv_block(c[0], 3, NULL, NULL, &n), KVT_ERANGE);
    float kb[16 * 8], vb[16 * 8];
    assert_int_equal(kvt_qkv_read_block(c[3], 2, kb, vb, &n), 0);
    assert_int_equal(kvt_qkv_read_block(c[3], 3, kb, vb, &n), KVT_ERANGE);
    assert_int_equal(kvt_cache_trim(c[0], 32), 0);
    assert_int_equal(kvt_kv_block_count(c[0]), 2);
    assert_int_equal(kvt_kv_block_count(c[1]), 0); /* not a kv kind */
    assert_int_equal(kvt_kv_block_count(NULL), 0);
    kvt_caches_destroy(c, 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_publish_stack_array_snapshot),
        cmocka_unit_test(test_state_arrays_custom_allocator),
        cmocka_unit_test(test_destroy_hands_everything_to_the_store),
        cmocka_unit_test(test_put_hit_and_fresh_miss),
        cmocka_unit_test(test_service_layers_from_caches),
        cmocka_unit_test(test_block_count_and_fingerprint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
