/*
 * io_shim.c: the library's file-system calls, with the faults a test arms
 * and the record of durability events (io_shim.h). Disarmed, each wrapper
 * costs one relaxed atomic load over its system call.
 */
#include "io_shim.h"

#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_EVENTS 4096

static atomic_int g_armed;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t g_ops;
static int64_t g_fail_at;
static int g_err, g_short, g_record;
static void (*g_before)(void *, kvt__io_op);
static void *g_before_ctx;
static char g_path_has[512];
static atomic_llong g_calls, g_failures;
static kvt__io_event *g_ev; /* (MAX_EVENTS) while recording */
static int g_n_ev;

void kvt__io_arm(const kvt__io_fault *f)
{
    pthread_mutex_lock(&g_mu);
    atomic_store(&g_armed, 0);
    atomic_store(&g_calls, 0);
    atomic_store(&g_failures, 0);
    g_n_ev = 0;
    g_ops = f && f->ops ? f->ops : KVT_IO_ALL_OPS;
    g_fail_at = f ? f->fail_at : 0;
    g_err = f && f->err ? f->err : EIO;
    g_short = f ? f->short_write : 0;
    snprintf(g_path_has, sizeof g_path_has, "%s", f && f->path_has ? f->path_has : "");
    g_record = f ? f->record : 0;
    g_before = f ? f->before : NULL;
    g_before_ctx = f ? f->before_ctx : NULL;
    if (g_record && !g_ev && !(g_ev = kvt__calloc(MAX_EVENTS, sizeof *g_ev)))
        g_record = 0; /* out of memory: nothing recorded (kvt__io_events says 0) */
    atomic_store(&g_armed, f != NULL);
    pthread_mutex_unlock(&g_mu);
}

void kvt__io_disarm(void)
{
    pthread_mutex_lock(&g_mu);
    atomic_store(&g_armed, 0);
    pthread_mutex_unlock(&g_mu);
}

int64_t kvt__io_calls(void) { return atomic_load(&g_calls); }
int64_t kvt__io_failures(void) { return atomic_load(&g_failures); }

int kvt__io_events(kvt__io_event *out, int cap)
{
    pthread_mutex_lock(&g_mu);
    int n = g_n_ev;
    for (int i = 0; i < n && i < cap && g_ev; i++)
        out[i] = g_ev[i];
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* The path an fd is open on ("" when unknown). */
static void fd_path(int fd, char *out, size_t cap)
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t k = readlink(link, out, cap - 1);
    out[k > 0 ? k : 0] = '\0';
}

/* The path `name` relative to dirfd names. */
static void at_path(int dirfd, const char *name, char *out, size_t cap)
{
    if (!name) {
        out[0] = '\0';
        return;
    }
    if (name[0] == '/' || dirfd == AT_FDCWD) {
        snprintf(out, cap, "%s", name);
        return;
    }
    char dir[512];
    fd_path(dirfd, dir, sizeof dir);
    size_t n = strlen(dir);
    if (n + 1 >= cap) {
        snprintf(out, cap, "%s", name);
        return;
    }
    memcpy(out, dir, n);
    out[n] = '/';
    snprintf(out + n + 1, cap - n - 1, "%s", name);
}

/* A call about to be made, when armed. */
typedef struct call {
    int counted;     /* armed and of a counted op */
    int need_path;   /* path-matching or recording: the path is resolved */
    int fail;        /* errno to fail with, 0 none */
    int short_write; /* fail as a short write */
    char path[512];
} call;

/* Decides whether the call fails. `fd` >= 0 names the file by descriptor,
 * else (dirfd, name). */
static void gate(call *c, kvt__io_op op, int fd, int dirfd, const char *name)
{
    c->counted = c->need_path = c->fail = c->short_write = 0;
    c->path[0] = '\0';
    if (!atomic_load_explicit(&g_armed, memory_order_relaxed))
        return;
    pthread_mutex_lock(&g_mu);
    int armed = atomic_load(&g_armed) && (g_ops & (1u << op));
    int64_t fail_at = g_fail_at;
    int err = g_err, shrt = g_short;
    char has[512];
    snprintf(has, sizeof has, "%s", g_path_has);
    c->need_path = armed && (has[0] || g_record);
    void (*before)(void *, kvt__io_op) = g_before;
    void *before_ctx = g_before_ctx;
    pthread_mutex_unlock(&g_mu);
    if (!armed)
        return;
    if (before)
        before(before_ctx, op);
    c->counted = 1;
    if (c->need_path) {
        if (fd >= 0)
            fd_path(fd, c->path, sizeof c->path);
        else
            at_path(dirfd, name, c->path, sizeof c->path);
    }
    int64_t k = atomic_fetch_add(&g_calls, 1) + 1;
    if ((fail_at > 0 && k == fail_at) || (has[0] && strstr(c->path, has))) {
        atomic_fetch_add(&g_failures, 1);
        c->fail = err;
        c->short_write = shrt && (op == KVT_IO_WRITE || op == KVT_IO_PWRITE || op == KVT_IO_SEND);
    }
}

