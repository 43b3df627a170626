/*
 * budget.c: the SSD tier's byte budget over a whole root shared by several
 * processes and identities (reclaim), the offline collector kvt_store_gc,
 * and the shared lock a put holds while it relies on existing blocks.
 * It decides from the files on disk (every entry file's header), never from
 * one process's index alone, and never deletes a block an entry file on
 * disk still references, or a file in a directory another live store holds.
 */
#include "codec.h"
#include "hmap.h"
#include "internal.h"
#include "io_shim.h"
#include "store_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- foreign directories and the budget ----------------------------------------------- */

typedef struct fcand {
    int dir;              /* index into the dir list */
    char name[256];
    uint64_t bytes;
    int64_t mtime_ms;
    int orphan;           /* temp / refused / unreferenced / broken: goes first */
    int broken;           /* entries: a referenced block is not on disk */
    kvt__key *blocks;    /* entries: referenced blocks */
    int32_t n_blocks;
    kvt__key key;
    char type;
} fcand;

typedef struct fdirs {
    char **paths;
    int *dirfds, *lockfds;
    int n;
    fcand *c;
    size_t n_c, cap_c;
    uint64_t bytes;       /* of all listed dirs (idle or not) */
    int unlink_errno;     /* first error that kept files from being removed: an
                             unlink (ENOENT, removed meanwhile, excepted) or a
                             directory whose .lock cannot be opened */
} fdirs;

static void fdirs_free(fdirs *f)
{
    for (int i = 0; i < f->n; i++) {
        kvt__free(f->paths[i]);
        if (f->lockfds[i] >= 0)
            kvt__io_close(f->lockfds[i]); /* releases the flock */
        if (f->dirfds[i] >= 0)
            kvt__io_close(f->dirfds[i]);
    }
    for (size_t i = 0; i < f->n_c; i++)
        kvt__free(f->c[i].blocks);
    kvt__free(f->paths);
    kvt__free(f->dirfds);
    kvt__free(f->lockfds);
    kvt__free(f->c);
    memset(f, 0, sizeof *f);
}

static fcand *fc_push(fdirs *f)
{
    if (f->n_c == f->cap_c) {
        size_t c = f->cap_c ? f->cap_c * 2 : 64;
        fcand *n = kvt__realloc(f->c, sizeof *n * c);
        if (!n)
            return NULL;
        f->c = n;
        f->cap_c = c;
    }
    fcand *x = &f->c[f->n_c++];
    memset(x, 0, sizeof *x);
    return x;
}

typedef struct foreign_ctx {
    fdirs *f;
    int collect;
    int cap;
    int i;        /* the directory being listed */
    int idle;     /* nobody holds it: its files are candidates */
    const char *path;
    int dirfd;
} foreign_ctx;

/* Reads a candidate's header: a valid shard is not an orphan; an entry
 * keeps its block references. */
static void fc_read(foreign_ctx *c, fcand *x)
{
    kvt__shard sh;
    int fd = -1, reason;
    if (kvt__shard_open(c->dirfd, c->path, x->name, &sh, &fd, &reason))
        return;
    if (x->type == 'e') {
        kvt__pentry pe;
        if (!kvt__codec_parse_entry(&sh, x->name, NULL, &pe, &reason)) {
            x->orphan = 0;
            x->blocks = pe.blocks;
            x->n_blocks = pe.n_blocks;
            pe.blocks = NULL;
            kvt__pentry_free(&pe);
        }
    } else {
        kvt__pblock pb;
        if (!kvt__codec_parse_block(&sh, x->name, NULL, &pb, &reason)) {
            x->orphan = 0;
            x->key = pb.key;
            kvt__pblock_free(&pb);
        }
    }
    kvt__io_close(fd);
    kvt__shard_free(&sh);
}

