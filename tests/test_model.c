/*
 * test_model.c: checkpoint loading and validation (engine/model.c) and the
 * synthetic model writer (engine/synth.c). Every kind of bad file is written
 * into a fresh temporary directory and must give its own error code and
 * message, naming the file.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "model.h"
#include "tokenizer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_dir[256];

static int setup_dir(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvt_test_model_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static void path_in(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", g_dir, name); }

static void small_params(kvt_synth_params *p)
{
    memset(p, 0, sizeof *p);
    p->dim = 32;
    p->hidden_dim = 48;
    p->n_layers = 3;
    p->n_heads = 4;
    p->n_kv_heads = 2;
    p->vocab_size = 50;
    p->seq_len = 64;
    p->seed = 11;
}

static unsigned char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)len + 64);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return b;
}

static void write_all(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n)
        assert_int_equal(fwrite(b, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Loads `path` expecting failure `code` and a message naming the file and
 * containing `needle`. */
static void expect_refused(const char *path, int code, const char *needle)
{
    kvt_model *m = (kvt_model *)0x1;
    int rc = kvt_model_load(path, &m);
    const char *msg = kvt_last_error();
    print_message("  %s -> %d: %s\n", path, rc, msg);
    assert_int_equal(rc, code);
    assert_null(m);
    assert_non_null(strstr(msg, path));
    assert_non_null(strstr(msg, needle));
}

/* A good plain file, then a copy with header int `field` set to `value`. */
static void header_variant(const char *name, int field, int32_t value, int code, const char *needle)
{
    kvt_synth_params p;
    small_params(&p);
    char good[512], bad[512];
    path_in(good, sizeof good, "good_plain.bin");
    assert_int_equal(kvt_model_synth(&p, good), 0);
    size_t n;
    unsigned char *b = read_all(good, &n);
    memcpy(b + 4 * field, &value, 4);
    path_in(bad, sizeof bad, name);
    write_all(bad, b, n);
    free(b);
    expect_refused(bad, code, needle);
}

static void test_missing_file(void **state)
{
    (void)state;
    char path[512];
    path_in(path, sizeof path, "does_not_exist.bin");
    expect_refused(path, -ENOENT, "cannot open");
}

static void test_short_file(void **state)
{
    (void)state;
    char path[512];
    path_in(path, sizeof path, "short.bin");
    write_all(path, "0123456789", 10);
    expect_refused(path, KVT_EFORMAT, "shorter than the 28-byte");
    write_all(path, "", 0);
    expect_refused(path, KVT_EFORMAT, "file is 0 bytes");
}

static void test_header_not_positive(void **state)
{
    (void)state;
    header_variant("zero_dim.bin", 0, 0, KVT_EFORMAT, "dim is 0; it must be positive");
    header_variant("neg_layers.bin", 2, -3, KVT_EFORMAT, "n_layers is -3");
    header_variant("zero_seq.bin", 6, 0, KVT_EFORMAT, "seq_len is 0");
}

static void test_header_does_not_add_up(void **state)
{
    (void)state;
    header_variant("dim_heads.bin", 3, 5, KVT_EFORMAT, "dim 32 is not a multiple of n_heads 5");
    header_variant("heads_kv.bin", 4, 3, KVT_EFORMAT, "n_heads 4 is not a multiple of n_kv_heads 3");
    header_variant("odd_head.bin", 3, 32, KVT_EFORMAT, "head_size 1");
}

static void test_header_absurd(void **state)
{
    (void)state;
    header_variant("huge_dim.bin", 0, 1 << 30, KVT_EFORMAT, "above the limit");
    header_variant("many_layers.bin", 2, 257, KVT_EFORMAT, "n_layers is 257, above the limit 256");
    /* in range but the file is far too small for it */
    header_variant("big_vocab.bin", 5, 1 << 20, KVT_EFORMAT, "needs");
}

static void test_size_mismatch(void **state)
{
    (void)state;
    kvt_synth_params p;
    small_params(&p);
    char good[512], bad[512];
    path_in(good, sizeof good, "good_plain.bin");
    assert_int_equal(kvt_model_synth(&p, good), 0);
    size_t n;
    unsigned char *b = read_all(good, &n);
    path_in(bad, sizeof bad, "truncated.bin");
    write_all(bad, b, n - 4);
    char needle[128];
    snprintf(needle, sizeof needle, "file is %zu bytes", n - 4);
    expect_refused(bad, KVT_EFORMAT, needle);
    snprintf(needle, sizeof needle, "needs %zu", n);
    expect_refused(bad, KVT_EFORMAT, needle);
    free(b);
}

