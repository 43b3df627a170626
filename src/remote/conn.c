/*
 * conn.c: the remote tier's connections to Redis: one node or a Redis
 * Cluster. Owns a pool of hiredis connections per node, the cluster's slot
 * map (CLUSTER SLOTS; CRC16 key slots; MOVED updates it, ASK is followed
 * once), pipelined execution (every node written before any is read: one
 * round trip per node), per-node health (consecutive failures mark a node
 * down; its commands then fail at once, without waiting on a socket, until a
 * PING succeeds) and the background thread that pings down nodes with
 * backoff and re-reads the slot map.
 * It must never block longer than the caller's timeout on any socket
 * operation, and never print a password.
 */
#include "remote_internal.h"

#include "io_shim.h"

#include <errno.h>
#include <hiredis.h>
#include <sds.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_NODES 64
#define POOL 8
#define SLOTS 16384
#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 5000

typedef struct rnode {
    char host[256];
    int port;
    pthread_mutex_t mu;
    redisContext *idle[POOL];
    int n_idle;
    int fails;          /* consecutive failed calls */
    int down;           /* skipped until a PING succeeds */
    int64_t retry_ms;   /* monotonic time of the next PING */
    int64_t backoff_ms;
} rnode;

struct kvt__rconn {
    kvt__rconn_cfg cfg;
    pthread_rwlock_t lk; /* nodes[] (append only) and slots[] */
    rnode *nodes[MAX_NODES];
    int n_nodes;
    int16_t slots[SLOTS]; /* node index per slot; -1 unknown */
    _Atomic int map_stale; /* a MOVED was seen or the map was never read */
    kvt__rconn_counters ct;
    pthread_mutex_t th_mu;
    pthread_cond_t th_cv;
    int closing;
    pthread_t th;
    int th_started;
};

static struct timeval tv_of(int32_t ms)
{
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    return tv;
}

/* ---- CRC16 key slots (Redis Cluster spec: CRC16-CCITT XMODEM) ---------------------- */

static uint16_t crc16(const char *buf, size_t len)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((uint8_t)buf[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}

unsigned kvt__redis_slot(const char *key, size_t len)
{
    const char *o = memchr(key, '{', len);
    if (o) {
        size_t s = (size_t)(o - key) + 1;
        const char *c = memchr(key + s, '}', len - s);
        if (c && c > key + s)
            return crc16(key + s, (size_t)(c - key - s)) & (SLOTS - 1);
    }
    return crc16(key, len) & (SLOTS - 1);
}

/* ---- nodes and their pools --------------------------------------------------------- */

/* Index of node host:port, added when new (caller holds lk for writing).
 * @return the index, or -1 (too many nodes / out of memory). */
static int node_add_locked(kvt__rconn *c, const char *host, int port)
{
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i]->port == port && strcmp(c->nodes[i]->host, host) == 0)
            return i;
    if (c->n_nodes == MAX_NODES)
        return -1;
    rnode *n = kvt__calloc(1, sizeof *n);
    if (!n)
        return -1;
    snprintf(n->host, sizeof n->host, "%s", host);
    n->port = port;
    pthread_mutex_init(&n->mu, NULL);
    n->backoff_ms = BACKOFF_MIN_MS;
    c->nodes[c->n_nodes] = n;
    return c->n_nodes++;
}

static int node_index(kvt__rconn *c, const char *host, int port)
{
    pthread_rwlock_rdlock(&c->lk);
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i]->port == port && strcmp(c->nodes[i]->host, host) == 0) {
            pthread_rwlock_unlock(&c->lk);
            return i;
        }
    pthread_rwlock_unlock(&c->lk);
    pthread_rwlock_wrlock(&c->lk);
    int i = node_add_locked(c, host, port);
    pthread_rwlock_unlock(&c->lk);
    return i;
}

static rnode *node_at(kvt__rconn *c, int i)
{
    pthread_rwlock_rdlock(&c->lk);
    rnode *n = i >= 0 && i < c->n_nodes ? c->nodes[i] : NULL;
    pthread_rwlock_unlock(&c->lk);
    return n;
}

