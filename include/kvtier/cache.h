/*
 * kvtier/cache.h: per-layer cache state, the ops table every cache kind
 * implements, the built-in host kinds and method attachments.
 *
 * A layer cache holds the state of one model layer after `offset` tokens.
 * Every kind reports its reachable range [min_offset, offset]: the lengths it
 * can be cut back to with kvt_cache_trim():
 *   kv         plain attention K/V in blocks of B tokens    [0, offset]
 *   rotating   sliding window W (ring, optional keep sinks) [0, offset] until
 *              the ring wraps, [offset, offset] after
 *   recurrent  fixed-size state (SSM / linear attention)    [offset, offset]
 *   qkv        int8 codes + one f32 scale per group          [0, offset]
 *   qkvc       sealed blocks as 8-bit codes with per-channel [sealed, offset]
 *              scales, or as f16 / bf16; the open block f32
 * kv and rotating hold K/V in a storage dtype (F32, F16, BF16; rotating also
 * I8 with per-group scales) recorded in their encoded params and on every
 * tensor; kvt_kv_block_rows / kvt_rotating_rows lend the rows in that dtype.
 * Backends bring their own kinds by filling a kvt_cache_ops table and
 * registering it (kvt_cache_register_kind) so stored state can be decoded.
 *
 * Sharing: kvt_cache_clone() returns an independent object that shares every
 * immutable buffer with the source (zero bytes copied for full blocks); the
 * first write into a shared buffer copies that one buffer (copy-on-write).
 *
 * Thread-safety: one kvt_cache object is used by one thread at a time. Two
 * clones may be used by two threads at once (shared buffers are immutable and
 * their reference counts atomic).
 */
#ifndef KVTIER_CACHE_H
#define KVTIER_CACHE_H

#include "kvtier/buffer.h"
#include "kvtier/common.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- dtypes and named tensors (the codec the SSD tier writes) ---------- */

typedef enum kvt_dtype {
    KVT_DTYPE_F32 = 0,
    KVT_DTYPE_F16,
    KVT_DTYPE_BF16,
    KVT_DTYPE_I8,
    KVT_DTYPE_U8,
    KVT_DTYPE_I32,
    KVT_DTYPE_I64,
    KVT_DTYPE_COUNT
} kvt_dtype;

/** Bytes per element of `dt` (0 for an unknown value). Thread-safe. */
KVT_API size_t kvt_dtype_size(kvt_dtype dt);
/** The safetensors name of `dt` ("F32", "F16", "BF16", "I8", "U8", "I32",
 * "I64"); NULL for an unknown value. Thread-safe. */
KVT_API const char *kvt_dtype_name(kvt_dtype dt);
/** Parses a safetensors dtype name. @return 0 or KVT_EFORMAT. Thread-safe. */
KVT_API int kvt_dtype_parse(const char *name, kvt_dtype *out);

/** Converts n floats of src to dt into dst (n elements of dt):
 * KVT_DTYPE_F32 copies; KVT_DTYPE_F16 (IEEE binary16) and KVT_DTYPE_BF16
 * round to nearest, ties to even (NaN stays a quiet NaN; a value past the
 * f16 range becomes an infinity of its sign, f16 keeps subnormals).
 * @return 0; KVT_EINVAL (NULL pointer with n > 0, or another dtype).
 * Thread-safe. */
KVT_API int kvt_dtype_from_f32(kvt_dtype dt, const float *src, void *dst, size_t n);
/** Converts n elements of dt (KVT_DTYPE_F32, F16 or BF16) at src to floats
 * in dst; exact (every f16 and bf16 value is a float).
 * @return 0; KVT_EINVAL (NULL pointer with n > 0, or another dtype).
 * Thread-safe. */
KVT_API int kvt_dtype_to_f32(kvt_dtype dt, const void *src, float *dst, size_t n);

#define KVT_TENSOR_NAME_MAX 64
#define KVT_TENSOR_MAX_DIMS 4

