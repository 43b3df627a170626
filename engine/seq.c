/*
 * seq.c: one generation through the cache service, step by step (seq.h).
 * Owns a sequence's life: admit, acquire, bounded prefill chunks past the
 * reused prefix with the snapshots due on the way, the sampled tokens and
 * the stop rule, decode (alone or by the caller's batch), the final
 * publish and the release.
 *
 * Must never: prefill a token the service already covers, take a snapshot
 * at any other moment than "the caches hold exactly those tokens" (a
 * wrapped ring cannot be rewound later, DESIGN.md 3.14), publish after an
 * engine error (the caches are partial), or leave a request admitted after
 * kvt_seq_finish.
 */
#include "seq.h"

#include "kvtier/residency.h"

#include "util.h"

#include <string.h>

enum seq_phase {
    SEQ_PREFILL, /* prompt tokens remain to be prefilled */
    SEQ_CHOSEN,  /* a token was sampled; kvt_seq_next takes it */
    SEQ_PENDING, /* the token joined the reply and waits to be fed */
    SEQ_DONE,    /* the generation ended */
    SEQ_FAILED   /* an engine step failed: the caches are partial */
};

struct kvt_seq {
    kvt_model *m;
    const kvt_model_config *c;
    kvt_service *svc;
    kvt_sampler *sampler;
    const kvt_tokenizer *stop_tok; /* borrowed, NULL = no newline stop */
    kvt_admission *adm;
    kvt_state state;               /* the live caches */
    kvt_residency *live;           /* bounded residency of the live caches, NULL = fully resident */
    int keeps;                     /* the service keeps what this request publishes */
    int64_t stride;                /* tokens between prefill checkpoints, 0 = none */
    enum seq_phase phase;
    int64_t n_prompt, max_tokens;  /* max_tokens clamped to the positions left */
    int64_t reused;                /* prompt tokens the service served */
    int64_t done;                  /* prompt tokens in the caches */
    int64_t fed;                   /* reply tokens in the caches */
    int64_t published;             /* length of the last state published, 0 none */
    int64_t ckpt_every;            /* replayable: generated tokens between checkpoints, 0 none */
    int64_t resumed;               /* reply tokens restored from a checkpoint */
    int32_t *all;                  /* (n_prompt + max_tokens) prompt, then the fed reply */
    int32_t *reply;                /* (max_tokens) reply tokens */
    int64_t n_reply;
    int32_t tok;                   /* CHOSEN: the sampled token; PENDING: the one to feed */
    int32_t prev;                  /* token before tok (stop rule) */
    float *logits;                 /* (vocab_size) */
    uint64_t t0;                   /* begin, ns */
    double ttft_ms, prefill_ms;
};

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

/* Under a bound, makes the kv caches of a state that goes to the service
 * resident (paged blocks read back): a published entry holds RAM the RAM
 * tier's budget charges, never a reference on the request's page file
 * (which then goes with the request). */
static int live_materialize(const kvt_seq *s, kvt_state *st)
{
    int rc = 0;
    for (int32_t l = 0; s->live && rc == 0 && l < st->n_layers; l++)
        rc = kvt_kv_make_resident(st->caches[l]);
    return rc;
}

/* Publishes a zero-copy clone of the live caches as the entry tokens[0..n)
 * (under a bound its paged blocks are read back into the clone).
 * A refused publish is not the generation's error: the state is not kept. */
static int publish_snapshot(kvt_seq *s, int64_t n)
{
    kvt_state snap; /* arrays from kvtier: publish (or dispose) frees them */
    int rc = kvt_state_clone(&s->state, &snap);
    if (!rc)
        rc = live_materialize(s, &snap);
    if (!rc)
        rc = kvt_service_publish(s->svc, s->adm, s->all, n, &snap);
    kvt_state_clear(&snap);
    s->published = n;
    return rc;
}

static int is_stop(const kvt_tokenizer *stop_tok, int32_t prev, int32_t tok)
{
    if (tok == KVT_TOKEN_EOS || tok == KVT_TOKEN_BOS)
        return 1;
    if (stop_tok) {
        const char *piece = kvt_tokenizer_decode(stop_tok, prev, tok);
        if (!piece || strchr(piece, '\n'))
            return 1;
    }
    return 0;
}

