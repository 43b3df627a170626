/*
 * test_serve_events.c: the dashboard's HTTP side of kvtier serve without a
 * browser (server/dashboard.h), in process over loopback sockets with
 * stories260K (skipped with a message when KVT_SHARED_DIR lacks it): the
 * page and its files are served from the binary, an unknown file is 404;
 * /events sends a finished request as a `request` event with its seq and
 * a `snapshot` event with the counters; 16 streams are served and the 17th
 * gets 503; a stream whose client closed frees its place; stopping the
 * server ends every stream at once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server.h"

#define STREAMS 16 /* the server's default bound */

static char model[1024], tokenizer[1024];
static int have_model;

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int open_get(int port, const char *path)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char req[512];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", path);
    assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    return fd;
}

/* Reads from fd into buf (NUL-terminated, at most cap-1 bytes) until `want` appears, EOF, or
 * timeout_ms. @return bytes read; *eof set when the peer closed. */
static size_t read_until(int fd, char *buf, size_t cap, const char *want, double timeout_ms, int *eof)
{
    size_t n = 0;
    double end = now_ms() + timeout_ms;
    *eof = 0;
    buf[0] = '\0';
    while (n + 1 < cap && (!want || !strstr(buf, want))) {
        int left = (int)(end - now_ms());
        if (left <= 0)
            break;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, left) <= 0)
            break;
        ssize_t k = recv(fd, buf + n, cap - 1 - n, 0);
        if (k <= 0) {
            *eof = 1;
            break;
        }
        n += (size_t)k;
        buf[n] = '\0';
    }
    return n;
}

static void get(int port, const char *path, char *buf, size_t cap)
{
    int fd = open_get(port, path), eof;
    char *p = buf;
    read_until(fd, p, cap, NULL, 30000, &eof);
    close(fd);
}

static void post_completion(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    const char *body = "{\"prompt\": \"Once upon a time\", \"max_tokens\": 4, \"temperature\": 0}";
    char req[512];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
    assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    char buf[4096];
    int eof;
    read_until(fd, buf, sizeof buf, NULL, 30000, &eof);
    close(fd);
    assert_non_null(strstr(buf, "HTTP/1.1 200"));
}

static kvt_server *start(void)
{
    kvt_server_opts o = {.model_path = model, .tok_path = tokenizer, .prompt_cache_bytes = 16u << 20};
    kvt_server *s = NULL;
    assert_int_equal(kvt_server_start(&o, &s), 0);
    assert_int_equal(kvt_server_load(s), 0);
    return s;
}

static void test_page_files(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    kvt_server *s = start();
    int port = kvt_server_port(s);
    static char buf[1 << 20];
    get(port, "/dashboard", buf, sizeof buf);
    assert_non_null(strstr(buf, "HTTP/1.1 200"));
    assert_non_null(strstr(buf, "Content-Type: text/html"));
    assert_non_null(strstr(buf, "id=\"kpi-requests\""));
    assert_non_null(strstr(buf, "src=\"/dashboard/chart.js\""));
    get(port, "/dashboard/dashboard.js", buf, sizeof buf);
    assert_non_null(strstr(buf, "HTTP/1.1 200"));
    assert_non_null(strstr(buf, "new EventSource('/events')"));
    get(port, "/dashboard/dashboard.css", buf, sizeof buf);
    assert_non_null(strstr(buf, "@media (max-width"));
    get(port, "/dashboard/../server.c", buf, sizeof buf);
    assert_non_null(strstr(buf, "HTTP/1.1 404"));
    if (access("/usr/share/javascript/chart.js/chart.min.js", R_OK) == 0 && !getenv("KVTIER_CHARTJS")) {
        get(port, "/dashboard/chart.js", buf, sizeof buf);
        assert_non_null(strstr(buf, "HTTP/1.1 200"));
        assert_non_null(strstr(buf, "Chart.js v"));
    }
    assert_int_equal(kvt_server_stop(s, 1000), 0);
    kvt_server_destroy(s);
}

