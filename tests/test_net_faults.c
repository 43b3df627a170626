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
 * store fails cleanly and every lookup misses; and, which no walk sees, one
 * failed call of a restore leaves no failed connection in the pool (the next
 * restores succeed, nothing more is counted), and a restore on a tier turned
 * unhealthy fails at once saying Redis is unreachable.
 * The runs of a walk are spread over worker processes, each with a
 * redis-server of its own (tests/support/fault_walk.h; KVT_FAULT_WORKERS,
 * default 8): every N is run and checked as one after another would.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "internal.h"
#include "fault_walk.h"
#include "io_shim.h"
#include "pc_util.h"
#include "redis_util.h"
#include "store_util.h"

#include "kvtier/remote.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* One redis-server per walk worker (each run flushes its own); g_srv[0]
 * also serves the cases outside the walks. */
#define MAX_SRV 16
static redis_srv g_srv[MAX_SRV];
static int g_n_srv;
static int g_worker; /* the walk worker of this process (its server) */
static kvt_store_identity g_id[2];
static char g_fp[2][KVT_STORE_FINGERPRINT_LEN];

typedef struct outcome {
    int stored, store_failed, restored, restore_failed, missed;
    int bad; /* a violation (printed) */
} outcome;

/* The two models' tiers (on this worker's server); a failure is a
 * violation (this runs in walk workers: no cmocka assertion). */
static int open_tiers(kvt_remote **r, outcome *o)
{
    kvt_remote_options opt = {.lookup_timeout_ms = 500, .io_timeout_ms = 500, .quiet = 1};
    for (int m = 0; m < 2; m++) {
        r[m] = NULL;
        if (kvt_remote_open(g_srv[g_worker].url, &g_id[m], &opt, &r[m])) {
            fprintf(stderr, "  cannot open the tier of model %d: %s\n", m, kvt_last_error());
            o->bad++;
            if (m)
                kvt_remote_close(r[0]);
            return -1;
        }
    }
    return 0;
}

