/*
 * synth_util.h: the small synthetic models the chat and sequence tests run
 * on (dim 32, hidden 64, 3 layers, 4 heads, 2 kv heads, own classifier).
 */
#ifndef KVT_TEST_SYNTH_UTIL_H
#define KVT_TEST_SYNTH_UTIL_H

#include <stdint.h>

/** Layer mix of a synthetic model (the tests' M_* order). */
enum { SU_PLAIN, SU_WINDOW, SU_RECURRENT, SU_HYBRID };

/** Writes model `which` (SU_*) to path with seed seed_base + which: plain
 * (all attention), window (layers 1, 2 sliding over `window`), recurrent
 * (layers 0, 2), hybrid (layer 1 window, layer 2 recurrent). Fails the
 * test (cmocka assert) when kvt_model_synth fails. */
void su_synth(int which, const char *path, int32_t vocab, int32_t seq_len, uint64_t seed_base, int32_t window);

#endif
