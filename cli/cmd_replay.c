/*
 * cmd_replay.c: `kvtier replay`: replays a serving trace (Mooncake JSON
 * lines) and reports the prefix-cache hit ratios of a retention policy at a
 * block capacity; --sweep runs every policy over several capacities and
 * charts them with gnuplot. It owns the command line, the progress bar and
 * the output formats; replay logic lives in tools/replay/.
 */
#include "args.h"
#include "cli.h"

#include "replay.h"
#include "kvtier/experimental/retention_block.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define DEFAULT_BYTES_PER_TOKEN 64 /* 10,000 blocks of 512 tokens = 328 MB */
#define DEFAULT_CAPACITY 10000

typedef struct opts {
    const char *traces[8];
    int n_traces;
    int64_t capacity;
    int64_t ram;
    int64_t ssd_blocks;
    int64_t bytes_per_token;
    int64_t max_requests;
    const char *policy;
    const char *chart;
    const char *ssd_dir;
    int json, sweep, list, sim, quiet;
} opts;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier replay [TRACE...] [--capacity-blocks N | --ram BYTES] [--ssd-blocks N [--ssd-dir DIR]]\n"
            "                     [--policy NAME] [--bytes-per-token B] [--requests N] [--sim]\n"
            "                     [--json] [--quiet]\n"
            "       kvtier replay [TRACE...] --sweep [--chart PNG] [--requests N]\n"
            "       kvtier replay --list-policies\n"
            "\n"
            "Replays a Mooncake trace (JSON lines: timestamp, input_length, output_length,\n"
            "hash_ids of 512-token blocks) and reports block and token hit ratios.\n"
            "TRACE defaults to $KVT_SHARED_DIR/data/traces/mooncake_conversation_trace.jsonl\n"
            "(both shared traces for --sweep). Capacity is in 512-token blocks (default %d);\n"
            "--ram BYTES bounds the replay's memory instead: capacity BYTES / (512 * (B + %d)),\n"
            "B kv bytes per token (default %d) plus the cache's own host bytes per token\n"
            "(token copies, index, policy), so peak RSS stays within about BYTES x 1.1 + 64 MB.\n"
            "BYTES: " KVT_CLI_BYTES_FORMS ".\n"
            "--policy (kvtier replay --list-policies):\n"
            "  lru-ref     plain LRU over hash ids (block simulator; the README cross-check)\n"
            "  opt         Belady's offline optimum (block simulator)\n"
            "  lru         prompt cache, block-granular LRU, leaf first along the radix tree\n"
            "  lfu-aged    prompt cache, block-granular recency plus frequency (default)\n"
            "  lfu-learned lfu-aged plus a learned first-use offset: new blocks of requests\n"
            "              like those whose blocks came back stay longer\n"
            "  entry-lru, entry-slru  prompt cache, whole entries leave (entry-level)\n"
            "--sim runs lru, lfu-aged or lfu-learned in the block simulator (ids only, no kv bytes).\n"
            "--ssd-blocks N tiers the prompt cache over the SSD store (kvtier/store.h) with a\n"
            "budget of N blocks, in --ssd-dir DIR (default: a temporary directory, removed).\n"
            "--sweep: capacities 1000 10000 30000 100000, every policy; a table and a PNG\n"
            "chart (default replay-sweep.png) drawn by gnuplot.\n",
            DEFAULT_CAPACITY, KVT_REPLAY_HOST_BYTES_PER_TOKEN, DEFAULT_BYTES_PER_TOKEN);
}

