/*
 * gen_corpus.c: writes the seed corpus of every fuzz target with the
 * project's own writers, so the fuzzers start from valid inputs: real store
 * directories (kvt_store_put of entries of every cache kind, with shared
 * blocks and an attachment), their shards one by one, encoded cache states
 * (kvt_cache_encode), synthetic checkpoints of every layer kind
 * (kvt_model_synth), the default tokenizer (kvt_tokenizer_write_default),
 * published generations (kvt_publish_*), remote records (the remote tier
 * storing into a real redis-server),
 * trace lines, transcripts and chat scripts.
 *   fuzz_gen_corpus fuzz/corpus        (then commit what changed)
 * Output is deterministic (but for the manifests' created time); each file is
 * a few KB at most.
 */
#include "fuzz_util.h"

#include "chat.h"
#include "model.h"
#include "redis_util.h"
#include "store_util.h"
#include "tokenizer.h"

#include "kvtier/publish.h"
#include "kvtier/remote.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *g_out;

static void save(const char *target, const char *name, const void *data, size_t n)
{
    char dir[1024], path[1200];
    snprintf(dir, sizeof dir, "%s/%s", g_out, target);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/seed-%s", dir, name);
    if (fz_write_file(path, data, n)) {
        fprintf(stderr, "gen_corpus: cannot write %s\n", path);
        exit(1);
    }
}

static void save_str(const char *target, const char *name, const char *s) { save(target, name, s, strlen(s)); }

static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    uint8_t *b = NULL;
    *n = 0;
    uint8_t chunk[65536];
    size_t got;
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0)
        if (fz_append(&b, n, chunk, got))
            exit(1);
    fclose(f);
    return b;
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "gen_corpus: %s: %s (%s)\n", what, kvt_strerror(rc), kvt_last_error());
    exit(1);
}

/* ---- store directories and shards ----------------------------------------------- */

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Packs the shards of dir as fz records (plus a temporary and a stray file)
 * and saves each shard alone as a shard-header seed. */
static void pack_dir(const char *dir, const char *name, int extras)
{
    DIR *d = opendir(dir);
    if (!d)
        exit(1);
    char *names[256];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 256)
        if (strstr(de->d_name, ".safetensors"))
            names[n++] = strdup(de->d_name);
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, by_name);
    uint8_t *buf = NULL;
    size_t len = 0;
    uint8_t verify = 1;
    fz_append(&buf, &len, &verify, 1);
    for (int i = 0; i < n; i++) {
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        size_t fn = 0;
        uint8_t *f = slurp(path, &fn);
        fz_record_write(&buf, &len, FZ_NAME_OWN, f, (uint32_t)fn);
        char sname[128];
        snprintf(sname, sizeof sname, "%s-%c%d", name, names[i][0], i);
        if (fn <= 8192)
            save("fuzz_shard_header", sname, f, fn);
        free(f);
        free(names[i]);
    }
    if (extras) {
        fz_record_write(&buf, &len, FZ_NAME_TEMP, "partial", 7);
        fz_record_write(&buf, &len, FZ_NAME_OTHER, "not a shard", 11);
    }
    save("fuzz_store_scan", name, buf, len);
    free(buf);
}

static kvt_cache *filled(kvt_cache *c, int64_t n, int d);

/* Entry e of the corpus's entries of cfg: 6 + 3e tokens, later entries
 * extending the first (shared blocks), entry 2 in another ns. cfg NULL: one
 * qkvc layer (kv_dim 4, blocks of 4 tokens: sealed blocks and an open one). */
