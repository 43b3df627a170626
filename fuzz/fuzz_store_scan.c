/*
 * fuzz_store_scan.c: the SSD tier's startup scan and restore
 * (kvt_store_open, src/ssd/store.c) over a store directory built from the
 * input: a list of files (fz_record_write: shards named by their own
 * header's key, temporaries of dead writers, misnamed shards, stray files).
 * The store must open, refuse what fails validation under a counted reason,
 * and serve only what it indexed: for every entry shard in the input, find
 * and find_exact of its tokens, then a restore (verified or not, by the
 * first byte) that either fails cleanly or gives caches holding exactly the
 * entry's tokens that pass fz_cache_exercise. `kvtier store verify`'s walk
 * runs over the same root, and no temporary file of a dead writer survives
 * the open.
 */
#include "fuzz_cache_check.h"

#include "internal.h"
#include "kvtier/io.h"
#include "store_internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dirname[64]; /* the identity directory's name under any root */

static const kvt_store_identity g_id = {FZ_STORE_MODEL, FZ_STORE_CONFIG, FZ_STORE_TOKENIZER};

static void setup(void)
{
    if (g_dirname[0])
        return;
    /* One reference to the process's default I/O worker for the whole run:
     * every store an input opens shares its threads, as the stores of a
     * server do, instead of starting and joining them once per input. */
    static kvt_io *worker;
    char root[512];
    kvt_store *s = NULL;
    if (kvt_io_default_acquire(&worker) || fz_mkdtemp(root, sizeof root, "store-id") ||
        kvt_store_open(root, &g_id, NULL, &s))
        abort();
    const char *d = strrchr(kvt_store_dir(s), '/');
    snprintf(g_dirname, sizeof g_dirname, "%s", d + 1);
    kvt_store_close(s);
    fz_rmtree(root);
}

typedef struct want {
    char *ns;
    int32_t *tokens;
    int64_t n;
} want;

/* The name a shard's own header implies, and for an entry its (ns, tokens). */
static void own_name(const uint8_t *p, uint32_t n, char *name, size_t cap, want *w)
{
    snprintf(name, cap, "e%032d%s", 0, KVT__SHARD_SUFFIX);
    char path[64];
    int fd = fz_memfile(p, n, path);
    if (fd < 0)
        return;
    kvt__shard sh;
    int reason;
    if (!kvt__shard_read_header(fd, path, n, &sh, &reason)) {
        const char *type = kvt__meta_str(&sh, "type"), *key = kvt__meta_str(&sh, "key");
        const char *ns = kvt__meta_str(&sh, "ns"), *toks = kvt__meta_str(&sh, "tokens");
        if (type && key && strlen(key) == 32)
            snprintf(name, cap, "%c%s%s", type[0] == 'b' ? 'b' : 'e', key, KVT__SHARD_SUFFIX);
        if (type && !strcmp(type, "entry") && ns && toks && !kvt__tokens_unb64(toks, &w->tokens, &w->n))
            w->ns = strdup(ns);
        kvt__shard_free(&sh);
    }
    close(fd);
}

/* A restored entry: its tokens start with the prompt's first prefix_len,
 * every layer holds all of them. */
static void check_restored(const kvt_entry *e, const char *ns, const int32_t *prompt, const kvt_cold_hit *hit)
{
    FZ_CHECK(e->n_tokens == hit->n_tokens && !strcmp(e->ns, ns) &&
                 !memcmp(e->tokens, prompt, sizeof(int32_t) * (size_t)hit->prefix_len),
             "restored other tokens (%lld, hit %lld)", (long long)e->n_tokens, (long long)hit->n_tokens);
    for (int32_t l = 0; l < e->n_caches; l++) {
        FZ_CHECK(e->caches[l] && kvt_cache_offset(e->caches[l]) == e->n_tokens, "layer %d holds %lld tokens of %lld",
                 (int)l, e->caches[l] ? (long long)kvt_cache_offset(e->caches[l]) : -1LL, (long long)e->n_tokens);
        fz_in none = {NULL, 0};
        fz_cache_exercise(e->caches[l], &none);
    }
    for (int32_t a = 0; a < e->n_attachments; a++)
        FZ_CHECK(e->attachments[a] != NULL, "attachment %d missing", (int)a);
}

