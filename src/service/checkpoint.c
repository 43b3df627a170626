/*
 * checkpoint.c: generation checkpoints of replayable requests (service.h,
 * "generation checkpoints"; docs/checkpoints.md).
 *
 * Owns the checkpoint writer: a FIFO queue of jobs, each a write (a
 * zero-copy clone of a request's caches with its metadata attachment, made
 * durable with kvt_store_put: the store's crash-safe path, kv blocks already
 * on disk shared) or a removal (every checkpoint of a completed request),
 * run one at a time in queue order by background write operations on the
 * process's I/O worker (kvtier/io.h): at most one of them is queued or
 * running at once, each runs the job at the head and queues the next one
 * while jobs are left. No thread of its own. Also the resume side: finding
 * a request's newest readable checkpoint, validating it against the
 * request, and handing its caches back.
 *
 * Lock rule: `mu` guards the queue, the job in flight and the counters; no
 * store call runs under it (the operation unlocks before kvt_store_put and
 * kvt_store_remove); lock order: mu, then the worker's. A caller of
 * kvt_service_checkpoint pays the clone and a queue append, never I/O: a
 * full queue (or a worker that refuses the write operation) drops the
 * checkpoint (counted).
 *
 * Must never: resume from a checkpoint that does not match its request
 * (each field is checked and named), write a removed request's checkpoint
 * after its removal, or lose a queued job at shutdown (destroy drains).
 */
#include "checkpoint.h"

#include "kvtier/io.h"

#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define KVT__CKPT_ATTACHMENT "kvtier.generation"
#define KVT__CKPT_MAGIC "KVTGEN\r\n"   /* 8 bytes */
#define KVT__CKPT_VERSION 1u
#define KVT__CKPT_META_BYTES 80u
#define KVT__CKPT_KEEP 2               /* durable checkpoints kept per request */
#define KVT__CKPT_QUEUE_DEFAULT (256ull << 20)
#define KVT__CKPT_NS_PREFIX "checkpoint:"
#define KVT__CKPT_NS_LEN 48            /* prefix + 32 hex + NUL fits */

struct kvt__ckpt_run {
    char ns[KVT__CKPT_NS_LEN];        /* the store namespace of its checkpoints */
    char id[KVT_REQUEST_ID_MAX + 1];  /* the request id, for messages */
    uint64_t seed;                    /* the seed it started or resumed with */
};

typedef struct cjob {
    int remove;                /* 0: write e; 1: remove every checkpoint of ns */
    char ns[KVT__CKPT_NS_LEN];
    kvt_entry e;               /* write: kvtier-allocated, clones of the caches */
    uint64_t bytes;            /* cache bytes e holds */
    uint64_t seq;              /* its place in the queue's order (1, 2, ...) */
    struct cjob *next;
} cjob;

struct kvt__ckpt {
    kvt_store *store;
    int64_t every;
    uint64_t max_bytes;
    pthread_mutex_t mu;
    pthread_cond_t idle_cv;    /* a job finished, or the last write operation ended */
    cjob *head, *tail;
    char busy_ns[KVT__CKPT_NS_LEN]; /* ns of the job in flight, "" none */
    int flush_rc;              /* last failure since the previous flush */
    int stop;
    int sync;                  /* kvt_service_checkpoint waits until its write is done */
    int scheduled;             /* a write operation is queued or running on the worker */
    uint64_t next_seq;         /* seq of the last job queued */
    uint64_t done_seq;         /* seq of the last job the writer finished (FIFO) */
    uint64_t op_seq;           /* write operations submitted (their keys) */
    kvt_io *io;                /* the process's default I/O worker (a reference) */
    kvt_checkpoint_stats st;
};

/* ---- metadata: a fixed little-endian record ------------------------------------ */

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Layout (docs/checkpoints.md): magic[8] version:u32 bytes:u32
 * prompt_tokens:i64 generated_tokens:i64 pending_token:i32 temperature:f32
 * topp:f32 reserved:u32 seed:u64 rng_state:u64 rng_draws:u64 reserved:u64 */
