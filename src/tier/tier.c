/*
 * tier.c: the helpers of tier.h: running release hooks and building,
 * releasing and classifying kvtier-allocated entries (kvt_entry). Owns no state; never
 * does I/O and never touches a cold tier.
 */
#include "kvtier/tier.h"

#include "internal.h"
#include "tier_internal.h"

#include <stdatomic.h>
#include <string.h>

KVT_API void kvt_hook_run(kvt_hook *h)
{
    if (!h || !h->fn)
        return;
    kvt_hook copy = *h;
    h->fn = NULL;
    h->ctx = NULL;
    copy.fn(copy.ctx);
}

/* One refcount for every share of a hook (kvt__hook_share). */
typedef struct hook_share {
    atomic_int_fast64_t refs;
    kvt_hook inner;
} hook_share;

static void hook_share_run(void *ctx)
{
    hook_share *s = ctx;
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        kvt_hook_run(&s->inner);
        kvt__free(s);
    }
}

int kvt__hook_share(kvt_hook *h, kvt_hook *copy)
{
    *copy = (kvt_hook){NULL, NULL};
    if (!h->fn)
        return 0;
    hook_share *s;
    if (h->fn == hook_share_run) {
        s = h->ctx;
    } else {
        if (!(s = kvt__malloc(sizeof *s)))
            return kvt__fail(KVT_ENOMEM, "sharing a release hook: out of memory");
        atomic_init(&s->refs, 1);
        s->inner = *h;
        *h = (kvt_hook){hook_share_run, s};
    }
    atomic_fetch_add(&s->refs, 1);
    *copy = (kvt_hook){hook_share_run, s};
    return 0;
}

KVT_API int kvt_entry_init(kvt_entry *e, const char *ns, const int32_t *tokens, int64_t n_tokens,
                           int32_t n_caches, int32_t n_attachments)
{
    if (!e)
        return kvt__fail(KVT_EINVAL, "kvt_entry_init: entry is NULL");
    memset(e, 0, sizeof *e);
    ns = kvt__ns(ns);
    if (n_tokens < 0 || n_caches < 0 || n_attachments < 0)
        return kvt__fail(KVT_EINVAL, "kvt_entry_init: negative count (tokens %lld, caches %d, attachments %d)",
                         (long long)n_tokens, (int)n_caches, (int)n_attachments);
    if (!tokens && n_tokens > 0)
        return kvt__fail(KVT_EINVAL, "kvt_entry_init: tokens NULL with n_tokens %lld", (long long)n_tokens);
    if ((uint64_t)n_tokens > SIZE_MAX / sizeof(int32_t))
        return kvt__fail(KVT_EINVAL, "kvt_entry_init: %lld tokens is too many", (long long)n_tokens);
    char *ns_copy = kvt__strdup(ns);
    int32_t *tok = kvt__malloc((size_t)n_tokens * sizeof *tok);
    kvt_cache **caches = kvt__calloc((size_t)n_caches, sizeof *caches);
    kvt_attachment **att = kvt__calloc((size_t)n_attachments, sizeof *att);
    if (!ns_copy || !tok || !caches || !att) {
        kvt__free(ns_copy);
        kvt__free(tok);
        kvt__free(caches);
        kvt__free(att);
        return kvt__fail(KVT_ENOMEM, "kvt_entry_init: out of memory for %lld tokens", (long long)n_tokens);
    }
    if (n_tokens)
        memcpy(tok, tokens, (size_t)n_tokens * sizeof *tok);
    e->ns = ns_copy;
    e->tokens = tok;
    e->n_tokens = n_tokens;
    e->caches = caches;
    e->n_caches = n_caches;
    e->attachments = att;
    e->n_attachments = n_attachments;
    return 0;
}

KVT_API void kvt_entry_clear(kvt_entry *e)
{
    if (!e)
        return;
    for (int32_t i = 0; e->caches && i < e->n_caches; i++)
        kvt_cache_destroy(e->caches[i]);
    for (int32_t i = 0; e->attachments && i < e->n_attachments; i++)
        kvt_attachment_destroy(e->attachments[i]);
    kvt_hook_run(&e->hook); /* after every view of the memory it releases */
    kvt__free((void *)e->ns);
    kvt__free((void *)e->tokens);
    kvt__free(e->caches);
    kvt__free(e->attachments);
    memset(e, 0, sizeof *e);
}

KVT_API int kvt_entry_trimmable(const kvt_entry *e, int64_t *min_reach)
{
    int64_t reach = 0;
    int trimmable = e->n_attachments == 0;
    for (int32_t i = 0; i < e->n_caches; i++) {
        int64_t lo = 0, off = 0;
        kvt_cache_range(e->caches[i], &lo, &off);
        if (lo > reach)
            reach = lo;
        if (lo >= off && off > 0 && kvt_cache_trim_granule(e->caches[i]) == 0)
            trimmable = 0;
    }
    if (min_reach)
        *min_reach = reach;
    return trimmable;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

KVT_API int64_t kvt_entry_trim_granule(const kvt_entry *e)
{
    if (!e || e->n_attachments > 0)
        return 0;
    int64_t g = 0;
    for (int32_t i = 0; i < e->n_caches; i++) {
        int64_t lo = 0;
        kvt_cache_range(e->caches[i], &lo, NULL);
        if (lo == 0)
            continue; /* cut anywhere */
        int64_t cg = kvt_cache_trim_granule(e->caches[i]);
        if (cg <= 0)
            return 0;
        g = g ? g / gcd64(g, cg) * cg : cg;
    }
    return g;
}
