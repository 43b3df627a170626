/*
 * args.h: argument parsing shared by the `kvtier` subcommands (cli/cmd_*.c,
 * bench/bench_*.c). Command-line code only; not part of the library API.
 */
#ifndef KVT_CLI_ARGS_H
#define KVT_CLI_ARGS_H

#include "chat.h"

#include <stdint.h>

/** The byte-count forms every command accepts, for --help and messages. */
#define KVT_CLI_BYTES_FORMS KVT_CHAT_BYTES_FORMS

/** Parses a byte count, the one grammar of every kvtier command (chat,
 * replay, store gc, bench): kvt_chat_parse_bytes (engine/chat.h), i.e.
 * DIGITS[.DIGITS][K|M|G|T[i]][B], powers of 1024, rounded down to whole
 * bytes ("1.5G" is 1610612736).
 * @param end NULL: the count must be all of s; else receives a pointer just
 *   past the count (the longest run of the form's characters: the caller
 *   checks what follows, e.g. a ',' of a list).
 * @return 0, or -1 when s (or its leading run, with end) is not a byte count
 *   or is 2^64 bytes or more; *out and *end are then left alone. */
int kvt_cli_bytes(const char *s, uint64_t *out, const char **end);

/** Parses all of s as a decimal integer (strtoll syntax) in [lo, hi].
 * @return 0, or -1 when s is NULL or empty, has anything after the number,
 *   or the number is out of range (*out is then left alone). */
int kvt_cli_int(const char *s, long long lo, long long hi, long long *out);

/** Parses all of s as a finite number (strtof syntax) in [lo, hi] (hi may
 * be INFINITY). @return 0, or -1 as kvt_cli_int (also for NaN and inf). */
int kvt_cli_float(const char *s, float lo, float hi, float *out);

/** The --kv-dtype help text of chat, serve and generate (26-column indent);
 * the default is each command's own. */
#define KVT_CLI_KV_DTYPE_HELP                                                                                 \
    "  --kv-dtype S          storage scheme of the K/V every tier holds: f32, f16, bf16, q8\n"                \
    "                        (8-bit codes: attention K/V per channel over each kv block,\n"                   \
    "                        its open block in f32; window rings per token); state of\n"                      \
    "                        one scheme never serves another\n"

/** Parses a --kv-dtype value ("f32", "f16", "bf16", "q8") into *out.
 * @return 0, or -1 (*out is then left alone). */
int kvt_cli_kv_scheme(const char *s, kvt_kv_scheme *out);

#endif
