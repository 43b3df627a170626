/*
 * kvtier/buffer.h: refcounted immutable host buffers.
 *
 * A kvt_buf is the unit of zero-copy sharing: a full kv block, a snapshot of a
 * ring, a recurrent state. Once a buffer is shared (refs > 1) nobody writes to
 * it; a writer that finds refs > 1 copies first (copy-on-write). The reference
 * count is atomic, so different threads may retain and release the same buffer;
 * the bytes themselves are not synchronised.
 */
#ifndef KVTIER_BUFFER_H
#define KVTIER_BUFFER_H

#include "kvtier/common.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_buf kvt_buf;

/** Allocates a buffer of `bytes` bytes (zero-filled), refs = 1.
 *
 * @param bytes size in bytes; 0 is allowed (data is then a valid non-NULL
 *        pointer to nothing).
 * @param out   receives the buffer; the caller owns one reference and releases
 *        it with kvt_buf_release().
 * @return 0, KVT_EINVAL (out NULL), KVT_ENOMEM. Thread-safe.
 */
KVT_API int kvt_buf_new(size_t bytes, kvt_buf **out);

/** Wraps memory kvtier does not own (an mmap'd file region, a device
 * staging area) as a buffer, refs = 1.
 *
 * `release(ctx, data, bytes)` runs exactly once, when the last reference is
 * released (it may be NULL). The memory must stay valid until then.
 * @return 0, KVT_EINVAL (out NULL, or data NULL with bytes > 0), KVT_ENOMEM
 * (then release is NOT called; the memory stays the caller's). Thread-safe.
 */
KVT_API int kvt_buf_wrap(void *data, size_t bytes,
                         void (*release)(void *ctx, void *data, size_t bytes), void *ctx,
                         kvt_buf **out);

/** Adds a reference; returns `b` (NULL-safe). Thread-safe. */
KVT_API kvt_buf *kvt_buf_retain(kvt_buf *b);
/** Drops a reference; the last one frees the buffer. NULL is a no-op. Thread-safe. */
KVT_API void kvt_buf_release(kvt_buf *b);
/** Start of the bytes; borrowed, valid while the caller holds a reference.
 * Thread-safe (the pointer never changes; the bytes are not synchronised). */
KVT_API void *kvt_buf_data(const kvt_buf *b);
/** Size in bytes (fixed at creation). Thread-safe. */
KVT_API size_t kvt_buf_bytes(const kvt_buf *b);
/** Current reference count (a snapshot: other threads may change it).
 * 1 means the caller holds the only reference and may write in place. */
KVT_API int64_t kvt_buf_refs(const kvt_buf *b);

/** Process-wide count of bytes copied by copy-on-write and clone paths since
 * start (relaxed atomic). Benchmarks read it to prove zero-copy sharing.
 * Thread-safe. */
KVT_API uint64_t kvt_buf_bytes_copied(void);
/** Adds `n` to the counter above; called by every cache kind that copies.
 * Thread-safe (relaxed atomic). */
KVT_API void kvt_buf_count_copy(uint64_t n);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_BUFFER_H */
