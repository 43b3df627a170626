/*
 * store_internal.h: what the files of the SSD tier share; never installed.
 *   store.c         open, close, stats, lookups, the index records, the
 *                   cold-tier table
 *   scan.c          the directory walker: startup scan, offline walk,
 *                   other-config count; file and directory names
 *   put.c           the synchronous write (blocks, then the entry shard)
 *   writer.c        the write-behind queue: one write operation per job on
 *                   the process's I/O worker (kvtier/io.h)
 *   restore.c       restores, the pending-job restore, asynchronous
 *                   restores as coalesced I/O-worker operations
 *   budget.c        the byte budget over the root (reclaim) and gc
 *   store_format.c  shard files: crash-safe writes, header reads
 * The entry <-> shard codec is src/tier/codec.h; keys are key.h's; the
 * index and maps are src/base's (index.h, hmap.h).
 */
#ifndef KVTIER_STORE_INTERNAL_H
#define KVTIER_STORE_INTERNAL_H

#include "kvtier/io.h"
#include "kvtier/store.h"

#include "codec.h"
#include "hmap.h"
#include "index.h"
#include "io_shim.h"
#include "key.h"

#include <jansson.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>

#define KVT__SHARD_SUFFIX ".safetensors"
#define KVT__TMP_PREFIX ".tmp."
#define KVT__BUDGET_LOCK ".budget.lock" /* reclaim holds it exclusive, a put shared */

/* ---- shard files (store_format.c) ---------------------------------------- */

/** Writes `meta` (an object of string values; "sha256", "xxh3", "payload_bytes" and
 * "format"/"version" are added) and tensors t[0..n) as `final_name` in dirfd:
 * temp name, pwrite, fsync, rename. The directory itself is not fsync'd.
 * On failure the temp file is removed. *file_bytes (may be NULL) receives the
 * size. @return 0, -errno, KVT_EIO (short write / size check), KVT_ENOMEM. */
int kvt__shard_write(int dirfd, const char *dir_path, const char *final_name, json_t *meta,
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io, kvt_io *worker,
                     uint64_t *file_bytes);

/** A shard written under its temp name, not yet durable or visible. */
typedef struct kvt__pending_shard {
    int fd, dirfd;
    uint64_t bytes;
    char tmp[256], final[128], path[4096];
    /* until sealed: the payload hash (maybe still running as an operation
     * of the I/O worker: `hash`, a kvt_io_ticket) */
    int sealed;
    void *hash;        /* kvt_io_ticket of the SHA-256 operation, NULL when hashed inline */
    void *md;          /* EVP_MD_CTX */
    void *xx;          /* XXH3_state_t */
    kvt__st_out *t;    /* owned copy of the tensor list */
    int32_t *ord, n;   /* write order */
    json_t *meta;      /* reference held for the final header */
    size_t hlen;
    uint64_t payload;
    kvt_store_io io;
} kvt__pending_shard;

/** First half of kvt__shard_write: writes the temp file's payload, its
 * SHA-256 possibly still being computed by a foreground hash operation on
 * `worker` when this returns (so the caller can begin the next shard
 * meanwhile; worker NULL, a small payload or a full queue: hashed inline). On success ps
 * holds the open file: finish with kvt__shard_seal (optional: hash, header,
 * writeback started), kvt__shard_commit (seal, fsync, size check, rename) or
 * kvt__shard_abort (remove). The tensor data of t is borrowed, valid until
 * one of those returns; t itself and meta are not needed after this call
 * (meta gets one more reference, dropped by seal/abort). On failure nothing
 * is left behind. */
int kvt__shard_begin(int dirfd, const char *dir_path, const char *final_name, json_t *meta,
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io, kvt_io *worker,
                     kvt__pending_shard *ps);
/** Waits for the payload hash, writes the header with it and starts the
 * writeback; no-op when already sealed. On failure the shard is aborted
 * (temp file removed). @return 0, -errno, KVT_EIO, KVT_ENOMEM. */
int kvt__shard_seal(kvt__pending_shard *ps);
/** seal, then fsync, size check, close, rename; on failure the temp file is
 * removed. */
int kvt__shard_commit(kvt__pending_shard *ps, const kvt_store_io *io);
/** Waits for a running hash, closes and removes a begun shard (no-op when
 * already finished). */
void kvt__shard_abort(kvt__pending_shard *ps);

