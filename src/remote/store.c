/*
 * store.c: the remote tier's store. An entry's full blocks from token 0 become
 * content-addressed block records (one pipelined EXISTS first: blocks Redis
 * holds already are not sent again); what the blocks do not carry (a partial
 * tail, untrimmable state, attachments) becomes one entry record. Each record
 * is one SET plus a field in its parent node's children hash (the lookup's
 * hint); the first store of an identity also writes its layout key.
 */
#include "remote_internal.h"

#include <hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PIPE_BYTES (32u << 20) /* record bytes per write pipeline */

typedef struct range {
    int64_t b, e;
} range;

static int cmp_range(const void *a, const void *b)
{
    const range *x = a, *y = b;
    return x->b < y->b ? -1 : x->b > y->b ? 1 : (x->e > y->e) - (x->e < y->e);
}

/* Whether blocks (of B tokens) alone rebuild a prefix: every layer decodes
 * from its chained tensors only, at the chain's end. @return 1: every layer
 * reaches 0, so the chain serves a prefix of any length (its last block
 * cut); 2: some layer reaches the chain's end only as a multiple of its
 * block granule (kvt_cache_trim_granule: a qkvc layer's whole sealed
 * blocks), so the chain serves a prefix at block ends only; 0: blocks alone
 * rebuild none. */
