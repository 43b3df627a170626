/*
 * test_chat.c: the main job end to end (engine/chat.h over the cache
 * service): a scripted multi-turn chat gives token-for-token the same greedy
 * replies with the prompt cache as without it, on stories260K (skipped with
 * a message when KVT_SHARED_DIR is absent) and on small synthetic models
 * with plain, sliding-window (short window: the ring wraps), recurrent and
 * mixed layers, while later turns prefill only their new tokens. Also: the
 * drift case (the reply re-sent as text re-encodes to other tokens; on a
 * wrapped window model the turn still reuses the whole previous prompt via
 * the prompt-boundary snapshot), exact repeats (reused = len - 1 on every
 * kind), an evicted and re-admitted conversation under a tiny budget, the
 * chat template and script parsing, and admission errors.
 *
 * KVT_TEST_KV_SCHEME (f32, f16, bf16, q8; ctest runs test_chat_f16, _bf16
 * and _q8 beside this default run) sets the KV storage scheme of every
 * model loaded here and adds --kv-dtype to every `kvtier chat` run: cached
 * == uncached token for token, restart from SSD included, in each scheme.
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
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- fixtures: synthetic models and a tokenizer with merges ------------------------ */

#define VOCAB 320
static char dir[256];
static char tok_path[300];

enum { M_PLAIN, M_WINDOW, M_RECURRENT, M_HYBRID, M_COUNT };
static const char *const model_name[M_COUNT] = {"plain", "window", "recurrent", "hybrid"};
static char model_path[M_COUNT][300];
#define WINDOW 12

/* A llama2.c tokenizer: <unk>, BOS, EOS, 256 byte pieces, then merges of
 * frequent English pairs (so re-encoding generated text can merge tokens the
 * model emitted apart: drift). */
static void write_tokenizer(const char *path)
{
    static const char *const merges[] = {
        " t", "th", "he", "in", "er", "an", " a", "re", "on", "at", "en", "nd", "ti", "es", "or",
        "te", "of", "ed", "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou",
        "io", "le", "ve", "co", "me", "de", "hi", "ri", "ro", "ic", "ne", "ea", "ra", "ce", "li",
        "ch", "ll", "be", "ma", "si", "om", "ur", " the", "the", "ing", "and", " s", " w", " b", "Us",
        "er:"};
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    int32_t max_len = 6;
    fwrite(&max_len, 4, 1, f);
    for (int id = 0; id < VOCAB; id++) {
        char piece[16];
        float score = 0.0f;
        if (id == 0)
            strcpy(piece, "<unk>");
        else if (id == 1)
            strcpy(piece, "\n<s>\n");
        else if (id == 2)
            strcpy(piece, "\n</s>\n");
        else if (id < 259)
            snprintf(piece, sizeof piece, "<0x%02X>", id - 3);
        else {
            assert_true(id - 259 < (int)(sizeof merges / sizeof *merges));
            strcpy(piece, merges[id - 259]);
            score = -(float)(id - 259);
        }
        int32_t len = (int32_t)strlen(piece);
        fwrite(&score, 4, 1, f);
        fwrite(&len, 4, 1, f);
        fwrite(piece, 1, (size_t)len, f);
    }
    assert_int_equal(fclose(f), 0);
}

static int group_setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_chat_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(tok_path, sizeof tok_path, "%s/tok.bin", dir);
    write_tokenizer(tok_path);
    for (int i = 0; i < M_COUNT; i++) {
        snprintf(model_path[i], sizeof model_path[i], "%s/%s.bin", dir, model_name[i]);
        su_synth(i, model_path[i], VOCAB, 1024, 7, WINDOW);
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    unlink(tok_path);
    for (int i = 0; i < M_COUNT; i++)
        unlink(model_path[i]);
    rmdir(dir);
    return 0;
}

/* ---- running a conversation ------------------------------------------------------------ */

#define MAX_TURNS 8
#define MAX_REPLY 16

typedef struct {
    int n_turns;
    int64_t reply[MAX_TURNS][MAX_REPLY];
    int64_t n_reply[MAX_TURNS];
    int64_t n_prompt[MAX_TURNS];
    int32_t prompt[MAX_TURNS][2048]; /* each turn's prompt ids */
    kvt_turn_stats st[MAX_TURNS];
    kvt_service_stats rep;
} run_result;

typedef struct {
    kvt_model *m;
    kvt_tokenizer *tok;
} loaded;

/* The scheme under test (KVT_TEST_KV_SCHEME), "" for the default. */
static const char *test_scheme(void)
{
    const char *s = getenv("KVT_TEST_KV_SCHEME");
    return s ? s : "";
}

static loaded load(const char *mp, const char *tp)
{
    loaded l = {0};
    int rc = kvt_chat_load(mp, tp, &l.m, &l.tok);
    if (rc)
        print_message("load %s: %s\n", mp, kvt_last_error());
    assert_int_equal(rc, 0);
    kvt_kv_scheme ks = KVT_KV_F32;
    if (*test_scheme())
        assert_int_equal(kvt_kv_scheme_parse(test_scheme(), &ks), 0);
    assert_int_equal(kvt_model_set_kv_scheme(l.m, ks), 0);
    return l;
}

static void unload(loaded *l)
{
    kvt_tokenizer_free(l->tok);
    kvt_model_free(l->m);
}

/* Bytes the chat service projects for `tokens` tokens of one attention
 * layer in blocks of B: whole blocks of the scheme's row bytes (under q8
 * codes with 16 * kv_dim bytes of scales each), plus, in every scheme but
 * f32 (the qkvc kind: sealed blocks), the f32 open block. */
