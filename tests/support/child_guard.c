/* child_guard.c: the registry of the children a test started (child_guard.h). */
#include "child_guard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_KIDS 256

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t g_kids[MAX_KIDS];
static int g_kept[MAX_KIDS]; /* 1: registered before child_guard_keep_current */
static pid_t g_owner;        /* the process that registered them */

/* Kills and reaps one child, unless it is no longer ours (reaped elsewhere:
 * ECHILD, so a reused pid is never signalled). @return 1 if it was running. */
static int reap_one(pid_t pid)
{
    int st;
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid || (w < 0 && errno == ECHILD))
        return 0;
    kill(pid, SIGKILL);
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    return 1;
}

static int kill_where(int include_kept)
{
    if (getpid() != g_owner)
        return 0; /* a forked child of the test: not its children */
    pid_t taken[MAX_KIDS];
    int n = 0, running = 0;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_KIDS; i++)
        if (g_kids[i] > 0 && (include_kept || !g_kept[i])) {
            taken[n++] = g_kids[i];
            g_kids[i] = 0;
            g_kept[i] = 0;
        }
    pthread_mutex_unlock(&g_mu);
    for (int i = 0; i < n; i++)
        running += reap_one(taken[i]);
    return running;
}

static void at_exit(void) { kill_where(1); }

void child_guard_add(pid_t pid)
{
    if (pid <= 0)
        return;
    pthread_mutex_lock(&g_mu);
    if (!g_owner) {
        g_owner = getpid();
        atexit(at_exit);
    }
    for (int i = 0; i < MAX_KIDS; i++)
        if (!g_kids[i]) {
            g_kids[i] = pid;
            g_kept[i] = 0;
            break;
        }
    pthread_mutex_unlock(&g_mu);
}

void child_guard_del(pid_t pid)
{
    if (pid <= 0)
        return;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_KIDS; i++)
        if (g_kids[i] == pid) {
            g_kids[i] = 0;
            g_kept[i] = 0;
        }
    pthread_mutex_unlock(&g_mu);
}

void child_guard_in_child(pid_t parent)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
        _exit(125); /* the test died between fork and prctl */
}

int child_guard_kill_all(void) { return kill_where(1); }

void child_guard_keep_current(void)
{
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_KIDS; i++)
        g_kept[i] = g_kids[i] > 0;
    pthread_mutex_unlock(&g_mu);
}

int child_guard_teardown(void **state)
{
    (void)state;
    int n = kill_where(0);
    if (n)
        printf("child_guard: killed %d child process%s the test left running\n", n, n == 1 ? "" : "es");
    return 0;
}