static int standalone_test(kvt_cache *const *caches, const kvt_cache_state *st, int32_t L, int64_t B, int64_t end)
{
    int kind = 1;
    for (int32_t l = 0; l < L; l++) {
        kvt_cache_state s = st[l];
        s.offset = end;
        s.min_offset = 0;
        if (st[l].min_offset != 0) {
            int64_t g = kvt_cache_trim_granule(caches[l]);
            if (g <= 0 || B % g != 0 || end > st[l].min_offset)
                return 0;
            s.min_offset = end; /* whole sealed blocks, nothing open */
            kind = 2;
        }
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
    return kind;
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

typedef struct wpipe {
    kvt__rpipe p;
    void **bufs;      /* (n) per record: its value, then its names (freed after exec) */
    int32_t n, cap;
    uint64_t bytes, records;
    uint64_t *lpend, *ldone; /* (nl) tensor bytes per layer of the records queued, and of those
                                Redis accepted (may be NULL: not counted) */
    int32_t nl;
} wpipe;

static void wpipe_reset(wpipe *w)
{
    kvt__rpipe_clear(&w->p);
    for (int32_t i = 0; i < w->n; i++)
        kvt__free(w->bufs[i]);
    w->n = 0;
    w->bytes = 0;
    w->records = 0;
    if (w->lpend)
        memset(w->lpend, 0, sizeof *w->lpend * (size_t)w->nl);
}

static void wpipe_free(wpipe *w)
{
    wpipe_reset(w);
    kvt__free(w->bufs);
    kvt__free(w->lpend);
    kvt__free(w->ldone);
    memset(w, 0, sizeof *w);
}

/* The record about to be queued carries the tensors of ly[0..L): counted per layer. */
static void wpipe_count_layers(wpipe *w, const kvt__rec_layer *ly, int32_t L)
{
    for (int32_t l = 0; w->lpend && l < L && l < w->nl; l++)
        for (int32_t t = 0; t < ly[l].n_tensors; t++)
            w->lpend[l] += (uint64_t)ly[l].tensors[t].bytes;
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
    char *nm = rc ? NULL : kvt__malloc(2 * KVT__REMOTE_KEY_MAX + 17);
    if (rc || !nm || (rc = wpipe_keep(w, nm)))
        return rc ? rc : kvt__fail(KVT_ENOMEM, "remote store: out of memory");
    char *kn = nm, *nn = nm + KVT__REMOTE_KEY_MAX, *fd = nm + 2 * KVT__REMOTE_KEY_MAX;
    size_t kl = kvt__remote_key_name(r, type, key, kn), nl = kvt__remote_key_name(r, 'k', node, nn);
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
            KVT__REMOTE_BUMP(r, failures_reply, 1);
            rc = kvt__fail(KVT_EIO, "remote store: redis %s refused a write: %.200s", r->host, rep->str);
        }
    }
    if (!rc) {
        *records += w->records;
        *bytes += w->bytes;
        for (int32_t l = 0; w->lpend && l < w->nl; l++)
            w->ldone[l] += w->lpend[l];
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

/* Fills a record layer's description from st (kind, params, the offsets
 * given) with room for st's tensors and none chosen yet (the caller picks
 * them; encode_record frees the array). @return 0 or KVT_ENOMEM. */
static int layer_desc(kvt__rec_layer *ly, const kvt_cache_state *st, int64_t offset, int64_t min_offset)
{
    memset(ly, 0, sizeof *ly);
    memcpy(ly->kind, st->kind, sizeof ly->kind);
    ly->offset = offset;
    ly->min_offset = min_offset;
    ly->n_params = st->n_params;
    memcpy(ly->params, st->params, sizeof ly->params);
    ly->tensors = kvt__calloc((size_t)(st->n_tensors ? st->n_tensors : 1), sizeof *ly->tensors);
    return ly->tensors ? 0 : kvt__fail(KVT_ENOMEM, "remote store: out of memory");
}

/* Encodes rec unless rc (the status of filling its layers) is already an
 * error, frees its layers' tensor arrays either way, and appends the kid
 * value of tokens kt[0..kn) (with_kid). On success *val (the pipeline's
 * buffer) holds vb record bytes and then the kid value at *kid (kb bytes).
 * @return 0, rc, or kvt__rec_encode's error / KVT_ENOMEM. */
static int encode_record(const kvt__rec *rec, int rc, const int32_t *kt, int64_t kn, void **val, size_t *vb,
                         const void **kid, size_t *kb)
{
    *val = NULL;
    if (!rc)
        rc = kvt__rec_encode(rec, val, vb);
    for (int32_t l = 0; l < rec->n_layers; l++) {
        kvt__free(rec->layers[l].tensors);
        rec->layers[l].tensors = NULL;
    }
    if (rc)
        return rc;
    if (!(*val = with_kid(*val, *vb, rec->flags, kt, kn, kid, kb)))
        return kvt__fail(KVT_ENOMEM, "remote store: out of memory");
    return 0;
}

int kvt__remote_store(kvt_remote *r, const kvt_entry *e)
{
    const int32_t L = e->n_caches, A = e->n_attachments;
    const int64_t n = e->n_tokens;
    const char *ns = e->ns ? e->ns : "";
    if (n < 0 || L < 0 || A < 0 || (n && !e->tokens) || (L && !e->caches) || (A && !e->attachments))
        return kvt__fail(KVT_EINVAL, "remote store: malformed entry");
    if (kvt__remote_all_down(r))
        return kvt__fail(KVT_EIO, "remote store: redis %s is unreachable", r->host);
    kvt_cache_state *st = kvt__calloc((size_t)(L ? L : 1), sizeof *st);
    kvt__rec_layer *layers = kvt__calloc((size_t)(L ? L : 1), sizeof *layers);
    kvt__rec_att *atts = kvt__calloc((size_t)(A ? A : 1), sizeof *atts);
    range *rg = NULL;
    kvt__key *keys = NULL;
    int *present = NULL;
    wpipe w = {0};
    kvt__rpipe ex = {0};
    char (*names)[KVT__REMOTE_KEY_MAX] = NULL;
    int rc = 0;
    uint64_t records = 0, bytes = 0, skipped = 0;
    w.lpend = kvt__calloc((size_t)(L ? L : 1), sizeof *w.lpend);
    w.ldone = kvt__calloc((size_t)(L ? L : 1), sizeof *w.ldone);
    w.nl = L;
    if (!st || !layers || !atts || !w.lpend || !w.ldone) {
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
    int known = kvt__remote_layout_get(r, r->io_ms, &lB, &lsa);
    if (!known && n_chain > 0) {
        lB = (int32_t)B;
        lsa = standalone_test(e->caches, st, L, B, n_chain * B);
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
    /* the entry record serves any length from its chained blocks' end to n
     * (kv layers reach 0, a qkvc layer its sealed blocks, the chain); a
     * layer reaching only n (recurrent, a wrapped ring) serves n alone */
    int trimmable = A == 0 && (min_reach == 0 || (min_reach < n && min_reach <= (int64_t)n_chain * B));
    int need_entry = !(known && lsa && A == 0 && n > 0 && (int64_t)n_chain * B == n);

    keys = kvt__calloc((size_t)(n_chain ? n_chain : 1), sizeof *keys);
    present = kvt__calloc((size_t)(n_chain ? n_chain : 1), sizeof *present);
    names = kvt__malloc(KVT__REMOTE_KEY_MAX * (size_t)(n_chain + 1));
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
        size_t kl = kvt__remote_key_name(r, 'b', keys[c], names[c]);
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
            /* standalone 2: a layer reachable only at block ends says so (min_offset its end) */
            int64_t end = (int64_t)(c + 1) * B;
            if ((rc = layer_desc(ly, &st[l], end, lsa == 2 && st[l].min_offset > 0 ? end : 0)))
                break;
            for (int32_t t = 0; t < st[l].n_tensors; t++)
                if (st[l].tensors[t].tok_begin == (int64_t)c * B && st[l].tensors[t].tok_end == (int64_t)(c + 1) * B)
                    ly->tensors[ly->n_tensors++] = st[l].tensors[t];
        }
        void *val = NULL;
        size_t vb = 0, kb = 0;
        const void *kid = NULL;
        if (!rc)
            wpipe_count_layers(&w, layers, L); /* before encode_record frees the tensor lists */
        if ((rc = encode_record(&rec, rc, rec.tokens, B, &val, &vb, &kid, &kb)))
            goto out;
        if ((rc = wpipe_add(r, &w, 'b', keys[c], val, vb, c ? keys[c - 1] : kvt__remote_node_key(r, ns, keys, 0), kid,
                            kb, ttlp)))
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
            if ((rc = layer_desc(ly, &st[l], st[l].offset, st[l].min_offset)))
                break;
            for (int32_t t = 0; t < st[l].n_tensors; t++) {
                const kvt_tensor *x = &st[l].tensors[t];
                int chained = x->tok_begin >= 0 && x->tok_end <= tail_at && x->tok_end - x->tok_begin == B &&
                              x->tok_begin % (B ? B : 1) == 0 && n_chain > 0;
                if (!chained)
                    ly->tensors[ly->n_tensors++] = *x;
            }
        }
        void *val = NULL;
        size_t vb = 0, kb = 0;
        const void *kid = NULL;
        if (!rc)
            wpipe_count_layers(&w, layers, L);
        rc = encode_record(&rec, rc, e->tokens + tail_at, n - tail_at, &val, &vb, &kid, &kb);
        kvt__free(bk);
        if (rc)
            goto out;
        if ((rc = wpipe_add(r, &w, 'e', ekey, val, vb, kvt__remote_node_key(r, ns, keys, n_chain), kid, kb, ttlp)))
            goto out;
    }
    char lk[KVT__REMOTE_KEY_MAX], lv[64];
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
    kvt__remote_layers_add(r, w.ldone, w.ldone ? w.nl : 0);
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
