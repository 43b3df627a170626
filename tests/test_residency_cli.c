/*
 * test_residency_cli.c: faults in live-cache paging through the CLI. A
 * `kvtier generate --live-cache-blocks 2` child on stories260K (16-token
 * blocks, so a 400-position run pages most of its blocks) runs under a
 * test-only LD_PRELOAD library (tests/preload/fault_preload.c, built with
 * the tests, never part of kvtier) that fails the page file's pwrite or
 * pread with ENOSPC or EIO. Failed writes keep the blocks in RAM: the run
 * succeeds with the fully resident output, byte for byte, and says how many
 * writes failed; a failed read ends the run with exit 1 and a message
 * naming the block and the page file, after printing only a prefix of the
 * right output: never a wrong token. The f16, bf16 and q8 schemes (their
 * sealed blocks paged) give their own resident output under a strict bound,
 * in generate and in a two-turn chat, and a failed read fails them cleanly
 * too. Skips without stories260K or the preload library (TSan builds).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "cli_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char model[1024], tok[1024], dir[256];
static int ready;
static cli_result ref; /* fully resident, no fault */

static const char *const prompt = "Once upon a time there was a little girl named Lily. She loved to play outside "
                                  "in the park with her friends. One day she saw a big red ball.";

/* Runs generate (bounded when `bounded`; replayable as request `id` with
 * checkpoints under dir/ssd when id is not NULL) with the fault given by the
 * KVT_PRELOAD_FAULT_* environment (unset: none). */
static void generate_as(int bounded, const char *id, cli_result *r)
{
    const char *args[32] = {"generate", "--model", model, "--tokenizer", tok, "--prompt", prompt, "--steps",
                            "400", "--temperature", "0", "--block-tokens", "16", "--threads", "1"};
    int n = 15;
    if (bounded) {
        args[n++] = "--live-cache-blocks";
        args[n++] = "2";
        args[n++] = "--live-cache-dir";
        args[n++] = dir;
    }
    char ssd[300];
    snprintf(ssd, sizeof ssd, "%s/ssd", dir);
    if (id) {
        args[n++] = "--request-id";
        args[n++] = id;
        args[n++] = "--ssd-cache";
        args[n++] = ssd;
        args[n++] = "--checkpoint-every";
        args[n++] = "16";
    }
    args[n] = NULL;
    cli_child c;
    assert_int_equal(cli_start(&c, dir, args, NULL, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 300, r), 0);
    assert_false(r->timed_out);
}

static void generate(int bounded, cli_result *r) { generate_as(bounded, NULL, r); }

/* Runs `generate --kv-dtype dtype` (bounded: --live-cache-blocks 2 --live-cache-strict),
 * or with `chat` a two-turn chat (stdin: two messages) under the same flags. */
static void run_scheme(const char *cmd, const char *dtype, int bounded, cli_result *r)
{
    const char *args[40] = {cmd, "--model", model, "--tokenizer", tok, "--temperature", "0", "--block-tokens",
                            "16", "--threads", "1", "--kv-dtype", dtype};
    int n = 13;
    char in[300];
    snprintf(in, sizeof in, "%s/chat-in.txt", dir);
    if (!strcmp(cmd, "generate")) {
        args[n++] = "--prompt";
        args[n++] = prompt;
        args[n++] = "--steps";
        args[n++] = "400";
    } else {
        FILE *f = fopen(in, "w");
        assert_non_null(f);
        fprintf(f, "%s\nAnd then what did she do with the ball?\n", prompt);
        assert_int_equal(fclose(f), 0);
        args[n++] = "--max-tokens";
        args[n++] = "120";
    }
    if (bounded) {
        args[n++] = "--live-cache-blocks";
        args[n++] = "2";
        args[n++] = "--live-cache-strict";
        args[n++] = "--live-cache-dir";
        args[n++] = dir;
    }
    args[n] = NULL;
    cli_child c;
    assert_int_equal(cli_start(&c, dir, args, !strcmp(cmd, "generate") ? NULL : in, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 300, r), 0);
    assert_false(r->timed_out);
}

