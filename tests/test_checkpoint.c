/*
 * test_checkpoint.c: generation checkpoints of the cache service
 * (kvtier/service.h, "generation checkpoints") through the step-wise
 * engine API (engine/seq.h) on plain and hybrid (window + recurrent)
 * synthetic models, greedy and seeded sampling (temperature and top-p).
 *
 * - A replayable generation interrupted after k tokens (released as
 *   interrupted), then resumed by a new service over the reopened store
 *   (a restart), gives exactly the reply of an uninterrupted run; the
 *   resume restores floor(k / N) * N tokens' worth of state and prefills
 *   nothing; only the two newest checkpoints stay on disk.
 * - A completed generation removes its checkpoints; a repeat starts fresh.
 * - The newest checkpoint corrupted on disk: the resume takes the older one
 *   and the reply is still exact.
 * - Each field of the metadata that does not match is an error naming it:
 *   prompt, original prompt length, generated count, pending token, seed,
 *   temperature, top-p, RNG position; also checkpoints planted in the store
 *   with inconsistent metadata (the on-disk record of docs/checkpoints.md).
 * - kvt_service_checkpoint's refusals.
 * - checkpoint_sync: every checkpoint is durable when the call returns.
 * - The writes run as background write operations on the process's I/O
 *   worker, not on a thread of their own: while another background
 *   operation holds the worker's one background slot, a checkpoint stays
 *   queued (a newer one of the request supersedes it) and nothing is
 *   written; once the slot is free the newest is written by one write
 *   operation, and a restart resumes from it exactly.
 * - K/V stored as f16, bf16 or q8 (the hybrid model's window layer as a
 *   rotating cache of that dtype): resume after a restart is exact against
 *   an uninterrupted run in the same scheme, from the checkpoint, prefilling
 *   nothing; an f32 service over the same root never resumes from it (the
 *   scheme is part of the identity), and the checkpoints stay for the scheme.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "io_gate.h"
#include "seq.h"
#include "synth_util.h"
#include "tiers.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define VOCAB 259
#define WINDOW 10
#define EVERY 4
#define MAXT 40
#define NPROMPT 21
enum { M_PLAIN, M_HYBRID, M_COUNT };
static const char *const model_name[M_COUNT] = {"plain", "hybrid"};
static const int model_kind[M_COUNT] = {SU_PLAIN, SU_HYBRID};
static char dir[256], model_path[M_COUNT][300], tok_path[300];
static int trial;
static kvt_kv_scheme rig_scheme = KVT_KV_F32; /* the KV storage scheme rig_open sets */
static int rig_sync;                          /* rig_open's checkpoint_sync */

static int group_setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/kvt_test_ckpt_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(tok_path, sizeof tok_path, "%s/tok.bin", dir);
    if (kvt_tokenizer_write_default(tok_path, VOCAB))
        return -1;
    for (int i = 0; i < M_COUNT; i++) {
        snprintf(model_path[i], sizeof model_path[i], "%s/%s.bin", dir, model_name[i]);
        su_synth(model_kind[i], model_path[i], VOCAB, 256, 23, WINDOW);
    }
    return 0;
}

static void rm_rf(const char *path)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    assert_int_equal(system(cmd), 0);
}

static int group_teardown(void **state)
{
    (void)state;
    rm_rf(dir);
    return 0;
}

/* A model, its store under a fresh (or the same) root, and a service with checkpoints. */
typedef struct rig {
    kvt_model *m;
    kvt_store *store;
    kvt_service *svc;
    char root[320];
} rig;

static void rig_open(rig *r, int which, const char *root)
{
    memset(r, 0, sizeof *r);
    snprintf(r->root, sizeof r->root, "%s", root);
    assert_int_equal(kvt_model_load(model_path[which], &r->m), 0);
    assert_int_equal(kvt_model_set_kv_scheme(r->m, rig_scheme), 0);
    kvt_chat_identity id;
    assert_int_equal(kvt_chat_identity_compute(r->m, tok_path, &id), 0);
    assert_int_equal(kvt_chat_store_open(r->m, &id, root, 0, 0, &r->store), 0);
    kvt_chat_service_opts so = {.block_tokens = 8, .checkpoint_store = r->store, .checkpoint_every = EVERY,
                                .checkpoint_sync = rig_sync};
    assert_int_equal(kvt_chat_service_create(r->m, &so, &r->svc), 0);
}

/* A restart: the service and store closed (everything queued made durable);
 * r->root stays for rig_reopen. */
static void rig_close(rig *r)
{
    assert_int_equal(kvt_service_close(r->svc), 0);
    kvt_service_destroy(r->svc);
    assert_int_equal(kvt_store_close(r->store), 0);
    kvt_model_free(r->m);
    r->svc = NULL;
    r->store = NULL;
    r->m = NULL;
}

/* A new process over the same root. */
static void rig_reopen(rig *r, int which)
{
    char root[320];
    snprintf(root, sizeof root, "%s", r->root);
    rig_open(r, which, root);
}

/* rig_open over a root of its own (r->root). */
static void rig_fresh(rig *r, int which)
{
    char root[320];
    snprintf(root, sizeof root, "%s/root%d", dir, trial++);
    rig_open(r, which, root);
}

