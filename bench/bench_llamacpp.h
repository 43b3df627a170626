/*
 * bench_llamacpp.h: the llama.cpp baseline of `kvtier bench engine
 * --context-only`: the engine's model exported as GGUF (f32 weights, the
 * same numbers the engine runs) into a temporary directory and decoded at
 * context by llama.cpp (node-llama-cpp's prebuilt CPU binary,
 * bench/llamacpp/decode.mjs) with the bench's tokens, one run at a time so
 * the bench can pair each run with one of its own.
 * Command-line code only; not part of the library API. Not thread-safe.
 */
#ifndef KVT_BENCH_LLAMACPP_H
#define KVT_BENCH_LLAMACPP_H

#include "model.h"

#include <stdint.h>

/** KV cache configurations llama.cpp runs: its cache type and flash
 * attention (f32 off, f16 off and on, bf16 off and on, q8_0 on: the best
 * setting of each type is among them; f32 with flash attention is left out,
 * as llama.cpp then converts the f32 cache to f16 at every step, and q8_0
 * needs flash attention). */
#define KVT_LLAMACPP_CONFIGS 6
/** Context lengths at most. */
#define KVT_LLAMACPP_MAX_CTX 4
/** Runs at most. */
#define KVT_LLAMACPP_MAX_RUNS 64

typedef struct kvt_llamacpp kvt_llamacpp;

/** Name of configuration i: its GGML KV type ("f32", "f16", "q8_0"). */
const char *kvt_llamacpp_kv_name(int i);
/** 1 when configuration i runs with flash attention. */
int kvt_llamacpp_flash(int i);
/** The engine's KV scheme that stores what configuration i stores (f32 ->
 * KVT_KV_F32, f16 -> KVT_KV_F16, bf16 -> KVT_KV_BF16, q8_0 -> KVT_KV_Q8). */
kvt_kv_scheme kvt_llamacpp_scheme(int i);

/** Prepares the baseline: finds bench/llamacpp (KVT_LLAMACPP_DIR, else the
 * source tree this binary was built from) with its installed node_modules
 * and node, exports `m` with tokenizer `tok_path` as GGUF f32 into a fresh
 * temporary directory, and writes the n_tok bench tokens there.
 * @param out receives the handle (free with kvt_llamacpp_close), or NULL
 *   when the baseline is not available: then a line on stderr says why
 *   (no node, packages not installed: run `make bench-deps`) and 0 is
 *   returned, so the bench runs without it.
 * @return 0; KVT_EINVAL; an export error (KVT_ENOMEM, -errno...).
 */
int kvt_llamacpp_open(const kvt_model *m, const char *tok_path, const int32_t *tok, int n_tok, int threads,
                      kvt_llamacpp **out);

/** One run of llama.cpp's decode at context: per configuration, a sequence
 * prefilled to each of ctx[0..n_ctx) in turn (increasing, each >= the
 * previous + steps) and `steps` greedy tokens after each, timed token by
 * token, in a context of the last ctx + steps + 1 tokens (so llama.cpp
 * never shifts its context in a timed step). Stores the run's tokens/s by
 * the clock around each call and by llama.cpp's own decode counters.
 * @return 0; KVT_ELIMIT (more than KVT_LLAMACPP_MAX_RUNS runs or contexts);
 *   KVT_EIO when node fails or prints no result (its stderr passes through;
 *   exit 3 means the prebuilt binary did not load).
 */
int kvt_llamacpp_run(kvt_llamacpp *lc, const int *ctx, int n_ctx, int steps);

/** Median over the runs so far of configuration cfg at context index k, in
 * tokens/s (0 when not run). own 0: by the clock around each call from
 * JavaScript (llama.cpp, node-llama-cpp's sampling and scheduling); own 1:
 * by llama.cpp's own counters (llama_decode alone, what llama.cpp prints). */
double kvt_llamacpp_tps(const kvt_llamacpp *lc, int cfg, int k, int own);

/** "llama.cpp v0.5.0 prebuilt, CPU backend libggml-cpu-icelake.so; CPU : ..."
 * as decode.mjs reported it ("" before a run). Borrowed, valid until close. */
const char *kvt_llamacpp_info(const kvt_llamacpp *lc);

/** Removes the temporary directory and frees. NULL is a no-op. */
void kvt_llamacpp_close(kvt_llamacpp *lc);

#endif
