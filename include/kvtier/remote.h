/*
 * kvtier/remote.h: the remote tier on Redis. Hosts serving the same model
 * share prefixes through one Redis (a single node, or a Redis Cluster).
 *
 * Key layout (every key starts with the identity's prefix, so two models
 * never collide): "kvt:<32 hex of the identity seed>:" then
 *   b<32 hex>   one full kv block range of every layer, content addressed by
 *               the chained block key of the SSD tier (identity, ns, parent
 *               block key, block tokens): one self-describing record
 *   e<32 hex>   one entry by its entry key (identity, ns, all tokens): its
 *               layers' non-block state (tails, rings, recurrent state),
 *               attachments and the keys of its blocks; written only when
 *               the blocks alone cannot rebuild the entry (an untrimmable
 *               checkpoint, a partial tail, attachments, an object)
 *   k<32 hex>   the children of one chain node (a block key, or the root of
 *               a namespace): a hash whose fields name the blocks and
 *               entries that continue it and hold their tokens, so a lookup
 *               matches a prompt token by token inside the next block.
 *               Only a hint: what it names is validated when read
 *   layout      the identity's block size and whether its blocks alone
 *               rebuild a prefix (every layer is a blocked kind)
 * A record is one value written with one SET: a header (format version,
 * identity seed, its own key, parent key, ns, tokens, every layer's kind,
 * params, offsets and tensor names, dtypes and shapes), the payload, and an
 * XXH3-128 of both. Metadata and payload are never split over two keys.
 * Every GET is validated (identity, key, tokens, shapes, checksum) before a
 * byte is used; a record that fails is a counted miss and is deleted.
 *
 * Eviction has one authority: Redis (configure maxmemory and an allkeys
 * policy, e.g. allkeys-lru); an optional TTL is set on every write. Because
 * records are self-contained, an evicted key is simply a miss.
 *
 * Faults: every call is bounded by a timeout (lookups 50 ms by default);
 * after fail_threshold consecutive failures the tier is marked unhealthy and
 * skipped (finds miss at once, writes are dropped and counted) until a
 * background PING succeeds. A Redis that is down when the tier opens is a
 * warning, not an error: the tier starts unhealthy and retries with backoff.
 * A dead or slow Redis makes misses, never a wrong answer.
 *
 * Thread-safety: every function on one kvt_remote (and every operation of
 * its kvt_cold_tier table) may be called from any thread at any time, except
 * kvt_remote_close (no other call may be running or start).
 */
#ifndef KVTIER_REMOTE_H
#define KVTIER_REMOTE_H

#include "kvtier/common.h"
#include "kvtier/store.h"
#include "kvtier/tier.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Where Redis is, parsed from `redis://[user:password@]host:port[/db]`. */
typedef struct kvt_remote_url {
    char host[256];
    int port;           /* 1..65535; 6379 when the URL has none */
    int db;             /* 0..15 (SELECT); 0 when the URL has none */
    char user[128];     /* "" = no user (AUTH password only) */
    char password[256]; /* "" = no password */
} kvt_remote_url;

/** Parses `url` into *out (zeroed first). The scheme must be "redis://";
 * a password may be percent-encoded. The password is never printed: error
 * messages name the host only.
 * @return 0; KVT_EINVAL (NULL argument, another scheme, an empty or too long
 * host, user or password, a port outside 1..65535, a db outside 0..15,
 * trailing text). Thread-safe. */
KVT_API int kvt_remote_url_parse(const char *url, kvt_remote_url *out);

