/*
 * codec.h: the entry <-> shard codec, shared by every tier that stores
 * entries as bytes (the SSD tier's files, the remote tier's records).
 * Internal; not installed. Thread-safe: every function works on its
 * arguments only.
 *
 * An entry is stored as content-addressed kv block shards plus one entry
 * shard. A shard is a safetensors image: 8-byte little-endian header length,
 * a JSON header (tensor descriptions and "__metadata__", an object of
 * strings), then the raw tensor bytes (the payload). The metadata holds
 * "format" ("kvtier-shard"), "version", "payload_bytes" and two checksums of
 * the payload, "xxh3" (XXH3-128, checked on every decode) and "sha256"
 * (checked when strict); then, by type:
 *   block: type "block", identity, ns, key, parent (key.h hex), tok_begin,
 *          tok_end, tokens (base64 of the block's int32 LE tokens);
 *   entry: type "entry", identity, ns, key, n_tokens, min_reach, [granule
 *          (only when > 0: kvt_entry_trim_granule)], tokens
 *          (base64, all of them), layers (JSON: kind, offset, min_offset,
 *          params, tensors with name, dtype, shape, tok range and the index
 *          of the block holding it or -1), blocks (JSON: [key, tok_begin,
 *          tok_end] in chain order), attachments (JSON: name, kind).
 * Tensor names: "L<layer>.<name>" for layer state, "A<i>" for attachment i.
 * Keys are key.h's (kvt__entry_key / kvt__block_key of the identity seed),
 * so the same state has the same key and the same bytes in every tier.
 *
 * Use, encoding: kvt__enc_entry, then for each block kvt__enc_block and for
 * the entry kvt__enc_entry_shard (metadata and tensors, for a file writer),
 * or kvt__enc_block_record / kvt__enc_entry_record (one byte buffer each).
 * Decoding: kvt__shard_parse_image or a file reader gives a validated
 * kvt__shard; kvt__codec_parse_entry / _block validate the metadata; the
 * payloads are checked (kvt__shard_check); kvt__codec_decode builds the
 * entry. Untrusted input: every field is validated before it is used; a
 * refusal names its kvt_store_refusal reason.
 */
#ifndef KVTIER_CODEC_H
#define KVTIER_CODEC_H

#include "kvtier/buffer.h"
#include "kvtier/store.h"
#include "kvtier/tier.h"

#include "key.h"

#include <jansson.h>
#include <stdint.h>

#define KVT__SHARD_FORMAT "kvtier-shard"
#define KVT__SHARD_VERSION "2"     /* written; "1" (no xxh3) is still read */
#define KVT__SHARD_VERSION_V1 "1" /* no fast checksum: decoded only after SHA-256 */
#define KVT__PAYLOAD_ALIGN 64      /* the payload starts at a multiple of this */

/* ---- safetensors images (codec_shard.c) ------------------------------------ */

/** One tensor to write: data borrowed. */
typedef struct kvt__st_out {
    char name[96];
    kvt_dtype dtype;
    int32_t ndim;
    int64_t shape[KVT_TENSOR_MAX_DIMS];
    const void *data; /* (bytes) */
    size_t bytes;
} kvt__st_out;

/** One tensor described by a validated header; offsets relative to the payload. */
typedef struct kvt__st_in {
    const char *name; /* borrowed from the shard's JSON */
    kvt_dtype dtype;
    int32_t ndim;
    int64_t shape[KVT_TENSOR_MAX_DIMS];
    uint64_t begin, end; /* [begin, end) bytes within the payload */
} kvt__st_in;

/** A validated shard header. */
typedef struct kvt__shard {
    json_t *root;          /* parsed header, owned */
    json_t *meta;          /* "__metadata__" object of strings, borrowed from root */
    kvt__st_in *t;         /* (n), sorted by begin */
    int32_t n;
    uint64_t header_len;   /* JSON bytes */
    uint64_t payload_off;  /* 8 + header_len */
    uint64_t payload_bytes;
    uint64_t file_bytes;
    uint8_t sha[32];       /* payload SHA-256 from the metadata */
    uint8_t xxh[16];       /* payload XXH3-128 from the metadata (canonical order) */
    int has_xxh;           /* 0: a version 1 shard (SHA-256 only) */
} kvt__shard;

/** A validated shard with its checked payload (owned reference). */
typedef struct kvt__rshard {
    kvt__shard sh;
    kvt_buf *buf; /* (sh.payload_bytes) */
} kvt__rshard;

/** Releases what an rshard holds; zeroes it. NULL is a no-op. */
void kvt__rshard_clear(kvt__rshard *r);

/** Payload write order of t[0..n): wider dtypes first, so every tensor is
 * aligned to its element size. Caller frees with kvt__free; NULL on OOM. */
int32_t *kvt__shard_order(const kvt__st_out *t, int32_t n);

