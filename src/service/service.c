/*
 * service.c: the cache service a scheduler talks to (DESIGN.md section 6).
 *
 * Owns: admission under the model's position limit and the KV byte budget
 * (projected from the layers' growth kinds), the admissions of admitted requests,
 * namespaces with adapter identity and version, the prompt cache it keeps
 * state in (acquire lends from it, publish puts into it, close hands it to
 * the cold tier) and the report: its counters, the prompt cache's and the
 * cold tiers' (kvt_tier_stats, per level of a chain).
 *
 * Must never: hand state across namespaces, keep state for a request that
 * reuses nothing, swallow an error of close, or block while holding its mutex
 * (admit_wait sleeps on a condition variable that releases it).
 */
#include "kvtier/io.h"
#include "kvtier/service.h"

#include "checkpoint.h"
#include "service_pool.h"
#include "telemetry.h"
#include "internal.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kvt_admission {
    kvt_admission *next, *prev;      /* the service's list of held admissions */
    int32_t *prompt;             /* (n_prompt) copied at admit */
    int64_t n_prompt;
    char *ns;                    /* "" for the base model */
    char *session;               /* NULL = none */
    int no_reuse;
    int64_t max_tokens;
    uint64_t bytes;              /* projected KV bytes it holds */
    kvt__ckpt_run *ckpt;         /* replayable: its checkpoints (checkpoint.c), NULL = not */
    kvt_pool_reservation *kv_res; /* with a pool: its KV bytes until acquire publishes them */
    int kv_published;            /* acquire published them: release releases them */
};

struct kvt_service {
    pthread_mutex_t mu;
    pthread_cond_t released;     /* signalled on every release */
    int32_t n_layers;
    kvt_service_layer *layers;   /* (n_layers) */
    int64_t max_positions;
    kvt_new_caches_fn new_caches;
    void *new_caches_ctx;
    void (*new_caches_ctx_free)(void *ctx);
    uint64_t kv_budget;          /* 0 = unlimited */
    int (*pressure)(void *ctx);  /* boundary check, NULL = none */
    void *pressure_ctx;
    kvt_prompt_cache *pc;        /* NULL: keeps nothing */
    kvt_cold_tier cold;          /* the cold tier's table, copied (its self borrowed) */
    int has_cold;                /* 0: RAM only */
    kvt_tier_chain *chain;       /* the chain `cold` is the table of, or NULL */
    kvt__ckpt *ckpt;             /* generation checkpoints (checkpoint.c), NULL = none */
    kvt_admission admissions;            /* sentinel of the held-admission list */
    uint64_t projected;          /* sum of held admissions' bytes */
    uint64_t n_admissions;
    int closed;
    int close_done;              /* close's flush and clear have finished */
    /* idle demotion (cold tier only) */
    uint64_t demote_idle_ms;
    pthread_t demoter;
    int demoter_running;
    pthread_cond_t stop;         /* signalled by close to end the demoter */
    uint64_t acquires, reused_tokens, publishes, rejected, waited;
    uint64_t live_paged_out_blocks, live_paged_out_bytes, live_paged_in_blocks, live_paged_in_bytes;
    uint64_t live_page_stall_ms, live_page_failures;
    kvt__svc_pool pool;          /* membership of the config's pool (service_pool.h) */
    kvt__telemetry *telem;       /* per-layer telemetry; the prompt cache's cold tier goes through it */
};

/* ---- creation ----------------------------------------------------------------- */

static int check_layer(const kvt_service_layer *l, int32_t i)
{
    switch (l->growth) {
    case KVT_GROWTH_PER_TOKEN:
        if (l->bytes_per_token == 0 || l->block_tokens < 0)
            return kvt__fail(KVT_EINVAL, "service: layer %d grows per token but bytes_per_token is 0 "
                             "or block_tokens %d < 0", i, l->block_tokens);
        return 0;
    case KVT_GROWTH_WINDOW:
        if (l->bytes_per_token == 0 || l->window < 1)
            return kvt__fail(KVT_EINVAL, "service: window layer %d needs bytes_per_token > 0 and "
                             "window >= 1 (got %zu, %d)", i, l->bytes_per_token, l->window);
        return 0;
    case KVT_GROWTH_FIXED:
        return 0;
    }
    return kvt__fail(KVT_EINVAL, "service: layer %d has unknown growth kind %d", i, (int)l->growth);
}

/* Idle demotion: every quarter of the idle time, entries idle that long
 * leave RAM once the cold tier holds them. Runs until close. The prompt cache
 * does its own locking; the service mutex only guards `closed`. */
