/*
 * publish_internal.h: pieces shared by the files of src/publish (the
 * publisher, the validator, the read-only tier); never installed.
 */
#ifndef KVTIER_PUBLISH_INTERNAL_H
#define KVTIER_PUBLISH_INTERNAL_H

#include "kvtier/publish.h"

#include <stddef.h>
#include <stdint.h>

#define KVT__PUB_FORMAT "kvtier-published-cache"
#define KVT__PUB_VERSION 1
#define KVT__PUB_MANIFEST "MANIFEST.json"
#define KVT__PUB_CURRENT "CURRENT"
#define KVT__PUB_GENERATIONS "generations"
#define KVT__PUB_STAGING ".staging-"
#define KVT__PUB_REMOVING ".removing-"
#define KVT__PUB_LOCK ".publish.lock"

/** A directory and an identity, copied (kvt_publisher and kvt_published
 * keep both). */
typedef struct kvt__pub_where {
    char *dir;
    char *model_id, *config_fingerprint, *tokenizer_hash;
    kvt_store_identity identity; /* points at the copies above */
} kvt__pub_where;

/** Checks (dir non-empty and at most 3000 bytes, identity strings set) and
 * copies them into *w; `fn` names the caller in messages.
 * @return 0; KVT_EINVAL; KVT_ENOMEM (then *w holds nothing). */
int kvt__pub_where_init(kvt__pub_where *w, const char *dir, const kvt_store_identity *id, const char *fn);
/** Frees the copies; zeroes *w. */
void kvt__pub_where_clear(kvt__pub_where *w);

/** 1 when s is a generation id: 1..32 characters of [0-9A-Za-z_-]. */
int kvt__pub_id_valid(const char *s);

/** Reads dir/CURRENT into id (KVT_PUBLISH_ID_LEN bytes), trailing newline
 * stripped. @return 0; KVT_ENOTFOUND (no CURRENT); KVT_EFORMAT (it holds no
 * valid id: detail set); -errno. */
int kvt__pub_read_current(const char *dir, char *id);

/** Validates the generation directory open as gfd (path gpath, id `id`):
 * everything kvt_publish_validate checks past locating the directory.
 * @return as kvt_publish_validate. */
int kvt__pub_validate_at(int gfd, const char *gpath, const char *id, const kvt_publish_validate_opts *opts,
                         kvt_publish_report *out);

/** SHA-256 of the whole open file fd as 64 hex digits + NUL, and its size.
 * @return 0 or -errno. */
int kvt__pub_sha256_fd(int fd, char hex[65], uint64_t *bytes);

/** Removes the directory tree `name` under dirfd (files and directories,
 * at most 4 levels deep, symbolic links removed, never followed).
 * @return 0 or -errno. */
int kvt__pub_rmtree_at(int dirfd, const char *name);

/** fsync of a directory by path. @return 0 or -errno. */
int kvt__pub_fsync_path(const char *path);

#endif
