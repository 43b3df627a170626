/*
 * kvtier/service.h: the cache service a scheduler talks to. One service
 * per loaded model. It owns the state requests run on: fresh caches,
 * prefix reuse from the prompt cache (and its cold tier), the KV byte
 * budget requests are admitted under, and the report (/stats).
 *
 * A request's life:
 *
 *     kvt_service_admit()       reserve its projected KV bytes (or wait)
 *     kvt_service_acquire()     longest reusable prefix, else fresh caches
 *       ... prefill tokens [reused, n_prompt) ...
 *     kvt_service_publish()     prompt-boundary snapshot (a zero-copy clone)
 *       ... decode ...
 *     kvt_service_publish()     prompt + generation
 *     kvt_service_release()     bytes return to the budget
 *
 * The scheduler never learns what is resident or where (RAM, SSD); what the
 * service holds is in kvt_service_get_stats().
 *
 * Namespaces: state made under one namespace never serves a prompt in
 * another. An adapter's namespace carries its identity AND its
 * version (kvt_service_ns()), so state computed under adapter "fr" version 2
 * never serves "fr" version 3, nor adapter "de", nor the base model ("").
 *
 * Thread-safety: every kvt_service_* call may be made from any thread, so
 * several threads (one per request) may share a service: the budget, the held
 * admissions and the counters are guarded by the service's mutex; the prompt cache locks
 * itself, and acquire/publish call it without the service mutex (a cold-tier
 * read never blocks other requests' admission). kvt_service_admit_wait()
 * sleeps without holding the mutex. The caches a request acquires belong to
 * that request's thread. kvt_service_destroy() must not race any call.
 */
#ifndef KVTIER_SERVICE_H
#define KVTIER_SERVICE_H

#include "kvtier/cache.h"
#include "kvtier/common.h"
#include "kvtier/residency.h"
#include "kvtier/prompt_cache.h"
#include "kvtier/tier.h"
#include "kvtier/tier_chain.h"

struct kvt_store; /* kvtier/store.h */
struct kvt_pool;  /* kvtier/pool.h */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_service kvt_service;
typedef struct kvt_admission kvt_admission;

/* ---- model description --------------------------------------------------- */

/** How one layer's cache grows with the sequence, for KV projection. */
typedef enum kvt_growth {
    KVT_GROWTH_PER_TOKEN = 0, /* plain kv: bytes_per_token for every token */
    KVT_GROWTH_WINDOW = 1,    /* sliding window: bytes_per_token for at most `window` tokens */
    KVT_GROWTH_FIXED = 2      /* recurrent: fixed_bytes whatever the length */
} kvt_growth;

/** One layer as the service projects it. */
typedef struct kvt_service_layer {
    kvt_growth growth;
    size_t bytes_per_token; /* PER_TOKEN, WINDOW: bytes per token (K and V) */
    int32_t block_tokens;   /* PER_TOKEN: storage is whole blocks of this many
                               tokens (rounded up); 0 = no rounding */
    int32_t window;         /* WINDOW: W tokens (>= 1) */
    size_t fixed_bytes;     /* FIXED: bytes of state; PER_TOKEN: bytes on top of the per-token
                               ones once the sequence holds a token (0 for plain kv) */
} kvt_service_layer;

