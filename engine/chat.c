/*
 * chat.c: generation through the cache service and multi-turn chat on the
 * reference engine (chat.h). Owns the one-call generation (a loop over the
 * steps of seq.c, which own admit, acquire, prefill, snapshots, decode,
 * publish and release), the chat template, bounded reading of scripts and
 * message lines, a conversation's history, the byte-size parser of every
 * command, the model identity of the SSD tier (XXH3-128 of every byte) and
 * the chat's SSD tier that degrades (read-only, then off) instead of
 * failing the chat.
 *
 * Must never leave a request admitted after returning, read an input past
 * its bound, or let a disk failure change a reply or the exit status.
 */
#include "chat.h"
#include "seq.h"

#include "model_internal.h"
#include "util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h> /* XXH3 on the widest vector unit the CPU has */
#else
#include <xxhash.h>
#endif

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* ---- the service of a model ------------------------------------------------- */

typedef struct {
    const kvt_model *m;
    int32_t block_tokens;
} fresh_ctx;

static int fresh_caches(void *ctx, kvt_cache **caches)
{
    const fresh_ctx *f = ctx;
    return kvt_model_new_caches(f->m, f->block_tokens, caches);
}

static void fresh_free(void *ctx) { kvt__free(ctx); }

KVT_API int kvt_chat_service_create(const kvt_model *m, const kvt_chat_service_opts *o, kvt_service **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "chat service: out is NULL");
    *out = NULL;
    if (!m || !o)
        return kvt__fail(KVT_EINVAL, "chat service: model and options are required");
    if (o->block_tokens < 0)
        return kvt__fail(KVT_EINVAL, "chat service: block_tokens %d < 0", o->block_tokens);
    const kvt_model_config *c = kvt_model_get_config(m);
    int32_t B = o->block_tokens ? o->block_tokens : 256;
    if (B > c->seq_len)
        B = c->seq_len; /* as kvt_model_new_caches: a longer block is never filled */
    /* each layer's growth read off an empty cache of it in the model's scheme:
     * the arithmetic kvt_service_layer_of does for every tier's records */
    kvt_service_layer layers[KVT_MODEL_MAX_LAYERS];
    memset(layers, 0, sizeof layers);
    kvt_cache *probe[KVT_MODEL_MAX_LAYERS];
    int rc = kvt_model_new_caches(m, B, probe);
    if (rc)
        return rc;
    for (int32_t l = 0; l < c->n_layers && !rc; l++)
        rc = kvt_service_layer_of(probe[l], &layers[l]);
    kvt_caches_destroy(probe, c->n_layers);
    if (rc)
        return rc;
    fresh_ctx *f = kvt__malloc(sizeof *f);
    if (!f)
        return kvt__fail(KVT_ENOMEM, "chat service: out of memory");
    f->m = m;
    f->block_tokens = B;
    kvt_service_config cfg = {
        .n_layers = c->n_layers,
        .layers = layers,
        .max_positions = c->seq_len,
        .new_caches = fresh_caches,
        .new_caches_ctx = f,
        .new_caches_ctx_free = fresh_free,
        .prompt_cache_bytes = o->prompt_cache_bytes,
        .kv_budget_bytes = o->kv_budget_bytes,
        .block_tokens = B,
        .cold = o->cold,
        .chain = o->cold ? o->chain : NULL,
        .demote_idle_ms = o->demote_idle_ms,
        .pool = o->pool,
        .pool_name = o->pool_name,
        .checkpoint_store = o->checkpoint_store,
        .checkpoint_every = o->checkpoint_every,
        .checkpoint_sync = o->checkpoint_sync,
    };
    rc = kvt_service_create(&cfg, out);
    if (rc)
        kvt__free(f);
    return rc;
}

/* ---- one generation ------------------------------------------------------------- */