static void corpus_entry(const store_cfg *cfg, int e, kvt_entry *en)
{
    int32_t tokens[12];
    int64_t n = 6 + 3 * e;
    for (int64_t i = 0; i < n; i++)
        tokens[i] = (int32_t)(i < 6 ? 10 + i : 40 + e * 7 + i);
    int rc;
    if (cfg) {
        rc = store_make_entry(cfg, e == 2 ? "lora:a" : "", tokens, n, en);
    } else if (!(rc = kvt_entry_init(en, e == 2 ? "lora:a" : "", tokens, n, 1, 0))) {
        if (!(rc = kvt_qkvc_create(4, 4, &en->caches[0])))
            filled(en->caches[0], n, 4);
    }
    if (rc)
        die("make entry", rc);
}

static void gen_store(const char *name, const store_cfg *cfg, int n_entries, int extras)
{
    char root[512];
    if (fz_mkdtemp(root, sizeof root, "gen"))
        exit(1);
    kvt_store_identity id = {FZ_STORE_MODEL, FZ_STORE_CONFIG, FZ_STORE_TOKENIZER};
    kvt_store *s = NULL;
    int rc = kvt_store_open(root, &id, NULL, &s);
    if (rc)
        die("store open", rc);
    for (int e = 0; e < n_entries; e++) {
        kvt_entry en;
        corpus_entry(cfg, e, &en);
        if ((rc = kvt_store_put(s, &en)))
            die("store put", rc);
        kvt_entry_clear(&en);
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    kvt_store_close(s);
    pack_dir(dir, name, extras);
    fz_rmtree(root);
}

/* ---- published generations --------------------------------------------------------- */

/* Packs the tree under dir (paths relative to top) as fz_tree nodes,
 * directories before what they hold, names sorted. */
static void pack_tree(const char *top, const char *rel, uint8_t **buf, size_t *len)
{
    char dir[2048];
    snprintf(dir, sizeof dir, "%s%s%s", top, rel[0] ? "/" : "", rel);
    DIR *d = opendir(dir);
    if (!d)
        exit(1);
    char *names[256];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 256)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            names[n++] = strdup(de->d_name);
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, by_name);
    for (int i = 0; i < n; i++) {
        char r[1024], path[3200];
        snprintf(r, sizeof r, "%s%s%s", rel, rel[0] ? "/" : "", names[i]);
        snprintf(path, sizeof path, "%s/%s", top, r);
        struct stat st;
        if (lstat(path, &st))
            exit(1);
        if (S_ISDIR(st.st_mode)) {
            fz_tree_write(buf, len, FZ_TREE_DIR, r, NULL, 0);
            pack_tree(top, r, buf, len);
        } else {
            size_t fn = 0;
            uint8_t *f = slurp(path, &fn);
            fz_tree_write(buf, len, FZ_TREE_FILE, r, f, (uint32_t)fn);
            free(f);
        }
        free(names[i]);
    }
}

/* Publishes n_entries entries of cfg as the first generation of a fresh
 * directory (kvt_publish_*) and saves it as fuzz_manifest seeds: as
 * published (mode byte `mode`), and with a shard replaced by a symbolic link
 * leading out of the generation. */
