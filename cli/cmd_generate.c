/*
 * cmd_generate.c: `kvtier generate`: text generation with the reference
 * engine, printing on stdout exactly what llama2.c `run` prints and the
 * prefill/decode speed on stderr. It owns argument parsing and the lifetime
 * of the model, tokenizer and sampler of one run. It must never print
 * anything but the generated text on stdout (errors and timing go to stderr).
 */
#include "args.h"
#include "chat.h"
#include "cli.h"
#include "generate.h"
#include "tiers.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier generate [--model M.bin --tokenizer T.bin] [--prompt TEXT] [--steps N]\n"
            "                       [--temperature T] [--top-p P] [--seed S] [--block-tokens B]\n"
            "                       [--threads N] [--kv-dtype f32|f16|bf16|q8]\n"
            "                       [--request-id ID --ssd-cache DIR [--checkpoint-every N] [--checkpoint-sync]]\n"
            "                       [--live-cache-blocks N] [--live-cache-bytes B] [--live-cache-dir DIR]\n"
            "                       [--live-cache-strict]\n"
            "\n"
            "Generates text with the reference engine and prints on stdout exactly what llama2.c\n"
            "`run M.bin -z T.bin -i TEXT -n N -t T -p P -s S` prints; then, on stderr,\n"
            "\"prefill: X tok/s, decode: Y tok/s\" (a part that ran no token says \"0 tokens\"; a run\n"
            "resumed from its checkpoint says \"prefill: 0 tokens (N restored from the checkpoint)\"\n"
            "when it prefilled nothing); with --request-id also a \"resumed:\" and a \"checkpoints:\"\n"
            "line. Every flag with a value takes it as --flag VALUE or --flag=VALUE.\n"
            "\n"
            "  --model M.bin       llama2.c checkpoint (legacy float32). Give it with --tokenizer;\n"
            "                      without both, the built-in default model is used (random\n"
            "                      weights, meaningless text; created on first use under\n"
            "                      $XDG_CACHE_HOME/kvtier).\n"
            "  --tokenizer T.bin   llama2.c tokenizer.bin for that model (same vocab_size).\n"
            "  --prompt TEXT       prompt (default \"\": start from BOS alone).\n"
            "  --steps N           positions to run, BOS and prompt included (default 256;\n"
            "                      0 or more than seq_len = seq_len).\n"
            "  --temperature T     0 = greedy argmax; default 1.0.\n"
            "  --top-p P           nucleus sampling threshold in [0, 1]; 0 or 1 = plain\n"
            "                      sampling; default 0.9.\n"
            "  --seed S            random seed (nonzero integer); default (or 0): the current\n"
            "                      time, as llama2.c.\n"
            "  --block-tokens B    tokens per kv cache block (default 256).\n"
            "  --threads N         engine threads, this one included, 1 to 64 (default: online\n"
            "                      CPUs, at most 8). The output does not depend on it.\n"
            "  --kv-dtype S        storage scheme of the K/V cache: f32 (default: llama2.c\n"
            "                      computes in f32 and generate prints its output exactly; chat,\n"
            "                      serve and cache publish default to f16), f16, bf16, q8 (8-bit\n"
            "                      codes per channel over each kv block, the open block in f32).\n"
            "  --request-id ID     make the run replayable: every --checkpoint-every generated\n"
            "                      tokens a checkpoint (caches, tokens, sampler state) is written\n"
            "                      behind decode under --ssd-cache DIR; run the same command again\n"
            "                      after a crash and it resumes from the newest valid checkpoint of\n"
            "                      ID and prints the whole output exactly as an uninterrupted run.\n"
            "                      A run that ends removes its checkpoints. Without --seed the\n"
            "                      resumed run takes the checkpoint's seed; a checkpoint that does\n"
            "                      not match the run (prompt, seed, temperature, top-p, counts) is\n"
            "                      an error naming the field (docs/checkpoints.md).\n"
            "  --ssd-cache DIR     where the checkpoints are kept (the SSD tier's directory).\n"
            "  --checkpoint-every N  generated tokens between checkpoints (default 16).\n"
            "  --checkpoint-sync   each checkpoint is durable before decoding goes on (default:\n"
            "                      written behind decode): a crash loses at most N tokens however\n"
            "                      slow the disk; the decode waits for every write.\n"
            "  --live-cache-blocks N  keep at most N full kv blocks of the run in RAM (over all\n"
            "                      layers); the others are written once to a page file and read\n"
            "                      back, checksummed, when attention needs them (docs/residency.md).\n"
            "                      The output is the same as fully resident. Default: no bound.\n"
            "  --live-cache-bytes B  the same bound in bytes (suffixes K, M, G; the smaller wins).\n"
            "                      Paging counters go to stderr.\n"
            "  --live-cache-dir DIR  where the page file is made (unlinked at once; default\n"
            "                      $TMPDIR, else /tmp). With --request-id the checkpoints of\n"
            "                      a bounded run hold every block (paged ones are read back to\n"
            "                      be written), and a resumed run is bounded again at once.\n"
            "  --live-cache-strict   the bound holds exactly: a block past it is released as soon\n"
            "                      as it is written, and the run waits for that write (default: up\n"
            "                      to 4 blocks per layer stay in RAM while their writes are in flight).\n"
            "\n"
            "Exit status: 0 success, 1 failure (message on stderr), 2 usage error.\n"
            "\n"
            "Example (a real model):\n"
            "  kvtier generate --model stories260K.bin --tokenizer tok512.bin \\\n"
            "      --prompt \"Once upon a time\" --steps 128 --temperature 0\n");
}