static void make_prompt(int32_t *p, int n, int salt)
{
    p[0] = KVT_TOKEN_BOS;
    for (int i = 1; i < n; i++)
        p[i] = 3 + (int32_t)(((unsigned)i * 37u + (unsigned)salt * 101u) % (VOCAB - 3));
}

typedef struct run_result {
    int32_t reply[MAXT];
    int64_t n_reply;
    kvt_turn_stats st;
    int rc;              /* kvt_seq_begin's status */
    char err[512];
} run_result;

typedef struct run_args {
    const int32_t *prompt;
    int64_t n_prompt;
    int64_t max_tokens;
    float temp, topp;
    uint64_t seed;
    int seed_explicit;
    const char *id;      /* NULL: not replayable */
    int64_t stop_after;  /* > 0: released as interrupted after this many reply tokens */
} run_args;

/* One generation; the reply is what a client gets: the restored tokens,
 * then every token kvt_seq_next gives. */
static void run(rig *r, const run_args *a, run_result *out)
{
    memset(out, 0, sizeof *out);
    kvt_sampler *sp = NULL;
    assert_int_equal(kvt_sampler_create(VOCAB, a->temp, a->topp, a->seed, &sp), 0);
    kvt_gen_opts o = {.max_tokens = a->max_tokens, .admit_timeout_ms = -1, .request_id = a->id,
                      .seed_explicit = a->seed_explicit};
    kvt_seq *s = NULL;
    out->rc = kvt_seq_begin(r->m, r->svc, sp, a->prompt, a->n_prompt, &o, &s);
    if (out->rc) {
        snprintf(out->err, sizeof out->err, "%s", kvt_last_error());
        kvt_sampler_free(sp);
        return;
    }
    int64_t n;
    const int32_t *rep = kvt_seq_reply(s, &n);
    assert_int_equal(n, kvt_seq_resumed(s));
    memcpy(out->reply, rep, (size_t)n * sizeof *rep);
    out->n_reply = n;
    int done = 0;
    while (!done)
        assert_int_equal(kvt_seq_prefill(s, 5, &done), 0);
    int completed = 1;
    for (;;) {
        int32_t tok;
        int fin;
        assert_int_equal(kvt_seq_next(s, &tok, &fin), 0);
        if (tok >= 0)
            out->reply[out->n_reply++] = tok;
        if (fin)
            break;
        if (a->stop_after > 0 && out->n_reply >= a->stop_after) {
            completed = 0;
            break;
        }
        assert_int_equal(kvt_seq_decode(s), 0);
    }
    assert_int_equal(kvt_seq_finish(s, completed, &out->st), 0);
    kvt_sampler_free(sp);
}

static int64_t store_entries(rig *r)
{
    kvt_store_stats st;
    kvt_store_get_stats(r->store, &st);
    return (int64_t)st.entries;
}

/* The sampling cases: greedy, and seeded temperature + top-p. */
typedef struct sampling {
    float temp, topp;
    uint64_t seed;
} sampling;
static const sampling samplings[2] = {{0.0f, 0.9f, 5}, {0.9f, 0.8f, 77}};

/* The prompt salt whose uninterrupted reply runs the whole MAXT tokens (no
 * stop token), so every interruption point exists. */
static int long_prompt(rig *r, const sampling *sm, int32_t *prompt, run_result *ref)
{
    for (int salt = 1; salt < 200; salt++) {
        make_prompt(prompt, NPROMPT, salt);
        run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = sm->temp,
                      .topp = sm->topp, .seed = sm->seed};
        run(r, &a, ref);
        if (ref->n_reply == MAXT)
            return salt;
    }
    fail_msg("no prompt gives a %d-token reply", MAXT);
    return 0;
}

static void test_resume_exact(void **state)
{
    (void)state;
    static const int64_t stops[] = {3, 4, 5, 9, 17, 24, 38};
    for (int k = 0; k < M_COUNT; k++) {
        for (int t = 0; t < 2; t++) {
            const sampling *sm = &samplings[t];
            rig r;
            rig_fresh(&r, k);
            int32_t prompt[NPROMPT];
            run_result ref;
            long_prompt(&r, sm, prompt, &ref);
            for (size_t i = 0; i < sizeof stops / sizeof *stops; i++) {
                char id[32];
                snprintf(id, sizeof id, "req-%d-%d-%zu", k, t, i);
                run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = sm->temp,
                              .topp = sm->topp, .seed = sm->seed, .seed_explicit = 1, .id = id,
                              .stop_after = stops[i]};
                run_result part, whole;
                run(&r, &a, &part);
                assert_int_equal(part.rc, 0);
                assert_int_equal(part.n_reply, stops[i]);
                assert_memory_equal(part.reply, ref.reply, (size_t)part.n_reply * sizeof(int32_t));
                rig_close(&r); /* a restart */
                rig_reopen(&r, k);
                a.stop_after = 0;
                run(&r, &a, &whole);
                assert_int_equal(whole.rc, 0);
                int64_t g = stops[i] / EVERY * EVERY; /* the newest checkpoint */
                print_message("  %s, %s: interrupted at %lld, resumed %lld reply tokens, %lld prefilled\n",
                              model_name[k], t ? "sampled" : "greedy", (long long)stops[i],
                              (long long)whole.st.resumed_tokens, (long long)whole.st.prefilled_tokens);
                assert_int_equal(whole.st.resumed_tokens, g > 0 ? g - 1 : 0);
                if (g > 0) {
                    assert_int_equal(whole.st.prefilled_tokens, 0);
                    assert_int_equal(whole.st.reused_tokens, NPROMPT);
                }
                assert_int_equal(whole.n_reply, ref.n_reply);
                assert_memory_equal(whole.reply, ref.reply, (size_t)ref.n_reply * sizeof(int32_t));
                /* completed: its checkpoints are gone */
                assert_int_equal(kvt_service_flush(r.svc), 0);
                assert_int_equal(store_entries(&r), 0);
            }
            kvt_checkpoint_stats cs;
            assert_int_equal(kvt_service_checkpoint_stats(r.svc, &cs), 0);
            assert_true(cs.resumes >= 1);
            assert_int_equal(cs.pending, 0);
            rig_close(&r);
        }
    }
}

