/*
 * test_prompt_cache_diff.c: randomized differential test of the prompt
 * cache against an oracle written here: a plain array of entries scanned
 * linearly, with the rules of DESIGN.md section 3 restated naively (usable
 * prefix, reachable ranges, session hits, equal-token replacement with
 * sessions and pins following, supersede, oversize drops, LRU eviction of
 * unpinned entries preferring session-free ones, trims in place, clear).
 * After every step: resident set, byte total (shared buffers once),
 * counters, and which entry serves each prompt (the served entry must be one
 * of the oracle's longest candidates, exact-length ones first).
 * Seed printed; KVT_SEED repeats a run, KVT_DIFF_STEPS changes the length.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_seed.h"

#include "kvtier/prompt_cache.h"
#include "pc_util.h"

#define MAXT 24  /* tokens per entry */
#define MAXE 512 /* oracle slots */
#define MAXL 3   /* layers */
#define MAXB 8   /* buffers per layer */
#define NSESS 3
#define NLEASE 4

typedef struct oentry {
    int live;
    uint64_t id;
    char ns[8];
    int32_t tok[MAXT];
    int64_t n;
    char kinds[MAXL + 1];
    int trimmable;
    int64_t reach;
    kvt_buf *bufs[MAXL][MAXB]; /* per layer, in foreach_buf order (identity only:
                                  never dereferenced, the cache may have freed them) */
    size_t buf_bytes[MAXL][MAXB];
    int nbufs[MAXL];
    size_t priv;
    int64_t pins;
    uint64_t tick;
} oentry;

typedef struct oracle {
    oentry e[MAXE];
    uint64_t clock;
    size_t max_bytes;
    uint64_t sess[NSESS][2]; /* session -> ns index (0 "", 1 "b") -> id */
    kvt_prompt_cache_stats st;
} oracle;

/* internal test hook of src/ram/prompt_cache.c */
int kvt__prompt_cache_entry_info(kvt_prompt_cache *pc, uint64_t id, int64_t *sessions, int64_t *pins,
                                  size_t *n_bufs, size_t *private_bytes);

static const char *NS[2] = {"", "b"};
static const char *SESS[NSESS] = {"s0", "s1", "s2"};

static unsigned rng_state;
static unsigned rnd(unsigned n)
{
    rng_state = rng_state * 1103515245u + 12345u;
    return (rng_state >> 8) % n;
}

static oentry *by_id(oracle *o, uint64_t id)
{
    for (int i = 0; i < MAXE; i++)
        if (o->e[i].live && o->e[i].id == id)
            return &o->e[i];
    return NULL;
}

static int ns_index(const char *ns) { return strcmp(ns, "b") == 0; }

static int session_refs(oracle *o, const oentry *e)
{
    int n = 0;
    for (int s = 0; s < NSESS; s++)
        if (o->sess[s][ns_index(e->ns)] == e->id)
            n++;
    return n;
}

static int is_prefix(const int32_t *a, int64_t na, const int32_t *b, int64_t nb)
{
    return na <= nb && (na == 0 || memcmp(a, b, (size_t)na * 4) == 0);
}

static size_t oracle_bytes(oracle *o)
{
    size_t total = 0;
    kvt_buf *seen[MAXE * MAXL * MAXB];
    size_t ns = 0;
    for (int i = 0; i < MAXE; i++) {
        oentry *e = &o->e[i];
        if (!e->live)
            continue;
        total += e->priv;
        for (int l = 0; l < MAXL; l++)
            for (int k = 0; k < e->nbufs[l]; k++) {
                size_t j = 0;
                while (j < ns && seen[j] != e->bufs[l][k])
                    j++;
                if (j == ns) {
                    seen[ns++] = e->bufs[l][k];
                    total += e->buf_bytes[l][k];
                }
            }
    }
    return total;
}

static size_t entry_alone(const oentry *e)
{
    size_t total = e->priv;
    for (int l = 0; l < MAXL; l++)
        for (int k = 0; k < e->nbufs[l]; k++) {
            int dup = 0;
            for (int l2 = 0; l2 <= l && !dup; l2++)
                for (int k2 = 0; k2 < (l2 == l ? k : e->nbufs[l2]) && !dup; k2++)
                    dup = e->bufs[l2][k2] == e->bufs[l][k];
            if (!dup)
                total += e->buf_bytes[l][k];
        }
    return total;
}

