/*
 * store.c: the SSD tier (kvtier/store.h, DESIGN.md section 4). Owns one
 * identity directory under a root: its index (entries in a radix tree per
 * namespace, content-addressed blocks with reference counts), the startup
 * scan, put (blocks first, then the entry shard, each crash-safe), restore
 * into owned buffers, the write-behind queue and its writer thread, the
 * restore threads, the byte budget over the whole root, and the kvt_cold_tier
 * table the prompt cache tiers over.
 * It must never serve bytes it has not validated (identity, tokens, offsets,
 * checksum under verify), never index an entry before it is durable, never
 * delete a block some indexed entry or in-flight put still references, and
 * never touch the files of an identity directory another live store holds.
 */
#include "hmap.h"
#include "index.h"
#include "internal.h"
#include "store_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define KVT__QUEUE_DEFAULT (256ull << 20)
#define KVT__ID_MAX 1024
#define KVT__WINDOW 16 /* block shards written before the first fsync */

/* ---- index records ------------------------------------------------------------ */

typedef struct st_block {
    kvt__key key;
    uint64_t bytes;   /* file size */
    int64_t refs;     /* indexed entries + in-flight puts referencing it */
} st_block;

typedef struct st_entry {
    kvt__key key;
    uint64_t id;          /* the handle given out by find */
    char *ns;
    int32_t *tokens;      /* (n_tokens) */
    int64_t n_tokens;
    int64_t min_reach;    /* smallest usable prefix (tokens); n_tokens when untrimmable */
    kvt__key *blocks;    /* (n_blocks) in chain order */
    int32_t n_blocks;
    uint64_t bytes;       /* entry file size */
    int64_t last_use_ms;  /* wall clock; file mtime at scan */
    struct st_entry *next, *prev;
} st_entry;

typedef struct st_orphan { /* refused or unreferenced files, evicted first */
    char name[256];
    uint64_t bytes;
} st_orphan;

/* One write-behind job. While queued or being written it is findable (in
 * its ns's ptree and in pjobs by its handle) and restorable from its own
 * caches (zero-copy clones whose hook holds a reference): the job's entry is
 * cleared when the writer is done with it and the last clone is gone. */
typedef struct wjob {
    kvt_entry e;
    int64_t min_reach;    /* as st_entry's */
    struct wjob *twin;    /* an older queued job with the same (ns, tokens):
                             the pending index holds only the newest */
    uint64_t bytes;
    uint64_t id;          /* handle; the durable entry gets the same one */
    kvt__key key;
    _Atomic int64_t refs; /* the queue's + one per clone handed out */
    struct wjob *next;
} wjob;

typedef struct rjob {
    uint64_t handle;
    kvt_restore_done_fn done;
    void *arg;
    struct rjob *next;
} rjob;

struct kvt_store {
    char *root, *dir, *dir_name;
    int dirfd, lockfd;
    char *identity;       /* canonical identity JSON */
    kvt__key id_seed;    /* XXH3-128 of identity */
    kvt_store_options opts;

    pthread_mutex_t mu;
    kvt__kmap by_key, by_id, blocks, pending, pjobs;
    kvt__index *tree;     /* durable entries (st_entry) by (ns, tokens) */
    kvt__index *ptree;    /* jobs whose write-behind is queued or in flight (wjob) */
    st_entry *head;       /* all entries */
    uint64_t next_id;
    st_orphan *orphans;
    int32_t n_orphans, cap_orphans;
    uint64_t own_bytes, foreign_bytes;
    uint64_t foreign_scan_ms; /* last listing of the root (monotonic ms) */
    uint64_t disk_ms;     /* last reclaim pass over the own directory (monotonic ms) */
    int reclaim_due;      /* a reclaim could not take the lock: try again */
    kvt__key *free_keys; /* blocks this process stopped referencing, for reclaim */
    int32_t n_free, cap_free;
    pthread_mutex_t disk_mu; /* the on-disk entry cache (held by reclaim) */
    kvt__kmap disk;       /* entry key -> dent, entry files reclaim parsed */
    kvt_store_stats st;

    /* write-behind */
    pthread_t writer;
    int writer_started;
    pthread_cond_t q_cv, idle_cv;
    wjob *q_head, *q_tail;
    int closing;
    int flush_rc;
    char flush_msg[256]; /* kvt_last_error of that failure (the writer's thread) */

    /* restore threads */
    pthread_t *rthreads;
    int n_rthreads;
    pthread_cond_t r_cv;
    rjob *r_head, *r_tail;
};

KVT_API const char *kvt_store_refusal_name(kvt_store_refusal r)
{
    static const char *const names[KVT_STORE_REFUSED_COUNT] = {
        "truncated", "header-bound", "offsets", "malformed", "identity",
        "checksum", "tokens", "missing-block", "io", "symlink"};
    return (unsigned)r < KVT_STORE_REFUSED_COUNT ? names[r] : "unknown";
}

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static char *read_small(int dirfd, const char *name);

/* ---- keys ----------------------------------------------------------------------- */

/* How the index sees an entry of reach min_reach (see kvt__index_insert). */
static int trimmable(int64_t n_tokens, int64_t min_reach) { return min_reach < n_tokens || n_tokens == 0; }

static kvt__key id_key(uint64_t id) { return (kvt__key){id, 0x5eed}; }

static void file_name(char type, kvt__key k, char out[64])
{
    char hex[33];
    kvt__key_hex(k, hex);
    snprintf(out, 64, "%c%s" KVT__SHARD_SUFFIX, type, hex);
}

/* ---- identity / fingerprint --------------------------------------------------- */

static char *identity_json(const kvt_store_identity *id)
{
    json_t *o = json_pack("{s:s, s:s, s:s}", "model", id->model_id, "config", id->config_fingerprint,
                          "tokenizer", id->tokenizer_hash);
    char *s = o ? json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(o);
    if (!s)
        return NULL;
    char *d = kvt__strdup(s);
    free(s);
    return d;
}

static void sha256_hex(const void *data, size_t n, char out[65])
{
    uint8_t md[32];
    unsigned int len = 0;
    EVP_Digest(data, n, md, &len, EVP_sha256(), NULL);
    kvt__hex(md, 32, out);
}

KVT_API int kvt_store_config_fingerprint(kvt_cache *const *caches, int32_t n_layers,
                                         char out[KVT_STORE_FINGERPRINT_LEN])
{
    if (!out || n_layers < 0 || (n_layers && !caches))
        return kvt__fail(KVT_EINVAL, "kvt_store_config_fingerprint: bad arguments");
    size_t cap = 64 + (size_t)n_layers * 256, len = 0;
    char *s = kvt__malloc(cap);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "kvt_store_config_fingerprint: out of memory");
    len += (size_t)snprintf(s + len, cap - len, "layers=%d", (int)n_layers);
    for (int32_t l = 0; l < n_layers; l++) {
        kvt_cache_state st;
        int rc = kvt_cache_encode(caches[l], &st);
        if (rc) {
            kvt__free(s);
            return rc;
        }
        len += (size_t)snprintf(s + len, cap - len, ";%s(", st.kind);
        for (int32_t p = 0; p < st.n_params && p < KVT_CACHE_PARAMS_MAX; p++)
            len += (size_t)snprintf(s + len, cap - len, "%s%lld", p ? "," : "", (long long)st.params[p]);
        len += (size_t)snprintf(s + len, cap - len, ")");
        kvt_cache_state_clear(&st);
    }
    sha256_hex(s, len, out);
    kvt__free(s);
    return 0;
}

/* ---- namespaces and entries (call with mu held) --------------------------------- */

static void entry_free(st_entry *e)
{
    if (!e)
        return;
    kvt__free(e->ns);
    kvt__free(e->tokens);
    kvt__free(e->blocks);
    kvt__free(e);
}

static void orphan_add(kvt_store *s, const char *name, uint64_t bytes)
{
    if (s->n_orphans == s->cap_orphans) {
        int32_t c = s->cap_orphans ? s->cap_orphans * 2 : 16;
        st_orphan *o = kvt__realloc(s->orphans, sizeof *o * (size_t)c);
        if (!o)
            return; /* still counted in own_bytes; gc can remove it */
        s->orphans = o;
        s->cap_orphans = c;
    }
    snprintf(s->orphans[s->n_orphans].name, sizeof s->orphans[0].name, "%s", name);
    s->orphans[s->n_orphans++].bytes = bytes;
}

/* A file just written under a name a refused shard had: it is no longer an
 * orphan (the budget must not delete the new file). */
static void orphan_forget(kvt_store *s, const char *name)
{
    for (int32_t i = 0; i < s->n_orphans; i++)
        if (!strcmp(s->orphans[i].name, name)) {
            s->own_bytes -= KVT__MIN(s->own_bytes, s->orphans[i].bytes);
            s->orphans[i] = s->orphans[--s->n_orphans];
            return;
        }
}

/* Indexes an entry (takes ownership of e on success); e->id, when set (the
 * handle its write-behind job had), is kept, else a new one is given. */
static int index_entry(kvt_store *s, st_entry *e)
{
    if (!e->id || kvt__kmap_ptr(&s->by_id, id_key(e->id)))
        e->id = ++s->next_id;
    void *was;
    if (kvt__index_insert(s->tree, e->ns, e->tokens, e->n_tokens, e, trimmable(e->n_tokens, e->min_reach),
                          e->min_reach, &was))
        return KVT_ENOMEM;
    if (was) { /* same (ns, tokens) under another key: not possible while keys are content keys */
        kvt__index_insert(s->tree, e->ns, e->tokens, e->n_tokens, was, trimmable(e->n_tokens, e->min_reach),
                          e->min_reach, &was); /* puts it back: the node exists, nothing is allocated */
        return kvt__fail(KVT_EINVAL, "store index: two keys for one token sequence");
    }
    if (kvt__kmap_put_ptr(&s->by_key, e->key, e) || kvt__kmap_put_ptr(&s->by_id, id_key(e->id), e)) {
        kvt__kmap_del(&s->by_key, e->key);
        kvt__index_remove(s->tree, e->ns, e->tokens, e->n_tokens);
        return KVT_ENOMEM;
    }
    e->next = s->head;
    e->prev = NULL;
    if (s->head)
        s->head->prev = e;
    s->head = e;
    s->own_bytes += e->bytes;
    s->st.entries++;
    if (e->n_tokens > s->st.longest_prefix_tokens)
        s->st.longest_prefix_tokens = e->n_tokens;
    return 0;
}

static void block_unref(kvt_store *s, kvt__key k, int delete_file)
{
    st_block *b = kvt__kmap_ptr(&s->blocks, k);
    if (!b || --b->refs > 0)
        return;
    if (!delete_file || s->opts.read_only)
        return; /* stays indexed with refs 0: evicted first under the budget */
    /* entries of other processes may use it: reclaim decides from the disk */
    if (s->n_free == s->cap_free) {
        int32_t c = s->cap_free ? s->cap_free * 2 : 16;
        kvt__key *x = kvt__realloc(s->free_keys, sizeof *x * (size_t)c);
        if (!x)
            return; /* stays; the budget removes it when unreferenced */
        s->free_keys = x;
        s->cap_free = c;
    }
    s->free_keys[s->n_free++] = k;
}

static void recompute_longest(kvt_store *s)
{
    int64_t m = 0;
    for (st_entry *e = s->head; e; e = e->next)
        m = KVT__MAX(m, e->n_tokens);
    s->st.longest_prefix_tokens = m;
}


/* Removes an entry from the index and deletes its file (keep_file 1: leaves
 * it as an orphan, a refused shard; 2: the file is already gone) and hands
 * the blocks only it used to reclaim. */
static void drop_entry_ex(kvt_store *s, st_entry *e, int keep_file)
{
    kvt__index_remove(s->tree, e->ns, e->tokens, e->n_tokens);
    kvt__kmap_del(&s->by_key, e->key);
    kvt__kmap_del(&s->by_id, id_key(e->id));
    if (e->prev)
        e->prev->next = e->next;
    else
        s->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    char name[64];
    file_name('e', e->key, name);
    if (keep_file == 2)
        s->own_bytes -= KVT__MIN(s->own_bytes, e->bytes);
    else if (keep_file || s->opts.read_only)
        orphan_add(s, name, e->bytes);
    else {
        unlinkat(s->dirfd, name, 0);
        s->own_bytes -= KVT__MIN(s->own_bytes, e->bytes);
    }
    s->st.entries--;
    for (int32_t i = 0; i < e->n_blocks; i++)
        block_unref(s, e->blocks[i], 1);
    int longest = e->n_tokens == s->st.longest_prefix_tokens;
    entry_free(e);
    if (longest)
        recompute_longest(s);
}

static void drop_entry(kvt_store *s, st_entry *e) { drop_entry_ex(s, e, 0); }

/* ---- metadata parsing (shared by scan, restore, walk) ------------------------------ */

typedef struct pentry {
    const char *ns;
    int32_t *tokens;
    int64_t n_tokens, min_reach;
    kvt__key key;
    kvt__key *blocks;
    int64_t (*ranges)[2]; /* (n_blocks) [tok_begin, tok_end) of each block */
    int32_t n_blocks;
    json_t *layers;      /* owned */
    json_t *atts;        /* owned */
} pentry;

static void pentry_free(pentry *p)
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

static int bad(int *reason, int r, const char *path, const char *what)
{
    *reason = r;
    return kvt__fail(r == KVT_STORE_REFUSED_IDENTITY ? KVT_EIDENTITY : KVT_EFORMAT, "%s: refused (%s): %s", path,
                     kvt_store_refusal_name((kvt_store_refusal)r), what);
}

