/*
 * test_prompt_cache_unlocked.c: the prompt cache asks its cold tier (find,
 * find_exact, pending) WITHOUT its lock, since a lookup may block on I/O (a
 * remote tier). A gated cold tier (the in-memory tier of tests/support
 * behind a table whose next find / find_exact / pending can be held on a
 * condition variable) blocks one lookup of lend, prefetch, object lend,
 * eviction, relieve or demote_idle while another thread puts, clears, evicts
 * or lends in the same cache. Each case checks that the other thread is not
 * held up (no deadlock: the test dies after 10 s instead of hanging), that
 * the blocked call re-finds its RAM candidate or drops what went stale
 * (never a stale pointer: the ASan and TSan builds run this file), and what
 * it returns. A last case runs several threads over a tier whose lookups
 * yield, with a printed seed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_seed.h"

#include "kvtier/prompt_cache.h"
#include "mem_tier.h"
#include "pc_util.h"

#define MB ((size_t)1 << 20)
#define DEADLOCK_MS 10000

/* ---- the gated tier --------------------------------------------------------------- */

enum { G_FIND = 1, G_FIND_EXACT = 2, G_PENDING = 4 };

typedef struct gate_tier {
    const kvt_cold_tier *inner; /* the mem_tier's table */
    kvt_cold_tier iface;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int armed;     /* G_* ops whose next call blocks (one call, then disarmed) */
    int blocked;   /* calls waiting at the gate */
    int open;      /* the gate let them go */
    int yield;     /* every lookup yields the CPU first (the random case) */
} gate_tier;

static void die_after(const char *what)
{
    fprintf(stderr, "deadlock: %s did not happen within %d ms\n", what, DEADLOCK_MS);
    _exit(1); /* threads are stuck on locks: cmocka could not go on */
}

static struct timespec deadline(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += DEADLOCK_MS / 1000;
    return ts;
}

/* At the entry of a lookup: blocks here when `op` is armed. */
static void gate_pass(gate_tier *g, int op)
{
    if (g->yield)
        sched_yield();
    pthread_mutex_lock(&g->mu);
    if (g->armed & op) {
        g->armed &= ~op;
        g->blocked++;
        pthread_cond_broadcast(&g->cv);
        struct timespec dl = deadline();
        while (!g->open)
            if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT)
                die_after("the gate opening");
        g->blocked--;
    }
    pthread_mutex_unlock(&g->mu);
}

static int g_find(void *self, const int32_t *p, int64_t n, const char *ns, kvt_cold_hit *out)
{
    gate_tier *g = self;
    gate_pass(g, G_FIND);
    return g->inner->find(g->inner->self, p, n, ns, out);
}

static int g_find_exact(void *self, const int32_t *t, int64_t n, const char *ns, kvt_cold_hit *out)
{
    gate_tier *g = self;
    gate_pass(g, G_FIND_EXACT);
    return g->inner->find_exact(g->inner->self, t, n, ns, out);
}

static int g_pending(void *self, const int32_t *t, int64_t n, const char *ns)
{
    gate_tier *g = self;
    gate_pass(g, G_PENDING);
    return g->inner->pending(g->inner->self, t, n, ns);
}

static int g_restore(void *self, uint64_t h, kvt_entry *out)
{
    gate_tier *g = self;
    return g->inner->restore(g->inner->self, h, out);
}

static int g_restore_async(void *self, uint64_t h, kvt_restore_done_fn done, void *arg)
{
    gate_tier *g = self;
    return g->inner->restore_async(g->inner->self, h, done, arg);
}

static int g_store(void *self, const kvt_entry *e)
{
    gate_tier *g = self;
    return g->inner->store(g->inner->self, e);
}

static int g_spill(void *self, kvt_entry *e)
{
    gate_tier *g = self;
    return g->inner->spill(g->inner->self, e);
}

static int g_flush(void *self)
{
    gate_tier *g = self;
    return g->inner->flush ? g->inner->flush(g->inner->self) : 0;
}