static kvt__rfail classify(const redisContext *ctx, int saved_errno)
{
    if (ctx && ctx->err == REDIS_ERR_IO && (saved_errno == EAGAIN || saved_errno == EWOULDBLOCK))
        return KVT__RF_TIMEOUT;
    if (ctx && ctx->err == REDIS_ERR_PROTOCOL)
        return KVT__RF_REPLY;
    return KVT__RF_CONN;
}

/* ---- network calls: every connect, send and receive of a hiredis context goes
 * through these, so the I/O shim (io_shim.h) can fail it as a socket error ---- */

/* Fails the context's call as hiredis reports a socket error. */
static int net_fail(redisContext *ctx, int err)
{
    ctx->err = REDIS_ERR_IO;
    snprintf(ctx->errstr, sizeof ctx->errstr, "%s", strerror(err));
    errno = err;
    return REDIS_ERR;
}

static void net_peer(const redisContext *ctx, char *out, size_t cap)
{
    snprintf(out, cap, "%s:%d", ctx->tcp.host ? ctx->tcp.host : "", ctx->tcp.port);
}

static redisContext *net_connect(const char *host, int port, struct timeval tv)
{
    char peer[300];
    snprintf(peer, sizeof peer, "%s:%d", host, port);
    int e = kvt__io_net_gate(KVT_IO_CONNECT, peer, NULL);
    if (e) {
        errno = e;
        return NULL;
    }
    return redisConnectWithTimeout(host, port, tv);
}

/* The shim's verdict on sending what ctx has buffered: 0, or REDIS_ERR
 * (after sending half of it when the fault is a short write). */
static int net_send_gate(redisContext *ctx)
{
    if (!ctx->obuf || !sdslen(ctx->obuf))
        return 0;
    char peer[300];
    net_peer(ctx, peer, sizeof peer);
    int half = 0, e = kvt__io_net_gate(KVT_IO_SEND, peer, &half);
    if (!e)
        return 0;
    if (half && sdslen(ctx->obuf) / 2 && write(ctx->fd, ctx->obuf, sdslen(ctx->obuf) / 2) < 0)
        e = errno;
    return net_fail(ctx, e);
}

static int net_buffer_write(redisContext *ctx, int *done)
{
    if (net_send_gate(ctx))
        return REDIS_ERR;
    return redisBufferWrite(ctx, done);
}

/* The shim's verdict on one reply: sending what is buffered, then reading
 * the reply. 0, or REDIS_ERR with the call failed. */
static int net_reply_gate(redisContext *ctx)
{
    if (net_send_gate(ctx))
        return REDIS_ERR;
    char peer[300];
    net_peer(ctx, peer, sizeof peer);
    int e = kvt__io_net_gate(KVT_IO_RECV, peer, NULL);
    return e ? net_fail(ctx, e) : 0;
}

/* One reply (a blocking context sends what is buffered first). */
static int net_get_reply(redisContext *ctx, void **reply)
{
    if (net_reply_gate(ctx))
        return REDIS_ERR;
    return redisGetReply(ctx, reply);
}

static void count_fail(kvt__rconn *c, kvt__rfail f)
{
    if (f == KVT__RF_TIMEOUT)
        atomic_fetch_add(&c->ct.timeouts, 1);
    else if (f == KVT__RF_CONN)
        atomic_fetch_add(&c->ct.conn_failures, 1);
    else if (f == KVT__RF_REPLY)
        atomic_fetch_add(&c->ct.reply_failures, 1);
}

/* One call on a node failed (f) or succeeded (KVT__RF_NONE). */
static void node_result(kvt__rconn *c, rnode *n, kvt__rfail f)
{
    pthread_mutex_lock(&n->mu);
    if (f == KVT__RF_NONE) {
        n->fails = 0;
    } else if (f != KVT__RF_REPLY && f != KVT__RF_DOWN && ++n->fails >= c->cfg.fail_threshold && !n->down) {
        n->down = 1;
        n->backoff_ms = BACKOFF_MIN_MS;
        n->retry_ms = kvt__remote_now_ms() + n->backoff_ms;
        atomic_fetch_add(&c->ct.unhealthy_transitions, 1);
        for (int i = 0; i < n->n_idle; i++)
            redisFree(n->idle[i]);
        n->n_idle = 0;
        pthread_mutex_unlock(&n->mu);
        pthread_mutex_lock(&c->th_mu);
        pthread_cond_signal(&c->th_cv);
        pthread_mutex_unlock(&c->th_mu);
        return;
    }
    pthread_mutex_unlock(&n->mu);
}

