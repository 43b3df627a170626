/*
 * kvtier/publish.h: published prompt caches. A prompt cache computed once (a
 * long system prompt, few-shot examples, a document set) is written as an
 * immutable, verified, model-bound generation under a directory that any
 * number of hosts and processes mount read-only as a cold tier.
 *
 * Layout of a publication directory DIR (docs/publish.md has the format):
 *   CURRENT                   the id of the current generation, one line
 *   generations/<id>/         one immutable generation:
 *     MANIFEST.json           identity, and for every shard its relative
 *                             path, size, SHA-256, tokens covered, type, ns
 *     <identity dir>/         an SSD store root's identity directory
 *                             (kvtier/store.h): IDENTITY, b*.safetensors,
 *                             e*.safetensors
 *   .staging-<pid>-<n>/       a generation being written (never read)
 *   .removing-<id>/           a generation being removed (never read)
 *   .publish.lock             publishers take it exclusively (one at a time)
 *
 * Publication (kvt_publish_begin .. kvt_publish_commit): shards are written
 * into a staging directory under DIR by an SSD store (crash-safe writes),
 * the manifest is written and every file and directory fsync'd, the staging
 * directory is renamed to generations/<id>/, then CURRENT is switched
 * atomically (temp file, fsync, rename, fsync DIR). Generations beyond
 * `keep` are removed only when no reader holds them.
 *
 * Readers: a mounted generation is held by a shared flock(2) on its
 * directory (generations/<id>, opened O_DIRECTORY), for as long as it is
 * mounted. The publisher removes an old generation only after taking the
 * exclusive lock on it without waiting (LOCK_EX | LOCK_NB): a generation
 * some reader holds is kept (counted) and retried at the next publication.
 * It renames the directory to .removing-<id> under that lock before
 * deleting, and a reader checks after locking that generations/<id> is still
 * the directory it locked, so a reader never mounts half of a removed one.
 *
 * Validation (kvt_publish_validate): everything read from DIR is untrusted.
 * A generation is refused whole, with one reason (kvt_publish_refusal), and
 * a refused generation is never mounted: the tier keeps the previous one.
 *
 * Thread-safety: a kvt_publisher is used by one thread at a time; several
 * publishers (threads or processes) on one DIR serialise on .publish.lock.
 * Every function on a kvt_published may be called from any thread, except
 * kvt_published_close.
 */
#ifndef KVTIER_PUBLISH_H
#define KVTIER_PUBLISH_H

#include "kvtier/common.h"
#include "kvtier/store.h"
#include "kvtier/tier.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Longest generation id plus its NUL. Ids are 1..32 characters of
 * [0-9A-Za-z_-]; kvtier writes 8 decimal digits, one more than the largest
 * id under generations/. */
#define KVT_PUBLISH_ID_LEN 33

/** Fixed bound on MANIFEST.json, in bytes (64 MiB). Shard headers have
 * their own bound, KVT_STORE_MAX_HEADER. */
#define KVT_PUBLISH_MAX_MANIFEST (64u << 20)

/** Why a generation was refused (the first failing check names it). */
typedef enum kvt_publish_refusal {
    KVT_PUBLISH_OK = 0,
    KVT_PUBLISH_REFUSED_ABSOLUTE_PATH,   /* a shard path that starts with '/' */
    KVT_PUBLISH_REFUSED_DOTDOT,          /* a shard path with a ".." component */
    KVT_PUBLISH_REFUSED_SYMLINK,         /* a shard path (or the generation
                                            directory) resolving through a
                                            symbolic link: outside the
                                            generation, or inside it (never
                                            followed by the store) */
    KVT_PUBLISH_REFUSED_HEADER_BOUND,    /* a shard header over
                                            KVT_STORE_MAX_HEADER, or the manifest
                                            over KVT_PUBLISH_MAX_MANIFEST */
    KVT_PUBLISH_REFUSED_IDENTITY,        /* a shard (or the manifest) of
                                            another identity */
    KVT_PUBLISH_REFUSED_HASH,            /* a shard's SHA-256 differs from the manifest */
    KVT_PUBLISH_REFUSED_SIZE,            /* a shard's size differs from the manifest */
    KVT_PUBLISH_REFUSED_TOKENS,          /* a shard's token count (or ns)
                                            differs from the manifest */
    KVT_PUBLISH_REFUSED_MISSING,         /* CURRENT names a generation that
                                            does not exist, or holds no valid id */
    KVT_PUBLISH_REFUSED_PARTIAL,         /* the generation lacks its manifest,
                                            or a listed shard or a block an
                                            entry needs */
    KVT_PUBLISH_REFUSED_JSON,            /* the manifest is not valid JSON */
    KVT_PUBLISH_REFUSED_UNKNOWN_REQUIRED,/* the manifest requires a field this
                                            reader does not know */
    KVT_PUBLISH_REFUSED_MALFORMED,       /* a field missing, ill-typed or out
                                            of range; another format or version */
    KVT_PUBLISH_REFUSED_SHARD,           /* a shard whose header fails the
                                            store's other checks */
    KVT_PUBLISH_REFUSED_UNLISTED,        /* a shard file the manifest does not list */
    KVT_PUBLISH_REFUSED_IO,              /* a read failed */
    KVT_PUBLISH_REFUSED_COUNT
} kvt_publish_refusal;

