/*
 * test_publish.c: published prompt caches (kvtier/publish.h; the tier
 * conformance suite runs on the published tier in test_tier_conformance.c).
 * The publication protocol (manifest, CURRENT, keep, readers' locks); one
 * test per refusal reason, each planting its defect in an otherwise good
 * generation and checking both kvt_publish_validate and that the tier keeps
 * serving the previous generation, never a part of the refused one; and
 * readers restoring while a publisher loops, which see one whole
 * generation or the next, never a mix and never a missing file.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "kvtier/publish.h"
#include "store_util.h"
#include "test_seed.h"

static const store_cfg KV = {.n_kv = 2, .kv_dim = 8, .block = 4};
static const kvt_store_identity ID = {"model-a", "cfg-a", "tok-a"};
static const kvt_store_identity OTHER = {"model-b", "cfg-a", "tok-a"};

static void seq(int32_t *t, int64_t n, int32_t base)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = base + (int32_t)i;
}

/* Publishes the entries (tokens base..base+n[i]) under dir; returns the id. */
static void publish(const char *dir, const kvt_store_identity *id, const int32_t *base, const int64_t *n, int count,
                    int keep, char *gen)
{
    kvt_publisher *w;
    assert_int_equal(kvt_publish_begin(dir, id, NULL, &w), 0);
    for (int i = 0; i < count; i++) {
        int32_t tok[64];
        seq(tok, n[i], base[i]);
        kvt_entry e;
        assert_int_equal(store_make_entry(&KV, "", tok, n[i], &e), 0);
        assert_int_equal(kvt_publish_put(w, &e), 0);
        kvt_entry_clear(&e);
    }
    kvt_publish_result res;
    assert_int_equal(kvt_publish_commit(w, keep, &res), 0);
    assert_true(res.entries >= (count > 0) && res.entries <= (uint64_t)count); /* nested entries are superseded */
    assert_true(res.shards > res.entries); /* + IDENTITY */
    if (gen)
        strcpy(gen, res.generation);
}

static int64_t find_len(const kvt_cold_tier *t, int32_t base, int64_t n, kvt_cold_hit *hit)
{
    int32_t p[64];
    seq(p, n, base);
    kvt_cold_hit h = {0};
    int rc = t->find(t->self, p, n, "", &h);
    if (hit)
        *hit = h;
    return rc == 0 ? h.prefix_len : 0;
}

static void expect_restore(const kvt_cold_tier *t, const kvt_cold_hit *h, int32_t base)
{
    int32_t tok[64];
    seq(tok, h->n_tokens, base);
    kvt_entry got, want;
    assert_int_equal(t->restore(t->self, h->handle, &got), 0);
    assert_int_equal(store_make_entry(&KV, "", tok, h->n_tokens, &want), 0);
    assert_int_equal(store_entry_diff(&want, &got), 0);
    kvt_entry_clear(&got);
    kvt_entry_clear(&want);
}

static void path_of(char *out, size_t cap, const char *dir, const char *gen, const char *rel)
{
    snprintf(out, cap, "%s/generations/%s%s%s", dir, gen, rel ? "/" : "", rel ? rel : "");
}

static json_t *manifest_load(const char *dir, const char *gen)
{
    char p[1024];
    path_of(p, sizeof p, dir, gen, "MANIFEST.json");
    json_error_t err;
    json_t *m = json_load_file(p, 0, &err);
    assert_non_null(m);
    return m;
}

static void manifest_save(const char *dir, const char *gen, json_t *m)
{
    char p[1024];
    path_of(p, sizeof p, dir, gen, "MANIFEST.json");
    assert_int_equal(json_dump_file(m, p, JSON_INDENT(1)), 0);
    json_decref(m);
}

/* The manifest entry of the first shard of `type` ("entry", "block"). */
static json_t *shard_of(json_t *m, const char *type)
{
    json_t *a = json_object_get(m, "shards");
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *s = json_array_get(a, i);
        if (!strcmp(json_string_value(json_object_get(s, "type")), type))
            return s;
    }
    fail_msg("no %s shard in the manifest", type);
    return NULL;
}

/* the library's own (internal) SHA-256 of a file */
int kvt__pub_sha256_fd(int fd, char hex[65], uint64_t *bytes);

