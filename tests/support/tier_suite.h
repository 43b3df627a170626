/*
 * tier_suite.h: the cold-tier conformance suite. Every kvt_cold_tier
 * implementation runs the same tests unchanged: the find rules of DESIGN.md
 * 3.2 / 3.4 (longest usable prefix capped at n - 1, reachable ranges,
 * untrimmable entries only when all their tokens are a prefix, namespaces),
 * restore equals what was stored, spill then flush, stale handles. The
 * chain suite checks the tier chain's rules with a given implementation as
 * its lower level: the strictly-longer rule between levels, promotion,
 * demotion, read-only refusals, a lower level failing or slow.
 */
#ifndef KVT_TEST_TIER_SUITE_H
#define KVT_TEST_TIER_SUITE_H

#include "kvtier/tier.h"
#include "mem_tier.h"

/** A tier implementation under test: open makes a fresh, empty tier (its
 * table in *tier, its state in *ctx); close destroys it. put (NULL: the
 * table's store) makes an entry findable in a read-only tier, which the
 * conformance tests then check refuses store and spill. */
typedef struct tier_impl {
    const char *name;
    int (*open)(void **ctx, kvt_cold_tier *tier);
    void (*close)(void *ctx);
    int (*put)(void *ctx, const kvt_entry *e);
} tier_impl;

/** A tier implementation for the eviction test: open_small makes a fresh
 * tier that holds about one entry of 16 tokens of the suite's layout, so
 * storing a second evicts the least recently used; close destroys it. */
typedef struct tier_small_impl {
    const char *name;
    int (*open_small)(void **ctx, kvt_cold_tier *tier);
    void (*close)(void *ctx);
} tier_small_impl;

/** The in-memory tier (capacity 1) and the SSD store (a byte budget of
 * 1.5 entries). */
extern const tier_small_impl tier_small_mem, tier_small_store;

/** Runs the eviction-hook test (kvt_cold_tier.set_evict) against impl: an
 * evicted entry reaches the hook whole; a refusing hook, or none, means a
 * plain delete; stats count evictions. @return failed tests. */
int tier_suite_run_eviction(const tier_small_impl *impl);

/** The implementations: the in-memory tier, the SSD store in a temporary
 * directory, chains of memory over memory and of memory over the store. */
extern const tier_impl tier_impl_mem, tier_impl_store, tier_impl_chain_mem_mem, tier_impl_chain_mem_store;

/** The published (read-only) tier over a temporary publication directory
 * (tests/support/published_tier.c): put publishes a new generation holding
 * every entry put so far and refreshes the tier onto it. */
extern const tier_impl tier_impl_published;

/** Runs the conformance tests against impl. @return failed tests. */
int tier_suite_run(const tier_impl *impl);

/** Runs the tier-chain rules with a chain [in-memory tier, lower]. @return
 * failed tests. */
int tier_suite_run_chain(const tier_impl *lower);

/** Test knob of the in-memory tier (not part of the mem_tier API that the
 * store twin mirrors): at most max_entries entries (0 = unbounded); adding
 * one more evicts the oldest, handing it to the eviction hook if one is set. */
void mem_tier_capacity(mem_tier *t, int max_entries);

#endif
