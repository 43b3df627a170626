/*
 * test_store.c: the SSD tier (kvtier/store.h, issue 5): round trips of every
 * cache kind and attachments, content-addressed block sharing, find rules
 * (trimmable vs untrimmable, the n - 1 cap, namespaces), persistence across
 * reopen with temp-file cleanup, superseding, the byte budget over the root
 * (own LRU and idle foreign identities), injected write faults (ENOSPC, EIO,
 * short and lying writes, fsync failures), refused shards with their own
 * counted reason (truncated, header over bound, offsets outside the file,
 * malformed, other identity, checksum under verify), lookups during a pending
 * write, the write-behind bound, async restore, walk/gc, and the cold-tier
 * table. Randomized parts print their seed (KVT_TEST_SEED replays).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "pc_util.h"
#include "store_util.h"
#include "oom_alloc.h"

#include "kvtier/cache.h"
#include "kvtier/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const store_cfg CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};
static const store_cfg CFG_ALL = {.n_kv = 1, .kv_dim = 8, .block = 4, .qkv = 1, .window = 6, .recurrent = 40,
                                  .attach = 33};

typedef struct fx {
    char root[512];
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    store_cfg cfg;
} fx;

static void fx_init(fx *f, const store_cfg *cfg, const char *tag)
{
    f->cfg = *cfg;
    store_tmpdir(f->root, sizeof f->root, tag);
    assert_true(f->root[0] != '\0');
    store_identity(cfg, "model-a", f->fp, &f->id);
}

static kvt_store *fx_open(fx *f, const kvt_store_options *o)
{
    kvt_store *s = NULL;
    int rc = kvt_store_open(f->root, &f->id, o, &s);
    if (rc)
        fprintf(stderr, "open: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    return s;
}

static void put_tokens(kvt_store *s, const store_cfg *cfg, const char *ns, const int32_t *t, int64_t n)
{
    kvt_entry e;
    assert_int_equal(store_make_entry(cfg, ns, t, n, &e), 0);
    int rc = kvt_store_put(s, &e);
    if (rc)
        fprintf(stderr, "put: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    kvt_entry_clear(&e);
}

static void expect_restores(kvt_store *s, const store_cfg *cfg, const char *ns, const int32_t *t, int64_t n)
{
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, n, ns, &hit), 0);
    kvt_entry got, want;
    int rc = kvt_store_restore(s, hit.handle, t, n, &got);
    if (rc)
        fprintf(stderr, "restore: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    assert_int_equal(store_make_entry(cfg, ns, t, n, &want), 0);
    assert_int_equal(store_entry_diff(&got, &want), 0);
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
}

/* ---- round trips and lookups ---------------------------------------------------- */

static void roundtrip_all_kinds(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG_ALL, "rt");
    kvt_store_options o = {.verify = 1};
    kvt_store *s = fx_open(&f, &o);
    int32_t t[11];
    pcu_seq(t, 11, 100);
    put_tokens(s, &f.cfg, "", t, 5); /* window 6 not wrapped */
    put_tokens(s, &f.cfg, "", t, 11); /* wrapped ring */
    expect_restores(s, &f.cfg, "", t, 5);
    expect_restores(s, &f.cfg, "", t, 11);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 2);     /* untrimmable: no superseding */
    assert_int_equal(st.written, 2);
    assert_int_equal(st.restores, 2);
    assert_int_equal(st.blocks, 2);      /* [0,4) and [4,8): kv + qkv tensors each */
    assert_int_equal(st.blocks_shared, 1); /* the 11-token entry reused [0,4) */
    assert_int_equal(st.longest_prefix_tokens, 11);
    /* a second put of an equal entry writes nothing */
    put_tokens(s, &f.cfg, "", t, 11);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.skipped, 1);
    assert_int_equal(st.written, 2);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

static void find_rules(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "find");
    kvt_store *s = fx_open(&f, NULL);
    int32_t a[20], p[30];
    pcu_seq(a, 20, 1);
    put_tokens(s, &f.cfg, "", a, 20);
    kvt_cold_hit hit;
    /* prompt extends the entry: whole entry usable */
    pcu_seq(p, 30, 1);
    assert_int_equal(kvt_store_find(s, p, 30, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 20);
    assert_int_equal(hit.n_tokens, 20);
    /* prompt equal to the entry: capped at n - 1 */
    assert_int_equal(kvt_store_find(s, p, 20, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 19);
    /* divergent prompt: a trimmable entry serves the common prefix */
    pcu_seq(p, 30, 1);
    p[7] = 9999;
    assert_int_equal(kvt_store_find(s, p, 30, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 7);
    /* other namespace, one-token prompt, first token differs */
    assert_int_equal(kvt_store_find(s, p, 30, "lora:x", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_find(s, p, 1, "", &hit), KVT_ENOTFOUND);
    p[0] = 5000;
    assert_int_equal(kvt_store_find(s, p, 30, "", &hit), KVT_ENOTFOUND);
    /* restore with a prompt that differs from the stored tokens is a miss */
    pcu_seq(p, 30, 1);
    assert_int_equal(kvt_store_find(s, p, 30, "", &hit), 0);
    p[3] = -1;
    kvt_entry e;
    assert_int_equal(kvt_store_restore(s, hit.handle, p, 30, &e), KVT_ENOTFOUND);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_TOKENS], 1);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);

    /* untrimmable (recurrent layer): only prompts extending all its tokens */
    store_cfg u = CFG;
    u.recurrent = 16;
    fx_init(&f, &u, "find-u");
    s = fx_open(&f, NULL);
    put_tokens(s, &f.cfg, "", a, 20);
    pcu_seq(p, 30, 1);
    assert_int_equal(kvt_store_find(s, p, 30, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 20);
    assert_int_equal(kvt_store_find(s, p, 20, "", &hit), KVT_ENOTFOUND); /* would need a trim */
    p[7] = 9999;
    assert_int_equal(kvt_store_find(s, p, 30, "", &hit), KVT_ENOTFOUND);
    /* a shorter untrimmable snapshot serves the divergent prompt */
    put_tokens(s, &f.cfg, "", a, 6);
    assert_int_equal(kvt_store_find(s, p, 30, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 6);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

static void shared_prefix_stored_once(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "share");
    kvt_store *s = fx_open(&f, NULL);
    int32_t sys[64], t[80];
    pcu_seq(sys, 64, 7);
    for (int c = 0; c < 5; c++) { /* five conversations on one 64-token system prompt */
        memcpy(t, sys, sizeof sys);
        pcu_seq(t + 64, 16, 1000 * (c + 1));
        put_tokens(s, &f.cfg, "", t, 80);
    }
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 5);
    /* 16 shared blocks once + 4 own blocks per conversation */
    assert_int_equal(st.blocks, 16 + 5 * 4);
    assert_int_equal(st.blocks_shared, 4 * 16);
    assert_int_equal(store_count_files(kvt_store_dir(s), "b"), 36);
    for (int c = 0; c < 5; c++) {
        memcpy(t, sys, sizeof sys);
        pcu_seq(t + 64, 16, 1000 * (c + 1));
        expect_restores(s, &f.cfg, "", t, 80);
    }
    /* the same tokens in another namespace are other blocks */
    put_tokens(s, &f.cfg, "lora:a", t, 80);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.blocks, 36 + 20);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

static void supersede_prefixes(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "sup");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[40];
    pcu_seq(t, 40, 3);
    put_tokens(s, &f.cfg, "", t, 10);
    put_tokens(s, &f.cfg, "", t, 25);
    put_tokens(s, &f.cfg, "", t, 40);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.superseded, 2);
    assert_int_equal(store_count_files(kvt_store_dir(s), "e"), 1);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find(s, t, 11, "", &hit), 0); /* served by the 40-token entry */
    assert_int_equal(hit.prefix_len, 10);
    assert_int_equal(hit.n_tokens, 40);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* An entry with an attachment is untrimmable: it supersedes none of its
 * kv-only ancestors, and the store never reports a usable prefix inside it
 * (only a prompt extending all of its tokens uses it). */
