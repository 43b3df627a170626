/*
 * server.h: `kvtier serve`, an OpenAI-compatible HTTP server over the
 * reference engine and the cache service. HTTP is libmicrohttpd (one thread
 * per connection, bounded by a connection limit and an idle timeout); JSON
 * is jansson; generation runs on one engine thread (scheduler.h).
 *
 * Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming by
 * server-sent events), GET /v1/models, GET /v1/models/{id}, GET /health,
 * POST /tokenize, POST /detokenize, GET /stats, GET /metrics. Errors are
 * OpenAI error objects (openai.h).
 *
 * Life: kvt_server_start (binds; /health answers 503), kvt_server_load (the
 * model, the service, the engine thread; /health answers 200), then
 * kvt_server_stop (no new connections, running requests finish up to the
 * shutdown timeout, the SSD tier is flushed) and kvt_server_destroy.
 *
 * Thread-safety: start, load, stop and destroy are called by one thread (the
 * command's); kvt_server_port may be called from any thread.
 */
#ifndef KVT_SERVER_SERVER_H
#define KVT_SERVER_SERVER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_server kvt_server;

/** Models one server serves at most. */
#define KVT_SERVER_MAX_MODELS 8

/** One model of a multi-model server (strings copied by kvt_server_start). */
typedef struct kvt_server_model {
    const char *model_path;      /* llama2.c checkpoint (required) */
    const char *tok_path;        /* its tokenizer.bin (required) */
    const char *model_name;      /* id in /v1/models and the requests' "model";
                                    NULL = the file's name without extension */
} kvt_server_model;

/** Settings of a server. Zero-initialise, then set; zero means the default. */
typedef struct kvt_server_opts {
    const char *host;            /* address to bind (IPv4 or IPv6 literal, or "localhost"); NULL = "127.0.0.1" */
    int port;                    /* TCP port; 0 = any free port (see kvt_server_port) */
    const char *model_path;      /* llama2.c checkpoint; NULL (with tok_path NULL) = built-in default model */
    const char *tok_path;        /* its tokenizer.bin */
    const char *model_name;      /* id in /v1/models; NULL = the model file's name without extension */
    const kvt_server_model *models; /* (n_models) several models in one process, each with its
                                    own cache service and engine thread, all under one pool;
                                    a request picks one by its "model" field (none: the first;
                                    an unknown id: 404). The model_path/tok_path/model_name
                                    above must then be NULL. Copied */
    int n_models;                /* 0 = the one model above; at most KVT_SERVER_MAX_MODELS */
    uint64_t pool_ram_bytes;     /* --pool-ram: RAM of every model's prompt cache together; 0 = not limited */
    uint64_t pool_kv_bytes;      /* --pool-kv: projected KV bytes of every admitted request together */
    uint64_t pool_disk_bytes;    /* --pool-disk: disk budget of the SSD root; needs ssd_max_bytes.
                                    A process-wide pool (kvtier/pool.h) is made when there are
                                    several models or any of these four is set; each service
                                    joins it as "service:<id>", the SSD root as "ssd:<dir>" */
    uint64_t pool_remote_bytes;  /* --pool-remote: bytes of every model's remote writes in flight
                                    together (queued write-behind, the write being sent, a
                                    synchronous store); a write that does not fit is refused
                                    (write-behind: a counted drop); needs redis_url. Each
                                    model's remote tier joins as "remote:<id>" */
    uint64_t prompt_cache_bytes; /* RAM prompt cache budget; 0 keeps nothing (cache off) */
    uint64_t kv_budget_bytes;    /* admission budget of projected KV bytes; 0 = unlimited */
    const char *ssd_dir;         /* SSD tier directory, NULL = none */
    uint64_t ssd_max_bytes;      /* its byte budget, 0 = unlimited */
    int ssd_verify;              /* check SHA-256 of every shard on load */
    const char *const *prompt_cache_dirs; /* published prompt caches mounted read-only
                                    (kvt_tiers_opts), (n_prompt_cache_dirs); copied */
    int n_prompt_cache_dirs;     /* 0 = none; at most 7 */
    const char *redis_url;       /* remote tier on Redis (kvt_tiers_opts.redis_url), NULL = none; copied */
    int redis_cluster;           /* the URL names a Redis Cluster node */
    int32_t redis_timeout_ms;    /* bound on one Redis lookup; 0 = 50 */
    int32_t redis_restore_timeout_ms; /* bound on one whole Redis restore; 0 = 1000 */
    int64_t redis_ttl_s;         /* expiry of every key written; 0 = none */
    uint64_t demote_idle_ms;     /* RAM entries idle this long leave RAM once on SSD; 0 never */
    int64_t max_queue;           /* requests waiting for admission at most (0: none wait) */
    int64_t max_running;         /* requests admitted at once at most; 0 = 64 */
    uint64_t max_body;           /* request body bytes at most; 0 = 1 MiB */
    const char *api_key;         /* NULL = no authentication; else "Authorization: Bearer KEY" */
    unsigned conn_timeout_s;     /* idle connection timeout, seconds; 0 = 30 */
    unsigned max_connections;    /* open connections at most; 0 = 256 */
    int threads;                 /* engine threads (kvt_model_set_threads), 1..64; 0 = the model's default */
    int64_t prefill_chunk;       /* prompt tokens one engine step runs at most (1..256, the
                                    engine's chunk; 0 = 256): a smaller bound shortens the
                                    stall a long prompt puts on running streams; values out of
                                    range are clamped to it) */
    int kv_scheme;               /* storage scheme of the K/V, a kvt_kv_scheme (engine/model.h); 0 = f32, the
                                    model's own; `kvtier serve` passes KVT_KV_F16 unless --kv-dtype
                                    says otherwise: an embedder wanting that sets it here */
    int64_t checkpoint_every;    /* with ssd_dir: a request with an Idempotency-Key header is
                                    checkpointed every this many generated tokens and resumed
                                    by a repeat after a restart (docs/checkpoints.md); 0 = off */
    int checkpoint_sync;         /* with checkpoint_every: 1 = each checkpoint is durable before
                                    the request decodes on (--checkpoint-sync) */
    int64_t live_cache_blocks;   /* > 0: each request keeps at most this many full kv blocks in
                                    RAM and pages the rest to a page file (kvt_gen_opts.live_cache_*,
                                    docs/residency.md); admission charges the bound; 0 = no bound */
    uint64_t live_cache_bytes;   /* > 0: the same bound in bytes (the smaller wins) */
    const char *live_cache_dir;  /* page-file directory, NULL = $TMPDIR or /tmp; copied */
    int live_cache_strict;       /* 1: the strict bound (kvt_gen_opts.live_cache_strict) */
} kvt_server_opts;

