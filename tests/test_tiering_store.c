/*
 * test_tiering_store.c: the prompt cache's tiering tests
 * (test_prompt_cache_tier.c, written against the in-memory tier) run
 * unchanged against the real SSD tier: store_tier.h renames every mem_tier
 * call to its twin over a kvt_store in a temporary directory (issue 5:
 * same tests, both implementations).
 */
#include "store_tier.h"

/* Before any test: every mem_tier function must have its store twin. */
__attribute__((constructor)) static void check_api(void) { store_tier_check_api(); }

#include "test_prompt_cache_tier.c"
