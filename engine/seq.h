/*
 * seq.h: one generation through the cache service, step by step.
 *
 * A kvt_seq is one request's generation split into the steps a
 * continuous-batching scheduler interleaves across many sequences:
 *
 *     kvt_seq_begin()          admit under the KV budget, acquire the longest
 *                              reusable prefix (else fresh caches)
 *     kvt_seq_prefill() ...    bounded chunks of the rest of the prompt; the
 *                              call that completes it samples the first token
 *     loop:
 *       kvt_seq_next()         the token chosen last (stream it), finished?
 *       kvt_seq_decode()       feed it and sample the next, alone, or
 *       (batched decode by the caller into kvt_seq_logits) + kvt_seq_after_decode()
 *     kvt_seq_finish()         publish what was computed, release, free
 *
 * kvt_chat_generate() (chat.h) is exactly this loop with one unbounded
 * prefill call and kvt_seq_decode(); a sequence stepped with any prefill
 * chunk sizes makes the same state and the same tokens.
 *
 * What is published to the service (when it keeps state for the request):
 * - during prefill, at the moment the caches hold exactly those tokens:
 *   the prompt-boundary snapshot (all n_prompt tokens) and, when some layer
 *   holding the whole prompt could not be cut back to n_prompt - 1 tokens
 *   (recurrent state, a wrapped window), a snapshot of n_prompt - 1 tokens,
 *   so an exact repeat reuses n_prompt - 1 on every cache kind; on such
 *   models also a checkpoint at every multiple of the prefill checkpoint
 *   stride between the reused prefix and n_prompt - 1 (kvt_gen_opts,
 *   kvt_chat_generate in chat.h), so a prompt sharing only a start with
 *   this one still reuses that start;
 * - at kvt_seq_finish(): the prompt plus every fed reply token.
 * Each snapshot is a zero-copy clone (kv blocks are shared). A refused
 * publish is not an error of the generation: that state is simply not kept.
 *
 * Thread-safety: a sequence is used by one thread at a time, and its model
 * and sampler by one thread at a time (a model's scratch is shared by every
 * sequence on it: a scheduler runs all of a model's sequences on one engine
 * thread). The service may be shared with other threads.
 */
#ifndef KVT_ENGINE_SEQ_H
#define KVT_ENGINE_SEQ_H

#include "chat.h"
#include "kvtier/residency.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvt_seq kvt_seq;

/** Starts a sequence: validates, admits the request under the service's KV
 * budget (prompt + max_tokens tokens; max_tokens is first clamped to the
 * positions the model has left after the prompt) and acquires its state
 * (the longest reusable prefix, else fresh caches). Runs no model work.
 *
 * @param m, svc borrowed; svc built for m (kvt_chat_service_create); both
 *   must outlive the sequence.
 * @param sampler borrowed until kvt_seq_finish; used by this sequence only
 *   while it runs (its random state advances with every sampled token).
 * @param prompt (n_prompt) token ids, n_prompt >= 1; copied.
 * @param o borrowed during the call; o->stop_tok (if set) is borrowed until
 *   kvt_seq_finish. o->admit_timeout_ms: < 0 waits for room as long as it
 *   takes, 0 does not wait (KVT_EAGAIN at once when the request does not fit
 *   beside the admitted ones now), > 0 waits up to that many milliseconds.
 * @param out receives the sequence; caller ends it with kvt_seq_finish().
 *   NULL on error.
 * @return 0; KVT_EINVAL (a NULL argument, n_prompt < 1, o->max_tokens < 1);
 *   KVT_EAGAIN (does not fit now / the wait timed out: nothing is held);
 *   KVT_ELIMIT (can never fit: the message says what to lower); KVT_ECLOSED;
 *   KVT_ENOMEM; an error of kvt_service_acquire. On error nothing stays
 *   admitted or allocated. */
KVT_API int kvt_seq_begin(kvt_model *m, kvt_service *svc, kvt_sampler *sampler, const int32_t *prompt,
                          int64_t n_prompt, const kvt_gen_opts *o, kvt_seq **out);

/** Prompt tokens the service served from its cache (not prefilled); 0 for
 * NULL. Known from kvt_seq_begin on. A resumed generation covers the whole
 * prompt (n_prompt). */
KVT_API int64_t kvt_seq_reused(const kvt_seq *s);

/** Reply tokens a replayable sequence (o->request_id) got back from its
 * checkpoint at kvt_seq_begin: they are in kvt_seq_reply() already (emit
 * them first: the client gets the whole reply), the prompt is done, and
 * the next kvt_seq_next() returns the checkpoint's pending token. 0 when
 * nothing was resumed or for NULL. */
KVT_API int64_t kvt_seq_resumed(const kvt_seq *s);

/* ---- replayable generations (shared by seq.c and generate.c) ---------------------- */

