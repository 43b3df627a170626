/*
 * bench_remote.c: `kvtier bench remote`: the remote tier on Redis. For each
 * size (64 MB to 1 GB of kv state) it stores an entry through the tier
 * (write GB/s) and restores it (find + pipelined GETs + validation of every
 * record, checksum included, + rebuilding the caches: restore GB/s), and in
 * the same run reads the same record bytes with raw pipelined hiredis GETs
 * (the physical limit on this machine) and writes them with raw pipelined
 * SETs. Goal: restore >= 70% of raw GETs. Then the lookup latency of a
 * 32k-token prompt (pipelined EXISTS of its block keys, the children hint).
 * Every figure is the median of N runs. Without --redis it starts a
 * redis-server of its own on a free loopback port (temporary directory, no
 * persistence) and stops it at the end.
 */
#include "args.h"
#include "bench_util.h"
#include "cli.h"

#include "kvtier/cache.h"
#include "kvtier/remote.h"

#include <errno.h>
#include <hiredis.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- a redis-server of our own --------------------------------------------------- */

static pid_t g_pid;
static char g_dir[256];

static int start_redis(uint64_t maxmemory, char *url, size_t cap, int *port_out)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &len)) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    int port = ntohs(a.sin_port);
    close(fd);
    const char *t = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/kvtier-bench-redis-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(g_dir))
        return -1;
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "exec redis-server --port %d --bind 127.0.0.1 --dir %s --save '' --appendonly no --protected-mode no "
             "--maxmemory %llu --maxmemory-policy allkeys-lru --logfile %s/redis.log </dev/null >/dev/null 2>&1",
             port, g_dir, (unsigned long long)maxmemory, g_dir);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    g_pid = pid;
    for (int i = 0; i < 500; i++) {
        struct timeval tv = {1, 0};
        redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
        int ok = c && !c->err;
        if (c)
            redisFree(c);
        if (ok) {
            snprintf(url, cap, "redis://127.0.0.1:%d", port);
            *port_out = port;
            return 0;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            g_pid = 0;
            return -1;
        }
        usleep(10000);
    }
    return -1;
}

static void stop_redis(void)
{
    if (g_pid > 0) {
        kill(g_pid, SIGKILL);
        waitpid(g_pid, NULL, 0);
        g_pid = 0;
    }
    if (g_dir[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
        if (system(cmd) != 0)
            fprintf(stderr, "bench remote: could not remove %s\n", g_dir);
    }
}

/* ---- raw hiredis ------------------------------------------------------------------- */

typedef struct keylist {
    char **k;
    size_t n, cap;
} keylist;

static void keylist_free(keylist *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->k[i]);
    free(l->k);
    memset(l, 0, sizeof *l);
}

/* Every record key of the prefix (SCAN). */
static int scan_keys(redisContext *c, const char *prefix, keylist *out)
{
    char cursor[32] = "0", pat[80];
    snprintf(pat, sizeof pat, "%s[be]*", prefix);
    do {
        redisReply *r = redisCommand(c, "SCAN %s MATCH %s COUNT 1000", cursor, pat);
        if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
            if (r)
                freeReplyObject(r);
            return -1;
        }
        snprintf(cursor, sizeof cursor, "%s", r->element[0]->str);
        for (size_t i = 0; i < r->element[1]->elements; i++) {
            if (out->n == out->cap) {
                out->cap = out->cap ? out->cap * 2 : 256;
                out->k = realloc(out->k, sizeof *out->k * out->cap);
            }
            out->k[out->n++] = strdup(r->element[1]->element[i]->str);
        }
        freeReplyObject(r);
    } while (strcmp(cursor, "0") != 0);
    return 0;
}

/* Pipelined GETs of every key, all sent before any reply is read (as the
 * tier does): the bytes read. keep: every reply is held until the last has
 * arrived, as a restore must hold the bytes it returns (fresh memory, page
 * faults included); else each is freed at once (its memory reused). */
