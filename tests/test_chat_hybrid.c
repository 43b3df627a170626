/*
 * test_chat_hybrid.c: shared prefixes on models whose state cannot be cut
 * back (prefill checkpoints, engine/chat.h). Two conversations whose first
 * messages share a long start, on synthetic plain, sliding-window (the ring
 * wraps), recurrent and hybrid models: the second conversation's first turn
 * reuses at least the shared length rounded down to the checkpoint stride,
 * in RAM (one service) and after a restart from the SSD tier (a second
 * `kvtier chat` process on the same --ssd-cache), and every reply equals a
 * cache-off run. Checkpoints share the kv blocks they sit on (the budget
 * counts them once: a checkpoint costs its ring and recurrent state), obey a
 * small RAM budget, and `--prefill-checkpoint-stride 0` turns them off.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "chat.h"
#include "synth_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define VOCAB 259 /* the default byte tokenizer */
#define WINDOW 24
#define BLOCK 16
enum { M_PLAIN, M_WINDOW, M_RECURRENT, M_HYBRID, M_COUNT };
static const char *const model_name[M_COUNT] = {"plain", "window", "recurrent", "hybrid"};
static char dir[256], model_path[M_COUNT][300], tok_path[300];

static int group_setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_chat_hybrid_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(tok_path, sizeof tok_path, "%s/tok.bin", dir);
    if (kvt_tokenizer_write_default(tok_path, VOCAB))
        return -1;
    for (int i = 0; i < M_COUNT; i++) {
        snprintf(model_path[i], sizeof model_path[i], "%s/%s.bin", dir, model_name[i]);
        su_synth(i, model_path[i], VOCAB, 1024, 21, WINDOW);
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* Two conversations; their first messages share a long start. */
#define SHARED_START                                                                                       \
    "You are a careful assistant for a ship's crew. Answer in one short line. The ship sails from the "   \
    "northern harbour at dawn, carries grain and timber, and must reach the southern port before the "   \
    "winter storms. The captain keeps a log of the wind, the tides and the stars. Q:"
static const char *const conv_a[] = {SHARED_START " Who steers at night, and how?", "And in a storm?"};
static const char *const conv_b[] = {SHARED_START " What does the cook count each day?", "Why that?"};
#define TURNS 2
#define MAX_REPLY 12

/* Prompt tokens of a conversation's first turn, as kvt_chat_turn makes them. */
static int64_t first_prompt(const kvt_tokenizer *tok, const char *msg, int32_t *ids, int64_t cap)
{
    char *text = NULL;
    assert_int_equal(kvt_chat_render(&msg, NULL, 1, &text), 0);
    int64_t n = 0;
    assert_int_equal(kvt_tokenizer_encode(tok, text, 1, 0, ids, cap, &n), 0);
    free(text);
    return n;
}

/* Tokens the first turns of the two conversations share. */
static int64_t shared_tokens(const kvt_tokenizer *tok)
{
    int32_t a[2048], b[2048];
    int64_t na = first_prompt(tok, conv_a[0], a, 2048), nb = first_prompt(tok, conv_b[0], b, 2048);
    int64_t s = 0;
    while (s < na && s < nb && a[s] == b[s])
        s++;
    return s;
}

typedef struct {
    int32_t reply[2][TURNS][MAX_REPLY]; /* [conversation][turn] */
    int64_t n_reply[2][TURNS];
    kvt_turn_stats st[2][TURNS];
    kvt_service_stats after_a, rep; /* after conversation A; at the end */
} two_convs;

/* Runs conversation A, then B, on one service (block size BLOCK). */
static void run_two(kvt_model *m, kvt_tokenizer *tok, uint64_t pc_bytes, int64_t stride, two_convs *r)
{
    memset(r, 0, sizeof *r);
    kvt_chat_service_opts so = {.prompt_cache_bytes = pc_bytes, .block_tokens = BLOCK};
    kvt_service *svc = NULL;
    assert_int_equal(kvt_chat_service_create(m, &so, &svc), 0);
    for (int c = 0; c < 2; c++) {
        kvt_chat_opts o = {.max_tokens = MAX_REPLY, .session = c ? "b" : "a", .prefill_checkpoint_stride = stride};
        kvt_chat *chat = NULL;
        assert_int_equal(kvt_chat_create(m, tok, svc, &o, &chat), 0);
        for (int t = 0; t < TURNS; t++) {
            const int32_t *ids = NULL;
            int64_t n = 0;
            int rc = kvt_chat_turn(chat, (c ? conv_b : conv_a)[t], NULL, &ids, &n, &r->st[c][t]);
            if (rc)
                print_message("turn: %s\n", kvt_last_error());
            assert_int_equal(rc, 0);
            assert_true(n <= MAX_REPLY);
            memcpy(r->reply[c][t], ids, (size_t)n * sizeof *ids);
            r->n_reply[c][t] = n;
        }
        kvt_chat_free(chat);
        if (c == 0)
            assert_int_equal(kvt_service_get_stats(svc, &r->after_a), 0);
    }
    assert_int_equal(kvt_service_get_stats(svc, &r->rep), 0);
    assert_true(r->rep.bytes <= r->rep.max_bytes || pc_bytes == 0);
    kvt_service_destroy(svc);
}

static void assert_same_replies(const two_convs *a, const two_convs *b)
{
    for (int c = 0; c < 2; c++)
        for (int t = 0; t < TURNS; t++) {
            assert_int_equal(a->n_reply[c][t], b->n_reply[c][t]);
            assert_memory_equal(a->reply[c][t], b->reply[c][t], (size_t)a->n_reply[c][t] * sizeof(int32_t));
        }
}

/* ---- in RAM: one service, two conversations ---------------------------------------------- */

static void test_shared_start_in_ram(void **state)
{
    (void)state;
    kvt_tokenizer *tok = NULL;
    assert_int_equal(kvt_tokenizer_load(tok_path, VOCAB, &tok), 0);
    int64_t shared = shared_tokens(tok);
    print_message("  the first turns share %lld tokens\n", (long long)shared);
    assert_true(shared > 200);
    two_convs *off = calloc(1, sizeof *off), *on = calloc(1, sizeof *on), *none = calloc(1, sizeof *none);
    assert_non_null(off);
    assert_non_null(on);
    assert_non_null(none);
    for (int k = 0; k < M_COUNT; k++) {
        kvt_model *m = NULL;
        assert_int_equal(kvt_model_load(model_path[k], &m), 0);
        run_two(m, tok, 0, 0, off);                 /* cache off: the reference */
        run_two(m, tok, 64u << 20, -1, none);       /* checkpoints off */
        run_two(m, tok, 64u << 20, 0, on);          /* default stride: the block size */
        int64_t want = shared / BLOCK * BLOCK;
        print_message("  %-9s: B's first turn reuses %lld of %lld tokens with checkpoints, %lld without "
                      "(shared %lld, want >= %lld)\n", model_name[k], (long long)on->st[1][0].reused_tokens,
                      (long long)on->st[1][0].prompt_tokens, (long long)none->st[1][0].reused_tokens,
                      (long long)shared, (long long)want);
        assert_same_replies(on, off);
        assert_same_replies(none, off);
        assert_true(on->st[1][0].reused_tokens >= want);
        assert_true(on->st[1][0].reused_tokens <= shared);
        /* later turns still reuse their whole previous prompt */
        for (int c = 0; c < 2; c++)
            assert_true(on->st[c][1].reused_tokens >= on->st[c][0].prompt_tokens);
        uint64_t ckpts = on->after_a.publishes - none->after_a.publishes;
        if (k == M_PLAIN) {
            /* every entry of a plain model can be cut back: no checkpoint */
            assert_int_equal(ckpts, 0);
            assert_int_equal(on->rep.bytes, none->rep.bytes);
        } else {
            /* one per block boundary b of each of A's prompts, reused < b < n - 1 */
            uint64_t expect = 0;
            for (int t = 0; t < TURNS; t++)
                expect += (uint64_t)((on->st[0][t].prompt_tokens - 2) / BLOCK - on->st[0][t].reused_tokens / BLOCK);
            assert_int_equal(ckpts, expect);
            /* the budget counts the kv blocks a checkpoint shares once: it
             * adds only its ring and recurrent state (plus small structs) */
            uint64_t per = (on->after_a.bytes - none->after_a.bytes) / ckpts;
            size_t fixed = kvt_model_fixed_state_bytes(m);
            print_message("  %-9s: %llu checkpoints in A's two turns, %llu bytes each (fixed state %zu, "
                          "kv of %lld tokens %zu)\n", model_name[k], (unsigned long long)ckpts,
                          (unsigned long long)per, fixed, (long long)shared,
                          (size_t)shared * kvt_model_kv_bytes_per_token(m));
            assert_true(per <= fixed + 1024);
        }
        kvt_model_free(m);
    }

    /* a stride that is not a multiple of the block size; a budget that holds
     * a few entries only (checkpoints are evicted like any entry) */
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(model_path[M_HYBRID], &m), 0);
    run_two(m, tok, 0, 0, off);
    run_two(m, tok, 64u << 20, 7, on);
    print_message("  hybrid, stride 7: B's first turn reuses %lld\n", (long long)on->st[1][0].reused_tokens);
    assert_same_replies(on, off);
    assert_true(on->st[1][0].reused_tokens >= shared / 7 * 7);
    uint64_t small = 3 * (kvt_model_fixed_state_bytes(m) + 300 * kvt_model_kv_bytes_per_token(m));
    run_two(m, tok, small, 0, on);
    print_message("  hybrid, budget %llu bytes: %llu evictions, %llu bytes held\n", (unsigned long long)small,
                  (unsigned long long)on->rep.evictions, (unsigned long long)on->rep.bytes);
    assert_same_replies(on, off);
    assert_true(on->rep.evictions > 0);
    assert_true(on->rep.bytes <= small);
    kvt_model_free(m);
    kvt_tokenizer_free(tok);
    free(off);
    free(on);
    free(none);
}