static uint64_t attn_projection(const kvt_model *m, int64_t tokens, int32_t B)
{
    uint64_t t = (uint64_t)((tokens + B - 1) / B * B), kv = (uint64_t)kvt_model_get_config(m)->kv_dim;
    if (kvt_model_kv_scheme(m) == KVT_KV_Q8)
        return t * (2 * kv + (16 * kv + (uint64_t)B - 1) / (uint64_t)B) + 8 * kv * (uint64_t)B;
    if (kvt_model_kv_scheme(m) != KVT_KV_F32)
        return t * kvt_model_kv_row_bytes(m) + 8 * kv * (uint64_t)B;
    return t * kvt_model_kv_row_bytes(m);
}

static kvt_service *service(const loaded *l, uint64_t pc_bytes, int32_t block)
{
    kvt_chat_service_opts so = {.prompt_cache_bytes = pc_bytes, .block_tokens = block};
    kvt_service *svc = NULL;
    assert_int_equal(kvt_chat_service_create(l->m, &so, &svc), 0);
    return svc;
}

/* Runs turns [0, n) of `script` in chat `c`, recording into r. */
static void chat_turns(kvt_chat *c, const char *const *script, int from, int n, run_result *r)
{
    for (int t = from; t < n; t++) {
        const char *reply = NULL;
        const int32_t *ids = NULL;
        int64_t n_ids = 0;
        int rc = kvt_chat_turn(c, script[t], &reply, &ids, &n_ids, &r->st[t]);
        if (rc)
            print_message("turn %d: %s\n", t + 1, kvt_last_error());
        assert_int_equal(rc, 0);
        assert_non_null(reply);
        assert_true(n_ids <= MAX_REPLY);
        r->n_reply[t] = n_ids;
        for (int64_t i = 0; i < n_ids; i++)
            r->reply[t][i] = ids[i];
        int64_t np = 0;
        const int32_t *p = kvt_chat_last_prompt(c, &np);
        assert_true(np <= 2048);
        r->n_prompt[t] = np;
        memcpy(r->prompt[t], p, (size_t)np * sizeof *p);
        /* accounting: every prompt token is either reused or prefilled */
        assert_int_equal(r->st[t].reused_tokens + r->st[t].prefilled_tokens, np);
        assert_int_equal(r->st[t].prompt_tokens, np);
    }
    r->n_turns = n;
}

static run_result *run_chat(const loaded *l, const char *const *script, int n, uint64_t pc_bytes, int32_t block)
{
    run_result *r = calloc(1, sizeof *r);
    assert_non_null(r);
    kvt_service *svc = service(l, pc_bytes, block);
    kvt_chat_opts o = {.max_tokens = MAX_REPLY, .session = "s"};
    kvt_chat *c = NULL;
    assert_int_equal(kvt_chat_create(l->m, l->tok, svc, &o, &c), 0);
    chat_turns(c, script, 0, n, r);
    kvt_service_get_stats(svc, &r->rep);
    kvt_chat_free(c);
    assert_int_equal(kvt_service_close(svc), 0);
    kvt_service_destroy(svc);
    return r;
}

static void assert_same_replies(const run_result *a, const run_result *b)
{
    assert_int_equal(a->n_turns, b->n_turns);
    for (int t = 0; t < a->n_turns; t++) {
        assert_int_equal(a->n_prompt[t], b->n_prompt[t]);
        assert_memory_equal(a->prompt[t], b->prompt[t], (size_t)a->n_prompt[t] * sizeof(int32_t));
        assert_int_equal(a->n_reply[t], b->n_reply[t]);
        for (int64_t i = 0; i < a->n_reply[t]; i++)
            assert_int_equal(a->reply[t][i], b->reply[t][i]);
    }
}

static const char *const script5[] = {
    "Hello there, who are you?",
    "Tell me a story about the sea.",
    "And then what happened?",
    "Was it a happy ending?",
    "Thanks, that is all.",
};

/* Same replies with the cache on and off; turns 2.. reuse and prefill only
 * what is new (at most the new text plus the drifted reply). */
static void check_invariant(const loaded *l, int32_t block)
{
    run_result *off = run_chat(l, script5, 5, 0, block);
    run_result *on = run_chat(l, script5, 5, 64u << 20, block);
    assert_same_replies(on, off);
    for (int t = 0; t < 5; t++)
        assert_int_equal(off->st[t].reused_tokens, 0);
    assert_int_equal(on->st[0].reused_tokens, 0);
    int64_t total_on = 0, total_off = 0;
    for (int t = 1; t < 5; t++) {
        /* at least the whole previous prompt minus nothing: the boundary
         * snapshot is a prefix of the next turn whatever the reply drift */
        assert_true(on->st[t].reused_tokens >= on->n_prompt[t - 1]);
        assert_true(on->st[t].prefilled_tokens < off->st[t].prefilled_tokens);
        total_on += on->st[t].prefilled_tokens;
        total_off += off->st[t].prefilled_tokens;
    }
    print_message("  prefilled tokens in turns 2-5: %lld with the cache, %lld without\n", (long long)total_on,
                  (long long)total_off);
    assert_true(on->rep.hits >= 4);
    free(on);
    free(off);
}

static void test_invariant_plain(void **state)
{
    (void)state;
    loaded l = load(model_path[M_PLAIN], tok_path);
    check_invariant(&l, 16);
    check_invariant(&l, 256);
    unload(&l);
}

static void test_invariant_window(void **state)
{
    (void)state;
    loaded l = load(model_path[M_WINDOW], tok_path);
    check_invariant(&l, 16);
    unload(&l);
}

static void test_invariant_recurrent(void **state)
{
    (void)state;
    loaded l = load(model_path[M_RECURRENT], tok_path);
    check_invariant(&l, 16);
    unload(&l);
}

static void test_invariant_hybrid(void **state)
{
    (void)state;
    loaded l = load(model_path[M_HYBRID], tok_path);
    check_invariant(&l, 7);
    unload(&l);
}