/* checkpoint_sync: each kvt_service_checkpoint returns once its checkpoint
 * is durable, so right after an interrupted generation (no flush) every
 * checkpoint it took is written, none was superseded in the queue, nothing
 * is pending, and a restart resumes from the newest; written behind decode,
 * the writer would still be on the first (fsync is slower than a decode
 * step of this model). */
static void test_sync_each_durable(void **state)
{
    (void)state;
    rig_sync = 1;
    rig r;
    rig_fresh(&r, M_PLAIN);
    int32_t prompt[NPROMPT];
    run_result ref, part, whole;
    long_prompt(&r, &samplings[0], prompt, &ref);
    run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = samplings[0].temp,
                  .topp = samplings[0].topp, .seed = samplings[0].seed, .id = "sync", .stop_after = 3 * EVERY + 1};
    run(&r, &a, &part);
    assert_int_equal(part.rc, 0);
    kvt_checkpoint_stats cs;
    assert_int_equal(kvt_service_checkpoint_stats(r.svc, &cs), 0);
    print_message("  sync: interrupted at %d: %llu queued, %llu written, %llu superseded, %llu pending\n",
                  3 * EVERY + 1, (unsigned long long)cs.queued, (unsigned long long)cs.written,
                  (unsigned long long)cs.superseded, (unsigned long long)cs.pending);
    assert_int_equal(cs.queued, 3);
    assert_int_equal(cs.written, 3);
    assert_int_equal(cs.superseded, 0);
    assert_int_equal(cs.pending, 0);
    rig_close(&r);
    rig_reopen(&r, M_PLAIN);
    a.stop_after = 0;
    run(&r, &a, &whole);
    assert_int_equal(whole.st.resumed_tokens, 3 * EVERY - 1);
    assert_int_equal(whole.st.prefilled_tokens, 0);
    assert_int_equal(whole.n_reply, ref.n_reply);
    assert_memory_equal(whole.reply, ref.reply, (size_t)ref.n_reply * sizeof(int32_t));
    rig_close(&r);
    rig_sync = 0;
}

