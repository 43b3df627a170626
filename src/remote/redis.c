/*
 * redis.c: the remote tier (kvtier/remote.h, DESIGN.md section 5): the
 * kvt_cold_tier over Redis. This file owns the identity's key prefix and
 * layout, the handle table of recent lookups, the stats, the tier table and
 * open/close. The operations live beside it: lookup.c (pipelined EXISTS of a
 * prompt's block keys, then the children of the last node reached), restore.c
 * (pipelined GETs, every record validated before a byte is used), store.c
 * (blocks Redis holds already are not sent again) and writeback.c (the bounded
 * write-behind queue on the I/O worker; io_ops.c the asynchronous restore).
 * The tier must never serve a record it has not validated, never hand out a
 * shortened entry for a handle, and never wait on Redis longer than the
 * call's timeout.
 */
#include "remote_internal.h"

#include <hiredis.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- keys --------------------------------------------------------------------------- */

size_t kvt__remote_key_name(const kvt_remote *r, char type, kvt__key k, char out[KVT__REMOTE_KEY_MAX])
{
    char hex[33];
    kvt__key_hex(k, hex);
    return (size_t)snprintf(out, KVT__REMOTE_KEY_MAX, "%s%c%s", r->prefix, type, hex);
}

/* The node a chain position hangs off: the last block's key, or the root of ns. */
kvt__key kvt__remote_node_key(const kvt_remote *r, const char *ns, const kvt__key *keys, int32_t run)
{
    return run ? keys[run - 1] : kvt__entry_key(r->seed, ns, NULL, -1);
}

static char *identity_json(const kvt_store_identity *id)
{
    json_t *o = json_pack("{s:s, s:s, s:s}", "model", id->model_id, "config", id->config_fingerprint, "tokenizer",
                          id->tokenizer_hash);
    char *s = o ? json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(o);
    return s;
}

static int identity_ok(const kvt_store_identity *id)
{
    return id && id->model_id && id->config_fingerprint && id->tokenizer_hash && strlen(id->model_id) <= 1024 &&
           strlen(id->config_fingerprint) <= 1024 && strlen(id->tokenizer_hash) <= 1024;
}

KVT_API int kvt_remote_key_prefix(const kvt_store_identity *identity, char *out, size_t cap)
{
    if (!out || cap < 38 || !identity_ok(identity))
        return kvt__fail(KVT_EINVAL, "kvt_remote_key_prefix: bad arguments");
    char *js = identity_json(identity);
    if (!js)
        return kvt__fail(KVT_ENOMEM, "kvt_remote_key_prefix: out of memory");
    char hex[33];
    kvt__key_hex(kvt__key_seed(js), hex);
    free(js);
    snprintf(out, cap, "kvt:%s:", hex);
    return 0;
}

/* ---- stats -------------------------------------------------------------------------- */

KVT_API int kvt_remote_stats_get(kvt_remote *r, kvt_remote_stats *out)
{
    if (!r || !out)
        return kvt__fail(KVT_EINVAL, "kvt_remote_stats_get: NULL argument");
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    pthread_mutex_unlock(&r->mu);
    kvt__rconn_counters_snap c;
    kvt__rconn_counters_get(r->conn, &c);
    out->failures_timeout = c.timeouts;
    out->failures_conn = c.conn_failures;
    out->failures_reply += c.reply_failures;
    out->unhealthy_transitions = c.unhealthy_transitions;
    out->round_trips = c.round_trips;
    out->redirects = c.redirects;
    out->nodes = (uint64_t)kvt__rconn_nodes(r->conn);
    out->slots_covered = (uint64_t)kvt__rconn_slots_covered(r->conn);
    out->healthy = kvt__rconn_down(r->conn) == 0;
    pthread_mutex_lock(&r->q_mu);
    out->queued_entries = (uint64_t)r->q_n;
    out->queued_bytes = r->q_bytes;
    pthread_mutex_unlock(&r->q_mu);
    return 0;
}

