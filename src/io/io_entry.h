/*
 * io_entry.h: what the tiers share when several waiters get the result of
 * one coalesced restore of the I/O worker; never installed.
 */
#ifndef KVTIER_IO_ENTRY_H
#define KVTIER_IO_ENTRY_H

#include "kvtier/io.h"
#include "kvtier/tier.h"

/** A zero-copy clone of e into out (kvt_entry_init, every cache cloned with
 * kvt_cache_clone, every attachment with kvt_attachment_clone; out's hook
 * empty), so each waiter of one read owns an independent entry. On error
 * out is cleared. @return 0 or the clone's error (KVT_ENOMEM). */
int kvt__entry_share(const kvt_entry *e, kvt_entry *out);

/** One waiter's entry from a coalesced restore's completion (status,
 * disposition and the shared result as kvt_io_notify_fn gives them): a
 * successful, published result is cloned into *out (kvt__entry_share); a
 * discarded one, or one without a result, is KVT_ECANCELED. *out is zeroed
 * first and holds an entry only when 0 is returned.
 * @return 0; the operation's status; KVT_ECANCELED; the clone's error. */
int kvt__entry_from_result(int status, kvt_io_disposition d, const void *result, kvt_entry *out);

/** A synchronous restore's end, for a ticket the caller got from
 * kvt_io_submit: runs the operation on this thread if it is still queued
 * (kvt_io_run_here), waits for it without a bound, turns its completion into
 * *out (kvt__entry_from_result) and releases the ticket. A failure's
 * kvt_last_error() is the sentence the run set, on whichever thread ran it
 * (kvt_io_wait).
 * @return as kvt__entry_from_result; KVT_ECLOSED when the worker shut down
 * before it ran. */
int kvt__entry_wait(kvt_io_ticket *tk, kvt_entry *out);

#endif
