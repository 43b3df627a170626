/*
 * lookup.c: the remote tier's find and find_exact. One pipelined round trip
 * asks EXISTS for the prompt's block keys (and, when blocks alone do not
 * rebuild a prefix, the entries at block boundaries) and keeps the run from
 * the start; a second reads the children hash of the node reached for a
 * longer match inside the next block; a third confirms with EXISTS that the
 * record a child names is still there. All three share one deadline (the
 * lookup timeout). A lookup only records what it found under a handle: it
 * never reads a record's value.
 */
#include "remote_internal.h"

#include <hiredis.h>
#include <string.h>

static int64_t common(const int32_t *a, const int32_t *b, int64_t n)
{
    int64_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

typedef struct best {
    int64_t prefix;   /* usable tokens */
    kvt__rhandle h;
    int have;
} best;

static void best_set(best *b, int64_t prefix, kvt__rhandle *h)
{
    kvt__remote_hslot_clear(&b->h);
    b->h = *h;
    b->prefix = prefix;
    b->have = 1;
    memset(h, 0, sizeof *h);
}

#define KID_NODES 64 /* children hashes one lookup reads at most */

/* Weighs one children field (fk: 'b' or 'e' then the key; fv: flags, 3
 * zero bytes, tokens) of node j (keys[0..j), its first token at base)
 * against the prompt; when it would serve more than `beat` tokens, *kb
 * becomes it. @return 1 taken, 0 not, or KVT_ENOMEM (< 0). */
static int kid_candidate(const redisReply *fk, const redisReply *fv, const int32_t *prompt, int64_t n, const char *ns,
                         const kvt__key *keys, int64_t j, int64_t base, int32_t B, int known, int standalone,
                         int64_t beat, best *kb)
{
    kvt__key k;
    memcpy(&k.lo, fk->str + 1, 8);
    memcpy(&k.hi, fk->str + 9, 8);
    uint8_t flags = (uint8_t)fv->str[0];
    int64_t T = (int64_t)(fv->len - 4) / 4;
    int32_t *tt = kvt__malloc(sizeof *tt * (size_t)(T ? T : 1));
    if (!tt)
        return kvt__fail(KVT_ENOMEM, "remote find: out of memory");
    memcpy(tt, fv->str + 4, sizeof *tt * (size_t)T);
    int64_t avail = n - base, q = common(tt, prompt + base, KVT__MIN(T, avail)), cand = 0;
    kvt__rhandle h;
    int rc = 0;
    if (fk->str[0] == 'b' && standalone == 1 && (flags & KVT__REC_STANDALONE) && known && T == B && q > 0) {
        cand = KVT__MIN(base + q, n - 1);
        if (cand > beat) {
            kvt__key *k2 = kvt__malloc(sizeof *k2 * (size_t)(j + 1));
            if (!k2 || (rc = kvt__remote_hslot_make(&h, ns, prompt, base, tt, T, NULL, 0, 0, KVT__KEY_ZERO))) {
                kvt__free(k2);
                kvt__free(tt);
                return rc ? rc : kvt__fail(KVT_ENOMEM, "remote find: out of memory");
            }
            if (j)
                memcpy(k2, keys, sizeof *k2 * (size_t)j);
            k2[j] = k;
            kvt__free(h.keys);
            h.keys = k2;
            h.n_keys = (int32_t)j + 1;
            best_set(kb, cand, &h);
            rc = 1;
        }
    } else if (fk->str[0] == 'e') {
        if (q == T && base + T <= n - 1)
            cand = base + T;
        else if (flags & KVT__REC_TRIMMABLE)
            cand = KVT__MIN(base + q, n - 1);
        if (standalone == 2 && cand < base)
            cand = 0; /* sealed blocks: never cut below the node it hangs off */
        if (cand > beat && cand > 0) {
            if ((rc = kvt__remote_hslot_make(&h, ns, prompt, base, tt, T, keys, (int32_t)j, 1, k))) {
                kvt__free(tt);
                return rc;
            }
            best_set(kb, cand, &h);
            rc = 1;
        }
    }
    kvt__free(tt);
    return rc;
}

/* Runs p, every socket operation and the whole of it ending by deadline. */
static int exec_by(kvt_remote *r, kvt__rpipe *p, int64_t deadline)
{
    p->deadline_ms = deadline;
    return kvt__rconn_exec(r->conn, p, kvt__remote_left_ms(deadline));
}

static int do_find(kvt_remote *r, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out, int exact)
{
    memset(out, 0, sizeof *out);
    KVT__REMOTE_BUMP(r, lookups, 1);
    if (kvt__remote_all_down(r)) {
        KVT__REMOTE_BUMP(r, lookups_skipped, 1);
        return KVT_ENOTFOUND;
    }
    if (n < 0 || (n > 0 && !prompt))
        return kvt__fail(KVT_EINVAL, "remote find: bad prompt");
    const int64_t deadline = kvt__remote_now_ms() + r->lookup_ms;
    int32_t B = 0;
    int standalone = 0;
    int known = kvt__remote_layout_get(r, r->lookup_ms, &B, &standalone);
    int64_t nb = known ? n / B : 0;
    kvt__key *keys = kvt__malloc(sizeof *keys * (size_t)(nb ? nb : 1));
    char (*names)[KVT__REMOTE_KEY_MAX] = kvt__malloc(KVT__REMOTE_KEY_MAX * (size_t)(2 * nb + 2));
    size_t *lens = kvt__malloc(sizeof *lens * (size_t)(2 * nb + 2));
    char kns[KID_NODES][KVT__REMOTE_KEY_MAX]; /* round trip 2's node names */
    kvt__rpipe p = {0};
    best bst = {0}, kb = {0};
    int rc = 0;
    if (!keys || !names || !lens) {
        rc = kvt__fail(KVT_ENOMEM, "remote find: out of memory");
        goto out;
    }
    kvt__key parent = KVT__KEY_ZERO;
    for (int64_t j = 0; j < nb; j++)
        parent = keys[j] = kvt__block_key(r->seed, ns, parent, prompt + j * B, B);

    /* round trip 1: the prompt's blocks (and entries at block boundaries
     * when blocks alone do not rebuild a prefix); exact: the entry itself */
    int32_t ne = 0, i_exact = -1;
    for (int64_t j = 0; j < nb; j++) {
        lens[j] = kvt__remote_key_name(r, 'b', keys[j], names[j]);
        const char *av[2] = {"EXISTS", names[j]};
        size_t al[2] = {6, lens[j]};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
    }
    if (exact) {
        kvt__key ek = kvt__entry_key(r->seed, ns, prompt, n);
        lens[nb] = kvt__remote_key_name(r, 'e', ek, names[nb]);
        const char *av[2] = {"EXISTS", names[nb]};
        size_t al[2] = {6, lens[nb]};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
        i_exact = (int32_t)nb;
    } else if (known && !standalone) {
        for (int64_t j = 1; j <= nb && j * B <= n - 1; j++, ne++) {
            kvt__key ek = kvt__entry_key(r->seed, ns, prompt, j * B);
            lens[nb + j] = kvt__remote_key_name(r, 'e', ek, names[nb + j]);
            const char *av[2] = {"EXISTS", names[nb + j]};
            size_t al[2] = {6, lens[nb + j]};
            if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
                goto out;
        }
    }
    int64_t run = 0;
    int failed = 0;
    if (p.n) {
        exec_by(r, &p, deadline); /* a missing reply counts as absent */
        failed = p.fail != KVT__RF_NONE;
        while (run < nb && p.cmds[run].reply && ((redisReply *)p.cmds[run].reply)->type == REDIS_REPLY_INTEGER &&
               ((redisReply *)p.cmds[run].reply)->integer == 1)
            run++;
    }
    kvt__rhandle h;
    if (exact) {
        redisReply *e = p.cmds[i_exact].reply;
        int have_e = e && e->type == REDIS_REPLY_INTEGER && e->integer == 1;
        /* the entry names its chained blocks: at most its whole blocks, the
         * run of them found here (restore takes the ones it names) */
        if (have_e) {
            if ((rc = kvt__remote_hslot_make(&h, ns, prompt, n, NULL, 0, keys, (int32_t)run, 1,
                                             kvt__entry_key(r->seed, ns, prompt, n))))
                goto out;
            best_set(&bst, n, &h);
        } else if (known && standalone && n > 0 && n % B == 0 && run == nb) {
            if ((rc = kvt__remote_hslot_make(&h, ns, prompt, n, NULL, 0, keys, (int32_t)nb, 0, KVT__KEY_ZERO)))
                goto out;
            best_set(&bst, n, &h);
        }
        goto done;
    }
    /* standalone 2: blocks rebuild a prefix at block ends only (n - 1 is none) */
    int64_t use = standalone == 2 && run * B > n - 1 ? run - 1 : run;
    if (standalone && use > 0) {
        if ((rc = kvt__remote_hslot_make(&h, ns, prompt, use * B, NULL, 0, keys, (int32_t)use, 0, KVT__KEY_ZERO)))
            goto out;
        best_set(&bst, KVT__MIN(use * B, n - 1), &h);
    } else if (known && !standalone) {
        for (int64_t j = KVT__MIN(run, (int64_t)ne); j >= 1; j--) {
            redisReply *e = p.cmds[nb + j - 1].reply;
            if (e && e->type == REDIS_REPLY_INTEGER && e->integer == 1) {
                if ((rc = kvt__remote_hslot_make(&h, ns, prompt, j * B, NULL, 0, keys, (int32_t)j, 1,
                                                 kvt__entry_key(r->seed, ns, prompt, j * B))))
                    goto out;
                best_set(&bst, j * B, &h);
                break;
            }
        }
    }
    kvt__rpipe_clear(&p);

    /* round trip 2: the children of the node reached, for a longer match
     * inside the next block (a partial block, an entry's tail). When blocks
     * alone rebuild nothing (untrimmable state), an entry hanging off a
     * shallower node of the run is usable too (the prompt extends it), so
     * the children of the nodes from the best boundary entry down to the
     * deepest are read in the same round trip (at most KID_NODES of them). */
    int64_t j_hi = run, j_lo = use < run ? use : run; /* an entry off the node the blocks serve serves more */
    if (known && !standalone && !exact)
        j_lo = KVT__MAX(KVT__MAX(bst.have ? bst.prefix / B : 0, run - (KID_NODES - 1)), 0);
    char kb_field[17];
    int64_t kb_j = -1;
    if (j_lo * (known ? B : 0) < n - 1 && !failed && kvt__remote_now_ms() < deadline) {
        for (int64_t j = j_lo; j <= j_hi; j++) {
            char *kn = kns[j - j_lo];
            size_t kl = kvt__remote_key_name(r, 'k', kvt__remote_node_key(r, ns, keys, (int32_t)j), kn);
            const char *av[2] = {"HGETALL", kn};
            size_t al[2] = {7, kl};
            if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
                goto out;
        }
        exec_by(r, &p, deadline); /* a node without a reply has no children here */
        for (int64_t j = j_lo; j <= j_hi; j++) {
            redisReply *kids = p.cmds[j - j_lo].reply;
            int64_t base = j * (known ? B : 0);
            for (size_t f = 0; kids && kids->type == REDIS_REPLY_ARRAY && f + 1 < kids->elements; f += 2) {
                redisReply *fk = kids->element[f], *fv = kids->element[f + 1];
                if (fk->type != REDIS_REPLY_STRING || fk->len != 17 || fv->type != REDIS_REPLY_STRING ||
                    fv->len < 4 || (fv->len - 4) % 4)
                    continue;
                if ((rc = kid_candidate(fk, fv, prompt, n, ns, keys, j, base, B, known, standalone,
                                        KVT__MAX(bst.prefix, kb.prefix), &kb)) < 0)
                    goto out;
                if (rc) {
                    memcpy(kb_field, fk->str, 17);
                    kb_j = j;
                }
                rc = 0;
            }
        }
    }
    kvt__rpipe_clear(&p);
    /* round trip 3: the children hash is a hint; the record it names must
     * still be there (Redis may have evicted it), else the hint goes */
    if (kb.have && kvt__remote_now_ms() < deadline) {
        char vn[KVT__REMOTE_KEY_MAX];
        size_t vl = kb_field[0] == 'b' ? kvt__remote_key_name(r, 'b', kb.h.keys[kb.h.n_keys - 1], vn)
                                       : kvt__remote_key_name(r, 'e', kb.h.ekey, vn);
        const char *av[2] = {"EXISTS", vn};
        size_t al[2] = {6, vl};
        if ((rc = kvt__rpipe_add(&p, 1, 2, av, al)))
            goto out;
        redisReply *v = exec_by(r, &p, deadline) == 0 ? p.cmds[0].reply : NULL;
        if (v && v->type == REDIS_REPLY_INTEGER && v->integer == 1) {
            best_set(&bst, kb.prefix, &kb.h);
        } else if (v && v->type == REDIS_REPLY_INTEGER) {
            kvt__rpipe_clear(&p);
            char kn[KVT__REMOTE_KEY_MAX];
            size_t kl = kvt__remote_key_name(r, 'k', kvt__remote_node_key(r, ns, keys, (int32_t)kb_j), kn);
            const char *dv[3] = {"HDEL", kn, kb_field};
            size_t dl[3] = {4, kl, 17};
            if (kvt__rpipe_add(&p, 1, 3, dv, dl) == 0)
                kvt__rconn_exec(r->conn, &p, r->lookup_ms);
        }
    }
done:
    if (bst.have && bst.prefix > 0) {
        out->prefix_len = bst.prefix;
        out->n_tokens = bst.h.n_tokens;
        out->handle = kvt__remote_handle_put(r, &bst.h);
        pthread_mutex_lock(&r->mu);
        r->st.lookup_hits++;
        r->st.hit_tokens += (uint64_t)out->prefix_len;
        pthread_mutex_unlock(&r->mu);
    } else {
        rc = KVT_ENOTFOUND;
    }
out:
    kvt__rpipe_clear(&p);
    kvt__remote_hslot_clear(&bst.h);
    kvt__remote_hslot_clear(&kb.h);
    kvt__free(keys);
    kvt__free(names);
    kvt__free(lens);
    if (rc)
        memset(out, 0, sizeof *out);
    return rc;
}

int kvt__remote_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    if (n < 2)
        return (memset(out, 0, sizeof *out), KVT_ENOTFOUND);
    return do_find(self, prompt, n, ns, out, 0);
}

int kvt__remote_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    return do_find(self, tokens, n, ns, out, 1);
}
