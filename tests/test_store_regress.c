/*
 * test_store_regress.c: two budget/cleanup cases of the SSD tier.
 *  - A block refused at restore (checksum) leaves no entry file on disk that
 *    references it: the store verifies clean afterwards, also after a reopen;
 *    an entry file whose block is gone (removed behind the store's back) is
 *    garbage that kvt_store_gc removes under any budget, and that the budget
 *    of an open store removes.
 *  - A budget smaller than one entry with its blocks keeps the entries that
 *    fit instead of evicting everything to make room for the one that never
 *    fits (which is not kept, and does not supersede its shorter prefixes).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "pc_util.h"
#include "store_util.h"

#include "kvtier/cache.h"
#include "kvtier/store.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* 512-byte blocks: their headers are larger than their payloads */
static const store_cfg SMALL = {.n_kv = 2, .kv_dim = 8, .block = 4};

typedef struct fx {
    char root[512];
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
} fx;

static void fx_init(fx *f, const char *tag)
{
    store_tmpdir(f->root, sizeof f->root, tag);
    assert_true(f->root[0] != '\0');
    store_identity(&SMALL, "model-r", f->fp, &f->id);
}

static kvt_store *fx_open(fx *f, uint64_t max_bytes)
{
    kvt_store_options o = {.max_bytes = max_bytes};
    kvt_store *s = NULL;
    int rc = kvt_store_open(f->root, &f->id, &o, &s);
    if (rc)
        fprintf(stderr, "open: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    return s;
}

static void put_tokens(kvt_store *s, const int32_t *t, int64_t n)
{
    kvt_entry e;
    assert_int_equal(store_make_entry(&SMALL, "", t, n, &e), 0);
    int rc = kvt_store_put(s, &e);
    if (rc)
        fprintf(stderr, "put: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    kvt_entry_clear(&e);
}

static int restore_exact(kvt_store *s, const int32_t *t, int64_t n)
{
    kvt_cold_hit hit;
    int rc = kvt_store_find_exact(s, t, n, "", &hit);
    if (rc)
        return rc;
    kvt_entry got;
    rc = kvt_store_restore(s, hit.handle, t, n, &got);
    if (!rc)
        kvt_entry_clear(&got);
    return rc;
}

typedef struct walk_acc {
    int shards, refused, missing_block;
} walk_acc;

static int walk_cb(void *ctx, const kvt_store_shard_info *in)
{
    walk_acc *a = ctx;
    if (in->type != 'e' && in->type != 'b')
        return 0;
    a->shards++;
    if (in->status) {
        a->refused++;
        a->missing_block += in->status == KVT_STORE_REFUSED_MISSING_BLOCK + 1;
        fprintf(stderr, "refused: %s (%s)\n", in->file, kvt_store_refusal_name((kvt_store_refusal)(in->status - 1)));
    }
    return 0;
}

/* `kvtier store verify`: every shard through the restore's own checks. */
static walk_acc verify_root(const char *root)
{
    walk_acc a = {0};
    assert_int_equal(kvt_store_walk(root, 1, walk_cb, &a), 0);
    return a;
}

static uint64_t dir_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    uint64_t n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        char p[2048];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if ((de->d_name[0] == 'e' || de->d_name[0] == 'b') && !stat(p, &st))
            n += (uint64_t)st.st_size;
    }
    closedir(d);
    return n;
}

/* Three entries over disjoint block chains (4 full blocks each). */
static void three_entries(int32_t t[3][16])
{
    for (int k = 0; k < 3; k++)
        pcu_seq(t[k], 16, 100 + 17 * k);
}

/* A block payload flipped: the restore refuses it and, before anything else
 * happens, no entry file over it is left; verify is clean now and after a
 * reopen; the other entries still restore. */