static void test_invariant_stories260k(void **state)
{
    (void)state;
    const char *shared = getenv("KVT_SHARED_DIR");
    if (!shared) {
        print_message("skipping: KVT_SHARED_DIR is not set (ctest sets it to <source>/../shared)\n");
        skip();
    }
    char mp[1024], tp[1024];
    snprintf(mp, sizeof mp, "%s/data/models/stories260K.bin", shared);
    snprintf(tp, sizeof tp, "%s/data/models/tok512.bin", shared);
    if (access(mp, R_OK) || access(tp, R_OK)) {
        print_message("skipping: %s or %s is missing\n", mp, tp);
        skip();
    }
    loaded l = load(mp, tp);
    check_invariant(&l, 256);
    check_invariant(&l, 16);
    unload(&l);
}

/* A kv block larger than the model's positions is never filled: it is
 * capped at seq_len (a --block-tokens 1048576 chat of 18 tokens held 1.3 GB
 * of blocks, and projected a million tokens of KV per request). */
static void test_block_tokens_capped(void **state)
{
    (void)state;
    loaded l = load(model_path[M_PLAIN], tok_path);
    const kvt_model_config *c = kvt_model_get_config(l.m);
    kvt_cache *caches[8];
    assert_true(c->n_layers <= 8);
    assert_int_equal(kvt_model_new_caches(l.m, 1 << 20, caches), 0);
    assert_int_equal(kvt_kv_block_tokens(caches[0]), c->seq_len);
    kvt_caches_destroy(caches, c->n_layers);
    assert_int_equal(kvt_model_new_caches(l.m, 16, caches), 0);
    assert_int_equal(kvt_kv_block_tokens(caches[0]), 16); /* smaller ones stay */
    kvt_caches_destroy(caches, c->n_layers);
    kvt_service *svc = service(&l, 1 << 20, 1 << 20);
    assert_int_equal(kvt_service_project_bytes(svc, 10),
                     (uint64_t)c->n_layers * attn_projection(l.m, 10, c->seq_len)); /* one whole block */
    if (kvt_model_kv_scheme(l.m) != KVT_KV_Q8) /* f16, bf16: the f32 open block on top */
        assert_int_equal(attn_projection(l.m, 10, c->seq_len) * c->n_layers,
                         (uint64_t)c->seq_len * kvt_model_kv_bytes_per_token(l.m) +
                             (kvt_model_kv_scheme(l.m) == KVT_KV_F32
                                  ? 0
                                  : (uint64_t)c->n_layers * 2 * sizeof(float) * (uint64_t)c->kv_dim * c->seq_len));
    kvt_service_destroy(svc);
    unload(&l);
}

/* ---- drift on a wrapped sliding window ------------------------------------------------- */

static void test_drift_window(void **state)
{
    (void)state;
    loaded l = load(model_path[M_WINDOW], tok_path);
    run_result *off = run_chat(&l, script5, 3, 0, 16);
    run_result *on = run_chat(&l, script5, 3, 64u << 20, 16);
    assert_same_replies(on, off);
    int drifted = 0;
    for (int t = 1; t < 3; t++) {
        int64_t n1 = on->n_prompt[t - 1];
        assert_true(n1 > WINDOW); /* the ring wrapped during the previous prompt */
        /* the previous prompt's tokens are a prefix of this prompt */
        assert_memory_equal(on->prompt[t], on->prompt[t - 1], (size_t)n1 * sizeof(int32_t));
        /* drift: the reply re-sent as text re-encodes to other tokens */
        int same = 1;
        for (int64_t i = 0; i < on->n_reply[t - 1]; i++)
            same &= on->prompt[t][n1 + i] == on->reply[t - 1][i];
        if (!same) {
            drifted++;
            /* the generated tokens are not a prefix, the wrapped ring cannot be
             * cut back: only the prompt-boundary snapshot serves, whole */
            assert_int_equal(on->st[t].reused_tokens, n1);
        }
    }
    print_message("  turns with drift: %d of 2\n", drifted);
    assert_true(drifted >= 1);
    free(on);
    free(off);
    unload(&l);
}

/* ---- exact repeat ------------------------------------------------------------------ */

static void exact_repeat(const char *mp, const char *tp)
{
    loaded l = load(mp, tp);
    kvt_service *svc = service(&l, 64u << 20, 16);
    kvt_sampler *s = NULL;
    assert_int_equal(kvt_sampler_create(VOCAB, 0.0f, 0.9f, 1, &s), 0);
    int32_t prompt[40];
    for (int i = 0; i < 40; i++)
        prompt[i] = 3 + (i * 37) % (VOCAB - 3);
    prompt[0] = KVT_TOKEN_BOS;
    kvt_gen_opts o = {.max_tokens = 8, .admit_timeout_ms = -1};
    int32_t r1[8], r2[8];
    int64_t n1 = 0, n2 = 0;
    kvt_turn_stats st;
    assert_int_equal(kvt_chat_generate(l.m, svc, s, prompt, 40, &o, r1, 8, &n1, &st), 0);
    assert_int_equal(st.reused_tokens, 0);
    assert_int_equal(kvt_chat_generate(l.m, svc, s, prompt, 40, &o, r2, 8, &n2, &st), 0);
    assert_int_equal(st.reused_tokens, 39);
    assert_int_equal(st.prefilled_tokens, 1);
    assert_int_equal(n1, n2);
    assert_memory_equal(r1, r2, (size_t)n1 * sizeof(int32_t));
    kvt_sampler_free(s);
    kvt_service_destroy(svc);
    unload(&l);
}

static void test_exact_repeat_every_kind(void **state)
{
    (void)state;
    for (int i = 0; i < M_COUNT; i++) {
        print_message("  %s\n", model_name[i]);
        exact_repeat(model_path[i], tok_path);
    }
}

/* ---- eviction under a tiny budget --------------------------------------------------------- */

static const char *const script_b[] = {
    "Where do birds go in winter?",
    "How far can they fly?",
    "Do they come back?",
    "Which ones stay?",
};

