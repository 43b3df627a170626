/*
 * server.c: HTTP and routing of `kvtier serve` (server.h) on libmicrohttpd,
 * one thread per connection. A connection thread parses and validates a
 * request, tokenizes it, checks it against the context and the KV budget,
 * submits it to the engine thread (scheduler.h) and then waits on the job: a
 * whole JSON response, or server-sent events as the reply grows. While it
 * waits it watches its socket, so a client that goes away cancels its job
 * within one engine step.
 *
 * Must never: log the API key, read more than --max-body bytes of a body
 * into memory, let a client's input reach the engine unvalidated, or block
 * the engine thread on a client.
 */
#include "server.h"

#include "dashboard.h"
#include "metrics.h"
#include "openai.h"
#include "scheduler.h"

#include "chat.h"
#include "kvtier/pool.h"
#include "tiers.h"
#include "util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* One served model: its engine, tokenizer, tier stack, cache service and
 * engine thread. Set by load; read-only afterwards (tiers_st under tiers_mu). */
typedef struct srv_model {
    char *model_path, *tok_path, *name_opt; /* owned copies of the options */
    kvt_model *m;
    kvt_tokenizer *tok;
    kvt_tiers *tiers;            /* the tier stack under the prompt cache (SSD, ...) */
    kvt_store *store;            /* its SSD level's store, NULL without one (or while off) */
    kvt_tiers_status tiers_st;   /* the levels' state at the last kvt_server_poll_tiers */
    kvt_cold_tier tier;
    kvt_service *svc;
    kvt_srv_sched *sched;
    char model_name[64];
    int32_t seq_len, vocab;
    int64_t slots_said;          /* the cluster's uncovered hash slots last warned about (0: none) */
} srv_model;

struct kvt_server {
    kvt_server_opts o;           /* strings below are owned copies */
    char *host, *ssd_dir, *api_key, *redis_url, *live_dir;
    srv_model md[KVT_SERVER_MAX_MODELS]; /* (n_md) the served models, the default first */
    int n_md;
    kvt_pool *pool;              /* shared by every model's service and the SSD root; NULL = none */
    char *pub_dirs[8];           /* copies of o.prompt_cache_dirs */
    struct MHD_Daemon *d;
    int port;
    kvt_srv_metrics *metrics;
    kvt_dash *dash;              /* GET /dashboard, /events */
    atomic_int ready;            /* 1 once load finished: the fields below are set */
    atomic_int stopping;         /* stop began: new generation requests get 503 */
    atomic_long active;          /* requests between their first handler call and completion */
    pthread_mutex_t tiers_mu;    /* guards each model's tiers_st */
    int64_t created;             /* Unix seconds at load, for /v1/models */
    atomic_ullong next_id;
    int stopped;
};

/* ---- small helpers ---------------------------------------------------------------------- */

static char *xstrdup(const char *s) { return s ? strdup(s) : NULL; }

static int64_t unix_s(void) { return (int64_t)time(NULL); }

/* The model a request names: the first when name is NULL; NULL when no
 * served model has that id. */
static srv_model *find_model(kvt_server *s, const char *name)
{
    if (!name)
        return &s->md[0];
    for (int i = 0; i < s->n_md; i++)
        if (!strcmp(s->md[i].model_name, name))
            return &s->md[i];
    return NULL;
}

/* The 404 of a request naming a model that is not served: the message
 * lists the ids that are. */
static int unknown_model(kvt_server *s, const char *name, kvt_oai_error *e)
{
    char ids[KVT_SERVER_MAX_MODELS * 70] = "";
    size_t n = 0;
    for (int i = 0; i < s->n_md && n < sizeof ids; i++)
        n += (size_t)snprintf(ids + n, sizeof ids - n, "%s'%s'", i ? ", " : "", s->md[i].model_name);
    return kvt_oai_error_set(e, 404, "invalid_request_error", "model", "model_not_found",
                             "the model '%.200s' does not exist (this server serves %s)", name, ids);
}

/* Declared in server.h (the dashboard's event streams use it too). */
int kvt__srv_peer_gone(int fd)
{
    if (fd < 0)
        return 0;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0)
        return 0;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

static int conn_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* The answer when a request cannot be handled for want of memory: a fixed
 * error object in static memory (nothing to allocate but MHD's response). */
static const char oom_body[] = "{\"error\":{\"message\":\"the server is out of memory\",\"type\":\"server_error\","
                               "\"param\":null,\"code\":\"out_of_memory\"}}";

static enum MHD_Result send_oom(struct MHD_Connection *c)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(sizeof oom_body - 1, (void *)oom_body, MHD_RESPMEM_PERSISTENT);
    if (!r)
        return MHD_NO; /* MHD itself is out of memory: it closes the connection */
    MHD_add_response_header(r, "Content-Type", "application/json");
    enum MHD_Result ret = MHD_queue_response(c, 500, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_body(kvt_server *s, struct MHD_Connection *c, kvt_srv_endpoint ep, int status,
                                 char *body, const char *ctype, const char *extra_h, const char *extra_v)
{
    kvt_srv_metrics_request(s->metrics, ep, body ? status : 500);
    if (!body)
        return send_oom(c); /* the body could not be built */
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return send_oom(c);
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    if (extra_h)
        MHD_add_response_header(r, extra_h, extra_v);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_json(kvt_server *s, struct MHD_Connection *c, kvt_srv_endpoint ep, int status,
                                 json_t *doc)
{
    char *body = doc ? json_dumps(doc, JSON_COMPACT | JSON_REAL_PRECISION(6)) : NULL;
    json_decref(doc);
    return send_body(s, c, ep, status, body, "application/json", NULL, NULL);
}

static enum MHD_Result send_error(kvt_server *s, struct MHD_Connection *c, kvt_srv_endpoint ep,
                                  const kvt_oai_error *e)
{
    const char *h = NULL, *v = NULL;
    if (e->status == 429) {
        h = "Retry-After";
        v = "1";
    } else if (e->status == 405) {
        h = "Allow";
        v = ep == KVT_EP_CHAT || ep == KVT_EP_COMPLETIONS || ep == KVT_EP_TOKENIZE || ep == KVT_EP_DETOKENIZE
                ? "POST" : "GET";
    } else if (e->status == 401) {
        h = "WWW-Authenticate";
        v = "Bearer";
    }
    return send_body(s, c, ep, e->status, kvt_oai_error_json(e), "application/json", h, v);
}

static enum MHD_Result fail(kvt_server *s, struct MHD_Connection *c, kvt_srv_endpoint ep, int status,
                            const char *type, const char *param, const char *code, const char *msg)
{
    kvt_oai_error e;
    kvt_oai_error_set(&e, status, type, param, code, "%s", msg);
    return send_error(s, c, ep, &e);
}

/* ---- routing ------------------------------------------------------------------------------ */

typedef struct {
    kvt_srv_endpoint ep;
    int post;                    /* the endpoint's method: 1 POST, 0 GET */
    int known;                   /* 0: unknown path */
    char *body;                  /* (len) bytes received, at most max_body */
    size_t len, cap;
    int too_big;
    int oom;                     /* the body could not be kept: answered 500 once received */
} req_ctx;

/* The endpoints, with their methods (the dashboard's are kvt_dash_owns'). */
static const struct {
    const char *path;
    kvt_srv_endpoint ep;
    int post;
} routes[] = {
    {"/v1/chat/completions", KVT_EP_CHAT, 1}, {"/v1/completions", KVT_EP_COMPLETIONS, 1},
    {"/v1/models", KVT_EP_MODELS, 0},         {"/health", KVT_EP_HEALTH, 0},
    {"/tokenize", KVT_EP_TOKENIZE, 1},        {"/detokenize", KVT_EP_DETOKENIZE, 1},
    {"/stats", KVT_EP_STATS, 0},              {"/metrics", KVT_EP_METRICS, 0},
};

static void route(const char *url, req_ctx *r)
{
    r->ep = KVT_EP_OTHER;
    if (kvt_dash_owns(url)) {
        r->ep = strcmp(url, "/events") ? KVT_EP_DASHBOARD : KVT_EP_EVENTS;
        r->known = 1;
        return;
    }
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].path) ||
            (routes[i].ep == KVT_EP_MODELS && !strncmp(url, "/v1/models/", 11) && url[11])) {
            r->ep = routes[i].ep;
            r->post = routes[i].post;
            r->known = 1;
            return;
        }
}

