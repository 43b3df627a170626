/*
 * cmd_store.c: `kvtier store inspect|verify|gc DIR`: the SSD tier's root on
 * disk, offline. inspect reads shard headers only (never tensor bytes);
 * verify runs every check a restore runs (both checksums, every header
 * field, every layer's decode) and exits 0 only if every shard is good; gc
 * evicts least recently used entries of idle identity directories down to a
 * byte budget. Owns no state beyond one command run; never writes a shard.
 */
#include "args.h"
#include "cli.h"

#include "kvtier/store.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TOP_PREFIXES 5

typedef struct ident_acc {
    char dir[64];
    char identity[1100];
    uint64_t entries, blocks, temps, others, bad, bytes;
    int64_t top_tokens[TOP_PREFIXES];
    char top_ns[TOP_PREFIXES][64];
} ident_acc;

typedef struct walk_state {
    ident_acc *ids;
    int n, cap;
    int verbose_bad;
    uint64_t bad_by_reason[KVT_STORE_REFUSED_COUNT];
    uint64_t shards, bad;
} walk_state;

static ident_acc *acc_for(walk_state *w, const kvt_store_shard_info *in)
{
    for (int i = 0; i < w->n; i++)
        if (!strcmp(w->ids[i].dir, in->dir))
            return &w->ids[i];
    if (w->n == w->cap) {
        int c = w->cap ? w->cap * 2 : 8;
        ident_acc *n = realloc(w->ids, sizeof *n * (size_t)c);
        if (!n)
            return NULL;
        w->ids = n;
        w->cap = c;
    }
    ident_acc *a = &w->ids[w->n++];
    memset(a, 0, sizeof *a);
    snprintf(a->dir, sizeof a->dir, "%s", in->dir);
    snprintf(a->identity, sizeof a->identity, "%s", in->identity[0] ? in->identity : "(no IDENTITY file)");
    return a;
}

static int on_shard(void *ctx, const kvt_store_shard_info *in)
{
    walk_state *w = ctx;
    ident_acc *a = acc_for(w, in);
    if (!a)
        return 1;
    a->bytes += in->bytes;
    if (in->type == 't') {
        a->temps++;
        return 0;
    }
    if (in->type == '?') {
        a->others++;
        return 0;
    }
    w->shards++;
    if (in->status) {
        a->bad++;
        w->bad++;
        int r = in->status - 1;
        if (r >= 0 && r < KVT_STORE_REFUSED_COUNT)
            w->bad_by_reason[r]++;
        if (w->verbose_bad && in->type == 'l')
            printf("BAD  %s: refused (symlink): an identity directory must not be a symbolic link\n", in->dir);
        else if (w->verbose_bad)
            printf("BAD  %s/%s: %s\n", in->dir, in->file, kvt_store_refusal_name((kvt_store_refusal)r));
        return 0;
    }
    if (in->type == 'b') {
        a->blocks++;
        return 0;
    }
    a->entries++;
    /* keep the longest prefixes */
    for (int i = 0; i < TOP_PREFIXES; i++)
        if (in->n_tokens > a->top_tokens[i]) {
            memmove(&a->top_tokens[i + 1], &a->top_tokens[i], sizeof(int64_t) * (size_t)(TOP_PREFIXES - 1 - i));
            memmove(a->top_ns[i + 1], a->top_ns[i], sizeof a->top_ns[0] * (size_t)(TOP_PREFIXES - 1 - i));
            a->top_tokens[i] = in->n_tokens;
            snprintf(a->top_ns[i], sizeof a->top_ns[i], "%s", in->ns);
            break;
        }
    return 0;
}

/* Identity directories under root, as kvt_store_walk finds them: 32
 * lowercase hex digits naming a directory that holds an IDENTITY file, or
 * such a name on a symbolic link (walk reports it refused). @return the
 * count, or -errno when root cannot be listed. */
static int count_identity_dirs(const char *root)
{
    DIR *d = opendir(root);
    if (!d)
        return -errno;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        const char *nm = de->d_name;
        size_t k = 0;
        while (k < 32 && ((nm[k] >= '0' && nm[k] <= '9') || (nm[k] >= 'a' && nm[k] <= 'f')))
            k++;
        if (k != 32 || nm[32])
            continue;
        struct stat sb;
        char idf[4200];
        snprintf(idf, sizeof idf, "%s/%s", root, nm);
        if (lstat(idf, &sb) == 0 && S_ISLNK(sb.st_mode)) {
            n++;
            continue;
        }
        snprintf(idf, sizeof idf, "%s/%s/IDENTITY", root, nm);
        n += access(idf, F_OK) == 0;
    }
    closedir(d);
    return n;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier store inspect DIR     entries, bytes, identities, longest prefixes (headers only)\n"
               "       kvtier store verify DIR      check every shard as a restore does (and SHA-256); exit 0 only if all are good\n"
               "       kvtier store gc DIR --max BYTES  evict LRU entries of idle identities (e.g. 10G)\n"
               "\n"
               "DIR is the SSD tier's root: the --ssd-cache DIR of chat, serve and generate, which holds one\n"
               "directory per identity (32 hex digits, with an IDENTITY file). inspect and verify refuse a\n"
               "DIR that holds none (exit 1).\n"
               "Exit status: 0 success, 1 failure (a bad shard, a DIR that is not a store), 2 usage error.\n");
}

