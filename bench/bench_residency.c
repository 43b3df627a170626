/*
 * bench_residency.c: `kvtier bench residency`: what bounded live-cache
 * residency (kvtier/residency.h) costs prefill and decode, measured in one
 * run against the fully resident baseline. The same greedy generation (a
 * prompt of --prompt-tokens seeded token ids, then --gen decoded tokens) runs
 * with the request's full kv blocks bounded to 1/1 (fully resident: no
 * residency at all, the baseline), 1/2, 1/4 and 1/8 of its KV bytes. By
 * default the page file's pages are dropped from the OS page cache after
 * every write and read (fdatasync + posix_fadvise DONTNEED), so every page-in
 * reads the disk. Prints per bound: prefill and decode tok/s, decode as a
 * share of fully resident, disk bytes read per decoded token, the page-in
 * rate achieved while decoding, the disk's ceiling on decode (raw read rate
 * / bytes per token), read stall, peak full-block bytes in RAM; and the raw
 * sequential read rate of the same directory (O_DIRECT-free: a file
 * written, synced and dropped, read back in block-sized preads by one
 * stream, and in half-block preads, the size of a window's page-in, by as
 * many streams as the page-in worker has threads). A row "1/8*" runs 1/8
 * again with all paging on the process's default I/O worker (one
 * background read at a time), the I/O depth before the page-in worker.
 * Checks that every bound decoded the same tokens.
 * --batched-prefill N prefills through kvt_model_forward_batch in passes of
 * N prompt rows (the server's path: `kvtier serve --prefill-chunk N`)
 * instead of kvt_model_prefill; --bounds picks the bounds run (1 is always
 * the baseline).
 * Default models (--shapes): two synthetic shapes written to the temporary
 * directory, one after the other: "mqa" (dim 512, 4 layers, 8 heads
 * sharing one kv head: kv_dim = dim / 8, hidden 2.7 x dim; a tiny per-token
 * compute beside its KV) and "gqa" (the ratios of a Llama-3-8B-like model
 * scaled down: dim 768, 12 heads, 3 kv heads: kv_dim = dim / 4, hidden 3.5 x
 * dim, 4 layers); --model for another. Owns its temporary directory and
 * removes it.
 */
#include "args.h"
#include "bench_util.h"
#include "cli.h"
#include "model.h"

#include "kvtier/io.h"
#include "kvtier/residency.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RAW_BYTES ((uint64_t)256 << 20) /* bytes of the raw read measurement */
#define RAW_STREAMS 4                   /* = the page-in worker's threads (residency.c) */
#define ROWS 5 /* bounds 1/1, 1/2, 1/4, 1/8, and 1/8 with paging on the default worker */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier bench residency [--model M.bin] [--prompt-tokens N] [--gen N] [--block-tokens B]\n"
            "                              [--dir DIR] [--runs N] [--threads N] [--keep-page-cache]\n"
            "                              [--batched-prefill N] [--bounds 1,2,4,8] [--shapes mqa,gqa]\n"
            "\n"
            "Prefill and decode tokens/s of one greedy generation with the request's full kv blocks\n"
            "bounded to 1/1 (fully resident), 1/2, 1/4 and 1/8 of its KV bytes, the page file in DIR\n"
            "(default $TMPDIR, else /var/tmp); its pages are dropped from the OS page cache after each\n"
            "write and read (unless --keep-page-cache), so page-ins read the disk. Prints decode as a\n"
            "share of fully resident (the goal at 1/8: >= 50%%), the disk bytes read per decoded\n"
            "token, the page-in rate achieved while decoding and the disk's ceiling on decode (raw\n"
            "read rate / bytes per token), next to the raw read rate of DIR (1 stream of block-sized\n"
            "preads; 4 streams of half-block preads, the page-in worker's depth and read size).\n"
            "Row 1/8*: 1/8 again with all paging on the default I/O worker (one read at a time).\n"
            "Default models, one table each (--shapes picks): mqa, synthetic dim 512, hidden 1376, 4\n"
            "layers, 8 heads sharing 1 kv head (kv_dim = dim/8); gqa, synthetic dim 768, hidden 2688,\n"
            "4 layers, 12 heads, 3 kv heads (kv_dim = dim/4, hidden 3.5 x dim: Llama-3-8B's ratios\n"
            "scaled down); both vocab 512, seq-len 4096. --prompt-tokens 3968, --gen 64,\n"
            "--block-tokens 256, --runs 1 (medians when more).\n"
            "--batched-prefill N: prefill in passes of N (1-256) prompt rows through the batched pass\n"
            "the server's scheduler runs (serve --prefill-chunk N) instead of kvt_model_prefill.\n"
            "--bounds: the denominators of the bounds to run, a comma list of 1, 2, 4, 8 (1, fully\n"
            "resident, always runs first: the baseline).\n");
}

