/*
 * gguf.c: writes a loaded llama2.c checkpoint and its tokenizer as a GGUF v3
 * file llama.cpp runs as architecture "llama" (engine/gguf.h gives the
 * layout). It owns only the encoding: the weights are read from the model's
 * mapping, never changed. It must never leave a partial file at the
 * destination: it writes a temporary in the same directory, fsyncs it and
 * renames it into place, removing the temporary on any error.
 */
#include "gguf.h"

#include "model_internal.h"
#include "util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_VERSION 3
#define GGUF_ALIGN 32
/* GGUF metadata value types */
enum { GT_U32 = 4, GT_I32 = 5, GT_F32 = 6, GT_BOOL = 7, GT_STRING = 8, GT_ARRAY = 9 };
/* SentencePiece token types as llama.cpp reads them */
enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_BYTE = 6 };
#define MAX_TENSORS (3 + 9 * KVT_MODEL_MAX_LAYERS)

typedef struct {
    char name[48];
    uint32_t n_dims;
    uint64_t ne[2];     /* GGUF order: ne[0] is the fastest (a row's length) */
    uint32_t type;      /* KVT_GGUF_F32 or KVT_GGUF_F16 */
    const float *data;  /* ne[0] * ne[1] floats in the model's mapping */
    uint64_t offset;    /* from the start of the data section, aligned */
} gguf_tensor;

typedef struct {
    FILE *f;
    uint64_t pos; /* bytes written so far */
    int err;      /* errno of the first failed write, 0 if none */
} gguf_writer;

static void put_bytes(gguf_writer *w, const void *p, size_t n)
{
    if (!w->err && n && fwrite(p, 1, n, w->f) != n)
        w->err = errno ? errno : EIO;
    w->pos += n;
}

static void put_u32(gguf_writer *w, uint32_t v) { put_bytes(w, &v, 4); }
static void put_u64(gguf_writer *w, uint64_t v) { put_bytes(w, &v, 8); }
static void put_str(gguf_writer *w, const char *s, size_t n)
{
    put_u64(w, n);
    put_bytes(w, s, n);
}
static void put_key(gguf_writer *w, const char *key, uint32_t type)
{
    put_str(w, key, strlen(key));
    put_u32(w, type);
}
static void kv_u32(gguf_writer *w, const char *key, uint32_t v)
{
    put_key(w, key, GT_U32);
    put_u32(w, v);
}
static void kv_f32(gguf_writer *w, const char *key, float v)
{
    put_key(w, key, GT_F32);
    put_bytes(w, &v, 4);
}
static void kv_bool(gguf_writer *w, const char *key, int v)
{
    put_key(w, key, GT_BOOL);
    uint8_t b = v ? 1 : 0;
    put_bytes(w, &b, 1);
}
static void kv_str(gguf_writer *w, const char *key, const char *v)
{
    put_key(w, key, GT_STRING);
    put_str(w, v, strlen(v));
}
static void pad_to(gguf_writer *w, uint64_t align)
{
    static const uint8_t zero[GGUF_ALIGN];
    uint64_t r = w->pos % align;
    if (r)
        put_bytes(w, zero, (size_t)(align - r));
}

/* "<0xNN>" with two hex digits: llama2.c's byte-fallback pieces. */
static int is_byte_piece(const char *p)
{
    return strlen(p) == 6 && !strncmp(p, "<0x", 3) && p[5] == '>' && strchr("0123456789ABCDEFabcdef", p[3]) &&
           strchr("0123456789ABCDEFabcdef", p[4]);
}

static int token_type(int32_t id, const char *piece)
{
    if (id == 0)
        return TT_UNKNOWN;
    if (id == KVT_TOKEN_BOS || id == KVT_TOKEN_EOS)
        return TT_CONTROL;
    return is_byte_piece(piece) ? TT_BYTE : TT_NORMAL;
}

