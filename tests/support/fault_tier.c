/*
 * fault_tier.c: the forwarding, fault-injecting tier of fault_tier.h. Owns
 * only its knobs and counters (atomics; the hold under a mutex); never keeps
 * an entry.
 */
#include "fault_tier.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct fault_tier {
    kvt_cold_tier iface;
    kvt_cold_tier inner;
    atomic_int fail_restores;
    atomic_int_fast64_t finds, finds_done, restores;
    pthread_mutex_t mu; /* guards held */
    pthread_cond_t cv;
    int held;
};

/* While finds are held, waits for the release (at most HOLD_MAX_S, so a
 * caller that wrongly waits for the find fails instead of hanging). */
#define HOLD_MAX_S 30

static void hold(fault_tier *f)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += HOLD_MAX_S;
    pthread_mutex_lock(&f->mu);
    while (f->held && pthread_cond_timedwait(&f->cv, &f->mu, &dl) == 0)
        ;
    pthread_mutex_unlock(&f->mu);
}

static int ft_find(void *self, const int32_t *p, int64_t n, const char *ns, kvt_cold_hit *out)
{
    fault_tier *f = self;
    atomic_fetch_add(&f->finds, 1);
    hold(f);
    int rc = f->inner.find(f->inner.self, p, n, ns, out);
    atomic_fetch_add(&f->finds_done, 1);
    return rc;
}

static int ft_find_exact(void *self, const int32_t *t, int64_t n, const char *ns, kvt_cold_hit *out)
{
    fault_tier *f = self;
    hold(f);
    return f->inner.find_exact(f->inner.self, t, n, ns, out);
}

static int ft_restore(void *self, uint64_t h, kvt_entry *out)
{
    fault_tier *f = self;
    atomic_fetch_add(&f->restores, 1);
    if (atomic_load(&f->fail_restores)) {
        memset(out, 0, sizeof *out);
        return KVT_EIO;
    }
    return f->inner.restore(f->inner.self, h, out);
}

static int ft_restore_async(void *self, uint64_t h, kvt_restore_done_fn done, void *arg)
{
    fault_tier *f = self;
    atomic_fetch_add(&f->restores, 1);
    if (atomic_load(&f->fail_restores)) {
        done(arg, KVT_EIO, NULL);
        return 0;
    }
    return f->inner.restore_async(f->inner.self, h, done, arg);
}

static int ft_store(void *self, const kvt_entry *e)
{
    fault_tier *f = self;
    return f->inner.store(f->inner.self, e);
}

static int ft_spill(void *self, kvt_entry *e)
{
    fault_tier *f = self;
    return f->inner.spill(f->inner.self, e);
}

/* A read-only tier that keeps its write operations and refuses them: the
 * chain must go by the flag, not by the operations being NULL. */
static int ft_store_ro(void *self, const kvt_entry *e) { return KVT_EREADONLY; }
static int ft_spill_ro(void *self, kvt_entry *e) { return KVT_EREADONLY; }

static int ft_pending(void *self, const int32_t *t, int64_t n, const char *ns)
{
    fault_tier *f = self;
    return f->inner.pending(f->inner.self, t, n, ns);
}

static int ft_flush(void *self)
{
    fault_tier *f = self;
    return f->inner.flush(f->inner.self);
}

static int ft_withdraw(void *self, const int32_t *t, int64_t n, const char *ns)
{
    fault_tier *f = self;
    return f->inner.withdraw(f->inner.self, t, n, ns);
}

static int ft_stats(void *self, kvt_tier_stats *out)
{
    fault_tier *f = self;
    return f->inner.stats(f->inner.self, out);
}

static void ft_set_evict(void *self, kvt_tier_evict_fn fn, void *arg)
{
    fault_tier *f = self;
    f->inner.set_evict(f->inner.self, fn, arg);
}

int fault_tier_create(const kvt_cold_tier *inner, int read_only, fault_tier **out)
{
    fault_tier *f = calloc(1, sizeof *f);
    if (!f)
        return KVT_ENOMEM;
    f->inner = *inner;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->iface = (kvt_cold_tier){.self = f,
                               .find = ft_find,
                               .find_exact = inner->find_exact ? ft_find_exact : NULL,
                               .restore = ft_restore,
                               .restore_async = inner->restore_async ? ft_restore_async : NULL,
                               .store = read_only ? ft_store_ro : ft_store,
                               .spill = read_only ? ft_spill_ro : inner->spill ? ft_spill : NULL,
                               .pending = inner->pending ? ft_pending : NULL,
                               .flush = inner->flush ? ft_flush : NULL,
                               .withdraw = inner->withdraw && !read_only ? ft_withdraw : NULL,
                               .stats = inner->stats ? ft_stats : NULL,
                               .set_evict = inner->set_evict ? ft_set_evict : NULL,
                               .flags = inner->flags | (read_only ? KVT_TIER_READ_ONLY : 0)};
    *out = f;
    return 0;
}

void fault_tier_destroy(fault_tier *f)
{
    if (!f)
        return;
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f);
}
const kvt_cold_tier *fault_tier_iface(fault_tier *f) { return &f->iface; }
void fault_tier_hold_finds(fault_tier *f, int on)
{
    pthread_mutex_lock(&f->mu);
    f->held = on;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}
void fault_tier_fail_restores(fault_tier *f, int on) { atomic_store(&f->fail_restores, on); }
int64_t fault_tier_finds(fault_tier *f) { return atomic_load(&f->finds); }
int64_t fault_tier_finds_done(fault_tier *f) { return atomic_load(&f->finds_done); }
int64_t fault_tier_restores(fault_tier *f) { return atomic_load(&f->restores); }