/** Reads and validates the header of the open shard `fd` of `file_bytes` bytes.
 * On failure *reason receives a kvt_store_refusal and the shard is zeroed.
 * @return 0, KVT_EFORMAT, -errno, KVT_ENOMEM. */
int kvt__shard_read_header(int fd, const char *path, uint64_t file_bytes, kvt__shard *out, int *reason);

/** Opens `name` in dirfd (dir: its path, for messages; never following a
 * link) and validates its header. On success *fd_out is the open file.
 * @return 0; KVT_ENOTFOUND (no such file) or -errno with *reason
 * KVT_STORE_REFUSED_IO; a kvt__shard_read_header error. */
int kvt__shard_open(int dirfd, const char *dir, const char *name, kvt__shard *sh, int *fd_out, int *reason);

/* ---- the store's state (store.c; every field under mu unless noted) ------------ */

typedef struct st_block {
    kvt__key key;
    uint64_t bytes;   /* file size */
    int64_t refs;     /* indexed entries + in-flight puts referencing it */
    uint64_t *lbytes; /* (n_lbytes) tensor bytes of each layer in the file, or NULL */
    int32_t n_lbytes;
} st_block;

typedef struct st_entry {
    kvt__key key;
    uint64_t id;          /* the handle given out by find */
    char *ns;
    int32_t *tokens;      /* (n_tokens) */
    int64_t n_tokens;
    int64_t min_reach;    /* smallest usable prefix (tokens); n_tokens when untrimmable */
    int64_t granule;      /* > 0: also usable at its multiples below min_reach (kvt_entry_trim_granule) */
    kvt__key *blocks;    /* (n_blocks) in chain order */
    int32_t n_blocks;
    uint64_t bytes;       /* entry file size */
    uint64_t *lbytes;     /* (n_lbytes) tensor bytes of each layer in the entry file, or NULL */
    int32_t n_lbytes;
    int64_t last_use_ms;  /* wall clock; file mtime at scan */
    struct st_entry *next, *prev;
} st_entry;

typedef struct st_orphan { /* refused or unreferenced files, evicted first */
    char name[256];
    uint64_t bytes;
} st_orphan;

/* One write-behind job, the task of one write operation of the I/O
 * worker. While queued or being written it is findable (in ptree and in
 * pjobs by its handle) and restorable from its own caches (zero-copy clones
 * whose hook holds a reference): the job's entry is cleared when the write
 * is done with it and the last clone is gone. */
typedef struct wjob {
    struct kvt_store *s;
    kvt_entry e;
    int64_t min_reach;    /* as st_entry's */
    int64_t granule;      /* as st_entry's */
    struct wjob *twin;    /* an older queued job with the same (ns, tokens):
                             the pending index holds only the newest */
    uint64_t bytes;
    uint64_t id;          /* handle; the durable entry gets the same one */
    kvt__key key;
    _Atomic int64_t refs; /* the queue's + one per clone handed out */
    int state;            /* KVT__WJOB_* */
} wjob;

enum {
    KVT__WJOB_SUBMITTING = 0, /* inside kvt_io_submit (its caller holds mu) */
    KVT__WJOB_COALESCED = 1,  /* joined an identical queued or running write */
    KVT__WJOB_QUEUED = 2      /* the worker owns it */
};

typedef struct kvt__store_pins kvt__store_pins;

struct kvt_store {
    char *root, *dir, *dir_name;
    int dirfd, lockfd;
    char *identity;       /* canonical identity JSON */
    kvt__key id_seed;    /* XXH3-128 of identity */
    kvt_store_options opts;

    pthread_mutex_t mu;
    kvt__kmap by_key, by_id, blocks, pending, pjobs;
    kvt__index *tree;     /* durable entries (st_entry) by (ns, tokens) */
    kvt__index *ptree;    /* jobs whose write-behind is queued or in flight (wjob) */
    st_entry *head;       /* all entries */
    uint64_t next_id;
    st_orphan *orphans;
    int32_t n_orphans, cap_orphans;
    uint64_t own_bytes, foreign_bytes;
    uint64_t foreign_scan_ms; /* last listing of the root (monotonic ms) */
    uint64_t disk_ms;     /* last reclaim pass over the own directory (monotonic ms) */
    int reclaim_due;      /* a reclaim could not take the lock: try again */
    kvt__key *free_keys; /* blocks this process stopped referencing, for reclaim */
    int32_t n_free, cap_free;
    pthread_mutex_t disk_mu; /* the on-disk entry cache (held by reclaim) */
    kvt__kmap disk;       /* entry key -> dent, entry files reclaim parsed */
    kvt_store_stats st;
    uint64_t *layer_bytes; /* (n_layer_bytes) tensor bytes of each layer over the indexed
                              files (each block file once): the per-layer residency */
    int32_t n_layer_bytes;
    struct kvt_pool_member *pool_member; /* the root's disk-axis membership (store_pool.c), NULL = none */
    uint64_t finds, find_hits; /* kvt_store_find calls, and those that found a prefix */
    uint64_t demoted;     /* budget evictions the eviction hook took */
    uint64_t behind_failed; /* write-behind jobs whose write failed (on the I/O worker) */
    uint64_t behind_dropped; /* write-behind jobs the I/O worker discarded unrun (it shut down) */

