/*
 * store_tier.h: the mem_tier.h test API (same functions, same knobs, same
 * counters) implemented over the real SSD tier (kvt_store in a temporary
 * directory), so the prompt cache's tiering tests run unchanged against both
 * cold tiers: a test file includes this header, then the mem_tier test file;
 * every mem_tier name below is renamed to its store_tier twin.
 * Knobs map to the store's real behaviour where it has one (write failures
 * are injected into its I/O layer, manual spills hold its writer inside a
 * pwrite) and are emulated in this wrapper otherwise (refused spills, failed
 * restores, async delay and gate, loose find, counters, release hooks).
 */
#ifndef KVT_TEST_STORE_TIER_H
#define KVT_TEST_STORE_TIER_H

#define mem_tier store_tier
#define mem_tier_counts store_tier_counts
#define mem_tier_create store_tier_create
#define mem_tier_destroy store_tier_destroy
#define mem_tier_iface store_tier_iface
#define mem_tier_fail_writes store_tier_fail_writes
#define mem_tier_refuse_spills store_tier_refuse_spills
#define mem_tier_manual_spills store_tier_manual_spills
#define mem_tier_queue_bytes store_tier_queue_bytes
#define mem_tier_async_delay store_tier_async_delay
#define mem_tier_gate store_tier_gate
#define mem_tier_no_async store_tier_no_async
#define mem_tier_loose_find store_tier_loose_find
#define mem_tier_fail_restores store_tier_fail_restores
#define mem_tier_drain store_tier_drain
#define mem_tier_quiesce store_tier_quiesce
#define mem_tier_counts_get store_tier_counts_get
#define mem_tier_has store_tier_has
#define mem_tier_insert store_tier_insert
#define mem_tier_clear store_tier_clear

/* Every mem_tier function renamed above. A function added to mem_tier.h and
 * missing here would silently call the real mem_tier on a store_tier:
 * store_tier_check_api() (run before the tests) fails loudly instead. */
#define STORE_TIER_COVERED                                                                                   \
    "create destroy iface fail_writes refuse_spills manual_spills queue_bytes async_delay gate no_async "     \
    "loose_find "                                                                                            \
    "fail_restores drain quiesce counts_get has insert clear"

/** Exits the process with a message when tests/support/mem_tier.h (found via
 * $KVT_SOURCE_DIR) declares a function STORE_TIER_COVERED lacks. */
void store_tier_check_api(void);

#include "mem_tier.h"

#endif