static oentry *oracle_victim(oracle *o)
{
    oentry *best = NULL;
    for (int pass = 0; pass < 2 && !best; pass++)
        for (int i = 0; i < MAXE; i++) {
            oentry *e = &o->e[i];
            if (!e->live || e->pins > 0 || (pass == 0 && session_refs(o, e) > 0))
                continue;
            if (!best || e->tick < best->tick)
                best = e;
        }
    return best;
}

static void oracle_evict_to_budget(oracle *o)
{
    while (oracle_bytes(o) > o->max_bytes) {
        oentry *v = oracle_victim(o);
        if (!v)
            break;
        if (getenv("KVT_DIFF_TRACE"))
            printf("  oracle evicts %llu\n", (unsigned long long)v->id);
        v->live = 0;
        o->st.evictions++;
    }
}

/* usable prefix of e for prompt (0 = not a candidate) */
static int64_t usable(const oentry *e, const char *ns, const int32_t *p, int64_t n)
{
    if (strcmp(e->ns, ns) != 0)
        return 0;
    int64_t c = 0;
    while (c < e->n && c < n && e->tok[c] == p[c])
        c++;
    if (c > n - 1)
        c = n - 1;
    if (c < 1)
        return 0;
    if (c == e->n)
        return c;
    return e->trimmable && c >= e->reach ? c : 0;
}

static int64_t oracle_best(oracle *o, const char *ns, const int32_t *p, int64_t n, int *exact)
{
    int64_t best = 0;
    *exact = 0;
    for (int i = 0; i < MAXE; i++) {
        if (!o->e[i].live)
            continue;
        int64_t u = usable(&o->e[i], ns, p, n);
        if (u > best) {
            best = u;
            *exact = 0;
        }
        if (u == best && u > 0 && o->e[i].n == u)
            *exact = 1;
    }
    return best;
}

typedef struct world {
    kvt_prompt_cache *pc;
    oracle *o;
    kvt_lease *lease[NLEASE];
    uint64_t lease_id[NLEASE]; /* oracle id the lease pins (follows replacement) */
} world;

static void check_world(world *w, int step)
{
    kvt_prompt_cache_stats s;
    kvt_prompt_cache_get_stats(w->pc, &s);
    oracle *o = w->o;
    int64_t live = 0, pinned = 0;
    int bad = 0;
    for (int i = 0; i < MAXE; i++) {
        oentry *e = &o->e[i];
        if (!e->live)
            continue;
        live++;
        pinned += e->pins > 0;
        uint64_t id;
        if (!kvt_prompt_cache_find_exact(w->pc, e->tok, e->n, e->ns, &id) || id != e->id) {
            printf("step %d: oracle entry %llu (%lld tokens, ns '%s') not resident as such\n", step,
                   (unsigned long long)e->id, (long long)e->n, e->ns);
            bad++;
            continue;
        }
        int64_t cs, cp;
        size_t cb, cpriv, ob = 0;
        assert_int_equal(kvt__prompt_cache_entry_info(w->pc, e->id, &cs, &cp, &cb, &cpriv), 0);
        for (int l = 0; l < MAXL; l++)
            ob += (size_t)e->nbufs[l];
        if (cs != session_refs(o, e) || cp != e->pins || cb != ob || cpriv != e->priv) {
            printf("step %d: entry %llu: sessions %lld pins %lld bufs %zu private %zu, oracle %d %lld %zu %zu\n",
                   step, (unsigned long long)e->id, (long long)cs, (long long)cp, cb, cpriv, session_refs(o, e),
                   (long long)e->pins, ob, e->priv);
            bad++;
        }
    }
    if (bad)
        fail_msg("step %d: %d oracle entries differ (cache: %lld entries, %zu bytes)", step, bad,
                 (long long)s.entries, s.bytes);
    if (s.entries != live)
        fail_msg("step %d: entries %lld, oracle %lld", step, (long long)s.entries, (long long)live);
    size_t ob = oracle_bytes(o);
    if (s.bytes != ob)
        fail_msg("step %d: bytes %zu, oracle %zu", step, s.bytes, ob);
    if (s.pinned != pinned)
        fail_msg("step %d: pinned %lld, oracle %lld", step, (long long)s.pinned, (long long)pinned);
#define CK(f)                                                                                          \
    if (s.f != o->st.f)                                                                                \
        fail_msg("step %d: counter " #f " %llu, oracle %llu", step, (unsigned long long)s.f,            \
                 (unsigned long long)o->st.f);
    CK(hits) CK(misses) CK(session_hits) CK(session_misses) CK(prefix_walks) CK(evictions)
    CK(replacements) CK(supersedes) CK(oversize_drops)
#undef CK
}