static int raw_get(redisContext *c, const keylist *l, int keep, uint64_t *bytes)
{
    *bytes = 0;
    void **kept = keep ? calloc(l->n ? l->n : 1, sizeof *kept) : NULL;
    if (keep && !kept)
        return -1;
    for (size_t i = 0; i < l->n; i++)
        redisAppendCommand(c, "GET %s", l->k[i]);
    int rc = 0;
    for (size_t i = 0; i < l->n; i++) {
        void *rp;
        if (redisGetReply(c, &rp) != REDIS_OK) {
            rc = -1;
            break;
        }
        redisReply *r = rp;
        if (r->type == REDIS_REPLY_STRING)
            *bytes += r->len;
        if (keep)
            kept[i] = r;
        else
            freeReplyObject(r);
    }
    for (size_t i = 0; keep && i < l->n; i++)
        if (kept[i])
            freeReplyObject(kept[i]);
    free(kept);
    return rc;
}

/* Pipelined SETs of values of the given sizes (one buffer reused). */
static int raw_set(redisContext *c, const size_t *sizes, size_t n, const char *buf)
{
    for (size_t i = 0; i < n; i++) {
        char key[48];
        snprintf(key, sizeof key, "kvt-bench-raw:%zu", i);
        redisAppendCommand(c, "SET %s %b", key, buf, sizes[i]);
    }
    for (size_t i = 0; i < n; i++) {
        void *rp;
        if (redisGetReply(c, &rp) != REDIS_OK)
            return -1;
        freeReplyObject(rp);
    }
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier bench remote [--redis URL] [--sizes 64M,256M,1G] [--layers N] [--kv-dim N]\n"
               "                           [--block-tokens N] [--runs N]\n"
               "  the remote tier on Redis: restore GB/s (lookup, pipelined GETs, every record\n"
               "  validated, caches rebuilt) vs raw pipelined hiredis GETs of the same bytes, store\n"
               "  GB/s vs raw pipelined SETs, and the lookup latency of a 32k-token prompt; medians\n"
               "  of N runs (default 3). Without --redis a redis-server of its own is started on\n"
               "  loopback (needs redis-server on PATH). --redis must name an empty database: the\n"
               "  bench flushes it (FLUSHDB) between runs.\n");
}