/* Bad records both tiers saw. */
static uint64_t bad_records(kvt_remote **r, outcome *o)
{
    uint64_t n = 0;
    for (int m = 0; m < 2; m++) {
        kvt_remote_stats st;
        if (kvt_remote_stats_get(r[m], &st)) {
            fprintf(stderr, "  no stats of model %d's tier\n", m);
            o->bad++;
            continue;
        }
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
        if (store_make_entry(WL[i].cfg, "", tok, WL[i].n, &e)) {
            fprintf(stderr, "  entry %d: cannot build it\n", i);
            o->bad++;
            continue;
        }
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
        if (store_make_entry(WL[i].cfg, "", tok, got.n_tokens, &want)) {
            fprintf(stderr, "  entry %d: cannot build the expected entry\n", i);
            o->bad++;
            kvt_entry_clear(&got);
            continue;
        }
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
    if (open_tiers(r, o))
        return;
    store_all(r, o);
    restore_all(r, o);
    uint64_t bad = bad_records(r, o);
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
    if (open_tiers(r, o))
        return;
    outcome c;
    memset(&c, 0, sizeof c);
    restore_all(r, &c);
    uint64_t bad = bad_records(r, o);
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

/* Empties this worker's server: 0, or -1 with a message. */
static int flushall(void)
{
    if (redis_cmd(g_srv[g_worker].port, NULL, 0, NULL, "FLUSHALL") == 0)
        return 0;
    fprintf(stderr, "  FLUSHALL on port %d failed\n", g_srv[g_worker].port);
    return -1;
}

typedef struct walk_arg {
    int err, short_write;
    const char *what;
} walk_arg;

/* One run of a walk, in a worker process (fault_walk.h): violations are
 * counted in out->bad. v[]: stored, store failures, restored. */
static void walk_run(int64_t n, int worker, void *ctx, fw_run *out)
{
    const walk_arg *a = ctx;
    g_worker = worker;
    outcome o;
    memset(&o, 0, sizeof o);
    if (flushall()) {
        out->bad = 1;
        out->failed = -1; /* a violation (bad_runs); the walk goes on */
        return;
    }
    kvt__io_fault f = {.ops = KVT_IO_NET_OPS, .fail_at = n, .err = a->err, .short_write = a->short_write};
    kvt__io_arm(&f);
    workload(&o);
    kvt__io_disarm();
    out->calls = kvt__io_calls();
    out->failed = kvt__io_failures();
    if (out->failed) {
        check_clean(&o);
        out->ok = !o.store_failed && !o.restore_failed && !o.missed;
        if (o.bad)
            fprintf(stderr, "%s: network call %lld failed: %d violation(s) (stored %d, store failures %d, restored %d, "
                    "restore failures %d, misses %d)\n",
                    a->what, (long long)n, o.bad, o.stored, o.store_failed, o.restored, o.restore_failed, o.missed);
    }
    out->bad = o.bad;
    out->v[0] = o.stored, out->v[1] = o.store_failed, out->v[2] = o.restored;
}

/* Walks N over every network call of the workload with this fault, over
 * worker processes with a redis-server each (the same runs and checks as
 * one after another). */
static void walk(const char *what, int err, int short_write, fw_result *w)
{
    walk_arg a = {err, short_write, what};
    int rc = fault_walk(g_n_srv, 10000, walk_run, &a, w);
    printf("  %-12s %4lld network calls in the workload, each failed in turn: %4lld runs succeeded anyway, %4lld "
           "failed cleanly (%d workers)\n",
           what, (long long)w->calls, (long long)w->ok, (long long)w->failed_cleanly, g_n_srv);
    assert_int_equal(rc, 0);
    /* the fault-free run stored and restored everything */
    assert_int_equal(w->clean.v[1], 0);
    assert_int_equal(w->clean.v[2], N_WL);
    assert_int_equal(w->bad_runs, 0);
    assert_int_equal(w->walked, w->calls);
    assert_true(w->calls >= 10);
}

static void walk_reset(void **state)
{
    (void)state;
    fw_result w;
    walk("ECONNRESET", ECONNRESET, 0, &w);
    assert_true(w.failed_cleanly > 0);
}

static void walk_timeout(void **state)
{
    (void)state;
    fw_result w;
    walk("timeout", EAGAIN, 0, &w); /* what a socket read or write past its timeout reports */
}

static void walk_half_sent(void **state)
{
    (void)state;
    fw_result w;
    walk("half sent", EPIPE, 1, &w);
}

/* One tier of model 0 on g_srv[0] holding WL[0], and a hit of it. */
static kvt_remote *one_entry_tier(kvt_cold_tier *t, int32_t *tok, kvt_cold_hit *hit)
{
    g_worker = 0;
    assert_int_equal(flushall(), 0);
    kvt_remote_options opt = {.lookup_timeout_ms = 2000, .io_timeout_ms = 2000, .restore_timeout_ms = 2000,
                              .quiet = 1};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(g_srv[0].url, &g_id[0], &opt, &r), 0);
    kvt_remote_cold_tier(r, t);
    pcu_seq(tok, 32, WL[0].base);
    kvt_entry e;
    assert_int_equal(store_make_entry(WL[0].cfg, "", tok, WL[0].n, &e), 0);
    assert_int_equal(t->store(t->self, &e), 0);
    kvt_entry_clear(&e);
    assert_int_equal(t->find(t->self, tok, WL[0].n + 1, "", hit), 0);
    assert_int_equal(hit->prefix_len, WL[0].n);
    return r;
}

/* Restores hit and compares with the cache-off state: 0, or the restore's code. */
static int restore_cmp(const kvt_cold_tier *t, const kvt_cold_hit *hit, const int32_t *tok)
{
    kvt_entry got, want;
    int rc = t->restore(t->self, hit->handle, &got);
    if (rc) {
        assert_null(got.caches);
        return rc;
    }
    assert_int_equal(got.n_tokens, hit->n_tokens);
    assert_int_equal(store_make_entry(WL[0].cfg, "", tok, got.n_tokens, &want), 0);
    assert_int_equal(store_entry_diff(&got, &want), 0);
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
    return 0;
}

static kvt_remote_stats tier_stats(kvt_remote *r)
{
    kvt_remote_stats st;
    assert_int_equal(kvt_remote_stats_get(r, &st), 0);
    return st;
}

/* A connection whose call failed is closed, never handed back to the pool
 * (src/remote/conn.c, node_give): hiredis keeps the error on its context,
 * so a pooled failed context fails every later call that takes it (the pool
 * hands out the last one given back first), and fail_threshold such calls
 * mark a healthy Redis down. For each fault (a reset reply, a timed-out
 * reply, a command cut in half on the wire), exactly one network call of a
 * restore fails: that restore fails with KVT_EIO and a message saying
 * why; then three restores of the same hit in a row succeed with the
 * cache-off bytes, and no further failure is counted. */
static void failed_conn_not_pooled(void **state)
{
    (void)state;
    static const struct {
        kvt__io_op op;
        int err, short_write;
        const char *what, *msg;
    } F[] = {
        {KVT_IO_RECV, ECONNRESET, 0, "reset reply", "did not answer"},
        {KVT_IO_RECV, EAGAIN, 0, "timed-out reply", "did not answer within the restore timeout"},
        {KVT_IO_SEND, EPIPE, 1, "half-sent GET", "did not answer"},
    };
    kvt_cold_tier t;
    int32_t tok[32];
    kvt_cold_hit hit;
    kvt_remote *r = one_entry_tier(&t, tok, &hit);
    assert_int_equal(restore_cmp(&t, &hit, tok), 0); /* the pool holds a good connection */
    for (size_t f = 0; f < sizeof F / sizeof F[0]; f++) {
        kvt_remote_stats s0 = tier_stats(r);
        kvt__io_fault fault = {.ops = 1u << F[f].op, .fail_at = 1, .err = F[f].err, .short_write = F[f].short_write};
        kvt__io_arm(&fault);
        kvt__clear_error();
        int rc = restore_cmp(&t, &hit, tok);
        kvt__io_disarm();
        assert_int_equal(kvt__io_failures(), 1);
        if (rc != KVT_EIO || !strstr(kvt_last_error(), F[f].msg))
            fail_msg("%s: the restore returned %d (want %d) with '%s' (want '%s')", F[f].what, rc, KVT_EIO,
                     kvt_last_error(), F[f].msg);
        kvt_remote_stats s1 = tier_stats(r);
        assert_int_equal(s1.failures_conn + s1.failures_timeout, s0.failures_conn + s0.failures_timeout + 1);
        assert_int_equal(s1.restore_failures, s0.restore_failures + 1);
        for (int k = 0; k < 3; k++) {
            kvt__clear_error();
            rc = restore_cmp(&t, &hit, tok);
            if (rc)
                fail_msg("%s: restore %d after the one failed call failed (%d: %s): the failed connection was "
                         "used again",
                         F[f].what, k + 1, rc, kvt_last_error());
        }
        kvt_remote_stats s2 = tier_stats(r);
        assert_int_equal(s2.failures_conn, s1.failures_conn);
        assert_int_equal(s2.failures_timeout, s1.failures_timeout);
        assert_int_equal(s2.restore_failures, s1.restore_failures);
        assert_int_equal(s2.restores, s1.restores + 3);
        assert_int_equal(s2.unhealthy_transitions, 0);
        assert_int_equal(s2.healthy, 1);
        print_message("  %-16s one restore failed ('%s'), the next 3 restored\n", F[f].what, F[f].msg);
    }
    assert_int_equal(kvt_remote_close(r), 0);
}

/* Redis unreachable after the lookup: with every call to it failed, the
 * tier turns unhealthy (fail_threshold failed lookups), a restore then fails
 * at once with KVT_EIO saying Redis is unreachable, and once calls go
 * through again the tier comes back (its health thread's PING) and the same
 * hit restores. */
static void unreachable_restore(void **state)
{
    (void)state;
    kvt_cold_tier t;
    int32_t tok[32];
    kvt_cold_hit hit, h2;
    kvt_remote *r = one_entry_tier(&t, tok, &hit);
    char peer[64];
    snprintf(peer, sizeof peer, "127.0.0.1:%d", g_srv[0].port);
    kvt__io_fault f = {.ops = KVT_IO_NET_OPS, .path_has = peer, .err = ECONNREFUSED};
    kvt__io_arm(&f);
    for (int i = 0; i < 10 && kvt_remote_healthy(r); i++)
        assert_int_equal(t.find(t.self, tok, WL[0].n + 1, "", &h2), KVT_ENOTFOUND);
    int healthy = kvt_remote_healthy(r);
    kvt__clear_error();
    int rc = restore_cmp(&t, &hit, tok);
    int64_t failed = kvt__io_failures();
    kvt__io_disarm();
    assert_int_equal(healthy, 0);
    assert_true(failed >= 3);
    if (rc != KVT_EIO || !strstr(kvt_last_error(), "unreachable"))
        fail_msg("the restore on an unhealthy tier returned %d (want %d) with '%s' (want 'unreachable')", rc, KVT_EIO,
                 kvt_last_error());
    int up = 0;
    for (int i = 0; i < 3000 && !(up = kvt_remote_healthy(r)); i++)
        usleep(10000); /* the health thread's backoff starts at 50 ms */
    assert_true(up);
    assert_int_equal(restore_cmp(&t, &hit, tok), 0);
    assert_int_equal(kvt_remote_close(r), 0);
}

/* Redis unreachable on every call: stores fail with a message, lookups miss. */
static void unreachable(void **state)
{
    (void)state;
    g_worker = 0;
    assert_int_equal(flushall(), 0);
    char peer[64];
    snprintf(peer, sizeof peer, "127.0.0.1:%d", g_srv[0].port);
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
    g_n_srv = fault_walk_workers();
    if (g_n_srv > MAX_SRV)
        g_n_srv = MAX_SRV;
    for (int i = 0; i < g_n_srv; i++)
        if (redis_start(&g_srv[i], 64, NULL)) {
            fprintf(stderr, "test_net_faults: cannot start redis-server %d\n", i);
            while (i-- > 0)
                redis_stop(&g_srv[i]);
            return 1;
        }
    store_identity(&CFG, "model-net", g_fp[0], &g_id[0]);
    store_identity(&CFG_HYB, "model-net-hybrid", g_fp[1], &g_id[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(walk_reset),
        cmocka_unit_test(walk_timeout),
        cmocka_unit_test(walk_half_sent),
        cmocka_unit_test(unreachable),
        cmocka_unit_test(failed_conn_not_pooled),
        cmocka_unit_test(unreachable_restore),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < g_n_srv; i++)
        redis_stop(&g_srv[i]);
    return failed ? 1 : 0;
}