    /* the eviction hook (kvt_cold_tier.set_evict); reclaim calls it under evict_mu */
    pthread_mutex_t evict_mu;
    kvt_tier_evict_fn evict_fn;
    void *evict_arg;

    /* the I/O worker running write-behind, asynchronous restores and
     * shard hashes (opts.worker, or a reference on the process default) */
    kvt_io *worker;
    int worker_default;   /* worker is a reference on the default: released at close */
    kvt__key io_seed;     /* mixed into operation keys: this store's operations only coalesce with its own */

    /* write-behind (st.pending / pending_bytes count the jobs the worker holds) */
    pthread_cond_t idle_cv; /* a write ended, or an asynchronous restore's waiter was told */
    int closing;
    int flush_rc;
    char flush_msg[256]; /* kvt_last_error of that failure (the worker's thread) */
    uint64_t restores_live; /* asynchronous restore waiters not yet told */

    /* pins of single blocks live caches refer to (block_ref.c); NULL without a directory */
    kvt__store_pins *pins;
};


/* ---- shared helpers --------------------------------------------------------- */

/** Wall clock in ms (entry last use; file mtimes are wall clock). */
static inline int64_t kvt__store_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/** How the index sees an entry of reach min_reach (see kvt__index_insert). */
static inline int kvt__store_trimmable(int64_t n_tokens, int64_t min_reach, int64_t granule)
{
    return min_reach < n_tokens || n_tokens == 0 || granule > 0;
}

/** The by_id / pjobs key of a handle. */
static inline kvt__key kvt__store_id_key(uint64_t id) { return (kvt__key){id, 0x5eed}; }

/** A refusal of a shard: KVT_EIDENTITY for another identity's, else KVT_EFORMAT. */
static inline int kvt__store_refuse(int *reason, int r, const char *path, const char *what)
{
    return kvt__shard_refuse(reason, r, r == KVT_STORE_REFUSED_IDENTITY ? KVT_EIDENTITY : KVT_EFORMAT, path, what);
}

/** A shard's file name: type ('e' entry, 'b' block), 32 hex digits of its key, the suffix. */
void kvt__store_file_name(char type, kvt__key k, char out[64]);
/** A shard whose header names another key than its file name is refused
 * (malformed). @return 0 or KVT_EFORMAT with *reason. */
int kvt__store_check_name(char type, kvt__key k, const char *name, int *reason);

/* store.c, with mu held */
void kvt__store_entry_free(st_entry *e);
void kvt__store_orphan_add(kvt_store *s, const char *name, uint64_t bytes);
/** A file just written under a name a refused shard had: no longer an orphan. */
void kvt__store_orphan_forget(kvt_store *s, const char *name);
/** Indexes e (taken on success; e->id kept when set and free). @return 0, KVT_ENOMEM. */
int kvt__store_index_entry(kvt_store *s, st_entry *e);
/** One reference to block k goes; with none left and delete_file, reclaim may remove it. */
void kvt__store_block_unref(kvt_store *s, kvt__key k, int delete_file);
/** Removes e from the index; keep_file 0 deletes its file, 1 leaves it as an
 * orphan (a refused shard), 2 says it is already gone. Frees e. */
void kvt__store_drop_entry(kvt_store *s, st_entry *e, int keep_file);
/** Counts a refusal reason in the stats. */
void kvt__store_refuse_count(kvt_store *s, int reason);

/* ---- per-layer residency (store.c) ----
 * Each indexed file keeps the tensor bytes of each layer it holds (from the
 * tensors it was written with, or its header at scan); the store adds them
 * to its per-layer totals when the file is indexed and subtracts them when
 * it leaves the index. Header bytes belong to no layer. */
