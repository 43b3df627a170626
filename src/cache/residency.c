/*
 * residency.c: bounded live-cache residency (kvtier/residency.h): the block
 * state machine, one request's page file, paging blocks of kv block tables
 * out (write once, then release the RAM) and in (checksummed reads through
 * the I/O worker, read-ahead of the next layer), and the counters.
 *
 * Who touches what: a block entry (kvt__blk) and its state belong to the
 * thread that uses its cache (one at a time, cache.h); every state change is
 * kvt_block_transition on that thread. The I/O worker's threads touch only
 * their task: a write sets its page's status (under r->mu, with a broadcast
 * that settle and the write slack wait on), a read fills its own buffer.
 * A page (one block's page-file copy) is immutable once written and may be
 * shared by clones; it holds a reference on the residency, so the page file
 * stays open while any block or operation needs it. A block whose buffer
 * has an origin (internal.h: the SSD tier holds the same bytes durably)
 * gets a page by reference instead: the origin pinned, nothing written, its
 * page-ins read from the origin, checked against the checksum of the RAM
 * bytes taken before they were released. Never: use a byte of a
 * page-in before its checksum matched; rewrite a page; page out a block
 * another holder shares; page the mutable tail.
 */
#include "cache_internal.h"
#include "internal.h"
#include "page_file.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

/* ---- the block state machine ------------------------------------------------ */

static const char *const state_names[KVT_BLOCK_STATES] = {"resident", "writing", "durable+resident",
                                                         "durable", "restoring", "failed"};
static const char *const event_names[KVT_BLOCK_EVENTS] = {"write", "written", "write failed", "evict",
                                                         "read", "read done", "read failed"};

KVT_API const char *kvt_block_state_name(kvt_block_state s)
{
    return (unsigned)s < KVT_BLOCK_STATES ? state_names[s] : NULL;
}

KVT_API int kvt_block_transition(kvt_block_state *s, kvt_block_event ev)
{
    /* next[state][event]: -1 where the edge does not exist */
    static const signed char next[KVT_BLOCK_STATES][KVT_BLOCK_EVENTS] = {
        /*                   write              written                     write failed       evict
                             read               read done                   read failed */
        [KVT_BLOCK_RESIDENT] = {KVT_BLOCK_WRITING, -1, -1, -1, -1, -1, -1},
        [KVT_BLOCK_WRITING] = {-1, KVT_BLOCK_DURABLE_RESIDENT, KVT_BLOCK_FAILED, -1, -1, -1, -1},
        [KVT_BLOCK_DURABLE_RESIDENT] = {-1, -1, -1, KVT_BLOCK_DURABLE, -1, -1, -1},
        [KVT_BLOCK_DURABLE] = {-1, -1, -1, -1, KVT_BLOCK_RESTORING, -1, -1},
        [KVT_BLOCK_RESTORING] = {-1, -1, -1, -1, -1, KVT_BLOCK_DURABLE_RESIDENT, KVT_BLOCK_DURABLE},
        [KVT_BLOCK_FAILED] = {-1, -1, -1, -1, -1, -1, -1},
    };
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_block_transition: state is NULL");
    if ((unsigned)*s >= KVT_BLOCK_STATES || (unsigned)ev >= KVT_BLOCK_EVENTS)
        return kvt__fail(KVT_EINVAL, "kvt_block_transition: state %d or event %d out of range", (int)*s, (int)ev);
    int n = next[*s][ev];
    if (n < 0)
        return kvt__fail(KVT_EINVAL, "block state %s has no \"%s\" edge", state_names[*s], event_names[ev]);
    *s = (kvt_block_state)n;
    return 0;
}

/* A transition the code below knows is legal: a failure is a bug of this
 * file, reported as one (never silently ignored). */
static int step(kvt__blk *b, kvt_block_event ev)
{
    kvt_block_state s = (kvt_block_state)b->state;
    int rc = kvt_block_transition(&s, ev);
    if (rc == 0)
        b->state = (uint8_t)s;
    return rc;
}

/* ---- the residency object ------------------------------------------------------ */

#define RES_MAX_LAYERS 4096
/* Full blocks past its share a table may keep in RAM while their writes are in
 * flight before appends wait for a write to complete (the default of
 * kvt_residency_options.write_slack). */
#define WRITE_SLACK 4
#define DEFAULT_READ_AHEAD 32
#define DEFAULT_WINDOW 8
/* Threads of the process's page-in worker: page-ins (read-ahead included)
 * in flight at once when no worker is given, so the disk sees a queue, not
 * one read at a time. */
#define PAGE_IN_THREADS 4

struct kvt_residency {
    _Atomic int64_t refs;
    int64_t max_blocks;
    uint64_t max_bytes;
    int32_t read_ahead;
    int32_t window;
    int32_t write_slack; /* >= 0 */
    int drop;
    kvt_io *io; /* page-file writes */
    int own_io; /* io is a reference on the process's default worker */
    kvt_io *rd_io; /* page-ins: the given worker, or a reference on the page-in worker */
    int fd;
    char *path; /* the page file's name (unlinked), for messages */
    uint64_t id; /* first half of every operation key */
    _Atomic uint64_t next_off;
    _Atomic uint64_t next_ref; /* operation keys of pages by reference */
    pthread_mutex_t mu; /* attach table; write completions (with cv) */
    pthread_cond_t cv;  /* a page's write completed */
    kvt__blocks *layers[RES_MAX_LAYERS];
    int32_t n_att;
    int32_t top_layer; /* 1 + the highest layer ever attached */
#define KVT__RES_ATOMIC(name, doc) _Atomic uint64_t name;
    KVT_RESIDENCY_STATS(KVT__RES_ATOMIC)
#undef KVT__RES_ATOMIC
};

/* A page: one block's copy in the page file. */
#define PAGE_PENDING 1
typedef struct kvt__page {
    _Atomic int64_t refs;
    kvt_residency *r; /* retained */
    kvt__origin *ref; /* a page by reference: the pinned origin (retained), NULL for a page-file copy */
    uint64_t off, bytes; /* off: in the page file; a page by reference: a unique key (high bit set) */
    XXH128_hash_t sum[2]; /* of the block's K half and V half; set before status turns 0 */
    _Atomic int status; /* PAGE_PENDING while the write runs, then 0 or the error */
} kvt__page;

/* What a page-in reads of a block: its K half (the first bytes / 2: the K
 * rows of a kv block), its V half, or both. */
#define PART_K 1
#define PART_V 2
#define PART_ALL 3

