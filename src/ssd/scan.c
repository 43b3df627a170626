/*
 * scan.c: the SSD tier's directory walking: the startup scan that rebuilds
 * the index from shard headers (bounded reads, no payload), the offline
 * walk behind store inspect/verify, the count of shards other configs of
 * the same model left, and the names kvtier gives files and directories.
 * It never follows a symbolic link and never serves a shard it refused.
 */
#include "codec.h"
#include "hmap.h"
#include "internal.h"
#include "io_shim.h"
#include "store_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- names ------------------------------------------------------------------------ */

static int is_hex32(const char *s)
{
    for (int i = 0; i < 32; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

/* 32 lowercase hex digits: what kvt_store_open names identity directories. */
int kvt__store_is_identity_dir(const char *n) { return strlen(n) == 32 && is_hex32(n); }

/* e<32 hex>.safetensors or b<32 hex>.safetensors */
int kvt__store_is_shard_name(const char *n)
{
    return (n[0] == 'e' || n[0] == 'b') && strlen(n) == 33 + strlen(KVT__SHARD_SUFFIX) && is_hex32(n + 1) &&
           !strcmp(n + 33, KVT__SHARD_SUFFIX);
}

char *kvt__store_read_small(int dirfd, const char *name)
{
    int fd = kvt__io_openat(dirfd, name, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return NULL;
    char *b = kvt__malloc(8192);
    ssize_t r = b ? kvt__io_read(fd, b, 8191) : -1;
    kvt__io_close(fd);
    if (r < 0) {
        kvt__free(b);
        return NULL;
    }
    while (r > 0 && (b[r - 1] == '\n'))
        r--;
    b[r] = '\0';
    return b;
}

/* ---- scan ------------------------------------------------------------------------ */

int kvt__store_pid_alive(const char *tmpname)
{
    long pid = strtol(tmpname + strlen(KVT__TMP_PREFIX), NULL, 10);
    if (pid <= 0)
        return 0;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

void kvt__store_refuse_count(kvt_store *s, int reason)
{
    if (reason >= 0 && reason < KVT_STORE_REFUSED_COUNT)
        s->st.refused[reason]++;
}

/* ---- the directory walker ------------------------------------------------------------ */

int kvt__dir_walk(int dirfd, kvt__dir_fn fn, void *ctx)
{
    DIR *d = fdopendir(dup(dirfd));
    if (!d)
        return -errno;
    rewinddir(d); /* the dup shares the descriptor's offset: start at the beginning */
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        struct stat st;
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..") ||
            fstatat(dirfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW))
            continue;
        rc = fn(ctx, de->d_name, &st);
    }
    closedir(d);
    return rc;
}

int kvt__store_is_meta_file(const char *name)
{
    return !strcmp(name, ".lock") || !strcmp(name, "IDENTITY") || !strcmp(name, KVT__BUDGET_LOCK);
}

int kvt__store_is_tmp_name(const char *name) { return !strncmp(name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX)); }

int kvt__root_walk(const char *root, const char *skip, kvt__root_fn fn, void *ctx)
{
    DIR *d = opendir(root);
    if (!d)
        return -errno;
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        if (!kvt__store_is_identity_dir(de->d_name) || (skip && !strcmp(de->d_name, skip)))
            continue;
        kvt__id_dir x = {.name = de->d_name, .dirfd = -1};
        snprintf(x.path, sizeof x.path, "%s/%s", root, de->d_name);
        if (lstat(x.path, &x.lst) || !(S_ISLNK(x.lst.st_mode) || S_ISDIR(x.lst.st_mode)))
            continue;
        if (S_ISLNK(x.lst.st_mode)) {
            rc = fn(ctx, &x); /* never followed */
            continue;
        }
        x.dirfd = kvt__io_open(x.path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (x.dirfd < 0)
            continue;
        rc = fn(ctx, &x);
        kvt__io_close(x.dirfd);
    }
    closedir(d);
    return rc;
}

/* ---- the startup scan ----------------------------------------------------------------- */

/* Indexes block shard nm (its header sh); *reason on a refusal. */
static int scan_block(kvt_store *s, const char *nm, const kvt__shard *sh, const struct stat *fst, int *reason)
{
    kvt__pblock pb;
    int rc = kvt__codec_parse_block(sh, nm, s->identity, &pb, reason);
    if (!rc)
        rc = kvt__store_check_name('b', pb.key, nm, reason);
    if (!rc && !kvt__kmap_ptr(&s->blocks, pb.key)) {
        st_block *b = kvt__calloc(1, sizeof *b);
        if (b && !kvt__store_lbytes_shard(sh, &b->lbytes, &b->n_lbytes) && !kvt__kmap_put_ptr(&s->blocks, pb.key, b)) {
            b->key = pb.key;
            b->bytes = (uint64_t)fst->st_size;
            s->own_bytes += b->bytes;
            kvt__store_lbytes_account(s, b->lbytes, b->n_lbytes, 1);
            s->st.blocks++;
        } else {
            if (b)
                kvt__free(b->lbytes);
            kvt__free(b);
            rc = KVT_ENOMEM;
        }
    }
    kvt__pblock_free(&pb);
    return rc;
}

/* Indexes entry shard nm when all its blocks are indexed; *reason on a refusal. */
static int scan_entry(kvt_store *s, const char *nm, const kvt__shard *sh, const struct stat *fst, int *reason)
{
    kvt__pentry pe;
    int rc = kvt__codec_parse_entry(sh, nm, s->identity, &pe, reason);
    if (!rc)
        rc = kvt__store_check_name('e', pe.key, nm, reason);
    for (int32_t i = 0; !rc && i < pe.n_blocks; i++)
        if (!kvt__kmap_ptr(&s->blocks, pe.blocks[i])) {
            rc = kvt__store_refuse(reason, KVT_STORE_REFUSED_MISSING_BLOCK, nm, "references a block that is gone");
            s->reclaim_due = 1; /* a broken file: reclaim removes it */
        }
    st_entry *e = NULL;
    if (!rc && !kvt__kmap_ptr(&s->by_key, pe.key)) {
        e = kvt__calloc(1, sizeof *e);
        if (!e || !(e->ns = kvt__strdup(pe.ns)) || kvt__store_lbytes_shard(sh, &e->lbytes, &e->n_lbytes)) {
            kvt__store_entry_free(e);
            rc = KVT_ENOMEM;
        } else {
            e->key = pe.key;
            e->tokens = pe.tokens;
            pe.tokens = NULL;
            e->n_tokens = pe.n_tokens;
            e->min_reach = pe.min_reach;
            e->granule = pe.granule;
            e->blocks = pe.blocks;
            pe.blocks = NULL;
            e->n_blocks = pe.n_blocks;
            e->bytes = (uint64_t)fst->st_size;
            e->last_use_ms = (int64_t)fst->st_mtim.tv_sec * 1000 + fst->st_mtim.tv_nsec / 1000000;
            if (kvt__store_index_entry(s, e)) {
                kvt__store_entry_free(e);
                rc = KVT_ENOMEM;
            } else {
                for (int32_t i = 0; i < e->n_blocks; i++)
                    ((st_block *)kvt__kmap_ptr(&s->blocks, e->blocks[i]))->refs++;
            }
        }
    }
    kvt__pentry_free(&pe);
    return rc;
}

typedef struct scan_ctx {
    kvt_store *s;
    int pass; /* 0: blocks (and dead writers' temp files), 1: entries */
} scan_ctx;

static int scan_file(void *ctx, const char *nm, const struct stat *fst)
{
    scan_ctx *c = ctx;
    kvt_store *s = c->s;
    if ((nm[0] == '.' && !kvt__store_is_tmp_name(nm)) || !S_ISREG(fst->st_mode))
        return 0;
    if (kvt__store_is_tmp_name(nm)) {
        if (c->pass == 0 && !s->opts.read_only && !kvt__store_pid_alive(nm) && !kvt__io_unlinkat(s->dirfd, nm, 0))
            s->st.temp_removed++;
        return 0;
    }
    size_t len = strlen(nm);
    if (len != 1 + 32 + strlen(KVT__SHARD_SUFFIX) || strcmp(nm + 33, KVT__SHARD_SUFFIX))
        return 0;
    char type = nm[0];
    if ((c->pass == 0) != (type == 'b') || (type != 'b' && type != 'e'))
        return 0;
    kvt__shard sh;
    int fd = -1, reason = -1;
    int rc = kvt__shard_open(s->dirfd, s->dir, nm, &sh, &fd, &reason);
    if (!rc)
        rc = type == 'b' ? scan_block(s, nm, &sh, fst, &reason) : scan_entry(s, nm, &sh, fst, &reason);
    if (fd >= 0)
        kvt__io_close(fd);
    kvt__shard_free(&sh);
    if (rc == KVT_ENOMEM)
        return rc;
    if (rc) {
        kvt__store_refuse_count(s, reason);
        s->own_bytes += (uint64_t)fst->st_size;
        kvt__store_orphan_add(s, nm, (uint64_t)fst->st_size);
    }
    return 0;
}

int kvt__store_scan(kvt_store *s)
{
    /* Two passes: blocks first (entries reference them), then entries. */
    for (int pass = 0; pass < 2; pass++) {
        scan_ctx c = {s, pass};
        int rc = kvt__dir_walk(s->dirfd, scan_file, &c);
        if (rc == KVT_ENOMEM)
            return rc;
        if (rc)
            return kvt__fail(rc, "%s: cannot list: %s", s->dir, strerror(-rc));
    }
    kvt__clear_error();
    return 0;
}

/* ---- shards of other configs ------------------------------------------------------- */

typedef struct other_ctx {
    kvt_store *s;
    const char *model_id;
} other_ctx;

static int count_shard(void *ctx, const char *name, const struct stat *st)
{
    (void)st;
    if (kvt__store_is_shard_name(name))
        ((kvt_store *)ctx)->st.other_config_shards++;
    return 0;
}

static int count_dir(void *ctx, const kvt__id_dir *d)
{
    other_ctx *c = ctx;
    if (d->dirfd < 0)
        return 0;
    char *ident = kvt__store_read_small(d->dirfd, "IDENTITY");
    json_t *j = ident ? json_loads(ident, 0, NULL) : NULL;
    const char *model = json_string_value(json_object_get(j, "model"));
    if (model && !strcmp(model, c->model_id))
        kvt__dir_walk(d->dirfd, count_shard, c->s);
    json_decref(j);
    kvt__free(ident);
    return 0;
}

/* Counts the shards of directories holding the same model id under another
 * config fingerprint or tokenizer: a model reshaped under the same name. */
void kvt__store_count_other_configs(kvt_store *s, const kvt_store_identity *id)
{
    other_ctx c = {s, id->model_id};
    kvt__root_walk(s->root, s->dir_name, count_dir, &c);
}

/* ---- offline: walk ------------------------------------------------------------------ */

typedef struct walk_ctx {
    int verify;
    int (*cb)(void *ctx, const kvt_store_shard_info *info);
    void *cb_ctx;
    const kvt__id_dir *d;
    const char *ident;
    int rc; /* the callback's nonzero return: stops the walk */
} walk_ctx;

/* Fills in what the shard's header says and checks what it references;
 * with verify, everything a restore checks, by the restore's own code.
 * @return 0 or the refusal (*reason). */
static int walk_check(walk_ctx *c, const char *nm, kvt_store_shard_info *in, kvt__shard *sh, kvt__pentry *pe,
                      kvt__pblock *pb, int *reason)
{
    int dfd = c->d->dirfd, fd = -1;
    const char *path = c->d->path;
    int r = kvt__shard_open(dfd, path, nm, sh, &fd, reason);
    if (fd >= 0)
        kvt__io_close(fd);
    if (!r && in->type == 'e') {
        r = kvt__codec_parse_entry(sh, nm, c->ident, pe, reason);
        if (!r) {
            in->ns = pe->ns;
            in->n_tokens = pe->n_tokens;
            in->n_layers = (int32_t)json_array_size(pe->layers);
            in->n_blocks = pe->n_blocks;
            for (int32_t i = 0; !r && i < pe->n_blocks; i++) {
                char bn[64];
                struct stat bs;
                kvt__store_file_name('b', pe->blocks[i], bn);
                if (fstatat(dfd, bn, &bs, 0))
                    r = kvt__store_refuse(reason, KVT_STORE_REFUSED_MISSING_BLOCK, nm, "a referenced block is gone");
            }
        }
    } else if (!r) {
        r = kvt__codec_parse_block(sh, nm, c->ident, pb, reason);
        if (!r) {
            in->ns = pb->ns;
            in->n_tokens = pb->n_tokens;
        }
    }
    in->n_tensors = sh->n;
    if (!r && c->verify && in->type == 'e') {
        kvt_entry tmp;
        char bad_shard[64];
        uint64_t nb = 0;
        r = kvt__store_load_entry(dfd, path, nm, c->ident, NULL, -1, 1, &tmp, reason, bad_shard, &nb);
        if (!r)
            kvt_entry_clear(&tmp);
        else if (r == KVT_ENOTFOUND)
            *reason = KVT_STORE_REFUSED_IO; /* removed while walking */
    } else if (!r && c->verify) {
        kvt__rshard rs;
        kvt__pblock pb2;
        memset(&rs, 0, sizeof rs);
        r = kvt__store_load_block(dfd, path, nm, c->ident, 1, &rs, &pb2, reason);
        kvt__pblock_free(&pb2);
        kvt__rshard_clear(&rs);
    }
    return r;
}

static int walk_file(void *ctx, const char *nm, const struct stat *fs)
{
    walk_ctx *c = ctx;
    if (kvt__store_is_meta_file(nm) || !S_ISREG(fs->st_mode))
        return 0;
    kvt_store_shard_info in;
    memset(&in, 0, sizeof in);
    in.dir = c->d->name;
    in.identity = c->ident;
    in.file = nm;
    in.bytes = (uint64_t)fs->st_size;
    in.mtime_ms = (int64_t)fs->st_mtim.tv_sec * 1000 + fs->st_mtim.tv_nsec / 1000000;
    in.ns = "";
    in.type = kvt__store_is_tmp_name(nm) ? 't' : (nm[0] == 'e' || nm[0] == 'b') ? nm[0] : '?';
    kvt__shard sh;
    kvt__pentry pe;
    kvt__pblock pb;
    memset(&sh, 0, sizeof sh);
    memset(&pe, 0, sizeof pe);
    memset(&pb, 0, sizeof pb);
    if (in.type == 'e' || in.type == 'b') {
        int reason = -1;
        int r = walk_check(c, nm, &in, &sh, &pe, &pb, &reason);
        in.status = r ? (reason >= 0 ? reason : KVT_STORE_REFUSED_IO) + 1 : 0;
    }
    c->rc = c->cb(c->cb_ctx, &in);
    kvt__pblock_free(&pb);
    kvt__pentry_free(&pe);
    kvt__shard_free(&sh);
    return c->rc;
}

static int walk_dir(void *ctx, const kvt__id_dir *d)
{
    walk_ctx *c = ctx;
    if (d->dirfd < 0) {
        /* never followed: reported as refused, like kvt_store_open refuses it */
        kvt_store_shard_info in;
        memset(&in, 0, sizeof in);
        in.dir = d->name;
        in.identity = "";
        in.file = "";
        in.type = 'l';
        in.mtime_ms = (int64_t)d->lst.st_mtim.tv_sec * 1000 + d->lst.st_mtim.tv_nsec / 1000000;
        in.ns = "";
        in.status = KVT_STORE_REFUSED_SYMLINK + 1;
        return c->rc = c->cb(c->cb_ctx, &in);
    }
    char *ident = kvt__store_read_small(d->dirfd, "IDENTITY");
    if (!ident)
        return 0; /* not a store directory */
    c->d = d;
    c->ident = ident;
    kvt__dir_walk(d->dirfd, walk_file, c); /* a directory that cannot be listed is passed over */
    kvt__free(ident);
    return c->rc;
}

KVT_API int kvt_store_walk(const char *root, int verify, int (*cb)(void *ctx, const kvt_store_shard_info *info),
                           void *ctx)
{
    if (!root || !cb)
        return kvt__fail(KVT_EINVAL, "kvt_store_walk: bad arguments");
    walk_ctx c = {.verify = verify, .cb = cb, .cb_ctx = ctx};
    int rc = kvt__root_walk(root, NULL, walk_dir, &c);
    if (rc && !c.rc)
        return kvt__fail(rc, "%s: %s", root, strerror(-rc));
    return rc;
}

