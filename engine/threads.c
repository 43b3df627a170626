/*
 * threads.c: the forward pass's fork-join worker threads. A model owns
 * one set; kvt_threads_run() runs fn(ctx, i, n) for every part i in [0, n) and
 * returns when all are done. Parts are claimed one at a time from a shared
 * counter by the caller and by every worker that is awake, so a worker that
 * the OS has not scheduled (a loaded machine) delays a run by at most the
 * part it already holds: the caller takes the rest itself and never waits for
 * a worker to wake up. Between runs a worker spins (with a pause) for up to
 * KVT_THREADS_SPIN checks before it sleeps on a condition variable, and the
 * caller spins as long for the last parts before it sleeps: a decode step
 * runs dozens of products back to back with little serial work between them,
 * so a run normally starts and ends without a system call. It owns its
 * worker threads and nothing else; it must never run jobs of two callers at
 * once (the model is used by one thread at a time) and never leave a worker
 * running after kvt_threads_destroy().
 */
#include "threads.h"

#include "util.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* How many checks (each followed by a pause instruction) a worker makes
 * for the next run, and the caller for the last parts of a run, before it
 * sleeps: about 0.2 ms of spinning at 13 ns per pause. Counted in checks, not
 * in time, so a spinning thread the OS preempts (a loaded machine) still
 * spins its share when it runs again instead of going to sleep at once. */
#define KVT_THREADS_SPIN 16384

struct kvt_threads {
    int n_workers; /* threads besides the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    /* The published run, a sequence lock: odd while the caller writes fn,
     * ctx and n_parts, even (2 * run number) once they hold that run's job;
     * a worker reads them between two equal even values. */
    _Atomic uint64_t seq;
    atomic_int stop;
    _Atomic(kvt_threads_fn) fn; /* the run's job */
    _Atomic(void *) ctx;
    atomic_int n_parts;
    atomic_int sleepers;       /* workers in (or entering) pthread_cond_wait on go */
    atomic_int caller_waiting; /* 1 while the caller sleeps (or is about to) on done */
    /* (run number << 32) | next part to claim: a claim succeeds only for the
     * run it was read for, so a late worker never takes a part of the next */
    _Atomic uint64_t claim;
    atomic_int parts_done; /* parts of the current run finished */
};

typedef struct {
    kvt_threads *p;
    int index; /* 1..n_workers */
} worker_arg;

/* Claims and runs parts of run `gen` until none is left; returns how many
 * it ran. */
static int run_parts(kvt_threads *p, uint64_t gen, kvt_threads_fn fn, void *ctx, int n)
{
    int ran = 0;
    uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        if (c >> 32 != (gen & 0xffffffffu) || (int)(c & 0xffffffffu) >= n)
            return ran;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* c now holds the current value */
        fn(ctx, (int)(c & 0xffffffffu), n);
        ran++;
        if (atomic_fetch_add(&p->parts_done, 1) + 1 == n && atomic_load(&p->caller_waiting)) {
            pthread_mutex_lock(&p->mu); /* the last part and the caller sleeps: wake it */
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
        c = atomic_load_explicit(&p->claim, memory_order_acquire);
    }
}

/* The run after `seen` (an even seq value) once it is published: spins for
 * up to KVT_THREADS_SPIN checks, then sleeps until kvt_threads_run publishes one.
 * Returns its seq value (even), or 0 when the set is stopping. */
static uint64_t wait_run(kvt_threads *p, uint64_t seen)
{
    for (;;) {
        for (int spin = 0; spin < KVT_THREADS_SPIN; spin++) {
            if (atomic_load(&p->stop))
                return 0;
            uint64_t s = atomic_load_explicit(&p->seq, memory_order_acquire);
            if (s != seen && !(s & 1))
                return s;
            cpu_relax();
        }
        if (atomic_load(&p->seq) != seen) { /* a run being written by a caller the OS paused */
            sched_yield();
            continue;
        }
        pthread_mutex_lock(&p->mu);
        atomic_fetch_add(&p->sleepers, 1); /* seq_cst: kvt_threads_run sees it, or we see its seq */
        while (!atomic_load(&p->stop) && atomic_load(&p->seq) == seen)
            pthread_cond_wait(&p->go, &p->mu);
        atomic_fetch_sub(&p->sleepers, 1);
        pthread_mutex_unlock(&p->mu);
    }
}

