/*
 * cmd_chat.c: `kvtier chat`, the main job: a multi-turn chat on the
 * reference engine whose turns prefill only what the prompt cache does not
 * already hold. Replies go to stdout; after each reply exactly one line goes
 * to stderr: "turn N: reused R tokens, prefilled P tokens, ttft T ms"
 * (scripts rely on it). Owns argument parsing and output; the work is in
 * engine/chat.c. Must never print anything else on stderr between turns,
 * except the one warning of a tier level that degraded (engine/tiers.c,
 * kvt_tiers_warn): the directory and the cause, once.
 */
#include "chat.h"
#include "tiers.h"
#include "args.h"
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier chat [--model M.bin --tokenizer T.bin] [--script FILE] [--session ID]\n"
            "                   [--prompt-cache BYTES] [--kv-budget BYTES] [--max-tokens N]\n"
            "                   [--temperature T] [--top-p P] [--seed S] [--block-tokens B]\n"
            "                   [--adapter NAME --adapter-version V] [--multiline] [--stats]\n"
            "                   [--ssd-cache DIR [--ssd-cache-max BYTES] [--ssd-cache-verify]\n"
            "                    [--demote-idle MS]] [--prompt-cache-dir DIR ...] [--transcript FILE]\n"
            "                   [--redis URL [--redis-cluster] [--redis-timeout MS] [--redis-ttl SECONDS]\n"
            "                   [--redis-restore-timeout MS]]\n"
            "                   [--live-cache-blocks N] [--live-cache-bytes B] [--live-cache-dir DIR]\n"
            "                   [--live-cache-strict]\n"
            "                   [--prefill-checkpoint-stride TOKENS] [--threads N]\n"
            "                   [--kv-dtype f32|f16|bf16|q8]\n"
            "\n"
            "Multi-turn chat on the reference engine. Each turn re-sends the whole conversation\n"
            "(chat template \"User: ...\\nAssistant: ...\"); the prompt cache serves the prefix it\n"
            "already holds, so only new tokens are prefilled. Replies go to stdout; after each\n"
            "reply one line goes to stderr:\n"
            "    turn N: reused R tokens, prefilled P tokens, ttft T ms\n"
            "Every flag with a value takes it as --flag VALUE or --flag=VALUE.\n"
            "\n"
            "  --model, --tokenizer  llama2.c checkpoint and tokenizer.bin (default: the built-in\n"
            "                        default model, created on first use)\n"
            "  --script FILE         one user message per line (blank and '#' lines skipped);\n"
            "                        default: read messages from stdin (end of input, Ctrl-C\n"
            "                        or SIGTERM end the chat after the running turn, keeping\n"
            "                        the cache; a second Ctrl-C kills). Limits, on both: a line\n"
            "                        is at most 1 MiB and holds no NUL byte; a script is at most\n"
            "                        64 MiB. Input past a limit is refused, naming it (exit 1).\n"
            "  --session ID          session id for affinity (default \"chat\")\n"
            "  --prompt-cache BYTES  RAM prompt cache (default 1G); 0 keeps nothing: the\n"
            "                        cache-off baseline. BYTES: 4096, 512M, 1.5G, 2GiB...\n"
            "                        (K, M, G, T are powers of 1024; kvtier --help says all forms)\n"
            "  --kv-budget BYTES     admission budget of projected KV bytes (default 0: unlimited;\n"
            "                        the service's kv_budget_bytes)\n"
            "  --max-tokens, --steps N  reply tokens per turn (default 64)\n"
            "  --temperature T       0 = greedy (default); --top-p P as kvtier generate (default 0.9)\n"
            "  --seed S              sampling seed, a positive integer (default 42)\n"
            "  --block-tokens B      kv block size in tokens (default 256)\n"
            "  --threads N           engine threads, this one included, 1 to 64 (default: online\n"
            "                        CPUs, at most 8); replies do not depend on it\n"
            KVT_CLI_KV_DTYPE_HELP
            "                        (default f16: greedy replies of stories260K agree with f32 on\n"
            "                        64 of 64 prompts, perplexity equal, half the bytes; `kvtier\n"
            "                        bench kv-dtype`; a cached prefix is cut back at block\n"
            "                        boundaries)\n"
            "  --prefill-checkpoint-stride TOKENS  on models with recurrent or sliding-window\n"
            "                        layers, keep the state every TOKENS prompt tokens while a\n"
            "                        prompt is prefilled, so a new conversation sharing a start\n"
            "                        reuses it (default: the kv block size; 0 = off)\n"
            "  --adapter NAME --adapter-version V  state namespace \"NAME@V\" (default: base model)\n"
            "  --multiline           let replies run past a newline (default: stop at '\\n')\n"
            "  --live-cache-blocks N, --live-cache-bytes B  keep at most N full kv blocks (B bytes)\n"
            "                        of each turn in RAM, page the rest to a file under\n"
            "                        --live-cache-dir DIR (default $TMPDIR, else /tmp) and back;\n"
            "                        replies unchanged (docs/residency.md); every --kv-dtype (f16,\n"
            "                        bf16, q8: their sealed blocks are paged, the f32 open block stays)\n"
            "  --live-cache-strict   the bound holds exactly: a block past it is released as soon\n"
            "                        as it is written, and the turn waits for that write (default:\n"
            "                        up to 4 blocks per layer stay in RAM while being written)\n"
            "  --stats               print the model identity and what hashing it cost at startup,\n"
            "                        and the service report (JSON) at the end, on stderr\n"
            "  --ssd-cache DIR       SSD tier under the prompt cache: every kept prefix is queued there\n"
            "                        at once (write-behind), so a later run (a restart, even after kill -9)\n"
            "                        reuses the conversation from disk. State is kept per identity:\n"
            "                        XXH3-128 of every byte of the model and of the tokenizer.\n"
            "                        A DIR that cannot be written (read-only, another user's, locked\n"
            "                        by another process for over 1 s) is used read-only, or not at\n"
            "                        all; a write that fails later (full disk, DIR deleted) stops the\n"
            "                        writes. Either way one warning names DIR and the cause, the chat\n"
            "                        goes on (replies unchanged, exit 0) and --stats counts it\n"
            "                        (\"ssd_cache\": mode, cause, write_failures, writes_skipped)\n"
            "  --ssd-cache-max BYTES byte budget over DIR (default 0: unlimited)\n"
            "  --ssd-cache-verify    also check SHA-256 of every shard on load (XXH3-128 is always checked)\n"
            "  --demote-idle MS      prefixes idle MS milliseconds leave RAM once on SSD\n"
            "  --prompt-cache-dir DIR  mount the published prompt cache in DIR (kvtier cache publish)\n"
            "                        read-only, below the other tiers; repeatable. Its CURRENT\n"
            "                        generation is validated whole (SHA-256 of every shard) before it\n"
            "                        serves; a new publication is picked up between turns; a refused\n"
            "                        one is warned about once and the mounted one keeps serving\n"
            "  --redis URL           shared remote tier on Redis, below the SSD tier:\n"
            "                        redis://[user:password@]host:port[/db] (the password may come from\n"
            "                        KVTIER_REDIS_PASSWORD instead; it is never printed). Every kept\n"
            "                        prefix is also written there (write-behind), so another host\n"
            "                        serving the same model reuses it; Redis evicts on its own\n"
            "                        (maxmemory + allkeys-lru). A Redis that is down or slow makes\n"
            "                        misses, never an error: one warning, retried in the background\n"
            "  --redis-cluster       URL names a node of a Redis Cluster (slot map, MOVED/ASK)\n"
            "  --redis-timeout MS    bound on one Redis lookup (default 50)\n"
            "  --redis-restore-timeout MS  bound on one whole restore from Redis, every round trip\n"
            "                        and read of it (default 1000); past it the request prefills\n"
            "  --redis-ttl SECONDS   expiry of every key written (default 0: none)\n"
            "  --transcript FILE     resume the conversation saved in FILE (JSON: [{\"user\": ...,\n"
            "                        \"assistant\": ...}, ...]) and save it there after every turn;\n"
            "                        with --ssd-cache a new process continues where the last stopped.\n"
            "                        At most 64 MiB; checked before the first turn (a missing\n"
            "                        directory or a FILE that cannot be written is refused then)\n"
            "\n"
            "The model's context (its seq_len positions) bounds the whole conversation; there is no\n"
            "history truncation. A reply is cut to the positions its prompt leaves. A turn whose\n"
            "prompt alone (the whole conversation so far and its message) fills the context ends\n"
            "the chat with exit 3: the message says the prompt's tokens and the limit; earlier\n"
            "turns stay in the cache and, unchanged, in --transcript, and it says whether a new run\n"
            "can continue that transcript (only with a shorter message) or cannot (the history\n"
            "alone fills the context: start a new conversation).\n"
            "\n"
            "Exit status: 0 success, 1 failure (message on stderr), 2 usage error, 3 the context is\n"
            "full (above), 130 a script interrupted (Ctrl-C/SIGTERM) before its last message.\n");
}

