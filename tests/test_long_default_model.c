/*
 * test_long_default_model.c: the built-in default model (engine/
 * default_model.c), made in a temporary XDG_CACHE_HOME: two processes racing
 * to create it both succeed and leave one complete file that loads with the
 * default shape, a classifier of its own and greedy text that varies; a
 * second call reuses it. Long (writes ~340 MB), so it carries
 * the "long" label and CI skips it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "model.h"
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void test_default_model_race_and_reuse(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvt_test_default_XXXXXX";
    assert_non_null(mkdtemp(dir));
    assert_int_equal(setenv("XDG_CACHE_HOME", dir, 1), 0);
    pid_t kids[2];
    for (int i = 0; i < 2; i++) {
        kids[i] = fork();
        assert_true(kids[i] >= 0);
        if (kids[i] == 0) {
            char mp[4096], tp[4096];
            _exit(kvt_default_model(mp, sizeof mp, tp, sizeof tp) == 0 ? 0 : 1);
        }
    }
    for (int i = 0; i < 2; i++) {
        int st;
        assert_int_equal(waitpid(kids[i], &st, 0), kids[i]);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 0);
    }
    char mp[4096], tp[4096];
    uint64_t t0 = kvt_now_ms();
    assert_int_equal(kvt_default_model(mp, sizeof mp, tp, sizeof tp), 0);
    assert_true(kvt_now_ms() - t0 < 1000); /* reused, not rewritten */
    assert_non_null(strstr(mp, dir));
    assert_int_equal(access(tp, R_OK), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(mp, &m), 0);
    kvt_synth_params p;
    kvt_default_model_params(&p);
    const kvt_model_config *c = kvt_model_get_config(m);
    assert_int_equal(c->dim, p.dim);
    assert_int_equal(c->hidden_dim, p.hidden_dim);
    assert_int_equal(c->n_layers, p.n_layers);
    assert_int_equal(c->n_heads, p.n_heads);
    assert_int_equal(c->n_kv_heads, p.n_kv_heads);
    assert_int_equal(c->vocab_size, 259);
    assert_int_equal(c->seq_len, 4096);
    assert_int_equal(c->shared_classifier, 0);
    assert_non_null(strstr(mp, "-wcls.bin")); /* not the name of the old tied model */
    /* greedy text varies and mostly prints: 64 tokens after "Hello there"
     * (a tied classifier gave one byte over and over) */
    kvt_cache *cc[12];
    float logits[259];
    const char *prompt = "Hello there";
    int32_t tok[16] = {1};
    int n = 1, distinct = 0, printable = 0, seen[259] = {0};
    for (const char *q = prompt; *q; q++)
        tok[n++] = KVT_TOKEN_BYTE0 + (unsigned char)*q;
    assert_int_equal(kvt_model_new_caches(m, 256, cc), 0);
    assert_int_equal(kvt_model_prefill(m, cc, tok, n, logits), 0);
    for (int s = 0; s < 64; s++) {
        int a = 0;
        for (int v = 1; v < 259; v++)
            a = logits[v] > logits[a] ? v : a;
        distinct += !seen[a]++;
        printable += a >= KVT_TOKEN_BYTE0 + 32 && a < KVT_TOKEN_BYTE0 + 127;
        assert_int_equal(kvt_model_decode(m, cc, a, logits), 0);
    }
    print_message("  greedy: %d distinct tokens of 64, %d printable\n", distinct, printable);
    assert_true(distinct >= 8);
    assert_true(printable >= 32);
    kvt_caches_destroy(cc, 12);
    kvt_model_free(m);
    /* no temporaries left behind by either writer */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ls '%s/kvtier' | grep -q tmp", dir);
    assert_int_not_equal(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_model_race_and_reuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