int kvt_bench_remote(int argc, char **argv)
{
    const char *sizes = "64M,256M,1G", *url = NULL;
    int layers = 8, kv_dim = 1024, block = 256, runs = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long long x;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--redis") && v) {
            url = v;
            i++;
        } else if (!strcmp(a, "--sizes") && v) {
            sizes = v;
            i++;
        } else if ((!strcmp(a, "--layers") || !strcmp(a, "--kv-dim") || !strcmp(a, "--block-tokens") ||
                    !strcmp(a, "--runs")) &&
                   v && kvt_cli_int(v, 1, 1 << 20, &x) == 0) {
            *(!strcmp(a, "--layers") ? &layers : !strcmp(a, "--kv-dim") ? &kv_dim
                                               : !strcmp(a, "--runs")   ? &runs
                                                                        : &block) = (int)x;
            i++;
        } else {
            usage(stderr);
            return 2;
        }
    }
    uint64_t biggest = 0;
    for (const char *p = sizes; *p;) {
        uint64_t b;
        const char *end;
        if (kvt_cli_bytes(p, &b, &end) || (*end && *end != ',') || b == 0) {
            fprintf(stderr, "bench remote: bad size list '%s'\n", sizes);
            return 2;
        }
        biggest = b > biggest ? b : biggest;
        p = *end ? end + 1 : end;
    }
    char own_url[64];
    int port = 0;
    kvt_remote_url u;
    if (url) {
        if (kvt_remote_url_parse(url, &u)) {
            fprintf(stderr, "bench remote: %s\n", kvt_last_error());
            return 2;
        }
        port = u.port;
    } else {
        if (start_redis(biggest * 2 + (256u << 20), own_url, sizeof own_url, &port)) {
            fprintf(stderr, "bench remote: cannot start redis-server (is it installed?)\n");
            stop_redis();
            return 1;
        }
        url = own_url;
        memset(&u, 0, sizeof u);
        snprintf(u.host, sizeof u.host, "127.0.0.1");
        u.port = port;
    }
    struct timeval tv = {30, 0};
    redisContext *raw = redisConnectWithTimeout(u.host, u.port, tv);
    if (!raw || raw->err) {
        fprintf(stderr, "bench remote: cannot connect to %s:%d\n", u.host, u.port);
        if (raw)
            redisFree(raw);
        stop_redis();
        return 1;
    }
    redisSetTimeout(raw, tv);
    if (u.password[0]) {
        redisReply *r = u.user[0] ? redisCommand(raw, "AUTH %s %s", u.user, u.password)
                                  : redisCommand(raw, "AUTH %s", u.password);
        if (r)
            freeReplyObject(r);
    }
    if (u.db) {
        redisReply *r = redisCommand(raw, "SELECT %d", u.db);
        if (r)
            freeReplyObject(r);
    }
    memset(&u, 0, sizeof u);
    kvt_store_identity id = {"bench-remote", "bench-config", "bench-tok"};
    char prefix[64];
    kvt_remote_key_prefix(&id, prefix, sizeof prefix);
    kvt_remote_options ro = {.lookup_timeout_ms = 2000, .io_timeout_ms = 30000, .queue_max_bytes = 4ull << 30};
    printf("bench remote: redis %s, %d kv layers x kv_dim %d, blocks of %d tokens, median of %d runs\n",
           url == own_url ? "started on loopback" : "given", layers, kv_dim, block, runs);
    printf("%10s %8s %10s %10s %10s %8s %8s %10s %10s %8s\n", "state", "records", "raw GET", "GET kept", "restore",
           "of raw", "of kept", "raw SET", "store", "of raw");
    int status = 0;
    double *v_rest = calloc((size_t)runs, sizeof(double)), *v_raw = calloc((size_t)runs, sizeof(double));
    double *v_st = calloc((size_t)runs, sizeof(double)), *v_rset = calloc((size_t)runs, sizeof(double));
    double *v_kept = calloc((size_t)runs, sizeof(double));
    char *setbuf = NULL;
    for (const char *p = sizes; *p && !status;) {
        uint64_t bytes;
        const char *end;
        kvt_cli_bytes(p, &bytes, &end);
        p = *end ? end + 1 : end;
        /* whole blocks: one record each */
        int64_t n = kvt_bench_util_state_tokens(bytes, layers, kv_dim, block);
        kvt_entry e;
        int32_t *tok = NULL;
        int rc = kvt_bench_util_entry(n, layers, kv_dim, block, &e, &tok);
        if (rc) {
            fprintf(stderr, "bench remote: cannot build the state: %s\n", kvt_strerror(rc));
            status = 1;
            break;
        }
        uint64_t state = 0;
        for (int l = 0; l < layers; l++)
            state += kvt_cache_bytes(e.caches[l]);
        size_t n_rec = 0, *rec_sizes = NULL;
        uint64_t rec_bytes = 0;
        for (int k = 0; k < runs && !status; k++) {
            redisReply *fr = redisCommand(raw, "FLUSHDB");
            if (fr)
                freeReplyObject(fr);
            kvt_remote *r = NULL;
            kvt_cold_tier t;
            if ((rc = kvt_remote_open(url, &id, &ro, &r)) || !kvt_remote_healthy(r)) {
                fprintf(stderr, "bench remote: cannot open the tier: %s\n", rc ? kvt_last_error() : "unreachable");
                kvt_remote_close(r);
                status = 1;
                break;
            }
            kvt_remote_cold_tier(r, &t);
            double t0 = now_s();
            rc = t.store(t.self, &e);
            v_st[k] = (double)state / (now_s() - t0) / 1e9;
            kvt_cold_hit h;
            kvt_entry got;
            memset(&got, 0, sizeof got);
            t0 = now_s();
            if (!rc)
                rc = t.find(t.self, tok, n + 1, "", &h);
            if (!rc)
                rc = t.restore(t.self, h.handle, &got);
            double rs = now_s() - t0;
            if (!rc && got.n_tokens != n)
                rc = KVT_EFORMAT;
            kvt_entry_clear(&got);
            v_rest[k] = (double)state / rs / 1e9;
            keylist kl = {0};
            uint64_t gb = 0;
            if (!rc && scan_keys(raw, prefix, &kl) == 0) {
                t0 = now_s();
                if (raw_get(raw, &kl, 0, &gb)) {
                    fprintf(stderr, "bench remote: raw GET: %s\n", raw->errstr);
                    rc = KVT_EIO;
                }
                v_raw[k] = (double)gb / (now_s() - t0) / 1e9;
                t0 = now_s();
                if (!rc && raw_get(raw, &kl, 1, &gb)) {
                    fprintf(stderr, "bench remote: raw GET: %s\n", raw->errstr);
                    rc = KVT_EIO;
                }
                v_kept[k] = (double)gb / (now_s() - t0) / 1e9;
                /* restore figures in record bytes too, for the same-bytes ratio */
                v_rest[k] = (double)gb / rs / 1e9;
                v_st[k] = v_st[k] * (double)gb / (double)state;
                if (!rec_sizes) {
                    n_rec = kl.n;
                    rec_sizes = calloc(n_rec ? n_rec : 1, sizeof *rec_sizes);
                    rec_bytes = gb;
                    for (size_t i = 0; i < n_rec; i++)
                        rec_sizes[i] = (size_t)(gb / (n_rec ? n_rec : 1));
                }
            }
            keylist_free(&kl);
            kvt_remote_close(r);
            if (!rc && rec_sizes) {
                if (!setbuf)
                    setbuf = calloc(1, (size_t)(rec_bytes / (n_rec ? n_rec : 1)) + 1);
                fr = redisCommand(raw, "FLUSHDB");
                if (fr)
                    freeReplyObject(fr);
                t0 = now_s();
                if (!setbuf || raw_set(raw, rec_sizes, n_rec, setbuf)) {
                    fprintf(stderr, "bench remote: raw SET: %s\n", raw->errstr);
                    rc = KVT_EIO;
                }
                v_rset[k] = (double)rec_bytes / (now_s() - t0) / 1e9;
                free(setbuf);
                setbuf = NULL;
            }
            if (rc) {
                fprintf(stderr, "bench remote: run %d failed: %s (%s)\n", k + 1, kvt_strerror(rc), kvt_last_error());
                status = 1;
            }
        }
        if (!status) {
            double g = median(v_raw, runs), gk = median(v_kept, runs), re = median(v_rest, runs),
                   s = median(v_rset, runs), st = median(v_st, runs);
            char sz[32];
            snprintf(sz, sizeof sz, "%.0f MB", (double)state / 1e6);
            printf("%10s %8zu %5.2f GB/s %5.2f GB/s %5.2f GB/s %7.0f%% %7.0f%% %5.2f GB/s %5.2f GB/s %7.0f%%\n", sz,
                   n_rec, g, gk, re, 100 * re / g, 100 * re / gk, s, st, 100 * st / s);
        }
        free(rec_sizes);
        kvt_entry_clear(&e);
        free(tok);
    }
    /* lookup latency: a 32k-token prompt over a stored 32k-token entry */
    if (!status) {
        redisReply *fr = redisCommand(raw, "FLUSHDB");
        if (fr)
            freeReplyObject(fr);
        const int64_t n = 32768;
        kvt_entry e;
        int32_t *tok = NULL;
        kvt_remote *r = NULL;
        int rc = kvt_bench_util_entry(n, 1, 8, block, &e, &tok);
        if (!rc)
            rc = kvt_remote_open(url, &id, &ro, &r);
        kvt_cold_tier t;
        if (!rc) {
            kvt_remote_cold_tier(r, &t);
            rc = t.store(t.self, &e);
        }
        double lat[64];
        int nl = runs * 5 > 64 ? 64 : runs * 5;
        kvt_remote_stats s0, s1;
        kvt_remote_stats_get(r, &s0);
        for (int k = 0; !rc && k < nl; k++) {
            kvt_cold_hit h;
            double t0 = now_s();
            rc = t.find(t.self, tok, n, "", &h);
            lat[k] = (now_s() - t0) * 1e3;
            if (!rc && h.prefix_len != n - 1)
                rc = KVT_EFORMAT;
        }
        kvt_remote_stats_get(r, &s1);
        if (rc) {
            fprintf(stderr, "bench remote: lookup run failed: %s\n", kvt_strerror(rc));
            status = 1;
        } else {
            printf("lookup of a %lld-token prompt (%lld block keys checked in one pipeline): median %.2f ms "
                   "over %d lookups, %.1f round trips each\n",
                   (long long)n, (long long)(n / block), median(lat, nl), nl,
                   (double)(s1.round_trips - s0.round_trips) / nl);
        }
        kvt_remote_close(r);
        kvt_entry_clear(&e);
        free(tok);
    }
    free(v_rest);
    free(v_raw);
    free(v_st);
    free(v_rset);
    free(v_kept);
    redisFree(raw);
    stop_redis();
    return status;
}