static void record(const call *c, kvt__io_op op, int failed, int fd, const char *path2)
{
    if (!c->counted || !c->need_path)
        return;
    pthread_mutex_lock(&g_mu);
    if (g_record && g_ev) {
        int skip = 0;
        if ((op == KVT_IO_WRITE || op == KVT_IO_PWRITE) && g_n_ev > 0) {
            const kvt__io_event *last = &g_ev[(g_n_ev - 1) < MAX_EVENTS ? g_n_ev - 1 : MAX_EVENTS - 1];
            skip = (last->op == KVT_IO_WRITE || last->op == KVT_IO_PWRITE) && !strcmp(last->path, c->path);
        }
        if (!skip) {
            if (g_n_ev < MAX_EVENTS) {
                kvt__io_event *e = &g_ev[g_n_ev];
                memset(e, 0, sizeof *e);
                e->op = op;
                e->failed = failed;
                snprintf(e->path, sizeof e->path, "%s", c->path);
                if (path2)
                    snprintf(e->path2, sizeof e->path2, "%s", path2);
                struct stat st;
                e->is_dir = op == KVT_IO_FSYNC && fd >= 0 && !fstat(fd, &st) && S_ISDIR(st.st_mode);
            }
            g_n_ev++;
        }
    }
    pthread_mutex_unlock(&g_mu);
}

/* Fails the call: -1 with errno set. */
static int fail_with(int err)
{
    errno = err;
    return -1;
}

int kvt__io_net_gate(kvt__io_op op, const char *peer, int *short_write)
{
    call c;
    gate(&c, op, -1, AT_FDCWD, peer ? peer : "");
    if (short_write)
        *short_write = c.short_write;
    return c.fail;
}

int kvt__io_open(const char *path, int flags, mode_t mode) { return kvt__io_openat(AT_FDCWD, path, flags, mode); }

int kvt__io_openat(int dirfd, const char *path, int flags, mode_t mode)
{
    call c;
    gate(&c, KVT_IO_OPEN, -1, dirfd, path);
    int fd = c.fail ? fail_with(c.fail) : openat(dirfd, path, flags, mode);
    if (flags & O_CREAT)
        record(&c, KVT_IO_OPEN, fd < 0, -1, NULL);
    return fd;
}

ssize_t kvt__io_read(int fd, void *buf, size_t n)
{
    call c;
    gate(&c, KVT_IO_READ, fd, -1, NULL);
    return c.fail ? fail_with(c.fail) : read(fd, buf, n);
}

ssize_t kvt__io_pread(int fd, void *buf, size_t n, off_t off)
{
    call c;
    gate(&c, KVT_IO_PREAD, fd, -1, NULL);
    return c.fail ? fail_with(c.fail) : pread(fd, buf, n, off);
}

ssize_t kvt__io_write(int fd, const void *buf, size_t n)
{
    call c;
    gate(&c, KVT_IO_WRITE, fd, -1, NULL);
    ssize_t r;
    if (c.short_write && n > 1)
        r = write(fd, buf, n / 2);
    else
        r = c.fail ? fail_with(c.fail) : write(fd, buf, n);
    record(&c, KVT_IO_WRITE, r < 0, fd, NULL);
    return r;
}

ssize_t kvt__io_pwrite(int fd, const void *buf, size_t n, off_t off)
{
    call c;
    gate(&c, KVT_IO_PWRITE, fd, -1, NULL);
    ssize_t r;
    if (c.short_write && n > 1)
        r = pwrite(fd, buf, n / 2, off);
    else
        r = c.fail ? fail_with(c.fail) : pwrite(fd, buf, n, off);
    record(&c, KVT_IO_PWRITE, r < 0, fd, NULL);
    return r;
}

int kvt__io_fsync(int fd)
{
    call c;
    gate(&c, KVT_IO_FSYNC, fd, -1, NULL);
    int r = c.fail ? fail_with(c.fail) : fsync(fd);
    record(&c, KVT_IO_FSYNC, r != 0, fd, NULL);
    return r;
}

int kvt__io_fdatasync(int fd)
{
    call c;
    gate(&c, KVT_IO_FSYNC, fd, -1, NULL);
    int r = c.fail ? fail_with(c.fail) : fdatasync(fd);
    record(&c, KVT_IO_FSYNC, r != 0, fd, NULL);
    return r;
}

int kvt__io_rename(const char *from, const char *to) { return kvt__io_renameat(AT_FDCWD, from, AT_FDCWD, to); }

int kvt__io_renameat(int from_dirfd, const char *from, int to_dirfd, const char *to)
{
    call c;
    gate(&c, KVT_IO_RENAME, -1, from_dirfd, from);
    char to_path[512] = "";
    if (c.need_path)
        at_path(to_dirfd, to, to_path, sizeof to_path);
    int r = c.fail ? fail_with(c.fail) : renameat(from_dirfd, from, to_dirfd, to);
    record(&c, KVT_IO_RENAME, r != 0, -1, to_path);
    return r;
}

int kvt__io_unlink(const char *path) { return kvt__io_unlinkat(AT_FDCWD, path, 0); }

int kvt__io_unlinkat(int dirfd, const char *path, int flags)
{
    call c;
    gate(&c, KVT_IO_UNLINK, -1, dirfd, path);
    int r = c.fail ? fail_with(c.fail) : unlinkat(dirfd, path, flags);
    record(&c, KVT_IO_UNLINK, r != 0, -1, NULL);
    return r;
}

void *kvt__io_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    call c;
    gate(&c, KVT_IO_MMAP, fd, -1, NULL);
    if (c.fail) {
        errno = c.fail;
        return MAP_FAILED;
    }
    return mmap(addr, len, prot, flags, fd, off);
}

int kvt__io_ftruncate(int fd, off_t len)
{
    call c;
    gate(&c, KVT_IO_FTRUNCATE, fd, -1, NULL);
    return c.fail ? fail_with(c.fail) : ftruncate(fd, len);
}

int kvt__io_close(int fd)
{
    call c;
    gate(&c, KVT_IO_CLOSE, fd, -1, NULL);
    if (c.fail) {
        close(fd); /* Linux releases the descriptor even when close reports an error */
        return fail_with(c.fail);
    }
    return close(fd);
}
