/*
 * bench_ssd.c: `kvtier bench ssd`: SSD tier store and restore throughput for
 * 64 MB to 1 GB of kv state, next to the raw sequential write (with fsync)
 * and read bandwidth of the same directory measured in the same run. The
 * page cache is dropped before every read (/proc/sys/vm/drop_caches when
 * permitted, else posix_fadvise(DONTNEED) on every file of the directory).
 * "restore" is the default restore, which checks the XXH3-128 of every
 * payload before handing out a byte; "restore+sha" is the strict mode
 * (--ssd-cache-verify) that checks SHA-256 as well. Goal: the default
 * (checked) restore >= 80% of raw read; store, hashes included, >= 70% of
 * raw write. Owns its temporary directory and removes it. Without --dir the
 * directory goes under $TMPDIR, or /var/tmp when TMPDIR is unset or on a
 * memory file system (tmpfs, ramfs): the figures are of a disk.
 */
#include "args.h"
#include "bench_util.h"
#include "cli.h"

#include "kvtier/cache.h"
#include "kvtier/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#define CHUNK (8u << 20)

static double now_s(void) { return (double)kvt_now_ns() / 1e9; }

static int drop_mode; /* 1 drop_caches, 2 fadvise */

static void fadvise_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' && (!de->d_name[1] || de->d_name[1] == '.'))
            continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        struct stat st;
        if (lstat(p, &st))
            continue;
        if (S_ISDIR(st.st_mode)) {
            fadvise_dir(p);
            continue;
        }
        int fd = open(p, O_RDONLY);
        if (fd >= 0) {
            fdatasync(fd);
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            close(fd);
        }
    }
    closedir(d);
}

/* Empties the page cache of everything under dir. */
static void drop_cache(const char *dir)
{
    sync();
    int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
    if (fd >= 0 && write(fd, "3\n", 2) == 2) {
        close(fd);
        drop_mode = 1;
        return;
    }
    if (fd >= 0)
        close(fd);
    fadvise_dir(dir);
    drop_mode = 2;
}

static void rmtree(const char *path)
{
    DIR *d = opendir(path);
    if (!d) {
        unlink(path);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", path, de->d_name);
        struct stat st;
        if (!lstat(p, &st) && S_ISDIR(st.st_mode))
            rmtree(p);
        else
            unlink(p);
    }
    closedir(d);
    rmdir(path);
}

/* Raw sequential write (8 MB pwrites, fsync file and directory) and, n_reads
 * times, read (the best read lands in *r_gbs; 0 reads leaves it alone). */
static int reads = 3; /* every figure is the best of this many runs */

static int raw_io(const char *dir, uint64_t bytes, const uint8_t *src, double *w_gbs, double *r_gbs,
                  int n_reads)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/raw.bin", dir);
    double t0 = now_s();
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return -errno;
    for (uint64_t off = 0; off < bytes; off += CHUNK) {
        size_t n = (size_t)(bytes - off < CHUNK ? bytes - off : CHUNK);
        if (pwrite(fd, src + (off % (64u << 20)), n, (off_t)off) != (ssize_t)n) {
            close(fd);
            return -EIO;
        }
    }
    fsync(fd);
    close(fd);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    *w_gbs = (double)bytes / (now_s() - t0) / 1e9;
    if (!n_reads) {
        unlink(p);
        return 0;
    }
    uint8_t *buf = malloc(CHUNK);
    if (!buf)
        return KVT_ENOMEM;
    uint64_t got = 0;
    *r_gbs = 0;
    for (int k = 0; k < n_reads; k++) {
        drop_cache(dir);
        t0 = now_s();
        fd = open(p, O_RDONLY);
        got = 0;
        ssize_t r;
        while (fd >= 0 && (r = read(fd, buf, CHUNK)) > 0)
            got += (uint64_t)r;
        if (fd >= 0)
            close(fd);
        double g = (double)got / (now_s() - t0) / 1e9;
        if (g > *r_gbs)
            *r_gbs = g;
    }
    free(buf);
    unlink(p);
    return got == bytes ? 0 : -EIO;
}

