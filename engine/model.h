/*
 * engine/model.h: the reference engine's model: a llama2.c checkpoint (legacy
 * float32 format, optionally with kvtier's hybrid-shape extension) loaded by
 * mmap, and its forward pass over per-layer kvtier caches.
 *
 * Checkpoint format (llama2.c run.c, "legacy" export, little-endian):
 *   header  7 x int32: dim, hidden_dim, n_layers, n_heads, n_kv_heads,
 *           vocab_size (negative = separate classifier, |vocab_size| tokens),
 *           seq_len
 *   float32 tensors, in this order (head_size = dim / n_heads,
 *   kv_dim = n_kv_heads * head_size, L = n_layers, V = |vocab_size|):
 *     token_embedding (V, dim)       rms_att (L, dim)
 *     wq (L, dim, dim)               wk (L, kv_dim, dim)
 *     wv (L, kv_dim, dim)            wo (L, dim, dim)
 *     rms_ffn (L, dim)               w1 (L, hidden_dim, dim)
 *     w2 (L, dim, hidden_dim)        w3 (L, hidden_dim, dim)
 *     rms_final (dim)
 *     freq_cis_real (seq_len, head_size / 2)   (unused, skipped)
 *     freq_cis_imag (seq_len, head_size / 2)   (unused, skipped)
 *     wcls (V, dim)                  only when vocab_size < 0
 *
 * Hybrid-shape extension (kvtier, issue 4), version 1: an optional trailer
 * right after the tensors above; a plain llama2.c file has none.
 *   char    magic[4] = "KVTX"
 *   int32   version  = 1            (any other value is refused)
 *   int32   sliding_window W        (> 0 iff some layer is a window layer, else 0)
 *   int32   n_layers                (must equal the header's)
 *   int32   kind[n_layers]          (kvt_layer_kind values 0, 1, 2)
 *   float32 for each recurrent layer l, ascending: wa (dim, dim), wx (dim, dim)
 * and nothing after it. The file size must match exactly.
 *
 * Forward pass, per layer l with input x (dim) at position pos:
 *   xb = rmsnorm(x, rms_att[l])          rmsnorm(v, w) = w * v / sqrt(mean(v^2) + 1e-5)
 *   KVT_LAYER_ATTN    q = wq xb, k = wk xb, v = wv xb; RoPE on q and k exactly as
 *                     llama2.c run.c (pairs (i, i+1) within each head rotated by
 *                     pos * 10000^-((i % head_size) / head_size)); grouped-query
 *                     attention (query head h reads kv head h / (n_heads / n_kv_heads))
 *                     over positions 0..pos, softmax(q.k / sqrt(head_size));
 *                     out = wo att.
 *   KVT_LAYER_WINDOW  as ATTN but over positions max(0, pos - W + 1)..pos only.
 *   KVT_LAYER_RECURRENT (gated linear recurrence; state h (dim), h_{-1} = 0):
 *                     a_t = sigmoid(wa xb_t)              (elementwise, dim)
 *                     h_t = a_t * h_{t-1} + (1 - a_t) * (wx xb_t)
 *                     out = wo h_t
 *   x += out
 *   xb = rmsnorm(x, rms_ffn[l]); x += w2 (silu(w1 xb) * (w3 xb))   silu(v) = v / (1 + e^-v)
 * then logits = wcls rmsnorm(x, rms_final), wcls = token_embedding when shared.
 *
 * Caches (one per layer, from kvt_model_new_caches): "kv" (or "qkv" for
 * int8 K/V) for ATTN layers, "rotating" (window W, keep 0) for WINDOW layers, "recurrent" (dim float32 =
 * h) for RECURRENT layers. Positions come from the caches: a prefill or decode
 * starts at kvt_cache_offset(caches[0]) and appends to every layer's cache, so
 * a caller holding caches with p tokens (e.g. from the prompt cache) feeds
 * only tokens[p..].
 *
 * Threads: a model owns a set of worker threads (online CPUs, at most 8,
 * the caller included; kvt_model_set_threads changes it) that split each
 * matrix product by output rows and attention by heads; OpenBLAS runs each
 * piece single-threaded (loading a model calls openblas_set_num_threads(1),
 * process-wide).
 *
 * Thread-safety: a kvt_model holds scratch buffers and its worker threads; one thread
 * at a time may call prefill/decode on it (the caller serialises). Loading, freeing and the
 * const getters of different models are independent. kvt_model_get_config,
 * kvt_model_fingerprint and kvt_model_kv_bytes_per_token may be called
 * concurrently with each other (they only read).
 */
