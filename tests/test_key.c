/*
 * test_key.c: the content keys of src/base/key.c. The golden values were
 * computed by the SSD tier's key code before it moved into the key module
 * (the same XXH3-128 over the bytes key.h documents): shards already on disk
 * are named by them, and the remote tier must name the same state the same
 * way, so a change here is a format change, never a refactor.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "key.h"

#define ID "{\"config\":\"c\",\"model\":\"m\",\"tokenizer\":\"t\"}"

static void tokens(int32_t *t, int n)
{
    for (int i = 0; i < n; i++)
        t[i] = i * 7919 - 300;
}

static void expect_key(kvt__key k, uint64_t lo, uint64_t hi)
{
    assert_int_equal(k.lo, lo);
    assert_int_equal(k.hi, hi);
}

static void test_golden(void **state)
{
    (void)state;
    int32_t t[600];
    tokens(t, 600);
    kvt__key s = kvt__key_seed(ID);
    expect_key(s, 0xc57c9bf6d84b6855ull, 0xeecbb9f30746d01dull);
    expect_key(kvt__entry_key(s, "", t, 0), 0xb049511208aaf3c4ull, 0x76f5205f2794a435ull);
    expect_key(kvt__entry_key(s, "", NULL, 0), 0xb049511208aaf3c4ull, 0x76f5205f2794a435ull);
    expect_key(kvt__entry_key(s, "lora:a", t, 600), 0xb1521f6b16ec2669ull, 0x3f1ff825c1b21c78ull);
    kvt__key b1 = kvt__block_key(s, "", KVT__KEY_ZERO, t, 256);
    expect_key(b1, 0xc9f628c0e61ea816ull, 0x1d144520a04b5775ull);
    expect_key(kvt__block_key(s, "", b1, t + 256, 44), 0x3ac92a02981f5307ull, 0xe667bc0a32d0190bull);
}

/* what a key depends on: every input changes it; the chain carries history */
static void test_inputs(void **state)
{
    (void)state;
    int32_t t[64];
    tokens(t, 64);
    kvt__key s = kvt__key_seed(ID), s2 = kvt__key_seed(ID " ");
    kvt__key e = kvt__entry_key(s, "", t, 64);
    assert_false(kvt__key_eq(e, kvt__entry_key(s2, "", t, 64)));
    assert_false(kvt__key_eq(e, kvt__entry_key(s, "x", t, 64)));
    assert_false(kvt__key_eq(e, kvt__entry_key(s, "", t, 63)));
    kvt__key a = kvt__block_key(s, "", KVT__KEY_ZERO, t, 32);
    assert_false(kvt__key_eq(a, kvt__entry_key(s, "", t, 32))); /* 'b' vs 'e' */
    kvt__key b = kvt__block_key(s, "", a, t + 32, 32);
    kvt__key b_other_parent = kvt__block_key(s, "", kvt__block_key(s, "", KVT__KEY_ZERO, t + 1, 32), t + 32, 32);
    assert_false(kvt__key_eq(b, b_other_parent));
    assert_true(kvt__key_eq(b, kvt__block_key(s, "", a, t + 32, 32)));
    /* ns "a" + tokens vs ns "" : the NUL keeps them apart */
    int32_t x = 0x61;
    assert_false(kvt__key_eq(kvt__block_key(s, "a", KVT__KEY_ZERO, NULL, 0), kvt__block_key(s, "", KVT__KEY_ZERO, &x, 1)));
    expect_key(kvt__key_seed(NULL), 0, 0);
    assert_int_not_equal(kvt__key_word((kvt__key){0, 5}), 0);
}

static void test_hex(void **state)
{
    (void)state;
    kvt__key k = {0x0123456789abcdefull, 0xfedcba9876543210ull}, back;
    char h[33];
    kvt__key_hex(k, h);
    assert_string_equal(h, "fedcba98765432100123456789abcdef"); /* hi, then lo, big-endian */
    assert_int_equal(kvt__key_parse(h, &back), 0);
    assert_true(kvt__key_eq(k, back));
    back = (kvt__key){7, 7};
    assert_int_equal(kvt__key_parse("FEDCBA98765432100123456789ABCDEF", &back), -1);
    assert_int_equal(kvt__key_parse("fedcba98765432100123456789abcde", &back), -1);
    assert_int_equal(kvt__key_parse("fedcba98765432100123456789abcdef0", &back), -1);
    assert_int_equal(kvt__key_parse("fedcba98765432100123456789abcdeg", &back), -1);
    expect_key(back, 7, 7); /* untouched on refusal */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden),
        cmocka_unit_test(test_inputs),
        cmocka_unit_test(test_hex),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
