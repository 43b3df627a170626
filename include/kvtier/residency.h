/*
 * kvtier/residency.h: bounded live-cache residency. A running request keeps
 * only a bounded number of its full immutable kv blocks in RAM; the others
 * are paged out to a page file once and paged back in, checksummed, while
 * attention reads them.
 *
 * A kvt_residency is one request's policy (the bound, in blocks or bytes),
 * its page file and its counters. The request attaches the kv cache of each
 * attention layer (kvt_kv_set_residency); from then on every append that
 * completes a block checks the bound, and the oldest full blocks beyond it
 * are written to the page file through a kvt_io worker and their RAM
 * released once the write completed (a block being written stays readable
 * from RAM: a pending write is not a copy). The mutable tail block is never
 * paged. A "qkvc" cache (kvt_qkvc_create_dtype: blocks sealed in U8, F16 or
 * BF16, the open block in f32) is paged the same way: its sealed blocks are
 * its full blocks (K rows, then V rows, of the sealed dtype); its f32 open
 * block and a U8 cache's per-block scales (4 x kv_dim floats) stay in RAM.
 * Every call below that takes "a kv cache" takes a qkvc cache too.
 * Attention walks a cache's blocks through a window
 * (kvt_kv_window_open/get/put/close: a bounded number of blocks staged at a
 * time, read ahead in the walk's order and into the next layer), or makes
 * all of them readable at once with kvt_kv_pin (waiting for the reads it
 * needs, counting the stall, and starting the reads of the next layer's
 * blocks) and gives the staged copies back with kvt_kv_unpin.
 *
 * Each block of an attached (or cloned) cache follows one state machine,
 * kvt_block_transition (docs/residency.md draws it):
 *
 *   RESIDENT          in RAM only (fresh, or shared with another holder)
 *   WRITING           in RAM, its page-file write in flight
 *   DURABLE_RESIDENT  in the page file and in RAM (written, or paged in)
 *   DURABLE           in the page file only: RAM released
 *   RESTORING         in the page file, a read in flight
 *   FAILED            its write failed: stays in RAM for good (counted)
 *
 * Rules: a block is written at most once (paged in and out again it is not
 * rewritten), and not at all when the SSD tier holds it durably (a block
 * restored from the store's block shards): then it is paged out by
 * reference to that copy, pinned in the store against its budget eviction
 * and gc while the page exists, and paged in from it with the same checksum
 * check (a pin that cannot be taken: written to the page file as usual); a block whose buffer another holder shares (a prompt-cache
 * entry, another request) is never paged by this request (its RAM is the
 * other holder's; the bound counts the blocks this request alone holds);
 * a failed read or a checksum mismatch (XXH3-128 of every block, checked
 * before any byte is used) is an error of the request, never a wrong token.
 *
 * Lifetime: a kvt_residency is reference counted. kvt_residency_create
 * returns one reference; every attached cache, every block with a page-file
 * copy (also in clones) and every operation in flight holds one; the page
 * file is closed (its space freed: it is unlinked at creation) with the
 * last reference (which also drops the default I/O worker's reference, when
 * the residency took one).
 *
 * Thread-safety: the calls on one residency are thread-safe. A kv cache is
 * used by one thread at a time (kvtier/cache.h): kvt_kv_pin, kvt_kv_unpin and
 * the appends of the caches attached to one residency run on one thread at
 * a time (the request's engine thread).
 */
#ifndef KVTIER_RESIDENCY_H
#define KVTIER_RESIDENCY_H

#include "kvtier/cache.h"
#include "kvtier/common.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* the I/O worker (kvtier/io.h) */
typedef struct kvt_io kvt_io;

/* ---- the block state machine ---------------------------------------------- */

/** Physical state of one kv block of a cache under a residency policy. */
typedef enum kvt_block_state {
    KVT_BLOCK_RESIDENT = 0,         /**< in RAM only */
    KVT_BLOCK_WRITING = 1,          /**< in RAM; page-file write in flight */
    KVT_BLOCK_DURABLE_RESIDENT = 2, /**< in the page file and in RAM */
    KVT_BLOCK_DURABLE = 3,          /**< in the page file only */
    KVT_BLOCK_RESTORING = 4,        /**< in the page file; read in flight */
    KVT_BLOCK_FAILED = 5,           /**< write failed; in RAM for good */
    KVT_BLOCK_STATES = 6            /**< number of states, not a state */
} kvt_block_state;