#ifndef KVT_ENGINE_MODEL_H
#define KVT_ENGINE_MODEL_H

#include "kvtier/cache.h"
#include "kvtier/common.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_model kvt_model;

/** What replaces attention in a layer (hybrid-shape extension). */
typedef enum { KVT_LAYER_ATTN = 0, KVT_LAYER_WINDOW = 1, KVT_LAYER_RECURRENT = 2 } kvt_layer_kind;

#define KVT_MODEL_MAX_LAYERS 256

/** Shape of a loaded model. */
typedef struct kvt_model_config {
    int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; /* llama2.c header;
                                          vocab_size here is always positive (|header value|) */
    int32_t head_size, kv_dim;          /* derived: dim / n_heads, n_kv_heads * head_size */
    int shared_classifier;              /* 1 when the classifier is the token embedding */
    int32_t sliding_window;             /* W tokens for KVT_LAYER_WINDOW layers, 0 if none */
    kvt_layer_kind layer_kind[KVT_MODEL_MAX_LAYERS]; /* per layer (n_layers <= 256) */
} kvt_model_config;

/** Storage scheme of the K/V the caches of attention and window layers
 * hold (kvt_model_set_kv_scheme). The forward pass computes in f32, writes
 * K/V in the scheme of each cache and reads them back converting on the fly
 * (kernels.h), so the scheme changes the numbers slightly but never the
 * rule that cached and uncached runs of one scheme agree token for token.
 *   KVT_KV_F32   float32, 4 bytes per element (llama2.c's own; the default)
 *   KVT_KV_F16   IEEE binary16, 2 bytes, rounded to nearest even
 *   KVT_KV_BF16  bfloat16, 2 bytes, rounded to nearest even
 *   KVT_KV_Q8    8-bit codes: in attention layers with a per-channel step
 *                and minimum over each block; in window layers an I8 ring
 *                with one f32 scale per group of kvt_model_q8_group_size()
 *                elements
 * Attention layers of every scheme but F32 keep the open (last, partly
 * filled) block in f32 and store a block in the scheme when it is sealed,
 * as the next block starts (the "qkvc" kind, kvt_qkvc_create_dtype), so a
 * token's own block is read exactly and only earlier blocks are rounded; a
 * cached prefix can then be cut back only to a block boundary or inside the
 * open block. Window layers store every slot in the scheme.
 * Recurrent state stays f32 in every scheme. */
typedef enum kvt_kv_scheme { KVT_KV_F32 = 0, KVT_KV_F16, KVT_KV_BF16, KVT_KV_Q8, KVT_KV_SCHEME_COUNT } kvt_kv_scheme;

/** "f32", "f16", "bf16" or "q8"; NULL for another value. Thread-safe. */
KVT_API const char *kvt_kv_scheme_name(kvt_kv_scheme s);

/** Parses "f32", "f16", "bf16" or "q8" (what --kv-dtype takes).
 * @return 0; KVT_EINVAL (NULL, or another name: the message lists the four).
 * Thread-safe. */
KVT_API int kvt_kv_scheme_parse(const char *name, kvt_kv_scheme *out);

/** Loads a checkpoint by mmap (read-only, private) and validates it.
 *
 * Untrusted input: every header value and the exact file size are checked
 * before any tensor is touched; no read ever goes past the mapping.
 * @param path checkpoint file (llama2.c legacy float32, optional KVTX trailer).
 * @param out  receives the model; caller frees with kvt_model_free().
 * @return 0; KVT_EINVAL (path or out NULL); -errno when the file cannot be
 *   opened/stat'ed/mapped; KVT_EIO
 *   when the header cannot be read; KVT_EFORMAT with kvt_last_error() naming
 *   the file and the fault: not a regular file, file shorter than the header, a header value that is not positive or does not
 *   add up (dim % n_heads, n_heads % n_kv_heads, odd head_size, more than 256
 *   layers, sizes overflowing), file size != expected size (both in bytes),
 *   trailing bytes that are not a KVTX trailer, a malformed trailer (layer
 *   count, layer kind, window); KVT_EUNSUPPORTED for a KVTX trailer of an
 *   unknown version; KVT_ENOMEM; -errno when the worker threads cannot start.
 * Thread-safe (touches no shared state but OpenBLAS's thread count).
 */