KVT_API int kvt_remote_stats_json(const kvt_remote_stats *s, char **out)
{
    if (out)
        *out = NULL;
    if (!s || !out)
        return kvt__fail(KVT_EINVAL, "kvt_remote_stats_json: NULL argument");
    json_t *o = json_object();
    int bad = !o;
#define KVT__REMOTE_JSON(name, kind, h) bad = bad || json_object_set_new(o, #name, json_integer((json_int_t)s->name));
    KVT_REMOTE_COUNTERS(KVT__REMOTE_JSON)
#undef KVT__REMOTE_JSON
    char *js = bad ? NULL : json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!js)
        return kvt__fail(KVT_ENOMEM, "kvt_remote_stats_json: out of memory");
    *out = kvt__strdup(js);
    free(js);
    return *out ? 0 : kvt__fail(KVT_ENOMEM, "kvt_remote_stats_json: out of memory");
}

KVT_API int kvt_remote_healthy(kvt_remote *r) { return r && kvt__rconn_down(r->conn) == 0; }

KVT_API int kvt_remote_stats_names(const char **names, const char **kinds, const char **help, int cap)
{
    int i = 0;
#define KVT__REMOTE_NAME(name, kind, h)                                                                         \
    if (i < cap) {                                                                                              \
        if (names)                                                                                              \
            names[i] = #name;                                                                                   \
        if (kinds)                                                                                              \
            kinds[i] = #kind;                                                                                   \
        if (help)                                                                                               \
            help[i] = h;                                                                                        \
    }                                                                                                           \
    i++;
    KVT_REMOTE_COUNTERS(KVT__REMOTE_NAME)
#undef KVT__REMOTE_NAME
    return i;
}

/* The whole tier is skipped when every node is down. */
int kvt__remote_all_down(kvt_remote *r) { return kvt__rconn_down(r->conn) >= kvt__rconn_nodes(r->conn); }

/* ---- layout ------------------------------------------------------------------------- */

/* Learns the identity's block size and standalone flag from Redis (once).
 * @return 1 known, 0 not (yet). */
int kvt__remote_layout_get(kvt_remote *r, int32_t timeout_ms, int32_t *B, int *standalone)
{
    pthread_mutex_lock(&r->mu);
    int known = r->layout_known;
    *B = r->B;
    *standalone = r->standalone;
    pthread_mutex_unlock(&r->mu);
    if (known)
        return 1;
    char key[KVT__REMOTE_KEY_MAX];
    size_t kl = (size_t)snprintf(key, sizeof key, "%slayout", r->prefix);
    const char *av[2] = {"GET", key};
    size_t al[2] = {3, kl};
    kvt__rpipe p = {0};
    int ok = 0;
    if (kvt__rpipe_add(&p, 1, 2, av, al) == 0 && kvt__rconn_exec(r->conn, &p, timeout_ms) == 0) {
        redisReply *rep = p.cmds[0].reply;
        int b = 0, sa = -1;
        char tail;
        if (rep->type == REDIS_REPLY_STRING && rep->len < 64 &&
            sscanf(rep->str, "kvtier-layout 1 block=%d standalone=%d%c", &b, &sa, &tail) == 2 && b > 0 &&
            b <= (1 << 20) && sa >= 0 && sa <= 2) {
            pthread_mutex_lock(&r->mu);
            if (!r->layout_known) {
                r->layout_known = 1;
                r->B = b;
                r->standalone = sa;
            }
            *B = r->B;
            *standalone = r->standalone;
            pthread_mutex_unlock(&r->mu);
            ok = 1;
        }
    }
    kvt__rpipe_clear(&p);
    return ok;
}

/* ---- handles ------------------------------------------------------------------------ */

void kvt__remote_hslot_clear(kvt__rhandle *h)
{
    kvt__free(h->ns);
    kvt__free(h->tokens);
    kvt__free(h->keys);
    memset(h, 0, sizeof *h);
}

