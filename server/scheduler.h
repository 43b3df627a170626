/*
 * scheduler.h: the engine thread of `kvtier serve`. Generation requests (jobs)
 * are submitted by the HTTP threads into a bounded queue; one engine thread
 * owns the model and runs them: admission under the KV budget, prefill past
 * the reused prefix, decode, prompt-boundary and final publishes, release.
 * A job's reply grows under its own mutex; the connection that submitted it
 * waits on it (kvt_srv_job_wait) and streams or returns it.
 *
 * Thread-safety: kvt_srv_sched_* and kvt_srv_job_* may be called from any
 * thread; only the engine thread touches the model, the samplers and the
 * caches. A job is shared by its connection and the scheduler (refcounted);
 * its reply fields are read under job->mu.
 */
#ifndef KVT_SERVER_SCHEDULER_H
#define KVT_SERVER_SCHEDULER_H

#include "metrics.h"
#include "openai.h"

#include "chat.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Status recorded for a request cancelled by its client (nginx's 499). */
#define KVT_SRV_STATUS_CANCELLED 499

typedef struct kvt_srv_job {
    /* ---- set before kvt_srv_sched_submit, read-only afterwards ---- */
    kvt_srv_endpoint endpoint;
    int32_t *prompt;            /* (n_prompt) token ids, owned by the job */
    int64_t n_prompt;
    int64_t max_tokens;         /* >= 1; n_prompt + max_tokens <= the model's seq_len */
    float temperature, top_p;   /* as kvt_sampler_create */
    uint64_t seed;              /* != 0 */
    char *stop[KVT_OAI_MAX_STOP]; /* stop sequences, owned */
    int n_stop;
    int stop_at_newline;        /* 1: stop before a token whose piece holds '\n' (chat) */
    char *session;              /* owned, NULL = none */
    char *request_id;           /* owned: the Idempotency-Key of a replayable request
                                   (checkpointed, resumed after a restart), NULL = none */
    int seed_explicit;          /* 1: the client gave "seed" */
    char model[64];             /* the served model's id, for the record */
    uint64_t arrival_ns;        /* kvt_now_ns() when the body was complete */

    /* ---- the reply, written by the engine thread under mu ---- */
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* signalled when text grows or the job ends */
    char *text;                 /* (text_len) reply text so far, valid UTF-8, NUL-terminated */
    size_t text_len, text_cap;
    size_t visible;             /* leading bytes of text that may be sent now (a stop
                                   sequence may still begin in the rest) */
    int done;                   /* 1: finished; status says how */
    int status;                 /* 200, or the HTTP status of the error */
    char error[512];            /* the error message when status != 200 */
    const char *finish_reason;  /* "stop" or "length" when done with 200 */
    kvt_oai_usage usage;        /* final when done; prompt/reuse figures from the first token */
    int started;                /* 1 once the first token is chosen */
    uint64_t visible_ns;        /* kvt_now_ns() when visible last grew or the job ended */

    /* ---- either side ---- */
    atomic_int cancel;          /* set by the connection: stop within one step */
    atomic_int refs;

    /* ---- engine-private ---- */
    char *raw;                  /* undecided tail of the reply bytes (a partial character) */
    size_t raw_len, raw_cap;
    struct kvt_srv_job *next;   /* queue link */
} kvt_srv_job;

/** A new job with one reference (the caller's); NULL when out of memory.
 * The caller fills the input fields (ownership of prompt, stop and session
 * passes to the job) and submits it. */
kvt_srv_job *kvt_srv_job_new(void);

/** Drops a reference; the last one frees the job. NULL is a no-op. */
void kvt_srv_job_release(kvt_srv_job *j);

/** Asks the engine to stop the job at its next step (a client went away).
 * What it computed is still published to the cache. */
void kvt_srv_job_cancel(kvt_srv_job *j);

/** Waits (with j->mu held by the caller) until the job ends or its visible
 * text grows past `seen` bytes, at most timeout_ms milliseconds. */
void kvt_srv_job_wait_locked(kvt_srv_job *j, size_t seen, int64_t timeout_ms);

typedef struct kvt_srv_sched kvt_srv_sched;

/** Upper bounds of the decode batch-size histogram (sequences in one
 * batched decode step); a last +Inf bucket follows. */