/** How one layer of the built-in kinds grows, read off a cache of it:
 * "kv" PER_TOKEN (2 * kv_dim * the element size of its storage scheme per
 * token: 4 for f32, 2 for f16 and bf16; its block_tokens),
 * "qkv" PER_TOKEN (2 * kv_dim int8 codes + 2 * kv_dim / group_size f32
 * scales per token, its block_tokens), "qkvc" PER_TOKEN (2 * kv_dim codes +
 * ceil(16 * kv_dim / block_tokens) bytes of scales per token, its
 * block_tokens, plus fixed_bytes 8 * kv_dim * block_tokens: the f32 open
 * block; with f16 or bf16 sealed blocks 2 * kv_dim * 2 bytes per token and
 * the same fixed open block), "rotating" WINDOW (2 * kv_dim * 4, 2 for f16/bf16, or for an
 * int8 ring 2 * (kv_dim + kv_dim / group_size * 4) bytes per token, its
 * window), "recurrent" FIXED (its state bytes).
 * @param c any cache of the layer (only its kind and parameters are read).
 * @return 0; KVT_EINVAL (NULL argument); KVT_EUNSUPPORTED (a backend kind:
 *   describe that layer yourself); KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_service_layer_of(const kvt_cache *c, kvt_service_layer *out);

/** How to build a service. Zero-initialise, then fill. */
typedef struct kvt_service_config {
    int32_t n_layers;                 /* 1..256 */
    const kvt_service_layer *layers;  /* (n_layers) copied by create; NULL:
                                         create makes one set of fresh caches
                                         and reads each layer off it
                                         (kvt_service_layer_of), so the model
                                         is described once, by new_caches */
    int64_t max_positions;            /* the model's position limit (seq_len), >= 1 */
    kvt_new_caches_fn new_caches;     /* required: fills n_layers fresh caches
                                         (kvtier/cache.h) */
    void *new_caches_ctx;             /* passed to new_caches; borrowed for the service's life */
    void (*new_caches_ctx_free)(void *ctx); /* optional: run on new_caches_ctx by
                                         kvt_service_destroy; if create fails the
                                         context stays the caller's */
    /** Prompt-cache RAM budget in bytes. 0 keeps nothing and reuses nothing:
     * the cache-off baseline (keeps() is false, acquire always fresh). */
    uint64_t prompt_cache_bytes;
    /** kv block size in tokens, passed to the prompt cache as its hint; 0 = 256. */
    int32_t block_tokens;
    /** Aggregate projected KV bytes admitted requests may hold; 0 = unlimited. */
    uint64_t kv_budget_bytes;
    /** Optional backend pressure check for kvt_service_boundary(): nonzero
     * while live memory is over what optional state may use.
     * NULL: boundaries release nothing. Called with the service mutex held;
     * must not call into the service. */
    int (*pressure)(void *ctx);
    void *pressure_ctx;
    /** Optional cold tier under the prompt cache (the SSD store): the table
     * is copied, its `self` is borrowed and must outlive the service (close
     * the service before the store). NULL: RAM only.
     * Write-behind, always on with a cold tier that has `spill`: every state
     * kvt_service_publish keeps is queued for the tier at once (zero-copy
     * views; publish never waits on I/O), so a process killed at any moment
     * loses at most the tier's write queue, not every prefix still in RAM.
     * The queue is the tier's and bounded in bytes: a refused write is
     * counted (write_behind_dropped) and that state is spilled when it
     * leaves RAM. Leaving RAM writes nothing for state the tier already
     * holds (durable_evictions); state whose write is still pending is not
     * evicted (a pending write is not a copy). */
    const kvt_cold_tier *cold;
    /** Optional: the tier chain `cold` is the table of
     * (kvt_tier_chain_cold_tier), borrowed like cold->self. The report then
     * lists each level's counters (kvt_tier_chain_level_stats); NULL: it
     * lists `cold` as one tier, from its stats operation (none when the
     * tier has no stats). Ignored without `cold`. */
    kvt_tier_chain *chain;
    /** With a cold tier: RAM entries idle this long (milliseconds) leave RAM
     * once the cold tier holds them (`kvtier chat --demote-idle MS`),
     * checked by a background thread every max(demote_idle_ms / 4, 10) ms.
     * 0 = never. Ignored without a cold tier. */
    uint64_t demote_idle_ms;
    /** Optional store that keeps generation checkpoints (see "generation
     * checkpoints" below); borrowed, must outlive the service (close the
     * service first). May be the store behind `cold`. NULL: none are kept
     * and kvt_service_resume acquires as kvt_service_acquire does. */
    struct kvt_store *checkpoint_store;
    /** With checkpoint_store: generated tokens between two checkpoints of a
     * replayable request (`--checkpoint-every N`), >= 1. */
    int64_t checkpoint_every;
    /** With checkpoint_store: bytes of cache state the checkpoint writer may
     * hold queued (kvt_cache_bytes of the queued clones); 0 = 256 MiB. */
    uint64_t checkpoint_queue_bytes;
    /** With checkpoint_store: 1 = each kvt_service_checkpoint returns only
     * once the writer finished that checkpoint (durable, or failed and
     * counted), so a crash loses at most checkpoint_every generated tokens
     * however slow the disk is, and the decode waits for each write
     * (`--checkpoint-sync`); 0 = written behind decode (a crash may also
     * lose what the writer had not made durable yet). */
    int checkpoint_sync;
    /** Optional process-wide pool (kvtier/pool.h) the service joins as
     * `pool_name` (required with a pool, unique in it); borrowed, must
     * outlive the service. NULL: no pool (the budgets above are the only
     * limits). With a pool:
     * - RAM axis: the prompt cache's budget starts at 0 and grows before
     *   each publish by what the state may add (reserved, then published on
     *   the axis), never past prompt_cache_bytes; after the put it shrinks to
     *   the bytes the cache holds and the rest goes back to the pool. When
     *   the pool has no room the cache keeps to its current budget (evicting
     *   its own entries, as a full cache does); the refusal is counted.
     * - KV axis: an admission reserves its projected KV bytes beside
     *   kv_budget_bytes (both must fit); acquire publishes them; release
     *   releases them, or drops the reservation when the request never
     *   acquired. The pool's refusal is the admission's: KVT_EAGAIN (wait;
     *   kvt_service_admit_wait looks again every 2 ms, since another
     *   service's release does not wake this one) or KVT_ELIMIT, its message
     *   naming the axis, the member, the bytes asked and the bytes free.
     * The membership is left (everything still charged released) by
     * kvt_service_destroy. */
    struct kvt_pool *pool;
    const char *pool_name; /* copied */
} kvt_service_config;

/** Creates a service.
 * @param cfg  borrowed during the call (layers are copied).
 * @param out  receives the service; caller frees with kvt_service_destroy().
 * @return 0; KVT_EINVAL (a NULL argument, n_layers outside 1..256,
 *   max_positions < 1, a layer with bytes_per_token 0 for a growing kind or a
 *   window < 1; kvt_last_error() names the layer); with layers NULL, the
 *   error of new_caches or KVT_EUNSUPPORTED (a layer of a backend kind:
 *   pass layers); KVT_EINVAL also for a pool without pool_name, and the
 *   errors of kvt_pool_join (KVT_EBUSY: a member of that name is joined);
 *   KVT_ENOMEM; an error of the prompt cache's construction.
 *   Thread-safe.
 */