static void meta_encode(const kvt_checkpoint_info *in, uint8_t out[KVT__CKPT_META_BYTES])
{
    memset(out, 0, KVT__CKPT_META_BYTES);
    memcpy(out, KVT__CKPT_MAGIC, 8);
    put_u32(out + 8, KVT__CKPT_VERSION);
    put_u32(out + 12, KVT__CKPT_META_BYTES);
    put_u64(out + 16, (uint64_t)in->prompt_tokens);
    put_u64(out + 24, (uint64_t)in->generated_tokens);
    put_u32(out + 32, (uint32_t)in->pending_token);
    put_u32(out + 36, f32_bits(in->temperature));
    put_u32(out + 40, f32_bits(in->topp));
    put_u64(out + 48, in->seed);
    put_u64(out + 56, in->rng_state);
    put_u64(out + 64, in->rng_draws);
}

static int meta_decode(const uint8_t *p, size_t n, kvt_checkpoint_info *out)
{
    if (n != KVT__CKPT_META_BYTES || memcmp(p, KVT__CKPT_MAGIC, 8))
        return kvt__fail(KVT_EFORMAT, "checkpoint metadata: %zu bytes without the record's magic", n);
    if (get_u32(p + 8) != KVT__CKPT_VERSION || get_u32(p + 12) != KVT__CKPT_META_BYTES)
        return kvt__fail(KVT_EUNSUPPORTED, "checkpoint metadata: version %u is not %u",
                         (unsigned)get_u32(p + 8), KVT__CKPT_VERSION);
    *out = (kvt_checkpoint_info){
        .prompt_tokens = (int64_t)get_u64(p + 16),
        .generated_tokens = (int64_t)get_u64(p + 24),
        .pending_token = (int32_t)get_u32(p + 32),
        .temperature = bits_f32(get_u32(p + 36)),
        .topp = bits_f32(get_u32(p + 40)),
        .seed = get_u64(p + 48),
        .rng_state = get_u64(p + 56),
        .rng_draws = get_u64(p + 64),
    };
    return 0;
}

/* ---- keys ---------------------------------------------------------------------- */

static int check_request_id(const char *id)
{
    if (!id || !*id)
        return kvt__fail(KVT_EINVAL, "checkpoint: empty request id");
    size_t n = strlen(id);
    if (n > KVT_REQUEST_ID_MAX)
        return kvt__fail(KVT_EINVAL, "checkpoint: request id of %zu bytes (at most %d)", n, KVT_REQUEST_ID_MAX);
    for (const unsigned char *p = (const unsigned char *)id; *p; p++)
        if (*p < 0x20 || *p == 0x7f)
            return kvt__fail(KVT_EINVAL, "checkpoint: request id holds a control character");
    return 0;
}

/* "checkpoint:" + 32 hex digits of XXH3-128(id, NUL, the request's ns). */
static void run_ns(const char *id, const char *ns, char out[KVT__CKPT_NS_LEN])
{
    XXH3_state_t *x = XXH3_createState();
    XXH128_hash_t h;
    if (x) {
        XXH3_128bits_reset(x);
        XXH3_128bits_update(x, id, strlen(id) + 1);
        XXH3_128bits_update(x, ns, strlen(ns));
        h = XXH3_128bits_digest(x);
        XXH3_freeState(x);
    } else { /* no memory for a streaming state: hash one joined copy on the stack */
        char buf[KVT_REQUEST_ID_MAX + 1 + 512];
        size_t a = strlen(id) + 1, b = KVT__MIN(strlen(ns), sizeof buf - a);
        memcpy(buf, id, a);
        memcpy(buf + a, ns, b);
        h = XXH3_128bits(buf, a + b);
    }
    snprintf(out, KVT__CKPT_NS_LEN, KVT__CKPT_NS_PREFIX "%016llx%016llx", (unsigned long long)h.high64,
             (unsigned long long)h.low64);
}