static int g_withdraw(void *self, const int32_t *t, int64_t n, const char *ns)
{
    gate_tier *g = self;
    return g->inner->withdraw ? g->inner->withdraw(g->inner->self, t, n, ns) : KVT_ENOTFOUND;
}

static void gate_init(gate_tier *g, mem_tier *mt)
{
    memset(g, 0, sizeof *g);
    g->inner = mem_tier_iface(mt);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->iface = (kvt_cold_tier){.self = g,
                               .find = g_find,
                               .find_exact = g_find_exact,
                               .restore = g_restore,
                               .restore_async = g->inner->restore_async ? g_restore_async : NULL,
                               .store = g_store,
                               .spill = g->inner->spill ? g_spill : NULL,
                               .pending = g->inner->pending ? g_pending : NULL,
                               .flush = g_flush,
                               .withdraw = g_withdraw};
}

static void gate_destroy(gate_tier *g)
{
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

static void gate_arm(gate_tier *g, int ops)
{
    pthread_mutex_lock(&g->mu);
    g->armed = ops;
    g->open = 0;
    pthread_mutex_unlock(&g->mu);
}

/* Waits until a call is held at the gate. */
static void gate_wait_blocked(gate_tier *g)
{
    pthread_mutex_lock(&g->mu);
    struct timespec dl = deadline();
    while (g->blocked == 0)
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT)
            die_after("a lookup reaching the gate");
    pthread_mutex_unlock(&g->mu);
}