/* KV storage schemes a run can store: the cache dtype of each. q8 is the
 * engine's (the qkvc kind: per-channel scales per block, the open block f32);
 * q8-token the int8 layout with one f32 scale per 32 floats of a token row
 * (the qkv kind, what q8 stored before), for comparison. */
static const struct {
    const char *name;
    kvt_dtype dtype;
} k_schemes[] = {{"f32", KVT_DTYPE_F32}, {"f16", KVT_DTYPE_F16}, {"bf16", KVT_DTYPE_BF16}, {"q8", KVT_DTYPE_U8},
                 {"q8-token", KVT_DTYPE_I8}};
#define N_SCHEMES (int)(sizeof k_schemes / sizeof k_schemes[0])
#define Q8_GROUP 32

/* Replaces every f32 kv cache of e by one holding the same tokens stored as
 * scheme `sc` (f32: nothing to do). */
static int to_scheme(kvt_entry *e, int sc, int32_t kv_dim, int32_t block)
{
    if (k_schemes[sc].dtype == KVT_DTYPE_F32)
        return 0;
    for (int l = 0; l < e->n_caches; l++) {
        kvt_cache *c = NULL;
        kvt_dtype dt = k_schemes[sc].dtype;
        int rc = dt == KVT_DTYPE_I8   ? kvt_qkv_create(kv_dim, Q8_GROUP, block, &c)
                 : dt == KVT_DTYPE_U8 ? kvt_qkvc_create(kv_dim, block, &c)
                                      : kvt_kv_create_dtype(kv_dim, block, dt, &c);
        for (int64_t b = 0; !rc && b < kvt_kv_block_count(e->caches[l]); b++) {
            kvt_kv_rows r;
            if (!(rc = kvt_kv_block_rows(e->caches[l], b, &r))) {
                const void *in[2] = {r.k, r.v};
                rc = kvt_cache_append(c, r.n, in);
            }
        }
        if (rc) {
            kvt_cache_destroy(c);
            return rc;
        }
        kvt_cache_destroy(e->caches[l]);
        e->caches[l] = c;
    }
    return 0;
}

/* 1 when path is on a memory file system (tmpfs, ramfs): not a disk. */
static int on_memory_fs(const char *path)
{
    struct statfs sf;
    if (statfs(path, &sf) != 0)
        return 0;
    unsigned long t = (unsigned long)sf.f_type;
    return t == TMPFS_MAGIC || t == RAMFS_MAGIC;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier bench ssd [--dir DIR] [--sizes 64M,256M,1G] [--layers N] [--kv-dim N]\n"
               "                        [--block-tokens N] [--reads N] [--kv-dtype f32,f16,bf16,q8,q8-token]\n"
               "  store/restore GB/s of SIZE bytes of f32 kv state vs raw write+fsync / read of DIR;\n"
               "  --dir DIR: the run works in a new directory under DIR, removed at the end\n"
               "  (default: $TMPDIR, or /var/tmp when TMPDIR is unset or on tmpfs/ramfs, so the\n"
               "  figures are of a disk, not of memory; a DIR on tmpfs is used with a warning);\n"
               "  --kv-dtype (default f32): the same tokens stored in each KV storage scheme\n"
               "  (q8: 8-bit codes with per-channel scales per block, the open block in f32, as\n"
               "  the engine stores it; q8-token: int8 with an f32 scale per 32 floats of a token,\n"
               "  the layout q8 had before); \"tok/s\" is the checked restore's\n"
               "  tokens per second, \"f32-eq\" the same tokens per second as GB/s of f32 state;\n"
               "  every figure is the best of N runs (default 3), writes on fresh directories,\n"
               "  reads each after dropping the page cache\n");
}