/* The 404 of an unknown path: the path asked for and every endpoint with its method. */
static void unknown_path_message(const char *method, const char *url, char *msg, size_t cap)
{
    int n = snprintf(msg, cap, "no endpoint %.32s %.200s; the endpoints are:", method, url);
    for (size_t i = 0; i < sizeof routes / sizeof routes[0] && n > 0 && (size_t)n < cap; i++) {
        n += snprintf(msg + n, cap - (size_t)n, "%s %s %s", i ? "," : "", routes[i].post ? "POST" : "GET",
                      routes[i].path);
        if (routes[i].ep == KVT_EP_MODELS && (size_t)n < cap)
            n += snprintf(msg + n, cap - (size_t)n, ", GET /v1/models/{model}");
    }
    if (n > 0 && (size_t)n < cap)
        snprintf(msg + n, cap - (size_t)n, ", GET /dashboard, GET /events");
}

static int authorized(kvt_server *s, struct MHD_Connection *c)
{
    if (!s->api_key)
        return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    const char *key = NULL;
    if (h && !strncasecmp(h, "Bearer ", 7))
        key = h + 7;
    return kvt_oai_key_equal(key ? key : "", s->api_key);
}

/* ---- prompts -------------------------------------------------------------------------------- */

/* The prompt of a parsed request as token ids (BOS first for text).
 * @return 0, or the HTTP status with e filled. */
static int prompt_tokens(const srv_model *s, const kvt_oai_request *r, int bos, int32_t **ids, int64_t *n,
                         kvt_oai_error *e)
{
    *ids = NULL;
    *n = 0;
    if (r->prompt_ids) {
        for (int64_t i = 0; i < r->n_prompt_ids; i++)
            if (r->prompt_ids[i] >= s->vocab)
                return kvt_oai_error_set(e, 400, "invalid_request_error", "prompt", NULL,
                                         "'prompt[%lld]' is token id %d, outside the vocabulary [0, %d)",
                                         (long long)i, r->prompt_ids[i], s->vocab);
        *ids = malloc((size_t)r->n_prompt_ids * sizeof **ids);
        if (!*ids)
            return kvt_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        memcpy(*ids, r->prompt_ids, (size_t)r->n_prompt_ids * sizeof **ids);
        *n = r->n_prompt_ids;
        return 0;
    }
    char *text = NULL;
    if (r->kind == KVT_OAI_CHAT) {
        char *conv = NULL;
        if (kvt_chat_render((const char *const *)r->user, (const char *const *)r->reply, r->n_turns, &conv))
            return kvt_oai_error_set(e, 500, "server_error", NULL, NULL, "cannot render the conversation");
        if (r->system) {
            size_t a = strlen(r->system), b = strlen(conv);
            text = malloc(a + b + 10);
            if (text)
                snprintf(text, a + b + 10, "System: %s\n%s", r->system, conv);
            free(conv);
        } else
            text = conv;
    } else
        text = strdup(r->prompt_text);
    if (!text)
        return kvt_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    size_t cap = strlen(text) + 3;
    *ids = malloc(cap * sizeof **ids);
    int rc = *ids ? kvt_tokenizer_encode(s->tok, text, bos, 0, *ids, (int64_t)cap, n) : KVT_ENOMEM;
    free(text);
    if (rc) {
        free(*ids);
        *ids = NULL;
        return rc == KVT_ENOMEM ? kvt_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory")
                                : kvt_oai_error_set(e, 400, "invalid_request_error", "prompt", NULL,
                                                    "the prompt cannot be encoded: %s", kvt_last_error());
    }
    if (*n == 0) {
        free(*ids);
        *ids = NULL;
        return kvt_oai_error_set(e, 400, "invalid_request_error", "prompt", NULL, "the prompt is empty");
    }
    return 0;
}

/* ---- generation ------------------------------------------------------------------------------ */

typedef struct {
    kvt_server *s;
    const srv_model *md;         /* the model it runs on */
    kvt_srv_job *job;
    struct MHD_Connection *conn;
    int fd;
    kvt_oai_kind kind;
    char id[40];
    int64_t created;
    int include_usage;
    int phase;                   /* 0 role chunk next, 1 text, 2 ended */
    size_t sent;                 /* bytes of job->text sent */
    const char *out;             /* (out_len) event bytes not yet handed to MHD */
    size_t out_len, out_off;
    int out_owned;               /* out is malloc'd (else static) */
} stream_ctx;

static void stream_free(void *cls)
{
    stream_ctx *st = cls;
    kvt_srv_job_cancel(st->job); /* no-op for a finished job */
    kvt_srv_job_release(st->job);
    if (st->out_owned)
        free((char *)st->out);
    free(st);
}

static void stream_put(stream_ctx *st, char *ev)
{
    if (st->out_owned)
        free((char *)st->out);
    st->out = ev;
    st->out_len = ev ? strlen(ev) : 0;
    st->out_off = 0;
    st->out_owned = 1;
}

/* A stream whose next event cannot be built (out of memory) ends with an
 * error event and [DONE], from static memory. */
static const char oom_event[] = "data: {\"error\":{\"message\":\"the server is out of memory\",\"type\":"
                                "\"server_error\",\"param\":null,\"code\":\"out_of_memory\"}}\n\ndata: [DONE]\n\n";

static void stream_end_oom(stream_ctx *st)
{
    stream_put(st, NULL);
    st->out = oom_event;
    st->out_len = sizeof oom_event - 1;
    st->out_owned = 0;
    st->phase = 2;
}