static int parse_i64(const char *flag, const char *s, int64_t min, int64_t *out)
{
    long long v;
    if (kvt_cli_int(s, min, LLONG_MAX, &v)) {
        fprintf(stderr, "kvtier replay: %s needs an integer >= %lld, got '%s'\n", flag,
                (long long)min, s ? s : "");
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, opts *o)
{
    *o = (opts){.capacity = -1, .ram = -1, .ssd_blocks = 0,
                .bytes_per_token = DEFAULT_BYTES_PER_TOKEN, .policy = "lfu-aged",
                .chart = "replay-sweep.png"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 1;
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else if (!strcmp(a, "--sweep")) {
            o->sweep = 1;
        } else if (!strcmp(a, "--list-policies")) {
            o->list = 1;
        } else if (!strcmp(a, "--sim")) {
            o->sim = 1;
        } else if (!strcmp(a, "--quiet")) {
            o->quiet = 1;
        } else if (!strcmp(a, "--capacity-blocks")) {
            if (parse_i64(a, v, 1, &o->capacity)) return -1;
            i++;
        } else if (!strcmp(a, "--ram")) {
            uint64_t b;
            if (!v || kvt_cli_bytes(v, &b, NULL) || b < 1 || b > INT64_MAX) {
                fprintf(stderr, "kvtier replay: --ram needs a byte count >= 1 (%s), got '%s'\n",
                        KVT_CLI_BYTES_FORMS, v ? v : "");
                return -1;
            }
            o->ram = (int64_t)b;
            i++;
        } else if (!strcmp(a, "--ssd-blocks")) {
            if (parse_i64(a, v, 0, &o->ssd_blocks)) return -1;
            i++;
        } else if (!strcmp(a, "--bytes-per-token")) {
            if (parse_i64(a, v, 8, &o->bytes_per_token)) return -1;
            if (o->bytes_per_token % 8 || o->bytes_per_token > KVT_REPLAY_MAX_BYTES_PER_TOKEN) {
                fprintf(stderr, "kvtier replay: --bytes-per-token must be a multiple of 8 "
                                "(K and V floats) and at most %d, got %lld\n",
                        KVT_REPLAY_MAX_BYTES_PER_TOKEN, (long long)o->bytes_per_token);
                return -1;
            }
            i++;
        } else if (!strcmp(a, "--requests")) {
            if (parse_i64(a, v, 1, &o->max_requests)) return -1;
            i++;
        } else if (!strcmp(a, "--policy")) {
            if (!v) { fprintf(stderr, "kvtier replay: --policy needs a name\n"); return -1; }
            o->policy = v;
            i++;
        } else if (!strcmp(a, "--ssd-dir")) {
            if (!v) { fprintf(stderr, "kvtier replay: --ssd-dir needs a path\n"); return -1; }
            o->ssd_dir = v;
            i++;
        } else if (!strcmp(a, "--chart")) {
            if (!v) { fprintf(stderr, "kvtier replay: --chart needs a path\n"); return -1; }
            o->chart = v;
            i++;
        } else if (a[0] == '-') {
            fprintf(stderr, "kvtier replay: unknown option '%s' (see --help)\n", a);
            return -1;
        } else {
            if (o->n_traces == 8) {
                fprintf(stderr, "kvtier replay: at most 8 traces\n");
                return -1;
            }
            o->traces[o->n_traces++] = a;
        }
    }
    if (o->capacity > 0 && o->ram > 0) {
        fprintf(stderr, "kvtier replay: give --capacity-blocks or --ram, not both\n");
        return -1;
    }
    if (o->ram > 0) {
        /* B covers the whole replay: kv bytes and the cache's per-token host
         * bytes (token copies, index, policy) that its budget does not count */
        o->capacity = o->ram / (KVT_TRACE_BLOCK_TOKENS * (o->bytes_per_token + KVT_REPLAY_HOST_BYTES_PER_TOKEN));
        if (o->capacity < 1) {
            fprintf(stderr, "kvtier replay: --ram %lld bytes holds no 512-token block at %lld "
                            "bytes per token (+%d of host state)\n", (long long)o->ram,
                    (long long)o->bytes_per_token, KVT_REPLAY_HOST_BYTES_PER_TOKEN);
            return -1;
        }
    }
    if (o->capacity < 0)
        o->capacity = DEFAULT_CAPACITY;
    return 0;
}

/* ---- policies --------------------------------------------------------------- */

static int in_list(const char *name, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name))
            return 1;
    return 0;
}

/* The prompt cache's policies: every block policy of the library
 * (kvt_block_policy_names, so a new one is listed without a second list),
 * then the replay's other cache policies (entry-level retention). */
static int cache_policies(const char **out, int cap)
{
    const char *const *names;
    int n = 0, k = kvt_block_policy_names(&names);
    for (int i = 0; i < k && n < cap; i++)
        out[n++] = names[i];
    k = kvt_replay_cache_policies(&names);
    for (int i = 0; i < k && n < cap; i++)
        if (!in_list(names[i], out, n))
            out[n++] = names[i];
    return n;
}

/* Every policy name: the simulator-only ones (lru-ref, opt), then the
 * prompt cache's. */
static int all_policies(const char **out, int cap)
{
    const char *const *names;
    int n = 0, k = kvt_replay_sim_policies(&names);
    for (int i = 0; i < k && n < cap; i++)
        if (!strcmp(names[i], "lru-ref") || !strcmp(names[i], "opt"))
            out[n++] = names[i];
    return n + cache_policies(out + n, cap - n);
}

