/*
 * generate.c: the llama2.c generate loop over the reference engine (prompt as
 * one batched prefill, then one decode per token). It owns only the state of
 * one call: the prompt ids, the per-layer caches and the logits buffer, all
 * freed before it returns. It must never print anything but the decoded
 * pieces and the final "\n" (timing goes to the caller through stats), and
 * never change which positions run or what is printed relative to llama2.c.
 */
#include "generate.h"

#include "seq.h"
#include "util.h"

#include <errno.h>
#include <string.h>

static int emit(FILE *out, const char *piece)
{
    const char *s = kvt_tokenizer_printable(piece);
    if (s[0] != '\0' && fputs(s, out) == EOF)
        return kvt__fail(-EIO, "generate: writing the output failed");
    if (fflush(out) != 0)
        return kvt__fail(-EIO, "generate: flushing the output failed");
    return 0;
}

static void finish_stats(kvt_generate_stats *st)
{
    st->prefill_tok_s = st->prefill_ms > 0 ? (double)st->prefill_tokens / (st->prefill_ms / 1000.0) : 0.0;
    st->decode_tok_s = st->decode_ms > 0 ? (double)st->decode_tokens / (st->decode_ms / 1000.0) : 0.0;
}

int kvt_generate(kvt_model *m, const kvt_tokenizer *tok, kvt_sampler *sampler, const char *prompt,
                 int64_t steps, int32_t block_tokens, FILE *out, kvt_generate_stats *stats)
{
    return kvt_generate_ex(m, tok, sampler, prompt, steps, block_tokens, NULL, out, stats);
}

/* Prints the pieces of the restored reply tokens (prev: the token before the first). */
static int emit_reply(FILE *out, const kvt_tokenizer *tok, int32_t prev, const int32_t *reply, int64_t n)
{
    for (int64_t k = 0; k < n; k++) {
        int rc = emit(out, kvt_tokenizer_decode(tok, prev, reply[k]));
        if (rc)
            return rc;
        prev = reply[k];
    }
    return 0;
}

int kvt_generate_ex(kvt_model *m, const kvt_tokenizer *tok, kvt_sampler *sampler, const char *prompt,
                    int64_t steps, int32_t block_tokens, const kvt_generate_replay *rp, FILE *out,
                    kvt_generate_stats *stats)
{
    return kvt_generate_live(m, tok, sampler, prompt, steps, block_tokens, rp, NULL, out, stats);
}