static void *demoter_main(void *arg)
{
    kvt_service *s = arg;
    uint64_t every = KVT__MAX(s->demote_idle_ms / 4, 10);
    pthread_mutex_lock(&s->mu);
    while (!s->closed) {
        struct timespec t = kvt__deadline(CLOCK_MONOTONIC, every);
        pthread_cond_timedwait(&s->stop, &s->mu, &t);
        if (s->closed)
            break;
        pthread_mutex_unlock(&s->mu);
        (void)kvt_prompt_cache_demote_idle(s->pc, s->demote_idle_ms, NULL);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

KVT_API int kvt_service_layer_of(const kvt_cache *c, kvt_service_layer *out)
{
    if (!c || !out)
        return kvt__fail(KVT_EINVAL, "kvt_service_layer_of: NULL cache or out");
    memset(out, 0, sizeof *out);
    kvt_cache_state st;
    int rc = kvt_cache_encode(c, &st); /* the kind's parameters, as the store reads them */
    if (rc)
        return rc;
    const int64_t *p = st.params;
    if (!strcmp(st.kind, "kv") && st.n_params >= 2) {
        /* K and V rows in the cache's storage scheme (f32 without the param) */
        size_t es = st.n_params >= 3 ? kvt_dtype_size((kvt_dtype)p[2]) : 4;
        *out = (kvt_service_layer){.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * (size_t)p[0] * (es ? es : 4),
                                   .block_tokens = (int32_t)p[1]};
    } else if (!strcmp(st.kind, "qkv") && st.n_params >= 3 && p[2] > 0) {
        *out = (kvt_service_layer){.growth = KVT_GROWTH_PER_TOKEN,
                                   .bytes_per_token = 2 * (size_t)p[0] + 2 * (size_t)(p[0] / p[2]) * 4,
                                   .block_tokens = (int32_t)p[1]};
    } else if (!strcmp(st.kind, "qkvc") && st.n_params >= 2 && p[1] > 0) {
        /* sealed blocks: 8-bit codes and each block's per-channel scales, or
         * (a 4th param: the dtype) 16-bit values; the f32 open block is fixed */
        size_t es = st.n_params >= 4 ? kvt_dtype_size((kvt_dtype)p[3]) : 0;
        size_t row = es ? 2 * (size_t)p[0] * es
                        : 2 * (size_t)p[0] + (16 * (size_t)p[0] + (size_t)p[1] - 1) / (size_t)p[1];
        *out = (kvt_service_layer){.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = row,
                                   .block_tokens = (int32_t)p[1], .fixed_bytes = 8 * (size_t)p[0] * (size_t)p[1]};
    } else if (!strcmp(st.kind, "rotating") && st.n_params >= 2) {
        /* params kv_dim, window, keep, dtype, group_size: an I8 ring holds
         * one byte per element plus an f32 scale per group, K and V */
        kvt_dtype dt = st.n_params >= 4 ? (kvt_dtype)p[3] : KVT_DTYPE_F32;
        size_t row = (size_t)p[0] * 4;
        if (dt == KVT_DTYPE_I8 && st.n_params >= 5 && p[4] > 0)
            row = (size_t)p[0] + (size_t)(p[0] / p[4]) * 4;
        else if (kvt_dtype_size(dt))
            row = (size_t)p[0] * kvt_dtype_size(dt);
        *out = (kvt_service_layer){.growth = KVT_GROWTH_WINDOW, .bytes_per_token = 2 * row,
                                   .window = (int32_t)p[1]};
    } else if (!strcmp(st.kind, "recurrent") && st.n_params >= 1) {
        *out = (kvt_service_layer){.growth = KVT_GROWTH_FIXED, .fixed_bytes = (size_t)p[0]};
    } else {
        rc = kvt__fail(KVT_EUNSUPPORTED, "kvt_service_layer_of: cache kind '%s' has no known growth: "
                       "describe this layer in kvt_service_config.layers", st.kind);
    }
    kvt_cache_state_clear(&st);
    return rc;
}

/* cfg->layers NULL: one set of fresh caches says how each layer grows. */
static int layers_from_caches(const kvt_service_config *cfg, kvt_service_layer *layers)
{
    kvt_cache **c = kvt__calloc((size_t)cfg->n_layers, sizeof *c);
    if (!c)
        return kvt__fail(KVT_ENOMEM, "service: out of memory");
    int rc = cfg->new_caches(cfg->new_caches_ctx, c);
    if (rc)
        kvt__fail(rc, "service: new_caches failed making the caches the layers are read off: %s",
                  kvt_strerror(rc));
    for (int32_t i = 0; !rc && i < cfg->n_layers; i++) {
        rc = c[i] ? kvt_service_layer_of(c[i], &layers[i])
                  : kvt__fail(KVT_EINVAL, "service: new_caches left layer %d NULL", i);
        if (rc == KVT_EUNSUPPORTED)
            kvt__fail(rc, "service: layer %d is of kind '%s', whose growth kvtier does not know: pass "
                      "kvt_service_config.layers", i, kvt_cache_kind(c[i]));
    }
    kvt_caches_destroy(c, cfg->n_layers);
    kvt__free(c);
    return rc;
}

KVT_API int kvt_service_create(const kvt_service_config *cfg, kvt_service **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "service: out is NULL");
    *out = NULL;
    if (!cfg || !cfg->new_caches)
        return kvt__fail(KVT_EINVAL, "service: config and new_caches are required");
    if (cfg->n_layers < 1 || cfg->n_layers > 256)
        return kvt__fail(KVT_EINVAL, "service: n_layers %d outside 1..256", cfg->n_layers);
    kvt_service_layer derived[256];
    if (!cfg->layers) {
        int rc = layers_from_caches(cfg, derived);
        if (rc)
            return rc;
    }
    const kvt_service_layer *cfg_layers = cfg->layers ? cfg->layers : derived;
    if (cfg->block_tokens < 0)
        return kvt__fail(KVT_EINVAL, "service: block_tokens %d < 0", cfg->block_tokens);
    if (cfg->max_positions < 1)
        return kvt__fail(KVT_EINVAL, "service: max_positions %lld < 1", (long long)cfg->max_positions);
    if (cfg->pool && !cfg->pool_name)
        return kvt__fail(KVT_EINVAL, "service: a pool needs a pool_name for the service's membership");
    for (int32_t i = 0; i < cfg->n_layers; i++) {
        int rc = check_layer(&cfg_layers[i], i);
        if (rc)
            return rc;
    }
    kvt_service *s = kvt__calloc(1, sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "service: out of memory");
    int rc = KVT_ENOMEM;
    s->layers = kvt__calloc((size_t)cfg->n_layers, sizeof *s->layers);
    if (!s->layers) {
        rc = kvt__fail(KVT_ENOMEM, "service: out of memory");
        goto fail;
    }
    memcpy(s->layers, cfg_layers, (size_t)cfg->n_layers * sizeof *s->layers);
    s->n_layers = cfg->n_layers;
    s->max_positions = cfg->max_positions;
    s->new_caches = cfg->new_caches;
    s->new_caches_ctx = cfg->new_caches_ctx;
    s->new_caches_ctx_free = cfg->new_caches_ctx_free;
    s->kv_budget = cfg->kv_budget_bytes;
    s->pressure = cfg->pressure;
    s->pressure_ctx = cfg->pressure_ctx;
    s->admissions.next = s->admissions.prev = &s->admissions;
    if (cfg->cold) {
        s->cold = *cfg->cold;
        s->has_cold = 1;
        s->chain = cfg->chain;
    }
    rc = kvt__svc_pool_init(&s->pool, cfg->pool, cfg->pool_name, cfg->prompt_cache_bytes);
    if (rc)
        goto fail;
    rc = kvt__telemetry_create(cfg->n_layers, cfg->cold, cfg->cold ? cfg->chain : NULL, &s->telem);
    if (rc)
        goto fail;
    if (cfg->prompt_cache_bytes > 0) {
        /* with a cold tier: restores are promoted into RAM at once, and an
         * entry whose write is still pending is never evicted */
        kvt_prompt_cache_config pcc = {
            /* with a pool the budget grows from 0 as the pool grants it */
            .max_bytes = cfg->pool ? 0 : (size_t)cfg->prompt_cache_bytes,
            .block_tokens = cfg->block_tokens,
            .cold = kvt__telemetry_cold(s->telem), /* cfg->cold, counted by layer */
            .flags = cfg->cold ? (KVT_PC_PROMOTE_RESTORES | KVT_PC_EVICT_ONLY_DURABLE) : 0,
        };
        rc = kvt_prompt_cache_create(&pcc, &s->pc);
        if (rc)
            goto fail;
    }
    if (cfg->checkpoint_store) {
        rc = kvt__ckpt_create(cfg->checkpoint_store, cfg->checkpoint_every, cfg->checkpoint_queue_bytes,
                              cfg->checkpoint_sync, &s->ckpt);
        if (rc)
            goto fail;
    }
    if (pthread_mutex_init(&s->mu, NULL)) {
        rc = kvt__fail(KVT_ENOMEM, "service: cannot create mutex");
        goto fail;
    }
    /* timed waits run on the monotonic clock, as the prompt cache's do, so a
     * wall-clock step does not shorten or stretch them */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int crc = pthread_cond_init(&s->released, &ca);
    if (crc) {
        pthread_condattr_destroy(&ca);
        pthread_mutex_destroy(&s->mu);
        rc = kvt__fail(KVT_ENOMEM, "service: cannot create condition variable");
        goto fail;
    }
    crc = pthread_cond_init(&s->stop, &ca);
    pthread_condattr_destroy(&ca);
    if (crc) {
        pthread_cond_destroy(&s->released);
        pthread_mutex_destroy(&s->mu);
        rc = kvt__fail(KVT_ENOMEM, "service: cannot create condition variable");
        goto fail;
    }
    if (s->pc && cfg->cold && cfg->demote_idle_ms > 0) {
        s->demote_idle_ms = cfg->demote_idle_ms;
        if (pthread_create(&s->demoter, NULL, demoter_main, s)) {
            pthread_cond_destroy(&s->stop);
            pthread_cond_destroy(&s->released);
            pthread_mutex_destroy(&s->mu);
            rc = kvt__fail(KVT_ENOMEM, "service: cannot start the idle-demotion thread");
            goto fail;
        }
        s->demoter_running = 1;
    }
    *out = s;
    return 0;
fail:
    kvt__ckpt_destroy(s->ckpt);
    kvt_prompt_cache_destroy(s->pc);
    kvt__telemetry_destroy(s->telem);
    kvt__svc_pool_fini(&s->pool);
    kvt__free(s->layers);
    kvt__free(s);
    return rc;
}

static void admission_free(kvt_admission *l)
{
    if (!l)
        return;
    kvt__free(l->prompt);
    kvt__free(l->ns);
    kvt__free(l->session);
    kvt__ckpt_release(NULL, l->ckpt, 0);
    kvt__free(l);
}

KVT_API void kvt_service_destroy(kvt_service *svc)
{
    if (!svc)
        return;
    (void)kvt_service_close(svc);
    /* Leases never released are the caller's bug; free them so nothing leaks. */
    while (svc->admissions.next != &svc->admissions) {
        kvt_admission *l = svc->admissions.next;
        l->prev->next = l->next;
        l->next->prev = l->prev;
        kvt_pool_drop(l->kv_res);
        admission_free(l);
    }
    kvt__ckpt_destroy(svc->ckpt);
    kvt_prompt_cache_destroy(svc->pc);
    kvt__telemetry_destroy(svc->telem);
    kvt__svc_pool_fini(&svc->pool);
    pthread_cond_destroy(&svc->stop);
    pthread_cond_destroy(&svc->released);
    pthread_mutex_destroy(&svc->mu);
    kvt__free(svc->layers);
    if (svc->new_caches_ctx_free)
        svc->new_caches_ctx_free(svc->new_caches_ctx);
    kvt__free(svc);
}

/* ---- namespaces ---------------------------------------------------------------- */

static int has_control(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            return 1;
    return 0;
}

KVT_API int kvt_service_ns(const char *adapter, const char *version, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return kvt__fail(KVT_EINVAL, "namespace: no output buffer");
    buf[0] = '\0';
    if (!adapter || !*adapter)
        return 0;
    if (strchr(adapter, '@'))
        return kvt__fail(KVT_EINVAL, "namespace: adapter name '%s' contains '@'", adapter);
    if (has_control(adapter))
        return kvt__fail(KVT_EINVAL, "namespace: adapter name contains a control character");
    if (!kvt__utf8_valid(adapter))
        return kvt__fail(KVT_EINVAL, "namespace: adapter name is not valid UTF-8");
    if (!strncmp(adapter, "object:", 7))
        return kvt__fail(KVT_EINVAL, "namespace: adapter name '%s' starts with the reserved 'object:'",
                         adapter);
    if (!version || !*version)
        return kvt__fail(KVT_EINVAL, "namespace: adapter '%s' needs a version (state of one version "
                         "never serves another)", adapter);
    if (has_control(version))
        return kvt__fail(KVT_EINVAL, "namespace: version of adapter '%s' contains a control character",
                         adapter);
    if (!kvt__utf8_valid(version))
        return kvt__fail(KVT_EINVAL, "namespace: version of adapter '%s' is not valid UTF-8", adapter);
    int n = snprintf(buf, cap, "%s@%s", adapter, version);
    if (n < 0 || (size_t)n >= cap) {
        buf[0] = '\0';
        return kvt__fail(KVT_ERANGE, "namespace: '%s@%s' needs %d bytes, buffer holds %zu", adapter,
                         version, n + 1, cap);
    }
    return 0;
}

/* ---- admission ------------------------------------------------------------------- */

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
static uint64_t sat_mul(uint64_t a, uint64_t b) { return b && a > UINT64_MAX / b ? UINT64_MAX : a * b; }

KVT_API uint64_t kvt_service_project_bytes(const kvt_service *svc, int64_t n_tokens)
{
    if (!svc || n_tokens < 0)
        return 0;
    uint64_t n = (uint64_t)n_tokens, total = 0;
    for (int32_t i = 0; i < svc->n_layers; i++) {
        const kvt_service_layer *l = &svc->layers[i];
        switch (l->growth) {
        case KVT_GROWTH_PER_TOKEN: {
            uint64_t t = n;
            if (l->block_tokens > 0) {
                uint64_t b = (uint64_t)l->block_tokens;
                t = (n + b - 1) / b * b;
            }
            total = sat_add(total, sat_mul(t, l->bytes_per_token));
            if (n) /* a fixed part on top (qkvc: its f32 open block) */
                total = sat_add(total, l->fixed_bytes);
            break;
        }
        case KVT_GROWTH_WINDOW:
            total = sat_add(total, sat_mul(n < (uint64_t)l->window ? n : (uint64_t)l->window,
                                           l->bytes_per_token));
            break;
        case KVT_GROWTH_FIXED:
            total = sat_add(total, l->fixed_bytes);
            break;
        }
    }
    return total;
}

KVT_API uint64_t kvt_service_project_live_bytes(const kvt_service *svc, int64_t n_tokens, int64_t live_blocks,
                                                uint64_t live_bytes)
{
    uint64_t all = kvt_service_project_bytes(svc, n_tokens);
    if (!svc || (live_blocks <= 0 && !live_bytes))
        return all;
    /* the per-token layers' share of `all`, one block of each (the tails), one block of the first */
    uint64_t per_token = 0, tails = 0, block = 0;
    for (int32_t i = 0; i < svc->n_layers; i++) {
        const kvt_service_layer *l = &svc->layers[i];
        if (l->growth != KVT_GROWTH_PER_TOKEN)
            continue;
        uint64_t n = (uint64_t)n_tokens, b = l->block_tokens > 0 ? (uint64_t)l->block_tokens : 1;
        per_token = sat_add(per_token, sat_mul((n + b - 1) / b * b, l->bytes_per_token));
        tails = sat_add(tails, sat_mul(b, l->bytes_per_token));
        if (!block)
            block = sat_mul(b, l->bytes_per_token);
    }
    uint64_t bound = live_blocks > 0 ? sat_mul((uint64_t)live_blocks, block) : UINT64_MAX;
    if (live_bytes && live_bytes < bound)
        bound = live_bytes;
    bound = sat_add(bound, tails);
    return bound < per_token ? all - per_token + bound : all;
}

static int check_request(const kvt_request *req)
{
    if (!req || !req->prompt)
        return kvt__fail(KVT_EINVAL, "service: request or its prompt is NULL");
    if (req->n_prompt < 1)
        return kvt__fail(KVT_EINVAL, "service: prompt of %lld tokens (at least 1 is needed)",
                         (long long)req->n_prompt);
    if (req->max_tokens < 0)
        return kvt__fail(KVT_EINVAL, "service: max_tokens %lld < 0", (long long)req->max_tokens);
    return 0;
}

/* 1 fits, 0 must wait, < 0 never fits. Called with the mutex held. */
static int fits_locked(kvt_service *s, const kvt_request *req, uint64_t *need_out)
{
    int rc = check_request(req);
    if (rc)
        return rc;
    if (s->closed)
        return kvt__fail(KVT_ECLOSED, "service: closed");
    int64_t want = req->n_prompt > INT64_MAX - req->max_tokens ? INT64_MAX : req->n_prompt + req->max_tokens;
    if (want > s->max_positions) {
        s->rejected++;
        return kvt__fail(KVT_ELIMIT, "context limit: prompt %lld + max_tokens %lld = %lld tokens exceeds "
                         "the model's %lld positions; shorten the prompt or lower max_tokens",
                         (long long)req->n_prompt, (long long)req->max_tokens, (long long)want,
                         (long long)s->max_positions);
    }
    uint64_t need = kvt_service_project_live_bytes(s, want, req->live_blocks, req->live_bytes); /* a bounded request: its bound */
    *need_out = need;
    if (!s->kv_budget)
        return 1;
    if (need > s->kv_budget && s->n_admissions == 0) {
        s->rejected++;
        return kvt__fail(KVT_ELIMIT, "kv budget: request needs %llu bytes of KV (%.2f MB; prompt %lld + "
                         "max_tokens %lld tokens), over the whole budget, kvt_service_config.kv_budget_bytes "
                         "%llu bytes (%.2f MB); lower max_tokens or the prompt, or raise kv_budget_bytes",
                         (unsigned long long)need, need / 1e6,
                         (long long)req->n_prompt, (long long)req->max_tokens,
                         (unsigned long long)s->kv_budget, s->kv_budget / 1e6);
    }
    if (sat_add(s->projected, need) > s->kv_budget)
        return 0;
    return 1;
}

static int admission_new(const kvt_request *req, uint64_t bytes, kvt_admission **out)
{
    kvt_admission *l = kvt__calloc(1, sizeof *l);
    if (!l)
        goto oom;
    l->prompt = kvt__malloc((size_t)req->n_prompt * sizeof *l->prompt);
    l->ns = kvt__strdup(req->ns ? req->ns : "");
    l->session = req->session ? kvt__strdup(req->session) : NULL;
    if (!l->prompt || !l->ns || (req->session && !l->session))
        goto oom;
    memcpy(l->prompt, req->prompt, (size_t)req->n_prompt * sizeof *l->prompt);
    l->n_prompt = req->n_prompt;
    l->no_reuse = req->no_reuse;
    l->max_tokens = req->max_tokens;
    l->bytes = bytes;
    *out = l;
    return 0;
oom:
    admission_free(l);
    return kvt__fail(KVT_ENOMEM, "service: out of memory for an admission");
}

/* Admits under the held mutex: 0, KVT_EAGAIN or an error. *pool_wait is
 * set to 1 when the pool refused (a release in another service of the pool
 * makes room, and it does not signal this one). */
static int admit_locked(kvt_service *s, const kvt_request *req, kvt_admission **out, int *pool_wait)
{
    uint64_t need = 0;
    *pool_wait = 0;
    int f = fits_locked(s, req, &need);
    if (f < 0)
        return f;
    if (f == 0) {
        s->waited++;
        return kvt__fail(KVT_EAGAIN, "kv budget: request needs %llu bytes, %llu of %llu are held by %llu "
                         "admitted requests; wait for a release", (unsigned long long)need,
                         (unsigned long long)s->projected, (unsigned long long)s->kv_budget,
                         (unsigned long long)s->n_admissions);
    }
    /* the pool's KV axis: reserved now, published by acquire */
    kvt_pool_reservation *res = NULL;
    int rc = kvt__svc_pool_kv_reserve(&s->pool, need, &res);
    if (rc == KVT_EAGAIN) {
        s->waited++;
        *pool_wait = 1;
    } else if (rc == KVT_ELIMIT) {
        s->rejected++;
    }
    if (rc)
        return rc;
    kvt_admission *l = NULL;
    rc = admission_new(req, need, &l);
    if (rc) {
        kvt_pool_drop(res);
        return rc;
    }
    l->kv_res = res;
    l->next = &s->admissions;
    l->prev = s->admissions.prev;
    l->prev->next = l;
    s->admissions.prev = l;
    s->projected = sat_add(s->projected, need);
    s->n_admissions++;
    *out = l;
    return 0;
}

KVT_API int kvt_service_admit(kvt_service *svc, const kvt_request *req, kvt_admission **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "service: out is NULL");
    *out = NULL;
    if (!svc)
        return kvt__fail(KVT_EINVAL, "service: NULL service");
    int pool_wait;
    pthread_mutex_lock(&svc->mu);
    int rc = admit_locked(svc, req, out, &pool_wait);
    pthread_mutex_unlock(&svc->mu);
    return rc;
}

