/*
 * store_internal.h: pieces of the SSD tier shared by the files of src/ssd; never
 * installed. The shard format (safetensors writer and validating header
 * reader) and its small codecs. Keys are key.h's kvt__key; the index is
 * src/base's (index.h, hmap.h).
 */
#ifndef KVTIER_STORE_INTERNAL_H
#define KVTIER_STORE_INTERNAL_H

#include "kvtier/store.h"

#include "key.h"

#include <jansson.h>
#include <pthread.h>
#include <stdint.h>

/* ---- shard format (store_format.c) --------------------------------------- */

#define KVT__SHARD_FORMAT "kvtier-shard"
#define KVT__SHARD_VERSION "2"     /* written; "1" (no xxh3) is still read */
#define KVT__SHARD_VERSION_V1 "1" /* no fast checksum: restored only after SHA-256 */
#define KVT__SHARD_SUFFIX ".safetensors"
#define KVT__TMP_PREFIX ".tmp."

/** One tensor to write: data borrowed for the call. */
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
    uint8_t xxh[16];       /* payload XXH3-128 from the metadata (big-endian hex order) */
    int has_xxh;           /* 0: a version 1 shard (SHA-256 only) */
} kvt__shard;

/** Writes `meta` (an object of string values; "sha256", "xxh3", "payload_bytes" and
 * "format"/"version" are added) and tensors t[0..n) as `final_name` in dirfd:
 * temp name, pwrite, fsync, rename. The directory itself is not fsync'd.
 * On failure the temp file is removed. *file_bytes (may be NULL) receives the
 * size. @return 0, -errno, KVT_EIO (short write / size check), KVT_ENOMEM. */
int kvt__shard_write(int dirfd, const char *dir_path, const char *final_name, json_t *meta,
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io, uint64_t *file_bytes);

/** A shard written under its temp name, not yet durable or visible. */
typedef struct kvt__pending_shard {
    int fd, dirfd;
    uint64_t bytes;
    char tmp[256], final[128], path[4096];
    /* until sealed: the payload hash (maybe still running on `hasher`) */
    int hashing, sealed;
    pthread_t hasher;
    void *md;          /* EVP_MD_CTX */
    void *xx;          /* XXH3_state_t */
    kvt__st_out *t;    /* owned copy of the tensor list */
    int32_t *ord, n;   /* write order */
    json_t *meta;      /* reference held for the final header */
    size_t hlen;
    uint64_t payload;
    kvt_store_io io;
} kvt__pending_shard;

/** First half of kvt__shard_write: writes the temp file's payload, its
 * SHA-256 possibly still being computed on a second thread when this
 * returns (so the caller can begin the next shard meanwhile). On success ps
 * holds the open file: finish with kvt__shard_seal (optional: hash, header,
 * writeback started), kvt__shard_commit (seal, fsync, size check, rename) or
 * kvt__shard_abort (remove). The tensor data of t is borrowed, valid until
 * one of those returns; t itself and meta are not needed after this call
 * (meta gets one more reference, dropped by seal/abort). On failure nothing
 * is left behind. */
int kvt__shard_begin(int dirfd, const char *dir_path, const char *final_name, json_t *meta,
                     const kvt__st_out *t, int32_t n, const kvt_store_io *io, kvt__pending_shard *ps);
/** Waits for the payload hash, writes the header with it and starts the
 * writeback; no-op when already sealed. On failure the shard is aborted
 * (temp file removed). @return 0, -errno, KVT_EIO, KVT_ENOMEM. */
int kvt__shard_seal(kvt__pending_shard *ps);
/** seal, then fsync, size check, close, rename; on failure the temp file is
 * removed. */
int kvt__shard_commit(kvt__pending_shard *ps, const kvt_store_io *io);
/** Waits for a running hash, closes and removes a begun shard (no-op when
 * already finished). */
void kvt__shard_abort(kvt__pending_shard *ps);

/** Reads and validates the header of the open shard `fd` of `file_bytes` bytes.
 * On failure *reason receives a kvt_store_refusal and the shard is zeroed.
 * @return 0, KVT_EFORMAT, -errno, KVT_ENOMEM. */
int kvt__shard_read_header(int fd, const char *path, uint64_t file_bytes, kvt__shard *out, int *reason);

/** Frees what kvt__shard_read_header allocated; zeroes *sh. */
void kvt__shard_free(kvt__shard *sh);

/** Metadata string value or NULL. */
const char *kvt__meta_str(const kvt__shard *sh, const char *key);

/** Checks the payload bytes p (sh->payload_bytes) against the header: the
 * XXH3-128 always (when the shard has one), the SHA-256 when `strict` or when
 * the shard has no XXH3-128 (version 1). On a mismatch *reason is
 * KVT_STORE_REFUSED_CHECKSUM. @return 0 or KVT_ECORRUPT. */
int kvt__shard_check(const kvt__shard *sh, const void *p, int strict, const char *path, int *reason);

/** base64 of n int32 tokens (little-endian); caller frees with kvt__free. */
char *kvt__tokens_b64(const int32_t *tokens, int64_t n);
/** Decodes base64 tokens; *out caller frees with kvt__free (may be NULL when
 * *n == 0). @return 0 or KVT_EFORMAT / KVT_ENOMEM. */
int kvt__tokens_unb64(const char *s, int32_t **out, int64_t *n);

#endif
