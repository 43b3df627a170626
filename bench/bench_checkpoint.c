/*
 * bench_checkpoint.c: `kvtier bench checkpoint`: what generation checkpoints
 * cost decode, measured in one run against its baseline. The same generation
 * (llama2.c-exact, kvt_generate_ex: prompt, --steps positions, seeded
 * sampling) runs alternately without checkpoints (plain kvt_generate: what
 * `kvtier generate` does without --request-id) and replayable with a
 * checkpoint every --every generated tokens (16 by default: the clone on the
 * decode thread, the durable write as a background write operation on the
 * process's I/O worker (docs/io.md) through the SSD store under a temporary directory, removed at the end). Prints the
 * median decode tokens/s of each, their ratio, and the writer's counters;
 * checks that both runs printed the same text. Default model: stories260K
 * under $KVT_SHARED_DIR (else ../shared) when it is there, else the built-in
 * one; --model/--tokenizer for another.
 * Owns nothing beyond the run: the temporary store directory is removed.
 */
#include "args.h"
#include "bench_util.h"
#include "chat.h"
#include "cli.h"
#include "generate.h"
#include "tiers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier bench checkpoint [--model M.bin --tokenizer T.bin] [--steps N] [--every N]\n"
            "                               [--runs N] [--prompt TEXT] [--threads N]\n"
            "\n"
            "Decode tokens/s of one generation without checkpoints and with a checkpoint every\n"
            "--every generated tokens (default 16; written behind decode to an SSD store in a\n"
            "temporary directory), alternating, --runs of each (default 9); prints the medians\n"
            "and their ratio (the goal: within 10%%). Default model: stories260K under\n"
            "$KVT_SHARED_DIR (else ../shared) when present, else the built-in one; --steps default\n"
            "512 (capped at the model's seq_len), --prompt default \"Once upon a time\".\n");
}

static int fail(const char *what, int rc)
{
    fprintf(stderr, "kvtier bench checkpoint: %s: %s (%s)\n", what, kvt_strerror(rc), kvt_last_error());
    return 1;
}

/* One generation into `out` (rewound first). */
static int one_run(kvt_model *m, const kvt_tokenizer *tok, const char *prompt, long steps, kvt_service *svc,
                   const char *id, FILE *out, kvt_generate_stats *st)
{
    kvt_sampler *sp = NULL;
    int rc = kvt_sampler_create(kvt_model_get_config(m)->vocab_size, 0.8f, 0.9f, 20261201, &sp);
    if (rc)
        return rc;
    rewind(out);
    kvt_generate_replay rp = {.svc = svc, .request_id = id, .seed_explicit = 1};
    rc = kvt_generate_ex(m, tok, sp, prompt, steps, 256, svc ? &rp : NULL, out, st);
    fflush(out);
    kvt_sampler_free(sp);
    return rc;
}

static char *slurp(FILE *f)
{
    long n = ftell(f);
    char *b = calloc(1, (size_t)(n > 0 ? n : 0) + 1);
    if (b && n > 0) {
        rewind(f);
        if (fread(b, 1, (size_t)n, f) != (size_t)n)
            b[0] = '\0';
    }
    return b;
}