static int usage_error(const char *msg, const char *arg)
{
    fprintf(stderr, "kvtier chat: %s%s%s (kvtier chat --help for usage)\n", msg, arg ? " " : "", arg ? arg : "");
    return 2;
}

static int parse_i64(const char *flag, const char *v, long long lo, long long hi, long long *out)
{
    return kvt_cli_int_arg("kvtier chat", flag, v, lo, hi, out);
}

/* Prints a reply: printable ASCII, tab, newline and UTF-8 bytes as they
 * are, other control bytes escaped (synthetic models emit arbitrary bytes). */
/* @return 0, or -errno when stdout could not take the reply. */
static int print_reply(const char *r)
{
    for (const unsigned char *p = (const unsigned char *)r; *p; p++) {
        if (*p >= 0x20 && *p != 0x7f)
            fputc(*p, stdout);
        else if (*p == '\t' || *p == '\n') /* '\n' only with --multiline */
            fputc(*p, stdout);
        else
            fprintf(stdout, "\\x%02x", *p);
    }
    fputc('\n', stdout);
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout))
        return -(errno ? errno : EIO);
    return 0;
}

/* The exit status of a chat that ended because a turn's prompt filled the
 * model's context (documented in --help and README). */
#define KVT_CHAT_EXIT_CONTEXT_FULL 3

