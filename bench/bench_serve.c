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
 * median), on one kept-alive connection as SDK clients send requests and
 * with a new connection per request; whether every reply was the same with
 * the cache on and off.
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
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

static double now_ms(void) { return (double)kvt_now_ns() / 1e6; }

/* ---- a blocking HTTP/1.0 client ------------------------------------------------------- */

typedef struct {
    int status;
    char *body;          /* NUL-terminated */
    double t_first;      /* ms: first content chunk of a stream (or the end) */
    double t_end;        /* ms: the response complete */
    double *ev;          /* (n_ev) ms: arrival of each streamed event carrying reply text */
    int n_ev, cap_ev;
} reply;

/* Whether one streamed event (NUL-terminated) carries reply text. */
static int has_text(const char *e)
{
    const char *c = strstr(e, "\"delta\":{\"content\":\"");
    if (c)
        return c[21] != '"';
    c = strstr(e, "\"text\":\"");
    return c && c[8] != '"';
}

/* Stamps the complete events of buf[*from, n) that carry text; *from moves
 * past the last complete event. */
static void stamp_events(reply *out, char *buf, size_t n, size_t *from)
{
    for (;;) {
        char *e = strstr(buf + *from, "\n\n");
        if (!e)
            return;
        *e = '\0';
        int text = has_text(buf + *from);
        *e = '\n';
        *from = (size_t)(e - buf) + 2;
        if (!text)
            continue;
        if (out->n_ev == out->cap_ev) {
            int nc = out->cap_ev ? out->cap_ev * 2 : 64;
            double *p = realloc(out->ev, (size_t)nc * sizeof *p);
            if (!p)
                return;
            out->ev = p;
            out->cap_ev = nc;
        }
        out->ev[out->n_ev++] = now_ms();
    }
    (void)n;
}

/* Sends `method path` with `body` (NULL: none) and reads the whole
 * response. @return 0, or -1 when the connection failed. */
static int http(int port, const char *method, const char *path, const char *body, reply *out)
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
    size_t bl = body ? strlen(body) : 0;
    char head[256];
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                      method, path, bl);
    if (send(fd, head, (size_t)hn, MSG_NOSIGNAL) != hn || (bl && send(fd, body, bl, MSG_NOSIGNAL) != (ssize_t)bl)) {
        close(fd);
        return -1;
    }
    size_t cap = 1 << 16, n = 0, scanned = 0;
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
        if (!scanned) { /* events start after the header */
            char *h = strstr(buf, "\r\n\r\n");
            scanned = h ? (size_t)(h - buf) + 4 : 0;
        }
        if (scanned)
            stamp_events(out, buf, n, &scanned);
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

static int post(int port, const char *path, const char *body, reply *out)
{
    return http(port, "POST", path, body, out);
}

/* ---- a keep-alive HTTP/1.1 client: one connection for many requests ------------------ */

/* How the official OpenAI SDKs talk to a server (a pool of persistent
 * connections): requests one after another on one TCP connection, so no
 * connect, accept or connection thread per request. */
typedef struct {
    int port;
    int fd; /* -1: not connected */
} keep_conn;

static void keep_close(keep_conn *k)
{
    if (k->fd >= 0)
        close(k->fd);
    k->fd = -1;
}

/* Sends `method path` with `body` (NULL: none) on k's connection (made
 * first when there is none) and reads the response up to its
 * Content-Length. Fills out->status, out->body and out->t_end as http()
 * does. @return 0, or -1 when the connection failed (k is closed; the
 * next call reconnects). */
