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

/* Lists the identity directories under root except `skip` (only directories
 * named like one and holding an IDENTITY file; only shard and temp files in
 * them are ever candidates); measures every
 * file; for directories nobody holds (flock LOCK_EX succeeds; the lock is kept
 * until fdirs_free) collects eviction candidates with their block references. */
static int list_foreign(const char *root, const char *skip, int collect, fdirs *f)
{
    memset(f, 0, sizeof *f);
    DIR *d = opendir(root);
    if (!d)
        return -errno;
    struct dirent *de;
    int cap = 0;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || (skip && !strcmp(de->d_name, skip)))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", root, de->d_name);
        struct stat st;
        if (!kvt__store_is_identity_dir(de->d_name) || lstat(path, &st) || !S_ISDIR(st.st_mode))
            continue;
        int dfd = kvt__io_open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (dfd < 0)
            continue;
        if (faccessat(dfd, "IDENTITY", F_OK, AT_SYMLINK_NOFOLLOW)) {
            kvt__io_close(dfd); /* not a store directory: never touched */
            continue;
        }
        if (f->n == cap) {
            cap = cap ? cap * 2 : 8;
            char **p = kvt__realloc(f->paths, sizeof *p * (size_t)cap);
            if (p)
                f->paths = p;
            int *a = kvt__realloc(f->dirfds, sizeof *a * (size_t)cap);
            if (a)
                f->dirfds = a;
            int *b = kvt__realloc(f->lockfds, sizeof *b * (size_t)cap);
            if (b)
                f->lockfds = b;
            if (!p || !a || !b) {
                kvt__io_close(dfd);
                closedir(d);
                fdirs_free(f);
                return KVT_ENOMEM;
            }
        }
        int i = f->n++;
        f->paths[i] = kvt__strdup(path);
        f->dirfds[i] = dfd;
        f->lockfds[i] = -1;
        int lfd = kvt__io_openat(dfd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (collect && lfd < 0 && !f->unlink_errno)
            f->unlink_errno = errno; /* cannot lock, so cannot clean: not "held" */
        int idle = collect && lfd >= 0 && flock(lfd, LOCK_EX | LOCK_NB) == 0;
        if (idle)
            f->lockfds[i] = lfd;
        else if (lfd >= 0)
            kvt__io_close(lfd);
        DIR *dd = fdopendir(dup(dfd));
        if (!dd)
            continue;
        size_t first_c = f->n_c;
        struct dirent *fe;
        while ((fe = readdir(dd))) {
            struct stat fs;
            if (!strcmp(fe->d_name, ".") || !strcmp(fe->d_name, "..") || !strcmp(fe->d_name, ".lock") ||
                !strcmp(fe->d_name, "IDENTITY") || !strcmp(fe->d_name, ".budget.lock"))
                continue;
            if (fstatat(dfd, fe->d_name, &fs, AT_SYMLINK_NOFOLLOW) || !S_ISREG(fs.st_mode))
                continue;
            f->bytes += (uint64_t)fs.st_size;
            if (!idle)
                continue;
            fcand *x = fc_push(f);
            if (!x)
                break;
            x->dir = i;
            snprintf(x->name, sizeof x->name, "%s", fe->d_name);
            x->bytes = (uint64_t)fs.st_size;
            x->mtime_ms = (int64_t)fs.st_mtim.tv_sec * 1000 + fs.st_mtim.tv_nsec / 1000000;
            x->type = fe->d_name[0];
            int is_tmp = !strncmp(fe->d_name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX));
            x->orphan = 1;
            if (is_tmp)
                continue;
            if (!kvt__store_is_shard_name(fe->d_name)) {
                x->name[0] = '\0'; /* not ours: counted, never deleted */
                continue;
            }
            kvt__shard sh;
            int fd = -1, reason;
            if (kvt__shard_open(dfd, path, fe->d_name, &sh, &fd, &reason))
                continue;
            if (x->type == 'e') {
                kvt__pentry pe;
                if (!kvt__codec_parse_entry(&sh, fe->d_name, NULL, &pe, &reason)) {
                    x->orphan = 0;
                    x->blocks = pe.blocks;
                    x->n_blocks = pe.n_blocks;
                    pe.blocks = NULL;
                    kvt__pentry_free(&pe);
                }
            } else {
                kvt__pblock pb;
                if (!kvt__codec_parse_block(&sh, fe->d_name, NULL, &pb, &reason)) {
                    x->orphan = 0;
                    x->key = pb.key;
                    kvt__free(pb.tokens);
                }
            }
            kvt__io_close(fd);
            kvt__shard_free(&sh);
        }
        closedir(dd);
        /* an entry referencing a block that is not on disk is broken: an
         * orphan (goes first; kvt_store_gc always removes it) */
        for (size_t c = first_c; c < f->n_c; c++) {
            fcand *x = &f->c[c];
            for (int32_t j = 0; x->type == 'e' && x->name[0] && !x->orphan && j < x->n_blocks; j++) {
                char bn[64];
                struct stat bst;
                kvt__store_file_name('b', x->blocks[j], bn);
                if (fstatat(dfd, bn, &bst, AT_SYMLINK_NOFOLLOW))
                    x->orphan = x->broken = 1;
            }
        }
    }
    closedir(d);
    kvt__clear_error();
    return 0;
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

