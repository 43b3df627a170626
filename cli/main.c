/*
 * main.c: the `kvtier` command: dispatches to a subcommand. Owns no state.
 */
#include "args.h"
#include "cli.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} kvt_subcommand;

static void usage(FILE *f, const kvt_subcommand *cmds, const kvt_subcommand *benches)
{
    fprintf(f, "usage: kvtier COMMAND [ARGS...]   (kvtier COMMAND --help for details)\n\ncommands:\n");
    for (const kvt_subcommand *c = cmds; c->name; c++)
        fprintf(f, "  %-16s %s\n", c->name, c->help);
    fprintf(f, "\nbenchmarks (kvtier bench NAME):\n");
    for (const kvt_subcommand *c = benches; c->name; c++)
        fprintf(f, "  %-16s %s\n", c->name, c->help);
    fprintf(f, "\nBYTES, in every command's size flags (--prompt-cache, --kv-budget, --ssd-cache-max,\n"
               "--ram, store gc --max, bench sizes):\n  %s.\n", KVT_CLI_BYTES_FORMS);
}

static int run(const kvt_subcommand *c, int argc, char **argv)
{
    if (!c->fn) {
        fprintf(stderr, "kvtier: '%s' is not part of this build\n", c->name);
        return 1;
    }
    return c->fn(argc, argv);
}

int main(int argc, char **argv)
{
    const kvt_subcommand cmds[] = {
        {"generate", kvt_cmd_generate, "generate text with the reference engine (llama2.c checkpoints)"},
        {"chat", kvt_cmd_chat, "multi-turn chat that prefills only new tokens (the main job)"},
        {"model", kvt_cmd_model, "model synth|info|default|export-gguf: synthetic checkpoints, a checkpoint's shape, GGUF export"},
        {"replay", kvt_cmd_replay, "replay a serving trace through the prompt cache"},
        {"store", kvt_cmd_store, "store inspect|verify|gc: the SSD tier on disk"},
        {"cache", kvt_cmd_cache, "cache publish|inspect|verify: published read-only prompt caches"},
        {"serve", kvt_cmd_serve, "OpenAI-compatible HTTP server over the prompt cache"},
        {"bench", NULL, "run a benchmark (see below)"},
        {NULL, NULL, NULL},
    };
    const kvt_subcommand benches[] = {
        {"engine", kvt_bench_engine, "prefill/decode tokens per second"},
        {"lookup", kvt_bench_lookup, "prefix lookup (find, lend zero-copy views, release): radix index vs linear scan"},
        {"dedup", kvt_bench_dedup, "RAM bytes of entries sharing a long system prompt"},
        {"chat", kvt_bench_chat, "per-turn TTFT with the prompt cache on and off"},
        {"kv-dtype", kvt_bench_kv_dtype, "quality and bytes of each KV storage scheme (f16, bf16, q8) vs f32"},
        {"ssd", kvt_bench_ssd, "SSD store/restore throughput vs raw disk bandwidth"},
        {"remote", kvt_bench_remote, "remote tier on Redis: restore/store GB/s vs raw hiredis GET/SET, 32k-token lookup ms"},
        {"serve", kvt_bench_serve, "kvtier serve over HTTP: TTFT per turn cache on/off, batched decode, overhead"},
        {"checkpoint", kvt_bench_checkpoint, "decode tok/s with generation checkpoints every 16 tokens vs without"},
        {"residency", kvt_bench_residency, "prefill/decode tok/s with live kv blocks bounded to 1/2, 1/4, 1/8 of RAM vs fully resident"},
        {NULL, NULL, NULL},
    };
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout, cmds, benches);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "bench")) {
        if (argc < 3 || !strcmp(argv[2], "--help") || !strcmp(argv[2], "-h")) {
            usage(argc < 3 ? stderr : stdout, cmds, benches);
            return argc < 3 ? 2 : 0;
        }
        for (const kvt_subcommand *c = benches; c->name; c++)
            if (!strcmp(c->name, argv[2]))
                return run(c, argc - 2, argv + 2);
        fprintf(stderr, "kvtier: unknown benchmark '%s'\n", argv[2]);
        return 2;
    }
    for (const kvt_subcommand *c = cmds; c->name; c++)
        if (!strcmp(c->name, argv[1]))
            return run(c, argc - 1, argv + 1);
    fprintf(stderr, "kvtier: unknown command '%s' (try kvtier --help)\n", argv[1]);
    return 2;
}
