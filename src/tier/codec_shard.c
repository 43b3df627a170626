/*
 * codec_shard.c: safetensors shard images for the codec (codec.h): the JSON
 * header (built, and parsed with every field validated before use: bounded
 * length, offsets inside the payload, sorted, contiguous, byte counts
 * matching dtype x shape, totals matching the size), the payload checksums
 * (XXH3-128 and SHA-256), whole images in memory, and base64 tokens. It does
 * no file I/O (src/ssd/store_format.c writes and reads shard files with
 * these) and never trusts a header field it has not checked.
 */
#include "codec.h"

#include "internal.h"

#include <errno.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* ---- tokens -------------------------------------------------------------- */

char *kvt__tokens_b64(const int32_t *tokens, int64_t n)
{
    size_t raw = (size_t)n * 4;
    uint8_t *le = kvt__malloc(raw ? raw : 1);
    char *out = kvt__malloc(4 * ((raw + 2) / 3) + 1);
    if (!le || !out) {
        kvt__free(le);
        kvt__free(out);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)tokens[i];
        le[4 * i] = (uint8_t)v;
        le[4 * i + 1] = (uint8_t)(v >> 8);
        le[4 * i + 2] = (uint8_t)(v >> 16);
        le[4 * i + 3] = (uint8_t)(v >> 24);
    }
    int len = raw ? EVP_EncodeBlock((unsigned char *)out, le, (int)raw) : 0;
    out[len] = '\0';
    kvt__free(le);
    return out;
}

int kvt__tokens_unb64(const char *s, int32_t **out, int64_t *n)
{
    *out = NULL;
    *n = 0;
    size_t len = strlen(s);
    if (len == 0)
        return 0;
    if (len % 4 || len > (size_t)1 << 30)
        return kvt__fail(KVT_EFORMAT, "tokens: base64 length %zu is not a multiple of 4", len);
    size_t pad = (s[len - 1] == '=') + (len > 1 && s[len - 2] == '=');
    size_t raw = len / 4 * 3 - pad;
    if (raw % 4)
        return kvt__fail(KVT_EFORMAT, "tokens: %zu bytes is not a whole number of int32", raw);
    uint8_t *buf = kvt__malloc(len / 4 * 3 + 1);
    int32_t *tok = kvt__malloc(raw ? raw : 1);
    if (!buf || !tok) {
        kvt__free(buf);
        kvt__free(tok);
        return kvt__fail(KVT_ENOMEM, "tokens: cannot allocate %zu bytes", raw);
    }
    int got = EVP_DecodeBlock(buf, (const unsigned char *)s, (int)len);
    if (got < 0 || (size_t)got != len / 4 * 3) {
        kvt__free(buf);
        kvt__free(tok);
        return kvt__fail(KVT_EFORMAT, "tokens: invalid base64");
    }
    for (size_t i = 0; i < raw / 4; i++)
        tok[i] = (int32_t)((uint32_t)buf[4 * i] | (uint32_t)buf[4 * i + 1] << 8 |
                           (uint32_t)buf[4 * i + 2] << 16 | (uint32_t)buf[4 * i + 3] << 24);
    kvt__free(buf);
    *out = tok;
    *n = (int64_t)(raw / 4);
    return 0;
}

/* ---- building ------------------------------------------------------------ */

/* Orders tensors so that wider dtypes come first (keeps every tensor aligned to
 * its element size when the payload starts 64-byte aligned). */
int32_t *kvt__shard_order(const kvt__st_out *t, int32_t n)
{
    int32_t *ord = kvt__malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!ord)
        return NULL;
    int32_t k = 0;
    for (size_t w = 8; w >= 1; w /= 2)
        for (int32_t i = 0; i < n; i++)
            if (kvt_dtype_size(t[i].dtype) == w)
                ord[k++] = i;
    return ord;
}

