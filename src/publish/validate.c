/*
 * validate.c: reading a published generation as untrusted input. Every
 * check of kvt_publish_validate lives here, each failing with its own
 * kvt_publish_refusal; the read-only tier and `kvtier cache inspect|verify`
 * call it, and nothing here ever writes to the publication directory.
 */
#include "internal.h"
#include "publish_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <openssl/evp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const REFUSAL_NAMES[KVT_PUBLISH_REFUSED_COUNT] = {
    "ok",     "absolute-path", "dotdot",   "symlink", "header-bound",     "identity",  "hash",  "size",
    "tokens", "missing",       "partial",  "json",    "unknown-required", "malformed", "shard", "unlisted",
    "io",
};

KVT_API const char *kvt_publish_refusal_name(kvt_publish_refusal r)
{
    return (unsigned)r < KVT_PUBLISH_REFUSED_COUNT ? REFUSAL_NAMES[r] : "unknown";
}

int kvt__pub_where_init(kvt__pub_where *w, const char *dir, const kvt_store_identity *id, const char *fn)
{
    memset(w, 0, sizeof *w);
    if (!dir || !*dir || !id || !id->model_id || !id->config_fingerprint || !id->tokenizer_hash)
        return kvt__fail(KVT_EINVAL, "%s: a directory and a whole identity are required", fn);
    if (strlen(dir) > 3000)
        return kvt__fail(KVT_EINVAL, "%s: directory path over 3000 bytes", fn);
    w->dir = kvt__strdup(dir);
    w->model_id = kvt__strdup(id->model_id);
    w->config_fingerprint = kvt__strdup(id->config_fingerprint);
    w->tokenizer_hash = kvt__strdup(id->tokenizer_hash);
    if (!w->dir || !w->model_id || !w->config_fingerprint || !w->tokenizer_hash) {
        kvt__pub_where_clear(w);
        return kvt__fail(KVT_ENOMEM, "%s: out of memory", fn);
    }
    w->identity = (kvt_store_identity){w->model_id, w->config_fingerprint, w->tokenizer_hash};
    return 0;
}

void kvt__pub_where_clear(kvt__pub_where *w)
{
    kvt__free(w->dir);
    kvt__free(w->model_id);
    kvt__free(w->config_fingerprint);
    kvt__free(w->tokenizer_hash);
    memset(w, 0, sizeof *w);
}

int kvt__pub_id_valid(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n < 1 || n > KVT_PUBLISH_ID_LEN - 1)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

int kvt__pub_read_current(const char *dir, char *id)
{
    char path[4096];
    id[0] = '\0';
    snprintf(path, sizeof path, "%s/%s", dir, KVT__PUB_CURRENT);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        if (errno == ENOENT)
            return kvt__fail(KVT_ENOTFOUND, "%s: no CURRENT (nothing published yet)", dir);
        return kvt__fail(-errno, "%s: %s", path, strerror(errno));
    }
    char buf[80];
    ssize_t r = read(fd, buf, sizeof buf - 1);
    int e = errno;
    close(fd);
    if (r < 0)
        return kvt__fail(-e, "%s: %s", path, strerror(e));
    buf[r] = '\0';
    while (r > 0 && (buf[r - 1] == '\n' || buf[r - 1] == '\r'))
        buf[--r] = '\0';
    if (!kvt__pub_id_valid(buf))
        return kvt__fail(KVT_EFORMAT, "%s holds no valid generation id (1-32 characters of [0-9A-Za-z_-])", path);
    memcpy(id, buf, (size_t)r + 1);
    return 0;
}

int kvt__pub_sha256_fd(int fd, char hex[65], uint64_t *bytes)
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(md);
        return KVT_ENOMEM;
    }
    enum { CHUNK = 1 << 20 };
    unsigned char *buf = kvt__malloc(CHUNK);
    if (!buf) {
        EVP_MD_CTX_free(md);
        return KVT_ENOMEM;
    }
    uint64_t total = 0;
    off_t off = 0;
    int rc = 0;
    for (;;) {
        ssize_t r = pread(fd, buf, CHUNK, off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            rc = -errno;
            break;
        }
        if (r == 0)
            break;
        EVP_DigestUpdate(md, buf, (size_t)r);
        off += r;
        total += (uint64_t)r;
    }
    unsigned char d[32];
    unsigned dl = 0;
    EVP_DigestFinal_ex(md, d, &dl);
    EVP_MD_CTX_free(md);
    kvt__free(buf);
    if (rc)
        return rc;
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", d[i]);
    if (bytes)
        *bytes = total;
    return 0;
}

