/*
 * service_pc.h: the service's glue to the RAM prompt cache (internal).
 * The prompt cache locks itself: take and put are called without the
 * service mutex (they may wait on cold-tier reads), the rest with it.
 */
#ifndef KVTIER_SERVICE_PC_H
#define KVTIER_SERVICE_PC_H

#include "kvtier/service.h"

typedef struct kvt__service_pc kvt__service_pc;

/** A prompt cache of max_bytes over `cold` (NULL: RAM only). */
int kvt__service_pc_create(uint64_t max_bytes, int32_t block_tokens, const kvt_cold_tier *cold,
                           kvt__service_pc **out);
void kvt__service_pc_destroy(kvt__service_pc *pc);
/** Longest usable prefix into out->caches (n_layers slots, all NULL on a
 * miss), out->reused_tokens, attachments and hook. 0 on hit and miss alike. */
int kvt__service_pc_lend(kvt__service_pc *pc, const int32_t *prompt, int64_t n, const char *ns,
                         const char *session, int32_t n_layers, kvt_state *out);
/** Adopts st's caches/attachments/hook on 0 (st zeroed); on error they stay in st. */
int kvt__service_pc_put(kvt__service_pc *pc, const int32_t *tokens, int64_t n, const char *ns,
                        const char *session, kvt_state *st);
int64_t kvt__service_pc_peek(kvt__service_pc *pc, const int32_t *prompt, int64_t n, const char *ns);
void kvt__service_pc_close_session(kvt__service_pc *pc, const char *session);
void kvt__service_pc_reclaim(kvt__service_pc *pc, int (*pressure)(void *ctx), void *ctx);
/** Entries idle idle_ms leave RAM once the cold tier holds them. */
int kvt__service_pc_demote_idle(kvt__service_pc *pc, uint64_t idle_ms);
void kvt__service_pc_stats(kvt__service_pc *pc, kvt_service_stats *out);
int kvt__service_pc_clear(kvt__service_pc *pc);
int kvt__service_pc_prefetch(kvt__service_pc *pc, const int32_t *prompt, int64_t n, const char *ns,
                             const char *session, kvt_lease **out);
/** The cold tier's flush (0 without one). */
int kvt__service_pc_flush(kvt__service_pc *pc);

#endif
