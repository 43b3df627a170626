/*
 * redis_util.c: redis-server processes, a loopback cluster and the remote
 * tier's tier_impl for the tests (redis_util.h).
 */
#include "redis_util.h"

#include "child_guard.h"

#include "kvtier/remote.h"
#include "store_util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int redis_available(const char *test)
{
    if (system("command -v redis-server >/dev/null 2>&1") == 0)
        return 1;
    printf("%s: SKIP: redis-server is not installed (Debian: apt-get install redis-server)\n", test);
    return 0;
}

static int free_port(void)
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
    /* cluster nodes also listen on port + 10000 */
    return port < 55000 ? port : free_port();
}

static long long vcmd(int port, char *out, size_t cap, size_t *out_len, const char *fmt, va_list ap)
{
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return -1;
    }
    redisSetTimeout(c, tv);
    redisReply *r = redisvCommand(c, fmt, ap);
    long long v = -1;
    if (r) {
        if (r->type == REDIS_REPLY_INTEGER)
            v = r->integer;
        else if (r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_NIL ||
                 r->type == REDIS_REPLY_ARRAY)
            v = 0;
        if (out && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS)) {
            size_t n = r->len < cap ? r->len : cap;
            memcpy(out, r->str, n);
            if (n < cap)
                out[n] = 0;
            if (out_len)
                *out_len = r->len;
        } else if (out_len) {
            *out_len = 0;
        }
        freeReplyObject(r);
    }
    redisFree(c);
    return v;
}

long long redis_cmd(int port, char *out, size_t cap, size_t *out_len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    long long v = vcmd(port, out, cap, out_len, fmt, ap);
    va_end(ap);
    return v;
}

int redis_set_bin(int port, const char *key, const void *value, size_t bytes)
{
    return redis_cmd(port, NULL, 0, NULL, "SET %s %b", key, value, bytes) == 0 ? 0 : -1;
}

static long long scan(int port, const char *pattern, char *keys, size_t cap, long long max_keys)
{
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return -1;
    }
    long long count = 0;
    char cursor[32] = "0";
    do {
        redisReply *r = redisCommand(c, "SCAN %s MATCH %s COUNT 1000", cursor, pattern);
        if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
            if (r)
                freeReplyObject(r);
            redisFree(c);
            return -1;
        }
        snprintf(cursor, sizeof cursor, "%s", r->element[0]->str);
        for (size_t i = 0; i < r->element[1]->elements; i++) {
            if (count < max_keys && keys)
                snprintf(keys + (size_t)count * cap, cap, "%s", r->element[1]->element[i]->str);
            count++;
        }
        freeReplyObject(r);
    } while (strcmp(cursor, "0") != 0);
    redisFree(c);
    return count;
}

int redis_first_key(int port, const char *pattern, char *out, size_t cap)
{
    return scan(port, pattern, out, cap, 1) > 0 ? 0 : -1;
}

long long redis_count_keys(int port, const char *pattern) { return scan(port, pattern, NULL, 0, 0); }

long long redis_keys(int port, const char *pattern, char *keys, size_t cap, long long max_keys)
{
    return scan(port, pattern, keys, cap, max_keys);
}

long long redis_info_field(int port, const char *section, const char *field)
{
    static char info[1 << 16];
    if (redis_cmd(port, info, sizeof info - 1, NULL, "INFO %s", section) != 0)
        return -1;
    char want[128];
    snprintf(want, sizeof want, "\n%s:", field);
    const char *p = strstr(info, want);
    return p ? strtoll(p + strlen(want), NULL, 10) : -1;
}

void redis_kill(redis_srv *s);

/* The server is up and is our child (not another test's redis-server that
 * took the port between free_port and our bind: it would answer PING too):
 * INFO server's process_id is s->pid. A --requirepass in s->extra is sent
 * with AUTH first. @return 1 ours, 0 not (yet). */
static int alive(const redis_srv *s)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", s->port, tv);
    int up = 0;
    if (c && !c->err) {
        char pass[128] = "";
        const char *rp = strstr(s->extra, "--requirepass ");
        if (rp)
            sscanf(rp + strlen("--requirepass "), "%127s", pass);
        redisReply *r = pass[0] ? redisCommand(c, "AUTH %s", pass) : NULL;
        if (r)
            freeReplyObject(r);
        r = redisCommand(c, "INFO server");
        if (r && r->type == REDIS_REPLY_STRING) {
            const char *p = strstr(r->str, "process_id:");
            up = p && strtol(p + strlen("process_id:"), NULL, 10) == (long)s->pid;
        }
        if (r)
            freeReplyObject(r);
    }
    if (c)
        redisFree(c);
    return up;
}

