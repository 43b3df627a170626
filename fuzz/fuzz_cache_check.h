/*
 * fuzz_cache_check.h: checks a cache must pass whatever built it (a decode
 * of untrusted bytes, or create + append from fuzzer data): its range, its
 * readers, encode -> decode -> encode giving the same state, clone, trim and
 * append. Shared by fuzz_tensor_decode and fuzz_codec_roundtrip.
 */
#ifndef KVT_FUZZ_CACHE_CHECK_H
#define KVT_FUZZ_CACHE_CHECK_H

#include "fuzz_util.h"

/** Whether two encoded states are equal: kind, offsets, params, and each
 * tensor's name, dtype, shape, token range and bytes. On a difference
 * *why names it. */
int fz_state_equal(const kvt_cache_state *a, const kvt_cache_state *b, const char **why);

/** Runs the checks on c (not modified: clones are used). `in` supplies the
 * trim lengths and appended values. */
void fz_cache_exercise(const kvt_cache *c, fz_in *in);

#endif