/** What happens to a block (the edges of the state machine). */
typedef enum kvt_block_event {
    KVT_BLOCK_EV_WRITE = 0,        /**< RESIDENT -> WRITING: write submitted */
    KVT_BLOCK_EV_WRITTEN = 1,      /**< WRITING -> DURABLE_RESIDENT: write completed */
    KVT_BLOCK_EV_WRITE_FAILED = 2, /**< WRITING -> FAILED */
    KVT_BLOCK_EV_EVICT = 3,        /**< DURABLE_RESIDENT -> DURABLE: RAM released */
    KVT_BLOCK_EV_READ = 4,         /**< DURABLE -> RESTORING: read submitted */
    KVT_BLOCK_EV_READ_DONE = 5,    /**< RESTORING -> DURABLE_RESIDENT: read and checksum ok */
    KVT_BLOCK_EV_READ_FAILED = 6,  /**< RESTORING -> DURABLE: the read failed (an error of the reader) */
    KVT_BLOCK_EVENTS = 7           /**< number of events, not an event */
} kvt_block_event;

/** Applies `ev` to the state `*s`: the one function every block state change
 * goes through. @return 0 (then *s is the new state) or KVT_EINVAL naming
 * the state and the event when the edge does not exist (*s unchanged).
 * Thread-safe (on distinct states). */
KVT_API int kvt_block_transition(kvt_block_state *s, kvt_block_event ev);

/** The name of a state ("resident", "writing", "durable+resident",
 * "durable", "restoring", "failed"), NULL for a value out of range.
 * Static storage. Thread-safe. */
KVT_API const char *kvt_block_state_name(kvt_block_state s);

/* ---- the residency policy of one request ---------------------------------- */

/** Options of kvt_residency_create. Zero fields take the default. */
typedef struct kvt_residency_options {
    int64_t max_blocks;  /**< full blocks kept in RAM over all attached caches; 0 = no block bound */
    uint64_t max_bytes;  /**< bytes of full blocks kept in RAM; 0 = no byte bound (both 0: fully resident) */
    const char *dir;     /**< directory of the page file (copied); NULL: $TMPDIR, else /tmp */
    kvt_io *io;          /**< borrowed worker the page reads and writes run on, must outlive the
                              residency; NULL: the process's default worker (kvt_io_default_acquire) */
    int32_t read_ahead;  /**< blocks of the next layer read while a layer attends (default 32; < 0: none);
                              through a window at most `window` of them */
    int32_t window;      /**< blocks of one cache an attention window (kvt_kv_window_open) holds in
                              RAM at most, staged and being read ahead together (default 8; at least 2) */
    int drop_page_cache; /**< 1: drop the page file's pages from the OS page cache after each write
                              (after an fdatasync) and each read (posix_fadvise DONTNEED), so every
                              page-in reads the disk (benchmarks) */
    int32_t write_slack; /**< full blocks one attached cache may keep in RAM past its share while their
                              page-file writes are in flight, before a bound check waits for the oldest
                              write (default 4; < 0: none, the strict bound: a bound check waits for the
                              write of every block past the share, so RAM never holds more full private
                              blocks than the share and the next attention over them pages them in) */
} kvt_residency_options;

/** Counters of one residency (since creation, except the gauges).
 * X(name, doc) lists them in order. */
#define KVT_RESIDENCY_STATS(X)                                                     \
    X(blocks_out, "blocks written to the page file")                               \
    X(bytes_out, "bytes written to the page file")                                 \
    X(blocks_ref, "blocks paged out by reference to their SSD-tier copy (unwritten)") \
    X(bytes_ref, "bytes of those blocks")                                          \
    X(blocks_in, "page-ins: reads of a block, or of the K or V half a window pass uses") \
    X(bytes_in, "bytes read back from the page file (or the SSD-tier copy)")       \
    X(readahead_hits, "blocks attention found read ahead (complete or in flight)") \
    X(stall_ns, "ns attention waited for blocks being read")                       \
    X(write_failures, "blocks whose write failed (they stay in RAM)")              \
    X(read_failures, "reads that failed or did not match their checksum")          \
    X(evictions, "times a written block's RAM was released")                       \
    X(resident_blocks, "gauge: full private blocks in RAM of the attached caches") \
    X(resident_bytes, "gauge: their bytes")                                        \
    X(peak_resident_bytes, "high-water mark of resident_bytes")                    \
    X(staged_bytes, "gauge: bytes of blocks paged in for attention")               \
    X(peak_staged_bytes, "high-water mark of staged_bytes (read-ahead included)")

