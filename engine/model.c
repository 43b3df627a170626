/*
 * model.c: loads and validates llama2.c checkpoints (and the KVTX hybrid-shape
 * trailer) by mmap, owns the model object, its config fingerprint and the
 * per-layer cache factory. It must never read outside the mapping: every
 * offset is computed from header values checked for range and overflow and
 * compared with the file size before any tensor pointer is formed. The
 * forward pass lives in forward.c.
 */
#include "model_internal.h"

#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEADER_BYTES 28
/* Sanity bounds: far beyond any model this engine runs, small enough that
 * every product below fits in 64 bits. */
#define MAX_DIM (1 << 16)
#define MAX_HIDDEN (1 << 18)
#define MAX_VOCAB (1 << 22)
#define MAX_SEQ (1 << 22)

static int mul_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static int add_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_add_overflow(a, b, out); }

/* Float count of the standard llama2.c tensors for a checked config. */
static int standard_floats(const kvt_model_config *c, const char *path, uint64_t *out)
{
    uint64_t L = (uint64_t)c->n_layers, d = (uint64_t)c->dim, h = (uint64_t)c->hidden_dim;
    uint64_t kv = (uint64_t)c->kv_dim, V = (uint64_t)c->vocab_size, S = (uint64_t)c->seq_len;
    uint64_t per_layer = 0, t, total;
    /* rms_att + wq + wk + wv + wo + rms_ffn + w1 + w2 + w3 */
    uint64_t parts[] = {d, d * d, kv * d, kv * d, d * d, d, h * d, d * h, h * d};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        per_layer += parts[i]; /* each < 2^36, sum < 2^40 */
    int ok = mul_ok(per_layer, L, &total);
    ok = ok && mul_ok(V, d, &t) && add_ok(total, t, &total);       /* token_embedding */
    ok = ok && add_ok(total, d, &total);                             /* rms_final */
    ok = ok && mul_ok(S, (uint64_t)c->head_size, &t) && add_ok(total, t, &total); /* freq_cis both */
    if (ok && !c->shared_classifier)
        ok = mul_ok(V, d, &t) && add_ok(total, t, &total);
    if (!ok || total > (UINT64_MAX - HEADER_BYTES) / 4)
        return kvt__fail(KVT_EFORMAT, "%s: header sizes overflow a 64-bit byte count", path);
    *out = total;
    return 0;
}

/* Checks the 7 header ints and fills the derived config fields. */
static int check_header(const int32_t hdr[7], const char *path, kvt_model_config *c)
{
    static const char *names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    static const int32_t maxv[7] = {MAX_DIM, MAX_HIDDEN, KVT_MODEL_MAX_LAYERS, MAX_DIM, MAX_DIM, MAX_VOCAB, MAX_SEQ};
    memset(c, 0, sizeof *c);
    for (int i = 0; i < 7; i++) {
        int64_t v = hdr[i];
        if (i == 5 && v < 0)
            v = -v;
        if (v <= 0)
            return kvt__fail(KVT_EFORMAT, "%s: header field %s is %d; it must be positive (not a llama2.c checkpoint?)",
                             path, names[i], hdr[i]);
        if (v > maxv[i])
            return kvt__fail(KVT_EFORMAT, "%s: header field %s is %lld, above the limit %d", path, names[i],
                             (long long)v, maxv[i]);
    }
    c->dim = hdr[0];
    c->hidden_dim = hdr[1];
    c->n_layers = hdr[2];
    c->n_heads = hdr[3];
    c->n_kv_heads = hdr[4];
    c->shared_classifier = hdr[5] > 0;
    c->vocab_size = hdr[5] > 0 ? hdr[5] : -hdr[5];
    c->seq_len = hdr[6];
    if (c->dim % c->n_heads)
        return kvt__fail(KVT_EFORMAT, "%s: dim %d is not a multiple of n_heads %d", path, c->dim, c->n_heads);
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads)
        return kvt__fail(KVT_EFORMAT, "%s: n_heads %d is not a multiple of n_kv_heads %d", path, c->n_heads,
                         c->n_kv_heads);
    c->head_size = c->dim / c->n_heads;
    if (c->head_size % 2)
        return kvt__fail(KVT_EFORMAT, "%s: head_size %d (dim / n_heads) is odd; RoPE needs pairs", path,
                         c->head_size);
    c->kv_dim = c->n_kv_heads * c->head_size;
    return 0;
}

