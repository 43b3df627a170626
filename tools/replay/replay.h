/*
 * kvtier/replay.h: serving-trace replay: load a Mooncake-format trace, turn
 * its requests into token sequences, and measure what a prefix cache of a
 * given block capacity would have saved.
 *
 * Trace format (JSON lines, as Mooncake publishes them): one request a line,
 * {"timestamp": ms, "input_length": tokens, "output_length": tokens,
 *  "hash_ids": [int, ...]}, one hash id per 512-token block of the input,
 * each id standing for that block and every block before it.
 *
 * Two engines run a trace:
 *   - the block-level simulator (kvt_replay_sim): ids only, no kv bytes.
 *     Policies "lru-ref" (plain block LRU, every id touched in request order:
 *     the cross-check against the README's table), "opt" (Belady's offline
 *     optimum: evict the block whose next use is farthest, never admit a block
 *     used later than everything resident) and every kvt_block_policy name
 *     (driven like the prompt cache drives it).
 *   - the real prompt cache (kvt_replay_cache, when the library has it): each
 *     request's prompt is taken, extended and put back through the RAM tier.
 * A simulator hit is a hash id resident at lookup; "prefix" hits count only
 * the blocks before a request's first miss (what a prefix cache can use).
 *
 * Thread-safety: a loaded trace is read-only and may be shared by threads;
 * each replay call uses only its own state.
 */
#ifndef KVTIER_REPLAY_H
#define KVTIER_REPLAY_H

#include "kvtier/common.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Tokens per trace hash id (Mooncake blocks). */
#define KVT_TRACE_BLOCK_TOKENS 512

/** One request of a trace. */
typedef struct kvt_trace_request {
    int64_t timestamp_ms;  /* arrival, ms from trace start */
    int32_t input_length;  /* prompt tokens, >= 1 */
    int32_t output_length; /* generated tokens, >= 0 */
    int32_t n_blocks;      /* hash ids = ceil(input_length / 512) */
    int64_t first;         /* index of its first id in kvt_trace.ids */
} kvt_trace_request;

/** A loaded trace (plain data, read-only after loading). */
typedef struct kvt_trace {
    int64_t n_requests;
    kvt_trace_request *requests; /* (n_requests) */
    int64_t n_ids;
    int64_t *ids;                /* (n_ids) every request's hash ids, in order */
    int64_t max_id;              /* largest id (ids are >= 0) */
} kvt_trace;

/** Loads a trace file.
 *
 * @param path         JSON lines file (borrowed).
 * @param max_requests load at most this many requests (first lines); <= 0
 *                     loads all.
 * @param out          receives the trace; the caller frees it with
 *                     kvt_trace_destroy().
 * @return 0; -errno (cannot open or read); KVT_EFORMAT (no request at all,
 *         a line that is not a request object, a negative id or length, or a hash_ids length
 *         that is not ceil(input_length / 512): kvt_last_error names the
 *         line and field); KVT_EINVAL (NULL argument); KVT_ENOMEM. On error
 *         *out is NULL.
 */
KVT_API int kvt_trace_load(const char *path, int64_t max_requests, kvt_trace **out);

/** Frees a trace (NULL is a no-op). */
KVT_API void kvt_trace_destroy(kvt_trace *t);

/** The 512 tokens that stand for hash id `id`.
 *
 * Deterministic (splitmix64 seeded by the id): equal ids give equal tokens,
 * different ids give different tokens from the first one on (ids map one to
 * one to first tokens for ids < 2^31), so two prompts share a token prefix
 * exactly as long as they share hash ids. Tokens are in [0, 2^31).
 * @param out receives KVT_TRACE_BLOCK_TOKENS tokens. Thread-safe.
 */
KVT_API void kvt_trace_block_tokens(int64_t id, int32_t *out);

/** The prompt of request `r`: its blocks' tokens, concatenated, cut to
 * input_length. The partial last block (input_length not a multiple of 512)
 * is the first input_length % 512 tokens of its id's 512 tokens: the trace
 * gives that partial block its own id, so it is only ever shared with a
 * prompt holding the very same partial block.
 * @param out receives r->input_length tokens (the caller sizes it).
 * @return 0 or KVT_EINVAL (NULL argument; r's ids outside t->ids, or an
 * input_length that is not ceil-consistent with its n_blocks). Thread-safe.
 */
KVT_API int kvt_trace_prompt(const kvt_trace *t, const kvt_trace_request *r, int32_t *out);

/** What a replay measured. Block figures count trace blocks (512 tokens). */
typedef struct kvt_replay_result {
    int64_t requests;         /* requests replayed */
    int64_t blocks;           /* blocks requested (sum of n_blocks) */
    int64_t block_hits;       /* simulator: ids resident at lookup; cache:
                                 blocks whose reusable tokens all came from
                                 the cache (RAM or SSD) */
    int64_t prefix_block_hits; /* hits before each request's first miss */
    int64_t tokens;           /* prompt tokens requested */
    int64_t token_hits;       /* prompt tokens served from the cache */
    int64_t ram_block_hits, ssd_block_hits; /* cache: hits by tier */
    int64_t bytes_spilled, bytes_restored;  /* cache: to and from the SSD tier */
    int64_t entries_evicted;  /* cache: entries dropped or spilled whole */
    int64_t blocks_trimmed;   /* cache: blocks cut off entry tails */
    int64_t peak_blocks;      /* most blocks resident at once */
    double seconds;           /* wall time of the replay loop */
} kvt_replay_result;

