/*
 * test_serve_invariance.c: a request's output depends neither on what it is
 * batched with, nor on the cache, nor on how its prompt is cut into chunks.
 *
 * Engine (kvt_model_forward_batch, the pass `kvtier serve` runs): a prompt
 * fed in one chunk per pass (up to KVT_MODEL_CHUNK tokens), in chunks of
 * random sizes, in random chunks beside two other sequences whose own prompt
 * and decode rows share the passes, and after a reused prefix (a zero-copy
 * clone of caches that held part of it, as the prompt cache lends them):
 * the logits after its last token must equal, bit for bit (memcmp), those
 * of decoding the prompt token by token with kvt_model_decode; so must the
 * logits of 3 greedy decode steps after it (the state appended to the
 * caches is the same). On stories260K (when ../shared has it) and on
 * synthetic plain, sliding-window (wrapping), recurrent and hybrid models,
 * with K/V stored as f32, f16 and q8, and with the plain model's caches
 * paged under a 1-block residency bound. kvt_model_prefill's GEMM path is
 * printed beside it: it agrees within float tolerance only, which is why
 * the server does not prefill through it.
 *
 * Server (in process, HTTP on loopback): 8 token-id prompts of 9 to 140
 * tokens, greedy, 12 reply tokens each. Reference: each sent alone to a
 * cache-off server prefilling 256 tokens per step. The same 8 sent at once
 * to a cache-off server prefilling 5 tokens per step (chunked, batched with
 * each other), and twice at once to a cache-on server prefilling 5 per step
 * (the second round reuses the first round's prompts: cached_tokens > 0)
 * must give byte-identical replies; the cache-on server also answers the
 * extended prompt (prompt + reply + more tokens) as a cache-off one does.
 *
 * Random choices print their seed and read KVT_TEST_SEED.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_rng.h"
#include "test_seed.h"

#include "kvtier/residency.h"
#include "model.h"
#include "server.h"
#include "serve_util.h"
#include "tokenizer.h"

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* How many times slower this build runs a test (CMake: 10 under TSan, 3
 * under ASan, else 1): the receive timeout is multiplied by it (under TSan
 * a concurrent completion got no reply within 120 s: status -1). */
#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif

static uint64_t g_seed;
static char g_dir[256];