/* Parses the KVTX trailer at `p` (`bytes` long) into c->layer_kind and
 * c->sliding_window, and the recurrent weights into w. */
static int parse_trailer(const unsigned char *p, uint64_t bytes, const char *path, kvt_model_config *c,
                         kvt__weights *w)
{
    int32_t f[3];
    if (bytes < 16)
        return kvt__fail(KVT_EFORMAT, "%s: kvtier extension is %llu bytes, shorter than its 16-byte header", path,
                         (unsigned long long)bytes);
    memcpy(f, p + 4, sizeof f);
    if (f[0] != KVT__TRAILER_VERSION)
        return kvt__fail(KVT_EUNSUPPORTED, "%s: kvtier extension version %d is not supported (this build reads %d)",
                         path, f[0], KVT__TRAILER_VERSION);
    if (f[2] != c->n_layers)
        return kvt__fail(KVT_EFORMAT, "%s: kvtier extension lists %d layers, the header says %d", path, f[2],
                         c->n_layers);
    uint64_t need = 16 + 4 * (uint64_t)c->n_layers;
    if (bytes < need)
        return kvt__fail(KVT_EFORMAT, "%s: kvtier extension is %llu bytes, too short for %d layer kinds", path,
                         (unsigned long long)bytes, c->n_layers);
    int n_window = 0, n_rec = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        int32_t k;
        memcpy(&k, p + 16 + 4 * (size_t)l, 4);
        if (k < KVT_LAYER_ATTN || k > KVT_LAYER_RECURRENT)
            return kvt__fail(KVT_EFORMAT, "%s: kvtier extension: layer %d has unknown kind %d", path, l, k);
        c->layer_kind[l] = (kvt_layer_kind)k;
        n_window += k == KVT_LAYER_WINDOW;
        n_rec += k == KVT_LAYER_RECURRENT;
    }
    if (n_window && (f[1] <= 0 || f[1] > c->seq_len))
        return kvt__fail(KVT_EFORMAT, "%s: kvtier extension: sliding window %d must be in [1, seq_len %d]", path,
                         f[1], c->seq_len);
    if (!n_window && f[1] != 0)
        return kvt__fail(KVT_EFORMAT, "%s: kvtier extension: sliding window %d but no window layer", path, f[1]);
    c->sliding_window = f[1];
    uint64_t dd = (uint64_t)c->dim * (uint64_t)c->dim;
    uint64_t total = need + (uint64_t)n_rec * 2 * dd * 4;
    if (bytes != total)
        return kvt__fail(KVT_EFORMAT, "%s: kvtier extension is %llu bytes, expected %llu for %d recurrent layers",
                         path, (unsigned long long)bytes, (unsigned long long)total, n_rec);
    const float *fp = (const float *)(const void *)(p + need);
    for (int32_t l = 0; l < c->n_layers; l++) {
        if (c->layer_kind[l] != KVT_LAYER_RECURRENT)
            continue;
        w->rec_wa[l] = fp;
        w->rec_wx[l] = fp + dd;
        fp += 2 * dd;
    }
    return 0;
}