/** Binds and starts answering HTTP (every generation request gets 503 until
 * kvt_server_load). The options' strings are copied.
 * @param out caller frees with kvt_server_destroy().
 * @return 0; KVT_EINVAL (bad host, one of model/tokenizer without the
 *   other); KVT_ENOMEM; -EADDRINUSE or another -errno when the socket cannot
 *   be bound (kvt_last_error names the address). */
int kvt_server_start(const kvt_server_opts *o, kvt_server **out);

/** The TCP port the server listens on (the chosen one when port was 0). */
int kvt_server_port(const kvt_server *s);

/** The model id the server answers to by default: the first model's
 * (valid after kvt_server_load). */
const char *kvt_server_model_name(const kvt_server *s);

/** Models served (1 for a single-model server). */
int kvt_server_model_count(const kvt_server *s);

/** The id of model i (0-based; "" outside 0..count-1), valid after load. */
const char *kvt_server_model_id(const kvt_server *s, int i);

/** Creates the pool (see pool_*_bytes), then for each model in turn loads
 * the model and tokenizer, opens the tier stack (kvt_tiers_open: an
 * SSD directory that cannot be written makes the tier read-only or off, not
 * an error; kvt_server_poll_tiers says so; the SSD root is shared by the
 * models and charged to the pool once, by the first), creates the cache
 * service and starts the engine thread; then /health answers 200.
 * Test hook: with the environment variable KVTIER_TEST_LOAD_GATE=PATH set,
 * the load first waits (before it reads anything) until PATH exists, for at
 * most 60 s, so a test can hold the server in its loading window (503 on
 * /health and every model endpoint) for as long as it checks it.
 * @return 0, or the loader's / tier stack's / service's error (kvt_last_error
 *   names the file or setting); KVT_EINVAL when two models have one id; the
 *   pool's refusal (KVT_ELIMIT naming the axis) when the SSD budget is over
 *   pool_disk_bytes. */
int kvt_server_load(kvt_server *s);

/** Says, on stderr, each degradation of a tier level the first time it is
 * seen ("kvtier serve: warning: SSD cache DIR: CAUSE; continuing ..."): a
 * directory that could not be opened for writing at load, a write that
 * failed since; and a Redis Cluster (--redis-cluster) whose slot map
 * leaves hash slots without a node, naming the cluster and the count. Call it after kvt_server_load and then now and then (the
 * command does every second). @return the warnings printed. Called by the
 * thread that calls load and stop. */
int kvt_server_poll_tiers(kvt_server *s);

/** Graceful stop: stops accepting connections and requests, lets running
 * and queued requests finish for up to timeout_ms milliseconds (then
 * cancels them: a stream ends with an error event, a waiting client gets
 * 503), closes connections, then closes the cache service (every RAM entry
 * handed to the SSD tier and flushed) and the SSD tier.
 * @return 0, or the first error of closing the service or the SSD tier
 *   (KVT_ETOOBIG when a prefix larger than the SSD budget was not written). */
int kvt_server_stop(kvt_server *s, int64_t timeout_ms);

/** Stops (timeout 0) if still running, frees everything. NULL is a no-op. */
void kvt_server_destroy(kvt_server *s);

/** Whether the peer of socket `fd` closed its side or the socket failed
 * (poll with POLLRDHUP, no wait); 0 for fd < 0. Used to cancel the work of a
 * client that went away. Thread-safe. */
int kvt__srv_peer_gone(int fd);

#ifdef __cplusplus
}
#endif
#endif /* KVT_SERVER_SERVER_H */
