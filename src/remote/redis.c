/*
 * redis.c: the remote tier (kvtier/remote.h, DESIGN.md section 5): the
 * kvt_cold_tier over Redis. Owns the identity's key prefix and layout, the
 * lookups (pipelined EXISTS of a prompt's block keys, then the children of
 * the last node reached for a match inside the next block), the handle
 * table of recent lookups, restores (pipelined GETs, every record validated
 * against what was asked before a byte is used; a bad record is counted and
 * deleted), stores (blocks Redis holds already are not sent again) and the
 * bounded write-behind queue with its writer thread.
 * It must never serve a record it has not validated, never hand out a
 * shortened entry for a handle, and never wait on Redis longer than the
 * call's timeout.
 */
#include "remote_internal.h"

#include <hiredis.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HANDLES 256
#define KEY_MAX 96
#define PIPE_BYTES (32u << 20) /* record bytes per write pipeline */

typedef struct hslot {
    uint64_t id;      /* 0: empty */
    char *ns;
    int32_t *tokens;  /* (n_tokens): what the restored entry holds */
    int64_t n_tokens;
    kvt__key *keys;   /* (n_keys) block keys in chain order */
    int32_t n_keys;
    int is_entry;
    kvt__key ekey;
} hslot;

typedef struct wjob {
    kvt_entry e;
    uint64_t bytes;
    struct wjob *next;
} wjob;

struct kvt_remote {
    kvt__rconn *conn;
    kvt__key seed;
    char prefix[48];
    size_t prefix_len;
    char host[300];  /* host:port for messages (never the password) */
    int32_t lookup_ms, io_ms;
    int64_t ttl_s;
    uint64_t queue_max_bytes;
    int32_t queue_max_entries;

    pthread_mutex_t mu; /* layout, handles, stats */
    int layout_known, layout_written;
    int32_t B;
    int standalone;
    hslot ring[HANDLES];
    uint64_t next_id;
    kvt_remote_stats st;
    uint64_t entries, bytes; /* new entries and record bytes this tier wrote */

    /* write-behind */
    pthread_mutex_t q_mu;
    pthread_cond_t q_cv, idle_cv;
    wjob *q_head, *q_tail, *inflight;
    int32_t q_n;
    uint64_t q_bytes;
    int closing;
    int flush_rc;
    pthread_t writer;
    int writer_started;
};

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Milliseconds left before deadline (at least 1). */
static int32_t left_ms(int64_t deadline)
{
    int64_t l = deadline - mono_ms();
    return l < 1 ? 1 : (int32_t)l;
}

/* ---- keys --------------------------------------------------------------------------- */

static size_t key_name(const kvt_remote *r, char type, kvt__key k, char out[KEY_MAX])
{
    char hex[33];
    kvt__key_hex(k, hex);
    return (size_t)snprintf(out, KEY_MAX, "%s%c%s", r->prefix, type, hex);
}

/* The node a chain position hangs off: the last block's key, or the root of ns. */
static kvt__key node_key(const kvt_remote *r, const char *ns, const kvt__key *keys, int32_t run)
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

#define BUMP(r, field, n)                                                                                       \
    do {                                                                                                        \
        pthread_mutex_lock(&(r)->mu);                                                                           \
        (r)->st.field += (n);                                                                                   \
        pthread_mutex_unlock(&(r)->mu);                                                                         \
    } while (0)

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
    out->healthy = kvt__rconn_down(r->conn) == 0;
    pthread_mutex_lock(&r->q_mu);
    out->queued_entries = (uint64_t)r->q_n + (r->inflight != NULL);
    out->queued_bytes = r->q_bytes + (r->inflight ? r->inflight->bytes : 0);
    pthread_mutex_unlock(&r->q_mu);
    return 0;
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
static int all_down(kvt_remote *r) { return kvt__rconn_down(r->conn) >= kvt__rconn_nodes(r->conn); }

/* ---- layout ------------------------------------------------------------------------- */

/* Learns the identity's block size and standalone flag from Redis (once).
 * @return 1 known, 0 not (yet). */
static int layout_get(kvt_remote *r, int32_t timeout_ms, int32_t *B, int *standalone)
{
    pthread_mutex_lock(&r->mu);
    int known = r->layout_known;
    *B = r->B;
    *standalone = r->standalone;
    pthread_mutex_unlock(&r->mu);
    if (known)
        return 1;
    char key[KEY_MAX];
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
            b <= (1 << 20) && (sa == 0 || sa == 1)) {
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

static void hslot_clear(hslot *h)
{
    kvt__free(h->ns);
    kvt__free(h->tokens);
    kvt__free(h->keys);
    memset(h, 0, sizeof *h);
}

/* Stores a lookup's result; *h is moved in. @return the handle. */
static uint64_t handle_put(kvt_remote *r, hslot *h)
{
    pthread_mutex_lock(&r->mu);
    uint64_t id = ++r->next_id;
    hslot *s = &r->ring[id % HANDLES];
    hslot old = *s;
    h->id = id;
    *s = *h;
    pthread_mutex_unlock(&r->mu);
    hslot_clear(&old);
    memset(h, 0, sizeof *h);
    return id;
}

/* A copy of the slot of handle id. @return 0 or KVT_ENOTFOUND / KVT_ENOMEM. */
static int handle_get(kvt_remote *r, uint64_t id, hslot *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&r->mu);
    const hslot *s = &r->ring[id % HANDLES];
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
    hslot_clear(out);
    return kvt__fail(KVT_ENOMEM, "remote tier: out of memory");
}