/* records an entry's buffers and private bytes the way the cache counts them */
typedef struct rec_ctx {
    oentry *e;
    int layer;
} rec_ctx;

static void rec_buf(kvt_buf *b, void *p)
{
    rec_ctx *r = p;
    assert_true(r->e->nbufs[r->layer] < MAXB);
    r->e->buf_bytes[r->layer][r->e->nbufs[r->layer]] = kvt_buf_bytes(b);
    r->e->bufs[r->layer][r->e->nbufs[r->layer]++] = b;
}

static void measure(oentry *e, kvt_cache **c, int nc)
{
    e->priv = 0;
    e->trimmable = 1;
    e->reach = 0;
    for (int l = 0; l < nc; l++) {
        e->nbufs[l] = 0;
        rec_ctx r = {e, l};
        c[l]->ops->foreach_buf(c[l], rec_buf, &r);
        e->priv += c[l]->ops->private_bytes(c[l]);
        int64_t lo, off;
        kvt_cache_range(c[l], &lo, &off);
        if (lo > e->reach)
            e->reach = lo;
        if (lo >= off && off > 0)
            e->trimmable = 0;
    }
}

static oentry *free_slot(oracle *o)
{
    for (int i = 0; i < MAXE; i++)
        if (!o->e[i].live)
            return &o->e[i];
    fail_msg("oracle full");
    return NULL;
}

/* oracle side of take (also checks the cache's answer) */
static void oracle_take(world *w, const char *ns, const int32_t *p, int64_t n, int sess, const kvt_hit *h, int step)
{
    oracle *o = w->o;
    if (sess >= 0) {
        oentry *se = by_id(o, o->sess[sess][ns_index(ns)]);
        if (se && se->n >= 1 && se->n < n && is_prefix(se->tok, se->n, p, n)) {
            if (h->source != KVT_HIT_SESSION || h->entry_id != se->id || h->prefix_len != se->n)
                fail_msg("step %d: expected a session hit on %llu at %lld, got source %d id %llu p %lld", step,
                         (unsigned long long)se->id, (long long)se->n, (int)h->source,
                         (unsigned long long)h->entry_id, (long long)h->prefix_len);
            o->st.hits++;
            o->st.session_hits++;
            se->tick = ++o->clock;
            return;
        }
        o->st.session_misses++;
    }
    o->st.prefix_walks++;
    int exact;
    int64_t best = oracle_best(o, ns, p, n, &exact);
    if (h->prefix_len != best)
        fail_msg("step %d: take served %lld tokens, oracle's longest is %lld", step, (long long)h->prefix_len,
                 (long long)best);
    if (best == 0) {
        o->st.misses++;
        assert_int_equal(h->source, KVT_HIT_NONE);
        return;
    }
    o->st.hits++;
    oentry *e = by_id(o, h->entry_id);
    if (!e || usable(e, ns, p, n) != best)
        fail_msg("step %d: served entry %llu is not a candidate at %lld", step, (unsigned long long)h->entry_id,
                 (long long)best);
    if (exact && e->n != best)
        fail_msg("step %d: an exact-length candidate existed but entry %llu (%lld tokens) served", step,
                 (unsigned long long)e->id, (long long)e->n);
    assert_int_equal(h->entry.n_tokens, best);
    assert_memory_equal(h->entry.tokens, p, (size_t)best * 4);
    for (int l = 0; l < h->entry.n_caches; l++)
        assert_int_equal(kvt_cache_offset(h->entry.caches[l]), best);
    e->tick = ++o->clock;
    if (getenv("KVT_DIFF_TRACE"))
        printf("step %d take served %llu at %lld tick %llu\n", step, (unsigned long long)e->id, (long long)best,
               (unsigned long long)e->tick);
    if (sess >= 0)
        o->sess[sess][ns_index(ns)] = e->id;
}

