/*
 * test_cache.c: layer caches (kvtier/cache.h): the kv kind's blocks, sharing
 * and copy-on-write, trims at every boundary, encode/decode round trips and
 * rejection of bad states, the kind registry, OOM atomicity, and a
 * randomized differential test against a flat-array oracle (seed printed;
 * set KVT_TEST_SEED to replay).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_seed.h"

#include "kvtier/cache.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- helpers ---------------------------------------------------------------- */

/* Value of K (which = 0) or V (which = 1) at token t, element j. */
static float val(int which, int64_t t, int j) { return which ? -(float)(t * 1000 + j) - 0.5f : (float)(t * 1000 + j); }

/* Fills k, v with tokens [t0, t0 + n) of width d. */
static void make_kv(int64_t t0, int64_t n, int d, float *k, float *v)
{
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < d; j++) {
            k[i * d + j] = val(0, t0 + i, j);
            v[i * d + j] = val(1, t0 + i, j);
        }
}

static int append_tokens(kvt_cache *c, int64_t t0, int64_t n, int d)
{
    float *k = malloc(sizeof(float) * (size_t)(n * d + 1)), *v = malloc(sizeof(float) * (size_t)(n * d + 1));
    make_kv(t0, n, d, k, v);
    const void *in[2] = {k, v};
    int rc = kvt_cache_append(c, n, in);
    free(k);
    free(v);
    return rc;
}

/* Asserts a kv cache holds exactly tokens [0, n) made by make_kv. */
static void check_kv(const kvt_cache *c, int64_t n)
{
    int32_t B = kvt_kv_block_tokens(c), d = kvt_kv_dim(c);
    assert_int_equal(kvt_cache_offset(c), n);
    int64_t nb = (n + B - 1) / B;
    for (int64_t b = 0; b < nb; b++) {
        const float *k, *v;
        int32_t nt;
        assert_int_equal(kvt_kv_block(c, b, &k, &v, &nt), 0);
        assert_int_equal(nt, b * B + B <= n ? B : n - b * B);
        for (int32_t i = 0; i < nt; i++)
            for (int j = 0; j < d; j++) {
                if (k[i * d + j] != val(0, b * B + i, j) || v[i * d + j] != val(1, b * B + i, j))
                    fail_msg("token %lld elem %d: K %g V %g", (long long)(b * B + i), j, k[i * d + j], v[i * d + j]);
            }
    }
    assert_int_equal(kvt_kv_block(c, nb, NULL, NULL, NULL), KVT_ERANGE);
}

struct nth_buf {
    int64_t want, seen;
    kvt_buf *found;
};
static void nth_buf_fn(kvt_buf *b, void *ctx)
{
    struct nth_buf *n = ctx;
    if (n->seen++ == n->want)
        n->found = b;
}

/* The index-th buffer foreach_buf visits (for kv: block `index`), borrowed. */
static kvt_buf *kv_buf_of(const kvt_cache *c, int64_t index)
{
    struct nth_buf n = {index, 0, NULL};
    c->ops->foreach_buf(c, nth_buf_fn, &n);
    assert_non_null(n.found);
    return n.found;
}

/* Decodes a state that must fail with `want` and a detail containing msg. */
static void expect_decode_fail(const kvt_cache_state *st, int want, const char *msg, int case_no)
{
    kvt_cache *r = (kvt_cache *)1;
    int rc = kvt_cache_decode(st, &r);
    if (rc != want || !strstr(kvt_last_error(), msg))
        fail_msg("case %d: rc %d (%s), want %d and \"%s\"", case_no, rc, kvt_last_error(), want, msg);
    assert_null(r);
}

static void add_bytes(kvt_buf *b, void *ctx) { *(size_t *)ctx += kvt_buf_bytes(b); }
static void count_bufs(kvt_buf *b, void *ctx) { (void)b; ++*(int *)ctx; }

/* ---- injected allocator --------------------------------------------------------- */

static long alloc_budget = -1; /* allocations left before failing; -1 = never fail */
static long alloc_live;

static void *t_malloc(size_t n, void *ctx)
{
    (void)ctx;
    if (alloc_budget == 0)
        return NULL;
    if (alloc_budget > 0)
        alloc_budget--;
    alloc_live++;
    return malloc(n ? n : 1);
}
static void *t_realloc(void *p, size_t n, void *ctx)
{
    (void)ctx;
    if (alloc_budget == 0)
        return NULL;
    if (alloc_budget > 0)
        alloc_budget--;
    if (!p)
        alloc_live++;
    return realloc(p, n ? n : 1);
}
static void t_free(void *p, void *ctx)
{
    (void)ctx;
    if (p)
        alloc_live--;
    free(p);
}
static const kvt_allocator t_alloc = {t_malloc, t_realloc, t_free, NULL};

static int setup_alloc(void **state)
{
    (void)state;
    alloc_budget = -1;
    alloc_live = 0;
    kvt_set_allocator(&t_alloc);
    return 0;
}
static int teardown_alloc(void **state)
{
    (void)state;
    long live = alloc_live;
    kvt_set_allocator(NULL);
    if (live != 0)
        fail_msg("%ld kvtier allocations leaked", live);
    return 0;
}

/* ---- dtypes ------------------------------------------------------------------- */

static void test_dtypes(void **state)
{
    (void)state;
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_F32), 4);
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_BF16), 2);
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_I64), 8);
    assert_int_equal(kvt_dtype_size(KVT_DTYPE_COUNT), 0);
    assert_string_equal(kvt_dtype_name(KVT_DTYPE_U8), "U8");
    assert_null(kvt_dtype_name((kvt_dtype)99));
    for (int i = 0; i < KVT_DTYPE_COUNT; i++) {
        kvt_dtype dt;
        assert_int_equal(kvt_dtype_parse(kvt_dtype_name((kvt_dtype)i), &dt), 0);
        assert_int_equal(dt, i);
    }
    kvt_dtype dt;
    assert_int_equal(kvt_dtype_parse("F64", &dt), KVT_EFORMAT);
    assert_non_null(strstr(kvt_last_error(), "F64"));
}

/* ---- kv ----------------------------------------------------------------------- */

static void test_kv_create_args(void **state)
{
    (void)state;
    kvt_cache *c = (kvt_cache *)1;
    assert_int_equal(kvt_kv_create(0, 4, &c), KVT_EINVAL);
    assert_null(c);
    assert_int_equal(kvt_kv_create(4, 0, &c), KVT_EINVAL);
    assert_int_equal(kvt_kv_create(4, 4, NULL), KVT_EINVAL);
    assert_int_equal(kvt_kv_create(3, 4, &c), 0);
    assert_string_equal(kvt_cache_kind(c), "kv");
    assert_int_equal(kvt_kv_dim(c), 3);
    assert_int_equal(kvt_kv_block_tokens(c), 4);
    int64_t lo = -1, hi = -1;
    kvt_cache_range(c, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 0);
    /* append argument checks leave the cache empty */
    float x[3] = {0};
    const void *bad[2] = {x, NULL};
    assert_int_equal(kvt_cache_append(c, 1, bad), KVT_EINVAL);
    assert_int_equal(kvt_cache_append(c, -1, bad), KVT_EINVAL);
    assert_int_equal(kvt_cache_append(c, 1, NULL), KVT_EINVAL);
    assert_int_equal(kvt_cache_append(c, 0, NULL), 0);
    assert_int_equal(kvt_cache_offset(c), 0);
    assert_int_equal(kvt_kv_block(c, 0, NULL, NULL, NULL), KVT_ERANGE);
    assert_int_equal(kvt_kv_block(NULL, 0, NULL, NULL, NULL), KVT_EINVAL);
    kvt_cache_destroy(c);
    kvt_cache_destroy(NULL);
}

static void test_kv_append_read(void **state)
{
    (void)state;
    kvt_cache *c;
    assert_int_equal(kvt_kv_create(3, 4, &c), 0);
    assert_int_equal(append_tokens(c, 0, 1, 3), 0);
    check_kv(c, 1);
    assert_int_equal(append_tokens(c, 1, 10, 3), 0); /* fills the tail, then 2 new blocks */
    check_kv(c, 11);
    assert_int_equal(append_tokens(c, 11, 1, 3), 0); /* exactly fills block 2 */
    check_kv(c, 12);
    assert_int_equal(append_tokens(c, 12, 4, 3), 0); /* one whole new block */
    check_kv(c, 16);
    /* bytes: private + 4 blocks of (2, 4, 3) f32 */
    size_t bufs = 0;
    int nbuf = 0;
    const kvt_cache_ops *ops = c->ops;
    ops->foreach_buf(c, add_bytes, &bufs);
    ops->foreach_buf(c, count_bufs, &nbuf);
    assert_int_equal(nbuf, 4);
    assert_int_equal(bufs, 4 * 2 * 4 * 3 * sizeof(float));
    assert_int_equal(kvt_cache_bytes(c), ops->private_bytes(c) + bufs);
    assert_true(ops->private_bytes(c) > 0);
    kvt_cache_destroy(c);
}