/* Builds a slot: tokens = a[0..na) + b[0..nb); keys copied. */
static int hslot_make(hslot *h, const char *ns, const int32_t *a, int64_t na, const int32_t *b, int64_t nb,
                      const kvt__key *keys, int32_t n_keys, int is_entry, kvt__key ekey)
{
    memset(h, 0, sizeof *h);
    h->ns = kvt__strdup(ns);
    h->tokens = kvt__malloc(sizeof(int32_t) * (size_t)(na + nb ? na + nb : 1));
    h->keys = kvt__malloc(sizeof(kvt__key) * (size_t)(n_keys ? n_keys : 1));
    if (!h->ns || !h->tokens || !h->keys) {
        hslot_clear(h);
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

/* ---- lookups ------------------------------------------------------------------------ */

static int64_t common(const int32_t *a, const int32_t *b, int64_t n)
{
    int64_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* A children field: 'b' or 'e' then the 16-byte key; value: u8 flags, 3 zero
 * bytes, tokens (int32 little-endian). */
static size_t kid_field(char type, kvt__key k, char out[17])
{
    out[0] = type;
    memcpy(out + 1, &k.lo, 8);
    memcpy(out + 9, &k.hi, 8);
    return 17;
}

typedef struct best {
    int64_t prefix;   /* usable tokens */
    hslot h;
    int have;
} best;

static void best_set(best *b, int64_t prefix, hslot *h)
{
    hslot_clear(&b->h);
    b->h = *h;
    b->prefix = prefix;
    b->have = 1;
    memset(h, 0, sizeof *h);
}

static int do_find(kvt_remote *r, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out, int exact)
{
    memset(out, 0, sizeof *out);
    BUMP(r, lookups, 1);
    if (all_down(r)) {
        BUMP(r, lookups_skipped, 1);
        return KVT_ENOTFOUND;
    }
    if (n < 0 || (n > 0 && !prompt))
        return kvt__fail(KVT_EINVAL, "remote find: bad prompt");
    const int64_t deadline = mono_ms() + r->lookup_ms;
    int32_t B = 0;
    int standalone = 0;
    int known = layout_get(r, r->lookup_ms, &B, &standalone);
    int64_t nb = known ? n / B : 0;
    kvt__key *keys = kvt__malloc(sizeof *keys * (size_t)(nb ? nb : 1));
    char (*names)[KEY_MAX] = kvt__malloc(KEY_MAX * (size_t)(2 * nb + 2));
    size_t *lens = kvt__malloc(sizeof *lens * (size_t)(2 * nb + 2));
    kvt__rpipe p = {0};
    best bst = {0}, kb = {0};
    int rc = 0;
    if (!keys || !names || !lens) {
        rc = kvt__fail(KVT_ENOMEM, "remote find: out of memory");
        goto out;
    }
    kvt__key parent = KVT__KEY_ZERO;
    for (int64_t j = 0; j < nb; j++)
        parent = keys[j] = kvt__block_key(r->seed, ns, parent, prompt + j * B, B);

    /* round trip 1: the prompt's blocks (and entries at block boundaries
     * when blocks alone do not rebuild a prefix); exact: the entry itself */
    int32_t ne = 0, i_exact = -1;
    for (int64_t j = 0; j < nb; j++) {
        lens[j] = key_name(r, 'b', keys[j], names[j]);
        const char *av[2] = {"EXISTS", names[j]};
        size_t al[2] = {6, lens[j]};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
    }
    if (exact) {
        kvt__key ek = kvt__entry_key(r->seed, ns, prompt, n);
        lens[nb] = key_name(r, 'e', ek, names[nb]);
        const char *av[2] = {"EXISTS", names[nb]};
        size_t al[2] = {6, lens[nb]};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
        i_exact = (int32_t)nb;
    } else if (known && !standalone) {
        for (int64_t j = 1; j <= nb && j * B <= n - 1; j++, ne++) {
            kvt__key ek = kvt__entry_key(r->seed, ns, prompt, j * B);
            lens[nb + j] = key_name(r, 'e', ek, names[nb + j]);
            const char *av[2] = {"EXISTS", names[nb + j]};
            size_t al[2] = {6, lens[nb + j]};
            if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
                goto out;
        }
    }
    int64_t run = 0;
    int failed = 0;
    if (p.n) {
        kvt__rconn_exec(r->conn, &p, left_ms(deadline)); /* a missing reply counts as absent */
        failed = p.fail != KVT__RF_NONE;
        while (run < nb && p.cmds[run].reply && ((redisReply *)p.cmds[run].reply)->type == REDIS_REPLY_INTEGER &&
               ((redisReply *)p.cmds[run].reply)->integer == 1)
            run++;
    }
    hslot h;
    if (exact) {
        redisReply *e = p.cmds[i_exact].reply;
        int have_e = e && e->type == REDIS_REPLY_INTEGER && e->integer == 1;
        int64_t need = known ? n / B : 0;
        if (have_e && run >= need) {
            if ((rc = hslot_make(&h, ns, prompt, n, NULL, 0, keys, (int32_t)need, 1,
                                 kvt__entry_key(r->seed, ns, prompt, n))))
                goto out;
            best_set(&bst, n, &h);
        } else if (known && standalone && n > 0 && n % B == 0 && run == nb) {
            if ((rc = hslot_make(&h, ns, prompt, n, NULL, 0, keys, (int32_t)nb, 0, KVT__KEY_ZERO)))
                goto out;
            best_set(&bst, n, &h);
        }
        goto done;
    }
    if (standalone && run > 0) {
        if ((rc = hslot_make(&h, ns, prompt, run * B, NULL, 0, keys, (int32_t)run, 0, KVT__KEY_ZERO)))
            goto out;
        best_set(&bst, KVT__MIN(run * B, n - 1), &h);
    } else if (known && !standalone) {
        for (int64_t j = KVT__MIN(run, (int64_t)ne); j >= 1; j--) {
            redisReply *e = p.cmds[nb + j - 1].reply;
            if (e && e->type == REDIS_REPLY_INTEGER && e->integer == 1) {
                if ((rc = hslot_make(&h, ns, prompt, j * B, NULL, 0, keys, (int32_t)j, 1,
                                     kvt__entry_key(r->seed, ns, prompt, j * B))))
                    goto out;
                best_set(&bst, j * B, &h);
                break;
            }
        }
    }
    kvt__rpipe_clear(&p);

    /* round trip 2: the children of the node reached, for a longer match
     * inside the next block (a partial block, an entry's tail) */
    int64_t base = run * (known ? B : 0);
    char kn[KEY_MAX], kb_field[17];
    size_t kl = 0;
    if (base < n - 1 && !failed && mono_ms() < deadline) {
        kl = key_name(r, 'k', node_key(r, ns, keys, (int32_t)run), kn);
        const char *av[2] = {"HGETALL", kn};
        size_t al[2] = {7, kl};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
        redisReply *kids = NULL;
        if (kvt__rconn_exec(r->conn, &p, left_ms(deadline)) == 0)
            kids = p.cmds[0].reply;
        for (size_t f = 0; kids && kids->type == REDIS_REPLY_ARRAY && f + 1 < kids->elements; f += 2) {
            redisReply *fk = kids->element[f], *fv = kids->element[f + 1];
            if (fk->type != REDIS_REPLY_STRING || fk->len != 17 || fv->type != REDIS_REPLY_STRING || fv->len < 4 ||
                (fv->len - 4) % 4)
                continue;
            kvt__key k;
            memcpy(&k.lo, fk->str + 1, 8);
            memcpy(&k.hi, fk->str + 9, 8);
            uint8_t flags = (uint8_t)fv->str[0];
            int64_t T = (int64_t)(fv->len - 4) / 4;
            int32_t *tt = kvt__malloc(sizeof *tt * (size_t)(T ? T : 1));
            if (!tt) {
                rc = kvt__fail(KVT_ENOMEM, "remote find: out of memory");
                goto out;
            }
            memcpy(tt, fv->str + 4, sizeof *tt * (size_t)T);
            int64_t avail = n - base, q = common(tt, prompt + base, KVT__MIN(T, avail)), cand = 0;
            if (fk->str[0] == 'b' && standalone && (flags & KVT__REC_STANDALONE) && known && T == B && q > 0) {
                cand = KVT__MIN(base + q, n - 1);
                if (cand > KVT__MAX(bst.prefix, kb.prefix)) {
                    kvt__key *k2 = kvt__malloc(sizeof *k2 * (size_t)(run + 1));
                    if (!k2 || (rc = hslot_make(&h, ns, prompt, base, tt, T, NULL, 0, 0, KVT__KEY_ZERO))) {
                        kvt__free(k2);
                        kvt__free(tt);
                        rc = rc ? rc : kvt__fail(KVT_ENOMEM, "remote find: out of memory");
                        goto out;
                    }
                    if (run)
                        memcpy(k2, keys, sizeof *k2 * (size_t)run);
                    k2[run] = k;
                    kvt__free(h.keys);
                    h.keys = k2;
                    h.n_keys = (int32_t)run + 1;
                    best_set(&kb, cand, &h);
                    memcpy(kb_field, fk->str, 17);
                }
            } else if (fk->str[0] == 'e') {
                if (q == T && base + T <= n - 1)
                    cand = base + T;
                else if (flags & KVT__REC_TRIMMABLE)
                    cand = KVT__MIN(base + q, n - 1);
                if (cand > KVT__MAX(bst.prefix, kb.prefix) && cand > 0) {
                    if ((rc = hslot_make(&h, ns, prompt, base, tt, T, keys, (int32_t)run, 1, k))) {
                        kvt__free(tt);
                        goto out;
                    }
                    best_set(&kb, cand, &h);
                    memcpy(kb_field, fk->str, 17);
                }
            }
            kvt__free(tt);
        }
    }
    kvt__rpipe_clear(&p);
    /* round trip 3: the children hash is a hint; the record it names must
     * still be there (Redis may have evicted it), else the hint goes */
    if (kb.have && mono_ms() < deadline) {
        char vn[KEY_MAX];
        size_t vl = kb_field[0] == 'b' ? key_name(r, 'b', kb.h.keys[kb.h.n_keys - 1], vn)
                                       : key_name(r, 'e', kb.h.ekey, vn);
        const char *av[2] = {"EXISTS", vn};
        size_t al[2] = {6, vl};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
        redisReply *v = kvt__rconn_exec(r->conn, &p, left_ms(deadline)) == 0 ? p.cmds[0].reply : NULL;
        if (v && v->type == REDIS_REPLY_INTEGER && v->integer == 1) {
            best_set(&bst, kb.prefix, &kb.h);
        } else if (v && v->type == REDIS_REPLY_INTEGER) {
            kvt__rpipe_clear(&p);
            const char *dv[3] = {"HDEL", kn, kb_field};
            size_t dl[3] = {4, kl, 17};
            if (kvt__rpipe_add(&p, 1, 3, dv, dl) == 0)
                kvt__rconn_exec(r->conn, &p, r->lookup_ms);
        }
    }
done:
    if (bst.have && bst.prefix > 0) {
        out->prefix_len = bst.prefix;
        out->n_tokens = bst.h.n_tokens;
        out->handle = handle_put(r, &bst.h);
        pthread_mutex_lock(&r->mu);
        r->st.lookup_hits++;
        r->st.hit_tokens += (uint64_t)out->prefix_len;
        pthread_mutex_unlock(&r->mu);
    } else {
        rc = KVT_ENOTFOUND;
    }
out:
    kvt__rpipe_clear(&p);
    hslot_clear(&bst.h);
    hslot_clear(&kb.h);
    kvt__free(keys);
    kvt__free(names);
    kvt__free(lens);
    if (rc)
        memset(out, 0, sizeof *out);
    return rc;
}

static int t_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    if (n < 2)
        return (memset(out, 0, sizeof *out), KVT_ENOTFOUND);
    return do_find(self, prompt, n, ns, out, 0);
}

static int t_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    return do_find(self, tokens, n, ns, out, 1);
}

/* ---- restore ------------------------------------------------------------------------ */

/* A GET reply shared by the tensors that alias it. */
typedef struct held {
    _Atomic int refs;
    redisReply *rep;
} held;

static void held_release(held *h)
{
    if (h && atomic_fetch_sub(&h->refs, 1) == 1) {
        freeReplyObject(h->rep);
        kvt__free(h);
    }
}

static void tensor_release(void *ctx, void *data, size_t bytes)
{
    (void)data, (void)bytes;
    held_release(ctx);
}

/* Deletes keys whose records failed validation (best effort). */
static void delete_bad(kvt_remote *r, char (*names)[KEY_MAX], const size_t *lens, const int *bad, int32_t n)
{
    kvt__rpipe p = {0};
    for (int32_t i = 0; i < n; i++)
        if (bad[i]) {
            const char *av[2] = {"DEL", names[i]};
            size_t al[2] = {3, lens[i]};
            kvt__rpipe_add(&p, 1, 2, av, al);
        }
    if (p.n)
        kvt__rconn_exec(r->conn, &p, r->io_ms);
    kvt__rpipe_clear(&p);
}

static int ns_eq(const kvt__rec *rec, const char *ns)
{
    return rec->ns_len == strlen(ns) && memcmp(rec->ns, ns, rec->ns_len) == 0;
}

/* Checks block record j against what the handle asked for. */
static int block_ok(const kvt_remote *r, const kvt__rec *b, const hslot *h, int32_t j, int64_t at)
{
    kvt__key parent = j ? h->keys[j - 1] : KVT__KEY_ZERO;
    if (b->type != 'b' || !kvt__key_eq(b->seed, r->seed))
        return kvt__fail(KVT_EIDENTITY, "remote restore: block %d belongs to another identity", (int)j);
    if (!kvt__key_eq(b->key, h->keys[j]) || !kvt__key_eq(b->parent, parent) || !ns_eq(b, h->ns) ||
        b->tok_begin != at || b->n_tokens < 1 || at + b->n_tokens > h->n_tokens)
        return kvt__fail(KVT_EFORMAT, "remote restore: block %d is not the one asked for", (int)j);
    if (memcmp(b->tokens, h->tokens + at, sizeof(int32_t) * (size_t)b->n_tokens) != 0 ||
        !kvt__key_eq(kvt__block_key(r->seed, h->ns, parent, b->tokens, b->n_tokens), h->keys[j]))
        return kvt__fail(KVT_EFORMAT, "remote restore: block %d holds other tokens", (int)j);
    return 0;
}

static int entry_ok(const kvt_remote *r, const kvt__rec *e, const hslot *h)
{
    if (e->type != 'e' || !kvt__key_eq(e->seed, r->seed))
        return kvt__fail(KVT_EIDENTITY, "remote restore: entry belongs to another identity");
    if (!kvt__key_eq(e->key, h->ekey) || !ns_eq(e, h->ns) || e->n_tokens != h->n_tokens ||
        (e->n_tokens && memcmp(e->tokens, h->tokens, sizeof(int32_t) * (size_t)e->n_tokens) != 0) ||
        !kvt__key_eq(kvt__entry_key(r->seed, h->ns, e->tokens, e->n_tokens), h->ekey))
        return kvt__fail(KVT_EFORMAT, "remote restore: the entry record is not the one asked for");
    return 0;
}

/* Rebuilds layer l: tensors of blocks[0..nb) layer l, then `local` (may be
 * NULL), each aliasing its reply through a wrapped buffer. */
static int build_layer(const kvt__rec *blocks, held **bh, int32_t nb, const kvt__rec_layer *desc,
                       const kvt__rec_layer *local, held *lh, int32_t l, kvt_cache **out)
{
    int32_t nt = local ? local->n_tensors : 0;
    for (int32_t j = 0; j < nb; j++)
        nt += blocks[j].layers[l].n_tensors;
    kvt_cache_state st;
    memset(&st, 0, sizeof st);
    memcpy(st.kind, desc->kind, sizeof st.kind);
    st.offset = desc->offset;
    st.min_offset = desc->min_offset;
    st.n_params = desc->n_params;
    memcpy(st.params, desc->params, sizeof st.params);
    st.tensors = kvt__calloc((size_t)(nt ? nt : 1), sizeof *st.tensors);
    if (!st.tensors)
        return kvt__fail(KVT_ENOMEM, "remote restore: out of memory");
    int rc = 0;
    for (int32_t j = 0; j <= nb && !rc; j++) {
        const kvt__rec_layer *L = j < nb ? &blocks[j].layers[l] : local;
        held *hh = j < nb ? bh[j] : lh;
        for (int32_t t = 0; L && t < L->n_tensors; t++) {
            kvt_tensor *x = &st.tensors[st.n_tensors];
            *x = L->tensors[t];
            x->owner = NULL;
            if (x->bytes) {
                atomic_fetch_add(&hh->refs, 1);
                if (kvt_buf_wrap((void *)x->data, x->bytes, tensor_release, hh, &x->owner)) {
                    atomic_fetch_sub(&hh->refs, 1);
                    rc = kvt__fail(KVT_ENOMEM, "remote restore: out of memory");
                    break;
                }
            }
            st.n_tensors++;
        }
    }
    if (!rc)
        rc = kvt_cache_decode(&st, out);
    for (int32_t t = 0; t < st.n_tensors; t++)
        kvt_buf_release(st.tensors[t].owner);
    kvt__free(st.tensors);
    return rc;
}

static int t_restore(void *self, uint64_t handle, kvt_entry *out)
{
    kvt_remote *r = self;
    memset(out, 0, sizeof *out);
    hslot h;
    int rc = handle_get(r, handle, &h);
    if (rc)
        return rc;
    int64_t t0 = mono_ms();
    int32_t nk = h.n_keys, nrec = nk + (h.is_entry ? 1 : 0);
    char (*names)[KEY_MAX] = kvt__malloc(KEY_MAX * (size_t)(nrec ? nrec : 1));
    size_t *lens = kvt__calloc((size_t)(nrec ? nrec : 1), sizeof *lens);
    kvt__rec *recs = kvt__calloc((size_t)(nrec ? nrec : 1), sizeof *recs);
    held **hs = kvt__calloc((size_t)(nrec ? nrec : 1), sizeof *hs);
    int *bad = kvt__calloc((size_t)(nrec ? nrec : 1), sizeof *bad);
    kvt_attachment **atts = NULL;
    kvt__rpipe p = {0};
    uint64_t got_bytes = 0;
    if (!names || !lens || !recs || !hs || !bad) {
        rc = kvt__fail(KVT_ENOMEM, "remote restore: out of memory");
        goto out;
    }
    if (all_down(r)) {
        rc = kvt__fail(KVT_EIO, "remote restore: redis %s is unreachable", r->host);
        goto out;
    }
    /* records [0..nk) are the blocks, nk the entry */
    for (int32_t i = 0; i < nrec; i++) {
        lens[i] = i < nk ? key_name(r, 'b', h.keys[i], names[i]) : key_name(r, 'e', h.ekey, names[i]);
        const char *av[2] = {"GET", names[i]};
        size_t al[2] = {3, lens[i]};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
    }
    if (kvt__rconn_exec(r->conn, &p, r->io_ms)) {
        rc = kvt__fail(KVT_EIO, "remote restore: redis %s did not answer", r->host);
        goto out;
    }
    for (int32_t i = 0; i < nrec; i++) {
        redisReply *rep = p.cmds[i].reply;
        if (rep->type == REDIS_REPLY_NIL) {
            BUMP(r, restore_partial, 1);
            rc = kvt__fail(KVT_ENOTFOUND, "remote restore: record %d of %d is gone (evicted since the lookup)",
                           (int)i + 1, (int)nrec);
            goto out;
        }
        if (rep->type != REDIS_REPLY_STRING) {
            BUMP(r, failures_reply, 1);
            rc = kvt__fail(KVT_EIO, "remote restore: redis %s answered GET with an error", r->host);
            goto out;
        }
        got_bytes += rep->len;
        hs[i] = kvt__calloc(1, sizeof *hs[i]);
        if (!hs[i]) {
            rc = kvt__fail(KVT_ENOMEM, "remote restore: out of memory");
            goto out;
        }
        atomic_store(&hs[i]->refs, 1);
        hs[i]->rep = rep;
        p.cmds[i].reply = NULL;
    }
    /* validate every record before using any */
    int64_t at = 0;
    for (int32_t i = 0; i < nrec && !rc; i++) {
        rc = kvt__rec_parse(hs[i]->rep->str, hs[i]->rep->len, &recs[i]);
        if (!rc && i < nk) {
            rc = block_ok(r, &recs[i], &h, i, at);
            at += recs[i].n_tokens;
        } else if (!rc) {
            rc = entry_ok(r, &recs[i], &h);
            if (!rc && recs[i].n_blocks != nk)
                rc = kvt__fail(KVT_EFORMAT, "remote restore: the entry names %d blocks, the lookup %d",
                               (int)recs[i].n_blocks, (int)nk);
            for (int32_t j = 0; !rc && j < nk; j++)
                if (!kvt__key_eq(kvt__rec_block_key(&recs[i], j), h.keys[j]))
                    rc = kvt__fail(KVT_EFORMAT, "remote restore: the entry names other blocks");
        }
        if (!rc && i < nk && i > 0 && recs[i].n_layers != recs[0].n_layers)
            rc = kvt__fail(KVT_EFORMAT, "remote restore: blocks disagree on the layer count");
        if (rc)
            bad[i] = 1;
    }
    if (!rc && !h.is_entry && at != h.n_tokens)
        rc = kvt__fail(KVT_EFORMAT, "remote restore: blocks hold %lld tokens, the lookup %lld", (long long)at,
                       (long long)h.n_tokens);
    if (!rc && h.is_entry && nk && recs[nk].n_layers != recs[0].n_layers)
        rc = kvt__fail(KVT_EFORMAT, "remote restore: the entry and its blocks disagree on the layer count");
    if (rc) {
        BUMP(r, bad_records, 1);
        delete_bad(r, names, lens, bad, nrec);
        if (rc != KVT_ENOMEM)
            rc = KVT_ECORRUPT;
        goto out;
    }
    {
        const kvt__rec *desc = h.is_entry ? &recs[nk] : &recs[0];
        int32_t L = desc->n_layers, A = h.is_entry ? recs[nk].n_atts : 0;
        if ((rc = kvt_entry_init(out, h.ns, h.tokens, h.n_tokens, L, A)))
            goto out;
        for (int32_t l = 0; l < L && !rc; l++) {
            kvt__rec_layer d = desc->layers[l];
            if (!h.is_entry) {
                d.offset = h.n_tokens;
                d.min_offset = 0;
            }
            rc = build_layer(recs, hs, nk, &d, h.is_entry ? &recs[nk].layers[l] : NULL, h.is_entry ? hs[nk] : NULL, l,
                             &out->caches[l]);
        }
        for (int32_t a = 0; a < A && !rc; a++)
            rc = kvt_attachment_blob(recs[nk].atts[a].name, recs[nk].atts[a].data, recs[nk].atts[a].bytes,
                                     &out->attachments[a]);
        if (rc) {
            kvt_entry_clear(out);
            if (rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED) {
                BUMP(r, bad_records, 1);
                for (int32_t i = 0; i < nrec; i++)
                    bad[i] = 1;
                delete_bad(r, names, lens, bad, nrec);
                rc = KVT_ECORRUPT;
            }
        }
    }
    (void)atts;
out:
    for (int32_t i = 0; i < nrec; i++) {
        if (recs)
            kvt__rec_clear(&recs[i]);
        if (hs)
            held_release(hs[i]);
    }
    kvt__rpipe_clear(&p);
    kvt__free(names);
    kvt__free(lens);
    kvt__free(recs);
    kvt__free(hs);
    kvt__free(bad);
    hslot_clear(&h);
    pthread_mutex_lock(&r->mu);
    if (rc) {
        r->st.restore_failures++;
    } else {
        r->st.restores++;
        r->st.restored_bytes += got_bytes;
    }
    r->st.restore_ms += (uint64_t)(mono_ms() - t0);
    pthread_mutex_unlock(&r->mu);
    if (rc)
        memset(out, 0, sizeof *out);
    return rc;
}

/* ---- store -------------------------------------------------------------------------- */

typedef struct range {
    int64_t b, e;
} range;

static int cmp_range(const void *a, const void *b)
{
    const range *x = a, *y = b;
    return x->b < y->b ? -1 : x->b > y->b ? 1 : (x->e > y->e) - (x->e < y->e);
}

/* Whether blocks alone rebuild a prefix: every layer decodes from its
 * chained tensors only, at the chain's end. */
static int standalone_test(const kvt_cache_state *st, int32_t L, int64_t end)
{
    for (int32_t l = 0; l < L; l++) {
        if (st[l].min_offset != 0)
            return 0;
        kvt_cache_state s = st[l];
        s.offset = end;
        s.tensors = kvt__calloc((size_t)(st[l].n_tensors ? st[l].n_tensors : 1), sizeof *s.tensors);
        if (!s.tensors)
            return 0;
        s.n_tensors = 0;
        for (int32_t t = 0; t < st[l].n_tensors; t++)
            if (st[l].tensors[t].tok_begin >= 0 && st[l].tensors[t].tok_end <= end)
                s.tensors[s.n_tensors++] = st[l].tensors[t];
        kvt_cache *c = NULL;
        int rc = kvt_cache_decode(&s, &c);
        kvt_cache_destroy(c);
        kvt__free(s.tensors);
        if (rc) {
            kvt__clear_error();
            return 0;
        }
    }
    return 1;
}

typedef struct wpipe {
    kvt__rpipe p;
    void **bufs;      /* (n) per record: its value, then its names (freed after exec) */
    int32_t n, cap;
    uint64_t bytes, records;
} wpipe;

static void wpipe_reset(wpipe *w)
{
    kvt__rpipe_clear(&w->p);
    for (int32_t i = 0; i < w->n; i++)
        kvt__free(w->bufs[i]);
    w->n = 0;
    w->bytes = 0;
    w->records = 0;
}

static void wpipe_free(wpipe *w)
{
    wpipe_reset(w);
    kvt__free(w->bufs);
    memset(w, 0, sizeof *w);
}

/* Keeps buf until the pipeline has run (freed on error too). */
static int wpipe_keep(wpipe *w, void *buf)
{
    if (w->n == w->cap) {
        int32_t cap = w->cap ? w->cap * 2 : 32;
        void **b = kvt__realloc(w->bufs, sizeof *b * (size_t)cap);
        if (!b) {
            kvt__free(buf);
            return kvt__fail(KVT_ENOMEM, "remote store: out of memory");
        }
        w->bufs = b;
        w->cap = cap;
    }
    w->bufs[w->n++] = buf;
    return 0;
}

/* Queues SET key value [PX ttl], HSET kids field kidval [PEXPIRE kids ttl].
 * value (with kidval in its tail) passes to the pipeline. */
static int wpipe_add(kvt_remote *r, wpipe *w, char type, kvt__key key, void *value, size_t vbytes, kvt__key node,
                     const void *kidval, size_t kidbytes, const char *ttl)
{
    int rc = wpipe_keep(w, value);
    char *nm = rc ? NULL : kvt__malloc(2 * KEY_MAX + 17);
    if (rc || !nm || (rc = wpipe_keep(w, nm)))
        return rc ? rc : kvt__fail(KVT_ENOMEM, "remote store: out of memory");
    char *kn = nm, *nn = nm + KEY_MAX, *fd = nm + 2 * KEY_MAX;
    size_t kl = key_name(r, type, key, kn), nl = key_name(r, 'k', node, nn);
    size_t fl = kid_field(type, key, fd);
    w->bytes += vbytes;
    w->records++;
    const char *set[5] = {"SET", kn, value, "PX", ttl};
    size_t setl[5] = {3, kl, vbytes, 2, ttl ? strlen(ttl) : 0};
    if ((rc = kvt__rpipe_add(&w->p, 1, ttl ? 5 : 3, set, setl)))
        return rc;
    const char *hs[4] = {"HSET", nn, fd, kidval};
    size_t hsl[4] = {4, nl, fl, kidbytes};
    if ((rc = kvt__rpipe_add(&w->p, 1, 4, hs, hsl)))
        return rc;
    if (ttl) {
        const char *ex[3] = {"PEXPIRE", nn, ttl};
        size_t exl[3] = {7, nl, strlen(ttl)};
        rc = kvt__rpipe_add(&w->p, 1, 3, ex, exl);
    }
    return rc;
}

static int wpipe_exec(kvt_remote *r, wpipe *w, uint64_t *records, uint64_t *bytes)
{
    if (!w->p.n)
        return 0;
    int rc = kvt__rconn_exec(r->conn, &w->p, r->io_ms);
    if (rc == KVT_EIO)
        rc = kvt__fail(KVT_EIO, "remote store: redis %s did not answer", r->host);
    for (int32_t i = 0; rc == 0 && i < w->p.n; i++) {
        redisReply *rep = w->p.cmds[i].reply;
        if (rep->type == REDIS_REPLY_ERROR) {
            BUMP(r, failures_reply, 1);
            rc = kvt__fail(KVT_EIO, "remote store: redis %s refused a write: %.200s", r->host, rep->str);
        }
    }
    if (!rc) {
        *records += w->records;
        *bytes += w->bytes;
    }
    wpipe_reset(w);
    return rc;
}

/* Kid value: flags, 3 zero bytes, tokens. Appended after the record in one
 * allocation so the pipeline owns one buffer per record. */
static void *with_kid(void *rec, size_t rb, uint8_t flags, const int32_t *tok, int64_t n, const void **kid,
                      size_t *kb)
{
    size_t k = 4 + 4 * (size_t)n;
    uint8_t *b = kvt__realloc(rec, rb + k);
    if (!b) {
        kvt__free(rec);
        return NULL;
    }
    b[rb] = flags;
    b[rb + 1] = b[rb + 2] = b[rb + 3] = 0;
    if (n)
        memcpy(b + rb + 4, tok, 4 * (size_t)n);
    *kid = b + rb;
    *kb = k;
    return b;
}

static int do_store(kvt_remote *r, const kvt_entry *e)
{
    const int32_t L = e->n_caches, A = e->n_attachments;
    const int64_t n = e->n_tokens;
    const char *ns = e->ns ? e->ns : "";
    if (n < 0 || L < 0 || A < 0 || (n && !e->tokens) || (L && !e->caches) || (A && !e->attachments))
        return kvt__fail(KVT_EINVAL, "remote store: malformed entry");
    if (all_down(r))
        return kvt__fail(KVT_EIO, "remote store: redis %s is unreachable", r->host);
    kvt_cache_state *st = kvt__calloc((size_t)(L ? L : 1), sizeof *st);
    kvt__rec_layer *layers = kvt__calloc((size_t)(L ? L : 1), sizeof *layers);
    kvt__rec_att *atts = kvt__calloc((size_t)(A ? A : 1), sizeof *atts);
    range *rg = NULL;
    kvt__key *keys = NULL;
    int *present = NULL;
    wpipe w = {0};
    kvt__rpipe ex = {0};
    char (*names)[KEY_MAX] = NULL;
    int rc = 0;
    uint64_t records = 0, bytes = 0, skipped = 0;
    if (!st || !layers || !atts) {
        rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
        goto out;
    }
    size_t n_tensors = 0;
    int64_t min_reach = A ? n : 0;
    for (int32_t l = 0; l < L; l++) {
        if (!e->caches[l] || (rc = kvt_cache_encode(e->caches[l], &st[l])))
            goto out_rc;
        if (st[l].offset != n) {
            rc = kvt__fail(KVT_EINVAL, "remote store: layer %d holds %lld tokens, the entry %lld", (int)l,
                           (long long)st[l].offset, (long long)n);
            goto out;
        }
        min_reach = KVT__MAX(min_reach, st[l].min_offset);
        n_tensors += (size_t)st[l].n_tensors;
    }
    for (int32_t a = 0; a < A; a++) {
        const kvt_attachment *at = e->attachments[a];
        if (!at || !at->ops->serialize || at->ops->serialize(at, &atts[a].data, &atts[a].bytes)) {
            rc = kvt__fail(KVT_EUNSUPPORTED, "remote store: attachment %d cannot be serialized", (int)a);
            goto out;
        }
        memcpy(atts[a].name, at->name, sizeof atts[a].name);
    }
    /* the chain: full-block ranges from token 0, all of one size B */
    rg = kvt__calloc(n_tensors ? n_tensors : 1, sizeof *rg);
    if (!rg) {
        rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
        goto out;
    }
    int32_t n_rg = 0;
    for (int32_t l = 0; l < L; l++)
        for (int32_t t = 0; t < st[l].n_tensors; t++) {
            const kvt_tensor *x = &st[l].tensors[t];
            if (x->tok_begin < 0 || x->tok_end <= x->tok_begin || x->tok_end > n)
                continue;
            int dup = 0;
            for (int32_t i = 0; i < n_rg && !dup; i++)
                dup = rg[i].b == x->tok_begin && rg[i].e == x->tok_end;
            if (!dup)
                rg[n_rg++] = (range){x->tok_begin, x->tok_end};
        }
    qsort(rg, (size_t)n_rg, sizeof *rg, cmp_range);
    int64_t B = n_rg ? rg[0].e - rg[0].b : 0;
    int32_t n_chain = 0;
    while (n_chain < n_rg && rg[n_chain].b == n_chain * B && rg[n_chain].e == (n_chain + 1) * B)
        n_chain++;
    int32_t lB;
    int lsa, write_layout = 0;
    int known = layout_get(r, r->io_ms, &lB, &lsa);
    if (!known && n_chain > 0) {
        lB = (int32_t)B;
        lsa = standalone_test(st, L, n_chain * B);
        pthread_mutex_lock(&r->mu);
        if (!r->layout_known) {
            r->layout_known = 1;
            r->B = lB;
            r->standalone = lsa;
        }
        lB = r->B;
        lsa = r->standalone;
        pthread_mutex_unlock(&r->mu);
        known = 1;
    }
    if (!known || lB != B)
        n_chain = 0; /* no usable chain: the entry record carries everything */
    pthread_mutex_lock(&r->mu);
    write_layout = known && !r->layout_written;
    pthread_mutex_unlock(&r->mu);
    int trimmable = A == 0 && min_reach == 0;
    int need_entry = !(known && lsa && A == 0 && n > 0 && (int64_t)n_chain * B == n);

    keys = kvt__calloc((size_t)(n_chain ? n_chain : 1), sizeof *keys);
    present = kvt__calloc((size_t)(n_chain ? n_chain : 1), sizeof *present);
    names = kvt__malloc(KEY_MAX * (size_t)(n_chain + 1));
    if (!keys || !present || !names) {
        rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
        goto out;
    }
    kvt__key parent = KVT__KEY_ZERO;
    for (int32_t c = 0; c < n_chain; c++)
        parent = keys[c] = kvt__block_key(r->seed, ns, parent, e->tokens + (int64_t)c * B, B);
    kvt__key ekey = kvt__entry_key(r->seed, ns, e->tokens, n);

    /* round trip 1: which blocks Redis holds already */
    for (int32_t c = 0; c < n_chain; c++) {
        size_t kl = key_name(r, 'b', keys[c], names[c]);
        const char *av[2] = {"EXISTS", names[c]};
        size_t al[2] = {6, kl};
        if ((rc = kvt__rpipe_add(&ex, 1, 2, av, al)))
            goto out;
    }
    if (ex.n && kvt__rconn_exec(r->conn, &ex, r->io_ms) == 0)
        for (int32_t c = 0; c < n_chain; c++) {
            redisReply *rep = ex.cmds[c].reply;
            present[c] = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1;
        }
    kvt__rpipe_clear(&ex);

    char ttl[32];
    const char *ttlp = NULL;
    if (r->ttl_s > 0) {
        snprintf(ttl, sizeof ttl, "%lld", (long long)r->ttl_s * 1000);
        ttlp = ttl;
    }
    /* round trip(s) 2: the missing blocks, then the entry */
    for (int32_t c = 0; c < n_chain; c++) {
        if (present[c]) {
            skipped++;
            continue;
        }
        kvt__rec rec = {.type = 'b', .flags = (uint8_t)(lsa ? KVT__REC_STANDALONE : 0), .seed = r->seed,
                        .key = keys[c], .parent = c ? keys[c - 1] : KVT__KEY_ZERO, .ns = ns,
                        .ns_len = (uint32_t)strlen(ns), .tok_begin = (int64_t)c * B, .tokens = e->tokens + (int64_t)c * B,
                        .n_tokens = B, .layers = layers, .n_layers = L};
        for (int32_t l = 0; l < L; l++) {
            kvt__rec_layer *ly = &layers[l];
            memset(ly, 0, sizeof *ly);
            memcpy(ly->kind, st[l].kind, sizeof ly->kind);
            ly->offset = (int64_t)(c + 1) * B;
            ly->n_params = st[l].n_params;
            memcpy(ly->params, st[l].params, sizeof ly->params);
            ly->tensors = kvt__calloc((size_t)(st[l].n_tensors ? st[l].n_tensors : 1), sizeof *ly->tensors);
            if (!ly->tensors) {
                rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
                break;
            }
            for (int32_t t = 0; t < st[l].n_tensors; t++)
                if (st[l].tensors[t].tok_begin == (int64_t)c * B && st[l].tensors[t].tok_end == (int64_t)(c + 1) * B)
                    ly->tensors[ly->n_tensors++] = st[l].tensors[t];
        }
        void *val = NULL;
        size_t vb = 0;
        if (!rc)
            rc = kvt__rec_encode(&rec, &val, &vb);
        for (int32_t l = 0; l < L; l++) {
            kvt__free(layers[l].tensors);
            layers[l].tensors = NULL;
        }
        if (rc)
            goto out;
        const void *kid;
        size_t kb;
        if (!(val = with_kid(val, vb, rec.flags, rec.tokens, B, &kid, &kb))) {
            rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
            goto out;
        }
        if ((rc = wpipe_add(r, &w, 'b', keys[c], val, vb, c ? keys[c - 1] : node_key(r, ns, keys, 0), kid, kb, ttlp)))
            goto out;
        if (w.bytes >= PIPE_BYTES && (rc = wpipe_exec(r, &w, &records, &bytes)))
            goto out;
    }
    if (need_entry) {
        int64_t tail_at = (int64_t)n_chain * B;
        uint8_t *bk = kvt__malloc(16 * (size_t)(n_chain ? n_chain : 1));
        if (!bk) {
            rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
            goto out;
        }
        for (int32_t c = 0; c < n_chain; c++) {
            memcpy(bk + 16 * (size_t)c, &keys[c].lo, 8);
            memcpy(bk + 16 * (size_t)c + 8, &keys[c].hi, 8);
        }
        kvt__rec rec = {.type = 'e', .flags = (uint8_t)(trimmable ? KVT__REC_TRIMMABLE : 0), .seed = r->seed,
                        .key = ekey, .ns = ns, .ns_len = (uint32_t)strlen(ns), .tokens = e->tokens, .n_tokens = n,
                        .block_keys = bk, .n_blocks = n_chain, .layers = layers, .n_layers = L, .atts = atts,
                        .n_atts = A};
        for (int32_t l = 0; l < L && !rc; l++) {
            kvt__rec_layer *ly = &layers[l];
            memset(ly, 0, sizeof *ly);
            memcpy(ly->kind, st[l].kind, sizeof ly->kind);
            ly->offset = st[l].offset;
            ly->min_offset = st[l].min_offset;
            ly->n_params = st[l].n_params;
            memcpy(ly->params, st[l].params, sizeof ly->params);
            ly->tensors = kvt__calloc((size_t)(st[l].n_tensors ? st[l].n_tensors : 1), sizeof *ly->tensors);
            if (!ly->tensors) {
                rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
                break;
            }
            for (int32_t t = 0; t < st[l].n_tensors; t++) {
                const kvt_tensor *x = &st[l].tensors[t];
                int chained = x->tok_begin >= 0 && x->tok_end <= tail_at && x->tok_end - x->tok_begin == B &&
                              x->tok_begin % (B ? B : 1) == 0 && n_chain > 0;
                if (!chained)
                    ly->tensors[ly->n_tensors++] = *x;
            }
        }
        void *val = NULL;
        size_t vb = 0;
        if (!rc)
            rc = kvt__rec_encode(&rec, &val, &vb);
        kvt__free(bk);
        for (int32_t l = 0; l < L; l++) {
            kvt__free(layers[l].tensors);
            layers[l].tensors = NULL;
        }
        if (rc)
            goto out;
        const void *kid;
        size_t kb;
        if (!(val = with_kid(val, vb, rec.flags, e->tokens + tail_at, n - tail_at, &kid, &kb))) {
            rc = kvt__fail(KVT_ENOMEM, "remote store: out of memory");
            goto out;
        }
        if ((rc = wpipe_add(r, &w, 'e', ekey, val, vb, node_key(r, ns, keys, n_chain), kid, kb, ttlp)))
            goto out;
    }
    char lk[KEY_MAX], lv[64];
    if (write_layout) {
        size_t kl = (size_t)snprintf(lk, sizeof lk, "%slayout", r->prefix);
        size_t vl = (size_t)snprintf(lv, sizeof lv, "kvtier-layout 1 block=%d standalone=%d", (int)lB, lsa);
        const char *av[3] = {"SET", lk, lv};
        size_t al[3] = {3, kl, vl};
        if ((rc = kvt__rpipe_add(&w.p, 1, 3, av, al)))
            goto out;
    }
    if ((rc = wpipe_exec(r, &w, &records, &bytes)))
        goto out;
    if (write_layout) {
        pthread_mutex_lock(&r->mu);
        r->layout_written = 1;
        pthread_mutex_unlock(&r->mu);
    }
    goto out;
out_rc:
    if (!rc)
        rc = kvt__fail(KVT_EINVAL, "remote store: layer without a cache");
out:
    pthread_mutex_lock(&r->mu);
    r->st.write_records += records;
    r->st.write_bytes += bytes;
    r->st.writes_skipped += skipped;
    if (rc) {
        r->st.write_failures++;
    } else if (records) {
        r->st.writes++;
        r->entries++;
        r->bytes += bytes;
    }
    pthread_mutex_unlock(&r->mu);
    wpipe_free(&w);
    kvt__rpipe_clear(&ex);
    for (int32_t l = 0; st && l < L; l++)
        kvt_cache_state_clear(&st[l]);
    kvt__free(st);
    kvt__free(layers);
    kvt__free(atts);
    kvt__free(rg);
    kvt__free(keys);
    kvt__free(present);
    kvt__free(names);
    return rc;
}

static int t_store(void *self, const kvt_entry *e) { return do_store(self, e); }

/* ---- write-behind ------------------------------------------------------------------- */

static uint64_t entry_bytes(const kvt_entry *e)
{
    uint64_t b = (uint64_t)e->n_tokens * 4;
    for (int32_t l = 0; l < e->n_caches; l++)
        b += e->caches[l] ? kvt_cache_bytes(e->caches[l]) : 0;
    for (int32_t a = 0; a < e->n_attachments; a++)
        b += kvt_attachment_bytes(e->attachments[a]);
    return b;
}

static void *writer_main(void *arg)
{
    kvt_remote *r = arg;
    pthread_mutex_lock(&r->q_mu);
    for (;;) {
        while (!r->q_head && !r->closing)
            pthread_cond_wait(&r->q_cv, &r->q_mu);
        if (!r->q_head)
            break;
        wjob *j = r->q_head;
        r->q_head = j->next;
        if (!r->q_head)
            r->q_tail = NULL;
        r->q_n--;
        r->q_bytes -= j->bytes;
        r->inflight = j;
        pthread_mutex_unlock(&r->q_mu);
        int rc;
        if (all_down(r)) {
            BUMP(r, dropped, 1);
            rc = kvt__fail(KVT_EIO, "remote write-behind: redis %s is unreachable; the write was dropped", r->host);
        } else {
            rc = do_store(r, &j->e);
        }
        kvt_entry_clear(&j->e);
        kvt__free(j);
        pthread_mutex_lock(&r->q_mu);
        r->inflight = NULL;
        if (rc && !r->flush_rc)
            r->flush_rc = rc;
        pthread_cond_broadcast(&r->idle_cv);
    }
    pthread_mutex_unlock(&r->q_mu);
    return NULL;
}

static int t_spill(void *self, kvt_entry *e)
{
    kvt_remote *r = self;
    if (!e)
        return kvt__fail(KVT_EINVAL, "remote spill: NULL entry");
    if (all_down(r)) {
        BUMP(r, dropped, 1);
        return kvt__fail(KVT_EAGAIN, "remote spill: redis %s is unreachable", r->host);
    }
    uint64_t b = entry_bytes(e);
    wjob *j = kvt__calloc(1, sizeof *j);
    if (!j)
        return kvt__fail(KVT_ENOMEM, "remote spill: out of memory");
    pthread_mutex_lock(&r->q_mu);
    if (r->closing || r->q_n >= r->queue_max_entries || r->q_bytes + b > r->queue_max_bytes) {
        pthread_mutex_unlock(&r->q_mu);
        kvt__free(j);
        BUMP(r, dropped, 1);
        return kvt__fail(KVT_EAGAIN, "remote spill: the write-behind queue is full");
    }
    j->e = *e;
    j->bytes = b;
    memset(e, 0, sizeof *e);
    if (r->q_tail)
        r->q_tail->next = j;
    else
        r->q_head = j;
    r->q_tail = j;
    r->q_n++;
    r->q_bytes += b;
    pthread_cond_signal(&r->q_cv);
    pthread_mutex_unlock(&r->q_mu);
    return 0;
}

static int same(const kvt_entry *e, const int32_t *tokens, int64_t n, const char *ns)
{
    return e->n_tokens == n && strcmp(e->ns ? e->ns : "", ns) == 0 &&
           (n == 0 || memcmp(e->tokens, tokens, sizeof(int32_t) * (size_t)n) == 0);
}

static int t_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_remote *r = self;
    int found = 0;
    pthread_mutex_lock(&r->q_mu);
    if (r->inflight && same(&r->inflight->e, tokens, n, ns))
        found = 1;
    for (wjob *j = r->q_head; j && !found; j = j->next)
        found = same(&j->e, tokens, n, ns);
    pthread_mutex_unlock(&r->q_mu);
    return found;
}