int kvt_bench_ssd(int argc, char **argv)
{
    const char *tmpdir = getenv("TMPDIR");
    const char *base = NULL; /* --dir, else the default below */
    const char *sizes = "64M,256M,1G";
    int layers = 8, kv_dim = 1024, block = 256;
    int schemes[N_SCHEMES] = {0}, n_schemes = 1; /* indices into k_schemes; default f32 */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--dir") && v) {
            base = v;
            i++;
        } else if (!strcmp(a, "--sizes") && v) {
            sizes = v;
            i++;
        } else if (!strcmp(a, "--layers") && v) {
            layers = atoi(v);
            i++;
        } else if (!strcmp(a, "--kv-dim") && v) {
            kv_dim = atoi(v);
            i++;
        } else if (!strcmp(a, "--reads") && v) {
            reads = atoi(v);
            i++;
        } else if (!strcmp(a, "--kv-dtype") && v) {
            n_schemes = 0;
            for (const char *q = v; *q;) {
                size_t len = strcspn(q, ",");
                int found = -1;
                for (int k = 0; k < N_SCHEMES; k++)
                    if (strlen(k_schemes[k].name) == len && !strncmp(q, k_schemes[k].name, len))
                        found = k;
                if (found < 0 || n_schemes == N_SCHEMES) {
                    fprintf(stderr, "bench ssd: --kv-dtype '%s': a list of f32, f16, bf16, q8, q8-token\n", v);
                    return 2;
                }
                schemes[n_schemes++] = found;
                q += len + (q[len] == ',');
            }
            if (!n_schemes) {
                usage(stderr);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--block-tokens") && v) {
            block = atoi(v);
            i++;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (layers < 1 || kv_dim < 1 || block < 1 || reads < 1) {
        usage(stderr);
        return 2;
    }
    if (!base) {
        base = "/var/tmp";
        if (tmpdir && *tmpdir && on_memory_fs(tmpdir))
            printf("bench ssd: TMPDIR %s is a memory file system (tmpfs/ramfs): using /var/tmp\n", tmpdir);
        else if (tmpdir && *tmpdir)
            base = tmpdir;
    } else if (on_memory_fs(base)) {
        fprintf(stderr, "bench ssd: warning: --dir %s is a memory file system (tmpfs/ramfs): the figures are "
                        "not of a disk\n", base);
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/kvtier-bench-ssd-XXXXXX", base);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "bench ssd: cannot create a directory under %s: %s\n", base, strerror(errno));
        return 1;
    }
    uint8_t *src = malloc(64u << 20);
    if (!src) {
        fprintf(stderr, "bench ssd: out of memory for the 64 MiB source buffer\n");
        rmtree(dir);
        return 1;
    }
    for (size_t i = 0; i < (64u << 20); i++)
        src[i] = (uint8_t)(i * 131 + (i >> 12));
    printf("bench ssd: dir %s, %d kv layers x kv_dim %d, blocks of %d tokens\n", dir, layers, kv_dim, block);
    printf("%5s %10s %10s %10s %8s %10s %10s %8s %12s %10s %10s\n", "dtype", "state", "raw write", "store",
           "of raw", "raw read", "restore", "of raw", "restore+sha", "tok/s", "f32-eq");
    int status = 0;
    const char *p = sizes;
    int si = 0; /* the scheme of this row: each size runs every scheme */
    while (*p) {
        uint64_t bytes = 0;
        const char *end;
        if (kvt_cli_bytes(p, &bytes, &end) || (*end && *end != ',') || bytes == 0) {
            fprintf(stderr, "bench ssd: bad size list '%s'\n", sizes);
            status = 2;
            break;
        }
        kvt_entry e;
        int32_t *tok = NULL;
        int rc = kvt_bench_util_entry(kvt_bench_util_state_tokens(bytes, layers, kv_dim, 1), layers, kv_dim, block, &e,
                                      &tok);
        if (!rc && (rc = to_scheme(&e, schemes[si], kv_dim, block))) {
            kvt_entry_clear(&e);
            free(tok);
        }
        if (rc) {
            fprintf(stderr, "bench ssd: cannot build %llu bytes of state: %s\n", (unsigned long long)bytes,
                    kvt_strerror(rc));
            status = 1;
            break;
        }
        uint64_t state = 0;
        for (int l = 0; l < layers; l++)
            state += kvt_cache_bytes(e.caches[l]);
        double rw = 0, rr = 0;
        char root[4200];
        snprintf(root, sizeof root, "%s/store", dir);
        kvt_store_identity id = {"bench", "bench-config", "bench-tok"};
        kvt_store *s = NULL;
        double st_gbs = 0, rs_gbs = 0, rv_gbs = 0;
        /* writes, best of `reads`: raw and store alternate so both see the
         * same (shared, noisy) disk; each store put goes to a fresh root */
        for (int k = 0; !status && !rc && k < reads; k++) {
            double w = 0;
            if ((rc = raw_io(dir, state, src, &w, &rr, k == 0 ? reads : 0))) {
                fprintf(stderr, "bench ssd: raw I/O failed: %s\n", kvt_strerror(rc));
                status = 1;
                break;
            }
            rw = w > rw ? w : rw;
            kvt_store_close(s);
            s = NULL;
            rmtree(root);
            if ((rc = kvt_store_open(root, &id, NULL, &s)))
                break;
            double t0 = now_s();
            rc = kvt_store_put(s, &e);
            double g = (double)state / (now_s() - t0) / 1e9;
            st_gbs = g > st_gbs ? g : st_gbs;
        }
        if (!status && s) {
            for (int pass = 0; !rc && pass < 2 * reads; pass++) {
                kvt_store_close(s);
                s = NULL;
                kvt_store_options o = {.verify = pass % 2};
                drop_cache(dir);
                if ((rc = kvt_store_open(root, &id, &o, &s)))
                    break;
                kvt_cold_hit hit;
                kvt_entry got;
                double t0 = now_s();
                rc = kvt_store_find_exact(s, tok, e.n_tokens, "", &hit);
                if (!rc)
                    rc = kvt_store_restore(s, hit.handle, tok, e.n_tokens, &got);
                double dt = now_s() - t0;
                if (!rc) {
                    double g = (double)state / dt / 1e9, *best = pass % 2 ? &rv_gbs : &rs_gbs;
                    if (g > *best)
                        *best = g;
                    if (got.n_caches != layers || kvt_cache_offset(got.caches[0]) != e.n_tokens)
                        rc = KVT_EFORMAT;
                    kvt_entry_clear(&got);
                }
            }
        }
        kvt_store_close(s);
        if (rc && !status) { /* a raw I/O failure has been reported already */
            fprintf(stderr, "bench ssd: store/restore failed: %s\n", kvt_last_error());
            status = 1;
        }
        rmtree(root);
        double tok_s = (double)e.n_tokens * rs_gbs * 1e9 / (double)state;
        double f32_gbs = tok_s * (double)layers * 2.0 * (double)kv_dim * sizeof(float) / 1e9;
        kvt_entry_clear(&e);
        free(tok);
        if (status)
            break;
        printf("%5s %8.0fMB %8.2fGB/s %8.2fGB/s %7.0f%% %8.2fGB/s %8.2fGB/s %7.0f%% %10.2fGB/s %10.0f %8.2fGB/s\n",
               k_schemes[schemes[si]].name, (double)state / 1048576.0, rw, st_gbs, 100.0 * st_gbs / rw, rr, rs_gbs,
               100.0 * rs_gbs / rr, rv_gbs, tok_s, f32_gbs);
        fflush(stdout);
        if (++si == n_schemes) { /* every scheme of this size done: the next size */
            si = 0;
            p = *end == ',' ? end + 1 : end;
        }
    }
    printf("writes and reads: best of %d; page cache dropped with %s before every read\n", reads,
           drop_mode == 1 ? "/proc/sys/vm/drop_caches" : "posix_fadvise(DONTNEED) on every file");
    printf("restore: the default, XXH3-128 of every payload checked; restore+sha: --ssd-cache-verify "
           "(SHA-256 as well)\n");
    printf("goal: store >= 70%% of raw write (hashes included), checked restore >= 80%% of raw read\n");
    free(src);
    rmtree(dir);
    return status;
}