KVT_API int kvt_model_load(const char *path, kvt_model **out);

/** Unmaps and frees a model. NULL is a no-op. Caches made for it stay valid
 * (they own their memory). */
KVT_API void kvt_model_free(kvt_model *m);

/** Shape of `m`. Borrowed, valid until kvt_model_free(m). */
KVT_API const kvt_model_config *kvt_model_get_config(const kvt_model *m);

/** 64-bit FNV-1a hash of the config (every shape field, shared_classifier,
 * sliding_window and each layer's kind): the model part of a cache identity.
 * Two models with equal configs hash equal even if their weights differ; the
 * caller adds a model id (path, file hash) to tell weights apart. */
KVT_API uint64_t kvt_model_fingerprint(const kvt_model *m);

/** Creates one empty cache per layer, of the kind the layer needs, in the
 * model's storage scheme (kvt_model_set_kv_scheme):
 * for ATTN kvt_kv_create(kv_dim, block_tokens) under F32, else
 * kvt_qkvc_create_dtype(kv_dim, block_tokens, F16, BF16 or (Q8) U8),
 * kvt_rotating_create_dtype(kv_dim, W, 0, dtype, group size) for WINDOW,
 * kvt_recurrent_create(dim * 4 bytes) for RECURRENT.
 * @param block_tokens tokens per kv block (>= 1; 256 is the default; more
 *   than seq_len is capped at seq_len: a longer block is never filled).
 * @param caches array of n_layers slots; on success every slot holds a cache
 *   the caller owns (dispose with kvt_caches_destroy(caches, n_layers)); on
 *   error every slot is NULL.
 * @return 0, KVT_EINVAL, KVT_ENOMEM (or whatever the cache kind returns).
 */
KVT_API int kvt_model_new_caches(const kvt_model *m, int32_t block_tokens, kvt_cache **caches);

/** Sets the storage scheme of the caches kvt_model_new_caches makes from
 * now on (a model starts with KVT_KV_F32). Caches made before keep theirs:
 * the forward pass reads any scheme. The scheme reaches every tier through
 * the caches: their encoded params and tensor dtypes, so the SSD tier's
 * config fingerprint (its identity directory) differs per scheme and state
 * of one scheme never serves another.
 * @return 0; KVT_EINVAL (NULL model or a value outside the enum).
 * Not thread-safe with kvt_model_new_caches or the byte getters below on the
 * same model (set it once after loading, before caches are made). */
KVT_API int kvt_model_set_kv_scheme(kvt_model *m, kvt_kv_scheme s);

/** The model's storage scheme (KVT_KV_F32 for NULL). */
KVT_API kvt_kv_scheme kvt_model_kv_scheme(const kvt_model *m);

/** Elements per f32 scale of the I8 rings of window layers under
 * KVT_KV_Q8: the largest of 32, 16, 8, 4, 2, 1 that divides head_size (so a
 * group never spans two heads). */
KVT_API int32_t kvt_model_q8_group_size(const kvt_model *m);

/** Block tokens kvt_model_kv_row_bytes, kvt_model_kv_bytes_per_token and
 * kvt_model_fixed_state_bytes assume (the default block); the _at variants
 * take the block of the caches at hand. */
#define KVT_MODEL_Q8_BLOCK 256

/** Bytes of K and V of one token in one attention layer in the model's
 * scheme: 2 * kv_dim * 4 (F32), 2 * kv_dim * 2 (F16, BF16), 2 * kv_dim +
 * ceil(16 * kv_dim / 256) (Q8: the codes and a share of the per-channel
 * scales of a 256-token block); 0 for NULL. */
KVT_API size_t kvt_model_kv_row_bytes(const kvt_model *m);

/** kvt_model_kv_row_bytes for caches of blocks of block_tokens (capped at
 * seq_len, as kvt_model_new_caches caps it): under Q8 2 * kv_dim +
 * ceil(16 * kv_dim / block_tokens), what kvt_service_layer_of reads off such
 * a cache; the other schemes do not depend on the block. 0 for NULL or
 * block_tokens < 1. Thread-safe. */
KVT_API size_t kvt_model_kv_row_bytes_at(const kvt_model *m, int32_t block_tokens);

