/*
 * mem_tier.h: an in-memory cold tier (kvt_cold_tier) for tests. It really
 * stores zero-copy clones of what it is given and restores clones of them;
 * counts every call and every write that lands; can be told to fail writes,
 * refuse spills, hold spills pending until drained (the "durable" state is
 * the test's to control), bound the pending spills in bytes like a real
 * write-behind queue, and delay or gate async reads. Pending spills can be
 * withdrawn (kvt_cold_tier.withdraw). Thread-safe.
 */
#ifndef KVT_TEST_MEM_TIER_H
#define KVT_TEST_MEM_TIER_H

#include "kvtier/tier.h"

#include <stdint.h>

typedef struct mem_tier mem_tier;

typedef struct mem_tier_counts {
    int64_t finds, find_exacts, restores, async_restores, stores, spills, spill_writes;
    int64_t failed_writes, refused_spills, pendings;
    int64_t writes;                 /* entries made durable: stores, spills
                                       written at once or by drain */
    int64_t withdrawn;              /* pending spills withdrawn */
    int64_t hooks_given, hooks_run; /* release hooks on restored entries */
    int64_t entries;                /* stored entries */
} mem_tier_counts;

int mem_tier_create(mem_tier **out);
/** Waits for async reads still running, then frees everything. */
void mem_tier_destroy(mem_tier *t);
/** The kvt_cold_tier table (borrowed, valid until destroy). */
const kvt_cold_tier *mem_tier_iface(mem_tier *t);

void mem_tier_fail_writes(mem_tier *t, int on);   /* store and spill writes fail KVT_EIO */
void mem_tier_refuse_spills(mem_tier *t, int on); /* spill returns KVT_EAGAIN */
void mem_tier_manual_spills(mem_tier *t, int on); /* spills stay pending until drain */
/* With manual spills: a spill is refused (KVT_EAGAIN, counted in
 * refused_spills) when the pending spills' cache bytes plus its own would
 * exceed `bytes`, except into an empty queue (the SSD tier's rule). 0 = no bound. */
void mem_tier_queue_bytes(mem_tier *t, int bytes);
void mem_tier_async_delay(mem_tier *t, int ms);   /* async reads sleep first */
void mem_tier_gate(mem_tier *t, int closed);      /* closed: async reads wait until opened */
void mem_tier_no_async(mem_tier *t, int on);      /* restore_async refuses (KVT_EAGAIN) */
/* find reports the common prefix without checking reachable ranges (like an
 * index that does not know them), so take must check what it restores */
void mem_tier_loose_find(mem_tier *t, int on);
void mem_tier_fail_restores(mem_tier *t, int on); /* restores fail KVT_EIO */
/** Writes every pending spill. @return the number written. */
int mem_tier_drain(mem_tier *t);
/** Drops every stored entry (running the hooks they hold). */
void mem_tier_clear(mem_tier *t);
/** Waits until no async read is running. */
void mem_tier_quiesce(mem_tier *t);

mem_tier_counts mem_tier_counts_get(mem_tier *t);
/** Whether an entry of exactly (ns, tokens) is stored (durable). */
int mem_tier_has(mem_tier *t, const char *ns, const int32_t *tokens, int64_t n);
/** Stores a kvtier-allocated entry directly (ownership passes on 0). */
int mem_tier_insert(mem_tier *t, kvt_entry *owned);

#endif