static int known_policy(const char *name)
{
    const char *names[16];
    return in_list(name, names, all_policies(names, 16));
}

/* Whether `policy` runs in the block simulator (ids only). */
static int use_sim(const char *policy, const opts *o)
{
    const char *names[16];
    return o->sim || !in_list(policy, names, cache_policies(names, 16));
}

/* ---- progress bar ---------------------------------------------------------- */

typedef struct progress_ctx {
    const char *label;
    uint64_t last_ns;
} progress_ctx;

static int progress_bar(int64_t done, int64_t total, void *ctx)
{
    progress_ctx *p = ctx;
    uint64_t now = kvt_now_ns();
    if (done < total && now - p->last_ns < 100000000ULL)
        return 0;
    p->last_ns = now;
    int width = 30, fill = total ? (int)(done * width / total) : width;
    fprintf(stderr, "\r%-28.28s [%.*s%*s] %3d%%", p->label, fill,
            "##############################", width - fill, "",
            total ? (int)(done * 100 / total) : 100);
    if (done >= total)
        fprintf(stderr, "\r%*s\r", 28 + width + 8, "");
    fflush(stderr);
    return 0;
}

/* ---- one run ---------------------------------------------------------------- */

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static int run_one(const kvt_trace *t, const char *policy, int64_t capacity, const opts *o,
                   kvt_replay_result *res, const char **engine)
{
    progress_ctx pc = {.label = policy};
    int show = !o->quiet && isatty(STDERR_FILENO);
    int rc;
    if (use_sim(policy, o)) {
        *engine = "block simulator";
        if (o->ssd_blocks > 0 && !o->sweep)
            fprintf(stderr, "kvtier replay: --ssd-blocks applies to the prompt cache policies only; "
                            "'%s' runs in the block simulator (RAM only)\n", policy);
        rc = kvt_replay_sim(t, policy, capacity, show ? progress_bar : NULL, &pc, res);
    } else {
        *engine = "prompt cache";
        kvt_replay_config cfg = {.policy = policy, .capacity_blocks = capacity,
                                 .bytes_per_token = (int32_t)o->bytes_per_token,
                                 .ssd_blocks = o->ssd_blocks, .ssd_dir = o->ssd_dir};
        rc = kvt_replay_cache(t, &cfg, show ? progress_bar : NULL, &pc, res);
    }
    if (rc)
        fprintf(stderr, "kvtier replay: %s: %s\n", kvt_strerror(rc), kvt_last_error());
    return rc;
}

static double ratio(int64_t a, int64_t b) { return b ? (double)a / (double)b : 0.0; }

static void print_result(const char *trace, const char *policy, int64_t capacity, const opts *o,
                         const kvt_replay_result *r, const char *engine)
{
    double rps = r->seconds > 0 ? (double)r->requests / r->seconds : 0.0;
    if (o->json) {
        printf("{\"trace\": \"%s\", \"policy\": \"%s\", \"engine\": \"%s\", "
               "\"capacity_blocks\": %lld, \"bytes_per_token\": %lld, \"requests\": %lld, "
               "\"blocks\": %lld, \"block_hits\": %lld, \"block_hit_ratio\": %.6f, "
               "\"prefix_block_hit_ratio\": %.6f, \"tokens\": %lld, \"token_hits\": %lld, "
               "\"token_hit_ratio\": %.6f, \"ram_block_hits\": %lld, \"ssd_block_hits\": %lld, "
               "\"ssd_blocks\": %lld, \"bytes_spilled\": %lld, \"bytes_restored\": %lld, "
               "\"entries_evicted\": %lld, \"blocks_trimmed\": %lld, \"peak_blocks\": %lld, "
               "\"seconds\": %.3f, \"requests_per_second\": %.1f}\n",
               base_name(trace), policy, engine, (long long)capacity, (long long)o->bytes_per_token,
               (long long)r->requests, (long long)r->blocks, (long long)r->block_hits,
               ratio(r->block_hits, r->blocks), ratio(r->prefix_block_hits, r->blocks),
               (long long)r->tokens, (long long)r->token_hits, ratio(r->token_hits, r->tokens),
               (long long)r->ram_block_hits, (long long)r->ssd_block_hits, (long long)o->ssd_blocks,
               (long long)r->bytes_spilled, (long long)r->bytes_restored,
               (long long)r->entries_evicted, (long long)r->blocks_trimmed,
               (long long)r->peak_blocks, r->seconds, rps);
        return;
    }
    printf("trace              %s (%lld requests, %lld blocks)\n", base_name(trace),
           (long long)r->requests, (long long)r->blocks);
    printf("policy             %s (%s)\n", policy, engine);
    printf("capacity           %lld blocks (%.1f MB of kv state at %lld bytes/token)\n",
           (long long)capacity, (double)capacity * KVT_TRACE_BLOCK_TOKENS * (double)o->bytes_per_token / 1e6,
           (long long)o->bytes_per_token);
    printf("block hit ratio    %.4f (%lld of %lld; before the first miss: %.4f)\n",
           ratio(r->block_hits, r->blocks), (long long)r->block_hits, (long long)r->blocks,
           ratio(r->prefix_block_hits, r->blocks));
    printf("token hit ratio    %.4f (%lld of %lld tokens)\n", ratio(r->token_hits, r->tokens),
           (long long)r->token_hits, (long long)r->tokens);
    if (o->ssd_blocks > 0)
        printf("hits by tier       RAM %lld, SSD %lld blocks\n", (long long)r->ram_block_hits,
               (long long)r->ssd_block_hits);
    else
        printf("hits by tier       RAM %lld blocks (no SSD tier)\n", (long long)r->ram_block_hits);
    printf("bytes spilled      %lld, restored %lld\n", (long long)r->bytes_spilled,
           (long long)r->bytes_restored);
    printf("entries evicted    %lld (blocks trimmed off tails: %lld)\n",
           (long long)r->entries_evicted, (long long)r->blocks_trimmed);
    printf("wall time          %.3f s, %.0f requests/s\n", r->seconds, rps);
}

