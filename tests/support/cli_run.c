/*
 * cli_run.c: the child-process runner of cli_run.h. Owns nothing past a
 * call; never asserts (the tests do).
 */
#include "cli_run.h"

#include "child_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

int cli_inputs(char *model, size_t model_cap, char *tok, size_t tok_cap)
{
    if (!getenv("KVT_BIN")) {
        printf("skipping: KVT_BIN is not set (ctest sets it to the kvtier binary)\n");
        return 0;
    }
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(model, model_cap, "%s/data/models/stories260K.bin", shared && *shared ? shared : "../shared");
    snprintf(tok, tok_cap, "%s/data/models/tok512.bin", shared && *shared ? shared : "../shared");
    if (access(model, R_OK) || access(tok, R_OK)) {
        printf("skipping: %s absent\n", model);
        return 0;
    }
    return 1;
}

void cli_slurp(const char *path, char *buf, size_t cap)
{
    buf[0] = '\0';
    FILE *f = fopen(path, "rb");
    if (!f)
        return;
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = '\0';
    fclose(f);
}

int cli_start(cli_child *c, const char *dir, const char *const *args, const char *in, int pipe_stdin,
              uint64_t as_bytes)
{
    snprintf(c->out_path, sizeof c->out_path, "%s/out.txt", dir);
    snprintf(c->err_path, sizeof c->err_path, "%s/err.txt", dir);
    unlink(c->out_path);
    unlink(c->err_path);
    const char *argv[64] = {getenv("KVT_BIN")};
    int n = 1;
    for (int i = 0; args[i] && n < 63; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    int p[2] = {-1, -1};
    c->stdin_fd = -1;
    if (pipe_stdin && pipe(p))
        return -1;
    pid_t parent = getpid();
    c->pid = fork();
    if (c->pid < 0)
        return -1;
    if (c->pid == 0) {
        child_guard_in_child(parent);
        if (as_bytes) {
            struct rlimit lim = {.rlim_cur = as_bytes, .rlim_max = as_bytes};
            setrlimit(RLIMIT_AS, &lim);
        }
        int fd = pipe_stdin ? p[0] : open(in ? in : "/dev/null", O_RDONLY);
        int o = open(c->out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int e = open(c->err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || o < 0 || e < 0)
            _exit(126);
        dup2(fd, 0);
        dup2(o, 1);
        dup2(e, 2);
        if (pipe_stdin)
            close(p[1]);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    child_guard_add(c->pid);
    if (pipe_stdin) {
        close(p[0]);
        c->stdin_fd = p[1];
    }
    return 0;
}

int cli_finish(cli_child *c, int timeout_s, cli_result *r)
{
    memset(r, 0, sizeof *r);
    if (c->stdin_fd >= 0) {
        close(c->stdin_fd);
        c->stdin_fd = -1;
    }
    struct rusage ru;
    int st = 0;
    for (long waited_ms = 0;; waited_ms += 10) {
        pid_t w = wait4(c->pid, &st, WNOHANG, &ru);
        if (w < 0)
            return -1;
        if (w == c->pid) {
            child_guard_del(c->pid);
            break;
        }
        if (waited_ms == (long)timeout_s * 1000) {
            printf("kvtier still running after %d s: killed\n", timeout_s);
            r->timed_out = 1;
            kill(c->pid, SIGKILL);
        }
        usleep(10000);
    }
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r->maxrss_kb = ru.ru_maxrss;
    cli_slurp(c->out_path, r->out, sizeof r->out);
    cli_slurp(c->err_path, r->err, sizeof r->err);
    return 0;
}
