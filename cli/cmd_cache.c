/*
 * cmd_cache.c: `kvtier cache publish|inspect|verify`: published prompt
 * caches (kvtier/publish.h). publish prefills each prompt of a JSON Lines
 * file with the reference engine through a cache service whose cold tier is
 * the new generation's staging store (so the entries are exactly those a
 * chat or server would keep for the same tokens), then commits the
 * generation; inspect reads manifests and shard headers only; verify checks
 * every SHA-256 of every generation. Owns no state beyond one command run.
 */
#include "args.h"
#include "chat.h"
#include "cli.h"
#include "seq.h"

#include "kvtier/publish.h"

#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier cache publish --model M --tokenizer T --prompts FILE --out DIR [--keep N]\n"
            "                            [--block N] [--threads N] [--kv-dtype f32|f16|bf16|q8]\n"
            "       kvtier cache inspect DIR\n"
            "       kvtier cache verify DIR\n"
            "\n"
            "Published prompt caches: a prompt cache computed once (a system prompt, few-shot\n"
            "examples, documents) and mounted read-only by `kvtier chat` and `kvtier serve`\n"
            "(--prompt-cache-dir DIR). Format and protocol: docs/publish.md.\n"
            "\n"
            "publish   prefills every prompt of FILE with the reference engine and publishes the\n"
            "          caches as a new generation of DIR: shards written into a staging directory,\n"
            "          a manifest (identity; every shard's path, size, SHA-256, tokens), fsyncs, a\n"
            "          rename into DIR/generations/<id>/, then an atomic switch of DIR/CURRENT.\n"
            "          Readers pick the new generation up between requests.\n"
            "  --prompts FILE   JSON Lines, one prompt per line:\n"
            "                     {\"ns\": \"...\", \"text\": \"...\"}     text, encoded with BOS as chat\n"
            "                                                    and serve encode a prompt\n"
            "                     {\"ns\": \"...\", \"tokens\": [1, ...]}  token ids, used as they are\n"
            "                   \"ns\" is optional (\"\" = the base model); blank lines are skipped\n"
            "  --out DIR        the publication directory (created when absent)\n"
            "  --keep N         generations kept, the new one included (default 2); an older one\n"
            "                   a reader still holds is kept until the next publication\n"
            "  --block N        kv block size in tokens (default 256, as chat and serve)\n"
            "  --threads N      engine threads (default: the model's)\n"
            "  --kv-dtype S     storage scheme of the published K/V: f16 (default, as chat and\n"
            "                   serve), f32, bf16, q8 (8-bit codes per channel over each kv\n"
            "                   block); a generation\n"
            "                   serves only a chat or server running the same --kv-dtype (the\n"
            "                   scheme is part of the cache configuration)\n"
            "  --model M --tokenizer T  a llama2.c checkpoint and its tokenizer (both, or neither\n"
            "                   for the built-in default model); a generation serves only this\n"
            "                   model, tokenizer and cache configuration\n"
            "inspect   every generation's manifest and shard headers (no tensor bytes): identity,\n"
            "          created time, shards with tokens, ns, layers and sizes, and any refusal\n"
            "verify    every check a mount runs plus the SHA-256 of every shard of every\n"
            "          generation; exit 0 only if all are good\n"
            "\n"
            "Exit status: 0 success, 1 failure (the message names it), 2 usage error.\n");
}

