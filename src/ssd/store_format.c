/*
 * store_format.c: the SSD tier's shard format. Writes safetensors files
 * crash-safely (temp name, pwrite through the injectable I/O layer, fsync,
 * rename) and reads their headers back with every field validated before use
 * (bounded header, offsets inside the payload, sorted, contiguous, byte counts
 * matching dtype x shape, totals matching the file size). Also the small
 * codecs the metadata needs (base64 tokens, hex).
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
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define KVT__IO_CHUNK (4u << 20) /* bytes per pwrite / read / hash step */
#define KVT__PAYLOAD_ALIGN 64    /* payload starts at a multiple of this */

static _Atomic uint64_t kvt__tmp_seq;

/* ---- small codecs -------------------------------------------------------- */

char *kvt__tokens_b64(const int32_t *tokens, int64_t n)
{
    size_t raw = (size_t)n * 4;
    uint8_t *le = kvt__malloc(raw ? raw : 1);
    char *out = kvt__malloc(4 * ((raw + 2) / 3) + 1);
    if (!le || !out) {
        kvt__free(le);
        kvt__free(out);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)tokens[i];
        le[4 * i] = (uint8_t)v;
        le[4 * i + 1] = (uint8_t)(v >> 8);
        le[4 * i + 2] = (uint8_t)(v >> 16);
        le[4 * i + 3] = (uint8_t)(v >> 24);
    }
    int len = raw ? EVP_EncodeBlock((unsigned char *)out, le, (int)raw) : 0;
    out[len] = '\0';
    kvt__free(le);
    return out;
}

int kvt__tokens_unb64(const char *s, int32_t **out, int64_t *n)
{
    *out = NULL;
    *n = 0;
    size_t len = strlen(s);
    if (len == 0)
        return 0;
    if (len % 4 || len > (size_t)1 << 30)
        return kvt__fail(KVT_EFORMAT, "tokens: base64 length %zu is not a multiple of 4", len);
    size_t pad = (s[len - 1] == '=') + (len > 1 && s[len - 2] == '=');
    size_t raw = len / 4 * 3 - pad;
    if (raw % 4)
        return kvt__fail(KVT_EFORMAT, "tokens: %zu bytes is not a whole number of int32", raw);
    uint8_t *buf = kvt__malloc(len / 4 * 3 + 1);
    int32_t *tok = kvt__malloc(raw ? raw : 1);
    if (!buf || !tok) {
        kvt__free(buf);
        kvt__free(tok);
        return kvt__fail(KVT_ENOMEM, "tokens: cannot allocate %zu bytes", raw);
    }
    int got = EVP_DecodeBlock(buf, (const unsigned char *)s, (int)len);
    if (got < 0 || (size_t)got != len / 4 * 3) {
        kvt__free(buf);
        kvt__free(tok);
        return kvt__fail(KVT_EFORMAT, "tokens: invalid base64");
    }
    for (size_t i = 0; i < raw / 4; i++)
        tok[i] = (int32_t)((uint32_t)buf[4 * i] | (uint32_t)buf[4 * i + 1] << 8 |
                           (uint32_t)buf[4 * i + 2] << 16 | (uint32_t)buf[4 * i + 3] << 24);
    kvt__free(buf);
    *out = tok;
    *n = (int64_t)(raw / 4);
    return 0;
}

/* ---- writer ---------------------------------------------------------------- */

static ssize_t default_pwrite(void *ctx, int fd, const void *buf, size_t n, off_t off)
{
    (void)ctx;
    return pwrite(fd, buf, n, off);
}
static int default_fsync(void *ctx, int fd)
{
    (void)ctx;
    return fsync(fd);
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

/* Orders tensors so that wider dtypes come first (keeps every tensor aligned to
 * its element size when the payload starts 64-byte aligned). */
static int32_t *write_order(const kvt__st_out *t, int32_t n)
{
    int32_t *ord = kvt__malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!ord)
        return NULL;
    int32_t k = 0;
    for (size_t w = 8; w >= 1; w /= 2)
        for (int32_t i = 0; i < n; i++)
            if (kvt_dtype_size(t[i].dtype) == w)
                ord[k++] = i;
    return ord;
}

