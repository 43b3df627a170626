/*
 * test_cli_input.c: every input `kvtier chat` reads is bounded and refused
 * clearly past its bound, and byte sizes mean the same in every command.
 * Runs the binary (KVT_BIN) as a child with a wall-clock limit and an
 * address-space limit, and checks its exit status, its stderr and its peak
 * RSS: a script or stdin of /dev/zero, a NUL byte on stdin and in a script
 * (one message for both), a line over 1 MiB, a script and a transcript over
 * 64 MiB, a transcript path whose directory is missing or that is a
 * directory (said before any turn runs); then the byte-size parser
 * (kvt_chat_parse_bytes, which kvt_cli_bytes and so every command use).
 * Uses stories260K from ../shared (skips without it).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "chat.h"
#include "cli_run.h"
#include "tsan_skip.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char dir[256], model[1024], tok[1024];

/* The child's address-space cap: 2 GiB (an unbounded read fails fast instead
 * of taking the machine), none under ASan (its shadow reserves terabytes of
 * address space; the peak RSS check still holds). Under TSan, whose shadow
 * mapping does not fit under the cap either and whose shadow memory is most
 * of a child's peak RSS, the cases that read a bounded input and check the
 * peak RSS skip (BOUNDED_INPUT_CASE); the others run with no cap. */
#if defined(__SANITIZE_ADDRESS__) || defined(KVT_SANITIZE_THREAD)
#define AS_LIMIT 0
#else
#define AS_LIMIT (2ull << 30)
#endif

static int have_inputs(void) { return cli_inputs(model, sizeof model, tok, sizeof tok); }

/* A case that feeds the child an input it must refuse within 256 MB of peak
 * RSS under a 2 GiB address-space cap: neither holds under TSan. */
#define BOUNDED_INPUT_CASE()                                                                                 \
    KVT_TSAN_SKIP("the child cannot start under the 2 GiB address-space cap (TSan's shadow mapping is "     \
                  "larger) and its peak RSS would be TSan's shadow memory")

/* Runs `kvtier chat --model M --tokenizer T --max-tokens 4 ARGS...` with
 * stdin from `in` (NULL: /dev/null), at most 20 s and 2 GiB of address
 * space. */