static void print_report(const walk_state *w)
{
    uint64_t total = 0;
    for (int i = 0; i < w->n; i++) {
        const ident_acc *a = &w->ids[i];
        total += a->bytes;
        printf("identity %s\n  %s\n", a->dir, a->identity);
        printf("  entries %llu  blocks %llu  bytes %llu  refused %llu  temp files %llu\n",
               (unsigned long long)a->entries, (unsigned long long)a->blocks, (unsigned long long)a->bytes,
               (unsigned long long)a->bad, (unsigned long long)a->temps);
        for (int k = 0; k < TOP_PREFIXES && a->top_tokens[k]; k++)
            printf("  prefix %d: %lld tokens (ns \"%s\")\n", k + 1, (long long)a->top_tokens[k], a->top_ns[k]);
    }
    printf("total: %d identities, %llu shards, %llu bytes, %llu refused\n", w->n, (unsigned long long)w->shards,
           (unsigned long long)total, (unsigned long long)w->bad);
    for (int r = 0; r < KVT_STORE_REFUSED_COUNT; r++)
        if (w->bad_by_reason[r])
            printf("  refused (%s): %llu\n", kvt_store_refusal_name((kvt_store_refusal)r),
                   (unsigned long long)w->bad_by_reason[r]);
}

int kvt_cmd_store(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { /* store SUB --help too */
            usage(stdout);
            return 0;
        }
    if (argc < 3) {
        usage(stderr);
        return 2;
    }
    const char *sub = argv[1], *dir = argv[2];
    char idf[4200];
    snprintf(idf, sizeof idf, "%s/IDENTITY", dir);
    if (access(idf, F_OK) == 0) { /* a verify there would say "ok (0 of 0)" */
        fprintf(stderr, "kvtier store %s: %s is one identity's directory; give the store's root "
                        "(the --ssd-cache DIR, its parent)\n", sub, dir);
        return 2;
    }
    if (!strcmp(sub, "inspect") || !strcmp(sub, "verify")) {
        if (argc != 3) {
            usage(stderr);
            return 2;
        }
        int verify = !strcmp(sub, "verify");
        /* a directory that holds no identity directory is not a store: an
         * "ok (0 of 0 shards good)" there would pass any directory */
        int n_ids = count_identity_dirs(dir);
        if (n_ids < 0) {
            fprintf(stderr, "kvtier store %s: %s: %s\n", sub, dir, strerror(-n_ids));
            return 1;
        }
        if (n_ids == 0) {
            fprintf(stderr, "kvtier store %s: %s is not a kvtier store: it holds no identity directory (a "
                            "directory named by 32 hex digits holding an IDENTITY file, as chat, serve and "
                            "generate make under --ssd-cache DIR)\n", sub, dir);
            return 1;
        }
        walk_state w;
        memset(&w, 0, sizeof w);
        w.verbose_bad = 1;
        int rc = kvt_store_walk(dir, verify, on_shard, &w);
        if (rc) {
            fprintf(stderr, "kvtier store %s: %s\n", sub, kvt_last_error());
            free(w.ids);
            return 1;
        }
        print_report(&w);
        if (verify)
            printf("verify: %s (%llu of %llu shards good)\n", w.bad ? "FAILED" : "ok",
                   (unsigned long long)(w.shards - w.bad), (unsigned long long)w.shards);
        free(w.ids);
        return verify && w.bad ? 1 : 0;
    }
    if (!strcmp(sub, "gc")) {
        uint64_t max = 0;
        int have = 0;
        for (int i = 3; i < argc; i++) {
            if (strcmp(argv[i], "--max") != 0) {
                fprintf(stderr, "kvtier store gc: bad argument '%s'\n", argv[i]);
                usage(stderr);
                return 2;
            }
            if (i + 1 >= argc || kvt_cli_bytes(argv[i + 1], &max, NULL)) {
                fprintf(stderr, "kvtier store gc: --max wants a byte count (e.g. 10G, 512M, 4096), got '%s'\n",
                        i + 1 < argc ? argv[i + 1] : "");
                return 2;
            }
            have = 1;
            i++;
        }
        if (!have) {
            fprintf(stderr, "kvtier store gc: --max BYTES is required\n");
            return 2;
        }
        uint64_t freed = 0;
        int rc = kvt_store_gc(dir, max, &freed);
        if (rc) {
            fprintf(stderr, "kvtier store gc: %s\n", kvt_last_error());
            return 1;
        }
        printf("gc: freed %llu bytes (budget %llu)\n", (unsigned long long)freed, (unsigned long long)max);
        return 0;
    }
    fprintf(stderr, "kvtier store: unknown subcommand '%s'\n", sub);
    usage(stderr);
    return 2;
}