int kvt_generate_live(kvt_model *m, const kvt_tokenizer *tok, kvt_sampler *sampler, const char *prompt,
                      int64_t steps, int32_t block_tokens, const kvt_generate_replay *rp,
                      const kvt_residency_options *live, FILE *out, kvt_generate_stats *stats)
{
    kvt_generate_stats st;
    memset(&st, 0, sizeof st);
    if (stats)
        *stats = st;
    if (!m || !tok || !sampler || !out)
        return kvt__fail(KVT_EINVAL, "kvt_generate: NULL %s",
                         !m ? "model" : !tok ? "tokenizer" : !sampler ? "sampler" : "out");
    if (rp && (!rp->svc || !rp->request_id))
        return kvt__fail(KVT_EINVAL, "generate: a replayable run needs a service and a request id");
    if (steps < 0)
        return kvt__fail(KVT_EINVAL, "generate: steps %lld is negative", (long long)steps);
    const kvt_model_config *cfg = kvt_model_get_config(m);
    if (kvt_tokenizer_vocab_size(tok) != cfg->vocab_size)
        return kvt__fail(KVT_EINVAL, "generate: tokenizer has %d pieces, model vocab_size is %d",
                         (int)kvt_tokenizer_vocab_size(tok), (int)cfg->vocab_size);
    if (kvt_sampler_vocab_size(sampler) != cfg->vocab_size)
        return kvt__fail(KVT_EINVAL, "generate: sampler is for %d tokens, model vocab_size is %d",
                         (int)kvt_sampler_vocab_size(sampler), (int)cfg->vocab_size);
    if (steps == 0 || steps > cfg->seq_len)
        steps = cfg->seq_len;
    st.steps = steps;

    const char *text = prompt ? prompt : "";
    int64_t cap = (int64_t)strlen(text) + 3;
    int32_t *toks = kvt__malloc((size_t)cap * sizeof *toks);
    kvt_cache **caches = kvt__calloc((size_t)cfg->n_layers, sizeof *caches);
    float *logits = kvt__malloc((size_t)cfg->vocab_size * sizeof *logits);
    int32_t *all = NULL; /* replayable: (n_prompt + max_tokens) prompt, then the reply */
    kvt_admission *adm = NULL;
    kvt_state state = {0};
    kvt_residency *res = NULL;
    int rc = 0, have_caches = 0, completed = 0;
    if (!toks || !caches || !logits) {
        rc = kvt__fail(KVT_ENOMEM, "generate: no memory for a %lld-token prompt", (long long)cap);
        goto done;
    }
    int64_t n_prompt = 0;
    if ((rc = kvt_tokenizer_encode(tok, text, 1, 0, toks, cap, &n_prompt)))
        goto done;
    st.prompt_tokens = n_prompt;

    /* Positions 0..n_prompt-2 force the next prompt token (llama2.c). */
    int64_t forced = KVT__MIN(n_prompt - 1, steps);
    for (int64_t pos = 0; pos < forced; pos++) {
        if (toks[pos + 1] == KVT_TOKEN_BOS)
            goto newline; /* llama2.c stops at a BOS, even a forced one */
        if ((rc = emit(out, kvt_tokenizer_decode(tok, toks[pos], toks[pos + 1]))))
            goto done;
    }
    if (steps < n_prompt)
        goto newline; /* the run ends before the first sample: nothing to compute */

    int32_t token = toks[n_prompt - 1];
    int64_t pos0 = n_prompt - 1; /* the position whose logits come first */
    int64_t generated = 0;       /* reply tokens chosen (and printed) so far */
    int64_t every = 0;
    uint64_t t1 = 0;
    if (rp) {
        /* every position from n_prompt - 1 on samples one reply token; the
         * last one is never fed, so the caches hold at most `steps` tokens */
        int64_t max_tokens = steps - n_prompt + 1;
        kvt_request req = {.prompt = toks, .n_prompt = n_prompt, .max_tokens = max_tokens - 1};
        if (live && (live->max_blocks > 0 || live->max_bytes > 0)) {
            /* admission charges the bound, not the whole context */
            req.live_blocks = live->max_blocks;
            req.live_bytes = live->max_bytes;
            if ((rc = kvt_residency_create(live, &res)))
                goto done;
        }
        all = kvt__malloc((size_t)(n_prompt + max_tokens) * sizeof *all);
        if (!all) {
            rc = kvt__fail(KVT_ENOMEM, "generate: no memory for %lld tokens", (long long)(n_prompt + max_tokens));
            goto done;
        }
        memcpy(all, toks, (size_t)n_prompt * sizeof *all);
        if ((rc = kvt_service_admit(rp->svc, &req, &adm)))
            goto done;
        kvt_checkpoint_info ck;
        if ((rc = kvt_replay_acquire(rp->svc, adm, sampler, cfg->vocab_size, rp->request_id, rp->seed_explicit,
                                     &state, &ck, all + n_prompt, max_tokens)))
            goto done;
        if (state.n_layers != cfg->n_layers) {
            rc = kvt__fail(KVT_EINVAL, "generate: the service gave %d layers, the model has %d",
                           (int)state.n_layers, (int)cfg->n_layers);
            goto done;
        }
        memcpy(caches, state.caches, (size_t)cfg->n_layers * sizeof *caches);
        /* bounded: the caches the service gave (a resumed checkpoint's or
         * fresh ones) are attached in attention order; a checkpoint clones
         * them, sharing their page-file copies, and its encode reads those */
        if (res && (rc = kvt_seq_live_attach(caches, cfg->n_layers, res)))
            goto done;
        every = kvt_service_checkpoint_every(rp->svc);
        if (ck.generated_tokens > 0) {
            generated = ck.generated_tokens;
            st.resumed_generated = generated;
            st.resumed_tokens = n_prompt + generated - 1;
            if ((rc = emit_reply(out, tok, toks[n_prompt - 1], all + n_prompt, generated)))
                goto done;
            token = all[n_prompt + generated - 1];
            pos0 = n_prompt - 1 + generated;
            t1 = kvt_now_ns();
            goto decode;
        }
        int64_t reused = state.reused_tokens;
        uint64_t t0 = kvt_now_ns();
        if ((rc = kvt_model_prefill(m, caches, toks + reused, n_prompt - reused, logits)))
            goto done;
        t1 = kvt_now_ns();
        st.prefill_tokens = n_prompt - reused;
        st.prefill_ms = (double)(t1 - t0) / 1e6;
    } else {
        if ((rc = kvt_model_new_caches(m, block_tokens, caches)))
            goto done;
        have_caches = 1;
        uint64_t t0 = kvt_now_ns();
        if (live && (live->max_blocks > 0 || live->max_bytes > 0)) {
            /* bounded residency: each kv layer's cache attached in attention order */
            if ((rc = kvt_residency_create(live, &res)))
                goto done;
            if ((rc = kvt_seq_live_attach(caches, cfg->n_layers, res)))
                goto done;
        }
        if ((rc = kvt_model_prefill(m, caches, toks, n_prompt, logits)))
            goto done;
        t1 = kvt_now_ns();
        st.prefill_tokens = n_prompt;
        st.prefill_ms = (double)(t1 - t0) / 1e6;
    }
decode:
    for (int64_t pos = pos0; pos < steps; pos++) {
        if (pos > n_prompt - 1) {
            if ((rc = kvt_model_decode(m, caches, token, logits)))
                goto done;
            st.decode_tokens++;
        }
        int32_t next = kvt_sampler_sample(sampler, logits);
        st.sampled_tokens++;
        if (next == KVT_TOKEN_BOS)
            break;
        if ((rc = emit(out, kvt_tokenizer_decode(tok, token, next))))
            goto done;
        token = next;
        if (all) {
            all[n_prompt + generated++] = next;
            /* the caches hold the prompt and every reply token but `next`,
             * which is pending; no checkpoint for the last position */
            if (every > 0 && generated % every == 0 && pos + 1 < steps &&
                kvt_replay_checkpoint(rp->svc, adm, sampler, caches, all, n_prompt, generated, next) == 0)
                st.checkpoints++;
        }
    }
    st.decode_ms = (double)(kvt_now_ns() - t1) / 1e6;
    completed = 1;
newline:
    if (fputs("\n", out) == EOF || fflush(out) != 0)
        rc = kvt__fail(-EIO, "generate: writing the output failed");
done:
    if (res) {
        for (int32_t l = 0; l < cfg->n_layers; l++) /* the last writes complete: final counters */
            if (caches[l] && (!strcmp(kvt_cache_kind(caches[l]), "kv") || !strcmp(kvt_cache_kind(caches[l]), "qkvc")))
                (void)kvt_kv_residency_settle(caches[l]);
        kvt_residency_stats rs;
        if (kvt_residency_stats_get(res, &rs) == 0) {
            st.paged_out_blocks = rs.blocks_out;
            st.paged_out_bytes = rs.bytes_out;
            st.paged_in_blocks = rs.blocks_in;
            st.paged_in_bytes = rs.bytes_in;
            st.page_stall_ms = (double)rs.stall_ns / 1e6;
            st.live_peak_bytes = rs.peak_resident_bytes;
            st.page_write_failures = rs.write_failures;
            st.paged_ref_blocks = rs.blocks_ref;
            st.paged_ref_bytes = rs.bytes_ref;
        }
    }
    if (have_caches)
        kvt_caches_destroy(caches, cfg->n_layers);
    kvt_residency_release(res);
    kvt_state_clear(&state); /* the replayable run's caches (caches[] only borrowed them) */
    if (adm)
        kvt_service_release(rp->svc, adm, completed && rc == 0);
    kvt__free(caches);
    kvt__free(logits);
    kvt__free(toks);
    kvt__free(all);
    finish_stats(&st);
    if (stats)
        *stats = st;
    return rc;
}