/** One named tensor of an encoded cache.
 * `data` is borrowed from `owner` (a retained reference released by
 * kvt_cache_state_clear) or, when owner is NULL, from the cache object that
 * produced the state (valid until that object is next modified or destroyed). */
typedef struct kvt_tensor {
    char name[KVT_TENSOR_NAME_MAX]; /* unique within one cache state, e.g. "blk3" */
    kvt_dtype dtype;
    int32_t ndim;                           /* 1..KVT_TENSOR_MAX_DIMS */
    int64_t shape[KVT_TENSOR_MAX_DIMS];     /* elements per dim, outermost first */
    const void *data;                       /* (bytes) */
    size_t bytes;                           /* = product(shape) * dtype size */
    kvt_buf *owner;                         /* retained, or NULL (see above) */
    /* Token range [tok_begin, tok_end) when this tensor is exactly one full,
     * immutable kv block of the layer (the SSD tier content-addresses those
     * and stores them once); tok_begin = tok_end = -1 otherwise. */
    int64_t tok_begin, tok_end;
} kvt_tensor;

#define KVT_CACHE_PARAMS_MAX 8

/** A cache serialised to named tensors plus a few integer parameters.
 * Produced by kvt_cache_encode(), consumed by kvt_cache_decode(). */
typedef struct kvt_cache_state {
    char kind[32];               /* registered kind name, e.g. "kv" */
    int64_t offset;              /* tokens the state holds */
    int64_t min_offset;          /* reachable range start (tokens) */
    int32_t n_params;            /* used entries of params */
    int64_t params[KVT_CACHE_PARAMS_MAX]; /* kind-specific, documented per kind */
    int32_t n_tensors;
    kvt_tensor *tensors;         /* (n_tensors), owned by the state */
} kvt_cache_state;

/** Releases a state's tensor array and every owner reference in it, then
 * zeroes the struct. NULL is a no-op. */
KVT_API void kvt_cache_state_clear(kvt_cache_state *st);

/* ---- the ops table ------------------------------------------------------ */

typedef struct kvt_cache kvt_cache;

/** Operations of one cache kind. Every pointer is required unless noted. */
typedef struct kvt_cache_ops {
    const char *kind; /* unique name, at most 31 bytes, e.g. "kv" */
    /** Bytes held outside the buffers foreach_buf visits (headers, tables). */
    size_t (*private_bytes)(const kvt_cache *c);
    /** Calls fn once for every refcounted buffer the cache holds (full kv
     * blocks, shared rings). Lets owners count a shared buffer once. */
    void (*foreach_buf)(const kvt_cache *c, void (*fn)(kvt_buf *b, void *ctx), void *ctx);
    /** Reachable range [*min_offset, *offset] in tokens. */
    void (*range)(const kvt_cache *c, int64_t *min_offset, int64_t *offset);
    /** Cuts the cache back to `length` tokens; length must be inside the range. */
    int (*trim)(kvt_cache *c, int64_t length);
    /** Zero-copy clone (shares buffers); the clone is owned by the caller. */
    int (*clone)(const kvt_cache *c, kvt_cache **out);
    /** Appends `n_tokens` tokens of state; `inputs` is kind-specific (see the
     * built-in kinds below). */
    int (*append)(kvt_cache *c, int64_t n_tokens, const void *const *inputs);
    /** Frees the object and drops its buffer references. */
    void (*destroy)(kvt_cache *c);
    /** Serialises to named tensors (sharing buffers where possible). */
    int (*encode)(const kvt_cache *c, kvt_cache_state *out);
    /** Builds a new cache of this kind from a state (copies or retains the
     * tensors' owners). Validates every parameter and tensor size. */
    int (*decode)(const kvt_cache_state *st, kvt_cache **out);
} kvt_cache_ops;

/** Common header of every cache object; a kind's struct begins with it. */
struct kvt_cache {
    const kvt_cache_ops *ops;
};

