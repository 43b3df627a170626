/*
 * fuzz_manifest.c: validation of a published generation
 * (kvt_publish_validate, src/publish/validate.c) over a generation
 * directory built from the input: MANIFEST.json, the identity directory,
 * its shards, other files, directories and symbolic links pointing anywhere
 * (fz_tree_build). The first byte is a mode: bit 0 checks every SHA-256,
 * bit 1 asks for the corpus's identity, bit 2 goes through CURRENT, bit 3
 * also mounts the generation as the read-only tier (kvt_published_open),
 * which must agree with validation.
 * An accepted generation lists only regular files of the listed size inside
 * its identity directory, reached without a symbolic link (and with the
 * listed SHA-256 when hashes are checked); the report's counts agree with
 * what was listed. A refusal names one reason with a sentence and returns
 * that reason's code. Validation never changes the directory.
 */
#include "fuzz_util.h"

#include "internal.h"
#include "publish/publish_internal.h"

#include "kvtier/publish.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const kvt_store_identity g_id = {FZ_STORE_MODEL, FZ_STORE_CONFIG, FZ_STORE_TOKENIZER};

typedef struct seen {
    const char *gpath;
    int hashes;
    uint64_t shards, identities, entries, blocks;
} seen;

static void on_shard(void *ctx, const kvt_publish_shard_info *s)
{
    seen *v = ctx;
    v->shards++;
    v->identities += s->type == 'i';
    v->entries += s->type == 'e';
    v->blocks += s->type == 'b';
    FZ_CHECK(s->type == 'e' || s->type == 'b' || s->type == 'i', "shard type %d", s->type);
    FZ_CHECK(s->path[0] && s->path[0] != '/' && !strstr(s->path, ".."), "accepted shard path %s", s->path);
    /* every component a real directory, the last a regular file */
    char full[4400];
    size_t gl = (size_t)snprintf(full, sizeof full, "%s/", v->gpath);
    for (size_t i = 0;; i++) {
        if (s->path[i] == '/' || !s->path[i]) {
            memcpy(full + gl, s->path, i);
            full[gl + i] = '\0';
            struct stat st;
            FZ_CHECK(lstat(full, &st) == 0, "accepted shard %s: %s is missing", s->path, full);
            FZ_CHECK(!S_ISLNK(st.st_mode), "accepted shard %s goes through the symbolic link %s", s->path, full);
            if (!s->path[i]) {
                FZ_CHECK(S_ISREG(st.st_mode) && (uint64_t)st.st_size == s->bytes,
                         "accepted shard %s: not a regular file of %llu bytes", s->path,
                         (unsigned long long)s->bytes);
                break;
            }
            FZ_CHECK(S_ISDIR(st.st_mode), "accepted shard %s: %s is not a directory", s->path, full);
        }
    }
    FZ_CHECK(s->hash_checked == v->hashes, "shard %s hash_checked %d, hashes %d", s->path, s->hash_checked,
             v->hashes);
    if (v->hashes) {
        int fd = open(full, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        char hex[65];
        uint64_t n = 0;
        FZ_CHECK(fd >= 0 && kvt__pub_sha256_fd(fd, hex, &n) == 0, "cannot hash %s", full);
        FZ_CHECK(!strcmp(hex, s->sha256) && n == s->bytes, "accepted shard %s has another SHA-256", s->path);
        close(fd);
    }
}

/* A fingerprint of a tree: entries, and the sum of sizes and mtimes. */
static uint64_t g_fp[3];
static int fp_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)path;
    (void)flag;
    (void)ftw;
    g_fp[0]++;
    g_fp[1] += (uint64_t)sb->st_size;
    g_fp[2] += (uint64_t)sb->st_mtim.tv_nsec + (uint64_t)sb->st_mtim.tv_sec * 1000000000ull + sb->st_mode;
    return 0;
}
static void fingerprint(const char *root, uint64_t out[3])
{
    memset(g_fp, 0, sizeof g_fp);
    nftw(root, fp_one, 16, FTW_PHYS);
    memcpy(out, g_fp, sizeof g_fp);
}

