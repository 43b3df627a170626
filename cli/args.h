/*
 * args.h: argument parsing shared by the `kvtier` subcommands (cli/cmd_*.c,
 * bench/bench_*.c). Command-line code only; not part of the library API.
 */
#ifndef KVT_CLI_ARGS_H
#define KVT_CLI_ARGS_H

#include "chat.h"

#include <stddef.h>
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

/** kvt_cli_int for a flag's value, saying a bad one on stderr as
 * "CMD: FLAG wants an integer in [lo, hi], got 'V' (CMD --help for usage)".
 * @return 0 (*out set), or 2 (the usage error was printed). */
int kvt_cli_int_arg(const char *cmd, const char *flag, const char *v, long long lo, long long hi, long long *out);

/** kvt_cli_float for a flag's value, saying a bad one as kvt_cli_int_arg
 * does ("wants a number in [lo, hi]", or "a finite number >= lo" when hi is
 * INFINITY). @return 0 (*out set), or 2. */
int kvt_cli_float_arg(const char *cmd, const char *flag, const char *v, float lo, float hi, float *out);

/* ---- the flags `kvtier generate` and `kvtier chat` share ----------------------- */

/** The engine, sampling and live-cache flags of generate and chat, parsed by
 * one parser (kvt_cli_engine_arg) so both spell, bound and refuse them alike.
 * The caller sets the defaults (and seed_min) before parsing. */
typedef struct kvt_cli_engine_flags {
    const char *model, *tokenizer; /* --model, --tokenizer: both, or neither (the default model) */
    float temperature;             /* --temperature, >= 0 (0 = greedy) */
    float top_p;                   /* --top-p, in [0, 1] */
    long long seed;                /* --seed, in [seed_min, LLONG_MAX] */
    long long seed_min;            /* set by the caller: generate INT64_MIN (0 = the time), chat 1 */
    long long block_tokens;        /* --block-tokens, in [1, 2^20] */
    long long threads;             /* --threads, in [1, KVT_MODEL_MAX_THREADS]; 0 = not given */
    kvt_kv_scheme kv_scheme;       /* --kv-dtype */
    long long live_blocks;         /* --live-cache-blocks, >= 0 (0 = no bound) */
    uint64_t live_bytes;           /* --live-cache-bytes (0 = no bound) */
    const char *live_dir;          /* --live-cache-dir */
    int live_strict;               /* --live-cache-strict */
} kvt_cli_engine_flags;

/** Parses argv[*i] when it is one of kvt_cli_engine_flags' flags, as
 * "--flag VALUE" or "--flag=VALUE" (--live-cache-strict takes no value).
 * @param cmd names the command in messages ("kvtier chat").
 * @return 0: not one of them (nothing changed); 1: parsed (*i is left on the
 *   last argument used); 2: a usage error, printed on stderr as
 *   "CMD: --flag wants ..., got 'VALUE'" or "CMD: --flag needs a value". */
int kvt_cli_engine_arg(const char *cmd, int argc, char **argv, int *i, kvt_cli_engine_flags *f);

/** The checks after parsing: --model and --tokenizer together or neither;
 * --live-cache-dir and --live-cache-strict only with a bound.
 * @return 0, or 2 (a usage error, printed on stderr as kvt_cli_engine_arg's). */
int kvt_cli_engine_check(const char *cmd, const kvt_cli_engine_flags *f);

/** Loads f->model and f->tokenizer (both NULL: the built-in default model,
 * created on first use) and says on stderr which file failed and why:
 * "CMD: cannot load the model: ...", "CMD: cannot load the tokenizer: ..."
 * or "CMD: cannot create the default model: ...".
 * @param model_out, tok_out NULL, or receive the paths loaded (cap bytes each).
 * @param m, tok receive objects the caller frees with kvt_model_free and
 *   kvt_tokenizer_free (NULL on error).
 * @return 0, or 1 (the message was printed). */
int kvt_cli_engine_load(const char *cmd, const kvt_cli_engine_flags *f, kvt_model **m, kvt_tokenizer **tok,
                        char *model_out, char *tok_out, size_t cap);

#endif
