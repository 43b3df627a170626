/*
 * test_degraded.c: a degraded SSD tier never ends `kvtier chat`. A lock on
 * the cache directory held by another process, a read-only mount, a
 * directory where a shard file should be, a full disk, the directory deleted
 * in the middle of a chat: each run warns once on stderr naming the
 * directory and the cause, goes on read-only or without the tier, counts
 * it in --stats ("ssd_cache"), replies exactly as a cache-off run, and
 * exits 0 (it exited 1 after the replies, hung on the lock, or refused to
 * start). Flags that contradict each other stay a usage error (exit 2).
 * The full disk is also injected in-process through the store's write layer
 * (kvt_store_io), so it runs where mount does not. Binary runs use KVT_BIN
 * and stories260K from ../shared (skipped without them); tmpfs cases skip
 * when mount is not allowed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "chat.h"
#include "tiers.h"
#include "cli_run.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char dir[256], model[1024], tok[1024], script[300], baseline[8192];

static const char *const lines[] = {"Once upon a time there was a cat.", "What did the cat do next?",
                                    "And how did the story end?"};

static int have_inputs(void) { return cli_inputs(model, sizeof model, tok, sizeof tok); }

/* Starts `kvtier chat --model M --tokenizer T --max-tokens 8 ARGS...`; with
 * `pipe_stdin` its stdin is a pipe the test writes, else it runs the script. */
