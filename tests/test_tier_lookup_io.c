/*
 * test_tier_lookup_io.c: a tier chain level with a lookup budget
 * (kvt_tier_level.find_budget_ms) is asked on the process's I/O worker,
 * never on a thread of the chain's own.
 *   - Its find is a foreground "find" operation of the default worker: seen
 *     running from inside the level's find, counted in the worker's find
 *     counters, and started while write-behind operations are still queued
 *     behind a background operation that holds the worker's background slot.
 *   - A level over its budget is skipped: the chain answers by the budget
 *     from the level above while the level's find is still held; the late
 *     answer is discarded (the worker counts a result nobody waited for)
 *     and never used; a find that could not start within the budget (every
 *     worker thread busy) is discarded unrun and the level is never called.
 *   - Chain destroy waits for a find still running in a level.
 * Under ASan a late answer that leaked would show at exit.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier/io.h"
#include "kvtier/tier_chain.h"
#include "io_gate.h"
#include "mem_tier.h"
#include "pc_util.h"
#include "store_util.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void pause_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The worker's kind named "find" (-1 when the worker has none). */
static int find_kind(void)
{
    for (int k = 0; k < KVT_IO_KINDS; k++)
        if (!strcmp(kvt_io_kind_name((kvt_io_kind)k), "find"))
            return k;
    return -1;
}

static kvt_io_stats io_stats(void)
{
    kvt_io_stats s;
    assert_int_equal(kvt_io_default_stats_get(&s), 0);
    return s;
}

/* ---- the probed lower level: a memory tier whose find can be held -------------- */

static pthread_mutex_t pmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pcv = PTHREAD_COND_INITIALIZER;
static kvt_cold_tier inner;  /* the memory tier's table */
static int held;             /* finds wait until it is 0 */
static int calls, returned;  /* finds called and finds that returned */
static int on_worker;        /* finds that saw a find operation running on the default worker */
static uint64_t bg_queued;   /* background operations queued while the last find ran */

static int probe_find(void *self, const int32_t *p, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_io_stats s;
    int k = find_kind();
    int seen = k >= 0 && kvt_io_default_stats_get(&s) == 0 && s.running_ops >= 1 && s.by_kind[k].queued_ops >= 1;
    pthread_mutex_lock(&pmu);
    calls++;
    on_worker += seen;
    bg_queued = seen ? s.queued_ops : 0;
    struct timespec dl; /* a held find gives up after 30 s, so a test that never releases it fails */
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 30 * KVT_TEST_TIME_SCALE;
    int wrc = 0;
    while (held && wrc == 0)
        wrc = pthread_cond_timedwait(&pcv, &pmu, &dl);
    pthread_mutex_unlock(&pmu);
    int rc = inner.find(self, p, n, ns, out);
    pthread_mutex_lock(&pmu);
    returned++;
    pthread_cond_broadcast(&pcv);
    pthread_mutex_unlock(&pmu);
    return rc;
}

static void hold(int on)
{
    pthread_mutex_lock(&pmu);
    held = on;
    pthread_cond_broadcast(&pcv);
    pthread_mutex_unlock(&pmu);
}

static int get(int *v)
{
    pthread_mutex_lock(&pmu);
    int x = *v;
    pthread_mutex_unlock(&pmu);
    return x;
}

/* ---- operations on the worker besides the finds ---------------------------------------- */

/* Holds worker threads; file scope, so the teardown opens it after a failed
 * assertion left a case (the worker's last release would wait for it). */
static io_gate gate = IO_GATE_INIT;

static int gate_teardown(void **state)
{
    (void)state;
    io_gate_open(&gate);
    hold(0);
    return 0;
}

static int quick_run(void *task, void **result)
{
    (void)task;
    (void)result;
    return 0;
}

static kvt_io_key key(uint64_t n) { return (kvt_io_key){0x7465737474696572ull, n}; }

/* ---- the fixture: [memory (8 tokens), probed memory (24 tokens, budget)] -------------- */