/** Names the simulator accepts: "lru-ref", "opt", then the block policies.
 * @param names receives `count` static strings (may be NULL): a static
 *        array. @return the count. Thread-safe. */
KVT_API int kvt_replay_sim_policies(const char *const **names);

/** Progress callback: `done` of `total` requests replayed; return non-zero
 * to stop early (the result then covers the requests done). */
typedef int (*kvt_replay_progress_fn)(int64_t done, int64_t total, void *ctx);

/** Replays a trace through the block-level simulator.
 *
 * @param t               the trace (borrowed for the call).
 * @param policy          a kvt_replay_sim_policies() name.
 * @param capacity_blocks resident blocks at most, >= 1.
 * @param progress        called every 256 requests and at the end (may be NULL).
 * @param out             receives the figures (zeroed first).
 * @return 0; KVT_EINVAL (NULL argument, capacity < 1); KVT_ENOTFOUND
 *         (unknown policy); KVT_ENOMEM.
 */
KVT_API int kvt_replay_sim(const kvt_trace *t, const char *policy, int64_t capacity_blocks,
                           kvt_replay_progress_fn progress, void *ctx, kvt_replay_result *out);

/** Names kvt_replay_cache accepts: the block policies ("lru": block-level
 * LRU, leaf first; "lfu-aged"), which cut entries block by block, then
 * "entry-lru" and "entry-slru", the prompt cache's entry-level retention
 * (whole entries leave). @param names receives a static array (may be
 * NULL). @return the count. Thread-safe. */
KVT_API int kvt_replay_cache_policies(const char *const **names);

/** Bounds of kvt_replay_cache: the block policy's tables are sized by the
 * capacity (16 sketch counters per block) and the replay holds one prompt of
 * kv state, so larger values would allocate without bound (2^24 blocks is
 * 8.6 billion tokens, far past the point where nothing is ever evicted). */
#define KVT_REPLAY_MAX_BLOCKS (INT64_C(1) << 24)
#define KVT_REPLAY_MAX_BYTES_PER_TOKEN (1 << 16)

/** Host bytes the prompt cache holds per resident token besides the token's
 * kv bytes, as a replay sees it: the entry's copy of its tokens, the radix
 * index's edge labels, the block keys and the block policy's slots (none of
 * which the cache's byte budget counts), plus heap fragmentation. Measured
 * at 9.6-12.3 bytes on the shared Mooncake traces (peak heap in use minus
 * counted bytes, per resident token); `kvtier replay --ram B` sizes the
 * capacity as B / (512 * (bytes_per_token + this)) so that the whole
 * replay, not only its kv bytes, stays within B. */
#define KVT_REPLAY_HOST_BYTES_PER_TOKEN 16

/** How kvt_replay_cache runs. */
typedef struct kvt_replay_config {
    const char *policy;        /* a kvt_replay_cache_policies() name */
    int64_t capacity_blocks;   /* RAM budget in 512-token blocks, 1 to
                                  KVT_REPLAY_MAX_BLOCKS */
    int32_t bytes_per_token;   /* kv bytes per token (K and V, f32): a
                                  multiple of 8, 8 to KVT_REPLAY_MAX_BYTES_PER_TOKEN */
    int64_t ssd_blocks;        /* SSD tier budget in 512-token blocks (the
                                  real store, kvtier/store.h), at most
                                  KVT_REPLAY_MAX_BLOCKS; 0 = RAM only */
    const char *ssd_dir;       /* the store's root; NULL = a fresh temporary
                                  directory, removed after the replay */
} kvt_replay_config;

/** Replays a trace through the real RAM prompt cache (kvtier/prompt_cache.h).
 *
 * One kv layer of bytes_per_token / 8 floats per token for K (and as many
 * for V) in blocks of 512 tokens. The RAM budget is capacity_blocks * 512 *
 * bytes_per_token bytes plus 64 bytes per block for the caches' own
 * bookkeeping (private bytes). Each request: take(prompt), append the
 * prompt's tokens after the prefix it lent (zeros: the values do not
 * matter here), put the whole prompt back (it supersedes the entry it
 * extends). A block is a hit when every token of it that the request could
 * reuse (all but the prompt's final token) came from the cache.
 *
 * With ssd_blocks > 0 the prompt cache tiers over an SSD store of
 * ssd_blocks * 512 * bytes_per_token bytes: evicted entries and the whole
 * prefix of an entry before its first block cut are spilled (write-behind),
 * and a take restores from SSD when it holds a strictly longer prefix than
 * RAM. The replay waits for each request's spills to be durable before the
 * next request (kvt_store_flush), as if writes kept up with arrivals: the
 * trace's requests are far apart next to a write, the replay's are not.
 * bytes_spilled / bytes_restored are the store's shard bytes written and
 * read.
 *
 * @param out receives the figures (zeroed first); peak_blocks is the most
 *        bytes resident at once (private bytes included), in blocks.
 * @return 0; KVT_EINVAL (NULL argument, capacity or ssd_blocks outside
 *         [1, KVT_REPLAY_MAX_BLOCKS] / [0, KVT_REPLAY_MAX_BLOCKS],
 *         bytes_per_token not a multiple of 8 in [8, KVT_REPLAY_MAX_BYTES_PER_TOKEN]); KVT_ENOTFOUND
 *         (unknown policy); KVT_ENOMEM; -errno (the SSD directory); an error
 *         of the prompt cache or the store (kvt_last_error says).
 */
KVT_API int kvt_replay_cache(const kvt_trace *t, const kvt_replay_config *cfg,
                             kvt_replay_progress_fn progress, void *ctx, kvt_replay_result *out);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_REPLAY_H */
