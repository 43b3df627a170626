/*
 * cache.c: the generic side of layer caches (see kvtier/cache.h): dispatch
 * through the ops table, argument and range checks shared by every kind, the
 * dtype helpers, the registry of kinds used by kvt_cache_decode(), the
 * structural validation of untrusted encoded states, and the helpers the
 * built-in kinds use to build and check encoded tensors.
 * It owns no cache state itself and must never touch a kind's private struct:
 * everything kind-specific goes through the kind's ops.
 */
#include "cache_internal.h"
#include "internal.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---- dtypes -------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t size;
} kvt__dtypes[KVT_DTYPE_COUNT] = {
    [KVT_DTYPE_F32] = {"F32", 4}, [KVT_DTYPE_F16] = {"F16", 2}, [KVT_DTYPE_BF16] = {"BF16", 2},
    [KVT_DTYPE_I8] = {"I8", 1},   [KVT_DTYPE_U8] = {"U8", 1},   [KVT_DTYPE_I32] = {"I32", 4},
    [KVT_DTYPE_I64] = {"I64", 8},
};

KVT_API size_t kvt_dtype_size(kvt_dtype dt)
{
    return (unsigned)dt < KVT_DTYPE_COUNT ? kvt__dtypes[dt].size : 0;
}

KVT_API const char *kvt_dtype_name(kvt_dtype dt)
{
    return (unsigned)dt < KVT_DTYPE_COUNT ? kvt__dtypes[dt].name : NULL;
}

KVT_API int kvt_dtype_parse(const char *name, kvt_dtype *out)
{
    if (!name || !out)
        return kvt__fail(KVT_EFORMAT, "kvt_dtype_parse: %s is NULL", !name ? "name" : "out");
    for (int i = 0; i < KVT_DTYPE_COUNT; i++) {
        if (strcmp(name, kvt__dtypes[i].name) == 0) {
            *out = (kvt_dtype)i;
            return 0;
        }
    }
    return kvt__fail(KVT_EFORMAT, "unknown dtype \"%.32s\"", name);
}

/* f32 -> binary16, round to nearest even (F. Giesen's float_to_half_fast3_rtne:
 * subnormals by one float addition that rounds in the FPU's default mode). */