static void fault(const char *call, const char *err, const char *after)
{
    setenv("KVT_PRELOAD_FAULT_CALL", call, 1);
    setenv("KVT_PRELOAD_FAULT_ERRNO", err, 1);
    setenv("KVT_PRELOAD_FAULT_AFTER", after, 1);
    setenv("KVT_PRELOAD_FAULT_PATH", "kvtier-live-", 1);
}

static void no_fault(void)
{
    unsetenv("KVT_PRELOAD_FAULT_CALL");
}

/* The number after `key` in text, -1 when absent. */
static long long number_after(const char *text, const char *key)
{
    const char *p = strstr(text, key);
    return p ? atoll(p + strlen(key)) : -1;
}

static int setup(void **state)
{
    (void)state;
    const char *preload = getenv("KVT_FAULT_PRELOAD");
    if (!cli_inputs(model, sizeof model, tok, sizeof tok) || !preload || access(preload, R_OK) != 0) {
        printf("test_residency_cli: skipped: needs KVT_BIN, stories260K and KVT_FAULT_PRELOAD (not in TSan builds)\n");
        return 0;
    }
    snprintf(dir, sizeof dir, "/tmp/kvt_live_cli_XXXXXX");
    assert_non_null(mkdtemp(dir));
    /* the child loads the fault library; an ASan child accepts it before its runtime */
    setenv("LD_PRELOAD", preload, 1);
    const char *asan = getenv("ASAN_OPTIONS");
    char opts[512];
    snprintf(opts, sizeof opts, "%s%sverify_asan_link_order=0", asan ? asan : "", asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);
    no_fault();
    generate(0, &ref);
    assert_int_equal(ref.status, 0);
    assert_true(strlen(ref.out) > 200);
    ready = 1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    unsetenv("LD_PRELOAD");
    if (!dir[0])
        return 0;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

#define NEED()             \
    do {                   \
        if (!ready) {      \
            skip();        \
            return;        \
        }                  \
    } while (0)

static void test_bounded_identical(void **state)
{
    (void)state;
    NEED();
    no_fault();
    static cli_result r;
    generate(1, &r);
    assert_int_equal(r.status, 0);
    assert_string_equal(r.out, ref.out);
    long long out = number_after(r.err, "live cache: paged out ");
    printf("no fault: paged out %lld blocks\n", out);
    assert_true(out > 20);
    assert_int_equal(number_after(r.err, "MB of full blocks in RAM, "), 0); /* failed writes */
}

/* A full disk (ENOSPC) or a failing one (EIO) under the page file's writes:
 * the blocks stay in RAM, counted, and the output is the same. */
static void test_write_faults_keep_blocks(void **state)
{
    (void)state;
    NEED();
    static const char *const errs[] = {"ENOSPC", "EIO"};
    for (int e = 0; e < 2; e++) {
        fault("pwrite", errs[e], "5"); /* five blocks written, then every write fails */
        static cli_result r;
        generate(1, &r);
        no_fault();
        if (r.status != 0)
            fprintf(stderr, "%s: %s\n", errs[e], r.err);
        assert_int_equal(r.status, 0);
        assert_string_equal(r.out, ref.out);
        long long failed = number_after(r.err, "MB of full blocks in RAM, ");
        printf("%s on page writes: output identical, %lld failed writes kept in RAM, paged out %lld\n", errs[e],
               failed, number_after(r.err, "live cache: paged out "));
        assert_true(failed > 0);
        assert_int_equal(number_after(r.err, "live cache: paged out "), 5);
    }
}

/* EIO on the page file's reads: the run fails cleanly with the block and
 * the page file named, and what it printed is a prefix of the right output. */
static void test_read_fault_fails_cleanly(void **state)
{
    (void)state;
    NEED();
    static const char *const after[] = {"0", "40"};
    for (int k = 0; k < 2; k++) {
        fault("pread", "EIO", after[k]);
        static cli_result r;
        generate(1, &r);
        no_fault();
        printf("EIO on page reads after %s: exit %d, printed %zu of %zu bytes; %s", after[k], r.status,
               strlen(r.out), strlen(ref.out), r.err);
        assert_int_equal(r.status, 1);
        assert_non_null(strstr(r.err, "live cache: paging block"));
        assert_non_null(strstr(r.err, "kvtier-live-"));
        assert_non_null(strstr(r.err, "nput/output error"));
        assert_true(strlen(r.out) < strlen(ref.out));
        assert_memory_equal(r.out, ref.out, strlen(r.out)); /* never a wrong token */
    }
}

/* A replayable bounded run (--request-id with --live-cache-blocks): the
 * same output; its checkpoints hold every block (paged ones read back), so
 * a run that fails on a page read resumes from one, bounded again, and
 * prints the whole output exactly. */
static void test_replayable_bounded(void **state)
{
    (void)state;
    NEED();
    no_fault();
    static cli_result r;
    generate_as(1, "whole", &r);
    assert_int_equal(r.status, 0);
    assert_string_equal(r.out, ref.out);
    assert_true(number_after(r.err, "live cache: paged out ") > 20);
    fault("pread", "EIO", "6000"); /* fails about halfway, past several checkpoints */
    generate_as(1, "broken", &r);
    no_fault();
    printf("replayable, EIO on page reads after 6000: exit %d, printed %zu of %zu bytes\n", r.status, strlen(r.out),
           strlen(ref.out));
    assert_int_equal(r.status, 1);
    assert_memory_equal(r.out, ref.out, strlen(r.out));
    generate_as(1, "broken", &r);
    printf("rerun: %s", r.err);
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.err, "resumed: request 'broken' from its checkpoint at"));
    assert_true(number_after(r.err, "live cache: paged out ") > 0); /* bounded again */
    /* the blocks restored from the checkpoint are the SSD tier's: paged out by reference, said on stderr */
    assert_true(number_after(r.err, "failed writes (kept in RAM), ") > 0);
    assert_string_equal(r.out, ref.out);
}

