/*
 * chat.c: generation through the cache service and multi-turn chat on the
 * reference engine (chat.h). Owns the generation loop (admit, acquire,
 * prefill past the reused prefix, prompt-boundary snapshot, decode, publish,
 * release), the chat template, script parsing and a conversation's history.
 *
 * Must never: prefill a token the service already covers, take the
 * boundary snapshot at any other moment than "caches hold exactly the
 * prompt" (a wrapped ring cannot be rewound later, DESIGN.md 3.14), or
 * leave a request admitted after returning.
 */
#include "chat.h"

#include "../src/internal.h"

#include <ctype.h>
#include <errno.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    kvt_service_layer layers[KVT_MODEL_MAX_LAYERS];
    memset(layers, 0, sizeof layers);
    size_t per_token = 2 * (size_t)c->kv_dim * sizeof(float);
    for (int32_t l = 0; l < c->n_layers; l++) {
        switch (c->layer_kind[l]) {
        case KVT_LAYER_ATTN:
            layers[l] = (kvt_service_layer){.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = per_token,
                                            .block_tokens = B};
            break;
        case KVT_LAYER_WINDOW:
            layers[l] = (kvt_service_layer){.growth = KVT_GROWTH_WINDOW, .bytes_per_token = per_token,
                                            .window = c->sliding_window};
            break;
        case KVT_LAYER_RECURRENT:
            layers[l] = (kvt_service_layer){.growth = KVT_GROWTH_FIXED,
                                            .fixed_bytes = (size_t)c->dim * sizeof(float)};
            break;
        }
    }
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
        .demote_idle_ms = o->demote_idle_ms,
    };
    int rc = kvt_service_create(&cfg, out);
    if (rc)
        kvt__free(f);
    return rc;
}

/* ---- one generation ------------------------------------------------------------- */

static double ms_since(uint64_t t0) { return (double)(kvt_now_ns() - t0) / 1e6; }

/* Whether some layer, holding n tokens, could no longer be cut back to n - 1. */
static int point_range_at(const kvt_model_config *c, int64_t n)
{
    for (int32_t l = 0; l < c->n_layers; l++) {
        if (c->layer_kind[l] == KVT_LAYER_RECURRENT)
            return 1;
        if (c->layer_kind[l] == KVT_LAYER_WINDOW && n > c->sliding_window)
            return 1;
    }
    return 0;
}

/* Publishes a zero-copy clone of the live caches as the entry tokens[0..n).
 * A refused publish is not the generation's error: the state is not kept. */
static int publish_snapshot(kvt_service *svc, kvt_admission *adm, const kvt_state *live, const int32_t *tokens,
                            int64_t n)
{
    kvt_state snap;
    int rc = kvt_state_clone(live, &snap);
    if (!rc)
        rc = kvt_service_publish(svc, adm, tokens, n, &snap);
    kvt_state_dispose(&snap);
    return rc;
}

static int is_stop(const kvt_gen_opts *o, int32_t prev, int32_t tok)
{
    if (tok == KVT_TOKEN_EOS || tok == KVT_TOKEN_BOS)
        return 1;
    if (o->stop_tok) {
        const char *piece = kvt_tokenizer_decode(o->stop_tok, prev, tok);
        if (!piece || strchr(piece, '\n'))
            return 1;
    }
    return 0;
}

