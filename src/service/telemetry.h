/*
 * telemetry.h: a service's per-layer residency telemetry, private to
 * src/service/. The prompt cache talks to its cold tier through a table
 * that forwards every call and counts, per layer, what restores bring up and
 * what write-behind and spills hand down; the report adds the prompt
 * cache's RAM residency by layer and its entry counters.
 */
#ifndef KVT_SERVICE_TELEMETRY_H
#define KVT_SERVICE_TELEMETRY_H

#include "kvtier/service.h"

#include <jansson.h>

typedef struct kvt__telemetry kvt__telemetry;

/* A collector over n_layers layers, forwarding to `cold` (copied; NULL:
 * no cold tier), the table of `chain` when that is not NULL (borrowed,
 * outlives the collector: its levels' per-layer bytes are asked at report
 * time). 0; KVT_ENOMEM. */
int kvt__telemetry_create(int32_t n_layers, const kvt_cold_tier *cold, kvt_tier_chain *chain, kvt__telemetry **out);

/* The table the prompt cache is given instead of the cold tier (NULL when
 * there is none); valid until destroy. */
const kvt_cold_tier *kvt__telemetry_cold(kvt__telemetry *t);

/* After the prompt cache is gone. NULL is a no-op. */
void kvt__telemetry_destroy(kvt__telemetry *t);

/* kvt_service_layer_stats over pc (NULL: no RAM residency) and its
 * counters ps. */
int kvt__telemetry_get(kvt__telemetry *t, kvt_prompt_cache *pc, const kvt_service_stats *ps,
                       kvt_layer_stats *out, int32_t cap);

/* The report's "layers" array; NULL when out of memory. */
json_t *kvt__telemetry_json(kvt__telemetry *t, kvt_prompt_cache *pc, const kvt_service_stats *ps);

/* Groups for n_layers layers. */
int32_t kvt__telemetry_groups(int32_t n_layers);

#endif