static void *worker_main(void *arg)
{
    worker_arg *wa = arg;
    kvt_threads *p = wa->p;
    kvt__free(wa);
    uint64_t seen = 0;
    for (;;) {
        uint64_t s = wait_run(p, seen);
        if (!s)
            break;
        kvt_threads_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
        int n = atomic_load_explicit(&p->n_parts, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        seen = s;
        if (atomic_load_explicit(&p->seq, memory_order_relaxed) != s)
            continue; /* the caller moved on to a later run while we read: this one is over */
        run_parts(p, s >> 1, fn, ctx, n);
    }
    return NULL;
}

int kvt_threads_create(int n_threads, kvt_threads **out)
{
    *out = NULL;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n < 1 ? 1 : n > 8 ? 8 : (int)n;
    }
    kvt_threads *p = kvt__calloc(1, sizeof *p);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "engine threads: out of memory");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->seq, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->fn, NULL);
    atomic_init(&p->ctx, NULL);
    atomic_init(&p->n_parts, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->caller_waiting, 0);
    atomic_init(&p->claim, 0);
    atomic_init(&p->parts_done, 0);
    p->threads = kvt__calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->threads) {
        kvt_threads_destroy(p);
        return kvt__fail(KVT_ENOMEM, "engine threads: out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = kvt__malloc(sizeof *wa);
        if (!wa) {
            kvt_threads_destroy(p);
            return kvt__fail(KVT_ENOMEM, "engine threads: out of memory");
        }
        wa->p = p;
        wa->index = i;
        int rc = pthread_create(&p->threads[i - 1], NULL, worker_main, wa);
        if (rc != 0) {
            kvt__free(wa);
            kvt_threads_destroy(p);
            return kvt__fail(-rc, "engine threads: cannot start a thread");
        }
        p->n_workers++;
    }
    *out = p;
    return 0;
}

int kvt_threads_size(const kvt_threads *p) { return p ? p->n_workers + 1 : 1; }

void kvt_threads_run(kvt_threads *p, kvt_threads_fn fn, void *ctx, int n_parts)
{
    if (!p || p->n_workers == 0 || n_parts <= 1) {
        for (int i = 0; i < n_parts; i++)
            fn(ctx, i, n_parts);
        return;
    }
    uint64_t s = atomic_load_explicit(&p->seq, memory_order_relaxed) + 1; /* odd: writing */
    atomic_store_explicit(&p->seq, s, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->n_parts, n_parts, memory_order_relaxed);
    uint64_t gen = (s + 1) >> 1;
    atomic_store_explicit(&p->parts_done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (gen & 0xffffffffu) << 32, memory_order_release);
    atomic_store(&p->seq, s + 1); /* seq_cst: published (see wait_run's sleepers) */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
    }
    run_parts(p, gen, fn, ctx, n_parts);
    for (int spin = 0; atomic_load_explicit(&p->parts_done, memory_order_acquire) < n_parts; spin++) {
        cpu_relax();
        if (spin >= KVT_THREADS_SPIN) {
            pthread_mutex_lock(&p->mu);
            atomic_store(&p->caller_waiting, 1); /* seq_cst: the last part's worker sees it or we see its count */
            while (atomic_load(&p->parts_done) < n_parts)
                pthread_cond_wait(&p->done, &p->mu);
            atomic_store(&p->caller_waiting, 0);
            pthread_mutex_unlock(&p->mu);
            break;
        }
    }
}

void kvt_threads_destroy(kvt_threads *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++)
        pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->mu);
    kvt__free(p->threads);
    kvt__free(p);
}