/** The JSON header of a shard: meta (an object of strings; "sha256",
 * "xxh3", "payload_bytes", "format" and "version" are set in it) with the
 * tensors t in the order ord, padded with spaces so the payload starts at a
 * multiple of KVT__PAYLOAD_ALIGN. *len_out receives its length (the same for
 * any two hex strings of the same length). Caller frees with kvt__free.
 * @return the header, or NULL on OOM. */
char *kvt__shard_header(json_t *meta, const kvt__st_out *t, const int32_t *ord, int32_t n, const char *sha_hex,
                        const char *xxh_hex, uint64_t payload, size_t *len_out);

/** Checks a header length hlen (the first 8 bytes, little-endian) against
 * the bound KVT_STORE_MAX_HEADER and a shard of file_bytes bytes; call it
 * before reading the header. @return 0 or KVT_EFORMAT with *reason. */
int kvt__shard_check_len(uint64_t hlen, uint64_t file_bytes, const char *path, int *reason);

/** Validates a shard header: h (hlen JSON bytes, already length-checked)
 * of a shard of file_bytes bytes in all (8 + hlen + payload). On failure
 * *reason receives a kvt_store_refusal and *out is zeroed.
 * @return 0, KVT_EFORMAT, KVT_ENOMEM. */
int kvt__shard_parse_header(const char *h, uint64_t hlen, uint64_t file_bytes, const char *path, kvt__shard *out,
                            int *reason);

/** Frees what the header parsers allocated; zeroes *sh. */
void kvt__shard_free(kvt__shard *sh);

/** Metadata string value or NULL. */
const char *kvt__meta_str(const kvt__shard *sh, const char *key);

/** Checks the payload bytes p (sh->payload_bytes) against the header: the
 * XXH3-128 always (when the shard has one), the SHA-256 when `strict` or when
 * the shard has no XXH3-128 (version 1). On a mismatch *reason is
 * KVT_STORE_REFUSED_CHECKSUM. @return 0 or KVT_ECORRUPT. */
int kvt__shard_check(const kvt__shard *sh, const void *p, int strict, const char *path, int *reason);

/** Builds a whole shard image in memory (the bytes a shard file holds):
 * meta and tensors as kvt__shard_header, the checksums computed. *out is a
 * new buffer (released by kvt_buf_release). @return 0, KVT_EINVAL (unknown
 * dtype), KVT_ENOMEM. */
int kvt__shard_image(json_t *meta, const kvt__st_out *t, int32_t n, kvt_buf **out);

/** Validates an image (header and payload checksum, see kvt__shard_check)
 * and makes *out: its header and a buffer over its payload that holds a
 * reference on img (img itself stays the caller's). name is used in
 * messages. @return 0; KVT_EFORMAT / KVT_ECORRUPT with *reason; KVT_ENOMEM. */
int kvt__shard_parse_image(kvt_buf *img, const char *name, int strict, kvt__rshard *out, int *reason);

/** base64 of n int32 tokens (little-endian); caller frees with kvt__free. */
char *kvt__tokens_b64(const int32_t *tokens, int64_t n);
/** Decodes base64 tokens; *out caller frees with kvt__free (may be NULL when
 * *n == 0). @return 0 or KVT_EFORMAT / KVT_ENOMEM. */
int kvt__tokens_unb64(const char *s, int32_t **out, int64_t *n);

/** Sets *reason = r and the error detail "path: refused (<reason>): what".
 * @return code. */
int kvt__shard_refuse(int *reason, int r, int code, const char *path, const char *what);

/* ---- encoding an entry (codec.c) ------------------------------------------- */

/** One block range of an encoded entry. */
typedef struct kvt__enc_range {
    int64_t b, e;  /* [b, e) tokens */
    int chained;   /* part of the block chain (starts where the previous ended) */
    int32_t idx;   /* index in the chain when chained */
} kvt__enc_range;

/** An entry encoded for storage. Borrows the entry it was made from: its
 * tokens, ns and attachments must stay valid and unchanged while it is used. */
typedef struct kvt__enc {
    const kvt_entry *e;
    kvt_cache_state *st;  /* (e->n_caches) encoded layers, owned */
    kvt__enc_range *rg;   /* (n_rg) distinct token ranges of the tensors, sorted */
    int32_t n_rg;
    kvt__key *keys;       /* (n_chain) chained block keys */
    int32_t n_chain;
    kvt__key key;         /* the entry's key */
    int64_t min_reach;    /* largest min_offset (n_tokens with attachments) */
    int64_t granule;      /* kvt_entry_trim_granule (metadata "granule" when > 0) */
    uint64_t state_bytes; /* bytes of all layer tensors */
    size_t n_tensors;     /* layer tensors in all */
} kvt__enc;

