/*
 * fuzz_util.c: the helpers of fuzz_util.h. Plain C, no libFuzzer
 * dependency, so the same code runs under the corpus replay driver.
 */
#include "fuzz_util.h"

#include "kvtier/buffer.h"

#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void fz_fail(const char *file, int line, const char *cond, const char *fmt, ...)
{
    fprintf(stderr, "%s:%d: invariant failed: %s: ", file, line, cond);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

const char *const fz_kind_names[FZ_KIND_COUNT] = {"kv", "rotating", "recurrent", "qkv", "attachment", "qkvc"};

/* ---- cursor ---------------------------------------------------------------- */

uint8_t fz_u8(fz_in *in)
{
    if (!in->n)
        return 0;
    in->n--;
    return *in->p++;
}
uint16_t fz_u16(fz_in *in) { return (uint16_t)(fz_u8(in) | fz_u8(in) << 8); }
uint32_t fz_u32(fz_in *in) { return (uint32_t)fz_u16(in) | (uint32_t)fz_u16(in) << 16; }
uint64_t fz_u64(fz_in *in) { return (uint64_t)fz_u32(in) | (uint64_t)fz_u32(in) << 32; }

const uint8_t *fz_take(fz_in *in, size_t n)
{
    if (in->n < n)
        return NULL;
    const uint8_t *p = in->p;
    in->p += n;
    in->n -= n;
    return p;
}

/* ---- files ------------------------------------------------------------------- */

int fz_memfile(const void *data, size_t n, char path[64])
{
    int fd = memfd_create("kvt-fuzz", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    const uint8_t *p = data;
    size_t left = n;
    while (left) {
        ssize_t w = write(fd, p, left);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        p += w;
        left -= (size_t)w;
    }
    snprintf(path, 64, "/proc/self/fd/%d", fd);
    return fd;
}

char *fz_cstr(const uint8_t *data, size_t n)
{
    char *s = malloc(n + 1);
    if (!s)
        abort();
    if (n)
        memcpy(s, data, n);
    s[n] = '\0';
    return s;
}

const char *fz_tmp_root(void)
{
    const char *e = getenv("KVT_FUZZ_TMP");
    if (e && *e)
        return e;
    return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
}

int fz_mkdtemp(char *out, size_t cap, const char *tag)
{
    if ((size_t)snprintf(out, cap, "%s/kvt-fuzz-%s-XXXXXX", fz_tmp_root(), tag) >= cap)
        return -1;
    return mkdtemp(out) ? 0 : -1;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void fz_rmtree(const char *path) { nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

int fz_write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    int ok = (n == 0 || fwrite(data, 1, n, f) == n);
    ok = (fclose(f) == 0) && ok;
    return ok ? 0 : -1;
}

int fz_append(uint8_t **buf, size_t *len, const void *src, size_t n)
{
    uint8_t *b = realloc(*buf, *len + n + 1);
    if (!b)
        return -1;
    if (n)
        memcpy(b + *len, src, n);
    *buf = b;
    *len += n;
    return 0;
}

static int put_le(uint8_t **buf, size_t *len, uint64_t v, int bytes)
{
    uint8_t b[8];
    for (int i = 0; i < bytes; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    return fz_append(buf, len, b, (size_t)bytes);
}

/* ---- cache states ------------------------------------------------------------- */

#define FZ_SIDE_MAX 32
static kvt_buf *fz_side[FZ_SIDE_MAX]; /* data of owner-less tensors */
static int fz_n_side;

void fz_state_free(kvt_cache_state *st)
{
    for (int32_t i = 0; st->tensors && i < st->n_tensors; i++)
        kvt_buf_release(st->tensors[i].owner);
    free(st->tensors);
    memset(st, 0, sizeof *st);
    for (int i = 0; i < fz_n_side; i++)
        kvt_buf_release(fz_side[i]);
    fz_n_side = 0;
}

int fz_state_read(fz_in *in, kvt_cache_state *st, int *sel)
{
    memset(st, 0, sizeof *st);
    *sel = fz_u8(in) % FZ_KIND_COUNT;
    snprintf(st->kind, sizeof st->kind, "%s", fz_kind_names[*sel]);
    st->offset = (int64_t)fz_u64(in);
    st->min_offset = (int64_t)fz_u64(in);
    st->n_params = fz_u8(in) % (KVT_CACHE_PARAMS_MAX + 2); /* one past the limit too */
    for (int32_t i = 0; i < st->n_params && i < KVT_CACHE_PARAMS_MAX; i++)
        st->params[i] = (int64_t)fz_u64(in);
    int32_t nt = fz_u8(in) % 17;
    st->tensors = calloc((size_t)(nt ? nt : 1), sizeof *st->tensors);
    if (!st->tensors)
        return -1;
    for (int32_t i = 0; i < nt; i++) {
        kvt_tensor *t = &st->tensors[i];
        size_t nl = fz_u8(in);
        const uint8_t *name = fz_take(in, nl);
        if (!name)
            break;
        memcpy(t->name, name, nl < sizeof t->name ? nl : sizeof t->name);
        if (nl < sizeof t->name)
            t->name[nl] = '\0';
        t->dtype = (kvt_dtype)(fz_u8(in) % (KVT_DTYPE_COUNT + 1));
        t->ndim = fz_u8(in) % (KVT_TENSOR_MAX_DIMS + 2);
        uint64_t elems = 1;
        for (int32_t d = 0; d < t->ndim && d < KVT_TENSOR_MAX_DIMS; d++) {
            t->shape[d] = (int32_t)fz_u32(in); /* negative dims stay possible */
            elems = t->shape[d] < 0 || elems > (1ull << 40) ? ~0ull : elems * (uint64_t)t->shape[d];
        }
        t->tok_begin = (int64_t)fz_u64(in);
        t->tok_end = (int64_t)fz_u64(in);
        int mode = fz_u8(in);
        size_t es = kvt_dtype_size(t->dtype);
        uint64_t bytes = (mode & 1) ? fz_u32(in) : (es && elems != ~0ull ? elems * es : 0);
        if (bytes > FZ_TENSOR_MAX)
            break;
        t->bytes = (size_t)bytes;
        size_t extra = (mode & 2) ? 64 : 0;
        kvt_buf *b = NULL;
        if (kvt_buf_new(t->bytes + extra, &b))
            break;
        uint8_t *dst = (uint8_t *)kvt_buf_data(b) + extra / 2;
        size_t have = in->n < t->bytes ? in->n : t->bytes;
        if (t->bytes)
            memset(kvt_buf_data(b), 0, t->bytes + extra);
        if (have)
            memcpy(dst, fz_take(in, have), have);
        t->data = dst;
        if ((mode & 4) && fz_n_side < FZ_SIDE_MAX) {
            fz_side[fz_n_side++] = b; /* no owner: the data stays valid until fz_state_free */
        } else {
            t->owner = b;
        }
        st->n_tensors = i + 1;
    }
    return 0;
}

int fz_state_write(const kvt_cache_state *st, int sel, uint8_t **buf, size_t *len)
{
    int rc = put_le(buf, len, (uint64_t)sel, 1);
    rc |= put_le(buf, len, (uint64_t)st->offset, 8);
    rc |= put_le(buf, len, (uint64_t)st->min_offset, 8);
    rc |= put_le(buf, len, (uint64_t)st->n_params, 1);
    for (int32_t i = 0; i < st->n_params; i++)
        rc |= put_le(buf, len, (uint64_t)st->params[i], 8);
    rc |= put_le(buf, len, (uint64_t)st->n_tensors, 1);
    for (int32_t i = 0; i < st->n_tensors; i++) {
        const kvt_tensor *t = &st->tensors[i];
        size_t nl = strlen(t->name);
        rc |= put_le(buf, len, nl, 1);
        rc |= fz_append(buf, len, t->name, nl);
        rc |= put_le(buf, len, (uint64_t)t->dtype, 1);
        rc |= put_le(buf, len, (uint64_t)t->ndim, 1);
        for (int32_t d = 0; d < t->ndim; d++)
            rc |= put_le(buf, len, (uint64_t)t->shape[d], 4);
        rc |= put_le(buf, len, (uint64_t)t->tok_begin, 8);
        rc |= put_le(buf, len, (uint64_t)t->tok_end, 8);
        rc |= put_le(buf, len, 0, 1);
        rc |= fz_append(buf, len, t->data, t->bytes);
    }
    return rc ? -1 : 0;
}

int fz_record_write(uint8_t **buf, size_t *len, int mode, const void *data, uint32_t n)
{
    int rc = put_le(buf, len, (uint64_t)mode, 1);
    rc |= put_le(buf, len, n, 4);
    rc |= fz_append(buf, len, data, n);
    return rc ? -1 : 0;
}

/* ---- directory trees ------------------------------------------------------------ */

int fz_tree_write(uint8_t **buf, size_t *len, int kind, const char *path, const void *data, uint32_t n)
{
    size_t pl = strlen(path);
    if (pl > 255)
        return -1;
    int rc = put_le(buf, len, (uint64_t)kind, 1);
    rc |= put_le(buf, len, pl, 1);
    rc |= fz_append(buf, len, path, pl);
    rc |= put_le(buf, len, n, 4);
    rc |= fz_append(buf, len, data, n);
    return rc ? -1 : 0;
}

/* 1 when rel is a path fz_tree_build may create under root: components
 * non-empty, not "." or "..", and every parent either absent (made here as a
 * directory) or a real directory (never a link or a file). */
static int tree_path_ok(const char *root, char *rel)
{
    if (!rel[0] || rel[0] == '/')
        return 0;
    for (char *c = rel;;) {
        char *e = strchr(c, '/');
        size_t cl = e ? (size_t)(e - c) : strlen(c);
        if (cl == 0 || (cl == 1 && c[0] == '.') || (cl == 2 && c[0] == '.' && c[1] == '.'))
            return 0;
        if (!e)
            return 1;
        *e = '\0';
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", root, rel);
        struct stat st;
        int ok = lstat(p, &st) == 0 ? S_ISDIR(st.st_mode) : mkdir(p, 0755) == 0;
        *e = '/';
        if (!ok)
            return 0;
        c = e + 1;
    }
}

int fz_tree_build(fz_in *in, const char *root, int max)
{
    int made = 0;
    for (int i = 0; i < max && in->n; i++) {
        int kind = fz_u8(in) % 3;
        size_t pl = fz_u8(in);
        const uint8_t *pp = fz_take(in, pl);
        uint32_t n = fz_u32(in);
        if (n > in->n)
            n = (uint32_t)in->n;
        const uint8_t *d = fz_take(in, n);
        if (!pp || memchr(pp, 0, pl))
            continue;
        char rel[260], path[1300];
        memcpy(rel, pp, pl);
        rel[pl] = '\0';
        if (!tree_path_ok(root, rel))
            continue;
        snprintf(path, sizeof path, "%s/%s", root, rel);
        struct stat st;
        if (lstat(path, &st) == 0) /* first node of a path wins */
            continue;
        int ok;
        if (kind == FZ_TREE_DIR) {
            ok = mkdir(path, 0755) == 0;
        } else if (kind == FZ_TREE_LINK) {
            char *target = fz_cstr(d, n);
            ok = !(n && memchr(d, 0, n)) && symlink(target, path) == 0;
            free(target);
        } else {
            ok = fz_write_file(path, d, n) == 0;
        }
        made += ok;
    }
    return made;
}
