/*
 * test_tokenizer.c: the llama2.c tokenizer (engine/tokenizer.h): the default
 * byte vocabulary, known encodings and round trips on tok512.bin, byte
 * fallback, merge order (best score first, leftmost on ties), decode rules
 * after BOS and for byte pieces, safe_printf filtering, and one error per
 * kind of bad tokenizer file. A randomized differential test compares
 * kvt_tokenizer_encode with a plain transcription of llama2.c's encode loop
 * (qsort + bsearch lookups, full rescan per merge); it prints its seed, set
 * KVT_TEST_SEED to replay.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_seed.h"
#include "tok_ref.h"

#include "tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- helpers ---------------------------------------------------------------- */

static char g_dir[256];

static int setup_dir(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvt_test_tok_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static void path_in_dir(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", g_dir, name);
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Appends one little-endian int32 / float32 / raw bytes to a growing buffer. */
typedef struct {
    unsigned char *p;
    size_t n;
} bytes;

static void put(bytes *b, const void *src, size_t n)
{
    b->p = realloc(b->p, b->n + n + 1);
    assert_non_null(b->p);
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_i32(bytes *b, int32_t v) { put(b, &v, 4); }
static void put_f32(bytes *b, float v) { put(b, &v, 4); }
static void put_piece(bytes *b, float score, const char *s)
{
    put_f32(b, score);
    put_i32(b, (int32_t)strlen(s));
    put(b, s, strlen(s));
}

/* A vocabulary: <unk>, BOS, EOS, 256 byte pieces, then `extra` pieces. */
static void write_vocab(const char *path, const char *const *extra, const float *scores, int n_extra)
{
    bytes b = {0};
    int32_t maxlen = 6;
    for (int i = 0; i < n_extra; i++)
        if ((int32_t)strlen(extra[i]) > maxlen)
            maxlen = (int32_t)strlen(extra[i]);
    put_i32(&b, maxlen);
    put_piece(&b, 0, "<unk>");
    put_piece(&b, 0, "\n<s>\n");
    put_piece(&b, 0, "\n</s>\n");
    for (int i = 0; i < 256; i++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", i);
        put_piece(&b, 0, s);
    }
    for (int i = 0; i < n_extra; i++)
        put_piece(&b, scores[i], extra[i]);
    write_bytes(path, b.p, b.n);
    free(b.p);
}

static int64_t encode(const kvt_tokenizer *t, const char *text, int bos, int eos, int32_t *out, int64_t cap)
{
    int64_t n = -1;
    int rc = kvt_tokenizer_encode(t, text, bos, eos, out, cap, &n);
    if (rc)
        fail_msg("encode(\"%s\") failed: %s: %s", text, kvt_strerror(rc), kvt_last_error());
    return n;
}

/* Concatenation of decode() (raw, or through the safe_printf filter) of ids[1..n). */
static char *decode_all(const kvt_tokenizer *t, const int32_t *ids, int64_t n, int printable)
{
    size_t cap = 16;
    for (int64_t i = 0; i < n; i++)
        cap += strlen(kvt_tokenizer_piece(t, ids[i]));
    char *s = calloc(1, cap);
    assert_non_null(s);
    for (int64_t i = 1; i < n; i++) {
        const char *p = kvt_tokenizer_decode(t, ids[i - 1], ids[i]);
        assert_non_null(p);
        strcat(s, printable ? kvt_tokenizer_printable(p) : p);
    }
    return s;
}

static const char *shared_file(char *buf, size_t cap, const char *rel)
{
    const char *dir = getenv("KVT_SHARED_DIR");
    if (!dir)
        return NULL;
    snprintf(buf, cap, "%s/%s", dir, rel);
    return access(buf, R_OK) == 0 ? buf : NULL;
}

static kvt_tokenizer *load_tok512(void)
{
    char buf[1024];
    const char *p = shared_file(buf, sizeof buf, "data/models/tok512.bin");
    if (!p) {
        print_message("skipping: KVT_SHARED_DIR/data/models/tok512.bin not available (KVT_SHARED_DIR=%s)\n",
                      getenv("KVT_SHARED_DIR") ? getenv("KVT_SHARED_DIR") : "(unset)");
        return NULL;
    }
    kvt_tokenizer *t = NULL;
    int rc = kvt_tokenizer_load(p, 512, &t);
    if (rc)
        fail_msg("load %s: %s: %s", p, kvt_strerror(rc), kvt_last_error());
    return t;
}

/* ---- the default vocabulary -------------------------------------------------- */

static void test_default_vocab(void **state)
{
    (void)state;
    char path[512];
    path_in_dir(path, sizeof path, "default.bin");
    assert_int_equal(kvt_tokenizer_write_default(path, 259), 0);
    kvt_tokenizer *t = NULL;
    assert_int_equal(kvt_tokenizer_load(path, 259, &t), 0);
    assert_int_equal(kvt_tokenizer_vocab_size(t), 259);
    assert_string_equal(kvt_tokenizer_piece(t, 0), "<unk>");
    assert_string_equal(kvt_tokenizer_piece(t, 1), "\n<s>\n");
    assert_string_equal(kvt_tokenizer_piece(t, 2), "\n</s>\n");
    assert_string_equal(kvt_tokenizer_piece(t, 3), "<0x00>");
    assert_string_equal(kvt_tokenizer_piece(t, 3 + 0x0A), "<0x0A>");
    assert_string_equal(kvt_tokenizer_piece(t, 258), "<0xFF>");
    assert_null(kvt_tokenizer_piece(t, 259));
    assert_null(kvt_tokenizer_piece(t, -1));
    assert_true(kvt_tokenizer_score(t, 100) == 0.0f);

    /* One id per byte, dummy prefix by byte fallback, BOS/EOS on request. */
    int32_t ids[64];
    int64_t n = encode(t, "Hi\xC3\xA9", 1, 1, ids, 64);
    int32_t want[] = {1, ' ' + 3, 'H' + 3, 'i' + 3, 0xC3 + 3, 0xA9 + 3, 2};
    assert_int_equal(n, 7);
    for (int i = 0; i < 7; i++)
        assert_int_equal(ids[i], want[i]);
    char *raw = decode_all(t, ids, n - 1, 0); /* without EOS */
    assert_string_equal(raw, " Hi\xC3\xA9"); /* "<0x20>" is not a leading space: kept */
    free(raw);
    char *shown = decode_all(t, ids, n - 1, 1);
    assert_string_equal(shown, " Hi"); /* single bytes >= 0x80 are not printed (safe_printf) */
    free(shown);

    /* Empty text: BOS alone, no dummy prefix. */
    assert_int_equal(encode(t, "", 1, 0, ids, 64), 1);
    assert_int_equal(ids[0], 1);
    assert_int_equal(encode(t, "", 0, 0, ids, 64), 0);
    kvt_tokenizer_free(t);

    /* Only 259 can be filled; nothing is written for another size. */
    char other[512];
    path_in_dir(other, sizeof other, "other.bin");
    assert_int_equal(kvt_tokenizer_write_default(other, 512), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "512"));
    assert_int_equal(access(other, F_OK), -1);
    assert_int_equal(kvt_tokenizer_write_default(NULL, 259), KVT_EINVAL);
    /* Unwritable place: -errno, no temp file left. */
    assert_int_equal(kvt_tokenizer_write_default("/nonexistent-dir/x.bin", 259), -ENOENT);
}

/* ---- tok512.bin: known encodings, round trips --------------------------------- */

static void test_tok512_known(void **state)
{
    (void)state;
    kvt_tokenizer *t = load_tok512();
    if (!t)
        skip();
    int32_t ids[256];
    /* Pinned after the golden test (test_golden) reproduced llama2.c's
     * output for this prompt. */
    int32_t want[] = {1, 326, 269, 301, 425, 411, 263, 377, 267, 265, 410, 451, 347, 426};
    int64_t n = encode(t, "Tim and Sue went to the zoo.", 1, 0, ids, 256);
    assert_int_equal(n, 14);
    for (int i = 0; i < 14; i++)
        assert_int_equal(ids[i], want[i]);
    char *s = decode_all(t, ids, n, 1);
    assert_string_equal(s, "Tim and Sue went to the zoo.");
    free(s);
    /* EOS is appended after merging. */
    assert_int_equal(encode(t, "Tim and Sue went to the zoo.", 1, 1, ids, 256), 15);
    assert_int_equal(ids[14], 2);
    /* Without BOS the dummy-prefix space is not stripped. */
    n = encode(t, "zoo", 0, 0, ids, 256);
    assert_true(n >= 1);
    assert_int_equal(ids[0] == 1, 0);
    kvt_tokenizer_free(t);
}

static void test_tok512_roundtrip(void **state)
{
    (void)state;
    kvt_tokenizer *t = load_tok512();
    if (!t)
        skip();
    static const char *const texts[] = {
        "Once upon a time, there was a little girl named Lily.",
        "  two leading spaces",
        "tabs\tand\nnewlines\n\n",
        "Numbers 12345 and punctuation !?.,;:'\"()[]{}",
        "x",
        " ",
        "h\xC3\xA9llo w\xC3\xB6rld \xE2\x82\xAC 100 \xF0\x9F\x98\x80 done", /* UTF-8 incl. a 4-byte emoji */
        "invalid \xFF\xFE utf-8 \x80\x80\x80\x80\x80 continuation run",
    };
    for (size_t k = 0; k < sizeof texts / sizeof *texts; k++) {
        int64_t cap = (int64_t)strlen(texts[k]) + 3;
        int32_t *ids = malloc((size_t)cap * sizeof *ids);
        int64_t n = encode(t, texts[k], 1, 0, ids, cap);
        assert_true(n >= 2 && n <= cap);
        assert_int_equal(ids[0], 1);
        for (int64_t i = 0; i < n; i++)
            assert_true(ids[i] >= 0 && ids[i] < 512);
        /* Raw decode is the exact inverse (BOS strips the dummy prefix). */
        char *raw = decode_all(t, ids, n, 0);
        assert_string_equal(raw, texts[k]);
        free(raw);
        free(ids);
    }
    kvt_tokenizer_free(t);
}

static void test_byte_fallback(void **state)
{
    (void)state;
    kvt_tokenizer *t = load_tok512();
    if (!t)
        skip();
    /* An emoji has no piece in a 512-piece vocabulary: four byte pieces. */
    int32_t ids[16];
    int64_t n = encode(t, "\xF0\x9F\x98\x80", 1, 0, ids, 16);
    assert_true(n >= 5);
    assert_int_equal(ids[n - 4], 0xF0 + 3);
    assert_int_equal(ids[n - 3], 0x9F + 3);
    assert_int_equal(ids[n - 2], 0x98 + 3);
    assert_int_equal(ids[n - 1], 0x80 + 3);
    /* Decoded, each is its raw byte; safe_printf drops them (not isprint). */
    assert_string_equal(kvt_tokenizer_decode(t, 5, 0xF0 + 3), "\xF0");
    assert_string_equal(kvt_tokenizer_printable("\xF0"), "");
    kvt_tokenizer_free(t);

    /* A byte whose fallback id is outside a tiny vocabulary is refused. */
    char path[512];
    path_in_dir(path, sizeof path, "tiny.bin");
    bytes b = {0};
    put_i32(&b, 6);
    put_piece(&b, 0, "<unk>");
    put_piece(&b, 0, "\n<s>\n");
    put_piece(&b, 0, "\n</s>\n");
    put_piece(&b, 0, " ");
    put_piece(&b, 0, "a");
    write_bytes(path, b.p, b.n);
    free(b.p);
    kvt_tokenizer *tiny = NULL;
    assert_int_equal(kvt_tokenizer_load(path, 5, &tiny), 0);
    assert_int_equal(encode(tiny, "aa", 1, 0, ids, 16), 4); /* BOS, " ", a, a */
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 4);
    int64_t m = 99;
    assert_int_equal(kvt_tokenizer_encode(tiny, "ab", 1, 0, ids, 16, &m), KVT_ERANGE);
    assert_int_equal(m, 0);
    assert_non_null(strstr(kvt_last_error(), "0x62"));
    kvt_tokenizer_free(tiny);

    /* BOS/EOS ids a vocabulary does not hold are refused, never returned
     * (fuzz_tokenizer_file found a 1-piece vocabulary encoding BOS as id 1) */
    b = (bytes){0};
    put_i32(&b, 6);
    put_piece(&b, 0, "<unk>");
    put_piece(&b, 0, "\n<s>\n");
    write_bytes(path, b.p, b.n);
    free(b.p);
    assert_int_equal(kvt_tokenizer_load(path, 0, &tiny), 0);
    m = 99;
    assert_int_equal(kvt_tokenizer_encode(tiny, "", 1, 0, ids, 16, &m), 0);
    assert_int_equal(m, 1);
    assert_int_equal(kvt_tokenizer_encode(tiny, "", 1, 1, ids, 16, &m), KVT_ERANGE);
    assert_int_equal(m, 0);
    assert_non_null(strstr(kvt_last_error(), "EOS id 2"));
    kvt_tokenizer_free(tiny);
}

/* ---- merge order -------------------------------------------------------------- */

static void test_merge_order(void **state)
{
    (void)state;
    char path[512];
    path_in_dir(path, sizeof path, "merge.bin");
    /* ids 259.. */
    const char *extra[] = {" ", "a", "b", "c", "ab", "bc", "abc", "aa", " a"};
    const float scores[] = {0, 0, 0, 0, 5, 7, 9, 1, -2e10f};
    write_vocab(path, extra, scores, 9);
    kvt_tokenizer *t = NULL;
    assert_int_equal(kvt_tokenizer_load(path, 259 + 9, &t), 0);
    int32_t ids[32];
    /* "abc": "bc" (7) beats "ab" (5); then "a"+"bc" = "abc" (9). " a" scores
     * below -1e10 and never merges. */
    int64_t n = encode(t, "abc", 1, 0, ids, 32);
    assert_int_equal(n, 3);
    assert_int_equal(ids[1], 259);     /* " " */
    assert_int_equal(ids[2], 259 + 6); /* "abc" */
    /* "aaa": the pairs tie (score 1); the leftmost merges first. */
    n = encode(t, "aaa", 0, 0, ids, 32);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 259);
    assert_int_equal(ids[1], 259 + 7); /* "aa" */
    assert_int_equal(ids[2], 259 + 1); /* "a" */
    /* Capacity too small: KVT_ERANGE, n = 0. */
    int64_t m = 7;
    assert_int_equal(kvt_tokenizer_encode(t, "aaa", 1, 1, ids, 3, &m), KVT_ERANGE);
    assert_int_equal(m, 0);
    assert_int_equal(kvt_tokenizer_encode(t, NULL, 1, 1, ids, 3, &m), KVT_EINVAL);
    kvt_tokenizer_free(t);
}