/* ---- listing a request's checkpoints -------------------------------------------------- */

typedef struct hits {
    kvt_cold_hit *v;
    int64_t n, cap;
} hits;

static int collect(void *ctx, const kvt_cold_hit *hit)
{
    hits *h = ctx;
    if (h->n == h->cap) {
        int64_t c = h->cap ? h->cap * 2 : 8;
        kvt_cold_hit *v = kvt__realloc(h->v, (size_t)c * sizeof *v);
        if (!v)
            return KVT_ENOMEM;
        h->v = v;
        h->cap = c;
    }
    h->v[h->n++] = *hit;
    return 0;
}

static int longest_first(const void *a, const void *b)
{
    const kvt_cold_hit *x = a, *y = b;
    if (x->n_tokens != y->n_tokens)
        return x->n_tokens > y->n_tokens ? -1 : 1;
    return x->handle > y->handle ? -1 : x->handle < y->handle;
}

/* The durable checkpoints of ns, newest (most tokens) first. */
static int list_ns(kvt_store *store, const char *ns, hits *out)
{
    memset(out, 0, sizeof *out);
    int rc = kvt_store_list(store, ns, collect, out);
    if (rc) {
        kvt__free(out->v);
        memset(out, 0, sizeof *out);
        return rc == KVT_ENOMEM ? kvt__fail(KVT_ENOMEM, "checkpoint: out of memory listing checkpoints") : rc;
    }
    if (out->n > 1)
        qsort(out->v, (size_t)out->n, sizeof *out->v, longest_first);
    return 0;
}

/* ---- the writer ---------------------------------------------------------------------- */

static void job_free(cjob *j)
{
    if (!j)
        return;
    kvt_entry_clear(&j->e);
    kvt__free(j);
}

/* Removes the checkpoints of ns beyond the `keep` newest. On the I/O worker. */
static int prune(kvt__ckpt *c, const char *ns, int64_t keep, uint64_t *removed)
{
    hits h;
    int rc = list_ns(c->store, ns, &h);
    for (int64_t i = keep; !rc && i < h.n; i++) {
        int r = kvt_store_remove(c->store, h.v[i].handle);
        if (r == 0)
            (*removed)++;
        else if (r != KVT_ENOTFOUND) /* evicted meanwhile: nothing left to remove */
            rc = r;
    }
    kvt__free(h.v);
    return rc;
}

static int writer_run(void *task, void **result);

/* Submits the writer's next operation (mu held: the worker accepts or
 * refuses it before another job is queued). Background: a checkpoint is
 * write-behind, nobody waits for it but a checkpoint_sync caller. Its key
 * is unique, so it never joins an earlier operation about to return. */
static int submit_writer(kvt__ckpt *c)
{
    kvt_io_op op = {.kind = KVT_IO_KIND_WRITE,
                    .key = {(uint64_t)(uintptr_t)c ^ UINT64_C(0x636b7074a0761d64),
                            ++c->op_seq ^ UINT64_C(0x5bd1e99500000000)},
                    .priority = KVT_IO_BACKGROUND,
                    .run = writer_run,
                    .task = c};
    return kvt_io_submit(c->io, &op, NULL);
}

/* One write operation (on an I/O worker thread): runs the job at the head
 * of the queue, then queues the next operation when jobs are left (so
 * other background I/O gets its turn between two checkpoints; if the
 * worker refuses it, this operation runs the next job itself) or clears
 * c->scheduled. Never touches c after its last unlock (destroy may free it
 * then). */
