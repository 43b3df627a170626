/*
 * put.c: the SSD tier's synchronous write (kvt_store_put, and the
 * write-behind operation's job): an entry is encoded (src/tier/codec.h), the blocks the
 * store lacks are written crash-safely, then the entry shard, and only then
 * is it indexed. It must never index an entry before it and its blocks are
 * durable, and never rely on a block without holding the shared budget lock
 * (budget.c) from the moment it is pinned until the entry is renamed.
 */
#include "codec.h"
#include "index.h"
#include "internal.h"
#include "store_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define KVT__WINDOW 16 /* block shards written before the first fsync */

static int fsync_dir(kvt_store *s)
{
    int (*fs)(void *, int) = s->opts.io && s->opts.io->fsync_fn ? s->opts.io->fsync_fn : NULL;
    int r = fs ? fs(s->opts.io->ctx, s->dirfd) : kvt__io_fsync(s->dirfd);
    if (r)
        return kvt__fail(-(errno ? errno : EIO), "%s: directory fsync failed: %s", s->dir, strerror(errno));
    return 0;
}

/* The first (shortest) entry a new trimmable entry of reach min_reach (and
 * block granule, 0: none) supersedes: a strict prefix of it in its ns,
 * non-empty, that the new one serves at every length it serves: at least
 * min_reach long (served by cutting the new one back), or reaching only its
 * own end at a multiple of the granule, its own granule a multiple of it
 * (every length it can be cut to is a block boundary of the new one). */
typedef struct sup_ctx {
    int64_t min_reach, granule;
    st_entry *found;
} sup_ctx;

static void supersede_pick(void *val, int64_t depth, void *ctx)
{
    sup_ctx *c = ctx;
    st_entry *old = val;
    int covered = old->n_tokens >= c->min_reach ||
                  (c->granule > 0 && old->min_reach == old->n_tokens && old->n_tokens % c->granule == 0 &&
                   old->granule > 0 && old->granule % c->granule == 0);
    if (!c->found && old->n_tokens > 0 && covered)
        c->found = old;
}

/* Drops every entry the new one supersedes (call with mu held). One walk
 * of the prompt per dropped entry: no allocation and no cap on how many. */
static void supersede(kvt_store *s, const char *ns, const int32_t *tokens, int64_t n, int64_t min_reach,
                      int64_t granule)
{
    for (;;) {
        sup_ctx c = {min_reach, granule, NULL};
        kvt__index_prefixes(s->tree, ns, tokens, n, supersede_pick, &c);
        if (!c.found)
            return;
        kvt__store_drop_entry(s, c.found, 0);
        s->st.superseded++;
    }
}

/* What one put holds while it runs. */
typedef struct put_job {
    kvt_store *s;
    const kvt_entry *e;
    kvt__enc enc;
    int8_t *pinned;          /* (enc.n_chain) this put holds a reference on block c */
    kvt__st_out *outs;       /* (kvt__enc_max_tensors) */
    kvt__pending_shard *win; /* (KVT__WINDOW) */
} put_job;

static int block_there(kvt_store *s, kvt__key k)
{
    char bn[64];
    struct stat bst;
    kvt__store_file_name('b', k, bn);
    return fstatat(s->dirfd, bn, &bst, AT_SYMLINK_NOFOLLOW) == 0;
}

/* Step 2: is the entry durable already (then *done = 1: recently used, skip)?
 * Else pins the blocks the index has and the disk still holds. */