static void test_kv_clone_cow(void **state)
{
    (void)state;
    const int d = 2, B = 4;
    kvt_cache *a, *b;
    assert_int_equal(kvt_kv_create(d, B, &a), 0);
    assert_int_equal(append_tokens(a, 0, 10, d), 0); /* blocks 0, 1 full; tail of 2 */
    uint64_t c0 = kvt_buf_bytes_copied();
    assert_int_equal(kvt_cache_clone(a, &b), 0);
    assert_int_equal(kvt_buf_bytes_copied(), c0); /* zero bytes copied */
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvt_buf_refs(kv_buf_of(a, i)), 2);
    assert_ptr_equal(kv_buf_of(a, 2), kv_buf_of(b, 2));
    check_kv(b, 10);

    /* the first write into the shared tail copies that block only: 2 rows of K and V */
    assert_int_equal(append_tokens(b, 10, 1, d), 0);
    assert_int_equal(kvt_buf_bytes_copied() - c0, 2 * 2 * d * sizeof(float));
    assert_ptr_not_equal(kv_buf_of(a, 2), kv_buf_of(b, 2));
    assert_int_equal(kvt_buf_refs(kv_buf_of(a, 2)), 1);
    assert_int_equal(kvt_buf_refs(kv_buf_of(b, 2)), 1);
    assert_int_equal(kvt_buf_refs(kv_buf_of(a, 0)), 2);
    assert_int_equal(kvt_buf_refs(kv_buf_of(a, 1)), 2);
    check_kv(a, 10);
    check_kv(b, 11);

    /* the source now owns its tail alone: writes in place */
    uint64_t c1 = kvt_buf_bytes_copied();
    kvt_buf *tail = kv_buf_of(a, 2);
    float k[2] = {77, 78}, v[2] = {79, 80};
    const void *in[2] = {k, v};
    assert_int_equal(kvt_cache_append(a, 1, in), 0);
    assert_int_equal(kvt_buf_bytes_copied(), c1);
    assert_ptr_equal(kv_buf_of(a, 2), tail);
    const float *kk, *vv;
    int32_t nt;
    assert_int_equal(kvt_kv_block(a, 2, &kk, &vv, &nt), 0);
    assert_int_equal(nt, 3);
    assert_true(kk[2 * d] == 77 && kk[2 * d + 1] == 78 && vv[2 * d] == 79 && vv[2 * d + 1] == 80);
    check_kv(b, 11); /* the clone did not see it */

    /* a clone of a cache ending on a block boundary: next append makes a new block, no copy */
    kvt_cache *e, *f;
    assert_int_equal(kvt_kv_create(d, B, &e), 0);
    assert_int_equal(append_tokens(e, 0, 8, d), 0);
    assert_int_equal(kvt_cache_clone(e, &f), 0);
    uint64_t c2 = kvt_buf_bytes_copied();
    assert_int_equal(append_tokens(f, 8, 5, d), 0);
    assert_int_equal(kvt_buf_bytes_copied(), c2);
    check_kv(e, 8);
    check_kv(f, 13);

    /* the source disposed: the clone keeps the shared blocks alive */
    kvt_cache_destroy(a);
    check_kv(b, 11);
    assert_int_equal(kvt_buf_refs(kv_buf_of(b, 0)), 1);
    kvt_cache_destroy(b);
    kvt_cache_destroy(e);
    kvt_cache_destroy(f);
}

static void test_kv_trim_every_length(void **state)
{
    (void)state;
    const int d = 3, B = 4;
    const int64_t n = 13;
    kvt_cache *src;
    assert_int_equal(kvt_kv_create(d, B, &src), 0);
    assert_int_equal(append_tokens(src, 0, n, d), 0);
    assert_int_equal(kvt_cache_trim(src, n + 1), KVT_ERANGE);
    assert_int_equal(kvt_cache_trim(src, -1), KVT_ERANGE);
    assert_int_equal(kvt_cache_can_trim(src, n + 1), 0);
    check_kv(src, n);
    for (int64_t len = 0; len <= n; len++) {
        kvt_cache *c;
        assert_int_equal(kvt_cache_clone(src, &c), 0);
        assert_int_equal(kvt_cache_can_trim(c, len), 1);
        uint64_t c0 = kvt_buf_bytes_copied();
        assert_int_equal(kvt_cache_trim(c, len), 0);
        assert_int_equal(kvt_buf_bytes_copied(), c0); /* trimming copies nothing */
        check_kv(c, len);
        int nbuf = 0;
        c->ops->foreach_buf(c, count_bufs, &nbuf);
        assert_int_equal(nbuf, (len + B - 1) / B);
        /* the next append copies the (shared) partial tail lazily, only its rows */
        assert_int_equal(append_tokens(c, len, 6, d), 0);
        assert_int_equal(kvt_buf_bytes_copied() - c0, (uint64_t)(len % B) * 2 * d * sizeof(float));
        check_kv(c, len + 6);
        check_kv(src, n);
        kvt_cache_destroy(c);
    }
    kvt_cache_destroy(src);
}

static void test_kv_encode_decode(void **state)
{
    (void)state;
    const int d = 3, B = 4;
    kvt_cache *c, *r;
    assert_int_equal(kvt_kv_create(d, B, &c), 0);
    assert_int_equal(append_tokens(c, 0, 10, d), 0);
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    assert_string_equal(st.kind, "kv");
    assert_int_equal(st.offset, 10);
    assert_int_equal(st.min_offset, 0);
    assert_int_equal(st.n_params, 2);
    assert_int_equal(st.params[0], d);
    assert_int_equal(st.params[1], B);
    assert_int_equal(st.n_tensors, 3);
    for (int i = 0; i < 3; i++) {
        const kvt_tensor *t = &st.tensors[i];
        char name[16];
        snprintf(name, sizeof name, "blk%d", i);
        assert_string_equal(t->name, name);
        assert_int_equal(t->dtype, KVT_DTYPE_F32);
        assert_int_equal(t->ndim, 3);
        assert_int_equal(t->shape[0], 2);
        assert_int_equal(t->shape[1], i < 2 ? 4 : 2);
        assert_int_equal(t->shape[2], d);
        assert_int_equal(t->bytes, 2 * t->shape[1] * d * sizeof(float));
        assert_non_null(t->owner);
        assert_int_equal(t->tok_begin, i < 2 ? i * B : -1);
        assert_int_equal(t->tok_end, i < 2 ? i * B + B : -1);
        const float *f = t->data;
        for (int64_t r0 = 0; r0 < t->shape[1]; r0++)
            for (int j = 0; j < d; j++) {
                assert_true(f[r0 * d + j] == val(0, i * B + r0, j));
                assert_true(f[(t->shape[1] + r0) * d + j] == val(1, i * B + r0, j));
            }
    }
    /* full blocks are shared with the state, not copied */
    assert_ptr_equal(st.tensors[0].owner, kv_buf_of(c, 0));
    assert_int_equal(kvt_buf_refs(st.tensors[0].owner), 2);

    assert_int_equal(kvt_cache_decode(&st, &r), 0);
    check_kv(r, 10);
    /* zero-copy restore: the decoded full blocks are the same buffers */
    assert_ptr_equal(kv_buf_of(r, 0), kv_buf_of(c, 0));
    assert_ptr_equal(kv_buf_of(r, 1), kv_buf_of(c, 1));
    assert_ptr_not_equal(kv_buf_of(r, 2), kv_buf_of(c, 2));
    kvt_cache_state_clear(&st);
    assert_int_equal(st.n_tensors, 0);
    assert_null(st.tensors);
    kvt_cache_destroy(c);
    /* r holds a retained (foreign) block alone now; trimming into it and
     * writing must still copy it rather than write into the decoded buffer */
    kvt_buf *blk1 = kv_buf_of(r, 1);
    assert_int_equal(kvt_buf_refs(blk1), 1);
    assert_int_equal(kvt_cache_trim(r, 6), 0);
    uint64_t c0 = kvt_buf_bytes_copied();
    assert_int_equal(append_tokens(r, 6, 3, d), 0);
    assert_int_equal(kvt_buf_bytes_copied() - c0, 2 * 2 * d * sizeof(float));
    check_kv(r, 9);
    kvt_cache_destroy(r);

    /* empty cache round trip */
    assert_int_equal(kvt_kv_create(d, B, &c), 0);
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    assert_int_equal(st.n_tensors, 0);
    assert_int_equal(kvt_cache_decode(&st, &r), 0);
    check_kv(r, 0);
    kvt_cache_state_clear(&st);
    kvt_cache_state_clear(NULL);
    kvt_cache_destroy(c);
    kvt_cache_destroy(r);
}