static void gate_open(gate_tier *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    g->armed = 0;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* ---- running one call on another thread -------------------------------------------- */

typedef struct call {
    pthread_t th;
    void (*fn)(struct call *);
    kvt_prompt_cache *pc;
    const int32_t *tokens;
    int64_t n;
    const char *key;
    int rc;
    int64_t count;
    kvt_hit hit;
    kvt_lease *lease;
    atomic_int done;
} call;

static void *call_main(void *p)
{
    call *c = p;
    c->fn(c);
    atomic_store(&c->done, 1);
    return NULL;
}

static void call_start(call *c, void (*fn)(call *))
{
    c->fn = fn;
    atomic_init(&c->done, 0);
    assert_int_equal(pthread_create(&c->th, NULL, call_main, c), 0);
}

static void call_join(call *c)
{
    for (int ms = 0; !atomic_load(&c->done); ms++) {
        if (ms > DEADLOCK_MS)
            die_after("the blocked call returning");
        usleep(1000);
    }
    pthread_join(c->th, NULL);
}

static void do_lend(call *c) { c->rc = kvt_prompt_cache_lend(c->pc, c->tokens, c->n, "", NULL, &c->hit); }
static void do_put(call *c) { c->rc = pcu_put_fresh(c->pc, "", c->tokens, c->n, "k", NULL); }
static void do_prefetch(call *c) { c->rc = kvt_prompt_cache_prefetch(c->pc, c->tokens, c->n, "", NULL, &c->lease); }
static void do_object_lend(call *c) { c->rc = kvt_prompt_cache_object_lend(c->pc, c->key, &c->hit); }
static void do_demote_idle(call *c) { c->rc = kvt_prompt_cache_demote_idle(c->pc, 0, &c->count); }

static int over_once_flag;
static int over_once(void *ctx)
{
    (void)ctx;
    return over_once_flag-- > 0;
}
static void do_relieve(call *c)
{
    over_once_flag = 1;
    c->rc = kvt_prompt_cache_relieve(c->pc, over_once, NULL, &c->count);
}

/* ---- fixtures ------------------------------------------------------------------------ */

/* A prompt cache over the gated in-memory tier, and the prompts the cases
 * use: t = 1, 2, ..., 16 and u = 500, 501, ..., 515. */
typedef struct fixture {
    mem_tier *mt;
    gate_tier g;
    kvt_prompt_cache *pc;
    int32_t t[16], u[16];
} fixture;

static void fx_open(fixture *f, size_t max_bytes, uint32_t flags)
{
    assert_int_equal(mem_tier_create(&f->mt), 0);
    gate_init(&f->g, f->mt);
    kvt_prompt_cache_config cfg = {.max_bytes = max_bytes, .cold = &f->g.iface, .flags = flags};
    assert_int_equal(kvt_prompt_cache_create(&cfg, &f->pc), 0);
    pcu_seq(f->t, 16, 1);
    pcu_seq(f->u, 16, 500);
}

static void fx_close(fixture *f)
{
    kvt_prompt_cache_destroy(f->pc);
    mem_tier_destroy(f->mt);
    gate_destroy(&f->g);
}

/* cmocka fixtures: a 64 MB cache, with write-behind (fx_setup) or without
 * (fx_setup_no_wb: the tier holds only what a case puts there). */
static int fx_setup_flags(void **state, uint32_t flags)
{
    fixture *f = calloc(1, sizeof *f);
    assert_non_null(f);
    fx_open(f, 64 * MB, flags);
    *state = f;
    return 0;
}
static int fx_setup(void **state) { return fx_setup_flags(state, 0); }
static int fx_setup_no_wb(void **state) { return fx_setup_flags(state, KVT_PC_NO_WRITE_BEHIND); }
static int fx_teardown(void **state)
{
    fx_close(*state);
    free(*state);
    return 0;
}

/* Starts fn(c) on another thread and returns once its next lookup of the
 * kinds `ops` is held at the gate. */
static void start_blocked(fixture *f, int ops, call *c, void (*fn)(call *))
{
    gate_arm(&f->g, ops);
    call_start(c, fn);
    gate_wait_blocked(&f->g);
}

/* Lets the held lookup go and waits for the call to return. */
static void finish_blocked(fixture *f, call *c)
{
    gate_open(&f->g);
    call_join(c);
}

/* stores (tokens) with a fresh kv cache directly in the cold tier */
static void tier_put(mem_tier *mt, const int32_t *t, int64_t n)
{
    kvt_entry e;
    assert_int_equal(kvt_entry_init(&e, "", t, n, 1, 0), 0);
    assert_int_equal(pcu_fresh("k", e.caches, t, n), 0);
    assert_int_equal(mem_tier_insert(mt, &e), 0);
}

/* the hit lends tokens[0..p) of `t` with caches at p */
static void assert_lends(const kvt_hit *h, const int32_t *t, int64_t p)
{
    assert_int_equal(h->prefix_len, p);
    assert_int_equal(h->entry.n_tokens, p);
    assert_memory_equal(h->entry.tokens, t, (size_t)p * sizeof(int32_t));
    assert_int_equal(h->entry.n_caches, 1);
    assert_int_equal(kvt_cache_offset(h->entry.caches[0]), p);
}

/* ---- lend ---------------------------------------------------------------------------- */

/* While lend's find is held, a put of a longer entry supersedes lend's RAM
 * candidate (it leaves and is disposed): lend re-finds and lends the new
 * one, never the disposed entry. */
static void test_lend_put_supersedes_candidate(void **state)
{
    fixture *f = *state; /* no write-behind: the tier stays empty */
    const int32_t *t = f->t;
    assert_int_equal(pcu_put_fresh(f->pc, "", t, 8, "k", NULL), 0);
    call l = {.pc = f->pc, .tokens = t, .n = 12};
    start_blocked(f, G_FIND, &l, do_lend);
    /* the other thread is not held up by the blocked lookup */
    assert_int_equal(pcu_put_fresh(f->pc, "", t, 10, "k", NULL), 0);
    assert_int_equal(pcu_stats(f->pc).supersedes, 1);
    assert_int_equal(kvt_prompt_cache_peek(f->pc, t, 12, "", NULL), 10);
    finish_blocked(f, &l);
    assert_int_equal(l.rc, 0);
    assert_int_equal(l.hit.source, KVT_HIT_RAM);
    assert_lends(&l.hit, t, 10);
    kvt_hit_clear(&l.hit);
    kvt_prompt_cache_stats s = pcu_stats(f->pc);
    assert_int_equal(s.relookups, 1);
    assert_int_equal(s.hits, 1);
    assert_int_equal(s.cold_restores, 0);
}

/* A clear while lend's find is held: the RAM candidate is gone, and the cold
 * tier's prefix (shorter than the candidate was, longer than what RAM has
 * now) serves. */
static void test_lend_clear_then_cold_serves(void **state)
{
    fixture *f = *state;
    const int32_t *t = f->t;
    tier_put(f->mt, t, 6);
    assert_int_equal(pcu_put_fresh(f->pc, "", t, 8, "k", NULL), 0);
    call l = {.pc = f->pc, .tokens = t, .n = 12};
    start_blocked(f, G_FIND, &l, do_lend);
    kvt_prompt_cache_clear(f->pc);
    assert_int_equal(pcu_stats(f->pc).entries, 0);
    finish_blocked(f, &l);
    assert_int_equal(l.rc, 0);
    assert_int_equal(l.hit.source, KVT_HIT_COLD);
    assert_lends(&l.hit, t, 6);
    kvt_hit_clear(&l.hit);
    kvt_prompt_cache_stats s = pcu_stats(f->pc);
    assert_int_equal(s.relookups, 1);
    assert_int_equal(s.cold_restores, 1);
}

/* An eviction of the candidate while lend's find is held: the evicted entry
 * went to the cold tier (spilled), so lend restores it from there. */
static void test_lend_evict_candidate(void **state)
{
    fixture *f = *state;
    const int32_t *t = f->t;
    assert_int_equal(pcu_put_fresh(f->pc, "", t, 8, "k", NULL), 0);
    call l = {.pc = f->pc, .tokens = t, .n = 12};
    start_blocked(f, G_FIND, &l, do_lend);
    int64_t k = 0;
    assert_int_equal(kvt_prompt_cache_evict(f->pc, 1, &k), 0);
    assert_int_equal(k, 1);
    assert_true(mem_tier_has(f->mt, "", t, 8));
    finish_blocked(f, &l);
    assert_int_equal(l.rc, 0);
    assert_int_equal(l.hit.source, KVT_HIT_COLD);
    assert_lends(&l.hit, t, 8);
    kvt_hit_clear(&l.hit);
    assert_int_equal(pcu_stats(f->pc).relookups, 1);
}

/* Without a change in between, lend lends its first candidate: no
 * re-lookup; and a RAM prefix of n - 1 tokens never asks the tier (nothing
 * can be strictly longer). */
static void test_lend_unchanged_and_full(void **state)
{
    fixture *f = *state;
    const int32_t *t = f->t;
    assert_int_equal(pcu_put_fresh(f->pc, "", t, 8, "k", NULL), 0);
    int64_t finds = mem_tier_counts_get(f->mt).finds;
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(f->pc, t, 12, "", NULL, &h), 0);
    assert_lends(&h, t, 8);
    kvt_hit_clear(&h);
    assert_int_equal(mem_tier_counts_get(f->mt).finds, finds + 1);
    assert_int_equal(kvt_prompt_cache_lend(f->pc, t, 9, "", NULL, &h), 0);
    assert_lends(&h, t, 8);
    kvt_hit_clear(&h);
    assert_int_equal(mem_tier_counts_get(f->mt).finds, finds + 1);
    assert_int_equal(pcu_stats(f->pc).relookups, 0);
}

