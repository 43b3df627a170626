/*
 * chat.h: generation through the cache service, and multi-turn chat on the
 * reference engine (issue 4: the main job).
 *
 * kvt_chat_generate() is the engine side of DESIGN.md 3.14 and section 6:
 * admit, acquire (the longest reusable prefix), prefill only the tokens past
 * it, publish a zero-copy snapshot of the caches taken exactly at the prompt
 * boundary (before the first generated token), decode, publish the
 * prompt+generation entry, release. It is a loop over the step-wise API of
 * seq.h, which a batching scheduler drives directly.
 *
 * kvt_chat is a conversation: every turn renders the whole conversation with
 * the chat template and re-encodes it, as real chat traffic does (the reply
 * is re-sent as text, so its tokens may differ from the generated ones:
 * "drift"); the prompt cache makes the turn cost only its new tokens.
 *
 * Thread-safety: one generation or chat at a time per model (the model's
 * scratch is not shared); the service may be shared by several.
 */
#ifndef KVT_ENGINE_CHAT_H
#define KVT_ENGINE_CHAT_H

#include "model.h"
#include "sampler.h"
#include "tokenizer.h"

#include "kvtier/service.h"
#include "kvtier/store.h"

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the service of a model ------------------------------------------------- */

/** Settings of kvt_chat_service_create(). Zero-initialise, then set. */
typedef struct kvt_chat_service_opts {
    uint64_t prompt_cache_bytes;  /* RAM prompt cache; 0 keeps nothing (cache off) */
    uint64_t kv_budget_bytes;     /* admission budget; 0 = unlimited */
    int32_t block_tokens;         /* kv block size in tokens; 0 = 256; capped at seq_len */
    const kvt_cold_tier *cold;    /* optional cold tier (table copied; its self must
                                     outlive the service), e.g. kvt_store_cold_tier() */
    kvt_tier_chain *chain;        /* optional: the chain `cold` is the table of (the
                                     service report lists its levels), or NULL */
    uint64_t demote_idle_ms;      /* with a cold tier: demote RAM entries idle this long; 0 never */
    kvt_store *checkpoint_store;  /* optional: keeps generation checkpoints of replayable
                                     requests (kvt_service_config.checkpoint_store) */
    int64_t checkpoint_every;     /* with checkpoint_store: generated tokens between them, >= 1 */
    int checkpoint_sync;          /* with checkpoint_store: 1 = each is durable before decode goes
                                     on (kvt_service_config.checkpoint_sync) */
    struct kvt_pool *pool;        /* optional process-wide pool the service joins as
                                     pool_name (kvt_service_config.pool) */
    const char *pool_name;
} kvt_chat_service_opts;

/** Creates a cache service for `m`: layer growth from the model's layer
 * kinds (ATTN per token in whole blocks, WINDOW capped at W, RECURRENT
 * fixed), position limit seq_len, fresh caches from kvt_model_new_caches.
 * @param m borrowed: must outlive the service.
 * @param out caller frees with kvt_service_destroy().
 * @return 0, KVT_EINVAL, KVT_ENOMEM, or kvt_service_create's error. */
KVT_API int kvt_chat_service_create(const kvt_model *m, const kvt_chat_service_opts *o, kvt_service **out);

/* ---- one generation ------------------------------------------------------------- */

/** What one generation did. Times in milliseconds. */
typedef struct kvt_turn_stats {
    int64_t prompt_tokens;     /* tokens of the prompt */
    int64_t reused_tokens;     /* prompt tokens served by the service (not prefilled) */
    int64_t prefilled_tokens;  /* prompt tokens run by prefill */
    int64_t generated_tokens;  /* tokens of the reply (stop token excluded) */
    int64_t resumed_tokens;    /* reply tokens restored from a generation
                                  checkpoint (not decoded again); 0 = not resumed */
    double ttft_ms;            /* admit start to the first generated token chosen */
    double prefill_ms;         /* time inside kvt_model_prefill */
    double total_ms;           /* admit start to release */
    /* bounded live-cache residency (kvt_gen_opts.live_cache_*; 0 otherwise) */
    uint64_t paged_out_blocks, paged_out_bytes; /* full kv blocks written to the page file */
    uint64_t paged_in_blocks, paged_in_bytes;   /* read back for attention */
    double page_stall_ms;      /* attention waiting for blocks being read */
    uint64_t live_peak_bytes;  /* high-water mark of full kv blocks in RAM (the bound's) */
    uint64_t page_write_failures; /* blocks whose page write failed (kept in RAM) */
    uint64_t paged_ref_blocks, paged_ref_bytes; /* paged out by reference to their SSD-tier copy (unwritten) */
} kvt_turn_stats;