typedef struct kvt_residency_stats {
#define KVT__RES_FIELD(name, doc) uint64_t name;
    KVT_RESIDENCY_STATS(KVT__RES_FIELD)
#undef KVT__RES_FIELD
} kvt_residency_stats;

typedef struct kvt_residency kvt_residency;

/** Creates a residency policy with its page file (created in opt->dir and
 * unlinked at once: nothing is left on disk after a crash).
 * @param opt NULL or the options (borrowed during the call).
 * @param out receives the residency (one reference); released by
 *   kvt_residency_release. NULL on error.
 * @return 0; KVT_EINVAL (out NULL, max_blocks or window < 0); KVT_ENOMEM; -errno when
 *   the page file cannot be created (the message names the directory). */
KVT_API int kvt_residency_create(const kvt_residency_options *opt, kvt_residency **out);

/** Retains r (returns it). NULL gives NULL. Thread-safe. */
KVT_API kvt_residency *kvt_residency_retain(kvt_residency *r);

/** Releases one reference; the last one (after every attached cache, paged
 * block and operation let go) waits for nothing more, closes the page file
 * and frees r and, when r started it, its I/O worker. NULL is a no-op.
 * Thread-safe. */
KVT_API void kvt_residency_release(kvt_residency *r);

/** Whether r bounds anything (max_blocks or max_bytes set). 0 for NULL. */
KVT_API int kvt_residency_bounded(const kvt_residency *r);

/** The bound in bytes of full blocks for caches whose blocks are
 * block_bytes each: max_bytes, or max_blocks * block_bytes, the smaller
 * when both are set; UINT64_MAX when unbounded or r is NULL. Admission
 * charges this (plus the tails) for a bounded request instead of its whole
 * context. Thread-safe. */
KVT_API uint64_t kvt_residency_bound_bytes(const kvt_residency *r, uint64_t block_bytes);

/** A snapshot of r's counters. @return 0 or KVT_EINVAL (a NULL argument).
 * Thread-safe. */
KVT_API int kvt_residency_stats_get(const kvt_residency *r, kvt_residency_stats *out);

/* ---- kv caches under a policy --------------------------------------------- */

/** Attaches a kv cache to r as attention layer `layer` (0-based: the order
 * kvt_kv_pin reads ahead in), or detaches it (r NULL). An attached cache
 * pages its full private blocks out when r's bound is passed; its bound
 * share is max_blocks (or max_bytes / block bytes) divided by the number of
 * attached caches. The cache retains r; it is detached when disposed.
 * Blocks already paged stay readable after a detach (they hold r).
 * Checks the bound at once (blocks already held may be paged out).
 * @return 0; KVT_EINVAL (c not a kv or qkvc cache, layer outside [0, 4096), or
 *   another cache already attached as that layer); KVT_ENOMEM; an error of
 *   the write path (a failed write is not an error: counted, block kept). */
KVT_API int kvt_kv_set_residency(kvt_cache *c, kvt_residency *r, int32_t layer);

/** Makes blocks [0, ceil(n_tokens / B)) of a kv cache readable by
 * kvt_kv_block_rows: waits for reads already in flight (read-ahead), reads
 * every other paged-out block (checksummed), counts the wait as stall time,
 * then starts read-ahead of the next attached layer's paged blocks.
 * A cache of another kind, or without paged-out blocks, returns 0 at once.
 * Pins do not nest: kvt_kv_unpin releases all staged blocks.
 * @return 0; KVT_EINVAL (c NULL); KVT_ERANGE (n_tokens outside
 *   [0, offset]); KVT_EIO (a read failed: the message names the block and
 *   the errno); KVT_ECORRUPT (a block did not match its checksum);
 *   KVT_ENOMEM. On error the blocks read so far stay staged (kvt_kv_unpin
 *   releases them). */
KVT_API int kvt_kv_pin(kvt_cache *c, int64_t n_tokens);

/** Releases the RAM of every block kvt_kv_pin paged in (they are durable:
 * nothing is written). No-op for a cache of another kind, one without
 * residency, or NULL. */
KVT_API void kvt_kv_unpin(kvt_cache *c);

/** Opens attention through a window over blocks [0, nb) of a kv cache,
 * nb = ceil(n_tokens / B): the caller walks them `passes` times in block
 * order (e.g. the K blocks for the scores, then the V blocks for the values)
 * taking each with kvt_kv_window_get and giving it back with
 * kvt_kv_window_put, then calls kvt_kv_window_close. A paged-out block is
 * read (checksummed) when taken unless read ahead; read-ahead follows the
 * walk (into the next pass), and this cache's staged blocks and reads in
 * flight are never more than the window (kvt_residency_options.window), so
 * attention over a paged cache holds the bound plus one window, not a
 * layer's share of the context.
 * @return the window (> 0 blocks): a window is open; 0 when blocks [0, nb)
 *   are all in RAM (no window: read them with kvt_kv_block_rows; also for a
 *   cache of another kind); KVT_EINVAL (c NULL, passes < 1, a window already
 *   open on c); KVT_ERANGE (n_tokens outside [0, offset]). */