KVT_API int kvt_chat_generate(kvt_model *m, kvt_service *svc, kvt_sampler *sampler, const int32_t *prompt,
                              int64_t n_prompt, const kvt_gen_opts *o, int32_t *reply, int64_t reply_cap,
                              int64_t *n_reply, kvt_turn_stats *st)
{
    kvt_turn_stats s = {.prompt_tokens = n_prompt};
    if (st)
        *st = s;
    if (n_reply)
        *n_reply = 0;
    if (!m || !svc || !sampler || !prompt || !o || !reply || !n_reply)
        return kvt__fail(KVT_EINVAL, "chat: NULL model, service, sampler, prompt, options or reply");
    if (n_prompt < 1 || o->max_tokens < 1 || reply_cap < o->max_tokens)
        return kvt__fail(KVT_EINVAL, "chat: prompt %lld tokens (>= 1), max_tokens %lld (>= 1), reply "
                         "capacity %lld (>= max_tokens)", (long long)n_prompt, (long long)o->max_tokens,
                         (long long)reply_cap);
    const kvt_model_config *c = kvt_model_get_config(m);
    int64_t max_tokens = o->max_tokens;
    if (n_prompt < c->seq_len && max_tokens > c->seq_len - n_prompt)
        max_tokens = c->seq_len - n_prompt; /* the reply may use every position left */

    uint64_t t0 = kvt_now_ns();
    kvt_request req = {.prompt = prompt, .n_prompt = n_prompt, .max_tokens = max_tokens, .ns = o->ns,
                       .session = o->session};
    kvt_admission *adm = NULL;
    kvt_state state = {0};
    float *logits = NULL;
    int32_t *all = NULL;
    int rc = kvt_service_admit_wait(svc, &req, o->admit_timeout_ms, &adm);
    if (rc)
        return rc;
    rc = kvt_service_acquire(svc, adm, &state);
    if (rc)
        goto done;
    logits = kvt__malloc((size_t)c->vocab_size * sizeof *logits);
    all = kvt__malloc((size_t)(n_prompt + max_tokens) * sizeof *all);
    if (!logits || !all) {
        rc = kvt__fail(KVT_ENOMEM, "chat: out of memory");
        goto done;
    }
    memcpy(all, prompt, (size_t)n_prompt * sizeof *all);
    int64_t R = state.reused_tokens;
    s.reused_tokens = R;
    s.prefilled_tokens = n_prompt - R;
    int keeps = kvt_service_keeps(svc, adm);

    uint64_t tp = kvt_now_ns();
    if (keeps && n_prompt - 1 > R && point_range_at(c, n_prompt)) {
        /* The boundary entry will not serve an exact repeat (it cannot be cut
         * back to n - 1): keep the state of n - 1 tokens as well. */
        rc = kvt_model_prefill(m, state.caches, prompt + R, n_prompt - 1 - R, NULL);
        if (rc)
            goto done;
        double part = ms_since(tp);
        (void)publish_snapshot(svc, adm, &state, prompt, n_prompt - 1);
        tp = kvt_now_ns();
        rc = kvt_model_prefill(m, state.caches, prompt + n_prompt - 1, 1, logits);
        s.prefill_ms = part + ms_since(tp);
    } else {
        rc = kvt_model_prefill(m, state.caches, prompt + R, n_prompt - R, logits);
        s.prefill_ms = ms_since(tp);
    }
    if (rc)
        goto done;
    int32_t tok = kvt_sampler_sample(sampler, logits);
    s.ttft_ms = ms_since(t0);
    /* Prompt-boundary snapshot: the caches hold exactly the prompt now. */
    if (keeps)
        (void)publish_snapshot(svc, adm, &state, prompt, n_prompt);

    int64_t fed = 0, k = 0;
    int32_t prev = prompt[n_prompt - 1];
    for (;;) {
        if (is_stop(o, prev, tok))
            break;
        reply[k++] = tok;
        if (k >= max_tokens)
            break;
        rc = kvt_model_decode(m, state.caches, tok, logits);
        if (rc)
            goto done;
        all[n_prompt + fed++] = tok;
        prev = tok;
        tok = kvt_sampler_sample(sampler, logits);
    }
    *n_reply = k;
    s.generated_tokens = k;
    if (keeps && fed > 0) {
        if (kvt_service_publish(svc, adm, all, n_prompt + fed, &state) == 0)
            memset(&state, 0, sizeof state);
    }
done:
    kvt_state_dispose(&state);
    kvt_service_release(svc, adm, rc == 0);
    kvt__free(logits);
    kvt__free(all);
    s.total_ms = ms_since(t0);
    if (st)
        *st = s;
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

KVT_API int kvt_chat_script_load(const char *path, char ***lines, int32_t *n)
{
    if (!path)
        return kvt__fail(KVT_EINVAL, "chat script: NULL path");
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvt__fail(-errno, "%s: cannot open script: %s", path, strerror(errno));
    sbuf b = {0};
    char chunk[4096];
    size_t got;
    errno = 0;
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0)
        sb_add(&b, chunk, got);
    int err = ferror(f) ? (errno ? errno : EIO) : 0;
    fclose(f);
    if (err || b.oom) {
        free(b.p);
        return err ? kvt__fail(-err, "%s: cannot read script: %s", path, strerror(err))
                   : kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
    }
    if (b.p && strlen(b.p) != b.n) {
        free(b.p);
        return kvt__fail(KVT_EINVAL, "%s: script holds a NUL byte", path);
    }
    int rc = kvt_chat_script_parse(b.p ? b.p : "", lines, n);
    free(b.p);
    return rc;
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

/* Length of the valid UTF-8 sequence at p (1..4), or 0 if p does not start one. */
static size_t utf8_len(const unsigned char *p, size_t left)
{
    size_t n;
    if (p[0] < 0x80)
        return 1;
    else if (p[0] >= 0xC2 && p[0] <= 0xDF)
        n = 2;
    else if (p[0] >= 0xE0 && p[0] <= 0xEF)
        n = 3;
    else if (p[0] >= 0xF0 && p[0] <= 0xF4)
        n = 4;
    else
        return 0;
    if (left < n)
        return 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    if ((p[0] == 0xE0 && p[1] < 0xA0) || (p[0] == 0xED && p[1] > 0x9F) || (p[0] == 0xF0 && p[1] < 0x90) ||
        (p[0] == 0xF4 && p[1] > 0x8F))
        return 0; /* overlong, surrogate or past U+10FFFF */
    return n;
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
        size_t k = utf8_len((const unsigned char *)raw.p + i, raw.n - i);
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
    char *text = NULL;
    int rc = kvt_chat_render((const char *const *)c->user, (const char *const *)c->reply, c->n_turns + 1, &text);
    if (rc)
        goto fail;
    size_t cap = strlen(text) + 3;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) {
        rc = kvt__fail(KVT_ENOMEM, "chat turn: out of memory");
        goto fail;
    }
    free(c->prompt);
    c->prompt = ids;
    c->n_prompt = 0;
    rc = kvt_tokenizer_encode(c->tok, text, 1, 0, ids, (int64_t)cap, &c->n_prompt);
    if (rc)
        goto fail;
    kvt_gen_opts g = {.max_tokens = c->o.max_tokens, .ns = c->ns, .session = c->session,
                      .admit_timeout_ms = -1, .stop_tok = c->o.multiline ? NULL : c->tok};
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
    free(text);
    if (reply)
        *reply = r;
    if (reply_tokens)
        *reply_tokens = c->out;
    if (n_reply_tokens)
        *n_reply_tokens = c->n_out;
    return 0;
fail:
    free(text);
    free(u);
    c->user[c->n_turns] = NULL;
    return rc;
}