static int spawn(redis_srv *s)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "exec redis-server --port %d --bind 127.0.0.1 --dir %s --save '' --appendonly no --daemonize no "
             "--protected-mode no --logfile %s/redis.log %s </dev/null >/dev/null 2>&1",
             s->port, s->dir, s->dir, s->extra);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        child_guard_in_child(parent);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    s->pid = pid;
    child_guard_add(pid);
    for (int i = 0; i < 1000; i++) { /* 10 s */
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) { /* e.g. the port was taken: the caller tries another */
            child_guard_del(pid);
            s->pid = 0;
            return -1;
        }
        if (alive(s))
            return 0;
        sleep_ms(10);
    }
    redis_kill(s);
    return -1;
}

int redis_start(redis_srv *s, int maxmemory_mb, const char *extra)
{
    memset(s, 0, sizeof *s);
    store_tmpdir(s->dir, sizeof s->dir, "redis");
    if (!s->dir[0])
        return -1;
    snprintf(s->extra, sizeof s->extra, "--maxmemory %dmb --maxmemory-policy allkeys-lru %s",
             maxmemory_mb > 0 ? maxmemory_mb : 256, extra ? extra : "");
    for (int attempt = 0; attempt < 5; attempt++) {
        s->port = free_port();
        if (s->port > 0 && spawn(s) == 0) {
            snprintf(s->url, sizeof s->url, "redis://127.0.0.1:%d", s->port);
            return 0;
        }
    }
    return -1;
}

void redis_kill(redis_srv *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        child_guard_del(s->pid);
        s->pid = 0;
    }
}

int redis_restart(redis_srv *s)
{
    redis_kill(s);
    for (int i = 0; i < 100; i++) { /* the port may linger for a moment */
        if (spawn(s) == 0)
            return 0;
        sleep_ms(20);
    }
    return -1;
}

void redis_stop(redis_srv *s)
{
    redis_kill(s);
    if (s->dir[0])
        store_rmtree(s->dir);
    s->dir[0] = 0;
}

/* ---- a loopback cluster -------------------------------------------------------- */

int redis_cluster_start(redis_srv *nodes, int n)
{
    memset(nodes, 0, sizeof *nodes * (size_t)n);
    for (int i = 0; i < n; i++) {
        char extra[512];
        snprintf(extra, sizeof extra,
                 "--cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 1000 "
                 "--cluster-require-full-coverage no");
        if (redis_start(&nodes[i], 64, extra))
            goto fail;
    }
    for (int i = 0; i < n; i++) {
        long lo = 16384L * i / n, hi = 16384L * (i + 1) / n - 1;
        if (redis_cmd(nodes[i].port, NULL, 0, NULL, "CLUSTER ADDSLOTSRANGE %ld %ld", lo, hi) != 0)
            goto fail;
    }
    for (int i = 1; i < n; i++)
        if (redis_cmd(nodes[0].port, NULL, 0, NULL, "CLUSTER MEET 127.0.0.1 %d", nodes[i].port) != 0)
            goto fail;
    for (int t = 0; t < 1000; t++) { /* 10 s */
        int ok = 1;
        for (int i = 0; i < n && ok; i++) {
            char info[4096];
            ok = redis_cmd(nodes[i].port, info, sizeof info - 1, NULL, "CLUSTER INFO") == 0 &&
                 strstr(info, "cluster_state:ok") && strstr(info, "cluster_slots_assigned:16384");
            char want[64];
            snprintf(want, sizeof want, "cluster_known_nodes:%d", n);
            ok = ok && strstr(info, want);
        }
        if (ok)
            return 0;
        sleep_ms(10);
    }
fail:
    redis_cluster_stop(nodes, n);
    return -1;
}

void redis_cluster_stop(redis_srv *nodes, int n)
{
    for (int i = 0; i < n; i++)
        redis_stop(&nodes[i]);
}

/* ---- the tier_impl --------------------------------------------------------------- */

static char g_url[64];
static int g_cluster, g_ports[8], g_n_ports;

void redis_tier_use(const char *url, int cluster, const int *ports, int n_ports)
{
    snprintf(g_url, sizeof g_url, "%s", url);
    g_cluster = cluster;
    g_n_ports = n_ports < 8 ? n_ports : 8;
    memcpy(g_ports, ports, sizeof *ports * (size_t)g_n_ports);
}

static int redis_open(void **ctx, kvt_cold_tier *tier)
{
    for (int i = 0; i < g_n_ports; i++)
        if (redis_cmd(g_ports[i], NULL, 0, NULL, "FLUSHALL") != 0)
            return KVT_EIO;
    kvt_store_identity id = {"tier-suite", "any", "tok"};
    kvt_remote_options o = {.cluster = g_cluster, .lookup_timeout_ms = 1000};
    kvt_remote *r;
    int rc = kvt_remote_open(g_url, &id, &o, &r);
    if (rc)
        return rc;
    kvt_remote_cold_tier(r, tier);
    *ctx = r;
    return 0;
}

static void redis_close(void *ctx) { kvt_remote_close(ctx); }

const tier_impl tier_impl_redis = {"remote tier (Redis)", redis_open, redis_close, NULL};