KVT_API int kvt_service_admit_wait(kvt_service *svc, const kvt_request *req, int64_t timeout_ms,
                                   kvt_admission **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "service: out is NULL");
    *out = NULL;
    if (!svc)
        return kvt__fail(KVT_EINVAL, "service: NULL service");
    struct timespec deadline = kvt__deadline(CLOCK_MONOTONIC, timeout_ms > 0 ? (uint64_t)timeout_ms : 0);
    pthread_mutex_lock(&svc->mu);
    int rc, pool_wait;
    for (;;) {
        rc = admit_locked(svc, req, out, &pool_wait);
        if (rc != KVT_EAGAIN || timeout_ms == 0)
            break;
        if (pool_wait) {
            /* room comes from another member's release, which does not
             * signal this service: look again every few milliseconds */
            struct timespec t = kvt__deadline(CLOCK_MONOTONIC, 2);
            if (timeout_ms > 0 && (t.tv_sec > deadline.tv_sec ||
                                   (t.tv_sec == deadline.tv_sec && t.tv_nsec > deadline.tv_nsec)))
                t = deadline;
            int w = pthread_cond_timedwait(&svc->released, &svc->mu, &t);
            if (w == ETIMEDOUT && t.tv_sec == deadline.tv_sec && t.tv_nsec == deadline.tv_nsec) {
                rc = admit_locked(svc, req, out, &pool_wait);
                break;
            }
            continue;
        }
        int w = timeout_ms < 0 ? pthread_cond_wait(&svc->released, &svc->mu)
                               : pthread_cond_timedwait(&svc->released, &svc->mu, &deadline);
        if (w == ETIMEDOUT) {
            rc = admit_locked(svc, req, out, &pool_wait);
            break;
        }
    }
    pthread_mutex_unlock(&svc->mu);
    return rc;
}