static int usage_error(const char *msg, const char *arg)
{
    fprintf(stderr, "kvtier cache: %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    usage(stderr);
    return 2;
}

static int fail(const char *what, int rc)
{
    fprintf(stderr, "kvtier cache: %s: %s (%s)\n", what, kvt_last_error(), kvt_strerror(rc));
    return 1;
}

/* ---- inspect / verify --------------------------------------------------------------- */

/* One shard line, into the FILE ctx (printed after the generation's summary). */
static void print_shard(void *ctx, const kvt_publish_shard_info *s)
{
    FILE *f = ctx;
    const char *type = s->type == 'e' ? "entry" : s->type == 'b' ? "block" : "identity";
    fprintf(f, "    %-8s %s  %lld tokens  ns \"%s\"", type, s->path, (long long)s->tokens, s->ns);
    if (s->type == 'e')
        fprintf(f, "  %d layers", (int)s->n_layers);
    if (s->type != 'i')
        fprintf(f, "  %d tensors", (int)s->n_tensors);
    fprintf(f, "  %llu bytes  sha256 %.16s...%s\n", (unsigned long long)s->bytes, s->sha256,
            s->hash_checked ? " (good)" : "");
}

static int cmd_look(const char *dir, int verify)
{
    char **ids = NULL, current[KVT_PUBLISH_ID_LEN];
    int32_t n = 0;
    const char *cmd = verify ? "kvtier cache verify" : "kvtier cache inspect";
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        fprintf(stderr, "%s: %s: %s\n", cmd, dir, strerror(errno));
        return 1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "%s: %s: not a directory (a published prompt cache is the --out DIR of kvtier cache "
                "publish)\n", cmd, dir);
        return 1;
    }
    int rc = kvt_publish_list(dir, &ids, &n, current);
    if (rc)
        return fail("cannot list the generations", rc);
    if (n == 0 && !current[0]) {
        kvt_publish_ids_free(ids, n);
        fprintf(stderr, "%s: %s is not a published prompt cache: it holds no CURRENT file and no generation "
                "under generations/ (kvtier cache publish --out DIR makes them)\n", cmd, dir);
        return 1;
    }
    printf("publication %s\n  CURRENT %s\n", dir, current[0] ? current : "(none)");
    int bad = 0, current_seen = 0;
    uint64_t total_shards = 0, total_bytes = 0;
    for (int32_t i = n - 1; i >= 0; i--) {
        int is_cur = !strcmp(ids[i], current);
        current_seen |= is_cur;
        char *lines = NULL;
        size_t lines_len = 0;
        FILE *mf = verify ? NULL : open_memstream(&lines, &lines_len);
        kvt_publish_validate_opts vo = {.hashes = verify, .on_shard = mf ? print_shard : NULL, .ctx = mf};
        kvt_publish_report rep;
        int vr = kvt_publish_validate(dir, ids[i], &vo, &rep);
        if (mf)
            fclose(mf);
        printf("generation %s%s", ids[i], is_cur ? " (current)" : "");
        if (vr) {
            free(lines);
            bad++;
            printf("  REFUSED (%s): %s\n", kvt_publish_refusal_name(rep.refusal),
                   rep.refusal ? rep.detail : kvt_last_error());
            continue;
        }
        printf("  created %s\n", rep.created);
        printf("  identity %s: model %s, tokenizer %s, config %.16s...\n", rep.identity_dir, rep.model_id,
               rep.tokenizer_hash, rep.config_fingerprint);
        printf("  shards %llu (%llu entries, %llu kv blocks), %llu bytes, longest entry %lld tokens%s\n",
               (unsigned long long)rep.shards, (unsigned long long)rep.entries, (unsigned long long)rep.blocks,
               (unsigned long long)rep.bytes, (long long)rep.tokens_max,
               verify ? ": every SHA-256 good" : "");
        if (lines)
            fputs(lines, stdout);
        free(lines);
        total_shards += rep.shards;
        total_bytes += rep.bytes;
    }
    if (current[0] && !current_seen) {
        kvt_publish_report rep;
        kvt_publish_validate(dir, NULL, NULL, &rep);
        printf("CURRENT REFUSED (%s): %s\n", kvt_publish_refusal_name(rep.refusal), rep.detail);
        bad++;
    }
    printf("total: %d generations, %llu shards, %llu bytes, %d refused\n", (int)n, (unsigned long long)total_shards,
           (unsigned long long)total_bytes, bad);
    kvt_publish_ids_free(ids, n);
    if (verify && n == 0) {
        fprintf(stderr, "kvtier cache verify: %s holds no generation\n", dir);
        return 1;
    }
    return verify && bad ? 1 : 0;
}

/* ---- publish -------------------------------------------------------------------------- */

typedef struct prompt {
    char *ns;
    int32_t *tok;
    int64_t n;
} prompt;

static void prompts_free(prompt *p, int32_t n)
{
    for (int32_t i = 0; p && i < n; i++) {
        free(p[i].ns);
        free(p[i].tok);
    }
    free(p);
}

