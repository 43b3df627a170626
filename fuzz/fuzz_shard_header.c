/*
 * fuzz_shard_header.c: the SSD tier's shard header reader
 * (kvt__shard_read_header, src/ssd/store_format.c) on arbitrary files. A header
 * it accepts must describe tensors that are sorted, contiguous, inside the
 * payload and sized dtype x shape, with a payload ending exactly at the end
 * of the file; the base64 tokens of the metadata decode or are refused; the
 * payload checks (XXH3-128, SHA-256) run over exactly the declared bytes. A refusal must name a
 * reason.
 */
#include "fuzz_util.h"

#include "internal.h"
#include "store_internal.h"

#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    int fd = fz_memfile(data, size, path);
    if (fd < 0)
        return 0;
    kvt__shard sh;
    int reason = -1;
    int rc = kvt__shard_read_header(fd, path, size, &sh, &reason);
    if (rc) {
        FZ_CHECK(rc == KVT_ENOMEM || (reason >= 0 && reason < KVT_STORE_REFUSED_COUNT),
                 "refused (%d) without a reason (%d)", rc, reason);
        FZ_CHECK(!sh.root && !sh.t && sh.n == 0, "a refused header left state behind");
        close(fd);
        return 0;
    }
    FZ_CHECK(sh.payload_off == 8 + sh.header_len && sh.payload_off + sh.payload_bytes == size,
             "payload [%llu, +%llu) does not end the %zu-byte file", (unsigned long long)sh.payload_off,
             (unsigned long long)sh.payload_bytes, size);
    uint64_t at = 0;
    for (int32_t i = 0; i < sh.n; i++) {
        const kvt__st_in *t = &sh.t[i];
        FZ_CHECK(t->begin == at && t->end >= t->begin && t->end <= sh.payload_bytes, "tensor %d at [%llu, %llu)",
                 (int)i, (unsigned long long)t->begin, (unsigned long long)t->end);
        uint64_t elems = 1;
        for (int32_t d = 0; d < t->ndim; d++)
            elems *= (uint64_t)t->shape[d];
        FZ_CHECK(t->end - t->begin == elems * kvt_dtype_size(t->dtype), "tensor %s size", t->name);
        at = t->end;
    }
    FZ_CHECK(at == sh.payload_bytes, "tensors cover %llu of %llu bytes", (unsigned long long)at,
             (unsigned long long)sh.payload_bytes);
    const char *toks = kvt__meta_str(&sh, "tokens");
    if (toks) {
        int32_t *ids = NULL;
        int64_t n = -1;
        if (!kvt__tokens_unb64(toks, &ids, &n)) {
            FZ_CHECK(n >= 0, "decoded %lld tokens", (long long)n);
            char *back = kvt__tokens_b64(ids, n);
            /* the canonical encoding of what was decoded decodes the same */
            int32_t *again = NULL;
            int64_t m = -1;
            FZ_CHECK(back && !kvt__tokens_unb64(back, &again, &m) && m == n &&
                         (n == 0 || !memcmp(again, ids, (size_t)n * 4)),
                     "tokens do not survive a re-encoding");
            kvt__free(back);
            kvt__free(again);
        }
        kvt__free(ids);
    }
    const char *key = kvt__meta_str(&sh, "key");
    kvt__key k;
    if (key && !kvt__key_parse(key, &k)) {
        char hex[33];
        kvt__key_hex(k, hex);
        FZ_CHECK(!strcmp(hex, key), "key %s reads back as %s", key, hex);
    }
    /* the payload checks restore runs: XXH3-128, and SHA-256 when strict */
    for (int strict = 0; strict < 2; strict++) {
        int why = -1;
        rc = kvt__shard_check(&sh, data + sh.payload_off, strict, path, &why);
        FZ_CHECK(rc == 0 || (rc == KVT_ECORRUPT && why == KVT_STORE_REFUSED_CHECKSUM), "check returned %d (%d)", rc,
                 why);
    }
    kvt__shard_free(&sh);
    close(fd);
    return 0;
}
