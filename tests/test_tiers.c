/*
 * test_tiers.c: the tier stack of chat and serve (engine/tiers.h) in
 * process, on stories260K (skipped with a message without it): bad options
 * refused with the field named; levels not implemented yet refused with
 * KVT_EUNSUPPORTED, nothing left open; an empty stack gives no cold tier;
 * an SSD stack keeps a conversation across a close and a reopen (the second
 * chat restores from it, through the chain, with the same replies as a
 * cache-off chat), reports the level's state, and a disk that fails every
 * write turns it read-only with one warning and never fails the chat.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "chat.h"
#include "cli_run.h"
#include "redis_util.h"
#include "store_util.h"
#include "tiers.h"

#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* How many times slower this build runs a test (CMake: 10 under TSan, 3
 * under ASan, else 1). */
#ifndef KVT_TEST_TIME_SCALE
#define KVT_TEST_TIME_SCALE 1
#endif

static char dir[256], model[1024], tok[1024];

static const char *const lines[] = {"Once upon a time there was a cat.", "What did the cat do next?",
                                    "And how did the story end?"};

static int have_inputs(void) { return cli_inputs(model, sizeof model, tok, sizeof tok); }

/* Runs the three lines through a chat over `cold` (NULL: a cache-off chat)
 * and copies the replies into out (3 x cap); with `report`, the service's
 * report after it closed (its "tiers" from `chain`), freed by the caller
 * with kvt_string_free. */
static void run_chat_report(kvt_model *m, kvt_tokenizer *t, const kvt_cold_tier *cold, kvt_tier_chain *chain,
                            const char *const *script, char out[3][512], int64_t *reused_first, char **report)
{
    kvt_chat_service_opts svo = {.prompt_cache_bytes = cold ? 200000 : 0, .cold = cold, .chain = chain};
    kvt_service *svc = NULL;
    assert_int_equal(kvt_chat_service_create(m, &svo, &svc), 0);
    kvt_chat_opts co = {.max_tokens = 8, .session = "s"};
    kvt_chat *chat = NULL;
    assert_int_equal(kvt_chat_create(m, t, svc, &co, &chat), 0);
    for (int i = 0; i < 3; i++) {
        const char *reply;
        kvt_turn_stats st;
        assert_int_equal(kvt_chat_turn(chat, script[i], &reply, NULL, NULL, &st), 0);
        snprintf(out[i], 512, "%s", reply);
        if (i == 0 && reused_first)
            *reused_first = st.reused_tokens;
    }
    kvt_chat_free(chat);
    assert_int_equal(kvt_service_close(svc), 0);
    if (report)
        assert_int_equal(kvt_service_stats_json(svc, report), 0);
    kvt_service_destroy(svc);
}

static void run_chat(kvt_model *m, kvt_tokenizer *t, const kvt_cold_tier *cold, char out[3][512],
                     int64_t *reused_first)
{
    run_chat_report(m, t, cold, NULL, lines, out, reused_first, NULL);
}

/* Loads stories260K and its identity. */
static void load(kvt_model **m, kvt_tokenizer **t, kvt_chat_identity *id)
{
    assert_int_equal(kvt_chat_load(model, tok, m, t), 0);
    assert_int_equal(kvt_chat_identity_compute(*m, tok, id), 0);
}