KVT_API int kvt_chat_generate(kvt_model *m, kvt_service *svc, kvt_sampler *sampler, const int32_t *prompt,
                              int64_t n_prompt, const kvt_gen_opts *o, int32_t *reply, int64_t reply_cap,
                              int64_t *n_reply, kvt_turn_stats *st)
{
    if (st)
        *st = (kvt_turn_stats){.prompt_tokens = n_prompt};
    if (n_reply)
        *n_reply = 0;
    if (!m || !svc || !sampler || !prompt || !o || !reply || !n_reply)
        return kvt__fail(KVT_EINVAL, "chat: NULL model, service, sampler, prompt, options or reply");
    if (n_prompt < 1 || o->max_tokens < 1 || reply_cap < o->max_tokens)
        return kvt__fail(KVT_EINVAL, "chat: prompt %lld tokens (>= 1), max_tokens %lld (>= 1), reply "
                         "capacity %lld (>= max_tokens)", (long long)n_prompt, (long long)o->max_tokens,
                         (long long)reply_cap);
    kvt_seq *s = NULL;
    int rc = kvt_seq_begin(m, svc, sampler, prompt, n_prompt, o, &s);
    if (rc)
        return rc;
    int done = 0, finished = 0;
    while (!rc && !done)
        rc = kvt_seq_prefill(s, INT64_MAX, &done);
    while (!rc) {
        int32_t tok;
        rc = kvt_seq_next(s, &tok, &finished);
        if (rc || finished)
            break;
        rc = kvt_seq_decode(s);
    }
    if (!rc) {
        int64_t n = 0;
        const int32_t *r = kvt_seq_reply(s, &n);
        memcpy(reply, r, (size_t)n * sizeof *reply);
        *n_reply = n;
    }
    kvt_turn_stats fs;
    kvt_seq_finish(s, rc == 0, &fs);
    if (st)
        *st = fs;
    return rc;
}

/* ---- chat template and scripts ------------------------------------------------- */

typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

KVT_API int kvt_chat_render(const char *const *user, const char *const *reply, int32_t n_turns, char **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "chat render: out is NULL");
    *out = NULL;
    if (!user || n_turns < 1 || (n_turns > 1 && !reply))
        return kvt__fail(KVT_EINVAL, "chat render: %d turns (>= 1) with their messages", n_turns);
    sbuf b = {0};
    for (int32_t i = 0; i < n_turns; i++) {
        if (!user[i] || (i < n_turns - 1 && !reply[i])) {
            free(b.p);
            return kvt__fail(KVT_EINVAL, "chat render: turn %d has no message", i + 1);
        }
        sb_str(&b, "User: ");
        sb_str(&b, user[i]);
        sb_str(&b, "\nAssistant:");
        if (i < n_turns - 1) {
            sb_str(&b, reply[i]);
            sb_str(&b, "\n");
        }
    }
    if (b.oom) {
        free(b.p);
        return kvt__fail(KVT_ENOMEM, "chat render: out of memory");
    }
    *out = b.p;
    return 0;
}

KVT_API void kvt_chat_script_free(char **lines, int32_t n)
{
    if (!lines)
        return;
    for (int32_t i = 0; i < n; i++)
        free(lines[i]);
    free(lines);
}

KVT_API int kvt_chat_script_parse(const char *text, char ***lines, int32_t *n)
{
    if (!text || !lines || !n)
        return kvt__fail(KVT_EINVAL, "chat script: NULL argument");
    *lines = NULL;
    *n = 0;
    char **v = NULL;
    int32_t count = 0, cap = 0;
    const char *p = text;
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        size_t l = len;
        while (l > 0 && isspace((unsigned char)p[l - 1]))
            l--;
        if (l > 0 && p[0] != '#') {
            if (count == cap) {
                int32_t nc = cap ? cap * 2 : 16;
                char **nv = realloc(v, (size_t)nc * sizeof *nv);
                if (!nv)
                    goto oom;
                v = nv;
                cap = nc;
            }
            char *s = malloc(l + 1);
            if (!s)
                goto oom;
            memcpy(s, p, l);
            s[l] = '\0';
            v[count++] = s;
        }
        p += len + (e ? 1 : 0);
    }
    *lines = v;
    *n = count;
    return 0;
oom:
    kvt_chat_script_free(v, count);
    return kvt__fail(KVT_ENOMEM, "chat script: out of memory");
}