/* A state decoded from copies the caller owns (no owner): decode copies. */
static void test_kv_decode_copies_borrowed(void **state)
{
    (void)state;
    kvt_cache *c, *r;
    assert_int_equal(kvt_kv_create(2, 2, &c), 0);
    assert_int_equal(append_tokens(c, 0, 5, 2), 0);
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    kvt_buf *owners[3];
    for (int i = 0; i < 3; i++) {
        owners[i] = st.tensors[i].owner;
        st.tensors[i].owner = NULL; /* data stays valid: c and owners[] hold it */
    }
    uint64_t c0 = kvt_buf_bytes_copied();
    assert_int_equal(kvt_cache_decode(&st, &r), 0);
    assert_int_equal(kvt_buf_bytes_copied() - c0, 5 * 2 * 2 * sizeof(float));
    assert_ptr_not_equal(kv_buf_of(r, 0), kv_buf_of(c, 0));
    check_kv(r, 5);
    for (int i = 0; i < 3; i++)
        kvt_buf_release(owners[i]);
    kvt_cache_state_clear(&st);
    kvt_cache_destroy(c);
    check_kv(r, 5);
    kvt_cache_destroy(r);
}

/* Each kind of bad kv state is rejected with its own message. */
static void test_kv_decode_rejects(void **state)
{
    (void)state;
    kvt_cache *c, *r = (kvt_cache *)1;
    assert_int_equal(kvt_kv_create(2, 4, &c), 0);
    assert_int_equal(append_tokens(c, 0, 6, 2), 0);
    static char far[64];
    enum { N_CASES = 17 };
    for (int k = 0; k < N_CASES; k++) {
        kvt_cache_state st;
        assert_int_equal(kvt_cache_encode(c, &st), 0);
        int want = KVT_EFORMAT;
        const char *msg = NULL;
        switch (k) {
        case 0: strcpy(st.kind, "nope"); want = KVT_EUNSUPPORTED; msg = "unknown kind"; break;
        case 1: memset(st.kind, 'x', sizeof st.kind); msg = "not terminated"; break;
        case 2: st.n_params = 1; msg = "params, expected 2"; break;
        case 3: st.params[0] = 0; msg = "kv_dim = 0"; break;
        case 4: st.params[1] = -5; msg = "block_tokens = -5"; break;
        case 5: st.min_offset = 3; msg = "min_offset"; break;
        case 6: st.offset = 9; msg = "tensors, 9 tokens"; break;
        case 7: st.offset = -1; msg = "bad range"; break;
        case 8: strcpy(st.tensors[1].name, "blk7"); msg = "expected \"blk1\""; break;
        case 9: st.tensors[0].dtype = KVT_DTYPE_I32; msg = "dtype I32"; break;
        case 10: st.tensors[0].dtype = (kvt_dtype)42; msg = "unknown dtype"; break;
        case 11: st.tensors[0].shape[1] = 3; st.tensors[0].bytes = 2 * 3 * 2 * 4; msg = "shape (2, 3, 2), expected (2, 4, 2)"; break;
        case 12: st.tensors[0].bytes -= 4; msg = "bytes, its shape"; break;
        case 13: st.tensors[0].data = NULL; msg = "no data"; break;
        case 14: st.tensors[0].data = far; msg = "outside its owner"; break;
        case 15: st.n_tensors = -1; msg = "-1 tensors"; break;
        case 16: st.tensors[0].ndim = 5; msg = "5 dims"; break;
        }
        expect_decode_fail(&st, want, msg, k);
        if (k == 15)
            st.n_tensors = 2;
        kvt_cache_state_clear(&st);
    }
    assert_int_equal(kvt_cache_decode(NULL, &r), KVT_EINVAL);
    kvt_cache_destroy(c);
}

/* Every allocation failure leaves the cache as it was (and leaks nothing). */
static void test_kv_oom(void **state)
{
    (void)state;
    const int d = 2, B = 4;
    int succeeded = 0;
    for (long fail_at = 0; !succeeded && fail_at < 64; fail_at++) {
        kvt_cache *a, *b;
        alloc_budget = -1;
        assert_int_equal(kvt_kv_create(d, B, &a), 0);
        assert_int_equal(append_tokens(a, 0, 6, d), 0);
        assert_int_equal(kvt_cache_clone(a, &b), 0);
        size_t bytes = kvt_cache_bytes(b);
        alloc_budget = fail_at;
        /* shared tail copy + 5 new blocks + a larger table */
        int rc = append_tokens(b, 6, 20, d);
        alloc_budget = -1;
        if (rc == 0) {
            succeeded = 1;
            check_kv(b, 26);
        } else {
            assert_int_equal(rc, KVT_ENOMEM);
            check_kv(b, 6);
            assert_true(kvt_cache_bytes(b) >= bytes);
            assert_ptr_equal(kv_buf_of(a, 1), kv_buf_of(b, 1));
            assert_int_equal(kvt_buf_refs(kv_buf_of(b, 1)), 2);
        }
        check_kv(a, 6);
        /* clone, encode and decode under the same failure point */
        kvt_cache *x = NULL;
        kvt_cache_state st;
        alloc_budget = fail_at;
        rc = kvt_cache_clone(a, &x);
        alloc_budget = -1;
        assert_true(rc == 0 || (rc == KVT_ENOMEM && x == NULL));
        kvt_cache_destroy(x);
        alloc_budget = fail_at;
        rc = kvt_cache_encode(a, &st);
        alloc_budget = -1;
        if (rc == 0) {
            x = NULL;
            alloc_budget = fail_at;
            int rc2 = kvt_cache_decode(&st, &x);
            alloc_budget = -1;
            assert_true(rc2 == 0 || (rc2 == KVT_ENOMEM && x == NULL));
            if (x)
                check_kv(x, 6);
            kvt_cache_destroy(x);
        } else {
            assert_int_equal(rc, KVT_ENOMEM);
            assert_int_equal(st.n_tensors, 0);
        }
        kvt_cache_state_clear(&st);
        kvt_cache_destroy(a);
        kvt_cache_destroy(b);
    }
    assert_true(succeeded);
}

static void test_caches_clone(void **state)
{
    (void)state;
    kvt_cache *src[3], *dst[3];
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvt_kv_create(2, 4, &src[i]), 0);
        assert_int_equal(append_tokens(src[i], 0, 5 + i, 2), 0);
    }
    assert_int_equal(kvt_caches_clone(src, 3, dst), 0);
    for (int i = 0; i < 3; i++)
        check_kv(dst[i], 5 + i);
    kvt_caches_destroy(dst, 3);
    for (int i = 0; i < 3; i++)
        assert_null(dst[i]);
    /* all or nothing */
    for (long fail_at = 0; fail_at < 6; fail_at++) {
        alloc_budget = fail_at;
        int rc = kvt_caches_clone(src, 3, dst);
        alloc_budget = -1;
        if (rc == 0) {
            kvt_caches_destroy(dst, 3);
            continue;
        }
        assert_int_equal(rc, KVT_ENOMEM);
        for (int i = 0; i < 3; i++)
            assert_null(dst[i]);
    }
    kvt_caches_destroy(src, 3);
}

/* ---- rotating ------------------------------------------------------------------ */

/* Oracle: token held by each slot after tokens [0, n) were written one by one. */
static void ring_oracle(int64_t n, int window, int keep, int64_t *slot_tok)
{
    for (int s = 0; s < window; s++)
        slot_tok[s] = -1;
    for (int64_t t = 0; t < n; t++)
        slot_tok[t < keep ? t : keep + (t - keep) % (window - keep)] = t;
}

static void check_ring(const kvt_cache *c, int64_t n, int window, int keep, int d)
{
    const float *k, *v;
    int32_t nv;
    int64_t slot_tok[64];
    assert_int_equal(kvt_rotating_view(c, &k, &v, &nv), 0);
    assert_int_equal(nv, n < window ? n : window);
    assert_int_equal(kvt_cache_offset(c), n);
    ring_oracle(n, window, keep, slot_tok);
    for (int s = 0; s < nv; s++)
        for (int j = 0; j < d; j++)
            if (k[s * d + j] != val(0, slot_tok[s], j) || v[s * d + j] != val(1, slot_tok[s], j))
                fail_msg("offset %lld slot %d elem %d: K %g V %g, want token %lld", (long long)n, s, j,
                         k[s * d + j], v[s * d + j], (long long)slot_tok[s]);
}