static int foreign_file(void *ctx, const char *nm, const struct stat *fs)
{
    foreign_ctx *c = ctx;
    fdirs *f = c->f;
    if (kvt__store_is_meta_file(nm) || !S_ISREG(fs->st_mode))
        return 0;
    f->bytes += (uint64_t)fs->st_size;
    if (!c->idle)
        return 0;
    fcand *x = fc_push(f);
    if (!x)
        return 1; /* out of memory: the rest of this directory is not listed */
    x->dir = c->i;
    snprintf(x->name, sizeof x->name, "%s", nm);
    x->bytes = (uint64_t)fs->st_size;
    x->mtime_ms = (int64_t)fs->st_mtim.tv_sec * 1000 + fs->st_mtim.tv_nsec / 1000000;
    x->type = nm[0];
    x->orphan = 1;
    if (kvt__store_is_tmp_name(nm))
        return 0;
    if (!kvt__store_is_shard_name(nm)) {
        x->name[0] = '\0'; /* not ours: counted, never deleted */
        return 0;
    }
    fc_read(c, x);
    return 0;
}

/* Room for one more directory. @return 0 or KVT_ENOMEM. */
static int fdirs_grow(fdirs *f, int *cap)
{
    if (f->n < *cap)
        return 0;
    int c = *cap ? *cap * 2 : 8;
    char **p = kvt__realloc(f->paths, sizeof *p * (size_t)c);
    if (p)
        f->paths = p;
    int *a = kvt__realloc(f->dirfds, sizeof *a * (size_t)c);
    if (a)
        f->dirfds = a;
    int *b = kvt__realloc(f->lockfds, sizeof *b * (size_t)c);
    if (b)
        f->lockfds = b;
    if (!p || !a || !b)
        return KVT_ENOMEM;
    *cap = c;
    return 0;
}