static void attachment_entry_rules(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "attrules");
    store_cfg with_att = CFG;
    with_att.attach = 16; /* same layers, same identity */
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[24];
    pcu_seq(t, 24, 5);
    put_tokens(s, &f.cfg, "", t, 10);
    put_tokens(s, &with_att, "", t, 20);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.superseded, 0);
    assert_int_equal(st.entries, 2);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), 0);
    int32_t q[16];
    memcpy(q, t, sizeof q);
    q[15] = -1; /* shares 15 tokens with the attachment entry */
    assert_int_equal(kvt_store_find(s, q, 16, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 10); /* the kv-only ancestor, not 15 inside the other */
    assert_int_equal(hit.n_tokens, 10);
    assert_int_equal(kvt_store_find(s, t, 21, "", &hit), 0); /* extends all of it */
    assert_int_equal(hit.prefix_len, 20);
    assert_int_equal(hit.n_tokens, 20);
    kvt_entry e;
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 21, &e), 0);
    assert_int_equal(e.n_attachments, 1);
    kvt_entry_clear(&e);
    assert_int_equal(kvt_store_close(s), 0);
    /* the same after a scan rebuilt the index */
    s = fx_open(&f, NULL);
    assert_int_equal(kvt_store_find(s, q, 16, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 10);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

static void objects_and_attachments(void **state)
{
    (void)state;
    store_cfg oc = {.attach = 100};
    fx f;
    fx_init(&f, &oc, "obj");
    kvt_store *s = fx_open(&f, NULL);
    put_tokens(s, &f.cfg, "object:img-1", NULL, 0);
    expect_restores(s, &f.cfg, "object:img-1", NULL, 0);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, NULL, 0, "object:img-2", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* ---- persistence ------------------------------------------------------------------ */

static void reopen_and_temp_cleanup(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG_ALL, "reopen");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[30];
    pcu_seq(t, 30, 50);
    put_tokens(s, &f.cfg, "", t, 30);
    put_tokens(s, &f.cfg, "ns2", t, 12);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    /* a dead writer's leftover temp file (pid far above pid_max) */
    char p[1200];
    snprintf(p, sizeof p, "%s/.tmp.2000000000.7.eabc.safetensors", dir);
    int fd = open(p, O_CREAT | O_WRONLY, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "partial", 7), 7);
    close(fd);
    s = fx_open(&f, NULL);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 2);
    assert_int_equal(st.temp_removed, 1);
    assert_int_equal(store_count_files(dir, ".tmp."), 0);
    expect_restores(s, &f.cfg, "", t, 30);
    expect_restores(s, &f.cfg, "ns2", t, 12);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* ---- faults ------------------------------------------------------------------------ */

/* The fault-injecting write layer and the store of the case running. They
 * live here, not on the case's stack, so that faults_teardown can open the
 * gate and close the store of a case whose assertion failed while its writer
 * was held: else that writer waits forever on a stack that is gone, and every
 * later case's writes queue behind it on the shared I/O worker (the suite
 * hangs instead of reporting the failure). */
static struct {
    store_faults fl;
    kvt_store_io io;
    kvt_store *s;
    char root[512];
} FLT;

static store_faults *faults_begin(kvt_store_io **io)
{
    store_faults_init(&FLT.fl, &FLT.io);
    *io = &FLT.io;
    return &FLT.fl;
}

static kvt_store *faults_open(fx *f, const kvt_store_options *o)
{
    FLT.s = fx_open(f, o);
    snprintf(FLT.root, sizeof FLT.root, "%s", f->root);
    return FLT.s;
}

static void faults_close(kvt_store *s)
{
    FLT.s = NULL;
    assert_int_equal(kvt_store_close(s), 0);
}

static int faults_teardown(void **state)
{
    (void)state;
    if (FLT.s) {
        store_faults_gate(&FLT.fl, 0);
        (void)kvt_store_close(FLT.s);
        FLT.s = NULL;
        store_rmtree(FLT.root);
    }
    return 0;
}

static void fault_case(int err, int shortw, int lie, int fsync_fail, int expect)
{
    fx f;
    fx_init(&f, &CFG, "fault");
    kvt_store_io *io;
    store_faults *fl = faults_begin(&io);
    kvt_store_options o = {.io = io};
    kvt_store *s = faults_open(&f, &o);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    pthread_mutex_lock(&fl->mu);
    fl->err = err;
    fl->short_write = shortw;
    fl->lie = lie;
    if (fsync_fail)
        fl->fail_fsync_after = fsync_fail;
    else
        fl->fail_pwrite_after = 4; /* inside the second block or the entry */
    pthread_mutex_unlock(&fl->mu);
    kvt_entry e;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 10, &e), 0);
    int rc = kvt_store_put(s, &e);
    if (lie) {
        /* A device that acknowledges bytes it did not write is silent: the
         * put succeeds, and the damage is caught when the entry is loaded. */
        assert_int_equal(rc, 0);
        kvt_cold_hit hit;
        kvt_entry got;
        assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), 0);
        assert_int_not_equal(kvt_store_restore(s, hit.handle, t, 10, &got), 0);
        assert_null(got.caches);
        kvt_store_stats st;
        kvt_store_get_stats(s, &st);
        assert_int_equal(st.restore_misses, 1);
        assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), KVT_ENOTFOUND);
        kvt_entry_clear(&e);
        faults_close(s);
        store_rmtree(f.root);
        return;
    }
    assert_int_equal(rc, expect);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.failed, 1);
    assert_int_equal(st.entries, 0);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find(s, t, 10, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(store_count_files(kvt_store_dir(s), ".tmp."), 0);
    assert_int_equal(store_count_files(kvt_store_dir(s), "e"), 0);
    /* the same entry goes through once the fault is gone */
    assert_int_equal(kvt_store_put(s, &e), 0);
    expect_restores(s, &f.cfg, "", t, 10);
    kvt_entry_clear(&e);
    faults_close(s);
    store_rmtree(f.root);
}

static void fault_enospc(void **state) { (void)state; fault_case(ENOSPC, 0, 0, 0, -ENOSPC); }
static void fault_eio(void **state) { (void)state; fault_case(EIO, 0, 0, 0, -EIO); }
static void fault_short_write(void **state) { (void)state; fault_case(ENOSPC, 1, 0, 0, -ENOSPC); }
static void fault_lying_write(void **state) { (void)state; fault_case(EIO, 0, 1, 0, 0); }
static void fault_fsync(void **state) { (void)state; fault_case(EIO, 0, 0, 2, -EIO); }

/* Blocks of 4 MB: their hashes run on a second thread and each block is
 * sealed (header written) only after the next one's payload, so a failing
 * pwrite can land in a payload or a header while another hash is running.
 * Every position must fail cleanly (nothing indexed, no temp file) and the
 * same entry must then store and restore, checksums verified. */
static void fault_pipelined_blocks(void **state)
{
    (void)state;
    const store_cfg big = {.n_kv = 2, .kv_dim = 1024, .block = 256}; /* 4 MB per block */
    int32_t t[800];
    pcu_seq(t, 800, 7);
    kvt_entry e;
    assert_int_equal(store_make_entry(&big, "", t, 800, &e), 0);
    for (int at = 1; at <= 9; at++) { /* 3 blocks x (payload, length, header) */
        fx f;
        fx_init(&f, &big, "pipe");
        kvt_store_io *io;
        store_faults *fl = faults_begin(&io);
        kvt_store_options o = {.io = io, .verify = 1};
        kvt_store *s = faults_open(&f, &o);
        pthread_mutex_lock(&fl->mu);
        fl->err = EIO;
        fl->fail_pwrite_after = at;
        pthread_mutex_unlock(&fl->mu);
        assert_int_equal(kvt_store_put(s, &e), -EIO);
        kvt_store_stats st;
        kvt_store_get_stats(s, &st);
        assert_int_equal(st.failed, 1);
        assert_int_equal(st.entries, 0);
        kvt_cold_hit hit;
        assert_int_equal(kvt_store_find(s, t, 800, "", &hit), KVT_ENOTFOUND);
        assert_int_equal(store_count_files(kvt_store_dir(s), ".tmp."), 0);
        assert_int_equal(store_count_files(kvt_store_dir(s), "e"), 0);
        assert_int_equal(kvt_store_put(s, &e), 0);
        kvt_store_get_stats(s, &st);
        assert_int_equal(st.entries, 1);
        assert_int_equal(st.blocks, 3);
        expect_restores(s, &f.cfg, "", t, 800);
        faults_close(s);
        store_rmtree(f.root);
    }
    kvt_entry_clear(&e);
}