/* Validates an entry shard's metadata. identity NULL: accept the shard's own. */
static int parse_entry(const kvt__shard *sh, const char *path, const char *identity, pentry *p, int *reason)
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
        pentry_free(p);
        return trc;
    }
    if (trc || p->n_tokens != n_decl) {
        pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "tokens do not decode to n_tokens ids");
    }
    kvt__key want = kvt__entry_key(kvt__key_seed(id), p->ns, p->tokens, p->n_tokens);
    if (kvt__key_parse(key, &p->key) || !kvt__key_eq(want, p->key)) {
        pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_TOKENS, path, "key does not match (identity, ns, tokens)");
    }
    if (p->min_reach < 0 || p->min_reach > p->n_tokens) {
        pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "min_reach outside [0, n_tokens]");
    }
    const char *ls = kvt__meta_str(sh, "layers"), *bs = kvt__meta_str(sh, "blocks"),
               *as = kvt__meta_str(sh, "attachments");
    json_t *blocks = bs ? json_loads(bs, 0, NULL) : NULL;
    p->layers = ls ? json_loads(ls, 0, NULL) : NULL;
    p->atts = as ? json_loads(as, 0, NULL) : NULL;
    if (!json_is_array(p->layers) || !json_is_array(blocks) || !json_is_array(p->atts)) {
        json_decref(blocks);
        pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, "layers, blocks or attachments is not a JSON array");
    }
    size_t nb = json_array_size(blocks);
    p->blocks = kvt__calloc(nb ? nb : 1, sizeof *p->blocks);
    p->ranges = kvt__calloc(nb ? nb : 1, sizeof *p->ranges);
    if (!p->blocks || !p->ranges) {
        json_decref(blocks);
        pentry_free(p);
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
            pentry_free(p);
            return bad(reason, KVT_STORE_REFUSED_TOKENS, path, "a block key does not follow from the tokens");
        }
        p->ranges[i][0] = bb;
        p->ranges[i][1] = be;
        parent = k;
        at = be;
    }
    json_decref(blocks);
    if (why) {
        pentry_free(p);
        return bad(reason, KVT_STORE_REFUSED_MALFORMED, path, why);
    }
    p->n_blocks = (int32_t)nb;
    return 0;
}

typedef struct pblock {
    const char *ns;
    kvt__key key, parent;
    int64_t tok_begin, tok_end;
    int32_t *tokens;
    int64_t n_tokens;
} pblock;

static int parse_block(const kvt__shard *sh, const char *path, const char *identity, pblock *p, int *reason)
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

/* Opens and validates a shard's header. */
static int open_shard(int dirfd, const char *dir, const char *name, kvt__shard *sh, int *fd_out, int *reason)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        *reason = KVT_STORE_REFUSED_IO;
        return kvt__fail(errno == ENOENT ? KVT_ENOTFOUND : -errno, "%s: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st)) {
        int e = errno;
        close(fd);
        *reason = KVT_STORE_REFUSED_IO;
        return kvt__fail(-e, "%s: %s", path, strerror(e));
    }
    int rc = kvt__shard_read_header(fd, path, (uint64_t)st.st_size, sh, reason);
    if (rc) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    return 0;
}

/* ---- scan ------------------------------------------------------------------------ */

static int pid_alive(const char *tmpname)
{
    long pid = strtol(tmpname + strlen(KVT__TMP_PREFIX), NULL, 10);
    if (pid <= 0)
        return 0;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

static void refuse_count(kvt_store *s, int reason)
{
    if (reason >= 0 && reason < KVT_STORE_REFUSED_COUNT)
        s->st.refused[reason]++;
}

static int scan(kvt_store *s)
{
    DIR *d = fdopendir(dup(s->dirfd));
    if (!d)
        return kvt__fail(-errno, "%s: cannot list: %s", s->dir, strerror(errno));
    rewinddir(d);
    /* Two passes: blocks first (entries reference them), then entries. */
    for (int pass = 0; pass < 2; pass++) {
        rewinddir(d);
        struct dirent *de;
        while ((de = readdir(d))) {
            const char *nm = de->d_name;
            struct stat fst;
            if (nm[0] == '.' && strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX)))
                continue;
            if (fstatat(s->dirfd, nm, &fst, AT_SYMLINK_NOFOLLOW) || !S_ISREG(fst.st_mode))
                continue;
            if (!strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX))) {
                if (pass == 0 && !s->opts.read_only && !pid_alive(nm) && !unlinkat(s->dirfd, nm, 0))
                    s->st.temp_removed++;
                continue;
            }
            size_t len = strlen(nm);
            if (len != 1 + 32 + strlen(KVT__SHARD_SUFFIX) || strcmp(nm + 33, KVT__SHARD_SUFFIX))
                continue;
            char type = nm[0];
            if ((pass == 0) != (type == 'b') || (type != 'b' && type != 'e'))
                continue;
            kvt__shard sh;
            int fd = -1, reason = -1;
            int rc = open_shard(s->dirfd, s->dir, nm, &sh, &fd, &reason);
            if (!rc && type == 'b') {
                pblock pb;
                rc = parse_block(&sh, nm, s->identity, &pb, &reason);
                char want[64];
                if (!rc) {
                    file_name('b', pb.key, want);
                    if (strcmp(want, nm))
                        rc = bad(&reason, KVT_STORE_REFUSED_MALFORMED, nm, "file name does not match its key");
                }
                if (!rc && !kvt__kmap_ptr(&s->blocks, pb.key)) {
                    st_block *b = kvt__calloc(1, sizeof *b);
                    if (b && !kvt__kmap_put_ptr(&s->blocks, pb.key, b)) {
                        b->key = pb.key;
                        b->bytes = (uint64_t)fst.st_size;
                        s->own_bytes += b->bytes;
                        s->st.blocks++;
                    } else {
                        kvt__free(b);
                        rc = KVT_ENOMEM;
                    }
                }
                kvt__free(pb.tokens);
            } else if (!rc) {
                pentry pe;
                rc = parse_entry(&sh, nm, s->identity, &pe, &reason);
                char want[64];
                if (!rc) {
                    file_name('e', pe.key, want);
                    if (strcmp(want, nm))
                        rc = bad(&reason, KVT_STORE_REFUSED_MALFORMED, nm, "file name does not match its key");
                }
                for (int32_t i = 0; !rc && i < pe.n_blocks; i++)
                    if (!kvt__kmap_ptr(&s->blocks, pe.blocks[i])) {
                        rc = bad(&reason, KVT_STORE_REFUSED_MISSING_BLOCK, nm, "references a block that is gone");
                        s->reclaim_due = 1; /* a broken file: reclaim removes it */
                    }
                st_entry *e = NULL;
                if (!rc && !kvt__kmap_ptr(&s->by_key, pe.key)) {
                    e = kvt__calloc(1, sizeof *e);
                    if (!e || !(e->ns = kvt__strdup(pe.ns))) {
                        entry_free(e);
                        rc = KVT_ENOMEM;
                    } else {
                        e->key = pe.key;
                        e->tokens = pe.tokens;
                        pe.tokens = NULL;
                        e->n_tokens = pe.n_tokens;
                        e->min_reach = pe.min_reach;
                        e->blocks = pe.blocks;
                        pe.blocks = NULL;
                        e->n_blocks = pe.n_blocks;
                        e->bytes = (uint64_t)fst.st_size;
                        e->last_use_ms = (int64_t)fst.st_mtim.tv_sec * 1000 + fst.st_mtim.tv_nsec / 1000000;
                        if (index_entry(s, e)) {
                            entry_free(e);
                            rc = KVT_ENOMEM;
                        } else {
                            for (int32_t i = 0; i < e->n_blocks; i++)
                                ((st_block *)kvt__kmap_ptr(&s->blocks, e->blocks[i]))->refs++;
                        }
                    }
                }
                pentry_free(&pe);
            }
            if (fd >= 0)
                close(fd);
            kvt__shard_free(&sh);
            if (rc == KVT_ENOMEM) {
                closedir(d);
                return rc;
            }
            if (rc) {
                refuse_count(s, reason);
                s->own_bytes += (uint64_t)fst.st_size;
                orphan_add(s, nm, (uint64_t)fst.st_size);
            }
        }
    }
    closedir(d);
    kvt__clear_error();
    return 0;
}

/* ---- foreign directories and the budget ----------------------------------------------- */

typedef struct fcand {
    int dir;              /* index into the dir list */
    char name[256];
    uint64_t bytes;
    int64_t mtime_ms;
    int orphan;           /* temp / refused / unreferenced / broken: goes first */
    int broken;           /* entries: a referenced block is not on disk */
    kvt__key *blocks;    /* entries: referenced blocks */
    int32_t n_blocks;
    kvt__key key;
    char type;
} fcand;

typedef struct fdirs {
    char **paths;
    int *dirfds, *lockfds;
    int n;
    fcand *c;
    size_t n_c, cap_c;
    uint64_t bytes;       /* of all listed dirs (idle or not) */
    int unlink_errno;     /* first error that kept files from being removed: an
                             unlink (ENOENT, removed meanwhile, excepted) or a
                             directory whose .lock cannot be opened */
} fdirs;

static void fdirs_free(fdirs *f)
{
    for (int i = 0; i < f->n; i++) {
        kvt__free(f->paths[i]);
        if (f->lockfds[i] >= 0)
            close(f->lockfds[i]); /* releases the flock */
        if (f->dirfds[i] >= 0)
            close(f->dirfds[i]);
    }
    for (size_t i = 0; i < f->n_c; i++)
        kvt__free(f->c[i].blocks);
    kvt__free(f->paths);
    kvt__free(f->dirfds);
    kvt__free(f->lockfds);
    kvt__free(f->c);
    memset(f, 0, sizeof *f);
}

static fcand *fc_push(fdirs *f)
{
    if (f->n_c == f->cap_c) {
        size_t c = f->cap_c ? f->cap_c * 2 : 64;
        fcand *n = kvt__realloc(f->c, sizeof *n * c);
        if (!n)
            return NULL;
        f->c = n;
        f->cap_c = c;
    }
    fcand *x = &f->c[f->n_c++];
    memset(x, 0, sizeof *x);
    return x;
}

static int is_hex32(const char *s)
{
    for (int i = 0; i < 32; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

/* 32 lowercase hex digits: what kvt_store_open names identity directories. */
static int is_identity_dir_name(const char *n) { return strlen(n) == 32 && is_hex32(n); }

/* e<32 hex>.safetensors or b<32 hex>.safetensors */
static int is_shard_name(const char *n)
{
    return (n[0] == 'e' || n[0] == 'b') && strlen(n) == 33 + strlen(KVT__SHARD_SUFFIX) && is_hex32(n + 1) &&
           !strcmp(n + 33, KVT__SHARD_SUFFIX);
}

/* Lists the identity directories under root except `skip` (only directories
 * named like one and holding an IDENTITY file; only shard and temp files in
 * them are ever candidates); measures every
 * file; for directories nobody holds (flock LOCK_EX succeeds; the lock is kept
 * until fdirs_free) collects eviction candidates with their block references. */
static int list_foreign(const char *root, const char *skip, int collect, fdirs *f)
{
    memset(f, 0, sizeof *f);
    DIR *d = opendir(root);
    if (!d)
        return -errno;
    struct dirent *de;
    int cap = 0;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || (skip && !strcmp(de->d_name, skip)))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", root, de->d_name);
        struct stat st;
        if (!is_identity_dir_name(de->d_name) || lstat(path, &st) || !S_ISDIR(st.st_mode))
            continue;
        int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
        if (dfd < 0)
            continue;
        if (faccessat(dfd, "IDENTITY", F_OK, AT_SYMLINK_NOFOLLOW)) {
            close(dfd); /* not a store directory: never touched */
            continue;
        }
        if (f->n == cap) {
            cap = cap ? cap * 2 : 8;
            char **p = kvt__realloc(f->paths, sizeof *p * (size_t)cap);
            if (p)
                f->paths = p;
            int *a = kvt__realloc(f->dirfds, sizeof *a * (size_t)cap);
            if (a)
                f->dirfds = a;
            int *b = kvt__realloc(f->lockfds, sizeof *b * (size_t)cap);
            if (b)
                f->lockfds = b;
            if (!p || !a || !b) {
                close(dfd);
                closedir(d);
                fdirs_free(f);
                return KVT_ENOMEM;
            }
        }
        int i = f->n++;
        f->paths[i] = kvt__strdup(path);
        f->dirfds[i] = dfd;
        f->lockfds[i] = -1;
        int lfd = openat(dfd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (collect && lfd < 0 && !f->unlink_errno)
            f->unlink_errno = errno; /* cannot lock, so cannot clean: not "held" */
        int idle = collect && lfd >= 0 && flock(lfd, LOCK_EX | LOCK_NB) == 0;
        if (idle)
            f->lockfds[i] = lfd;
        else if (lfd >= 0)
            close(lfd);
        DIR *dd = fdopendir(dup(dfd));
        if (!dd)
            continue;
        size_t first_c = f->n_c;
        struct dirent *fe;
        while ((fe = readdir(dd))) {
            struct stat fs;
            if (!strcmp(fe->d_name, ".") || !strcmp(fe->d_name, "..") || !strcmp(fe->d_name, ".lock") ||
                !strcmp(fe->d_name, "IDENTITY") || !strcmp(fe->d_name, ".budget.lock"))
                continue;
            if (fstatat(dfd, fe->d_name, &fs, AT_SYMLINK_NOFOLLOW) || !S_ISREG(fs.st_mode))
                continue;
            f->bytes += (uint64_t)fs.st_size;
            if (!idle)
                continue;
            fcand *x = fc_push(f);
            if (!x)
                break;
            x->dir = i;
            snprintf(x->name, sizeof x->name, "%s", fe->d_name);
            x->bytes = (uint64_t)fs.st_size;
            x->mtime_ms = (int64_t)fs.st_mtim.tv_sec * 1000 + fs.st_mtim.tv_nsec / 1000000;
            x->type = fe->d_name[0];
            int is_tmp = !strncmp(fe->d_name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX));
            x->orphan = 1;
            if (is_tmp)
                continue;
            if (!is_shard_name(fe->d_name)) {
                x->name[0] = '\0'; /* not ours: counted, never deleted */
                continue;
            }
            kvt__shard sh;
            int fd = -1, reason;
            if (open_shard(dfd, path, fe->d_name, &sh, &fd, &reason))
                continue;
            if (x->type == 'e') {
                pentry pe;
                if (!parse_entry(&sh, fe->d_name, NULL, &pe, &reason)) {
                    x->orphan = 0;
                    x->blocks = pe.blocks;
                    x->n_blocks = pe.n_blocks;
                    pe.blocks = NULL;
                    pentry_free(&pe);
                }
            } else {
                pblock pb;
                if (!parse_block(&sh, fe->d_name, NULL, &pb, &reason)) {
                    x->orphan = 0;
                    x->key = pb.key;
                    kvt__free(pb.tokens);
                }
            }
            close(fd);
            kvt__shard_free(&sh);
        }
        closedir(dd);
        /* an entry referencing a block that is not on disk is broken: an
         * orphan (goes first; kvt_store_gc always removes it) */
        for (size_t c = first_c; c < f->n_c; c++) {
            fcand *x = &f->c[c];
            for (int32_t j = 0; x->type == 'e' && x->name[0] && !x->orphan && j < x->n_blocks; j++) {
                char bn[64];
                struct stat bst;
                file_name('b', x->blocks[j], bn);
                if (fstatat(dfd, bn, &bst, AT_SYMLINK_NOFOLLOW))
                    x->orphan = x->broken = 1;
            }
        }
    }
    closedir(d);
    kvt__clear_error();
    return 0;
}

