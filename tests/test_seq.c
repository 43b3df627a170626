/*
 * test_seq.c: the step-wise generation API (engine/seq.h). A sequence
 * stepped with prefill chunks of 1, 7 and 64 tokens, fed by kvt_seq_decode
 * or by a decode the caller runs (kvt_seq_after_decode), gives token for
 * token what kvt_chat_generate gives, reuses the same prefixes and leaves
 * the same entries in the prompt cache, on plain, sliding-window (the ring
 * wraps), recurrent and hybrid synthetic models, greedy and sampled.
 * A sequence cancelled during prefill or decode publishes what it computed
 * and releases its admission; the errors of every step are checked.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "seq.h"
#include "synth_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define VOCAB 259
#define WINDOW 10
enum { M_PLAIN, M_WINDOW, M_RECURRENT, M_HYBRID, M_COUNT };
static const char *const model_name[M_COUNT] = {"plain", "window", "recurrent", "hybrid"};
static char dir[256], model_path[M_COUNT][300], tok_path[300];

static int group_setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_seq_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(tok_path, sizeof tok_path, "%s/tok.bin", dir);
    if (kvt_tokenizer_write_default(tok_path, VOCAB))
        return -1;
    for (int i = 0; i < M_COUNT; i++) {
        snprintf(model_path[i], sizeof model_path[i], "%s/%s.bin", dir, model_name[i]);
        su_synth(i, model_path[i], VOCAB, 512, 11, WINDOW);
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

static kvt_model *load_model(int which)
{
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(model_path[which], &m), 0);
    return m;
}

static kvt_service *service(const kvt_model *m, uint64_t pc_bytes, uint64_t kv_budget)
{
    kvt_chat_service_opts so = {.prompt_cache_bytes = pc_bytes, .kv_budget_bytes = kv_budget, .block_tokens = 16};
    kvt_service *svc = NULL;
    assert_int_equal(kvt_chat_service_create(m, &so, &svc), 0);
    return svc;
}

/* A prompt of n tokens: BOS then ids from `salt`. */
static void make_prompt(int32_t *p, int n, int salt)
{
    p[0] = KVT_TOKEN_BOS;
    for (int i = 1; i < n; i++)
        p[i] = 3 + (int32_t)(((unsigned)i * 37u + (unsigned)salt * 101u) % (VOCAB - 3));
}

#define MAXR 24

typedef struct {
    int32_t reply[MAXR];
    int64_t n_reply;
    kvt_turn_stats st;
} gen_result;

/* Steps one generation: prefill chunks of `chunk`, then decodes; when
 * `batched`, every other token is fed by a decode the test runs itself on
 * kvt_seq_caches into kvt_seq_logits (as a batching scheduler does). */
static int step_generate(kvt_model *m, kvt_service *svc, kvt_sampler *sp, const int32_t *prompt, int64_t n,
                         const kvt_gen_opts *o, int64_t chunk, int batched, gen_result *r)
{
    kvt_seq *s = NULL;
    int rc = kvt_seq_begin(m, svc, sp, prompt, n, o, &s);
    if (rc)
        return rc;
    int done = 0, calls = 0;
    while (!done) {
        assert_int_equal(kvt_seq_prefill(s, chunk, &done), 0);
        calls++;
        /* a chunk never runs more than asked */
        assert_true(kvt_seq_cached(s) - kvt_seq_reused(s) <= calls * chunk);
    }
    for (int i = 0;; i++) {
        int32_t tok = -2;
        int fin = -1;
        assert_int_equal(kvt_seq_next(s, &tok, &fin), 0);
        if (fin)
            break;
        assert_int_equal(kvt_seq_pending_token(s), tok);
        if (batched && i % 2) {
            assert_int_equal(kvt_model_decode(m, kvt_seq_caches(s), kvt_seq_pending_token(s), kvt_seq_logits(s)), 0);
            assert_int_equal(kvt_seq_after_decode(s), 0);
        } else {
            assert_int_equal(kvt_seq_decode(s), 0);
        }
        assert_int_equal(kvt_seq_pending_token(s), -1);
    }
    const int32_t *rep = kvt_seq_reply(s, &r->n_reply);
    assert_true(r->n_reply <= MAXR);
    memcpy(r->reply, rep, (size_t)r->n_reply * sizeof *rep);
    assert_int_equal(kvt_seq_finish(s, 1, &r->st), 0);
    return 0;
}

/* Three requests on one service: a prompt, a longer one sharing its start,
 * an exact repeat of the first. */
#define NREQ 3
static const int req_len[NREQ] = {40, 57, 40};
static const int req_salt[NREQ] = {1, 1, 1};