static int http_keep(keep_conn *k, const char *method, const char *path, const char *body, reply *out)
{
    memset(out, 0, sizeof *out);
    if (k->fd < 0) {
        k->fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)k->port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int one = 1;
        if (k->fd < 0 || connect(k->fd, (struct sockaddr *)&a, sizeof a) ||
            setsockopt(k->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one)) {
            keep_close(k);
            return -1;
        }
    }
    size_t bl = body ? strlen(body) : 0;
    char *req = malloc(bl + 256);
    if (!req)
        return -1;
    int hn = snprintf(req, 256,
                      "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                      method, path, bl);
    memcpy(req + hn, body ? body : "", bl);
    ssize_t sent = send(k->fd, req, (size_t)hn + bl, MSG_NOSIGNAL); /* one segment: no Nagle wait */
    free(req);
    if (sent != (ssize_t)((size_t)hn + bl)) {
        keep_close(k);
        return -1;
    }
    size_t cap = 1 << 14, n = 0, head = 0;
    long long want = -1;
    char *buf = malloc(cap);
    while (buf) {
        if (head && want >= 0 && n >= head + (size_t)want)
            break;
        if (n + 4096 > cap) {
            char *p = realloc(buf, cap *= 2);
            if (!p)
                break;
            buf = p;
        }
        ssize_t got = recv(k->fd, buf + n, cap - n - 1, 0);
        if (got <= 0)
            break;
        n += (size_t)got;
        buf[n] = '\0';
        char *sep = head ? NULL : strstr(buf, "\r\n\r\n");
        if (sep) {
            head = (size_t)(sep - buf) + 4;
            for (char *l = strstr(buf, "\r\n"); l && l < sep; l = strstr(l + 2, "\r\n"))
                if (!strncasecmp(l + 2, "Content-Length:", 15))
                    want = atoll(l + 17);
        }
    }
    out->t_end = now_ms();
    out->t_first = out->t_end;
    if (!buf || !head || want < 0 || n < head + (size_t)want) {
        free(buf);
        keep_close(k);
        return -1;
    }
    buf[head + (size_t)want] = '\0';
    out->status = atoi(buf + 9);
    out->body = strdup(buf + head);
    free(buf);
    return out->body ? 0 : -1;
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
            free(r.ev);
            continue;
        }
        c->ttft[t] = r.t_first - t0;
        json_t *u = NULL;
        c->replies[t] = stream_text(r.body, &u);
        json_decref(u);
        free(r.body);
        free(r.ev);
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
    double *ev;          /* (n_ev) arrival times of the events carrying text, ms */
    int n_ev;
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
    json_t *u = NULL;
    /* an error is a failed request or a stream cut before its usage chunk;
     * a stream whose tokens all came in one event (or in none: a first
     * token without text) is a reply like any other, only not timed */
    if (!post(d->port, "/v1/completions", body, &r) && r.status == 200)
        free(stream_text(r.body, &u));
    if (!json_is_object(u)) {
        d->errors++;
        json_decref(u);
        free(r.body);
        free(r.ev);
        return NULL;
    }
    d->tokens = json_integer_value(json_object_get(u, "completion_tokens"));
    json_decref(u);
    d->t_first = r.t_first;
    d->t_end = r.t_end;
    d->ev = r.ev;
    d->n_ev = r.n_ev;
    free(r.body);
    return NULL;
}

/* One measurement of n concurrent streams. */
typedef struct {
    double all_rate;     /* tokens/s while all n streams decode (below) */
    double whole_rate;   /* tokens/s over first first-token .. last end (ramp-up and tail included) */
    double window_ms;    /* length of the window in which all n streams decode */
    double span_ms;      /* the longest stream's first-to-last-token time */
    int64_t coalesced;   /* tokens that arrived in one event with another (the connection fell behind) */
    int untimed;         /* streams whose tokens all arrived in one event (or none): no span to time */
} decode_fig;

