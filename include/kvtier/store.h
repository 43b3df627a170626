/*
 * kvtier/store.h: the SSD tier. Crash-safe persistent prefixes that survive
 * restarts and are never served wrong.
 *
 * Layout on disk: a root directory holds one subdirectory per identity (the
 * hex SHA-256 of the model id, the config fingerprint and the tokenizer hash,
 * cut to 32 characters). Each holds:
 *   IDENTITY           the identity as JSON (what `kvtier store inspect` shows)
 *   b<32 hex>.safetensors  one full kv block range of every layer, content
 *                      addressed by a chained XXH3-128 over (identity, ns,
 *                      parent block key, block tokens); stored once, shared
 *                      by every entry whose tokens extend it
 *   e<32 hex>.safetensors  one entry: its tokens, its layers' non-block state
 *                      (tails, rings, recurrent state), its attachments, and
 *                      the keys of the blocks it references
 * Every shard is a safetensors file (8-byte little-endian header length, JSON
 * header with string-only "__metadata__", contiguous tensor bytes), so any
 * safetensors reader opens it. The metadata holds the identity, ns, tokens
 * (base64 of int32 little-endian), per-layer kinds, params and ranges, and two
 * checksums of the payload: XXH3-128 and SHA-256. Headers over
 * KVT_STORE_MAX_HEADER bytes are refused.
 *
 * Durability: a shard is written under a temporary name, fsync'd, renamed,
 * and the directory fsync'd; an interrupted or failed write is never visible
 * under a final name and never indexed. Opening the store scans headers only
 * (no tensor bytes), removes temporary files of dead writers and rebuilds the
 * index; a shard that fails validation is refused and counted under its own
 * reason (kvt_store_refusal), never served.
 *
 * Lookup (kvt_store_find, kvt_store_find_exact) touches the in-memory index
 * only. kvt_store_restore reads the shards into buffers the restored caches
 * own (shards of 64 KiB or more are mapped read-only, each tensor's buffer
 * holding the mapping, which is unmapped when the last view is released;
 * smaller ones are copied), checks the stored tokens against the requested
 * prefix (a mismatch is a miss), checks the XXH3-128 of every payload it
 * reads, always, before any byte is handed out (SHA-256 as well when the
 * store was opened with verify), and rebuilds the caches with
 * kvt_cache_decode (zero-copy for kinds that adopt whole buffers, e.g. full
 * kv blocks). A checksum mismatch is refused (KVT_ECORRUPT, counted under
 * "checksum"), and the corrupt shard is removed from disk and from the index,
 * with every entry that references it: it is never read again. An entry
 * whose write-behind is queued or in flight is found by lookups and restored
 * from the queue's own caches (zero-copy clones), so a pending write is never
 * lost to a lookup.
 *
 * Identity directories that are symbolic links are refused everywhere: open
 * fails, kvt_store_walk reports them (KVT_STORE_REFUSED_SYMLINK), kvt_store_gc
 * and the budget never enter them.
 *
 * Thread-safety: every function on one kvt_store may be called from any
 * thread concurrently, except kvt_store_close (no other call may be running
 * or start on that store).
 */
#ifndef KVTIER_STORE_H
#define KVTIER_STORE_H

#include "kvtier/cache.h"
#include "kvtier/common.h"
#include "kvtier/tier.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Fixed bound on a shard's JSON header, in bytes (16 MiB). A larger header
 * length is refused with KVT_STORE_REFUSED_HEADER_BOUND before anything is read. */
#define KVT_STORE_MAX_HEADER (16u << 20)

/** Length of a hex fingerprint string including its NUL (SHA-256: 64 + 1). */
#define KVT_STORE_FINGERPRINT_LEN 65

typedef struct kvt_store kvt_store;

/** What a store's shards belong to. Shards written under another identity are
 * never served. All three strings are borrowed for the call only; each must be
 * non-NULL, at most 1024 bytes ("" is allowed). */
typedef struct kvt_store_identity {
    const char *model_id;           /* e.g. the checkpoint's name or hash */
    const char *config_fingerprint; /* layer count, shapes, kinds, dtypes:
                                       see kvt_store_config_fingerprint() */
    const char *tokenizer_hash;     /* e.g. SHA-256 of tokenizer.bin */
} kvt_store_identity;