/* ---- helpers of the chat command and benchmark ----------------------------------------- */

KVT_API int kvt_chat_parse_bytes(const char *what, const char *text, uint64_t *out)
{
    if (!text || !out || !*text || !isdigit((unsigned char)*text))
        return kvt__fail(KVT_EINVAL, "%s: '%s' is not a byte count (e.g. 1073741824, 512M, 2G)",
                         what ? what : "bytes", text ? text : "(null)");
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno)
        return kvt__fail(KVT_EINVAL, "%s: '%s' is out of range", what, text);
    unsigned shift = 0;
    switch (toupper((unsigned char)*end)) {
    case 'K': shift = 10, end++; break;
    case 'M': shift = 20, end++; break;
    case 'G': shift = 30, end++; break;
    case 'T': shift = 40, end++; break;
    default: break;
    }
    if (shift && toupper((unsigned char)*end) == 'I')
        end++;
    if (toupper((unsigned char)*end) == 'B')
        end++;
    if (*end)
        return kvt__fail(KVT_EINVAL, "%s: '%s' is not a byte count (e.g. 1073741824, 512M, 2G)", what, text);
    if (shift && v > (UINT64_MAX >> shift))
        return kvt__fail(KVT_EINVAL, "%s: '%s' is out of range", what, text);
    *out = (uint64_t)v << shift;
    return 0;
}

