/*
 * test_store_faults.c: every I/O call of an SSD-tier workload failed in
 * turn through the library's I/O shim (src/base/io_shim.c), SQLite's way.
 * The workload: open a store, put an entry, queue three more through the
 * write-behind (one extends the first, one is in another namespace, one has
 * a recurrent layer and an attachment), flush, close, reopen (the scan) and
 * restore what the index offers. For each N over every call the workload
 * makes, for each fault (EIO, ENOSPC, EINTR, a short write), the N-th call
 * fails; then:
 *   - every call returned 0 or an error with a message, nothing crashed;
 *   - every restore that succeeded gave exactly the bytes that were put;
 *   - no temporary file is left in the store directory;
 *   - a reopen without faults indexes nothing partial: no shard is
 *     refused, and every indexed entry restores, SHA-256 verified, to
 *     exactly what was put.
 * Also the durability protocol seen through the shim's record: each shard
 * is created under a temporary name, written, fsync'd, renamed, and the
 * directory fsync'd after the rename; blocks are durable before the entry
 * that references them is renamed.
 * The runs of a walk are spread over worker processes (tests/support/
 * fault_walk.h; KVT_FAULT_WORKERS, default 8): every N is run and checked
 * as one after another would, and a walk under the I/O-delay shim, whose
 * runs mostly sleep in fsync and write, takes about 1/8 of the time.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "fault_walk.h"
#include "io_shim.h"
#include "pc_util.h"
#include "store_util.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const store_cfg CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};
static const store_cfg CFG_HYB = {.n_kv = 1, .kv_dim = 8, .block = 4, .recurrent = 24, .attach = 9};

/* The entries of the workload: tokens, ns and layer layout. */
typedef struct wl_entry {
    const char *ns;
    int32_t base;
    int64_t n;
    const store_cfg *cfg;
    int async;
} wl_entry;

static const wl_entry WL[] = {
    {"", 1, 10, &CFG, 0},      /* put */
    {"", 1, 17, &CFG, 1},      /* extends it: supersedes it */
    {"lora:a", 1, 9, &CFG, 1}, /* the same tokens, another namespace */
    {"", 900, 6, &CFG_HYB, 1}, /* untrimmable, with an attachment */
};
#define N_WL ((int)(sizeof WL / sizeof WL[0]))

typedef struct fx {
    char root[512];
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
} fx;

/* Both layouts share one identity: their layers differ, so does the
 * config fingerprint, but the store does not check layouts against it. */
static void fx_init(fx *f)
{
    store_tmpdir(f->root, sizeof f->root, "faults");
    store_identity(&CFG, "model-a", f->fp, &f->id);
}

typedef struct outcome {
    int opened, put_failed, flushed, reopened;
    int restored, restore_failed;
    int bad; /* a violation (printed) */
} outcome;

/* Restores every workload entry the store finds; a restore that succeeds
 * must give exactly what was put. */
static void restore_all(kvt_store *s, outcome *o, int strict)
{
    for (int i = 0; i < N_WL; i++) {
        int32_t t[32];
        pcu_seq(t, WL[i].n, WL[i].base);
        kvt_cold_hit hit;
        if (kvt_store_find_exact(s, t, WL[i].n, WL[i].ns, &hit))
            continue;
        kvt_entry got, want;
        int rc = kvt_store_restore(s, hit.handle, t, WL[i].n, &got);
        if (rc) {
            o->restore_failed++;
            if (strict) {
                fprintf(stderr, "  entry %d indexed but not restorable: %s\n", i, kvt_last_error());
                o->bad++;
            }
            continue;
        }
        if (store_make_entry(WL[i].cfg, WL[i].ns, t, WL[i].n, &want)) {
            fprintf(stderr, "  entry %d: cannot build the expected entry\n", i);
            o->bad++;
            kvt_entry_clear(&got);
            continue;
        }
        if (store_entry_diff(&got, &want)) {
            fprintf(stderr, "  entry %d restored with other bytes\n", i);
            o->bad++;
        }
        o->restored++;
        kvt_entry_clear(&got);
        kvt_entry_clear(&want);
    }
}