/** The write layer shards go through: real pwrite/fsync by default; tests
 * replace it to inject ENOSPC, EIO or short writes.
 * pwrite_fn returns bytes written (may be short) or -1 with errno set, like
 * pwrite(2); fsync_fn returns 0 or -1 with errno set, like fsync(2). Both are
 * called from the I/O worker's threads (write-behind, docs/io.md) and from
 * kvt_store_put callers, concurrently. */
typedef struct kvt_store_io {
    ssize_t (*pwrite_fn)(void *ctx, int fd, const void *buf, size_t bytes, off_t offset);
    int (*fsync_fn)(void *ctx, int fd);
    void *ctx;
} kvt_store_io;

/** Options of kvt_store_open. Zero-initialise, then set what you need. */
typedef struct kvt_store_options {
    /** Byte budget over the whole root (every identity directory counts),
     * bytes; 0 = unlimited (`--ssd-cache-max`). When a write takes the root
     * over it, least recently used entries go first (own entries by last
     * use, idle directories of other identities by file time). Several
     * processes may share a root and an identity directory: block files are
     * deleted only under an exclusive lock of <dir>/.budget.lock, from the
     * files on disk (an entry file goes before or with the blocks only it
     * uses; a block goes only when no entry file references it), and puts
     * hold the shared lock while they rely on existing blocks, so budget
     * eviction never leaves an entry with a missing block (an entry file
     * whose block is gone, e.g. refused at restore, is removed by every
     * reclaim, budget or not). An entry that with its block files exceeds
     * max_bytes on its own is not kept: it is dropped first and supersedes
     * nothing, so the entries that fit stay. */
    uint64_t max_bytes;
    /** Write-behind queue bound in bytes of queued cache state; 0 = 256 MiB.
     * kvt_store_put_async refuses (and counts as dropped) what does not fit. */
    uint64_t queue_max_bytes;
    /** Non-zero: strict restores (`--ssd-cache-verify`): the SHA-256 of every
     * shard read is checked as well as its XXH3-128 (which every restore
     * checks, always); a mismatch is a miss, counted. */
    int verify;
    /* (There is no restore_threads option any more: it sized nothing once
     * restores, write-behind and shard hashing ran on the I/O worker
     * (`worker`), whose threads every store of the process shares; size
     * those with kvt_io_options.threads of a worker given here.) */
    /** Fault-injection write layer (borrowed for the life of the store);
     * NULL = pwrite(2)/fsync(2). */
    const kvt_store_io *io;
    /** Non-zero: read-only store. Open needs only read access (a read-only
     * mount, a directory or .lock file of another user): it creates
     * nothing, writes nothing (no IDENTITY, no temp files, no last-use
     * stamps), removes nothing (no temp cleanup, no budget, no gc, a corrupt
     * shard only leaves the index) and takes the shared lock only when .lock
     * can be opened for reading. find and restore work as usual;
     * kvt_store_put, kvt_store_put_async and the cold tier's store and spill
     * return -EROFS, counted in stats.write_refused (the cold tier's table
     * says KVT_TIER_READ_ONLY and its store and spill refuse with
     * KVT_EREADONLY, counted the same way). */
    int read_only;
    /** How long open waits for the shared lock on <dir>/.lock while
     * another process holds it exclusively (kvt_store_gc or a budget pass
     * evicting the directory as idle, or anything else that locks it), in
     * milliseconds; 0 = 10,000 ms; at most 86,400,000. Open never blocks in
     * flock: it retries a non-blocking attempt (pauses of 1 to 50 ms) and
     * gives up with KVT_EBUSY once the wait has passed, so no thread is
     * ever left waiting for the lock. Read-only opens do not wait (they go
     * on without the lock when it is held). */
    uint64_t lock_wait_ms;
    /** Optional process-wide pool (kvtier/pool.h; borrowed, must outlive
     * the store). The root joins it as `pool_name` (NULL: "ssd:<root>",
     * the root's tail when longer than 255 bytes) and its byte budget
     * max_bytes is reserved and published on the pool's disk axis at open
     * (the root never holds more than its budget beyond a shard being
     * written, so the budgets of every root of the process stay under the
     * pool's disk limit) and released at close. Refused at open, before
     * anything is created: the pool's KVT_EAGAIN / KVT_ELIMIT naming the
     * axis "disk", the bytes asked and free; KVT_EINVAL for max_bytes 0
     * under a disk-limited pool (an unlimited root cannot be charged);
     * KVT_EBUSY when the member name is joined (several stores on one root
     * share its budget: give the pool to one of them). A read-only store
     * joins with 0 bytes. NULL: no pool. */
    struct kvt_pool *pool;
    const char *pool_name; /* borrowed for the call */
    /** The I/O worker (kvtier/io.h) that runs this store's write-behind
     * writes, asynchronous restores and shard hashes; borrowed: it must
     * outlive the store. NULL: the process's default worker, a reference
     * taken at open (kvt_io_default_acquire) and dropped at close. */
    struct kvt_io *worker;
} kvt_store_options;

