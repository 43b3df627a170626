/*
 * test_remote.c: the remote tier against a real redis-server on loopback:
 * the cold-tier conformance suite and the tier-chain rules with Redis as the
 * lower level, then the faults: Redis killed mid-run and restarted, down at
 * startup, stalled by CLIENT PAUSE (every call bounded by its timeout, a
 * restore by its own deadline), a
 * record corrupted with SETRANGE, another identity's record planted under a
 * key, a record evicted between lookup and restore (also an entry's last block
 * before an exact lookup), a key of another Redis type (GET answers an
 * error), each failed restore with its message; maxmemory reached; two
 * tiers sharing one Redis (two hosts); blocks Redis holds are not sent again;
 * passwords; and the URL parser. Skips (saying why) only when redis-server is
 * not installed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvtier/remote.h"
#include "kvtier/tier_chain.h"
#include "internal.h"
#include "redis_util.h"
#include "key.h"
#include "store_util.h"
#include "tier_suite.h"

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};
static const store_cfg HY = {.n_kv = 1, .kv_dim = 8, .block = 4, .recurrent = 40}; /* untrimmable */
static const store_cfg KV8 = {.n_kv = 2, .kv_dim = 8, .block = 8};
static const kvt_store_identity ID_A = {"remote-test", "cfg", "tok"};
static const kvt_store_identity ID_B = {"remote-test-other-model", "cfg", "tok"};

static redis_srv g_srv; /* the shared server */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void seq(int32_t *t, int64_t n, int32_t base)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

static kvt_remote *open_tier(const char *url, const kvt_store_identity *id, int32_t lookup_ms)
{
    kvt_remote_options o = {.lookup_timeout_ms = lookup_ms, .io_timeout_ms = 500, .quiet = 1};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(url, id, &o, &r), 0);
    return r;
}

static void put(kvt_remote *r, const store_cfg *cfg, const int32_t *tok, int64_t n)
{
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_entry e;
    assert_int_equal(store_make_entry(cfg, "", tok, n, &e), 0);
    assert_int_equal(t.store(t.self, &e), 0);
    kvt_entry_clear(&e);
}

static int64_t find_len(kvt_remote *r, const int32_t *p, int64_t n, kvt_cold_hit *hit)
{
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_cold_hit h = {0};
    int rc = t.find(t.self, p, n, "", &h);
    if (hit)
        *hit = h;
    return rc == 0 ? h.prefix_len : 0;
}

static int restore_rc(kvt_remote *r, uint64_t handle, const store_cfg *cfg, const int32_t *tok, int64_t n)
{
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_entry got, want;
    int rc = t.restore(t.self, handle, &got);
    if (rc) {
        assert_null(got.caches);
        return rc;
    }
    assert_int_equal(store_make_entry(cfg, "", tok, n, &want), 0);
    assert_int_equal(got.n_tokens, n);
    assert_int_equal(store_entry_diff(&want, &got), 0);
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
    return 0;
}

/* restore_rc after clearing the error, for a restore that must fail with
 * `want` and a message containing `msg`. */
static void restore_fails(kvt_remote *r, uint64_t handle, const store_cfg *cfg, const int32_t *tok, int64_t n,
                          int want, const char *msg)
{
    kvt__clear_error();
    int rc = restore_rc(r, handle, cfg, tok, n);
    if (rc != want || !strstr(kvt_last_error(), msg))
        fail_msg("the restore returned %d with '%s' (want %d with '%s')", rc, kvt_last_error(), want, msg);
}

static kvt_remote_stats stats(kvt_remote *r)
{
    kvt_remote_stats s;
    assert_int_equal(kvt_remote_stats_get(r, &s), 0);
    return s;
}

/* The Redis key of block j (block size B) of tokens under identity id. */
static void block_name(const kvt_store_identity *id, const int32_t *tok, int B, int j, char *out, size_t cap)
{
    char prefix[64];
    assert_int_equal(kvt_remote_key_prefix(id, prefix, sizeof prefix), 0);
    char hi[17] = {0}, lo[17] = {0};
    memcpy(hi, prefix + 4, 16);
    memcpy(lo, prefix + 20, 16);
    kvt__key seed = {strtoull(lo, NULL, 16), strtoull(hi, NULL, 16)};
    kvt__key k = KVT__KEY_ZERO;
    for (int i = 0; i <= j; i++)
        k = kvt__block_key(seed, "", k, tok + i * B, B);
    char hex[33];
    kvt__key_hex(k, hex);
    snprintf(out, cap, "%sb%s", prefix, hex);
}