static void write_behind_failure_counts(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "wbfail");
    kvt_store_io *io;
    store_faults *fl = faults_begin(&io);
    kvt_store_options o = {.io = io};
    kvt_store *s = faults_open(&f, &o);
    pthread_mutex_lock(&fl->mu);
    fl->err = ENOSPC;
    fl->fail_pwrite_after = 1;
    pthread_mutex_unlock(&fl->mu);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    kvt_entry e;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 10, &e), 0);
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    assert_null(e.caches); /* ownership passed */
    assert_int_equal(kvt_store_flush(s), -ENOSPC);
    assert_int_equal(kvt_store_flush(s), 0); /* reported once */
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.failed, 1);
    assert_int_equal(st.pending, 0);
    assert_int_equal(st.entries, 0);
    faults_close(s);
    store_rmtree(f.root);
}

/* ---- pending writes and the queue bound -------------------------------------------- */

static void lookup_while_pending(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "pending");
    kvt_store_io *io;
    store_faults *fl = faults_begin(&io);
    kvt_store_options o = {.io = io, .queue_max_bytes = 1};
    kvt_store *s = faults_open(&f, &o);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    store_faults_gate(fl, 1);
    kvt_entry e, e2;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 10, &e), 0);
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    store_faults_wait_blocked(fl, 1); /* the writer is inside a pwrite */
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_pending(s, t, 10, ""), 1);
    assert_int_equal(kvt_store_contains(s, t, 10, ""), 0); /* not durable yet */
    /* a pending write is found (served from the queue: see test_store_pending) */
    assert_int_equal(kvt_store_find(s, t, 10, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 9);
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), 0);
    assert_int_equal(store_count_files(kvt_store_dir(s), "e"), 0);
    assert_int_equal(store_count_files(kvt_store_dir(s), "b"), 0);
    /* the queue is bounded: a second entry does not fit while one is pending */
    int32_t t2[10];
    pcu_seq(t2, 10, 500);
    assert_int_equal(store_make_entry(&f.cfg, "", t2, 10, &e2), 0);
    assert_int_equal(kvt_store_put_async(s, &e2), KVT_EAGAIN);
    assert_non_null(e2.caches); /* still the caller's */
    kvt_entry_clear(&e2);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.pending, 1);
    assert_true(st.pending_bytes > 0);
    assert_int_equal(st.dropped, 1);
    store_faults_gate(fl, 0);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(kvt_store_pending(s, t, 10, ""), 0);
    /* kvt_store_contains: exact (tokens, ns) only; declared, but was never defined */
    assert_int_equal(kvt_store_contains(s, t, 10, ""), 1);
    assert_int_equal(kvt_store_contains(s, t, 9, ""), 0);
    assert_int_equal(kvt_store_contains(s, t, 10, "other"), 0);
    assert_int_equal(kvt_store_contains(s, t2, 10, ""), 0);
    assert_int_equal(kvt_store_contains(NULL, t, 10, ""), 0);
    assert_int_equal(kvt_store_contains(s, NULL, 10, ""), 0);
    expect_restores(s, &f.cfg, "", t, 10);
    faults_close(s);
    store_rmtree(f.root);
}

/* A NULL namespace is "" (the base model) in every lookup: find, find_exact,
 * pending (while the write is held up) and contains answer for NULL exactly
 * as for "", and never for another namespace's entry. */
static void null_ns_is_base_model(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "nullns");
    kvt_store_io *io;
    store_faults *fl = faults_begin(&io);
    kvt_store_options o = {.io = io};
    kvt_store *s = faults_open(&f, &o);
    int32_t t[10], u[10];
    pcu_seq(t, 10, 1);
    pcu_seq(u, 10, 700);
    put_tokens(s, &f.cfg, "lora:x", u, 10); /* another namespace: NULL never sees it */
    store_faults_gate(fl, 1);
    kvt_entry e;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 10, &e), 0);
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    store_faults_wait_blocked(fl, 1); /* the writer is inside a pwrite */
    assert_int_equal(kvt_store_pending(s, t, 10, ""), 1);
    assert_int_equal(kvt_store_pending(s, t, 10, NULL), 1);
    assert_int_equal(kvt_store_pending(s, t, 10, "other"), 0);
    kvt_cold_hit a, b;
    memset(&b, 0, sizeof b);
    assert_int_equal(kvt_store_find(s, t, 10, "", &a), 0);
    assert_int_equal(kvt_store_find(s, t, 10, NULL, &b), 0);
    assert_int_equal(b.prefix_len, 9);
    assert_int_equal(b.handle, a.handle);
    store_faults_gate(fl, 0);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(kvt_store_pending(s, t, 10, NULL), 0);
    assert_int_equal(kvt_store_contains(s, t, 10, NULL), 1);
    assert_int_equal(kvt_store_contains(s, u, 10, NULL), 0);
    assert_int_equal(kvt_store_contains(s, u, 10, "lora:x"), 1);
    memset(&b, 0, sizeof b);
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &a), 0);
    assert_int_equal(kvt_store_find_exact(s, t, 10, NULL, &b), 0);
    assert_int_equal(b.handle, a.handle);
    assert_int_equal(b.n_tokens, 10);
    assert_int_equal(kvt_store_find_exact(s, u, 10, NULL, &b), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_find(s, u, 10, NULL, &b), KVT_ENOTFOUND);
    expect_restores(s, &f.cfg, "", t, 10);
    faults_close(s);
    store_rmtree(f.root);
}

typedef struct acb {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, status;
    kvt_entry e;
} acb;

static void async_done(void *arg, int status, kvt_entry *e)
{
    acb *a = arg;
    pthread_mutex_lock(&a->mu);
    a->status = status;
    if (e)
        a->e = *e; /* move */
    a->done = 1;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

static void async_restore(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG_ALL, "async");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[21];
    pcu_seq(t, 21, 9);
    put_tokens(s, &f.cfg, "", t, 21);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 21, "", &hit), 0);
    acb a = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    assert_int_equal(kvt_store_restore_async(s, hit.handle, async_done, &a), 0);
    pthread_mutex_lock(&a.mu);
    while (!a.done)
        pthread_cond_wait(&a.cv, &a.mu);
    pthread_mutex_unlock(&a.mu);
    assert_int_equal(a.status, 0);
    kvt_entry want;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 21, &want), 0);
    assert_int_equal(store_entry_diff(&a.e, &want), 0);
    kvt_entry_clear(&a.e);
    kvt_entry_clear(&want);
    /* a stale handle: the callback still runs once, with the error */
    acb b = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    assert_int_equal(kvt_store_restore_async(s, 987654, async_done, &b), 0);
    pthread_mutex_lock(&b.mu);
    while (!b.done)
        pthread_cond_wait(&b.cv, &b.mu);
    pthread_mutex_unlock(&b.mu);
    assert_int_equal(b.status, KVT_ENOTFOUND);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* ---- refused shards ------------------------------------------------------------------ */

/* Writes one 10-token entry, closes, and returns the entry file's path. */
static kvt_store *one_entry(fx *f, const kvt_store_options *o, char *path, size_t cap)
{
    kvt_store *s = fx_open(f, o);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    put_tokens(s, &f->cfg, "", t, 10);
    char name[256];
    assert_int_equal(store_first_file(kvt_store_dir(s), "e", name, sizeof name), 0);
    snprintf(path, cap, "%s/%s", kvt_store_dir(s), name);
    assert_int_equal(kvt_store_close(s), 0);
    return NULL;
}

static uint64_t reopen_refused(fx *f, int reason, const kvt_store_options *o)
{
    kvt_store *s = fx_open(f, o);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), KVT_ENOTFOUND);
    for (int r = 0; r < KVT_STORE_REFUSED_COUNT; r++)
        if (r != reason && st.refused[r])
            fail_msg("refused for %s, expected only %s", kvt_store_refusal_name((kvt_store_refusal)r),
                     kvt_store_refusal_name((kvt_store_refusal)reason));
    assert_int_equal(kvt_store_close(s), 0);
    return st.refused[reason];
}