/** Why a shard was refused (counted per reason in kvt_store_stats.refused). */
typedef enum kvt_store_refusal {
    KVT_STORE_REFUSED_TRUNCATED = 0, /* file shorter than its header says */
    KVT_STORE_REFUSED_HEADER_BOUND,  /* header length over KVT_STORE_MAX_HEADER */
    KVT_STORE_REFUSED_OFFSETS,       /* data_offsets outside the payload, overlapping,
                                        unsorted, or the file longer than declared */
    KVT_STORE_REFUSED_MALFORMED,     /* bad JSON, missing/ill-typed field, dtype or
                                        shape that does not match its byte count */
    KVT_STORE_REFUSED_IDENTITY,      /* written under another identity */
    KVT_STORE_REFUSED_CHECKSUM,      /* payload XXH3-128 mismatch (every restore) or
                                        SHA-256 mismatch (strict restore, verify) */
    KVT_STORE_REFUSED_TOKENS,        /* stored tokens differ from the request/index */
    KVT_STORE_REFUSED_MISSING_BLOCK, /* an entry references a block that is gone */
    KVT_STORE_REFUSED_IO,            /* read error */
    KVT_STORE_REFUSED_SYMLINK,       /* an identity directory that is a symbolic link */
    KVT_STORE_REFUSED_COUNT
} kvt_store_refusal;

/** Short name of a refusal reason ("truncated", "header-bound", "offsets",
 * "malformed", "identity", "checksum", "tokens", "missing-block", "io",
 * "symlink"); static. */
KVT_API const char *kvt_store_refusal_name(kvt_store_refusal r);

/** Counters of one open store, one list: X(type, name, kind, metric, help).
 * It makes the struct, kvt_store_stats_json (/stats "ssd", by name) and the
 * server's /metrics families kvtier_ssd_<metric> (a counter with "_total";
 * a name ending _ns, nanoseconds, as <metric>_seconds), so a counter added
 * here appears in all three. The refusals by reason are the array after. */
#define KVT_STORE_COUNTERS(X)                                                                           \
    X(uint64_t, entries, gauge, entries, "indexed (durable) entries")                                  \
    X(uint64_t, blocks, gauge, blocks, "indexed block shards")                                         \
    X(uint64_t, bytes, gauge, bytes, "bytes of this identity's directory (files)")                     \
    X(uint64_t, root_bytes, gauge, root_bytes, "bytes of the whole root, as last measured")            \
    X(uint64_t, max_bytes, gauge, max_bytes, "the byte budget over the root (0 = unlimited)")          \
    X(uint64_t, pending, gauge, pending_writes, "write-behind jobs queued or being written")            \
    X(uint64_t, pending_bytes, gauge, pending_write_bytes, "cache bytes the pending writes hold")       \
    X(uint64_t, dropped, counter, dropped_writes, "write-behind refused: queue full or store closing") \
    X(uint64_t, failed, counter, failed_writes, "writes that failed (I/O, ENOSPC, bad state)")         \
    X(uint64_t, written, counter, written_entries, "entries made durable")                             \
    X(uint64_t, skipped, counter, skipped_writes, "puts of an entry already durable (no write)")       \
    X(uint64_t, blocks_written, counter, blocks_written, "block shards written")                       \
    X(uint64_t, blocks_shared, counter, blocks_shared, "block references satisfied by an existing shard") \
    X(uint64_t, bytes_written, counter, written_bytes, "shard bytes written")                          \
    X(uint64_t, superseded, counter, superseded_entries,                                               \
      "entries removed because a longer trimmable one serves them")                                    \
    X(uint64_t, evicted, counter, evicted_entries, "entries evicted by the byte budget")               \
    X(uint64_t, evicted_foreign_files, counter, evicted_foreign_files,                                 \
      "files of other identities' idle directories evicted")                                           \
    X(uint64_t, restores, counter, restores, "successful restores")                                    \
    X(uint64_t, restore_misses, counter, restore_misses, "restores that found the entry unusable or gone") \
    X(uint64_t, restore_bytes, counter, restore_bytes, "shard bytes read by restores")                 \
    X(uint64_t, restore_ns_last, gauge, last_restore_ns, "duration of the last successful restore, ns") \
    X(uint64_t, temp_removed, counter, temp_files_removed, "leftover temporary files removed")         \
    X(uint64_t, other_config_shards, gauge, other_config_shards,                                       \
      "shards found at open under the same model id with another config fingerprint or tokenizer "    \
      "(their own directories): never served")                                                         \
    X(int64_t, longest_prefix_tokens, gauge, longest_prefix_tokens, "tokens of the longest indexed entry") \
    X(uint64_t, write_refused, counter, write_refused, "puts refused because the store is read-only")  \
    X(uint64_t, pending_hits, counter, pending_hits, "restores served from the write-behind queue")