/* The checksums of a block's halves (block bytes are even: K rows, then as
 * many V rows). */
static void page_sums(kvt__page *p, const void *data)
{
    uint64_t half = p->bytes / 2;
    p->sum[0] = XXH3_128bits(data, half);
    p->sum[1] = XXH3_128bits((const char *)data + half, half);
}

static _Thread_local int in_io_worker; /* a residency's last release must not join its own worker */

static void gauge_add(_Atomic uint64_t *g, _Atomic uint64_t *peak, int64_t delta)
{
    uint64_t now = atomic_fetch_add(g, (uint64_t)delta) + (uint64_t)delta;
    if (peak) {
        uint64_t p = atomic_load(peak);
        while (now > p && !atomic_compare_exchange_weak(peak, &p, now)) {
        }
    }
}

/* The process's page-in worker (PAGE_IN_THREADS threads, every one free for
 * background reads), shared by the residencies given no worker: created by
 * the first acquire, destroyed by the last release. */
static pthread_mutex_t page_in_mu = PTHREAD_MUTEX_INITIALIZER;
static kvt_io *page_in_io;
static uint64_t page_in_refs;

static int page_in_acquire(kvt_io **out)
{
    pthread_mutex_lock(&page_in_mu);
    int rc = 0;
    if (!page_in_io) {
        kvt_io_options o = {.threads = PAGE_IN_THREADS, .max_background = PAGE_IN_THREADS};
        rc = kvt_io_create(&o, &page_in_io);
    }
    if (rc == 0) {
        page_in_refs++;
        *out = page_in_io;
    }
    pthread_mutex_unlock(&page_in_mu);
    return rc;
}

static void page_in_release(void)
{
    kvt_io *last = NULL;
    pthread_mutex_lock(&page_in_mu);
    if (page_in_refs > 0 && --page_in_refs == 0) {
        last = page_in_io;
        page_in_io = NULL;
    }
    pthread_mutex_unlock(&page_in_mu);
    kvt_io_destroy(last); /* page-ins are never fire and forget: nothing queued is lost */
}

static void *res_final(void *arg)
{
    kvt_residency *r = arg;
    if (r->own_io) {
        kvt_io_default_release(r->io);
        page_in_release();
    }
    kvt__page_file_close(r->fd);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    kvt__free(r->path);
    kvt__free(r);
    return NULL;
}

KVT_API kvt_residency *kvt_residency_retain(kvt_residency *r)
{
    if (r)
        atomic_fetch_add(&r->refs, 1);
    return r;
}

KVT_API void kvt_residency_release(kvt_residency *r)
{
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1)
        return;
    if (in_io_worker && r->own_io) { /* (a default or page-in worker thread) */
        /* on a worker thread: the default worker's last release must not run here */
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &a, res_final, r);
        pthread_attr_destroy(&a);
        if (rc == 0)
            return;
        /* no thread: leave the worker running rather than deadlock */
        r->own_io = 0;
    }
    (void)res_final(r);
}

KVT_API int kvt_residency_create(const kvt_residency_options *opt, kvt_residency **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_residency_create: out is NULL");
    *out = NULL;
    kvt_residency_options o = opt ? *opt : (kvt_residency_options){0};
    if (o.max_blocks < 0 || o.window < 0)
        return kvt__fail(KVT_EINVAL, "kvt_residency_create: %s %lld is negative", o.window < 0 ? "window" : "max_blocks",
                         o.window < 0 ? (long long)o.window : (long long)o.max_blocks);
    kvt_residency *r = kvt__calloc(1, sizeof *r);
    if (!r)
        return kvt__fail(KVT_ENOMEM, "kvt_residency_create: out of memory");
    r->refs = 1;
    r->fd = -1;
    r->max_blocks = o.max_blocks;
    r->max_bytes = o.max_bytes;
    r->read_ahead = o.read_ahead == 0 ? DEFAULT_READ_AHEAD : o.read_ahead < 0 ? 0 : o.read_ahead;
    r->window = o.window > 0 ? KVT__MAX(o.window, 2) : DEFAULT_WINDOW;
    r->write_slack = o.write_slack == 0 ? WRITE_SLACK : o.write_slack < 0 ? 0 : o.write_slack;
    r->drop = o.drop_page_cache != 0;
    r->id = (uint64_t)(uintptr_t)r ^ kvt_now_ns() ^ ((uint64_t)getpid() << 40);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    int rc = 0;
    const char *dir = o.dir ? o.dir : getenv("TMPDIR");
    if (!dir || !*dir)
        dir = "/tmp";
    size_t n = strlen(dir) + 40;
    r->path = kvt__malloc(n);
    if (!r->path) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_residency_create: out of memory");
        goto fail;
    }
    snprintf(r->path, n, "%s/kvtier-live-%d-%llx", dir, (int)getpid(), (unsigned long long)(r->id & 0xffffffffffull));
    r->fd = kvt__page_file_create(r->path);
    if (r->fd < 0) {
        rc = r->fd;
        (void)kvt__fail(rc, "live-cache page file %s: cannot create it: %s", r->path, strerror(-rc));
        goto fail;
    }
    if (o.io) {
        r->io = r->rd_io = o.io;
    } else {
        if ((rc = kvt_io_default_acquire(&r->io)) != 0)
            goto fail;
        if ((rc = page_in_acquire(&r->rd_io)) != 0) {
            kvt_io_default_release(r->io);
            goto fail;
        }
        r->own_io = 1;
    }
    *out = r;
    return 0;
fail:
    kvt_residency_release(r);
    return rc;
}

KVT_API int kvt_residency_bounded(const kvt_residency *r) { return r && (r->max_blocks > 0 || r->max_bytes > 0); }

/* Full blocks of block_bytes the bound allows in RAM over all attached caches. */
static uint64_t bound_blocks(const kvt_residency *r, uint64_t block_bytes)
{
    uint64_t n = UINT64_MAX;
    if (r->max_blocks > 0)
        n = (uint64_t)r->max_blocks;
    if (r->max_bytes > 0 && block_bytes > 0)
        n = KVT__MIN(n, r->max_bytes / block_bytes);
    return n;
}

KVT_API uint64_t kvt_residency_bound_bytes(const kvt_residency *r, uint64_t block_bytes)
{
    if (!kvt_residency_bounded(r))
        return UINT64_MAX;
    uint64_t n = bound_blocks(r, block_bytes);
    return block_bytes && n > UINT64_MAX / block_bytes ? UINT64_MAX : n * block_bytes;
}

