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

int kvt__store_scan(kvt_store *s)
{
    DIR *d = fdopendir(dup(s->dirfd));
    if (!d)
        return kvt__fail(-errno, "%s: cannot list: %s", s->dir, strerror(errno));
    rewinddir(d);
    /* Two passes: blocks first (entries reference them), then entries. */
    for (int pass = 0; pass < 2; pass++) {
        rewinddir(d);
        struct dirent *de;
        while ((de = readdir(d))) {
            const char *nm = de->d_name;
            struct stat fst;
            if (nm[0] == '.' && strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX)))
                continue;
            if (fstatat(s->dirfd, nm, &fst, AT_SYMLINK_NOFOLLOW) || !S_ISREG(fst.st_mode))
                continue;
            if (!strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX))) {
                if (pass == 0 && !s->opts.read_only && !kvt__store_pid_alive(nm) && !kvt__io_unlinkat(s->dirfd, nm, 0))
                    s->st.temp_removed++;
                continue;
            }
            size_t len = strlen(nm);
            if (len != 1 + 32 + strlen(KVT__SHARD_SUFFIX) || strcmp(nm + 33, KVT__SHARD_SUFFIX))
                continue;
            char type = nm[0];
            if ((pass == 0) != (type == 'b') || (type != 'b' && type != 'e'))
                continue;
            kvt__shard sh;
            int fd = -1, reason = -1;
            int rc = kvt__shard_open(s->dirfd, s->dir, nm, &sh, &fd, &reason);
            if (!rc && type == 'b') {
                kvt__pblock pb;
                rc = kvt__codec_parse_block(&sh, nm, s->identity, &pb, &reason);
                char want[64];
                if (!rc) {
                    kvt__store_file_name('b', pb.key, want);
                    if (strcmp(want, nm))
                        rc = kvt__store_refuse(&reason, KVT_STORE_REFUSED_MALFORMED, nm, "file name does not match its key");
                }
                if (!rc && !kvt__kmap_ptr(&s->blocks, pb.key)) {
                    st_block *b = kvt__calloc(1, sizeof *b);
                    if (b && !kvt__kmap_put_ptr(&s->blocks, pb.key, b)) {
                        b->key = pb.key;
                        b->bytes = (uint64_t)fst.st_size;
                        s->own_bytes += b->bytes;
                        s->st.blocks++;
                    } else {
                        kvt__free(b);
                        rc = KVT_ENOMEM;
                    }
                }
                kvt__free(pb.tokens);
            } else if (!rc) {
                kvt__pentry pe;
                rc = kvt__codec_parse_entry(&sh, nm, s->identity, &pe, &reason);
                char want[64];
                if (!rc) {
                    kvt__store_file_name('e', pe.key, want);
                    if (strcmp(want, nm))
                        rc = kvt__store_refuse(&reason, KVT_STORE_REFUSED_MALFORMED, nm, "file name does not match its key");
                }
                for (int32_t i = 0; !rc && i < pe.n_blocks; i++)
                    if (!kvt__kmap_ptr(&s->blocks, pe.blocks[i])) {
                        rc = kvt__store_refuse(&reason, KVT_STORE_REFUSED_MISSING_BLOCK, nm, "references a block that is gone");
                        s->reclaim_due = 1; /* a broken file: reclaim removes it */
                    }
                st_entry *e = NULL;
                if (!rc && !kvt__kmap_ptr(&s->by_key, pe.key)) {
                    e = kvt__calloc(1, sizeof *e);
                    if (!e || !(e->ns = kvt__strdup(pe.ns))) {
                        kvt__store_entry_free(e);
                        rc = KVT_ENOMEM;
                    } else {
                        e->key = pe.key;
                        e->tokens = pe.tokens;
                        pe.tokens = NULL;
                        e->n_tokens = pe.n_tokens;
                        e->min_reach = pe.min_reach;
                        e->blocks = pe.blocks;
                        pe.blocks = NULL;
                        e->n_blocks = pe.n_blocks;
                        e->bytes = (uint64_t)fst.st_size;
                        e->last_use_ms = (int64_t)fst.st_mtim.tv_sec * 1000 + fst.st_mtim.tv_nsec / 1000000;
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
            }
            if (fd >= 0)
                kvt__io_close(fd);
            kvt__shard_free(&sh);
            if (rc == KVT_ENOMEM) {
                closedir(d);
                return rc;
            }
            if (rc) {
                kvt__store_refuse_count(s, reason);
                s->own_bytes += (uint64_t)fst.st_size;
                kvt__store_orphan_add(s, nm, (uint64_t)fst.st_size);
            }
        }
    }
    closedir(d);
    kvt__clear_error();
    return 0;
}

/* Counts the shards of directories holding the same model id under another
 * config fingerprint or tokenizer: a model reshaped under the same name. */
void kvt__store_count_other_configs(kvt_store *s, const kvt_store_identity *id)
{
    DIR *d = opendir(s->root);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!kvt__store_is_identity_dir(de->d_name) || !strcmp(de->d_name, s->dir_name))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", s->root, de->d_name);
        int dfd = kvt__io_open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (dfd < 0)
            continue;
        char *ident = kvt__store_read_small(dfd, "IDENTITY");
        json_t *j = ident ? json_loads(ident, 0, NULL) : NULL;
        const char *model = json_string_value(json_object_get(j, "model"));
        if (model && !strcmp(model, id->model_id)) {
            DIR *dd = fdopendir(dup(dfd));
            struct dirent *fe;
            while (dd && (fe = readdir(dd)))
                if (kvt__store_is_shard_name(fe->d_name))
                    s->st.other_config_shards++;
            if (dd)
                closedir(dd);
        }
        json_decref(j);
        kvt__free(ident);
        kvt__io_close(dfd);
    }
    closedir(d);
}

