/*
 * child_guard.h: no child process a test started outlives the test. The
 * helpers that fork servers (serve_util, redis_util) and CLI runs (cli_run)
 * register each child here; every child still registered is SIGKILLed and
 * reaped when the test process exits normally (an atexit handler that runs
 * only in the process that registered it, never in a forked child that calls
 * exit), by child_guard_teardown (a cmocka teardown: an assertion that fails
 * mid-test leaves no server running into the next test) and, when the test
 * process dies without running atexit (SIGKILL from a ctest timeout, a
 * crash), by the kernel (PR_SET_PDEATHSIG, set in the child before exec).
 * A leaked server holds ports, directories, a store's .lock and any
 * descriptor it inherited (session 4 lost a lock that way).
 *
 * Thread-safe. A child must be forked from a thread that lives until the
 * child is stopped (the death signal follows the forking thread): the test
 * helpers fork from the test's main thread.
 */
#ifndef KVT_TEST_CHILD_GUARD_H
#define KVT_TEST_CHILD_GUARD_H

#include <sys/types.h>

/** Registers a child just forked (pid > 0); the first call installs the
 * atexit handler. At most 256 children are registered at once (more are
 * not guarded). */
void child_guard_add(pid_t pid);

/** Forgets a child the caller has reaped (waitpid returned it). */
void child_guard_del(pid_t pid);

/** In the forked child, before exec: asks the kernel to SIGKILL this
 * process when the thread that forked it dies; exits at once (status 125)
 * when the parent is already gone. `parent` is getpid() of the test process,
 * read before fork. */
void child_guard_in_child(pid_t parent);

/** SIGKILLs and reaps every registered child of this process. @return how
 * many were still running (0 when the test stopped all it started). */
int child_guard_kill_all(void);

/** Marks the children registered so far as the group's (started before the
 * tests, e.g. a shared cache-off server): child_guard_teardown leaves them. */
void child_guard_keep_current(void);

/** A cmocka teardown (int (*)(void **)): SIGKILLs and reaps the children
 * registered since the last child_guard_keep_current, printing how many a
 * failed test left running. @return 0. */
int child_guard_teardown(void **state);

#endif