/* ---- generic calls (dispatch through ops) -------------------------------- */

/** Kind name of `c` (borrowed, static). */
KVT_API const char *kvt_cache_kind(const kvt_cache *c);

/** Total bytes `c` holds (private bytes + every buffer, shared or not).
 * Owners that hold many caches count shared buffers once themselves with
 * foreach_buf. */
KVT_API size_t kvt_cache_bytes(const kvt_cache *c);

/** Reachable range in tokens: *min_offset <= *offset. Either pointer may be NULL. */
KVT_API void kvt_cache_range(const kvt_cache *c, int64_t *min_offset, int64_t *offset);

/** Tokens the cache holds (its offset). */
KVT_API int64_t kvt_cache_offset(const kvt_cache *c);

/** Block granule below the reachable range: a cache with granule g > 0 can
 * also be cut back to every multiple of g tokens below min_offset (a qkvc
 * cache drops whole sealed blocks: g is its block_tokens; what remains is
 * exactly the state an uncached run in that scheme holds there). 0 for
 * every other kind and for NULL. Thread-safe on a cache no one mutates. */
KVT_API int64_t kvt_cache_trim_granule(const kvt_cache *c);

/** Whether `length` tokens is reachable: inside [min_offset, offset], or a
 * multiple of kvt_cache_trim_granule() below min_offset. */
KVT_API int kvt_cache_can_trim(const kvt_cache *c, int64_t length);

/** Cuts the cache back to `length` tokens.
 * @return 0; KVT_EINVAL (c NULL); KVT_ERANGE when length is not reachable
 * (kvt_cache_can_trim: outside [min_offset, offset] and not a multiple of
 * the granule below min_offset; the cache is unchanged); KVT_ENOMEM when a
 * copy-on-write copy fails (unchanged). Not thread-safe with other calls on
 * the same object (clones are independent objects). */
KVT_API int kvt_cache_trim(kvt_cache *c, int64_t length);

/** Zero-copy clone. @param out receives a new object the caller owns and
 * destroys with kvt_cache_destroy(). @return 0, KVT_EINVAL, KVT_ENOMEM. */
KVT_API int kvt_cache_clone(const kvt_cache *c, kvt_cache **out);

/** Appends n_tokens tokens of state (kind-specific inputs, see each kind).
 * @return 0; KVT_EINVAL (bad arguments); KVT_ERANGE (capacity); KVT_ENOMEM.
 * On error the cache is unchanged. */
KVT_API int kvt_cache_append(kvt_cache *c, int64_t n_tokens, const void *const *inputs);

/** Frees `c` (NULL is a no-op). Buffers shared with clones stay alive
 * until their last holder releases them. */
KVT_API void kvt_cache_destroy(kvt_cache *c);

/** Serialises `c` into `out` (zeroed first). On success the caller owns the
 * state and frees it with kvt_cache_state_clear(). @return 0; KVT_EINVAL (c or
 * out NULL); KVT_ENOMEM. Thread-safe with other readers of `c`. */
KVT_API int kvt_cache_encode(const kvt_cache *c, kvt_cache_state *out);

/** Rebuilds a cache from a state, by the kind registered under st->kind.
 * Untrusted input: every parameter and tensor size is checked.
 * @param out receives a new object the caller owns and destroys with
 * kvt_cache_destroy().
 * @return 0; KVT_EINVAL (st or out NULL); KVT_EUNSUPPORTED (unknown kind);
 * KVT_EFORMAT (a parameter or tensor that does not fit the kind;
 * kvt_last_error names it); KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_cache_decode(const kvt_cache_state *st, kvt_cache **out);

/** Registers a backend kind so kvt_cache_decode() can rebuild it. The ops
 * table is borrowed for the life of the process. Built-in kinds are always
 * registered. @return 0; KVT_EINVAL (missing op or name); KVT_EBUSY (name
 * taken); KVT_ENOMEM (more than 32 kinds). Thread-safe. */