static int fail(const char *what, int rc)
{
    fprintf(stderr, "kvtier bench residency: %s: %s (%s)\n", what, kvt_strerror(rc), kvt_last_error());
    return 1;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

typedef struct run_result {
    double prefill_tok_s, decode_tok_s, decode_s;
    uint64_t decode_bytes_in; /* page-ins during decode */
    double stall_ms;
    uint64_t peak_resident;
    int32_t *toks; /* (gen) decoded tokens */
} run_result;

/* The prompt through kvt_model_forward_batch in passes of at most `rows`
 * rows of the one sequence (the server's prefill); logits of the last row. */
static int prefill_batched(kvt_model *m, kvt_cache **caches, const int32_t *prompt, int64_t n_prompt, int32_t rows,
                           float *logits)
{
    for (int64_t at = 0; at < n_prompt;) {
        int64_t n = n_prompt - at < rows ? n_prompt - at : rows, cap = kvt_model_pass_rows(m, caches);
        int32_t count = (int32_t)(n < cap ? n : cap);
        int rc = kvt_model_forward_batch(m, 1, &caches, &count, prompt + at, logits);
        if (rc)
            return rc;
        at += count;
    }
    return 0;
}

/* One generation with full blocks bounded to bound_bytes (0: no residency);
 * batched > 0: the prompt in batched passes of that many rows; io: the
 * worker all paging runs on (NULL: the residency's own choice, page-ins on
 * the page-in worker). */
static int one_run(kvt_model *m, const int32_t *prompt, int64_t n_prompt, int64_t gen, int32_t block,
                   uint64_t bound_bytes, const char *dir, int drop, int32_t batched, kvt_io *io, run_result *out)
{
    const kvt_model_config *c = kvt_model_get_config(m);
    int L = c->n_layers, V = c->vocab_size, rc = 0;
    kvt_cache **caches = calloc((size_t)L, sizeof *caches);
    float *logits = malloc((size_t)V * sizeof *logits);
    kvt_residency *r = NULL;
    if (!caches || !logits) {
        rc = kvt_set_error(KVT_ENOMEM, "bench residency: out of memory");
        goto done;
    }
    if ((rc = kvt_model_new_caches(m, block, caches)))
        goto done;
    if (bound_bytes) {
        kvt_residency_options o = {.max_bytes = bound_bytes, .dir = dir, .drop_page_cache = drop, .io = io};
        if ((rc = kvt_residency_create(&o, &r)))
            goto done;
        for (int l = 0; l < L && rc == 0; l++)
            if (!strcmp(kvt_cache_kind(caches[l]), "kv"))
                rc = kvt_kv_set_residency(caches[l], r, l);
        if (rc)
            goto done;
    }
    uint64_t t0 = kvt_now_ns();
    if ((rc = batched ? prefill_batched(m, caches, prompt, n_prompt, batched, logits)
                      : kvt_model_prefill(m, caches, prompt, n_prompt, logits)))
        goto done;
    uint64_t t1 = kvt_now_ns();
    kvt_residency_stats s0 = {0}, s1 = {0};
    if (r)
        (void)kvt_residency_stats_get(r, &s0);
    for (int64_t g = 0; g < gen; g++) {
        int32_t tok = argmax(logits, V);
        out->toks[g] = tok;
        if (g + 1 < gen && (rc = kvt_model_decode(m, caches, tok, logits)))
            goto done;
    }
    uint64_t t2 = kvt_now_ns();
    if (r)
        (void)kvt_residency_stats_get(r, &s1);
    out->prefill_tok_s = (double)n_prompt / ((double)(t1 - t0) / 1e9);
    out->decode_tok_s = gen > 1 ? (double)(gen - 1) / ((double)(t2 - t1) / 1e9) : 0;
    out->decode_s = (double)(t2 - t1) / 1e9;
    out->decode_bytes_in = s1.bytes_in - s0.bytes_in;
    out->stall_ms = (double)s1.stall_ns / 1e6;
    out->peak_resident = s1.peak_resident_bytes;
done:
    if (caches && caches[0])
        kvt_caches_destroy(caches, L);
    kvt_residency_release(r);
    free(caches);
    free(logits);
    return rc;
}

/* One stream of raw_read_rate: reads chunks next, next + streams, ... */
typedef struct raw_stream {
    pthread_t th;
    int fd, first, streams, rc;
    uint64_t bytes;
    size_t chunk;
} raw_stream;

static void *raw_stream_run(void *arg)
{
    raw_stream *st = arg;
    char *buf = malloc(st->chunk);
    if (!buf) {
        st->rc = KVT_ENOMEM;
        return NULL;
    }
    for (uint64_t off = (uint64_t)st->first * st->chunk; off < st->bytes && st->rc == 0;
         off += (uint64_t)st->streams * st->chunk)
        if (pread(st->fd, buf, st->chunk, (off_t)off) != (ssize_t)st->chunk)
            st->rc = -EIO;
    free(buf);
    return NULL;
}

/* Raw read rate of dir in GB/s: `bytes` written, synced, dropped from the
 * page cache, read back in `chunk`-byte preads, by one stream (*gbs1,
 * sequential) and again, dropped again, in `chunk2`-byte preads by
 * `streams` threads taking every streams-th chunk (*gbs_n). */
static int raw_read_rate(const char dir[4096], uint64_t bytes, size_t chunk, size_t chunk2, int streams,
                         double *gbs1, double *gbs_n)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/raw-read.bin", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return kvt_set_error(-errno, "bench residency: %s: %s", path, strerror(errno));
    unlink(path);
    char *buf = malloc(chunk);
    int rc = 0;
    if (!buf) {
        close(fd);
        return kvt_set_error(KVT_ENOMEM, "bench residency: out of memory");
    }
    uint64_t s = 1;
    for (size_t i = 0; i < chunk; i++)
        buf[i] = (char)kvt_bench_util_rnd32(&s);
    for (uint64_t off = 0; off < bytes && rc == 0; off += chunk)
        if (pwrite(fd, buf, chunk, (off_t)off) != (ssize_t)chunk)
            rc = kvt_set_error(-errno, "bench residency: writing %s failed", path);
    if (rc == 0 && fdatasync(fd) != 0)
        rc = kvt_set_error(-errno, "bench residency: fdatasync %s failed", path);
    (void)posix_fadvise(fd, 0, (off_t)bytes, POSIX_FADV_DONTNEED);
    uint64_t t0 = kvt_now_ns();
    for (uint64_t off = 0; off < bytes && rc == 0; off += chunk)
        if (pread(fd, buf, chunk, (off_t)off) != (ssize_t)chunk)
            rc = kvt_set_error(-errno, "bench residency: reading %s failed", path);
    double sec = (double)(kvt_now_ns() - t0) / 1e9;
    *gbs1 = sec > 0 ? (double)bytes / sec / 1e9 : 0;
    raw_stream st[RAW_STREAMS];
    streams = streams < 1 ? 1 : streams > RAW_STREAMS ? RAW_STREAMS : streams;
    (void)posix_fadvise(fd, 0, (off_t)bytes, POSIX_FADV_DONTNEED);
    t0 = kvt_now_ns();
    int started = 0;
    for (; rc == 0 && started < streams; started++) {
        st[started] = (raw_stream){.fd = fd, .first = started, .streams = streams, .bytes = bytes, .chunk = chunk2};
        if (pthread_create(&st[started].th, NULL, raw_stream_run, &st[started]) != 0) {
            rc = kvt_set_error(KVT_ENOMEM, "bench residency: cannot start a read stream");
            break;
        }
    }
    for (int i = 0; i < started; i++) {
        pthread_join(st[i].th, NULL);
        if (rc == 0 && st[i].rc)
            rc = kvt_set_error(st[i].rc, "bench residency: reading %s failed", path);
    }
    sec = (double)(kvt_now_ns() - t0) / 1e9;
    *gbs_n = sec > 0 ? (double)bytes / sec / 1e9 : 0;
    free(buf);
    close(fd);
    return rc;
}