static void map_standard(const float *p, const kvt_model_config *c, kvt__weights *w)
{
    size_t L = (size_t)c->n_layers, d = (size_t)c->dim, h = (size_t)c->hidden_dim, kv = (size_t)c->kv_dim;
    w->token_embedding = p, p += (size_t)c->vocab_size * d;
    w->rms_att = p, p += L * d;
    w->wq = p, p += L * d * d;
    w->wk = p, p += L * kv * d;
    w->wv = p, p += L * kv * d;
    w->wo = p, p += L * d * d;
    w->rms_ffn = p, p += L * d;
    w->w1 = p, p += L * h * d;
    w->w2 = p, p += L * d * h;
    w->w3 = p, p += L * h * d;
    w->rms_final = p, p += d;
    p += (size_t)c->seq_len * (size_t)c->head_size; /* freq_cis_real + freq_cis_imag */
    w->wcls = c->shared_classifier ? w->token_embedding : p;
}

int kvt__model_alloc_scratch(kvt_model *m); /* forward.c */
void kvt__model_free_scratch(kvt_model *m); /* forward.c */

KVT_API int kvt_model_load(const char *path, kvt_model **out)
{
    if (!path || !out)
        return kvt__fail(KVT_EINVAL, "kvt_model_load: NULL %s", path ? "out" : "path");
    *out = NULL;
    int rc, fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
        return kvt__fail(rc, "%s: cannot open model: %s", path, strerror(-rc));
    }
    kvt_model *m = NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = kvt__fail(-errno, "%s: cannot stat model: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = kvt__fail(KVT_EFORMAT, "%s: not a regular file", path);
        goto fail;
    }
    uint64_t size = (uint64_t)st.st_size;
    if (size < HEADER_BYTES) {
        rc = kvt__fail(KVT_EFORMAT, "%s: file is %llu bytes, shorter than the %d-byte llama2.c header", path,
                       (unsigned long long)size, HEADER_BYTES);
        goto fail;
    }
    m = kvt__calloc(1, sizeof *m);
    if (!m || !(m->path = kvt__strdup(path))) {
        rc = kvt__fail(KVT_ENOMEM, "%s: out of memory loading model", path);
        goto fail;
    }
    int32_t hdr[7];
    if (pread(fd, hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr) {
        rc = kvt__fail(KVT_EIO, "%s: cannot read the header", path);
        goto fail;
    }
    if ((rc = check_header(hdr, path, &m->cfg)) != 0)
        goto fail;
    uint64_t floats = 0;
    if ((rc = standard_floats(&m->cfg, path, &floats)) != 0)
        goto fail;
    uint64_t expect = HEADER_BYTES + floats * 4;
    if (size < expect) {
        rc = kvt__fail(KVT_EFORMAT, "%s: file is %llu bytes, the header (dim %d, hidden %d, layers %d, heads %d/%d, "
                       "vocab %d, seq_len %d) needs %llu", path, (unsigned long long)size, m->cfg.dim,
                       m->cfg.hidden_dim, m->cfg.n_layers, m->cfg.n_heads, m->cfg.n_kv_heads, hdr[5],
                       m->cfg.seq_len, (unsigned long long)expect);
        goto fail;
    }
    if (size > SIZE_MAX) {
        rc = kvt__fail(KVT_ENOMEM, "%s: file too large to map", path);
        goto fail;
    }
    m->map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m->map == MAP_FAILED) {
        m->map = NULL;
        rc = kvt__fail(-errno, "%s: cannot mmap model: %s", path, strerror(errno));
        goto fail;
    }
    m->map_bytes = (size_t)size;
    const unsigned char *base = m->map;
    if (size > expect) {
        uint64_t extra = size - expect;
        if (extra < 4 || memcmp(base + expect, KVT__TRAILER_MAGIC, 4) != 0) {
            rc = kvt__fail(KVT_EFORMAT, "%s: %llu trailing bytes after the %llu bytes the header describes, "
                           "not a kvtier (KVTX) extension", path, (unsigned long long)extra,
                           (unsigned long long)expect);
            goto fail;
        }
        if ((rc = parse_trailer(base + expect, extra, path, &m->cfg, &m->w)) != 0)
            goto fail;
    }
    map_standard((const float *)(const void *)(base + HEADER_BYTES), &m->cfg, &m->w);
    close(fd);
    fd = -1;
    if ((rc = kvt__model_alloc_scratch(m)) != 0)
        goto fail;
    *out = m;
    return 0;
