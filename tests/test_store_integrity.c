/*
 * test_store_integrity.c: what the SSD tier checks on every restore, by
 * default. Random single-byte flips in block and entry payloads (copied and
 * mapped shards, sync, async and exact restores) are all refused with the
 * checksum reason, the shard removed from disk and the index (entries over a
 * removed block leave the index too), and never read again; an older
 * (version 1) shard is restored only after its SHA-256 is checked; `verify`
 * refuses what restore refuses (a header edited to valid but wrong numbers);
 * a symlinked identity directory is refused by open and reported by walk,
 * never followed by gc; the read-only mode writes nothing and refuses puts;
 * write failures (a directory where a shard should be, a deleted directory)
 * are returned and counted, and the store goes on working.
 * Randomized parts print their seed (KVT_TEST_SEED replays).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "pc_util.h"
#include "store_util.h"
#include "test_seed.h"

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
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

static const store_cfg SMALL = {.n_kv = 2, .kv_dim = 8, .block = 4};          /* 512-byte blocks: copied */
static const store_cfg LARGE = {.n_kv = 2, .kv_dim = 1024, .block = 16};      /* 256 KiB blocks: mapped */
static const store_cfg MIXED = {.n_kv = 1, .kv_dim = 8, .block = 4, .recurrent = 40, .attach = 33};

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
    store_identity(cfg, "model-i", f->fp, &f->id);
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

static void put_tokens(kvt_store *s, const store_cfg *cfg, const int32_t *t, int64_t n)
{
    kvt_entry e;
    assert_int_equal(store_make_entry(cfg, "", t, n, &e), 0);
    int rc = kvt_store_put(s, &e);
    if (rc)
        fprintf(stderr, "put: %s\n", kvt_last_error());
    assert_int_equal(rc, 0);
    kvt_entry_clear(&e);
}

/* Restores (tokens t, n) exactly; returns the status and, on 0, whether the
 * bytes equal what was written (*same). */
static int restore_cmp(kvt_store *s, const store_cfg *cfg, const int32_t *t, int64_t n, int *same)
{
    kvt_cold_hit hit;
    int rc = kvt_store_find_exact(s, t, n, "", &hit);
    if (rc)
        return rc;
    kvt_entry got, want;
    rc = kvt_store_restore(s, hit.handle, t, n, &got);
    if (rc)
        return rc;
    assert_int_equal(store_make_entry(cfg, "", t, n, &want), 0);
    *same = store_entry_diff(&got, &want) == 0;
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
    return 0;
}

/* Payload bytes of a shard file (file size - 8 - header length). */
static uint64_t payload_bytes(const char *path)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    uint8_t lb[8];
    assert_int_equal(fread(lb, 1, 8, fp), 8);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)lb[i] << (8 * i);
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    fclose(fp);
    return (uint64_t)size - 8 - hlen;
}

/* Names of the files starting with prefix in dir (up to max, 256 bytes each). */
static int list_files(const char *dir, const char *prefix, char names[][256], int max)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < max)
        if (!strncmp(de->d_name, prefix, strlen(prefix)))
            snprintf(names[n++], 256, "%s", de->d_name);
    closedir(d);
    return n;
}

/* out = a "/" b, asserting it fits. */
static void join(char *out, size_t cap, const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    assert_true(la + 1 + lb < cap);
    memcpy(out, a, la);
    out[la] = '/';
    memcpy(out + la + 1, b, lb + 1);
}