#define KVT__STORE_LAYERS_MAX 4096 /* layer indices at or past this are not counted */
/** Per-layer bytes of tensors t[0..n) ("L<layer>.<name>"; other names count
 * for no layer): *out a new vector (kvt__free) of *n_out, NULL when no
 * tensor is a layer's. No lock needed. @return 0, KVT_ENOMEM. */
int kvt__store_lbytes_out(const kvt__st_out *t, int32_t n, uint64_t **out, int32_t *n_out);
/** The same from a validated header's tensors. */
int kvt__store_lbytes_shard(const kvt__shard *sh, uint64_t **out, int32_t *n_out);
/** Adds (sign > 0) or subtracts a file's vector to the totals (mu held). */
void kvt__store_lbytes_account(kvt_store *s, const uint64_t *v, int32_t n, int sign);
/** Subtracts an unindexed block's bytes from the totals and frees it (mu held). */
void kvt__store_block_forget(kvt_store *s, st_block *b);

/* scan.c: the one directory walker */
/** A walker's callback: one directory entry (not "." or ".."), its lstat.
 * A nonzero return stops the walk and is what the walk returns. */
typedef int (*kvt__dir_fn)(void *ctx, const char *name, const struct stat *st);
/** Calls fn for every entry of the directory dirfd that can still be
 * stat'ed, without following links, in readdir order; fn may unlink the
 * entry it is given. @return 0, fn's nonzero value, or -errno when the
 * directory cannot be listed. */
int kvt__dir_walk(int dirfd, kvt__dir_fn fn, void *ctx);
/** An identity directory under a root, as kvt__root_walk reports it. */
typedef struct kvt__id_dir {
    const char *name;   /* 32 hex digits */
    char path[4096];    /* root/name */
    int dirfd;          /* open (O_NOFOLLOW), closed after the callback; -1 for a link */
    struct stat lst;    /* lstat of path */
} kvt__id_dir;
typedef int (*kvt__root_fn)(void *ctx, const kvt__id_dir *d);
/** Calls fn for every entry of root named like an identity directory
 * (except skip, when not NULL) that is a directory or a symbolic link
 * (reported with dirfd -1, never followed). @return 0, fn's nonzero value,
 * or -errno when root cannot be listed. */
int kvt__root_walk(const char *root, const char *skip, kvt__root_fn fn, void *ctx);
/** ".lock", "IDENTITY", ".budget.lock": a store's bookkeeping files, never shards. */
int kvt__store_is_meta_file(const char *name);
/** A temp file (written, not yet renamed). */
int kvt__store_is_tmp_name(const char *name);
int kvt__store_is_identity_dir(const char *name);
/** e<32 hex>.safetensors or b<32 hex>.safetensors */
int kvt__store_is_shard_name(const char *name);
/** Whether a temp file's writer (the pid in its name) is alive. */
int kvt__store_pid_alive(const char *tmpname);
/** The first 8 KiB of a small file in dirfd, trailing newlines cut; caller
 * frees with kvt__free; NULL when it cannot be read. */
char *kvt__store_read_small(int dirfd, const char *name);
/** Rebuilds the index from the directory (headers only). @return 0, -errno, KVT_ENOMEM. */
int kvt__store_scan(kvt_store *s);
/** Counts shards of directories holding the same model id under another config. */
void kvt__store_count_other_configs(kvt_store *s, const kvt_store_identity *id);

/* put.c */
/** Writes e durably and indexes it (handle want_id when nonzero). */
int kvt__store_write(kvt_store *s, const kvt_entry *e, uint64_t want_id);
/** Validates a caller's entry (fn names the call). @return 0 or KVT_EINVAL. */
int kvt__store_check_entry(const kvt_entry *e, const char *fn);
/** A write to a read-only store: refused (-EROFS) and counted. */
int kvt__store_refuse_write(kvt_store *s, const char *fn);

/** The I/O-worker key of an operation of this store on content key k. */
static inline kvt_io_key kvt__store_io_key(const kvt_store *s, kvt__key k)
{
    return (kvt_io_key){k.lo ^ s->io_seed.lo, k.hi ^ s->io_seed.hi};
}

/* writer.c */
/** Takes the store's I/O worker (opts.worker, else a reference on the
 * process default) at open. @return 0 or kvt_io_default_acquire's error. */
int kvt__store_worker_open(kvt_store *s);
/** At close: flushes, refuses new work, waits until the worker holds no
 * write or restore waiter of the store. @return the flush's result. */