/** Counters of one open store (see KVT_STORE_COUNTERS). A snapshot; fields
 * are independent reads. */
typedef struct kvt_store_stats {
#define KVT__STORE_FIELD(type, name, kind, metric, help) type name;
    KVT_STORE_COUNTERS(KVT__STORE_FIELD)
#undef KVT__STORE_FIELD
    uint64_t refused[KVT_STORE_REFUSED_COUNT]; /* refusals per reason (kvt_store_refusal_name), since open */
} kvt_store_stats;

/** The counters *st as one JSON object: {every KVT_STORE_COUNTERS name: n,
 * "refused": {every kvt_store_refusal_name: n}}, compact, keys in list order.
 * @param out receives the string; caller frees with kvt_string_free.
 * @return 0; KVT_EINVAL (NULL argument); KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_store_stats_json(const kvt_store_stats *st, char **out);

/** Computes a config fingerprint from a model's (empty) per-layer caches: the
 * layer count and, per layer, the kind and its parameters (which fix shapes
 * and dtypes), hashed with SHA-256.
 * @param caches (n_layers) borrowed for the call; @param out receives 64 hex
 * digits and a NUL. @return 0, KVT_EINVAL (NULL, n_layers < 0), KVT_ENOMEM.
 * Thread-safe. */
KVT_API int kvt_store_config_fingerprint(kvt_cache *const *caches, int32_t n_layers,
                                         char out[KVT_STORE_FINGERPRINT_LEN]);

/** The same fingerprint from the model's recipe for fresh caches (the
 * new_caches function a service or prompt cache is configured with), so the
 * caller builds no caches of its own: new_caches(ctx, ...) fills n_layers
 * caches, which are read and destroyed before the call returns.
 * @param out receives 64 hex digits and a NUL.
 * @return 0; KVT_EINVAL (NULL new_caches or out, n_layers outside 1..256,
 * a slot left NULL); new_caches' error; KVT_ENOMEM. Thread-safe when
 * new_caches is. */
KVT_API int kvt_store_config_fingerprint_of(kvt_new_caches_fn new_caches, void *ctx, int32_t n_layers,
                                            char out[KVT_STORE_FINGERPRINT_LEN]);