/** Short name of a refusal reason ("ok", "absolute-path", "dotdot",
 * "symlink", "header-bound", "identity", "hash", "size", "tokens",
 * "missing", "partial", "json", "unknown-required", "malformed", "shard",
 * "unlisted", "io"); static. Thread-safe. */
KVT_API const char *kvt_publish_refusal_name(kvt_publish_refusal r);

/* ---- writing a generation ------------------------------------------------------ */

typedef struct kvt_publisher kvt_publisher;

/** Options of kvt_publish_begin. Zero-initialise, then set. */
typedef struct kvt_publish_options {
    /** Non-zero: the new generation starts with every shard of the current
     * one (hard links: no bytes copied), so a publication adds prompts to
     * what is published. A current generation of another identity, or one
     * that fails validation, is an error. */
    int from_current;
} kvt_publish_options;

/** Starts a generation under `dir` for `identity`: creates dir and
 * dir/generations (0755) when absent, takes dir/.publish.lock exclusively
 * (waiting for another publisher), removes leftovers of dead publishers
 * (.staging-*, .removing-*), creates the staging directory and opens an SSD
 * store in it (kvt_store_open, unlimited budget).
 * @param dir, identity, opts borrowed for the call; opts may be NULL.
 * @param out receives the publisher; end it with kvt_publish_commit() or
 *   kvt_publish_abort().
 * @return 0; KVT_EINVAL (NULL argument, empty dir); -errno naming the
 *   directory; KVT_ENOMEM; kvt_store_open's errors; with from_current,
 *   kvt_publish_validate's errors. On error nothing is left behind. */
KVT_API int kvt_publish_begin(const char *dir, const kvt_store_identity *identity,
                              const kvt_publish_options *opts, kvt_publisher **out);

/** Writes an entry into the generation being built (kvt_store_put: durable
 * in the staging directory on return; kv blocks shared between entries are
 * stored once; a trimmable entry supersedes the entries it extends).
 * @param e borrowed, as kvt_store_put.
 * @return 0, or kvt_store_put's errors. Not thread-safe with other calls
 *   on the same publisher. */
KVT_API int kvt_publish_put(kvt_publisher *p, const kvt_entry *e);

/** The staging store's cold-tier table (kvt_store_cold_tier: writable), so
 * a cache service can write into the generation as it would into an SSD
 * tier (spill is write-behind: kvt_publish_commit flushes it). Borrowed,
 * valid until commit or abort. */
KVT_API void kvt_publish_cold_tier(kvt_publisher *p, kvt_cold_tier *out);

/** What a commit did. */
typedef struct kvt_publish_result {
    char generation[KVT_PUBLISH_ID_LEN]; /* the new generation's id */
    uint64_t shards;                     /* files listed in the manifest */
    uint64_t bytes;                      /* their bytes */
    uint64_t entries;                    /* entry shards */
    uint64_t removed;                    /* old generations removed */
    uint64_t kept_busy;                  /* old generations a reader still holds */
} kvt_publish_result;

/** Publishes the generation and frees p (also on error): flushes and closes
 * the staging store, writes MANIFEST.json (SHA-256 and size of every shard,
 * tokens each covers, created time) and fsyncs every file and directory,
 * renames the staging directory to generations/<id>/ and fsyncs
 * generations/, switches CURRENT (temp file, fsync, rename, fsync dir), then
 * removes generations beyond the newest `keep` that no reader holds (see the
 * file comment), and releases .publish.lock.
 * @param keep generations to keep, the new one included (>= 1).
 * @param res may be NULL.
 * @return 0; KVT_EINVAL (NULL p, keep < 1: then p is aborted); the store's
 *   write errors; -errno naming the file. On error before the CURRENT
 *   switch the staging directory is removed and CURRENT is unchanged. A
 *   generation that cannot be removed is not an error (it is counted in
 *   kept_busy). */
