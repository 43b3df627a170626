/*
 * codec.c: the entry <-> shard codec of codec.h: encodes an entry's layers
 * into content-addressed block shards and an entry shard (metadata and
 * tensors, or whole images), validates shard metadata, and builds an entry
 * back from validated shards. It owns only what it allocates for one call
 * or one encoding, does no I/O, and never uses a byte of a shard before the
 * header describing it has been validated.
 */
#include "codec.h"

#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- encoding ---------------------------------------------------------------- */

static int cmp_range(const void *a, const void *b)
{
    const kvt__enc_range *x = a, *y = b;
    if (x->b != y->b)
        return x->b < y->b ? -1 : 1;
    return (x->e > y->e) - (x->e < y->e);
}

static int find_range(const kvt__enc_range *r, int32_t n, int64_t b, int64_t e)
{
    for (int32_t i = 0; i < n; i++)
        if (r[i].b == b && r[i].e == e)
            return i;
    return -1;
}

void kvt__enc_clear(kvt__enc *enc)
{
    if (!enc)
        return;
    for (int32_t l = 0; enc->st && enc->e && l < enc->e->n_caches; l++)
        kvt_cache_state_clear(&enc->st[l]);
    kvt__free(enc->st);
    kvt__free(enc->rg);
    kvt__free(enc->keys);
    memset(enc, 0, sizeof *enc);
}

/* Encodes every layer; checks the layers and attachments. */
static int encode_layers(kvt__enc *enc, const kvt_entry *e)
{
    const int32_t L = e->n_caches, A = e->n_attachments;
    enc->min_reach = A ? e->n_tokens : 0;
    for (int32_t l = 0; l < L; l++) {
        kvt_cache_state *st = &enc->st[l];
        int rc = kvt_cache_encode(e->caches[l], st);
        if (rc)
            return rc;
        if (st->offset != e->n_tokens)
            return kvt__fail(KVT_EINVAL, "encode: layer %d holds %lld tokens, the entry %lld", (int)l,
                             (long long)st->offset, (long long)e->n_tokens);
        enc->min_reach = KVT__MAX(enc->min_reach, st->min_offset);
        enc->n_tensors += (size_t)st->n_tensors;
    }
    enc->granule = kvt_entry_trim_granule(e);
    for (int32_t a = 0; a < A; a++)
        if (!e->attachments[a] || !e->attachments[a]->ops->serialize)
            return kvt__fail(KVT_EUNSUPPORTED, "encode: attachment %d (%s) cannot be serialized", (int)a,
                             e->attachments[a] ? e->attachments[a]->name : "NULL");
    return 0;
}

/* The distinct token ranges of the layer tensors, sorted; those that chain
 * from token 0 become the blocks. */
static int collect_ranges(kvt__enc *enc)
{
    const kvt_entry *e = enc->e;
    enc->rg = kvt__calloc(enc->n_tensors ? enc->n_tensors : 1, sizeof *enc->rg);
    if (!enc->rg)
        return kvt__fail(KVT_ENOMEM, "encode: out of memory");
    for (int32_t l = 0; l < e->n_caches; l++)
        for (int32_t t = 0; t < enc->st[l].n_tensors; t++) {
            const kvt_tensor *x = &enc->st[l].tensors[t];
            enc->state_bytes += x->bytes;
            if (x->tok_begin < 0 || x->tok_end <= x->tok_begin || x->tok_end > e->n_tokens)
                continue;
            if (find_range(enc->rg, enc->n_rg, x->tok_begin, x->tok_end) < 0)
                enc->rg[enc->n_rg++] = (kvt__enc_range){x->tok_begin, x->tok_end, 0, -1};
        }
    qsort(enc->rg, (size_t)enc->n_rg, sizeof *enc->rg, cmp_range);
    int64_t at = 0;
    for (int32_t i = 0; i < enc->n_rg; i++)
        if (enc->rg[i].b == at) {
            enc->rg[i].chained = 1;
            enc->rg[i].idx = enc->n_chain++;
            at = enc->rg[i].e;
        }
    return 0;
}