/* Stores a lookup's result; *h is moved in. @return the handle. */
uint64_t kvt__remote_handle_put(kvt_remote *r, kvt__rhandle *h)
{
    pthread_mutex_lock(&r->mu);
    uint64_t id = ++r->next_id;
    kvt__rhandle *s = &r->ring[id % KVT__REMOTE_HANDLES];
    kvt__rhandle old = *s;
    h->id = id;
    *s = *h;
    pthread_mutex_unlock(&r->mu);
    kvt__remote_hslot_clear(&old);
    memset(h, 0, sizeof *h);
    return id;
}

/* A copy of the slot of handle id. @return 0 or KVT_ENOTFOUND / KVT_ENOMEM. */
int kvt__remote_handle_get(kvt_remote *r, uint64_t id, kvt__rhandle *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&r->mu);
    const kvt__rhandle *s = &r->ring[id % KVT__REMOTE_HANDLES];
    if (!id || s->id != id) {
        pthread_mutex_unlock(&r->mu);
        return kvt__fail(KVT_ENOTFOUND, "remote tier: handle %llu is not a recent lookup", (unsigned long long)id);
    }
    *out = *s;
    out->ns = kvt__strdup(s->ns);
    out->tokens = kvt__malloc(sizeof(int32_t) * (size_t)(s->n_tokens ? s->n_tokens : 1));
    out->keys = kvt__malloc(sizeof(kvt__key) * (size_t)(s->n_keys ? s->n_keys : 1));
    if (out->ns && out->tokens && out->keys) {
        if (s->n_tokens)
            memcpy(out->tokens, s->tokens, sizeof(int32_t) * (size_t)s->n_tokens);
        if (s->n_keys)
            memcpy(out->keys, s->keys, sizeof(kvt__key) * (size_t)s->n_keys);
        pthread_mutex_unlock(&r->mu);
        return 0;
    }
    pthread_mutex_unlock(&r->mu);
    kvt__remote_hslot_clear(out);
    return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
}

/* Builds a slot: tokens = a[0..na) + b[0..nb); keys copied. */
int kvt__remote_hslot_make(kvt__rhandle *h, const char *ns, const int32_t *a, int64_t na, const int32_t *b, int64_t nb,
                           const kvt__key *keys, int32_t n_keys, int is_entry, kvt__key ekey)
{
    memset(h, 0, sizeof *h);
    h->ns = kvt__strdup(ns);
    h->tokens = kvt__malloc(sizeof(int32_t) * (size_t)(na + nb ? na + nb : 1));
    h->keys = kvt__malloc(sizeof(kvt__key) * (size_t)(n_keys ? n_keys : 1));
    if (!h->ns || !h->tokens || !h->keys) {
        kvt__remote_hslot_clear(h);
        return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
    }
    if (na)
        memcpy(h->tokens, a, sizeof(int32_t) * (size_t)na);
    if (nb)
        memcpy(h->tokens + na, b, sizeof(int32_t) * (size_t)nb);
    h->n_tokens = na + nb;
    if (n_keys)
        memcpy(h->keys, keys, sizeof(kvt__key) * (size_t)n_keys);
    h->n_keys = n_keys;
    h->is_entry = is_entry;
    h->ekey = ekey;
    return 0;
}

/* ---- the tier table ------------------------------------------------------------- */

int kvt__remote_store_now(kvt_remote *r, const kvt_entry *e)
{
    struct kvt_pool_reservation *res = NULL; /* in flight on the pool's remote axis while it is sent */
    int rc = e ? kvt__remote_pool_reserve(r, kvt__remote_entry_bytes(e), &res) : 0;
    if (!rc)
        rc = kvt__remote_store(r, e);
    kvt__remote_pool_drop(res);
    return rc;
}