/* ---- decode rules -------------------------------------------------------------- */

static void test_decode_rules(void **state)
{
    (void)state;
    char path[512];
    path_in_dir(path, sizeof path, "dec.bin");
    const char *extra[] = {" the", "<0x41>", "<0x0a>", "<0x", "<0x4", "\x01\x02", "<0xZZ>"};
    const float scores[] = {0, 0, 0, 0, 0, 0, 0};
    write_vocab(path, extra, scores, 7);
    kvt_tokenizer *t = NULL;
    assert_int_equal(kvt_tokenizer_load(path, 259 + 7, &t), 0);
    assert_string_equal(kvt_tokenizer_decode(t, 1, 259), "the");  /* after BOS: space stripped */
    assert_string_equal(kvt_tokenizer_decode(t, 5, 259), " the"); /* otherwise kept */
    assert_string_equal(kvt_tokenizer_decode(t, 1, 3 + 'A'), "A");
    assert_string_equal(kvt_tokenizer_decode(t, 7, 3), "");        /* <0x00>: empty string */
    assert_string_equal(kvt_tokenizer_decode(t, 7, 260), "A");     /* a second "<0x41>" */
    assert_string_equal(kvt_tokenizer_decode(t, 7, 261), "\n");    /* lower-case hex as sscanf %X */
    assert_string_equal(kvt_tokenizer_decode(t, 7, 262), "<0x");   /* no digit: not a byte */
    assert_string_equal(kvt_tokenizer_decode(t, 7, 263), "\x04");  /* one digit, no '>': sscanf takes it */
    assert_string_equal(kvt_tokenizer_decode(t, 7, 265), "<0xZZ>");
    assert_null(kvt_tokenizer_decode(t, 7, 266));
    assert_null(kvt_tokenizer_decode(t, 7, -3));
    /* safe_printf: single unprintable bytes vanish; longer pieces print. */
    assert_string_equal(kvt_tokenizer_printable("\x01"), "");
    assert_string_equal(kvt_tokenizer_printable("\x7F"), "");
    assert_string_equal(kvt_tokenizer_printable(""), "");
    assert_string_equal(kvt_tokenizer_printable(NULL), "");
    assert_string_equal(kvt_tokenizer_printable("\n"), "\n");
    assert_string_equal(kvt_tokenizer_printable("\t"), "\t");
    assert_string_equal(kvt_tokenizer_printable("~"), "~");
    assert_string_equal(kvt_tokenizer_printable(kvt_tokenizer_decode(t, 7, 264)), "\x01\x02");
    kvt_tokenizer_free(t);
}