static void test_trailing_garbage(void **state)
{
    (void)state;
    kvt_synth_params p;
    small_params(&p);
    char good[512], bad[512];
    path_in(good, sizeof good, "good_plain.bin");
    assert_int_equal(kvt_model_synth(&p, good), 0);
    size_t n;
    unsigned char *b = read_all(good, &n);
    memcpy(b + n, "GARBAGE!", 8);
    path_in(bad, sizeof bad, "trailing.bin");
    write_all(bad, b, n + 8);
    expect_refused(bad, KVT_EFORMAT, "8 trailing bytes");
    write_all(bad, b, n + 2);
    expect_refused(bad, KVT_EFORMAT, "not a kvtier (KVTX) extension");
    free(b);
}

/* A hybrid file; `mutate` edits its trailer (at offset `t`). */
static unsigned char *hybrid_bytes(size_t *n, size_t *trailer)
{
    kvt_synth_params p;
    small_params(&p);
    p.sliding_window = 4;
    p.layer_kind[1] = KVT_LAYER_WINDOW;
    p.layer_kind[2] = KVT_LAYER_RECURRENT;
    char good[512];
    path_in(good, sizeof good, "good_hybrid.bin");
    assert_int_equal(kvt_model_synth(&p, good), 0);
    unsigned char *b = read_all(good, n);
    *trailer = *n - (16 + 4 * 3 + 2 * 32 * 32 * 4);
    assert_memory_equal(b + *trailer, "KVTX", 4);
    return b;
}

static void test_trailer_unknown_version(void **state)
{
    (void)state;
    size_t n, t;
    unsigned char *b = hybrid_bytes(&n, &t);
    int32_t v = 2;
    memcpy(b + t + 4, &v, 4);
    char bad[512];
    path_in(bad, sizeof bad, "trailer_v2.bin");
    write_all(bad, b, n);
    expect_refused(bad, KVT_EUNSUPPORTED, "version 2 is not supported");
    free(b);
}

static void test_trailer_malformed(void **state)
{
    (void)state;
    size_t n, t;
    unsigned char *b = hybrid_bytes(&n, &t);
    char bad[512];
    int32_t v;
    path_in(bad, sizeof bad, "trailer_bad.bin");

    v = 7; /* layer 1 kind */
    memcpy(b + t + 16 + 4, &v, 4);
    write_all(bad, b, n);
    expect_refused(bad, KVT_EFORMAT, "layer 1 has unknown kind 7");
    v = KVT_LAYER_WINDOW;
    memcpy(b + t + 16 + 4, &v, 4);

    v = 4; /* layer count */
    memcpy(b + t + 12, &v, 4);
    write_all(bad, b, n);
    expect_refused(bad, KVT_EFORMAT, "lists 4 layers, the header says 3");
    v = 3;
    memcpy(b + t + 12, &v, 4);

    v = 0; /* window layers but no window */
    memcpy(b + t + 8, &v, 4);
    write_all(bad, b, n);
    expect_refused(bad, KVT_EFORMAT, "sliding window 0 must be in [1, seq_len 64]");
    v = 4;
    memcpy(b + t + 8, &v, 4);

    write_all(bad, b, n - 4); /* recurrent weights cut short */
    expect_refused(bad, KVT_EFORMAT, "expected");
    write_all(bad, b, t + 10); /* trailer header cut short */
    expect_refused(bad, KVT_EFORMAT, "shorter than its 16-byte header");

    write_all(bad, b, n); /* and the untouched bytes load */
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(bad, &m), 0);
    kvt_model_free(m);
    free(b);
}