static int wait_healthy(kvt_remote *r, int ms)
{
    for (int i = 0; i < ms / 10; i++) {
        if (kvt_remote_healthy(r))
            return 1;
        sleep_ms(10);
    }
    return kvt_remote_healthy(r);
}

/* How many times slower this build runs a test (CMake: 10 under TSan, 3
 * under ASan, else 1): multiplies find_len_until's bound. */
#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif

/* find_len on a tier whose lookups are bounded by 50 ms, where the case
 * checks that the tier serves (not the bound): a lookup the machine holds
 * past its bound is a counted miss by design (a loaded -j2 suite run missed
 * the hit after CLIENT PAUSE that way), so it looks up again, every 20 ms for
 * at most 10 s times KVT_TEST_TIME_SCALE, until the lookup finds `want`
 * tokens. Returns the last length found (0: a miss); prints the tries when
 * it took more than one. */
static int64_t find_len_until(kvt_remote *r, const int32_t *p, int64_t n, int64_t want, kvt_cold_hit *hit)
{
    int64_t got = 0;
    int tries = 0;
    double t0 = now_ms(), bound = 10000.0 * KVT_TEST_TIME_SCALE;
    do {
        if (tries++)
            sleep_ms(20);
        got = find_len(r, p, n, hit);
    } while (got != want && now_ms() - t0 < bound);
    if (tries > 1)
        print_message("  a %lld-token hit took %d lookups (%.0f ms) under the 50 ms lookup bound\n", (long long)want,
                      tries, now_ms() - t0);
    return got;
}

static int fx_flush(void **state)
{
    (void)state;
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "FLUSHALL"), 0);
    return 0;
}

/* killed mid-run: every lookup stays a fast miss, the tier turns unhealthy
 * after 3 failures (then skips Redis without I/O), and comes back by itself
 * once Redis is restarted */
static void f_kill_restart(void **state)
{
    redis_srv s;
    assert_int_equal(redis_start(&s, 64, NULL), 0);
    /* socket bounds of 5 s: a lookup that is not held to its own 50 ms
     * would show as seconds, far from the 2.5 s allowed for a loaded machine */
    kvt_remote_options o = {.lookup_timeout_ms = 50, .io_timeout_ms = 5000, .connect_timeout_ms = 5000, .quiet = 1};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(s.url, &ID_A, &o, &r), 0);
    int32_t p[20];
    seq(p, 20, 100);
    put(r, &KV, p, 16);
    assert_int_equal(find_len_until(r, p, 20, 16, NULL), 16);
    redis_kill(&s);
    double worst = 0;
    for (int i = 0; i < 6; i++) {
        double t0 = now_ms();
        assert_int_equal(find_len(r, p, 20, NULL), 0);
        double took = now_ms() - t0;
        worst = took > worst ? took : worst;
    }
    print_message("redis killed: 6 lookups, the slowest took %.1f ms (timeout 50 ms)\n", worst);
    assert_true(worst < 2500);
    kvt_remote_stats st = stats(r);
    assert_int_equal(st.healthy, 0);
    assert_int_equal(st.unhealthy_transitions, 1);
    assert_true(st.failures_conn >= 3);
    assert_true(st.lookups_skipped >= 1);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", p, 16, &e), 0);
    assert_int_equal(t.spill(t.self, &e), KVT_EAGAIN); /* unhealthy: dropped, still ours */
    assert_non_null(e.caches);
    kvt_entry_clear(&e);
    assert_int_equal(stats(r).dropped, 1);

    assert_int_equal(redis_restart(&s), 0);
    assert_true(wait_healthy(r, 30000));
    assert_int_equal(find_len(r, p, 20, NULL), 0); /* no persistence: the data went with it */
    put(r, &KV, p, 16);
    kvt_cold_hit h;
    assert_int_equal(find_len_until(r, p, 20, 16, &h), 16);
    assert_int_equal(restore_rc(r, h.handle, &KV, p, 16), 0);
    kvt_remote_close(r);
    redis_stop(&s);
}