static void rewrite_header(const char *path, const char *field, uint64_t hlen_override)
{
    /* Re-serialises the header after editing it; payload kept. */
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    uint8_t lb[8];
    assert_int_equal(fread(lb, 1, 8, fp), 8);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)lb[i] << (8 * i);
    char *h = malloc(hlen + 1);
    assert_int_equal(fread(h, 1, hlen, fp), hlen);
    h[hlen] = 0;
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    size_t pl = (size_t)size - 8 - hlen;
    char *payload = malloc(pl + 1);
    fseek(fp, (long)(8 + hlen), SEEK_SET);
    assert_int_equal(fread(payload, 1, pl, fp), pl);
    fclose(fp);
    json_t *root = json_loads(h, 0, NULL);
    assert_non_null(root);
    if (!strcmp(field, "offsets")) { /* push the last tensor's end past the payload */
        const char *k;
        json_t *v;
        json_object_foreach(root, k, v)
        {
            json_t *o = json_object_get(v, "data_offsets");
            if (o && (uint64_t)json_integer_value(json_array_get(o, 1)) == pl)
                json_array_set_new(o, 1, json_integer((json_int_t)pl + 4096));
        }
    } else if (!strcmp(field, "identity")) {
        json_object_set_new(json_object_get(root, "__metadata__"), "identity", json_string("{\"model\":\"other\"}"));
    } else if (!strcmp(field, "sha256-last")) { /* the digest's last hex digit changed */
        json_t *m = json_object_get(root, "__metadata__");
        char sha[65];
        snprintf(sha, sizeof sha, "%s", json_string_value(json_object_get(m, "sha256")));
        sha[63] = sha[63] == '0' ? '1' : '0';
        json_object_set_new(m, "sha256", json_string(sha));
    } else if (!strcmp(field, "xxh3-last")) { /* the XXH3-128's last hex digit changed */
        json_t *m = json_object_get(root, "__metadata__");
        char xx[33];
        snprintf(xx, sizeof xx, "%s", json_string_value(json_object_get(m, "xxh3")));
        xx[31] = xx[31] == '0' ? '1' : '0';
        json_object_set_new(m, "xxh3", json_string(xx));
    } else if (!strncmp(field, "granule=", 8)) { /* a trim granule (qkvc entries write one) */
        json_object_set_new(json_object_get(root, "__metadata__"), "granule", json_string(field + 8));
    } else if (!strcmp(field, "dtype")) {
        const char *k;
        json_t *v;
        json_object_foreach(root, k, v) if (json_object_get(v, "dtype")) json_object_set_new(v, "dtype", json_string("F16"));
    }
    char *out = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    uint64_t nl = hlen_override ? hlen_override : strlen(out);
    fp = fopen(path, "wb");
    for (int i = 0; i < 8; i++)
        lb[i] = (uint8_t)(nl >> (8 * i));
    fwrite(lb, 1, 8, fp);
    fwrite(out, 1, strlen(out), fp);
    fwrite(payload, 1, pl, fp);
    fclose(fp);
    free(out);
    free(h);
    free(payload);
}

static void refused_truncated(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "trunc");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(truncate(path, st.st_size - 10), 0);
    assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_TRUNCATED, NULL), 1);
    store_rmtree(f.root);
}

static void refused_header_bound(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "hbound");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    char copy[1300];
    snprintf(copy, sizeof copy, "%s.orig", path);
    char cmd[3000];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", path, copy);
    assert_int_equal(system(cmd), 0);
    rewrite_header(path, "none", (uint64_t)KVT_STORE_MAX_HEADER + 1);
    assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_HEADER_BOUND, NULL), 1);
    /* a header length pointing past the end is a truncation */
    assert_int_equal(rename(copy, path), 0);
    rewrite_header(path, "none", 1u << 20);
    assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_TRUNCATED, NULL), 1);
    store_rmtree(f.root);
}

static void refused_offsets(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "offs");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    rewrite_header(path, "offsets", 0);
    assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_OFFSETS, NULL), 1);
    store_rmtree(f.root);
}

static void refused_malformed(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "malf");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    rewrite_header(path, "dtype", 0); /* F16 with an F32 byte count */
    assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_MALFORMED, NULL), 1);
    FILE *fp = fopen(path, "r+b");
    fseek(fp, 8, SEEK_SET);
    fputc('[', fp); /* not a JSON object any more */
    fclose(fp);
    assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_MALFORMED, NULL), 1);
    store_rmtree(f.root);
}

/* a shard's "granule" must be an integer in [1, n_tokens]: 0, past the
 * entry's tokens or not a number is refused as malformed, never indexed */
static void refused_granule(void **state)
{
    (void)state;
    const char *bad[] = {"granule=0", "granule=11", "granule=-4", "granule=4x"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        fx f;
        fx_init(&f, &CFG, "gran");
        char path[1200];
        one_entry(&f, NULL, path, sizeof path); /* 10 tokens */
        rewrite_header(path, bad[i], 0);
        assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_MALFORMED, NULL), 1);
        store_rmtree(f.root);
    }
}

static void refused_identity(void **state)
{
    (void)state;
    /* model-a with another shape writes into its own directory; a shard of
     * it copied into this identity's directory is refused, never served */
    fx f;
    fx_init(&f, &CFG, "ident");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    rewrite_header(path, "identity", 0);
    assert_int_equal(reopen_refused(&f, KVT_STORE_REFUSED_IDENTITY, NULL), 1);
    /* same model name, other shape: its own directory, none of these entries */
    fx g = f;
    store_cfg other = CFG;
    other.kv_dim = 16;
    store_identity(&other, "model-a", g.fp, &g.id);
    assert_string_not_equal(g.fp, f.fp);
    kvt_store *s = fx_open(&g, NULL);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.other_config_shards, 3); /* the entry and its 2 blocks: seen, never served */
    assert_true(strcmp(kvt_store_dir(s), path) != 0);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

static void bitflip_caught(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "flip");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    assert_int_equal(store_flip_byte(path, 3, 0x10), 0);
    kvt_store_options o = {.verify = 1};
    kvt_store *s = fx_open(&f, &o); /* headers are fine: indexed */
    int32_t t[10];
    pcu_seq(t, 10, 1);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), 0);
    kvt_entry e;
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 10, &e), KVT_ECORRUPT);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 1);
    assert_int_equal(st.restore_misses, 1);
    /* never offered again */
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), KVT_ENOTFOUND);
    /* written again, the new file replaces the refused one and is not
     * treated as an orphan by the budget */
    put_tokens(s, &f.cfg, "", t, 10);
    expect_restores(s, &f.cfg, "", t, 10);
    kvt_store_get_stats(s, &st);
    uint64_t bytes = st.bytes;
    assert_int_equal(kvt_store_close(s), 0);
    kvt_store_options tight = {.verify = 1, .max_bytes = bytes};
    s = fx_open(&f, &tight);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 0);
    assert_int_equal(st.bytes, bytes);
    expect_restores(s, &f.cfg, "", t, 10);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* What the index says exists is checked on disk: an entry whose file
 * another process removed (gc, its budget) is written again by the next
 * put of the same tokens, not skipped as already durable. */
static void put_rewrites_removed_entry(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "rewrite");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    put_tokens(s, &f.cfg, "", t, 10);
    char name[256], path[1400];
    assert_int_equal(store_first_file(kvt_store_dir(s), "e", name, sizeof name), 0);
    snprintf(path, sizeof path, "%s/%s", kvt_store_dir(s), name);
    assert_int_equal(unlink(path), 0); /* behind the store's back */
    put_tokens(s, &f.cfg, "", t, 10);
    assert_int_equal(access(path, F_OK), 0);
    expect_restores(s, &f.cfg, "", t, 10);
    assert_int_equal(kvt_store_close(s), 0);
    s = fx_open(&f, NULL); /* and a scan finds it */
    assert_int_equal(kvt_store_contains(s, t, 10, ""), 1);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* The block shard of `dir` whose header says it begins at token 0. */
