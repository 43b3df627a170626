/*
 * oom_alloc.c: the failing allocator of oom_alloc.h, for tests only. Owns a
 * call counter and the index of the one call to fail; never frees or keeps
 * anything itself.
 */
#include "oom_alloc.h"

#include "kvtier/common.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

static atomic_long calls, fired, armed;
static long fail_at;

static int fail_now(void)
{
    if (atomic_fetch_add(&calls, 1) + 1 != fail_at)
        return 0;
    atomic_fetch_add(&fired, 1);
    return 1;
}

/* At exit: how many allocations the program's walks failed (one per armed
 * run whose k-th allocation happened), the figure TESTING.md collects. */
static void report(void)
{
    printf("oom_alloc: %ld allocation(s) failed in turn over %ld armed run(s)\n", atomic_load(&fired),
           atomic_load(&armed));
}

static void *oom_malloc(size_t n, void *ctx)
{
    (void)ctx;
    return fail_now() ? NULL : malloc(n ? n : 1);
}

static void *oom_realloc(void *p, size_t n, void *ctx)
{
    (void)ctx;
    return fail_now() ? NULL : realloc(p, n ? n : 1);
}

static void oom_free(void *p, void *ctx)
{
    (void)ctx;
    free(p);
}

void oom_arm(long k)
{
    static const kvt_allocator failing = {oom_malloc, oom_realloc, oom_free, NULL};
    if (atomic_fetch_add(&armed, 1) == 0)
        atexit(report);
    atomic_store(&calls, 0);
    fail_at = k;
    kvt_set_allocator(&failing);
}

long oom_calls(void) { return atomic_load(&calls); }
