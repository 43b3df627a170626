/*
 * test_serve_openai.c: the OpenAI wire format of kvtier serve on its own
 * (server/openai.h): request bodies parsed into turns and prompts, every
 * validation error naming its field, the stream chunk framing, the usage
 * object, UTF-8 hold-back and repair of reply bytes, and the API key
 * comparison.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "openai.h"

#include <stdlib.h>
#include <string.h>

static int parse(kvt_oai_kind k, const char *body, kvt_oai_request *r, kvt_oai_error *e)
{
    return kvt_oai_parse(k, body, strlen(body), r, e);
}

static void expect_bad(kvt_oai_kind k, const char *body, const char *param, const char *needle)
{
    kvt_oai_request r;
    kvt_oai_error e;
    assert_int_equal(parse(k, body, &r, &e), 400);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, param ? param : "");
    if (!strstr(e.message, needle))
        fprintf(stderr, "'%s' lacks '%s'\n", e.message, needle);
    assert_non_null(strstr(e.message, needle));
    assert_null(r.user); /* cleared on error */
}

static void test_chat_turns(void **state)
{
    kvt_oai_request r;
    kvt_oai_error e;
    const char *body = "{\"model\": \"m\", \"messages\": ["
                       "{\"role\": \"system\", \"content\": \"Be brief.\"},"
                       "{\"role\": \"user\", \"content\": \"Hi\"},"
                       "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"there\"}]},"
                       "{\"role\": \"assistant\", \"content\": \" Hello\"},"
                       "{\"role\": \"user\", \"content\": \"Story?\"}],"
                       "\"max_completion_tokens\": 12, \"max_tokens\": 99, \"temperature\": 0, \"seed\": 7,"
                       "\"stop\": [\"x\", \"\", \"yz\"], \"stream\": true, \"stream_options\": {\"include_usage\": true},"
                       "\"user\": \"u1\", \"prompt_cache_key\": \"conv-9\", \"n\": 1, \"unknown\": [1]}";
    assert_int_equal(parse(KVT_OAI_CHAT, body, &r, &e), 0);
    assert_int_equal(r.n_turns, 2);
    assert_string_equal(r.user[0], "Hi\nthere"); /* consecutive user messages joined */
    assert_string_equal(r.reply[0], " Hello");
    assert_string_equal(r.user[1], "Story?");
    assert_string_equal(r.system, "Be brief.");
    assert_string_equal(r.model, "m");
    assert_int_equal(r.max_tokens, 12); /* max_completion_tokens wins */
    assert_true(r.temperature == 0.0);
    assert_true(r.has_seed && r.seed == 7);
    assert_int_equal(r.n_stop, 2); /* the empty one is dropped */
    assert_string_equal(r.stop[1], "yz");
    assert_true(r.stream && r.include_usage);
    assert_string_equal(r.session, "conv-9"); /* prompt_cache_key before user */
    kvt_oai_request_clear(&r);
    assert_int_equal(parse(KVT_OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}", &r, &e), 0);
    assert_true(r.temperature == 1.0 && r.top_p == 1.0 && r.max_tokens == -1 && !r.stream && !r.session);
    kvt_oai_request_clear(&r);
}

static void test_prompt_forms(void **state)
{
    kvt_oai_request r;
    kvt_oai_error e;
    assert_int_equal(parse(KVT_OAI_COMPLETION, "{\"prompt\": \"Once\"}", &r, &e), 0);
    assert_string_equal(r.prompt_text, "Once");
    kvt_oai_request_clear(&r);
    assert_int_equal(parse(KVT_OAI_COMPLETION, "{\"prompt\": [\"Once\"]}", &r, &e), 0);
    assert_string_equal(r.prompt_text, "Once");
    kvt_oai_request_clear(&r);
    assert_int_equal(parse(KVT_OAI_COMPLETION, "{\"prompt\": [1, 5, 9]}", &r, &e), 0);
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[2], 9);
    kvt_oai_request_clear(&r);
    assert_int_equal(parse(KVT_OAI_COMPLETION, "{\"prompt\": [[1, 5]]}", &r, &e), 0);
    assert_int_equal(r.n_prompt_ids, 2);
    kvt_oai_request_clear(&r);
}