KVT_API int kvt_service_create(const kvt_service_config *cfg, kvt_service **out);

/** Closes (if not yet closed) and frees the service. NULL is a no-op.
 * Every admission must have been released. Not thread-safe with other calls on it. */
KVT_API void kvt_service_destroy(kvt_service *svc);

/* ---- namespaces ------------------------------------------------------------ */

/** Builds the state namespace of an adapter: "" for the base model
 * (adapter NULL or ""), else "<adapter>@<version>".
 *
 * Adapter names and versions are UTF-8 text without control characters.
 * Adapter names may not contain '@' or control characters and may not start
 * with "object:" (reserved for exact-key objects), so two
 * different (adapter, version) pairs never build the same namespace.
 * @param adapter  NULL or "" for the base model.
 * @param version  required (non-empty, no control characters) with an adapter;
 *                 ignored without one.
 * @param buf,cap  receives the NUL-terminated namespace (cap bytes).
 * @return 0; KVT_EINVAL (bad name or version, with the reason); KVT_ERANGE
 *   (does not fit in cap bytes). Thread-safe.
 */
KVT_API int kvt_service_ns(const char *adapter, const char *version, char *buf, size_t cap);

/* ---- admission ------------------------------------------------------------- */

/** One request as the service sees it. */
typedef struct kvt_request {
    const int32_t *prompt;   /* (n_prompt) token ids; copied by admit */
    int64_t n_prompt;        /* >= 1 */
    int64_t max_tokens;      /* tokens it may generate, >= 0 */
    const char *ns;          /* state namespace (kvt_service_ns), NULL = "" */
    const char *session;     /* session id for affinity, NULL = none */
    int no_reuse;            /* 1: takes fresh state and its state is never kept
                                (a prefix without identity) */
    int64_t live_blocks;     /* with live_bytes, both 0: admission charges the whole context */
    uint64_t live_bytes;     /* else the request keeps at most live_blocks (> 0) full kv blocks
                                (over all its layers) and at most live_bytes (> 0) bytes of them
                                in RAM and pages the rest (a residency bound,
                                kvtier/residency.h): it is charged
                                kvt_service_project_live_bytes instead */
} kvt_request;

/** Projected KV bytes of `n_tokens` tokens of one sequence under this
 * service's model: per-token layers grow with every token (rounded up to
 * whole blocks), window layers stop at W tokens, fixed layers count their
 * fixed bytes. Thread-safe. */
KVT_API uint64_t kvt_service_project_bytes(const kvt_service *svc, int64_t n_tokens);

/** Projected RAM bytes of `n_tokens` tokens of one sequence whose full kv
 * blocks in RAM are bounded (a residency bound): to live_blocks blocks (each
 * the size of the first per-token layer's block) when > 0, and to live_bytes
 * bytes when > 0 (the smaller bound wins). The per-token layers are charged
 * at most that plus one block each (the mutable tails), window and fixed
 * layers as kvt_service_project_bytes; never more than
 * kvt_service_project_bytes, which both 0 give. Thread-safe. */
KVT_API uint64_t kvt_service_project_live_bytes(const kvt_service *svc, int64_t n_tokens, int64_t live_blocks,
                                                uint64_t live_bytes);

/** Admits a request beside the ones already holding state.
 *
 * The request holds its projected bytes (n_prompt + max_tokens tokens) until
 * kvt_service_release().
 * @param out receives the admission (the request's identity until release) on
 *   success; NULL otherwise.
 * @return 0 admitted;
 *   KVT_EAGAIN: does not fit beside the admitted requests now; retry after a
 *     release (or use kvt_service_admit_wait);
 *   KVT_ELIMIT: can never be admitted: n_prompt + max_tokens exceeds the
 *     model's position limit (the message names both numbers and the limit),
 *     or the request alone needs more than the whole KV budget (the message
 *     says how many bytes it needs, the budget, and to lower max_tokens or the
 *     prompt, or raise kvt_service_config.kv_budget_bytes, by that name);
 *   with a pool (kvt_service_config.pool), also the pool's KVT_EAGAIN or
 *   KVT_ELIMIT on the KV axis (the message names the axis "kv", the
 *   service's member, the bytes asked and the bytes free);
 *   KVT_EINVAL (NULL or malformed request); KVT_ECLOSED; KVT_ENOMEM.
 * Thread-safe.
 */
KVT_API int kvt_service_admit(kvt_service *svc, const kvt_request *req, kvt_admission **out);

/** As kvt_service_admit, but waits up to timeout_ms milliseconds (< 0: no
 * limit) for a release to make room. @return as kvt_service_admit; KVT_EAGAIN
 * when the wait timed out. Thread-safe (waits without holding the mutex). */
KVT_API int kvt_service_admit_wait(kvt_service *svc, const kvt_request *req, int64_t timeout_ms,
                                   kvt_admission **out);

/** Whether kvt_service_admit would admit `req` now; holds nothing.
 * @return 1 fits, 0 must wait, or the KVT_ELIMIT/KVT_EINVAL/KVT_ECLOSED of
 * kvt_service_admit. Thread-safe. */
KVT_API int kvt_service_fits(kvt_service *svc, const kvt_request *req);

/* ---- request state ----------------------------------------------------------- */

