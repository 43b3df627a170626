/*
 * replay.c: serving traces: loading Mooncake JSON lines (jansson), the token
 * synthesis that turns hash ids into prompts, and the block-level simulator
 * (reference LRU, Belady's optimum, the kvt_block_policy policies) used to
 * cross-check the prompt-cache replay and to bound it. It reads a trace and
 * counts; it must never touch a prompt cache or allocate kv bytes.
 */
#include "replay.h"

#include "kvtier/experimental/retention_block.h"

#include "util.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

/* ---- loading --------------------------------------------------------------- */

static int grow(void **p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    int64_t c = *cap ? *cap : 1024;
    while (c < need)
        c *= 2;
    void *q = kvt__realloc(*p, (size_t)c * elem);
    if (!q)
        return kvt__fail(KVT_ENOMEM, "trace: no memory for %lld items", (long long)c);
    *p = q;
    *cap = c;
    return 0;
}

static int parse_line(kvt_trace *t, int64_t *ids_cap, const char *path, int64_t lineno,
                      const char *line, kvt_trace_request *r)
{
    json_error_t jerr;
    json_t *o = json_loads(line, 0, &jerr);
    int rc = 0;
    if (!o || !json_is_object(o)) {
        rc = kvt__fail(KVT_EFORMAT, "%s:%lld: not a JSON object (%s)", path, (long long)lineno,
                       o ? "other JSON value" : jerr.text);
        goto out;
    }
    json_t *ts = json_object_get(o, "timestamp"), *in = json_object_get(o, "input_length");
    json_t *outl = json_object_get(o, "output_length"), *ids = json_object_get(o, "hash_ids");
    if (!json_is_integer(ts) || !json_is_integer(in) || !json_is_array(ids)) {
        rc = kvt__fail(KVT_EFORMAT, "%s:%lld: needs integer timestamp, integer input_length and "
                                    "array hash_ids", path, (long long)lineno);
        goto out;
    }
    json_int_t inlen = json_integer_value(in);
    json_int_t outlen = json_is_integer(outl) ? json_integer_value(outl) : 0;
    size_t n = json_array_size(ids);
    if (inlen < 1 || inlen > INT32_MAX / 2 || outlen < 0 || outlen > INT32_MAX) {
        rc = kvt__fail(KVT_EFORMAT, "%s:%lld: input_length %lld / output_length %lld out of range",
                       path, (long long)lineno, (long long)inlen, (long long)outlen);
        goto out;
    }
    if ((json_int_t)n != (inlen + KVT_TRACE_BLOCK_TOKENS - 1) / KVT_TRACE_BLOCK_TOKENS) {
        rc = kvt__fail(KVT_EFORMAT, "%s:%lld: %zu hash_ids for input_length %lld (need %lld)", path,
                       (long long)lineno, n, (long long)inlen,
                       (long long)((inlen + KVT_TRACE_BLOCK_TOKENS - 1) / KVT_TRACE_BLOCK_TOKENS));
        goto out;
    }
    if ((rc = grow((void **)&t->ids, ids_cap, t->n_ids + (int64_t)n, sizeof *t->ids)))
        goto out;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) >= ((json_int_t)1 << 40)) {
            rc = kvt__fail(KVT_EFORMAT, "%s:%lld: hash_ids[%zu] is not an integer in [0, 2^40)",
                           path, (long long)lineno, i);
            goto out;
        }
        t->ids[t->n_ids + (int64_t)i] = (int64_t)json_integer_value(v);
        t->max_id = KVT__MAX(t->max_id, t->ids[t->n_ids + (int64_t)i]);
    }
    *r = (kvt_trace_request){.timestamp_ms = (int64_t)json_integer_value(ts),
                             .input_length = (int32_t)inlen,
                             .output_length = (int32_t)outlen,
                             .n_blocks = (int32_t)n,
                             .first = t->n_ids};
    t->n_ids += (int64_t)n;
