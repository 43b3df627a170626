/*
 * publish.c: writing a published generation (kvtier/publish.h). A
 * publisher holds DIR/.publish.lock exclusively from begin to commit or
 * abort, writes shards through an SSD store opened in a staging directory,
 * then makes the generation durable and visible in the order the header
 * states (manifest, fsyncs, rename into generations/, CURRENT switch) and
 * removes old generations that no reader holds. It never touches a
 * generation that is, or may be, mounted.
 */
#include "internal.h"
#include "publish_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct kvt_publisher {
    kvt__pub_where w;
    const char *dir;             /* w.dir */
    int dirfd, lockfd;
    char staging[64];            /* name under dir */
    char staging_path[4096];
    char identity_dir[64];       /* the store's identity directory name */
    kvt_store *store;
};

/* ---- file helpers ---------------------------------------------------------------- */

int kvt__pub_fsync_path(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) ? -errno : 0;
    close(fd);
    return rc;
}

static int rmtree_depth(int dfd, const char *name, int depth)
{
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW))
        return errno == ENOENT ? 0 : -errno;
    if (!S_ISDIR(st.st_mode))
        return unlinkat(dfd, name, 0) && errno != ENOENT ? -errno : 0;
    if (depth > 4)
        return -ELOOP;
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return -errno;
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -ENOMEM;
    }
    int rc = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
            int r = rmtree_depth(dirfd(d), de->d_name, depth + 1);
            if (r && !rc)
                rc = r;
        }
    closedir(d);
    if (unlinkat(dfd, name, AT_REMOVEDIR) && errno != ENOENT && !rc)
        rc = -errno;
    return rc;
}

int kvt__pub_rmtree_at(int dirfd, const char *name) { return rmtree_depth(dirfd, name, 0); }

static int mkdir_p1(const char *path)
{
    if (mkdir(path, 0755) && errno != EEXIST)
        return kvt__fail(-errno, "%s: %s", path, strerror(errno));
    struct stat st;
    if (lstat(path, &st) || !S_ISDIR(st.st_mode))
        return kvt__fail(-ENOTDIR, "%s: not a directory", path);
    return 0;
}

/* Writes data to dirfd/name: create, write, fsync, close. */
static int write_durable(int dirfd, const char *name, const char *data, size_t n, const char *what)
{
    int fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return kvt__fail(-errno, "%s: %s", what, strerror(errno));
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int e = w < 0 ? errno : EIO;
            close(fd);
            unlinkat(dirfd, name, 0);
            return kvt__fail(-e, "%s: %s", what, strerror(e));
        }
        done += (size_t)w;
    }
    if (fsync(fd)) {
        int e = errno;
        close(fd);
        unlinkat(dirfd, name, 0);
        return kvt__fail(-e, "%s: fsync: %s", what, strerror(e));
    }
    close(fd);
    return 0;
}

/* Removes leftovers of dead publishers (we hold the publish lock, so no
 * publisher is alive to own them; readers never open them). */
static void remove_leftovers(int dirfd)
{
    int fd = dup(dirfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0)
            close(fd);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d)))
        if (!strncmp(de->d_name, KVT__PUB_STAGING, strlen(KVT__PUB_STAGING)) ||
            !strncmp(de->d_name, KVT__PUB_REMOVING, strlen(KVT__PUB_REMOVING)) ||
            !strncmp(de->d_name, ".CURRENT.tmp.", 13))
            kvt__pub_rmtree_at(dirfd, de->d_name);
    closedir(d);
}

static void publisher_free(kvt_publisher *p)
{
    if (!p)
        return;
    if (p->store)
        kvt_store_close(p->store);
    if (p->staging[0] && p->dirfd >= 0)
        kvt__pub_rmtree_at(p->dirfd, p->staging);
    if (p->lockfd >= 0)
        close(p->lockfd); /* releases the publish lock */
    if (p->dirfd >= 0)
        close(p->dirfd);
    kvt__pub_where_clear(&p->w);
    kvt__free(p);
}

/* Hard-links every entry and block shard of the current generation into the
 * staging store's directory (before the store opens it). */