static void test_options(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    kvt_chat_identity id;
    load(&m, &t, &id);
    kvt_tiers *tiers = (kvt_tiers *)1;
    kvt_tiers_opts o = {0};
    assert_int_equal(kvt_tiers_open(NULL, &id, &o, &tiers), KVT_EINVAL);
    assert_null(tiers);
    assert_int_equal(kvt_tiers_open(m, &id, NULL, &tiers), KVT_EINVAL);
    assert_int_equal(kvt_tiers_open(m, &id, &o, NULL), KVT_EINVAL);
    o.ssd_dir = "";
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "directory is empty"));
    o.ssd_dir = dir;
    assert_int_equal(kvt_tiers_open(m, NULL, &o, &tiers), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "identity"));
    o.write_queue = -1;
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "write_queue"));
    o.write_queue = 0;
    o.n_prompt_cache_dirs = 1;
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), KVT_EINVAL);
    /* an empty published directory, and a Redis URL that does not parse:
     * refused, nothing opened (no directory made) */
    char sub[400];
    snprintf(sub, sizeof sub, "%s/never", dir);
    o.ssd_dir = sub;
    const char *pub[] = {""};
    o.prompt_cache_dirs = pub;
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "published cache directory 1 is empty"));
    o.n_prompt_cache_dirs = 0;
    o.redis_url = "http://127.0.0.1:6379";
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), KVT_EINVAL);
    assert_non_null(strstr(kvt_last_error(), "redis://"));
    assert_null(tiers);
    assert_int_equal(access(sub, F_OK), -1);
    /* no level: an empty stack, no cold tier */
    kvt_tiers_opts none = {0};
    assert_int_equal(kvt_tiers_open(m, NULL, &none, &tiers), 0);
    assert_int_equal(kvt_tiers_levels(tiers), 0);
    assert_null(kvt_tiers_chain(tiers));
    assert_null(kvt_tiers_store(tiers));
    kvt_cold_tier ct;
    memset(&ct, 0xab, sizeof ct);
    assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), KVT_ENOTFOUND);
    assert_null(ct.find);
    kvt_tiers_status st;
    kvt_tiers_poll(tiers, &st);
    assert_int_equal(st.n_levels, 0);
    assert_int_equal(kvt_tiers_warn(tiers, "test", "x", stderr), 0);
    assert_int_equal(kvt_tiers_close(tiers, &st), 0);
    assert_int_equal(kvt_tiers_close(NULL, NULL), 0);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
}

static void test_ssd_stack(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    kvt_chat_identity id;
    load(&m, &t, &id);
    char ref[3][512], got[3][512], root[400];
    run_chat(m, t, NULL, ref, NULL);
    snprintf(root, sizeof root, "%s/ssd", dir);
    kvt_tiers_opts o = {.ssd_dir = root};
    for (int round = 0; round < 2; round++) {
        kvt_tiers *tiers = NULL;
        assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), 0);
        assert_int_equal(kvt_tiers_levels(tiers), 1);
        assert_non_null(kvt_tiers_chain(tiers));
        assert_non_null(kvt_tiers_store(tiers));
        kvt_cold_tier ct;
        assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), 0);
        assert_int_equal(ct.flags & KVT_TIER_READ_ONLY, 0);
        int64_t reused = -1;
        run_chat(m, t, &ct, got, &reused);
        for (int i = 0; i < 3; i++)
            assert_string_equal(got[i], ref[i]);
        kvt_tier_stats ls;
        assert_int_equal(kvt_tier_chain_level_stats(kvt_tiers_chain(tiers), 0, &ls), 0);
        print_message("round %d: first turn reused %lld tokens; level 0: %llu restores, %llu entries\n", round,
                      (long long)reused, (unsigned long long)ls.restores, (unsigned long long)ls.entries);
        if (round == 0) {
            assert_int_equal(reused, 0); /* an empty directory */
        } else {
            assert_true(reused > 0); /* the first chat's prompt, from disk through the chain */
            assert_true(ls.restores >= 1);
        }
        kvt_tiers_status st;
        kvt_tiers_poll(tiers, &st);
        assert_int_equal(st.n_levels, 1);
        assert_string_equal(st.level[0].name, "ssd");
        assert_string_equal(st.level[0].label, "SSD cache");
        assert_string_equal(st.level[0].where, root);
        assert_int_equal(st.level[0].mode, KVT_LEVEL_MODE_READ_WRITE);
        assert_int_equal(st.level[0].warn, 0);
        assert_int_equal(kvt_tiers_close(tiers, &st), 0);
        assert_int_equal(st.n_levels, 1);
        assert_true(st.level[0].entries > 0);
        assert_int_equal(st.level[0].write_failures, 0);
    }
    kvt_tokenizer_free(t);
    kvt_model_free(m);
}

