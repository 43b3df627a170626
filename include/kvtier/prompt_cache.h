/*
 * kvtier/prompt_cache.h: the RAM tier: a byte-capped prefix cache of entries
 * (ns, tokens, layer caches, attachments, release hook), indexed by a radix
 * tree per namespace, tiered over an optional cold tier (kvtier/tier.h).
 *
 * Typical use by an engine (the config sets new_caches, so a miss lends
 * fresh caches and one path serves hit and miss):
 *   kvt_hit hit;
 *   kvt_prompt_cache_lend(pc, prompt, n, "", "chat-7", &hit);
 *   // prefill prompt[hit.prefix_len..n) into hit.entry.caches, generate
 *   // into all[0..n_all), then put the longer state back:
 *   kvt_prompt_cache_put_hit(pc, &hit, all, n_all, "chat-7");
 *   kvt_hit_clear(&hit);     // releases what put_hit did not adopt
 * Shutdown: kvt_prompt_cache_destroy() hands every entry to the cold tier
 * and flushes it first (kvt_prompt_cache_close()).
 *
 * Budget: bytes, never a count of entries: the unique bytes of every refcounted
 * buffer (kv block) held by resident entries, each counted once however many
 * entries share it, plus each entry's private bytes (mutable tails, ring and
 * recurrent state outside shared buffers, attachments). Views lent by lend
 * are not counted: they belong to the caller.
 *
 * Thread-safety: every function may be called from any thread at any time;
 * one mutex guards the cache state. The cold tier is never called with that
 * lock held: its lookups (find, find_exact, pending) may block on I/O (a
 * remote tier, a chain waiting a lookup budget), so lend, prefetch, object
 * lend, eviction, relieve, demote_idle and close drop the lock around each
 * question and check what they found in RAM again afterwards (an entry that
 * left or was cut meanwhile is looked up again, never used); restores,
 * spills and stores run outside it too. Other threads use the cache while a
 * lookup waits. Release hooks and cache destruction run outside the lock,
 * except in relieve and reclaim, which free each released entry at once so
 * that the caller's pressure check sees the memory gone. Callbacks the cache
 * runs under its lock (over_budget, pressure) must not call into the cache.
 *
 * Write-behind (the default with a cold tier that has `spill`): every entry
 * put is handed to the tier's spill at once (zero-copy views, after the lock
 * is dropped; the caller never waits on I/O), so a process killed at any
 * moment loses at most what is still in the tier's queue. An entry the tier
 * already holds or has queued (find_exact / pending) is not queued again. A
 * refused write-behind (the tier's queue is full, bounded in bytes) is a
 * counted drop, and that entry is spilled when it leaves RAM, as every entry
 * was before write-behind. Leaving RAM (eviction, close) writes nothing for
 * an entry the tier holds or has queued: counted in durable_evictions. When
 * a trimmable put supersedes shorter entries whose writes are still queued,
 * those writes are withdrawn (tier->withdraw) once the new one is queued.
 * Entries restored from the tier (promotions, prefetch) are not written
 * back. KVT_PC_NO_WRITE_BEHIND keeps the older rule: spill only on eviction.
 *
 * Namespaces: every `ns` argument (and kvt_entry.ns in put) is borrowed;
 * "" is the base model and NULL means "", as in the service.
 *
 * Block-granular eviction (a kvt_block_policy in the config) cuts resident
 * entries back in place; kvt_prompt_cache_trim() is that primitive.
 */
#ifndef KVTIER_PROMPT_CACHE_H
#define KVTIER_PROMPT_CACHE_H

#include "kvtier/cache.h"
#include "kvtier/common.h"
#include "kvtier/retention.h"
#include "kvtier/tier.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A block-granular retention policy (experimental API:
 * kvtier/experimental/retention_block.h); only pointers to it are used here. */
typedef struct kvt_block_policy kvt_block_policy;

typedef struct kvt_prompt_cache kvt_prompt_cache;
typedef struct kvt_lease kvt_lease;