static int64_t fc_block_refs(const fdirs *f, int dir, kvt__key k)
{
    int64_t n = 0;
    for (size_t i = 0; i < f->n_c; i++)
        if (f->c[i].dir == dir && f->c[i].type == 'e' && f->c[i].name[0] && !f->c[i].broken)
            for (int32_t j = 0; j < f->c[i].n_blocks; j++)
                n += kvt__key_eq(f->c[i].blocks[j], k);
    return n;
}

/* Deletes candidate i (and, for an entry, the blocks nobody else references). */
static uint64_t fc_evict(fdirs *f, size_t i)
{
    fcand *x = &f->c[i];
    if (!x->name[0])
        return 0;
    uint64_t freed = 0;
    if (!unlinkat(f->dirfds[x->dir], x->name, 0))
        freed += x->bytes;
    else if (errno != ENOENT && !f->unlink_errno)
        f->unlink_errno = errno;
    x->name[0] = '\0';
    if (x->type != 'e')
        return freed;
    for (int32_t j = 0; j < x->n_blocks; j++) {
        if (fc_block_refs(f, x->dir, x->blocks[j]))
            continue;
        for (size_t b = 0; b < f->n_c; b++)
            if (f->c[b].dir == x->dir && f->c[b].type == 'b' && f->c[b].name[0] && !f->c[b].orphan &&
                kvt__key_eq(f->c[b].key, x->blocks[j])) {
                if (!unlinkat(f->dirfds[x->dir], f->c[b].name, 0))
                    freed += f->c[b].bytes;
                else if (errno != ENOENT && !f->unlink_errno)
                    f->unlink_errno = errno;
                f->c[b].name[0] = '\0';
            }
    }
    return freed;
}

/* Marks unreferenced blocks of idle directories as orphans. */
static void fc_mark_orphans(fdirs *f)
{
    for (size_t i = 0; i < f->n_c; i++)
        if (f->c[i].type == 'b' && !f->c[i].orphan && !fc_block_refs(f, f->c[i].dir, f->c[i].key))
            f->c[i].orphan = 1;
}

/* Oldest remaining candidate: orphans first, then entries by time. */
static ssize_t fc_oldest(const fdirs *f)
{
    ssize_t best = -1;
    for (size_t i = 0; i < f->n_c; i++) {
        const fcand *x = &f->c[i];
        if (!x->name[0] || (!x->orphan && x->type != 'e'))
            continue;
        if (best < 0 || x->orphan > f->c[best].orphan ||
            (x->orphan == f->c[best].orphan && x->mtime_ms < f->c[best].mtime_ms))
            best = (ssize_t)i;
    }
    return best;
}

/* ---- the budget over a shared root ------------------------------------------------------
 *
 * Several processes may hold one identity directory open. Block files are
 * shared by entries of every process, so a block is deleted only by
 * reclaim(), which holds an exclusive flock on <dir>/.budget.lock and
 * decides from the directory as it is on disk (every entry file's header),
 * not from this process's index: a block goes only when no entry file on
 * disk references it, and an entry file goes before (or with) the blocks
 * that only it uses. Every put holds a shared flock on the same file from
 * the moment it relies on an existing block until its entry file is renamed,
 * so reclaim never sees a put half done; a put also re-checks on disk the
 * blocks (and the entry) its index says exist. */

#define KVT__BUDGET_LOCK ".budget.lock"

/* An entry file as reclaim parsed it (cached by key: entry files are
 * immutable under their names). */
typedef struct dent {
    kvt__key *blocks;
    int32_t n_blocks;
    int valid; /* header and metadata good */
} dent;

typedef struct rfile {
    char name[128];
    char type;      /* 'e', 'b', 't' (dead writer's temp file) */
    uint64_t bytes;
    int64_t mtime_ms;
    int orphan;     /* refused, unreferenced or broken: goes first */
    int broken;     /* entries: a referenced block is not on disk */
    int gone;       /* deleted by this pass */
    int64_t refs;   /* blocks: valid entry files referencing it */
    kvt__key key;
    const dent *d;  /* entries */
} rfile;

static void dent_free(dent *d)
{
    if (d) {
        kvt__free(d->blocks);
        kvt__free(d);
    }
}

static const dent *dent_get(kvt_store *s, const char *name, kvt__key key)
{
    dent *d = kvt__kmap_ptr(&s->disk, key);
    if (d)
        return d;
    d = kvt__calloc(1, sizeof *d);
    if (!d)
        return NULL;
    kvt__shard sh;
    int fd = -1, reason = -1;
    if (!open_shard(s->dirfd, s->dir, name, &sh, &fd, &reason)) {
        pentry pe;
        if (!parse_entry(&sh, name, s->identity, &pe, &reason) && kvt__key_eq(pe.key, key)) {
            d->valid = 1;
            d->blocks = pe.blocks;
            d->n_blocks = pe.n_blocks;
            pe.blocks = NULL;
            pentry_free(&pe);
        }
        close(fd);
        kvt__shard_free(&sh);
    } else if (reason == KVT_STORE_REFUSED_IO) {
        kvt__free(d); /* gone or unreadable now: not cached */
        kvt__clear_error();
        return NULL;
    }
    kvt__clear_error();
    if (kvt__kmap_put_ptr(&s->disk, key, d)) {
        dent_free(d);
        return NULL;
    }
    return d;
}

static int is_orphan_name(kvt_store *s, const char *name)
{
    for (int32_t i = 0; i < s->n_orphans; i++)
        if (!strcmp(s->orphans[i].name, name))
            return 1;
    return 0;
}

static rfile *rf_block(kvt__kmap *bm, kvt__key k) { return kvt__kmap_ptr(bm, k); }

/* Deletes file f of the own directory; an entry takes its blocks' references
 * with it and the blocks nobody else references go too. */
static uint64_t rf_delete(kvt_store *s, rfile *f, kvt__kmap *bm)
{
    if (f->gone)
        return 0;
    uint64_t freed = 0;
    if (!unlinkat(s->dirfd, f->name, 0) || errno == ENOENT)
        freed = f->bytes;
    f->gone = 1;
    if (f->type != 'e' || !f->d || !f->d->valid || f->orphan)
        return freed;
    for (int32_t i = 0; i < f->d->n_blocks; i++) {
        rfile *b = rf_block(bm, f->d->blocks[i]);
        if (b && !b->gone && --b->refs <= 0)
            freed += rf_delete(s, b, bm);
    }
    return freed;
}

static int64_t own_last_use(kvt_store *s, kvt__key k, int64_t mtime)
{
    st_entry *e = kvt__kmap_ptr(&s->by_key, k);
    return e && e->last_use_ms > mtime ? e->last_use_ms : mtime;
}

/* Frees unreferenced blocks this process let go of, and applies the budget
 * over the whole root, from the directory's state on disk (see above).
 * wait: block until the lock is free (close); else try once and leave it
 * due for the next call. Call without mu. */
static void reclaim(kvt_store *s, kvt__key protect, int wait)
{
    if (s->opts.read_only || s->dirfd < 0)
        return;
    uint64_t max = s->opts.max_bytes;
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&s->mu);
    int due = s->n_free > 0 || s->reclaim_due ||
              (max && (s->own_bytes + s->foreign_bytes > max || now - s->disk_ms >= 1000));
    pthread_mutex_unlock(&s->mu);
    if (!due && !(wait && max))
        return;
    int lfd = openat(s->dirfd, KVT__BUDGET_LOCK, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lfd < 0)
        return;
    if (flock(lfd, LOCK_EX | (wait ? 0 : LOCK_NB))) {
        close(lfd);
        pthread_mutex_lock(&s->mu);
        s->reclaim_due = 1;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    pthread_mutex_lock(&s->disk_mu);
    /* 1. the own directory as it is on disk */
    rfile *fs = NULL;
    size_t n = 0, cap = 0;
    uint64_t own = 0;
    DIR *d = fdopendir(dup(s->dirfd));
    if (d)
        rewinddir(d); /* the dup shares the offset scan left at the end */
    struct dirent *de;
    while (d && (de = readdir(d))) {
        const char *nm = de->d_name;
        struct stat st;
        if (!strcmp(nm, ".") || !strcmp(nm, "..") || !strcmp(nm, ".lock") || !strcmp(nm, "IDENTITY") ||
            !strcmp(nm, KVT__BUDGET_LOCK) || fstatat(s->dirfd, nm, &st, AT_SYMLINK_NOFOLLOW) ||
            !S_ISREG(st.st_mode))
            continue;
        own += (uint64_t)st.st_size;
        int tmp = !strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX));
        if (!(tmp ? !pid_alive(nm) : is_shard_name(nm)))
            continue; /* IDENTITY, locks, live writers' temp files, strangers */
        if (strlen(nm) >= sizeof fs[0].name)
            continue;
        if (n == cap) {
            size_t c = cap ? cap * 2 : 64;
            rfile *x = kvt__realloc(fs, sizeof *x * c);
            if (!x)
                break;
            fs = x;
            cap = c;
        }
        rfile *f = &fs[n++];
        memset(f, 0, sizeof *f);
        memcpy(f->name, nm, strlen(nm) + 1); /* checked: shorter than name */
        f->type = tmp ? 't' : nm[0];
        f->bytes = (uint64_t)st.st_size;
        f->mtime_ms = (int64_t)st.st_mtim.tv_sec * 1000 + st.st_mtim.tv_nsec / 1000000;
        f->orphan = tmp;
        if (!tmp) {
            char hex[33];
            memcpy(hex, nm + 1, 32);
            hex[32] = '\0';
            kvt__key_parse(hex, &f->key);
        }
    }
    if (d)
        closedir(d);
    kvt__kmap bm;
    memset(&bm, 0, sizeof bm);
    for (size_t i = 0; i < n; i++)
        if (fs[i].type == 'b')
            kvt__kmap_put_ptr(&bm, fs[i].key, &fs[i]);
    for (size_t i = 0; i < n; i++)
        if (fs[i].type == 'e')
            fs[i].d = dent_get(s, fs[i].name, fs[i].key); /* header I/O: without mu */
    pthread_mutex_lock(&s->mu);
    uint64_t foreign = s->foreign_bytes, foreign_ms = s->foreign_scan_ms;
    for (size_t i = 0; i < n; i++) {
        rfile *f = &fs[i];
        if (f->type == 'b' && is_orphan_name(s, f->name))
            f->orphan = 1;
        if (f->type != 'e')
            continue;
        f->orphan = !f->d || !f->d->valid || is_orphan_name(s, f->name);
        for (int32_t k = 0; f->d && f->d->valid && !f->broken && k < f->d->n_blocks; k++)
            if (!rf_block(&bm, f->d->blocks[k]))
                f->orphan = f->broken = 1; /* a block is gone: broken, goes first */
        if (!f->orphan)
            f->mtime_ms = own_last_use(s, f->key, f->mtime_ms);
    }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < n; i++)
        if (fs[i].type == 'e' && !fs[i].orphan)
            for (int32_t k = 0; k < fs[i].d->n_blocks; k++)
                rf_block(&bm, fs[i].d->blocks[k])->refs++;
    /* 2. blocks this process let go of that no entry file references */
    pthread_mutex_lock(&s->mu);
    uint64_t evicted_big = 0;
    kvt__key *fr = s->free_keys;
    int32_t nfr = s->n_free;
    s->free_keys = NULL;
    s->n_free = s->cap_free = 0;
    s->reclaim_due = 0;
    pthread_mutex_unlock(&s->mu);
    for (int32_t i = 0; i < nfr; i++) {
        rfile *b = rf_block(&bm, fr[i]);
        if (b && !b->gone && b->refs == 0) {
            uint64_t freed = rf_delete(s, b, &bm);
            own -= KVT__MIN(own, freed);
        }
    }
    kvt__free(fr);
    /* 2b. entry files referencing a block that is gone are garbage, budget
     * or not (nothing can serve them). The block is looked up again first:
     * a put without the shared lock renames its blocks before its entry, so
     * one seen by readdir before its blocks is not broken. */
    for (size_t i = 0; i < n; i++) {
        rfile *x = &fs[i];
        if (x->type != 'e' || !x->broken || x->gone)
            continue;
        int missing = 0;
        for (int32_t k = 0; !missing && k < x->d->n_blocks; k++) {
            char bn[64];
            struct stat bst;
            file_name('b', x->d->blocks[k], bn);
            missing = fstatat(s->dirfd, bn, &bst, AT_SYMLINK_NOFOLLOW) != 0;
        }
        if (missing) {
            uint64_t freed = rf_delete(s, x, &bm);
            own -= KVT__MIN(own, freed);
        }
    }
    /* 3. the budget: broken and unreferenced files first, then the least
     * recently used entries here and in idle foreign directories. An entry
     * that with all its blocks exceeds the whole budget can never be kept:
     * it goes first (with the blocks only it uses), before anything that
     * fits is evicted to make room for it. */
    if (max)
        for (size_t i = 0; i < n; i++) {
            rfile *x = &fs[i];
            if (x->type != 'e' || x->orphan || x->gone)
                continue;
            uint64_t need = x->bytes;
            for (int32_t k = 0; k < x->d->n_blocks; k++) {
                rfile *b = rf_block(&bm, x->d->blocks[k]);
                if (b && !b->gone)
                    need += b->bytes;
            }
            if (need > max) {
                evicted_big++;
                uint64_t freed = rf_delete(s, x, &bm);
                own -= KVT__MIN(own, freed);
            }
        }
    fdirs f;
    int have_f = 0;
    if (max) {
        if (foreign || now - foreign_ms >= 1000 || wait) {
            have_f = list_foreign(s->root, s->dir_name, 1, &f) == 0;
            foreign_ms = now;
        }
        if (have_f) {
            foreign = f.bytes;
            fc_mark_orphans(&f);
        }
    }
    uint64_t evicted = evicted_big, evicted_foreign = 0;
    while (max && own + foreign > max) {
        ssize_t best = -1;
        for (size_t i = 0; i < n; i++) {
            rfile *x = &fs[i];
            /* a block goes only when no valid entry file references it */
            int cand = !x->gone && (x->type == 'b' ? x->refs == 0 : 1) &&
                       !(x->type == 'e' && !x->orphan && kvt__key_eq(x->key, protect));
            int xo = x->orphan || x->type != 'e';
            if (!cand)
                continue;
            if (best < 0) {
                best = (ssize_t)i;
                continue;
            }
            rfile *b = &fs[best];
            int bo = b->orphan || b->type != 'e';
            if (xo > bo || (xo == bo && x->mtime_ms < b->mtime_ms))
                best = (ssize_t)i;
        }
        ssize_t fi = have_f ? fc_oldest(&f) : -1;
        if (best < 0 && fi < 0)
            break;
        int own_orphan = best >= 0 && (fs[best].orphan || fs[best].type != 'e');
        if (fi >= 0 && (best < 0 || (!own_orphan && (f.c[fi].orphan || f.c[fi].mtime_ms <= fs[best].mtime_ms)))) {
            uint64_t freed = fc_evict(&f, (size_t)fi);
            foreign -= KVT__MIN(foreign, freed);
            evicted_foreign++;
        } else {
            evicted += fs[best].type == 'e' && !fs[best].orphan;
            uint64_t freed = rf_delete(s, &fs[best], &bm);
            own -= KVT__MIN(own, freed);
        }
    }
    if (have_f)
        fdirs_free(&f);
    /* 4. the index follows the disk: what was deleted leaves it */
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < n; i++) {
        rfile *x = &fs[i];
        if (!x->gone)
            continue;
        if (x->type == 'e') {
            st_entry *e = kvt__kmap_ptr(&s->by_key, x->key);
            if (e)
                drop_entry_ex(s, e, 2);
            dent_free(kvt__kmap_ptr(&s->disk, x->key));
            kvt__kmap_del(&s->disk, x->key);
        } else if (x->type == 'b') {
            st_block *b = kvt__kmap_ptr(&s->blocks, x->key);
            if (b) {
                for (st_entry *e = s->head, *nx; e; e = nx) {
                    nx = e->next;
                    for (int32_t k = 0; k < e->n_blocks; k++)
                        if (kvt__key_eq(e->blocks[k], x->key)) {
                            drop_entry_ex(s, e, 2);
                            break;
                        }
                }
                if ((b = kvt__kmap_ptr(&s->blocks, x->key))) {
                    s->st.blocks--;
                    kvt__kmap_del(&s->blocks, x->key);
                    kvt__free(b);
                }
            }
        }
        for (int32_t k = 0; k < s->n_orphans; k++)
            if (!strcmp(s->orphans[k].name, x->name)) {
                s->orphans[k] = s->orphans[--s->n_orphans];
                break;
            }
    }
    s->own_bytes = own;
    s->foreign_bytes = foreign;
    s->foreign_scan_ms = foreign_ms;
    s->disk_ms = now;
    s->st.evicted += evicted;
    s->st.evicted_foreign_files += evicted_foreign;
    pthread_mutex_unlock(&s->mu);
    kvt__kmap_free(&bm);
    kvt__free(fs);
    pthread_mutex_unlock(&s->disk_mu);
    close(lfd); /* releases the lock */
}

