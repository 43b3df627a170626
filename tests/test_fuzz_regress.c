/*
 * test_fuzz_regress.c: unit tests for the bugs the fuzz targets of fuzz/
 * found in parsers that have no test file of their own here (the remote
 * tier's record codec). Each builds the smallest input that shows the bug;
 * the fuzzer's own input is kept beside the target's corpus as regress-*.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include "internal.h"
#include "remote_internal.h"

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void seal(uint8_t *b, size_t n)
{
    XXH128_hash_t h = XXH3_128bits(b, n - 16);
    put64(b + n - 16, h.low64);
    put64(b + n - 8, h.high64);
}

/* A block record of H header and P payload bytes with one layer (at 104:
 * its fixed part is 120 bytes) holding one tensor, whose descriptor is at
 * 224 .. 344: name "x", U8, shape [8], 8 bytes at payload offset 0. */
static uint8_t *one_tensor_record(uint32_t H, uint64_t P, size_t *n)
{
    *n = H + P + 16;
    uint8_t *b = calloc(1, *n + 256); /* room for the descriptor past a short value */
    assert_non_null(b);
    memcpy(b, "KVTR", 4);
    b[4] = KVT__REC_VERSION;
    b[6] = 'b';
    put32(b + 8, H);
    put64(b + 64, P);
    put32(b + 92, 1);              /* one layer, no ns, tokens, blocks or attachments */
    memcpy(b + 104, "kv", 2);      /* the layer's kind */
    put32(b + 104 + 52, 1);        /* one tensor */
    memcpy(b + 224, "x", 2);
    put32(b + 288, KVT_DTYPE_U8);
    put32(b + 292, 1);
    put64(b + 296, 8);
    put64(b + 328, 8);
    put64(b + 336, 0);
    seal(b, *n);
    return b;
}

/* The layer's fixed part fits the header, and so does one tensor descriptor
 * counted from the layer's start, but not from where the table begins (it
 * ends 88 bytes into the payload). The parser must refuse it, not read the
 * tensor's dtype, shape and offsets out of the payload (or past the value). */
static void record_tensor_table_past_header(void **state)
{
    (void)state;
    size_t n;
    uint8_t *b = one_tensor_record(256, 128, &n);
    kvt__rec r;
    assert_int_equal(kvt__rec_parse(b, n, &r), KVT_EFORMAT);
    assert_non_null(strstr(kvt_last_error(), "layer 0"));
    assert_null(r.layers);
    free(b);
    /* the same table with the header grown to hold it is fine */
    b = one_tensor_record(384, 64, &n);
    assert_int_equal(kvt__rec_parse(b, n, &r), 0);
    assert_int_equal(r.n_layers, 1);
    assert_int_equal(r.layers[0].n_tensors, 1);
    assert_int_equal(r.layers[0].tensors[0].bytes, 8);
    assert_ptr_equal(r.layers[0].tensors[0].data, b + 384);
    kvt__rec_clear(&r);
    free(b);
}

/* A zero-byte tensor with one wide dimension ([0, 1000]): whether it is
 * accepted must not depend on how much payload the other tensors take, so
 * that a parsed record encodes into one that parses again. */
static void record_zero_size_wide_shape(void **state)
{
    (void)state;
    kvt_tensor t[2];
    memset(t, 0, sizeof t);
    uint8_t data[4] = {1, 2, 3, 4};
    snprintf(t[0].name, sizeof t[0].name, "empty");
    t[0].dtype = KVT_DTYPE_F32;
    t[0].ndim = 2;
    t[0].shape[0] = 0;
    t[0].shape[1] = 1000;
    snprintf(t[1].name, sizeof t[1].name, "small");
    t[1].dtype = KVT_DTYPE_U8;
    t[1].ndim = 1;
    t[1].shape[0] = 4;
    t[1].bytes = 4;
    t[1].data = data;
    kvt__rec_layer L;
    memset(&L, 0, sizeof L);
    snprintf(L.kind, sizeof L.kind, "kv");
    L.offset = 4;
    L.n_tensors = 2;
    L.tensors = t;
    kvt__rec r = {.type = 'b', .ns = "", .layers = &L, .n_layers = 1, .tok_begin = 0};
    void *v = NULL;
    size_t n = 0;
    assert_int_equal(kvt__rec_encode(&r, &v, &n), 0);
    kvt__rec p;
    assert_int_equal(kvt__rec_parse(v, n, &p), 0); /* payload of 4 bytes: 1000 > P */
    assert_int_equal(p.layers[0].tensors[0].shape[1], 1000);
    assert_int_equal(p.layers[0].tensors[0].bytes, 0);
    assert_memory_equal(p.layers[0].tensors[1].data, data, 4);
    kvt__rec_clear(&p);
    kvt__free(v);
    /* a shape whose element count is beyond any payload is still refused */
    t[0].shape[0] = (int64_t)1 << 40;
    t[0].shape[1] = (int64_t)1 << 40;
    assert_int_equal(kvt__rec_encode(&r, &v, &n), 0);
    assert_int_equal(kvt__rec_parse(v, n, &p), KVT_EFORMAT);
    assert_non_null(strstr(kvt_last_error(), "shape too large"));
    kvt__free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(record_tensor_table_past_header),
        cmocka_unit_test(record_zero_size_wide_shape),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