static int foreign_dir(void *ctx, const kvt__id_dir *d)
{
    foreign_ctx *c = ctx;
    fdirs *f = c->f;
    if (d->dirfd < 0 || faccessat(d->dirfd, "IDENTITY", F_OK, AT_SYMLINK_NOFOLLOW))
        return 0; /* a link, or not a store directory: never touched */
    int dfd = dup(d->dirfd);
    if (dfd < 0)
        return 0;
    if (fdirs_grow(f, &c->cap)) {
        kvt__io_close(dfd);
        return KVT_ENOMEM;
    }
    int i = f->n++;
    f->paths[i] = kvt__strdup(d->path);
    f->dirfds[i] = dfd;
    f->lockfds[i] = -1;
    int lfd = kvt__io_openat(dfd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (c->collect && lfd < 0 && !f->unlink_errno)
        f->unlink_errno = errno; /* cannot lock, so cannot clean: not "held" */
    int idle = c->collect && lfd >= 0 && flock(lfd, LOCK_EX | LOCK_NB) == 0;
    if (idle)
        f->lockfds[i] = lfd;
    else if (lfd >= 0)
        kvt__io_close(lfd);
    size_t first_c = f->n_c;
    *c = (foreign_ctx){f, c->collect, c->cap, i, idle, d->path, dfd};
    kvt__dir_walk(dfd, foreign_file, c);
    /* an entry referencing a block that is not on disk is broken: an
     * orphan (goes first; kvt_store_gc always removes it) */
    for (size_t k = first_c; k < f->n_c; k++) {
        fcand *x = &f->c[k];
        for (int32_t j = 0; x->type == 'e' && x->name[0] && !x->orphan && j < x->n_blocks; j++) {
            char bn[64];
            struct stat bst;
            kvt__store_file_name('b', x->blocks[j], bn);
            if (fstatat(dfd, bn, &bst, AT_SYMLINK_NOFOLLOW))
                x->orphan = x->broken = 1;
        }
    }
    return 0;
}

/* Lists the identity directories under root except `skip` (only directories
 * named like one and holding an IDENTITY file; only shard and temp files in
 * them are ever candidates); measures every
 * file; for directories nobody holds (flock LOCK_EX succeeds; the lock is kept
 * until fdirs_free) collects eviction candidates with their block references. */
static int list_foreign(const char *root, const char *skip, int collect, fdirs *f)
{
    memset(f, 0, sizeof *f);
    foreign_ctx c = {.f = f, .collect = collect};
    int rc = kvt__root_walk(root, skip, foreign_dir, &c);
    if (rc == KVT_ENOMEM)
        fdirs_free(f);
    kvt__clear_error();
    return rc;
}

static int64_t fc_block_refs(const fdirs *f, int dir, kvt__key k)
{
    int64_t n = 0;
    for (size_t i = 0; i < f->n_c; i++)
        if (f->c[i].dir == dir && f->c[i].type == 'e' && f->c[i].name[0] && !f->c[i].broken)
            for (int32_t j = 0; j < f->c[i].n_blocks; j++)
                n += kvt__key_eq(f->c[i].blocks[j], k);
    return n;
}

/* Deletes candidate i (and, for an entry, the blocks nobody else references). */
static uint64_t fc_evict(fdirs *f, size_t i)
{
    fcand *x = &f->c[i];
    if (!x->name[0])
        return 0;
    uint64_t freed = 0;
    if (!kvt__io_unlinkat(f->dirfds[x->dir], x->name, 0))
        freed += x->bytes;
    else if (errno != ENOENT && !f->unlink_errno)
        f->unlink_errno = errno;
    x->name[0] = '\0';
    if (x->type != 'e')
        return freed;
    for (int32_t j = 0; j < x->n_blocks; j++) {
        if (fc_block_refs(f, x->dir, x->blocks[j]))
            continue;
        for (size_t b = 0; b < f->n_c; b++)
            if (f->c[b].dir == x->dir && f->c[b].type == 'b' && f->c[b].name[0] && !f->c[b].orphan &&
                kvt__key_eq(f->c[b].key, x->blocks[j])) {
                if (!kvt__io_unlinkat(f->dirfds[x->dir], f->c[b].name, 0))
                    freed += f->c[b].bytes;
                else if (errno != ENOENT && !f->unlink_errno)
                    f->unlink_errno = errno;
                f->c[b].name[0] = '\0';
            }
    }
    return freed;
}

/* Marks unreferenced blocks of idle directories as orphans. */
static void fc_mark_orphans(fdirs *f)
{
    for (size_t i = 0; i < f->n_c; i++)
        if (f->c[i].type == 'b' && !f->c[i].orphan && !fc_block_refs(f, f->c[i].dir, f->c[i].key))
            f->c[i].orphan = 1;
}

/* Oldest remaining candidate: orphans first, then entries by time. */
static ssize_t fc_oldest(const fdirs *f)
{
    ssize_t best = -1;
    for (size_t i = 0; i < f->n_c; i++) {
        const fcand *x = &f->c[i];
        if (!x->name[0] || (!x->orphan && x->type != 'e'))
            continue;
        if (best < 0 || x->orphan > f->c[best].orphan ||
            (x->orphan == f->c[best].orphan && x->mtime_ms < f->c[best].mtime_ms))
            best = (ssize_t)i;
    }
    return best;
}

/* ---- the budget over a shared root ------------------------------------------------------
 *
 * Several processes may hold one identity directory open. Block files are
 * shared by entries of every process, so a block is deleted only by
 * kvt__store_reclaim(), which holds an exclusive flock on <dir>/.budget.lock and
 * decides from the directory as it is on disk (every entry file's header),
 * not from this process's index: a block goes only when no entry file on
 * disk references it, and an entry file goes before (or with) the blocks
 * that only it uses. Every put holds a shared flock on the same file from
 * the moment it relies on an existing block until its entry file is renamed,
 * so reclaim never sees a put half done; a put also re-checks on disk the
 * blocks (and the entry) its index says exist. */


/* An entry file as reclaim parsed it (cached by key: entry files are
 * immutable under their names). */
typedef struct dent {
    kvt__key *blocks;
    int32_t n_blocks;
    int valid; /* header and metadata good */
} dent;

typedef struct rfile {
    char name[128];
    char type;      /* 'e', 'b', 't' (dead writer's temp file) */
    uint64_t bytes;
    int64_t mtime_ms;
    int orphan;     /* refused, unreferenced or broken: goes first */
    int broken;     /* entries: a referenced block is not on disk */
    int gone;       /* deleted by this pass */
    int64_t refs;   /* blocks: valid entry files referencing it */
    kvt__key key;
    const dent *d;  /* entries */
} rfile;

static void dent_free(dent *d)
{
    if (d) {
        kvt__free(d->blocks);
        kvt__free(d);
    }
}

static const dent *dent_get(kvt_store *s, const char *name, kvt__key key)
{
    dent *d = kvt__kmap_ptr(&s->disk, key);
    if (d)
        return d;
    d = kvt__calloc(1, sizeof *d);
    if (!d)
        return NULL;
    kvt__shard sh;
    int fd = -1, reason = -1;
    if (!kvt__shard_open(s->dirfd, s->dir, name, &sh, &fd, &reason)) {
        kvt__pentry pe;
        if (!kvt__codec_parse_entry(&sh, name, s->identity, &pe, &reason) && kvt__key_eq(pe.key, key)) {
            d->valid = 1;
            d->blocks = pe.blocks;
            d->n_blocks = pe.n_blocks;
            pe.blocks = NULL;
            kvt__pentry_free(&pe);
        }
        kvt__io_close(fd);
        kvt__shard_free(&sh);
    } else if (reason == KVT_STORE_REFUSED_IO) {
        kvt__free(d); /* gone or unreadable now: not cached */
        kvt__clear_error();
        return NULL;
    }
    kvt__clear_error();
    if (kvt__kmap_put_ptr(&s->disk, key, d)) {
        dent_free(d);
        return NULL;
    }
    return d;
}

static int is_orphan_name(kvt_store *s, const char *name)
{
    for (int32_t i = 0; i < s->n_orphans; i++)
        if (!strcmp(s->orphans[i].name, name))
            return 1;
    return 0;
}

static rfile *rf_block(kvt__kmap *bm, kvt__key k) { return kvt__kmap_ptr(bm, k); }

/* Deletes file f of the own directory; an entry takes its blocks' references
 * with it and the blocks nobody else references go too. */
static uint64_t rf_delete(kvt_store *s, rfile *f, kvt__kmap *bm)
{
    if (f->gone)
        return 0;
    uint64_t freed = 0;
    if (!kvt__io_unlinkat(s->dirfd, f->name, 0) || errno == ENOENT)
        freed = f->bytes;
    f->gone = 1;
    if (f->type != 'e' || !f->d || !f->d->valid || f->orphan)
        return freed;
    for (int32_t i = 0; i < f->d->n_blocks; i++) {
        rfile *b = rf_block(bm, f->d->blocks[i]);
        if (b && !b->gone && --b->refs <= 0)
            freed += rf_delete(s, b, bm);
    }
    return freed;
}

static int64_t own_last_use(kvt_store *s, kvt__key k, int64_t mtime)
{
    st_entry *e = kvt__kmap_ptr(&s->by_key, k);
    return e && e->last_use_ms > mtime ? e->last_use_ms : mtime;
}

/* One reclaim pass: the own directory as it is on disk, and what the
 * pass deletes. */
typedef struct rpass {
    kvt_store *s;
    rfile *fs;              /* (n) shard and dead temp files of the own directory */
    size_t n, cap;
    kvt__kmap bm;           /* block key -> rfile */
    uint64_t own;           /* bytes of the own directory (every regular file) */
    uint64_t foreign;       /* bytes of the other identity directories */
    uint64_t foreign_ms;    /* when those were last listed */
    uint64_t now, max;
    kvt__key protect;
    int wait;
    uint64_t evicted, evicted_foreign, demoted;
    fdirs f;                /* idle foreign directories, when listed */
    int have_f;
} rpass;

/* Deletes own file x (an entry with the blocks only it uses). */
static void rp_delete(rpass *rp, rfile *x)
{
    uint64_t freed = rf_delete(rp->s, x, &rp->bm);
    rp->own -= KVT__MIN(rp->own, freed);
}

/* Hands entry file x, about to be evicted by the budget, to the eviction
 * hook when one is set: loaded whole and checked as a restore would (call
 * without mu; the files are still there). The hook owns it on 0. */
static void rp_demote(rpass *rp, const rfile *x)
{
    kvt_store *s = rp->s;
    pthread_mutex_lock(&s->evict_mu);
    int hooked = s->evict_fn != NULL;
    pthread_mutex_unlock(&s->evict_mu);
    if (!hooked)
        return;
    kvt_entry e;
    int reason = -1;
    char bad_shard[64];
    uint64_t nb = 0;
    int rc = kvt__store_load_entry(s->dirfd, s->dir, x->name, s->identity, NULL, -1, s->opts.verify, &e, &reason,
                                   bad_shard, &nb);
    kvt__clear_error();
    if (rc)
        return; /* cannot be handed over whole: deleted as without a hook */
    pthread_mutex_lock(&s->evict_mu);
    int taken = s->evict_fn && s->evict_fn(s->evict_arg, &e) == 0;
    pthread_mutex_unlock(&s->evict_mu);
    if (taken)
        rp->demoted++;
    else
        kvt_entry_clear(&e);
}

/* Evicts own entry x under the budget: demoted if the hook takes it, then deleted. */
static void rp_evict(rpass *rp, rfile *x)
{
    rp_demote(rp, x);
    rp_delete(rp, x);
}

static int list_own(void *ctx, const char *nm, const struct stat *st)
{
    rpass *rp = ctx;
    if (kvt__store_is_meta_file(nm) || !S_ISREG(st->st_mode))
        return 0;
    rp->own += (uint64_t)st->st_size;
    int tmp = kvt__store_is_tmp_name(nm);
    if (!(tmp ? !kvt__store_pid_alive(nm) : kvt__store_is_shard_name(nm)))
        return 0; /* live writers' temp files, strangers */
    if (strlen(nm) >= sizeof rp->fs[0].name)
        return 0;
    if (rp->n == rp->cap) {
        size_t c = rp->cap ? rp->cap * 2 : 64;
        rfile *x = kvt__realloc(rp->fs, sizeof *x * c);
        if (!x)
            return 1; /* out of memory: the pass works on what it listed */
        rp->fs = x;
        rp->cap = c;
    }
    rfile *f = &rp->fs[rp->n++];
    memset(f, 0, sizeof *f);
    memcpy(f->name, nm, strlen(nm) + 1); /* checked: shorter than name */
    f->type = tmp ? 't' : nm[0];
    f->bytes = (uint64_t)st->st_size;
    f->mtime_ms = (int64_t)st->st_mtim.tv_sec * 1000 + st->st_mtim.tv_nsec / 1000000;
    f->orphan = tmp;
    if (!tmp) {
        char hex[33];
        memcpy(hex, nm + 1, 32);
        hex[32] = '\0';
        kvt__key_parse(hex, &f->key);
    }
    return 0;
}

/* Step 1: the own directory as it is on disk; every entry file's header
 * (cached by key; header I/O without mu). */
static void reclaim_list(rpass *rp)
{
    kvt_store *s = rp->s;
    kvt__dir_walk(s->dirfd, list_own, rp);
    for (size_t i = 0; i < rp->n; i++)
        if (rp->fs[i].type == 'b')
            kvt__kmap_put_ptr(&rp->bm, rp->fs[i].key, &rp->fs[i]);
    for (size_t i = 0; i < rp->n; i++)
        if (rp->fs[i].type == 'e')
            rp->fs[i].d = dent_get(s, rp->fs[i].name, rp->fs[i].key);
}

static void pin_ref(kvt__key k, uint64_t n, void *ctx)
{
    rfile *b = rf_block(ctx, k);
    if (b && n > 0)
        b->refs++;
}

/* Step 1b: orphans (refused, unreadable) and broken entries (a block is
 * gone) are marked; entries get this process's last use; every valid
 * entry file counts as a reference on its blocks. */
static void reclaim_mark(rpass *rp)
{
    kvt_store *s = rp->s;
    pthread_mutex_lock(&s->mu);
    rp->foreign = s->foreign_bytes;
    rp->foreign_ms = s->foreign_scan_ms;
    for (size_t i = 0; i < rp->n; i++) {
        rfile *f = &rp->fs[i];
        if (f->type == 'b' && is_orphan_name(s, f->name))
            f->orphan = 1;
        if (f->type != 'e')
            continue;
        f->orphan = !f->d || !f->d->valid || is_orphan_name(s, f->name);
        for (int32_t k = 0; f->d && f->d->valid && !f->broken && k < f->d->n_blocks; k++)
            if (!rf_block(&rp->bm, f->d->blocks[k]))
                f->orphan = f->broken = 1; /* a block is gone: broken, goes first */
        if (!f->orphan)
            f->mtime_ms = own_last_use(s, f->key, f->mtime_ms);
    }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < rp->n; i++)
        if (rp->fs[i].type == 'e' && !rp->fs[i].orphan)
            for (int32_t k = 0; k < rp->fs[i].d->n_blocks; k++)
                rf_block(&rp->bm, rp->fs[i].d->blocks[k])->refs++;
    /* a block a live cache pinned is referenced too: never deleted while pinned */
    kvt__store_pins_add_refs(s->pins, pin_ref, &rp->bm);
}

