/*
 * fuzz_tokenizer_file.c: kvt_tokenizer_load (engine/tokenizer.c) on
 * arbitrary tokenizer.bin files, then every use of what it accepted: each
 * piece, score and decode (after BOS and not), the printable filter, and
 * encodes of a text made of the vocabulary's own pieces and of a few fixed
 * strings. Loading must refuse what does not parse with KVT_EFORMAT; an
 * accepted vocabulary must never make encode or decode read outside it.
 */
#include "fuzz_util.h"

#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void encode_text(const kvt_tokenizer *t, const char *text)
{
    size_t cap = strlen(text) + 3;
    int32_t *ids = malloc(cap * sizeof *ids);
    int64_t n = -1;
    int rc = kvt_tokenizer_encode(t, text, 1, 1, ids, (int64_t)cap, &n);
    /* byte fallback outside a small vocabulary is the one refusal */
    FZ_CHECK(rc == 0 || rc == KVT_ERANGE, "encode returned %d: %s", rc, kvt_last_error());
    if (!rc) {
        FZ_CHECK(n >= 2 && (size_t)n <= cap, "%lld ids for %zu bytes", (long long)n, strlen(text));
        int32_t V = kvt_tokenizer_vocab_size(t);
        for (int64_t i = 0; i < n; i++) {
            FZ_CHECK(ids[i] >= 0 && ids[i] < V, "id %d outside the %d-piece vocabulary", ids[i], V);
            if (i)
                (void)kvt_tokenizer_printable(kvt_tokenizer_decode(t, ids[i - 1], ids[i]));
        }
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    int fd = fz_memfile(data, size, path);
    if (fd < 0)
        return 0;
    kvt_tokenizer *t = NULL;
    int32_t vocab = size ? (int32_t)(data[size - 1] % 2 ? 0 : 259) : 0;
    int rc = kvt_tokenizer_load(path, vocab, &t);
    close(fd);
    if (rc) {
        FZ_CHECK(!t, "a refused file gave a tokenizer");
        FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_ENOMEM, "load returned %d: %s", rc, kvt_last_error());
        return 0;
    }
    int32_t V = kvt_tokenizer_vocab_size(t);
    FZ_CHECK(V >= 1 && (!vocab || V == vocab), "vocab_size %d (asked %d)", V, vocab);
    FZ_CHECK(!kvt_tokenizer_piece(t, V) && !kvt_tokenizer_piece(t, -1), "piece outside the vocabulary");
    FZ_CHECK(!kvt_tokenizer_decode(t, 1, V), "decode outside the vocabulary");
    size_t total = 0;
    for (int32_t i = 0; i < V; i++) {
        const char *p = kvt_tokenizer_piece(t, i);
        FZ_CHECK(p != NULL, "piece %d", i);
        total += strlen(p);
        (void)kvt_tokenizer_score(t, i);
        const char *d1 = kvt_tokenizer_decode(t, 1, i), *d0 = kvt_tokenizer_decode(t, 0, i);
        FZ_CHECK(d1 && d0, "decode of %d", i);
        (void)kvt_tokenizer_printable(d0);
    }
    /* a text made of the pieces themselves (bounded) */
    size_t cap = total < 4096 ? total : 4096;
    char *text = malloc(cap + 1);
    size_t at = 0;
    for (int32_t i = 0; i < V && at < cap; i++) {
        const char *p = kvt_tokenizer_piece(t, i);
        size_t l = strlen(p);
        if (at + l > cap)
            break;
        memcpy(text + at, p, l);
        at += l;
    }
    text[at] = '\0';
    encode_text(t, text);
    free(text);
    encode_text(t, "Once upon a time, \xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80 \xFF\x80");
    encode_text(t, "");
    kvt_tokenizer_free(t);
    return 0;
}