static void run_chat(const char *in, const char *const *args, cli_result *r)
{
    const char *argv[32] = {"chat", "--model", model, "--tokenizer", tok, "--max-tokens", "4"};
    int n = 7;
    for (int i = 0; args[i]; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    cli_child c;
    assert_int_equal(cli_start(&c, dir, argv, in, 0, AS_LIMIT), 0);
    assert_int_equal(cli_finish(&c, 20, r), 0);
}

/* Exit 1, stderr holding `want`, no turn run, peak RSS under 256 MB. */
static void expect_refused(const char *what, const cli_result *r, const char *want)
{
    print_message("%s: exit %d, peak RSS %ld KB, stderr: %s", what, r->status, r->maxrss_kb, r->err);
    assert_false(r->timed_out);
    assert_int_equal(r->status, 1);
    if (!strstr(r->err, want))
        fail_msg("%s: stderr lacks '%s': %s", what, want, r->err);
    assert_null(strstr(r->err, "turn 1:"));
    assert_true(r->maxrss_kb < 256 * 1024);
}

static void write_file(const char *path, const char *text, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* A file of `bytes` bytes repeating `unit`. */
static void write_repeated(const char *path, const char *unit, size_t bytes)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    size_t u = strlen(unit);
    for (size_t n = 0; n < bytes; n += u)
        fwrite(unit, 1, u, f);
    assert_int_equal(fclose(f), 0);
}

/* /dev/zero as the script and as stdin: refused at its first byte (was
 * 10.9 GB and 12.2 GB of memory in 8 s). */
static void test_dev_zero(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    BOUNDED_INPUT_CASE();
    cli_result r;
    run_chat(NULL, (const char *const[]){"--script", "/dev/zero", NULL}, &r);
    expect_refused("--script /dev/zero", &r, "/dev/zero: line 1 holds a NUL byte");
    run_chat("/dev/zero", (const char *const[]){NULL}, &r);
    expect_refused("stdin /dev/zero", &r, "stdin: line 1 holds a NUL byte");
}

/* A NUL byte on stdin was a silently truncated message; --script refused it.
 * Both refuse it now, with the same message. */
static void test_nul_byte_both_paths(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    BOUNDED_INPUT_CASE();
    char path[300];
    snprintf(path, sizeof path, "%s/nul.txt", dir);
    write_file(path, "hello\nhel\0lo world\n", 19);
    cli_result r;
    run_chat(path, (const char *const[]){NULL}, &r);
    assert_int_equal(r.status, 1);
    assert_non_null(strstr(r.err, "stdin: line 2 holds a NUL byte (a message is text)"));
    assert_non_null(strstr(r.err, "turn 1:")); /* the first line ran */
    assert_null(strstr(r.err, "turn 2:"));
    run_chat(NULL, (const char *const[]){"--script", path, NULL}, &r);
    char want[400];
    snprintf(want, sizeof want, "%s: line 2 holds a NUL byte (a message is text)", path);
    expect_refused("--script with a NUL", &r, want);
    unlink(path);
}

/* A line over 1 MiB, on stdin and in a script; a script over 64 MiB. */
static void test_line_and_script_limits(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    BOUNDED_INPUT_CASE();
    char path[300], big[300];
    snprintf(path, sizeof path, "%s/long.txt", dir);
    snprintf(big, sizeof big, "%s/big.txt", dir);
    write_repeated(path, "abcdefgh", (1u << 20) + 64); /* one line, no newline */
    cli_result r;
    run_chat(path, (const char *const[]){NULL}, &r);
    expect_refused("stdin 1 MiB line", &r, "stdin: line 1 is longer than the limit of 1048576 bytes (1 MiB)");
    run_chat(NULL, (const char *const[]){"--script", path, NULL}, &r);
    expect_refused("--script 1 MiB line", &r, "line 1 is longer than the limit of 1048576 bytes (1 MiB)");
    /* 65 MiB of comment lines: every line is fine, the whole is not */
    write_repeated(big, "# a comment line of the script, skipped\n", (size_t)65 << 20);
    run_chat(NULL, (const char *const[]){"--script", big, NULL}, &r);
    expect_refused("--script 65 MiB", &r, "a script holds at most 67108864 bytes (64 MiB)");
    unlink(path);
    unlink(big);
}

/* A transcript over 64 MiB; a transcript path whose directory does not exist
 * (was "Input/output error" after the first turn ran) or that is a directory
 * (was a JSON parse error): the real cause, before any turn. */
static void test_transcript_checks(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    BOUNDED_INPUT_CASE();
    char msg[300], big[300];
    snprintf(msg, sizeof msg, "%s/msg.txt", dir);
    snprintf(big, sizeof big, "%s/big.json", dir);
    write_file(msg, "hello\n", 6);
    cli_result r;
    run_chat(msg, (const char *const[]){"--transcript", "/nonexistent/x.json", NULL}, &r);
    expect_refused("--transcript /nonexistent/x.json", &r, "/nonexistent/x.json");
    assert_non_null(strstr(r.err, "No such file or directory"));
    assert_null(strstr(r.err, "Input/output error"));
    assert_string_equal(r.out, ""); /* nothing generated */
    run_chat(msg, (const char *const[]){"--transcript", dir, NULL}, &r);
    expect_refused("--transcript DIR", &r, "Is a directory");
    assert_string_equal(r.out, "");
    write_repeated(big, "                                ", (size_t)65 << 20);
    run_chat(msg, (const char *const[]){"--transcript", big, NULL}, &r);
    expect_refused("--transcript 65 MiB", &r, "a transcript holds at most 67108864 bytes (64 MiB)");
    /* a good path still works: the file is written after the turn */
    char tr[300];
    snprintf(tr, sizeof tr, "%s/conv.json", dir);
    run_chat(msg, (const char *const[]){"--transcript", tr, NULL}, &r);
    assert_int_equal(r.status, 0);
    assert_int_equal(access(tr, R_OK), 0);
    unlink(tr);
    unlink(msg);
    unlink(big);
}

/* The one byte-size grammar: decimals, K/M/G/T with optional i and B, any
 * case, rounded down; no sign, space, exponent, hex (1.5G was refused by
 * chat and accepted by store gc). */
static void test_parse_bytes(void **state)
{
    (void)state;
    struct {
        const char *text;
        uint64_t want;
    } ok[] = {
        {"0", 0}, {"4096", 4096}, {"512M", 512ull << 20}, {"512m", 512ull << 20}, {"2GiB", 2ull << 30},
        {"2gib", 2ull << 30}, {"10GB", 10ull << 30}, {"1.5G", 3ull << 29}, {"1.5K", 1536}, {"0.5", 0},
        {"1.25KiB", 1280}, {"16MB", 16ull << 20}, {"100B", 100}, {"1T", 1ull << 40},
        {"0.001K", 1}, {"18446744073709551615", UINT64_MAX}, {"15.999999999999999999T", (16ull << 40) - 1},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        uint64_t v = 12345;
        if (kvt_chat_parse_bytes("x", ok[i].text, &v))
            fail_msg("'%s' refused: %s", ok[i].text, kvt_last_error());
        if (v != ok[i].want)
            fail_msg("'%s': got %llu, want %llu", ok[i].text, (unsigned long long)v,
                     (unsigned long long)ok[i].want);
    }
    const char *bad[] = {"", "-1", "+1", " 1", "1 ", "1e3", "0x10", "inf", "nan", "1.", ".5", "1.5.G", "12Q",
                         "1KK", "1iB", "16E", "18446744073709551616", "16777216T", "1,5G", "1G "};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t v = 777;
        if (kvt_chat_parse_bytes("--flag", bad[i], &v) != KVT_EINVAL)
            fail_msg("'%s' accepted as %llu", bad[i], (unsigned long long)v);
        assert_int_equal(v, 777);
        assert_non_null(strstr(kvt_last_error(), "--flag"));
        assert_non_null(strstr(kvt_last_error(), "1.5G")); /* says the forms */
    }
}

