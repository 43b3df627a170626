/*
 * tiers.c: the tier stack of chat and serve (tiers.h): the SSD level that
 * degrades instead of failing, and the stack composing the levels present
 * with a kvt_tier_chain.
 */
#include "tiers.h"

#include "util.h"

#include "kvtier/publish.h"
#include "kvtier/remote.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The store's config fingerprint of the model's fresh caches (layer count,
 * kinds, shapes). */
static int model_fingerprint(const kvt_model *m, char fp[KVT_STORE_FINGERPRINT_LEN])
{
    const kvt_model_config *c = kvt_model_get_config(m);
    kvt_cache *caches[KVT_MODEL_MAX_LAYERS] = {0};
    int rc = kvt_model_new_caches(m, 256, caches);
    if (rc)
        return rc;
    rc = kvt_store_config_fingerprint(caches, c->n_layers, fp);
    kvt_caches_destroy(caches, c->n_layers);
    return rc;
}

KVT_API int kvt_chat_store_open(const kvt_model *m, const kvt_chat_identity *ident, const char *root,
                                uint64_t max_bytes, int verify, kvt_store **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "chat store: out is NULL");
    *out = NULL;
    if (!m || !ident || !root)
        return kvt__fail(KVT_EINVAL, "chat store: model, identity and root are required");
    char fp[KVT_STORE_FINGERPRINT_LEN];
    int rc = model_fingerprint(m, fp);
    if (rc)
        return rc;
    kvt_store_identity id = {.model_id = ident->model_id, .config_fingerprint = fp,
                             .tokenizer_hash = ident->tokenizer_hash};
    kvt_store_options so = {.max_bytes = max_bytes, .verify = verify};
    return kvt_store_open(root, &id, &so, out);
}

/* ---- the SSD level: degrades instead of failing the command ------------------------ */

/* Whether rc says the disk failed (an errno, or the store's I/O code), rather
 * than the entry (too big, unsupported) or the caller. */
static int disk_error(int rc) { return rc == KVT_EIO || (rc < 0 && rc > -4096); }

struct kvt_ssd_level {
    pthread_mutex_t mu;
    kvt_store *store;            /* NULL when OFF from the start */
    kvt_cold_tier inner;         /* the store's own table; its flags say
                                    KVT_TIER_READ_ONLY when the store was
                                    opened read-only (the store refuses writes) */
    char *root;
    int tripped;                 /* a write failed since: writes are skipped */
    char cause[600];
    int warned, too_big;
    uint64_t open_failures, sync_failures, skipped;
    uint64_t seen_failed;        /* store's failed count already looked at */
    kvt_store_stats last;        /* the store's counters at the last poll */
};

/* The level's state: OFF without a store; READ_ONLY when the store was
 * opened read-only (its own mode, which its table reports) or a write failed
 * since; else READ_WRITE. d->mu held. */
static kvt_level_mode ssd_mode(const kvt_ssd_level *d)
{
    if (!d->store)
        return KVT_LEVEL_MODE_OFF;
    return d->tripped || (d->inner.flags & KVT_TIER_READ_ONLY) ? KVT_LEVEL_MODE_READ_ONLY
                                                               : KVT_LEVEL_MODE_READ_WRITE;
}

/* Turns the tier READ_ONLY (once) with the cause; d->mu held. */
static void ssd_trip(kvt_ssd_level *d, int rc, const char *detail)
{
    if (ssd_mode(d) != KVT_LEVEL_MODE_READ_WRITE)
        return;
    d->tripped = 1;
    const char *why = rc < 0 && rc > -4096 ? strerror(-rc) : kvt_strerror(rc);
    if (detail && *detail && !strstr(detail, why))
        snprintf(d->cause, sizeof d->cause, "%s: a write failed (%s): %s", d->root, why, detail);
    else if (detail && *detail)
        snprintf(d->cause, sizeof d->cause, "%s: a write failed: %s", d->root, detail);
    else
        snprintf(d->cause, sizeof d->cause, "%s: a write failed (%s)", d->root, why);
}

/* Whether a write failed since (then this write is skipped, counted). A
 * store opened read-only refuses writes itself (KVT_EREADONLY, counted in
 * its write_refused); the chain never sends it any, as its table says. */