/** Options of kvt_remote_open. Zero-initialise, then set what you need. */
typedef struct kvt_remote_options {
    /** Non-zero: `url` names one node of a Redis Cluster (`--redis-cluster`):
     * the tier reads the slot map (CLUSTER SLOTS), routes every key to the
     * node of its slot (CRC16 of the key mod 16384) and follows MOVED and ASK
     * redirections. */
    int cluster;
    /** Password when the URL has none; NULL: the environment variable
     * KVTIER_REDIS_PASSWORD, if set. Borrowed for the call. */
    const char *password;
    /** Bound on one lookup (find, find_exact), in ms; 0 = 50. */
    int32_t lookup_timeout_ms;
    /** Bound on each socket read or write of a restore or store, in ms; 0 =
     * 2000 (a restore as a whole is bounded by restore_timeout_ms too). */
    int32_t io_timeout_ms;
    /** Bound on connecting, in ms; 0 = 200. */
    int32_t connect_timeout_ms;
    /** Consecutive failed calls that mark the tier unhealthy; 0 = 3. */
    int32_t fail_threshold;
    /** Seconds every written key lives (`--redis-ttl`); 0 = no TTL (Redis's
     * maxmemory policy alone evicts). */
    int64_t ttl_s;
    /** Write-behind queue bound in bytes of queued cache state; 0 = 256 MiB. */
    uint64_t queue_max_bytes;
    /** Write-behind queue bound in entries; 0 = 1024. */
    int32_t queue_max_entries;
    /** Non-zero: do not print the startup warning when Redis is down. */
    int quiet;
    /** Optional process-wide pool (kvtier/pool.h; borrowed, must outlive
     * the tier) the tier joins as `pool_name` (NULL: "remote:HOST:PORT";
     * borrowed for the call). Every write in flight (queued write-behind,
     * the one being sent, a synchronous store) holds its entry's bytes on
     * the pool's remote axis from the moment it is accepted until it ends;
     * a write that does not fit is refused (write-behind: a counted drop,
     * KVT_EAGAIN; store: the pool's KVT_EAGAIN or KVT_ELIMIT), the message
     * naming the axis "remote", the bytes asked and free. NULL: no pool. */
    struct kvt_pool *pool;
    const char *pool_name;
    /** Bound on a whole restore, in ms, from its start to its last byte
     * (every round trip, connect and read of it, whatever io_timeout_ms
     * allows each one); 0 = 1000. A restore that cannot finish in time fails
     * with KVT_EIO, counted as a timeout, and the caller prefills instead.
     * The default is what loopback Redis moves under load in that time
     * (0.1-0.4 GB/s measured: 100-400 MB, the state of 1,400-5,400 tokens of
     * the 342 MB default model, of whole contexts of small ones), while
     * prefilling 1,400 tokens of that model takes about 40 s on the CPU
     * engine; raise it for larger states or slower links. */
    int32_t restore_timeout_ms;
    /** The I/O worker (kvtier/io.h) that runs the write-behind sets and the
     * asynchronous restores (restore_async of the cold-tier table, e.g. a
     * prefetch); borrowed: it must outlive the tier. NULL: the process's
     * default worker, a reference taken at open and dropped at close. */
    struct kvt_io *worker;
} kvt_remote_options;

/** The remote tier's counters, one list: X(name, kind, help). */
#define KVT_REMOTE_COUNTERS(X)                                                                   \
    X(lookups, counter, "finds and find_exacts asked of Redis")                                 \
    X(lookup_hits, counter, "lookups that reported a usable prefix")                            \
    X(hit_tokens, counter, "prompt tokens the hits covered")                                    \
    X(lookups_skipped, counter, "lookups answered as a miss because the tier was unhealthy")    \
    X(restores, counter, "entries restored")                                                    \
    X(restore_failures, counter, "restores that failed (missing, bad or unreachable records)")  \
    X(restore_partial, counter, "restores refused because a record was gone since the lookup")  \
    X(restored_bytes, counter, "record bytes read by restores")                                 \
    X(restore_ms, counter, "milliseconds spent in restores")                                    \
    X(writes, counter, "entries written (store or write-behind) that added a record")           \
    X(write_records, counter, "records written with SET")                                       \
    X(write_bytes, counter, "record bytes written")                                             \
    X(writes_skipped, counter, "blocks not sent because Redis already held them")               \
    X(write_failures, counter, "writes that failed")                                            \
    X(dropped, counter, "write-behind entries dropped (queue full or tier unhealthy)")          \
    X(bad_records, counter, "records refused by validation (and deleted)")                      \
    X(failures_timeout, counter, "calls that timed out")                                        \
    X(failures_conn, counter, "calls that failed to connect or lost the connection")            \
    X(failures_reply, counter, "calls that got an error reply")                                 \
    X(unhealthy_transitions, counter, "times the tier was marked unhealthy")                    \
    X(round_trips, counter, "pipelined round trips to a node")                                  \
    X(redirects, counter, "MOVED and ASK redirections followed")                                \
    X(healthy, gauge, "1 while the tier is used, 0 while it is skipped")                        \
    X(queued_entries, gauge, "write-behind entries queued or being written")                    \
    X(queued_bytes, gauge, "bytes of cache state in the write-behind queue")                    \
    X(nodes, gauge, "Redis nodes known (1 for a single node)")                                \
    X(slots_covered, gauge, "hash slots (of 16384) the cluster's slot map gives a node (all for a single node)")

/** Counters of one remote tier (see KVT_REMOTE_COUNTERS); all uint64. */
typedef struct kvt_remote_stats {
#define KVT__REMOTE_FIELD(name, kind, help) uint64_t name;
    KVT_REMOTE_COUNTERS(KVT__REMOTE_FIELD)
#undef KVT__REMOTE_FIELD
} kvt_remote_stats;