static void nap_ms(int ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

static io_gate slot = IO_GATE_INIT; /* file scope: the teardown opens it after a failed assertion */

static int slot_teardown(void **state)
{
    (void)state;
    io_gate_open(&slot);
    return 0;
}

/* The checkpoint writer runs on the I/O worker: with its background slot
 * held, checkpoints wait in the writer's queue (a newer one supersedes the
 * queued one) and nothing is written, however long; released, the newest
 * is written by one write operation and a restart resumes from it. */
static void test_writes_on_io_worker(void **state)
{
    (void)state;
    rig r;
    rig_fresh(&r, M_PLAIN);
    int32_t prompt[NPROMPT];
    run_result ref, part, whole;
    long_prompt(&r, &samplings[0], prompt, &ref);
    kvt_io *io;
    assert_int_equal(kvt_io_default_acquire(&io), 0);
    kvt_io_options o;
    assert_int_equal(kvt_io_options_get(io, &o), 0);
    assert_int_equal(o.max_background, 1); /* the default worker: one background operation at a time */
    io_gate_hold(io, &slot, (kvt_io_key){0x636b70745f736c6full, 1}, KVT_IO_BACKGROUND);
    kvt_io_stats before;
    assert_int_equal(kvt_io_stats_get(io, &before), 0);

    run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = samplings[0].temp,
                  .topp = samplings[0].topp, .seed = samplings[0].seed, .id = "on-worker",
                  .stop_after = 2 * EVERY + 1};
    run(&r, &a, &part); /* checkpoints at EVERY and 2 * EVERY generated tokens; kept (interrupted) */
    assert_int_equal(part.rc, 0);
    kvt_checkpoint_stats cs;
    kvt_io_stats during;
    /* nothing can be written while the slot is held: look for a while */
    for (int i = 0; i < 10; i++) {
        nap_ms(30 * KVT_TEST_TIME_SCALE);
        assert_int_equal(kvt_service_checkpoint_stats(r.svc, &cs), 0);
        if (cs.written)
            break;
    }
    assert_int_equal(kvt_io_stats_get(io, &during), 0);
    print_message("  slot held: %llu queued, %llu written, %llu superseded, %llu pending; worker write ops "
                  "queued %llu\n", (unsigned long long)cs.queued, (unsigned long long)cs.written,
                  (unsigned long long)cs.superseded, (unsigned long long)cs.pending,
                  (unsigned long long)during.by_kind[KVT_IO_KIND_WRITE].queued_ops);
    assert_int_equal(cs.queued, 2);
    assert_int_equal(cs.written, 0);
    assert_int_equal(cs.superseded, 1);
    assert_int_equal(cs.pending, 1);
    assert_int_equal(during.by_kind[KVT_IO_KIND_WRITE].queued_ops, 1);

    io_gate_open(&slot);
    assert_int_equal(kvt_service_flush(r.svc), 0);
    /* the writer's job is done; the worker counts its operation as it
     * returns: wait for the worker to be idle before reading its counters */
    assert_int_equal(kvt_io_flush(io, 10000ull * KVT_TEST_TIME_SCALE), 0);
    kvt_io_stats after;
    assert_int_equal(kvt_io_stats_get(io, &after), 0);
    assert_int_equal(kvt_service_checkpoint_stats(r.svc, &cs), 0);
    print_message("  released: %llu written, %llu pending; worker write ops submitted %llu, ran %llu\n",
                  (unsigned long long)cs.written, (unsigned long long)cs.pending,
                  (unsigned long long)(after.by_kind[KVT_IO_KIND_WRITE].submitted -
                                       before.by_kind[KVT_IO_KIND_WRITE].submitted),
                  (unsigned long long)(after.by_kind[KVT_IO_KIND_WRITE].ran - before.by_kind[KVT_IO_KIND_WRITE].ran));
    assert_int_equal(cs.written, 1);
    assert_int_equal(cs.pending, 0);
    assert_int_equal(cs.failed, 0);
    assert_int_equal(after.by_kind[KVT_IO_KIND_WRITE].submitted - before.by_kind[KVT_IO_KIND_WRITE].submitted, 1);
    assert_int_equal(after.by_kind[KVT_IO_KIND_WRITE].ran - before.by_kind[KVT_IO_KIND_WRITE].ran, 1);
    assert_int_equal(after.by_kind[KVT_IO_KIND_WRITE].failed - before.by_kind[KVT_IO_KIND_WRITE].failed, 0);
    kvt_io_default_release(io);
    rig_close(&r);
    rig_reopen(&r, M_PLAIN);
    a.stop_after = 0;
    run(&r, &a, &whole);
    assert_int_equal(whole.st.resumed_tokens, 2 * EVERY - 1);
    assert_int_equal(whole.st.prefilled_tokens, 0);
    assert_int_equal(whole.n_reply, ref.n_reply);
    assert_memory_equal(whole.reply, ref.reply, (size_t)ref.n_reply * sizeof(int32_t));
    rig_close(&r);
}

static void test_keeps_two_and_completed_removes(void **state)
{
    (void)state;
    rig r;
    rig_fresh(&r, M_HYBRID);
    int32_t prompt[NPROMPT];
    run_result ref, part, again;
    long_prompt(&r, &samplings[1], prompt, &ref);
    run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = samplings[1].temp,
                  .topp = samplings[1].topp, .seed = samplings[1].seed, .id = "keep", .stop_after = 30};
    run(&r, &a, &part);
    assert_int_equal(kvt_service_flush(r.svc), 0);
    kvt_checkpoint_stats cs;
    assert_int_equal(kvt_service_checkpoint_stats(r.svc, &cs), 0);
    print_message("  checkpoints at 4..28: queued %llu, written %llu, superseded in the queue %llu, removed %llu\n",
                  (unsigned long long)cs.queued, (unsigned long long)cs.written, (unsigned long long)cs.superseded,
                  (unsigned long long)cs.removed);
    /* a checkpoint waiting in the queue is replaced by a newer one; the
     * newest (28) is always written; at most two stay */
    assert_int_equal(cs.queued, 7);
    assert_int_equal(cs.written + cs.superseded, 7);
    assert_true(store_entries(&r) >= 1 && store_entries(&r) <= 2);
    assert_int_equal((int64_t)cs.removed, (int64_t)cs.written - store_entries(&r));
    /* interrupted again at 33 and 37 (each resume writes the next one): 32 and 36 stay */
    a.stop_after = 33;
    run(&r, &a, &part);
    assert_int_equal(part.st.resumed_tokens, 27);
    assert_int_equal(kvt_service_flush(r.svc), 0);
    a.stop_after = 37;
    run(&r, &a, &part);
    assert_int_equal(part.st.resumed_tokens, 31);
    assert_int_equal(kvt_service_flush(r.svc), 0);
    assert_int_equal(store_entries(&r), 2);
    /* the interrupted one resumes and completes: nothing stays */
    a.stop_after = 0;
    run(&r, &a, &part);
    assert_int_equal(part.st.resumed_tokens, 35);
    assert_memory_equal(part.reply, ref.reply, sizeof ref.reply);
    assert_int_equal(kvt_service_flush(r.svc), 0);
    assert_int_equal(store_entries(&r), 0);
    /* a repeat of a completed request starts fresh (and is the same) */
    run(&r, &a, &again);
    assert_int_equal(again.st.resumed_tokens, 0);
    assert_int_equal(again.st.prefilled_tokens, NPROMPT);
    assert_memory_equal(again.reply, ref.reply, sizeof ref.reply);
    /* not seed_explicit: the resumed run takes the checkpoint's seed */
    a.stop_after = 10;
    run(&r, &a, &part);
    a.stop_after = 0;
    a.seed = 999;
    run(&r, &a, &again);
    assert_int_equal(again.rc, 0);
    assert_int_equal(again.st.resumed_tokens, 7);
    assert_memory_equal(again.reply, ref.reply, sizeof ref.reply);
    rig_close(&r);
}

