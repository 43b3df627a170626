/*
 * service_pc.c: the service's glue to the RAM prompt cache
 * (include/kvtier/prompt_cache.h): take becomes acquire, put becomes publish.
 * Owns the prompt cache object only; must never change what the prompt
 * cache decides to keep or lend, nor hand out a view without its hook share.
 */
#include "service_pc.h"

#include "internal.h"
#include "kvtier/prompt_cache.h"

#include <stdio.h>
#include <string.h>

struct kvt__service_pc {
    kvt_prompt_cache *pc;
    kvt_cold_tier cold;          /* the table, copied (its self is borrowed) */
    int has_cold;                /* 0: RAM only */
};

int kvt__service_pc_create(uint64_t max_bytes, int32_t block_tokens, const kvt_cold_tier *cold,
                           kvt__service_pc **out)
{
    *out = NULL;
    kvt__service_pc *s = kvt__calloc(1, sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "service: out of memory");
    kvt_prompt_cache_config cfg = {
        .max_bytes = (size_t)max_bytes,
        .block_tokens = block_tokens,
        .cold = cold,
        .flags = cold ? (KVT_PC_PROMOTE_RESTORES | KVT_PC_EVICT_ONLY_DURABLE) : 0,
    };
    int rc = kvt_prompt_cache_create(&cfg, &s->pc);
    if (rc) {
        kvt__free(s);
        return rc;
    }
    if (cold) {
        s->cold = *cold;
        s->has_cold = 1;
    }
    *out = s;
    return 0;
}

void kvt__service_pc_destroy(kvt__service_pc *s)
{
    if (!s)
        return;
    kvt_prompt_cache_destroy(s->pc);
    kvt__free(s);
}

int kvt__service_pc_take(kvt__service_pc *s, const int32_t *prompt, int64_t n, const char *ns,
                         const char *session, int32_t n_layers, kvt_state *out)
{
    kvt_hit hit;
    int rc = kvt_prompt_cache_take(s->pc, prompt, n, ns, session, &hit);
    if (rc)
        return rc;
    if (hit.prefix_len > 0 && hit.entry.n_caches != n_layers) {
        int64_t got = hit.entry.n_caches;
        kvt_hit_dispose(&hit);
        return kvt__fail(KVT_EIDENTITY, "service: a reused entry has %lld layers, the model %d", (long long)got,
                         n_layers);
    }
    if (hit.prefix_len > 0) {
        for (int32_t i = 0; i < n_layers; i++) {
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
    kvt_hit_dispose(&hit);
    return 0;
}

int kvt__service_pc_put(kvt__service_pc *s, const int32_t *tokens, int64_t n, const char *ns,
                        const char *session, kvt_state *st)
{
    kvt_entry e = {
        .ns = ns,
        .tokens = tokens,
        .n_tokens = n,
        .caches = st->caches,
        .n_caches = st->n_layers,
        .attachments = st->attachments,
        .n_attachments = st->n_attachments,
        .hook = st->hook,
    };
    int rc = kvt_prompt_cache_put(s->pc, &e, session);
    if (rc)
        return rc;
    st->hook = (kvt_hook){0}; /* adopted (put emptied its copy) */
    kvt_state_dispose(st);    /* frees the emptied arrays if kvtier's, zeroes st */
    return 0;
}

int64_t kvt__service_pc_peek(kvt__service_pc *s, const int32_t *prompt, int64_t n, const char *ns)
{
    return kvt_prompt_cache_peek(s->pc, prompt, n, ns, NULL);
}

void kvt__service_pc_close_session(kvt__service_pc *s, const char *session)
{
    kvt_prompt_cache_close_session(s->pc, session);
}

void kvt__service_pc_reclaim(kvt__service_pc *s, kvt_over_budget_fn pressure, void *ctx)
{
    if (pressure)
        (void)kvt_prompt_cache_reclaim(s->pc, pressure, ctx, NULL);
}

void kvt__service_pc_stats(kvt__service_pc *s, kvt_service_report *out)
{
    kvt_prompt_cache_stats ps;
    memset(&ps, 0, sizeof ps);
    kvt_prompt_cache_stats_get(s->pc, &ps);
    out->entries = ps.entries > 0 ? (uint64_t)ps.entries : 0;
    out->bytes = ps.bytes;
    out->max_bytes = ps.max_bytes;
    out->hits = ps.hits;
    out->misses = ps.misses;
    out->session_hits = ps.session_hits;
    out->session_misses = ps.session_misses;
    out->demotions = ps.demotions;
    out->evictions = ps.evictions;
    out->cold_restores = ps.cold_restores;
    out->spills = ps.spills;
    out->write_behind_queued = ps.write_behind_queued;
    out->write_behind_dropped = ps.write_behind_dropped;
    out->durable_evictions = ps.durable_evictions;
}

int kvt__service_pc_prefetch(kvt__service_pc *s, const int32_t *prompt, int64_t n, const char *ns,
                             const char *session, kvt_lease **out)
{
    return kvt_prompt_cache_prefetch(s->pc, prompt, n, ns, session, out);
}

int kvt__service_pc_flush(kvt__service_pc *s)
{
    if (!s->has_cold || !s->cold.flush)
        return 0;
    int rc = s->cold.flush(s->cold.self);
    if (rc) {
        char detail[512];
        snprintf(detail, sizeof detail, "%s", kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
        kvt__fail(rc, "service: flushing the cold tier failed: %s", detail);
    }
    return rc;
}

int kvt__service_pc_clear(kvt__service_pc *s)
{
    int rc = 0;
    if (s->has_cold) {
        /* Graceful shutdown: every resident entry goes to the cold tier.
         * Write-behind queued most of them when they were put: the first
         * flush makes those durable, so eviction (which never evicts an
         * entry whose write is pending) writes nothing for them and spills
         * only what write-behind dropped; the second flush makes that
         * durable too. */
        rc = kvt__service_pc_flush(s);
        kvt_prompt_cache_stats ps;
        kvt_prompt_cache_stats_get(s->pc, &ps);
        if (ps.entries > 0)
            (void)kvt_prompt_cache_evict(s->pc, ps.entries, NULL);
    }
    int frc = kvt__service_pc_flush(s);
    if (!rc)
        rc = frc;
    kvt_prompt_cache_clear(s->pc);
    return rc;
}

int kvt__service_pc_demote_idle(kvt__service_pc *s, uint64_t idle_ms)
{
    return kvt_prompt_cache_demote_idle(s->pc, idle_ms, NULL);
}