out:
    json_decref(o);
    return rc;
}

KVT_API int kvt_trace_load(const char *path, int64_t max_requests, kvt_trace **out)
{
    if (!path || !out)
        return kvt__fail(KVT_EINVAL, "trace load: NULL path or out");
    *out = NULL;
    FILE *f = fopen(path, "r");
    if (!f)
        return kvt__fail(-errno, "%s: cannot open: %s", path, strerror(errno));
    int rc = 0;
    char *line = NULL;
    size_t line_cap = 0;
    int64_t req_cap = 0, ids_cap = 0, lineno = 0;
    kvt_trace *t = kvt__calloc(1, sizeof *t);
    if (!t) {
        rc = kvt__fail(KVT_ENOMEM, "trace: no memory");
        goto fail;
    }
    ssize_t len;
    while ((max_requests <= 0 || t->n_requests < max_requests) &&
           (len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        if (strspn(line, " \t\r\n") == (size_t)len)
            continue; /* blank line */
        if ((rc = grow((void **)&t->requests, &req_cap, t->n_requests + 1, sizeof *t->requests)))
            goto fail;
        if ((rc = parse_line(t, &ids_cap, path, lineno, line, &t->requests[t->n_requests])))
            goto fail;
        t->n_requests++;
    }
    if (ferror(f)) {
        rc = kvt__fail(-EIO, "%s: read error after line %lld", path, (long long)lineno);
        goto fail;
    }
    if (t->n_requests == 0) {
        rc = kvt__fail(KVT_EFORMAT, "%s: no requests (the trace is empty)", path);
        goto fail;
    }
    free(line); /* getline allocates with malloc */
    fclose(f);
    *out = t;
    return 0;
fail:
    free(line);
    fclose(f);
    kvt_trace_destroy(t);
    return rc;
}

KVT_API void kvt_trace_destroy(kvt_trace *t)
{
    if (!t)
        return;
    kvt__free(t->requests);
    kvt__free(t->ids);
    kvt__free(t);
}

/* ---- token synthesis ---------------------------------------------------------- */

KVT_API void kvt_trace_block_tokens(int64_t id, int32_t *out)
{
    uint64_t s = (uint64_t)id * 0x9e3779b97f4a7c15ULL + 0x2545f4914f6cdd1dULL;
    out[0] = (int32_t)((uint64_t)id & 0x7fffffff);
    for (int i = 1; i < KVT_TRACE_BLOCK_TOKENS; i++) {
        uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        z ^= z >> 31;
        out[i] = (int32_t)(z & 0x7fffffff);
    }
}

KVT_API int kvt_trace_prompt(const kvt_trace *t, const kvt_trace_request *r, int32_t *out)
{
    if (!t || !r || !out)
        return kvt__fail(KVT_EINVAL, "trace prompt: NULL argument");
    if (r->n_blocks < 1 || r->first < 0 || r->first > t->n_ids - r->n_blocks || r->input_length < 1 ||
        r->input_length > (int64_t)r->n_blocks * KVT_TRACE_BLOCK_TOKENS ||
        r->input_length <= (int64_t)(r->n_blocks - 1) * KVT_TRACE_BLOCK_TOKENS)
        return kvt__fail(KVT_EINVAL, "trace prompt: request (first id %lld, %d ids, %d tokens) is not "
                                     "one of this trace's %lld ids", (long long)r->first, (int)r->n_blocks,
                         (int)r->input_length, (long long)t->n_ids);
    int32_t block[KVT_TRACE_BLOCK_TOKENS];
    for (int32_t b = 0; b < r->n_blocks; b++) {
        int64_t start = (int64_t)b * KVT_TRACE_BLOCK_TOKENS;
        int64_t n = KVT__MIN((int64_t)KVT_TRACE_BLOCK_TOKENS, r->input_length - start);
        kvt_trace_block_tokens(t->ids[r->first + b], block);
        memcpy(out + start, block, (size_t)n * sizeof *out);
    }
    return 0;
}

/* ---- simulator ---------------------------------------------------------------- */

static const char *const kvt__sim_names[] = {"lru-ref", "opt", "lru", "lfu-aged", "lfu-learned"};

KVT_API int kvt_replay_sim_policies(const char *const **names)
{
    if (names)
        *names = kvt__sim_names;
    return (int)(sizeof kvt__sim_names / sizeof kvt__sim_names[0]);
}

typedef struct sim {
    const kvt_trace *t;
    int64_t cap;
    uint8_t *resident; /* (max_id + 1) */
    int64_t count;
    kvt_replay_result *res;
} sim;

/* Counts the hits of request r against the resident set, before any update. */
static void count_hits(sim *s, const kvt_trace_request *r)
{
    int prefix = 1;
    for (int32_t b = 0; b < r->n_blocks; b++) {
        int hit = s->resident[s->t->ids[r->first + b]];
        s->res->block_hits += hit;
        prefix = prefix && hit;
        s->res->prefix_block_hits += prefix;
        int64_t lo = (int64_t)b * KVT_TRACE_BLOCK_TOKENS;
        int64_t hi = KVT__MIN(lo + KVT_TRACE_BLOCK_TOKENS, (int64_t)r->input_length - 1);
        if (prefix && hi > lo)
            s->res->token_hits += hi - lo;
    }
    s->res->blocks += r->n_blocks;
    s->res->tokens += r->input_length;
}

/* lru-ref: doubly linked list over ids, head = least recently used. */
static int sim_lru_ref(sim *s, kvt_replay_progress_fn progress, void *ctx)
{
    int64_t n = s->t->max_id + 1, head = -1, tail = -1;
    int64_t *prev = kvt__malloc((size_t)n * sizeof *prev), *next = kvt__malloc((size_t)n * sizeof *next);
    if (!prev || !next) {
        kvt__free(prev);
        kvt__free(next);
        return kvt__fail(KVT_ENOMEM, "replay: no memory for %lld ids", (long long)n);
    }
#define UNLINK(x)                                                                                  \
    do {                                                                                           \
        if (prev[x] >= 0) next[prev[x]] = next[x]; else head = next[x];                            \
        if (next[x] >= 0) prev[next[x]] = prev[x]; else tail = prev[x];                            \
    } while (0)
    int rc = 0;
    for (int64_t q = 0; q < s->t->n_requests; q++) {
        const kvt_trace_request *r = &s->t->requests[q];
        count_hits(s, r);
        for (int32_t b = 0; b < r->n_blocks; b++) {
            int64_t id = s->t->ids[r->first + b];
            if (s->resident[id])
                UNLINK(id);
            else {
                s->resident[id] = 1;
                s->count++;
            }
            prev[id] = tail;
            next[id] = -1;
            if (tail >= 0) next[tail] = id; else head = id;
            tail = id;
            while (s->count > s->cap) {
                int64_t v = head;
                UNLINK(v);
                s->resident[v] = 0;
                s->count--;
            }
            s->res->peak_blocks = KVT__MAX(s->res->peak_blocks, s->count);
        }
        s->res->requests = q + 1;
        if (progress && ((q + 1) % 256 == 0 || q + 1 == s->t->n_requests) &&
            progress(q + 1, s->t->n_requests, ctx))
            break;
    }
#undef UNLINK
    kvt__free(prev);
    kvt__free(next);
    return rc;
}

/* opt: Belady with bypass. Max-heap of (next use, id) with lazy deletion. */
typedef struct { int64_t next, id; } opt_item;

static void opt_push(opt_item *h, int64_t *n, opt_item it)
{
    int64_t i = (*n)++;
    while (i > 0 && h[(i - 1) / 2].next < it.next) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = it;
}

static opt_item opt_pop(opt_item *h, int64_t *n)
{
    opt_item top = h[0], last = h[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && h[c + 1].next > h[c].next)
            c++;
        if (h[c].next <= last.next)
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0)
        h[i] = last;
    return top;
}

