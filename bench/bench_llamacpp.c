/*
 * bench_llamacpp.c: runs llama.cpp (bench/llamacpp/decode.mjs through node)
 * on a GGUF export of the bench's model, for `kvtier bench engine
 * --context-only`. Owns a temporary directory (the GGUF file and the token
 * file) from open to close and nothing else; it never installs or downloads
 * anything: without the packages `make bench-deps` installs it says so and
 * the bench goes on without the baseline.
 */
#include "bench_llamacpp.h"

#include "bench_util.h"
#include "gguf.h"
#include "tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef KVT_SOURCE_DIR
#define KVT_SOURCE_DIR "."
#endif

static const struct {
    const char *kv;
    int flash;
    kvt_kv_scheme scheme;
} k_configs[KVT_LLAMACPP_CONFIGS] = {
    {"f32", 0, KVT_KV_F32},   {"f16", 0, KVT_KV_F16},   {"f16", 1, KVT_KV_F16},
    {"bf16", 0, KVT_KV_BF16}, {"bf16", 1, KVT_KV_BF16}, {"q8_0", 1, KVT_KV_Q8},
};

struct kvt_llamacpp {
    char dir[64];      /* the temporary directory */
    char script[4096]; /* decode.mjs */
    int threads, runs;
    double tps[2][KVT_LLAMACPP_CONFIGS][KVT_LLAMACPP_MAX_CTX][KVT_LLAMACPP_MAX_RUNS]; /* [own] */
    char info[1024];
};

const char *kvt_llamacpp_kv_name(int i) { return i >= 0 && i < KVT_LLAMACPP_CONFIGS ? k_configs[i].kv : NULL; }
int kvt_llamacpp_flash(int i) { return i >= 0 && i < KVT_LLAMACPP_CONFIGS && k_configs[i].flash; }
kvt_kv_scheme kvt_llamacpp_scheme(int i) { return i >= 0 && i < KVT_LLAMACPP_CONFIGS ? k_configs[i].scheme : KVT_KV_F32; }

int kvt_llamacpp_open(const kvt_model *m, const char *tok_path, const int32_t *tok, int n_tok, int threads,
                      kvt_llamacpp **out)
{
    if (!m || !tok_path || !tok || n_tok < 1 || !out)
        return kvt_set_error(KVT_EINVAL, "kvt_llamacpp_open: NULL argument or no tokens");
    *out = NULL;
    const char *env = getenv("KVT_LLAMACPP_DIR");
    char dir[3800], probe[4200];
    snprintf(dir, sizeof dir, "%s", env && env[0] ? env : KVT_SOURCE_DIR "/bench/llamacpp");
    snprintf(probe, sizeof probe, "%s/node_modules/node-llama-cpp/package.json", dir);
    if (access(probe, R_OK) != 0) {
        fprintf(stderr, "kvtier bench engine: no llama.cpp baseline: %s is absent (run `make bench-deps`, or set "
                "KVT_LLAMACPP_DIR)\n", probe);
        return 0;
    }
    if (system("node --version >/dev/null 2>&1") != 0) {
        fprintf(stderr, "kvtier bench engine: no llama.cpp baseline: node is not installed\n");
        return 0;
    }
    kvt_llamacpp *lc = calloc(1, sizeof *lc);
    if (!lc)
        return kvt_set_error(KVT_ENOMEM, "llama.cpp baseline: out of memory");
    snprintf(lc->script, sizeof lc->script, "%s/decode.mjs", dir);
    lc->threads = threads;
    strcpy(lc->dir, "/tmp/kvtier-bench-llamacpp-XXXXXX");
    if (!mkdtemp(lc->dir)) {
        int e = errno;
        free(lc);
        return kvt_set_error(-e, "llama.cpp baseline: cannot create a temporary directory: %s", strerror(e));
    }
    kvt_tokenizer *t = NULL;
    char path[128];
    snprintf(path, sizeof path, "%s/model.gguf", lc->dir);
    int rc = kvt_tokenizer_load(tok_path, kvt_model_get_config(m)->vocab_size, &t);
    if (rc == 0) {
        fprintf(stderr, "kvtier bench engine: exporting the model as GGUF (f32) to %s for llama.cpp\n", path);
        rc = kvt_gguf_export(m, t, KVT_GGUF_F32, "kvtier-bench", path);
    }
    kvt_tokenizer_free(t);
    snprintf(path, sizeof path, "%s/tokens.bin", lc->dir);
    FILE *f = rc == 0 ? fopen(path, "wb") : NULL;
    if (rc == 0 && (!f || fwrite(tok, sizeof *tok, (size_t)n_tok, f) != (size_t)n_tok))
        rc = kvt_set_error(-(errno ? errno : EIO), "%s: cannot write the bench tokens", path);
    if (f && fclose(f) != 0 && rc == 0)
        rc = kvt_set_error(-(errno ? errno : EIO), "%s: cannot write the bench tokens", path);
    if (rc != 0) {
        kvt_llamacpp_close(lc);
        return rc;
    }
    *out = lc;
    return 0;
}

