/*
 * io_entry.h: what the tiers share when several waiters get the result of
 * one coalesced restore of the I/O worker; never installed.
 */
#ifndef KVTIER_IO_ENTRY_H
#define KVTIER_IO_ENTRY_H

#include "kvtier/tier.h"

/** A zero-copy clone of e into out (kvt_entry_init, every cache cloned with
 * kvt_cache_clone, every attachment with kvt_attachment_clone; out's hook
 * empty), so each waiter of one read owns an independent entry. On error
 * out is cleared. @return 0 or the clone's error (KVT_ENOMEM). */
int kvt__entry_share(const kvt_entry *e, kvt_entry *out);

#endif