/** Settings of one generation. Zero-initialise, then set. */
typedef struct kvt_gen_opts {
    int64_t max_tokens;        /* reply tokens at most (>= 1); clamped to the
                                  positions the model has left after the prompt */
    const char *ns;            /* state namespace (kvt_service_ns), NULL = "" */
    const char *session;       /* session id, NULL = none */
    int64_t admit_timeout_ms;  /* wait for room in the KV budget; < 0 forever, 0 not at all */
    const kvt_tokenizer *stop_tok; /* optional: stop before a token whose decoded
                                  piece holds '\n' (one-line replies) */
    int64_t prefill_checkpoint_stride; /* tokens between prefill checkpoints (see
                                  kvt_chat_generate): 0 = the kv block size (256 when the
                                  model has no kv layer), < 0 = no checkpoints */
    const char *request_id;    /* replayable generation (kvtier/service.h,
                                  "generation checkpoints"): resumes from the
                                  newest valid checkpoint of this id and saves
                                  one every kvt_service_checkpoint_every()
                                  generated tokens; NULL = not replayable */
    int seed_explicit;         /* with request_id: 1 when the sampler's seed was
                                  chosen by the client (a checkpoint with another
                                  seed is then a mismatch); 0: a resumed
                                  generation takes the checkpoint's seed */
    int64_t live_cache_blocks; /* > 0: keep at most this many full kv blocks of the
                                  request in RAM (over all its layers), page the rest to
                                  a page file and back (kvtier/residency.h); 0 = no bound */
    uint64_t live_cache_bytes; /* > 0: the same bound in bytes (the smaller wins) */
    const char *live_cache_dir; /* page-file directory, NULL = $TMPDIR or /tmp */
    int live_cache_strict;      /* 1: the strict bound: no blocks past it while their writes are
                                   in flight (kvt_residency_options.write_slack < 0); 0: up to 4
                                   per layer (the default) */
} kvt_gen_opts;

/** Generates a reply to `prompt` through the service.
 *
 * Stops before EOS or BOS, before a newline piece (when stop_tok is set), or
 * after max_tokens. Prompt-boundary snapshots (when the service keeps state):
 * the caches holding exactly the prompt are cloned (zero-copy) and published
 * before the first generated token is fed; when some layer could not be cut
 * back to n_prompt - 1 tokens at that point (recurrent state, a wrapped
 * window) a snapshot of n_prompt - 1 tokens is published too, so an exact
 * repeat of the prompt reuses n_prompt - 1 tokens on every cache kind. At
 * the end the caches holding prompt + fed reply tokens are published.
 * Prefill checkpoints: on a model whose state for the whole prompt cannot be
 * cut back (a recurrent layer, or a window layer whose ring wraps within the
 * prompt), the prompt is prefilled in pieces ending at every multiple of
 * o->prefill_checkpoint_stride tokens, and at each such boundary b (reused
 * prefix < b < n_prompt - 1) the caches are cloned and published as the
 * entry prompt[0..b). A later prompt sharing P tokens with this one then
 * reuses the largest checkpoint at or below P (an untrimmable entry serves
 * only prompts extending all its tokens), where without them it reuses
 * nothing. A checkpoint shares the kv blocks it sits on (zero bytes copied
 * when the stride is a multiple of the block size; otherwise the live
 * cache copies its partial tail block once); the ring of each window layer
 * (W x kv_dim x 2 x 4 bytes) and the state of each recurrent layer
 * (dim x 4 bytes) are its own: the live caches copy them on the next
 * write. Checkpoints are ordinary entries of the prompt cache (budget,
 * retention, cold tier). A plain model (or a prompt within the window and
 * without recurrent layers) makes none: its entries can be cut back.
 * A failing publish is not an error of the generation: the state is simply
 * not kept (the report's publishes counts only accepted states).
 * Snapshots are published without a share of the acquired state's release
 * hook (that goes with the final entry): a cold tier that lends memory
 * mapped from files must keep it alive by buffer references, as the SSD
 * store does by restoring into owned buffers.
 *
 * @param m, svc, sampler borrowed; svc built for m.
 * @param prompt (n_prompt) token ids, n_prompt >= 1.
 * @param reply  receives the reply tokens, (reply_cap,) int32; reply_cap >= max_tokens.
 * @param n_reply receives the reply length.
 * @param st     NULL or receives the figures.
 * @return 0; KVT_EINVAL; KVT_ENOMEM; KVT_ELIMIT / KVT_EAGAIN from admission
 *   (the message says what to lower); an error of acquire, prefill or decode (the request
 *   is released, nothing is published after the error).
 * Not thread-safe for one model or sampler. */