#define KVT_SRV_BATCH_BUCKETS 14
extern const int kvt_srv_batch_bounds[KVT_SRV_BATCH_BUCKETS];

/** Where the engine thread's time goes, one entry per phase of a step:
 * name and help text (the /stats keys and the `phase` label of
 * kvtier_engine_phase_seconds_total). */
#define KVT_SRV_PHASES(X)                                                                                    \
    X(admit, "admitting queued requests: admission, prefix lookup and acquire (kvt_seq_begin)")            \
    X(prefill, "forward passes over prompt tokens with no decode row in the pass")                          \
    X(decode, "forward passes with decode rows (prompt rows run in the same pass included)")                \
    X(sample, "sampling next tokens from the logits, prompt-boundary snapshots")                            \
    X(emit, "appending chosen tokens to replies and waking their connections")                              \
    X(finish, "ending requests: publishing what they computed to the cache, releasing admission")          \
    X(other, "the rest of the engine's steps (cancellation checks, bookkeeping)")

typedef enum kvt_srv_phase {
#define KVT__PHASE_ENUM(name, help) KVT_SRV_PHASE_##name,
    KVT_SRV_PHASES(KVT__PHASE_ENUM)
#undef KVT__PHASE_ENUM
    KVT_SRV_PHASE_COUNT
} kvt_srv_phase;

/** What the engine thread did (monotonic totals since the scheduler
 * started), for /stats and /metrics. */
typedef struct kvt_srv_sched_stats {
    uint64_t steps;              /* engine steps that ran at least one forward pass */
    uint64_t decode_steps;       /* steps with a batched decode */
    uint64_t mixed_steps;        /* decode steps that also ran prompt tokens (prefill
                                    in the same step as decode) */
    uint64_t prefill_passes;     /* forward passes that ran prompt tokens */
    uint64_t prefill_tokens;     /* prompt tokens those passes ran */
    uint64_t batch_sequences;    /* decode rows, summed over the decode steps */
    uint64_t batch_buckets[KVT_SRV_BATCH_BUCKETS + 1]; /* decode steps by batch size:
                                    bucket i counts sizes in (bound[i-1], bound[i]], the
                                    last one sizes above every bound (not cumulative) */
    uint64_t batch_step_ns[KVT_SRV_BATCH_BUCKETS + 1]; /* engine-thread time of those steps
                                    (whole steps: admission to the last token emitted), ns */
    uint64_t joined;             /* sequences that started decoding in a step where
                                    others already decoded (arrived a step apart) */
    uint64_t left_early;         /* sequences that ended in a step while others kept
                                    decoding */
    uint64_t phase_ns[KVT_SRV_PHASE_COUNT]; /* engine-thread time per phase, ns */
    uint64_t step_ns;            /* engine-thread time inside steps, ns (the phases sum to it) */
    uint64_t sse_events;         /* streamed events built by the connection threads */
    uint64_t sse_build_ns;       /* time the connection threads spent building them, ns */
    uint64_t sse_lag_ns;         /* summed delay from a token becoming sendable to its
                                    event being handed to the HTTP library, ns */
} kvt_srv_sched_stats;

/** A snapshot of the scheduler's figures (thread-safe). */
void kvt_srv_sched_get_stats(kvt_srv_sched *s, kvt_srv_sched_stats *out);

/** Adds b's figures to a (several models' schedulers summed). */
void kvt_srv_sched_stats_add(kvt_srv_sched_stats *a, const kvt_srv_sched_stats *b);

/** Counts one streamed event built by a connection thread: build_ns spent
 * building it, lag_ns since its text became sendable (thread-safe). */
void kvt_srv_sched_note_sse(kvt_srv_sched *s, uint64_t build_ns, uint64_t lag_ns);

/** The figures as the /stats "engine" object: every field above, phase
 * times in seconds, the histogram as {"le": bound, "count": n, "seconds": s}
 * (steps and their engine-thread time per bucket), and the mean batch. @return a new reference, NULL when out of memory. */
json_t *kvt_srv_sched_stats_json(const kvt_srv_sched_stats *st);