/** A request's state, owned by the caller.
 *
 * Arrays: kvtier frees an array only if kvtier allocated it. A state filled
 * by kvt_service_acquire(), kvt_state_init() or kvt_state_clone() holds
 * arrays from kvtier's allocator (kvt_set_allocator) and says so in
 * `kvtier_arrays`; kvt_state_clear() and a successful
 * kvt_service_publish() free them. A state you fill yourself (a stack array,
 * your own malloc; kvtier_arrays left 0) keeps its arrays: kvt_state_clear()
 * and publish only destroy or adopt the caches and attachments in them, and
 * the arrays stay yours. Either way, ending a state is the same code:
 * publish or not, then kvt_state_clear() (a no-op on what publish took). */
typedef struct kvt_state {
    int32_t n_layers;
    kvt_cache **caches;          /* (n_layers) the caller owns each */
    int64_t reused_tokens;       /* prompt tokens the caches already cover; 0 = miss */
    int32_t n_attachments;
    kvt_attachment **attachments; /* (n_attachments) stored with a reused prefix */
    kvt_hook hook;               /* runs after the caches and attachments are gone
                                    (keeps a restored donor's backing alive) */
    int32_t kvtier_arrays;       /* nonzero: kvtier allocated `caches` and
                                    `attachments` (set by acquire, init and
                                    clone; never set it yourself) */
} kvt_state;

/** Makes *st an empty state whose arrays come from kvtier's allocator:
 * `caches` holds n_layers NULL slots, `attachments` n_attachments NULL
 * slots (NULL when 0), no hook, reused_tokens 0. Fill the slots, then hand
 * it to kvt_service_publish() and/or end it with kvt_state_clear(), which
 * free the arrays.
 * @return 0; KVT_EINVAL (st NULL, n_layers < 1 or n_attachments < 0);
 *   KVT_ENOMEM (then *st is zeroed). Thread-safe (touches only `st`). */
KVT_API int kvt_state_init(kvt_state *st, int32_t n_layers, int32_t n_attachments);

/** The prompt-boundary snapshot: *out becomes a state (arrays from kvtier,
 * as kvt_state_init) holding a zero-copy clone of every cache of `src`
 * (kvt_cache_clone: full blocks shared, nothing copied) and a clone of every
 * attachment; reused_tokens is copied, the hook is not (the clone holds no
 * share of src's hook: the clones' buffers are refcounted and keep their
 * bytes alive by themselves, as they do for state the SSD store restores).
 * `src` is only read and stays the caller's. Publish *out while `src` keeps
 * running, then kvt_state_clear(out).
 * @return 0; KVT_EINVAL (NULL argument, src without caches or with a NULL
 *   slot); KVT_ENOMEM or a clone error (then *out is zeroed, nothing is left
 *   allocated). Thread-safe with other readers of src's caches. */
KVT_API int kvt_state_clone(const kvt_state *src, kvt_state *out);

/** The request's state: the longest reusable prefix of its prompt in its
 * namespace (at most n_prompt - 1 tokens: one must run to give logits), else
 * fresh caches.
 *
 * @param out filled on success (its arrays are kvtier's, see kvt_state); the
 *   caller owns it and ends it with kvt_state_clear(), after handing it to
 *   kvt_service_publish() or not.
 * @param adm a live admission (not yet released; anything else is undefined).
 * @return 0; KVT_EINVAL (NULL service, admission or out); KVT_ECLOSED;
 *   KVT_ENOMEM or a cache-creation error (nothing is left allocated).
 * Thread-safe.
 */
KVT_API int kvt_service_acquire(kvt_service *svc, kvt_admission *adm, kvt_state *out);

/** Ends a state: destroys every non-NULL cache and attachment, then runs the
 * hook, then frees the two arrays if kvtier allocated them (kvtier_arrays;
 * arrays of your own are left to you), and zeroes *st. NULL and a zeroed
 * state are no-ops, so calling it after a successful kvt_service_publish()
 * is harmless. Thread-safe (touches only `st`). */
KVT_API void kvt_state_clear(kvt_state *st);

/** Whether state the request publishes may be kept (a prompt cache exists and
 * the request reuses prefixes): a caller skips snapshots the service would
 * drop. @return 1 or 0 (0 for NULL arguments). Thread-safe. */
KVT_API int kvt_service_keeps(kvt_service *svc, const kvt_admission *adm);

/** Offers state covering tokens[0..n_tokens) for reuse in the request's
 * namespace and session; the prompt cache keeps or drops it by its budget
 * and retention policy. With a cold tier, kept state is queued for it
 * before publish returns (write-behind; see kvt_service_config.cold).
 *
 * Every cache must hold exactly n_tokens tokens. On success the service
 * adopts the caches, the attachments and the hook in `st`, frees the arrays
 * if kvtier allocated them (arrays of your own are never freed: see
 * kvt_state) and zeroes *st. On error nothing is taken and *st is unchanged.
 * Either way the caller may end with kvt_state_clear(st).
 * To keep using the live caches, publish a clone (kvt_state_clone): that is
 * the zero-copy prompt-boundary snapshot, which must be taken while the
 * caches hold exactly the prompt (a wrapped ring or a recurrent state cannot
 * be rewound later).
 * @return 0; KVT_EINVAL (NULL argument, n_tokens < 1, a cache whose offset is
 *   not n_tokens, wrong layer count; kvt_last_error says which);
 *   KVT_EUNSUPPORTED (the service keeps nothing for this request: see
 *   kvt_service_keeps); KVT_ECLOSED; KVT_ENOMEM.
 * Thread-safe.
 */