static void test_evicted_conversation(void **state)
{
    (void)state;
    for (int k = M_PLAIN; k <= M_HYBRID; k += M_HYBRID - M_PLAIN) {
        loaded l = load(model_path[k], tok_path);
        run_result *off_a = run_chat(&l, script5, 4, 0, 16);
        run_result *off_b = run_chat(&l, script_b, 4, 0, 16);
        /* A budget that holds about one conversation: A and B evict each other. */
        uint64_t budget = 3 * attn_projection(l.m, 112, 16); /* 112 tokens of kv on 3 layers (f32: 2 * 16 * 4 bytes a row) */
        kvt_service *svc = service(&l, budget, 16);
        kvt_chat_opts oa = {.max_tokens = MAX_REPLY, .session = "a"};
        kvt_chat_opts ob = {.max_tokens = MAX_REPLY, .session = "b"};
        kvt_chat *a = NULL, *b = NULL;
        assert_int_equal(kvt_chat_create(l.m, l.tok, svc, &oa, &a), 0);
        assert_int_equal(kvt_chat_create(l.m, l.tok, svc, &ob, &b), 0);
        run_result *ra = calloc(1, sizeof *ra), *rb = calloc(1, sizeof *rb);
        for (int t = 0; t < 4; t++) {
            chat_turns(a, script5, t, t + 1, ra);
            chat_turns(b, script_b, t, t + 1, rb);
        }
        kvt_service_stats rep;
        kvt_service_get_stats(svc, &rep);
        print_message("  %s: evictions %llu, entries %llu, bytes %llu of %llu\n", model_name[k],
                      (unsigned long long)rep.evictions, (unsigned long long)rep.entries,
                      (unsigned long long)rep.bytes, (unsigned long long)rep.max_bytes);
        assert_true(rep.evictions > 0);
        assert_true(rep.bytes <= budget);
        /* A was evicted at least once: some turn reused less than its whole
         * previous prompt; outputs are still those of the cache-off run. */
        int short_reuse = 0;
        for (int t = 1; t < 4; t++)
            short_reuse |= ra->st[t].reused_tokens < ra->n_prompt[t - 1];
        assert_true(short_reuse);
        assert_same_replies(ra, off_a);
        assert_same_replies(rb, off_b);
        kvt_chat_free(a);
        kvt_chat_free(b);
        kvt_service_destroy(svc);
        free(ra);
        free(rb);
        free(off_a);
        free(off_b);
        unload(&l);
    }
}

/* ---- template, script, admission ---------------------------------------------------- */

static void test_template_and_script(void **state)
{
    (void)state;
    const char *user[] = {"Hi", "More"};
    const char *reply[] = {" Hello."};
    char *text = NULL;
    assert_int_equal(kvt_chat_render(user, reply, 2, &text), 0);
    assert_string_equal(text, "User: Hi\nAssistant: Hello.\nUser: More\nAssistant:");
    free(text);
    assert_int_equal(kvt_chat_render(user, reply, 1, &text), 0);
    assert_string_equal(text, "User: Hi\nAssistant:");
    free(text);
    assert_int_equal(kvt_chat_render(user, NULL, 2, &text), KVT_EINVAL);
    assert_int_equal(kvt_chat_render(user, reply, 0, &text), KVT_EINVAL);

    char **lines = NULL;
    int32_t n = 0;
    assert_int_equal(kvt_chat_script_parse("first  \r\n\n# comment\n  second\nthird", &lines, &n), 0);
    assert_int_equal(n, 3);
    assert_string_equal(lines[0], "first");
    assert_string_equal(lines[1], "  second");
    assert_string_equal(lines[2], "third");
    kvt_chat_script_free(lines, n);
    assert_int_equal(kvt_chat_script_parse("", &lines, &n), 0);
    assert_int_equal(n, 0);
    kvt_chat_script_free(lines, n);
    assert_true(kvt_chat_script_load("/nonexistent/script.txt", &lines, &n) < 0);
    assert_non_null(strstr(kvt_last_error(), "/nonexistent/script.txt"));

    uint64_t b = 0;
    assert_int_equal(kvt_chat_parse_bytes("x", "512M", &b), 0);
    assert_int_equal(b, 512ull << 20);
    assert_int_equal(kvt_chat_parse_bytes("x", "2GiB", &b), 0);
    assert_int_equal(b, 2ull << 30);
    assert_int_equal(kvt_chat_parse_bytes("x", "0", &b), 0);
    assert_int_equal(b, 0);
    assert_int_equal(kvt_chat_parse_bytes("x", "12Q", &b), KVT_EINVAL);
    assert_int_equal(kvt_chat_parse_bytes("x", "-1", &b), KVT_EINVAL);
}

static void test_admission_errors(void **state)
{
    (void)state;
    loaded l = load(model_path[M_PLAIN], tok_path);
    kvt_chat_service_opts so = {.prompt_cache_bytes = 1 << 20, .kv_budget_bytes = 1000, .block_tokens = 16};
    kvt_service *svc = NULL;
    assert_int_equal(kvt_chat_service_create(l.m, &so, &svc), 0);
    kvt_sampler *s = NULL;
    assert_int_equal(kvt_sampler_create(VOCAB, 0.0f, 0.9f, 1, &s), 0);
    int32_t prompt[8] = {1, 40, 41, 42, 43, 44, 45, 46};
    int32_t r[4];
    int64_t n = 0;
    kvt_gen_opts o = {.max_tokens = 4};
    /* 12 tokens round up to one block of 16: 3 layers * 16 * 2 * 16 * 4 bytes
     * in f32 (6144), 3 * 16 * the row bytes of the scheme under test */
    assert_int_equal(kvt_chat_generate(l.m, svc, s, prompt, 8, &o, r, 4, &n, NULL), KVT_ELIMIT);
    char needs[64];
    snprintf(needs, sizeof needs, "needs %llu bytes", (unsigned long long)(3 * attn_projection(l.m, 12, 16)));
    if (!*test_scheme())
        assert_string_equal(needs, "needs 6144 bytes");
    assert_non_null(strstr(kvt_last_error(), needs));
    kvt_service_destroy(svc);
    kvt_sampler_free(s);
    unload(&l);
}