static void test_rotating(void **state)
{
    (void)state;
    const int d = 2;
    kvt_cache *c = (kvt_cache *)1;
    assert_int_equal(kvt_rotating_create(d, 4, 4, &c), KVT_EINVAL);
    assert_null(c);
    assert_int_equal(kvt_rotating_create(d, 0, 0, &c), KVT_EINVAL);
    for (int keep = 0; keep < 3; keep++) {
        const int W = 6;
        assert_int_equal(kvt_rotating_create(d, W, keep, &c), 0);
        assert_string_equal(kvt_cache_kind(c), "rotating");
        assert_int_equal(kvt_kv_dim(c), d);
        assert_int_equal(kvt_kv_block_tokens(c), 0);
        int64_t n = 0;
        for (int step = 1; n < 40; step = step % 9 + 1) { /* batches of 1..9 tokens */
            assert_int_equal(append_tokens(c, n, step, d), 0);
            n += step;
            check_ring(c, n, W, keep, d);
            int64_t lo, hi;
            kvt_cache_range(c, &lo, &hi);
            assert_int_equal(hi, n);
            assert_int_equal(lo, n <= W ? 0 : n);
        }
        /* after the wrap only the offset itself */
        assert_int_equal(kvt_cache_trim(c, n - 1), KVT_ERANGE);
        assert_int_equal(kvt_cache_trim(c, n), 0);
        check_ring(c, n, W, keep, d);
        kvt_cache_destroy(c);
    }
    /* before the wrap: trims at every length, then refill past the window */
    const int W = 5, keep = 1;
    kvt_cache *src;
    assert_int_equal(kvt_rotating_create(d, W, keep, &src), 0);
    assert_int_equal(append_tokens(src, 0, W, d), 0); /* exactly full: still trimmable */
    assert_int_equal(kvt_cache_can_trim(src, 0), 1);
    for (int64_t len = 0; len <= W; len++) {
        assert_int_equal(kvt_cache_clone(src, &c), 0);
        assert_ptr_equal(kv_buf_of(c, 0), kv_buf_of(src, 0));
        assert_int_equal(kvt_cache_trim(c, len), 0);
        check_ring(c, len, W, keep, d);
        uint64_t c0 = kvt_buf_bytes_copied();
        assert_int_equal(append_tokens(c, len, 9, d), 0); /* copy-on-write of the valid slots */
        assert_int_equal(kvt_buf_bytes_copied() - c0, (uint64_t)len * 2 * d * sizeof(float));
        check_ring(c, len + 9, W, keep, d);
        check_ring(src, W, W, keep, d);
        uint64_t c1 = kvt_buf_bytes_copied();
        assert_int_equal(append_tokens(c, len + 9, 2, d), 0); /* now private: in place */
        assert_int_equal(kvt_buf_bytes_copied(), c1);
        check_ring(c, len + 11, W, keep, d);
        kvt_cache_destroy(c);
    }
    assert_int_equal(kvt_cache_bytes(src), sizeof(float) * 2 * W * d + src->ops->private_bytes(src));
    kvt_cache_destroy(src);
}

static void test_rotating_encode_decode(void **state)
{
    (void)state;
    const int d = 3, W = 4, keep = 1;
    for (int64_t n = 0; n <= 9; n += 3) {
        kvt_cache *c, *r;
        assert_int_equal(kvt_rotating_create(d, W, keep, &c), 0);
        assert_int_equal(append_tokens(c, 0, n, d), 0);
        kvt_cache_state st;
        assert_int_equal(kvt_cache_encode(c, &st), 0);
        assert_string_equal(st.kind, "rotating");
        assert_int_equal(st.offset, n);
        assert_int_equal(st.min_offset, n <= W ? 0 : n);
        assert_int_equal(st.n_params, 3);
        assert_true(st.params[0] == d && st.params[1] == W && st.params[2] == keep);
        assert_int_equal(st.n_tensors, 1);
        assert_string_equal(st.tensors[0].name, "ring");
        assert_int_equal(st.tensors[0].dtype, KVT_DTYPE_F32);
        assert_true(st.tensors[0].ndim == 3 && st.tensors[0].shape[0] == 2 && st.tensors[0].shape[1] == W &&
                    st.tensors[0].shape[2] == d);
        assert_int_equal(st.tensors[0].tok_begin, -1);
        assert_int_equal(kvt_cache_decode(&st, &r), 0);
        assert_ptr_equal(kv_buf_of(r, 0), kv_buf_of(c, 0)); /* zero-copy */
        check_ring(r, n, W, keep, d);
        int64_t lo, hi;
        kvt_cache_range(r, &lo, &hi);
        assert_int_equal(lo, st.min_offset);
        kvt_cache_state_clear(&st);
        kvt_cache_destroy(c);
        /* r holds the decoded ring alone; it is foreign, so a write copies */
        uint64_t c0 = kvt_buf_bytes_copied();
        assert_int_equal(append_tokens(r, n, 2, d), 0);
        assert_int_equal(kvt_buf_bytes_copied() - c0, (uint64_t)(n < W ? n : W) * 2 * d * sizeof(float));
        check_ring(r, n + 2, W, keep, d);
        kvt_cache_destroy(r);
    }
    /* rejects */
    kvt_cache *c;
    assert_int_equal(kvt_rotating_create(d, W, keep, &c), 0);
    assert_int_equal(append_tokens(c, 0, 6, d), 0);
    for (int k = 0; k < 6; k++) {
        kvt_cache_state st;
        assert_int_equal(kvt_cache_encode(c, &st), 0);
        const char *msg = NULL;
        switch (k) {
        case 0: st.params[2] = W; msg = "keep = 4 is outside [0, 3]"; break;
        case 1: st.params[1] = 0; msg = "window = 0"; break;
        case 2: st.min_offset = 0; msg = "min_offset is 0"; break;
        case 3: st.n_tensors = 0; msg = "0 tensors, expected 1"; break;
        case 4: strcpy(st.tensors[0].name, "rung"); msg = "expected \"ring\""; break;
        case 5: st.n_params = 4; msg = "4 params, expected 3"; break;
        }
        expect_decode_fail(&st, KVT_EFORMAT, msg, k);
        if (k == 3)
            st.n_tensors = 1;
        kvt_cache_state_clear(&st);
    }
    kvt_cache_destroy(c);
}

/* ---- recurrent ------------------------------------------------------------------ */

static void test_recurrent(void **state)
{
    (void)state;
    kvt_cache *c, *d2;
    assert_int_equal(kvt_recurrent_create(0, &c), KVT_EINVAL);
    assert_int_equal(kvt_recurrent_create(16, &c), 0);
    assert_string_equal(kvt_cache_kind(c), "recurrent");
    const unsigned char *s = kvt_recurrent_state(c);
    for (int i = 0; i < 16; i++)
        assert_int_equal(s[i], 0);
    unsigned char s1[16], s2[16];
    for (int i = 0; i < 16; i++) {
        s1[i] = (unsigned char)(i + 1);
        s2[i] = (unsigned char)(200 - i);
    }
    const void *in1[1] = {s1}, *in2[1] = {s2}, *bad[1] = {NULL};
    assert_int_equal(kvt_cache_append(c, 3, bad), KVT_EINVAL);
    assert_int_equal(kvt_cache_append(c, 3, in1), 0);
    int64_t lo, hi;
    kvt_cache_range(c, &lo, &hi);
    assert_int_equal(lo, 3);
    assert_int_equal(hi, 3);
    assert_memory_equal(kvt_recurrent_state(c), s1, 16);
    assert_int_equal(kvt_cache_trim(c, 2), KVT_ERANGE);
    assert_int_equal(kvt_cache_trim(c, 0), KVT_ERANGE);
    assert_int_equal(kvt_cache_trim(c, 3), 0);
    assert_null(kvt_recurrent_state(NULL));
    assert_int_equal(kvt_cache_bytes(c), 16 + c->ops->private_bytes(c));

    /* clone shares; a write into the clone takes a new buffer, copies nothing */
    assert_int_equal(kvt_cache_clone(c, &d2), 0);
    assert_ptr_equal(kvt_recurrent_state(d2), kvt_recurrent_state(c));
    assert_int_equal(kvt_buf_refs(kv_buf_of(c, 0)), 2);
    uint64_t c0 = kvt_buf_bytes_copied();
    assert_int_equal(kvt_cache_append(d2, 2, in2), 0);
    assert_int_equal(kvt_buf_bytes_copied(), c0);
    assert_memory_equal(kvt_recurrent_state(c), s1, 16);
    assert_memory_equal(kvt_recurrent_state(d2), s2, 16);
    assert_int_equal(kvt_cache_offset(d2), 5);
    assert_int_equal(kvt_cache_offset(c), 3);
    /* private now: in place */
    const void *p = kvt_recurrent_state(d2);
    assert_int_equal(kvt_cache_append(d2, 1, in1), 0);
    assert_ptr_equal(kvt_recurrent_state(d2), p);
    assert_memory_equal(p, s1, 16);
    kvt_cache_destroy(d2);
    kvt_cache_destroy(c);
}