/** Opens (creating when absent) the store of `identity` under `root`.
 *
 * Creates root and root/<identity dir>/ (mode 0755), writes IDENTITY, scans
 * the directory's shard headers (no tensor bytes) to rebuild the index,
 * removes temporary files left by dead writers, counts refused shards, then
 * measures the root and applies the budget. Takes the I/O worker (opts->worker,
 * else a reference on the process default) its writes and restores run on. Holds a shared flock on <dir>/.lock until close: a
 * directory nobody holds is idle, and only idle directories of other
 * identities are ever evicted by another store or by kvt_store_gc.
 * @param root     directory path, borrowed for the call.
 * @param identity borrowed for the call (copied).
 * @param opts     NULL for defaults; borrowed for the call (opts->worker is
 *                 borrowed for the life of the store).
 * @param out      receives the store; close it with kvt_store_close().
 * @return 0; KVT_EINVAL (NULL argument, root empty or over 3000 bytes, an
 * identity string over 1024 bytes or not UTF-8, lock_wait_ms out of range);
 * KVT_EUNSUPPORTED (the identity directory is a symbolic link: refused, not
 * followed); KVT_EBUSY (another process held <dir>/.lock exclusively for
 * the whole of opts->lock_wait_ms: nothing is left open; also a pool member
 * name already joined, see pool); -errno (cannot create or open a
 * directory; in read-only mode a missing identity directory is an empty
 * store, not an error); KVT_ENOMEM.
 * Thread-safe (different stores are independent).
 */
KVT_API int kvt_store_open(const char *root, const kvt_store_identity *identity,
                           const kvt_store_options *opts, kvt_store **out);

/** Flushes the write-behind queue, stops the threads, applies the budget a
 * last time (waiting for puts of other processes on the same directory to
 * finish, so the root ends within max_bytes plus a shard written meanwhile)
 * and frees the store. NULL is a no-op (returns 0). Queued async restores
 * still complete (their callbacks run) before it returns.
 * @return 0 when every write since open was made durable, else the status of
 * the last failure (KVT_EIO, -ENOSPC, ...). The store is freed either way.
 * Not thread-safe with other calls on the same store. */
KVT_API int kvt_store_close(kvt_store *s);

/** Longest usable prefix of `prompt` held by the store, from the index only
 * (no I/O): the common prefix of an entry's tokens with the prompt, capped at
 * n_prompt - 1 (one token must still run), counted only if it lies inside
 * every layer's reachable range of that entry (an entry with attachments or
 * a wrapped ring / recurrent layer serves only prompts that extend all of its
 * tokens). Among entries giving the longest prefix a shortest one is chosen.
 * O(n_prompt) walks of two radix trees: durable entries and entries whose
 * write-behind is queued or in flight (a pending entry is found; on equal
 * prefixes the durable one is chosen).
 * @param prompt (n_prompt) token ids, borrowed; @param ns namespace; NULL
 * means "" (the base model).
 * @param hit receives prefix_len, n_tokens and the handle on success; the
 *        handle stays valid until the entry is evicted or superseded (then
 *        restore returns KVT_ENOTFOUND).
 * @return 0; KVT_ENOTFOUND (no usable prefix of at least 1 token); KVT_EINVAL
 * (NULL s or hit, n_prompt < 0, NULL prompt with n_prompt > 0).
 * Thread-safe. */
KVT_API int kvt_store_find(kvt_store *s, const int32_t *prompt, int64_t n_prompt, const char *ns,
                           kvt_cold_hit *hit);

/** Exact lookup: the entry whose tokens equal `tokens` in `ns` (n_tokens may
 * be 0: objects), durable or, failing that, pending in the write-behind
 * queue. Index only. hit->prefix_len = n_tokens.
 * @return 0; KVT_ENOTFOUND; KVT_EINVAL (as kvt_store_find). Thread-safe. */
KVT_API int kvt_store_find_exact(kvt_store *s, const int32_t *tokens, int64_t n_tokens, const char *ns,
                                 kvt_cold_hit *hit);