KVT_API int kvt_cache_register_kind(const kvt_cache_ops *ops);

/** Makes a model's fresh (empty) per-layer caches: fills caches[0..n) for
 * the n layers the owner was configured with (the slots arrive NULL).
 * @return 0, or a negative status; on error kvtier destroys whatever caches
 * were already put in the slots. Called by kvtier without any of its locks
 * held, possibly from several threads at once: it must be safe to call
 * concurrently. `ctx` is the pointer given beside the function. */
typedef int (*kvt_new_caches_fn)(void *ctx, kvt_cache **caches);

/** Clones `n` caches into out[0..n) (all or nothing: on error nothing is
 * left allocated). @return 0; KVT_EINVAL (n < 0, or caches/out NULL with
 * n > 0); otherwise as kvt_cache_clone. */
KVT_API int kvt_caches_clone(kvt_cache *const *caches, int n, kvt_cache **out);
/** Destroys `n` caches and NULLs the slots (NULL slots are skipped). */
KVT_API void kvt_caches_destroy(kvt_cache **caches, int n);

/* ---- kind "kv": plain attention K/V in blocks -------------------------- */

/** Creates an empty kv cache for one layer.
 *
 * Layout: a list of blocks of `block_tokens` tokens; each block is one
 * kvt_buf holding K then V, each (block_tokens, kv_dim) float32 row-major,
 * i.e. 2 * block_tokens * kv_dim * 4 bytes. Full blocks are immutable and
 * shared by clones; the last, partially filled block is the mutable tail,
 * copied on first write when shared.
 * append inputs: inputs[0] = K (n_tokens, kv_dim) f32, inputs[1] = V
 * (n_tokens, kv_dim) f32; both copied in.
 * encode: one tensor per block, named "blk<i>", F32 shape (2, n, kv_dim)
 * with n = tokens in that block; params = {kv_dim, block_tokens}.
 *
 * @param kv_dim       floats per token per K (= n_kv_heads * head_dim), >= 1
 * @param block_tokens tokens per block B, >= 1 (the default is 256)
 * @return 0, KVT_EINVAL, KVT_ENOMEM.
 */
KVT_API int kvt_kv_create(int32_t kv_dim, int32_t block_tokens, kvt_cache **out);

/** Creates an empty kv cache that stores K and V as `dtype` (its storage
 * scheme): KVT_DTYPE_F32 (exactly kvt_kv_create), KVT_DTYPE_F16 or
 * KVT_DTYPE_BF16 (half the bytes: each block is 2 * block_tokens * kv_dim * 2
 * bytes). append takes f32 K/V as kvt_kv_create documents and converts them
 * with kvt_dtype_from_f32. encode: tensors "blk<i>" of that dtype, shape
 * (2, n, kv_dim); params = {kv_dim, block_tokens} for F32 (as kvt_kv_create),
 * {kv_dim, block_tokens, dtype} otherwise (dtype as its kvt_dtype value).
 * decode refuses a tensor whose dtype differs from the params' (KVT_EFORMAT).
 * For int8 K/V use the qkv kind (kvt_qkv_create).
 * @return 0; KVT_EINVAL (a bad dimension or another dtype); KVT_ENOMEM. */
KVT_API int kvt_kv_create_dtype(int32_t kv_dim, int32_t block_tokens, kvt_dtype dtype, kvt_cache **out);

/** Borrowed K and V rows of a kv, qkv or rotating cache in its storage
 * scheme, as attention reads them (filled by kvt_kv_block_rows and
 * kvt_rotating_rows). Element i of row t of K is
 *   F32/F16/BF16: ((const T *)k)[t * kv_dim + i] converted to float
 *   I8:           ((const int8_t *)k)[t * kv_dim + i] * k_scale[t * (kv_dim / group_size) + i / group_size]
 *                 (one float multiply: exactly what kvt_qkv_read_block returns)
 *   U8:           fmaf(((const uint8_t *)k)[t * kv_dim + i], k_scale[i], k_min[i])
 *                 (per channel: one step and one minimum per element index, for all n rows)
 * V alike. Valid until the cache is next modified or destroyed. */