/* Aggregate decode tokens/s of n concurrent streams of max_tokens each.
 * Each stream decodes its tokens after the first over its span, from the
 * arrival of its first text to that of its last; the window in which all n
 * decode runs from the latest first arrival to the earliest last one.
 * all_rate is the tokens decoded in that window per second, counting each
 * stream's tokens at its own mean rate over its span (events do not carry
 * one token each when a connection falls behind, so tokens are not counted
 * by event): the sum of the streams' rates, 0 when the window is empty
 * (the streams did not decode at the same time). With n = 1: tokens after
 * the first over the stream's span. whole_rate is tokens after each
 * stream's first over first first-token to last end. A stream whose tokens
 * all arrived in one event (untimed) has no span: its tokens count in
 * whole_rate, and it is left out of the window and of all_rate. */
static decode_fig decode_rate(int port, int n, int max_tokens, int *errors)
{
    decoder *d = calloc((size_t)n, sizeof *d);
    pthread_t *th = calloc((size_t)n, sizeof *th);
    for (int i = 0; i < n; i++) {
        d[i] = (decoder){.port = port, .id = i, .max_tokens = max_tokens};
        pthread_create(&th[i], NULL, decoder_main, &d[i]);
    }
    double lo = 1e300, hi = 0, w_lo = 0, w_hi = 1e300;
    int64_t tokens = 0;
    decode_fig f = {0};
    int ok = 1;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        *errors += d[i].errors;
        if (d[i].errors) {
            ok = 0;
            continue;
        }
        tokens += d[i].tokens > 1 ? d[i].tokens - 1 : 0;
        f.coalesced += d[i].tokens > d[i].n_ev ? d[i].tokens - d[i].n_ev : 0;
        lo = d[i].t_first < lo ? d[i].t_first : lo;
        hi = d[i].t_end > hi ? d[i].t_end : hi;
        if (d[i].n_ev < 2) { /* its tokens came at once: it has no decode span of its own */
            f.untimed++;
            continue;
        }
        w_lo = d[i].ev[0] > w_lo ? d[i].ev[0] : w_lo;
        w_hi = d[i].ev[d[i].n_ev - 1] < w_hi ? d[i].ev[d[i].n_ev - 1] : w_hi;
    }
    double sum = 0;
    for (int i = 0; ok && i < n; i++) {
        if (d[i].n_ev < 2)
            continue;
        double span = d[i].ev[d[i].n_ev - 1] - d[i].ev[0];
        f.span_ms = span > f.span_ms ? span : f.span_ms;
        sum += span > 0 ? (double)(d[i].tokens - 1) / (span / 1000.0) : 0.0;
    }
    if (ok && f.untimed < n && w_hi > w_lo) {
        f.all_rate = sum;
        f.window_ms = w_hi - w_lo;
    }
    f.whole_rate = hi > lo ? (double)tokens / ((hi - lo) / 1000.0) : 0.0;
    for (int i = 0; i < n; i++)
        free(d[i].ev);
    free(d);
    free(th);
    return f;
}

/* Median over `n` sequential one-token completions of client wall time
 * minus the request's engine_ms, sent over one kept-alive HTTP/1.1
 * connection (keep != NULL, as SDK clients send them) or each over a new
 * HTTP/1.0 connection (keep NULL: TCP connect, the HTTP library's accept and
 * connection thread, close, all counted). *floor_ms receives the median wall
 * time of a GET /health sent the same way before each completion: what a
 * request costs with no JSON, no scheduling and no engine, the baseline of
 * the same run. */
