/*
 * fuzz_transcript.c: the `kvtier chat --transcript FILE` reader and writer
 * (transcript_read / transcript_apply / transcript_save, static in
 * cli/cmd_chat.c, compiled into this target by including that file) on
 * arbitrary files. A transcript it accepts resumes a conversation whose
 * turns are exactly the file's strings; a refusal names its cause; saving it and loading the saved file gives the same turns; the
 * next turn runs on a tiny synthetic model (or is refused as too long for
 * its positions) for one input in eight.
 */
#include "../cli/cmd_chat.c"

#include "fuzz_util.h"

static kvt_model *g_model;
static kvt_tokenizer *g_tok;
static kvt_service *g_svc;
static char g_dir[512];

/* The scratch directory (model, tokenizer, the input's file) goes when the
 * process ends normally; a crash leaves it for inspection. */
static void remove_scratch(void)
{
    fz_rmtree(g_dir);
}

static void setup(void)
{
    if (g_model)
        return;
    char mp[600], tp[600];
    if (fz_mkdtemp(g_dir, sizeof g_dir, "transcript"))
        abort();
    atexit(remove_scratch);
    snprintf(mp, sizeof mp, "%s/model.bin", g_dir);
    snprintf(tp, sizeof tp, "%s/tokenizer.bin", g_dir);
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 16;
    p.hidden_dim = 32;
    p.n_layers = 1;
    p.n_heads = 2;
    p.n_kv_heads = 2;
    p.vocab_size = KVT_DEFAULT_VOCAB;
    p.seq_len = 256;
    p.seed = 7;
    kvt_chat_service_opts so;
    memset(&so, 0, sizeof so);
    /* cache off: every input runs alone, whatever ran before it */
    if (kvt_model_synth(&p, mp) || kvt_tokenizer_write_default(tp, KVT_DEFAULT_VOCAB) ||
        kvt_chat_load(mp, tp, &g_model, &g_tok) || kvt_chat_service_create(g_model, &so, &g_svc)) {
        fprintf(stderr, "fuzz_transcript: setup failed: %s\n", kvt_last_error());
        abort();
    }
}

static kvt_chat *new_chat(void)
{
    kvt_chat_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens = 2;
    kvt_chat *c = NULL;
    if (kvt_chat_create(g_model, g_tok, g_svc, &o, &c))
        abort();
    return c;
}

/* Reads path and resumes a new chat from it; NULL when refused (*rc says). */
static kvt_chat *resume(const char *path, json_t **doc, int *rc)
{
    cli_err[0] = '\0';
    *rc = transcript_read(path, doc);
    if (*rc)
        return NULL;
    kvt_chat *c = new_chat();
    *rc = transcript_apply(c, *doc);
    FZ_CHECK(*rc == 0 || *rc == KVT_ENOMEM, "apply of a transcript read returned %d", *rc);
    if (*rc) {
        kvt_chat_free(c);
        json_decref(*doc);
        return NULL;
    }
    return c;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    char path[700], saved[700];
    snprintf(path, sizeof path, "%s/transcript.json", g_dir);
    snprintf(saved, sizeof saved, "%s/saved.json", g_dir);
    if (fz_write_file(path, data, size))
        abort();
    json_t *doc = NULL;
    int rc;
    kvt_chat *c = resume(path, &doc, &rc);
    if (!c) {
        FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_ENOMEM, "read returned %d: %s", rc, cli_err);
        FZ_CHECK(cli_err[0], "refused (%d) without saying why", rc);
        return 0;
    }
    FZ_CHECK(json_is_array(doc) && json_array_size(doc) == (size_t)kvt_chat_turns(c), "%d turns from %zu",
             kvt_chat_turns(c), json_array_size(doc));
    for (int32_t i = 0; i < kvt_chat_turns(c); i++) {
        const char *u, *r;
        FZ_CHECK(!kvt_chat_get_turn(c, i, &u, &r), "turn %d", (int)i);
        json_t *t = json_array_get(doc, (size_t)i);
        FZ_CHECK(!strcmp(u, json_string_value(json_object_get(t, "user"))) &&
                     !strcmp(r, json_string_value(json_object_get(t, "assistant"))),
                 "turn %d differs from the file", (int)i);
    }
    json_decref(doc);
    /* save, read the saved file: the same conversation */
    rc = transcript_save(c, saved);
    FZ_CHECK(rc == 0, "a transcript that was read does not save: %s", cli_err);
    json_t *doc2 = NULL;
    kvt_chat *c2 = resume(saved, &doc2, &rc);
    FZ_CHECK(c2 && kvt_chat_turns(c2) == kvt_chat_turns(c), "reading the saved file: %d %s", rc, cli_err);
    for (int32_t i = 0; i < kvt_chat_turns(c); i++) {
        const char *u, *r, *u2, *r2;
        kvt_chat_get_turn(c, i, &u, &r);
        kvt_chat_get_turn(c2, i, &u2, &r2);
        FZ_CHECK(!strcmp(u, u2) && !strcmp(r, r2), "turn %d changes through save and read", (int)i);
    }
    json_decref(doc2);
    kvt_chat_free(c2);
    unlink(saved);
    /* the next turn on the resumed conversation, for one input in eight (a
     * generation hands work to the model's threads: slow on a loaded host) */
    const char *reply = NULL;
    if (kvt_chat_turns(c) < 64 && size % 8 == 0) {
        rc = kvt_chat_turn(c, "Go on.", &reply, NULL, NULL, NULL);
        FZ_CHECK(rc == 0 || rc == KVT_ELIMIT || rc == KVT_ENOMEM, "turn returned %d: %s", rc, kvt_last_error());
        FZ_CHECK(rc || reply, "a turn without a reply");
    }
    kvt_chat_free(c);
    return 0;
}
