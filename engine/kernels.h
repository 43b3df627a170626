/*
 * engine/kernels.h: the vector kernels of the decode path (internal to
 * engine/): a row-blocked matrix product over several input rows, attention
 * scores, softmax, the weighted sum of values, and SwiGLU's silu(h) * g. One
 * implementation is chosen per process (AVX-512 F+BW+VL, AVX2+FMA+F16C or
 * plain C, by what CPUID reports) and every caller uses it.
 *
 * Summation-order rule (what makes batched decode batch-invariant): each
 * output element of kvt__matmul_rows is computed as
 *     acc = 0 (one vector of LANES floats)
 *     for each chunk c of LANES inputs, c = 0, 1, ...: acc = fma(w_c, x_c, acc)
 *         (the last chunk is zero-padded)
 *     out = horizontal sum of acc (a fixed tree)
 * so its bits depend only on that weight row and that input row: never on
 * how many rows are multiplied together, which rows they are, where the
 * row range of a thread starts, or on memory alignment. The attention
 * kernels keep the same kind of rule: every result depends only on its own
 * query, keys, values and length, in an order fixed by head_size.
 */
#ifndef KVT_ENGINE_KERNELS_H
#define KVT_ENGINE_KERNELS_H

#include "kvtier/cache.h"

#include <stddef.h>

/** out[i * ldo + r] = sum_j W[r * n_in + j] * x[i * n_in + j] for rows r in
 * [r0, r1) and inputs i in [0, n). W (n_out, n_in) row-major, x (n, n_in)
 * contiguous rows. Weight rows are read once per block of rows for all n
 * inputs (the block stays in L1/L2 while every input passes over it).
 * Thread-safe: reads W and x, writes only the given output elements. */
void kvt__matmul_rows(float *out, size_t ldo, const float *x, int n, const float *W, int n_in, int r0, int r1);

/** Attention scores of one query head over n keys: S[t] = dot(q, K + t * ldk)
 * * scale for t in [0, n), each dot in kvt__dot's order. q (hs), K rows of
 * at least hs floats, ldk floats apart. */
void kvt__attn_scores(float *S, const float *q, const float *K, size_t ldk, int n, int hs, float scale);

/** In-place softmax of x[0..n): exp(x - max) / sum, with a vectorised exp
 * (Cephes expf: range reduction to [-ln2/2, ln2/2] and a degree-5
 * polynomial, about 1 ulp; libm expf in the plain C set) and the sum taken
 * in 16 (or 8) lanes then reduced in a fixed tree. */
void kvt__softmax(float *x, int n);

/** Weighted sum of n value rows: out[i] = (accumulate ? out[i] : 0) +
 * sum_t S[t] * V[t * ldv + i] for i in [0, hs), t ascending (one fused
 * multiply-add per term, per element in t order), so a sum split over
 * segments with accumulate = 1 after the first equals the sum in one call. */
void kvt__attn_values(float *out, const float *S, const float *V, size_t ldv, int n, int hs, int accumulate);

/* ---- attention over K/V in a storage scheme (kvt_kv_rows) -------------------
 * Rows r hold K and V as F32, F16, BF16, I8 with per-group scales or U8
 * with per-channel steps and minima; a head reads elements [off, off + hs)
 * of each row, rows ld elements apart (ld = kv_dim). Each element is
 * converted to float as kvt_kv_rows states (exact for F16/BF16; code * scale
 * for I8; fmaf(code, step, min) for U8) on the fly, and used in the same order
 * as the F32 kernels use theirs. For F32 rows these are kvt__attn_scores /
 * kvt__attn_values exactly. For the other dtypes every set gives bit for
 * bit what its own F32 kernels give on the converted rows: "avx512" in 16
 * lanes (vcvtph2ps, a shift, vpmovsxbd), "avx2" in 8 (F16C), "c" element by
 * element. A head wider than 512 floats of I8 runs the plain C kernel. */

/** S[t] = dot(q, K_t[off .. off + hs)) * scale for the r->n rows of r. */
void kvt__attn_scores_rows(float *S, const float *q, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                           float scale);

/** out[i] = (accumulate ? out[i] : 0) + sum_t S[t] * V_t[off + i], i in [0, hs),
 * t ascending over the r->n rows (one multiply-add per term, as
 * kvt__attn_values). */
void kvt__attn_values_rows(float *out, const float *S, const kvt_kv_rows *r, size_t off, size_t ld, int hs,
                           int accumulate);

/** dst (r->n, hs) = elements [off, off + hs) of every row of K (v = 0) or V
 * (v = 1), converted to float: what prefill's GEMM reads. */
void kvt__rows_to_f32(float *dst, const kvt_kv_rows *r, int v, size_t off, size_t ld, int hs);

/** h[i] = silu(h[i]) * g[i] = h / (1 + exp(-h)) * g for i in [0, n), with
 * kvt__softmax's exp. */
void kvt__silu_mul(float *h, const float *g, size_t n);

/** Name of the kernel set in use: "avx512", "avx2" or "c". */
const char *kvt__kernels_isa(void);

/** Selects a kernel set by name ("avx512", "avx2", "c"), for tests and
 * benchmarks that compare them. Process-wide; call only while no forward
 * pass runs. @return 0, or -1 when the CPU lacks it or the name is unknown. */
int kvt__kernels_select(const char *isa);

/** The reference rounding of x to dt (KVT_DTYPE_F16 or KVT_DTYPE_BF16; any
 * other dt rounds as BF16), returned as the float it stands for: written
 * apart from the library's conversion (kvt_dtype_from_f32 adds and shifts
 * bits) so tests and `kvtier bench kv-dtype` can check that one against it.
 * IEEE round to nearest, ties to even: the nearest multiple of x's quantum
 * 2^(max(e, emin) - (p - 1)) for x of exponent e, p the significand bits
 * with the implicit one (f16 11, bf16 8), emin the smallest normal exponent
 * (f16 -14, bf16 -126), computed in double (exact: a power-of-two scaling)
 * with nearbyint under the default rounding mode (ties to the even
 * multiple); past the largest finite value, infinity with x's sign. NaN,
 * infinities and zeros are returned unchanged. Thread-safe. */
float kvt__round_ref(kvt_dtype dt, float x);

#endif