int kvt_llamacpp_run(kvt_llamacpp *lc, const int *ctx, int n_ctx, int steps)
{
    if (!lc || !ctx || n_ctx < 1 || n_ctx > KVT_LLAMACPP_MAX_CTX || lc->runs >= KVT_LLAMACPP_MAX_RUNS)
        return kvt_set_error(KVT_ELIMIT, "llama.cpp baseline: 1 to %d contexts and at most %d runs",
                             KVT_LLAMACPP_MAX_CTX, KVT_LLAMACPP_MAX_RUNS);
    char cmd[8192], list[128] = "", cfgs[256] = "";
    int n = 0;
    for (int k = 0; k < n_ctx; k++)
        n += snprintf(list + n, sizeof list - (size_t)n, "%s%d", k ? "," : "", ctx[k]);
    n = 0;
    for (int i = 0; i < KVT_LLAMACPP_CONFIGS; i++)
        n += snprintf(cfgs + n, sizeof cfgs - (size_t)n, "%s%s:%s", i ? "," : "", k_configs[i].kv,
                      k_configs[i].flash ? "on" : "off");
    snprintf(cmd, sizeof cmd,
             "node '%s' --model '%s/model.gguf' --tokens-file '%s/tokens.bin' --contexts %s --steps %d --threads %d "
             "--runs 1 --configs %s",
             lc->script, lc->dir, lc->dir, list, steps, lc->threads, cfgs);
    FILE *p = popen(cmd, "r");
    if (!p)
        return kvt_set_error(-errno, "llama.cpp baseline: cannot run node: %s", strerror(errno));
    char line[2048];
    int got = 0, run = lc->runs;
    while (fgets(line, sizeof line, p)) {
        char kv[16], flash[8];
        int c;
        double tps, own;
        if (!strncmp(line, "info ", 5)) {
            line[strcspn(line, "\n")] = '\0';
            size_t len = strlen(line + 5);
            len = len < sizeof lc->info - 1 ? len : sizeof lc->info - 1;
            memcpy(lc->info, line + 5, len);
            lc->info[len] = '\0';
        } else if (sscanf(line, "result kv %15s flash %7s ctx %d tps %lf own %lf", kv, flash, &c, &tps, &own) == 5) {
            for (int i = 0; i < KVT_LLAMACPP_CONFIGS; i++)
                for (int k = 0; k < n_ctx; k++)
                    if (!strcmp(kv, k_configs[i].kv) && !strcmp(flash, k_configs[i].flash ? "on" : "off") &&
                        c == ctx[k])
                        lc->tps[0][i][k][run] = tps, lc->tps[1][i][k][run] = own, got++;
        }
    }
    int st = pclose(p);
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0 || got != KVT_LLAMACPP_CONFIGS * n_ctx)
        return kvt_set_error(KVT_EIO, "llama.cpp baseline: node %s exited with status %d after %d of %d results%s",
                             lc->script, st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st), got,
                             KVT_LLAMACPP_CONFIGS * n_ctx,
                             st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 3 ? " (llama.cpp did not load)" : "");
    lc->runs++;
    return 0;
}

double kvt_llamacpp_tps(const kvt_llamacpp *lc, int cfg, int k, int own)
{
    if (!lc || !lc->runs || cfg < 0 || cfg >= KVT_LLAMACPP_CONFIGS || k < 0 || k >= KVT_LLAMACPP_MAX_CTX)
        return 0;
    double v[KVT_LLAMACPP_MAX_RUNS];
    memcpy(v, lc->tps[own != 0][cfg][k], sizeof(double) * (size_t)lc->runs);
    return kvt_bench_util_median(v, lc->runs);
}

const char *kvt_llamacpp_info(const kvt_llamacpp *lc) { return lc ? lc->info : ""; }

void kvt_llamacpp_close(kvt_llamacpp *lc)
{
    if (!lc)
        return;
    char path[128];
    snprintf(path, sizeof path, "%s/model.gguf", lc->dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokens.bin", lc->dir);
    unlink(path);
    rmdir(lc->dir);
    free(lc);
}
