/*
 * args.h: argument parsing shared by the `kvtier` subcommands (cli/cmd_*.c,
 * bench/bench_*.c). Command-line code only; not part of the library API.
 */
#ifndef KVT_CLI_ARGS_H
#define KVT_CLI_ARGS_H

#include <stdint.h>

/** Parses a byte count: a decimal number (a fraction is allowed: "1.5G")
 * with an optional suffix K, M, G or T (powers of 1024) and an optional
 * trailing "B" (e.g. 4096, 512M, 10GB), truncated to whole bytes into *out.
 * @param end NULL: the count must be all of s; else receives a pointer just
 *   past the count (the caller checks what follows, e.g. a list separator).
 * @return 0, or -1 when s does not start with a count, the count is negative
 *   or does not fit in 64 bits, or (end NULL) text follows it; *out and *end
 *   are then left alone. */
int kvt_cli_bytes(const char *s, uint64_t *out, const char **end);

/** Parses all of s as a decimal integer (strtoll syntax) in [lo, hi].
 * @return 0, or -1 when s is NULL or empty, has anything after the number,
 *   or the number is out of range (*out is then left alone). */
int kvt_cli_int(const char *s, long long lo, long long hi, long long *out);

/** Parses all of s as a finite number (strtof syntax) in [lo, hi] (hi may
 * be INFINITY). @return 0, or -1 as kvt_cli_int (also for NaN and inf). */
int kvt_cli_float(const char *s, float lo, float hi, float *out);

#endif