/* ---- configuration ------------------------------------------------------- */

/** Promote a prefix restored from the cold tier into RAM at once (a zero-copy
 * clone is put as an entry), so a second request reuses it before the first
 * finishes. */
#define KVT_PC_PROMOTE_RESTORES 0x1u
/** Tier policy: never evict (nor demote, nor reclaim) an
 * entry whose lower-tier write is still pending (tier->pending says 1): a
 * pending write is not a copy, even when the tier serves lookups from its
 * queue meanwhile. Eviction stops at such a victim (the cache may stay over
 * budget until the write lands). Eviction then spills only entries the tier
 * does not already hold (tier->find_exact). With write-behind most victims
 * were written long before they are evicted, so eviction rarely stops. */
#define KVT_PC_EVICT_ONLY_DURABLE 0x2u
/** Turns write-behind off: entries reach the cold tier only when they leave
 * RAM (eviction, oversize puts), and eviction spills an entry the tier holds
 * again unless KVT_PC_EVICT_ONLY_DURABLE is set. For tiers whose writes are
 * costly enough that only evicted state should be written. */
#define KVT_PC_NO_WRITE_BEHIND 0x4u

typedef struct kvt_prompt_cache_config {
    size_t max_bytes;                   /* RAM budget in bytes; 0 keeps nothing */
    int32_t block_tokens;               /* block size hint B in tokens (0 = 256);
                                           reported, not enforced */
    const kvt_retention_ops *retention; /* NULL = kvt_retention_lru; borrowed
                                           for the life of the cache */
    const kvt_cold_tier *cold;          /* NULL = RAM only; the struct is copied,
                                           cold->self is borrowed and must
                                           outlive the cache */
    uint32_t flags;                     /* KVT_PC_* */
    /* Block-granular eviction: NULL = entry-level only. When set,
     * eviction cuts trimmable entries back block by block (blocks of
     * block_tokens tokens, the lowest-priority block first, leaf first along
     * the radix tree) and drops an entry whole only when its first block
     * goes; untrimmable entries (and entries whose cut block is pinned)
     * still leave whole by `retention`. Borrowed: must outlive the cache and
     * be used by no one else meanwhile (the cache calls it under its lock).
     * Create it with kvt_block_policy_create
     * (kvtier/experimental/retention_block.h, KVT_EXPERIMENTAL). */
    kvt_block_policy *block_policy;
    /* Fresh caches on a miss: NULL = a miss lends nothing. When set, a lend
     * that finds no prefix lends n_layers fresh caches made by
     * new_caches(new_caches_ctx, ...) instead, so one code path serves hit
     * and miss: prefill prompt[hit.prefix_len..n) into hit.entry.caches,
     * then kvt_prompt_cache_put_hit(). new_caches_ctx is borrowed for the
     * life of the cache. */
    kvt_new_caches_fn new_caches;
    void *new_caches_ctx;
    int32_t n_layers;                   /* 1..256 with new_caches, else 0 */
} kvt_prompt_cache_config;

/** Creates a prompt cache.
 * @param cfg borrowed for the call.
 * @param out receives the cache; caller frees with kvt_prompt_cache_destroy().
 * @return 0; KVT_EINVAL (cfg/out NULL, block_tokens < 0, a cold tier missing
 * find/restore/store, new_caches set with n_layers outside 1..256);
 * KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_prompt_cache_create(const kvt_prompt_cache_config *cfg, kvt_prompt_cache **out);

/** Graceful shutdown, as kvt_service_close() does for the service: waits
 * for in-flight prefetch reads, then every resident entry (pinned ones too)
 * leaves RAM: one the cold tier neither holds nor has a write pending for
 * is handed to it (write-behind spill; when the tier refuses the spill, a
 * synchronous store), then the tier is flushed (its flush op), so a
 * restarted process finds every prefix on disk. Sessions are dropped and
 * reads still in flight are discarded, as by kvt_prompt_cache_clear().
 * Without a cold tier it is kvt_prompt_cache_clear(). The cache stays
 * usable (a second close hands over only what was put since); every step
 * runs whatever an earlier one said.
 * @return 0 (everything handed over and durable, or no cold tier); the
 *   first failure otherwise: a hand-over refused (KVT_EIO, -ENOSPC, ...;
 *   that entry is lost, counted in spill_failures) or the tier's flush
 *   error; kvt_last_error names the step. NULL is a no-op (returns 0).
 * Thread-safe, but no other thread should use the cache meanwhile: an entry
 * put during the call may or may not be handed over. */