/* Runs one command on a fresh or pooled context synchronously. */
static redisReply *ctx_cmd(redisContext *ctx, int argc, const char **argv, const size_t *len)
{
    if (redisAppendCommandArgv(ctx, argc, argv, len) != REDIS_OK)
        return NULL;
    void *r = NULL;
    return net_get_reply(ctx, &r) == REDIS_OK ? r : NULL;
}

/* A new connection to n: connect, AUTH, SELECT. NULL on failure (*f why). */
static redisContext *node_connect(kvt__rconn *c, rnode *n, int32_t timeout_ms, kvt__rfail *f)
{
    int32_t ct = KVT__MIN(c->cfg.connect_timeout_ms, timeout_ms > 0 ? timeout_ms : c->cfg.connect_timeout_ms);
    redisContext *ctx = net_connect(n->host, n->port, tv_of(ct > 0 ? ct : 1));
    if (!ctx || ctx->err) {
        *f = ctx && ctx->err == REDIS_ERR_IO && errno == ETIMEDOUT ? KVT__RF_TIMEOUT : KVT__RF_CONN;
        if (ctx)
            redisFree(ctx);
        return NULL;
    }
    redisSetTimeout(ctx, tv_of(timeout_ms > 0 ? timeout_ms : 1));
    const kvt_remote_url *u = &c->cfg.url;
    if (u->password[0]) {
        const char *av[3] = {"AUTH", u->user[0] ? u->user : u->password, u->password};
        size_t al[3] = {4, strlen(av[1]), strlen(u->password)};
        redisReply *r = ctx_cmd(ctx, u->user[0] ? 3 : 2, av, al);
        int ok = r && r->type == REDIS_REPLY_STATUS;
        if (r)
            freeReplyObject(r);
        if (!ok) {
            *f = r ? KVT__RF_REPLY : classify(ctx, errno);
            redisFree(ctx);
            return NULL;
        }
    }
    if (u->db && !c->cfg.cluster) {
        char db[16];
        snprintf(db, sizeof db, "%d", u->db);
        const char *av[2] = {"SELECT", db};
        size_t al[2] = {6, strlen(db)};
        redisReply *r = ctx_cmd(ctx, 2, av, al);
        int ok = r && r->type == REDIS_REPLY_STATUS;
        if (r)
            freeReplyObject(r);
        if (!ok) {
            *f = r ? KVT__RF_REPLY : classify(ctx, errno);
            redisFree(ctx);
            return NULL;
        }
    }
    return ctx;
}

/* A connection to node n with socket timeouts of timeout_ms, or NULL (the
 * node is down, or connecting failed: *f says which). */
static redisContext *node_take(kvt__rconn *c, rnode *n, int32_t timeout_ms, int probe, kvt__rfail *f)
{
    pthread_mutex_lock(&n->mu);
    if (n->down && !probe) {
        pthread_mutex_unlock(&n->mu);
        *f = KVT__RF_DOWN;
        return NULL;
    }
    redisContext *ctx = n->n_idle ? n->idle[--n->n_idle] : NULL;
    pthread_mutex_unlock(&n->mu);
    if (ctx) {
        redisSetTimeout(ctx, tv_of(timeout_ms > 0 ? timeout_ms : 1));
        return ctx;
    }
    ctx = node_connect(c, n, timeout_ms, f);
    if (!ctx) {
        count_fail(c, *f);
        if (!probe)
            node_result(c, n, *f);
    }
    return ctx;
}

static void node_give(rnode *n, redisContext *ctx, int ok)
{
    if (!ctx)
        return;
    pthread_mutex_lock(&n->mu);
    if (ok && !n->down && n->n_idle < POOL) {
        n->idle[n->n_idle++] = ctx;
        ctx = NULL;
    }
    pthread_mutex_unlock(&n->mu);
    if (ctx)
        redisFree(ctx);
}

/* ---- the slot map ------------------------------------------------------------------ */

