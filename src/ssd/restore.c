/*
 * restore.c: reading entries back from the SSD tier: shard payloads mapped
 * or copied into owned buffers and checked before any byte is used, the
 * entry built by the codec (src/tier/codec.h), entries still in the
 * write-behind queue served from the queue, refusals counted and corrupt
 * shards forgotten, and kvt_store_restore and kvt_store_restore_async of a
 * durable entry as coalesced foreground operations of the I/O worker (one
 * read, a zero-copy clone per waiter).
 * It never hands out a byte whose checksum it has not verified.
 */
#include "codec.h"
#include "hmap.h"
#include "internal.h"
#include "io_entry.h"
#include "store_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- restore ------------------------------------------------------------------- */

static void free_base(void *ctx, void *data, size_t bytes)
{
    (void)data;
    (void)bytes;
    kvt__free(ctx);
}

typedef struct kvt__map {
    void *base;
    size_t len;
} kvt__map;

static void unmap_release(void *ctx, void *data, size_t bytes)
{
    (void)data;
    (void)bytes;
    kvt__map *m = ctx;
    munmap(m->base, m->len);
    kvt__free(m);
}

/* Maps a shard read-only (MAP_POPULATE reads it in one sequential pass); the
 * buffer's release unmaps it once the last view is gone (DESIGN.md 4). Shards
 * are immutable under their final names (never truncated or rewritten), and
 * an unlinked file stays readable through the mapping. Returns 1 when mapping
 * is not possible (the caller then copies). */
static int map_payload(int fd, const kvt__shard *sh, const char *path, int strict, kvt_buf **out, int *reason)
{
    if (sh->payload_bytes < (64u << 10))
        return 1; /* small: a copy is cheaper than a mapping */
    kvt__map *m = kvt__malloc(sizeof *m);
    if (!m)
        return kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
    uint8_t *p;
    m->len = (size_t)sh->file_bytes;
    m->base = kvt__io_mmap(NULL, m->len, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m->base == MAP_FAILED) {
        kvt__free(m);
        return 1;
    }
    p = (uint8_t *)m->base + sh->payload_off;
    int rc = kvt__shard_check(sh, p, strict, path, reason);
    if (!rc && (rc = kvt_buf_wrap(p, (size_t)sh->payload_bytes, unmap_release, m, out)))
        rc = kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
    if (rc) {
        munmap(m->base, m->len);
        kvt__free(m);
    }
    return rc;
}

/* Reads a shard's payload into an owned buffer (a read-only mapping for large
 * shards, else a 64-byte aligned copy) and checks it before anything can use
 * it: XXH3-128 always, SHA-256 as well when strict (or for a version 1
 * shard, which has no XXH3-128). */
