/*
 * test_store_gaps.c: SSD-tier rules that a `make mutate` run showed no test
 * could see (tools/mutate/mutations.txt S25, S32):
 *   - a new entry supersedes in the store only the prefixes it can be cut
 *     back to: an entry whose layers reach back only part of the way (a
 *     backend kind with range [offset - 4, offset]) keeps shorter ancestors;
 *   - a block shard whose header names another namespace than the entry
 *     that references it is refused at restore and at the scan (S32 turned
 *     out equivalent: the block key, recomputed from the header's ns,
 *     parent and tokens, already covers the ns; this shows the refusal).
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
#include <stdlib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a backend kind that can be cut back by at most 4 tokens ------------------------- */

typedef struct tail4 {
    kvt_cache base;
    int64_t offset;
} tail4;

static const kvt_cache_ops t4_ops;

static kvt_cache *t4_new(int64_t offset)
{
    tail4 *t = calloc(1, sizeof *t);
    assert_non_null(t);
    t->base.ops = &t4_ops;
    t->offset = offset;
    return &t->base;
}
static size_t t4_private(const kvt_cache *c)
{
    (void)c;
    return sizeof(tail4);
}
static void t4_foreach(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx)
{
    (void)c;
    (void)fn;
    (void)ctx;
}
static void t4_range(const kvt_cache *c, int64_t *lo, int64_t *off)
{
    *off = ((const tail4 *)c)->offset;
    *lo = *off > 4 ? *off - 4 : 0;
}
static int t4_trim(kvt_cache *c, int64_t n)
{
    int64_t lo, off;
    t4_range(c, &lo, &off);
    if (n < lo || n > off)
        return KVT_ERANGE;
    ((tail4 *)c)->offset = n;
    return 0;
}
static int t4_clone(const kvt_cache *c, kvt_cache **out)
{
    *out = t4_new(((const tail4 *)c)->offset);
    return 0;
}
static int t4_append(kvt_cache *c, int64_t n, const void *const *in)
{
    (void)in;
    ((tail4 *)c)->offset += n;
    return 0;
}
static void t4_destroy(kvt_cache *c) { free(c); }
static int t4_encode(const kvt_cache *c, kvt_cache_state *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->kind, sizeof out->kind, "test.tail4");
    t4_range(c, &out->min_offset, &out->offset);
    return 0;
}
static int t4_decode(const kvt_cache_state *st, kvt_cache **out)
{
    *out = t4_new(st->offset);
    return 0;
}
static const kvt_cache_ops t4_ops = {"test.tail4", t4_private, t4_foreach, t4_range, t4_trim,
                                     t4_clone,     t4_append,  t4_destroy, t4_encode, t4_decode};

typedef struct fx {
    char root[512];
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
} fx;

static const store_cfg SMALL = {.n_kv = 2, .kv_dim = 8, .block = 4};

