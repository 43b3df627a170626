/*
 * cache_internal.h: helpers shared by cache.c and the built-in cache kinds
 * (cache_kv.c, cache_rotating.c, cache_recurrent.c, cache_qkv.c); never
 * installed. The ops tables of the built-in kinds are declared here so the
 * registry in cache.c can list them.
 */
#ifndef KVTIER_CACHE_INTERNAL_H
#define KVTIER_CACHE_INTERNAL_H

#include "kvtier/cache.h"
#include "kvtier/io.h"
#include "kvtier/residency.h"

#include <stdbool.h>

extern const kvt_cache_ops kvt__kv_ops;
extern const kvt_cache_ops kvt__rotating_ops;
extern const kvt_cache_ops kvt__recurrent_ops;
extern const kvt_cache_ops kvt__qkv_ops;
extern const kvt_cache_ops kvt__qkvc_ops;

/** kv_dim of a rotating cache (c must be one). */
int32_t kvt__rotating_kv_dim(const kvt_cache *c);
/** kv_dim and block_tokens of a qkv cache (c must be one). */
int32_t kvt__qkv_kv_dim(const kvt_cache *c);
int32_t kvt__qkv_block_tokens(const kvt_cache *c);
/** kvt_kv_block_rows of a qkv cache (c must be one; out not NULL). */
int kvt__qkv_block_rows(const kvt_cache *c, int64_t index, kvt_kv_rows *out);
/** kv_dim, block_tokens and kvt_kv_block_rows of a qkvc cache (c must be
 * one; out not NULL). */
int32_t kvt__qkvc_kv_dim(const kvt_cache *c);
int32_t kvt__qkvc_block_tokens(const kvt_cache *c);
kvt_dtype kvt__qkvc_sealed_dtype(const kvt_cache *c);
int kvt__qkvc_block_rows(const kvt_cache *c, int64_t index, kvt_kv_rows *out);
/** The sealed blocks' table of a qkvc cache (c must be one), with its block
 * tokens, sealed block bytes ((2, B, kv_dim) of the sealed dtype: K rows,
 * then V rows) and offset (every token held, the open block's too). */
struct kvt__blocks *kvt__qkvc_table(const kvt_cache *c, int32_t *block_tokens, size_t *block_bytes,
                                    int64_t *offset);
/** kvt_kv_dtype of a rotating cache (c must be one). */
kvt_dtype kvt__rotating_dtype(const kvt_cache *c);

/** Largest kv_dim, block_tokens, window or group count a built-in kind
 * accepts (create and decode): keeps every byte size far from overflow. */
#define KVT__DIM_MAX (1 << 20)

/** Prepares `st` (already zeroed) for `n_tensors` tensors: copies kind,
 * offsets and params, allocates the tensor array with every tok range -1.
 * @return 0 or KVT_ENOMEM. */
int kvt__state_begin(kvt_cache_state *st, const char *kind, int64_t offset, int64_t min_offset,
                     int32_t n_params, const int64_t *params, int32_t n_tensors);

/** Fills tensor `t`: name, dtype, shape (ndim dims), data and bytes, token
 * range. Retains `owner` (may be NULL) for the state. */
void kvt__tensor_set(kvt_tensor *t, const char *name, kvt_dtype dt, int ndim, const int64_t *shape,
                     const void *data, size_t bytes, kvt_buf *owner, int64_t tok_begin, int64_t tok_end);

/** Checks that tensor `i` of `st` is named `name` with dtype `dt` and the
 * given shape (the generic structure of every tensor was already checked
 * by kvt_cache_decode). @return 0 or KVT_EFORMAT naming the mismatch. */
int kvt__tensor_expect(const kvt_cache_state *st, int32_t i, const char *name, kvt_dtype dt, int ndim,
                       const int64_t *shape);

/** Whether tensor `t` covers its owner buffer exactly (data is the start of
 * the owner, aligned for its dtype, and bytes its size): decode may then
 * retain the owner instead of copying (zero-copy restore). */
bool kvt__tensor_is_whole_owner(const kvt_tensor *t);