typedef struct kvt_kv_rows {
    kvt_dtype dtype;                /* KVT_DTYPE_F32, F16, BF16, I8 or U8 */
    const void *k, *v;              /* (n, kv_dim) elements of dtype, rows kv_dim elements apart */
    const float *k_scale, *v_scale; /* I8: (n, kv_dim / group_size) scales; U8: (kv_dim) steps; NULL otherwise */
    const float *k_min, *v_min;     /* U8: (kv_dim) minima; NULL otherwise */
    int32_t group_size;             /* I8: elements per scale; 0 otherwise */
    int32_t n;                      /* rows */
} kvt_kv_rows;

/** Rows of block `index` of a kv, qkv or qkvc cache (see kvt_kv_rows);
 * out->n is block_tokens except for the tail (qkvc: U8, F16 or BF16 rows for a sealed
 * block, F32 rows for the open one). Thread-safe with other readers.
 * @return 0; KVT_EINVAL (NULL out, not a kv/qkv/qkvc cache, or a kv block
 * that is paged out or being read back under a residency bound:
 * kvtier/residency.h, kvt_kv_pin it first); KVT_ERANGE (no such block). */
KVT_API int kvt_kv_block_rows(const kvt_cache *c, int64_t index, kvt_kv_rows *out);

/** Storage dtype of the K/V of a kv, rotating, qkv or qkvc cache
 * (KVT_DTYPE_F32, F16, BF16; I8 for qkv and int8 rotating caches; for qkvc
 * the dtype of its sealed blocks: U8, F16 or BF16, whose open block
 * kvt_kv_block_rows still lends as F32); KVT_DTYPE_COUNT for NULL and other
 * kinds. Thread-safe. */
KVT_API kvt_dtype kvt_kv_dtype(const kvt_cache *c);

/** Borrowed pointers into block `index` of an F32 kv cache (other schemes:
 * kvt_kv_block_rows). *k and *v point at (*n_tokens, kv_dim) f32 rows, valid until the cache is
 * next modified or destroyed. *n_tokens is block_tokens except for the tail.
 * @return 0; KVT_EINVAL (not a kv cache, one stored in another dtype, or a
 * block paged out under a residency bound: kvtier/residency.h, kvt_kv_pin it
 * first); KVT_ERANGE (no such block). */
KVT_API int kvt_kv_block(const kvt_cache *c, int64_t index, const float **k, const float **v,
                         int32_t *n_tokens);
/** Blocks of a kv, qkv or qkvc cache that hold tokens: ceil(offset / B),
 * the last one possibly partial (the mutable tail); valid block indices for
 * kvt_kv_block() / kvt_kv_block_rows() / kvt_qkv_read_block() are
 * [0, count). 0 for an empty cache and for other kinds. Thread-safe with
 * other readers. */
KVT_API int64_t kvt_kv_block_count(const kvt_cache *c);
/** Tokens per block of a kv, qkv or qkvc cache; 0 for other kinds. */
KVT_API int32_t kvt_kv_block_tokens(const kvt_cache *c);
/** Elements per token of K (and of V) of a kv, rotating, qkv or qkvc cache;
 * 0 otherwise. */
KVT_API int32_t kvt_kv_dim(const kvt_cache *c);

/* ---- kind "rotating": sliding-window ring ---------------------------------- */

/** Creates an empty rotating (sliding-window) cache for one layer.
 *
 * The ring holds `window` token slots of K and V, each (window, kv_dim) f32.
 * The first `keep` tokens (attention sinks) stay in slots [0, keep) forever;
 * later tokens rotate through slots [keep, window). Before the ring wraps
 * (offset <= window) the range is [0, offset]; after it only [offset, offset].
 * append inputs: as kv. encode: tensor "ring" F32 (2, window, kv_dim) holding
 * min(offset, window) valid slots; params = {kv_dim, window, keep}.
 *
 * @param window slots W >= 1; @param keep 0 <= keep < window.
 * @return 0, KVT_EINVAL, KVT_ENOMEM. Thread-safe (creates a new object).
 */