static void first_block_file(const char *dir, char *path, size_t cap)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    int found = 0;
    while ((de = readdir(d))) {
        if (de->d_name[0] != 'b')
            continue;
        char p[1200], head[4096];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        FILE *fp = fopen(p, "rb");
        assert_non_null(fp);
        size_t n = fread(head, 1, sizeof head - 1, fp);
        fclose(fp);
        head[n] = '\0';
        if (memmem(head, n, "\"tok_begin\":\"0\"", 15)) {
            snprintf(path, cap, "%s", p);
            found++;
        }
    }
    closedir(d);
    assert_int_equal(found, 1);
}

/* A block whose payload fails its checksum leaves the index with every
 * entry that references it: an entry sharing that block is not offered
 * again (its restore could only fail), and both entries are gone. */
static void corrupt_block_drops_sharers(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "blkshare");
    kvt_store *s = fx_open(&f, NULL);
    int32_t a[10], b[10];
    pcu_seq(a, 10, 1);
    memcpy(b, a, sizeof b);
    for (int i = 4; i < 10; i++)
        b[i] = 500 + i; /* shares the first block (4 tokens) with a */
    put_tokens(s, &f.cfg, "", a, 10);
    put_tokens(s, &f.cfg, "", b, 10);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 2);
    assert_int_equal(st.blocks, 3);
    char path[1200];
    first_block_file(kvt_store_dir(s), path, sizeof path);
    assert_int_equal(store_flip_byte(path, 1, 0x10), 0);
    kvt_cold_hit hit;
    kvt_entry e;
    assert_int_equal(kvt_store_find_exact(s, a, 10, "", &hit), 0);
    assert_int_equal(kvt_store_restore(s, hit.handle, a, 10, &e), KVT_ECORRUPT);
    assert_int_equal(kvt_store_find_exact(s, b, 10, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_find_exact(s, a, 10, "", &hit), KVT_ENOTFOUND);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 1);
    assert_int_equal(kvt_store_close(s), 0);
    /* the same in read-only mode, where no reclaim removes the files: the
     * index alone must forget the sharer */
    s = fx_open(&f, NULL);
    put_tokens(s, &f.cfg, "", a, 10);
    put_tokens(s, &f.cfg, "", b, 10);
    first_block_file(kvt_store_dir(s), path, sizeof path);
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(store_flip_byte(path, 1, 0x10), 0);
    kvt_store_options ro = {.read_only = 1};
    s = fx_open(&f, &ro);
    assert_int_equal(kvt_store_find_exact(s, a, 10, "", &hit), 0);
    assert_int_equal(kvt_store_restore(s, hit.handle, a, 10, &e), KVT_ECORRUPT);
    assert_int_equal(kvt_store_find_exact(s, b, 10, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

typedef struct walk_acc {
    int files, entries, blocks, bad, checksum;
} walk_acc;

static int walk_count(void *ctx, const kvt_store_shard_info *in)
{
    walk_acc *a = ctx;
    if (in->status)
        fprintf(stderr, "walk: %s/%s status %d\n", in->dir, in->file, in->status);
    a->files++;
    a->entries += in->type == 'e';
    a->blocks += in->type == 'b';
    a->bad += in->status != 0;
    a->checksum += in->status == KVT_STORE_REFUSED_CHECKSUM + 1;
    return 0;
}

/* An entry file removed behind the store's back (another process's gc or
 * budget): the restore misses, and the entry leaves the index instead of
 * being found, and failing, on every later lookup. */
static void entry_file_removed(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "gone");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    put_tokens(s, &f.cfg, "", t, 10);
    char name[256], path[1200];
    assert_int_equal(store_first_file(kvt_store_dir(s), "e", name, sizeof name), 0);
    snprintf(path, sizeof path, "%s/%s", kvt_store_dir(s), name);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), 0);
    assert_int_equal(unlink(path), 0);
    kvt_entry e;
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 10, &e), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_find(s, t, 10, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_contains(s, t, 10, ""), 0);
    /* and it can be written again */
    put_tokens(s, &f.cfg, "", t, 10);
    expect_restores(s, &f.cfg, "", t, 10);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

static void walk_verify_and_gc(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "walk");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    walk_acc a = {0};
    assert_int_equal(kvt_store_walk(f.root, 1, walk_count, &a), 0);
    assert_int_equal(a.entries, 1);
    assert_int_equal(a.blocks, 2);
    assert_int_equal(a.bad, 0);
    assert_int_equal(store_flip_byte(path, 1, 0x5a), 0);
    memset(&a, 0, sizeof a);
    assert_int_equal(kvt_store_walk(f.root, 0, walk_count, &a), 0);
    assert_int_equal(a.bad, 0); /* headers only: not seen */
    assert_int_equal(kvt_store_walk(f.root, 1, walk_count, &a), 0);
    assert_int_equal(a.checksum, 1);
    /* files gc must never touch: another program's directory under the root,
     * a directory named like an identity without IDENTITY, a stray file */
    char other[1200], fake[1200], stray[1300];
    snprintf(other, sizeof other, "%s/notes", f.root);
    snprintf(fake, sizeof fake, "%s/0123456789abcdef0123456789abcdef", f.root);
    assert_int_equal(mkdir(other, 0755), 0);
    assert_int_equal(mkdir(fake, 0755), 0);
    snprintf(stray, sizeof stray, "%s/e0123456789abcdef0123456789abcdef.safetensors", fake);
    FILE *sf = fopen(stray, "w");
    fputs("not a shard", sf);
    fclose(sf);
    snprintf(stray, sizeof stray, "%s/keep.txt", other);
    sf = fopen(stray, "w");
    fputs("keep", sf);
    fclose(sf);
    uint64_t freed = 0;
    assert_int_equal(kvt_store_gc(f.root, 0, &freed), 0);
    assert_true(freed > 0);
    assert_int_equal(access(stray, F_OK), 0);
    assert_int_equal(store_count_files(fake, "e"), 1);
    memset(&a, 0, sizeof a);
    assert_int_equal(kvt_store_walk(f.root, 0, walk_count, &a), 0);
    assert_int_equal(a.files, 0);
    store_rmtree(f.root);
}

/* gc on a directory it may not write: an error naming the reason, not "freed 0
 * bytes" with exit 0. As root (who may remove anything) a child drops to
 * nobody for the gc; the identity directory is root's and 0555. */
static void gc_cannot_remove(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "gcperm");
    char path[1200], dir[1200];
    one_entry(&f, NULL, path, sizeof path);
    snprintf(dir, sizeof dir, "%s", path);
    *strrchr(dir, '/') = '\0';
    assert_int_equal(chmod(f.root, 0755), 0);
    assert_int_equal(chmod(dir, 0555), 0);
    int rc;
    uint64_t freed = 1;
    if (geteuid() == 0) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            if (setgid(65534) || setuid(65534))
                _exit(100);
            int r = kvt_store_gc(f.root, 0, &freed);
            _exit(r == -EACCES && freed == 0 && strstr(kvt_last_error(), "over the budget") ? 0
                  : r == 0                                                                 ? 1
                                                                                           : 2);
        }
        int st = 0;
        assert_int_equal(waitpid(pid, &st, 0), pid);
        assert_true(WIFEXITED(st));
        rc = WEXITSTATUS(st);
        if (rc == 100) {
            chmod(dir, 0755);
            store_rmtree(f.root);
            printf("cannot drop root privileges: skipping\n");
            skip();
        }
    } else {
        int r = kvt_store_gc(f.root, 0, &freed);
        rc = r == -EACCES && freed == 0 && strstr(kvt_last_error(), "over the budget") ? 0 : r == 0 ? 1 : 2;
    }
    assert_int_equal(rc, 0); /* 1: gc said it succeeded; 2: another error */
    assert_int_equal(access(path, F_OK), 0);
    assert_int_equal(chmod(dir, 0755), 0);
    /* once it may, gc removes everything */
    assert_int_equal(kvt_store_gc(f.root, 0, &freed), 0);
    assert_true(freed > 0);
    assert_int_equal(access(path, F_OK), -1);
    store_rmtree(f.root);
}