static char *build_header(json_t *meta, const kvt__st_out *t, const int32_t *ord, int32_t n,
                          const char *sha_hex, const char *xxh_hex, uint64_t payload, size_t *len_out)
{
    char pb[32];
    snprintf(pb, sizeof pb, "%llu", (unsigned long long)payload);
    if (json_object_set_new(meta, "sha256", json_string(sha_hex)) ||
        json_object_set_new(meta, "xxh3", json_string(xxh_hex)) ||
        json_object_set_new(meta, "payload_bytes", json_string(pb)) ||
        json_object_set_new(meta, "format", json_string(KVT__SHARD_FORMAT)) ||
        json_object_set_new(meta, "version", json_string(KVT__SHARD_VERSION)))
        return NULL;
    json_t *root = json_object();
    if (!root || json_object_set(root, "__metadata__", meta)) {
        json_decref(root);
        return NULL;
    }
    uint64_t off = 0;
    for (int32_t k = 0; k < n; k++) {
        const kvt__st_out *x = &t[ord[k]];
        json_t *shape = json_array();
        for (int32_t d = 0; shape && d < x->ndim; d++)
            json_array_append_new(shape, json_integer(x->shape[d]));
        json_t *desc = json_pack("{s:s, s:o, s:[I,I]}", "dtype", kvt_dtype_name(x->dtype), "shape",
                                 shape, "data_offsets", (json_int_t)off, (json_int_t)(off + x->bytes));
        if (!desc || json_object_set_new(root, x->name, desc)) {
            json_decref(root);
            return NULL;
        }
        off += x->bytes;
    }
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!s)
        return NULL;
    size_t len = strlen(s);
    size_t padded = ((8 + len + KVT__PAYLOAD_ALIGN - 1) / KVT__PAYLOAD_ALIGN) * KVT__PAYLOAD_ALIGN - 8;
    char *h = kvt__malloc(padded + 1);
    if (h) {
        memcpy(h, s, len);
        memset(h + len, ' ', padded - len); /* safetensors allows trailing spaces */
        h[padded] = '\0';
        *len_out = padded;
    }
    free(s); /* jansson's allocator */
    return h;
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

/* SHA-256 of a shard's payload, computed on a second thread while the
 * writer thread copies the same (immutable) bytes into the file (and
 * computes their XXH3-128 as it goes), so a store
 * costs max(hash, write) instead of their sum on a 2-core machine; the hash
 * is only waited for in kvt__shard_seal, so a caller that begins shard k+1
 * before sealing shard k keeps both cores hashing while it writes. Small
 * payloads are hashed inline: a thread is not worth it below this size. */
#define KVT__HASH_THREAD_MIN (4u << 20)

typedef struct {
    EVP_MD_CTX *md;
    const kvt__st_out *t;
    const int32_t *ord;
    int32_t n;
} kvt__hash_job;

static void *hash_payload(void *arg)
{
    kvt__hash_job *j = arg;
    for (int32_t k = 0; k < j->n; k++) {
        const kvt__st_out *x = &j->t[j->ord[k]];
        EVP_DigestUpdate(j->md, x->data, x->bytes);
    }
    kvt__free(j); /* the job is the thread's own */
    return NULL;
}