static int bad(const char *flag, const char *value, const char *why)
{
    fprintf(stderr, "kvtier generate: %s: invalid value '%s' (%s)\n", flag, value, why);
    fprintf(stderr, "(kvtier generate --help for usage)\n");
    return 2;
}

static int parse_i64(const char *flag, const char *v, long long lo, long long hi, long long *out)
{
    return kvt_cli_int_arg("kvtier generate", flag, v, lo, hi, out);
}

static int fail(const char *what, int rc)
{
    const char *detail = kvt_last_error();
    fprintf(stderr, "kvtier generate: %s: %s%s%s\n", what, kvt_strerror(rc), detail[0] ? ": " : "", detail);
    return 1;
}

int kvt_cmd_generate(int argc, char **argv)
{
    const char *prompt = "", *request_id = NULL, *ssd_dir = NULL;
    long long steps = 256, every = 0;
    int ckpt_sync = 0;
    /* llama2.c's defaults: temperature 1.0, top-p 0.9, seed 0 = the time */
    kvt_cli_engine_flags ef = {.temperature = 1.0f, .top_p = 0.9f, .seed_min = INT64_MIN, .block_tokens = 256,
                               .kv_scheme = KVT_KV_F32};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        int er = kvt_cli_engine_arg("kvtier generate", argc, argv, &i, &ef);
        if (er == 2)
            return 2;
        if (er == 1)
            continue;
        if (!strcmp(a, "--checkpoint-sync")) {
            ckpt_sync = 1;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "kvtier generate: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
        /* --flag value or --flag=value */
        char name[32];
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        if (nlen >= sizeof name) {
            fprintf(stderr, "kvtier generate: unknown flag '%s' (kvtier generate --help for usage)\n", a);
            return 2;
        }
        memcpy(name, a, nlen);
        name[nlen] = '\0';
        static const char *const known[] = {"--prompt", "--steps", "--request-id", "--ssd-cache",
                                            "--checkpoint-every", NULL};
        int k = 0;
        while (known[k] && strcmp(known[k], name))
            k++;
        if (!known[k]) {
            fprintf(stderr, "kvtier generate: unknown flag '%s' (kvtier generate --help for usage)\n", name);
            return 2;
        }
        const char *v = eq ? eq + 1 : NULL;
        if (!v) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kvtier generate: %s needs a value (kvtier generate --help for usage)\n", name);
                return 2;
            }
            v = argv[++i];
        }
        int rc = 0;
        if (!strcmp(name, "--prompt"))
            prompt = v;
        else if (!strcmp(name, "--steps"))
            rc = parse_i64(name, v, 0, INT32_MAX, &steps);
        else if (!strcmp(name, "--request-id"))
            request_id = v;
        else if (!strcmp(name, "--ssd-cache"))
            ssd_dir = v;
        else if (!strcmp(name, "--checkpoint-every"))
            rc = parse_i64(name, v, 1, INT32_MAX, &every);
        if (rc)
            return rc;
    }
    if (kvt_cli_engine_check("kvtier generate", &ef))
        return 2;
    if (request_id && (!request_id[0] || strlen(request_id) > KVT_REQUEST_ID_MAX))
        return bad("--request-id", request_id, "need 1 to 255 bytes");
    if ((request_id != NULL) != (ssd_dir != NULL) || ((every || ckpt_sync) && !request_id)) {
        fprintf(stderr, "kvtier generate: %s\n", request_id ? "--request-id needs --ssd-cache DIR (where the checkpoints are kept)"
                        : ssd_dir ? "--ssd-cache needs --request-id ID (generate keeps only checkpoints there)"
                                  : "--checkpoint-every and --checkpoint-sync need --request-id ID and --ssd-cache DIR");
        return 2;
    }
    /* llama2.c: a seed of 0 means "seed with the time"; the int seed is
     * converted to unsigned long long. */
    uint64_t rng_seed = ef.seed ? (uint64_t)ef.seed : (uint64_t)time(NULL);

    kvt_model *model = NULL;
    kvt_tokenizer *tok = NULL;
    kvt_sampler *sampler = NULL;
    kvt_store *store = NULL;
    kvt_service *svc = NULL;
    int status = 1, rc;
    static char tok_path[4096], model_path[4096];
    if (kvt_cli_engine_load("kvtier generate", &ef, &model, &tok, model_path, tok_path, sizeof tok_path))
        goto done;
    if (ef.threads && (rc = kvt_model_set_threads(model, (int)ef.threads))) {
        status = fail("cannot start the engine threads", rc);
        goto done;
    }
    kvt_model_set_kv_scheme(model, ef.kv_scheme);
    const kvt_model_config *cfg = kvt_model_get_config(model);
    if ((rc = kvt_sampler_create(cfg->vocab_size, ef.temperature, ef.top_p, rng_seed, &sampler))) {
        status = fail("cannot create the sampler", rc);
        goto done;
    }
    if (request_id) {
        kvt_chat_identity ident;
        if ((rc = kvt_chat_identity_compute(model, tok_path, &ident))) {
            status = fail("cannot hash the model", rc);
            goto done;
        }
        if ((rc = kvt_chat_store_open(model, &ident, ssd_dir, 0, 0, &store))) {
            status = fail("cannot open --ssd-cache", rc);
            goto done;
        }
        kvt_chat_service_opts so = {.block_tokens = (int32_t)ef.block_tokens, .checkpoint_store = store,
                                    .checkpoint_every = every ? every : 16, .checkpoint_sync = ckpt_sync};
        if ((rc = kvt_chat_service_create(model, &so, &svc))) {
            status = fail("cannot create the cache service", rc);
            goto done;
        }
    }
    kvt_generate_stats st;
    kvt_generate_replay rp = {.svc = svc, .request_id = request_id, .seed_explicit = ef.seed != 0};
    kvt_residency_options live = {.max_blocks = ef.live_blocks, .max_bytes = ef.live_bytes, .dir = ef.live_dir,
                                  .write_slack = ef.live_strict ? -1 : 0};
    rc = kvt_generate_live(model, tok, sampler, prompt, steps, (int32_t)ef.block_tokens, request_id ? &rp : NULL,
                           ef.live_blocks || ef.live_bytes ? &live : NULL, stdout, &st);
    if (rc) {
        status = fail("generation failed", rc);
        goto done;
    }
    /* a rate only over tokens that ran: a resumed run restores its caches
     * from the checkpoint and may prefill nothing (was "prefill 0.0 tok/s") */
    if (st.prefill_tokens > 0)
        fprintf(stderr, "prefill: %.1f tok/s, ", st.prefill_tok_s);
    else if (st.resumed_generated)
        fprintf(stderr, "prefill: 0 tokens (%lld restored from the checkpoint), ", (long long)st.resumed_tokens);
    else
        fprintf(stderr, "prefill: 0 tokens, ");
    if (st.decode_tokens > 0)
        fprintf(stderr, "decode: %.1f tok/s\n", st.decode_tok_s);
    else
        fprintf(stderr, "decode: 0 tokens\n");
    if (ef.live_blocks || ef.live_bytes)
        fprintf(stderr, "live cache: paged out %llu blocks (%.1f MB), paged in %llu blocks (%.1f MB), stall "
                "%.1f ms, peak %.1f MB of full blocks in RAM, %llu failed writes (kept in RAM), %llu blocks "
                "(%.1f MB) paged by reference to the SSD tier\n",
                (unsigned long long)st.paged_out_blocks, st.paged_out_bytes / 1e6,
                (unsigned long long)st.paged_in_blocks, st.paged_in_bytes / 1e6, st.page_stall_ms,
                st.live_peak_bytes / 1e6, (unsigned long long)st.page_write_failures,
                (unsigned long long)st.paged_ref_blocks, st.paged_ref_bytes / 1e6);
    if (request_id) {
        if (st.resumed_generated)
            fprintf(stderr, "resumed: request '%s' from its checkpoint at %lld generated tokens (%lld tokens "
                    "restored, %lld prefilled, %lld decoded)\n", request_id, (long long)st.resumed_generated,
                    (long long)st.resumed_tokens, (long long)st.prefill_tokens, (long long)st.decode_tokens);
        else
            fprintf(stderr, "resumed: nothing (request '%s' started fresh: %lld prefilled, %lld decoded)\n",
                    request_id, (long long)st.prefill_tokens, (long long)st.decode_tokens);
    }
    status = 0;
done:
    if (svc && (rc = kvt_service_close(svc)) && status == 0)
        status = fail("cannot make the checkpoints durable", rc);
    if (svc && status == 0) {
        kvt_checkpoint_stats cs;
        kvt_service_checkpoint_stats(svc, &cs);
        fprintf(stderr, "checkpoints: %lld taken every %lld tokens, %s: %llu written, %llu "
                "superseded in the writer's queue, %llu dropped, %llu removed (the run completed)\n",
                (long long)st.checkpoints, every ? every : 16,
                ckpt_sync ? "each durable before decoding went on" : "written behind decode", (unsigned long long)cs.written,
                (unsigned long long)cs.superseded, (unsigned long long)cs.dropped, (unsigned long long)cs.removed);
    }
    kvt_service_destroy(svc);
    if (store && (rc = kvt_store_close(store)) && status == 0)
        status = fail("cannot close --ssd-cache", rc);
    kvt_sampler_free(sampler);
    kvt_tokenizer_free(tok);
    kvt_model_free(model);
    return status;
}