static void test_ssd_stack_disk_full(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    kvt_chat_identity id;
    load(&m, &t, &id);
    char ref[3][512], got[3][512], root[400];
    run_chat(m, t, NULL, ref, NULL);
    snprintf(root, sizeof root, "%s/full", dir);
    kvt_store_io io;
    store_faults faults;
    store_faults_init(&faults, &io);
    faults.fail_all = 1;
    faults.err = ENOSPC;
    kvt_tiers_opts o = {.ssd_dir = root, .ssd_io = &io};
    kvt_tiers *tiers = NULL;
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), 0);
    kvt_cold_tier ct;
    assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), 0);
    run_chat(m, t, &ct, got, NULL);
    for (int i = 0; i < 3; i++)
        assert_string_equal(got[i], ref[i]);
    FILE *f = tmpfile();
    assert_non_null(f);
    int said = kvt_tiers_warn(tiers, "test", "counted", f);
    kvt_tiers_status st;
    assert_int_equal(kvt_tiers_close(tiers, &st), 0);
    said += kvt_tiers_say(&st, "test", "counted", f);
    char text[4096] = "";
    rewind(f);
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
    print_message("%s", text);
    assert_int_equal(said, 1); /* once */
    assert_int_equal(st.level[0].mode, KVT_LEVEL_MODE_READ_ONLY);
    assert_non_null(strstr(text, "test: warning: SSD cache "));
    assert_non_null(strstr(text, root));
    assert_non_null(strstr(text, "No space left on device"));
    assert_non_null(strstr(text, "continuing read-only"));
    assert_true(st.level[0].write_failures >= 1);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
}

/* An SSD directory whose lock another process holds: the level opens
 * read-only within lock_wait_ms on the caller's thread (the store retries a
 * non-blocking flock; no open thread is left waiting in flock, which under
 * TSan raced with the process's exit), its table says KVT_TIER_READ_ONLY
 * (the store's own read-only mode: the chain writes nothing into it), what
 * it holds still serves, and close leaves no thread behind. */
static void test_ssd_lock_held(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    kvt_chat_identity id;
    load(&m, &t, &id);
    char ref[3][512], got[3][512], root[400], lock[1200];
    run_chat(m, t, NULL, ref, NULL);
    snprintf(root, sizeof root, "%s/locked", dir);
    kvt_tiers_opts o = {.ssd_dir = root, .ssd_lock_wait_ms = 100};
    kvt_tiers *tiers = NULL;
    kvt_cold_tier ct;
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), 0); /* fills the directory */
    assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), 0);
    run_chat(m, t, &ct, got, NULL);
    snprintf(lock, sizeof lock, "%s/.lock", kvt_store_dir(kvt_tiers_store(tiers)));
    assert_int_equal(kvt_tiers_close(tiers, NULL), 0);
    pid_t holder = store_hold_lock(lock, 0);
    assert_true(holder > 0);
    int before = store_thread_count_baseline();
    assert_true(before > 0);
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), 0);
    kvt_tiers_status st;
    kvt_tiers_poll(tiers, &st);
    print_message("lock held: %s: %s\n", kvt_level_mode_name(st.level[0].mode), st.level[0].cause);
    assert_int_equal(st.level[0].mode, KVT_LEVEL_MODE_READ_ONLY);
    assert_non_null(strstr(st.level[0].cause, "its lock is held by another process"));
    assert_int_equal(st.level[0].open_failures, 1);
    assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), 0);
    assert_int_equal(ct.flags & KVT_TIER_READ_ONLY, KVT_TIER_READ_ONLY); /* no level takes writes */
    int64_t reused = 0;
    run_chat(m, t, &ct, got, &reused);
    for (int i = 0; i < 3; i++)
        assert_string_equal(got[i], ref[i]);
    assert_true(reused > 0); /* what the directory holds still serves */
    assert_int_equal(kvt_tiers_close(tiers, &st), 0);
    assert_int_equal(st.level[0].mode, KVT_LEVEL_MODE_READ_ONLY);
    assert_int_equal(st.level[0].write_failures, 0);
    int after = store_thread_count_settle(before);
    print_message("threads before open %d, after close %d\n", before, after);
    assert_int_equal(after, before);
    kill(holder, SIGKILL);
    waitpid(holder, NULL, 0);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
}