static int read_slots(kvt__rconn *c, rnode *seed, int32_t timeout_ms, kvt__rfail *f)
{
    redisContext *ctx = node_take(c, seed, timeout_ms, 1, f);
    if (!ctx)
        return KVT_EIO;
    const char *av[2] = {"CLUSTER", "SLOTS"};
    size_t al[2] = {7, 5};
    redisReply *r = ctx_cmd(ctx, 2, av, al);
    if (!r) {
        *f = classify(ctx, errno);
        count_fail(c, *f);
        node_give(seed, ctx, 0);
        return KVT_EIO;
    }
    node_give(seed, ctx, 1);
    if (r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
        freeReplyObject(r);
        *f = KVT__RF_REPLY;
        count_fail(c, *f);
        return kvt__fail(KVT_EIO, "redis %s:%d: CLUSTER SLOTS gave no slot map (not a cluster?)", seed->host,
                         seed->port);
    }
    int16_t *map = kvt__malloc(sizeof c->slots);
    if (!map) {
        freeReplyObject(r);
        return KVT_ENOMEM;
    }
    for (int s = 0; s < SLOTS; s++)
        map[s] = -1;
    for (size_t i = 0; i < r->elements; i++) {
        redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
            e->element[2]->elements < 2 || e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
            continue;
        long long a = e->element[0]->integer, b = e->element[1]->integer;
        redisReply *m = e->element[2];
        const char *host = m->element[0]->type == REDIS_REPLY_STRING && m->element[0]->len ? m->element[0]->str
                                                                                             : seed->host;
        int port = (int)m->element[1]->integer;
        int idx = node_index(c, host, port);
        if (idx < 0 || a < 0 || b >= SLOTS || a > b)
            continue;
        for (long long s = a; s <= b; s++)
            map[s] = (int16_t)idx;
    }
    freeReplyObject(r);
    pthread_rwlock_wrlock(&c->lk);
    memcpy(c->slots, map, sizeof c->slots);
    pthread_rwlock_unlock(&c->lk);
    kvt__free(map);
    atomic_store(&c->map_stale, 0);
    return 0;
}

int kvt__rconn_refresh(kvt__rconn *c, int32_t timeout_ms, kvt__rfail *fail)
{
    kvt__rfail f = KVT__RF_NONE;
    if (!c->cfg.cluster) {
        if (fail)
            *fail = f;
        return 0;
    }
    /* any known node that answers will do: the seed first */
    int rc = KVT_EIO;
    int n = kvt__rconn_nodes(c);
    for (int i = 0; i < n && rc; i++) {
        rnode *nd = node_at(c, i);
        if (nd && !nd->down)
            rc = read_slots(c, nd, timeout_ms, &f);
    }
    if (fail)
        *fail = f;
    return rc;
}

int kvt__rconn_nodes(kvt__rconn *c)
{
    pthread_rwlock_rdlock(&c->lk);
    int n = c->n_nodes;
    pthread_rwlock_unlock(&c->lk);
    return n;
}

int kvt__rconn_slots_covered(kvt__rconn *c)
{
    int n = 0;
    pthread_rwlock_rdlock(&c->lk);
    for (int s = 0; s < SLOTS; s++)
        n += c->slots[s] >= 0;
    pthread_rwlock_unlock(&c->lk);
    return n;
}

int kvt__rconn_down(kvt__rconn *c)
{
    int down = 0, n = kvt__rconn_nodes(c);
    for (int i = 0; i < n; i++) {
        rnode *nd = node_at(c, i);
        pthread_mutex_lock(&nd->mu);
        down += nd->down;
        pthread_mutex_unlock(&nd->mu);
    }
    return down;
}

void kvt__rconn_mark_down(kvt__rconn *c)
{
    int n = kvt__rconn_nodes(c);
    for (int i = 0; i < n; i++) {
        rnode *nd = node_at(c, i);
        pthread_mutex_lock(&nd->mu);
        nd->fails = c->cfg.fail_threshold - 1;
        pthread_mutex_unlock(&nd->mu);
        node_result(c, nd, KVT__RF_CONN);
    }
}

/* ---- the health thread ------------------------------------------------------------- */

