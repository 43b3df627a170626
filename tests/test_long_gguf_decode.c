/*
 * test_long_gguf_decode.c: bench/llamacpp/decode.mjs, the llama.cpp baseline
 * of `kvtier bench engine --context-only`, times only single-token decode
 * steps, also when the last context plus the steps reach the model's whole
 * seq_len (the bench's C = seq_len - steps). stories260K (seq_len 512) is
 * exported as GGUF f32 and decoded at C = 64 and 480 with 32 steps: every
 * configuration must report both figures for both contexts and exit 0.
 * decode.mjs refuses a context shift and checks that llama.cpp counted one
 * decode per step and that the sequence ends at C + steps; in a context of
 * exactly C + steps tokens node-llama-cpp shifted it at the last step and,
 * the tokens not starting with BOS, evaluated the whole sequence again
 * inside a timed step. Long: it needs node and the npm packages
 * (`make bench-deps`); it skips, saying why, without them.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gguf.h"
#include "model.h"
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define STEPS 32

static void test_decode_to_seq_len(void **state)
{
    (void)state;
    const char *src = getenv("KVT_SOURCE_DIR"), *shared = getenv("KVT_SHARED_DIR");
    char script[4096], pkg[4200], mp[4096], tp[4096];
    snprintf(script, sizeof script, "%s/bench/llamacpp/decode.mjs", src ? src : ".");
    snprintf(pkg, sizeof pkg, "%s/bench/llamacpp/node_modules/node-llama-cpp/package.json", src ? src : ".");
    snprintf(mp, sizeof mp, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tp, sizeof tp, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    if (access(pkg, R_OK) != 0 || access(mp, R_OK) != 0 || system("node --version >/dev/null 2>&1") != 0) {
        printf("test_long_gguf_decode: skipped: needs node, %s (`make bench-deps`) and %s\n", pkg, mp);
        skip();
        return;
    }
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    assert_int_equal(kvt_model_load(mp, &m), 0);
    const kvt_model_config *c = kvt_model_get_config(m);
    assert_int_equal(c->seq_len, 512);
    assert_int_equal(kvt_tokenizer_load(tp, c->vocab_size, &t), 0);
    char dir[] = "/tmp/kvt_test_gguf_decode_XXXXXX", gguf[256], toks[256];
    assert_non_null(mkdtemp(dir));
    snprintf(gguf, sizeof gguf, "%s/model.gguf", dir);
    snprintf(toks, sizeof toks, "%s/tokens.bin", dir);
    assert_int_equal(kvt_gguf_export(m, t, KVT_GGUF_F32, "test", gguf), 0);
    /* the bench's tokens: none is BOS at position 0 */
    int32_t tok[512];
    uint64_t s = 42;
    for (int i = 0; i < 512; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        tok[i] = 3 + (int32_t)((s >> 33) % (uint64_t)(c->vocab_size - 3));
    }
    FILE *f = fopen(toks, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(tok, sizeof tok[0], 512, f), 512);
    assert_int_equal(fclose(f), 0);

    const int ctx[2] = {64, 512 - STEPS};
    const char *cfg[2][2] = {{"f32", "off"}, {"f16", "on"}};
    char cmd[16384];
    snprintf(cmd, sizeof cmd,
             "node '%s' --model '%s' --tokens-file '%s' --contexts %d,%d --steps %d --threads 2 --configs %s:%s,%s:%s",
             script, gguf, toks, ctx[0], ctx[1], STEPS, cfg[0][0], cfg[0][1], cfg[1][0], cfg[1][1]);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char line[4096];
    int got[2][2] = {{0}};
    while (fgets(line, sizeof line, p)) {
        printf("  %s", line);
        char kv[16], flash[8];
        int C;
        double tps, own;
        if (sscanf(line, "result kv %15s flash %7s ctx %d tps %lf own %lf", kv, flash, &C, &tps, &own) != 5)
            continue;
        for (int i = 0; i < 2; i++)
            for (int k = 0; k < 2; k++)
                if (!strcmp(kv, cfg[i][0]) && !strcmp(flash, cfg[i][1]) && C == ctx[k]) {
                    assert_true(tps > 0 && own > 0);
                    got[i][k]++;
                }
    }
    int st = pclose(p);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 2; k++)
            assert_int_equal(got[i][k], 1);
    unlink(gguf);
    unlink(toks);
    rmdir(dir);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_to_seq_len),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