KVT_API int kvt_service_publish(kvt_service *svc, kvt_admission *adm, const int32_t *tokens,
                                int64_t n_tokens, kvt_state *st);

/** Ends a request: its projected KV bytes return to the budget and waiting
 * admissions are woken. The admission is freed; NULL is a no-op.
 * @param completed 1 when the generation ran to its end (stop token or
 *   max_tokens), 0 when it was interrupted or failed. For a replayable
 *   request (kvt_service_resume) 1 queues the removal of its checkpoints
 *   behind its queued writes (release never waits for I/O); 0 keeps them for
 *   the request to resume.
 * Thread-safe. */
KVT_API void kvt_service_release(kvt_service *svc, kvt_admission *adm, int completed);

/** An execution boundary passed: while the config's pressure check says so,
 * the prompt cache gives optional RAM snapshots back. Never
 * changes a running request; no storage I/O. No-op without a pressure check.
 * For a backend that measures its own live memory (a device allocator, say)
 * and calls this between its steps; not the prompt-boundary snapshot, which
 * is kvt_state_clone() then kvt_service_publish(). Thread-safe. */
KVT_API void kvt_service_boundary(kvt_service *svc);

/** Longest usable prefix of prompt (tokens) held in RAM under `ns` (NULL =
 * ""), without taking it; 0 without a prompt cache. Thread-safe. */
KVT_API int64_t kvt_service_peek(kvt_service *svc, const int32_t *prompt, int64_t n_prompt, const char *ns);

/** A prompt cache prefetch lease (kvtier/prompt_cache.h). */
typedef struct kvt_lease kvt_lease;

/** Starts reading the cold tier's prefix of `prompt` (n_prompt tokens) in
 * `ns` (NULL = "") while a request is being prepared, before it is admitted:
 * identical reads coalesce, the loaded entry is published
 * to RAM and pinned until the lease is released, so acquire finds it there.
 * @param out receives a lease even when there is nothing to read (NULL
 *   without a prompt cache); wait on it with kvt_lease_wait() and release it
 *   with kvt_lease_release() (kvtier/prompt_cache.h), after acquire.
 * @return 0; KVT_EINVAL; KVT_ECLOSED; the prompt cache's error.
 * Thread-safe. */
KVT_API int kvt_service_prefetch(kvt_service *svc, const int32_t *prompt, int64_t n_prompt, const char *ns,
                                 const char *session, kvt_lease **out);

/** Makes every write queued to the cold tier durable, and every queued
 * generation checkpoint write and removal done (checkpoint_store).
 * @return 0 (durable, or no cold tier); KVT_EINVAL (svc NULL); the
 *   checkpoint writer's last failure since the previous flush, else the cold
 *   tier's first write error (kvt_last_error says so). Thread-safe. */
KVT_API int kvt_service_flush(kvt_service *svc);

/** Drops a session's affinity; never the data. NULL is a
 * no-op. Thread-safe. */
KVT_API void kvt_service_close_session(kvt_service *svc, const char *session);

/* ---- generation checkpoints ------------------------------------------------------ */

/*
 * A replayable request carries an id (the server's Idempotency-Key,
 * `kvtier generate --request-id`). While it generates, the caller saves a
 * checkpoint every kvt_service_checkpoint_every() generated tokens: a
 * zero-copy clone of its caches (prompt + fed reply tokens), the pending
 * token (chosen, not yet fed), and the sampler's state. The clone is all
 * the decode thread pays: the write goes through the SSD store's crash-safe
 * path (kvt_store_put: temp file, fsync, rename) on the checkpoint writer's
 * thread, and kv blocks already on disk are shared, not written again.
 * kvt_service_release(completed = 1) removes the request's checkpoints
 * (after its queued writes); completed = 0 keeps them, and the same request
 * with the same id resumes from its newest valid one with
 * kvt_service_resume(), in this process or after a crash or restart.
 *
 * On disk a checkpoint is an ordinary entry of the store in the namespace
 * "checkpoint:<32 hex>" (XXH3-128 of the request id and the request's own
 * namespace: no prompt lookup ever sees it), with one attachment
 * "kvtier.generation" holding the metadata (docs/checkpoints.md).
 */

/** Bytes of a request id, at most (the id is hashed into the key). */
#define KVT_REQUEST_ID_MAX 255

/** A replayable generation: its id and how it samples. */
typedef struct kvt_replay {
    const char *request_id; /* 1..KVT_REQUEST_ID_MAX bytes, no control
                               characters; copied */
    uint64_t seed;          /* the sampler seed the generation starts from */
    int seed_explicit;      /* 1: the client chose the seed, so a checkpoint
                               made with another seed is a mismatch; 0: a
                               resumed generation takes the checkpoint's seed */
    float temperature;      /* the sampler's settings: a checkpoint made with */
    float topp;             /* other ones is a mismatch */
    int32_t vocab_size;     /* > 0: a pending token outside [0, vocab_size)
                               is a mismatch; 0: not checked */
} kvt_replay;