static int ssd_writes_off(kvt_ssd_level *d)
{
    pthread_mutex_lock(&d->mu);
    int off = d->tripped;
    if (off)
        d->skipped++;
    pthread_mutex_unlock(&d->mu);
    return off;
}

static int ssd_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_ssd_level *d = self;
    if (!d->store)
        return KVT_ENOTFOUND;
    return d->inner.find(d->inner.self, prompt, n, ns, out);
}

static int ssd_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_ssd_level *d = self;
    if (!d->store || !d->inner.find_exact)
        return KVT_ENOTFOUND;
    return d->inner.find_exact(d->inner.self, tokens, n, ns, out);
}

static int ssd_restore(void *self, uint64_t handle, kvt_entry *out)
{
    kvt_ssd_level *d = self;
    if (!d->store) {
        memset(out, 0, sizeof *out);
        return KVT_ENOTFOUND;
    }
    return d->inner.restore(d->inner.self, handle, out);
}

static int ssd_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    kvt_ssd_level *d = self;
    if (!d->store || !d->inner.restore_async)
        return KVT_ENOTFOUND; /* done never runs: the prompt cache restores synchronously or misses */
    return d->inner.restore_async(d->inner.self, handle, done, arg);
}

static int ssd_store(void *self, const kvt_entry *e)
{
    kvt_ssd_level *d = self;
    if (!d->store || ssd_writes_off(d))
        return KVT_EIO; /* the caller keeps its entry */
    int rc = d->inner.store(d->inner.self, e);
    if (disk_error(rc)) {
        pthread_mutex_lock(&d->mu);
        d->sync_failures++;
        ssd_trip(d, rc, kvt_last_error());
        pthread_mutex_unlock(&d->mu);
    }
    return rc;
}

static int ssd_spill(void *self, kvt_entry *e)
{
    kvt_ssd_level *d = self;
    if (!d->store || !d->inner.spill || ssd_writes_off(d))
        return KVT_EIO; /* the caller disposes it: no spill */
    return d->inner.spill(d->inner.self, e);
}

static int ssd_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_ssd_level *d = self;
    if (!d->store || !d->inner.pending)
        return 0;
    return d->inner.pending(d->inner.self, tokens, n, ns);
}

/* Waits for the store's queue; a disk failure turns the tier READ_ONLY and is
 * not an error of the caller's (the command goes on); ETOOBIG is returned. */
static int ssd_flush_locked(kvt_ssd_level *d)
{
    pthread_mutex_unlock(&d->mu);
    int rc = kvt_store_flush(d->store);
    char detail[512];
    snprintf(detail, sizeof detail, "%s", rc ? kvt_last_error() : "");
    pthread_mutex_lock(&d->mu);
    kvt_store_get_stats(d->store, &d->last);
    d->seen_failed = d->last.failed;
    if (disk_error(rc)) {
        ssd_trip(d, rc, detail);
        return 0;
    }
    if (rc == KVT_ETOOBIG)
        d->too_big = 1;
    return rc;
}

static int ssd_flush(void *self)
{
    kvt_ssd_level *d = self;
    if (!d->store)
        return 0;
    pthread_mutex_lock(&d->mu);
    int rc = ssd_flush_locked(d);
    pthread_mutex_unlock(&d->mu);
    return rc;
}

/* The store's own tier counters (what a chain reports per level). */
static int ssd_stats(void *self, kvt_tier_stats *out)
{
    kvt_ssd_level *d = self;
    memset(out, 0, sizeof *out);
    return d->store ? d->inner.stats(d->inner.self, out) : 0;
}

/* The store's per-layer residency (0 for every layer while it is off). */
static int ssd_layer_bytes(void *self, int32_t n_layers, uint64_t *bytes)
{
    kvt_ssd_level *d = self;
    return d->store && d->inner.layer_bytes ? d->inner.layer_bytes(d->inner.self, n_layers, bytes)
                                            : KVT_LAYER_BYTES_RESIDENT;
}

/* The store's budget evictions go to fn (a chain demotes them into the level
 * below). Only while the store is open: close removes nothing (the chain
 * removes its hook before the level closes). */