KVT_API int kvt_publish_commit(kvt_publisher *p, int32_t keep, kvt_publish_result *res);

/** Drops the generation being built (removes the staging directory),
 * releases the lock and frees p. NULL is a no-op. */
KVT_API void kvt_publish_abort(kvt_publisher *p);

/* ---- validating and inspecting ------------------------------------------------------ */

/** One shard of a generation, as validation saw it: the manifest's fields
 * and, once read, the header's. Borrowed, valid during the callback. */
typedef struct kvt_publish_shard_info {
    const char *path;    /* relative to the generation directory */
    char type;           /* 'e' entry, 'b' kv block, 'i' IDENTITY */
    const char *ns;      /* from the manifest */
    uint64_t bytes;      /* from the manifest */
    int64_t tokens;      /* from the manifest: tokens the shard covers */
    const char *sha256;  /* from the manifest: 64 hex digits */
    int32_t n_layers;    /* from the header (entries), else 0 */
    int32_t n_tensors;   /* from the header, else 0 */
    int hash_checked;    /* 1 when its SHA-256 was computed and matched */
} kvt_publish_shard_info;

/** Settings of kvt_publish_validate. Zero-initialise, then set. */
typedef struct kvt_publish_validate_opts {
    /** The identity the reader serves; NULL accepts any (inspect, verify). */
    const kvt_store_identity *identity;
    /** Non-zero: compute every shard's SHA-256 and compare it with the
     * manifest (reads every byte). 0: sizes, paths and headers only. */
    int hashes;
    /** Called once per listed shard that passed every check, in manifest
     * order (may be NULL). */
    void (*on_shard)(void *ctx, const kvt_publish_shard_info *s);
    void *ctx;
} kvt_publish_validate_opts;

/** What validation found. */
typedef struct kvt_publish_report {
    char generation[KVT_PUBLISH_ID_LEN];
    kvt_publish_refusal refusal;  /* KVT_PUBLISH_OK when the generation is good */
    char detail[768];             /* the refusal's sentence (what and where), "" when good */
    int64_t created_ms;           /* from the manifest, ms since the epoch */
    char created[32];             /* from the manifest, ISO 8601 UTC */
    char identity_dir[40];        /* from the manifest */
    char model_id[1025], config_fingerprint[1025], tokenizer_hash[1025];
    uint64_t shards, bytes, entries, blocks;
    int64_t tokens_max;           /* the longest entry's tokens */
} kvt_publish_report;

/** Validates one generation of `dir` (generation NULL: the one CURRENT
 * names) without serving it, checking in this order: CURRENT holds a
 * valid id and names an existing generation directory (not a symbolic
 * link) with a manifest; the manifest's size bound, JSON, the "required"
 * fields it lists (each must be known), format, version, generation id,
 * identity (equal to opts->identity when given) and shard list; for every
 * listed shard: a relative path without "..", not resolving through a
 * symbolic link, inside the identity directory, present, of the listed
 * size, with the listed SHA-256 (opts->hashes); then every file the SSD
 * store would serve from the generation (kvt_store_walk) must be listed,
 * have a valid header (bound, identity, offsets, tokens) and cover the
 * listed tokens, and every block an entry needs must be present.
 * @param out receives the report (refusal and detail on a refusal).
 * @return 0 (good); KVT_ENOTFOUND (generation NULL and dir has no CURRENT:
 *   nothing published; out->refusal stays OK); KVT_EFORMAT (refused: see
 *   out->refusal); KVT_ECORRUPT (refused: hash); KVT_EIDENTITY (refused:
 *   identity); KVT_EINVAL (NULL dir or out); KVT_ENOMEM. kvt_last_error()
 *   holds out->detail. Thread-safe. */
KVT_API int kvt_publish_validate(const char *dir, const char *generation, const kvt_publish_validate_opts *opts,
                                 kvt_publish_report *out);

