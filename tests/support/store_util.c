/*
 * store_util.c: test helpers for the SSD tier (see store_util.h). Builds
 * deterministic entries, compares entries byte for byte, injects write
 * faults, and runs the SIGKILL crash trials. Test-only: may print and
 * allocate with malloc; never used by the library.
 */
#include "store_util.h"
#include "pc_util.h"
#include "test_rng.h"

#include "kvtier/cache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- deterministic entries ------------------------------------------------------ */

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
    return h ^ (h >> 31);
}

static float kv_val(uint64_t h, int layer, int which, int j)
{
    uint64_t x = mix(mix(h, (uint64_t)layer * 2 + (uint64_t)which), (uint64_t)j);
    return (float)(x % 20001) * 0.001f - 10.0f;
}

static int append_kv(kvt_cache *c, int layer, int d, const int32_t *tokens, int64_t n)
{
    const int64_t chunk = 16;
    float *k = malloc(sizeof(float) * (size_t)(chunk * d)), *v = malloc(sizeof(float) * (size_t)(chunk * d));
    uint64_t h = 1469598103934665603ull;
    int rc = (!k || !v) ? KVT_ENOMEM : 0;
    for (int64_t p0 = 0; !rc && p0 < n; p0 += chunk) {
        int64_t m = n - p0 < chunk ? n - p0 : chunk;
        for (int64_t i = 0; i < m; i++) {
            h = mix(h, (uint32_t)tokens[p0 + i]);
            for (int j = 0; j < d; j++) {
                k[i * d + j] = kv_val(h, layer, 0, j);
                v[i * d + j] = kv_val(h, layer, 1, j);
            }
        }
        const void *in[2] = {k, v};
        rc = kvt_cache_append(c, m, in);
    }
    free(k);
    free(v);
    return rc;
}

static int n_layers(const store_cfg *cfg)
{
    return cfg->n_kv + (cfg->qkv ? 1 : 0) + (cfg->window > 0) + (cfg->recurrent > 0);
}

int store_make_empty(const store_cfg *cfg, kvt_cache **caches, int max)
{
    int L = 0, rc = 0;
    for (int i = 0; i < cfg->n_kv && L < max && !rc; i++)
        if (!(rc = kvt_kv_create(cfg->kv_dim, cfg->block, &caches[L])))
            L++;
    if (cfg->qkv && L < max && !rc && !(rc = kvt_qkv_create(cfg->kv_dim, 4, cfg->block, &caches[L])))
        L++;
    if (cfg->window > 0 && L < max && !rc && !(rc = kvt_rotating_create(cfg->kv_dim, cfg->window, 2, &caches[L])))
        L++;
    if (cfg->recurrent > 0 && L < max && !rc && !(rc = kvt_recurrent_create((size_t)cfg->recurrent, &caches[L])))
        L++;
    return L;
}

int store_make_entry(const store_cfg *cfg, const char *ns, const int32_t *tokens, int64_t n, kvt_entry *out)
{
    int L = n_layers(cfg);
    int rc = kvt_entry_init(out, ns, tokens, n, L, cfg->attach > 0 ? 1 : 0);
    if (rc)
        return rc;
    int made = store_make_empty(cfg, out->caches, L);
    if (made != L) {
        kvt_entry_clear(out);
        return KVT_ENOMEM;
    }
    uint64_t hall = 7;
    for (int64_t i = 0; i < n; i++)
        hall = mix(hall, (uint32_t)tokens[i]);
    for (int l = 0; l < L && !rc; l++) {
        const char *kind = kvt_cache_kind(out->caches[l]);
        if (!strcmp(kind, "recurrent")) {
            uint8_t *stt = malloc((size_t)cfg->recurrent);
            for (int b = 0; b < cfg->recurrent; b++)
                stt[b] = (uint8_t)mix(hall, (uint64_t)b);
            const void *in[1] = {stt};
            if (n)
                rc = kvt_cache_append(out->caches[l], n, in);
            free(stt);
        } else {
            rc = append_kv(out->caches[l], l, cfg->kv_dim, tokens, n);
        }
    }
    if (!rc && cfg->attach > 0) {
        uint8_t *blob = malloc((size_t)cfg->attach);
        for (int b = 0; b < cfg->attach; b++)
            blob[b] = (uint8_t)mix(hall ^ 0xA77A, (uint64_t)b);
        rc = kvt_attachment_blob("draft.hidden", blob, (size_t)cfg->attach, &out->attachments[0]);
        free(blob);
    }
    if (rc)
        kvt_entry_clear(out);
    return rc;
}