static int writer_run(void *task, void **result)
{
    kvt__ckpt *c = task;
    (void)result;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        cjob *j = c->head;
        if (!j) {
            c->scheduled = 0;
            pthread_cond_broadcast(&c->idle_cv);
            break;
        }
        c->head = j->next;
        if (!c->head)
            c->tail = NULL;
        memcpy(c->busy_ns, j->ns, sizeof c->busy_ns);
        pthread_mutex_unlock(&c->mu);

        uint64_t removed = 0;
        int rc = 0, written = 0;
        if (!j->remove) {
            rc = kvt_store_put(c->store, &j->e);
            written = rc == 0;
            if (!rc)
                rc = prune(c, j->ns, KVT__CKPT_KEEP, &removed);
        } else {
            rc = prune(c, j->ns, 0, &removed);
        }
        uint64_t bytes = j->bytes, seq = j->seq;
        job_free(j);

        pthread_mutex_lock(&c->mu);
        c->done_seq = seq;
        c->st.written += (uint64_t)written;
        c->st.removed += removed;
        if (rc) {
            c->st.failed++;
            c->flush_rc = rc;
        }
        c->st.pending--;
        c->st.pending_bytes -= KVT__MIN(c->st.pending_bytes, bytes);
        c->busy_ns[0] = '\0';
        pthread_cond_broadcast(&c->idle_cv);
        if (c->head && submit_writer(c) == 0)
            break; /* the next operation runs the next job */
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int kvt__ckpt_create(kvt_store *store, int64_t every, uint64_t queue_bytes, int sync, kvt__ckpt **out)
{
    *out = NULL;
    if (!store || every < 1)
        return kvt__fail(KVT_EINVAL, "service: checkpoints need a store and checkpoint_every >= 1 (got %lld)",
                         (long long)every);
    kvt__ckpt *c = kvt__calloc(1, sizeof *c);
    if (!c)
        return kvt__fail(KVT_ENOMEM, "service: out of memory for the checkpoint writer");
    c->store = store;
    c->every = every;
    c->sync = sync != 0;
    c->max_bytes = queue_bytes ? queue_bytes : KVT__CKPT_QUEUE_DEFAULT;
    int rc = KVT_ENOMEM;
    if (pthread_mutex_init(&c->mu, NULL))
        goto fail_mu;
    if (pthread_cond_init(&c->idle_cv, NULL))
        goto fail_idle;
    if ((rc = kvt_io_default_acquire(&c->io)) != 0)
        goto fail_io;
    *out = c;
    return 0;
fail_io:
    pthread_cond_destroy(&c->idle_cv);
fail_idle:
    pthread_mutex_destroy(&c->mu);
fail_mu:
    kvt__free(c);
    return kvt__fail(rc, "service: cannot set up the checkpoint writer: %s", kvt_strerror(rc));
}

void kvt__ckpt_destroy(kvt__ckpt *c)
{
    if (!c)
        return;
    /* every queued job runs (the close guarantee); then no write operation
     * refers to c any more */
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    while (c->head || c->scheduled || c->busy_ns[0])
        pthread_cond_wait(&c->idle_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    kvt_io_default_release(c->io);
    pthread_cond_destroy(&c->idle_cv);
    pthread_mutex_destroy(&c->mu);
    kvt__free(c);
}

int kvt__ckpt_flush(kvt__ckpt *c)
{
    if (!c)
        return 0;
    pthread_mutex_lock(&c->mu);
    while (c->head || c->busy_ns[0] || c->scheduled)
        pthread_cond_wait(&c->idle_cv, &c->mu);
    int rc = c->flush_rc;
    c->flush_rc = 0;
    pthread_mutex_unlock(&c->mu);
    return rc ? kvt__fail(rc, "checkpoint writer: a write or removal failed: %s", kvt_strerror(rc)) : 0;
}

/* Unlinks the queued writes of ns (not the one in flight) onto *dropped.
 * Called with mu held. */
static void unqueue_writes(kvt__ckpt *c, const char *ns, cjob **dropped)
{
    cjob **pp = &c->head, *last = NULL;
    while (*pp) {
        cjob *j = *pp;
        if (!j->remove && !strcmp(j->ns, ns)) {
            *pp = j->next;
            c->st.pending--;
            c->st.pending_bytes -= KVT__MIN(c->st.pending_bytes, j->bytes);
            j->next = *dropped;
            *dropped = j;
        } else {
            last = j;
            pp = &j->next;
        }
    }
    c->tail = last;
}

static void jobs_free(cjob *j)
{
    while (j) {
        cjob *n = j->next;
        job_free(j);
        j = n;
    }
}

/* Appends j (the writer owns it from then on, on 0); *seq gets its place
 * in the order. A newer write replaces the queued writes of its request; a
 * removal drops them. When no write operation is queued or running, one is
 * submitted to the I/O worker; a worker that refuses it (its queue is full)
 * refuses j like a full queue (a write counts as dropped). */
static int enqueue(kvt__ckpt *c, cjob *j, uint64_t *seq)
{
    cjob *dropped = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->stop) {
        pthread_mutex_unlock(&c->mu);
        return kvt__fail(KVT_ECLOSED, "checkpoint: the writer is stopping");
    }
    uint64_t before = c->st.pending;
    unqueue_writes(c, j->ns, &dropped);
    if (!j->remove)
        c->st.superseded += before - c->st.pending;
    if (!j->remove && c->head && c->st.pending_bytes + j->bytes > c->max_bytes) {
        c->st.dropped++;
        uint64_t queued = c->st.pending_bytes;
        pthread_mutex_unlock(&c->mu);
        jobs_free(dropped);
        return kvt__fail(KVT_EAGAIN, "checkpoint: the writer's queue holds %llu bytes; %llu more would pass "
                         "its bound of %llu", (unsigned long long)queued, (unsigned long long)j->bytes,
                         (unsigned long long)c->max_bytes);
    }
    if (!c->scheduled) { /* the queue is empty: nothing was unqueued above */
        int rc = submit_writer(c);
        if (rc) {
            if (!j->remove)
                c->st.dropped++;
            pthread_mutex_unlock(&c->mu);
            jobs_free(dropped);
            return kvt__fail(rc, "checkpoint: the I/O worker refused the write: %s", kvt_strerror(rc));
        }
        c->scheduled = 1;
    }
    j->next = NULL;
    j->seq = *seq = ++c->next_seq;
    if (c->tail)
        c->tail->next = j;
    else
        c->head = j;
    c->tail = j;
    c->st.pending++;
    c->st.pending_bytes += j->bytes;
    if (!j->remove)
        c->st.queued++;
    pthread_mutex_unlock(&c->mu);
    jobs_free(dropped);
    return 0;
}

void kvt__ckpt_release(kvt__ckpt *c, kvt__ckpt_run *run, int completed)
{
    if (!run)
        return;
    if (c && completed) {
        cjob *j = kvt__calloc(1, sizeof *j);
        if (j) {
            j->remove = 1;
            memcpy(j->ns, run->ns, sizeof j->ns);
            uint64_t seq;
            if (enqueue(c, j, &seq))
                kvt__free(j);
        }
        /* without memory the checkpoints stay: a repeat resumes, and the
         * store's budget evicts them in time */
    }
    kvt__free(run);
}

/* Waits until no job of ns is queued or in flight. */
static void wait_ns(kvt__ckpt *c, const char *ns)
{
    pthread_mutex_lock(&c->mu);
    for (;;) {
        int busy = !strcmp(c->busy_ns, ns);
        for (cjob *j = c->head; j && !busy; j = j->next)
            busy = !strcmp(j->ns, ns);
        if (!busy)
            break;
        pthread_cond_wait(&c->idle_cv, &c->mu);
    }
    pthread_mutex_unlock(&c->mu);
}

/* ---- the API ---------------------------------------------------------------------------- */

KVT_API int64_t kvt_service_checkpoint_every(const kvt_service *svc)
{
    int closed = 0;
    int32_t nl = 0;
    kvt__ckpt *c = svc ? kvt__service_checkpoints((kvt_service *)svc, &closed, &nl) : NULL;
    return c ? c->every : 0;
}

KVT_API int kvt_service_checkpoint_stats(kvt_service *svc, kvt_checkpoint_stats *out)
{
    if (!svc || !out)
        return kvt__fail(KVT_EINVAL, "checkpoint stats: NULL argument");
    memset(out, 0, sizeof *out);
    int closed = 0;
    int32_t nl = 0;
    kvt__ckpt *c = kvt__service_checkpoints(svc, &closed, &nl);
    if (!c)
        return 0;
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

static void count(kvt__ckpt *c, uint64_t *field, uint64_t n)
{
    pthread_mutex_lock(&c->mu);
    *field += n;
    pthread_mutex_unlock(&c->mu);
}

/* The checks of a restored checkpoint against its request, each naming
 * its field. tokens (n_tokens) are the entry's. */
static int validate(const kvt__ckpt_run *run, const kvt_replay *rp, const kvt_checkpoint_info *m,
                    const int32_t *tokens, int64_t n_tokens, const int32_t *prompt, int64_t n_prompt,
                    int64_t max_tokens)
{
    const char *id = run->id;
    if (m->prompt_tokens != n_prompt)
        return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint's original prompt length is %lld tokens, the "
                         "request's prompt has %lld", id, (long long)m->prompt_tokens, (long long)n_prompt);
    if (n_tokens < n_prompt)
        return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint holds %lld tokens, fewer than its %lld-token "
                         "prompt", id, (long long)n_tokens, (long long)n_prompt);
    for (int64_t i = 0; i < n_prompt; i++)
        if (tokens[i] != prompt[i])
            return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint was made for another prompt (prompt token %lld "
                             "is %d there, %d in the request)", id, (long long)i, (int)tokens[i], (int)prompt[i]);
    if (m->generated_tokens < 1 || m->generated_tokens > max_tokens || n_tokens != n_prompt + m->generated_tokens - 1)
        return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint's generated count %lld does not fit (it holds "
                         "%lld tokens after the prompt, so %lld; the request allows 1..%lld)", id,
                         (long long)m->generated_tokens, (long long)(n_tokens - n_prompt),
                         (long long)(n_tokens - n_prompt + 1), (long long)max_tokens);
    if (m->pending_token < 0 || (rp->vocab_size > 0 && m->pending_token >= rp->vocab_size))
        return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint's pending token %d is outside the vocabulary "
                         "[0, %d)", id, (int)m->pending_token, (int)rp->vocab_size);
    if (rp->seed_explicit && m->seed != rp->seed)
        return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint's seed is %llu, the request's %llu", id,
                         (unsigned long long)m->seed, (unsigned long long)rp->seed);
    if (m->temperature != rp->temperature)
        return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint's temperature is %g, the request's %g", id,
                         (double)m->temperature, (double)rp->temperature);
    if (m->topp != rp->topp)
        return kvt__fail(KVT_EMISMATCH, "request '%s': checkpoint's top-p is %g, the request's %g", id,
                         (double)m->topp, (double)rp->topp);
    return 0;
}

