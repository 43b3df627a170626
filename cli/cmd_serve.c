/*
 * cmd_serve.c: `kvtier serve`: argument parsing, signals and the life of
 * the server (server/server.h). Prints one line when it listens and one when
 * the model is loaded, both on stderr ("kvtier serve: listening on
 * http://HOST:PORT", "kvtier serve: ready, model NAME"); scripts and tests
 * read the port from the first. Never prints the API key.
 */
#include "chat.h"
#include "args.h"
#include "cli.h"
#include "server.h"

#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier serve [--model M.bin --tokenizer T.bin [--model-name NAME]] ...\n"
            "                    [--pool-ram BYTES] [--pool-kv BYTES] [--pool-disk BYTES] [--pool-remote BYTES]\n"
            "                    [--host ADDR] [--port N] [--prompt-cache BYTES] [--kv-budget BYTES]\n"
            "                    [--ssd-cache DIR [--ssd-cache-max BYTES] [--ssd-cache-verify]\n"
            "                     [--demote-idle MS] [--checkpoint-every N [--checkpoint-sync]]]\n"
            "                    [--prompt-cache-dir DIR ...]\n"
            "                    [--redis URL [--redis-cluster] [--redis-timeout MS] [--redis-ttl SECONDS]\n"
            "                     [--redis-restore-timeout MS]]\n"
            "                    [--max-queue N] [--max-running N] [--prefill-chunk N]\n"
            "                    [--max-body BYTES] [--api-key KEY] [--shutdown-timeout MS]\n"
            "                    [--conn-timeout S] [--max-connections N] [--threads N]\n"
            "                    [--kv-dtype f32|f16|bf16|q8]\n"
            "                    [--live-cache-blocks N] [--live-cache-bytes B] [--live-cache-dir DIR]\n"
            "                    [--live-cache-strict]\n"
            "\n"
            "An OpenAI-compatible HTTP server over the reference engine and the prompt cache:\n"
            "multi-turn traffic re-sends the conversation, and only its new tokens are prefilled.\n"
            "Endpoints: POST /v1/chat/completions, POST /v1/completions (\"stream\": true for\n"
            "server-sent events), GET /v1/models, GET /health, POST /tokenize, POST /detokenize,\n"
            "GET /stats (the cache service report), GET /metrics (Prometheus text),\n"
            "GET /dashboard (a live page in a browser) and GET /events (its server-sent events:\n"
            "a /stats snapshot a second and one event per finished request; 16 streams at most).\n"
            "Usage in every reply: prompt_tokens_details.cached_tokens (the reused prefix) and a\n"
            "\"kvtier\" object (reused tokens by tier, prefilled tokens, queue and TTFT ms).\n"
            "\n"
            "  --model, --tokenizer  llama2.c checkpoint and tokenizer.bin (default: the built-in\n"
            "                        default model, created on first use)\n"
            "  --model-name NAME     the model id clients name (default: the model file's name\n"
            "                        without extension); a request naming another gets 404\n"
            "  several models        repeat --model M --tokenizer T [--model-name NAME] (at most 8;\n"
            "                        the k-th --tokenizer goes with the k-th --model, a\n"
            "                        --model-name with the --model before it): one process serves\n"
            "                        them all, each with its own cache service and engine thread,\n"
            "                        under one pool; a request picks one by its \"model\" field (none:\n"
            "                        the first), /v1/models lists them, /stats has each one's report\n"
            "                        (\"models\") and the pool's (\"pool\"). The cache flags below apply\n"
            "                        to each model (--prompt-cache is each one's most); the models\n"
            "                        share the --ssd-cache directory, each in its own identity\n"
            "                        directory; /metrics labels each model's series model=\"ID\"\n"
            "  --pool-ram BYTES      RAM of every model's prompt cache together (default 0: not\n"
            "                        limited): a cache grows only as the pool grants, and gives\n"
            "                        back what it no longer holds\n"
            "  --pool-kv BYTES       projected KV bytes of every model's admitted requests together;\n"
            "                        a request that does not fit now waits (0: not limited)\n"
            "  --pool-disk BYTES     disk bytes of the SSD directory (its --ssd-cache-max must fit)\n"
            "                        (0: not limited)\n"
            "  --pool-remote BYTES   bytes of every model's Redis writes in flight together (queued\n"
            "                        write-behind and the write being sent; needs --redis); a write\n"
            "                        that does not fit is dropped and counted (0: not limited).\n"
            "                        /stats \"pool\" and /metrics kvtier_pool_* give occupancy and\n"
            "                        high-water marks by axis and by member\n"
            "  --host ADDR           IPv4/IPv6 address to bind, or localhost (default 127.0.0.1:\n"
            "                        loopback only; 0.0.0.0 or :: listen on every interface)\n"
            "  --port N              TCP port (default 8080; 0 picks a free one, printed at start)\n"
            "  --prompt-cache BYTES  RAM prompt cache (default 1G); 0 keeps nothing: cache off.\n"
            "                        Suffixes K, M, G, T (x1024).\n"
            "  --kv-budget BYTES     admission budget of projected KV bytes (default 0: unlimited);\n"
            "                        requests that do not fit now wait in the queue\n"
            "  --ssd-cache DIR       SSD tier under the prompt cache; flushed at shutdown, so a\n"
            "                        restarted server reuses what reached it. A DIR that cannot be\n"
            "                        written is used read-only (or not at all), with one warning;\n"
            "                        /stats says its mode (\"ssd_cache\")\n"
            "  --ssd-cache-max BYTES byte budget over DIR (default 0: unlimited)\n"
            "  --ssd-cache-verify    also check SHA-256 of every shard on load (XXH3-128 is always checked)\n"
            "  --demote-idle MS      prefixes idle MS milliseconds leave RAM once on SSD\n"
            "  --checkpoint-every N  a request with an 'Idempotency-Key: KEY' header is checkpointed\n"
            "                        under --ssd-cache every N generated tokens; the same request with\n"
            "                        the same key after a crash or restart resumes from its newest\n"
            "                        checkpoint and the client gets the whole reply, identical to an\n"
            "                        uninterrupted one (a checkpoint that does not match the request\n"
            "                        is a 422 naming the field; docs/checkpoints.md)\n"
            "  --checkpoint-sync     each checkpoint is durable before that request decodes on\n"
            "                        (default: written behind decode): a crash loses at most N\n"
            "                        tokens however slow the disk; the decode waits for every write\n"
            "  --redis URL           shared remote tier on Redis below the SSD tier, so several servers\n"
            "                        of the same model behind a load balancer reuse each other's\n"
            "                        prefixes: redis://[user:password@]host:port[/db] (or the password\n"
            "                        in KVTIER_REDIS_PASSWORD; never printed). A Redis that is down or\n"
            "                        slow makes misses, never errors (one warning; /stats redis_cache)\n"
            "  --redis-cluster       URL names a node of a Redis Cluster (slot map, MOVED/ASK); a slot\n"
            "                        map that leaves hash slots without a node is warned about\n"
            "  --redis-timeout MS    bound on one Redis lookup (default 50)\n"
            "  --redis-restore-timeout MS  bound on one whole restore from Redis, every round trip\n"
            "                        and read of it (default 1000); past it the request prefills\n"
            "  --redis-ttl SECONDS   expiry of every key written (default 0: none)\n"
            "  --prompt-cache-dir DIR  mount the published prompt cache in DIR (kvtier cache publish)\n"
            "                        read-only, below the other tiers; repeatable (at most 7). Its\n"
            "                        CURRENT generation is validated whole (SHA-256 of every shard)\n"
            "                        before it serves; a new publication is picked up without a\n"
            "                        restart (CURRENT is re-read every second, requests move over\n"
            "                        between lookups); a refused one is warned about once and the\n"
            "                        mounted one keeps serving; /stats lists each in\n"
            "                        \"published_caches\" (\"published_cache\": the first)\n"
            "  --max-queue N         requests waiting for admission at most (default 64); then 429\n"
            "                        with Retry-After\n"
            "  --max-running N       requests admitted at once at most (default 64)\n"
            "  --prefill-chunk N     prompt tokens one engine step runs at most, beside the decode\n"
            "                        of the running streams (1 to 256, default 256): a smaller\n"
            "                        bound shortens the stall a long prompt puts on them; replies\n"
            "                        do not depend on it\n"
            "  --max-body BYTES      request body size limit (default 1M); larger gets 413\n"
            "  --api-key KEY         require 'Authorization: Bearer KEY' on every endpoint but\n"
            "                        /health and the /dashboard page's own files (401 otherwise);\n"
            "                        also read from KVTIER_API_KEY\n"
            "  --shutdown-timeout MS on SIGTERM/SIGINT, let running requests finish this long\n"
            "                        (default 10000), then cancel them; the SSD tier is flushed\n"
            "  --conn-timeout S      close connections idle S seconds (default 30)\n"
            "  --max-connections N   open connections at most (default 256)\n"
            "  --threads N           threads of the engine's prefill and batched decode, the\n"
            "                        engine thread included, 1 to 64 (default: online CPUs, at\n"
            "                        most 8); replies do not depend on it\n"
            KVT_CLI_KV_DTYPE_HELP
            "                        (default f16: greedy replies of stories260K agree with f32 on\n"
            "                        64 of 64 prompts, perplexity equal, half the bytes; `kvtier\n"
            "                        bench kv-dtype`; a cached prefix is cut back at block\n"
            "                        boundaries)\n"
            "  --live-cache-blocks N, --live-cache-bytes B  each request keeps at most N full kv\n"
            "                        blocks (B bytes; the smaller wins) of its context in RAM; the\n"
            "                        others are written once to a page file and read back,\n"
            "                        checksummed, when attention needs them (docs/residency.md).\n"
            "                        Replies are the same as fully resident. Admission (--kv-budget,\n"
            "                        --pool-kv) charges the bound, not the context, so more long\n"
            "                        requests fit. Every --kv-dtype (f16, bf16, q8: their sealed blocks).\n"
            "                        /stats kv.live_* and /metrics kvtier_live_* count the paging\n"
            "  --live-cache-dir DIR  where each request's page file is made (unlinked at once;\n"
            "                        default $TMPDIR, else /tmp; give a directory on a disk: a\n"
            "                        page file on a tmpfs takes RAM too)\n"
            "  --live-cache-strict   the bound holds exactly: a block past it is released as soon\n"
            "                        as it is written, and the request waits for that write\n"
            "                        (default: up to 4 blocks per layer stay in RAM while their\n"
            "                        writes are in flight, docs/residency.md)\n"
            "\n"
            "Sampling follows the request (OpenAI defaults: temperature 1, top_p 1; \"seed\" makes\n"
            "it repeatable; temperature 0 is greedy). Chat replies end before a newline, like\n"
            "kvtier chat; \"stop\" sequences end them too.\n"
            "\n"
            "Exit status: 0 after a clean shutdown, 1 failure (message on stderr), 2 usage error.\n");
}

