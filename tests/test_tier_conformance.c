/*
 * test_tier_conformance.c: every cold-tier implementation runs the same
 * conformance suite unchanged (tests/support/tier_suite.c): the in-memory
 * tier, the SSD store, a chain of two in-memory tiers, a chain of memory
 * over the store, and the published read-only tier (its entries arrive by
 * publication; store and spill are refused). Then the tier chain's own rules, with the in-memory tier
 * and the store as the lower level: strictly longer between levels,
 * promotion, demotion, read-only refusals, a failing or slow lower level.
 * Then the eviction hook of the tiers that evict on their own (the
 * in-memory tier at capacity, the store under its byte budget).
 */
#include "tier_suite.h"

int main(void)
{
    int failed = 0;
    failed += tier_suite_run(&tier_impl_mem);
    failed += tier_suite_run(&tier_impl_store);
    failed += tier_suite_run(&tier_impl_chain_mem_mem);
    failed += tier_suite_run(&tier_impl_chain_mem_store);
    failed += tier_suite_run(&tier_impl_published);
    failed += tier_suite_run_chain(&tier_impl_mem);
    failed += tier_suite_run_chain(&tier_impl_store);
    failed += tier_suite_run_eviction(&tier_small_mem);
    failed += tier_suite_run_eviction(&tier_small_store);
    return failed ? 1 : 0;
}