/* down at startup: open succeeds (warns), the tier is unhealthy, lookups
 * miss at once, and it comes up when Redis does */
static void f_down_at_start(void **state)
{
    redis_srv s;
    assert_int_equal(redis_start(&s, 64, NULL), 0);
    redis_kill(&s); /* a port with nobody on it */
    kvt_remote *r = open_tier(s.url, &ID_A, 50);
    assert_int_equal(kvt_remote_healthy(r), 0);
    int32_t p[20];
    seq(p, 20, 200);
    uint64_t skipped = stats(r).lookups_skipped;
    double t0 = now_ms();
    assert_int_equal(find_len(r, p, 20, NULL), 0);
    print_message("redis down at start: the lookup missed after %.1f ms\n", now_ms() - t0);
    assert_int_equal(stats(r).lookups_skipped, skipped + 1); /* skipped: no I/O */
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", p, 16, &e), 0);
    assert_int_equal(t.store(t.self, &e), KVT_EIO);
    kvt_entry_clear(&e);
    assert_int_equal(redis_restart(&s), 0);
    assert_true(wait_healthy(r, 30000));
    put(r, &KV, p, 16);
    assert_int_equal(find_len_until(r, p, 20, 16, NULL), 16);
    kvt_remote_close(r);
    redis_stop(&s);
}

/* a stalled Redis (CLIENT PAUSE): the lookup returns a miss within its
 * timeout, counted; once the pause ends the tier serves again */
static void f_client_pause(void **state)
{
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 50);
    int32_t p[20];
    seq(p, 20, 300);
    put(r, &KV, p, 16);
    assert_int_equal(find_len_until(r, p, 20, 16, NULL), 16);
    /* Up to 3 tries: a loaded machine can hold this thread past the 150 ms
     * for one try; a lookup that waits for the pause or a socket timeout
     * (500 ms) misses it every time. */
    double took = 0;
    for (int attempt = 0; attempt < 3; attempt++) {
        uint64_t timeouts = stats(r).failures_timeout;
        assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "CLIENT PAUSE 500 ALL"), 0);
        double t0 = now_ms();
        assert_int_equal(find_len(r, p, 20, NULL), 0);
        took = now_ms() - t0;
        print_message("CLIENT PAUSE 500 ms: the lookup returned a miss after %.1f ms (timeout 50 ms)\n", took);
        assert_true(stats(r).failures_timeout > timeouts);
        sleep_ms(600);
        kvt_cold_hit h;
        assert_int_equal(find_len_until(r, p, 20, 16, &h), 16); /* the pause is over: a hit again */
        assert_int_equal(restore_rc(r, h.handle, &KV, p, 16), 0);
        assert_int_equal(stats(r).healthy, 1);
        if (took < 150)
            break;
    }
    assert_true(took < 150);
    kvt_remote_close(r);
}

/* a Redis that stalls (CLIENT PAUSE) between the lookup and the restore:
 * the restore gives up by its own deadline (restore_timeout_ms), not after a
 * socket timeout per read (io_timeout_ms), counted as a timeout; a stall
 * shorter than the deadline only delays the restore, which then succeeds */