/** Bytes of K and V of one slot of a window layer's ring in the model's
 * scheme: kvt_model_kv_row_bytes except under Q8, where the ring holds int8
 * codes with one f32 scale per kvt_model_q8_group_size() elements: 2 *
 * (kv_dim + kv_dim / group_size * 4); 0 for NULL. */
KVT_API size_t kvt_model_window_row_bytes(const kvt_model *m);

/** Bytes of cache state that grow with each token, summed over all ATTN
 * layers: n_attn_layers * kvt_model_kv_row_bytes (the model's scheme).
 * Window and recurrent layers hold a fixed size and add nothing per token.
 * For admission control. */
KVT_API size_t kvt_model_kv_bytes_per_token(const kvt_model *m);

/** kvt_model_kv_bytes_per_token for caches of blocks of block_tokens:
 * n_attn_layers * kvt_model_kv_row_bytes_at(m, block_tokens). */
KVT_API size_t kvt_model_kv_bytes_per_token_at(const kvt_model *m, int32_t block_tokens);

/** Bytes of fixed-size cache state per sequence (rings of window layers at
 * full size in the model's scheme (Q8: 2 * (kv_dim + kv_dim / group_size *
 * 4) a slot) + f32 recurrent states + in every scheme but F32 the f32 open
 * block of each attention layer, 8 * kv_dim * min(256, seq_len)),
 * independent of length. */
KVT_API size_t kvt_model_fixed_state_bytes(const kvt_model *m);

/** Prefill: runs n_tokens tokens through the model as one batch (GEMM,
 * processed in chunks of at most KVT_MODEL_CHUNK tokens), appending their
 * state to every layer's cache. A chunk may cross block boundaries; in a
 * cache that seals its blocks ("qkvc") the rows of each block attend before
 * the next block's K/V are appended, so every row reads its own block in
 * f32 and the earlier ones sealed, however the prompt is split. With a
 * bounded residency, each block's rows attend through a window of their
 * own, closed without next-layer read-ahead until the layer's last block
 * (kvt_kv_window_close_same), so staging stays within one window.
 *
 * Starts at position p = kvt_cache_offset(caches[0]); every cache must hold
 * exactly p tokens and have the kind and kv_dim its layer needs.
 * @param caches n_layers caches (borrowed; each one modified).
 * @param tokens n_tokens ids, each in [0, vocab_size).
 * @param n_tokens >= 1.
 * @param logits NULL, or vocab_size floats receiving the logits of the last token.
 * @return 0; KVT_EINVAL (NULL arguments, n_tokens < 1, a token id out of range,
 *   a cache of the wrong kind/dim/offset; nothing is modified); KVT_ELIMIT when
 *   p + n_tokens > seq_len (the message gives both numbers; nothing is
 *   modified); an error from a cache append (KVT_ENOMEM...): the caches then
 *   hold a partial chunk and must be discarded.
 * Not thread-safe for one model (see above).
 */
KVT_API int kvt_model_prefill(kvt_model *m, kvt_cache **caches, const int32_t *tokens, int64_t n_tokens,
                              float *logits);

/** Decode: one token at position kvt_cache_offset(caches[0]) (matrix-vector
 * products), appending its state to every cache.
 * @param logits vocab_size floats (required).
 * @return as kvt_model_prefill with n_tokens = 1.
 */
KVT_API int kvt_model_decode(kvt_model *m, kvt_cache **caches, int32_t token, float *logits);