static void start(cli_child *c, int pipe_stdin, const char *const *args)
{
    const char *argv[40] = {"chat", "--model", model, "--tokenizer", tok, "--max-tokens", "8"};
    int n = 7;
    if (!pipe_stdin) {
        argv[n++] = "--script";
        argv[n++] = script;
    }
    for (int i = 0; args[i]; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    assert_int_equal(cli_start(c, dir, argv, NULL, pipe_stdin, 0), 0);
}

static void run_chat(const char *const *args, cli_result *r)
{
    cli_child c;
    start(&c, 0, args);
    assert_int_equal(cli_finish(&c, 30, r), 0);
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* The run a user expects on a degraded disk: exit 0, the replies of the
 * cache-off run, one warning naming the directory and `cause`, and the
 * --stats document saying the mode and counting what failed. */
static void expect_degraded(const char *what, const cli_result *r, const char *ssd, const char *cause,
                            const char *mode)
{
    print_message("%s: exit %d\n%s", what, r->status, r->err);
    assert_int_equal(r->status, 0);
    assert_string_equal(r->out, baseline);
    assert_int_equal(count(r->err, "warning: SSD cache "), 1);
    char want[600];
    snprintf(want, sizeof want, "warning: SSD cache %s", ssd);
    if (!strstr(r->err, want))
        fail_msg("%s: the warning does not name %s: %s", what, ssd, r->err);
    if (!strstr(r->err, cause))
        fail_msg("%s: stderr lacks the cause '%s': %s", what, cause, r->err);
    assert_int_equal(count(r->err, "turn "), 3);
    snprintf(want, sizeof want, "\"mode\":\"%s\"", mode);
    if (!strstr(r->err, want))
        fail_msg("%s: --stats lacks %s: %s", what, want, r->err);
}

/* The first number after `key` in s. */
static long long number_after(const char *s, const char *key)
{
    const char *p = strstr(s, key);
    assert_non_null(p);
    return atoll(p + strlen(key));
}

/* The first number after `key` inside the report's "ssd_cache" object (the
 * service report before it has a "tiers" array with keys of the same names). */
static long long ssd_cache_number(const char *err, const char *key)
{
    const char *o = strstr(err, "\"ssd_cache\":");
    assert_non_null(o);
    return number_after(o, key);
}

static void rm_rf(const char *path)
{
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    assert_int_equal(system(cmd), 0);
}

/* The identity directory the chat uses under root (the only one there). */
static void identity_dir(const char *root, char *out, size_t cap)
{
    char cmd[700];
    snprintf(cmd, sizeof cmd, "ls -d '%s'/*/ | head -1", root);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    assert_non_null(fgets(out, (int)cap, p));
    pclose(p);
    out[strcspn(out, "\n")] = '\0';
    size_t n = strlen(out);
    if (n && out[n - 1] == '/')
        out[n - 1] = '\0';
}

/* Fills an SSD cache under root with a run of the script; it must serve. */
static void fill(const char *root)
{
    cli_result r;
    run_chat((const char *const[]){"--ssd-cache", root, NULL}, &r);
    assert_int_equal(r.status, 0);
    assert_string_equal(r.out, baseline);
}

static int mount_tmpfs(const char *path, const char *opts)
{
    mkdir(path, 0755);
    if (mount("tmpfs", path, "tmpfs", 0, opts) != 0) {
        print_message("skipping: cannot mount a tmpfs here (%s)\n", strerror(errno));
        rmdir(path);
        return -1;
    }
    return 0;
}

/* ---- the cases --------------------------------------------------------------------- */

/* Another process holds the directory's lock: chat waited for ever. It now
 * serves what the directory holds, read-only. */
static void test_lock_held(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char root[300], id[700], lock[800];
    snprintf(root, sizeof root, "%s/locked", dir);
    fill(root);
    identity_dir(root, id, sizeof id);
    snprintf(lock, sizeof lock, "%s/.lock", id);
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t holder = fork();
    assert_true(holder >= 0);
    if (holder == 0) {
        int fd = open(lock, O_RDWR);
        if (fd < 0 || flock(fd, LOCK_EX))
            _exit(1);
        if (write(p[1], "x", 1) != 1)
            _exit(1);
        pause();
        _exit(0);
    }
    char x;
    assert_int_equal(read(p[0], &x, 1), 1);
    cli_result r;
    run_chat((const char *const[]){"--ssd-cache", root, "--stats", NULL}, &r);
    kill(holder, SIGKILL);
    waitpid(holder, NULL, 0);
    close(p[0]);
    close(p[1]);
    expect_degraded("lock held", &r, root, "its lock is held by another process", "read-only");
    assert_true(number_after(r.err, "turn 1: reused ") > 0); /* read-only: still served */
    assert_int_equal(number_after(r.err, "\"open_failures\":"), 1);
    rm_rf(root);
}

/* A read-only mount: chat refused to start. */
static void test_read_only_mount(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char mnt[300], root[400];
    snprintf(mnt, sizeof mnt, "%s/ro", dir);
    if (mount_tmpfs(mnt, "size=1m,mode=0755"))
        skip();
    snprintf(root, sizeof root, "%s/cache", mnt);
    fill(root);
    assert_int_equal(mount(NULL, mnt, NULL, MS_REMOUNT | MS_RDONLY, NULL), 0);
    cli_result r;
    run_chat((const char *const[]){"--ssd-cache", root, "--stats", NULL}, &r);
    umount(mnt);
    rmdir(mnt);
    expect_degraded("read-only mount", &r, root, "Read-only file system", "read-only");
    assert_true(number_after(r.err, "turn 1: reused ") > 0);
}

/* A directory where a shard file should be: every reply was right, then
 * exit 1 ("rename ... failed: Is a directory"). */
static void test_directory_in_place_of_shard(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char root[300], id[700], cmd[1600];
    snprintf(root, sizeof root, "%s/shards", dir);
    fill(root);
    identity_dir(root, id, sizeof id);
    snprintf(cmd, sizeof cmd, "cd '%s' && for f in e*.safetensors b*.safetensors; do "
             "[ -f \"$f\" ] && rm -f \"$f\" && mkdir \"$f\"; done; ls -d e*.safetensors >/dev/null", id);
    assert_int_equal(system(cmd), 0);
    cli_result r;
    run_chat((const char *const[]){"--ssd-cache", root, "--stats", NULL}, &r);
    expect_degraded("directory in place of a shard", &r, root, "Is a directory", "read-only");
    assert_true(ssd_cache_number(r.err, "\"write_failures\":") >= 1);
    rm_rf(root);
}

/* A full disk (a 64 KiB tmpfs): exit 1 after the replies. */
static void test_disk_full(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char mnt[300];
    snprintf(mnt, sizeof mnt, "%s/full", dir);
    if (mount_tmpfs(mnt, "size=64k"))
        skip();
    cli_result r;
    run_chat((const char *const[]){"--ssd-cache", mnt, "--stats", NULL}, &r);
    umount(mnt);
    rmdir(mnt);
    expect_degraded("full disk", &r, mnt, "No space left on device", "read-only");
    assert_true(ssd_cache_number(r.err, "\"write_failures\":") >= 1);
}

/* The directory deleted between two turns: exit 1 after the replies. */
static void test_directory_deleted(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char root[300], err[16384];
    snprintf(root, sizeof root, "%s/deleted", dir);
    cli_child c;
    start(&c, 1, (const char *const[]){"--ssd-cache", root, "--stats", NULL});
    FILE *in = fdopen(c.stdin_fd, "w");
    assert_non_null(in);
    fprintf(in, "%s\n", lines[0]);
    fflush(in);
    for (int i = 0; i < 3000; i++) { /* wait for turn 1 */
        cli_slurp(c.err_path, err, sizeof err);
        if (strstr(err, "turn 1:") && !access(root, F_OK))
            break;
        usleep(10000);
    }
    assert_non_null(strstr(err, "turn 1:"));
    /* the writer may create a file while rm runs ("Directory not empty"):
     * again until the directory is gone */
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' 2>/dev/null", root);
    for (int i = 0; i < 100 && (system(cmd) != 0 || !access(root, F_OK)); i++)
        usleep(10000);
    assert_int_equal(access(root, F_OK), -1);
    fprintf(in, "%s\n%s\n", lines[1], lines[2]);
    fclose(in);
    c.stdin_fd = -1;
    cli_result r;
    assert_int_equal(cli_finish(&c, 30, &r), 0);
    expect_degraded("directory deleted", &r, root, "No such file or directory", "read-only");
    rm_rf(root);
}

/* A cache the flags make unusable stays a usage error. */
static void test_contradicting_flags(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    cli_result r;
    run_chat((const char *const[]){"--ssd-cache", dir, "--prompt-cache", "0", NULL}, &r);
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "--ssd-cache needs a prompt cache"));
    run_chat((const char *const[]){"--ssd-cache", "", NULL}, &r);
    assert_int_equal(r.status, 2);
    assert_string_equal(r.out, "");
}