static void sha256_file(const char *path, char hex[65], uint64_t *bytes)
{
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(kvt__pub_sha256_fd(fd, hex, bytes), 0);
    close(fd);
}

/* Makes the manifest's size and hash of `s` match the file again. */
static void rehash(const char *dir, const char *gen, json_t *s)
{
    char p[1024], hex[65];
    uint64_t n;
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(s, "path")));
    sha256_file(p, hex, &n);
    json_object_set_new(s, "sha256", json_string(hex));
    json_object_set_new(s, "bytes", json_integer((json_int_t)n));
}

static void write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    assert_non_null(a);
    assert_non_null(b);
    char buf[4096];
    size_t r;
    while ((r = fread(buf, 1, sizeof buf, a)) > 0)
        assert_int_equal(fwrite(buf, 1, r, b), r);
    fclose(a);
    assert_int_equal(fclose(b), 0);
}

/* ---- the protocol ------------------------------------------------------------------ */

/* publish, validate (hashes), mount: find/restore; the manifest lists every
 * shard with size, SHA-256 and tokens; CURRENT names the new generation */
static void t_publish_and_mount(void **state)
{
    (void)state;
    char dir[512], gen[KVT_PUBLISH_ID_LEN];
    store_tmpdir(dir, sizeof dir, "pub-basic");
    int32_t base[2] = {100, 100};
    int64_t n[2] = {10, 24}; /* share 2 blocks: stored once */
    int32_t b2[1] = {500};
    int64_t n2[1] = {12};
    publish(dir, &ID, b2, n2, 1, 2, NULL);
    publish(dir, &ID, base, n, 2, 2, gen);
    assert_string_equal(gen, "00000002");

    kvt_publish_report rep;
    kvt_publish_validate_opts vo = {.identity = &ID, .hashes = 1};
    assert_int_equal(kvt_publish_validate(dir, NULL, &vo, &rep), 0);
    assert_int_equal(rep.refusal, KVT_PUBLISH_OK);
    assert_string_equal(rep.generation, gen);
    /* the 10-token entry is a prefix of the 24-token one: superseded */
    assert_int_equal(rep.entries, 1);
    assert_int_equal(rep.blocks, 6);
    assert_int_equal(rep.tokens_max, 24);
    assert_int_equal(rep.shards, 1 + 6 + 1);

    json_t *m = manifest_load(dir, gen);
    json_t *e = shard_of(m, "entry");
    assert_int_equal(json_integer_value(json_object_get(e, "tokens")), 24);
    char p[1024], hex[65];
    uint64_t bytes;
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(e, "path")));
    sha256_file(p, hex, &bytes);
    assert_string_equal(hex, json_string_value(json_object_get(e, "sha256")));
    assert_int_equal(bytes, json_integer_value(json_object_get(e, "bytes")));
    json_decref(m);

    kvt_published *pt;
    kvt_published_options po = {.poll_ms = -1};
    assert_int_equal(kvt_published_open(dir, &ID, &po, &pt), 0);
    kvt_cold_tier t;
    kvt_published_cold_tier(pt, &t);
    assert_int_equal(t.flags, KVT_TIER_READ_ONLY);
    kvt_cold_hit h;
    assert_int_equal(find_len(&t, 100, 30, &h), 24);
    expect_restore(&t, &h, 100);
    assert_int_equal(find_len(&t, 500, 20, NULL), 0); /* only in generation 1 */
    kvt_published_status st;
    kvt_published_get_status(pt, &st);
    assert_string_equal(st.generation, gen);
    assert_int_equal(st.switches, 1);
    assert_int_equal(st.refusals, 0);

    /* another model's tier refuses the generation whole */
    kvt_published *po2;
    assert_int_equal(kvt_published_open(dir, &OTHER, &po, &po2), 0);
    kvt_published_cold_tier(po2, &t);
    assert_int_equal(find_len(&t, 100, 30, NULL), 0);
    kvt_published_get_status(po2, &st);
    assert_int_equal(st.last_refusal, KVT_PUBLISH_REFUSED_IDENTITY);
    assert_string_equal(st.generation, "");
    kvt_published_close(po2);
    kvt_published_close(pt);
    store_rmtree(dir);
}

/* a new publication is picked up by the poll timer without a restart, and a
 * handle found before the switch still restores from its own generation */