KVT_API int kvt_chat_script_read_line(FILE *f, const char *name, int64_t lineno, char **buf, size_t *cap,
                                      size_t *len)
{
    if (!f || !buf || !cap || !len)
        return kvt__fail(KVT_EINVAL, "read line: NULL argument");
    if (!name)
        name = "input";
    size_t n = 0, used = 0;
    int c;
    errno = 0;
    while ((c = getc_unlocked(f)) != EOF) {
        used++;
        if (c == '\n')
            break;
        if (c == '\0')
            return kvt__fail(KVT_EFORMAT, "%s: line %lld holds a NUL byte (a message is text)", name,
                             (long long)lineno);
        if (n >= KVT_CHAT_MAX_LINE)
            return kvt__fail(KVT_ELIMIT, "%s: line %lld is longer than the limit of %zu bytes (1 MiB) "
                             "for one message", name, (long long)lineno, KVT_CHAT_MAX_LINE);
        if (n + 1 >= *cap) {
            size_t nc = *cap ? *cap * 2 : 256;
            if (nc > KVT_CHAT_MAX_LINE + 1)
                nc = KVT_CHAT_MAX_LINE + 1;
            char *p = realloc(*buf, nc);
            if (!p)
                return kvt__fail(KVT_ENOMEM, "%s: line %lld: out of memory", name, (long long)lineno);
            *buf = p;
            *cap = nc;
        }
        (*buf)[n++] = (char)c;
    }
    if (c == EOF && ferror(f)) {
        int err = errno ? errno : EIO;
        return kvt__fail(-err, "%s: cannot read: %s", name, strerror(err));
    }
    if (!used)
        return 0;
    if (!*buf) {
        *buf = malloc(1);
        if (!*buf)
            return kvt__fail(KVT_ENOMEM, "%s: out of memory", name);
        *cap = 1;
    }
    while (n > 0 && isspace((unsigned char)(*buf)[n - 1]))
        n--;
    (*buf)[n] = '\0';
    *len = used;
    return 1;
}

KVT_API int kvt_chat_script_load(const char *path, char ***lines, int32_t *n)
{
    if (!path || !lines || !n)
        return kvt__fail(KVT_EINVAL, "chat script: NULL argument");
    *lines = NULL;
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvt__fail(-errno, "%s: cannot open script: %s", path, strerror(errno));
    char **v = NULL, *line = NULL;
    int32_t count = 0, cap = 0;
    size_t line_cap = 0, len = 0, total = 0;
    int rc;
    for (int64_t lineno = 1;; lineno++) {
        rc = kvt_chat_script_read_line(f, path, lineno, &line, &line_cap, &len);
        if (rc <= 0)
            break;
        total += len;
        if (total > KVT_CHAT_MAX_FILE) {
            rc = kvt__fail(KVT_ELIMIT, "%s: a script holds at most %zu bytes (64 MiB); refused at line %lld",
                           path, KVT_CHAT_MAX_FILE, (long long)lineno);
            break;
        }
        if (line[0] == '\0' || line[0] == '#')
            continue;
        if (count == INT32_MAX) {
            rc = kvt__fail(KVT_ELIMIT, "%s: too many messages", path);
            break;
        }
        if (count == cap) {
            int32_t nc = cap ? (cap > INT32_MAX / 2 ? INT32_MAX : cap * 2) : 16;
            char **nv = realloc(v, (size_t)nc * sizeof *nv);
            if (!nv) {
                rc = kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
                break;
            }
            v = nv;
            cap = nc;
        }
        if (!(v[count] = strdup(line))) {
            rc = kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
            break;
        }
        count++;
    }
    free(line);
    fclose(f);
    if (rc < 0) {
        kvt_chat_script_free(v, count);
        return rc;
    }
    *lines = v;
    *n = count;
    return 0;
}

/* ---- a conversation ---------------------------------------------------------------- */

struct kvt_chat {
    kvt_model *m;
    const kvt_tokenizer *tok;
    kvt_service *svc;
    kvt_sampler *sampler;
    kvt_chat_opts o;
    char *session, *ns;
    char **user, **reply;        /* (n_turns) each; reply[i] NULL while turn i runs */
    int32_t n_turns, cap;
    int32_t *prompt;             /* (n_prompt) last turn's prompt */
    int64_t n_prompt;
    int32_t *out;                /* (max_tokens) last reply's ids */
    int64_t n_out;
};