/* Step 2: blocks this process let go of that no entry file references. */
static void reclaim_released(rpass *rp)
{
    kvt_store *s = rp->s;
    pthread_mutex_lock(&s->mu);
    kvt__key *fr = s->free_keys;
    int32_t nfr = s->n_free;
    s->free_keys = NULL;
    s->n_free = s->cap_free = 0;
    s->reclaim_due = 0;
    pthread_mutex_unlock(&s->mu);
    for (int32_t i = 0; i < nfr; i++) {
        rfile *b = rf_block(&rp->bm, fr[i]);
        if (b && !b->gone && b->refs == 0)
            rp_delete(rp, b);
    }
    kvt__free(fr);
}

/* Step 2b: entry files referencing a block that is gone are garbage, budget
 * or not (nothing can serve them). The block is looked up again first: a
 * put without the shared lock renames its blocks before its entry, so one
 * seen by readdir before its blocks is not broken. */
static void reclaim_broken(rpass *rp)
{
    for (size_t i = 0; i < rp->n; i++) {
        rfile *x = &rp->fs[i];
        if (x->type != 'e' || !x->broken || x->gone)
            continue;
        int missing = 0;
        for (int32_t k = 0; !missing && k < x->d->n_blocks; k++) {
            char bn[64];
            struct stat bst;
            kvt__store_file_name('b', x->d->blocks[k], bn);
            missing = fstatat(rp->s->dirfd, bn, &bst, AT_SYMLINK_NOFOLLOW) != 0;
        }
        if (missing)
            rp_delete(rp, x);
    }
}

