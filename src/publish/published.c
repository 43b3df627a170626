/*
 * published.c: the read-only cold tier over a publication directory's
 * CURRENT generation (kvtier/publish.h). A generation is validated whole
 * before it is mounted, held by a shared flock on its directory while
 * mounted, and served by a read-only SSD store over it. Switching to a new
 * generation replaces the mount pointer under the tier's mutex: a find sees
 * one generation, and its handle names the generation it came from, so a
 * restore reads the entry from there (the mount before the current one is
 * kept for that until the next switch).
 *
 * Lock rule: `mu` guards the two mount pointers and their reference
 * counts only; no I/O and no store call runs under it. `refresh_mu`
 * serialises refreshes (validation reads files; finds go on meanwhile).
 */
#include "internal.h"
#include "publish_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* Handles: the mount's sequence number (20 bits) above the store's handle. */
#define SEQ_SHIFT 40
#define SEQ_MASK 0xFFFFFu

typedef struct mount {
    int refs;             /* the slot's reference + one per call in flight; under mu */
    uint32_t seq;
    kvt_store *store;
    int gfd;              /* the generation directory, flock(LOCK_SH) held */
    char id[KVT_PUBLISH_ID_LEN];
    uint64_t entries, bytes;
} mount;

struct kvt_published {
    kvt__pub_where w;
    const char *dir;             /* w.dir */
    const kvt_store_identity *identity; /* &w.identity */
    kvt_published_options opts;

    pthread_mutex_t mu;
    mount *cur, *prev;
    uint32_t next_seq;

    pthread_mutex_t refresh_mu;
    kvt_published_status st;    /* under refresh_mu (generation also read under mu) */
    int last_code;              /* the code of the last refusal */

    /* counters (atomic) */
    uint64_t finds, find_hits, restores, restore_failures, write_failures;

    pthread_t poller;
    int poller_started, stop;
    pthread_mutex_t poll_mu;
    pthread_cond_t poll_cv;
};

static void bump(uint64_t *c) { __atomic_fetch_add(c, 1, __ATOMIC_RELAXED); }
static uint64_t load(const uint64_t *c) { return __atomic_load_n(c, __ATOMIC_RELAXED); }

static void mount_free(mount *m)
{
    if (!m)
        return;
    if (m->store)
        kvt_store_close(m->store);
    if (m->gfd >= 0)
        close(m->gfd); /* releases the shared lock */
    kvt__free(m);
}

static void unref(kvt_published *p, mount *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&p->mu);
    int last = --m->refs == 0;
    pthread_mutex_unlock(&p->mu);
    if (last)
        mount_free(m);
}

static mount *ref_current(kvt_published *p)
{
    pthread_mutex_lock(&p->mu);
    mount *m = p->cur;
    if (m)
        m->refs++;
    pthread_mutex_unlock(&p->mu);
    return m;
}