static uint16_t kvt__f32_to_f16(float ff)
{
    const uint32_t f32_inf = 255u << 23, f16_max = (127u + 16u) << 23;
    const uint32_t denorm_magic_u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t f;
    memcpy(&f, &ff, sizeof f);
    uint32_t sign = f & 0x80000000u;
    uint16_t o;
    f ^= sign;
    if (f >= f16_max) {
        o = f > f32_inf ? 0x7e00 : 0x7c00; /* NaN stays NaN, else infinity */
    } else if (f < (113u << 23)) {         /* below 2^-14: subnormal or zero */
        float fv, magic;
        memcpy(&fv, &f, sizeof fv);
        memcpy(&magic, &denorm_magic_u, sizeof magic);
        fv += magic;
        memcpy(&f, &fv, sizeof f);
        o = (uint16_t)(f - denorm_magic_u);
    } else {
        uint32_t mant_odd = (f >> 13) & 1u;
        f += (uint32_t)((15 - 127) * (1 << 23)) + 0xfffu; /* rebias; round half up */
        f += mant_odd;                                    /* ... and ties to even */
        o = (uint16_t)(f >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

static float kvt__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu, x;
    if (e == 0x1f) {
        x = sign | 0x7f800000u | (mant << 13);
    } else if (e) {
        x = sign | ((e + 112u) << 23) | (mant << 13);
    } else {
        float f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        memcpy(&x, &f, sizeof x);
        x |= sign;
    }
    float out;
    memcpy(&out, &x, sizeof out);
    return out;
}

static uint16_t kvt__f32_to_bf16(float ff)
{
    uint32_t x;
    memcpy(&x, &ff, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

KVT_API int kvt_dtype_from_f32(kvt_dtype dt, const float *src, void *dst, size_t n)
{
    if (n && (!src || !dst))
        return kvt__fail(KVT_EINVAL, "kvt_dtype_from_f32: NULL %s", !src ? "src" : "dst");
    uint16_t *h = dst;
    switch (dt) {
    case KVT_DTYPE_F32:
        if (n)
            memcpy(dst, src, n * sizeof(float));
        return 0;
    case KVT_DTYPE_F16:
        for (size_t i = 0; i < n; i++)
            h[i] = kvt__f32_to_f16(src[i]);
        return 0;
    case KVT_DTYPE_BF16:
        for (size_t i = 0; i < n; i++)
            h[i] = kvt__f32_to_bf16(src[i]);
        return 0;
    default:
        return kvt__fail(KVT_EINVAL, "kvt_dtype_from_f32: dtype %s is not F32, F16 or BF16",
                         kvt_dtype_name(dt) ? kvt_dtype_name(dt) : "(unknown)");
    }
}

KVT_API int kvt_dtype_to_f32(kvt_dtype dt, const void *src, float *dst, size_t n)
{
    if (n && (!src || !dst))
        return kvt__fail(KVT_EINVAL, "kvt_dtype_to_f32: NULL %s", !src ? "src" : "dst");
    const uint16_t *h = src;
    switch (dt) {
    case KVT_DTYPE_F32:
        if (n)
            memcpy(dst, src, n * sizeof(float));
        return 0;
    case KVT_DTYPE_F16:
        for (size_t i = 0; i < n; i++)
            dst[i] = kvt__f16_to_f32(h[i]);
        return 0;
    case KVT_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            uint32_t x = (uint32_t)h[i] << 16;
            memcpy(&dst[i], &x, sizeof x);
        }
        return 0;
    default:
        return kvt__fail(KVT_EINVAL, "kvt_dtype_to_f32: dtype %s is not F32, F16 or BF16",
                         kvt_dtype_name(dt) ? kvt_dtype_name(dt) : "(unknown)");
    }
}

/* ---- int8 rows with per-group scales (qkv and int8 rotating) ------------- */

void kvt__q8_quantize_row(const float *x, size_t D, size_t gs, float *scales, int8_t *codes)
{
    for (size_t g = 0; g < D / gs; g++) {
        const float *xg = x + g * gs;
        float amax = 0.0f;
        for (size_t i = 0; i < gs; i++)
            amax = fmaxf(amax, fabsf(xg[i]));
        /* at most FLT_MAX / 128, so every int8 code reads back finite (what
         * decode accepts); an inf among the values clamps to code 127 */
        float scale = fminf(amax / 127.0f, FLT_MAX / 128.0f);
        scales[g] = scale;
        for (size_t i = 0; i < gs; i++) {
            float r = scale > 0.0f ? roundf(xg[i] / scale) : 0.0f;
            r = fminf(fmaxf(r, -127.0f), 127.0f);
            codes[g * gs + i] = (int8_t)r;
        }
    }
}

void kvt__q8_dequantize_row(const float *scales, const int8_t *codes, size_t D, size_t gs, float *x)
{
    for (size_t i = 0; i < D; i++)
        x[i] = (float)codes[i] * scales[i / gs];
}

int kvt__q8_check_scales(const kvt_tensor *t, const char *kind)
{
    const char *s = t->data;
    for (size_t i = 0; i < t->bytes / sizeof(float); i++) {
        float x;
        memcpy(&x, s + i * sizeof x, sizeof x); /* the data may be unaligned */
        if (!(x >= 0.0f) || !(x <= FLT_MAX / 128.0f)) /* code -128 times it must be finite */
            return kvt__fail(KVT_EFORMAT,
                             "%s state: tensor \"%s\" holds scale %g at %zu (must be finite, >= 0 and at most "
                             "FLT_MAX / 128, so that every code reads back finite)",
                             kind, t->name, (double)x, i);
    }
    return 0;
}

/* ---- registry ------------------------------------------------------------ */

#define KVT__KINDS_MAX 32

static pthread_mutex_t kvt__kinds_lock = PTHREAD_MUTEX_INITIALIZER;
static const kvt_cache_ops *kvt__kinds[KVT__KINDS_MAX];
static int kvt__n_kinds; /* backend kinds; the built-ins are not stored */

static const kvt_cache_ops *const kvt__builtin_kinds[] = {
    &kvt__kv_ops,
    &kvt__rotating_ops,
    &kvt__recurrent_ops,
    &kvt__qkv_ops,
    &kvt__qkvc_ops,
};
#define KVT__N_BUILTIN ((int)(sizeof kvt__builtin_kinds / sizeof kvt__builtin_kinds[0]))

static const kvt_cache_ops *kvt__find_kind_locked(const char *kind)
{
    for (int i = 0; i < KVT__N_BUILTIN; i++)
        if (strcmp(kvt__builtin_kinds[i]->kind, kind) == 0)
            return kvt__builtin_kinds[i];
    for (int i = 0; i < kvt__n_kinds; i++)
        if (strcmp(kvt__kinds[i]->kind, kind) == 0)
            return kvt__kinds[i];
    return NULL;
}

KVT_API int kvt_cache_register_kind(const kvt_cache_ops *ops)
{
    if (!ops || !ops->kind)
        return kvt__fail(KVT_EINVAL, "kvt_cache_register_kind: %s is NULL", !ops ? "ops" : "ops->kind");
    size_t len = strnlen(ops->kind, 32);
    if (len == 0 || len > 31)
        return kvt__fail(KVT_EINVAL, "kvt_cache_register_kind: kind name must be 1 to 31 bytes");
    const char *missing = !ops->private_bytes ? "private_bytes"
                          : !ops->foreach_buf ? "foreach_buf"
                          : !ops->range       ? "range"
                          : !ops->trim        ? "trim"
                          : !ops->clone       ? "clone"
                          : !ops->append      ? "append"
                          : !ops->destroy     ? "destroy"
                          : !ops->encode      ? "encode"
                          : !ops->decode      ? "decode"
                                              : NULL;
    if (missing)
        return kvt__fail(KVT_EINVAL, "kvt_cache_register_kind: kind \"%s\" has no %s op", ops->kind, missing);
    int rc = 0;
    pthread_mutex_lock(&kvt__kinds_lock);
    if (kvt__find_kind_locked(ops->kind))
        rc = kvt__fail(KVT_EBUSY, "kvt_cache_register_kind: kind \"%s\" is already registered", ops->kind);
    else if (kvt__n_kinds + KVT__N_BUILTIN >= KVT__KINDS_MAX)
        rc = kvt__fail(KVT_ENOMEM, "kvt_cache_register_kind: more than %d kinds", KVT__KINDS_MAX);
    else
        kvt__kinds[kvt__n_kinds++] = ops;
    pthread_mutex_unlock(&kvt__kinds_lock);
    return rc;
}

/* ---- generic calls ------------------------------------------------------- */

KVT_API const char *kvt_cache_kind(const kvt_cache *c) { return c ? c->ops->kind : NULL; }

static void kvt__add_buf_bytes(kvt_buf *b, void *ctx) { *(size_t *)ctx += kvt_buf_bytes(b); }

KVT_API size_t kvt_cache_bytes(const kvt_cache *c)
{
    if (!c)
        return 0;
    size_t total = c->ops->private_bytes(c);
    c->ops->foreach_buf(c, kvt__add_buf_bytes, &total);
    return total;
}

KVT_API void kvt_cache_range(const kvt_cache *c, int64_t *min_offset, int64_t *offset)
{
    int64_t lo = 0, hi = 0;
    if (c)
        c->ops->range(c, &lo, &hi);
    if (min_offset)
        *min_offset = lo;
    if (offset)
        *offset = hi;
}

KVT_API int64_t kvt_cache_offset(const kvt_cache *c)
{
    int64_t off;
    kvt_cache_range(c, NULL, &off);
    return off;
}

KVT_API int64_t kvt_cache_trim_granule(const kvt_cache *c)
{
    return c && c->ops == &kvt__qkvc_ops ? kvt__qkvc_block_tokens(c) : 0;
}

/* length is reachable: inside [lo, hi], or a multiple of the kind's granule
 * below lo (a qkvc cache drops whole sealed blocks) */
static int reachable(const kvt_cache *c, int64_t length, int64_t lo, int64_t hi)
{
    if (length >= lo && length <= hi)
        return 1;
    int64_t g = kvt_cache_trim_granule(c);
    return g > 0 && length >= 0 && length < lo && length % g == 0;
}

KVT_API int kvt_cache_can_trim(const kvt_cache *c, int64_t length)
{
    if (!c)
        return 0;
    int64_t lo, hi;
    c->ops->range(c, &lo, &hi);
    return reachable(c, length, lo, hi);
}

KVT_API int kvt_cache_trim(kvt_cache *c, int64_t length)
{
    if (!c)
        return kvt__fail(KVT_EINVAL, "kvt_cache_trim: cache is NULL");
    int64_t lo, hi;
    c->ops->range(c, &lo, &hi);
    if (!reachable(c, length, lo, hi)) {
        int64_t g = kvt_cache_trim_granule(c);
        char below[80] = "";
        if (g > 0)
            snprintf(below, sizeof below, " or a multiple of %lld below it", (long long)g);
        return kvt__fail(KVT_ERANGE, "kvt_cache_trim: %s cache cannot be cut to %lld tokens (range [%lld, %lld]%s)",
                         c->ops->kind, (long long)length, (long long)lo, (long long)hi, below);
    }
    if (length == hi)
        return 0;
    return c->ops->trim(c, length);
}

KVT_API int kvt_cache_clone(const kvt_cache *c, kvt_cache **out)
{
    if (!c || !out)
        return kvt__fail(KVT_EINVAL, "kvt_cache_clone: %s is NULL", !c ? "cache" : "out");
    *out = NULL;
    return c->ops->clone(c, out);
}

KVT_API int kvt_cache_append(kvt_cache *c, int64_t n_tokens, const void *const *inputs)
{
    if (!c)
        return kvt__fail(KVT_EINVAL, "kvt_cache_append: cache is NULL");
    if (n_tokens < 0)
        return kvt__fail(KVT_EINVAL, "kvt_cache_append: n_tokens is %lld", (long long)n_tokens);
    if (n_tokens == 0)
        return 0;
    if (!inputs)
        return kvt__fail(KVT_EINVAL, "kvt_cache_append: inputs is NULL");
    return c->ops->append(c, n_tokens, inputs);
}

KVT_API void kvt_cache_destroy(kvt_cache *c)
{
    if (c)
        c->ops->destroy(c);
}

KVT_API int kvt_cache_encode(const kvt_cache *c, kvt_cache_state *out)
{
    if (!c || !out)
        return kvt__fail(KVT_EINVAL, "kvt_cache_encode: %s is NULL", !c ? "cache" : "out");
    memset(out, 0, sizeof *out);
    int rc = c->ops->encode(c, out);
    if (rc)
        kvt_cache_state_clear(out);
    return rc;
}

KVT_API void kvt_cache_state_clear(kvt_cache_state *st)
{
    if (!st)
        return;
    if (st->tensors) {
        for (int32_t i = 0; i < st->n_tensors; i++)
            kvt_buf_release(st->tensors[i].owner);
        kvt__free(st->tensors);
    }
    memset(st, 0, sizeof *st);
}

/* Structural checks of one untrusted tensor: name, dtype, dims, byte size,
 * data inside its owner. */
static int kvt__check_tensor(const kvt_cache_state *st, int32_t i)
{
    const kvt_tensor *t = &st->tensors[i];
    if (!memchr(t->name, '\0', sizeof t->name))
        return kvt__fail(KVT_EFORMAT, "%s state: tensor %d has an unterminated name", st->kind, (int)i);
    if (kvt_dtype_size(t->dtype) == 0)
        return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" has unknown dtype %d", st->kind, t->name,
                         (int)t->dtype);
    if (t->ndim < 1 || t->ndim > KVT_TENSOR_MAX_DIMS)
        return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" has %d dims (1 to %d allowed)", st->kind, t->name,
                         (int)t->ndim, KVT_TENSOR_MAX_DIMS);
    uint64_t elems = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0 || t->shape[d] > (int64_t)1 << 40)
            return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" dim %d is %lld", st->kind, t->name, d,
                             (long long)t->shape[d]);
        if (t->shape[d] && elems > (UINT64_MAX >> 4) / (uint64_t)t->shape[d])
            return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" is too large", st->kind, t->name);
        elems *= (uint64_t)t->shape[d];
    }
    uint64_t want = elems * kvt_dtype_size(t->dtype);
    if (want != (uint64_t)t->bytes)
        return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" has %zu bytes, its shape and dtype need %llu",
                         st->kind, t->name, t->bytes, (unsigned long long)want);
    if (t->bytes && !t->data)
        return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" has no data", st->kind, t->name);
    if (t->owner && t->bytes) {
        const char *lo = kvt_buf_data(t->owner), *p = t->data;
        size_t ob = kvt_buf_bytes(t->owner);
        if (p < lo || (size_t)(p - lo) > ob || t->bytes > ob - (size_t)(p - lo))
            return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" data lies outside its owner buffer", st->kind,
                             t->name);
    }
    return 0;
}

