/*
 * fuzz_openai_request.c: request bodies of POST /v1/chat/completions and
 * /v1/completions to kvt_oai_parse (server/openai.c). The first byte picks
 * the endpoint (bit 0: completion), the rest is the body.
 *
 * A refusal is 400 (or 500 when out of memory) with the same status in the
 * error, a message, and an error object that is valid JSON; the request is
 * left zeroed. An accepted request holds what the parser promises (a chat of
 * n_turns user texts and n_turns - 1 replies, or a prompt as text or ids;
 * limits and sampling inside their ranges; at most 4 non-empty stop
 * sequences), parsing the same body again gives the same request, and a body
 * written back from the parsed request parses to the same request too. The
 * response and stream chunk builders then run on its texts and must give
 * JSON that jansson reads back with the same text.
 */
#include "fuzz_util.h"

#include "openai.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static int str_eq(const char *a, const char *b) { return (!a && !b) || (a && b && !strcmp(a, b)); }

static void check_same(const kvt_oai_request *a, const kvt_oai_request *b, const char *what)
{
    FZ_CHECK(a->kind == b->kind && a->n_turns == b->n_turns && a->n_prompt_ids == b->n_prompt_ids &&
                 a->max_tokens == b->max_tokens && a->temperature == b->temperature && a->top_p == b->top_p &&
                 a->has_seed == b->has_seed && (!a->has_seed || a->seed == b->seed) && a->n_stop == b->n_stop &&
                 a->stream == b->stream && a->include_usage == b->include_usage,
             "%s: scalar fields differ", what);
    FZ_CHECK(str_eq(a->model, b->model) && str_eq(a->system, b->system) && str_eq(a->prompt_text, b->prompt_text) &&
                 str_eq(a->session, b->session),
             "%s: model, system, prompt or session differ", what);
    for (int32_t i = 0; i < a->n_turns; i++) {
        FZ_CHECK(str_eq(a->user[i], b->user[i]), "%s: user text %d differs", what, (int)i);
        if (i + 1 < a->n_turns)
            FZ_CHECK(str_eq(a->reply[i], b->reply[i]), "%s: reply %d differs", what, (int)i);
    }
    if (a->n_prompt_ids)
        FZ_CHECK(!memcmp(a->prompt_ids, b->prompt_ids, (size_t)a->n_prompt_ids * sizeof *a->prompt_ids),
                 "%s: prompt ids differ", what);
    for (int i = 0; i < a->n_stop; i++)
        FZ_CHECK(str_eq(a->stop[i], b->stop[i]), "%s: stop %d differs", what, i);
}

static void check_valid(const kvt_oai_request *r, kvt_oai_kind kind)
{
    FZ_CHECK(r->kind == kind, "kind %d, asked %d", (int)r->kind, (int)kind);
    if (kind == KVT_OAI_CHAT) {
        FZ_CHECK(r->n_turns >= 1 && r->user && r->reply, "a chat of %d turns", (int)r->n_turns);
        for (int32_t i = 0; i < r->n_turns; i++) {
            FZ_CHECK(r->user[i] != NULL, "user text %d is missing", (int)i);
            if (i + 1 < r->n_turns)
                FZ_CHECK(r->reply[i] != NULL, "reply %d is missing", (int)i);
        }
        FZ_CHECK(!r->prompt_text && !r->prompt_ids, "a chat with a completion prompt");
    } else {
        FZ_CHECK((r->prompt_text != NULL) != (r->n_prompt_ids > 0), "prompt: text %p, %lld ids",
                 (void *)r->prompt_text, (long long)r->n_prompt_ids);
        for (int64_t i = 0; i < r->n_prompt_ids; i++)
            FZ_CHECK(r->prompt_ids[i] >= 0, "prompt id %lld is %d", (long long)i, (int)r->prompt_ids[i]);
        FZ_CHECK(r->n_turns == 0 && !r->user, "a completion with chat turns");
    }
    FZ_CHECK(r->max_tokens == -1 || r->max_tokens >= 1, "max_tokens %lld", (long long)r->max_tokens);
    FZ_CHECK(r->temperature >= 0 && r->temperature <= 2, "temperature %g", r->temperature);
    FZ_CHECK(r->top_p > 0 && r->top_p <= 1, "top_p %g", r->top_p);
    FZ_CHECK(r->n_stop >= 0 && r->n_stop <= KVT_OAI_MAX_STOP, "%d stop sequences", r->n_stop);
    for (int i = 0; i < r->n_stop; i++)
        FZ_CHECK(r->stop[i] && r->stop[i][0], "stop %d is empty", i);
    FZ_CHECK(r->stream == 0 || r->stream == 1, "stream %d", r->stream);
    FZ_CHECK(r->include_usage == 0 || r->include_usage == 1, "include_usage %d", r->include_usage);
    FZ_CHECK(!r->session || r->session[0], "an empty session key");
}