static int refusal_code(kvt_publish_refusal r)
{
    return r == KVT_PUBLISH_REFUSED_HASH ? KVT_ECORRUPT : r == KVT_PUBLISH_REFUSED_IDENTITY ? KVT_EIDENTITY : KVT_EFORMAT;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size};
    int mode = fz_u8(&in);
    int hashes = mode & 1, with_id = (mode >> 1) & 1, current = (mode >> 2) & 1, mount = (mode >> 3) & 1;
    char root[512], gpath[700];
    if (fz_mkdtemp(root, sizeof root, "manifest"))
        return 0;
    snprintf(gpath, sizeof gpath, "%s/%s", root, KVT__PUB_GENERATIONS);
    mkdir(gpath, 0755);
    snprintf(gpath, sizeof gpath, "%s/%s/%s", root, KVT__PUB_GENERATIONS, FZ_PUB_GENERATION);
    mkdir(gpath, 0755);
    fz_tree_build(&in, gpath, 64);
    if (current || mount) {
        char cur[600];
        snprintf(cur, sizeof cur, "%s/%s", root, KVT__PUB_CURRENT);
        fz_write_file(cur, FZ_PUB_GENERATION "\n", strlen(FZ_PUB_GENERATION) + 1);
    }
    uint64_t before[3], after[3];
    fingerprint(root, before);

    seen v = {.gpath = gpath, .hashes = hashes};
    kvt_publish_validate_opts o = {.identity = with_id ? &g_id : NULL, .hashes = hashes, .on_shard = on_shard,
                                   .ctx = &v};
    kvt_publish_report rep;
    kvt__clear_error();
    int rc = kvt_publish_validate(root, current ? NULL : FZ_PUB_GENERATION, &o, &rep);
    FZ_CHECK(!strcmp(rep.generation, FZ_PUB_GENERATION), "report of generation %s", rep.generation);
    if (rc == 0) {
        FZ_CHECK(rep.refusal == KVT_PUBLISH_OK && !rep.detail[0], "accepted with refusal %d (%s)", rep.refusal,
                 rep.detail);
        FZ_CHECK(v.shards == rep.shards && v.entries == rep.entries && v.blocks == rep.blocks &&
                     rep.shards == rep.entries + rep.blocks + v.identities,
                 "report counts %llu shards (%llu entries, %llu blocks), %llu seen",
                 (unsigned long long)rep.shards, (unsigned long long)rep.entries, (unsigned long long)rep.blocks,
                 (unsigned long long)v.shards);
        FZ_CHECK(!rep.shards || v.identities == 1, "%llu IDENTITY files listed", (unsigned long long)v.identities);
        if (with_id)
            FZ_CHECK(!strcmp(rep.model_id, g_id.model_id) && !strcmp(rep.config_fingerprint, g_id.config_fingerprint) &&
                         !strcmp(rep.tokenizer_hash, g_id.tokenizer_hash),
                     "accepted for another identity (%s)", rep.model_id);
    } else if (rep.refusal != KVT_PUBLISH_OK) {
        FZ_CHECK((unsigned)rep.refusal < KVT_PUBLISH_REFUSED_COUNT && rep.detail[0], "refusal %d without a sentence",
                 rep.refusal);
        FZ_CHECK(rc == refusal_code(rep.refusal), "refusal %s returned %d", kvt_publish_refusal_name(rep.refusal),
                 rc);
        FZ_CHECK(kvt_last_error()[0], "refusal without an error message");
    } else {
        FZ_CHECK(rc == KVT_ENOMEM, "failed with %d (%s) and no refusal", rc, kvt_last_error());
    }
    fingerprint(root, after);
    FZ_CHECK(!memcmp(before, after, sizeof before), "validation changed the directory");

    if (mount && rc != KVT_ENOMEM) {
        /* the read-only tier mounts exactly what validation accepts */
        kvt_published *p = NULL;
        kvt_published_options po = {.poll_ms = -1, .skip_hashes = !hashes};
        if (!kvt_published_open(root, &g_id, &po, &p)) {
            kvt_published_status s;
            kvt_published_get_status(p, &s);
            int ok_id = rc == 0 && (with_id || (!strcmp(rep.model_id, g_id.model_id) &&
                                                !strcmp(rep.config_fingerprint, g_id.config_fingerprint) &&
                                                !strcmp(rep.tokenizer_hash, g_id.tokenizer_hash)));
            FZ_CHECK(!!s.generation[0] == ok_id, "validation %s (%s), the tier mounted \"%s\" (%s)",
                     rc ? "refused" : "accepted", rep.detail, s.generation, s.last_detail);
            kvt_published_close(p);
        }
    }
    fz_rmtree(root);
    return 0;
}