int kvt__enc_entry(kvt__enc *enc, kvt__key seed, const kvt_entry *e)
{
    memset(enc, 0, sizeof *enc);
    enc->e = e;
    enc->st = kvt__calloc((size_t)(e->n_caches ? e->n_caches : 1), sizeof *enc->st);
    if (!enc->st)
        return kvt__fail(KVT_ENOMEM, "encode: out of memory");
    int rc = encode_layers(enc, e);
    if (!rc)
        rc = collect_ranges(enc);
    if (!rc && !(enc->keys = kvt__calloc((size_t)(enc->n_chain ? enc->n_chain : 1), sizeof *enc->keys)))
        rc = kvt__fail(KVT_ENOMEM, "encode: out of memory");
    if (rc) {
        kvt__enc_clear(enc);
        return rc;
    }
    kvt__key parent = KVT__KEY_ZERO;
    for (int32_t i = 0, c = 0; i < enc->n_rg; i++) {
        if (!enc->rg[i].chained)
            continue;
        enc->keys[c] = kvt__block_key(seed, e->ns, parent, e->tokens + enc->rg[i].b, enc->rg[i].e - enc->rg[i].b);
        parent = enc->keys[c++];
    }
    enc->key = kvt__entry_key(seed, e->ns, e->tokens, e->n_tokens);
    return 0;
}

size_t kvt__enc_max_tensors(const kvt__enc *enc) { return enc->n_tensors + (size_t)enc->e->n_attachments + 1; }

static json_t *meta_base(const char *type, const char *identity, const char *ns)
{
    return json_pack("{s:s, s:s, s:s}", "type", type, "identity", identity, "ns", ns);
}

static int set_i64(json_t *m, const char *k, int64_t v)
{
    char b[32];
    snprintf(b, sizeof b, "%lld", (long long)v);
    return json_object_set_new(m, k, json_string(b));
}

static int set_key(json_t *m, const char *k, kvt__key v)
{
    char h[33];
    kvt__key_hex(v, h);
    return json_object_set_new(m, k, json_string(h));
}

static int set_dumped(json_t *m, const char *k, const json_t *v)
{
    char *str = v ? json_dumps(v, JSON_COMPACT) : NULL;
    if (!str)
        return -1;
    int rc = json_object_set_new(m, k, json_string(str));
    free(str);
    return rc;
}

static void st_out_set(kvt__st_out *o, int32_t layer, const kvt_tensor *t)
{
    snprintf(o->name, sizeof o->name, "L%d.%s", (int)layer, t->name);
    o->dtype = t->dtype;
    o->ndim = t->ndim;
    memcpy(o->shape, t->shape, sizeof o->shape);
    o->data = t->data;
    o->bytes = t->bytes;
}

/* The range of chain block c. */
static const kvt__enc_range *chain_range(const kvt__enc *enc, int32_t c)
{
    for (int32_t i = 0; i < enc->n_rg; i++)
        if (enc->rg[i].chained && enc->rg[i].idx == c)
            return &enc->rg[i];
    return NULL;
}

int kvt__enc_block(const kvt__enc *enc, int32_t c, const char *identity, json_t **meta, kvt__st_out *outs,
                   int32_t *n)
{
    *meta = NULL;
    *n = 0;
    const kvt__enc_range *r = chain_range(enc, c);
    if (!r)
        return kvt__fail(KVT_EINVAL, "encode: no block %d in a chain of %d", (int)c, (int)enc->n_chain);
    int32_t k = 0;
    for (int32_t l = 0; l < enc->e->n_caches; l++)
        for (int32_t t = 0; t < enc->st[l].n_tensors; t++)
            if (enc->st[l].tensors[t].tok_begin == r->b && enc->st[l].tensors[t].tok_end == r->e)
                st_out_set(&outs[k++], l, &enc->st[l].tensors[t]);
    char *toks = kvt__tokens_b64(enc->e->tokens + r->b, r->e - r->b);
    json_t *m = meta_base("block", identity, enc->e->ns);
    if (!toks || !m || set_key(m, "key", enc->keys[c]) || set_key(m, "parent", c ? enc->keys[c - 1] : KVT__KEY_ZERO) ||
        set_i64(m, "tok_begin", r->b) || set_i64(m, "tok_end", r->e) ||
        json_object_set_new(m, "tokens", json_string(toks))) {
        kvt__free(toks);
        json_decref(m);
        return kvt__fail(KVT_ENOMEM, "encode: out of memory");
    }
    kvt__free(toks);
    *meta = m;
    *n = k;
    return 0;
}

