/*
 * openai.h: the OpenAI wire format of `kvtier serve`: parsing and validating
 * the bodies of POST /v1/chat/completions and /v1/completions into a request
 * the scheduler can run, and building the JSON it answers with (whole
 * responses, server-sent-event chunks, usage, error objects).
 *
 * Owns no state and never touches the model or the service: everything here
 * is a pure function of its arguments, so it is tested on its own
 * (tests/test_serve_openai.c). Bodies are untrusted: every field is checked
 * for its type and range, and a failure names the field.
 *
 * Thread-safety: every function may be called from any thread.
 */
#ifndef KVT_SERVER_OPENAI_H
#define KVT_SERVER_OPENAI_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Which endpoint a body was sent to. */
typedef enum kvt_oai_kind { KVT_OAI_CHAT = 0, KVT_OAI_COMPLETION = 1 } kvt_oai_kind;

/** Most stop sequences a request may give (OpenAI's limit). */
#define KVT_OAI_MAX_STOP 4

/** An OpenAI-style error: the HTTP status and the four fields of
 * {"error": {"message", "type", "param", "code"}}. */
typedef struct kvt_oai_error {
    int status;          /* HTTP status: 400, 401, 404, 405, 413, 429, 500, 503 */
    char message[512];   /* what is wrong, for a person */
    const char *type;    /* "invalid_request_error", "authentication_error", ... (static) */
    char param[64];      /* the offending field, "" for none (null in JSON) */
    const char *code;    /* a short machine code or NULL (null in JSON), static */
} kvt_oai_error;

/** Fills `e` (status, type, param, code, printf-style message). `param` and
 * `code` may be NULL. @return e->status. */