/* Frees unreferenced blocks this process let go of, and applies the budget
 * over the whole root, from the directory's state on disk (see above).
 * wait: block until the lock is free (close); else try once and leave it
 * due for the next call. Call without mu. */
void kvt__store_reclaim(kvt_store *s, kvt__key protect, int wait)
{
    if (s->opts.read_only || s->dirfd < 0)
        return;
    uint64_t max = s->opts.max_bytes;
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&s->mu);
    int due = s->n_free > 0 || s->reclaim_due ||
              (max && (s->own_bytes + s->foreign_bytes > max || now - s->disk_ms >= 1000));
    pthread_mutex_unlock(&s->mu);
    if (!due && !(wait && max))
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
    /* 1. the own directory as it is on disk */
    rfile *fs = NULL;
    size_t n = 0, cap = 0;
    uint64_t own = 0;
    DIR *d = fdopendir(dup(s->dirfd));
    if (d)
        rewinddir(d); /* the dup shares the offset scan left at the end */
    struct dirent *de;
    while (d && (de = readdir(d))) {
        const char *nm = de->d_name;
        struct stat st;
        if (!strcmp(nm, ".") || !strcmp(nm, "..") || !strcmp(nm, ".lock") || !strcmp(nm, "IDENTITY") ||
            !strcmp(nm, KVT__BUDGET_LOCK) || fstatat(s->dirfd, nm, &st, AT_SYMLINK_NOFOLLOW) ||
            !S_ISREG(st.st_mode))
            continue;
        own += (uint64_t)st.st_size;
        int tmp = !strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX));
        if (!(tmp ? !kvt__store_pid_alive(nm) : kvt__store_is_shard_name(nm)))
            continue; /* IDENTITY, locks, live writers' temp files, strangers */
        if (strlen(nm) >= sizeof fs[0].name)
            continue;
        if (n == cap) {
            size_t c = cap ? cap * 2 : 64;
            rfile *x = kvt__realloc(fs, sizeof *x * c);
            if (!x)
                break;
            fs = x;
            cap = c;
        }
        rfile *f = &fs[n++];
        memset(f, 0, sizeof *f);
        memcpy(f->name, nm, strlen(nm) + 1); /* checked: shorter than name */
        f->type = tmp ? 't' : nm[0];
        f->bytes = (uint64_t)st.st_size;
        f->mtime_ms = (int64_t)st.st_mtim.tv_sec * 1000 + st.st_mtim.tv_nsec / 1000000;
        f->orphan = tmp;
        if (!tmp) {
            char hex[33];
            memcpy(hex, nm + 1, 32);
            hex[32] = '\0';
            kvt__key_parse(hex, &f->key);
        }
    }
    if (d)
        closedir(d);
    kvt__kmap bm;
    memset(&bm, 0, sizeof bm);
    for (size_t i = 0; i < n; i++)
        if (fs[i].type == 'b')
            kvt__kmap_put_ptr(&bm, fs[i].key, &fs[i]);
    for (size_t i = 0; i < n; i++)
        if (fs[i].type == 'e')
            fs[i].d = dent_get(s, fs[i].name, fs[i].key); /* header I/O: without mu */
    pthread_mutex_lock(&s->mu);
    uint64_t foreign = s->foreign_bytes, foreign_ms = s->foreign_scan_ms;
    for (size_t i = 0; i < n; i++) {
        rfile *f = &fs[i];
        if (f->type == 'b' && is_orphan_name(s, f->name))
            f->orphan = 1;
        if (f->type != 'e')
            continue;
        f->orphan = !f->d || !f->d->valid || is_orphan_name(s, f->name);
        for (int32_t k = 0; f->d && f->d->valid && !f->broken && k < f->d->n_blocks; k++)
            if (!rf_block(&bm, f->d->blocks[k]))
                f->orphan = f->broken = 1; /* a block is gone: broken, goes first */
        if (!f->orphan)
            f->mtime_ms = own_last_use(s, f->key, f->mtime_ms);
    }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < n; i++)
        if (fs[i].type == 'e' && !fs[i].orphan)
            for (int32_t k = 0; k < fs[i].d->n_blocks; k++)
                rf_block(&bm, fs[i].d->blocks[k])->refs++;
    /* 2. blocks this process let go of that no entry file references */
    pthread_mutex_lock(&s->mu);
    uint64_t evicted_big = 0;
    kvt__key *fr = s->free_keys;
    int32_t nfr = s->n_free;
    s->free_keys = NULL;
    s->n_free = s->cap_free = 0;
    s->reclaim_due = 0;
    pthread_mutex_unlock(&s->mu);
    for (int32_t i = 0; i < nfr; i++) {
        rfile *b = rf_block(&bm, fr[i]);
        if (b && !b->gone && b->refs == 0) {
            uint64_t freed = rf_delete(s, b, &bm);
            own -= KVT__MIN(own, freed);
        }
    }
    kvt__free(fr);
    /* 2b. entry files referencing a block that is gone are garbage, budget
     * or not (nothing can serve them). The block is looked up again first:
     * a put without the shared lock renames its blocks before its entry, so
     * one seen by readdir before its blocks is not broken. */
    for (size_t i = 0; i < n; i++) {
        rfile *x = &fs[i];
        if (x->type != 'e' || !x->broken || x->gone)
            continue;
        int missing = 0;
        for (int32_t k = 0; !missing && k < x->d->n_blocks; k++) {
            char bn[64];
            struct stat bst;
            kvt__store_file_name('b', x->d->blocks[k], bn);
            missing = fstatat(s->dirfd, bn, &bst, AT_SYMLINK_NOFOLLOW) != 0;
        }
        if (missing) {
            uint64_t freed = rf_delete(s, x, &bm);
            own -= KVT__MIN(own, freed);
        }
    }
    /* 3. the budget: broken and unreferenced files first, then the least
     * recently used entries here and in idle foreign directories. An entry
     * that with all its blocks exceeds the whole budget can never be kept:
     * it goes first (with the blocks only it uses), before anything that
     * fits is evicted to make room for it. */
    if (max)
        for (size_t i = 0; i < n; i++) {
            rfile *x = &fs[i];
            if (x->type != 'e' || x->orphan || x->gone)
                continue;
            uint64_t need = x->bytes;
            for (int32_t k = 0; k < x->d->n_blocks; k++) {
                rfile *b = rf_block(&bm, x->d->blocks[k]);
                if (b && !b->gone)
                    need += b->bytes;
            }
            if (need > max) {
                evicted_big++;
                uint64_t freed = rf_delete(s, x, &bm);
                own -= KVT__MIN(own, freed);
            }
        }
    fdirs f;
    int have_f = 0;
    if (max) {
        if (foreign || now - foreign_ms >= 1000 || wait) {
            have_f = list_foreign(s->root, s->dir_name, 1, &f) == 0;
            foreign_ms = now;
        }
        if (have_f) {
            foreign = f.bytes;
            fc_mark_orphans(&f);
        }
    }
    uint64_t evicted = evicted_big, evicted_foreign = 0;
    while (max && own + foreign > max) {
        ssize_t best = -1;
        for (size_t i = 0; i < n; i++) {
            rfile *x = &fs[i];
            /* a block goes only when no valid entry file references it */
            int cand = !x->gone && (x->type == 'b' ? x->refs == 0 : 1) &&
                       !(x->type == 'e' && !x->orphan && kvt__key_eq(x->key, protect));
            int xo = x->orphan || x->type != 'e';
            if (!cand)
                continue;
            if (best < 0) {
                best = (ssize_t)i;
                continue;
            }
            rfile *b = &fs[best];
            int bo = b->orphan || b->type != 'e';
            if (xo > bo || (xo == bo && x->mtime_ms < b->mtime_ms))
                best = (ssize_t)i;
        }
        ssize_t fi = have_f ? fc_oldest(&f) : -1;
        if (best < 0 && fi < 0)
            break;
        int own_orphan = best >= 0 && (fs[best].orphan || fs[best].type != 'e');
        if (fi >= 0 && (best < 0 || (!own_orphan && (f.c[fi].orphan || f.c[fi].mtime_ms <= fs[best].mtime_ms)))) {
            uint64_t freed = fc_evict(&f, (size_t)fi);
            foreign -= KVT__MIN(foreign, freed);
            evicted_foreign++;
        } else {
            evicted += fs[best].type == 'e' && !fs[best].orphan;
            uint64_t freed = rf_delete(s, &fs[best], &bm);
            own -= KVT__MIN(own, freed);
        }
    }
    if (have_f)
        fdirs_free(&f);
    /* 4. the index follows the disk: what was deleted leaves it */
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < n; i++) {
        rfile *x = &fs[i];
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
                    kvt__free(b);
                }
            }
        }
        for (int32_t k = 0; k < s->n_orphans; k++)
            if (!strcmp(s->orphans[k].name, x->name)) {
                s->orphans[k] = s->orphans[--s->n_orphans];
                break;
            }
    }
    s->own_bytes = own;
    s->foreign_bytes = foreign;
    s->foreign_scan_ms = foreign_ms;
    s->disk_ms = now;
    s->st.evicted += evicted;
    s->st.evicted_foreign_files += evicted_foreign;
    pthread_mutex_unlock(&s->mu);
    kvt__kmap_free(&bm);
    kvt__free(fs);
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
