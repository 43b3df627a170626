/*
 * args.c: the argument parsers of args.h, shared by the kvtier subcommands so
 * each spells a size the same way, and the one parser of the engine flags
 * generate and chat share. Owns no state; never exits. The value parsers
 * never print (the calling command reports a bad value in its own words);
 * the kvt_cli_engine_* functions print their usage errors on stderr, named
 * by the command, so both commands say them alike.
 */
#include "args.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
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

/* ---- the flags generate and chat share ----------------------------------------- */

int kvt_cli_int_arg(const char *cmd, const char *flag, const char *v, long long lo, long long hi, long long *out)
{
    if (!kvt_cli_int(v, lo, hi, out))
        return 0;
    fprintf(stderr, "%s: %s wants an integer in [%lld, %lld], got '%s' (%s --help for usage)\n", cmd, flag, lo, hi,
            v, cmd);
    return 2;
}

int kvt_cli_float_arg(const char *cmd, const char *flag, const char *v, float lo, float hi, float *out)
{
    if (!kvt_cli_float(v, lo, hi, out))
        return 0;
    if (isinf(hi))
        fprintf(stderr, "%s: %s wants a finite number >= %g, got '%s' (%s --help for usage)\n", cmd, flag,
                (double)lo, v, cmd);
    else
        fprintf(stderr, "%s: %s wants a number in [%g, %g], got '%s' (%s --help for usage)\n", cmd, flag,
                (double)lo, (double)hi, v, cmd);
    return 2;
}

int kvt_cli_engine_arg(const char *cmd, int argc, char **argv, int *i, kvt_cli_engine_flags *f)
{
    static const char *const with_value[] = {"--model", "--tokenizer", "--temperature", "--top-p", "--seed",
                                             "--block-tokens", "--threads", "--kv-dtype", "--live-cache-blocks",
                                             "--live-cache-bytes", "--live-cache-dir", NULL};
    const char *a = argv[*i];
    if (!strcmp(a, "--live-cache-strict")) {
        f->live_strict = 1;
        return 1;
    }
    const char *eq = strchr(a, '=');
    size_t n = eq ? (size_t)(eq - a) : strlen(a);
    int k = 0;
    while (with_value[k] && (strlen(with_value[k]) != n || strncmp(with_value[k], a, n)))
        k++;
    const char *flag = with_value[k];
    if (!flag)
        return 0;
    const char *v = eq ? eq + 1 : NULL;
    if (!v) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "%s: %s needs a value (%s --help for usage)\n", cmd, flag, cmd);
            return 2;
        }
        v = argv[++*i];
    }
    if (!strcmp(flag, "--model"))
        f->model = v;
    else if (!strcmp(flag, "--tokenizer"))
        f->tokenizer = v;
    else if (!strcmp(flag, "--temperature"))
        return kvt_cli_float_arg(cmd, flag, v, 0.0f, INFINITY, &f->temperature) ? 2 : 1;
    else if (!strcmp(flag, "--top-p"))
        return kvt_cli_float_arg(cmd, flag, v, 0.0f, 1.0f, &f->top_p) ? 2 : 1;
    else if (!strcmp(flag, "--seed"))
        return kvt_cli_int_arg(cmd, flag, v, f->seed_min, LLONG_MAX, &f->seed) ? 2 : 1;
    else if (!strcmp(flag, "--block-tokens"))
        return kvt_cli_int_arg(cmd, flag, v, 1, 1 << 20, &f->block_tokens) ? 2 : 1;
    else if (!strcmp(flag, "--threads"))
        return kvt_cli_int_arg(cmd, flag, v, 1, KVT_MODEL_MAX_THREADS, &f->threads) ? 2 : 1;
    else if (!strcmp(flag, "--kv-dtype")) {
        if (kvt_cli_kv_scheme(v, &f->kv_scheme)) {
            fprintf(stderr, "%s: --kv-dtype wants f32, f16, bf16 or q8, got '%s'\n", cmd, v);
            return 2;
        }
    } else if (!strcmp(flag, "--live-cache-blocks"))
        return kvt_cli_int_arg(cmd, flag, v, 0, LLONG_MAX, &f->live_blocks) ? 2 : 1;
    else if (!strcmp(flag, "--live-cache-bytes")) {
        if (kvt_cli_bytes(v, &f->live_bytes, NULL)) {
            fprintf(stderr, "%s: --live-cache-bytes wants a byte count (%s), got '%s'\n", cmd,
                    KVT_CLI_BYTES_FORMS, v);
            return 2;
        }
    } else if (!strcmp(flag, "--live-cache-dir"))
        f->live_dir = v;
    return 1;
}

int kvt_cli_engine_check(const char *cmd, const kvt_cli_engine_flags *f)
{
    if ((f->model != NULL) != (f->tokenizer != NULL)) {
        fprintf(stderr, "%s: %s given without %s (give both, or neither for the default model)\n", cmd,
                f->model ? "--model" : "--tokenizer", f->model ? "--tokenizer" : "--model");
        return 2;
    }
    if ((f->live_dir || f->live_strict) && !f->live_blocks && !f->live_bytes) {
        fprintf(stderr, "%s: %s needs --live-cache-blocks N or --live-cache-bytes B\n", cmd,
                f->live_dir ? "--live-cache-dir" : "--live-cache-strict");
        return 2;
    }
    return 0;
}

int kvt_cli_engine_load(const char *cmd, const kvt_cli_engine_flags *f, kvt_model **m, kvt_tokenizer **tok,
                        char *model_out, char *tok_out, size_t cap)
{
    kvt_chat_load_part part = KVT_CHAT_LOAD_OK;
    int rc = kvt_chat_load_from(f->model, f->tokenizer, m, tok, model_out, tok_out, cap, &part);
    if (!rc)
        return 0;
    const char *what = part == KVT_CHAT_LOAD_TOKENIZER        ? "cannot load the tokenizer"
                       : part == KVT_CHAT_LOAD_DEFAULT_MODEL ? "cannot create the default model"
                       : part == KVT_CHAT_LOAD_MODEL         ? "cannot load the model"
                                                             : "cannot load the model and tokenizer";
    const char *detail = kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc);
    if (strstr(detail, kvt_strerror(rc)))
        fprintf(stderr, "%s: %s: %s\n", cmd, what, detail);
    else
        fprintf(stderr, "%s: %s: %s (%s)\n", cmd, what, detail, kvt_strerror(rc));
    return 1;
}
