/*
 * tokenizer.h: the reference engine's tokenizer: llama2.c `tokenizer.bin`
 * files (a SentencePiece BPE vocabulary exported by llama2.c tokenizer.py),
 * with byte-exact llama2.c run.c encode/decode semantics.
 *
 * File format (all little-endian, as llama2.c writes it):
 *   int32 max_token_length            longest piece, in bytes
 *   then for each id 0..vocab_size-1:
 *     float32 score                   merge priority (higher merges first)
 *     int32   len                     piece length in bytes, >= 0
 *     len bytes                       the piece (no terminator)
 * The file does not store vocab_size; it must hold exactly the model's
 * vocab_size pieces (llama2.c run.c build_tokenizer reads the count from
 * the checkpoint). Ids 1 and 2 are BOS and EOS; ids 3..258 are the byte
 * pieces "<0x00>".."<0xFF>" used for byte fallback (byte b -> id b + 3).
 *
 * Pieces are used as C strings, as llama2.c does: a piece holding a NUL
 * byte acts as its prefix before the NUL in encode, decode and printing.
 */
#ifndef KVT_ENGINE_TOKENIZER_H
#define KVT_ENGINE_TOKENIZER_H

#include "kvtier/common.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Token id of BOS ("\n<s>\n") in llama2.c vocabularies. */
#define KVT_TOKEN_BOS 1
/** Token id of EOS ("\n</s>\n") in llama2.c vocabularies. */
#define KVT_TOKEN_EOS 2
/** Id of the byte piece for byte 0x00; byte b falls back to id b + this. */
#define KVT_TOKEN_BYTE0 3
/** vocab_size of the built-in default tokenizer: <unk>, BOS, EOS + 256 bytes. */
#define KVT_DEFAULT_VOCAB 259

/** A loaded vocabulary. Immutable after kvt_tokenizer_load(). */
typedef struct kvt_tokenizer kvt_tokenizer;

/** Loads a llama2.c tokenizer.bin.
 *
 * Reads the whole file, checks that every record is complete, that no length
 * is negative, that the header's max_token_length is at least the longest
 * piece, and that the file holds exactly `vocab_size` pieces with nothing
 * after them.
 *
 * @param path       file to read.
 * @param vocab_size the model's vocab_size (checkpoint header), >= 1; or 0 to
 *                   accept however many pieces the file holds (at least 1).
 * @param out        receives the tokenizer; the caller frees it with
 *                   kvt_tokenizer_free(). Untouched on error.
 * @return 0; KVT_EINVAL (NULL argument, negative vocab_size); -errno (cannot
 *   open or read the file); KVT_EFORMAT (short file, truncated record,
 *   negative length, max_token_length smaller than a piece, or a piece count
 *   that differs from vocab_size: the message names the file and both
 *   numbers); KVT_ETOOBIG (file over 1 GiB); KVT_ENOMEM.
 * Thread-safe (touches no shared state).
 */
KVT_API int kvt_tokenizer_load(const char *path, int32_t vocab_size, kvt_tokenizer **out);

/** Frees a tokenizer. NULL is a no-op. */
KVT_API void kvt_tokenizer_free(kvt_tokenizer *t);

/** Number of pieces (ids 0..n-1). Thread-safe. */
KVT_API int32_t kvt_tokenizer_vocab_size(const kvt_tokenizer *t);

/** The raw piece of `id` as stored (NUL-terminated, llama2.c's vocab[id]).
 * Borrowed, valid until kvt_tokenizer_free(). NULL if id is out of range.
 * Thread-safe. */
KVT_API const char *kvt_tokenizer_piece(const kvt_tokenizer *t, int32_t id);

/** Merge score of `id` (0.0f if out of range). Thread-safe. */
KVT_API float kvt_tokenizer_score(const kvt_tokenizer *t, int32_t id);