/* ---- the report ----------------------------------------------------------------- */

static const int REFUSAL_CODE[KVT_PUBLISH_REFUSED_COUNT] = {
    [KVT_PUBLISH_REFUSED_HASH] = KVT_ECORRUPT,
    [KVT_PUBLISH_REFUSED_IDENTITY] = KVT_EIDENTITY,
};

/* Records the refusal in out and as the thread's error. @return its code. */
static int refuse(kvt_publish_report *out, kvt_publish_refusal r, const char *fmt, ...) KVT_PRINTF(3, 4);
static int refuse(kvt_publish_report *out, kvt_publish_refusal r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->detail, sizeof out->detail, fmt, ap);
    va_end(ap);
    out->refusal = r;
    int code = REFUSAL_CODE[r] ? REFUSAL_CODE[r] : KVT_EFORMAT;
    return kvt__fail(code, "generation %s refused (%s): %s", out->generation, kvt_publish_refusal_name(r),
                     out->detail);
}

/* ---- the manifest ----------------------------------------------------------------- */

/* Fields a manifest may list under "required": the ones this reader knows. */
static const char *const KNOWN_FIELDS[] = {"format", "version",      "generation", "created",
                                           "created_ms", "identity", "identity_dir", "shards"};

static int known_field(const char *s)
{
    for (size_t i = 0; i < sizeof KNOWN_FIELDS / sizeof KNOWN_FIELDS[0]; i++)
        if (!strcmp(s, KNOWN_FIELDS[i]))
            return 1;
    return 0;
}

/* One listed shard. */
typedef struct mshard {
    const char *path, *ns, *sha;
    char type;
    uint64_t bytes;
    int64_t tokens;
    int seen, hashed;
    int32_t n_layers, n_tensors;
} mshard;

typedef struct vstate {
    kvt_publish_report *out;
    const char *gpath;
    mshard *s;
    size_t n;
    int rc;
} vstate;

