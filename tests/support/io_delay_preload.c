/*
 * io_delay_preload.c: a test-only LD_PRELOAD library (built with the tests as
 * libkvt_io_delay.so, never linked into kvtier or a test program, not part of
 * the suite) that makes storage and network slow relative to the CPU, the way
 * a fast CI machine with a slow disk is: each interposed call sleeps before
 * it runs. A test that assumes background work (write-behind, page-file
 * writes, remote puts, checkpoints) did or did not happen by the time it
 * looks fails under it. Configured by environment (microseconds, 0 or unset
 * = no delay):
 *   KVT_DELAY_FSYNC_US  fsync, fdatasync, sync_file_range, syncfs (any fd)
 *   KVT_DELAY_WRITE_US  write, pwrite, writev, pwritev on regular files
 *   KVT_DELAY_READ_US   read, pread, readv, preadv on regular files
 *   KVT_DELAY_SEND_US   send, sendto, sendmsg, write, writev on TCP sockets
 *   KVT_DELAY_RECV_US   recv, recvfrom, recvmsg, read, readv on TCP sockets
 *                       (the Redis tier's hiredis uses read/write)
 *   KVT_DELAY_LOG       a file: each process that delayed a call appends one
 *                       line at exit (a normal exit, not a kill) with its pid,
 *                       program and how many calls it delayed per kind, so a
 *                       run can check the shim was applied
 * Reads and writes through mmap are not delayed. Processes named ctest or
 * cmake are left alone (their own logs). Usage:
 *   LD_PRELOAD=build/libkvt_io_delay.so KVT_DELAY_FSYNC_US=20000 \
 *     KVT_DELAY_LOG=/tmp/delay.log ctest --test-dir build -LE long -j2
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default"))) /* the build hides symbols by default */

enum { D_FSYNC, D_WRITE, D_READ, D_SEND, D_RECV, D_KINDS };
static const char *const kind_env[D_KINDS] = {"KVT_DELAY_FSYNC_US", "KVT_DELAY_WRITE_US", "KVT_DELAY_READ_US",
                                              "KVT_DELAY_SEND_US", "KVT_DELAY_RECV_US"};
static const char *const kind_name[D_KINDS] = {"fsync", "write", "read", "send", "recv"};

static long delay_us[D_KINDS];
static atomic_long delayed[D_KINDS];
static atomic_int ready; /* 0 unread, 1 reading, 2 read */
static int active;

static void load_config(void)
{
    int expect = 0;
    if (atomic_load(&ready) == 2 || !atomic_compare_exchange_strong(&ready, &expect, 1)) {
        while (atomic_load(&ready) != 2)
            ; /* another thread is reading the environment: microseconds */
        return;
    }
    char exe[256] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = '\0';
    const char *base = strrchr(exe, '/');
    base = base ? base + 1 : exe;
    int skip = !strcmp(base, "ctest") || !strcmp(base, "cmake");
    for (int k = 0; k < D_KINDS; k++) {
        const char *v = getenv(kind_env[k]);
        delay_us[k] = (!skip && v) ? atol(v) : 0;
        if (delay_us[k] > 0)
            active = 1;
    }
    atomic_store(&ready, 2);
}

__attribute__((constructor)) static void io_delay_init(void) { load_config(); }