/* chat accepts the forms, refuses the rest as a usage error; --help says the
 * input limits. */
static void test_chat_flags(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char msg[300];
    snprintf(msg, sizeof msg, "%s/msg2.txt", dir);
    write_file(msg, "hello\n", 6);
    cli_result r;
    run_chat(msg, (const char *const[]){"--prompt-cache", "1.5G", "--kv-budget", "64MiB", NULL}, &r);
    assert_int_equal(r.status, 0);
    run_chat(msg, (const char *const[]){"--prompt-cache", "1e9", NULL}, &r);
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "--prompt-cache"));
    run_chat(NULL, (const char *const[]){"--help", NULL}, &r);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "1 MiB"));
    assert_non_null(strstr(r.out, "64 MiB"));
    unlink(msg);
}

/* Every command and subcommand takes --help (and -h): its usage on stdout,
 * exit 0, nothing run; never the flag read as a path or a missing option. */
static void test_every_command_help(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        skip();
    static const char *const cmds[][3] = {
        {"chat"},          {"generate"},     {"serve"},       {"replay"},      {"model"},
        {"model", "synth"}, {"model", "info"}, {"model", "default"}, {"store"},
        {"store", "inspect"}, {"store", "verify"}, {"store", "gc"}, {"bench"},
        {"bench", "ssd"},  {"bench", "chat"},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        for (int h = 0; h < 2; h++) {
            const char *argv[4];
            int n = 0;
            for (int k = 0; k < 3 && cmds[i][k]; k++)
                argv[n++] = cmds[i][k];
            argv[n++] = h ? "-h" : "--help";
            argv[n] = NULL;
            cli_child c;
            cli_result r;
            assert_int_equal(cli_start(&c, dir, argv, NULL, 0, AS_LIMIT), 0);
            assert_int_equal(cli_finish(&c, 20, &r), 0);
            if (r.status != 0 || !strstr(r.out, "usage:"))
                fail_msg("kvtier %s %s %s: exit %d, stdout '%.80s', stderr '%.200s'", cmds[i][0],
                         cmds[i][1] ? cmds[i][1] : "", argv[n - 1], r.status, r.out, r.err);
        }
    }
}

