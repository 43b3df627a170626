/*
 * scheduler.c: the engine thread of `kvtier serve` (scheduler.h). It owns the model:
 * jobs come from a bounded FIFO queue, each generation runs through the
 * cache service (admission, prefix reuse, prompt-boundary snapshot,
 * publish, release), and the reply text grows under the job's mutex, where
 * the connection thread reads it.
 *
 * Lock order: sched->mu before job->mu; neither is held while the model runs.
 * Must never: let a job end without kvt_service_release, or send a byte of a
 * reply that a stop sequence may still cut.
 */
#include "scheduler.h"

#include "seq.h"
#include "util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

struct kvt_srv_sched {
    kvt_model *m;
    const kvt_tokenizer *tok;
    kvt_service *svc;
    kvt_srv_metrics *metrics;
    kvt_srv_sched_opts o;
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* the engine waits here for jobs; drain waits for idleness */
    kvt_srv_job *head, *tail;   /* queued, FIFO */
    int64_t queued, running;
    int closed;                 /* drain began: no new jobs */
    int stop;                   /* the engine thread ends */
    int cancel_all;             /* drain timed out: every job ends now */
    pthread_t thread;
    /* engine-private scratch of the batched decode, (max_running) each */
    struct running_s **batch;
    kvt_cache ***batch_caches;
    int32_t *batch_counts;      /* (max_running) rows of each sequence in the pass */
    int32_t *batch_tokens;      /* (max_running + chunk) the pass's tokens */
    float *batch_logits;        /* (max_running, vocab_size) */
    int64_t chunk;              /* prompt tokens per step at most */
    /* figures: st is the engine's own (engine thread only), copied into
     * shown under st_mu at the end of each step; the SSE figures come
     * from the connection threads */
    kvt_srv_sched_stats st, shown;
    pthread_mutex_t st_mu;
    kvt_srv_phase phase;        /* the phase the engine thread is in */
    uint64_t mark_ns;           /* when it entered it */
    atomic_ullong sse_events, sse_build_ns, sse_lag_ns;
};

/* Charges the time since the last mark to the current phase and enters
 * phase p. @return the phase left. Engine thread only. */
static kvt_srv_phase phase_to(kvt_srv_sched *s, kvt_srv_phase p)
{
    uint64_t now = kvt_now_ns();
    kvt_srv_phase was = s->phase;
    s->st.phase_ns[was] += now - s->mark_ns;
    s->mark_ns = now;
    s->phase = p;
    return was;
}

/* Counts a decode step of nb sequences. @return its histogram bucket. */
static int count_batch(kvt_srv_sched_stats *st, int nb)
{
    int i = 0;
    while (i < KVT_SRV_BATCH_BUCKETS && nb > kvt_srv_batch_bounds[i])
        i++;
    st->batch_buckets[i]++;
    st->batch_sequences += (uint64_t)nb;
    st->decode_steps++;
    return i;
}

/* A condition variable whose timed waits use CLOCK_MONOTONIC (deadline_in). */
static void cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

/* ---- jobs ------------------------------------------------------------------------------ */

kvt_srv_job *kvt_srv_job_new(void)
{
    kvt_srv_job *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    pthread_mutex_init(&j->mu, NULL);
    cond_init_monotonic(&j->cv);
    atomic_init(&j->refs, 1);
    atomic_init(&j->cancel, 0);
    j->status = 200;
    return j;
}