/* The metadata attachment of a restored entry. */
static int entry_meta(const kvt_entry *e, kvt_checkpoint_info *m)
{
    for (int32_t a = 0; a < e->n_attachments; a++) {
        const kvt_attachment *att = e->attachments[a];
        if (!att || strcmp(att->name, KVT__CKPT_ATTACHMENT))
            continue;
        size_t n = 0;
        const void *p = kvt_attachment_blob_data(att, &n);
        if (!p)
            break;
        return meta_decode(p, n, m);
    }
    return kvt__fail(KVT_EFORMAT, "checkpoint: entry has no '%s' attachment", KVT__CKPT_ATTACHMENT);
}

/* Moves a restored entry's caches and hook into a fresh state. */
static int entry_to_state(kvt_entry *e, int32_t n_layers, int64_t n_prompt, kvt_state *out)
{
    if (e->n_caches != n_layers)
        return kvt__fail(KVT_EFORMAT, "checkpoint: entry has %d layers, the model %d", (int)e->n_caches,
                         (int)n_layers);
    int rc = kvt_state_init(out, n_layers, 0);
    if (rc)
        return rc;
    for (int32_t l = 0; l < n_layers; l++) {
        out->caches[l] = e->caches[l];
        e->caches[l] = NULL;
    }
    out->hook = e->hook;
    e->hook = (kvt_hook){0};
    out->reused_tokens = n_prompt;
    return 0;
}

