/*
 * page_file.h: the file calls of a live cache's page file (residency.c),
 * kept apart so they go through the fault shim (io_shim.h) without its
 * names meeting those of the I/O worker (kvtier/io.h). Never installed.
 */
#ifndef KVTIER_PAGE_FILE_H
#define KVTIER_PAGE_FILE_H

#include <stdint.h>

/** Creates `path` (O_EXCL, mode 0600) and unlinks it at once, so its space
 * is freed when the descriptor closes, even after a crash.
 * @return the descriptor or -errno. */
int kvt__page_file_create(const char *path);
/** Writes (write = 1) or reads n bytes at off, retrying short transfers
 * and EINTR. @return 0 or -errno (a write making no progress: -ENOSPC; a
 * read past the end: -EIO). */
int kvt__page_file_io(int fd, void *p, uint64_t n, uint64_t off, int write);
/** fdatasync, then drops [off, off + n) from the OS page cache. @return 0 or -errno. */
int kvt__page_file_sync_drop(int fd, uint64_t off, uint64_t n);
/** Drops [off, off + n) (clean pages) from the OS page cache. */
void kvt__page_file_drop(int fd, uint64_t off, uint64_t n);
/** Closes fd (negative: no-op). */
void kvt__page_file_close(int fd);

#endif