static int is_hex(const char *s, size_t n)
{
    if (strlen(s) != n)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

static const char *str_field(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static int copy_str(char *dst, size_t cap, const char *s)
{
    size_t n = strlen(s);
    if (n >= cap)
        return -1;
    memcpy(dst, s, n + 1);
    return 0;
}

/* Reads and parses MANIFEST.json of gfd into *root. */
static int load_manifest(int gfd, kvt_publish_report *out, json_t **root)
{
    *root = NULL;
    int fd = openat(gfd, KVT__PUB_MANIFEST, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        if (errno == ENOENT)
            return refuse(out, KVT_PUBLISH_REFUSED_PARTIAL, "it has no %s: not completely published",
                          KVT__PUB_MANIFEST);
        if (errno == ELOOP)
            return refuse(out, KVT_PUBLISH_REFUSED_SYMLINK, "%s is a symbolic link", KVT__PUB_MANIFEST);
        return refuse(out, KVT_PUBLISH_REFUSED_IO, "%s: %s", KVT__PUB_MANIFEST, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return refuse(out, KVT_PUBLISH_REFUSED_PARTIAL, "%s is not a regular file", KVT__PUB_MANIFEST);
    }
    if ((uint64_t)st.st_size > KVT_PUBLISH_MAX_MANIFEST) {
        close(fd);
        return refuse(out, KVT_PUBLISH_REFUSED_HEADER_BOUND, "%s is %lld bytes, over the bound of %u bytes",
                      KVT__PUB_MANIFEST, (long long)st.st_size, KVT_PUBLISH_MAX_MANIFEST);
    }
    size_t n = (size_t)st.st_size;
    char *buf = kvt__malloc(n + 1);
    if (!buf) {
        close(fd);
        return kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    if (got != n) {
        kvt__free(buf);
        return refuse(out, KVT_PUBLISH_REFUSED_IO, "%s: short read", KVT__PUB_MANIFEST);
    }
    json_error_t err;
    *root = json_loadb(buf, n, JSON_REJECT_DUPLICATES, &err);
    kvt__free(buf);
    if (!*root)
        return refuse(out, KVT_PUBLISH_REFUSED_JSON, "%s is not valid JSON: line %d: %s", KVT__PUB_MANIFEST,
                      err.line, err.text);
    return 0;
}

/* The manifest's top-level fields into out; the shard list into v. */
static int parse_manifest(json_t *root, const char *id, const kvt_publish_validate_opts *o, vstate *v)
{
    kvt_publish_report *out = v->out;
    if (!json_is_object(root))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "the manifest is not a JSON object");
    json_t *req = json_object_get(root, "required");
    if (req && !json_is_array(req))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"required\" is not an array");
    for (size_t i = 0; req && i < json_array_size(req); i++) {
        json_t *f = json_array_get(req, i);
        if (!json_is_string(f))
            return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"required\"[%zu] is not a string", i);
        if (!known_field(json_string_value(f)))
            return refuse(out, KVT_PUBLISH_REFUSED_UNKNOWN_REQUIRED,
                          "the manifest requires field \"%s\", which this reader does not know",
                          json_string_value(f));
    }
    const char *fmt = str_field(root, "format");
    if (!fmt || strcmp(fmt, KVT__PUB_FORMAT))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"format\" is %s%s%s, not \"%s\"", fmt ? "\"" : "",
                      fmt ? fmt : "missing", fmt ? "\"" : "", KVT__PUB_FORMAT);
    json_t *ver = json_object_get(root, "version");
    if (!json_is_integer(ver) || json_integer_value(ver) != KVT__PUB_VERSION)
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"version\" is not %d (this reader's)", KVT__PUB_VERSION);
    const char *gen = str_field(root, "generation");
    if (!gen || strcmp(gen, id))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"generation\" is %s, not the directory's name %s",
                      gen ? gen : "missing", id);
    json_t *cms = json_object_get(root, "created_ms");
    const char *created = str_field(root, "created");
    if (!json_is_integer(cms) || !created || copy_str(out->created, sizeof out->created, created))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"created\" or \"created_ms\" is missing or ill-typed");
    out->created_ms = (int64_t)json_integer_value(cms);
    json_t *ident = json_object_get(root, "identity");
    const char *mid = str_field(ident, "model_id"), *cfp = str_field(ident, "config_fingerprint"),
               *tok = str_field(ident, "tokenizer_hash");
    if (!json_is_object(ident) || !mid || !cfp || !tok || copy_str(out->model_id, sizeof out->model_id, mid) ||
        copy_str(out->config_fingerprint, sizeof out->config_fingerprint, cfp) ||
        copy_str(out->tokenizer_hash, sizeof out->tokenizer_hash, tok))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED,
                      "\"identity\" needs model_id, config_fingerprint and tokenizer_hash strings of at most 1024 bytes");
    const char *idir = str_field(root, "identity_dir");
    if (!idir || !is_hex(idir, 32))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"identity_dir\" is not 32 hex digits");
    memcpy(out->identity_dir, idir, 33);
    if (o->identity && (strcmp(o->identity->model_id, mid) || strcmp(o->identity->config_fingerprint, cfp) ||
                        strcmp(o->identity->tokenizer_hash, tok)))
        return refuse(out, KVT_PUBLISH_REFUSED_IDENTITY,
                      "published for model %s (config %.16s..., tokenizer %.24s), not for model %s (config %.16s..., "
                      "tokenizer %.24s)",
                      mid, cfp, tok, o->identity->model_id, o->identity->config_fingerprint,
                      o->identity->tokenizer_hash);
    json_t *shards = json_object_get(root, "shards");
    if (!json_is_array(shards))
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "\"shards\" is not an array");
    v->n = json_array_size(shards);
    v->s = v->n ? kvt__calloc(v->n, sizeof *v->s) : NULL;
    if (v->n && !v->s)
        return kvt__fail(KVT_ENOMEM, "manifest: out of memory");
    for (size_t i = 0; i < v->n; i++) {
        json_t *sj = json_array_get(shards, i);
        mshard *m = &v->s[i];
        const char *type = str_field(sj, "type");
        json_t *b = json_object_get(sj, "bytes"), *t = json_object_get(sj, "tokens");
        m->path = str_field(sj, "path");
        m->ns = str_field(sj, "ns");
        m->sha = str_field(sj, "sha256");
        if (!json_is_object(sj) || !m->path || !type || !m->ns || !m->sha || !json_is_integer(b) ||
            !json_is_integer(t) || json_integer_value(b) < 0 || json_integer_value(t) < 0)
            return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED,
                          "shards[%zu] needs path, type, ns, sha256 strings and non-negative bytes and tokens", i);
        m->type = !strcmp(type, "entry") ? 'e' : !strcmp(type, "block") ? 'b' : !strcmp(type, "identity") ? 'i' : 0;
        if (!m->type)
            return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shards[%zu]: type \"%s\" is not entry, block or identity",
                          i, type);
        if (!is_hex(m->sha, 64))
            return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shards[%zu]: sha256 is not 64 hex digits", i);
        m->bytes = (uint64_t)json_integer_value(b);
        m->tokens = (int64_t)json_integer_value(t);
    }
    return 0;
}