/* The entry shard holding the most tokens (kvt_store_walk: headers only). */
typedef struct newest_file {
    char path[700];
    int64_t n_tokens;
    int entries;
    const char *root;
} newest_file;

static int find_newest(void *ctx, const kvt_store_shard_info *info)
{
    newest_file *n = ctx;
    if (info->type != 'e')
        return 0;
    n->entries++;
    if (info->n_tokens > n->n_tokens) {
        n->n_tokens = info->n_tokens;
        snprintf(n->path, sizeof n->path, "%s/%s/%s", n->root, info->dir, info->file);
    }
    return 0;
}

static void test_corrupt_newest_takes_older(void **state)
{
    (void)state;
    rig r;
    rig_fresh(&r, M_PLAIN);
    int32_t prompt[NPROMPT];
    run_result ref, part, whole;
    long_prompt(&r, &samplings[1], prompt, &ref);
    run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = samplings[1].temp,
                  .topp = samplings[1].topp, .seed = samplings[1].seed, .seed_explicit = 1, .id = "corrupt",
                  .stop_after = 9};
    run(&r, &a, &part);
    assert_int_equal(kvt_service_flush(r.svc), 0); /* the checkpoint at 8 */
    a.stop_after = 13;
    run(&r, &a, &part); /* resumes at 8, writes 12 */
    rig_close(&r);
    /* two entry files (checkpoints at 8 and 12): flip the last payload byte
     * of the one holding 12 */
    newest_file nf = {.root = r.root};
    assert_int_equal(kvt_store_walk(r.root, 0, find_newest, &nf), 0);
    assert_int_equal(nf.entries, 2);
    assert_int_equal(nf.n_tokens, NPROMPT + 11);
    int fd = open(nf.path, O_RDWR);
    assert_true(fd >= 0);
    off_t end = lseek(fd, 0, SEEK_END);
    unsigned char b;
    assert_int_equal(pread(fd, &b, 1, end - 1), 1);
    b ^= 0x5a;
    assert_int_equal(pwrite(fd, &b, 1, end - 1), 1);
    close(fd);
    rig_reopen(&r, M_PLAIN);
    a.stop_after = 0;
    run(&r, &a, &whole);
    assert_int_equal(whole.rc, 0);
    assert_int_equal(whole.st.resumed_tokens, 7); /* the checkpoint at 8 */
    assert_memory_equal(whole.reply, ref.reply, sizeof ref.reply);
    kvt_checkpoint_stats cs;
    assert_int_equal(kvt_service_checkpoint_stats(r.svc, &cs), 0);
    assert_int_equal(cs.unreadable, 1);
    rig_close(&r);
}

/* ---- mismatches ---------------------------------------------------------------------------- */

static void expect_mismatch(rig *r, const run_args *a, const char *field)
{
    run_result got;
    run(r, a, &got);
    print_message("  %-24s -> %s\n", field, got.err);
    assert_int_equal(got.rc, KVT_EMISMATCH);
    if (!strstr(got.err, field))
        fail_msg("the error does not name '%s': %s", field, got.err);
}

