/*
 * store.c: the SSD tier (kvtier/store.h, DESIGN.md section 4). Owns one
 * identity directory under a root: its index (entries in a radix tree per
 * namespace, content-addressed blocks with reference counts), the startup
 * scan, put (blocks first, then the entry shard, each crash-safe), restore
 * into owned buffers, the write-behind queue (on the I/O worker), the per-layer
 * residency of the index, the byte budget over the whole root, and the
 * kvt_cold_tier table the prompt cache tiers over.
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
#define KVT__LOCK_WAIT_DEFAULT_MS 10000u

KVT_API const char *kvt_store_refusal_name(kvt_store_refusal r)
{
    static const char *const names[KVT_STORE_REFUSED_COUNT] = {
        "truncated", "header-bound", "offsets", "malformed", "identity",
        "checksum", "tokens", "missing-block", "io", "symlink"};
    return (unsigned)r < KVT_STORE_REFUSED_COUNT ? names[r] : "unknown";
}

void kvt__store_file_name(char type, kvt__key k, char out[64])
{
    char hex[33];
    kvt__key_hex(k, hex);
    snprintf(out, 64, "%c%s" KVT__SHARD_SUFFIX, type, hex);
}

int kvt__store_check_name(char type, kvt__key k, const char *name, int *reason)
{
    char want[64];
    kvt__store_file_name(type, k, want);
    return strcmp(want, name) ? kvt__store_refuse(reason, KVT_STORE_REFUSED_MALFORMED, name,
                                                  "file name does not match its key")
                              : 0;
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

void kvt__store_entry_free(st_entry *e)
{
    if (!e)
        return;
    kvt__free(e->ns);
    kvt__free(e->tokens);
    kvt__free(e->blocks);
    kvt__free(e->lbytes);
    kvt__free(e);
}

/* ---- per-layer residency ------------------------------------------------------------ */

/* The layer of a tensor named "L<layer>.<name>" (the codec's layer tensors),
 * -1 for another name or a layer index past KVT__STORE_LAYERS_MAX (names
 * come from files: never trusted to size anything). */
static int32_t tensor_layer(const char *name)
{
    if (!name || name[0] != 'L' || name[1] < '0' || name[1] > '9')
        return -1;
    int64_t v = 0;
    const char *p = name + 1;
    for (; *p >= '0' && *p <= '9'; p++) {
        v = v * 10 + (*p - '0');
        if (v >= KVT__STORE_LAYERS_MAX)
            return -1;
    }
    return *p == '.' ? (int32_t)v : -1;
}

/* Adds `bytes` of layer l to the growing vector *v (*n long). */
static int lbytes_add(uint64_t **v, int32_t *n, int32_t l, uint64_t bytes)
{
    if (l < 0)
        return 0;
    if (l >= *n) {
        uint64_t *x = kvt__realloc(*v, sizeof *x * (size_t)(l + 1));
        if (!x)
            return KVT_ENOMEM;
        memset(x + *n, 0, sizeof *x * (size_t)(l + 1 - *n));
        *v = x;
        *n = l + 1;
    }
    (*v)[l] += bytes;
    return 0;
}

int kvt__store_lbytes_out(const kvt__st_out *t, int32_t n, uint64_t **out, int32_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    for (int32_t i = 0; i < n; i++)
        if (lbytes_add(out, n_out, tensor_layer(t[i].name), (uint64_t)t[i].bytes)) {
            kvt__free(*out);
            *out = NULL;
            *n_out = 0;
            return KVT_ENOMEM;
        }
    return 0;
}

int kvt__store_lbytes_shard(const kvt__shard *sh, uint64_t **out, int32_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    for (int32_t i = 0; i < sh->n; i++)
        if (lbytes_add(out, n_out, tensor_layer(sh->t[i].name), sh->t[i].end - sh->t[i].begin)) {
            kvt__free(*out);
            *out = NULL;
            *n_out = 0;
            return KVT_ENOMEM;
        }
    return 0;
}

void kvt__store_lbytes_account(kvt_store *s, const uint64_t *v, int32_t n, int sign)
{
    if (!v || n <= 0)
        return;
    if (sign > 0 && n > s->n_layer_bytes) {
        uint64_t *x = kvt__realloc(s->layer_bytes, sizeof *x * (size_t)n);
        if (x) {
            memset(x + s->n_layer_bytes, 0, sizeof *x * (size_t)(n - s->n_layer_bytes));
            s->layer_bytes = x;
            s->n_layer_bytes = n;
        } /* else the layers past the old length go uncounted (a subtraction clamps at 0) */
    }
    for (int32_t i = 0; i < n && i < s->n_layer_bytes; i++)
        s->layer_bytes[i] = sign > 0 ? s->layer_bytes[i] + v[i] : s->layer_bytes[i] - KVT__MIN(s->layer_bytes[i], v[i]);
}

