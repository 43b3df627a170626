/*
 * test_cache_cli.c: `kvtier cache publish|inspect|verify` and `kvtier chat
 * --prompt-cache-dir` run as child processes on stories260K: usage errors
 * and bad prompt files are refused naming the line; a publication is
 * inspected (manifest and headers) and verified (every SHA-256); a chat
 * whose first prompt was published reuses all of it but the token that must
 * run, with the reply of a chat without it; after a bit flip verify exits 1
 * naming the hash, and the chat warns once, reuses nothing and replies the
 * same. A publication made with --kv-dtype f16 serves f16 chats only.
 * Skips without KVT_BIN or the shared model.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "cli_run.h"
#include "store_util.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char model[1024], tok[1024], dir[512];

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

/* Runs kvtier with args (NULL-terminated); fills *r. */
static void run(const char *const *args, cli_result *r)
{
    cli_child c;
    assert_int_equal(cli_start(&c, dir, args, NULL, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 300, r), 0);
    assert_false(r->timed_out);
}

static void expect_in(const char *hay, const char *needle)
{
    if (!strstr(hay, needle))
        fprintf(stderr, "expected \"%s\" in:\n%s\n", needle, hay);
    assert_non_null(strstr(hay, needle));
}

/* `turn 1: reused R tokens` from a chat's stderr. */
static long reused_of(const char *err)
{
    const char *p = strstr(err, "turn 1: reused ");
    assert_non_null(p);
    return atol(p + strlen("turn 1: reused "));
}

static const char USER[] = "Tell me a story about a cat named Tom who lived in a big red house.";

/* The chat of USER with K/V stored as `scheme` (NULL: the default, f32),
 * mounting the publication `pub` (NULL: none). */
static void chat_scheme(const char *pub, const char *scheme, cli_result *r)
{
    char script[600];
    snprintf(script, sizeof script, "%s/script.txt", dir);
    char text[200];
    snprintf(text, sizeof text, "%s\n", USER);
    write_text(script, text);
    const char *a[16] = {"chat", "--model", model, "--tokenizer", tok, "--script", script, "--max-tokens", "24"};
    int n = 9;
    if (pub)
        a[n++] = "--prompt-cache-dir", a[n++] = pub;
    if (scheme)
        a[n++] = "--kv-dtype", a[n++] = scheme;
    a[n] = NULL;
    run(a, r);
}

static void chat(const char *pub, cli_result *r) { chat_scheme(pub, NULL, r); }

