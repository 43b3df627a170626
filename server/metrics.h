/*
 * metrics.h: the counters of `kvtier serve` in one place: requests by
 * endpoint and status, tokens (prompt, reused by tier, prefilled,
 * generated), TTFT and end-to-end histograms, and a bounded ring of the
 * last finished requests. GET /metrics (Prometheus text), GET /stats and
 * the dashboard read them from here; nothing else keeps a second copy.
 *
 * Thread-safety: every function may be called from any thread (one mutex
 * guards the counters and the ring; no call blocks on anything else).
 */
#ifndef KVT_SERVER_METRICS_H
#define KVT_SERVER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "kvtier/io.h"
#include "kvtier/pool.h"
#include "kvtier/remote.h"
#include "kvtier/service.h"
#include "kvtier/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Endpoints counted apart. */
#define KVT_SRV_ENDPOINTS(X)                         \
    X(KVT_EP_CHAT, "/v1/chat/completions")           \
    X(KVT_EP_COMPLETIONS, "/v1/completions")         \
    X(KVT_EP_MODELS, "/v1/models")                   \
    X(KVT_EP_HEALTH, "/health")                      \
    X(KVT_EP_TOKENIZE, "/tokenize")                  \
    X(KVT_EP_DETOKENIZE, "/detokenize")              \
    X(KVT_EP_STATS, "/stats")                        \
    X(KVT_EP_METRICS, "/metrics")                    \
    X(KVT_EP_DASHBOARD, "/dashboard")                \
    X(KVT_EP_EVENTS, "/events")                      \
    X(KVT_EP_OTHER, "other")

typedef enum kvt_srv_endpoint {
#define KVT__EP_ENUM(name, path) name,
    KVT_SRV_ENDPOINTS(KVT__EP_ENUM)
#undef KVT__EP_ENUM
    KVT_EP_COUNT
} kvt_srv_endpoint;

/** Token and request counters (monotonic totals), name and help text; the
 * one list makes the struct, the /stats object and the Prometheus lines. */
#define KVT_SRV_COUNTERS(X)                                                                            \
    X(completions, "generation requests finished (any status)")                                        \
    X(completions_ok, "generation requests that returned a reply")                                     \
    X(cancelled, "generation requests cancelled by a client disconnect or shutdown")                  \
    X(rejected_queue_full, "generation requests refused because the queue was full (429)")            \
    X(prompt_tokens, "prompt tokens of finished generation requests")                                 \
    X(generation_tokens, "tokens generated")                                                           \
    X(prefix_cache_queries, "prompt tokens looked up in the prefix cache (vLLM's pair, in tokens)")    \
    X(prefix_cache_hits, "prompt tokens served by the prefix cache, any tier (vLLM's pair, in tokens)") \
    X(cached_tokens_ram, "prompt tokens reused from the RAM tier")                                    \
    X(cached_tokens_ssd, "prompt tokens reused from the SSD tier")                                    \
    X(cached_tokens_remote, "prompt tokens reused from the remote tier (Redis)")                      \
    X(cached_tokens_published, "prompt tokens reused from a published prompt cache")                  \
    X(prefilled_tokens, "prompt tokens run by prefill")                                               \
    X(decode_steps, "batched decode steps run by the engine")                                         \
    X(decode_batch_sequences, "sequences decoded, summed over the batched steps (mean batch = this / steps)")

typedef struct kvt_srv_counters {
#define KVT__CTR_FIELD(name, help) uint64_t name;
    KVT_SRV_COUNTERS(KVT__CTR_FIELD)
#undef KVT__CTR_FIELD
} kvt_srv_counters;

/** One finished generation request, as the request table shows it. */
typedef struct kvt_srv_record {
    uint64_t seq;             /* 1, 2, ... in finishing order */
    int64_t time_ms;          /* Unix time the request finished, ms */
    kvt_srv_endpoint endpoint;
    char model[64];
    char ns[64];              /* state namespace ("" = base model) */
    int64_t prompt_tokens, completion_tokens;
    int64_t reused_ram, reused_ssd, reused_remote, reused_published; /* kvt_oai_usage's */
    int64_t prefilled_tokens;
    double queue_ms, ttft_ms, e2e_ms; /* ttft_ms < 0: no token was produced */
    int status;               /* HTTP status answered (200, or the error's) */
} kvt_srv_record;

