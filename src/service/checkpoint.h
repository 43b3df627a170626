/*
 * checkpoint.h (internal): the service's generation-checkpoint writer and
 * the two hooks service.c gives it. Never installed.
 */
#ifndef KVT_SERVICE_CHECKPOINT_H
#define KVT_SERVICE_CHECKPOINT_H

#include "kvtier/service.h"
#include "kvtier/store.h"

#include <stdint.h>

typedef struct kvt__ckpt kvt__ckpt;
typedef struct kvt__ckpt_run kvt__ckpt_run;

/** Starts the checkpoint writer over `store` (borrowed; must outlive it).
 * @param every generated tokens between checkpoints, >= 1.
 * @param queue_bytes bound of queued cache bytes, 0 = 256 MiB.
 * @param sync 1: kvt_service_checkpoint returns once the writer finished
 *   that checkpoint (kvt_service_config.checkpoint_sync).
 * Its writes run as background write operations on the process's default
 * I/O worker (a reference taken here, dropped by kvt__ckpt_destroy).
 * @return 0; KVT_EINVAL (NULL store, every < 1); KVT_ENOMEM;
 *   kvt_io_default_acquire's errors. */
int kvt__ckpt_create(kvt_store *store, int64_t every, uint64_t queue_bytes, int sync, kvt__ckpt **out);

/** Runs every queued job (waits for the write operations on the I/O
 * worker), drops its reference on the worker and frees. NULL is a no-op. */
void kvt__ckpt_destroy(kvt__ckpt *c);

/** Waits until the writer's queue is empty. @return 0, or the status of the
 * last write or removal that failed since the previous flush. NULL: 0. */
int kvt__ckpt_flush(kvt__ckpt *c);

/** A replayable request ends: completed queues the removal of its
 * checkpoints (behind nothing: its queued writes are dropped), else they are
 * kept. Frees `run`. NULL run is a no-op; c may be NULL (then run is freed). */
void kvt__ckpt_release(kvt__ckpt *c, kvt__ckpt_run *run, int completed);

/* ---- from service.c ---- */

/** The service's checkpoint writer (NULL: none), whether close has begun,
 * and its layer count. Thread-safe. */
kvt__ckpt *kvt__service_checkpoints(kvt_service *s, int *closed, int32_t *n_layers);

/** The admission's prompt, max_tokens, namespace and its checkpoint-run
 * slot (NULL until kvt_service_resume marks it replayable). The fields are
 * immutable after admit; the slot belongs to the request's thread. */
kvt__ckpt_run **kvt__admission_checkpoint(kvt_admission *a, const int32_t **prompt, int64_t *n_prompt,
                                          int64_t *max_tokens, const char **ns);

#endif
