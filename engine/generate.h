/*
 * generate.h: the llama2.c run.c generate loop on the reference engine:
 * encode the prompt with BOS, run it, then sample token after token, printing
 * each decoded piece. The prompt runs as one batched prefill instead of
 * llama2.c's token-at-a-time loop; the printed text is identical.
 */
#ifndef KVT_ENGINE_GENERATE_H
#define KVT_ENGINE_GENERATE_H

#include "kvtier/residency.h"
#include "kvtier/service.h"

#include "model.h"
#include "sampler.h"
#include "tokenizer.h"

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/** What one kvt_generate() call did and how fast. */
typedef struct kvt_generate_stats {
    int64_t steps;           /* positions run, after clamping (llama2.c's steps) */
    int64_t prompt_tokens;   /* prompt ids, BOS included */
    int64_t prefill_tokens;  /* tokens run by the batched prefill (0 if steps ended inside the prompt) */
    int64_t decode_tokens;   /* tokens run one at a time by kvt_model_decode */
    int64_t sampled_tokens;  /* tokens chosen by the sampler (printed or the final BOS) */
    double prefill_ms;       /* wall time of the prefill, ms */
    double decode_ms;        /* wall time from the first sample to the end, ms */
    double prefill_tok_s;    /* prefill_tokens / prefill time, tokens/s (0 if none) */
    double decode_tok_s;     /* decode_tokens / decode time, tokens/s (0 if none) */
    int64_t resumed_generated; /* replayable run: reply tokens its checkpoint held
                                  (the pending one included); 0 = not resumed */
    int64_t resumed_tokens;  /* tokens its restored caches held (prompt + fed reply) */
    int64_t checkpoints;     /* checkpoints this run handed to the service */
    /* kvt_generate_live under a bound (0 otherwise): */
    uint64_t paged_out_blocks, paged_out_bytes; /* full kv blocks written to the page file */
    uint64_t paged_in_blocks, paged_in_bytes;   /* read back for attention */
    double page_stall_ms;    /* attention waiting for blocks being read */
    uint64_t live_peak_bytes; /* high-water mark of full kv blocks in RAM */
    uint64_t page_write_failures; /* blocks whose page write failed (kept in RAM) */
    uint64_t paged_ref_blocks, paged_ref_bytes; /* paged out by reference to their SSD-tier copy (unwritten) */
} kvt_generate_stats;

/** A replayable kvt_generate_ex() run. Zero-initialise, then set. */
typedef struct kvt_generate_replay {
    kvt_service *svc;        /* a service for the model with a checkpoint store
                                (kvt_service_checkpoint_every() > 0); borrowed */
    const char *request_id;  /* the run's id (kvtier/service.h, kvt_replay) */
    int seed_explicit;       /* 1: the sampler's seed was given by the user */
} kvt_generate_replay;

/** Generates text exactly as llama2.c run.c generate() prints it.
 *
 * The prompt is encoded with BOS, no EOS (kvt_tokenizer_encode). llama2.c's
 * loop runs positions pos = 0..steps-1: at each it forwards the current token;
 * while pos < n_prompt - 1 the next token is the next prompt token, after
 * that the sampler picks it from the logits; a next token of BOS (id 1) ends
 * the loop; otherwise the piece kvt_tokenizer_decode(token, next) is printed
 * through kvt_tokenizer_printable(). Then "\n" is printed. Here the prompt
 * pieces are printed, the prompt runs as one kvt_model_prefill(), and each
 * later position is one kvt_model_decode(): the same positions are run and
 * the same text printed (a run that ends inside the prompt runs nothing).
 *
 * @param m       the model (borrowed; used by this thread only during the call).
 * @param tok     tokenizer whose vocab_size equals the model's.
 * @param sampler sampler for the model's vocab_size (its generator advances).
 * @param prompt  UTF-8 text, "" or NULL for BOS alone.
 * @param steps   positions to run, BOS and prompt included; 0 or more than the
 *                model's seq_len means seq_len (llama2.c). Must be >= 0.
 * @param block_tokens kv block size for the caches, >= 1 (256 is the default).
 * @param out     where text goes; flushed after every piece (llama2.c does).
 * @param stats   NULL, or receives counts and timing (also on error, as far
 *                as the run got).
 * @return 0; KVT_EINVAL (NULL model/tokenizer/sampler/out, negative steps, a
 *   vocab_size mismatch: the message gives both numbers); KVT_ENOMEM; -EIO
 *   when writing to out fails; any error of kvt_tokenizer_encode,
 *   kvt_model_new_caches, kvt_model_prefill or kvt_model_decode. On error
 *   the text printed so far stays printed; no "\n" is added.
 * Not thread-safe for one model or sampler.
 */
KVT_API int kvt_generate(kvt_model *m, const kvt_tokenizer *tok, kvt_sampler *sampler, const char *prompt,
                         int64_t steps, int32_t block_tokens, FILE *out, kvt_generate_stats *stats);

/** kvt_generate(), replayable: the same positions run and the same text is
 * printed, and the run survives a crash.
 *
 * With rp NULL it is kvt_generate(). With rp, the run is a request of
 * rp->svc (admitted for the tokens fed after the prompt, steps - n_prompt:
 * the token chosen at the last position is never fed) that resumes from the newest valid checkpoint of
 * rp->request_id (kvt_replay_acquire: caches, reply tokens and the sampler's
 * generator come back; nothing it covers is prefilled or decoded again) and
 * saves a checkpoint every kvt_service_checkpoint_every() generated tokens
 * (zero-copy clone, write-behind). A resumed run prints the whole text an
 * uninterrupted run prints: the prompt pieces, the restored reply's pieces,
 * then what it generates. A run that reaches its end (BOS or steps) is
 * released completed, which removes its checkpoints; an error leaves them.
 * @param block_tokens ignored with rp (the service makes the caches).
 * @return as kvt_generate; with rp also the errors of kvt_service_admit
 *   and kvt_replay_acquire (KVT_EMISMATCH names the field that differs).
 * Not thread-safe for one model or sampler. */
KVT_API int kvt_generate_ex(kvt_model *m, const kvt_tokenizer *tok, kvt_sampler *sampler, const char *prompt,
                            int64_t steps, int32_t block_tokens, const kvt_generate_replay *rp, FILE *out,
                            kvt_generate_stats *stats);

/** kvt_generate_ex() with bounded live-cache residency: when live is not
 * NULL and bounds something (max_blocks or max_bytes), the run's kv caches
 * keep at most that many full blocks in RAM and page the rest through a
 * page file (kvtier/residency.h); the text printed is the same as fully
 * resident (same arithmetic), and stats gets the paging counters. A page
 * read that fails or does not match its checksum ends the run with that
 * error (KVT_EIO, KVT_ECORRUPT); a failed page write keeps the block in RAM.
 * With rp the bound applies to the caches the service makes (fresh, or
 * restored from a checkpoint: then the bound is enforced at once), the
 * admission charges the bound, and each checkpoint (a clone sharing the
 * page-file copies) reads the paged blocks back when it is encoded.
 * @param live borrowed during the call; NULL = fully resident.
 * @return as kvt_generate_ex; kvt_residency_create's errors. */
KVT_API int kvt_generate_live(kvt_model *m, const kvt_tokenizer *tok, kvt_sampler *sampler, const char *prompt,
                              int64_t steps, int32_t block_tokens, const kvt_generate_replay *rp,
                              const kvt_residency_options *live, FILE *out, kvt_generate_stats *stats);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_GENERATE_H */