typedef struct fx {
    mem_tier *upper, *lower;
    kvt_tier_chain *chain;
    kvt_cold_tier t;
    kvt_io *io; /* a reference on the default worker, for the blocking operations */
    int32_t p[32];
} fx;

static void put(mem_tier *m, const int32_t *tok, int64_t n)
{
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", tok, n, &e), 0);
    const kvt_cold_tier *t = mem_tier_iface(m);
    assert_int_equal(t->store(t->self, &e), 0);
    kvt_entry_clear(&e);
}

static void fx_open(fx *f, int32_t budget_ms)
{
    memset(f, 0, sizeof *f);
    assert_int_equal(kvt_io_default_acquire(&f->io), 0);
    kvt_io_options o;
    assert_int_equal(kvt_io_options_get(f->io, &o), 0);
    assert_int_equal(o.threads, 2);        /* the default worker these cases are written for */
    assert_int_equal(o.max_background, 1);
    assert_int_equal(mem_tier_create(&f->upper), 0);
    assert_int_equal(mem_tier_create(&f->lower), 0);
    pcu_seq(f->p, 32, 300);
    put(f->upper, f->p, 8);
    put(f->lower, f->p, 24);
    inner = *mem_tier_iface(f->lower);
    kvt_tier_level lv[2] = {{.tier = *mem_tier_iface(f->upper), .name = "memory"},
                            {.tier = inner, .find_budget_ms = budget_ms, .name = "slow"}};
    lv[1].tier.find = probe_find;
    kvt_tier_chain_config cc = {.levels = lv, .n_levels = 2};
    assert_int_equal(kvt_tier_chain_create(&cc, &f->chain), 0);
    kvt_tier_chain_cold_tier(f->chain, &f->t);
    pthread_mutex_lock(&pmu);
    held = calls = returned = on_worker = 0;
    bg_queued = 0;
    pthread_mutex_unlock(&pmu);
}

static void fx_close(fx *f)
{
    kvt_tier_chain_destroy(f->chain);
    mem_tier_destroy(f->upper);
    mem_tier_destroy(f->lower);
    kvt_io_default_release(f->io);
}

static int64_t find_len(fx *f, int64_t n, int *level)
{
    kvt_cold_hit h = {0};
    int rc = f->t.find(f->t.self, f->p, n, "", &h);
    *level = rc == 0 ? (int)(h.handle >> 60) : -1;
    return rc == 0 ? h.prefix_len : 0;
}

static uint64_t over_budget(fx *f)
{
    kvt_tier_stats s;
    assert_int_equal(kvt_tier_chain_level_stats(f->chain, 1, &s), 0);
    return s.finds_over_budget;
}

/* Waits (bounded) until the default worker runs no find operation. */
static void finds_settle(int k)
{
    double t0 = now_ms();
    while (io_stats().by_kind[k].queued_ops && now_ms() - t0 < 10000.0 * KVT_TEST_TIME_SCALE)
        pause_ms(2);
    assert_int_equal(io_stats().by_kind[k].queued_ops, 0);
}

/* Asks the chain for 28 tokens of the prompt with the level's finds held,
 * until a find reached the level within its budget: on a loaded machine the
 * worker may not start it in time, and then it is discarded unrun (a miss
 * like any other, counted over budget) and the case asks again, for at most
 * 10 s times KVT_TEST_TIME_SCALE. Returns the chain's answer of the attempt
 * whose find is now held in the level; *took is its time, *over what it
 * added to finds_over_budget. */
static int64_t held_find(fx *f, int k, int *lvl, double *took, uint64_t *over)
{
    hold(1);
    double t_end = now_ms() + 10000.0 * KVT_TEST_TIME_SCALE;
    for (int tries = 1;; tries++) {
        int c0 = get(&calls);
        uint64_t o0 = over_budget(f);
        double t0 = now_ms();
        int64_t got = find_len(f, 28, lvl);
        *took = now_ms() - t0;
        *over = over_budget(f) - o0;
        if (io_stats().by_kind[k].queued_ops == 1) { /* started: held in the level */
            while (get(&calls) == c0 && now_ms() < t_end)
                pause_ms(1);
            assert_int_equal(get(&calls), c0 + 1);
            if (tries > 1)
                print_message("the find started within its budget at try %d\n", tries);
            return got;
        }
        assert_true(now_ms() < t_end);
        pause_ms(20);
    }
}

