/*
 * fault_walk.h: SQLite's fault walk (fail the N-th I/O call of a workload,
 * for every N until the workload makes fewer than N calls) spread over
 * worker processes. Worker w of W runs N = w+1, w+1+W, ... in a process of
 * its own (fork: the library's I/O shim, its counters and any store state
 * are per process), so a walk whose runs wait on I/O (the I/O-delay shim,
 * tests/support/io_delay_preload.c, sleeps on every fsync and write) takes
 * about 1/W of the time the same runs take one after another. Every N is
 * still run and checked exactly as a sequential walk checks it: the walk
 * ends at the first N whose run saw no failure (the workload made fewer
 * calls), every N before it must have failed, and that fault-free run must
 * have made exactly N-1 calls. Tests only; not thread-safe (call it from the
 * test's main thread, with no store, tier or thread of the library open).
 */
#ifndef KVT_TEST_FAULT_WALK_H
#define KVT_TEST_FAULT_WALK_H

#include <stdint.h>

/** What one run reports (written by the run function in the worker). */
typedef struct fw_run {
    int64_t n;      /* the call that was armed to fail (set by the walk) */
    int64_t calls;  /* counted calls the run made (kvt__io_calls) */
    int64_t failed; /* calls failed (kvt__io_failures): 0 ends the walk */
    int32_t ok;     /* the workload succeeded in spite of the fault */
    int32_t bad;    /* violations found (each printed by the run) */
    int32_t v[8];   /* the test's own figures (checked by the test on the fault-free run) */
} fw_run;

/** Runs the workload once with call n armed to fail; fills out->calls,
 * failed, ok, bad and v. `worker` (0 .. workers-1) names the process's
 * private resources (a Redis server of its own). Must not use cmocka
 * assertions (it runs in a child process): report through bad. */
typedef void (*fw_run_fn)(int64_t n, int worker, void *ctx, fw_run *out);

/** The figures of a walk. */
typedef struct fw_result {
    int64_t calls;          /* calls in the fault-free workload (its last N - 1) */
    int64_t walked;         /* runs with N <= calls (each failed a call) */
    int64_t ok;             /* of those, runs that succeeded anyway */
    int64_t failed_cleanly; /* of those, runs that failed without a violation */
    int64_t bad_runs;       /* runs (any N) with a violation, or a worker that died */
    fw_run clean;           /* the fault-free run that ended the walk */
} fw_result;

/** The number of workers: KVT_FAULT_WORKERS when set (1 = sequential in
 * child processes), else 8. */
int fault_walk_workers(void);

/** Walks n = 1, 2, ... up to max_n over `workers` processes (1..64).
 * Returns 0 when the walk completed (every N up to the fault-free run was
 * run and failed a call, and that run made exactly N-1 calls), -1 with a
 * message on stderr otherwise (a worker that died or could not start, no
 * fault-free run below max_n, a hole in the walk). Violations are counted
 * in res->bad_runs, not in the return value. */
int fault_walk(int workers, int64_t max_n, fw_run_fn fn, void *ctx, fw_result *res);

#endif
