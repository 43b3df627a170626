/*
 * synth.c: writes deterministic synthetic checkpoints (llama2.c legacy
 * format, plus the KVTX v1 trailer for hybrid shapes; model.h documents
 * both). Weights come from one splitmix64 stream seeded by the caller, so
 * equal parameters give byte-identical files. It must never leave a partial
 * file at the destination: it writes a temporary in the same directory,
 * fsyncs it and renames it into place, removing the temporary on any error.
 */
#include "model_internal.h"

#include "util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    FILE *f;
    uint64_t rng;
    float buf[16384];
    size_t n;
    int err; /* errno of the first failed write, 0 if none */
} synth_writer;

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void flush_floats(synth_writer *w)
{
    if (w->n && !w->err && fwrite(w->buf, sizeof(float), w->n, w->f) != w->n)
        w->err = errno ? errno : EIO;
    w->n = 0;
}

static void put_float(synth_writer *w, float v)
{
    w->buf[w->n++] = v;
    if (w->n == sizeof w->buf / sizeof w->buf[0])
        flush_floats(w);
}

/* n floats uniform in [-scale, scale). */
static void put_uniform(synth_writer *w, uint64_t n, float scale)
{
    for (uint64_t i = 0; i < n; i++) {
        double u = (double)(splitmix64(&w->rng) >> 11) * (1.0 / 9007199254740992.0); /* [0, 1) */
        put_float(w, (float)((2.0 * u - 1.0) * scale));
    }
}

static void put_const(synth_writer *w, uint64_t n, float v)
{
    for (uint64_t i = 0; i < n; i++)
        put_float(w, v);
}

static void put_ints(synth_writer *w, const int32_t *v, size_t n)
{
    flush_floats(w);
    if (!w->err && fwrite(v, sizeof(int32_t), n, w->f) != n)
        w->err = errno ? errno : EIO;
}

static int check_params(const kvt_synth_params *p)
{
    if (!p)
        return kvt__fail(KVT_EINVAL, "model synth: NULL params");
    const char *names[7] = {"dim", "hidden", "layers", "heads", "kv-heads", "vocab", "seq-len"};
    const int32_t vals[7] = {p->dim, p->hidden_dim, p->n_layers, p->n_heads, p->n_kv_heads, p->vocab_size,
                             p->seq_len};
    for (int i = 0; i < 7; i++)
        if (vals[i] <= 0)
            return kvt__fail(KVT_EINVAL, "model synth: --%s is %d; it must be positive", names[i], vals[i]);
    if (p->n_layers > KVT_MODEL_MAX_LAYERS)
        return kvt__fail(KVT_EINVAL, "model synth: --layers %d is above the limit %d", p->n_layers,
                         KVT_MODEL_MAX_LAYERS);
    if (p->dim > (1 << 16) || p->hidden_dim > (1 << 18) || p->vocab_size > (1 << 22) || p->seq_len > (1 << 22))
        return kvt__fail(KVT_EINVAL, "model synth: a size is above the loader's limits (dim 65536, hidden 262144, "
                         "vocab and seq-len 4194304)");
    if (p->dim % p->n_heads)
        return kvt__fail(KVT_EINVAL, "model synth: --dim %d is not a multiple of --heads %d", p->dim, p->n_heads);
    if (p->n_kv_heads > p->n_heads || p->n_heads % p->n_kv_heads)
        return kvt__fail(KVT_EINVAL, "model synth: --heads %d is not a multiple of --kv-heads %d", p->n_heads,
                         p->n_kv_heads);
    if ((p->dim / p->n_heads) % 2)
        return kvt__fail(KVT_EINVAL, "model synth: head size %d (dim / heads) must be even", p->dim / p->n_heads);
    int n_window = 0;
    for (int32_t l = 0; l < p->n_layers; l++) {
        if (p->layer_kind[l] < KVT_LAYER_ATTN || p->layer_kind[l] > KVT_LAYER_RECURRENT)
            return kvt__fail(KVT_EINVAL, "model synth: layer %d has unknown kind %d", l, (int)p->layer_kind[l]);
        n_window += p->layer_kind[l] == KVT_LAYER_WINDOW;
    }
    if (n_window && (p->sliding_window <= 0 || p->sliding_window > p->seq_len))
        return kvt__fail(KVT_EINVAL, "model synth: window layers need --sliding-window in [1, seq-len %d], got %d",
                         p->seq_len, p->sliding_window);
    if (!n_window && p->sliding_window != 0)
        return kvt__fail(KVT_EINVAL, "model synth: --sliding-window %d given but no --window-layers",
                         p->sliding_window);
    return 0;
}

