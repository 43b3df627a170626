/*
 * page_file.c: the file calls of a live cache's page file (page_file.h),
 * every one through the fault shim so tests can fail them.
 */
#include "page_file.h"

#include "io_shim.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

int kvt__page_file_create(const char *path)
{
    int fd = kvt__io_open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return -errno;
    (void)kvt__io_unlink(path);
    return fd;
}

int kvt__page_file_io(int fd, void *buf, uint64_t n, uint64_t off, int write)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = write ? kvt__io_pwrite(fd, p, n, (off_t)off) : kvt__io_pread(fd, p, n, (off_t)off);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return errno ? -errno : -EIO;
        }
        if (k == 0)
            return write ? -ENOSPC : -EIO;
        p += k;
        n -= (uint64_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

int kvt__page_file_sync_drop(int fd, uint64_t off, uint64_t n)
{
    if (kvt__io_fdatasync(fd) != 0)
        return errno ? -errno : -EIO;
    kvt__page_file_drop(fd, off, n);
    return 0;
}

void kvt__page_file_drop(int fd, uint64_t off, uint64_t n)
{
    (void)posix_fadvise(fd, (off_t)off, (off_t)n, POSIX_FADV_DONTNEED);
}

void kvt__page_file_close(int fd)
{
    if (fd >= 0)
        (void)kvt__io_close(fd);
}
