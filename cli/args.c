/*
 * args.c: the argument parsers of args.h, shared by the kvtier subcommands so
 * each spells a size the same way. Owns no state; never prints or exits (the
 * calling command reports a bad argument in its own words).
 */
#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int kvt_cli_bytes(const char *s, uint64_t *out, const char **endp)
{
    if (!s || !out)
        return -1;
    size_t n = endp ? strspn(s, "0123456789.kKmMgGtTiIbB") : strlen(s);
    char buf[64];
    if (n == 0 || n >= sizeof buf)
        return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    uint64_t v;
    if (kvt_chat_parse_bytes(NULL, buf, &v))
        return -1;
    *out = v;
    if (endp)
        *endp = s + n;
    return 0;
}

int kvt_cli_int(const char *s, long long lo, long long hi, long long *out)
{
    if (!s)
        return -1;
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (errno || end == s || *end || x < lo || x > hi)
        return -1;
    *out = x;
    return 0;
}

int kvt_cli_kv_scheme(const char *s, kvt_kv_scheme *out)
{
    kvt_kv_scheme k;
    if (!s || kvt_kv_scheme_parse(s, &k))
        return -1;
    *out = k;
    return 0;
}

int kvt_cli_float(const char *s, float lo, float hi, float *out)
{
    if (!s)
        return -1;
    char *end;
    errno = 0;
    float x = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(x) || x < lo || x > hi)
        return -1;
    *out = x;
    return 0;
}