/** Reads a found entry back into owned buffers and rebuilds its caches.
 *
 * The whole entry (hit n_tokens tokens) is restored; trimming is the
 * caller's (kvt_cache_trim). Before anything is returned the stored tokens
 * are compared with the index's copy and, when `prompt` is given, their first
 * min(n_prompt, n_tokens) tokens with the prompt: any difference is a miss
 * (counted as refused: tokens), never served. The XXH3-128 of every shard
 * read is checked before its bytes are used (a version 1 shard, which has
 * none, is checked by SHA-256); under verify the SHA-256 too. A mismatch
 * removes the shard (file and index; for a block, the entries over it leave
 * the index). A handle from a pending write is restored from the queued
 * entry: zero-copy clones of its caches and attachments; out->hook then
 * holds the queued entry (its own hook runs after the writer is done and
 * every clone's hook has run); once the write is durable the same handle
 * restores from disk. A durable entry is read as a foreground operation of
 * the store's I/O worker (kind restore, keyed by the handle) that the call
 * waits for: identical restores at the same time, by this call or
 * kvt_store_restore_async, are one read, each caller getting its own
 * zero-copy clone; still queued when asked, the read runs on the calling
 * thread. When the worker refuses it (queue full, shutting down) the call
 * reads on its own thread as well.
 * @param handle from kvt_store_find / kvt_store_find_exact.
 * @param prompt (n_prompt) the tokens the caller will use, borrowed; may be
 *        NULL with n_prompt 0.
 * @param out receives a kvtier-allocated entry (kvt_entry_init; the caches
 *        own their bytes or a read-only mapping of the shard that their buffers release,
 *        the hook is empty); the caller releases it with kvt_entry_clear().
 *        Zeroed on error. Shards are never truncated or rewritten under
 *        their final names, so a mapping stays valid after an eviction.
 * @return 0; KVT_EINVAL (NULL s or out, n_prompt < 0, NULL prompt with
 * n_prompt > 0); KVT_ENOTFOUND (no such handle, evicted meanwhile, tokens differ); KVT_ECORRUPT
 * (checksum mismatch); KVT_EFORMAT (shard invalid, or a layer
 * that does not decode); KVT_EIDENTITY; -errno (read failure); KVT_ENOMEM.
 * Every failure is a miss: nothing partial is returned. Thread-safe.
 */
KVT_API int kvt_store_restore(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt,
                              kvt_entry *out);

/** Queues kvt_store_restore(s, handle, NULL, 0, ...) on a restore thread.
 * `done(arg, status, entry)` runs exactly once, on a restore thread, also
 * when the restore fails (see kvt_restore_done_fn in tier.h: on status 0 the
 * callee owns the entry's contents).
 * @return 0 (queued); KVT_EINVAL (NULL s or done: done is not called);
 * KVT_ECLOSED (store closing: done is not called); KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_store_restore_async(kvt_store *s, uint64_t handle, kvt_restore_done_fn done, void *arg);

/** Writes an entry now; durable on return (temp name, fsync, rename, fsync
 * of the directory). An entry with equal tokens in the same ns that is
 * already durable is not written again (counted as skipped). A trimmable
 * entry supersedes same-ns entries whose tokens are a strict prefix of it
 * and that it can serve (the prompt cache's put rule).
 *
 * @param e borrowed: ns, tokens, caches and attachments are read during the
 *        call, never kept or destroyed; no other thread may modify the caches
 *        during the call. Every cache must hold exactly e->n_tokens tokens;
 *        each attachment needs ops->serialize.
 * @return 0; KVT_EINVAL (offsets differ from n_tokens, NULL, ns or an
 * attachment name not valid UTF-8: shard metadata is JSON); KVT_EUNSUPPORTED
 * (an attachment that cannot be serialized); KVT_ETOOBIG (larger than the
 * whole budget); -EROFS (read-only store: counted in write_refused); -ENOSPC, KVT_EIO or -errno (write failed: the entry is not
 * indexed, temporary files are removed); KVT_ENOMEM. A failure is counted in
 * stats.failed. Thread-safe.
 */
KVT_API int kvt_store_put(kvt_store *s, const kvt_entry *e);

/** Queues an entry for write-behind; returns at once.
 *
 * @param e a kvtier-allocated entry (kvt_entry_init; e.g. zero-copy clones of
 *        the
 *        caches). Ownership passes to the store on 0: the writer clears it
 *        (kvt_entry_clear) after the write, whether it succeeds or fails, and
 *        *e is zeroed. On error it stays with the caller.
 * Until the write is durable the entry is not indexed as durable
 * (kvt_store_contains says 0, kvt_store_pending() says 1), but find and
 * find_exact see it and restore serves it from the queued caches.
 * The queue holds at most queue_max_bytes of cache state (kvt_cache_bytes of
 * the layers plus attachment bytes), except that an entry is always accepted
 * into an empty queue (so one larger entry is written, not dropped forever).
 * @return 0 (queued); KVT_EAGAIN (queue bytes would exceed queue_max_bytes:
 * counted as dropped); KVT_ECLOSED (closing: dropped); KVT_EINVAL (as
 * kvt_store_put); -EROFS (read-only store: counted in write_refused);
 * KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_store_put_async(kvt_store *s, kvt_entry *e);

/** Whether a write of exactly (ns, tokens) is queued or in flight (1) or
 * not (0; also for a NULL store, or NULL tokens with n_tokens > 0). A NULL
 * ns means "".
 * Index only. Thread-safe. */
