/*
 * kvtier/io.h: one bounded background I/O worker for a process.
 *
 * A kvt_io runs prepared I/O operations (SSD writes and restores, shard
 * hashing, remote gets and sets, prefetches, a tier chain's budgeted
 * lookups, generation checkpoints) on a fixed number of threads
 * from a queue bounded both in operations and in bytes. Callers never block
 * on admission: a full queue refuses (KVT_EAGAIN) and the caller decides
 * (write-behind counts a drop, a restore falls back to prefill).
 *
 * Operations are keyed exactly by (kind, 128-bit content key). A submission
 * whose key matches an operation already queued or running is coalesced: it
 * does not run again, it gets one more ticket on the same operation (one
 * read, many waiters). Every ticket is an independent interest:
 *   - kvt_io_wait blocks until the operation completes and says, for this
 *     ticket, publish (use the result) or discard;
 *   - kvt_io_cancel releases the interest; when no interest is left and the
 *     operation has not started, it is discarded without running; when it
 *     has started, its result is discarded on completion;
 *   - kvt_io_ticket_release ends the ticket (cancelling it first if the
 *     operation is not complete) and drops its hold on the result.
 * A submission without a ticket (write-behind, fire and forget) holds an
 * interest the worker keeps until the operation has run.
 *
 * A waiter that cannot block (a callback API such as an asynchronous
 * restore) submits with kvt_io_submit_notify instead: it is told once, on
 * completion, on the thread that completed the operation.
 *
 * Two priorities: KVT_IO_FOREGROUND operations (a restore or a lookup a
 * request waits for, a hash a writer waits for) start before any KVT_IO_BACKGROUND one
 * (write-behind, prefetch); first in, first out within a priority. At most
 * max_background background operations run at once (by default all threads
 * but one), so a foreground operation finds a free thread even while
 * write-behind is busy. A coalesced foreground submission promotes a queued
 * background operation.
 *
 * Ownership and lifetime: a kvt_io is created by kvt_io_create and ended by
 * kvt_io_destroy, or shared through the process's default worker
 * (kvt_io_default_acquire / kvt_io_default_release, reference counted:
 * created by the first acquire, flushed and destroyed by the last release).
 * A component that is given a kvt_io (the SSD store's options, the remote
 * tier's) borrows it: the worker must outlive it. A component given none
 * takes a reference on the default worker at open and drops it at close.
 * Operations must not wait for other operations of the same worker from a
 * worker thread unless they can run them themselves (kvt_io_run_here), or
 * a full set of threads could wait on a queue nobody serves.
 *
 * Thread-safety: every call is thread-safe; one ticket may be waited on by
 * one thread at a time, and ends with exactly one kvt_io_ticket_release.
 */
#ifndef KVTIER_IO_H
#define KVTIER_IO_H

#include "kvtier/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Kind of an operation (part of its exact key). */
typedef enum kvt_io_kind {
    KVT_IO_KIND_RESTORE = 0,    /**< read stored state back (SSD restore) */
    KVT_IO_KIND_WRITE = 1,      /**< write-behind of state to a tier */
    KVT_IO_KIND_HASH = 2,       /**< checksum of a shard */
    KVT_IO_KIND_REMOTE_GET = 3, /**< remote tier read */
    KVT_IO_KIND_REMOTE_SET = 4, /**< remote tier write */
    KVT_IO_KIND_PREFETCH = 5,   /**< speculative restore nobody waits for yet */
    KVT_IO_KIND_FIND = 6,       /**< a tier's lookup (a tier chain level's find with a time budget) */
    KVT_IO_KINDS = 7       /**< number of kinds, not a kind */
} kvt_io_kind;

/** Priority of an operation. */
typedef enum kvt_io_priority {
    KVT_IO_FOREGROUND = 0, /**< a request waits for it (a restore before prefill) */
    KVT_IO_BACKGROUND = 1  /**< nobody waits now (write-behind, prefetch) */
} kvt_io_priority;

/** A 128-bit content key: the same two 64-bit halves (lo, hi) every tier
 * names stored state by (an entry key or a block key). */
typedef struct kvt_io_key {
    uint64_t lo, hi;
} kvt_io_key;

/** What a ticket's holder does with a completed operation. */
typedef enum kvt_io_disposition {
    KVT_IO_PUBLISH = 0, /**< the operation ran and succeeded: use its result */
    KVT_IO_DISCARD = 1  /**< failed, cancelled, discarded or shut down: drop it */
} kvt_io_disposition;