static void test_recurrent_encode_decode(void **state)
{
    (void)state;
    /* a state whose owner wraps memory kvtier does not own (a file region) */
    static unsigned char region[32];
    for (int i = 0; i < 32; i++)
        region[i] = (unsigned char)(3 * i);
    kvt_buf *owner;
    assert_int_equal(kvt_buf_wrap(region, sizeof region, NULL, NULL, &owner), 0);
    kvt_cache_state st;
    memset(&st, 0, sizeof st);
    strcpy(st.kind, "recurrent");
    st.offset = st.min_offset = 7;
    st.n_params = 1;
    st.params[0] = 32;
    kvt_tensor t;
    memset(&t, 0, sizeof t);
    strcpy(t.name, "state");
    t.dtype = KVT_DTYPE_U8;
    t.ndim = 1;
    t.shape[0] = 32;
    t.data = region;
    t.bytes = 32;
    t.owner = owner;
    st.n_tensors = 1;
    st.tensors = &t;
    kvt_cache *r;
    assert_int_equal(kvt_cache_decode(&st, &r), 0);
    assert_ptr_equal(kvt_recurrent_state(r), region); /* zero-copy */
    assert_int_equal(kvt_cache_offset(r), 7);
    /* decode failures */
    const char *msgs[4] = {"state_bytes = 0", "not a single point", "dtype I8", "has shape (31)"};
    for (int k = 0; k < 4; k++) {
        kvt_cache_state bad = st;
        kvt_tensor bt = t;
        bad.tensors = &bt;
        if (k == 0)
            bad.params[0] = 0;
        if (k == 1)
            bad.min_offset = 0;
        if (k == 2)
            bt.dtype = KVT_DTYPE_I8;
        if (k == 3) {
            bt.shape[0] = 31;
            bt.bytes = 31;
        }
        expect_decode_fail(&bad, KVT_EFORMAT, msgs[k], k);
    }
    kvt_buf_release(owner); /* r holds the region alone now */
    unsigned char s[32];
    memset(s, 0xAB, sizeof s);
    const void *in[1] = {s};
    assert_int_equal(kvt_cache_append(r, 1, in), 0);
    assert_int_equal(region[5], 15); /* the foreign region was never written */
    assert_memory_equal(kvt_recurrent_state(r), s, 32);
    /* round trip through encode */
    kvt_cache_state st2;
    kvt_cache *r2;
    assert_int_equal(kvt_cache_encode(r, &st2), 0);
    assert_int_equal(st2.offset, 8);
    assert_int_equal(st2.min_offset, 8);
    assert_int_equal(st2.params[0], 32);
    assert_string_equal(st2.tensors[0].name, "state");
    assert_int_equal(kvt_cache_decode(&st2, &r2), 0);
    assert_memory_equal(kvt_recurrent_state(r2), s, 32);
    assert_int_equal(kvt_cache_offset(r2), 8);
    kvt_cache_state_clear(&st2);
    kvt_cache_destroy(r);
    kvt_cache_destroy(r2);
}

/* ---- qkv ------------------------------------------------------------------------ */

/* Input value of K (which 0) or V (1) at token t, element j; every 7th token
 * has an all-zero first group. */
static float qval(int which, int64_t t, int j, int gs)
{
    if (t % 7 == 0 && j < gs)
        return 0.0f;
    return sinf((float)t * 0.37f + (float)j * 1.3f + (float)which) * (float)(1 + j % 5);
}

static int qkv_append_tokens(kvt_cache *c, int64_t t0, int64_t n, int d, int gs)
{
    float *k = malloc(sizeof(float) * (size_t)(n * d + 1)), *v = malloc(sizeof(float) * (size_t)(n * d + 1));
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < d; j++) {
            k[i * d + j] = qval(0, t0 + i, j, gs);
            v[i * d + j] = qval(1, t0 + i, j, gs);
        }
    const void *in[2] = {k, v};
    int rc = kvt_cache_append(c, n, in);
    free(k);
    free(v);
    return rc;
}

/* Asserts a qkv cache holds tokens [0, n) within the quantization bound. */
static void check_qkv(const kvt_cache *c, int64_t n, int gs)
{
    int32_t B = kvt_kv_block_tokens(c), d = kvt_kv_dim(c);
    assert_int_equal(kvt_cache_offset(c), n);
    float *k = malloc(sizeof(float) * (size_t)(B * d)), *v = malloc(sizeof(float) * (size_t)(B * d));
    int64_t nb = (n + B - 1) / B;
    for (int64_t b = 0; b < nb; b++) {
        int32_t nt;
        assert_int_equal(kvt_qkv_read_block(c, b, k, v, &nt), 0);
        assert_int_equal(nt, b * B + B <= n ? B : n - b * B);
        for (int32_t i = 0; i < nt; i++)
            for (int which = 0; which < 2; which++)
                for (int g = 0; g < d / gs; g++) {
                    int64_t t = b * B + i;
                    float amax = 0;
                    for (int j = g * gs; j < g * gs + gs; j++)
                        amax = fmaxf(amax, fabsf(qval(which, t, j, gs)));
                    float scale = amax / 127.0f;
                    for (int j = g * gs; j < g * gs + gs; j++) {
                        float x = qval(which, t, j, gs), y = (which ? v : k)[i * d + j];
                        if (scale == 0.0f ? y != 0.0f : fabsf(x - y) > scale * 0.5f * (1 + 1e-5f))
                            fail_msg("token %lld %c[%d]: %g dequantized to %g (scale %g)", (long long)t,
                                     which ? 'V' : 'K', j, x, y, scale);
                    }
                }
    }
    assert_int_equal(kvt_qkv_read_block(c, nb, k, v, NULL), KVT_ERANGE);
    free(k);
    free(v);
}

static void test_qkv(void **state)
{
    (void)state;
    const int d = 8, gs = 4, B = 3;
    kvt_cache *c = (kvt_cache *)1, *x;
    assert_int_equal(kvt_qkv_create(d, 3, B, &c), KVT_EINVAL);
    assert_null(c);
    assert_int_equal(kvt_qkv_create(d, 0, B, &c), KVT_EINVAL);
    assert_int_equal(kvt_qkv_create(d, gs, B, &c), 0);
    assert_string_equal(kvt_cache_kind(c), "qkv");
    assert_int_equal(kvt_kv_dim(c), d);
    assert_int_equal(kvt_kv_block_tokens(c), B);
    assert_int_equal(kvt_qkv_read_block(NULL, 0, NULL, NULL, NULL), KVT_EINVAL);
    assert_int_equal(qkv_append_tokens(c, 0, 1, d, gs), 0);
    check_qkv(c, 1, gs);
    assert_int_equal(qkv_append_tokens(c, 1, 10, d, gs), 0);
    check_qkv(c, 11, gs);
    /* the largest element of a group comes back exactly (code 127) */
    float k[24], v[24];
    assert_int_equal(kvt_qkv_read_block(c, 0, k, v, NULL), 0);
    assert_true(fabsf(k[1 * d + 4] - qval(0, 1, 4, gs)) <= fabsf(qval(0, 1, 4, gs)) * 1e-6f);
    /* bytes: 4 blocks of scales (2, 3, 2) f32 + codes (2, 3, 8) i8 */
    size_t bufs = 0;
    c->ops->foreach_buf(c, add_bytes, &bufs);
    assert_int_equal(bufs, 4 * (2 * 3 * 2 * 4 + 2 * 3 * 8));
    assert_int_equal(kvt_cache_bytes(c), bufs + c->ops->private_bytes(c));

    /* clone shares every block; the shared tail is copied on the first write */
    uint64_t c0 = kvt_buf_bytes_copied();
    assert_int_equal(kvt_cache_clone(c, &x), 0);
    assert_int_equal(kvt_buf_bytes_copied(), c0);
    assert_ptr_equal(kv_buf_of(c, 3), kv_buf_of(x, 3));
    assert_int_equal(kvt_buf_refs(kv_buf_of(c, 0)), 2);
    assert_int_equal(qkv_append_tokens(x, 11, 4, d, gs), 0);
    assert_int_equal(kvt_buf_bytes_copied() - c0, 2 * (2 * 2 * 4 + 2 * 8)); /* 2 rows */
    check_qkv(c, 11, gs);
    check_qkv(x, 15, gs);
    kvt_cache_destroy(x);

    /* trims at every length, then appends */
    for (int64_t len = 0; len <= 11; len++) {
        assert_int_equal(kvt_cache_clone(c, &x), 0);
        assert_int_equal(kvt_cache_trim(x, len), 0);
        check_qkv(x, len, gs);
        c0 = kvt_buf_bytes_copied();
        assert_int_equal(qkv_append_tokens(x, len, 5, d, gs), 0);
        assert_int_equal(kvt_buf_bytes_copied() - c0, (uint64_t)(len % B) * 2 * (2 * 4 + 8));
        check_qkv(x, len + 5, gs);
        kvt_cache_destroy(x);
    }
    assert_int_equal(kvt_cache_trim(c, 12), KVT_ERANGE);
    check_qkv(c, 11, gs);
    kvt_cache_destroy(c);
}

