/*
 * fault_walk.c: the fault walk over worker processes (fault_walk.h).
 * Each worker writes one fixed-size record per run to its pipe (well below
 * PIPE_BUF: never split); the parent reads every pipe until EOF, then checks
 * the walk is whole.
 */
#include "fault_walk.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define FW_MAX_WORKERS 64

int fault_walk_workers(void)
{
    const char *v = getenv("KVT_FAULT_WORKERS");
    int w = v && *v ? atoi(v) : 8;
    return w < 1 ? 1 : w > FW_MAX_WORKERS ? FW_MAX_WORKERS : w;
}

static int write_full(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

/* The worker: N = w+1, w+1+W, ... until a run fails no call (or max_n). */
static void worker_main(int w, int workers, int64_t max_n, fw_run_fn fn, void *ctx, int fd)
{
    /* a crash kills the worker (the parent reports it), never returns into
     * the test runner's copy in this process (cmocka catches these) */
    const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        signal(sigs[i], SIG_DFL);
    for (int64_t n = w + 1; n <= max_n; n += workers) {
        fw_run r;
        memset(&r, 0, sizeof r);
        fn(n, w, ctx, &r);
        r.n = n;
        if (write_full(fd, &r, sizeof r))
            _exit(3);
        if (r.failed == 0)
            break;
    }
    close(fd);
    _exit(0);
}

/* Records of every worker, in arrival order. */
typedef struct recs {
    fw_run *r;
    size_t n, cap;
} recs;

static int recs_add(recs *a, const fw_run *r)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        fw_run *p = realloc(a->r, cap * sizeof *p);
        if (!p)
            return -1;
        a->r = p;
        a->cap = cap;
    }
    a->r[a->n++] = *r;
    return 0;
}

int fault_walk(int workers, int64_t max_n, fw_run_fn fn, void *ctx, fw_result *res)
{
    memset(res, 0, sizeof *res);
    if (workers < 1 || workers > FW_MAX_WORKERS || max_n < 1) {
        fprintf(stderr, "fault_walk: %d workers, max N %lld\n", workers, (long long)max_n);
        return -1;
    }
    fflush(NULL); /* nothing buffered twice */
    pid_t pid[FW_MAX_WORKERS];
    struct pollfd pf[FW_MAX_WORKERS];
    int started = 0, rc = 0;
    for (int w = 0; w < workers; w++) {
        int p[2];
        if (pipe(p)) {
            fprintf(stderr, "fault_walk: pipe: %s\n", strerror(errno));
            rc = -1;
            break;
        }
        pid_t c = fork();
        if (c < 0) {
            fprintf(stderr, "fault_walk: fork: %s\n", strerror(errno));
            close(p[0]);
            close(p[1]);
            rc = -1;
            break;
        }
        if (c == 0) {
            close(p[0]);
            for (int i = 0; i < started; i++)
                close(pf[i].fd); /* the earlier workers' read ends */
            worker_main(w, workers, max_n, fn, ctx, p[1]);
        }
        close(p[1]);
        pid[started] = c;
        pf[started].fd = p[0];
        pf[started].events = POLLIN;
        started++;
    }
    recs all = {0};
    /* a partial record is kept per worker until it is whole */
    fw_run part[FW_MAX_WORKERS];
    size_t have[FW_MAX_WORKERS] = {0};
    int open = started;
    while (open > 0) {
        if (poll(pf, (nfds_t)started, -1) < 0) {
            if (errno == EINTR)
                continue;
            fprintf(stderr, "fault_walk: poll: %s\n", strerror(errno));
            rc = -1;
            break;
        }
        for (int i = 0; i < started; i++) {
            if (pf[i].fd < 0 || !(pf[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            ssize_t k = read(pf[i].fd, (char *)&part[i] + have[i], sizeof part[i] - have[i]);
            if (k < 0 && errno == EINTR)
                continue;
            if (k <= 0) {
                if (have[i]) {
                    fprintf(stderr, "fault_walk: worker %d: a cut record\n", i);
                    rc = -1;
                }
                close(pf[i].fd);
                pf[i].fd = -1;
                open--;
                continue;
            }
            have[i] += (size_t)k;
            if (have[i] == sizeof part[i]) {
                if (recs_add(&all, &part[i]))
                    rc = -1;
                have[i] = 0;
            }
        }
    }
    for (int i = 0; i < started; i++) {
        if (pf[i].fd >= 0)
            close(pf[i].fd);
        int st = 0;
        while (waitpid(pid[i], &st, 0) < 0 && errno == EINTR)
            ;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "fault_walk: worker %d %s %d\n", i, WIFEXITED(st) ? "exited" : "was killed by signal",
                    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            res->bad_runs++;
            rc = -1;
        }
    }
    /* the walk ends at the first N that failed no call */
    int64_t end = -1;
    for (size_t i = 0; i < all.n; i++)
        if (all.r[i].failed == 0 && (end < 0 || all.r[i].n < end)) {
            end = all.r[i].n;
            res->clean = all.r[i];
        }
    if (end < 0) {
        fprintf(stderr, "fault_walk: no run below N = %lld failed no call\n", (long long)max_n);
        rc = -1;
        end = max_n + 1;
    }
    for (size_t i = 0; i < all.n; i++) {
        const fw_run *r = &all.r[i];
        if (r->bad)
            res->bad_runs++;
        if (r->n >= end)
            continue;
        if (r->failed == 0)
            continue; /* not reached: end is the least such N */
        res->walked++;
        if (r->ok)
            res->ok++;
        else
            res->failed_cleanly++;
    }
    res->calls = res->clean.calls;
    if (rc == 0 && (res->walked != end - 1 || res->calls != end - 1)) {
        fprintf(stderr, "fault_walk: %lld runs failed a call below N = %lld, whose run made %lld calls\n",
                (long long)res->walked, (long long)end, (long long)res->calls);
        rc = -1;
    }
    free(all.r);
    return rc;
}