/* The JSON description of layer l; its tensors outside the chain go to
 * outs (at *k). */
static json_t *layer_json(const kvt__enc *enc, int32_t l, kvt__st_out *outs, int32_t *k)
{
    const kvt_cache_state *st = &enc->st[l];
    json_t *params = json_array(), *tens = json_array();
    for (int32_t p = 0; p < st->n_params && p < KVT_CACHE_PARAMS_MAX; p++)
        json_array_append_new(params, json_integer(st->params[p]));
    for (int32_t t = 0; t < st->n_tensors; t++) {
        const kvt_tensor *x = &st->tensors[t];
        int r = x->tok_begin >= 0 ? find_range(enc->rg, enc->n_rg, x->tok_begin, x->tok_end) : -1;
        int bidx = r >= 0 && enc->rg[r].chained ? enc->rg[r].idx : -1;
        json_t *shape = json_array();
        for (int32_t d = 0; d < x->ndim; d++)
            json_array_append_new(shape, json_integer(x->shape[d]));
        json_array_append_new(tens, json_pack("{s:s, s:s, s:o, s:[I,I], s:i}", "name", x->name, "dtype",
                                              kvt_dtype_name(x->dtype), "shape", shape, "tok",
                                              (json_int_t)x->tok_begin, (json_int_t)x->tok_end, "block", bidx));
        if (bidx < 0)
            st_out_set(&outs[(*k)++], l, x);
    }
    return json_pack("{s:s, s:I, s:I, s:o, s:o}", "kind", st->kind, "offset", (json_int_t)st->offset, "min_offset",
                     (json_int_t)st->min_offset, "params", params, "tensors", tens);
}

int kvt__enc_entry_shard(const kvt__enc *enc, const char *identity, json_t **meta, kvt__st_out *outs, int32_t *n)
{
    const kvt_entry *e = enc->e;
    *meta = NULL;
    *n = 0;
    json_t *layers = json_array(), *blocks = json_array(), *atts = json_array();
    int32_t k = 0;
    int rc = 0;
    for (int32_t i = 0; i < enc->n_rg; i++)
        if (enc->rg[i].chained) {
            char h[33];
            kvt__key_hex(enc->keys[enc->rg[i].idx], h);
            json_array_append_new(blocks, json_pack("[s,I,I]", h, (json_int_t)enc->rg[i].b, (json_int_t)enc->rg[i].e));
        }
    for (int32_t l = 0; l < e->n_caches; l++)
        json_array_append_new(layers, layer_json(enc, l, outs, &k));
    for (int32_t a = 0; a < e->n_attachments; a++) {
        const void *data = NULL;
        size_t bytes = 0;
        const kvt_attachment *att = e->attachments[a];
        if ((rc = att->ops->serialize(att, &data, &bytes)))
            break;
        json_array_append_new(atts, json_pack("{s:s, s:s}", "name", att->name, "kind", att->ops->kind));
        kvt__st_out *o = &outs[k++];
        snprintf(o->name, sizeof o->name, "A%d", (int)a);
        o->dtype = KVT_DTYPE_U8;
        o->ndim = 1;
        o->shape[0] = (int64_t)bytes;
        o->data = data;
        o->bytes = bytes;
    }
    char *toks = kvt__tokens_b64(e->tokens, e->n_tokens);
    json_t *m = meta_base("entry", identity, e->ns);
    int bad_meta = rc || !toks || !m || !layers || !blocks || !atts || set_key(m, "key", enc->key) ||
                   set_i64(m, "n_tokens", e->n_tokens) || set_i64(m, "min_reach", enc->min_reach) ||
                   (enc->granule > 0 && set_i64(m, "granule", enc->granule)) ||
                   json_object_set_new(m, "tokens", json_string(toks)) || set_dumped(m, "layers", layers) ||
                   set_dumped(m, "blocks", blocks) || set_dumped(m, "attachments", atts);
    json_decref(layers);
    json_decref(blocks);
    json_decref(atts);
    kvt__free(toks);
    if (bad_meta) {
        json_decref(m);
        return rc ? rc : kvt__fail(KVT_ENOMEM, "encode: out of memory");
    }
    *meta = m;
    *n = k;
    return 0;
}