KVT_API int kvt_service_resume(kvt_service *svc, kvt_admission *adm, const kvt_replay *rp, kvt_state *out,
                               kvt_checkpoint_info *info, int32_t *reply, int64_t reply_cap)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (info)
        memset(info, 0, sizeof *info);
    if (!svc || !adm || !rp || !out || !info || !reply)
        return kvt__fail(KVT_EINVAL, "resume: NULL service, admission, replay, state, info or reply");
    int rc = check_request_id(rp->request_id);
    if (rc)
        return rc;
    const int32_t *prompt;
    int64_t n_prompt, max_tokens;
    const char *ns;
    kvt__ckpt_run **slot = kvt__admission_checkpoint(adm, &prompt, &n_prompt, &max_tokens, &ns);
    if (*slot)
        return kvt__fail(KVT_EINVAL, "resume: request '%s' is already replayable", (*slot)->id);
    if (reply_cap < max_tokens)
        return kvt__fail(KVT_EINVAL, "resume: reply_cap %lld is below the request's max_tokens %lld",
                         (long long)reply_cap, (long long)max_tokens);
    int closed = 0;
    int32_t n_layers = 0;
    kvt__ckpt *c = kvt__service_checkpoints(svc, &closed, &n_layers);
    if (closed)
        return kvt__fail(KVT_ECLOSED, "service: closed");
    if (!c)
        return kvt_service_acquire(svc, adm, out);
    kvt__ckpt_run *run = kvt__calloc(1, sizeof *run);
    if (!run)
        return kvt__fail(KVT_ENOMEM, "resume: out of memory");
    snprintf(run->id, sizeof run->id, "%s", rp->request_id);
    run_ns(rp->request_id, ns, run->ns);
    run->seed = rp->seed;

    wait_ns(c, run->ns); /* this request's own queued writes land first */
    hits h;
    rc = list_ns(c->store, run->ns, &h);
    for (int64_t i = 0; !rc && i < h.n; i++) {
        kvt_entry e;
        if (kvt_store_restore(c->store, h.v[i].handle, NULL, 0, &e)) {
            count(c, &c->st.unreadable, 1); /* refused by the store (counted there): try an older one */
            continue;
        }
        kvt_checkpoint_info m;
        if (entry_meta(&e, &m)) {
            kvt_entry_clear(&e);
            count(c, &c->st.unreadable, 1);
            continue;
        }
        rc = validate(run, rp, &m, e.tokens, e.n_tokens, prompt, n_prompt, max_tokens);
        if (rc) {
            count(c, &c->st.mismatches, 1);
        } else if (!(rc = entry_to_state(&e, n_layers, n_prompt, out))) {
            int64_t fed = m.generated_tokens - 1;
            memcpy(reply, e.tokens + n_prompt, (size_t)fed * sizeof *reply);
            reply[fed] = m.pending_token;
            *info = m;
            run->seed = m.seed;
            pthread_mutex_lock(&c->mu);
            c->st.resumes++;
            c->st.resumed_tokens += (uint64_t)e.n_tokens;
            pthread_mutex_unlock(&c->mu);
            kvt_entry_clear(&e);
            kvt__free(h.v);
            *slot = run;
            return 0;
        }
        kvt_entry_clear(&e);
    }
    kvt__free(h.v);
    if (rc) {
        kvt__free(run);
        return rc;
    }
    rc = kvt_service_acquire(svc, adm, out);
    if (rc) {
        kvt__free(run);
        return rc;
    }
    *slot = run;
    return 0;
}

