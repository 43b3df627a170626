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
/* kvt_buf_new without the zero fill, for a buffer whose every byte the
 * caller writes before anyone reads it, or whose unwritten bytes nobody ever
 * reads: the open block of a KV cache (rows past the ones held are neither
 * read by attention, nor encoded, nor paged). Zero-filling such a block cost
 * the serve path an 18.9 MB memset and its page faults per request (12
 * blocks of 256 tokens x 768 x 2 x 4 bytes, 12% of a one-token request's
 * engine time), and the trim of those pages when it was freed. Same
 * contract as kvt_buf_new otherwise. */
struct kvt_buf;
int kvt__buf_new_uninit(size_t bytes, struct kvt_buf **out);
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

/* ---- buffer origins ----
 * A buffer whose bytes are also held durably elsewhere (a kv block restored
 * from the SSD tier: the bytes of one tensor in a block shard) may carry
 * its origin, so a live cache paging the block out can refer to that copy
 * instead of writing its own (residency.c). The owner of the copy (the
 * store) implements the ops; the cache code only calls them. */
typedef struct kvt__origin kvt__origin;
typedef struct kvt__origin_ops {
    /** Pins the copy against its owner's eviction and collection (a count:
     * pins nest). @return 0, or an error when the copy is gone (then the
     * caller keeps its own copy). Thread-safe. */
    int (*pin)(kvt__origin *o);
    /** Undoes one pin. Thread-safe. */
    void (*unpin)(kvt__origin *o);
    /** Reads n bytes of the copy from byte `at` on into dst (unchecked: the
     * caller checks them against its own checksum). @return 0, -errno,
     * KVT_EIO, KVT_EINVAL (a range past the copy). Thread-safe. */
    int (*read)(kvt__origin *o, void *dst, uint64_t at, size_t n);
    /** Frees o (its last reference went). */
    void (*free_fn)(kvt__origin *o);
} kvt__origin_ops;
struct kvt__origin {
    const kvt__origin_ops *ops;
    _Atomic int64_t refs;
};
/** One more reference on o (returns it; NULL gives NULL). */
kvt__origin *kvt__origin_retain(kvt__origin *o);
/** Drops one reference; the last one calls ops->free_fn. NULL is a no-op. */
void kvt__origin_release(kvt__origin *o);
struct kvt_buf;
/** Gives buffer b the origin o (takes over the caller's reference on o)
 * unless b has one already (then o is released). Thread-safe. */
void kvt__buf_set_origin(struct kvt_buf *b, kvt__origin *o);
/** b's origin (borrowed: valid while b is), NULL when none. Thread-safe. */
kvt__origin *kvt__buf_origin(const struct kvt_buf *b);

#endif