KVT_API int kvt_prompt_cache_close(kvt_prompt_cache *pc);

/** Closes the cache (kvt_prompt_cache_close(): every entry is handed to the
 * cold tier and the tier flushed, so destroying loses nothing (what
 * write-behind already queued is not written twice); call close
 * yourself to see its status), then frees every entry (release hooks run
 * once their views are gone) and the cache. To drop the entries instead,
 * call kvt_prompt_cache_clear() first. The cold tier must still be open.
 * Every lease must have been released and no other thread may use the cache
 * during or after the call. NULL is a no-op. */
KVT_API void kvt_prompt_cache_destroy(kvt_prompt_cache *pc);

/* ---- lend / put ------------------------------------------------------------ */

/** Where a hit came from. */
typedef enum kvt_hit_source {
    KVT_HIT_NONE = 0,   /* miss: prefix_len 0; no caches, or fresh ones when
                           the config has new_caches */
    KVT_HIT_RAM,        /* longest RAM candidate, found by the tree walk */
    KVT_HIT_SESSION,    /* the session's latest entry, without a walk */
    KVT_HIT_COLD        /* restored from the cold tier */
} kvt_hit_source;

/** What kvt_prompt_cache_lend lends. entry is a kvtier-allocated entry (see
 * tier.h): tokens = prompt[0..prefix_len), caches = zero-copy views trimmed
 * to prefix_len (one per layer of the donor), attachments = clones, hook = one share of the
 * donor's release hook. Release it with kvt_hit_clear(), or move parts out
 * first: set the slots you keep to NULL and empty the hook you keep
 * (kvt_prompt_cache_put NULLs the slots of the arrays it adopts from, so
 * passing hit.entry.caches as the new entry's caches array does that; the
 * hook is a value: move it as the example at the top of this file does). */
typedef struct kvt_hit {
    kvt_entry entry;
    int64_t prefix_len;     /* tokens reused; 0 on a miss */
    kvt_hit_source source;
    uint64_t entry_id;      /* id of the RAM entry that served (0 if none);
                               ids are unique for the life of the cache */
} kvt_hit;

/** Releases what a hit still owns (kvt_entry_clear on hit->entry) and zeroes
 * it. NULL and a zeroed hit are no-ops. Thread-safe for distinct hits. */
KVT_API void kvt_hit_clear(kvt_hit *hit);

