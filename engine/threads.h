/*
 * engine/threads.h: the fork-join worker threads of the forward pass
 * (internal to engine/; not the process-wide pool of shared limits). One set
 * per model; used by one thread at a time.
 */
#ifndef KVT_ENGINE_THREADS_H
#define KVT_ENGINE_THREADS_H

#include <stdint.h>

typedef struct kvt_threads kvt_threads;
/** A job part: runs part `i` of `n` (0 <= i < n). */
typedef void (*kvt_threads_fn)(void *ctx, int i, int n);

/** Starts n_threads - 1 workers (n_threads <= 0: online CPUs, at most 8).
 * Caller frees with kvt_threads_destroy(). @return 0, KVT_ENOMEM, -errno. */
int kvt_threads_create(int n_threads, kvt_threads **out);
/** Threads taking part in a run, the caller included (>= 1; 1 for NULL). */
int kvt_threads_size(const kvt_threads *p);
/** Runs fn(ctx, i, n_parts) once for every i in [0, n_parts) and returns
 * when all are done. Parts are claimed one by one by the calling thread and
 * by the workers that are awake, so which thread runs a part varies (a part
 * must not depend on it) and a worker the OS has not scheduled yet never
 * holds the run up; give a few parts per thread. After a run the workers
 * spin (a pause per check) for up to 0.2 ms waiting for the next one, then
 * sleep; the caller spins as long for parts still running before it sleeps,
 * so back-to-back runs (a decode step's products) need no system call. Not
 * reentrant; one caller at a time. */
void kvt_threads_run(kvt_threads *p, kvt_threads_fn fn, void *ctx, int n_parts);
/** Stops and joins the workers. NULL is a no-op. */
void kvt_threads_destroy(kvt_threads *p);

#endif
