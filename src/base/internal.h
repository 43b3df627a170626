/*
 * internal.h: helpers shared by libkvtier's modules; never installed.
 * Symbols here use the kvt__ prefix and stay hidden in the shared library.
 */
#ifndef KVTIER_INTERNAL_H
#define KVTIER_INTERNAL_H

#include "kvtier/common.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

void *kvt__malloc(size_t bytes);
void *kvt__calloc(size_t n, size_t size);
void *kvt__realloc(void *ptr, size_t bytes);
void kvt__free(void *ptr);
char *kvt__strdup(const char *s);
/* A namespace argument: NULL means "", the base model, in every public call. */
static inline const char *kvt__ns(const char *ns) { return ns ? ns : ""; }

/** Records the detail sentence for kvt_last_error() and returns code, so a
 * failure reads `return kvt__fail(KVT_EFORMAT, "%s: ...", path);`. */
int kvt__fail(int code, const char *fmt, ...) KVT_PRINTF(2, 3);
/** Clears the calling thread's detail sentence. */
void kvt__clear_error(void);
/** 1 when str is valid UTF-8 (no overlong forms, surrogates or code points
 * past U+10FFFF), else 0 (also for NULL): names that tiers write into JSON
 * (namespaces, identity strings, attachment names). Thread-safe. */
int kvt__utf8_valid(const char *str);
/** The absolute time `ms` milliseconds from now on `clock` (CLOCK_MONOTONIC
 * or CLOCK_REALTIME, matching the condition variable's clock), for
 * pthread_cond_timedwait. Thread-safe. */
struct timespec kvt__deadline(clockid_t clock, uint64_t ms);

#define KVT__MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVT__MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