/* ---- cases ------------------------------------------------------------------------------- */

/* the budgeted level's find is a foreground find operation on the default
 * worker, and starts while write-behind waits */
static void test_find_is_foreground_op(void **state)
{
    (void)state;
    int k = find_kind();
    if (k < 0)
        fprintf(stderr, "test_tier_lookup_io: the I/O worker has no kind named \"find\"\n");
    assert_true(k >= 0);
    fx f;
    fx_open(&f, 2000 * KVT_TEST_TIME_SCALE); /* a budget it answers within */
    kvt_io_stats before = io_stats();
    int lvl;
    assert_int_equal(find_len(&f, 28, &lvl), 24);
    assert_int_equal(lvl, 1);
    kvt_io_stats after = io_stats();
    print_message("find on the budgeted level: seen on the worker %d of %d; find ops submitted %llu -> %llu, "
                  "ran %llu -> %llu\n", get(&on_worker), get(&calls),
                  (unsigned long long)before.by_kind[k].submitted, (unsigned long long)after.by_kind[k].submitted,
                  (unsigned long long)before.by_kind[k].ran, (unsigned long long)after.by_kind[k].ran);
    assert_int_equal(get(&calls), 1);
    assert_int_equal(get(&on_worker), 1);
    assert_int_equal(after.by_kind[k].submitted - before.by_kind[k].submitted, 1);
    assert_int_equal(after.by_kind[k].ran - before.by_kind[k].ran, 1);
    assert_int_equal(after.by_kind[k].failed - before.by_kind[k].failed, 0);

    /* write-behind holds the one background slot and three more wait: the
     * request's find still starts at once (foreground goes first) */
    io_gate_hold(f.io, &gate, key(1), KVT_IO_BACKGROUND);
    for (uint64_t i = 0; i < 3; i++) {
        kvt_io_op op = {.kind = KVT_IO_KIND_PREFETCH, .key = key(10 + i), .priority = KVT_IO_BACKGROUND,
                        .run = quick_run};
        assert_int_equal(kvt_io_submit(f.io, &op, NULL), 0);
    }
    double t0 = now_ms();
    assert_int_equal(find_len(&f, 28, &lvl), 24);
    double took = now_ms() - t0;
    pthread_mutex_lock(&pmu);
    uint64_t waiting = bg_queued;
    pthread_mutex_unlock(&pmu);
    print_message("with write-behind queued: the find answered in %.1f ms while %llu background operations "
                  "were queued\n", took, (unsigned long long)waiting);
    assert_int_equal(lvl, 1);
    assert_int_equal(get(&on_worker), 2);
    assert_int_equal(waiting, 3);
    assert_int_equal(over_budget(&f), 0);
    io_gate_open(&gate);
    assert_int_equal(kvt_io_flush(f.io, 10000ull * KVT_TEST_TIME_SCALE), 0);
    fx_close(&f);
}

/* a level over its budget is skipped while the request goes on; its late
 * answer is discarded by the worker, never used */
