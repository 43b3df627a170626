/*
 * test_golden.c: the reference engine against llama2.c. For every line of
 * ../shared/vectors/stories260K_greedy.jsonl it runs the built `kvtier
 * generate` (KVT_BIN) on stories260K.bin + tok512.bin and compares stdout
 * byte for byte with what llama2.c printed (the first differing byte is
 * reported). The same vectors also run in-process through kvt_generate with
 * kv block sizes 1, 7 and 256 (the output must not depend on the block
 * layout). Then the command line: sampling with a seed is reproducible,
 * --help, and each kind of bad argument or file gives its own exit status
 * and message. Skips with a message when ../shared (KVT_SHARED_DIR) or the
 * binary (KVT_BIN) is absent.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "generate.h"

#include <fcntl.h>
#include <jansson.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* ---- helpers ---------------------------------------------------------------- */

static char g_model[1024], g_tok[1024], g_vectors[1024], g_dir[256];

static int have_shared(void)
{
    const char *dir = getenv("KVT_SHARED_DIR");
    if (!dir) {
        print_message("skipping: KVT_SHARED_DIR is not set (ctest sets it to <source>/../shared)\n");
        return 0;
    }
    snprintf(g_model, sizeof g_model, "%s/data/models/stories260K.bin", dir);
    snprintf(g_tok, sizeof g_tok, "%s/data/models/tok512.bin", dir);
    snprintf(g_vectors, sizeof g_vectors, "%s/vectors/stories260K_greedy.jsonl", dir);
    const char *need[] = {g_model, g_tok, g_vectors};
    for (int i = 0; i < 3; i++)
        if (access(need[i], R_OK) != 0) {
            print_message("skipping: %s is not available\n", need[i]);
            return 0;
        }
    return 1;
}

static const char *kvt_bin(void)
{
    const char *bin = getenv("KVT_BIN");
    if (!bin || access(bin, X_OK) != 0) {
        print_message("skipping: KVT_BIN (the built kvtier command) is not set or not executable\n");
        return NULL;
    }
    return bin;
}

typedef struct {
    char *out;     /* stdout bytes, NUL-terminated */
    size_t len;    /* stdout length, bytes */
    char err[4096]; /* first bytes of stderr */
    int status;    /* exit status, or -1 if killed */
} run_result;

/* Runs argv with stdout captured through a pipe and stderr into a file. */
static void run(char *const argv[], run_result *r)
{
    memset(r, 0, sizeof *r);
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    char errpath[300];
    snprintf(errpath, sizeof errpath, "%s/stderr.txt", g_dir);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    posix_spawn_file_actions_addopen(&fa, 2, errpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    assert_int_equal(rc, 0);
    size_t cap = 4096;
    r->out = malloc(cap);
    assert_non_null(r->out);
    for (;;) {
        if (r->len + 1024 > cap) {
            cap *= 2;
            r->out = realloc(r->out, cap);
            assert_non_null(r->out);
        }
        ssize_t n = read(fds[0], r->out + r->len, cap - r->len - 1);
        if (n <= 0)
            break;
        r->len += (size_t)n;
    }
    r->out[r->len] = '\0';
    close(fds[0]);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    FILE *f = fopen(errpath, "rb");
    if (f) {
        size_t n = fread(r->err, 1, sizeof r->err - 1, f);
        r->err[n] = '\0';
        fclose(f);
    }
}

/* Fails with the first differing byte and some context of both sides. */
static void compare_bytes(const char *what, const char *got, size_t got_len, const char *want, size_t want_len)
{
    size_t i = 0;
    while (i < got_len && i < want_len && got[i] == want[i])
        i++;
    if (i == got_len && i == want_len)
        return;
    size_t from = i > 40 ? i - 40 : 0;
    fail_msg("%s: output differs at byte %zu (got %zu bytes, want %zu)\n  got:  \"%.*s\"\n  want: \"%.*s\"", what,
             i, got_len, want_len, (int)((got_len > from ? got_len - from : 0) < 80 ? got_len - from : 80),
             got + from, (int)((want_len > from ? want_len - from : 0) < 80 ? want_len - from : 80), want + from);
}

typedef struct {
    char *prompt;
    long long steps;
    char *stdout_text;
    size_t stdout_len;
} vector;

static int load_vectors(vector **out)
{
    FILE *f = fopen(g_vectors, "r");
    assert_non_null(f);
    vector *v = NULL;
    int n = 0;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) > 0) {
        if (line[0] == '\n')
            continue;
        json_error_t jerr;
        json_t *j = json_loads(line, 0, &jerr);
        if (!j)
            fail_msg("%s line %d: %s", g_vectors, n + 1, jerr.text);
        json_t *p = json_object_get(j, "prompt"), *s = json_object_get(j, "steps"),
               *o = json_object_get(j, "stdout"), *t = json_object_get(j, "temperature");
        assert_true(json_is_string(p) && json_is_integer(s) && json_is_string(o) && json_is_number(t));
        assert_true(json_number_value(t) == 0.0);
        v = realloc(v, sizeof *v * (size_t)(n + 1));
        v[n].prompt = strdup(json_string_value(p));
        v[n].steps = json_integer_value(s);
        v[n].stdout_len = json_string_length(o);
        v[n].stdout_text = malloc(v[n].stdout_len + 1);
        memcpy(v[n].stdout_text, json_string_value(o), v[n].stdout_len + 1);
        json_decref(j);
        n++;
    }
    free(line);
    fclose(f);
    assert_true(n >= 1);
    *out = v;
    return n;
}