char *kvt__shard_header(json_t *meta, const kvt__st_out *t, const int32_t *ord, int32_t n, const char *sha_hex,
                        const char *xxh_hex, uint64_t payload, size_t *len_out)
{
    char pb[32];
    snprintf(pb, sizeof pb, "%llu", (unsigned long long)payload);
    if (json_object_set_new(meta, "sha256", json_string(sha_hex)) ||
        json_object_set_new(meta, "xxh3", json_string(xxh_hex)) ||
        json_object_set_new(meta, "payload_bytes", json_string(pb)) ||
        json_object_set_new(meta, "format", json_string(KVT__SHARD_FORMAT)) ||
        json_object_set_new(meta, "version", json_string(KVT__SHARD_VERSION)))
        return NULL;
    json_t *root = json_object();
    if (!root || json_object_set(root, "__metadata__", meta)) {
        json_decref(root);
        return NULL;
    }
    uint64_t off = 0;
    for (int32_t k = 0; k < n; k++) {
        const kvt__st_out *x = &t[ord[k]];
        json_t *shape = json_array();
        for (int32_t d = 0; shape && d < x->ndim; d++)
            json_array_append_new(shape, json_integer(x->shape[d]));
        json_t *desc = json_pack("{s:s, s:o, s:[I,I]}", "dtype", kvt_dtype_name(x->dtype), "shape",
                                 shape, "data_offsets", (json_int_t)off, (json_int_t)(off + x->bytes));
        if (!desc || json_object_set_new(root, x->name, desc)) {
            json_decref(root);
            return NULL;
        }
        off += x->bytes;
    }
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!s)
        return NULL;
    size_t len = strlen(s);
    size_t padded = ((8 + len + KVT__PAYLOAD_ALIGN - 1) / KVT__PAYLOAD_ALIGN) * KVT__PAYLOAD_ALIGN - 8;
    char *h = kvt__malloc(padded + 1);
    if (h) {
        memcpy(h, s, len);
        memset(h + len, ' ', padded - len); /* safetensors allows trailing spaces */
        h[padded] = '\0';
        *len_out = padded;
    }
    free(s); /* jansson's allocator */
    return h;
}

/* ---- parsing ------------------------------------------------------------- */

void kvt__shard_free(kvt__shard *sh)
{
    if (!sh)
        return;
    json_decref(sh->root);
    kvt__free(sh->t);
    memset(sh, 0, sizeof *sh);
}

const char *kvt__meta_str(const kvt__shard *sh, const char *key)
{
    return json_string_value(json_object_get(sh->meta, key));
}

int kvt__shard_refuse(int *reason, int r, int code, const char *path, const char *what)
{
    *reason = r;
    return kvt__fail(code, "%s: refused (%s): %s", path, kvt_store_refusal_name((kvt_store_refusal)r),
                     what);
}

static int cmp_begin(const void *a, const void *b)
{
    const kvt__st_in *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

int kvt__shard_check_len(uint64_t hlen, uint64_t file_bytes, const char *path, int *reason)
{
    char msg[160];
    if (hlen > KVT_STORE_MAX_HEADER) {
        snprintf(msg, sizeof msg, "header length %llu over the bound %u", (unsigned long long)hlen,
                 KVT_STORE_MAX_HEADER);
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_HEADER_BOUND, KVT_EFORMAT, path, msg);
    }
    if (hlen < 2 || 8 + hlen > file_bytes) {
        snprintf(msg, sizeof msg, "header length %llu, file %llu bytes", (unsigned long long)hlen,
                 (unsigned long long)file_bytes);
        return kvt__shard_refuse(reason, hlen < 2 ? KVT_STORE_REFUSED_MALFORMED : KVT_STORE_REFUSED_TRUNCATED,
                      KVT_EFORMAT, path, msg);
    }
    return 0;
}