/* A disk that fails every write under the SSD level: the write-behind
 * failures inside the store's writer (its spill accepted each entry) show in
 * the service report's "tiers", named "ssd". */
static void test_ssd_report_failures(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    kvt_chat_identity id;
    load(&m, &t, &id);
    char got[3][512], root[400];
    snprintf(root, sizeof root, "%s/failing", dir);
    kvt_store_io io;
    store_faults faults;
    store_faults_init(&faults, &io);
    faults.fail_all = 1;
    faults.err = EIO;
    kvt_tiers_opts o = {.ssd_dir = root, .ssd_io = &io};
    kvt_tiers *tiers = NULL;
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), 0);
    kvt_cold_tier ct;
    assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), 0);
    char *report = NULL;
    run_chat_report(m, t, &ct, kvt_tiers_chain(tiers), lines, got, NULL, &report);
    json_t *doc = json_loads(report, 0, NULL);
    assert_non_null(doc);
    json_t *tiers_a = json_object_get(doc, "tiers");
    assert_int_equal(json_array_size(tiers_a), 1);
    json_t *l0 = json_array_get(tiers_a, 0);
    assert_string_equal(json_string_value(json_object_get(l0, "name")), "ssd");
    assert_int_equal(json_integer_value(json_object_get(l0, "level")), 0);
    json_int_t behind = json_integer_value(json_object_get(l0, "behind_failures"));
    json_int_t stores = json_integer_value(json_object_get(l0, "stores"));
    print_message("level 0 \"ssd\": %lld writes accepted by the chain, %lld failed behind\n", (long long)stores,
                  (long long)behind);
    assert_true(stores >= 1);  /* the chain handed entries to the store's spill, which took them */
    assert_true(behind >= 1);  /* and the store's writer failed them */
    json_decref(doc);
    kvt_string_free(report);
    kvt_tier_stats ls;
    assert_int_equal(kvt_tier_chain_level_stats(kvt_tiers_chain(tiers), 0, &ls), 0);
    assert_int_equal(ls.behind_failures, (uint64_t)behind);
    assert_string_equal(kvt_tier_chain_level_name(kvt_tiers_chain(tiers), 0), "ssd");
    assert_null(kvt_tier_chain_level_name(kvt_tiers_chain(tiers), 1));
    assert_int_equal(kvt_tiers_close(tiers, NULL), 0);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
}

/* The stack's SSD level demotes its budget evictions into the Redis level
 * below it (a real redis-server): while Redis holds every kept prefix (the
 * stack writes each behind into it) an eviction is not sent again
 * (demotions_skipped); once Redis lost them (FLUSHALL), the evicted entries
 * are demoted into it and found there. */