static void t_cache_cli(void **state)
{
    (void)state;
    if (!cli_inputs(model, sizeof model, tok, sizeof tok))
        skip();
    store_tmpdir(dir, sizeof dir, "cache-cli");
    char prompts[600], out[600];
    snprintf(prompts, sizeof prompts, "%s/prompts.jsonl", dir);
    snprintf(out, sizeof out, "%s/pub", dir);
    cli_result r;

    const char *help[] = {"cache", "publish", "--help", NULL};
    run(help, &r);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "--prompts FILE");
    const char *no_out[] = {"cache", "publish", "--prompts", prompts, NULL};
    run(no_out, &r);
    assert_int_equal(r.status, 2);
    expect_in(r.err, "--out DIR");

    const char *pub[] = {"cache", "publish", "--model", model, "--tokenizer", tok, "--prompts", prompts, "--out", out,
                         NULL};
    write_text(prompts, "{\"text\": \"hello\", \"colour\": \"red\"}\n");
    run(pub, &r);
    assert_int_equal(r.status, 1);
    expect_in(r.err, "prompts.jsonl:1: unknown field \"colour\"");
    write_text(prompts, "\n{\"tokens\": [1, 2, 9999]}\n");
    run(pub, &r);
    assert_int_equal(r.status, 1);
    expect_in(r.err, "prompts.jsonl:2: tokens[2] is not a token id in [0, 512)");
    write_text(prompts, "{\"text\": \"a\", \"tokens\": [1]}\n");
    run(pub, &r);
    assert_int_equal(r.status, 1);
    expect_in(r.err, "exactly one of");

    /* the chat's first prompt, rendered as the chat template does, and one token prompt in a namespace */
    char line[400];
    json_t *j = json_pack("{s:s}", "text", "User: Tell me a story about a cat named Tom who lived in a big red house.\nAssistant:");
    char *js = json_dumps(j, JSON_COMPACT);
    snprintf(line, sizeof line, "%s\n{\"ns\": \"lora:x\", \"tokens\": [1, 403, 411, 261, 37]}\n", js);
    free(js);
    json_decref(j);
    write_text(prompts, line);
    run(pub, &r);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "published generation 00000001");
    expect_in(r.out, "2 prompts, 2 entries");

    const char *inspect[] = {"cache", "inspect", out, NULL};
    run(inspect, &r);
    printf("%s", r.out);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "CURRENT 00000001");
    expect_in(r.out, "ns \"lora:x\"");
    expect_in(r.out, "5 tokens");
    const char *p = strstr(r.out, "longest entry ");
    assert_non_null(p);
    long n_pub = atol(p + strlen("longest entry "));
    const char *verify[] = {"cache", "verify", out, NULL};
    run(verify, &r);
    printf("%s", r.out);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "every SHA-256 good");

    cli_result plain, with;
    chat(NULL, &plain);
    assert_int_equal(plain.status, 0);
    chat(out, &with);
    assert_int_equal(with.status, 0);
    printf("chat: published first prompt of %ld tokens: turn 1 reused %ld (without: %ld)\n", n_pub,
           reused_of(with.err), reused_of(plain.err));
    assert_int_equal(reused_of(plain.err), 0);
    assert_int_equal(reused_of(with.err), n_pub - 1); /* one token must run */
    assert_string_equal(with.out, plain.out);

    /* a flipped byte: verify names the hash; the chat warns, reuses nothing, replies the same */
    char man[700];
    snprintf(man, sizeof man, "%s/generations/00000001/MANIFEST.json", out);
    json_t *m = json_load_file(man, 0, NULL);
    assert_non_null(m);
    json_t *shards = json_object_get(m, "shards");
    char shard[1200] = "";
    for (size_t i = 0; i < json_array_size(shards); i++) {
        json_t *s = json_array_get(shards, i);
        if (json_integer_value(json_object_get(s, "tokens")) == n_pub)
            snprintf(shard, sizeof shard, "%s/generations/00000001/%s", out,
                     json_string_value(json_object_get(s, "path")));
    }
    json_decref(m);
    assert_true(shard[0]);
    assert_int_equal(store_flip_byte(shard, 1, 0x10), 0);
    run(verify, &r);
    printf("%s", r.out);
    assert_int_equal(r.status, 1);
    expect_in(r.out, "REFUSED (hash)");
    chat(out, &with);
    assert_int_equal(with.status, 0);
    expect_in(with.err, "warning: published prompt cache");
    expect_in(with.err, "refused (hash)");
    assert_int_equal(reused_of(with.err), 0);
    assert_string_equal(with.out, plain.out);
    store_rmtree(dir);
}

/* `cache publish` with its default scheme, f16: the generation serves a
 * chat running f16, given or by default (all of the published prompt but the
 * token that must run, the reply of an f16 chat without it), and no other
 * scheme: an f32 or a q8 chat reuses nothing from it and replies as it does
 * without it. A bad scheme is a usage error. */