static void t_pickup(void **state)
{
    (void)state;
    char dir[512];
    store_tmpdir(dir, sizeof dir, "pub-pickup");
    int32_t b1[1] = {100}, b2[1] = {300};
    int64_t n[1] = {16};
    publish(dir, &ID, b1, n, 1, 2, NULL);
    kvt_published *pt;
    kvt_published_options po = {.poll_ms = 10};
    assert_int_equal(kvt_published_open(dir, &ID, &po, &pt), 0);
    kvt_cold_tier t;
    kvt_published_cold_tier(pt, &t);
    kvt_cold_hit old;
    assert_int_equal(find_len(&t, 100, 20, &old), 16);
    publish(dir, &ID, b2, n, 1, 2, NULL);
    int waited = 0;
    while (find_len(&t, 300, 20, NULL) != 16 && waited < 5000) {
        usleep(10000);
        waited += 10;
    }
    print_message("new generation picked up after ~%d ms (poll every 10 ms)\n", waited);
    assert_true(waited < 5000);
    assert_int_equal(find_len(&t, 100, 20, NULL), 0); /* the new generation only */
    expect_restore(&t, &old, 100);                   /* the old handle: its own generation */
    kvt_tier_stats s;
    assert_int_equal(t.stats(t.self, &s), 0);
    assert_int_equal(s.entries, 1);
    assert_true(s.finds >= 3);
    kvt_published_close(pt);
    store_rmtree(dir);
}

static int count_generations(const char *dir)
{
    char **ids;
    int32_t n;
    assert_int_equal(kvt_publish_list(dir, &ids, &n, NULL), 0);
    kvt_publish_ids_free(ids, n);
    return n;
}

/* --keep: old generations go, except one a reader holds (its shared lock) */
static void t_keep_and_readers(void **state)
{
    (void)state;
    char dir[512], g1[KVT_PUBLISH_ID_LEN], g[KVT_PUBLISH_ID_LEN];
    store_tmpdir(dir, sizeof dir, "pub-keep");
    int32_t b[1] = {100};
    int64_t n[1] = {8};
    publish(dir, &ID, b, n, 1, 1, g1);
    kvt_published *pt;
    kvt_published_options po = {.poll_ms = -1};
    assert_int_equal(kvt_published_open(dir, &ID, &po, &pt), 0); /* holds g1 */
    kvt_publisher *w;
    assert_int_equal(kvt_publish_begin(dir, &ID, NULL, &w), 0);
    kvt_publish_result res;
    assert_int_equal(kvt_publish_commit(w, 1, &res), 0);
    assert_int_equal(res.kept_busy, 1); /* g1 is held */
    assert_int_equal(res.removed, 0);
    assert_int_equal(count_generations(dir), 2);
    kvt_published_close(pt); /* lets go of g1 */
    for (int i = 0; i < 3; i++)
        publish(dir, &ID, b, n, 1, 2, g);
    assert_int_equal(count_generations(dir), 2);
    char p[1024];
    struct stat st;
    path_of(p, sizeof p, dir, g1, NULL);
    assert_int_equal(stat(p, &st), -1);
    /* a generation locked by another open file description is kept */
    char **ids;
    int32_t cnt;
    assert_int_equal(kvt_publish_list(dir, &ids, &cnt, NULL), 0);
    path_of(p, sizeof p, dir, ids[0], NULL);
    kvt_publish_ids_free(ids, cnt);
    int fd = open(p, O_RDONLY | O_DIRECTORY);
    assert_true(fd >= 0);
    assert_int_equal(flock(fd, LOCK_SH), 0);
    publish(dir, &ID, b, n, 1, 1, g);
    assert_int_equal(count_generations(dir), 2);
    close(fd);
    publish(dir, &ID, b, n, 1, 1, g);
    assert_int_equal(count_generations(dir), 1);
    store_rmtree(dir);
}

/* a failed or abandoned publication leaves CURRENT alone, and its staging
 * directory is removed (by abort, or by the next publisher) */