/* Opens, locks, validates and mounts generation id. On a refusal *rep says why. */
static int mount_open(kvt_published *p, const char *id, kvt_publish_report *rep, mount **out)
{
    *out = NULL;
    memset(rep, 0, sizeof *rep);
    memcpy(rep->generation, id, strlen(id) + 1);
    char gpath[4096];
    snprintf(gpath, sizeof gpath, "%s/%s/%s", p->dir, KVT__PUB_GENERATIONS, id);
    mount *m = kvt__calloc(1, sizeof *m);
    if (!m)
        return kvt__fail(KVT_ENOMEM, "published tier: out of memory");
    m->gfd = -1;
    memcpy(m->id, id, strlen(id) + 1);
    int rc = 0;
    m->gfd = open(gpath, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (m->gfd < 0) {
        int e = errno;
        rep->refusal = e == ENOENT ? KVT_PUBLISH_REFUSED_MISSING
                       : e == ELOOP || e == ENOTDIR ? KVT_PUBLISH_REFUSED_SYMLINK
                                                    : KVT_PUBLISH_REFUSED_IO;
        snprintf(rep->detail, sizeof rep->detail, "CURRENT names generation %s: %.600s: %s", id, gpath, strerror(e));
        rc = KVT_EFORMAT;
    }
    /* hold it, then check it is still generations/<id> (a publisher renames
     * a generation away under its exclusive lock before removing it) */
    if (!rc && flock(m->gfd, LOCK_SH | LOCK_NB)) {
        rep->refusal = KVT_PUBLISH_REFUSED_MISSING;
        snprintf(rep->detail, sizeof rep->detail, "generation %s is being removed", id);
        rc = KVT_EFORMAT;
    }
    struct stat a, b;
    if (!rc && (fstat(m->gfd, &a) || stat(gpath, &b) || a.st_ino != b.st_ino || a.st_dev != b.st_dev)) {
        rep->refusal = KVT_PUBLISH_REFUSED_MISSING;
        snprintf(rep->detail, sizeof rep->detail, "generation %s was removed while being opened", id);
        rc = KVT_EFORMAT;
    }
    if (rc) {
        mount_free(m);
        return kvt__fail(rc, "generation %s refused (%s): %s", id, kvt_publish_refusal_name(rep->refusal),
                         rep->detail);
    }
    kvt_publish_validate_opts vo = {.identity = p->identity, .hashes = !p->opts.skip_hashes};
    rc = kvt__pub_validate_at(m->gfd, gpath, id, &vo, rep);
    kvt_store_options so = {.read_only = 1};
    if (!rc)
        rc = kvt_store_open(gpath, p->identity, &so, &m->store);
    if (!rc) {
        kvt_store_stats ss;
        kvt_store_get_stats(m->store, &ss);
        const char *sd = kvt_store_dir(m->store), *slash = strrchr(sd, '/');
        if (strcmp(slash ? slash + 1 : sd, rep->identity_dir)) {
            rep->refusal = KVT_PUBLISH_REFUSED_IDENTITY;
            snprintf(rep->detail, sizeof rep->detail, "its identity directory %s is not this model's %s",
                     rep->identity_dir, slash ? slash + 1 : sd);
            rc = kvt__fail(KVT_EIDENTITY, "generation %s refused (identity): %s", id, rep->detail);
        } else if (ss.entries != rep->entries || ss.blocks != rep->blocks) {
            rep->refusal = KVT_PUBLISH_REFUSED_PARTIAL;
            snprintf(rep->detail, sizeof rep->detail,
                     "the store indexed %llu entries and %llu blocks, the manifest lists %llu and %llu",
                     (unsigned long long)ss.entries, (unsigned long long)ss.blocks,
                     (unsigned long long)rep->entries, (unsigned long long)rep->blocks);
            rc = kvt__fail(KVT_EFORMAT, "generation %s refused (partial): %s", id, rep->detail);
        }
        m->entries = ss.entries;
        m->bytes = rep->bytes;
    }
    if (rc) {
        mount_free(m);
        return rc;
    }
    m->refs = 1;
    *out = m;
    return 0;
}

KVT_API int kvt_published_refresh(kvt_published *p)
{
    if (!p)
        return kvt__fail(KVT_EINVAL, "kvt_published_refresh: NULL tier");
    pthread_mutex_lock(&p->refresh_mu);
    char id[KVT_PUBLISH_ID_LEN];
    kvt_publish_report rep;
    memset(&rep, 0, sizeof rep);
    int rc = kvt__pub_read_current(p->dir, id);
    if (rc == KVT_EFORMAT) {
        snprintf(id, sizeof id, "CURRENT");
        rep.refusal = KVT_PUBLISH_REFUSED_MISSING;
        snprintf(rep.detail, sizeof rep.detail, "%s", kvt_last_error());
    }
    if (rc && rc != KVT_EFORMAT) {
        pthread_mutex_unlock(&p->refresh_mu);
        return rc;
    }
    if (!rc && p->cur && !strcmp(p->cur->id, id)) { /* cur changes only here: read without mu */
        pthread_mutex_unlock(&p->refresh_mu);
        return 0;
    }
    if (p->st.last_refusal && !strcmp(p->st.last_refused, id)) {
        rc = kvt__fail(p->last_code, "generation %s refused (%s): %s", id,
                       kvt_publish_refusal_name(p->st.last_refusal), p->st.last_detail);
        pthread_mutex_unlock(&p->refresh_mu);
        return rc;
    }
    mount *m = NULL;
    if (!rc)
        rc = mount_open(p, id, &rep, &m);
    if (rc) {
        if (rep.refusal) {
            p->st.refusals++;
            p->st.refused[rep.refusal]++;
            p->st.last_refusal = rep.refusal;
            snprintf(p->st.last_detail, sizeof p->st.last_detail, "%s", rep.detail);
            memcpy(p->st.last_refused, id, strlen(id) + 1);
            p->last_code = rc;
            if (rc == KVT_EFORMAT && rep.refusal == KVT_PUBLISH_REFUSED_MISSING)
                kvt__fail(rc, "generation %s refused (missing): %s", id, rep.detail);
        }
        pthread_mutex_unlock(&p->refresh_mu);
        return rc;
    }
    pthread_mutex_lock(&p->mu);
    m->seq = ++p->next_seq & SEQ_MASK;
    mount *old = p->prev;
    p->prev = p->cur;
    p->cur = m;
    memcpy(p->st.generation, id, strlen(id) + 1);
    pthread_mutex_unlock(&p->mu);
    p->st.switches++;
    pthread_mutex_unlock(&p->refresh_mu);
    unref(p, old);
    return 0;
}

static void *poll_main(void *arg)
{
    kvt_published *p = arg;
    pthread_mutex_lock(&p->poll_mu);
    while (!p->stop) {
        struct timespec until = kvt__deadline(CLOCK_MONOTONIC, (uint64_t)p->opts.poll_ms);
        pthread_cond_timedwait(&p->poll_cv, &p->poll_mu, &until);
        if (p->stop)
            break;
        pthread_mutex_unlock(&p->poll_mu);
        kvt_published_refresh(p);
        pthread_mutex_lock(&p->poll_mu);
    }
    pthread_mutex_unlock(&p->poll_mu);
    return NULL;
}

KVT_API void kvt_published_close(kvt_published *p)
{
    if (!p)
        return;
    if (p->poller_started) {
        pthread_mutex_lock(&p->poll_mu);
        p->stop = 1;
        pthread_cond_broadcast(&p->poll_cv);
        pthread_mutex_unlock(&p->poll_mu);
        pthread_join(p->poller, NULL);
    }
    mount_free(p->cur);
    mount_free(p->prev);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->refresh_mu);
    pthread_mutex_destroy(&p->poll_mu);
    pthread_cond_destroy(&p->poll_cv);
    kvt__pub_where_clear(&p->w);
    kvt__free(p);
}