/* ---- budget --------------------------------------------------------------------------- */

static void budget_lru(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "budget");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[40];
    pcu_seq(t, 40, 1);
    put_tokens(s, &f.cfg, "", t, 40);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    uint64_t one = st.bytes; /* one 40-token entry with its blocks */
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);

    fx_init(&f, &CFG, "budget");
    kvt_store_options o = {.max_bytes = one * 3 + one / 2};
    s = fx_open(&f, &o);
    for (int c = 0; c < 6; c++) {
        pcu_seq(t, 40, 100 * (c + 1));
        put_tokens(s, &f.cfg, "", t, 40);
        if (c >= 1) { /* touch the first entry: it stays recently used */
            usleep(3000);
            pcu_seq(t, 40, 100);
            kvt_cold_hit hit;
            kvt_entry e;
            assert_int_equal(kvt_store_find_exact(s, t, 40, "", &hit), 0);
            usleep(5000);
            assert_int_equal(kvt_store_restore(s, hit.handle, t, 40, &e), 0);
            kvt_entry_clear(&e);
        }
        usleep(5000);
    }
    kvt_store_get_stats(s, &st);
    assert_true(st.root_bytes <= o.max_bytes);
    assert_int_equal(st.entries, 3);
    assert_int_equal(st.evicted, 3);
    kvt_cold_hit hit;
    pcu_seq(t, 40, 100);
    assert_int_equal(kvt_store_find_exact(s, t, 40, "", &hit), 0); /* kept: recently used */
    pcu_seq(t, 40, 200);
    assert_int_equal(kvt_store_find_exact(s, t, 40, "", &hit), KVT_ENOTFOUND);
    pcu_seq(t, 40, 500);
    assert_int_equal(kvt_store_find_exact(s, t, 40, "", &hit), 0);
    pcu_seq(t, 40, 600);
    assert_int_equal(kvt_store_find_exact(s, t, 40, "", &hit), 0);
    /* larger than the whole budget */
    kvt_store_close(s);
    kvt_store_options tiny = {.max_bytes = 100};
    s = fx_open(&f, &tiny);
    kvt_entry e;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 40, &e), 0);
    assert_int_equal(kvt_store_put(s, &e), KVT_ETOOBIG);
    /* written behind: flush reports the writer's reason, sizes included (was
     * only "write-behind write failed (larger than the whole budget)") */
    assert_int_equal(kvt_store_put_async(s, &e), 0);
    assert_int_equal(kvt_store_flush(s), KVT_ETOOBIG);
    assert_non_null(strstr(kvt_last_error(), "the budget is 100"));
    assert_int_equal(kvt_store_flush(s), 0); /* reported once */
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* While another identity's store holds its directory open (so none of its
 * files may go), a write that takes the root over budget must not evict the
 * entry it just wrote: it stays indexed and restorable, the budget is simply
 * exceeded until something evictable appears. */
static void budget_keeps_new_entry_beside_open_store(void **state)
{
    (void)state;
    fx a;
    fx_init(&a, &CFG, "budget-open");
    fx b = a;
    store_identity(&CFG, "model-b", b.fp, &b.id);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    kvt_store *sb = fx_open(&b, NULL);
    put_tokens(sb, &b.cfg, "", t, 10);
    kvt_store_stats st;
    kvt_store_get_stats(sb, &st);
    uint64_t b_bytes = st.bytes;
    assert_true(b_bytes > 0);
    /* room for one such entry and a half: A's entry (as large as B's) fits
     * alone, not beside B */
    kvt_store_options o = {.max_bytes = b_bytes * 3 / 2};
    kvt_store *sa = fx_open(&a, &o);
    put_tokens(sa, &a.cfg, "", t, 10);
    kvt_store_get_stats(sa, &st);
    assert_int_equal(st.evicted, 0);
    assert_int_equal(st.entries, 1);
    assert_int_equal(kvt_store_contains(sa, t, 10, ""), 1);
    expect_restores(sa, &a.cfg, "", t, 10);
    assert_int_equal(kvt_store_contains(sb, t, 10, ""), 1); /* and B's is untouched */
    expect_restores(sb, &b.cfg, "", t, 10);
    assert_int_equal(kvt_store_close(sa), 0);
    assert_int_equal(kvt_store_close(sb), 0);
    store_rmtree(a.root);
}

static void budget_foreign_idle(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "foreign");
    fx g = f;
    store_identity(&CFG, "model-b", g.fp, &g.id);
    kvt_store *sb = fx_open(&g, NULL);
    int32_t t[40];
    for (int c = 0; c < 3; c++) {
        pcu_seq(t, 40, 10 * (c + 1));
        put_tokens(sb, &g.cfg, "", t, 40);
    }
    kvt_store_stats st;
    kvt_store_get_stats(sb, &st);
    uint64_t b_bytes = st.bytes;
    /* while model-b's store is open its directory is not idle */
    kvt_store_options o = {.max_bytes = b_bytes / 2};
    kvt_store *sa = fx_open(&f, &o);
    pcu_seq(t, 40, 7000);
    put_tokens(sa, &f.cfg, "", t, 40);
    kvt_store_get_stats(sa, &st);
    assert_int_equal(st.evicted_foreign_files, 0);
    assert_int_equal(kvt_store_close(sb), 0);
    /* now idle: the next write evicts model-b's oldest entries first */
    pcu_seq(t, 40, 8000);
    put_tokens(sa, &f.cfg, "", t, 40);
    kvt_store_get_stats(sa, &st);
    assert_true(st.evicted_foreign_files > 0);
    assert_true(st.root_bytes <= o.max_bytes);
    assert_int_equal(kvt_store_close(sa), 0);
    store_rmtree(f.root);
}

/* ---- cold-tier table -------------------------------------------------------------------- */

static void cold_tier_table(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "tier");
    kvt_store *s = fx_open(&f, NULL);
    kvt_cold_tier tier;
    kvt_store_cold_tier(s, &tier);
    assert_ptr_equal(tier.self, s);
    int32_t t[12];
    pcu_seq(t, 12, 4);
    kvt_entry e;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 12, &e), 0);
    assert_int_equal(tier.spill(tier.self, &e), 0);
    assert_int_equal(tier.flush(tier.self), 0);
    assert_int_equal(tier.pending(tier.self, t, 12, ""), 0);
    kvt_cold_hit hit;
    assert_int_equal(tier.find(tier.self, t, 12, "", &hit), 0);
    assert_int_equal(hit.prefix_len, 11);
    kvt_entry got, want;
    assert_int_equal(tier.restore(tier.self, hit.handle, &got), 0);
    assert_int_equal(store_make_entry(&f.cfg, "", t, 12, &want), 0);
    assert_int_equal(store_entry_diff(&got, &want), 0);
    assert_int_equal(tier.store(tier.self, &want), 0); /* already durable: skipped */
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