static int usage_error(const char *msg, const char *arg)
{
    fprintf(stderr, "kvtier serve: %s%s%s (kvtier serve --help for usage)\n", msg, arg ? " " : "", arg ? arg : "");
    return 2;
}

static int parse_int(const char *flag, const char *v, long long lo, long long hi, long long *out)
{
    if (!kvt_cli_int(v, lo, hi, out))
        return 0;
    fprintf(stderr, "kvtier serve: %s wants an integer in [%lld, %lld], got '%s'\n", flag, lo, hi, v);
    return 2;
}

/* The thread that waits for SIGINT/SIGTERM (set before the handler is installed). */
static pthread_t g_main_thread;

/* SIGINT/SIGTERM delivered to a thread that does not block them: sent on to
 * the main thread, which blocks them and takes them with sigtimedwait.
 * pthread_kill is async-signal-safe. */
static void forward_to_main(int sig)
{
    if (!pthread_equal(pthread_self(), g_main_thread))
        pthread_kill(g_main_thread, sig);
}

int kvt_cmd_serve(int argc, char **argv)
{
    kvt_server_opts o = {.prompt_cache_bytes = 1ull << 30, .port = 8080, .kv_scheme = KVT_KV_F16};
    long long redis_timeout = 0, redis_ttl = 0, redis_restore = 0;
    long long port = 8080, max_queue = 64, max_running = 64, shutdown_ms = 10000, demote = 0, conn_timeout = 30,
              max_conn = 256, threads = 0, ckpt_every = 0, live_blocks = 0, prefill_chunk = 0;
    uint64_t max_body = 1 << 20;
    const char *pub_dirs[7];
    int n_pub = 0;
    kvt_server_model models[KVT_SERVER_MAX_MODELS];
    memset(models, 0, sizeof models);
    int n_model = 0, n_tok = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--ssd-cache-verify")) {
            o.ssd_verify = 1;
            continue;
        }
        if (!strcmp(a, "--redis-cluster")) {
            o.redis_cluster = 1;
            continue;
        }
        if (!strcmp(a, "--live-cache-strict")) {
            o.live_cache_strict = 1;
            continue;
        }
        if (!strcmp(a, "--checkpoint-sync")) {
            o.checkpoint_sync = 1;
            continue;
        }
        static const char *const with_value[] = {
            "--model", "--tokenizer", "--model-name", "--host", "--port", "--prompt-cache", "--kv-budget",
            "--ssd-cache", "--ssd-cache-max", "--demote-idle", "--max-queue", "--max-running", "--prefill-chunk", "--max-body",
            "--api-key", "--shutdown-timeout", "--conn-timeout", "--max-connections", "--threads",
            "--prompt-cache-dir", "--kv-dtype", "--redis", "--redis-timeout", "--redis-ttl", "--checkpoint-every",
            "--redis-restore-timeout", "--pool-ram", "--pool-kv", "--pool-disk", "--pool-remote", "--live-cache-blocks",
            "--live-cache-bytes", "--live-cache-dir", NULL};
        int known = 0;
        for (int k = 0; with_value[k]; k++)
            known |= !strcmp(a, with_value[k]);
        if (!known)
            return usage_error("unknown flag", a);
        if (i + 1 >= argc)
            return usage_error("missing value after", a);
        const char *v = argv[++i];
        int rc = 0;
        if (!strcmp(a, "--model")) {
            if (n_model == KVT_SERVER_MAX_MODELS)
                return usage_error("too many --model (at most 8)", NULL);
            models[n_model++].model_path = v;
        } else if (!strcmp(a, "--tokenizer")) {
            if (n_tok == KVT_SERVER_MAX_MODELS)
                return usage_error("too many --tokenizer (at most 8)", NULL);
            models[n_tok++].tok_path = v;
        } else if (!strcmp(a, "--model-name")) {
            if (!*v || strlen(v) >= 64)
                return usage_error("--model-name wants 1 to 63 characters, got", v);
            int k = n_model ? n_model - 1 : 0;
            if (models[k].model_name)
                return usage_error("--model-name given twice for one --model:", v);
            models[k].model_name = v;
        } else if (!strcmp(a, "--host"))
            o.host = v;
        else if (!strcmp(a, "--ssd-cache"))
            o.ssd_dir = v;
        else if (!strcmp(a, "--redis"))
            o.redis_url = v;
        else if (!strcmp(a, "--redis-timeout")) {
            rc = parse_int(a, v, 1, 60000, &redis_timeout);
            o.redis_timeout_ms = (int32_t)redis_timeout;
        } else if (!strcmp(a, "--redis-restore-timeout")) {
            rc = parse_int(a, v, 1, 600000, &redis_restore);
            o.redis_restore_timeout_ms = (int32_t)redis_restore;
        } else if (!strcmp(a, "--redis-ttl")) {
            rc = parse_int(a, v, 1, LLONG_MAX / 1000, &redis_ttl);
            o.redis_ttl_s = redis_ttl;
        }
        else if (!strcmp(a, "--prompt-cache-dir")) {
            if (!*v || n_pub == 7)
                return usage_error(*v ? "too many --prompt-cache-dir (at most 7)" : "--prompt-cache-dir wants a directory",
                                   NULL);
            pub_dirs[n_pub++] = v;
        }
        else if (!strcmp(a, "--api-key")) {
            if (!*v)
                return usage_error("--api-key wants a non-empty key", NULL);
            o.api_key = v;
        } else if (!strcmp(a, "--port"))
            rc = parse_int(a, v, 0, 65535, &port);
        else if (!strcmp(a, "--max-queue"))
            rc = parse_int(a, v, 0, 1 << 20, &max_queue);
        else if (!strcmp(a, "--max-running"))
            rc = parse_int(a, v, 1, 4096, &max_running);
        else if (!strcmp(a, "--prefill-chunk"))
            rc = parse_int(a, v, 1, 256, &prefill_chunk);
        else if (!strcmp(a, "--shutdown-timeout"))
            rc = parse_int(a, v, 0, LLONG_MAX / 2, &shutdown_ms);
        else if (!strcmp(a, "--demote-idle"))
            rc = parse_int(a, v, 0, LLONG_MAX / 2, &demote);
        else if (!strcmp(a, "--conn-timeout"))
            rc = parse_int(a, v, 1, 86400, &conn_timeout);
        else if (!strcmp(a, "--max-connections"))
            rc = parse_int(a, v, 1, 65536, &max_conn);
        else if (!strcmp(a, "--threads"))
            rc = parse_int(a, v, 1, KVT_MODEL_MAX_THREADS, &threads);
        else if (!strcmp(a, "--checkpoint-every"))
            rc = parse_int(a, v, 1, INT32_MAX, &ckpt_every);
        else if (!strcmp(a, "--live-cache-blocks"))
            rc = parse_int(a, v, 1, LLONG_MAX, &live_blocks);
        else if (!strcmp(a, "--live-cache-dir")) {
            if (!*v)
                return usage_error("--live-cache-dir wants a directory", NULL);
            o.live_cache_dir = v;
        }
        else if (!strcmp(a, "--kv-dtype")) {
            kvt_kv_scheme ks;
            if (kvt_cli_kv_scheme(v, &ks))
                return usage_error("--kv-dtype wants f32, f16, bf16 or q8, got", v);
            o.kv_scheme = (int)ks;
        }
        else {
            uint64_t *dst = !strcmp(a, "--prompt-cache") ? &o.prompt_cache_bytes
                            : !strcmp(a, "--kv-budget")  ? &o.kv_budget_bytes
                            : !strcmp(a, "--max-body")   ? &max_body
                            : !strcmp(a, "--pool-ram")   ? &o.pool_ram_bytes
                            : !strcmp(a, "--pool-kv")    ? &o.pool_kv_bytes
                            : !strcmp(a, "--pool-disk")  ? &o.pool_disk_bytes
                            : !strcmp(a, "--pool-remote") ? &o.pool_remote_bytes
                            : !strcmp(a, "--live-cache-bytes") ? &o.live_cache_bytes
                                                         : &o.ssd_max_bytes;
            if (kvt_chat_parse_bytes(a, v, dst)) {
                fprintf(stderr, "kvtier serve: %s\n", kvt_last_error());
                return 2;
            }
        }
        if (rc)
            return rc;
    }
    if (n_model != n_tok)
        return usage_error(n_model > n_tok ? "--model given without --tokenizer" : "--tokenizer given without --model",
                           NULL);
    if (!n_model && models[0].model_name)
        o.model_name = models[0].model_name; /* the built-in default model, renamed */
    if (n_model == 1) {
        o.model_path = models[0].model_path;
        o.tok_path = models[0].tok_path;
        o.model_name = models[0].model_name;
    } else if (n_model > 1) {
        o.models = models;
        o.n_models = n_model;
    }
    if (o.pool_remote_bytes && !o.redis_url)
        return usage_error("--pool-remote needs --redis URL (the writes it bounds)", NULL);
    if (o.pool_disk_bytes && (!o.ssd_dir || !o.ssd_max_bytes))
        return usage_error("--pool-disk needs --ssd-cache DIR with --ssd-cache-max BYTES (the budget it charges)",
                           NULL);
    if (o.pool_disk_bytes && o.ssd_max_bytes > o.pool_disk_bytes)
        return usage_error("--ssd-cache-max is over --pool-disk", NULL);
    if (!o.ssd_dir && (o.ssd_max_bytes || o.ssd_verify || demote || ckpt_every))
        return usage_error("--ssd-cache-max, --ssd-cache-verify, --demote-idle and --checkpoint-every need "
                           "--ssd-cache DIR", NULL);
    if (o.checkpoint_sync && !ckpt_every)
        return usage_error("--checkpoint-sync needs --checkpoint-every N", NULL);
    o.checkpoint_every = ckpt_every;
    o.live_cache_blocks = live_blocks;
    if ((o.live_cache_dir || o.live_cache_strict) && !live_blocks && !o.live_cache_bytes)
        return usage_error(o.live_cache_dir ? "--live-cache-dir needs --live-cache-blocks N or --live-cache-bytes B"
                                            : "--live-cache-strict needs --live-cache-blocks N or --live-cache-bytes B",
                           NULL);
    if (o.ssd_dir && o.prompt_cache_bytes == 0)
        return usage_error("--ssd-cache needs a prompt cache (--prompt-cache > 0) to tier under", NULL);
    if (n_pub && o.prompt_cache_bytes == 0)
        return usage_error("--prompt-cache-dir needs a prompt cache (--prompt-cache > 0) to tier under", NULL);
    if (!o.redis_url && (o.redis_cluster || o.redis_timeout_ms || o.redis_ttl_s || o.redis_restore_timeout_ms))
        return usage_error("--redis-cluster, --redis-timeout, --redis-restore-timeout and --redis-ttl need --redis URL",
                           NULL);
    if (o.redis_url && o.prompt_cache_bytes == 0)
        return usage_error("--redis needs a prompt cache (--prompt-cache > 0) to tier under", NULL);
    o.prompt_cache_dirs = pub_dirs;
    o.n_prompt_cache_dirs = n_pub;
    if (max_body < 1)
        return usage_error("--max-body must be at least 1 byte", NULL);
    if (!o.api_key) {
        const char *env = getenv("KVTIER_API_KEY");
        if (env && *env)
            o.api_key = env;
    }
    o.port = (int)port;
    o.max_queue = max_queue;
    o.max_running = max_running;
    o.prefill_chunk = prefill_chunk;
    o.max_body = max_body;
    o.demote_idle_ms = (uint64_t)demote;
    o.conn_timeout_s = (unsigned)conn_timeout;
    o.max_connections = (unsigned)max_conn;
    o.threads = (int)threads;

    /* every thread the server starts inherits this mask; the main thread
     * takes SIGINT/SIGTERM with sigwait. Threads started before this point
     * (OpenBLAS starts its pool when the library loads) do not block them:
     * a SIGTERM the kernel gives one of those would end the process without
     * the graceful stop, so the handler hands it to the main thread */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    g_main_thread = pthread_self();
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = forward_to_main;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvt_server *s = NULL;
    int rc = kvt_server_start(&o, &s);
    if (rc) {
        fprintf(stderr, "kvtier serve: %s\n", kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
        return 1;
    }
    const char *host = o.host && strcmp(o.host, "localhost") ? o.host : "127.0.0.1";
    int v6 = strchr(host, ':') != NULL;
    fprintf(stderr, "kvtier serve: listening on http://%s%s%s:%d\n", v6 ? "[" : "", host, v6 ? "]" : "",
            kvt_server_port(s));
    fflush(stderr);
    if ((rc = kvt_server_load(s))) {
        fprintf(stderr, "kvtier serve: cannot load: %s\n", kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
        kvt_server_destroy(s);
        return 1;
    }
    if (kvt_server_model_count(s) > 1) {
        fprintf(stderr, "kvtier serve: ready, models");
        for (int i = 0; i < kvt_server_model_count(s); i++)
            fprintf(stderr, "%s %s", i ? "," : "", kvt_server_model_id(s, i));
        fprintf(stderr, "\n");
    } else
        fprintf(stderr, "kvtier serve: ready, model %s\n", kvt_server_model_name(s));
    fflush(stderr);
    /* wait for SIGINT/SIGTERM, saying a tier level's degradation within a second */
    int sig = -1;
    for (;;) {
        kvt_server_poll_tiers(s);
        struct timespec tick = {.tv_sec = 1};
        sig = sigtimedwait(&set, NULL, &tick);
        if (sig == SIGINT || sig == SIGTERM)
            break;
    }
    fprintf(stderr, "kvtier serve: %s: stopping (running requests get up to %lld ms)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", shutdown_ms);
    fflush(stderr);
    rc = kvt_server_stop(s, shutdown_ms);
    int status = 0;
    if (rc == KVT_ETOOBIG)
        fprintf(stderr, "kvtier serve: warning: a prefix larger than --ssd-cache-max was not written to the SSD "
                        "cache (%s)\n", kvt_last_error());
    else if (rc) {
        fprintf(stderr, "kvtier serve: flushing the cache at shutdown failed: %s\n",
                kvt_last_error()[0] ? kvt_last_error() : kvt_strerror(rc));
        status = 1;
    }
    kvt_server_destroy(s);
    if (!status)
        fprintf(stderr, "kvtier serve: stopped\n");
    return status;
}