KVT_API int kvt_chat_generate(kvt_model *m, kvt_service *svc, kvt_sampler *sampler, const int32_t *prompt,
                              int64_t n_prompt, const kvt_gen_opts *o, int32_t *reply, int64_t reply_cap,
                              int64_t *n_reply, kvt_turn_stats *st);

/* ---- chat template and scripts ----------------------------------------------------- */

/** Renders the conversation as the template's text:
 *   for each earlier turn i: "User: <user[i]>\nAssistant:<reply[i]>\n"
 *   then for the current turn: "User: <user[n-1]>\nAssistant:"
 * Replies are stored as decoded (they usually start with a space).
 * @param user (n_turns) messages, reply (n_turns - 1) replies, borrowed.
 * @param out  receives a NUL-terminated string; caller frees with free().
 * @return 0, KVT_EINVAL (n_turns < 1, NULL message), KVT_ENOMEM. */
KVT_API int kvt_chat_render(const char *const *user, const char *const *reply, int32_t n_turns, char **out);

/** Splits a script into user messages: one per line, '\r' and trailing
 * whitespace stripped, empty lines and lines starting with '#' skipped.
 * @param text NUL-terminated, borrowed.
 * @param lines receives (n) strings; caller frees with kvt_chat_script_free().
 * @return 0, KVT_EINVAL (NULL), KVT_ENOMEM. */
KVT_API int kvt_chat_script_parse(const char *text, char ***lines, int32_t *n);
/** Bounds of every chat input read: one message line (a script's or
 * stdin's), and a whole script or transcript file, in bytes. */
#define KVT_CHAT_MAX_LINE ((size_t)1 << 20)  /* 1 MiB */
#define KVT_CHAT_MAX_FILE ((size_t)64 << 20) /* 64 MiB */

/** Reads one line of user input from `f` into *buf (grown with realloc up to
 * KVT_CHAT_MAX_LINE + 1 bytes; the caller frees it with free()): the line
 * without its '\n' and trailing whitespace, NUL-terminated; *len receives
 * the bytes consumed from f (the line with its '\n' and trailing space). The same rules and messages for a script and for stdin: a NUL byte
 * is refused (a message is text), and so is a line longer than
 * KVT_CHAT_MAX_LINE bytes; nothing past the refused byte is read.
 * @param name names the input in messages ("stdin", a path); borrowed.
 * @param lineno the line's number (1-based), for messages.
 * @return 1 (a line; the last one may lack its '\n'); 0 (end of input, nothing
 *   read); KVT_EFORMAT (NUL byte: "NAME: line N holds a NUL byte ...");
 *   KVT_ELIMIT (the line is too long); KVT_ENOMEM; -errno (read error,
 *   e.g. -EINTR when a signal interrupted the read, -EISDIR). */
KVT_API int kvt_chat_script_read_line(FILE *f, const char *name, int64_t lineno, char **buf, size_t *cap,
                                      size_t *len);

/** Reads and parses a script file, line by line with
 * kvt_chat_script_read_line (a NUL byte or a line over KVT_CHAT_MAX_LINE is
 * refused), at most KVT_CHAT_MAX_FILE bytes in all (a larger file, or an
 * endless one such as /dev/zero, is refused, never read whole).
 * @return as parse; KVT_EFORMAT, KVT_ELIMIT (kvt_last_error names the
 *   path, the line and the limit); -errno naming the path. */
KVT_API int kvt_chat_script_load(const char *path, char ***lines, int32_t *n);
/** Frees what kvt_chat_script_parse returned. NULL is a no-op. */
KVT_API void kvt_chat_script_free(char **lines, int32_t n);