/* f16, bf16 and q8 under a strict bound: generate and a two-turn chat
 * print exactly their fully resident output, the sealed blocks paged out
 * and in; EIO on a page read of a q8 run fails it cleanly, after a prefix
 * of that output. */
static void test_schemes_bounded(void **state)
{
    (void)state;
    NEED();
    no_fault();
    static const char *const dtypes[3] = {"f16", "bf16", "q8"};
    static const char *const cmds[2] = {"generate", "chat"};
    static cli_result full, r;
    for (int d = 0; d < 3; d++)
        for (int k = 0; k < 2; k++) {
            run_scheme(cmds[k], dtypes[d], 0, &full);
            if (full.status != 0)
                fprintf(stderr, "%s\n", full.err);
            assert_int_equal(full.status, 0);
            run_scheme(cmds[k], dtypes[d], 1, &r);
            if (r.status != 0)
                fprintf(stderr, "%s\n", r.err);
            assert_int_equal(r.status, 0);
            long long out = number_after(r.err, "paged out ");
            printf("%s %s bounded: output identical (%zu bytes), paged out %lld blocks\n", cmds[k], dtypes[d],
                   strlen(r.out), out);
            assert_true(strlen(full.out) > 200);
            assert_string_equal(r.out, full.out);
            assert_true(out > 10);
            if (d == 2 && k == 0) { /* q8: a failed page read */
                fault("pread", "EIO", "40");
                run_scheme(cmds[k], dtypes[d], 1, &r);
                no_fault();
                assert_int_equal(r.status, 1);
                assert_non_null(strstr(r.err, "live cache: paging block"));
                assert_true(strlen(r.out) < strlen(full.out));
                assert_memory_equal(r.out, full.out, strlen(r.out));
            }
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bounded_identical),
        cmocka_unit_test(test_write_faults_keep_blocks),
        cmocka_unit_test(test_read_fault_fails_cleanly),
        cmocka_unit_test(test_replayable_bounded),
        cmocka_unit_test(test_schemes_bounded),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