KVT_API int kvt_service_fits(kvt_service *svc, const kvt_request *req)
{
    if (!svc)
        return kvt__fail(KVT_EINVAL, "service: NULL service");
    uint64_t need = 0;
    pthread_mutex_lock(&svc->mu);
    uint64_t rejected = svc->rejected;
    int rc = fits_locked(svc, req, &need);
    svc->rejected = rejected; /* a question is not a refusal */
    if (rc == 1)
        rc = kvt__svc_pool_kv_fits(&svc->pool, need);
    pthread_mutex_unlock(&svc->mu);
    return rc;
}

KVT_API void kvt_service_release(kvt_service *svc, kvt_admission *adm, int completed)
{
    if (!svc || !adm)
        return;
    kvt__ckpt_release(svc->ckpt, adm->ckpt, completed); /* completed: its checkpoints go */
    adm->ckpt = NULL;
    pthread_mutex_lock(&svc->mu);
    adm->prev->next = adm->next;
    adm->next->prev = adm->prev;
    svc->projected = svc->projected >= adm->bytes ? svc->projected - adm->bytes : 0;
    svc->n_admissions--;
    if (adm->kv_res) /* never acquired: the reservation is dropped */
        kvt_pool_drop(adm->kv_res);
    else if (adm->kv_published)
        kvt__svc_pool_kv_release(&svc->pool, adm->bytes);
    adm->kv_res = NULL;
    pthread_cond_broadcast(&svc->released);
    pthread_mutex_unlock(&svc->mu);
    admission_free(adm);
}