static void gen_published(const char *name, const store_cfg *cfg, int n_entries, uint8_t mode)
{
    char root[512];
    if (fz_mkdtemp(root, sizeof root, "gen-pub"))
        exit(1);
    kvt_store_identity id = {FZ_STORE_MODEL, FZ_STORE_CONFIG, FZ_STORE_TOKENIZER};
    kvt_publisher *p = NULL;
    int rc = kvt_publish_begin(root, &id, NULL, &p);
    if (rc)
        die("publish begin", rc);
    for (int e = 0; e < n_entries; e++) {
        kvt_entry en;
        corpus_entry(cfg, e, &en);
        if ((rc = kvt_publish_put(p, &en)))
            die("publish put", rc);
        kvt_entry_clear(&en);
    }
    kvt_publish_result res;
    if ((rc = kvt_publish_commit(p, 1, &res)))
        die("publish commit", rc);
    if (strcmp(res.generation, FZ_PUB_GENERATION)) {
        fprintf(stderr, "gen_corpus: the first generation is %s, fuzz_manifest expects %s\n", res.generation,
                FZ_PUB_GENERATION);
        exit(1);
    }
    char gdir[700];
    snprintf(gdir, sizeof gdir, "%s/generations/%s", root, FZ_PUB_GENERATION);
    uint8_t *buf = NULL;
    size_t len = 0;
    fz_append(&buf, &len, &mode, 1);
    pack_tree(gdir, "", &buf, &len);
    save("fuzz_manifest", name, buf, len);
    free(buf);
    /* the same with its first entry shard a link to a file outside */
    buf = NULL;
    len = 0;
    fz_append(&buf, &len, &mode, 1);
    kvt_publish_report rep;
    if (kvt_publish_validate(root, FZ_PUB_GENERATION, NULL, &rep))
        die("validate", KVT_EFORMAT);
    char shard[1024] = "";
    DIR *d;
    char idir[800];
    snprintf(idir, sizeof idir, "%s/%s", gdir, rep.identity_dir);
    if ((d = opendir(idir))) {
        struct dirent *de;
        while ((de = readdir(d)))
            if (de->d_name[0] == 'e' && (!shard[0] || strcmp(de->d_name, shard + 33) < 0))
                snprintf(shard, sizeof shard, "%s/%s", rep.identity_dir, de->d_name);
        closedir(d);
    }
    if (shard[0]) {
        fz_tree_write(&buf, &len, FZ_TREE_LINK, shard, "../../../../../../etc/hostname", 30);
        pack_tree(gdir, "", &buf, &len);
        char lname[128];
        snprintf(lname, sizeof lname, "%s-link-out", name);
        save("fuzz_manifest", lname, buf, len);
    }
    free(buf);
    fz_rmtree(root);
}

/* ---- remote records ---------------------------------------------------------------- */

static int by_str(const void *a, const void *b) { return strcmp((const char *)a, (const char *)b); }

/* Writes entries of cfg into a real redis-server through the remote tier
 * (kvt_remote_open, its table's store) and saves every record it SET (the
 * block and entry keys: GET of each) as a fuzz_remote_record seed, mode byte
 * 3 (checksum rewritten, layers rebuilt). Skipped, saying so, without
 * redis-server. */
static void gen_records(const char *name, const store_cfg *cfg, int n_entries)
{
    if (!redis_available("gen_corpus"))
        return;
    redis_srv srv;
    if (redis_start(&srv, 64, NULL))
        exit(1);
    kvt_store_identity id = {FZ_STORE_MODEL, FZ_STORE_CONFIG, FZ_STORE_TOKENIZER};
    kvt_remote *r = NULL;
    int rc = kvt_remote_open(srv.url, &id, NULL, &r);
    if (rc)
        die("remote open", rc);
    kvt_cold_tier t;
    kvt_remote_cold_tier(r, &t);
    for (int e = 0; e < n_entries; e++) {
        kvt_entry en;
        corpus_entry(cfg, e, &en);
        if ((rc = t.store(t.self, &en)))
            die("remote store", rc);
        kvt_entry_clear(&en);
    }
    kvt_remote_close(r);
    char prefix[128];
    kvt_remote_key_prefix(&id, prefix, sizeof prefix);
    static char keys[64][160];
    int nk = 0;
    for (const char *ty = "be"; *ty; ty++) {
        char pat[200];
        snprintf(pat, sizeof pat, "%s%c*", prefix, *ty);
        char cur[160];
        /* one key at a time: SCAN's order is Redis's; sorted below */
        while (nk < 64 && redis_first_key(srv.port, pat, cur, sizeof cur) == 0) {
            snprintf(keys[nk++], sizeof keys[0], "%s", cur);
            redis_cmd(srv.port, NULL, 0, NULL, "RENAME %s seen:%s", cur, cur);
        }
    }
    qsort(keys, (size_t)nk, sizeof keys[0], by_str);
    static uint8_t val[1 << 20];
    int nb = 0, ne = 0;
    for (int i = 0; i < nk; i++) {
        size_t vn = 0;
        val[0] = 3;
        if (redis_cmd(srv.port, (char *)val + 1, sizeof val - 1, &vn, "GET seen:%s", keys[i]) < 0)
            exit(1);
        char type = keys[i][strlen(prefix)];
        char sname[128];
        snprintf(sname, sizeof sname, "%s-%c%d", name, type, type == 'b' ? nb++ : ne++);
        if (vn + 1 <= 16384)
            save("fuzz_remote_record", sname, val, vn + 1);
    }
    redis_stop(&srv);
}