KVT_API int kvt_residency_stats_get(const kvt_residency *r, kvt_residency_stats *out)
{
    if (!r || !out)
        return kvt__fail(KVT_EINVAL, "kvt_residency_stats_get: NULL %s", r ? "out" : "residency");
#define KVT__RES_LOAD(name, doc) out->name = atomic_load(&((kvt_residency *)r)->name);
    KVT_RESIDENCY_STATS(KVT__RES_LOAD)
#undef KVT__RES_LOAD
    return 0;
}

/* ---- pages and their I/O ---------------------------------------------------------- */

static void page_release(kvt__page *p)
{
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1)
        return;
    kvt_residency *r = p->r;
    if (p->ref) {
        p->ref->ops->unpin(p->ref);
        kvt__origin_release(p->ref);
    }
    kvt__free(p);
    kvt_residency_release(r);
}

static kvt__page *page_retain(kvt__page *p)
{
    if (p)
        atomic_fetch_add(&p->refs, 1);
    return p;
}

typedef struct wr_task {
    kvt__page *page; /* retained */
    kvt_buf *buf;    /* retained: the block stays readable while it is written */
} wr_task;

static void page_complete(kvt__page *p, int status)
{
    kvt_residency *r = p->r;
    pthread_mutex_lock(&r->mu);
    atomic_store(&p->status, status);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static int wr_run(void *vt, void **result)
{
    wr_task *t = vt;
    kvt__page *p = t->page;
    kvt_residency *r = p->r;
    const char *data = kvt_buf_data(t->buf);
    page_sums(p, data);
    int rc = kvt__page_file_io(r->fd, (void *)data, p->bytes, p->off, 1);
    if (rc == 0 && r->drop) /* dirty pages cannot be dropped: written back first */
        rc = kvt__page_file_sync_drop(r->fd, p->off, p->bytes);
    if (rc == 0) {
        atomic_fetch_add(&r->blocks_out, 1);
        atomic_fetch_add(&r->bytes_out, p->bytes);
    }
    page_complete(p, rc);
    return rc;
}

static void wr_free(void *vt, void *result)
{
    wr_task *t = vt;
    int was = in_io_worker;
    in_io_worker = 1;
    if (atomic_load(&t->page->status) == PAGE_PENDING) /* discarded before it ran */
        page_complete(t->page, KVT_ECLOSED);
    kvt_buf_release(t->buf);
    page_release(t->page);
    kvt__free(t);
    in_io_worker = was;
}

typedef struct rd_task {
    kvt__page *page; /* retained */
    kvt_buf *buf;    /* retained: the destination, the result every ticket shares */
    int part;        /* PART_K, PART_V or PART_ALL */
} rd_task;

/* Reads `part` of page p (PART_K, PART_V: one half; PART_ALL: the block)
 * into the same bytes of the block buffer dst (from the page file, or from
 * its origin) and checks each half read against its checksum; the other
 * half of dst is left as it was. One read, counted as one page-in.
 * @return 0, -errno, KVT_EIO, KVT_ECORRUPT. */
static int page_pread(const kvt__page *p, void *dst, int part)
{
    kvt_residency *r = p->r;
    uint64_t half = p->bytes / 2, at = part == PART_V ? half : 0, n = part == PART_ALL ? p->bytes : half;
    char *d = (char *)dst + at;
    int rc;
    if (p->ref) {
        rc = p->ref->ops->read(p->ref, d, at, (size_t)n);
    } else {
        rc = kvt__page_file_io(r->fd, d, n, p->off + at, 0);
        if (r->drop)
            kvt__page_file_drop(r->fd, p->off + at, n);
    }
    for (int h = 0; h < 2 && rc == 0; h++)
        if ((part & (1 << h)) && !XXH128_isEqual(XXH3_128bits((char *)dst + h * half, half), p->sum[h]))
            rc = KVT_ECORRUPT;
    if (rc == 0) {
        atomic_fetch_add(&r->blocks_in, 1);
        atomic_fetch_add(&r->bytes_in, n);
    } else {
        atomic_fetch_add(&r->read_failures, 1);
    }
    return rc;
}

static int rd_run(void *vt, void **result)
{
    rd_task *t = vt;
    int rc = page_pread(t->page, kvt_buf_data(t->buf), t->part);
    if (rc == 0)
        *result = t->buf;
    return rc;
}

static void rd_free(void *vt, void *result)
{
    rd_task *t = vt;
    int was = in_io_worker;
    in_io_worker = 1;
    kvt_buf_release(t->buf);
    page_release(t->page);
    kvt__free(t);
    in_io_worker = was;
}

/* The request-facing message of a failed page-in. */
static int read_error(const kvt__page *p, int64_t index, int rc)
{
    if (p->ref && rc == KVT_ECORRUPT)
        return kvt__fail(KVT_ECORRUPT, "live cache: block %lld paged in from its SSD-tier copy does not match "
                         "its checksum (XXH3-128): refused", (long long)index);
    if (p->ref)
        return kvt__fail(KVT_EIO, "live cache: paging block %lld in from its SSD-tier copy failed: %s",
                         (long long)index, kvt_strerror(rc));
    if (rc == KVT_ECORRUPT)
        return kvt__fail(KVT_ECORRUPT, "live cache: block %lld paged in from %s does not match its checksum "
                         "(XXH3-128): refused", (long long)index, p->r->path);
    return kvt__fail(KVT_EIO, "live cache: paging block %lld in from %s failed: %s", (long long)index, p->r->path,
                     kvt_strerror(rc));
}

/* ---- block entries --------------------------------------------------------------- */

#define TX(t) ((t)->res ? (t)->res->x : NULL) /* the table's page-file side */
#define TR(t) ((t)->res ? (t)->res->r : NULL) /* the policy it is attached to */

/* The page-file side of block i of table t (it exists whenever a block of t
 * has a page or a read). */
static kvt__blkres *xres(const kvt__blocks *t, int64_t i) { return TX(t) ? &TX(t)[i] : NULL; }
static kvt__page *page_of(const kvt__blocks *t, int64_t i) { return TX(t) ? TX(t)[i].page : NULL; }
static kvt_io_ticket *read_of(const kvt__blocks *t, int64_t i) { return TX(t) ? TX(t)[i].rd : NULL; }

/* Block i is staged with one half only (a split window's read-ahead): its
 * RAM copy lacks the other half, so it must not be read as a whole block. */
static int half_staged(const kvt__blocks *t, int64_t i)
{
    return TX(t) && t->v[i].staged && TX(t)[i].parts != PART_ALL;
}

/* Makes t->res if it does not exist. @return 0 or KVT_ENOMEM. */
static int ensure_side(kvt__blocks *t)
{
    if (!t->res && !(t->res = kvt__calloc(1, sizeof *t->res)))
        return kvt__fail(KVT_ENOMEM, "live cache: out of memory for a block table's residency");
    return 0;
}

int kvt__blocks_ensure_res(kvt__blocks *t)
{
    int rc = ensure_side(t);
    if (rc || t->res->x || t->cap == 0)
        return rc;
    t->res->x = kvt__calloc((size_t)t->cap, sizeof *t->res->x);
    return t->res->x ? 0 : kvt__fail(KVT_ENOMEM, "live cache: out of memory for the page table of %lld blocks",
                                     (long long)t->cap);
}

/* A staged or RESTORING block i of t lets go of its staging (the gauge and t's count). */
static void staged_sub(const kvt__blocks *t, int64_t i)
{
    kvt__page *p = page_of(t, i);
    if (p)
        gauge_add(&p->r->staged_bytes, NULL, -(int64_t)p->bytes);
    if (t->res)
        t->res->held--;
}

void kvt__blk_release(kvt__blocks *t, int64_t i)
{
    kvt__blk *k = &t->v[i];
    kvt__blkres *x = xres(t, i);
    if (x && x->rd) {
        kvt_io_ticket_release(x->rd);
        staged_sub(t, i);
    } else if (k->staged) {
        staged_sub(t, i);
    }
    kvt_buf_release(k->buf);
    *k = (kvt__blk){0};
    if (x) {
        page_release(x->page);
        *x = (kvt__blkres){0};
    }
}

void kvt__blk_clone(const kvt__blocks *src, kvt__blocks *dst, int64_t i)
{
    const kvt__blk *k = &src->v[i];
    kvt__blk *d = &dst->v[i];
    /* a clone holds no read in flight: a block being read is paged out for it;
     * a staged copy becomes the clone's own RAM copy (durable and resident) */
    int reading = read_of(src, i) != NULL || half_staged(src, i);
    *d = (kvt__blk){.heap = k->heap, .state = reading ? KVT_BLOCK_DURABLE : k->state};
    d->buf = k->buf && !reading ? kvt_buf_retain(k->buf) : NULL;
    if (TX(dst))
        TX(dst)[i] = (kvt__blkres){.page = page_retain(page_of(src, i))};
}

/* Applies a completed write of a WRITING block. */
static void poll_write(kvt__blocks *t, int64_t i)
{
    kvt__blk *k = &t->v[i];
    if (k->state != KVT_BLOCK_WRITING)
        return;
    kvt__page *p = TX(t)[i].page;
    int st = atomic_load(&p->status);
    if (st == PAGE_PENDING)
        return;
    if (st == 0) {
        (void)step(k, KVT_BLOCK_EV_WRITTEN);
        return;
    }
    (void)step(k, KVT_BLOCK_EV_WRITE_FAILED);
    atomic_fetch_add(&p->r->write_failures, 1);
    page_release(p);
    TX(t)[i].page = NULL;
}

/* Waits for the write of a WRITING block and applies it. */
static void wait_write(kvt__blocks *t, int64_t i)
{
    kvt__page *p = TX(t)[i].page;
    kvt_residency *r = p->r;
    pthread_mutex_lock(&r->mu);
    while (atomic_load(&p->status) == PAGE_PENDING)
        pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    poll_write(t, i);
}

/* Ends the read in flight of block i: waits, then the block is
 * DURABLE_RESIDENT with the staged copy, or DURABLE and the error is set. */
static int finish_read(kvt__blocks *t, int64_t i)
{
    kvt__blk *k = &t->v[i];
    kvt__blkres *x = &TX(t)[i];
    void *res = NULL;
    kvt_io_disposition d = KVT_IO_DISCARD;
    (void)kvt_io_run_here(x->rd); /* still queued: read it on this thread, not after the queue */
    int rc = kvt_io_wait(x->rd, UINT64_MAX, &d, &res);
    if (rc == 0 && (d != KVT_IO_PUBLISH || !res))
        rc = KVT_ECANCELED;
    if (rc == 0)
        k->buf = kvt_buf_retain(res);
    kvt_io_ticket_release(x->rd);
    x->rd = NULL;
    if (rc != 0) {
        staged_sub(t, i);
        (void)step(k, KVT_BLOCK_EV_READ_FAILED);
        return read_error(x->page, i, rc);
    }
    k->staged = true;
    return step(k, KVT_BLOCK_EV_READ_DONE);
}

/* Starts the read of `part` (PART_K, PART_V, PART_ALL) of DURABLE block i:
 * a ticket on the worker, or (queue full) the read now on this thread. */
static int start_read(kvt__blocks *t, int64_t i, kvt_io_priority prio, int part)
{
    kvt__blk *k = &t->v[i];
    kvt__blkres *x = &TX(t)[i];
    kvt__page *p = x->page;
    kvt_residency *r = p->r;
    kvt_buf *buf;
    int rc = kvt_buf_new(p->bytes, &buf);
    if (rc)
        return rc;
    gauge_add(&r->staged_bytes, &r->peak_staged_bytes, (int64_t)p->bytes);
    t->res->held++;
    x->parts = (uint8_t)part;
    rd_task *task = kvt__malloc(sizeof *task);
    if (task) {
        *task = (rd_task){page_retain(p), kvt_buf_retain(buf), part};
        /* the part in the key: the halves of one page are two reads */
        kvt_io_op op = {.kind = KVT_IO_KIND_RESTORE, .key = {r->id ^ ((uint64_t)part << 62), p->off},
                        .priority = prio, .bytes = part == PART_ALL ? p->bytes : p->bytes / 2,
                        .run = rd_run, .free_fn = rd_free, .task = task};
        if (kvt_io_submit(r->rd_io, &op, &x->rd) == 0) {
            kvt_buf_release(buf);
            return step(k, KVT_BLOCK_EV_READ);
        }
        x->rd = NULL;
        rd_free(task, NULL);
    }
    /* the worker refused it (full, closed) or no memory for a task: read it here */
    (void)step(k, KVT_BLOCK_EV_READ);
    rc = page_pread(p, kvt_buf_data(buf), part);
    if (rc != 0) {
        kvt_buf_release(buf);
        staged_sub(t, i);
        (void)step(k, KVT_BLOCK_EV_READ_FAILED);
        return read_error(p, i, rc);
    }
    k->buf = buf;
    k->staged = true;
    return step(k, KVT_BLOCK_EV_READ_DONE);
}

/* Reads the halves of staged block i its copy lacks (`want`: the parts it
 * must hold), on this thread; the block stays staged either way.
 * @return 0 or the request-facing error of the read. */
static int fill_parts(kvt__blocks *t, int64_t i, int want)
{
    kvt__blkres *x = &TX(t)[i];
    int missing = want & ~x->parts;
    if (!missing)
        return 0;
    int rc = page_pread(x->page, kvt_buf_data(t->v[i].buf), missing);
    if (rc != 0)
        return read_error(x->page, i, rc);
    x->parts |= (uint8_t)missing;
    return 0;
}

int kvt__blk_read(const kvt__blocks *t, int64_t i, size_t block_bytes, kvt_buf **out)
{
    const kvt__blk *k = &t->v[i];
    if (k->buf && !read_of(t, i) && !half_staged(t, i)) {
        *out = kvt_buf_retain(k->buf);
        return 0;
    }
    kvt__page *p = page_of(t, i);
    if (!p)
        return kvt__fail(KVT_EINVAL, "live cache: block %lld has neither a RAM copy nor a page-file copy",
                         (long long)i);
    kvt_buf *buf;
    int rc = kvt_buf_new(block_bytes, &buf);
    if (rc)
        return rc;
    if ((rc = page_pread(p, kvt_buf_data(buf), PART_ALL)) != 0) {
        kvt_buf_release(buf);
        return read_error(p, i, rc);
    }
    *out = buf;
    return 0;
}

int kvt__blk_make_private(kvt__blocks *t, int64_t i, size_t block_bytes)
{
    if (!page_of(t, i) && !read_of(t, i) && !t->v[i].staged)
        return 0;
    kvt_buf *buf;
    int rc = kvt__blk_read(t, i, block_bytes, &buf);
    if (rc)
        return rc;
    bool heap = t->v[i].buf ? t->v[i].heap : true;
    kvt__blk_release(t, i);
    t->v[i] = (kvt__blk){.buf = buf, .heap = heap, .state = KVT_BLOCK_RESIDENT};
    return 0;
}

/* Pages RESIDENT private block i out by reference when its buffer has an
 * origin that can be pinned: a page holding the pinned origin and the
 * checksum of the RAM bytes, durable at once (nothing written). @return 1
 * (done), 0 (no origin or no pin: write it), KVT_ENOMEM. */
static int page_by_ref(kvt_residency *r, kvt__blocks *t, int64_t i, size_t block_bytes)
{
    kvt_buf *buf = t->v[i].buf;
    kvt__origin *o = kvt__buf_origin(buf);
    if (!o || kvt_buf_bytes(buf) != block_bytes)
        return 0;
    if (o->ops->pin(o) != 0) {
        kvt__clear_error(); /* the block is written to the page file instead */
        return 0;
    }
    kvt__page *p = kvt__calloc(1, sizeof *p);
    if (!p) {
        o->ops->unpin(o);
        return kvt__fail(KVT_ENOMEM, "live cache: out of memory for a block's page");
    }
    p->refs = 1; /* the block's */
    p->r = kvt_residency_retain(r);
    p->ref = kvt__origin_retain(o);
    p->bytes = block_bytes;
    p->off = ((uint64_t)1 << 63) | atomic_fetch_add(&r->next_ref, 1);
    page_sums(p, kvt_buf_data(buf));
    p->status = 0;
    TX(t)[i].page = p;
    int rc = step(&t->v[i], KVT_BLOCK_EV_WRITE);
    if (rc == 0)
        rc = step(&t->v[i], KVT_BLOCK_EV_WRITTEN);
    atomic_fetch_add(&r->blocks_ref, 1);
    atomic_fetch_add(&r->bytes_ref, block_bytes);
    return rc ? rc : 1;
}

/* Submits the write of RESIDENT private block i (or writes it here when the
 * worker refuses); a block the SSD tier holds is paged by reference
 * instead (page_by_ref). @return 0 or KVT_ENOMEM (the block is then
 * unchanged). */
static int start_write(kvt_residency *r, kvt__blocks *t, int64_t i, size_t block_bytes)
{
    int rc = kvt__blocks_ensure_res(t);
    if (rc)
        return rc;
    if ((rc = page_by_ref(r, t, i, block_bytes)) != 0)
        return rc < 0 ? rc : 0;
    kvt__page *p = kvt__calloc(1, sizeof *p);
    wr_task *task = kvt__malloc(sizeof *task);
    if (!p || !task) {
        kvt__free(p);
        kvt__free(task);
        return kvt__fail(KVT_ENOMEM, "live cache: out of memory for a block's page");
    }
    p->refs = 2; /* the block's and the task's */
    p->r = kvt_residency_retain(r);
    p->bytes = block_bytes;
    p->off = atomic_fetch_add(&r->next_off, block_bytes);
    p->status = PAGE_PENDING;
    *task = (wr_task){p, kvt_buf_retain(t->v[i].buf)};
    TX(t)[i].page = p;
    (void)step(&t->v[i], KVT_BLOCK_EV_WRITE);
    kvt_io_op op = {.kind = KVT_IO_KIND_WRITE, .key = {r->id, p->off}, .priority = KVT_IO_BACKGROUND,
                    .bytes = block_bytes, .run = wr_run, .free_fn = wr_free, .task = task};
    if (kvt_io_submit(r->io, &op, NULL) != 0) {
        void *res = NULL;
        (void)wr_run(task, &res);
        wr_free(task, NULL);
    }
    return 0;
}

/* ---- tables under a policy --------------------------------------------------------- */

/* Whether block i is RAM this table's bound counts: a private RAM copy that
 * is not a staged page-in. */
static int charged(const kvt__blocks *t, int64_t i)
{
    const kvt__blk *k = &t->v[i];
    if (!k->buf || k->staged || read_of(t, i))
        return 0;
    return !(k->state == KVT_BLOCK_RESIDENT && kvt_buf_refs(k->buf) > 1); /* shared: its other holder's */
}

int kvt__blocks_enforce(kvt__blocks *t, int64_t full, size_t block_bytes)
{
    kvt_residency *r = TR(t);
    if (!r)
        return 0;
    int bounded = kvt_residency_bounded(r);
    uint64_t share = bounded ? bound_blocks(r, block_bytes) / (uint64_t)KVT__MAX(r->n_att, 1) : UINT64_MAX;
    int64_t in_ram;
    for (;;) {
        in_ram = 0;
        for (int64_t i = 0; i < full; i++) {
            if (TX(t))
                poll_write(t, i);
            in_ram += charged(t, i);
        }
        if (!bounded || (uint64_t)in_ram <= share)
            break;
        uint64_t need = (uint64_t)in_ram - share;
        int64_t oldest_writing = -1;
        for (int64_t i = 0; i < full && need > 0; i++) {
            if (!charged(t, i))
                continue;
            kvt__blk *k = &t->v[i];
            if (k->state == KVT_BLOCK_RESIDENT) {
                int rc = start_write(r, t, i, block_bytes);
                if (rc)
                    return rc;
                poll_write(t, i); /* complete already when written on this thread */
            }
            if (k->state == KVT_BLOCK_WRITING) {
                if (oldest_writing < 0)
                    oldest_writing = i;
                need--;
            } else if (k->state == KVT_BLOCK_DURABLE_RESIDENT) {
                kvt_buf_release(k->buf);
                k->buf = NULL;
                (void)step(k, KVT_BLOCK_EV_EVICT);
                atomic_fetch_add(&r->evictions, 1);
                in_ram--;
                need--;
            } /* FAILED: stays in RAM for good */
        }
        /* past the share by more than the writes allowed in flight: wait for one */
        if (oldest_writing >= 0 && (uint64_t)in_ram > share + (uint64_t)r->write_slack) {
            wait_write(t, oldest_writing);
            continue;
        }
        break;
    }
    uint64_t bytes = (uint64_t)in_ram * block_bytes;
    int64_t delta = (int64_t)bytes - (int64_t)t->res->charged;
    t->res->charged = bytes;
    gauge_add(&r->resident_bytes, &r->peak_resident_bytes, delta);
    gauge_add(&r->resident_blocks, NULL, delta / (int64_t)KVT__MAX(block_bytes, 1));
    return 0;
}

void kvt__blocks_detach(kvt__blocks *t)
{
    kvt_residency *r = TR(t);
    if (!r)
        return;
    pthread_mutex_lock(&r->mu);
    if (r->layers[t->res->layer] == t) {
        r->layers[t->res->layer] = NULL;
        r->n_att--;
    }
    pthread_mutex_unlock(&r->mu);
    gauge_add(&r->resident_bytes, NULL, -(int64_t)t->res->charged);
    gauge_add(&r->resident_blocks, NULL, -(int64_t)(t->res->charged / KVT__MAX(t->res->charged_bb, 1)));
    t->res->charged = 0;
    t->res->r = NULL;
    kvt_residency_release(r);
}

/* ---- public kv calls ------------------------------------------------------------------ */

/* Blocks of table t holding tokens [0, n_tokens) (ceil(n_tokens / B), but
 * never past the table: a qkvc cache's open block is outside it), and its
 * full blocks when it holds `offset` tokens. */
static int64_t table_blocks(const kvt__blocks *t, int64_t n_tokens, int32_t B)
{
    return KVT__MIN((n_tokens + B - 1) / B, t->n);
}

static int64_t table_full(const kvt__blocks *t, int64_t offset, int32_t B) { return KVT__MIN(offset / B, t->n); }

KVT_API int kvt_kv_set_residency(kvt_cache *c, kvt_residency *r, int32_t layer)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t)
        return kvt__fail(KVT_EINVAL, "kvt_kv_set_residency: not a kv or qkvc cache");
    if (r && (layer < 0 || layer >= RES_MAX_LAYERS))
        return kvt__fail(KVT_EINVAL, "kvt_kv_set_residency: layer %d outside [0, %d)", (int)layer, RES_MAX_LAYERS);
    if (TR(t) == r && (!r || t->res->layer == layer))
        return 0;
    if (r) {
        pthread_mutex_lock(&r->mu);
        int taken = r->layers[layer] != NULL;
        if (!taken) {
            r->layers[layer] = t;
            r->n_att++;
            r->top_layer = KVT__MAX(r->top_layer, layer + 1);
        }
        pthread_mutex_unlock(&r->mu);
        if (taken)
            return kvt__fail(KVT_EINVAL, "kvt_kv_set_residency: another cache is attached as layer %d", (int)layer);
    }
    kvt__blocks_detach(t);
    if (!r)
        return 0;
    int rc = ensure_side(t);
    if (rc) {
        pthread_mutex_lock(&r->mu);
        r->layers[layer] = NULL;
        r->n_att--;
        pthread_mutex_unlock(&r->mu);
        return rc;
    }
    t->res->r = kvt_residency_retain(r);
    t->res->layer = layer;
    t->res->charged_bb = bb;
    return kvt__blocks_enforce(t, table_full(t, off, B), bb);
}