static void test_validation(void **state)
{
    expect_bad(KVT_OAI_CHAT, "{\"messages\": [}", NULL, "line 1, column 15");
    expect_bad(KVT_OAI_CHAT, "", NULL, "malformed JSON");
    expect_bad(KVT_OAI_CHAT, "\"text\"", NULL, "JSON object");
    expect_bad(KVT_OAI_CHAT, "{\"messages\": 3}", "messages", "an array");
    expect_bad(KVT_OAI_CHAT, "{\"messages\": []}", "messages", "at least one");
    expect_bad(KVT_OAI_CHAT, "{}", "messages", "required");
    expect_bad(KVT_OAI_CHAT, "{\"messages\": [{\"content\": \"a\"}]}", "messages[0].role", "required");
    expect_bad(KVT_OAI_CHAT, "{\"messages\": [{\"role\": \"tool\", \"content\": \"a\"}]}", "messages[0].role",
               "\"user\"");
    expect_bad(KVT_OAI_CHAT, "{\"messages\": [{\"role\": \"assistant\", \"content\": \"a\"}]}", "messages[0].role",
               "start with a user");
    expect_bad(KVT_OAI_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}",
               "messages", "last message");
    expect_bad(KVT_OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": {\"x\": 1}}]}", "messages[0].content",
               "a string or an array");
    expect_bad(KVT_OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}",
               "messages[0].content", "text part");
    const char *m = "\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]";
    char body[512];
    struct {
        const char *field, *param, *needle;
    } cases[] = {
        {"\"max_tokens\": 1.5", "max_tokens", "an integer, got a number"},
        {"\"max_tokens\": 0", "max_tokens", "at least 1"},
        {"\"max_completion_tokens\": \"5\"", "max_completion_tokens", "an integer, got a string"},
        {"\"temperature\": 3", "temperature", "[0, 2]"},
        {"\"temperature\": true", "temperature", "a number, got a boolean"},
        {"\"top_p\": 0", "top_p", "(0, 1]"},
        {"\"seed\": \"1\"", "seed", "an integer"},
        {"\"n\": 2", "n", "must be 1"},
        {"\"stop\": 5", "stop", "a string or an array"},
        {"\"stop\": [\"a\", \"b\", \"c\", \"d\", \"e\"]", "stop", "at most 4"},
        {"\"stop\": [\"a\", 1]", "stop", "'stop[1]' must be a string"},
        {"\"stream\": \"yes\"", "stream", "a boolean"},
        {"\"stream_options\": {\"include_usage\": 1}", "stream_options.include_usage", "a boolean"},
        {"\"model\": 4", "model", "a string"},
        {"\"user\": 4", "user", "a string"},
        {"\"prompt_cache_key\": []", "prompt_cache_key", "a string"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(body, sizeof body, "{%s, %s}", m, cases[i].field);
        expect_bad(KVT_OAI_CHAT, body, cases[i].param, cases[i].needle);
    }
    expect_bad(KVT_OAI_COMPLETION, "{}", "prompt", "required");
    expect_bad(KVT_OAI_COMPLETION, "{\"prompt\": 5}", "prompt", "a string or an array");
    expect_bad(KVT_OAI_COMPLETION, "{\"prompt\": []}", "prompt", "no token");
    expect_bad(KVT_OAI_COMPLETION, "{\"prompt\": [1, -2]}", "prompt", "'prompt[1]'");
    expect_bad(KVT_OAI_COMPLETION, "{\"prompt\": [\"a\", \"b\"]}", "prompt", "one string only");
    expect_bad(KVT_OAI_COMPLETION, "{\"prompt\": \"a\\u0000b\"}", NULL, "\\u0000"); /* jansson refuses NUL */
    expect_bad(KVT_OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"seed\": 1, \"seed\": 2}", NULL,
               "duplicate");
}

static void test_error_object(void **state)
{
    kvt_oai_error e;
    kvt_oai_error_set(&e, 429, "rate_limit_error", NULL, "queue_full", "full: %d", 3);
    char *s = kvt_oai_error_json(&e);
    assert_string_equal(s, "{\"error\":{\"message\":\"full: 3\",\"type\":\"rate_limit_error\",\"param\":null,"
                           "\"code\":\"queue_full\"}}");
    free(s);
    kvt_oai_error_set(&e, 400, "invalid_request_error", "x", NULL, "bad \xFF byte");
    s = kvt_oai_error_json(&e); /* a client byte that is not UTF-8 is repaired, never dropped silently */
    assert_non_null(s);
    assert_non_null(strstr(s, "bad \xEF\xBF\xBD byte"));
    assert_non_null(strstr(s, "\"param\":\"x\",\"code\":null"));
    free(s);
}