static double overhead_ms(int port, keep_conn *keep, int n, int *errors, double *floor_ms)
{
    double *v = calloc((size_t)n, sizeof *v), *h = calloc((size_t)n, sizeof *h);
    int k = 0, kh = 0;
    static const char body[] = "{\"prompt\": [1, 30, 31, 32], \"max_tokens\": 1, \"temperature\": 0}";
    for (int i = 0; v && h && i < n; i++) {
        reply r;
        double t0 = now_ms();
        int rc = keep ? http_keep(keep, "GET", "/health", NULL, &r) : http(port, "GET", "/health", NULL, &r);
        if (!rc && r.status == 200)
            h[kh++] = r.t_end - t0;
        else
            (*errors)++;
        free(r.body);
        free(r.ev);
        t0 = now_ms();
        rc = keep ? http_keep(keep, "POST", "/v1/completions", body, &r) : post(port, "/v1/completions", body, &r);
        if (rc || r.status != 200) {
            (*errors)++;
            free(r.body);
            free(r.ev);
            continue;
        }
        json_t *doc = json_loads(r.body, 0, NULL);
        double engine = json_number_value(json_object_get(json_object_get(json_object_get(doc, "usage"), "kvtier"),
                                                          "engine_ms"));
        v[k++] = (r.t_end - t0) - engine;
        json_decref(doc);
        free(r.body);
        free(r.ev);
    }
    double m = k ? kvt_bench_util_median(v, k) : 0.0;
    *floor_ms = kh ? kvt_bench_util_median(h, kh) : 0.0;
    free(v);
    free(h);
    return m;
}

/* ---- the engine alone, at the same moment ----------------------------------------------------- */

/* Decode tokens/s of the engine alone at batch n (kvt_model_decode_batch,
 * n sequences each holding a 3-token prompt, `steps` steps): the ceiling
 * the server's batched decode is measured against. 0 on an error. */
static double engine_rate(kvt_model *m, int n, int steps)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    size_t L = (size_t)c->n_layers, V = (size_t)c->vocab_size;
    kvt_cache ***caches = calloc((size_t)n, sizeof *caches);
    int32_t *toks = calloc((size_t)n, sizeof *toks);
    float *logits = malloc((size_t)n * V * sizeof *logits);
    int rc = caches && toks && logits ? 0 : KVT_ENOMEM;
    for (int i = 0; !rc && i < n; i++) {
        int32_t prompt[3] = {1, 10 + i, 20 + i};
        caches[i] = calloc(L, sizeof **caches);
        rc = caches[i] ? kvt_model_new_caches(m, 256, caches[i]) : KVT_ENOMEM;
        if (!rc)
            rc = kvt_model_prefill(m, caches[i], prompt, 3, logits);
        toks[i] = 30 + i;
    }
    double t0 = now_ms();
    for (int k = 0; !rc && k < steps; k++) {
        rc = kvt_model_decode_batch(m, n, (kvt_cache **const *)caches, toks, logits);
        for (int i = 0; i < n; i++)
            toks[i] = (toks[i] * 31 + k) % c->vocab_size;
    }
    double ms = now_ms() - t0;
    for (int i = 0; caches && i < n; i++)
        if (caches[i]) {
            kvt_caches_destroy(caches[i], (int32_t)L);
            free(caches[i]);
        }
    free(caches);
    free(toks);
    free(logits);
    return rc || ms <= 0 ? 0.0 : (double)n * steps / (ms / 1000.0);
}

/* GETs /stats and returns its "engine" object (decref), NULL on failure. */
static json_t *engine_stats(int port)
{
    reply r;
    usleep(20000); /* the step that finished the last reply has copied its figures */
    if (http(port, "GET", "/stats", NULL, &r) || r.status != 200) {
        free(r.body);
        free(r.ev);
        return NULL;
    }
    json_t *doc = json_loads(r.body, 0, NULL);
    json_t *e = json_incref(json_object_get(doc, "engine"));
    json_decref(doc);
    free(r.body);
    free(r.ev);
    return e;
}