static void test_qkv_encode_decode(void **state)
{
    (void)state;
    const int d = 8, gs = 2, B = 4;
    kvt_cache *c, *r;
    assert_int_equal(kvt_qkv_create(d, gs, B, &c), 0);
    assert_int_equal(qkv_append_tokens(c, 0, 10, d, gs), 0);
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    assert_string_equal(st.kind, "qkv");
    assert_int_equal(st.n_params, 3);
    assert_true(st.params[0] == d && st.params[1] == B && st.params[2] == gs);
    assert_int_equal(st.n_tensors, 6);
    for (int i = 0; i < 3; i++) {
        const kvt_tensor *q = &st.tensors[2 * i], *sc = &st.tensors[2 * i + 1];
        char name[16];
        int64_t rows = i < 2 ? 4 : 2;
        snprintf(name, sizeof name, "blk%d.q", i);
        assert_string_equal(q->name, name);
        snprintf(name, sizeof name, "blk%d.s", i);
        assert_string_equal(sc->name, name);
        assert_int_equal(q->dtype, KVT_DTYPE_I8);
        assert_int_equal(sc->dtype, KVT_DTYPE_F32);
        assert_true(q->shape[0] == 2 && q->shape[1] == rows && q->shape[2] == d);
        assert_true(sc->shape[0] == 2 && sc->shape[1] == rows && sc->shape[2] == d / gs);
        assert_int_equal(q->tok_begin, i < 2 ? i * B : -1);
        assert_int_equal(sc->tok_end, i < 2 ? i * B + B : -1);
        /* token 1, K, group 1: the code of its largest element is +-127 */
        const int8_t *codes = q->data;
        const float *scales = sc->data;
        if (i == 0) {
            float amax = fmaxf(fabsf(qval(0, 1, 2, gs)), fabsf(qval(0, 1, 3, gs)));
            assert_true(fabsf(scales[1 * (d / gs) + 1] - amax / 127.0f) <= 1e-7f);
            assert_true(abs(codes[1 * d + 2]) == 127 || abs(codes[1 * d + 3]) == 127);
        }
    }
    assert_int_equal(kvt_cache_decode(&st, &r), 0);
    assert_ptr_equal(kv_buf_of(r, 0), kv_buf_of(c, 0)); /* zero-copy */
    assert_ptr_equal(kv_buf_of(r, 1), kv_buf_of(c, 1));
    check_qkv(r, 10, gs);
    float k1[32], v1[32], k2[32], v2[32];
    for (int b = 0; b < 3; b++) {
        assert_int_equal(kvt_qkv_read_block(c, b, k1, v1, NULL), 0);
        assert_int_equal(kvt_qkv_read_block(r, b, k2, v2, NULL), 0);
        assert_memory_equal(k1, k2, sizeof(float) * (b < 2 ? 32 : 16));
        assert_memory_equal(v1, v2, sizeof(float) * (b < 2 ? 32 : 16));
    }
    kvt_cache_state_clear(&st);
    kvt_cache_destroy(r);

    /* rejects */
    for (int k = 0; k < 6; k++) {
        assert_int_equal(kvt_cache_encode(c, &st), 0);
        const char *msg = NULL;
        switch (k) {
        case 0: st.params[2] = 3; msg = "does not divide"; break;
        case 1: st.params[2] = 16; msg = "group_size = 16 is outside [1, 8]"; break;
        case 2: st.n_tensors = 5; msg = "5 tensors"; break;
        case 3: strcpy(st.tensors[3].name, "blk1.q"); msg = "expected \"blk1.s\""; break;
        case 4: ((float *)st.tensors[5].data)[0] = -1.0f; msg = "scale -1"; break; /* tail copy: ours */
        case 5: ((float *)st.tensors[5].data)[1] = NAN; msg = "must be finite"; break;
        }
        expect_decode_fail(&st, KVT_EFORMAT, msg, k);
        if (k == 2)
            st.n_tensors = 6;
        kvt_cache_state_clear(&st);
    }
    check_qkv(c, 10, gs);
    kvt_cache_destroy(c);
}

/* ---- attachments ------------------------------------------------------------------ */

static void test_attachment_blob(void **state)
{
    (void)state;
    char data[100];
    for (int i = 0; i < 100; i++)
        data[i] = (char)i;
    kvt_attachment *a = (kvt_attachment *)1, *b;
    assert_int_equal(kvt_attachment_blob(NULL, data, 100, &a), KVT_EINVAL);
    assert_null(a);
    assert_int_equal(kvt_attachment_blob("x", NULL, 5, &a), KVT_EINVAL);
    char longname[80];
    memset(longname, 'n', sizeof longname);
    longname[64] = '\0';
    assert_int_equal(kvt_attachment_blob(longname, data, 100, &a), KVT_EINVAL);
    /* the message says the limit the check applies (it said "63 bytes or
     * longer" while 63 bytes are accepted) */
    char said[96];
    snprintf(said, sizeof said, "name is %d bytes or longer; at most %d fit", KVT_TENSOR_NAME_MAX,
             KVT_TENSOR_NAME_MAX - 1);
    if (!strstr(kvt_last_error(), said))
        fail_msg("'%s' lacks '%s'", kvt_last_error(), said);
    longname[63] = '\0';
    assert_int_equal(kvt_attachment_blob(longname, data, 100, &a), 0);
    assert_string_equal(a->name, longname);
    kvt_attachment_destroy(a);

    assert_int_equal(kvt_attachment_blob("draft.hidden", data, 100, &a), 0);
    data[5] = 99; /* the blob holds a copy */
    size_t n = 0;
    const char *p = kvt_attachment_blob_data(a, &n);
    assert_int_equal(n, 100);
    assert_int_equal(p[5], 5);
    assert_string_equal(a->name, "draft.hidden");
    assert_string_equal(a->ops->kind, "blob");
    assert_true(kvt_attachment_bytes(a) >= 100 && kvt_attachment_bytes(a) < 100 + 256);
    assert_int_equal(kvt_attachment_clone(a, &b), 0);
    assert_ptr_equal(kvt_attachment_blob_data(b, NULL), p); /* shared, not copied */
    assert_string_equal(b->name, "draft.hidden");
    const void *sd;
    size_t sn;
    assert_int_equal(b->ops->serialize(b, &sd, &sn), 0);
    assert_ptr_equal(sd, p);
    assert_int_equal(sn, 100);
    kvt_attachment_destroy(a);
    assert_int_equal(((const char *)kvt_attachment_blob_data(b, NULL))[99], 99);
    kvt_attachment_destroy(b);
    kvt_attachment_destroy(NULL);
    assert_int_equal(kvt_attachment_bytes(NULL), 0);
    b = (kvt_attachment *)1;
    assert_int_equal(kvt_attachment_clone(NULL, &b), KVT_EINVAL);
    assert_null(b); /* *out is NULL on every error */
    assert_null(kvt_attachment_blob_data(NULL, NULL));
    n = 7;
    assert_null(kvt_attachment_blob_data(NULL, &n));
    assert_int_equal(n, 0); /* not left stale */

    assert_int_equal(kvt_attachment_blob("empty", NULL, 0, &a), 0);
    assert_non_null(kvt_attachment_blob_data(a, &n));
    assert_int_equal(n, 0);
    kvt_attachment_destroy(a);
}

/* ---- every kind: OOM atomicity, round trips --------------------------------------- */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* A fingerprint of everything a cache holds, through its encoded state. */
static uint64_t fingerprint(const kvt_cache *c)
{
    kvt_cache_state st;
    assert_int_equal(kvt_cache_encode(c, &st), 0);
    uint64_t h = fnv(14695981039346656037ull, st.kind, strlen(st.kind));
    h = fnv(h, &st.offset, sizeof st.offset);
    h = fnv(h, &st.min_offset, sizeof st.min_offset);
    h = fnv(h, st.params, sizeof st.params[0] * (size_t)st.n_params);
    for (int i = 0; i < st.n_tensors; i++) {
        h = fnv(h, st.tensors[i].name, strlen(st.tensors[i].name));
        h = fnv(h, st.tensors[i].shape, sizeof st.tensors[i].shape);
        h = fnv(h, st.tensors[i].data, st.tensors[i].bytes);
    }
    kvt_cache_state_clear(&st);
    return h;
}