fail:
    if (fd >= 0)
        close(fd);
    kvt_model_free(m);
    return rc;
}

KVT_API void kvt_model_free(kvt_model *m)
{
    if (!m)
        return;
    kvt__model_free_scratch(m);
    if (m->map)
        munmap(m->map, m->map_bytes);
    kvt__free(m->path);
    kvt__free(m);
}

KVT_API const kvt_model_config *kvt_model_get_config(const kvt_model *m) { return m ? &m->cfg : NULL; }

static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

KVT_API uint64_t kvt_model_fingerprint(const kvt_model *m)
{
    if (!m)
        return 0;
    const kvt_model_config *c = &m->cfg;
    int32_t f[11] = {c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size,
                     c->seq_len, c->head_size, c->kv_dim, c->shared_classifier, c->sliding_window};
    uint64_t h = fnv1a(0xcbf29ce484222325ULL, "kvtier-model-v1", 15);
    h = fnv1a(h, f, sizeof f);
    for (int32_t l = 0; l < c->n_layers; l++) {
        unsigned char k = (unsigned char)c->layer_kind[l];
        h = fnv1a(h, &k, 1);
    }
    return h;
}

static const char *const kvt__scheme_names[KVT_KV_SCHEME_COUNT] = {"f32", "f16", "bf16", "q8"};

KVT_API const char *kvt_kv_scheme_name(kvt_kv_scheme s)
{
    return (unsigned)s < KVT_KV_SCHEME_COUNT ? kvt__scheme_names[s] : NULL;
}

KVT_API int kvt_kv_scheme_parse(const char *name, kvt_kv_scheme *out)
{
    for (int i = 0; name && out && i < KVT_KV_SCHEME_COUNT; i++)
        if (!strcmp(name, kvt__scheme_names[i])) {
            *out = (kvt_kv_scheme)i;
            return 0;
        }
    return kvt__fail(KVT_EINVAL, "KV storage scheme \"%.32s\": use f32, f16, bf16 or q8", name ? name : "(null)");
}

KVT_API int kvt_model_set_kv_scheme(kvt_model *m, kvt_kv_scheme s)
{
    if (!m || (unsigned)s >= KVT_KV_SCHEME_COUNT)
        return kvt__fail(KVT_EINVAL, "kvt_model_set_kv_scheme: %s", !m ? "NULL model" : "unknown scheme");
    m->kv_scheme = s;
    return 0;
}

KVT_API kvt_kv_scheme kvt_model_kv_scheme(const kvt_model *m) { return m ? m->kv_scheme : KVT_KV_F32; }

KVT_API int32_t kvt_model_q8_group_size(const kvt_model *m)
{
    int32_t gs = 32;
    while (m && gs > 1 && m->cfg.head_size % gs)
        gs /= 2;
    return gs;
}

/* The cache dtype of a scheme. */
static kvt_dtype scheme_dtype(kvt_kv_scheme s)
{
    static const kvt_dtype dt[KVT_KV_SCHEME_COUNT] = {KVT_DTYPE_F32, KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_I8};
    return dt[s];
}

KVT_API size_t kvt_model_window_row_bytes(const kvt_model *m)
{
    if (!m)
        return 0;
    size_t kv = (size_t)m->cfg.kv_dim;
    if (m->kv_scheme == KVT_KV_Q8)
        return 2 * (kv + kv / (size_t)kvt_model_q8_group_size(m) * sizeof(float));
    return 2 * kv * kvt_dtype_size(scheme_dtype(m->kv_scheme));
}

/* K and V bytes of one token of an attention layer in blocks of B tokens. */
static size_t kv_row_bytes(const kvt_model *m, size_t B)
{
    size_t kv = (size_t)m->cfg.kv_dim;
    if (m->kv_scheme == KVT_KV_Q8) /* codes, plus a block's 16 * kv_dim bytes of scales over its B tokens */
        return 2 * kv + (16 * kv + B - 1) / B;
    return kvt_model_window_row_bytes(m);
}