static kvt_store *fx_open(fx *f)
{
    kvt_store *s = NULL;
    int rc = kvt_store_open(f->root, &f->id, NULL, &s);
    if (rc)
        fprintf(stderr, "open: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    return s;
}

static void put_tail4(kvt_store *s, const int32_t *t, int64_t n)
{
    kvt_entry e;
    assert_int_equal(kvt_entry_init(&e, "", t, n, 1, 0), 0);
    e.caches[0] = t4_new(n);
    assert_int_equal(kvt_store_put(s, &e), 0);
    kvt_entry_clear(&e);
}

static int has_exact(kvt_store *s, const int32_t *t, int64_t n)
{
    kvt_cold_hit h;
    return kvt_store_find_exact(s, t, n, "", &h) == 0;
}

/* 3.5 / 4: supersede only what the new entry can be cut back to */
static void supersede_only_within_reach(void **state)
{
    (void)state;
    int rc = kvt_cache_register_kind(&t4_ops);
    assert_true(rc == 0 || rc == KVT_EBUSY);
    fx f;
    store_tmpdir(f.root, sizeof f.root, "gaps-reach");
    store_identity(&SMALL, "model-gaps", f.fp, &f.id);
    kvt_store *s = fx_open(&f);
    int32_t t[16];
    pcu_seq(t, 16, 1);
    put_tail4(s, t, 3);
    put_tail4(s, t, 7); /* reach 3: it serves 3, which is superseded */
    assert_false(has_exact(s, t, 3));
    put_tail4(s, t, 12); /* reach 8: it cannot serve 7, which stays */
    assert_true(has_exact(s, t, 7));
    assert_true(has_exact(s, t, 12));
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.superseded, 1);
    /* and after a reopen the 7-token entry restores */
    assert_int_equal(kvt_store_close(s), 0);
    s = fx_open(&f);
    kvt_cold_hit h;
    assert_int_equal(kvt_store_find_exact(s, t, 7, "", &h), 0);
    kvt_entry got;
    assert_int_equal(kvt_store_restore(s, h.handle, t, 7, &got), 0);
    assert_int_equal(kvt_cache_offset(got.caches[0]), 7);
    kvt_entry_clear(&got);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* Replaces `from` by `to` (same length) in the header of the shard at path. */
static int edit_header(const char *path, const char *from, const char *to)
{
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    uint8_t lb[8];
    assert_int_equal(fread(lb, 1, 8, fp), 8);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)lb[i] << (8 * i);
    char *h = calloc(1, hlen + 1);
    assert_non_null(h);
    assert_int_equal(fread(h, 1, hlen, fp), hlen);
    char *at = strstr(h, from);
    int found = at != NULL;
    if (at) {
        assert_int_equal(strlen(from), strlen(to));
        fseek(fp, (long)(8 + (at - h)), SEEK_SET);
        assert_int_equal(fwrite(to, 1, strlen(to), fp), strlen(to));
    }
    free(h);
    assert_int_equal(fclose(fp), 0);
    return found;
}

/* 4: a block shard must match the entry's ns before its bytes are used.
 * The scan refuses such a block at open; this one is edited after the scan
 * (another process sharing the root rewrote it), so only restore's own
 * check of each block header against the entry can see it. */
static void block_of_another_ns_refused(void **state)
{
    (void)state;
    fx f;
    store_tmpdir(f.root, sizeof f.root, "gaps-ns");
    store_identity(&SMALL, "model-gaps", f.fp, &f.id);
    kvt_store *s = fx_open(&f);
    int32_t t[20];
    pcu_seq(t, 20, 1);
    kvt_entry e;
    assert_int_equal(store_make_entry(&SMALL, "lora:a", t, 18, &e), 0);
    assert_int_equal(kvt_store_put(s, &e), 0);
    kvt_entry_clear(&e);
    kvt_cold_hit h;
    assert_int_equal(kvt_store_find_exact(s, t, 18, "lora:a", &h), 0);
    /* every block shard now says it belongs to "lora:b" (edited in place) */
    const char *dir = kvt_store_dir(s);
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    int n = 0, edited = 0;
    while ((de = readdir(d))) {
        if (de->d_name[0] != 'b')
            continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        edited += edit_header(path, "\"ns\":\"lora:a\"", "\"ns\":\"lora:b\"");
        n++;
    }
    closedir(d);
    assert_true(n >= 4);
    assert_int_equal(edited, n);
    kvt_entry got;
    int rc = kvt_store_restore(s, h.handle, t, 18, &got);
    if (rc == 0)
        kvt_entry_clear(&got);
    if (getenv("KVT_TEST_VERBOSE"))
        fprintf(stderr, "restore: %d %s\n", rc, kvt_last_error());
    assert_int_not_equal(rc, 0); /* the entry's blocks are not its own */
    assert_int_equal(kvt_store_close(s), 0);
    /* and a reopen's scan refuses them too: the entry is not offered */
    s = fx_open(&f);
    assert_int_equal(kvt_store_find_exact(s, t, 18, "lora:a", &h), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(supersede_only_within_reach),
        cmocka_unit_test(block_of_another_ns_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