/* oracle side of a successful put of entry x (already measured) */
static void oracle_put(world *w, oentry *x, int sess)
{
    oracle *o = w->o;
    if (entry_alone(x) > o->max_bytes) {
        o->st.oversize_drops++;
        return;
    }
    oentry *slot = free_slot(o);
    *slot = *x;
    slot->live = 1;
    slot->pins = 0;
    slot->tick = ++o->clock;
    for (int i = 0; i < MAXE; i++) {
        oentry *old = &o->e[i];
        if (old == slot || !old->live || strcmp(old->ns, slot->ns) != 0 || old->n != slot->n ||
            !is_prefix(old->tok, old->n, slot->tok, slot->n))
            continue;
        for (int s = 0; s < NSESS; s++)
            for (int k = 0; k < 2; k++)
                if (o->sess[s][k] == old->id)
                    o->sess[s][k] = slot->id;
        slot->pins += old->pins;
        for (int l = 0; l < NLEASE; l++)
            if (w->lease[l] && w->lease_id[l] == old->id)
                w->lease_id[l] = slot->id;
        old->live = 0;
        o->st.replacements++;
    }
    if (slot->trimmable && slot->n > 0)
        for (int i = 0; i < MAXE; i++) {
            oentry *old = &o->e[i];
            if (old == slot || !old->live || strcmp(old->ns, slot->ns) != 0 || old->n >= slot->n ||
                old->n < slot->reach || old->pins > 0 || !is_prefix(old->tok, old->n, slot->tok, slot->n))
                continue;
            old->live = 0;
            o->st.supersedes++;
        }
    if (sess >= 0)
        o->sess[sess][ns_index(slot->ns)] = slot->id;
    oracle_evict_to_budget(o);
}

static void random_prompt(oracle *o, int32_t *p, int64_t *n)
{
    /* mostly: a resident entry's tokens, cut and/or extended, maybe edited */
    oentry *base = NULL;
    for (int tries = 0; tries < 8 && !base; tries++) {
        oentry *e = &o->e[rnd(MAXE) % 64];
        if (e->live)
            base = e;
    }
    int64_t len = 0;
    if (base && rnd(5) != 0) {
        len = rnd((unsigned)base->n + 1);
        memcpy(p, base->tok, (size_t)len * 4);
    }
    int64_t total = len + 1 + rnd(6);
    if (total > MAXT)
        total = MAXT;
    for (int64_t i = len; i < total; i++)
        p[i] = (int32_t)rnd(3);
    if (total > 2 && rnd(6) == 0)
        p[rnd((unsigned)total)] = (int32_t)rnd(3);
    *n = total;
}

static const char *KINDS[] = {"k", "kk", "kr", "kw", "k"};

/* an engine turn: take (checked), extend the views or fresh caches, put */
static void op_turn(world *w, int step, int do_put)
{
    oracle *o = w->o;
    int32_t p[MAXT];
    int64_t n;
    random_prompt(o, p, &n);
    const char *ns = NS[rnd(4) == 0];
    int sess = rnd(4) == 0 ? -1 : (int)rnd(NSESS);
    kvt_hit h;
    assert_int_equal(kvt_prompt_cache_lend(w->pc, p, n, ns, sess >= 0 ? SESS[sess] : NULL, &h), 0);
    oracle_take(w, ns, p, n, sess, &h, step);
    if (!do_put) {
        kvt_hit_clear(&h);
        return;
    }
    kvt_cache *c[MAXL];
    int nc;
    char kinds[MAXL + 1];
    kvt_hook hook = {0};
    if (h.prefix_len > 0) {
        nc = h.entry.n_caches;
        for (int l = 0; l < nc; l++) {
            c[l] = h.entry.caches[l];
            h.entry.caches[l] = NULL;
            const char *k = kvt_cache_kind(c[l]);
            kinds[l] = strcmp(k, "recurrent") == 0 ? 'r' : strcmp(k, "rotating") == 0 ? 'w' : 'k';
        }
        kinds[nc] = 0;
        hook = h.entry.hook;
        h.entry.hook = (kvt_hook){0};
        assert_int_equal(pcu_extend(c, nc, p + h.prefix_len, n - h.prefix_len), 0);
    } else {
        strcpy(kinds, KINDS[rnd(5)]);
        nc = (int)strlen(kinds);
        assert_int_equal(pcu_fresh(kinds, c, p, n), 0);
    }
    kvt_hit_clear(&h);
    oentry x;
    memset(&x, 0, sizeof x);
    strcpy(x.ns, ns);
    memcpy(x.tok, p, (size_t)n * 4);
    x.n = n;
    strcpy(x.kinds, kinds);
    measure(&x, c, nc);
    assert_int_equal(pcu_put(w->pc, ns, p, n, c, nc, NULL, 0, hook, sess >= 0 ? SESS[sess] : NULL), 0);
    /* the new entry's id (a fake one if it did not stay: then the oracle must
     * drop it too, which check_world verifies) */
    uint64_t id = 0;
    if (!kvt_prompt_cache_find_exact(w->pc, p, n, ns, &id))
        id = UINT64_MAX - (uint64_t)step; /* a fake id no session slot holds */
    x.id = id;
    if (getenv("KVT_DIFF_TRACE")) {
        kvt_prompt_cache_stats cs;
        kvt_prompt_cache_get_stats(w->pc, &cs);
        printf("step %d put n=%lld ns='%s' sess=%d kinds=%s id=%llu alone=%zu max=%zu cache bytes=%zu entries=%lld "
               "oracle bytes(before)=%zu\n",
               step, (long long)n, ns, sess, kinds, (unsigned long long)id, entry_alone(&x), o->max_bytes, cs.bytes,
               (long long)cs.entries, oracle_bytes(o));
    }
    oracle_put(w, &x, sess);
}