/* Records a detail sentence for fail() (the CLI cannot use kvt__fail). */
static char cli_err[1024];
static int cli_fail(int code, const char *fmt, ...) KVT_PRINTF(2, 3);
static int cli_fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cli_err, sizeof cli_err, fmt, ap);
    va_end(ap);
    return code;
}

static int fail(const char *what, int rc)
{
    if (cli_err[0]) {
        if (strstr(cli_err, kvt_strerror(rc)))
            fprintf(stderr, "kvtier chat: %s: %s\n", what, cli_err);
        else
            fprintf(stderr, "kvtier chat: %s: %s (%s)\n", what, cli_err, kvt_strerror(rc));
        cli_err[0] = '\0';
        return 1;
    }
    const char *detail = kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc);
    if (strstr(detail, kvt_strerror(rc)))
        fprintf(stderr, "kvtier chat: %s: %s\n", what, detail);
    else
        fprintf(stderr, "kvtier chat: %s: %s (%s)\n", what, detail, kvt_strerror(rc));
    return 1;
}

/* Reads f to its end into a buffer (malloc; *out, *n bytes) grown as the
 * bytes arrive, starting from `hint` (a regular file's size), at most
 * cap + 1 bytes: *n > cap says the file holds more than cap. A small file
 * costs its own size, never cap. @return 0, ENOMEM (nothing allocated), or
 * the read's errno value (EIO when it set none). */
static int read_bounded(FILE *f, size_t hint, size_t cap, char **out, size_t *n)
{
    size_t size = hint < cap ? hint + 1 : cap + 1, len = 0;
    if (size < 4096)
        size = cap + 1 < 4096 ? cap + 1 : 4096;
    char *buf = malloc(size);
    *out = NULL;
    *n = 0;
    for (;;) {
        if (!buf)
            return ENOMEM;
        errno = 0;
        len += fread(buf + len, 1, size - len, f);
        if (ferror(f)) {
            int err = errno ? errno : EIO;
            free(buf);
            return err;
        }
        if (len < size || size == cap + 1)
            break;
        size_t next = size > (cap + 1) / 2 ? cap + 1 : size * 2;
        char *grown = realloc(buf, next);
        if (!grown)
            free(buf);
        buf = grown;
        size = next;
    }
    *out = buf;
    *n = len;
    return 0;
}

/* Reads the conversation saved in `path` into *doc (NULL: no file yet, a
 * new conversation), before anything is generated: a file over
 * KVT_CHAT_MAX_FILE, a directory, a path whose directory is missing or
 * cannot take the file (the save after each turn would fail) and a file that
 * is not a JSON array of turns are refused here, naming the real cause. */
static int transcript_read(const char *path, json_t **doc)
{
    *doc = NULL;
    FILE *f = fopen(path, "rb");
    if (!f && errno != ENOENT)
        return cli_fail(-errno, "%s: %s", path, strerror(errno));
    if (f) {
        struct stat sb = {0};
        if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
            fclose(f);
            return cli_fail(-EISDIR, "%s: %s (a transcript is a JSON file)", path, strerror(EISDIR));
        }
        if (S_ISREG(sb.st_mode) && (uint64_t)sb.st_size > KVT_CHAT_MAX_FILE) {
            fclose(f);
            return cli_fail(KVT_ELIMIT, "%s: a transcript holds at most %zu bytes (64 MiB)", path,
                            KVT_CHAT_MAX_FILE);
        }
        char *buf = NULL;
        size_t n = 0;
        int err = read_bounded(f, S_ISREG(sb.st_mode) ? (size_t)sb.st_size : 0, KVT_CHAT_MAX_FILE, &buf, &n);
        fclose(f);
        if (err == ENOMEM)
            return cli_fail(KVT_ENOMEM, "%s: out of memory", path);
        int rc = 0;
        if (err)
            rc = cli_fail(-err, "%s: cannot read: %s", path, strerror(err));
        else if (n > KVT_CHAT_MAX_FILE)
            rc = cli_fail(KVT_ELIMIT, "%s: a transcript holds at most %zu bytes (64 MiB)", path,
                          KVT_CHAT_MAX_FILE);
        json_error_t jerr;
        if (!rc && !(*doc = json_loadb(buf, n, 0, &jerr)))
            rc = cli_fail(KVT_EFORMAT, "%s: line %d: %s", path, jerr.line, jerr.text);
        free(buf);
        if (!rc && !json_is_array(*doc))
            rc = cli_fail(KVT_EFORMAT, "%s: not a JSON array of turns", path);
        for (size_t i = 0; !rc && i < json_array_size(*doc); i++) {
            json_t *t = json_array_get(*doc, i);
            if (!json_is_string(json_object_get(t, "user")) || !json_is_string(json_object_get(t, "assistant")))
                rc = cli_fail(KVT_EFORMAT, "%s: turn %zu needs string fields \"user\" and \"assistant\"",
                              path, i + 1);
        }
        if (rc) {
            json_decref(*doc);
            *doc = NULL;
            return rc;
        }
    }
    /* The save writes a temporary file beside it and renames it into place:
     * try that now, so a missing or read-only directory is said before the
     * first turn rather than after it. */
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return cli_fail(KVT_ERANGE, "%s: path too long", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        int err = errno;
        json_decref(*doc);
        *doc = NULL;
        return cli_fail(-err, "%s: cannot be saved there: %s", path, strerror(err));
    }
    close(fd);
    unlink(tmp);
    return 0;
}

