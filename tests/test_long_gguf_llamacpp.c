/*
 * test_long_gguf_llamacpp.c: a GGUF export (engine/gguf.c) run by llama.cpp
 * computes what the engine computes. stories260K and the built-in default
 * model (its separate classifier exported as output.weight) are exported in
 * f32; llama.cpp (node-llama-cpp's prebuilt CPU binary, bench/llamacpp/
 * logits.mjs, f32 KV cache, flash attention off: with it on, llama.cpp's
 * CPU attention reads an f32 KV cache as f16, 2 threads) and the engine each decode 64 greedy
 * tokens after the same prompt: the tokens must be equal at every step and
 * the logits close (a wrong RoPE row order in wq/wk, a transposed matrix or
 * a wrong norm epsilon moves them by far more). An f16 export of
 * stories260K must give the same greedy tokens too. Long: it needs node and
 * the npm package (scripts/install-bench-deps.sh) and writes ~340 MB; it
 * skips, saying why, when bench/llamacpp/node_modules is absent.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gguf.h"
#include "model.h"
#include "tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define STEPS 64

static char g_script[4096];

static int have_llamacpp(void)
{
    const char *src = getenv("KVT_SOURCE_DIR");
    char pkg[4200];
    snprintf(g_script, sizeof g_script, "%s/bench/llamacpp/logits.mjs", src ? src : ".");
    snprintf(pkg, sizeof pkg, "%s/bench/llamacpp/node_modules/node-llama-cpp/package.json", src ? src : ".");
    if (access(pkg, R_OK) != 0) {
        printf("test_long_gguf_llamacpp: skipped: %s is absent (run scripts/install-bench-deps.sh)\n", pkg);
        return 0;
    }
    if (system("node --version >/dev/null 2>&1") != 0) {
        printf("test_long_gguf_llamacpp: skipped: node is not installed\n");
        return 0;
    }
    return 1;
}

static int argmax(const float *v, int n)
{
    int a = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[a])
            a = i;
    return a;
}

/* Exports (model, tokenizer) as GGUF of `dt`, runs llama.cpp's greedy decode
 * of STEPS tokens after the prompt and the engine's, and compares them: the
 * tokens equal at every step, the largest logit difference returned. */
static double compare(const char *model_path, const char *tok_path, kvt_gguf_dtype dt, const char *text)
{
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    assert_int_equal(kvt_model_load(model_path, &m), 0);
    const kvt_model_config *c = kvt_model_get_config(m);
    int V = c->vocab_size, L = c->n_layers;
    assert_int_equal(kvt_tokenizer_load(tok_path, V, &t), 0);
    char dir[] = "/tmp/kvt_test_gguf_XXXXXX", gguf[256];
    assert_non_null(mkdtemp(dir));
    snprintf(gguf, sizeof gguf, "%s/model.gguf", dir);
    assert_int_equal(kvt_gguf_export(m, t, dt, "test", gguf), 0);

    int32_t prompt[256];
    int64_t np = 0;
    assert_int_equal(kvt_tokenizer_encode(t, text, 1, 0, prompt, 256, &np), 0);
    char cmd[16384];
    int n = snprintf(cmd, sizeof cmd, "node '%s' --model '%s' --steps %d --threads 2 --kv f32 --flash off --tokens ", g_script,
                     gguf, STEPS);
    for (int64_t i = 0; i < np; i++)
        n += snprintf(cmd + n, sizeof cmd - (size_t)n, "%s%d", i ? "," : "", prompt[i]);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);

    kvt_cache **caches = calloc((size_t)L, sizeof *caches);
    float *lg = malloc(sizeof(float) * (size_t)V);
    size_t cap = 1 << 20;
    char *line = malloc(cap);
    assert_int_equal(kvt_model_new_caches(m, 256, caches), 0);
    assert_int_equal(kvt_model_prefill(m, caches, prompt, np, lg), 0);
    double max_diff = 0;
    int steps = 0;
    while (fgets(line, (int)cap, p)) {
        if (!strncmp(line, "info ", 5)) {
            printf("  %s", line);
            continue;
        }
        int s, tok, off = 0;
        assert_int_equal(sscanf(line, "step %d token %d logits %n", &s, &tok, &off), 2);
        assert_int_equal(s, steps);
        char *q = line + off;
        for (int v = 0; v < V; v++) {
            char *end;
            double x = strtod(q, &end);
            assert_true(end != q);
            q = end;
            double d = fabs(x - lg[v]);
            if (d > max_diff)
                max_diff = d;
        }
        int mine = argmax(lg, V);
        if (mine != tok)
            printf("  step %d: engine token %d, llama.cpp token %d\n", s, mine, tok);
        assert_int_equal(mine, tok);
        steps++;
        if (steps < STEPS)
            assert_int_equal(kvt_model_decode(m, caches, mine, lg), 0);
    }
    int st = pclose(p);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_int_equal(steps, STEPS);
    printf("  %s (%s weights): %lld prompt tokens, %d greedy steps equal, max |logit difference| %.3g\n",
           model_path, dt == KVT_GGUF_F16 ? "f16" : "f32", (long long)np, STEPS, max_diff);
    kvt_caches_destroy(caches, L);
    free(caches);
    free(lg);
    free(line);
    unlink(gguf);
    rmdir(dir);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
    return max_diff;
}

static void test_stories260k(void **state)
{
    (void)state;
    if (!have_llamacpp()) {
        skip();
        return;
    }
    const char *shared = getenv("KVT_SHARED_DIR");
    char mp[4096], tp[4096];
    snprintf(mp, sizeof mp, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tp, sizeof tp, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    if (access(mp, R_OK) != 0) {
        printf("test_long_gguf_llamacpp: skipped: %s is absent\n", mp);
        skip();
        return;
    }
    double d = compare(mp, tp, KVT_GGUF_F32, "Once upon a time, there was a little girl named Lily.");
    assert_true(d < 1e-3);
    /* f16 weights round each weight by up to 2^-11 relative: the logits move
     * more, but the greedy text stays */
    d = compare(mp, tp, KVT_GGUF_F16, "Once upon a time, there was a little girl named Lily.");
    assert_true(d < 0.1);
}

static void test_default_model(void **state)
{
    (void)state;
    if (!have_llamacpp()) {
        skip();
        return;
    }
    char mp[4096], tp[4096];
    assert_int_equal(kvt_default_model(mp, sizeof mp, tp, sizeof tp), 0);
    double d = compare(mp, tp, KVT_GGUF_F32, "The quick brown fox jumps over the lazy dog.");
    assert_true(d < 1e-3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stories260k),
        cmocka_unit_test(test_default_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
