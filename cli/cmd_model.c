/*
 * cmd_model.c: `kvtier model synth` (write a deterministic synthetic
 * checkpoint), `kvtier model info` (print a checkpoint's shape), `kvtier
 * model default` (print, creating on first use, the built-in default model's
 * paths) and `kvtier model export-gguf` (write a checkpoint as GGUF for
 * llama.cpp). Parses arguments only; the work is in engine/synth.c,
 * engine/default_model.c and engine/gguf.c. Never writes anything but the
 * requested file.
 */
#include "args.h"
#include "cli.h"
#include "chat.h"
#include "gguf.h"
#include "model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtier model synth --out FILE --dim D --hidden H --layers L --heads NH --kv-heads NKV\n"
            "                          --vocab V --seq-len S --seed X [--separate-classifier]\n"
            "                          [--sliding-window W --window-layers LIST] [--recurrent-layers LIST]\n"
            "       kvtier model info FILE    (shape, layer kinds, fingerprint, KV bytes per token, and the\n"
            "                                 identity of the SSD tier: XXH3-128 of every byte, and its cost)\n"
            "       kvtier model default      (prints the built-in model and tokenizer paths)\n"
            "       kvtier model export-gguf [--model M --tokenizer T] --out F.gguf [--dtype f32|f16]\n"
            "                                 (writes M as GGUF v3, architecture \"llama\", for llama.cpp; without\n"
            "                                 --model the built-in default model and its tokenizer; --dtype of the\n"
            "                                 weight matrices, f32 by default, norms stay f32)\n"
            "LIST is comma-separated layer indices, e.g. 1,3. Identical arguments give identical files.\n"
            "Tokenizer: with --vocab 259 chat and generate take the built-in byte-level tokenizer\n"
            "(its path: kvtier model default); another vocab needs a tokenizer.bin of that size.\n");
}

static int parse_i64(const char *flag, const char *s, long long lo, long long hi, long long *out)
{
    if (!kvt_cli_int(s, lo, hi, out))
        return 0;
    fprintf(stderr, "kvtier model: %s expects an integer in [%lld, %lld], got '%s'\n", flag, lo, hi, s);
    return -1;
}

static int parse_layers(const char *flag, const char *list, kvt_synth_params *p, kvt_layer_kind kind)
{
    char buf[1024];
    if (strlen(list) >= sizeof buf) {
        fprintf(stderr, "kvtier model: %s list too long\n", flag);
        return -1;
    }
    strcpy(buf, list);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        long long l;
        if (parse_i64(flag, tok, 0, KVT_MODEL_MAX_LAYERS - 1, &l) != 0)
            return -1;
        if (p->layer_kind[l] != KVT_LAYER_ATTN && p->layer_kind[l] != kind) {
            fprintf(stderr, "kvtier model: layer %lld is in both --window-layers and --recurrent-layers\n", l);
            return -1;
        }
        p->layer_kind[l] = kind;
    }
    return 0;
}