/** Acquires the state of a replayable request (kvt_service_resume) and,
 * when a checkpoint was resumed, puts the sampler where it was: the
 * checkpoint's generator state must follow from its seed and RNG position
 * (kvt_sampler_state_after), else KVT_EMISMATCH naming "RNG position".
 * The replay's seed, temperature, top-p are the sampler's; vocab_size the
 * model's.
 * @param reply (reply_cap) as kvt_service_resume; info->generated_tokens is
 *   0 when the request starts fresh.
 * @return 0 or an error of kvt_service_resume (then nothing is held) or the
 *   mismatch above (then *out is cleared). */
KVT_API int kvt_replay_acquire(kvt_service *svc, kvt_admission *adm, kvt_sampler *sampler, int32_t vocab_size,
                               const char *request_id, int seed_explicit, kvt_state *out,
                               kvt_checkpoint_info *info, int32_t *reply, int64_t reply_cap);

/** Saves a checkpoint of a replayable request whose caches hold tokens
 * (n_prompt prompt tokens, then generated - 1 fed reply tokens) and whose
 * sampler just chose `pending`, the generated-th reply token
 * (kvt_service_checkpoint; the metadata is read off the sampler).
 * @return as kvt_service_checkpoint (a refused checkpoint is not an error of
 *   the generation: the service counts it). */
KVT_API int kvt_replay_checkpoint(kvt_service *svc, kvt_admission *adm, const kvt_sampler *sampler,
                                  kvt_cache *const *caches, const int32_t *tokens, int64_t n_prompt,
                                  int64_t generated, int32_t pending);

/** Prefills at most max_tokens of the prompt tokens not yet in the caches.
 *
 * The tokens run in pieces that end where a snapshot is due (each
 * checkpoint boundary, and n_prompt - 1, on models whose state cannot be cut
 * back there); each snapshot is published when the caches reach its length,
 * so the snapshots do not depend on max_tokens.
 * The call that completes the prompt samples the first reply token (TTFT is
 * measured there) and publishes the prompt-boundary snapshot.
 * @param max_tokens >= 1 (INT64_MAX: the whole rest of the prompt).
 * @param prompt_done receives 1 once the whole prompt is in the caches and
 *   the first token is chosen (then kvt_seq_next() may be called), else 0.
 *   A call after the prompt is done runs nothing and returns 0.
 * @return 0; KVT_EINVAL (NULL arguments, max_tokens < 1, or the sequence
 *   failed before); an error of kvt_model_prefill: the sequence has failed
 *   (its caches are partial): only kvt_seq_finish() remains, and publishes
 *   nothing more. */
KVT_API int kvt_seq_prefill(kvt_seq *s, int64_t max_tokens, int *prompt_done);

/** The next prompt piece for a prefill driven by the caller (a batched pass,
 * kvt_model_forward_batch, with other sequences' rows): at most max_tokens
 * of the prompt tokens not yet in the caches, ending where a snapshot is due
 * (as kvt_seq_prefill cuts its pieces) and at most kvt_model_pass_rows
 * (KVT_MODEL_CHUNK), so
 * the caller feeds one piece per pass and then calls kvt_seq_after_prefill.
 * @param tokens receives a pointer to the piece's tokens (borrowed, valid
 *   until the next call on s); NULL when there is none.
 * @return the piece's length (>= 1), or 0 when the prompt is done, the
 *   sequence failed, or an argument is bad (NULL, max_tokens < 1). */
KVT_API int64_t kvt_seq_prefill_next(const kvt_seq *s, int64_t max_tokens, const int32_t **tokens);

/** The caller appended the first n tokens of the piece kvt_seq_prefill_next
 * gave to kvt_seq_caches() and, when they end the prompt, wrote the logits
 * of the last one to kvt_seq_logits(): records them and does what
 * kvt_seq_prefill does at that point (the snapshot due there; at the end of
 * the prompt: the first reply token is sampled, TTFT taken, the
 * prompt-boundary snapshot published). Time in the caller's pass is not in
 * the turn's prefill_ms.
 * @param prompt_done receives 1 once the prompt is done (kvt_seq_next may be
 *   called), else 0.
 * @return 0; KVT_EINVAL (NULL arguments, the prompt done or the sequence
 *   failed, n outside 1 .. the piece's length, or the caches do not hold
 *   exactly n tokens more: nothing changes). */
KVT_API int kvt_seq_after_prefill(kvt_seq *s, int64_t n, int *prompt_done);

/** Marks the sequence failed: a batched pass the caller ran over its caches
 * failed, so they may hold a partial step. Only kvt_seq_finish() remains,
 * and it publishes nothing more. NULL is a no-op. */
KVT_API void kvt_seq_fail(kvt_seq *s);

