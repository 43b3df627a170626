/*
 * restore.c: the remote tier's restore. It GETs the records a handle names in
 * one pipeline, validates every record against what the lookup asked for
 * (identity, key, parent, ns, tokens with the content key recomputed, the
 * checksum) before any byte is used, and rebuilds the entry with tensors that
 * alias the replies (released with the last view). A bad record is counted,
 * DELeted and the restore fails with KVT_ECORRUPT; a record gone since the
 * lookup gives KVT_ENOTFOUND, never a shortened entry.
 */
#include "remote_internal.h"

#include <hiredis.h>
#include <stdatomic.h>
#include <string.h>

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
static void delete_bad(kvt_remote *r, char (*names)[KVT__REMOTE_KEY_MAX], const size_t *lens, const int *bad, int32_t n)
{
    kvt__rpipe p = {0};
    for (int32_t i = 0; i < n; i++)
        if (bad[i]) {
            const char *av[2] = {"DEL", names[i]};
            size_t al[2] = {3, lens[i]};
            kvt__rpipe_add(&p, 1, 2, av, al);
        }
    if (p.n) /* small commands: bounded like a lookup, so a failing restore returns soon */
        kvt__rconn_exec(r->conn, &p, r->lookup_ms);
    kvt__rpipe_clear(&p);
}

static int ns_eq(const kvt__rec *rec, const char *ns)
{
    return rec->ns_len == strlen(ns) && memcmp(rec->ns, ns, rec->ns_len) == 0;
}

/* Checks block record j against what the handle asked for. */
static int block_ok(const kvt_remote *r, const kvt__rec *b, const kvt__rhandle *h, int32_t j, int64_t at)
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

static int entry_ok(const kvt_remote *r, const kvt__rec *e, const kvt__rhandle *h)
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

int kvt__remote_restore_direct(void *self, uint64_t handle, kvt_entry *out)
{
    kvt_remote *r = self;
    memset(out, 0, sizeof *out);
    kvt__rhandle h;
    int rc = kvt__remote_handle_get(r, handle, &h);
    if (rc)
        return rc;
    int64_t t0 = kvt__remote_now_ms();
    int32_t nk = h.n_keys, nrec = nk + (h.is_entry ? 1 : 0);
    char (*names)[KVT__REMOTE_KEY_MAX] = kvt__malloc(KVT__REMOTE_KEY_MAX * (size_t)(nrec ? nrec : 1));
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
    if (kvt__remote_all_down(r)) {
        rc = kvt__fail(KVT_EIO, "remote restore: redis %s is unreachable", r->host);
        goto out;
    }
    /* records [0..nk) are the blocks, nk the entry */
    for (int32_t i = 0; i < nrec; i++) {
        lens[i] =
            i < nk ? kvt__remote_key_name(r, 'b', h.keys[i], names[i]) : kvt__remote_key_name(r, 'e', h.ekey, names[i]);
        const char *av[2] = {"GET", names[i]};
        size_t al[2] = {3, lens[i]};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
    }
    /* the whole restore, every round trip and read, ends by its deadline */
    p.deadline_ms = t0 + r->restore_ms;
    if (kvt__rconn_exec(r->conn, &p, r->io_ms)) {
        rc = p.fail == KVT__RF_TIMEOUT
                 ? kvt__fail(KVT_EIO, "remote restore: redis %s did not answer within the restore timeout (%d ms)",
                             r->host, (int)r->restore_ms)
                 : kvt__fail(KVT_EIO, "remote restore: redis %s did not answer", r->host);
        goto out;
    }
    for (int32_t i = 0; i < nrec; i++) {
        redisReply *rep = p.cmds[i].reply;
        if (rep->type == REDIS_REPLY_NIL) {
            KVT__REMOTE_BUMP(r, restore_partial, 1);
            rc = kvt__fail(KVT_ENOTFOUND, "remote restore: record %d of %d is gone (evicted since the lookup)",
                           (int)i + 1, (int)nrec);
            goto out;
        }
        if (rep->type != REDIS_REPLY_STRING) {
            KVT__REMOTE_BUMP(r, failures_reply, 1);
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
    /* validate every record before using any. An entry names its own chained
     * blocks: the first `nuse` of the blocks fetched, which the lookup took
     * from the prompt's chain (it may have fetched more than the entry uses) */
    int64_t at = 0;
    int32_t nuse = nk, short_chain = 0;
    for (int32_t i = 0; i < nrec && !rc; i++) {
        rc = kvt__rec_parse(hs[i]->rep->str, hs[i]->rep->len, &recs[i]);
        if (!rc && i < nk) {
            rc = block_ok(r, &recs[i], &h, i, at);
            at += recs[i].n_tokens;
        } else if (!rc) {
            rc = entry_ok(r, &recs[i], &h);
            if (!rc && recs[i].n_blocks > nk) {
                short_chain = 1; /* its blocks past the lookup's run were not seen: a miss, not a bad record */
                break;
            }
            nuse = recs[i].n_blocks;
            for (int32_t j = 0; !rc && j < nuse; j++)
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
    if (short_chain) {
        KVT__REMOTE_BUMP(r, restore_partial, 1);
        rc = kvt__fail(KVT_ENOTFOUND, "remote restore: the entry names %d blocks, the lookup found %d",
                       (int)recs[nk].n_blocks, (int)nk);
        goto out;
    }
    if (!rc && h.is_entry && nuse && recs[nk].n_layers != recs[0].n_layers)
        rc = kvt__fail(KVT_EFORMAT, "remote restore: the entry and its blocks disagree on the layer count");
    if (rc) {
        KVT__REMOTE_BUMP(r, bad_records, 1);
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
            if (!h.is_entry) { /* blocks alone: a layer whose block records say it is reachable at
                                  their end only (standalone 2) holds whole blocks, nothing open */
                d.offset = h.n_tokens;
                d.min_offset = d.min_offset > 0 ? h.n_tokens : 0;
            }
            rc = build_layer(recs, hs, nuse, &d, h.is_entry ? &recs[nk].layers[l] : NULL, h.is_entry ? hs[nk] : NULL,
                             l, &out->caches[l]);
        }
        for (int32_t a = 0; a < A && !rc; a++)
            rc = kvt_attachment_blob(recs[nk].atts[a].name, recs[nk].atts[a].data, recs[nk].atts[a].bytes,
                                     &out->attachments[a]);
        if (rc) {
            kvt_entry_clear(out);
            if (rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED) {
                KVT__REMOTE_BUMP(r, bad_records, 1);
                for (int32_t i = 0; i < nrec; i++)
                    bad[i] = i < nuse || i == nk;
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
    kvt__remote_hslot_clear(&h);
    pthread_mutex_lock(&r->mu);
    if (rc) {
        r->st.restore_failures++;
    } else {
        r->st.restores++;
        r->st.restored_bytes += got_bytes;
    }
    r->st.restore_ms += (uint64_t)(kvt__remote_now_ms() - t0);
    pthread_mutex_unlock(&r->mu);
    if (rc)
        memset(out, 0, sizeof *out);
    return rc;
}