/** What a checkpoint records about its generation. */
typedef struct kvt_checkpoint_info {
    int64_t prompt_tokens;    /* the original prompt's length */
    int64_t generated_tokens; /* reply tokens so far, the pending one included (>= 1) */
    int32_t pending_token;    /* the last reply token: chosen, not yet fed */
    uint64_t seed;            /* the sampler's seed */
    uint64_t rng_state;       /* the sampler's generator state after choosing
                                 the pending token */
    uint64_t rng_draws;       /* random draws made so far (the RNG position) */
    float temperature, topp;  /* the sampler's settings */
} kvt_checkpoint_info;

/** Generated tokens between two checkpoints of a replayable request (the
 * config's checkpoint_every), or 0 when the service keeps no checkpoints.
 * Thread-safe. */
KVT_API int64_t kvt_service_checkpoint_every(const kvt_service *svc);

/** The state of a replayable request: its newest valid checkpoint, else
 * what kvt_service_acquire() gives.
 *
 * Marks the admission replayable under `rp` (kvt_service_checkpoint is
 * allowed from then on; its release decides the checkpoints' fate). Waits
 * until the checkpoint writer holds no queued write of this request (a
 * retry in the same process sees every checkpoint made), then tries the
 * request's checkpoints newest first: one that fails to restore (a checksum
 * or format refusal, a shard gone) is skipped for the next older one. The
 * first that restores is validated against the request and itself, and a
 * mismatch is an error naming the field, never a silently wrong
 * continuation: its prompt (the original prompt length, then the tokens),
 * the generated count (>= 1, at most the request's max_tokens, and the
 * entry holding exactly prompt + generated - 1 tokens), the pending token
 * (inside [0, rp->vocab_size)), the seed (when rp->seed_explicit), the
 * temperature and the top-p.
 *
 * @param rp borrowed during the call (copied).
 * @param out on success the caller's state (see kvt_state): resumed, its
 *   caches hold the prompt and the fed reply tokens (n_prompt +
 *   generated_tokens - 1) and reused_tokens is n_prompt; else as
 *   kvt_service_acquire.
 * @param info receives the checkpoint's metadata; generated_tokens 0 when
 *   nothing was resumed (then the rest of *info is zero).
 * @param reply (reply_cap) receives the generated_tokens reply tokens, the
 *   pending one last; reply_cap >= the request's max_tokens.
 * @return 0; KVT_EINVAL (NULL argument, a bad request id, reply_cap below
 *   max_tokens, or the admission already replayable); KVT_EMISMATCH (the
 *   newest readable checkpoint does not match: kvt_last_error names the
 *   field, the request id and both values; nothing is held); KVT_ECLOSED;
 *   KVT_ENOMEM; an error of kvt_service_acquire. Thread-safe. */
KVT_API int kvt_service_resume(kvt_service *svc, kvt_admission *adm, const kvt_replay *rp, kvt_state *out,
                               kvt_checkpoint_info *info, int32_t *reply, int64_t reply_cap);

/** Saves a checkpoint of a replayable request (write-behind).
 *
 * Clones `caches` (zero-copy: full kv blocks are shared; the live caches
 * copy a shared tail on their next write) and queues the clone with the
 * metadata for the checkpoint writer; returns without I/O. A queued
 * checkpoint of the same request not yet being written is replaced by this
 * newer one (superseded). The writer keeps the request's two newest durable
 * checkpoints and removes older ones.
 * @param caches (n_layers) borrowed, each holding exactly n_tokens tokens;
 *   the caller keeps using them.
 * @param tokens (n_tokens) the prompt then the fed reply tokens; n_tokens =
 *   info->prompt_tokens + info->generated_tokens - 1.
 * @param info borrowed; prompt_tokens must be the request's, seed the one
 *   the request resumed or started with.
 * With checkpoint_sync it returns once the writer finished this checkpoint
 * (durable, or failed: counted in `failed`, reported by kvt_service_flush).
 * @return 0 (queued); KVT_EAGAIN (the writer's queue is over its byte bound:
 *   this checkpoint is dropped, counted; decode goes on); KVT_EINVAL (NULL
 *   argument, counts that do not add up, a cache not holding n_tokens, or
 *   a seed other than the request's); KVT_EUNSUPPORTED (no checkpoint store,
 *   or the admission is not replayable: kvt_service_resume first);
 *   KVT_ECLOSED; KVT_ENOMEM or a clone error. Thread-safe. */
KVT_API int kvt_service_checkpoint(kvt_service *svc, kvt_admission *adm, kvt_cache *const *caches,
                                   const int32_t *tokens, int64_t n_tokens, const kvt_checkpoint_info *info);

/** Counters of the checkpoint writer, one list: X(name, kind, help). */
#define KVT_CHECKPOINT_COUNTERS(X)                                                              \
    X(queued, counter, "checkpoints accepted by kvt_service_checkpoint")                        \
    X(written, counter, "checkpoints made durable")                                             \
    X(dropped, counter, "checkpoints refused because the writer's queue was full")              \
    X(superseded, counter, "queued checkpoints replaced by a newer one of the same request")    \
    X(failed, counter, "checkpoint writes or removals that failed")                             \
    X(removed, counter, "checkpoint entries removed (completed requests, older checkpoints)")   \
    X(resumes, counter, "generations resumed from a checkpoint")                                \
    X(resumed_tokens, counter, "tokens those resumes restored instead of recomputing")          \
    X(unreadable, counter, "checkpoints that failed to restore and were skipped")               \
    X(mismatches, counter, "resumes refused because a checkpoint did not match the request")    \
    X(pending, gauge, "checkpoint writes and removals queued or in flight")                     \
    X(pending_bytes, gauge, "cache bytes the queued checkpoints hold")

