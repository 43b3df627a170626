/*
 * sched_stats.c: the engine thread's figures (kvt_srv_sched_stats,
 * scheduler.h) rendered for /stats (JSON) and /metrics (Prometheus text):
 * the decode batch-size histogram, steps with prefill mixed in, and where
 * the engine thread's time goes. Pure functions of a snapshot: no locks.
 */
#include "scheduler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const int kvt_srv_batch_bounds[KVT_SRV_BATCH_BUCKETS] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64};

static const char *const phase_name[KVT_SRV_PHASE_COUNT] = {
#define KVT__PHASE_NAME(name, help) #name,
    KVT_SRV_PHASES(KVT__PHASE_NAME)
#undef KVT__PHASE_NAME
};

void kvt_srv_sched_stats_add(kvt_srv_sched_stats *a, const kvt_srv_sched_stats *b)
{
    a->steps += b->steps;
    a->decode_steps += b->decode_steps;
    a->mixed_steps += b->mixed_steps;
    a->prefill_passes += b->prefill_passes;
    a->prefill_tokens += b->prefill_tokens;
    a->batch_sequences += b->batch_sequences;
    for (int i = 0; i <= KVT_SRV_BATCH_BUCKETS; i++) {
        a->batch_buckets[i] += b->batch_buckets[i];
        a->batch_step_ns[i] += b->batch_step_ns[i];
    }
    a->joined += b->joined;
    a->left_early += b->left_early;
    for (int i = 0; i < KVT_SRV_PHASE_COUNT; i++)
        a->phase_ns[i] += b->phase_ns[i];
    a->step_ns += b->step_ns;
    a->sse_events += b->sse_events;
    a->sse_build_ns += b->sse_build_ns;
    a->sse_lag_ns += b->sse_lag_ns;
}

json_t *kvt_srv_sched_stats_json(const kvt_srv_sched_stats *st)
{
    json_t *hist = json_array(), *phases = json_object();
    for (int i = 0; hist && i <= KVT_SRV_BATCH_BUCKETS; i++) {
        double sec = (double)st->batch_step_ns[i] / 1e9;
        json_t *b = i < KVT_SRV_BATCH_BUCKETS
                        ? json_pack("{s:i, s:I, s:f}", "le", kvt_srv_batch_bounds[i], "count",
                                    (json_int_t)st->batch_buckets[i], "seconds", sec)
                        : json_pack("{s:s, s:I, s:f}", "le", "+Inf", "count", (json_int_t)st->batch_buckets[i],
                                    "seconds", sec);
        json_array_append_new(hist, b);
    }
    for (int i = 0; phases && i < KVT_SRV_PHASE_COUNT; i++)
        json_object_set_new(phases, phase_name[i], json_real((double)st->phase_ns[i] / 1e9));
    return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:o*, s:I, s:I, s:o*, s:f, s:I, s:f, s:f}", "steps",
                     (json_int_t)st->steps, "decode_steps", (json_int_t)st->decode_steps, "mixed_steps",
                     (json_int_t)st->mixed_steps, "prefill_passes", (json_int_t)st->prefill_passes,
                     "prefill_tokens", (json_int_t)st->prefill_tokens, "batch_sequences",
                     (json_int_t)st->batch_sequences, "mean_batch",
                     st->decode_steps ? (double)st->batch_sequences / (double)st->decode_steps : 0.0,
                     "batch_size_histogram", hist, "joined", (json_int_t)st->joined, "left_early",
                     (json_int_t)st->left_early, "phase_seconds", phases, "step_seconds",
                     (double)st->step_ns / 1e9, "sse_events", (json_int_t)st->sse_events, "sse_build_seconds",
                     (double)st->sse_build_ns / 1e9, "sse_lag_seconds", (double)st->sse_lag_ns / 1e9);
}

static void counter(FILE *f, const char *name, const char *help, uint64_t v)
{
    fprintf(f, "# HELP kvtier_%s %s\n# TYPE kvtier_%s counter\nkvtier_%s %llu\n", name, help, name, name,
            (unsigned long long)v);
}

static void seconds(FILE *f, const char *name, const char *help, uint64_t ns)
{
    fprintf(f, "# HELP kvtier_%s %s\n# TYPE kvtier_%s counter\nkvtier_%s %.9f\n", name, help, name, name,
            (double)ns / 1e9);
}

int kvt_srv_sched_stats_prometheus(char **text, const kvt_srv_sched_stats *st)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return -1;
    fprintf(f, "# HELP kvtier_decode_batch_size sequences decoded together in one batched decode step\n"
               "# TYPE kvtier_decode_batch_size histogram\n");
    uint64_t cum = 0;
    for (int i = 0; i < KVT_SRV_BATCH_BUCKETS; i++) {
        cum += st->batch_buckets[i];
        fprintf(f, "kvtier_decode_batch_size_bucket{le=\"%d\"} %llu\n", kvt_srv_batch_bounds[i],
                (unsigned long long)cum);
    }
    cum += st->batch_buckets[KVT_SRV_BATCH_BUCKETS];
    fprintf(f, "kvtier_decode_batch_size_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    fprintf(f, "kvtier_decode_batch_size_sum %llu\nkvtier_decode_batch_size_count %llu\n",
            (unsigned long long)st->batch_sequences, (unsigned long long)st->decode_steps);
    counter(f, "engine_steps_total", "engine steps that ran at least one forward pass", st->steps);
    counter(f, "engine_mixed_steps_total", "batched decode steps that also ran prompt tokens", st->mixed_steps);
    counter(f, "engine_prefill_passes_total", "forward passes that ran prompt tokens", st->prefill_passes);
    counter(f, "engine_prefill_tokens_total", "prompt tokens run by those passes", st->prefill_tokens);
    counter(f, "engine_joined_total", "sequences that began decoding while others already decoded", st->joined);
    counter(f, "engine_left_early_total", "sequences that ended while others kept decoding", st->left_early);
    fprintf(f, "# HELP kvtier_engine_phase_seconds_total engine-thread time by step phase\n"
               "# TYPE kvtier_engine_phase_seconds_total counter\n");
    for (int i = 0; i < KVT_SRV_PHASE_COUNT; i++)
        fprintf(f, "kvtier_engine_phase_seconds_total{phase=\"%s\"} %.9f\n", phase_name[i],
                (double)st->phase_ns[i] / 1e9);
    seconds(f, "engine_step_seconds_total", "engine-thread time inside steps (the phases sum to it)", st->step_ns);
    counter(f, "sse_events_total", "streamed events built by the connection threads", st->sse_events);
    seconds(f, "sse_build_seconds_total", "connection-thread time spent building streamed events",
            st->sse_build_ns);
    seconds(f, "sse_lag_seconds_total", "summed delay from reply text becoming sendable to its event being handed "
            "to the HTTP library", st->sse_lag_ns);
    if (fclose(f) != 0) {
        free(buf);
        return -1;
    }
    size_t old = strlen(*text);
    char *p = realloc(*text, old + len + 1);
    if (!p) {
        free(buf);
        return -1;
    }
    memcpy(p + old, buf, len + 1);
    free(buf);
    *text = p;
    return 0;
}