KVT_API int kvt_service_checkpoint(kvt_service *svc, kvt_admission *adm, kvt_cache *const *caches,
                                   const int32_t *tokens, int64_t n_tokens, const kvt_checkpoint_info *info)
{
    if (!svc || !adm || !caches || !tokens || !info)
        return kvt__fail(KVT_EINVAL, "checkpoint: NULL service, admission, caches, tokens or info");
    int closed = 0;
    int32_t n_layers = 0;
    kvt__ckpt *c = kvt__service_checkpoints(svc, &closed, &n_layers);
    if (closed)
        return kvt__fail(KVT_ECLOSED, "service: closed");
    const int32_t *prompt;
    int64_t n_prompt, max_tokens;
    const char *ns;
    kvt__ckpt_run *run = *kvt__admission_checkpoint(adm, &prompt, &n_prompt, &max_tokens, &ns);
    if (!c || !run)
        return kvt__fail(KVT_EUNSUPPORTED, "checkpoint: %s", !c ? "the service keeps no checkpoints (no "
                         "checkpoint store)" : "the request is not replayable (kvt_service_resume first)");
    if (info->prompt_tokens != n_prompt || info->generated_tokens < 1 || info->generated_tokens > max_tokens ||
        n_tokens != info->prompt_tokens + info->generated_tokens - 1)
        return kvt__fail(KVT_EINVAL, "checkpoint: prompt %lld tokens (the request's: %lld), %lld generated "
                         "(1..%lld), %lld tokens in the caches (prompt + generated - 1 expected)",
                         (long long)info->prompt_tokens, (long long)n_prompt, (long long)info->generated_tokens,
                         (long long)max_tokens, (long long)n_tokens);
    if (memcmp(tokens, prompt, (size_t)n_prompt * sizeof *tokens))
        return kvt__fail(KVT_EINVAL, "checkpoint: tokens do not start with the request's prompt");
    if (info->seed != run->seed)
        return kvt__fail(KVT_EINVAL, "checkpoint: seed %llu is not the request's %llu",
                         (unsigned long long)info->seed, (unsigned long long)run->seed);
    for (int32_t l = 0; l < n_layers; l++) {
        if (!caches[l] || kvt_cache_offset(caches[l]) != n_tokens)
            return kvt__fail(KVT_EINVAL, "checkpoint: layer %d cache holds %lld tokens, not %lld", (int)l,
                             caches[l] ? (long long)kvt_cache_offset(caches[l]) : -1LL, (long long)n_tokens);
    }
    cjob *j = kvt__calloc(1, sizeof *j);
    if (!j)
        return kvt__fail(KVT_ENOMEM, "checkpoint: out of memory");
    memcpy(j->ns, run->ns, sizeof j->ns);
    int rc = kvt_entry_init(&j->e, run->ns, tokens, n_tokens, n_layers, 1);
    if (!rc)
        rc = kvt_caches_clone(caches, n_layers, j->e.caches);
    if (!rc) {
        uint8_t meta[KVT__CKPT_META_BYTES];
        meta_encode(info, meta);
        rc = kvt_attachment_blob(KVT__CKPT_ATTACHMENT, meta, sizeof meta, &j->e.attachments[0]);
    }
    for (int32_t l = 0; !rc && l < n_layers; l++)
        j->bytes += kvt_cache_bytes(j->e.caches[l]);
    uint64_t seq = 0;
    if (!rc)
        rc = enqueue(c, j, &seq);
    if (rc) {
        job_free(j);
        return rc;
    }
    if (c->sync) { /* until the writer finished it: jobs finish in queue order */
        pthread_mutex_lock(&c->mu);
        while (c->done_seq < seq)
            pthread_cond_wait(&c->idle_cv, &c->mu);
        pthread_mutex_unlock(&c->mu);
    }
    return 0;
}
