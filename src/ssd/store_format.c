/*
 * store_format.c: the SSD tier's shard files. Writes safetensors shards
 * (src/tier/codec.h builds and validates their headers) crash-safely: temp
 * name, pwrite through the injectable I/O layer, fsync, rename; and reads a
 * file's header back, validated before use.
 * Every shard carries two checksums of its payload: XXH3-128 (checked on
 * every restore) and SHA-256 (checked by strict restores and store verify).
 * It never reads tensor bytes except to hash them, never trusts a header
 * field it has not checked, and never leaves a temp file behind on failure.
 */
#include "internal.h"
#include "store_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define KVT__IO_CHUNK (4u << 20) /* bytes per pwrite / read / hash step */

static _Atomic uint64_t kvt__tmp_seq;

/* ---- writer ---------------------------------------------------------------- */

static ssize_t default_pwrite(void *ctx, int fd, const void *buf, size_t n, off_t off)
{
    (void)ctx;
    return kvt__io_pwrite(fd, buf, n, off);
}
static int default_fsync(void *ctx, int fd)
{
    (void)ctx;
    return kvt__io_fsync(fd);
}

/* Writes all of buf at off through the I/O layer; a call that makes no
 * progress is an I/O error (a short write followed by nothing). */
static int write_all(const kvt_store_io *io, int fd, const void *buf, size_t n, uint64_t off,
                     const char *path)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = io->pwrite_fn(io->ctx, fd, p, n, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            int e = errno ? errno : EIO;
            return kvt__fail(-e, "%s: write failed at offset %llu: %s", path, (unsigned long long)off,
                             strerror(e));
        }
        if (w == 0)
            return kvt__fail(KVT_EIO, "%s: write made no progress at offset %llu", path,
                             (unsigned long long)off);
        p += w;
        off += (uint64_t)w;
        n -= (size_t)w;
    }
    return 0;
}

static kvt_store_io io_or_default(const kvt_store_io *io_opt)
{
    kvt_store_io io = {default_pwrite, default_fsync, NULL};
    if (io_opt)
        io = *io_opt;
    if (!io.pwrite_fn)
        io.pwrite_fn = default_pwrite;
    if (!io.fsync_fn)
        io.fsync_fn = default_fsync;
    return io;
}

/* SHA-256 of a shard's payload, computed as a foreground operation of the
 * I/O worker while the calling thread copies the same (immutable) bytes
 * into the file (and computes their XXH3-128 as it goes), so a store costs
 * max(hash, write) instead of their sum on a 2-core machine; the hash is
 * only waited for in kvt__shard_seal, so a caller that begins shard k+1
 * before sealing shard k keeps both cores hashing while it writes. Seal
 * runs a hash that has not started yet itself (kvt_io_run_here), so a
 * writer never waits for a worker thread. Small payloads are hashed
 * inline: an operation is not worth it below this size; so is a payload
 * the worker's queue refuses. */
#define KVT__HASH_OP_MIN (4u << 20)

typedef struct kvt__hash_job {
    EVP_MD_CTX *md;
    const kvt__st_out *t;
    const int32_t *ord;
    int32_t n;
} kvt__hash_job;

static int hash_payload(void *task, void **result)
{
    (void)result;
    kvt__hash_job *j = task;
    for (int32_t k = 0; k < j->n; k++) {
        const kvt__st_out *x = &j->t[j->ord[k]];
        EVP_DigestUpdate(j->md, x->data, x->bytes);
    }
    return 0;
}

static void hash_free(void *task, void *result)
{
    (void)result;
    kvt__free(task);
}

/* The key of a hash operation: the temp file's unique sequence number (a
 * hash is never shared: two shards of the same name may differ). */
static kvt_io_key hash_key(uint64_t seq) { return (kvt_io_key){seq ^ 0x5a256ull, (uint64_t)getpid()}; }