/* ---- the shards -------------------------------------------------------------------- */

/* The path rules: relative, no "..", exactly <identity_dir>/<name>, and no
 * component a symbolic link. */
static int check_path(int gfd, const char *gpath, const mshard *m, vstate *v)
{
    kvt_publish_report *out = v->out;
    const char *p = m->path;
    size_t len = strlen(p);
    if (len == 0 || len > 1024)
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shard path \"%.64s\" is empty or over 1024 bytes", p);
    if (p[0] == '/')
        return refuse(out, KVT_PUBLISH_REFUSED_ABSOLUTE_PATH, "shard path \"%s\" is absolute", p);
    int comps = 0;
    for (const char *c = p; *c;) {
        const char *e = strchr(c, '/');
        size_t cl = e ? (size_t)(e - c) : strlen(c);
        if (cl == 2 && c[0] == '.' && c[1] == '.')
            return refuse(out, KVT_PUBLISH_REFUSED_DOTDOT, "shard path \"%s\" contains \"..\"", p);
        if (cl == 0 || (cl == 1 && c[0] == '.'))
            return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shard path \"%s\" has an empty or \".\" component", p);
        comps++;
        c += cl + (e ? 1 : 0);
        if (e && !*c)
            return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shard path \"%s\" ends with '/'", p);
    }
    /* every component, outermost first: a symbolic link anywhere is refused,
     * saying whether it leads outside the generation */
    char sub[1100];
    for (size_t i = 0; i <= len; i++) {
        if (p[i] != '/' && p[i] != '\0')
            continue;
        memcpy(sub, p, i);
        sub[i] = '\0';
        struct stat st;
        if (fstatat(gfd, sub, &st, AT_SYMLINK_NOFOLLOW)) {
            if (errno == ENOENT || errno == ENOTDIR)
                return refuse(out, KVT_PUBLISH_REFUSED_PARTIAL, "listed shard %s is missing", p);
            return refuse(out, KVT_PUBLISH_REFUSED_IO, "%s: %s", p, strerror(errno));
        }
        if (S_ISLNK(st.st_mode)) {
            char full[4096], real[PATH_MAX], greal[PATH_MAX];
            snprintf(full, sizeof full, "%s/%s", gpath, p);
            int inside = 0;
            if (realpath(full, real) && realpath(gpath, greal)) {
                size_t gl = strlen(greal);
                inside = !strncmp(real, greal, gl) && real[gl] == '/';
            }
            if (!inside)
                return refuse(out, KVT_PUBLISH_REFUSED_SYMLINK,
                              "shard path %s resolves through the symbolic link %s to outside the generation", p, sub);
            return refuse(out, KVT_PUBLISH_REFUSED_SYMLINK,
                          "shard path %s goes through the symbolic link %s (never followed)", p, sub);
        }
    }
    if (comps != 2 || strncmp(p, out->identity_dir, 32) || p[32] != '/')
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shard path %s is not <identity_dir>/<file>", p);
    const char *name = p + 33;
    char want = !strcmp(name, "IDENTITY") ? 'i' : name[0];
    if (want != m->type)
        return refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shard %s is listed with the wrong type", p);
    return 0;
}