/* Resumes the conversation transcript_read returned (NULL: nothing to do). */
static int transcript_apply(kvt_chat *chat, json_t *doc)
{
    int rc = 0;
    for (size_t i = 0; !rc && i < json_array_size(doc); i++) {
        json_t *t = json_array_get(doc, i);
        rc = kvt_chat_add_turn(chat, json_string_value(json_object_get(t, "user")),
                               json_string_value(json_object_get(t, "assistant")));
    }
    return rc;
}

/* Saves the conversation to `path` atomically (temporary file, rename). */
static int transcript_save(const kvt_chat *chat, const char *path)
{
    json_t *doc = json_array();
    int rc = doc ? 0 : KVT_ENOMEM;
    for (int32_t i = 0; !rc && i < kvt_chat_turns(chat); i++) {
        const char *u = NULL, *r = NULL;
        kvt_chat_get_turn(chat, i, &u, &r);
        json_error_t jerr;
        json_t *t = json_pack_ex(&jerr, 0, "{s:s, s:s}", "user", u, "assistant", r);
        if (!t)
            rc = cli_fail(KVT_EINVAL, "%s: turn %d: %s", path, i + 1, jerr.text);
        else if (json_array_append_new(doc, t))
            rc = KVT_ENOMEM;
    }
    char tmp[4096];
    if (!rc && snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        rc = cli_fail(KVT_ERANGE, "%s: path too long", path);
    FILE *f = NULL;
    if (!rc && !(f = fopen(tmp, "w")))
        rc = cli_fail(-errno, "%s: cannot write: %s", tmp, strerror(errno));
    if (f) {
        errno = 0;
        int bad = json_dumpf(doc, f, JSON_INDENT(1)) != 0;
        bad |= fflush(f) != 0 || ferror(f);
        int err = errno ? errno : EIO;
        bad |= fclose(f) != 0;
        if (bad) {
            rc = cli_fail(-err, "%s: cannot write: %s", tmp, strerror(err));
            unlink(tmp);
        }
    }
    if (!rc && rename(tmp, path) != 0) {
        rc = cli_fail(-errno, "%s: cannot rename into place: %s", path, strerror(errno));
        unlink(tmp);
    }
    json_decref(doc);
    if (rc == KVT_ENOMEM)
        cli_fail(rc, "%s: out of memory", path);
    return rc;
}

/* Set by the first SIGINT/SIGTERM: the chat ends as at end of input (the
 * running turn finishes, the cache is written); a second one kills. */
static volatile sig_atomic_t stop_requested;

/* Also puts /dev/null under stdin (open, dup2 and close are
 * async-signal-safe): a signal that lands after the loop checked
 * stop_requested but before its read() blocks would otherwise leave the
 * chat waiting on stdin; now that read sees end of input. */
static void on_stop_signal(int sig)
{
    (void)sig;
    int saved = errno;
    stop_requested = 1;
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (fd != STDIN_FILENO) {
            dup2(fd, STDIN_FILENO);
            close(fd);
        }
    }
    errno = saved;
}

/* SA_RESETHAND: the next signal has its default effect; no SA_RESTART: a
 * read waiting on stdin returns EINTR so the loop sees the request. */
static void catch_stop_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* Reads one message line from stdin (kvt_chat_script_read_line: the limits
 * and messages of --script). @return 1 a line, 0 at EOF or on a stop
 * signal, or the reader's error. */
static int read_line(char **buf, size_t *cap, int64_t lineno)
{
    size_t used;
    int rc = kvt_chat_script_read_line(stdin, "stdin", lineno, buf, cap, &used);
    if (rc < 0 && stop_requested)
        return 0;
    return rc;
}