KVT_API int kvt_rotating_create(int32_t kv_dim, int32_t window, int32_t keep, kvt_cache **out);

/** Creates an empty rotating cache whose ring stores K and V as `dtype`:
 * KVT_DTYPE_F32 (exactly kvt_rotating_create), F16, BF16 (converted with
 * kvt_dtype_from_f32), or I8 (every `group_size` consecutive floats of a
 * token row share one f32 scale, as the qkv kind quantizes them).
 * Ring layout: F32/F16/BF16 (2, window, kv_dim) of dtype; I8 scales (2,
 * window, kv_dim / group_size) f32 then codes (2, window, kv_dim) i8.
 * encode: F32 as kvt_rotating_create; F16/BF16 tensor "ring" of that dtype
 * (2, window, kv_dim); I8 tensors "ring.q" I8 (2, window, kv_dim) and
 * "ring.s" F32 (2, window, kv_dim / group_size); params = {kv_dim, window,
 * keep, dtype, group_size} (group_size 0 unless I8) for every dtype but F32.
 * decode refuses a tensor whose dtype differs from the params' (KVT_EFORMAT).
 * @param group_size I8: >= 1 and divides kv_dim; ignored otherwise.
 * @return 0; KVT_EINVAL (a bad dimension, dtype or group size); KVT_ENOMEM.
 * Thread-safe (creates a new object). */
KVT_API int kvt_rotating_create_dtype(int32_t kv_dim, int32_t window, int32_t keep, kvt_dtype dtype,
                                      int32_t group_size, kvt_cache **out);

/** The ring of a rotating cache in its storage scheme (see kvt_kv_rows):
 * the first out->n = min(offset, window) slots, in storage order (as
 * kvt_rotating_view). Thread-safe with other readers.
 * @return 0; KVT_EINVAL (NULL out, or not a rotating cache). */
KVT_API int kvt_rotating_rows(const kvt_cache *c, kvt_kv_rows *out);

/** Borrowed view of the ring of an F32 rotating cache (other schemes:
 * kvt_rotating_rows): *k, *v are (window, kv_dim) f32 with the first
 * *n_valid slots filled (n_valid = min(offset, window)). Slot order is
 * storage order, not token order: attention that is order-free over its keys
 * (softmax with RoPE already applied to K) can use it as is.
 * Valid until the cache is next modified or destroyed.
 * @return 0 or KVT_EINVAL (not a rotating cache, or one stored in another
 * dtype). */
KVT_API int kvt_rotating_view(const kvt_cache *c, const float **k, const float **v, int32_t *n_valid);

/* ---- kind "recurrent": fixed-size state -------------------------------------- */

/** Creates a recurrent-state cache of `state_bytes` bytes (zeros, offset 0).
 * append inputs: inputs[0] = the whole new state (state_bytes) after the
 * n_tokens new tokens; offset += n_tokens. Range is [offset, offset].
 * encode: tensor "state" U8 (state_bytes); params = {state_bytes}.
 * @return 0, KVT_EINVAL (state_bytes 0), KVT_ENOMEM. Thread-safe (creates a
 * new object). */
KVT_API int kvt_recurrent_create(size_t state_bytes, kvt_cache **out);

/** Borrowed pointer to the current state (state_bytes bytes), valid until the
 * cache is next modified or destroyed; NULL when c is not recurrent. */
KVT_API const void *kvt_recurrent_state(const kvt_cache *c);

/* ---- kind "qkv": int8 quantized kv ------------------------------------------ */