static void t_abort(void **state)
{
    (void)state;
    char dir[512], g1[KVT_PUBLISH_ID_LEN];
    store_tmpdir(dir, sizeof dir, "pub-abort");
    int32_t b[1] = {100};
    int64_t n[1] = {8};
    publish(dir, &ID, b, n, 1, 2, g1);
    kvt_publisher *w;
    assert_int_equal(kvt_publish_begin(dir, &ID, NULL, &w), 0);
    kvt_publish_abort(w);
    assert_int_equal(store_count_files(dir, ".staging-"), 0);
    char p[1024];
    snprintf(p, sizeof p, "%s/.staging-999999-0", dir);
    assert_int_equal(mkdir(p, 0755), 0); /* a dead publisher's */
    publish(dir, &ID, b, n, 1, 2, NULL);
    assert_int_equal(store_count_files(dir, ".staging-"), 0);
    kvt_publish_report rep;
    assert_int_equal(kvt_publish_validate(dir, g1, NULL, &rep), 0);
    store_rmtree(dir);
}

/* ---- one test per refusal ------------------------------------------------------------ */

typedef struct plant {
    const char *name;
    kvt_publish_refusal want;
    int want_rc;
    void (*fn)(const char *dir, const char *gen);
} plant;

static void p_absolute(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    json_object_set_new(shard_of(m, "entry"), "path", json_string("/etc/passwd"));
    manifest_save(dir, gen, m);
}

static void p_dotdot(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    json_t *s = shard_of(m, "entry");
    char p[512];
    snprintf(p, sizeof p, "%s", json_string_value(json_object_get(s, "path")));
    char q[600];
    snprintf(q, sizeof q, "%.32s/../../00000001/%s", p, p);
    json_object_set_new(s, "path", json_string(q));
    manifest_save(dir, gen, m);
}

/* the entry shard becomes a symbolic link to an identical copy outside */
static void p_symlink(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    char p[1024], out[1024];
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(shard_of(m, "entry"), "path")));
    snprintf(out, sizeof out, "%s/outside.safetensors", dir);
    copy_file(p, out);
    assert_int_equal(unlink(p), 0);
    assert_int_equal(symlink(out, p), 0);
    json_decref(m);
}

/* the entry shard's header length says 17 MiB; size and hash updated */
static void p_header_bound(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    json_t *s = shard_of(m, "entry");
    char p[1024];
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(s, "path")));
    int fd = open(p, O_WRONLY);
    assert_true(fd >= 0);
    uint64_t len = (uint64_t)17 << 20;
    unsigned char le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (unsigned char)(len >> (8 * i));
    assert_int_equal(pwrite(fd, le, 8, 0), 8);
    close(fd);
    rehash(dir, gen, s);
    manifest_save(dir, gen, m);
}

/* a shard written under another identity, listed with its true size, hash
 * and tokens */
static void p_identity(const char *dir, const char *gen)
{
    char other[600], og[KVT_PUBLISH_ID_LEN];
    snprintf(other, sizeof other, "%s/other", dir);
    int32_t b[1] = {700};
    int64_t n[1] = {3}; /* shorter than a block: the entry shard alone */
    publish(other, &OTHER, b, n, 1, 1, og);
    json_t *om = manifest_load(other, og);
    json_t *os = shard_of(om, "entry");
    const char *opath = json_string_value(json_object_get(os, "path"));
    json_t *m = manifest_load(dir, gen);
    const char *idir = json_string_value(json_object_get(m, "identity_dir"));
    char from[1024], rel[200], to[1024];
    path_of(from, sizeof from, other, og, opath);
    snprintf(rel, sizeof rel, "%s/%s", idir, strchr(opath, '/') + 1);
    path_of(to, sizeof to, dir, gen, rel);
    copy_file(from, to);
    json_t *s = json_deep_copy(os);
    json_object_set_new(s, "path", json_string(rel));
    json_array_append_new(json_object_get(m, "shards"), s);
    json_decref(om);
    manifest_save(dir, gen, m);
}

static void p_hash(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    char p[1024];
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(shard_of(m, "block"), "path")));
    assert_int_equal(store_flip_byte(p, 1, 0x01), 0);
    json_decref(m);
}

static void p_size(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    char p[1024];
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(shard_of(m, "block"), "path")));
    FILE *f = fopen(p, "ab");
    assert_non_null(f);
    fputc(0, f);
    fclose(f);
    json_decref(m);
}

static void p_tokens(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    json_t *s = shard_of(m, "entry");
    json_object_set_new(s, "tokens", json_integer(json_integer_value(json_object_get(s, "tokens")) + 1));
    manifest_save(dir, gen, m);
}