static void test_chunks_and_usage(void **state)
{
    kvt_oai_usage u = {.prompt_tokens = 12, .completion_tokens = 3, .reused_ram = 6, .reused_ssd = 2,
                       .reused_remote = 1, .reused_published = 1, .prefilled_tokens = 2, .queue_ms = 0.5, .ttft_ms = 1.25, .engine_ms = 2};
    char *ev = kvt_oai_chunk_event(KVT_OAI_CHAT, "id1", 5, "m", 1, NULL, 0, NULL, 1, NULL);
    assert_string_equal(ev, "data: {\"id\":\"id1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\","
                            "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
                            "\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n");
    free(ev);
    ev = kvt_oai_chunk_event(KVT_OAI_CHAT, "id1", 5, "m", 0, "ab\"c", 3, NULL, 0, NULL);
    assert_non_null(strstr(ev, "\"delta\":{\"content\":\"ab\\\"\"}"));
    assert_null(strstr(ev, "usage")); /* no include_usage: no usage field */
    free(ev);
    ev = kvt_oai_chunk_event(KVT_OAI_COMPLETION, "id2", 5, "m", 0, NULL, 0, "length", 1, NULL);
    assert_non_null(strstr(ev, "\"object\":\"text_completion\""));
    assert_non_null(strstr(ev, "{\"text\":\"\",\"index\":0,\"logprobs\":null,\"finish_reason\":\"length\"}"));
    free(ev);
    ev = kvt_oai_chunk_event(KVT_OAI_CHAT, "id1", 5, "m", 0, NULL, 0, NULL, 1, &u);
    assert_non_null(strstr(ev, "\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,"
                               "\"total_tokens\":15,\"prompt_tokens_details\":{\"cached_tokens\":10},"
                               "\"kvtier\":{\"reused_tokens\":{\"ram\":6,\"ssd\":2,\"remote\":1,\"published\":1},"
                               "\"prefilled_tokens\":2,"
                               "\"queue_ms\":0.5,\"ttft_ms\":1.25,\"engine_ms\":2"));
    free(ev);
    /* a chain level's name gives the tier its reuse is reported under */
    assert_int_equal(kvt_oai_tier_of_level("ssd"), 1);
    assert_int_equal(kvt_oai_tier_of_level("redis"), 2);
    assert_int_equal(kvt_oai_tier_of_level("published"), 3);
    assert_int_equal(kvt_oai_tier_of_level("published:2"), 3);
    char *resp = kvt_oai_response_json(KVT_OAI_CHAT, "c1", 9, "m", "Hi", 2, "stop", &u);
    assert_non_null(strstr(resp, "\"object\":\"chat.completion\""));
    assert_non_null(strstr(resp, "\"message\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"logprobs\":null,"
                                 "\"finish_reason\":\"stop\""));
    free(resp);
}

static void test_utf8(void **state)
{
    assert_int_equal(kvt_oai_utf8_complete("ab\xE2\x82", 4), 2);     /* a euro sign half-way: held back */
    assert_int_equal(kvt_oai_utf8_complete("ab\xE2\x82\xAC", 5), 5); /* complete */
    assert_int_equal(kvt_oai_utf8_complete("\xF0\x9F\x98", 3), 0);
    assert_int_equal(kvt_oai_utf8_complete("a\xFF", 2), 2);          /* never valid: not held */
    assert_int_equal(kvt_oai_utf8_complete("a\x80", 2), 2);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    assert_int_equal(kvt_oai_utf8_append(&buf, &len, &cap, "a\xFF\xE2\x82\xAC\xC3", 6), 0);
    assert_string_equal(buf, "a\xEF\xBF\xBD\xE2\x82\xAC\xEF\xBF\xBD"); /* bad and cut bytes become U+FFFD */
    assert_int_equal(len, strlen(buf));
    assert_int_equal(kvt_oai_utf8_append(&buf, &len, &cap, "\xED\xA0\x80", 3), 0); /* a surrogate */
    assert_string_equal(buf + 10, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
    free(buf);
}

static void test_key(void **state)
{
    assert_true(kvt_oai_key_equal("sekrit", "sekrit"));
    assert_false(kvt_oai_key_equal("sekriT", "sekrit"));
    assert_false(kvt_oai_key_equal("sekrit2", "sekrit"));
    assert_false(kvt_oai_key_equal("sekri", "sekrit"));
    assert_false(kvt_oai_key_equal("", "sekrit"));
    assert_false(kvt_oai_key_equal(NULL, "sekrit"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_turns),   cmocka_unit_test(test_prompt_forms),
        cmocka_unit_test(test_validation),   cmocka_unit_test(test_error_object),
        cmocka_unit_test(test_chunks_and_usage), cmocka_unit_test(test_utf8),
        cmocka_unit_test(test_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