static void bad_arguments(void **state)
{
    (void)state;
    kvt_store *s = NULL;
    kvt_store_identity id = {"m", "c", "t"};
    assert_int_equal(kvt_store_open(NULL, &id, NULL, &s), KVT_EINVAL);
    assert_int_equal(kvt_store_open("/tmp", NULL, NULL, &s), KVT_EINVAL);
    /* an empty or overlong root says so (was "root ... is NULL" and "an
     * identity string is over 1024 bytes") */
    assert_int_equal(kvt_store_open("", &id, NULL, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "root path is empty"));
    char longroot[3100];
    memset(longroot, 'a', sizeof longroot - 1);
    longroot[sizeof longroot - 1] = '\0';
    assert_int_equal(kvt_store_open(longroot, &id, NULL, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "root path is over 3000 bytes"));
    kvt_store_options o = {.lock_wait_ms = 86400001u};
    assert_int_equal(kvt_store_open("/tmp", &id, &o, &s), KVT_EINVAL);
    assert_int_equal(kvt_store_close(NULL), 0);
    kvt_store_identity bad_id = {"m\xc3", "c", "t"};
    assert_int_equal(kvt_store_open("/tmp", &bad_id, NULL, &s), KVT_EINVAL);
    fx f;
    fx_init(&f, &CFG, "args");
    s = fx_open(&f, NULL);
    int32_t t[8];
    pcu_seq(t, 8, 1);
    kvt_entry e;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 8, &e), 0);
    e.n_tokens = 7; /* layers hold 8 */
    assert_int_equal(kvt_store_put(s, &e), KVT_EINVAL);
    e.n_tokens = 8;
    const char *ns = e.ns;
    e.ns = "lora:\xff\xfe"; /* not UTF-8: a clear error, not "out of memory" */
    assert_int_equal(kvt_store_put(s, &e), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "UTF-8"));
    assert_int_equal(kvt_store_put_async(s, &e), KVT_EINVAL);
    e.ns = ns;
    /* every other entry point: the documented error, never a crash */
    kvt_cold_hit hit;
    kvt_entry out;
    assert_int_equal(kvt_store_put(NULL, &e), KVT_EINVAL);
    assert_int_equal(kvt_store_put_async(NULL, &e), KVT_EINVAL);
    assert_int_equal(kvt_store_find(NULL, t, 8, "", &hit), KVT_EINVAL);
    assert_int_equal(kvt_store_find(s, t, 8, NULL, &hit), KVT_ENOTFOUND); /* NULL ns is "": empty */
    assert_int_equal(kvt_store_find(s, NULL, 3, "", &hit), KVT_EINVAL);
    assert_int_equal(kvt_store_find(s, t, 8, "", NULL), KVT_EINVAL);
    assert_int_equal(kvt_store_find_exact(s, t, -1, "", &hit), KVT_EINVAL);
    assert_int_equal(kvt_store_find(s, t, 8, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_restore(NULL, 1, NULL, 0, &out), KVT_EINVAL);
    assert_int_equal(kvt_store_restore(s, 1, NULL, 5, &out), KVT_EINVAL);
    memset(&out, 0xab, sizeof out);
    assert_int_equal(kvt_store_restore(s, 12345, NULL, 0, &out), KVT_ENOTFOUND); /* no such handle */
    assert_null(out.caches);
    assert_int_equal(out.n_caches, 0);
    assert_int_equal(kvt_store_restore_async(s, 1, NULL, NULL), KVT_EINVAL);
    assert_int_equal(kvt_store_flush(NULL), KVT_EINVAL);
    kvt_store_stats st;
    kvt_store_get_stats(NULL, &st); /* no-op */
    kvt_store_get_stats(s, NULL);
    assert_null(kvt_store_dir(NULL));
    assert_string_equal(kvt_store_refusal_name(KVT_STORE_REFUSED_COUNT), "unknown");
    assert_string_equal(kvt_store_refusal_name(KVT_STORE_REFUSED_CHECKSUM), "checksum");
    char fp[KVT_STORE_FINGERPRINT_LEN];
    assert_int_equal(kvt_store_config_fingerprint(NULL, 1, fp), KVT_EINVAL);
    assert_int_equal(kvt_store_config_fingerprint(e.caches, -1, fp), KVT_EINVAL);
    uint64_t freed = 99;
    assert_int_equal(kvt_store_gc(NULL, 0, &freed), KVT_EINVAL);
    assert_int_equal(freed, 0);
    assert_int_equal(kvt_store_gc("/nonexistent/kvt-root", 0, &freed), -ENOENT);
    walk_acc wa = {0};
    assert_int_equal(kvt_store_walk(NULL, 0, walk_count, &wa), KVT_EINVAL);
    assert_int_equal(kvt_store_walk(f.root, 0, NULL, &wa), KVT_EINVAL);
    assert_int_equal(kvt_store_walk("/nonexistent/kvt-root", 0, walk_count, &wa), -ENOENT);
    assert_int_equal(wa.files, 0);
    kvt_entry_clear(&e);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}


/* ---- out of memory --------------------------------------------------------------------- */

/* Every allocation of put, find, restore and reopen fails once: each call
 * returns 0 or KVT_ENOMEM, nothing is refused or dropped for it, and what is
 * indexed afterwards restores exactly (ASan checks nothing leaks). */
static void out_of_memory(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG_ALL, "oom");
    int32_t t[13];
    pcu_seq(t, 13, 40);
    long k;
    int failures = 0;
    for (k = 1; k < 5000; k++) {
        kvt_store *s = fx_open(&f, NULL);
        kvt_entry e;
        assert_int_equal(store_make_entry(&f.cfg, "", t, 13, &e), 0);
        oom_arm(k);
        int rc1 = kvt_store_put(s, &e);
        kvt_cold_hit hit;
        int rc2 = kvt_store_find_exact(s, t, 13, "", &hit);
        kvt_entry got;
        int rc3 = rc2 == 0 ? kvt_store_restore(s, hit.handle, t, 13, &got) : 0;
        if (rc2 == 0 && rc3 == 0)
            kvt_entry_clear(&got);
        int rc4 = kvt_store_close(s);
        kvt_store *s2 = NULL;
        int rc5 = kvt_store_open(f.root, &f.id, NULL, &s2);
        kvt_set_allocator(NULL);
        int rcs[5] = {rc1, rc2 == KVT_ENOTFOUND && rc1 ? 0 : rc2, rc3, rc4, rc5};
        for (int i = 0; i < 5; i++) {
            if (rcs[i] == KVT_ENOMEM)
                failures++;
            else if (rcs[i] != 0)
                fail_msg("allocation %ld: call %d returned %d (%s)", k, i, rcs[i], kvt_last_error());
        }
        if (rc5 == 0) {
            kvt_store_stats st;
            kvt_store_get_stats(s2, &st);
            for (int r = 0; r < KVT_STORE_REFUSED_COUNT; r++)
                assert_int_equal(st.refused[r], 0);
            if (kvt_store_find_exact(s2, t, 13, "", &hit) == 0)
                expect_restores(s2, &f.cfg, "", t, 13);
            assert_int_equal(kvt_store_close(s2), 0);
        }
        kvt_entry_clear(&e);
        store_rmtree(f.root);
        assert_int_equal(mkdir(f.root, 0755), 0);
        if (oom_calls() < k)
            break; /* every allocation of the sequence has failed once */
    }
    printf("  out of memory injected at each of %ld allocations: %d calls failed cleanly\n", k - 1, failures);
    assert_true(k < 5000);
    assert_true(failures > 0);
    store_rmtree(f.root);
}

/* The 10-token entry of f, opened with o: found, its restore refused
 * (KVT_ECORRUPT, counted as checksum), and never offered again. */
static void refused_by_checksum(fx *f, const kvt_store_options *o)
{
    int32_t t[10];
    pcu_seq(t, 10, 1);
    kvt_cold_hit hit;
    kvt_entry e;
    kvt_store *s = fx_open(f, o);
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), 0);
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 10, &e), KVT_ECORRUPT);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 1);
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_close(s), 0);
}

/* Under verify the whole SHA-256 is compared: a digest that differs only in
 * its last byte is refused (the payload and its XXH3-128 are intact, so only
 * the verified restore and `store verify` can see it). */
static void verify_sha256_last_byte(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "shalast");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    rewrite_header(path, "sha256-last", 0);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    kvt_cold_hit hit;
    kvt_entry e;
    kvt_store *s = fx_open(&f, NULL); /* without verify: XXH3-128 only, served */
    assert_int_equal(kvt_store_find_exact(s, t, 10, "", &hit), 0);
    assert_int_equal(kvt_store_restore(s, hit.handle, t, 10, &e), 0);
    kvt_entry_clear(&e);
    assert_int_equal(kvt_store_close(s), 0);
    walk_acc a = {0};
    assert_int_equal(kvt_store_walk(f.root, 1, walk_count, &a), 0); /* store verify */
    assert_int_equal(a.checksum, 1);
    kvt_store_options o = {.verify = 1};
    refused_by_checksum(&f, &o);
    store_rmtree(f.root);
}

/* The fast checksum is compared whole on every restore, verify or not: an
 * XXH3-128 that differs only in its last byte is refused, counted, and the
 * entry leaves the index. */