static void t_cache_cli_kv_dtype(void **state)
{
    (void)state;
    if (!cli_inputs(model, sizeof model, tok, sizeof tok))
        skip();
    store_tmpdir(dir, sizeof dir, "cache-cli-dtype");
    char prompts[600], out[600];
    snprintf(prompts, sizeof prompts, "%s/prompts.jsonl", dir);
    snprintf(out, sizeof out, "%s/pub16", dir);
    cli_result r;
    const char *bad[] = {"cache", "publish", "--prompts", prompts, "--out", out, "--kv-dtype", "f8", NULL};
    run(bad, &r);
    assert_int_equal(r.status, 2);
    expect_in(r.err, "--kv-dtype wants f32, f16, bf16 or q8, got: f8");

    char line[400];
    json_t *j = json_pack("{s:s}", "text", "User: Tell me a story about a cat named Tom who lived in a big red house.\nAssistant:");
    char *js = json_dumps(j, JSON_COMPACT);
    snprintf(line, sizeof line, "%s\n", js);
    free(js);
    json_decref(j);
    write_text(prompts, line);
    const char *pub[] = {"cache", "publish", "--model", model, "--tokenizer", tok, "--prompts", prompts, "--out", out,
                         NULL}; /* the default scheme: f16 */
    run(pub, &r);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "published generation 00000001");
    const char *inspect[] = {"cache", "inspect", out, NULL};
    run(inspect, &r);
    assert_int_equal(r.status, 0);
    const char *p = strstr(r.out, "longest entry ");
    assert_non_null(p);
    long n_pub = atol(p + strlen("longest entry "));
    assert_true(n_pub > 1);

    static const char *const schemes[] = {"f16", NULL, "f32", "q8"}; /* NULL: chat's default, f16 */
    for (int i = 0; i < 4; i++) {
        cli_result plain, with;
        chat_scheme(NULL, schemes[i], &plain);
        assert_int_equal(plain.status, 0);
        chat_scheme(out, schemes[i], &with);
        assert_int_equal(with.status, 0);
        printf("chat --kv-dtype %s over an f16 publication of %ld tokens: turn 1 reused %ld\n",
               schemes[i] ? schemes[i] : "(default)", n_pub, reused_of(with.err));
        assert_int_equal(reused_of(plain.err), 0);
        assert_int_equal(reused_of(with.err), i < 2 ? n_pub - 1 : 0);
        assert_string_equal(with.out, plain.out);
    }
    store_rmtree(dir);
}

/* inspect and verify of a directory that is not a publication: a missing
 * one (inspect said "total: 0 generations", exit 0), a file, and a directory
 * without CURRENT or generations/: exit 1, naming the directory and what is
 * missing. */
static void t_cache_cli_not_a_publication(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        skip();
    store_tmpdir(dir, sizeof dir, "cache-cli-none");
    char missing[600], file[600], empty[600];
    snprintf(missing, sizeof missing, "%s/missing", dir);
    snprintf(file, sizeof file, "%s/file.txt", dir);
    snprintf(empty, sizeof empty, "%s/empty", dir);
    write_text(file, "not a publication\n");
    assert_int_equal(mkdir(empty, 0755), 0);
    static const char *const subs[] = {"inspect", "verify"};
    for (int k = 0; k < 2; k++) {
        cli_result r;
        const char *a[] = {"cache", subs[k], missing, NULL};
        run(a, &r);
        print_message("cache %s MISSING: exit %d, %s", subs[k], r.status, r.err);
        assert_int_equal(r.status, 1);
        expect_in(r.err, missing);
        expect_in(r.err, "No such file or directory");
        const char *b[] = {"cache", subs[k], file, NULL};
        run(b, &r);
        assert_int_equal(r.status, 1);
        expect_in(r.err, "not a directory");
        const char *c[] = {"cache", subs[k], empty, NULL};
        run(c, &r);
        print_message("cache %s EMPTY: exit %d, %s", subs[k], r.status, r.err);
        assert_int_equal(r.status, 1);
        expect_in(r.err, "is not a published prompt cache: it holds no CURRENT file and no generation");
    }
    store_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(t_cache_cli), cmocka_unit_test(t_cache_cli_kv_dtype),
                                       cmocka_unit_test(t_cache_cli_not_a_publication)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