/* Runs `kvtier ARGS...` (no chat defaults) with stdin from /dev/null. */
static void run_cmd(const char *const *args, int timeout_s, cli_result *r)
{
    cli_child c;
    assert_int_equal(cli_start(&c, dir, args, NULL, 0, AS_LIMIT), 0);
    assert_int_equal(cli_finish(&c, timeout_s, r), 0);
    assert_false(r->timed_out);
}

static void expect_in(const char *what, const char *hay, const char *needle)
{
    if (!strstr(hay, needle))
        fail_msg("%s: lacks '%s' in: %s", what, needle, hay);
}

/* A turn whose prompt fills the model's context (it exited 1 with "prompt
 * 555 + max_tokens 60 ... lower max_tokens", which no --max-tokens could
 * fix, and the saved transcript failed the same way in every new run): the
 * chat says the context is full with the tokens and the limit, exits 3, the
 * transcript holds the turns before it (valid JSON), and a run continuing
 * it is told it cannot, and why. */
static void test_context_full(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char script[300], tr[300], one[300];
    snprintf(script, sizeof script, "%s/long.txt", dir);
    snprintf(tr, sizeof tr, "%s/full.json", dir);
    snprintf(one, sizeof one, "%s/one.txt", dir);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    for (int i = 0; i < 12; i++)
        fprintf(f, "Tell me a long story about a cat and a dog, number %d\n", i + 1);
    assert_int_equal(fclose(f), 0);
    write_file(one, "more\n", 5);
    unlink(tr);
    cli_result r;
    const char *a[] = {"chat", "--model", model, "--tokenizer", tok, "--max-tokens", "60", "--script", script,
                       "--transcript", tr, NULL};
    run_cmd(a, 60, &r);
    print_message("context full: exit %d, stderr: %s", r.status, r.err);
    assert_int_equal(r.status, 3);
    expect_in("chat at the context limit", r.err, "the context is full: turn ");
    expect_in("chat at the context limit", r.err, "the model has 512 positions");
    int turns = 0;
    for (const char *p = r.err; (p = strstr(p, "turn ")) != NULL; p++) {
        int t;
        long long reused;
        if (sscanf(p, "turn %d: reused %lld", &t, &reused) == 2)
            turns = t;
    }
    assert_true(turns >= 1 && turns < 12);
    char said[64];
    snprintf(said, sizeof said, "turn %d's prompt", turns + 1);
    expect_in("the turn that did not fit", r.err, said);
    long long prompt = 0;
    const char *p = strstr(r.err, "message) is ");
    assert_non_null(p);
    assert_int_equal(sscanf(p, "message) is %lld tokens", &prompt), 1);
    assert_true(prompt >= 512);
    snprintf(said, sizeof said, "holds the %d turns before it, unchanged", turns);
    expect_in("the transcript", r.err, said);
    /* the transcript is valid and holds exactly the turns that ran */
    char *doc = NULL;
    {
        FILE *tf = fopen(tr, "rb");
        assert_non_null(tf);
        doc = calloc(1, 1 << 20);
        assert_non_null(doc);
        size_t n = fread(doc, 1, (1 << 20) - 1, tf);
        fclose(tf);
        assert_true(n > 2);
    }
    int users = 0;
    for (const char *q = doc; (q = strstr(q, "\"user\"")) != NULL; q++)
        users++;
    assert_int_equal(users, turns);
    free(doc);
    /* a new run continuing it: the same turn number, told it cannot go on */
    const char *b[] = {"chat", "--model", model, "--tokenizer", tok, "--max-tokens", "1", "--script", one,
                       "--transcript", tr, NULL};
    run_cmd(b, 60, &r);
    print_message("continuing: exit %d, stderr: %s", r.status, r.err);
    assert_int_equal(r.status, 3);
    snprintf(said, sizeof said, "turn %d's prompt", turns + 1);
    expect_in("continuing", r.err, said);
    expect_in("continuing", r.err, "no run can continue it on this model");
    assert_null(strstr(r.err, "lower max_tokens"));
    /* without a transcript: the chat ends there, exit 3 */
    const char *c[] = {"chat", "--model", model, "--tokenizer", tok, "--max-tokens", "60", "--script", script, NULL};
    run_cmd(c, 60, &r);
    assert_int_equal(r.status, 3);
    expect_in("no transcript", r.err, "the chat ends here");
    unlink(script);
    unlink(one);
    unlink(tr);
}

