/*
 * fault_preload.c: a test-only LD_PRELOAD library (built with the tests,
 * never linked into kvtier) that fails pwrite or pread on the files whose
 * path holds a string, so a test can inject faults into a `kvtier` child
 * process through its ordinary system calls. Configured by environment:
 *   KVT_PRELOAD_FAULT_CALL  "pwrite" or "pread"
 *   KVT_PRELOAD_FAULT_PATH  substring of the file's path (/proc/self/fd link,
 *                           " (deleted)" included for an unlinked file)
 *   KVT_PRELOAD_FAULT_ERRNO "ENOSPC" or "EIO" (default EIO)
 *   KVT_PRELOAD_FAULT_AFTER calls on matching files that succeed first (default 0)
 * Every later matching call fails with the errno and writes or reads nothing.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef ssize_t (*io_fn)(int, void *, size_t, off_t);

#define EXPORT __attribute__((visibility("default"))) /* the build hides symbols by default */

static atomic_long seen;

/* Whether this call on fd fails; *err gets the errno. */
static int should_fail(const char *call, int fd, int *err)
{
    const char *want = getenv("KVT_PRELOAD_FAULT_CALL"), *path = getenv("KVT_PRELOAD_FAULT_PATH");
    if (!want || !path || strcmp(want, call))
        return 0;
    char link[64], target[1024];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0)
        return 0;
    target[n] = '\0';
    if (!strstr(target, path))
        return 0;
    const char *after = getenv("KVT_PRELOAD_FAULT_AFTER");
    if (atomic_fetch_add(&seen, 1) < (after ? atol(after) : 0))
        return 0;
    const char *e = getenv("KVT_PRELOAD_FAULT_ERRNO");
    *err = e && !strcmp(e, "ENOSPC") ? ENOSPC : EIO;
    return 1;
}

EXPORT ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    static io_fn real;
    if (!real)
        real = (io_fn)dlsym(RTLD_NEXT, "pwrite");
    int err;
    if (should_fail("pwrite", fd, &err)) {
        errno = err;
        return -1;
    }
    return real(fd, (void *)buf, n, off);
}

EXPORT ssize_t pread(int fd, void *buf, size_t n, off_t off)
{
    static io_fn real;
    if (!real)
        real = (io_fn)dlsym(RTLD_NEXT, "pread");
    int err;
    if (should_fail("pread", fd, &err)) {
        errno = err;
        return -1;
    }
    return real(fd, buf, n, off);
}

/* the same calls under their 64-bit-offset names */
EXPORT ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }
EXPORT ssize_t pread64(int fd, void *buf, size_t n, off_t off) { return pread(fd, buf, n, off); }