static void corrupt_block_leaves_no_broken_entry(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, "regress-corrupt");
    int32_t t[3][16];
    three_entries(t);
    kvt_store *s = fx_open(&f, 0);
    for (int k = 0; k < 3; k++)
        put_tokens(s, t[k], 16);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(store_count_files(dir, "e"), 3);
    assert_int_equal(store_count_files(dir, "b"), 12);
    walk_acc a = verify_root(f.root);
    assert_int_equal(a.refused, 0);

    /* one payload byte of one block shard */
    char bname[256], path[1400];
    assert_int_equal(store_first_file(dir, "b", bname, sizeof bname), 0);
    snprintf(path, sizeof path, "%s/%s", dir, bname);
    assert_int_equal(store_flip_byte(path, 1, 0x10), 0);

    s = fx_open(&f, 0);
    int corrupt = -1;
    for (int k = 0; k < 3; k++) {
        int rc = restore_exact(s, t[k], 16);
        if (rc == KVT_ECORRUPT) {
            assert_int_equal(corrupt, -1);
            corrupt = k;
        } else {
            assert_int_equal(rc, 0);
        }
    }
    assert_true(corrupt >= 0);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 1);
    assert_int_equal(st.entries, 2);
    /* while the store is still open: the entry file over the bad block is gone */
    assert_int_equal(store_count_files(dir, "e"), 2);
    a = verify_root(f.root);
    assert_int_equal(a.refused, 0);
    assert_int_equal(kvt_store_close(s), 0);

    a = verify_root(f.root);
    assert_int_equal(a.refused, 0);
    assert_int_equal(a.missing_block, 0);
    assert_int_equal(store_count_files(dir, "e"), 2);
    s = fx_open(&f, 0);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_MISSING_BLOCK], 0);
    assert_int_equal(st.entries, 2);
    for (int k = 0; k < 3; k++)
        assert_int_equal(restore_exact(s, t[k], 16), k == corrupt ? KVT_ENOTFOUND : 0);
    /* the refused prefix written again restores */
    put_tokens(s, t[corrupt], 16);
    assert_int_equal(restore_exact(s, t[corrupt], 16), 0);
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(verify_root(f.root).refused, 0);
    store_rmtree(f.root);
}

/* Removes one block of entry t0's chain behind the store's back (what the
 * old code left after a refused block). */
static void make_broken(fx *f, int32_t t[3][16], char *dir, size_t cap)
{
    kvt_store *s = fx_open(f, 0);
    for (int k = 0; k < 3; k++)
        put_tokens(s, t[k], 16);
    snprintf(dir, cap, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    /* the blocks of t[0] alone: a store holding only t[0] */
    fx g;
    fx_init(&g, "regress-probe");
    s = fx_open(&g, 0);
    put_tokens(s, t[0], 16);
    char gdir[1024];
    snprintf(gdir, sizeof gdir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    char bname[256], path[1400];
    assert_int_equal(store_first_file(gdir, "b", bname, sizeof bname), 0);
    snprintf(path, sizeof path, "%s/%s", dir, bname);
    assert_int_equal(unlink(path), 0);
    store_rmtree(g.root);
    walk_acc a = verify_root(f->root);
    assert_int_equal(a.refused, 1);
    assert_int_equal(a.missing_block, 1);
}

/* kvt_store_gc removes a broken entry file even far under the budget. */
static void gc_removes_broken_entry(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, "regress-gc");
    int32_t t[3][16];
    three_entries(t);
    char dir[1024];
    make_broken(&f, t, dir, sizeof dir);
    uint64_t freed = 0;
    assert_int_equal(kvt_store_gc(f.root, 10ull << 30, &freed), 0);
    assert_true(freed > 0);
    walk_acc a = verify_root(f.root);
    assert_int_equal(a.refused, 0);
    assert_int_equal(store_count_files(dir, "e"), 2);
    kvt_store *s = fx_open(&f, 0);
    assert_int_equal(restore_exact(s, t[1], 16), 0);
    assert_int_equal(restore_exact(s, t[2], 16), 0);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* An open store (no budget) removes a broken entry file it found at open. */
static void open_store_removes_broken_entry(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, "regress-open");
    int32_t t[3][16];
    three_entries(t);
    char dir[1024];
    make_broken(&f, t, dir, sizeof dir);
    kvt_store *s = fx_open(&f, 0);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_MISSING_BLOCK], 1);
    assert_int_equal(st.entries, 2);
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(verify_root(f.root).refused, 0);
    assert_int_equal(store_count_files(dir, "e"), 2);
    store_rmtree(f.root);
}