/* Tokens between prefill checkpoints for this prompt: 0 when every layer
 * holding the whole prompt can still be cut back (its entries serve every
 * shorter prefix, checkpoints would add nothing) or when `asked` < 0; the
 * kv block size when `asked` is 0. */
static int64_t checkpoint_stride(const kvt_seq *s, int64_t asked)
{
    if (asked < 0 || !point_range_at(s->c, s->n_prompt))
        return 0;
    if (asked > 0)
        return asked;
    for (int32_t l = 0; l < s->state.n_layers; l++) {
        int32_t b = kvt_kv_block_tokens(s->state.caches[l]);
        if (b > 0)
            return b;
    }
    return 256;
}

/* Detaches the live caches from their residency (they go on to the service
 * or are freed; blocks already paged stay readable). */
static void live_detach(kvt_seq *s)
{
    for (int32_t l = 0; s->live && l < s->state.n_layers; l++)
        if (s->state.caches && s->state.caches[l] &&
            (!strcmp(kvt_cache_kind(s->state.caches[l]), "kv") || !strcmp(kvt_cache_kind(s->state.caches[l]), "qkvc")))
            (void)kvt_kv_set_residency(s->state.caches[l], NULL, 0);
}

static void seq_free(kvt_seq *s)
{
    live_detach(s);
    kvt_residency_release(s->live);
    kvt_state_clear(&s->state);
    kvt__free(s->all);
    kvt__free(s->reply);
    kvt__free(s->logits);
    kvt__free(s);
}

KVT_API int kvt_seq_begin(kvt_model *m, kvt_service *svc, kvt_sampler *sampler, const int32_t *prompt,
                          int64_t n_prompt, const kvt_gen_opts *o, kvt_seq **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "chat: out is NULL");
    *out = NULL;
    if (!m || !svc || !sampler || !prompt || !o)
        return kvt__fail(KVT_EINVAL, "chat: NULL model, service, sampler, prompt or options");
    if (n_prompt < 1 || o->max_tokens < 1)
        return kvt__fail(KVT_EINVAL, "chat: prompt %lld tokens (>= 1), max_tokens %lld (>= 1)",
                         (long long)n_prompt, (long long)o->max_tokens);
    uint64_t t0 = kvt_now_ns();
    const kvt_model_config *c = kvt_model_get_config(m);
    int64_t max_tokens = o->max_tokens;
    if (n_prompt < c->seq_len && max_tokens > c->seq_len - n_prompt)
        max_tokens = c->seq_len - n_prompt; /* the reply may use every position left */
    kvt_seq *s = kvt__calloc(1, sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "chat: out of memory");
    *s = (kvt_seq){.m = m, .c = c, .svc = svc, .sampler = sampler, .stop_tok = o->stop_tok,
                   .n_prompt = n_prompt, .max_tokens = max_tokens, .tok = -1, .t0 = t0};
    kvt_request req = {.prompt = prompt, .n_prompt = n_prompt, .max_tokens = max_tokens, .ns = o->ns,
                       .session = o->session};
    int rc = 0;
    if (o->live_cache_blocks > 0 || o->live_cache_bytes > 0) {
        kvt_residency_options ro = {.max_blocks = o->live_cache_blocks, .max_bytes = o->live_cache_bytes,
                                    .dir = o->live_cache_dir, .write_slack = o->live_cache_strict ? -1 : 0};
        if ((rc = kvt_residency_create(&ro, &s->live)) != 0) {
            kvt__free(s);
            return rc;
        }
        /* admission charges the bound, not the whole context */
        req.live_blocks = o->live_cache_blocks;
        req.live_bytes = o->live_cache_bytes;
    }
    rc = kvt_service_admit_wait(svc, &req, o->admit_timeout_ms, &s->adm);
    if (rc) {
        kvt_residency_release(s->live);
        kvt__free(s);
        return rc;
    }
    s->logits = kvt__malloc((size_t)c->vocab_size * sizeof *s->logits);
    s->all = kvt__malloc((size_t)(n_prompt + max_tokens) * sizeof *s->all);
    s->reply = kvt__malloc((size_t)max_tokens * sizeof *s->reply);
    if (!s->logits || !s->all || !s->reply) {
        rc = kvt__fail(KVT_ENOMEM, "chat: out of memory");
        goto fail;
    }
    kvt_checkpoint_info ck = {0};
    if (o->request_id)
        rc = kvt_replay_acquire(svc, s->adm, sampler, c->vocab_size, o->request_id, o->seed_explicit, &s->state,
                                &ck, s->reply, max_tokens);
    else
        rc = kvt_service_acquire(svc, s->adm, &s->state);
    if (rc)
        goto fail;
    memcpy(s->all, prompt, (size_t)n_prompt * sizeof *s->all);
    /* under a bound, each kv layer's cache is attached in layer order (the
     * order attention reads them: read-ahead follows it) */
    if (s->live)
        rc = kvt_seq_live_attach(s->state.caches, s->state.n_layers, s->live);
    if (rc)
        goto fail;
    s->reused = s->done = s->state.reused_tokens;
    s->ckpt_every = o->request_id ? kvt_service_checkpoint_every(svc) : 0;
    if (ck.generated_tokens > 0) {
        /* resumed: the caches hold the prompt and the fed reply tokens; the
         * pending token is chosen again by nobody: kvt_seq_next takes it */
        int64_t fed = ck.generated_tokens - 1;
        memcpy(s->all + n_prompt, s->reply, (size_t)fed * sizeof *s->all);
        s->reused = s->done = n_prompt;
        s->fed = s->n_reply = s->resumed = fed;
        s->tok = ck.pending_token;
        s->prev = fed > 0 ? s->reply[fed - 1] : prompt[n_prompt - 1];
        s->phase = SEQ_CHOSEN;
        s->ttft_ms = ms_since(t0);
    }
    s->keeps = kvt_service_keeps(svc, s->adm);
    s->stride = s->keeps ? checkpoint_stride(s, o->prefill_checkpoint_stride) : 0;
    *out = s;
    return 0;