KVT_API int kvt_store_pending(kvt_store *s, const int32_t *tokens, int64_t n_tokens, const char *ns);

/** Waits until the write-behind queue is empty.
 * @return 0 when everything queued or written since the previous flush is
 * durable; else the last failure's status (nothing was dropped silently:
 * see stats.failed / stats.dropped); KVT_EINVAL (NULL store). Thread-safe. */
KVT_API int kvt_store_flush(kvt_store *s);

/** Fills *tier with the kvt_cold_tier table over this store (find,
 * find_exact, restore, restore_async, store, spill, pending, flush, stats,
 * set_evict), for kvt_prompt_cache's config or a kvt_tier_chain level.
 * tier->self = s: borrowed, valid until kvt_store_close; close the prompt
 * cache (or chain) first. flags is KVT_TIER_READ_ONLY for a store opened
 * read-only (kvt_store_options.read_only), whose store and spill then refuse
 * with KVT_EREADONLY (counted in stats.write_refused; the entry stays the
 * caller's), as tier.h asks of a read-only tier; else 0.
 *   stats: finds / find_hits (kvt_store_find calls), restores and
 *     restore_failures (stats.restores / restore_misses), stores
 *     (stats.written), write_failures (failed + dropped + write_refused),
 *     behind_failures (write-behind jobs accepted by spill whose write
 *     failed later, on the I/O worker; also in failed), behind_dropped
 *     (accepted jobs the I/O worker discarded unrun because it shut down),
 *     evictions (stats.evicted), demotions (evictions the hook took),
 *     entries and bytes (this identity's directory).
 *   set_evict: from then on, an entry the byte budget evicts from this
 *     store's own directory is first read back whole (checked as a restore
 *     is) and handed to the hook; the hook owns it on 0, else it is only
 *     deleted, as it is without a hook. The hook runs on whichever thread
 *     ran the budget (a put, the writer, close), without the store's lock
 *     but while the budget pass holds the root's budget lock; it must not
 *     call back into this store. Entries of other identities' directories
 *     and files the store refused are deleted, never handed over.
 * Thread-safe. */
KVT_API void kvt_store_cold_tier(kvt_store *s, kvt_cold_tier *tier);

/** Whether an entry of exactly (tokens, ns) is durable and indexed (1) or
 * not (0: absent, still pending, evicted, or a NULL store, or NULL tokens
 * with n_tokens > 0). A NULL ns means "". Index only (no I/O). Thread-safe. */
KVT_API int kvt_store_contains(kvt_store *s, const int32_t *tokens, int64_t n_tokens, const char *ns);

/** Calls cb(ctx, hit) for every durable entry indexed under namespace `ns`
 * (NULL means ""), in no particular order; hit->prefix_len and
 * hit->n_tokens are the entry's token count, hit->handle its handle for
 * kvt_store_restore and kvt_store_remove. Entries whose write is still
 * queued are not listed. Index only (no I/O). cb runs with the store's
 * lock held: it must not call into the store; a non-zero return stops the
 * walk and is returned.
 * @return 0; KVT_EINVAL (NULL s or cb); cb's non-zero return. Thread-safe. */
KVT_API int kvt_store_list(kvt_store *s, const char *ns, int (*cb)(void *ctx, const kvt_cold_hit *hit),
                           void *ctx);

/** Removes one durable entry: it leaves the index and its file is deleted;
 * the block shards only it referenced are handed to the budget's reclaim,
 * which deletes them under the directory's exclusive lock (so an entry of
 * another process never loses a block). Used to drop state nobody will
 * resume, e.g. the checkpoints of a completed generation.
 * @param handle from kvt_store_find, kvt_store_find_exact or kvt_store_list.
 * @return 0; KVT_EINVAL (NULL s); KVT_ENOTFOUND (no durable entry has that
 *   handle: evicted, removed, or its write still queued); -EROFS
 *   (read-only store: counted in write_refused). Thread-safe. */