/* ---- request state ------------------------------------------------------------------ */

/* kvtier frees a state's arrays only when it allocated them (kvtier_arrays):
 * a caller's stack or malloc array is never handed to kvt__free. */
KVT_API void kvt_state_clear(kvt_state *st)
{
    if (!st)
        return;
    if (st->caches)
        kvt_caches_destroy(st->caches, st->n_layers);
    for (int32_t i = 0; st->attachments && i < st->n_attachments; i++) {
        kvt_attachment_destroy(st->attachments[i]);
        st->attachments[i] = NULL;
    }
    kvt_hook_run(&st->hook);
    if (st->kvtier_arrays) {
        kvt__free(st->caches);
        kvt__free(st->attachments);
    }
    memset(st, 0, sizeof *st);
}

KVT_API int kvt_state_init(kvt_state *st, int32_t n_layers, int32_t n_attachments)
{
    if (!st)
        return kvt__fail(KVT_EINVAL, "kvt_state_init: state is NULL");
    memset(st, 0, sizeof *st);
    if (n_layers < 1 || n_attachments < 0)
        return kvt__fail(KVT_EINVAL, "kvt_state_init: %d layers (at least 1), %d attachments (at least 0)",
                         n_layers, n_attachments);
    st->caches = kvt__calloc((size_t)n_layers, sizeof *st->caches);
    st->attachments = n_attachments ? kvt__calloc((size_t)n_attachments, sizeof *st->attachments) : NULL;
    if (!st->caches || (n_attachments && !st->attachments)) {
        kvt__free(st->caches);
        kvt__free(st->attachments);
        memset(st, 0, sizeof *st);
        return kvt__fail(KVT_ENOMEM, "kvt_state_init: out of memory for %d layers", n_layers);
    }
    st->n_layers = n_layers;
    st->n_attachments = n_attachments;
    st->kvtier_arrays = 1;
    return 0;
}

KVT_API int kvt_state_clone(const kvt_state *src, kvt_state *out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_state_clone: out is NULL");
    memset(out, 0, sizeof *out);
    if (!src || !src->caches || (src->n_attachments > 0 && !src->attachments))
        return kvt__fail(KVT_EINVAL, "kvt_state_clone: NULL source state or arrays");
    for (int32_t i = 0; i < src->n_layers; i++)
        if (!src->caches[i])
            return kvt__fail(KVT_EINVAL, "kvt_state_clone: layer %d has no cache", i);
    int rc = kvt_state_init(out, src->n_layers, src->n_attachments);
    if (!rc)
        rc = kvt_caches_clone(src->caches, src->n_layers, out->caches);
    for (int32_t i = 0; !rc && i < src->n_attachments; i++)
        rc = kvt_attachment_clone(src->attachments[i], &out->attachments[i]);
    if (rc) {
        kvt_state_clear(out);
        return rc;
    }
    out->reused_tokens = src->reused_tokens;
    return 0;
}

static int admission_keeps(const kvt_service *s, const kvt_admission *l) { return s->pc && !l->no_reuse; }

/* The admission's longest usable prefix into out->caches (n_layers slots,
 * all left NULL on a miss), out->reused_tokens, attachments and hook. 0 on
 * hit and miss alike. Without the service mutex (the lend may read the cold
 * tier). */