/** Creates an empty int8-quantized kv cache.
 *
 * Blocks of block_tokens tokens; within each token row of K (and V) every
 * `group_size` consecutive floats share one f32 scale = max|x| / 127 and are
 * stored as round(x / scale) in int8. append inputs: as kv (f32 K and V,
 * quantized on the way in). encode: tensors "blk<i>.q" I8 (2, n, kv_dim) and
 * "blk<i>.s" F32 (2, n, kv_dim / group_size); params = {kv_dim, block_tokens,
 * group_size}. A scale is at most FLT_MAX / 128 (quantizing clamps it there,
 * so values beyond FLT_MAX * 127 / 128 or infinite read back as +-127 steps),
 * so every int8 code reads back finite; decode (and an I8 rotating ring's)
 * refuses a scale that is negative, NaN or above it (KVT_EFORMAT).
 * @param group_size >= 1 and divides kv_dim. @return 0, KVT_EINVAL, KVT_ENOMEM.
 */
KVT_API int kvt_qkv_create(int32_t kv_dim, int32_t group_size, int32_t block_tokens, kvt_cache **out);

/** Dequantizes block `index` into caller buffers k_out and v_out, each at
 * least (block_tokens, kv_dim) floats; *n_tokens receives the tokens in it.
 * @return 0, KVT_EINVAL (not qkv), KVT_ERANGE (no such block). */
KVT_API int kvt_qkv_read_block(const kvt_cache *c, int64_t index, float *k_out, float *v_out,
                               int32_t *n_tokens);

/* ---- kind "qkvc": 8-bit kv quantized per channel ------------------------------ */

/** Creates an empty kv cache that stores K and V as 8-bit codes quantized per
 * channel over each block of block_tokens tokens (KIVI's scheme for K, here
 * for V too; asymmetric): in a sealed block, channel c of K has min[c] and
 * step[c] = (max - min) / 255 over the block's tokens, and element c of
 * token t is stored as round((x - min[c]) / step[c]) in [0, 255] and read as
 * fmaf(code, step[c], min[c]) (kvt_kv_rows, dtype U8); V alike.
 * A channel's scale depends on all of its block's tokens, so the open block
 * (the tail, up to block_tokens tokens) is kept in f32 and sealed only when a
 * token of the next block is appended: attention of a token reads its own
 * block in f32 and every earlier block quantized. Range: [sealed tokens,
 * offset] (a cut into a sealed block would need the f32 rows that sealing
 * dropped). append inputs: as kv (f32 K and V); on an error the cache is
 * unchanged. RAM: each sealed block 2 * block_tokens * kv_dim + 16 * kv_dim
 * bytes; the tail 8 * block_tokens * kv_dim bytes.
 * encode: params {kv_dim, block_tokens, layout} (layout 1 is this byte
 * layout; decode refuses another with KVT_EFORMAT); min_offset = sealed
 * tokens; per sealed block i tensors "blk<i>.q" U8 (2, B, kv_dim) (K codes
 * then V codes) and "blk<i>.s" F32 (4, kv_dim) (K min, K step, V min, V
 * step), both with the block's token range; then, when the open block holds
 * tokens, "tail" F32 (2, rows, kv_dim) with no token range. decode adopts a
 * tensor that covers its own buffer without copying (zero-copy restore) and
 * refuses a min or step that is not finite or a negative step.
 * decode also refuses a step that makes code 255 read as infinity
 * (fmaf(255, step, min) not finite); sealing never writes one.
 * @return 0; KVT_EINVAL (a dimension outside [1, 2^20] or NULL out); KVT_ENOMEM. */
KVT_API int kvt_qkvc_create(int32_t kv_dim, int32_t block_tokens, kvt_cache **out);

