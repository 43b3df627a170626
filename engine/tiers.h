/*
 * tiers.h: the tier stack under the RAM prompt cache that `kvtier chat`,
 * `kvtier serve` (and any command with a cache) open: the levels the user
 * asked for (SSD, then a remote Redis tier, then published prompt caches),
 * composed by a kvt_tier_chain (kvtier/tier_chain.h) into one kvt_cold_tier
 * for the cache service, with the health of every level for the command's
 * messages.
 *
 * A level a user expects to work never ends the command: a level that cannot
 * be opened for writing starts read-only, or off, with the cause; a write
 * that fails later turns it read-only. Each degradation is warned about once
 * (kvt_tiers_warn) and counted (kvt_tiers_poll). Replies never depend on it:
 * what is read back is checked by the level.
 *
 * Life: kvt_tiers_open, kvt_tiers_cold_tier (give the table to the service),
 * kvt_tiers_poll / kvt_tiers_warn between requests, then, after the service
 * is closed (it hands its RAM entries to the tier and flushes), kvt_tiers_close
 * (flushes, stops the chain, closes the levels upper first).
 *
 * Also here: the SSD level itself (kvt_ssd_level_*), usable alone, and
 * kvt_chat_store_open, the plain store of a model.
 *
 * Thread-safety: the cold-tier table, poll, warn and the accessors may be
 * called from any thread; open and close by one thread, close once nothing
 * else uses the stack.
 */
#ifndef KVT_ENGINE_TIERS_H
#define KVT_ENGINE_TIERS_H

#include "chat.h"

#include "kvtier/publish.h"
#include "kvtier/remote.h"
#include "kvtier/store.h"
#include "kvtier/tier.h"
#include "kvtier/tier_chain.h"

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the health of one level ------------------------------------------------------ */

/** What a level is doing. */
typedef enum kvt_level_mode {
    KVT_LEVEL_MODE_READ_WRITE = 0, /* healthy */
    KVT_LEVEL_MODE_READ_ONLY,      /* found and restored from, never written again */
    KVT_LEVEL_MODE_OFF,            /* not used at all: every lookup misses */
} kvt_level_mode;

/** The name of a mode as commands print it: "read-write", "read-only",
 * "off". A static string. Thread-safe. */
KVT_API const char *kvt_level_mode_name(kvt_level_mode m);

/** A snapshot of one level's state. */
typedef struct kvt_level_status {
    char name[16];            /* the level's kind: "ssd", "redis", "published" */
    char label[32];           /* in messages: "SSD cache", ... */
    char where[512];          /* the directory or address it uses (never a
                                 credential) */
    kvt_level_mode mode;
    char cause[600];          /* why it degraded ("" while read-write): names the
                                 directory or address and the system's reason */
    int warn;                 /* 1 exactly once: the first poll after it degraded */
    uint64_t open_failures;   /* 1 when it could not be opened for writing */
    uint64_t write_failures;  /* writes that failed */
    uint64_t writes_skipped;  /* writes not attempted once degraded */
    uint64_t entries;         /* entries it holds */
    uint64_t restores;        /* entries restored from it */
    char generation[KVT_PUBLISH_ID_LEN]; /* published level: the generation it
                                 mounted ("" when none, and for other levels) */
} kvt_level_status;

/* ---- the SSD level ------------------------------------------------------------------ */

/** Opens the SSD store (a cold tier) for a model under `root`, with the
 * store identity: model id and tokenizer hash from `id`
 * (kvt_chat_identity_compute), and the config fingerprint of the model's
 * fresh caches (kvt_store_config_fingerprint: layer count, kinds, shapes).
 * A disk that fails is an error here; kvt_ssd_level_open degrades instead.
 * @param max_bytes budget over the root (0 = unlimited); @param verify check
 *   SHA-256 on every load.
 * @param out caller closes with kvt_store_close() after the service is closed.
 * @return 0; KVT_EINVAL (NULL model, identity, root or out); kvt_store_open's
 *   errors (-errno naming the directory). */
KVT_API int kvt_chat_store_open(const kvt_model *m, const kvt_chat_identity *id, const char *root, uint64_t max_bytes,
                        int verify, kvt_store **out);

/** How kvt_ssd_level_open attaches the SSD tier. Zero-initialise, then set. */
typedef struct kvt_ssd_level_opts {
    uint64_t max_bytes;      /* budget over the root (0 = unlimited) */
    int verify;              /* strict restores (SHA-256 too) */
    uint64_t lock_wait_ms;   /* how long open may wait for a lock another
                                process holds on the directory; 0 = 1000 ms
                                (the store's kvt_store_options.lock_wait_ms: on
                                the caller's thread, never blocking in flock) */
    const kvt_store_io *io;  /* write layer (tests inject ENOSPC); NULL = real */
    struct kvt_pool *pool;   /* the process-wide pool the root joins (its budget
                                charged on the disk axis: kvt_store_options.pool);
                                NULL = none. A refusal fails the open, as a bad flag does */
} kvt_ssd_level_opts;

typedef struct kvt_ssd_level kvt_ssd_level;

