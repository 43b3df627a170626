/*
 * openai.c: the OpenAI wire format of `kvtier serve` (openai.h): request
 * bodies parsed and validated field by field, responses, stream chunks,
 * usage and error objects built with jansson.
 *
 * Must never: trust a field's type, accept a value outside its documented
 * range, or emit a JSON string that is not valid UTF-8.
 */
#include "openai.h"

#include "tokenizer.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DUMP_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(6))

int kvt_oai_error_set(kvt_oai_error *e, int status, const char *type, const char *param, const char *code,
                      const char *fmt, ...)
{
    e->status = status;
    e->type = type;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return status;
}

/* A string made valid UTF-8 (a message may quote client bytes). */
static json_t *safe_string(const char *s)
{
    char *buf = NULL;
    size_t len = 0, cap = 0;
    if (kvt_oai_utf8_append(&buf, &len, &cap, s, strlen(s)))
        return NULL;
    json_t *v = json_stringn(buf ? buf : "", len);
    free(buf);
    return v;
}

char *kvt_oai_error_json(const kvt_oai_error *e)
{
    json_t *err = json_object();
    if (!err)
        return NULL;
    json_object_set_new(err, "message", safe_string(e->message));
    json_object_set_new(err, "type", json_string(e->type ? e->type : "invalid_request_error"));
    json_object_set_new(err, "param", e->param[0] ? safe_string(e->param) : json_null());
    json_object_set_new(err, "code", e->code ? json_string(e->code) : json_null());
    json_t *doc = json_pack("{s:o}", "error", err);
    char *s = doc ? json_dumps(doc, DUMP_FLAGS) : NULL;
    json_decref(doc);
    return s;
}

/* ---- parsing ---------------------------------------------------------------------- */

