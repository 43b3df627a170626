/*
 * serve_util.h: what the server tests share: `kvtier serve` as a child
 * process (started with --port 0, the port read from its log; stopped with
 * SIGTERM or killed with SIGKILL) and a small HTTP/1.0 client over sockets.
 * Nothing here asserts: every call says whether it worked, so a test that
 * kills the server on purpose (the crash trials) tells a dropped connection
 * from a wrong reply. Every child is registered with child_guard.h: killed
 * at exit, by child_guard_teardown, and by the kernel if the test dies.
 */
#ifndef KVT_TEST_SERVE_UTIL_H
#define KVT_TEST_SERVE_UTIL_H

#include <stddef.h>
#include <sys/types.h>

/** Reads up to cap - 1 bytes of a file into buf, NUL-terminated. @return
 * the bytes read, -1 when it cannot be opened. */
int kvt_ts_read_file(const char *path, char *buf, size_t cap);

/** A `kvtier serve` child process. */
typedef struct kvt_ts_server {
    pid_t pid;
    int port;
    char log[400]; /* its stderr */
} kvt_ts_server;

/** Starts `bin serve --port 0 ARGS...` (args NULL-terminated, at most 56)
 * with stderr to log_path and stdout to /dev/null, and waits (up to 30 s
 * times KVT_TEST_TIME_SCALE) for "ready, model" in the log. @return 0; -1 when it exited or did not get
 * ready (the log is printed to stderr). */
int kvt_ts_server_start(kvt_ts_server *sv, const char *bin, const char *log_path, const char *const *args);

/** Starts the child as kvt_ts_server_start does, but returns as soon as it
 * listens ("listening on" in the log, port set), before the model is
 * loaded. @return 0; -1 when it exited or did not listen within 30 s (times
 * KVT_TEST_TIME_SCALE). */
int kvt_ts_server_spawn(kvt_ts_server *sv, const char *bin, const char *log_path, const char *const *args);

/** SIGTERM, then its exit status (128 + signal when killed by one; -1 and a
 * SIGKILL when it did not exit within 30 s times KVT_TEST_TIME_SCALE). */
int kvt_ts_server_stop(kvt_ts_server *sv);

/** SIGKILL and wait for it. */
void kvt_ts_server_kill(kvt_ts_server *sv);

/** A response: status -1 when the connection failed or closed before a
 * whole status line and headers arrived. */
typedef struct kvt_ts_resp {
    int status;
    char *head; /* status line and headers (what arrived, when status is -1) */
    char *body; /* NUL-terminated */
    size_t len;
} kvt_ts_resp;

void kvt_ts_resp_free(kvt_ts_resp *r);

/** A TCP connection to 127.0.0.1:port with a receive timeout of timeout_s
 * seconds; -1 when it cannot connect. */
int kvt_ts_connect(int port, int timeout_s);

/** Sends all n bytes (stops quietly when the peer closed). */
void kvt_ts_send_all(int fd, const char *p, size_t n);

/** Sends one HTTP/1.0 request (body as application/json when non-NULL;
 * `headers` are extra "Name: value\r\n" lines). */
void kvt_ts_send_request(int fd, const char *method, const char *path, const char *headers, const char *body);

/** Reads the response until the server closes (or the timeout), closes fd. */
void kvt_ts_read_response(int fd, kvt_ts_resp *r);

/** connect + send + read. @return r->status. */
int kvt_ts_http(int port, const char *method, const char *path, const char *headers, const char *body,
                int timeout_s, kvt_ts_resp *r);

#endif