static int t_stats(void *self, kvt_tier_stats *out)
{
    kvt_remote *r = self;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&r->mu);
    out->finds = r->st.lookups;
    out->find_hits = r->st.lookup_hits;
    out->restores = r->st.restores;
    out->restore_failures = r->st.restore_failures;
    out->stores = r->st.writes;
    out->write_failures = r->st.write_failures + r->st.dropped;
    out->behind_failures = r->behind_failed;
    out->behind_dropped = r->behind_dropped;
    out->entries = r->entries;
    out->bytes = r->bytes;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

void kvt__remote_layers_add(kvt_remote *r, const uint64_t *v, int32_t n)
{
    if (!v || n <= 0)
        return;
    if (n > r->n_layer_written) {
        uint64_t *x = kvt__realloc(r->layer_written, sizeof *x * (size_t)n);
        if (x) {
            memset(x + r->n_layer_written, 0, sizeof *x * (size_t)(n - r->n_layer_written));
            r->layer_written = x;
            r->n_layer_written = n;
        }
    }
    for (int32_t i = 0; i < n && i < r->n_layer_written; i++)
        r->layer_written[i] += v[i];
}

KVT_API int kvt_remote_layer_written_bytes(kvt_remote *r, int32_t n_layers, uint64_t *bytes)
{
    if (!r || n_layers < 0 || (n_layers > 0 && !bytes))
        return kvt__fail(KVT_EINVAL, "kvt_remote_layer_written_bytes: %s",
                         !r ? "remote is NULL" : n_layers < 0 ? "n_layers < 0" : "bytes is NULL");
    pthread_mutex_lock(&r->mu);
    for (int32_t i = 0; i < n_layers; i++)
        bytes[i] = i < r->n_layer_written ? r->layer_written[i] : 0;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

static int t_layer_bytes(void *self, int32_t n_layers, uint64_t *bytes)
{
    kvt_remote *r = self;
    pthread_mutex_lock(&r->mu);
    for (int32_t i = 0; i < n_layers && i < r->n_layer_written; i++)
        bytes[i] += r->layer_written[i];
    pthread_mutex_unlock(&r->mu);
    return KVT_LAYER_BYTES_WRITTEN;
}

KVT_API void kvt_remote_cold_tier(kvt_remote *r, kvt_cold_tier *out)
{
    memset(out, 0, sizeof *out);
    out->self = r;
    out->find = kvt__remote_find;
    out->find_exact = kvt__remote_find_exact;
    out->restore = kvt__remote_restore;
    out->restore_async = kvt__remote_restore_async;
    out->store = kvt__remote_store_sync;
    out->spill = kvt__remote_spill;
    out->pending = kvt__remote_pending;
    out->flush = kvt__remote_flush;
    out->withdraw = kvt__remote_withdraw;
    out->stats = t_stats;
    out->layer_bytes = t_layer_bytes;
}

/* ---- open / close ------------------------------------------------------------------- */

KVT_API int kvt_remote_open(const char *url, const kvt_store_identity *identity, const kvt_remote_options *opts,
                            kvt_remote **out)
{
    if (out)
        *out = NULL;
    if (!url || !out || !identity_ok(identity))
        return kvt__fail(KVT_EINVAL, "kvt_remote_open: NULL url, out or identity, or identity strings over 1024 bytes");
    kvt_remote_options o = {0};
    if (opts)
        o = *opts;
    if (o.lookup_timeout_ms < 0 || o.io_timeout_ms < 0 || o.connect_timeout_ms < 0 || o.fail_threshold < 0 ||
        o.ttl_s < 0 || o.queue_max_entries < 0 || o.restore_timeout_ms < 0)
        return kvt__fail(KVT_EINVAL, "kvt_remote_open: negative option");
    kvt__rconn_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    int rc = kvt_remote_url_parse(url, &cfg.url);
    if (rc)
        return rc;
    if (!cfg.url.password[0]) {
        const char *pw = o.password ? o.password : getenv("KVTIER_REDIS_PASSWORD");
        if (pw && strlen(pw) >= sizeof cfg.url.password) {
            memset(&cfg, 0, sizeof cfg);
            return kvt__fail(KVT_EINVAL, "kvt_remote_open: password too long");
        }
        if (pw)
            snprintf(cfg.url.password, sizeof cfg.url.password, "%s", pw);
    }
    cfg.cluster = o.cluster;
    cfg.connect_timeout_ms = o.connect_timeout_ms ? o.connect_timeout_ms : 200;
    cfg.fail_threshold = o.fail_threshold ? o.fail_threshold : 3;
    kvt_remote *r = kvt__calloc(1, sizeof *r);
    char *js = identity_json(identity);
    if (!r || !js) {
        kvt__free(r);
        free(js);
        memset(&cfg, 0, sizeof cfg);
        return kvt__fail(KVT_ENOMEM, "kvt_remote_open: out of memory");
    }
    r->seed = kvt__key_seed(js);
    free(js);
    char hex[33];
    kvt__key_hex(r->seed, hex);
    r->prefix_len = (size_t)snprintf(r->prefix, sizeof r->prefix, "kvt:%s:", hex);
    snprintf(r->host, sizeof r->host, "%s:%d", cfg.url.host, cfg.url.port);
    r->lookup_ms = o.lookup_timeout_ms ? o.lookup_timeout_ms : 50;
    r->io_ms = o.io_timeout_ms ? o.io_timeout_ms : 2000;
    r->restore_ms = o.restore_timeout_ms ? o.restore_timeout_ms : 1000;
    r->ttl_s = o.ttl_s;
    r->queue_max_bytes = o.queue_max_bytes ? o.queue_max_bytes : (256ull << 20);
    r->queue_max_entries = o.queue_max_entries ? o.queue_max_entries : 1024;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->q_mu, NULL);
    pthread_cond_init(&r->idle_cv, NULL);
    rc = kvt__remote_pool_join(r, &o);
    if (!rc)
        rc = kvt__rconn_create(&cfg, &r->conn);
    memset(&cfg, 0, sizeof cfg); /* the password copy */
    if (rc) {
        kvt_remote_close(r);
        return rc;
    }
    if ((rc = kvt__remote_worker_open(r, o.worker))) {
        kvt_remote_close(r);
        return rc;
    }
    /* first contact: the slot map of a cluster, else a PING */
    kvt__rfail f = KVT__RF_NONE;
    int up;
    if (o.cluster) {
        up = kvt__rconn_refresh(r->conn, r->lookup_ms > 200 ? r->lookup_ms : 200, &f) == 0;
    } else {
        kvt__rpipe p = {0};
        const char *av[1] = {"PING"};
        up = kvt__rpipe_add(&p, -1, 1, av, NULL) == 0 &&
             kvt__rconn_exec(r->conn, &p, r->lookup_ms > 200 ? r->lookup_ms : 200) == 0;
        kvt__rpipe_clear(&p);
    }
    if (!up) {
        kvt__rconn_mark_down(r->conn);
        if (!o.quiet)
            fprintf(stderr,
                    "kvtier: warning: redis %s is unreachable; running without the remote tier, retrying in the "
                    "background\n",
                    r->host);
    }
    kvt__clear_error();
    *out = r;
    return 0;
}

KVT_API int kvt_remote_close(kvt_remote *r)
{
    if (!r)
        return 0;
    int rc = kvt__remote_worker_close(r); /* every queued write runs first */
    kvt__remote_pool_leave(r);
    kvt__rconn_destroy(r->conn);
    for (int i = 0; i < KVT__REMOTE_HANDLES; i++)
        kvt__remote_hslot_clear(&r->ring[i]);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->q_mu);
    pthread_cond_destroy(&r->idle_cv);
    kvt__free(r->layer_written);
    kvt__free(r);
    return rc;
}