KVT_API int kvt_kv_window_open(kvt_cache *c, int64_t n_tokens, int32_t passes);

/** kvt_kv_window_open for a walk whose passes alternate K and V: even
 * passes (0, 2, ...) use only the K rows of each block (kvt_kv_rows.k),
 * odd passes only the V rows (.v), e.g. the scores of a group of heads,
 * then its values. A paged-out block is read only the half its pass uses
 * (each half checked against its own checksum), so one K-then-V walk reads
 * each paged byte once, not twice; in a block staged with one half, the
 * other half's pointer is NULL. When every paged-out block of the walk fits
 * the window, whole blocks are read instead and held from the K pass for
 * the V pass. Same returns and errors as kvt_kv_window_open. */
KVT_API int kvt_kv_window_open_halves(kvt_cache *c, int64_t n_tokens, int32_t passes);

/** Takes block `index` of an open window: the next block of the walk
 * (block position % nb). Waits for its read ahead or reads it now (the wait
 * is stall time), starts the reads of the next positions of the walk while
 * the window has room, and fills `out` as kvt_kv_block_rows does.
 * @return 0; KVT_EINVAL (no window open, out NULL, index not the next of the
 *   walk, or the walk is over); KVT_EIO (a read failed: the message names the
 *   block and the errno); KVT_ECORRUPT (checksum mismatch); KVT_ENOMEM. After
 *   an error, close the window. */
KVT_API int kvt_kv_window_get(kvt_cache *c, int64_t index, kvt_kv_rows *out);

/** Gives back block `index` taken by kvt_kv_window_get (its rows must not
 * be used afterwards): a paged-in copy is released unless the read-ahead
 * already passed its next use in the walk. No-op without an open window. */
KVT_API void kvt_kv_window_put(kvt_cache *c, int64_t index);

/** Closes the window: releases every staged block of the cache, then starts
 * the reads of the next attached layer's first paged blocks (at most
 * min(read_ahead, window)), so they load while this layer's other work runs.
 * No-op without an open window or for NULL. */
KVT_API void kvt_kv_window_close(kvt_cache *c);

/** Closes the window as kvt_kv_window_close does but starts no read-ahead
 * of the next layer: for a caller whose next walk is over this same cache
 * (the reference engine's rows of a pass crossing a block boundary of a
 * cache that seals its blocks attend block by block, a walk each). The
 * next layer's blocks read ahead meanwhile would stay staged beside this
 * cache's next window: two windows, not the one docs/residency.md (Costs)
 * promises. No-op without an open window or for NULL. Called on the
 * cache's one thread, as the window calls are (thread-safety above). */
KVT_API void kvt_kv_window_close_same(kvt_cache *c);

/** Makes every block of a kv cache a RAM block of its own again and lets
 * go of its page-file copies: paged-out blocks are read back (checksummed),
 * staged and written ones keep their RAM copy, and the cache is detached
 * from its residency. Afterwards the cache holds no reference on any page
 * file, so a cache that outlives its request (a published entry) does not
 * keep the request's page file, and its RAM is all in kvt_cache_bytes (the
 * RAM tier's budget charges it). A cache of another kind returns 0.
 * @return 0; KVT_EINVAL (c NULL, a window open on c); KVT_EIO, KVT_ECORRUPT
 *   (a read back failed: the blocks read so far are resident, the others
 *   still paged); KVT_ENOMEM. */
KVT_API int kvt_kv_make_resident(kvt_cache *c);

/** The state of block `index` of a kv cache (KVT_BLOCK_RESIDENT for a
 * cache without residency). @return 0, KVT_EINVAL, KVT_ERANGE. */
KVT_API int kvt_kv_block_state(const kvt_cache *c, int64_t index, kvt_block_state *out);

/** Waits for every page-file write of this cache's blocks in flight and
 * applies the completions (releasing the RAM of written blocks beyond the
 * bound). For tests and for a caller that wants the bound exact now.
 * @return 0, KVT_EINVAL. */
KVT_API int kvt_kv_residency_settle(kvt_cache *c);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_RESIDENCY_H */