/** Runs one operation on a worker thread: does the I/O of `task` and may
 * set *result to a value shared (read-only) by every ticket. Returns 0 or a
 * negative code (the tickets see it as their status). */
typedef int (*kvt_io_run_fn)(void *task, void **result);

/** Frees an operation's task and result (result NULL if it never ran or
 * set none). Called exactly once per accepted submission that was not
 * coalesced: when the operation is discarded before it starts, or after it
 * ran once no ticket holds it any more. Called without any lock of the
 * worker held, on a worker thread or on the thread that dropped the last
 * hold. May be NULL (nothing to free). */
typedef void (*kvt_io_free_fn)(void *task, void *result);

/** A prepared operation (copied by kvt_io_submit). */
typedef struct kvt_io_op {
    kvt_io_kind kind;         /**< with key: the exact identity */
    kvt_io_key key;           /**< content key of the state read or written */
    kvt_io_priority priority; /**< KVT_IO_FOREGROUND or KVT_IO_BACKGROUND */
    uint64_t bytes;           /**< bytes the operation moves (charged to the byte bound while queued or running) */
    kvt_io_run_fn run;        /**< required */
    kvt_io_free_fn free_fn;   /**< may be NULL */
    void *task;               /**< passed to run and free_fn */
} kvt_io_op;

/** Options of kvt_io_create. Zero fields take the default. */
typedef struct kvt_io_options {
    int threads;        /**< worker threads, 1..64 (default 2) */
    uint32_t max_ops;   /**< operations queued or running, 1..1048576 (default 1024) */
    uint64_t max_bytes; /**< bytes queued or running (default 256 MiB); one operation larger than this is refused */
    int max_background; /**< background operations running at once, 1..threads (default threads - 1, at least 1) */
} kvt_io_options;

/** The per-kind counters, one list: X(name, kind, help) with kind counter
 * or gauge; kvt_io_kind_stats, kvt_io_stats_json and the server's /metrics
 * (kvtier_io_*{kind="..."}) are generated from it. */
#define KVT_IO_KIND_COUNTERS(X)                                                            \
    X(submitted, counter, "accepted submissions, coalesced ones included")                \
    X(coalesced, counter, "submissions that joined an identical queued or running operation") \
    X(refused, counter, "submissions refused because the queue was full")                 \
    X(ran, counter, "operations run")                                                      \
    X(failed, counter, "operations whose run returned an error")                          \
    X(queued_ops, gauge, "operations queued or running")                                  \
    X(queued_bytes, gauge, "bytes of the operations queued or running")

/** Counters of one kind of operation (since creation, except the gauges),
 * as KVT_IO_KIND_COUNTERS lists them. */
typedef struct kvt_io_kind_stats {
#define KVT__IO_FIELD(name, kind, help) uint64_t name;
    KVT_IO_KIND_COUNTERS(KVT__IO_FIELD)
#undef KVT__IO_FIELD
} kvt_io_kind_stats;

/** The worker-wide counters, one list: X(name, kind, help) with kind
 * counter or gauge; kvt_io_stats, kvt_io_stats_json and the server's
 * /metrics (kvtier_io_worker_*) are generated from it, so a counter added
 * here appears in all three. */
#define KVT_IO_WORKER_COUNTERS(X)                                                              \
    X(submitted, counter, "accepted submissions, coalesced ones included")                    \
    X(coalesced, counter, "submissions attached to an identical queued or running operation") \
    X(refused, counter, "submissions refused with KVT_EAGAIN (queue full)")                   \
    X(ran, counter, "operations run")                                                          \
    X(failed, counter, "operations whose run returned an error")                              \
    X(discarded, counter, "operations discarded before they started (nobody waited)")         \
    X(results_discarded, counter, "operations that ran while nobody waited any more")         \
    X(queued_ops, gauge, "operations queued, not started")                                    \
    X(running_ops, gauge, "operations running")                                               \
    X(queued_bytes, gauge, "bytes of queued and running operations")                          \
    X(max_queued_ops, gauge, "high-water mark of queued plus running operations")

/** Counters of a worker (since creation, except the gauges), as
 * KVT_IO_WORKER_COUNTERS lists them, and the same per kind. */
typedef struct kvt_io_stats {
#define KVT__IO_FIELD(name, kind, help) uint64_t name;
    KVT_IO_WORKER_COUNTERS(KVT__IO_FIELD)
#undef KVT__IO_FIELD
    kvt_io_kind_stats by_kind[KVT_IO_KINDS]; /**< the same, per kind */
} kvt_io_stats;