/** Lends the longest usable prefix of `prompt` held in RAM or the cold tier.
 *
 * Usable prefix of an entry: its common prefix with the prompt, capped at
 * n - 1; the entry is a candidate at p >= 1 only if every layer can be cut
 * to p (kvt_cache_can_trim: inside its reachable range, or for a qkvc layer
 * a block boundary below it, so an f16/bf16/q8 entry serves the largest block
 * boundary of the common prefix below its sealed tokens; an untrimmable
 * entry: only when all its tokens are a prefix of the prompt). If `session` names an entry of this ns that is a
 * strict prefix of the prompt and resident, it serves without a tree walk
 * (session hit). Otherwise the radix tree is walked along the prompt
 * (O(n), never a scan of entries); ties prefer an entry of exactly p tokens.
 * If a cold tier is attached and RAM's prefix is shorter than n - 1, its
 * find is asked (without the lock, on a session hit too; when an entry left
 * or was cut meanwhile the RAM candidate is found again, counted in
 * relookups); it is restored (outside the lock) only when its prefix is
 * STRICTLY longer than RAM's (the session's entry on a session hit); a
 * restored entry whose divergent tail cannot be trimmed is dropped and the
 * RAM candidate serves; a restored prefix is promoted into RAM when
 * KVT_PC_PROMOTE_RESTORES is set. The donor stays resident (non-consuming).
 * A served RAM entry becomes the session's entry for ns.
 * Counters: hits/misses count RAM candidacy only; session_hits/misses when
 * `session` is set; prefix_walks per walk; cold_restores per restore used.
 *
 * @param prompt (n) tokens, borrowed; n >= 0 (n <= 1 is always a miss).
 * @param ns     namespace (borrowed; "" = base model); NULL means "".
 * @param session session id (borrowed) or NULL.
 * @param out    receives the hit (zeroed first); a miss is a success with
 *               prefix_len 0 and source KVT_HIT_NONE, lending n_layers
 *               fresh caches (ns set, no tokens) when the config has
 *               new_caches, nothing otherwise. Caller frees with
 *               kvt_hit_clear(), or hands it to kvt_prompt_cache_put_hit().
 * @return 0; KVT_EINVAL (NULL pc/out, prompt NULL with n > 0, n < 0);
 * KVT_ENOMEM (a copy or clone failed: nothing is lent; the lookup was
 * already counted); on a miss, the error of new_caches (nothing is lent).
 * A failing cold restore is not an error: the RAM candidate serves. */
KVT_API int kvt_prompt_cache_lend(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n,
                                  const char *ns, const char *session, kvt_hit *out);

/** Inserts an entry.
 *
 * e->ns and e->tokens are borrowed (copied); a NULL e->ns means "". The caches, the attachments and
 * the hook are adopted: ownership passes to the cache on success, and the
 * cache then sets every e->caches[i] and e->attachments[i] to NULL and
 * empties e->hook (the arrays themselves stay the caller's). On error
 * nothing is adopted and *e is untouched.
 * Every cache must hold exactly e->n_tokens tokens.
 *
 * An entry of equal tokens in the same ns is replaced (sessions pointing at
 * it follow the new one). If the new entry is trimmable, same-ns entries
 * whose tokens are a strict prefix of it and that it serves at every length
 * they serve are superseded: dropped without spill. Those are the ones it
 * can be trimmed back to (at least its reach long) and, for a new entry
 * with a block granule (f16/bf16/q8), one cut back to a block boundary of
 * it with nothing open (it reaches only its own end). One with rows in its
 * open block below the new entry's reach stays: it serves lengths inside
 * that block the new one cannot be cut to. An untrimmable entry supersedes
 * nothing. Then entries are evicted to the budget (spilling each to the cold
 * tier that does not hold it yet: write-behind, a refused spill is no
 * spill). An entry whose own bytes exceed max_bytes is spilled to the cold
 * tier and dropped (success; counted in oversize_drops). `session`
 * (borrowed, may be NULL) then points at the new entry for ns.
 *
 * Write-behind (a cold tier with spill, KVT_PC_NO_WRITE_BEHIND not set):
 * after the lock is dropped, zero-copy views of the kept entry are handed to
 * the tier's spill before put returns (never waiting on I/O): counted in
 * write_behind_queued; refused (queue full): write_behind_dropped, and the
 * entry is spilled when it leaves RAM instead; an entry the tier already
 * holds or has pending (an equal-token replacement, a prefix re-published
 * after a restart) is not queued again: write_behind_skipped. Then queued
 * writes of the entries it superseded are withdrawn (tier->withdraw):
 * write_behind_withdrawn.
 *
 * @return 0; KVT_EINVAL (NULL pc/e, n_tokens < 0, tokens NULL with
 * n_tokens > 0, a NULL cache or attachment slot, a cache whose offset is not
 * n_tokens); KVT_ENOMEM. */
KVT_API int kvt_prompt_cache_put(kvt_prompt_cache *pc, kvt_entry *e, const char *session);

