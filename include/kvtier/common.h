/*
 * kvtier/common.h: status codes, error messages, the export macro and the
 * pluggable allocator shared by every kvtier module.
 *
 * Every kvtier call that can fail returns an int: 0 on success, a negative
 * KVT_E* code from the list below, or -errno for a system failure.
 * kvt_strerror() names both kinds. Calls that fail also leave a sentence
 * naming what was wrong (the file, the field, the numbers) in a thread-local
 * buffer read with kvt_last_error(). On error, out-parameters are zeroed or
 * NULL and nothing is left allocated. No call exits or aborts.
 *
 * Ownership, the same in every module: kvtier frees an array only if kvtier
 * allocated it, and frees each one it allocated at the documented end call
 * (kvt_state_clear, kvt_hit_clear, kvt_entry_clear). Calls that adopt
 * state (kvt_prompt_cache_put, kvt_prompt_cache_put_hit,
 * kvt_prompt_cache_object_put, kvt_service_publish) take the caches, the
 * attachments and the release hook on success, setting each slot to NULL,
 * and never free an array of yours (a stack array, your own malloc); a
 * successful kvt_service_publish also ends a state kvtier built, freeing its
 * arrays. On error they take nothing. So "call, then clear" is right on
 * every outcome.
 *
 * One verb per act: kvt_x_destroy ends an object (a handle or a cache),
 * kvt_x_clear ends a value struct you hold (kvt_hit, kvt_state, kvt_entry,
 * kvt_cache_state), kvt_x_release drops a reference or a hold (buffers,
 * admissions, leases), kvt_string_free frees a string kvtier returned.
 * Every one of them accepts NULL. A NULL namespace means "" (the base
 * model) in every call that takes one.
 */
#ifndef KVTIER_COMMON_H
#define KVTIER_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVT_API __attribute__((visibility("default")))
#define KVT_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define KVT_API
#define KVT_PRINTF(f, a)
#endif

/* X-macro list of kvtier's own status codes: (name, value, message). */
#define KVT_ERRORS(X)                                                          \
    X(KVT_OK, 0, "success")                                                    \
    X(KVT_EINVAL, -10001, "invalid argument")                                  \
    X(KVT_ENOMEM, -10002, "out of memory")                                     \
    X(KVT_ERANGE, -10003, "length outside the reachable range")                \
    X(KVT_ENOTFOUND, -10004, "not found")                                      \
    X(KVT_EFORMAT, -10005, "malformed file or data")                           \
    X(KVT_ECORRUPT, -10006, "checksum mismatch")                               \
    X(KVT_EIDENTITY, -10007, "state belongs to another model identity")        \
    X(KVT_EBUSY, -10008, "resource busy")                                      \
    X(KVT_ETOOBIG, -10009, "larger than the whole budget")                     \
    X(KVT_EUNSUPPORTED, -10010, "unsupported kind or version")                 \
    X(KVT_ECLOSED, -10011, "object already closed")                            \
    X(KVT_ECANCELED, -10012, "operation canceled")                             \
    X(KVT_EIO, -10013, "storage I/O failed")                                   \
    X(KVT_ESTALE, -10014, "result discarded: the cache was cleared meanwhile") \
    X(KVT_ELIMIT, -10015, "request exceeds a model or budget limit")           \
    X(KVT_EAGAIN, -10016, "does not fit now; retry later")                     \
    X(KVT_EREADONLY, -10017, "the tier is read-only")                          \
    X(KVT_EMISMATCH, -10018, "saved state does not match the request")

enum kvt_status {
#define KVT__ENUM(name, value, msg) name = value,
    KVT_ERRORS(KVT__ENUM)
#undef KVT__ENUM
};

/** Names a status code.
 *
 * @param code 0, a KVT_E* code, or -errno.
 * @return a static string, never NULL ("unknown error" for anything else).
 * Thread-safe.
 */
KVT_API const char *kvt_strerror(int code);

/** The detail sentence of the last failure on the calling thread.
 *
 * Set by every kvtier call that returns an error (e.g. "model.bin: file is
 * 1000 bytes, header says 1056540"). Borrowed, valid until the next kvtier
 * call on this thread. Returns "" when there is none. Thread-safe (the
 * buffer is thread-local).
 */
KVT_API const char *kvt_last_error(void);

/** Records `code`'s detail sentence (printf format) for kvt_last_error() on
 * the calling thread and returns code, so that code built on kvtier (an
 * engine, a backend's cache kind, a cold tier) reports its errors the way
 * kvtier does: `return kvt_set_error(KVT_EFORMAT, "%s: ...", path);`. The
 * sentence is cut at 511 bytes; an argument may be kvt_last_error() itself
 * (e.g. to prefix it). fmt NULL records "". Thread-safe (thread-local). */
KVT_API int kvt_set_error(int code, const char *fmt, ...) KVT_PRINTF(2, 3);

/** Pluggable allocator. All heap memory kvtier owns goes through these
 * three functions (same contracts as malloc/realloc/free), so tests can
 * inject out-of-memory failures. */
typedef struct kvt_allocator {
    void *(*malloc_fn)(size_t bytes, void *ctx);
    void *(*realloc_fn)(void *ptr, size_t bytes, void *ctx);
    void (*free_fn)(void *ptr, void *ctx);
    void *ctx;
} kvt_allocator;

/** Installs the process-wide allocator (NULL restores malloc/realloc/free).
 *
 * Must be called before any kvtier object exists and never while another
 * thread uses kvtier: memory allocated by one allocator is freed by the one
 * installed at the time. Not thread-safe.
 */
KVT_API void kvt_set_allocator(const kvt_allocator *alloc);

/** Allocation through the installed allocator (kvt_set_allocator), for code
 * built on kvtier whose memory must follow it (so one out-of-memory test
 * covers it, or one accounting allocator counts it): same contracts as
 * malloc, calloc (NULL when n * size overflows), realloc and free; malloc of
 * 0 bytes returns a unique pointer with the default allocator. Memory from
 * kvt_malloc / kvt_calloc / kvt_realloc is freed with kvt_free (NULL is a
 * no-op), under the same allocator. Thread-safe as the allocator is. */
KVT_API void *kvt_malloc(size_t bytes);
/** n * size zeroed bytes from the installed allocator; NULL when n * size
 * overflows or memory is short. Free with kvt_free. Thread-safe as the
 * allocator is. */
KVT_API void *kvt_calloc(size_t n, size_t size);
/** Resizes a block from kvt_malloc / kvt_calloc / kvt_realloc (ptr NULL:
 * as kvt_malloc) to `bytes`; on NULL (memory short) ptr is left valid and
 * still owned by the caller. Thread-safe as the allocator is. */
KVT_API void *kvt_realloc(void *ptr, size_t bytes);
/** Frees a block from kvt_malloc / kvt_calloc / kvt_realloc; NULL is a
 * no-op. Thread-safe as the allocator is. */
KVT_API void kvt_free(void *ptr);

/** Frees a string kvtier returned to the caller (kvt_service_stats_json()
 * and any other call whose doc says "caller frees with kvt_string_free"),
 * through the allocator installed by kvt_set_allocator(). NULL is a no-op.
 * Thread-safe for distinct strings. */
KVT_API void kvt_string_free(char *s);

/** Monotonic clock in milliseconds (CLOCK_MONOTONIC). Thread-safe. */
KVT_API uint64_t kvt_now_ms(void);
/** Monotonic clock in nanoseconds (CLOCK_MONOTONIC). Thread-safe. */
KVT_API uint64_t kvt_now_ns(void);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_COMMON_H */
