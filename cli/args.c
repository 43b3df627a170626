/*
 * args.c: the argument parsers of args.h, shared by the kvtier subcommands so
 * each spells a size the same way. Owns no state; never prints or exits (the
 * calling command reports a bad argument in its own words).
 */
#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

int kvt_cli_bytes(const char *s, uint64_t *out, const char **endp)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v >= 0)) /* also refuses NaN */
        return -1;
    double m = 1;
    switch (*end) {
    case 'k': case 'K': m = 1024.0; end++; break;
    case 'm': case 'M': m = 1024.0 * 1024; end++; break;
    case 'g': case 'G': m = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': m = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'B' || *end == 'b')
        end++;
    if (!(v * m < 18446744073709551616.0)) /* 2^64: inf and overflow */
        return -1;
    if (endp)
        *endp = end;
    else if (*end)
        return -1;
    *out = (uint64_t)(v * m);
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