/* ---- cache states ------------------------------------------------------------------ */

static void gen_state(const char *name, kvt_cache *c, int sel)
{
    kvt_cache_state st;
    int rc = kvt_cache_encode(c, &st);
    if (rc)
        die("encode", rc);
    uint8_t *buf = NULL;
    size_t len = 0;
    if (fz_state_write(&st, sel, &buf, &len))
        exit(1);
    save("fuzz_tensor_decode", name, buf, len);
    free(buf);
    kvt_cache_state_clear(&st);
    kvt_cache_destroy(c);
}

static kvt_cache *filled(kvt_cache *c, int64_t n, int d)
{
    float k[64], v[64];
    for (int64_t t = 0; t < n; t++) {
        for (int j = 0; j < d; j++) {
            k[j] = (float)(t * d + j) / 8.0f;
            v[j] = -(float)(t * d + j) / 16.0f;
        }
        const void *in[2] = {k, v};
        if (kvt_cache_append(c, 1, in))
            exit(1);
    }
    return c;
}

static void gen_states(void)
{
    kvt_cache *c;
    kvt_kv_create(4, 3, &c);
    gen_state("kv", filled(c, 7, 4), FZ_KIND_KV);
    kvt_rotating_create(4, 4, 1, &c);
    gen_state("rotating", filled(c, 3, 4), FZ_KIND_ROTATING);
    kvt_rotating_create(2, 4, 1, &c);
    gen_state("rotating-wrapped", filled(c, 9, 2), FZ_KIND_ROTATING);
    kvt_recurrent_create(16, &c);
    uint8_t stt[16];
    for (int i = 0; i < 16; i++)
        stt[i] = (uint8_t)(i * 17);
    const void *in[1] = {stt};
    kvt_cache_append(c, 5, in);
    gen_state("recurrent", c, FZ_KIND_RECURRENT);
    kvt_qkv_create(8, 4, 2, &c);
    gen_state("qkv", filled(c, 5, 8), FZ_KIND_QKV);
    /* qkvc: two sealed blocks and an open one of 1 row; a full open block
     * (decoded without a copy); no open block (trimmed to the sealed tokens) */
    kvt_qkvc_create(4, 3, &c);
    gen_state("qkvc", filled(c, 7, 4), FZ_KIND_QKVC);
    kvt_qkvc_create(4, 3, &c);
    gen_state("qkvc-full-open-block", filled(c, 6, 4), FZ_KIND_QKVC);
    kvt_qkvc_create(2, 2, &c);
    filled(c, 5, 2);
    if (kvt_cache_trim(c, 4))
        exit(1);
    gen_state("qkvc-sealed-only", c, FZ_KIND_QKVC);
    /* an attachment blob: one U8 tensor named as the store names them */
    kvt_cache_state st;
    memset(&st, 0, sizeof st);
    kvt_tensor t;
    memset(&t, 0, sizeof t);
    snprintf(t.name, sizeof t.name, "draft.hidden");
    t.dtype = KVT_DTYPE_U8;
    t.ndim = 1;
    t.shape[0] = 16;
    t.data = stt;
    t.bytes = 16;
    t.tok_begin = t.tok_end = -1;
    st.n_tensors = 1;
    st.tensors = &t;
    uint8_t *buf = NULL;
    size_t len = 0;
    fz_state_write(&st, FZ_KIND_ATTACHMENT, &buf, &len);
    save("fuzz_tensor_decode", "attachment", buf, len);
    free(buf);
}