/* ---- sweep ------------------------------------------------------------------- */

static const int64_t sweep_caps[] = {1000, 10000, 30000, 100000};
#define N_CAPS 4

static int write_chart(const opts *o, const char *const *traces, int n_traces,
                       const char *const *pols, int n_pols, double *ratios /* (trace, pol, cap) */)
{
    char data[] = "/tmp/kvtier-sweep-XXXXXX";
    int fd = mkstemp(data);
    if (fd < 0) {
        fprintf(stderr, "kvtier replay: cannot create a temp file: %s\n", strerror(errno));
        return -1;
    }
    FILE *f = fdopen(fd, "w");
    if (!f) {
        close(fd);
        unlink(data);
        return -1;
    }
    /* One gnuplot data block per trace: capacity then one column per policy. */
    for (int ti = 0; ti < n_traces; ti++) {
        fprintf(f, "# %s\n", base_name(traces[ti]));
        for (int c = 0; c < N_CAPS; c++) {
            fprintf(f, "%lld", (long long)sweep_caps[c]);
            for (int p = 0; p < n_pols; p++)
                fprintf(f, " %.6f", ratios[((size_t)ti * n_pols + p) * N_CAPS + c]);
            fprintf(f, "\n");
        }
        fprintf(f, "\n\n");
    }
    fclose(f);
    FILE *g = popen("gnuplot 2>&1", "w");
    if (!g) {
        unlink(data);
        return -1;
    }
    fprintf(g, "set terminal pngcairo size %d,560 font 'sans,10'\n", 640 * n_traces);
    fprintf(g, "set output '%s'\n", o->chart);
    fprintf(g, "set termoption noenhanced\nset multiplot layout 1,%d\n", n_traces);
    fprintf(g, "set logscale x\nset xlabel 'capacity (512-token blocks)'\n"
               "set ylabel 'block hit ratio'\nset yrange [0:*]\nset grid\nset key left top\n"
               "set xtics (1000, 10000, 30000, 100000)\n");
    for (int ti = 0; ti < n_traces; ti++) {
        fprintf(g, "set title '%s'\nplot ", base_name(traces[ti]));
        for (int p = 0; p < n_pols; p++)
            fprintf(g, "%s'%s' index %d using 1:%d with linespoints lw 2 %s title '%s'",
                    p ? ", " : "", data, ti, p + 2,
                    strcmp(pols[p], "opt") ? "dt 1" : "dt 2 lc rgb 'black'", pols[p]);
        fprintf(g, "\n");
    }
    fprintf(g, "unset multiplot\n");
    int st = pclose(g);
    unlink(data);
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "kvtier replay: gnuplot failed (exit %d): no chart written to %s\n",
                st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st), o->chart);
        return -1;
    }
    return 0;
}

static int have_gnuplot(void)
{
    return system("command -v gnuplot >/dev/null 2>&1") == 0;
}