static int append_any(kvt_cache *c, int64_t n)
{
    if (strcmp(kvt_cache_kind(c), "recurrent") == 0) {
        unsigned char s[24];
        memset(s, (int)(kvt_cache_offset(c) + n), sizeof s);
        const void *in[1] = {s};
        return kvt_cache_append(c, n, in);
    }
    return append_tokens(c, kvt_cache_offset(c), n, kvt_kv_dim(c));
}

static void make_all_kinds(kvt_cache *c[4])
{
    assert_int_equal(kvt_kv_create(4, 3, &c[0]), 0);
    assert_int_equal(kvt_rotating_create(4, 5, 1, &c[1]), 0);
    assert_int_equal(kvt_recurrent_create(24, &c[2]), 0);
    assert_int_equal(kvt_qkv_create(4, 2, 3, &c[3]), 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(append_any(c[i], 4), 0);
}

static void test_all_kinds_oom(void **state)
{
    (void)state;
    for (int kind = 0; kind < 4; kind++) {
        int done = 0;
        for (long fail_at = 0; !done && fail_at < 64; fail_at++) {
            kvt_cache *c[4], *x = NULL, *y = NULL;
            make_all_kinds(c);
            assert_int_equal(kvt_cache_clone(c[kind], &x), 0); /* everything shared */
            uint64_t before = fingerprint(x);
            size_t bytes = kvt_cache_bytes(x);
            alloc_budget = fail_at;
            int rc = append_any(x, 7);
            alloc_budget = -1;
            if (rc) {
                assert_int_equal(rc, KVT_ENOMEM);
                assert_true(fingerprint(x) == before);
                assert_int_equal(kvt_cache_offset(x), 4);
                assert_true(kvt_cache_bytes(x) >= bytes); /* the block table may have grown */
            } else {
                assert_int_equal(kvt_cache_offset(x), 11);
                done = 1;
            }
            assert_true(fingerprint(c[kind]) != 0);
            kvt_cache_state st;
            alloc_budget = fail_at;
            rc = kvt_cache_encode(x, &st);
            alloc_budget = -1;
            if (rc == 0) {
                alloc_budget = fail_at;
                rc = kvt_cache_decode(&st, &y);
                alloc_budget = -1;
                if (rc == 0)
                    assert_true(fingerprint(y) == fingerprint(x));
                else
                    assert_true(rc == KVT_ENOMEM && y == NULL);
                kvt_cache_state_clear(&st);
            } else {
                assert_int_equal(rc, KVT_ENOMEM);
            }
            kvt_cache_destroy(y);
            y = NULL;
            alloc_budget = fail_at;
            rc = kvt_cache_clone(x, &y);
            alloc_budget = -1;
            assert_true(rc == 0 || (rc == KVT_ENOMEM && y == NULL));
            kvt_cache_destroy(y);
            kvt_cache_destroy(x);
            kvt_caches_destroy(c, 4);
        }
        assert_true(done);
    }
    /* creation under failure */
    for (long fail_at = 0; fail_at < 3; fail_at++) {
        kvt_cache *c = NULL;
        kvt_attachment *a = NULL;
        alloc_budget = fail_at;
        int r1 = kvt_rotating_create(2, 4, 0, &c);
        kvt_cache_destroy(c);
        alloc_budget = fail_at;
        int r2 = kvt_recurrent_create(8, &c);
        kvt_cache_destroy(c);
        alloc_budget = fail_at;
        int r3 = kvt_attachment_blob("a", "xyz", 3, &a);
        kvt_attachment_destroy(a);
        alloc_budget = -1;
        assert_true(fail_at >= 2 ? r1 == 0 && r2 == 0 && r3 == 0 : r1 == KVT_ENOMEM && r2 == KVT_ENOMEM && r3 == KVT_ENOMEM);
    }
}

/* encode -> decode -> encode gives the same state, for every kind. */
static void test_all_kinds_round_trip(void **state)
{
    (void)state;
    kvt_cache *c[4];
    make_all_kinds(c);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(append_any(c[i], 3), 0); /* the rotating one wraps */
        kvt_cache_state st;
        kvt_cache *r;
        assert_int_equal(kvt_cache_encode(c[i], &st), 0);
        assert_int_equal(kvt_cache_decode(&st, &r), 0);
        kvt_cache_state_clear(&st);
        assert_string_equal(kvt_cache_kind(r), kvt_cache_kind(c[i]));
        int64_t l1, h1, l2, h2;
        kvt_cache_range(c[i], &l1, &h1);
        kvt_cache_range(r, &l2, &h2);
        assert_int_equal(l1, l2);
        assert_int_equal(h1, h2);
        assert_true(fingerprint(r) == fingerprint(c[i]));
        assert_int_equal(kvt_cache_bytes(r) - r->ops->private_bytes(r), kvt_cache_bytes(c[i]) - c[i]->ops->private_bytes(c[i]));
        /* both go on the same way */
        assert_int_equal(append_any(r, 2), 0);
        assert_int_equal(append_any(c[i], 2), 0);
        assert_true(fingerprint(r) == fingerprint(c[i]));
        kvt_cache_destroy(r);
    }
    kvt_caches_destroy(c, 4);
}

/* ---- registry ------------------------------------------------------------------ */

static size_t dummy_private(const kvt_cache *c) { (void)c; return 8; }
static void dummy_foreach(const kvt_cache *c, void (*fn)(kvt_buf *, void *), void *ctx) { (void)c; (void)fn; (void)ctx; }
static void dummy_range(const kvt_cache *c, int64_t *lo, int64_t *hi) { (void)c; *lo = *hi = 7; }
static int dummy_trim(kvt_cache *c, int64_t n) { (void)c; (void)n; return 0; }
static int dummy_clone(const kvt_cache *c, kvt_cache **out) { (void)c; (void)out; return KVT_EINVAL; }
static int dummy_append(kvt_cache *c, int64_t n, const void *const *in) { (void)c; (void)n; (void)in; return KVT_EINVAL; }
static void dummy_dispose(kvt_cache *c) { free(c); }
static int dummy_encode(const kvt_cache *c, kvt_cache_state *st) { (void)c; (void)st; return KVT_EINVAL; }
static int dummy_decode(const kvt_cache_state *st, kvt_cache **out);
static const kvt_cache_ops dummy_ops = {"test.dummy", dummy_private, dummy_foreach, dummy_range, dummy_trim,
                                        dummy_clone, dummy_append, dummy_dispose, dummy_encode, dummy_decode};
static int dummy_decode(const kvt_cache_state *st, kvt_cache **out)
{
    (void)st;
    kvt_cache *c = malloc(sizeof *c);
    c->ops = &dummy_ops;
    *out = c;
    return 0;
}

static void test_register_kind(void **state)
{
    (void)state;
    assert_int_equal(kvt_cache_register_kind(NULL), KVT_EINVAL);
    kvt_cache_ops bad = dummy_ops;
    bad.trim = NULL;
    assert_int_equal(kvt_cache_register_kind(&bad), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "trim"));
    bad = dummy_ops;
    bad.kind = "kv";
    assert_int_equal(kvt_cache_register_kind(&bad), KVT_EBUSY);
    bad.kind = "";
    assert_int_equal(kvt_cache_register_kind(&bad), KVT_EINVAL);
    bad.kind = "a-kind-name-that-is-longer-than-31-bytes";
    assert_int_equal(kvt_cache_register_kind(&bad), KVT_EINVAL);

    kvt_cache_state st;
    memset(&st, 0, sizeof st);
    strcpy(st.kind, "test.dummy");
    kvt_cache *c = NULL;
    assert_int_equal(kvt_cache_decode(&st, &c), KVT_EUNSUPPORTED);
    assert_int_equal(kvt_cache_register_kind(&dummy_ops), 0);
    assert_int_equal(kvt_cache_register_kind(&dummy_ops), KVT_EBUSY);
    assert_int_equal(kvt_cache_decode(&st, &c), 0);
    assert_string_equal(kvt_cache_kind(c), "test.dummy");
    assert_int_equal(kvt_cache_offset(c), 7);
    assert_int_equal(kvt_cache_bytes(c), 8);
    kvt_cache_destroy(c);

    /* the table is bounded */
    static kvt_cache_ops many[40];
    static char names[40][32];
    int rc = 0, i;
    for (i = 0; i < 40 && rc == 0; i++) {
        many[i] = dummy_ops;
        snprintf(names[i], sizeof names[i], "test.k%d", i);
        many[i].kind = names[i];
        rc = kvt_cache_register_kind(&many[i]);
    }
    assert_int_equal(rc, KVT_ENOMEM);
    assert_true(i > 20);
}

/* ---- threads: two clones of one cache used by two threads --------------------- */

struct thr {
    kvt_cache *c;
    int64_t base;
    int rc;
};