static void free_vectors(vector *v, int n)
{
    for (int i = 0; i < n; i++) {
        free(v[i].prompt);
        free(v[i].stdout_text);
    }
    free(v);
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvt_test_golden_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---- golden vectors ------------------------------------------------------------- */

static void test_golden_cli(void **state)
{
    (void)state;
    const char *bin = kvt_bin();
    if (!have_shared() || !bin)
        skip();
    vector *v;
    int n = load_vectors(&v);
    for (int i = 0; i < n; i++) {
        char steps[32];
        snprintf(steps, sizeof steps, "%lld", v[i].steps);
        char *argv[] = {(char *)bin, "generate", "--model", g_model, "--tokenizer", g_tok, "--prompt",
                        v[i].prompt, "--steps", steps, "--temperature", "0", NULL};
        run_result r;
        run(argv, &r);
        if (r.status != 0)
            fail_msg("vector %d: exit status %d, stderr: %s", i, r.status, r.err);
        char what[64];
        snprintf(what, sizeof what, "vector %d (kvtier generate)", i);
        compare_bytes(what, r.out, r.len, v[i].stdout_text, v[i].stdout_len);
        /* Timing goes to stderr, in the documented form. */
        assert_non_null(strstr(r.err, "prefill: "));
        assert_non_null(strstr(r.err, " tok/s, decode: "));
        free(r.out);
    }
    print_message("%d golden vectors reproduced byte for byte by %s\n", n, bin);
    free_vectors(v, n);
}

static void test_golden_in_process(void **state)
{
    (void)state;
    if (!have_shared())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *tok = NULL;
    int rc = kvt_model_load(g_model, &m);
    if (rc)
        fail_msg("%s: %s", kvt_strerror(rc), kvt_last_error());
    assert_int_equal(kvt_tokenizer_load(g_tok, kvt_model_get_config(m)->vocab_size, &tok), 0);
    vector *v;
    int n = load_vectors(&v);
    const int32_t blocks[] = {256, 7, 1};
    for (int b = 0; b < 3; b++) {
        for (int i = 0; i < n; i++) {
            kvt_sampler *s = NULL;
            assert_int_equal(kvt_sampler_create(512, 0.0f, 0.9f, 1, &s), 0);
            char *buf = NULL;
            size_t len = 0;
            FILE *f = open_memstream(&buf, &len);
            assert_non_null(f);
            kvt_generate_stats st;
            rc = kvt_generate(m, tok, s, v[i].prompt, v[i].steps, blocks[b], f, &st);
            fclose(f);
            if (rc)
                fail_msg("vector %d: %s: %s", i, kvt_strerror(rc), kvt_last_error());
            char what[64];
            snprintf(what, sizeof what, "vector %d (in process, block %d)", i, (int)blocks[b]);
            compare_bytes(what, buf, len, v[i].stdout_text, v[i].stdout_len);
            /* Every position ran once: prompt by prefill, the rest by decode,
             * unless a BOS ended the run early. */
            assert_int_equal(st.steps, v[i].steps);
            assert_int_equal(st.prefill_tokens, st.prompt_tokens);
            assert_true(st.prefill_tokens + st.decode_tokens <= st.steps);
            assert_int_equal(st.sampled_tokens, st.decode_tokens + 1);
            free(buf);
            kvt_sampler_free(s);
        }
    }
    free_vectors(v, n);
    kvt_tokenizer_free(tok);
    kvt_model_free(m);
}

/* A run that ends inside the prompt prints the prompt pieces and computes
 * nothing; steps 0 means the model's seq_len. */
static void test_steps_edges(void **state)
{
    (void)state;
    if (!have_shared())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *tok = NULL;
    assert_int_equal(kvt_model_load(g_model, &m), 0);
    assert_int_equal(kvt_tokenizer_load(g_tok, 512, &tok), 0);
    kvt_sampler *s = NULL;
    assert_int_equal(kvt_sampler_create(512, 0.0f, 0.9f, 1, &s), 0);
    const char *prompt = "Tim and Sue went to the zoo."; /* 14 ids with BOS */
    struct {
        int64_t steps;
        const char *want;
    } cases[] = {{1, "Tim\n"}, {3, "Tim and S\n"}, {13, "Tim and Sue went to the zoo.\n"}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);
        kvt_generate_stats st;
        assert_int_equal(kvt_generate(m, tok, s, prompt, cases[k].steps, 256, f, &st), 0);
        fclose(f);
        assert_string_equal(buf, cases[k].want);
        assert_int_equal(st.prefill_tokens, 0);
        assert_int_equal(st.sampled_tokens, 0);
        free(buf);
    }
    /* steps 0 -> seq_len; steps past seq_len -> seq_len. */
    int32_t seq_len = kvt_model_get_config(m)->seq_len;
    int64_t asks[] = {0, (int64_t)seq_len + 1000};
    for (int k = 0; k < 2; k++) {
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);
        kvt_generate_stats st;
        assert_int_equal(kvt_generate(m, tok, s, "", asks[k], 256, f, &st), 0);
        fclose(f);
        assert_int_equal(st.steps, seq_len);
        assert_true(len >= 2 && buf[len - 1] == '\n');
        free(buf);
    }
    assert_int_equal(kvt_generate(m, tok, s, "", -1, 256, stdout, NULL), KVT_EINVAL);
    assert_int_equal(kvt_generate(NULL, tok, s, "", 5, 256, stdout, NULL), KVT_EINVAL);
    kvt_sampler_free(s);
    /* A sampler for another vocabulary is refused, naming both sizes. */
    assert_int_equal(kvt_sampler_create(100, 0.0f, 0.9f, 1, &s), 0);
    assert_int_equal(kvt_generate(m, tok, s, "", 5, 256, stdout, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "100"));
    assert_non_null(strstr(kvt_last_error(), "512"));
    kvt_sampler_free(s);
    kvt_tokenizer_free(tok);
    kvt_model_free(m);
}