/* Waits for a hash operation (running it here if it has not started). */
static void hash_wait(kvt__pending_shard *ps)
{
    if (!ps->hash)
        return;
    kvt_io_run_here(ps->hash);
    kvt_io_wait(ps->hash, UINT64_MAX, NULL, NULL);
    kvt_io_ticket_release(ps->hash);
    ps->hash = NULL;
}

/* Waits for a running hash and frees what a begun shard holds besides its file. */
static void pending_release(kvt__pending_shard *ps)
{
    hash_wait(ps); /* before md or the data can go away */
    EVP_MD_CTX_free(ps->md);
    ps->md = NULL;
    if (ps->xx)
        XXH3_freeState(ps->xx);
    ps->xx = NULL;
    kvt__free(ps->t);
    ps->t = NULL;
    kvt__free(ps->ord);
    ps->ord = NULL;
    json_decref(ps->meta);
    ps->meta = NULL;
}

int kvt__shard_begin(int dirfd, const char *dir_path, const char *final_name, json_t *meta,
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io_opt, kvt_io *worker,
                     kvt__pending_shard *ps)
{
    memset(ps, 0, sizeof *ps);
    ps->fd = -1;
    ps->io = io_or_default(io_opt);
    uint64_t seq = atomic_fetch_add(&kvt__tmp_seq, 1);
    snprintf(ps->tmp, sizeof ps->tmp, KVT__TMP_PREFIX "%ld.%llu.%s", (long)getpid(), (unsigned long long)seq,
             final_name);
    snprintf(ps->final, sizeof ps->final, "%s", final_name);
    snprintf(ps->path, sizeof ps->path, "%s/%s", dir_path, ps->tmp);
    ps->dirfd = dirfd;
    const char *path = ps->path;

    uint64_t payload = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t es = kvt_dtype_size(t[i].dtype);
        if (!es)
            return kvt__fail(KVT_EINVAL, "%s: tensor %s has an unknown dtype", final_name, t[i].name);
        payload += t[i].bytes;
    }
    /* the tensor list is copied: the hash may outlive the caller's array */
    ps->t = kvt__malloc(sizeof *ps->t * (size_t)(n ? n : 1));
    if (ps->t)
        memcpy(ps->t, t, sizeof *ps->t * (size_t)n);
    ps->n = n;
    ps->ord = ps->t ? kvt__shard_order(ps->t, n) : NULL;
    char zeros[65];
    memset(zeros, '0', 64);
    zeros[64] = '\0';
    size_t hlen = 0;
    char *header = ps->ord ? kvt__shard_header(meta, ps->t, ps->ord, n, zeros, zeros + 32, payload, &hlen) : NULL;
    if (!header) {
        pending_release(ps);
        return kvt__fail(KVT_ENOMEM, "%s: cannot build the shard header", final_name);
    }
    kvt__free(header); /* only its length is needed now: seal rebuilds it */
    json_incref(meta);
    ps->meta = meta;
    ps->hlen = hlen;
    ps->payload = payload;
    int rc = 0;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    ps->md = md;
    XXH3_state_t *xx = XXH3_createState();
    ps->xx = xx;
    int fd = kvt__io_openat(dirfd, ps->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = kvt__fail(-errno, "%s: cannot create: %s", path, strerror(errno));
        pending_release(ps);
        return rc;
    }
    ps->fd = fd;
    if (!md || !xx || !EVP_DigestInit_ex(md, EVP_sha256(), NULL) || XXH3_128bits_reset(xx) != XXH_OK) {
        rc = kvt__fail(KVT_ENOMEM, "%s: cannot start SHA-256 / XXH3-128", path);
        goto fail;
    }
    /* Payload first (hashed beside the writes, see hash_payload), then, in
     * kvt__shard_seal, the header with the real hash over a same-length
     * placeholder. The hash may still run when this returns. */
    int threaded = 0;
    kvt__hash_job *hj = worker && payload >= KVT__HASH_OP_MIN ? kvt__malloc(sizeof *hj) : NULL;
    if (hj) {
        *hj = (kvt__hash_job){md, ps->t, ps->ord, n};
        kvt_io_op op = {.kind = KVT_IO_KIND_HASH,
                        .key = hash_key(seq),
                        .priority = KVT_IO_FOREGROUND, /* a writer waits for it */
                        .bytes = payload,
                        .run = hash_payload,
                        .free_fn = hash_free,
                        .task = hj};
        kvt_io_ticket *tk = NULL;
        if (kvt_io_submit(worker, &op, &tk) == 0) {
            ps->hash = tk;
            threaded = 1;
        } else {
            kvt__free(hj); /* refused (queue full, too big): hashed inline below */
        }
    }
    uint64_t off = 8 + hlen;
    for (int32_t k = 0; k < n && !rc; k++) {
        const kvt__st_out *x = &ps->t[ps->ord[k]];
        const uint8_t *p = x->data;
        size_t left = x->bytes;
        while (left) {
            size_t c = left < KVT__IO_CHUNK ? left : KVT__IO_CHUNK;
            /* XXH3-128 here, beside the writes: the SHA-256 thread (when
             * there is one) is the slower of the two */
            if (!threaded)
                EVP_DigestUpdate(md, p, c);
            XXH3_128bits_update(xx, p, c);
            if ((rc = write_all(&ps->io, fd, p, c, off, path)))
                break;
            p += c;
            off += c;
            left -= c;
        }
    }
    if (rc)
        goto fail;
    ps->bytes = 8 + hlen + payload;
    /* hashed inline: nothing to overlap, the header goes out now (same
     * write order as an unpipelined shard) */
    return threaded ? 0 : kvt__shard_seal(ps);