/* Step 3a: an entry that with all its blocks exceeds the whole budget can
 * never be kept: it goes first (with the blocks only it uses), before
 * anything that fits is evicted to make room for it. */
static void reclaim_too_big(rpass *rp)
{
    for (size_t i = 0; i < rp->n; i++) {
        rfile *x = &rp->fs[i];
        if (x->type != 'e' || x->orphan || x->gone)
            continue;
        uint64_t need = x->bytes;
        for (int32_t k = 0; k < x->d->n_blocks; k++) {
            rfile *b = rf_block(&rp->bm, x->d->blocks[k]);
            if (b && !b->gone)
                need += b->bytes;
        }
        if (need > rp->max) {
            rp->evicted++;
            rp_evict(rp, x);
        }
    }
}

/* The own file evicted next: orphans and unreferenced blocks first, then
 * the least recently used entry (never `protect`); -1 when none. */
static ssize_t own_oldest(const rpass *rp)
{
    ssize_t best = -1;
    for (size_t i = 0; i < rp->n; i++) {
        const rfile *x = &rp->fs[i];
        /* a block goes only when no valid entry file references it */
        int cand = !x->gone && (x->type == 'b' ? x->refs == 0 : 1) &&
                   !(x->type == 'e' && !x->orphan && kvt__key_eq(x->key, rp->protect));
        int xo = x->orphan || x->type != 'e';
        if (!cand)
            continue;
        if (best < 0) {
            best = (ssize_t)i;
            continue;
        }
        const rfile *b = &rp->fs[best];
        int bo = b->orphan || b->type != 'e';
        if (xo > bo || (xo == bo && x->mtime_ms < b->mtime_ms))
            best = (ssize_t)i;
    }
    return best;
}