typedef struct kvt_remote kvt_remote;

/** Opens the remote tier of `identity` on the Redis at `url` (see
 * kvt_remote_url_parse). Connects once, bounded by connect_timeout_ms; a
 * Redis that cannot be reached is not an error: the tier opens unhealthy,
 * warns on stderr (unless opts->quiet; the message names host and port,
 * never the password) and retries in the background with backoff.
 * @param identity the same identity as the SSD tier's (borrowed for the
 *        call): the records of another identity are never served.
 * @param opts NULL for the defaults; borrowed for the call.
 * @param out receives the tier; released by kvt_remote_close.
 * @return 0; KVT_EINVAL (NULL url, identity or out, a bad URL, identity
 * strings NULL or over 1024 bytes, negative options); KVT_ENOMEM; -errno (a
 * thread could not start). Thread-safe. */
KVT_API int kvt_remote_open(const char *url, const kvt_store_identity *identity, const kvt_remote_options *opts,
                            kvt_remote **out);

/** Writes what the write-behind queue holds (each write bounded by
 * io_timeout_ms; an unhealthy tier drops it, counted), stops the threads,
 * closes the connections and frees the tier. NULL is a no-op.
 * @return 0, or the first write error of the final drain. */
KVT_API int kvt_remote_close(kvt_remote *r);

/** Fills *out with the tier's kvt_cold_tier table (self = r, borrowed until
 * kvt_remote_close). Operations: find and find_exact (one or two pipelined
 * round trips per node, bounded by lookup_timeout_ms; they do network I/O,
 * so a chain should give this level a lookup budget), restore (pipelined
 * GETs of every record, validated; a record gone since the lookup makes it
 * fail with KVT_ENOTFOUND, a record that fails validation with
 * KVT_ECORRUPT: never a shortened or wrong entry), store (blocks Redis holds
 * already are not sent again), spill / pending / withdraw / flush (the
 * write-behind queue, drained on the process's I/O worker) and stats. restore_async and
 * set_evict are NULL: Redis evicts on its own. Handles name the last 256
 * lookups; an older handle is KVT_ENOTFOUND. */
KVT_API void kvt_remote_cold_tier(kvt_remote *r, kvt_cold_tier *out);

/** Fills *out with the counters. Never blocks on I/O.
 * @return 0; KVT_EINVAL (NULL argument). Thread-safe. */
KVT_API int kvt_remote_stats_get(kvt_remote *r, kvt_remote_stats *out);

/** Bytes by layer this tier wrote to Redis: bytes[i] receives the tensor
 * bytes of layer i in every record a SET of this process wrote and Redis
 * accepted since the tier opened (blocks Redis already held are not sent,
 * so not counted). This is not what Redis holds: Redis is the eviction
 * authority (maxmemory, TTL) and evicts without telling any host, and other
 * hosts write too, so per-layer residency in Redis cannot be known here.
 * The cold-tier table's layer_bytes gives the same figures as
 * KVT_LAYER_BYTES_WRITTEN. Never blocks on I/O.
 * @param bytes (n_layers) written whole (0 past the layers written).
 * @return 0; KVT_EINVAL (r NULL, n_layers < 0, bytes NULL with n_layers > 0).
 * Thread-safe. */
KVT_API int kvt_remote_layer_written_bytes(kvt_remote *r, int32_t n_layers, uint64_t *bytes);

/** The counters *s (from kvt_remote_stats_get) as one JSON object, {every
 * KVT_REMOTE_COUNTERS name: n}, compact, keys in list order.
 * @param out receives the string; caller frees with kvt_string_free.
 * @return 0; KVT_EINVAL (NULL argument); KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_remote_stats_json(const kvt_remote_stats *s, char **out);

/** Whether the tier is in use (1) or skipped after failures (0). Thread-safe. */
KVT_API int kvt_remote_healthy(kvt_remote *r);

/** The names, kinds and help texts of KVT_REMOTE_COUNTERS, in order, for a
 * report or Prometheus lines: fills up to `cap` entries of the three arrays
 * (any may be NULL) and returns how many counters there are. Thread-safe. */
KVT_API int kvt_remote_stats_names(const char **names, const char **kinds, const char **help, int cap);

/** The key prefix of `identity` ("kvt:<32 hex>:"), into out (cap bytes; 38
 * suffice). @return 0; KVT_EINVAL (NULL argument, cap too small, identity
 * strings NULL or over 1024 bytes). Thread-safe. */
KVT_API int kvt_remote_key_prefix(const kvt_store_identity *identity, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_REMOTE_H */