/* After a turn refused with KVT_ELIMIT: when its prompt alone (the whole
 * conversation and the new message) fills the model's context, says so with
 * the numbers, and whether the saved conversation can go on, and returns
 * KVT_CHAT_EXIT_CONTEXT_FULL; else 0 (another limit: the caller reports it). */
static int context_full(kvt_chat *chat, const kvt_model *m, int32_t turn, const char *transcript)
{
    int64_t n_prompt = 0, n_min = 0;
    kvt_chat_last_prompt(chat, &n_prompt);
    const int64_t L = kvt_model_get_config(m)->seq_len;
    if (n_prompt < L)
        return 0;
    fprintf(stderr, "kvtier chat: the context is full: turn %d's prompt (the conversation so far and this "
            "message) is %lld tokens; the model has %lld positions and a reply needs at least one left\n",
            turn, (long long)n_prompt, (long long)L);
    int32_t kept = kvt_chat_turns(chat);
    if (!transcript) {
        fprintf(stderr, "kvtier chat: the chat ends here; the %d turns before it stay in the cache\n", (int)kept);
        return KVT_CHAT_EXIT_CONTEXT_FULL;
    }
    fprintf(stderr, "kvtier chat: %s holds the %d turns before it, unchanged; ", transcript, (int)kept);
    if (kvt_chat_prompt_tokens(chat, "", &n_min) != 0)
        fprintf(stderr, "a run continuing it needs the conversation and a new message to fit in %lld positions\n",
                (long long)L);
    else if (n_min >= L)
        fprintf(stderr, "no run can continue it on this model: with an empty message the prompt alone is "
                "already %lld of %lld positions (there is no history truncation): start a new conversation "
                "(another --transcript)\n", (long long)n_min, (long long)L);
    else
        fprintf(stderr, "a run can continue it only with a shorter message: the conversation leaves %lld "
                "positions for a message and its reply (this message took %lld)\n", (long long)(L - n_min),
                (long long)(n_prompt - n_min));
    return KVT_CHAT_EXIT_CONTEXT_FULL;
}

/* Says each degradation of a level the first time it is seen. */
static void tiers_warn(kvt_tiers *tiers)
{
    kvt_tiers_warn(tiers, "kvtier chat", "--stats counts it", stderr);
}

/* --stats: the service report with one object per tier level added
 * ("ssd_cache" for the SSD tier; "published_cache" the first published
 * directory, "published_caches" every one in order) and, with --redis, the
 * remote tier's counters ("remote", as in serve's /stats). */