/* The next attached table after `layer` in attention order (wrapping to the
 * first: the next token's first layer), NULL when none. */
static kvt__blocks *next_layer(kvt_residency *r, int32_t layer)
{
    kvt__blocks *n = NULL;
    pthread_mutex_lock(&r->mu);
    int32_t top = r->top_layer;
    for (int32_t i = 1; i <= top && !n; i++)
        n = r->layers[(layer + i) % top];
    pthread_mutex_unlock(&r->mu);
    return n;
}

KVT_API int kvt_kv_pin(kvt_cache *c, int64_t n_tokens)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t) /* another kind (qkv, rotating) is always resident */
        return c ? 0 : kvt__fail(KVT_EINVAL, "kvt_kv_pin: cache is NULL");
    if (n_tokens < 0 || n_tokens > off)
        return kvt__fail(KVT_ERANGE, "kvt_kv_pin: %lld tokens of a cache holding %lld", (long long)n_tokens,
                         (long long)off);
    if (!TX(t)) /* never paged */
        return 0;
    int64_t nb = table_blocks(t, n_tokens, B);
    int rc = 0;
    kvt_residency *stat_r = TR(t);
    uint64_t t0 = 0;
    /* start every read this layer needs, then take them in attention order */
    for (int64_t i = 0; i < nb && rc == 0; i++) {
        if (t->v[i].state == KVT_BLOCK_DURABLE)
            rc = start_read(t, i, KVT_IO_FOREGROUND, PART_ALL);
        else if (TX(t)[i].rd)
            atomic_fetch_add(&TX(t)[i].page->r->readahead_hits, 1);
    }
    for (int64_t i = 0; i < nb && rc == 0; i++) {
        if (!TX(t)[i].rd)
            continue;
        if (!t0)
            t0 = kvt_now_ns();
        stat_r = TX(t)[i].page->r;
        rc = finish_read(t, i);
    }
    for (int64_t i = 0; i < nb && rc == 0; i++) /* a half read ahead for a window: the other half too */
        if (t->v[i].staged)
            rc = fill_parts(t, i, PART_ALL);
    if (t0 && stat_r)
        atomic_fetch_add(&stat_r->stall_ns, kvt_now_ns() - t0);
    if (rc != 0)
        return rc;
    /* read-ahead: the first paged blocks of the next layer in attention order */
    kvt__blocks *nx = TR(t) && TR(t)->read_ahead > 0 ? next_layer(TR(t), t->res->layer) : NULL;
    int64_t want = nx ? TR(t)->read_ahead : 0;
    for (int64_t i = 0; nx && TX(nx) && i < nx->n && want > 0; i++) {
        if (nx->v[i].state != KVT_BLOCK_DURABLE)
            continue;
        if (start_read(nx, i, KVT_IO_BACKGROUND, PART_ALL) != 0)
            break; /* read-ahead is only a hint: the pin reads it */
        want--;
    }
    return 0;
}