static int sim_opt(sim *s, kvt_replay_progress_fn progress, void *ctx)
{
    const kvt_trace *t = s->t;
    int64_t n = t->max_id + 1, never = INT64_MAX;
    int64_t *nextuse = kvt__malloc((size_t)KVT__MAX(t->n_ids, 1) * sizeof *nextuse);
    int64_t *last = kvt__malloc((size_t)n * sizeof *last);     /* scratch, then next use of id */
    opt_item *heap = kvt__malloc((size_t)KVT__MAX(t->n_ids, 1) * sizeof *heap);
    int rc = 0;
    if (!nextuse || !last || !heap) {
        rc = kvt__fail(KVT_ENOMEM, "replay opt: no memory for %lld accesses", (long long)t->n_ids);
        goto out;
    }
    for (int64_t i = 0; i < n; i++)
        last[i] = never;
    for (int64_t i = t->n_ids - 1; i >= 0; i--) {
        nextuse[i] = last[t->ids[i]];
        last[t->ids[i]] = i;
    }
    /* from here on last[id] = next use of a resident id (the heap key). */
    int64_t nh = 0;
    for (int64_t q = 0; q < t->n_requests; q++) {
        const kvt_trace_request *r = &t->requests[q];
        count_hits(s, r);
        for (int32_t b = 0; b < r->n_blocks; b++) {
            int64_t pos = r->first + b, id = t->ids[pos];
            if (!s->resident[id] && s->count >= s->cap) {
                while (nh > 0 && (!s->resident[heap[0].id] || last[heap[0].id] != heap[0].next))
                    opt_pop(heap, &nh); /* stale */
                if (nh == 0 || heap[0].next <= nextuse[pos])
                    continue; /* bypass: used later than anything resident */
                opt_item v = opt_pop(heap, &nh);
                s->resident[v.id] = 0;
                s->count--;
            }
            if (!s->resident[id]) {
                s->resident[id] = 1;
                s->count++;
            }
            last[id] = nextuse[pos];
            opt_push(heap, &nh, (opt_item){nextuse[pos], id});
            s->res->peak_blocks = KVT__MAX(s->res->peak_blocks, s->count);
        }
        s->res->requests = q + 1;
        if (progress && ((q + 1) % 256 == 0 || q + 1 == t->n_requests) &&
            progress(q + 1, t->n_requests, ctx))
            break;
    }
out:
    kvt__free(nextuse);
    kvt__free(last);
    kvt__free(heap);
    return rc;
}

