/*
 * telemetry.c: per-layer residency telemetry of a cache service
 * (telemetry.h). The forwarding cold-tier table counts, per layer, the
 * restores that bring state up and the writes that hand it down (bytes of
 * each layer's cache); at report time the prompt cache's RAM residency by
 * layer is walked and its entry counters (promotions, demotions,
 * evictions) are given to every layer, since every entry holds all of them.
 * The cold tiers' per-layer bytes are asked of each level (layer_bytes: the
 * SSD tier's index gives residency, the remote tier what this host wrote).
 * Layers past KVT_LAYER_REPORT_LIMIT are one overflow group, so the report
 * (and the /metrics label `layer`) stays bounded whatever the model.
 */
#include "telemetry.h"

#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

struct kvt__telemetry {
    pthread_mutex_t mu;     /* guards the four arrays */
    int32_t n_layers;
    uint64_t *restores, *restored_bytes, *written, *written_bytes; /* (n_layers) each */
    kvt_cold_tier real, shim;
    int has_cold;
    kvt_tier_chain *chain;  /* the chain real is the table of, or NULL */
};

int32_t kvt__telemetry_groups(int32_t n_layers)
{
    if (n_layers <= 0)
        return 0;
    return n_layers <= KVT_LAYER_REPORT_LIMIT ? n_layers : KVT_LAYER_REPORT_LIMIT + 1;
}

/* Adds one entry's layers to count[] and bytes[] (under t->mu). */
static void count_entry(kvt__telemetry *t, const kvt_entry *e, uint64_t *count, uint64_t *bytes)
{
    if (!e)
        return;
    pthread_mutex_lock(&t->mu);
    for (int32_t i = 0; i < e->n_caches && i < t->n_layers; i++) {
        if (!e->caches[i])
            continue;
        count[i]++;
        bytes[i] += kvt_cache_bytes(e->caches[i]);
    }
    pthread_mutex_unlock(&t->mu);
}

/* ---- the forwarding table ------------------------------------------------------- */

static int fw_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt__telemetry *t = self;
    return t->real.find(t->real.self, prompt, n, ns, out);
}

static int fw_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt__telemetry *t = self;
    return t->real.find_exact(t->real.self, tokens, n, ns, out);
}

static int fw_restore(void *self, uint64_t handle, kvt_entry *out)
{
    kvt__telemetry *t = self;
    int rc = t->real.restore(t->real.self, handle, out);
    if (rc == 0)
        count_entry(t, out, t->restores, t->restored_bytes);
    return rc;
}

typedef struct fw_async {
    kvt__telemetry *t;
    kvt_restore_done_fn done;
    void *arg;
} fw_async;

static void fw_async_done(void *arg, int status, kvt_entry *entry)
{
    fw_async a = *(fw_async *)arg;
    kvt__free(arg);
    if (status == 0)
        count_entry(a.t, entry, a.t->restores, a.t->restored_bytes);
    a.done(a.arg, status, entry);
}

static int fw_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    kvt__telemetry *t = self;
    fw_async *a = kvt__malloc(sizeof *a);
    if (!a)
        return kvt__fail(KVT_ENOMEM, "telemetry: out of memory starting a restore");
    *a = (fw_async){.t = t, .done = done, .arg = arg};
    int rc = t->real.restore_async(t->real.self, handle, fw_async_done, a);
    if (rc) /* not accepted: done never runs */
        kvt__free(a);
    return rc;
}

static int fw_store(void *self, const kvt_entry *e)
{
    kvt__telemetry *t = self;
    int rc = t->real.store(t->real.self, e);
    if (rc == 0)
        count_entry(t, e, t->written, t->written_bytes);
    return rc;
}

static int fw_spill(void *self, kvt_entry *e)
{
    kvt__telemetry *t = self;
    /* counted before the call: on 0 the tier owns the entry (and may clear it at once) */
    uint64_t bytes[KVT_LAYER_REPORT_LIMIT + 1] = {0};
    int32_t n = e ? KVT__MIN(e->n_caches, t->n_layers) : 0;
    uint64_t *big = n > KVT_LAYER_REPORT_LIMIT + 1 ? kvt__calloc((size_t)n, sizeof *big) : NULL;
    uint64_t *b = big ? big : bytes;
    int32_t m = big ? n : KVT__MIN(n, KVT_LAYER_REPORT_LIMIT + 1);
    for (int32_t i = 0; i < m; i++)
        b[i] = e->caches[i] ? kvt_cache_bytes(e->caches[i]) : 0;
    int rc = t->real.spill(t->real.self, e);
    if (rc == 0) {
        pthread_mutex_lock(&t->mu);
        for (int32_t i = 0; i < m; i++) {
            t->written[i]++;
            t->written_bytes[i] += b[i];
        }
        pthread_mutex_unlock(&t->mu);
    }
    kvt__free(big);
    return rc;
}

