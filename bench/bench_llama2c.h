/*
 * bench_llama2c.h: the baseline of `kvtier bench engine`: a plain copy of
 * llama2.c run.c's forward pass (one token at a time, naive matvec over the
 * weights, a contiguous (layer, seq_len, kv_dim) KV array), written for the
 * benchmark and compiled the way run.c is built (-Ofast -march=native, set
 * in CMakeLists.txt); a second copy of the same loop is built with OpenMP
 * (run.c's `make runomp`) when the compiler has it. Plain attention models
 * only. Command-line code only; not part of the library API.
 */
#ifndef KVT_BENCH_LLAMA2C_H
#define KVT_BENCH_LLAMA2C_H

#include "model.h"

typedef struct kvt_llama2c kvt_llama2c;

/** Reads the checkpoint at `path` (whose shape is *c, from kvt_model_load)
 * into memory and allocates run.c's state. Caller frees with
 * kvt_llama2c_close(). @return 0, or -1 (file unreadable, out of memory). */
int kvt_llama2c_open(const char *path, const kvt_model_config *c, kvt_llama2c **out);

/** Frees everything; NULL is a no-op. */
void kvt_llama2c_close(kvt_llama2c *p);

/** run.c's forward(): token at position pos (0-based, every earlier position
 * already run), logits (vocab_size floats) out. Single-threaded. */
void kvt_llama2c_forward(kvt_llama2c *p, int token, int pos, float *logits);

/** 1 when the OpenMP copy was built (the compiler has OpenMP), else 0. */
int kvt_llama2c_omp_available(void);

/** The same forward pass from the OpenMP build, on `threads` threads (run.c's
 * `#pragma omp parallel for` over matmul rows and attention heads); falls
 * back to kvt_llama2c_forward when OpenMP is not available. */
void kvt_llama2c_forward_omp(kvt_llama2c *p, int token, int pos, float *logits, int threads);

#endif
