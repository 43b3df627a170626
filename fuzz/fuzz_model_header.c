/*
 * fuzz_model_header.c: kvt_model_load (engine/model.c) on arbitrary
 * checkpoint files: the 7-int llama2.c header, the exact size check, the
 * KVTX trailer (version, window, layer kinds, recurrent weights). The file
 * is an in-memory file, so the loader's own open/fstat/mmap path runs. A
 * model it accepts must make fresh caches of its layers' kinds and run a
 * short prefill and one decode step without reading outside the mapping
 * (the weights are whatever the input holds: NaN logits are fine, a
 * crash is not).
 */
#include "fuzz_util.h"

#include "model.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    int fd = fz_memfile(data, size, path);
    if (fd < 0)
        return 0;
    kvt_model *m = NULL;
    int rc = kvt_model_load(path, &m);
    close(fd);
    if (rc) {
        FZ_CHECK(!m, "a refused checkpoint gave a model");
        FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED || rc == KVT_ENOMEM || rc == KVT_EIO,
                 "load returned %d: %s", rc, kvt_last_error());
        return 0;
    }
    const kvt_model_config *c = kvt_model_get_config(m);
    FZ_CHECK(c->dim == c->n_heads * c->head_size && c->kv_dim == c->n_kv_heads * c->head_size,
             "derived shape of dim %d heads %d/%d", c->dim, c->n_heads, c->n_kv_heads);
    (void)kvt_model_fingerprint(m);
    (void)kvt_model_kv_bytes_per_token(m);
    (void)kvt_model_fixed_state_bytes(m);
    kvt_cache **caches = calloc((size_t)c->n_layers, sizeof *caches);
    if (caches && !kvt_model_new_caches(m, 4, caches)) {
        for (int32_t l = 0; l < c->n_layers; l++) {
            const char *want = c->layer_kind[l] == KVT_LAYER_WINDOW      ? "rotating"
                               : c->layer_kind[l] == KVT_LAYER_RECURRENT ? "recurrent"
                                                                         : "kv";
            FZ_CHECK(!strcmp(kvt_cache_kind(caches[l]), want), "layer %d cache %s, want %s", (int)l,
                     kvt_cache_kind(caches[l]), want);
        }
        float *logits = malloc(sizeof(float) * (size_t)c->vocab_size);
        int32_t toks[2] = {0, c->vocab_size - 1};
        int64_t n = c->seq_len >= 3 ? 2 : 1;
        rc = kvt_model_prefill(m, caches, toks, n, logits);
        FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "prefill of %lld tokens failed: %s", (long long)n, kvt_last_error());
        if (!rc && c->seq_len > n) {
            rc = kvt_model_decode(m, caches, toks[1], logits);
            FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "decode failed: %s", kvt_last_error());
        }
        int32_t bad = c->vocab_size;
        rc = kvt_model_decode(m, caches, bad, logits);
        FZ_CHECK(rc == KVT_EINVAL || rc == KVT_ELIMIT, "token %d accepted (%d)", bad, rc);
        free(logits);
        kvt_caches_destroy(caches, c->n_layers);
    }
    free(caches);
    kvt_model_free(m);
    return 0;
}
