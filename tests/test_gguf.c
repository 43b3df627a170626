/*
 * test_gguf.c: the GGUF export (engine/gguf.c), read back by a GGUF v3
 * parser written here from the format's specification (not from gguf.c):
 * every llama.cpp metadata key with the model's values, the tokenizer
 * section, each tensor's name, shape, type and 32-byte aligned offset, and
 * tensor bytes equal to the llama2.c checkpoint's (read independently from
 * its file), in f32 and f16; a shared classifier writes no output.weight;
 * hybrid models, mismatched tokenizers and bad paths are refused, leaving no
 * file behind. That llama.cpp computes the engine's logits from the export is
 * tests/test_long_gguf_llamacpp.c.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gguf.h"
#include "model.h"
#include "synth_util.h"
#include "tokenizer.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- a small GGUF v3 reader ------------------------------------------- */

typedef struct {
    char name[64];
    uint32_t n_dims, type;
    uint64_t ne[4], offset;
} rd_tensor;

typedef struct {
    unsigned char *buf;
    size_t len, pos;
    uint64_t n_tensors, n_kv;
    rd_tensor t[64];
    size_t data0; /* start of the data section */
} rd_file;

static unsigned char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static uint64_t rd_u(rd_file *r, int bytes)
{
    assert_true(r->pos + (size_t)bytes <= r->len);
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)r->buf[r->pos + (size_t)i] << (8 * i);
    r->pos += (size_t)bytes;
    return v;
}

/* A string: returns a pointer into the buffer and its length. */
static const char *rd_str(rd_file *r, uint64_t *n)
{
    *n = rd_u(r, 8);
    assert_true(r->pos + *n <= r->len);
    const char *s = (const char *)r->buf + r->pos;
    r->pos += *n;
    return s;
}

static int str_is(const char *s, uint64_t n, const char *want) { return n == strlen(want) && !memcmp(s, want, n); }