int store_cache_diff(const kvt_cache *a, const kvt_cache *b)
{
    kvt_cache_state x, y;
    if (kvt_cache_encode(a, &x))
        return 4;
    if (kvt_cache_encode(b, &y)) {
        kvt_cache_state_clear(&x);
        return 4;
    }
    int d = 0;
    if (strcmp(x.kind, y.kind) || x.offset != y.offset || x.min_offset != y.min_offset || x.n_params != y.n_params ||
        memcmp(x.params, y.params, sizeof x.params) || x.n_tensors != y.n_tensors)
        d = 5;
    for (int32_t t = 0; !d && t < x.n_tensors; t++) {
        const kvt_tensor *p = &x.tensors[t], *q = &y.tensors[t];
        if (strcmp(p->name, q->name) || p->dtype != q->dtype || p->ndim != q->ndim ||
            memcmp(p->shape, q->shape, sizeof p->shape) || p->bytes != q->bytes || memcmp(p->data, q->data, p->bytes) ||
            p->tok_begin != q->tok_begin || p->tok_end != q->tok_end)
            d = 6;
    }
    kvt_cache_state_clear(&x);
    kvt_cache_state_clear(&y);
    return d;
}

int store_entry_diff(const kvt_entry *a, const kvt_entry *b)
{
    if (strcmp(a->ns, b->ns) || a->n_tokens != b->n_tokens)
        return fprintf(stderr, "diff: ns or n_tokens (%lld vs %lld)\n", (long long)a->n_tokens,
                       (long long)b->n_tokens), 1;
    if (a->n_tokens && memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n_tokens))
        return fprintf(stderr, "diff: tokens\n"), 2;
    if (a->n_caches != b->n_caches || a->n_attachments != b->n_attachments)
        return fprintf(stderr, "diff: layer or attachment count\n"), 3;
    for (int32_t l = 0; l < a->n_caches; l++) {
        int d = store_cache_diff(a->caches[l], b->caches[l]);
        if (d) {
            fprintf(stderr, "diff: layer %d (%s) differs (%d)\n", (int)l, kvt_cache_kind(a->caches[l]), d);
            return d;
        }
    }
    for (int32_t i = 0; i < a->n_attachments; i++) {
        size_t na = 0, nb = 0;
        const void *da = kvt_attachment_blob_data(a->attachments[i], &na);
        const void *db = kvt_attachment_blob_data(b->attachments[i], &nb);
        if (!da || !db || na != nb || memcmp(da, db, na) || strcmp(a->attachments[i]->name, b->attachments[i]->name))
            return fprintf(stderr, "diff: attachment %d\n", (int)i), 7;
    }
    return 0;
}

void store_identity(const store_cfg *cfg, const char *model, char *fp, kvt_store_identity *id)
{
    kvt_cache *c[16] = {0};
    int L = store_make_empty(cfg, c, 16);
    if (kvt_store_config_fingerprint(c, L, fp))
        strcpy(fp, "fingerprint-failed");
    kvt_caches_destroy(c, L);
    id->model_id = model;
    id->config_fingerprint = fp;
    id->tokenizer_hash = "tok-1";
}

/* ---- directories --------------------------------------------------------------- */

void store_tmpdir(char *path, size_t cap, const char *tag)
{
    const char *t = getenv("TMPDIR");
    snprintf(path, cap, "%s/kvt-%s-XXXXXX", t && *t ? t : "/tmp", tag);
    if (!mkdtemp(path))
        path[0] = '\0';
}