/* Takes the shared lock a put holds while it relies on existing blocks;
 * -1 when the lock file cannot be opened (the put goes on unprotected). */
static int put_lock(kvt_store *s)
{
    int fd = openat(s->dirfd, KVT__BUDGET_LOCK, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0 && flock(fd, LOCK_SH)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* ---- put ------------------------------------------------------------------------ */

typedef struct brange {
    int64_t b, e;
    int chained;
    int32_t idx;   /* index in the chain */
} brange;

static int cmp_range(const void *a, const void *b)
{
    const brange *x = a, *y = b;
    if (x->b != y->b)
        return x->b < y->b ? -1 : 1;
    return (x->e > y->e) - (x->e < y->e);
}

static int find_range(const brange *r, int32_t n, int64_t b, int64_t e)
{
    for (int32_t i = 0; i < n; i++)
        if (r[i].b == b && r[i].e == e)
            return i;
    return -1;
}

static int fsync_dir(kvt_store *s)
{
    int (*fs)(void *, int) = s->opts.io && s->opts.io->fsync_fn ? s->opts.io->fsync_fn : NULL;
    int r = fs ? fs(s->opts.io->ctx, s->dirfd) : fsync(s->dirfd);
    if (r)
        return kvt__fail(-(errno ? errno : EIO), "%s: directory fsync failed: %s", s->dir, strerror(errno));
    return 0;
}

static json_t *meta_base(kvt_store *s, const char *type, const char *ns)
{
    return json_pack("{s:s, s:s, s:s}", "type", type, "identity", s->identity, "ns", ns);
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

static int st_out_set(kvt__st_out *o, int32_t layer, const kvt_tensor *t)
{
    snprintf(o->name, sizeof o->name, "L%d.%s", (int)layer, t->name);
    o->dtype = t->dtype;
    o->ndim = t->ndim;
    memcpy(o->shape, t->shape, sizeof o->shape);
    o->data = t->data;
    o->bytes = t->bytes;
    return 0;
}

/* The first (shortest) entry a new trimmable entry of reach min_reach
 * supersedes: a strict prefix of it in its ns, non-empty, at least
 * min_reach long (it can be served by cutting the new one back). */
typedef struct sup_ctx {
    int64_t min_reach;
    st_entry *found;
} sup_ctx;

static void supersede_pick(void *val, int64_t depth, void *ctx)
{
    sup_ctx *c = ctx;
    st_entry *old = val;
    if (!c->found && old->n_tokens > 0 && old->n_tokens >= c->min_reach)
        c->found = old;
}

/* Drops every entry the new one supersedes (call with mu held). One walk
 * of the prompt per dropped entry: no allocation and no cap on how many. */
static void supersede(kvt_store *s, const char *ns, const int32_t *tokens, int64_t n, int64_t min_reach)
{
    for (;;) {
        sup_ctx c = {min_reach, NULL};
        kvt__index_prefixes(s->tree, ns, tokens, n, supersede_pick, &c);
        if (!c.found)
            return;
        drop_entry(s, c.found);
        s->st.superseded++;
    }
}

static int do_put(kvt_store *s, const kvt_entry *e, uint64_t want_id)
{
    int rc = 0;
    const int32_t L = e->n_caches, A = e->n_attachments;
    int64_t n = e->n_tokens;
    kvt_cache_state *st = kvt__calloc((size_t)(L ? L : 1), sizeof *st);
    brange *rg = NULL;
    int32_t n_rg = 0, n_chain = 0;
    kvt__key *keys = NULL;
    int8_t *pinned = NULL;
    kvt__st_out *outs = NULL;
    kvt__pending_shard *win = kvt__calloc(KVT__WINDOW, sizeof *win);
    json_t *meta = NULL;
    const char *ns = e->ns;
    kvt__key ekey = kvt__entry_key(s->id_seed, ns, e->tokens, n);
    int64_t min_reach = A ? n : 0;
    uint64_t write_bytes = 0;
    int lockfd = -1;
    if (!st || !win) {
        kvt__free(st);
        kvt__free(win);
        return kvt__fail(KVT_ENOMEM, "store put: out of memory");
    }

    /* 1. encode every layer; collect block ranges */
    size_t n_tensors = 0;
    for (int32_t l = 0; l < L; l++) {
        if ((rc = kvt_cache_encode(e->caches[l], &st[l])))
            goto out;
        if (st[l].offset != n) {
            rc = kvt__fail(KVT_EINVAL, "store put: layer %d holds %lld tokens, the entry %lld", (int)l,
                           (long long)st[l].offset, (long long)n);
            goto out;
        }
        min_reach = KVT__MAX(min_reach, st[l].min_offset);
        n_tensors += (size_t)st[l].n_tensors;
    }
    for (int32_t a = 0; a < A; a++)
        if (!e->attachments[a] || !e->attachments[a]->ops->serialize) {
            rc = kvt__fail(KVT_EUNSUPPORTED, "store put: attachment %d (%s) cannot be serialized", (int)a,
                           e->attachments[a] ? e->attachments[a]->name : "NULL");
            goto out;
        }
    rg = kvt__calloc(n_tensors ? n_tensors : 1, sizeof *rg);
    outs = kvt__calloc(n_tensors + (size_t)A + 1, sizeof *outs);
    if (!rg || !outs) {
        rc = kvt__fail(KVT_ENOMEM, "store put: out of memory");
        goto out;
    }
    for (int32_t l = 0; l < L; l++)
        for (int32_t t = 0; t < st[l].n_tensors; t++) {
            const kvt_tensor *x = &st[l].tensors[t];
            write_bytes += x->bytes;
            if (x->tok_begin < 0 || x->tok_end <= x->tok_begin || x->tok_end > n)
                continue;
            if (find_range(rg, n_rg, x->tok_begin, x->tok_end) < 0)
                rg[n_rg++] = (brange){x->tok_begin, x->tok_end, 0, -1};
        }
    qsort(rg, (size_t)n_rg, sizeof *rg, cmp_range);
    int64_t at = 0;
    for (int32_t i = 0; i < n_rg; i++)
        if (rg[i].b == at) {
            rg[i].chained = 1;
            rg[i].idx = n_chain++;
            at = rg[i].e;
        }
    if (s->opts.max_bytes && write_bytes > s->opts.max_bytes) {
        rc = kvt__fail(KVT_ETOOBIG, "store put: %llu bytes of state, the budget is %llu",
                       (unsigned long long)write_bytes, (unsigned long long)s->opts.max_bytes);
        goto out;
    }
    keys = kvt__calloc((size_t)(n_chain ? n_chain : 1), sizeof *keys);
    pinned = kvt__calloc((size_t)(n_chain ? n_chain : 1), 1);
    if (!keys || !pinned) {
        rc = kvt__fail(KVT_ENOMEM, "store put: out of memory");
        goto out;
    }
    kvt__key parent = KVT__KEY_ZERO;
    for (int32_t i = 0, c = 0; i < n_rg; i++) {
        if (!rg[i].chained)
            continue;
        keys[c] = kvt__block_key(s->id_seed, ns, parent, e->tokens + rg[i].b, rg[i].e - rg[i].b);
        parent = keys[c++];
    }

    /* 2. already durable? pin the blocks that exist. From here until the
     * entry is renamed the put holds the shared budget lock: no reclaim of
     * any process deletes a block it relies on; and what the index says
     * exists is checked on disk (another process may have removed it). */
    lockfd = put_lock(s);
    char ename[64];
    file_name('e', ekey, ename);
    struct stat est;
    int e_on_disk = fstatat(s->dirfd, ename, &est, AT_SYMLINK_NOFOLLOW) == 0;
    pthread_mutex_lock(&s->mu);
    st_entry *have = kvt__kmap_ptr(&s->by_key, ekey);
    if (have && !e_on_disk) {
        drop_entry_ex(s, have, 2); /* removed behind our back: write it again */
        have = NULL;
    }
    if (have) {
        have->last_use_ms = wall_ms(); /* written again: recently used */
        s->st.skipped++;
        pthread_mutex_unlock(&s->mu);
        goto out;
    }
    for (int32_t c = 0; c < n_chain; c++) {
        st_block *b = kvt__kmap_ptr(&s->blocks, keys[c]);
        if (b) {
            b->refs++;
            pinned[c] = 1;
        }
    }
    pthread_mutex_unlock(&s->mu);
    for (int32_t c = 0; c < n_chain; c++) {
        char bn[64];
        struct stat bst;
        file_name('b', keys[c], bn);
        int there = pinned[c] && fstatat(s->dirfd, bn, &bst, AT_SYMLINK_NOFOLLOW) == 0;
        pthread_mutex_lock(&s->mu);
        if (pinned[c] && !there) { /* gone from disk: written again below */
            st_block *b = kvt__kmap_ptr(&s->blocks, keys[c]);
            if (b)
                b->refs--;
            pinned[c] = 0;
        } else if (there) {
            s->st.blocks_shared++;
        }
        pthread_mutex_unlock(&s->mu);
    }

    /* 3. write missing blocks: up to KVT__WINDOW temp files written back to
     * back (shard k sealed after shard k+1 is begun, so hashes overlap;
     * writeback started on each), then each fsync'd and renamed */
    int wrote_block = 0;
    int32_t nwin = 0;
    int32_t win_c[KVT__WINDOW];
    for (int32_t i = 0; i <= n_rg; i++) {
        int last = i == n_rg;
        if (!last && (!rg[i].chained || pinned[rg[i].idx]))
            continue;
        if (!last) {
            int32_t c = rg[i].idx, k = 0;
            for (int32_t l = 0; l < L; l++)
                for (int32_t t = 0; t < st[l].n_tensors; t++)
                    if (st[l].tensors[t].tok_begin == rg[i].b && st[l].tensors[t].tok_end == rg[i].e)
                        st_out_set(&outs[k++], l, &st[l].tensors[t]);
            char *toks = kvt__tokens_b64(e->tokens + rg[i].b, rg[i].e - rg[i].b);
            meta = meta_base(s, "block", ns);
            if (!toks || !meta || set_key(meta, "key", keys[c]) ||
                set_key(meta, "parent", c ? keys[c - 1] : KVT__KEY_ZERO) || set_i64(meta, "tok_begin", rg[i].b) ||
                set_i64(meta, "tok_end", rg[i].e) || json_object_set_new(meta, "tokens", json_string(toks))) {
                kvt__free(toks);
                rc = kvt__fail(KVT_ENOMEM, "store put: out of memory");
                goto abort_win;
            }
            kvt__free(toks);
            char name[64];
            file_name('b', keys[c], name);
            rc = kvt__shard_begin(s->dirfd, s->dir, name, meta, outs, k, s->opts.io, &win[nwin]);
            json_decref(meta);
            meta = NULL;
            if (rc)
                goto abort_win;
            win_c[nwin++] = c;
            /* seal the previous shard only now: its hash ran beside this
             * shard's writes (and this shard's hash runs beside the seal) */
            if (nwin > 1 && (rc = kvt__shard_seal(&win[nwin - 2])))
                goto abort_win;
            if (nwin < KVT__WINDOW)
                continue;
        }
        for (int32_t w = 0; w < nwin; w++) {
            int32_t c = win_c[w];
            uint64_t fb = win[w].bytes;
            if ((rc = kvt__shard_commit(&win[w], s->opts.io))) {
                for (int32_t x = w + 1; x < nwin; x++)
                    kvt__shard_abort(&win[x]);
                nwin = 0;
                goto out;
            }
            wrote_block = 1;
            pthread_mutex_lock(&s->mu);
            orphan_forget(s, win[w].final);
            st_block *b = kvt__kmap_ptr(&s->blocks, keys[c]);
            if (b) {
                b->refs++;
            } else if ((b = kvt__calloc(1, sizeof *b)) && !kvt__kmap_put_ptr(&s->blocks, keys[c], b)) {
                b->key = keys[c];
                b->bytes = fb;
                b->refs = 1;
                s->own_bytes += fb;
                s->st.blocks++;
            } else {
                kvt__free(b);
                pthread_mutex_unlock(&s->mu);
                char name[64];
                file_name('b', keys[c], name);
                unlinkat(s->dirfd, name, 0);
                for (int32_t x = w + 1; x < nwin; x++)
                    kvt__shard_abort(&win[x]);
                nwin = 0;
                rc = kvt__fail(KVT_ENOMEM, "store put: out of memory");
                goto out;
            }
            pinned[c] = 1;
            s->st.blocks_written++;
            s->st.bytes_written += fb;
            pthread_mutex_unlock(&s->mu);
        }
        nwin = 0;
    }
    if (wrote_block && (rc = fsync_dir(s)))
        goto out;

    /* 4. the entry shard: local tensors, attachments, layer descriptions */
    {
        json_t *layers = json_array(), *blocks = json_array(), *atts = json_array();
        int32_t k = 0;
        for (int32_t i = 0; i < n_rg; i++)
            if (rg[i].chained) {
                char h[33];
                kvt__key_hex(keys[rg[i].idx], h);
                json_array_append_new(blocks, json_pack("[s,I,I]", h, (json_int_t)rg[i].b, (json_int_t)rg[i].e));
            }
        for (int32_t l = 0; l < L; l++) {
            json_t *params = json_array(), *tens = json_array();
            for (int32_t p = 0; p < st[l].n_params && p < KVT_CACHE_PARAMS_MAX; p++)
                json_array_append_new(params, json_integer(st[l].params[p]));
            for (int32_t t = 0; t < st[l].n_tensors; t++) {
                const kvt_tensor *x = &st[l].tensors[t];
                int r = x->tok_begin >= 0 ? find_range(rg, n_rg, x->tok_begin, x->tok_end) : -1;
                int bidx = r >= 0 && rg[r].chained ? rg[r].idx : -1;
                json_t *shape = json_array();
                for (int32_t d = 0; d < x->ndim; d++)
                    json_array_append_new(shape, json_integer(x->shape[d]));
                json_array_append_new(tens, json_pack("{s:s, s:s, s:o, s:[I,I], s:i}", "name", x->name, "dtype",
                                                      kvt_dtype_name(x->dtype), "shape", shape, "tok",
                                                      (json_int_t)x->tok_begin, (json_int_t)x->tok_end, "block",
                                                      bidx));
                if (bidx < 0)
                    st_out_set(&outs[k++], l, x);
            }
            json_array_append_new(layers, json_pack("{s:s, s:I, s:I, s:o, s:o}", "kind", st[l].kind, "offset",
                                                    (json_int_t)st[l].offset, "min_offset",
                                                    (json_int_t)st[l].min_offset, "params", params, "tensors",
                                                    tens));
        }
        for (int32_t a = 0; a < A; a++) {
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
        char *toks = kvt__tokens_b64(e->tokens, n);
        meta = meta_base(s, "entry", ns);
        int bad_meta = rc || !toks || !meta || !layers || !blocks || !atts || set_key(meta, "key", ekey) ||
                       set_i64(meta, "n_tokens", n) || set_i64(meta, "min_reach", min_reach) ||
                       json_object_set_new(meta, "tokens", json_string(toks)) ||
                       set_dumped(meta, "layers", layers) || set_dumped(meta, "blocks", blocks) ||
                       set_dumped(meta, "attachments", atts);
        json_decref(layers);
        json_decref(blocks);
        json_decref(atts);
        if (bad_meta) {
            kvt__free(toks);
            if (!rc)
                rc = kvt__fail(KVT_ENOMEM, "store put: out of memory");
            goto out;
        }
        kvt__free(toks);
        char name[64];
        uint64_t fb = 0;
        file_name('e', ekey, name);
        if ((rc = kvt__shard_write(s->dirfd, s->dir, name, meta, outs, k, s->opts.io, &fb)))
            goto out;
        if ((rc = fsync_dir(s))) {
            unlinkat(s->dirfd, name, 0);
            goto out;
        }
        /* 5. index it (the pins become the entry's references) */
        st_entry *en = kvt__calloc(1, sizeof *en);
        if (en) {
            en->ns = kvt__strdup(ns);
            en->tokens = kvt__malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
            en->blocks = kvt__malloc(sizeof(kvt__key) * (size_t)(n_chain ? n_chain : 1));
        }
        if (!en || !en->ns || !en->tokens || !en->blocks) {
            entry_free(en);
            unlinkat(s->dirfd, name, 0);
            rc = kvt__fail(KVT_ENOMEM, "store put: out of memory");
            goto out;
        }
        if (n)
            memcpy(en->tokens, e->tokens, sizeof(int32_t) * (size_t)n);
        memcpy(en->blocks, keys, sizeof(kvt__key) * (size_t)n_chain);
        en->n_blocks = n_chain;
        en->key = ekey;
        en->n_tokens = n;
        en->min_reach = min_reach;
        en->bytes = fb;
        en->id = want_id;
        en->last_use_ms = wall_ms();
        /* with its blocks over the whole budget, the entry is not kept (the
         * reclaim below drops it first): it must not supersede the shorter
         * entries that fit */
        uint64_t need = fb;
        for (int32_t c = 0; s->opts.max_bytes && c < n_chain; c++) {
            char bn[64];
            struct stat bst;
            file_name('b', keys[c], bn);
            if (!fstatat(s->dirfd, bn, &bst, AT_SYMLINK_NOFOLLOW))
                need += (uint64_t)bst.st_size;
        }
        int too_big = s->opts.max_bytes && need > s->opts.max_bytes;
        pthread_mutex_lock(&s->mu);
        orphan_forget(s, name);
        st_entry *dup_e = kvt__kmap_ptr(&s->by_key, ekey);
        if (dup_e) { /* a concurrent put of the same entry won: same file */
            entry_free(en);
            s->st.skipped++;
            pthread_mutex_unlock(&s->mu);
            goto out;
        }
        if (index_entry(s, en)) {
            pthread_mutex_unlock(&s->mu);
            entry_free(en);
            unlinkat(s->dirfd, name, 0);
            rc = kvt__fail(KVT_ENOMEM, "store put: out of memory");
            goto out;
        }
        memset(pinned, 0, (size_t)(n_chain ? n_chain : 1)); /* transferred */
        s->st.written++;
        s->st.bytes_written += fb;
        /* supersede: a trimmable entry serves its strict same-ns prefixes */
        if (min_reach < n && A == 0 && !too_big)
            supersede(s, ns, e->tokens, n, min_reach);
        pthread_mutex_unlock(&s->mu);
    }
    goto out;
abort_win:
    for (int32_t x = 0; x < nwin; x++)
        kvt__shard_abort(&win[x]);
out:
    if (pinned) {
        int any = 0;
        for (int32_t c = 0; c < n_chain; c++)
            any |= pinned[c];
        if (any) {
            pthread_mutex_lock(&s->mu);
            for (int32_t c = 0; c < n_chain; c++)
                if (pinned[c])
                    block_unref(s, keys[c], 0);
            pthread_mutex_unlock(&s->mu);
        }
    }
    if (rc) {
        pthread_mutex_lock(&s->mu);
        s->st.failed++;
        pthread_mutex_unlock(&s->mu);
    }
    if (lockfd >= 0)
        close(lockfd); /* the entry is renamed (or the put failed): reclaim may run */
    char err[sizeof s->flush_msg];
    if (rc)
        snprintf(err, sizeof err, "%s", kvt_last_error());
    reclaim(s, ekey, 0);
    if (rc)
        kvt__fail(rc, "%s", err);
    json_decref(meta);
    for (int32_t l = 0; l < L; l++)
        kvt_cache_state_clear(&st[l]);
    kvt__free(st);
    kvt__free(rg);
    kvt__free(keys);
    kvt__free(pinned);
    kvt__free(outs);
    kvt__free(win);
    return rc;
}

/* ---- restore ------------------------------------------------------------------- */

static void free_base(void *ctx, void *data, size_t bytes)
{
    (void)data;
    (void)bytes;
    kvt__free(ctx);
}

typedef struct kvt__map {
    void *base;
    size_t len;
} kvt__map;

static void unmap_release(void *ctx, void *data, size_t bytes)
{
    (void)data;
    (void)bytes;
    kvt__map *m = ctx;
    munmap(m->base, m->len);
    kvt__free(m);
}

/* Maps a shard read-only (MAP_POPULATE reads it in one sequential pass); the
 * buffer's release unmaps it once the last view is gone (DESIGN.md 4). Shards
 * are immutable under their final names (never truncated or rewritten), and
 * an unlinked file stays readable through the mapping. Returns 1 when mapping
 * is not possible (the caller then copies). */
static int map_payload(int fd, const kvt__shard *sh, const char *path, int strict, kvt_buf **out, int *reason)
{
    if (sh->payload_bytes < (64u << 10))
        return 1; /* small: a copy is cheaper than a mapping */
    kvt__map *m = kvt__malloc(sizeof *m);
    if (!m)
        return kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
    uint8_t *p;
    m->len = (size_t)sh->file_bytes;
    m->base = mmap(NULL, m->len, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m->base == MAP_FAILED) {
        kvt__free(m);
        return 1;
    }
    p = (uint8_t *)m->base + sh->payload_off;
    int rc = kvt__shard_check(sh, p, strict, path, reason);
    if (!rc && (rc = kvt_buf_wrap(p, (size_t)sh->payload_bytes, unmap_release, m, out)))
        rc = kvt__fail(KVT_ENOMEM, "%s: out of memory", path);
    if (rc) {
        munmap(m->base, m->len);
        kvt__free(m);
    }
    return rc;
}

/* Reads a shard's payload into an owned buffer (a read-only mapping for large
 * shards, else a 64-byte aligned copy) and checks it before anything can use
 * it: XXH3-128 always, SHA-256 as well when strict (or for a version 1
 * shard, which has no XXH3-128). */
static int read_payload(int fd, const kvt__shard *sh, const char *path, int strict, kvt_buf **out, int *reason)
{
    *out = NULL;
    int mr = map_payload(fd, sh, path, strict, out, reason);
    if (mr != 1)
        return mr;
    size_t n = (size_t)sh->payload_bytes;
    uint8_t *base = kvt__malloc(n + 64);
    if (!base)
        return kvt__fail(KVT_ENOMEM, "%s: cannot allocate %zu bytes", path, n);
    uint8_t *p = base + ((64 - ((uintptr_t)base & 63)) & 63);
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, p + got, n - got, (off_t)(sh->payload_off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int e = r < 0 ? errno : 0;
            kvt__free(base);
            *reason = r < 0 ? KVT_STORE_REFUSED_IO : KVT_STORE_REFUSED_TRUNCATED;
            return kvt__fail(r < 0 ? -e : KVT_EFORMAT, "%s: payload read failed at %zu of %zu bytes", path, got, n);
        }
        got += (size_t)r;
    }
    if (kvt__shard_check(sh, p, strict, path, reason)) {
        kvt__free(base);
        return KVT_ECORRUPT;
    }
    int rc = kvt_buf_wrap(p, n, free_base, base, out);
    if (rc)
        kvt__free(base);
    return rc;
}

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

typedef struct rshard {
    kvt__shard sh;
    kvt_buf *buf;
} rshard;

/* Builds layer l's state from its JSON description and decodes it. */
static int build_layer(const json_t *lj, int32_t l, const rshard *ent, const rshard *blk, int32_t n_blk,
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
        const rshard *src = bi < 0 ? ent : &blk[bi];
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

/* Opens a block shard, validates its header and metadata (identity NULL:
 * the shard's own; the file name must follow from its key) and reads its
 * checked payload into *out. */
static int load_block(int dirfd, const char *dir, const char *name, const char *identity, int strict, rshard *out,
                      pblock *pb, int *reason)
{
    int fd = -1;
    memset(pb, 0, sizeof *pb);
    int rc = open_shard(dirfd, dir, name, &out->sh, &fd, reason);
    if (rc)
        return rc;
    if (!(rc = parse_block(&out->sh, name, identity, pb, reason))) {
        char want[64];
        file_name('b', pb->key, want);
        if (strcmp(want, name))
            rc = bad(reason, KVT_STORE_REFUSED_MALFORMED, name, "file name does not match its key");
    }
    if (!rc)
        rc = read_payload(fd, &out->sh, name, strict, &out->buf, reason);
    close(fd);
    if (rc) {
        kvt__free(pb->tokens);
        pb->tokens = NULL;
    }
    return rc;
}

/* Everything a restore checks, shared by kvt_store_restore and store verify:
 * the entry shard's header and metadata (identity; NULL accepts the shard's
 * own), its key against the file name and (want_tok, want_n; want_n < 0:
 * no index copy to compare), every referenced block (present, its own
 * checks, its key, ns, range and tokens against the entry's), every payload's
 * checksum (XXH3-128; SHA-256 as well when strict), every layer description
 * against the tensors it names, and each layer's decode. On success *out is
 * the kvtier-allocated entry. On failure *reason is the refusal (-1 for a plain miss:
 * the entry file is gone) and bad_shard (64 bytes) names the shard at fault
 * ("" when none is). *bytes receives the shard bytes read. */
static int load_entry(int dirfd, const char *dir, const char *name, const char *identity, const int32_t *want_tok,
                      int64_t want_n, int strict, kvt_entry *out, int *reason, char *bad_shard, uint64_t *bytes)
{
    memset(out, 0, sizeof *out);
    bad_shard[0] = '\0';
    *bytes = 0;
    rshard ent;
    memset(&ent, 0, sizeof ent);
    rshard *blk = NULL;
    pentry pe;
    memset(&pe, 0, sizeof pe);
    int fd = -1, rc;
    int64_t n = 0;
    snprintf(bad_shard, 64, "%s", name);
    if ((rc = open_shard(dirfd, dir, name, &ent.sh, &fd, reason))) {
        if (rc == KVT_ENOTFOUND) {
            *reason = -1; /* evicted meanwhile: a plain miss */
            bad_shard[0] = '\0';
        }
        goto out;
    }
    if ((rc = parse_entry(&ent.sh, name, identity, &pe, reason)))
        goto out;
    n = pe.n_tokens;
    char want[64];
    file_name('e', pe.key, want);
    if (strcmp(want, name)) {
        rc = bad(reason, KVT_STORE_REFUSED_MALFORMED, name, "file name does not match its key");
        goto out;
    }
    if (want_n >= 0 && (pe.n_tokens != want_n || (n && memcmp(pe.tokens, want_tok, sizeof(int32_t) * (size_t)n)))) {
        rc = bad(reason, KVT_STORE_REFUSED_TOKENS, name, "stored tokens differ from the index");
        goto out;
    }
    if ((rc = read_payload(fd, &ent.sh, name, strict, &ent.buf, reason)))
        goto out;
    *bytes += ent.sh.file_bytes;
    close(fd);
    fd = -1;
    blk = kvt__calloc((size_t)(pe.n_blocks ? pe.n_blocks : 1), sizeof *blk);
    if (!blk) {
        rc = kvt__fail(KVT_ENOMEM, "store restore: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < pe.n_blocks; i++) {
        char bname[64];
        file_name('b', pe.blocks[i], bname);
        pblock pb;
        if ((rc = load_block(dirfd, dir, bname, identity, strict, &blk[i], &pb, reason))) {
            if (rc == KVT_ENOTFOUND) {
                *reason = KVT_STORE_REFUSED_MISSING_BLOCK;
                rc = kvt__fail(KVT_EFORMAT, "%s: refused (missing-block): references block %s that is gone", name,
                               bname);
            } else {
                snprintf(bad_shard, 64, "%s", bname);
            }
            goto out;
        }
        int ok = kvt__key_eq(pb.key, pe.blocks[i]) && !strcmp(pb.ns, pe.ns) && pb.tok_begin == pe.ranges[i][0] &&
                 pb.tok_end == pe.ranges[i][1] &&
                 !memcmp(pb.tokens, pe.tokens + pb.tok_begin, sizeof(int32_t) * (size_t)pb.n_tokens);
        kvt__free(pb.tokens);
        if (!ok) {
            rc = bad(reason, KVT_STORE_REFUSED_TOKENS, bname, "block does not match the entry's tokens");
            snprintf(bad_shard, 64, "%s", bname);
            goto out;
        }
        *bytes += blk[i].sh.file_bytes;
    }
    int32_t L = (int32_t)json_array_size(pe.layers), A = (int32_t)json_array_size(pe.atts);
    if ((rc = kvt_entry_init(out, pe.ns, pe.tokens, n, L, A)))
        goto out;
    for (int32_t l = 0; l < L && !rc; l++)
        rc = build_layer(json_array_get(pe.layers, (size_t)l), l, &ent, blk, pe.n_blocks, n, &out->caches[l], name,
                         reason);
    for (int32_t a = 0; a < A && !rc; a++) {
        const char *an = json_string_value(json_object_get(json_array_get(pe.atts, (size_t)a), "name"));
        char tn[16];
        snprintf(tn, sizeof tn, "A%d", (int)a);
        const kvt__st_in *x = tensor_named(&ent.sh, tn);
        if (!an || !x || x->dtype != KVT_DTYPE_U8) {
            rc = bad(reason, KVT_STORE_REFUSED_MALFORMED, name, "an attachment is missing");
            break;
        }
        rc = kvt_attachment_blob(an, (const uint8_t *)kvt_buf_data(ent.buf) + x->begin, (size_t)(x->end - x->begin),
                                 &out->attachments[a]);
    }
out:
    if (fd >= 0)
        close(fd);
    for (int32_t i = 0; blk && i < pe.n_blocks; i++) {
        kvt__shard_free(&blk[i].sh);
        kvt_buf_release(blk[i].buf);
    }
    kvt__free(blk);
    kvt__shard_free(&ent.sh);
    kvt_buf_release(ent.buf);
    pentry_free(&pe);
    if (rc)
        kvt_entry_clear(out);
    if (!rc || rc == KVT_ENOMEM)
        bad_shard[0] = '\0';
    return rc;
}

static int restore_impl(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt, kvt_entry *out,
                        int *reason, char *bad_shard)
{
    uint64_t t0 = kvt_now_ns();
    memset(out, 0, sizeof *out);
    bad_shard[0] = '\0';
    pthread_mutex_lock(&s->mu);
    st_entry *e = kvt__kmap_ptr(&s->by_id, id_key(handle));
    if (!e) {
        pthread_mutex_unlock(&s->mu);
        return kvt__fail(KVT_ENOTFOUND, "store restore: entry %llu is gone", (unsigned long long)handle);
    }
    kvt__key key = e->key;
    int64_t n = e->n_tokens;
    int32_t *itok = kvt__malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (itok && n)
        memcpy(itok, e->tokens, sizeof(int32_t) * (size_t)n);
    pthread_mutex_unlock(&s->mu);
    if (!itok)
        return kvt__fail(KVT_ENOMEM, "store restore: out of memory");
    int64_t cmpn = KVT__MIN(n_prompt, n);
    if (prompt && cmpn && memcmp(prompt, itok, sizeof(int32_t) * (size_t)cmpn)) {
        kvt__free(itok);
        *reason = KVT_STORE_REFUSED_TOKENS;
        return kvt__fail(KVT_ENOTFOUND, "store restore: stored tokens differ from the requested prefix");
    }
    char name[64];
    file_name('e', key, name);
    uint64_t bytes = 0;
    int rc = load_entry(s->dirfd, s->dir, name, s->identity, itok, n, s->opts.verify, out, reason, bad_shard, &bytes);
    kvt__free(itok);
    if (rc)
        return rc;
    if (!s->opts.read_only)
        utimensat(s->dirfd, name, NULL, 0); /* the last use survives a restart (best effort) */
    pthread_mutex_lock(&s->mu);
    if ((e = kvt__kmap_ptr(&s->by_key, key)))
        e->last_use_ms = wall_ms();
    s->st.restores++;
    s->st.restore_bytes += bytes;
    s->st.restore_ns_last = kvt_now_ns() - t0;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* A shard whose payload failed its checksum (call with mu held): its file is
 * removed (not in read-only mode) so no later open or restore reads it
 * again, and it leaves the index; for a block, so does every entry that
 * references it, and their entry files are removed by the next reclaim
 * (which runs under the budget lock, due from here: the caller runs it). */
static void forget_corrupt(kvt_store *s, const char *shard)
{
    kvt__key k;
    char hex[33];
    if (!is_shard_name(shard))
        return;
    memcpy(hex, shard + 1, 32);
    hex[32] = '\0';
    if (kvt__key_parse(hex, &k))
        return;
    if (shard[0] == 'e') {
        st_entry *e = kvt__kmap_ptr(&s->by_key, k);
        if (e)
            drop_entry_ex(s, e, s->opts.read_only);
        else if (!s->opts.read_only)
            unlinkat(s->dirfd, shard, 0);
        return;
    }
    if (!s->opts.read_only) {
        unlinkat(s->dirfd, shard, 0);
        s->reclaim_due = 1;
    }
    st_block *b = kvt__kmap_ptr(&s->blocks, k);
    if (b) {
        s->own_bytes -= KVT__MIN(s->own_bytes, b->bytes);
        s->st.blocks--;
        kvt__kmap_del(&s->blocks, k);
        kvt__free(b);
    }
    for (st_entry *e = s->head, *nx; e; e = nx) {
        nx = e->next;
        for (int32_t i = 0; i < e->n_blocks; i++)
            if (kvt__key_eq(e->blocks[i], k)) {
                drop_entry_ex(s, e, 1);
                break;
            }
    }
}

static void pjob_hook(void *ctx);
static void pjob_release(wjob *j);

/* Restores a handle whose write-behind is still queued or in flight from the
 * job's own caches: zero-copy clones, the hook holding a reference on the
 * job (so whatever its entry's hook releases stays alive until the clones
 * are gone). @return 0; KVT_ENOTFOUND (no such pending job, or its tokens
 * differ from the prompt); KVT_ENOMEM. */
static int restore_pending(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt, kvt_entry *out)
{
    pthread_mutex_lock(&s->mu);
    wjob *j = kvt__kmap_ptr(&s->pjobs, id_key(handle));
    if (j)
        atomic_fetch_add(&j->refs, 1);
    pthread_mutex_unlock(&s->mu);
    if (!j)
        return KVT_ENOTFOUND;
    const kvt_entry *e = &j->e;
    int64_t cmpn = KVT__MIN(n_prompt, e->n_tokens);
    int rc = 0;
    if (prompt && cmpn && memcmp(prompt, e->tokens, sizeof(int32_t) * (size_t)cmpn))
        rc = kvt__fail(KVT_ENOTFOUND, "store restore: pending tokens differ from the requested prefix");
    if (!rc)
        rc = kvt_entry_init(out, e->ns, e->tokens, e->n_tokens, e->n_caches, e->n_attachments);
    if (rc) {
        pjob_release(j);
        return rc;
    }
    out->hook = (kvt_hook){pjob_hook, j}; /* from here kvt_entry_clear releases j */
    for (int32_t l = 0; !rc && l < e->n_caches; l++)
        rc = kvt_cache_clone(e->caches[l], &out->caches[l]);
    for (int32_t a = 0; !rc && a < e->n_attachments; a++)
        rc = e->attachments[a] ? kvt_attachment_clone(e->attachments[a], &out->attachments[a]) : 0;
    if (rc) {
        kvt_entry_clear(out);
        return kvt__fail(rc, "store restore: cannot clone a pending entry: %s", kvt_strerror(rc));
    }
    pthread_mutex_lock(&s->mu);
    s->st.restores++;
    s->st.pending_hits++;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

KVT_API int kvt_store_restore(kvt_store *s, uint64_t handle, const int32_t *prompt, int64_t n_prompt,
                              kvt_entry *out)
{
    if (!s || !out || (n_prompt && !prompt) || n_prompt < 0)
        return kvt__fail(KVT_EINVAL, "kvt_store_restore: bad arguments");
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&s->mu);
    int durable = kvt__kmap_ptr(&s->by_id, id_key(handle)) != NULL;
    pthread_mutex_unlock(&s->mu);
    if (!durable) {
        /* served from the write-behind queue; or, when no job holds the
         * handle, its write may have just become durable under the same
         * handle: the durable path below tries */
        int prc = restore_pending(s, handle, prompt, n_prompt, out);
        if (prc != KVT_ENOTFOUND)
            return prc;
    }
    int reason = -1;
    char bad_shard[64];
    int rc = restore_impl(s, handle, prompt, n_prompt, out, &reason, bad_shard);
    if (rc) {
        pthread_mutex_lock(&s->mu);
        s->st.restore_misses++;
        if (rc != KVT_ENOMEM)
            refuse_count(s, reason);
        if (reason == KVT_STORE_REFUSED_CHECKSUM && bad_shard[0])
            forget_corrupt(s, bad_shard);
        /* A shard that failed validation, or an entry whose file is gone
         * (removed by another process's gc or budget: a plain miss, reason
         * -1), is never offered again (a failed allocation or read says
         * nothing about the shard). */
        if (((reason >= 0 && reason != KVT_STORE_REFUSED_IO) || (reason < 0 && rc == KVT_ENOTFOUND)) &&
            rc != KVT_ENOMEM) {
            st_entry *e = kvt__kmap_ptr(&s->by_id, id_key(handle));
            if (e)
                drop_entry_ex(s, e, 1);
        }
        pthread_mutex_unlock(&s->mu);
        if (rc == KVT_EFORMAT && reason == KVT_STORE_REFUSED_TOKENS)
            rc = KVT_ENOTFOUND;
        char err[256];
        snprintf(err, sizeof err, "%s", kvt_last_error());
        reclaim(s, KVT__KEY_ZERO, 0); /* blocks only the dropped entry used */
        kvt__fail(rc, "%s", err);
    }
    return rc;
}

/* ---- lookups --------------------------------------------------------------------- */

KVT_API int kvt_store_find(kvt_store *s, const int32_t *prompt, int64_t n_prompt, const char *ns,
                           kvt_cold_hit *hit)
{
    ns = kvt__ns(ns);
    if (!s || !hit || n_prompt < 0 || (n_prompt && !prompt))
        return kvt__fail(KVT_EINVAL, "kvt_store_find: bad arguments");
    pthread_mutex_lock(&s->mu);
    void *r, *pr;
    int64_t p = kvt__index_lookup(s->tree, ns, prompt, n_prompt, &r);
    int64_t pp = kvt__index_lookup(s->ptree, ns, prompt, n_prompt, &pr);
    if (pr && (!r || pp > p)) { /* a longer prefix still in the write-behind queue */
        wjob *j = pr;
        hit->prefix_len = pp;
        hit->n_tokens = j->e.n_tokens;
        hit->handle = j->id;
    } else if (r) {
        st_entry *e = r;
        hit->prefix_len = p;
        hit->n_tokens = e->n_tokens;
        hit->handle = e->id;
    }
    pthread_mutex_unlock(&s->mu);
    return r || pr ? 0 : KVT_ENOTFOUND;
}

KVT_API int kvt_store_find_exact(kvt_store *s, const int32_t *tokens, int64_t n_tokens, const char *ns,
                                 kvt_cold_hit *hit)
{
    ns = kvt__ns(ns);
    if (!s || !hit || n_tokens < 0 || (n_tokens && !tokens))
        return kvt__fail(KVT_EINVAL, "kvt_store_find_exact: bad arguments");
    pthread_mutex_lock(&s->mu);
    st_entry *r = kvt__index_exact(s->tree, ns, tokens, n_tokens);
    wjob *pr = r ? NULL : kvt__index_exact(s->ptree, ns, tokens, n_tokens);
    if (r || pr) {
        hit->prefix_len = n_tokens;
        hit->n_tokens = n_tokens;
        hit->handle = r ? r->id : pr->id;
    }
    pthread_mutex_unlock(&s->mu);
    return r || pr ? 0 : KVT_ENOTFOUND;
}

KVT_API int kvt_store_pending(kvt_store *s, const int32_t *tokens, int64_t n_tokens, const char *ns)
{
    ns = kvt__ns(ns);
    if (!s || n_tokens < 0 || (n_tokens && !tokens))
        return 0;
    kvt__key k = kvt__entry_key(s->id_seed, ns, tokens, n_tokens);
    pthread_mutex_lock(&s->mu);
    int p = kvt__kmap_ptr(&s->pending, k) != NULL;
    pthread_mutex_unlock(&s->mu);
    return p;
}

KVT_API int kvt_store_contains(kvt_store *s, const int32_t *tokens, int64_t n_tokens, const char *ns)
{
    ns = kvt__ns(ns);
    if (!s || n_tokens < 0 || (n_tokens && !tokens))
        return 0;
    kvt__key k = kvt__entry_key(s->id_seed, ns, tokens, n_tokens);
    pthread_mutex_lock(&s->mu);
    int have = kvt__kmap_ptr(&s->by_key, k) != NULL;
    pthread_mutex_unlock(&s->mu);
    return have;
}

/* ---- writes ---------------------------------------------------------------------- */

static int check_entry(const kvt_entry *e, const char *fn)
{
    if (!e || !e->ns || e->n_tokens < 0 || (e->n_tokens && !e->tokens) || e->n_caches < 0 ||
        (e->n_caches && !e->caches) || e->n_attachments < 0 || (e->n_attachments && !e->attachments))
        return kvt__fail(KVT_EINVAL, "%s: entry is NULL or inconsistent", fn);
    if (!kvt__utf8_valid(e->ns))
        return kvt__fail(KVT_EINVAL, "%s: namespace is not valid UTF-8", fn);
    for (int32_t l = 0; l < e->n_caches; l++)
        if (!e->caches[l])
            return kvt__fail(KVT_EINVAL, "%s: layer %d is NULL", fn, (int)l);
    for (int32_t a = 0; a < e->n_attachments; a++)
        if (e->attachments[a] && !kvt__utf8_valid(e->attachments[a]->name))
            return kvt__fail(KVT_EINVAL, "%s: attachment %d's name is not valid UTF-8", fn, (int)a);
    return 0;
}

/* A write to a read-only store: refused and counted. */
static int refuse_write(kvt_store *s, const char *fn)
{
    pthread_mutex_lock(&s->mu);
    s->st.write_refused++;
    pthread_mutex_unlock(&s->mu);
    return kvt__fail(-EROFS, "%s: %s is open read-only: nothing is written", fn, s->dir);
}

KVT_API int kvt_store_put(kvt_store *s, const kvt_entry *e)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_store_put: store is NULL");
    int rc = check_entry(e, "kvt_store_put");
    if (!rc && s->opts.read_only)
        return refuse_write(s, "kvt_store_put");
    return rc ? rc : do_put(s, e, 0);
}

static uint64_t entry_bytes(const kvt_entry *e)
{
    uint64_t b = 0;
    for (int32_t l = 0; l < e->n_caches; l++)
        b += kvt_cache_bytes(e->caches[l]);
    for (int32_t a = 0; a < e->n_attachments; a++)
        if (e->attachments[a])
            b += kvt_attachment_bytes(e->attachments[a]);
    return b;
}

/* Pending writes per entry key (a count; absent = 0). */
static int pending_add(kvt_store *s, kvt__key k, int delta)
{
    uint64_t *v = kvt__kmap_get(&s->pending, k);
    int64_t c = (v ? (int64_t)*v : 0) + delta;
    if (c <= 0) {
        kvt__kmap_del(&s->pending, k);
        return 0;
    }
    return kvt__kmap_put(&s->pending, k, (uint64_t)c);
}

/* Drops a job from the pending lookups (call with mu held). */
static void pjob_unindex(kvt_store *s, wjob *j)
{
    const kvt_entry *e = &j->e;
    wjob *head = kvt__index_exact(s->ptree, e->ns, e->tokens, e->n_tokens);
    if (head == j) {
        void *was;
        if (j->twin) /* the next older twin takes the node: it exists, nothing is allocated */
            kvt__index_insert(s->ptree, e->ns, e->tokens, e->n_tokens, j->twin,
                              trimmable(e->n_tokens, j->min_reach), j->min_reach, &was);
        else
            kvt__index_remove(s->ptree, e->ns, e->tokens, e->n_tokens);
    } else {
        for (wjob *x = head; x; x = x->twin)
            if (x->twin == j) {
                x->twin = j->twin;
                break;
            }
    }
    j->twin = NULL;
    kvt__kmap_del(&s->pjobs, id_key(j->id));
}

/* Drops one reference to a job; the last clears its entry (caches,
 * attachments, then its hook) and frees it. Needs no store: a clone may
 * outlive it. */
static void pjob_release(wjob *j)
{
    if (atomic_fetch_sub(&j->refs, 1) != 1)
        return;
    kvt_entry_clear(&j->e);
    kvt__free(j);
}

static void pjob_hook(void *ctx) { pjob_release(ctx); }

KVT_API int kvt_store_put_async(kvt_store *s, kvt_entry *e)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_store_put_async: store is NULL");
    int rc = check_entry(e, "kvt_store_put_async");
    if (rc)
        return rc;
    if (s->opts.read_only)
        return refuse_write(s, "kvt_store_put_async");
    wjob *j = kvt__calloc(1, sizeof *j);
    if (!j)
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    j->bytes = entry_bytes(e);
    j->key = kvt__entry_key(s->id_seed, e->ns, e->tokens, e->n_tokens);
    int64_t min_reach = 0;
    kvt_entry_trimmable(e, &min_reach);
    if (e->n_attachments)
        min_reach = e->n_tokens;
    pthread_mutex_lock(&s->mu);
    if (s->closing || (s->st.pending && s->st.pending_bytes + j->bytes > s->opts.queue_max_bytes)) {
        s->st.dropped++;
        int closing = s->closing;
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return closing ? kvt__fail(KVT_ECLOSED, "kvt_store_put_async: the store is closing")
                       : kvt__fail(KVT_EAGAIN, "kvt_store_put_async: the write-behind queue is full");
    }
    j->e = *e;
    j->min_reach = min_reach;
    j->id = ++s->next_id;
    atomic_init(&j->refs, 1);
    if (pending_add(s, j->key, 1)) {
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    }
    if (kvt__kmap_put_ptr(&s->pjobs, id_key(j->id), j) ||
        kvt__index_insert(s->ptree, j->e.ns, j->e.tokens, j->e.n_tokens, j, trimmable(j->e.n_tokens, min_reach),
                          min_reach, (void **)&j->twin)) {
        kvt__kmap_del(&s->pjobs, id_key(j->id));
        pending_add(s, j->key, -1);
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(KVT_ENOMEM, "kvt_store_put_async: out of memory");
    }
    memset(e, 0, sizeof *e);
    if (s->q_tail)
        s->q_tail->next = j;
    else
        s->q_head = j;
    s->q_tail = j;
    s->st.pending++;
    s->st.pending_bytes += j->bytes;
    pthread_cond_signal(&s->q_cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static void *writer_main(void *arg)
{
    kvt_store *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->q_head && !s->closing)
            pthread_cond_wait(&s->q_cv, &s->mu);
        wjob *j = s->q_head;
        if (!j)
            break; /* closing and drained */
        s->q_head = j->next;
        if (!s->q_head)
            s->q_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        int rc = do_put(s, &j->e, j->id);
        kvt__key key = j->key;
        uint64_t bytes = j->bytes;
        char msg[sizeof s->flush_msg];
        if (rc)
            snprintf(msg, sizeof msg, "%s", kvt_last_error());
        pthread_mutex_lock(&s->mu);
        pjob_unindex(s, j);
        pthread_mutex_unlock(&s->mu);
        /* the entry goes now, or with the last clone; before the job stops
         * counting as pending, so a flush returns after it */
        pjob_release(j);
        pthread_mutex_lock(&s->mu);
        if (rc) {
            s->flush_rc = rc;
            memcpy(s->flush_msg, msg, sizeof msg);
        }
        pending_add(s, key, -1);
        s->st.pending--;
        s->st.pending_bytes -= bytes;
        pthread_cond_broadcast(&s->idle_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

KVT_API int kvt_store_flush(kvt_store *s)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_store_flush: store is NULL");
    pthread_mutex_lock(&s->mu);
    while (s->st.pending)
        pthread_cond_wait(&s->idle_cv, &s->mu);
    int rc = s->flush_rc;
    char msg[sizeof s->flush_msg];
    memcpy(msg, s->flush_msg, sizeof msg);
    s->flush_rc = 0;
    pthread_mutex_unlock(&s->mu);
    if (rc)
        return kvt__fail(rc, "store flush: a write-behind write failed: %s", msg);
    return 0;
}

/* ---- async restore ---------------------------------------------------------------- */

static void *restore_main(void *arg)
{
    kvt_store *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->r_head && !s->closing)
            pthread_cond_wait(&s->r_cv, &s->mu);
        rjob *j = s->r_head;
        if (!j)
            break;
        s->r_head = j->next;
        if (!s->r_head)
            s->r_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        rjob job = *j;
        kvt__free(j);
        kvt_entry e;
        int rc = kvt_store_restore(s, job.handle, NULL, 0, &e);
        /* nothing of kvtier's is touched after done returns: the caller may
         * be waiting for it to change the allocator or to close the store */
        job.done(job.arg, rc, rc ? NULL : &e);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

KVT_API int kvt_store_restore_async(kvt_store *s, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    if (!s || !done)
        return kvt__fail(KVT_EINVAL, "kvt_store_restore_async: bad arguments");
    rjob *j = kvt__calloc(1, sizeof *j);
    if (!j)
        return kvt__fail(KVT_ENOMEM, "kvt_store_restore_async: out of memory");
    j->handle = handle;
    j->done = done;
    j->arg = arg;
    pthread_mutex_lock(&s->mu);
    if (s->closing) {
        pthread_mutex_unlock(&s->mu);
        kvt__free(j);
        return kvt__fail(KVT_ECLOSED, "kvt_store_restore_async: the store is closing");
    }
    if (s->r_tail)
        s->r_tail->next = j;
    else
        s->r_head = j;
    s->r_tail = j;
    pthread_cond_signal(&s->r_cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* ---- open / close / stats ------------------------------------------------------------ */

static int write_identity_file(kvt_store *s)
{
    char buf[4 * KVT__ID_MAX];
    int fd = openat(s->dirfd, "IDENTITY", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t r = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (r >= 0 && (size_t)r == strlen(s->identity) + 1 && !memcmp(buf, s->identity, strlen(s->identity)))
            return 0;
    }
    char tmp[64];
    snprintf(tmp, sizeof tmp, KVT__TMP_PREFIX "%ld.IDENTITY", (long)getpid());
    fd = openat(s->dirfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return kvt__fail(-errno, "%s/IDENTITY: %s", s->dir, strerror(errno));
    size_t n = strlen(s->identity);
    int ok = write(fd, s->identity, n) == (ssize_t)n && write(fd, "\n", 1) == 1 && !fsync(fd);
    close(fd);
    if (!ok || renameat(s->dirfd, tmp, s->dirfd, "IDENTITY")) {
        unlinkat(s->dirfd, tmp, 0);
        return kvt__fail(KVT_EIO, "%s/IDENTITY: cannot write", s->dir);
    }
    return 0;
}

/* Counts the shards of directories holding the same model id under another
 * config fingerprint or tokenizer: a model reshaped under the same name. */
static void count_other_configs(kvt_store *s, const kvt_store_identity *id)
{
    DIR *d = opendir(s->root);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!is_identity_dir_name(de->d_name) || !strcmp(de->d_name, s->dir_name))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", s->root, de->d_name);
        int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
        if (dfd < 0)
            continue;
        char *ident = read_small(dfd, "IDENTITY");
        json_t *j = ident ? json_loads(ident, 0, NULL) : NULL;
        const char *model = json_string_value(json_object_get(j, "model"));
        if (model && !strcmp(model, id->model_id)) {
            DIR *dd = fdopendir(dup(dfd));
            struct dirent *fe;
            while (dd && (fe = readdir(dd)))
                if (is_shard_name(fe->d_name))
                    s->st.other_config_shards++;
            if (dd)
                closedir(dd);
        }
        json_decref(j);
        kvt__free(ident);
        close(dfd);
    }
    closedir(d);
}

static void free_block_val(kvt__key k, uint64_t v, void *ctx) { kvt__free((void *)(uintptr_t)v); }
static void free_dent_val(kvt__key k, uint64_t v, void *ctx) { dent_free((void *)(uintptr_t)v); }

static void store_free(kvt_store *s)
{
    for (st_entry *e = s->head, *nx; e; e = nx) {
        nx = e->next;
        entry_free(e);
    }
    kvt__index_destroy(s->tree);
    kvt__index_destroy(s->ptree);
    kvt__kmap_foreach(&s->blocks, free_block_val, NULL);
    kvt__kmap_free(&s->blocks);
    kvt__kmap_free(&s->by_key);
    kvt__kmap_free(&s->by_id);
    kvt__kmap_free(&s->pending);
    kvt__kmap_free(&s->pjobs);
    kvt__kmap_foreach(&s->disk, free_dent_val, NULL);
    kvt__kmap_free(&s->disk);
    kvt__free(s->free_keys);
    pthread_mutex_destroy(&s->disk_mu);
    kvt__free(s->orphans);
    kvt__free(s->rthreads);
    if (s->lockfd >= 0)
        close(s->lockfd);
    if (s->dirfd >= 0)
        close(s->dirfd);
    kvt__free(s->root);
    kvt__free(s->dir);
    kvt__free(s->dir_name);
    kvt__free(s->identity);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->q_cv);
    pthread_cond_destroy(&s->idle_cv);
    pthread_cond_destroy(&s->r_cv);
    kvt__free(s);
}

KVT_API int kvt_store_open(const char *root, const kvt_store_identity *id, const kvt_store_options *opts,
                           kvt_store **out)
{
    if (!out)
        return kvt__fail(KVT_EINVAL, "kvt_store_open: out is NULL");
    *out = NULL;
    if (!root || !id || !id->model_id || !id->config_fingerprint || !id->tokenizer_hash)
        return kvt__fail(KVT_EINVAL, "kvt_store_open: root or an identity field is NULL");
    if (!*root || strlen(root) > 3000)
        return kvt__fail(KVT_EINVAL, "kvt_store_open: the root path is %s",
                         *root ? "over 3000 bytes" : "empty");
    if (strlen(id->model_id) > KVT__ID_MAX || strlen(id->config_fingerprint) > KVT__ID_MAX ||
        strlen(id->tokenizer_hash) > KVT__ID_MAX)
        return kvt__fail(KVT_EINVAL, "kvt_store_open: an identity string is over %d bytes", KVT__ID_MAX);
    if (!kvt__utf8_valid(id->model_id) || !kvt__utf8_valid(id->config_fingerprint) ||
        !kvt__utf8_valid(id->tokenizer_hash))
        return kvt__fail(KVT_EINVAL, "kvt_store_open: an identity string is not valid UTF-8");
    if (opts && (opts->restore_threads < 0 || opts->restore_threads > 16))
        return kvt__fail(KVT_EINVAL, "kvt_store_open: restore_threads %d outside 0..16", opts->restore_threads);
    kvt_store *s = kvt__calloc(1, sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "kvt_store_open: out of memory");
    s->dirfd = s->lockfd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->disk_mu, NULL);
    pthread_cond_init(&s->q_cv, NULL);
    pthread_cond_init(&s->idle_cv, NULL);
    pthread_cond_init(&s->r_cv, NULL);
    if (opts)
        s->opts = *opts;
    if (!s->opts.queue_max_bytes)
        s->opts.queue_max_bytes = KVT__QUEUE_DEFAULT;
    if (!s->opts.restore_threads)
        s->opts.restore_threads = 1;
    s->st.max_bytes = s->opts.max_bytes;
    int rc = 0;
    char hex[65];
    s->identity = identity_json(id);
    s->root = kvt__strdup(root);
    if (!s->identity || !s->root || kvt__index_create(&s->tree) || kvt__index_create(&s->ptree)) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_store_open: out of memory");
        goto fail;
    }
    s->id_seed = kvt__key_seed(s->identity);
    sha256_hex(s->identity, strlen(s->identity), hex);
    hex[32] = '\0';
    s->dir_name = kvt__strdup(hex);
    size_t dl = strlen(root) + 40;
    s->dir = kvt__malloc(dl);
    if (!s->dir_name || !s->dir) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_store_open: out of memory");
        goto fail;
    }
    snprintf(s->dir, dl, "%s/%s", root, hex);
    int ro = s->opts.read_only;
    if (!ro && ((mkdir(root, 0755) && errno != EEXIST) || (mkdir(s->dir, 0755) && errno != EEXIST))) {
        rc = kvt__fail(-errno, "%s: cannot create: %s", s->dir, strerror(errno));
        goto fail;
    }
    struct stat dst;
    if (!lstat(s->dir, &dst) && S_ISLNK(dst.st_mode)) {
        rc = kvt__fail(KVT_EUNSUPPORTED,
                       "%s: the identity directory is a symbolic link; kvtier refuses it (in open, scan, "
                       "inspect, verify and gc alike): replace it with a real directory",
                       s->dir);
        goto fail;
    }
    s->dirfd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (s->dirfd < 0 && !(ro && errno == ENOENT)) {
        rc = kvt__fail(-errno, "%s: cannot open: %s", s->dir, strerror(errno));
        goto fail;
    }
    if (!ro) {
        s->lockfd = openat(s->dirfd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (s->lockfd < 0 || flock(s->lockfd, LOCK_SH)) {
            rc = kvt__fail(-errno, "%s/.lock: %s", s->dir, strerror(errno));
            goto fail;
        }
        if ((rc = write_identity_file(s)))
            goto fail;
    } else if (s->dirfd >= 0) {
        /* read-only: hold the shared lock when .lock can be read (so this
         * directory counts as in use), else go on without it */
        s->lockfd = openat(s->dirfd, ".lock", O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (s->lockfd >= 0 && flock(s->lockfd, LOCK_SH | LOCK_NB)) {
            close(s->lockfd);
            s->lockfd = -1;
        }
    }
    if (s->dirfd >= 0 && (rc = scan(s)))
        goto fail;
    count_other_configs(s, id);
    fdirs f;
    if (!ro && !list_foreign(root, s->dir_name, 0, &f)) {
        s->foreign_bytes = f.bytes;
        fdirs_free(&f);
    }
    reclaim(s, KVT__KEY_ZERO, 0);
    if (pthread_create(&s->writer, NULL, writer_main, s)) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_store_open: cannot start the writer thread");
        goto fail;
    }
    s->writer_started = 1;
    s->rthreads = kvt__calloc((size_t)s->opts.restore_threads, sizeof(pthread_t));
    if (!s->rthreads) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_store_open: out of memory");
        goto fail;
    }
    for (int i = 0; i < s->opts.restore_threads; i++) {
        if (pthread_create(&s->rthreads[i], NULL, restore_main, s)) {
            rc = kvt__fail(KVT_ENOMEM, "kvt_store_open: cannot start a restore thread");
            goto fail;
        }
        s->n_rthreads++;
    }
    *out = s;
    return 0;
fail:
    pthread_mutex_lock(&s->mu);
    s->closing = 1;
    pthread_cond_broadcast(&s->q_cv);
    pthread_cond_broadcast(&s->r_cv);
    pthread_mutex_unlock(&s->mu);
    if (s->writer_started)
        pthread_join(s->writer, NULL);
    for (int i = 0; i < s->n_rthreads; i++)
        pthread_join(s->rthreads[i], NULL);
    store_free(s);
    return rc;
}

KVT_API int kvt_store_close(kvt_store *s)
{
    if (!s)
        return 0;
    int rc = kvt_store_flush(s);
    pthread_mutex_lock(&s->mu);
    s->closing = 1;
    pthread_cond_broadcast(&s->q_cv);
    pthread_cond_broadcast(&s->r_cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->writer, NULL);
    for (int i = 0; i < s->n_rthreads; i++)
        pthread_join(s->rthreads[i], NULL);
    /* the last word on the budget: waits for other processes' puts, so the
     * root ends within max_bytes (plus a shard written meanwhile) */
    reclaim(s, KVT__KEY_ZERO, 1);
    /* anything queued after the flush (raced with close) was written by the
     * writer before it exited; record its failure too */
    if (!rc && s->flush_rc)
        rc = s->flush_rc;
    store_free(s);
    return rc;
}

KVT_API void kvt_store_get_stats(kvt_store *s, kvt_store_stats *out)
{
    if (!s || !out)
        return;
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->bytes = s->own_bytes;
    out->root_bytes = s->own_bytes + s->foreign_bytes;
    out->max_bytes = s->opts.max_bytes;
    pthread_mutex_unlock(&s->mu);
}

KVT_API const char *kvt_store_dir(const kvt_store *s) { return s ? s->dir : NULL; }

/* ---- the cold-tier table ----------------------------------------------------------- */

static int ct_find(void *self, const int32_t *prompt, int64_t n, const char *ns, kvt_cold_hit *out)
{
    return kvt_store_find(self, prompt, n, ns, out);
}
static int ct_find_exact(void *self, const int32_t *tokens, int64_t n, const char *ns, kvt_cold_hit *out)
{
    return kvt_store_find_exact(self, tokens, n, ns, out);
}
static int ct_restore(void *self, uint64_t handle, kvt_entry *out)
{
    return kvt_store_restore(self, handle, NULL, 0, out);
}
static int ct_restore_async(void *self, uint64_t handle, kvt_restore_done_fn done, void *arg)
{
    return kvt_store_restore_async(self, handle, done, arg);
}
static int ct_store(void *self, const kvt_entry *e) { return kvt_store_put(self, e); }
static int ct_spill(void *self, kvt_entry *e) { return kvt_store_put_async(self, e); }
static int ct_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    return kvt_store_pending(self, tokens, n, ns);
}
static int ct_flush(void *self) { return kvt_store_flush(self); }

KVT_API void kvt_store_cold_tier(kvt_store *s, kvt_cold_tier *tier)
{
    if (!tier)
        return;
    *tier = (kvt_cold_tier){.self = s,
                            .find = ct_find,
                            .find_exact = ct_find_exact,
                            .restore = ct_restore,
                            .restore_async = ct_restore_async,
                            .store = ct_store,
                            .spill = ct_spill,
                            .pending = ct_pending,
                            .flush = ct_flush};
}

/* ---- offline: walk and gc ------------------------------------------------------------ */

static char *read_small(int dirfd, const char *name)
{
    int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    char *b = kvt__malloc(8192);
    ssize_t r = b ? read(fd, b, 8191) : -1;
    close(fd);
    if (r < 0) {
        kvt__free(b);
        return NULL;
    }
    while (r > 0 && (b[r - 1] == '\n'))
        r--;
    b[r] = '\0';
    return b;
}

KVT_API int kvt_store_walk(const char *root, int verify, int (*cb)(void *ctx, const kvt_store_shard_info *info),
                           void *ctx)
{
    if (!root || !cb)
        return kvt__fail(KVT_EINVAL, "kvt_store_walk: bad arguments");
    DIR *d = opendir(root);
    if (!d)
        return kvt__fail(-errno, "%s: %s", root, strerror(errno));
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", root, de->d_name);
        if (!is_identity_dir_name(de->d_name))
            continue;
        struct stat lst;
        if (!lstat(path, &lst) && S_ISLNK(lst.st_mode)) {
            /* never followed: reported as refused, like kvt_store_open refuses it */
            kvt_store_shard_info in;
            memset(&in, 0, sizeof in);
            in.dir = de->d_name;
            in.identity = "";
            in.file = "";
            in.type = 'l';
            in.mtime_ms = (int64_t)lst.st_mtim.tv_sec * 1000 + lst.st_mtim.tv_nsec / 1000000;
            in.ns = "";
            in.status = KVT_STORE_REFUSED_SYMLINK + 1;
            rc = cb(ctx, &in);
            continue;
        }
        int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
        if (dfd < 0)
            continue;
        char *ident = read_small(dfd, "IDENTITY");
        if (!ident) {
            close(dfd); /* not a store directory */
            continue;
        }
        DIR *dd = fdopendir(dup(dfd));
        struct dirent *fe;
        while (!rc && dd && (fe = readdir(dd))) {
            struct stat fs;
            const char *nm = fe->d_name;
            if (!strcmp(nm, ".") || !strcmp(nm, "..") || !strcmp(nm, ".lock") || !strcmp(nm, "IDENTITY") ||
                !strcmp(nm, KVT__BUDGET_LOCK))
                continue;
            if (fstatat(dfd, nm, &fs, AT_SYMLINK_NOFOLLOW) || !S_ISREG(fs.st_mode))
                continue;
            kvt_store_shard_info in;
            memset(&in, 0, sizeof in);
            in.dir = de->d_name;
            in.identity = ident ? ident : "";
            in.file = nm;
            in.bytes = (uint64_t)fs.st_size;
            in.mtime_ms = (int64_t)fs.st_mtim.tv_sec * 1000 + fs.st_mtim.tv_nsec / 1000000;
            in.ns = "";
            int is_tmp = !strncmp(nm, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX));
            in.type = is_tmp ? 't' : (nm[0] == 'e' || nm[0] == 'b') ? nm[0] : '?';
            kvt__shard sh;
            memset(&sh, 0, sizeof sh);
            pentry pe;
            memset(&pe, 0, sizeof pe);
            pblock pb;
            memset(&pb, 0, sizeof pb);
            int fd = -1, reason = -1;
            if (in.type == 'e' || in.type == 'b') {
                int r = open_shard(dfd, path, nm, &sh, &fd, &reason);
                if (!r && in.type == 'e') {
                    r = parse_entry(&sh, nm, ident, &pe, &reason);
                    if (!r) {
                        in.ns = pe.ns;
                        in.n_tokens = pe.n_tokens;
                        in.n_layers = (int32_t)json_array_size(pe.layers);
                        in.n_blocks = pe.n_blocks;
                        for (int32_t i = 0; !r && i < pe.n_blocks; i++) {
                            char bn[64];
                            struct stat bs;
                            file_name('b', pe.blocks[i], bn);
                            if (fstatat(dfd, bn, &bs, 0))
                                r = bad(&reason, KVT_STORE_REFUSED_MISSING_BLOCK, nm, "a referenced block is gone");
                        }
                    }
                } else if (!r) {
                    r = parse_block(&sh, nm, ident, &pb, &reason);
                    if (!r) {
                        in.ns = pb.ns;
                        in.n_tokens = pb.n_tokens;
                    }
                }
                in.n_tensors = sh.n;
                if (!r && verify && in.type == 'e') {
                    /* everything a restore checks, by the restore's own code */
                    kvt_entry tmp;
                    char bad_shard[64];
                    uint64_t nb = 0;
                    r = load_entry(dfd, path, nm, ident, NULL, -1, 1, &tmp, &reason, bad_shard, &nb);
                    if (!r)
                        kvt_entry_clear(&tmp);
                    else if (r == KVT_ENOTFOUND)
                        reason = KVT_STORE_REFUSED_IO; /* removed while walking */
                } else if (!r && verify) {
                    rshard rs;
                    pblock pb2;
                    memset(&rs, 0, sizeof rs);
                    r = load_block(dfd, path, nm, ident, 1, &rs, &pb2, &reason);
                    kvt__free(pb2.tokens);
                    kvt__shard_free(&rs.sh);
                    kvt_buf_release(rs.buf);
                }
                in.status = r ? (reason >= 0 ? reason : KVT_STORE_REFUSED_IO) + 1 : 0;
            }
            rc = cb(ctx, &in);
            if (fd >= 0)
                close(fd);
            kvt__free(pb.tokens);
            pentry_free(&pe);
            kvt__shard_free(&sh);
        }
        if (dd)
            closedir(dd);
        kvt__free(ident);
        close(dfd);
    }
    closedir(d);
    return rc;
}

