/*
 * fuzz_util.h: helpers shared by the fuzz targets in fuzz/: a cursor over
 * the fuzzer's bytes, in-memory files for loaders that take a path, scratch
 * directories for the store, and the two input formats a target and the
 * corpus generator (gen_corpus.c) must agree on: an encoded cache state
 * (fuzz_tensor_decode) and a directory of shard files (fuzz_store_scan).
 * Every target defines LLVMFuzzerTestOneInput; libFuzzer drives it in the
 * clang build (make fuzz), replay_main.c feeds it the committed corpus in the
 * plain build (make test).
 */
#ifndef KVT_FUZZ_UTIL_H
#define KVT_FUZZ_UTIL_H

#include "kvtier/cache.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A failed invariant: prints what and where, then aborts so that libFuzzer
 * (and the corpus replay) report the input as a crash. */
#define FZ_CHECK(cond, ...)                                                                       \
    do {                                                                                          \
        if (!(cond))                                                                              \
            fz_fail(__FILE__, __LINE__, #cond, __VA_ARGS__);                                      \
    } while (0)
_Noreturn void fz_fail(const char *file, int line, const char *cond, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- a cursor over the input: reads past the end give zeros ---------------- */

typedef struct fz_in {
    const uint8_t *p;
    size_t n;
} fz_in;

uint8_t fz_u8(fz_in *in);
uint16_t fz_u16(fz_in *in);
uint32_t fz_u32(fz_in *in);
uint64_t fz_u64(fz_in *in);
/** Borrows the next n bytes, or NULL (cursor unchanged) when fewer are left. */
const uint8_t *fz_take(fz_in *in, size_t n);

/* ---- files --------------------------------------------------------------- */

/** An in-memory file (memfd) holding data[0..n): *path receives a name any
 * open(2) accepts ("/proc/self/fd/N"). @return the fd (close it) or -1. */
int fz_memfile(const void *data, size_t n, char path[64]);
/** A NUL-terminated copy of data[0..n) (malloc; caller frees). */
char *fz_cstr(const uint8_t *data, size_t n);
/** Scratch root: $KVT_FUZZ_TMP, else /dev/shm when writable, else /tmp. */
const char *fz_tmp_root(void);
/** Creates a fresh directory under fz_tmp_root() into out; 0 or -1. */
int fz_mkdtemp(char *out, size_t cap, const char *tag);
/** Removes a directory tree (best effort). */
void fz_rmtree(const char *path);
/** Writes data[0..n) to path; 0 or -1. */
int fz_write_file(const char *path, const void *data, size_t n);

/* ---- an encoded cache state as fuzzer bytes ------------------------------- */

/* Kind selectors of the first byte (fuzz_tensor_decode, fuzz_codec_roundtrip).
 * New kinds go at the end, so that the first byte of every committed input
 * keeps its kind. */
enum { FZ_KIND_KV, FZ_KIND_ROTATING, FZ_KIND_RECURRENT, FZ_KIND_QKV, FZ_KIND_ATTACHMENT, FZ_KIND_QKVC, FZ_KIND_COUNT };
extern const char *const fz_kind_names[FZ_KIND_COUNT];

/* Largest tensor the state reader builds (bytes): keeps one input bounded. */
#define FZ_TENSOR_MAX (1u << 20)

/** Reads a cache state: u8 kind selector (mod FZ_KIND_COUNT; the attachment
 * kind reads the same layout and uses tensor 0 as the blob), i64 offset,
 * i64 min_offset, u8 n_params, i64 params, u8 n_tensors, then per tensor:
 * u8 name length, name, u8 dtype, u8 ndim, u32 dims, i64 tok_begin, i64
 * tok_end, u8 mode (bit 0: u32 byte count follows instead of dtype x shape;
 * bit 1: the owner buffer is 64 bytes larger, data at offset 32; bit 2: no
 * owner), then the data (zeros past the input's end). Tensors over
 * FZ_TENSOR_MAX bytes end the state. Free it with fz_state_free (it owns
 * its tensors' owners and the data of owner-less tensors; one state at a
 * time). *sel receives the selector. @return 0 or -1. */
int fz_state_read(fz_in *in, kvt_cache_state *st, int *sel);
void fz_state_free(kvt_cache_state *st);
/** Appends the encoding fz_state_read reads (mode 0 for every tensor) to
 * *buf (realloc'd, *len bytes). @return 0 or -1. */
int fz_state_write(const kvt_cache_state *st, int sel, uint8_t **buf, size_t *len);

/* ---- a store directory as fuzzer bytes ----------------------------------- */

/* Records: u8 name mode, u32 length, the file's bytes. Name modes (mod 4):
 * 0 the name the shard's own header implies ("<type letter><key>.safetensors"
 * from its "type" and "key" metadata, "e<zeros>" when it has none), 1 a
 * temporary name of a dead writer (".tmp.<n>"), 2 a shard name that does not
 * match the key, 3 an unrelated file. */
enum { FZ_NAME_OWN, FZ_NAME_TEMP, FZ_NAME_WRONG, FZ_NAME_OTHER };
/* The identity every store seed is written under and fuzz_store_scan opens. */
#define FZ_STORE_MODEL "fuzz-model"
#define FZ_STORE_CONFIG "fuzz-config"
#define FZ_STORE_TOKENIZER "fuzz-tokenizer"
/* The generation id fuzz_manifest builds its input under (the first id a
 * publisher writes, as in every manifest seed). */
#define FZ_PUB_GENERATION "00000001"

int fz_record_write(uint8_t **buf, size_t *len, int mode, const void *data, uint32_t n);

/** Grows *buf by n bytes of src. @return 0 or -1. */
int fz_append(uint8_t **buf, size_t *len, const void *src, size_t n);

/* ---- a directory tree as fuzzer bytes (fuzz_manifest) ---------------------- */

/* Nodes: u8 kind (mod 3), u8 path length, the path (relative to the tree's
 * root), u32 length, then that many bytes: a file's contents, a symbolic
 * link's target, nothing for a directory (a directory's length is 0). */
enum { FZ_TREE_FILE, FZ_TREE_DIR, FZ_TREE_LINK };

/** Appends one node. @return 0 or -1. */
int fz_tree_write(uint8_t **buf, size_t *len, int kind, const char *path, const void *data, uint32_t n);
/** Makes the nodes of `in` under root, at most max of them, parents made as
 * needed. A node whose path is empty, absolute, holds a NUL, an empty, "."
 * or ".." component, or would go through a symbolic link or a file made
 * before, is skipped, so nothing is ever written outside root.
 * @return the nodes made. */
int fz_tree_build(fz_in *in, const char *root, int max);

#endif