/* A kvt_block_policy driven the way the prompt cache drives it: one clock
 * value per request, parents named, the partial last block flagged. */
static int sim_policy(sim *s, const char *name, kvt_replay_progress_fn progress, void *ctx)
{
    kvt_block_policy *p = NULL;
    int rc = kvt_block_policy_create(name, s->cap, &p);
    if (rc)
        return rc;
    int64_t now = 0;
    for (int64_t q = 0; q < s->t->n_requests && rc == 0; q++) {
        const kvt_trace_request *r = &s->t->requests[q];
        count_hits(s, r);
        for (int32_t b = 0; b < r->n_blocks && rc == 0; b++) {
            int64_t id = s->t->ids[r->first + b];
            uint64_t parent = b ? (uint64_t)s->t->ids[r->first + b - 1] + 1 : 0;
            unsigned flags = (b == r->n_blocks - 1 && r->input_length % KVT_TRACE_BLOCK_TOKENS)
                                 ? KVT_BLOCK_TAIL : 0;
            if ((rc = kvt_block_policy_touch(p, (uint64_t)id + 1, parent, now, b, flags)))
                break;
            if (!s->resident[id]) {
                s->resident[id] = 1;
                s->count++;
            }
            while (s->count > s->cap) {
                uint64_t v;
                kvt_block_policy_victim(p, &v);
                kvt_block_policy_remove(p, v);
                s->resident[v - 1] = 0;
                s->count--;
            }
            s->res->peak_blocks = KVT__MAX(s->res->peak_blocks, s->count);
        }
        now += r->n_blocks;
        s->res->requests = q + 1;
        if (progress && ((q + 1) % 256 == 0 || q + 1 == s->t->n_requests) &&
            progress(q + 1, s->t->n_requests, ctx))
            break;
    }
    kvt_block_policy_destroy(p);
    return rc;
}