static const char *type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static int bad(kvt_oai_error *e, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(kvt_oai_error *e, const char *param, const char *fmt, ...)
{
    char msg[sizeof e->message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvt_oai_error_set(e, 400, "invalid_request_error", param, NULL, "%s", msg);
}

static int bad_type(kvt_oai_error *e, const char *param, const char *want, const json_t *v)
{
    return bad(e, param, "'%s' must be %s, got %s", param, want, type_name(v));
}

static int oom(kvt_oai_error *e)
{
    return kvt_oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
}

/* Present and not null. */
static json_t *field(json_t *doc, const char *name)
{
    json_t *v = json_object_get(doc, name);
    return json_is_null(v) ? NULL : v;
}

/* The text of a message's content: a string, an array of text parts, or null. */
static int content_text(json_t *c, const char *param, char **out, kvt_oai_error *e)
{
    *out = NULL;
    if (!c || json_is_null(c)) {
        *out = strdup("");
        return *out ? 0 : oom(e);
    }
    if (json_is_string(c)) {
        *out = strndup(json_string_value(c), json_string_length(c));
        if (*out && strlen(*out) != json_string_length(c)) {
            free(*out);
            *out = NULL;
            return bad(e, param, "'%s' holds a NUL character", param);
        }
        return *out ? 0 : oom(e);
    }
    if (!json_is_array(c))
        return bad_type(e, param, "a string or an array of text parts", c);
    size_t total = 0, i;
    json_t *part;
    json_array_foreach(c, i, part) {
        json_t *t = json_object_get(part, "text");
        const char *ty = json_string_value(json_object_get(part, "type"));
        if (!json_is_object(part) || !ty || strcmp(ty, "text") || !json_is_string(t))
            return bad(e, param, "'%s[%zu]' must be a text part {\"type\": \"text\", \"text\": \"...\"}", param, i);
        total += json_string_length(t);
    }
    char *s = malloc(total + 1);
    if (!s)
        return oom(e);
    size_t n = 0;
    json_array_foreach(c, i, part) {
        json_t *t = json_object_get(part, "text");
        memcpy(s + n, json_string_value(t), json_string_length(t));
        n += json_string_length(t);
    }
    s[n] = '\0';
    if (strlen(s) != n) {
        free(s);
        return bad(e, param, "'%s' holds a NUL character", param);
    }
    *out = s;
    return 0;
}

/* *dst = *dst + "\n" + add (or add when *dst is NULL); takes add. */
static int join(char **dst, char *add)
{
    if (!*dst) {
        *dst = add;
        return 0;
    }
    size_t a = strlen(*dst), b = strlen(add);
    char *s = realloc(*dst, a + b + 2);
    if (!s) {
        free(add);
        return -1;
    }
    s[a] = '\n';
    memcpy(s + a + 1, add, b + 1);
    free(add);
    *dst = s;
    return 0;
}

static int parse_messages(json_t *msgs, kvt_oai_request *r, kvt_oai_error *e)
{
    if (!msgs)
        return bad(e, "messages", "'messages' is required");
    if (!json_is_array(msgs))
        return bad_type(e, "messages", "an array of messages", msgs);
    size_t n = json_array_size(msgs);
    if (n == 0)
        return bad(e, "messages", "'messages' must hold at least one message");
    r->user = calloc(n, sizeof *r->user);
    r->reply = calloc(n, sizeof *r->reply);
    if (!r->user || !r->reply)
        return oom(e);
    int last = 0; /* 0 none yet, 1 user, 2 assistant */
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i);
        char param[64];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m))
            return bad_type(e, param, "an object", m);
        json_t *role = json_object_get(m, "role");
        snprintf(param, sizeof param, "messages[%zu].role", i);
        if (!json_is_string(role))
            return role ? bad_type(e, param, "a string", role) : bad(e, param, "'%s' is required", param);
        const char *ro = json_string_value(role);
        int kind = !strcmp(ro, "user") ? 1 : !strcmp(ro, "assistant") ? 2
                   : (!strcmp(ro, "system") || !strcmp(ro, "developer")) ? 3 : 0;
        if (!kind)
            return bad(e, param, "'%s' must be \"system\", \"developer\", \"user\" or \"assistant\"", param);
        char cparam[64];
        snprintf(cparam, sizeof cparam, "messages[%zu].content", i);
        char *text = NULL;
        int rc = content_text(json_object_get(m, "content"), cparam, &text, e);
        if (rc)
            return rc;
        if (kind == 3) {
            if (join(&r->system, text))
                return oom(e);
            continue;
        }
        if (kind == 2 && last == 0) {
            free(text);
            return bad(e, param, "the conversation must start with a user message (messages[%zu] is from the "
                       "assistant)", i);
        }
        if (kind == 1 && last == 2)
            r->n_turns++; /* a new turn after a reply */
        if (kind == 1 && last == 0)
            r->n_turns = 1;
        char **slot = kind == 1 ? &r->user[r->n_turns - 1] : &r->reply[r->n_turns - 1];
        if (join(slot, text))
            return oom(e);
        last = kind;
    }
    if (last != 1)
        return bad(e, "messages", last == 0 ? "'messages' holds no user message"
                                             : "the last message must be from the user");
    return 0;
}