/* One shard of the encoding as an image. */
static int record(json_t *meta, const kvt__st_out *outs, int32_t n, kvt_buf **out)
{
    int rc = kvt__shard_image(meta, outs, n, out);
    json_decref(meta);
    return rc;
}

int kvt__enc_block_record(const kvt__enc *enc, int32_t c, const char *identity, kvt_buf **out)
{
    *out = NULL;
    kvt__st_out *outs = kvt__calloc(kvt__enc_max_tensors(enc), sizeof *outs);
    json_t *meta = NULL;
    int32_t n = 0;
    int rc = outs ? kvt__enc_block(enc, c, identity, &meta, outs, &n) : kvt__fail(KVT_ENOMEM, "encode: out of memory");
    if (!rc)
        rc = record(meta, outs, n, out);
    kvt__free(outs);
    return rc;
}

int kvt__enc_entry_record(const kvt__enc *enc, const char *identity, kvt_buf **out)
{
    *out = NULL;
    kvt__st_out *outs = kvt__calloc(kvt__enc_max_tensors(enc), sizeof *outs);
    json_t *meta = NULL;
    int32_t n = 0;
    int rc = outs ? kvt__enc_entry_shard(enc, identity, &meta, outs, &n) : kvt__fail(KVT_ENOMEM, "encode: out of memory");
    if (!rc)
        rc = record(meta, outs, n, out);
    kvt__free(outs);
    return rc;
}

/* ---- metadata ------------------------------------------------------------------ */

void kvt__pentry_free(kvt__pentry *p)
{
    kvt__free(p->tokens);
    kvt__free(p->blocks);
    kvt__free(p->ranges);
    json_decref(p->layers);
    json_decref(p->atts);
    memset(p, 0, sizeof *p);
}

static int parse_i64(const char *s, int64_t *out)
{
    if (!s || !*s)
        return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (*end || errno)
        return -1;
    *out = v;
    return 0;
}

/* A refusal: KVT_EIDENTITY for another identity's shard, else KVT_EFORMAT. */
static int bad(int *reason, int r, const char *path, const char *what)
{
    return kvt__shard_refuse(reason, r, r == KVT_STORE_REFUSED_IDENTITY ? KVT_EIDENTITY : KVT_EFORMAT, path, what);
}

