/*
 * test_io_shim.c: the library's I/O shim (src/base/io_shim.c) on its own:
 * disarmed it is the system call; armed, the N-th counted call fails with
 * the chosen errno (only the ops asked for are counted), a write can be made
 * short, every call on a matching path fails, the counters are exact under
 * concurrent callers, and the record lists creating opens, writes, fsyncs
 * (of files and directories), renames and unlinks in call order.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "io_shim.h"
#include "store_util.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static char dir[512];

static int setup(void **state)
{
    (void)state;
    store_tmpdir(dir, sizeof dir, "ioshim");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvt__io_disarm();
    store_rmtree(dir);
    return 0;
}

static int make_file(const char *name, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", dir, name);
    return kvt__io_open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

static void disarmed_is_the_system_call(void **state)
{
    (void)state;
    kvt__io_disarm();
    char p[600], buf[8];
    int fd = make_file("plain", p, sizeof p);
    assert_true(fd >= 0);
    assert_int_equal(kvt__io_pwrite(fd, "abcdef", 6, 0), 6);
    assert_int_equal(kvt__io_write(fd, "gh", 2), 2);
    assert_int_equal(kvt__io_pread(fd, buf, 8, 0), 6);
    assert_memory_equal(buf, "ghcdef", 6); /* write() went at the offset 0 the fd was at */
    assert_int_equal(kvt__io_fsync(fd), 0);
    assert_int_equal(kvt__io_ftruncate(fd, 3), 0);
    void *m = kvt__io_mmap(NULL, 3, PROT_READ, MAP_SHARED, fd, 0);
    assert_true(m != MAP_FAILED);
    assert_memory_equal(m, "ghc", 3);
    munmap(m, 3);
    assert_int_equal(kvt__io_close(fd), 0);
    char q[600];
    snprintf(q, sizeof q, "%s/plain2", dir);
    assert_int_equal(kvt__io_rename(p, q), 0);
    assert_int_equal(kvt__io_unlink(q), 0);
    assert_int_equal(access(q, F_OK), -1);
    assert_int_equal(kvt__io_calls(), 0); /* nothing counted while disarmed */
}

static void nth_call_fails(void **state)
{
    (void)state;
    char p[600];
    int fd = make_file("nth", p, sizeof p);
    for (int err = 0; err < 3; err++) {
        const int errs[3] = {EIO, ENOSPC, EINTR};
        kvt__io_fault f = {.ops = 1u << KVT_IO_PWRITE, .fail_at = 3, .err = errs[err]};
        kvt__io_arm(&f);
        int fsyncs = 0;
        for (int i = 1; i <= 5; i++) {
            errno = 0;
            ssize_t r = kvt__io_pwrite(fd, "xy", 2, i * 2);
            fsyncs += kvt__io_fsync(fd) == 0; /* not counted: never failed */
            if (i == 3) {
                assert_int_equal(r, -1);
                assert_int_equal(errno, errs[err]);
            } else {
                assert_int_equal(r, 2);
            }
        }
        assert_int_equal(fsyncs, 5);
        assert_int_equal(kvt__io_calls(), 5);
        assert_int_equal(kvt__io_failures(), 1);
    }
    /* all ops counted: open, pwrite, fsync, rename, unlink in turn */
    kvt__io_fault g = {.fail_at = 2, .err = ENOSPC};
    kvt__io_arm(&g);
    assert_int_equal(kvt__io_fsync(fd), 0);
    assert_int_equal(kvt__io_close(fd), -1); /* the 2nd call: failed, yet the fd is released */
    assert_int_equal(errno, ENOSPC);
    assert_int_equal(fcntl(fd, F_GETFD), -1);
    kvt__io_disarm();
}

static void short_write(void **state)
{
    (void)state;
    char p[600], buf[16];
    int fd = make_file("short", p, sizeof p);
    kvt__io_fault f = {.ops = (1u << KVT_IO_PWRITE) | (1u << KVT_IO_WRITE), .fail_at = 1, .short_write = 1};
    kvt__io_arm(&f);
    assert_int_equal(kvt__io_pwrite(fd, "0123456789", 10, 0), 5);
    assert_int_equal(kvt__io_pwrite(fd, "56789", 5, 5), 5); /* only the first */
    assert_int_equal(kvt__io_pread(fd, buf, 16, 0), 10);
    assert_memory_equal(buf, "0123456789", 10);
    kvt__io_disarm();
    kvt__io_close(fd);
}