/** Puts back what lend lent, extended: the entry (hit->entry.ns,
 * tokens[0..n_tokens)) made of the hit's caches, attachments and hook share,
 * as kvt_prompt_cache_put() does. The engine has appended tokens
 * [hit->prefix_len, n_tokens) to every cache; tokens must begin with the
 * prefix the hit lent (checked). On success the hit's parts are adopted and
 * the hit is released and zeroed; on error nothing is adopted and the hit is
 * unchanged. Either way end with kvt_hit_clear(hit) (a no-op after a
 * success), so one code path serves every outcome.
 * @param tokens (n_tokens) borrowed; @param session as for put.
 * @return 0; KVT_EINVAL (NULL pc/hit/tokens, a hit that lends no caches,
 *   tokens that do not begin with the lent prefix, a cache that does not
 *   hold n_tokens tokens); KVT_ENOMEM. Thread-safe for distinct hits. */
KVT_API int kvt_prompt_cache_put_hit(kvt_prompt_cache *pc, kvt_hit *hit, const int32_t *tokens,
                                     int64_t n_tokens, const char *session);

/** Longest usable RAM prefix of `prompt` (n tokens) in `ns`, as lend would
 * find it by the tree walk, without lending anything, touching recency,
 * counters or the cold tier.
 * @param out_id optional: receives the id of the entry that would serve.
 * @return the prefix length (0 = none, also on bad arguments). */
KVT_API int64_t kvt_prompt_cache_peek(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n,
                                      const char *ns, uint64_t *out_id);

/** Whether RAM holds an entry of exactly `tokens` (n, may be 0) in `ns`.
 * @param out_id optional: receives its id.
 * @return 1 found, 0 not (also on bad arguments). Does not touch recency. */
KVT_API int kvt_prompt_cache_find_exact(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n,
                                        const char *ns, uint64_t *out_id);

/** Lends views of the entry of exactly `tokens` in `ns` (RAM only; a use:
 * touches recency, no counters). @param out as for lend (prefix_len = n).
 * @return 0; KVT_ENOTFOUND; KVT_EINVAL; KVT_ENOMEM. */
KVT_API int kvt_prompt_cache_lend_exact(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n,
                                       const char *ns, kvt_hit *out);

/** Cuts the resident entry of exactly `tokens` (n) in `ns` back to `new_len`
 * tokens in place (every layer trimmed; blocks nobody else holds are freed)
 * and re-indexes it. If an entry of the shorter tokens already exists, the
 * trimmed one replaces it (sessions follow). Pins and session affinity stay.
 * new_len == n is a no-op.
 * @return 0; KVT_ENOTFOUND; KVT_ERANGE (new_len outside [1, n] or outside a
 * layer's reachable range, or the entry has attachments: unchanged);
 * KVT_EINVAL; KVT_ENOMEM (a layer or the index could not follow: the entry
 * is dropped, without a spill, rather than kept half-trimmed). */
KVT_API int kvt_prompt_cache_trim(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n,
                                  const char *ns, int64_t new_len);

/* ---- budget, eviction, pressure ------------------------------------------- */

/** Changes the budget (bytes) and evicts to it (spilling, as put; with a
 * block policy blocks are cut first, as put's eviction does).
 * @return 0 or KVT_EINVAL (pc NULL). */
KVT_API int kvt_prompt_cache_set_max_bytes(kvt_prompt_cache *pc, size_t max_bytes);

/** Evicts up to `count` entries chosen by the retention policy among
 * unpinned entries, preferring entries no session points at, spilling each
 * (write-behind). @param n_out optional: entries evicted.
 * @return 0 or KVT_EINVAL (pc NULL or count < 0). */
KVT_API int kvt_prompt_cache_evict(kvt_prompt_cache *pc, int64_t count, int64_t *n_out);

/** Live-memory check the caller supplies: nonzero while over its budget. */
typedef int (*kvt_over_budget_fn)(void *ctx);

