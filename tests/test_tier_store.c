/*
 * test_tier_store.c: the SSD store as a level of a tier chain.
 *   - Its open never blocks in flock: with <dir>/.lock held exclusively by
 *     another process, open gives up with KVT_EBUSY after lock_wait_ms and
 *     leaves no thread behind; a holder that lets go within the wait is
 *     waited for.
 *   - A store opened read-only says so in its tier table
 *     (KVT_TIER_READ_ONLY), refuses store and spill with KVT_EREADONLY
 *     (counted), and a chain over it writes to the next writable level while
 *     still finding and restoring what the store holds.
 *   - Its budget evictions are demoted into the next writable level below
 *     it (the in-memory tier), written behind by the chain, counted; an
 *     entry the level below already holds (a write-behind level has every
 *     kept prefix) is not written again.
 *   - The chain's demotion writes run on the process's I/O worker, never on
 *     a private thread: inside the level's spill, the default worker shows
 *     a write operation running, and its write counter grew by the end.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/io.h"
#include "kvtier/tier_chain.h"
#include "mem_tier.h"
#include "pc_util.h"
#include "store_util.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

typedef struct fx {
    char root[512];
    char lock[1200];
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    pid_t holder;
} fx;

/* A root with one identity directory (created by an open and a close) and
 * its .lock path. */