void kvt_srv_job_release(kvt_srv_job *j)
{
    if (!j || atomic_fetch_sub(&j->refs, 1) != 1)
        return;
    free(j->prompt);
    for (int i = 0; i < j->n_stop; i++)
        free(j->stop[i]);
    free(j->session);
    free(j->request_id);
    free(j->text);
    free(j->raw);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

void kvt_srv_job_cancel(kvt_srv_job *j)
{
    if (j)
        atomic_store(&j->cancel, 1);
}

static void deadline_in(struct timespec *ts, int64_t ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

void kvt_srv_job_wait_locked(kvt_srv_job *j, size_t seen, int64_t timeout_ms)
{
    if (j->done || j->visible > seen)
        return;
    struct timespec ts;
    deadline_in(&ts, timeout_ms);
    pthread_cond_timedwait(&j->cv, &j->mu, &ts);
}

/* ---- reply text (engine thread) -------------------------------------------------------- */

/* Longest suffix of text that is a proper prefix of a stop sequence. */
static size_t stop_holdback(const kvt_srv_job *j)
{
    size_t best = 0;
    for (int i = 0; i < j->n_stop; i++) {
        size_t sl = strlen(j->stop[i]);
        for (size_t k = sl - 1; k > best; k--)
            if (k <= j->text_len && !memcmp(j->text + j->text_len - k, j->stop[i], k)) {
                best = k;
                break;
            }
    }
    return best;
}

/* Converts the decidable part of raw into text and cuts at a stop sequence.
 * Called with j->mu held. @return 1 when a stop sequence ended the reply,
 * 0 otherwise, -1 out of memory. */
static int commit_raw(kvt_srv_job *j, int final)
{
    size_t n = final ? j->raw_len : kvt_oai_utf8_complete(j->raw, j->raw_len);
    size_t before = j->text_len;
    if (n && kvt_oai_utf8_append(&j->text, &j->text_len, &j->text_cap, j->raw, n))
        return -1;
    if (j->raw_len > n) /* raw is NULL before the first byte: memmove(NULL, ...) is undefined even for 0 */
        memmove(j->raw, j->raw + n, j->raw_len - n);
    j->raw_len -= n;
    for (int i = 0; i < j->n_stop; i++) {
        size_t sl = strlen(j->stop[i]);
        size_t from = before >= sl ? before - sl + 1 : 0;
        for (size_t p = from; p + sl <= j->text_len; p++)
            if (!memcmp(j->text + p, j->stop[i], sl)) {
                j->text_len = p;
                j->text[p] = '\0';
                j->visible = p;
                return 1;
            }
    }
    j->visible = final ? j->text_len : j->text_len - stop_holdback(j);
    return 0;
}

/* Appends a generated token's piece. @return as commit_raw. */
static int append_token(kvt_srv_job *j, const kvt_tokenizer *tok, int32_t prev, int32_t t)
{
    const char *piece = kvt_tokenizer_decode(tok, prev, t);
    size_t n = piece ? strlen(piece) : 0;
    if (j->raw_len + n > j->raw_cap) {
        size_t nc = j->raw_cap ? j->raw_cap * 2 : 64;
        while (nc < j->raw_len + n)
            nc *= 2;
        char *p = realloc(j->raw, nc);
        if (!p)
            return -1;
        j->raw = p;
        j->raw_cap = nc;
    }
    memcpy(j->raw + j->raw_len, piece ? piece : "", n);
    j->raw_len += n;
    return commit_raw(j, 0);
}

static int64_t unix_ms(void)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

/* Ends a job: final text, status, the record; wakes its connection. */
static void finish(kvt_srv_sched *s, kvt_srv_job *j, int status, const char *finish_reason, const char *err)
{
    pthread_mutex_lock(&j->mu);
    if (status == 200)
        commit_raw(j, 1);
    j->visible_ns = kvt_now_ns();
    j->status = status;
    j->finish_reason = finish_reason;
    if (err)
        snprintf(j->error, sizeof j->error, "%s", err);
    kvt_srv_record rec = {
        .time_ms = unix_ms(),
        .endpoint = j->endpoint,
        .prompt_tokens = j->n_prompt,
        .completion_tokens = j->usage.completion_tokens,
        .reused_ram = j->usage.reused_ram,
        .reused_ssd = j->usage.reused_ssd,
        .reused_remote = j->usage.reused_remote,
        .reused_published = j->usage.reused_published,
        .prefilled_tokens = j->usage.prefilled_tokens,
        .queue_ms = j->usage.queue_ms,
        .ttft_ms = j->started ? j->usage.ttft_ms : -1.0,
        .e2e_ms = (double)(kvt_now_ns() - j->arrival_ns) / 1e6,
        .status = status,
    };
    snprintf(rec.model, sizeof rec.model, "%s", j->model);
    pthread_mutex_unlock(&j->mu);
    /* the record goes into the ring before the job is done, so a client that
     * has its reply finds its request in /events and /stats */
    kvt_srv_metrics_finish(s->metrics, &rec);
    pthread_mutex_lock(&j->mu);
    j->done = 1;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (status == KVT_SRV_STATUS_CANCELLED || status == 503)
        kvt_srv_metrics_add(s->metrics, offsetof(kvt_srv_counters, cancelled), 1);
}

/* ---- the engine thread: continuous batching ------------------------------------------------ */

/* A job the engine admitted: its sequence and sampler. Engine-private. */
typedef struct running_s {
    kvt_srv_job *job;
    kvt_seq *seq;
    kvt_sampler *sampler;
    int prompt_done;
    int32_t prev;               /* the token before the next one, for decoding pieces */
    double engine_ms;           /* prefill calls and decode steps it took part in, ms */
    int64_t decodes;            /* batched decode steps it took part in */
} running;

/* The restores each cold tier level counted so far, (KVT_TIER_CHAIN_MAX).
 * @return the levels read. */
static int32_t level_restores(kvt_service *svc, uint64_t *out)
{
    int32_t n = kvt_service_tier_count(svc);
    if (n > KVT_TIER_CHAIN_MAX)
        n = KVT_TIER_CHAIN_MAX;
    for (int32_t i = 0; i < n; i++) {
        kvt_tier_stats st;
        out[i] = kvt_service_tier_stats(svc, i, &st) == 0 ? st.restores : 0;
    }
    return n;
}

/* Which tier served a request's `reused` prompt tokens: the cold tier level
 * whose restores grew while the request began (restores0 before, n0 levels),
 * else RAM; a resumed request's checkpoint comes from the SSD store. Puts
 * the tokens into that tier's reused_* field of u. */
static void count_reused(kvt_service *svc, const uint64_t *restores0, int32_t n0, int resumed, int64_t reused,
                         kvt_oai_usage *u)
{
    uint64_t now[KVT_TIER_CHAIN_MAX];
    int32_t n = level_restores(svc, now);
    int tier = resumed ? 1 : 0;
    for (int32_t i = 0; i < n && i < n0; i++)
        if (now[i] > restores0[i]) {
            tier = kvt_oai_tier_of_level(kvt_service_tier_name(svc, i));
            break;
        }
    u->reused_ram = tier == 0 ? reused : 0;
    u->reused_ssd = tier == 1 ? reused : 0;
    u->reused_remote = tier == 2 ? reused : 0;
    u->reused_published = tier == 3 ? reused : 0;
}

static double ms_since(uint64_t t0) { return (double)(kvt_now_ns() - t0) / 1e6; }

/* Ends a running sequence: publishes what it computed, releases its
 * admission, then ends its job. */
static void end_run(kvt_srv_sched *s, running *r, int status, const char *reason, const char *err)
{
    kvt_srv_phase was = phase_to(s, KVT_SRV_PHASE_finish);
    kvt_seq_finish(r->seq, status == 200, NULL);
    pthread_mutex_lock(&r->job->mu);
    r->job->usage.engine_ms = r->engine_ms;
    pthread_mutex_unlock(&r->job->mu);
    kvt_sampler_free(r->sampler);
    finish(s, r->job, status, reason, err);
    kvt_srv_job_release(r->job);
    memset(r, 0, sizeof *r);
    phase_to(s, was);
}

/* Takes the token the sequence chose last. @return 1 when the job ended. */
static int take_token(kvt_srv_sched *s, running *r)
{
    int32_t tok = -1;
    int finished = 0;
    kvt_srv_job *j = r->job;
    if (kvt_seq_next(r->seq, &tok, &finished)) {
        end_run(s, r, 500, NULL, kvt_last_error());
        return 1;
    }
    int cut = 0;
    if (tok >= 0) {
        kvt_srv_phase was = phase_to(s, KVT_SRV_PHASE_emit);
        pthread_mutex_lock(&j->mu);
        size_t seen = j->visible;
        cut = append_token(j, s->tok, r->prev, tok);
        j->usage.completion_tokens++;
        if (cut >= 0 && j->visible > seen)
            j->visible_ns = kvt_now_ns();
        if (cut >= 0 && j->visible)
            pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
        r->prev = tok;
        phase_to(s, was);
    }
    if (cut < 0) {
        end_run(s, r, 500, NULL, "out of memory");
        return 1;
    }
    if (finished || cut) {
        end_run(s, r, 200, cut || tok < 0 ? "stop" : "length", NULL);
        return 1;
    }
    return 0;
}

/* The sequence's prompt is in its caches and its first token chosen:
 * TTFT, and the token goes out. */
static void prompt_done(kvt_srv_sched *s, running *r)
{
    r->prompt_done = 1;
    pthread_mutex_lock(&r->job->mu);
    r->job->started = 1;
    r->job->usage.ttft_ms = ms_since(r->job->arrival_ns);
    pthread_mutex_unlock(&r->job->mu);
    take_token(s, r);
}

static void job_error(kvt_srv_sched *s, kvt_srv_job *j, int rc)
{
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
    finish(s, j, rc == KVT_ELIMIT || rc == KVT_EINVAL ? 400 : rc == KVT_EMISMATCH ? 422 : rc == KVT_ECLOSED ? 503 : 500,
           NULL, msg);
}

/* Takes the head job off the queue (it becomes the caller's reference). */
static kvt_srv_job *pop_head(kvt_srv_sched *s, int admitted)
{
    pthread_mutex_lock(&s->mu);
    kvt_srv_job *j = s->head;
    s->head = j->next;
    if (!s->head)
        s->tail = NULL;
    j->next = NULL;
    s->queued--;
    s->running += admitted;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return j;
}

/* Starts the queue's head job into *slot. @return 1 when the head left the
 * queue (started: slot->job set; or ended at once: slot untouched), 0 when
 * it does not fit beside the running ones now (it stays first). */
static int admit_head(kvt_srv_sched *s, running *slot)
{
    pthread_mutex_lock(&s->mu);
    kvt_srv_job *j = s->head;
    int closing = s->cancel_all;
    pthread_mutex_unlock(&s->mu);
    if (closing || atomic_load(&j->cancel)) {
        j = pop_head(s, 0);
        finish(s, j, closing ? 503 : KVT_SRV_STATUS_CANCELLED, NULL,
               closing ? "the server is shutting down" : "cancelled by the client");
        kvt_srv_job_release(j);
        return 1;
    }
    const kvt_model_config *c = kvt_model_get_config(s->m);
    kvt_sampler *sampler = NULL;
    kvt_seq *seq = NULL;
    int rc = kvt_sampler_create(c->vocab_size, j->temperature, j->top_p, j->seed, &sampler);
    kvt_gen_opts g = {.max_tokens = j->max_tokens, .session = j->session, .admit_timeout_ms = 0,
                      .stop_tok = j->stop_at_newline ? s->tok : NULL, .request_id = j->request_id,
                      .seed_explicit = j->seed_explicit, .live_cache_blocks = s->o.live_cache_blocks,
                      .live_cache_bytes = s->o.live_cache_bytes, .live_cache_dir = s->o.live_cache_dir,
                      .live_cache_strict = s->o.live_cache_strict};
    uint64_t restores0[KVT_TIER_CHAIN_MAX];
    int32_t n_levels = level_restores(s->svc, restores0);
    if (!rc)
        rc = kvt_seq_begin(s->m, s->svc, sampler, j->prompt, j->n_prompt, &g, &seq);
    if (rc == KVT_EAGAIN) {
        kvt_sampler_free(sampler);
        return 0;
    }
    if (rc) {
        kvt_sampler_free(sampler);
        j = pop_head(s, 0);
        job_error(s, j, rc);
        kvt_srv_job_release(j);
        return 1;
    }
    int64_t reused = kvt_seq_reused(seq);
    pthread_mutex_lock(&j->mu);
    j->usage.prompt_tokens = j->n_prompt;
    count_reused(s->svc, restores0, n_levels, kvt_seq_resumed(seq) > 0, reused, &j->usage);
    j->usage.prefilled_tokens = j->n_prompt - reused;
    j->usage.queue_ms = ms_since(j->arrival_ns);
    pthread_mutex_unlock(&j->mu);
    *slot = (running){.job = pop_head(s, 1), .seq = seq, .sampler = sampler, .prev = j->prompt[j->n_prompt - 1]};
    /* a resumed request: the reply its checkpoint holds goes out first, so
     * the client gets the whole reply once */
    int64_t n_resumed = kvt_seq_resumed(seq);
    if (n_resumed > 0) {
        int64_t n_rep;
        const int32_t *rep = kvt_seq_reply(seq, &n_rep);
        int cut = 0;
        pthread_mutex_lock(&j->mu);
        j->usage.resumed_tokens = n_resumed;
        for (int64_t i = 0; i < n_resumed && cut == 0; i++) {
            cut = append_token(j, s->tok, slot->prev, rep[i]);
            j->usage.completion_tokens++;
            slot->prev = rep[i];
        }
        if (cut >= 0 && j->visible)
            pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
        if (cut)
            end_run(s, slot, cut < 0 ? 500 : 200, cut < 0 ? NULL : "stop", cut < 0 ? "out of memory" : NULL);
    }
    return 1;
}

/* Drops the ended sequences from run[0..n), keeping the order. @return the new n. */
static int64_t compact(kvt_srv_sched *s, running *run, int64_t n)
{
    int64_t w = 0;
    for (int64_t i = 0; i < n; i++)
        if (run[i].job)
            run[w++] = run[i];
    if (w != n) {
        pthread_mutex_lock(&s->mu);
        s->running = w;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    return w;
}

/* One engine step over the running sequences: cancellations, admission
 * (first come first served: a head that does not fit waits), then one
 * batched pass holding a decode row of every sequence with a pending token
 * and a bounded chunk of prompt rows shared by the sequences still
 * prefilling (requests admitted in the same step prefill together, beside
 * the running streams).
 * @return 1 when the queue's head waits for room, else 0. */
static int step(kvt_srv_sched *s, running *run, int64_t *n_run, int cancel_all)
{
    s->mark_ns = kvt_now_ns();
    uint64_t step0 = s->mark_ns;
    s->phase = KVT_SRV_PHASE_other;
    int64_t n = *n_run;
    for (int64_t i = 0; i < n; i++)
        if (cancel_all || atomic_load(&run[i].job->cancel))
            end_run(s, &run[i], cancel_all ? 503 : KVT_SRV_STATUS_CANCELLED, NULL,
                    cancel_all ? "the server is shutting down" : "cancelled by the client");
    n = compact(s, run, n);
    int blocked = 0;
    phase_to(s, KVT_SRV_PHASE_admit);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int more = s->head != NULL && n < s->o.max_running;
        pthread_mutex_unlock(&s->mu);
        if (!more)
            break;
        if (!admit_head(s, &run[n])) {
            blocked = 1;
            break;
        }
        if (run[n].job)
            n++;
    }
    /* ONE batched pass over the weights: a decode row for every sequence
     * with a pending token, then prompt rows of the sequences still
     * prefilling, at most prefill_chunk of them (a long prompt never stalls
     * the running streams for more than that). Every row is computed as its
     * decode alone would (kvt_model_forward_batch), so a reply depends
     * neither on what it was batched with nor on how its prompt was cut. */
    phase_to(s, KVT_SRV_PHASE_other);
    int nb = 0, n_dec = 0, veterans = 0, bucket = -1;
    int64_t rows = 0;
    for (int64_t i = 0; i < n; i++) {
        running *r = &run[i];
        if (!r->job || !r->prompt_done || kvt_seq_pending_token(r->seq) < 0)
            continue;
        s->batch[nb] = r;
        s->batch_caches[nb] = kvt_seq_caches(r->seq);
        s->batch_counts[nb++] = 1;
        s->batch_tokens[rows++] = kvt_seq_pending_token(r->seq);
        veterans += r->decodes > 0;
    }
    n_dec = nb;
    int64_t budget = s->chunk;
    if (n_dec + budget > KVT_MODEL_CHUNK) /* the pass stays one group of rows */
        budget = KVT__MAX(KVT_MODEL_CHUNK - n_dec, 16);
    for (int64_t i = 0; i < n && budget > 0; i++) {
        running *r = &run[i];
        if (!r->job || r->prompt_done)
            continue;
        const int32_t *toks = NULL;
        int64_t k = kvt_seq_prefill_next(r->seq, KVT__MIN(budget, (int64_t)KVT_MODEL_CHUNK), &toks);
        if (k < 1) { /* nothing to prefill: a resumed request's checkpoint holds its prompt */
            prompt_done(s, r);
            continue;
        }
        s->batch[nb] = r;
        s->batch_caches[nb] = kvt_seq_caches(r->seq);
        s->batch_counts[nb++] = (int32_t)k;
        memcpy(s->batch_tokens + rows, toks, (size_t)k * sizeof *toks);
        rows += k;
        budget -= k;
    }
    int ran = nb > 0;
    if (n_dec > 0) {
        bucket = count_batch(&s->st, n_dec);
        s->st.mixed_steps += nb > n_dec;
        for (int b = 0; veterans && b < n_dec; b++)
            s->st.joined += s->batch[b]->decodes == 0;
        kvt_srv_metrics_add(s->metrics, offsetof(kvt_srv_counters, decode_steps), 1);
        kvt_srv_metrics_add(s->metrics, offsetof(kvt_srv_counters, decode_batch_sequences), (uint64_t)n_dec);
    }
    if (nb > n_dec) {
        s->st.prefill_passes++;
        s->st.prefill_tokens += (uint64_t)(rows - n_dec);
    }
    if (nb > 0) {
        int32_t V = kvt_model_get_config(s->m)->vocab_size;
        phase_to(s, n_dec ? KVT_SRV_PHASE_decode : KVT_SRV_PHASE_prefill);
        uint64_t t0 = kvt_now_ns();
        int rc = kvt_model_forward_batch(s->m, nb, (kvt_cache **const *)s->batch_caches, s->batch_counts,
                                         s->batch_tokens, s->batch_logits);
        double pass_ms = ms_since(t0);
        char err[512] = "";
        if (rc)
            snprintf(err, sizeof err, "%s", kvt_last_error());
        phase_to(s, KVT_SRV_PHASE_sample);
        int ended = 0;
        for (int b = 0; b < nb; b++) {
            running *r = s->batch[b];
            r->engine_ms += pass_ms;
            if (rc) { /* the caches may hold a partial step: nothing more is published */
                kvt_seq_fail(r->seq);
                end_run(s, r, 500, NULL, err);
                ended += b < n_dec;
                continue;
            }
            memcpy(kvt_seq_logits(r->seq), s->batch_logits + (size_t)b * (size_t)V, (size_t)V * sizeof(float));
            int rc2;
            if (b < n_dec) {
                r->decodes++;
                if ((rc2 = kvt_seq_after_decode(r->seq)) == 0) {
                    ended += take_token(s, r);
                    continue;
                }
                ended++;
            } else if ((rc2 = kvt_seq_after_prefill(r->seq, s->batch_counts[b], &r->prompt_done)) == 0) {
                if (r->prompt_done)
                    prompt_done(s, r);
                continue;
            }
            snprintf(err, sizeof err, "%s", kvt_last_error());
            kvt_seq_fail(r->seq);
            end_run(s, r, 500, NULL, err);
        }
        if (ended < n_dec)
            s->st.left_early += (uint64_t)ended;
    }
    *n_run = compact(s, run, n);
    phase_to(s, KVT_SRV_PHASE_other);
    s->st.steps += ran;
    s->st.step_ns += s->mark_ns - step0;
    if (bucket >= 0)
        s->st.batch_step_ns[bucket] += s->mark_ns - step0;
    pthread_mutex_lock(&s->st_mu);
    s->shown = s->st;
    pthread_mutex_unlock(&s->st_mu);
    return blocked;
}

static void *engine_main(void *arg)
{
    kvt_srv_sched *s = arg;
    running *run = calloc((size_t)s->o.max_running + 1, sizeof *run);
    int64_t n_run = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head && n_run == 0 && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        int stop = s->stop && !s->head && n_run == 0;
        int cancel_all = s->cancel_all;
        if (cancel_all)
            for (kvt_srv_job *j = s->head; j; j = j->next)
                atomic_store(&j->cancel, 1);
        pthread_mutex_unlock(&s->mu);
        if (stop || !run)
            break;
        if (step(s, run, &n_run, cancel_all) && n_run == 0) {
            /* nothing runs and the head still does not fit (another user of
             * the service holds the budget): look again shortly */
            struct timespec ts;
            deadline_in(&ts, 2);
            pthread_mutex_lock(&s->mu);
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            pthread_mutex_unlock(&s->mu);
        }
    }
    free(run);
    return NULL;
}

static void sched_free(kvt_srv_sched *s)
{
    free(s->batch);
    free(s->batch_caches);
    free(s->batch_tokens);
    free(s->batch_counts);
    free(s->batch_logits);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->st_mu);
    free(s);
}