/** One model's engine thread, as /metrics shows it. */
typedef struct kvt_srv_model_engine {
    const char *id;             /* the model's id (/v1/models), borrowed */
    kvt_srv_sched_stats st;     /* kvt_srv_sched_get_stats (zero before load) */
    int64_t queue_depth;        /* kvt_srv_sched_gauges: jobs waiting for admission */
    int64_t running;            /* jobs admitted (prefilling or decoding) */
} kvt_srv_model_engine;

/** Appends the engine threads' figures to the Prometheus text *text, one
 * HELP and TYPE line per family and one series per model of `models`
 * (n of them), labelled model="id" (escaped as metrics.h's label values):
 * the gauges kvtier_queue_depth and kvtier_running_requests, the histogram
 * kvtier_decode_batch_size, counters kvtier_decode_steps_total,
 * kvtier_decode_batch_sequences_total, kvtier_engine_steps_total,
 * kvtier_engine_mixed_steps_total, kvtier_engine_prefill_passes_total,
 * kvtier_engine_prefill_tokens_total, kvtier_engine_joined_total,
 * kvtier_engine_left_early_total, kvtier_engine_phase_seconds_total{model,
 * phase}, kvtier_engine_step_seconds_total, and the connection threads'
 * streaming of each model's replies: kvtier_sse_events_total,
 * kvtier_sse_build_seconds_total, kvtier_sse_lag_seconds_total. Nothing
 * when n is 0. *text is a malloc'd string; on success it is replaced by a
 * longer one (caller frees), on error left as it was.
 * @return 0, or -1 when out of memory. */
int kvt_srv_sched_stats_prometheus(char **text, const kvt_srv_model_engine *models, int n);

/** Settings of the scheduler. */
typedef struct kvt_srv_sched_opts {
    int64_t max_queue;          /* jobs waiting for admission at most (>= 0) */
    int64_t max_running;        /* jobs admitted at once at most (>= 1) */
    int64_t prefill_chunk;      /* prompt tokens one engine step runs at most, over all
                                   prefilling jobs (1..KVT_MODEL_CHUNK; 0 = KVT_MODEL_CHUNK) */
    int64_t live_cache_blocks;  /* bounded live-cache residency of every job, as
                                   kvt_gen_opts.live_cache_*; 0 and 0 = fully resident */
    uint64_t live_cache_bytes;
    const char *live_cache_dir; /* borrowed: must outlive the scheduler; NULL = $TMPDIR or /tmp */
    int live_cache_strict;      /* as kvt_gen_opts.live_cache_strict */
} kvt_srv_sched_opts;

/** Starts the engine thread over a loaded model, its tokenizer and service
 * (all borrowed: they must outlive the scheduler).
 * @param metrics borrowed; finished jobs are recorded there.
 * @return 0, KVT_EINVAL, KVT_ENOMEM, or -errno when the thread cannot start. */
int kvt_srv_sched_create(kvt_model *m, const kvt_tokenizer *tok, kvt_service *svc, kvt_srv_metrics *metrics,
                         const kvt_srv_sched_opts *o, kvt_srv_sched **out);

/** Queues a job (the scheduler takes its own reference).
 * @return 0; KVT_EAGAIN when max_queue jobs already wait beyond the free
 *   running slots (max_running minus the jobs running) (answer 429);
 *   KVT_ECLOSED after kvt_srv_sched_drain began (answer 503). */
int kvt_srv_sched_submit(kvt_srv_sched *s, kvt_srv_job *j);

/** Jobs waiting and running now. */
void kvt_srv_sched_gauges(kvt_srv_sched *s, int64_t *queued, int64_t *running);

/** Stops taking jobs (submit answers KVT_ECLOSED), lets the queued and
 * running ones finish for up to timeout_ms milliseconds, then cancels the
 * rest (they end with status 503) and waits for the engine to let them go.
 * @return how many jobs were cancelled. */
int64_t kvt_srv_sched_drain(kvt_srv_sched *s, int64_t timeout_ms);

/** Drains with timeout 0 if needed, stops and joins the engine thread, frees.
 * NULL is a no-op. */
void kvt_srv_sched_destroy(kvt_srv_sched *s);

#ifdef __cplusplus
}
#endif
#endif /* KVT_SERVER_SCHEDULER_H */