static void xxh3_last_byte(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "xxhlast");
    char path[1200];
    one_entry(&f, NULL, path, sizeof path);
    rewrite_header(path, "xxh3-last", 0);
    refused_by_checksum(&f, NULL);
    store_rmtree(f.root);
}

/* A block shard written by another identity (its key is consistent with its
 * own identity) planted in this identity's directory is refused at scan,
 * counted as identity, and never indexed. */
static void refused_block_of_other_identity(void **state)
{
    (void)state;
    fx a;
    fx_init(&a, &CFG, "blkid");
    fx b = a;
    store_identity(&CFG, "model-b", b.fp, &b.id);
    char pa[1200], pb[1200];
    one_entry(&a, NULL, pa, sizeof pa);
    one_entry(&b, NULL, pb, sizeof pb);
    *strrchr(pa, '/') = '\0';
    *strrchr(pb, '/') = '\0';
    int planted = 0;
    DIR *d = opendir(pb);
    assert_non_null(d);
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] != 'b')
            continue;
        char cmd[3000];
        snprintf(cmd, sizeof cmd, "cp '%s/%s' '%s/'", pb, de->d_name, pa);
        assert_int_equal(system(cmd), 0);
        planted++;
    }
    closedir(d);
    assert_int_equal(planted, 2);
    kvt_store *s = fx_open(&a, NULL);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_IDENTITY], 2);
    assert_int_equal(st.blocks, 2); /* its own two */
    assert_int_equal(st.entries, 1);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    expect_restores(s, &a.cfg, "", t, 10);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(a.root);
}

/* ---- durability order ----------------------------------------------------------- */

/* A write layer that records, at every fsync, what it was of: a file still
 * under its temporary name ("F:<final name>"), a file under another name
 * ("X:<name>": synced after its rename), or the directory ("D:" and the
 * shard names then present). */
typedef struct order_rec {
    char ev[32][640];
    int n;
} order_rec;

static ssize_t rec_pwrite(void *ctx, int fd, const void *buf, size_t n, off_t off)
{
    (void)ctx;
    return pwrite(fd, buf, n, off);
}

static int rec_fsync(void *ctx, int fd)
{
    order_rec *r = ctx;
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    char *ev = r->n < 32 ? r->ev[r->n++] : NULL;
    if (ev && S_ISDIR(st.st_mode)) {
        snprintf(ev, 640, "D:");
        DIR *d = fdopendir(dup(fd));
        assert_non_null(d);
        rewinddir(d);
        struct dirent *de;
        while ((de = readdir(d)))
            if (strstr(de->d_name, ".safetensors") && de->d_name[0] != '.')
                snprintf(ev + strlen(ev), 640 - strlen(ev), "%s ", de->d_name);
        closedir(d);
    } else if (ev) {
        char link[64], target[4096];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t k = readlink(link, target, sizeof target - 1);
        assert_true(k > 0);
        target[k] = '\0';
        const char *base = strrchr(target, '/') + 1;
        if (!strncmp(base, ".tmp.", 5)) { /* .tmp.<pid>.<seq>.<final> */
            const char *fin = strchr(strchr(base + 5, '.') + 1, '.') + 1;
            snprintf(ev, 640, "F:%s", fin);
        } else {
            snprintf(ev, 640, "X:%s", base);
        }
    }
    return fsync(fd);
}

static int find_event(const order_rec *r, int from, const char *prefix, const char *has, const char *lacks)
{
    for (int i = from; i < r->n; i++)
        if (!strncmp(r->ev[i], prefix, strlen(prefix)) && (!has || strstr(r->ev[i], has)) &&
            (!lacks || !strstr(r->ev[i], lacks)))
            return i;
    return -1;
}

/* The put protocol, seen through the write layer: every shard is fsync'd
 * under its temporary name (before its rename), the block shards are
 * renamed and the directory fsync'd before the entry shard is renamed, and
 * the directory is fsync'd again once the entry is under its final name. A
 * SIGKILL keeps the page cache, so only this order shows what a power loss
 * would leave. */
static void durability_order(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &CFG, "order");
    order_rec rec = {.n = 0};
    kvt_store_io io = {rec_pwrite, rec_fsync, &rec};
    kvt_store_options o = {.io = &io};
    kvt_store *s = fx_open(&f, &o);
    rec.n = 0; /* what open wrote is not the put's */
    int32_t t[10];
    pcu_seq(t, 10, 1);
    put_tokens(s, &f.cfg, "", t, 10); /* two full blocks and the entry */
    char entry[256];
    assert_int_equal(store_first_file(kvt_store_dir(s), "e", entry, sizeof entry), 0);
    char *blocks[2];
    int nb = 0;
    DIR *d = opendir(kvt_store_dir(s));
    struct dirent *de;
    while ((de = readdir(d)))
        if (de->d_name[0] == 'b' && nb < 2)
            blocks[nb++] = strdup(de->d_name);
    closedir(d);
    assert_int_equal(nb, 2);
    for (int i = 0; i < rec.n; i++)
        if (rec.ev[i][0] == 'X')
            fail_msg("fsync of %s after its rename", rec.ev[i] + 2);
    char want[300];
    snprintf(want, sizeof want, "F:%s", entry);
    int fe = find_event(&rec, 0, want, NULL, NULL);
    assert_true(fe >= 0); /* the entry was synced under its temporary name */
    for (int b = 0; b < 2; b++) {
        snprintf(want, sizeof want, "F:%s", blocks[b]);
        int fb = find_event(&rec, 0, want, NULL, NULL);
        assert_true(fb >= 0);
        /* a directory fsync with the block renamed and the entry not yet */
        int db = find_event(&rec, fb + 1, "D:", blocks[b], entry);
        if (db < 0)
            fail_msg("no directory fsync after %s was renamed and before %s was", blocks[b], entry);
        free(blocks[b]);
    }
    if (find_event(&rec, fe + 1, "D:", entry, NULL) < 0)
        fail_msg("no directory fsync after %s was renamed", entry);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(roundtrip_all_kinds),
        cmocka_unit_test(find_rules),
        cmocka_unit_test(shared_prefix_stored_once),
        cmocka_unit_test(supersede_prefixes),
        cmocka_unit_test(objects_and_attachments),
        cmocka_unit_test(attachment_entry_rules),
        cmocka_unit_test(reopen_and_temp_cleanup),
        cmocka_unit_test_teardown(fault_enospc, faults_teardown),
        cmocka_unit_test_teardown(fault_eio, faults_teardown),
        cmocka_unit_test_teardown(fault_short_write, faults_teardown),
        cmocka_unit_test_teardown(fault_lying_write, faults_teardown),
        cmocka_unit_test_teardown(fault_fsync, faults_teardown),
        cmocka_unit_test_teardown(fault_pipelined_blocks, faults_teardown),
        cmocka_unit_test(durability_order),
        cmocka_unit_test_teardown(write_behind_failure_counts, faults_teardown),
        cmocka_unit_test_teardown(lookup_while_pending, faults_teardown),
        cmocka_unit_test_teardown(null_ns_is_base_model, faults_teardown),
        cmocka_unit_test(async_restore),
        cmocka_unit_test(refused_truncated),
        cmocka_unit_test(refused_header_bound),
        cmocka_unit_test(refused_offsets),
        cmocka_unit_test(refused_malformed),
        cmocka_unit_test(refused_granule),
        cmocka_unit_test(refused_identity),
        cmocka_unit_test(bitflip_caught),
        cmocka_unit_test(corrupt_block_drops_sharers),
        cmocka_unit_test(put_rewrites_removed_entry),
        cmocka_unit_test(verify_sha256_last_byte),
        cmocka_unit_test(xxh3_last_byte),
        cmocka_unit_test(refused_block_of_other_identity),
        cmocka_unit_test(walk_verify_and_gc),
        cmocka_unit_test(entry_file_removed),
        cmocka_unit_test(gc_cannot_remove),
        cmocka_unit_test(budget_lru),
        cmocka_unit_test(budget_foreign_idle),
        cmocka_unit_test(budget_keeps_new_entry_beside_open_store),
        cmocka_unit_test(cold_tier_table),
        cmocka_unit_test(bad_arguments),
        cmocka_unit_test(out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