static int cmd_synth(int argc, char **argv)
{
    kvt_synth_params p;
    memset(&p, 0, sizeof p);
    const char *out = NULL;
    int have_seed = 0;
    struct {
        const char *flag;
        int32_t *dst;
    } ints[] = {{"--dim", &p.dim},         {"--hidden", &p.hidden_dim}, {"--layers", &p.n_layers},
                {"--heads", &p.n_heads},   {"--kv-heads", &p.n_kv_heads}, {"--vocab", &p.vocab_size},
                {"--seq-len", &p.seq_len}, {"--sliding-window", &p.sliding_window}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--separate-classifier")) {
            p.separate_classifier = 1;
            continue;
        }
        int known = !strcmp(a, "--out") || !strcmp(a, "--seed") || !strcmp(a, "--window-layers") ||
                    !strcmp(a, "--recurrent-layers");
        for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
            known |= !strcmp(a, ints[k].flag);
        if (!known) {
            fprintf(stderr, "kvtier model synth: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvtier model synth: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        long long x;
        int done = 0;
        for (size_t k = 0; k < sizeof ints / sizeof ints[0] && !done; k++)
            if (!strcmp(a, ints[k].flag)) {
                /* 0 is "not given" below, so only --sliding-window may be 0 */
                if (parse_i64(a, v, strcmp(a, "--sliding-window") ? 1 : 0, INT32_MAX, &x) != 0)
                    return 2;
                *ints[k].dst = (int32_t)x;
                done = 1;
            }
        if (done)
            continue;
        if (!strcmp(a, "--out")) {
            out = v;
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            p.seed = strtoull(v, &end, 10);
            if (errno || end == v || *end || v[0] == '-') {
                fprintf(stderr, "kvtier model synth: --seed expects an unsigned integer, got '%s'\n", v);
                return 2;
            }
            have_seed = 1;
        } else if (!strcmp(a, "--window-layers")) {
            if (parse_layers(a, v, &p, KVT_LAYER_WINDOW) != 0)
                return 2;
        } else if (!strcmp(a, "--recurrent-layers")) {
            if (parse_layers(a, v, &p, KVT_LAYER_RECURRENT) != 0)
                return 2;
        } else {
            fprintf(stderr, "kvtier model synth: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!out || !p.dim || !p.hidden_dim || !p.n_layers || !p.n_heads || !p.n_kv_heads || !p.vocab_size ||
        !p.seq_len || !have_seed) {
        fprintf(stderr, "kvtier model synth: --out, --dim, --hidden, --layers, --heads, --kv-heads, --vocab, "
                        "--seq-len and --seed are required\n");
        usage(stderr);
        return 2;
    }
    for (int32_t l = p.n_layers; l < KVT_MODEL_MAX_LAYERS; l++)
        if (p.layer_kind[l] != KVT_LAYER_ATTN) {
            fprintf(stderr, "kvtier model synth: layer %d in a layer list, but the model has %d layers\n", l,
                    p.n_layers);
            return 2;
        }
    int rc = kvt_model_synth(&p, out);
    if (rc != 0) {
        fprintf(stderr, "kvtier model synth: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
        return rc == KVT_EINVAL ? 2 : 1;
    }
    return 0;
}

static int cmd_default(void)
{
    char model[4096], tok[4096];
    int rc = kvt_default_model(model, sizeof model, tok, sizeof tok);
    if (rc != 0) {
        fprintf(stderr, "kvtier model default: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
        return 1;
    }
    printf("model %s\ntokenizer %s\n", model, tok);
    return 0;
}

static int cmd_info(const char *path)
{
    kvt_model *m = NULL;
    uint64_t t0 = kvt_now_ns();
    int rc = kvt_model_load(path, &m);
    if (rc != 0) {
        fprintf(stderr, "kvtier model info: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
        return 1;
    }
    double load_ms = (double)(kvt_now_ns() - t0) / 1e6;
    kvt_chat_identity id;
    if ((rc = kvt_chat_identity_compute(m, NULL, &id)) != 0) {
        fprintf(stderr, "kvtier model info: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
        kvt_model_free(m);
        return 1;
    }
    const kvt_model_config *c = kvt_model_get_config(m);
    static const char kind_char[3] = {'A', 'W', 'R'};
    char kinds[KVT_MODEL_MAX_LAYERS + 1];
    for (int32_t l = 0; l < c->n_layers; l++)
        kinds[l] = kind_char[c->layer_kind[l]];
    kinds[c->n_layers] = '\0';
    printf("dim %d hidden %d layers %d heads %d kv_heads %d head_size %d kv_dim %d vocab %d seq_len %d\n"
           "classifier %s, sliding_window %d, layers %s (A attention, W window, R recurrent)\n"
           "fingerprint %016llx, kv bytes/token %zu, fixed state bytes %zu\n",
           c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->head_size, c->kv_dim, c->vocab_size,
           c->seq_len, c->shared_classifier ? "shared" : "separate", c->sliding_window, kinds,
           (unsigned long long)kvt_model_fingerprint(m), kvt_model_kv_bytes_per_token(m),
           kvt_model_fixed_state_bytes(m));
    printf("identity %s (every byte: %.1f MB hashed in %.1f ms; load %.1f ms)\n", id.model_id,
           (double)id.model_bytes / 1e6, id.ms, load_ms);
    kvt_model_free(m);
    return 0;
}

static int cmd_export_gguf(int argc, char **argv)
{
    const char *model = NULL, *tok = NULL, *out = NULL, *dtype = "f32";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = !strcmp(a, "--model") ? &model : !strcmp(a, "--tokenizer") ? &tok
                         : !strcmp(a, "--out") ? &out : !strcmp(a, "--dtype") ? &dtype : NULL;
        if (!dst) {
            fprintf(stderr, "kvtier model export-gguf: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvtier model export-gguf: %s needs a value\n", a);
            return 2;
        }
        *dst = argv[++i];
    }
    kvt_gguf_dtype dt;
    if (kvt_gguf_dtype_parse(dtype, &dt) != 0) {
        fprintf(stderr, "kvtier model export-gguf: --dtype: %s\n", kvt_last_error());
        return 2;
    }
    if (!out || (model && !tok) || (!model && tok)) {
        fprintf(stderr, "kvtier model export-gguf: %s\n",
                !out ? "--out F.gguf is required"
                     : "--model and --tokenizer go together (give both, or neither for the default model)");
        usage(stderr);
        return 2;
    }
    char mp[4096], tp[4096];
    int rc = 0;
    if (!model) {
        if ((rc = kvt_default_model(mp, sizeof mp, tp, sizeof tp)) != 0) {
            fprintf(stderr, "kvtier model export-gguf: default model: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
            return 1;
        }
        model = mp, tok = tp;
    }
    kvt_model *m = NULL;
    kvt_tokenizer *t = NULL;
    if ((rc = kvt_model_load(model, &m)) == 0 &&
        (rc = kvt_tokenizer_load(tok, kvt_model_get_config(m)->vocab_size, &t)) == 0) {
        const char *base = strrchr(model, '/');
        rc = kvt_gguf_export(m, t, dt, base ? base + 1 : model, out);
    }
    if (rc != 0)
        fprintf(stderr, "kvtier model export-gguf: %s (%s)\n", kvt_last_error(), kvt_strerror(rc));
    kvt_tokenizer_free(t);
    kvt_model_free(m);
    return rc == 0 ? 0 : rc == KVT_EINVAL || rc == KVT_EUNSUPPORTED ? 2 : 1;
}

int kvt_cmd_model(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { /* info and default too */
            usage(stdout);
            return 0;
        }
    if (!strcmp(argv[1], "synth"))
        return cmd_synth(argc - 1, argv + 1);
    if (!strcmp(argv[1], "info")) {
        if (argc != 3) {
            usage(stderr);
            return 2;
        }
        return cmd_info(argv[2]);
    }
    if (!strcmp(argv[1], "default")) {
        if (argc != 2) { /* was ignored: "model default FILE" printed the paths, exit 0 */
            fprintf(stderr, "kvtier model default: takes no argument, got '%s' (kvtier model --help)\n", argv[2]);
            return 2;
        }
        return cmd_default();
    }
    if (!strcmp(argv[1], "export-gguf"))
        return cmd_export_gguf(argc - 1, argv + 1);
    fprintf(stderr, "kvtier model: unknown subcommand '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
