/*
 * metrics.c: the server's counters, histograms and request ring
 * (metrics.h), and their two renderings: Prometheus text and the /stats
 * JSON object. One mutex guards everything here; nothing is called under it.
 */
#include "metrics.h"

#include <pthread.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double kvt_srv_ttft_bounds[KVT_SRV_TTFT_BUCKETS] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                                          0.25,  0.5,   0.75, 1.0,  2.5,  5.0,  7.5,  10.0,
                                                          20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const double kvt_srv_e2e_bounds[KVT_SRV_E2E_BUCKETS] = {0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,
                                                        5.0,  10.0, 15.0, 20.0,  30.0,  40.0,  50.0,
                                                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

static const int statuses[] = {200, 400, 401, 404, 405, 413, 429, 500, 503};
#define N_STATUS ((int)(sizeof statuses / sizeof statuses[0]) + 1) /* last: any other */

static const char *const ep_path[KVT_EP_COUNT] = {
#define KVT__EP_PATH(name, path) path,
    KVT_SRV_ENDPOINTS(KVT__EP_PATH)
#undef KVT__EP_PATH
};

typedef struct {
    uint64_t bucket[KVT_SRV_E2E_BUCKETS > KVT_SRV_TTFT_BUCKETS ? KVT_SRV_E2E_BUCKETS : KVT_SRV_TTFT_BUCKETS];
    uint64_t count;
    double sum;
} histogram;

struct kvt_srv_metrics {
    pthread_mutex_t mu;
    uint64_t requests[KVT_EP_COUNT][N_STATUS];
    kvt_srv_counters c;
    histogram ttft, e2e;
    kvt_srv_record ring[KVT_SRV_RECORDS];
    uint64_t next_seq;        /* seq of the next record; ring holds (next_seq - KVT_SRV_RECORDS, next_seq) */
};

kvt_srv_metrics *kvt_srv_metrics_create(void)
{
    kvt_srv_metrics *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    pthread_mutex_init(&m->mu, NULL);
    m->next_seq = 1;
    return m;
}

void kvt_srv_metrics_destroy(kvt_srv_metrics *m)
{
    if (!m)
        return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static int status_index(int status)
{
    for (int i = 0; i < N_STATUS - 1; i++)
        if (statuses[i] == status)
            return i;
    return N_STATUS - 1;
}

void kvt_srv_metrics_request(kvt_srv_metrics *m, kvt_srv_endpoint ep, int status)
{
    if ((unsigned)ep >= KVT_EP_COUNT)
        ep = KVT_EP_OTHER;
    pthread_mutex_lock(&m->mu);
    m->requests[ep][status_index(status)]++;
    pthread_mutex_unlock(&m->mu);
}

void kvt_srv_metrics_add(kvt_srv_metrics *m, size_t field_offset, uint64_t n)
{
    if (field_offset + sizeof(uint64_t) > sizeof(kvt_srv_counters))
        return;
    pthread_mutex_lock(&m->mu);
    *(uint64_t *)((char *)&m->c + field_offset) += n;
    pthread_mutex_unlock(&m->mu);
}

static void observe(histogram *h, const double *bounds, int n, double v)
{
    for (int i = 0; i < n; i++)
        if (v <= bounds[i])
            h->bucket[i]++;
    h->count++;
    h->sum += v;
}

static uint64_t pos(int64_t v) { return v > 0 ? (uint64_t)v : 0; }

void kvt_srv_metrics_finish(kvt_srv_metrics *m, const kvt_srv_record *rec)
{
    pthread_mutex_lock(&m->mu);
    m->c.completions++;
    if (rec->status == 200)
        m->c.completions_ok++;
    m->c.prompt_tokens += pos(rec->prompt_tokens);
    m->c.generation_tokens += pos(rec->completion_tokens);
    if (rec->status == 200 || rec->ttft_ms >= 0) {
        m->c.prefix_cache_queries += pos(rec->prompt_tokens);
        m->c.prefix_cache_hits +=
            pos(rec->reused_ram + rec->reused_ssd + rec->reused_remote + rec->reused_published);
    }
    m->c.cached_tokens_ram += pos(rec->reused_ram);
    m->c.cached_tokens_ssd += pos(rec->reused_ssd);
    m->c.cached_tokens_remote += pos(rec->reused_remote);
    m->c.cached_tokens_published += pos(rec->reused_published);
    m->c.prefilled_tokens += pos(rec->prefilled_tokens);
    if (rec->ttft_ms >= 0)
        observe(&m->ttft, kvt_srv_ttft_bounds, KVT_SRV_TTFT_BUCKETS, rec->ttft_ms / 1000.0);
    observe(&m->e2e, kvt_srv_e2e_bounds, KVT_SRV_E2E_BUCKETS, rec->e2e_ms / 1000.0);
    kvt_srv_record *slot = &m->ring[m->next_seq % KVT_SRV_RECORDS];
    *slot = *rec;
    slot->seq = m->next_seq++;
    pthread_mutex_unlock(&m->mu);
}

void kvt_srv_metrics_counters(kvt_srv_metrics *m, kvt_srv_counters *out)
{
    pthread_mutex_lock(&m->mu);
    *out = m->c;
    pthread_mutex_unlock(&m->mu);
}

size_t kvt_srv_metrics_records(kvt_srv_metrics *m, uint64_t after_seq, kvt_srv_record *out, size_t cap)
{
    pthread_mutex_lock(&m->mu);
    uint64_t first = m->next_seq > KVT_SRV_RECORDS ? m->next_seq - KVT_SRV_RECORDS : 1;
    if (after_seq + 1 > first)
        first = after_seq + 1;
    size_t n = 0;
    for (uint64_t s = first; s < m->next_seq && n < cap; s++)
        out[n++] = m->ring[s % KVT_SRV_RECORDS];
    pthread_mutex_unlock(&m->mu);
    return n;
}

/* ---- Prometheus text ------------------------------------------------------------------ */

typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t nc = b->cap ? b->cap * 2 : 8192;
        while (nc < b->n + (size_t)k + 1)
            nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = nc;
    }
}