KVT_API int kvt_published_open(const char *dir, const kvt_store_identity *identity,
                               const kvt_published_options *opts, kvt_published **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_published_open: out is NULL");
    *out = NULL;
    kvt__pub_where w;
    int rc = kvt__pub_where_init(&w, dir, identity, "kvt_published_open");
    if (rc)
        return rc;
    kvt_published *p = kvt__calloc(1, sizeof *p);
    if (!p) {
        kvt__pub_where_clear(&w);
        return kvt__fail(KVT_ENOMEM, "kvt_published_open: out of memory");
    }
    p->w = w;
    p->dir = p->w.dir;
    p->identity = &p->w.identity;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->refresh_mu, NULL);
    pthread_mutex_init(&p->poll_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->poll_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (opts)
        p->opts = *opts;
    if (p->opts.poll_ms == 0)
        p->opts.poll_ms = 1000;
    rc = kvt_published_refresh(p);
    if (rc == KVT_ENOMEM) {
        kvt_published_close(p);
        return rc;
    }
    kvt__clear_error();
    if (p->opts.poll_ms > 0) {
        int e = pthread_create(&p->poller, NULL, poll_main, p);
        if (e) {
            kvt_published_close(p);
            return kvt__fail(-e, "kvt_published_open: cannot start the poll thread: %s", strerror(e));
        }
        p->poller_started = 1;
    }
    *out = p;
    return 0;
}