static void test_mismatch_each_field(void **state)
{
    (void)state;
    rig r;
    rig_fresh(&r, M_HYBRID);
    int32_t prompt[NPROMPT];
    run_result ref, part;
    long_prompt(&r, &samplings[1], prompt, &ref);
    run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = samplings[1].temp,
                  .topp = samplings[1].topp, .seed = samplings[1].seed, .seed_explicit = 1, .id = "mm",
                  .stop_after = 10};
    run(&r, &a, &part);
    assert_int_equal(kvt_service_flush(r.svc), 0);

    run_args b = a;
    b.stop_after = 0;
    int32_t other[NPROMPT + 1];
    memcpy(other, prompt, sizeof prompt);
    other[NPROMPT - 3] = other[NPROMPT - 3] == 5 ? 6 : 5;
    b.prompt = other;
    expect_mismatch(&r, &b, "another prompt");
    other[NPROMPT] = 7;
    b.n_prompt = NPROMPT + 1;
    expect_mismatch(&r, &b, "original prompt length");
    b = a;
    b.stop_after = 0;
    b.max_tokens = 5; /* the checkpoint holds 8 generated tokens */
    expect_mismatch(&r, &b, "generated count");
    b = a;
    b.stop_after = 0;
    b.seed = 78;
    expect_mismatch(&r, &b, "seed");
    b = a;
    b.stop_after = 0;
    b.temp = 0.7f;
    expect_mismatch(&r, &b, "temperature");
    b = a;
    b.stop_after = 0;
    b.topp = 0.5f;
    expect_mismatch(&r, &b, "top-p");
    kvt_checkpoint_stats cs;
    assert_int_equal(kvt_service_checkpoint_stats(r.svc, &cs), 0);
    assert_int_equal(cs.mismatches, 6);

    /* pending token outside the vocabulary: through kvt_service_resume */
    kvt_request req = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT};
    kvt_admission *adm = NULL;
    assert_int_equal(kvt_service_admit(r.svc, &req, &adm), 0);
    kvt_replay rp = {.request_id = "mm", .seed = a.seed, .seed_explicit = 1, .temperature = a.temp,
                     .topp = a.topp, .vocab_size = ref.reply[7]}; /* the pending token of the checkpoint at 8 */
    kvt_state st;
    kvt_checkpoint_info info;
    int32_t reply[MAXT];
    assert_int_equal(kvt_service_resume(r.svc, adm, &rp, &st, &info, reply, MAXT), KVT_EMISMATCH);
    print_message("  %-24s -> %s\n", "pending token", kvt_last_error());
    assert_non_null(strstr(kvt_last_error(), "pending token"));
    /* a matching one: the state and metadata come back */
    rp.vocab_size = VOCAB;
    assert_int_equal(kvt_service_resume(r.svc, adm, &rp, &st, &info, reply, MAXT), 0);
    assert_int_equal(info.generated_tokens, 8);
    assert_int_equal(info.prompt_tokens, NPROMPT);
    assert_int_equal(info.pending_token, ref.reply[7]);
    assert_int_equal(info.seed, a.seed);
    assert_int_equal(info.rng_draws, 8);
    assert_int_equal(info.rng_state, kvt_sampler_state_after(a.seed, 8));
    assert_memory_equal(reply, ref.reply, 8 * sizeof(int32_t));
    assert_int_equal(st.reused_tokens, NPROMPT);
    assert_int_equal(kvt_cache_offset(st.caches[0]), NPROMPT + 7);
    /* replayable once */
    kvt_state st2;
    assert_int_equal(kvt_service_resume(r.svc, adm, &rp, &st2, &info, reply, MAXT), KVT_EINVAL);
    kvt_state_clear(&st);
    kvt_service_release(r.svc, adm, 0);
    /* the mismatches removed nothing: the right request still resumes */
    b = a;
    b.stop_after = 0;
    run_result whole;
    run(&r, &b, &whole);
    assert_int_equal(whole.rc, 0);
    assert_int_equal(whole.st.resumed_tokens, 7);
    assert_memory_equal(whole.reply, ref.reply, sizeof ref.reply);
    rig_close(&r);
}

