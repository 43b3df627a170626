/*
 * test_durability_store.c: the write-behind tests of test_durability.c run
 * unchanged over the real SSD tier (store_tier.h renames every mem_tier call
 * to its twin over a kvt_store): its own bounded write queue refuses the
 * second write while the first is held inside its pwrite, its pending and
 * find_exact say what is durable, its flush makes everything durable.
 */
#include "store_tier.h"

/* Before any test: every mem_tier function must have its store twin. */
__attribute__((constructor)) static void check_api(void) { store_tier_check_api(); }

#include "test_durability.c"