/* Step 3b: the budget: broken and unreferenced files first, then the least
 * recently used entries here and in idle foreign directories. */
static void reclaim_budget(rpass *rp)
{
    if (rp->foreign || rp->now - rp->foreign_ms >= 1000 || rp->wait) {
        rp->have_f = list_foreign(rp->s->root, rp->s->dir_name, 1, &rp->f) == 0;
        rp->foreign_ms = rp->now;
    }
    if (rp->have_f) {
        rp->foreign = rp->f.bytes;
        fc_mark_orphans(&rp->f);
    }
    while (rp->own + rp->foreign > rp->max) {
        ssize_t best = own_oldest(rp);
        ssize_t fi = rp->have_f ? fc_oldest(&rp->f) : -1;
        if (best < 0 && fi < 0)
            break;
        rfile *x = best >= 0 ? &rp->fs[best] : NULL;
        int own_orphan = x && (x->orphan || x->type != 'e');
        if (fi >= 0 && (!x || (!own_orphan && (rp->f.c[fi].orphan || rp->f.c[fi].mtime_ms <= x->mtime_ms)))) {
            uint64_t freed = fc_evict(&rp->f, (size_t)fi);
            rp->foreign -= KVT__MIN(rp->foreign, freed);
            rp->evicted_foreign++;
        } else if (own_orphan) {
            rp_delete(rp, x);
        } else {
            rp->evicted++;
            rp_evict(rp, x);
        }
    }
}