static void f_pause_during_restore(void **state)
{
    kvt_remote_options o = {.lookup_timeout_ms = 1000, .io_timeout_ms = 1500, .restore_timeout_ms = 150,
                            .quiet = 1};
    kvt_remote *r = NULL;
    assert_int_equal(kvt_remote_open(g_srv.url, &ID_A, &o, &r), 0);
    int32_t p[40];
    seq(p, 40, 350);
    put(r, &KV, p, 36); /* 9 blocks of 4 tokens: 9 GETs pipelined */
    kvt_cold_hit h;
    assert_int_equal(find_len(r, p, 40, &h), 36);
    /* Up to 3 tries, as in f_client_pause: a restore that waits for the
     * pause or the socket timeout (1500 ms) misses the 400 ms every time. */
    double took = 0;
    for (int attempt = 0; attempt < 3; attempt++) {
        uint64_t timeouts = stats(r).failures_timeout, failures = stats(r).restore_failures;
        assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "CLIENT PAUSE 1200 ALL"), 0);
        double t0 = now_ms();
        restore_fails(r, h.handle, &KV, p, 36, KVT_EIO, "did not answer within the restore timeout (150 ms)");
        took = now_ms() - t0;
        print_message("CLIENT PAUSE 1200 ms during a restore: it failed after %.1f ms (restore timeout 150 ms, "
                      "io timeout 1500 ms)\n",
                      took);
        assert_true(took >= 140);
        assert_true(stats(r).failures_timeout > timeouts);
        assert_int_equal(stats(r).restore_failures, failures + 1);
        sleep_ms(1300);
        if (took < 400)
            break;
        assert_int_equal(find_len(r, p, 40, &h), 36); /* the pause is over: found again */
    }
    assert_true(took < 400);
    /* a shorter stall inside a longer deadline: the restore waits it out */
    kvt_remote_close(r);
    o.restore_timeout_ms = 10000; /* far longer than the stall, also on a loaded machine */
    assert_int_equal(kvt_remote_open(g_srv.url, &ID_A, &o, &r), 0);
    assert_int_equal(find_len(r, p, 40, &h), 36);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "CLIENT PAUSE 300 ALL"), 0);
    double t0 = now_ms();
    assert_int_equal(restore_rc(r, h.handle, &KV, p, 36), 0);
    took = now_ms() - t0;
    print_message("CLIENT PAUSE 300 ms during a restore: it succeeded after %.1f ms (restore timeout 10000 ms)\n",
                  took);
    assert_true(took >= 250);
    kvt_remote_close(r);
}

/* untrimmable state: a checkpoint ending inside a block hangs off the node
 * of its last whole block; a longer entry's blocks take the prompt's run
 * deeper than that node, and the checkpoint is still found and restored */
static void f_untrimmable_shallow(void **state)
{
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 1000);
    int32_t p[20], q[20];
    seq(p, 20, 700);
    put(r, &HY, p, 10); /* blocks 0-1, a 2-token tail: off node 2 */
    put(r, &HY, p, 16); /* blocks 0-3 */
    memcpy(q, p, sizeof q);
    for (int i = 12; i < 20; i++)
        q[i] = 9000 + i; /* q's blocks 0-2 are p's: the run reaches node 3 */
    kvt_cold_hit h;
    assert_int_equal(find_len(r, q, 20, &h), 10);
    assert_int_equal(restore_rc(r, h.handle, &HY, p, 10), 0);
    assert_int_equal(find_len(r, p, 20, &h), 16); /* the longer one still wins where it serves */
    kvt_remote_close(r);
}

/* an entry record naming fewer chained blocks than its whole blocks (here
 * none: it was stored with 8-token blocks under an identity whose layout
 * says 4, so it carries all its state) while the prompt's 4-token blocks
 * are in Redis: find_exact takes the blocks the entry names (none), the
 * restore gives the entry exactly, and no valid record is called bad */
static void f_entry_short_chain(void **state)
{
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 1000);
    int32_t p[20];
    seq(p, 20, 800);
    put(r, &KV, p, 16);  /* the layout (4-token blocks) and blocks 0-3 */
    put(r, &KV8, p, 16); /* the same entry key: replaces the entry record, no block chained */
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_cold_hit h;
    assert_int_equal(t.find_exact(t.self, p, 16, "", &h), 0);
    assert_int_equal(h.prefix_len, 16);
    assert_int_equal(restore_rc(r, h.handle, &KV8, p, 16), 0);
    assert_int_equal(find_len(r, p, 20, &h), 16); /* find: the standalone blocks serve, as stored */
    assert_int_equal(restore_rc(r, h.handle, &KV, p, 16), 0);
    assert_int_equal(stats(r).bad_records, 0);
    kvt_remote_close(r);
}

/* a byte of a record flipped with SETRANGE: the restore refuses it
 * (KVT_ECORRUPT), counts it, deletes the key; the next lookup stops before it */
static void f_setrange(void **state)
{
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 1000);
    int32_t p[20];
    seq(p, 20, 400);
    put(r, &KV, p, 16);
    char key[160];
    block_name(&ID_A, p, 4, 2, key, sizeof key);
    long long len = redis_cmd(g_srv.port, NULL, 0, NULL, "STRLEN %s", key);
    assert_true(len > 100);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "SETRANGE %s %lld %b", key, len - 40, "\x5a", (size_t)1),
                     len);
    kvt_cold_hit h;
    assert_int_equal(find_len(r, p, 20, &h), 16);
    restore_fails(r, h.handle, &KV, p, 16, KVT_ECORRUPT, "checksum mismatch");
    assert_int_equal(stats(r).bad_records, 1);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "EXISTS %s", key), 0);
    assert_int_equal(find_len(r, p, 20, &h), 8); /* blocks 0 and 1 remain */
    assert_int_equal(restore_rc(r, h.handle, &KV, p, 8), 0);
    kvt_remote_close(r);
}