static void test_over_budget_discarded(void **state)
{
    (void)state;
    int k = find_kind();
    assert_true(k >= 0);
    fx f;
    fx_open(&f, 40);
    kvt_io_stats before = io_stats();
    int lvl;
    double took;
    uint64_t over;
    int64_t got = held_find(&f, k, &lvl, &took, &over);
    int ret = get(&returned);
    kvt_io_stats during = io_stats();
    print_message("held level (budget 40 ms): answered %lld tokens from level %d in %.1f ms; level finds "
                  "called %d, returned %d; find ops running %llu\n", (long long)got, lvl, took, get(&calls), ret,
                  (unsigned long long)during.by_kind[k].queued_ops);
    assert_int_equal(got, 8);  /* the upper level's prefix: the request goes on */
    assert_int_equal(lvl, 0);
    assert_int_equal(ret, 0);  /* while the level's find is still held */
    assert_true(took >= 39);   /* after its budget */
    assert_int_equal(over, 1);
    assert_int_equal(during.by_kind[k].queued_ops, 1); /* still on the worker */
    hold(0);
    finds_settle(k);
    kvt_io_stats after = io_stats();
    print_message("released: level finds returned %d; results discarded %llu -> %llu\n", get(&returned),
                  (unsigned long long)before.results_discarded, (unsigned long long)after.results_discarded);
    assert_int_equal(get(&returned), 1);
    assert_int_equal(after.results_discarded - before.results_discarded, 1);
    assert_int_equal(after.by_kind[k].ran - before.by_kind[k].ran, 1);
    fx_close(&f);
}

/* both worker threads busy: the find cannot start within its budget; it is
 * discarded unrun (the level is never called) and the request goes on */
static void test_not_started_discarded(void **state)
{
    (void)state;
    int k = find_kind();
    assert_true(k >= 0);
    fx f;
    fx_open(&f, 40);
    io_gate_hold(f.io, &gate, key(20), KVT_IO_FOREGROUND);
    io_gate_hold(f.io, &gate, key(21), KVT_IO_FOREGROUND);
    kvt_io_stats before = io_stats();
    int lvl;
    double t0 = now_ms();
    int64_t got = find_len(&f, 28, &lvl);
    double took = now_ms() - t0;
    kvt_io_stats after = io_stats();
    print_message("worker busy (budget 40 ms): answered %lld tokens from level %d in %.1f ms; level called %d; "
                  "discarded %llu -> %llu\n", (long long)got, lvl, took, get(&calls),
                  (unsigned long long)before.discarded, (unsigned long long)after.discarded);
    assert_int_equal(got, 8);
    assert_int_equal(lvl, 0);
    assert_true(took >= 39);
    assert_int_equal(get(&calls), 0);
    assert_int_equal(after.discarded - before.discarded, 1);
    assert_int_equal(after.by_kind[k].ran - before.by_kind[k].ran, 0);
    assert_int_equal(after.by_kind[k].queued_ops, 0);
    assert_int_equal(over_budget(&f), 1);
    io_gate_open(&gate);
    assert_int_equal(kvt_io_flush(f.io, 10000ull * KVT_TEST_TIME_SCALE), 0);
    assert_int_equal(get(&calls), 0);
    fx_close(&f);
}

static void *release_later(void *arg)
{
    (void)arg;
    pause_ms(150);
    hold(0);
    return NULL;
}

/* destroy waits for a find still running in a level (the level's table
 * stays valid until destroy returns) */
static void test_destroy_waits_for_find(void **state)
{
    (void)state;
    int k = find_kind();
    assert_true(k >= 0);
    fx f;
    fx_open(&f, 40);
    int lvl;
    double took_find;
    uint64_t over;
    assert_int_equal(held_find(&f, k, &lvl, &took_find, &over), 8);
    assert_int_equal(get(&returned), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, release_later, NULL), 0);
    double t0 = now_ms();
    kvt_tier_chain_destroy(f.chain);
    double took = now_ms() - t0;
    int ret = get(&returned);
    print_message("destroy returned after %.1f ms; the held find returned %d\n", took, ret);
    assert_int_equal(ret, 1);
    assert_true(took >= 100);
    pthread_join(th, NULL);
    mem_tier_destroy(f.upper);
    mem_tier_destroy(f.lower);
    kvt_io_default_release(f.io);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_find_is_foreground_op, gate_teardown),
        cmocka_unit_test_teardown(test_over_budget_discarded, gate_teardown),
        cmocka_unit_test_teardown(test_not_started_discarded, gate_teardown),
        cmocka_unit_test_teardown(test_destroy_waits_for_find, gate_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