static uint64_t xs_next(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* ---- every restore checks the payload ------------------------------------------------ */

/* Random single-byte flips in block payloads (and entry payloads), default
 * options (no verify): each one is refused with the checksum reason, the bad
 * shard is gone from disk, the entries over it are gone from the index, and a
 * new put of the same tokens restores right. Without the check, wrong bytes
 * were served. */
static void flips_refused(const store_cfg *cfg, const char *tag, int trials, uint64_t *seed_state)
{
    fx f;
    fx_init(&f, cfg, tag);
    int32_t t[80], t2[80];
    int64_t n = 4 * cfg->block + 3;
    pcu_seq(t, 80, 7);
    memcpy(t2, t, sizeof t);
    t2[n - 1] = 9999; /* a second entry sharing every full block with the first */
    int refused = 0, wrong = 0;
    for (int k = 0; k < trials; k++) {
        kvt_store *s = fx_open(&f, NULL);
        put_tokens(s, cfg, t, n);
        put_tokens(s, cfg, t2, n);
        char dir[1024];
        snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
        assert_int_equal(kvt_store_close(s), 0);
        char names[16][256];
        int entry = (k % 4) == 3; /* one flip in four hits an entry shard */
        int nf = list_files(dir, entry ? "e" : "b", names, 16);
        assert_int_equal(nf, entry ? 2 : 4);
        const char *victim = names[xs_next(seed_state) % (uint64_t)nf];
        char path[1400];
        snprintf(path, sizeof path, "%s/%s", dir, victim);
        uint64_t pb = payload_bytes(path);
        assert_true(pb > 0);
        long at = 1 + (long)(xs_next(seed_state) % pb);
        int mask = 1 << (xs_next(seed_state) % 8);
        assert_int_equal(store_flip_byte(path, at, mask), 0);
        s = fx_open(&f, NULL);
        int same1 = 0, same2 = 0;
        int rc1 = restore_cmp(s, cfg, t, n, &same1);
        int rc2 = restore_cmp(s, cfg, t2, n, &same2);
        wrong += (rc1 == 0 && !same1) + (rc2 == 0 && !same2);
        int ok = entry ? ((rc1 == KVT_ECORRUPT) + (rc2 == KVT_ECORRUPT) == 1 &&
                          ((rc1 == 0 && same1) || (rc2 == 0 && same2)))
                       /* both entries reference every full block: after the
                        * first refusal the second is no longer indexed */
                       : (rc1 == KVT_ECORRUPT && rc2 == KVT_ENOTFOUND);
        if (ok) {
            refused++;
            kvt_store_stats st;
            kvt_store_get_stats(s, &st);
            assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 1);
            struct stat sb;
            if (stat(path, &sb) == 0)
                fail_msg("trial %d: the corrupt shard %s is still on disk", k, victim);
        } else {
            printf("trial %d: flip at -%ld of %s: restores %d (same %d), %d (same %d)\n", k, at, victim, rc1,
                   same1, rc2, same2);
        }
        assert_int_equal(kvt_store_close(s), 0);
        /* a later open never reads it again, and the same tokens written
         * again restore right */
        s = fx_open(&f, NULL);
        kvt_store_stats st;
        kvt_store_get_stats(s, &st);
        assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 0);
        put_tokens(s, cfg, t, n);
        assert_int_equal(restore_cmp(s, cfg, t, n, &same1), 0);
        assert_true(same1);
        assert_int_equal(kvt_store_close(s), 0);
        store_rmtree(f.root);
        assert_int_equal(mkdir(f.root, 0755), 0);
    }
    printf("%s: %d flips, %d refused, %d served wrong bytes\n", tag, trials, refused, wrong);
    assert_int_equal(wrong, 0);
    assert_int_equal(refused, trials);
    store_rmtree(f.root);
}

static void bitflips_copied(void **state)
{
    (void)state;
    uint64_t x = test_seed("bitflips_copied") | 1;
    flips_refused(&SMALL, "flipS", 24, &x);
}

static void bitflips_mapped(void **state)
{
    (void)state;
    uint64_t x = test_seed("bitflips_mapped") | 1;
    flips_refused(&LARGE, "flipL", 12, &x);
}

typedef struct acb {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, status;
} acb;

static void async_done(void *arg, int status, kvt_entry *e)
{
    acb *a = arg;
    if (e)
        kvt_entry_clear(e);
    pthread_mutex_lock(&a->mu);
    a->done = 1;
    a->status = status;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

/* The async path (restore threads) checks as well: a flipped attachment
 * byte in an entry shard of an untrimmable entry is refused there. */
static void async_flip_refused(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &MIXED, "flipA");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[13];
    pcu_seq(t, 13, 3);
    put_tokens(s, &f.cfg, t, 13);
    char dir[1024], name[256], path[1400];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(store_first_file(dir, "e", name, sizeof name), 0);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    assert_int_equal(store_flip_byte(path, 1, 0x01), 0); /* the attachment is the last tensor */
    s = fx_open(&f, NULL);
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 13, "", &hit), 0);
    acb a = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
    assert_int_equal(kvt_store_restore_async(s, hit.handle, async_done, &a), 0);
    pthread_mutex_lock(&a.mu);
    while (!a.done)
        pthread_cond_wait(&a.cv, &a.mu);
    pthread_mutex_unlock(&a.mu);
    assert_int_equal(a.status, KVT_ECORRUPT);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 1);
    assert_int_equal(kvt_store_find_exact(s, t, 13, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(store_count_files(dir, "e"), 0);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

/* ---- headers ------------------------------------------------------------------------- */

/* Reads a shard: header JSON (caller frees) and payload (caller frees). */
static char *read_shard(const char *path, char **payload, size_t *pl)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    uint8_t lb[8];
    assert_int_equal(fread(lb, 1, 8, fp), 8);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)lb[i] << (8 * i);
    char *h = calloc(1, hlen + 1);
    assert_int_equal(fread(h, 1, hlen, fp), hlen);
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    *pl = (size_t)size - 8 - hlen;
    *payload = malloc(*pl + 1);
    fseek(fp, (long)(8 + hlen), SEEK_SET);
    assert_int_equal(fread(*payload, 1, *pl, fp), *pl);
    fclose(fp);
    return h;
}