int kvt_bench_checkpoint(int argc, char **argv)
{
    const char *model_path = NULL, *tok_path = NULL, *prompt = "Once upon a time";
    long long steps = 512, every = 16, runs = 9, threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvtier bench checkpoint: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "--model"))
            model_path = v;
        else if (!strcmp(a, "--tokenizer"))
            tok_path = v;
        else if (!strcmp(a, "--prompt"))
            prompt = v;
        else if (!strcmp(a, "--steps"))
            bad = kvt_cli_int(v, 2, 1 << 20, &steps);
        else if (!strcmp(a, "--every"))
            bad = kvt_cli_int(v, 1, 1 << 20, &every);
        else if (!strcmp(a, "--runs"))
            bad = kvt_cli_int(v, 1, 64, &runs);
        else if (!strcmp(a, "--threads"))
            bad = kvt_cli_int(v, 1, KVT_MODEL_MAX_THREADS, &threads);
        else {
            fprintf(stderr, "kvtier bench checkpoint: unknown flag '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvtier bench checkpoint: %s: invalid value '%s'\n", a, v);
            return 2;
        }
    }
    char sm[4096], st[4096];
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(sm, sizeof sm, "%s/data/models/stories260K.bin", shared && *shared ? shared : "../shared");
    snprintf(st, sizeof st, "%s/data/models/tok512.bin", shared && *shared ? shared : "../shared");
    if (!model_path && !tok_path && access(sm, R_OK) == 0 && access(st, R_OK) == 0) {
        model_path = sm;
        tok_path = st;
    }
    kvt_model *m = NULL;
    kvt_tokenizer *tok = NULL;
    char mp[4096], tp[4096];
    int rc = kvt_chat_load_paths(model_path, tok_path, &m, &tok, mp, tp, sizeof mp);
    if (rc)
        return fail("cannot load the model", rc);
    if (threads && (rc = kvt_model_set_threads(m, (int)threads)))
        return fail("cannot start the engine threads", rc);
    char dir[] = "/tmp/kvt_bench_ckpt_XXXXXX";
    kvt_store *store = NULL;
    kvt_service *svc = NULL;
    FILE *out_a = tmpfile(), *out_b = tmpfile();
    int status = 1;
    kvt_chat_identity id;
    if (!mkdtemp(dir) || !out_a || !out_b) {
        fprintf(stderr, "kvtier bench checkpoint: cannot make a temporary directory or file\n");
        goto done;
    }
    if ((rc = kvt_chat_identity_compute(m, tp, &id)) || (rc = kvt_chat_store_open(m, &id, dir, 0, 0, &store))) {
        status = fail("cannot open the store", rc);
        goto done;
    }
    kvt_chat_service_opts so = {.checkpoint_store = store, .checkpoint_every = every};
    if ((rc = kvt_chat_service_create(m, &so, &svc))) {
        status = fail("cannot create the service", rc);
        goto done;
    }
    const kvt_model_config *c = kvt_model_get_config(m);
    printf("checkpoint cost: %s (dim %d, %d layers), %lld positions, temperature 0.8, top-p 0.9, seed fixed; "
           "%lld runs each, alternating\n", mp, (int)c->dim, (int)c->n_layers, steps, runs);
    double off[64], on[64];
    long long ckpts = 0, decoded = 0;
    int same = 1;
    for (int r = 0; r < runs; r++) {
        kvt_generate_stats a, b;
        char rid[32];
        snprintf(rid, sizeof rid, "bench-%d", r);
        if ((rc = one_run(m, tok, prompt, steps, NULL, NULL, out_a, &a)) ||
            (rc = one_run(m, tok, prompt, steps, svc, rid, out_b, &b))) {
            status = fail("generation failed", rc);
            goto done;
        }
        off[r] = a.decode_tok_s;
        on[r] = b.decode_tok_s;
        ckpts += b.checkpoints;
        decoded = b.decode_tokens;
        char *ta = slurp(out_a), *tb = slurp(out_b);
        same &= ta && tb && !strcmp(ta, tb);
        free(ta);
        free(tb);
        printf("  run %d: without %.1f tok/s, with --checkpoint-every %lld %.1f tok/s (%lld checkpoints)\n", r,
               a.decode_tok_s, every, b.decode_tok_s, (long long)b.checkpoints);
    }
    if ((rc = kvt_service_flush(svc))) {
        status = fail("the checkpoint writer failed", rc);
        goto done;
    }
    kvt_checkpoint_stats cs;
    kvt_service_checkpoint_stats(svc, &cs);
    double mo = kvt_bench_util_median(off, runs), mn = kvt_bench_util_median(on, runs);
    printf("decode, median of %lld: without checkpoints %.1f tok/s, with a checkpoint every %lld tokens %.1f tok/s: "
           "%.3fx (%+.1f%%; goal: within 10%%)\n", runs, mo, every, mn, mn / mo, (mn / mo - 1.0) * 100.0);
    printf("checkpoints: %lld taken over %lld runs of %lld decoded tokens; writer: %llu written, %llu superseded in "
           "its queue, %llu dropped, %llu failed, %llu removed; output %s\n", ckpts, runs, decoded,
           (unsigned long long)cs.written, (unsigned long long)cs.superseded, (unsigned long long)cs.dropped,
           (unsigned long long)cs.failed, (unsigned long long)cs.removed, same ? "identical" : "DIFFERS");
    status = same ? 0 : 1;
done:
    if (svc)
        kvt_service_close(svc);
    kvt_service_destroy(svc);
    kvt_store_close(store);
    if (dir[sizeof dir - 2] != 'X') {
        char cmd[200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "kvtier bench checkpoint: could not remove %s\n", dir);
    }
    if (out_a)
        fclose(out_a);
    if (out_b)
        fclose(out_b);
    kvt_tokenizer_free(tok);
    kvt_model_free(m);
    return status;
}
