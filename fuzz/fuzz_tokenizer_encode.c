/*
 * fuzz_tokenizer_encode.c: differential check of kvt_tokenizer_encode
 * (engine/tokenizer.c: a heap of candidate merges, O(n log n)) against
 * llama2.c's own encode loop (tests/support/tok_ref.c: bsearch lookups, a
 * full rescan per merge). The input builds a vocabulary, <unk>, BOS, EOS,
 * the 256 byte pieces and " " followed by up to 32 pieces of its own (any
 * bytes, duplicates allowed, scores including -1e10 and NaN), and gives the
 * text and the BOS/EOS flags. Both encoders must give the same ids, and the
 * decode of those ids must not fail.
 */
#include "fuzz_util.h"

#include "tok_ref.h"
#include "tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int put_piece(uint8_t **b, size_t *n, float score, const void *s, int32_t len)
{
    return fz_append(b, n, &score, 4) | fz_append(b, n, &len, 4) | fz_append(b, n, s, (size_t)len);
}

static float score_of(uint8_t v)
{
    int8_t s = (int8_t)v;
    if (s == 127)
        return NAN;
    if (s == -128)
        return -1e10f;
    return (float)s / 4.0f;
}

/* The part of every vocabulary file that does not depend on the input:
 * max_token_length, <unk>, BOS, EOS and the 256 byte pieces, written once. */
static uint8_t *g_base;
static size_t g_base_len;

static void setup(void)
{
    if (g_base)
        return;
    int32_t maxlen = 16;
    int rc = fz_append(&g_base, &g_base_len, &maxlen, 4);
    rc |= put_piece(&g_base, &g_base_len, 0, "<unk>", 5);
    rc |= put_piece(&g_base, &g_base_len, 0, "\n<s>\n", 5);
    rc |= put_piece(&g_base, &g_base_len, 0, "\n</s>\n", 6);
    for (int b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        rc |= put_piece(&g_base, &g_base_len, 0, s, 6);
    }
    if (rc)
        abort();
}

/* Appends one piece at b + *n (the caller sized b for every piece). */
static void add_piece(uint8_t *b, size_t *n, float score, const void *s, int32_t len)
{
    memcpy(b + *n, &score, 4);
    memcpy(b + *n + 4, &len, 4);
    if (len)
        memcpy(b + *n + 8, s, (size_t)len);
    *n += 8 + (size_t)len;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    fz_in in = {data, size};
    uint8_t flags = fz_u8(&in);
    int n_extra = fz_u8(&in) % 33;
    /* the base, " " and up to 32 pieces of at most 12 bytes */
    uint8_t *file = malloc(g_base_len + 33 * (8 + 12));
    if (!file)
        return 0;
    memcpy(file, g_base, g_base_len);
    size_t len = g_base_len;
    add_piece(file, &len, score_of(fz_u8(&in)), " ", 1);
    for (int i = 0; i < n_extra; i++) {
        int32_t pl = fz_u8(&in) % 13;
        float sc = score_of(fz_u8(&in));
        const uint8_t *p = fz_take(&in, (size_t)pl);
        if (!p)
            break;
        add_piece(file, &len, sc, p, pl);
    }
    char path[64];
    int fd = fz_memfile(file, len, path);
    free(file);
    if (fd < 0)
        return 0;
    kvt_tokenizer *t = NULL;
    int rc = kvt_tokenizer_load(path, 0, &t);
    close(fd);
    FZ_CHECK(rc == 0, "a well-formed vocabulary was refused: %s", kvt_last_error());
    size_t tl = in.n > 512 ? 512 : in.n;
    char *text = fz_cstr(in.p, tl); /* stops at the first NUL, as a C string does */
    size_t cap = strlen(text) + 3;
    int32_t *got = malloc(cap * sizeof *got), *want = malloc(cap * sizeof *want);
    int64_t n = -1;
    int bos = flags & 1, eos = (flags >> 1) & 1;
    rc = kvt_tokenizer_encode(t, text, bos, eos, got, (int64_t)cap, &n);
    FZ_CHECK(rc == 0, "encode failed: %s", kvt_last_error());
    int m = tok_ref_encode(t, text, bos, eos, want);
    FZ_CHECK(n == m, "%lld ids, llama2.c gives %d", (long long)n, m);
    for (int i = 0; i < m; i++)
        FZ_CHECK(got[i] == want[i], "id %d is %d, llama2.c gives %d", i, got[i], want[i]);
    for (int64_t i = 1; i < n; i++)
        FZ_CHECK(kvt_tokenizer_decode(t, got[i - 1], got[i]) != NULL, "decode of id %d", got[i]);
    /* a capacity one short is refused, never overrun */
    if (n > 0) {
        int64_t k = -1;
        FZ_CHECK(kvt_tokenizer_encode(t, text, bos, eos, got, n - 1, &k) == KVT_ERANGE && k == 0,
                 "encode into %lld slots of %lld", (long long)(n - 1), (long long)n);
    }
    free(got);
    free(want);
    free(text);
    kvt_tokenizer_free(t);
    return 0;
}
