/*
 * engine/kernels.h: the vector kernels of the decode path (internal to
 * engine/): a row-blocked matrix product over several input rows, a dot
 * product and an axpy. One implementation is chosen per process (AVX-512,
 * AVX2+FMA or plain C, by what the CPU supports) and every caller uses it.
 *
 * Summation-order rule (what makes batched decode batch-invariant): each
 * output element of kvt__matmul_rows is computed as
 *     acc = 0 (one vector of LANES floats)
 *     for each chunk c of LANES inputs, c = 0, 1, ...: acc = fma(w_c, x_c, acc)
 *         (the last chunk is zero-padded)
 *     out = horizontal sum of acc (a fixed tree)
 * so its bits depend only on that weight row and that input row: never on
 * how many rows are multiplied together, which rows they are, where the
 * row range of a thread starts, or on memory alignment. kvt__dot follows the
 * same rule.
 */
#ifndef KVT_ENGINE_KERNELS_H
#define KVT_ENGINE_KERNELS_H

#include <stddef.h>

/** out[i * ldo + r] = sum_j W[r * n_in + j] * x[i * n_in + j] for rows r in
 * [r0, r1) and inputs i in [0, n). W (n_out, n_in) row-major, x (n, n_in)
 * contiguous rows. Weight rows are read once per block of rows for all n
 * inputs (the block stays in L1/L2 while every input passes over it).
 * Thread-safe: reads W and x, writes only the given output elements. */
void kvt__matmul_rows(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0, int r1);

/** sum_j a[j] * b[j] over n floats, in the order stated above. */
float kvt__dot(const float *a, const float *b, int n);

/** y[j] += a * x[j] for j in [0, n) (one multiply-add per element). */
void kvt__axpy(float *y, float a, const float *x, int n);

/** Name of the kernel set in use: "avx512", "avx2" or "c". */
const char *kvt__kernels_isa(void);

/** Selects a kernel set by name ("avx512", "avx2", "c"), for tests and
 * benchmarks that compare them. Process-wide; call only while no forward
 * pass runs. @return 0, or -1 when the CPU lacks it or the name is unknown. */
int kvt__kernels_select(const char *isa);

#endif