/* Releases the staged copy of block i (it is durable: nothing is written). */
static void unstage(kvt__blocks *t, int64_t i)
{
    kvt__blk *k = &t->v[i];
    if (!k->staged)
        return;
    staged_sub(t, i);
    kvt_buf_release(k->buf);
    k->buf = NULL;
    k->staged = false;
    (void)step(k, KVT_BLOCK_EV_EVICT);
}

KVT_API void kvt_kv_unpin(kvt_cache *c)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t || !TX(t))
        return;
    for (int64_t i = 0; i < t->n; i++)
        unstage(t, i);
}

/* ---- attention through a window ------------------------------------------------------ */

/* What walk position pos of t's open window uses of its block: in a split
 * window the K half in even passes and the V half in odd ones, else the
 * whole block. */
static int part_at(const kvt__blocks_res *w, int64_t pos)
{
    if (!w->win_split)
        return PART_ALL;
    return (pos / w->win_nb) % 2 == 0 ? PART_K : PART_V;
}

/* Starts reads of the paged blocks at positions win_ahead.. of t's open
 * window while t holds fewer than its window. Read-ahead is a hint: a read
 * that cannot start is left to kvt_kv_window_get. */
static void window_read_ahead(kvt__blocks *t)
{
    kvt__blocks_res *w = t->res;
    for (; w->win_ahead < w->win_total && w->held < w->win_size; w->win_ahead++) {
        int64_t i = w->win_ahead % w->win_nb;
        /* a staged copy without the half this position uses is filled when taken */
        if (i < t->n && t->v[i].state == KVT_BLOCK_DURABLE && start_read(t, i, KVT_IO_BACKGROUND, part_at(w, w->win_ahead)) != 0)
            break;
    }
}

