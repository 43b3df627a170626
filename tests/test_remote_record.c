/*
 * test_remote_record.c: every check of the remote tier's record parser
 * (src/remote/record.c, kvt__rec_parse) that a value from Redis must pass
 * before any byte of it is used, one corruption at a time on a record made
 * by the encoder and sealed again with a correct XXH3-128 (so only the
 * check under test can refuse it): a format version this build does not
 * read, a NUL inside the namespace, a tensor and an attachment whose bytes
 * run past the payload, and a payload byte changed without resealing. Each
 * refusal must carry its error code and say what is wrong.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include "internal.h"
#include "remote_internal.h"

/* Where the encoder puts things for the record below (layout in
 * remote_internal.h): ns "lora-a" at 104 (8 bytes padded), 3 tokens at 112
 * (16 padded), no block keys, the layer at 128 (120 bytes), its one tensor's
 * descriptor at 248 (bytes at +104, payload offset at +112), the attachment
 * at 368 (bytes at +64, payload offset at +72). */
#define AT_NS 104
#define AT_TENSOR 248
#define AT_ATT 368

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}
/* The trailing XXH3-128 of bytes [0, n - 16), as the encoder writes it. */
static void seal(uint8_t *b, size_t n)
{
    XXH128_hash_t h = XXH3_128bits(b, n - 16);
    put64(b + n - 16, h.low64);
    put64(b + n - 8, h.high64);
}

static const float kv[4] = {1.0f, 2.0f, 3.0f, 4.0f};
static const char att_bytes[8] = "pixels!";
static const int32_t toks[3] = {11, 12, 13};

/* An entry record: ns "lora-a", 3 tokens, one kv layer with one f32 tensor
 * of 4 values, one attachment of 8 bytes. *n its size; free with kvt__free. */
static uint8_t *make_record(size_t *n)
{
    kvt_tensor t;
    memset(&t, 0, sizeof t);
    strcpy(t.name, "k");
    t.dtype = KVT_DTYPE_F32;
    t.ndim = 1;
    t.shape[0] = 4;
    t.bytes = sizeof kv;
    t.data = kv;
    kvt__rec_layer L;
    memset(&L, 0, sizeof L);
    strcpy(L.kind, "kv");
    L.offset = 3;
    L.n_tensors = 1;
    L.tensors = &t;
    kvt__rec_att a;
    memset(&a, 0, sizeof a);
    strcpy(a.name, "img");
    a.data = att_bytes;
    a.bytes = sizeof att_bytes;
    kvt__rec r = {.type = 'e', .ns = "lora-a", .ns_len = 6, .tokens = toks, .n_tokens = 3,
                  .layers = &L, .n_layers = 1, .atts = &a, .n_atts = 1};
    void *v = NULL;
    assert_int_equal(kvt__rec_encode(&r, &v, n), 0);
    uint8_t *b = v;
    /* the layout the offsets above assume */
    assert_int_equal(get64(b + AT_TENSOR + 104), sizeof kv);
    assert_int_equal(get64(b + AT_ATT + 64), sizeof att_bytes);
    assert_memory_equal(b + AT_ATT, "img", 4);
    return b;
}

static uint64_t payload_bytes(const uint8_t *b) { return get64(b + 64); }

/* Parses b (n bytes): wants `code` and `what` in the message. */
static void refused(const uint8_t *b, size_t n, int code, const char *what)
{
    kvt__rec r;
    int rc = kvt__rec_parse(b, n, &r);
    if (rc != code)
        fail_msg("parse returned %d (want %d, '%s'): %s", rc, code, what, rc ? kvt_last_error() : "accepted");
    if (!strstr(kvt_last_error(), what))
        fail_msg("the refusal '%s' does not say '%s'", kvt_last_error(), what);
    assert_null(r.layers); /* nothing left allocated */
}

static void test_valid_record_parses(void **state)
{
    (void)state;
    size_t n;
    uint8_t *b = make_record(&n);
    kvt__rec r;
    assert_int_equal(kvt__rec_parse(b, n, &r), 0);
    assert_int_equal(r.ns_len, 6);
    assert_memory_equal(r.ns, "lora-a", 6);
    assert_int_equal(r.n_tokens, 3);
    assert_memory_equal(r.tokens, toks, sizeof toks);
    assert_int_equal(r.n_layers, 1);
    assert_int_equal(r.layers[0].tensors[0].bytes, sizeof kv);
    assert_memory_equal(r.layers[0].tensors[0].data, kv, sizeof kv);
    assert_int_equal(r.n_atts, 1);
    assert_int_equal(r.atts[0].bytes, sizeof att_bytes);
    assert_memory_equal(r.atts[0].data, att_bytes, sizeof att_bytes);
    kvt__rec_clear(&r);
    kvt__free(b);
}

static void test_other_version_refused(void **state)
{
    (void)state;
    size_t n;
    uint8_t *b = make_record(&n);
    b[4] = KVT__REC_VERSION + 1;
    seal(b, n);
    refused(b, n, KVT_EUNSUPPORTED, "format version 2");
    kvt__free(b);
}

static void test_nul_in_ns_refused(void **state)
{
    (void)state;
    size_t n;
    uint8_t *b = make_record(&n);
    b[AT_NS + 4] = 0; /* "lora\0a": another namespace's prefix would match */
    seal(b, n);
    refused(b, n, KVT_EFORMAT, "NUL inside the ns");
    kvt__free(b);
}

static void test_tensor_past_payload_refused(void **state)
{
    (void)state;
    size_t n;
    uint8_t *b = make_record(&n);
    uint64_t P = payload_bytes(b);
    put64(b + AT_TENSOR + 112, P - 8); /* 16 bytes from 8 before the payload's end */
    seal(b, n);
    refused(b, n, KVT_EFORMAT, "tensor k: 16 bytes at");
    put64(b + AT_TENSOR + 112, P + 64); /* starting past it */
    seal(b, n);
    refused(b, n, KVT_EFORMAT, "tensor k: 16 bytes at");
    kvt__free(b);
}

static void test_attachment_past_payload_refused(void **state)
{
    (void)state;
    size_t n;
    uint8_t *b = make_record(&n);
    uint64_t P = payload_bytes(b);
    put64(b + AT_ATT + 72, P - 4); /* 8 bytes from 4 before the payload's end */
    seal(b, n);
    refused(b, n, KVT_EFORMAT, "attachment 0 past the payload");
    put64(b + AT_ATT + 72, 0);
    put64(b + AT_ATT + 64, P + 1); /* longer than the payload */
    seal(b, n);
    refused(b, n, KVT_EFORMAT, "attachment 0 past the payload");
    kvt__free(b);
}

static void test_unsealed_change_refused(void **state)
{
    (void)state;
    size_t n;
    uint8_t *b = make_record(&n);
    b[n - 17] ^= 1; /* the payload's last byte, checksum left as it was */
    refused(b, n, KVT_ECORRUPT, "checksum mismatch");
    kvt__free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_record_parses),
        cmocka_unit_test(test_other_version_refused),
        cmocka_unit_test(test_nul_in_ns_refused),
        cmocka_unit_test(test_tensor_past_payload_refused),
        cmocka_unit_test(test_attachment_past_payload_refused),
        cmocka_unit_test(test_unsealed_change_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