int store_hold_lock(const char *path, int hold_ms)
{
    int p[2];
    if (pipe(p))
        return -1;
    pid_t holder = fork();
    if (holder < 0) {
        close(p[0]);
        close(p[1]);
        return -1;
    }
    if (holder == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failing test leaves no holder behind */
        int fd = open(path, O_RDWR);
        if (fd < 0 || flock(fd, LOCK_EX) || write(p[1], "x", 1) != 1)
            _exit(1);
        if (hold_ms == 0)
            pause();
        usleep((useconds_t)hold_ms * 1000);
        _exit(0);
    }
    char x;
    ssize_t got = read(p[0], &x, 1);
    close(p[0]);
    close(p[1]);
    if (got != 1) {
        kill(holder, SIGKILL);
        waitpid(holder, NULL, 0);
        return -1;
    }
    return (int)holder;
}

int store_thread_count(void)
{
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static void nap_10ms(void)
{
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

int store_thread_count_baseline(void)
{
    int n = store_thread_count(), same = 0;
    for (int i = 0; i < 500 && same < 3; i++) {
        nap_10ms();
        int m = store_thread_count();
        same = m == n ? same + 1 : 0;
        n = m;
    }
    return n;
}

int store_thread_count_settle(int want)
{
    int n = store_thread_count();
    for (int i = 0; i < 500 && n != want; i++) {
        nap_10ms();
        n = store_thread_count();
    }
    return n;
}

void store_rmtree(const char *path)
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
            store_rmtree(p);
        else
            unlink(p);
    }
    closedir(d);
    rmdir(path);
}

int store_count_files(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (!strncmp(de->d_name, prefix, strlen(prefix)) && strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            n++;
    closedir(d);
    return n;
}

int store_first_file(const char *dir, const char *prefix, char *name, size_t cap)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    struct dirent *de;
    int rc = -1;
    while ((de = readdir(d)))
        if (!strncmp(de->d_name, prefix, strlen(prefix))) {
            snprintf(name, cap, "%s", de->d_name);
            rc = 0;
            break;
        }
    closedir(d);
    return rc;
}

