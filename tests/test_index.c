/*
 * test_index.c: the radix tree of src/base/index.c (DESIGN.md 3.3): exact
 * insert/replace/remove, edge splits and merges, the lookup rules (cap at
 * n - 1, reach, untrimmable only as a full prefix, exact-length ties), and a
 * randomized comparison against a brute-force scan (seed from KVT_SEED).
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

#include <pthread.h>

#include "index.h"
#include "kvtier/common.h"

typedef struct val {
    int32_t tok[16];
    int64_t n;
    int trimmable;
    int64_t reach;
    int live;
} val;

static void test_insert_exact_remove(void **state)
{
    (void)state;
    kvt__index *ix;
    assert_int_equal(kvt__index_create(&ix), 0);
    int32_t a[] = {1, 2, 3, 4, 5}, b[] = {1, 2, 9}, c[] = {1, 2};
    int va, vb, vc, vd;
    void *rep = &va;
    assert_int_equal(kvt__index_insert(ix, "", a, 5, &va, 1, 0, &rep), 0);
    assert_null(rep);
    assert_int_equal(kvt__index_insert(ix, "", b, 3, &vb, 1, 0, &rep), 0);
    assert_int_equal(kvt__index_insert(ix, "", c, 2, &vc, 1, 0, &rep), 0);
    assert_null(rep);
    /* root + [1,2] + [3,4,5] + [9] */
    assert_int_equal(kvt__index_nodes(ix), 4);
    assert_ptr_equal(kvt__index_exact(ix, "", a, 5), &va);
    assert_ptr_equal(kvt__index_exact(ix, "", b, 3), &vb);
    assert_ptr_equal(kvt__index_exact(ix, "", c, 2), &vc);
    assert_null(kvt__index_exact(ix, "", a, 4));
    assert_null(kvt__index_exact(ix, "other", a, 5));
    /* replace */
    assert_int_equal(kvt__index_insert(ix, "", b, 3, &vd, 0, 3, &rep), 0);
    assert_ptr_equal(rep, &vb);
    assert_ptr_equal(kvt__index_exact(ix, "", b, 3), &vd);
    /* remove [1,2,9]: [1,2] keeps its value, no merge */
    assert_ptr_equal(kvt__index_remove(ix, "", b, 3), &vd);
    assert_int_equal(kvt__index_nodes(ix), 3);
    /* remove [1,2]: [1,2] + [3,4,5] merge into one edge */
    assert_ptr_equal(kvt__index_remove(ix, "", c, 2), &vc);
    assert_int_equal(kvt__index_nodes(ix), 2);
    assert_ptr_equal(kvt__index_exact(ix, "", a, 5), &va);
    assert_null(kvt__index_remove(ix, "", c, 2));
    assert_ptr_equal(kvt__index_remove(ix, "", a, 5), &va);
    assert_int_equal(kvt__index_nodes(ix), 0); /* empty namespace dropped */
    kvt__index_destroy(ix);
}

static void test_lookup_rules(void **state)
{
    (void)state;
    kvt__index *ix;
    assert_int_equal(kvt__index_create(&ix), 0);
    int32_t e1[] = {1, 2, 3, 4, 5, 6};   /* trimmable, reach 0 */
    int32_t e2[] = {1, 2, 3, 7, 7, 7};   /* untrimmable */
    int32_t e3[] = {1, 2, 3};            /* untrimmable, exact */
    int v1, v2, v3;
    void *rep, *got;
    assert_int_equal(kvt__index_insert(ix, "", e1, 6, &v1, 1, 0, &rep), 0);
    assert_int_equal(kvt__index_insert(ix, "", e2, 6, &v2, 0, 6, &rep), 0);
    /* prompt equal to e1: usable prefix capped at n - 1 = 5 */
    assert_int_equal(kvt__index_lookup(ix, "", e1, 6, &got), 5);
    assert_ptr_equal(got, &v1);
    /* prompt diverging inside e2's tail: e2 cannot be trimmed; e1 shares 3
     * tokens and is trimmed back to them */
    int32_t p1[] = {1, 2, 3, 7, 7, 8, 9};
    assert_int_equal(kvt__index_lookup(ix, "", p1, 7, &got), 3);
    assert_ptr_equal(got, &v1);
    /* prompt extending e2 fully: e2 serves all 6 */
    int32_t p2[] = {1, 2, 3, 7, 7, 7, 1};
    assert_int_equal(kvt__index_lookup(ix, "", p2, 7, &got), 6);
    assert_ptr_equal(got, &v2);
    /* but a prompt equal to e2 cannot use it (cap 5, e2 untrimmable) */
    assert_int_equal(kvt__index_lookup(ix, "", e2, 6, &got), 3);
    assert_ptr_equal(got, &v1);
    /* exact-length tie: e3 ends at 3 and wins over trimming e1 */
    assert_int_equal(kvt__index_insert(ix, "", e3, 3, &v3, 0, 3, &rep), 0);
    assert_int_equal(kvt__index_lookup(ix, "", p1, 7, &got), 3);
    assert_ptr_equal(got, &v3);
    /* reach: a trimmable entry whose layers reach only >= 5 */
    kvt__index_remove(ix, "", e3, 3);
    kvt__index_remove(ix, "", e1, 6);
    assert_int_equal(kvt__index_insert(ix, "", e1, 6, &v1, 1, 5, &rep), 0);
    assert_int_equal(kvt__index_lookup(ix, "", p1, 7, &got), 0);
    assert_null(got);
    int32_t p3[] = {1, 2, 3, 4, 5, 0};
    assert_int_equal(kvt__index_lookup(ix, "", p3, 6, &got), 5);
    assert_ptr_equal(got, &v1);
    int32_t p4[] = {1, 2, 3, 4, 0};
    assert_int_equal(kvt__index_lookup(ix, "", p4, 5, &got), 0);
    /* namespaces never mix; a 1-token prompt never hits */
    assert_int_equal(kvt__index_lookup(ix, "lora", p3, 6, &got), 0);
    assert_int_equal(kvt__index_lookup(ix, "", p3, 1, &got), 0);
    kvt__index_destroy(ix);
}

