/*
 * store_tier.c: the mem_tier test API over the real SSD tier (see
 * store_tier.h). Test-only. Owns one kvt_store in a temporary directory
 * (removed by destroy) and a kvt_cold_tier table that forwards to the
 * store's own table, counting calls and applying the test knobs.
 */
#include "store_tier.h"
#include "kvtier/io.h"

#include "kvtier/store.h"
#include "store_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct tracked {
    char *ns;
    int32_t *tokens;
    int64_t n;
} tracked;

struct store_tier {
    kvt_cold_tier iface;   /* what the prompt cache calls */
    kvt_cold_tier inner;   /* the store's own table */
    kvt_store *store;
    char root[512];
    store_faults faults;
    kvt_store_io io;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refuse_spills, manual_spills, delay_ms, gate_closed, no_async, loose, fail_restores, fail_writes;
    uint64_t queue_bytes;   /* the store's write-behind bound (0 = its default) */
    int64_t writes_before;  /* entries written by stores closed since create */
    int active_async;
    store_tier_counts c;
    atomic_int_fast64_t hooks_run;
    tracked *tr;
    size_t n_tr, cap_tr;
    kvt_entry *kept; /* spilled entries held like the mem tier holds them */
    size_t n_kept, cap_kept;
};

static void hook_done(void *ctx)
{
    store_tier *t = ctx;
    atomic_fetch_add(&t->hooks_run, 1);
}

static void track(store_tier *t, const kvt_entry *e)
{
    pthread_mutex_lock(&t->mu);
    if (t->n_tr == t->cap_tr) {
        size_t c = t->cap_tr ? t->cap_tr * 2 : 16;
        tracked *v = realloc(t->tr, c * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&t->mu);
            return;
        }
        t->tr = v;
        t->cap_tr = c;
    }
    tracked *x = &t->tr[t->n_tr++];
    x->ns = strdup(e->ns);
    x->n = e->n_tokens;
    x->tokens = malloc(sizeof(int32_t) * (size_t)(e->n_tokens ? e->n_tokens : 1));
    if (e->n_tokens)
        memcpy(x->tokens, e->tokens, sizeof(int32_t) * (size_t)e->n_tokens);
    pthread_mutex_unlock(&t->mu);
}

/* A write failure injected below the store surfaces as -EIO; the mem tier
 * (and the tests written against it) say KVT_EIO. */
static int as_kvt(int rc) { return rc < 0 && rc > -4096 ? KVT_EIO : rc; }

static int st_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    store_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.finds++;
    int loose = t->loose;
    pthread_mutex_unlock(&t->mu);
    if (!loose)
        return t->inner.find(t->inner.self, prompt, n, ns, out);
    /* loose: the longest common prefix over everything written, durable or
     * not checked for reachable ranges (an index that does not know them) */
    int64_t best = 0;
    kvt_cold_hit bh;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n_tr; i++) {
        tracked *x = &t->tr[i];
        if (strcmp(x->ns, ns))
            continue;
        int64_t p = 0, m = x->n < n ? x->n : n;
        while (p < m && x->tokens[p] == prompt[p])
            p++;
        if (p > n - 1)
            p = n - 1;
        kvt_cold_hit h;
        if (p > best && !kvt_store_find_exact(t->store, x->tokens, x->n, ns, &h)) {
            best = p;
            bh = h;
            bh.prefix_len = p;
        }
    }
    pthread_mutex_unlock(&t->mu);
    if (!best)
        return KVT_ENOTFOUND;
    *out = bh;
    return 0;
}

static int st_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    store_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.find_exacts++;
    pthread_mutex_unlock(&t->mu);
    return t->inner.find_exact(t->inner.self, tokens, n, ns, out);
}