static void test_load_configs(void **state)
{
    (void)state;
    kvt_synth_params p;
    small_params(&p);
    char plain[512], sep[512], hyb[512];
    path_in(plain, sizeof plain, "cfg_plain.bin");
    path_in(sep, sizeof sep, "cfg_sep.bin");
    assert_int_equal(kvt_model_synth(&p, plain), 0);
    p.separate_classifier = 1;
    assert_int_equal(kvt_model_synth(&p, sep), 0);
    size_t n, t;
    free(hybrid_bytes(&n, &t));
    path_in(hyb, sizeof hyb, "good_hybrid.bin");

    kvt_model *a = NULL, *b = NULL, *c = NULL;
    assert_int_equal(kvt_model_load(plain, &a), 0);
    assert_int_equal(kvt_model_load(sep, &b), 0);
    assert_int_equal(kvt_model_load(hyb, &c), 0);
    const kvt_model_config *ca = kvt_model_get_config(a), *cb = kvt_model_get_config(b), *cc = kvt_model_get_config(c);
    assert_int_equal(ca->dim, 32);
    assert_int_equal(ca->hidden_dim, 48);
    assert_int_equal(ca->n_layers, 3);
    assert_int_equal(ca->head_size, 8);
    assert_int_equal(ca->kv_dim, 16);
    assert_int_equal(ca->vocab_size, 50);
    assert_int_equal(ca->shared_classifier, 1);
    assert_int_equal(ca->sliding_window, 0);
    assert_int_equal(cb->shared_classifier, 0);
    assert_int_equal(cb->vocab_size, 50);
    assert_int_equal(cc->sliding_window, 4);
    assert_int_equal(cc->layer_kind[0], KVT_LAYER_ATTN);
    assert_int_equal(cc->layer_kind[1], KVT_LAYER_WINDOW);
    assert_int_equal(cc->layer_kind[2], KVT_LAYER_RECURRENT);
    assert_int_equal(kvt_model_kv_bytes_per_token(a), 3 * 2 * 16 * 4);
    assert_int_equal(kvt_model_kv_bytes_per_token(c), 1 * 2 * 16 * 4);
    assert_int_equal(kvt_model_fixed_state_bytes(c), 2 * 4 * 16 * 4 + 32 * 4);
    assert_true(kvt_model_fingerprint(a) != kvt_model_fingerprint(b));
    assert_true(kvt_model_fingerprint(a) != kvt_model_fingerprint(c));
    kvt_model *a2 = NULL;
    assert_int_equal(kvt_model_load(plain, &a2), 0);
    assert_true(kvt_model_fingerprint(a) == kvt_model_fingerprint(a2));
    kvt_model_free(a2);
    kvt_model_free(a);
    kvt_model_free(b);
    kvt_model_free(c);
    kvt_model_free(NULL);
}

static void test_stories260k_config(void **state)
{
    (void)state;
    const char *shared = getenv("KVT_SHARED_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/data/models/stories260K.bin", shared ? shared : "");
    if (!shared || access(path, R_OK) != 0) {
        print_message("skip: %s not found (KVT_SHARED_DIR unset or ../shared absent)\n", path);
        skip();
    }
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    const kvt_model_config *c = kvt_model_get_config(m);
    assert_int_equal(c->dim, 64);
    assert_int_equal(c->hidden_dim, 172);
    assert_int_equal(c->n_layers, 5);
    assert_int_equal(c->n_heads, 8);
    assert_int_equal(c->n_kv_heads, 4);
    assert_int_equal(c->vocab_size, 512);
    assert_int_equal(c->seq_len, 512);
    assert_int_equal(c->kv_dim, 32);
    assert_int_equal(c->shared_classifier, 1);
    assert_int_equal(kvt_model_kv_bytes_per_token(m), 1280);
    kvt_model_free(m);
}

