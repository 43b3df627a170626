/*
 * test_threads.c: the forward pass's worker threads (engine/threads.c). Every part of
 * every run is run exactly once and is finished when kvt_threads_run returns,
 * over many runs of 1..32 parts back to back (a worker still waking from one
 * run must never take a part of the next), with a part that stalls (the
 * others are taken by the threads that are free), with jobs that change
 * from run to run while workers spin and after they went to sleep, a
 * sleeping worker woken by the next run (it takes parts of it), and for a
 * pool of one thread. Run under TSan too (make test-tsan).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "threads.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

typedef struct {
    atomic_int count[32];
    int stall_part; /* -1: none */
    int run;
} job;

static void part(void *ctx, int i, int n)
{
    job *j = ctx;
    assert_true(i >= 0 && i < n && n <= 32);
    if (i == j->stall_part) {
        struct timespec ts = {0, 2000000}; /* 2 ms */
        nanosleep(&ts, NULL);
    }
    atomic_fetch_add(&j->count[i], 1);
}

static void check_runs(kvt_threads *p, int runs, int stall)
{
    job j;
    for (int r = 0; r < runs; r++) {
        int n = 1 + (r * 7) % 32;
        for (int i = 0; i < 32; i++)
            atomic_init(&j.count[i], 0);
        j.stall_part = stall && r % 50 == 0 ? n / 2 : -1;
        j.run = r;
        kvt_threads_run(p, part, &j, n);
        for (int i = 0; i < 32; i++)
            assert_int_equal(atomic_load(&j.count[i]), i < n ? 1 : 0);
    }
}

static void test_every_part_once(void **state)
{
    (void)state;
    kvt_threads *p = NULL;
    assert_int_equal(kvt_threads_create(3, &p), 0);
    assert_int_equal(kvt_threads_size(p), 3);
    check_runs(p, 20000, 0);
    check_runs(p, 500, 1);
    kvt_threads_destroy(p);
}

/* Runs whose job (ctx) and part count change every time, some back to back
 * (workers still spinning), some after a pause longer than the workers' spin
 * (workers asleep, woken by the run): every part of every run is run once,
 * with its own run's ctx, and a set is destroyed with its workers spinning
 * and with them asleep. */
static void test_spin_and_sleep(void **state)
{
    (void)state;
    for (int t = 2; t <= 3; t++) {
        kvt_threads *p = NULL;
        assert_int_equal(kvt_threads_create(t, &p), 0);
        job jobs[2];
        for (int k = 0; k < 2; k++) {
            for (int i = 0; i < 32; i++)
                atomic_init(&jobs[k].count[i], 0);
            jobs[k].stall_part = -1;
        }
        for (int r = 0; r < 3000; r++) {
            job *j = &jobs[r & 1], *other = &jobs[!(r & 1)];
            int n = 2 + (r * 13) % 31;
            j->run = r;
            kvt_threads_run(p, part, j, n);
            for (int i = 0; i < 32; i++) { /* this run's parts once each, none in the other job */
                assert_int_equal(atomic_load(&j->count[i]), i < n ? 1 : 0);
                assert_int_equal(atomic_load(&other->count[i]), 0);
            }
            for (int i = 0; i < 32; i++)
                atomic_store(&j->count[i], 0);
            if (r % 100 == 99) {
                struct timespec ts = {0, 1000000}; /* 1 ms: past the spin, the workers sleep */
                nanosleep(&ts, NULL);
            }
        }
        if (t == 3) {
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
        kvt_threads_destroy(p); /* t == 2: right after a run; t == 3: asleep */
    }
}

typedef struct {
    pthread_t caller;
    atomic_int by_worker; /* parts a worker (not the caller) ran */
} who_job;

static void who_part(void *ctx, int i, int n)
{
    (void)i, (void)n;
    who_job *j = ctx;
    struct timespec ts = {0, 500000}; /* 0.5 ms: long enough for a woken worker to claim a part */
    nanosleep(&ts, NULL);
    if (!pthread_equal(pthread_self(), j->caller))
        atomic_fetch_add(&j->by_worker, 1);
}

/* A worker asleep (past its spin) is woken by the next run and takes parts
 * of it: without the wake-up the caller would run every part alone and the
 * results would still be right, so this is checked by who ran them. Up to
 * 50 tries of 16 parts after a 2 ms pause each, so a loaded machine that
 * runs the woken worker late fails no try by itself. */
static void test_sleeping_worker_wakes(void **state)
{
    (void)state;
    kvt_threads *p = NULL;
    assert_int_equal(kvt_threads_create(2, &p), 0);
    who_job j;
    j.caller = pthread_self();
    atomic_init(&j.by_worker, 0);
    int tries = 0;
    while (atomic_load(&j.by_worker) == 0 && tries++ < 50) {
        struct timespec ts = {0, 2000000}; /* past the spin: the worker sleeps */
        nanosleep(&ts, NULL);
        kvt_threads_run(p, who_part, &j, 16);
    }
    print_message("  a woken worker ran %d parts (try %d)\n", atomic_load(&j.by_worker), tries);
    assert_true(atomic_load(&j.by_worker) > 0);
    kvt_threads_destroy(p);
}

static void test_single_thread_and_null(void **state)
{
    (void)state;
    kvt_threads *p = NULL;
    assert_int_equal(kvt_threads_create(1, &p), 0);
    assert_int_equal(kvt_threads_size(p), 1);
    check_runs(p, 100, 0);
    kvt_threads_destroy(p);
    assert_int_equal(kvt_threads_size(NULL), 1);
    check_runs(NULL, 100, 0);
    kvt_threads_destroy(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_part_once),
        cmocka_unit_test(test_spin_and_sleep),
        cmocka_unit_test(test_sleeping_worker_wakes),
        cmocka_unit_test(test_single_thread_and_null),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