static void p_current_missing(const char *dir, const char *gen)
{
    (void)gen;
    char p[1024];
    snprintf(p, sizeof p, "%s/CURRENT", dir);
    write_file(p, "00000099\n", 9);
}

static void p_current_garbage(const char *dir, const char *gen)
{
    (void)gen;
    char p[1024];
    snprintf(p, sizeof p, "%s/CURRENT", dir);
    write_file(p, "../../etc\n", 10);
}

static void p_no_manifest(const char *dir, const char *gen)
{
    char p[1024];
    path_of(p, sizeof p, dir, gen, "MANIFEST.json");
    assert_int_equal(unlink(p), 0);
}

static void p_missing_shard(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    char p[1024];
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(shard_of(m, "block"), "path")));
    assert_int_equal(unlink(p), 0);
    json_decref(m);
}

static void p_json(const char *dir, const char *gen)
{
    char p[1024];
    path_of(p, sizeof p, dir, gen, "MANIFEST.json");
    write_file(p, "{\"format\": \"kvtier-published-cache\", ", 37);
}

/* a manifest one byte over KVT_PUBLISH_MAX_MANIFEST (sparse: its size is
 * what is refused, before a byte is read) */
static void p_manifest_bound(const char *dir, const char *gen)
{
    char p[1024];
    path_of(p, sizeof p, dir, gen, "MANIFEST.json");
    assert_int_equal(truncate(p, (off_t)KVT_PUBLISH_MAX_MANIFEST + 1), 0);
}

static void p_unknown_required(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    json_array_append_new(json_object_get(m, "required"), json_string("encryption"));
    json_object_set_new(m, "encryption", json_string("aes-256-gcm"));
    manifest_save(dir, gen, m);
}

static void p_version(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    json_object_set_new(m, "version", json_integer(2));
    manifest_save(dir, gen, m);
}

/* a copy of a block shard under a name the manifest does not list */
static void p_unlisted(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    const char *bp = json_string_value(json_object_get(shard_of(m, "block"), "path"));
    char from[1024], to[1024], rel[200];
    path_of(from, sizeof from, dir, gen, bp);
    snprintf(rel, sizeof rel, "%.32s/bffffffffffffffffffffffffffffffff.safetensors", bp);
    path_of(to, sizeof to, dir, gen, rel);
    copy_file(from, to);
    json_decref(m);
}

/* a block shard whose header JSON is broken (length kept); size and hash updated */
static void p_shard(const char *dir, const char *gen)
{
    json_t *m = manifest_load(dir, gen);
    json_t *s = shard_of(m, "block");
    char p[1024];
    path_of(p, sizeof p, dir, gen, json_string_value(json_object_get(s, "path")));
    int fd = open(p, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, "[[[[", 4, 8), 4);
    close(fd);
    rehash(dir, gen, s);
    manifest_save(dir, gen, m);
}

static const plant PLANTS[] = {
    {"absolute shard path", KVT_PUBLISH_REFUSED_ABSOLUTE_PATH, KVT_EFORMAT, p_absolute},
    {"'..' in a shard path", KVT_PUBLISH_REFUSED_DOTDOT, KVT_EFORMAT, p_dotdot},
    {"shard resolving through a symlink outside", KVT_PUBLISH_REFUSED_SYMLINK, KVT_EFORMAT, p_symlink},
    {"shard header over the fixed maximum", KVT_PUBLISH_REFUSED_HEADER_BOUND, KVT_EFORMAT, p_header_bound},
    {"shard of another identity", KVT_PUBLISH_REFUSED_IDENTITY, KVT_EIDENTITY, p_identity},
    {"SHA-256 differs from the manifest", KVT_PUBLISH_REFUSED_HASH, KVT_ECORRUPT, p_hash},
    {"size differs from the manifest", KVT_PUBLISH_REFUSED_SIZE, KVT_EFORMAT, p_size},
    {"token count differs from the manifest", KVT_PUBLISH_REFUSED_TOKENS, KVT_EFORMAT, p_tokens},
    {"CURRENT names a missing generation", KVT_PUBLISH_REFUSED_MISSING, KVT_EFORMAT, p_current_missing},
    {"CURRENT holds no valid id", KVT_PUBLISH_REFUSED_MISSING, KVT_EFORMAT, p_current_garbage},
    {"partial generation: no manifest", KVT_PUBLISH_REFUSED_PARTIAL, KVT_EFORMAT, p_no_manifest},
    {"partial generation: a listed shard is gone", KVT_PUBLISH_REFUSED_PARTIAL, KVT_EFORMAT, p_missing_shard},
    {"manifest not valid JSON", KVT_PUBLISH_REFUSED_JSON, KVT_EFORMAT, p_json},
    {"manifest over the fixed maximum", KVT_PUBLISH_REFUSED_HEADER_BOUND, KVT_EFORMAT, p_manifest_bound},
    {"manifest with an unknown required field", KVT_PUBLISH_REFUSED_UNKNOWN_REQUIRED, KVT_EFORMAT,
     p_unknown_required},
    {"manifest of another version", KVT_PUBLISH_REFUSED_MALFORMED, KVT_EFORMAT, p_version},
    {"a shard the manifest does not list", KVT_PUBLISH_REFUSED_UNLISTED, KVT_EFORMAT, p_unlisted},
    {"a shard with a broken header", KVT_PUBLISH_REFUSED_SHARD, KVT_EFORMAT, p_shard},
};