/* Before block `index` is read for the walk now: when the window is full,
 * gives back the held block of this pass the walk needs last (one read
 * ahead before older blocks were paged out, e.g. by the previous layer
 * ahead of an append that evicted written blocks), finishing its read
 * first, and lets read-ahead come back to it. Blocks after `index` in this
 * pass are not in use (the walk takes blocks in order). */
static int window_make_room(kvt__blocks *t, int64_t index)
{
    kvt__blocks_res *w = t->res;
    if (w->held < w->win_size)
        return 0;
    int64_t pass_start = (w->win_cursor - 1) - (w->win_cursor - 1) % w->win_nb;
    for (int64_t j = KVT__MIN(w->win_nb, t->n) - 1; j > index; j--) {
        if (!t->v[j].staged && !TX(t)[j].rd)
            continue;
        if (TX(t)[j].rd) {
            int rc = finish_read(t, j);
            if (rc)
                return rc;
        }
        unstage(t, j);
        w->win_ahead = KVT__MIN(w->win_ahead, pass_start + j);
        return 0;
    }
    return 0;
}

/* kvt_kv_window_open (halves = 0) and kvt_kv_window_open_halves (1). */
static int window_open(kvt_cache *c, int64_t n_tokens, int32_t passes, int halves)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t) /* another kind (qkv, rotating) is always resident */
        return c ? 0 : kvt__fail(KVT_EINVAL, "kvt_kv_window_open: cache is NULL");
    if (n_tokens < 0 || n_tokens > off || passes < 1)
        return kvt__fail(n_tokens < 0 || n_tokens > off ? KVT_ERANGE : KVT_EINVAL,
                         "kvt_kv_window_open: %lld tokens of a cache holding %lld, %d passes (>= 1)",
                         (long long)n_tokens, (long long)off, (int)passes);
    if (!TX(t)) /* never paged */
        return 0;
    /* the walk's blocks (a qkvc open block too) that a read must still give:
     * paged out, being read, or staged with one half only (a split window's
     * read-ahead of the next layer reads K halves; read on the spot when the
     * worker refused it, such a block is resident without its V, and only a
     * window, or a pin, fills the other half before it is used) */
    int64_t nb = (n_tokens + B - 1) / B, paged = 0;
    for (int64_t i = 0; i < table_blocks(t, n_tokens, B); i++)
        paged += t->v[i].state == KVT_BLOCK_DURABLE || t->v[i].state == KVT_BLOCK_RESTORING || half_staged(t, i);
    if (!paged)
        return 0;
    kvt__blocks_res *w = t->res;
    if (w->win_size > 0)
        return kvt__fail(KVT_EINVAL, "kvt_kv_window_open: a window is already open on this cache");
    kvt_residency *r = TR(t);
    w->win_size = r ? r->window : DEFAULT_WINDOW;
    w->win_nb = nb;
    w->win_total = nb * passes;
    w->win_cursor = w->win_ahead = 0;
    /* halves: each pass reads the half it uses, unless every paged block fits
     * the window: then whole blocks, held from the K pass for the V pass */
    w->win_split = halves && passes > 1 && paged >= w->win_size;
    window_read_ahead(t);
    return w->win_size;
}