/* ---- after a restart: two `kvtier chat` processes on one --ssd-cache --------------------- */

static int run_cli(const char *args, const char *out_path, const char *err_path)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' chat %s >'%s' 2>'%s'", getenv("KVT_BIN"), args, out_path, err_path);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *buf = calloc(1, 1 << 16);
    assert_non_null(buf);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Reused tokens of turn 1 in a chat's stderr. */
static long long turn1_reused(const char *err_path)
{
    char *e = slurp(err_path);
    long long r = -1, p = -1;
    int got = sscanf(e, "turn 1: reused %lld tokens, prefilled %lld tokens", &r, &p);
    if (got != 2)
        print_message("stderr: %s\n", e);
    assert_int_equal(got, 2);
    free(e);
    return r;
}

static void write_script(const char *path, const char *const *lines)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int t = 0; t < TURNS; t++)
        fprintf(f, "%s\n", lines[t]);
    assert_int_equal(fclose(f), 0);
}

/* Conversation A in one process, then B in a new process on the same SSD
 * directory; returns B's first-turn reuse and checks B's replies against
 * the cache-off output in ref_out. */
static long long restart_reuse(int k, const char *flags, const char *ref_out)
{
    char a[400], b[400], ssd[400], out[400], err[400], args[4096], cmd[600];
    snprintf(a, sizeof a, "%s/a.txt", dir);
    snprintf(b, sizeof b, "%s/b.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/ssd-%s", dir, model_name[k]);
    snprintf(out, sizeof out, "%s/out.txt", dir);
    snprintf(err, sizeof err, "%s/err.txt", dir);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ssd);
    assert_int_equal(system(cmd), 0);
    const char *script[2] = {a, b};
    long long reused = -1;
    for (int c = 0; c < 2; c++) {
        snprintf(args, sizeof args,
                 "--model '%s' --tokenizer '%s' --script '%s' --max-tokens %d --block-tokens %d --ssd-cache '%s' %s",
                 model_path[k], tok_path, script[c], MAX_REPLY, BLOCK, ssd, flags);
        assert_int_equal(run_cli(args, out, err), 0);
        if (c == 1) {
            reused = turn1_reused(err);
            char *o = slurp(out), *r = slurp(ref_out);
            assert_string_equal(o, r); /* the replies of a cache-off run */
            free(o);
            free(r);
        }
    }
    assert_int_equal(system(cmd), 0);
    return reused;
}

