/*
 * test_net_faults.c: every network call of a remote-tier workload failed in
 * turn through the library's I/O shim (src/base/io_shim.c, which every
 * connect, send and receive of the remote tier's hiredis connections goes
 * through, src/remote/conn.c), against a real redis-server on loopback.
 * The workload: open the tier, store three entries (one extends another:
 * shared blocks; one has a recurrent layer and an attachment), then look
 * each up by a prompt that extends it and restore it. For each N over every
 * network call the workload makes, for each fault (connection reset, a
 * timeout, a send cut in half), the N-th call fails; then:
 *   - every call returned 0 or an error with a message, nothing crashed;
 *   - every restore that succeeded gave exactly the bytes a cache-off
 *     prefill computes for the tokens it covers;
 *   - without faults, on a new tier over the same Redis: no record is
 *     refused as bad, whatever is found restores to exactly those bytes, and
 *     storing the workload again makes every entry restorable.
 * Also Redis unreachable on every call (path match on the peer): every
 * store fails cleanly and every lookup misses.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "internal.h"
#include "io_shim.h"
#include "pc_util.h"
#include "redis_util.h"
#include "store_util.h"

#include "kvtier/remote.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const store_cfg CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};
static const store_cfg CFG_HYB = {.n_kv = 1, .kv_dim = 8, .block = 4, .recurrent = 24, .attach = 9};

/* Each layout is its own model (identity): the remote tier learns one block
 * layout per identity. */
typedef struct wl_entry {
    int32_t base;
    int64_t n;
    const store_cfg *cfg;
    int model; /* 0: CFG's tier, 1: CFG_HYB's */
} wl_entry;

static const wl_entry WL[] = {
    {1, 10, &CFG, 0},      /* two blocks and a tail */
    {1, 17, &CFG, 0},      /* extends it: its blocks are already there */
    {900, 6, &CFG_HYB, 1}, /* untrimmable, with an attachment */
};
#define N_WL ((int)(sizeof WL / sizeof WL[0]))

static redis_srv g_srv;
static kvt_store_identity g_id[2];
static char g_fp[2][KVT_STORE_FINGERPRINT_LEN];

typedef struct outcome {
    int stored, store_failed, restored, restore_failed, missed;
    int bad; /* a violation (printed) */
} outcome;

/* The two models' tiers. */
static void open_tiers(kvt_remote **r)
{
    kvt_remote_options o = {.lookup_timeout_ms = 500, .io_timeout_ms = 500, .quiet = 1};
    for (int m = 0; m < 2; m++) {
        r[m] = NULL;
        assert_int_equal(kvt_remote_open(g_srv.url, &g_id[m], &o, &r[m]), 0);
    }
}

/* Bad records both tiers saw. */
static uint64_t bad_records(kvt_remote **r)
{
    uint64_t n = 0;
    for (int m = 0; m < 2; m++) {
        kvt_remote_stats st;
        assert_int_equal(kvt_remote_stats_get(r[m], &st), 0);
        n += st.bad_records;
    }
    return n;
}

static void close_tiers(kvt_remote **r)
{
    for (int m = 0; m < 2; m++)
        kvt_remote_close(r[m]);
}

static void store_all(kvt_remote **r, outcome *o)
{
    for (int i = 0; i < N_WL; i++) {
        kvt_cold_tier t;
        kvt_remote_cold_tier(r[WL[i].model], &t);
        int32_t tok[32];
        pcu_seq(tok, WL[i].n, WL[i].base);
        kvt_entry e;
        assert_int_equal(store_make_entry(WL[i].cfg, "", tok, WL[i].n, &e), 0);
        kvt__clear_error();
        int rc = t.store(t.self, &e);
        if (rc) {
            o->store_failed++;
            if (!kvt_last_error()[0]) {
                fprintf(stderr, "  store %d failed (%d) without a message\n", i, rc);
                o->bad++;
            }
        } else {
            o->stored++;
        }
        kvt_entry_clear(&e);
    }
}

/* Looks every entry up by a prompt one token longer and restores what is
 * found: it must be exactly the cache-off state of the tokens it holds. */
static void restore_all(kvt_remote **r, outcome *o)
{
    for (int i = 0; i < N_WL; i++) {
        kvt_cold_tier t;
        kvt_remote_cold_tier(r[WL[i].model], &t);
        int32_t tok[32]; /* every stored entry is a run of this sequence */
        pcu_seq(tok, 32, WL[i].base);
        kvt_cold_hit hit = {0};
        if (t.find(t.self, tok, WL[i].n + 1, "", &hit)) {
            o->missed++;
            continue;
        }
        if (hit.prefix_len < 1 || hit.prefix_len > WL[i].n || hit.n_tokens < hit.prefix_len) {
            fprintf(stderr, "  entry %d: a hit of %lld (%lld tokens) for a prompt of %lld\n", i,
                    (long long)hit.prefix_len, (long long)hit.n_tokens, (long long)WL[i].n + 1);
            o->bad++;
            continue;
        }
        kvt_entry got, want;
        kvt__clear_error();
        int rc = t.restore(t.self, hit.handle, &got);
        if (rc) {
            if (getenv("KVT_TEST_VERBOSE"))
                fprintf(stderr, "  restore %d (hit %lld of %lld tokens) failed: %s\n", i, (long long)hit.prefix_len,
                        (long long)hit.n_tokens, kvt_last_error());
            o->restore_failed++;
            if (!kvt_last_error()[0] || got.caches) {
                fprintf(stderr, "  restore %d failed (%d) without a message or with state left\n", i, rc);
                o->bad++;
            }
            continue;
        }
        /* the entry found may be another one the workload stored (sharing a prefix) */
        assert_int_equal(store_make_entry(WL[i].cfg, "", tok, got.n_tokens, &want), 0);
        if (got.n_tokens != hit.n_tokens || store_entry_diff(&got, &want)) {
            fprintf(stderr, "  entry %d restored with other bytes (%lld tokens)\n", i, (long long)got.n_tokens);
            o->bad++;
        }
        o->restored++;
        kvt_entry_clear(&got);
        kvt_entry_clear(&want);
    }
}

