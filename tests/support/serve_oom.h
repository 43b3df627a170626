/*
 * serve_oom.h: allocation failure at every allocation of the server's
 * request path. The process's malloc, calloc, realloc and the aligned
 * allocators are replaced (glibc allows it; they forward to glibc's own):
 * once armed, the N-th allocation made by any thread but the test's own
 * returns NULL. A server runs in the process (kvt_server_start with a prompt
 * cache and an SSD tier) beside a cache-off one; for each request kind
 * (a chat the cache has never seen, a chat that reuses a cached prefix, a
 * streamed chat, a completion of token ids) N walks over the allocations
 * the request makes: each faulted request must be answered 200 with the
 * cache-off reply, or with an OpenAI error object (4xx/5xx), or, only when
 * the failed allocation was inside libmicrohttpd (which cannot answer
 * without memory), have its connection closed; the same request then
 * succeeds with the cache-off reply (the server keeps serving).
 *
 * Not available under ASan or TSan (they own malloc): serve_oom_walk
 * returns 77 (skip).
 */
#ifndef KVT_TEST_SERVE_OOM_H
#define KVT_TEST_SERVE_OOM_H

#include <stdint.h>

#define SERVE_OOM_KINDS 4

typedef struct serve_oom_report {
    const char *kind[SERVE_OOM_KINDS];
    int64_t allocations[SERVE_OOM_KINDS]; /* allocations one request of the kind made (last count) */
    int64_t failed[SERVE_OOM_KINDS];      /* allocations failed (one per faulted request) */
    int64_t ok[SERVE_OOM_KINDS];          /* faulted requests answered 200 with the right reply */
    int64_t errors[SERVE_OOM_KINDS];      /* answered with an error object */
    int64_t dropped[SERVE_OOM_KINDS];     /* connection closed (failure inside libmicrohttpd) */
    int64_t bad;                          /* violations (printed): wrong reply, no answer outside MHD, ... */
} serve_oom_report;

/** Walks N over the allocations of each request kind, every `stride`-th
 * (1: all), starting at an offset drawn from `seed`. @return 0 when run
 * (check report.bad), 77 to skip (sanitizer build, or KVT_SHARED_DIR lacks
 * stories260K), -1 when a server cannot start. */
int serve_oom_walk(int64_t stride, uint64_t seed, int verbose, serve_oom_report *out);

#endif