/* Step 4: the index follows the disk: what was deleted leaves it. */
static void reclaim_apply(rpass *rp)
{
    kvt_store *s = rp->s;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < rp->n; i++) {
        rfile *x = &rp->fs[i];
        if (!x->gone)
            continue;
        if (x->type == 'e') {
            st_entry *e = kvt__kmap_ptr(&s->by_key, x->key);
            if (e)
                kvt__store_drop_entry(s, e, 2);
            dent_free(kvt__kmap_ptr(&s->disk, x->key));
            kvt__kmap_del(&s->disk, x->key);
        } else if (x->type == 'b') {
            st_block *b = kvt__kmap_ptr(&s->blocks, x->key);
            if (b) {
                for (st_entry *e = s->head, *nx; e; e = nx) {
                    nx = e->next;
                    for (int32_t k = 0; k < e->n_blocks; k++)
                        if (kvt__key_eq(e->blocks[k], x->key)) {
                            kvt__store_drop_entry(s, e, 2);
                            break;
                        }
                }
                if ((b = kvt__kmap_ptr(&s->blocks, x->key))) {
                    s->st.blocks--;
                    kvt__kmap_del(&s->blocks, x->key);
                    kvt__store_block_forget(s, b);
                }
            }
        }
        for (int32_t k = 0; k < s->n_orphans; k++)
            if (!strcmp(s->orphans[k].name, x->name)) {
                s->orphans[k] = s->orphans[--s->n_orphans];
                break;
            }
    }
    s->own_bytes = rp->own;
    s->foreign_bytes = rp->foreign;
    s->foreign_scan_ms = rp->foreign_ms;
    s->disk_ms = rp->now;
    s->st.evicted += rp->evicted;
    s->st.evicted_foreign_files += rp->evicted_foreign;
    s->demoted += rp->demoted;
    pthread_mutex_unlock(&s->mu);
}

/* Frees unreferenced blocks this process let go of, and applies the budget
 * over the whole root, from the directory's state on disk (see above).
 * wait: block until the lock is free (close); else try once and leave it
 * due for the next call. Call without mu. */