void kvt__store_block_forget(kvt_store *s, st_block *b)
{
    if (!b)
        return;
    kvt__store_lbytes_account(s, b->lbytes, b->n_lbytes, -1);
    kvt__free(b->lbytes);
    kvt__free(b);
}

KVT_API int kvt_store_layer_bytes(kvt_store *s, int32_t n_layers, uint64_t *bytes)
{
    if (!s || n_layers < 0 || (n_layers > 0 && !bytes))
        return kvt__fail(KVT_EINVAL, "kvt_store_layer_bytes: %s", !s ? "store is NULL" : n_layers < 0 ? "n_layers < 0"
                                                                                                   : "bytes is NULL");
    pthread_mutex_lock(&s->mu);
    for (int32_t i = 0; i < n_layers; i++)
        bytes[i] = i < s->n_layer_bytes ? s->layer_bytes[i] : 0;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void kvt__store_orphan_add(kvt_store *s, const char *name, uint64_t bytes)
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
void kvt__store_orphan_forget(kvt_store *s, const char *name)
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
int kvt__store_index_entry(kvt_store *s, st_entry *e)
{
    if (!e->id || kvt__kmap_ptr(&s->by_id, kvt__store_id_key(e->id)))
        e->id = ++s->next_id;
    void *was;
    if (kvt__index_insert_g(s->tree, e->ns, e->tokens, e->n_tokens, e,
                            kvt__store_trimmable(e->n_tokens, e->min_reach, e->granule), e->min_reach, e->granule, &was))
        return KVT_ENOMEM;
    if (was) { /* same (ns, tokens) under another key: not possible while keys are content keys */
        kvt__index_insert_g(s->tree, e->ns, e->tokens, e->n_tokens, was,
                            kvt__store_trimmable(e->n_tokens, e->min_reach, ((st_entry *)was)->granule), e->min_reach,
                            ((st_entry *)was)->granule, &was); /* puts it back: the node exists, nothing is allocated */
        return kvt__fail(KVT_EINVAL, "store index: two keys for one token sequence");
    }
    if (kvt__kmap_put_ptr(&s->by_key, e->key, e) || kvt__kmap_put_ptr(&s->by_id, kvt__store_id_key(e->id), e)) {
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
    kvt__store_lbytes_account(s, e->lbytes, e->n_lbytes, 1);
    s->st.entries++;
    if (e->n_tokens > s->st.longest_prefix_tokens)
        s->st.longest_prefix_tokens = e->n_tokens;
    return 0;
}

void kvt__store_block_unref(kvt_store *s, kvt__key k, int delete_file)
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
void kvt__store_drop_entry(kvt_store *s, st_entry *e, int keep_file)
{
    kvt__index_remove(s->tree, e->ns, e->tokens, e->n_tokens);
    kvt__kmap_del(&s->by_key, e->key);
    kvt__kmap_del(&s->by_id, kvt__store_id_key(e->id));
    if (e->prev)
        e->prev->next = e->next;
    else
        s->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    char name[64];
    kvt__store_file_name('e', e->key, name);
    if (keep_file == 2)
        s->own_bytes -= KVT__MIN(s->own_bytes, e->bytes);
    else if (keep_file || s->opts.read_only)
        kvt__store_orphan_add(s, name, e->bytes);
    else {
        kvt__io_unlinkat(s->dirfd, name, 0);
        s->own_bytes -= KVT__MIN(s->own_bytes, e->bytes);
    }
    s->st.entries--;
    kvt__store_lbytes_account(s, e->lbytes, e->n_lbytes, -1);
    for (int32_t i = 0; i < e->n_blocks; i++)
        kvt__store_block_unref(s, e->blocks[i], 1);
    int longest = e->n_tokens == s->st.longest_prefix_tokens;
    kvt__store_entry_free(e);
    if (longest)
        recompute_longest(s);
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
    s->finds++;
    s->find_hits += r || pr;
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

KVT_API int kvt_store_list(kvt_store *s, const char *ns, int (*cb)(void *ctx, const kvt_cold_hit *hit), void *ctx)
{
    ns = kvt__ns(ns);
    if (!s || !cb)
        return kvt__fail(KVT_EINVAL, "kvt_store_list: NULL store or callback");
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    for (st_entry *e = s->head; e && !rc; e = e->next)
        if (!strcmp(e->ns, ns))
            rc = cb(ctx, &(kvt_cold_hit){.prefix_len = e->n_tokens, .n_tokens = e->n_tokens, .handle = e->id});
    pthread_mutex_unlock(&s->mu);
    return rc;
}

KVT_API int kvt_store_remove(kvt_store *s, uint64_t handle)
{
    if (!s)
        return kvt__fail(KVT_EINVAL, "kvt_store_remove: NULL store");
    if (s->opts.read_only)
        return kvt__store_refuse_write(s, "kvt_store_remove");
    pthread_mutex_lock(&s->mu);
    st_entry *e = kvt__kmap_ptr(&s->by_id, kvt__store_id_key(handle));
    if (e)
        kvt__store_drop_entry(s, e, 0);
    pthread_mutex_unlock(&s->mu);
    if (!e)
        return kvt__fail(KVT_ENOTFOUND, "kvt_store_remove: no durable entry has handle %llu",
                         (unsigned long long)handle);
    kvt__store_reclaim(s, KVT__KEY_ZERO, 0); /* blocks only the removed entry used */
    return 0;
}

/* ---- open / close / stats ------------------------------------------------------------ */

static int write_identity_file(kvt_store *s)
{
    char buf[4 * KVT__ID_MAX];
    int fd = kvt__io_openat(s->dirfd, "IDENTITY", O_RDONLY | O_CLOEXEC, 0);
    if (fd >= 0) {
        ssize_t r = kvt__io_read(fd, buf, sizeof buf - 1);
        kvt__io_close(fd);
        if (r >= 0 && (size_t)r == strlen(s->identity) + 1 && !memcmp(buf, s->identity, strlen(s->identity)))
            return 0;
    }
    char tmp[64];
    snprintf(tmp, sizeof tmp, KVT__TMP_PREFIX "%ld.IDENTITY", (long)getpid());
    fd = kvt__io_openat(s->dirfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return kvt__fail(-errno, "%s/IDENTITY: %s", s->dir, strerror(errno));
    size_t n = strlen(s->identity);
    int ok = kvt__io_write(fd, s->identity, n) == (ssize_t)n && kvt__io_write(fd, "\n", 1) == 1 && !kvt__io_fsync(fd);
    kvt__io_close(fd);
    if (!ok || kvt__io_renameat(s->dirfd, tmp, s->dirfd, "IDENTITY")) {
        kvt__io_unlinkat(s->dirfd, tmp, 0);
        return kvt__fail(KVT_EIO, "%s/IDENTITY: cannot write", s->dir);
    }
    return 0;
}

/* Takes the shared lock on <dir>/.lock without ever blocking in flock: a
 * non-blocking attempt, retried with a growing pause (1 to 50 ms) until the
 * exclusive holder (gc or another process's budget pass evicting this idle
 * directory, or anything else that locks it) lets go or lock_wait_ms has
 * passed. Open returns in about lock_wait_ms at most, on its own thread. */
static int take_shared_lock(kvt_store *s)
{
    uint64_t wait_ms = s->opts.lock_wait_ms ? s->opts.lock_wait_ms : KVT__LOCK_WAIT_DEFAULT_MS;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint64_t pause_us = 1000;
    for (;;) {
        if (flock(s->lockfd, LOCK_SH | LOCK_NB) == 0)
            return 0;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return kvt__fail(-errno, "%s/.lock: %s", s->dir, strerror(errno));
        clock_gettime(CLOCK_MONOTONIC, &now);
        uint64_t spent_us = (uint64_t)(now.tv_sec - t0.tv_sec) * 1000000u + (uint64_t)(now.tv_nsec / 1000) -
                            (uint64_t)(t0.tv_nsec / 1000);
        if (spent_us >= wait_ms * 1000u)
            return kvt__fail(KVT_EBUSY,
                             "%s/.lock: its lock is held by another process (waited %llu ms); open it "
                             "read-only, or retry once that process is done",
                             s->dir, (unsigned long long)wait_ms);
        uint64_t left_us = wait_ms * 1000u - spent_us;
        uint64_t us = pause_us < left_us ? pause_us : left_us;
        struct timespec ts = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000L};
        nanosleep(&ts, NULL);
        if (pause_us < 50000)
            pause_us *= 2;
    }
}

static void free_block_val(kvt__key k, uint64_t v, void *ctx)
{
    st_block *b = (st_block *)(uintptr_t)v;
    kvt__free(b->lbytes);
    kvt__free(b);
}

static void store_free(kvt_store *s)
{
    kvt__store_pool_leave(s);
    for (st_entry *e = s->head, *nx; e; e = nx) {
        nx = e->next;
        kvt__store_entry_free(e);
    }
    kvt__index_destroy(s->tree);
    kvt__index_destroy(s->ptree);
    kvt__kmap_foreach(&s->blocks, free_block_val, NULL);
    kvt__kmap_free(&s->blocks);
    kvt__kmap_free(&s->by_key);
    kvt__kmap_free(&s->by_id);
    kvt__kmap_free(&s->pending);
    kvt__kmap_free(&s->pjobs);
    kvt__free(s->layer_bytes);
    kvt__store_disk_free(s);
    kvt__free(s->free_keys);
    pthread_mutex_destroy(&s->disk_mu);
    pthread_mutex_destroy(&s->evict_mu);
    kvt__free(s->orphans);
    if (s->worker_default)
        kvt_io_default_release(s->worker);
    kvt__store_pins_close(s->pins);
    if (s->lockfd >= 0)
        kvt__io_close(s->lockfd);
    if (s->dirfd >= 0)
        kvt__io_close(s->dirfd);
    kvt__free(s->root);
    kvt__free(s->dir);
    kvt__free(s->dir_name);
    kvt__free(s->identity);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->idle_cv);
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
    if (opts && opts->lock_wait_ms > 86400000u)
        return kvt__fail(KVT_EINVAL, "kvt_store_open: lock_wait_ms %llu is over 86,400,000 (one day)",
                         (unsigned long long)opts->lock_wait_ms);
    kvt_store *s = kvt__calloc(1, sizeof *s);
    if (!s)
        return kvt__fail(KVT_ENOMEM, "kvt_store_open: out of memory");
    s->dirfd = s->lockfd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->disk_mu, NULL);
    pthread_mutex_init(&s->evict_mu, NULL);
    pthread_cond_init(&s->idle_cv, NULL);
    if (opts)
        s->opts = *opts;
    if (!s->opts.queue_max_bytes)
        s->opts.queue_max_bytes = KVT__QUEUE_DEFAULT;
    s->st.max_bytes = s->opts.max_bytes;
    s->root = kvt__strdup(root);
    int rc = s->root ? kvt__store_pool_join(s) : 0; /* refused before anything is created */
    if (rc)
        goto fail;
    char hex[65];
    s->identity = identity_json(id);
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
    s->dirfd = kvt__io_open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (s->dirfd < 0 && !(ro && errno == ENOENT)) {
        rc = kvt__fail(-errno, "%s: cannot open: %s", s->dir, strerror(errno));
        goto fail;
    }
    if (!ro) {
        s->lockfd = kvt__io_openat(s->dirfd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (s->lockfd < 0) {
            rc = kvt__fail(-errno, "%s/.lock: %s", s->dir, strerror(errno));
            goto fail;
        }
        if ((rc = take_shared_lock(s)))
            goto fail;
        if ((rc = write_identity_file(s)))
            goto fail;
    } else if (s->dirfd >= 0) {
        /* read-only: hold the shared lock when .lock can be read (so this
         * directory counts as in use), else go on without it */
        s->lockfd = kvt__io_openat(s->dirfd, ".lock", O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (s->lockfd >= 0 && flock(s->lockfd, LOCK_SH | LOCK_NB)) {
            kvt__io_close(s->lockfd);
            s->lockfd = -1;
        }
    }
    if ((rc = kvt__store_pins_create(s->dirfd, &s->pins)))
        goto fail;
    if (s->dirfd >= 0 && (rc = kvt__store_scan(s)))
        goto fail;
    kvt__store_count_other_configs(s, id);
    uint64_t foreign = 0;
    if (!ro && !kvt__store_foreign_bytes(root, s->dir_name, &foreign))
        s->foreign_bytes = foreign;
    kvt__store_reclaim(s, KVT__KEY_ZERO, 0);
    if ((rc = kvt__store_worker_open(s)))
        goto fail;
    *out = s;
    return 0;
fail:
    store_free(s);
    return rc;
}

KVT_API int kvt_store_close(kvt_store *s)
{
    if (!s)
        return 0;
    int rc = kvt__store_worker_close(s);
    /* the last word on the budget: waits for other processes' puts, so the
     * root ends within max_bytes (plus a shard written meanwhile) */
    kvt__store_reclaim(s, KVT__KEY_ZERO, 1);
    /* anything queued after the flush (raced with close) was written
     * before the worker let go of the store; record its failure too */
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

KVT_API int kvt_store_stats_json(const kvt_store_stats *st, char **out)
{
    if (out)
        *out = NULL;
    if (!st || !out)
        return kvt__fail(KVT_EINVAL, "kvt_store_stats_json: NULL argument");
    json_t *o = json_object(), *ref = json_object();
    int bad = !o || !ref;
#define KVT__STORE_JSON(type, name, kind, metric, help)                                            \
    bad = bad || json_object_set_new(o, #name, json_integer((json_int_t)KVT__MIN((uint64_t)st->name, (uint64_t)INT64_MAX)));
    KVT_STORE_COUNTERS(KVT__STORE_JSON)
#undef KVT__STORE_JSON
    for (int r = 0; !bad && r < KVT_STORE_REFUSED_COUNT; r++)
        bad = json_object_set_new(ref, kvt_store_refusal_name((kvt_store_refusal)r),
                                  json_integer((json_int_t)KVT__MIN(st->refused[r], (uint64_t)INT64_MAX)));
    if (bad)
        json_decref(ref);
    else
        bad = json_object_set_new(o, "refused", ref); /* takes ref, on failure too */
    char *js = bad ? NULL : json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!js)
        return kvt__fail(KVT_ENOMEM, "kvt_store_stats_json: out of memory");
    *out = kvt__strdup(js);
    free(js);
    return *out ? 0 : kvt__fail(KVT_ENOMEM, "kvt_store_stats_json: out of memory");
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
/* A write to a read-only store through the tier table: refused as a
 * read-only tier refuses (KVT_EREADONLY), counted in write_refused. */
static int ct_refuse(kvt_store *s, const char *fn)
{
    (void)kvt__store_refuse_write(s, fn);
    return kvt__fail(KVT_EREADONLY, "%s: %s is open read-only: nothing is written", fn, s->dir);
}
static int ct_store(void *self, const kvt_entry *e)
{
    kvt_store *s = self;
    return s->opts.read_only ? ct_refuse(s, "store tier store") : kvt_store_put(s, e);
}
static int ct_spill(void *self, kvt_entry *e)
{
    kvt_store *s = self;
    return s->opts.read_only ? ct_refuse(s, "store tier spill") : kvt_store_put_async(s, e);
}
static int ct_pending(void *self, const int32_t *tokens, int64_t n, const char *ns)
{
    return kvt_store_pending(self, tokens, n, ns);
}
static int ct_flush(void *self) { return kvt_store_flush(self); }

static int ct_stats(void *self, kvt_tier_stats *out)
{
    kvt_store *s = self;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&s->mu);
    out->finds = s->finds;
    out->find_hits = s->find_hits;
    out->restores = s->st.restores;
    out->restore_failures = s->st.restore_misses;
    out->stores = s->st.written;
    out->write_failures = s->st.failed + s->st.dropped + s->st.write_refused;
    out->behind_failures = s->behind_failed;
    out->behind_dropped = s->behind_dropped;
    out->demotions = s->demoted;
    out->evictions = s->st.evicted;
    out->entries = s->st.entries;
    out->bytes = s->own_bytes;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static int ct_layer_bytes(void *self, int32_t n_layers, uint64_t *bytes)
{
    kvt_store *s = self;
    pthread_mutex_lock(&s->mu);
    for (int32_t i = 0; i < n_layers && i < s->n_layer_bytes; i++)
        bytes[i] += s->layer_bytes[i];
    pthread_mutex_unlock(&s->mu);
    return KVT_LAYER_BYTES_RESIDENT;
}

static void ct_set_evict(void *self, kvt_tier_evict_fn fn, void *arg)
{
    kvt_store *s = self;
    pthread_mutex_lock(&s->evict_mu); /* waits for a call in flight */
    s->evict_fn = fn;
    s->evict_arg = arg;
    pthread_mutex_unlock(&s->evict_mu);
}

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
                            .flush = ct_flush,
                            .stats = ct_stats,
                            .set_evict = ct_set_evict,
                            .layer_bytes = ct_layer_bytes,
                            .flags = s && s->opts.read_only ? KVT_TIER_READ_ONLY : 0};
}