static int parse_prompt(json_t *p, kvt_oai_request *r, kvt_oai_error *e)
{
    if (!p)
        return bad(e, "prompt", "'prompt' is required");
    if (json_is_array(p) && json_array_size(p) == 1 &&
        (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0); /* a batch of one */
    if (json_is_string(p)) {
        if (strlen(json_string_value(p)) != json_string_length(p))
            return bad(e, "prompt", "'prompt' holds a NUL character");
        r->prompt_text = strdup(json_string_value(p));
        return r->prompt_text ? 0 : oom(e);
    }
    if (!json_is_array(p))
        return bad_type(e, "prompt", "a string or an array of token ids", p);
    size_t n = json_array_size(p), i;
    if (n == 0)
        return bad(e, "prompt", "'prompt' holds no token");
    r->prompt_ids = malloc(n * sizeof *r->prompt_ids);
    if (!r->prompt_ids)
        return oom(e);
    json_t *v;
    json_array_foreach(p, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return json_array_size(p) > 1 && json_is_string(v)
                       ? bad(e, "prompt", "'prompt' may hold one string only (n > 1 prompts are not supported)")
                       : bad(e, "prompt", "'prompt[%zu]' must be a token id (an integer >= 0)", i);
        r->prompt_ids[i] = (int32_t)json_integer_value(v);
    }
    r->n_prompt_ids = (int64_t)n;
    return 0;
}

static int parse_common(json_t *doc, kvt_oai_request *r, kvt_oai_error *e)
{
    json_t *v;
    if ((v = field(doc, "model"))) {
        if (!json_is_string(v))
            return bad_type(e, "model", "a string", v);
        if (!(r->model = strdup(json_string_value(v))))
            return oom(e);
    }
    const char *mt = field(doc, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if ((v = field(doc, mt))) {
        if (!json_is_integer(v))
            return bad_type(e, mt, "an integer", v);
        if (json_integer_value(v) < 1)
            return bad(e, mt, "'%s' must be at least 1, got %lld", mt, (long long)json_integer_value(v));
        r->max_tokens = json_integer_value(v);
    }
    if ((v = field(doc, "temperature"))) {
        if (!json_is_number(v))
            return bad_type(e, "temperature", "a number", v);
        r->temperature = json_number_value(v);
        if (!(r->temperature >= 0 && r->temperature <= 2))
            return bad(e, "temperature", "'temperature' must be in [0, 2], got %g", r->temperature);
    }
    if ((v = field(doc, "top_p"))) {
        if (!json_is_number(v))
            return bad_type(e, "top_p", "a number", v);
        r->top_p = json_number_value(v);
        if (!(r->top_p > 0 && r->top_p <= 1))
            return bad(e, "top_p", "'top_p' must be in (0, 1], got %g", r->top_p);
    }
    if ((v = field(doc, "seed"))) {
        if (!json_is_integer(v))
            return bad_type(e, "seed", "an integer", v);
        r->has_seed = 1;
        r->seed = (uint64_t)json_integer_value(v);
    }
    if ((v = field(doc, "n"))) {
        if (!json_is_integer(v))
            return bad_type(e, "n", "an integer", v);
        if (json_integer_value(v) != 1)
            return bad(e, "n", "'n' must be 1 (this server returns one choice per request), got %lld",
                       (long long)json_integer_value(v));
    }
    if ((v = field(doc, "stop"))) {
        if (json_is_string(v)) {
            if (json_string_length(v) > 0 && !(r->stop[r->n_stop++] = strdup(json_string_value(v))))
                return oom(e);
        } else if (json_is_array(v)) {
            if (json_array_size(v) > KVT_OAI_MAX_STOP)
                return bad(e, "stop", "'stop' holds %zu sequences, at most %d are allowed", json_array_size(v),
                           KVT_OAI_MAX_STOP);
            size_t i;
            json_t *s;
            json_array_foreach(v, i, s) {
                if (!json_is_string(s))
                    return bad(e, "stop", "'stop[%zu]' must be a string, got %s", i, type_name(s));
                if (json_string_length(s) > 0 && !(r->stop[r->n_stop++] = strdup(json_string_value(s))))
                    return oom(e);
            }
        } else
            return bad_type(e, "stop", "a string or an array of strings", v);
    }
    if ((v = field(doc, "stream"))) {
        if (!json_is_boolean(v))
            return bad_type(e, "stream", "a boolean", v);
        r->stream = json_is_true(v);
    }
    if ((v = field(doc, "stream_options"))) {
        if (!json_is_object(v))
            return bad_type(e, "stream_options", "an object", v);
        json_t *iu = field(v, "include_usage");
        if (iu && !json_is_boolean(iu))
            return bad_type(e, "stream_options.include_usage", "a boolean", iu);
        r->include_usage = json_is_true(iu);
    }
    const char *sess = field(doc, "prompt_cache_key") ? "prompt_cache_key" : "user";
    if ((v = field(doc, sess))) {
        if (!json_is_string(v))
            return bad_type(e, sess, "a string", v);
        if (json_string_length(v) > 0 && !(r->session = strdup(json_string_value(v))))
            return oom(e);
    }
    return 0;
}

int kvt_oai_parse(kvt_oai_kind kind, const char *body, size_t len, kvt_oai_request *out, kvt_oai_error *err)
{
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->max_tokens = -1;
    out->temperature = 1.0;
    out->top_p = 1.0;
    json_error_t je;
    json_t *doc = json_loadb(body ? body : "", body ? len : 0, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!doc) {
        kvt_oai_request_clear(out); /* cleared on every error */
        return bad(err, NULL, "malformed JSON at line %d, column %d (byte %d): %s", je.line, je.column,
                   je.position, je.text);
    }
    int rc;
    if (!json_is_object(doc))
        rc = bad(err, NULL, "the request body must be a JSON object, got %s", type_name(doc));
    else
        rc = parse_common(doc, out, err);
    if (!rc)
        rc = kind == KVT_OAI_CHAT ? parse_messages(field(doc, "messages"), out, err)
                                  : parse_prompt(field(doc, "prompt"), out, err);
    json_decref(doc);
    if (rc)
        kvt_oai_request_clear(out);
    return rc;
}

void kvt_oai_request_clear(kvt_oai_request *r)
{
    if (!r)
        return;
    free(r->model);
    if (r->user)
        for (int32_t i = 0; i < r->n_turns; i++)
            free(r->user[i]);
    if (r->reply)
        for (int32_t i = 0; i < r->n_turns; i++)
            free(r->reply[i]);
    free(r->user);
    free(r->reply);
    free(r->system);
    free(r->prompt_text);
    free(r->prompt_ids);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->session);
    memset(r, 0, sizeof *r);
}

/* ---- responses ---------------------------------------------------------------------- */

static double ms3(double ms) { return round(ms * 1000.0) / 1000.0; }

int kvt_oai_tier_of_level(const char *level_name)
{
    if (!level_name || !strcmp(level_name, "ssd") || !strcmp(level_name, "cold"))
        return 1;
    if (!strcmp(level_name, "redis") || !strcmp(level_name, "remote"))
        return 2;
    if (!strncmp(level_name, "published", 9))
        return 3;
    return 1;
}

json_t *kvt_oai_usage_json(const kvt_oai_usage *u)
{
    int64_t cached = u->reused_ram + u->reused_ssd + u->reused_remote + u->reused_published;
    return json_pack("{s:I, s:I, s:I, s:{s:I}, s:{s:{s:I, s:I, s:I, s:I}, s:I, s:f, s:f, s:f, s:I}}", "prompt_tokens",
                     (json_int_t)u->prompt_tokens, "completion_tokens", (json_int_t)u->completion_tokens,
                     "total_tokens", (json_int_t)(u->prompt_tokens + u->completion_tokens),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)cached,
                     "kvtier", "reused_tokens", "ram", (json_int_t)u->reused_ram, "ssd", (json_int_t)u->reused_ssd,
                     "remote", (json_int_t)u->reused_remote, "published", (json_int_t)u->reused_published,
                     "prefilled_tokens", (json_int_t)u->prefilled_tokens, "queue_ms", ms3(u->queue_ms),
                     "ttft_ms", ms3(u->ttft_ms), "engine_ms", ms3(u->engine_ms), "resumed_tokens",
                     (json_int_t)u->resumed_tokens);
}