/* ---- a conversation ---------------------------------------------------------------- */

typedef struct kvt_chat kvt_chat;

/** Settings of a conversation. Zero-initialise, then set. */
typedef struct kvt_chat_opts {
    int64_t max_tokens;       /* reply tokens per turn, >= 1 */
    const char *session;      /* session id (copied), NULL = none */
    const char *ns;           /* namespace (copied), NULL = "" */
    float temperature;        /* 0 = greedy (the default) */
    float topp;               /* as kvt_sampler_create */
    uint64_t seed;            /* sampler seed, 0 = 42 */
    int multiline;            /* 1: replies may span lines (default: stop at '\n') */
    int64_t prefill_checkpoint_stride; /* as kvt_gen_opts: 0 = the kv block size, < 0 = none */
    int64_t live_cache_blocks; /* as kvt_gen_opts: bounded live-cache residency of each turn */
    uint64_t live_cache_bytes;
    const char *live_cache_dir; /* borrowed: must outlive the chat */
    int live_cache_strict;      /* as kvt_gen_opts */
} kvt_chat_opts;

/** Creates a conversation over a model, its tokenizer and a service.
 * All three are borrowed and must outlive the chat.
 * @param out caller frees with kvt_chat_free(). @return 0, KVT_EINVAL, KVT_ENOMEM. */
KVT_API int kvt_chat_create(kvt_model *m, const kvt_tokenizer *tok, kvt_service *svc, const kvt_chat_opts *o,
                            kvt_chat **out);
/** Frees a conversation (closes its session's affinity). NULL is a no-op. */
KVT_API void kvt_chat_free(kvt_chat *c);

/** Runs one turn: appends `user`, renders and encodes the whole conversation
 * (with BOS), generates, appends the decoded reply.
 * The reply text is what a chat server returns and what the next turn
 * re-sends: the llama2.c decode of the reply tokens, made valid UTF-8 (a
 * byte outside a valid sequence becomes U+FFFD). Its re-encoding may differ
 * from the generated tokens (drift).
 * @param reply receives the reply text, borrowed, valid until the next turn
 *   or kvt_chat_free. May be NULL.
 * @param reply_tokens,n_reply_tokens optional: the generated ids (borrowed, same lifetime).
 * @param st NULL or the turn's figures.
 * The reply is cut to the positions the prompt leaves (seq_len - prompt).
 * @return 0; KVT_EINVAL; KVT_ENOMEM; an error of kvt_chat_generate (the
 *   turn is not added to the conversation), among them KVT_ELIMIT when the
 *   prompt alone fills the model's context (prompt >= seq_len: no position
 *   is left for a reply; kvt_chat_last_prompt gives its tokens). */
KVT_API int kvt_chat_turn(kvt_chat *c, const char *user, const char **reply, const int32_t **reply_tokens,
                          int64_t *n_reply_tokens, kvt_turn_stats *st);

/** Appends a finished turn (a user message and the reply text it got) to the
 * conversation without generating: resumes a saved conversation. Both
 * strings are copied. @return 0, KVT_EINVAL, KVT_ENOMEM. */
KVT_API int kvt_chat_add_turn(kvt_chat *c, const char *user, const char *reply);

/** Turns in the conversation so far. */
KVT_API int32_t kvt_chat_turns(const kvt_chat *c);

/** Turn i (0-based): its user message and reply (borrowed, valid until
 * kvt_chat_free). @return 0, or KVT_ERANGE when i is not a turn. */
KVT_API int kvt_chat_get_turn(const kvt_chat *c, int32_t i, const char **user, const char **reply);

/** The prompt tokens of the last turn (borrowed, valid until the next turn). */
KVT_API const int32_t *kvt_chat_last_prompt(const kvt_chat *c, int64_t *n);

/** How many tokens the prompt of a next turn with message `user` would be:
 * the whole conversation so far and `user` rendered and encoded (with BOS)
 * as kvt_chat_turn does, without running anything. With user "" it is the
 * smallest prompt any next turn can have: when that is the model's seq_len
 * or more, the conversation cannot go on (there is no history truncation).
 * A turn's reply is cut to the positions its prompt leaves.
 * @param n receives the token count. @return 0; KVT_EINVAL (NULL argument);
 *   KVT_ENOMEM. Not thread-safe for one chat. */