static void op_trim(world *w, int step)
{
    oracle *o = w->o;
    oentry *e = &o->e[rnd(MAXE) % 64];
    if (!e->live)
        return;
    int64_t new_len = 1 + rnd((unsigned)e->n);
    int rc = kvt_prompt_cache_trim(w->pc, e->tok, e->n, e->ns, new_len);
    if (new_len == e->n) {
        assert_int_equal(rc, 0);
        return;
    }
    int ok = e->trimmable && new_len >= e->reach;
    if (!ok) {
        if (rc != KVT_ERANGE)
            fail_msg("step %d: trim of an untrimmable entry returned %d", step, rc);
        return;
    }
    if (rc != 0)
        fail_msg("step %d: trim %lld -> %lld failed %d (%s)", step, (long long)e->n, (long long)new_len, rc,
                 kvt_last_error());
    /* kv layers keep their first ceil(new_len / B) blocks; rings keep theirs */
    for (int l = 0; e->kinds[l]; l++)
        if (e->kinds[l] == 'k')
            e->nbufs[l] = (int)((new_len + PCU_BLOCK - 1) / PCU_BLOCK);
    e->n = new_len;
    for (int i = 0; i < MAXE; i++) {
        oentry *old = &o->e[i];
        if (old == e || !old->live || strcmp(old->ns, e->ns) != 0 || old->n != e->n ||
            !is_prefix(old->tok, old->n, e->tok, e->n))
            continue;
        for (int s = 0; s < NSESS; s++)
            for (int k = 0; k < 2; k++)
                if (o->sess[s][k] == old->id)
                    o->sess[s][k] = e->id;
        e->pins += old->pins;
        for (int l = 0; l < NLEASE; l++)
            if (w->lease[l] && w->lease_id[l] == old->id)
                w->lease_id[l] = e->id;
        old->live = 0;
        o->st.replacements++;
    }
}

static void op_evict(world *w)
{
    int64_t k = rnd(3), n;
    assert_int_equal(kvt_prompt_cache_evict(w->pc, k, &n), 0);
    int64_t want = 0;
    for (; want < k; want++) {
        oentry *v = oracle_victim(w->o);
        if (!v)
            break;
        v->live = 0;
        w->o->st.evictions++;
    }
    assert_int_equal(n, want);
}

static void dump(world *w)
{
    for (int i = 0; i < MAXE; i++) {
        oentry *e = &w->o->e[i];
        if (e->live)
            printf("  id %llu n %lld ns '%s' tick %llu pins %lld sess %d alone %zu\n", (unsigned long long)e->id,
                   (long long)e->n, e->ns, (unsigned long long)e->tick, (long long)e->pins, session_refs(w->o, e),
                   entry_alone(e));
    }
}

