/*
 * common.c: status strings, the thread-local error detail, the pluggable
 * allocator, the clocks (now, condition-variable deadlines) and the UTF-8
 * check every module uses.
 * Owns no other state.
 */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static _Thread_local char kvt__errbuf[512];

static void *default_malloc(size_t n, void *ctx) { (void)ctx; return malloc(n ? n : 1); }
static void *default_realloc(void *p, size_t n, void *ctx) { (void)ctx; return realloc(p, n ? n : 1); }
static void default_free(void *p, void *ctx) { (void)ctx; free(p); }

static kvt_allocator kvt__alloc = {default_malloc, default_realloc, default_free, NULL};

KVT_API const char *kvt_strerror(int code)
{
    switch (code) {
#define KVT__CASE(name, value, msg) case value: return msg;
        KVT_ERRORS(KVT__CASE)
#undef KVT__CASE
    default:
        break;
    }
    if (code < 0 && code > -4096)
        return strerror(-code); /* glibc: static table, thread-safe for valid errnos */
    return "unknown error";
}

KVT_API const char *kvt_last_error(void) { return kvt__errbuf; }

void kvt__clear_error(void) { kvt__errbuf[0] = '\0'; }

int kvt__fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kvt__errbuf, sizeof kvt__errbuf, fmt, ap);
    va_end(ap);
    return code;
}

KVT_API int kvt_set_error(int code, const char *fmt, ...)
{
    char tmp[sizeof kvt__errbuf]; /* an argument may be kvt_last_error() itself */
    tmp[0] = '\0';
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(tmp, sizeof tmp, fmt, ap);
        va_end(ap);
    }
    memcpy(kvt__errbuf, tmp, sizeof tmp);
    return code;
}

KVT_API void kvt_set_allocator(const kvt_allocator *alloc)
{
    if (alloc)
        kvt__alloc = *alloc;
    else
        kvt__alloc = (kvt_allocator){default_malloc, default_realloc, default_free, NULL};
}

void *kvt__malloc(size_t bytes) { return kvt__alloc.malloc_fn(bytes, kvt__alloc.ctx); }
void *kvt__realloc(void *p, size_t bytes) { return kvt__alloc.realloc_fn(p, bytes, kvt__alloc.ctx); }
void kvt__free(void *p)
{
    if (p)
        kvt__alloc.free_fn(p, kvt__alloc.ctx);
}
KVT_API void kvt_string_free(char *s) { kvt__free(s); }
KVT_API void *kvt_malloc(size_t bytes) { return kvt__malloc(bytes); }
KVT_API void *kvt_realloc(void *ptr, size_t bytes) { return kvt__realloc(ptr, bytes); }
KVT_API void kvt_free(void *ptr) { kvt__free(ptr); }
KVT_API void *kvt_calloc(size_t n, size_t size) { return kvt__calloc(n, size); }
void *kvt__calloc(size_t n, size_t size)
{
    if (size && n > SIZE_MAX / size)
        return NULL;
    void *p = kvt__malloc(n * size);
    if (p)
        memset(p, 0, n * size);
    return p;
}
char *kvt__strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = kvt__malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

KVT_API uint64_t kvt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
KVT_API uint64_t kvt_now_ms(void) { return kvt_now_ns() / 1000000ull; }

struct timespec kvt__deadline(clockid_t clock, uint64_t ms)
{
    struct timespec t;
    clock_gettime(clock, &t);
    uint64_t ns = (uint64_t)t.tv_nsec + (ms % 1000) * 1000000ull;
    t.tv_sec += (time_t)(ms / 1000 + ns / 1000000000ull);
    t.tv_nsec = (long)(ns % 1000000000ull);
    return t;
}

/* Hand-decoded (no allocation), so it is cheap on every put and open. */
int kvt__utf8_valid(const char *str)
{
    if (!str)
        return 0;
    const unsigned char *s = (const unsigned char *)str;
    while (*s) {
        unsigned c = *s, n, cp;
        if (c < 0x80) {
            s++;
            continue;
        }
        if (c >= 0xc2 && c <= 0xdf)
            n = 1, cp = c & 0x1f;
        else if (c >= 0xe0 && c <= 0xef)
            n = 2, cp = c & 0x0f;
        else if (c >= 0xf0 && c <= 0xf4)
            n = 3, cp = c & 0x07;
        else
            return 0;
        for (unsigned i = 1; i <= n; i++) {
            if ((s[i] & 0xc0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i] & 0x3f);
        }
        if ((n == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (n == 3 && (cp < 0x10000 || cp > 0x10ffff)))
            return 0;
        s += n + 1;
    }
    return 1;
}