static int link_current(kvt_publisher *p, const kvt_store_identity *id)
{
    kvt_publish_validate_opts vo = {.identity = id, .hashes = 1};
    kvt_publish_report rep;
    int rc = kvt_publish_validate(p->dir, NULL, &vo, &rep);
    if (rc == KVT_ENOTFOUND)
        return 0; /* nothing published yet: start empty */
    if (rc)
        return rc;
    char src[4400], dst[4400];
    snprintf(dst, sizeof dst, "%s/%s", p->staging_path, rep.identity_dir);
    if ((rc = mkdir_p1(dst)))
        return rc;
    snprintf(src, sizeof src, "%s/%s/%s/%s", p->dir, KVT__PUB_GENERATIONS, rep.generation, rep.identity_dir);
    DIR *d = opendir(src);
    if (!d)
        return kvt__fail(-errno, "%s: %s", src, strerror(errno));
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        const char *nm = de->d_name;
        size_t l = strlen(nm);
        if ((nm[0] != 'e' && nm[0] != 'b') || l < 12 || strcmp(nm + l - 12, ".safetensors"))
            continue;
        char a[4700], b[4700];
        snprintf(a, sizeof a, "%s/%s", src, nm);
        snprintf(b, sizeof b, "%s/%s", dst, nm);
        if (link(a, b))
            rc = kvt__fail(-errno, "%s: cannot link into the new generation: %s", a, strerror(errno));
    }
    closedir(d);
    return rc;
}