static void test_synth_deterministic(void **state)
{
    (void)state;
    kvt_synth_params p;
    small_params(&p);
    p.sliding_window = 3;
    p.layer_kind[0] = KVT_LAYER_WINDOW;
    p.layer_kind[2] = KVT_LAYER_RECURRENT;
    char a[512], b[512], c[512];
    path_in(a, sizeof a, "det_a.bin");
    path_in(b, sizeof b, "det_b.bin");
    path_in(c, sizeof c, "det_c.bin");
    assert_int_equal(kvt_model_synth(&p, a), 0);
    assert_int_equal(kvt_model_synth(&p, b), 0);
    p.seed++;
    assert_int_equal(kvt_model_synth(&p, c), 0);
    size_t na, nb, nc;
    unsigned char *ba = read_all(a, &na), *bb = read_all(b, &nb), *bc = read_all(c, &nc);
    assert_int_equal(na, nb);
    assert_memory_equal(ba, bb, na);
    assert_int_equal(na, nc);
    assert_memory_not_equal(ba, bc, na);
    /* every weight finite and within its scale; no temp file left behind */
    const float *f = (const float *)(const void *)(ba + 28);
    for (size_t i = 0; i < 50 * 32; i++)
        assert_true(f[i] >= -1.0f && f[i] < 1.0f);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls '%s' | grep -q tmp", g_dir);
    assert_int_not_equal(system(cmd), 0);
    free(ba);
    free(bb);
    free(bc);
}

/* A separate classifier is written row by row: wcls_row_scale multiplies
 * row v, and without it the rows are the plain fan-in-scaled draw. The
 * default model's params ask for one, weighting down tokens that print
 * nothing. */
static void test_synth_classifier_row_scale(void **state)
{
    (void)state;
    kvt_synth_params p;
    small_params(&p); /* vocab 50, dim 32 */
    p.separate_classifier = 1;
    char a[512], b[512];
    path_in(a, sizeof a, "cls_a.bin");
    path_in(b, sizeof b, "cls_b.bin");
    assert_int_equal(kvt_model_synth(&p, a), 0);
    float scale[50];
    for (int v = 0; v < 50; v++)
        scale[v] = v % 2 ? 0.25f : 1.0f;
    p.wcls_row_scale = scale;
    assert_int_equal(kvt_model_synth(&p, b), 0);
    size_t na, nb;
    unsigned char *ba = read_all(a, &na), *bb = read_all(b, &nb);
    assert_int_equal(na, nb);
    const float *wa = (const float *)(const void *)(ba + na - 50 * 32 * 4);
    const float *wb = (const float *)(const void *)(bb + nb - 50 * 32 * 4);
    assert_memory_equal(ba, bb, na - 50 * 32 * 4); /* everything before wcls is the same */
    float lim = 1.0f / sqrtf(32.0f);
    for (int v = 0; v < 50; v++)
        for (int j = 0; j < 32; j++) {
            float x = wa[v * 32 + j];
            assert_true(x >= -lim && x < lim);
            assert_true(wb[v * 32 + j] == x * scale[v]); /* scales are powers of 2: exact */
        }
    free(ba);
    free(bb);
    kvt_default_model_params(&p);
    assert_int_equal(p.separate_classifier, 1);
    assert_non_null(p.wcls_row_scale);
    assert_true(p.wcls_row_scale[KVT_TOKEN_BYTE0 + 'a'] == 1.0f);
    assert_true(p.wcls_row_scale[KVT_TOKEN_BYTE0 + '\n'] == 1.0f);
    assert_true(p.wcls_row_scale[KVT_TOKEN_BYTE0 + 200] == 0.25f);
    assert_true(p.wcls_row_scale[1] == 0.25f); /* BOS */
}

static void test_synth_rejects_bad_shapes(void **state)
{
    (void)state;
    kvt_synth_params p;
    char out[512];
    path_in(out, sizeof out, "never.bin");
    small_params(&p);
    p.n_heads = 5;
    assert_int_equal(kvt_model_synth(&p, out), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "not a multiple of --heads 5"));
    small_params(&p);
    p.layer_kind[1] = KVT_LAYER_WINDOW; /* no window size */
    assert_int_equal(kvt_model_synth(&p, out), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "--sliding-window"));
    small_params(&p);
    p.sliding_window = 8; /* window without window layers */
    assert_int_equal(kvt_model_synth(&p, out), KVT_EINVAL);
    small_params(&p);
    p.dim = 0;
    assert_int_equal(kvt_model_synth(&p, out), KVT_EINVAL);
    assert_int_equal(access(out, F_OK), -1);
    small_params(&p);
    char nodir[600];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/x.bin", g_dir);
    assert_true(kvt_model_synth(&p, nodir) == -ENOENT);
}

/* `kvtier model synth` twice with the same arguments: byte-identical files;
 * a bad argument: exit status 2 and no file. */