/* What the bench runs (the parsed flags). */
typedef struct bench_opts {
    long long n_prompt, gen, block, runs, threads, batched;
    int drop, use[4];
} bench_opts;

/* Every bound of o on the model at model_path (label: how the table names
 * it, NULL: the path), page files in dir; unlinks `remove` (the synthetic
 * model) at the end. @return 0, 1 (failed), 2 (bad flags for this model). */
static int bench_model(const char *dir, const char *model_path, const char *label, const char *remove,
                       const bench_opts *o)
{
    long long n_prompt = o->n_prompt, gen = o->gen, block = o->block, runs = o->runs, threads = o->threads;
    long long batched = o->batched;
    int drop = o->drop;
    const int *use = o->use;
    int status = 1, rc;
    kvt_model *m = NULL;
    int32_t *prompt = NULL;
    run_result res[ROWS][16];
    memset(res, 0, sizeof res);
    kvt_io *dio = NULL; /* the 1/8* row's worker */
    if (use[3] && (rc = kvt_io_default_acquire(&dio))) {
        status = fail("cannot start the default I/O worker", rc);
        goto done;
    }
    if ((rc = kvt_model_load(model_path, &m))) {
        status = fail("cannot load the model", rc);
        goto done;
    }
    if (threads && (rc = kvt_model_set_threads(m, (int)threads))) {
        status = fail("cannot start the engine threads", rc);
        goto done;
    }
    const kvt_model_config *c = kvt_model_get_config(m);
    if (n_prompt + gen > c->seq_len) {
        fprintf(stderr, "kvtier bench residency: --prompt-tokens %lld + --gen %lld exceeds the model's seq_len %d\n",
                n_prompt, gen, c->seq_len);
        status = 2;
        goto done;
    }
    prompt = malloc((size_t)n_prompt * sizeof *prompt);
    if (!prompt) {
        status = fail("out of memory", KVT_ENOMEM);
        goto done;
    }
    uint64_t s = 42;
    for (long long i = 0; i < n_prompt; i++)
        prompt[i] = (int32_t)(kvt_bench_util_rnd32(&s) % (uint32_t)c->vocab_size);
    /* the request's KV: every attention layer's rows in whole blocks */
    int64_t tokens = n_prompt + gen - 1;
    uint64_t kv = (uint64_t)((tokens + block - 1) / block * block) * kvt_model_kv_bytes_per_token(m);
    static const int den[ROWS] = {1, 2, 4, 8, 8};
    for (long long k = 0; k < runs; k++)
        for (int b = 0; b < ROWS; b++) { /* bounds alternate so all see the same machine */
            if (!use[b < 4 ? b : 3])
                continue;
            run_result *r = &res[b][k];
            r->toks = calloc((size_t)gen, sizeof *r->toks);
            if (!r->toks) {
                status = fail("out of memory", KVT_ENOMEM);
                goto done;
            }
            if ((rc = one_run(m, prompt, n_prompt, gen, (int32_t)block, b ? kv / (uint64_t)den[b] : 0, dir, drop,
                              (int32_t)batched, b == 4 ? dio : NULL, r))) {
                status = fail("generation failed", rc);
                goto done;
            }
            if (memcmp(r->toks, res[0][0].toks, (size_t)gen * sizeof *r->toks)) {
                fprintf(stderr, "kvtier bench residency: bound 1/%d decoded other tokens than fully resident\n",
                        den[b]);
                goto done;
            }
        }
    double raw1 = 0, raw = 0; /* one stream of whole blocks; the page-in worker's depth of halves */
    size_t blk_bytes = (size_t)block * kvt_model_kv_row_bytes(m);
    if ((rc = raw_read_rate(dir, RAW_BYTES, blk_bytes, blk_bytes / 2, RAW_STREAMS, &raw1, &raw))) {
        status = fail("raw read", rc);
        goto done;
    }
    printf("model %s: dim %d, hidden %d, %d layers, %d heads, %d kv heads, kv_dim %d; prompt %lld + %lld decoded "
           "tokens; KV %.1f MB in blocks of %lld tokens (%.0f KB per layer); page cache %s\n",
           label ? label : model_path, c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->kv_dim,
           n_prompt, gen, kv / 1e6, block, blk_bytes / 1e3,
           drop ? "dropped after every page write and read" : "kept");
    if (batched)
        printf("prefill: batched passes of %lld prompt rows (kvt_model_forward_batch, the server's path)\n", batched);
    else
        printf("prefill: kvt_model_prefill (chunks of 256 tokens)\n");
    printf("raw read of %s (%.0f MB, page cache dropped): %.2f GB/s in %zu-byte preads, 1 stream; %.2f GB/s in "
           "%zu-byte preads, %d streams (a page-in's size, the page-in worker's threads)\n", dir, RAW_BYTES / 1e6,
           raw1, blk_bytes, raw, blk_bytes / 2, RAW_STREAMS);
    printf("%6s %10s %12s %12s %9s %14s %12s %12s %10s %10s\n", "bound", "RAM bound", "prefill/s", "decode/s",
           "of 1/1", "disk B/token", "page-in GB/s", "disk cap/s", "stall ms", "peak MB");
    double base = 0;
    for (int b = 0; b < ROWS; b++) {
        if (!use[b < 4 ? b : 3])
            continue;
        double pf[16], dc[16], bt[16], st[16], pk[16], gb[16];
        for (long long k = 0; k < runs; k++) {
            pf[k] = res[b][k].prefill_tok_s;
            dc[k] = res[b][k].decode_tok_s;
            bt[k] = gen > 1 ? (double)res[b][k].decode_bytes_in / (double)(gen - 1) : 0;
            st[k] = res[b][k].stall_ms;
            pk[k] = (double)res[b][k].peak_resident;
            gb[k] = res[b][k].decode_s > 0 ? (double)res[b][k].decode_bytes_in / res[b][k].decode_s / 1e9 : 0;
        }
        double dmed = kvt_bench_util_median(dc, runs), bmed = kvt_bench_util_median(bt, runs);
        if (b == 0)
            base = dmed;
        char bound[32];
        snprintf(bound, sizeof bound, "%.1f MB", (b ? kv / (uint64_t)den[b] : kv) / 1e6);
        char cap[32]; /* the disk's ceiling on decode: raw rate / bytes per token */
        if (bmed > 0)
            snprintf(cap, sizeof cap, "%.1f", raw * 1e9 / bmed);
        else
            snprintf(cap, sizeof cap, "-");
        printf("%4s%d%-1s %10s %12.1f %12.2f %8.0f%% %14.0f %12.3f %12s %10.1f %10.1f\n", "1/", den[b], b == 4 ? "*" : "", bound,
               kvt_bench_util_median(pf, runs), dmed, base > 0 ? 100 * dmed / base : 0, bmed,
               kvt_bench_util_median(gb, runs), cap, kvt_bench_util_median(st, runs),
               b ? kvt_bench_util_median(pk, runs) / 1e6 : kv / 1e6);
    }
    printf("goal: decode at 1/8 >= 50%% of fully resident; disk cap/s = %d-stream raw rate / disk B per token (the "
           "most decode could do if the disk were the only cost); 1/8*: 1/8 with all paging on the process's default "
           "I/O worker (one background read at a time, as before the page-in worker); every bound decoded the same "
           "%lld tokens\n", RAW_STREAMS, gen);
    status = 0;
done:
    for (int b = 0; b < ROWS; b++)
        for (int k = 0; k < 16; k++)
            free(res[b][k].toks);
    kvt_io_default_release(dio);
    free(prompt);
    kvt_model_free(m);
    if (remove)
        unlink(remove);
    return status;
}