/** The buffer a single-buffer kind decodes tensor `t` into: its owner,
 * retained, when the tensor covers it exactly (zero-copy restore; *heap =
 * false), else a new counted copy (*heap = true). @return 0 or KVT_ENOMEM. */
int kvt__tensor_adopt(const kvt_tensor *t, kvt_buf **out, bool *heap);

/** Checks st->n_params == n and each params[i] in [lo[i], hi[i]].
 * @return 0 or KVT_EFORMAT naming the parameter (names[i]). */
int kvt__params_expect(const kvt_cache_state *st, int32_t n, const char *const *names, const int64_t *lo,
                       const int64_t *hi);

/** kvt_buf_new + memcpy of `bytes` from src (counted with kvt_buf_count_copy
 * when `count` is true). @return 0 or KVT_ENOMEM. */
int kvt__buf_copy(const void *src, size_t bytes, bool count, kvt_buf **out);

/* ---- int8 rows with per-group scales (cache.c) ------------------------------ */

/** Quantizes one row x (D floats, gs divides D) into scales (D / gs): each
 * scale = min(max|x| / 127, FLT_MAX / 128) of its group, and codes (D):
 * round(x / scale) in [-127, 127] (0 when the scale is 0). */
void kvt__q8_quantize_row(const float *x, size_t D, size_t gs, float *scales, int8_t *codes);
/** x[i] = codes[i] * scales[i / gs] for i in [0, D). */
void kvt__q8_dequantize_row(const float *scales, const int8_t *codes, size_t D, size_t gs, float *x);
/** Checks every scale of F32 tensor t is >= 0 and at most FLT_MAX / 128
 * (so code * scale is finite for every int8 code, -128 included).
 * @return 0 or KVT_EFORMAT naming the kind, the tensor and the index. */
int kvt__q8_check_scales(const kvt_tensor *t, const char *kind);

/* ---- block tables shared by the kv and qkv kinds (cache_kv.c) ------------- */

/** One block of a blocked kind. `heap` is true when the buffer was made by
 * kvt_buf_new in this library, so it may be written in place once no one
 * else holds it (refs == 1); a retained foreign buffer (a decoded file
 * region) is always copied before a write. */
typedef struct kvt__blk {
    kvt_buf *buf; /* the block's RAM copy; NULL while it is paged out (residency.h) */
    bool heap;
    bool staged;   /* buf was paged in by kvt_kv_pin (released by kvt_kv_unpin) */
    uint8_t state; /* kvt_block_state; RESIDENT without a residency policy */
} kvt__blk;

/** The page-file side of one block (residency.c), in a table of its own so a
 * cache that is never paged pays nothing for it. */
typedef struct kvt__blkres {
    struct kvt__page *page; /* its page-file copy, NULL when none */
    kvt_io_ticket *rd;      /* RESTORING: the read in flight */
    uint8_t parts;          /* staged or RESTORING: the halves its copy holds (or is reading): 1 K, 2 V, 3 both */
} kvt__blkres;

/** What a block table under a residency policy adds (residency.c): made
 * when the table is attached or a block is first paged (or cloned paged),
 * so a cache that is never paged pays one NULL pointer for it. */
typedef struct kvt__blocks_res {
    kvt__blkres *x;    /* (cap of the table) or NULL */
    kvt_residency *r;  /* the policy the table is attached to (its bound applies), NULL none */
    int32_t layer;     /* with r: the attention layer it was attached as */
    uint64_t charged;  /* with r: bytes of full blocks it charges to r's resident gauge */
    size_t charged_bb; /* with r: its block bytes */
    int64_t held;      /* blocks staged or being read (RESTORING) */
    /* an open attention window (kvt_kv_window_open): positions 0 .. win_total - 1
     * walk blocks 0 .. win_nb - 1 passes times; win_cursor is the next position
     * kvt_kv_window_get takes, win_ahead the next one read-ahead looks at */
    int64_t win_nb, win_total, win_cursor, win_ahead;
    int32_t win_size; /* > 0 while a window is open: blocks held at most */
    int32_t win_split; /* the open window's passes read only the half they use (even passes K, odd V) */
} kvt__blocks_res;