static void head(sbuf *b, const char *name, const char *type, const char *help)
{
    sb_printf(b, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\n", name, help, name, type);
}

static void one(sbuf *b, const char *name, const char *type, const char *help, uint64_t v)
{
    head(b, name, type, help);
    sb_printf(b, "kvtier_%s %llu\n", name, (unsigned long long)v);
}

static void hist(sbuf *b, const char *name, const char *help, const histogram *h, const double *bounds, int n)
{
    head(b, name, "histogram", help);
    for (int i = 0; i < n; i++)
        sb_printf(b, "kvtier_%s_bucket{le=\"%g\"} %llu\n", name, bounds[i], (unsigned long long)h->bucket[i]);
    sb_printf(b, "kvtier_%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)h->count);
    sb_printf(b, "kvtier_%s_sum %.6f\nkvtier_%s_count %llu\n", name, h->sum, name, (unsigned long long)h->count);
}

size_t kvt_srv_prom_escape(const char *v, char *out, size_t cap)
{
    size_t used = 0, n = 0;
    for (; cap >= 3 && v[n] && used + 3 <= cap; n++) {
        char c = v[n];
        if (c == '\\' || c == '"' || c == '\n') {
            out[used++] = '\\';
            out[used++] = c == '\n' ? 'n' : c;
        } else
            out[used++] = c;
    }
    if (cap)
        out[used] = '\0';
    return n;
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static void sb_label(sbuf *b, const char *v)
{
    char esc[128];
    while (*v) {
        v += kvt_srv_prom_escape(v, esc, sizeof esc);
        sb_printf(b, "%s", esc);
    }
}

/* The start of one model's series: kvtier_FAM{model="ID" (the caller adds
 * its other labels, the closing brace and the value). */
static void series(sbuf *b, const char *fam, const char *model)
{
    sb_printf(b, "kvtier_%s{model=\"", fam);
    sb_label(b, model);
    sb_printf(b, "\"");
}

/* Which part of a model's figures a family reads. */
typedef enum { PART_REP, PART_SSD, PART_REMOTE } fig_part;

static int has_part(const kvt_srv_model_figures *f, fig_part p)
{
    return p == PART_REP ? f->have_rep : p == PART_SSD ? f->have_ssd : f->have_remote;
}

static int any_part(const kvt_srv_model_figures *mf, int n, fig_part p)
{
    for (int i = 0; i < n; i++)
        if (has_part(&mf[i], p))
            return 1;
    return 0;
}

/* One family with one series per model that has part p: the uint64 at
 * byte offset `off` of each model's figures, divided by `div` when it is
 * not 0 (milliseconds or nanoseconds given as seconds). No lines at all
 * when no model has the part. */
static void model_family(sbuf *b, const kvt_srv_model_figures *mf, int n, fig_part p, const char *fam,
                         const char *type, const char *help, size_t off, double div)
{
    if (!any_part(mf, n, p))
        return;
    head(b, fam, type, help);
    for (int i = 0; i < n; i++) {
        if (!has_part(&mf[i], p))
            continue;
        uint64_t v = *(const uint64_t *)((const char *)&mf[i] + off);
        series(b, fam, mf[i].id);
        if (div > 0)
            sb_printf(b, "} %.9g\n", (double)v / div);
        else
            sb_printf(b, "} %llu\n", (unsigned long long)v);
    }
}

/* The tier_* gauges: RAM from the report, SSD from the store. */
static void tier_family(sbuf *b, const kvt_srv_model_figures *mf, int n, const char *fam, const char *help,
                        size_t rep_off, size_t ss_off)
{
    head(b, fam, "gauge", help);
    for (int i = 0; i < n; i++) {
        const kvt_srv_model_figures *f = &mf[i];
        if (!f->have_rep)
            continue;
        series(b, fam, f->id);
        sb_printf(b, ",tier=\"ram\"} %llu\n", (unsigned long long)*(const uint64_t *)((const char *)f + rep_off));
        if (f->have_ssd) {
            series(b, fam, f->id);
            sb_printf(b, ",tier=\"ssd\"} %llu\n", (unsigned long long)*(const uint64_t *)((const char *)f + ss_off));
        }
    }
}

/* Every model's service, tier, SSD, remote and per-layer families, each
 * series labelled by model. */
static void model_lines(sbuf *b, const kvt_srv_model_figures *mf, int n)
{
    if (any_part(mf, n, PART_REP)) {
        tier_family(b, mf, n, "tier_bytes", "Bytes a tier holds.", offsetof(kvt_srv_model_figures, rep.bytes),
                    offsetof(kvt_srv_model_figures, ss.bytes));
        tier_family(b, mf, n, "tier_max_bytes", "A tier's byte budget (0: unlimited).",
                    offsetof(kvt_srv_model_figures, rep.max_bytes), offsetof(kvt_srv_model_figures, ss.max_bytes));
        tier_family(b, mf, n, "tier_entries", "Entries (prefix states) a tier holds.",
                    offsetof(kvt_srv_model_figures, rep.entries), offsetof(kvt_srv_model_figures, ss.entries));
    }
    /* every prompt cache counter, from its one list (its gauges are the tier_* lines) */
#define KVT__PC_PROM(type, name, kind, help)                                                       \
    if (!strcmp(#kind, "counter"))                                                                 \
        model_family(b, mf, n, PART_REP, "prompt_cache_" #name "_total", "counter", help ".",          \
                     offsetof(kvt_srv_model_figures, rep.name), 0);
    KVT_PROMPT_CACHE_COUNTERS(KVT__PC_PROM)
#undef KVT__PC_PROM
    model_family(b, mf, n, PART_REP, "kv_projected_bytes", "gauge", "Projected KV bytes of the admitted requests.",
                 offsetof(kvt_srv_model_figures, rep.kv_projected_bytes), 0);
    model_family(b, mf, n, PART_REP, "kv_budget_bytes", "gauge",
                 "KV byte budget requests are admitted under (0: unlimited).",
                 offsetof(kvt_srv_model_figures, rep.kv_budget_bytes), 0);
    model_family(b, mf, n, PART_REP, "admission_rejected_total", "counter", "Requests that can never fit the limits.",
                 offsetof(kvt_srv_model_figures, rep.rejected), 0);
    /* the bounded live-cache counters (docs/residency.md), from the service's
     * one list; a counter of milliseconds in seconds */
#define KVT__LIVE_PROM(name, group, key, kind, help)                                               \
    if (!strncmp(#name, "live_", 5)) {                                                             \
        int ms = !strcmp(#name, "live_page_stall_ms");                                             \
        model_family(b, mf, n, PART_REP, ms ? "live_page_stall_seconds_total" : #name "_total", "counter", \
                     ms ? "Time attention waited for live-cache blocks being read." : help ".",    \
                     offsetof(kvt_srv_model_figures, rep.name), ms ? 1000.0 : 0);                  \
    }
    KVT_SERVICE_COUNTERS(KVT__LIVE_PROM)
#undef KVT__LIVE_PROM
    /* each cold tier level's counters, from the tiers' one list, labelled
     * by model, level and name */
    int any_tiers = 0;
    for (int i = 0; i < n; i++)
        any_tiers |= mf[i].n_tiers > 0;
#define KVT__TIER_PROM(fld, kind, help)                                                           \
    if (any_tiers) {                                                                               \
        int counter = !strcmp(#kind, "counter");                                                   \
        char nm[64];                                                                               \
        snprintf(nm, sizeof nm, "tier_level_%s%s", #fld, counter ? "_total" : "");                \
        head(b, nm, #kind, "Tier level: " help ".");                                               \
        for (int i = 0; i < n; i++)                                                                \
            for (int32_t l = 0; l < mf[i].n_tiers && l < KVT_TIER_CHAIN_MAX; l++) {                \
                series(b, nm, mf[i].id);                                                           \
                sb_printf(b, ",level=\"%d\",tier=\"%s\"} %llu\n", (int)l, mf[i].tiers[l].name,        \
                          (unsigned long long)mf[i].tiers[l].st.fld);                              \
            }                                                                                      \
    }
    KVT_TIER_COUNTERS(KVT__TIER_PROM)
#undef KVT__TIER_PROM
    /* every SSD store counter, from its one list (kvtier_ssd_<metric>), and
     * its refusals by reason */
#define KVT__STORE_PROM(type, name, kind, metric, help)                                            \
    {                                                                                              \
        const char *mname = #metric;                                                               \
        size_t len = strlen(mname);                                                                \
        int ns = len > 3 && !strcmp(mname + len - 3, "_ns");                                       \
        char nm[96];                                                                               \
        snprintf(nm, sizeof nm, "ssd_%.*s%s%s", (int)(ns ? len - 3 : len), mname, ns ? "_seconds" : "", \
                 !strcmp(#kind, "counter") ? "_total" : "");                                       \
        model_family(b, mf, n, PART_SSD, nm, #kind, "SSD tier: " help ".",                         \
                     offsetof(kvt_srv_model_figures, ss.name), ns ? 1e9 : 0);                      \
    }
    KVT_STORE_COUNTERS(KVT__STORE_PROM)
#undef KVT__STORE_PROM
    if (any_part(mf, n, PART_SSD)) {
        head(b, "ssd_refused_total", "counter", "SSD tier: shards refused, by reason.");
        for (int i = 0; i < n; i++)
            for (int r = 0; mf[i].have_ssd && r < KVT_STORE_REFUSED_COUNT; r++) {
                series(b, "ssd_refused_total", mf[i].id);
                sb_printf(b, ",reason=\"%s\"} %llu\n", kvt_store_refusal_name((kvt_store_refusal)r),
                          (unsigned long long)mf[i].ss.refused[r]);
            }
    }
    /* every remote counter, from its one list; a counter of milliseconds
     * (NAME_ms) in seconds, as Prometheus base units want */
#define KVT__REMOTE_PROM(field, kind, help)                                                        \
    {                                                                                              \
        const char *fname = #field;                                                                \
        size_t len = strlen(fname);                                                                \
        int ms = len > 3 && !strcmp(fname + len - 3, "_ms");                                       \
        char nm[96];                                                                               \
        snprintf(nm, sizeof nm, "remote_%.*s%s", (int)(ms ? len - 3 : len), fname,                 \
                 ms ? "_seconds_total" : !strcmp(#kind, "counter") ? "_total" : "");               \
        model_family(b, mf, n, PART_REMOTE, nm, #kind, "Remote tier: " help ".",                  \
                     offsetof(kvt_srv_model_figures, rs.field), ms ? 1000.0 : 0);                  \
    }
    KVT_REMOTE_COUNTERS(KVT__REMOTE_PROM)
#undef KVT__REMOTE_PROM
    /* one family per field of the per-layer list, labelled by model and
     * layer (at most KVT_LAYER_REPORT_LIMIT + 1 layer values a model: the
     * overflow group is one) */
    int any_layers = 0;
    for (int i = 0; i < n; i++)
        any_layers |= mf[i].n_layers > 0;
#define KVT__LAYER_PROM(name, kind, help)                                                          \
    if (any_layers) {                                                                              \
        const char *fam = !strcmp(#kind, "counter") ? "layer_" #name "_total" : "layer_" #name;   \
        head(b, fam, #kind, "Per-layer residency: " help ".");                                    \
        for (int i = 0; i < n; i++)                                                                \
            for (int32_t l = 0; l < mf[i].n_layers && l <= KVT_LAYER_REPORT_LIMIT; l++) {          \
                const kvt_layer_stats *g = &mf[i].layers[l];                                       \
                series(b, fam, mf[i].id);                                                          \
                if (g->first_layer == g->last_layer)                                               \
                    sb_printf(b, ",layer=\"%d\"} %llu\n", (int)g->first_layer,                     \
                              (unsigned long long)g->name);                                        \
                else                                                                               \
                    sb_printf(b, ",layer=\"%d-%d\"} %llu\n", (int)g->first_layer, (int)g->last_layer, \
                              (unsigned long long)g->name);                                        \
            }                                                                                      \
    }
    KVT_LAYER_COUNTERS(KVT__LAYER_PROM)
#undef KVT__LAYER_PROM
}

/* The process-wide pool's lines: members, and for every field of the one
 * list a family by axis for the whole pool and one by member and axis. */
static void pool_lines(sbuf *b, kvt_pool *pool)
{
    kvt_pool_report r;
    char *js = NULL;
    json_t *doc = NULL;
    if (pool && kvt_pool_report_get(pool, &r) == 0 && kvt_pool_report_json(pool, &js) == 0)
        doc = json_loads(js, 0, NULL);
    kvt_string_free(js);
    if (!doc)
        return;
    one(b, "pool_members", "gauge", "Managers joined to the process-wide pool.", r.members);
    json_t *members = json_object_get(doc, "member_list");
    /* members are the process's services and roots: bounded by its configuration */
#define KVT__POOL_PROM(name, kind, help)                                                               \
    head(b, !strcmp(#kind, "counter") ? "pool_" #name "_total" : "pool_" #name "_bytes", #kind,         \
         "Process-wide pool: " help ".");                                                              \
    for (int a = 0; a < KVT_POOL_AXES; a++)                                                            \
        sb_printf(b, "kvtier_pool_%s{axis=\"%s\"} %llu\n",                                              \
                  !strcmp(#kind, "counter") ? #name "_total" : #name "_bytes",                         \
                  kvt_pool_axis_name((kvt_pool_axis)a), (unsigned long long)r.axis[a].name);           \
    if (strcmp(#name, "limit")) {                                                                      \
        head(b, !strcmp(#kind, "counter") ? "pool_member_" #name "_total" : "pool_member_" #name "_bytes", \
             #kind, "One pool member: " help ".");                                                     \
        size_t i;                                                                                      \
        json_t *m;                                                                                     \
        json_array_foreach(members, i, m)                                                              \
        {                                                                                              \
            for (int a = 0; a < KVT_POOL_AXES; a++) {                                                  \
                const char *ax = kvt_pool_axis_name((kvt_pool_axis)a);                                 \
                json_t *x = json_object_get(json_object_get(json_object_get(m, "axes"), ax), #name);    \
                sb_printf(b, "kvtier_pool_member_%s{member=\"",                                         \
                          !strcmp(#kind, "counter") ? #name "_total" : #name "_bytes");                \
                sb_label(b, json_string_value(json_object_get(m, "name")));                             \
                sb_printf(b, "\",axis=\"%s\"} %llu\n", ax, (unsigned long long)json_integer_value(x));    \
            }                                                                                          \
        }                                                                                              \
    }
    KVT_POOL_USAGE_FIELDS(KVT__POOL_PROM)
#undef KVT__POOL_PROM
    json_decref(doc);
}

/* The I/O worker's families: one per KVT_IO_WORKER_COUNTERS entry
 * (kvtier_io_worker_*, worker-wide) and one per KVT_IO_KIND_COUNTERS entry,
 * by kind. */
static void io_lines(sbuf *b, const kvt_io_stats *io)
{
#define KVT__IO_WPROM(field, kind, help)                                                           \
    {                                                                                              \
        int ctr = !strcmp(#kind, "counter");                                                       \
        char name[64];                                                                             \
        snprintf(name, sizeof name, "io_worker_%s%s", #field, ctr ? "_total" : "");               \
        head(b, name, #kind, "I/O worker, all kinds: " help ".");                                 \
        sb_printf(b, "kvtier_%s %llu\n", name, (unsigned long long)io->field);                     \
    }
    KVT_IO_WORKER_COUNTERS(KVT__IO_WPROM)
#undef KVT__IO_WPROM
#define KVT__IO_PROM(field, kind, help)                                                            \
    {                                                                                              \
        int ctr = !strcmp(#kind, "counter");                                                       \
        char name[64];                                                                             \
        snprintf(name, sizeof name, "io_%s%s", #field, ctr ? "_total" : "");                      \
        head(b, name, #kind, "I/O worker: " help ", by kind.");                                    \
        for (int k = 0; k < KVT_IO_KINDS; k++)                                                     \
            sb_printf(b, "kvtier_%s{kind=\"%s\"} %llu\n", name, kvt_io_kind_name((kvt_io_kind)k),    \
                      (unsigned long long)io->by_kind[k].field);                                   \
    }
    KVT_IO_KIND_COUNTERS(KVT__IO_PROM)
#undef KVT__IO_PROM
}

int kvt_srv_metrics_prometheus(kvt_srv_metrics *m, const kvt_srv_gauges *g, const kvt_srv_model_figures *models,
                               int n_models, kvt_pool *pool, const kvt_io_stats *io, char **out)
{
    *out = NULL;
    pthread_mutex_lock(&m->mu);
    uint64_t req[KVT_EP_COUNT][N_STATUS];
    memcpy(req, m->requests, sizeof req);
    kvt_srv_counters c = m->c;
    histogram ttft = m->ttft, e2e = m->e2e;
    pthread_mutex_unlock(&m->mu);

    sbuf b = {0};
    head(&b, "requests_total", "counter", "HTTP requests answered, by endpoint and status.");
    for (int e = 0; e < KVT_EP_COUNT; e++)
        for (int s = 0; s < N_STATUS; s++)
            if (req[e][s])
                sb_printf(&b, "kvtier_requests_total{endpoint=\"%s\",status=\"%s%d\"} %llu\n", ep_path[e],
                          s == N_STATUS - 1 ? "other" : "", s == N_STATUS - 1 ? 0 : statuses[s],
                          (unsigned long long)req[e][s]);
    /* every counter but the per-tier pair, which is one labelled family,
     * and the decode steps, which are each model's engine thread's (one
     * series per model: kvt_srv_sched_stats_prometheus) */
#define KVT__CTR_PROM(name, help)                                                                  \
    if (strncmp(#name, "cached_tokens_", 14) && strncmp(#name, "decode_", 7)) {                    \
        head(&b, #name "_total", "counter", help ".");                                             \
        sb_printf(&b, "kvtier_" #name "_total %llu\n", (unsigned long long)c.name);                \
    }
    KVT_SRV_COUNTERS(KVT__CTR_PROM)
#undef KVT__CTR_PROM
    head(&b, "cached_tokens_total", "counter", "Prompt tokens reused from the prefix cache, by the tier that held them.");
    /* the tier is the name past "cached_tokens_" (through a pointer: clang's
     * -Wstring-plus-int refuses an offset into a string literal) */
#define KVT__CACHED_PROM(name, help)                                                               \
    {                                                                                              \
        const char *ctr = #name;                                                                   \
        if (!strncmp(ctr, "cached_tokens_", 14))                                                   \
            sb_printf(&b, "kvtier_cached_tokens_total{tier=\"%s\"} %llu\n", ctr + 14,             \
                      (unsigned long long)c.name);                                                 \
    }
    KVT_SRV_COUNTERS(KVT__CACHED_PROM)
#undef KVT__CACHED_PROM
    hist(&b, "time_to_first_token_seconds", "Time from a request's arrival to its first generated token.", &ttft,
         kvt_srv_ttft_bounds, KVT_SRV_TTFT_BUCKETS);
    hist(&b, "e2e_request_latency_seconds", "Time from a request's arrival to its end.", &e2e, kvt_srv_e2e_bounds,
         KVT_SRV_E2E_BUCKETS);
    one(&b, "open_connections", "gauge", "Open HTTP connections.", pos(g->connections));
    one(&b, "ready", "gauge", "1 once the model is loaded and requests are served.", (uint64_t)g->ready);
    if (models && n_models > 0)
        model_lines(&b, models, n_models);
    if (io)
        io_lines(&b, io);
    pool_lines(&b, pool);
    if (b.oom || !b.p) {
        free(b.p);
        return -1;
    }
    *out = b.p;
    return 0;
}

/* ---- JSON ------------------------------------------------------------------------------ */

static const char *ep_name(kvt_srv_endpoint e) { return (unsigned)e < KVT_EP_COUNT ? ep_path[e] : "other"; }

json_t *kvt_srv_record_json(const kvt_srv_record *r)
{
    return json_pack("{s:I, s:I, s:s, s:s, s:s, s:I, s:I, s:{s:I, s:I, s:I, s:I}, s:I, s:f, s:f, s:f, s:i}", "seq",
                     (json_int_t)r->seq, "time_ms", (json_int_t)r->time_ms, "endpoint", ep_name(r->endpoint),
                     "model", r->model, "ns", r->ns, "prompt_tokens", (json_int_t)r->prompt_tokens,
                     "completion_tokens", (json_int_t)r->completion_tokens, "reused_tokens", "ram",
                     (json_int_t)r->reused_ram, "ssd", (json_int_t)r->reused_ssd, "remote",
                     (json_int_t)r->reused_remote, "published", (json_int_t)r->reused_published, "prefilled_tokens",
                     (json_int_t)r->prefilled_tokens, "queue_ms", r->queue_ms, "ttft_ms", r->ttft_ms, "e2e_ms",
                     r->e2e_ms, "status", r->status);
}

json_t *kvt_srv_metrics_json(kvt_srv_metrics *m, const kvt_srv_gauges *g, size_t recent)
{
    pthread_mutex_lock(&m->mu);
    uint64_t req[KVT_EP_COUNT][N_STATUS];
    memcpy(req, m->requests, sizeof req);
    kvt_srv_counters c = m->c;
    pthread_mutex_unlock(&m->mu);
    json_t *doc = json_object(), *by = json_object(), *ctr = json_object(), *rec = json_array();
    if (!doc || !by || !ctr || !rec) {
        json_decref(doc);
        json_decref(by);
        json_decref(ctr);
        json_decref(rec);
        return NULL;
    }
    uint64_t total = 0;
    for (int e = 0; e < KVT_EP_COUNT; e++) {
        json_t *st = NULL;
        for (int s = 0; s < N_STATUS; s++) {
            if (!req[e][s])
                continue;
            if (!st)
                st = json_object();
            char k[16];
            if (s == N_STATUS - 1)
                snprintf(k, sizeof k, "other");
            else
                snprintf(k, sizeof k, "%d", statuses[s]);
            json_object_set_new(st, k, json_integer((json_int_t)req[e][s]));
            total += req[e][s];
        }
        if (st)
            json_object_set_new(by, ep_path[e], st);
    }
#define KVT__CTR_JSON(name, help) json_object_set_new(ctr, #name, json_integer((json_int_t)c.name));
    KVT_SRV_COUNTERS(KVT__CTR_JSON)
#undef KVT__CTR_JSON
    kvt_srv_record *buf = recent ? calloc(recent, sizeof *buf) : NULL;
    if (buf) {
        uint64_t after = 0;
        pthread_mutex_lock(&m->mu);
        if (m->next_seq - 1 > recent)
            after = m->next_seq - 1 - recent;
        pthread_mutex_unlock(&m->mu);
        size_t n = kvt_srv_metrics_records(m, after, buf, recent);
        for (size_t i = 0; i < n; i++)
            json_array_append_new(rec, kvt_srv_record_json(&buf[i]));
        free(buf);
    }
    json_object_set_new(doc, "requests_total", json_integer((json_int_t)total));
    json_object_set_new(doc, "requests", by);
    json_object_set_new(doc, "counters", ctr);
    json_object_set_new(doc, "queue_depth", json_integer(g->queue_depth));
    json_object_set_new(doc, "running", json_integer(g->running));
    json_object_set_new(doc, "connections", json_integer(g->connections));
    json_object_set_new(doc, "ready", json_boolean(g->ready));
    json_object_set_new(doc, "recent", rec);
    return doc;
}