int kvt_bench_residency(int argc, char **argv)
{
    const char *model_path = NULL, *dir_arg = NULL;
    long long n_prompt = 3968, gen = 64, block = 256, runs = 1, threads = 0, batched = 0;
    int drop = 1, use[4] = {1, 1, 1, 1}; /* bounds 1/1, 1/2, 1/4, 1/8 */
    int shapes[2] = {1, 1};               /* mqa, gqa */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--keep-page-cache")) {
            drop = 0;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvtier bench residency: %s needs a value (or is unknown)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        long long *dst = !strcmp(a, "--prompt-tokens") ? &n_prompt : !strcmp(a, "--gen") ? &gen
                         : !strcmp(a, "--block-tokens") ? &block : !strcmp(a, "--runs") ? &runs
                         : !strcmp(a, "--threads") ? &threads : NULL;
        if (!strcmp(a, "--model"))
            model_path = v;
        else if (!strcmp(a, "--dir"))
            dir_arg = v;
        else if (!strcmp(a, "--bounds")) {
            static const char *const names[4] = {"1", "2", "4", "8"};
            memset(use, 0, sizeof use);
            for (const char *p = v; *p;) {
                size_t len = strcspn(p, ",");
                int hit = 0;
                for (int b = 0; b < 4; b++)
                    if (len == 1 && *p == names[b][0])
                        use[b] = hit = 1;
                if (!hit) {
                    fprintf(stderr, "kvtier bench residency: --bounds: want a comma list of 1, 2, 4, 8, got '%s'\n", v);
                    return 2;
                }
                p += len + (p[len] == ',');
            }
            use[0] = 1; /* the baseline */
        } else if (!strcmp(a, "--shapes")) {
            shapes[0] = shapes[1] = 0;
            for (const char *p = v; *p;) {
                size_t len = strcspn(p, ",");
                if (len == 3 && !strncmp(p, "mqa", 3))
                    shapes[0] = 1;
                else if (len == 3 && !strncmp(p, "gqa", 3))
                    shapes[1] = 1;
                else {
                    fprintf(stderr, "kvtier bench residency: --shapes: want a comma list of mqa, gqa, got '%s'\n", v);
                    return 2;
                }
                p += len + (p[len] == ',');
            }
        } else if (!strcmp(a, "--batched-prefill")) {
            if (kvt_cli_int(v, 1, 256, &batched)) {
                fprintf(stderr, "kvtier bench residency: --batched-prefill: need an integer in [1, 256], got '%s'\n",
                        v);
                return 2;
            }
        } else if (!dst) {
            fprintf(stderr, "kvtier bench residency: unknown flag '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (kvt_cli_int(v, 1, 1 << 24, dst)) {
            fprintf(stderr, "kvtier bench residency: %s: need an integer in [1, %d], got '%s'\n", a, 1 << 24, v);
            return 2;
        }
    }
    const char *tmp = dir_arg ? dir_arg : getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/kvtier-bench-residency-XXXXXX", tmp && *tmp ? tmp : "/var/tmp");
    if (!mkdtemp(dir)) {
        fprintf(stderr, "kvtier bench residency: cannot make a directory under %s: %s\n", tmp ? tmp : "/var/tmp",
                strerror(errno));
        return 1;
    }
    bench_opts o = {n_prompt, gen, block, runs > 16 ? 16 : runs, threads, batched, drop, {use[0], use[1], use[2], use[3]}};
    int status = 0;
    if (model_path) {
        status = bench_model(dir, model_path, NULL, NULL, &o);
    } else {
        static const char *const names[2] = {"mqa", "gqa"};
        static const char *const means[2] = {
            "kv_dim = dim/8, hidden 2.7 x dim: a tiny per-token compute beside its KV",
            "kv_dim = dim/4, hidden 3.5 x dim: the ratios of a Llama-3-8B-like model scaled down"};
        for (int k = 0; k < 2 && status == 0; k++) {
            if (!shapes[k])
                continue;
            kvt_synth_params p;
            memset(&p, 0, sizeof p);
            if (k == 0)
                p.dim = 512, p.hidden_dim = 1376, p.n_heads = 8, p.n_kv_heads = 1;
            else
                p.dim = 768, p.hidden_dim = 2688, p.n_heads = 12, p.n_kv_heads = 3;
            p.n_layers = 4, p.vocab_size = 512, p.seq_len = 4096, p.seed = 20261201;
            char synth[4200], label[300];
            snprintf(synth, sizeof synth, "%s/model.bin", dir);
            snprintf(label, sizeof label, "synthetic %s (%s)", names[k], means[k]);
            int rc = kvt_model_synth(&p, synth);
            status = rc ? fail("cannot write the synthetic model", rc) : bench_model(dir, synth, label, synth, &o);
            if (k == 0 && shapes[1] && status == 0)
                printf("\n");
        }
    }
    rmdir(dir);
    return status;
}