fail:
    kvt_service_release(svc, s->adm, 0);
    seq_free(s);
    return rc;
}

KVT_API int kvt_seq_live_attach(kvt_cache *const *caches, int32_t n_layers, kvt_residency *res)
{
    for (int32_t l = 0; l < n_layers; l++) {
        const char *kind = kvt_cache_kind(caches[l]);
        int rc = 0;
        if (!strcmp(kind, "kv") || !strcmp(kind, "qkvc")) /* qkvc: its sealed blocks are paged */
            rc = kvt_kv_set_residency(caches[l], res, l);
        else if (!strcmp(kind, "qkv"))
            rc = kvt__fail(KVT_EINVAL,
                           "live-cache bound: layer %d stores its KV in the qkv kind (int8 codes), which is never "
                           "paged; bound a kv or qkvc cache, or run this one fully resident", (int)l);
        if (rc)
            return rc;
    }
    return 0;
}

KVT_API int64_t kvt_seq_reused(const kvt_seq *s) { return s ? s->reused : 0; }

KVT_API int64_t kvt_seq_resumed(const kvt_seq *s) { return s ? s->resumed : 0; }

KVT_API int kvt_replay_acquire(kvt_service *svc, kvt_admission *adm, kvt_sampler *sampler, int32_t vocab_size,
                               const char *request_id, int seed_explicit, kvt_state *out,
                               kvt_checkpoint_info *info, int32_t *reply, int64_t reply_cap)
{
    if (!sampler)
        return kvt__fail(KVT_EINVAL, "replay: NULL sampler");
    kvt_replay rp = {.request_id = request_id, .seed = kvt_sampler_seed(sampler), .seed_explicit = seed_explicit,
                     .temperature = kvt_sampler_temperature(sampler), .topp = kvt_sampler_topp(sampler),
                     .vocab_size = vocab_size};
    int rc = kvt_service_resume(svc, adm, &rp, out, info, reply, reply_cap);
    if (rc || info->generated_tokens == 0)
        return rc;
    if (kvt_sampler_state_after(info->seed, info->rng_draws) != info->rng_state || info->rng_state == 0)
        rc = kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint's generator state %llu does not follow from its "
                       "seed %llu at RNG position %llu", request_id, (unsigned long long)info->rng_state,
                       (unsigned long long)info->seed, (unsigned long long)info->rng_draws);
    if (!rc)
        rc = kvt_sampler_restore(sampler, info->seed, info->rng_state, info->rng_draws);
    if (rc) {
        kvt_state_clear(out);
        memset(info, 0, sizeof *info);
    }
    return rc;
}