static void write_model(synth_writer *w, const kvt_synth_params *p)
{
    uint64_t L = (uint64_t)p->n_layers, d = (uint64_t)p->dim, h = (uint64_t)p->hidden_dim;
    uint64_t hs = d / (uint64_t)p->n_heads, kv = (uint64_t)p->n_kv_heads * hs, V = (uint64_t)p->vocab_size;
    float sd = 1.0f / sqrtf((float)d), sh = 1.0f / sqrtf((float)h);
    int32_t hdr[7] = {p->dim, p->hidden_dim, p->n_layers, p->n_heads, p->n_kv_heads,
                      p->separate_classifier ? -p->vocab_size : p->vocab_size, p->seq_len};
    put_ints(w, hdr, 7);
    put_uniform(w, V * d, 1.0f);  /* token_embedding */
    put_const(w, L * d, 1.0f);    /* rms_att */
    put_uniform(w, L * d * d, sd);  /* wq */
    put_uniform(w, L * kv * d, sd); /* wk */
    put_uniform(w, L * kv * d, sd); /* wv */
    put_uniform(w, L * d * d, sd);  /* wo */
    put_const(w, L * d, 1.0f);      /* rms_ffn */
    put_uniform(w, L * h * d, sd);  /* w1 */
    put_uniform(w, L * d * h, sh);  /* w2 */
    put_uniform(w, L * h * d, sd);  /* w3 */
    put_const(w, d, 1.0f);          /* rms_final */
    for (int pass = 0; pass < 2; pass++) /* freq_cis_real, freq_cis_imag (seq_len, hs / 2) */
        for (int32_t pos = 0; pos < p->seq_len; pos++)
            for (uint64_t j = 0; j < hs / 2; j++) {
                double val = pos * pow(10000.0, -(double)(2 * j) / (double)hs);
                put_float(w, (float)(pass ? sin(val) : cos(val)));
            }
    if (p->separate_classifier) { /* wcls, row by row */
        for (uint64_t v = 0; v < V; v++)
            put_uniform(w, d, sd * (p->wcls_row_scale ? p->wcls_row_scale[v] : 1.0f));
    }
    int hybrid = 0;
    for (int32_t l = 0; l < p->n_layers; l++)
        hybrid |= p->layer_kind[l] != KVT_LAYER_ATTN;
    if (!hybrid)
        return;
    int32_t th[4];
    memcpy(&th[0], KVT__TRAILER_MAGIC, 4);
    th[1] = KVT__TRAILER_VERSION;
    th[2] = p->sliding_window;
    th[3] = p->n_layers;
    put_ints(w, th, 4);
    for (int32_t l = 0; l < p->n_layers; l++) {
        int32_t k = (int32_t)p->layer_kind[l];
        put_ints(w, &k, 1);
    }
    for (int32_t l = 0; l < p->n_layers; l++)
        if (p->layer_kind[l] == KVT_LAYER_RECURRENT) {
            put_uniform(w, d * d, sd); /* wa */
            put_uniform(w, d * d, sd); /* wx */
        }
    flush_floats(w);
}

KVT_API int kvt_model_synth(const kvt_synth_params *p, const char *out_path)
{
    int rc = check_params(p);
    if (rc != 0)
        return rc;
    if (!out_path)
        return kvt__fail(KVT_EINVAL, "model synth: NULL output path");
    size_t n = strlen(out_path) + 16;
    char *tmp = kvt__malloc(n);
    synth_writer *w = kvt__calloc(1, sizeof *w);
    if (!tmp || !w) {
        kvt__free(tmp);
        kvt__free(w);
        return kvt__fail(KVT_ENOMEM, "model synth: out of memory");
    }
    snprintf(tmp, n, "%s.tmp.XXXXXX", out_path);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        rc = kvt__fail(-errno, "%s: cannot create a temporary file: %s", tmp, strerror(errno));
        goto done;
    }
    (void)fchmod(fd, 0644);
    w->f = fdopen(fd, "wb");
    if (!w->f) {
        rc = kvt__fail(-errno, "%s: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        goto done;
    }
    w->rng = p->seed;
    write_model(w, p);
    flush_floats(w);
    if (!w->err && fflush(w->f) != 0)
        w->err = errno;
    if (!w->err && fsync(fileno(w->f)) != 0)
        w->err = errno;
    if (fclose(w->f) != 0 && !w->err)
        w->err = errno;
    if (!w->err && rename(tmp, out_path) != 0)
        w->err = errno;
    if (w->err) {
        unlink(tmp);
        rc = kvt__fail(-w->err, "%s: cannot write model: %s", out_path, strerror(w->err));
    }
done:
    kvt__free(tmp);
    kvt__free(w);
    return rc;
}