static void print_report(const char *report, const kvt_tiers_status *st, const kvt_remote_stats *rs)
{
    json_t *doc = json_loads(report, 0, NULL);
    char *rjs = NULL;
    if (doc && rs && kvt_remote_stats_json(rs, &rjs) == 0)
        json_object_set_new(doc, "remote", json_loads(rjs, 0, NULL));
    kvt_string_free(rjs);
    json_t *pubs = NULL; /* borrowed: doc holds it */
    for (int32_t i = 0; doc && st && i < st->n_levels; i++) {
        const kvt_level_status *l = &st->level[i];
        json_t *o = json_pack("{s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:I}", "dir", l->where, "mode",
                              kvt_level_mode_name(l->mode), "cause", l->cause, "open_failures",
                              (json_int_t)l->open_failures, "write_failures", (json_int_t)l->write_failures,
                              "writes_skipped", (json_int_t)l->writes_skipped, "entries", (json_int_t)l->entries,
                              "restores", (json_int_t)l->restores);
        if (!o)
            continue;
        /* the first level of a kind under its one-level key; every
         * published level (several --prompt-cache-dir) in order */
        char key[40];
        snprintf(key, sizeof key, "%s_cache", l->name);
        if (!json_object_get(doc, key))
            json_object_set(doc, key, o);
        if (!strcmp(l->name, "published")) {
            if (!pubs && (pubs = json_array()) != NULL)
                json_object_set_new(doc, "published_caches", pubs);
            if (pubs)
                json_array_append(pubs, o);
        }
        json_decref(o);
    }
    char *text = doc ? json_dumps(doc, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    fprintf(stderr, "%s\n", text ? text : report);
    free(text);
    json_decref(doc);
}

int kvt_cmd_chat(int argc, char **argv)
{
    const char *script = NULL, *session = "chat";
    const char *adapter = NULL, *adapter_version = NULL;
    uint64_t pc_bytes = 1ull << 30, kv_budget = 0;
    long long max_tokens = 64, ckpt_stride = -1; /* -1: not given */
    int multiline = 0, stats = 0, ssd_verify = 0;
    const char *ssd_dir = NULL, *transcript = NULL, *redis_url = NULL;
    int redis_cluster = 0;
    long long redis_timeout = 0, redis_ttl = 0, redis_restore = 0;
    uint64_t ssd_max = 0;
    long long demote_idle = 0;
    const char *pub_dirs[KVT_TIER_CHAIN_MAX];
    int n_pub = 0;
    /* greedy by default; the seed of sampled replies is a positive integer */
    kvt_cli_engine_flags ef = {.temperature = 0.0f, .top_p = 0.9f, .seed = 42, .seed_min = 1, .block_tokens = 256,
                               .kv_scheme = KVT_KV_F16};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        int er = kvt_cli_engine_arg("kvtier chat", argc, argv, &i, &ef);
        if (er == 2)
            return 2;
        if (er == 1)
            continue;
        if (!strcmp(a, "--multiline")) {
            multiline = 1;
            continue;
        }
        if (!strcmp(a, "--stats")) {
            stats = 1;
            continue;
        }
        if (!strcmp(a, "--ssd-cache-verify")) {
            ssd_verify = 1;
            continue;
        }
        if (!strcmp(a, "--redis-cluster")) {
            redis_cluster = 1;
            continue;
        }
        static const char *const with_value[] = {"--script", "--session", "--prompt-cache", "--kv-budget",
                                                 "--max-tokens", "--steps", "--adapter", "--adapter-version",
                                                 "--ssd-cache", "--ssd-cache-max", "--demote-idle", "--transcript",
                                                 "--prefill-checkpoint-stride", "--prompt-cache-dir", "--redis",
                                                 "--redis-timeout", "--redis-ttl", "--redis-restore-timeout", NULL};
        /* --flag value or --flag=value, as the shared flags */
        char flag[40];
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        int known = 0;
        if (nlen < sizeof flag) {
            memcpy(flag, a, nlen);
            flag[nlen] = '\0';
            for (int k = 0; with_value[k]; k++)
                known |= !strcmp(flag, with_value[k]);
        }
        if (!known)
            return usage_error("unknown flag", a);
        if (!eq && i + 1 >= argc)
            return usage_error("missing value after", a);
        const char *v = eq ? eq + 1 : argv[++i];
        a = flag;
        int rc = 0;
        if (!strcmp(a, "--script"))
            script = v;
        else if (!strcmp(a, "--session"))
            session = v;
        else if (!strcmp(a, "--adapter"))
            adapter = v;
        else if (!strcmp(a, "--adapter-version"))
            adapter_version = v;
        else if (!strcmp(a, "--ssd-cache"))
            ssd_dir = v;
        else if (!strcmp(a, "--transcript"))
            transcript = v;
        else if (!strcmp(a, "--redis"))
            redis_url = v;
        else if (!strcmp(a, "--redis-timeout"))
            rc = parse_i64(a, v, 1, 60000, &redis_timeout);
        else if (!strcmp(a, "--redis-restore-timeout"))
            rc = parse_i64(a, v, 1, 600000, &redis_restore);
        else if (!strcmp(a, "--redis-ttl"))
            rc = parse_i64(a, v, 1, LLONG_MAX / 1000, &redis_ttl);
        else if (!strcmp(a, "--prompt-cache-dir")) {
            if (!*v || n_pub == KVT_TIER_CHAIN_MAX - 1)
                return usage_error(*v ? "too many --prompt-cache-dir (at most 7)" : "--prompt-cache-dir wants a directory",
                                   NULL);
            pub_dirs[n_pub++] = v;
        }
        else if (!strcmp(a, "--demote-idle"))
            rc = parse_i64(a, v, 0, LLONG_MAX, &demote_idle);
        else if (!strcmp(a, "--prompt-cache") || !strcmp(a, "--kv-budget") || !strcmp(a, "--ssd-cache-max")) {
            uint64_t *dst = !strcmp(a, "--kv-budget") ? &kv_budget : !strcmp(a, "--ssd-cache-max") ? &ssd_max : &pc_bytes;
            if (kvt_chat_parse_bytes(a, v, dst)) {
                fprintf(stderr, "kvtier chat: %s\n", kvt_last_error());
                return 2;
            }
        } else if (!strcmp(a, "--max-tokens") || !strcmp(a, "--steps"))
            rc = parse_i64(a, v, 1, INT32_MAX, &max_tokens);
        else if (!strcmp(a, "--prefill-checkpoint-stride"))
            rc = parse_i64(a, v, 0, 1 << 20, &ckpt_stride);
        if (rc)
            return rc;
    }
    if (kvt_cli_engine_check("kvtier chat", &ef))
        return 2;
    char ns[512];
    if ((!adapter || !*adapter) && adapter_version)
        return usage_error("--adapter-version given without --adapter (it would run in the base model's "
                           "namespace)", NULL);
    if (kvt_service_ns(adapter, adapter_version, ns, sizeof ns)) {
        fprintf(stderr, "kvtier chat: %s\n", kvt_last_error());
        return 2;
    }
    if (!ssd_dir && (ssd_max || ssd_verify || demote_idle))
        return usage_error("--ssd-cache-max, --ssd-cache-verify and --demote-idle need --ssd-cache DIR", NULL);
    if (ssd_dir && pc_bytes == 0)
        return usage_error("--ssd-cache needs a prompt cache (--prompt-cache > 0) to tier under", NULL);
    if (n_pub && pc_bytes == 0)
        return usage_error("--prompt-cache-dir needs a prompt cache (--prompt-cache > 0) to tier under", NULL);
    if (!redis_url && (redis_cluster || redis_timeout || redis_ttl || redis_restore))
        return usage_error("--redis-cluster, --redis-timeout, --redis-restore-timeout and --redis-ttl need --redis URL",
                           NULL);
    if (redis_url && pc_bytes == 0)
        return usage_error("--redis needs a prompt cache (--prompt-cache > 0) to tier under", NULL);

    char **lines = NULL;
    int32_t n_lines = 0;
    int rc;
    if (script) {
        rc = kvt_chat_script_load(script, &lines, &n_lines);
        if (rc)
            return fail("cannot read the script", rc);
        if (n_lines == 0) {
            fprintf(stderr, "kvtier chat: the script %s holds no message (blank and '#' lines are skipped)\n",
                    script);
            return 1;
        }
    }
    json_t *saved = NULL;
    if (transcript && (rc = transcript_read(transcript, &saved))) {
        kvt_chat_script_free(lines, n_lines);
        return fail("cannot use the transcript", rc);
    }
    kvt_model *m = NULL;
    kvt_tokenizer *tok = NULL;
    kvt_service *svc = NULL;
    kvt_chat *chat = NULL;
    kvt_tiers *tiers = NULL;
    kvt_cold_tier tier;
    char *report = NULL;
    static char used_model[4096], used_tok[4096];
    char *line = NULL;
    size_t line_cap = 0;
    int64_t stdin_line = 0;
    int status = 1, too_big_said = 0;
    if (kvt_cli_engine_load("kvtier chat", &ef, &m, &tok, used_model, used_tok, sizeof used_model))
        goto done;
    if (ef.threads && (rc = kvt_model_set_threads(m, (int)ef.threads))) {
        status = fail("cannot start the engine threads", rc);
        goto done;
    }
    kvt_model_set_kv_scheme(m, ef.kv_scheme); /* before any cache (and the SSD identity) is made */
    kvt_chat_service_opts so = {.prompt_cache_bytes = pc_bytes, .kv_budget_bytes = kv_budget,
                                .block_tokens = (int32_t)ef.block_tokens, .demote_idle_ms = (uint64_t)demote_idle};
    kvt_chat_identity ident;
    if ((ssd_dir || n_pub || redis_url || stats) && (rc = kvt_chat_identity_compute(m, used_tok, &ident))) {
        status = fail("cannot hash the model", rc);
        goto done;
    }
    if (stats) {
        fprintf(stderr, "kvtier chat: identity: model %s (%.1f MB), tokenizer %s (%llu bytes): hashed in %.1f ms\n",
                ident.model_id, (double)ident.model_bytes / 1e6, ident.tokenizer_hash,
                (unsigned long long)ident.tokenizer_bytes, ident.ms);
        fflush(stderr);
    }
    kvt_tiers_opts to = {.ssd_dir = ssd_dir, .ssd_max_bytes = ssd_max, .ssd_verify = ssd_verify,
                         .prompt_cache_dirs = pub_dirs, .n_prompt_cache_dirs = n_pub, .redis_url = redis_url,
                         .redis_cluster = redis_cluster, .redis_timeout_ms = (int32_t)redis_timeout,
                         .redis_ttl_s = redis_ttl, .redis_restore_timeout_ms = (int32_t)redis_restore};
    if ((rc = kvt_tiers_open(m, ssd_dir || n_pub || redis_url ? &ident : NULL, &to, &tiers))) {
        status = fail("cannot open the SSD cache", rc);
        if (rc == KVT_EINVAL || rc == KVT_EUNSUPPORTED)
            status = 2; /* the flags, not the disk */
        goto done;
    }
    tiers_warn(tiers);
    if (kvt_tiers_cold_tier(tiers, &tier) == 0) {
        so.cold = &tier;
        so.chain = kvt_tiers_chain(tiers);
    }
    if ((rc = kvt_chat_service_create(m, &so, &svc))) {
        status = fail("cannot create the cache service", rc);
        goto done;
    }
    kvt_chat_opts co = {.max_tokens = max_tokens, .session = session, .ns = ns, .temperature = ef.temperature,
                        .topp = ef.top_p, .seed = (uint64_t)ef.seed, .multiline = multiline,
                        .prefill_checkpoint_stride = ckpt_stride < 0 ? ef.block_tokens : ckpt_stride == 0 ? -1 : ckpt_stride,
                        .live_cache_blocks = ef.live_blocks, .live_cache_bytes = ef.live_bytes, .live_cache_dir = ef.live_dir,
                        .live_cache_strict = ef.live_strict};
    if ((rc = kvt_chat_create(m, tok, svc, &co, &chat))) {
        status = fail("cannot start the chat", rc);
        goto done;
    }
    if ((rc = transcript_apply(chat, saved))) {
        status = fail("cannot resume the transcript", rc);
        goto done;
    }
    int32_t before = kvt_chat_turns(chat);
    int interactive = !script && isatty(STDIN_FILENO);
    catch_stop_signals();
    int interrupted = 0; /* a script stopped before its last message */
    for (int32_t turn = 1;; turn++) {
        const char *msg;
        if (stop_requested) {
            interrupted = script && turn <= n_lines;
            break;
        }
        if (script) {
            if (turn > n_lines)
                break;
            msg = lines[turn - 1];
        } else {
            if (interactive) {
                fputs("> ", stderr);
                fflush(stderr);
            }
            if ((rc = read_line(&line, &line_cap, ++stdin_line)) < 0) {
                status = fail("cannot read stdin", rc);
                goto done;
            }
            if (rc == 0)
                break;
            if (!line[0]) {
                turn--;
                continue;
            }
            msg = line;
        }
        json_t *text = transcript ? json_string(msg) : NULL;
        if (transcript && !text) { /* NULL for bytes that are not UTF-8 */
            cli_fail(KVT_EINVAL, "message %d is not valid UTF-8; a --transcript holds UTF-8 text", turn);
            status = fail("cannot run the turn", KVT_EINVAL);
            goto done;
        }
        json_decref(text);
        const char *reply = NULL;
        kvt_turn_stats st;
        if ((rc = kvt_chat_turn(chat, msg, &reply, NULL, NULL, &st))) {
            if (rc == KVT_ELIMIT && (status = context_full(chat, m, before + turn, transcript)))
                goto done;
            if (rc == KVT_ELIMIT && strstr(kvt_last_error(), "kv_budget_bytes")) /* the service's own name */
                cli_fail(rc, "%s (set by --kv-budget)", kvt_last_error());
            status = fail("turn failed", rc);
            goto done;
        }
        if ((rc = print_reply(reply))) {
            cli_fail(rc, "writing the reply to stdout failed: %s", strerror(-rc));
            status = fail("turn output lost", rc);
            goto done;
        }
        if (transcript && (rc = transcript_save(chat, transcript))) {
            status = fail("cannot save the transcript", rc);
            goto done;
        }
        fprintf(stderr, "turn %d: reused %lld tokens, prefilled %lld tokens, ttft %.1f ms\n", before + turn,
                (long long)st.reused_tokens, (long long)st.prefilled_tokens, st.ttft_ms);
        if (ef.live_blocks || ef.live_bytes)
            fprintf(stderr, "turn %d: live cache paged out %llu blocks, in %llu blocks (%.1f MB), stall %.1f ms, "
                    "by reference %llu blocks\n",
                    before + turn, (unsigned long long)st.paged_out_blocks, (unsigned long long)st.paged_in_blocks,
                    st.paged_in_bytes / 1e6, st.page_stall_ms, (unsigned long long)st.paged_ref_blocks);
        fflush(stderr);
        tiers_warn(tiers);
    }
    if (stats && kvt_service_stats_json(svc, &report) != 0)
        report = NULL;
    status = 0;
    if (interrupted) {
        fprintf(stderr, "kvtier chat: interrupted before the script's last message (the cache was kept)\n");
        status = 130;
    }
done:
    free(line);
    json_decref(saved);
    kvt_chat_free(chat);
    if (svc) {
        rc = kvt_service_close(svc);
        too_big_said = rc == KVT_ETOOBIG;
        if (rc == KVT_ETOOBIG)
            /* The user's --ssd-cache-max is smaller than a prefix: that
             * prefix cannot be kept on disk. Say so; the run itself is fine. */
            fprintf(stderr, "kvtier chat: warning: a prefix larger than --ssd-cache-max was not written "
                            "to the SSD cache (%s)\n", kvt_last_error());
        else if (rc && status == 0)
            status = fail("closing the cache service failed", rc);
        kvt_service_destroy(svc);
    }
    kvt_remote_stats rstats;
    kvt_remote *remote = report ? kvt_tiers_remote(tiers) : NULL;
    int have_remote = remote && kvt_remote_stats_get(remote, &rstats) == 0;
    kvt_tiers_status tst;
    rc = kvt_tiers_close(tiers, &tst);
    if (rc == KVT_ETOOBIG && !too_big_said)
        fprintf(stderr, "kvtier chat: warning: a prefix larger than --ssd-cache-max was not written "
                        "to the SSD cache\n");
    kvt_tiers_say(&tst, "kvtier chat", "--stats counts it", stderr);
    if (report)
        print_report(report, &tst, have_remote ? &rstats : NULL);
    kvt_string_free(report);
    kvt_tokenizer_free(tok);
    kvt_model_free(m);
    kvt_chat_script_free(lines, n_lines);
    return status;
}