/* ---- bad files: each kind gives its own error ------------------------------------ */

static void expect_bad(const char *name, const void *data, size_t n, int32_t vocab, int code, const char *needle)
{
    char path[512];
    path_in_dir(path, sizeof path, name);
    write_bytes(path, data, n);
    kvt_tokenizer *t = (kvt_tokenizer *)(uintptr_t)1;
    int rc = kvt_tokenizer_load(path, vocab, &t);
    if (rc != code)
        fail_msg("%s: expected %d (%s), got %d (%s): %s", name, code, kvt_strerror(code), rc, kvt_strerror(rc),
                 kvt_last_error());
    assert_ptr_equal(t, (kvt_tokenizer *)(uintptr_t)1); /* out untouched */
    const char *msg = kvt_last_error();
    assert_non_null(strstr(msg, path));
    if (!strstr(msg, needle))
        fail_msg("%s: message \"%s\" lacks \"%s\"", name, msg, needle);
}

static void test_bad_files(void **state)
{
    (void)state;
    unsigned char three[3] = {6, 0, 0};
    expect_bad("empty.bin", "", 0, 0, KVT_EFORMAT, "shorter than its 4-byte header");
    expect_bad("three.bin", three, 3, 0, KVT_EFORMAT, "shorter than its 4-byte header");
    int32_t h = 6;
    expect_bad("no_pieces.bin", &h, 4, 0, KVT_EFORMAT, "holds no pieces");

    bytes b = {0};
    put_i32(&b, 6);
    put_piece(&b, 0, "ab");
    put_f32(&b, 0); /* 4 of the 8 record bytes */
    expect_bad("trunc_record.bin", b.p, b.n, 0, KVT_EFORMAT, "truncated record for piece 1");
    free(b.p);

    b = (bytes){0};
    put_i32(&b, 6);
    put_f32(&b, 0);
    put_i32(&b, -5);
    expect_bad("neg_len.bin", b.p, b.n, 0, KVT_EFORMAT, "negative length -5");
    free(b.p);

    b = (bytes){0};
    put_i32(&b, 1000);
    put_f32(&b, 0);
    put_i32(&b, 100);
    put(&b, "abc", 3);
    expect_bad("long_len.bin", b.p, b.n, 0, KVT_EFORMAT, "claims 100 bytes but only 3 remain");
    free(b.p);

    b = (bytes){0};
    put_i32(&b, 2);
    put_piece(&b, 0, "abcd");
    expect_bad("max_len.bin", b.p, b.n, 0, KVT_EFORMAT, "max_token_length is 2");
    free(b.p);

    /* vocab mismatch, both ways: the message gives both numbers. */
    char path[512];
    path_in_dir(path, sizeof path, "v259.bin");
    assert_int_equal(kvt_tokenizer_write_default(path, 259), 0);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    unsigned char buf[8192];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    expect_bad("v259_as_512.bin", buf, n, 512, KVT_EFORMAT, "holds 259 pieces but the model's vocab_size is 512");
    expect_bad("v259_as_100.bin", buf, n, 100, KVT_EFORMAT, "holds 259 pieces but the model's vocab_size is 100");

    /* Not a file, missing file, bad arguments. */
    kvt_tokenizer *t = NULL;
    assert_int_equal(kvt_tokenizer_load(g_dir, 0, &t), KVT_EFORMAT);
    assert_non_null(strstr(kvt_last_error(), "not a regular file"));
    path_in_dir(path, sizeof path, "missing.bin");
    assert_int_equal(kvt_tokenizer_load(path, 0, &t), -ENOENT);
    assert_non_null(strstr(kvt_last_error(), "missing.bin"));
    assert_int_equal(kvt_tokenizer_load(NULL, 0, &t), KVT_EINVAL);
    assert_int_equal(kvt_tokenizer_load(path, -1, &t), KVT_EINVAL);
    assert_null(t);
    kvt_tokenizer_free(NULL);
}