static char *cat3(char *a, const char *b, const char *c)
{
    if (!a)
        return NULL;
    size_t na = strlen(a), nb = strlen(b), nc = c ? strlen(c) : 0;
    char *p = realloc(a, na + nb + nc + 1);
    if (!p) {
        free(a);
        return NULL;
    }
    memcpy(p + na, b, nb);
    if (c)
        memcpy(p + na + nb, c, nc);
    p[na + nb + nc] = '\0';
    return p;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    stream_ctx *st = cls;
    kvt_srv_job *j = st->job;
    const char *model = st->md->model_name;
    for (;;) {
        if (st->out_off < st->out_len) {
            size_t n = st->out_len - st->out_off;
            if (n > max)
                n = max;
            memcpy(buf, st->out + st->out_off, n);
            st->out_off += n;
            return (ssize_t)n;
        }
        if (st->phase == 2) {
            /* the reply is complete: a client that stops reading is bounded by the idle timeout again */
            MHD_set_connection_option(st->conn, MHD_CONNECTION_OPTION_TIMEOUT, st->s->o.conn_timeout_s);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        if (st->phase == 0) { /* chat streams open with the assistant's role; completions do not */
            st->phase = 1;
            if (st->kind == KVT_OAI_CHAT) {
                stream_put(st, kvt_oai_chunk_event(st->kind, st->id, st->created, model, 1, NULL, 0, NULL,
                                                   st->include_usage, NULL));
                if (!st->out)
                    stream_end_oom(st);
            }
            continue;
        }
        pthread_mutex_lock(&j->mu);
        while (!j->done && j->visible <= st->sent) {
            kvt_srv_job_wait_locked(j, st->sent, 20);
            if (!j->done && j->visible <= st->sent) {
                pthread_mutex_unlock(&j->mu);
                if (kvt__srv_peer_gone(st->fd)) {
                    kvt_srv_job_cancel(j);
                    return MHD_CONTENT_READER_END_WITH_ERROR;
                }
                pthread_mutex_lock(&j->mu);
            }
        }
        /* what the event needs is copied under the job's lock and the event
         * built after it, so the engine thread never waits on a build */
        uint64_t t0 = kvt_now_ns(), lag = t0 > j->visible_ns ? t0 - j->visible_ns : 0;
        char *piece = NULL, err[sizeof j->error];
        size_t n_piece = 0;
        int status = j->status, has_text = j->visible > st->sent;
        const char *finish_reason = j->finish_reason;
        kvt_oai_usage usage = j->usage;
        if (has_text) {
            n_piece = j->visible - st->sent;
            piece = malloc(n_piece + 1);
            if (piece) {
                memcpy(piece, j->text + st->sent, n_piece);
                piece[n_piece] = '\0';
                st->sent = j->visible;
            }
        } else if (status != 200)
            snprintf(err, sizeof err, "%s", j->error);
        pthread_mutex_unlock(&j->mu);
        char *ev = NULL;
        if (has_text) {
            ev = piece ? kvt_oai_chunk_event(st->kind, st->id, st->created, model, 0, piece, n_piece, NULL,
                                             st->include_usage, NULL)
                       : NULL;
            free(piece);
        } else if (status == 200) {
            ev = kvt_oai_chunk_event(st->kind, st->id, st->created, model, 0, NULL, 0, finish_reason,
                                     st->include_usage, NULL);
            if (ev && st->include_usage) {
                char *u = kvt_oai_chunk_event(st->kind, st->id, st->created, model, 0, NULL, 0, NULL, 1, &usage);
                ev = u ? cat3(ev, u, NULL) : (free(ev), NULL);
                free(u);
            }
            ev = cat3(ev, "data: [DONE]\n\n", NULL);
            st->phase = 2;
        } else {
            kvt_oai_error e;
            kvt_oai_error_set(&e, status, status == 400 || status == 422 ? "invalid_request_error" : "server_error", NULL,
                              NULL, "%s", err);
            char *body = kvt_oai_error_json(&e);
            ev = body ? cat3(strdup("data: "), body, "\n\ndata: [DONE]\n\n") : NULL;
            free(body);
            st->phase = 2;
        }
        kvt_srv_sched_note_sse(st->md->sched, kvt_now_ns() - t0, lag);
        if (ev)
            stream_put(st, ev);
        else
            stream_end_oom(st);
    }
}

static void new_id(kvt_server *s, kvt_oai_kind kind, char *id, size_t cap)
{
    unsigned long long n = atomic_fetch_add(&s->next_id, 1);
    snprintf(id, cap, "%s-%016llx", kind == KVT_OAI_CHAT ? "chatcmpl" : "cmpl", n);
}

static enum MHD_Result do_generate(kvt_server *s, struct MHD_Connection *c, req_ctx *rq)
{
    kvt_oai_kind kind = rq->ep == KVT_EP_CHAT ? KVT_OAI_CHAT : KVT_OAI_COMPLETION;
    kvt_oai_request r;
    kvt_oai_error e;
    if (kvt_oai_parse(kind, rq->body, rq->len, &r, &e))
        return send_error(s, c, rq->ep, &e);
    enum MHD_Result ret;
    srv_model *md = find_model(s, r.model);
    if (!md) {
        unknown_model(s, r.model, &e);
        ret = send_error(s, c, rq->ep, &e);
        goto out;
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    if (prompt_tokens(md, &r, 1, &ids, &n, &e)) {
        ret = send_error(s, c, rq->ep, &e);
        goto out;
    }
    int64_t left = md->seq_len - n;
    if (left < 1 || (r.max_tokens > 0 && r.max_tokens > left)) {
        free(ids);
        if (left < 1)
            kvt_oai_error_set(&e, 400, "invalid_request_error", "messages", "context_length_exceeded",
                              "this model's context is %d tokens; the prompt has %lld tokens, leaving no room "
                              "for a reply", md->seq_len, (long long)n);
        else
            kvt_oai_error_set(&e, 400, "invalid_request_error", "max_tokens", "context_length_exceeded",
                              "this model's context is %d tokens; the prompt has %lld tokens and max_tokens "
                              "asks for %lld (%lld in all)", md->seq_len, (long long)n, (long long)r.max_tokens,
                              (long long)(n + r.max_tokens));
        ret = send_error(s, c, rq->ep, &e);
        goto out;
    }
    int64_t max_tokens = r.max_tokens > 0 ? r.max_tokens : (kind == KVT_OAI_CHAT ? 256 : 16);
    if (max_tokens > left)
        max_tokens = left;
    kvt_request kr = {.prompt = ids, .n_prompt = n, .max_tokens = max_tokens,
                      .live_blocks = s->o.live_cache_blocks, .live_bytes = s->o.live_cache_bytes};
    int fit = kvt_service_fits(md->svc, &kr);
    if (fit < 0) {
        free(ids);
        kvt_oai_error_set(&e, fit == KVT_ECLOSED ? 503 : 400, "invalid_request_error", "max_tokens",
                          fit == KVT_ELIMIT ? "kv_budget_exceeded" : NULL, "%s", kvt_last_error());
        ret = send_error(s, c, rq->ep, &e);
        goto out;
    }
    kvt_srv_job *j = kvt_srv_job_new();
    if (!j) {
        free(ids);
        ret = fail(s, c, rq->ep, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    j->endpoint = rq->ep;
    j->prompt = ids;
    j->n_prompt = n;
    j->max_tokens = max_tokens;
    j->temperature = (float)r.temperature;
    j->top_p = (float)r.top_p;
    uint64_t seed = r.has_seed ? r.seed : (kvt_now_ns() ^ ((uint64_t)atomic_load(&s->next_id) << 32));
    j->seed = seed ? seed : 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < r.n_stop; i++) {
        j->stop[i] = r.stop[i];
        r.stop[i] = NULL;
    }
    j->n_stop = r.n_stop;
    r.n_stop = 0;
    j->stop_at_newline = kind == KVT_OAI_CHAT;
    j->session = r.session;
    r.session = NULL;
    j->seed_explicit = r.has_seed;
    /* a replayable request: checkpointed, and a repeat with the same key resumes */
    const char *key = kvt_service_checkpoint_every(md->svc) > 0
                          ? MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Idempotency-Key") : NULL;
    if (key && *key) {
        int ok = strlen(key) <= KVT_REQUEST_ID_MAX;
        for (const unsigned char *p = (const unsigned char *)key; ok && *p; p++)
            ok = *p >= 0x20 && *p != 0x7f;
        if (!ok) {
            kvt_srv_job_release(j);
            kvt_oai_error_set(&e, 400, "invalid_request_error", "Idempotency-Key", NULL,
                              "the Idempotency-Key header must be 1 to %d bytes without control characters",
                              KVT_REQUEST_ID_MAX);
            ret = send_error(s, c, rq->ep, &e);
            goto out;
        }
        if (!(j->request_id = strdup(key))) {
            kvt_srv_job_release(j);
            ret = fail(s, c, rq->ep, 500, "server_error", NULL, NULL, "out of memory");
            goto out;
        }
    }
    snprintf(j->model, sizeof j->model, "%s", md->model_name);
    j->arrival_ns = kvt_now_ns();
    int rc = atomic_load(&s->stopping) ? KVT_ECLOSED : kvt_srv_sched_submit(md->sched, j);
    if (rc) {
        kvt_srv_job_release(j);
        if (rc == KVT_EAGAIN) {
            kvt_srv_metrics_add(s->metrics, offsetof(kvt_srv_counters, rejected_queue_full), 1);
            kvt_oai_error_set(&e, 429, "rate_limit_error", NULL, "queue_full",
                              "the server's queue is full (%lld requests waiting); retry later",
                              (long long)s->o.max_queue);
        } else
            kvt_oai_error_set(&e, 503, "server_error", NULL, "shutting_down", "the server is shutting down");
        ret = send_error(s, c, rq->ep, &e);
        goto out;
    }
    /* the request now waits on the engine: our own disconnect check replaces the idle timeout */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    int fd = conn_fd(c);
    char id[40];
    new_id(s, kind, id, sizeof id);
    if (r.stream) {
        stream_ctx *st = calloc(1, sizeof *st);
        struct MHD_Response *resp = st ? MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, st,
                                                                           stream_free)
                                       : NULL;
        if (!resp) {
            free(st);
            kvt_srv_job_cancel(j);
            kvt_srv_job_release(j);
            kvt_srv_metrics_request(s->metrics, rq->ep, 500);
            ret = send_oom(c);
            goto out;
        }
        st->s = s;
        st->md = md;
        st->job = j;
        st->conn = c;
        st->fd = fd;
        st->kind = kind;
        memcpy(st->id, id, sizeof id);
        st->created = unix_s();
        st->include_usage = r.include_usage;
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        kvt_srv_metrics_request(s->metrics, rq->ep, 200);
        ret = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        goto out;
    }
    pthread_mutex_lock(&j->mu);
    while (!j->done) {
        kvt_srv_job_wait_locked(j, SIZE_MAX, 20);
        if (j->done)
            break;
        pthread_mutex_unlock(&j->mu);
        int gone = kvt__srv_peer_gone(fd);
        pthread_mutex_lock(&j->mu);
        if (gone) {
            kvt_srv_job_cancel(j);
            pthread_mutex_unlock(&j->mu);
            kvt_srv_job_release(j);
            ret = MHD_NO; /* the client is gone: close */
            goto out;
        }
    }
    pthread_mutex_unlock(&j->mu);
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, s->o.conn_timeout_s);
    if (j->status != 200) {
        kvt_oai_error_set(&e, j->status, j->status == 400 || j->status == 422 ? "invalid_request_error" : "server_error", NULL, NULL,
                          "%s", j->error);
        ret = send_error(s, c, rq->ep, &e);
    } else
        ret = send_body(s, c, rq->ep, 200,
                        kvt_oai_response_json(kind, id, unix_s(), md->model_name, j->text, j->text_len,
                                              j->finish_reason, &j->usage),
                        "application/json", NULL, NULL);
    kvt_srv_job_release(j);
out:
    kvt_oai_request_clear(&r);
    return ret;
}

/* ---- the other endpoints ----------------------------------------------------------------------- */

/* The body as a JSON object, or NULL with e filled (400). */
static json_t *body_object(const req_ctx *rq, kvt_oai_error *e)
{
    json_error_t je;
    json_t *doc = json_loadb(rq->body ? rq->body : "", rq->len, JSON_DECODE_ANY, &je);
    if (!doc)
        kvt_oai_error_set(e, 400, "invalid_request_error", NULL, NULL,
                          "malformed JSON at line %d, column %d (byte %d): %s", je.line, je.column, je.position,
                          je.text);
    else if (!json_is_object(doc)) {
        json_decref(doc);
        doc = NULL;
        kvt_oai_error_set(e, 400, "invalid_request_error", NULL, NULL, "the request body must be a JSON object");
    }
    return doc;
}

static enum MHD_Result do_tokenize(kvt_server *s, struct MHD_Connection *c, req_ctx *rq)
{
    kvt_oai_error e;
    json_t *doc = body_object(rq, &e);
    if (!doc)
        return send_error(s, c, rq->ep, &e);
    json_t *ast = json_object_get(doc, "add_special_tokens");
    if (ast && !json_is_boolean(ast)) {
        json_decref(doc);
        return fail(s, c, rq->ep, 400, "invalid_request_error", "add_special_tokens", NULL,
                    "'add_special_tokens' must be a boolean");
    }
    int bos = !ast || json_is_true(ast);
    kvt_oai_kind kind = json_object_get(doc, "messages") ? KVT_OAI_CHAT : KVT_OAI_COMPLETION;
    json_decref(doc);
    kvt_oai_request r;
    if (kvt_oai_parse(kind, rq->body, rq->len, &r, &e))
        return send_error(s, c, rq->ep, &e);
    srv_model *md = find_model(s, r.model);
    if (!md) {
        unknown_model(s, r.model, &e);
        kvt_oai_request_clear(&r);
        return send_error(s, c, rq->ep, &e);
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    if (prompt_tokens(md, &r, bos, &ids, &n, &e)) {
        kvt_oai_request_clear(&r);
        return send_error(s, c, rq->ep, &e);
    }
    kvt_oai_request_clear(&r);
    json_t *arr = json_array();
    for (int64_t i = 0; arr && i < n; i++)
        json_array_append_new(arr, json_integer(ids[i]));
    free(ids);
    return send_json(s, c, rq->ep, 200,
                     arr ? json_pack("{s:I, s:i, s:o}", "count", (json_int_t)n, "max_model_len", md->seq_len,
                                     "tokens", arr)
                         : NULL);
}

static enum MHD_Result do_detokenize(kvt_server *s, struct MHD_Connection *c, req_ctx *rq)
{
    kvt_oai_error e;
    json_t *doc = body_object(rq, &e);
    if (!doc)
        return send_error(s, c, rq->ep, &e);
    json_t *mname = json_object_get(doc, "model");
    if (mname && !json_is_string(mname)) {
        json_decref(doc);
        return fail(s, c, rq->ep, 400, "invalid_request_error", "model", NULL, "'model' must be a string");
    }
    srv_model *md = find_model(s, mname ? json_string_value(mname) : NULL);
    if (!md) {
        unknown_model(s, json_string_value(mname), &e);
        json_decref(doc);
        return send_error(s, c, rq->ep, &e);
    }
    json_t *toks = json_object_get(doc, "tokens");
    if (!json_is_array(toks)) {
        json_decref(doc);
        return fail(s, c, rq->ep, 400, "invalid_request_error", "tokens", NULL,
                    toks ? "'tokens' must be an array of token ids" : "'tokens' is required");
    }
    char *raw = NULL, *text = NULL;
    size_t raw_len = 0, raw_cap = 0, len = 0, cap = 0;
    int32_t prev = -1;
    size_t i;
    json_t *v;
    json_array_foreach(toks, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= md->vocab) {
            free(raw);
            json_decref(doc);
            kvt_oai_error_set(&e, 400, "invalid_request_error", "tokens", NULL,
                              "'tokens[%zu]' must be a token id in [0, %d)", i, md->vocab);
            return send_error(s, c, rq->ep, &e);
        }
        int32_t t = (int32_t)json_integer_value(v);
        const char *piece = (t == KVT_TOKEN_BOS || t == KVT_TOKEN_EOS) ? "" : kvt_tokenizer_decode(md->tok, prev, t);
        size_t pn = piece ? strlen(piece) : 0;
        if (raw_len + pn + 1 > raw_cap) {
            size_t nc = raw_cap ? raw_cap * 2 : 256;
            while (nc < raw_len + pn + 1)
                nc *= 2;
            char *p = realloc(raw, nc);
            if (!p) {
                free(raw);
                json_decref(doc);
                return fail(s, c, rq->ep, 500, "server_error", NULL, NULL, "out of memory");
            }
            raw = p;
            raw_cap = nc;
        }
        memcpy(raw + raw_len, piece ? piece : "", pn);
        raw_len += pn;
        prev = t;
    }
    json_decref(doc);
    int rc = kvt_oai_utf8_append(&text, &len, &cap, raw ? raw : "", raw_len);
    free(raw);
    if (rc || (!text && !(text = strdup(""))))
        return fail(s, c, rq->ep, 500, "server_error", NULL, NULL, "out of memory");
    json_t *out = json_pack("{s:s%}", "prompt", text, len);
    free(text);
    return send_json(s, c, rq->ep, 200, out);
}

static void gauges(kvt_server *s, kvt_srv_gauges *g)
{
    memset(g, 0, sizeof *g);
    g->ready = atomic_load(&s->ready);
    for (int i = 0; g->ready && i < s->n_md; i++) { /* every model's engine thread */
        int64_t q = 0, r = 0;
        kvt_srv_sched_gauges(s->md[i].sched, &q, &r);
        g->queue_depth += q;
        g->running += r;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
    g->connections = di ? (int64_t)di->num_connections : 0;
}

/* One model's engine thread: its figures and gauges (zero before load). */
static void model_engine(const srv_model *md, int ready, kvt_srv_model_engine *out)
{
    memset(out, 0, sizeof *out);
    out->id = md->model_name;
    if (!ready)
        return;
    kvt_srv_sched_get_stats(md->sched, &out->st);
    kvt_srv_sched_gauges(md->sched, &out->queue_depth, &out->running);
}

/* The engine threads' figures, summed over the models (zero before load). */
static void engine_stats(kvt_server *s, int ready, kvt_srv_sched_stats *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < s->n_md; i++) {
        kvt_srv_model_engine one;
        model_engine(&s->md[i], ready, &one);
        kvt_srv_sched_stats_add(out, &one.st);
    }
}

/* The store's counters, from their one list (kvt_store_stats_json); NULL when out of memory. */
static json_t *store_json(const kvt_store_stats *ss)
{
    char *js = NULL;
    json_t *o = kvt_store_stats_json(ss, &js) == 0 ? json_loads(js, 0, NULL) : NULL;
    kvt_string_free(js);
    return o;
}

/* Each tier level's health of one model into doc: "KIND_cache" (mode
 * read-write / read-only / off, the cause) for the first level of each kind
 * ("ssd_cache", "redis_cache", "published_cache": the form one level of a
 * kind always had), and "published_caches", every published level in chain
 * order (several --prompt-cache-dir), each with its "tier" name as the
 * report's "tiers" list gives it ("published", or "published:N"). */
static void levels_json(kvt_server *s, const srv_model *md, int ready, json_t *doc)
{
    json_t *pubs = NULL;
    pthread_mutex_lock(&s->tiers_mu);
    for (int32_t i = 0; i < md->tiers_st.n_levels; i++) {
        const kvt_level_status *l = &md->tiers_st.level[i];
        const char *tier = ready ? kvt_service_tier_name(md->svc, i) : NULL;
        json_t *o = json_pack("{s:s, s:s, s:s, s:s?, s:I, s:I, s:I}", "dir", l->where, "mode",
                              kvt_level_mode_name(l->mode), "cause", l->cause, "tier", tier, "open_failures",
                              (json_int_t)l->open_failures, "write_failures", (json_int_t)l->write_failures,
                              "writes_skipped", (json_int_t)l->writes_skipped);
        if (!o)
            continue;
        char key[40];
        snprintf(key, sizeof key, "%s_cache", l->name);
        if (!json_object_get(doc, key))
            json_object_set(doc, key, o);
        if (!strcmp(l->name, "published")) {
            if (l->generation[0]) /* the generation mounted at the last poll (about every second) */
                json_object_set_new(o, "generation", json_string(l->generation));
            if (!pubs)
                pubs = json_array();
            if (pubs)
                json_array_append(pubs, o);
        }
        json_decref(o);
    }
    pthread_mutex_unlock(&s->tiers_mu);
    if (pubs)
        json_object_set_new(doc, "published_caches", pubs);
}

/* One model's part of /stats: its service report (kvt_service_stats_json)
 * with "ssd", "remote" and its tier levels' health; an empty object before
 * load. NULL when out of memory. */
static json_t *model_stats(kvt_server *s, const srv_model *md, int ready)
{
    json_t *doc = NULL;
    if (ready) {
        char *rep = NULL;
        if (kvt_service_stats_json(md->svc, &rep) == 0)
            doc = json_loads(rep, 0, NULL);
        kvt_string_free(rep);
    }
    if (!doc)
        doc = json_object();
    if (!doc)
        return NULL;
    if (ready && md->store) {
        kvt_store_stats ss;
        kvt_store_get_stats(md->store, &ss);
        json_object_set_new(doc, "ssd", store_json(&ss));
    } else
        json_object_set_new(doc, "ssd", json_null());
    kvt_remote_stats rs;
    kvt_remote *remote = ready ? kvt_tiers_remote(md->tiers) : NULL;
    char *rjs = NULL;
    if (remote && kvt_remote_stats_get(remote, &rs) == 0 && kvt_remote_stats_json(&rs, &rjs) == 0)
        json_object_set_new(doc, "remote", json_loads(rjs, 0, NULL));
    kvt_string_free(rjs);
    levels_json(s, md, ready, doc);
    return doc;
}

/* The /stats document with the last `recent` finished requests; NULL when
 * out of memory. The first model's report is the top level (as with one
 * model), "engine" every model's engine threads summed; "models" lists
 * every model's (id, max_model_len, report, its own engine thread's
 * "engine", "queue_depth" and "running"); "pool"
 * is the process-wide pool's whole report (kvt_pool_report_json: every
 * member), null without a pool. */
static json_t *stats_doc(kvt_server *s, size_t recent)
{
    kvt_srv_gauges g;
    gauges(s, &g);
    json_t *doc = model_stats(s, &s->md[0], g.ready);
    if (!doc)
        return NULL;
    json_object_set_new(doc, "server", kvt_srv_metrics_json(s->metrics, &g, recent));
    kvt_srv_sched_stats es;
    engine_stats(s, g.ready, &es);
    json_object_set_new(doc, "engine", kvt_srv_sched_stats_json(&es));
    json_object_set_new(doc, "model", json_pack("{s:s, s:i}", "id", s->md[0].model_name, "max_model_len",
                                                s->md[0].seq_len));
    json_t *models = json_array();
    for (int i = 0; models && i < s->n_md; i++) {
        kvt_srv_model_engine me;
        model_engine(&s->md[i], g.ready, &me);
        json_t *one = json_pack("{s:s, s:i, s:o*, s:o*, s:I, s:I}", "id", s->md[i].model_name, "max_model_len",
                                s->md[i].seq_len, "report", model_stats(s, &s->md[i], g.ready), "engine",
                                kvt_srv_sched_stats_json(&me.st), "queue_depth", (json_int_t)me.queue_depth,
                                "running", (json_int_t)me.running);
        if (json_array_append_new(models, one)) {
            json_decref(models);
            models = NULL;
        }
    }
    json_object_set_new(doc, "models", models ? models : json_null());
    char *pjs = NULL;
    json_t *pool = NULL;
    if (s->pool && kvt_pool_report_json(s->pool, &pjs) == 0)
        pool = json_loads(pjs, 0, NULL);
    kvt_string_free(pjs);
    json_object_set_new(doc, "pool", pool ? pool : json_null());
    return doc;
}

/* The dashboard's snapshot: /stats without its request list (those come as events). */
static json_t *dash_snapshot(void *cls) { return stats_doc(cls, 0); }

static enum MHD_Result do_stats(kvt_server *s, struct MHD_Connection *c, req_ctx *rq)
{
    json_t *doc = stats_doc(s, 50);
    return doc ? send_json(s, c, rq->ep, 200, doc) : MHD_NO;
}

/* One model's figures for /metrics (nothing but the id before load). */
static void model_figures(const srv_model *md, int ready, kvt_srv_model_figures *f)
{
    memset(f, 0, sizeof *f);
    snprintf(f->id, sizeof f->id, "%s", md->model_name);
    f->have_rep = ready && kvt_service_get_stats(md->svc, &f->rep) == 0;
    if (!f->have_rep)
        return;
    for (int32_t i = 0; i < kvt_service_tier_count(md->svc) && f->n_tiers < KVT_TIER_CHAIN_MAX; i++)
        if (kvt_service_tier_stats(md->svc, i, &f->tiers[f->n_tiers].st) == 0) {
            snprintf(f->tiers[f->n_tiers].name, sizeof f->tiers[0].name, "%s", kvt_service_tier_name(md->svc, i));
            f->n_tiers++;
        }
    if (md->store) {
        kvt_store_get_stats(md->store, &f->ss);
        f->have_ssd = 1;
    }
    kvt_remote *remote = kvt_tiers_remote(md->tiers);
    f->have_remote = remote && kvt_remote_stats_get(remote, &f->rs) == 0;
    int n = kvt_service_layer_stats(md->svc, f->layers, KVT_LAYER_REPORT_LIMIT + 1);
    f->n_layers = n > 0 ? n : 0;
}

static enum MHD_Result do_metrics(kvt_server *s, struct MHD_Connection *c, req_ctx *rq)
{
    kvt_srv_gauges g;
    gauges(s, &g);
    kvt_srv_model_figures *mf = calloc((size_t)s->n_md, sizeof *mf);
    if (!mf)
        return MHD_NO;
    for (int i = 0; i < s->n_md; i++) /* every model's series, labelled by its id */
        model_figures(&s->md[i], g.ready, &mf[i]);
    kvt_io_stats ios; /* the process's I/O worker, when a tier uses it */
    int have_io = kvt_io_default_stats_get(&ios) == 0;
    char *text = NULL;
    /* this scrape counts itself */
    kvt_srv_metrics_request(s->metrics, rq->ep, 200);
    int rc = kvt_srv_metrics_prometheus(s->metrics, &g, mf, s->n_md, s->pool, have_io ? &ios : NULL, &text);
    free(mf);
    if (rc)
        return MHD_NO;
    kvt_srv_model_engine *me = calloc((size_t)s->n_md, sizeof *me); /* each model's engine thread */
    if (!me) {
        free(text);
        return MHD_NO;
    }
    for (int i = 0; i < s->n_md; i++)
        model_engine(&s->md[i], g.ready, &me[i]);
    rc = kvt_srv_sched_stats_prometheus(&text, me, s->n_md);
    free(me);
    if (rc) {
        free(text);
        return MHD_NO;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
    enum MHD_Result ret = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    return ret;
}

static json_t *model_json(const kvt_server *s, const srv_model *md)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", md->model_name, "object", "model", "created",
                     (json_int_t)s->created, "owned_by", "kvtier", "max_model_len", md->seq_len);
}