/* The SentencePiece text of a llama2.c piece: BOS/EOS by name, ' ' -> U+2581. */
static void put_piece_text(gguf_writer *w, int32_t id, const char *piece)
{
    if (id == KVT_TOKEN_BOS || id == KVT_TOKEN_EOS) {
        const char *s = id == KVT_TOKEN_BOS ? "<s>" : "</s>";
        put_str(w, s, strlen(s));
        return;
    }
    size_t n = 0, spaces = 0;
    for (const char *p = piece; *p; p++, n++)
        spaces += *p == ' ';
    put_u64(w, n + 2 * spaces); /* U+2581 is 3 bytes */
    for (const char *p = piece; *p; p++)
        if (*p == ' ')
            put_bytes(w, "\xe2\x96\x81", 3);
        else
            put_bytes(w, p, 1);
}

static void put_tokenizer(gguf_writer *w, const kvt_tokenizer *t, int32_t V)
{
    kv_str(w, "tokenizer.ggml.model", "llama");
    put_key(w, "tokenizer.ggml.tokens", GT_ARRAY);
    put_u32(w, GT_STRING);
    put_u64(w, (uint64_t)V);
    for (int32_t i = 0; i < V; i++)
        put_piece_text(w, i, kvt_tokenizer_piece(t, i));
    put_key(w, "tokenizer.ggml.scores", GT_ARRAY);
    put_u32(w, GT_F32);
    put_u64(w, (uint64_t)V);
    for (int32_t i = 0; i < V; i++) {
        float s = kvt_tokenizer_score(t, i);
        put_bytes(w, &s, 4);
    }
    put_key(w, "tokenizer.ggml.token_type", GT_ARRAY);
    put_u32(w, GT_I32);
    put_u64(w, (uint64_t)V);
    for (int32_t i = 0; i < V; i++) {
        int32_t ty = token_type(i, kvt_tokenizer_piece(t, i));
        put_bytes(w, &ty, 4);
    }
    kv_u32(w, "tokenizer.ggml.bos_token_id", KVT_TOKEN_BOS);
    kv_u32(w, "tokenizer.ggml.eos_token_id", KVT_TOKEN_EOS);
    kv_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    kv_bool(w, "tokenizer.ggml.add_bos_token", 1);
    kv_bool(w, "tokenizer.ggml.add_eos_token", 0);
}
#define N_TOKENIZER_KEYS 9

static void add_tensor(gguf_tensor *ts, int *n, const char *name, const float *data, uint64_t ne0, uint64_t ne1,
                       uint32_t type)
{
    gguf_tensor *g = &ts[(*n)++];
    snprintf(g->name, sizeof g->name, "%s", name);
    g->n_dims = ne1 ? 2 : 1;
    g->ne[0] = ne0;
    g->ne[1] = ne1 ? ne1 : 1;
    g->type = ne1 ? type : KVT_GGUF_F32; /* vectors stay f32 */
    g->data = data;
}

/* The tensors in llama.cpp's names and shapes (see gguf.h). */
static int list_tensors(const kvt_model *m, kvt_gguf_dtype dt, gguf_tensor *ts)
{
    const kvt_model_config *c = &m->cfg;
    const kvt__weights *w = &m->w;
    uint64_t d = (uint64_t)c->dim, kv = (uint64_t)c->kv_dim, h = (uint64_t)c->hidden_dim, V = (uint64_t)c->vocab_size;
    int n = 0;
    char nm[48];
    add_tensor(ts, &n, "token_embd.weight", w->token_embedding, d, V, dt);
    add_tensor(ts, &n, "output_norm.weight", w->rms_final, d, 0, dt);
    if (!c->shared_classifier)
        add_tensor(ts, &n, "output.weight", w->wcls, d, V, dt);
    for (int32_t l = 0; l < c->n_layers; l++) {
        uint64_t L = (uint64_t)l;
        struct {
            const char *part;
            const float *base;
            uint64_t ne0, ne1;
        } parts[] = {{"attn_norm", w->rms_att + L * d, d, 0},   {"attn_q", w->wq + L * d * d, d, d},
                     {"attn_k", w->wk + L * kv * d, d, kv},     {"attn_v", w->wv + L * kv * d, d, kv},
                     {"attn_output", w->wo + L * d * d, d, d},  {"ffn_norm", w->rms_ffn + L * d, d, 0},
                     {"ffn_gate", w->w1 + L * h * d, d, h},     {"ffn_down", w->w2 + L * d * h, h, d},
                     {"ffn_up", w->w3 + L * h * d, d, h}};
        for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
            snprintf(nm, sizeof nm, "blk.%d.%s.weight", (int)l, parts[i].part);
            add_tensor(ts, &n, nm, parts[i].base, parts[i].ne0, parts[i].ne1, dt);
        }
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        ts[i].offset = off;
        uint64_t bytes = ts[i].ne[0] * ts[i].ne[1] * (ts[i].type == KVT_GGUF_F16 ? 2 : 4);
        off += (bytes + GGUF_ALIGN - 1) / GGUF_ALIGN * GGUF_ALIGN;
    }
    return n;
}

