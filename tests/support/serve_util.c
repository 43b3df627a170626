/* serve_util.c: `kvtier serve` child processes and an HTTP/1.0 client for the server tests. */
#include "serve_util.h"

#include "child_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

/* How many times slower this build runs (CMake: 10 under TSan, 3 under
 * ASan, else 1): the waits for a child to get ready or to exit are
 * multiplied by it. */
#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif

int kvt_ts_read_file(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = '\0';
    fclose(f);
    return (int)n;
}

/* Forks bin with args and waits for `until` in its log (the port is read
 * from the "listening on" line). */
static int server_run(kvt_ts_server *sv, const char *bin, const char *log_path, const char *const *args,
                      const char *until)
{
    snprintf(sv->log, sizeof sv->log, "%s", log_path);
    const char *argv[64] = {bin, "serve", "--port", "0"};
    int n = 4;
    for (int i = 0; args && args[i] && n < 62; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    sv->port = 0;
    unlink(sv->log); /* never read the ready line of an earlier server */
    pid_t parent = getpid();
    sv->pid = fork();
    if (sv->pid < 0)
        return -1;
    if (sv->pid == 0) {
        child_guard_in_child(parent);
        int fd = open(sv->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        int null = open("/dev/null", O_RDWR);
        dup2(null, 1); /* never hold the test's stdout open (ctest waits for it) */
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    child_guard_add(sv->pid);
    static char buf[16384];
    const char *tag = "listening on http://127.0.0.1:";
    for (int i = 0; i < 3000 * KVT_TEST_TIME_SCALE; i++) {
        if (kvt_ts_read_file(sv->log, buf, sizeof buf) > 0 && strstr(buf, until)) {
            const char *p = strstr(buf, tag);
            sv->port = p ? atoi(p + strlen(tag)) : 0;
            if (sv->port > 0)
                return 0;
            break;
        }
        int st;
        if (waitpid(sv->pid, &st, WNOHANG) == sv->pid) {
            fprintf(stderr, "server exited early: %s\n", buf);
            child_guard_del(sv->pid);
            sv->pid = 0;
            return -1;
        }
        usleep(10000);
    }
    fprintf(stderr, "server did not get to '%s': %s\n", until, buf);
    kvt_ts_server_kill(sv);
    return -1;
}

int kvt_ts_server_start(kvt_ts_server *sv, const char *bin, const char *log_path, const char *const *args)
{
    return server_run(sv, bin, log_path, args, "ready, model");
}

int kvt_ts_server_spawn(kvt_ts_server *sv, const char *bin, const char *log_path, const char *const *args)
{
    return server_run(sv, bin, log_path, args, "listening on");
}

int kvt_ts_server_stop(kvt_ts_server *sv)
{
    if (sv->pid <= 0)
        return -1;
    kill(sv->pid, SIGTERM);
    for (int i = 0; i < 3000 * KVT_TEST_TIME_SCALE; i++) {
        int st;
        if (waitpid(sv->pid, &st, WNOHANG) == sv->pid) {
            child_guard_del(sv->pid);
            sv->pid = 0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        usleep(10000);
    }
    kvt_ts_server_kill(sv);
    return -1;
}

void kvt_ts_server_kill(kvt_ts_server *sv)
{
    if (sv->pid <= 0)
        return;
    kill(sv->pid, SIGKILL);
    waitpid(sv->pid, NULL, 0);
    child_guard_del(sv->pid);
    sv->pid = 0;
}

void kvt_ts_resp_free(kvt_ts_resp *r)
{
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof *r);
}

int kvt_ts_connect(int port, int timeout_s)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    struct timeval tv = {.tv_sec = timeout_s};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

void kvt_ts_send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0)
            return; /* the server may close early (413, 401): the reply tells */
        p += k;
        n -= (size_t)k;
    }
}

void kvt_ts_send_request(int fd, const char *method, const char *path, const char *headers, const char *body)
{
    char head[2048];
    size_t bl = body ? strlen(body) : 0;
    snprintf(head, sizeof head, "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\n%s%s", method, path,
             body ? "Content-Type: application/json\r\n" : "", headers ? headers : "");
    char cl[64] = "";
    if (body)
        snprintf(cl, sizeof cl, "Content-Length: %zu\r\n", bl);
    kvt_ts_send_all(fd, head, strlen(head));
    kvt_ts_send_all(fd, cl, strlen(cl));
    kvt_ts_send_all(fd, "\r\n", 2);
    if (body)
        kvt_ts_send_all(fd, body, bl);
}

void kvt_ts_read_response(int fd, kvt_ts_resp *r)
{
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 4096 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t k = recv(fd, buf + n, cap - n - 1, 0);
        if (k <= 0)
            break;
        n += (size_t)k;
    }
    buf[n] = '\0';
    close(fd);
    memset(r, 0, sizeof *r);
    char *sep = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) || !sep) {
        r->status = -1;
        r->head = buf;
        r->body = strdup("");
        return;
    }
    r->status = atoi(buf + 9);
    *sep = '\0';
    r->head = strdup(buf);
    r->len = n - (size_t)(sep + 4 - buf);
    r->body = malloc(r->len + 1);
    memcpy(r->body, sep + 4, r->len);
    r->body[r->len] = '\0';
    free(buf);
}

int kvt_ts_http(int port, const char *method, const char *path, const char *headers, const char *body,
                int timeout_s, kvt_ts_resp *r)
{
    int fd = kvt_ts_connect(port, timeout_s);
    if (fd < 0) {
        memset(r, 0, sizeof *r);
        r->status = -1;
        r->head = strdup("");
        r->body = strdup("");
        return -1;
    }
    kvt_ts_send_request(fd, method, path, headers, body);
    kvt_ts_read_response(fd, r);
    return r->status;
}