static enum MHD_Result do_models(kvt_server *s, struct MHD_Connection *c, req_ctx *rq, const char *url)
{
    if (!strncmp(url, "/v1/models/", 11)) {
        srv_model *md = find_model(s, url + 11);
        if (!md) {
            kvt_oai_error e;
            unknown_model(s, url + 11, &e);
            return send_error(s, c, rq->ep, &e);
        }
        return send_json(s, c, rq->ep, 200, model_json(s, md));
    }
    json_t *data = json_array();
    for (int i = 0; data && i < s->n_md; i++)
        if (json_array_append_new(data, model_json(s, &s->md[i]))) {
            json_decref(data);
            data = NULL;
        }
    return send_json(s, c, rq->ep, 200, data ? json_pack("{s:s, s:o}", "object", "list", "data", data) : NULL);
}

/* ---- the access handler ---------------------------------------------------------------------------- */

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload_data, size_t *upload_data_size,
                               void **con_cls)
{
    kvt_server *s = cls;
    req_ctx *rq = *con_cls;
    if (!rq) {
        rq = calloc(1, sizeof *rq);
        if (!rq)
            return send_oom(c);
        *con_cls = rq;
        atomic_fetch_add(&s->active, 1);
        route(url, rq);
        int is_post = !strcmp(method, "POST"), is_get = !strcmp(method, "GET");
        if (!rq->known) {
            char msg[700];
            unknown_path_message(method, url, msg, sizeof msg);
            return fail(s, c, KVT_EP_OTHER, 404, "invalid_request_error", NULL, "not_found", msg);
        }
        if ((rq->post && !is_post) || (!rq->post && !is_get)) {
            char msg[300];
            snprintf(msg, sizeof msg, "%s takes %s, not %.32s", url, rq->post ? "POST" : "GET", method);
            return fail(s, c, rq->ep, 405, "invalid_request_error", NULL, "method_not_allowed", msg);
        }
        if (rq->ep != KVT_EP_HEALTH && rq->ep != KVT_EP_DASHBOARD && !authorized(s, c))
            return fail(s, c, rq->ep, 401, "invalid_request_error", NULL, "invalid_api_key",
                        "missing or incorrect API key (send 'Authorization: Bearer KEY')");
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > s->o.max_body) {
            char msg[200];
            snprintf(msg, sizeof msg, "the request body is %.24s bytes; this server takes at most %llu (--max-body)",
                     cl, (unsigned long long)s->o.max_body);
            return fail(s, c, rq->ep, 413, "invalid_request_error", NULL, "body_too_large", msg);
        }
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (rq->oom)
            return MHD_YES; /* dropped: answered 500 once it is all received */
        if (rq->too_big || rq->len + n > s->o.max_body) {
            rq->too_big = 1;
            return MHD_YES;
        }
        if (rq->len + n + 1 > rq->cap) {
            size_t nc = rq->cap ? rq->cap * 2 : 4096;
            while (nc < rq->len + n + 1)
                nc *= 2;
            char *p = realloc(rq->body, nc);
            if (!p) {
                rq->oom = 1; /* the rest of the body is read and dropped */
                return MHD_YES;
            }
            rq->body = p;
            rq->cap = nc;
        }
        memcpy(rq->body + rq->len, upload_data, n);
        rq->len += n;
        rq->body[rq->len] = '\0';
        return MHD_YES;
    }
    if (rq->oom) {
        kvt_srv_metrics_request(s->metrics, rq->ep, 500);
        return send_oom(c);
    }
    if (rq->too_big) {
        char msg[160];
        snprintf(msg, sizeof msg, "the request body is over %llu bytes (--max-body)", (unsigned long long)s->o.max_body);
        return fail(s, c, rq->ep, 413, "invalid_request_error", NULL, "body_too_large", msg);
    }
    int ready = atomic_load(&s->ready);
    if (rq->ep == KVT_EP_HEALTH) {
        if (!ready)
            return fail(s, c, rq->ep, 503, "server_error", NULL, "loading", "the model is loading");
        if (atomic_load(&s->stopping))
            return fail(s, c, rq->ep, 503, "server_error", NULL, "shutting_down", "the server is shutting down");
        return send_json(s, c, rq->ep, 200, json_pack("{s:s}", "status", "ok"));
    }
    if (rq->ep == KVT_EP_METRICS)
        return do_metrics(s, c, rq);
    if (rq->ep == KVT_EP_DASHBOARD || rq->ep == KVT_EP_EVENTS)
        return kvt_dash_handle(s->dash, c, url, rq->ep);
    if (!ready)
        return fail(s, c, rq->ep, 503, "server_error", NULL, "loading", "the model is loading; retry shortly");
    switch (rq->ep) {
    case KVT_EP_CHAT:
    case KVT_EP_COMPLETIONS: return do_generate(s, c, rq);
    case KVT_EP_MODELS: return do_models(s, c, rq, url);
    case KVT_EP_TOKENIZE: return do_tokenize(s, c, rq);
    case KVT_EP_DETOKENIZE: return do_detokenize(s, c, rq);
    case KVT_EP_STATS: return do_stats(s, c, rq);
    default: return MHD_NO;
    }
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    kvt_server *s = cls;
    req_ctx *rq = *con_cls;
    if (!rq)
        return;
    free(rq->body);
    free(rq);
    *con_cls = NULL;
    atomic_fetch_sub(&s->active, 1);
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, s->o.conn_timeout_s);
}