static void run_requests(kvt_model *m, kvt_tokenizer *tok, int chunk, int batched, float temp, uint64_t pc,
                         gen_result out[NREQ], kvt_service_stats *rep)
{
    kvt_service *svc = service(m, pc, 0);
    kvt_sampler *sp = NULL;
    assert_int_equal(kvt_sampler_create(VOCAB, temp, 0.9f, 5, &sp), 0);
    for (int i = 0; i < NREQ; i++) {
        int32_t prompt[64];
        make_prompt(prompt, req_len[i], req_salt[i]);
        kvt_gen_opts o = {.max_tokens = 12 + i, .admit_timeout_ms = -1, .session = "s",
                          .stop_tok = i == 1 ? tok : NULL};
        memset(&out[i], 0, sizeof out[i]);
        if (chunk == 0) {
            assert_int_equal(kvt_chat_generate(m, svc, sp, prompt, req_len[i], &o, out[i].reply, MAXR,
                                               &out[i].n_reply, &out[i].st), 0);
        } else {
            assert_int_equal(step_generate(m, svc, sp, prompt, req_len[i], &o, chunk, batched, &out[i]), 0);
        }
    }
    assert_int_equal(kvt_service_get_stats(svc, rep), 0);
    assert_int_equal(rep->admitted, 0);
    kvt_sampler_free(sp);
    kvt_service_destroy(svc);
}

static void test_stepwise_equals_generate(void **state)
{
    (void)state;
    kvt_tokenizer *tok = NULL;
    assert_int_equal(kvt_tokenizer_load(tok_path, VOCAB, &tok), 0);
    static const int chunks[] = {1, 7, 64};
    for (int k = 0; k < M_COUNT; k++) {
        kvt_model *m = load_model(k);
        for (int t = 0; t < 2; t++) {
            float temp = t ? 0.8f : 0.0f;
            gen_result ref[NREQ], off[NREQ];
            kvt_service_stats ref_rep, off_rep;
            run_requests(m, tok, 0, 0, temp, 8u << 20, ref, &ref_rep);
            run_requests(m, tok, 0, 0, temp, 0, off, &off_rep);
            print_message("  %s, temperature %.1f: reused %lld, %lld, %lld; replies %lld, %lld, %lld tokens\n",
                          model_name[k], temp, (long long)ref[0].st.reused_tokens,
                          (long long)ref[1].st.reused_tokens, (long long)ref[2].st.reused_tokens,
                          (long long)ref[0].n_reply, (long long)ref[1].n_reply, (long long)ref[2].n_reply);
            assert_true(ref[1].st.reused_tokens > 0);
            assert_int_equal(ref[2].st.reused_tokens, req_len[2] - 1);
            for (int i = 0; i < NREQ; i++) { /* the cache changes no token */
                assert_int_equal(ref[i].n_reply, off[i].n_reply);
                assert_memory_equal(ref[i].reply, off[i].reply, (size_t)off[i].n_reply * sizeof(int32_t));
            }
            for (size_t c = 0; c < sizeof chunks / sizeof *chunks; c++) {
                for (int batched = 0; batched < 2; batched++) {
                    gen_result got[NREQ];
                    kvt_service_stats rep;
                    run_requests(m, tok, chunks[c], batched, temp, 8u << 20, got, &rep);
                    for (int i = 0; i < NREQ; i++) {
                        assert_int_equal(got[i].n_reply, ref[i].n_reply);
                        assert_memory_equal(got[i].reply, ref[i].reply, (size_t)ref[i].n_reply * sizeof(int32_t));
                        assert_int_equal(got[i].st.reused_tokens, ref[i].st.reused_tokens);
                        assert_int_equal(got[i].st.prefilled_tokens, ref[i].st.prefilled_tokens);
                        assert_int_equal(got[i].st.generated_tokens, ref[i].st.generated_tokens);
                        assert_int_equal(got[i].st.prompt_tokens, req_len[i]);
                        assert_true(got[i].st.ttft_ms > 0 && got[i].st.ttft_ms <= got[i].st.total_ms);
                    }
                    /* the same snapshots and entries */
                    assert_int_equal(rep.publishes, ref_rep.publishes);
                    assert_int_equal(rep.entries, ref_rep.entries);
                    assert_int_equal(rep.bytes, ref_rep.bytes);
                    assert_int_equal(rep.hits, ref_rep.hits);
                }
            }
        }
        kvt_model_free(m);
    }
    kvt_tokenizer_free(tok);
}

/* ---- cancel --------------------------------------------------------------------------- */