/* The service's admission error names the library's own option; chat adds
 * its flag when it prints it. */
static void test_kv_budget_names(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char msg[300];
    snprintf(msg, sizeof msg, "%s/msg3.txt", dir);
    write_file(msg, "hello\n", 6);
    cli_result r;
    run_chat(msg, (const char *const[]){"--kv-budget", "4096", NULL}, &r);
    print_message("kv budget: exit %d, stderr: %s", r.status, r.err);
    assert_int_equal(r.status, 1);
    expect_in("--kv-budget 4096", r.err, "kvt_service_config.kv_budget_bytes 4096 bytes");
    expect_in("--kv-budget 4096", r.err, "(set by --kv-budget)");
    unlink(msg);
}

/* A bad --tokenizer is reported as the tokenizer's (chat said "cannot load
 * the model"), naming the file and what is wrong, by chat and generate. */
static void test_bad_tokenizer_named(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    cli_result r;
    char msg[300];
    snprintf(msg, sizeof msg, "%s/msg4.txt", dir);
    write_file(msg, "hello\n", 6);
    /* the model checkpoint given as the tokenizer */
    const char *chat[] = {"chat", "--model", model, "--tokenizer", model, "--script", msg, NULL};
    const char *gen[] = {"generate", "--model", model, "--tokenizer", model, "--steps", "4", NULL};
    const char *const *cmds[] = {chat, gen};
    for (int k = 0; k < 2; k++) {
        run_cmd(cmds[k], 20, &r);
        print_message("%s --tokenizer MODEL: exit %d, stderr: %s", cmds[k][0], r.status, r.err);
        assert_int_equal(r.status, 1);
        expect_in("bad tokenizer", r.err, "cannot load the tokenizer: ");
        expect_in("bad tokenizer", r.err, model);
        expect_in("bad tokenizer", r.err, "not a llama2.c tokenizer file");
        assert_null(strstr(r.err, "cannot load the model"));
    }
    /* and a missing one */
    const char *missing[] = {"chat", "--model", model, "--tokenizer", "/nonexistent/tok.bin", "--script", msg, NULL};
    run_cmd(missing, 20, &r);
    assert_int_equal(r.status, 1);
    expect_in("missing tokenizer", r.err, "cannot load the tokenizer: /nonexistent/tok.bin");
    unlink(msg);
}

/* chat and generate parse the flags they share with one parser: the same
 * value is refused with the same words by both, and --flag=value works in
 * both. */