static int fw_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt__telemetry *t = self;
    return t->real.pending(t->real.self, tokens, n, ns);
}

static int fw_flush(void *self)
{
    kvt__telemetry *t = self;
    return t->real.flush(t->real.self);
}

static int fw_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    kvt__telemetry *t = self;
    return t->real.withdraw(t->real.self, tokens, n, ns);
}

static int fw_stats(void *self, kvt_tier_stats *out)
{
    kvt__telemetry *t = self;
    return t->real.stats(t->real.self, out);
}

static void fw_set_evict(void *self, kvt_tier_evict_fn fn, void *arg)
{
    kvt__telemetry *t = self;
    t->real.set_evict(t->real.self, fn, arg);
}

static int fw_layer_bytes(void *self, int32_t n_layers, uint64_t *bytes)
{
    kvt__telemetry *t = self;
    return t->real.layer_bytes(t->real.self, n_layers, bytes);
}

/* Adds the cold tiers' per-layer bytes: residency into disk[], what this
 * host wrote into written[] (each (n) long; tmp is scratch of n). */
static void cold_layer_bytes(kvt__telemetry *t, int32_t n, uint64_t *disk, uint64_t *written, uint64_t *tmp)
{
    int32_t levels = t->chain ? kvt_tier_chain_levels(t->chain) : t->has_cold && t->real.layer_bytes ? 1 : 0;
    for (int32_t l = 0; l < levels; l++) {
        memset(tmp, 0, sizeof *tmp * (size_t)n);
        int kind = t->chain ? kvt_tier_chain_level_layer_bytes(t->chain, l, n, tmp)
                            : t->real.layer_bytes(t->real.self, n, tmp);
        uint64_t *to = kind == KVT_LAYER_BYTES_RESIDENT ? disk : kind == KVT_LAYER_BYTES_WRITTEN ? written : NULL;
        for (int32_t i = 0; to && i < n; i++)
            to[i] += tmp[i];
    }
}

int kvt__telemetry_create(int32_t n_layers, const kvt_cold_tier *cold, kvt_tier_chain *chain, kvt__telemetry **out)
{
    *out = NULL;
    kvt__telemetry *t = kvt__calloc(1, sizeof *t);
    size_t n = (size_t)(n_layers > 0 ? n_layers : 1);
    if (t) {
        t->restores = kvt__calloc(n, sizeof *t->restores);
        t->restored_bytes = kvt__calloc(n, sizeof *t->restored_bytes);
        t->written = kvt__calloc(n, sizeof *t->written);
        t->written_bytes = kvt__calloc(n, sizeof *t->written_bytes);
    }
    if (!t || !t->restores || !t->restored_bytes || !t->written || !t->written_bytes ||
        pthread_mutex_init(&t->mu, NULL)) {
        if (t) {
            kvt__free(t->restores);
            kvt__free(t->restored_bytes);
            kvt__free(t->written);
            kvt__free(t->written_bytes);
        }
        kvt__free(t);
        return kvt__fail(KVT_ENOMEM, "service: out of memory for the per-layer telemetry");
    }
    t->n_layers = n_layers;
    t->chain = chain;
    if (cold) {
        t->real = *cold;
        t->has_cold = 1;
        /* every operation the real tier has, forwarded; what it lacks stays NULL */
        t->shim = (kvt_cold_tier){
            .self = t,
            .find = cold->find ? fw_find : NULL,
            .find_exact = cold->find_exact ? fw_find_exact : NULL,
            .restore = cold->restore ? fw_restore : NULL,
            .restore_async = cold->restore_async ? fw_restore_async : NULL,
            .store = cold->store ? fw_store : NULL,
            .spill = cold->spill ? fw_spill : NULL,
            .pending = cold->pending ? fw_pending : NULL,
            .flush = cold->flush ? fw_flush : NULL,
            .withdraw = cold->withdraw ? fw_withdraw : NULL,
            .stats = cold->stats ? fw_stats : NULL,
            .set_evict = cold->set_evict ? fw_set_evict : NULL,
            .layer_bytes = cold->layer_bytes ? fw_layer_bytes : NULL,
            .flags = cold->flags,
        };
    }
    *out = t;
    return 0;
}