static void test_shared_start_after_restart(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN")) {
        print_message("skipping: KVT_BIN is not set (ctest sets it to the kvtier binary)\n");
        skip();
    }
    kvt_tokenizer *tok = NULL;
    assert_int_equal(kvt_tokenizer_load(tok_path, VOCAB, &tok), 0);
    int64_t shared = shared_tokens(tok);
    kvt_tokenizer_free(tok);
    char a[400], b[400], ref[400], err[400], args[4096];
    snprintf(a, sizeof a, "%s/a.txt", dir);
    snprintf(b, sizeof b, "%s/b.txt", dir);
    snprintf(ref, sizeof ref, "%s/ref.txt", dir);
    snprintf(err, sizeof err, "%s/referr.txt", dir);
    write_script(a, conv_a);
    write_script(b, conv_b);
    for (int k = 0; k < M_COUNT; k++) {
        snprintf(args, sizeof args, "--model '%s' --tokenizer '%s' --script '%s' --max-tokens %d --prompt-cache 0",
                 model_path[k], tok_path, b, MAX_REPLY);
        assert_int_equal(run_cli(args, ref, err), 0);
        long long with = restart_reuse(k, "", ref);
        long long without = restart_reuse(k, "--prefill-checkpoint-stride 0", ref);
        print_message("  %-9s: after a restart B's first turn reuses %lld tokens with checkpoints, %lld with "
                      "--prefill-checkpoint-stride 0 (shared %lld)\n", model_name[k], with, without,
                      (long long)shared);
        assert_true(with >= shared / BLOCK * BLOCK);
        assert_true(with <= shared);
        if (k == M_PLAIN)
            assert_int_equal(without, with); /* a plain model needs none */
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shared_start_in_ram),
        cmocka_unit_test(test_shared_start_after_restart),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