/* The namespace of a request's checkpoints, as docs/checkpoints.md gives it. */
static void ckpt_ns(const char *id, const char *ns, char out[64])
{
    char buf[300];
    size_t a = strlen(id) + 1, b = strlen(ns);
    memcpy(buf, id, a);
    memcpy(buf + a, ns, b);
    XXH128_hash_t h = XXH3_128bits(buf, a + b);
    snprintf(out, 64, "checkpoint:%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
}

static void le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Writes a checkpoint entry straight into the store: the caches of a
 * prefill of prompt + fed, and the metadata record as given. */
static void plant(rig *r, const char *id, const int32_t *tokens, int64_t n_tokens, int64_t prompt_tokens,
                  int64_t generated, int32_t pending, uint64_t seed, uint64_t rng_state, uint64_t draws, float temp,
                  float topp)
{
    const kvt_model_config *c = kvt_model_get_config(r->m);
    kvt_cache *caches[8] = {0};
    assert_int_equal(kvt_model_new_caches(r->m, 8, caches), 0);
    assert_int_equal(kvt_model_prefill(r->m, caches, tokens, n_tokens, NULL), 0);
    uint8_t meta[80] = {0};
    memcpy(meta, "KVTGEN\r\n", 8);
    le32(meta + 8, 1);
    le32(meta + 12, 80);
    le64(meta + 16, (uint64_t)prompt_tokens);
    le64(meta + 24, (uint64_t)generated);
    le32(meta + 32, (uint32_t)pending);
    uint32_t tb, pb;
    memcpy(&tb, &temp, 4);
    memcpy(&pb, &topp, 4);
    le32(meta + 36, tb);
    le32(meta + 40, pb);
    le64(meta + 48, seed);
    le64(meta + 56, rng_state);
    le64(meta + 64, draws);
    kvt_attachment *att = NULL;
    assert_int_equal(kvt_attachment_blob("kvtier.generation", meta, sizeof meta, &att), 0);
    char ns[64];
    ckpt_ns(id, "", ns);
    kvt_entry e = {.ns = ns, .tokens = tokens, .n_tokens = n_tokens, .caches = caches, .n_caches = c->n_layers,
                   .attachments = &att, .n_attachments = 1};
    assert_int_equal(kvt_store_put(r->store, &e), 0);
    kvt_attachment_destroy(att);
    kvt_caches_destroy(caches, c->n_layers);
}

static void test_planted_metadata(void **state)
{
    (void)state;
    rig r;
    rig_fresh(&r, M_PLAIN);
    int32_t prompt[NPROMPT];
    run_result ref, got;
    const sampling *sm = &samplings[1];
    long_prompt(&r, sm, prompt, &ref);
    int32_t toks[NPROMPT + MAXT];
    memcpy(toks, prompt, sizeof prompt);
    memcpy(toks + NPROMPT, ref.reply, sizeof ref.reply);
    uint64_t good = kvt_sampler_state_after(sm->seed, 8);
    run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = sm->temp, .topp = sm->topp,
                  .seed = sm->seed, .seed_explicit = 1};
    /* a correct planted record resumes exactly (the format is the documented one) */
    plant(&r, "p-ok", toks, NPROMPT + 7, NPROMPT, 8, ref.reply[7], sm->seed, good, 8, sm->temp, sm->topp);
    a.id = "p-ok";
    run(&r, &a, &got);
    assert_int_equal(got.rc, 0);
    assert_int_equal(got.st.resumed_tokens, 7);
    assert_int_equal(got.st.prefilled_tokens, 0);
    assert_memory_equal(got.reply, ref.reply, 8 * sizeof(int32_t)); /* the planted caches came from a prefill */
    /* the generated count disagrees with the tokens the entry holds */
    plant(&r, "p-gen", toks, NPROMPT + 7, NPROMPT, 9, ref.reply[7], sm->seed, good, 8, sm->temp, sm->topp);
    a.id = "p-gen";
    expect_mismatch(&r, &a, "generated count");
    /* the original prompt length disagrees with the request's */
    plant(&r, "p-len", toks, NPROMPT + 7, NPROMPT - 1, 9, ref.reply[7], sm->seed, good, 8, sm->temp, sm->topp);
    a.id = "p-len";
    expect_mismatch(&r, &a, "original prompt length");
    /* a negative pending token */
    plant(&r, "p-pend", toks, NPROMPT + 7, NPROMPT, 8, -3, sm->seed, good, 8, sm->temp, sm->topp);
    a.id = "p-pend";
    expect_mismatch(&r, &a, "pending token");
    /* another seed */
    plant(&r, "p-seed", toks, NPROMPT + 7, NPROMPT, 8, ref.reply[7], sm->seed + 1, good, 8, sm->temp, sm->topp);
    a.id = "p-seed";
    expect_mismatch(&r, &a, "seed");
    /* a generator state that does not follow from seed and position */
    plant(&r, "p-rng", toks, NPROMPT + 7, NPROMPT, 8, ref.reply[7], sm->seed,
          kvt_sampler_state_after(sm->seed, 7), 8, sm->temp, sm->topp);
    a.id = "p-rng";
    expect_mismatch(&r, &a, "RNG position");
    rig_close(&r);
}

static void test_checkpoint_refusals(void **state)
{
    (void)state;
    rig r;
    rig_fresh(&r, M_PLAIN);
    assert_int_equal(kvt_service_checkpoint_every(r.svc), EVERY);
    int32_t prompt[NPROMPT];
    make_prompt(prompt, NPROMPT, 3);
    kvt_request req = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = 8};
    kvt_admission *adm = NULL;
    assert_int_equal(kvt_service_admit(r.svc, &req, &adm), 0);
    kvt_state st;
    assert_int_equal(kvt_service_acquire(r.svc, adm, &st), 0);
    assert_int_equal(kvt_model_prefill(r.m, st.caches, prompt, NPROMPT, NULL), 0);
    kvt_checkpoint_info info = {.prompt_tokens = NPROMPT, .generated_tokens = 1, .pending_token = 5, .seed = 9};
    /* not replayable */
    assert_int_equal(kvt_service_checkpoint(r.svc, adm, st.caches, prompt, NPROMPT, &info), KVT_EUNSUPPORTED);
    kvt_state_clear(&st);
    kvt_service_release(r.svc, adm, 0);

    assert_int_equal(kvt_service_admit(r.svc, &req, &adm), 0);
    kvt_replay rp = {.request_id = "refusals", .seed = 9, .seed_explicit = 1};
    int32_t reply[8];
    assert_int_equal(kvt_service_resume(r.svc, adm, &rp, &st, &info, reply, 7), KVT_EINVAL); /* reply_cap */
    rp.request_id = "";
    assert_int_equal(kvt_service_resume(r.svc, adm, &rp, &st, &info, reply, 8), KVT_EINVAL);
    rp.request_id = "bad\nid";
    assert_int_equal(kvt_service_resume(r.svc, adm, &rp, &st, &info, reply, 8), KVT_EINVAL);
    rp.request_id = "refusals";
    assert_int_equal(kvt_service_resume(r.svc, adm, &rp, &st, &info, reply, 8), 0);
    assert_int_equal(info.generated_tokens, 0);
    assert_int_equal(kvt_model_prefill(r.m, st.caches, prompt, NPROMPT, NULL), 0);
    kvt_checkpoint_info ck = {.prompt_tokens = NPROMPT, .generated_tokens = 1, .pending_token = 5, .seed = 9};
    assert_int_equal(kvt_service_checkpoint(r.svc, adm, st.caches, prompt, NPROMPT - 1, &ck), KVT_EINVAL);
    ck.seed = 10;
    assert_int_equal(kvt_service_checkpoint(r.svc, adm, st.caches, prompt, NPROMPT, &ck), KVT_EINVAL);
    ck.seed = 9;
    ck.generated_tokens = 9; /* over max_tokens */
    assert_int_equal(kvt_service_checkpoint(r.svc, adm, st.caches, prompt, NPROMPT + 8, &ck), KVT_EINVAL);
    ck.generated_tokens = 2; /* the caches hold one token fewer than 2 generated need */
    assert_int_equal(kvt_service_checkpoint(r.svc, adm, st.caches, prompt, NPROMPT + 1, &ck), KVT_EINVAL);
    ck.generated_tokens = 1;
    assert_int_equal(kvt_service_checkpoint(r.svc, adm, st.caches, prompt, NPROMPT, &ck), 0);
    kvt_state_clear(&st);
    kvt_service_release(r.svc, adm, 0);
    assert_int_equal(kvt_service_flush(r.svc), 0);
    assert_int_equal(store_entries(&r), 1);
    rig_close(&r);
}