static void workload(outcome *o)
{
    memset(o, 0, sizeof *o);
    kvt_remote *r[2];
    open_tiers(r);
    store_all(r, o);
    restore_all(r, o);
    uint64_t bad = bad_records(r);
    if (bad) { /* a fault made a good record look bad (and deleted it) */
        fprintf(stderr, "  %llu record(s) refused as bad under the fault\n", (unsigned long long)bad);
        o->bad++;
    }
    close_tiers(r);
}

/* Without faults, on a new tier: no bad record, what is found restores,
 * and the workload stored again restores whole. */
static void check_clean(outcome *o)
{
    kvt_remote *r[2];
    open_tiers(r);
    outcome c;
    memset(&c, 0, sizeof c);
    restore_all(r, &c);
    uint64_t bad = bad_records(r);
    if (bad) {
        fprintf(stderr, "  %llu bad record(s) left in Redis\n", (unsigned long long)bad);
        o->bad++;
    }
    if (c.restore_failed) {
        fprintf(stderr, "  %d entry(ies) found but not restorable\n", c.restore_failed);
        o->bad++;
    }
    memset(&c, 0, sizeof c);
    store_all(r, &c);
    restore_all(r, &c);
    if (c.store_failed || c.restored != N_WL) {
        fprintf(stderr, "  after the fault: %d store failure(s), %d of %d restored\n", c.store_failed, c.restored,
                N_WL);
        o->bad++;
    }
    o->bad += c.bad;
    close_tiers(r);
}

static void flushall(void) { assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "FLUSHALL"), 0); }

typedef struct walk_fig {
    int64_t calls, walked, ok, failed_cleanly;
} walk_fig;

static void walk(const char *what, int err, int short_write, walk_fig *w)
{
    memset(w, 0, sizeof *w);
    int bad = 0;
    for (int64_t n = 1;; n++) {
        flushall();
        kvt__io_fault f = {.ops = KVT_IO_NET_OPS, .fail_at = n, .err = err, .short_write = short_write};
        kvt__io_arm(&f);
        outcome o;
        workload(&o);
        kvt__io_disarm();
        int64_t calls = kvt__io_calls(), failed = kvt__io_failures();
        if (failed == 0) { /* fewer than n calls: the walk is over */
            w->calls = calls;
            assert_int_equal(o.bad, 0);
            assert_int_equal(o.store_failed, 0);
            assert_int_equal(o.restored, N_WL);
            break;
        }
        w->walked++;
        check_clean(&o);
        if (!o.store_failed && !o.restore_failed && !o.missed)
            w->ok++;
        else
            w->failed_cleanly++;
        if (o.bad) {
            fprintf(stderr, "%s: network call %lld failed: %d violation(s) (stored %d, store failures %d, restored %d, "
                    "restore failures %d, misses %d)\n",
                    what, (long long)n, o.bad, o.stored, o.store_failed, o.restored, o.restore_failed, o.missed);
            bad++;
        }
        assert_true(n < 10000);
    }
    printf("  %-12s %4lld network calls in the workload, each failed in turn: %4lld runs succeeded anyway, %4lld "
           "failed cleanly\n",
           what, (long long)w->calls, (long long)w->ok, (long long)w->failed_cleanly);
    assert_int_equal(bad, 0);
    assert_int_equal(w->walked, w->calls);
    assert_true(w->calls >= 10);
}

static void walk_reset(void **state)
{
    (void)state;
    walk_fig w;
    walk("ECONNRESET", ECONNRESET, 0, &w);
    assert_true(w.failed_cleanly > 0);
}

static void walk_timeout(void **state)
{
    (void)state;
    walk_fig w;
    walk("timeout", EAGAIN, 0, &w); /* what a socket read or write past its timeout reports */
}

static void walk_half_sent(void **state)
{
    (void)state;
    walk_fig w;
    walk("half sent", EPIPE, 1, &w);
}

/* Redis unreachable on every call: stores fail with a message, lookups miss. */
static void unreachable(void **state)
{
    (void)state;
    flushall();
    char peer[64];
    snprintf(peer, sizeof peer, "127.0.0.1:%d", g_srv.port);
    kvt__io_fault f = {.ops = KVT_IO_NET_OPS, .path_has = peer, .err = ECONNREFUSED};
    kvt__io_arm(&f);
    outcome o;
    workload(&o);
    kvt__io_disarm();
    assert_true(kvt__io_failures() > 0);
    assert_int_equal(o.bad, 0);
    assert_int_equal(o.stored, 0);
    assert_int_equal(o.store_failed, N_WL);
    assert_int_equal(o.missed, N_WL);
    check_clean(&o);
    assert_int_equal(o.bad, 0);
}

int main(void)
{
    if (!redis_available("test_net_faults"))
        return 0;
    if (redis_start(&g_srv, 64, NULL)) {
        fprintf(stderr, "test_net_faults: cannot start redis-server\n");
        return 1;
    }
    store_identity(&CFG, "model-net", g_fp[0], &g_id[0]);
    store_identity(&CFG_HYB, "model-net-hybrid", g_fp[1], &g_id[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(walk_reset),
        cmocka_unit_test(walk_timeout),
        cmocka_unit_test(walk_half_sent),
        cmocka_unit_test(unreachable),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    redis_stop(&g_srv);
    return failed ? 1 : 0;
}
