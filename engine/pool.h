/*
 * engine/pool.h: fork-join thread pool used by the forward pass (internal to
 * engine/). One pool per model; used by one thread at a time.
 */
#ifndef KVT_ENGINE_POOL_H
#define KVT_ENGINE_POOL_H

#include <stdint.h>

typedef struct kvt__pool kvt__pool;
/** A job part: runs part `i` of `n` (0 <= i < n). */
typedef void (*kvt__pool_fn)(void *ctx, int i, int n);

/** Starts n_threads - 1 workers (n_threads <= 0: online CPUs, at most 8).
 * Caller frees with kvt__pool_free(). @return 0, KVT_ENOMEM, -errno. */
int kvt__pool_create(int n_threads, kvt__pool **out);
/** Threads taking part in a run, the caller included (>= 1; 1 for NULL). */
int kvt__pool_size(const kvt__pool *p);
/** Runs fn(ctx, i, n_parts) once for every i in [0, n_parts) and returns
 * when all are done. Parts are claimed one by one by the calling thread and
 * by the workers that are awake, so which thread runs a part varies (a part
 * must not depend on it) and a worker the OS has not scheduled yet never
 * holds the run up; give a few parts per thread. Not reentrant; one caller at
 * a time. */
void kvt__pool_run(kvt__pool *p, kvt__pool_fn fn, void *ctx, int n_parts);
/** Stops and joins the workers. NULL is a no-op. */
void kvt__pool_free(kvt__pool *p);

#endif