/* another identity's record planted under our key: refused, counted, deleted */
static void f_foreign_record(void **state)
{
    kvt_remote *a = open_tier(g_srv.url, &ID_A, 1000), *b = open_tier(g_srv.url, &ID_B, 1000);
    int32_t p[20], q[20];
    seq(p, 20, 500);
    seq(q, 20, 9000);
    put(a, &KV, q, 8); /* A knows its layout */
    put(b, &KV, p, 16);
    assert_int_equal(find_len(a, p, 20, NULL), 0); /* identities never mix */
    char kb[160], ka[160];
    static char val[1 << 16];
    size_t vl = 0;
    for (int j = 0; j < 4; j++) {
        block_name(&ID_B, p, 4, j, kb, sizeof kb);
        block_name(&ID_A, p, 4, j, ka, sizeof ka);
        assert_int_equal(redis_cmd(g_srv.port, val, sizeof val, &vl, "GET %s", kb), 0);
        assert_true(vl > 0 && vl < sizeof val);
        assert_int_equal(redis_set_bin(g_srv.port, ka, val, vl), 0);
    }
    kvt_cold_hit h;
    assert_int_equal(find_len(a, p, 20, &h), 16);
    restore_fails(a, h.handle, &KV, p, 16, KVT_ECORRUPT, "block 0 belongs to another identity");
    assert_int_equal(stats(a).bad_records, 1);
    block_name(&ID_A, p, 4, 0, ka, sizeof ka);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "EXISTS %s", ka), 0);
    assert_int_equal(find_len(a, p, 20, NULL), 0);
    block_name(&ID_B, p, 4, 0, kb, sizeof kb); /* B's own records are untouched */
    assert_int_equal(find_len(b, p, 20, &h), 16);
    assert_int_equal(restore_rc(b, h.handle, &KV, p, 16), 0);
    kvt_remote_close(a);
    kvt_remote_close(b);
}

/* A tier of ID_A holding p = base, base+1, ... (20 tokens; the first 16
 * stored as KV) and a lookup's 16-token hit of it. */
static kvt_remote *tier_with_hit(int32_t *p, int32_t base, kvt_cold_hit *h)
{
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 1000);
    seq(p, 20, base);
    put(r, &KV, p, 16);
    assert_int_equal(find_len(r, p, 20, h), 16);
    return r;
}

/* Deletes block j (4-token blocks, ID_A) of tok from Redis; its key into key. */
static void del_block(const int32_t *tok, int j, char *key, size_t cap)
{
    block_name(&ID_A, tok, 4, j, key, cap);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "DEL %s", key), 1);
}

/* a block gone between the lookup and the restore: the restore fails
 * cleanly (KVT_ENOTFOUND), never a shortened or wrong entry */
static void f_gone_before_restore(void **state)
{
    int32_t p[20];
    kvt_cold_hit h;
    kvt_remote *r = tier_with_hit(p, 600, &h);
    char key[160];
    del_block(p, 1, key, sizeof key);
    restore_fails(r, h.handle, &KV, p, 16, KVT_ENOTFOUND, "record 2 of 4 is gone");
    kvt_remote_stats st = stats(r);
    assert_int_equal(st.restore_partial, 1);
    assert_int_equal(st.restore_failures, 1);
    assert_int_equal(find_len(r, p, 20, &h), 4);
    kvt_remote_close(r);
}

/* the last block of an untrimmable entry gone before an exact lookup: the
 * lookup finds the entry record over the 3 blocks still there, the restore
 * sees that the entry names 4 and fails as a miss (KVT_ENOTFOUND, counted
 * as partial), never calling a valid record bad */
