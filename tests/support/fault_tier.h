/*
 * fault_tier.h: a kvt_cold_tier that forwards to another tier and can be
 * told to be slow (finds are held until the test releases them), to fail (restores fail KVT_EIO) or to be
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

/** on: find and find_exact wait, before forwarding, until a call with on =
 * 0 releases them (or 30 s pass, so a caller that waits for a held find
 * fails instead of hanging); off releases every waiting call. */
void fault_tier_hold_finds(fault_tier *f, int on);
void fault_tier_fail_restores(fault_tier *f, int on);

/** Calls forwarded so far (restores: sync and async). */
int64_t fault_tier_finds(fault_tier *f);
/** finds that returned (a held find has not). */
int64_t fault_tier_finds_done(fault_tier *f);
int64_t fault_tier_restores(fault_tier *f);

#endif
