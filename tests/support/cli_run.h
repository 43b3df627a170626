/*
 * cli_run.h: running the kvtier binary (KVT_BIN) as a child process in
 * tests: arguments as a NULL-terminated list, stdin from a file, /dev/null
 * or a pipe the test writes, stdout and stderr captured in files under the
 * test's directory, a wall-clock limit (then SIGKILL), an optional
 * address-space limit, and the child's peak RSS. Also the shared
 * stories260K paths. No cmocka here: errors are returned. Children are
 * registered with child_guard.h until cli_finish reaps them.
 */
#ifndef KVT_TEST_CLI_RUN_H
#define KVT_TEST_CLI_RUN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/** Fills model and tok with stories260K.bin and tok512.bin under
 * $KVT_SHARED_DIR (default ../shared). @return 1 when KVT_BIN is set and
 * both files are readable, else 0 (printing why the test skips). */
int cli_inputs(char *model, size_t model_cap, char *tok, size_t tok_cap);

/** Reads up to cap - 1 bytes of path into buf, NUL-terminated ("" when
 * the file cannot be read). */
void cli_slurp(const char *path, char *buf, size_t cap);

/** A running `kvtier` child. */
typedef struct cli_child {
    pid_t pid;
    int stdin_fd;          /* the pipe's write end (pipe_stdin), else -1 */
    char out_path[300], err_path[300];
} cli_child;

/** Starts KVT_BIN with argv[1..] = args (NULL-terminated). stdin: a pipe
 * when pipe_stdin (write c->stdin_fd), else the file `in` (NULL: /dev/null).
 * stdout and stderr go to dir/out.txt and dir/err.txt (removed first, so
 * nothing of an earlier run is read as this one's). as_bytes > 0 caps the
 * child's address space (RLIMIT_AS). @return 0, or -1 (fork or pipe). */
int cli_start(cli_child *c, const char *dir, const char *const *args, const char *in, int pipe_stdin,
              uint64_t as_bytes);

/** What a child did. */
typedef struct cli_result {
    int status;           /* exit status; -1 killed by a signal */
    int timed_out;        /* it ran past the limit and was killed */
    long maxrss_kb;       /* peak RSS (getrusage of the child), KiB */
    char out[8192];       /* stdout (first bytes) */
    char err[16384];      /* stderr (first bytes) */
} cli_result;

/** Closes the child's stdin pipe (if still open), waits at most timeout_s
 * seconds (then kills it), and fills *r. @return 0, or -1 (wait failed). */
int cli_finish(cli_child *c, int timeout_s, cli_result *r);

#endif