/* ---- the command: stderr format, cache off, restart from the SSD tier ------------------ */

/* Runs `kvtier chat ARGS` with stdout to out_path and stderr to err_path; returns the exit status. */
static int run_cli(const char *args, const char *out_path, const char *err_path)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' chat %s%s%s >'%s' 2>'%s'", getenv("KVT_BIN"), args,
             *test_scheme() ? " --kv-dtype " : "", test_scheme(), out_path, err_path);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *buf = calloc(1, 1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Parses the per-turn stderr lines; returns how many were found. Every line
 * of stderr must be one of them. */
static int parse_turn_lines(const char *err, long long reused[], long long prefilled[], int max)
{
    int n = 0;
    for (const char *p = err; *p;) {
        const char *e = strchr(p, '\n');
        assert_non_null(e);
        int turn = 0;
        long long r = -1, pf = -1;
        double ms = -1;
        int got = sscanf(p, "turn %d: reused %lld tokens, prefilled %lld tokens, ttft %lf ms", &turn, &r, &pf, &ms);
        if (got != 4)
            print_message("unexpected stderr line: %.*s\n", (int)(e - p), p);
        assert_int_equal(got, 4);
        assert_int_equal(turn, n + 1);
        assert_true(ms >= 0);
        assert_true(n < max);
        reused[n] = r;
        prefilled[n] = pf;
        n++;
        p = e + 1;
    }
    return n;
}

/* Names three output/error file pairs "<tag>out<i>.txt" and runs the
 * cache-off baseline of `script` on `model` into pair 0. */
static void cli_baseline(const char *model, const char *tok, const char *script, const char *tag, char out[3][400],
                         char err[3][400])
{
    for (int i = 0; i < 3; i++) {
        snprintf(out[i], 400, "%s/%sout%d.txt", dir, tag, i);
        snprintf(err[i], 400, "%s/%serr%d.txt", dir, tag, i);
    }
    char args[2048];
    snprintf(args, sizeof args, "--model '%s' --tokenizer '%s' --script '%s' --max-tokens 12 --prompt-cache 0",
             model, tok, script);
    assert_int_equal(run_cli(args, out[0], err[0]), 0);
}

/* A restart on the same --ssd-cache: every turn reuses all but one token.
 * On the plain model the session's entry (prompt + reply, a strict prefix of
 * the next prompt) is resident but shorter than the next prompt-boundary
 * snapshot on disk: the cold tier must still be asked (DESIGN.md 3.4). */
static void cli_restart_from_ssd(const char *model, const char *tok, const char *name)
{
    char script[400], ssd[400], out[3][400], err[3][400], args[2048];
    snprintf(script, sizeof script, "%s/script.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/ssd", dir);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs("# a comment line\nHello there, who are you?\n\nTell me a story about the sea.\nAnd then?\n", f);
    fclose(f);
    /* 0: cache off; 1: first run with the SSD tier; 2: a new process on the same directory */
    cli_baseline(model, tok, script, "", out, err);
    for (int i = 1; i <= 2; i++) {
        snprintf(args, sizeof args,
                 "--model '%s' --tokenizer '%s' --script '%s' --max-tokens 12 --ssd-cache '%s' --ssd-cache-verify",
                 model, tok, script, ssd);
        assert_int_equal(run_cli(args, out[i], err[i]), 0);
    }
    char *o0 = slurp(out[0]), *o1 = slurp(out[1]), *o2 = slurp(out[2]);
    assert_string_equal(o0, o1);
    assert_string_equal(o0, o2);
    long long r[3][8], p[3][8];
    char *e[3];
    for (int i = 0; i < 3; i++) {
        e[i] = slurp(err[i]);
        assert_int_equal(parse_turn_lines(e[i], r[i], p[i], 8), 3);
    }
    for (int t = 0; t < 3; t++) {
        assert_int_equal(r[0][t], 0);
        assert_int_equal(r[0][t] + p[0][t], r[1][t] + p[1][t]); /* same prompts */
        assert_int_equal(r[2][t] + p[2][t], r[0][t] + p[0][t]);
        /* after the restart every turn, even the first, reuses its whole
         * prompt but the last token: the history came back from disk */
        if (p[2][t] != 1)
            fail_msg("%s model, turn %d after the restart: reused %lld, prefilled %lld (want 1)",
                     name, t + 1, r[2][t], p[2][t]);
    }
    assert_int_equal(r[1][0], 0);
    assert_true(r[1][1] > 0);
    free(o0);
    free(o1);
    free(o2);
    for (int i = 0; i < 3; i++) {
        free(e[i]);
        unlink(out[i]);
        unlink(err[i]);
    }
    unlink(script);
    snprintf(args, sizeof args, "rm -rf '%s'", ssd);
    assert_int_equal(system(args), 0);
}

static void test_cli_restart_from_ssd(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN")) {
        print_message("skipping: KVT_BIN is not set (ctest sets it to the kvtier binary)\n");
        skip();
    }
    cli_restart_from_ssd(model_path[M_HYBRID], tok_path, "hybrid");
    /* stories260K: its replies re-encode to the same tokens, so the
     * session's entry is a strict prefix of the next prompt */
    const char *shared = getenv("KVT_SHARED_DIR");
    char mp[1024], tp[1024];
    snprintf(mp, sizeof mp, "%s/data/models/stories260K.bin", shared ? shared : ".");
    snprintf(tp, sizeof tp, "%s/data/models/tok512.bin", shared ? shared : ".");
    if (shared && !access(mp, R_OK) && !access(tp, R_OK))
        cli_restart_from_ssd(mp, tp, "stories260K");
    else
        print_message("stories260K part skipped: %s\n", shared ? "its model or tokenizer is missing"
                                                               : "KVT_SHARED_DIR is not set");
    char script[400], out[1][400], err[1][400], args[2048];
    snprintf(script, sizeof script, "%s/script.txt", dir);
    snprintf(out[0], sizeof out[0], "%s/usage.out", dir);
    snprintf(err[0], sizeof err[0], "%s/usage.err", dir);

    /* usage errors exit 2 with a message */
    snprintf(args, sizeof args, "--ssd-cache-max 1G --script '%s'", script);
    assert_int_equal(run_cli(args, out[0], err[0]), 2);
    snprintf(args, sizeof args, "--prompt-cache lots");
    assert_int_equal(run_cli(args, out[0], err[0]), 2);
    char *msg = slurp(err[0]);
    assert_non_null(strstr(msg, "--prompt-cache"));
    free(msg);
    unlink(out[0]);
    unlink(err[0]);
}