/** Records kept by the ring (the oldest is dropped first). */
#define KVT_SRV_RECORDS 256

/** Histogram bucket bounds, seconds: TTFT as vLLM's
 * vllm:time_to_first_token_seconds, end to end as vLLM's e2e request latency. */
#define KVT_SRV_TTFT_BUCKETS 22
#define KVT_SRV_E2E_BUCKETS 21
extern const double kvt_srv_ttft_bounds[KVT_SRV_TTFT_BUCKETS];
extern const double kvt_srv_e2e_bounds[KVT_SRV_E2E_BUCKETS];

typedef struct kvt_srv_metrics kvt_srv_metrics;

/** @return a new metrics object (free with kvt_srv_metrics_destroy), NULL when out of memory. */
kvt_srv_metrics *kvt_srv_metrics_create(void);
/** NULL is a no-op. */
void kvt_srv_metrics_destroy(kvt_srv_metrics *m);

/** Counts one HTTP request answered with `status` at `ep`. */
void kvt_srv_metrics_request(kvt_srv_metrics *m, kvt_srv_endpoint ep, int status);

/** Adds `n` to one counter, by field: kvt_srv_metrics_add(m, offsetof(kvt_srv_counters, cancelled), 1). */
void kvt_srv_metrics_add(kvt_srv_metrics *m, size_t field_offset, uint64_t n);

/** Counts a finished generation request: its tokens, the histograms (TTFT
 * when rec->ttft_ms >= 0, e2e always) and a copy of `rec` in the ring
 * (rec->seq is assigned here). */
void kvt_srv_metrics_finish(kvt_srv_metrics *m, const kvt_srv_record *rec);

/** A snapshot of the counters. */
void kvt_srv_metrics_counters(kvt_srv_metrics *m, kvt_srv_counters *out);

/** Copies the records with seq > after_seq, oldest first, at most cap.
 * @return how many were copied. */
size_t kvt_srv_metrics_records(kvt_srv_metrics *m, uint64_t after_seq, kvt_srv_record *out, size_t cap);

/** Gauges the server reads when it is asked (not counters). */
typedef struct kvt_srv_gauges {
    int64_t queue_depth;      /* requests waiting for admission, every model's (/stats;
                                 /metrics has each model's: kvt_srv_model_engine) */
    int64_t running;          /* requests admitted (prefilling or decoding), every model's */
    int64_t connections;      /* open HTTP connections */
    int ready;                /* 1 once the models are loaded */
} kvt_srv_gauges;

/** One served model's figures for /metrics, read by the server when it is
 * scraped; every series made from them carries the label model="id". */
typedef struct kvt_srv_model_figures {
    char id[64];              /* the model's id (/v1/models) */
    int have_rep;             /* rep is filled (0 before the model is loaded) */
    kvt_service_stats rep;    /* kvt_service_get_stats */
    int have_ssd;             /* ss is filled: the model has an SSD tier */
    kvt_store_stats ss;       /* kvt_store_get_stats */
    int have_remote;          /* rs is filled: the model has a remote tier */
    kvt_remote_stats rs;      /* kvt_remote_stats_get */
    int32_t n_tiers;          /* cold tier levels the report lists (kvt_service_tier_count) */
    struct {
        char name[KVT_TIER_NAME_MAX];  /* kvt_service_tier_name */
        kvt_tier_stats st;             /* kvt_service_tier_stats */
    } tiers[KVT_TIER_CHAIN_MAX];
    int32_t n_layers;         /* groups filled in layers (kvt_service_layer_stats), 0 for none */
    kvt_layer_stats layers[KVT_LAYER_REPORT_LIMIT + 1];
} kvt_srv_model_figures;

