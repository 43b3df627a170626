/*
 * test_store_chat.c: the SSD tier end to end through `kvtier chat` (KVT_BIN)
 * on stories260K (KVT_SHARED_DIR; skipped, saying why, when either is
 * absent):
 *  - random single-byte flips in a block shard's payload: every one is
 *    refused (the shard is gone afterwards) and the replies equal a
 *    cache-off run (without the check a flip was served: wrong replies);
 *  - with a 16K prompt cache over the SSD tier, a fast scripted chat reuses
 *    as much as with a prompt cache that holds everything (prefixes that
 *    left RAM while their writes were still queued are found in the queue);
 *  - six concurrent chats on one --ssd-cache with --ssd-cache-max 300K:
 *    `kvtier store verify` exits 0 and the root holds at most the budget
 *    plus one shard.
 * Randomized parts print their seed (KVT_TEST_SEED replays).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "store_util.h"
#include "test_seed.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char model[1024], tok[1024], dir[512];

static int have_inputs(void)
{
    const char *bin = getenv("KVT_BIN"), *shared = getenv("KVT_SHARED_DIR");
    if (!bin || !shared) {
        print_message("skipping: KVT_BIN or KVT_SHARED_DIR is not set (ctest sets both)\n");
        return 0;
    }
    snprintf(model, sizeof model, "%s/data/models/stories260K.bin", shared);
    snprintf(tok, sizeof tok, "%s/data/models/tok512.bin", shared);
    if (access(model, R_OK) || access(tok, R_OK)) {
        print_message("skipping: %s or %s is missing\n", model, tok);
        return 0;
    }
    return 1;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *buf = calloc(1, 1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Runs `kvtier chat --model M --tokenizer T ARGS` (stdout, stderr to files). */
static int chat(const char *args, const char *out, const char *err)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' chat --model '%s' --tokenizer '%s' %s >'%s' 2>'%s'", getenv("KVT_BIN"), model,
             tok, args, out, err);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

/* "turn N: reused R tokens, ..." lines: fills reused[]; returns turns. */
static int reused_per_turn(const char *err, long long *reused, int max)
{
    int n = 0;
    for (const char *p = strstr(err, "turn "); p && n < max; p = strstr(p + 1, "\nturn ")) {
        if (*p == '\n')
            p++;
        int t;
        long long r;
        if (sscanf(p, "turn %d: reused %lld tokens", &t, &r) == 2)
            reused[n++] = r;
    }
    return n;
}

/* The identity directory under root (the only one). */
static void identity_dir(const char *root, char *out, size_t cap)
{
    DIR *d = opendir(root);
    assert_non_null(d);
    struct dirent *de;
    out[0] = '\0';
    while ((de = readdir(d)))
        if (strlen(de->d_name) == 32)
            snprintf(out, cap, "%s/%s", root, de->d_name);
    closedir(d);
    assert_true(out[0] != '\0');
}