static int ping(kvt__rconn *c, rnode *n)
{
    kvt__rfail f;
    redisContext *ctx = node_take(c, n, c->cfg.connect_timeout_ms, 1, &f);
    if (!ctx)
        return -1;
    const char *av[1] = {"PING"};
    size_t al[1] = {4};
    redisReply *r = ctx_cmd(ctx, 1, av, al);
    int ok = r && (r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_STRING);
    if (r)
        freeReplyObject(r);
    pthread_mutex_lock(&n->mu);
    if (ok) {
        n->down = 0;
        n->fails = 0;
        n->backoff_ms = BACKOFF_MIN_MS;
    }
    pthread_mutex_unlock(&n->mu);
    node_give(n, ctx, ok);
    return ok ? 0 : -1;
}

static void *health_main(void *arg)
{
    kvt__rconn *c = arg;
    pthread_mutex_lock(&c->th_mu);
    while (!c->closing) {
        pthread_mutex_unlock(&c->th_mu);
        int64_t now = kvt__remote_now_ms(), next = now + 1000;
        int n = kvt__rconn_nodes(c), any_up_again = 0;
        for (int i = 0; i < n; i++) {
            rnode *nd = node_at(c, i);
            pthread_mutex_lock(&nd->mu);
            int due = nd->down && nd->retry_ms <= now;
            int64_t at = nd->retry_ms;
            pthread_mutex_unlock(&nd->mu);
            if (due) {
                if (ping(c, nd) == 0) {
                    any_up_again = 1;
                } else {
                    pthread_mutex_lock(&nd->mu);
                    nd->backoff_ms = KVT__MIN(nd->backoff_ms * 2, BACKOFF_MAX_MS);
                    nd->retry_ms = kvt__remote_now_ms() + nd->backoff_ms;
                    at = nd->retry_ms;
                    pthread_mutex_unlock(&nd->mu);
                }
            }
            pthread_mutex_lock(&nd->mu);
            if (nd->down)
                next = KVT__MIN(next, at);
            pthread_mutex_unlock(&nd->mu);
        }
        if (c->cfg.cluster && (any_up_again || atomic_load(&c->map_stale)))
            kvt__rconn_refresh(c, c->cfg.connect_timeout_ms, NULL);
        if (c->cfg.cluster && atomic_load(&c->map_stale))
            next = KVT__MIN(next, kvt__remote_now_ms() + 200);
        pthread_mutex_lock(&c->th_mu);
        int64_t wait = next - kvt__remote_now_ms();
        if (!c->closing && wait > 0) {
            struct timespec dl = kvt__deadline(CLOCK_MONOTONIC, (uint64_t)wait);
            pthread_cond_timedwait(&c->th_cv, &c->th_mu, &dl);
        }
    }
    pthread_mutex_unlock(&c->th_mu);
    return NULL;
}

/* ---- create / destroy -------------------------------------------------------------- */

int kvt__rconn_create(const kvt__rconn_cfg *cfg, kvt__rconn **out)
{
    kvt__rconn *c = kvt__calloc(1, sizeof *c);
    if (!c)
        return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
    c->cfg = *cfg;
    if (c->cfg.fail_threshold <= 0)
        c->cfg.fail_threshold = 3;
    pthread_rwlock_init(&c->lk, NULL);
    pthread_mutex_init(&c->th_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->th_cv, &ca);
    pthread_condattr_destroy(&ca);
    for (int s = 0; s < SLOTS; s++)
        c->slots[s] = c->cfg.cluster ? -1 : 0;
    if (node_add_locked(c, cfg->url.host, cfg->url.port) != 0) {
        kvt__rconn_destroy(c);
        return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
    }
    atomic_store(&c->map_stale, cfg->cluster);
    int rc = pthread_create(&c->th, NULL, health_main, c);
    if (rc) {
        kvt__rconn_destroy(c);
        return kvt__fail(-rc, "remote tier: cannot start the health thread");
    }
    c->th_started = 1;
    *out = c;
    return 0;
}

void kvt__rconn_destroy(kvt__rconn *c)
{
    if (!c)
        return;
    if (c->th_started) {
        pthread_mutex_lock(&c->th_mu);
        c->closing = 1;
        pthread_cond_broadcast(&c->th_cv);
        pthread_mutex_unlock(&c->th_mu);
        pthread_join(c->th, NULL);
    }
    for (int i = 0; i < c->n_nodes; i++) {
        rnode *n = c->nodes[i];
        for (int k = 0; k < n->n_idle; k++)
            redisFree(n->idle[k]);
        pthread_mutex_destroy(&n->mu);
        kvt__free(n);
    }
    pthread_rwlock_destroy(&c->lk);
    pthread_mutex_destroy(&c->th_mu);
    pthread_cond_destroy(&c->th_cv);
    kvt__free(c);
}