/* ---- prefetch, objects --------------------------------------------------------------- */

/* prefetch's find is held while another thread puts and clears: the read
 * then starts, loads the cold entry and pins it. */
static void test_prefetch_find_unlocked(void **state)
{
    fixture *f = *state;
    const int32_t *t = f->t, *u = f->u;
    tier_put(f->mt, t, 10);
    call c = {.pc = f->pc, .tokens = t, .n = 12};
    start_blocked(f, G_FIND, &c, do_prefetch);
    assert_int_equal(pcu_put_fresh(f->pc, "", u, 8, "k", NULL), 0);
    kvt_prompt_cache_clear(f->pc);
    finish_blocked(f, &c);
    assert_int_equal(c.rc, 0);
    assert_int_equal(kvt_lease_wait(c.lease, 5000), 0);
    assert_int_equal(kvt_prompt_cache_peek(f->pc, t, 12, "", NULL), 10);
    kvt_prompt_cache_stats s = pcu_stats(f->pc);
    assert_int_equal(s.prefetch_reads, 1);
    assert_int_equal(s.pinned, 1);
    kvt_lease_release(c.lease);
    assert_int_equal(pcu_stats(f->pc).pinned, 0);
}

/* object lend's find_exact is held while another thread puts the same
 * object into RAM: the lend restores and lends the object. */
