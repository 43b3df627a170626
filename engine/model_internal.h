/*
 * engine/model_internal.h: the kvt_model struct shared by model.c (loading)
 * and forward.c (the forward pass). Never included outside engine/.
 */
#ifndef KVT_ENGINE_MODEL_INTERNAL_H
#define KVT_ENGINE_MODEL_INTERNAL_H

#include "model.h"

#include <stddef.h>
#include <stdint.h>

#define KVT__TRAILER_MAGIC "KVTX"
#define KVT__TRAILER_VERSION 1

/* Weight pointers into the mapping (borrowed from map). Shapes as in model.h. */
typedef struct kvt__weights {
    const float *token_embedding; /* (vocab, dim) */
    const float *rms_att;         /* (layer, dim) */
    const float *wq;              /* (layer, dim, dim) */
    const float *wk;              /* (layer, kv_dim, dim) */
    const float *wv;              /* (layer, kv_dim, dim) */
    const float *wo;              /* (layer, dim, dim) */
    const float *rms_ffn;         /* (layer, dim) */
    const float *w1;              /* (layer, hidden_dim, dim) */
    const float *w2;              /* (layer, dim, hidden_dim) */
    const float *w3;              /* (layer, hidden_dim, dim) */
    const float *rms_final;       /* (dim) */
    const float *wcls;            /* (vocab, dim) */
    const float *rec_wa[KVT_MODEL_MAX_LAYERS]; /* (dim, dim) per recurrent layer, else NULL */
    const float *rec_wx[KVT_MODEL_MAX_LAYERS]; /* (dim, dim) per recurrent layer, else NULL */
} kvt__weights;

/* Scratch of the forward pass, sized for KVT_MODEL_CHUNK tokens. */
typedef struct kvt__scratch {
    float *x;      /* (chunk, dim) residual stream */
    float *xb;     /* (chunk, dim) normed input */
    float *q;      /* (chunk, dim) queries; reused as attention output */
    float *att;    /* (chunk, dim) attention output */
    float *k;      /* (chunk, kv_dim) */
    float *v;      /* (chunk, kv_dim) */
    float *hb;     /* (chunk, hidden_dim) */
    float *hb2;    /* (chunk, hidden_dim) */
    float *scores; /* (2 threads, chunk, seq_len) attention scores */
    float *state;  /* (dim) recurrent state being advanced */
    float *rope_cos, *rope_sin; /* (chunk, head_size / 2) */
} kvt__scratch;

struct kvt_threads;

struct kvt_model {
    char *path;
    void *map;       /* mmap of the whole file */
    size_t map_bytes;
    kvt_model_config cfg;
    kvt__weights w;
    kvt__scratch s;
    float *scratch_block; /* one allocation behind every kvt__scratch pointer */
    size_t scores_cap;    /* floats allocated at s.scores */
    kvt_kv_rows *segs;    /* (segs_cap) runs of K/V rows (cache blocks, a ring) the attention reads */
    size_t segs_cap;
    float *conv;          /* (conv_cap) floats: prefill's K/V head slices converted to f32 for GEMM */
    size_t conv_cap;
    kvt_kv_scheme kv_scheme; /* storage scheme of the caches kvt_model_new_caches makes */
    struct kvt_threads *threads; /* worker threads of the forward pass */
    int own_gemm;           /* 1: prefill products through kernels.h, not OpenBLAS */
    /* arrays of a batched pass (decode rows and prompt rows), one allocation
     * (dec_block): per sequence (dec_cap of them), and per attention row (at
     * most KVT_MODEL_CHUNK rows run at once) */
    void *dec_block;
    const void **dec_ptrs; /* (dec_cap * n_layers) caches, sorted to find one passed twice */
    int64_t *dec_pos;      /* (dec_cap) position of each sequence's first new token */
    int64_t *dec_ctx;      /* (KVT_MODEL_CHUNK) keys each attention row attends to in the current layer */
    int32_t *dec_seg0;     /* (KVT_MODEL_CHUNK) first segment in segs of each attention row */
    int32_t *dec_nseg;     /* (KVT_MODEL_CHUNK) its segments */
    int32_t *dec_row;      /* (KVT_MODEL_CHUNK) the row of s.q / s.att it reads and writes */
    size_t dec_cap;
};

#endif