void kvt__rconn_counters_get(kvt__rconn *c, kvt__rconn_counters_snap *out)
{
    out->timeouts = atomic_load(&c->ct.timeouts);
    out->conn_failures = atomic_load(&c->ct.conn_failures);
    out->reply_failures = atomic_load(&c->ct.reply_failures);
    out->unhealthy_transitions = atomic_load(&c->ct.unhealthy_transitions);
    out->round_trips = atomic_load(&c->ct.round_trips);
    out->redirects = atomic_load(&c->ct.redirects);
}

/* ---- pipelines --------------------------------------------------------------------- */

int kvt__rpipe_add(kvt__rpipe *p, int key_arg, int argc, const char *const *argv, const size_t *argvlen)
{
    if (argc < 1 || argc > 8 || key_arg >= argc)
        return kvt__fail(KVT_EINVAL, "remote tier: bad command");
    if (p->n == p->cap) {
        int32_t cap = p->cap ? p->cap * 2 : 16;
        kvt__rcmd *v = kvt__realloc(p->cmds, (size_t)cap * sizeof *v);
        if (!v)
            return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
        p->cmds = v;
        p->cap = cap;
    }
    kvt__rcmd *m = &p->cmds[p->n++];
    memset(m, 0, sizeof *m);
    m->argc = argc;
    m->key_arg = key_arg;
    for (int i = 0; i < argc; i++) {
        m->argv[i] = argv[i];
        m->argvlen[i] = argvlen ? argvlen[i] : strlen(argv[i]);
    }
    return 0;
}

void kvt__rpipe_clear(kvt__rpipe *p)
{
    for (int32_t i = 0; i < p->n; i++)
        if (p->cmds[i].reply)
            freeReplyObject(p->cmds[i].reply);
    kvt__free(p->cmds);
    memset(p, 0, sizeof *p);
}

static int route(kvt__rconn *c, const kvt__rcmd *m)
{
    if (!c->cfg.cluster || m->key_arg < 0)
        return 0;
    unsigned s = kvt__redis_slot(m->argv[m->key_arg], m->argvlen[m->key_arg]);
    pthread_rwlock_rdlock(&c->lk);
    int i = c->slots[s];
    pthread_rwlock_unlock(&c->lk);
    return i < 0 ? 0 : i;
}

static void note_fail(kvt__rpipe *p, kvt__rfail f)
{
    if (p->fail == KVT__RF_NONE)
        p->fail = f;
}

/* The socket timeout of the next operation of p: timeout_ms, or what is
 * left of p's deadline when that is less; 0 once the deadline has passed. */
static int32_t op_ms(const kvt__rpipe *p, int32_t timeout_ms)
{
    if (!p->deadline_ms)
        return timeout_ms;
    int64_t left = p->deadline_ms - kvt__remote_now_ms();
    return left <= 0 ? 0 : left < timeout_ms ? (int32_t)left : timeout_ms;
}

/* Fails ctx as a timeout (classify sees EAGAIN): the deadline has passed. */
static int deadline_passed(redisContext *ctx)
{
    ctx->err = REDIS_ERR_IO;
    snprintf(ctx->errstr, sizeof ctx->errstr, "deadline passed");
    errno = EAGAIN;
    return REDIS_ERR;
}

/* redisGetReply under p's deadline (past the shim's gates, as
 * net_get_reply): writes what is buffered, then reads until a reply is
 * whole, shrinking the socket timeout to what is left of the deadline
 * before each operation. */