/* One --ssd-cache directory, three processes: f16, then f32, then f16
 * again. The f32 run reuses nothing of the f16 state (its identity differs
 * by the scheme) and replies as a cache-off f32 run; the second f16 run
 * reuses all but one token of every turn. Without the scheme in the identity
 * the f32 run would restore f16 state. */
static void test_cli_scheme_never_serves_another(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN") || *test_scheme()) {
        print_message("skipping: %s\n", *test_scheme() ? "sets its own schemes (runs in the default test_chat)"
                                                        : "KVT_BIN is not set");
        skip();
    }
    char script[400], ssd[400], out[4][400], err[4][400], args[2048];
    snprintf(script, sizeof script, "%s/scheme_script.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/scheme_ssd", dir);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs("Hello there, who are you?\nTell me a story about the sea.\n", f);
    fclose(f);
    static const char *const kinds[4] = {"f16", "f32", "f16", "f32"}; /* the last: f32 cache off */
    long long r[4][4], p[4][4];
    char *o[4];
    for (int i = 0; i < 4; i++) {
        snprintf(out[i], 400, "%s/scheme_out%d.txt", dir, i);
        snprintf(err[i], 400, "%s/scheme_err%d.txt", dir, i);
        if (i < 3)
            snprintf(args, sizeof args, "--model '%s' --tokenizer '%s' --script '%s' --max-tokens 8 --ssd-cache '%s' "
                     "--kv-dtype %s", model_path[M_PLAIN], tok_path, script, ssd, kinds[i]);
        else
            snprintf(args, sizeof args, "--model '%s' --tokenizer '%s' --script '%s' --max-tokens 8 --prompt-cache 0 "
                     "--kv-dtype %s", model_path[M_PLAIN], tok_path, script, kinds[i]);
        assert_int_equal(run_cli(args, out[i], err[i]), 0);
        char *e = slurp(err[i]);
        assert_int_equal(parse_turn_lines(e, r[i], p[i], 4), 2);
        free(e);
        o[i] = slurp(out[i]);
    }
    assert_int_equal(r[1][0], 0); /* f32 found nothing of f16's on the first turn */
    assert_string_equal(o[1], o[3]); /* and replied as f32 without any cache */
    for (int t = 0; t < 2; t++)
        if (p[2][t] != 1)
            fail_msg("the second f16 run, turn %d: reused %lld, prefilled %lld (want 1)", t + 1, r[2][t], p[2][t]);
    assert_string_equal(o[0], o[2]);
    for (int i = 0; i < 4; i++) {
        free(o[i]);
        unlink(out[i]);
        unlink(err[i]);
    }
    unlink(script);
    snprintf(args, sizeof args, "rm -rf '%s'", ssd);
    assert_int_equal(system(args), 0);
}

/* --ssd-cache-max smaller than one prefix: that prefix cannot be kept on
 * disk; the chat says so in a warning and still succeeds (exit 0) with the
 * same replies as a run with no cache (it exited 1 at close before). */
static void test_cli_ssd_budget_below_one_prefix(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN")) {
        print_message("skipping: KVT_BIN is not set (ctest sets it to the kvtier binary)\n");
        skip();
    }
    char script[400], out[2][400], err[2][400], ssd[400], args[2048];
    snprintf(script, sizeof script, "%s/tiny_ssd.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/tiny_ssd", dir);
    for (int i = 0; i < 2; i++) {
        snprintf(out[i], sizeof out[i], "%s/tiny_ssd%d.out", dir, i);
        snprintf(err[i], sizeof err[i], "%s/tiny_ssd%d.err", dir, i);
    }
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs("hello there\nand then?\n", f);
    fclose(f);
    snprintf(args, sizeof args, "--model '%s' --tokenizer '%s' --max-tokens 8 --script '%s' --prompt-cache 0",
             model_path[M_PLAIN], tok_path, script);
    assert_int_equal(run_cli(args, out[0], err[0]), 0);
    snprintf(args, sizeof args,
             "--model '%s' --tokenizer '%s' --max-tokens 8 --script '%s' --ssd-cache '%s' --ssd-cache-max 1000",
             model_path[M_PLAIN], tok_path, script, ssd);
    assert_int_equal(run_cli(args, out[1], err[1]), 0);
    char *o0 = slurp(out[0]), *o1 = slurp(out[1]), *e1 = slurp(err[1]);
    assert_string_equal(o0, o1);
    assert_non_null(strstr(e1, "warning: a prefix larger than --ssd-cache-max"));
    assert_non_null(strstr(e1, "the budget is 1000"));
    free(o0);
    free(o1);
    free(e1);
    for (int i = 0; i < 2; i++) {
        unlink(out[i]);
        unlink(err[i]);
    }
    unlink(script);
    snprintf(args, sizeof args, "rm -rf '%s'", ssd);
    assert_int_equal(system(args), 0);
}

