/*
 * bench_serve.c: `kvtier bench serve`: the server measured over HTTP on
 * loopback, with the prompt cache on and off in one run (two servers in
 * this process, one after the other; clients are threads speaking HTTP/1.0
 * over sockets, streaming so TTFT is what a client sees: request sent to the
 * first content chunk received).
 *
 * Prints: TTFT p50/p99 per turn of S concurrent T-turn conversations, cache
 * on and off, and turns 2..T pooled (goal: on <= 1/3 of off); aggregate
 * decode tokens/s of S concurrent streams against one stream (goal >= 4x);
 * what the server adds per request outside prefill and decode (HTTP, JSON,
 * scheduling: client wall time minus the request's engine_ms; goal < 1 ms
 * median); whether every reply was the same with the cache on and off.
 */
#include "bench_util.h"
#include "chat.h"
#include "cli.h"
#include "args.h"
#include "server.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static double now_ms(void) { return (double)kvt_now_ns() / 1e6; }

/* ---- a blocking HTTP/1.0 client ------------------------------------------------------- */

typedef struct {
    int status;
    char *body;          /* NUL-terminated */
    double t_first;      /* ms: first content chunk of a stream (or the end) */
    double t_end;        /* ms: the response complete */
} reply;

/* POSTs `body` to `path` and reads the whole response. @return 0, or -1 when
 * the connection failed. */