/** The generation ids under dir/generations, sorted ascending, and which
 * one CURRENT names. @param ids receives (n) ids; caller frees with
 * kvt_publish_ids_free. @param current receives CURRENT's id ("" when
 * none), KVT_PUBLISH_ID_LEN bytes; may be NULL.
 * @return 0; KVT_EINVAL; -errno naming dir; KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_publish_list(const char *dir, char ***ids, int32_t *n, char *current);

/** Frees what kvt_publish_list returned. NULL is a no-op. */
KVT_API void kvt_publish_ids_free(char **ids, int32_t n);

/* ---- the read-only tier over CURRENT --------------------------------------------- */

typedef struct kvt_published kvt_published;

/** Options of kvt_published_open. Zero-initialise, then set. */
typedef struct kvt_published_options {
    /** How often a background thread re-reads CURRENT, in milliseconds;
     * 0 = 1000; < 0 = no thread (only kvt_published_refresh switches). */
    int64_t poll_ms;
    /** Non-zero: do not compute SHA-256 of every shard at mount (sizes,
     * paths and headers are still checked, and every restore checks each
     * payload's XXH3-128). Default 0: every hash is checked before a
     * generation is mounted. */
    int skip_hashes;
} kvt_published_options;

/** The state of a published tier. */
typedef struct kvt_published_status {
    char generation[KVT_PUBLISH_ID_LEN]; /* mounted ("" when none) */
    uint64_t switches;                   /* generations mounted since open */
    uint64_t refusals;                   /* generations refused since open */
    uint64_t refused[KVT_PUBLISH_REFUSED_COUNT]; /* per reason */
    kvt_publish_refusal last_refusal;    /* KVT_PUBLISH_OK when none */
    char last_detail[768];               /* the last refusal's sentence */
    char last_refused[KVT_PUBLISH_ID_LEN]; /* the generation it refused */
} kvt_published_status;

/** Opens the read-only tier over the generation `dir`'s CURRENT names, for
 * `identity` (the serving model's: a generation of another identity is
 * refused): validates it (kvt_publish_validate with hashes unless
 * skip_hashes), holds it (shared flock on its directory) and mounts it as a
 * read-only SSD store (kvt_store_options.read_only). No CURRENT, or a
 * refused generation, is not an error: the tier starts empty (every find
 * misses) and mounts the first good generation it sees; kvt_published_status
 * says why. Starts the poll thread (see poll_ms).
 * @param dir, identity, opts borrowed for the call (opts may be NULL).
 * @param out receives the tier; close with kvt_published_close() after
 *   whatever uses its table (a prompt cache, a chain) is closed.
 * @return 0; KVT_EINVAL (NULL argument, empty dir); KVT_ENOMEM; -errno (the
 *   thread could not start). */
KVT_API int kvt_published_open(const char *dir, const kvt_store_identity *identity,
                               const kvt_published_options *opts, kvt_published **out);

/** Re-reads CURRENT now and, when it names another generation, validates
 * and mounts it. A find after the switch sees only the new generation; a
 * handle from the generation mounted before it still restores (that one is
 * kept until the next switch), so a request that found an entry reads it
 * from the generation it found it in. A refused generation is counted and
 * not retried until CURRENT changes again; the mounted one stays in use.
 * @return 0 (the mounted generation is CURRENT's, new or not);
 *   KVT_ENOTFOUND (no CURRENT); the refusal's code (as
 *   kvt_publish_validate; kvt_last_error names it); KVT_ENOMEM; a store
 *   open error. Thread-safe (refreshes are serialised). */
KVT_API int kvt_published_refresh(kvt_published *p);

/** Fills *out (NULL p or out: no-op). Thread-safe. */
KVT_API void kvt_published_get_status(kvt_published *p, kvt_published_status *out);

/** Fills *out with the tier's table: self = p (borrowed until close),
 * flags KVT_TIER_READ_ONLY; find, find_exact (index only: the mounted
 * store's), restore (from the generation the handle came from), store
 * (refuses with KVT_EREADONLY, counted in write_failures), stats (finds,
 * find_hits, restores, restore_failures, write_failures, and entries and
 * bytes of the mounted generation); spill, pending, flush, withdraw,
 * restore_async and set_evict are NULL. Handles stay below 2^60. */
KVT_API void kvt_published_cold_tier(kvt_published *p, kvt_cold_tier *out);

/** Stops the poll thread, unmounts (releasing the shared locks) and frees
 * p. NULL is a no-op. Entries restored earlier stay valid (their buffers
 * own their bytes or the shard mapping). Not thread-safe with other calls
 * on p. */
KVT_API void kvt_published_close(kvt_published *p);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_PUBLISH_H */