static void put_tensor_data(gguf_writer *w, const gguf_tensor *g, uint16_t *buf, size_t buf_elems)
{
    uint64_t n = g->ne[0] * g->ne[1];
    if (g->type == KVT_GGUF_F32) {
        put_bytes(w, g->data, (size_t)(n * 4));
        return;
    }
    for (uint64_t i = 0; i < n && !w->err; i += buf_elems) {
        size_t k = (size_t)(n - i < buf_elems ? n - i : buf_elems);
        kvt_dtype_from_f32(KVT_DTYPE_F16, g->data + i, buf, k);
        put_bytes(w, buf, k * 2);
    }
}

static void write_gguf(gguf_writer *w, const kvt_model *m, const kvt_tokenizer *t, kvt_gguf_dtype dt,
                       const char *name, const gguf_tensor *ts, int n_tensors, uint16_t *buf, size_t buf_elems)
{
    const kvt_model_config *c = &m->cfg;
    put_bytes(w, "GGUF", 4);
    put_u32(w, GGUF_VERSION);
    put_u64(w, (uint64_t)n_tensors);
    put_u64(w, 15 + N_TOKENIZER_KEYS);
    kv_str(w, "general.architecture", "llama");
    kv_str(w, "general.name", name);
    kv_u32(w, "general.alignment", GGUF_ALIGN);
    kv_u32(w, "general.file_type", dt == KVT_GGUF_F16 ? 1 : 0);
    kv_u32(w, "llama.context_length", (uint32_t)c->seq_len);
    kv_u32(w, "llama.embedding_length", (uint32_t)c->dim);
    kv_u32(w, "llama.block_count", (uint32_t)c->n_layers);
    kv_u32(w, "llama.feed_forward_length", (uint32_t)c->hidden_dim);
    kv_u32(w, "llama.attention.head_count", (uint32_t)c->n_heads);
    kv_u32(w, "llama.attention.head_count_kv", (uint32_t)c->n_kv_heads);
    kv_u32(w, "llama.rope.dimension_count", (uint32_t)c->head_size);
    kv_f32(w, "llama.rope.freq_base", 10000.0f);
    kv_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    kv_u32(w, "llama.vocab_size", (uint32_t)c->vocab_size);
    kv_u32(w, "llama.attention.key_length", (uint32_t)c->head_size);
    put_tokenizer(w, t, c->vocab_size);
    for (int i = 0; i < n_tensors; i++) {
        put_str(w, ts[i].name, strlen(ts[i].name));
        put_u32(w, ts[i].n_dims);
        for (uint32_t k = 0; k < ts[i].n_dims; k++)
            put_u64(w, ts[i].ne[k]);
        put_u32(w, ts[i].type);
        put_u64(w, ts[i].offset);
    }
    pad_to(w, GGUF_ALIGN);
    uint64_t data0 = w->pos;
    for (int i = 0; i < n_tensors && !w->err; i++) {
        static const uint8_t zero[GGUF_ALIGN];
        if (w->pos - data0 < ts[i].offset)
            put_bytes(w, zero, (size_t)(ts[i].offset - (w->pos - data0)));
        put_tensor_data(w, &ts[i], buf, buf_elems);
    }
    pad_to(w, GGUF_ALIGN);
}