static void test_cancel_publishes_computed(void **state)
{
    (void)state;
    for (int k = 0; k < M_COUNT; k++) {
        kvt_model *m = load_model(k);
        kvt_service *svc = service(m, 8u << 20, 0);
        kvt_sampler *sp = NULL;
        assert_int_equal(kvt_sampler_create(VOCAB, 0.0f, 0.9f, 5, &sp), 0);
        int32_t prompt[64];
        make_prompt(prompt, 60, 3);
        kvt_gen_opts o = {.max_tokens = 8};

        /* cancelled during prefill, after 2 chunks of 7: 14 tokens published */
        kvt_seq *s = NULL;
        assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 40, &o, &s), 0);
        int done = 1;
        assert_int_equal(kvt_seq_prefill(s, 7, &done), 0);
        assert_int_equal(done, 0);
        assert_int_equal(kvt_seq_prefill(s, 7, &done), 0);
        assert_int_equal(kvt_seq_cached(s), 14);
        kvt_service_stats rep;
        assert_int_equal(kvt_service_get_stats(svc, &rep), 0);
        assert_int_equal(rep.admitted, 1);
        kvt_turn_stats st;
        assert_int_equal(kvt_seq_finish(s, 0, &st), 0);
        assert_int_equal(st.generated_tokens, 0);
        assert_int_equal(st.ttft_ms, 0);
        assert_int_equal(kvt_service_get_stats(svc, &rep), 0);
        assert_int_equal(rep.admitted, 0);
        assert_int_equal(rep.publishes, 1);
        /* a prompt extending those 14 tokens reuses all of them, on every kind */
        assert_int_equal(kvt_service_peek(svc, prompt, 30, NULL), 14);

        /* cancelled during decode: prompt (20) + fed tokens published */
        make_prompt(prompt, 60, 4);
        assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 20, &o, &s), 0);
        assert_int_equal(kvt_seq_prefill(s, INT64_MAX, &done), 0);
        assert_int_equal(done, 1);
        int32_t full[64];
        memcpy(full, prompt, 20 * sizeof *full);
        int fed = 0, fin = 0;
        for (; fed < 3; fed++) {
            int32_t t;
            assert_int_equal(kvt_seq_next(s, &t, &fin), 0);
            if (fin)
                break;
            full[20 + fed] = t;
            assert_int_equal(kvt_seq_decode(s), 0);
        }
        assert_int_equal(kvt_seq_cached(s), 20 + fed);
        assert_int_equal(kvt_seq_finish(s, 0, &st), 0);
        full[20 + fed] = 5; /* one more token so the whole entry is usable */
        print_message("  %s: cancelled after %d fed tokens\n", model_name[k], fed);
        if (fed > 0)
            assert_int_equal(kvt_service_peek(svc, full, 21 + fed, NULL), 20 + fed);
        assert_int_equal(kvt_service_get_stats(svc, &rep), 0);
        assert_int_equal(rep.admitted, 0);

        kvt_sampler_free(sp);
        kvt_service_destroy(svc);
        kvt_model_free(m);
    }
}

/* ---- errors --------------------------------------------------------------------------- */