/** Opens the SSD tier under `root` (kvt_chat_store_open's identity) so that
 * a disk the user expects to work never ends the command: when the
 * directory cannot be created, opened or locked for writing (another user's
 * files, a read-only mount, a lock another process holds for longer than
 * lock_wait_ms) it is opened read-only (the store's read_only option: what
 * it holds is found and restored, nothing is written; its table says
 * KVT_TIER_READ_ONLY, so a chain writes to the next level) and the level
 * starts READ_ONLY, or OFF when even that fails, with the cause. Open returns
 * within about lock_wait_ms (the read-only open does not wait) and leaves
 * no thread behind. When a write fails
 * later (a full disk, the directory deleted, a directory where a shard file
 * should be) it turns READ_ONLY: later writes are skipped (counted), lookups
 * and restores go on (a failing restore is a miss, the prefix is recomputed).
 * @param out receives the level; free it with kvt_ssd_level_close() after
 *   the service using it is closed.
 * @return 0 (also when the level starts OFF: see kvt_ssd_level_poll);
 *   KVT_EINVAL (NULL model, identity, root or out; an empty root);
 *   KVT_ENOMEM. */
KVT_API int kvt_ssd_level_open(const kvt_model *m, const kvt_chat_identity *id, const char *root,
                       const kvt_ssd_level_opts *o, kvt_ssd_level **out);

/** Fills *tier with the cold-tier table over `d` (borrowed, valid until
 * kvt_ssd_level_close): the store's own functions (stats and set_evict
 * included: a chain demotes the store's budget evictions), with writes
 * skipped once a write failed and every write failure recorded. flags is the
 * store's: KVT_TIER_READ_ONLY when it was opened read-only (its store and
 * spill refuse with KVT_EREADONLY), and KVT_TIER_READ_ONLY while the level is
 * OFF; a chain then writes to the next writable level. A level that turns
 * READ_ONLY after a write failure keeps flags 0 (it skips writes, counted in
 * writes_skipped). Thread-safe. */
KVT_API void kvt_ssd_level_tier(kvt_ssd_level *d, kvt_cold_tier *tier);

/** Checks for write-behind failures since the last call (when the store
 * counted one, waits for its queue to learn the cause and turns READ_ONLY),
 * then fills *st (name "ssd", label "SSD cache", where the root). Call it
 * between turns and before reporting. Thread-safe. */
KVT_API void kvt_ssd_level_poll(kvt_ssd_level *d, kvt_level_status *st);

/** The level's store (borrowed; NULL while OFF), for its own counters
 * (kvt_store_get_stats). Valid until kvt_ssd_level_close. Thread-safe. */
KVT_API kvt_store *kvt_ssd_level_store(kvt_ssd_level *d);

/** Closes the store (flushing what can still be written), then a last poll
 * into *st (may be NULL), then frees d. NULL is a no-op. @return 0, or
 * KVT_ETOOBIG when an entry was larger than the whole max_bytes budget (not
 * a degradation: that entry alone was not kept). Other write failures are a
 * degradation reported in *st, never an error. */
KVT_API int kvt_ssd_level_close(kvt_ssd_level *d, kvt_level_status *st);

/* ---- the stack ---------------------------------------------------------------------- */

/** What kvt_tiers_open attaches. Zero-initialise, then set; a level whose
 * field is unset is absent. Strings are borrowed for the call. */
typedef struct kvt_tiers_opts {
    /* SSD tier (the top level) */
    const char *ssd_dir;          /* --ssd-cache DIR; NULL = no SSD level */
    uint64_t ssd_max_bytes;       /* --ssd-cache-max; 0 = unlimited */
    int ssd_verify;               /* --ssd-cache-verify: SHA-256 on every restore */
    uint64_t ssd_lock_wait_ms;    /* as kvt_ssd_level_opts.lock_wait_ms */
    const kvt_store_io *ssd_io;   /* as kvt_ssd_level_opts.io (tests) */
    struct kvt_pool *ssd_pool;    /* as kvt_ssd_level_opts.pool */
    struct kvt_pool *redis_pool;  /* the pool the remote tier's writes in flight join
                                     (kvt_remote_options.pool), as redis_pool_name */
    const char *redis_pool_name;
    /* shared remote tier (below the SSD tier) */
    const char *redis_url;        /* --redis redis://[user:password@]host:port[/db]
                                     (kvtier/remote.h); NULL = none. Every kept
                                     prefix is written behind into it too, so other
                                     hosts serving the model reuse it; a Redis that
                                     does not answer makes the level OFF (misses,
                                     retried in the background), never an error.
                                     The password may come from KVTIER_REDIS_PASSWORD */
    int redis_cluster;            /* --redis-cluster: the URL names a cluster node */
    int32_t redis_timeout_ms;     /* --redis-timeout: bound on a lookup (0 = 50 ms) */
    int32_t redis_restore_timeout_ms; /* --redis-restore-timeout: bound on a whole restore (0 = 1000 ms) */
    int64_t redis_ttl_s;          /* --redis-ttl: seconds a written key lives (0 = none) */
    /* published read-only prompt caches (the bottom levels, in order): each
     * mounts the CURRENT generation of its directory (kvtier/publish.h:
     * validated whole, SHA-256 of every shard, before it serves), picks up a
     * new publication by itself (CURRENT is re-read every second; a request
     * reads an entry from the generation it found it in), and keeps serving
     * the mounted generation when a new one is refused. A directory with
     * nothing published is OFF until something is. Never written. */
    const char *const *prompt_cache_dirs; /* --prompt-cache-dir DIR, (n_prompt_cache_dirs) */
    int n_prompt_cache_dirs;      /* 0 = none */
    int32_t write_queue;          /* the chain's promotion/demotion queue, entries (0 = 64) */
} kvt_tiers_opts;