static void test_shared_flags(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        skip();
    static const char *const bad[][2] = {{"--threads", "0"},     {"--top-p", "1.5"},      {"--temperature", "nan"},
                                         {"--block-tokens", "0"}, {"--kv-dtype", "f8"},    {"--live-cache-bytes", "1e3"},
                                         {"--live-cache-blocks", "-1"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[2][600];
        for (int k = 0; k < 2; k++) {
            const char *a[] = {k ? "generate" : "chat", bad[i][0], bad[i][1], NULL};
            cli_result r;
            run_cmd(a, 20, &r);
            if (r.status != 2)
                fail_msg("%s %s %s: exit %d (want 2), stderr: %s", a[0], bad[i][0], bad[i][1], r.status, r.err);
            /* the message without its command name */
            const char *m = strchr(r.err, ':');
            assert_non_null(m);
            snprintf(err[k], sizeof err[k], "%s", m);
            expect_in(a[0], r.err, bad[i][0]);
        }
        char *g = strstr(err[1], "(kvtier generate --help"), *c = strstr(err[0], "(kvtier chat --help");
        if (g)
            *g = '\0';
        if (c)
            *c = '\0';
        if (strcmp(err[0], err[1]))
            fail_msg("%s %s: chat said '%s', generate '%s'", bad[i][0], bad[i][1], err[0], err[1]);
    }
    /* --flag=value, and a flag without its value */
    const char *eq[] = {"chat", "--threads=0", NULL};
    cli_result r;
    run_cmd(eq, 20, &r);
    assert_int_equal(r.status, 2);
    expect_in("chat --threads=0", r.err, "--threads wants an integer in [1, 64], got '0'");
    const char *nov[] = {"chat", "--seed", NULL};
    run_cmd(nov, 20, &r);
    assert_int_equal(r.status, 2);
    expect_in("chat --seed", r.err, "--seed needs a value");
    const char *strict[] = {"generate", "--live-cache-strict", NULL};
    run_cmd(strict, 20, &r);
    assert_int_equal(r.status, 2);
    expect_in("generate --live-cache-strict", r.err, "--live-cache-strict needs --live-cache-blocks N or --live-cache-bytes B");
}

/* bench lookup says what it measures in the field's words (it printed
 * "take+dispose"), and refuses a bad count (atoi read "1x" as 1). */
static void test_bench_lookup_words(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN"))
        skip();
    cli_result r;
    const char *bad[] = {"bench", "lookup", "--entries", "1x", NULL};
    run_cmd(bad, 20, &r);
    assert_int_equal(r.status, 2);
    expect_in("bench lookup --entries 1x", r.err, "--entries wants an integer in [1, 10000000], got '1x'");
    const char *help[] = {"bench", "lookup", "--help", NULL};
    run_cmd(help, 20, &r);
    assert_int_equal(r.status, 0);
    expect_in("bench lookup --help", r.out, "find the longest cached prefix");
    const char *quick[] = {"bench", "lookup", "--quick", "--entries", "20", NULL};
    run_cmd(quick, 120, &r);
    print_message("bench lookup --quick --entries 20: exit %d\n%s", r.status, r.out);
    assert_int_equal(r.status, 0);
    assert_null(strstr(r.out, "take+dispose"));
    expect_in("bench lookup", r.out, "find the longest cached prefix, lend zero-copy views of it, release them");
    expect_in("bench lookup", r.out, "radix index: median");
    expect_in("bench lookup", r.out, "linear scan: median");
}

/* A store entry file (an "e....safetensors" shard) in an identity directory
 * under root: a checkpoint was written. */
static int has_entry_shard(const char *root)
{
    DIR *d = opendir(root);
    if (!d)
        return 0;
    int found = 0;
    struct dirent *de;
    while (!found && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char sub[600];
        snprintf(sub, sizeof sub, "%s/%s", root, de->d_name);
        DIR *s = opendir(sub);
        if (!s)
            continue;
        struct dirent *fe;
        while (!found && (fe = readdir(s)) != NULL)
            found = fe->d_name[0] == 'e' && strstr(fe->d_name, ".safetensors") != NULL &&
                    !strstr(fe->d_name, ".tmp");
        closedir(s);
    }
    closedir(d);
    return found;
}

/* generate resumed from a checkpoint that holds the whole prompt prefills
 * nothing: it says what happened ("prefill: 0 tokens (N restored from the
 * checkpoint)"), never a rate over no tokens ("prefill: 0.0 tok/s"). The
 * first run is killed (SIGKILL) once a checkpoint is on disk. */
static void test_generate_resumed_says_restored(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char ssd[300];
    snprintf(ssd, sizeof ssd, "%s/ckpt", dir);
    const char *a[] = {"generate", "--model", model, "--tokenizer", tok, "--prompt", "Once upon a time",
                       "--steps", "512", "--temperature", "0", "--request-id", "resume-me", "--ssd-cache", ssd,
                       "--checkpoint-every", "1", "--checkpoint-sync", NULL};
    int killed = 0;
    for (int trial = 0; trial < 20 && !killed; trial++) {
        char rm[400];
        snprintf(rm, sizeof rm, "rm -rf '%s'", ssd);
        assert_int_equal(system(rm), 0);
        cli_child c;
        assert_int_equal(cli_start(&c, dir, a, NULL, 0, AS_LIMIT), 0);
        for (int i = 0; i < 600000; i++) {
            if (has_entry_shard(ssd)) {
                killed = kill(c.pid, SIGKILL) == 0;
                break;
            }
            siginfo_t si = {0};
            if (waitid(P_PID, (id_t)c.pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == c.pid)
                break; /* it ended (left for cli_finish to reap) */
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
        }
        cli_result r;
        assert_int_equal(cli_finish(&c, 120, &r), 0);
        if (killed && !has_entry_shard(ssd))
            killed = 0; /* the run ended (removing its checkpoints) before the kill landed */
    }
    if (!killed)
        fail_msg("no run could be killed while a checkpoint was on disk in 20 trials");
    cli_result r;
    run_cmd(a, 120, &r);
    print_message("resumed: exit %d, stderr: %s", r.status, r.err);
    assert_int_equal(r.status, 0);
    expect_in("resumed", r.err, "from its checkpoint at ");
    long long restored = 0, prefilled = -1;
    const char *p = strstr(r.err, "generated tokens (");
    assert_non_null(p);
    assert_int_equal(sscanf(p, "generated tokens (%lld tokens restored, %lld prefilled", &restored, &prefilled), 2);
    assert_int_equal(prefilled, 0);
    assert_null(strstr(r.err, "prefill: 0.0 tok/s"));
    char said[96];
    snprintf(said, sizeof said, "prefill: 0 tokens (%lld restored from the checkpoint)", restored);
    expect_in("resumed", r.err, said);
    char rm[400];
    snprintf(rm, sizeof rm, "rm -rf '%s'", ssd);
    assert_int_equal(system(rm), 0);
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_cli_input_XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char path[400];
    const char *names[] = {"out.txt", "err.txt"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dev_zero),
        cmocka_unit_test(test_nul_byte_both_paths),
        cmocka_unit_test(test_line_and_script_limits),
        cmocka_unit_test(test_transcript_checks),
        cmocka_unit_test(test_parse_bytes),
        cmocka_unit_test(test_chat_flags),
        cmocka_unit_test(test_every_command_help),
        cmocka_unit_test(test_context_full),
        cmocka_unit_test(test_kv_budget_names),
        cmocka_unit_test(test_bad_tokenizer_named),
        cmocka_unit_test(test_shared_flags),
        cmocka_unit_test(test_bench_lookup_words),
        cmocka_unit_test(test_generate_resumed_says_restored),
    };
    return kvt_tsan_exit(cmocka_run_group_tests(tests, setup, teardown));
}