int kvt__store_worker_close(kvt_store *s);
/** Drops one reference to a job; the last clears its entry and frees it. */
void kvt__store_job_release(wjob *j);
/** The release hook of a clone of a job's entry (ctx: the job). */
void kvt__store_job_hook(void *ctx);

/* restore.c */

/** Opens, validates and reads a block shard (checked payload). */
int kvt__store_load_block(int dirfd, const char *dir, const char *name, const char *identity, int strict,
                          kvt__rshard *out, kvt__pblock *pb, int *reason);
/** Everything a restore checks and builds, from the files (see restore.c). */
int kvt__store_load_entry(int dirfd, const char *dir, const char *name, const char *identity,
                          const int32_t *want_tok, int64_t want_n, int strict, kvt_entry *out, int *reason,
                          char *bad_shard, uint64_t *bytes);
/** kvt__store_load_entry, then (pins not NULL) kvt__store_tag_blocks on the
 * restored entry: what a restore hands to a caller that may page its blocks. */
int kvt__store_load_entry_tagged(kvt__store_pins *pins, int dirfd, const char *dir, const char *name,
                                 const char *identity, const int32_t *want_tok, int64_t want_n, int strict,
                                 kvt_entry *out, int *reason, char *bad_shard, uint64_t *bytes);

/* block_ref.c: single kv blocks referred to by live caches (internal.h's buffer origins) */
/** The pin table of the identity directory dirfd (one per directory in
 * the process: an existing one is shared, else a new one duplicates
 * dirfd); *out NULL when dirfd < 0. @return 0, -errno, KVT_ENOMEM. */
int kvt__store_pins_create(int dirfd, kvt__store_pins **out);
/** The store lets go of its table (at close): the table lives while other
 * stores or origins refer to it, and pins still held keep the directory's
 * shared flock. */
void kvt__store_pins_close(kvt__store_pins *p);
/** Calls fn(key, pins) for every pinned block, under the table's lock (fn
 * must not call back into it). No-op for NULL. */
void kvt__store_pins_add_refs(kvt__store_pins *p, void (*fn)(kvt__key k, uint64_t n, void *ctx), void *ctx);
/** Gives every buffer of e's kv caches that lies in the payload of block
 * shard blk[i] (key keys[i]) an origin: that tensor of that file
 * (kvt__buf_set_origin), so a live cache can page it out by reference. No
 * origin (out of memory) only means the block is written as before. */
void kvt__store_tag_blocks(kvt__store_pins *pins, kvt_entry *e, const kvt__rshard *blk, const kvt__key *keys,
                           int32_t n_blocks);

/** After a put made its entry durable: gives the whole kv block buffers
 * of the entry's caches in its chain blocks the origin of their tensor
 * (its offset from the shard's header), as a restore does: blocks it wrote
 * itself (written[c]: their file bytes are these buffers' bytes), and
 * blocks that were there already whose payload's XXH3-128 is that of
 * these buffers' bytes (another computation of the same prefix may have
 * stored other bytes under the same key: then no origin). */
void kvt__store_tag_written(kvt_store *s, const kvt__enc *enc, const int8_t *written);

/* budget.c */
/** Frees unreferenced blocks and applies the budget over the root (call
 * without mu); protect: an entry key never evicted by this pass; wait:
 * block until the budget lock is free. */
void kvt__store_reclaim(kvt_store *s, kvt__key protect, int wait);
/** The shared budget lock a put holds while it relies on existing blocks;
 * -1 when it cannot be taken (the put goes on unprotected). */
int kvt__store_put_lock(kvt_store *s);
/** Bytes of the identity directories under root other than skip. @return 0 or an error. */
int kvt__store_foreign_bytes(const char *root, const char *skip, uint64_t *bytes);

/* Joins opts.pool (store_pool.c): the root's byte budget is reserved and
 * published on the pool's disk axis. 0 without a pool; the pool's refusal
 * (KVT_EAGAIN, KVT_ELIMIT, naming the axis), KVT_EINVAL (no budget under a
 * disk-limited pool), KVT_EBUSY (the member name is joined), KVT_ENOMEM. */
int kvt__store_pool_join(kvt_store *s);
/* Leaves the pool (the budget goes back); no-op without one. */
void kvt__store_pool_leave(kvt_store *s);
/** Frees the cache of parsed entry files (store close). */
void kvt__store_disk_free(kvt_store *s);

#endif