int kvt__shard_parse_header(const char *h, uint64_t hlen, uint64_t file_bytes, const char *path, kvt__shard *out,
                            int *reason)
{
    memset(out, 0, sizeof *out);
    char msg[160];
    json_error_t jerr;
    json_t *root = json_loadb(h, hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        snprintf(msg, sizeof msg, "header is not a JSON object (%.100s)", root ? "not an object" : jerr.text);
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_MALFORMED, KVT_EFORMAT, path, msg);
    }
    out->root = root;
    out->header_len = hlen;
    out->payload_off = 8 + hlen;
    out->file_bytes = file_bytes;
    out->meta = json_object_get(root, "__metadata__");
    const char *bad = NULL;
    if (!json_is_object(out->meta))
        bad = "no __metadata__ object";
    const char *k;
    json_t *v;
    if (!bad)
        json_object_foreach(out->meta, k, v) if (!json_is_string(v)) bad = "a __metadata__ value is not a string";
    const char *fmt = bad ? NULL : kvt__meta_str(out, "format");
    const char *ver = bad ? NULL : kvt__meta_str(out, "version");
    const char *sha = bad ? NULL : kvt__meta_str(out, "sha256");
    const char *pbs = bad ? NULL : kvt__meta_str(out, "payload_bytes");
    const char *xxh = bad ? NULL : kvt__meta_str(out, "xxh3");
    int v1 = ver && !strcmp(ver, KVT__SHARD_VERSION_V1);
    if (!bad && (!fmt || strcmp(fmt, KVT__SHARD_FORMAT) || !ver || (strcmp(ver, KVT__SHARD_VERSION) && !v1)))
        bad = "not a kvtier shard of version " KVT__SHARD_VERSION_V1 " or " KVT__SHARD_VERSION;
    if (!bad && (!sha || kvt__unhex(sha, out->sha, 32)))
        bad = "sha256 is not 64 hex digits";
    if (!bad && !v1 && (!xxh || kvt__unhex(xxh, out->xxh, 16)))
        bad = "xxh3 is not 32 hex digits";
    if (!bad)
        out->has_xxh = !v1;
    char *endp = NULL;
    unsigned long long pb = 0;
    if (!bad) {
        errno = 0;
        pb = pbs ? strtoull(pbs, &endp, 10) : 0;
        if (!pbs || !*pbs || *endp || errno)
            bad = "payload_bytes is not a number";
    }
    if (bad) {
        kvt__shard_free(out);
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_MALFORMED, KVT_EFORMAT, path, bad);
    }
    out->payload_bytes = pb;
    if (out->payload_off + pb > file_bytes || out->payload_off + pb < pb) {
        snprintf(msg, sizeof msg, "file is %llu bytes, header declares %llu", (unsigned long long)file_bytes,
                 (unsigned long long)(out->payload_off + pb));
        kvt__shard_free(out);
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_TRUNCATED, KVT_EFORMAT, path, msg);
    }
    if (out->payload_off + pb != file_bytes) {
        snprintf(msg, sizeof msg, "file is %llu bytes, longer than the declared %llu",
                 (unsigned long long)file_bytes, (unsigned long long)(out->payload_off + pb));
        kvt__shard_free(out);
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_OFFSETS, KVT_EFORMAT, path, msg);
    }
    size_t nt = json_object_size(root) - 1;
    out->t = kvt__calloc(nt ? nt : 1, sizeof(kvt__st_in));
    if (!out->t) {
        kvt__shard_free(out);
        return kvt__fail(KVT_ENOMEM, "%s: cannot allocate %zu tensor descriptors", path, nt);
    }
    int r = KVT_STORE_REFUSED_MALFORMED;
    json_object_foreach(root, k, v)
    {
        if (!strcmp(k, "__metadata__"))
            continue;
        kvt__st_in *x = &out->t[out->n];
        x->name = k;
        json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
        json_t *offs = json_object_get(v, "data_offsets");
        if (!json_is_object(v) || !json_is_string(dt) || kvt_dtype_parse(json_string_value(dt), &x->dtype)) {
            bad = "a tensor has no known dtype";
            break;
        }
        if (!json_is_array(shape) || json_array_size(shape) > KVT_TENSOR_MAX_DIMS) {
            bad = "a tensor shape is not an array of at most 4 dims";
            break;
        }
        uint64_t elems = 1;
        x->ndim = (int32_t)json_array_size(shape);
        for (int32_t d = 0; d < x->ndim; d++) {
            json_t *e = json_array_get(shape, (size_t)d);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > ((json_int_t)1 << 40)) {
                bad = "a shape dimension is not a non-negative integer";
                break;
            }
            x->shape[d] = json_integer_value(e);
            if (x->shape[d] && elems > UINT64_MAX / (uint64_t)x->shape[d] / 8) {
                bad = "a tensor shape overflows";
                break;
            }
            elems *= (uint64_t)x->shape[d];
        }
        if (bad)
            break;
        if (!json_is_array(offs) || json_array_size(offs) != 2 || !json_is_integer(json_array_get(offs, 0)) ||
            !json_is_integer(json_array_get(offs, 1))) {
            bad = "data_offsets is not [begin, end]";
            break;
        }
        json_int_t b = json_integer_value(json_array_get(offs, 0)), e = json_integer_value(json_array_get(offs, 1));
        if (b < 0 || e < b || (uint64_t)e > pb) {
            bad = "data_offsets point outside the payload";
            r = KVT_STORE_REFUSED_OFFSETS;
            break;
        }
        x->begin = (uint64_t)b;
        x->end = (uint64_t)e;
        if (x->end - x->begin != elems * kvt_dtype_size(x->dtype)) {
            bad = "data_offsets do not match dtype x shape";
            break;
        }
        out->n++;
    }
    if (!bad) {
        qsort(out->t, (size_t)out->n, sizeof(kvt__st_in), cmp_begin);
        uint64_t at = 0;
        for (int32_t i = 0; i < out->n; i++) {
            if (out->t[i].begin != at) {
                bad = "tensors overlap or leave a hole";
                r = KVT_STORE_REFUSED_OFFSETS;
                break;
            }
            at = out->t[i].end;
        }
        if (!bad && at != pb) {
            bad = "tensors do not cover the payload";
            r = KVT_STORE_REFUSED_OFFSETS;
        }
    }
    if (bad) {
        kvt__shard_free(out);
        return kvt__shard_refuse(reason, r, KVT_EFORMAT, path, bad);
    }
    return 0;
}