static void f_entry_block_gone_exact(void **state)
{
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 1000);
    int32_t p[20];
    seq(p, 20, 650);
    put(r, &HY, p, 16); /* blocks 0-3 and the entry record naming them */
    char key[160];
    del_block(p, 3, key, sizeof key);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    kvt_cold_hit h;
    assert_int_equal(t.find_exact(t.self, p, 16, "", &h), 0);
    assert_int_equal(h.prefix_len, 16);
    restore_fails(r, h.handle, &HY, p, 16, KVT_ENOTFOUND, "the entry names 4 blocks, the lookup found 3");
    kvt_remote_stats st = stats(r);
    assert_int_equal(st.restore_partial, 1);
    assert_int_equal(st.restore_failures, 1);
    assert_int_equal(st.bad_records, 0);
    kvt_remote_close(r);
}

/* a key of ours holding another Redis type (a list: GET answers WRONGTYPE):
 * the restore fails with KVT_EIO saying Redis answered GET with an error,
 * counted as a reply failure; the key is not taken for a bad record */
static void f_get_error_reply(void **state)
{
    int32_t p[20];
    kvt_cold_hit h;
    kvt_remote *r = tier_with_hit(p, 660, &h);
    char key[160];
    del_block(p, 1, key, sizeof key);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "RPUSH %s x", key), 1);
    uint64_t reply_failures = stats(r).failures_reply;
    restore_fails(r, h.handle, &KV, p, 16, KVT_EIO, "answered GET with an error");
    kvt_remote_stats st = stats(r);
    assert_int_equal(st.failures_reply, reply_failures + 1);
    assert_int_equal(st.restore_failures, 1);
    assert_int_equal(st.bad_records, 0);
    assert_int_equal(redis_cmd(g_srv.port, NULL, 0, NULL, "EXISTS %s", key), 1);
    kvt_remote_close(r);
}

/* maxmemory reached: Redis evicts (allkeys-lru); every store still
 * succeeds, every lookup restores exactly what was stored or misses, and the
 * newest entries are there */
static void f_maxmemory(void **state)
{
    redis_srv s;
    assert_int_equal(redis_start(&s, 4, NULL), 0);
    kvt_remote *r = open_tier(s.url, &ID_A, 1000);
    static const store_cfg BIG = {.n_kv = 2, .kv_dim = 256, .block = 16};
    enum { N = 48, LEN = 64 };
    int32_t p[N][LEN + 4];
    for (int i = 0; i < N; i++) {
        seq(p[i], LEN + 4, 100000 * (i + 1));
        /* Redis's LRU clock ticks once a second, so keys written in the
         * same second tie and allkeys-lru evicts among them at random: let
         * the clock move on before the newest entry, so that it is the
         * most recent key by Redis's own measure */
        if (i == N - 1)
            usleep(1500 * 1000);
        put(r, &BIG, p[i], LEN); /* 256 KiB of kv each: 12 MiB into 4 MiB */
    }
    int whole = 0, partial = 0, miss = 0;
    for (int i = 0; i < N; i++) {
        kvt_cold_hit h;
        int64_t got = find_len(r, p[i], LEN + 4, &h);
        if (!got) {
            miss++;
            continue;
        }
        int rc = restore_rc(r, h.handle, &BIG, p[i], h.n_tokens);
        assert_true(rc == 0 || rc == KVT_ENOTFOUND);
        if (rc == 0 && got == LEN)
            whole++;
        else
            partial++;
    }
    char info[8192];
    assert_int_equal(redis_cmd(s.port, info, sizeof info - 1, NULL, "INFO stats"), 0);
    char *ev = strstr(info, "evicted_keys:");
    long long evicted = ev ? atoll(ev + 13) : 0;
    print_message("maxmemory 4 MB, 12 MiB stored: %d whole, %d partial, %d misses; Redis evicted %lld keys\n",
                  whole, partial, miss, evicted);
    assert_true(evicted > 0);
    assert_true(miss + partial > 0);
    kvt_cold_hit h;
    assert_int_equal(find_len(r, p[N - 1], LEN + 4, &h), LEN); /* the newest */
    assert_int_equal(restore_rc(r, h.handle, &BIG, p[N - 1], LEN), 0);
    assert_int_equal(stats(r).write_failures, 0);
    kvt_remote_close(r);
    redis_stop(&s);
}

/* two hosts on one Redis: what one stores, the other (which never stored
 * anything) finds and restores, including a tail and an extension */