KVT_API int kvt_replay_checkpoint(kvt_service *svc, kvt_admission *adm, const kvt_sampler *sampler,
                                  kvt_cache *const *caches, const int32_t *tokens, int64_t n_prompt,
                                  int64_t generated, int32_t pending)
{
    kvt_checkpoint_info ck = {.prompt_tokens = n_prompt, .generated_tokens = generated, .pending_token = pending,
                              .seed = kvt_sampler_seed(sampler), .rng_state = kvt_sampler_rng_state(sampler),
                              .rng_draws = kvt_sampler_rng_draws(sampler),
                              .temperature = kvt_sampler_temperature(sampler), .topp = kvt_sampler_topp(sampler)};
    return kvt_service_checkpoint(svc, adm, caches, tokens, n_prompt + generated - 1, &ck);
}

/* Where the next prefill piece must end at the latest: the next length at
 * which a snapshot is due (a checkpoint boundary, n_prompt - 1), else the
 * end of the prompt. */
static int64_t next_stop(const kvt_seq *s)
{
    int64_t n = s->n_prompt;
    if (s->stride > 0) {
        int64_t b = (s->done / s->stride + 1) * s->stride;
        if (b < n - 1)
            return b;
    }
    /* The boundary entry will not serve an exact repeat (it cannot be cut
     * back to n - 1): keep the state of n - 1 tokens as well. */
    if (s->keeps && n - 1 > s->reused && s->done < n - 1 && point_range_at(s->c, n))
        return n - 1;
    return n;
}

/* Prompt tokens [done, done + n) are in the caches (and, when they end the
 * prompt, their logits in s->logits): publishes the snapshot due there, or
 * samples the first reply token and publishes the prompt-boundary snapshot. */
static void after_piece(kvt_seq *s, int64_t n, int64_t stop)
{
    int64_t end = s->done + n;
    s->done = end;
    if (end < s->n_prompt) {
        if (end == stop)
            (void)publish_snapshot(s, end);
        return;
    }
    s->tok = kvt_sampler_sample(s->sampler, s->logits);
    s->prev = s->all[s->n_prompt - 1];
    s->ttft_ms = ms_since(s->t0);
    /* Prompt-boundary snapshot: the caches hold exactly the prompt now. */
    if (s->keeps)
        (void)publish_snapshot(s, s->n_prompt);
    s->phase = SEQ_CHOSEN;
}

/* Runs prompt tokens [done, done + n) and publishes the snapshot due there. */
static int prefill_piece(kvt_seq *s, int64_t n, int64_t stop)
{
    int64_t end = s->done + n;
    uint64_t tp = kvt_now_ns();
    int rc = kvt_model_prefill(s->m, s->state.caches, s->all + s->done, n, end == s->n_prompt ? s->logits : NULL);
    s->prefill_ms += ms_since(tp);
    if (rc) {
        s->phase = SEQ_FAILED;
        return rc;
    }
    after_piece(s, n, stop);
    return 0;
}

KVT_API int64_t kvt_seq_prefill_next(const kvt_seq *s, int64_t max_tokens, const int32_t **tokens)
{
    if (tokens)
        *tokens = NULL;
    if (!s || !tokens || max_tokens < 1 || s->phase != SEQ_PREFILL)
        return 0;
    *tokens = s->all + s->done;
    int64_t n = KVT__MIN(next_stop(s) - s->done, max_tokens);
    return KVT__MIN(n, kvt_model_pass_rows(s->m, s->state.caches));
}