/* Validates an entry shard's metadata. identity NULL: accept the shard's own. */
int kvt__codec_parse_entry(const kvt__shard *sh, const char *path, const char *identity, kvt__pentry *p,
                           int *reason)
{
    memset(p, 0, sizeof *p);
    const char *type = kvt__meta_str(sh, "type"), *id = kvt__meta_str(sh, "identity");
    if (!type || strcmp(type, "entry") || !id)
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "not an entry shard with an identity");
    if (identity && strcmp(id, identity))
        return bad(reason, KVT_STORE_REFUSED_IDENTITY, path, "written under another identity");
    p->ns = kvt__meta_str(sh, "ns");
    const char *toks = kvt__meta_str(sh, "tokens"), *key = kvt__meta_str(sh, "key");
    int64_t n_decl = -1;
    if (!p->ns || !toks || !key || parse_i64(kvt__meta_str(sh, "n_tokens"), &n_decl) ||
        parse_i64(kvt__meta_str(sh, "min_reach"), &p->min_reach))
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "missing ns, tokens, key, n_tokens or min_reach");
    int trc = kvt__tokens_unb64(toks, &p->tokens, &p->n_tokens);
    if (trc == KVT_ENOMEM) {
        kvt__pentry_free(p);
        return trc;
    }
    if (trc || p->n_tokens != n_decl) {
        kvt__pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "tokens do not decode to n_tokens ids");
    }
    kvt__key want = kvt__entry_key(kvt__key_seed(id), p->ns, p->tokens, p->n_tokens);
    if (kvt__key_parse(key, &p->key) || !kvt__key_eq(want, p->key)) {
        kvt__pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_TOKENS, path, "key does not match (identity, ns, tokens)");
    }
    if (p->min_reach < 0 || p->min_reach > p->n_tokens) {
        kvt__pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "min_reach outside [0, n_tokens]");
    }
    const char *gs = kvt__meta_str(sh, "granule");
    p->granule = 0;
    if (gs && (parse_i64(gs, &p->granule) || p->granule < 1 || p->granule > p->n_tokens)) {
        kvt__pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "granule is not in [1, n_tokens]");
    }
    const char *ls = kvt__meta_str(sh, "layers"), *bs = kvt__meta_str(sh, "blocks"),
               *as = kvt__meta_str(sh, "attachments");
    json_t *blocks = bs ? json_loads(bs, 0, NULL) : NULL;
    p->layers = ls ? json_loads(ls, 0, NULL) : NULL;
    p->atts = as ? json_loads(as, 0, NULL) : NULL;
    if (!json_is_array(p->layers) || !json_is_array(blocks) || !json_is_array(p->atts)) {
        json_decref(blocks);
        kvt__pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "layers, blocks or attachments is not a JSON array");
    }
    size_t nb = json_array_size(blocks);
    p->blocks = kvt__calloc(nb ? nb : 1, sizeof *p->blocks);
    p->ranges = kvt__calloc(nb ? nb : 1, sizeof *p->ranges);
    if (!p->blocks || !p->ranges) {
        json_decref(blocks);
        kvt__pentry_free(p);
        return kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
    }
    /* Each block: [key hex, tok_begin, tok_end]; the chain must start at 0,
     * be contiguous, and its keys must follow from the tokens. */
    kvt__key parent = KVT__KEY_ZERO, seed = kvt__key_seed(id);
    int64_t at = 0;
    const char *why = NULL;
    for (size_t i = 0; i < nb && !why; i++) {
        json_t *b = json_array_get(blocks, i);
        const char *kh = json_string_value(json_array_get(b, 0));
        json_t *jb = json_array_get(b, 1), *je = json_array_get(b, 2);
        if (!kh || !json_is_integer(jb) || !json_is_integer(je) || kvt__key_parse(kh, &p->blocks[i])) {
            why = "a block reference is not [key, begin, end]";
            break;
        }
        int64_t bb = json_integer_value(jb), be = json_integer_value(je);
        if (bb != at || be <= bb || be > p->n_tokens) {
            why = "block ranges are not a contiguous chain inside the tokens";
            break;
        }
        kvt__key k = kvt__block_key(seed, p->ns, parent, p->tokens + bb, be - bb);
        if (!kvt__key_eq(k, p->blocks[i])) {
            json_decref(blocks);
            kvt__pentry_free(p);
            return bad(reason, KVT_STORE_REFUSED_TOKENS, path, "a block key does not follow from the tokens");
        }
        p->ranges[i][0] = bb;
        p->ranges[i][1] = be;
        parent = k;
        at = be;
    }
    json_decref(blocks);
    if (why) {
        kvt__pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, why);
    }
    p->n_blocks = (int32_t)nb;
    return 0;
}

void kvt__pblock_free(kvt__pblock *p)
{
    kvt__free(p->tokens);
    memset(p, 0, sizeof *p);
}