static void f_two_hosts(void **state)
{
    kvt_remote *a = open_tier(g_srv.url, &ID_A, 1000), *b = open_tier(g_srv.url, &ID_A, 1000);
    int32_t p[40];
    seq(p, 40, 700);
    put(a, &KV, p, 18); /* four blocks and a tail of 2 */
    kvt_cold_hit h;
    assert_int_equal(find_len(b, p, 30, &h), 18);
    assert_int_equal(h.n_tokens, 18);
    assert_int_equal(restore_rc(b, h.handle, &KV, p, 18), 0);
    put(b, &KV, p, 33);
    assert_int_equal(find_len(a, p, 40, &h), 33);
    assert_int_equal(restore_rc(a, h.handle, &KV, p, 33), 0);
    kvt_remote_close(a);
    kvt_remote_close(b);
}

/* a block Redis holds already is not sent again */
static void f_skip_present(void **state)
{
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 1000);
    int32_t p[40];
    seq(p, 40, 800);
    put(r, &KV, p, 16);
    kvt_remote_stats s1 = stats(r);
    assert_int_equal(s1.write_records, 4);
    put(r, &KV, p, 16);
    kvt_remote_stats s2 = stats(r);
    assert_int_equal(s2.write_records, 4);
    assert_int_equal(s2.writes_skipped, 4);
    put(r, &KV, p, 24);
    kvt_remote_stats s3 = stats(r);
    assert_int_equal(s3.write_records, 6); /* two new blocks */
    assert_int_equal(s3.writes_skipped, 8);
    kvt_remote_close(r);
}

/* AUTH: from the URL or KVTIER_REDIS_PASSWORD; a wrong one leaves the tier
 * unhealthy, and no message carries the password */
static void f_password(void **state)
{
    redis_srv s;
    assert_int_equal(redis_start(&s, 64, "--requirepass s3cret-pw"), 0);
    char url[128];
    snprintf(url, sizeof url, "redis://:s3cret-pw@127.0.0.1:%d", s.port);
    kvt_remote *r = open_tier(url, &ID_A, 1000);
    assert_int_equal(kvt_remote_healthy(r), 1);
    int32_t p[20];
    seq(p, 20, 900);
    put(r, &KV, p, 16);
    kvt_remote_close(r);
    setenv("KVTIER_REDIS_PASSWORD", "s3cret-pw", 1);
    r = open_tier(s.url, &ID_A, 1000);
    assert_int_equal(find_len(r, p, 20, NULL), 16);
    kvt_remote_close(r);
    setenv("KVTIER_REDIS_PASSWORD", "wrong", 1);
    r = open_tier(s.url, &ID_A, 1000);
    assert_int_equal(kvt_remote_healthy(r), 0);
    assert_int_equal(find_len(r, p, 20, NULL), 0);
    kvt_remote_close(r);
    unsetenv("KVTIER_REDIS_PASSWORD");
    redis_stop(&s);
}

/* a chain [memory, Redis with KVT_LEVEL_WRITE_BEHIND]: every spill lands in
 * both levels, so another host (a second tier on the same Redis) finds it */
static void f_chain_write_behind(void **state)
{
    mem_tier *m;
    assert_int_equal(mem_tier_create(&m), 0);
    kvt_remote *r = open_tier(g_srv.url, &ID_A, 1000), *other = open_tier(g_srv.url, &ID_A, 1000);
    kvt_cold_tier rt;
    kvt_remote_cold_tier(r, &rt);
    kvt_tier_level lv[2] = {{.tier = *mem_tier_iface(m)}, {.tier = rt, .flags = KVT_LEVEL_WRITE_BEHIND}};
    kvt_tier_chain_config cfg = {.levels = lv, .n_levels = 2};
    kvt_tier_chain *c;
    assert_int_equal(kvt_tier_chain_create(&cfg, &c), 0);
    kvt_cold_tier t;
    kvt_tier_chain_cold_tier(c, &t);
    int32_t p[24];
    seq(p, 24, 1100);
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", p, 20, &e), 0);
    assert_int_equal(t.spill(t.self, &e), 0);
    assert_int_equal(t.flush(t.self), 0);
    assert_true(mem_tier_has(m, "", p, 20));
    kvt_cold_hit h;
    assert_int_equal(find_len(other, p, 24, &h), 20);
    assert_int_equal(restore_rc(other, h.handle, &KV, p, 20), 0);
    kvt_tier_stats ls;
    assert_int_equal(kvt_tier_chain_level_stats(c, 1, &ls), 0);
    assert_int_equal(ls.stores, 1);
    kvt_tier_chain_destroy(c);
    mem_tier_destroy(m);
    kvt_remote_close(r);
    kvt_remote_close(other);
}

