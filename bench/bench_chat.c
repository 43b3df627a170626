/*
 * bench_chat.c: `kvtier bench chat`: a 10-turn scripted conversation on the
 * built-in default model (or --model/--tokenizer), run with the prompt cache
 * on and off in the same process, turn by turn interleaved so both see the
 * same machine load. Per turn it prints the prompt tokens prefilled and the
 * TTFT with the cache off and on, the on/off ratio, and the baseline the
 * goal is measured against: the time to prefill only the new tokens (the
 * cached prefix taken straight from the service, then prefill + the first
 * token, no admission or lookup). Goal (issue 4): from turn 2 on, TTFT with
 * the cache within 1.2x of that baseline.
 * Then TTFT per KV storage scheme: one cache-on and one cache-off chat per
 * scheme (f32, f16, bf16, q8), the schemes taking turns within each turn,
 * with each scheme's TTFT and decode rate over f32's (goal: a converted
 * scheme no more than 10% slower than f32) and whether its replies are the
 * same with and without the cache.
 * Owns nothing but its figures; must never time anything but the engine.
 */
#include "chat.h"
#include "bench_util.h"
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const script[10] = {
    "Hello! I am planning a trip to the mountains next week and would like some advice.",
    "What should I pack for three days of hiking if the weather may turn cold at night?",
    "How heavy should my backpack be, and how do I fit a tent and a sleeping bag in it?",
    "Which trail would you choose for a first trip: the lake loop or the ridge path?",
    "Tell me how to read a topographic map, in particular the contour lines near a pass.",
    "What do I do if I get lost and my phone has no signal left in the valley?",
    "How much water should I carry, and can I drink from the streams if I filter it?",
    "Please suggest simple meals I can cook on a small stove with one pot only.",
    "How do I keep food away from animals at the campsite during the night?",
    "Finally, give me a short checklist for the morning before I leave the car park.",
};

#define MAX_REPEAT 9

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier bench chat [--model M.bin --tokenizer T.bin] [--max-tokens N] [--turns N]\n"
               "                        [--prompt-cache BYTES] [--block-tokens B] [--repeat K]\n"
               "10-turn scripted chat, prompt cache on vs off in the same run (default model: the\n"
               "built-in one). Prints per turn: prefilled tokens and TTFT off/on, on/off ratio, and\n"
               "TTFT on vs the time to prefill only the new tokens (goal: <= 1.2x from turn 2).\n"
               "--repeat K runs K identical cache-on conversations (fresh services) and reports medians\n"
               "(default 3), so one load spike on a shared machine does not decide a ratio.\n");
}

/* Time to prefill only prompt[R..n) and choose the first token, on caches
 * holding prompt[0..R) taken from the service (fresh caches when R = 0). */
static int baseline_ms(kvt_model *m, kvt_service *svc, const int32_t *prompt, int64_t n, int64_t R,
                       double *out)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    float *logits = malloc((size_t)c->vocab_size * sizeof *logits);
    if (!logits)
        return KVT_ENOMEM;
    kvt_request req = {.prompt = prompt, .n_prompt = R + 1, .max_tokens = 0};
    kvt_admission *adm = NULL;
    kvt_state st = {0};
    int rc = kvt_service_admit(svc, &req, &adm);
    if (!rc)
        rc = kvt_service_acquire(svc, adm, &st);
    if (!rc && st.reused_tokens != R) {
        /* Not resident any more (evicted): rebuild the prefix, untimed. */
        kvt_caches_destroy(st.caches, st.n_layers);
        rc = kvt_model_new_caches(m, 256, st.caches);
        if (!rc && R > 0)
            rc = kvt_model_prefill(m, st.caches, prompt, R, NULL);
    }
    if (!rc) {
        uint64_t t0 = kvt_now_ns();
        rc = kvt_model_prefill(m, st.caches, prompt + R, n - R, logits);
        (void)kvt_sample_argmax(logits, c->vocab_size);
        *out = (double)(kvt_now_ns() - t0) / 1e6;
    }
    kvt_state_clear(&st);
    kvt_service_release(svc, adm, 1);
    free(logits);
    return rc;
}

#define N_SCHEMES KVT_KV_SCHEME_COUNT

/* The per-scheme section (see the top of the file). The model's scheme is
 * set before every turn of a scheme's chats, so each service makes its fresh
 * caches in its own scheme; it is f32 again on return. */
