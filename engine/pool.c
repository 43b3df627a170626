/*
 * pool.c: a tiny fork-join thread pool for the forward pass. A model owns
 * one; kvt__pool_run() runs fn(ctx, i, n) for i in [0, n) with the caller as
 * participant 0 and returns when all are done. It owns its worker threads
 * and nothing else; it must never run jobs of two callers at once (the model
 * is used by one thread at a time) and never leave a worker running after
 * kvt__pool_free().
 */
#include "pool.h"

#include "internal.h"

#include <pthread.h>
#include <unistd.h>

struct kvt__pool {
    int n_workers; /* threads besides the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation; /* bumped per job (under mu) */
    int pending;         /* workers still running the job (under mu) */
    int stop;
    kvt__pool_fn fn;
    void *ctx;
    int n_parts;
};

typedef struct {
    kvt__pool *p;
    int index; /* 1..n_workers */
} worker_arg;

static void *worker_main(void *arg)
{
    worker_arg *wa = arg;
    kvt__pool *p = wa->p;
    int me = wa->index;
    kvt__free(wa);
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        kvt__pool_fn fn = p->fn;
        void *ctx = p->ctx;
        int n = p->n_parts;
        pthread_mutex_unlock(&p->mu);
        if (me < n)
            fn(ctx, me, n);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int kvt__pool_create(int n_threads, kvt__pool **out)
{
    *out = NULL;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n < 1 ? 1 : n > 8 ? 8 : (int)n;
    }
    kvt__pool *p = kvt__calloc(1, sizeof *p);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "thread pool: out of memory");
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->threads = kvt__calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->threads) {
        kvt__pool_free(p);
        return kvt__fail(KVT_ENOMEM, "thread pool: out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = kvt__malloc(sizeof *wa);
        if (!wa) {
            kvt__pool_free(p);
            return kvt__fail(KVT_ENOMEM, "thread pool: out of memory");
        }
        wa->p = p;
        wa->index = i;
        int rc = pthread_create(&p->threads[i - 1], NULL, worker_main, wa);
        if (rc != 0) {
            kvt__free(wa);
            kvt__pool_free(p);
            return kvt__fail(-rc, "thread pool: cannot start a thread");
        }
        p->n_workers++;
    }
    *out = p;
    return 0;
}

int kvt__pool_size(const kvt__pool *p) { return p ? p->n_workers + 1 : 1; }

void kvt__pool_run(kvt__pool *p, kvt__pool_fn fn, void *ctx, int n_parts)
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
    p->pending = p->n_workers;
    p->generation++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    /* the caller is participant 0, and takes parts beyond the pool's size */
    fn(ctx, 0, n_parts);
    for (int i = p->n_workers + 1; i < n_parts; i++)
        fn(ctx, i, n_parts);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

void kvt__pool_free(kvt__pool *p)
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