KVT_API int kvt_kv_window_open(kvt_cache *c, int64_t n_tokens, int32_t passes)
{
    return window_open(c, n_tokens, passes, 0);
}

KVT_API int kvt_kv_window_open_halves(kvt_cache *c, int64_t n_tokens, int32_t passes)
{
    return window_open(c, n_tokens, passes, 1);
}

KVT_API int kvt_kv_window_get(kvt_cache *c, int64_t index, kvt_kv_rows *out)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t || !out || !t->res || t->res->win_size <= 0)
        return kvt__fail(KVT_EINVAL, "kvt_kv_window_get: %s", !t ? "not a kv or qkvc cache" : !out ? "out is NULL"
                                                                                           : "no window is open");
    kvt__blocks_res *w = t->res;
    if (w->win_cursor >= w->win_total || index != w->win_cursor % w->win_nb)
        return kvt__fail(KVT_EINVAL, "kvt_kv_window_get: block %lld out of order (position %lld of %lld walks "
                         "block %lld)", (long long)index, (long long)w->win_cursor, (long long)w->win_total,
                         (long long)(w->win_cursor % w->win_nb));
    int part = part_at(w, w->win_cursor);
    w->win_cursor++;
    w->win_ahead = KVT__MAX(w->win_ahead, w->win_cursor);
    if (index >= t->n) { /* a qkvc cache's open block: outside the table, always in RAM */
        window_read_ahead(t);
        return kvt_kv_block_rows(c, index, out);
    }
    int rc = 0;
    kvt__blk *k = &t->v[index];
    if (k->state == KVT_BLOCK_DURABLE || TX(t)[index].rd) {
        uint64_t t0 = kvt_now_ns();
        kvt_residency *sr = TX(t)[index].page->r;
        if (k->state == KVT_BLOCK_DURABLE && (rc = window_make_room(t, index)) == 0) /* not read ahead: now */
            rc = start_read(t, index, KVT_IO_FOREGROUND, part);
        else
            atomic_fetch_add(&sr->readahead_hits, 1);
        if (rc == 0 && TX(t)[index].rd)
            rc = finish_read(t, index);
        atomic_fetch_add(&sr->stall_ns, kvt_now_ns() - t0);
    }
    if (rc == 0 && k->staged && (TX(t)[index].parts & part) != part) { /* staged for another pass */
        uint64_t t0 = kvt_now_ns();
        rc = fill_parts(t, index, part);
        atomic_fetch_add(&TX(t)[index].page->r->stall_ns, kvt_now_ns() - t0);
    }
    if (rc == 0)
        window_read_ahead(t);
    if (rc == 0)
        rc = kvt_kv_block_rows(c, index, out);
    if (rc == 0 && k->staged) { /* a half not read is not handed out */
        if (!(TX(t)[index].parts & PART_K))
            out->k = NULL;
        if (!(TX(t)[index].parts & PART_V))
            out->v = NULL;
    }
    return rc;
}

