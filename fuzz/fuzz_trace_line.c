/*
 * fuzz_trace_line.c: kvt_trace_load (tools/replay/replay.c) on arbitrary Mooncake
 * JSON-lines traces, then what `kvtier replay` does with a trace it
 * accepted: every request's prompt (kvt_trace_prompt) and the block-level
 * simulator under the reference LRU and Belady's optimum, whose hits can
 * never exceed the blocks requested, and whose peak stays within capacity.
 * The optimum never loses to LRU when no request repeats an id (the
 * Mooncake meaning: an id stands for its block and every block before it):
 * hits are judged against the set resident when a request starts, so a
 * repeated id in one request counts twice and Belady's bound does not hold.
 */
#include "fuzz_util.h"

#include "replay.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Whether some request lists an id twice. */
static int repeats_an_id(const kvt_trace *t)
{
    int rep = 0;
    int64_t *v = malloc(sizeof(int64_t) * (size_t)(t->n_ids ? t->n_ids : 1));
    for (int64_t i = 0; v && !rep && i < t->n_requests; i++) {
        const kvt_trace_request *r = &t->requests[i];
        memcpy(v, t->ids + r->first, sizeof(int64_t) * (size_t)r->n_blocks);
        qsort(v, (size_t)r->n_blocks, sizeof *v, cmp_i64);
        for (int32_t k = 1; k < r->n_blocks; k++)
            rep |= v[k] == v[k - 1];
    }
    free(v);
    return rep;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    int fd = fz_memfile(data, size, path);
    if (fd < 0)
        return 0;
    kvt_trace *t = NULL;
    int rc = kvt_trace_load(path, size % 3 == 0 ? 2 : 0, &t);
    close(fd);
    if (rc) {
        FZ_CHECK(!t, "a refused trace was returned");
        FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_ENOMEM, "load returned %d: %s", rc, kvt_last_error());
        return 0;
    }
    FZ_CHECK(t->n_requests >= 1, "an accepted trace with no request");
    int64_t blocks = 0, ids = 0;
    for (int64_t i = 0; i < t->n_requests; i++) {
        const kvt_trace_request *r = &t->requests[i];
        FZ_CHECK(r->input_length >= 1 && r->n_blocks == (r->input_length + 511) / 512 && r->first == ids,
                 "request %lld: %d tokens, %d ids from %lld", (long long)i, r->input_length, r->n_blocks,
                 (long long)r->first);
        ids += r->n_blocks;
        blocks += r->n_blocks;
        if (r->input_length <= (1 << 20)) {
            int32_t *p = malloc(sizeof(int32_t) * (size_t)r->input_length);
            FZ_CHECK(p && kvt_trace_prompt(t, r, p) == 0, "prompt of request %lld: %s", (long long)i,
                     kvt_last_error());
            for (int32_t k = 0; k < r->input_length; k++)
                FZ_CHECK(p[k] >= 0, "token %d is negative", p[k]);
            free(p);
        }
    }
    FZ_CHECK(ids == t->n_ids, "requests hold %lld ids, the trace %lld", (long long)ids, (long long)t->n_ids);
    if (blocks <= 4096) {
        kvt_replay_result lru, opt;
        int64_t cap = 1 + (int64_t)(size % 7);
        FZ_CHECK(kvt_replay_sim(t, "lru-ref", cap, NULL, NULL, &lru) == 0, "lru-ref: %s", kvt_last_error());
        FZ_CHECK(kvt_replay_sim(t, "opt", cap, NULL, NULL, &opt) == 0, "opt: %s", kvt_last_error());
        FZ_CHECK(lru.blocks == blocks && opt.blocks == blocks, "simulated %lld / %lld of %lld blocks",
                 (long long)lru.blocks, (long long)opt.blocks, (long long)blocks);
        FZ_CHECK(lru.block_hits <= blocks && opt.block_hits <= blocks &&
                     (opt.block_hits >= lru.block_hits || repeats_an_id(t)),
                 "hits: lru %lld, opt %lld of %lld blocks", (long long)lru.block_hits, (long long)opt.block_hits,
                 (long long)blocks);
        FZ_CHECK(lru.peak_blocks <= cap && opt.peak_blocks <= cap, "peak %lld / %lld over capacity %lld",
                 (long long)lru.peak_blocks, (long long)opt.peak_blocks, (long long)cap);
    }
    kvt_trace_destroy(t);
    return 0;
}