/** Counters of the checkpoint writer (see KVT_CHECKPOINT_COUNTERS); all uint64. */
typedef struct kvt_checkpoint_stats {
#define KVT__CKPT_FIELD(name, kind, help) uint64_t name;
    KVT_CHECKPOINT_COUNTERS(KVT__CKPT_FIELD)
#undef KVT__CKPT_FIELD
} kvt_checkpoint_stats;

/** Fills `out` with the checkpoint counters (all zero without a checkpoint
 * store). @return 0, KVT_EINVAL (NULL argument). Thread-safe. */
KVT_API int kvt_service_checkpoint_stats(kvt_service *svc, kvt_checkpoint_stats *out);

/* ---- report ------------------------------------------------------------------ */

/** The service's own counters, one list: X(name, group, key, kind, help):
 * field `name` of kvt_service_stats, reported as `key` in the object `group`
 * ("requests" or "kv") of kvt_service_stats_json; kind counter (only grows),
 * gauge (a current value) or limit (a gauge whose 0 means unlimited: null in
 * the JSON); help a one-line sentence (for Prometheus HELP lines). */
#define KVT_SERVICE_COUNTERS(X)                                                                        \
    X(acquires, requests, acquires, counter, "kvt_service_acquire calls that succeeded")               \
    X(reused_tokens, requests, reused_tokens, counter, "Prompt tokens reused over those acquires")     \
    X(publishes, requests, publishes, counter, "States kvt_service_publish accepted")                  \
    X(admitted, requests, admitted, gauge, "Admissions held now")                                      \
    X(kv_projected_bytes, kv, projected_bytes, gauge, "Projected KV bytes of the admitted requests")   \
    X(kv_budget_bytes, kv, budget_bytes, limit, "KV byte budget requests are admitted under")          \
    X(rejected, requests, rejected, counter, "Requests refused because they can never fit (KVT_ELIMIT)") \
    X(waited, requests, waited, counter, "Admissions answered KVT_EAGAIN (wait for room)")                 \
    X(live_paged_out_blocks, kv, live_paged_out_blocks, counter,                                       \
      "Full kv blocks bounded requests wrote to their page files (kvtier/residency.h)")                \
    X(live_paged_out_bytes, kv, live_paged_out_bytes, counter, "Their bytes")                           \
    X(live_paged_in_blocks, kv, live_paged_in_blocks, counter, "Blocks bounded requests read back")     \
    X(live_paged_in_bytes, kv, live_paged_in_bytes, counter, "Their bytes")                             \
    X(live_page_stall_ms, kv, live_page_stall_ms, counter, "ms attention waited for blocks being read") \
    X(live_page_failures, kv, live_page_failures, counter, "Page writes failed (blocks kept in RAM) and reads failed")

/** What the service holds, as it reports itself (/stats): every counter of
 * its prompt cache (KVT_PROMPT_CACHE_COUNTERS, each as uint64; all 0 without
 * a prompt cache), then its own (KVT_SERVICE_COUNTERS). */
typedef struct kvt_service_stats {
#define KVT__SVC_PC_FIELD(type, name, kind, help) uint64_t name;
    KVT_PROMPT_CACHE_COUNTERS(KVT__SVC_PC_FIELD)
#undef KVT__SVC_PC_FIELD
#define KVT__SVC_FIELD(name, group, key, kind, help) uint64_t name;
    KVT_SERVICE_COUNTERS(KVT__SVC_FIELD)
#undef KVT__SVC_FIELD
} kvt_service_stats;

/** Fills `out` with a snapshot of the counters. @return 0, KVT_EINVAL. Thread-safe. */
KVT_API int kvt_service_get_stats(kvt_service *svc, kvt_service_stats *out);

/** Adds what one bounded request paged (kvt_residency_stats_get at its
 * end) to the service's live_* counters. NULL arguments are a no-op.
 * Thread-safe. */
KVT_API void kvt_service_count_residency(kvt_service *svc, const kvt_residency_stats *st);

/* ---- per-layer residency telemetry ------------------------------------------------ */

/** Layers the telemetry names one by one; the rest are one overflow group. */
#define KVT_LAYER_REPORT_LIMIT 64

/** The per-layer telemetry, one list: X(name, kind, help). Every entry the
 * service keeps holds every layer, so an entry's promotion, demotion or
 * eviction counts for each of its layers; bytes are the layer's own. For the
 * overflow group each field is the sum over its layers. */
#define KVT_LAYER_COUNTERS(X)                                                                          \
    X(ram_bytes, gauge, "RAM bytes of the layer's state in the prompt cache, shared blocks counted once") \
    X(ram_shared_blocks, gauge, "Buffers (blocks) of the layer held by more than one RAM entry")        \
    X(ssd_bytes, gauge, "Bytes of the layer's state the SSD tier's index holds, a shared block file once") \
    X(remote_written_bytes, counter,                                                                   \
      "Bytes of the layer's state this host wrote to the remote tier (not residency: Redis evicts "     \
      "without telling)")                                                                              \
    X(restores, counter, "Cold-tier restores that brought the layer's state")                          \
    X(restored_bytes, counter, "Bytes of the layer's state those restores read")                       \
    X(written, counter, "States of the layer handed to the cold tier (write-behind and spills)")      \
    X(written_bytes, counter, "Bytes of the layer's state handed to the cold tier")                    \
    X(promotions, counter, "Restored prefixes put into RAM (each holds the layer)")                    \
    X(demotions, counter, "Entries released from RAM by relieve, demote_idle and reclaim")            \
    X(evictions, counter, "Entries evicted for the RAM budget (each holds the layer)")

