/*
 * synth_util.c: synthetic models for the chat and sequence tests (see
 * synth_util.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "synth_util.h"

#include "model.h"
#include "kvtier/common.h"

#include <string.h>

void su_synth(int which, const char *path, int32_t vocab, int32_t seq_len, uint64_t seed_base, int32_t window)
{
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    p.dim = 32;
    p.hidden_dim = 64;
    p.n_layers = 3;
    p.n_heads = 4;
    p.n_kv_heads = 2;
    p.vocab_size = vocab;
    p.seq_len = seq_len;
    p.seed = seed_base + (uint64_t)which;
    p.separate_classifier = 1; /* a tied classifier with random weights repeats its input */
    switch (which) {
    case SU_WINDOW:
        p.layer_kind[1] = p.layer_kind[2] = KVT_LAYER_WINDOW;
        p.sliding_window = window;
        break;
    case SU_RECURRENT:
        p.layer_kind[0] = p.layer_kind[2] = KVT_LAYER_RECURRENT;
        break;
    case SU_HYBRID:
        p.layer_kind[1] = KVT_LAYER_WINDOW;
        p.layer_kind[2] = KVT_LAYER_RECURRENT;
        p.sliding_window = window;
        break;
    default:
        break;
    }
    int rc = kvt_model_synth(&p, path);
    if (rc)
        print_message("synth %s: %s\n", path, kvt_last_error());
    assert_int_equal(rc, 0);
}