/* A budget smaller than one entry with its blocks: the entries that fit
 * stay, the one that can never fit is not kept. */
static void budget_keeps_what_fits(void **state)
{
    (void)state;
    int32_t a[12], b[12], big[40];
    pcu_seq(a, 12, 5);
    memcpy(b, a, sizeof b);
    b[8] = 4000; /* shares a's first two blocks */
    pcu_seq(big, 40, 9000);
    /* measure: the small pair, and the big entry alone */
    fx m;
    fx_init(&m, "regress-measure");
    kvt_store *s = fx_open(&m, 0);
    put_tokens(s, a, 12);
    put_tokens(s, b, 12);
    uint64_t small = dir_bytes(kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(m.root);
    fx_init(&m, "regress-measure2");
    s = fx_open(&m, 0);
    put_tokens(s, big, 40);
    uint64_t big_bytes = dir_bytes(kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(m.root);
    kvt_entry e;
    assert_int_equal(store_make_entry(&SMALL, "", big, 40, &e), 0);
    uint64_t big_state = 0;
    for (int32_t l = 0; l < e.n_caches; l++)
        big_state += kvt_cache_bytes(e.caches[l]);
    kvt_entry_clear(&e);
    uint64_t max = small + 1024;
    fprintf(stderr, "small pair %llu B, big entry %llu B (state %llu B), budget %llu B\n",
            (unsigned long long)small, (unsigned long long)big_bytes, (unsigned long long)big_state,
            (unsigned long long)max);
    assert_true(big_bytes > max);  /* the big one alone never fits */
    assert_true(big_state <= max); /* but its state is not refused up front */

    fx f;
    fx_init(&f, "regress-budget");
    s = fx_open(&f, max);
    put_tokens(s, a, 12);
    put_tokens(s, b, 12);
    put_tokens(s, big, 40);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_contains(s, a, 12, ""), 1);
    assert_int_equal(kvt_store_contains(s, b, 12, ""), 1);
    assert_int_equal(kvt_store_contains(s, big, 40, ""), 0);
    assert_int_equal(kvt_store_close(s), 0);
    assert_true(dir_bytes(dir) <= max);
    assert_int_equal(store_count_files(dir, "e"), 2);
    s = fx_open(&f, max);
    assert_int_equal(restore_exact(s, a, 12), 0);
    assert_int_equal(restore_exact(s, b, 12), 0);
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(verify_root(f.root).refused, 0);
    store_rmtree(f.root);
}

/* The same budget, the big entry extending a kept one (a trimmable entry
 * supersedes its strict prefixes): the prefix that fits stays. */
static void budget_keeps_prefix_of_too_big(void **state)
{
    (void)state;
    int32_t a[12], big[40];
    pcu_seq(big, 40, 5);
    memcpy(a, big, sizeof a);
    fx m;
    fx_init(&m, "regress-measure3");
    kvt_store *s = fx_open(&m, 0);
    put_tokens(s, a, 12);
    uint64_t small = dir_bytes(kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(m.root);
    uint64_t max = 2 * small;

    fx f;
    fx_init(&f, "regress-budget2");
    s = fx_open(&f, max);
    put_tokens(s, a, 12);
    put_tokens(s, big, 40);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_contains(s, big, 40, ""), 0);
    assert_int_equal(kvt_store_contains(s, a, 12, ""), 1);
    assert_int_equal(kvt_store_close(s), 0);
    assert_true(dir_bytes(dir) <= max);
    s = fx_open(&f, max);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find(s, big, 40, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 12);
    assert_int_equal(restore_exact(s, a, 12), 0);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(corrupt_block_leaves_no_broken_entry),
        cmocka_unit_test(gc_removes_broken_entry),
        cmocka_unit_test(open_store_removes_broken_entry),
        cmocka_unit_test(budget_keeps_what_fits),
        cmocka_unit_test(budget_keeps_prefix_of_too_big),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