/** Encodes every layer of e (borrowed) under the identity seed: block ranges,
 * block keys, the entry key. Checks each layer holds e->n_tokens tokens and
 * every attachment can be serialized. @return 0; KVT_EINVAL /
 * KVT_EUNSUPPORTED (named in the detail); KVT_ENOMEM; an encode error. On
 * error *enc is cleared. */
int kvt__enc_entry(kvt__enc *enc, kvt__key seed, const kvt_entry *e);
/** Releases an encoding. A zeroed one is a no-op. */
void kvt__enc_clear(kvt__enc *enc);

/** Tensors that kvt__enc_block / kvt__enc_entry_shard may write: a caller's
 * kvt__st_out array of this many elements fits any of them. */
size_t kvt__enc_max_tensors(const kvt__enc *enc);

/** The shard of chain block c (0 <= c < n_chain): *meta (a new reference)
 * and its tensors in outs[0..*n) (data borrowed from the encoding).
 * identity: the canonical identity string. @return 0 or KVT_ENOMEM. */
int kvt__enc_block(const kvt__enc *enc, int32_t c, const char *identity, json_t **meta, kvt__st_out *outs,
                   int32_t *n);

/** The entry shard: the tensors no block holds, the attachments (serialized
 * now) and the layer, block and attachment descriptions. *meta is a new
 * reference; outs[0..*n) borrow from the encoding and the attachments.
 * @return 0, KVT_ENOMEM, or an attachment's serialize error. */
int kvt__enc_entry_shard(const kvt__enc *enc, const char *identity, json_t **meta, kvt__st_out *outs, int32_t *n);

/** kvt__enc_block as one shard image (see kvt__shard_image). */
int kvt__enc_block_record(const kvt__enc *enc, int32_t c, const char *identity, kvt_buf **out);
/** kvt__enc_entry_shard as one shard image. */
int kvt__enc_entry_record(const kvt__enc *enc, const char *identity, kvt_buf **out);

/* ---- decoding (codec.c) ---------------------------------------------------- */

/** An entry shard's validated metadata. */
typedef struct kvt__pentry {
    const char *ns;          /* borrowed from the shard */
    int32_t *tokens;         /* (n_tokens) owned */
    int64_t n_tokens, min_reach;
    int64_t granule;         /* "granule" (0 when absent): cut also at its multiples below min_reach */
    kvt__key key;
    kvt__key *blocks;        /* (n_blocks) chain order, owned */
    int64_t (*ranges)[2];    /* (n_blocks) [tok_begin, tok_end) of each block */
    int32_t n_blocks;
    json_t *layers;          /* owned */
    json_t *atts;            /* owned */
} kvt__pentry;

/** A block shard's validated metadata. */
typedef struct kvt__pblock {
    const char *ns;          /* borrowed from the shard */
    kvt__key key, parent;
    int64_t tok_begin, tok_end;
    int32_t *tokens;         /* (n_tokens) owned */
    int64_t n_tokens;
} kvt__pblock;

void kvt__pentry_free(kvt__pentry *p);
void kvt__pblock_free(kvt__pblock *p);

/** Validates an entry shard's metadata (identity NULL: accept the shard's
 * own): type, identity, tokens, the key against (identity, ns, tokens),
 * min_reach, the JSON arrays, and the block chain (contiguous from 0, each
 * key following from its parent and tokens). @return 0; KVT_EFORMAT or
 * KVT_EIDENTITY with *reason; KVT_ENOMEM. */
int kvt__codec_parse_entry(const kvt__shard *sh, const char *path, const char *identity, kvt__pentry *p,
                           int *reason);

/** Validates a block shard's metadata, its key following from (identity,
 * ns, parent, tokens). @return as kvt__codec_parse_entry. */
int kvt__codec_parse_block(const kvt__shard *sh, const char *path, const char *identity, kvt__pblock *p,
                           int *reason);

/** Checks that block i of entry pe, as loaded (pb: its parsed metadata),
 * is the block the entry names: key, ns, token range and tokens.
 * @return 0 or KVT_EFORMAT with *reason (KVT_STORE_REFUSED_TOKENS). */
int kvt__codec_block_check(const kvt__pentry *pe, int32_t i, const kvt__pblock *pb, const char *name, int *reason);

/** Builds the entry pe describes from its shard ent and its blocks blk[0..
 * pe->n_blocks) (chain order; payloads checked, each block checked with
 * kvt__codec_block_check): each layer description must match its tensors
 * and each layer must decode; attachments become blobs. *out is a
 * kvtier-allocated entry whose caches alias the payload buffers (each
 * tensor holds a reference on its buffer). @return 0; KVT_EFORMAT with
 * *reason; KVT_ENOMEM; a decode error (*out zeroed on every error). */
int kvt__codec_decode(const kvt__pentry *pe, const kvt__rshard *ent, const kvt__rshard *blk, const char *name,
                      kvt_entry *out, int *reason);

#endif