/* For each plant: generation 1 (entry A) is mounted; generation 2 (A and B)
 * is published, the defect planted in it, and the tier refreshed: the
 * refusal has its own reason, B is never served (nothing of generation 2 is
 * mounted) and A still is, from generation 1. */
static void t_refusals(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof PLANTS / sizeof PLANTS[0]; i++) {
        const plant *pl = &PLANTS[i];
        char dir[512], g1[KVT_PUBLISH_ID_LEN], g2[KVT_PUBLISH_ID_LEN];
        store_tmpdir(dir, sizeof dir, "pub-refuse");
        int32_t a[1] = {100}, ab[2] = {100, 300};
        int64_t na[1] = {16}, nab[2] = {16, 12};
        publish(dir, &ID, a, na, 1, 3, g1);
        kvt_published *pt;
        kvt_published_options po = {.poll_ms = -1};
        assert_int_equal(kvt_published_open(dir, &ID, &po, &pt), 0);
        kvt_cold_tier t;
        kvt_published_cold_tier(pt, &t);
        assert_int_equal(find_len(&t, 100, 20, NULL), 16);

        publish(dir, &ID, ab, nab, 2, 3, g2);
        pl->fn(dir, g2);
        kvt_publish_report rep;
        kvt_publish_validate_opts vo = {.identity = &ID, .hashes = 1};
        int rc = kvt_publish_validate(dir, NULL, &vo, &rep);
        print_message("%-44s -> %s: %s\n", pl->name, kvt_publish_refusal_name(rep.refusal), rep.detail);
        assert_int_equal(rc, pl->want_rc);
        assert_int_equal(rep.refusal, pl->want);

        assert_int_equal(kvt_published_refresh(pt), pl->want_rc);
        kvt_published_status st;
        kvt_published_get_status(pt, &st);
        assert_int_equal(st.last_refusal, pl->want);
        assert_int_equal(st.refused[pl->want], 1);
        assert_string_equal(st.generation, g1); /* the previous one stays */
        assert_int_equal(find_len(&t, 300, 20, NULL), 0);
        kvt_cold_hit h;
        assert_int_equal(find_len(&t, 100, 20, &h), 16);
        expect_restore(&t, &h, 100);
        /* not retried until CURRENT changes */
        assert_int_equal(kvt_published_refresh(pt), pl->want_rc);
        kvt_published_get_status(pt, &st);
        assert_int_equal(st.refusals, 1);
        kvt_published_close(pt);
        store_rmtree(dir);
    }
}

/* ---- readers during a publish loop ------------------------------------------------- */

enum { LOOP_GENS = 12, READERS = 2 };
static const int32_t LOOP_BASE = 1000;

/* generation k holds one entry of 8 + 4 (k % 4) tokens */
static int64_t loop_len(int k) { return 8 + 4 * (k % 4); }

typedef struct reader_arg {
    const char *dir;
    volatile int *done;
    int64_t reads, wrong, errors, stale, last_len_changes;
} reader_arg;