/** Pressure relief: while over_budget(ctx) says so, releases
 * the retention victim: its write to the cold tier (tier->store, from
 * zero-copy views, outside the cache lock) finishes NOW, then the entry is
 * released under the lock and its buffers freed at once (an entry that
 * changed or was pinned meanwhile stays; its write is durable). If a write
 * fails, stops and keeps that entry (a failed write is never a demotion).
 * An entry the tier already holds durably (with write-behind the usual
 * case: found, no write pending) is released without writing it again
 * (durable_evictions); one whose write is still pending is written now.
 * Without a cold tier entries are released without a write. Call under the
 * engine lock, after taking the request's prefix. over_budget runs under the
 * cache lock and must not call into the cache.
 * @param n_out optional: entries released (each counts as a demotion).
 * @return 0; KVT_EIO or the tier's error (the first failed write; entries
 * released before it stay released); KVT_EINVAL. */
KVT_API int kvt_prompt_cache_relieve(kvt_prompt_cache *pc, kvt_over_budget_fn over_budget,
                                     void *ctx, int64_t *n_out);

/** Reclaim at an execution boundary: while pressure(ctx)
 * says the backend is over its budget, drops retention victims WITHOUT any
 * storage I/O (no spill, no store). @param n_out optional: entries dropped.
 * @return 0 or KVT_EINVAL. */
KVT_API int kvt_prompt_cache_reclaim(kvt_prompt_cache *pc, kvt_over_budget_fn pressure, void *ctx,
                                     int64_t *n_out);

/** Demotes idle entries: every unpinned entry not used for
 * at least idle_ms milliseconds leaves RAM once the cold tier holds it. An
 * entry the tier already holds (tier->find_exact finds it, no write pending)
 * is dropped at once; an entry whose write is pending is kept for a later
 * call; any other is written with tier->store OUTSIDE the cache lock (a
 * zero-copy clone is written) and dropped once that write succeeds (still
 * resident and unpinned by then); a failed write keeps it (never counted as
 * a demotion). With write-behind, an idle entry's write was queued when it
 * was put, so it usually leaves at once, unwritten (durable_evictions).
 * No-op without a cold tier.
 * @param n_out optional: entries that left RAM (counted as demotions).
 * @return 0 or KVT_EINVAL. */
KVT_API int kvt_prompt_cache_demote_idle(kvt_prompt_cache *pc, uint64_t idle_ms, int64_t *n_out);

/* ---- sessions, pins, prefetch ---------------------------------------------- */

/** Drops the session's affinity (every ns), never the data.
 * Unknown sessions, and a NULL pc or session, are a no-op. */
KVT_API void kvt_prompt_cache_close_session(kvt_prompt_cache *pc, const char *session);

/** Pins the resident entry of exactly `tokens` in `ns`: it is never evicted,
 * demoted or reclaimed while the lease lives.
 * @param out receives a lease; released by kvt_lease_release().
 * @return 0; KVT_ENOTFOUND; KVT_EINVAL; KVT_ENOMEM. */
KVT_API int kvt_prompt_cache_pin(kvt_prompt_cache *pc, const int32_t *tokens, int64_t n,
                                 const char *ns, kvt_lease **out);

/** Starts the cold read for `prompt` while the request is being prepared.
 * If the session's entry already serves the prompt from
 * RAM and the cold tier holds no strictly longer prefix, pins it. Else, if
 * the cold tier holds a prefix strictly longer than
 * RAM's, reads it (tier->restore_async, or a synchronous restore in this
 * call when the tier has none); identical reads (same handle) coalesce into
 * one; the loaded entry is published to RAM (as put, with the session) and
 * pinned until the lease is released. A clear() during the read discards
 * the result (KVT_ESTALE from kvt_lease_wait).
 * @param out receives a lease (never NULL on success, even when there was
 * nothing to read); released by kvt_lease_release().
 * @return 0; KVT_EINVAL; KVT_ENOMEM; the tier's error if restore_async
 * refused the read. */
KVT_API int kvt_prompt_cache_prefetch(kvt_prompt_cache *pc, const int32_t *prompt, int64_t n,
                                      const char *ns, const char *session, kvt_lease **out);