static void ssd_set_evict(void *self, kvt_tier_evict_fn fn, void *arg)
{
    kvt_ssd_level *d = self;
    if (d->store && d->inner.set_evict)
        d->inner.set_evict(d->inner.self, fn, arg);
}

KVT_API void kvt_ssd_level_tier(kvt_ssd_level *d, kvt_cold_tier *tier)
{
    if (!tier)
        return;
    *tier = (kvt_cold_tier){.self = d,
                            .find = ssd_find,
                            .find_exact = ssd_find_exact,
                            .restore = ssd_restore,
                            .restore_async = ssd_restore_async,
                            .store = ssd_store,
                            .spill = ssd_spill,
                            .pending = ssd_pending,
                            .flush = ssd_flush,
                            .stats = ssd_stats,
                            .set_evict = ssd_set_evict,
                            .layer_bytes = ssd_layer_bytes,
                            /* the store's (read-only when it was opened so);
                             * read-only while OFF: a chain writes elsewhere */
                            .flags = d && d->store ? d->inner.flags : KVT_TIER_READ_ONLY};
}

KVT_API kvt_store *kvt_ssd_level_store(kvt_ssd_level *d) { return d ? d->store : NULL; }

KVT_API int kvt_ssd_level_open(const kvt_model *m, const kvt_chat_identity *ident, const char *root,
                              const kvt_ssd_level_opts *o, kvt_ssd_level **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "SSD cache: out is NULL");
    *out = NULL;
    if (!m || !ident || !root || !*root)
        return kvt__fail(KVT_EINVAL, "SSD cache: model, identity and a non-empty directory are required");
    kvt_ssd_level_opts none = {0};
    if (!o)
        o = &none;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    int rc = model_fingerprint(m, fp);
    if (rc)
        return rc;
    kvt_ssd_level *d = calloc(1, sizeof *d);
    if (!d || !(d->root = strdup(root))) {
        free(d);
        return kvt__fail(KVT_ENOMEM, "SSD cache: out of memory");
    }
    pthread_mutex_init(&d->mu, NULL);
    kvt_store_identity id = {.model_id = ident->model_id, .config_fingerprint = fp,
                             .tokenizer_hash = ident->tokenizer_hash};
    /* the store waits for a lock another process holds at most
     * lock_wait_ms, on this thread, and never blocks in flock */
    uint64_t wait_ms = o->lock_wait_ms ? o->lock_wait_ms : 1000;
    kvt_store_options so = {.max_bytes = o->max_bytes, .verify = o->verify, .io = o->io, .lock_wait_ms = wait_ms,
                            .pool = o->pool};
    rc = kvt_store_open(root, &id, &so, &d->store);
    if (rc == KVT_EINVAL || rc == KVT_ENOMEM || /* the flags, not the disk; or the pool's refusal */
        (o->pool && (rc == KVT_EAGAIN || rc == KVT_ELIMIT))) {
        char err[512];
        snprintf(err, sizeof err, "%s", kvt_last_error());
        kvt_ssd_level_close(d, NULL);
        return kvt__fail(rc, "%s", err);
    }
    if (rc) {
        d->store = NULL;
        d->open_failures = 1;
        if (rc == KVT_EBUSY)
            snprintf(d->cause, sizeof d->cause, "%s: its lock is held by another process (waited %llu ms)", root,
                     (unsigned long long)wait_ms);
        else
            snprintf(d->cause, sizeof d->cause, "%s: cannot be opened for writing (%s)", root,
                     kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
        /* the same directory read-only (the store's own mode: its table
         * says KVT_TIER_READ_ONLY): what it holds still serves */
        so.read_only = 1;
        if (disk_error(rc) || rc == KVT_EBUSY)
            (void)kvt_store_open(root, &id, &so, &d->store); /* NULL on failure: OFF */
    }
    if (d->store) {
        kvt_store_cold_tier(d->store, &d->inner);
        kvt_store_get_stats(d->store, &d->last);
        d->seen_failed = d->last.failed;
    }
    *out = d;
    return 0;
}