static void test_object_lend_unlocked(void **state)
{
    fixture *f = *state;
    kvt_attachment *att;
    assert_int_equal(kvt_attachment_blob("x", "img1", 5, &att), 0);
    assert_int_equal(kvt_prompt_cache_object_put(f->pc, "img1", &att, 1, NULL), 0);
    kvt_prompt_cache_clear(f->pc); /* in the tier only (written behind) */
    call c = {.pc = f->pc, .key = "img1"};
    start_blocked(f, G_FIND_EXACT, &c, do_object_lend);
    assert_int_equal(kvt_attachment_blob("x", "img1", 5, &att), 0);
    assert_int_equal(kvt_prompt_cache_object_put(f->pc, "img1", &att, 1, NULL), 0);
    finish_blocked(f, &c);
    assert_int_equal(c.rc, 0);
    assert_int_equal(c.hit.entry.n_attachments, 1);
    size_t nb;
    const char *d = kvt_attachment_blob_data(c.hit.entry.attachments[0], &nb);
    assert_int_equal(nb, 5);
    assert_string_equal(d, "img1");
    kvt_hit_clear(&c.hit);
}

/* object lend's find_exact is held while another thread clears the cache:
 * the object read from the tier belongs to the time before the clear, so
 * it is not published (epoch check) and the lend says so; a lend after the
 * clear restores and publishes it. */
static void test_object_lend_cleared_meanwhile(void **state)
{
    fixture *f = *state;
    kvt_attachment *att;
    assert_int_equal(kvt_attachment_blob("x", "img1", 5, &att), 0);
    assert_int_equal(kvt_prompt_cache_object_put(f->pc, "img1", &att, 1, NULL), 0);
    kvt_prompt_cache_clear(f->pc); /* in the tier only (written behind) */
    call c = {.pc = f->pc, .key = "img1"};
    start_blocked(f, G_FIND_EXACT, &c, do_object_lend);
    kvt_prompt_cache_clear(f->pc);
    finish_blocked(f, &c);
    assert_int_equal(c.rc, KVT_ESTALE);
    assert_int_equal(pcu_stats(f->pc).entries, 0);
    assert_int_equal(pcu_stats(f->pc).bytes, 0);
    assert_int_equal(kvt_prompt_cache_object_lend(f->pc, "img1", &c.hit), 0);
    assert_int_equal(c.hit.source, KVT_HIT_COLD);
    kvt_hit_clear(&c.hit);
    kvt_prompt_cache_stats s = pcu_stats(f->pc);
    assert_int_equal(s.entries, 1);
    assert_int_equal(s.object_restores, 2);
}

/* ---- eviction, relieve, demote_idle -------------------------------------------------- */

/* A put over the budget evicts; its question to the tier (pending) is held
 * while another thread lends, puts and evicts the very victim. The put then
 * finishes against what the cache is now: the budget holds, nothing left
 * twice, every entry counted. */