KVT_API int kvt_gguf_dtype_parse(const char *name, kvt_gguf_dtype *out)
{
    if (name && out && !strcmp(name, "f32"))
        return *out = KVT_GGUF_F32, 0;
    if (name && out && !strcmp(name, "f16"))
        return *out = KVT_GGUF_F16, 0;
    return kvt__fail(KVT_EINVAL, "GGUF weight type '%s': expected f32 or f16", name ? name : "(null)");
}

KVT_API int kvt_gguf_export(const kvt_model *m, const kvt_tokenizer *t, kvt_gguf_dtype dtype, const char *name,
                            const char *out_path)
{
    if (!m || !t || !out_path)
        return kvt__fail(KVT_EINVAL, "kvt_gguf_export: NULL %s", !m ? "model" : !t ? "tokenizer" : "output path");
    if (dtype != KVT_GGUF_F32 && dtype != KVT_GGUF_F16)
        return kvt__fail(KVT_EINVAL, "kvt_gguf_export: weight type %d is neither f32 (0) nor f16 (1)", (int)dtype);
    const kvt_model_config *c = &m->cfg;
    for (int32_t l = 0; l < c->n_layers; l++)
        if (c->layer_kind[l] != KVT_LAYER_ATTN)
            return kvt__fail(KVT_EUNSUPPORTED,
                             "%s: layer %d is a %s layer; GGUF export writes llama.cpp's \"llama\" architecture, "
                             "which has only full attention layers",
                             m->path, (int)l, c->layer_kind[l] == KVT_LAYER_WINDOW ? "sliding-window" : "recurrent");
    int32_t nv = kvt_tokenizer_vocab_size(t);
    if (nv != c->vocab_size || nv < 3)
        return kvt__fail(KVT_EINVAL, "%s: the tokenizer has %d pieces but the model's vocab_size is %d (and BOS/EOS "
                         "need ids 1 and 2)", m->path, (int)nv, (int)c->vocab_size);
    const size_t buf_elems = 1 << 16;
    size_t tl = strlen(out_path) + 16;
    char *tmp = kvt__malloc(tl);
    gguf_tensor *ts = kvt__calloc(MAX_TENSORS, sizeof *ts);
    uint16_t *buf = dtype == KVT_GGUF_F16 ? kvt__malloc(buf_elems * sizeof *buf) : NULL;
    int rc = 0;
    if (!tmp || !ts || (dtype == KVT_GGUF_F16 && !buf)) {
        rc = kvt__fail(KVT_ENOMEM, "%s: out of memory for the GGUF export", out_path);
        goto done;
    }
    int n_tensors = list_tensors(m, dtype, ts);
    snprintf(tmp, tl, "%s.tmp.XXXXXX", out_path);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        rc = kvt__fail(-errno, "%s: cannot create a temporary file: %s", tmp, strerror(errno));
        goto done;
    }
    (void)fchmod(fd, 0644);
    gguf_writer w = {fdopen(fd, "wb"), 0, 0};
    if (!w.f) {
        rc = kvt__fail(-errno, "%s: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        goto done;
    }
    write_gguf(&w, m, t, dtype, name ? name : "kvtier", ts, n_tensors, buf, buf_elems);
    if (!w.err && fflush(w.f) != 0)
        w.err = errno;
    if (!w.err && fsync(fileno(w.f)) != 0)
        w.err = errno;
    if (fclose(w.f) != 0 && !w.err)
        w.err = errno;
    if (!w.err && rename(tmp, out_path) != 0)
        w.err = errno;
    if (w.err) {
        unlink(tmp);
        rc = kvt__fail(-w.err, "%s: cannot write the GGUF file: %s", out_path, strerror(w.err));
    }
done:
    kvt__free(tmp);
    kvt__free(ts);
    kvt__free(buf);
    return rc;
}