static void fx_init(fx *f)
{
    memset(f, 0, sizeof *f);
    store_tmpdir(f->root, sizeof f->root, "tier-store");
    store_identity(&KV, "tier-store", f->fp, &f->id);
    kvt_store *s = NULL;
    assert_int_equal(kvt_store_open(f->root, &f->id, NULL, &s), 0);
    snprintf(f->lock, sizeof f->lock, "%s/.lock", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
}

/* Another process takes .lock exclusively and holds it for hold_ms (0: until
 * killed); returns once it holds it. */
static void hold_lock(fx *f, int hold_ms)
{
    f->holder = store_hold_lock(f->lock, hold_ms);
    assert_true(f->holder > 0);
}

static void fx_done(fx *f)
{
    if (f->holder > 0) {
        kill(f->holder, SIGKILL);
        waitpid(f->holder, NULL, 0);
    }
    store_rmtree(f->root);
}

/* a lock held for longer than lock_wait_ms: KVT_EBUSY after about the wait,
 * naming the lock, with no thread left waiting for it (the open runs on the
 * caller's thread and never blocks in flock) */
static void test_lock_held(void **state)
{
    (void)state;
    fx f;
    fx_init(&f);
    hold_lock(&f, 0);
    int before = store_thread_count_baseline();
    assert_true(before > 0);
    kvt_store *s = NULL;
    kvt_store_options o = {.lock_wait_ms = 150};
    /* Up to 3 tries: a loaded machine can hold this thread past 2 s once;
     * an open that waits for the holder (it never lets go) never returns. */
    double took = 0;
    for (int attempt = 0; attempt < 3; attempt++) {
        double t0 = now_ms();
        assert_int_equal(kvt_store_open(f.root, &f.id, &o, &s), KVT_EBUSY);
        took = now_ms() - t0;
        print_message("lock held: open gave up after %.1f ms (wait 150 ms): %s\n", took, kvt_last_error());
        assert_null(s);
        assert_true(took >= 140);
        assert_non_null(strstr(kvt_last_error(), ".lock"));
        assert_non_null(strstr(kvt_last_error(), "held by another process"));
        assert_int_equal(store_thread_count_settle(before), before);
        if (took < 2000)
            break;
    }
    assert_true(took < 2000);
    /* read-only does not wait: it opens at once without the lock (a wait
     * of a minute would show) */
    o.read_only = 1;
    o.lock_wait_ms = 60000;
    double t0 = now_ms();
    assert_int_equal(kvt_store_open(f.root, &f.id, &o, &s), 0);
    assert_true(now_ms() - t0 < 30000);
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(store_thread_count_settle(before), before);
    fx_done(&f);
}

/* a holder that lets go within the wait is waited for: the open succeeds */
static void test_lock_released(void **state)
{
    (void)state;
    fx f;
    fx_init(&f);
    hold_lock(&f, 200);
    kvt_store *s = NULL;
    kvt_store_options o = {.lock_wait_ms = 60000};
    double t0 = now_ms();
    assert_int_equal(kvt_store_open(f.root, &f.id, &o, &s), 0);
    double took = now_ms() - t0;
    print_message("lock released after 200 ms: open took %.1f ms\n", took);
    assert_true(took >= 150);
    assert_true(took < 30000); /* when the holder let go, not at the end of the 60 s wait */
    assert_int_equal(kvt_store_close(s), 0);
    o.lock_wait_ms = 86400001;
    assert_int_equal(kvt_store_open(f.root, &f.id, &o, &s), KVT_EINVAL);
    fx_done(&f);
}

static void put(const kvt_cold_tier *t, const int32_t *tok, int64_t n)
{
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", tok, n, &e), 0);
    assert_int_equal(t->store(t->self, &e), 0);
    kvt_entry_clear(&e);
}

static void expect_restore(const kvt_cold_tier *t, uint64_t handle, const int32_t *tok, int64_t n)
{
    kvt_entry got, want;
    assert_int_equal(t->restore(t->self, handle, &got), 0);
    assert_int_equal(store_make_entry(&KV, "", tok, n, &want), 0);
    assert_int_equal(store_entry_diff(&want, &got), 0);
    kvt_entry_clear(&want);
    kvt_entry_clear(&got);
}

/* a read-only store: its table says KVT_TIER_READ_ONLY and refuses writes
 * with KVT_EREADONLY (the entry stays the caller's, counted); a chain
 * [read-only store, memory] finds and restores what the store holds and
 * writes into the memory level */
static void test_read_only_level(void **state)
{
    (void)state;
    fx f;
    fx_init(&f);
    int32_t a[20], b[20];
    pcu_seq(a, 20, 100);
    pcu_seq(b, 20, 200);
    kvt_store *s = NULL;
    assert_int_equal(kvt_store_open(f.root, &f.id, NULL, &s), 0);
    kvt_cold_tier rw;
    kvt_store_cold_tier(s, &rw);
    assert_int_equal(rw.flags, 0);
    put(&rw, a, 16);
    assert_int_equal(kvt_store_close(s), 0);

    kvt_store_options o = {.read_only = 1};
    assert_int_equal(kvt_store_open(f.root, &f.id, &o, &s), 0);
    kvt_cold_tier ro;
    kvt_store_cold_tier(s, &ro);
    assert_int_equal(ro.flags, KVT_TIER_READ_ONLY);
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", b, 16, &e), 0);
    assert_int_equal(ro.store(ro.self, &e), KVT_EREADONLY);
    assert_int_equal(ro.spill(ro.self, &e), KVT_EREADONLY);
    assert_non_null(e.caches);
    kvt_tier_stats ts;
    assert_int_equal(ro.stats(ro.self, &ts), 0);
    assert_int_equal(ts.write_failures, 2);

    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_tier_level lv[2] = {{.tier = ro, .name = "ssd"}, {.tier = *mem_tier_iface(mt), .name = "memory"}};
    kvt_tier_chain_config cc = {.levels = lv, .n_levels = 2};
    kvt_tier_chain *c;
    assert_int_equal(kvt_tier_chain_create(&cc, &c), 0);
    kvt_cold_tier t;
    kvt_tier_chain_cold_tier(c, &t);
    assert_int_equal(t.flags, 0); /* the memory level is writable */
    assert_int_equal(t.spill(t.self, &e), 0);
    assert_int_equal(t.flush(t.self), 0);
    assert_true(mem_tier_has(mt, "", b, 16));
    assert_int_equal(kvt_store_find_exact(s, b, 16, "", &(kvt_cold_hit){0}), KVT_ENOTFOUND);
    kvt_cold_hit h;
    assert_int_equal(t.find(t.self, a, 20, "", &h), 0);
    assert_int_equal(h.prefix_len, 16);
    assert_int_equal(h.handle >> 60, 0);
    expect_restore(&t, h.handle, a, 16);
    kvt_tier_chain_destroy(c);
    mem_tier_destroy(mt);
    kvt_store_stats ss;
    kvt_store_get_stats(s, &ss);
    assert_int_equal(ss.write_refused, 2);
    assert_int_equal(kvt_store_close(s), 0);
    fx_done(&f);
}

/* A store whose byte budget holds about one entry of 16 tokens (1.5 times
 * what one takes on disk, measured in a scratch store), in f's root. */
static kvt_store *open_small(fx *f)
{
    char scratch[512];
    store_tmpdir(scratch, sizeof scratch, "tier-store-scratch");
    kvt_store *s = NULL;
    assert_int_equal(kvt_store_open(scratch, &f->id, NULL, &s), 0);
    kvt_cold_tier t;
    kvt_store_cold_tier(s, &t);
    int32_t p[16];
    pcu_seq(p, 16, 1);
    put(&t, p, 16);
    kvt_tier_stats st;
    assert_int_equal(t.stats(t.self, &st), 0);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(scratch);
    kvt_store_options o = {.max_bytes = st.bytes * 3 / 2};
    assert_int_equal(kvt_store_open(f->root, &f->id, &o, &s), 0);
    return s;
}

static kvt_tier_stats level_stats(kvt_tier_chain *c, int lvl)
{
    kvt_tier_stats s;
    assert_int_equal(kvt_tier_chain_level_stats(c, lvl, &s), 0);
    return s;
}

/* the store's budget evictions are demoted into the writable level below
 * (the in-memory tier), written behind by the chain: the evicted entry is
 * found there, whole, through the chain; counted on both levels */
static void test_store_demotes(void **state)
{
    (void)state;
    fx f;
    fx_init(&f);
    kvt_store *s = open_small(&f);
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_tier_level lv[2] = {{.name = "ssd"}, {.tier = *mem_tier_iface(mt), .name = "memory"}};
    kvt_store_cold_tier(s, &lv[0].tier);
    kvt_tier_chain_config cc = {.levels = lv, .n_levels = 2};
    kvt_tier_chain *c;
    assert_int_equal(kvt_tier_chain_create(&cc, &c), 0);
    kvt_cold_tier t;
    kvt_tier_chain_cold_tier(c, &t);
    int32_t a[20], b[20];
    pcu_seq(a, 20, 300);
    pcu_seq(b, 20, 400);
    put(&t, a, 16); /* into the store, the first writable level */
    assert_false(mem_tier_has(mt, "", a, 16));
    put(&t, b, 16); /* the store's budget evicts a */
    assert_int_equal(t.flush(t.self), 0);
    assert_int_equal(kvt_store_contains(s, a, 16, ""), 0);
    assert_true(mem_tier_has(mt, "", a, 16));
    kvt_tier_stats s0 = level_stats(c, 0), s1 = level_stats(c, 1);
    print_message("ssd: %llu evictions, %llu demotions; memory: %llu stores\n", (unsigned long long)s0.evictions,
                  (unsigned long long)s0.demotions, (unsigned long long)s1.stores);
    assert_int_equal(s0.evictions, 1);
    assert_int_equal(s0.demotions, 1);
    assert_int_equal(s0.demotions_dropped, 0);
    assert_int_equal(s1.stores, 1);
    kvt_cold_hit h;
    assert_int_equal(t.find(t.self, a, 20, "", &h), 0);
    assert_int_equal(h.prefix_len, 16);
    assert_int_equal(h.handle >> 60, 1); /* from the level below now */
    expect_restore(&t, h.handle, a, 16); /* and promotes it into the store */
    /* upper level first: the promoted copy holds a share of the memory
     * tier's release hook until the store has written it */
    kvt_tier_chain_destroy(c);
    assert_int_equal(kvt_store_close(s), 0);
    mem_tier_destroy(mt);
    fx_done(&f);
}

/* a write-behind level below the store (KVT_LEVEL_WRITE_BEHIND, e.g. a
 * shared Redis) got every kept prefix when it was put: the store's
 * eviction of it is not written into it a second time (demotions_skipped);
 * an entry it lacks (removed from it meanwhile) is demoted once */
static void test_demotion_beside_write_behind(void **state)
{
    (void)state;
    fx f;
    fx_init(&f);
    kvt_store *s = open_small(&f);
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_tier_level lv[2] = {{.name = "ssd"},
                            {.tier = *mem_tier_iface(mt), .name = "redis", .flags = KVT_LEVEL_WRITE_BEHIND}};
    kvt_store_cold_tier(s, &lv[0].tier);
    kvt_tier_chain_config cc = {.levels = lv, .n_levels = 2};
    kvt_tier_chain *c;
    assert_int_equal(kvt_tier_chain_create(&cc, &c), 0);
    kvt_cold_tier t;
    kvt_tier_chain_cold_tier(c, &t);
    int32_t a[20], b[20], d[20];
    pcu_seq(a, 20, 500);
    pcu_seq(b, 20, 600);
    pcu_seq(d, 20, 700);
    put(&t, a, 16); /* the store, and a copy written behind below */
    assert_int_equal(t.flush(t.self), 0);
    assert_true(mem_tier_has(mt, "", a, 16));
    int64_t writes = mem_tier_counts_get(mt).writes;
    put(&t, b, 16); /* b written behind too; the store evicts a, which is below already */
    assert_int_equal(t.flush(t.self), 0);
    assert_int_equal(kvt_store_contains(s, a, 16, ""), 0);
    kvt_tier_stats s0 = level_stats(c, 0);
    print_message("write-behind below: %lld writes before, %lld after; ssd: %llu evictions, %llu demotions, "
                  "%llu skipped\n",
                  (long long)writes, (long long)mem_tier_counts_get(mt).writes, (unsigned long long)s0.evictions,
                  (unsigned long long)s0.demotions, (unsigned long long)s0.demotions_skipped);
    assert_int_equal(mem_tier_counts_get(mt).writes, writes + 1); /* b only: a is not sent again */
    assert_int_equal(s0.evictions, 1);
    assert_int_equal(s0.demotions_skipped, 1);
    assert_int_equal(s0.demotions, 0);
    /* b leaves the level below (say its own eviction), then the store evicts it: demoted once */
    mem_tier_clear(mt);
    put(&t, d, 16);
    assert_int_equal(t.flush(t.self), 0);
    s0 = level_stats(c, 0);
    assert_int_equal(s0.evictions, 2);
    assert_int_equal(s0.demotions, 1);
    assert_int_equal(s0.demotions_skipped, 1);
    assert_true(mem_tier_has(mt, "", b, 16));
    assert_true(mem_tier_has(mt, "", d, 16));
    kvt_tier_chain_destroy(c);
    assert_int_equal(kvt_store_close(s), 0);
    mem_tier_destroy(mt);
    fx_done(&f);
}

/* the level below, wrapped: each spill into it looks at the default I/O
 * worker from inside the call (the write operation running it counts as a
 * running write) */
static kvt_cold_tier wrapped;
static int spills_seen, spills_on_worker;

static int probe_spill(void *self, kvt_entry *e)
{
    kvt_io_stats st;
    spills_seen++;
    if (kvt_io_default_stats_get(&st) == 0 && st.running_ops >= 1 && st.by_kind[KVT_IO_KIND_WRITE].queued_ops >= 1)
        spills_on_worker++;
    return wrapped.spill(self, e);
}

/* the chain's demotion of a store eviction is written by a write operation
 * on the process's I/O worker (no private writer thread): seen running from
 * inside the level's spill, and counted in the worker's write counters */
static void test_chain_writes_on_worker(void **state)
{
    (void)state;
    fx f;
    fx_init(&f);
    kvt_store *s = open_small(&f);
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    wrapped = *mem_tier_iface(mt);
    kvt_tier_level lv[2] = {{.name = "ssd"}, {.tier = wrapped, .name = "memory"}};
    lv[1].tier.spill = probe_spill;
    kvt_store_cold_tier(s, &lv[0].tier);
    kvt_tier_chain_config cc = {.levels = lv, .n_levels = 2};
    kvt_tier_chain *c;
    assert_int_equal(kvt_tier_chain_create(&cc, &c), 0);
    kvt_cold_tier t;
    kvt_tier_chain_cold_tier(c, &t);
    kvt_io_stats before, after;
    assert_int_equal(kvt_io_default_stats_get(&before), 0); /* the store holds the default worker */
    spills_seen = spills_on_worker = 0;
    int32_t a[20], b[20];
    pcu_seq(a, 20, 800);
    pcu_seq(b, 20, 900);
    put(&t, a, 16);
    put(&t, b, 16); /* the store's budget evicts a: demoted into memory by the chain */
    assert_int_equal(t.flush(t.self), 0);
    assert_true(mem_tier_has(mt, "", a, 16));
    assert_int_equal(kvt_io_default_stats_get(&after), 0);
    print_message("demotion spills %d, on the I/O worker %d; worker writes ran %llu -> %llu\n", spills_seen,
                  spills_on_worker, (unsigned long long)before.by_kind[KVT_IO_KIND_WRITE].ran,
                  (unsigned long long)after.by_kind[KVT_IO_KIND_WRITE].ran);
    assert_int_equal(spills_seen, 1);
    assert_int_equal(spills_on_worker, 1);
    assert_true(after.by_kind[KVT_IO_KIND_WRITE].ran >= before.by_kind[KVT_IO_KIND_WRITE].ran + 1);
    assert_int_equal(level_stats(c, 0).demotions, 1);
    kvt_tier_chain_destroy(c);
    assert_int_equal(kvt_store_close(s), 0);
    mem_tier_destroy(mt);
    fx_done(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lock_held),
        cmocka_unit_test(test_lock_released),
        cmocka_unit_test(test_read_only_level),
        cmocka_unit_test(test_store_demotes),
        cmocka_unit_test(test_demotion_beside_write_behind),
        cmocka_unit_test(test_chain_writes_on_worker),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