/* Fills *st; d->mu held. */
static void ssd_status(kvt_ssd_level *d, kvt_level_status *st)
{
    if (!st)
        return;
    memset(st, 0, sizeof *st);
    snprintf(st->name, sizeof st->name, "ssd");
    snprintf(st->label, sizeof st->label, "SSD cache");
    snprintf(st->where, sizeof st->where, "%s", d->root);
    st->mode = ssd_mode(d);
    snprintf(st->cause, sizeof st->cause, "%s", d->cause);
    st->warn = st->mode != KVT_LEVEL_MODE_READ_WRITE && !d->warned;
    if (st->warn)
        d->warned = 1;
    st->open_failures = d->open_failures;
    st->write_failures = d->last.failed > d->sync_failures ? d->last.failed : d->sync_failures;
    st->writes_skipped = d->skipped + d->last.write_refused;
    st->entries = d->last.entries;
    st->restores = d->last.restores;
}

KVT_API void kvt_ssd_level_poll(kvt_ssd_level *d, kvt_level_status *st)
{
    if (!d) {
        if (st)
            memset(st, 0, sizeof *st);
        return;
    }
    pthread_mutex_lock(&d->mu);
    if (d->store) {
        kvt_store_get_stats(d->store, &d->last);
        if (d->last.failed > d->seen_failed && ssd_mode(d) == KVT_LEVEL_MODE_READ_WRITE)
            (void)ssd_flush_locked(d); /* learns the cause */
    }
    ssd_status(d, st);
    pthread_mutex_unlock(&d->mu);
}

KVT_API int kvt_ssd_level_close(kvt_ssd_level *d, kvt_level_status *st)
{
    if (!d) {
        if (st)
            memset(st, 0, sizeof *st);
        return 0;
    }
    int ret = 0;
    pthread_mutex_lock(&d->mu);
    if (d->store) {
        (void)ssd_flush_locked(d);
        pthread_mutex_unlock(&d->mu);
        int rc = kvt_store_close(d->store); /* nothing queued: says what failed since the flush */
        pthread_mutex_lock(&d->mu);
        /* d->store is no longer used, only its being set (the last state) */
        if (disk_error(rc))
            ssd_trip(d, rc, kvt_last_error());
        else if (rc == KVT_ETOOBIG)
            d->too_big = 1;
    }
    if (d->too_big)
        ret = KVT_ETOOBIG;
    ssd_status(d, st);
    d->store = NULL;
    pthread_mutex_unlock(&d->mu);
    pthread_mutex_destroy(&d->mu);
    free(d->root);
    free(d);
    return ret;
}

KVT_API const char *kvt_level_mode_name(kvt_level_mode m)
{
    return m == KVT_LEVEL_MODE_READ_WRITE ? "read-write" : m == KVT_LEVEL_MODE_READ_ONLY ? "read-only" : "off";
}

/* ---- the stack -------------------------------------------------------------------- */

/* One level of the stack: its cold-tier table for the chain and its own life
 * (poll, close). A new kind of level adds an open function below and fills
 * one of these. */
typedef struct stack_level {
    void *self;
    char name[KVT_TIER_NAME_MAX]; /* in the report and metric labels: "ssd", "redis", "published[:N]" */
    kvt_cold_tier tier;          /* given to the chain */
    int32_t find_budget_ms;      /* the chain's lookup time budget for it */
    uint32_t chain_flags;        /* KVT_LEVEL_NO_PROMOTE / KVT_LEVEL_NO_DEMOTE */
    void (*poll)(void *self, kvt_level_status *st);
    int (*close)(void *self, kvt_level_status *st); /* 0 or KVT_ETOOBIG */
    kvt_store *(*store)(void *self);                /* NULL for levels without a store */
} stack_level;

struct kvt_tiers {
    stack_level lv[KVT_TIER_CHAIN_MAX];
    int32_t n;
    kvt_tier_chain *chain;       /* NULL when n == 0 */
    kvt_cold_tier table;         /* the chain's */
};

static void ssd_poll_fn(void *self, kvt_level_status *st) { kvt_ssd_level_poll(self, st); }
static int ssd_close_fn(void *self, kvt_level_status *st) { return kvt_ssd_level_close(self, st); }
static kvt_store *ssd_store_fn(void *self) { return kvt_ssd_level_store(self); }