/* Writes a shard with header h padded with spaces to hlen bytes. */
static void write_shard(const char *path, const char *h, size_t hlen, const char *payload, size_t pl)
{
    assert_true(strlen(h) <= hlen);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    uint8_t lb[8];
    for (int i = 0; i < 8; i++)
        lb[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    fwrite(lb, 1, 8, fp);
    fwrite(h, 1, strlen(h), fp);
    for (size_t i = strlen(h); i < hlen; i++)
        fputc(' ', fp);
    fwrite(payload, 1, pl, fp);
    assert_int_equal(fclose(fp), 0);
}

/* Makes every shard in dir a version 1 shard (no xxh3; same header length). */
static void downgrade_all(const char *dir)
{
    char names[32][256];
    int n = list_files(dir, "", names, 32);
    for (int i = 0; i < n; i++) {
        if (!strstr(names[i], ".safetensors") || names[i][0] == '.')
            continue;
        char path[2048];
        join(path, sizeof path, dir, names[i]);
        char *payload;
        size_t pl;
        char *h = read_shard(path, &payload, &pl);
        size_t hlen = strlen(h);
        json_t *root = json_loads(h, 0, NULL);
        assert_non_null(root);
        json_t *meta = json_object_get(root, "__metadata__");
        assert_non_null(json_object_get(meta, "xxh3"));
        assert_string_equal(json_string_value(json_object_get(meta, "version")), "2");
        json_object_del(meta, "xxh3");
        json_object_set_new(meta, "version", json_string("1"));
        char *out = json_dumps(root, JSON_COMPACT);
        json_decref(root);
        write_shard(path, out, hlen, payload, pl);
        free(out);
        free(h);
        free(payload);
    }
}

/* A version 1 shard (SHA-256 only) is still read, and only after its SHA-256
 * is checked: intact it restores; flipped it is refused even without verify. */
static void version1_checked_by_sha(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &SMALL, "v1");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[20];
    pcu_seq(t, 20, 1);
    put_tokens(s, &f.cfg, t, 18);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    downgrade_all(dir);
    s = fx_open(&f, NULL);
    int same = 0;
    assert_int_equal(restore_cmp(s, &f.cfg, t, 18, &same), 0);
    assert_true(same);
    assert_int_equal(kvt_store_close(s), 0);
    char name[256], path[1400];
    assert_int_equal(store_first_file(dir, "b", name, sizeof name), 0);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    assert_int_equal(store_flip_byte(path, 9, 0x04), 0);
    s = fx_open(&f, NULL);
    assert_int_equal(restore_cmp(s, &f.cfg, t, 18, &same), KVT_ECORRUPT);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.refused[KVT_STORE_REFUSED_CHECKSUM], 1);
    assert_int_equal(kvt_store_close(s), 0);
    store_rmtree(f.root);
}

typedef struct walk_acc {
    int files, bad, symlinks;
    int reason[KVT_STORE_REFUSED_COUNT];
} walk_acc;

static int walk_count(void *ctx, const kvt_store_shard_info *in)
{
    walk_acc *a = ctx;
    a->files++;
    a->bad += in->status != 0;
    a->symlinks += in->type == 'l';
    if (in->status > 0 && in->status <= KVT_STORE_REFUSED_COUNT)
        a->reason[in->status - 1]++;
    return 0;
}

