/*
 * block_ref.c: references to single kv blocks the SSD tier holds durably,
 * for live caches that page such a block out by reference instead of
 * writing it to their page file (residency.c, internal.h's buffer
 * origins).
 *
 * A restore tags each full kv block buffer that lies in a block shard with
 * an origin: the shard's key, the file offset and size of the block's
 * tensor. The origin's pin counts the block in the store's pin table
 * (kvt__store_pins, in memory only: a crash leaves no pin behind), which
 * the budget's reclaim adds to the block's references, so neither budget
 * eviction nor the release of its last entry deletes a pinned block. The
 * table is one per identity directory in the process (every store opened
 * on it shares it). While any pin is held the table holds a shared flock
 * on the directory's .lock, so kvt_store_gc, which collects only
 * directories nobody holds, leaves it alone even after the store is closed. A read
 * opens the shard by name and reads the tensor's bytes; the caller checks
 * them against the checksum it took of the same bytes in RAM before it let
 * them go. Pins are per process: another process sharing the identity
 * directory does not see them (its reclaim may delete the block; then a
 * read fails and the request errs, never a wrong token).
 */
#include "internal.h"
#include "io_shim.h"
#include "store_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/file.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

/* One table per identity directory per process (every store opened on it
 * shares it, so a store opened later sees the pins of an earlier one). */