static int64_t brute(val *vs, int nv, const int32_t *prompt, int64_t n, int64_t *exact_best)
{
    int64_t best = 0;
    *exact_best = 0;
    for (int i = 0; i < nv; i++) {
        if (!vs[i].live)
            continue;
        int64_t p = 0;
        while (p < vs[i].n && p < n && vs[i].tok[p] == prompt[p])
            p++;
        if (p > n - 1)
            p = n - 1;
        if (p < 1)
            continue;
        int ok = p == vs[i].n || (vs[i].trimmable && p >= vs[i].reach);
        if (!ok)
            continue;
        if (p > best)
            best = p;
        if (p == vs[i].n && p > *exact_best)
            *exact_best = p;
    }
    return best;
}

static int usable_at(const val *v, const int32_t *prompt, int64_t n, int64_t p)
{
    if (v->n < p)
        return 0;
    for (int64_t i = 0; i < p; i++)
        if (v->tok[i] != prompt[i])
            return 0;
    if (p == v->n)
        return 1;
    return v->trimmable && p >= v->reach && (v->tok[p] != prompt[p] || p == n - 1);
}

static void test_random_vs_brute(void **state)
{
    (void)state;
    unsigned seed = (unsigned)test_seed("test_index random");
    srand(seed);
    enum { NV = 200 };
    static val vs[NV];
    memset(vs, 0, sizeof vs);
    kvt__index *ix;
    assert_int_equal(kvt__index_create(&ix), 0);
    for (int step = 0; step < 20000; step++) {
        int i = rand() % NV;
        if (vs[i].live && rand() % 3 == 0) {
            assert_ptr_equal(kvt__index_remove(ix, "", vs[i].tok, vs[i].n), &vs[i]);
            vs[i].live = 0;
        } else if (!vs[i].live) {
            vs[i].n = rand() % 12;
            for (int k = 0; k < vs[i].n; k++)
                vs[i].tok[k] = rand() % 3;
            vs[i].trimmable = rand() % 3 != 0;
            vs[i].reach = vs[i].trimmable ? rand() % 4 : vs[i].n;
            void *rep;
            assert_int_equal(kvt__index_insert(ix, "", vs[i].tok, vs[i].n, &vs[i], vs[i].trimmable, vs[i].reach, &rep),
                             0);
            if (rep) {
                val *old = rep;
                assert_true(old->live);
                old->live = 0;
            }
            vs[i].live = 1;
        }
        int32_t prompt[16];
        int64_t n = rand() % 14;
        for (int k = 0; k < n; k++)
            prompt[k] = rand() % 3;
        void *got;
        int64_t exact;
        int64_t want = brute(vs, NV, prompt, n, &exact);
        int64_t p = kvt__index_lookup(ix, "", prompt, n, &got);
        assert_int_equal(p, want);
        if (p) {
            val *g = got;
            assert_true(g->live);
            assert_true(usable_at(g, prompt, n, p));
            if (exact == p)
                assert_int_equal(g->n, p); /* exact-length entries win ties */
        } else {
            assert_null(got);
        }
    }
    size_t live = 0;
    for (int i = 0; i < NV; i++)
        live += vs[i].live;
    /* compressed: at most one branch node per entry plus the root */
    assert_true(kvt__index_nodes(ix) <= 2 * live + 1);
    kvt__index_destroy(ix);
}

/* a chain of 8,000 nested entries (each a prefix of the next, one node
 * per token), built, looked up and destroyed on a thread with a 128 KB
 * stack: nothing may recurse per node */
enum { CHAIN = 8000 };

static void *chain_main(void *arg)
{
    int *ok = arg;
    static int32_t tok[CHAIN];
    static char vals[CHAIN];
    for (int i = 0; i < CHAIN; i++)
        tok[i] = i % 7;
    kvt__index *ix;
    if (kvt__index_create(&ix) != 0)
        return NULL;
    for (int64_t n = 1; n <= CHAIN; n++) {
        void *rep;
        if (kvt__index_insert(ix, "", tok, n, &vals[n - 1], 0, n, &rep) != 0)
            return NULL;
    }
    void *got;
    *ok = kvt__index_nodes(ix) == CHAIN + 1 && kvt__index_lookup(ix, "", tok, CHAIN, &got) == CHAIN - 1 &&
          got == &vals[CHAIN - 2];
    kvt__index_destroy(ix);
    return NULL;
}

static void test_deep_chain(void **state)
{
    (void)state;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 128 * 1024);
    pthread_t th;
    int ok = 0;
    assert_int_equal(pthread_create(&th, &a, chain_main, &ok), 0);
    pthread_join(th, NULL);
    pthread_attr_destroy(&a);
    assert_true(ok);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_insert_exact_remove),
        cmocka_unit_test(test_lookup_rules),
        cmocka_unit_test(test_random_vs_brute),
        cmocka_unit_test(test_deep_chain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