int store_flip_byte(const char *path, long from_end, int mask)
{
    FILE *f = fopen(path, "r+b");
    if (!f)
        return -1;
    int c = EOF;
    int ok = fseek(f, -from_end, SEEK_END) == 0 && (c = fgetc(f)) != EOF && fseek(f, -from_end, SEEK_END) == 0 &&
             fputc(c ^ mask, f) != EOF;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* ---- faults -------------------------------------------------------------------- */

static ssize_t f_pwrite(void *ctx, int fd, const void *buf, size_t n, off_t off)
{
    store_faults *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->waiting++;
    pthread_cond_broadcast(&f->cv);
    while (f->gate_closed)
        pthread_cond_wait(&f->cv, &f->mu);
    f->waiting--;
    f->pwrites++;
    int fail = f->fail_all || (f->fail_pwrite_after > 0 && --f->fail_pwrite_after == 0);
    int err = f->err, sh = f->short_write, lie = f->lie;
    if (fail && sh)
        f->fail_pwrite_after = 1; /* the next call then fails outright */
    if (fail && sh)
        f->short_write = 0;
    pthread_mutex_unlock(&f->mu);
    if (!fail)
        return pwrite(fd, buf, n, off);
    if (lie) {
        ssize_t w = pwrite(fd, buf, n / 2, off);
        return w < 0 ? w : (ssize_t)n;
    }
    if (sh && n > 1)
        return pwrite(fd, buf, n / 2, off);
    errno = err;
    return -1;
}

static int f_fsync(void *ctx, int fd)
{
    store_faults *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->fsyncs++;
    int fail = f->fail_fsync_after > 0 && --f->fail_fsync_after == 0;
    int err = f->err;
    pthread_mutex_unlock(&f->mu);
    if (fail) {
        errno = err;
        return -1;
    }
    return fsync(fd);
}

void store_faults_init(store_faults *f, kvt_store_io *io)
{
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    io->pwrite_fn = f_pwrite;
    io->fsync_fn = f_fsync;
    io->ctx = f;
}

void store_faults_gate(store_faults *f, int closed)
{
    pthread_mutex_lock(&f->mu);
    f->gate_closed = closed;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

void store_faults_wait_blocked(store_faults *f, int n)
{
    pthread_mutex_lock(&f->mu);
    while (f->waiting < n)
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

/* ---- crash trials -------------------------------------------------------------- */

#define CRASH_MAX_ENTRIES 400
#define CRASH_MAX_TOKENS 400

/* Tokens of the i-th entry the child writes in a trial: a few conversations
 * share long prefixes; some entries branch off. */
static int64_t crash_tokens(uint64_t seed, int i, int32_t *tok)
{
    uint64_t r = seed ^ ((uint64_t)i * 0x100000001B3ull);
    int conv = (int)(rng_next(&r) % 3);
    int64_t n = 8 + (int64_t)(rng_next(&r) % (CRASH_MAX_TOKENS - 8));
    int64_t branch = (rng_next(&r) % 3 == 0) ? (int64_t)(rng_next(&r) % (uint64_t)n) : n;
    for (int64_t p = 0; p < n; p++)
        tok[p] = p < branch ? (int32_t)(conv * 1000 + (p * 7) % 991) : (int32_t)(50000 + i * 13 + p);
    return n;
}

static store_cfg crash_cfg(int trial)
{
    store_cfg c = {.n_kv = 2, .kv_dim = 32, .block = 64};
    if (trial % 2) { /* untrimmable layouts: a recurrent layer and an attachment */
        c.recurrent = 48;
        c.attach = 24;
        c.window = 32;
    }
    return c;
}

static void crash_child(const char *root, int trial, uint64_t seed)
{
    store_cfg cfg = crash_cfg(trial);
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    store_identity(&cfg, "crash-model", fp, &id);
    kvt_store_options o = {.queue_max_bytes = 2u << 20};
    kvt_store *s = NULL;
    if (kvt_store_open(root, &id, &o, &s))
        _exit(3);
    int32_t tok[CRASH_MAX_TOKENS];
    for (int i = 0; i < CRASH_MAX_ENTRIES; i++) {
        int64_t n = crash_tokens(seed, i, tok);
        kvt_entry e;
        if (store_make_entry(&cfg, "", tok, n, &e))
            _exit(4);
        int rc = kvt_store_put_async(s, &e);
        if (rc == KVT_EAGAIN) {
            kvt_store_flush(s);
            rc = kvt_store_put_async(s, &e);
        }
        if (rc)
            kvt_entry_clear(&e);
    }
    kvt_store_close(s);
    _exit(0);
}

static int crash_check(const char *root, int trial, const uint64_t *seeds, int n_seeds, int verbose)
{
    store_cfg cfg = crash_cfg(trial);
    char fp[KVT_STORE_FINGERPRINT_LEN];
    kvt_store_identity id;
    store_identity(&cfg, "crash-model", fp, &id);
    kvt_store_options o = {.verify = 1};
    kvt_store *s = NULL;
    int rc = kvt_store_open(root, &id, &o, &s);
    if (rc) {
        fprintf(stderr, "trial %d: reopen failed: %s\n", trial, kvt_last_error());
        return 1;
    }
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    int fails = 0;
    for (int r = 0; r < KVT_STORE_REFUSED_COUNT; r++)
        if (st.refused[r]) {
            fprintf(stderr, "trial %d: %llu shards refused (%s) after a crash\n", trial,
                    (unsigned long long)st.refused[r], kvt_store_refusal_name((kvt_store_refusal)r));
            fails++;
        }
    if (store_count_files(kvt_store_dir(s), ".tmp.") != 0) {
        fprintf(stderr, "trial %d: temp files left after reopen\n", trial);
        fails++;
    }
    int32_t tok[CRASH_MAX_TOKENS];
    uint64_t found = 0;
    uint64_t *handles = calloc((size_t)n_seeds * CRASH_MAX_ENTRIES, sizeof *handles);
    for (int k = 0; k < n_seeds && !fails; k++)
        for (int i = 0; i < CRASH_MAX_ENTRIES && !fails; i++) {
            int64_t n = crash_tokens(seeds[k], i, tok);
            kvt_cold_hit hit;
            if (kvt_store_find_exact(s, tok, n, "", &hit))
                continue;
            int seen = 0; /* the same tokens may recur: count each entry once */
            for (uint64_t j = 0; j < found && !seen; j++)
                seen = handles[j] == hit.handle;
            if (seen)
                continue;
            handles[found++] = hit.handle;
            kvt_entry got, want;
            if ((rc = kvt_store_restore(s, hit.handle, tok, n, &got))) {
                fprintf(stderr, "trial %d: indexed entry %d does not restore: %s\n", trial, i, kvt_last_error());
                fails++;
                break;
            }
            if (store_make_entry(&cfg, "", tok, n, &want) || store_entry_diff(&got, &want)) {
                fprintf(stderr, "trial %d: entry %d restored different bytes\n", trial, i);
                fails++;
            }
            kvt_entry_clear(&got);
            kvt_entry_clear(&want);
        }
    free(handles);
    kvt_store_get_stats(s, &st);
    if (!fails && found != st.entries) {
        fprintf(stderr, "trial %d: %llu entries indexed, %llu accounted for\n", trial,
                (unsigned long long)st.entries, (unsigned long long)found);
        fails++;
    }
    if (verbose)
        printf("trial %d: %llu entries durable, %llu blocks, %llu temp files removed\n", trial,
               (unsigned long long)st.entries, (unsigned long long)st.blocks, (unsigned long long)st.temp_removed);
    kvt_store_close(s);
    return fails;
}

int store_crash_trials(int trials, uint64_t seed, int verbose)
{
    printf("store crash trials: %d, seed %llu (KVT_TEST_SEED to replay)\n", trials, (unsigned long long)seed);
    fflush(stdout);
    uint64_t r = seed;
    int failed = 0;
    for (int t = 0; t < trials; t++) {
        char root[512];
        store_tmpdir(root, sizeof root, "crash");
        if (!root[0])
            return 1;
        uint64_t tseed = rng_next(&r);
        /* Sometimes let an earlier run leave state behind first. */
        int rounds = 1 + (int)(rng_next(&r) % 2);
        uint64_t seeds[2] = {tseed, tseed + 1};
        for (int k = 0; k < rounds && !failed; k++) {
            pid_t pid = fork();
            if (pid == 0)
                crash_child(root, t, seeds[k]);
            if (pid < 0)
                return 1;
            struct timespec ts = {0, (long)(10 + rng_next(&r) % 240) * 1000000L};
            nanosleep(&ts, NULL);
            kill(pid, SIGKILL);
            int status;
            waitpid(pid, &status, 0);
            failed += crash_check(root, t, seeds, k + 1, verbose);
        }
        store_rmtree(root);
        if (failed) {
            fprintf(stderr, "crash trial %d failed (seed %llu)\n", t, (unsigned long long)seed);
            break;
        }
    }
    return failed;
}

/* ---- several writer processes on one root with a budget --------------------------- */

static const store_cfg MP_CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};

static uint64_t mp_xs(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* One writer: puts (sync and write-behind) entries over a few shared
 * starts, restores what it finds and checks the bytes. Exit status: 0 ok,
 * 1 wrong bytes, 2 store error. */
static int mp_writer(const char *root, uint64_t max, uint64_t seed, int rounds)
{
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    store_identity(&MP_CFG, "model-m", fp, &id);
    kvt_store_options o = {.max_bytes = max};
    kvt_store *s = NULL;
    if (kvt_store_open(root, &id, &o, &s)) {
        fprintf(stderr, "writer: open: %s\n", kvt_last_error());
        return 2;
    }
    uint64_t x = seed | 1;
    int status = 0;
    for (int r = 0; r < rounds && !status; r++) {
        int32_t t[64];
        int start = (int)(mp_xs(&x) % 3); /* three shared conversation starts */
        pcu_seq(t, 64, 1000 * (start + 1));
        int64_t n = 8 + (int64_t)(mp_xs(&x) % 40);
        int64_t fork_at = 4 + (int64_t)(mp_xs(&x) % (uint64_t)(n - 4));
        for (int64_t i = fork_at; i < n; i++)
            t[i] = (int32_t)(mp_xs(&x) % 50000) + 1;
        kvt_entry e;
        if (store_make_entry(&MP_CFG, "", t, n, &e))
            return 2;
        int rc;
        if (mp_xs(&x) % 2) {
            rc = kvt_store_put(s, &e);
            kvt_entry_clear(&e);
        } else {
            rc = kvt_store_put_async(s, &e);
            if (rc)
                kvt_entry_clear(&e);
            if (rc == KVT_EAGAIN)
                rc = 0;
        }
        if (rc) {
            fprintf(stderr, "writer: put: %s\n", kvt_last_error());
            status = 2;
            break;
        }
        /* restore the longest prefix found for a prompt over this start */
        kvt_cold_hit hit;
        if (kvt_store_find(s, t, n, "", &hit) == 0) {
            kvt_entry got;
            rc = kvt_store_restore(s, hit.handle, t, n, &got);
            if (rc == 0) {
                kvt_entry want;
                if (store_make_entry(&MP_CFG, "", got.tokens, got.n_tokens, &want))
                    return 2;
                if (store_entry_diff(&got, &want)) {
                    fprintf(stderr, "writer: restored bytes differ\n");
                    status = 1;
                }
                kvt_entry_clear(&want);
                kvt_entry_clear(&got);
            } else if (rc != KVT_ENOTFOUND && rc != KVT_EFORMAT) {
                /* gone (another process's budget) is a miss; a missing
                 * block (EFORMAT) is what this test exists to catch */
                fprintf(stderr, "writer: restore: %s\n", kvt_last_error());
                status = 2;
            } else if (rc == KVT_EFORMAT) {
                fprintf(stderr, "writer: restore refused: %s\n", kvt_last_error());
                status = 1;
            }
        }
    }
    int crc = kvt_store_close(s);
    if (crc && !status) {
        fprintf(stderr, "writer: close: %s\n", kvt_strerror(crc));
        status = 2;
    }
    return status;
}


static int mp_count(void *ctx, const kvt_store_shard_info *in)
{
    store_mp_result *a = ctx;
    a->bytes += in->bytes;
    if (in->bytes > a->biggest)
        a->biggest = in->bytes;
    if (in->type == 'e' || in->type == 'b')
        a->shards++;
    if (in->status) {
        a->bad++;
        fprintf(stderr, "verify: %s/%s refused (%s)\n", in->dir, in->file,
                kvt_store_refusal_name((kvt_store_refusal)(in->status - 1)));
    }
    return 0;
}


int store_multiproc_run(const char *root, int writers, int rounds, uint64_t max, uint64_t seed, store_mp_result *out)
{
    memset(out, 0, sizeof *out);
    pid_t pids[64];
    if (writers > 64)
        return -1;
    for (int w = 0; w < writers; w++) {
        fflush(NULL);
        pids[w] = fork();
        if (pids[w] < 0)
            return -1;
        if (pids[w] == 0)
            _exit(mp_writer(root, max, seed + 7919u * (uint64_t)(w + 1), rounds));
    }
    for (int w = 0; w < writers; w++) {
        int st = 0;
        if (waitpid(pids[w], &st, 0) != pids[w])
            return -1;
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "writer %d: %s %d\n", w, WIFEXITED(st) ? "exit" : "signal",
                    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            out->failed_writers++;
        }
    }
    return kvt_store_walk(root, 1, mp_count, out);
}