static void op_budget(world *w)
{
    if (getenv("KVT_DIFF_TRACE"))
        dump(w);
    size_t b = 600 + rnd(12000);
    w->o->max_bytes = b;
    static oentry before[MAXE];
    memcpy(before, w->o->e, sizeof before);
    assert_int_equal(kvt_prompt_cache_set_max_bytes(w->pc, b), 0);
    oracle_evict_to_budget(w->o);
    if (getenv("KVT_DIFF_TRACE")) {
        printf("  budget %zu; cache bytes now %zu, oracle %zu\n", b, (size_t)0, oracle_bytes(w->o));
        for (int i = 0; i < MAXE; i++)
            if (before[i].live)
                printf("  %llu cache %d oracle %d\n", (unsigned long long)before[i].id,
                       kvt_prompt_cache_find_exact(w->pc, before[i].tok, before[i].n, before[i].ns, NULL),
                       w->o->e[i].live);
    }
}

static void op_pin(world *w)
{
    int l = (int)rnd(NLEASE);
    oracle *o = w->o;
    if (w->lease[l]) {
        kvt_lease_release(w->lease[l]);
        w->lease[l] = NULL;
        oentry *e = by_id(o, w->lease_id[l]);
        if (e)
            e->pins--;
        oracle_evict_to_budget(o);
        return;
    }
    oentry *e = &o->e[rnd(MAXE) % 64];
    if (!e->live)
        return;
    assert_int_equal(kvt_prompt_cache_pin(w->pc, e->tok, e->n, e->ns, &w->lease[l]), 0);
    w->lease_id[l] = e->id;
    e->pins++;
}

static void op_close(world *w)
{
    int s = (int)rnd(NSESS);
    kvt_prompt_cache_close_session(w->pc, SESS[s]);
    w->o->sess[s][0] = w->o->sess[s][1] = 0;
}

static void op_clear(world *w)
{
    kvt_prompt_cache_clear(w->pc);
    for (int i = 0; i < MAXE; i++)
        w->o->e[i].live = 0;
    memset(w->o->sess, 0, sizeof w->o->sess);
}

static void test_differential(void **state)
{
    (void)state;
    unsigned seed = (unsigned)test_seed("test_prompt_cache_diff");
    const char *st = getenv("KVT_DIFF_STEPS");
    int steps = st ? atoi(st) : 4000;
    printf("test_prompt_cache_diff: %d steps (KVT_DIFF_STEPS to change)\n", steps);
    rng_state = seed;
    world w;
    memset(&w, 0, sizeof w);
    w.o = calloc(1, sizeof *w.o);
    assert_non_null(w.o);
    w.o->max_bytes = 8000;
    kvt_prompt_cache_config cfg = {.max_bytes = w.o->max_bytes, .block_tokens = PCU_BLOCK};
    assert_int_equal(kvt_prompt_cache_create(&cfg, &w.pc), 0);
    for (int step = 0; step < steps; step++) {
        unsigned op = rnd(100);
        if (getenv("KVT_DIFF_TRACE"))
            printf("step %d op %u\n", step, op);
        if (op < 45)
            op_turn(&w, step, 1);
        else if (op < 70)
            op_turn(&w, step, 0);
        else if (op < 78)
            op_trim(&w, step);
        else if (op < 84)
            op_evict(&w);
        else if (op < 88)
            op_budget(&w);
        else if (op < 95)
            op_pin(&w);
        else if (op < 99)
            op_close(&w);
        else
            op_clear(&w);
        check_world(&w, step);
    }
    kvt_prompt_cache_stats s;
    kvt_prompt_cache_get_stats(w.pc, &s);
    printf("  hits %llu misses %llu session hits %llu replacements %llu supersedes %llu evictions %llu "
           "oversize %llu\n",
           (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.session_hits,
           (unsigned long long)s.replacements, (unsigned long long)s.supersedes, (unsigned long long)s.evictions,
           (unsigned long long)s.oversize_drops);
    if (steps >= 4000) /* the run exercised every rule */
        assert_true(s.hits && s.misses && s.session_hits && s.replacements && s.supersedes && s.evictions);
    for (int l = 0; l < NLEASE; l++)
        kvt_lease_release(w.lease[l]);
    kvt_prompt_cache_destroy(w.pc);
    free(w.o);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_differential),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