/* One JSON line into *out; the message names the file and line. */
static int parse_prompt(const char *path, int64_t lineno, const char *line, const kvt_tokenizer *tok,
                        int32_t vocab, int64_t seq_len, prompt *out)
{
    memset(out, 0, sizeof *out);
    json_error_t err;
    json_t *o = json_loads(line, JSON_REJECT_DUPLICATES, &err);
    int rc = 0;
    if (!json_is_object(o)) {
        fprintf(stderr, "kvtier cache publish: %s:%lld: not a JSON object%s%s\n", path, (long long)lineno,
                o ? "" : ": ", o ? "" : err.text);
        json_decref(o);
        return 1;
    }
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) if (strcmp(key, "ns") && strcmp(key, "text") && strcmp(key, "tokens"))
    {
        fprintf(stderr, "kvtier cache publish: %s:%lld: unknown field \"%s\" (ns, text, tokens)\n", path,
                (long long)lineno, key);
        rc = 1;
        break;
    }
    json_t *ns = json_object_get(o, "ns"), *text = json_object_get(o, "text"), *toks = json_object_get(o, "tokens");
    if (!rc && ns && !json_is_string(ns)) {
        fprintf(stderr, "kvtier cache publish: %s:%lld: \"ns\" must be a string\n", path, (long long)lineno);
        rc = 1;
    }
    if (!rc && !!text == !!toks) {
        fprintf(stderr, "kvtier cache publish: %s:%lld: give exactly one of \"text\" and \"tokens\"\n", path,
                (long long)lineno);
        rc = 1;
    }
    if (!rc && text && !json_is_string(text)) {
        fprintf(stderr, "kvtier cache publish: %s:%lld: \"text\" must be a string\n", path, (long long)lineno);
        rc = 1;
    }
    if (!rc && toks && (!json_is_array(toks) || json_array_size(toks) == 0)) {
        fprintf(stderr, "kvtier cache publish: %s:%lld: \"tokens\" must be a non-empty array of ids\n", path,
                (long long)lineno);
        rc = 1;
    }
    if (!rc) {
        out->ns = strdup(ns ? json_string_value(ns) : "");
        size_t cap = text ? strlen(json_string_value(text)) + 3 : json_array_size(toks);
        out->tok = malloc(cap * sizeof *out->tok);
        if (!out->ns || !out->tok) {
            fprintf(stderr, "kvtier cache publish: out of memory\n");
            rc = 1;
        }
    }
    if (!rc && text) {
        int e = kvt_tokenizer_encode(tok, json_string_value(text), 1, 0, out->tok, (int64_t)(strlen(json_string_value(text)) + 3), &out->n);
        if (e) {
            fprintf(stderr, "kvtier cache publish: %s:%lld: cannot encode the text: %s\n", path, (long long)lineno,
                    kvt_last_error());
            rc = 1;
        }
    } else if (!rc) {
        for (size_t i = 0; !rc && i < json_array_size(toks); i++) {
            json_t *t = json_array_get(toks, i);
            if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= vocab) {
                fprintf(stderr, "kvtier cache publish: %s:%lld: tokens[%zu] is not a token id in [0, %d)\n", path,
                        (long long)lineno, i, (int)vocab);
                rc = 1;
            }
            out->tok[i] = (int32_t)json_integer_value(t);
        }
        out->n = (int64_t)json_array_size(toks);
    }
    if (!rc && (out->n < 1 || out->n >= seq_len)) {
        fprintf(stderr, "kvtier cache publish: %s:%lld: the prompt is %lld tokens; it needs 1 .. %lld (seq_len - 1)\n",
                path, (long long)lineno, (long long)out->n, (long long)seq_len - 1);
        rc = 1;
    }
    json_decref(o);
    if (rc) {
        free(out->ns);
        free(out->tok);
        memset(out, 0, sizeof *out);
    }
    return rc;
}

