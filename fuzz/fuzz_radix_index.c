/*
 * fuzz_radix_index.c: differential check of the prompt cache's radix tree
 * (src/base/index.c) against a linear scan. The input is a program of inserts,
 * replaces, removes, exact lookups, longest-prefix lookups and prefix walks
 * over two namespaces and a four-token alphabet (so prefixes collide and
 * edges split and merge). After every step the tree must answer what the
 * scan of the live values answers: the same longest usable prefix, a value
 * that is usable at that length (the one ending there when one does), the
 * same exact hits, and the same strict prefixes in order of length.
 */
#include "fuzz_util.h"

#include "index.h"
#include "kvtier/common.h"

#include <string.h>

#define NV 64
#define MAXT 24

typedef struct val {
    int32_t tok[MAXT];
    int64_t n;
    int ns, trimmable, live;
    int64_t reach;
} val;

static const char *const nss[2] = {"", "lora:a"};
static val vs[NV];

static int64_t common(const val *v, const int32_t *p, int64_t n)
{
    int64_t c = 0;
    while (c < v->n && c < n && v->tok[c] == p[c])
        c++;
    return c;
}

/* The value's best usable length for the prompt (0 = none). */
static int64_t usable(const val *v, const int32_t *p, int64_t n)
{
    int64_t c = common(v, p, n);
    if (c > n - 1)
        c = n - 1;
    if (c < 1)
        return 0;
    if (c == v->n || (v->trimmable && c >= v->reach))
        return c;
    return 0;
}

static int usable_at(const val *v, const int32_t *p, int64_t n, int64_t len)
{
    if (v->n < len || common(v, p, n) < len)
        return 0;
    return len == v->n || (v->trimmable && len >= v->reach);
}

typedef struct walk {
    int64_t depth[NV];
    int n;
} walk;

static void on_prefix(void *val_, int64_t depth, void *ctx)
{
    walk *w = ctx;
    val *v = val_;
    FZ_CHECK(depth == v->n, "prefix walk gives depth %lld for a %lld-token value", (long long)depth,
             (long long)v->n);
    if (w->n < NV)
        w->depth[w->n++] = depth;
}

static int find_slot(int ns, const int32_t *t, int64_t n)
{
    for (int i = 0; i < NV; i++)
        if (vs[i].live && vs[i].ns == ns && vs[i].n == n && !memcmp(vs[i].tok, t, sizeof(int32_t) * (size_t)n))
            return i;
    return -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size};
    memset(vs, 0, sizeof vs);
    kvt__index *ix = NULL;
    if (kvt__index_create(&ix))
        return 0;
    for (int step = 0; step < 256 && in.n; step++) {
        int op = fz_u8(&in) % 5, ns = fz_u8(&in) & 1;
        int32_t t[MAXT];
        int64_t n = fz_u8(&in) % MAXT;
        uint8_t bits = 0;
        for (int64_t i = 0; i < n; i++) {
            if (i % 4 == 0)
                bits = fz_u8(&in);
            t[i] = (bits >> (2 * (i % 4))) & 3;
        }
        int at = find_slot(ns, t, n);
        if (op == 0) { /* insert or replace: the new value takes a free slot */
            int dst = -1;
            for (int i = 0; dst < 0 && i < NV; i++)
                if (!vs[i].live)
                    dst = i;
            if (dst < 0)
                continue;
            val nv = {.n = n, .ns = ns, .trimmable = fz_u8(&in) & 1, .live = 1};
            memcpy(nv.tok, t, sizeof(int32_t) * (size_t)n);
            nv.reach = n ? fz_u8(&in) % (n + 1) : 0;
            void *replaced = (void *)1;
            int rc = kvt__index_insert(ix, nss[ns], t, n, &vs[dst], nv.trimmable, nv.reach, &replaced);
            if (rc) {
                FZ_CHECK(rc == KVT_ENOMEM, "insert returned %d", rc);
                continue;
            }
            FZ_CHECK(replaced == (at >= 0 ? (void *)&vs[at] : NULL), "insert replaced %p, expected slot %d",
                     replaced, at);
            if (at >= 0)
                vs[at].live = 0;
            vs[dst] = nv;
        } else if (op == 1) { /* remove */
            void *got = kvt__index_remove(ix, nss[ns], t, n);
            FZ_CHECK(got == (at >= 0 ? (void *)&vs[at] : NULL), "remove gave %p, expected slot %d", got, at);
            if (at >= 0)
                vs[at].live = 0;
        } else if (op == 2) { /* exact */
            void *got = kvt__index_exact(ix, nss[ns], t, n);
            FZ_CHECK(got == (at >= 0 ? (void *)&vs[at] : NULL), "exact gave %p, expected slot %d", got, at);
        } else if (op == 3) { /* longest usable prefix */
            int64_t best = 0, exact = 0;
            for (int i = 0; i < NV; i++) {
                if (!vs[i].live || vs[i].ns != ns)
                    continue;
                int64_t u = usable(&vs[i], t, n);
                best = u > best ? u : best;
            }
            for (int i = 0; i < NV; i++)
                if (vs[i].live && vs[i].ns == ns && best && vs[i].n == best && usable_at(&vs[i], t, n, best))
                    exact = 1;
            void *got = (void *)1;
            int64_t p = kvt__index_lookup(ix, nss[ns], t, n, &got);
            FZ_CHECK(p == best, "lookup gives %lld tokens, the scan %lld", (long long)p, (long long)best);
            if (!best) {
                FZ_CHECK(got == NULL, "no prefix but a value");
                continue;
            }
            val *v = got;
            FZ_CHECK(v >= vs && v < vs + NV && v->live && v->ns == ns, "lookup gave a value not live in ns");
            FZ_CHECK(usable_at(v, t, n, best), "the value it gave is not usable at %lld", (long long)best);
            FZ_CHECK(!exact || v->n == best, "a value ends at %lld but lookup chose one of %lld tokens",
                     (long long)best, (long long)v->n);
        } else { /* strict prefixes, shortest first */
            walk w = {.n = 0};
            kvt__index_prefixes(ix, nss[ns], t, n, on_prefix, &w);
            int want = 0;
            for (int i = 0; i < NV; i++)
                if (vs[i].live && vs[i].ns == ns && vs[i].n < n && common(&vs[i], t, n) == vs[i].n)
                    want++;
            FZ_CHECK(w.n == want, "prefix walk gives %d values, the scan %d", w.n, want);
            for (int i = 1; i < w.n; i++)
                FZ_CHECK(w.depth[i - 1] < w.depth[i], "prefix walk out of order");
        }
    }
    kvt__index_destroy(ix);
    return 0;
}