static void put_pin(put_job *p, int *done)
{
    kvt_store *s = p->s;
    const kvt__enc *enc = &p->enc;
    char ename[64];
    kvt__store_file_name('e', enc->key, ename);
    struct stat est;
    int e_on_disk = fstatat(s->dirfd, ename, &est, AT_SYMLINK_NOFOLLOW) == 0;
    pthread_mutex_lock(&s->mu);
    st_entry *have = kvt__kmap_ptr(&s->by_key, enc->key);
    if (have && !e_on_disk) {
        kvt__store_drop_entry(s, have, 2); /* removed behind our back: write it again */
        have = NULL;
    }
    *done = have != NULL;
    if (have) {
        have->last_use_ms = kvt__store_wall_ms(); /* written again: recently used */
        s->st.skipped++;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    for (int32_t c = 0; c < enc->n_chain; c++) {
        st_block *b = kvt__kmap_ptr(&s->blocks, enc->keys[c]);
        if (b) {
            b->refs++;
            p->pinned[c] = 1;
        }
    }
    pthread_mutex_unlock(&s->mu);
    for (int32_t c = 0; c < enc->n_chain; c++) {
        int there = p->pinned[c] && block_there(s, enc->keys[c]);
        pthread_mutex_lock(&s->mu);
        if (p->pinned[c] && !there) { /* gone from disk: written again below */
            st_block *b = kvt__kmap_ptr(&s->blocks, enc->keys[c]);
            if (b)
                b->refs--;
            p->pinned[c] = 0;
        } else if (there) {
            s->st.blocks_shared++;
        }
        pthread_mutex_unlock(&s->mu);
    }
}

/* Indexes block c just renamed (fb bytes) and pins it for this put. */
static int put_index_block(put_job *p, int32_t c, const char *final, uint64_t fb)
{
    kvt_store *s = p->s;
    kvt__key k = p->enc.keys[c];
    /* the block's tensors again (outs is free once a shard is begun), for its per-layer bytes */
    json_t *meta = NULL;
    int32_t nt = 0;
    uint64_t *lb = NULL;
    int32_t nlb = 0;
    int lrc = kvt__enc_block(&p->enc, c, s->identity, &meta, p->outs, &nt);
    json_decref(meta);
    if (!lrc)
        lrc = kvt__store_lbytes_out(p->outs, nt, &lb, &nlb);
    pthread_mutex_lock(&s->mu);
    kvt__store_orphan_forget(s, final);
    st_block *b = kvt__kmap_ptr(&s->blocks, k);
    if (b) {
        b->refs++;
        kvt__free(lb);
    } else if (!lrc && (b = kvt__calloc(1, sizeof *b)) && !kvt__kmap_put_ptr(&s->blocks, k, b)) {
        b->key = k;
        b->bytes = fb;
        b->refs = 1;
        b->lbytes = lb;
        b->n_lbytes = nlb;
        s->own_bytes += fb;
        kvt__store_lbytes_account(s, lb, nlb, 1);
        s->st.blocks++;
    } else {
        kvt__free(b);
        kvt__free(lb);
        pthread_mutex_unlock(&s->mu);
        char name[64];
        kvt__store_file_name('b', k, name);
        kvt__io_unlinkat(s->dirfd, name, 0);
        return kvt__fail(KVT_ENOMEM, "store put: out of memory");
    }
    p->pinned[c] = 1;
    s->st.blocks_written++;
    s->st.bytes_written += fb;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* Commits the window's shards win[0..nwin) in order, indexing each. On an
 * error the rest are aborted. */
static int put_commit_window(put_job *p, const int32_t *win_c, int32_t nwin)
{
    for (int32_t w = 0; w < nwin; w++) {
        uint64_t fb = p->win[w].bytes;
        int rc = kvt__shard_commit(&p->win[w], p->s->opts.io);
        if (!rc)
            rc = put_index_block(p, win_c[w], p->win[w].final, fb);
        if (rc) {
            for (int32_t x = w + 1; x < nwin; x++)
                kvt__shard_abort(&p->win[x]);
            return rc;
        }
    }
    return 0;
}

/* Step 3: writes the missing blocks: up to KVT__WINDOW temp files back to
 * back (shard k sealed after shard k+1 is begun, so hashes overlap;
 * writeback started on each), then each fsync'd, renamed and indexed; one
 * directory fsync at the end. */
static int put_blocks(put_job *p)
{
    kvt_store *s = p->s;
    const kvt__enc *enc = &p->enc;
    int wrote_block = 0, rc = 0;
    int32_t nwin = 0, win_c[KVT__WINDOW];
    for (int32_t c = 0; c <= enc->n_chain; c++) {
        int last = c == enc->n_chain;
        if (!last && p->pinned[c])
            continue;
        if (!last) {
            json_t *meta = NULL;
            int32_t k = 0;
            char name[64];
            kvt__store_file_name('b', enc->keys[c], name);
            rc = kvt__enc_block(enc, c, s->identity, &meta, p->outs, &k);
            if (!rc)
                rc = kvt__shard_begin(s->dirfd, s->dir, name, meta, p->outs, k, s->opts.io, s->worker,
                                      &p->win[nwin]);
            json_decref(meta);
            if (rc)
                goto abort_win;
            win_c[nwin++] = c;
            /* seal the previous shard only now: its hash ran beside this
             * shard's writes (and this shard's hash runs beside the seal) */
            if (nwin > 1 && (rc = kvt__shard_seal(&p->win[nwin - 2])))
                goto abort_win;
            if (nwin < KVT__WINDOW)
                continue;
        }
        if (nwin && (rc = put_commit_window(p, win_c, nwin)))
            return rc;
        wrote_block |= nwin > 0;
        nwin = 0;
    }
    return wrote_block ? fsync_dir(s) : 0;
abort_win:
    for (int32_t x = 0; x < nwin; x++)
        kvt__shard_abort(&p->win[x]);
    return rc;
}

/* Bytes the entry needs on disk with all its blocks (their files now). */
static uint64_t put_need(put_job *p, uint64_t fb)
{
    uint64_t need = fb;
    for (int32_t c = 0; c < p->enc.n_chain; c++) {
        char bn[64];
        struct stat bst;
        kvt__store_file_name('b', p->enc.keys[c], bn);
        if (!fstatat(p->s->dirfd, bn, &bst, AT_SYMLINK_NOFOLLOW))
            need += (uint64_t)bst.st_size;
    }
    return need;
}

/* Step 5: indexes the entry (file `name`, fb bytes; the pins become its
 * references) and supersedes the prefixes it serves. */
static int put_index_entry(put_job *p, const char *name, uint64_t fb, uint64_t want_id, int32_t n_outs)
{
    kvt_store *s = p->s;
    const kvt__enc *enc = &p->enc;
    const kvt_entry *e = p->e;
    int64_t n = e->n_tokens;
    st_entry *en = kvt__calloc(1, sizeof *en);
    int lrc = 0;
    if (en) {
        en->ns = kvt__strdup(e->ns);
        en->tokens = kvt__malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
        en->blocks = kvt__malloc(sizeof(kvt__key) * (size_t)(enc->n_chain ? enc->n_chain : 1));
        lrc = kvt__store_lbytes_out(p->outs, n_outs, &en->lbytes, &en->n_lbytes); /* the shard's tensors */
    }
    if (!en || !en->ns || !en->tokens || !en->blocks || lrc) {
        kvt__store_entry_free(en);
        kvt__io_unlinkat(s->dirfd, name, 0);
        return kvt__fail(KVT_ENOMEM, "store put: out of memory");
    }
    if (n)
        memcpy(en->tokens, e->tokens, sizeof(int32_t) * (size_t)n);
    memcpy(en->blocks, enc->keys, sizeof(kvt__key) * (size_t)enc->n_chain);
    en->n_blocks = enc->n_chain;
    en->key = enc->key;
    en->n_tokens = n;
    en->min_reach = enc->min_reach;
    en->granule = enc->granule;
    en->bytes = fb;
    en->id = want_id;
    en->last_use_ms = kvt__store_wall_ms();
    /* with its blocks over the whole budget, the entry is not kept (the
     * reclaim after the put drops it first): it must not supersede the
     * shorter entries that fit */
    int too_big = s->opts.max_bytes && put_need(p, fb) > s->opts.max_bytes;
    pthread_mutex_lock(&s->mu);
    kvt__store_orphan_forget(s, name);
    if (kvt__kmap_ptr(&s->by_key, enc->key)) { /* a concurrent put of the same entry won: same file */
        kvt__store_entry_free(en);
        s->st.skipped++;
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    if (kvt__store_index_entry(s, en)) {
        pthread_mutex_unlock(&s->mu);
        kvt__store_entry_free(en);
        kvt__io_unlinkat(s->dirfd, name, 0);
        return kvt__fail(KVT_ENOMEM, "store put: out of memory");
    }
    memset(p->pinned, 0, (size_t)(enc->n_chain ? enc->n_chain : 1)); /* transferred */
    s->st.written++;
    s->st.bytes_written += fb;
    /* supersede: a trimmable entry (its block granule counts) serves its
     * strict same-ns prefixes */
    if (kvt__store_trimmable(n, enc->min_reach, enc->granule) && e->n_attachments == 0 && !too_big)
        supersede(s, e->ns, e->tokens, n, enc->min_reach, enc->granule);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* Step 4: the entry shard (local tensors, attachments, layer
 * descriptions), durable; then step 5. */
static int put_entry(put_job *p, uint64_t want_id)
{
    kvt_store *s = p->s;
    json_t *meta = NULL;
    int32_t k = 0;
    int rc = kvt__enc_entry_shard(&p->enc, s->identity, &meta, p->outs, &k);
    if (rc)
        return rc;
    char name[64];
    uint64_t fb = 0;
    kvt__store_file_name('e', p->enc.key, name);
    rc = kvt__shard_write(s->dirfd, s->dir, name, meta, p->outs, k, s->opts.io, s->worker, &fb);
    json_decref(meta);
    if (rc)
        return rc;
    if ((rc = fsync_dir(s))) {
        kvt__io_unlinkat(s->dirfd, name, 0);
        return rc;
    }
    return put_index_entry(p, name, fb, want_id, k);
}

/* Step 1: encodes the entry and checks it can fit the budget. */
static int put_encode(put_job *p)
{
    kvt_store *s = p->s;
    int rc = kvt__enc_entry(&p->enc, s->id_seed, p->e);
    if (rc)
        return rc;
    if (s->opts.max_bytes && p->enc.state_bytes > s->opts.max_bytes)
        return kvt__fail(KVT_ETOOBIG, "store put: %llu bytes of state, the budget is %llu",
                         (unsigned long long)p->enc.state_bytes, (unsigned long long)s->opts.max_bytes);
    p->pinned = kvt__calloc((size_t)(p->enc.n_chain ? p->enc.n_chain : 1), 1);
    p->outs = kvt__calloc(kvt__enc_max_tensors(&p->enc), sizeof *p->outs);
    if (!p->pinned || !p->outs)
        return kvt__fail(KVT_ENOMEM, "store put: out of memory");
    return 0;
}

/* Drops the pins this put still holds (blocks it wrote or found but did
 * not hand to an indexed entry). */
static void put_unpin(put_job *p)
{
    int any = 0;
    for (int32_t c = 0; p->pinned && c < p->enc.n_chain; c++)
        any |= p->pinned[c];
    if (!any)
        return;
    pthread_mutex_lock(&p->s->mu);
    for (int32_t c = 0; c < p->enc.n_chain; c++)
        if (p->pinned[c])
            kvt__store_block_unref(p->s, p->enc.keys[c], 0);
    pthread_mutex_unlock(&p->s->mu);
}

int kvt__store_write(kvt_store *s, const kvt_entry *e, uint64_t want_id)
{
    put_job p = {.s = s, .e = e};
    kvt__key ekey = kvt__entry_key(s->id_seed, e->ns, e->tokens, e->n_tokens);
    int lockfd = -1, done = 0;
    p.win = kvt__calloc(KVT__WINDOW, sizeof *p.win);
    int rc = p.win ? put_encode(&p) : kvt__fail(KVT_ENOMEM, "store put: out of memory");
    if (!rc) {
        /* From here until the entry is renamed the put holds the shared
         * budget lock: no reclaim of any process deletes a block it relies
         * on; and what the index says exists is checked on disk (another
         * process may have removed it). */
        lockfd = kvt__store_put_lock(s);
        put_pin(&p, &done);
    }
    int8_t *written = NULL; /* the blocks this put writes itself: not there before */
    if (!rc && !done && p.enc.n_chain > 0 && (written = kvt__malloc((size_t)p.enc.n_chain)))
        for (int32_t c = 0; c < p.enc.n_chain; c++)
            written[c] = !p.pinned[c];
    if (!rc && !done && !(rc = put_blocks(&p)))
        rc = put_entry(&p, want_id);
    if (!rc && !done && written) /* durable now: live caches holding these blocks may refer to them */
        kvt__store_tag_written(s, &p.enc, written);
    kvt__free(written);
    put_unpin(&p);
    if (rc) {
        pthread_mutex_lock(&s->mu);
        s->st.failed++;
        pthread_mutex_unlock(&s->mu);
    }
    if (lockfd >= 0)
        kvt__io_close(lockfd); /* the entry is renamed (or the put failed): reclaim may run */
    char err[256];
    if (rc)
        snprintf(err, sizeof err, "%s", kvt_last_error());
    kvt__store_reclaim(s, ekey, 0);
    if (rc)
        kvt__fail(rc, "%s", err);
    kvt__enc_clear(&p.enc);
    kvt__free(p.pinned);
    kvt__free(p.outs);
    kvt__free(p.win);
    return rc;
}

/* ---- the public write ---------------------------------------------------------- */

int kvt__store_check_entry(const kvt_entry *e, const char *fn)
{
    if (!e || !e->ns || e->n_tokens < 0 || (e->n_tokens && !e->tokens) || e->n_caches < 0 ||
        (e->n_caches && !e->caches) || e->n_attachments < 0 || (e->n_attachments && !e->attachments))
        return kvt__fail(KVT_EINVAL, "%s: entry is NULL or inconsistent", fn);
    if (!kvt__utf8_valid(e->ns))
        return kvt__fail(KVT_EINVAL, "%s: namespace is not valid UTF-8", fn);
    for (int32_t l = 0; l < e->n_caches; l++)
        if (!e->caches[l])
            return kvt__fail(KVT_EINVAL, "%s: layer %d is NULL", fn, (int)l);
    for (int32_t a = 0; a < e->n_attachments; a++)
        if (e->attachments[a] && !kvt__utf8_valid(e->attachments[a]->name))
            return kvt__fail(KVT_EINVAL, "%s: attachment %d's name is not valid UTF-8", fn, (int)a);
    return 0;
}

/* A write to a read-only store: refused and counted. */
int kvt__store_refuse_write(kvt_store *s, const char *fn)
{
    pthread_mutex_lock(&s->mu);
    s->st.write_refused++;
    pthread_mutex_unlock(&s->mu);
    return kvt__fail(-EROFS, "%s: %s is open read-only: nothing is written", fn, s->dir);
}

KVT_API int kvt_store_put(kvt_store *s, const kvt_entry *e)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_store_put: store is NULL");
    int rc = kvt__store_check_entry(e, "kvt_store_put");
    if (!rc && s->opts.read_only)
        return kvt__store_refuse_write(s, "kvt_store_put");
    return rc ? rc : kvt__store_write(s, e, 0);
}