int kvt_oai_error_set(kvt_oai_error *e, int status, const char *type, const char *param, const char *code,
                      const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/** The error object as a JSON document; caller frees with free(). NULL
 * when out of memory. */
char *kvt_oai_error_json(const kvt_oai_error *e);

/** A parsed request. Zeroed by kvt_oai_parse; release with kvt_oai_request_clear. */
typedef struct kvt_oai_request {
    kvt_oai_kind kind;
    char *model;            /* "model", NULL when absent (the served model is used) */
    /* chat: the conversation split into turns for kvt_chat_render: user[i]
     * and the assistant reply reply[i] that followed it (n_turns - 1 replies;
     * the last turn is the one to answer); system text rendered before it */
    char **user, **reply;   /* (n_turns) and (n_turns - 1) strings */
    int32_t n_turns;
    char *system;           /* system/developer messages joined by '\n', NULL if none */
    /* completion: the prompt as text, or as token ids */
    char *prompt_text;      /* NUL-terminated, NULL when given as ids */
    int32_t *prompt_ids;    /* (n_prompt_ids) when given as ids */
    int64_t n_prompt_ids;
    /* sampling and limits */
    int64_t max_tokens;     /* "max_completion_tokens" or "max_tokens"; -1 when absent */
    double temperature;     /* [0, 2], default 1 */
    double top_p;           /* (0, 1], default 1 */
    int has_seed;
    uint64_t seed;          /* "seed" when has_seed */
    char *stop[KVT_OAI_MAX_STOP]; /* stop sequences (non-empty strings) */
    int n_stop;
    int stream;             /* "stream": true */
    int include_usage;      /* "stream_options": {"include_usage": true} */
    char *session;          /* "prompt_cache_key", else "user"; NULL when neither */
} kvt_oai_request;

/** Parses and validates a request body (JSON, `len` bytes, need not be
 * NUL-terminated).
 *
 * Chat: "messages" is a non-empty array of {"role", "content"}; roles
 * "system"/"developer" (their text goes before the conversation), "user",
 * "assistant"; consecutive messages of one role are joined with '\n'; the
 * conversation must start with a user message after any system text and end
 * with a user message. Content is a string or an array of {"type": "text",
 * "text"} parts. Completion: "prompt" is a string, an array of one string,
 * an array of token ids, or an array of one array of token ids (ids are
 * checked against the vocabulary by the caller).
 * Common: "model" string; "max_tokens"/"max_completion_tokens" integer >= 1;
 * "temperature" number in [0, 2]; "top_p" number in (0, 1]; "seed" integer;
 * "stop" string or array of at most 4 strings; "n" must be 1 when given;
 * "stream" boolean; "stream_options" object with boolean "include_usage";
 * "prompt_cache_key", "user" strings. Unknown fields are ignored, as
 * OpenAI-compatible servers do; null counts as absent.
 *
 * @param out zeroed, then filled on success (release with kvt_oai_request_clear);
 *   cleared on error.
 * @param err on error: status 400 and a message naming the field (for
 *   malformed JSON the line, column and byte position jansson reports).
 * @return 0, or the HTTP status (400; 500 when out of memory). */
int kvt_oai_parse(kvt_oai_kind kind, const char *body, size_t len, kvt_oai_request *out, kvt_oai_error *err);

/** Frees what kvt_oai_parse put in `r` and zeroes it. NULL is a no-op. */
void kvt_oai_request_clear(kvt_oai_request *r);

/** The reused_* field of kvt_oai_usage a restore from the cold tier level
 * named `level_name` (kvt_service_tier_name: "ssd", "redis", "published",
 * "published:N"; NULL or "cold": a cold tier without a chain, counted as
 * "ssd") counts in: 1 ssd, 2 remote, 3 published (0 is ram). */
int kvt_oai_tier_of_level(const char *level_name);

/** What a finished (or finishing) request reports in "usage". */
typedef struct kvt_oai_usage {
    int64_t prompt_tokens, completion_tokens;
    /* prompt tokens reused, by the tier that held them: the RAM prompt
     * cache, the SSD store, the remote tier (Redis), a published cache */
    int64_t reused_ram, reused_ssd, reused_remote, reused_published;
    int64_t prefilled_tokens;        /* prompt tokens run by prefill */
    double queue_ms, ttft_ms;        /* arrival to admission; arrival to the first token */
    double engine_ms;                /* time in prefill and decode steps that ran this request */
    int64_t resumed_tokens;          /* reply tokens restored from a generation checkpoint
                                        (Idempotency-Key), not decoded again */
} kvt_oai_usage;

/** The usage object:
 *   {"prompt_tokens", "completion_tokens", "total_tokens",
 *    "prompt_tokens_details": {"cached_tokens": ram + ssd + remote + published},
 *    "kvtier": {"reused_tokens": {"ram", "ssd", "remote", "published"}, "prefilled_tokens",
 *               "queue_ms", "ttft_ms",
 *               "engine_ms", "resumed_tokens"}}
 * engine_ms counts whole batched decode steps: with several requests
 * batched, each step's time is counted in each of them.
 * @return a new reference, NULL when out of memory. */
json_t *kvt_oai_usage_json(const kvt_oai_usage *u);

/** A whole (non-streaming) response: "chat.completion" with one choice whose
 * message is {"role": "assistant", "content": text}, or "text_completion"
 * with one choice {"text"}; finish_reason "stop" or "length".
 * @param id "chatcmpl-..." / "cmpl-..."; created in Unix seconds.
 * @param text reply bytes (valid UTF-8), text_len bytes; NULL (with text_len
 *   0) is the empty reply "".
 * @return a JSON document, caller frees with free(); NULL when out of memory. */
char *kvt_oai_response_json(kvt_oai_kind kind, const char *id, int64_t created, const char *model,
                            const char *text, size_t text_len, const char *finish_reason,
                            const kvt_oai_usage *u);

/** One streamed chunk as OpenAI sends it, framed as a server-sent event
 * ("data: {...}\n\n"). Chat: "chat.completion.chunk" whose one choice has
 * delta {"role": "assistant", "content": ""} when `first`, else
 * {"content": text} (an empty delta {} when text is NULL), and
 * finish_reason (NULL = null). Completion: "text_completion" with
 * {"text": text or ""}. With include_usage every such chunk carries
 * "usage": null; a usage chunk (u non-NULL) has "choices": [] and the usage.
 * @return the event, caller frees with free(); NULL when out of memory. */
char *kvt_oai_chunk_event(kvt_oai_kind kind, const char *id, int64_t created, const char *model, int first,
                          const char *text, size_t text_len, const char *finish_reason, int include_usage,
                          const kvt_oai_usage *u);

/** How many leading bytes of raw output s[0..n) can be turned into text
 * now: all of them except a trailing lead byte whose sequence is still
 * incomplete (more bytes may complete it). Used to hold back a partial
 * character while streaming; at the end everything is converted. */
size_t kvt_oai_utf8_complete(const char *s, size_t n);

/** Appends `raw` bytes (n) to `dst` as valid UTF-8: a byte outside a
 * valid sequence becomes U+FFFD (the rule kvt_chat_turn applies to replies).
 * @param dst,len,cap a growable buffer (free() it); kept NUL-terminated.
 * @return 0, or -1 when out of memory (dst unchanged). */
int kvt_oai_utf8_append(char **dst, size_t *len, size_t *cap, const char *raw, size_t n);

/** Constant-time comparison of a presented API key with the expected one:
 * the time depends only on the expected key's length. @return 1 equal, 0 not. */
int kvt_oai_key_equal(const char *presented, const char *expected);

#ifdef __cplusplus
}
#endif
#endif /* KVT_SERVER_OPENAI_H */
