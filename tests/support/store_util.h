/*
 * store_util.h: helpers for the SSD tier's tests: deterministic entries whose
 * state is a pure function of (config, tokens) so a test (or a parent process
 * after a crash) can rebuild the exact bytes that were written, an exact
 * comparison of two entries, directory helpers, a fault-injecting write
 * layer, the SIGKILL crash trials shared by test_store_crash and
 * test_long_store_crash, and the several-writers-one-budget run shared by
 * test_store_multiproc and test_long_store_multiproc.
 */
#ifndef KVT_TEST_STORE_UTIL_H
#define KVT_TEST_STORE_UTIL_H

#include "kvtier/store.h"
#include "kvtier/tier.h"

#include <pthread.h>
#include <stdint.h>

/** Layer layout of a test model. */
typedef struct store_cfg {
    int n_kv;          /* plain kv layers */
    int kv_dim;        /* floats per token per K */
    int block;         /* tokens per kv block */
    int qkv;           /* 1: one int8 kv layer (group 4) */
    int window;        /* > 0: one rotating layer with this window */
    int recurrent;     /* > 0: one recurrent layer of this many bytes */
    int attach;        /* > 0: one blob attachment of this many bytes */
} store_cfg;

/** Builds a kvtier-allocated entry (kvt_entry_clear frees it) for tokens in ns. State
 * at position p depends only on tokens[0..p] (causal), recurrent state and
 * attachment on all tokens. @return 0 or a kvtier error. */
int store_make_entry(const store_cfg *cfg, const char *ns, const int32_t *tokens, int64_t n, kvt_entry *out);

/** The empty caches of cfg (for kvt_store_config_fingerprint); caller
 * disposes with kvt_caches_destroy. @return layers created. */
int store_make_empty(const store_cfg *cfg, kvt_cache **caches, int max);

/** 0 when caches a and b encode identically (kind, offsets, params, tensor
 * names, dtypes, shapes, token ranges and bytes); 4 when either cannot be
 * encoded, 5 (header) or 6 (a tensor) when they differ. */
int store_cache_diff(const kvt_cache *a, const kvt_cache *b);

/** 0 when a and b hold identical ns, tokens, per-layer encoded state (kind,
 * offsets, params, tensor names, dtypes, shapes and bytes) and attachments;
 * else a line number-ish code > 0 and a message on stderr. */
int store_entry_diff(const kvt_entry *a, const kvt_entry *b);

/** Fills id with (model, fingerprint of cfg, "tok-1"); fp is the storage
 * (KVT_STORE_FINGERPRINT_LEN bytes). */
void store_identity(const store_cfg *cfg, const char *model, char *fp, kvt_store_identity *id);

/** Makes a fresh empty directory under $TMPDIR (or /tmp); path receives it. */
void store_tmpdir(char *path, size_t cap, const char *tag);
/** rm -rf of a directory tree (only under /tmp-like test dirs). */
void store_rmtree(const char *path);
/** Counts files in dir whose names start with prefix. */
int store_count_files(const char *dir, const char *prefix);
/** First file in dir whose name starts with prefix: name (cap bytes) or -1. */
int store_first_file(const char *dir, const char *prefix, char *name, size_t cap);
/** Forks a process that takes an exclusive flock on `path` (e.g. a store's
 * <dir>/.lock) and holds it for hold_ms (0: until killed; it is killed with
 * its parent too). @return its pid once it holds the lock (the caller reaps
 * it: kill + waitpid), or -1 when it could not. */
int store_hold_lock(const char *path, int hold_ms);
/** Threads of the calling process (entries of /proc/self/task); -1 when
 * that cannot be read. One read is racy: a thread that pthread_join has
 * returned for can still be listed by the kernel for a moment (its task is
 * reaped after it cleared its tid), so compare with the two below. */
int store_thread_count(void);
/** A baseline thread count: the same value read 3 times in a row 10 ms
 * apart (threads of earlier work still being reaped are gone by then), at
 * most 5 s of tries; the last value read otherwise. */
int store_thread_count_baseline(void);
/** The thread count once it settles on `want`, polled every 10 ms for up to
 * 5 s. @return the last count read (want, or what it stayed at). */
int store_thread_count_settle(int want);
/** Flips bits of one byte of a file in place: the byte `from_end` bytes
 * before its end (1 = the last byte) is xor-ed with mask. @return 0, or -1
 * when the file cannot be opened or is shorter than that. */
int store_flip_byte(const char *path, long from_end, int mask);

/** Fault-injecting write layer. */
typedef struct store_faults {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int fail_pwrite_after; /* > 0: the Nth pwrite from now fails with err (1 = the next) */
    int fail_fsync_after;  /* > 0: the Nth fsync from now fails with err */
    int err;               /* errno to inject (ENOSPC, EIO) */
    int short_write;       /* 1: a failing pwrite first writes half and reports it */
    int lie;               /* 1: a failing pwrite writes half but reports all */
    int fail_all;          /* 1: every pwrite fails with err */
    int gate_closed;       /* 1: every pwrite waits until opened */
    int waiting;           /* pwrites blocked on the gate */
    int64_t pwrites, fsyncs;
} store_faults;

void store_faults_init(store_faults *f, kvt_store_io *io);
void store_faults_gate(store_faults *f, int closed);
/** Waits until at least n pwrites are blocked on the gate. */
void store_faults_wait_blocked(store_faults *f, int n);

/** Runs `trials` SIGKILL crash trials under root (see test_store_crash.c).
 * @return 0 when every trial passed; prints the seed. */
int store_crash_trials(int trials, uint64_t seed, int verbose);

/** What store_multiproc_run saw after its writers ended (kvt_store_walk with
 * verify over the root). */
typedef struct store_mp_result {
    uint64_t bytes, biggest; /* file bytes of the root; the largest file */
    int shards, bad;         /* entry and block shards; refused files */
    int failed_writers;      /* writers that saw wrong bytes or a store error */
} store_mp_result;

/** Forks `writers` processes that each open `root` with max_bytes = max and
 * for `rounds` put (sync or write-behind) entries over three shared starts
 * and restore what they find, checking the bytes; then verifies the root.
 * @return 0 (see *out), or -1 when a process cannot be forked or waited for,
 * or kvt_store_walk's error. */
int store_multiproc_run(const char *root, int writers, int rounds, uint64_t max, uint64_t seed, store_mp_result *out);

#endif