KVT_API int kvt_chat_create(kvt_model *m, const kvt_tokenizer *tok, kvt_service *svc, const kvt_chat_opts *o,
                            kvt_chat **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "chat: out is NULL");
    *out = NULL;
    if (!m || !tok || !svc || !o || o->max_tokens < 1)
        return kvt__fail(KVT_EINVAL, "chat: model, tokenizer, service and max_tokens >= 1 are required");
    int32_t V = kvt_model_get_config(m)->vocab_size;
    if (kvt_tokenizer_vocab_size(tok) != V)
        return kvt__fail(KVT_EINVAL, "chat: tokenizer has %d pieces, the model's vocab_size is %d",
                         kvt_tokenizer_vocab_size(tok), V);
    kvt_chat *c = calloc(1, sizeof *c);
    if (!c)
        return kvt__fail(KVT_ENOMEM, "chat: out of memory");
    c->m = m;
    c->tok = tok;
    c->svc = svc;
    c->o = *o;
    c->session = o->session ? strdup(o->session) : NULL;
    c->ns = o->ns ? strdup(o->ns) : NULL;
    c->out = malloc((size_t)o->max_tokens * sizeof *c->out);
    int rc = kvt_sampler_create(V, o->temperature, o->topp, o->seed ? o->seed : 42, &c->sampler);
    if (rc || !c->out || (o->session && !c->session) || (o->ns && !c->ns)) {
        if (!rc)
            rc = kvt__fail(KVT_ENOMEM, "chat: out of memory");
        kvt_chat_free(c);
        return rc;
    }
    *out = c;
    return 0;
}

KVT_API void kvt_chat_free(kvt_chat *c)
{
    if (!c)
        return;
    if (c->session && c->svc)
        kvt_service_close_session(c->svc, c->session);
    for (int32_t i = 0; i < c->n_turns; i++) {
        free(c->user[i]);
        free(c->reply[i]);
    }
    free(c->user);
    free(c->reply);
    free(c->prompt);
    free(c->out);
    free(c->session);
    free(c->ns);
    kvt_sampler_free(c->sampler);
    free(c);
}

KVT_API const int32_t *kvt_chat_last_prompt(const kvt_chat *c, int64_t *n)
{
    if (n)
        *n = c ? c->n_prompt : 0;
    return c ? c->prompt : NULL;
}


/* The reply as text, the way a chat server returns it: the llama2.c decode
 * of `ids` following token `prev`, as valid UTF-8 (each byte that does not
 * belong to a valid sequence becomes U+FFFD). The next turn re-sends this
 * text, so it is also what drift is made of. Caller frees with free(). */