/** The Prometheus text exposition (version 0.0.4) of every counter,
 * histogram and gauge, kvtier_ names, one HELP and TYPE line per family:
 * - the server's own (requests by endpoint and status, tokens, the TTFT
 *   and end-to-end histograms, the connections and ready gauges of `g`),
 *   unlabelled: they count every model's requests together. The queue,
 *   the running requests and the decode steps are each model's engine
 *   thread's: kvt_srv_sched_stats_prometheus (scheduler.h) appends them,
 *   labelled by model; the counters decode_steps and decode_batch_sequences
 *   are left out here;
 * - for each model of `models` (n_models of them), series labelled
 *   model="id": the RAM tier and the SSD tier (kvtier_tier_bytes,
 *   _max_bytes, _entries{model,tier}), every prompt cache counter
 *   (kvtier_prompt_cache_NAME_total), admission (kvtier_kv_projected_bytes,
 *   kv_budget_bytes, admission_rejected_total), every KVT_TIER_COUNTERS
 *   value of each cold tier level (kvtier_tier_level_NAME[_total]{model,
 *   level="0",tier="ssd"}), the SSD write-behind and restores
 *   (kvtier_ssd_*), every KVT_REMOTE_COUNTERS entry (kvtier_remote_NAME_total
 *   for a counter, kvtier_remote_NAME for a gauge, a counter of
 *   milliseconds NAME_ms as kvtier_remote_NAME_seconds_total), and every
 *   KVT_LAYER_COUNTERS field by layer (kvtier_layer_NAME[_total]{model,
 *   layer="0"}, "64-99" for the overflow group: at most
 *   KVT_LAYER_REPORT_LIMIT + 1 layer values a model). A family no model has
 *   (no SSD tier, say) is left out;
 * - the I/O worker `io` (NULL: none): one family per KVT_IO_KIND_COUNTERS
 *   entry, kvtier_io_NAME[_total]{kind="..."};
 * - the process-wide pool (NULL: none): kvtier_pool_members, and for every
 *   field of KVT_POOL_USAGE_FIELDS one family by `axis` for the whole pool
 *   (kvtier_pool_<field>_bytes, refusals as kvtier_pool_refusals_total) and
 *   one by `member` and `axis` (kvtier_pool_member_<field>_..., the limit
 *   excepted).
 * Label values are escaped (backslash, quote, newline). Cardinality is
 * bounded by the configuration: at most KVT_SERVER_MAX_MODELS models, their
 * tier levels and layer groups, the pool's members.
 * @param models (n_models) borrowed for the call; NULL with 0 for none.
 * @param out receives a NUL-terminated string, caller frees with free().
 * @return 0, or -1 when out of memory (*out NULL). */
int kvt_srv_metrics_prometheus(kvt_srv_metrics *m, const kvt_srv_gauges *g, const kvt_srv_model_figures *models,
                               int n_models, kvt_pool *pool, const kvt_io_stats *io, char **out);

/** Escapes a Prometheus label value (backslash, quote and newline get a
 * backslash; a newline is written as \n) into out, NUL-terminated, as much
 * of v as fits in cap bytes (cap >= 3 writes at least one character of a
 * non-empty v). @return how many characters of v were written: call again
 * from v + that until v ends. */
size_t kvt_srv_prom_escape(const char *v, char *out, size_t cap);

/** The server's part of /stats: {"requests_total": n, "requests": {path:
 * {status: n}}, "counters": {every KVT_SRV_COUNTERS name: n}, "queue_depth",
 * "running", "connections", "ready", "recent": [the last `recent` records,
 * oldest first, as kvt_srv_record_json]}.
 * @return a new reference, NULL when out of memory. */
json_t *kvt_srv_metrics_json(kvt_srv_metrics *m, const kvt_srv_gauges *g, size_t recent);

/** One record as JSON (the shape /stats "recent" and the dashboard use). */
json_t *kvt_srv_record_json(const kvt_srv_record *r);

#ifdef __cplusplus
}
#endif
#endif /* KVT_SERVER_METRICS_H */