static int restore_common(store_tier *t, int rc, kvt_entry *out)
{
    pthread_mutex_lock(&t->mu);
    if (!rc && t->fail_restores) {
        kvt_entry_clear(out);
        rc = KVT_EIO;
    }
    if (!rc) {
        out->hook = (kvt_hook){hook_done, t};
        t->c.hooks_given++;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

static int st_restore(void *self, uint64_t handle, kvt_entry *out)
{
    store_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.restores++;
    int fail = t->fail_restores;
    pthread_mutex_unlock(&t->mu);
    if (fail) {
        memset(out, 0, sizeof *out);
        return KVT_EIO;
    }
    return restore_common(t, t->inner.restore(t->inner.self, handle, out), out);
}

typedef struct ajob {
    store_tier *t;
    kvt_restore_done_fn done;
    void *arg;
} ajob;

static void async_done(void *arg, int status, kvt_entry *e)
{
    ajob *j = arg;
    store_tier *t = j->t;
    pthread_mutex_lock(&t->mu);
    int delay = t->delay_ms;
    pthread_mutex_unlock(&t->mu);
    if (delay > 0) {
        struct timespec ts = {delay / 1000, (long)(delay % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&t->mu);
    while (t->gate_closed)
        pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    kvt_entry mine;
    memset(&mine, 0, sizeof mine);
    if (!status) {
        mine = *e;
        memset(e, 0, sizeof *e);
    }
    status = restore_common(t, status, &mine);
    j->done(j->arg, status, status ? NULL : &mine);
    if (!status)
        kvt_entry_clear(&mine); /* no-op when the callee moved it out */
    pthread_mutex_lock(&t->mu);
    t->active_async--;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    free(j);
}

static int st_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    store_tier *t = self;
    ajob *j = malloc(sizeof *j);
    if (!j)
        return KVT_ENOMEM;
    *j = (ajob){t, done, arg};
    pthread_mutex_lock(&t->mu);
    t->c.async_restores++;
    if (t->no_async) {
        pthread_mutex_unlock(&t->mu);
        free(j);
        return KVT_EAGAIN;
    }
    t->active_async++;
    pthread_mutex_unlock(&t->mu);
    int rc = t->inner.restore_async(t->inner.self, handle, async_done, j);
    if (rc) {
        pthread_mutex_lock(&t->mu);
        t->active_async--;
        pthread_mutex_unlock(&t->mu);
        free(j);
    }
    return rc;
}

static int st_store(void *self, const kvt_entry *e)
{
    store_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.stores++;
    pthread_mutex_unlock(&t->mu);
    int rc = t->inner.store(t->inner.self, e);
    if (rc) {
        pthread_mutex_lock(&t->mu);
        t->c.failed_writes++;
        pthread_mutex_unlock(&t->mu);
        return as_kvt(rc);
    }
    track(t, e);
    return 0;
}

static int st_spill(void *self, kvt_entry *e)
{
    store_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.spills++;
    if (t->refuse_spills) {
        t->c.refused_spills++;
        pthread_mutex_unlock(&t->mu);
        return KVT_EAGAIN;
    }
    int fail = t->fail_writes, manual = t->manual_spills;
    pthread_mutex_unlock(&t->mu);
    /* The store gets an owned clone (no hook) and this wrapper keeps the
     * spilled entry itself (with its hook share) until destroy, as the mem
     * tier does: tests observe when that share is released. */
    kvt_entry copy;
    int rc = kvt_entry_init(&copy, e->ns, e->tokens, e->n_tokens, e->n_caches, e->n_attachments);
    if (!rc && e->n_caches)
        rc = kvt_caches_clone(e->caches, e->n_caches, copy.caches);
    for (int32_t i = 0; !rc && i < e->n_attachments; i++)
        rc = kvt_attachment_clone(e->attachments[i], &copy.attachments[i]);
    if (rc) {
        kvt_entry_clear(&copy);
        return rc;
    }
    rc = t->inner.spill(t->inner.self, &copy);
    if (rc) {
        kvt_entry_clear(&copy);
        if (rc == KVT_EAGAIN) { /* the store's bounded queue is full */
            pthread_mutex_lock(&t->mu);
            t->c.refused_spills++;
            pthread_mutex_unlock(&t->mu);
        }
        return rc;
    }
    track(t, e);
    pthread_mutex_lock(&t->mu);
    if (t->n_kept == t->cap_kept) {
        size_t c = t->cap_kept ? t->cap_kept * 2 : 8;
        kvt_entry *v = realloc(t->kept, c * sizeof *v);
        if (v) {
            t->kept = v;
            t->cap_kept = c;
        }
    }
    if (t->n_kept < t->cap_kept) {
        t->kept[t->n_kept++] = *e;
        memset(e, 0, sizeof *e);
    } else {
        kvt_entry_clear(e);
    }
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&t->mu);
    if (!rc && fail)
        t->c.failed_writes++;
    else if (!rc && !manual)
        t->c.spill_writes++;
    pthread_mutex_unlock(&t->mu);
    if (!rc && !manual)
        kvt_store_flush(t->store); /* the mem tier writes at once */
    return rc;
}

static int st_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    store_tier *t = self;
    pthread_mutex_lock(&t->mu);
    t->c.pendings++;
    pthread_mutex_unlock(&t->mu);
    return t->inner.pending(t->inner.self, tokens, n, ns);
}

static int st_flush(void *self)
{
    store_tier_drain(self);
    return 0;
}

static int st_withdraw(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    store_tier *t = self;
    if (!t->inner.withdraw)
        return KVT_ENOTFOUND;
    int rc = t->inner.withdraw(t->inner.self, tokens, n, ns);
    if (rc == 0) {
        pthread_mutex_lock(&t->mu);
        t->c.withdrawn++;
        pthread_mutex_unlock(&t->mu);
    }
    return rc;
}

/* Opens the store at t->root (a fresh temporary directory when `fresh`). */
static int open_store_at(store_tier *t, int fresh)
{
    if (fresh)
        store_tmpdir(t->root, sizeof t->root, "tiering");
    kvt_store_identity id = {"tiering-test", "any", "tok"};
    kvt_store_options o = {.io = &t->io, .queue_max_bytes = t->queue_bytes};
    int rc = t->root[0] ? kvt_store_open(t->root, &id, &o, &t->store) : KVT_EIO;
    if (!rc)
        kvt_store_cold_tier(t->store, &t->inner);
    return rc;
}

static int open_store(store_tier *t) { return open_store_at(t, 1); }

/* Closes the store, remembering how many entries it wrote. */
static void close_store(store_tier *t)
{
    kvt_store_stats st;
    kvt_store_get_stats(t->store, &st);
    t->writes_before += (int64_t)st.written;
    kvt_store_close(t->store);
    t->store = NULL;
}

static void release_all(store_tier *t)
{
    for (size_t i = 0; i < t->n_kept; i++)
        kvt_entry_clear(&t->kept[i]);
    t->n_kept = 0;
    for (size_t i = 0; i < t->n_tr; i++) {
        free(t->tr[i].ns);
        free(t->tr[i].tokens);
    }
    t->n_tr = 0;
}

void store_tier_clear(store_tier *t)
{
    store_tier_quiesce(t);
    close_store(t);
    store_rmtree(t->root);
    pthread_mutex_lock(&t->mu);
    release_all(t);
    pthread_mutex_unlock(&t->mu);
    if (open_store(t))
        fprintf(stderr, "store_tier_clear: cannot reopen the store: %s\n", kvt_last_error());
}

void store_tier_check_api(void)
{
    const char *src = getenv("KVT_SOURCE_DIR");
    if (!src)
        return;
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/support/mem_tier.h", src);
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char line[1024];
    int bad = 0;
    while (fgets(line, sizeof line, f)) {
        for (char *p = strstr(line, "mem_tier_"); p; p = strstr(p + 1, "mem_tier_")) {
            char name[64];
            int n = 0;
            const char *q = p + strlen("mem_tier_");
            while (n < 63 && ((*q >= 'a' && *q <= 'z') || *q == '_'))
                name[n++] = *q++;
            name[n] = '\0';
            if (*q != '(')
                continue;
            char padded[80];
            snprintf(padded, sizeof padded, " %s ", name);
            if (!strstr(" " STORE_TIER_COVERED " ", padded)) {
                fprintf(stderr, "store_tier: mem_tier_%s() is not implemented over the store "
                                "(add it to tests/support/store_tier.[ch])\n", name);
                bad = 1;
            }
        }
    }
    fclose(f);
    if (bad)
        exit(1);
}

int store_tier_create(store_tier **out)
{
    store_tier *t = calloc(1, sizeof *t);
    if (!t)
        return KVT_ENOMEM;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    store_faults_init(&t->faults, &t->io);
    t->faults.err = EIO;
    int rc = open_store(t);
    if (rc) {
        free(t);
        return rc;
    }
    t->iface = (kvt_cold_tier){.self = t,
                               .find = st_find,
                               .find_exact = st_find_exact,
                               .restore = st_restore,
                               .restore_async = st_restore_async,
                               .store = st_store,
                               .spill = st_spill,
                               .pending = st_pending,
                               .flush = st_flush,
                               .withdraw = st_withdraw};
    *out = t;
    return 0;
}

void store_tier_destroy(store_tier *t)
{
    if (!t)
        return;
    store_tier_gate(t, 0);
    store_faults_gate(&t->faults, 0);
    store_tier_quiesce(t);
    kvt_store_close(t->store);
    store_rmtree(t->root);
    release_all(t);
    free(t->kept);
    free(t->tr);
    free(t);
}

const kvt_cold_tier *store_tier_iface(store_tier *t) { return &t->iface; }

void store_tier_fail_writes(store_tier *t, int on)
{
    pthread_mutex_lock(&t->mu);
    t->fail_writes = on;
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&t->faults.mu);
    t->faults.fail_all = on;
    pthread_mutex_unlock(&t->faults.mu);
}

