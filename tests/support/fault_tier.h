/*
 * fault_tier.h: a kvt_cold_tier that forwards to another tier and can be
 * told to be slow (find sleeps), to fail (restores fail KVT_EIO) or to be
 * read-only (KVT_TIER_READ_ONLY set; store and spill refuse with
 * KVT_EREADONLY, so a caller must obey the flag), and counts
 * the calls it forwards. For tests only: it wraps any implementation, so the
 * tier-chain rules about a slow, failing or read-only level are checked over
 * the in-memory tier and the SSD store alike. Thread-safe.
 */
#ifndef KVT_TEST_FAULT_TIER_H
#define KVT_TEST_FAULT_TIER_H

#include "kvtier/tier.h"

#include <stdint.h>

typedef struct fault_tier fault_tier;

/** Wraps *inner (the table is copied; inner->self must outlive the
 * wrapper). read_only is fixed at creation. @return 0 or KVT_ENOMEM. */
int fault_tier_create(const kvt_cold_tier *inner, int read_only, fault_tier **out);
void fault_tier_destroy(fault_tier *f);
/** The wrapping table (borrowed, valid until destroy). */
const kvt_cold_tier *fault_tier_iface(fault_tier *f);

void fault_tier_find_delay(fault_tier *f, int ms); /* find and find_exact sleep ms first */
void fault_tier_fail_restores(fault_tier *f, int on);

/** Calls forwarded so far (restores: sync and async). */
int64_t fault_tier_finds(fault_tier *f);
int64_t fault_tier_restores(fault_tier *f);

#endif
