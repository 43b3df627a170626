/*
 * remote_internal.h: the pieces of the remote tier (kvtier/remote.h) shared
 * by its files: the record codec (record.c), the connections, pipelines and
 * cluster routing (conn.c), the tier's state and the helpers its lookup,
 * restore, store and write-behind files share. Internal; never installed.
 */
#ifndef KVTIER_REMOTE_INTERNAL_H
#define KVTIER_REMOTE_INTERNAL_H

#include "internal.h"
#include "key.h"
#include "kvtier/cache.h"
#include "kvtier/io.h"
#include "kvtier/remote.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* ---- records (record.c) ----------------------------------------------------------
 *
 * Layout, little-endian, every offset from the start of the value:
 *   0    "KVTR"  magic
 *   4    u16     format version (KVT__REC_VERSION)
 *   6    u8      type: 'b' block, 'e' entry
 *   7    u8      flags (KVT__REC_TRIMMABLE)
 *   8    u32     header bytes H (a multiple of 64; the payload starts there)
 *   12   u32     0
 *   16   16 B    identity seed (lo, hi)
 *   32   16 B    the record's own key
 *   48   16 B    parent key (block: the previous block's key, or zero)
 *   64   u64     payload bytes P
 *   72   i64     tok_begin (block: first token's position; entry: 0)
 *   80   i64     n_tokens
 *   88   u32 ns bytes, u32 layers, u32 attachments, u32 block keys
 *   104  ns (padded to 8), tokens (int32, padded to 8), block keys (16 B each),
 *        per layer: kind[32], i64 offset, i64 min_offset, u32 n_params,
 *          u32 n_tensors, i64 params[8], then per tensor: name[64], u32 dtype,
 *          u32 ndim, i64 shape[4], u64 bytes, u64 payload offset
 *        per attachment: name[64], u64 bytes, u64 payload offset
 *        zero padding to H
 *   H    payload: every tensor and attachment at a 64-byte aligned offset
 *   H+P  XXH3-128 (lo, hi) of bytes [0, H + P)
 */
#define KVT__REC_VERSION 1
#define KVT__REC_TRIMMABLE 1u   /* entry: serves any length from its chained blocks' end to its tokens (no
                                   attachment; every layer reaches that end: kv from 0, qkvc from its
                                   sealed blocks) */
#define KVT__REC_STANDALONE 2u  /* block: blocks alone rebuild a prefix of this identity */
#define KVT__REC_MAX_LAYERS 4096
#define KVT__REC_MAX_TENSORS (1 << 20)

/** One layer of a record: its state description and tensors. On encode the
 * tensors are borrowed (data read during the call); on parse they point into
 * the parsed value (owner NULL). */
typedef struct kvt__rec_layer {
    char kind[32];
    int64_t offset, min_offset;
    int32_t n_params;
    int64_t params[KVT_CACHE_PARAMS_MAX];
    int32_t n_tensors;
    kvt_tensor *tensors;  /* (n_tensors) */
} kvt__rec_layer;

typedef struct kvt__rec_att {
    char name[KVT_TENSOR_NAME_MAX];
    const void *data;
    size_t bytes;
} kvt__rec_att;

/** A record's contents. kvt__rec_encode reads one; kvt__rec_parse fills one
 * whose pointers alias the parsed value (layers and atts arrays allocated,
 * released by kvt__rec_clear). */
typedef struct kvt__rec {
    char type;              /* 'b' or 'e' */
    uint8_t flags;
    kvt__key seed, key, parent;
    const char *ns;         /* parse: points into the value, ns_len bytes, not NUL-terminated */
    uint32_t ns_len;
    int64_t tok_begin;
    const int32_t *tokens;  /* (n_tokens) */
    int64_t n_tokens;
    const uint8_t *block_keys; /* (n_blocks * 16): lo, hi little-endian */
    int32_t n_blocks;
    kvt__rec_layer *layers; /* (n_layers) */
    int32_t n_layers;
    kvt__rec_att *atts;     /* (n_atts) */
    int32_t n_atts;
} kvt__rec;

/** Encodes *r into one value (kvt__malloc'd, caller frees with kvt__free).
 * @return 0; KVT_EINVAL (counts over the limits, a tensor name too long);
 * KVT_ENOMEM. Thread-safe. */
int kvt__rec_encode(const kvt__rec *r, void **out, size_t *out_bytes);

/** Parses and checks a value: bounds of every count and offset, the magic,
 * version, tensor sizes against dtype and shape, and the checksum. Does not
 * check what the value should be (identity, key, tokens): the caller does.
 * *out aliases buf (valid while buf is). @return 0; KVT_EFORMAT (malformed,
 * kvt_last_error says what); KVT_EUNSUPPORTED (another format version);
 * KVT_ECORRUPT (checksum mismatch); KVT_ENOMEM. Thread-safe. */
int kvt__rec_parse(const void *buf, size_t bytes, kvt__rec *out);

/** Frees what kvt__rec_parse allocated (not the value) and zeroes *r. */
void kvt__rec_clear(kvt__rec *r);

/** The i-th block key of a parsed record. */
kvt__key kvt__rec_block_key(const kvt__rec *r, int32_t i);

/* ---- connections and pipelines (conn.c) ------------------------------------------ */

typedef struct kvt__rconn kvt__rconn;

/** Connection settings. */
typedef struct kvt__rconn_cfg {
    kvt_remote_url url;
    int cluster;
    int32_t connect_timeout_ms;
    int32_t fail_threshold; /* consecutive failed calls that mark a node down */
} kvt__rconn_cfg;

/** What the connections counted (atomics; read with kvt__rconn_counters_get). */
typedef struct kvt__rconn_counters {
    _Atomic uint64_t timeouts, conn_failures, reply_failures, unhealthy_transitions, round_trips, redirects;
} kvt__rconn_counters;
typedef struct kvt__rconn_counters_snap {
    uint64_t timeouts, conn_failures, reply_failures, unhealthy_transitions, round_trips, redirects;
} kvt__rconn_counters_snap;

/** How a pipeline ended. */
typedef enum kvt__rfail {
    KVT__RF_NONE = 0,
    KVT__RF_TIMEOUT,
    KVT__RF_CONN,
    KVT__RF_REPLY,
    KVT__RF_DOWN /* the node is marked down: skipped without I/O */
} kvt__rfail;

/** One command of a pipeline: argv (borrowed until exec returns), the index
 * of the argument that is the key (routing in a cluster), and its reply
 * (a redisReply *, freed by kvt__rpipe_clear). */
typedef struct kvt__rcmd {
    int argc;
    const char *argv[8];
    size_t argvlen[8];
    int key_arg;
    void *reply;
} kvt__rcmd;

typedef struct kvt__rpipe {
    kvt__rcmd *cmds;
    int32_t n, cap;
    /* monotonic ms by which exec gives up (0: none): each connect, read and
     * write is then bounded by what is left of it as well as by timeout_ms,
     * so the whole exec is, however slowly the bytes trickle in */
    int64_t deadline_ms;
    kvt__rfail fail;      /* the first failure of exec */
    uint64_t round_trips, redirects;
} kvt__rpipe;

/** Appends a command (argv borrowed until exec). @return 0 or KVT_ENOMEM. */
int kvt__rpipe_add(kvt__rpipe *p, int key_arg, int argc, const char *const *argv, const size_t *argvlen);
/** Frees the replies and the command array. */
void kvt__rpipe_clear(kvt__rpipe *p);

/** Opens the connection set (no I/O: connections are made on first use).
 * @return 0; KVT_ENOMEM. */
int kvt__rconn_create(const kvt__rconn_cfg *cfg, kvt__rconn **out);
void kvt__rconn_destroy(kvt__rconn *c);
/** Reads the cluster's slot map (no-op for a single node).
 * @return 0; KVT_EIO (unreachable or not a cluster). */
int kvt__rconn_refresh(kvt__rconn *c, int32_t timeout_ms, kvt__rfail *fail);
/** Nodes known (1 for a single node). */
int kvt__rconn_nodes(kvt__rconn *c);
/* Hash slots (of 16384) the slot map gives a node: all of them for a single
 * node; for a cluster, those the last CLUSTER SLOTS (and MOVED since) assigned. */
int kvt__rconn_slots_covered(kvt__rconn *c);
/** Marks every node down (Redis unreachable at startup): the health thread
 * pings them with backoff. */
void kvt__rconn_mark_down(kvt__rconn *c);
/** Nodes marked down now. */
int kvt__rconn_down(kvt__rconn *c);
/** Snapshot of the counters. */
void kvt__rconn_counters_get(kvt__rconn *c, kvt__rconn_counters_snap *out);

/** Sends every command of p to the node of its key (pipelined: one round
 * trip per node, every node written before any is read), each socket read
 * and write bounded by timeout_ms (and the whole exec by p->deadline_ms
 * when set; past it a command gets no reply, as on a timeout), follows MOVED/ASK (a few times at most),
 * and stores each reply. A connection that fails or times out is closed
 * (its pending replies are lost with it); the commands routed to it get no
 * reply (NULL) and p->fail says why.
 * @return 0 when every command got a reply (error replies included: check
 * each); KVT_EIO otherwise; KVT_ENOMEM. Thread-safe (connections are taken
 * from per-node pools). */
int kvt__rconn_exec(kvt__rconn *c, kvt__rpipe *p, int32_t timeout_ms);

/** CRC16 (XMODEM) key slot of Redis Cluster, honouring {hash tags}. */
unsigned kvt__redis_slot(const char *key, size_t len);

/* ---- the tier (redis.c: keys, layout, handles, stats, the tier table, open/close;
 * lookup.c; restore.c; store.c; writeback.c) ------------------------------------------ */

#define KVT__REMOTE_HANDLES 256 /* lookups whose handles stay valid */
#define KVT__REMOTE_KEY_MAX 96  /* bytes of a key name with its NUL */

/** A lookup's result, kept so restore fetches exactly what the lookup found. */
typedef struct kvt__rhandle {
    uint64_t id;      /* 0: empty */
    char *ns;
    int32_t *tokens;  /* (n_tokens): what the restored entry holds */
    int64_t n_tokens;
    kvt__key *keys;   /* (n_keys) block keys in chain order */
    int32_t n_keys;
    int is_entry;
    kvt__key ekey;
} kvt__rhandle;

/** One write-behind entry: the task of one write operation of the I/O
 * worker; in the live list (q_head) while queued or being written. */
typedef struct kvt__rjob {
    kvt_entry e;
    uint64_t bytes;
    struct kvt_pool_reservation *res; /* its bytes on the pool's remote axis, NULL = no pool */
    struct kvt_remote *r;
    int state; /* KVT__RJOB_* (under q_mu once queued) */
    struct kvt__rjob *next, *prev;
} kvt__rjob;

enum {
    KVT__RJOB_SUBMITTING = 0, /* inside kvt_io_submit (its caller holds q_mu) */
    KVT__RJOB_COALESCED = 1,  /* joined an identical queued or running write */
    KVT__RJOB_QUEUED = 2,
    KVT__RJOB_RUNNING = 3,
    KVT__RJOB_WITHDRAWN = 4   /* taken back while queued: its operation is a no-op */
};

/** The tier. mu guards layout, handles and stats; q_mu the write-behind queue. */
struct kvt_remote {
    struct kvt_pool_member *pool_member; /* remote_pool.c; NULL = no pool */
    kvt__rconn *conn;
    kvt__key seed;
    char prefix[48];
    size_t prefix_len;
    char host[300];  /* host:port for messages (never the password) */
    int32_t lookup_ms, io_ms, restore_ms;
    int64_t ttl_s;
    uint64_t queue_max_bytes;
    int32_t queue_max_entries;

    pthread_mutex_t mu; /* layout, handles, stats */
    int layout_known, layout_written;
    int32_t B;
    int standalone;
    kvt__rhandle ring[KVT__REMOTE_HANDLES];
    uint64_t next_id;
    kvt_remote_stats st;
    uint64_t entries, bytes; /* new entries and record bytes this tier wrote */
    uint64_t behind_failed, behind_dropped; /* queued writes that failed / were dropped unsent; under mu */
    uint64_t *layer_written; /* (n_layer_written) tensor bytes of each layer in the records this
                                tier wrote that Redis accepted; under mu */
    int32_t n_layer_written;

    /* write-behind and asynchronous restores, on the I/O worker (q_mu) */
    kvt_io *worker;         /* opts.worker, or a reference on the process default */
    int worker_default;
    kvt__key io_seed;       /* mixed into operation keys: only this tier's operations coalesce */
    pthread_mutex_t q_mu;
    pthread_cond_t idle_cv; /* a job or a restore waiter ended */
    kvt__rjob *q_head, *q_tail; /* live jobs: queued or being written */
    int32_t q_n;            /* live jobs */
    uint64_t q_bytes;       /* their bytes */
    uint64_t ops_live;      /* jobs the worker still holds (withdrawn ones too) */
    uint64_t restores_live; /* asynchronous restore waiters not yet told */
    int closing;
    int flush_rc;
};

/** Adds n to the stats field of r under r->mu. */
#define KVT__REMOTE_BUMP(r, field, n)                                                                           \
    do {                                                                                                        \
        pthread_mutex_lock(&(r)->mu);                                                                           \
        (r)->st.field += (n);                                                                                   \
        pthread_mutex_unlock(&(r)->mu);                                                                         \
    } while (0)
/** Counts one on a kvt_remote field (not a kvt_remote_stats one) under mu. */
#define KVT__REMOTE_COUNT(r, field)                                                                             \
    do {                                                                                                        \
        pthread_mutex_lock(&(r)->mu);                                                                           \
        (r)->field++;                                                                                           \
        pthread_mutex_unlock(&(r)->mu);                                                                         \
    } while (0)

/** Monotonic clock in milliseconds. */
static inline int64_t kvt__remote_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/** Milliseconds left before deadline (at least 1). */
static inline int32_t kvt__remote_left_ms(int64_t deadline)
{
    int64_t l = deadline - kvt__remote_now_ms();
    return l < 1 ? 1 : (int32_t)l;
}

/** Writes the Redis key of a record ('b' block, 'e' entry, 'k' children hash)
 * into out. @return its length. */
size_t kvt__remote_key_name(const kvt_remote *r, char type, kvt__key k, char out[KVT__REMOTE_KEY_MAX]);
/** The node a chain position hangs off: the last of keys[0..run), or the root of ns. */
kvt__key kvt__remote_node_key(const kvt_remote *r, const char *ns, const kvt__key *keys, int32_t run);
/** Whether every node is marked down (the whole tier is skipped without I/O). */
int kvt__remote_all_down(kvt_remote *r);
/** Learns the identity's block size and standalone flag from Redis (once;
 * bounded by timeout_ms). @return 1 known (*B, *standalone set), 0 not (yet). */
int kvt__remote_layout_get(kvt_remote *r, int32_t timeout_ms, int32_t *B, int *standalone);
/** Frees a handle slot's arrays and zeroes it. */
void kvt__remote_hslot_clear(kvt__rhandle *h);
/** Stores a lookup's result (*h is moved in and zeroed). @return the handle. */
uint64_t kvt__remote_handle_put(kvt_remote *r, kvt__rhandle *h);
/** A copy of handle id's slot (caller clears with kvt__remote_hslot_clear).
 * @return 0; KVT_ENOTFOUND (not a recent lookup); KVT_ENOMEM. */
int kvt__remote_handle_get(kvt_remote *r, uint64_t id, kvt__rhandle *out);
/** Builds a slot: tokens = a[0..na) + b[0..nb), keys copied. @return 0 or KVT_ENOMEM. */
int kvt__remote_hslot_make(kvt__rhandle *h, const char *ns, const int32_t *a, int64_t na, const int32_t *b,
                           int64_t nb, const kvt__key *keys, int32_t n_keys, int is_entry, kvt__key ekey);

/* The kvt_cold_tier operations (kvtier/tier.h gives their contracts); self is a kvt_remote. */
int kvt__remote_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out);
int kvt__remote_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out);
/** kvt_cold_tier.restore: a coalesced foreground operation of the I/O
 * worker, waited for (io_ops.c); kvt__remote_restore_direct on the calling
 * thread when the worker refuses it. */