KVT_API int kvt_cache_decode(const kvt_cache_state *st, kvt_cache **out)
{
    if (!st || !out)
        return kvt__fail(KVT_EINVAL, "kvt_cache_decode: %s is NULL", !st ? "state" : "out");
    *out = NULL;
    if (!memchr(st->kind, '\0', sizeof st->kind))
        return kvt__fail(KVT_EFORMAT, "cache state: kind name is not terminated");
    pthread_mutex_lock(&kvt__kinds_lock);
    const kvt_cache_ops *ops = kvt__find_kind_locked(st->kind);
    pthread_mutex_unlock(&kvt__kinds_lock);
    if (!ops)
        return kvt__fail(KVT_EUNSUPPORTED, "cache state: unknown kind \"%s\"", st->kind);
    if (st->offset < 0 || st->min_offset < 0 || st->min_offset > st->offset)
        return kvt__fail(KVT_EFORMAT, "%s state: bad range [%lld, %lld]", st->kind, (long long)st->min_offset,
                         (long long)st->offset);
    if (st->n_params < 0 || st->n_params > KVT_CACHE_PARAMS_MAX)
        return kvt__fail(KVT_EFORMAT, "%s state: %d params (0 to %d allowed)", st->kind, (int)st->n_params,
                         KVT_CACHE_PARAMS_MAX);
    if (st->n_tensors < 0 || (st->n_tensors > 0 && !st->tensors))
        return kvt__fail(KVT_EFORMAT, "%s state: %d tensors%s", st->kind, (int)st->n_tensors,
                         st->n_tensors < 0 ? "" : " but no tensor array");
    for (int32_t i = 0; i < st->n_tensors; i++) {
        int rc = kvt__check_tensor(st, i);
        if (rc)
            return rc;
    }
    return ops->decode(st, out);
}