KVT_API void kvt_published_get_status(kvt_published *p, kvt_published_status *out)
{
    if (!p || !out)
        return;
    pthread_mutex_lock(&p->refresh_mu);
    *out = p->st;
    pthread_mutex_unlock(&p->refresh_mu);
}

/* ---- the table ------------------------------------------------------------------------ */

static int encode(const mount *m, kvt_cold_hit *out)
{
    if (out->handle >= ((uint64_t)1 << SEQ_SHIFT))
        return KVT_ENOTFOUND; /* a store handle this large never comes: not served */
    out->handle |= (uint64_t)m->seq << SEQ_SHIFT;
    return 0;
}

static int t_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_published *p = self;
    bump(&p->finds);
    mount *m = ref_current(p);
    if (!m)
        return KVT_ENOTFOUND;
    int rc = kvt_store_find(m->store, prompt, n, ns, out);
    if (!rc)
        rc = encode(m, out);
    unref(p, m);
    if (!rc)
        bump(&p->find_hits);
    return rc;
}

static int t_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    kvt_published *p = self;
    mount *m = ref_current(p);
    if (!m)
        return KVT_ENOTFOUND;
    int rc = kvt_store_find_exact(m->store, tokens, n, ns, out);
    if (!rc)
        rc = encode(m, out);
    unref(p, m);
    return rc;
}

static int t_restore(void *self, uint64_t handle, kvt_entry *out)
{
    kvt_published *p = self;
    if (out)
        memset(out, 0, sizeof *out);
    uint32_t seq = (uint32_t)(handle >> SEQ_SHIFT);
    pthread_mutex_lock(&p->mu);
    mount *m = p->cur && p->cur->seq == seq ? p->cur : p->prev && p->prev->seq == seq ? p->prev : NULL;
    if (m)
        m->refs++;
    pthread_mutex_unlock(&p->mu);
    if (!m || (handle >> SEQ_SHIFT) > SEQ_MASK) {
        unref(p, m);
        bump(&p->restore_failures);
        return kvt__fail(KVT_ENOTFOUND, "published tier: handle from a generation no longer mounted");
    }
    int rc = kvt_store_restore(m->store, handle & (((uint64_t)1 << SEQ_SHIFT) - 1), NULL, 0, out);
    unref(p, m);
    bump(rc ? &p->restore_failures : &p->restores);
    return rc;
}

static int t_store(void *self, const kvt_entry *e)
{
    (void)e;
    kvt_published *p = self;
    bump(&p->write_failures);
    return kvt__fail(KVT_EREADONLY, "published prompt cache %s is read-only", p->dir);
}

static int t_stats(void *self, kvt_tier_stats *out)
{
    kvt_published *p = self;
    memset(out, 0, sizeof *out);
    out->finds = load(&p->finds);
    out->find_hits = load(&p->find_hits);
    out->restores = load(&p->restores);
    out->restore_failures = load(&p->restore_failures);
    out->write_failures = load(&p->write_failures);
    pthread_mutex_lock(&p->mu);
    if (p->cur) {
        out->entries = p->cur->entries;
        out->bytes = p->cur->bytes;
    }
    pthread_mutex_unlock(&p->mu);
    return 0;
}

KVT_API void kvt_published_cold_tier(kvt_published *p, kvt_cold_tier *out)
{
    if (!out)
        return;
    *out = (kvt_cold_tier){.self = p,
                           .find = t_find,
                           .find_exact = t_find_exact,
                           .restore = t_restore,
                           .store = t_store,
                           .stats = t_stats,
                           .flags = KVT_TIER_READ_ONLY};
}