KVT_API int kvt_seq_after_prefill(kvt_seq *s, int64_t n, int *prompt_done)
{
    if (prompt_done)
        *prompt_done = 0;
    if (!s || !prompt_done)
        return kvt__fail(KVT_EINVAL, "chat after prefill: NULL sequence or prompt_done");
    if (s->phase != SEQ_PREFILL)
        return kvt__fail(KVT_EINVAL, "chat after prefill: %s", s->phase == SEQ_FAILED ? "the sequence failed earlier"
                                                                                      : "the prompt is done already");
    int64_t stop = next_stop(s);
    if (n < 1 || n > stop - s->done)
        return kvt__fail(KVT_EINVAL, "chat after prefill: %lld tokens; the next piece has 1 to %lld", (long long)n,
                         (long long)(stop - s->done));
    for (int32_t l = 0; l < s->state.n_layers; l++) {
        int64_t got = kvt_cache_offset(s->state.caches[l]);
        if (got != s->done + n)
            return kvt__fail(KVT_EINVAL, "chat after prefill: layer %d cache holds %lld tokens, %lld expected", l,
                             (long long)got, (long long)(s->done + n));
    }
    after_piece(s, n, stop);
    *prompt_done = s->phase != SEQ_PREFILL;
    return 0;
}

KVT_API void kvt_seq_fail(kvt_seq *s)
{
    if (s)
        s->phase = SEQ_FAILED;
}

KVT_API int kvt_seq_prefill(kvt_seq *s, int64_t max_tokens, int *prompt_done)
{
    if (prompt_done)
        *prompt_done = 0;
    if (!s || !prompt_done || max_tokens < 1)
        return kvt__fail(KVT_EINVAL, "chat prefill: NULL sequence or prompt_done, or max_tokens %lld < 1",
                         (long long)max_tokens);
    if (s->phase == SEQ_FAILED)
        return kvt__fail(KVT_EINVAL, "chat prefill: the sequence failed earlier; finish it");
    for (int64_t left = max_tokens; s->phase == SEQ_PREFILL && left > 0;) {
        int64_t stop = next_stop(s);
        int64_t n = KVT__MIN(stop - s->done, left);
        int rc = prefill_piece(s, n, stop);
        if (rc)
            return rc;
        left -= n;
    }
    *prompt_done = s->phase != SEQ_PREFILL;
    return 0;
}

KVT_API int kvt_seq_next(kvt_seq *s, int32_t *tok, int *finished)
{
    if (tok)
        *tok = -1;
    if (finished)
        *finished = 0;
    if (!s || !tok || !finished)
        return kvt__fail(KVT_EINVAL, "chat next: NULL sequence, tok or finished");
    switch (s->phase) {
    case SEQ_DONE:
        *finished = 1;
        return 0;
    case SEQ_CHOSEN:
        break;
    case SEQ_PREFILL:
        return kvt__fail(KVT_EINVAL, "chat next: the prompt is not prefilled yet");
    case SEQ_PENDING:
        return kvt__fail(KVT_EINVAL, "chat next: token %d is not fed yet (decode first)", (int)s->tok);
    default:
        return kvt__fail(KVT_EINVAL, "chat next: the sequence failed earlier; finish it");
    }
    if (is_stop(s->stop_tok, s->prev, s->tok)) {
        s->phase = SEQ_DONE;
        *finished = 1;
        return 0;
    }
    s->reply[s->n_reply++] = s->tok;
    *tok = s->tok;
    if (s->n_reply >= s->max_tokens) {
        s->phase = SEQ_DONE;
        *finished = 1;
    } else {
        s->phase = SEQ_PENDING;
        /* every ckpt_every reply tokens: the caches hold prompt + fed tokens,
         * the token is pending; a refused checkpoint is counted by the service */
        if (s->ckpt_every > 0 && s->n_reply % s->ckpt_every == 0 && s->n_reply > s->resumed + 1)
            (void)kvt_replay_checkpoint(s->svc, s->adm, s->sampler, s->state.caches, s->all, s->n_prompt,
                                        s->n_reply, s->tok);
    }
    return 0;
}

KVT_API kvt_cache **kvt_seq_caches(kvt_seq *s) { return s ? s->state.caches : NULL; }

KVT_API int64_t kvt_seq_cached(const kvt_seq *s) { return s ? s->done + s->fed : 0; }

KVT_API int32_t kvt_seq_pending_token(const kvt_seq *s) { return s && s->phase == SEQ_PENDING ? s->tok : -1; }

KVT_API float *kvt_seq_logits(kvt_seq *s) { return s ? s->logits : NULL; }