/** Batched decode: one token for each of n sequences in one pass over the
 * weights. Each weight matrix is read once for all n sequences (a row-blocked
 * matrix product split over the model's threads); attention runs per sequence
 * on its own caches (kv blocks, window ring, recurrent state, as
 * kvt_model_decode does), split over the threads by (sequence, head).
 *
 * Batch invariance (a rule, tested bit for bit): the logits of sequence i are
 * bit-identical to what kvt_model_decode(m, caches[i], tokens[i], ...) gives
 * alone, whatever n, whatever the other sequences are and at whatever
 * positions, and whichever thread computes them. It holds because decode and
 * batched decode share one code path (kvt_model_decode is this call with
 * n = 1) and every kernel on it sums each output element in an order fixed by
 * the model's shape alone: never by n, by the other rows, by where a thread's
 * share of rows starts or by memory alignment (engine/kernels.h states the
 * order). OpenBLAS, whose GEMM may sum in a batch-dependent order, is not on
 * this path. So a greedy reply never depends on what it was batched with.
 * kvt_model_prefill of one token with logits is kvt_model_decode too; longer
 * prefills (OpenBLAS GEMM) agree with decode within float tolerance only.
 *
 * @param n        sequences, >= 1 (any number; scratch grows to the largest n
 *                 seen and is kept; groups of KVT_MODEL_CHUNK run in turn).
 * @param caches   n arrays of n_layers caches (borrowed; each modified):
 *                 caches[i] is sequence i's, as for kvt_model_decode. Each
 *                 sequence may be at its own position; no cache may appear in
 *                 two sequences.
 * @param tokens   n token ids, tokens[i] for sequence i, each in [0, vocab_size).
 * @param logits   (n, vocab_size) floats, row-major: row i receives sequence i's.
 * @return 0; KVT_EINVAL (NULL arguments, n < 1, a token out of range, a cache
 *   of the wrong kind/dim or layers out of step, one cache in two sequences;
 *   the message names the sequence; nothing is modified); KVT_ELIMIT when a
 *   sequence is already at seq_len (nothing is modified); KVT_ENOMEM for the
 *   scratch (nothing is modified); an error from a cache append (KVT_ENOMEM...)
 *   after the checks: then every sequence's caches may hold a partial step
 *   and must be discarded.
 * Not thread-safe for one model (see above).
 */
KVT_API int kvt_model_decode_batch(kvt_model *m, int n, kvt_cache **const *caches, const int32_t *tokens,
                                   float *logits);

/** A batched pass of prompt rows and decode rows: sequence i feeds its next
 * counts[i] tokens (the prompt tokens of a prefill chunk, or 1 pending token
 * of a decode) in one pass over the weights with every other sequence's, and
 * receives the logits after its last one. kvt_model_decode_batch is this
 * call with every count 1.
 *
 * Prefill invariance (a rule, tested bit for bit): every row is computed as
 * kvt_model_decode computes that token alone, on the decode path (the
 * kernels of kernels.h, row by row; each row attends to exactly the keys up
 * to its own position). So the logits, and the state appended to the
 * caches, do not depend on how a prompt is cut into chunks, on what it is
 * batched with, or on whether its prefix was reused from a cache or
 * computed here: feeding tokens t0..tk in any split over passes gives
 * bit-identical logits to decoding them one by one. (kvt_model_prefill's
 * GEMM path agrees with it within float tolerance only.)
 *
 * @param n       sequences, >= 1.
 * @param caches  n arrays of n_layers caches, as kvt_model_decode_batch
 *                (each sequence at its own position; no cache in two).
 * @param counts  n token counts, each 1 to KVT_MODEL_CHUNK; sequences run in
 *                groups of at most KVT_MODEL_CHUNK rows in turn.
 * @param tokens  the tokens of sequence 0, then of sequence 1, ... (sum of
 *                counts), each in [0, vocab_size).
 * @param logits  (n, vocab_size) floats: row i receives the logits after
 *                sequence i's last token.
 * A sequence's rows may cross a block boundary of a cache that seals its
 * blocks ("qkvc": f16, bf16 and q8 K/V): its rows of one block attend
 * before the next block's K/V are appended (which seals the block), so
 * each row still reads its own block in f32 and the earlier ones sealed,
 * as its decode does.
 * @return as kvt_model_decode_batch; KVT_EINVAL also for a count out of
 *   range, and KVT_ELIMIT when a sequence's tokens would pass seq_len
 *   (nothing is modified on either).
 * Not thread-safe for one model.
 */
KVT_API int kvt_model_forward_batch(kvt_model *m, int n, kvt_cache **const *caches, const int32_t *counts,
                                    const int32_t *tokens, float *logits);

/** Tokens a sequence whose caches are `caches` may feed in one
 * kvt_model_forward_batch pass from where it is: KVT_MODEL_CHUNK, for every
 * cache kind and scheme. A pass may cross the block boundaries of a cache
 * that seals its blocks ("qkvc": f16, bf16, q8): only its attention goes
 * block by block (see kvt_model_forward_batch), and a bounded residency's
 * staging stays within one window (docs/residency.md, Costs). Kept so that
 * a caller need not know the rule. 0 for NULL arguments. Thread-safe. */
KVT_API int64_t kvt_model_pass_rows(const kvt_model *m, kvt_cache **caches);