/** Block table: v[0..n) hold the blocks of ceil(offset / B) tokens. */
typedef struct kvt__blocks {
    int64_t n, cap;
    kvt__blk *v;          /* (cap) */
    kvt__blocks_res *res; /* NULL unless residency is involved */
} kvt__blocks;

/** Copies the first `rows` token rows of a block into an empty block of the
 * same kind; returns the bytes copied. */
typedef size_t (*kvt__copy_rows_fn)(void *dst, const void *src, int64_t rows, const void *ctx);

/** Makes room to write tokens [offset, offset + n) (n >= 1): copies a partial
 * tail block that is shared or foreign (copy-on-write, counted with
 * kvt_buf_count_copy) and allocates the new blocks of block_bytes bytes.
 * Afterwards b->n = ceil((offset + n) / B) and every block from the one
 * holding token `offset` on is private and writable.
 * @return 0 or KVT_ENOMEM (the table is then unchanged). */
int kvt__blocks_prepare(kvt__blocks *b, int64_t offset, int64_t n, int32_t block_tokens, size_t block_bytes,
                        kvt__copy_rows_fn copy_rows, const void *ctx);
/** Retains every block of src into dst (zero bytes copied).
 * @return 0 or KVT_ENOMEM (dst is then empty). */
int kvt__blocks_clone(const kvt__blocks *src, kvt__blocks *dst);
/** Releases blocks [keep, n) and sets n = keep. */
void kvt__blocks_truncate(kvt__blocks *b, int64_t keep);
/** Releases every block and the table. */
void kvt__blocks_free(kvt__blocks *b);
/** Appends one block (ownership of buf passes to the table on success).
 * @return 0 or KVT_ENOMEM (buf stays the caller's). */
int kvt__blocks_push(kvt__blocks *b, kvt_buf *buf, bool heap);
/** Calls fn on the RAM copy of every block (blocks paged out have none). */
void kvt__blocks_foreach(const kvt__blocks *b, void (*fn)(kvt_buf *buf, void *ctx), void *ctx);

/* ---- bounded residency of block tables (residency.c) ----------------------- */

/** Releases everything block i of t holds (RAM copy, page-file copy, a read
 * in flight) and zeroes its entry. */
void kvt__blk_release(kvt__blocks *t, int64_t i);
/** dst block i = a clone of src block i (retains its RAM copy and page-file
 * copy; a read in flight is not shared: the clone sees that block as paged
 * out). dst->x must exist when src->x does. */
void kvt__blk_clone(const kvt__blocks *src, kvt__blocks *dst, int64_t i);
/** Makes block i a private RAM block without a page-file copy (state
 * RESIDENT), reading it in first when it is paged out (a block about to be
 * written again: a trim into it). @return 0 or an error of the read. */
int kvt__blk_make_private(kvt__blocks *t, int64_t i, size_t block_bytes);
/** A buffer holding block i's bytes: its RAM copy retained, or a
 * checksummed read of its page-file copy. @return 0 or an error of the read. */
int kvt__blk_read(const kvt__blocks *t, int64_t i, size_t block_bytes, kvt_buf **out);
/** Makes t->res and its page table (cap entries, zeroed) if they do not
 * exist. @return 0 or KVT_ENOMEM. */
int kvt__blocks_ensure_res(kvt__blocks *t);
/** Applies the bound of the table's policy after its full blocks [0, full)
 * changed: completed writes become durable, the oldest private blocks beyond
 * the table's share are written and their RAM released. No-op without a
 * bounded policy. @return 0 or KVT_ENOMEM (a failed write is counted, not
 * returned). */
int kvt__blocks_enforce(kvt__blocks *b, int64_t full, size_t block_bytes);
/** Detaches a table from its policy (releasing the reference). */
void kvt__blocks_detach(kvt__blocks *b);

/** The block table a residency pages, with its block tokens, block bytes
 * and offset: a kv cache's blocks, or a qkvc cache's sealed blocks (every
 * one full; its f32 open block, at index n when it holds rows, is outside
 * the table and never paged, and so are a U8 cache's per-block scales).
 * NULL when c is neither. */
kvt__blocks *kvt__kv_table(const kvt_cache *c, int32_t *block_tokens, size_t *block_bytes, int64_t *offset);

#endif
