/*
 * test_bench_kv_dtype.c: `kvtier bench kv-dtype` on stories260K, small (4
 * prompts of 24 tokens, 24 greedy tokens) as a child process: KV bytes per
 * token per scheme (f32 1280, f16/bf16 640, q8 330: 8-bit codes with per-channel
 * scales per 256-token block), the noise-floor rows (f32*isa, f32*pre)
 * agreeing on every prompt, the near-tie density counted over every one of
 * f32's greedy steps, and for each row one first-divergence gap per
 * disagreeing prompt (the near-tie line's count equals prompts minus agreeing
 * prompts). 48 tokens fit in one 256-token block, which f16, bf16, q8 and
 * the simulated open-block rows keep in f32: their logits must equal the
 * reference's bit for bit, which holds only if the batched passes the rows
 * prefill with compute what the reference's token-by-token decode does.
 * --rows picks rows; a bad name is a usage error. With blocks of 8 those
 * rows seal blocks and their logits leave f32's, and the real f16 and bf16
 * rows (sealed 16-bit blocks, the open block f32) equal the simulated ones
 * (f32 caches whose full blocks are rounded) bit for bit: greedy tokens and
 * logit differences. Not a quality test: the figures of a 4-prompt run are
 * not the goals'. Skips without KVT_BIN or the model.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "cli_run.h"
#include "store_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void expect_in(const char *hay, const char *needle)
{
    if (!strstr(hay, needle))
        fprintf(stderr, "expected \"%s\" in:\n%s\n", needle, hay);
    assert_non_null(strstr(hay, needle));
}

/* The agreeing prompts of a scheme's row ("  f16  ...  A/4 ..."), and the
 * disagreements its near-tie line counts (0 when it has none). */
static void row_counts(const char *out, const char *scheme, int *agree, int *disagree)
{
    char key[32];
    snprintf(key, sizeof key, "\n  %-9s ", scheme);
    const char *row = strstr(out, key);
    assert_non_null(row);
    const char *slash = strstr(row, "/4 ");
    assert_non_null(slash);
    const char *a = slash;
    while (a > row && a[-1] >= '0' && a[-1] <= '9')
        a--;
    *agree = atoi(a);
    const char *line = strstr(slash, key); /* the near-tie line comes after the rows */
    *disagree = line ? atoi(line + strlen(key)) : 0;
}

static void t_bench_kv_dtype(void **state)
{
    (void)state;
    char model[1024], tok[1024], dir[512];
    if (!cli_inputs(model, sizeof model, tok, sizeof tok))
        skip();
    store_tmpdir(dir, sizeof dir, "bench-kvd");
    const char *args[] = {"bench", "kv-dtype", "--model", model, "--tokenizer", tok, "--no-default", "--prompts", "4",
                          "--prompt-tokens", "24", "--gen-tokens", "24", NULL};
    cli_child c;
    cli_result r;
    assert_int_equal(cli_start(&c, dir, args, NULL, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 300, &r), 0);
    printf("%s", r.out);
    assert_false(r.timed_out);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "  f32             1280 ");
    expect_in(r.out, "  f16              640 ");
    expect_in(r.out, "  bf16             640 ");
    expect_in(r.out, "  q8               330 ");
    expect_in(r.out, "  f16+open         640 ");
    expect_in(r.out, "  bf16+open        640 ");
    /* the order of arithmetic alone: every prompt agrees */
    expect_in(r.out, "  f32*isa         1280 ");
    expect_in(r.out, "  f32*pre         1280 ");
    expect_in(r.out, "of its 96 greedy steps");
    static const char *const schemes[] = {"f16", "bf16", "q8", "f16+open", "bf16+open", "f32*pre", "f32*isa"};
    for (int i = 0; i < 7; i++) {
        int agree = -1, disagree = -1;
        row_counts(r.out, schemes[i], &agree, &disagree);
        printf("%s: %d agree, %d first divergences\n", schemes[i], agree, disagree);
        assert_true(agree >= 0 && agree <= 4);
        assert_int_equal(disagree, 4 - agree);
        if (i >= 5)
            assert_int_equal(agree, 4);
    }
    /* all 48 tokens in the open f32 block: bit-identical to the reference */
    expect_in(r.out, "  f16              640   0.500x            0             0         4/4 100.0%");
    expect_in(r.out, "  bf16             640   0.500x            0             0         4/4 100.0%");
    expect_in(r.out, "  q8               330   0.258x            0             0         4/4 100.0%");
    expect_in(r.out, "  f16+open         640   0.500x            0             0         4/4 100.0%");
    expect_in(r.out, "  bf16+open        640   0.500x            0             0         4/4 100.0%");

    /* --rows: only the named rows besides the reference; a bad name is refused */
    const char *rows[] = {"bench", "kv-dtype", "--model", model, "--tokenizer", tok, "--no-default", "--prompts", "2",
                          "--prompt-tokens", "8", "--gen-tokens", "4", "--rows", "f16,f32*pre", NULL};
    assert_int_equal(cli_start(&c, dir, rows, NULL, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 300, &r), 0);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "  f16              640 ");
    expect_in(r.out, "  f32*pre         1280 ");
    assert_null(strstr(r.out, "  bf16 "));
    assert_null(strstr(r.out, "  q8 "));
    assert_null(strstr(r.out, "  f32*isa "));
    /* blocks of 8: the open-block rows and q8 seal blocks, so they move off f32 */
    const char *sealed[] = {"bench", "kv-dtype", "--model", model, "--tokenizer", tok, "--no-default", "--prompts",
                            "4", "--prompt-tokens", "24", "--gen-tokens", "24", "--block-tokens", "8", "--rows",
                            "f16,bf16,q8,f16+open,bf16+open", NULL};
    assert_int_equal(cli_start(&c, dir, sealed, NULL, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 300, &r), 0);
    assert_int_equal(r.status, 0);
    expect_in(r.out, "  q8               640   0.500x "); /* 64 codes + 64 bytes of scales per block of 8, 5 layers */
    expect_in(r.out, "  f16+open         640   0.500x ");
    expect_in(r.out, "  bf16+open        640   0.500x ");
    assert_null(strstr(r.out, "x            0 ")); /* no row's max |dlogit| is 0 */
    expect_in(r.out, "  f16 (real) vs f16+open (simulated): greedy tokens equal on 4/4 prompts; logit differences "
                     "equal bit for bit");
    expect_in(r.out, "  bf16 (real) vs bf16+open (simulated): greedy tokens equal on 4/4 prompts; logit differences "
                     "equal bit for bit");
    rows[14] = "f16,f8";
    assert_int_equal(cli_start(&c, dir, rows, NULL, 0, 0), 0);
    assert_int_equal(cli_finish(&c, 300, &r), 0);
    assert_int_equal(r.status, 2);
    store_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(t_bench_kv_dtype)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