int kvt__remote_restore(void *self, uint64_t handle, kvt_entry *out);
/** The restore itself (one pipeline of GETs) on the calling thread (restore.c). */
int kvt__remote_restore_direct(void *self, uint64_t handle, kvt_entry *out);
/** kvt_cold_tier.store: the write as a foreground operation of the I/O
 * worker, waited for (io_ops.c): identical synchronous stores at the same
 * time are one write; on the calling thread when the worker refuses it. */
int kvt__remote_store_sync(void *self, const kvt_entry *e);
/** Writes an entry now, holding its bytes on the pool's remote axis while
 * it is sent (redis.c). */
int kvt__remote_store_now(kvt_remote *r, const kvt_entry *e);
/** Writes an entry now (blocks Redis holds already are skipped), bounded by io_ms per socket op. */
int kvt__remote_store(kvt_remote *r, const kvt_entry *e);
/** Adds v[0..n) to r->layer_written (r->mu held; growing it, a failed
 * allocation leaves the layers past the old length uncounted). */
void kvt__remote_layers_add(kvt_remote *r, const uint64_t *v, int32_t n);
int kvt__remote_spill(void *self, kvt_entry *e);
int kvt__remote_pending(void *self, const int32_t *tokens, int64_t n, const char *ns);
int kvt__remote_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns);
int kvt__remote_flush(void *self);
/** kvt_cold_tier.restore_async: a coalesced foreground operation of the I/O worker (io_ops.c). */
int kvt__remote_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg);
/** Takes the tier's I/O worker at open (worker, else a reference on the default). @return 0 or an error. */
int kvt__remote_worker_open(kvt_remote *r, kvt_io *worker);
/** At close: refuses new work, waits until the worker holds no job or restore waiter of the tier,
 * drops the default's reference. @return the first write-behind failure not yet reported. */
int kvt__remote_worker_close(kvt_remote *r);

/* remote_pool.c: the tier's membership of kvt_remote_options.pool. Join:
 * 0 without a pool; kvt_pool_join's error. Reserve: 0 with *res NULL
 * without a pool; the pool's refusal naming the axis. Drop: NULL is a no-op. */
int kvt__remote_pool_join(kvt_remote *r, const kvt_remote_options *o);
void kvt__remote_pool_leave(kvt_remote *r);
int kvt__remote_pool_reserve(kvt_remote *r, uint64_t bytes, struct kvt_pool_reservation **res);
void kvt__remote_pool_drop(struct kvt_pool_reservation *res);
/* The bytes an entry's write holds (tokens, caches, attachments). */
uint64_t kvt__remote_entry_bytes(const kvt_entry *e);

#endif
