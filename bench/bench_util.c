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
