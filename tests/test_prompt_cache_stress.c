/*
 * test_prompt_cache_stress.c: several threads hammer one prompt cache (over
 * the in-memory cold tier) with take/put, peek, find_exact, pins, prefetch,
 * objects, eviction, demotion, relief, session closes and clears, for TSan
 * and ASan. Afterwards: every release hook ran exactly once, the views each
 * thread got held the tokens it asked for, and a cleared cache holds zero
 * bytes. Seed printed; KVT_SEED repeats the operation mix.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <pthread.h>
#include <stdatomic.h>

#include <cmocka.h>

#include "test_seed.h"

#include "kvtier/prompt_cache.h"
#include "mem_tier.h"
#include "pc_util.h"

#define NTHREADS 4
#define ITERS 1500

static atomic_int hooks_made, hooks_run;
static atomic_int bad_views;

static void hook_fn(void *ctx)
{
    (void)ctx;
    atomic_fetch_add(&hooks_run, 1);
}

typedef struct targ {
    kvt_prompt_cache *pc;
    mem_tier *mt;
    unsigned seed;
} targ;

static unsigned rnd(unsigned *s, unsigned n)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) % n;
}

static int over_once(void *ctx)
{
    int *left = ctx;
    return (*left)-- > 0;
}

static void *worker(void *p)
{
    targ *a = p;
    unsigned s = a->seed;
    char session[16];
    kvt_lease *leases[4] = {0};
    for (int it = 0; it < ITERS; it++) {
        int32_t prompt[40];
        int64_t n = 2 + rnd(&s, 38);
        int32_t base = (int32_t)rnd(&s, 3); /* few distinct conversations */
        for (int64_t i = 0; i < n; i++)
            prompt[i] = base * 100 + (int32_t)(i < 20 ? i : rnd(&s, 4));
        snprintf(session, sizeof session, "s%u", rnd(&s, 6));
        const char *ns = rnd(&s, 5) == 0 ? "b" : "";
        unsigned op = rnd(&s, 100);
        if (op < 50) {
            kvt_hit h;
            if (kvt_prompt_cache_lend(a->pc, prompt, n, ns, session, &h) != 0)
                continue;
            if (h.prefix_len > 0) {
                if (h.entry.n_tokens != h.prefix_len || memcmp(h.entry.tokens, prompt, (size_t)h.prefix_len * 4) ||
                    kvt_cache_offset(h.entry.caches[0]) != h.prefix_len)
                    atomic_fetch_add(&bad_views, 1);
            }
            kvt_cache *c[2];
            kvt_hook hook = {0};
            int ok;
            if (h.prefix_len > 0 && h.entry.n_caches == 2) {
                c[0] = h.entry.caches[0];
                c[1] = h.entry.caches[1];
                h.entry.caches[0] = h.entry.caches[1] = NULL;
                hook = h.entry.hook;
                h.entry.hook = (kvt_hook){0};
                ok = pcu_extend(c, 2, prompt + h.prefix_len, n - h.prefix_len) == 0;
            } else {
                ok = pcu_fresh(rnd(&s, 4) == 0 ? "kr" : "kk", c, prompt, n) == 0;
                if (ok && rnd(&s, 2)) {
                    atomic_fetch_add(&hooks_made, 1);
                    hook = (kvt_hook){hook_fn, NULL};
                }
            }
            kvt_hit_clear(&h);
            if (ok)
                pcu_put(a->pc, ns, prompt, n, c, 2, NULL, 0, hook, rnd(&s, 2) ? session : NULL);
            else
                kvt_hook_run(&hook);
        } else if (op < 60) {
            kvt_prompt_cache_peek(a->pc, prompt, n, ns, NULL);
            kvt_prompt_cache_find_exact(a->pc, prompt, n, ns, NULL);
        } else if (op < 68) {
            int l = (int)rnd(&s, 4);
            if (leases[l]) {
                kvt_lease_release(leases[l]);
                leases[l] = NULL;
            } else if (rnd(&s, 2)) {
                kvt_prompt_cache_pin(a->pc, prompt, n - 1, ns, &leases[l]);
            } else if (kvt_prompt_cache_prefetch(a->pc, prompt, n, ns, session, &leases[l]) == 0 && rnd(&s, 2)) {
                kvt_lease_wait(leases[l], 50);
            }
        } else if (op < 74) {
            char key[8];
            snprintf(key, sizeof key, "o%u", rnd(&s, 4));
            if (rnd(&s, 2)) {
                kvt_attachment *att;
                if (kvt_attachment_blob("x", key, sizeof key, &att) == 0 &&
                    kvt_prompt_cache_object_put(a->pc, key, &att, 1, NULL) != 0)
                    kvt_attachment_destroy(att);
            } else {
                kvt_hit h;
                if (kvt_prompt_cache_object_lend(a->pc, key, &h) == 0) {
                    size_t nb;
                    const char *d = kvt_attachment_blob_data(h.entry.attachments[0], &nb);
                    if (nb != 8 || strcmp(d, key) != 0)
                        atomic_fetch_add(&bad_views, 1);
                    kvt_hit_clear(&h);
                }
            }
        } else if (op < 80) {
            int64_t k;
            kvt_prompt_cache_evict(a->pc, rnd(&s, 3), &k);
        } else if (op < 84) {
            kvt_prompt_cache_set_max_bytes(a->pc, 4000 + rnd(&s, 60000));
        } else if (op < 88) {
            int64_t k;
            kvt_prompt_cache_demote_idle(a->pc, rnd(&s, 3), &k);
        } else if (op < 91) {
            int left = 2;
            int64_t k;
            kvt_prompt_cache_relieve(a->pc, over_once, &left, &k);
        } else if (op < 94) {
            int left = 1;
            int64_t k;
            kvt_prompt_cache_reclaim(a->pc, over_once, &left, &k);
        } else if (op < 97) {
            kvt_prompt_cache_close_session(a->pc, session);
        } else if (op < 99) {
            kvt_prompt_cache_stats st;
            kvt_prompt_cache_get_stats(a->pc, &st);
            if (st.entries < 0)
                atomic_fetch_add(&bad_views, 1);
        } else {
            kvt_prompt_cache_clear(a->pc);
        }
    }
    for (int l = 0; l < 4; l++)
        kvt_lease_release(leases[l]);
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    unsigned seed = (unsigned)test_seed("test_prompt_cache_stress");
    mem_tier *mt;
    assert_int_equal(mem_tier_create(&mt), 0);
    kvt_prompt_cache_config cfg = {.max_bytes = 30000,
                                   .block_tokens = PCU_BLOCK,
                                   .cold = mem_tier_iface(mt),
                                   .flags = KVT_PC_PROMOTE_RESTORES};
    kvt_prompt_cache *pc;
    assert_int_equal(kvt_prompt_cache_create(&cfg, &pc), 0);
    pthread_t th[NTHREADS];
    targ args[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        args[i] = (targ){pc, mt, seed + 7919u * (unsigned)i};
        assert_int_equal(pthread_create(&th[i], NULL, worker, &args[i]), 0);
    }
    for (int i = 0; i < NTHREADS; i++)
        pthread_join(th[i], NULL);
    mem_tier_quiesce(mt);
    assert_int_equal(atomic_load(&bad_views), 0);
    kvt_prompt_cache_stats st;
    kvt_prompt_cache_get_stats(pc, &st);
    printf("  hits %llu misses %llu evictions %llu spills %llu demotions %llu cold restores %llu prefetch reads %llu\n",
           (unsigned long long)st.hits, (unsigned long long)st.misses, (unsigned long long)st.evictions,
           (unsigned long long)st.spills, (unsigned long long)st.demotions, (unsigned long long)st.cold_restores,
           (unsigned long long)st.prefetch_reads);
    assert_int_equal(st.pinned, 0); /* every lease was released */
    assert_true(st.hits > 0);
    kvt_prompt_cache_clear(pc);
    kvt_prompt_cache_get_stats(pc, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.bytes, 0);
    kvt_prompt_cache_destroy(pc);
    mem_tier_clear(mt);
    mem_tier_counts c = mem_tier_counts_get(mt);
    mem_tier_destroy(mt);
    /* every hook ran once: those made here, and those on restored entries */
    assert_int_equal(atomic_load(&hooks_run), atomic_load(&hooks_made));
    assert_int_equal(c.hooks_run, c.hooks_given);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