static void test_cli_synth(void **state)
{
    (void)state;
    const char *bin = getenv("KVT_BIN");
    if (!bin || access(bin, X_OK) != 0) {
        print_message("skip: KVT_BIN unset or not executable\n");
        skip();
    }
    char a[512], b[512], cmd[2048];
    path_in(a, sizeof a, "cli_a.bin");
    path_in(b, sizeof b, "cli_b.bin");
    const char *args = "--dim 32 --hidden 40 --layers 4 --heads 4 --kv-heads 1 --vocab 30 --seq-len 50 --seed 99 "
                       "--sliding-window 6 --window-layers 1,3 --recurrent-layers 2";
    snprintf(cmd, sizeof cmd, "'%s' model synth --out '%s' %s", bin, a, args);
    assert_int_equal(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "'%s' model synth --out '%s' %s", bin, b, args);
    assert_int_equal(system(cmd), 0);
    size_t na, nb;
    unsigned char *ba = read_all(a, &na), *bb = read_all(b, &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(ba, bb, na);
    free(ba);
    free(bb);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(a, &m), 0);
    const kvt_model_config *c = kvt_model_get_config(m);
    assert_int_equal(c->n_kv_heads, 1);
    assert_int_equal(c->sliding_window, 6);
    assert_int_equal(c->layer_kind[0], KVT_LAYER_ATTN);
    assert_int_equal(c->layer_kind[1], KVT_LAYER_WINDOW);
    assert_int_equal(c->layer_kind[2], KVT_LAYER_RECURRENT);
    assert_int_equal(c->layer_kind[3], KVT_LAYER_WINDOW);
    kvt_model_free(m);
    path_in(a, sizeof a, "cli_bad.bin");
    snprintf(cmd, sizeof cmd, "'%s' model synth --out '%s' --dim 30 --hidden 40 --layers 1 --heads 4 --kv-heads 1 "
             "--vocab 30 --seq-len 50 --seed 1 2>/dev/null", bin, a);
    int st = system(cmd);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 2);
    assert_int_equal(access(a, F_OK), -1);
    /* the message names what is wrong: a zero value is not a missing flag,
     * an unknown flag last on the line does not "need a value" */
    char err[512];
    path_in(err, sizeof err, "cli_bad.err");
    struct {
        const char *tail, *want;
    } cases[] = {{"--layers 0", "--layers expects an integer in [1,"}, {"--layers 1 --bogus", "unknown option --bogus"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(cmd, sizeof cmd, "'%s' model synth --out '%s' --dim 32 --hidden 40 --heads 4 --kv-heads 1 "
                 "--vocab 30 --seq-len 50 --seed 1 %s 2>'%s'", bin, a, cases[i].tail, err);
        st = system(cmd);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 2);
        size_t n;
        char *msg = (char *)read_all(err, &n);
        msg = realloc(msg, n + 1);
        assert_non_null(msg);
        msg[n] = '\0';
        if (!strstr(msg, cases[i].want))
            fail_msg("'%s': stderr lacks \"%s\": %s", cases[i].tail, cases[i].want, msg);
        free(msg);
    }
    unlink(err);
    assert_int_equal(access(a, F_OK), -1);
}

static void test_null_args(void **state)
{
    (void)state;
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(NULL, &m), KVT_EINVAL);
    assert_int_equal(kvt_model_load("x", NULL), KVT_EINVAL);
    assert_null(kvt_model_get_config(NULL));
    assert_int_equal(kvt_model_kv_bytes_per_token(NULL), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_short_file),
        cmocka_unit_test(test_header_not_positive),
        cmocka_unit_test(test_header_does_not_add_up),
        cmocka_unit_test(test_header_absurd),
        cmocka_unit_test(test_size_mismatch),
        cmocka_unit_test(test_trailing_garbage),
        cmocka_unit_test(test_trailer_unknown_version),
        cmocka_unit_test(test_trailer_malformed),
        cmocka_unit_test(test_load_configs),
        cmocka_unit_test(test_stories260k_config),
        cmocka_unit_test(test_synth_deterministic),
        cmocka_unit_test(test_synth_classifier_row_scale),
        cmocka_unit_test(test_synth_rejects_bad_shapes),
        cmocka_unit_test(test_cli_synth),
        cmocka_unit_test(test_null_args),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