KVT_API int kvt_store_remove(kvt_store *s, uint64_t handle);

/** Fills *out with the current counters (a NULL store or out is a no-op).
 * Thread-safe. */
KVT_API void kvt_store_get_stats(kvt_store *s, kvt_store_stats *out);

/** Per-layer residency of the store: bytes[i] receives the tensor bytes of
 * layer i over every file the index holds now (each block file once, however
 * many entries share it), kept up to date as files are indexed (put, the
 * startup scan) and leave the index (budget eviction, gc, supersede, remove,
 * a refused shard); no disk access. Headers and metadata belong to no layer,
 * so the sum is a little below kvt_store_stats.bytes. Files other processes
 * wrote into a shared root since this store opened are not in its index, so
 * not counted. The cold-tier table's layer_bytes (kvt_store_cold_tier) gives
 * the same figures as KVT_LAYER_BYTES_RESIDENT.
 * @param bytes (n_layers) written whole (0 past the layers the files hold).
 * @return 0; KVT_EINVAL (s NULL, n_layers < 0, bytes NULL with n_layers > 0).
 * Thread-safe. */
KVT_API int kvt_store_layer_bytes(kvt_store *s, int32_t n_layers, uint64_t *bytes);

/** The identity directory's path (borrowed, valid until kvt_store_close;
 * NULL for a NULL store). Thread-safe. */
KVT_API const char *kvt_store_dir(const kvt_store *s);

/* ---- offline tools over a root (the `kvtier store` command) ---------------- */

/** One shard (or leftover file) seen by kvt_store_walk. Borrowed, valid during
 * the callback only. */
typedef struct kvt_store_shard_info {
    const char *dir;          /* identity directory name */
    const char *identity;     /* its IDENTITY JSON, "" when missing */
    const char *file;         /* file name */
    char type;                /* 'e' entry, 'b' block, 't' temporary, '?' other,
                                 'l' a symlinked identity directory (file "") */
    uint64_t bytes;           /* file size */
    int64_t mtime_ms;         /* modification time, ms since the epoch */
    int status;               /* 0 valid, else the refusal reason + 1 */
    const char *ns;           /* entry/block ns ("" when unknown) */
    int64_t n_tokens;         /* entry tokens, block tok_end - tok_begin */
    int32_t n_layers;         /* entry layers */
    int32_t n_blocks;         /* entry's referenced blocks */
    int32_t n_tensors;        /* tensors in this shard */
} kvt_store_shard_info;

/** Calls cb for every file of every identity directory under root (a
 * directory named by 32 hex digits that holds an IDENTITY file; anything
 * else under root is ignored). Reads
 * headers only unless `verify` is non-zero (then every entry shard is loaded
 * by the restore's own code, with every check a restore runs plus SHA-256,
 * and decoded; every block shard is checked likewise). An identity-named
 * entry under root that is a symbolic link is reported once, type 'l',
 * status KVT_STORE_REFUSED_SYMLINK + 1, and never followed. A non-zero
 * return from cb stops the walk.
 * @return 0; KVT_EINVAL (NULL root or cb); -errno (root cannot be read);
 * or cb's non-zero return. Thread-safe. */
KVT_API int kvt_store_walk(const char *root, int verify,
                           int (*cb)(void *ctx, const kvt_store_shard_info *info), void *ctx);

/** Evicts least recently used entries (and the blocks only they use), refused
 * shards and leftover temporary files of idle identity directories under
 * root until the root holds at most max_bytes. Temporary files of dead
 * writers and entry files referencing a block that is gone are removed
 * whatever the budget. Only shard and temp files of
 * identity directories (see kvt_store_walk) are ever deleted; other files
 * count toward the bytes but are never touched. Directories held open by a
 * live store are skipped. *freed (may be NULL) receives the bytes removed.
 * @return 0 (also when only directories held open keep the root over
 * max_bytes); KVT_EINVAL (NULL root); -errno (root cannot be listed, or a
 * file could not be removed and the root is still over max_bytes: *freed
 * says what was removed). Thread-safe. */
KVT_API int kvt_store_gc(const char *root, uint64_t max_bytes, uint64_t *freed);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_STORE_H */