static double num(json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

/* Tokens per second of the decode steps the engine thread ran between two
 * /stats "engine" objects: decode rows over the steps' engine-thread time
 * (the server's own view, without HTTP). 0 when either is missing. */
static double steps_rate(json_t *a, json_t *b)
{
    json_t *ha = json_object_get(a, "batch_size_histogram"), *hb = json_object_get(b, "batch_size_histogram");
    double sec = 0;
    for (size_t i = 0; a && b && i < json_array_size(hb); i++)
        sec += num(json_array_get(hb, i), "seconds") - num(json_array_get(ha, i), "seconds");
    return sec > 0 ? (num(b, "batch_sequences") - num(a, "batch_sequences")) / sec : 0.0;
}

/* Prints what the engine did between two /stats "engine" objects. */
static void print_engine_delta(const char *what, json_t *a, json_t *b)
{
    if (!a || !b)
        return;
    double steps = num(b, "decode_steps") - num(a, "decode_steps");
    double seqs = num(b, "batch_sequences") - num(a, "batch_sequences");
    printf("  engine during %s: %.0f decode steps, mean batch %.2f, %.0f with prefill mixed in, %.0f prefill passes, "
           "%.0f joined a step late, %.0f left early\n", what, steps, steps > 0 ? seqs / steps : 0.0,
           num(b, "mixed_steps") - num(a, "mixed_steps"), num(b, "prefill_passes") - num(a, "prefill_passes"),
           num(b, "joined") - num(a, "joined"), num(b, "left_early") - num(a, "left_early"));
    /* steps by batch size, with their rate (sequences x steps / the steps' engine-thread time) */
    json_t *ha = json_object_get(a, "batch_size_histogram"), *hb = json_object_get(b, "batch_size_histogram");
    printf("  decode steps by batch size:");
    for (size_t i = 0; i < json_array_size(hb); i++) {
        json_t *x = json_array_get(ha, i), *y = json_array_get(hb, i);
        double c = num(y, "count") - num(x, "count"), sec = num(y, "seconds") - num(x, "seconds");
        json_t *le = json_object_get(y, "le");
        if (c > 0 && json_is_integer(le) && json_integer_value(le) <= 8) /* buckets 1..8 hold one size each */
            printf(" [%lld] %.0f steps %.1f tokens/s", (long long)json_integer_value(le), c,
                   sec > 0 ? (double)json_integer_value(le) * c / sec : 0.0);
        else if (c > 0)
            printf(" [%s] %.0f steps", json_is_integer(le) ? "9-64" : ">64", c);
    }
    printf("\n");
    json_t *pa = json_object_get(a, "phase_seconds"), *pb = json_object_get(b, "phase_seconds");
    double total = num(b, "step_seconds") - num(a, "step_seconds");
    printf("  engine-thread time %.3f s:", total);
    const char *k;
    json_t *v;
    json_object_foreach(pb, k, v) {
        double d = json_number_value(v) - num(pa, k);
        printf(" %s %.3f s (%.0f%%)", k, d, total > 0 ? 100.0 * d / total : 0.0);
    }
    double ev = num(b, "sse_events") - num(a, "sse_events");
    printf("\n  streamed events %.0f: build %.1f us, lag token->handed to HTTP %.2f ms (means)\n", ev,
           ev > 0 ? (num(b, "sse_build_seconds") - num(a, "sse_build_seconds")) / ev * 1e6 : 0.0,
           ev > 0 ? (num(b, "sse_lag_seconds") - num(a, "sse_lag_seconds")) / ev * 1e3 : 0.0);
}

static double median_of(const double *v, int n)
{
    double *w = malloc((size_t)n * sizeof *w);
    memcpy(w, v, (size_t)n * sizeof *w);
    double r = kvt_bench_util_median(w, n);
    free(w);
    return r;
}

static double load1(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1)
            l = -1;
        fclose(f);
    }
    return l;
}

