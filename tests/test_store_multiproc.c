/*
 * test_store_multiproc.c: several processes on one SSD root with a byte
 * budget. Six writer processes share one identity directory (and so each
 * other's blocks), each putting and restoring entries that share prefixes,
 * under a budget a few entries large. Budget eviction in one process must
 * never delete a block another process's entry references: afterwards
 * kvt_store_walk with verify (`kvtier store verify`) finds every shard good,
 * every restore in every child returned the bytes that were written, and the
 * root is within its budget plus one shard. Randomized: prints its seed
 * (KVT_TEST_SEED replays).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "pc_util.h"
#include "store_util.h"
#include "test_seed.h"

#include "kvtier/store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const store_cfg CFG = {.n_kv = 2, .kv_dim = 8, .block = 4};

#define WRITERS 6

static uint64_t xs(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* One writer: puts (sync and write-behind) entries over a few shared
 * starts, restores what it finds and checks the bytes. Exit status: 0 ok,
 * 1 wrong bytes, 2 store error. */
static int writer(const char *root, uint64_t max, uint64_t seed, int rounds)
{
    kvt_store_identity id;
    char fp[KVT_STORE_FINGERPRINT_LEN];
    store_identity(&CFG, "model-m", fp, &id);
    kvt_store_options o = {.max_bytes = max};
    kvt_store *s = NULL;
    if (kvt_store_open(root, &id, &o, &s)) {
        fprintf(stderr, "writer: open: %s\n", kvt_last_error());
        return 2;
    }
    uint64_t x = seed | 1;
    int status = 0;
    for (int r = 0; r < rounds && !status; r++) {
        int32_t t[64];
        int start = (int)(xs(&x) % 3); /* three shared conversation starts */
        pcu_seq(t, 64, 1000 * (start + 1));
        int64_t n = 8 + (int64_t)(xs(&x) % 40);
        int64_t fork_at = 4 + (int64_t)(xs(&x) % (uint64_t)(n - 4));
        for (int64_t i = fork_at; i < n; i++)
            t[i] = (int32_t)(xs(&x) % 50000) + 1;
        kvt_entry e;
        if (store_make_entry(&CFG, "", t, n, &e))
            return 2;
        int rc;
        if (xs(&x) % 2) {
            rc = kvt_store_put(s, &e);
            kvt_entry_clear(&e);
        } else {
            rc = kvt_store_put_async(s, &e);
            if (rc)
                kvt_entry_clear(&e);
            if (rc == KVT_EAGAIN)
                rc = 0;
        }
        if (rc) {
            fprintf(stderr, "writer: put: %s\n", kvt_last_error());
            status = 2;
            break;
        }
        /* restore the longest prefix found for a prompt over this start */
        kvt_cold_hit hit;
        if (kvt_store_find(s, t, n, "", &hit) == 0) {
            kvt_entry got;
            rc = kvt_store_restore(s, hit.handle, t, n, &got);
            if (rc == 0) {
                kvt_entry want;
                if (store_make_entry(&CFG, "", got.tokens, got.n_tokens, &want))
                    return 2;
                if (store_entry_diff(&got, &want)) {
                    fprintf(stderr, "writer: restored bytes differ\n");
                    status = 1;
                }
                kvt_entry_clear(&want);
                kvt_entry_clear(&got);
            } else if (rc != KVT_ENOTFOUND && rc != KVT_EFORMAT) {
                /* gone (another process's budget) is a miss; a missing
                 * block (EFORMAT) is what this test exists to catch */
                fprintf(stderr, "writer: restore: %s\n", kvt_last_error());
                status = 2;
            } else if (rc == KVT_EFORMAT) {
                fprintf(stderr, "writer: restore refused: %s\n", kvt_last_error());
                status = 1;
            }
        }
    }
    int crc = kvt_store_close(s);
    if (crc && !status) {
        fprintf(stderr, "writer: close: %s\n", kvt_strerror(crc));
        status = 2;
    }
    return status;
}

typedef struct acc {
    uint64_t bytes, biggest;
    int shards, bad;
} acc;

static int count(void *ctx, const kvt_store_shard_info *in)
{
    acc *a = ctx;
    a->bytes += in->bytes;
    if (in->bytes > a->biggest)
        a->biggest = in->bytes;
    if (in->type == 'e' || in->type == 'b')
        a->shards++;
    if (in->status) {
        a->bad++;
        fprintf(stderr, "verify: %s/%s refused (%s)\n", in->dir, in->file,
                kvt_store_refusal_name((kvt_store_refusal)(in->status - 1)));
    }
    return 0;
}

static void run_writers(int rounds, uint64_t max)
{
    uint64_t seed = test_seed("six_writers_one_budget");
    char root[512];
    store_tmpdir(root, sizeof root, "mproc");
    pid_t pids[WRITERS];
    for (int w = 0; w < WRITERS; w++) {
        fflush(NULL);
        pids[w] = fork();
        assert_true(pids[w] >= 0);
        if (pids[w] == 0)
            _exit(writer(root, max, seed + 7919u * (uint64_t)(w + 1), rounds));
    }
    int failed = 0;
    for (int w = 0; w < WRITERS; w++) {
        int st = 0;
        assert_int_equal(waitpid(pids[w], &st, 0), pids[w]);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            print_message("writer %d: %s %d\n", w, WIFEXITED(st) ? "exit" : "signal",
                          WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            failed++;
        }
    }
    acc a = {0};
    assert_int_equal(kvt_store_walk(root, 1, count, &a), 0);
    printf("%d writers x %d rounds, budget %llu: root %llu bytes in %d shards (largest %llu), %d refused\n",
           WRITERS, rounds, (unsigned long long)max, (unsigned long long)a.bytes, a.shards,
           (unsigned long long)a.biggest, a.bad);
    assert_int_equal(failed, 0);
    assert_int_equal(a.bad, 0);
    assert_true(a.shards > 0);
    if (a.bytes > max + a.biggest)
        fail_msg("root holds %llu bytes: over the budget %llu plus one shard (%llu)", (unsigned long long)a.bytes,
                 (unsigned long long)max, (unsigned long long)a.biggest);
    store_rmtree(root);
}

static void six_writers_one_budget(void **state)
{
    (void)state;
    run_writers(60, 24u << 10);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(six_writers_one_budget)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