static int cmp_id(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The simulator only compares ids and keeps arrays indexed by id, so a sparse
 * trace (ids up to 2^40: a 1 TB table) runs on a copy with its ids renumbered
 * 0..k-1 in increasing order. d->ids is the caller's to free. */
static int dense_copy(const kvt_trace *t, kvt_trace *d)
{
    size_t n = (size_t)t->n_ids;
    int64_t *sorted = kvt__malloc((n ? n : 1) * sizeof *sorted);
    int64_t *ids = kvt__malloc((n ? n : 1) * sizeof *ids);
    if (!sorted || !ids) {
        kvt__free(sorted);
        kvt__free(ids);
        return kvt__fail(KVT_ENOMEM, "replay sim: no memory for %lld ids", (long long)n);
    }
    memcpy(sorted, t->ids, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, cmp_id);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (!k || sorted[k - 1] != sorted[i])
            sorted[k++] = sorted[i];
    for (size_t i = 0; i < n; i++)
        ids[i] = (int64_t *)bsearch(&t->ids[i], sorted, k, sizeof *sorted, cmp_id) - sorted;
    kvt__free(sorted);
    *d = *t;
    d->ids = ids;
    d->max_id = k ? (int64_t)k - 1 : 0;
    return 0;
}

KVT_API int kvt_replay_sim(const kvt_trace *t, const char *policy, int64_t capacity_blocks,
                           kvt_replay_progress_fn progress, void *ctx, kvt_replay_result *out)
{
    if (!t || !policy || !out)
        return kvt__fail(KVT_EINVAL, "replay sim: NULL argument");
    memset(out, 0, sizeof *out);
    if (capacity_blocks < 1)
        return kvt__fail(KVT_EINVAL, "replay sim: capacity %lld blocks, need >= 1",
                         (long long)capacity_blocks);
    const char *const *names;
    int n = kvt_replay_sim_policies(&names), which = -1;
    for (int i = 0; i < n; i++)
        if (!strcmp(policy, names[i]))
            which = i;
    if (which < 0)
        return kvt__fail(KVT_ENOTFOUND, "replay sim: unknown policy '%s' (known: lru-ref, opt, lru, "
                                        "lfu-aged, lfu-learned)", policy);
    kvt_trace dense = {0};
    if (t->max_id >= 4 * t->n_ids + 1024) { /* sparse ids (never the Mooncake traces) */
        int drc = dense_copy(t, &dense);
        if (drc)
            return drc;
        t = &dense;
    }
    sim s = {.t = t, .cap = capacity_blocks, .res = out};
    s.resident = kvt__calloc((size_t)t->max_id + 1, 1);
    if (!s.resident) {
        kvt__free(dense.ids);
        return kvt__fail(KVT_ENOMEM, "replay sim: no memory for %lld ids", (long long)t->max_id + 1);
    }
    uint64_t t0 = kvt_now_ns();
    int rc;
    if (which == 0)
        rc = sim_lru_ref(&s, progress, ctx);
    else if (which == 1)
        rc = sim_opt(&s, progress, ctx);
    else
        rc = sim_policy(&s, policy, progress, ctx);
    out->seconds = (double)(kvt_now_ns() - t0) / 1e9;
    kvt__free(s.resident);
    kvt__free(dense.ids);
    return rc;
}