static void *thr_main(void *arg)
{
    struct thr *t = arg;
    const int d = 2;
    for (int round = 0; round < 50 && t->rc == 0; round++) {
        t->rc = append_tokens(t->c, t->base, 3, d);
        if (t->rc == 0)
            t->rc = kvt_cache_trim(t->c, t->base);
        kvt_cache *x;
        if (t->rc == 0 && (t->rc = kvt_cache_clone(t->c, &x)) == 0) {
            t->rc = append_tokens(x, t->base, 5, d);
            kvt_cache_destroy(x);
        }
    }
    if (t->rc == 0)
        t->rc = append_tokens(t->c, t->base, 7, d);
    return NULL;
}

static void test_kv_two_threads(void **state)
{
    (void)state;
    kvt_cache *src;
    assert_int_equal(kvt_kv_create(2, 4, &src), 0);
    assert_int_equal(append_tokens(src, 0, 10, 2), 0);
    struct thr t[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        t[i].base = 10;
        t[i].rc = 0;
        assert_int_equal(kvt_cache_clone(src, &t[i].c), 0);
    }
    kvt_cache_destroy(src);
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&th[i], NULL, thr_main, &t[i]), 0);
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(t[i].rc, 0);
        check_kv(t[i].c, 17);
        kvt_cache_destroy(t[i].c);
    }
}

struct thr_all {
    kvt_cache *c[4];
    int rc;
};

static void *thr_all_main(void *arg)
{
    struct thr_all *t = arg;
    for (int round = 0; round < 30 && t->rc == 0; round++)
        for (int i = 0; i < 4 && t->rc == 0; i++) {
            int64_t off = kvt_cache_offset(t->c[i]);
            kvt_cache *x = NULL, *y = NULL;
            kvt_cache_state st;
            if ((t->rc = kvt_cache_clone(t->c[i], &x)) || (t->rc = append_any(x, 2)) ||
                (t->rc = kvt_cache_encode(x, &st)))
                goto next;
            t->rc = kvt_cache_decode(&st, &y);
            kvt_cache_state_clear(&st);
            if (t->rc || (t->rc = append_any(y, 1)))
                goto next;
            if ((t->rc = append_any(t->c[i], 3)))
                goto next;
            if (kvt_cache_can_trim(t->c[i], off + 1))
                t->rc = kvt_cache_trim(t->c[i], off + 1);
        next:
            kvt_cache_destroy(x);
            kvt_cache_destroy(y);
        }
    return NULL;
}

/* Two threads work on two clones of the same caches of every kind at once
 * (run under TSan: shared buffers, copy-on-write, atomic refcounts). */
static void test_all_kinds_two_threads(void **state)
{
    (void)state;
    kvt_cache *src[4];
    make_all_kinds(src);
    struct thr_all t[2];
    pthread_t th[2];
    for (int k = 0; k < 2; k++) {
        t[k].rc = 0;
        assert_int_equal(kvt_caches_clone(src, 4, t[k].c), 0);
    }
    for (int k = 0; k < 2; k++)
        assert_int_equal(pthread_create(&th[k], NULL, thr_all_main, &t[k]), 0);
    for (int k = 0; k < 2; k++) {
        pthread_join(th[k], NULL);
        assert_int_equal(t[k].rc, 0);
    }
    for (int i = 0; i < 4; i++) {
        assert_true(fingerprint(t[0].c[i]) == fingerprint(t[1].c[i]));
        assert_int_equal(kvt_cache_offset(src[i]), 4);
    }
    assert_true(kvt_cache_offset(t[0].c[0]) == 4 + 30);
    kvt_caches_destroy(t[0].c, 4);
    kvt_caches_destroy(t[1].c, 4);
    kvt_caches_destroy(src, 4);
}

/* ---- randomized differential test against a flat oracle ------------------------- */

static uint64_t rng_state;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

enum { RK_KV, RK_ROT, RK_QKV };
#define RK_D 4
#define RK_GS 2
#define RK_W 9
#define RK_KEEP 2

static void rk_check(int kind, const kvt_cache *c, int64_t n)
{
    if (kind == RK_KV)
        check_kv(c, n);
    else if (kind == RK_ROT)
        check_ring(c, n, RK_W, RK_KEEP, RK_D);
    else
        check_qkv(c, n, RK_GS);
}

/* Random appends, trims (anywhere in the reachable range), clones, encode ->
 * decode restores and disposals on a family of caches sharing buffers; after
 * every step every cache is checked against the oracle (token values are a
 * function of position, so the expected contents follow from the length). */
static void random_family(int kind, uint64_t seed)
{
    rng_state = seed * 2654435761u + 1 + (uint64_t)kind;
    enum { N = 6 };
    kvt_cache *c[N] = {0};
    int64_t len[N] = {0};
    if (kind == RK_KV)
        assert_int_equal(kvt_kv_create(RK_D, 5, &c[0]), 0);
    else if (kind == RK_ROT)
        assert_int_equal(kvt_rotating_create(RK_D, RK_W, RK_KEEP, &c[0]), 0);
    else
        assert_int_equal(kvt_qkv_create(RK_D, RK_GS, 5, &c[0]), 0);
    for (int step = 0; step < 1500; step++) {
        int i = (int)(rnd() % N);
        if (!c[i])
            continue;
        int op = (int)(rnd() % 5);
        if (op == 0) {
            int64_t n = 1 + (int64_t)(rnd() % 12);
            int rc = kind == RK_QKV ? qkv_append_tokens(c[i], len[i], n, RK_D, RK_GS)
                                    : append_tokens(c[i], len[i], n, RK_D);
            assert_int_equal(rc, 0);
            len[i] += n;
        } else if (op == 1) {
            int64_t lo, hi;
            kvt_cache_range(c[i], &lo, &hi);
            assert_int_equal(hi, len[i]);
            int64_t l = lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
            assert_int_equal(kvt_cache_trim(c[i], l), 0);
            if (lo > 0)
                assert_int_equal(kvt_cache_trim(c[i], lo - 1), KVT_ERANGE);
            len[i] = l;
        } else if (op == 2 || op == 3) {
            int j = (int)(rnd() % N);
            if (j != i) {
                kvt_cache_destroy(c[j]);
                if (op == 2) {
                    assert_int_equal(kvt_cache_clone(c[i], &c[j]), 0);
                } else {
                    kvt_cache_state st;
                    assert_int_equal(kvt_cache_encode(c[i], &st), 0);
                    assert_int_equal(kvt_cache_decode(&st, &c[j]), 0);
                    kvt_cache_state_clear(&st);
                }
                len[j] = len[i];
            }
        } else if (i != 0) {
            kvt_cache_destroy(c[i]);
            c[i] = NULL;
        }
        for (int j = 0; j < N; j++)
            if (c[j])
                rk_check(kind, c[j], len[j]);
        if (len[i] > 150 && kvt_cache_can_trim(c[i], 0)) {
            assert_int_equal(kvt_cache_trim(c[i], 0), 0);
            len[i] = 0;
        } else if (len[i] > 150) {
            kvt_cache_destroy(c[i]);
            c[i] = NULL;
            if (i == 0)
                assert_int_equal(kvt_rotating_create(RK_D, RK_W, RK_KEEP, &c[0]), 0);
            len[i] = 0;
        }
    }
    kvt_caches_destroy(c, N);
}

static void test_random_families(void **state)
{
    (void)state;
    uint64_t seed = test_seed("test_random_families");
    random_family(RK_KV, seed);
    random_family(RK_ROT, seed);
    random_family(RK_QKV, seed);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_kv_create_args),
        cmocka_unit_test(test_kv_append_read),
        cmocka_unit_test(test_kv_clone_cow),
        cmocka_unit_test(test_kv_trim_every_length),
        cmocka_unit_test(test_kv_encode_decode),
        cmocka_unit_test(test_kv_decode_copies_borrowed),
        cmocka_unit_test(test_kv_decode_rejects),
        cmocka_unit_test_setup_teardown(test_kv_oom, setup_alloc, teardown_alloc),
        cmocka_unit_test_setup_teardown(test_caches_clone, setup_alloc, teardown_alloc),
        cmocka_unit_test(test_rotating),
        cmocka_unit_test(test_rotating_encode_decode),
        cmocka_unit_test(test_recurrent),
        cmocka_unit_test(test_recurrent_encode_decode),
        cmocka_unit_test(test_qkv),
        cmocka_unit_test(test_qkv_encode_decode),
        cmocka_unit_test(test_attachment_blob),
        cmocka_unit_test_setup_teardown(test_all_kinds_oom, setup_alloc, teardown_alloc),
        cmocka_unit_test(test_all_kinds_round_trip),
        cmocka_unit_test(test_register_kind),
        cmocka_unit_test(test_kv_two_threads),
        cmocka_unit_test(test_all_kinds_two_threads),
        cmocka_unit_test(test_random_families),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