static int check_file(int gfd, const mshard *cm, int hashes, vstate *v)
{
    mshard *m = (mshard *)cm;
    kvt_publish_report *out = v->out;
    int fd = openat(gfd, m->path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return errno == ENOENT ? refuse(out, KVT_PUBLISH_REFUSED_PARTIAL, "listed shard %s is missing", m->path)
                               : refuse(out, KVT_PUBLISH_REFUSED_IO, "%s: %s", m->path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return refuse(out, KVT_PUBLISH_REFUSED_PARTIAL, "listed shard %s is not a regular file", m->path);
    }
    if ((uint64_t)st.st_size != m->bytes) {
        close(fd);
        return refuse(out, KVT_PUBLISH_REFUSED_SIZE, "shard %s is %lld bytes, the manifest says %llu", m->path,
                      (long long)st.st_size, (unsigned long long)m->bytes);
    }
    if (hashes) {
        char hex[65];
        uint64_t n = 0;
        int rc = kvt__pub_sha256_fd(fd, hex, &n);
        if (rc) {
            close(fd);
            return rc == KVT_ENOMEM ? kvt__fail(rc, "manifest: out of memory")
                                    : refuse(out, KVT_PUBLISH_REFUSED_IO, "%s: %s", m->path, strerror(-rc));
        }
        if (n != m->bytes) {
            close(fd);
            return refuse(out, KVT_PUBLISH_REFUSED_SIZE, "shard %s changed size while read", m->path);
        }
        if (strcmp(hex, m->sha)) {
            close(fd);
            return refuse(out, KVT_PUBLISH_REFUSED_HASH, "shard %s has SHA-256 %.16s..., the manifest says %.16s...",
                          m->path, hex, m->sha);
        }
        m->hashed = 1;
    }
    close(fd);
    return 0;
}

static mshard *listed(vstate *v, const char *dir, const char *file)
{
    for (size_t i = 0; i < v->n; i++) {
        const char *p = v->s[i].path;
        size_t dl = strlen(dir);
        if (!strncmp(p, dir, dl) && p[dl] == '/' && !strcmp(p + dl + 1, file))
            return &v->s[i];
    }
    return NULL;
}

/* kvt_store_walk's callback: every file the store would read. */
static int walk_cb(void *ctx, const kvt_store_shard_info *in)
{
    vstate *v = ctx;
    kvt_publish_report *out = v->out;
    if (in->type == 'l') {
        v->rc = refuse(out, KVT_PUBLISH_REFUSED_SYMLINK, "identity directory %s is a symbolic link", in->dir);
        return 1;
    }
    mshard *m = listed(v, in->dir, in->file);
    if (!m) {
        v->rc = refuse(out, KVT_PUBLISH_REFUSED_UNLISTED, "%s/%s is not listed in the manifest", in->dir, in->file);
        return 1;
    }
    if (in->status) {
        int r = in->status - 1;
        kvt_publish_refusal pr = r == KVT_STORE_REFUSED_HEADER_BOUND  ? KVT_PUBLISH_REFUSED_HEADER_BOUND
                                 : r == KVT_STORE_REFUSED_IDENTITY    ? KVT_PUBLISH_REFUSED_IDENTITY
                                 : r == KVT_STORE_REFUSED_MISSING_BLOCK ? KVT_PUBLISH_REFUSED_PARTIAL
                                 : r == KVT_STORE_REFUSED_IO          ? KVT_PUBLISH_REFUSED_IO
                                 : r == KVT_STORE_REFUSED_SYMLINK     ? KVT_PUBLISH_REFUSED_SYMLINK
                                                                      : KVT_PUBLISH_REFUSED_SHARD;
        v->rc = refuse(out, pr, "shard %s: refused by the store's header check (%s)", m->path,
                       kvt_store_refusal_name((kvt_store_refusal)r));
        return 1;
    }
    if (in->type != m->type) {
        v->rc = refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shard %s is listed with the wrong type", m->path);
        return 1;
    }
    if (in->n_tokens != m->tokens) {
        v->rc = refuse(out, KVT_PUBLISH_REFUSED_TOKENS, "shard %s covers %lld tokens, the manifest says %lld", m->path,
                       (long long)in->n_tokens, (long long)m->tokens);
        return 1;
    }
    if (strcmp(in->ns, m->ns)) {
        v->rc = refuse(out, KVT_PUBLISH_REFUSED_TOKENS, "shard %s holds ns \"%s\", the manifest says \"%s\"", m->path,
                       in->ns, m->ns);
        return 1;
    }
    m->seen = 1;
    m->n_layers = in->n_layers;
    m->n_tensors = in->n_tensors;
    return 0;
}

int kvt__pub_validate_at(int gfd, const char *gpath, const char *id, const kvt_publish_validate_opts *o,
                         kvt_publish_report *out)
{
    kvt_publish_validate_opts none = {0};
    if (!o)
        o = &none;
    json_t *root = NULL;
    vstate v = {.out = out, .gpath = gpath};
    int rc = load_manifest(gfd, out, &root);
    if (!rc)
        rc = parse_manifest(root, id, o, &v);
    for (size_t i = 0; !rc && i < v.n; i++) {
        for (size_t j = 0; j < i; j++)
            if (!strcmp(v.s[j].path, v.s[i].path)) {
                rc = refuse(out, KVT_PUBLISH_REFUSED_MALFORMED, "shard %s is listed twice", v.s[i].path);
                break;
            }
        if (!rc)
            rc = check_path(gfd, gpath, &v.s[i], &v);
        if (!rc)
            rc = check_file(gfd, &v.s[i], o->hashes, &v);
    }
    if (!rc) {
        int wr = kvt_store_walk(gpath, 0, walk_cb, &v);
        if (v.rc)
            rc = v.rc;
        else if (wr)
            rc = refuse(out, KVT_PUBLISH_REFUSED_IO, "the generation cannot be read: %s", kvt_last_error());
    }
    for (size_t i = 0; !rc && i < v.n; i++)
        if (v.s[i].type != 'i' && !v.s[i].seen)
            rc = refuse(out, KVT_PUBLISH_REFUSED_PARTIAL,
                        "listed shard %s is not in a store directory (its IDENTITY is missing)", v.s[i].path);
    int has_identity = 0;
    for (size_t i = 0; i < v.n; i++)
        has_identity |= v.s[i].type == 'i';
    if (!rc && v.n && !has_identity)
        rc = refuse(out, KVT_PUBLISH_REFUSED_PARTIAL, "the manifest lists no IDENTITY file");
    if (!rc) {
        for (size_t i = 0; i < v.n; i++) {
            mshard *m = &v.s[i];
            out->shards++;
            out->bytes += m->bytes;
            out->entries += m->type == 'e';
            out->blocks += m->type == 'b';
            if (m->type == 'e' && m->tokens > out->tokens_max)
                out->tokens_max = m->tokens;
            if (o->on_shard) {
                kvt_publish_shard_info si = {.path = m->path, .type = m->type, .ns = m->ns, .bytes = m->bytes,
                                             .tokens = m->tokens, .sha256 = m->sha, .n_layers = m->n_layers,
                                             .n_tensors = m->n_tensors, .hash_checked = m->hashed};
                o->on_shard(o->ctx, &si);
            }
        }
    }
    kvt__free(v.s);
    json_decref(root);
    return rc;
}

KVT_API int kvt_publish_validate(const char *dir, const char *generation, const kvt_publish_validate_opts *opts,
                                 kvt_publish_report *out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_publish_validate: out is NULL");
    memset(out, 0, sizeof *out);
    if (!dir || !*dir)
        return kvt__fail(KVT_EINVAL, "kvt_publish_validate: no directory");
    char id[KVT_PUBLISH_ID_LEN];
    if (generation) {
        if (!kvt__pub_id_valid(generation))
            return kvt__fail(KVT_EINVAL, "kvt_publish_validate: \"%.40s\" is not a generation id", generation);
        memcpy(id, generation, strlen(generation) + 1);
    } else {
        int rc = kvt__pub_read_current(dir, id);
        if (rc == KVT_EFORMAT)
            return refuse(out, KVT_PUBLISH_REFUSED_MISSING, "%s", kvt_last_error());
        if (rc)
            return rc;
    }
    memcpy(out->generation, id, strlen(id) + 1);
    char gpath[4096];
    snprintf(gpath, sizeof gpath, "%s/%s/%s", dir, KVT__PUB_GENERATIONS, id);
    struct stat st;
    if (lstat(gpath, &st)) {
        if (errno == ENOENT || errno == ENOTDIR)
            return refuse(out, KVT_PUBLISH_REFUSED_MISSING, "%s names generation %s, which does not exist (%s)",
                          generation ? "the caller" : "CURRENT", id, gpath);
        return refuse(out, KVT_PUBLISH_REFUSED_IO, "%s: %s", gpath, strerror(errno));
    }
    if (S_ISLNK(st.st_mode))
        return refuse(out, KVT_PUBLISH_REFUSED_SYMLINK, "%s is a symbolic link", gpath);
    if (!S_ISDIR(st.st_mode))
        return refuse(out, KVT_PUBLISH_REFUSED_PARTIAL, "%s is not a directory", gpath);
    int gfd = open(gpath, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (gfd < 0)
        return refuse(out, KVT_PUBLISH_REFUSED_IO, "%s: %s", gpath, strerror(errno));
    int rc = kvt__pub_validate_at(gfd, gpath, id, opts, out);
    close(gfd);
    return rc;
}

static int cmp_ids(const void *a, const void *b)
{
    const char *x = *(const char *const *)a, *y = *(const char *const *)b;
    size_t lx = strlen(x), ly = strlen(y);
    return lx != ly ? (lx < ly ? -1 : 1) : strcmp(x, y); /* numeric order for decimal ids */
}

KVT_API int kvt_publish_list(const char *dir, char ***ids, int32_t *n, char *current)
{
    if (!dir || !ids || !n)
        return kvt__fail(KVT_EINVAL, "kvt_publish_list: bad arguments");
    *ids = NULL;
    *n = 0;
    if (current) {
        current[0] = '\0';
        char id[KVT_PUBLISH_ID_LEN];
        if (!kvt__pub_read_current(dir, id))
            memcpy(current, id, strlen(id) + 1);
        kvt__clear_error();
    }
    char gpath[4096];
    snprintf(gpath, sizeof gpath, "%s/%s", dir, KVT__PUB_GENERATIONS);
    int gfd = open(gpath, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (gfd < 0) {
        if (errno == ENOENT)
            return 0;
        return kvt__fail(-errno, "%s: %s", gpath, strerror(errno));
    }
    DIR *d = fdopendir(gfd);
    if (!d) {
        close(gfd);
        return kvt__fail(KVT_ENOMEM, "kvt_publish_list: out of memory");
    }
    char **v = NULL;
    int32_t cnt = 0, cap = 0;
    int rc = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!kvt__pub_id_valid(de->d_name))
            continue;
        if (cnt == cap) {
            int32_t nc = cap ? cap * 2 : 16;
            char **nv = kvt__realloc(v, (size_t)nc * sizeof *nv);
            if (!nv) {
                rc = KVT_ENOMEM;
                break;
            }
            v = nv;
            cap = nc;
        }
        if (!(v[cnt] = kvt__strdup(de->d_name))) {
            rc = KVT_ENOMEM;
            break;
        }
        cnt++;
    }
    closedir(d);
    if (rc) {
        kvt_publish_ids_free(v, cnt);
        return kvt__fail(rc, "kvt_publish_list: out of memory");
    }
    if (cnt)
        qsort(v, (size_t)cnt, sizeof *v, cmp_ids);
    *ids = v;
    *n = cnt;
    return 0;
}

KVT_API void kvt_publish_ids_free(char **ids, int32_t n)
{
    for (int32_t i = 0; ids && i < n; i++)
        kvt__free(ids[i]);
    kvt__free(ids);
}