/* Skips one value of type ty (sizes from the GGUF specification). */
static void rd_skip(rd_file *r, uint32_t ty)
{
    static const int size[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    assert_true(ty <= 12);
    if (ty == 8) {
        uint64_t n;
        rd_str(r, &n);
    } else if (ty == 9) {
        uint32_t et = (uint32_t)rd_u(r, 4);
        uint64_t n = rd_u(r, 8);
        for (uint64_t i = 0; i < n; i++)
            rd_skip(r, et);
    } else {
        r->pos += (size_t)size[ty];
    }
}

static void rd_open(rd_file *r, const char *path)
{
    memset(r, 0, sizeof *r);
    r->buf = read_all(path, &r->len);
    assert_memory_equal(r->buf, "GGUF", 4);
    r->pos = 4;
    assert_int_equal(rd_u(r, 4), 3);
    r->n_tensors = rd_u(r, 8);
    r->n_kv = rd_u(r, 8);
    assert_true(r->n_tensors <= 64);
    for (uint64_t i = 0; i < r->n_kv; i++) {
        uint64_t n;
        rd_str(r, &n);
        rd_skip(r, (uint32_t)rd_u(r, 4));
    }
    for (uint64_t i = 0; i < r->n_tensors; i++) {
        uint64_t n;
        const char *s = rd_str(r, &n);
        assert_true(n < sizeof r->t[i].name);
        memcpy(r->t[i].name, s, n);
        r->t[i].n_dims = (uint32_t)rd_u(r, 4);
        assert_true(r->t[i].n_dims >= 1 && r->t[i].n_dims <= 4);
        for (uint32_t k = 0; k < r->t[i].n_dims; k++)
            r->t[i].ne[k] = rd_u(r, 8);
        r->t[i].type = (uint32_t)rd_u(r, 4);
        r->t[i].offset = rd_u(r, 8);
        assert_int_equal(r->t[i].offset % 32, 0);
    }
    r->data0 = (r->pos + 31) / 32 * 32;
}

/* Positions r->pos at the value of metadata key `key` and returns its type;
 * fails the test when the key is absent. */
static uint32_t rd_find(rd_file *r, const char *key)
{
    r->pos = 24;
    for (uint64_t i = 0; i < r->n_kv; i++) {
        uint64_t n;
        const char *s = rd_str(r, &n);
        uint32_t ty = (uint32_t)rd_u(r, 4);
        if (str_is(s, n, key))
            return ty;
        rd_skip(r, ty);
    }
    fail_msg("metadata key %s is absent", key);
    return 0;
}

static uint32_t kv_u32(rd_file *r, const char *key)
{
    assert_int_equal(rd_find(r, key), 4);
    return (uint32_t)rd_u(r, 4);
}

static float kv_f32(rd_file *r, const char *key)
{
    assert_int_equal(rd_find(r, key), 6);
    uint32_t u = (uint32_t)rd_u(r, 4);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void kv_str_is(rd_file *r, const char *key, const char *want)
{
    assert_int_equal(rd_find(r, key), 8);
    uint64_t n;
    const char *s = rd_str(r, &n);
    assert_true(str_is(s, n, want));
}

static const rd_tensor *rd_tensor_named(rd_file *r, const char *name)
{
    for (uint64_t i = 0; i < r->n_tensors; i++)
        if (!strcmp(r->t[i].name, name))
            return &r->t[i];
    return NULL;
}

static const unsigned char *rd_data(rd_file *r, const rd_tensor *t)
{
    uint64_t n = t->ne[0] * t->ne[1] * (t->type == 1 ? 2 : 4);
    assert_true(r->data0 + t->offset + n <= r->len);
    return r->buf + r->data0 + t->offset;
}

/* ---- the llama2.c checkpoint, read from its file ---------------------- */

typedef struct {
    int32_t d, h, L, nh, nkv, V, S, kv, hs;
    int shared;
    float *f; /* the floats after the header */
    unsigned char *raw;
    /* float offsets of each tensor */
    size_t emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, wcls;
} ckpt;

static void ckpt_read(ckpt *c, const char *path)
{
    size_t len;
    c->raw = read_all(path, &len);
    int32_t hd[7];
    memcpy(hd, c->raw, sizeof hd);
    c->d = hd[0], c->h = hd[1], c->L = hd[2], c->nh = hd[3], c->nkv = hd[4], c->S = hd[6];
    c->shared = hd[5] > 0;
    c->V = hd[5] > 0 ? hd[5] : -hd[5];
    c->hs = c->d / c->nh, c->kv = c->nkv * c->hs;
    c->f = (float *)(c->raw + 28);
    size_t d = (size_t)c->d, L = (size_t)c->L, kv = (size_t)c->kv, h = (size_t)c->h, o = 0;
    c->emb = o, o += (size_t)c->V * d;
    c->rms_att = o, o += L * d;
    c->wq = o, o += L * d * d;
    c->wk = o, o += L * kv * d;
    c->wv = o, o += L * kv * d;
    c->wo = o, o += L * d * d;
    c->rms_ffn = o, o += L * d;
    c->w1 = o, o += L * h * d;
    c->w2 = o, o += L * d * h;
    c->w3 = o, o += L * h * d;
    c->rms_final = o, o += d;
    o += (size_t)c->S * (size_t)c->hs; /* freq_cis real + imag */
    c->wcls = c->shared ? c->emb : o;
}

/* ---- tests -------------------------------------------------------------- */

static char g_dir[64];

static int setup(void **state)
{
    (void)state;
    strcpy(g_dir, "/tmp/kvt_test_gguf_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    return system(cmd);
}

/* Files in the test directory whose name starts with `prefix` (an output
 * and its temporaries "<output>.tmp.XXXXXX"). */
static int dir_entries(const char *prefix)
{
    DIR *d = opendir(g_dir);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += !strncmp(e->d_name, prefix, strlen(prefix));
    closedir(d);
    return n;
}

/* Checks every tensor of the export against the checkpoint. */
static void check_tensors(rd_file *r, const ckpt *c, uint32_t mat_type)
{
    uint64_t want_n = 2 + (c->shared ? 0 : 1) + 9 * (uint64_t)c->L;
    assert_int_equal(r->n_tensors, want_n);
    struct {
        const char *name;
        size_t off;
        uint64_t ne0, ne1; /* ne1 0: a vector */
    } want[3 + 9 * 8];
    int n = 0;
    size_t d = (size_t)c->d, kv = (size_t)c->kv, h = (size_t)c->h;
    static char names[3 + 9 * 8][48];
    want[n].name = "token_embd.weight", want[n].off = c->emb, want[n].ne0 = d, want[n++].ne1 = (uint64_t)c->V;
    want[n].name = "output_norm.weight", want[n].off = c->rms_final, want[n].ne0 = d, want[n++].ne1 = 0;
    if (!c->shared)
        want[n].name = "output.weight", want[n].off = c->wcls, want[n].ne0 = d, want[n++].ne1 = (uint64_t)c->V;
    assert_true(c->L <= 8);
    for (int l = 0; l < c->L; l++) {
        size_t L = (size_t)l;
        struct {
            const char *p;
            size_t off;
            uint64_t ne0, ne1;
        } parts[9] = {{"attn_norm", c->rms_att + L * d, d, 0},  {"attn_q", c->wq + L * d * d, d, d},
                      {"attn_k", c->wk + L * kv * d, d, kv},    {"attn_v", c->wv + L * kv * d, d, kv},
                      {"attn_output", c->wo + L * d * d, d, d}, {"ffn_norm", c->rms_ffn + L * d, d, 0},
                      {"ffn_gate", c->w1 + L * h * d, d, h},    {"ffn_down", c->w2 + L * d * h, h, d},
                      {"ffn_up", c->w3 + L * h * d, d, h}};
        for (int i = 0; i < 9; i++) {
            snprintf(names[n], sizeof names[n], "blk.%d.%s.weight", l, parts[i].p);
            want[n].name = names[n], want[n].off = parts[i].off, want[n].ne0 = parts[i].ne0;
            want[n++].ne1 = parts[i].ne1;
        }
    }
    uint16_t *h16 = malloc(sizeof *h16 * d * (size_t)(c->V > c->h ? c->V : c->h) * 4);
    for (int i = 0; i < n; i++) {
        const rd_tensor *t = rd_tensor_named(r, want[i].name);
        if (!t)
            fail_msg("tensor %s is missing", want[i].name);
        assert_int_equal(t->n_dims, want[i].ne1 ? 2 : 1);
        assert_int_equal(t->ne[0], want[i].ne0);
        if (want[i].ne1)
            assert_int_equal(t->ne[1], want[i].ne1);
        uint32_t ty = want[i].ne1 ? mat_type : 0;
        assert_int_equal(t->type, ty);
        size_t cnt = (size_t)want[i].ne0 * (size_t)(want[i].ne1 ? want[i].ne1 : 1);
        const float *src = c->f + want[i].off;
        if (ty == 0) {
            assert_memory_equal(rd_data(r, t), src, cnt * 4);
        } else {
            assert_int_equal(kvt_dtype_from_f32(KVT_DTYPE_F16, src, h16, cnt), 0);
            assert_memory_equal(rd_data(r, t), h16, cnt * 2);
        }
    }
    free(h16);
}

static void check_hparams(rd_file *r, const ckpt *c, uint32_t file_type)
{
    kv_str_is(r, "general.architecture", "llama");
    assert_int_equal(kv_u32(r, "general.alignment"), 32);
    assert_int_equal(kv_u32(r, "general.file_type"), file_type);
    assert_int_equal(kv_u32(r, "llama.context_length"), c->S);
    assert_int_equal(kv_u32(r, "llama.embedding_length"), c->d);
    assert_int_equal(kv_u32(r, "llama.block_count"), c->L);
    assert_int_equal(kv_u32(r, "llama.feed_forward_length"), c->h);
    assert_int_equal(kv_u32(r, "llama.attention.head_count"), c->nh);
    assert_int_equal(kv_u32(r, "llama.attention.head_count_kv"), c->nkv);
    assert_int_equal(kv_u32(r, "llama.rope.dimension_count"), c->hs);
    assert_true(kv_f32(r, "llama.rope.freq_base") == 10000.0f);
    assert_true(kv_f32(r, "llama.attention.layer_norm_rms_epsilon") == 1e-5f);
    kv_str_is(r, "tokenizer.ggml.model", "llama");
    assert_int_equal(kv_u32(r, "tokenizer.ggml.bos_token_id"), 1);
    assert_int_equal(kv_u32(r, "tokenizer.ggml.eos_token_id"), 2);
    assert_int_equal(kv_u32(r, "tokenizer.ggml.unknown_token_id"), 0);
}

/* The tokenizer arrays: count V, the text of id `probe` and types/scores. */
static void check_tokens(rd_file *r, const kvt_tokenizer *tk, int32_t V)
{
    assert_int_equal(rd_find(r, "tokenizer.ggml.tokens"), 9);
    assert_int_equal(rd_u(r, 4), 8);
    assert_int_equal(rd_u(r, 8), (uint64_t)V);
    for (int32_t i = 0; i < V; i++) {
        uint64_t n;
        const char *s = rd_str(r, &n);
        const char *p = kvt_tokenizer_piece(tk, i);
        char want[256];
        size_t k = 0;
        if (i == 1 || i == 2) {
            strcpy(want, i == 1 ? "<s>" : "</s>"), k = strlen(want);
        } else {
            for (; *p && k < sizeof want - 4; p++)
                if (*p == ' ')
                    memcpy(want + k, "\xe2\x96\x81", 3), k += 3;
                else
                    want[k++] = *p;
        }
        if (n != k || memcmp(s, want, k))
            fail_msg("token %d: text '%.*s', expected '%.*s'", (int)i, (int)n, s, (int)k, want);
    }
    assert_int_equal(rd_find(r, "tokenizer.ggml.scores"), 9);
    assert_int_equal(rd_u(r, 4), 6);
    assert_int_equal(rd_u(r, 8), (uint64_t)V);
    for (int32_t i = 0; i < V; i++) {
        uint32_t u = (uint32_t)rd_u(r, 4);
        float f;
        memcpy(&f, &u, 4);
        assert_true(f == kvt_tokenizer_score(tk, i));
    }
    assert_int_equal(rd_find(r, "tokenizer.ggml.token_type"), 9);
    assert_int_equal(rd_u(r, 4), 5);
    assert_int_equal(rd_u(r, 8), (uint64_t)V);
    for (int32_t i = 0; i < V; i++) {
        int32_t ty = (int32_t)rd_u(r, 4);
        const char *p = kvt_tokenizer_piece(tk, i);
        int byte = strlen(p) == 6 && !strncmp(p, "<0x", 3) && p[5] == '>';
        int want = i == 0 ? 2 : i <= 2 ? 3 : byte ? 6 : 1;
        if (ty != want)
            fail_msg("token %d ('%s'): type %d, expected %d", (int)i, p, (int)ty, want);
    }
}

static void export_and_check(const char *model_path, const char *tok_path, kvt_gguf_dtype dt)
{
    kvt_model *m = NULL;
    kvt_tokenizer *tk = NULL;
    assert_int_equal(kvt_model_load(model_path, &m), 0);
    assert_int_equal(kvt_tokenizer_load(tok_path, kvt_model_get_config(m)->vocab_size, &tk), 0);
    char out[128];
    snprintf(out, sizeof out, "%s/out.gguf", g_dir);
    assert_int_equal(kvt_gguf_export(m, tk, dt, "name", out), 0);
    ckpt c;
    ckpt_read(&c, model_path);
    rd_file r;
    rd_open(&r, out);
    check_hparams(&r, &c, dt == KVT_GGUF_F16 ? 1 : 0);
    kv_str_is(&r, "general.name", "name");
    check_tokens(&r, tk, c.V);
    check_tensors(&r, &c, dt == KVT_GGUF_F16 ? 1 : 0);
    free(r.buf);
    free(c.raw);
    kvt_tokenizer_free(tk);
    kvt_model_free(m);
    assert_int_equal(dir_entries("out.gguf"), 1); /* no temporary left */
    assert_int_equal(unlink(out), 0);
}

static void synth_plain(char *mp, char *tp)
{
    sprintf(mp, "%s/m.bin", g_dir);
    sprintf(tp, "%s/t.bin", g_dir);
    su_synth(SU_PLAIN, mp, KVT_DEFAULT_VOCAB, 64, 7, 0);
    assert_int_equal(kvt_tokenizer_write_default(tp, KVT_DEFAULT_VOCAB), 0);
}

static void test_export_synthetic_f32_f16(void **state)
{
    (void)state;
    char mp[128], tp[128];
    synth_plain(mp, tp);
    export_and_check(mp, tp, KVT_GGUF_F32);
    export_and_check(mp, tp, KVT_GGUF_F16);
}

static void test_export_stories260k(void **state)
{
    (void)state;
    const char *shared = getenv("KVT_SHARED_DIR");
    char mp[4096], tp[4096];
    snprintf(mp, sizeof mp, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tp, sizeof tp, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    if (access(mp, R_OK) != 0 || access(tp, R_OK) != 0) {
        printf("test_export_stories260k: skipped: %s or tok512.bin is absent\n", mp);
        skip();
        return;
    }
    export_and_check(mp, tp, KVT_GGUF_F32); /* shared classifier: no output.weight */
    kvt_tokenizer *tk = NULL;
    assert_int_equal(kvt_tokenizer_load(tp, 512, &tk), 0);
    int spaced = 0;
    for (int32_t i = 0; i < 512; i++)
        spaced += kvt_tokenizer_piece(tk, i)[0] == ' ';
    assert_int_equal(spaced, 91); /* pieces that start with a space: the U+2581 mapping was exercised */
    kvt_tokenizer_free(tk);
}

static void test_refusals(void **state)
{
    (void)state;
    char mp[128], tp[128], hp[128], out[160];
    synth_plain(mp, tp);
    sprintf(hp, "%s/h.bin", g_dir);
    su_synth(SU_HYBRID, hp, KVT_DEFAULT_VOCAB, 64, 7, 8);
    kvt_model *m = NULL, *hm = NULL;
    kvt_tokenizer *tk = NULL;
    assert_int_equal(kvt_model_load(mp, &m), 0);
    assert_int_equal(kvt_model_load(hp, &hm), 0);
    assert_int_equal(kvt_tokenizer_load(tp, 0, &tk), 0);
    sprintf(out, "%s/x.gguf", g_dir);
    assert_int_equal(kvt_gguf_export(hm, tk, KVT_GGUF_F32, NULL, out), KVT_EUNSUPPORTED);
    assert_non_null(strstr(kvt_last_error(), "layer 1 is a sliding-window layer"));
    assert_int_equal(kvt_gguf_export(NULL, tk, KVT_GGUF_F32, NULL, out), KVT_EINVAL);
    assert_int_equal(kvt_gguf_export(m, NULL, KVT_GGUF_F32, NULL, out), KVT_EINVAL);
    assert_int_equal(kvt_gguf_export(m, tk, KVT_GGUF_F32, NULL, NULL), KVT_EINVAL);
    assert_int_equal(kvt_gguf_export(m, tk, (kvt_gguf_dtype)7, NULL, out), KVT_EINVAL);
    /* a tokenizer of another size */
    const char *shared = getenv("KVT_SHARED_DIR");
    char tok512[4096];
    snprintf(tok512, sizeof tok512, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    kvt_tokenizer *t512 = NULL;
    if (kvt_tokenizer_load(tok512, 512, &t512) == 0) {
        assert_int_equal(kvt_gguf_export(m, t512, KVT_GGUF_F32, NULL, out), KVT_EINVAL);
        assert_non_null(strstr(kvt_last_error(), "512 pieces"));
        kvt_tokenizer_free(t512);
    }
    char bad[200];
    sprintf(bad, "%s/no/such/dir/x.gguf", g_dir);
    assert_int_equal(kvt_gguf_export(m, tk, KVT_GGUF_F32, NULL, bad), -ENOENT);
    assert_int_equal(dir_entries("x.gguf"), 0); /* nothing written by any refusal */
    kvt_gguf_dtype dt;
    assert_int_equal(kvt_gguf_dtype_parse("f16", &dt), 0);
    assert_int_equal(dt, KVT_GGUF_F16);
    assert_int_equal(kvt_gguf_dtype_parse("f32", &dt), 0);
    assert_int_equal(dt, KVT_GGUF_F32);
    assert_int_equal(kvt_gguf_dtype_parse("q8_0", &dt), KVT_EINVAL);
    assert_int_equal(kvt_gguf_dtype_parse(NULL, &dt), KVT_EINVAL);
    kvt_tokenizer_free(tk);
    kvt_model_free(m);
    kvt_model_free(hm);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_export_synthetic_f32_f16, setup, teardown),
        cmocka_unit_test_setup_teardown(test_export_stories260k, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refusals, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