static int open_ssd(kvt_tiers *t, const kvt_model *m, const kvt_chat_identity *id, const kvt_tiers_opts *o)
{
    kvt_ssd_level_opts so = {.max_bytes = o->ssd_max_bytes, .verify = o->ssd_verify,
                             .lock_wait_ms = o->ssd_lock_wait_ms, .io = o->ssd_io, .pool = o->ssd_pool};
    kvt_ssd_level *d = NULL;
    int rc = kvt_ssd_level_open(m, id, o->ssd_dir, &so, &d);
    if (rc)
        return rc;
    stack_level *l = &t->lv[t->n++];
    l->self = d;
    snprintf(l->name, sizeof l->name, "ssd");
    kvt_ssd_level_tier(d, &l->tier);
    l->poll = ssd_poll_fn;
    l->close = ssd_close_fn;
    l->store = ssd_store_fn;
    return 0;
}

/* ---- the remote tier: a shared Redis under the SSD tier ---------------------------- */

/* --redis URL: the remote tier (kvtier/remote.h). Every kept prefix is also
 * written behind into it (KVT_LEVEL_WRITE_BEHIND), so other hosts find it;
 * its lookups are bounded by the chain's budget. The level is READ_WRITE
 * while Redis answers and OFF while the tier skips it (unreachable; it
 * retries in the background), warned about once per outage. */
typedef struct redis_level {
    pthread_mutex_t mu;
    kvt_remote *r;
    char where[300];       /* host:port, never the password */
    uint64_t outages_said; /* unhealthy transitions warned about; under mu */
    int down_said;         /* an outage is being reported; under mu */
} redis_level;

static void redis_poll_fn(void *self, kvt_level_status *st)
{
    redis_level *l = self;
    memset(st, 0, sizeof *st);
    snprintf(st->name, sizeof st->name, "redis");
    snprintf(st->label, sizeof st->label, "Redis cache");
    snprintf(st->where, sizeof st->where, "%s", l->where);
    kvt_remote_stats rs;
    kvt_remote_stats_get(l->r, &rs);
    st->mode = rs.healthy ? KVT_LEVEL_MODE_READ_WRITE : KVT_LEVEL_MODE_OFF;
    st->write_failures = rs.write_failures;
    st->writes_skipped = rs.dropped;
    st->entries = rs.writes;
    st->restores = rs.restores;
    if (!rs.healthy)
        snprintf(st->cause, sizeof st->cause,
                 "redis %s does not answer (%llu timeouts, %llu connection failures so far); retrying in the "
                 "background",
                 l->where, (unsigned long long)rs.failures_timeout, (unsigned long long)rs.failures_conn);
    pthread_mutex_lock(&l->mu);
    if (!rs.healthy && (!l->down_said || rs.unhealthy_transitions > l->outages_said)) {
        st->warn = 1;
        l->down_said = 1;
        l->outages_said = rs.unhealthy_transitions;
    } else if (rs.healthy) {
        l->down_said = 0;
    }
    pthread_mutex_unlock(&l->mu);
}

static int redis_close_fn(void *self, kvt_level_status *st)
{
    redis_level *l = self;
    if (st)
        redis_poll_fn(l, st);
    kvt_remote_close(l->r);
    pthread_mutex_destroy(&l->mu);
    free(l);
    return 0;
}

/* The remote tier's flush, as the level's: Redis is a cache, so a write that
 * failed (counted in the tier's write_failures, in /stats and chat --stats)
 * is not an error of the command's, as a disk error is not for the SSD level. */
static int redis_flush_fn(void *self)
{
    kvt_cold_tier t;
    kvt_remote_cold_tier(self, &t);
    (void)t.flush(self);
    return 0;
}