fail:
    kvt__shard_abort(ps);
    return rc;
}

int kvt__shard_seal(kvt__pending_shard *ps)
{
    if (ps->sealed)
        return 0;
    if (ps->fd < 0)
        return kvt__fail(KVT_EINVAL, "%s: shard was aborted", ps->path);
    hash_wait(ps);
    const char *path = ps->path;
    int rc = 0;
    uint8_t sha[32];
    char sha_hex[65];
    EVP_DigestFinal_ex(ps->md, sha, NULL);
    kvt__hex(sha, 32, sha_hex);
    XXH128_canonical_t xc;
    XXH128_canonicalFromHash(&xc, XXH3_128bits_digest(ps->xx));
    char xxh_hex[33];
    kvt__hex(xc.digest, 16, xxh_hex);
    size_t hlen2 = 0;
    char *header2 = kvt__shard_header(ps->meta, ps->t, ps->ord, ps->n, sha_hex, xxh_hex, ps->payload, &hlen2);
    if (!header2 || hlen2 != ps->hlen) {
        kvt__free(header2);
        rc = kvt__fail(KVT_ENOMEM, "%s: cannot rebuild the shard header", path);
        goto fail;
    }
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (uint8_t)((uint64_t)ps->hlen >> (8 * i));
    rc = write_all(&ps->io, ps->fd, lenb, 8, 0, path);
    if (!rc)
        rc = write_all(&ps->io, ps->fd, header2, ps->hlen, 8, path);
    kvt__free(header2);
    if (rc)
        goto fail;
    /* start writeback now: the device works while the next shard is hashed */
    sync_file_range(ps->fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    pending_release(ps);
    ps->sealed = 1;
    return 0;
fail:
    kvt__shard_abort(ps);
    return rc;
}

void kvt__shard_abort(kvt__pending_shard *ps)
{
    pending_release(ps);
    if (ps->fd >= 0) {
        kvt__io_close(ps->fd);
        kvt__io_unlinkat(ps->dirfd, ps->tmp, 0);
    }
    ps->fd = -1;
}

int kvt__shard_commit(kvt__pending_shard *ps, const kvt_store_io *io_opt)
{
    kvt_store_io io = io_or_default(io_opt);
    int rc = kvt__shard_seal(ps);
    if (rc)
        return rc;
    if (io.fsync_fn(io.ctx, ps->fd)) {
        int e = errno ? errno : EIO;
        rc = kvt__fail(-e, "%s: fsync failed: %s", ps->path, strerror(e));
        goto fail;
    }
    struct stat st;
    if (fstat(ps->fd, &st) || (uint64_t)st.st_size != ps->bytes) {
        rc = kvt__fail(KVT_EIO, "%s: file is %lld bytes after writing, expected %llu", ps->path,
                       (long long)st.st_size, (unsigned long long)ps->bytes);
        goto fail;
    }
    int fd = ps->fd;
    ps->fd = -1;
    if (kvt__io_close(fd)) {
        rc = kvt__fail(-errno, "%s: close failed: %s", ps->path, strerror(errno));
        kvt__io_unlinkat(ps->dirfd, ps->tmp, 0);
        return rc;
    }
    if (kvt__io_renameat(ps->dirfd, ps->tmp, ps->dirfd, ps->final)) {
        rc = kvt__fail(-errno, "%s: rename to %s failed: %s", ps->path, ps->final, strerror(errno));
        kvt__io_unlinkat(ps->dirfd, ps->tmp, 0);
        return rc;
    }
    return 0;
fail:
    kvt__shard_abort(ps);
    return rc;
}

int kvt__shard_write(int dirfd, const char *dir_path, const char *final_name, json_t *meta,
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io, kvt_io *worker,
                     uint64_t *file_bytes)
{
    kvt__pending_shard ps;
    int rc = kvt__shard_begin(dirfd, dir_path, final_name, meta, t, n, io, worker, &ps);
    if (!rc && !(rc = kvt__shard_commit(&ps, io)) && file_bytes)
        *file_bytes = ps.bytes;
    return rc;
}

/* ---- reader --------------------------------------------------------------- */

static int pread_all(int fd, void *buf, size_t n, uint64_t off)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t r = kvt__io_pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        if (r == 0)
            return KVT_EFORMAT; /* EOF */
        p += r;
        off += (uint64_t)r;
        n -= (size_t)r;
    }
    return 0;
}

