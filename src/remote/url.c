/*
 * url.c: parses `redis://[user:password@]host:port[/db]` for the remote tier.
 * It must never copy a password into an error message.
 */
#include "remote_internal.h"

#include <stdlib.h>
#include <string.h>

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Copies s[0..n) percent-decoded into out (cap bytes). @return 0 or -1. */
static int decode(const char *s, size_t n, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '%') {
            if (i + 2 >= n)
                return -1;
            int a = hexval(s[i + 1]), b = hexval(s[i + 2]);
            if (a < 0 || b < 0 || (a == 0 && b == 0))
                return -1;
            c = (char)(a * 16 + b);
            i += 2;
        }
        if (k + 1 >= cap)
            return -1;
        out[k++] = c;
    }
    out[k] = 0;
    return 0;
}

static int parse_int(const char *s, size_t n, long lo, long hi, int *out)
{
    if (n == 0 || n > 6)
        return -1;
    long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    if (v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

KVT_API int kvt_remote_url_parse(const char *url, kvt_remote_url *out)
{
    if (!url || !out)
        return kvt__fail(KVT_EINVAL, "kvt_remote_url_parse: NULL argument");
    memset(out, 0, sizeof *out);
    out->port = 6379;
    static const char scheme[] = "redis://";
    if (strncmp(url, scheme, sizeof scheme - 1) != 0)
        return kvt__fail(KVT_EINVAL, "redis URL: must start with redis:// (rediss:// and unix sockets are not supported)");
    const char *s = url + sizeof scheme - 1;
    const char *end = s + strlen(s);
    const char *slash = memchr(s, '/', (size_t)(end - s));
    const char *auth_end = NULL;
    for (const char *p = slash ? slash : end; p > s; p--)
        if (p[-1] == '@') {
            auth_end = p - 1;
            break;
        }
    if (auth_end) {
        const char *colon = memchr(s, ':', (size_t)(auth_end - s));
        if (colon) {
            if (decode(s, (size_t)(colon - s), out->user, sizeof out->user) ||
                decode(colon + 1, (size_t)(auth_end - colon - 1), out->password, sizeof out->password)) {
                memset(out, 0, sizeof *out);
                return kvt__fail(KVT_EINVAL, "redis URL: bad or too long user or password");
            }
        } else if (decode(s, (size_t)(auth_end - s), out->password, sizeof out->password)) {
            memset(out, 0, sizeof *out);
            return kvt__fail(KVT_EINVAL, "redis URL: bad or too long password");
        }
        s = auth_end + 1;
    }
    const char *hp_end = slash ? slash : end;
    const char *host_end = hp_end;
    const char *colon = NULL;
    for (const char *p = s; p < hp_end; p++)
        if (*p == ':')
            colon = p;
    if (colon)
        host_end = colon;
    size_t hl = (size_t)(host_end - s);
    if (hl == 0 || hl >= sizeof out->host) {
        memset(out, 0, sizeof *out);
        return kvt__fail(KVT_EINVAL, "redis URL: empty or too long host");
    }
    memcpy(out->host, s, hl);
    out->host[hl] = 0;
    if (strpbrk(out->host, "@/?# ")) {
        memset(out, 0, sizeof *out);
        return kvt__fail(KVT_EINVAL, "redis URL: bad host");
    }
    if (colon && parse_int(colon + 1, (size_t)(hp_end - colon - 1), 1, 65535, &out->port)) {
        char host[256];
        memcpy(host, out->host, sizeof host);
        memset(out, 0, sizeof *out);
        return kvt__fail(KVT_EINVAL, "redis URL: host %s: port must be 1..65535", host);
    }
    if (slash && slash + 1 < end && parse_int(slash + 1, (size_t)(end - slash - 1), 0, 15, &out->db)) {
        memset(out, 0, sizeof *out);
        return kvt__fail(KVT_EINVAL, "redis URL: db must be 0..15 and nothing may follow it");
    }
    return 0;
}