static int open_redis(kvt_tiers *t, const kvt_model *m, const kvt_chat_identity *id, const kvt_tiers_opts *o)
{
    char fp[KVT_STORE_FINGERPRINT_LEN];
    int rc = model_fingerprint(m, fp);
    if (rc)
        return rc;
    kvt_store_identity sid = {.model_id = id->model_id, .config_fingerprint = fp, .tokenizer_hash = id->tokenizer_hash};
    kvt_remote_url u;
    if ((rc = kvt_remote_url_parse(o->redis_url, &u)))
        return rc;
    redis_level *l = calloc(1, sizeof *l);
    if (!l)
        return kvt__fail(KVT_ENOMEM, "tier stack: out of memory");
    snprintf(l->where, sizeof l->where, "%s:%d", u.host, u.port);
    memset(&u, 0, sizeof u);
    kvt_remote_options ro = {.cluster = o->redis_cluster, .lookup_timeout_ms = o->redis_timeout_ms,
                             .restore_timeout_ms = o->redis_restore_timeout_ms,
                             .ttl_s = o->redis_ttl_s, .quiet = 1, .pool = o->redis_pool,
                             .pool_name = o->redis_pool_name};
    if ((rc = kvt_remote_open(o->redis_url, &sid, &ro, &l->r))) {
        free(l);
        return rc;
    }
    pthread_mutex_init(&l->mu, NULL);
    stack_level *sl = &t->lv[t->n++];
    sl->self = l;
    snprintf(sl->name, sizeof sl->name, "redis");
    kvt_remote_cold_tier(l->r, &sl->tier);
    sl->tier.flush = redis_flush_fn;
    sl->find_budget_ms = (o->redis_timeout_ms ? o->redis_timeout_ms : 50) + 10;
    sl->chain_flags = KVT_LEVEL_WRITE_BEHIND;
    sl->poll = redis_poll_fn;
    sl->close = redis_close_fn;
    return 0;
}

kvt_remote *kvt_tiers_remote(kvt_tiers *t)
{
    for (int32_t i = 0; t && i < t->n; i++)
        if (t->lv[i].poll == redis_poll_fn)
            return ((redis_level *)t->lv[i].self)->r;
    return NULL;
}

/* ---- published prompt caches: read-only levels at the bottom -------------------- */

/* One --prompt-cache-dir: the read-only tier over its CURRENT generation
 * (kvtier/publish.h), which picks up a new publication by itself. Its mode
 * is READ_ONLY while a generation is mounted and OFF while none is; a
 * refused generation is warned about once (the mounted one keeps serving). */
typedef struct pub_level {
    pthread_mutex_t mu;
    kvt_published *p;
    char *dir;
    uint64_t refusals_said; /* refusals already warned about; under mu */
    int off_said;           /* "nothing mounted" warned about; under mu */
} pub_level;

static void pub_poll_fn(void *self, kvt_level_status *st)
{
    pub_level *l = self;
    memset(st, 0, sizeof *st);
    snprintf(st->name, sizeof st->name, "published");
    snprintf(st->label, sizeof st->label, "published prompt cache");
    snprintf(st->where, sizeof st->where, "%s", l->dir);
    kvt_published_status ps;
    kvt_published_get_status(l->p, &ps);
    kvt_cold_tier t;
    kvt_tier_stats ts;
    kvt_published_cold_tier(l->p, &t);
    t.stats(t.self, &ts);
    st->entries = ts.entries;
    st->restores = ts.restores;
    st->mode = ps.generation[0] ? KVT_LEVEL_MODE_READ_ONLY : KVT_LEVEL_MODE_OFF;
    memcpy(st->generation, ps.generation, sizeof st->generation);
    if (ps.refusals)
        snprintf(st->cause, sizeof st->cause, "%.150s: generation %s refused (%s): %.300s%s%s", l->dir,
                 ps.last_refused, kvt_publish_refusal_name(ps.last_refusal), ps.last_detail,
                 ps.generation[0] ? "; still serving generation " : "", ps.generation);
    else if (!ps.generation[0])
        snprintf(st->cause, sizeof st->cause, "%.400s: nothing published yet (no CURRENT); mounted once published",
                 l->dir);
    pthread_mutex_lock(&l->mu);
    if (ps.refusals > l->refusals_said) {
        st->warn = 1;
        l->refusals_said = ps.refusals;
    } else if (!ps.generation[0] && !l->off_said) {
        st->warn = 1;
    }
    if (!ps.generation[0])
        l->off_said = 1;
    pthread_mutex_unlock(&l->mu);
}

static int pub_close_fn(void *self, kvt_level_status *st)
{
    pub_level *l = self;
    if (st)
        pub_poll_fn(l, st);
    kvt_published_close(l->p);
    pthread_mutex_destroy(&l->mu);
    free(l->dir);
    free(l);
    return 0;
}