/* Joins a running hash and frees what a begun shard holds besides its file. */
static void pending_release(kvt__pending_shard *ps)
{
    if (ps->hashing)
        pthread_join(ps->hasher, NULL); /* before md or the data can go away */
    ps->hashing = 0;
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
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io_opt, kvt__pending_shard *ps)
{
    memset(ps, 0, sizeof *ps);
    ps->fd = -1;
    ps->io = io_or_default(io_opt);
    snprintf(ps->tmp, sizeof ps->tmp, KVT__TMP_PREFIX "%ld.%llu.%s", (long)getpid(),
             (unsigned long long)atomic_fetch_add(&kvt__tmp_seq, 1), final_name);
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
    ps->ord = ps->t ? write_order(ps->t, n) : NULL;
    char zeros[65];
    memset(zeros, '0', 64);
    zeros[64] = '\0';
    size_t hlen = 0;
    char *header = ps->ord ? build_header(meta, ps->t, ps->ord, n, zeros, zeros + 32, payload, &hlen) : NULL;
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
    int fd = openat(dirfd, ps->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
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
    kvt__hash_job hj = {md, ps->t, ps->ord, n};
    int threaded = payload >= KVT__HASH_THREAD_MIN;
    kvt__hash_job *hjp = NULL;
    if (threaded && (hjp = kvt__malloc(sizeof *hjp))) {
        *hjp = hj;
        ps->hashing = pthread_create(&ps->hasher, NULL, hash_payload, hjp) == 0;
    }
    threaded = ps->hashing;
    if (!threaded) {
        kvt__free(hjp);
        hjp = NULL;
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
    if (ps->hashing)
        pthread_join(ps->hasher, NULL);
    ps->hashing = 0;
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
    char *header2 = build_header(ps->meta, ps->t, ps->ord, ps->n, sha_hex, xxh_hex, ps->payload, &hlen2);
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
        close(ps->fd);
        unlinkat(ps->dirfd, ps->tmp, 0);
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
    if (close(fd)) {
        rc = kvt__fail(-errno, "%s: close failed: %s", ps->path, strerror(errno));
        unlinkat(ps->dirfd, ps->tmp, 0);
        return rc;
    }
    if (renameat(ps->dirfd, ps->tmp, ps->dirfd, ps->final)) {
        rc = kvt__fail(-errno, "%s: rename to %s failed: %s", ps->path, ps->final, strerror(errno));
        unlinkat(ps->dirfd, ps->tmp, 0);
        return rc;
    }
    return 0;
fail:
    kvt__shard_abort(ps);
    return rc;
}

int kvt__shard_write(int dirfd, const char *dir_path, const char *final_name, json_t *meta,
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io, uint64_t *file_bytes)
{
    kvt__pending_shard ps;
    int rc = kvt__shard_begin(dirfd, dir_path, final_name, meta, t, n, io, &ps);
    if (!rc && !(rc = kvt__shard_commit(&ps, io)) && file_bytes)
        *file_bytes = ps.bytes;
    return rc;
}

/* ---- reader --------------------------------------------------------------- */

void kvt__shard_free(kvt__shard *sh)
{
    if (!sh)
        return;
    json_decref(sh->root);
    kvt__free(sh->t);
    memset(sh, 0, sizeof *sh);
}

const char *kvt__meta_str(const kvt__shard *sh, const char *key)
{
    return json_string_value(json_object_get(sh->meta, key));
}

static int refuse(int *reason, int r, int code, const char *path, const char *what)
{
    *reason = r;
    return kvt__fail(code, "%s: refused (%s): %s", path, kvt_store_refusal_name((kvt_store_refusal)r),
                     what);
}

static int pread_all(int fd, void *buf, size_t n, uint64_t off)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n, (off_t)off);
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

static int cmp_begin(const void *a, const void *b)
{
    const kvt__st_in *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

int kvt__shard_read_header(int fd, const char *path, uint64_t file_bytes, kvt__shard *out, int *reason)
{
    memset(out, 0, sizeof *out);
    char msg[160];
    if (file_bytes < 8)
        return refuse(reason, KVT_STORE_REFUSED_TRUNCATED, KVT_EFORMAT, path, "shorter than 8 bytes");
    uint8_t lenb[8];
    int rc = pread_all(fd, lenb, 8, 0);
    if (rc)
        return refuse(reason, KVT_STORE_REFUSED_IO, rc == KVT_EFORMAT ? KVT_EFORMAT : rc, path,
                      "cannot read the header length");
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)lenb[i] << (8 * i);
    if (hlen > KVT_STORE_MAX_HEADER) {
        snprintf(msg, sizeof msg, "header length %llu over the bound %u", (unsigned long long)hlen,
                 KVT_STORE_MAX_HEADER);
        return refuse(reason, KVT_STORE_REFUSED_HEADER_BOUND, KVT_EFORMAT, path, msg);
    }
    if (hlen < 2 || 8 + hlen > file_bytes) {
        snprintf(msg, sizeof msg, "header length %llu, file %llu bytes", (unsigned long long)hlen,
                 (unsigned long long)file_bytes);
        return refuse(reason, hlen < 2 ? KVT_STORE_REFUSED_MALFORMED : KVT_STORE_REFUSED_TRUNCATED,
                      KVT_EFORMAT, path, msg);
    }
    char *h = kvt__malloc(hlen);
    if (!h)
        return kvt__fail(KVT_ENOMEM, "%s: cannot allocate a %llu-byte header", path, (unsigned long long)hlen);
    rc = pread_all(fd, h, hlen, 8);
    if (rc) {
        kvt__free(h);
        return refuse(reason, KVT_STORE_REFUSED_IO, rc == KVT_EFORMAT ? KVT_EFORMAT : rc, path,
                      "cannot read the header");
    }
    json_error_t jerr;
    json_t *root = json_loadb(h, hlen, JSON_REJECT_DUPLICATES, &jerr);
    kvt__free(h);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        snprintf(msg, sizeof msg, "header is not a JSON object (%.100s)", root ? "not an object" : jerr.text);
        return refuse(reason, KVT_STORE_REFUSED_MALFORMED, KVT_EFORMAT, path, msg);
    }
    out->root = root;
    out->header_len = hlen;
    out->payload_off = 8 + hlen;
    out->file_bytes = file_bytes;
    out->meta = json_object_get(root, "__metadata__");
    const char *bad = NULL;
    if (!json_is_object(out->meta))
        bad = "no __metadata__ object";
    const char *k;
    json_t *v;
    if (!bad)
        json_object_foreach(out->meta, k, v) if (!json_is_string(v)) bad = "a __metadata__ value is not a string";
    const char *fmt = bad ? NULL : kvt__meta_str(out, "format");
    const char *ver = bad ? NULL : kvt__meta_str(out, "version");
    const char *sha = bad ? NULL : kvt__meta_str(out, "sha256");
    const char *pbs = bad ? NULL : kvt__meta_str(out, "payload_bytes");
    const char *xxh = bad ? NULL : kvt__meta_str(out, "xxh3");
    int v1 = ver && !strcmp(ver, KVT__SHARD_VERSION_V1);
    if (!bad && (!fmt || strcmp(fmt, KVT__SHARD_FORMAT) || !ver || (strcmp(ver, KVT__SHARD_VERSION) && !v1)))
        bad = "not a kvtier shard of version " KVT__SHARD_VERSION_V1 " or " KVT__SHARD_VERSION;
    if (!bad && (!sha || kvt__unhex(sha, out->sha, 32)))
        bad = "sha256 is not 64 hex digits";
    if (!bad && !v1 && (!xxh || kvt__unhex(xxh, out->xxh, 16)))
        bad = "xxh3 is not 32 hex digits";
    if (!bad)
        out->has_xxh = !v1;
    char *endp = NULL;
    unsigned long long pb = 0;
    if (!bad) {
        errno = 0;
        pb = pbs ? strtoull(pbs, &endp, 10) : 0;
        if (!pbs || !*pbs || *endp || errno)
            bad = "payload_bytes is not a number";
    }
    if (bad) {
        kvt__shard_free(out);
        return refuse(reason, KVT_STORE_REFUSED_MALFORMED, KVT_EFORMAT, path, bad);
    }
    out->payload_bytes = pb;
    if (out->payload_off + pb > file_bytes || out->payload_off + pb < pb) {
        snprintf(msg, sizeof msg, "file is %llu bytes, header declares %llu", (unsigned long long)file_bytes,
                 (unsigned long long)(out->payload_off + pb));
        kvt__shard_free(out);
        return refuse(reason, KVT_STORE_REFUSED_TRUNCATED, KVT_EFORMAT, path, msg);
    }
    if (out->payload_off + pb != file_bytes) {
        snprintf(msg, sizeof msg, "file is %llu bytes, longer than the declared %llu",
                 (unsigned long long)file_bytes, (unsigned long long)(out->payload_off + pb));
        kvt__shard_free(out);
        return refuse(reason, KVT_STORE_REFUSED_OFFSETS, KVT_EFORMAT, path, msg);
    }
    size_t nt = json_object_size(root) - 1;
    out->t = kvt__calloc(nt ? nt : 1, sizeof(kvt__st_in));
    if (!out->t) {
        kvt__shard_free(out);
        return kvt__fail(KVT_ENOMEM, "%s: cannot allocate %zu tensor descriptors", path, nt);
    }
    int r = KVT_STORE_REFUSED_MALFORMED;
    json_object_foreach(root, k, v)
    {
        if (!strcmp(k, "__metadata__"))
            continue;
        kvt__st_in *x = &out->t[out->n];
        x->name = k;
        json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
        json_t *offs = json_object_get(v, "data_offsets");
        if (!json_is_object(v) || !json_is_string(dt) || kvt_dtype_parse(json_string_value(dt), &x->dtype)) {
            bad = "a tensor has no known dtype";
            break;
        }
        if (!json_is_array(shape) || json_array_size(shape) > KVT_TENSOR_MAX_DIMS) {
            bad = "a tensor shape is not an array of at most 4 dims";
            break;
        }
        uint64_t elems = 1;
        x->ndim = (int32_t)json_array_size(shape);
        for (int32_t d = 0; d < x->ndim; d++) {
            json_t *e = json_array_get(shape, (size_t)d);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > ((json_int_t)1 << 40)) {
                bad = "a shape dimension is not a non-negative integer";
                break;
            }
            x->shape[d] = json_integer_value(e);
            if (x->shape[d] && elems > UINT64_MAX / (uint64_t)x->shape[d] / 8) {
                bad = "a tensor shape overflows";
                break;
            }
            elems *= (uint64_t)x->shape[d];
        }
        if (bad)
            break;
        if (!json_is_array(offs) || json_array_size(offs) != 2 || !json_is_integer(json_array_get(offs, 0)) ||
            !json_is_integer(json_array_get(offs, 1))) {
            bad = "data_offsets is not [begin, end]";
            break;
        }
        json_int_t b = json_integer_value(json_array_get(offs, 0)), e = json_integer_value(json_array_get(offs, 1));
        if (b < 0 || e < b || (uint64_t)e > pb) {
            bad = "data_offsets point outside the payload";
            r = KVT_STORE_REFUSED_OFFSETS;
            break;
        }
        x->begin = (uint64_t)b;
        x->end = (uint64_t)e;
        if (x->end - x->begin != elems * kvt_dtype_size(x->dtype)) {
            bad = "data_offsets do not match dtype x shape";
            break;
        }
        out->n++;
    }
    if (!bad) {
        qsort(out->t, (size_t)out->n, sizeof(kvt__st_in), cmp_begin);
        uint64_t at = 0;
        for (int32_t i = 0; i < out->n; i++) {
            if (out->t[i].begin != at) {
                bad = "tensors overlap or leave a hole";
                r = KVT_STORE_REFUSED_OFFSETS;
                break;
            }
            at = out->t[i].end;
        }
        if (!bad && at != pb) {
            bad = "tensors do not cover the payload";
            r = KVT_STORE_REFUSED_OFFSETS;
        }
    }
    if (bad) {
        kvt__shard_free(out);
        return refuse(reason, r, KVT_EFORMAT, path, bad);
    }
    return 0;
}

int kvt__shard_check(const kvt__shard *sh, const void *p, int strict, const char *path, int *reason)
{
    size_t n = (size_t)sh->payload_bytes;
    if (sh->has_xxh) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(p, n));
        if (memcmp(c.digest, sh->xxh, 16)) {
            *reason = KVT_STORE_REFUSED_CHECKSUM;
            return kvt__fail(KVT_ECORRUPT, "%s: refused (checksum): payload XXH3-128 differs from the header", path);
        }
    }
    if (strict || !sh->has_xxh) {
        uint8_t md[32];
        unsigned int len = 0;
        EVP_Digest(p, n, md, &len, EVP_sha256(), NULL);
        if (memcmp(md, sh->sha, 32)) {
            *reason = KVT_STORE_REFUSED_CHECKSUM;
            return kvt__fail(KVT_ECORRUPT, "%s: refused (checksum): payload SHA-256 differs from the header", path);
        }
    }
    return 0;
}