#define KNOB(name, field)                                                                                      \
    void name(store_tier *t, int v)                                                                            \
    {                                                                                                          \
        pthread_mutex_lock(&t->mu);                                                                            \
        t->field = v;                                                                                          \
        pthread_cond_broadcast(&t->cv);                                                                        \
        pthread_mutex_unlock(&t->mu);                                                                          \
    }
KNOB(store_tier_refuse_spills, refuse_spills)
KNOB(store_tier_async_delay, delay_ms)
KNOB(store_tier_gate, gate_closed)
KNOB(store_tier_no_async, no_async)
KNOB(store_tier_loose_find, loose)
KNOB(store_tier_fail_restores, fail_restores)

/* The store's own bound: it is set when a store opens, so the store is
 * closed (its writes flushed) and opened again on the same directory with
 * the new bound. Call it while no spill is held pending. */
void store_tier_queue_bytes(store_tier *t, int bytes)
{
    store_tier_quiesce(t);
    close_store(t);
    t->queue_bytes = bytes > 0 ? (uint64_t)bytes : 0;
    if (open_store_at(t, 0))
        fprintf(stderr, "store_tier_queue_bytes: cannot reopen the store: %s\n", kvt_last_error());
}

void store_tier_manual_spills(store_tier *t, int on)
{
    pthread_mutex_lock(&t->mu);
    t->manual_spills = on;
    pthread_mutex_unlock(&t->mu);
    store_faults_gate(&t->faults, on); /* the writer waits inside its pwrite */
}