static void t_url(void **state)
{
    kvt_remote_url u;
    assert_int_equal(kvt_remote_url_parse("redis://h:1/2", &u), 0);
    assert_string_equal(u.host, "h");
    assert_int_equal(u.port, 1);
    assert_int_equal(u.db, 2);
    assert_int_equal(kvt_remote_url_parse("redis://user:p%40ss@10.0.0.1:6380/3", &u), 0);
    assert_string_equal(u.user, "user");
    assert_string_equal(u.password, "p@ss");
    assert_string_equal(u.host, "10.0.0.1");
    assert_int_equal(u.port, 6380);
    assert_int_equal(kvt_remote_url_parse("redis://:pw@host", &u), 0);
    assert_string_equal(u.password, "pw");
    assert_string_equal(u.user, "");
    assert_int_equal(u.port, 6379);
    assert_int_equal(u.db, 0);
    assert_int_equal(kvt_remote_url_parse("redis://host/", &u), 0);
    const char *bad[] = {"http://h:1", "redis://", "redis://:pw@", "redis://h:0", "redis://h:70000", "redis://h:x",
                         "redis://h/16", "redis://h/1x", "rediss://h", "redis://u:%zz@h"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(kvt_remote_url_parse(bad[i], &u), KVT_EINVAL);
    assert_int_equal(kvt_remote_url_parse("redis://u:topsecret@h:99999", &u), KVT_EINVAL);
    assert_null(strstr(kvt_last_error(), "topsecret"));
    assert_string_equal(u.password, ""); /* nothing left behind */
}

static void t_key_prefix(void **state)
{
    char a[64], b[64];
    assert_int_equal(kvt_remote_key_prefix(&ID_A, a, sizeof a), 0);
    assert_int_equal(kvt_remote_key_prefix(&ID_B, b, sizeof b), 0);
    assert_int_equal(strlen(a), 37);
    assert_int_equal(strncmp(a, "kvt:", 4), 0);
    assert_string_not_equal(a, b);
}

int main(void)
{
    if (!redis_available("test_remote"))
        return 0;
    if (redis_start(&g_srv, 64, NULL)) {
        fprintf(stderr, "test_remote: cannot start redis-server\n");
        return 1;
    }
    redis_tier_use(g_srv.url, 0, &g_srv.port, 1);
    int failed = 0;
    failed += tier_suite_run(&tier_impl_redis);
    failed += tier_suite_run_chain(&tier_impl_redis);
    const struct CMUnitTest faults[] = {
        cmocka_unit_test(t_url),
        cmocka_unit_test(t_key_prefix),
        cmocka_unit_test(f_kill_restart),
        cmocka_unit_test(f_down_at_start),
        cmocka_unit_test_setup(f_client_pause, fx_flush),
        cmocka_unit_test_setup(f_pause_during_restore, fx_flush),
        cmocka_unit_test_setup(f_untrimmable_shallow, fx_flush),
        cmocka_unit_test_setup(f_entry_short_chain, fx_flush),
        cmocka_unit_test_setup(f_setrange, fx_flush),
        cmocka_unit_test_setup(f_foreign_record, fx_flush),
        cmocka_unit_test_setup(f_gone_before_restore, fx_flush),
        cmocka_unit_test_setup(f_entry_block_gone_exact, fx_flush),
        cmocka_unit_test_setup(f_get_error_reply, fx_flush),
        cmocka_unit_test(f_maxmemory),
        cmocka_unit_test_setup(f_two_hosts, fx_flush),
        cmocka_unit_test_setup(f_skip_present, fx_flush),
        cmocka_unit_test(f_password),
        cmocka_unit_test_setup(f_chain_write_behind, fx_flush),
    };
    failed += cmocka_run_group_tests_name("remote tier faults", faults, NULL, NULL);
    redis_stop(&g_srv);
    return failed ? 1 : 0;
}