static void test_ssd_demotes_into_redis(void **state)
{
    (void)state;
    if (!have_inputs() || !redis_available("test_ssd_demotes_into_redis"))
        skip();
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    kvt_chat_identity id;
    load(&m, &t, &id);
    static const char *const other[] = {"The dog ran to the park with a red ball.", "Who did the dog meet there?",
                                        "What happened when it rained?"};
    char got[3][512], root[400];
    /* the bytes one conversation takes on disk */
    snprintf(root, sizeof root, "%s/measure", dir);
    kvt_tiers_opts o = {.ssd_dir = root};
    kvt_tiers *tiers = NULL;
    kvt_cold_tier ct;
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), 0);
    assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), 0);
    run_chat(m, t, &ct, got, NULL);
    assert_int_equal(ct.flush(ct.self), 0);
    kvt_store_stats ss;
    kvt_store_get_stats(kvt_tiers_store(tiers), &ss);
    assert_int_equal(kvt_tiers_close(tiers, NULL), 0);
    redis_srv rs;
    assert_int_equal(redis_start(&rs, 64, NULL), 0);
    snprintf(root, sizeof root, "%s/small", dir);
    /* Redis lookups bounded by 1 s (times the build's slowdown), not 50 ms:
     * the demotion writer asks Redis whether it holds an evicted entry
     * within that bound, and a lookup past it on a loaded machine is a miss
     * by design (the entry is demoted again; timeouts in a row make the tier
     * unhealthy, which drops its writes), not what this test checks */
    o = (kvt_tiers_opts){.ssd_dir = root, .ssd_max_bytes = ss.bytes * 3 / 2, .redis_url = rs.url,
                         .redis_timeout_ms = 1000 * KVT_TEST_TIME_SCALE,
                         .redis_restore_timeout_ms = 10000 * KVT_TEST_TIME_SCALE};
    assert_int_equal(kvt_tiers_open(m, &id, &o, &tiers), 0);
    assert_int_equal(kvt_tiers_levels(tiers), 2);
    assert_int_equal(kvt_tiers_cold_tier(tiers, &ct), 0);
    kvt_tier_chain *c = kvt_tiers_chain(tiers);
    assert_string_equal(kvt_tier_chain_level_name(c, 1), "redis");
    run_chat_report(m, t, &ct, c, lines, got, NULL, NULL);
    run_chat_report(m, t, &ct, c, other, got, NULL, NULL); /* the SSD budget evicts the first conversation */
    assert_int_equal(ct.flush(ct.self), 0);
    kvt_tier_stats s0, s1;
    assert_int_equal(kvt_tier_chain_level_stats(c, 0, &s0), 0);
    print_message("redis held everything: ssd %llu evictions, %llu demotions, %llu skipped\n",
                  (unsigned long long)s0.evictions, (unsigned long long)s0.demotions,
                  (unsigned long long)s0.demotions_skipped);
    assert_true(s0.evictions >= 1);
    assert_int_equal(s0.demotions, 0);
    assert_int_equal(s0.demotions_skipped, s0.evictions);
    assert_int_equal(redis_cmd(rs.port, NULL, 0, NULL, "FLUSHALL"), 0);
    uint64_t evicted = s0.evictions;
    run_chat_report(m, t, &ct, c, lines, got, NULL, NULL); /* evicts the second one, which Redis lost */
    assert_int_equal(ct.flush(ct.self), 0);
    assert_int_equal(kvt_tier_chain_level_stats(c, 0, &s0), 0);
    assert_int_equal(kvt_tier_chain_level_stats(c, 1, &s1), 0);
    print_message("after FLUSHALL: ssd %llu evictions, %llu demotions, %llu skipped; redis %llu stores, "
                  "%lld keys\n",
                  (unsigned long long)s0.evictions, (unsigned long long)s0.demotions,
                  (unsigned long long)s0.demotions_skipped, (unsigned long long)s1.stores,
                  redis_count_keys(rs.port, "*"));
    assert_true(s0.evictions > evicted);
    assert_true(s0.demotions >= 1);
    assert_int_equal(s0.demotions + s0.demotions_skipped + s0.demotions_dropped, s0.evictions);
    assert_int_equal(kvt_tiers_close(tiers, NULL), 0);
    redis_stop(&rs);
    kvt_tokenizer_free(t);
    kvt_model_free(m);
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_tiers_XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_options),
        cmocka_unit_test(test_ssd_stack),
        cmocka_unit_test(test_ssd_stack_disk_full),
        cmocka_unit_test(test_ssd_lock_held),
        cmocka_unit_test(test_ssd_report_failures),
        cmocka_unit_test(test_ssd_demotes_into_redis),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