/* Replaces the first occurrence of `from` by `to` (same length) in the header
 * of the entry shard of dir. */
static void edit_entry_header(const char *dir, const char *from, const char *to)
{
    assert_int_equal(strlen(from), strlen(to));
    char name[256], path[1400];
    assert_int_equal(store_first_file(dir, "e", name, sizeof name), 0);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *payload;
    size_t pl;
    char *h = read_shard(path, &payload, &pl);
    char *at = strstr(h, from);
    if (!at)
        fail_msg("'%s' not in the header %s", from, h);
    memcpy(at, to, strlen(to));
    write_shard(path, h, strlen(h), payload, pl);
    free(h);
    free(payload);
}

/* `store verify` runs the restore's own checks: header numbers edited to
 * valid JSON but wrong values (a layer's offset, its block size in the
 * layer description) are refused by restore and by verify alike (verify
 * said "ok" before). */
static void verify_checks_what_restore_checks(void **state)
{
    (void)state;
    const char *edits[][2] = {
        {"\\\"offset\\\":18", "\\\"offset\\\":17"}, /* layers JSON inside a metadata string */
        {"\\\"params\\\":[8,4]", "\\\"params\\\":[8,2]"}, /* the block size */
    };
    for (size_t k = 0; k < sizeof edits / sizeof *edits; k++) {
        fx f;
        fx_init(&f, &SMALL, "vfy");
        kvt_store *s = fx_open(&f, NULL);
        int32_t t[20];
        pcu_seq(t, 20, 1);
        put_tokens(s, &f.cfg, t, 18);
        char dir[1024];
        snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
        assert_int_equal(kvt_store_close(s), 0);
        walk_acc a;
        memset(&a, 0, sizeof a);
        assert_int_equal(kvt_store_walk(f.root, 1, walk_count, &a), 0);
        assert_int_equal(a.bad, 0);
        edit_entry_header(dir, edits[k][0], edits[k][1]);
        /* verify, which said ok, refuses it */
        memset(&a, 0, sizeof a);
        assert_int_equal(kvt_store_walk(f.root, 1, walk_count, &a), 0);
        if (a.bad != 1)
            fail_msg("edit %zu (%s): verify found %d bad shards, want 1", k, edits[k][1], a.bad);
        assert_int_equal(a.reason[KVT_STORE_REFUSED_MALFORMED], 1);
        /* as restore does, for the same reason */
        s = fx_open(&f, NULL);
        int same = 0;
        assert_int_equal(restore_cmp(s, &f.cfg, t, 18, &same), KVT_EFORMAT);
        kvt_store_stats st;
        kvt_store_get_stats(s, &st);
        assert_int_equal(st.refused[KVT_STORE_REFUSED_MALFORMED], 1);
        assert_int_equal(kvt_store_close(s), 0);
        store_rmtree(f.root);
    }
}

/* ---- a symlinked identity directory ----------------------------------------------------- */

static void symlinked_identity_refused(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &SMALL, "sym");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[20];
    pcu_seq(t, 20, 1);
    put_tokens(s, &f.cfg, t, 18);
    char dir[1024], elsewhere[1100];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    snprintf(elsewhere, sizeof elsewhere, "%s.real", f.root);
    store_rmtree(elsewhere);
    assert_int_equal(rename(dir, elsewhere), 0);
    assert_int_equal(symlink(elsewhere, dir), 0);
    int files = store_count_files(elsewhere, "");
    /* open refuses it, naming the rule (read-only too) */
    kvt_store *s2 = NULL;
    assert_int_equal(kvt_store_open(f.root, &f.id, NULL, &s2), KVT_EUNSUPPORTED);
    assert_null(s2);
    assert_non_null(strstr(kvt_last_error(), "symbolic link"));
    kvt_store_options ro = {.read_only = 1};
    assert_int_equal(kvt_store_open(f.root, &f.id, &ro, &s2), KVT_EUNSUPPORTED);
    /* walk (inspect and verify) reports it as refused, without following it */
    walk_acc a;
    memset(&a, 0, sizeof a);
    assert_int_equal(kvt_store_walk(f.root, 1, walk_count, &a), 0);
    assert_int_equal(a.files, 1);
    assert_int_equal(a.symlinks, 1);
    assert_int_equal(a.reason[KVT_STORE_REFUSED_SYMLINK], 1);
    assert_string_equal(kvt_store_refusal_name(KVT_STORE_REFUSED_SYMLINK), "symlink");
    /* gc never follows it: nothing behind the link is removed */
    uint64_t freed = 1;
    assert_int_equal(kvt_store_gc(f.root, 0, &freed), 0);
    assert_int_equal(freed, 0);
    assert_int_equal(store_count_files(elsewhere, ""), files);
    unlink(dir);
    store_rmtree(elsewhere);
    store_rmtree(f.root);
}