/** Every level's state, top first. */
typedef struct kvt_tiers_status {
    int32_t n_levels;
    kvt_level_status level[KVT_TIER_CHAIN_MAX];
} kvt_tiers_status;

typedef struct kvt_tiers kvt_tiers;

/** Opens the levels `o` names, top first (SSD, remote, published), each so
 * that a failing disk or host degrades it instead of failing (see the file
 * comment), and composes them with a kvt_tier_chain. With no level set the
 * stack is empty (kvt_tiers_cold_tier says so) and holds no thread.
 * @param m, id the model and its identity (kvt_chat_identity_compute);
 *   borrowed for the call; id may be NULL when no level is set.
 * @param out receives the stack; close it with kvt_tiers_close() after the
 *   service using it is closed.
 * @return 0; KVT_EINVAL (NULL m, o or out; id NULL with a level set; an
 *   empty ssd_dir or redis_url; a bad redis_url; negative redis_timeout_ms,
 *   redis_restore_timeout_ms or redis_ttl_s; n_prompt_cache_dirs < 0, or > 0 with a NULL array, or
 *   an empty one; more than KVT_TIER_CHAIN_MAX levels; write_queue < 0);
 *   KVT_ENOMEM; kvt_published_open's errors; kvt_tier_chain_create's
 *   errors. On error nothing is left open. */
KVT_API int kvt_tiers_open(const kvt_model *m, const kvt_chat_identity *id, const kvt_tiers_opts *o, kvt_tiers **out);

/** Fills *out with the stack's cold-tier table (borrowed until
 * kvt_tiers_close), for kvt_chat_service_opts.cold.
 * @return 0; KVT_ENOTFOUND (the stack has no level: give the service no
 *   cold tier; *out is zeroed); KVT_EINVAL (NULL). Thread-safe. */
KVT_API int kvt_tiers_cold_tier(kvt_tiers *t, kvt_cold_tier *out);

/** Levels in the stack (0 when empty or NULL). Thread-safe. */
KVT_API int32_t kvt_tiers_levels(const kvt_tiers *t);

/** The chain composing the levels (borrowed; NULL when empty), for its
 * per-level counters and names (kvt_tier_chain_level_stats,
 * kvt_tier_chain_level_name: "ssd", "redis", "published", or "published:N"
 * with several published directories, N counted from 1). The SSD level's
 * budget evictions are demoted into the next writable level (Redis), unless
 * that level holds them already. Thread-safe. */
KVT_API kvt_tier_chain *kvt_tiers_chain(kvt_tiers *t);

/** The SSD level's store (borrowed; NULL without an SSD level or while it
 * is OFF), for kvt_store_get_stats. Valid until kvt_tiers_close. */
KVT_API kvt_store *kvt_tiers_store(kvt_tiers *t);

/** The remote level's tier (borrowed; NULL without a --redis level), for
 * kvt_remote_stats_get. Valid until kvt_tiers_close. Thread-safe. */
KVT_API kvt_remote *kvt_tiers_remote(kvt_tiers *t);

/** Polls every level (each learns of write-behind failures since the last
 * call) and fills *st, top first. NULL t gives n_levels 0. Thread-safe. */
KVT_API void kvt_tiers_poll(kvt_tiers *t, kvt_tiers_status *st);

/** Prints the warning of every level in `st` whose warn is set, one line
 * each: "PROG: warning: LABEL CAUSE; continuing read-only: ... (replies are
 * unaffected; COUNTED)" or "...; continuing without it (...)".
 * @param prog e.g. "kvtier chat"; @param counted where the user finds the
 *   counts, e.g. "--stats counts it". @return the lines printed. */
KVT_API int kvt_tiers_say(const kvt_tiers_status *st, const char *prog, const char *counted, FILE *f);

/** kvt_tiers_poll, then kvt_tiers_say: says each degradation the first time
 * it is seen. @return the lines printed. Thread-safe. */
KVT_API int kvt_tiers_warn(kvt_tiers *t, const char *prog, const char *counted, FILE *f);

/** Flushes the chain (queued promotions and demotions, then every level),
 * stops it, closes the levels upper first, and fills *st (may be NULL) with
 * their last state; frees t. NULL is a no-op.
 * @return 0, or KVT_ETOOBIG when an entry was larger than a level's whole
 *   byte budget (that entry alone was not kept). Degradations are reported
 *   in *st, never as an error. */
KVT_API int kvt_tiers_close(kvt_tiers *t, kvt_tiers_status *st);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_TIERS_H */