/* ---- life ------------------------------------------------------------------------------------------- */

int kvt_server_start(const kvt_server_opts *o, kvt_server **out)
{
    *out = NULL;
    if (!o)
        return kvt__fail(KVT_EINVAL, "no options");
    if ((o->model_path != NULL) != (o->tok_path != NULL))
        return kvt__fail(KVT_EINVAL, "%s given without %s", o->model_path ? "--model" : "--tokenizer",
                         o->model_path ? "--tokenizer" : "--model");
    if (o->n_models < 0 || o->n_models > KVT_SERVER_MAX_MODELS || (o->n_models && !o->models))
        return kvt__fail(KVT_EINVAL, "%d models: 0 to %d", o->n_models, KVT_SERVER_MAX_MODELS);
    if (o->n_models && (o->model_path || o->tok_path || o->model_name))
        return kvt__fail(KVT_EINVAL, "give the models either in models[] or in model_path/tok_path, not both");
    for (int i = 0; i < o->n_models; i++)
        if (!o->models[i].model_path || !o->models[i].tok_path)
            return kvt__fail(KVT_EINVAL, "model %d: --model and --tokenizer are both required", i + 1);
    if (o->port < 0 || o->port > 65535)
        return kvt__fail(KVT_EINVAL, "port %d is not in [0, 65535]", o->port);
    if (o->n_prompt_cache_dirs < 0 || o->n_prompt_cache_dirs > 7 || (o->n_prompt_cache_dirs && !o->prompt_cache_dirs))
        return kvt__fail(KVT_EINVAL, "%d published cache directories: 0 to 7", o->n_prompt_cache_dirs);
    kvt_server *s = calloc(1, sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "out of memory");
    s->o = *o;
    pthread_mutex_init(&s->tiers_mu, NULL);
    s->host = xstrdup(!o->host || !strcmp(o->host, "localhost") ? "127.0.0.1" : o->host);
    int names_ok = 1;
    s->n_md = o->n_models ? o->n_models : 1;
    for (int i = 0; i < s->n_md; i++) {
        const kvt_server_model *want = o->n_models ? &o->models[i] : NULL;
        const char *mp = want ? want->model_path : o->model_path, *tp = want ? want->tok_path : o->tok_path;
        const char *nm = want ? want->model_name : o->model_name;
        s->md[i].model_path = xstrdup(mp);
        s->md[i].tok_path = xstrdup(tp);
        s->md[i].name_opt = xstrdup(nm);
        names_ok &= (!mp || s->md[i].model_path) && (!tp || s->md[i].tok_path) && (!nm || s->md[i].name_opt);
    }
    s->o.models = NULL;
    s->o.model_path = s->o.tok_path = s->o.model_name = NULL;
    s->ssd_dir = xstrdup(o->ssd_dir);
    s->redis_url = xstrdup(o->redis_url);
    s->api_key = xstrdup(o->api_key);
    s->live_dir = xstrdup(o->live_cache_dir);
    for (int i = 0; i < o->n_prompt_cache_dirs; i++)
        s->pub_dirs[i] = xstrdup(o->prompt_cache_dirs[i]);
    s->o.prompt_cache_dirs = (const char *const *)s->pub_dirs;
    s->o.host = s->host;
    s->o.ssd_dir = s->ssd_dir;
    s->o.redis_url = s->redis_url;
    s->o.api_key = s->api_key;
    s->o.live_cache_dir = s->live_dir;
    if (s->o.max_queue < 0)
        s->o.max_queue = 0;
    if (!s->o.max_running)
        s->o.max_running = 64;
    if (s->o.prefill_chunk < 0 || s->o.prefill_chunk > KVT_MODEL_CHUNK)
        s->o.prefill_chunk = s->o.prefill_chunk < 0 ? 1 : KVT_MODEL_CHUNK;
    if (!s->o.max_body)
        s->o.max_body = 1 << 20;
    if (!s->o.conn_timeout_s)
        s->o.conn_timeout_s = 30;
    if (!s->o.max_connections)
        s->o.max_connections = 256;
    atomic_init(&s->next_id, ((unsigned long long)time(NULL) << 20) ^ (unsigned long long)getpid());
    s->metrics = kvt_srv_metrics_create();
    kvt_dash_opts dopt = {.metrics = s->metrics, .snapshot = dash_snapshot, .ctx = s};
    if (!s->metrics || !s->host || !names_ok || (o->live_cache_dir && !s->live_dir) || kvt_dash_create(&dopt, &s->dash)) {
        kvt_server_destroy(s);
        return kvt__fail(KVT_ENOMEM, "out of memory");
    }
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC;
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, s->host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)o->port);
    } else if (inet_pton(AF_INET6, s->host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)o->port);
        flags |= MHD_USE_IPv6;
    } else {
        int rc = kvt__fail(KVT_EINVAL, "--host '%s' is not an IPv4 or IPv6 address", s->host);
        kvt_server_destroy(s);
        return rc;
    }
    s->d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, handler, s, MHD_OPTION_SOCK_ADDR, &ss,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, s, MHD_OPTION_CONNECTION_TIMEOUT,
                            s->o.conn_timeout_s, MHD_OPTION_CONNECTION_LIMIT, s->o.max_connections,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)65536, MHD_OPTION_END);
    if (!s->d) {
        int err = errno ? errno : EADDRINUSE;
        int rc = kvt__fail(-err, "cannot listen on %s port %d: %s", s->host, o->port, strerror(err));
        kvt_server_destroy(s);
        return rc;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : o->port;
    *out = s;
    return 0;
}