/** Encodes UTF-8 text the way llama2.c run.c encode() does.
 *
 * Steps: optional BOS (id 1); for non-empty text the dummy prefix: the id of
 * the piece " " (if the vocabulary has no " " piece, byte fallback: id
 * ' ' + 3; llama2.c would emit -1 there); then each UTF-8 codepoint (a lead
 * byte plus at most 3 continuation bytes) is looked up as a piece, and if
 * absent each of its bytes becomes id byte + 3; then repeatedly the adjacent
 * pair whose concatenation is a piece with the highest score (leftmost on a
 * tie, scores must exceed -1e10) is merged, until no pair merges; optional
 * EOS (id 2). Same output as llama2.c for every input, in O(n log n) time
 * with n = strlen(text) (a heap of candidate pairs instead of llama2.c's full
 * rescan per merge).
 *
 * @param text     NUL-terminated UTF-8 (invalid UTF-8 is allowed: bytes fall
 *                 back to byte pieces exactly as in llama2.c).
 * @param bos,eos  nonzero to add BOS / EOS.
 * @param tokens   receives the ids, (cap,) int32.
 * @param cap      capacity of tokens in tokens; strlen(text) + 3 always suffices.
 * @param n_tokens receives the number of ids written.
 * @return 0; KVT_EINVAL (NULL argument); KVT_ERANGE (more than cap ids, a
 *   byte fallback id outside the vocabulary: the message names the byte, or
 *   BOS/EOS asked of a vocabulary too small to hold id 1/2);
 *   KVT_ENOMEM. On error *n_tokens is 0 and tokens' contents are unspecified.
 * Thread-safe (the tokenizer is only read).
 */
KVT_API int kvt_tokenizer_encode(const kvt_tokenizer *t, const char *text, int bos, int eos,
                                 int32_t *tokens, int64_t cap, int64_t *n_tokens);

/** The piece llama2.c run.c decode() yields for `token` following `prev`.
 *
 * After BOS (prev == 1) a leading space of the piece is dropped; a piece of
 * the form "<0xNN>" (parsed as sscanf "<0x%02hhX>" would) becomes the single
 * raw byte NN (the empty string for 0x00).
 *
 * @return a NUL-terminated string, borrowed, valid until kvt_tokenizer_free();
 *   NULL if token is out of range. Thread-safe.
 */
KVT_API const char *kvt_tokenizer_decode(const kvt_tokenizer *t, int32_t prev, int32_t token);

/** What llama2.c run.c safe_printf() prints for a decoded piece: nothing
 * (returns "") for NULL, "", or a single byte that is neither printable nor
 * whitespace in the C locale (isprint/isspace); otherwise the piece itself.
 * Borrowed: returns `piece` or a static "". Thread-safe. */
KVT_API const char *kvt_tokenizer_printable(const char *piece);

/** Length in bytes (1..4) of the valid UTF-8 sequence starting at p, or 0 when
 * p does not start one within `left` bytes (left >= 1): a stray continuation
 * byte, a truncated sequence, an overlong form, a surrogate or a code point
 * past U+10FFFF (RFC 3629). Reads at most min(left, 4) bytes. Pure; thread-safe. */
KVT_API size_t kvt_utf8_len(const unsigned char *p, size_t left);


/** Writes the tokenizer.bin of the built-in default model.
 *
 * Pieces: id 0 "<unk>", 1 "\n<s>\n" (BOS), 2 "\n</s>\n" (EOS), 3..258 the byte
 * pieces "<0x00>".."<0xFF>" (upper-case hex), every score 0, max_token_length
 * 6. Text therefore encodes one id per byte (plus BOS and the dummy-prefix
 * space) and decodes back to the same bytes. Only vocab_size 259 can be
 * filled meaningfully (more ids would have no piece to hold; fewer cannot
 * hold the 256 bytes), so any other size is refused.
 * Written atomically: to "<path>.tmp.<pid>", fsync, then rename over path,
 * so a reader never sees a partial file.
 *
 * @param path       destination file (its directory must exist).
 * @param vocab_size must be KVT_DEFAULT_VOCAB (259).
 * @return 0; KVT_EINVAL (NULL path or vocab_size != 259, naming it);
 *   -errno (create, write, fsync or rename failed; the temp file is removed).
 * Thread-safe for distinct paths.
 */
KVT_API int kvt_tokenizer_write_default(const char *path, int32_t vocab_size);

#ifdef __cplusplus
}
#endif
#endif /* KVT_ENGINE_TOKENIZER_H */