static void workload(fx *f, outcome *o)
{
    memset(o, 0, sizeof *o);
    kvt_store *s = NULL;
    if (kvt_store_open(f->root, &f->id, NULL, &s)) {
        if (!kvt_last_error()[0])
            o->bad++;
        return;
    }
    o->opened = 1;
    for (int i = 0; i < N_WL; i++) {
        int32_t t[32];
        pcu_seq(t, WL[i].n, WL[i].base);
        kvt_entry e;
        if (store_make_entry(WL[i].cfg, WL[i].ns, t, WL[i].n, &e)) {
            fprintf(stderr, "  entry %d: cannot build it\n", i);
            o->bad++;
            continue;
        }
        int rc = WL[i].async ? kvt_store_put_async(s, &e) : kvt_store_put(s, &e);
        if (rc) {
            o->put_failed++;
            if (!kvt_last_error()[0])
                o->bad++;
        }
        kvt_entry_clear(&e); /* put_async took the parts it queued */
    }
    o->flushed = kvt_store_flush(s) == 0;
    kvt_store_close(s); /* errors are the flush's, reported again */
    s = NULL;
    if (kvt_store_open(f->root, &f->id, NULL, &s))
        return;
    o->reopened = 1;
    restore_all(s, o, 0);
    kvt_store_close(s);
}

/* Temporary files left in the root's identity directories. */
static int temps_left(const char *root)
{
    int n = 0;
    DIR *d = opendir(root);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", root, de->d_name);
        n += store_count_files(sub, ".tmp.");
    }
    if (d)
        closedir(d);
    return n;
}

/* A reopen without faults: nothing refused, every indexed entry restores
 * (SHA-256 verified) to what was put. */
static void check_clean(fx *f, outcome *o)
{
    kvt_store_options v = {.verify = 1};
    kvt_store *s = NULL;
    if (kvt_store_open(f->root, &f->id, &v, &s)) {
        fprintf(stderr, "  reopen failed: %s\n", kvt_last_error());
        o->bad++;
        return;
    }
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    for (int r = 0; r < KVT_STORE_REFUSED_COUNT; r++)
        if (st.refused[r]) {
            fprintf(stderr, "  the reopen refused %llu shard(s): %s\n", (unsigned long long)st.refused[r],
                    kvt_store_refusal_name((kvt_store_refusal)r));
            o->bad++;
        }
    restore_all(s, o, 1);
    kvt_store_close(s);
}

/* The walk's parameters. */
typedef struct walk_arg {
    uint32_t ops;
    int err, short_write;
    const char *what;
} walk_arg;

/* One run of the walk, in a worker process (fault_walk.h): no cmocka
 * assertion here, a violation is counted in out->bad. v[]: opened, flushed,
 * reopened, put failures, restored. */
static void walk_run(int64_t n, int worker, void *ctx, fw_run *out)
{
    (void)worker;
    const walk_arg *a = ctx;
    fx f;
    fx_init(&f);
    kvt__io_fault flt = {.ops = a->ops, .fail_at = n, .err = a->err, .short_write = a->short_write};
    kvt__io_arm(&flt);
    outcome o;
    workload(&f, &o);
    kvt__io_disarm();
    out->calls = kvt__io_calls();
    out->failed = kvt__io_failures();
    if (out->failed) {
        int temps = temps_left(f.root);
        if (temps) {
            fprintf(stderr, "  %d temporary file(s) left\n", temps);
            o.bad++;
        }
        check_clean(&f, &o);
        out->ok = o.opened && o.flushed && !o.put_failed;
        if (o.bad)
            fprintf(stderr, "%s: call %lld failed: %d violation(s) (opened %d, put failures %d, flushed %d, reopened "
                    "%d)\n", a->what, (long long)n, o.bad, o.opened, o.put_failed, o.flushed, o.reopened);
    }
    out->bad = o.bad;
    out->v[0] = o.opened, out->v[1] = o.flushed, out->v[2] = o.reopened, out->v[3] = o.put_failed;
    out->v[4] = o.restored;
    store_rmtree(f.root);
}

/* Walks N over every call of the workload with this fault (over worker
 * processes: the same runs and checks as one after another); figures out. */
static void walk(const char *what, uint32_t ops, int err, int short_write, fw_result *w)
{
    walk_arg a = {ops, err, short_write, what};
    int workers = fault_walk_workers();
    int rc = fault_walk(workers, 100000, walk_run, &a, w);
    printf("  %-12s %4lld calls in the workload, each failed in turn: %4lld runs succeeded anyway, %4lld failed "
           "cleanly (%d workers)\n",
           what, (long long)w->calls, (long long)w->ok, (long long)w->failed_cleanly, workers);
    assert_int_equal(rc, 0);
    /* the fault-free run: everything stored, the extending entry superseded the first */
    const fw_run *c = &w->clean;
    assert_true(c->v[0] && c->v[1] && c->v[2] && c->v[3] == 0);
    assert_int_equal(c->v[4], 3);
    assert_int_equal(w->bad_runs, 0);
    assert_int_equal(w->walked, w->calls);
}

static void walk_eio(void **state)
{
    (void)state;
    fw_result w;
    walk("EIO", 0, EIO, 0, &w);
}