static int load_prompts(const char *path, const kvt_tokenizer *tok, int32_t vocab, int64_t seq_len, prompt **out,
                        int32_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvtier cache publish: %s: cannot open: %s\n", path, strerror(errno));
        return 1;
    }
    prompt *v = NULL;
    int32_t n = 0, cap = 0;
    char *line = NULL;
    size_t line_cap = 0, len = 0, total = 0;
    int status = 0;
    for (int64_t lineno = 1;; lineno++) {
        int r = kvt_chat_script_read_line(f, path, lineno, &line, &line_cap, &len);
        if (r == 0)
            break;
        if (r < 0) {
            fprintf(stderr, "kvtier cache publish: %s\n", kvt_last_error());
            status = 1;
            break;
        }
        total += len;
        if (total > KVT_CHAT_MAX_FILE) {
            fprintf(stderr, "kvtier cache publish: %s: over %zu bytes\n", path, KVT_CHAT_MAX_FILE);
            status = 1;
            break;
        }
        if (!line[0])
            continue;
        if (n == cap) {
            int32_t nc = cap ? cap * 2 : 16;
            prompt *nv = realloc(v, (size_t)nc * sizeof *nv);
            if (!nv) {
                status = 1;
                break;
            }
            v = nv;
            cap = nc;
        }
        if ((status = parse_prompt(path, lineno, line, tok, vocab, seq_len, &v[n])))
            break;
        n++;
    }
    free(line);
    fclose(f);
    if (!status && n == 0) {
        fprintf(stderr, "kvtier cache publish: %s holds no prompt\n", path);
        status = 1;
    }
    if (status) {
        prompts_free(v, n);
        return status;
    }
    *out = v;
    *n_out = n;
    return 0;
}

/* The store identity chat and serve use for this model: model and tokenizer
 * hashes, and the config fingerprint of the model's fresh caches. */
static int model_identity(const kvt_model *m, const kvt_chat_identity *ci, char fp[KVT_STORE_FINGERPRINT_LEN],
                          kvt_store_identity *id)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    kvt_cache *caches[KVT_MODEL_MAX_LAYERS] = {0};
    int rc = kvt_model_new_caches(m, 256, caches);
    if (rc)
        return rc;
    rc = kvt_store_config_fingerprint(caches, c->n_layers, fp);
    kvt_caches_destroy(caches, c->n_layers);
    *id = (kvt_store_identity){.model_id = ci->model_id, .config_fingerprint = fp, .tokenizer_hash = ci->tokenizer_hash};
    return rc;
}