KVT_API int kvt_caches_clone(kvt_cache *const *caches, int n, kvt_cache **out)
{
    if (n < 0 || (n > 0 && (!caches || !out)))
        return kvt__fail(KVT_EINVAL, "kvt_caches_clone: bad arguments (n = %d)", n);
    for (int i = 0; i < n; i++)
        out[i] = NULL;
    for (int i = 0; i < n; i++) {
        int rc = kvt_cache_clone(caches[i], &out[i]);
        if (rc) {
            kvt_caches_destroy(out, i);
            return rc;
        }
    }
    return 0;
}

KVT_API void kvt_caches_destroy(kvt_cache **caches, int n)
{
    if (!caches)
        return;
    for (int i = 0; i < n; i++) {
        kvt_cache_destroy(caches[i]);
        caches[i] = NULL;
    }
}

/* ---- helpers for the kinds (cache_internal.h) ------------------------------ */

int kvt__state_begin(kvt_cache_state *st, const char *kind, int64_t offset, int64_t min_offset,
                     int32_t n_params, const int64_t *params, int32_t n_tensors)
{
    snprintf(st->kind, sizeof st->kind, "%s", kind);
    st->offset = offset;
    st->min_offset = min_offset;
    st->n_params = n_params;
    for (int32_t i = 0; i < n_params; i++)
        st->params[i] = params[i];
    st->n_tensors = 0;
    st->tensors = NULL;
    if (n_tensors > 0) {
        st->tensors = kvt__calloc((size_t)n_tensors, sizeof *st->tensors);
        if (!st->tensors)
            return kvt__fail(KVT_ENOMEM, "%s encode: cannot allocate %d tensors", kind, (int)n_tensors);
    }
    st->n_tensors = n_tensors;
    for (int32_t i = 0; i < n_tensors; i++)
        st->tensors[i].tok_begin = st->tensors[i].tok_end = -1;
    return 0;
}