KVT_API int kvt_chat_load_paths(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok,
                                char *model_out, char *tok_out, size_t cap)
{
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
        rc = kvt_default_model(def_model, sizeof def_model, def_tok, sizeof def_tok);
        if (rc)
            return rc;
        model_path = def_model;
        tok_path = def_tok;
    }
    if (model_out && tok_out) {
        if (strlen(model_path) >= cap || strlen(tok_path) >= cap)
            return kvt__fail(KVT_ERANGE, "chat load: path longer than %zu bytes", cap);
        strcpy(model_out, model_path);
        strcpy(tok_out, tok_path);
    }
    rc = kvt_model_load(model_path, m);
    if (rc)
        return rc;
    rc = kvt_tokenizer_load(tok_path, kvt_model_get_config(*m)->vocab_size, tok);
    if (rc) {
        kvt_model_free(*m);
        *m = NULL;
    }
    return rc;
}

KVT_API int kvt_chat_load(const char *model_path, const char *tok_path, kvt_model **m, kvt_tokenizer **tok)
{
    return kvt_chat_load_paths(model_path, tok_path, m, tok, NULL, NULL, 0);
}

/* SHA-256 (hex) of `path`: the whole file, or when `sample` its size and its
 * first and last 16 MiB. */
static int file_hash(const char *path, int sample, char hex[65])
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvt__fail(-errno, "%s: cannot open: %s", path, strerror(errno));
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char *buf = malloc(1 << 20);
    int rc = 0;
    if (!ctx || !buf || !EVP_DigestInit_ex(ctx, EVP_sha256(), NULL)) {
        rc = kvt__fail(KVT_ENOMEM, "%s: cannot hash: out of memory", path);
        goto done;
    }
    fseeko(f, 0, SEEK_END);
    off_t size = ftello(f);
    uint64_t sz = (uint64_t)size;
    EVP_DigestUpdate(ctx, &sz, sizeof sz);
    const off_t part = (off_t)16 << 20;
    off_t ranges[2][2] = {{0, size}, {0, 0}};
    if (sample && size > 2 * part) {
        ranges[0][1] = part;
        ranges[1][0] = size - part;
        ranges[1][1] = size;
    }
    for (int r = 0; r < 2 && !rc; r++) {
        if (fseeko(f, ranges[r][0], SEEK_SET)) {
            rc = kvt__fail(-errno, "%s: cannot seek", path);
            break;
        }
        for (off_t left = ranges[r][1] - ranges[r][0]; left > 0;) {
            size_t want = left < (1 << 20) ? (size_t)left : (1 << 20);
            size_t got = fread(buf, 1, want, f);
            if (got != want) {
                rc = kvt__fail(-EIO, "%s: short read while hashing", path);
                break;
            }
            EVP_DigestUpdate(ctx, buf, got);
            left -= (off_t)got;
        }
    }
    unsigned char md[32];
    unsigned len = 0;
    if (!rc && !EVP_DigestFinal_ex(ctx, md, &len))
        rc = kvt__fail(KVT_ENOMEM, "%s: cannot hash", path);
    for (unsigned i = 0; !rc && i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
done:
    free(buf);
    EVP_MD_CTX_free(ctx);
    fclose(f);
    return rc;
}

KVT_API int kvt_chat_store_open(const kvt_model *m, const char *model_path, const char *tok_path, const char *root,
                                uint64_t max_bytes, int verify, kvt_store **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "chat store: out is NULL");
    *out = NULL;
    if (!m || !model_path || !tok_path || !root)
        return kvt__fail(KVT_EINVAL, "chat store: model, paths and root are required");
    char model_hash[65], tok_hash[65], fp[KVT_STORE_FINGERPRINT_LEN];
    int rc = file_hash(model_path, 1, model_hash);
    if (!rc)
        rc = file_hash(tok_path, 0, tok_hash);
    if (rc)
        return rc;
    const kvt_model_config *c = kvt_model_get_config(m);
    kvt_cache *caches[KVT_MODEL_MAX_LAYERS] = {0};
    rc = kvt_model_new_caches(m, 256, caches);
    if (rc)
        return rc;
    rc = kvt_store_config_fingerprint(caches, c->n_layers, fp);
    kvt_caches_dispose(caches, c->n_layers);
    if (rc)
        return rc;
    kvt_store_identity id = {.model_id = model_hash, .config_fingerprint = fp, .tokenizer_hash = tok_hash};
    kvt_store_options so = {.max_bytes = max_bytes, .verify = verify};
    return kvt_store_open(root, &id, &so, out);
}