int kvt_srv_sched_create(kvt_model *m, const kvt_tokenizer *tok, kvt_service *svc, kvt_srv_metrics *metrics,
                         const kvt_srv_sched_opts *o, kvt_srv_sched **out)
{
    *out = NULL;
    if (!m || !tok || !svc || !metrics || !o || o->max_queue < 0 || o->max_running < 1 || o->prefill_chunk < 0 ||
        o->prefill_chunk > KVT_MODEL_CHUNK)
        return KVT_EINVAL;
    kvt_srv_sched *s = calloc(1, sizeof *s);
    if (!s)
        return KVT_ENOMEM;
    s->m = m;
    s->tok = tok;
    s->svc = svc;
    s->metrics = metrics;
    s->o = *o;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->st_mu, NULL);
    cond_init_monotonic(&s->cv);
    atomic_init(&s->sse_events, 0);
    atomic_init(&s->sse_build_ns, 0);
    atomic_init(&s->sse_lag_ns, 0);
    size_t R = (size_t)o->max_running;
    s->batch = calloc(R, sizeof *s->batch);
    s->batch_caches = calloc(R, sizeof *s->batch_caches);
    s->chunk = o->prefill_chunk ? o->prefill_chunk : KVT_MODEL_CHUNK;
    s->batch_counts = calloc(R, sizeof *s->batch_counts);
    s->batch_tokens = calloc(R + (size_t)s->chunk, sizeof *s->batch_tokens);
    s->batch_logits = calloc(R * (size_t)kvt_model_get_config(m)->vocab_size, sizeof *s->batch_logits);
    int rc = (s->batch && s->batch_caches && s->batch_counts && s->batch_tokens && s->batch_logits) ? 0 : ENOMEM;
    if (!rc)
        rc = pthread_create(&s->thread, NULL, engine_main, s);
    if (rc) {
        sched_free(s);
        return -rc;
    }
    *out = s;
    return 0;
}