static void test_errors(void **state)
{
    (void)state;
    kvt_model *m = load_model(M_HYBRID);
    /* a budget of exactly one request of 40 + 8 tokens */
    kvt_service *probe = service(m, 0, 0);
    uint64_t one = kvt_service_project_bytes(probe, 48);
    kvt_service_destroy(probe);
    kvt_service *svc = service(m, 8u << 20, one);
    kvt_sampler *sp = NULL;
    assert_int_equal(kvt_sampler_create(VOCAB, 0.0f, 0.9f, 5, &sp), 0);
    static int32_t prompt[600];
    make_prompt(prompt, 600, 9);
    kvt_gen_opts o = {.max_tokens = 8};
    kvt_seq *s = (kvt_seq *)1;

    assert_int_equal(kvt_seq_begin(NULL, svc, sp, prompt, 40, &o, &s), KVT_EINVAL);
    assert_null(s);
    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 0, &o, &s), KVT_EINVAL);
    kvt_gen_opts bad = {.max_tokens = 0};
    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 40, &bad, &s), KVT_EINVAL);
    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 40, &o, NULL), KVT_EINVAL);
    kvt_gen_opts huge = {.max_tokens = 8};
    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 600, &huge, &s), KVT_ELIMIT); /* seq_len 512 */
    assert_null(s);

    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 40, &o, &s), 0);
    /* the budget is held: a second request does not fit now and does not wait */
    kvt_seq *s2 = (kvt_seq *)1;
    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 40, &o, &s2), KVT_EAGAIN);
    assert_null(s2);
    kvt_gen_opts wait = {.max_tokens = 8, .admit_timeout_ms = 20};
    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 40, &wait, &s2), KVT_EAGAIN);

    int32_t t = 0;
    int fin = 0, done = 0;
    assert_int_equal(kvt_seq_next(s, &t, &fin), KVT_EINVAL); /* prompt not done */
    assert_int_equal(kvt_seq_decode(s), KVT_EINVAL);          /* nothing pending */
    assert_int_equal(kvt_seq_after_decode(s), KVT_EINVAL);
    assert_int_equal(kvt_seq_prefill(s, 0, &done), KVT_EINVAL);
    assert_int_equal(kvt_seq_prefill(s, 5, NULL), KVT_EINVAL);
    assert_int_equal(kvt_seq_prefill(s, INT64_MAX, &done), 0);
    assert_int_equal(done, 1);
    assert_int_equal(kvt_seq_prefill(s, 1, &done), 0); /* nothing left: a no-op */
    assert_int_equal(done, 1);
    assert_int_equal(kvt_seq_next(s, &t, &fin), 0);
    assert_int_equal(fin, 0);
    int32_t pend = t;
    assert_int_equal(kvt_seq_pending_token(s), pend);
    assert_int_equal(kvt_seq_next(s, &t, &fin), KVT_EINVAL); /* not fed yet */
    /* after_decode refuses caches that did not grow by exactly one token */
    assert_int_equal(kvt_seq_after_decode(s), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "expected"));
    assert_int_equal(kvt_seq_pending_token(s), pend); /* unchanged */
    assert_int_equal(kvt_seq_decode(s), 0);
    while (!fin) {
        assert_int_equal(kvt_seq_next(s, &t, &fin), 0);
        if (!fin)
            assert_int_equal(kvt_seq_decode(s), 0);
    }
    assert_int_equal(kvt_seq_next(s, &t, &fin), 0); /* stays finished */
    assert_int_equal(fin, 1);
    assert_int_equal(t, -1);
    assert_int_equal(kvt_seq_decode(s), KVT_EINVAL);
    assert_int_equal(kvt_seq_finish(s, 1, NULL), 0);

    /* the budget is free again */
    assert_int_equal(kvt_seq_begin(m, svc, sp, prompt, 40, &o, &s2), 0);
    assert_int_equal(kvt_seq_finish(s2, 0, NULL), 0);

    /* a failing prefill (a token outside the vocabulary): the sequence is
     * failed, publishes nothing, and finish releases it */
    kvt_service_stats before, after;
    assert_int_equal(kvt_service_get_stats(svc, &before), 0);
    int32_t badp[30];
    make_prompt(badp, 30, 10);
    badp[12] = VOCAB + 5; /* before the first checkpoint boundary (16) */
    assert_int_equal(kvt_seq_begin(m, svc, sp, badp, 30, &o, &s), 0);
    assert_int_equal(kvt_seq_prefill(s, 8, &done), 0); /* tokens 0..8 are fine */
    assert_int_equal(kvt_seq_prefill(s, INT64_MAX, &done), KVT_EINVAL);
    assert_int_equal(done, 0);
    assert_int_equal(kvt_seq_prefill(s, INT64_MAX, &done), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "failed"));
    assert_int_equal(kvt_seq_next(s, &t, &fin), KVT_EINVAL);
    assert_int_equal(kvt_seq_finish(s, 0, NULL), 0);
    assert_int_equal(kvt_service_get_stats(svc, &after), 0);
    assert_int_equal(after.publishes, before.publishes);
    assert_int_equal(after.admitted, 0);

    /* NULL */
    kvt_turn_stats st = {.prompt_tokens = 99};
    assert_int_equal(kvt_seq_finish(NULL, 1, &st), 0);
    assert_int_equal(st.prompt_tokens, 0);
    assert_int_equal(kvt_seq_reused(NULL), 0);
    assert_null(kvt_seq_caches(NULL));
    assert_null(kvt_seq_logits(NULL));
    assert_int_equal(kvt_seq_pending_token(NULL), -1);
    int64_t n = 5;
    assert_null(kvt_seq_reply(NULL, &n));
    assert_int_equal(n, 0);
    assert_int_equal(kvt_seq_next(NULL, &t, &fin), KVT_EINVAL);
    assert_int_equal(kvt_seq_decode(NULL), KVT_EINVAL);
    assert_int_equal(kvt_seq_after_decode(NULL), KVT_EINVAL);

    kvt_sampler_free(sp);
    kvt_service_destroy(svc);
    kvt_model_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stepwise_equals_generate),
        cmocka_unit_test(test_cancel_publishes_computed),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