struct kvt__store_pins {
    int64_t refs;         /* under g_mu: one per store open on the directory, one per origin */
    dev_t dev;            /* the directory's identity */
    ino_t ino;
    struct kvt__store_pins *next;
    pthread_mutex_t mu;   /* everything below */
    kvt__kmap count;      /* block key -> pins held */
    int64_t total;        /* pins held over all blocks */
    int dirfd;            /* a descriptor of the identity directory (owned) */
    int held_lockfd;      /* while total > 0: .lock open with a shared flock, else -1 */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct kvt__store_pins *g_tables;

int kvt__store_pins_create(int dirfd, kvt__store_pins **out)
{
    *out = NULL;
    struct stat ds;
    if (dirfd < 0)
        return 0; /* nothing on disk to refer to (a read-only store without its directory) */
    if (fstat(dirfd, &ds))
        return kvt__fail(-errno, "store: cannot stat the directory: %s", strerror(errno));
    pthread_mutex_lock(&g_mu);
    kvt__store_pins *p = g_tables;
    while (p && !(p->dev == ds.st_dev && p->ino == ds.st_ino))
        p = p->next;
    if (p) {
        p->refs++;
        pthread_mutex_unlock(&g_mu);
        *out = p;
        return 0;
    }
    int rc = 0;
    if (!(p = kvt__calloc(1, sizeof *p))) {
        rc = kvt__fail(KVT_ENOMEM, "store: out of memory for the pin table");
    } else if ((p->dirfd = fcntl(dirfd, F_DUPFD_CLOEXEC, 0)) < 0) {
        rc = kvt__fail(-errno, "store: cannot duplicate the directory descriptor: %s", strerror(errno));
        kvt__free(p);
    } else {
        p->refs = 1;
        p->dev = ds.st_dev;
        p->ino = ds.st_ino;
        p->held_lockfd = -1;
        pthread_mutex_init(&p->mu, NULL);
        p->next = g_tables;
        g_tables = p;
        *out = p;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static void pins_retain(kvt__store_pins *p)
{
    pthread_mutex_lock(&g_mu);
    p->refs++;
    pthread_mutex_unlock(&g_mu);
}

static void pins_release(kvt__store_pins *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&g_mu);
    int last = --p->refs == 0;
    if (last)
        for (kvt__store_pins **pp = &g_tables; *pp; pp = &(*pp)->next)
            if (*pp == p) {
                *pp = p->next;
                break;
            }
    pthread_mutex_unlock(&g_mu);
    if (!last)
        return;
    if (p->held_lockfd >= 0)
        kvt__io_close(p->held_lockfd);
    close(p->dirfd);
    kvt__kmap_free(&p->count);
    pthread_mutex_destroy(&p->mu);
    kvt__free(p);
}

void kvt__store_pins_close(kvt__store_pins *p) { pins_release(p); }

/* ---- the origin of one block tensor ------------------------------------------------------- */

typedef struct block_origin {
    kvt__origin base;
    kvt__store_pins *pins; /* retained */
    kvt__key key;          /* the block shard */
    uint64_t off, bytes;   /* the tensor's bytes in the file */
} block_origin;

/* Pins: the block file must still be there, checked under the shared
 * budget lock (reclaim holds it exclusively while it deletes), so a block
 * reclaim is deleting is not pinned; a reclaim running now makes the pin
 * fail (the caller keeps its own copy) rather than wait. */
static int bo_pin(kvt__origin *o)
{
    block_origin *b = (block_origin *)o;
    kvt__store_pins *p = b->pins;
    char name[64];
    kvt__store_file_name('b', b->key, name);
    int lfd = kvt__io_openat(p->dirfd, KVT__BUDGET_LOCK, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (lfd >= 0 && flock(lfd, LOCK_SH | LOCK_NB)) {
        kvt__io_close(lfd);
        return kvt__fail(KVT_EAGAIN, "store: block %s: the budget is being applied: not pinned", name);
    }
    struct stat st;
    int rc = 0;
    if (fstatat(p->dirfd, name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode) ||
        (uint64_t)st.st_size < b->off + b->bytes)
        rc = kvt__fail(KVT_ENOTFOUND, "store: block %s is gone: not pinned", name);
    pthread_mutex_lock(&p->mu);
    if (!rc && p->total == 0) { /* the first pin: hold the directory against gc (a shared flock on .lock) */
        p->held_lockfd = kvt__io_openat(p->dirfd, ".lock", O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (p->held_lockfd >= 0 && flock(p->held_lockfd, LOCK_SH | LOCK_NB)) {
            kvt__io_close(p->held_lockfd);
            p->held_lockfd = -1;
        }
        if (p->held_lockfd < 0)
            rc = kvt__fail(KVT_EIO, "store: block %s: the directory's lock cannot be held: not pinned", name);
    }
    if (!rc) {
        uint64_t *v = kvt__kmap_get(&p->count, b->key);
        if ((rc = kvt__kmap_put(&p->count, b->key, v ? *v + 1 : 1)) == 0) {
            p->total++;
        } else if (p->total == 0) {
            kvt__io_close(p->held_lockfd);
            p->held_lockfd = -1;
        }
    }
    pthread_mutex_unlock(&p->mu);
    if (lfd >= 0)
        kvt__io_close(lfd); /* releases the shared budget lock */
    return rc;
}

static void bo_unpin(kvt__origin *o)
{
    block_origin *b = (block_origin *)o;
    kvt__store_pins *p = b->pins;
    pthread_mutex_lock(&p->mu);
    uint64_t *v = kvt__kmap_get(&p->count, b->key);
    if (v) {
        if (*v > 1)
            (*v)--;
        else
            kvt__kmap_del(&p->count, b->key);
        if (--p->total == 0 && p->held_lockfd >= 0) {
            kvt__io_close(p->held_lockfd);
            p->held_lockfd = -1;
        }
    }
    pthread_mutex_unlock(&p->mu);
}

static int bo_read(kvt__origin *o, void *dst, uint64_t at, size_t n)
{
    block_origin *b = (block_origin *)o;
    char name[64];
    kvt__store_file_name('b', b->key, name);
    if (at > b->bytes || n > b->bytes - at)
        return kvt__fail(KVT_EINVAL, "store: block %s holds %llu bytes, %zu asked from byte %llu", name,
                         (unsigned long long)b->bytes, n, (unsigned long long)at);
    int fd = kvt__io_openat(b->pins->dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0)
        return -errno;
    int rc = 0;
    for (size_t got = 0; got < n;) {
        ssize_t r = kvt__io_pread(fd, (char *)dst + got, n - got, (off_t)(b->off + at + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            rc = r < 0 ? -errno : KVT_EIO;
            break;
        }
        got += (size_t)r;
    }
    kvt__io_close(fd);
    return rc;
}

static void bo_free(kvt__origin *o)
{
    block_origin *b = (block_origin *)o;
    pins_release(b->pins);
    kvt__free(b);
}

static const kvt__origin_ops block_origin_ops = {bo_pin, bo_unpin, bo_read, bo_free};

/* Gives buf the origin (block key, bytes at off) in table pins. No memory:
 * no origin (a live cache then writes the block to its page file). */
static void give_origin(kvt_buf *buf, kvt__store_pins *pins, kvt__key key, uint64_t off, uint64_t bytes)
{
    block_origin *o = kvt__calloc(1, sizeof *o);
    if (!o)
        return;
    o->base.ops = &block_origin_ops;
    atomic_init(&o->base.refs, 1);
    pins_retain(pins);
    o->pins = pins;
    o->key = key;
    o->off = off;
    o->bytes = bytes;
    kvt__buf_set_origin(buf, &o->base);
}

/* The tagging pass of a restore. */
typedef struct tag_ctx {
    kvt__store_pins *pins;
    const kvt__rshard *blk;
    const kvt__key *keys;
    int32_t n_blocks;
} tag_ctx;

static void tag_buf(kvt_buf *buf, void *vc)
{
    tag_ctx *c = vc;
    const char *d = kvt_buf_data(buf);
    size_t n = kvt_buf_bytes(buf);
    if (kvt__buf_origin(buf) || !d || !n)
        return;
    for (int32_t i = 0; i < c->n_blocks; i++) {
        const char *base = c->blk[i].buf ? kvt_buf_data(c->blk[i].buf) : NULL;
        uint64_t pn = c->blk[i].sh.payload_bytes;
        if (!base || d < base || d + n > base + pn)
            continue;
        give_origin(buf, c->pins, c->keys[i], c->blk[i].sh.payload_off + (uint64_t)(d - base), n);
        return;
    }
}

void kvt__store_tag_blocks(kvt__store_pins *pins, kvt_entry *e, const kvt__rshard *blk, const kvt__key *keys,
                           int32_t n_blocks)
{
    if (!pins || !e || n_blocks <= 0)
        return;
    tag_ctx c = {pins, blk, keys, n_blocks};
    for (int32_t l = 0; l < e->n_caches; l++) {
        kvt_cache *cc = e->caches[l];
        if (cc && !strcmp(kvt_cache_kind(cc), "kv") && cc->ops->foreach_buf)
            cc->ops->foreach_buf(cc, tag_buf, &c);
    }
}

void kvt__store_pins_add_refs(kvt__store_pins *p, void (*fn)(kvt__key k, uint64_t n, void *ctx), void *ctx)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    kvt__kmap_foreach(&p->count, fn, ctx);
    pthread_mutex_unlock(&p->mu);
}

/* The tensor of enc a shard names "L<layer>.<name>", NULL when none. */
static const kvt_tensor *enc_tensor(const kvt__enc *enc, const char *shard_name)
{
    char *end = NULL;
    if (shard_name[0] != 'L')
        return NULL;
    long l = strtol(shard_name + 1, &end, 10);
    if (!end || *end != '.' || l < 0 || l >= enc->e->n_caches)
        return NULL;
    for (int32_t t = 0; t < enc->st[l].n_tensors; t++)
        if (!strcmp(enc->st[l].tensors[t].name, end + 1))
            return &enc->st[l].tensors[t];
    return NULL;
}

/* Whether the payload of block shard sh holds exactly the bytes of enc's
 * tensors of the same names: each of its tensors one of enc's, of the same
 * size, laid end to end, and the XXH3-128 of enc's bytes in that order the
 * one the header holds (a version 1 shard, SHA-256 only: no). */
static int same_payload(const kvt__enc *enc, const kvt__shard *sh)
{
    if (!sh->has_xxh)
        return 0;
    XXH3_state_t *xx = XXH3_createState();
    if (!xx || XXH3_128bits_reset(xx) != XXH_OK) {
        XXH3_freeState(xx);
        return 0;
    }
    uint64_t at = 0;
    int ok = 1;
    for (int32_t i = 0; i < sh->n && ok; i++) {
        const kvt_tensor *x = enc_tensor(enc, sh->t[i].name);
        ok = x && sh->t[i].begin == at && sh->t[i].end - sh->t[i].begin == x->bytes &&
             XXH3_128bits_update(xx, x->data, x->bytes) == XXH_OK;
        at = sh->t[i].end;
    }
    if (ok && at == sh->payload_bytes) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(xx));
        ok = !memcmp(c.digest, sh->xxh, 16);
    } else {
        ok = 0;
    }
    XXH3_freeState(xx);
    return ok;
}

/* Gives the full kv block buffers of enc->e whose tensors are in block
 * shard c of the chain the origin of that tensor in the file, read from the
 * shard's header: when the put wrote the shard itself (its bytes are
 * theirs), or (verify) when it was there already and its payload holds
 * exactly their bytes (same_payload: another computation of the same
 * prefix may have stored other bytes under the same key). */
static void tag_block(kvt_store *s, const kvt__enc *enc, int32_t c, int verify)
{
    char name[64];
    kvt__store_file_name('b', enc->keys[c], name);
    kvt__shard sh;
    int fd = -1, reason = -1;
    if (kvt__shard_open(s->dirfd, s->dir, name, &sh, &fd, &reason)) {
        kvt__clear_error(); /* untagged: a live cache writes the block to its page file */
        return;
    }
    kvt__io_close(fd);
    if (verify && !same_payload(enc, &sh)) {
        kvt__shard_free(&sh); /* untagged: written to the page file */
        return;
    }
    const kvt_entry *e = enc->e;
    for (int32_t l = 0; l < e->n_caches; l++) {
        if (!e->caches[l] || strcmp(kvt_cache_kind(e->caches[l]), "kv"))
            continue;
        for (int32_t t = 0; t < enc->st[l].n_tensors; t++) {
            const kvt_tensor *x = &enc->st[l].tensors[t];
            if (x->tok_begin < 0 || !x->owner || kvt_buf_data(x->owner) != x->data ||
                kvt_buf_bytes(x->owner) != x->bytes || kvt__buf_origin(x->owner))
                continue; /* only a tensor that is a whole block buffer */
            char tn[160];
            snprintf(tn, sizeof tn, "L%d.%s", (int)l, x->name);
            for (int32_t i = 0; i < sh.n; i++) {
                if (strcmp(sh.t[i].name, tn) || sh.t[i].end - sh.t[i].begin != x->bytes)
                    continue;
                give_origin(x->owner, s->pins, enc->keys[c], sh.payload_off + sh.t[i].begin, x->bytes);
                break;
            }
        }
    }
    kvt__shard_free(&sh);
}

void kvt__store_tag_written(kvt_store *s, const kvt__enc *enc, const int8_t *written)
{
    if (!s->pins || s->opts.read_only)
        return;
    for (int32_t c = 0; c < enc->n_chain; c++)
        tag_block(s, enc, c, !written[c]);
}