/* nth: 1-based among the published levels; 0 when it is the only one */
static int open_published(kvt_tiers *t, const kvt_model *m, const kvt_chat_identity *id, const char *dir, int nth)
{
    if (t->n >= KVT_TIER_CHAIN_MAX)
        return kvt__fail(KVT_EINVAL, "tier stack: at most %d levels (SSD, remote and published caches together)",
                         KVT_TIER_CHAIN_MAX);
    char fp[KVT_STORE_FINGERPRINT_LEN];
    int rc = model_fingerprint(m, fp);
    if (rc)
        return rc;
    kvt_store_identity sid = {.model_id = id->model_id, .config_fingerprint = fp, .tokenizer_hash = id->tokenizer_hash};
    pub_level *l = calloc(1, sizeof *l);
    if (!l || !(l->dir = strdup(dir))) {
        free(l);
        return kvt__fail(KVT_ENOMEM, "tier stack: out of memory");
    }
    if ((rc = kvt_published_open(dir, &sid, NULL, &l->p))) {
        free(l->dir);
        free(l);
        return rc;
    }
    pthread_mutex_init(&l->mu, NULL);
    stack_level *sl = &t->lv[t->n++];
    sl->self = l;
    if (nth)
        snprintf(sl->name, sizeof sl->name, "published:%d", nth);
    else
        snprintf(sl->name, sizeof sl->name, "published");
    kvt_published_cold_tier(l->p, &sl->tier);
    sl->chain_flags = KVT_LEVEL_NO_PROMOTE | KVT_LEVEL_NO_DEMOTE;
    sl->poll = pub_poll_fn;
    sl->close = pub_close_fn;
    return 0;
}

/* Closes the levels upper first (a level's entry promoted into the one above
 * may hold a share of the lower level's release hook), after the chain. */
static int close_levels(kvt_tiers *t, kvt_tiers_status *st)
{
    int ret = 0;
    kvt_tier_chain_destroy(t->chain);
    t->chain = NULL;
    for (int32_t i = 0; i < t->n; i++) {
        kvt_level_status ls;
        int rc = t->lv[i].close(t->lv[i].self, &ls);
        if (rc && !ret)
            ret = rc;
        if (st)
            st->level[i] = ls;
    }
    if (st)
        st->n_levels = t->n;
    t->n = 0;
    return ret;
}

KVT_API int kvt_tiers_open(const kvt_model *m, const kvt_chat_identity *id, const kvt_tiers_opts *o,
                           kvt_tiers **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "tier stack: out is NULL");
    *out = NULL;
    if (!m || !o)
        return kvt__fail(KVT_EINVAL, "tier stack: model and options are required");
    if (o->ssd_dir && !*o->ssd_dir)
        return kvt__fail(KVT_EINVAL, "tier stack: the SSD cache directory is empty");
    if (o->n_prompt_cache_dirs < 0 || (o->n_prompt_cache_dirs > 0 && !o->prompt_cache_dirs))
        return kvt__fail(KVT_EINVAL, "tier stack: %d published cache directories and a %s array",
                         o->n_prompt_cache_dirs, o->prompt_cache_dirs ? "non-NULL" : "NULL");
    if (o->write_queue < 0)
        return kvt__fail(KVT_EINVAL, "tier stack: write_queue %d is negative", (int)o->write_queue);
    if (o->redis_url) {
        kvt_remote_url u;
        int urc = kvt_remote_url_parse(o->redis_url, &u);
        memset(&u, 0, sizeof u);
        if (urc)
            return urc;
    }
    if (o->redis_timeout_ms < 0 || o->redis_restore_timeout_ms < 0 || o->redis_ttl_s < 0)
        return kvt__fail(KVT_EINVAL, "tier stack: negative Redis timeout or TTL");
    for (int i = 0; i < o->n_prompt_cache_dirs; i++)
        if (!o->prompt_cache_dirs[i] || !*o->prompt_cache_dirs[i])
            return kvt__fail(KVT_EINVAL, "tier stack: published cache directory %d is empty", i + 1);
    if ((o->ssd_dir || o->redis_url || o->n_prompt_cache_dirs > 0) && !id)
        return kvt__fail(KVT_EINVAL, "tier stack: a level needs the model's identity");
    kvt_tiers *t = calloc(1, sizeof *t);
    if (!t)
        return kvt__fail(KVT_ENOMEM, "tier stack: out of memory");
    int rc = 0;
    if (o->ssd_dir)
        rc = open_ssd(t, m, id, o);
    if (rc == 0 && o->redis_url)
        rc = open_redis(t, m, id, o);
    for (int i = 0; rc == 0 && i < o->n_prompt_cache_dirs; i++)
        rc = open_published(t, m, id, o->prompt_cache_dirs[i], o->n_prompt_cache_dirs > 1 ? i + 1 : 0);
    if (rc == 0 && t->n > 0) {
        kvt_tier_level lv[KVT_TIER_CHAIN_MAX];
        for (int32_t i = 0; i < t->n; i++)
            lv[i] = (kvt_tier_level){.tier = t->lv[i].tier, .find_budget_ms = t->lv[i].find_budget_ms,
                                     .flags = t->lv[i].chain_flags, .name = t->lv[i].name};
        kvt_tier_chain_config cc = {.levels = lv, .n_levels = t->n, .write_queue = o->write_queue};
        rc = kvt_tier_chain_create(&cc, &t->chain);
        if (rc == 0)
            kvt_tier_chain_cold_tier(t->chain, &t->table);
    }
    if (rc) {
        char err[512];
        snprintf(err, sizeof err, "%s", kvt_last_error());
        close_levels(t, NULL);
        free(t);
        return kvt__fail(rc, "%s", err);
    }
    *out = t;
    return 0;
}

