/*
 * engine/gguf.h: exports a loaded llama2.c checkpoint and its tokenizer as a
 * GGUF file (version 3) that llama.cpp loads as architecture "llama", so
 * llama.cpp can run the very weights the engine runs (the baseline of
 * `kvtier bench engine --context-only`).
 *
 * What is written (GGUF v3, little-endian, alignment 32):
 *   metadata  general.architecture "llama", general.name, general.alignment,
 *             general.file_type (0 all f32, 1 mostly f16);
 *             llama.context_length = seq_len, llama.embedding_length = dim,
 *             llama.block_count = n_layers, llama.feed_forward_length =
 *             hidden_dim, llama.attention.head_count = n_heads,
 *             llama.attention.head_count_kv = n_kv_heads,
 *             llama.rope.dimension_count = head_size (RoPE on every pair of
 *             the head), llama.rope.freq_base = 10000,
 *             llama.attention.layer_norm_rms_epsilon = 1e-5, llama.vocab_size
 *             (the engine's constants, engine/model.h);
 *             tokenizer.ggml.model "llama" (SentencePiece), tokens, scores,
 *             token_type, bos/eos/unknown ids 1/2/0, add_bos_token true,
 *             add_eos_token false.
 *   tensors   (GGUF shapes list the fastest dimension first, so a llama2.c
 *             matrix (out, in) is [in, out] with the same bytes):
 *             token_embd.weight [dim, V]      output_norm.weight [dim] (f32)
 *             output.weight [dim, V]          (only with a separate classifier;
 *                                              llama.cpp ties it otherwise)
 *             per layer N: blk.N.attn_norm.weight [dim] (f32),
 *             blk.N.attn_q.weight [dim, dim], blk.N.attn_k.weight [dim, kv_dim],
 *             blk.N.attn_v.weight [dim, kv_dim], blk.N.attn_output.weight
 *             [dim, dim], blk.N.ffn_norm.weight [dim] (f32),
 *             blk.N.ffn_gate.weight (w1) [dim, hidden], blk.N.ffn_down.weight
 *             (w2) [hidden, dim], blk.N.ffn_up.weight (w3) [dim, hidden].
 *
 * RoPE layout: llama2.c rotates adjacent pairs (2i, 2i+1) of each head, the
 * layout of the original Meta checkpoints; llama.cpp's "llama" architecture
 * (rope type NORM) rotates the same pairs. The Hugging Face to GGUF converter
 * permutes wq/wk only because Hugging Face checkpoints store the rows in the
 * rotate-half order; llama2.c rows are already in the order llama.cpp
 * expects, so wq and wk are written unchanged (tests/test_long_gguf_llamacpp.c
 * compares llama.cpp's logits with the engine's to show it).
 *
 * Tokenizer: each llama2.c piece becomes its SentencePiece text: ' ' back to
 * U+2581 (llama2.c's exporter turned U+2581 into ' '), "\n<s>\n" and
 * "\n</s>\n" back to "<s>" and "</s>". Types: id 0 UNKNOWN (2), BOS and EOS
 * CONTROL (3), pieces "<0xNN>" BYTE (6), every other piece NORMAL (1).
 *
 * Thread-safety: kvt_gguf_export only reads the model and the tokenizer; it
 * may run while other threads read them, never while one runs the model's
 * forward pass (that writes the model's scratch, not its weights: it is in
 * fact safe, but not promised).
 */
#ifndef KVT_ENGINE_GGUF_H
#define KVT_ENGINE_GGUF_H

#include "model.h"
#include "tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Storage type of the weight matrices in an exported GGUF file (norm
 * vectors are always f32, as llama.cpp's converters write them). Values are
 * GGML type ids. */
typedef enum kvt_gguf_dtype { KVT_GGUF_F32 = 0, KVT_GGUF_F16 = 1 } kvt_gguf_dtype;

/** Parses "f32" or "f16". @return 0; KVT_EINVAL (NULL or another name; the
 * message names both). Thread-safe. */
KVT_API int kvt_gguf_dtype_parse(const char *name, kvt_gguf_dtype *out);

/** Writes `m` with tokenizer `t` as a GGUF v3 file for llama.cpp (layout in
 * the file comment).
 *
 * f16 matrices are rounded to nearest even (kvt_dtype_from_f32); a weight
 * beyond the f16 range becomes an infinity. Written to a temporary file in
 * the same directory, fsynced and renamed over out_path: a reader never sees
 * a partial file, and on error nothing is left behind.
 * @param m        a loaded model (borrowed; only read); every layer must be
 *                 KVT_LAYER_ATTN.
 * @param t        its tokenizer (borrowed): exactly the model's vocab_size
 *                 pieces, BOS and EOS at ids 1 and 2.
 * @param dtype    KVT_GGUF_F32 or KVT_GGUF_F16.
 * @param name     general.name (e.g. the checkpoint's file name); NULL: "kvtier".
 * @param out_path destination; its directory must exist.
 * @return 0; KVT_EINVAL (NULL model, tokenizer or path, a dtype outside the
 *   enum, or a tokenizer whose piece count differs from vocab_size or that
 *   has fewer than 3 pieces: the message gives both numbers);
 *   KVT_EUNSUPPORTED (a sliding-window or recurrent layer: llama.cpp's
 *   "llama" architecture has neither; the message names the layer);
 *   KVT_ENOMEM; -errno when the file cannot be created, written, fsynced or
 *   renamed (kvt_last_error names the path).
 */
KVT_API int kvt_gguf_export(const kvt_model *m, const kvt_tokenizer *t, kvt_gguf_dtype dtype, const char *name,
                            const char *out_path);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_GGUF_H */