static char *decode_text(const kvt_tokenizer *tok, int32_t prev, const int32_t *ids, int64_t n)
{
    sbuf raw = {0}, b = {0};
    sb_add(&raw, "", 0);
    sb_add(&b, "", 0);
    for (int64_t i = 0; i < n; i++) {
        const char *piece = kvt_tokenizer_decode(tok, prev, ids[i]);
        if (piece)
            sb_str(&raw, piece);
        prev = ids[i];
    }
    for (size_t i = 0; !raw.oom && i < raw.n;) {
        size_t k = kvt_utf8_len((const unsigned char *)raw.p + i, raw.n - i);
        if (k) {
            sb_add(&b, raw.p + i, k);
            i += k;
        } else {
            sb_str(&b, "\xEF\xBF\xBD");
            i++;
        }
    }
    int oom = raw.oom || b.oom;
    free(raw.p);
    if (oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

/* Room for one more turn in the history arrays. */
static int grow_turns(kvt_chat *c)
{
    if (c->n_turns < c->cap)
        return 0;
    int32_t nc = c->cap ? c->cap * 2 : 16;
    char **nu = realloc(c->user, (size_t)nc * sizeof *nu);
    if (!nu)
        return kvt__fail(KVT_ENOMEM, "chat: out of memory");
    c->user = nu;
    char **nr = realloc(c->reply, (size_t)nc * sizeof *nr);
    if (!nr)
        return kvt__fail(KVT_ENOMEM, "chat: out of memory");
    c->reply = nr;
    c->cap = nc;
    return 0;
}

KVT_API int kvt_chat_add_turn(kvt_chat *c, const char *user, const char *reply)
{
    if (!c || !user || !reply)
        return kvt__fail(KVT_EINVAL, "chat: NULL chat, message or reply");
    int rc = grow_turns(c);
    if (rc)
        return rc;
    char *u = strdup(user), *r = strdup(reply);
    if (!u || !r) {
        free(u);
        free(r);
        return kvt__fail(KVT_ENOMEM, "chat: out of memory");
    }
    c->user[c->n_turns] = u;
    c->reply[c->n_turns++] = r;
    return 0;
}

KVT_API int32_t kvt_chat_turns(const kvt_chat *c) { return c ? c->n_turns : 0; }

KVT_API int kvt_chat_get_turn(const kvt_chat *c, int32_t i, const char **user, const char **reply)
{
    if (!c || i < 0 || i >= c->n_turns)
        return kvt__fail(KVT_ERANGE, "chat: no turn %d (the conversation has %d)", i, c ? c->n_turns : 0);
    if (user)
        *user = c->user[i];
    if (reply)
        *reply = c->reply[i];
    return 0;
}

/* Renders the conversation so far with the next message `user` (which the
 * caller has put at c->user[c->n_turns]) and encodes it with BOS into *ids
 * (malloc; caller frees) and *n. */
static int encode_next(const kvt_chat *c, int32_t **ids_out, int64_t *n)
{
    char *text = NULL;
    *ids_out = NULL;
    *n = 0;
    int rc = kvt_chat_render((const char *const *)c->user, (const char *const *)c->reply, c->n_turns + 1, &text);
    if (rc)
        return rc;
    size_t cap = strlen(text) + 3;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) {
        free(text);
        return kvt__fail(KVT_ENOMEM, "chat turn: out of memory");
    }
    rc = kvt_tokenizer_encode(c->tok, text, 1, 0, ids, (int64_t)cap, n);
    free(text);
    if (rc) {
        free(ids);
        return rc;
    }
    *ids_out = ids;
    return 0;
}

KVT_API int kvt_chat_prompt_tokens(kvt_chat *c, const char *user, int64_t *n)
{
    if (!c || !user || !n)
        return kvt__fail(KVT_EINVAL, "chat prompt tokens: NULL chat, message or n");
    kvt_chat *w = c; /* the message sits in the free slot for the render only */
    int rc = grow_turns(w);
    if (rc)
        return rc;
    w->user[w->n_turns] = (char *)user;
    w->reply[w->n_turns] = NULL;
    int32_t *ids = NULL;
    rc = encode_next(w, &ids, n);
    w->user[w->n_turns] = NULL;
    free(ids);
    return rc;
}

KVT_API int kvt_chat_turn(kvt_chat *c, const char *user, const char **reply, const int32_t **reply_tokens,
                          int64_t *n_reply_tokens, kvt_turn_stats *st)
{
    if (reply)
        *reply = NULL;
    if (!c || !user)
        return kvt__fail(KVT_EINVAL, "chat turn: NULL chat or message");
    int grc = grow_turns(c);
    if (grc)
        return grc;
    char *u = strdup(user);
    if (!u)
        return kvt__fail(KVT_ENOMEM, "chat turn: out of memory");
    c->user[c->n_turns] = u;
    c->reply[c->n_turns] = NULL;
    free(c->prompt);
    c->prompt = NULL;
    c->n_prompt = 0;
    int rc = encode_next(c, &c->prompt, &c->n_prompt);
    if (rc)
        goto fail;
    kvt_gen_opts g = {.max_tokens = c->o.max_tokens, .ns = c->ns, .session = c->session,
                      .admit_timeout_ms = -1, .stop_tok = c->o.multiline ? NULL : c->tok,
                      .prefill_checkpoint_stride = c->o.prefill_checkpoint_stride,
                      .live_cache_blocks = c->o.live_cache_blocks, .live_cache_bytes = c->o.live_cache_bytes,
                      .live_cache_dir = c->o.live_cache_dir,
                      .live_cache_strict = c->o.live_cache_strict};
    rc = kvt_chat_generate(c->m, c->svc, c->sampler, c->prompt, c->n_prompt, &g, c->out, c->o.max_tokens,
                           &c->n_out, st);
    if (rc)
        goto fail;
    char *r = decode_text(c->tok, c->prompt[c->n_prompt - 1], c->out, c->n_out);
    if (!r) {
        rc = kvt__fail(KVT_ENOMEM, "chat turn: out of memory");
        goto fail;
    }
    c->reply[c->n_turns++] = r;
    if (reply)
        *reply = r;
    if (reply_tokens)
        *reply_tokens = c->out;
    if (n_reply_tokens)
        *n_reply_tokens = c->n_out;
    return 0;
fail:
    free(u);
    c->user[c->n_turns] = NULL;
    return rc;
}

/* ---- helpers of the chat command and benchmark ----------------------------------------- */

/* The byte-count grammar of every kvtier command: DIGITS[.DIGITS][K|M|G|T[i]][B]
 * (suffixes any case, powers of 1024), rounded down to whole bytes.
 * @return 0 and *out, or -1 (not that grammar, or 2^64 bytes or more). */
static int bytes_grammar(const char *s, uint64_t *out)
{
    const char *p = s;
    uint64_t whole = 0;
    if (!isdigit((unsigned char)*p))
        return -1;
    for (; isdigit((unsigned char)*p); p++) {
        uint64_t d = (uint64_t)(*p - '0');
        if (whole > (UINT64_MAX - d) / 10)
            return -1;
        whole = whole * 10 + d;
    }
    const char *frac = NULL;
    size_t n_frac = 0;
    if (*p == '.') {
        frac = ++p;
        for (; isdigit((unsigned char)*p); p++)
            n_frac++;
        if (n_frac == 0)
            return -1; /* "1." or "1.G" */
    }
    unsigned shift = 0;
    switch (toupper((unsigned char)*p)) {
    case 'K': shift = 10, p++; break;
    case 'M': shift = 20, p++; break;
    case 'G': shift = 30, p++; break;
    case 'T': shift = 40, p++; break;
    default: break;
    }
    if (shift && toupper((unsigned char)*p) == 'I')
        p++;
    if (toupper((unsigned char)*p) == 'B')
        p++;
    if (*p)
        return -1;
    if (whole > (UINT64_MAX >> shift))
        return -1;
    uint64_t v = whole << shift;
    /* the fraction 0.d1d2... times 2^shift, rounded down, by long division
     * (18 digits count: the 19th cannot add a whole byte below 2^60) */
    uint64_t rem = 0, den = 1, f = 0;
    for (size_t i = 0; i < n_frac && i < 18; i++) {
        rem = rem * 10 + (uint64_t)(frac[i] - '0');
        den *= 10;
    }
    for (unsigned i = 0; i < shift; i++) {
        rem *= 2;
        f = f * 2 + (rem >= den);
        if (rem >= den)
            rem -= den;
    }
    if (f > UINT64_MAX - v)
        return -1;
    v += f;
    *out = v;
    return 0;
}

KVT_API int kvt_chat_parse_bytes(const char *what, const char *text, uint64_t *out)
{
    if (!text || !out || bytes_grammar(text, out))
        return kvt__fail(KVT_EINVAL, "%s: '%s' is not a byte count (" KVT_CHAT_BYTES_FORMS ")",
                         what ? what : "bytes", text ? text : "(null)");
    return 0;
}

KVT_API int kvt_chat_load_from(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok,
                               char *model_out, char *tok_out, size_t cap, kvt_chat_load_part *failed)
{
    kvt_chat_load_part part_ = KVT_CHAT_LOAD_ARGS, *part = failed ? failed : &part_;
    *part = KVT_CHAT_LOAD_ARGS;
    if (!m || !tok)
        return kvt__fail(KVT_EINVAL, "chat load: NULL output");
    *m = NULL;
    *tok = NULL;
    if ((model_path != NULL) != (tok_path != NULL))
        return kvt__fail(KVT_EINVAL, "%s given without %s (give both, or neither for the default model)",
                         model_path ? "--model" : "--tokenizer", model_path ? "--tokenizer" : "--model");
    char def_model[4096], def_tok[4096];
    int rc;
    if (!model_path) {
        *part = KVT_CHAT_LOAD_DEFAULT_MODEL;
        rc = kvt_default_model(def_model, sizeof def_model, def_tok, sizeof def_tok);
        if (rc)
            return rc;
        model_path = def_model;
        tok_path = def_tok;
    }
    if (model_out && tok_out) {
        *part = KVT_CHAT_LOAD_ARGS;
        if (strlen(model_path) >= cap || strlen(tok_path) >= cap)
            return kvt__fail(KVT_ERANGE, "chat load: path longer than %zu bytes", cap);
        strcpy(model_out, model_path);
        strcpy(tok_out, tok_path);
    }
    *part = KVT_CHAT_LOAD_MODEL;
    rc = kvt_model_load(model_path, m);
    if (rc)
        return rc;
    *part = KVT_CHAT_LOAD_TOKENIZER;
    rc = kvt_tokenizer_load(tok_path, kvt_model_get_config(*m)->vocab_size, tok);
    if (rc) {
        kvt_model_free(*m);
        *m = NULL;
        return rc;
    }
    *part = KVT_CHAT_LOAD_OK;
    return 0;
}

KVT_API int kvt_chat_load_paths(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok,
                                char *model_out, char *tok_out, size_t cap)
{
    return kvt_chat_load_from(model_path, tok_path, m, tok, model_out, tok_out, cap, NULL);
}

KVT_API int kvt_chat_load(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok)
{
    return kvt_chat_load_paths(model_path, tok_path, m, tok, NULL, NULL, 0);
}

/* "xxh3-128:" and the 32 hex digits of h (canonical, big-endian). */
static void hash_hex(XXH128_hash_t h, char out[48])
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    int n = snprintf(out, 48, "xxh3-128:");
    for (int i = 0; i < 16; i++)
        n += snprintf(out + n, (size_t)(48 - n), "%02x", c.digest[i]);
}