static void path_match(void **state)
{
    (void)state;
    char a[600], b[600];
    int fa = make_file("keep.bin", a, sizeof a), fb = make_file("victim.bin", b, sizeof b);
    kvt__io_fault f = {.path_has = "victim", .err = EIO};
    kvt__io_arm(&f);
    assert_int_equal(kvt__io_pwrite(fa, "a", 1, 0), 1);
    assert_int_equal(kvt__io_pwrite(fb, "b", 1, 0), -1);
    assert_int_equal(kvt__io_fsync(fb), -1);
    assert_int_equal(kvt__io_openat(AT_FDCWD, b, O_RDONLY, 0), -1);
    assert_int_equal(kvt__io_unlink(b), -1);
    assert_int_equal(kvt__io_fsync(fa), 0);
    assert_int_equal(kvt__io_failures(), 4);
    kvt__io_disarm();
    assert_int_equal(kvt__io_unlink(b), 0);
    kvt__io_close(fa);
    kvt__io_close(fb);
}

typedef struct racer {
    int fd;
    int failed;
} racer;

static void *race_main(void *arg)
{
    racer *r = arg;
    for (int i = 0; i < 1000; i++)
        r->failed += kvt__io_pwrite(r->fd, "z", 1, i) < 0;
    return NULL;
}

static void exact_under_threads(void **state)
{
    (void)state;
    char p[600];
    int fd = make_file("race", p, sizeof p);
    kvt__io_fault f = {.fail_at = 2500};
    kvt__io_arm(&f);
    racer r[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        r[i] = (racer){fd, 0};
        pthread_create(&th[i], NULL, race_main, &r[i]);
    }
    int failed = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        failed += r[i].failed;
    }
    assert_int_equal(failed, 1);
    assert_int_equal(kvt__io_calls(), 4000);
    kvt__io_disarm();
    kvt__io_close(fd);
}

static void records_in_order(void **state)
{
    (void)state;
    kvt__io_fault f = {.record = 1};
    kvt__io_arm(&f);
    char p[600], q[600];
    int fd = make_file(".tmp.x", p, sizeof p);
    kvt__io_pwrite(fd, "aa", 2, 0);
    kvt__io_pwrite(fd, "bb", 2, 2); /* one event for the run of writes */
    kvt__io_fsync(fd);
    kvt__io_close(fd);
    snprintf(q, sizeof q, "%s/x", dir);
    kvt__io_rename(p, q);
    int dfd = kvt__io_open(dir, O_RDONLY | O_DIRECTORY, 0); /* no O_CREAT: not recorded */
    kvt__io_fsync(dfd);
    kvt__io_close(dfd);
    kvt__io_unlink(q);
    kvt__io_disarm();
    kvt__io_event ev[16];
    int n = kvt__io_events(ev, 16);
    assert_int_equal(n, 6);
    const kvt__io_op want[6] = {KVT_IO_OPEN, KVT_IO_PWRITE, KVT_IO_FSYNC, KVT_IO_RENAME, KVT_IO_FSYNC, KVT_IO_UNLINK};
    for (int i = 0; i < 6; i++)
        assert_int_equal(ev[i].op, want[i]);
    assert_non_null(strstr(ev[0].path, "/.tmp.x"));
    assert_non_null(strstr(ev[2].path, "/.tmp.x"));
    assert_false(ev[2].is_dir);
    assert_non_null(strstr(ev[3].path, "/.tmp.x"));
    assert_non_null(strstr(ev[3].path2, "/x"));
    assert_true(ev[4].is_dir);
    assert_non_null(strstr(ev[5].path, "/x"));
    for (int i = 0; i < 6; i++)
        assert_false(ev[i].failed);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(disarmed_is_the_system_call),
        cmocka_unit_test(nth_call_fails),
        cmocka_unit_test(short_write),
        cmocka_unit_test(path_match),
        cmocka_unit_test(exact_under_threads),
        cmocka_unit_test(records_in_order),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