/* ---- read-only mode ------------------------------------------------------------------- */

/* A listing of a directory tree level: name, size, mtime of every file. */
static void snapshot(const char *dir, char *out, size_t cap)
{
    char names[64][256];
    int n = list_files(dir, "", names, 64);
    /* readdir order is stable for an unchanged directory; sort anyway */
    qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    size_t len = 0;
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (!strcmp(names[i], ".") || !strcmp(names[i], ".."))
            continue; /* the parent changes with other tests */
        char p[2048];
        join(p, sizeof p, dir, names[i]);
        struct stat st;
        assert_int_equal(lstat(p, &st), 0);
        len += (size_t)snprintf(out + len, cap - len, "%s %lld %lld.%09ld\n", names[i], (long long)st.st_size,
                                (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
        assert_true(len < cap);
    }
}

static void read_only_mode(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &SMALL, "ro");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[20];
    pcu_seq(t, 20, 1);
    put_tokens(s, &f.cfg, t, 18);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    assert_int_equal(kvt_store_close(s), 0);
    /* a dead writer's temp file, a corrupt block: read-only leaves both */
    char tmp[1400];
    snprintf(tmp, sizeof tmp, "%s/.tmp.999999999.0.bffff.safetensors", dir);
    FILE *fp = fopen(tmp, "w");
    assert_non_null(fp);
    fputs("partial", fp);
    fclose(fp);
    /* another user's exclusive lock on .lock: read-only opens anyway */
    char lockp[1100];
    snprintf(lockp, sizeof lockp, "%s/.lock", dir);
    int lfd = open(lockp, O_RDWR);
    assert_true(lfd >= 0);
    assert_int_equal(flock(lfd, LOCK_EX), 0);
    char before[8192], after[8192], rootb[4096], roota[4096];
    snapshot(dir, before, sizeof before);
    snapshot(f.root, rootb, sizeof rootb);
    kvt_store_options o = {.read_only = 1, .max_bytes = 1};
    s = fx_open(&f, &o);
    int same = 0;
    assert_int_equal(restore_cmp(s, &f.cfg, t, 18, &same), 0);
    assert_true(same);
    kvt_entry e;
    assert_int_equal(store_make_entry(&f.cfg, "", t, 10, &e), 0);
    assert_int_equal(kvt_store_put(s, &e), -EROFS);
    assert_non_null(strstr(kvt_last_error(), "read-only"));
    assert_int_equal(kvt_store_put_async(s, &e), -EROFS);
    assert_non_null(e.caches); /* still the caller's */
    kvt_cold_tier ct;
    kvt_store_cold_tier(s, &ct);
    /* the tier table says so, and refuses as tier.h asks of a read-only tier */
    assert_int_equal(ct.flags & KVT_TIER_READ_ONLY, KVT_TIER_READ_ONLY);
    assert_int_equal(ct.spill(ct.self, &e), KVT_EREADONLY);
    assert_non_null(e.caches); /* still the caller's */
    assert_int_equal(ct.store(ct.self, &e), KVT_EREADONLY);
    kvt_entry_clear(&e);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.write_refused, 4);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.restores, 1);
    assert_int_equal(kvt_store_flush(s), 0);
    assert_int_equal(kvt_store_close(s), 0);
    snapshot(dir, after, sizeof after);
    snapshot(f.root, roota, sizeof roota);
    assert_string_equal(before, after);
    assert_string_equal(rootb, roota);
    close(lfd);
    /* a corrupt shard in read-only mode: refused, left on disk, never served */
    char name[256], path[1400];
    assert_int_equal(store_first_file(dir, "b", name, sizeof name), 0);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    assert_int_equal(store_flip_byte(path, 2, 0x40), 0);
    snapshot(dir, before, sizeof before);
    s = fx_open(&f, &o);
    assert_int_equal(restore_cmp(s, &f.cfg, t, 18, &same), KVT_ECORRUPT);
    /* the sentence names the shard's fault, whichever thread read it (the
     * read runs on the I/O worker or here: kvt_io_wait keeps its message) */
    fprintf(stderr, "read-only store, flipped shard: %s\n", kvt_last_error());
    assert_non_null(strstr(kvt_last_error(), "refused (checksum): payload XXH3-128 differs"));
    assert_null(strstr(kvt_last_error(), "another restore"));
    kvt_cold_hit hit;
    assert_int_equal(kvt_store_find_exact(s, t, 18, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_close(s), 0);
    snapshot(dir, after, sizeof after);
    assert_string_equal(before, after);
    /* an identity directory that does not exist: an empty read-only store,
     * nothing created */
    fx g;
    fx_init(&g, &SMALL, "ro2");
    store_identity(&LARGE, "model-none", g.fp, &g.id);
    s = fx_open(&g, &o);
    assert_int_equal(kvt_store_find_exact(s, t, 18, "", &hit), KVT_ENOTFOUND);
    assert_int_equal(kvt_store_close(s), 0);
    assert_int_equal(store_count_files(g.root, ""), 0);
    store_rmtree(g.root);
    store_rmtree(f.root);
}