__attribute__((destructor)) static void io_delay_report(void)
{
    const char *log = getenv("KVT_DELAY_LOG");
    long total = 0;
    for (int k = 0; k < D_KINDS; k++)
        total += atomic_load(&delayed[k]);
    if (!log || !total)
        return;
    char exe[256] = "", line[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = '\0';
    int len = snprintf(line, sizeof line, "pid=%ld exe=%s", (long)getpid(), exe);
    for (int k = 0; k < D_KINDS && len > 0 && (size_t)len < sizeof line; k++)
        len += snprintf(line + len, sizeof line - (size_t)len, " %s=%ld", kind_name[k], atomic_load(&delayed[k]));
    if (len <= 0 || (size_t)len >= sizeof line - 1)
        return;
    line[len++] = '\n';
    int fd = (int)syscall(SYS_open, log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    (void)syscall(SYS_write, fd, line, (size_t)len); /* the raw call: not delayed, not counted */
    (void)syscall(SYS_close, fd);
}

enum { FD_OTHER, FD_FILE, FD_TCP };

static int fd_class(int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return FD_OTHER;
    if (S_ISREG(st.st_mode))
        return FD_FILE;
    if (!S_ISSOCK(st.st_mode))
        return FD_OTHER;
    struct sockaddr_storage sa;
    socklen_t len = sizeof sa;
    if (getsockname(fd, (struct sockaddr *)&sa, &len) != 0)
        return FD_OTHER;
    return (sa.ss_family == AF_INET || sa.ss_family == AF_INET6) ? FD_TCP : FD_OTHER;
}

static void pause_for(int kind)
{
    long us = delay_us[kind];
    if (us <= 0)
        return;
    atomic_fetch_add(&delayed[kind], 1);
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0)
        ; /* a signal: sleep the rest */
}

/* Delays a call on fd: file_kind for regular files, sock_kind for TCP sockets (-1: none). */
static void delay_fd(int fd, int file_kind, int sock_kind)
{
    if (atomic_load(&ready) != 2)
        load_config();
    if (!active)
        return;
    int want_file = file_kind >= 0 && delay_us[file_kind] > 0;
    int want_sock = sock_kind >= 0 && delay_us[sock_kind] > 0;
    if (!want_file && !want_sock)
        return;
    int c = fd_class(fd);
    if (c == FD_FILE && want_file)
        pause_for(file_kind);
    else if (c == FD_TCP && want_sock)
        pause_for(sock_kind);
}

/* A sync of any fd (files and directories alike) waits the fsync delay. */
static void delay_sync(void)
{
    if (atomic_load(&ready) != 2)
        load_config();
    pause_for(D_FSYNC);
}

/* The next definition of name (libc's), looked up on first use. */
#define REAL(name)                                                                                           \
    static __typeof__(&name) real_##name;                                                                      \
    if (!real_##name)                                                                                          \
        real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

EXPORT int fsync(int fd)
{
    REAL(fsync);
    delay_sync();
    return real_fsync(fd);
}

EXPORT int fdatasync(int fd)
{
    REAL(fdatasync);
    delay_sync();
    return real_fdatasync(fd);
}

EXPORT int sync_file_range(int fd, off_t off, off_t n, unsigned int flags)
{
    REAL(sync_file_range);
    delay_sync();
    return real_sync_file_range(fd, off, n, flags);
}

EXPORT int syncfs(int fd)
{
    REAL(syncfs);
    delay_sync();
    return real_syncfs(fd);
}

EXPORT ssize_t write(int fd, const void *buf, size_t n)
{
    REAL(write);
    delay_fd(fd, D_WRITE, D_SEND);
    return real_write(fd, buf, n);
}

EXPORT ssize_t read(int fd, void *buf, size_t n)
{
    REAL(read);
    delay_fd(fd, D_READ, D_RECV);
    return real_read(fd, buf, n);
}

EXPORT ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    REAL(pwrite);
    delay_fd(fd, D_WRITE, -1);
    return real_pwrite(fd, buf, n, off);
}

EXPORT ssize_t pread(int fd, void *buf, size_t n, off_t off)
{
    REAL(pread);
    delay_fd(fd, D_READ, -1);
    return real_pread(fd, buf, n, off);
}

EXPORT ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }
EXPORT ssize_t pread64(int fd, void *buf, size_t n, off_t off) { return pread(fd, buf, n, off); }

EXPORT ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    REAL(writev);
    delay_fd(fd, D_WRITE, D_SEND);
    return real_writev(fd, iov, cnt);
}

EXPORT ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
    REAL(readv);
    delay_fd(fd, D_READ, D_RECV);
    return real_readv(fd, iov, cnt);
}

EXPORT ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off)
{
    REAL(pwritev);
    delay_fd(fd, D_WRITE, -1);
    return real_pwritev(fd, iov, cnt, off);
}

EXPORT ssize_t preadv(int fd, const struct iovec *iov, int cnt, off_t off)
{
    REAL(preadv);
    delay_fd(fd, D_READ, -1);
    return real_preadv(fd, iov, cnt, off);
}

EXPORT ssize_t send(int fd, const void *buf, size_t n, int flags)
{
    REAL(send);
    delay_fd(fd, -1, D_SEND);
    return real_send(fd, buf, n, flags);
}

EXPORT ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *to, socklen_t tolen)
{
    REAL(sendto);
    delay_fd(fd, -1, D_SEND);
    return real_sendto(fd, buf, n, flags, to, tolen);
}

EXPORT ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
    REAL(sendmsg);
    delay_fd(fd, -1, D_SEND);
    return real_sendmsg(fd, msg, flags);
}

EXPORT ssize_t recv(int fd, void *buf, size_t n, int flags)
{
    REAL(recv);
    delay_fd(fd, -1, D_RECV);
    return real_recv(fd, buf, n, flags);
}

EXPORT ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *from, socklen_t *fromlen)
{
    REAL(recvfrom);
    delay_fd(fd, -1, D_RECV);
    return real_recvfrom(fd, buf, n, flags, from, fromlen);
}

EXPORT ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
    REAL(recvmsg);
    delay_fd(fd, -1, D_RECV);
    return real_recvmsg(fd, msg, flags);
}