/** Waits up to timeout_ms milliseconds (0 = do not wait, UINT64_MAX =
 * forever) for a lease's read to end.
 * @return 0 (published and pinned, or nothing to read); KVT_EINVAL (lease
 * NULL); KVT_EAGAIN (still running); KVT_ESTALE (discarded by a clear); the
 * restore's error. */
KVT_API int kvt_lease_wait(kvt_lease *lease, uint64_t timeout_ms);

/** Releases the caller's interest: unpins the entry (then evicts to budget);
 * a read still running is no longer waited for (its result is still
 * published). NULL is a no-op. Call exactly once per lease. */
KVT_API void kvt_lease_release(kvt_lease *lease);

/* ---- objects: exact-key blobs ------------------------------------------------ */

/** Stores an exact-key blob (e.g. a media encoder output) under ns
 * "object:<key>" with no tokens and no caches: its attachments and hook are
 * adopted as in put (on success the slots are NULLed and the hook emptied).
 * Shares the budget, eviction and spill path of entries.
 * @param key NUL-terminated, non-empty, borrowed.
 * @return 0; KVT_EINVAL; KVT_ENOMEM. */
KVT_API int kvt_prompt_cache_object_put(kvt_prompt_cache *pc, const char *key,
                                        kvt_attachment **attachments, int32_t n_attachments,
                                        kvt_hook *hook);

/** Lends the object `key`: clones of its attachments and a hook share in
 * out->entry (no caches, no tokens). On a RAM miss asks the cold tier
 * (find_exact, then a restore outside the lock) and publishes what it reads
 * (discarded if a clear ran meanwhile). Counters: object_hits,
 * object_misses (RAM), object_restores.
 * @return 0; KVT_ENOTFOUND (in no tier); KVT_EINVAL; KVT_ENOMEM; KVT_ESTALE. */
KVT_API int kvt_prompt_cache_object_lend(kvt_prompt_cache *pc, const char *key, kvt_hit *out);

/* ---- clear, stats ------------------------------------------------------------ */

/** Drops every entry and session (no spill), advances the epoch so reads in
 * flight are discarded, keeps counters. Pinned entries are dropped too (their
 * leases then pin nothing). Writes write-behind already queued are not
 * withdrawn: they complete in the tier. */
KVT_API void kvt_prompt_cache_clear(kvt_prompt_cache *pc);

/** The prompt cache's counters, one list: X(type, name, kind, help) with
 * kind counter (only grows) or gauge (a current value) and help a one-line
 * sentence. It generates kvt_prompt_cache_stats, and the service uses it
 * for its report (kvt_service_stats, the "prefixes" object of
 * kvt_service_stats_json) and the server for Prometheus lines. */