void kvt__tensor_set(kvt_tensor *t, const char *name, kvt_dtype dt, int ndim, const int64_t *shape,
                     const void *data, size_t bytes, kvt_buf *owner, int64_t tok_begin, int64_t tok_end)
{
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dt;
    t->ndim = ndim;
    for (int d = 0; d < KVT_TENSOR_MAX_DIMS; d++)
        t->shape[d] = d < ndim ? shape[d] : 0;
    t->data = data;
    t->bytes = bytes;
    t->owner = kvt_buf_retain(owner);
    t->tok_begin = tok_begin;
    t->tok_end = tok_end;
}

int kvt__tensor_expect(const kvt_cache_state *st, int32_t i, const char *name, kvt_dtype dt, int ndim,
                       const int64_t *shape)
{
    const kvt_tensor *t = &st->tensors[i];
    if (strcmp(t->name, name) != 0)
        return kvt__fail(KVT_EFORMAT, "%s state: tensor %d is named \"%s\", expected \"%s\"", st->kind, (int)i,
                         t->name, name);
    if (t->dtype != dt)
        return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" has dtype %s, expected %s", st->kind, name,
                         kvt_dtype_name(t->dtype), kvt_dtype_name(dt));
    char got[96] = "", want[96] = "";
    int bad = t->ndim != ndim;
    for (int d = 0; d < ndim && !bad; d++)
        bad = t->shape[d] != shape[d];
    if (!bad)
        return 0;
    for (int d = 0, n = 0; d < t->ndim && n < (int)sizeof got; d++)
        n += snprintf(got + n, sizeof got - (size_t)n, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    for (int d = 0, n = 0; d < ndim && n < (int)sizeof want; d++)
        n += snprintf(want + n, sizeof want - (size_t)n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    return kvt__fail(KVT_EFORMAT, "%s state: tensor \"%s\" has shape (%s), expected (%s)", st->kind, name, got,
                     want);
}

bool kvt__tensor_is_whole_owner(const kvt_tensor *t)
{
    return t->owner && t->data == kvt_buf_data(t->owner) && t->bytes == kvt_buf_bytes(t->owner) &&
           (uintptr_t)t->data % kvt_dtype_size(t->dtype) == 0;
}

int kvt__tensor_adopt(const kvt_tensor *t, kvt_buf **out, bool *heap)
{
    *heap = !kvt__tensor_is_whole_owner(t);
    if (!*heap) {
        *out = kvt_buf_retain(t->owner);
        return 0;
    }
    return kvt__buf_copy(t->data, t->bytes, true, out);
}

int kvt__params_expect(const kvt_cache_state *st, int32_t n, const char *const *names, const int64_t *lo,
                       const int64_t *hi)
{
    if (st->n_params != n)
        return kvt__fail(KVT_EFORMAT, "%s state: %d params, expected %d", st->kind, (int)st->n_params, (int)n);
    for (int32_t i = 0; i < n; i++)
        if (st->params[i] < lo[i] || st->params[i] > hi[i])
            return kvt__fail(KVT_EFORMAT, "%s state: param %s = %lld is outside [%lld, %lld]", st->kind, names[i],
                             (long long)st->params[i], (long long)lo[i], (long long)hi[i]);
    return 0;
}

int kvt__buf_copy(const void *src, size_t bytes, bool count, kvt_buf **out)
{
    int rc = kvt_buf_new(bytes, out);
    if (rc)
        return rc;
    if (bytes)
        memcpy(kvt_buf_data(*out), src, bytes);
    if (count)
        kvt_buf_count_copy(bytes);
    return 0;
}