int store_tier_drain(store_tier *t)
{
    kvt_store_stats a, b;
    kvt_store_get_stats(t->store, &a);
    store_faults_gate(&t->faults, 0);
    kvt_store_flush(t->store);
    kvt_store_get_stats(t->store, &b);
    int manual;
    pthread_mutex_lock(&t->mu);
    manual = t->manual_spills;
    int written = (int)(b.written - a.written);
    if (manual)
        t->c.spill_writes += written;
    pthread_mutex_unlock(&t->mu);
    if (manual)
        store_faults_gate(&t->faults, 1);
    return written;
}

void store_tier_quiesce(store_tier *t)
{
    pthread_mutex_lock(&t->mu);
    while (t->active_async)
        pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    /* the store's operations run on the process's I/O worker: a restore's
     * task is freed there after its result was delivered, so a caller about
     * to swap the allocator waits for that too */
    kvt_io *io = NULL;
    if (kvt_io_default_acquire(&io) == 0) {
        (void)kvt_io_flush(io, UINT64_MAX);
        kvt_io_default_release(io);
    }
}

store_tier_counts store_tier_counts_get(store_tier *t)
{
    kvt_store_stats st;
    kvt_store_get_stats(t->store, &st);
    pthread_mutex_lock(&t->mu);
    store_tier_counts c = t->c;
    pthread_mutex_unlock(&t->mu);
    c.hooks_run = atomic_load(&t->hooks_run);
    c.entries = (int64_t)st.entries;
    c.writes = t->writes_before + (int64_t)st.written;
    return c;
}

int store_tier_has(store_tier *t, const char *ns, const int32_t *tokens, int64_t n)
{
    /* durable: find_exact also sees writes still queued */
    return kvt_store_contains(t->store, tokens, n, ns);
}

int store_tier_insert(store_tier *t, kvt_entry *owned)
{
    int rc = kvt_store_put(t->store, owned);
    if (rc)
        return rc;
    track(t, owned);
    kvt_entry_clear(owned);
    return 0;
}