#define KVT_PROMPT_CACHE_COUNTERS(X)                                                                      \
    X(uint64_t, hits, counter, "Lends whose RAM candidate served a prefix (RAM candidacy only)")          \
    X(uint64_t, misses, counter, "Lends with no RAM candidate")                                           \
    X(uint64_t, session_hits, counter, "Lends the session's entry served without a tree walk")           \
    X(uint64_t, session_misses, counter, "Lends with a session whose entry did not serve")                \
    X(uint64_t, prefix_walks, counter, "Radix tree walks made by lend")                                   \
    X(uint64_t, relookups, counter,                                                                       \
      "Lends that found their RAM candidate again because an entry left while the cold tier answered")    \
    X(uint64_t, object_hits, counter, "Object lends served from RAM")                                     \
    X(uint64_t, object_misses, counter, "Object lends not in RAM")                                        \
    X(uint64_t, object_restores, counter, "Objects restored from the cold tier")                          \
    X(uint64_t, cold_restores, counter, "Restores from the cold tier that served a lend")                 \
    X(uint64_t, cold_unusable, counter, "Restored entries dropped: their divergent tail cannot be cut")   \
    X(uint64_t, cold_failures, counter, "Cold-tier restores that failed")                                 \
    X(uint64_t, promotions, counter, "Restored prefixes put into RAM")                                    \
    X(uint64_t, prefetch_reads, counter, "Cold reads started by prefetch")                                \
    X(uint64_t, prefetch_coalesced, counter, "Prefetches joined to a read already running")               \
    X(uint64_t, prefetch_discarded, counter, "Prefetch reads discarded because a clear ran meanwhile")    \
    X(uint64_t, evictions, counter, "Entries evicted for the RAM budget")                                 \
    X(uint64_t, spills, counter, "Spills the cold tier accepted for entries leaving RAM")                 \
    X(uint64_t, spill_failures, counter, "Spills the cold tier refused for entries leaving RAM")          \
    X(uint64_t, write_behind_queued, counter, "Puts handed to the cold tier at once (write-behind)")       \
    X(uint64_t, write_behind_dropped, counter,                                                            \
      "Write-behinds the cold tier refused (queue full or error): spilled on leaving RAM")                \
    X(uint64_t, write_behind_skipped, counter, "Puts the cold tier already held or had pending")          \
    X(uint64_t, write_behind_withdrawn, counter, "Queued writes of superseded entries withdrawn")         \
    X(uint64_t, durable_evictions, counter,                                                               \
      "Entries that left RAM with nothing written: the cold tier held them or had them pending")          \
    X(uint64_t, demotions, counter, "Entries released by relieve, demote_idle and reclaim")               \
    X(uint64_t, replacements, counter, "Entries replaced by a put of equal tokens")                       \
    X(uint64_t, supersedes, counter, "Shorter entries dropped because a longer put serves them")         \
    X(uint64_t, oversize_drops, counter, "Puts larger than the whole budget: spilled and dropped")        \
    X(uint64_t, block_cuts, counter, "Entries cut back by block-granular eviction (one per cut)")         \
    X(uint64_t, blocks_cut, counter, "Blocks those cuts removed")                                         \
    X(int64_t, entries, gauge, "Resident entries (objects too)")                                          \
    X(int64_t, pinned, gauge, "Entries with at least one pin")                                            \
    X(size_t, bytes, gauge, "Bytes held (unique buffer bytes plus private bytes)")                        \
    X(size_t, max_bytes, gauge, "The RAM byte budget")                                                    \
    X(uint64_t, epoch, counter, "Clears so far (the epoch a clear advances)")

/** Residency by layer: bytes[i] receives the bytes layer i's state holds
 * in RAM over every resident entry (each buffer counted once, as the budget
 * counts it, plus the layer's private bytes), shared[i] how many of those
 * buffers more than one resident entry holds (blocks shared between
 * entries). Layers past an entry's own count add nothing; an entry's layers
 * past n_layers are not counted. A walk of every resident entry under the
 * cache's lock: for reports, not for a hot path.
 * @param bytes, shared (n_layers) each, written whole.
 * @return 0; KVT_EINVAL (NULL argument, n_layers < 0); KVT_ENOMEM (the
 *   arrays are then partial). Thread-safe. */
KVT_API int kvt_prompt_cache_layer_usage(kvt_prompt_cache *pc, int32_t n_layers, uint64_t *bytes,
                                         uint64_t *shared);

/** Counters and occupancy (see KVT_PROMPT_CACHE_COUNTERS). A consistent
 * snapshot. */
typedef struct kvt_prompt_cache_stats {
#define KVT__PC_FIELD(type, name, kind, help) type name;
    KVT_PROMPT_CACHE_COUNTERS(KVT__PC_FIELD)
#undef KVT__PC_FIELD
} kvt_prompt_cache_stats;

/** Fills *out with a snapshot taken under the cache's lock (spills,
 * spill_failures and the write_behind_* counters, counted off-lock, are read
 * just after it). NULL arguments
 * are a no-op. */
KVT_API void kvt_prompt_cache_get_stats(kvt_prompt_cache *pc, kvt_prompt_cache_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_PROMPT_CACHE_H */