static void walk_enospc(void **state)
{
    (void)state;
    fw_result w;
    walk("ENOSPC", (1u << KVT_IO_OPEN) | (1u << KVT_IO_WRITE) | (1u << KVT_IO_PWRITE) | (1u << KVT_IO_FSYNC) |
                       (1u << KVT_IO_RENAME) | (1u << KVT_IO_FTRUNCATE),
         ENOSPC, 0, &w);
}

static void walk_eintr(void **state)
{
    (void)state;
    fw_result w;
    walk("EINTR", 0, EINTR, 0, &w);
}

static void walk_short_write(void **state)
{
    (void)state;
    fw_result w;
    walk("short write", (1u << KVT_IO_WRITE) | (1u << KVT_IO_PWRITE), ENOSPC, 1, &w);
}

/* ---- the durability protocol, from the shim's record ------------------------------ */

static const char *base_of(const char *p)
{
    const char *b = strrchr(p, '/');
    return b ? b + 1 : p;
}

/* The final name a temporary shard ".tmp.<pid>.<seq>.<final>" is written for, or NULL. */
static const char *final_of_tmp(const char *name)
{
    if (strncmp(name, ".tmp.", 5))
        return NULL;
    const char *a = strchr(name + 5, '.');
    const char *b = a ? strchr(a + 1, '.') : NULL;
    return b ? b + 1 : NULL;
}

static int find_ev(const kvt__io_event *ev, int n, int from, kvt__io_op op, const char *base, int is_dir)
{
    for (int i = from; i < n; i++)
        if (ev[i].op == op && (!base || !strcmp(base_of(ev[i].path), base)) && ev[i].is_dir == is_dir)
            return i;
    return -1;
}

static void durability_protocol(void **state)
{
    (void)state;
    fx f;
    fx_init(&f);
    kvt_store *s = NULL;
    assert_int_equal(kvt_store_open(f.root, &f.id, NULL, &s), 0);
    kvt__io_fault rec = {.record = 1}; /* no fault: record only */
    kvt__io_arm(&rec);
    int32_t t[10];
    pcu_seq(t, 10, 1);
    kvt_entry e;
    assert_int_equal(store_make_entry(&CFG, "", t, 10, &e), 0);
    assert_int_equal(kvt_store_put(s, &e), 0); /* two full blocks and the entry */
    kvt_entry_clear(&e);
    kvt__io_disarm();
    static kvt__io_event ev[512];
    int n = kvt__io_events(ev, 512);
    assert_true(n > 0 && n <= 512);
    int shards = 0, entry_rename = -1, last_block_dir_sync = -1;
    for (int r = 0; r < n; r++) {
        if (ev[r].op != KVT_IO_RENAME)
            continue;
        const char *tmp = base_of(ev[r].path), *fin = final_of_tmp(tmp);
        if (!fin || !strstr(fin, ".safetensors"))
            continue; /* IDENTITY and the like */
        assert_string_equal(base_of(ev[r].path2), fin);
        shards++;
        int op = find_ev(ev, r, 0, KVT_IO_OPEN, tmp, 0);
        int wr = find_ev(ev, r, op + 1, KVT_IO_PWRITE, tmp, 0);
        int fs = find_ev(ev, r, wr + 1, KVT_IO_FSYNC, tmp, 0);
        if (op < 0 || wr < 0 || fs < 0)
            fail_msg("%s: renamed without create (%d), write (%d) and fsync (%d) before it", fin, op, wr, fs);
        assert_int_equal(find_ev(ev, n, r + 1, KVT_IO_FSYNC, fin, 0), -1); /* nothing synced after the rename */
        int ds = find_ev(ev, n, r + 1, KVT_IO_FSYNC, NULL, 1);
        if (ds < 0)
            fail_msg("%s: no directory fsync after its rename", fin);
        if (fin[0] == 'e')
            entry_rename = r;
        else if (ds > last_block_dir_sync)
            last_block_dir_sync = ds;
    }
    assert_int_equal(shards, 3);
    assert_true(entry_rename >= 0);
    if (!(last_block_dir_sync >= 0 && last_block_dir_sync < entry_rename))
        fail_msg("the entry was renamed (event %d) before its blocks' renames were made durable (directory fsync %d)",
                 entry_rename, last_block_dir_sync);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

int main(void)
{
    /* tmpfs when there is one: the walks make thousands of fsyncs, which
     * the shim sees all the same */
    if (!getenv("TMPDIR") && access("/dev/shm", W_OK) == 0)
        setenv("TMPDIR", "/dev/shm", 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(durability_protocol),
        cmocka_unit_test(walk_eio),
        cmocka_unit_test(walk_enospc),
        cmocka_unit_test(walk_eintr),
        cmocka_unit_test(walk_short_write),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
