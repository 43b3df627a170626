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
};

/* ---- jobs ------------------------------------------------------------------------------ */

kvt_srv_job *kvt_srv_job_new(void)
{
    kvt_srv_job *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
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
    j->status = status;
    j->finish_reason = finish_reason;
    if (err)
        snprintf(j->error, sizeof j->error, "%s", err);
    j->done = 1;
    kvt_srv_record rec = {
        .time_ms = unix_ms(),
        .endpoint = j->endpoint,
        .prompt_tokens = j->n_prompt,
        .completion_tokens = j->usage.completion_tokens,
        .reused_ram = j->usage.reused_ram,
        .reused_ssd = j->usage.reused_ssd,
        .prefilled_tokens = j->usage.prefilled_tokens,
        .queue_ms = j->usage.queue_ms,
        .ttft_ms = j->started ? j->usage.ttft_ms : -1.0,
        .e2e_ms = (double)(kvt_now_ns() - j->arrival_ns) / 1e6,
        .status = status,
    };
    snprintf(rec.model, sizeof rec.model, "%s", j->model);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    kvt_srv_metrics_finish(s->metrics, &rec);
    if (status == KVT_SRV_STATUS_CANCELLED || status == 503)
        kvt_srv_metrics_add(s->metrics, offsetof(kvt_srv_counters, cancelled), 1);
}

/* ---- one generation --------------------------------------------------------------------- */

static uint64_t cold_restores(kvt_service *svc)
{
    kvt_service_report r;
    return kvt_service_report_get(svc, &r) == 0 ? r.cold_restores : 0;
}

static void run_job(kvt_srv_sched *s, kvt_srv_job *j)
{
    if (atomic_load(&j->cancel)) {
        finish(s, j, KVT_SRV_STATUS_CANCELLED, NULL, "cancelled by the client");
        return;
    }
    const kvt_model_config *c = kvt_model_get_config(s->m);
    kvt_sampler *sampler = NULL;
    int32_t *reply = malloc((size_t)j->max_tokens * sizeof *reply);
    int rc = reply ? kvt_sampler_create(c->vocab_size, j->temperature, j->top_p, j->seed, &sampler) : KVT_ENOMEM;
    if (rc) {
        free(reply);
        finish(s, j, 500, NULL, rc == KVT_ENOMEM ? "out of memory" : kvt_last_error());
        return;
    }
    uint64_t restores0 = cold_restores(s->svc);
    kvt_gen_opts g = {.max_tokens = j->max_tokens, .session = j->session, .admit_timeout_ms = -1,
                      .stop_tok = j->stop_at_newline ? s->tok : NULL};
    int64_t n_reply = 0;
    kvt_turn_stats st;
    uint64_t t_start = kvt_now_ns();
    rc = kvt_chat_generate(s->m, s->svc, sampler, j->prompt, j->n_prompt, &g, reply, j->max_tokens, &n_reply, &st);
    int from_ssd = cold_restores(s->svc) > restores0;
    kvt_sampler_free(sampler);
    if (rc) {
        char msg[512];
        snprintf(msg, sizeof msg, "generation failed: %s", kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
        free(reply);
        finish(s, j, rc == KVT_ELIMIT ? 400 : 500, NULL, msg);
        return;
    }
    pthread_mutex_lock(&j->mu);
    j->started = 1;
    j->usage.prompt_tokens = j->n_prompt;
    j->usage.reused_ram = from_ssd ? 0 : st.reused_tokens;
    j->usage.reused_ssd = from_ssd ? st.reused_tokens : 0;
    j->usage.prefilled_tokens = st.prefilled_tokens;
    j->usage.queue_ms = (double)(t_start - j->arrival_ns) / 1e6;
    j->usage.ttft_ms = j->usage.queue_ms + st.ttft_ms;
    const char *reason = n_reply >= j->max_tokens ? "length" : "stop";
    int32_t prev = j->prompt[j->n_prompt - 1];
    for (int64_t i = 0; i < n_reply; i++) {
        int r = append_token(j, s->tok, prev, reply[i]);
        j->usage.completion_tokens = i + 1;
        if (r) {
            reason = "stop";
            break;
        }
        prev = reply[i];
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    free(reply);
    finish(s, j, 200, reason, NULL);
}

/* ---- the engine thread ------------------------------------------------------------------ */

static void *engine_main(void *arg)
{
    kvt_srv_sched *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head && s->stop)
            break;
        kvt_srv_job *j = s->head;
        s->head = j->next;
        if (!s->head)
            s->tail = NULL;
        j->next = NULL;
        s->queued--;
        s->running++;
        int cancel_all = s->cancel_all;
        pthread_mutex_unlock(&s->mu);
        if (cancel_all)
            finish(s, j, 503, NULL, "the server is shutting down");
        else
            run_job(s, j);
        kvt_srv_job_release(j);
        pthread_mutex_lock(&s->mu);
        s->running--;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int kvt_srv_sched_create(kvt_model *m, const kvt_tokenizer *tok, kvt_service *svc, kvt_srv_metrics *metrics,
                         const kvt_srv_sched_opts *o, kvt_srv_sched **out)
{
    *out = NULL;
    if (!m || !tok || !svc || !metrics || !o || o->max_queue < 0 || o->max_running < 1)
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
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&s->thread, NULL, engine_main, s);
    if (rc) {
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
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
    if (s->queued >= s->o.max_queue) {
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
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