int kvt_server_port(const kvt_server *s) { return s ? s->port : 0; }

/* Says once, and again when the number changes, that the Redis Cluster of
 * --redis leaves hash slots without a node: keys in them are never cached
 * remotely. @return 1 when it warned. */
static int warn_uncovered_slots(kvt_server *s, srv_model *md)
{
    kvt_remote *r = s->o.redis_cluster ? kvt_tiers_remote(md->tiers) : NULL;
    kvt_remote_stats rs;
    if (!r || kvt_remote_stats_get(r, &rs) || !rs.healthy)
        return 0; /* an unreachable cluster is warned about as such */
    int64_t uncovered = 16384 - (int64_t)rs.slots_covered;
    if (uncovered == md->slots_said)
        return 0;
    md->slots_said = uncovered;
    if (uncovered <= 0)
        return 0;
    kvt_remote_url u;
    char where[300] = "?";
    if (kvt_remote_url_parse(s->redis_url, &u) == 0)
        snprintf(where, sizeof where, "%s:%d", u.host, u.port);
    memset(&u, 0, sizeof u); /* the password copy */
    fprintf(stderr,
            "kvtier serve: warning: Redis Cluster %s (model %s) assigns only %llu of the 16384 hash slots to a node: "
            "%lld slots are not covered, so prefixes whose keys fall in them are never stored or found remotely "
            "(replies are unaffected; assign them with CLUSTER ADDSLOTS; /stats remote.slots_covered)\n",
            where, md->model_name, (unsigned long long)rs.slots_covered, (long long)uncovered);
    return 1;
}