static uint64_t xs(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* The block shard holding tokens from 0 (every entry's chain starts with it,
 * so a restore always reads it): its file name, or -1. */
static int first_block(const char *idir, char *name, size_t cap)
{
    DIR *d = opendir(idir);
    assert_non_null(d);
    struct dirent *de;
    int found = -1;
    while (found && (de = readdir(d))) {
        if (de->d_name[0] != 'b')
            continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%.200s", idir, de->d_name);
        char *h = slurp(path);
        if (strstr(h + 8, "\"tok_begin\":\"0\"")) {
            snprintf(name, cap, "%s", de->d_name);
            found = 0;
        }
        free(h);
    }
    closedir(d);
    return found;
}

static uint64_t header_end(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t lb[8];
    assert_int_equal(fread(lb, 1, 8, f), 8);
    fclose(f);
    uint64_t h = 0;
    for (int i = 0; i < 8; i++)
        h |= (uint64_t)lb[i] << (8 * i);
    return 8 + h;
}

static const char SCRIPT[] = "Once upon a time there was a little girl named Lily.\n"
                             "She liked to play with her ball in the park.\n"
                             "One day the ball rolled into the pond.\n";

static void bitflips_refused_in_chat(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    uint64_t x = test_seed("bitflips_refused_in_chat") | 1;
    char script[600], ssd[600], pristine[600], out0[600], out[600], err[600], args[4096], cmd[2048];
    snprintf(script, sizeof script, "%s/flip.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/flip_ssd", dir);
    snprintf(pristine, sizeof pristine, "%s/flip_pristine", dir);
    snprintf(out0, sizeof out0, "%s/flip_off.out", dir);
    snprintf(out, sizeof out, "%s/flip.out", dir);
    snprintf(err, sizeof err, "%s/flip.err", dir);
    write_file(script, SCRIPT);
    snprintf(args, sizeof args, "--script '%s' --max-tokens 24 --prompt-cache 0", script);
    assert_int_equal(chat(args, out0, err), 0);
    char *want = slurp(out0);
    snprintf(args, sizeof args, "--script '%s' --max-tokens 24 --block-tokens 8 --ssd-cache '%s'", script, pristine);
    assert_int_equal(chat(args, out, err), 0);
    char idir[1200], pidir[1200], bname[256], bpath[1600];
    identity_dir(pristine, pidir, sizeof pidir);
    assert_int_equal(first_block(pidir, bname, sizeof bname), 0);
    const int trials = 12;
    int refused = 0, wrong = 0;
    for (int k = 0; k < trials; k++) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -a '%s' '%s'", ssd, pristine, ssd);
        assert_int_equal(system(cmd), 0);
        identity_dir(ssd, idir, sizeof idir);
        snprintf(bpath, sizeof bpath, "%s/%s", idir, bname);
        struct stat st;
        assert_int_equal(stat(bpath, &st), 0);
        uint64_t payload = (uint64_t)st.st_size - header_end(bpath);
        long at = 1 + (long)(xs(&x) % payload);
        assert_int_equal(store_flip_byte(bpath, at, 1 << (xs(&x) % 8)), 0);
        snprintf(args, sizeof args, "--script '%s' --max-tokens 24 --block-tokens 8 --ssd-cache '%s'", script, ssd);
        assert_int_equal(chat(args, out, err), 0);
        char *got = slurp(out);
        wrong += strcmp(got, want) != 0;
        /* a refused shard is removed, and written again (right) when the
         * run saves its prefixes: either way the flipped bytes are gone */
        char orig[1600];
        snprintf(orig, sizeof orig, "%s/%s", pidir, bname);
        int gone = stat(bpath, &st) != 0;
        if (!gone) {
            char *now = slurp(bpath), *was = slurp(orig);
            gone = (uint64_t)st.st_size == header_end(orig) + payload && !memcmp(now, was, (size_t)st.st_size);
            free(now);
            free(was);
        }
        refused += gone;
        free(got);
    }
    printf("%d flips in block %s: %d refused, %d wrong replies\n", trials, bname, refused, wrong);
    assert_int_equal(wrong, 0);
    assert_int_equal(refused, trials);
    free(want);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", ssd, pristine);
    assert_int_equal(system(cmd), 0);
    unlink(script);
    unlink(out0);
    unlink(out);
    unlink(err);
}

/* A 16K prompt cache over the SSD tier: prefixes leave RAM at once and their
 * writes are queued; the next turn must still find them (0,0,0,51 tokens
 * reused before, with lines fast enough). Reuse must equal a prompt cache that
 * holds everything, and the replies a cache-off run. */
static void pending_found_with_small_prompt_cache(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char script[600], ssd[600], out0[600], out1[600], out2[600], err1[600], err2[600], args[4096];
    snprintf(script, sizeof script, "%s/pend.txt", dir);
    snprintf(ssd, sizeof ssd, "%s/pend_ssd", dir);
    snprintf(out0, sizeof out0, "%s/pend0.out", dir);
    snprintf(out1, sizeof out1, "%s/pend1.out", dir);
    snprintf(out2, sizeof out2, "%s/pend2.out", dir);
    snprintf(err1, sizeof err1, "%s/pend1.err", dir);
    snprintf(err2, sizeof err2, "%s/pend2.err", dir);
    write_file(script, "Once upon a time there was a little girl.\n"
                       "She liked to play in the park with her dog.\n"
                       "One day the dog ran away into the woods.\n"
                       "The girl looked for him everywhere.\n");
    snprintf(args, sizeof args, "--script '%s' --max-tokens 40 --prompt-cache 0", script);
    assert_int_equal(chat(args, out0, err1), 0);
    snprintf(args, sizeof args, "--script '%s' --max-tokens 40", script);
    assert_int_equal(chat(args, out1, err1), 0);
    snprintf(args, sizeof args, "--script '%s' --max-tokens 40 --prompt-cache 16K --ssd-cache '%s'", script, ssd);
    assert_int_equal(chat(args, out2, err2), 0);
    char *o0 = slurp(out0), *o1 = slurp(out1), *o2 = slurp(out2), *e1 = slurp(err1), *e2 = slurp(err2);
    assert_string_equal(o0, o1);
    assert_string_equal(o0, o2);
    long long r1[8], r2[8];
    assert_int_equal(reused_per_turn(e1, r1, 8), 4);
    assert_int_equal(reused_per_turn(e2, r2, 8), 4);
    printf("reused per turn: RAM %lld,%lld,%lld,%lld; 16K + SSD %lld,%lld,%lld,%lld\n", r1[0], r1[1], r1[2], r1[3],
           r2[0], r2[1], r2[2], r2[3]);
    for (int t = 1; t < 4; t++)
        if (r2[t] < r1[t])
            fail_msg("turn %d reused %lld tokens with 16K + SSD, %lld with RAM only: a pending write was missed",
                     t + 1, r2[t], r1[t]);
    free(o0);
    free(o1);
    free(o2);
    free(e1);
    free(e2);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ssd);
    assert_int_equal(system(cmd), 0);
    unlink(script);
    unlink(out0);
    unlink(out1);
    unlink(out2);
    unlink(err1);
    unlink(err2);
}