KVT_API int kvt_publish_begin(const char *dir, const kvt_store_identity *identity,
                              const kvt_publish_options *opts, kvt_publisher **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_publish_begin: out is NULL");
    *out = NULL;
    kvt_publisher *p = kvt__calloc(1, sizeof *p);
    if (!p)
        return kvt__fail(KVT_ENOMEM, "kvt_publish_begin: out of memory");
    p->dirfd = p->lockfd = -1;
    int rc = kvt__pub_where_init(&p->w, dir, identity, "kvt_publish_begin");
    if (rc) {
        publisher_free(p);
        return rc;
    }
    p->dir = p->w.dir;
    char path[4096];
    rc = mkdir_p1(dir);
    snprintf(path, sizeof path, "%s/%s", dir, KVT__PUB_GENERATIONS);
    if (!rc)
        rc = mkdir_p1(path);
    if (!rc && (p->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
        rc = kvt__fail(-errno, "%s: %s", dir, strerror(errno));
    if (!rc && (p->lockfd = openat(p->dirfd, KVT__PUB_LOCK, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644)) < 0)
        rc = kvt__fail(-errno, "%s/%s: %s", dir, KVT__PUB_LOCK, strerror(errno));
    while (!rc && flock(p->lockfd, LOCK_EX))
        if (errno != EINTR)
            rc = kvt__fail(-errno, "%s/%s: flock: %s", dir, KVT__PUB_LOCK, strerror(errno));
    if (rc) {
        publisher_free(p);
        return rc;
    }
    remove_leftovers(p->dirfd);
    static unsigned counter;
    snprintf(p->staging, sizeof p->staging, KVT__PUB_STAGING "%ld-%u", (long)getpid(),
             __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
    snprintf(p->staging_path, sizeof p->staging_path, "%s/%s", dir, p->staging);
    if (mkdirat(p->dirfd, p->staging, 0755)) {
        rc = kvt__fail(-errno, "%s: %s", p->staging_path, strerror(errno));
        p->staging[0] = '\0';
        publisher_free(p);
        return rc;
    }
    if (opts && opts->from_current)
        rc = link_current(p, identity);
    if (!rc)
        rc = kvt_store_open(p->staging_path, identity, NULL, &p->store);
    if (!rc) {
        const char *sd = kvt_store_dir(p->store);
        const char *slash = strrchr(sd, '/');
        snprintf(p->identity_dir, sizeof p->identity_dir, "%s", slash ? slash + 1 : sd);
    }
    if (rc) {
        publisher_free(p);
        return rc;
    }
    *out = p;
    return 0;
}

KVT_API int kvt_publish_put(kvt_publisher *p, const kvt_entry *e)
{
    if (!p || !e)
        return kvt__fail(KVT_EINVAL, "kvt_publish_put: bad arguments");
    return kvt_store_put(p->store, e);
}

KVT_API void kvt_publish_cold_tier(kvt_publisher *p, kvt_cold_tier *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (p)
        kvt_store_cold_tier(p->store, out);
}

KVT_API void kvt_publish_abort(kvt_publisher *p) { publisher_free(p); }

/* ---- commit ------------------------------------------------------------------------ */

typedef struct listing {
    json_t *shards;
    const char *identity_dir;
    int rc;
    uint64_t entries;
} listing;

static int list_cb(void *ctx, const kvt_store_shard_info *in)
{
    listing *l = ctx;
    if (strcmp(in->dir, l->identity_dir))
        return 0;
    if (in->type != 'e' && in->type != 'b') {
        l->rc = kvt__fail(KVT_EFORMAT, "staging: unexpected file %s/%s", in->dir, in->file);
        return 1;
    }
    if (in->status) {
        l->rc = kvt__fail(KVT_EFORMAT, "staging: shard %s/%s fails its own check (%s)", in->dir, in->file,
                          kvt_store_refusal_name((kvt_store_refusal)(in->status - 1)));
        return 1;
    }
    char path[200];
    snprintf(path, sizeof path, "%s/%s", in->dir, in->file);
    json_t *o = json_pack("{s:s, s:s, s:s, s:I, s:I}", "path", path, "type", in->type == 'e' ? "entry" : "block",
                          "ns", in->ns, "tokens", (json_int_t)in->n_tokens, "bytes", (json_int_t)in->bytes);
    if (!o || json_array_append_new(l->shards, o)) {
        l->rc = kvt__fail(KVT_ENOMEM, "manifest: out of memory");
        return 1;
    }
    l->entries += in->type == 'e';
    return 0;
}

/* Manifest order: entries (by ns, then tokens), then blocks, then IDENTITY. */
static int shard_rank(json_t *o)
{
    const char *t = json_string_value(json_object_get(o, "type"));
    return !strcmp(t, "entry") ? 0 : !strcmp(t, "block") ? 1 : 2;
}

static int cmp_shards(const void *a, const void *b)
{
    json_t *x = *(json_t *const *)a, *y = *(json_t *const *)b;
    int rx = shard_rank(x), ry = shard_rank(y);
    if (rx != ry)
        return rx - ry;
    int c = strcmp(json_string_value(json_object_get(x, "ns")), json_string_value(json_object_get(y, "ns")));
    if (c)
        return c;
    json_int_t tx = json_integer_value(json_object_get(x, "tokens")), ty = json_integer_value(json_object_get(y, "tokens"));
    if (tx != ty)
        return tx < ty ? -1 : 1;
    return strcmp(json_string_value(json_object_get(x, "path")), json_string_value(json_object_get(y, "path")));
}

/* Sorts the shard list in place (cmp_shards). @return 0 or KVT_ENOMEM. */
static int sort_shards(json_t *shards)
{
    size_t n = json_array_size(shards);
    json_t **v = n ? kvt__malloc(n * sizeof *v) : NULL;
    if (n && !v)
        return kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    for (size_t i = 0; i < n; i++)
        v[i] = json_incref(json_array_get(shards, i));
    qsort(v, n, sizeof *v, cmp_shards);
    json_array_clear(shards);
    int rc = 0;
    for (size_t i = 0; i < n; i++)
        if (json_array_append_new(shards, v[i]) && !rc)
            rc = kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    kvt__free(v);
    return rc;
}

/* fsyncs every listed file and records its SHA-256 (and exact size). */
static int hash_and_sync(kvt_publisher *p, json_t *shards)
{
    for (size_t i = 0; i < json_array_size(shards); i++) {
        json_t *o = json_array_get(shards, i);
        const char *rel = json_string_value(json_object_get(o, "path"));
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", p->staging_path, rel);
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0)
            return kvt__fail(-errno, "%s: %s", path, strerror(errno));
        char hex[65];
        uint64_t n = 0;
        int rc = kvt__pub_sha256_fd(fd, hex, &n);
        if (!rc && fsync(fd))
            rc = -errno;
        close(fd);
        if (rc)
            return kvt__fail(rc, "%s: %s", path, rc == KVT_ENOMEM ? "out of memory" : strerror(-rc));
        if (json_object_set_new(o, "sha256", json_string(hex)) || json_object_set_new(o, "bytes", json_integer((json_int_t)n)))
            return kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    }
    return 0;
}

/* One more than the largest id under generations/ and in CURRENT. */
static uint64_t next_id(const char *dir)
{
    char **ids = NULL, cur[KVT_PUBLISH_ID_LEN];
    int32_t n = 0;
    uint64_t max = 0;
    if (!kvt_publish_list(dir, &ids, &n, cur)) {
        for (int32_t i = 0; i < n; i++) {
            char *end;
            uint64_t v = strtoull(ids[i], &end, 10);
            if (!*end && v > max)
                max = v;
        }
        char *end;
        uint64_t v = cur[0] ? strtoull(cur, &end, 10) : 0;
        if (cur[0] && !*end && v > max)
            max = v;
    }
    kvt_publish_ids_free(ids, n);
    return max + 1;
}

/* Removes generation `id` when no reader holds it. @return 1 removed, 0 held, < 0 error. */
static int try_remove(kvt_publisher *p, const char *id)
{
    char rel[128], gone[128];
    snprintf(rel, sizeof rel, "%s/%s", KVT__PUB_GENERATIONS, id);
    int gfd = openat(p->dirfd, rel, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (gfd < 0)
        return -errno;
    if (flock(gfd, LOCK_EX | LOCK_NB)) {
        close(gfd);
        return 0; /* a reader holds it */
    }
    snprintf(gone, sizeof gone, KVT__PUB_REMOVING "%s", id);
    int rc = renameat(p->dirfd, rel, p->dirfd, gone) ? -errno : 0;
    close(gfd); /* a reader that opened it before the rename sees it moved and lets go */
    if (rc)
        return rc;
    kvt__pub_rmtree_at(p->dirfd, gone);
    return 1;
}

static void remove_old(kvt_publisher *p, int32_t keep, const char *newest, kvt_publish_result *res)
{
    char **ids = NULL;
    int32_t n = 0;
    if (kvt_publish_list(p->dir, &ids, &n, NULL))
        return;
    /* ids ascending: the last `keep` stay (the new one is the largest) */
    for (int32_t i = 0; i + keep < n; i++) {
        if (!strcmp(ids[i], newest))
            continue;
        int r = try_remove(p, ids[i]);
        if (r > 0)
            res->removed++;
        else
            res->kept_busy++;
    }
    kvt_publish_ids_free(ids, n);
}

static void iso_time(int64_t ms, char out[32])
{
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(out, 32, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

KVT_API int kvt_publish_commit(kvt_publisher *p, int32_t keep, kvt_publish_result *res)
{
    kvt_publish_result none;
    if (!res)
        res = &none;
    memset(res, 0, sizeof *res);
    if (!p)
        return kvt__fail(KVT_EINVAL, "kvt_publish_commit: publisher is NULL");
    if (keep < 1) {
        publisher_free(p);
        return kvt__fail(KVT_EINVAL, "kvt_publish_commit: keep %d is below 1", (int)keep);
    }
    int rc = kvt_store_flush(p->store);
    int crc = kvt_store_close(p->store);
    p->store = NULL;
    if (!rc)
        rc = crc;
    listing l = {.shards = json_array(), .identity_dir = p->identity_dir};
    json_t *man = NULL;
    if (!rc && !l.shards)
        rc = kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    if (!rc) {
        int wr = kvt_store_walk(p->staging_path, 0, list_cb, &l);
        rc = l.rc ? l.rc : wr;
    }
    if (!rc) {
        char ipath[128];
        snprintf(ipath, sizeof ipath, "%s/IDENTITY", p->identity_dir);
        json_t *o = json_pack("{s:s, s:s, s:s, s:I}", "path", ipath, "type", "identity", "ns", "", "tokens",
                              (json_int_t)0);
        if (!o || json_array_append_new(l.shards, o))
            rc = kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    }
    if (!rc)
        rc = sort_shards(l.shards);
    if (!rc)
        rc = hash_and_sync(p, l.shards);
    for (size_t i = 0; !rc && i < json_array_size(l.shards); i++) {
        res->shards++;
        res->bytes += (uint64_t)json_integer_value(json_object_get(json_array_get(l.shards, i), "bytes"));
    }
    res->entries = l.entries;
    char ddir[4200];
    snprintf(ddir, sizeof ddir, "%s/%s", p->staging_path, p->identity_dir);
    if (!rc && (rc = kvt__pub_fsync_path(ddir)))
        kvt__fail(rc, "%s: fsync: %s", ddir, strerror(-rc));
    uint64_t idn = next_id(p->dir);
    char id[KVT_PUBLISH_ID_LEN];
    snprintf(id, sizeof id, "%08" PRIu64, idn);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    int64_t ms = (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
    char created[32];
    iso_time(ms, created);
    if (!rc) {
        man = json_pack("{s:s, s:i, s:s, s:s, s:I, s:{s:s, s:s, s:s}, s:s, s:O, s:[s,s,s,s,s,s,s,s]}", "format",
                        KVT__PUB_FORMAT, "version", KVT__PUB_VERSION, "generation", id, "created", created,
                        "created_ms", (json_int_t)ms, "identity", "model_id", p->w.model_id, "config_fingerprint",
                        p->w.config_fingerprint, "tokenizer_hash", p->w.tokenizer_hash, "identity_dir", p->identity_dir,
                        "shards", l.shards, "required", "format", "version", "generation", "created", "created_ms",
                        "identity", "identity_dir", "shards");
        if (!man)
            rc = kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    }
    char *text = rc ? NULL : json_dumps(man, JSON_INDENT(1) | JSON_ENSURE_ASCII);
    if (!rc && !text)
        rc = kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    int sfd = -1;
    if (!rc && (sfd = openat(p->dirfd, p->staging, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
        rc = kvt__fail(-errno, "%s: %s", p->staging_path, strerror(errno));
    if (!rc)
        rc = write_durable(sfd, KVT__PUB_MANIFEST, text, strlen(text), "MANIFEST.json");
    if (!rc && fsync(sfd))
        rc = kvt__fail(-errno, "%s: fsync: %s", p->staging_path, strerror(errno));
    if (sfd >= 0)
        close(sfd);
    free(text);
    /* staging -> generations/<id>: an id another publisher took (none can:
     * we hold the lock, but a directory may have been made by hand) is skipped */
    char rel[128];
    for (int tries = 0; !rc; tries++) {
        snprintf(rel, sizeof rel, "%s/%s", KVT__PUB_GENERATIONS, id);
        if (!renameat(p->dirfd, p->staging, p->dirfd, rel))
            break;
        if ((errno != EEXIST && errno != ENOTEMPTY) || tries > 100) {
            rc = kvt__fail(-errno, "%s -> %s/%s: %s", p->staging_path, p->dir, rel, strerror(errno));
            break;
        }
        /* the manifest names the id: rewrite it for the next one */
        snprintf(id, sizeof id, "%08" PRIu64, ++idn);
        json_object_set_new(man, "generation", json_string(id));
        char *t2 = json_dumps(man, JSON_INDENT(1) | JSON_ENSURE_ASCII);
        int f2 = openat(p->dirfd, p->staging, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        rc = !t2 || f2 < 0 ? kvt__fail(KVT_ENOMEM, "manifest: cannot rewrite")
                           : write_durable(f2, KVT__PUB_MANIFEST, t2, strlen(t2), "MANIFEST.json");
        if (!rc && fsync(f2))
            rc = kvt__fail(-errno, "%s: fsync: %s", p->staging_path, strerror(errno));
        if (f2 >= 0)
            close(f2);
        free(t2);
    }
    json_decref(man);
    json_decref(l.shards);
    if (rc) {
        publisher_free(p); /* removes the staging directory */
        return rc;
    }
    p->staging[0] = '\0'; /* it is the generation now */
    char gdir[4096];
    snprintf(gdir, sizeof gdir, "%s/%s", p->dir, KVT__PUB_GENERATIONS);
    if ((rc = kvt__pub_fsync_path(gdir)))
        kvt__fail(rc, "%s: fsync: %s", gdir, strerror(-rc));
    /* CURRENT: temp file, fsync, rename, fsync DIR */
    char tmp[64], line[KVT_PUBLISH_ID_LEN + 2];
    snprintf(tmp, sizeof tmp, ".CURRENT.tmp.%ld", (long)getpid());
    snprintf(line, sizeof line, "%s\n", id);
    if (!rc)
        rc = write_durable(p->dirfd, tmp, line, strlen(line), "CURRENT");
    if (!rc && renameat(p->dirfd, tmp, p->dirfd, KVT__PUB_CURRENT)) {
        rc = kvt__fail(-errno, "%s/CURRENT: rename: %s", p->dir, strerror(errno));
        unlinkat(p->dirfd, tmp, 0);
    }
    if (!rc && fsync(p->dirfd))
        rc = kvt__fail(-errno, "%s: fsync: %s", p->dir, strerror(errno));
    if (!rc) {
        memcpy(res->generation, id, strlen(id) + 1);
        remove_old(p, keep, id, res);
    }
    publisher_free(p);
    return rc;
}