/** One layer's telemetry, or the overflow group's (see KVT_LAYER_COUNTERS). */
typedef struct kvt_layer_stats {
    int32_t first_layer, last_layer; /* equal for a layer named alone */
#define KVT__LAYER_FIELD(name, kind, help) uint64_t name;
    KVT_LAYER_COUNTERS(KVT__LAYER_FIELD)
#undef KVT__LAYER_FIELD
} kvt_layer_stats;

/** Groups the telemetry reports: min(n_layers, KVT_LAYER_REPORT_LIMIT),
 * plus one overflow group past that many layers (0 for NULL). Thread-safe. */
KVT_API int32_t kvt_service_layer_groups(const kvt_service *svc);

/** Fills out[0..groups) (layer 0 first; the overflow group last). RAM bytes
 * come from a walk of the prompt cache (kvt_prompt_cache_layer_usage);
 * ssd_bytes from the layer_bytes of every cold tier level that reports
 * residency (KVT_LAYER_BYTES_RESIDENT: the SSD tier's index, e.g.
 * kvt_store_layer_bytes); remote_written_bytes from the levels that can only
 * say what this host wrote (KVT_LAYER_BYTES_WRITTEN: the remote tier,
 * kvt_remote_layer_written_bytes); restores and written from what passed
 * between the prompt cache and its cold tier. @param cap out's length, at least kvt_service_layer_groups.
 * @return the groups filled; KVT_EINVAL (NULL argument, cap too small);
 *   KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_service_layer_stats(kvt_service *svc, kvt_layer_stats *out, int32_t cap);

/** How many cold tiers the report lists: the levels of the config's chain,
 * else 1 for a cold tier with a stats operation, else 0 (NULL: 0).
 * Thread-safe. */
KVT_API int32_t kvt_service_tier_count(kvt_service *svc);

/** Fills *out with the counters of listed tier `level` (0 = top):
 * kvt_tier_chain_level_stats of the config's chain, else the cold tier's
 * stats operation. @return 0; KVT_EINVAL (svc or out NULL, level outside
 * 0..kvt_service_tier_count - 1). Thread-safe. */
KVT_API int kvt_service_tier_stats(kvt_service *svc, int32_t level, kvt_tier_stats *out);

/** The name of listed tier `level` (0 = top): kvt_tier_chain_level_name of
 * the config's chain (e.g. "ssd", "redis", "published"), else "cold" for a
 * cold tier without a chain. Borrowed, valid until the service is
 * destroyed. NULL for a NULL svc or a level outside
 * 0..kvt_service_tier_count - 1. Thread-safe. */
KVT_API const char *kvt_service_tier_name(kvt_service *svc, int32_t level);

/** The report as one JSON document:
 *   {"prefixes": {every KVT_PROMPT_CACHE_COUNTERS name: n},
 *    "requests": {"acquires", "reused_tokens", "publishes", "admitted",
 *                 "rejected", "waited"},
 *    "kv": {"projected_bytes", "budget_bytes" (null when unlimited)},
 *    "tiers": [{"level": 0, "name": "ssd", every KVT_TIER_COUNTERS name: n},
 *              ...],
 *    "layers": [{"layer": "0" (or "64-99", the overflow group), every
 *                KVT_LAYER_COUNTERS name: n}, ...] (kvt_service_layer_stats),
 *    "pool": null, or {"member": name, "members": n,
 *             "axes": {"ram"|"kv"|"disk"|"remote": {"limit" (null when not
 *                      limited), "reserved", "published", "used",
 *                      "high_water", "refusals"}}  (this service's own),
 *             "totals": {same axes, over the whole pool}}}
 * ("requests" and "kv" hold the KVT_SERVICE_COUNTERS by group and key;
 * "tiers" the kvt_service_tier_name and kvt_service_tier_stats of each
 * listed tier, top first, and is empty without a cold tier.)
 * @param out receives a NUL-terminated string; caller frees with
 *   kvt_string_free(). @return 0, KVT_EINVAL, KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_service_stats_json(kvt_service *svc, char **out);

/** Closes the service: stops idle demotion, runs the checkpoint writer's
 * queued jobs (checkpoint_store), flushes the cold tier (if any),
 * hands it every RAM entry it does not hold yet and flushes it again (every
 * queued write made durable, so a restarted process finds the prefixes on
 * disk), clears the prompt cache and refuses new work
 * (KVT_ECLOSED). Idempotent: a second call does nothing and returns 0 once
 * the first has finished. The flush runs without the service mutex held, so
 * kvt_service_get_stats() and other calls answer meanwhile.
 * Errors of every step are aggregated (the first code is returned, the
 * message lists each); no step is skipped because an earlier one failed.
 * Admissions still held stay valid for release. Thread-safe. */
KVT_API int kvt_service_close(kvt_service *svc);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_SERVICE_H */