/* ---- byte programs of the differential targets ---------------------------------------- */

static void gen_programs(void)
{
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int sel = 0; sel < FZ_KIND_COUNT; sel++) {
        uint8_t b[600];
        b[0] = (uint8_t)sel;
        for (size_t i = 1; i < sizeof b; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            b[i] = (uint8_t)x;
        }
        /* mostly appends (op 0 = byte % 4 == 0) so the caches hold blocks */
        for (size_t i = 4; i < sizeof b; i += 23)
            b[i] = 0;
        char name[32];
        snprintf(name, sizeof name, "%s", fz_kind_names[sel]);
        save("fuzz_codec_roundtrip", name, b, sizeof b);
    }
    for (int k = 0; k < 3; k++) {
        uint8_t b[1024];
        for (size_t i = 0; i < sizeof b; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            b[i] = (uint8_t)x;
        }
        for (size_t i = 0; i < sizeof b; i += 40)
            b[i] = (uint8_t)(k == 0 ? 0 : i % 5); /* k 0: inserts first */
        char name[32];
        snprintf(name, sizeof name, "program-%d", k);
        save("fuzz_radix_index", name, b, sizeof b);
    }
    /* tokenizer_encode: flags, extra pieces (len, score, bytes), then text */
    static const char *const pieces[] = {"Th", "he", "e ", "the", " the", "at", "cat", "\xC3\xA9", "in", "ing"};
    uint8_t *buf = NULL;
    size_t len = 0;
    uint8_t hdr[3] = {3, (uint8_t)(sizeof pieces / sizeof *pieces), 8};
    fz_append(&buf, &len, hdr, 3);
    for (size_t i = 0; i < sizeof pieces / sizeof *pieces; i++) {
        uint8_t pl = (uint8_t)strlen(pieces[i]), sc = (uint8_t)(i * 3);
        fz_append(&buf, &len, &pl, 1);
        fz_append(&buf, &len, &sc, 1);
        fz_append(&buf, &len, pieces[i], pl);
    }
    const char *text = "The cat sat in the hat, the end. Caf\xC3\xA9 \xF0\x9F\x98\x80 thing";
    fz_append(&buf, &len, text, strlen(text));
    save("fuzz_tokenizer_encode", "words", buf, len);
    free(buf);
}

/* ---- checkpoints and tokenizers ------------------------------------------------------ */

static void gen_model(const char *name, int n_layers, const kvt_layer_kind *kinds, int32_t window, int separate)
{
    char root[512], path[600];
    if (fz_mkdtemp(root, sizeof root, "gen"))
        exit(1);
    snprintf(path, sizeof path, "%s/m.bin", root);
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 8;
    p.hidden_dim = 8;
    p.n_layers = n_layers;
    p.n_heads = 2;
    p.n_kv_heads = 1;
    p.vocab_size = 8;
    p.seq_len = 8;
    p.seed = 1;
    p.separate_classifier = separate;
    p.sliding_window = window;
    for (int l = 0; l < n_layers; l++)
        p.layer_kind[l] = kinds[l];
    int rc = kvt_model_synth(&p, path);
    if (rc)
        die("synth", rc);
    size_t n = 0;
    uint8_t *b = slurp(path, &n);
    save("fuzz_model_header", name, b, n);
    free(b);
    fz_rmtree(root);
}