/* Writes r back as a request body (jansson), NULL when out of memory or
 * when a text is not valid UTF-8 (json_string refuses it: the parser took
 * it from JSON, so this does not happen). */
static char *write_back(const kvt_oai_request *r)
{
    json_t *doc = json_object();
    if (!doc)
        return NULL;
    int bad = 0;
    if (r->model)
        bad |= json_object_set_new(doc, "model", json_string(r->model));
    if (r->max_tokens >= 1)
        bad |= json_object_set_new(doc, "max_tokens", json_integer(r->max_tokens));
    bad |= json_object_set_new(doc, "temperature", json_real(r->temperature));
    bad |= json_object_set_new(doc, "top_p", json_real(r->top_p));
    if (r->has_seed)
        bad |= json_object_set_new(doc, "seed", json_integer((json_int_t)r->seed));
    if (r->n_stop) {
        json_t *st = json_array();
        for (int i = 0; st && i < r->n_stop; i++)
            bad |= json_array_append_new(st, json_string(r->stop[i]));
        bad |= json_object_set_new(doc, "stop", st);
    }
    bad |= json_object_set_new(doc, "stream", json_boolean(r->stream));
    if (r->include_usage)
        bad |= json_object_set_new(doc, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (r->session)
        bad |= json_object_set_new(doc, "prompt_cache_key", json_string(r->session));
    if (r->kind == KVT_OAI_CHAT) {
        json_t *msgs = json_array();
        if (msgs && r->system)
            bad |= json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", r->system));
        for (int32_t i = 0; msgs && i < r->n_turns; i++) {
            bad |= json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", r->user[i]));
            if (i + 1 < r->n_turns)
                bad |= json_array_append_new(msgs,
                                             json_pack("{s:s, s:s}", "role", "assistant", "content", r->reply[i]));
        }
        bad |= json_object_set_new(doc, "messages", msgs);
    } else if (r->prompt_text) {
        bad |= json_object_set_new(doc, "prompt", json_string(r->prompt_text));
    } else {
        json_t *ids = json_array();
        for (int64_t i = 0; ids && i < r->n_prompt_ids; i++)
            bad |= json_array_append_new(ids, json_integer(r->prompt_ids[i]));
        bad |= json_object_set_new(doc, "prompt", ids);
    }
    char *s = bad ? NULL : json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    return s;
}

/* The answer builders on a text of the request: valid JSON holding it. */
static void check_answers(const kvt_oai_request *r, const char *raw)
{
    if (!raw)
        return;
    char *text = NULL;
    size_t len = 0, cap = 0;
    if (kvt_oai_utf8_append(&text, &len, &cap, raw, strlen(raw)))
        return; /* out of memory */
    FZ_CHECK(kvt_oai_utf8_complete(text, len) == len, "a valid text holds an incomplete sequence");
    kvt_oai_usage u = {.prompt_tokens = 3, .completion_tokens = 2, .reused_ram = 1};
    char *resp = kvt_oai_response_json(r->kind, "id-1", 1, r->model ? r->model : "m", text, len, "stop", &u);
    if (resp) {
        json_error_t je;
        json_t *d = json_loads(resp, 0, &je);
        FZ_CHECK(d != NULL, "the response is not JSON: %s", je.text);
        json_t *c0 = json_array_get(json_object_get(d, "choices"), 0);
        json_t *t = r->kind == KVT_OAI_CHAT ? json_object_get(json_object_get(c0, "message"), "content")
                                            : json_object_get(c0, "text");
        FZ_CHECK(json_is_string(t) && json_string_length(t) == len && !memcmp(json_string_value(t), text, len),
                 "the response does not hold the text");
        json_decref(d);
        free(resp);
    }
    char *ev = kvt_oai_chunk_event(r->kind, "id-1", 1, "m", 0, text, len, NULL, r->include_usage, NULL);
    if (ev) {
        size_t n = strlen(ev);
        FZ_CHECK(n > 8 && !strncmp(ev, "data: ", 6) && !strcmp(ev + n - 2, "\n\n"), "a chunk is not one event");
        ev[n - 2] = '\0';
        json_error_t je;
        json_t *d = json_loads(ev + 6, 0, &je);
        FZ_CHECK(d != NULL, "the chunk is not JSON: %s", je.text);
        json_decref(d);
        free(ev);
    }
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    kvt_oai_kind kind = (data[0] & 1) ? KVT_OAI_COMPLETION : KVT_OAI_CHAT;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    kvt_oai_request r;
    kvt_oai_error e;
    memset(&e, 0, sizeof e);
    int rc = kvt_oai_parse(kind, body, len, &r, &e);
    if (rc) {
        FZ_CHECK(rc == 400 || rc == 500, "parse returned %d", rc);
        FZ_CHECK(e.status == rc && e.message[0] && e.type, "error status %d for %d, message \"%s\"", e.status, rc,
                 e.message);
        kvt_oai_request zero;
        memset(&zero, 0, sizeof zero);
        FZ_CHECK(!memcmp(&r, &zero, sizeof r), "a refused request is not cleared");
        char *ej = kvt_oai_error_json(&e);
        if (ej) {
            json_error_t je;
            json_t *d = json_loads(ej, 0, &je);
            FZ_CHECK(d != NULL, "the error object is not JSON: %s", je.text);
            json_t *er = json_object_get(d, "error");
            FZ_CHECK(json_is_string(json_object_get(er, "message")) && json_is_string(json_object_get(er, "type")),
                     "the error object lacks message or type");
            json_decref(d);
            free(ej);
        }
        return 0;
    }
    check_valid(&r, kind);
    kvt_oai_request again;
    int rc2 = kvt_oai_parse(kind, body, len, &again, &e);
    FZ_CHECK(rc2 == 0 || rc2 == 500, "the same body gave %d the second time", rc2);
    if (rc2 == 0) {
        check_same(&r, &again, "parsed twice");
        kvt_oai_request_clear(&again);
    }
    char *back = write_back(&r);
    if (back) {
        kvt_oai_request r2;
        int rc3 = kvt_oai_parse(kind, back, strlen(back), &r2, &e);
        FZ_CHECK(rc3 == 0 || rc3 == 500, "the written-back body was refused (%d): %s\n%s", rc3, e.message, back);
        if (rc3 == 0) {
            check_same(&r, &r2, "written back");
            kvt_oai_request_clear(&r2);
        }
        free(back);
    }
    check_answers(&r, kind == KVT_OAI_CHAT ? r.user[r.n_turns - 1] : r.prompt_text);
    if (kind == KVT_OAI_CHAT && r.system)
        check_answers(&r, r.system);
    kvt_oai_request_clear(&r);
    kvt_oai_request_clear(&r); /* a cleared request clears again */
    return 0;
}
