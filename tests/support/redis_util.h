/*
 * redis_util.h: real redis-server processes for the remote tier's tests:
 * started on a free loopback port with their own temporary directory (no
 * persistence, maxmemory with allkeys-lru), killed, restarted on the same
 * port, paused; a 3-node Redis Cluster on loopback; a direct hiredis
 * connection to run commands; and a tier_impl of the remote tier for the
 * conformance suite.
 */
#ifndef KVT_TEST_REDIS_UTIL_H
#define KVT_TEST_REDIS_UTIL_H

#include "tier_suite.h"

#include <stddef.h>
#include <sys/types.h>

typedef struct redis_srv {
    pid_t pid;       /* 0: not running */
    int port;
    char dir[512];
    char url[64];    /* redis://127.0.0.1:port */
    char extra[256]; /* extra redis-server arguments, kept for restarts */
} redis_srv;

/** 1 when redis-server is on PATH; else prints why the test skips and returns 0. */
int redis_available(const char *test);

/** Starts redis-server on a free loopback port (maxmemory_mb > 0: maxmemory
 * with allkeys-lru; 0 = 256 MB) plus `extra` (space-separated arguments or
 * NULL) and waits until it answers as this child (INFO's process_id: a port
 * another process took first is retried with another). @return 0 or -1. */
int redis_start(redis_srv *s, int maxmemory_mb, const char *extra);
/** SIGKILLs the server (its port and directory stay for redis_restart). */
void redis_kill(redis_srv *s);
/** Starts the server again on the same port (empty: no persistence). @return 0 or -1. */
int redis_restart(redis_srv *s);
/** Stops the server and removes its directory. */
void redis_stop(redis_srv *s);

/** Runs one command (argv style, each argument a NUL-terminated string, or
 * binary with redis_cmd_bin) on the server at port; the reply's integer (for
 * integer replies), 0 for status/string replies, -1 on an error reply or
 * failure. If out is not NULL, a string reply is copied into it (cap bytes;
 * *out_len its length). */
long long redis_cmd(int port, char *out, size_t cap, size_t *out_len, const char *fmt, ...);
/** SET key value with binary value bytes. @return 0 or -1. */
int redis_set_bin(int port, const char *key, const void *value, size_t bytes);
/** The first key matching pattern (SCAN), into out. @return 0 or -1 (none). */
int redis_first_key(int port, const char *pattern, char *out, size_t cap);
/** Keys matching pattern (SCAN). */
long long redis_count_keys(int port, const char *pattern);
/** Keys matching pattern (SCAN): the first max_keys of them into keys, one
 * every cap bytes (NUL-terminated, cut at cap - 1). @return how many match, -1 on failure. */
long long redis_keys(int port, const char *pattern, char *keys, size_t cap, long long max_keys);
/** The integer field `field` of INFO `section` (e.g. "stats", "evicted_keys"); -1 if absent.
 * Not thread-safe. */
long long redis_info_field(int port, const char *section, const char *field);

/** A Redis Cluster of n masters (no replicas) on loopback, slots split
 * evenly, cluster-require-full-coverage no (the live nodes keep serving
 * their slots when one dies). @return 0 or -1. */
int redis_cluster_start(redis_srv *nodes, int n);
void redis_cluster_stop(redis_srv *nodes, int n);

/** The remote tier on the server (or cluster) that redis_tier_use set: each
 * open flushes every node and opens a fresh tier. */
extern const tier_impl tier_impl_redis;
/** Which server the tier_impl opens: url, cluster flag, ports to FLUSHALL. */
void redis_tier_use(const char *url, int cluster, const int *ports, int n_ports);

#endif