void kvt__store_reclaim(kvt_store *s, kvt__key protect, int wait)
{
    if (s->opts.read_only || s->dirfd < 0)
        return;
    rpass rp = {.s = s, .protect = protect, .wait = wait, .max = s->opts.max_bytes, .now = kvt_now_ms()};
    pthread_mutex_lock(&s->mu);
    int due = s->n_free > 0 || s->reclaim_due ||
              (rp.max && (s->own_bytes + s->foreign_bytes > rp.max || rp.now - s->disk_ms >= 1000));
    pthread_mutex_unlock(&s->mu);
    if (!due && !(wait && rp.max))
        return;
    int lfd = kvt__io_openat(s->dirfd, KVT__BUDGET_LOCK, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lfd < 0)
        return;
    if (flock(lfd, LOCK_EX | (wait ? 0 : LOCK_NB))) {
        kvt__io_close(lfd);
        pthread_mutex_lock(&s->mu);
        s->reclaim_due = 1;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    pthread_mutex_lock(&s->disk_mu);
    reclaim_list(&rp);
    reclaim_mark(&rp);
    reclaim_released(&rp);
    reclaim_broken(&rp);
    if (rp.max) {
        reclaim_too_big(&rp);
        reclaim_budget(&rp);
    }
    if (rp.have_f)
        fdirs_free(&rp.f);
    reclaim_apply(&rp);
    kvt__kmap_free(&rp.bm);
    kvt__free(rp.fs);
    pthread_mutex_unlock(&s->disk_mu);
    kvt__io_close(lfd); /* releases the lock */
}

/* Takes the shared lock a put holds while it relies on existing blocks;
 * -1 when the lock file cannot be opened (the put goes on unprotected). */
int kvt__store_put_lock(kvt_store *s)
{
    int fd = kvt__io_openat(s->dirfd, KVT__BUDGET_LOCK, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0 && flock(fd, LOCK_SH)) {
        kvt__io_close(fd);
        fd = -1;
    }
    return fd;
}

int kvt__store_foreign_bytes(const char *root, const char *skip, uint64_t *bytes)
{
    fdirs f;
    int rc = list_foreign(root, skip, 0, &f);
    if (!rc) {
        *bytes = f.bytes;
        fdirs_free(&f);
    }
    return rc;
}

static void free_dent_val(kvt__key k, uint64_t v, void *ctx) { dent_free((void *)(uintptr_t)v); }

void kvt__store_disk_free(kvt_store *s)
{
    kvt__kmap_foreach(&s->disk, free_dent_val, NULL);
    kvt__kmap_free(&s->disk);
}

/* ---- offline collection ----------------------------------------------------------- */

KVT_API int kvt_store_gc(const char *root, uint64_t max_bytes, uint64_t *freed)
{
    if (freed)
        *freed = 0;
    if (!root)
        return kvt__fail(KVT_EINVAL, "kvt_store_gc: root is NULL");
    fdirs f;
    int rc = list_foreign(root, NULL, 1, &f);
    if (rc)
        return kvt__fail(rc, "%s: cannot list: %s", root, kvt_strerror(rc));
    fc_mark_orphans(&f);
    uint64_t total = f.bytes, done = 0;
    /* temp files of dead writers and broken entries (a block is gone)
     * always go */
    for (size_t i = 0; i < f.n_c; i++)
        if ((!strncmp(f.c[i].name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX)) && !kvt__store_pid_alive(f.c[i].name)) ||
            (f.c[i].type == 'e' && f.c[i].broken)) {
            uint64_t b = fc_evict(&f, i);
            done += b;
            total -= KVT__MIN(total, b);
        }
    while (total > max_bytes) {
        ssize_t i = fc_oldest(&f);
        if (i < 0)
            break;
        if (!strncmp(f.c[i].name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX))) {
            f.c[i].name[0] = '\0'; /* a live writer's temp file */
            continue;
        }
        uint64_t b = fc_evict(&f, (size_t)i);
        done += b;
        total -= KVT__MIN(total, b);
    }
    int err = total > max_bytes ? f.unlink_errno : 0;
    fdirs_free(&f);
    if (freed)
        *freed = done;
    if (err)
        return kvt__fail(-err, "%s: still %llu bytes over the budget of %llu: cannot remove a shard: %s",
                         root, (unsigned long long)(total - max_bytes), (unsigned long long)max_bytes,
                         strerror(err));
    return 0;
}