/* Ctrl-C (SIGINT) or SIGTERM ends an interactive chat like end of input: the
 * running turn finishes, the prompt cache is written to --ssd-cache, exit 0,
 * so the next process reuses the conversation (it was killed, losing it). */
static void test_cli_interrupt_saves(void **state)
{
    (void)state;
    const char *bin = getenv("KVT_BIN");
    if (!bin) {
        print_message("skipping: KVT_BIN is not set (ctest sets it to the kvtier binary)\n");
        skip();
    }
    char ssd[400], err[400], script[400], args[2048], out[400];
    snprintf(ssd, sizeof ssd, "%s/ssd_int", dir);
    snprintf(err, sizeof err, "%s/int.err", dir);
    snprintf(out, sizeof out, "%s/int.out", dir);
    snprintf(script, sizeof script, "%s/int.txt", dir);
    const int sigs[] = {SIGINT, SIGTERM};
    for (int k = 0; k < 2; k++) {
        /* Empty the stderr file before the child exists: the poll below must
         * not see the "turn 1:" line an earlier run left in it and signal a
         * child that has not installed its handler yet. */
        int t = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        assert_true(t >= 0);
        close(t);
        int fds[2];
        assert_int_equal(pipe(fds), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            int e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644), o = open("/dev/null", O_WRONLY);
            if (e < 0 || o < 0 || dup2(fds[0], 0) < 0 || dup2(e, 2) < 0 || dup2(o, 1) < 0)
                _exit(120);
            close(fds[1]);
            /* the scheme under test, as run_cli passes it (another scheme's state never serves) */
            const char *ks = *test_scheme() ? "--kv-dtype" : NULL;
            execl(bin, bin, "chat", "--model", model_path[M_PLAIN], "--tokenizer", tok_path, "--max-tokens", "6",
                  "--ssd-cache", ssd, ks, test_scheme(), (char *)NULL);
            _exit(121);
        }
        close(fds[0]);
        const char *msg = "Hello there, who are you?\n";
        assert_int_equal(write(fds[1], msg, strlen(msg)), (ssize_t)strlen(msg));
        int seen = 0;
        for (int i = 0; i < 1200 && !seen; i++) { /* up to 60 s for the first turn */
            usleep(50000);
            char *e = slurp(err);
            seen = strstr(e, "turn 1:") != NULL;
            free(e);
        }
        assert_true(seen);
        assert_int_equal(kill(pid, sigs[k]), 0);
        int st = 0, reaped = 0;
        for (int i = 0; i < 1200 && !reaped; i++) { /* up to 60 s to exit; stdin stays open */
            reaped = waitpid(pid, &st, WNOHANG) == pid;
            if (!reaped)
                usleep(50000);
        }
        if (!reaped) {
            char *e = slurp(err);
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            close(fds[1]);
            fail_msg("signal %d: the chat did not exit within 60 s with its stdin still open; stderr: %s",
                     sigs[k], e);
        }
        close(fds[1]);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            char *e = slurp(err);
            fail_msg("signal %d: %s %d; stderr: %s", sigs[k], WIFEXITED(st) ? "exit" : "killed by",
                     WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), e);
        }
        /* a new process finds the conversation on disk */
        FILE *f = fopen(script, "w");
        assert_non_null(f);
        fputs(msg, f);
        fclose(f);
        snprintf(args, sizeof args, "--model '%s' --tokenizer '%s' --script '%s' --max-tokens 6 --ssd-cache '%s'",
                 model_path[M_PLAIN], tok_path, script, ssd);
        assert_int_equal(run_cli(args, out, err), 0);
        char *e = slurp(err);
        long long r[2], p[2];
        assert_int_equal(parse_turn_lines(e, r, p, 2), 1);
        if (p[0] != 1)
            fail_msg("signal %d: the next process reused %lld, prefilled %lld (want 1)", sigs[k], r[0], p[0]);
        free(e);
        snprintf(args, sizeof args, "rm -rf '%s'", ssd);
        assert_int_equal(system(args), 0);
    }
    unlink(err);
    unlink(out);
    unlink(script);
}

/* Bad input to the CLI: each case exits nonzero with a message naming what
 * is wrong (an empty script, a script that is a directory, stdin closed,
 * --adapter-version without --adapter). */
static void test_cli_bad_input(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN")) {
        print_message("skipping: KVT_BIN is not set (ctest sets it to the kvtier binary)\n");
        skip();
    }
    char script[400], out[400], err[400], args[2048];
    snprintf(script, sizeof script, "%s/only_comments.txt", dir);
    snprintf(out, sizeof out, "%s/bad.out", dir);
    snprintf(err, sizeof err, "%s/bad.err", dir);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs("# nothing but a comment\n\n   \n", f);
    fclose(f);
    char latin1[400], tr[400];
    snprintf(latin1, sizeof latin1, "%s/latin1.txt", dir);
    snprintf(tr, sizeof tr, "%s/latin1.json", dir);
    f = fopen(latin1, "w");
    assert_non_null(f);
    fputs("caf\xe9 au lait\n", f); /* Latin-1, not UTF-8 */
    fclose(f);
    char with_tr[1200];
    snprintf(with_tr, sizeof with_tr, "'%s' --transcript '%s'", latin1, tr);
    const char *model = model_path[M_PLAIN];
    struct {
        const char *fmt, *arg, *want;
        int rc;
    } cases[] = {
        {"--model '%s' --tokenizer '%s' --script '%s'", script, "holds no message", 1},
        {"--model '%s' --tokenizer '%s' --script '%s'", dir, "Is a directory", 1},
        {"--model '%s' --tokenizer '%s' %s <&-", "", "cannot read stdin", 1},
        /* a version alone would silently run in the base model's namespace */
        {"--model '%s' --tokenizer '%s' --script '%s' --adapter-version 2", script, "--adapter-version", 2},
        {"--model '%s' --tokenizer '%s' --script '%s' --temperature inf", script, "--temperature", 2},
        /* a transcript is JSON text: refused before the turn runs (was
         * "out of memory" after it) */
        {"--model '%s' --tokenizer '%s' --script %s", with_tr, "not valid UTF-8", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(args, sizeof args, cases[i].fmt, model, tok_path, cases[i].arg);
        assert_int_equal(run_cli(args, out, err), cases[i].rc);
        char *msg = slurp(err);
        if (!strstr(msg, cases[i].want))
            fail_msg("case %zu: stderr lacks '%s': %s", i, cases[i].want, msg);
        free(msg);
    }
    FILE *saved = fopen(tr, "r");
    assert_null(saved); /* nothing ran, nothing saved */
    /* replies that cannot be written are a failure, not a silent success */
    snprintf(args, sizeof args, "--model '%s' --tokenizer '%s' --script '%s' --max-tokens 4", model, tok_path,
             latin1);
    assert_int_equal(run_cli(args, "/dev/full", err), 1);
    char *msg = slurp(err);
    if (!strstr(msg, "stdout"))
        fail_msg("stdout to /dev/full: stderr lacks 'stdout': %s", msg);
    free(msg);
    unlink(latin1);
    unlink(script);
    unlink(out);
    unlink(err);
}