KVT_API int kvt_tiers_cold_tier(kvt_tiers *t, kvt_cold_tier *out)
{
    if (!t || !out)
        return kvt__fail(KVT_EINVAL, "kvt_tiers_cold_tier: %s is NULL", t ? "out" : "stack");
    if (!t->chain) {
        memset(out, 0, sizeof *out);
        return KVT_ENOTFOUND;
    }
    *out = t->table;
    return 0;
}

KVT_API int32_t kvt_tiers_levels(const kvt_tiers *t) { return t ? t->n : 0; }

KVT_API kvt_tier_chain *kvt_tiers_chain(kvt_tiers *t) { return t ? t->chain : NULL; }

KVT_API kvt_store *kvt_tiers_store(kvt_tiers *t)
{
    if (!t)
        return NULL;
    for (int32_t i = 0; i < t->n; i++)
        if (t->lv[i].store)
            return t->lv[i].store(t->lv[i].self);
    return NULL;
}

KVT_API void kvt_tiers_poll(kvt_tiers *t, kvt_tiers_status *st)
{
    if (!st)
        return;
    st->n_levels = t ? t->n : 0;
    for (int32_t i = 0; i < st->n_levels; i++)
        t->lv[i].poll(t->lv[i].self, &st->level[i]);
}

KVT_API int kvt_tiers_say(const kvt_tiers_status *st, const char *prog, const char *counted, FILE *f)
{
    int lines = 0;
    for (int32_t i = 0; st && i < st->n_levels; i++) {
        const kvt_level_status *l = &st->level[i];
        if (!l->warn)
            continue;
        fprintf(f, "%s: warning: %s %s; %s (replies are unaffected; %s)\n", prog, l->label, l->cause,
                l->mode == KVT_LEVEL_MODE_OFF
                    ? "continuing without it"
                    : "continuing read-only: what it holds still serves, nothing more is written",
                counted);
        lines++;
    }
    if (lines)
        fflush(f);
    return lines;
}

KVT_API int kvt_tiers_warn(kvt_tiers *t, const char *prog, const char *counted, FILE *f)
{
    kvt_tiers_status st;
    kvt_tiers_poll(t, &st);
    return kvt_tiers_say(&st, prog, counted, f);
}

KVT_API int kvt_tiers_close(kvt_tiers *t, kvt_tiers_status *st)
{
    if (st)
        memset(st, 0, sizeof *st);
    if (!t)
        return 0;
    int ret = 0;
    if (t->chain) {
        /* queued promotions and demotions, then every level's write-behind;
         * a level's disk failure is its degradation (reported in st), and
         * ETOOBIG is what each level's close returns below */
        (void)t->table.flush(t->table.self);
    }
    ret = close_levels(t, st);
    free(t);
    return ret;
}