/* ---- offline: walk ------------------------------------------------------------------ */

KVT_API int kvt_store_walk(const char *root, int verify, int (*cb)(void *ctx, const kvt_store_shard_info *info),
                           void *ctx)
{
    if (!root || !cb)
        return kvt__fail(KVT_EINVAL, "kvt_store_walk: bad arguments");
    DIR *d = opendir(root);
    if (!d)
        return kvt__fail(-errno, "%s: %s", root, strerror(errno));
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", root, de->d_name);
        if (!kvt__store_is_identity_dir(de->d_name))
            continue;
        struct stat lst;
        if (!lstat(path, &lst) && S_ISLNK(lst.st_mode)) {
            /* never followed: reported as refused, like kvt_store_open refuses it */
            kvt_store_shard_info in;
            memset(&in, 0, sizeof in);
            in.dir = de->d_name;
            in.identity = "";
            in.file = "";
            in.type = 'l';
            in.mtime_ms = (int64_t)lst.st_mtim.tv_sec * 1000 + lst.st_mtim.tv_nsec / 1000000;
            in.ns = "";
            in.status = KVT_STORE_REFUSED_SYMLINK + 1;
            rc = cb(ctx, &in);
            continue;
        }
        int dfd = kvt__io_open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (dfd < 0)
            continue;
        char *ident = kvt__store_read_small(dfd, "IDENTITY");
        if (!ident) {
            kvt__io_close(dfd); /* not a store directory */
            continue;
        }
        DIR *dd = fdopendir(dup(dfd));
        struct dirent *fe;
        while (!rc && dd && (fe = readdir(dd))) {
            struct stat fs;
            const char *nm = fe->d_name;
            if (!strcmp(nm, ".") || !strcmp(nm, "..") || !strcmp(nm, ".lock") || !strcmp(nm, "IDENTITY") ||
                !strcmp(nm, KVT__BUDGET_LOCK))
                continue;
            if (fstatat(dfd, nm, &fs, AT_SYMLINK_NOFOLLOW) || !S_ISREG(fs.st_mode))
                continue;
            kvt_store_shard_info in;
            memset(&in, 0, sizeof in);
            in.dir = de->d_name;
            in.identity = ident ? ident : "";
            in.file = nm;
            in.bytes = (uint64_t)fs.st_size;
            in.mtime_ms = (int64_t)fs.st_mtim.tv_sec * 1000 + fs.st_mtim.tv_nsec / 1000000;
            in.ns = "";
            int is_tmp = !strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX));
            in.type = is_tmp ? 't' : (nm[0] == 'e' || nm[0] == 'b') ? nm[0] : '?';
            kvt__shard sh;
            memset(&sh, 0, sizeof sh);
            kvt__pentry pe;
            memset(&pe, 0, sizeof pe);
            kvt__pblock pb;
            memset(&pb, 0, sizeof pb);
            int fd = -1, reason = -1;
            if (in.type == 'e' || in.type == 'b') {
                int r = kvt__shard_open(dfd, path, nm, &sh, &fd, &reason);
                if (!r && in.type == 'e') {
                    r = kvt__codec_parse_entry(&sh, nm, ident, &pe, &reason);
                    if (!r) {
                        in.ns = pe.ns;
                        in.n_tokens = pe.n_tokens;
                        in.n_layers = (int32_t)json_array_size(pe.layers);
                        in.n_blocks = pe.n_blocks;
                        for (int32_t i = 0; !r && i < pe.n_blocks; i++) {
                            char bn[64];
                            struct stat bs;
                            kvt__store_file_name('b', pe.blocks[i], bn);
                            if (fstatat(dfd, bn, &bs, 0))
                                r = kvt__store_refuse(&reason, KVT_STORE_REFUSED_MISSING_BLOCK, nm, "a referenced block is gone");
                        }
                    }
                } else if (!r) {
                    r = kvt__codec_parse_block(&sh, nm, ident, &pb, &reason);
                    if (!r) {
                        in.ns = pb.ns;
                        in.n_tokens = pb.n_tokens;
                    }
                }
                in.n_tensors = sh.n;
                if (!r && verify && in.type == 'e') {
                    /* everything a restore checks, by the restore's own code */
                    kvt_entry tmp;
                    char bad_shard[64];
                    uint64_t nb = 0;
                    r = kvt__store_load_entry(dfd, path, nm, ident, NULL, -1, 1, &tmp, &reason, bad_shard, &nb);
                    if (!r)
                        kvt_entry_clear(&tmp);
                    else if (r == KVT_ENOTFOUND)
                        reason = KVT_STORE_REFUSED_IO; /* removed while walking */
                } else if (!r && verify) {
                    kvt__rshard rs;
                    kvt__pblock pb2;
                    memset(&rs, 0, sizeof rs);
                    r = kvt__store_load_block(dfd, path, nm, ident, 1, &rs, &pb2, &reason);
                    kvt__free(pb2.tokens);
                    kvt__shard_free(&rs.sh);
                    kvt_buf_release(rs.buf);
                }
                in.status = r ? (reason >= 0 ? reason : KVT_STORE_REFUSED_IO) + 1 : 0;
            }
            rc = cb(ctx, &in);
            if (fd >= 0)
                kvt__io_close(fd);
            kvt__free(pb.tokens);
            kvt__pentry_free(&pe);
            kvt__shard_free(&sh);
        }
        if (dd)
            closedir(dd);
        kvt__free(ident);
        kvt__io_close(dfd);
    }
    closedir(d);
    return rc;
}