static int lend_state(kvt_service *s, const kvt_admission *adm, kvt_state *out)
{
    kvt_hit hit;
    int rc = kvt_prompt_cache_lend(s->pc, adm->prompt, adm->n_prompt, adm->ns, adm->session, &hit);
    if (rc)
        return rc;
    if (hit.prefix_len > 0 && hit.entry.n_caches != s->n_layers) {
        int64_t got = hit.entry.n_caches;
        kvt_hit_clear(&hit);
        return kvt__fail(KVT_EIDENTITY, "service: a reused entry has %lld layers, the model %d", (long long)got,
                         s->n_layers);
    }
    if (hit.prefix_len > 0) {
        for (int32_t i = 0; i < s->n_layers; i++) {
            out->caches[i] = hit.entry.caches[i];
            hit.entry.caches[i] = NULL;
        }
        if (hit.entry.n_attachments > 0) {
            out->attachments = hit.entry.attachments; /* allocated by kvtier's allocator */
            out->n_attachments = hit.entry.n_attachments;
            hit.entry.attachments = NULL;
            hit.entry.n_attachments = 0;
        }
        out->hook = hit.entry.hook;
        hit.entry.hook = (kvt_hook){0};
        out->reused_tokens = hit.prefix_len;
    }
    kvt_hit_clear(&hit);
    return 0;
}

/* Puts st as the entry of (adm's ns and session, tokens): adopts its caches,
 * attachments and hook on 0 (st cleared); on error they stay in st. */
static int put_state(kvt_service *s, const kvt_admission *adm, const int32_t *tokens, int64_t n, kvt_state *st)
{
    kvt_entry e = {
        .ns = adm->ns,
        .tokens = tokens,
        .n_tokens = n,
        .caches = st->caches,
        .n_caches = st->n_layers,
        .attachments = st->attachments,
        .n_attachments = st->n_attachments,
        .hook = st->hook,
    };
    uint64_t bytes = 0; /* at most what the entry adds (shared blocks count once) */
    for (int32_t i = 0; i < st->n_layers; i++)
        bytes += kvt_cache_bytes(st->caches[i]);
    for (int32_t i = 0; i < st->n_attachments; i++)
        bytes += kvt_attachment_bytes(st->attachments[i]);
    kvt__svc_pool_put_begin(&s->pool, s->pc, bytes, s->has_cold ? &s->cold : NULL);
    int rc = kvt_prompt_cache_put(s->pc, &e, adm->session);
    kvt__svc_pool_put_end(&s->pool, s->pc, s->has_cold ? &s->cold : NULL);
    if (rc)
        return rc;
    st->hook = (kvt_hook){0}; /* adopted (put emptied its copy) */
    kvt_state_clear(st);      /* frees the emptied arrays if kvtier's, zeroes st */
    return 0;
}

/* KVT_ECLOSED (with its detail) once close has begun, else 0. */
static int check_open(kvt_service *s)
{
    pthread_mutex_lock(&s->mu);
    int closed = s->closed;
    pthread_mutex_unlock(&s->mu);
    return closed ? kvt__fail(KVT_ECLOSED, "service: closed") : 0;
}

KVT_API int kvt_service_acquire(kvt_service *svc, kvt_admission *adm, kvt_state *out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "service: out is NULL");
    memset(out, 0, sizeof *out);
    if (!svc || !adm)
        return kvt__fail(KVT_EINVAL, "service: NULL service or admission");
    int rc = check_open(svc);
    if (rc)
        return rc;
    /* The lookup runs outside the service mutex: the prompt cache locks
     * itself and may read the cold tier (I/O) meanwhile; the admission's fields
     * are immutable after admit. */
    out->n_layers = svc->n_layers;
    out->caches = kvt__calloc((size_t)svc->n_layers, sizeof *out->caches);
    if (!out->caches) {
        rc = kvt__fail(KVT_ENOMEM, "service: out of memory");
        goto done;
    }
    out->kvtier_arrays = 1; /* caches and the attachments take may add */
    if (admission_keeps(svc, adm)) {
        rc = lend_state(svc, adm, out);
        if (rc)
            goto done;
    }
    if (out->reused_tokens == 0) {
        rc = svc->new_caches(svc->new_caches_ctx, out->caches);
        if (rc) {
            kvt__fail(rc, "service: cannot make fresh caches: %s", kvt_strerror(rc));
            goto done;
        }
    }
    pthread_mutex_lock(&svc->mu);
    svc->acquires++;
    svc->reused_tokens += (uint64_t)out->reused_tokens;
    if (adm->kv_res) { /* the request's caches exist: its KV bytes are published */
        kvt_pool_publish(adm->kv_res);
        adm->kv_res = NULL;
        adm->kv_published = 1;
    }
    pthread_mutex_unlock(&svc->mu);
done:
    if (rc)
        kvt_state_clear(out);
    return rc;
}

KVT_API int kvt_service_keeps(kvt_service *svc, const kvt_admission *adm)
{
    if (!svc || !adm)
        return 0;
    pthread_mutex_lock(&svc->mu);
    int k = admission_keeps(svc, adm) && !svc->closed;
    pthread_mutex_unlock(&svc->mu);
    return k;
}

KVT_API int kvt_service_publish(kvt_service *svc, kvt_admission *adm, const int32_t *tokens,
                                int64_t n_tokens, kvt_state *st)
{
    if (!svc || !adm || !tokens || !st || !st->caches)
        return kvt__fail(KVT_EINVAL, "publish: NULL service, admission, tokens or state");
    if (n_tokens < 1)
        return kvt__fail(KVT_EINVAL, "publish: %lld tokens (at least 1)", (long long)n_tokens);
    if (st->n_layers != svc->n_layers)
        return kvt__fail(KVT_EINVAL, "publish: state has %d layers, the model %d", st->n_layers,
                         svc->n_layers);
    for (int32_t i = 0; i < st->n_layers; i++) {
        if (!st->caches[i])
            return kvt__fail(KVT_EINVAL, "publish: layer %d has no cache", i);
        int64_t off = kvt_cache_offset(st->caches[i]);
        if (off != n_tokens)
            return kvt__fail(KVT_EINVAL, "publish: layer %d cache holds %lld tokens, published as %lld", i,
                             (long long)off, (long long)n_tokens);
    }
    int rc = check_open(svc);
    if (rc)
        return rc;
    if (!admission_keeps(svc, adm))
        return kvt__fail(KVT_EUNSUPPORTED, "publish: this service keeps no state for the request "
                         "(no prompt cache, or the request reuses nothing)");
    /* outside the service mutex: the prompt cache locks itself; with a cold
     * tier the kept state is queued for it at once (write-behind), and
     * eviction spills only what the tier does not hold */
    rc = put_state(svc, adm, tokens, n_tokens, st);
    if (rc)
        return rc;
    pthread_mutex_lock(&svc->mu);
    svc->publishes++;
    pthread_mutex_unlock(&svc->mu);
    return 0;
}

KVT_API void kvt_service_boundary(kvt_service *svc)
{
    if (!svc)
        return;
    pthread_mutex_lock(&svc->mu);
    if (svc->pc && !svc->closed && svc->pressure)
        (void)kvt_prompt_cache_reclaim(svc->pc, svc->pressure, svc->pressure_ctx, NULL);
    pthread_mutex_unlock(&svc->mu);
}

