/*
 * default_model.c: the built-in default model (a synthetic checkpoint of
 * about 85M parameters) and its byte-level tokenizer, created on first use
 * in the user's cache directory. It owns only the file names and the shape;
 * the files themselves come from kvt_model_synth() and
 * kvt_tokenizer_write_default(), both of which write atomically, so racing
 * processes are safe. It must never hand back a path to a partial file.
 */
#include "model.h"
#include "tokenizer.h"

#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEFAULT_SEED 20260101ULL

static float g_row_scale[KVT_DEFAULT_VOCAB]; /* classifier row factors, set once */
static pthread_once_t g_scale_once = PTHREAD_ONCE_INIT;

static void fill_row_scale(void)
{
    for (int v = 0; v < KVT_DEFAULT_VOCAB; v++) {
        int b = v - KVT_TOKEN_BYTE0;
        g_row_scale[v] = (b >= 32 && b < 127) || b == '\n' ? 1.0f : 0.25f;
    }
}

KVT_API void kvt_default_model_params(kvt_synth_params *p)
{
    memset(p, 0, sizeof *p);
    p->dim = 768;
    p->hidden_dim = 2048;
    p->n_layers = 12;
    p->n_heads = 12;
    p->n_kv_heads = 12;
    p->vocab_size = KVT_DEFAULT_VOCAB;
    p->seq_len = 4096;
    p->seed = DEFAULT_SEED;
    /* A classifier of its own (random, fan-in scaled): tied to the random
     * embedding, greedy text repeats one piece. Rows of tokens that print
     * nothing (specials, control and non-ASCII bytes) are weighted down, so
     * what greedy decoding picks mostly shows. */
    pthread_once(&g_scale_once, fill_row_scale);
    p->separate_classifier = 1;
    p->wcls_row_scale = g_row_scale;
}

/* mkdir -p for the cache directory (the path is ours, short). */
static int make_dirs(char *dir)
{
    for (char *s = dir + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        int r = mkdir(dir, 0755);
        *s = '/';
        if (r != 0 && errno != EEXIST)
            return kvt__fail(-errno, "%s: cannot create directory: %s", dir, strerror(errno));
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return kvt__fail(-errno, "%s: cannot create directory: %s", dir, strerror(errno));
    return 0;
}

KVT_API int kvt_default_model(char *model_path, size_t cap, char *tokenizer_path, size_t tok_cap)
{
    if (!model_path || !tokenizer_path)
        return kvt__fail(KVT_EINVAL, "kvt_default_model: NULL path buffer");
    char dir[4096];
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (xdg && xdg[0] == '/')
        n = snprintf(dir, sizeof dir, "%s/kvtier", xdg);
    else if (home && home[0])
        n = snprintf(dir, sizeof dir, "%s/.cache/kvtier", home);
    else
        return kvt__fail(KVT_ENOTFOUND, "default model: neither XDG_CACHE_HOME nor HOME is set; pass --model");
    if (n < 0 || (size_t)n >= sizeof dir)
        return kvt__fail(KVT_ERANGE, "default model: cache directory path too long");
    kvt_synth_params p;
    kvt_default_model_params(&p);
    /* The name carries the shape, the seed and the classifier ("-wcls" when
     * separate), so a changed default never reuses an old file. */
    int nm = snprintf(model_path, cap, "%s/default-d%d-h%d-l%d-nh%d-kv%d-v%d-s%d-seed%llu%s.bin", dir, p.dim,
                      p.hidden_dim, p.n_layers, p.n_heads, p.n_kv_heads, p.vocab_size, p.seq_len,
                      (unsigned long long)p.seed, p.separate_classifier ? "-wcls" : "");
    int nt = snprintf(tokenizer_path, tok_cap, "%s/default-tokenizer-v%d.bin", dir, p.vocab_size);
    if (nm < 0 || (size_t)nm >= cap || nt < 0 || (size_t)nt >= tok_cap)
        return kvt__fail(KVT_ERANGE, "default model: path buffer too small for %s", dir);
    int rc = make_dirs(dir);
    if (rc != 0)
        return rc;
    if (access(model_path, R_OK) != 0) {
        fprintf(stderr, "kvtier: creating the built-in default model (%d layers, dim %d, random weights) in %s\n",
                p.n_layers, p.dim, model_path);
        if ((rc = kvt_model_synth(&p, model_path)) != 0)
            return rc;
    }
    if (access(tokenizer_path, R_OK) != 0 && (rc = kvt_tokenizer_write_default(tokenizer_path, p.vocab_size)) != 0)
        return rc;
    return 0;
}