KVT_API void kvt_kv_window_put(kvt_cache *c, int64_t index)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t || !t->res || t->res->win_size <= 0 || index < 0 || index >= t->n)
        return;
    kvt__blocks_res *w = t->res;
    /* the block's next use in the walk: kept when read-ahead already went past
     * it and the copy holds what that use needs */
    int64_t pos = w->win_cursor - 1 - (w->win_cursor - 1) % w->win_nb + index;
    int next = part_at(w, pos + w->win_nb);
    if (pos + w->win_nb < w->win_ahead && (!t->v[index].staged || (TX(t)[index].parts & next) == next))
        return;
    unstage(t, index);
    window_read_ahead(t);
}

/* kvt_kv_window_close (ahead 1: the next layer's read-ahead starts) and
 * kvt_kv_window_close_same (0). */
static void window_close(kvt_cache *c, int ahead)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t || !t->res || t->res->win_size <= 0)
        return;
    int32_t size = t->res->win_size;
    /* the next layer's walk starts with a K pass: its K halves when this one was split */
    int first = t->res->win_split ? PART_K : PART_ALL;
    t->res->win_size = 0;
    t->res->win_split = 0;
    for (int64_t i = 0; TX(t) && i < t->n; i++)
        unstage(t, i);
    if (!ahead)
        return;
    /* read-ahead: the first paged blocks of the next layer in attention order,
     * within the window, so they load while the rest of this layer computes */
    kvt_residency *r = TR(t);
    kvt__blocks *nx = r && r->read_ahead > 0 ? next_layer(r, t->res->layer) : NULL;
    if (!nx || !TX(nx))
        return;
    int64_t want = KVT__MIN(r->read_ahead, size) - nx->res->held;
    for (int64_t i = 0; i < nx->n && want > 0; i++) {
        if (nx->v[i].state != KVT_BLOCK_DURABLE)
            continue;
        if (start_read(nx, i, KVT_IO_BACKGROUND, first) != 0)
            break;
        want--;
    }
}

KVT_API void kvt_kv_window_close(kvt_cache *c) { window_close(c, 1); }

KVT_API void kvt_kv_window_close_same(kvt_cache *c) { window_close(c, 0); }

KVT_API int kvt_kv_make_resident(kvt_cache *c)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t) /* another kind is always resident */
        return c ? 0 : kvt__fail(KVT_EINVAL, "kvt_kv_make_resident: cache is NULL");
    if (t->res && t->res->win_size > 0)
        return kvt__fail(KVT_EINVAL, "kvt_kv_make_resident: an attention window is open on this cache");
    kvt__blocks_detach(t);
    for (int64_t i = 0; TX(t) && i < t->n; i++) {
        if (TX(t)[i].rd) { /* a read ahead in flight: take it, then it is a RAM copy like the others */
            int rc = finish_read(t, i);
            if (rc)
                return rc;
        }
        if (t->v[i].staged) {
            int rc = fill_parts(t, i, PART_ALL); /* a half staged for a window: the block */
            if (rc)
                return rc;
            staged_sub(t, i);
            t->v[i].staged = false;
        }
        int rc = kvt__blk_make_private(t, i, bb);
        if (rc)
            return rc;
    }
    return 0;
}

KVT_API int kvt_kv_block_state(const kvt_cache *c, int64_t index, kvt_block_state *out)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t || !out)
        return kvt__fail(KVT_EINVAL, "kvt_kv_block_state: %s", !t ? "not a kv or qkvc cache" : "out is NULL");
    if (index < 0 || index >= t->n)
        return kvt__fail(KVT_ERANGE, "kvt_kv_block_state: block %lld of %lld", (long long)index, (long long)t->n);
    if (TX(t))
        poll_write(t, index);
    *out = (kvt_block_state)t->v[index].state;
    return 0;
}

KVT_API int kvt_kv_residency_settle(kvt_cache *c)
{
    int32_t B;
    size_t bb;
    int64_t off;
    kvt__blocks *t = kvt__kv_table(c, &B, &bb, &off);
    if (!t)
        return kvt__fail(KVT_EINVAL, "kvt_kv_residency_settle: not a kv or qkvc cache");
    for (int64_t i = 0; TX(t) && i < t->n; i++)
        if (t->v[i].state == KVT_BLOCK_WRITING)
            wait_write(t, i);
    return kvt__blocks_enforce(t, table_full(t, off, B), bb);
}