static int cmd_publish(int argc, char **argv)
{
    const char *model_path = NULL, *tok_path = NULL, *prompts_path = NULL, *out_dir = NULL;
    long long keep = 2, block = 256, threads = 0;
    kvt_kv_scheme kv_scheme = KVT_KV_F16;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc)
            return usage_error("missing value for", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model"))
            model_path = v;
        else if (!strcmp(a, "--tokenizer"))
            tok_path = v;
        else if (!strcmp(a, "--prompts"))
            prompts_path = v;
        else if (!strcmp(a, "--out"))
            out_dir = v;
        else if (!strcmp(a, "--keep")) {
            if (kvt_cli_int(v, 1, 1000000, &keep))
                return usage_error("--keep needs a count of at least 1", v);
        } else if (!strcmp(a, "--block")) {
            if (kvt_cli_int(v, 1, 1 << 20, &block))
                return usage_error("--block needs a token count of at least 1", v);
        } else if (!strcmp(a, "--threads")) {
            if (kvt_cli_int(v, 1, 1024, &threads))
                return usage_error("--threads needs a count of at least 1", v);
        } else if (!strcmp(a, "--kv-dtype")) {
            if (kvt_cli_kv_scheme(v, &kv_scheme))
                return usage_error("--kv-dtype wants f32, f16, bf16 or q8, got", v);
        } else
            return usage_error("unknown option", a);
    }
    if (!prompts_path || !out_dir)
        return usage_error("publish needs --prompts FILE and --out DIR", NULL);
    if (!model_path != !tok_path)
        return usage_error("give --model and --tokenizer together (or neither, for the default model)", NULL);
    kvt_model *m = NULL;
    kvt_tokenizer *tok = NULL;
    kvt_service *svc = NULL;
    kvt_sampler *smp = NULL;
    kvt_publisher *pub = NULL;
    prompt *ps = NULL;
    int32_t n_ps = 0;
    int status = 1, rc;
    static char used_model[4096], used_tok[4096];
    if ((rc = kvt_chat_load_paths(model_path, tok_path, &m, &tok, used_model, used_tok, sizeof used_model))) {
        status = fail("cannot load the model", rc);
        goto done;
    }
    if (threads && (rc = kvt_model_set_threads(m, (int)threads))) {
        status = fail("cannot start the engine threads", rc);
        goto done;
    }
    if ((rc = kvt_model_set_kv_scheme(m, kv_scheme))) { /* before the identity: it names the scheme */
        status = fail("cannot set the KV storage scheme", rc);
        goto done;
    }
    const kvt_model_config *mc = kvt_model_get_config(m);
    if ((status = load_prompts(prompts_path, tok, mc->vocab_size, mc->seq_len, &ps, &n_ps)))
        goto done;
    status = 1;
    kvt_chat_identity ci;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    if ((rc = kvt_chat_identity_compute(m, used_tok, &ci)) || (rc = model_identity(m, &ci, fp, &id))) {
        status = fail("cannot hash the model", rc);
        goto done;
    }
    if ((rc = kvt_publish_begin(out_dir, &id, NULL, &pub))) {
        status = fail("cannot start the publication", rc);
        goto done;
    }
    kvt_cold_tier cold;
    kvt_publish_cold_tier(pub, &cold);
    kvt_chat_service_opts so = {.prompt_cache_bytes = (uint64_t)1 << 40, .block_tokens = (int32_t)block, .cold = &cold};
    if ((rc = kvt_chat_service_create(m, &so, &svc)) || (rc = kvt_sampler_create(mc->vocab_size, 0.0f, 0.9f, 42, &smp))) {
        status = fail("cannot create the cache service", rc);
        goto done;
    }
    for (int32_t i = 0; i < n_ps; i++) {
        kvt_gen_opts go = {.max_tokens = 1, .ns = ps[i].ns, .admit_timeout_ms = -1};
        kvt_seq *s = NULL;
        int done_prefill = 0;
        kvt_turn_stats st;
        if ((rc = kvt_seq_begin(m, svc, smp, ps[i].tok, ps[i].n, &go, &s)) ||
            (rc = kvt_seq_prefill(s, INT64_MAX, &done_prefill))) {
            kvt_seq_finish(s, 0, NULL);
            status = fail("cannot prefill a prompt", rc);
            goto done;
        }
        kvt_seq_finish(s, 0, &st);
        fprintf(stderr, "kvtier cache publish: prompt %d (ns \"%s\"): %lld tokens, %lld prefilled, %lld reused, %.1f ms\n",
                (int)i + 1, ps[i].ns, (long long)st.prompt_tokens, (long long)st.prefilled_tokens,
                (long long)st.reused_tokens, st.prefill_ms);
    }
    if ((rc = kvt_service_flush(svc))) {
        status = fail("cannot write the caches", rc);
        goto done;
    }
    kvt_service_destroy(svc);
    svc = NULL;
    kvt_publish_result res;
    rc = kvt_publish_commit(pub, (int32_t)keep, &res);
    pub = NULL;
    if (rc) {
        status = fail("cannot publish", rc);
        goto done;
    }
    printf("published generation %s in %s: %d prompts, %llu entries, %llu shards, %llu bytes\n", res.generation,
           out_dir, (int)n_ps, (unsigned long long)res.entries, (unsigned long long)res.shards,
           (unsigned long long)res.bytes);
    if (res.removed || res.kept_busy)
        printf("old generations: %llu removed, %llu kept (a reader holds them; removed by a later publication)\n",
               (unsigned long long)res.removed, (unsigned long long)res.kept_busy);
    status = 0;
done:
    kvt_service_destroy(svc);
    kvt_publish_abort(pub);
    kvt_sampler_free(smp);
    prompts_free(ps, n_ps);
    kvt_tokenizer_free(tok);
    kvt_model_free(m);
    return status;
}

int kvt_cmd_cache(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        }
    if (argc < 2)
        return usage_error("which: publish, inspect or verify?", NULL);
    if (!strcmp(argv[1], "publish"))
        return cmd_publish(argc, argv);
    if (!strcmp(argv[1], "inspect") || !strcmp(argv[1], "verify")) {
        if (argc != 3)
            return usage_error("give one directory", NULL);
        return cmd_look(argv[2], !strcmp(argv[1], "verify"));
    }
    return usage_error("unknown subcommand", argv[1]);
}