/* A second process continues a saved conversation (--transcript) and gets
 * its whole history from the SSD tier; replies equal a cache-off run of the
 * whole conversation. */
static void test_cli_transcript_resume(void **state)
{
    (void)state;
    if (!getenv("KVT_BIN")) {
        print_message("skipping: KVT_BIN is not set (ctest sets it to the kvtier binary)\n");
        skip();
    }
    char a[400], b[400], ab[400], ssd[400], tr[400], out[3][400], err[3][400], args[3000];
    snprintf(a, sizeof a, "%s/a.txt", dir);
    snprintf(b, sizeof b, "%s/b.txt", dir);
    snprintf(ab, sizeof ab, "%s/ab.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/ssd2", dir);
    snprintf(tr, sizeof tr, "%s/transcript.json", dir);
    const char *msgs[5] = {"Hello, how are you today?", "Tell me about the ocean.", "What lives there?",
                           "Is it deep?", "Thank you."};
    FILE *fa = fopen(a, "w"), *fb = fopen(b, "w"), *fab = fopen(ab, "w");
    assert_non_null(fa);
    assert_non_null(fb);
    assert_non_null(fab);
    for (int i = 0; i < 5; i++) {
        fprintf(i < 3 ? fa : fb, "%s\n", msgs[i]);
        fprintf(fab, "%s\n", msgs[i]);
    }
    fclose(fa);
    fclose(fb);
    fclose(fab);
    const char *model = model_path[M_WINDOW];
    cli_baseline(model, tok_path, ab, "t", out, err);
    const char *scripts[2] = {a, b};
    for (int i = 1; i <= 2; i++) {
        snprintf(args, sizeof args,
                 "--model '%s' --tokenizer '%s' --script '%s' --max-tokens 12 --ssd-cache '%s' --transcript '%s'",
                 model, tok_path, scripts[i - 1], ssd, tr);
        assert_int_equal(run_cli(args, out[i], err[i]), 0);
    }
    char *o0 = slurp(out[0]), *o1 = slurp(out[1]), *o2 = slurp(out[2]);
    char both[8192];
    snprintf(both, sizeof both, "%s%s", o1, o2);
    assert_string_equal(o0, both);
    long long r0[8], p0[8], r1[8], p1[8], r2[8], p2[8];
    char *e0 = slurp(err[0]), *e1 = slurp(err[1]), *e2 = slurp(err[2]);
    assert_int_equal(parse_turn_lines(e0, r0, p0, 8), 5);
    assert_int_equal(parse_turn_lines(e1, r1, p1, 8), 3);
    /* the resumed process numbers its turns 4 and 5 */
    assert_non_null(strstr(e2, "turn 4: "));
    assert_non_null(strstr(e2, "turn 5: "));
    assert_int_equal(sscanf(e2, "turn 4: reused %lld tokens, prefilled %lld tokens", &r2[0], &p2[0]), 2);
    /* same prompts as the uninterrupted run, and a fresh process still
     * reused at least the whole turn-3 prompt: from disk */
    assert_int_equal(r2[0] + p2[0], r0[3] + p0[3]);
    assert_true(r2[0] >= r0[2] + p0[2]);
    print_message("  resumed turn 4: reused %lld of %lld tokens from the SSD tier\n", r2[0], r2[0] + p2[0]);
    free(o0);
    free(o1);
    free(o2);
    free(e0);
    free(e1);
    free(e2);
    for (int i = 0; i < 3; i++) {
        unlink(out[i]);
        unlink(err[i]);
    }
    unlink(a);
    unlink(b);
    unlink(ab);
    unlink(tr);
    snprintf(args, sizeof args, "rm -rf '%s'", ssd);
    assert_int_equal(system(args), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_template_and_script),
        cmocka_unit_test(test_invariant_plain),
        cmocka_unit_test(test_invariant_window),
        cmocka_unit_test(test_invariant_recurrent),
        cmocka_unit_test(test_invariant_hybrid),
        cmocka_unit_test(test_invariant_stories260k),
        cmocka_unit_test(test_drift_window),
        cmocka_unit_test(test_exact_repeat_every_kind),
        cmocka_unit_test(test_evicted_conversation),
        cmocka_unit_test(test_admission_errors),
        cmocka_unit_test(test_block_tokens_capped),
        cmocka_unit_test(test_cli_restart_from_ssd),
        cmocka_unit_test(test_cli_scheme_never_serves_another),
        cmocka_unit_test(test_cli_transcript_resume),
        cmocka_unit_test(test_cli_bad_input),
        cmocka_unit_test(test_cli_ssd_budget_below_one_prefix),
        cmocka_unit_test(test_cli_interrupt_saves),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