/** Creates an empty qkvc cache whose sealed blocks are stored as `sealed`:
 * KVT_DTYPE_U8 (exactly kvt_qkvc_create), or KVT_DTYPE_F16 / KVT_DTYPE_BF16
 * (each value of the f32 open block rounded to nearest even when the block
 * is sealed, kvt_dtype_from_f32; no scales). The open-block rule, the range
 * [sealed tokens, offset], append and zero-copy decode are as
 * kvt_qkvc_create documents; kvt_kv_block_rows lends a sealed block as
 * F16/BF16 rows and the open block as F32 rows.
 * RAM (F16/BF16): each sealed block 4 * block_tokens * kv_dim bytes; the
 * open block 8 * block_tokens * kv_dim bytes.
 * encode (F16/BF16): params {kv_dim, block_tokens, layout, dtype} (layout 1,
 * dtype its kvt_dtype value); min_offset = sealed tokens; per sealed block i
 * one tensor "blk<i>" of that dtype (2, B, kv_dim) (K rows then V rows) with
 * the block's token range; then "tail" F32 (2, rows, kv_dim) as for U8.
 * decode refuses a dtype other than F16 or BF16 in the 4th param, and any
 * tensor whose name, dtype or shape differs (KVT_EFORMAT).
 * @return 0; KVT_EINVAL (a dimension outside [1, 2^20], another dtype, or NULL
 * out); KVT_ENOMEM. */
KVT_API int kvt_qkvc_create_dtype(int32_t kv_dim, int32_t block_tokens, kvt_dtype sealed, kvt_cache **out);

/* ---- attachments: opaque method state -------------------------------------- */

typedef struct kvt_attachment kvt_attachment;

/** Operations of an attachment kind. */
typedef struct kvt_attachment_ops {
    const char *kind;                                   /* e.g. "blob" */
    size_t (*bytes)(const kvt_attachment *a);           /* bytes held */
    int (*clone)(const kvt_attachment *a, kvt_attachment **out); /* zero-copy where possible */
    void (*destroy)(kvt_attachment *a);
    /** Optional: the bytes to persist (borrowed, valid while `a` lives);
     * NULL ops means the attachment is never written to a lower tier. */
    int (*serialize)(const kvt_attachment *a, const void **data, size_t *bytes);
} kvt_attachment_ops;

/** Common header of every attachment. An entry that carries any attachment
 * is untrimmable: it serves only prompts that extend all of its tokens. */
struct kvt_attachment {
    const kvt_attachment_ops *ops;
    char name[KVT_TENSOR_NAME_MAX]; /* what the method calls it, e.g. "draft.hidden" */
};

/** Creates a "blob" attachment: a copy of `bytes` bytes of `data` in a
 * refcounted buffer (clones share it). @return 0, KVT_EINVAL (out NULL, name
 * NULL or of 64 bytes or more, data NULL with bytes > 0), KVT_ENOMEM.
 * Thread-safe. */
KVT_API int kvt_attachment_blob(const char *name, const void *data, size_t bytes, kvt_attachment **out);
/** The bytes of a blob attachment: borrowed, valid until `a` and every
 * clone of it are destroyed; *bytes (if not NULL) receives their count.
 * @return NULL (and *bytes 0) for NULL or an attachment of another kind.
 * Thread-safe (reads immutable data). */
KVT_API const void *kvt_attachment_blob_data(const kvt_attachment *a, size_t *bytes);
/** Bytes the attachment holds (its kind's ops->bytes); 0 for NULL.
 * Thread-safe. */
KVT_API size_t kvt_attachment_bytes(const kvt_attachment *a);
/** Clones an attachment through its kind (zero-copy where the kind can: a
 * blob clone shares its buffer). *out is NULL on every error.
 * @param out receives the clone; caller frees with kvt_attachment_destroy().
 * @return 0; KVT_EINVAL (a or out NULL); KVT_ENOMEM or the kind's error.
 * Thread-safe with other clones of the same attachment. */
KVT_API int kvt_attachment_clone(const kvt_attachment *a, kvt_attachment **out);
/** Destroys an attachment (its kind's ops->destroy): the shared bytes go
 * when the last clone goes. NULL is a no-op. Call exactly once per
 * attachment; not thread-safe with other calls on the same attachment. */
KVT_API void kvt_attachment_destroy(kvt_attachment *a);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_CACHE_H */