static int scheme_section(kvt_model *m, kvt_tokenizer *tok, long turns, const kvt_chat_service_opts *so_on,
                          const kvt_chat_service_opts *so_off, const kvt_chat_opts *co)
{
    kvt_service *svc[N_SCHEMES][2] = {{0}};
    kvt_chat *ch[N_SCHEMES][2] = {{0}};
    double ttft_on[N_SCHEMES] = {0}, ttft_off[N_SCHEMES] = {0}, dec_ms[N_SCHEMES] = {0};
    long dec_tok[N_SCHEMES] = {0};
    int same[N_SCHEMES], rc = 0;
    for (int s = 0; s < N_SCHEMES && !rc; s++) {
        same[s] = 1;
        kvt_model_set_kv_scheme(m, (kvt_kv_scheme)s);
        for (int k = 0; k < 2 && !rc; k++)
            if (!(rc = kvt_chat_service_create(m, k ? so_off : so_on, &svc[s][k])))
                rc = kvt_chat_create(m, tok, svc[s][k], co, &ch[s][k]);
    }
    for (long t = 0; t < turns && !rc; t++)
        for (int i = 0; i < N_SCHEMES && !rc; i++) {
            int s = (int)((i + t) % N_SCHEMES); /* each turn starts with another scheme */
            kvt_model_set_kv_scheme(m, (kvt_kv_scheme)s);
            const int32_t *ids[2];
            int64_t n[2];
            for (int k = 0; k < 2 && !rc; k++) {
                kvt_turn_stats st;
                if ((rc = kvt_chat_turn(ch[s][k], script[t], NULL, &ids[k], &n[k], &st))) {
                    fprintf(stderr, "kvtier bench chat: %s turn %ld failed: %s\n",
                            kvt_kv_scheme_name((kvt_kv_scheme)s), t + 1, kvt_last_error());
                    break;
                }
                if (k == 0 && t >= 1)
                    ttft_on[s] += st.ttft_ms;
                if (k == 1)
                    ttft_off[s] += st.ttft_ms;
                if (k == 0 && st.generated_tokens > 1) {
                    dec_ms[s] += st.total_ms - st.ttft_ms;
                    dec_tok[s] += st.generated_tokens - 1;
                }
            }
            if (!rc)
                same[s] &= n[0] == n[1] && !memcmp(ids[0], ids[1], (size_t)n[0] * sizeof *ids[0]);
        }
    if (!rc) {
        printf("\nTTFT per KV storage scheme (ms summed over turns; schemes interleaved turn by turn; ratio to\n"
               "f32 in brackets; decode = reply tokens after the first per second, cache on)\n");
        char on_hdr[32];
        snprintf(on_hdr, sizeof on_hdr, "on: ttft turns 2-%ld", turns);
        printf("  %-6s %9s %22s %22s %20s %s\n", "scheme", "KV B/tok", on_hdr, "off: ttft all turns", "decode tok/s",
               "on == off");
        int ok = 1;
        for (int s = 0; s < N_SCHEMES; s++) {
            kvt_model_set_kv_scheme(m, (kvt_kv_scheme)s);
            double d = dec_ms[s] > 0 ? dec_tok[s] / (dec_ms[s] / 1e3) : 0, d0 = dec_ms[0] > 0 ? dec_tok[0] / (dec_ms[0] / 1e3) : 0;
            printf("  %-6s %9zu %12.1f (%5.2fx) %12.1f (%5.2fx) %10.1f (%5.2fx) %s\n",
                   kvt_kv_scheme_name((kvt_kv_scheme)s), kvt_model_kv_bytes_per_token(m), ttft_on[s],
                   ttft_on[0] > 0 ? ttft_on[s] / ttft_on[0] : 0, ttft_off[s], ttft_off[0] > 0 ? ttft_off[s] / ttft_off[0] : 0,
                   d, d0 > 0 ? d / d0 : 0, same[s] ? "yes" : "NO");
            if (s > 0)
                ok &= ttft_on[s] <= 1.10 * ttft_on[0] && ttft_off[s] <= 1.10 * ttft_off[0];
            rc |= !same[s];
        }
        printf("goal (every converted scheme's TTFT within 1.10x of f32's, cache on and off): %s\n",
               ok ? "met" : "MISSED (one run on a shared machine: see the ratios)");
    }
    for (int s = 0; s < N_SCHEMES; s++)
        for (int k = 0; k < 2; k++) {
            kvt_chat_free(ch[s][k]);
            kvt_service_destroy(svc[s][k]);
        }
    kvt_model_set_kv_scheme(m, KVT_KV_F32);
    return rc;
}