KVT_API int64_t kvt_service_peek(kvt_service *svc, const int32_t *prompt, int64_t n_prompt, const char *ns)
{
    if (!svc || !prompt || n_prompt < 1)
        return 0;
    pthread_mutex_lock(&svc->mu);
    int64_t p = svc->pc && !svc->closed ? kvt_prompt_cache_peek(svc->pc, prompt, n_prompt, ns, NULL) : 0;
    pthread_mutex_unlock(&svc->mu);
    return p;
}

KVT_API int kvt_service_prefetch(kvt_service *svc, const int32_t *prompt, int64_t n_prompt, const char *ns,
                                 const char *session, kvt_lease **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "prefetch: out is NULL");
    *out = NULL;
    if (!svc || !prompt || n_prompt < 1)
        return kvt__fail(KVT_EINVAL, "prefetch: NULL service or prompt, or %lld tokens", (long long)n_prompt);
    int rc = check_open(svc);
    if (rc)
        return rc;
    if (!svc->pc)
        return 0;
    /* outside the service mutex: the read may be synchronous */
    return kvt_prompt_cache_prefetch(svc->pc, prompt, n_prompt, ns, session, out);
}

/* The cold tier's flush (0 without a prompt cache or a cold tier); the
 * error's detail names the tier's own message. */