static void gen_tokenizers(void)
{
    char root[512], path[600];
    if (fz_mkdtemp(root, sizeof root, "gen"))
        exit(1);
    snprintf(path, sizeof path, "%s/t.bin", root);
    int rc = kvt_tokenizer_write_default(path, KVT_DEFAULT_VOCAB);
    if (rc)
        die("tokenizer", rc);
    size_t n = 0;
    uint8_t *b = slurp(path, &n);
    save("fuzz_tokenizer_file", "default", b, n);
    free(b);
    fz_rmtree(root);
    /* a small vocabulary with merges (the layout tokenizer.h documents) */
    static const char *const pieces[] = {"<unk>", "\n<s>\n", "\n</s>\n", " ", "a", "b", "ab", " ab", "\xC3\xA9"};
    uint8_t *buf = NULL;
    size_t len = 0;
    int32_t maxlen = 6;
    fz_append(&buf, &len, &maxlen, 4);
    for (size_t i = 0; i < sizeof pieces / sizeof *pieces; i++) {
        float sc = (float)i;
        int32_t pl = (int32_t)strlen(pieces[i]);
        fz_append(&buf, &len, &sc, 4);
        fz_append(&buf, &len, &pl, 4);
        fz_append(&buf, &len, pieces[i], (size_t)pl);
    }
    save("fuzz_tokenizer_file", "small", buf, len);
    free(buf);
}

/* ---- text inputs ------------------------------------------------------------------------ */

static void gen_text(void)
{
    save_str("fuzz_trace_line", "lines",
         "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 12, \"hash_ids\": [1, 2]}\n"
         "{\"timestamp\": 25, \"input_length\": 1100, \"output_length\": 3, \"hash_ids\": [1, 2, 3]}\n"
         "\n"
         "{\"timestamp\": 30, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [1]}\n");
    save_str("fuzz_trace_line", "one", "{\"timestamp\": 7, \"input_length\": 1, \"hash_ids\": [42]}");
    json_t *doc = json_pack("[{s:s, s:s}, {s:s, s:s}]", "user", "Hello there", "assistant", " Hi! How are you?",
                            "user", "Caf\xC3\xA9 \xE2\x82\xAC?", "assistant", " \xF0\x9F\x98\x80 fine\n");
    char *s = json_dumps(doc, JSON_INDENT(1));
    char padded[512];
    size_t n = (size_t)snprintf(padded, sizeof padded, "%s\n", s);
    while (n % 8) /* fuzz_transcript runs a turn for inputs of 8k bytes */
        padded[n++] = ' ';
    save("fuzz_transcript", "two-turns", padded, n);
    free(s);
    json_decref(doc);
    save_str("fuzz_transcript", "empty", "[]");
    const char *script = "# a chat script\nHello there\n\n  indented line  \r\nCaf\xC3\xA9 \xE2\x82\xAC\n#skip\nlast";
    save("fuzz_script", "script", script, strlen(script));
    save_str("fuzz_script", "crlf", "one\r\ntwo\r\n\r\n");
}

/* One OpenAI request body for fuzz_openai_request: the endpoint byte
 * (0 chat, 1 completion), then the body as jansson writes it. */
static void save_request(const char *name, int completion, json_t *doc)
{
    char *s = json_dumps(doc, JSON_COMPACT);
    if (!s)
        die("json_dumps", KVT_ENOMEM);
    size_t n = strlen(s);
    uint8_t *b = malloc(n + 1);
    if (!b)
        die("malloc", KVT_ENOMEM);
    b[0] = (uint8_t)completion;
    memcpy(b + 1, s, n);
    save("fuzz_openai_request", name, b, n + 1);
    free(b);
    free(s);
    json_decref(doc);
}

/* Request bodies of the shapes OpenAI clients send (the openai npm package
 * of tests/e2e sends these fields): chats with system text, several turns,
 * text parts, streaming with usage; completions as text, one-string batch,
 * token ids and a one-array batch; every sampling field. */