/* Six chats at once on one root with --ssd-cache-max 300K. */
static void six_chats_one_budget(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    static const char *const lines[] = {"The cat liked to eat fish.", "One day it met a big dog.",
                                        "They played in the sun all day.", "Then it started to rain.",
                                        "They ran home together.", "Mom made them some warm milk."};
    char ssd[600], cmd[16384];
    snprintf(ssd, sizeof ssd, "%s/six_ssd", dir);
    size_t len = 0;
    len += (size_t)snprintf(cmd + len, sizeof cmd - len, "(");
    for (int w = 0; w < 6; w++) {
        char script[600];
        snprintf(script, sizeof script, "%s/six%d.txt", dir, w);
        FILE *f = fopen(script, "w");
        assert_non_null(f);
        fprintf(f, "Once upon a time there was a cat number %d.\n", w);
        for (int i = 0; i < 3; i++) /* 4 turns: each conversation fits the budget alone */
            fprintf(f, "%s\n", lines[(i + w) % 6]);
        fclose(f);
        len += (size_t)snprintf(cmd + len, sizeof cmd - len,
                                "'%s' chat --model '%s' --tokenizer '%s' --script '%s' --max-tokens 10 "
                                "--block-tokens 16 --ssd-cache '%s' --ssd-cache-max 300K >/dev/null 2>'%s/six%d.err' & ",
                                getenv("KVT_BIN"), model, tok, script, ssd, dir, w);
    }
    snprintf(cmd + len, sizeof cmd - len, "wait)");
    assert_int_equal(system(cmd), 0);
    char out[600], verify[2048];
    snprintf(out, sizeof out, "%s/six_verify.txt", dir);
    snprintf(verify, sizeof verify, "'%s' store verify '%s' >'%s' 2>&1", getenv("KVT_BIN"), ssd, out);
    int vrc = system(verify);
    char *v = slurp(out);
    /* the root's bytes, and its largest shard */
    char idir[1200];
    identity_dir(ssd, idir, sizeof idir);
    DIR *d = opendir(idir);
    assert_non_null(d);
    struct dirent *de;
    uint64_t total = 0, biggest = 0;
    int shards = 0;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || !strcmp(de->d_name, "IDENTITY"))
            continue;
        char p[2048];
        snprintf(p, sizeof p, "%s/%.200s", idir, de->d_name);
        struct stat st;
        assert_int_equal(stat(p, &st), 0);
        total += (uint64_t)st.st_size;
        biggest = (uint64_t)st.st_size > biggest ? (uint64_t)st.st_size : biggest;
        shards++;
    }
    closedir(d);
    const char *last = strstr(v, "verify:");
    printf("6 chats, budget 307200: root %llu bytes in %d shards (largest %llu); %s", (unsigned long long)total,
           shards, (unsigned long long)biggest, last ? last : v);
    if (!WIFEXITED(vrc) || WEXITSTATUS(vrc) != 0)
        fail_msg("store verify failed: %s", v);
    assert_true(shards > 0);
    if (total > 307200 + biggest)
        fail_msg("root %llu bytes: over the budget 307200 plus one shard (%llu)", (unsigned long long)total,
                 (unsigned long long)biggest);
    free(v);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'/six*", ssd, dir);
    assert_int_equal(system(cmd), 0);
}

static int setup(void **state)
{
    (void)state;
    store_tmpdir(dir, sizeof dir, "chat");
    return dir[0] ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    store_rmtree(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bitflips_refused_in_chat),
        cmocka_unit_test(pending_found_with_small_prompt_cache),
        cmocka_unit_test(six_chats_one_budget),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