KVT_API int kvt_chat_prompt_tokens(kvt_chat *c, const char *user, int64_t *n);

/** What a model's SSD state belongs to: hashes of every byte of the weights
 * the engine computes with and of the tokenizer file. */
typedef struct kvt_chat_identity {
    char model_id[48];       /* "xxh3-128:" + 32 hex digits of the whole checkpoint */
    char tokenizer_hash[48]; /* the same over the whole tokenizer file; "" when none */
    uint64_t model_bytes;    /* bytes hashed: the checkpoint's size */
    uint64_t tokenizer_bytes;
    double ms;               /* wall time the hashing took, ms */
} kvt_chat_identity;

/** Computes the identity of a loaded model: XXH3-128 over the whole mapped
 * checkpoint (the bytes kvt_model_load mapped, so no second read of the
 * file) and over the whole tokenizer file (read in 1 MiB pieces). Two
 * checkpoints that differ in any byte get different ids.
 * @param tok_path the tokenizer file, or NULL (then tokenizer_hash is "").
 * @return 0; KVT_EINVAL (NULL m or out; a tokenizer that is not a regular
 *   file: a FIFO or a device may never end); -errno naming the tokenizer file.
 * Thread-safe (reads only). */
KVT_API int kvt_chat_identity_compute(const kvt_model *m, const char *tok_path, kvt_chat_identity *out);

/* ---- helpers of the chat command and benchmark ----------------------------------------- */

/** The byte counts every kvtier command accepts, in words (for messages and
 * --help). */
#define KVT_CHAT_BYTES_FORMS "a whole or decimal number with an optional suffix K, M, G or T " \
    "(powers of 1024; KiB, MB and the like also accepted; any case), e.g. 4096, 512M, 1.5G, 2GiB"

/** Parses a byte count, the one parser of every kvtier command (chat,
 * replay, store gc, bench): DIGITS[.DIGITS][K|M|G|T[i]][B], suffixes in any
 * case, powers of 1024, rounded down to whole bytes ("1.5K" is 1536, "0.5"
 * is 0). No sign, space, exponent or hexadecimal.
 * @param what names the flag in the message (may be NULL).
 * @return 0 and *out; KVT_EINVAL naming `what` and the text (not that
 *   form, or 2^64 bytes or more; *out is left alone). Thread-safe. */
KVT_API int kvt_chat_parse_bytes(const char *what, const char *text, uint64_t *out);

/** Loads a model and its tokenizer; both paths NULL means the built-in
 * default model (kvt_default_model). One path without the other is
 * KVT_EINVAL. @param m, tok receive objects the caller frees with
 * kvt_model_free / kvt_tokenizer_free (both NULL on error).
 * @return 0 or the loader's error (kvt_last_error names the file). */
KVT_API int kvt_chat_load(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok);

/** As kvt_chat_load, and also gives the paths it loaded (the default model's
 * when both were NULL) in model_out / tok_out (cap bytes each).
 * @return as kvt_chat_load; KVT_ERANGE when a path does not fit in cap
 *   bytes (nothing is returned loaded). Thread-safe. */
KVT_API int kvt_chat_load_paths(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok,
                                char *model_out, char *tok_out, size_t cap);

/** Which file kvt_chat_load_from could not load. */
typedef enum kvt_chat_load_part {
    KVT_CHAT_LOAD_OK = 0,
    KVT_CHAT_LOAD_ARGS,          /* the arguments (one path without the other, a path over cap) */
    KVT_CHAT_LOAD_DEFAULT_MODEL, /* the built-in default model could not be created */
    KVT_CHAT_LOAD_MODEL,         /* the checkpoint (kvt_model_load) */
    KVT_CHAT_LOAD_TOKENIZER,     /* the tokenizer file (kvt_tokenizer_load; the model loaded) */
} kvt_chat_load_part;

/** As kvt_chat_load_paths, and says which file failed, so a caller can
 * report a bad tokenizer file as the tokenizer's, not the model's.
 * @param failed NULL, or receives the part that failed (KVT_CHAT_LOAD_OK
 *   on success). @return as kvt_chat_load_paths. Thread-safe. */
KVT_API int kvt_chat_load_from(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok,
                               char *model_out, char *tok_out, size_t cap, kvt_chat_load_part *failed);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_CHAT_H */