/* ---- differential test against a transcription of llama2.c's encode ------------ */

static void test_encode_matches_reference(void **state)
{
    (void)state;
    kvt_tokenizer *t = load_tok512();
    if (!t)
        skip();
    unsigned seed = (unsigned)test_seed("test_encode_matches_reference");
    srand(seed);
    static const char *const words[] = {"the ", "cat", " sat", "Lily", " and", ",", ".", "\n", "\xC3\xA9",
                                        "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\xFF", "\x80", "  ", "ing", "Once"};
    static char text[2400];
    static int32_t got[2500], want[2500];
    for (int iter = 0; iter < 303; iter++) {
        size_t len = 0;
        int parts = iter < 300 ? rand() % 40 : 500; /* a few long texts too */
        for (int p = 0; p < parts; p++) {
            if (rand() % 3 == 0) {
                text[len++] = (char)(1 + rand() % 255); /* any byte but NUL */
            } else {
                const char *w = words[rand() % (sizeof words / sizeof *words)];
                memcpy(text + len, w, strlen(w));
                len += strlen(w);
            }
        }
        text[len] = '\0';
        int bos = rand() % 2, eos = rand() % 2;
        int64_t n = encode(t, text, bos, eos, got, 2500);
        int m = tok_ref_encode(t, text, bos, eos, want);
        if (n != m)
            fail_msg("seed %u iter %d: %lld tokens, reference %d", seed, iter, (long long)n, m);
        for (int i = 0; i < m; i++)
            if (got[i] != want[i])
                fail_msg("seed %u iter %d: token %d is %d, reference %d", seed, iter, i, got[i], want[i]);
    }
    kvt_tokenizer_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_vocab),
        cmocka_unit_test(test_tok512_known),
        cmocka_unit_test(test_tok512_roundtrip),
        cmocka_unit_test(test_byte_fallback),
        cmocka_unit_test(test_merge_order),
        cmocka_unit_test(test_decode_rules),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_encode_matches_reference),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