int kvt__shard_check(const kvt__shard *sh, const void *p, int strict, const char *path, int *reason)
{
    size_t n = (size_t)sh->payload_bytes;
    if (sh->has_xxh) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(p, n));
        if (memcmp(c.digest, sh->xxh, 16)) {
            *reason = KVT_STORE_REFUSED_CHECKSUM;
            return kvt__fail(KVT_ECORRUPT, "%s: refused (checksum): payload XXH3-128 differs from the header", path);
        }
    }
    if (strict || !sh->has_xxh) {
        uint8_t md[32];
        unsigned int len = 0;
        EVP_Digest(p, n, md, &len, EVP_sha256(), NULL);
        if (memcmp(md, sh->sha, 32)) {
            *reason = KVT_STORE_REFUSED_CHECKSUM;
            return kvt__fail(KVT_ECORRUPT, "%s: refused (checksum): payload SHA-256 differs from the header", path);
        }
    }
    return 0;
}

/* ---- images in memory ------------------------------------------------------ */

void kvt__rshard_clear(kvt__rshard *r)
{
    if (!r)
        return;
    kvt__shard_free(&r->sh);
    kvt_buf_release(r->buf);
    r->buf = NULL;
}

int kvt__shard_image(json_t *meta, const kvt__st_out *t, int32_t n, kvt_buf **out)
{
    *out = NULL;
    uint64_t payload = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!kvt_dtype_size(t[i].dtype))
            return kvt__fail(KVT_EINVAL, "shard image: tensor %s has an unknown dtype", t[i].name);
        payload += t[i].bytes;
    }
    int32_t *ord = kvt__shard_order(t, n);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    XXH3_state_t *xx = XXH3_createState();
    int rc = KVT_ENOMEM;
    char *header = NULL;
    if (!ord || !md || !xx || !EVP_DigestInit_ex(md, EVP_sha256(), NULL) || XXH3_128bits_reset(xx) != XXH_OK)
        goto out;
    for (int32_t k = 0; k < n; k++) {
        EVP_DigestUpdate(md, t[ord[k]].data, t[ord[k]].bytes);
        XXH3_128bits_update(xx, t[ord[k]].data, t[ord[k]].bytes);
    }
    uint8_t sha[32];
    char sha_hex[65], xxh_hex[33];
    EVP_DigestFinal_ex(md, sha, NULL);
    kvt__hex(sha, 32, sha_hex);
    XXH128_canonical_t xc;
    XXH128_canonicalFromHash(&xc, XXH3_128bits_digest(xx));
    kvt__hex(xc.digest, 16, xxh_hex);
    size_t hlen = 0;
    if (!(header = kvt__shard_header(meta, t, ord, n, sha_hex, xxh_hex, payload, &hlen)))
        goto out;
    kvt_buf *b;
    if (kvt_buf_new(8 + hlen + (size_t)payload, &b))
        goto out;
    uint8_t *p = kvt_buf_data(b);
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memcpy(p + 8, header, hlen);
    uint64_t off = 8 + hlen;
    for (int32_t k = 0; k < n; k++) {
        if (t[ord[k]].bytes)
            memcpy(p + off, t[ord[k]].data, t[ord[k]].bytes);
        off += t[ord[k]].bytes;
    }
    *out = b;
    rc = 0;
out:
    kvt__free(header);
    XXH3_freeState(xx);
    EVP_MD_CTX_free(md);
    kvt__free(ord);
    return rc == KVT_ENOMEM ? kvt__fail(rc, "shard image: out of memory") : rc;
}

static void release_image(void *ctx, void *data, size_t bytes)
{
    (void)data;
    (void)bytes;
    kvt_buf_release(ctx);
}

int kvt__shard_parse_image(kvt_buf *img, const char *name, int strict, kvt__rshard *out, int *reason)
{
    memset(out, 0, sizeof *out);
    const uint8_t *p = kvt_buf_data(img);
    uint64_t size = kvt_buf_bytes(img), hlen = 0;
    if (size < 8)
        return kvt__shard_refuse(reason, KVT_STORE_REFUSED_TRUNCATED, KVT_EFORMAT, name, "shorter than 8 bytes");
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)p[i] << (8 * i);
    int rc = kvt__shard_check_len(hlen, size, name, reason);
    if (!rc)
        rc = kvt__shard_parse_header((const char *)p + 8, hlen, size, name, &out->sh, reason);
    if (!rc)
        rc = kvt__shard_check(&out->sh, p + out->sh.payload_off, strict, name, reason);
    kvt_buf *ref = rc ? NULL : kvt_buf_retain(img);
    if (!rc && kvt_buf_wrap((void *)(p + out->sh.payload_off), (size_t)out->sh.payload_bytes, release_image, ref,
                            &out->buf)) {
        kvt_buf_release(ref);
        rc = kvt__fail(KVT_ENOMEM, "%s: out of memory", name);
    }
    if (rc)
        kvt__rshard_clear(out);
    return rc;
}