const kvt_cold_tier *kvt__telemetry_cold(kvt__telemetry *t) { return t && t->has_cold ? &t->shim : NULL; }

void kvt__telemetry_destroy(kvt__telemetry *t)
{
    if (!t)
        return;
    pthread_mutex_destroy(&t->mu);
    kvt__free(t->restores);
    kvt__free(t->restored_bytes);
    kvt__free(t->written);
    kvt__free(t->written_bytes);
    kvt__free(t);
}

/* ---- report ------------------------------------------------------------------------ */

int kvt__telemetry_get(kvt__telemetry *t, kvt_prompt_cache *pc, const kvt_service_stats *ps, kvt_layer_stats *out,
                       int32_t cap)
{
    int32_t groups = kvt__telemetry_groups(t->n_layers);
    if (!out || cap < groups)
        return kvt__fail(KVT_EINVAL, "kvt_service_layer_stats: room for %d groups, %d needed", (int)cap, (int)groups);
    size_t n = (size_t)t->n_layers;
    uint64_t *ram = kvt__calloc(n, sizeof *ram), *shared = kvt__calloc(n, sizeof *shared);
    uint64_t *disk = kvt__calloc(n, sizeof *disk), *written = kvt__calloc(n, sizeof *written);
    uint64_t *tmp = kvt__calloc(n, sizeof *tmp);
    int rc = !ram || !shared || !disk || !written || !tmp ? kvt__fail(KVT_ENOMEM, "kvt_service_layer_stats: out of memory")
                                                          : 0;
    if (!rc && pc)
        rc = kvt_prompt_cache_layer_usage(pc, t->n_layers, ram, shared);
    if (!rc)
        cold_layer_bytes(t, t->n_layers, disk, written, tmp);
    kvt__free(tmp);
    if (rc) {
        kvt__free(ram);
        kvt__free(shared);
        kvt__free(disk);
        kvt__free(written);
        return rc;
    }
    memset(out, 0, sizeof *out * (size_t)groups);
    pthread_mutex_lock(&t->mu);
    for (int32_t i = 0; i < t->n_layers; i++) {
        kvt_layer_stats *g = &out[KVT__MIN(i, KVT_LAYER_REPORT_LIMIT)];
        if (i <= KVT_LAYER_REPORT_LIMIT)
            g->first_layer = i;
        g->last_layer = i;
        g->ram_bytes += ram[i];
        g->ram_shared_blocks += shared[i];
        g->ssd_bytes += disk[i];
        g->remote_written_bytes += written[i];
        g->restores += t->restores[i];
        g->restored_bytes += t->restored_bytes[i];
        g->written += t->written[i];
        g->written_bytes += t->written_bytes[i];
        g->promotions += ps->promotions;
        g->demotions += ps->demotions;
        g->evictions += ps->evictions;
    }
    pthread_mutex_unlock(&t->mu);
    kvt__free(ram);
    kvt__free(shared);
    kvt__free(disk);
    kvt__free(written);
    return groups;
}

json_t *kvt__telemetry_json(kvt__telemetry *t, kvt_prompt_cache *pc, const kvt_service_stats *ps)
{
    kvt_layer_stats *g = kvt__calloc(KVT_LAYER_REPORT_LIMIT + 1, sizeof *g);
    json_t *a = json_array();
    int n = g && a ? kvt__telemetry_get(t, pc, ps, g, KVT_LAYER_REPORT_LIMIT + 1) : -1;
    for (int i = 0; a && i < n; i++) {
        char label[32];
        if (g[i].first_layer == g[i].last_layer)
            snprintf(label, sizeof label, "%d", (int)g[i].first_layer);
        else
            snprintf(label, sizeof label, "%d-%d", (int)g[i].first_layer, (int)g[i].last_layer);
        json_t *o = json_object();
        int bad = !o || json_object_set_new(o, "layer", json_string(label));
#define KVT__LAYER_JSON(name, kind, help)                                                          \
    bad |= !o || json_object_set_new(o, #name, json_integer((json_int_t)KVT__MIN(g[i].name, (uint64_t)INT64_MAX)));
        KVT_LAYER_COUNTERS(KVT__LAYER_JSON)
#undef KVT__LAYER_JSON
        if (bad || json_array_append_new(a, o)) {
            if (bad)
                json_decref(o);
            json_decref(a);
            a = NULL;
        }
    }
    kvt__free(g);
    if (n < 0) {
        json_decref(a);
        return NULL;
    }
    return a;
}