KVT_API int kvt_store_gc(const char *root, uint64_t max_bytes, uint64_t *freed)
{
    if (freed)
        *freed = 0;
    if (!root)
        return kvt__fail(KVT_EINVAL, "kvt_store_gc: root is NULL");
    fdirs f;
    int rc = list_foreign(root, NULL, 1, &f);
    if (rc)
        return kvt__fail(rc, "%s: cannot list: %s", root, kvt_strerror(rc));
    fc_mark_orphans(&f);
    uint64_t total = f.bytes, done = 0;
    /* temp files of dead writers and broken entries (a block is gone)
     * always go */
    for (size_t i = 0; i < f.n_c; i++)
        if ((!strncmp(f.c[i].name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX)) && !pid_alive(f.c[i].name)) ||
            (f.c[i].type == 'e' && f.c[i].broken)) {
            uint64_t b = fc_evict(&f, i);
            done += b;
            total -= KVT__MIN(total, b);
        }
    while (total > max_bytes) {
        ssize_t i = fc_oldest(&f);
        if (i < 0)
            break;
        if (!strncmp(f.c[i].name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX))) {
            f.c[i].name[0] = '\0'; /* a live writer's temp file */
            continue;
        }
        uint64_t b = fc_evict(&f, (size_t)i);
        done += b;
        total -= KVT__MIN(total, b);
    }
    int err = total > max_bytes ? f.unlink_errno : 0;
    fdirs_free(&f);
    if (freed)
        *freed = done;
    if (err)
        return kvt__fail(-err, "%s: still %llu bytes over the budget of %llu: cannot remove a shard: %s",
                         root, (unsigned long long)(total - max_bytes), (unsigned long long)max_bytes,
                         strerror(err));
    return 0;
}