static int check_pending(const kvt_seq *s, const char *what)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "%s: NULL sequence", what);
    if (s->phase != SEQ_PENDING)
        return kvt__fail(KVT_EINVAL, "%s: no pending token (%s)", what,
                         s->phase == SEQ_FAILED ? "the sequence failed earlier" : "call kvt_seq_next first");
    return 0;
}

/* The pending token is in the caches and the logits hold its output. */
static void fed_and_sample(kvt_seq *s)
{
    s->all[s->n_prompt + s->fed++] = s->tok;
    s->prev = s->tok;
    s->tok = kvt_sampler_sample(s->sampler, s->logits);
    s->phase = SEQ_CHOSEN;
}

KVT_API int kvt_seq_decode(kvt_seq *s)
{
    int rc = check_pending(s, "chat decode");
    if (rc)
        return rc;
    rc = kvt_model_decode(s->m, s->state.caches, s->tok, s->logits);
    if (rc) {
        s->phase = SEQ_FAILED;
        return rc;
    }
    fed_and_sample(s);
    return 0;
}

KVT_API int kvt_seq_after_decode(kvt_seq *s)
{
    int rc = check_pending(s, "chat after decode");
    if (rc)
        return rc;
    int64_t want = s->done + s->fed + 1;
    for (int32_t l = 0; l < s->state.n_layers; l++) {
        int64_t got = kvt_cache_offset(s->state.caches[l]);
        if (got != want)
            return kvt__fail(KVT_EINVAL, "chat after decode: layer %d cache holds %lld tokens, %lld expected "
                             "(the pending token appended once)", l, (long long)got, (long long)want);
    }
    fed_and_sample(s);
    return 0;
}

KVT_API const int32_t *kvt_seq_reply(const kvt_seq *s, int64_t *n)
{
    if (n)
        *n = s ? s->n_reply : 0;
    return s ? s->reply : NULL;
}

KVT_API int kvt_seq_finish(kvt_seq *s, int completed, kvt_turn_stats *st)
{
    if (st)
        memset(st, 0, sizeof *st);
    if (!s)
        return 0;
    int failed = s->phase == SEQ_FAILED;
    int64_t n = s->done + s->fed;
    kvt_residency_stats rs = {0};
    if (s->live) {
        for (int32_t l = 0; l < s->state.n_layers; l++) /* the last writes complete: final counters */
            if (!strcmp(kvt_cache_kind(s->state.caches[l]), "kv"))
                (void)kvt_kv_residency_settle(s->state.caches[l]);
        if (kvt_residency_stats_get(s->live, &rs) == 0)
            kvt_service_count_residency(s->svc, &rs); /* the report's live_* counters */
        live_detach(s);
    }
    /* What the caches hold and no entry holds yet: prompt + fed reply, or
     * the prompt prefilled so far when cancelled during prefill. */
    if (!failed && s->keeps && n > s->reused && n != s->published) {
        if (live_materialize(s, &s->state) == 0 && kvt_service_publish(s->svc, s->adm, s->all, n, &s->state) == 0)
            memset(&s->state, 0, sizeof s->state);
    }
    kvt_service_release(s->svc, s->adm, completed && !failed);
    if (st) {
        st->prompt_tokens = s->n_prompt;
        st->reused_tokens = s->reused;
        st->prefilled_tokens = s->n_prompt - s->reused;
        st->generated_tokens = s->n_reply;
        st->resumed_tokens = s->resumed;
        st->ttft_ms = s->ttft_ms;
        st->prefill_ms = s->prefill_ms;
        st->total_ms = ms_since(s->t0);
        st->paged_out_blocks = rs.blocks_out;
        st->paged_out_bytes = rs.bytes_out;
        st->paged_in_blocks = rs.blocks_in;
        st->paged_in_bytes = rs.bytes_in;
        st->page_stall_ms = (double)rs.stall_ns / 1e6;
        st->live_peak_bytes = rs.peak_resident_bytes;
        st->page_write_failures = rs.write_failures;
        st->paged_ref_blocks = rs.blocks_ref;
        st->paged_ref_bytes = rs.bytes_ref;
    }
    seq_free(s);
    return 0;
}