KVT_API size_t kvt_model_kv_row_bytes(const kvt_model *m) { return m ? kv_row_bytes(m, KVT_MODEL_Q8_BLOCK) : 0; }

KVT_API size_t kvt_model_kv_row_bytes_at(const kvt_model *m, int32_t block_tokens)
{
    if (!m || block_tokens < 1)
        return 0;
    return kv_row_bytes(m, (size_t)KVT__MIN(block_tokens, m->cfg.seq_len)); /* as kvt_model_new_caches caps it */
}

KVT_API size_t kvt_model_kv_bytes_per_token_at(const kvt_model *m, int32_t block_tokens)
{
    if (!m)
        return 0;
    size_t n = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        n += m->cfg.layer_kind[l] == KVT_LAYER_ATTN;
    return n * kvt_model_kv_row_bytes_at(m, block_tokens);
}

KVT_API int kvt_model_new_caches(const kvt_model *m, int32_t block_tokens, kvt_cache **caches)
{
    if (!m || !caches)
        return kvt__fail(KVT_EINVAL, "kvt_model_new_caches: NULL argument");
    const kvt_model_config *c = &m->cfg;
    for (int32_t l = 0; l < c->n_layers; l++)
        caches[l] = NULL;
    if (block_tokens < 1)
        return kvt__fail(KVT_EINVAL, "kvt_model_new_caches: block_tokens %d must be >= 1", block_tokens);
    if (block_tokens > c->seq_len)
        block_tokens = c->seq_len; /* a longer block is never filled */
    const kvt_dtype dt = scheme_dtype(m->kv_scheme);
    const int32_t gs = kvt_model_q8_group_size(m);
    for (int32_t l = 0; l < c->n_layers; l++) {
        int rc;
        switch (c->layer_kind[l]) {
        case KVT_LAYER_WINDOW:
            rc = kvt_rotating_create_dtype(c->kv_dim, c->sliding_window, 0, dt, gs, &caches[l]);
            break;
        case KVT_LAYER_RECURRENT:
            rc = kvt_recurrent_create((size_t)c->dim * sizeof(float), &caches[l]);
            break;
        default:
            /* f32 in kv blocks; every other scheme seals full blocks and keeps the open one f32 */
            rc = dt == KVT_DTYPE_F32 ? kvt_kv_create(c->kv_dim, block_tokens, &caches[l])
                                     : kvt_qkvc_create_dtype(c->kv_dim, block_tokens,
                                                             dt == KVT_DTYPE_I8 ? KVT_DTYPE_U8 : dt, &caches[l]);
            break;
        }
        if (rc != 0) {
            kvt_caches_destroy(caches, l);
            return rc;
        }
    }
    return 0;
}

KVT_API size_t kvt_model_kv_bytes_per_token(const kvt_model *m)
{
    if (!m)
        return 0;
    size_t n = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        n += m->cfg.layer_kind[l] == KVT_LAYER_ATTN;
    return n * kvt_model_kv_row_bytes(m);
}

KVT_API size_t kvt_model_fixed_state_bytes(const kvt_model *m)
{
    if (!m)
        return 0;
    size_t n = 0;
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        if (m->cfg.layer_kind[l] == KVT_LAYER_WINDOW)
            n += (size_t)m->cfg.sliding_window * kvt_model_window_row_bytes(m);
        else if (m->cfg.layer_kind[l] == KVT_LAYER_ATTN && m->kv_scheme != KVT_KV_F32) /* the f32 open block */
            n += 2 * sizeof(float) * (size_t)m->cfg.kv_dim * (size_t)KVT__MIN(KVT_MODEL_Q8_BLOCK, m->cfg.seq_len);
        else if (m->cfg.layer_kind[l] == KVT_LAYER_RECURRENT)
            n += (size_t)m->cfg.dim * sizeof(float);
    }
    return n;
}
