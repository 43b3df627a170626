/*
 * test_identity.c: the SSD tier's model identity covers every byte of the
 * weights. A 41.5 MiB synthetic checkpoint and a copy whose weights differ
 * only in the middle (1M floats negated at 20 MiB, outside the first and
 * last 16 MiB) get different identities (`kvtier model info`, and the
 * library call), and a `kvtier chat` on the changed model over the SSD cache
 * the first model filled reuses nothing and replies exactly as with no cache
 * at all (it was served the first model's state). `chat --stats` and
 * `model info` print the identity and its cost. Runs the binary (KVT_BIN).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[256], model_a[300], model_b[300], tok[300];

/* A byte-level llama2.c tokenizer of 259 pieces: <unk>, BOS, EOS, bytes. */
static void write_tokenizer(const char *path)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    int32_t max_len = 6;
    fwrite(&max_len, 4, 1, f);
    for (int id = 0; id < 259; id++) {
        char piece[16];
        if (id == 0)
            strcpy(piece, "<unk>");
        else if (id == 1)
            strcpy(piece, "\n<s>\n");
        else if (id == 2)
            strcpy(piece, "\n</s>\n");
        else
            snprintf(piece, sizeof piece, "<0x%02X>", id - 3);
        float score = 0.0f;
        int32_t len = (int32_t)strlen(piece);
        fwrite(&score, 4, 1, f);
        fwrite(&len, 4, 1, f);
        fwrite(piece, 1, (size_t)len, f);
    }
    assert_int_equal(fclose(f), 0);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Runs `kvtier ARGS`, stdout to out.txt, stderr to err.txt; returns the exit status. */