int kvt_bench_chat(int argc, char **argv)
{
    const char *model_path = NULL, *tok_path = NULL;
    long max_tokens = 16, turns = 10, block = 256, repeat = 3;
    uint64_t pc_bytes = 1ull << 30;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvtier bench chat: unknown flag or missing value: %s\n", a);
            usage(stderr);
            return 2;
        }
        const char *v = argv[++i];
        char *end = NULL;
        errno = 0;
        if (!strcmp(a, "--model"))
            model_path = v;
        else if (!strcmp(a, "--tokenizer"))
            tok_path = v;
        else if (!strcmp(a, "--prompt-cache")) {
            if (kvt_chat_parse_bytes(a, v, &pc_bytes) || pc_bytes == 0) {
                fprintf(stderr, "kvtier bench chat: --prompt-cache wants a byte count > 0, got '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--max-tokens") || !strcmp(a, "--turns") || !strcmp(a, "--block-tokens") ||
                   !strcmp(a, "--repeat")) {
            long x = strtol(v, &end, 10);
            long hi = !strcmp(a, "--turns") ? 10 : !strcmp(a, "--repeat") ? MAX_REPEAT : 1 << 20;
            if (errno || !end || *end || x < 1 || x > hi) {
                fprintf(stderr, "kvtier bench chat: %s wants an integer in [1, %ld], got '%s'\n", a, hi, v);
                return 2;
            }
            *(!strcmp(a, "--max-tokens") ? &max_tokens
              : !strcmp(a, "--turns")    ? &turns
              : !strcmp(a, "--repeat")   ? &repeat
                                         : &block) = x;
        } else {
            fprintf(stderr, "kvtier bench chat: unknown flag '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    kvt_model *m = NULL;
    kvt_tokenizer *tok = NULL;
    kvt_service *on[MAX_REPEAT] = {0}, *off = NULL;
    kvt_chat *c_on[MAX_REPEAT] = {0}, *c_off = NULL;
    int status = 1;
    int rc = kvt_chat_load(model_path, tok_path, &m, &tok);
    if (rc) {
        fprintf(stderr, "kvtier bench chat: cannot load the model: %s\n", kvt_last_error());
        return 1;
    }
    kvt_chat_service_opts so_on = {.prompt_cache_bytes = pc_bytes, .block_tokens = (int32_t)block};
    kvt_chat_service_opts so_off = {.prompt_cache_bytes = 0, .block_tokens = (int32_t)block};
    kvt_chat_opts co = {.max_tokens = max_tokens, .session = "bench"};
    rc = kvt_chat_service_create(m, &so_off, &off);
    if (!rc)
        rc = kvt_chat_create(m, tok, off, &co, &c_off);
    for (long k = 0; !rc && k < repeat; k++) {
        rc = kvt_chat_service_create(m, &so_on, &on[k]);
        if (!rc)
            rc = kvt_chat_create(m, tok, on[k], &co, &c_on[k]);
    }
    if (rc) {
        fprintf(stderr, "kvtier bench chat: setup failed: %s\n", kvt_last_error());
        goto done;
    }
    const kvt_model_config *cfg = kvt_model_get_config(m);
    double load[1] = {0};
    if (getloadavg(load, 1) == 1)
        printf("load average at start: %.2f (timings on a busy machine swing from run to run)\n", load[0]);
    printf("kvtier bench chat: %ld turns, %ld reply tokens per turn, greedy; model dim %d, %d layers, "
           "vocab %d; cache-on figures are medians of %ld runs\n", turns, max_tokens, cfg->dim, cfg->n_layers,
           cfg->vocab_size, repeat);
    printf("ttft = admission + prompt-cache lookup + prefill + first token (ms); on:pref-ms = the prefill\n"
           "alone inside it; new-only = prefill of only the tokens past the cached prefix + first token,\n"
           "measured right after the turn on the prefix taken from the service (the goal's baseline);\n"
           "on/new is the median over the runs of each run's ttft / its own new-only time.\n\n");
    printf("%4s %6s | %8s %9s | %8s %7s %9s %10s | %9s %7s | %7s\n", "turn", "prompt", "off:pref", "off:ttft",
           "on:reuse", "on:pref", "on:ttft", "on:pref-ms", "new-only", "on/new", "on/off");
    int goal_ok = 1, identical = 1;
    double max_over = 0; /* TTFT minus prefill: what admission, lookup and snapshots add */
    double sum_on = 0, sum_off = 0;
    for (long t = 0; t < turns; t++) {
        kvt_turn_stats s_off, s_on;
        const int32_t *ids_off = NULL, *ids_on = NULL;
        int64_t n_off = 0, n_on = 0, n = 0;
        double ttft[MAX_REPEAT], pref[MAX_REPEAT], base[MAX_REPEAT], over[MAX_REPEAT];
        const int32_t *on_ids[MAX_REPEAT];
        int64_t on_n[MAX_REPEAT];
        /* The cache-off turn runs first on odd turns and last on even ones, so
         * neither side always follows the other's decode. */
        if (t % 2 == 0 && (rc = kvt_chat_turn(c_off, script[t], NULL, &ids_off, &n_off, &s_off))) {
            fprintf(stderr, "kvtier bench chat: turn %ld (cache off) failed: %s\n", t + 1, kvt_last_error());
            goto done;
        }
        for (long k = 0; k < repeat; k++) {
            if ((rc = kvt_chat_turn(c_on[k], script[t], NULL, &ids_on, &n_on, &s_on))) {
                fprintf(stderr, "kvtier bench chat: turn %ld (cache on) failed: %s\n", t + 1, kvt_last_error());
                goto done;
            }
            on_ids[k] = ids_on;
            on_n[k] = n_on;
            const int32_t *prompt = kvt_chat_last_prompt(c_on[k], &n);
            if ((rc = baseline_ms(m, on[k], prompt, n, s_on.reused_tokens, &base[k]))) {
                fprintf(stderr, "kvtier bench chat: turn %ld: baseline failed: %s\n", t + 1, kvt_last_error());
                goto done;
            }
            ttft[k] = s_on.ttft_ms;
            pref[k] = s_on.prefill_ms;
            over[k] = s_on.ttft_ms - s_on.prefill_ms;
        }
        if (t % 2 == 1 && (rc = kvt_chat_turn(c_off, script[t], NULL, &ids_off, &n_off, &s_off))) {
            fprintf(stderr, "kvtier bench chat: turn %ld (cache off) failed: %s\n", t + 1, kvt_last_error());
            goto done;
        }
        for (long k = 0; k < repeat; k++) /* each reply buffer is valid until its chat's next turn */
            identical &= n_off == on_n[k] && !memcmp(ids_off, on_ids[k], (size_t)on_n[k] * sizeof *ids_off);
        double ratio[MAX_REPEAT]; /* each run's TTFT over its own baseline, measured next to it */
        for (long k = 0; k < repeat; k++)
            ratio[k] = base[k] > 0 ? ttft[k] / base[k] : 0;
        double m_on = kvt_bench_util_median(ttft, repeat), m_pref = kvt_bench_util_median(pref, repeat);
        double m_base = kvt_bench_util_median(base, repeat);
        for (long k = 0; k < repeat; k++)
            max_over = over[k] > max_over ? over[k] : max_over;
        double r_new = kvt_bench_util_median(ratio, repeat), r_off = s_off.ttft_ms > 0 ? m_on / s_off.ttft_ms : 0;
        if (t >= 1) {
            goal_ok &= r_new <= 1.2;
            sum_on += m_on;
            sum_off += s_off.ttft_ms;
        }
        printf("%4ld %6lld | %8lld %9.1f | %8lld %7lld %9.1f %10.1f | %9.1f %6.2fx | %6.2fx\n", t + 1,
               (long long)n, (long long)s_off.prefilled_tokens, s_off.ttft_ms, (long long)s_on.reused_tokens,
               (long long)s_on.prefilled_tokens, m_on, m_pref, m_base, r_new, r_off);
        fflush(stdout);
    }
    printf("\nturns 2-%ld: TTFT %.1f ms with the cache, %.1f ms without (%.2fx less)\n", turns, sum_on, sum_off,
           sum_on > 0 ? sum_off / sum_on : 0);
    printf("service overhead (ttft minus prefill, any turn, any run): at most %.2f ms\n", max_over);
    printf("replies identical with and without the cache: %s\n", identical ? "yes" : "NO");
    printf("goal (turns 2-%ld: TTFT on <= 1.2x new-only prefill): %s\n", turns, goal_ok ? "met" : "MISSED");
    status = identical ? 0 : 1;
    if (scheme_section(m, tok, turns, &so_on, &so_off, &co))
        status = 1;
done:
    for (long k = 0; k < repeat; k++) {
        kvt_chat_free(c_on[k]);
        kvt_service_destroy(on[k]);
    }
    kvt_chat_free(c_off);
    kvt_service_destroy(off);
    kvt_tokenizer_free(tok);
    kvt_model_free(m);
    return status;
}