static int walk_cb(void *ctx, const kvt_store_shard_info *info)
{
    (void)ctx;
    FZ_CHECK(info->status >= 0 && info->status <= KVT_STORE_REFUSED_COUNT, "walk status %d", info->status);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    fz_in in = {data, size};
    int verify = fz_u8(&in) & 1;
    char root[512], dir[600], path[900];
    if (fz_mkdtemp(root, sizeof root, "store"))
        return 0;
    snprintf(dir, sizeof dir, "%s/%s", root, g_dirname);
    mkdir(dir, 0755);
    want ws[16];
    int nw = 0, n_temp = 0;
    for (int i = 0; i < 32 && in.n; i++) {
        int mode = fz_u8(&in) % 4;
        uint32_t n = fz_u32(&in);
        if (n > in.n)
            n = (uint32_t)in.n;
        const uint8_t *p = fz_take(&in, n);
        char name[128];
        want w = {0};
        if (mode == FZ_NAME_OWN || mode == FZ_NAME_WRONG)
            own_name(p, n, name, sizeof name, &w);
        if (mode == FZ_NAME_TEMP) {
            snprintf(name, sizeof name, "%s999999999.%d", KVT__TMP_PREFIX, i); /* no such pid */
            n_temp++;
        } else if (mode == FZ_NAME_WRONG) {
            name[1] = name[1] == 'f' ? '0' : 'f';
        } else if (mode == FZ_NAME_OTHER) {
            snprintf(name, sizeof name, "notes-%d.txt", i);
        }
        snprintf(path, sizeof path, "%s/%s", dir, name);
        if (fz_write_file(path, p, n) == 0 && w.ns && nw < 16 && mode == FZ_NAME_OWN)
            ws[nw++] = w;
        else {
            free(w.ns);
            kvt__free(w.tokens);
        }
    }
    kvt_store_options o;
    memset(&o, 0, sizeof o);
    o.verify = verify;
    kvt_store *s = NULL;
    int rc = kvt_store_open(root, &g_id, &o, &s);
    FZ_CHECK(rc == 0, "open over a fuzzed directory failed: %s", kvt_last_error());
    kvt_store_stats st;
    kvt_store_get_stats(s, &st);
    FZ_CHECK(st.temp_removed == (uint64_t)n_temp, "%llu of %d dead temporaries removed",
             (unsigned long long)st.temp_removed, n_temp);
    for (int i = 0; i < nw; i++) {
        want *w = &ws[i];
        kvt_cold_hit hit;
        int found_exact = kvt_store_find_exact(s, w->tokens, w->n, w->ns, &hit) == 0;
        if (found_exact) {
            FZ_CHECK(hit.n_tokens == w->n && hit.prefix_len == w->n, "exact hit of %lld tokens for %lld",
                     (long long)hit.n_tokens, (long long)w->n);
            FZ_CHECK(kvt_store_contains(s, w->tokens, w->n, w->ns) == 1, "contains disagrees with find_exact");
        }
        /* the prompt: the entry's tokens and one more */
        int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(w->n + 1));
        if (w->n)
            memcpy(prompt, w->tokens, sizeof(int32_t) * (size_t)w->n);
        prompt[w->n] = 7;
        if (kvt_store_find(s, prompt, w->n + 1, w->ns, &hit) == 0) {
            FZ_CHECK(hit.prefix_len >= 1 && hit.prefix_len <= w->n && hit.prefix_len <= hit.n_tokens,
                     "prefix %lld of an entry of %lld tokens", (long long)hit.prefix_len, (long long)hit.n_tokens);
            kvt_entry e;
            rc = kvt_store_restore(s, hit.handle, prompt, w->n + 1, &e);
            if (!rc) {
                check_restored(&e, w->ns, prompt, &hit);
                kvt_entry_clear(&e);
            } else {
                FZ_CHECK(rc == KVT_ENOTFOUND || rc == KVT_EFORMAT || rc == KVT_ECORRUPT || rc == KVT_EIDENTITY ||
                             rc == KVT_ENOMEM || rc < 0,
                         "restore returned %d: %s", rc, kvt_last_error());
                /* a shard that failed validation is never offered again */
                if (rc == KVT_ENOTFOUND || rc == KVT_EFORMAT || rc == KVT_ECORRUPT || rc == KVT_EIDENTITY) {
                    int again = kvt_store_restore(s, hit.handle, prompt, w->n + 1, &e);
                    FZ_CHECK(again == KVT_ENOTFOUND, "a refused entry restores again (%d)", again);
                }
            }
        }
        free(prompt);
    }
    if (getenv("KVT_FUZZ_VERBOSE")) {
        kvt_store_get_stats(s, &st);
        fprintf(stderr, "fuzz_store_scan: %d entry shards given, %llu entries and %llu blocks indexed, %llu restores, "
                        "%llu misses, refused:", nw, (unsigned long long)st.entries, (unsigned long long)st.blocks,
                (unsigned long long)st.restores, (unsigned long long)st.restore_misses);
        for (int r = 0; r < KVT_STORE_REFUSED_COUNT; r++)
            fprintf(stderr, " %s %llu", kvt_store_refusal_name((kvt_store_refusal)r), (unsigned long long)st.refused[r]);
        fputc('\n', stderr);
    }
    FZ_CHECK(kvt_store_close(s) == 0, "close: %s", kvt_last_error());
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)))
        FZ_CHECK(strncmp(de->d_name, KVT__TMP_PREFIX, strlen(KVT__TMP_PREFIX)), "%s survived the open",
                 de->d_name);
    if (d)
        closedir(d);
    kvt_store_walk(root, 1, walk_cb, NULL);
    for (int i = 0; i < nw; i++) {
        free(ws[i].ns);
        kvt__free(ws[i].tokens);
    }
    fz_rmtree(root);
    return 0;
}
