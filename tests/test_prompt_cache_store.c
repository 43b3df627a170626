/*
 * test_prompt_cache_store.c: the prompt cache's rule tests
 * (test_prompt_cache.c: spill on eviction, pending writes, relieve stopping
 * at a failed write, demote_idle, oversize spills, objects...) run unchanged
 * with the real SSD tier as the cold tier (store_tier.h renames every
 * mem_tier call to its twin over a kvt_store).
 */
#include "store_tier.h"

/* Before any test: every mem_tier function must have its store twin. */
__attribute__((constructor)) static void check_api(void) { store_tier_check_api(); }

#include "test_prompt_cache.c"