static int post(int port, const char *path, const char *body, reply *out)
{
    memset(out, 0, sizeof *out);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    size_t bl = strlen(body);
    char head[256];
    int hn = snprintf(head, sizeof head,
                      "POST %s HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                      path, bl);
    if (send(fd, head, (size_t)hn, MSG_NOSIGNAL) != hn || send(fd, body, bl, MSG_NOSIGNAL) != (ssize_t)bl) {
        close(fd);
        return -1;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 4096 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t k = recv(fd, buf + n, cap - n - 1, 0);
        if (k <= 0)
            break;
        n += (size_t)k;
        buf[n] = '\0';
        if (!out->t_first && (strstr(buf, "\"delta\":{\"content\"") || strstr(buf, "\"text\":\"")))
            out->t_first = now_ms();
    }
    close(fd);
    out->t_end = now_ms();
    if (!out->t_first)
        out->t_first = out->t_end;
    buf[n] = '\0';
    char *sep = strstr(buf, "\r\n\r\n");
    out->status = n > 12 ? atoi(buf + 9) : -1;
    out->body = strdup(sep ? sep + 4 : "");
    free(buf);
    return 0;
}

/* Content of a streamed chat reply or the completion's text, concatenated;
 * *usage receives the usage chunk (decref) or NULL. Caller frees. */
static char *stream_text(const char *body, json_t **usage)
{
    size_t cap = strlen(body) + 1, n = 0;
    char *text = calloc(1, cap);
    *usage = NULL;
    for (const char *p = strstr(body, "data: "); p; p = strstr(p + 1, "data: ")) {
        const char *e = strstr(p, "\n\n");
        if (!e)
            break;
        json_t *doc = json_loadb(p + 6, (size_t)(e - p - 6), 0, NULL);
        json_t *c = json_array_get(json_object_get(doc, "choices"), 0);
        const char *piece = json_string_value(json_object_get(json_object_get(c, "delta"), "content"));
        if (!piece)
            piece = json_string_value(json_object_get(c, "text"));
        if (piece) {
            memcpy(text + n, piece, strlen(piece));
            n += strlen(piece);
        }
        json_t *u = json_object_get(doc, "usage");
        if (json_is_object(u)) {
            json_decref(*usage);
            *usage = json_incref(u);
        }
        json_decref(doc);
    }
    return text;
}

/* ---- conversations ---------------------------------------------------------------------- */

typedef struct {
    int port, id, turns, max_tokens;
    double *ttft;        /* (turns) ms */
    char **replies;      /* (turns) */
    int errors;
} conv;

static const char *const questions[] = {
    "Hello! Can you tell me a short story about a cat?", "What was the name of the cat?",
    "Where did the cat live?", "What did the cat like to eat?", "Did the cat have a friend?",
    "What happened one rainy day?", "How did the cat feel then?", "What did the friends do next?",
    "What happened at the end?", "Thank you, that was lovely.",
};

static void *conv_main(void *arg)
{
    conv *c = arg;
    for (int t = 0; t < c->turns; t++) {
        json_t *msgs = json_array();
        for (int i = 0; i <= t; i++) {
            char u[256];
            snprintf(u, sizeof u, "Conversation %d: %s", c->id, questions[i % 10]);
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", u));
            if (i < t)
                json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", c->replies[i]));
        }
        json_t *req = json_pack("{s:o, s:f, s:i, s:b, s:{s:b}}", "messages", msgs, "temperature", 0.0, "max_tokens",
                                c->max_tokens, "stream", 1, "stream_options", "include_usage", 1);
        char *body = json_dumps(req, JSON_COMPACT);
        json_decref(req);
        reply r;
        double t0 = now_ms();
        int rc = post(c->port, "/v1/chat/completions", body, &r);
        free(body);
        if (rc || r.status != 200) {
            c->errors++;
            c->replies[t] = strdup("");
            free(r.body);
            continue;
        }
        c->ttft[t] = r.t_first - t0;
        json_t *u = NULL;
        c->replies[t] = stream_text(r.body, &u);
        json_decref(u);
        free(r.body);
    }
    return NULL;
}

static double pct(double *v, int n, double p)
{
    double *w = malloc((size_t)n * sizeof *w);
    memcpy(w, v, (size_t)n * sizeof *w);
    for (int i = 1; i < n; i++) /* insertion sort: n is small */
        for (int k = i; k > 0 && w[k - 1] > w[k]; k--) {
            double x = w[k];
            w[k] = w[k - 1];
            w[k - 1] = x;
        }
    int idx = (int)(p * (n - 1) + 0.5);
    double r = w[idx];
    free(w);
    return r;
}

/* ---- decode throughput and overhead ------------------------------------------------------ */

typedef struct {
    int port, id, max_tokens;
    int64_t tokens;
    double t_first, t_end;
    int errors;
} decoder;

static void *decoder_main(void *arg)
{
    decoder *d = arg;
    char body[256];
    /* token-id prompts: no template, no newline stop; the seed varies the text */
    snprintf(body, sizeof body,
             "{\"prompt\": [1, %d, %d], \"max_tokens\": %d, \"temperature\": 1, \"seed\": %d, \"stream\": true, "
             "\"stream_options\": {\"include_usage\": true}}", 10 + d->id, 20 + d->id, d->max_tokens, d->id + 1);
    reply r;
    if (post(d->port, "/v1/completions", body, &r) || r.status != 200) {
        d->errors++;
        free(r.body);
        return NULL;
    }
    json_t *u = NULL;
    free(stream_text(r.body, &u));
    d->tokens = json_integer_value(json_object_get(u, "completion_tokens"));
    json_decref(u);
    d->t_first = r.t_first;
    d->t_end = r.t_end;
    free(r.body);
    return NULL;
}

/* Aggregate decode tokens/s of n concurrent streams: tokens after each
 * stream's first, over the window from the first first-token to the last end. */
static double decode_rate(int port, int n, int max_tokens, int *errors)
{
    decoder *d = calloc((size_t)n, sizeof *d);
    pthread_t *th = calloc((size_t)n, sizeof *th);
    for (int i = 0; i < n; i++) {
        d[i] = (decoder){.port = port, .id = i, .max_tokens = max_tokens};
        pthread_create(&th[i], NULL, decoder_main, &d[i]);
    }
    double lo = 1e300, hi = 0;
    int64_t tokens = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        *errors += d[i].errors;
        if (d[i].errors)
            continue;
        tokens += d[i].tokens > 1 ? d[i].tokens - 1 : 0;
        lo = d[i].t_first < lo ? d[i].t_first : lo;
        hi = d[i].t_end > hi ? d[i].t_end : hi;
    }
    free(d);
    free(th);
    return hi > lo ? (double)tokens / ((hi - lo) / 1000.0) : 0.0;
}