static void gen_requests(void)
{
    save_request("chat-one", 0,
                 json_pack("{s:s, s:[{s:s, s:s}]}", "model", "stories260K", "messages", "role", "user", "content",
                           "Once upon a time"));
    save_request("chat-turns", 0,
                 json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:s}, {s:s, s:s}, {s:s, s:s}], s:i, s:f, s:f, s:I, s:s}",
                           "model", "m", "messages", "role", "system", "content", "You are terse.", "role", "user",
                           "content", "Hello", "role", "assistant", "content", " Hi!", "role", "user", "content",
                           "Caf\xC3\xA9 \xE2\x82\xAC?", "max_tokens", 16, "temperature", 0.7, "top_p", 0.9, "seed",
                           (json_int_t)42, "prompt_cache_key", "session-1"));
    save_request("chat-stream-parts", 0,
                 json_pack("{s:[{s:s, s:s}, {s:s, s:[{s:s, s:s}, {s:s, s:s}]}], s:b, s:{s:b}, s:[s, s], s:i, s:i, "
                           "s:s, s:n}",
                           "messages", "role", "developer", "content", "rules", "role", "user", "content", "type",
                           "text", "text", "part one ", "type", "text", "text", "part two", "stream", 1,
                           "stream_options", "include_usage", 1, "stop", "\n\n", "END", "max_completion_tokens", 8,
                           "n", 1, "user", "u-7", "temperature"));
    save_request("completion-text", 1,
                 json_pack("{s:s, s:s, s:i, s:f, s:s}", "model", "m", "prompt", "The cat", "max_tokens", 4,
                           "temperature", 0.0, "stop", "."));
    save_request("completion-batch-text", 1, json_pack("{s:[s], s:b}", "prompt", "one", "stream", 1));
    save_request("completion-ids", 1, json_pack("{s:[i, i, i, i], s:I}", "prompt", 1, 403, 9, 0, "seed",
                                                (json_int_t)-3));
    save_request("completion-batch-ids", 1, json_pack("{s:[[i, i]], s:i}", "prompt", 1, 2, "max_tokens", 1));
    save_str("fuzz_openai_request", "not-json", "\001{\"prompt\": \"x\",");
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_gen_corpus OUTDIR   (e.g. fuzz/corpus)\n");
        return 2;
    }
    g_out = argv[1];
    mkdir(g_out, 0755);
    store_cfg kv = {.n_kv = 2, .kv_dim = 2, .block = 4};
    gen_store("kv", &kv, 3, 1);
    store_cfg hybrid = {.n_kv = 1, .kv_dim = 2, .block = 4, .window = 3, .recurrent = 8};
    gen_store("hybrid", &hybrid, 2, 0);
    store_cfg q = {.n_kv = 0, .kv_dim = 4, .block = 4, .qkv = 1};
    gen_store("qkv", &q, 2, 0);
    store_cfg att = {.n_kv = 1, .kv_dim = 2, .block = 4, .attach = 12};
    gen_store("attachment", &att, 1, 0);
    gen_store("qkvc", NULL, 2, 0);
    gen_published("kv", &kv, 3, 3);
    gen_published("hybrid", &hybrid, 2, 0xf);
    gen_published("attachment", &att, 1, 0xb);
    gen_records("kv", &kv, 3);
    gen_records("hybrid", &hybrid, 2);
    gen_records("qkv", &q, 2);
    gen_records("attachment", &att, 1);
    gen_records("qkvc", NULL, 2);
    gen_states();
    gen_programs();
    kvt_layer_kind plain[2] = {KVT_LAYER_ATTN, KVT_LAYER_ATTN};
    gen_model("plain", 2, plain, 0, 0);
    gen_model("separate-classifier", 1, plain, 0, 1);
    kvt_layer_kind hyb[3] = {KVT_LAYER_ATTN, KVT_LAYER_WINDOW, KVT_LAYER_RECURRENT};
    gen_model("hybrid", 3, hyb, 4, 0);
    gen_tokenizers();
    gen_text();
    gen_requests();
    printf("corpus written under %s\n", g_out);
    return 0;
}