/** Takes the token chosen last (by the prefill that completed the prompt,
 * or by the last decode) and says whether the generation ends with it.
 *
 * - a stop token (EOS, BOS, or a piece holding '\n' when o->stop_tok is
 *   set): *tok = -1 (the stop token is not part of the reply), *finished = 1;
 * - else the token joins the reply and *tok receives it (stream it);
 *   *finished = 1 when the reply now has max_tokens tokens (that last token
 *   is never fed), else 0 and the token is pending: feed it with
 *   kvt_seq_decode(), or by a batched decode and kvt_seq_after_decode().
 * Once finished, further calls give *tok = -1, *finished = 1.
 * @return 0; KVT_EINVAL (NULL arguments; the prompt is not done; the pending
 *   token was not fed yet; the sequence failed). */
KVT_API int kvt_seq_next(kvt_seq *s, int32_t *tok, int *finished);

/** The sequence's live caches, for a batched decode driven by the caller:
 * an array of n_layers (the model's) caches holding kvt_seq_cached() tokens.
 * Borrowed, owned by the sequence, valid until kvt_seq_finish(); the caller
 * may append exactly the pending token to them (and nothing else). */
KVT_API kvt_cache **kvt_seq_caches(kvt_seq *s);

/** Tokens now in the sequence's caches (reused + prefilled + fed). */
KVT_API int64_t kvt_seq_cached(const kvt_seq *s);

/** The pending token (returned by kvt_seq_next() with finished = 0 and not
 * fed yet), or -1 when there is none. */
KVT_API int32_t kvt_seq_pending_token(const kvt_seq *s);

/** The sequence's logits buffer, (vocab_size) float32: a batched decode
 * writes the logits of the pending token here before kvt_seq_after_decode().
 * Borrowed, owned by the sequence, valid until kvt_seq_finish(). */
KVT_API float *kvt_seq_logits(kvt_seq *s);

/** Feeds the pending token through kvt_model_decode (appending it to the
 * caches) and samples the next token (taken by kvt_seq_next()).
 * @return 0; KVT_EINVAL (NULL, no pending token, or the sequence failed);
 *   an error of kvt_model_decode: the sequence has failed (see prefill). */
KVT_API int kvt_seq_decode(kvt_seq *s);

/** The caller ran a (batched) decode that appended the pending token to
 * kvt_seq_caches() and wrote its logits to kvt_seq_logits(): records the
 * token as fed and samples the next one.
 * @return 0; KVT_EINVAL (NULL, no pending token, the sequence failed, or the
 *   caches do not hold exactly one token more than before: nothing changes). */
KVT_API int kvt_seq_after_decode(kvt_seq *s);

/** The reply so far (tokens returned by kvt_seq_next with *tok >= 0), (n)
 * int32. Borrowed, valid until kvt_seq_finish(). NULL s gives NULL, n = 0. */
KVT_API const int32_t *kvt_seq_reply(const kvt_seq *s, int64_t *n);

/** Ends a sequence: publishes what was computed and not published yet
 * (prompt + fed reply tokens; a sequence cancelled during prefill publishes
 * the prompt tokens prefilled so far), releases the admission (waking
 * waiting admissions) and frees the sequence with its caches. A sequence
 * that failed publishes nothing more.
 * @param completed 1: the generation ran to its end; 0: cancelled (the
 *   request is released as interrupted). Both publish.
 * @param st NULL, or receives the figures: prompt, reused, prefilled and
 *   generated tokens, ttft_ms (0 if the first token was never chosen),
 *   prefill_ms (time inside kvt_model_prefill) and total_ms (begin to release).
 * @return 0 (a refused publish is not an error). NULL s is a no-op (st, when
 *   given, is zeroed). */
KVT_API int kvt_seq_finish(kvt_seq *s, int completed, kvt_turn_stats *st);

/** Attaches each layer's cache of a request to a bounded residency, in layer
 * order (the order attention reads them, which read-ahead follows): "kv"
 * layers (f32) and "qkvc" layers (f16, bf16, q8: their sealed blocks; the
 * f32 open block stays in RAM) are paged under the bound; window, recurrent
 * and other fixed-size kinds stay resident (they do not grow with the
 * context).
 * @param caches n_layers caches of one request; borrowed.
 * @param res the request's residency (kvtier/residency.h); borrowed.
 * @return 0; KVT_EINVAL when a layer holds its KV in the library's "qkv"
 *   kind (int8 codes, which the engine's schemes do not make), which grows
 *   with the context and is never paged: admitted under the bound it would
 *   hold more than was charged, so the request is refused, naming the layer;
 *   kvt_kv_set_residency's errors. On an error, layers attached before it
 *   stay attached (the caller detaches them as it does on success). Not
 *   thread-safe for one request's caches. */
KVT_API int kvt_seq_live_attach(kvt_cache *const *caches, int32_t n_layers, kvt_residency *res);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_SEQ_H */