static void test_resume_exact_schemes(void **state)
{
    (void)state;
    static const int64_t stops[] = {5, 17};
    static const kvt_kv_scheme schemes[] = {KVT_KV_F16, KVT_KV_BF16, KVT_KV_Q8};
    for (size_t si = 0; si < sizeof schemes / sizeof *schemes; si++) {
        for (int k = 0; k < M_COUNT; k++) {
            rig_scheme = schemes[si];
            rig r;
            rig_fresh(&r, k);
            assert_int_equal(kvt_model_kv_scheme(r.m), schemes[si]);
            int32_t prompt[NPROMPT];
            run_result ref;
            long_prompt(&r, &samplings[0], prompt, &ref); /* greedy, uninterrupted, in this scheme */
            for (size_t i = 0; i < sizeof stops / sizeof *stops; i++) {
                char id[48];
                snprintf(id, sizeof id, "req-%s-%d-%zu", kvt_kv_scheme_name(schemes[si]), k, i);
                run_args a = {.prompt = prompt, .n_prompt = NPROMPT, .max_tokens = MAXT, .temp = 0.0f,
                              .topp = 0.9f, .seed = 5, .seed_explicit = 1, .id = id, .stop_after = stops[i]};
                run_result part, whole, other;
                run(&r, &a, &part);
                assert_int_equal(part.rc, 0);
                assert_int_equal(part.n_reply, stops[i]);
                assert_memory_equal(part.reply, ref.reply, (size_t)part.n_reply * sizeof(int32_t));
                rig_close(&r);
                /* the same root in f32: nothing of this scheme resumes there */
                rig_scheme = KVT_KV_F32;
                rig_reopen(&r, k);
                run_args fa = a;
                fa.stop_after = 3; /* interrupted again: f32's own checkpoints, never the scheme's */
                run(&r, &fa, &other);
                assert_int_equal(other.rc, 0);
                assert_int_equal(other.st.resumed_tokens, 0);
                assert_int_equal(other.st.reused_tokens, 0);
                rig_close(&r);
                rig_scheme = schemes[si];
                rig_reopen(&r, k);
                a.stop_after = 0;
                run(&r, &a, &whole);
                assert_int_equal(whole.rc, 0);
                int64_t g = stops[i] / EVERY * EVERY;
                print_message("  %s, %s: interrupted at %lld, resumed %lld reply tokens, %lld prefilled\n",
                              kvt_kv_scheme_name(schemes[si]), model_name[k], (long long)stops[i],
                              (long long)whole.st.resumed_tokens, (long long)whole.st.prefilled_tokens);
                assert_int_equal(whole.st.resumed_tokens, g - 1);
                assert_int_equal(whole.st.prefilled_tokens, 0);
                assert_int_equal(whole.st.reused_tokens, NPROMPT);
                assert_int_equal(whole.n_reply, ref.n_reply);
                assert_memory_equal(whole.reply, ref.reply, (size_t)ref.n_reply * sizeof(int32_t));
            }
            rig_close(&r);
        }
    }
    rig_scheme = KVT_KV_F32;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resume_exact),
        cmocka_unit_test(test_sync_each_durable),
        cmocka_unit_test_teardown(test_writes_on_io_worker, slot_teardown),
        cmocka_unit_test(test_keeps_two_and_completed_removes),
        cmocka_unit_test(test_corrupt_newest_takes_older),
        cmocka_unit_test(test_mismatch_each_field),
        cmocka_unit_test(test_planted_metadata),
        cmocka_unit_test(test_checkpoint_refusals),
        cmocka_unit_test(test_resume_exact_schemes),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