static int run(const char *args, char **out, char **err)
{
    char cmd[4096], op[300], ep[300];
    snprintf(op, sizeof op, "%s/out.txt", dir);
    snprintf(ep, sizeof ep, "%s/err.txt", dir);
    snprintf(cmd, sizeof cmd, "'%s' %s >'%s' 2>'%s'", getenv("KVT_BIN"), args, op, ep);
    int st = system(cmd);
    *out = slurp(op);
    *err = slurp(ep);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static long long reused_on_turn(const char *err, int turn)
{
    char key[32];
    snprintf(key, sizeof key, "turn %d: reused ", turn);
    const char *p = strstr(err, key);
    assert_non_null(p);
    return atoll(p + strlen(key));
}

static int setup(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        return 0;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_identity_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(model_a, sizeof model_a, "%s/a.bin", dir);
    snprintf(model_b, sizeof model_b, "%s/b.bin", dir);
    snprintf(tok, sizeof tok, "%s/tok.bin", dir);
    write_tokenizer(tok);
    /* dim 256, hidden 824, 12 layers: 43,580,444 bytes (41.56 MiB) */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' model synth --out '%s' --dim 256 --hidden 824 --layers 12 --heads 8 "
             "--kv-heads 8 --vocab 259 --seq-len 512 --seed 11 --separate-classifier", getenv("KVT_BIN"), model_a);
    if (system(cmd) != 0)
        return -1;
    /* the copy: 1M floats negated at byte 20 MiB, the middle of the file */
    FILE *in = fopen(model_a, "rb"), *out = fopen(model_b, "wb");
    if (!in || !out)
        return -1;
    static float buf[1 << 16];
    size_t got;
    long at = 0;
    while ((got = fread(buf, sizeof *buf, sizeof buf / sizeof *buf, in)) > 0) {
        for (size_t i = 0; i < got; i++) {
            long byte = at + (long)(i * sizeof *buf);
            if (byte >= (20L << 20) && byte < (20L << 20) + (1L << 20) * 4)
                buf[i] = -buf[i];
        }
        fwrite(buf, sizeof *buf, got, out);
        at += (long)(got * sizeof *buf);
    }
    fclose(in);
    return fclose(out) == 0 && at == 43580444 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    if (!dir[0])
        return 0;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* The library call: every byte counts; the same file gives the same id. */
static void test_identity_every_byte(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        skip();
    kvt_model *a = NULL, *b = NULL;
    assert_int_equal(kvt_model_load(model_a, &a), 0);
    assert_int_equal(kvt_model_load(model_b, &b), 0);
    kvt_chat_identity ia, ib, ia2;
    assert_int_equal(kvt_chat_identity_compute(a, tok, &ia), 0);
    assert_int_equal(kvt_chat_identity_compute(b, tok, &ib), 0);
    assert_int_equal(kvt_chat_identity_compute(a, NULL, &ia2), 0);
    print_message("a %s, b %s, tokenizer %s, %.1f ms\n", ia.model_id, ib.model_id, ia.tokenizer_hash, ia.ms);
    assert_int_equal(ia.model_bytes, 43580444);
    assert_true(strncmp(ia.model_id, "xxh3-128:", 9) == 0 && strlen(ia.model_id) == 9 + 32);
    assert_string_not_equal(ia.model_id, ib.model_id);
    assert_string_equal(ia.model_id, ia2.model_id);
    assert_string_equal(ia.tokenizer_hash, ib.tokenizer_hash);
    assert_string_equal(ia2.tokenizer_hash, "");
    assert_true(ia.tokenizer_bytes > 0);
    assert_true(kvt_chat_identity_compute(a, "/nonexistent/tok.bin", &ia2) < 0);
    assert_non_null(strstr(kvt_last_error(), "/nonexistent/tok.bin"));
    kvt_model_free(a);
    kvt_model_free(b);
}

/* The changed model is never served the first model's SSD state: it reuses
 * 0 tokens and replies as with no cache (it reused the whole first prompt
 * and replied from the old weights' state). */
static void test_changed_weights_not_served(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        skip();
    char script[300], ssd[300], args[2048], base[1024];
    snprintf(script, sizeof script, "%s/script.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/ssd", dir);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs("Tell me a story about a cat and a dog.\nAnd then what happened?\n", f);
    fclose(f);
    char *out, *err, *out_b, *err_b;
    snprintf(base, sizeof base, "--tokenizer '%s' --script '%s' --max-tokens 12", tok, script);
    /* model A fills the SSD cache */
    snprintf(args, sizeof args, "chat --model '%s' %s --ssd-cache '%s'", model_a, base, ssd);
    assert_int_equal(run(args, &out, &err), 0);
    char *out_a = out;
    free(err);
    /* model B without any cache: the reference */
    snprintf(args, sizeof args, "chat --model '%s' %s --prompt-cache 0", model_b, base);
    assert_int_equal(run(args, &out_b, &err_b), 0);
    free(err_b);
    /* model B over A's SSD cache, in a new process */
    snprintf(args, sizeof args, "chat --model '%s' %s --ssd-cache '%s' --stats", model_b, base, ssd);
    assert_int_equal(run(args, &out, &err), 0);
    print_message("A: %sB, no cache: %sB over A's cache: %s%s", out_a, out_b, out, err);
    assert_int_equal(reused_on_turn(err, 1), 0);
    assert_string_equal(out, out_b);
    assert_string_not_equal(out_a, out_b); /* the change matters to the replies */
    /* --stats says the identity and its cost before the first turn */
    const char *id = strstr(err, "identity: model xxh3-128:");
    assert_non_null(id);
    assert_true(id < strstr(err, "turn 1:"));
    assert_non_null(strstr(err, "(43.6 MB)"));
    assert_non_null(strstr(err, "hashed in "));
    free(out);
    free(err);
    /* model A again over the same cache: its own state is still served */
    snprintf(args, sizeof args, "chat --model '%s' %s --ssd-cache '%s'", model_a, base, ssd);
    assert_int_equal(run(args, &out, &err), 0);
    assert_true(reused_on_turn(err, 1) > 0);
    assert_string_equal(out, out_a);
    free(out);
    free(err);
    free(out_a);
    free(out_b);
}

/* `model info` prints the identity of every byte and what it cost. */
static void test_model_info(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        skip();
    char args[1024], *out_a, *out_b, *err;
    snprintf(args, sizeof args, "model info '%s'", model_a);
    assert_int_equal(run(args, &out_a, &err), 0);
    free(err);
    snprintf(args, sizeof args, "model info '%s'", model_b);
    assert_int_equal(run(args, &out_b, &err), 0);
    free(err);
    const char *ia = strstr(out_a, "identity xxh3-128:"), *ib = strstr(out_b, "identity xxh3-128:");
    assert_non_null(ia);
    assert_non_null(ib);
    assert_non_null(strstr(ia, "43.6 MB hashed in "));
    assert_true(strncmp(ia, ib, 18 + 32) != 0);
    free(out_a);
    free(out_b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_identity_every_byte),
        cmocka_unit_test(test_changed_weights_not_served),
        cmocka_unit_test(test_model_info),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