static void test_evict_ask_unlocked(void **state)
{
    (void)state;
    int32_t t[3][16];
    for (int i = 0; i < 3; i++)
        pcu_seq(t[i], 16, 100 * (i + 1));
    kvt_cache *c[1];
    assert_int_equal(pcu_fresh("k", c, t[0], 8), 0);
    size_t one = pcu_unique_bytes(c, 1);
    kvt_cache_destroy(c[0]);
    fixture f;
    fx_open(&f, 2 * one, KVT_PC_NO_WRITE_BEHIND | KVT_PC_EVICT_ONLY_DURABLE);
    assert_int_equal(pcu_put_fresh(f.pc, "", t[0], 8, "k", NULL), 0);
    assert_int_equal(pcu_put_fresh(f.pc, "", t[1], 8, "k", NULL), 0);
    call p = {.pc = f.pc, .tokens = t[2], .n = 8};
    start_blocked(&f, G_PENDING, &p, do_put); /* over budget: asks the tier about the LRU entry t[0] */
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(f.pc, t[1], 12, "", NULL, &h), 0);
    assert_lends(&h, t[1], 8);
    kvt_hit_clear(&h);
    int64_t k = 0;
    assert_int_equal(kvt_prompt_cache_evict(f.pc, 1, &k), 0); /* the same victim */
    assert_int_equal(k, 1);
    assert_true(mem_tier_has(f.mt, "", t[0], 8));
    finish_blocked(&f, &p);
    assert_int_equal(p.rc, 0);
    kvt_prompt_cache_stats s = pcu_stats(f.pc);
    assert_true(s.bytes <= s.max_bytes);
    assert_int_equal(s.entries, 2);
    assert_int_equal(s.evictions, 1);
    assert_int_equal(kvt_prompt_cache_peek(f.pc, t[1], 12, "", NULL), 8);
    assert_int_equal(kvt_prompt_cache_peek(f.pc, t[2], 12, "", NULL), 8);
    assert_int_equal(mem_tier_counts_get(f.mt).spills, 1); /* t[0] written once */
    fx_close(&f);
}

/* relieve's question to the tier is held while another thread clears: the
 * victim is gone when relieve looks again, so it releases nothing more. */
static void test_relieve_ask_unlocked(void **state)
{
    fixture *f = *state;
    const int32_t *t = f->t;
    assert_int_equal(pcu_put_fresh(f->pc, "", t, 8, "k", NULL), 0);
    call r = {.pc = f->pc};
    start_blocked(f, G_FIND_EXACT, &r, do_relieve);
    kvt_prompt_cache_clear(f->pc);
    finish_blocked(f, &r);
    assert_int_equal(r.rc, 0);
    assert_int_equal(r.count, 0);
    assert_int_equal(pcu_stats(f->pc).demotions, 0);
}

/* demote_idle asks the tier (pending) off-lock while another thread lends
 * from and re-puts the idle entry: the entry the tier holds leaves once. */
static void test_demote_idle_ask_unlocked(void **state)
{
    fixture *f = *state;
    const int32_t *t = f->t, *u = f->u;
    assert_int_equal(pcu_put_fresh(f->pc, "", t, 8, "k", NULL), 0); /* written behind */
    assert_int_equal(pcu_put_fresh(f->pc, "", u, 8, "k", NULL), 0);
    call d = {.pc = f->pc};
    start_blocked(f, G_PENDING, &d, do_demote_idle);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(f->pc, u, 12, "", NULL, &h), 0);
    assert_lends(&h, u, 8);
    kvt_hit_clear(&h);
    assert_int_equal(pcu_put_fresh(f->pc, "", u, 8, "k", NULL), 0); /* replaces u: a new entry */
    finish_blocked(f, &d);
    assert_int_equal(d.rc, 0);
    assert_int_equal(d.count, 1); /* t left; u was replaced meanwhile and stays */
    assert_int_equal(kvt_prompt_cache_peek(f->pc, t, 12, "", NULL), 0);
    assert_int_equal(kvt_prompt_cache_peek(f->pc, u, 12, "", NULL), 8);
    assert_int_equal(pcu_stats(f->pc).entries, 1);
}

/* ---- many threads over a yielding tier ----------------------------------------------- */

typedef struct rarg {
    kvt_prompt_cache *pc;
    unsigned seed;
    atomic_int *bad;
} rarg;

static unsigned rnd(unsigned *s, unsigned n)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) % n;
}