static int setup(void **state)
{
    (void)state;
    g_seed = test_seed("test_serve_invariance");
    snprintf(g_dir, sizeof g_dir, "/tmp/kvt_serve_inv_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---- engine ------------------------------------------------------------------------------ */

#define STEPS 3 /* greedy decode steps after the prompt */

typedef struct {
    kvt_model *m;
    int L, V;
    int32_t block;
} eng;

static int argmax(const float *x, int n)
{
    int a = 0;
    for (int i = 1; i < n; i++)
        a = x[i] > x[a] ? i : a;
    return a;
}

/* Greedy decode STEPS tokens from caches whose last logits are `lg`; the
 * logits of every step go to out (STEPS, V). */
static void continue_greedy(const eng *e, kvt_cache **c, const float *lg, float *out)
{
    int32_t t = argmax(lg, e->V);
    for (int k = 0; k < STEPS; k++) {
        assert_int_equal(kvt_model_decode(e->m, c, t, out + (size_t)k * e->V), 0);
        t = argmax(out + (size_t)k * e->V, e->V);
    }
}

static void expect_same(const float *got, const float *want, int n, const char *what)
{
    if (memcmp(got, want, sizeof(float) * (size_t)n) != 0) {
        int at = 0;
        while (got[at] == want[at])
            at++;
        fail_msg("%s: logit %d is %.9g, token-by-token decode gives %.9g", what, at, got[at], want[at]);
    }
}

/* Feeds tok[from, n) to caches c through kvt_model_forward_batch in chunks
 * (max_chunk 0: random sizes 1..37, else that size), beside `others`
 * sequences (0..2) whose prompt and decode rows ride in the same passes;
 * leaves the logits after the last token in lg. */
static void feed(const eng *e, kvt_cache **c, const int32_t *tok, int from, int n, int max_chunk, int others,
                 uint64_t *rs, float *lg)
{
    kvt_cache *oc[2][KVT_MODEL_MAX_LAYERS];
    int32_t otok[2] = {0, 0};
    for (int o = 0; o < others; o++) {
        assert_int_equal(kvt_model_new_caches(e->m, e->block, oc[o]), 0);
        otok[o] = (int32_t)(rng_next(rs) % (uint64_t)e->V);
    }
    float *logits = malloc(sizeof(float) * (size_t)e->V * 3);
    int32_t *toks = malloc(sizeof(int32_t) * (KVT_MODEL_CHUNK * 3));
    for (int at = from; at < n;) {
        int k = max_chunk ? max_chunk : rng_range(rs, 1, 37);
        if (k > n - at)
            k = n - at;
        /* passes cross block boundaries, a sealing cache's too (f16, q8):
         * its rows of a block attend before the next block's are appended */
        assert_int_equal(kvt_model_pass_rows(e->m, c), KVT_MODEL_CHUNK);
        kvt_cache **cs[3];
        int32_t counts[3];
        int ns = 0, rows = 0, me = rng_range(rs, 0, others); /* where the sequence sits in the batch */
        for (int o = 0; o <= others; o++) {
            if (o == me) {
                cs[ns] = c;
                counts[ns++] = k;
                memcpy(toks + rows, tok + at, sizeof(int32_t) * (size_t)k);
                rows += k;
            }
            if (o < others) { /* another sequence: a decode row or a few prompt rows */
                int ko = rng_range(rs, 1, 3);
                if (kvt_cache_offset(oc[o][0]) + ko >= 500)
                    ko = 1;
                cs[ns] = oc[o];
                counts[ns++] = ko;
                for (int t = 0; t < ko; t++)
                    toks[rows++] = (otok[o] + t * 7) % e->V;
            }
        }
        assert_int_equal(kvt_model_forward_batch(e->m, ns, cs, counts, toks, logits), 0);
        for (int s = 0; s < ns; s++)
            if (cs[s] == c)
                memcpy(lg, logits + (size_t)s * e->V, sizeof(float) * (size_t)e->V);
            else
                otok[s > me ? s - 1 : s] = argmax(logits + (size_t)s * e->V, e->V);
        at += k;
    }
    for (int o = 0; o < others; o++)
        kvt_caches_destroy(oc[o], e->L);
    free(logits);
    free(toks);
}

/* Every way of feeding a prompt of n tokens against decoding it token by
 * token. paged: the fed caches (every layer a kv layer) live under a
 * 1-block residency bound, so prompt rows attend through the paging window. */
static void check_model(kvt_model *m, const char *name, int n, int32_t block, uint64_t salt, int paged)
{
    eng e = {m, kvt_model_get_config(m)->n_layers, kvt_model_get_config(m)->vocab_size, block};
    uint64_t rs = g_seed ^ (salt * 0x2545F4914F6CDD1DULL);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        tok[i] = (int32_t)(rng_next(&rs) % (uint64_t)e.V);
    size_t V = (size_t)e.V;
    float *ref = malloc(sizeof(float) * V), *ref_next = malloc(sizeof(float) * V * STEPS);
    float *lg = malloc(sizeof(float) * V), *next = malloc(sizeof(float) * V * STEPS);
    kvt_cache *c[KVT_MODEL_MAX_LAYERS], *d[KVT_MODEL_MAX_LAYERS];

    /* the reference: token by token */
    assert_int_equal(kvt_model_new_caches(m, block, c), 0);
    for (int i = 0; i < n; i++)
        assert_int_equal(kvt_model_decode(m, c, tok[i], ref), 0);
    continue_greedy(&e, c, ref, ref_next);
    kvt_caches_destroy(c, e.L);

    static const struct {
        const char *what;
        int chunk, others, reuse;
    } ways[] = {
        {"one chunk per pass (KVT_MODEL_CHUNK)", KVT_MODEL_CHUNK, 0, 0},
        {"random chunks", 0, 0, 0},
        {"random chunks beside 1 other sequence", 0, 1, 0},
        {"random chunks beside 2 other sequences", 0, 2, 0},
        {"a reused prefix, then random chunks beside 2", 0, 2, 1},
    };
    uint64_t paged_out = 0;
    int ran = 0;
    for (size_t w = 0; w < sizeof ways / sizeof ways[0]; w++) {
        if (paged && ways[w].reuse)
            continue;
        assert_int_equal(kvt_model_new_caches(m, block, c), 0);
        kvt_residency *res = NULL;
        if (paged) {
            kvt_residency_options ro = {.max_blocks = 1, .dir = g_dir};
            assert_int_equal(kvt_residency_create(&ro, &res), 0);
            for (int l = 0; l < e.L; l++)
                assert_int_equal(kvt_kv_set_residency(c[l], res, l), 0);
        }
        int from = 0;
        if (ways[w].reuse) { /* part of the prompt came from a cache: clone, go on on the clone */
            from = rng_range(&rs, 1, n - 1);
            feed(&e, c, tok, 0, from, 0, 1, &rs, lg);
            assert_int_equal(kvt_caches_clone(c, e.L, d), 0);
            kvt_caches_destroy(c, e.L);
            memcpy(c, d, sizeof(kvt_cache *) * (size_t)e.L);
        }
        feed(&e, c, tok, from, n, ways[w].chunk, ways[w].others, &rs, lg);
        char what[256];
        snprintf(what, sizeof what, "%s %s n %d: %s", name, kvt_kv_scheme_name(kvt_model_kv_scheme(m)), n,
                 ways[w].what);
        expect_same(lg, ref, e.V, what);
        continue_greedy(&e, c, lg, next);
        strncat(what, ", then greedy decode", sizeof what - strlen(what) - 1);
        expect_same(next, ref_next, e.V * STEPS, what);
        if (paged) {
            kvt_residency_stats st;
            for (int l = 0; l < e.L; l++)
                assert_int_equal(kvt_kv_residency_settle(c[l]), 0);
            assert_int_equal(kvt_residency_stats_get(res, &st), 0);
            paged_out += st.blocks_out;
        }
        kvt_caches_destroy(c, e.L);
        kvt_residency_release(res);
        ran++;
    }
    if (paged) {
        print_message("  %s n %d under a 1-block residency bound: %llu blocks paged out\n", name, n,
                      (unsigned long long)paged_out);
        assert_true(paged_out > 0);
    }
    /* the GEMM prefill, for comparison */
    assert_int_equal(kvt_model_new_caches(m, block, c), 0);
    assert_int_equal(kvt_model_prefill(m, c, tok, n, lg), 0);
    double md = 0;
    for (size_t i = 0; i < V; i++)
        md = fmax(md, fabs((double)lg[i] - ref[i]));
    kvt_caches_destroy(c, e.L);
    print_message("  %s %s n %d: %d ways bit-identical to token-by-token decode; kvt_model_prefill (GEMM) differs "
                  "by at most %.3g\n", name, kvt_kv_scheme_name(kvt_model_kv_scheme(m)), n, ran, md);
    free(tok);
    free(ref);
    free(ref_next);
    free(lg);
    free(next);
}

enum { PLAIN, WINDOW, RECURRENT, HYBRID };

static kvt_model *synth(int shape)
{
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 48, p.hidden_dim = 80, p.n_layers = 3, p.n_heads = 6, p.n_kv_heads = 2, p.vocab_size = 97;
    p.seq_len = 600;
    p.seed = 77 + (uint64_t)shape;
    if (shape == WINDOW) {
        p.sliding_window = 7;
        for (int l = 0; l < 3; l++)
            p.layer_kind[l] = KVT_LAYER_WINDOW;
    } else if (shape == RECURRENT) {
        p.layer_kind[0] = KVT_LAYER_RECURRENT;
    } else if (shape == HYBRID) {
        p.separate_classifier = 1;
        p.sliding_window = 5;
        p.layer_kind[0] = KVT_LAYER_WINDOW;
        p.layer_kind[1] = KVT_LAYER_RECURRENT;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/shape%d.bin", g_dir, shape);
    assert_int_equal(kvt_model_synth(&p, path), 0);
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    return m;
}

static void test_engine_prefill_invariance(void **state)
{
    (void)state;
    static const kvt_kv_scheme schemes[] = {KVT_KV_F32, KVT_KV_F16, KVT_KV_Q8};
    static const char *const names[] = {"plain", "window", "recurrent", "hybrid"};
    for (int shape = PLAIN; shape <= HYBRID; shape++) {
        kvt_model *m = synth(shape);
        for (size_t s = 0; s < sizeof schemes / sizeof schemes[0]; s++) {
            assert_int_equal(kvt_model_set_kv_scheme(m, schemes[s]), 0);
            check_model(m, names[shape], 90, 16, (uint64_t)(shape * 10 + (int)s + 1), 0);
        }
        if (shape == PLAIN) {
            assert_int_equal(kvt_model_set_kv_scheme(m, KVT_KV_F32), 0);
            check_model(m, "plain paged", 90, 16, 7, 1);
        }
        kvt_model_free(m);
    }
    const char *shared = getenv("KVT_SHARED_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/data/models/stories260K.bin", shared ? shared : "");
    if (!shared || access(path, R_OK) != 0) {
        print_message("stories260K skipped: %s not found\n", path);
        return;
    }
    kvt_model *m = NULL;
    assert_int_equal(kvt_model_load(path, &m), 0);
    check_model(m, "stories260K", 300, 16, 100, 0); /* more than one chunk, many blocks */
    kvt_model_free(m);
}

/* ---- server ------------------------------------------------------------------------------ */

#define NPROMPT 8
#define REPLY 12

static int32_t g_prompt[NPROMPT][160];
static int g_len[NPROMPT];

typedef struct {
    int port, i;
    const int32_t *prompt;
    int n;
    char *text;      /* the reply */
    int cached;      /* usage.prompt_tokens_details.cached_tokens */
    int status;
} call;

static void *do_call(void *arg)
{
    call *c = arg;
    json_t *p = json_array();
    for (int k = 0; k < c->n; k++)
        json_array_append_new(p, json_integer(c->prompt[k]));
    json_t *req = json_pack("{s:o, s:i, s:f}", "prompt", p, "max_tokens", REPLY, "temperature", 0.0);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    kvt_ts_resp r;
    kvt_ts_http(c->port, "POST", "/v1/completions", NULL, body, 120 * KVT_TEST_TIME_SCALE, &r);
    free(body);
    c->status = r.status;
    json_t *doc = json_loads(r.body, 0, NULL);
    const char *t = json_string_value(json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "text"));
    c->text = strdup(t ? t : "");
    c->cached = (int)json_integer_value(json_object_get(
        json_object_get(json_object_get(doc, "usage"), "prompt_tokens_details"), "cached_tokens"));
    json_decref(doc);
    kvt_ts_resp_free(&r);
    return NULL;
}

/* Sends the prompts (each prompt i is g_prompt[i] plus `ext` extra tokens
 * when ext > 0) to port, all at once (concurrent) or one after another. */
static void send_all(int port, int concurrent, call *out, const int32_t (*prompts)[160], const int *len)
{
    pthread_t th[NPROMPT];
    for (int i = 0; i < NPROMPT; i++) {
        out[i] = (call){.port = port, .i = i, .prompt = prompts[i], .n = len[i]};
        if (concurrent)
            assert_int_equal(pthread_create(&th[i], NULL, do_call, &out[i]), 0);
        else
            do_call(&out[i]);
    }
    for (int i = 0; concurrent && i < NPROMPT; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < NPROMPT; i++)
        assert_int_equal(out[i].status, 200);
}

static kvt_server *start(const char *model, const char *tok, uint64_t cache, int64_t chunk)
{
    kvt_server_opts o = {.model_path = model, .tok_path = tok, .prompt_cache_bytes = cache, .prefill_chunk = chunk,
                         .max_queue = 64, .max_running = 16};
    kvt_server *s = NULL;
    assert_int_equal(kvt_server_start(&o, &s), 0);
    assert_int_equal(kvt_server_load(s), 0);
    return s;
}

static void expect_replies(const call *got, const call *want, const char *what)
{
    for (int i = 0; i < NPROMPT; i++)
        if (strcmp(got[i].text, want[i].text) != 0)
            fail_msg("%s: prompt %d (%d tokens) replied \"%s\", alone on a 256-token-chunk cache-off server \"%s\"",
                     what, i, g_len[i], got[i].text, want[i].text);
}

static void free_calls(call *c)
{
    for (int i = 0; i < NPROMPT; i++)
        free(c[i].text);
}

static void test_serve_replies_invariant(void **state)
{
    (void)state;
    char model[400], tok[400];
    snprintf(model, sizeof model, "%s/serve.bin", g_dir);
    snprintf(tok, sizeof tok, "%s/tok.bin", g_dir);
    kvt_synth_params p; /* the default model's classifier (varied text) on a small shape */
    kvt_default_model_params(&p);
    p.dim = 96, p.hidden_dim = 256, p.n_layers = 3, p.n_heads = 4, p.n_kv_heads = 2, p.seq_len = 512;
    assert_int_equal(kvt_model_synth(&p, model), 0);
    assert_int_equal(kvt_tokenizer_write_default(tok, KVT_DEFAULT_VOCAB), 0);
    uint64_t rs = g_seed ^ 0x5eedULL;
    for (int i = 0; i < NPROMPT; i++) {
        g_len[i] = i == 0 ? 9 : rng_range(&rs, 9, 140);
        g_prompt[i][0] = 1;
        for (int k = 1; k < g_len[i]; k++)
            g_prompt[i][k] = rng_range(&rs, 3, KVT_DEFAULT_VOCAB - 1);
    }
    call ref[NPROMPT], got[NPROMPT], again[NPROMPT], ext_ref[NPROMPT], ext_got[NPROMPT];
    kvt_server *a = start(model, tok, 0, 256);
    send_all(kvt_server_port(a), 0, ref, (const int32_t(*)[160])g_prompt, g_len);

    kvt_server *b = start(model, tok, 0, 5);
    send_all(kvt_server_port(b), 1, got, (const int32_t(*)[160])g_prompt, g_len);
    expect_replies(got, ref, "cache off, 5-token chunks, 8 at once");
    free_calls(got);

    kvt_server *c = start(model, tok, 64u << 20, 5);
    send_all(kvt_server_port(c), 1, got, (const int32_t(*)[160])g_prompt, g_len);
    expect_replies(got, ref, "cache on, 5-token chunks, 8 at once, first round");
    send_all(kvt_server_port(c), 1, again, (const int32_t(*)[160])g_prompt, g_len);
    expect_replies(again, ref, "cache on, 5-token chunks, 8 at once, second round (reused)");
    int reused = 0;
    for (int i = 0; i < NPROMPT; i++)
        reused += again[i].cached > 0;
    assert_int_equal(reused, NPROMPT);

    /* the next turn: prompt + the reply's tokens (fed by decode on c, by
     * prefill on a) + 5 more tokens */
    static int32_t ext[NPROMPT][160];
    int ext_len[NPROMPT];
    for (int i = 0; i < NPROMPT; i++) {
        memcpy(ext[i], g_prompt[i], sizeof(int32_t) * (size_t)g_len[i]);
        ext_len[i] = g_len[i];
        kvt_ts_resp r; /* the reply's tokens, from the server's own tokenizer */
        json_t *req = json_pack("{s:s, s:b}", "prompt", got[i].text, "add_special_tokens", 0);
        char *body = json_dumps(req, JSON_COMPACT);
        json_decref(req);
        kvt_ts_http(kvt_server_port(a), "POST", "/tokenize", NULL, body, 30 * KVT_TEST_TIME_SCALE, &r);
        free(body);
        json_t *doc = json_loads(r.body, 0, NULL);
        json_t *ids = json_object_get(doc, "tokens");
        for (size_t k = 0; k < json_array_size(ids) && ext_len[i] < 150; k++)
            ext[i][ext_len[i]++] = (int32_t)json_integer_value(json_array_get(ids, k));
        json_decref(doc);
        kvt_ts_resp_free(&r);
        for (int k = 0; k < 5; k++)
            ext[i][ext_len[i]++] = rng_range(&rs, 3, KVT_DEFAULT_VOCAB - 1);
    }
    send_all(kvt_server_port(a), 0, ext_ref, (const int32_t(*)[160])ext, ext_len);
    send_all(kvt_server_port(c), 1, ext_got, (const int32_t(*)[160])ext, ext_len);
    for (int i = 0; i < NPROMPT; i++) {
        if (strcmp(ext_got[i].text, ext_ref[i].text) != 0)
            fail_msg("next turn of prompt %d (%d tokens, %d cached): \"%s\" with the cache, \"%s\" without", i,
                     ext_len[i], ext_got[i].cached, ext_got[i].text, ext_ref[i].text);
    }
    print_message("  8 prompts of 9-140 tokens: the same 12-token replies alone (256-token chunks, cache off), "
                  "8 at once in 5-token chunks (cache off, cache on, reused); next turns equal with the cache\n");
    free_calls(ref);
    free_calls(got);
    free_calls(again);
    free_calls(ext_ref);
    free_calls(ext_got);
    kvt_server_stop(a, 5000);
    kvt_server_stop(b, 5000);
    kvt_server_stop(c, 5000);
    kvt_server_destroy(a);
    kvt_server_destroy(b);
    kvt_server_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_engine_prefill_invariance),
        cmocka_unit_test(test_serve_replies_invariant),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