static void test_events(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    kvt_server *s = start();
    int port = kvt_server_port(s);
    post_completion(port);
    int fd = open_get(port, "/events"), eof;
    static char buf[1 << 16];
    read_until(fd, buf, sizeof buf, "event: snapshot", 30000, &eof);
    assert_non_null(strstr(buf, "HTTP/1.1 200"));
    assert_non_null(strstr(buf, "Content-Type: text/event-stream"));
    assert_non_null(strstr(buf, "retry: 2000"));
    const char *rq = strstr(buf, "event: request\nid: 1\ndata: {\"seq\":1,");
    assert_non_null(rq);
    assert_non_null(strstr(rq, "\"endpoint\":\"/v1/completions\""));
    assert_non_null(strstr(rq, "\"completion_tokens\":4"));
    const char *snap = strstr(buf, "event: snapshot\ndata: {");
    assert_non_null(snap);
    read_until(fd, buf, sizeof buf, "\n\n", 30000, &eof); /* the rest of the snapshot */
    /* a second request comes as its own event, while the stream stays open */
    post_completion(port);
    read_until(fd, buf, sizeof buf, "\"seq\":2,", 30000, &eof);
    assert_non_null(strstr(buf, "event: request\nid: 2\n"));
    /* the next snapshot counts both */
    read_until(fd, buf, sizeof buf, "\"completions\":2,", 30000, &eof);
    assert_non_null(strstr(buf, "\"completions\":2,"));
    close(fd);
    assert_int_equal(kvt_server_stop(s, 1000), 0);
    kvt_server_destroy(s);
}

static void test_bound_release_stop(void **state)
{
    (void)state;
    if (!have_model)
        skip();
    kvt_server *s = start();
    int port = kvt_server_port(s);
    int fds[STREAMS], eof;
    char buf[8192];
    for (int i = 0; i < STREAMS; i++) {
        fds[i] = open_get(port, "/events");
        read_until(fds[i], buf, sizeof buf, "retry: 2000", 30000, &eof);
        assert_non_null(strstr(buf, "HTTP/1.1 200"));
    }
    int over = open_get(port, "/events");
    read_until(over, buf, sizeof buf, "}}", 30000, &eof);
    close(over);
    assert_non_null(strstr(buf, "HTTP/1.1 503"));
    assert_non_null(strstr(buf, "\"code\":\"too_many_streams\""));
    /* a client that goes away frees its place */
    close(fds[0]);
    double t0 = now_ms();
    int ok = 0;
    while (!ok && now_ms() - t0 < 30000) {
        usleep(50000);
        fds[0] = open_get(port, "/events");
        read_until(fds[0], buf, sizeof buf, "\r\n", 30000, &eof);
        ok = strstr(buf, "HTTP/1.1 200") != NULL;
        if (!ok)
            close(fds[0]);
    }
    printf("a closed stream's place was free again after %.0f ms\n", now_ms() - t0);
    assert_true(ok);
    /* stopping ends every stream at once: it does not wait out its 20 s
     * grace for them */
    t0 = now_ms();
    assert_int_equal(kvt_server_stop(s, 20000), 0);
    for (int i = 0; i < STREAMS; i++) {
        size_t n;
        do
            n = read_until(fds[i], buf, sizeof buf, NULL, 30000, &eof);
        while (n && !eof);
        assert_true(eof);
        close(fds[i]);
    }
    double stop_ms = now_ms() - t0;
    printf("stop with %d open streams: %.0f ms\n", STREAMS, stop_ms);
    assert_true(stop_ms < 10000); /* without ending the streams the stop waits 20 s for them */
    kvt_server_destroy(s);
}

int main(void)
{
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared ? shared : "../shared");
    snprintf(tokenizer, sizeof tokenizer, "%s/data/models/tok512.bin", shared ? shared : "../shared");
    have_model = access(model, R_OK) == 0 && access(tokenizer, R_OK) == 0;
    if (!have_model)
        printf("test_serve_events: skipped: needs %s with tok512.bin (set KVT_SHARED_DIR)\n", model);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_page_files),
        cmocka_unit_test(test_events),
        cmocka_unit_test(test_bound_release_stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