static int t_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt_remote *r = self;
    wjob *hit = NULL;
    pthread_mutex_lock(&r->q_mu);
    for (wjob **pp = &r->q_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next)
        if (same(&(*pp)->e, tokens, n, ns)) {
            hit = *pp;
            *pp = hit->next;
            if (r->q_tail == hit)
                r->q_tail = prev;
            r->q_n--;
            r->q_bytes -= hit->bytes;
            break;
        }
    pthread_cond_broadcast(&r->idle_cv);
    pthread_mutex_unlock(&r->q_mu);
    if (!hit)
        return KVT_ENOTFOUND;
    kvt_entry_clear(&hit->e);
    kvt__free(hit);
    return 0;
}

static int t_flush(void *self)
{
    kvt_remote *r = self;
    pthread_mutex_lock(&r->q_mu);
    while (r->q_head || r->inflight)
        pthread_cond_wait(&r->idle_cv, &r->q_mu);
    int rc = r->flush_rc;
    r->flush_rc = 0;
    pthread_mutex_unlock(&r->q_mu);
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
    out->entries = r->entries;
    out->bytes = r->bytes;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

KVT_API void kvt_remote_cold_tier(kvt_remote *r, kvt_cold_tier *out)
{
    memset(out, 0, sizeof *out);
    out->self = r;
    out->find = t_find;
    out->find_exact = t_find_exact;
    out->restore = t_restore;
    out->store = t_store;
    out->spill = t_spill;
    out->pending = t_pending;
    out->flush = t_flush;
    out->withdraw = t_withdraw;
    out->stats = t_stats;
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
        o.ttl_s < 0 || o.queue_max_entries < 0)
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
    r->ttl_s = o.ttl_s;
    r->queue_max_bytes = o.queue_max_bytes ? o.queue_max_bytes : (256ull << 20);
    r->queue_max_entries = o.queue_max_entries ? o.queue_max_entries : 1024;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->q_mu, NULL);
    pthread_cond_init(&r->q_cv, NULL);
    pthread_cond_init(&r->idle_cv, NULL);
    rc = kvt__rconn_create(&cfg, &r->conn);
    memset(&cfg, 0, sizeof cfg); /* the password copy */
    if (rc) {
        kvt_remote_close(r);
        return rc;
    }
    if ((rc = pthread_create(&r->writer, NULL, writer_main, r))) {
        kvt_remote_close(r);
        return kvt__fail(-rc, "kvt_remote_open: cannot start the writer thread");
    }
    r->writer_started = 1;
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
    int rc = 0;
    if (r->writer_started) {
        pthread_mutex_lock(&r->q_mu);
        r->closing = 1;
        pthread_cond_broadcast(&r->q_cv);
        pthread_mutex_unlock(&r->q_mu);
        pthread_join(r->writer, NULL);
        rc = r->flush_rc;
    }
    for (wjob *j = r->q_head, *nx; j; j = nx) {
        nx = j->next;
        kvt_entry_clear(&j->e);
        kvt__free(j);
    }
    kvt__rconn_destroy(r->conn);
    for (int i = 0; i < HANDLES; i++)
        hslot_clear(&r->ring[i]);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->q_mu);
    pthread_cond_destroy(&r->q_cv);
    pthread_cond_destroy(&r->idle_cv);
    kvt__free(r);
    return rc;
}