static int get_reply(redisContext *ctx, void **r, const kvt__rpipe *p, int32_t timeout_ms)
{
    if (!p->deadline_ms)
        return net_get_reply(ctx, r);
    if (net_reply_gate(ctx))
        return REDIS_ERR;
    *r = NULL;
    if (redisGetReplyFromReader(ctx, r) != REDIS_OK)
        return REDIS_ERR;
    int32_t cur = timeout_ms;
    int wdone = 0;
    while (!*r) {
        int32_t ms = op_ms(p, timeout_ms);
        if (ms <= 0)
            return deadline_passed(ctx);
        if (ms < cur) {
            redisSetTimeout(ctx, tv_of(ms));
            cur = ms;
        }
        if (!wdone) {
            if (redisBufferWrite(ctx, &wdone) != REDIS_OK)
                return REDIS_ERR;
        } else if (redisBufferRead(ctx) != REDIS_OK || redisGetReplyFromReader(ctx, r) != REDIS_OK) {
            return REDIS_ERR;
        }
    }
    return REDIS_OK;
}

/* Runs commands idx[0..k) on node ni, pipelined, asking first when ask. */
static void run_on_node(kvt__rconn *c, kvt__rpipe *p, int ni, const int32_t *idx, int32_t k, int32_t timeout_ms,
                        int ask)
{
    rnode *n = node_at(c, ni);
    kvt__rfail f = KVT__RF_NONE;
    int32_t ms = op_ms(p, timeout_ms);
    if (ms <= 0) {
        count_fail(c, KVT__RF_TIMEOUT);
        note_fail(p, KVT__RF_TIMEOUT);
        return;
    }
    redisContext *ctx = n ? node_take(c, n, ms, 0, &f) : NULL;
    if (!ctx) {
        note_fail(p, n ? f : KVT__RF_CONN);
        return;
    }
    for (int32_t j = 0; j < k; j++) {
        const kvt__rcmd *m = &p->cmds[idx[j]];
        if (ask)
            redisAppendCommand(ctx, "ASKING");
        redisAppendCommandArgv(ctx, m->argc, (const char **)m->argv, m->argvlen);
    }
    atomic_fetch_add(&c->ct.round_trips, 1);
    p->round_trips++;
    int ok = 1;
    for (int32_t j = 0; j < k && ok; j++) {
        void *r = NULL;
        if (ask) {
            if (get_reply(ctx, &r, p, ms) != REDIS_OK) {
                ok = 0;
                break;
            }
            freeReplyObject(r);
            r = NULL;
        }
        if (get_reply(ctx, &r, p, ms) != REDIS_OK) {
            ok = 0;
            break;
        }
        p->cmds[idx[j]].reply = r;
    }
    if (!ok) {
        f = classify(ctx, errno);
        count_fail(c, f);
        note_fail(p, f);
    }
    node_result(c, n, ok ? KVT__RF_NONE : f);
    node_give(n, ctx, ok);
}

/* Sends the commands of several nodes: every node's buffer is written before
 * any reply is read, so the nodes work in parallel. */