/* ---- the command line ------------------------------------------------------------- */

static void test_sampling_reproducible(void **state)
{
    (void)state;
    const char *bin = kvt_bin();
    if (!have_shared() || !bin)
        skip();
    char *out[3];
    const char *seeds[3] = {"42", "42", "43"};
    for (int k = 0; k < 3; k++) {
        char *argv[] = {(char *)bin, "generate", "--model", g_model, "--tokenizer", g_tok, "--prompt", "Once upon",
                        "--steps", "120", "--temperature", "1.0", "--top-p", "0.9", "--seed", (char *)seeds[k], NULL};
        run_result r;
        run(argv, &r);
        if (r.status != 0)
            fail_msg("seed %s: exit %d: %s", seeds[k], r.status, r.err);
        out[k] = r.out;
    }
    assert_string_equal(out[0], out[1]);
    assert_string_not_equal(out[0], out[2]);
    assert_true(strncmp(out[0], "Once upon", 9) == 0);
    for (int k = 0; k < 3; k++)
        free(out[k]);
}

static void expect_exit(const char *bin, char *const extra[], int status, const char *needle)
{
    char *argv[32];
    int n = 0;
    argv[n++] = (char *)bin;
    argv[n++] = "generate";
    for (int i = 0; extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    run_result r;
    run(argv, &r);
    if (r.status != status)
        fail_msg("%s ...: exit %d, want %d; stderr: %s", extra[0], r.status, status, r.err);
    if (needle && !strstr(r.err, needle))
        fail_msg("%s ...: stderr \"%s\" lacks \"%s\"", extra[0], r.err, needle);
    if (status != 0)
        assert_int_equal(r.len, 0); /* nothing on stdout on failure */
    free(r.out);
}

static void test_cli_errors(void **state)
{
    (void)state;
    const char *bin = kvt_bin();
    if (!bin)
        skip();
    /* --help prints the usage on stdout, exit 0. */
    char *help[] = {(char *)bin, "generate", "--help", NULL};
    run_result r;
    run(help, &r);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "usage: kvtier generate"));
    assert_non_null(strstr(r.out, "--temperature"));
    free(r.out);

    expect_exit(bin, (char *[]){"--bogus", "1", NULL}, 2, "--bogus");
    expect_exit(bin, (char *[]){"--steps", "-1", NULL}, 2, "--steps");
    expect_exit(bin, (char *[]){"--steps", "12x", NULL}, 2, "--steps");
    expect_exit(bin, (char *[]){"--temperature", "-0.5", NULL}, 2, "--temperature");
    expect_exit(bin, (char *[]){"--temperature", "nan", NULL}, 2, "--temperature");
    expect_exit(bin, (char *[]){"--top-p", "1.5", NULL}, 2, "--top-p");
    expect_exit(bin, (char *[]){"--seed", "abc", NULL}, 2, "--seed");
    expect_exit(bin, (char *[]){"--block-tokens", "0", NULL}, 2, "--block-tokens");
    expect_exit(bin, (char *[]){"--prompt", NULL}, 2, "--prompt needs a value");
    expect_exit(bin, (char *[]){"stray", NULL}, 2, "stray");
    expect_exit(bin, (char *[]){"--model", "x.bin", NULL}, 2, "--tokenizer");

    if (!have_shared())
        return;
    /* Files: a missing model, a missing tokenizer, a vocab mismatch. */
    char missing[300];
    snprintf(missing, sizeof missing, "%s/missing.bin", g_dir);
    expect_exit(bin, (char *[]){"--model", missing, "--tokenizer", g_tok, NULL}, 1, "missing.bin");
    expect_exit(bin, (char *[]){"--model", g_model, "--tokenizer", missing, NULL}, 1, "missing.bin");
    char deftok[300];
    snprintf(deftok, sizeof deftok, "%s/default_tok.bin", g_dir);
    assert_int_equal(kvt_tokenizer_write_default(deftok, 259), 0);
    expect_exit(bin, (char *[]){"--model", g_model, "--tokenizer", deftok, "--steps", "5", NULL}, 1,
                "holds 259 pieces but the model's vocab_size is 512");
    /* --flag=value works like --flag value. */
    char *eq[] = {(char *)bin, "generate", "--model", g_model, "--tokenizer", g_tok, "--prompt=Tim", "--steps=3",
                  "--temperature=0", NULL};
    run(eq, &r);
    assert_int_equal(r.status, 0);
    assert_true(strncmp(r.out, "Tim", 3) == 0);
    free(r.out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_cli),
        cmocka_unit_test(test_golden_in_process),
        cmocka_unit_test(test_steps_edges),
        cmocka_unit_test(test_sampling_reproducible),
        cmocka_unit_test(test_cli_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