/** Tells a notify waiter (kvt_io_submit_notify) that its operation
 * completed: status is what kvt_io_wait would return (0, the run's error,
 * with kvt_last_error() set to the run's message as kvt_io_wait sets it,
 * KVT_ECLOSED when the worker shut down before it started); result is the
 * shared result, borrowed for the call (NULL unless KVT_IO_PUBLISH). Runs
 * once, without any lock of the worker held, on the worker thread that ran
 * the operation (or the thread of kvt_io_run_here / kvt_io_destroy). It may
 * submit operations; it must not destroy the worker. */
typedef void (*kvt_io_notify_fn)(void *arg, int status, kvt_io_disposition disposition, void *result);

typedef struct kvt_io kvt_io;
typedef struct kvt_io_ticket kvt_io_ticket;

/** Starts a worker and its threads.
 *
 * @param opt options, NULL for the defaults.
 * @param out receives the worker; caller ends it with kvt_io_destroy.
 * @return 0; KVT_EINVAL (out NULL, a field out of range); KVT_ENOMEM;
 *   -errno when a thread cannot start. On error *out is NULL.
 */
KVT_API int kvt_io_create(const kvt_io_options *opt, kvt_io **out);

/** Stops a worker: operations not started (only ones submitted without a
 * ticket can be left) are discarded and their free_fn runs, running ones
 * finish, the threads are joined, and the worker is freed. Call kvt_io_flush
 * first to let write-behind finish. Every ticket must be released
 * (kvt_io_ticket_release) before this call. NULL is a no-op. Not
 * thread-safe: no other call on this worker may run or follow. */
KVT_API void kvt_io_destroy(kvt_io *io);

/** Submits a prepared operation, or joins an identical one.
 *
 * When an operation with the same (kind, key) is queued or running, the
 * submission is coalesced: op->task is not used and op->free_fn(task, NULL)
 * runs before this call returns (the caller's prepared task is not needed);
 * the ticket (if asked for) waits for the existing operation, and a
 * foreground submission promotes it if it is queued as background.
 * Otherwise the operation is queued; ownership of op->task passes to the
 * worker (freed by op->free_fn as its doc says).
 *
 * @param op the operation (copied). op->run is required.
 * @param ticket receives a ticket (ended by kvt_io_ticket_release), or NULL
 *   to submit without waiting (the operation still runs).
 * @return 0;
 *   KVT_EAGAIN: the queue holds max_ops operations or the bytes would pass
 *     max_bytes (a message names which bound, what is queued and the bytes
 *     asked); never for a coalesced submission, which adds nothing;
 *   KVT_ETOOBIG: op->bytes exceeds max_bytes (will never fit);
 *   KVT_ECLOSED: the worker is shutting down;
 *   KVT_EINVAL: NULL io or op, no run function, kind or priority out of
 *     range; KVT_ENOMEM.
 *   On error *ticket is NULL and the task stays with the caller (free_fn is
 *   not called). Thread-safe.
 */
KVT_API int kvt_io_submit(kvt_io *io, const kvt_io_op *op, kvt_io_ticket **ticket);

/** Submits like kvt_io_submit (same coalescing, bounds and errors), for a
 * waiter that does not block: instead of a ticket, fn(arg, ...) is called
 * exactly once when the operation completes (see kvt_io_notify_fn). The
 * waiter holds an interest until then (it cannot be cancelled), so the
 * operation runs. On error fn is not called. kvt_io_flush returns only
 * after every notify function of the drained operations has returned.
 * @return as kvt_io_submit; KVT_EINVAL also for fn NULL. Thread-safe. */
KVT_API int kvt_io_submit_notify(kvt_io *io, const kvt_io_op *op, kvt_io_notify_fn fn, void *arg);

/** Runs the ticket's operation on the calling thread if it is still
 * queued (taken off the queue as a worker would; completion and tickets as
 * usual), so a thread that needs the result now does not wait for a free
 * worker thread. A no-op when the operation already started or completed,
 * or the ticket was cancelled.
 * @return 1 (ran here); 0 (nothing to do: kvt_io_wait for it); KVT_EINVAL
 *   (ticket NULL). Thread-safe. */
KVT_API int kvt_io_run_here(kvt_io_ticket *ticket);