/* ---- the benchmark ------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier bench serve [--model M.bin --tokenizer T.bin] [--streams S] [--turns T]\n"
               "                          [--max-tokens N] [--decode-tokens N] [--decode-rounds R]\n"
               "                          [--overhead-requests N]\n"
               "\n"
               "kvtier serve over HTTP on loopback, prompt cache on and off in one run (default: the\n"
               "built-in default model, 8 streams, 10 turns, 16 reply tokens per turn):\n"
               "  TTFT p50/p99 per turn of S concurrent T-turn conversations, on and off;\n"
               "  aggregate decode tokens/s of S concurrent streams vs one stream (--decode-tokens each,\n"
               "  default 64), cache on and off: counted over the window in which all S streams decode\n"
               "  (last first token to first last token; a stream whose tokens all came in one event is a\n"
               "  reply, not an error, left out of that window), median of R rounds (default 3) that alternate\n"
               "  1 and S streams, each beside the engine alone at batch 1 and S at that moment\n"
               "  (kvt_model_decode_batch: the ceiling), and the engine's batch-size histogram and\n"
               "  time split over the S-stream runs (/stats \"engine\");\n"
               "  what the server adds per request outside prefill and decode (median of\n"
               "  --overhead-requests sequential one-token completions, default 50) on one kept-alive\n"
               "  HTTP/1.1 connection, as the OpenAI SDKs send them, and again with a new connection\n"
               "  per request, each beside the round trip of a GET /health sent the same way before\n"
               "  each completion (the baseline).\n");
}

int kvt_bench_serve(int argc, char **argv)
{
    const char *model = NULL, *tok = NULL;
    long long streams = 8, turns = 10, max_tokens = 16, decode_tokens = 64, n_over = 50, rounds = 3;
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
            bad = kvt_cli_int(v, 1, 4096, &decode_tokens);
        else if (!strcmp(a, "--overhead-requests"))
            bad = kvt_cli_int(v, 1, 100000, &n_over);
        else if (!strcmp(a, "--decode-rounds"))
            bad = kvt_cli_int(v, 1, 100, &rounds);
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
    int S = (int)streams, T = (int)turns, R = (int)rounds;
    conv *cv[2];
    double over = 0, over_floor = 0, over_new = 0, over_new_floor = 0;
    int errors = 0;
    /* per server (cache off 0, on 1) and round: the S-stream and 1-stream
     * figures over HTTP, the engine alone at batch S and 1 */
    decode_fig (*dS)[100] = calloc(2, sizeof *dS), (*d1)[100] = calloc(2, sizeof *d1);
    double eS[2][100], e1[2][100], ld[2][2], sS[2][100], s1[2][100];
    json_t *eng0[2] = {NULL, NULL}, *eng1[2] = {NULL, NULL};
    kvt_model *alone = NULL;
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
        if (!alone) { /* the same file the server maps: the engine alone, beside it */
            const char *mp = model;
            char dm[4096], dt[4096];
            if (!mp && kvt_default_model(dm, sizeof dm, dt, sizeof dt) == 0)
                mp = dm;
            if (!mp || kvt_model_load(mp, &alone) != 0) {
                fprintf(stderr, "kvtier bench serve: cannot load the model for the engine figures: %s\n",
                        kvt_last_error());
                kvt_server_destroy(srv);
                return 1;
            }
        }
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
        fprintf(stderr, "decode: %d rounds of 1 stream, %d streams, the engine alone at 1 and %d, %lld tokens each...\n",
                R, S, S, decode_tokens);
        ld[on][0] = load1();
        for (int r = 0; r < R; r++) {
            json_t *a1 = engine_stats(port);
            d1[on][r] = decode_rate(port, 1, (int)decode_tokens, &errors);
            json_decref(eng0[on]); /* the last S-stream run's engine figures are printed */
            json_decref(eng1[on]);
            eng0[on] = engine_stats(port);
            s1[on][r] = steps_rate(a1, eng0[on]);
            json_decref(a1);
            dS[on][r] = decode_rate(port, S, (int)decode_tokens, &errors);
            eng1[on] = engine_stats(port);
            sS[on][r] = steps_rate(eng0[on], eng1[on]);
            e1[on][r] = engine_rate(alone, 1, (int)decode_tokens);
            eS[on][r] = engine_rate(alone, S, (int)decode_tokens);
        }
        ld[on][1] = load1();
        if (on) {
            keep_conn kc = {.port = port, .fd = -1};
            over = overhead_ms(port, &kc, (int)n_over, &errors, &over_floor);
            keep_close(&kc);
            over_new = overhead_ms(port, NULL, (int)n_over, &errors, &over_new_floor);
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
    int met = 1;
    for (int on = 1; on >= 0; on--) {
        double a[100], w[100], o1[100], g1[100], gS[100], win[100], span[100];
        int64_t coal = 0;
        int untimed = 0;
        for (int r = 0; r < R; r++) {
            untimed += dS[on][r].untimed + d1[on][r].untimed;
            a[r] = dS[on][r].all_rate;
            w[r] = dS[on][r].whole_rate;
            o1[r] = d1[on][r].all_rate;
            g1[r] = e1[on][r];
            gS[r] = eS[on][r];
            win[r] = dS[on][r].window_ms;
            span[r] = dS[on][r].span_ms;
            coal += dS[on][r].coalesced + d1[on][r].coalesced;
        }
        double mS = median_of(a, R), m1 = median_of(o1, R), mw = median_of(w, R);
        double mgS = median_of(gS, R), mg1 = median_of(g1, R);
        double msS = median_of(sS[on], R), ms1 = median_of(s1[on], R);
        met &= m1 > 0 && mS >= 4 * m1;
        printf("decode, cache %s (median of %d rounds, load %.1f -> %.1f): %d streams %.1f tokens/s aggregate while all "
               "%d decode (window %.0f of %.0f ms; %.1f over first first-token to last end), 1 stream %.1f tokens/s: "
               "%.2fx (goal >= 4x); rounds:", on ? "on" : "off", R, ld[on][0], ld[on][1], S, mS, S, median_of(win, R),
               median_of(span, R), mw,
               m1, m1 > 0 ? mS / m1 : 0.0);
        for (int r = 0; r < R; r++)
            printf(" %.2fx", o1[r] > 0 ? a[r] / o1[r] : 0.0);
        printf("\n  engine alone (kvt_model_decode_batch) at the same moments: batch %d %.1f tokens/s, batch 1 %.1f "
               "tokens/s: %.2fx; serve reaches %.0f%% of the engine at batch %d, %.0f%% at batch 1\n", S, mgS, mg1,
               mg1 > 0 ? mgS / mg1 : 0.0, mgS > 0 ? 100.0 * mS / mgS : 0.0, S, mg1 > 0 ? 100.0 * m1 / mg1 : 0.0);
        printf("  server side (the engine thread's decode steps, no HTTP): %d streams %.1f tokens/s, 1 stream %.1f "
               "tokens/s: %.2fx\n", S, msS, ms1, ms1 > 0 ? msS / ms1 : 0.0);
        if (coal)
            printf("  %lld tokens arrived in one event with another (a connection fell behind)\n", (long long)coal);
        if (untimed)
            printf("  %d streams got all their tokens in one event: replies, not errors, but without a decode span "
                   "they are left out of the windowed rates\n", untimed);
        print_engine_delta("the last S-stream run", eng0[on], eng1[on]);
        json_decref(eng0[on]);
        json_decref(eng1[on]);
    }
    printf("decode goal (%d streams >= 4x one stream, cache on and off): %s\n", S, met ? "met" : "MISSED");
    printf("server overhead per request (client wall time minus engine time, median of %lld one-token completions "
           "on one kept-alive HTTP/1.1 connection, as the OpenAI SDKs send them): %.3f ms (goal < 1 ms: %s); "
           "baseline: GET /health on that connection, alternating with them: %.3f ms (load %.1f)\n",
           n_over, over, over < 1.0 ? "met" : "MISSED", over_floor, load1());
    printf("  the same with a new HTTP/1.0 connection per request (connect, accept, the connection's thread and close "
           "counted): %.3f ms; baseline: GET /health over a new connection, alternating with them: %.3f ms\n",
           over_new, over_new_floor);
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
    free(dS);
    free(d1);
    kvt_model_free(alone);
    return same && !errors ? 0 : 1;
}