int kvt_server_poll_tiers(kvt_server *s)
{
    if (!s || s->stopped || !atomic_load(&s->ready))
        return 0;
    int n = 0;
    for (int i = 0; i < s->n_md; i++) {
        srv_model *md = &s->md[i];
        if (!md->tiers)
            continue;
        n += warn_uncovered_slots(s, md);
        kvt_tiers_status st;
        kvt_tiers_poll(md->tiers, &st);
        pthread_mutex_lock(&s->tiers_mu);
        md->tiers_st = st;
        pthread_mutex_unlock(&s->tiers_mu);
        n += kvt_tiers_say(&st, "kvtier serve", "/stats counts it", stderr);
    }
    return n;
}

const char *kvt_server_model_name(const kvt_server *s) { return s ? s->md[0].model_name : ""; }

/* The KVTIER_TEST_LOAD_GATE test hook (server.h): waits until the named
 * file exists, for at most 60 s. */
static void load_gate(void)
{
    const char *gate = getenv("KVTIER_TEST_LOAD_GATE");
    for (int i = 0; gate && *gate && access(gate, F_OK) != 0 && i < 6000; i++)
        usleep(10000);
}

int kvt_server_model_count(const kvt_server *s) { return s ? s->n_md : 0; }

const char *kvt_server_model_id(const kvt_server *s, int i)
{
    return s && i >= 0 && i < s->n_md ? s->md[i].model_name : "";
}

/* Loads model i: engine, tokenizer, tier stack, service (joined to the
 * pool as "service:<id>"), engine thread. */