int kvt__codec_parse_block(const kvt__shard *sh, const char *path, const char *identity, kvt__pblock *p,
                           int *reason)
{
    memset(p, 0, sizeof *p);
    const char *type = kvt__meta_str(sh, "type"), *id = kvt__meta_str(sh, "identity");
    if (!type || strcmp(type, "block") || !id)
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "not a block shard with an identity");
    if (identity && strcmp(id, identity))
        return bad(reason, KVT_STORE_REFUSED_IDENTITY, path, "written under another identity");
    p->ns = kvt__meta_str(sh, "ns");
    const char *k = kvt__meta_str(sh, "key"), *par = kvt__meta_str(sh, "parent"), *toks = kvt__meta_str(sh, "tokens");
    if (!p->ns || !k || !par || !toks || kvt__key_parse(k, &p->key) || kvt__key_parse(par, &p->parent) ||
        parse_i64(kvt__meta_str(sh, "tok_begin"), &p->tok_begin) ||
        parse_i64(kvt__meta_str(sh, "tok_end"), &p->tok_end))
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "missing ns, key, parent, tokens or range");
    int trc = kvt__tokens_unb64(toks, &p->tokens, &p->n_tokens);
    if (trc == KVT_ENOMEM)
        return trc;
    if (trc || p->tok_begin < 0 ||
        p->n_tokens != p->tok_end - p->tok_begin || p->n_tokens <= 0) {
        kvt__free(p->tokens);
        p->tokens = NULL;
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "tokens do not match the block range");
    }
    kvt__key want = kvt__block_key(kvt__key_seed(id), p->ns, p->parent, p->tokens, p->n_tokens);
    if (!kvt__key_eq(want, p->key)) {
        kvt__free(p->tokens);
        p->tokens = NULL;
        return bad(reason, KVT_STORE_REFUSED_TOKENS, path, "key does not follow from (parent, tokens)");
    }
    return 0;
}


/* ---- decoding ------------------------------------------------------------------ */

static const kvt__st_in *tensor_named(const kvt__shard *sh, const char *name)
{
    for (int32_t i = 0; i < sh->n; i++)
        if (!strcmp(sh->t[i].name, name))
            return &sh->t[i];
    return NULL;
}

static void release_parent(void *ctx, void *data, size_t bytes)
{
    (void)data;
    (void)bytes;
    kvt_buf_release(ctx);
}

/* Builds layer l's state from its JSON description and decodes it. */
static int build_layer(const json_t *lj, int32_t l, const kvt__rshard *ent, const kvt__rshard *blk, int32_t n_blk,
                       int64_t n_tokens, kvt_cache **out, const char *path, int *reason)
{
    kvt_cache_state cs;
    memset(&cs, 0, sizeof cs);
    const char *kind = json_string_value(json_object_get(lj, "kind"));
    json_t *params = json_object_get(lj, "params"), *tens = json_object_get(lj, "tensors");
    json_t *jo = json_object_get(lj, "offset"), *jm = json_object_get(lj, "min_offset");
    if (!kind || strlen(kind) >= sizeof cs.kind || !json_is_array(params) ||
        json_array_size(params) > KVT_CACHE_PARAMS_MAX || !json_is_array(tens) || !json_is_integer(jo) ||
        !json_is_integer(jm) || json_integer_value(jo) != n_tokens)
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "a layer description is malformed");
    snprintf(cs.kind, sizeof cs.kind, "%s", kind);
    cs.offset = json_integer_value(jo);
    cs.min_offset = json_integer_value(jm);
    cs.n_params = (int32_t)json_array_size(params);
    for (int32_t p = 0; p < cs.n_params; p++) {
        json_t *v = json_array_get(params, (size_t)p);
        if (!json_is_integer(v))
            return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "a layer parameter is not an integer");
        cs.params[p] = json_integer_value(v);
    }
    size_t nt = json_array_size(tens);
    cs.tensors = kvt__calloc(nt ? nt : 1, sizeof(kvt_tensor));
    if (!cs.tensors)
        return kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
    int rc = 0;
    for (size_t i = 0; i < nt; i++) {
        json_t *tj = json_array_get(tens, i);
        kvt_tensor *t = &cs.tensors[i];
        const char *name = json_string_value(json_object_get(tj, "name"));
        const char *dt = json_string_value(json_object_get(tj, "dtype"));
        json_t *shape = json_object_get(tj, "shape"), *tok = json_object_get(tj, "tok"), *jb = json_object_get(tj, "block");
        if (!name || strlen(name) >= KVT_TENSOR_NAME_MAX || !dt || kvt_dtype_parse(dt, &t->dtype) ||
            !json_is_array(shape) || json_array_size(shape) > KVT_TENSOR_MAX_DIMS || !json_is_array(tok) ||
            json_array_size(tok) != 2 || !json_is_integer(jb)) {
            rc = bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "a tensor description is malformed");
            break;
        }
        snprintf(t->name, sizeof t->name, "%s", name);
        t->ndim = (int32_t)json_array_size(shape);
        for (int32_t d = 0; d < t->ndim; d++)
            t->shape[d] = json_integer_value(json_array_get(shape, (size_t)d));
        t->tok_begin = json_integer_value(json_array_get(tok, 0));
        t->tok_end = json_integer_value(json_array_get(tok, 1));
        json_int_t bi = json_integer_value(jb);
        if (bi < -1 || bi >= n_blk) {
            rc = bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "a tensor references a block outside the chain");
            break;
        }
        const kvt__rshard *src = bi < 0 ? ent : &blk[bi];
        char sname[96];
        snprintf(sname, sizeof sname, "L%d.%s", (int)l, name);
        const kvt__st_in *x = tensor_named(&src->sh, sname);
        int same = x && x->dtype == t->dtype && x->ndim == t->ndim;
        for (int32_t d = 0; same && d < t->ndim; d++)
            same = x->shape[d] == t->shape[d];
        if (!same) {
            rc = bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "a tensor is missing or differs in dtype/shape");
            break;
        }
        t->data = (const uint8_t *)kvt_buf_data(src->buf) + x->begin;
        t->bytes = (size_t)(x->end - x->begin);
        /* each tensor gets its own buffer over its bytes, holding the shard's
         * buffer: kinds that adopt a whole owner then restore zero-copy */
        kvt_buf *parent = kvt_buf_retain(src->buf);
        if ((rc = kvt_buf_wrap((void *)t->data, t->bytes, release_parent, parent, &t->owner))) {
            kvt_buf_release(parent);
            break;
        }
        cs.n_tensors++;
    }
    if (!rc) {
        rc = kvt_cache_decode(&cs, out);
        if (rc && rc != KVT_ENOMEM)
            *reason = KVT_STORE_REFUSED_MALFORMED;
    }
    kvt_cache_state_clear(&cs);
    return rc;
}