static int read_payload(int fd, const kvt__shard *sh, const char *path, int strict, kvt_buf **out, int *reason)
{
    *out = NULL;
    int mr = map_payload(fd, sh, path, strict, out, reason);
    if (mr != 1)
        return mr;
    size_t n = (size_t)sh->payload_bytes;
    uint8_t *base = kvt__malloc(n + 64);
    if (!base)
        return kvt__fail(KVT_ENOMEM, "%s: cannot allocate %zu bytes", path, n);
    uint8_t *p = base + ((64 - ((uintptr_t)base & 63)) & 63);
    size_t got = 0;
    while (got < n) {
        ssize_t r = kvt__io_pread(fd, p + got, n - got, (off_t)(sh->payload_off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int e = r < 0 ? errno : 0;
            kvt__free(base);
            *reason = r < 0 ? KVT_STORE_REFUSED_IO : KVT_STORE_REFUSED_TRUNCATED;
            return kvt__fail(r < 0 ? -e : KVT_EFORMAT, "%s: payload read failed at %zu of %zu bytes", path, got, n);
        }
        got += (size_t)r;
    }
    if (kvt__shard_check(sh, p, strict, path, reason)) {
        kvt__free(base);
        return KVT_ECORRUPT;
    }
    int rc = kvt_buf_wrap(p, n, free_base, base, out);
    if (rc)
        kvt__free(base);
    return rc;
}

/* Opens a block shard, validates its header and metadata (identity NULL:
 * the shard's own; the file name must follow from its key) and reads its
 * checked payload into *out. */
int kvt__store_load_block(int dirfd, const char *dir, const char *name, const char *identity, int strict, kvt__rshard *out,
                      kvt__pblock *pb, int *reason)
{
    int fd = -1;
    memset(pb, 0, sizeof *pb);
    int rc = kvt__shard_open(dirfd, dir, name, &out->sh, &fd, reason);
    if (rc)
        return rc;
    if (!(rc = kvt__codec_parse_block(&out->sh, name, identity, pb, reason)))
        rc = kvt__store_check_name('b', pb->key, name, reason);
    if (!rc)
        rc = read_payload(fd, &out->sh, name, strict, &out->buf, reason);
    kvt__io_close(fd);
    if (rc) {
        kvt__free(pb->tokens);
        pb->tokens = NULL;
    }
    return rc;
}

/* Everything a restore checks, shared by kvt_store_restore and store verify:
 * the entry shard's header and metadata (identity; NULL accepts the shard's
 * own), its key against the file name and (want_tok, want_n; want_n < 0:
 * no index copy to compare), every referenced block (present, its own
 * checks, its key, ns, range and tokens against the entry's), every payload's
 * checksum (XXH3-128; SHA-256 as well when strict), every layer description
 * against the tensors it names, and each layer's decode. On success *out is
 * the kvtier-allocated entry. On failure *reason is the refusal (-1 for a plain miss:
 * the entry file is gone) and bad_shard (64 bytes) names the shard at fault
 * ("" when none is). *bytes receives the shard bytes read. */
int kvt__store_load_entry(int dirfd, const char *dir, const char *name, const char *identity, const int32_t *want_tok,
                      int64_t want_n, int strict, kvt_entry *out, int *reason, char *bad_shard, uint64_t *bytes)
{
    return kvt__store_load_entry_tagged(NULL, dirfd, dir, name, identity, want_tok, want_n, strict, out, reason,
                                        bad_shard, bytes);
}

int kvt__store_load_entry_tagged(kvt__store_pins *pins, int dirfd, const char *dir, const char *name,
                                 const char *identity, const int32_t *want_tok, int64_t want_n, int strict,
                                 kvt_entry *out, int *reason, char *bad_shard, uint64_t *bytes)
{
    memset(out, 0, sizeof *out);
    bad_shard[0] = '\0';
    *bytes = 0;
    kvt__rshard ent;
    memset(&ent, 0, sizeof ent);
    kvt__rshard *blk = NULL;
    kvt__pentry pe;
    memset(&pe, 0, sizeof pe);
    int fd = -1, rc;
    int64_t n = 0;
    snprintf(bad_shard, 64, "%s", name);
    if ((rc = kvt__shard_open(dirfd, dir, name, &ent.sh, &fd, reason))) {
        if (rc == KVT_ENOTFOUND) {
            *reason = -1; /* evicted meanwhile: a plain miss */
            bad_shard[0] = '\0';
        }
        goto out;
    }
    if ((rc = kvt__codec_parse_entry(&ent.sh, name, identity, &pe, reason)))
        goto out;
    n = pe.n_tokens;
    if ((rc = kvt__store_check_name('e', pe.key, name, reason)))
        goto out;
    if (want_n >= 0 && (pe.n_tokens != want_n || (n && memcmp(pe.tokens, want_tok, sizeof(int32_t) * (size_t)n)))) {
        rc = kvt__store_refuse(reason, KVT_STORE_REFUSED_TOKENS, name, "stored tokens differ from the index");
        goto out;
    }
    if ((rc = read_payload(fd, &ent.sh, name, strict, &ent.buf, reason)))
        goto out;
    *bytes += ent.sh.file_bytes;
    kvt__io_close(fd);
    fd = -1;
    blk = kvt__calloc((size_t)(pe.n_blocks ? pe.n_blocks : 1), sizeof *blk);
    if (!blk) {
        rc = kvt__fail(KVT_ENOMEM, "store restore: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < pe.n_blocks; i++) {
        char bname[64];
        kvt__store_file_name('b', pe.blocks[i], bname);
        kvt__pblock pb;
        if ((rc = kvt__store_load_block(dirfd, dir, bname, identity, strict, &blk[i], &pb, reason))) {
            if (rc == KVT_ENOTFOUND) {
                *reason = KVT_STORE_REFUSED_MISSING_BLOCK;
                rc = kvt__fail(KVT_EFORMAT, "%s: refused (missing-block): references block %s that is gone", name,
                               bname);
            } else {
                snprintf(bad_shard, 64, "%s", bname);
            }
            goto out;
        }
        rc = kvt__codec_block_check(&pe, i, &pb, bname, reason);
        kvt__pblock_free(&pb);
        if (rc) {
            snprintf(bad_shard, 64, "%s", bname);
            goto out;
        }
        *bytes += blk[i].sh.file_bytes;
    }
    rc = kvt__codec_decode(&pe, &ent, blk, name, out, reason);
    if (!rc)
        kvt__store_tag_blocks(pins, out, blk, pe.blocks, pe.n_blocks);
out:
    if (fd >= 0)
        kvt__io_close(fd);
    for (int32_t i = 0; blk && i < pe.n_blocks; i++)
        kvt__rshard_clear(&blk[i]);
    kvt__free(blk);
    kvt__rshard_clear(&ent);
    kvt__pentry_free(&pe);
    if (rc)
        kvt_entry_clear(out);
    if (!rc || rc == KVT_ENOMEM)
        bad_shard[0] = '\0';
    return rc;
}

static int restore_impl(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt, kvt_entry *out,
                        int *reason, char *bad_shard)
{
    uint64_t t0 = kvt_now_ns();
    memset(out, 0, sizeof *out);
    bad_shard[0] = '\0';
    pthread_mutex_lock(&s->mu);
    st_entry *e = kvt__kmap_ptr(&s->by_id, kvt__store_id_key(handle));
    if (!e) {
        pthread_mutex_unlock(&s->mu);
        return kvt__fail(KVT_ENOTFOUND, "store restore: entry %llu is gone", (unsigned long long)handle);
    }
    kvt__key key = e->key;
    int64_t n = e->n_tokens;
    int32_t *itok = kvt__malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (itok && n)
        memcpy(itok, e->tokens, sizeof(int32_t) * (size_t)n);
    pthread_mutex_unlock(&s->mu);
    if (!itok)
        return kvt__fail(KVT_ENOMEM, "store restore: out of memory");
    int64_t cmpn = KVT__MIN(n_prompt, n);
    if (prompt && cmpn && memcmp(prompt, itok, sizeof(int32_t) * (size_t)cmpn)) {
        kvt__free(itok);
        *reason = KVT_STORE_REFUSED_TOKENS;
        return kvt__fail(KVT_ENOTFOUND, "store restore: stored tokens differ from the requested prefix");
    }
    char name[64];
    kvt__store_file_name('e', key, name);
    uint64_t bytes = 0;
    int rc = kvt__store_load_entry_tagged(s->pins, s->dirfd, s->dir, name, s->identity, itok, n, s->opts.verify, out,
                                          reason, bad_shard, &bytes);
    kvt__free(itok);
    if (rc)
        return rc;
    if (!s->opts.read_only)
        utimensat(s->dirfd, name, NULL, 0); /* the last use survives a restart (best effort) */
    pthread_mutex_lock(&s->mu);
    if ((e = kvt__kmap_ptr(&s->by_key, key)))
        e->last_use_ms = kvt__store_wall_ms();
    s->st.restores++;
    s->st.restore_bytes += bytes;
    s->st.restore_ns_last = kvt_now_ns() - t0;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* A shard whose payload failed its checksum (call with mu held): its file is
 * removed (not in read-only mode) so no later open or restore reads it
 * again, and it leaves the index; for a block, so does every entry that
 * references it, and their entry files are removed by the next reclaim
 * (which runs under the budget lock, due from here: the caller runs it). */
static void forget_corrupt(kvt_store *s, const char *shard)
{
    kvt__key k;
    char hex[33];
    if (!kvt__store_is_shard_name(shard))
        return;
    memcpy(hex, shard + 1, 32);
    hex[32] = '\0';
    if (kvt__key_parse(hex, &k))
        return;
    if (shard[0] == 'e') {
        st_entry *e = kvt__kmap_ptr(&s->by_key, k);
        if (e)
            kvt__store_drop_entry(s, e, s->opts.read_only);
        else if (!s->opts.read_only)
            kvt__io_unlinkat(s->dirfd, shard, 0);
        return;
    }
    if (!s->opts.read_only) {
        kvt__io_unlinkat(s->dirfd, shard, 0);
        s->reclaim_due = 1;
    }
    st_block *b = kvt__kmap_ptr(&s->blocks, k);
    if (b) {
        s->own_bytes -= KVT__MIN(s->own_bytes, b->bytes);
        s->st.blocks--;
        kvt__kmap_del(&s->blocks, k);
        kvt__store_block_forget(s, b);
    }
    for (st_entry *e = s->head, *nx; e; e = nx) {
        nx = e->next;
        for (int32_t i = 0; i < e->n_blocks; i++)
            if (kvt__key_eq(e->blocks[i], k)) {
                kvt__store_drop_entry(s, e, 1);
                break;
            }
    }
}


/* Restores a handle whose write-behind is still queued or in flight from the
 * job's own caches: zero-copy clones, the hook holding a reference on the
 * job (so whatever its entry's hook releases stays alive until the clones
 * are gone). @return 0; KVT_ENOTFOUND (no such pending job, or its tokens
 * differ from the prompt); KVT_ENOMEM. */
static int restore_pending(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt, kvt_entry *out)
{
    pthread_mutex_lock(&s->mu);
    wjob *j = kvt__kmap_ptr(&s->pjobs, kvt__store_id_key(handle));
    if (j)
        atomic_fetch_add(&j->refs, 1);
    pthread_mutex_unlock(&s->mu);
    if (!j)
        return KVT_ENOTFOUND;
    const kvt_entry *e = &j->e;
    int64_t cmpn = KVT__MIN(n_prompt, e->n_tokens);
    int rc = 0;
    if (prompt && cmpn && memcmp(prompt, e->tokens, sizeof(int32_t) * (size_t)cmpn))
        rc = kvt__fail(KVT_ENOTFOUND, "store restore: pending tokens differ from the requested prefix");
    if (rc) {
        kvt__store_job_release(j);
        return rc;
    }
    if ((rc = kvt__entry_share(e, out))) {
        kvt__store_job_release(j);
        return kvt__fail(rc, "store restore: cannot clone a pending entry: %s", kvt_strerror(rc));
    }
    out->hook = (kvt_hook){kvt__store_job_hook, j}; /* from here kvt_entry_clear releases j */
    pthread_mutex_lock(&s->mu);
    s->st.restores++;
    s->st.pending_hits++;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* The restore itself, on the calling thread: the write-behind queue's
 * entry, else the durable shards (every refusal counted, a bad shard
 * forgotten). kvt_store_restore's contract. */
static int restore_direct(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt, kvt_entry *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&s->mu);
    int durable = kvt__kmap_ptr(&s->by_id, kvt__store_id_key(handle)) != NULL;
    pthread_mutex_unlock(&s->mu);
    if (!durable) {
        /* served from the write-behind queue; or, when no job holds the
         * handle, its write may have just become durable under the same
         * handle: the durable path below tries */
        int prc = restore_pending(s, handle, prompt, n_prompt, out);
        if (prc != KVT_ENOTFOUND)
            return prc;
    }
    int reason = -1;
    char bad_shard[64];
    int rc = restore_impl(s, handle, prompt, n_prompt, out, &reason, bad_shard);
    if (rc) {
        pthread_mutex_lock(&s->mu);
        s->st.restore_misses++;
        if (rc != KVT_ENOMEM)
            kvt__store_refuse_count(s, reason);
        if (reason == KVT_STORE_REFUSED_CHECKSUM && bad_shard[0])
            forget_corrupt(s, bad_shard);
        /* A shard that failed validation, or an entry whose file is gone
         * (removed by another process's gc or budget: a plain miss, reason
         * -1), is never offered again (a failed allocation or read says
         * nothing about the shard). */
        if (((reason >= 0 && reason != KVT_STORE_REFUSED_IO) || (reason < 0 && rc == KVT_ENOTFOUND)) &&
            rc != KVT_ENOMEM) {
            st_entry *e = kvt__kmap_ptr(&s->by_id, kvt__store_id_key(handle));
            if (e)
                kvt__store_drop_entry(s, e, 1);
        }
        pthread_mutex_unlock(&s->mu);
        if (rc == KVT_EFORMAT && reason == KVT_STORE_REFUSED_TOKENS)
            rc = KVT_ENOTFOUND;
        char err[256];
        snprintf(err, sizeof err, "%s", kvt_last_error());
        kvt__store_reclaim(s, KVT__KEY_ZERO, 0); /* blocks only the dropped entry used */
        kvt__fail(rc, "%s", err);
    }
    return rc;
}

/* ---- async restore ---------------------------------------------------------------- */

/* One asynchronous restore operation: read once, shared by every waiter
 * (each gets its own zero-copy clone of the result). */
typedef struct rtask {
    kvt_store *s;
    uint64_t handle;
    kvt_entry e; /* the result once run */
} rtask;

/* One kvt_store_restore_async call waiting for an operation. */
typedef struct rwait {
    kvt_store *s;
    kvt_restore_done_fn done;
    void *arg;
} rwait;

static int rtask_run(void *task, void **result)
{
    rtask *t = task;
    int rc = restore_direct(t->s, t->handle, NULL, 0, &t->e);
    if (!rc)
        *result = &t->e;
    return rc;
}

static void rtask_free(void *task, void *result)
{
    (void)result;
    rtask *t = task;
    kvt_entry_clear(&t->e);
    kvt__free(t);
}

/* Gives one waiter its clone of the shared result (or the error), then
 * lets the store's close go on. */
static void rwait_tell(void *arg, int status, kvt_io_disposition d, void *result)
{
    rwait w = *(rwait *)arg;
    kvt__free(arg);
    kvt_entry mine;
    status = kvt__entry_from_result(status, d, result, &mine);
    kvt_store *s = w.s;
    w.done(w.arg, status, status ? NULL : &mine);
    pthread_mutex_lock(&s->mu);
    s->restores_live--;
    pthread_cond_broadcast(&s->idle_cv);
    pthread_mutex_unlock(&s->mu);
}

/* The key of the restore of `handle`: a synchronous and an asynchronous
 * restore of one handle are the same operation (one read). */
static kvt_io_key restore_key(kvt_store *s, uint64_t handle) { return kvt__store_io_key(s, (kvt__key){handle, 0x7e57}); }

/* A durable handle's read as a foreground operation of the I/O worker,
 * waited for: an identical restore queued or running (synchronous or not)
 * is joined, so N threads restoring one handle read it once, each getting
 * its own zero-copy clone. Still queued when submitted, it runs on this
 * thread (no wait for a free worker thread). @return as restore_direct;
 * KVT_EAGAIN / KVT_ECLOSED / KVT_ETOOBIG when the worker cannot take it
 * (nothing was read). */
static int restore_coalesced(kvt_store *s, uint64_t handle, kvt_entry *out)
{
    rtask *t = kvt__calloc(1, sizeof *t);
    if (!t)
        return kvt__fail(KVT_ENOMEM, "kvt_store_restore: out of memory");
    t->s = s;
    t->handle = handle;
    kvt_io_op op = {.kind = KVT_IO_KIND_RESTORE,
                    .key = restore_key(s, handle),
                    .priority = KVT_IO_FOREGROUND,
                    .run = rtask_run,
                    .free_fn = rtask_free,
                    .task = t};
    kvt_io_ticket *tk = NULL;
    int rc = kvt_io_submit(s->worker, &op, &tk);
    if (rc) {
        kvt__free(t);
        return rc;
    }
    /* a failure's message is the one its read set, on whichever thread read (kvt_io_wait) */
    return kvt__entry_wait(tk, out);
}

KVT_API int kvt_store_restore(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt,
                              kvt_entry *out)
{
    if (!s || !out || (n_prompt && !prompt) || n_prompt < 0)
        return kvt__fail(KVT_EINVAL, "kvt_store_restore: bad arguments");
    memset(out, 0, sizeof *out);
    /* a durable entry whose tokens agree with the prompt is read through the
     * worker (coalesced); the rest on this thread: a pending job is served
     * from memory (no read to share), and a gone handle or a token mismatch
     * takes the refusal path */
    pthread_mutex_lock(&s->mu);
    st_entry *e = kvt__kmap_ptr(&s->by_id, kvt__store_id_key(handle));
    int shared = e != NULL;
    int64_t cmpn = e ? KVT__MIN(n_prompt, e->n_tokens) : 0;
    if (e && prompt && cmpn && memcmp(prompt, e->tokens, sizeof(int32_t) * (size_t)cmpn))
        shared = 0;
    pthread_mutex_unlock(&s->mu);
    if (shared) {
        int rc = restore_coalesced(s, handle, out);
        if (rc != KVT_EAGAIN && rc != KVT_ECLOSED && rc != KVT_ETOOBIG)
            return rc;
        /* the worker's queue is full or it is shutting down: read here */
    }
    return restore_direct(s, handle, prompt, n_prompt, out);
}

KVT_API int kvt_store_restore_async(kvt_store *s, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    if (!s || !done)
        return kvt__fail(KVT_EINVAL, "kvt_store_restore_async: bad arguments");
    rtask *t = kvt__calloc(1, sizeof *t);
    rwait *w = kvt__calloc(1, sizeof *w);
    if (!t || !w) {
        kvt__free(t);
        kvt__free(w);
        return kvt__fail(KVT_ENOMEM, "kvt_store_restore_async: out of memory");
    }
    t->s = s;
    t->handle = handle;
    *w = (rwait){s, done, arg};
    pthread_mutex_lock(&s->mu);
    if (s->closing) {
        pthread_mutex_unlock(&s->mu);
        kvt__free(t);
        kvt__free(w);
        return kvt__fail(KVT_ECLOSED, "kvt_store_restore_async: the store is closing");
    }
    s->restores_live++;
    pthread_mutex_unlock(&s->mu);
    /* a request waits for it: foreground, before write-behind; the same
     * handle queued or being read is joined (one read, many waiters) */
    kvt_io_op op = {.kind = KVT_IO_KIND_RESTORE,
                    .key = restore_key(s, handle),
                    .priority = KVT_IO_FOREGROUND,
                    .run = rtask_run,
                    .free_fn = rtask_free,
                    .task = t};
    int rc = kvt_io_submit_notify(s->worker, &op, rwait_tell, w);
    if (rc) {
        kvt__free(t);
        kvt__free(w);
        pthread_mutex_lock(&s->mu);
        s->restores_live--;
        pthread_cond_broadcast(&s->idle_cv);
        pthread_mutex_unlock(&s->mu);
        return kvt__fail(rc, "kvt_store_restore_async: %s", kvt_strerror(rc));
    }
    return 0;
}
