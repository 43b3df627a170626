/*
 * bench_llama2c.c: the single-threaded llama2.c baseline of `kvtier bench
 * engine` (bench_llama2c.h): opening the checkpoint (mmap, as run.c does) and
 * run.c's forward loop (bench_llama2c_loop.h). CMakeLists.txt builds this
 * file alone with -Ofast -march=native, as llama2.c's `make runfast` builds
 * run.c, so the baseline is as fast as run.c is; nothing else is built so.
 */
#include "bench_llama2c_loop.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int kvt_llama2c_open(const char *path, const kvt_model_config *c, kvt_llama2c **out)
{
    *out = NULL;
    kvt_llama2c *p = calloc(1, sizeof *p);
    if (!p)
        return -1;
    p->c = *c;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0)
            close(fd);
        free(p);
        return -1;
    }
    p->map_bytes = (size_t)st.st_size;
    p->map = mmap(NULL, p->map_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p->map == MAP_FAILED) {
        free(p);
        return -1;
    }
    size_t d = (size_t)c->dim, L = (size_t)c->n_layers, h = (size_t)c->hidden_dim, kv = (size_t)c->kv_dim;
    const float *w = (const float *)(const void *)((const char *)p->map + 28);
    p->emb = w, w += (size_t)c->vocab_size * d;
    p->rms_att = w, w += L * d;
    p->wq = w, w += L * d * d;
    p->wk = w, w += L * kv * d;
    p->wv = w, w += L * kv * d;
    p->wo = w, w += L * d * d;
    p->rms_ffn = w, w += L * d;
    p->w1 = w, w += L * h * d;
    p->w2 = w, w += L * d * h;
    p->w3 = w, w += L * h * d;
    p->rms_final = w, w += d;
    w += (size_t)c->seq_len * (size_t)c->head_size; /* freq_cis_real, freq_cis_imag */
    p->wcls = c->shared_classifier ? p->emb : w;
    p->x = calloc(d, sizeof(float)), p->xb = calloc(d, sizeof(float)), p->xb2 = calloc(d, sizeof(float));
    p->q = calloc(d, sizeof(float)), p->att = calloc((size_t)c->n_heads * c->seq_len, sizeof(float));
    p->hb = calloc(h, sizeof(float)), p->hb2 = calloc(h, sizeof(float));
    p->kc = calloc(L * c->seq_len * kv, sizeof(float)), p->vc = calloc(L * c->seq_len * kv, sizeof(float));
    if (!p->x || !p->xb || !p->xb2 || !p->q || !p->att || !p->hb || !p->hb2 || !p->kc || !p->vc) {
        kvt_llama2c_close(p);
        return -1;
    }
    *out = p;
    return 0;
}

void kvt_llama2c_close(kvt_llama2c *p)
{
    if (!p)
        return;
    float *bufs[] = {p->x, p->xb, p->xb2, p->q, p->att, p->hb, p->hb2, p->kc, p->vc};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    if (p->map && p->map != MAP_FAILED)
        munmap(p->map, p->map_bytes);
    free(p);
}

void kvt_llama2c_forward(kvt_llama2c *p, int token, int pos, float *logits) { l2c_forward(p, token, pos, logits); }