static char *dump(json_t *doc)
{
    char *s = doc ? json_dumps(doc, DUMP_FLAGS) : NULL;
    json_decref(doc);
    return s;
}

char *kvt_oai_response_json(kvt_oai_kind kind, const char *id, int64_t created, const char *model,
                            const char *text, size_t text_len, const char *finish_reason,
                            const kvt_oai_usage *u)
{
    if (!text) { /* an empty reply (the first token chosen was a stop) has no buffer */
        text = "";
        text_len = 0;
    }
    json_t *choice;
    if (kind == KVT_OAI_CHAT)
        choice = json_pack("{s:i, s:{s:s, s:s%}, s:n, s:s}", "index", 0, "message", "role", "assistant", "content",
                           text, text_len, "logprobs", "finish_reason", finish_reason);
    else
        choice = json_pack("{s:s%, s:i, s:n, s:s}", "text", text, text_len, "index", 0, "logprobs",
                           "finish_reason", finish_reason);
    json_t *usage = kvt_oai_usage_json(u);
    if (!choice || !usage) {
        json_decref(choice);
        json_decref(usage);
        return NULL;
    }
    return dump(json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", id, "object",
                          kind == KVT_OAI_CHAT ? "chat.completion" : "text_completion", "created",
                          (json_int_t)created, "model", model, "choices", choice, "usage", usage));
}

