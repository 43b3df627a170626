/*
 * sched_stats.c: the engine thread's figures (kvt_srv_sched_stats,
 * scheduler.h) rendered for /stats (JSON) and /metrics (Prometheus text):
 * the decode batch-size histogram, steps with prefill mixed in, and where
 * the engine thread's time goes; in /metrics one series per model (each
 * model has its own engine thread). Pure functions of a snapshot: no locks.
 */
#include "scheduler.h"

#include <stddef.h>
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

/* The start of one model's series of `fam`: kvtier_FAM{model="ID" (the
 * caller adds its other labels, the closing brace and the value). */
static void series(FILE *f, const char *fam, const char *id)
{
    char esc[64];
    fprintf(f, "kvtier_%s{model=\"", fam);
    while (*id) {
        id += kvt_srv_prom_escape(id, esc, sizeof esc);
        fputs(esc, f);
    }
    fputc('"', f);
}

/* One family with one series per model: the uint64 at byte offset `off` of
 * each model's stats, in seconds when `ns` (a count of nanoseconds). */
static void family(FILE *f, const kvt_srv_model_engine *mv, int n, const char *fam, const char *type,
                   const char *help, size_t off, int ns)
{
    fprintf(f, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\n", fam, help, fam, type);
    for (int i = 0; i < n; i++) {
        uint64_t v = *(const uint64_t *)((const char *)&mv[i].st + off);
        series(f, fam, mv[i].id);
        if (ns)
            fprintf(f, "} %.9f\n", (double)v / 1e9);
        else
            fprintf(f, "} %llu\n", (unsigned long long)v);
    }
}

static uint64_t nonneg(int64_t v) { return v > 0 ? (uint64_t)v : 0; }

int kvt_srv_sched_stats_prometheus(char **text, const kvt_srv_model_engine *mv, int n)
{
    if (n <= 0)
        return 0;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return -1;
    fprintf(f, "# HELP kvtier_queue_depth Requests waiting for admission under the KV budget.\n"
               "# TYPE kvtier_queue_depth gauge\n");
    for (int i = 0; i < n; i++) {
        series(f, "queue_depth", mv[i].id);
        fprintf(f, "} %llu\n", (unsigned long long)nonneg(mv[i].queue_depth));
    }
    fprintf(f, "# HELP kvtier_running_requests Requests admitted: prefilling or decoding.\n"
               "# TYPE kvtier_running_requests gauge\n");
    for (int i = 0; i < n; i++) {
        series(f, "running_requests", mv[i].id);
        fprintf(f, "} %llu\n", (unsigned long long)nonneg(mv[i].running));
    }
    fprintf(f, "# HELP kvtier_decode_batch_size sequences decoded together in one batched decode step\n"
               "# TYPE kvtier_decode_batch_size histogram\n");
    for (int m = 0; m < n; m++) {
        const kvt_srv_sched_stats *st = &mv[m].st;
        uint64_t cum = 0;
        for (int i = 0; i <= KVT_SRV_BATCH_BUCKETS; i++) {
            cum += st->batch_buckets[i];
            series(f, "decode_batch_size_bucket", mv[m].id);
            if (i < KVT_SRV_BATCH_BUCKETS)
                fprintf(f, ",le=\"%d\"} %llu\n", kvt_srv_batch_bounds[i], (unsigned long long)cum);
            else
                fprintf(f, ",le=\"+Inf\"} %llu\n", (unsigned long long)cum);
        }
        series(f, "decode_batch_size_sum", mv[m].id);
        fprintf(f, "} %llu\n", (unsigned long long)st->batch_sequences);
        series(f, "decode_batch_size_count", mv[m].id);
        fprintf(f, "} %llu\n", (unsigned long long)st->decode_steps);
    }
#define KVT__ENG(fam, type, help, field, ns) family(f, mv, n, fam, type, help, offsetof(kvt_srv_sched_stats, field), ns)
    KVT__ENG("decode_steps_total", "counter", "batched decode steps run by the engine.", decode_steps, 0);
    KVT__ENG("decode_batch_sequences_total", "counter",
             "sequences decoded, summed over the batched steps (mean batch = this / steps).", batch_sequences, 0);
    KVT__ENG("engine_steps_total", "counter", "engine steps that ran at least one forward pass", steps, 0);
    KVT__ENG("engine_mixed_steps_total", "counter", "batched decode steps that also ran prompt tokens", mixed_steps,
             0);
    KVT__ENG("engine_prefill_passes_total", "counter", "forward passes that ran prompt tokens", prefill_passes, 0);
    KVT__ENG("engine_prefill_tokens_total", "counter", "prompt tokens run by those passes", prefill_tokens, 0);
    KVT__ENG("engine_joined_total", "counter", "sequences that began decoding while others already decoded", joined,
             0);
    KVT__ENG("engine_left_early_total", "counter", "sequences that ended while others kept decoding", left_early, 0);
    fprintf(f, "# HELP kvtier_engine_phase_seconds_total engine-thread time by step phase\n"
               "# TYPE kvtier_engine_phase_seconds_total counter\n");
    for (int m = 0; m < n; m++)
        for (int i = 0; i < KVT_SRV_PHASE_COUNT; i++) {
            series(f, "engine_phase_seconds_total", mv[m].id);
            fprintf(f, ",phase=\"%s\"} %.9f\n", phase_name[i], (double)mv[m].st.phase_ns[i] / 1e9);
        }
    KVT__ENG("engine_step_seconds_total", "counter", "engine-thread time inside steps (the phases sum to it)", step_ns,
             1);
    KVT__ENG("sse_events_total", "counter", "streamed events built by the connection threads", sse_events, 0);
    KVT__ENG("sse_build_seconds_total", "counter", "connection-thread time spent building streamed events",
             sse_build_ns, 1);
    KVT__ENG("sse_lag_seconds_total", "counter",
             "summed delay from reply text becoming sendable to its event being handed to the HTTP library",
             sse_lag_ns, 1);
#undef KVT__ENG
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