static void *rworker(void *p)
{
    rarg *a = p;
    unsigned s = a->seed;
    for (int it = 0; it < 400; it++) {
        int32_t prompt[24];
        int64_t n = 2 + rnd(&s, 22);
        int32_t base = 1000 * (int32_t)rnd(&s, 3);
        for (int64_t i = 0; i < n; i++)
            prompt[i] = base + (int32_t)i;
        unsigned op = rnd(&s, 100);
        if (op < 55) {
            kvt_hit h;
            if (kvt_prompt_cache_lend(a->pc, prompt, n, "", NULL, &h) != 0)
                continue;
            if (h.prefix_len > 0 &&
                (h.entry.n_tokens != h.prefix_len || h.prefix_len > n - 1 ||
                 memcmp(h.entry.tokens, prompt, (size_t)h.prefix_len * sizeof(int32_t)) != 0 ||
                 kvt_cache_offset(h.entry.caches[0]) != h.prefix_len))
                atomic_fetch_add(a->bad, 1);
            kvt_hit_clear(&h);
        } else if (op < 85) {
            pcu_put_fresh(a->pc, "", prompt, n, "k", NULL);
        } else if (op < 93) {
            kvt_prompt_cache_evict(a->pc, 1 + rnd(&s, 2), NULL);
        } else if (op < 97) {
            kvt_lease *l = NULL;
            if (kvt_prompt_cache_prefetch(a->pc, prompt, n, "", NULL, &l) == 0) {
                kvt_lease_wait(l, 100);
                kvt_lease_release(l);
            }
        } else {
            kvt_prompt_cache_clear(a->pc);
        }
    }
    return NULL;
}

static void test_random_yielding_tier(void **state)
{
    (void)state;
    unsigned seed = (unsigned)test_seed("test_random_yielding_tier");
    for (int round = 0; round < 2; round++) {
        fixture f;
        fx_open(&f, 6000, round ? KVT_PC_EVICT_ONLY_DURABLE | KVT_PC_PROMOTE_RESTORES : 0);
        f.g.yield = 1;
        atomic_int bad;
        atomic_init(&bad, 0);
        pthread_t th[4];
        rarg a[4];
        for (int i = 0; i < 4; i++) {
            a[i] = (rarg){f.pc, seed + 7919u * (unsigned)i + (unsigned)round, &bad};
            assert_int_equal(pthread_create(&th[i], NULL, rworker, &a[i]), 0);
        }
        for (int i = 0; i < 4; i++)
            pthread_join(th[i], NULL);
        assert_int_equal(atomic_load(&bad), 0);
        kvt_prompt_cache_stats s = pcu_stats(f.pc);
        if (round == 0) /* only-durable may stop at an entry whose write is being queued */
            assert_true(s.bytes <= s.max_bytes);
        kvt_prompt_cache_clear(f.pc);
        assert_int_equal(pcu_stats(f.pc).bytes, 0);
        fx_close(&f);
    }
}

/* argv[1] (optional): a test-name pattern (cmocka_set_test_filter), to
 * run one case on its own. */
int main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_lend_put_supersedes_candidate, fx_setup_no_wb, fx_teardown),
        cmocka_unit_test_setup_teardown(test_lend_clear_then_cold_serves, fx_setup_no_wb, fx_teardown),
        cmocka_unit_test_setup_teardown(test_lend_evict_candidate, fx_setup_no_wb, fx_teardown),
        cmocka_unit_test_setup_teardown(test_lend_unchanged_and_full, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_prefetch_find_unlocked, fx_setup_no_wb, fx_teardown),
        cmocka_unit_test_setup_teardown(test_object_lend_unlocked, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_object_lend_cleared_meanwhile, fx_setup, fx_teardown),
        cmocka_unit_test(test_evict_ask_unlocked),
        cmocka_unit_test_setup_teardown(test_relieve_ask_unlocked, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_demote_idle_ask_unlocked, fx_setup, fx_teardown),
        cmocka_unit_test(test_random_yielding_tier),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
