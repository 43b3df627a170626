/*
 * test_codec.c: the entry <-> shard codec (src/tier/codec.h) as a tier that
 * keeps byte records (the remote tier) uses it: an entry encoded into block
 * and entry records decodes back to the same entry; a record is the same
 * bytes as the shard file the SSD tier writes for the same state (so both
 * tiers name and hold the same thing); a flipped payload byte, a broken
 * header, another identity and a block of another entry are refused with
 * their reasons.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "codec.h"
#include "store_util.h"

#include "kvtier/store.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ID "{\"config\":\"c\",\"model\":\"codec\",\"tokenizer\":\"t\"}"

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};
static const store_cfg HYBRID = {.n_kv = 1, .kv_dim = 8, .block = 4, .window = 6, .recurrent = 40, .attach = 24};

static void seq(int32_t *t, int n, int32_t base)
{
    for (int i = 0; i < n; i++)
        t[i] = base + 3 * i;
}

typedef struct records {
    kvt__enc enc;
    kvt_buf *entry;
    kvt_buf **blocks; /* (enc.n_chain) */
} records;

static void encode(const kvt_entry *e, records *r)
{
    memset(r, 0, sizeof *r);
    assert_int_equal(kvt__enc_entry(&r->enc, kvt__key_seed(ID), e), 0);
    r->blocks = calloc((size_t)r->enc.n_chain + 1, sizeof *r->blocks);
    assert_non_null(r->blocks);
    for (int32_t c = 0; c < r->enc.n_chain; c++)
        assert_int_equal(kvt__enc_block_record(&r->enc, c, ID, &r->blocks[c]), 0);
    assert_int_equal(kvt__enc_entry_record(&r->enc, ID, &r->entry), 0);
}

static void records_clear(records *r)
{
    for (int32_t c = 0; c < r->enc.n_chain; c++)
        kvt_buf_release(r->blocks[c]);
    free(r->blocks);
    kvt_buf_release(r->entry);
    kvt__enc_clear(&r->enc);
}

/* What a remote tier does on a hit: entry record, then its blocks, then decode. */
static int decode(kvt_buf *entry, kvt_buf *const *blocks, int32_t n_blocks, const char *identity, kvt_entry *out,
                  int *reason)
{
    kvt__rshard ent;
    kvt__pentry pe;
    memset(&pe, 0, sizeof pe);
    memset(out, 0, sizeof *out);
    int rc = kvt__shard_parse_image(entry, "entry", 0, &ent, reason);
    if (!rc)
        rc = kvt__codec_parse_entry(&ent.sh, "entry", identity, &pe, reason);
    if (!rc && pe.n_blocks != n_blocks)
        rc = KVT_EFORMAT;
    kvt__rshard *blk = calloc((size_t)n_blocks + 1, sizeof *blk);
    for (int32_t i = 0; !rc && i < n_blocks; i++) {
        kvt__pblock pb;
        memset(&pb, 0, sizeof pb);
        rc = kvt__shard_parse_image(blocks[i], "block", 0, &blk[i], reason);
        if (!rc)
            rc = kvt__codec_parse_block(&blk[i].sh, "block", identity, &pb, reason);
        if (!rc)
            rc = kvt__codec_block_check(&pe, i, &pb, "block", reason);
        kvt__pblock_free(&pb);
    }
    if (!rc)
        rc = kvt__codec_decode(&pe, &ent, blk, "entry", out, reason);
    for (int32_t i = 0; i < n_blocks; i++)
        kvt__rshard_clear(&blk[i]);
    free(blk);
    kvt__pentry_free(&pe);
    kvt__rshard_clear(&ent);
    return rc;
}

static void roundtrip(const store_cfg *cfg, int n)
{
    int32_t t[64];
    seq(t, n, 100);
    kvt_entry e, got;
    assert_int_equal(store_make_entry(cfg, "lora:x", t, n, &e), 0);
    records r;
    encode(&e, &r);
    int reason = -1;
    assert_int_equal(decode(r.entry, r.blocks, r.enc.n_chain, ID, &got, &reason), 0);
    assert_int_equal(store_entry_diff(&e, &got), 0);
    kvt_entry_clear(&got);
    records_clear(&r);
    kvt_entry_clear(&e);
}

static void test_roundtrip(void **state)
{
    (void)state;
    roundtrip(&KV, 18);     /* 4 full blocks and a 2-token tail */
    roundtrip(&KV, 0);      /* no tokens, no blocks */
    roundtrip(&HYBRID, 21); /* a window, recurrent state and an attachment */
}

static int read_file(const char *path, uint8_t **out, size_t *n)
{
    struct stat st;
    int fd = open(path, O_RDONLY);
    if (fd < 0 || fstat(fd, &st))
        return -1;
    *n = (size_t)st.st_size;
    *out = malloc(*n + 1);
    ssize_t r = read(fd, *out, *n);
    close(fd);
    return r == (ssize_t)*n ? 0 : -1;
}

