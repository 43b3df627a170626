/*
 * service_pc.c: the service's glue to the RAM prompt cache
 * (include/kvtier/prompt_cache.h). Owns nothing but the prompt cache object;
 * must never change what the prompt cache decides to keep or lend.
 * (Placeholder until the prompt cache lands: keeps nothing.)
 */
#include "service_pc.h"

#include "internal.h"

#include <string.h>

struct kvt__service_pc {
    uint64_t max_bytes;
};

int kvt__service_pc_create(uint64_t max_bytes, int32_t block_tokens, const kvt_cold_tier *cold,
                           kvt__service_pc **out)
{
    (void)cold, (void)block_tokens;
    kvt__service_pc *pc = kvt__calloc(1, sizeof *pc);
    if (!pc)
        return kvt__fail(KVT_ENOMEM, "service: out of memory");
    pc->max_bytes = max_bytes;
    *out = pc;
    return 0;
}

void kvt__service_pc_destroy(kvt__service_pc *pc) { kvt__free(pc); }

int kvt__service_pc_take(kvt__service_pc *pc, const int32_t *prompt, int64_t n, const char *ns,
                         const char *session, int32_t n_layers, kvt_state *out)
{
    (void)pc, (void)prompt, (void)n, (void)ns, (void)session, (void)n_layers;
    out->reused_tokens = 0;
    return 0;
}

int kvt__service_pc_put(kvt__service_pc *pc, const int32_t *tokens, int64_t n, const char *ns,
                        const char *session, kvt_state *st)
{
    (void)pc, (void)tokens, (void)n, (void)ns, (void)session;
    kvt_state_dispose(st);
    return 0;
}

int64_t kvt__service_pc_peek(kvt__service_pc *pc, const int32_t *prompt, int64_t n, const char *ns)
{
    (void)pc, (void)prompt, (void)n, (void)ns;
    return 0;
}

void kvt__service_pc_close_session(kvt__service_pc *pc, const char *session) { (void)pc, (void)session; }
void kvt__service_pc_reclaim(kvt__service_pc *pc, int (*pressure)(void *ctx), void *ctx) { (void)pc, (void)pressure, (void)ctx; }
int kvt__service_pc_demote_idle(kvt__service_pc *pc, uint64_t idle_ms)
{
    (void)pc, (void)idle_ms;
    return 0;
}
void kvt__service_pc_stats(kvt__service_pc *pc, kvt_service_report *out) { out->max_bytes = pc->max_bytes; }
int kvt__service_pc_clear(kvt__service_pc *pc)
{
    (void)pc;
    return 0;
}