/* ---- write failures are returned and counted, never fatal ---------------------------------- */

static void write_failures_not_fatal(void **state)
{
    (void)state;
    fx f;
    fx_init(&f, &SMALL, "wfail");
    kvt_store *s = fx_open(&f, NULL);
    int32_t t[20], u[20];
    pcu_seq(t, 20, 1);
    pcu_seq(u, 20, 300);
    put_tokens(s, &f.cfg, t, 18);
    /* a directory where the next block shard should be */
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", kvt_store_dir(s));
    put_tokens(s, &f.cfg, u, 3); /* no full block: entry only */
    char names[8][256];
    assert_int_equal(list_files(dir, "e", names, 8), 2);
    kvt_entry e;
    int32_t w[20];
    pcu_seq(w, 20, 600);
    assert_int_equal(store_make_entry(&f.cfg, "", w, 5, &e), 0);
    /* find the name this entry's block will get: write it once elsewhere */
    fx g;
    fx_init(&g, &SMALL, "wfail2");
    g.id = f.id;
    kvt_store *sg = fx_open(&g, NULL);
    assert_int_equal(kvt_store_put(sg, &e), 0);
    char bname[256];
    assert_int_equal(store_first_file(kvt_store_dir(sg), "b", bname, sizeof bname), 0);
    assert_int_equal(kvt_store_close(sg), 0);
    store_rmtree(g.root);
    char bpath[1400];
    snprintf(bpath, sizeof bpath, "%s/%s", dir, bname);
    assert_int_equal(mkdir(bpath, 0755), 0);
    int rc = kvt_store_put(s, &e);
    assert_true(rc < 0);
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.failed, 1);
    int same = 0;
    assert_int_equal(restore_cmp(s, &f.cfg, t, 18, &same), 0); /* still serving */
    assert_true(same);
    assert_int_equal(store_count_files(dir, ".tmp."), 0);
    rmdir(bpath);
    assert_int_equal(kvt_store_put(s, &e), 0);
    /* the whole identity directory deleted behind the store's back */
    store_rmtree(dir);
    int32_t v[20];
    pcu_seq(v, 20, 900);
    kvt_entry e2;
    assert_int_equal(store_make_entry(&f.cfg, "", v, 9, &e2), 0);
    assert_true(kvt_store_put(s, &e2) < 0);
    assert_int_equal(kvt_store_put_async(s, &e2), 0);
    assert_true(kvt_store_flush(s) < 0);
    kvt_store_get_stats(s, &st);
    assert_int_equal(st.failed, 3);
    assert_int_equal(restore_cmp(s, &f.cfg, t, 18, &same), KVT_ENOTFOUND);
    kvt_store_close(s); /* the failures were reported by put and flush */
    kvt_entry_clear(&e);
    store_rmtree(f.root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bitflips_copied),
        cmocka_unit_test(bitflips_mapped),
        cmocka_unit_test(async_flip_refused),
        cmocka_unit_test(version1_checked_by_sha),
        cmocka_unit_test(verify_checks_what_restore_checks),
        cmocka_unit_test(symlinked_identity_refused),
        cmocka_unit_test(read_only_mode),
        cmocka_unit_test(write_failures_not_fatal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