static int load_model(kvt_server *s, int i)
{
    srv_model *md = &s->md[i];
    static char used_model[4096], used_tok[4096];
    int rc = kvt_chat_load_paths(md->model_path, md->tok_path, &md->m, &md->tok, used_model, used_tok,
                                 sizeof used_model);
    if (rc)
        return rc;
    kvt_model_set_kv_scheme(md->m, (kvt_kv_scheme)s->o.kv_scheme); /* before any cache (and the SSD identity) is made */
    if (s->o.threads && (rc = kvt_model_set_threads(md->m, s->o.threads)))
        return rc;
    const kvt_model_config *cfg = kvt_model_get_config(md->m);
    md->seq_len = cfg->seq_len;
    md->vocab = cfg->vocab_size;
    if (md->name_opt)
        snprintf(md->model_name, sizeof md->model_name, "%s", md->name_opt);
    else {
        const char *b = strrchr(used_model, '/');
        b = b ? b + 1 : used_model;
        snprintf(md->model_name, sizeof md->model_name, "%.63s", b);
        char *dot = strrchr(md->model_name, '.');
        if (dot && dot != md->model_name)
            *dot = '\0';
    }
    for (int k = 0; k < i; k++)
        if (!strcmp(s->md[k].model_name, md->model_name))
            return kvt__fail(KVT_EINVAL, "models %d and %d both have the id '%s': give one a --model-name", k + 1,
                             i + 1, md->model_name);
    char member[80], rmember[80];
    snprintf(member, sizeof member, "service:%s", md->model_name);
    snprintf(rmember, sizeof rmember, "remote:%s", md->model_name);
    kvt_chat_service_opts so = {.prompt_cache_bytes = s->o.prompt_cache_bytes, .kv_budget_bytes = s->o.kv_budget_bytes,
                                .demote_idle_ms = s->o.demote_idle_ms, .pool = s->pool, .pool_name = member};
    kvt_chat_identity ident;
    int levels = s->ssd_dir || s->redis_url || s->o.n_prompt_cache_dirs;
    if (levels && (rc = kvt_chat_identity_compute(md->m, used_tok, &ident)))
        return rc;
    /* a disk that cannot be written degrades the tier (read-only or off,
     * warned by kvt_server_poll_tiers), never the server. The models share
     * the SSD root, whose budget is over the whole root: the first model's
     * store charges it to the pool, once */
    kvt_tiers_opts to = {.ssd_dir = s->ssd_dir, .ssd_max_bytes = s->o.ssd_max_bytes, .ssd_verify = s->o.ssd_verify,
                         .ssd_pool = i == 0 ? s->pool : NULL, .redis_pool = s->pool, .redis_pool_name = rmember,
                         .prompt_cache_dirs = s->o.prompt_cache_dirs, .n_prompt_cache_dirs = s->o.n_prompt_cache_dirs,
                         .redis_url = s->redis_url, .redis_cluster = s->o.redis_cluster,
                         .redis_timeout_ms = s->o.redis_timeout_ms, .redis_ttl_s = s->o.redis_ttl_s,
                         .redis_restore_timeout_ms = s->o.redis_restore_timeout_ms};
    if ((rc = kvt_tiers_open(md->m, levels ? &ident : NULL, &to, &md->tiers)))
        return rc;
    md->store = kvt_tiers_store(md->tiers);
    if (kvt_tiers_cold_tier(md->tiers, &md->tier) == 0) {
        so.cold = &md->tier;
        so.chain = kvt_tiers_chain(md->tiers);
    }
    if (s->o.checkpoint_every > 0 && md->store) { /* no store (SSD off): nothing is checkpointed */
        so.checkpoint_store = md->store;
        so.checkpoint_every = s->o.checkpoint_every;
        so.checkpoint_sync = s->o.checkpoint_sync;
    }
    if ((rc = kvt_chat_service_create(md->m, &so, &md->svc)))
        return rc;
    kvt_srv_sched_opts sco = {.max_queue = s->o.max_queue, .max_running = s->o.max_running,
                              .prefill_chunk = s->o.prefill_chunk,

                              .live_cache_blocks = s->o.live_cache_blocks, .live_cache_bytes = s->o.live_cache_bytes,
                              .live_cache_dir = s->o.live_cache_dir, .live_cache_strict = s->o.live_cache_strict};
    if ((rc = kvt_srv_sched_create(md->m, md->tok, md->svc, s->metrics, &sco, &md->sched)))
        return kvt__fail(rc, "cannot start the engine thread of model '%s'", md->model_name);
    return 0;
}

int kvt_server_load(kvt_server *s)
{
    load_gate();
    if (s->n_md > 1 || s->o.pool_ram_bytes || s->o.pool_kv_bytes || s->o.pool_disk_bytes || s->o.pool_remote_bytes) {
        kvt_pool_limits pl = {{s->o.pool_ram_bytes, s->o.pool_kv_bytes, s->o.pool_disk_bytes, s->o.pool_remote_bytes}};
        int rc = kvt_pool_create(&pl, &s->pool);
        if (rc)
            return rc;
    }
    for (int i = 0; i < s->n_md; i++) {
        int rc = load_model(s, i);
        if (rc)
            return rc;
    }
    s->created = unix_s();
    atomic_store(&s->ready, 1);
    return 0;
}

int kvt_server_stop(kvt_server *s, int64_t timeout_ms)
{
    if (!s || s->stopped)
        return 0;
    s->stopped = 1;
    atomic_store(&s->stopping, 1);
    kvt_dash_stop(s->dash);
    if (s->d) {
        MHD_socket lfd = MHD_quiesce_daemon(s->d);
        if (lfd != MHD_INVALID_SOCKET)
            close(lfd);
    }
    /* every engine thread drains within the one timeout */
    int64_t t0 = (int64_t)(kvt_now_ns() / 1000000);
    for (int i = 0; i < s->n_md; i++) {
        int64_t left = timeout_ms - ((int64_t)(kvt_now_ns() / 1000000) - t0);
        if (s->md[i].sched)
            kvt_srv_sched_drain(s->md[i].sched, left > 0 ? left : 0);
    }
    /* let finished requests hand their last bytes to their clients */
    for (int i = 0; i < 200 && atomic_load(&s->active) > 0; i++)
        usleep(5000);
    if (s->d) {
        MHD_stop_daemon(s->d);
        s->d = NULL;
    }
    int rc = 0;
    for (int i = 0; i < s->n_md; i++) {
        srv_model *md = &s->md[i];
        kvt_srv_sched_destroy(md->sched);
        md->sched = NULL;
        if (md->svc) {
            int rc1 = kvt_service_close(md->svc);
            kvt_service_destroy(md->svc);
            md->svc = NULL;
            if (!rc)
                rc = rc1;
        }
        if (md->tiers) {
            kvt_tiers_status st;
            md->store = NULL;
            int rc2 = kvt_tiers_close(md->tiers, &st);
            md->tiers = NULL;
            kvt_tiers_say(&st, "kvtier serve", "/stats counts it", stderr);
            if (!rc)
                rc = rc2;
        }
    }
    return rc;
}

void kvt_server_destroy(kvt_server *s)
{
    if (!s)
        return;
    kvt_server_stop(s, 0);
    for (int i = 0; i < s->n_md; i++) {
        kvt_tokenizer_free(s->md[i].tok);
        kvt_model_free(s->md[i].m);
        free(s->md[i].model_path);
        free(s->md[i].tok_path);
        free(s->md[i].name_opt);
    }
    kvt_pool_destroy(s->pool); /* every member has left */
    kvt_dash_destroy(s->dash);
    kvt_srv_metrics_destroy(s->metrics);
    free(s->host);
    free(s->ssd_dir);
    if (s->redis_url) /* it may hold a password */
        memset(s->redis_url, 0, strlen(s->redis_url));
    free(s->redis_url);
    free(s->api_key);
    free(s->live_dir);
    for (int i = 0; i < 8; i++)
        free(s->pub_dirs[i]);
    pthread_mutex_destroy(&s->tiers_mu);
    free(s);
}