/* ---- in process: the store's write layer fails with ENOSPC ----------------------- */

static ssize_t full_pwrite(void *ctx, int fd, const void *buf, size_t n, off_t off)
{
    (void)ctx, (void)fd, (void)buf, (void)n, (void)off;
    errno = ENOSPC;
    return -1;
}

static int real_fsync(void *ctx, int fd)
{
    (void)ctx;
    return fsync(fd);
}

static void test_disk_full_in_process(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    assert_int_equal(kvt_chat_load(model, tok, &m, &t), 0);
    kvt_chat_identity id;
    assert_int_equal(kvt_chat_identity_compute(m, tok, &id), 0);
    char root[300];
    snprintf(root, sizeof root, "%s/inproc", dir);
    kvt_store_io io = {.pwrite_fn = full_pwrite, .fsync_fn = real_fsync};
    kvt_ssd_level_opts so = {.io = &io};
    kvt_ssd_level *ssd = NULL;
    assert_int_equal(kvt_ssd_level_open(m, &id, root, &so, &ssd), 0);
    kvt_level_status st;
    kvt_ssd_level_poll(ssd, &st);
    assert_int_equal(st.mode, KVT_LEVEL_MODE_READ_WRITE);
    assert_int_equal(st.warn, 0);
    kvt_cold_tier tier;
    kvt_ssd_level_tier(ssd, &tier);
    /* a RAM budget of a few entries: turns evict and spill to the failing disk */
    kvt_chat_service_opts svo = {.prompt_cache_bytes = 200000, .cold = &tier};
    kvt_service *svc = NULL;
    assert_int_equal(kvt_chat_service_create(m, &svo, &svc), 0);
    kvt_chat_opts co = {.max_tokens = 8, .session = "s"};
    kvt_chat *chat = NULL;
    assert_int_equal(kvt_chat_create(m, t, svc, &co, &chat), 0);
    int warned = 0;
    for (int i = 0; i < 3; i++) {
        const char *reply;
        assert_int_equal(kvt_chat_turn(chat, lines[i], &reply, NULL, NULL, NULL), 0);
        kvt_ssd_level_poll(ssd, &st);
        warned += st.warn;
    }
    kvt_chat_free(chat);
    assert_int_equal(kvt_service_close(svc), 0); /* the failing disk is not the service's error */
    kvt_service_destroy(svc);
    assert_int_equal(kvt_ssd_level_close(ssd, &st), 0);
    warned += st.warn;
    print_message("in process: mode %d, cause '%s', %llu write failures, %llu skipped\n", st.mode, st.cause,
                  (unsigned long long)st.write_failures, (unsigned long long)st.writes_skipped);
    assert_int_equal(warned, 1); /* said once */
    assert_int_equal(st.mode, KVT_LEVEL_MODE_READ_ONLY);
    assert_non_null(strstr(st.cause, root));
    assert_non_null(strstr(st.cause, "No space left on device"));
    assert_true(st.write_failures >= 1);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
    rm_rf(root);
}

/* ---- fixture ----------------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_degraded_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(script, sizeof script, "%s/script.txt", dir);
    FILE *f = fopen(script, "w");
    if (!f)
        return -1;
    for (int i = 0; i < 3; i++)
        fprintf(f, "%s\n", lines[i]);
    fclose(f);
    if (!getenv("KVT_BIN") || !have_inputs())
        return 0;
    cli_result r;
    run_chat((const char *const[]){"--prompt-cache", "0", NULL}, &r);
    if (r.status != 0)
        return -1;
    snprintf(baseline, sizeof baseline, "%s", r.out);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lock_held),
        cmocka_unit_test(test_read_only_mount),
        cmocka_unit_test(test_directory_in_place_of_shard),
        cmocka_unit_test(test_disk_full),
        cmocka_unit_test(test_directory_deleted),
        cmocka_unit_test(test_contradicting_flags),
        cmocka_unit_test(test_disk_full_in_process),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
