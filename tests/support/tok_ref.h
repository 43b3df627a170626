/*
 * tok_ref.h: a plain transcription of llama2.c run.c encode() (qsort +
 * bsearch lookups, a full rescan of every pair per merge), the reference
 * kvt_tokenizer_encode is compared with by test_tokenizer.c and by the
 * fuzz target fuzz_tokenizer_encode.
 */
#ifndef KVT_TEST_TOK_REF_H
#define KVT_TEST_TOK_REF_H

#include "tokenizer.h"

#include <stdint.h>

/** llama2.c's encode of `text` with vocabulary t into tokens (strlen(text) +
 * 3 slots suffice); returns the count. As in llama2.c, the dummy prefix
 * looks up " " (the vocabulary must hold it) and byte fallback uses id
 * byte + 3 (the vocabulary must hold ids up to 258). */
int tok_ref_encode(const kvt_tokenizer *t, const char *text, int bos, int eos, int32_t *tokens);

#endif