/** Waits for a ticket's operation to complete.
 *
 * @param timeout_ms milliseconds to wait; 0 polls; UINT64_MAX waits forever.
 * @param disposition receives KVT_IO_PUBLISH when the operation ran and
 *   succeeded and this ticket was not cancelled, else KVT_IO_DISCARD (may be
 *   NULL).
 * @param result receives the operation's result (may be NULL): borrowed,
 *   valid until this ticket is released; NULL unless the disposition is
 *   KVT_IO_PUBLISH.
 * @return 0 (ran and succeeded); the run function's error code (ran and
 *   failed: kvt_last_error() on the waiting thread is then the message the
 *   run set, on whichever thread ran it, or "the <kind> failed" when it set
 *   none); KVT_ECANCELED (this ticket was cancelled); KVT_ECLOSED (the
 *   worker shut down before the operation started); KVT_EAGAIN (not
 *   complete within timeout_ms; the ticket stays valid); KVT_EINVAL (ticket
 *   NULL). Thread-safe.
 */
KVT_API int kvt_io_wait(kvt_io_ticket *ticket, uint64_t timeout_ms, kvt_io_disposition *disposition, void **result);

/** Cancels a ticket: releases its interest in the operation. When no
 * interest is left and the operation has not started, it is discarded (its
 * free_fn runs); when it has started, its result is discarded on
 * completion. A kvt_io_wait on this ticket returns KVT_ECANCELED. No effect
 * once the operation completed or when already cancelled. The ticket stays
 * valid until kvt_io_ticket_release. NULL is a no-op. Thread-safe. */
KVT_API void kvt_io_cancel(kvt_io_ticket *ticket);

/** Ends a ticket: cancels it if its operation has not completed, drops its
 * hold on the result (the operation's free_fn runs once no ticket holds it)
 * and frees the handle. NULL is a no-op. Thread-safe; no other call on this
 * ticket may run concurrently or follow. */
KVT_API void kvt_io_ticket_release(kvt_io_ticket *ticket);

/** Waits until no operation is queued or running, and the free_fn of every
 * finished operation that no ticket holds has returned (submissions keep
 * being accepted meanwhile).
 * @param timeout_ms milliseconds; UINT64_MAX waits forever.
 * @return 0; KVT_EAGAIN on timeout; KVT_EINVAL (io NULL). Thread-safe. */
KVT_API int kvt_io_flush(kvt_io *io, uint64_t timeout_ms);

/** The name of a kind ("restore", "write", "hash", "remote-get",
 * "remote-set", "prefetch", "find"; "unknown" out of range). Static storage.
 * Thread-safe. */
KVT_API const char *kvt_io_kind_name(kvt_io_kind kind);

/** Takes a reference on the process's default worker, created with the
 * default options by the first acquire.
 * @param out receives the worker (shared; never kvt_io_destroy it: end the
 *   reference with kvt_io_default_release).
 * @return 0; KVT_EINVAL (out NULL); kvt_io_create's errors (*out NULL).
 * Thread-safe. */
KVT_API int kvt_io_default_acquire(kvt_io **out);

/** Drops a reference taken by kvt_io_default_acquire. The last one flushes
 * the worker (waits for what is queued to run) and destroys it; a later
 * acquire creates a new one. Every ticket must be released before the last
 * release. NULL, or a worker that is not the default, is a no-op.
 * Thread-safe; never from a worker thread of that worker. */
KVT_API void kvt_io_default_release(kvt_io *io);

/** A snapshot of the process default worker's counters (no reference is
 * taken). @return 0; KVT_ENOTFOUND when no default worker exists now;
 * KVT_EINVAL (out NULL). Thread-safe. */
KVT_API int kvt_io_default_stats_get(kvt_io_stats *out);

/** The io report as one JSON object: {"threads", "max_ops", "max_bytes",
 * "max_background", KVT_IO_WORKER_COUNTERS... (in the list's order),
 * "by_kind": {"<kind>": {KVT_IO_KIND_COUNTERS...}}}.
 * @param opt the worker's options for the bounds (NULL: omitted).
 * @param out receives a string the caller frees with kvt_free.
 * @return 0; KVT_EINVAL; KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_io_stats_json(const kvt_io_stats *s, const kvt_io_options *opt, char **out);

/** The options a worker runs with (defaults filled in).
 * @return 0; KVT_EINVAL when an argument is NULL. Thread-safe. */
KVT_API int kvt_io_options_get(kvt_io *io, kvt_io_options *out);

/** A snapshot of the worker's counters.
 * @return 0; KVT_EINVAL when an argument is NULL. Thread-safe. */
KVT_API int kvt_io_stats_get(kvt_io *io, kvt_io_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_IO_H */