/** Most threads kvt_model_set_threads() accepts. */
#define KVT_MODEL_MAX_THREADS 64

/** Sets how many threads run this model's prefill and decode, the calling
 * thread included: stops and joins the workers and starts n_threads - 1
 * new ones (nothing is done when it already has n_threads). A model
 * starts with online CPUs, at most 8. Outputs do not depend on it: decode
 * (and batched decode) logits are bit-identical at any thread count (see
 * kvt_model_decode_batch); prefill through OpenBLAS within float tolerance.
 * @param n_threads 1 (no workers: everything on the caller) to
 *   KVT_MODEL_MAX_THREADS.
 * @return 0; KVT_EINVAL (NULL model, n_threads out of range; the message
 *   gives the range); KVT_ENOMEM or -errno when the new threads cannot start:
 *   the model then keeps its old threads and stays usable.
 * Not thread-safe for one model: never while a prefill or decode runs on it
 * (the same rule as those calls: the caller serialises).
 */
KVT_API int kvt_model_set_threads(kvt_model *m, int n_threads);

/** Threads running this model's forward pass, the caller included (>= 1);
 * 0 for NULL. Same thread-safety as kvt_model_set_threads. */
KVT_API int kvt_model_get_threads(const kvt_model *m);

/** Most tokens one prefill chunk holds (bounds the scratch memory). */
#define KVT_MODEL_CHUNK 256

/** Arguments of kvt_model_synth(). Zero-initialise, then set the shape. */
typedef struct kvt_synth_params {
    int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; /* all > 0 */
    uint64_t seed;                 /* weights are a function of (shape, seed) only */
    int separate_classifier;       /* 1: write wcls (header vocab_size negative) */
    const float *wcls_row_scale;   /* NULL, or vocab_size factors: row v of wcls is
                                      scaled by wcls_row_scale[v] (borrowed; only
                                      with separate_classifier) */
    int32_t sliding_window;        /* W for WINDOW layers; must be > 0 iff any */
    kvt_layer_kind layer_kind[KVT_MODEL_MAX_LAYERS]; /* per layer; 0 = ATTN */
} kvt_synth_params;

/** Writes a deterministic synthetic checkpoint.
 *
 * Weights: uniform in [-1, 1) from splitmix64(seed) per tensor, scaled by
 * 1/sqrt(fan_in) (embedding unscaled; wcls rows then by wcls_row_scale when
 * given), norm weights 1, freq_cis the llama2.c
 * cos/sin tables. Plain layers only: the llama2.c format exactly; any WINDOW
 * or RECURRENT layer adds the KVTX v1 trailer. Identical params give
 * byte-identical files. Written to a temporary file in the same directory,
 * then renamed over out_path (atomic; concurrent writers are safe).
 * @return 0; KVT_EINVAL (a shape that kvt_model_load would refuse; the message
 *   names the field); KVT_ENOMEM; -errno on I/O failure (kvt_last_error
 *   names the path).
 */
KVT_API int kvt_model_synth(const kvt_synth_params *p, const char *out_path);

/** Shape of the built-in default model (dim 768, hidden 2048, 12 layers,
 * 12 heads, 12 kv heads, vocab 259, seq_len 4096, fixed seed) with a
 * classifier of its own (random, fan-in scaled; the rows of tokens that are
 * not printable ASCII bytes or newline scaled by 1/4), so greedy text varies
 * and shows as characters instead of one repeated piece. Borrowed pointers in
 * *p point to static data. */
KVT_API void kvt_default_model_params(kvt_synth_params *p);

/** Paths of the built-in default model and its tokenizer, creating them on
 * first use under $XDG_CACHE_HOME/kvtier (else $HOME/.cache/kvtier).
 *
 * Creation writes temporaries and renames them, so two processes racing make
 * the same files safely. The tokenizer is written by
 * kvt_tokenizer_write_default(path, 259) (engine/tokenizer.h).
 * @param model_path, cap buffer for the checkpoint path (cap bytes).
 * @param tokenizer_path, tok_cap buffer for the tokenizer path.
 * @return 0; KVT_EINVAL (NULL buffer); KVT_ERANGE (a path does not fit);
 *   KVT_ENOTFOUND (neither variable set); -errno or the synth error.
 */
KVT_API int kvt_default_model(char *model_path, size_t cap, char *tokenizer_path, size_t tok_cap);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_MODEL_H */