static int run_grouped(kvt__rconn *c, kvt__rpipe *p, const int32_t *todo, int32_t n_todo, int32_t timeout_ms)
{
    int nn = kvt__rconn_nodes(c);
    if (nn <= 1) { /* one node: no routing, no grouping */
        run_on_node(c, p, 0, todo, n_todo, timeout_ms, 0);
        return 0;
    }
    if (n_todo <= 0)
        return 0;
    int32_t *idx = kvt__malloc(sizeof *idx * (size_t)n_todo);
    int *node = kvt__malloc(sizeof *node * (size_t)n_todo);
    if (!idx || !node) {
        kvt__free(idx);
        kvt__free(node);
        return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
    }
    for (int32_t i = 0; i < n_todo; i++)
        node[i] = route(c, &p->cmds[todo[i]]);
    /* write every node's commands, then read node by node */
    typedef struct pend {
        rnode *n;
        redisContext *ctx;
        int32_t first, k;
    } pend;
    pend *pe = kvt__calloc((size_t)nn, sizeof *pe);
    if (!pe) {
        kvt__free(idx);
        kvt__free(node);
        return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
    }
    int32_t at = 0;
    for (int ni = 0; ni < nn; ni++) {
        pe[ni].first = at;
        for (int32_t i = 0; i < n_todo; i++)
            if (node[i] == ni)
                idx[at++] = todo[i];
        pe[ni].k = at - pe[ni].first;
        if (!pe[ni].k)
            continue;
        kvt__rfail f = KVT__RF_NONE;
        pe[ni].n = node_at(c, ni);
        int32_t ms = op_ms(p, timeout_ms);
        pe[ni].ctx = ms > 0 ? node_take(c, pe[ni].n, ms, 0, &f) : NULL;
        if (!pe[ni].ctx) {
            if (ms <= 0)
                count_fail(c, f = KVT__RF_TIMEOUT);
            note_fail(p, f);
            continue;
        }
        for (int32_t j = 0; j < pe[ni].k; j++) {
            const kvt__rcmd *m = &p->cmds[idx[pe[ni].first + j]];
            redisAppendCommandArgv(pe[ni].ctx, m->argc, (const char **)m->argv, m->argvlen);
        }
        int done = 0;
        while (!done)
            if (net_buffer_write(pe[ni].ctx, &done) != REDIS_OK)
                break;
        atomic_fetch_add(&c->ct.round_trips, 1);
        p->round_trips++;
    }
    for (int ni = 0; ni < nn; ni++) {
        if (!pe[ni].ctx)
            continue;
        int ok = !pe[ni].ctx->err;
        for (int32_t j = 0; j < pe[ni].k && ok; j++) {
            void *r = NULL;
            if (get_reply(pe[ni].ctx, &r, p, timeout_ms) != REDIS_OK)
                ok = 0;
            else
                p->cmds[idx[pe[ni].first + j]].reply = r;
        }
        kvt__rfail f = KVT__RF_NONE;
        if (!ok) {
            f = classify(pe[ni].ctx, errno);
            count_fail(c, f);
            note_fail(p, f);
        }
        node_result(c, pe[ni].n, f);
        node_give(pe[ni].n, pe[ni].ctx, ok);
    }
    kvt__free(pe);
    kvt__free(idx);
    kvt__free(node);
    return 0;
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK ...": the target node and whether ASK. */
static int redirect_of(kvt__rconn *c, const redisReply *r, int *ask, unsigned *slot)
{
    if (!r || r->type != REDIS_REPLY_ERROR)
        return -1;
    int is_ask = strncmp(r->str, "ASK ", 4) == 0;
    if (!is_ask && strncmp(r->str, "MOVED ", 6) != 0)
        return -1;
    unsigned s;
    char hp[300];
    if (sscanf(r->str + (is_ask ? 4 : 6), "%u %299s", &s, hp) != 2 || s >= SLOTS)
        return -1;
    char *colon = strrchr(hp, ':');
    if (!colon)
        return -1;
    *colon = 0;
    int port = atoi(colon + 1);
    const char *host = hp[0] ? hp : c->cfg.url.host;
    *ask = is_ask;
    *slot = s;
    return node_index(c, host, port);
}

int kvt__rconn_exec(kvt__rconn *c, kvt__rpipe *p, int32_t timeout_ms)
{
    p->fail = KVT__RF_NONE;
    if (p->n == 0)
        return 0;
    int32_t *todo = kvt__malloc(sizeof *todo * (size_t)p->n);
    if (!todo)
        return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
    for (int32_t i = 0; i < p->n; i++)
        todo[i] = i;
    int rc = run_grouped(c, p, todo, p->n, timeout_ms);
    /* follow redirections, a few rounds at most */
    for (int round = 0; rc == 0 && c->cfg.cluster && round < 4; round++) {
        int any = 0;
        for (int32_t i = 0; i < p->n; i++) {
            int ask;
            unsigned slot;
            int ni = redirect_of(c, p->cmds[i].reply, &ask, &slot);
            if (ni < 0)
                continue;
            any = 1;
            freeReplyObject(p->cmds[i].reply);
            p->cmds[i].reply = NULL;
            atomic_fetch_add(&c->ct.redirects, 1);
            p->redirects++;
            if (!ask) {
                pthread_rwlock_wrlock(&c->lk);
                c->slots[slot] = (int16_t)ni;
                pthread_rwlock_unlock(&c->lk);
                atomic_store(&c->map_stale, 1);
            }
            int32_t one = i;
            run_on_node(c, p, ni, &one, 1, timeout_ms, ask);
        }
        if (!any)
            break;
    }
    kvt__free(todo);
    if (rc)
        return rc;
    for (int32_t i = 0; i < p->n; i++)
        if (!p->cmds[i].reply)
            return KVT_EIO;
    return 0;
}