/* a record holds the same bytes as the SSD tier's shard file of that state */
static void test_records_are_shard_files(void **state)
{
    (void)state;
    char root[512], fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    store_tmpdir(root, sizeof root, "codec");
    store_identity(&KV, "codec", fp, &id);
    kvt_store *s;
    assert_int_equal(kvt_store_open(root, &id, NULL, &s), 0);
    int32_t t[16];
    seq(t, 16, 7);
    kvt_entry e;
    assert_int_equal(store_make_entry(&KV, "", t, 16, &e), 0);
    assert_int_equal(kvt_store_put(s, &e), 0);
    /* the store's identity string is its canonical JSON of the three fields */
    char ident[1024];
    snprintf(ident, sizeof ident, "{\"config\":\"%s\",\"model\":\"%s\",\"tokenizer\":\"%s\"}", id.config_fingerprint,
             id.model_id, id.tokenizer_hash);
    kvt__enc enc;
    assert_int_equal(kvt__enc_entry(&enc, kvt__key_seed(ident), &e), 0);
    assert_int_equal(enc.n_chain, 4);
    for (int32_t c = 0; c <= enc.n_chain; c++) {
        kvt_buf *rec;
        char hex[33], path[1200];
        kvt__key k = c < enc.n_chain ? enc.keys[c] : enc.key;
        if (c < enc.n_chain)
            assert_int_equal(kvt__enc_block_record(&enc, c, ident, &rec), 0);
        else
            assert_int_equal(kvt__enc_entry_record(&enc, ident, &rec), 0);
        kvt__key_hex(k, hex);
        snprintf(path, sizeof path, "%s/%c%s.safetensors", kvt_store_dir(s), c < enc.n_chain ? 'b' : 'e', hex);
        uint8_t *file = NULL;
        size_t n = 0;
        assert_int_equal(read_file(path, &file, &n), 0);
        assert_int_equal(n, kvt_buf_bytes(rec));
        assert_memory_equal(file, kvt_buf_data(rec), n);
        free(file);
        kvt_buf_release(rec);
    }
    kvt__enc_clear(&enc);
    kvt_entry_clear(&e);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(root);
}

/* a copy of rec with byte at (from the end when negative) xor mask */
static kvt_buf *flipped(kvt_buf *rec, long at, int mask)
{
    kvt_buf *b;
    size_t n = kvt_buf_bytes(rec);
    assert_int_equal(kvt_buf_new(n, &b), 0);
    memcpy(kvt_buf_data(b), kvt_buf_data(rec), n);
    ((uint8_t *)kvt_buf_data(b))[at < 0 ? (long)n + at : at] ^= (uint8_t)mask;
    return b;
}

static void test_refusals(void **state)
{
    (void)state;
    int32_t t[16], u[16];
    seq(t, 16, 500);
    seq(u, 16, 900);
    kvt_entry e, other, got;
    assert_int_equal(store_make_entry(&KV, "", t, 12, &e), 0);
    assert_int_equal(store_make_entry(&KV, "", u, 12, &other), 0);
    records r, ro;
    encode(&e, &r);
    encode(&other, &ro);
    int reason = -1;
    kvt__rshard rs;

    kvt_buf *bad = flipped(r.blocks[1], -1, 0x40); /* the last payload byte */
    assert_int_equal(kvt__shard_parse_image(bad, "b", 0, &rs, &reason), KVT_ECORRUPT);
    assert_int_equal(reason, KVT_STORE_REFUSED_CHECKSUM);
    kvt_buf *blocks[3] = {r.blocks[0], bad, r.blocks[2]};
    assert_int_equal(decode(r.entry, blocks, 3, ID, &got, &reason), KVT_ECORRUPT);
    assert_null(got.caches);
    kvt_buf_release(bad);

    bad = flipped(r.entry, 9, 0x20); /* inside the JSON header */
    assert_int_equal(kvt__shard_parse_image(bad, "e", 0, &rs, &reason), KVT_EFORMAT);
    assert_int_equal(reason, KVT_STORE_REFUSED_MALFORMED);
    kvt_buf_release(bad);

    bad = flipped(r.entry, 7, 0x01); /* the header length's top byte: over the bound */
    assert_int_equal(kvt__shard_parse_image(bad, "e", 0, &rs, &reason), KVT_EFORMAT);
    assert_int_equal(reason, KVT_STORE_REFUSED_HEADER_BOUND);
    kvt_buf_release(bad);

    reason = -1;
    assert_int_equal(decode(r.entry, r.blocks, 3, "{\"other\":1}", &got, &reason), KVT_EIDENTITY);
    assert_int_equal(reason, KVT_STORE_REFUSED_IDENTITY);

    /* a valid block of another entry in the chain: refused, tokens differ */
    blocks[0] = r.blocks[0];
    blocks[1] = ro.blocks[1];
    blocks[2] = r.blocks[2];
    assert_int_equal(decode(r.entry, blocks, 3, ID, &got, &reason), KVT_EFORMAT);
    assert_int_equal(reason, KVT_STORE_REFUSED_TOKENS);

    assert_int_equal(decode(r.entry, r.blocks, 3, ID, &got, &reason), 0);
    assert_int_equal(store_entry_diff(&e, &got), 0);
    kvt_entry_clear(&got);
    records_clear(&r);
    records_clear(&ro);
    kvt_entry_clear(&e);
    kvt_entry_clear(&other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_records_are_shard_files),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