int kvt_srv_sched_submit(kvt_srv_sched *s, kvt_srv_job *j)
{
    pthread_mutex_lock(&s->mu);
    if (s->closed) {
        pthread_mutex_unlock(&s->mu);
        return KVT_ECLOSED;
    }
    /* jobs the engine will admit at its next step (free running slots) do
     * not count as waiting */
    int64_t free_slots = s->o.max_running > s->running ? s->o.max_running - s->running : 0;
    if (s->queued >= s->o.max_queue + free_slots) {
        pthread_mutex_unlock(&s->mu);
        return KVT_EAGAIN;
    }
    atomic_fetch_add(&j->refs, 1);
    j->next = NULL;
    if (s->tail)
        s->tail->next = j;
    else
        s->head = j;
    s->tail = j;
    s->queued++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void kvt_srv_sched_get_stats(kvt_srv_sched *s, kvt_srv_sched_stats *out)
{
    pthread_mutex_lock(&s->st_mu);
    *out = s->shown;
    pthread_mutex_unlock(&s->st_mu);
    out->sse_events = atomic_load(&s->sse_events);
    out->sse_build_ns = atomic_load(&s->sse_build_ns);
    out->sse_lag_ns = atomic_load(&s->sse_lag_ns);
}

void kvt_srv_sched_note_sse(kvt_srv_sched *s, uint64_t build_ns, uint64_t lag_ns)
{
    atomic_fetch_add(&s->sse_events, 1);
    atomic_fetch_add(&s->sse_build_ns, build_ns);
    atomic_fetch_add(&s->sse_lag_ns, lag_ns);
}

void kvt_srv_sched_gauges(kvt_srv_sched *s, int64_t *queued, int64_t *running)
{
    pthread_mutex_lock(&s->mu);
    *queued = s->queued;
    *running = s->running;
    pthread_mutex_unlock(&s->mu);
}

int64_t kvt_srv_sched_drain(kvt_srv_sched *s, int64_t timeout_ms)
{
    struct timespec ts;
    deadline_in(&ts, timeout_ms > 0 ? timeout_ms : 0);
    pthread_mutex_lock(&s->mu);
    s->closed = 1;
    while ((s->queued || s->running) && timeout_ms > 0)
        if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) == ETIMEDOUT)
            break;
    int64_t left = s->queued + s->running;
    if (left) {
        s->cancel_all = 1;
        for (kvt_srv_job *j = s->head; j; j = j->next)
            atomic_store(&j->cancel, 1);
        while (s->queued || s->running)
            pthread_cond_wait(&s->cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return left;
}

void kvt_srv_sched_destroy(kvt_srv_sched *s)
{
    if (!s)
        return;
    kvt_srv_sched_drain(s, 0);
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    sched_free(s);
}