static void *reader_main(void *arg)
{
    reader_arg *r = arg;
    kvt_published *pt;
    kvt_published_options po = {.poll_ms = 3};
    if (kvt_published_open(r->dir, &ID, &po, &pt)) {
        r->errors++;
        return NULL;
    }
    kvt_cold_tier t;
    kvt_published_cold_tier(pt, &t);
    int64_t last = -1;
    while (!__atomic_load_n(r->done, __ATOMIC_ACQUIRE)) {
        int32_t p[40];
        seq(p, 40, LOOP_BASE);
        kvt_cold_hit h;
        if (t.find(t.self, p, 40, "", &h))
            continue; /* nothing mounted yet */
        kvt_entry got;
        int rc = t.restore(t.self, h.handle, &got);
        if (rc == KVT_ENOTFOUND) {
            r->stale++; /* two switches between find and restore: a miss, never wrong */
            continue;
        }
        if (rc) {
            r->errors++;
            continue;
        }
        r->reads++;
        kvt_entry want;
        int ok = got.n_tokens == h.n_tokens && h.prefix_len == h.n_tokens;
        int known = 0;
        for (int k = 0; k < 4; k++)
            known |= got.n_tokens == loop_len(k);
        if (ok && known && !store_make_entry(&KV, "", p, got.n_tokens, &want)) {
            ok = store_entry_diff(&want, &got) == 0;
            kvt_entry_clear(&want);
        } else
            ok = 0;
        r->wrong += !ok;
        r->last_len_changes += got.n_tokens != last;
        last = got.n_tokens;
        kvt_entry_clear(&got);
    }
    kvt_published_status st;
    kvt_published_get_status(pt, &st);
    r->errors += (int64_t)st.refusals;
    kvt_published_close(pt);
    return NULL;
}

static void t_readers_during_publish(void **state)
{
    (void)state;
    uint64_t seed = test_seed("test_publish readers");
    srand((unsigned)seed);
    char dir[512];
    store_tmpdir(dir, sizeof dir, "pub-loop");
    volatile int done = 0;
    reader_arg ra[READERS];
    pthread_t th[READERS];
    for (int i = 0; i < READERS; i++) {
        ra[i] = (reader_arg){.dir = dir, .done = &done};
        assert_int_equal(pthread_create(&th[i], NULL, reader_main, &ra[i]), 0);
    }
    uint64_t kept_busy = 0;
    for (int k = 0; k < LOOP_GENS; k++) {
        int32_t b[1] = {LOOP_BASE};
        int64_t n[1] = {loop_len(k)};
        kvt_publisher *w;
        assert_int_equal(kvt_publish_begin(dir, &ID, NULL, &w), 0);
        int32_t tok[64];
        seq(tok, n[0], b[0]);
        kvt_entry e;
        assert_int_equal(store_make_entry(&KV, "", tok, n[0], &e), 0);
        assert_int_equal(kvt_publish_put(w, &e), 0);
        kvt_entry_clear(&e);
        kvt_publish_result res;
        assert_int_equal(kvt_publish_commit(w, 1, &res), 0); /* keep 1: only held ones stay */
        kept_busy += res.kept_busy;
        usleep((useconds_t)(rand() % 20000));
    }
    usleep(50000);
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    int64_t reads = 0, switches_seen = 0;
    for (int i = 0; i < READERS; i++) {
        pthread_join(th[i], NULL);
        print_message("reader %d: %lld restores, %lld wrong, %lld errors, %lld stale handles, %lld length changes\n", i,
                      (long long)ra[i].reads, (long long)ra[i].wrong, (long long)ra[i].errors, (long long)ra[i].stale,
                      (long long)ra[i].last_len_changes);
        assert_int_equal(ra[i].wrong, 0);
        assert_int_equal(ra[i].errors, 0);
        reads += ra[i].reads;
        switches_seen += ra[i].last_len_changes;
    }
    print_message("%d publications (keep 1), %llu removals deferred because a reader held the generation\n",
                  LOOP_GENS, (unsigned long long)kept_busy);
    assert_true(reads > 0);
    assert_true(switches_seen > READERS); /* readers did move over */
    publish(dir, &ID, (int32_t[]){LOOP_BASE}, (int64_t[]){8}, 1, 1, NULL);
    assert_int_equal(count_generations(dir), 1); /* nobody holds the old ones now */
    store_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(t_publish_and_mount),
        cmocka_unit_test(t_pickup),          cmocka_unit_test(t_keep_and_readers),
        cmocka_unit_test(t_abort),           cmocka_unit_test(t_refusals),
        cmocka_unit_test(t_readers_during_publish),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