int kvt__shard_read_header(int fd, const char *path, uint64_t file_bytes, kvt__shard *out, int *reason)
{
    memset(out, 0, sizeof *out);
    if (file_bytes < 8)
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_TRUNCATED, KVT_EFORMAT, path, "shorter than 8 bytes");
    uint8_t lenb[8];
    int rc = pread_all(fd, lenb, 8, 0);
    if (rc)
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_IO, rc == KVT_EFORMAT ? KVT_EFORMAT : rc, path,
                                 "cannot read the header length");
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)lenb[i] << (8 * i);
    if ((rc = kvt__shard_check_len(hlen, file_bytes, path, reason)))
        return rc;
    char *h = kvt__malloc(hlen);
    if (!h)
        return kvt__fail(KVT_ENOMEM, "%s: cannot allocate a %llu-byte header", path, (unsigned long long)hlen);
    rc = pread_all(fd, h, hlen, 8);
    if (rc) {
        kvt__free(h);
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_IO, rc == KVT_EFORMAT ? KVT_EFORMAT : rc, path,
                                 "cannot read the header");
    }
    rc = kvt__shard_parse_header(h, hlen, file_bytes, path, out, reason);
    kvt__free(h);
    return rc;
}

int kvt__shard_open(int dirfd, const char *dir, const char *name, kvt__shard *sh, int *fd_out, int *reason)
{
    memset(sh, 0, sizeof *sh); /* freeable whatever fails below (the scan frees it) */
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = kvt__io_openat(dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) {
        *reason = KVT_STORE_REFUSED_IO;
        return kvt__fail(errno == ENOENT ? KVT_ENOTFOUND : -errno, "%s: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st)) {
        int e = errno;
        kvt__io_close(fd);
        *reason = KVT_STORE_REFUSED_IO;
        return kvt__fail(-e, "%s: %s", path, strerror(e));
    }
    int rc = kvt__shard_read_header(fd, path, (uint64_t)st.st_size, sh, reason);
    if (rc) {
        kvt__io_close(fd);
        return rc;
    }
    *fd_out = fd;
    return 0;
}