/* XXH3-128 of the whole file at `path`, read in 1 MiB pieces. */
static int file_hash(const char *path, XXH128_hash_t *out, uint64_t *bytes)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvt__fail(-errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) || !S_ISREG(sb.st_mode)) { /* a FIFO or a device may never end */
        fclose(f);
        return kvt__fail(KVT_EINVAL, "%s: not a regular file: its identity cannot be hashed", path);
    }
    XXH3_state_t *st = XXH3_createState();
    unsigned char *buf = malloc(1 << 20);
    int rc = 0;
    if (!st || !buf || XXH3_128bits_reset(st) != XXH_OK) {
        rc = kvt__fail(KVT_ENOMEM, "%s: cannot hash: out of memory", path);
        goto done;
    }
    uint64_t total = 0;
    size_t got;
    errno = 0;
    while ((got = fread(buf, 1, 1 << 20, f)) > 0) {
        XXH3_128bits_update(st, buf, got);
        total += got;
    }
    if (ferror(f)) {
        int err = errno ? errno : EIO;
        rc = kvt__fail(-err, "%s: cannot read while hashing: %s", path, strerror(err));
        goto done;
    }
    *out = XXH3_128bits_digest(st);
    *bytes = total;
done:
    free(buf);
    XXH3_freeState(st);
    fclose(f);
    return rc;
}

KVT_API int kvt_chat_identity_compute(const kvt_model *m, const char *tok_path, kvt_chat_identity *out)
{
    if (!m || !out)
        return kvt__fail(KVT_EINVAL, "chat identity: NULL model or out");
    memset(out, 0, sizeof *out);
    uint64_t t0 = kvt_now_ns();
    /* the mapping holds every byte of the checkpoint: no second read */
    hash_hex(XXH3_128bits(m->map, m->map_bytes), out->model_id);
    out->model_bytes = m->map_bytes;
    if (tok_path) {
        XXH128_hash_t h;
        int rc = file_hash(tok_path, &h, &out->tokenizer_bytes);
        if (rc)
            return rc;
        hash_hex(h, out->tokenizer_hash);
    }
    out->ms = (double)(kvt_now_ns() - t0) / 1e6;
    return 0;
}
