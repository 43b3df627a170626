/*
 * bench_util.c: the shared benchmark helpers of bench_util.h. Owns no state
 * (the caller holds the generator's state); never prints or exits.
 */
#include "bench_util.h"

#include <stdlib.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvt_bench_util_median(double *v, long n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

uint32_t kvt_bench_util_rnd32(uint64_t *state)
{
    uint64_t r = *state;
    r ^= r << 13;
    r ^= r >> 7;
    r ^= r << 17;
    *state = r;
    return (uint32_t)(r >> 11);
}

int kvt_bench_util_append(kvt_cache **c, int layers, int32_t kv_dim, int64_t n)
{
    const int64_t chunk = 256;
    float *buf = calloc((size_t)(chunk * kv_dim), sizeof(float));
    if (!buf)
        return KVT_ENOMEM;
    int rc = 0;
    for (int64_t done = 0; done < n && rc == 0; done += chunk) {
        int64_t m = n - done < chunk ? n - done : chunk;
        for (int64_t i = 0; i < m * kv_dim; i += 97)
            buf[i] = (float)(done + i);
        const void *in[2] = {buf, buf};
        for (int l = 0; l < layers && rc == 0; l++)
            rc = kvt_cache_append(c[l], m, in);
    }
    free(buf);
    return rc;
}

int64_t kvt_bench_util_state_tokens(uint64_t bytes, int n_layers, int32_t kv_dim, int64_t round)
{
    uint64_t per_token = (uint64_t)n_layers * 2 * (uint64_t)kv_dim * 4;
    int64_t n = per_token ? (int64_t)(bytes / per_token) : 0;
    if (round < 1)
        round = 1;
    n -= n % round;
    if (n < round)
        n = round;
    return n < 2 ? 2 : n;
}

int kvt_bench_util_entry(int64_t n, int n_layers, int32_t kv_dim, int32_t block, kvt_entry *e, int32_t **tokens_out)
{
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!tok)
        return KVT_ENOMEM;
    for (int64_t i = 0; i <= n; i++)
        tok[i] = (int32_t)((i * 2654435761u) % 32000);
    int rc = kvt_entry_init(e, "", tok, n, n_layers, 0);
    if (rc) {
        free(tok);
        return rc;
    }
    const int64_t step = 256;
    float *k = malloc(sizeof(float) * (size_t)(step * kv_dim)), *v = malloc(sizeof(float) * (size_t)(step * kv_dim));
    if (!k || !v)
        rc = KVT_ENOMEM;
    for (int l = 0; !rc && l < n_layers; l++) {
        rc = kvt_kv_create(kv_dim, block, &e->caches[l]);
        for (int64_t p = 0; !rc && p < n; p += step) {
            int64_t m = n - p < step ? n - p : step;
            for (int64_t i = 0; i < m * kv_dim; i++) {
                k[i] = (float)((p * kv_dim + i + l) % 1000) * 0.001f;
                v[i] = -k[i];
            }
            const void *in[2] = {k, v};
            rc = kvt_cache_append(e->caches[l], m, in);
        }
    }
    free(k);
    free(v);
    if (rc) {
        kvt_entry_clear(e);
        free(tok);
        return rc;
    }
    *tokens_out = tok;
    return 0;
}
