/*
 * io_shim.h: the one place the library's file-system calls go through (the
 * SSD tier, every file of src/ssd), so tests can fail them. Each kvt__io_<call> has the
 * signature and the errno contract of the system call it wraps and, when no
 * fault is armed, is that call plus one relaxed atomic load.
 *
 * Network calls made inside a library (the remote tier's hiredis
 * connections, src/remote/conn.c) go through kvt__io_net_gate: the caller
 * asks before each connect, send and receive whether the shim fails it, and
 * fails it the way the library reports a socket error.
 *
 * A test arms a fault (kvt__io_arm): fail the N-th counted call from now
 * with a chosen errno (ENOSPC, EIO, EINTR, ...), or, for write and pwrite,
 * make it a short write (half the bytes written and reported); or fail every
 * counted call whose path contains a string. `ops` restricts which calls are
 * counted. The shim can also record, in order, the calls that make a shard
 * durable (creating opens, writes, fsyncs of files and directories, renames,
 * unlinks) with the paths they were about, so a test can assert the
 * durability protocol (write, fsync the file, rename, fsync the directory).
 *
 * Internal (kvt__): tests reach it through the private include directory.
 * Thread-safety: every wrapper may be called from any thread; arming,
 * disarming and reading the record are serialised by an internal mutex, and
 * counting is atomic (the N-th call is exactly one call even when several
 * threads race for it).
 */
#ifndef KVT_IO_SHIM_H
#define KVT_IO_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/** The wrapped calls (bit i of kvt__io_fault.ops is call i). */
typedef enum kvt__io_op {
    KVT_IO_OPEN = 0, /* open, openat */
    KVT_IO_READ,     /* read */
    KVT_IO_PREAD,    /* pread */
    KVT_IO_WRITE,    /* write */
    KVT_IO_PWRITE,   /* pwrite */
    KVT_IO_FSYNC,    /* fsync, fdatasync */
    KVT_IO_RENAME,   /* rename, renameat */
    KVT_IO_UNLINK,   /* unlink, unlinkat */
    KVT_IO_MMAP,     /* mmap */
    KVT_IO_FTRUNCATE,
    KVT_IO_CLOSE,    /* close (a failed close still releases the fd, as Linux does) */
    KVT_IO_CONNECT,  /* network: a new connection (connect, and the handshake the caller makes) */
    KVT_IO_SEND,     /* network: sending what is buffered (one or more commands) */
    KVT_IO_RECV,     /* network: reading one reply */
    KVT_IO_N_OPS
} kvt__io_op;

#define KVT_IO_ALL_OPS ((1u << KVT_IO_N_OPS) - 1u)
/** The network calls (kvt__io_net_gate), and every other call. */
#define KVT_IO_NET_OPS ((1u << KVT_IO_CONNECT) | (1u << KVT_IO_SEND) | (1u << KVT_IO_RECV))
#define KVT_IO_FILE_OPS (KVT_IO_ALL_OPS & ~KVT_IO_NET_OPS)

/** A fault to inject. Zero-initialise, then set. */
typedef struct kvt__io_fault {
    uint32_t ops;         /* calls counted (bit per kvt__io_op); 0 = all */
    int64_t fail_at;      /* > 0: the fail_at-th counted call from kvt__io_arm fails (1 = the next) */
    int err;              /* errno it fails with (0 = EIO) */
    int short_write;      /* 1: a failing write/pwrite of n > 1 bytes writes n / 2 and returns that;
                             a failing SEND sends half of what is buffered, then fails */
    const char *path_has; /* non-NULL: every counted call whose path contains this fails (copied) */
    int record;           /* 1: record the durability events (kvt__io_events) */
    /* non-NULL: called as before(before_ctx, op) at the start of every counted
     * call, on the calling thread, with no lock of the shim held (a test
     * holds a call there, e.g. a read, until other threads have caught up) */
    void (*before)(void *ctx, kvt__io_op op);
    void *before_ctx;
} kvt__io_fault;

/** Arms `f` (NULL: count and record nothing, inject nothing) and resets the
 * counters and the record. */
void kvt__io_arm(const kvt__io_fault *f);
/** Disarms: later calls are plain system calls. The counters and the record
 * stay readable until the next arm. */
void kvt__io_disarm(void);
/** Calls counted since the arm (each counted call once, failed or not). */
int64_t kvt__io_calls(void);
/** Calls failed since the arm. */
int64_t kvt__io_failures(void);

/** One recorded event. */
typedef struct kvt__io_event {
    kvt__io_op op;       /* OPEN (with O_CREAT only), WRITE/PWRITE (the first of a run on one file), FSYNC, RENAME, UNLINK */
    int is_dir;          /* FSYNC: of a directory */
    int failed;          /* the call was failed by the shim (or by the system) */
    char path[512];      /* the file (RENAME: the old name) */
    char path2[512];     /* RENAME: the new name */
} kvt__io_event;

/** Copies up to cap recorded events (in call order) into out. @return how
 * many were recorded (may exceed cap; at most 4096 are kept). */
int kvt__io_events(kvt__io_event *out, int cap);

/** Asks whether the network call `op` (KVT_IO_CONNECT, SEND or RECV) to
 * `peer` ("host:port", matched by path_has) fails: counts it like any
 * wrapped call and returns the errno to fail it with, or 0 to make it.
 * *short_write (may be NULL) is set to 1 when a failing SEND is armed as a
 * short write (the caller sends half of its buffer, then fails). No I/O.
 * Thread-safe. */
int kvt__io_net_gate(kvt__io_op op, const char *peer, int *short_write);

int kvt__io_open(const char *path, int flags, mode_t mode);
int kvt__io_openat(int dirfd, const char *path, int flags, mode_t mode);
ssize_t kvt__io_read(int fd, void *buf, size_t n);
ssize_t kvt__io_pread(int fd, void *buf, size_t n, off_t off);
ssize_t kvt__io_write(int fd, const void *buf, size_t n);
ssize_t kvt__io_pwrite(int fd, const void *buf, size_t n, off_t off);
int kvt__io_fsync(int fd);
int kvt__io_fdatasync(int fd);
int kvt__io_rename(const char *from, const char *to);
int kvt__io_renameat(int from_dirfd, const char *from, int to_dirfd, const char *to);
int kvt__io_unlink(const char *path);
int kvt__io_unlinkat(int dirfd, const char *path, int flags);
void *kvt__io_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off);
int kvt__io_ftruncate(int fd, off_t len);
int kvt__io_close(int fd);

#endif
