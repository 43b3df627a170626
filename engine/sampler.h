/*
 * sampler.h: picks the next token from a vector of logits, exactly as
 * llama2.c run.c does (greedy argmax; temperature + softmax + multinomial;
 * top-p "nucleus" sampling with its probability cutoff), driven by llama2.c's
 * xorshift random generator so a seed reproduces a run bit for bit.
 *
 * The primitives (argmax, softmax, multinomial, top-p, the generator) are
 * exported on their own so tests can check each rule.
 */
#ifndef KVT_ENGINE_SAMPLER_H
#define KVT_ENGINE_SAMPLER_H

#include "kvtier/common.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** One (probability, token id) pair, as llama2.c's ProbIndex. */
typedef struct kvt_prob_index {
    float prob;    /* probability of the token */
    int32_t index; /* token id */
} kvt_prob_index;

/** A sampler: settings, generator state and the top-p scratch buffer. */
typedef struct kvt_sampler kvt_sampler;

/** Creates a sampler (llama2.c build_sampler).
 *
 * @param vocab_size  logits per call, >= 1.
 * @param temperature 0 = greedy argmax; > 0 divides the logits before softmax.
 *                    Must be finite and >= 0.
 * @param topp        top-p threshold; values <= 0 or >= 1 mean plain
 *                    multinomial sampling (llama2.c). Must not be NaN.
 * @param seed        initial xorshift state, != 0 (a zero state never
 *                    changes; llama2.c substitutes time(NULL) for 0, the
 *                    caller decides).
 * @param out         receives the sampler; caller frees with kvt_sampler_free().
 * @return 0; KVT_EINVAL (naming the bad parameter); KVT_ENOMEM.
 * Thread-safe (touches no shared state).
 */
KVT_API int kvt_sampler_create(int32_t vocab_size, float temperature, float topp, uint64_t seed,
                               kvt_sampler **out);

/** Frees a sampler. NULL is a no-op. */
KVT_API void kvt_sampler_free(kvt_sampler *s);

/** Samples the next token (llama2.c sample()).
 *
 * temperature 0: argmax of the logits (first maximum on ties), the generator
 * is not advanced. Otherwise: logits /= temperature, softmax in place, one
 * coin = kvt_rng_f32(state), then top-p (0 < topp < 1) or multinomial.
 * @param logits (vocab_size,) float32; overwritten with the probabilities when
 *   temperature > 0 (as llama2.c does).
 * @return the token id, in [0, vocab_size).
 * Not thread-safe for one sampler (it advances the generator state).
 */
KVT_API int32_t kvt_sampler_sample(kvt_sampler *s, float *logits);

/** Logits per call (the vocab_size given at creation). */
KVT_API int32_t kvt_sampler_vocab_size(const kvt_sampler *s);

/** The current generator state (for tests and resuming). */
KVT_API uint64_t kvt_sampler_rng_state(const kvt_sampler *s);

/** The seed the sampler was created with (its generator's first state). */
KVT_API uint64_t kvt_sampler_seed(const kvt_sampler *s);

/** Coins the generator has drawn: one per kvt_sampler_sample() call with
 * temperature > 0 (greedy draws none), counted from creation or from the
 * count given to kvt_sampler_restore(). With the seed it fixes the state:
 * kvt_sampler_state_after(seed, draws) == kvt_sampler_rng_state(). */
KVT_API uint64_t kvt_sampler_rng_draws(const kvt_sampler *s);

/** The temperature and top-p the sampler was created with. */
KVT_API float kvt_sampler_temperature(const kvt_sampler *s);
KVT_API float kvt_sampler_topp(const kvt_sampler *s);

/** The generator state after `draws` steps of kvt_rng_u32 from `seed`
 * (O(draws)): what a resumed generation checks a saved state against. */
KVT_API uint64_t kvt_sampler_state_after(uint64_t seed, uint64_t draws);

/** Puts the generator where a saved generation left it (its seed, state and
 * draw count, from kvt_sampler_seed() / kvt_sampler_rng_state() /
 * kvt_sampler_rng_draws()), so the next sample is the one the uninterrupted
 * run drew. Temperature and top-p are kept.
 * @return 0; KVT_EINVAL (NULL sampler, seed or state 0). Not thread-safe
 *   for one sampler. */
KVT_API int kvt_sampler_restore(kvt_sampler *s, uint64_t seed, uint64_t rng_state, uint64_t draws);

/** llama2.c random_u32: xorshift64* step of *state (>> 12, << 25, >> 27,
 * times 0x2545F4914F6CDD1D), returns the high 32 bits. */
KVT_API uint32_t kvt_rng_u32(uint64_t *state);
/** llama2.c random_f32: (kvt_rng_u32 >> 8) / 16777216.0f, in [0, 1). */
KVT_API float kvt_rng_f32(uint64_t *state);

/** Index of the largest of x[0..n), the first one on ties (n >= 1). */
KVT_API int32_t kvt_sample_argmax(const float *x, int32_t n);

/** In-place softmax of x[0..n) (max-subtracted expf, float sums as llama2.c). */
KVT_API void kvt_softmax(float *x, int32_t n);

/** Multinomial sample (llama2.c sample_mult): first i whose running float sum
 * of probs[0..i] exceeds coin; n - 1 if rounding leaves none. */
KVT_API int32_t kvt_sample_mult(const float *probs, int32_t n, float coin);

/** Top-p sample (llama2.c sample_topp).
 *
 * Keeps the candidates with prob >= (1 - topp) / (n - 1) (the cutoff: they
 * cannot all fall outside the nucleus), sorts them by descending probability
 * (ties by ascending id, the order glibc's stable qsort gives llama2.c),
 * truncates after the first one at which the running sum exceeds topp, and
 * samples coin * (that sum) from the truncated list.
 * @param scratch (n,) buffer, contents overwritten.
 * @return the token id; if no candidate passes the cutoff (n == 1, NaNs) the
 *   argmax of probs (llama2.c would read out of bounds).
 */
KVT_API int32_t kvt_sample_topp(const float *probs, int32_t n, float topp, kvt_prob_index *scratch,
                                float coin);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_SAMPLER_H */