/* Median over `n` sequential one-token completions of client wall time
 * minus the request's engine_ms. */
static double overhead_ms(int port, int n, int *errors)
{
    double *v = calloc((size_t)n, sizeof *v);
    int k = 0;
    for (int i = 0; i < n; i++) {
        reply r;
        double t0 = now_ms();
        if (post(port, "/v1/completions", "{\"prompt\": [1, 30, 31, 32], \"max_tokens\": 1, \"temperature\": 0}", &r) ||
            r.status != 200) {
            (*errors)++;
            free(r.body);
            continue;
        }
        json_t *doc = json_loads(r.body, 0, NULL);
        double engine = json_number_value(json_object_get(json_object_get(json_object_get(doc, "usage"), "kvtier"),
                                                          "engine_ms"));
        v[k++] = (r.t_end - t0) - engine;
        json_decref(doc);
        free(r.body);
    }
    double m = k ? kvt_bench_util_median(v, k) : 0.0;
    free(v);
    return m;
}

/* ---- the benchmark ------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier bench serve [--model M.bin --tokenizer T.bin] [--streams S] [--turns T]\n"
               "                          [--max-tokens N] [--decode-tokens N] [--overhead-requests N]\n"
               "\n"
               "kvtier serve over HTTP on loopback, prompt cache on and off in one run (default: the\n"
               "built-in default model, 8 streams, 10 turns, 16 reply tokens per turn):\n"
               "  TTFT p50/p99 per turn of S concurrent T-turn conversations, on and off;\n"
               "  aggregate decode tokens/s of S concurrent streams vs one stream (--decode-tokens each,\n"
               "  default 64);\n"
               "  what the server adds per request outside prefill and decode (median of\n"
               "  --overhead-requests sequential one-token completions, default 50).\n");
}

int kvt_bench_serve(int argc, char **argv)
{
    const char *model = NULL, *tok = NULL;
    long long streams = 8, turns = 10, max_tokens = 16, decode_tokens = 64, n_over = 50;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvtier bench serve: unknown flag or missing value: %s\n", a);
            return 2;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--tokenizer"))
            tok = v;
        else if (!strcmp(a, "--streams"))
            bad = kvt_cli_int(v, 1, 64, &streams);
        else if (!strcmp(a, "--turns"))
            bad = kvt_cli_int(v, 1, 10, &turns);
        else if (!strcmp(a, "--max-tokens"))
            bad = kvt_cli_int(v, 1, 1024, &max_tokens);
        else if (!strcmp(a, "--decode-tokens"))
            bad = kvt_cli_int(v, 2, 4096, &decode_tokens);
        else if (!strcmp(a, "--overhead-requests"))
            bad = kvt_cli_int(v, 1, 100000, &n_over);
        else {
            fprintf(stderr, "kvtier bench serve: unknown flag %s\n", a);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvtier bench serve: bad value for %s: '%s'\n", a, v);
            return 2;
        }
    }
    if ((model != NULL) != (tok != NULL)) {
        fprintf(stderr, "kvtier bench serve: give --model and --tokenizer together\n");
        return 2;
    }
    int S = (int)streams, T = (int)turns;
    conv *cv[2];
    double rate1 = 0, rateS = 0, over = 0;
    int errors = 0;
    for (int on = 1; on >= 0; on--) {
        kvt_server_opts o = {.model_path = model, .tok_path = tok, .prompt_cache_bytes = on ? 4ull << 30 : 0,
                             .max_queue = 256, .max_running = 64};
        kvt_server *srv = NULL;
        int rc = kvt_server_start(&o, &srv);
        if (!rc)
            rc = kvt_server_load(srv);
        if (rc) {
            fprintf(stderr, "kvtier bench serve: cannot start the server: %s\n", kvt_last_error());
            kvt_server_destroy(srv);
            return 1;
        }
        int port = kvt_server_port(srv);
        fprintf(stderr, "cache %s: %d conversations x %d turns on %s...\n", on ? "on" : "off", S, T,
                kvt_server_model_name(srv));
        cv[on] = calloc((size_t)S, sizeof *cv[on]);
        pthread_t *th = calloc((size_t)S, sizeof *th);
        for (int i = 0; i < S; i++) {
            cv[on][i] = (conv){.port = port, .id = i, .turns = T, .max_tokens = (int)max_tokens,
                               .ttft = calloc((size_t)T, sizeof(double)), .replies = calloc((size_t)T, sizeof(char *))};
            pthread_create(&th[i], NULL, conv_main, &cv[on][i]);
        }
        for (int i = 0; i < S; i++) {
            pthread_join(th[i], NULL);
            errors += cv[on][i].errors;
        }
        free(th);
        if (on) {
            fprintf(stderr, "decode: 1 stream, then %d streams, %lld tokens each...\n", S, decode_tokens);
            rate1 = decode_rate(port, 1, (int)decode_tokens, &errors);
            rateS = decode_rate(port, S, (int)decode_tokens, &errors);
            over = overhead_ms(port, (int)n_over, &errors);
        }
        kvt_server_stop(srv, 10000);
        kvt_server_destroy(srv);
    }
    printf("kvtier bench serve: %d concurrent conversations, %d turns, %lld reply tokens per turn (ms, client-side "
           "TTFT: request sent to first content chunk)\n", S, T, max_tokens);
    printf("turn |  off p50  off p99 |   on p50   on p99 | on/off p50\n");
    double *pool[2];
    int pn = 0;
    pool[0] = calloc((size_t)(S * T), sizeof(double));
    pool[1] = calloc((size_t)(S * T), sizeof(double));
    double *col = calloc((size_t)S, sizeof(double));
    for (int t = 0; t < T; t++) {
        double p[2][2];
        for (int on = 0; on <= 1; on++) {
            for (int i = 0; i < S; i++)
                col[i] = cv[on][i].ttft[t];
            p[on][0] = pct(col, S, 0.5);
            p[on][1] = pct(col, S, 0.99);
        }
        printf("%4d | %8.1f %8.1f | %8.1f %8.1f | %7.2fx\n", t + 1, p[0][0], p[0][1], p[1][0], p[1][1],
               p[0][0] > 0 ? p[1][0] / p[0][0] : 0.0);
        if (t > 0) {
            for (int i = 0; i < S; i++) {
                pool[0][pn] = cv[0][i].ttft[t];
                pool[1][pn++] = cv[1][i].ttft[t];
            }
        }
    }
    int same = 1;
    for (int i = 0; i < S; i++)
        for (int t = 0; t < T; t++)
            same &= !strcmp(cv[0][i].replies[t], cv[1][i].replies[t]);
    if (pn) {
        double on50 = pct(pool[1], pn, 0.5), off50 = pct(pool[0], pn, 0.5);
        printf("turns 2-%d: TTFT p50 %.1f ms with the cache, %.1f ms without (%.2fx; goal <= 0.33x: %s)\n", T, on50,
               off50, off50 > 0 ? on50 / off50 : 0.0, on50 <= off50 / 3 ? "met" : "MISSED");
    }
    printf("decode: %d streams %.1f tokens/s aggregate, 1 stream %.1f tokens/s (%.2fx; goal >= 4x: %s)\n", S, rateS,
           rate1, rate1 > 0 ? rateS / rate1 : 0.0, rateS >= 4 * rate1 ? "met" : "MISSED");
    printf("server overhead per request (client wall time minus engine time, median of %lld): %.3f ms (goal < 1 ms: "
           "%s)\n", n_over, over, over < 1.0 ? "met" : "MISSED");
    printf("replies identical with and without the cache: %s; request errors: %d\n", same ? "yes" : "NO", errors);
    for (int on = 0; on <= 1; on++) {
        for (int i = 0; i < S; i++) {
            for (int t = 0; t < T; t++)
                free(cv[on][i].replies[t]);
            free(cv[on][i].replies);
            free(cv[on][i].ttft);
        }
        free(cv[on]);
    }
    free(pool[0]);
    free(pool[1]);
    free(col);
    return same && !errors ? 0 : 1;
}
