/*
 * tsan_skip.h: the few checks the thread sanitizer itself defeats skip under
 * it, and only under it. CMake defines KVT_SANITIZE_THREAD for every test of a
 * -DKVT_SANITIZE=thread build. Under TSan, KVT_TSAN_SKIP(why) in a cmocka case
 * prints "skipped under TSan: why" and skips the case; kvt_tsan_exit() turns
 * the program's result into 77 when a case skipped that way and none failed,
 * which ctest reports as skipped (SKIP_RETURN_CODE 77, set in CMakeLists.txt
 * for these tests). In every other build KVT_TSAN_SKIP does nothing and the
 * case runs and asserts; kvt_tsan_exit(rc) is rc.
 *
 * Use it only for a measurement TSan changes (peak RSS: its shadow memory) or
 * a limit it cannot run under (an address-space cap smaller than its shadow
 * mapping), never to hide a race.
 */
#ifndef KVT_TSAN_SKIP_H
#define KVT_TSAN_SKIP_H

#include <stdio.h>

#define KVT_TEST_SKIPPED 77 /* ctest SKIP_RETURN_CODE */

static int kvt_tsan_skipped; /* cases skipped under TSan in this program */

#ifdef KVT_SANITIZE_THREAD
#define KVT_TSAN_SKIP(why)                                                                                  \
    do {                                                                                                    \
        printf("skipped under TSan: %s\n", (why));                                                          \
        fflush(stdout);                                                                                     \
        kvt_tsan_skipped++;                                                                                 \
        skip();                                                                                             \
    } while (0)
#else
#define KVT_TSAN_SKIP(why) ((void)(why))
#endif

/** The exit status of a test program: `failed` (cmocka's count) when a case
 * failed, else 77 when a case was skipped under TSan, else 0. */
static inline int kvt_tsan_exit(int failed)
{
    if (failed)
        return failed;
    if (kvt_tsan_skipped) {
        printf("%d case(s) skipped under TSan (see above); ctest reports this program as skipped\n",
               kvt_tsan_skipped);
        return KVT_TEST_SKIPPED;
    }
    return 0;
}

#endif