int kvt__codec_block_check(const kvt__pentry *pe, int32_t i, const kvt__pblock *pb, const char *name, int *reason)
{
    int ok = kvt__key_eq(pb->key, pe->blocks[i]) && !strcmp(pb->ns, pe->ns) && pb->tok_begin == pe->ranges[i][0] &&
             pb->tok_end == pe->ranges[i][1] &&
             !memcmp(pb->tokens, pe->tokens + pb->tok_begin, sizeof(int32_t) * (size_t)pb->n_tokens);
    return ok ? 0 : bad(reason, KVT_STORE_REFUSED_TOKENS, name, "block does not match the entry's tokens");
}

int kvt__codec_decode(const kvt__pentry *pe, const kvt__rshard *ent, const kvt__rshard *blk, const char *name,
                      kvt_entry *out, int *reason)
{
    int32_t L = (int32_t)json_array_size(pe->layers), A = (int32_t)json_array_size(pe->atts);
    int rc = kvt_entry_init(out, pe->ns, pe->tokens, pe->n_tokens, L, A);
    if (rc)
        return rc;
    for (int32_t l = 0; l < L && !rc; l++)
        rc = build_layer(json_array_get(pe->layers, (size_t)l), l, ent, blk, pe->n_blocks, pe->n_tokens,
                         &out->caches[l], name, reason);
    for (int32_t a = 0; a < A && !rc; a++) {
        const char *an = json_string_value(json_object_get(json_array_get(pe->atts, (size_t)a), "name"));
        char tn[16];
        snprintf(tn, sizeof tn, "A%d", (int)a);
        const kvt__st_in *x = tensor_named(&ent->sh, tn);
        if (!an || !x || x->dtype != KVT_DTYPE_U8) {
            rc = bad(reason, KVT_STORE_REFUSED_MALFORMED, name, "an attachment is missing");
            break;
        }
        rc = kvt_attachment_blob(an, (const uint8_t *)kvt_buf_data(ent->buf) + x->begin, (size_t)(x->end - x->begin),
                                 &out->attachments[a]);
    }
    if (rc)
        kvt_entry_clear(out);
    return rc;
}
