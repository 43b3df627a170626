/*
 * serve_crash.h: crash trials of `kvtier serve --ssd-cache`: a server under
 * load from 8 clients (multi-turn chats sharing a system prompt) is killed
 * with SIGKILL at a random moment and restarted, trial after trial, on the
 * same SSD directory. Every 200 reply, before and after each restart, is
 * compared with the reply of a cache-off server (--prompt-cache 0) to the
 * same request; after each kill `kvtier store verify` must pass; after each
 * restart a probe conversation whose first turn reached the SSD tier must
 * be served from it (reused_tokens.ssd, or .remote through Redis, > 0). Used by test_serve_crash (a
 * few trials in `make test`) and test_long_serve_crash (200, label long).
 *
 * With Redis (serve_crash_opts.redis): a redis-server is started and two
 * servers share it (--redis), each with its own SSD directory: the one
 * killed and restarted (A, half the clients) and a survivor (B, the other
 * half, never killed). Before every third restart A's SSD directory is
 * wiped, so its probe can only be served through Redis; every probe must
 * still reuse cached tokens.
 */
#ifndef KVT_TEST_SERVE_CRASH_H
#define KVT_TEST_SERVE_CRASH_H

#include <stdint.h>

typedef struct serve_crash_report {
    int trials;           /* trials run (server started, loaded, killed) */
    int64_t replies;      /* 200 replies compared with the cache-off server */
    int64_t wrong;        /* of them, different from it */
    int64_t errors;       /* non-200 answers (429, 503 while loading...) */
    int64_t dropped;      /* requests cut by the kill (no answer) */
    int unclean;          /* `store verify` failures after a kill */
    int probe_ssd_hits;   /* restarts whose probe was served from the SSD tier */
    int64_t ssd_tokens;   /* prompt tokens reused from the SSD tier, all replies */
    int final_stop_rc;    /* exit status of the last server, stopped by SIGTERM */
    int redis_probe_hits; /* with Redis: restarts on a wiped SSD directory whose probe reused tokens */
    int redis_wipes;      /* with Redis: restarts on a wiped SSD directory */
    int64_t survivor_replies; /* with Redis: 200 replies of the survivor (included in replies) */
} serve_crash_report;

/** Options of the trials. Zero-initialise. */
typedef struct serve_crash_opts {
    int redis; /* 1: two servers share a redis-server (see above); skipped without redis-server */
} serve_crash_opts;

/** Runs `trials` trials with this seed (kill times, request order). Needs
 * KVT_BIN and stories260K under KVT_SHARED_DIR. @return 0 when run (check
 * the report), 77 when the model or binary is missing (skip), -1 when a
 * server could not be started. Prints one line per trial when verbose. */
int serve_crash_trials(int trials, uint64_t seed, int verbose, serve_crash_report *out);
/** The same with options (o may be NULL). */
int serve_crash_trials_opts(int trials, uint64_t seed, int verbose, const serve_crash_opts *o, serve_crash_report *out);

/** The whole test: runs the trials with the seed of test_seed(name) and
 * asserts (cmocka) 0 wrong replies, 0 unclean stores, the probe served from
 * the SSD tier after every restart, a clean last stop; skips without the
 * model. */
void serve_crash_run(const char *name, int trials);
/** The same with options (o may be NULL); with Redis it also asserts that
 * every probe after a wipe reused tokens through Redis. */
void serve_crash_run_opts(const char *name, int trials, const serve_crash_opts *o);

#endif
