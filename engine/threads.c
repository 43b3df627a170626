/*
 * threads.c: the forward pass's fork-join worker threads. A model owns
 * one set; kvt_threads_run() runs fn(ctx, i, n) for every part i in [0, n) and
 * returns when all are done. Parts are claimed one at a time from a shared
 * counter by the caller and by every worker that is awake, so a worker that
 * the OS has not scheduled (a loaded machine) delays a run by at most the
 * part it already holds: the caller takes the rest itself and never waits for
 * a worker to wake up. It owns its worker threads and nothing else; it must
 * never run jobs of two callers at once (the model is used by one thread at a
 * time) and never leave a worker running after kvt_threads_destroy().
 */
#include "threads.h"

#include "util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

struct kvt_threads {
    int n_workers; /* threads besides the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation; /* bumped per run (under mu) */
    int stop;            /* (under mu) */
    kvt_threads_fn fn;     /* the run's job (under mu) */
    void *ctx;
    int n_parts;
    /* (generation << 32) | next part to claim: a claim succeeds only for the
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
        if (atomic_fetch_add_explicit(&p->parts_done, 1, memory_order_acq_rel) + 1 == n) {
            pthread_mutex_lock(&p->mu); /* the last part: wake the caller */
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
        c = atomic_load_explicit(&p->claim, memory_order_acquire);
    }
}

static void *worker_main(void *arg)
{
    worker_arg *wa = arg;
    kvt_threads *p = wa->p;
    kvt__free(wa);
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        kvt_threads_fn fn = p->fn;
        void *ctx = p->ctx;
        int n = p->n_parts;
        pthread_mutex_unlock(&p->mu);
        run_parts(p, seen, fn, ctx, n);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
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
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_parts = n_parts;
    uint64_t gen = ++p->generation;
    atomic_store_explicit(&p->parts_done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (gen & 0xffffffffu) << 32, memory_order_release);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    run_parts(p, gen, fn, ctx, n_parts);
    pthread_mutex_lock(&p->mu);
    while (atomic_load_explicit(&p->parts_done, memory_order_acquire) < n_parts)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

void kvt_threads_destroy(kvt_threads *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
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
