/*
 * test_store_index.c: the SSD tier's in-memory index (src/base/index.c, the
 * radix tree the RAM tier uses too, and hmap.h's key maps):
 *  - superseding has no cap: a trimmable entry drops every strict same-ns
 *    prefix of it, 300 of them here (the store's own tree used to collect at
 *    most 256 ancestors and leave the rest silently);
 *  - two queued writes of the same (ns, tokens) both stay findable and
 *    restorable from the queue, and leave the pending index empty once done;
 *  - the longest-prefix rules through find, with siblings and a divergent
 *    prompt, match the RAM tier's rules (the same tree answers both).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "store_util.h"

#include "kvtier/store.h"

#include <stdio.h>
#include <string.h>

static const store_cfg KV = {.n_kv = 1, .kv_dim = 4, .block = 64};

static int no_fsync(void *ctx, int fd)
{
    (void)ctx;
    (void)fd;
    return 0; /* many small puts: durability is not what this file tests */
}

typedef struct fx {
    char root[512];
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    kvt_store_io io;
    kvt_store *s;
} fx;

static void fx_open(fx *f, const char *tag, const kvt_store_io *io)
{
    memset(f, 0, sizeof *f);
    store_tmpdir(f->root, sizeof f->root, tag);
    assert_true(f->root[0] != '\0');
    store_identity(&KV, "model-index", f->fp, &f->id);
    f->io = io ? *io : (kvt_store_io){.fsync_fn = no_fsync};
    kvt_store_options o = {.io = &f->io};
    assert_int_equal(kvt_store_open(f->root, &f->id, &o, &f->s), 0);
}

static void fx_close(fx *f)
{
    assert_int_equal(kvt_store_close(f->s), 0);
    store_rmtree(f->root);
}

static void put(kvt_store *s, const int32_t *t, int64_t n)
{
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", t, n, &e), 0);
    int rc = kvt_store_put(s, &e);
    if (rc)
        fprintf(stderr, "put: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    kvt_entry_clear(&e);
}

static void seq(int32_t *t, int n, int32_t base)
{
    for (int i = 0; i < n; i++)
        t[i] = base + i;
}

/* 300 strict prefixes of one prompt, then the prompt: all 300 superseded */
static void supersede_has_no_cap(void **state)
{
    (void)state;
    fx f;
    fx_open(&f, "index-sup", NULL);
    enum { N = 300 };
    int32_t t[N + 2];
    seq(t, N + 2, 1000);
    for (int n = N; n >= 1; n--) /* longest first: no put supersedes another */
        put(f.s, t, n);
    kvt_store_stats st;
    kvt_store_get_stats(f.s, &st);
    assert_int_equal(st.entries, N);
    assert_int_equal(st.superseded, 0);
    put(f.s, t, N + 1);
    kvt_store_get_stats(f.s, &st);
    print_message("superseded %llu of %d prefixes\n", (unsigned long long)st.superseded, N);
    assert_int_equal(st.superseded, N);
    assert_int_equal(st.entries, 1);
    kvt_cold_hit h;
    assert_int_equal(kvt_store_find(f.s, t, 20, "", &h), 0);
    assert_int_equal(h.prefix_len, 19);
    assert_int_equal(h.n_tokens, N + 1);
    assert_int_equal(kvt_store_find_exact(f.s, t, N, "", &h), KVT_ENOTFOUND);
    fx_close(&f);
}

/* The fault gate a case closed, opened by gate_teardown when an assertion
 * failed while the writer was held (else that writer waits forever and every
 * later case's writes queue behind it on the shared I/O worker: the program
 * hangs instead of failing). The gated case keeps its fault layer static, so
 * it outlives the case's stack. */
static store_faults *g_gate;

static int gate_teardown(void **state)
{
    (void)state;
    if (g_gate)
        store_faults_gate(g_gate, 0);
    g_gate = NULL;
    return 0;
}

/* two queued writes of the same tokens: findable and restorable while
 * queued, nothing pending once both are written */
static void twin_pending_writes(void **state)
{
    (void)state;
    static fx f; /* the store reads f.io from its writer: it must outlive a failed case too */
    static store_faults flt;
    static kvt_store_io io;
    store_faults_init(&flt, &io);
    g_gate = &flt;
    store_faults_gate(&flt, 1); /* the writer blocks on its first pwrite */
    fx_open(&f, "index-twin", &io);
    int32_t t[24];
    seq(t, 24, 77);
    kvt_entry e;
    for (int i = 0; i < 2; i++) {
        assert_int_equal(store_make_entry(&KV, "", t, 16, &e), 0);
        assert_int_equal(kvt_store_put_async(f.s, &e), 0);
    }
    store_faults_wait_blocked(&flt, 1);
    assert_int_equal(kvt_store_pending(f.s, t, 16, ""), 1);
    kvt_cold_hit h, hx;
    assert_int_equal(kvt_store_find(f.s, t, 24, "", &h), 0);
    assert_int_equal(h.prefix_len, 16);
    assert_int_equal(kvt_store_find_exact(f.s, t, 16, "", &hx), 0);
    assert_int_equal(hx.handle, h.handle);
    kvt_entry got, want;
    assert_int_equal(kvt_store_restore(f.s, h.handle, t, 24, &got), 0);
    assert_int_equal(store_make_entry(&KV, "", t, 16, &want), 0);
    assert_int_equal(store_entry_diff(&want, &got), 0);
    kvt_entry_clear(&got);
    store_faults_gate(&flt, 0);
    assert_int_equal(kvt_store_flush(f.s), 0);
    assert_int_equal(kvt_store_pending(f.s, t, 16, ""), 0);
    assert_int_equal(kvt_store_find(f.s, t, 24, "", &h), 0);
    assert_int_equal(h.n_tokens, 16);
    assert_int_equal(kvt_store_restore(f.s, h.handle, t, 24, &got), 0);
    assert_int_equal(store_entry_diff(&want, &got), 0);
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
    kvt_store_stats st;
    kvt_store_get_stats(f.s, &st);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.pending, 0);
    g_gate = NULL;
    fx_close(&f);
}

/* siblings and a divergent prompt: the longest usable prefix wins; an
 * equal-length tie goes to the entry ending exactly there */
static void longest_among_siblings(void **state)
{
    (void)state;
    fx f;
    fx_open(&f, "index-sib", NULL);
    int32_t a[32], b[32];
    seq(a, 32, 5000);
    memcpy(b, a, sizeof b);
    b[12] = -7; /* b diverges from a at 12 */
    put(f.s, a, 20);
    put(f.s, b, 28);
    put(f.s, a, 12);
    kvt_cold_hit h;
    assert_int_equal(kvt_store_find(f.s, b, 32, "", &h), 0);
    assert_int_equal(h.prefix_len, 28);
    assert_int_equal(h.n_tokens, 28);
    assert_int_equal(kvt_store_find(f.s, a, 32, "", &h), 0);
    assert_int_equal(h.prefix_len, 20);
    int32_t c[32];
    memcpy(c, a, sizeof c);
    c[12] = -9; /* diverges from both at 12: the 12-token entry ends there */
    assert_int_equal(kvt_store_find(f.s, c, 32, "", &h), 0);
    assert_int_equal(h.prefix_len, 12);
    assert_int_equal(h.n_tokens, 12);
    assert_int_equal(kvt_store_find(f.s, c, 32, "other", &h), KVT_ENOTFOUND);
    fx_close(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(supersede_has_no_cap),
        cmocka_unit_test_teardown(twin_pending_writes, gate_teardown),
        cmocka_unit_test(longest_among_siblings),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