static int flush_cold(kvt_service *s)
{
    if (!s->pc || !s->has_cold || !s->cold.flush)
        return 0;
    int rc = s->cold.flush(s->cold.self);
    if (rc) {
        char detail[512];
        snprintf(detail, sizeof detail, "%s", kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
        kvt__fail(rc, "service: flushing the cold tier failed: %s", detail);
    }
    return rc;
}

KVT_API int kvt_service_flush(kvt_service *svc)
{
    if (!svc)
        return kvt__fail(KVT_EINVAL, "flush: NULL service");
    int rc = kvt__ckpt_flush(svc->ckpt);
    int cold_rc = flush_cold(svc);
    kvt__svc_pool_settle(&svc->pool, svc->pc, svc->has_cold ? &svc->cold : NULL); /* what waited on a write is evictable now */
    return rc ? rc : cold_rc;
}

KVT_API void kvt_service_close_session(kvt_service *svc, const char *session)
{
    if (!svc || !session)
        return;
    pthread_mutex_lock(&svc->mu);
    if (svc->pc)
        kvt_prompt_cache_close_session(svc->pc, session);
    pthread_mutex_unlock(&svc->mu);
}

/* ---- report ---------------------------------------------------------------------------- */

KVT_API int kvt_service_get_stats(kvt_service *svc, kvt_service_stats *out)
{
    if (!svc || !out)
        return kvt__fail(KVT_EINVAL, "report: NULL argument");
    memset(out, 0, sizeof *out);
    if (svc->pc) { /* the prompt cache locks itself */
        kvt_prompt_cache_stats ps;
        kvt_prompt_cache_get_stats(svc->pc, &ps);
#define KVT__PC_COPY(type, name, kind, help) out->name = ps.name > 0 ? (uint64_t)ps.name : 0;
        KVT_PROMPT_CACHE_COUNTERS(KVT__PC_COPY)
#undef KVT__PC_COPY
    }
    pthread_mutex_lock(&svc->mu);
    out->acquires = svc->acquires;
    out->reused_tokens = svc->reused_tokens;
    out->publishes = svc->publishes;
    out->admitted = svc->n_admissions;
    out->kv_projected_bytes = svc->projected;
    out->kv_budget_bytes = svc->kv_budget;
    out->rejected = svc->rejected;
    out->waited = svc->waited;
    out->live_paged_out_blocks = svc->live_paged_out_blocks;
    out->live_paged_out_bytes = svc->live_paged_out_bytes;
    out->live_paged_in_blocks = svc->live_paged_in_blocks;
    out->live_paged_in_bytes = svc->live_paged_in_bytes;
    out->live_page_stall_ms = svc->live_page_stall_ms;
    out->live_page_failures = svc->live_page_failures;
    pthread_mutex_unlock(&svc->mu);
    return 0;
}

KVT_API void kvt_service_count_residency(kvt_service *svc, const kvt_residency_stats *st)
{
    if (!svc || !st)
        return;
    pthread_mutex_lock(&svc->mu);
    svc->live_paged_out_blocks += st->blocks_out;
    svc->live_paged_out_bytes += st->bytes_out;
    svc->live_paged_in_blocks += st->blocks_in;
    svc->live_paged_in_bytes += st->bytes_in;
    svc->live_page_stall_ms += st->stall_ns / 1000000;
    svc->live_page_failures += st->write_failures + st->read_failures;
    pthread_mutex_unlock(&svc->mu);
}

KVT_API int32_t kvt_service_layer_groups(const kvt_service *svc)
{
    return svc ? kvt__telemetry_groups(svc->n_layers) : 0;
}

KVT_API int kvt_service_layer_stats(kvt_service *svc, kvt_layer_stats *out, int32_t cap)
{
    kvt_service_stats ps;
    int rc = kvt_service_get_stats(svc, &ps);
    if (rc)
        return rc;
    return kvt__telemetry_get(svc->telem, svc->pc, &ps, out, cap);
}

KVT_API int32_t kvt_service_tier_count(kvt_service *svc)
{
    if (!svc || !svc->has_cold)
        return 0;
    if (svc->chain)
        return kvt_tier_chain_levels(svc->chain);
    return svc->cold.stats ? 1 : 0;
}

KVT_API int kvt_service_tier_stats(kvt_service *svc, int32_t level, kvt_tier_stats *out)
{
    if (!svc || !out)
        return kvt__fail(KVT_EINVAL, "kvt_service_tier_stats: %s is NULL", svc ? "out" : "service");
    memset(out, 0, sizeof *out);
    int32_t n = kvt_service_tier_count(svc);
    if (level < 0 || level >= n)
        return kvt__fail(KVT_EINVAL, "kvt_service_tier_stats: level %d outside 0..%d", (int)level, (int)n - 1);
    if (svc->chain)
        return kvt_tier_chain_level_stats(svc->chain, level, out);
    return svc->cold.stats(svc->cold.self, out);
}

KVT_API const char *kvt_service_tier_name(kvt_service *svc, int32_t level)
{
    if (level < 0 || level >= kvt_service_tier_count(svc))
        return NULL;
    return svc->chain ? kvt_tier_chain_level_name(svc->chain, level) : "cold";
}

static int set_u64(json_t *o, const char *k, uint64_t v)
{
    return json_object_set_new(o, k, json_integer(v > (uint64_t)INT64_MAX ? INT64_MAX : (json_int_t)v));
}

/* One KVT_SERVICE_COUNTERS value: a limit of 0 is null (unlimited). */
static int set_stat(json_t *o, const char *k, uint64_t v, const char *kind)
{
    if (v == 0 && strcmp(kind, "limit") == 0)
        return json_object_set_new(o, k, json_null());
    return set_u64(o, k, v);
}

/* The "tiers" array: one object per listed tier, top first. */
static json_t *tiers_json(kvt_service *svc)
{
    json_t *a = json_array();
    int32_t n = kvt_service_tier_count(svc);
    for (int32_t i = 0; a && i < n; i++) {
        kvt_tier_stats st;
        json_t *o = json_object();
        int bad = !o || kvt_service_tier_stats(svc, i, &st) != 0;
        if (!bad) {
            bad |= set_u64(o, "level", (uint64_t)i);
            bad |= json_object_set_new(o, "name", json_string(kvt_service_tier_name(svc, i)));
#define KVT__TIER_JSON(name, kind, help) bad |= set_u64(o, #name, st.name);
            KVT_TIER_COUNTERS(KVT__TIER_JSON)
#undef KVT__TIER_JSON
        }
        if (bad || json_array_append_new(a, o) != 0) {
            if (bad)
                json_decref(o);
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

KVT_API int kvt_service_stats_json(kvt_service *svc, char **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "report: out is NULL");
    *out = NULL;
    kvt_service_stats r;
    int rc = kvt_service_get_stats(svc, &r);
    if (rc)
        return rc;
    /* the objects are named as KVT_SERVICE_COUNTERS' groups */
    json_t *root = json_object(), *prefixes = json_object(), *requests = json_object(), *kv = json_object();
    json_t *tiers = tiers_json(svc);
    json_t *pool = kvt__svc_pool_json(&svc->pool);
    json_t *layers = kvt__telemetry_json(svc->telem, svc->pc, &r);
    char *text = NULL;
    int bad = !root || !prefixes || !requests || !kv || !tiers || !pool || !layers;
    if (!bad) {
#define KVT__PC_JSON(type, name, kind, help) bad |= set_u64(prefixes, #name, r.name);
        KVT_PROMPT_CACHE_COUNTERS(KVT__PC_JSON)
#undef KVT__PC_JSON
#define KVT__SVC_JSON(name, group, key, kind, help) bad |= set_stat(group, #key, r.name, #kind);
        KVT_SERVICE_COUNTERS(KVT__SVC_JSON)
#undef KVT__SVC_JSON
        bad |= json_object_set(root, "prefixes", prefixes) | json_object_set(root, "requests", requests) |
               json_object_set(root, "kv", kv) | json_object_set(root, "tiers", tiers) |
               json_object_set(root, "layers", layers) | json_object_set(root, "pool", pool);
    }
    kvt_io_stats ios; /* the process's I/O worker (the tiers' writes and restores), when one runs */
    char *io_text = NULL;
    if (!bad && kvt_io_default_stats_get(&ios) == 0 && kvt_io_stats_json(&ios, NULL, &io_text) == 0) {
        json_t *io = json_loads(io_text, 0, NULL);
        bad |= !io || json_object_set_new(root, "io", io);
    }
    kvt_free(io_text);
    kvt__clear_error();
    if (!bad)
        text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(prefixes);
    json_decref(requests);
    json_decref(kv);
    json_decref(tiers);
    json_decref(pool);
    json_decref(layers);
    json_decref(root);
    if (!text)
        return kvt__fail(KVT_ENOMEM, "report: cannot build the JSON document");
    *out = kvt__strdup(text);
    free(text);
    if (!*out)
        return kvt__fail(KVT_ENOMEM, "report: out of memory");
    return 0;
}

/* Close's graceful shutdown of the prompt cache: every resident entry goes
 * to the cold tier. Write-behind queued most of them when they were put: the
 * first flush makes those durable, so eviction (which never evicts an entry
 * whose write is pending) writes nothing for them and spills only what
 * write-behind dropped; the second flush makes that durable too. Then the
 * cache is cleared. Returns the first flush error. */
static int close_prompt_cache(kvt_service *s)
{
    int rc = 0;
    if (s->has_cold) {
        rc = flush_cold(s);
        kvt_prompt_cache_stats ps;
        kvt_prompt_cache_get_stats(s->pc, &ps);
        if (ps.entries > 0)
            (void)kvt_prompt_cache_evict(s->pc, ps.entries, NULL);
    }
    int frc = flush_cold(s);
    if (!rc)
        rc = frc;
    kvt_prompt_cache_clear(s->pc);
    kvt__svc_pool_ram_clear(&s->pool, s->pc);
    return rc;
}

KVT_API int kvt_service_close(kvt_service *svc)
{
    if (!svc)
        return 0;
    pthread_mutex_lock(&svc->mu);
    if (svc->closed) { /* a second close returns once the first has finished */
        while (!svc->close_done)
            pthread_cond_wait(&svc->released, &svc->mu);
        pthread_mutex_unlock(&svc->mu);
        return 0;
    }
    svc->closed = 1;
    pthread_cond_broadcast(&svc->released); /* waiters see ECLOSED */
    pthread_cond_broadcast(&svc->stop);
    int joining = svc->demoter_running;
    svc->demoter_running = 0;
    pthread_mutex_unlock(&svc->mu);
    if (joining) /* step 1: stop idle demotion (outside the mutex it takes) */
        pthread_join(svc->demoter, NULL);
    int rc = 0;
    /* steps 2 and 3: flush the cold tier, then clear, whatever the flush said;
     * disk I/O, so outside the service mutex (the prompt cache locks itself) */
    rc = kvt__ckpt_flush(svc->ckpt);
    if (svc->pc) {
        int pc_rc = close_prompt_cache(svc);
        rc = rc ? rc : pc_rc;
    }
    pthread_mutex_lock(&svc->mu);
    svc->close_done = 1;
    pthread_cond_broadcast(&svc->released);
    pthread_mutex_unlock(&svc->mu);
    return rc;
}

/* ---- glue for checkpoint.c ------------------------------------------------------------ */

kvt__ckpt *kvt__service_checkpoints(kvt_service *s, int *closed, int32_t *n_layers)
{
    pthread_mutex_lock(&s->mu);
    *closed = s->closed;
    pthread_mutex_unlock(&s->mu);
    *n_layers = s->n_layers;
    return s->ckpt;
}

kvt__ckpt_run **kvt__admission_checkpoint(kvt_admission *a, const int32_t **prompt, int64_t *n_prompt,
                                          int64_t *max_tokens, const char **ns)
{
    *prompt = a->prompt;
    *n_prompt = a->n_prompt;
    *max_tokens = a->max_tokens;
    *ns = a->ns;
    return &a->ckpt;
}