static int sweep(const opts *o, kvt_trace **traces, const char *const *paths, int n_traces)
{
    const char *pols[16];
    int n_pols = all_policies(pols, 16);
    if (have_gnuplot()) { /* before minutes of replay, not after */
        FILE *probe = fopen(o->chart, "ab");
        if (!probe) {
            fprintf(stderr, "kvtier replay: cannot write the chart %s: %s\n", o->chart, strerror(errno));
            return 1;
        }
        fclose(probe);
    }
    double *ratios = calloc((size_t)n_traces * n_pols * N_CAPS, sizeof *ratios);
    if (!ratios)
        return 1;
    double total_s = 0;
    for (int ti = 0; ti < n_traces; ti++) {
        if (!o->json)
            printf("%s (%lld requests): block hit ratio\n%-10s", base_name(paths[ti]),
                   (long long)traces[ti]->n_requests, "capacity");
        for (int p = 0; p < n_pols && !o->json; p++)
            printf(" %9s", pols[p]);
        if (!o->json)
            printf("\n");
        for (int c = 0; c < N_CAPS; c++) {
            if (!o->json)
                printf("%-10lld", (long long)sweep_caps[c]);
            for (int p = 0; p < n_pols; p++) {
                kvt_replay_result r;
                const char *engine;
                if (run_one(traces[ti], pols[p], sweep_caps[c], o, &r, &engine)) {
                    free(ratios);
                    return 1;
                }
                total_s += r.seconds;
                double v = ratio(r.block_hits, r.blocks);
                ratios[((size_t)ti * n_pols + p) * N_CAPS + c] = v;
                if (o->json)
                    print_result(paths[ti], pols[p], sweep_caps[c], o, &r, engine);
                else
                    printf(" %9.4f", v);
                fflush(stdout);
            }
            if (!o->json)
                printf("\n");
        }
        if (!o->json)
            printf("\n");
    }
    if (!o->json)
        printf("replay time %.2f s in all\n", total_s);
    int rc = 0;
    if (!have_gnuplot())
        fprintf(stderr, "kvtier replay: gnuplot is not installed (Debian package gnuplot-nox): "
                        "table only, no chart\n");
    else if (write_chart(o, paths, n_traces, pols, n_pols, ratios))
        rc = 1; /* asked for a chart and got none */
    else if (!o->json)
        printf("chart written to %s\n", o->chart);
    free(ratios);
    return rc;
}

/* ---- entry -------------------------------------------------------------------- */

static const char *default_trace(const char *name, char *buf, size_t cap)
{
    const char *shared = getenv("KVT_SHARED_DIR");
    snprintf(buf, cap, "%s/data/traces/%s", shared && *shared ? shared : "../shared", name);
    return buf;
}

int kvt_cmd_replay(int argc, char **argv)
{
    opts o;
    int prc = parse_args(argc, argv, &o);
    if (prc)
        return prc > 0 ? 0 : 2;
    if (o.list) {
        const char *names[16];
        int n = all_policies(names, 16);
        for (int i = 0; i < n; i++)
            printf("%s\n", names[i]);
        return 0;
    }
    if (!o.sweep && !known_policy(o.policy)) {
        fprintf(stderr, "kvtier replay: unknown policy '%s' (kvtier replay --list-policies)\n",
                o.policy);
        return 2;
    }
    char b0[4096], b1[4096];
    if (o.n_traces == 0) {
        o.traces[o.n_traces++] = default_trace("mooncake_conversation_trace.jsonl", b0, sizeof b0);
        if (o.sweep)
            o.traces[o.n_traces++] = default_trace("mooncake_synthetic_trace.jsonl", b1, sizeof b1);
    }
    kvt_trace *traces[8] = {0};
    int rc = 0;
    for (int i = 0; i < o.n_traces; i++) {
        int lrc = kvt_trace_load(o.traces[i], o.max_requests, &traces[i]);
        if (lrc) {
            fprintf(stderr, "kvtier replay: %s\n", kvt_last_error());
            rc = 1;
            goto out;
        }
    }
    if (o.sweep) {
        rc = sweep(&o, traces, o.traces, o.n_traces);
        goto out;
    }
    for (int i = 0; i < o.n_traces; i++) {
        kvt_replay_result r;
        const char *engine;
        if (run_one(traces[i], o.policy, o.capacity, &o, &r, &engine)) {
            rc = 1;
            goto out;
        }
        print_result(o.traces[i], o.policy, o.capacity, &o, &r, engine);
    }
out:
    for (int i = 0; i < o.n_traces; i++)
        kvt_trace_destroy(traces[i]);
    return rc;
}