char *kvt_oai_chunk_event(kvt_oai_kind kind, const char *id, int64_t created, const char *model, int first,
                          const char *text, size_t text_len, const char *finish_reason, int include_usage,
                          const kvt_oai_usage *u)
{
    json_t *doc = json_pack("{s:s, s:s, s:I, s:s}", "id", id, "object",
                            kind == KVT_OAI_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                            (json_int_t)created, "model", model);
    if (!doc)
        return NULL;
    json_t *choices = json_array();
    if (!u) {
        json_t *c;
        if (kind == KVT_OAI_CHAT) {
            json_t *delta = first ? json_pack("{s:s, s:s}", "role", "assistant", "content", "")
                            : text ? json_pack("{s:s%}", "content", text, text_len)
                                   : json_object();
            c = json_pack("{s:i, s:o, s:n, s:o}", "index", 0, "delta", delta, "logprobs", "finish_reason",
                          finish_reason ? json_string(finish_reason) : json_null());
        } else
            c = json_pack("{s:s%, s:i, s:n, s:o}", "text", text ? text : "", text ? text_len : 0, "index", 0,
                          "logprobs", "finish_reason", finish_reason ? json_string(finish_reason) : json_null());
        json_array_append_new(choices, c);
    }
    json_object_set_new(doc, "choices", choices);
    if (u)
        json_object_set_new(doc, "usage", kvt_oai_usage_json(u));
    else if (include_usage)
        json_object_set_new(doc, "usage", json_null());
    char *body = dump(doc);
    if (!body)
        return NULL;
    size_t n = strlen(body);
    char *ev = malloc(n + 9);
    if (ev) {
        memcpy(ev, "data: ", 6);
        memcpy(ev + 6, body, n);
        memcpy(ev + 6 + n, "\n\n", 3);
    }
    free(body);
    return ev;
}

/* ---- UTF-8 and keys ------------------------------------------------------------------ */


size_t kvt_oai_utf8_complete(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    /* a lead byte within the last 3 whose sequence runs past the end */
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = p[n - back];
        if ((c & 0xC0) == 0x80)
            continue;
        size_t need = (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 1;
        return need > back ? n - back : n;
    }
    return n;
}

int kvt_oai_utf8_append(char **dst, size_t *len, size_t *cap, const char *raw, size_t n)
{
    size_t worst = *len + 3 * n + 1;
    if (worst > *cap) {
        size_t nc = *cap ? *cap : 64;
        while (nc < worst)
            nc *= 2;
        char *p = realloc(*dst, nc);
        if (!p)
            return -1;
        *dst = p;
        *cap = nc;
    }
    const unsigned char *p = (const unsigned char *)raw;
    for (size_t i = 0; i < n;) {
        size_t k = kvt_utf8_len(p + i, n - i);
        if (k) {
            memcpy(*dst + *len, p + i, k);
            *len += k;
            i += k;
        } else {
            memcpy(*dst + *len, "\xEF\xBF\xBD", 3);
            *len += 3;
            i++;
        }
    }
    (*dst)[*len] = '\0';
    return 0;
}

int kvt_oai_key_equal(const char *presented, const char *expected)
{
    size_t n = strlen(expected), m = presented ? strlen(presented) : 0;
    volatile unsigned char diff = (unsigned char)(n != m);
    for (size_t i = 0; i < n; i++) {
        unsigned char a = (i < m) ? (unsigned char)presented[i] : 0;
        diff |= (unsigned char)(a ^ (unsigned char)expected[i]);
    }
    return diff == 0;
}
