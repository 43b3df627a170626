/*
 * embed_service.c: the cache service from a scheduler's side: admit,
 * acquire, prefill, publish a prompt-boundary snapshot, decode, publish,
 * release; then a second request reusing the first, and budget refusals.
 * Build: cc embed_service.c $(pkg-config --cflags --libs kvtier)
 */
#include <kvtier/service.h>
#include <stdio.h>
#include <stdlib.h>

#define L 2
#define D 4
#define B 16
#define CHECK(x) do { int rc_ = (x); if (rc_) { fprintf(stderr, "%s: %s (%s)\n", #x, \
    kvt_strerror(rc_), kvt_last_error()); exit(1); } } while (0)

static int new_caches(void *ctx, kvt_cache **caches)
{
    (void)ctx;
    for (int l = 0; l < L; l++) {
        int rc = kvt_kv_create(D, B, &caches[l]);
        if (rc) {
            kvt_caches_dispose(caches, l);
            return rc;
        }
    }
    return 0;
}

static void run(kvt_cache **caches, const int32_t *tokens, int64_t from, int64_t to)
{
    for (int64_t t = from; t < to; t++) {
        float kv[D] = {(float)tokens[t], (float)tokens[t], (float)tokens[t], (float)tokens[t]};
        const void *in[2] = {kv, kv};
        for (int l = 0; l < L; l++)
            CHECK(kvt_cache_append(caches[l], 1, in));
    }
}

/* One request: prompt[0..n_prompt), then n_gen generated tokens. */
static int64_t request(kvt_service *svc, int32_t *tokens, int64_t n_prompt, int64_t n_gen)
{
    kvt_request req = {.prompt = tokens, .n_prompt = n_prompt, .max_tokens = n_gen};
    kvt_admission *adm;
    CHECK(kvt_service_admit(svc, &req, &adm));
    kvt_state st;
    CHECK(kvt_service_acquire(svc, adm, &st));
    int64_t reused = st.reused_tokens;
    run(st.caches, tokens, reused, n_prompt); /* prefill only what is new */
    /* prompt-boundary snapshot: a zero-copy clone, published now; publish
     * frees the array, so it must come from malloc */
    kvt_state snap = {.n_layers = L, .caches = calloc(L, sizeof(kvt_cache *))};
    if (!snap.caches)
        exit(1);
    CHECK(kvt_caches_clone(st.caches, L, snap.caches));
    CHECK(kvt_service_publish(svc, adm, tokens, n_prompt, &snap));
    for (int64_t i = 0; i < n_gen; i++) /* decode: token ids from a fake sampler */
        tokens[n_prompt + i] = 900 + (int32_t)i;
    run(st.caches, tokens, n_prompt, n_prompt + n_gen);
    CHECK(kvt_service_publish(svc, adm, tokens, n_prompt + n_gen, &st)); /* adopts st */
    kvt_service_release(svc, adm, 1);
    return reused;
}

int main(void)
{
    const kvt_service_layer layers[L] = {
        {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * D * sizeof(float), .block_tokens = B},
        {.growth = KVT_GROWTH_PER_TOKEN, .bytes_per_token = 2 * D * sizeof(float), .block_tokens = B},
    };
    kvt_service_config cfg = {.n_layers = L, .layers = layers, .max_positions = 512,
                              .new_caches = new_caches, .prompt_cache_bytes = 1 << 20,
                              .block_tokens = B, .kv_budget_bytes = 16 << 10};
    kvt_service *svc;
    CHECK(kvt_service_create(&cfg, &svc));
    int32_t tokens[512];
    for (int i = 0; i < 512; i++)
        tokens[i] = 100 + i;
    int64_t r1 = request(svc, tokens, 40, 8);
    int64_t r2 = request(svc, tokens, 40, 8); /* the same prompt again */
    printf("request 1 reused %lld tokens, request 2 reused %lld\n", (long long)r1, (long long)r2);

    /* budget refusals: 64 bytes of KV per token; 400 tokens can never fit in
     * 16 KiB, and two requests of 140 do not fit at once */
    kvt_request big = {.prompt = tokens, .n_prompt = 300, .max_tokens = 100};
    kvt_admission *adm = NULL;
    int rc = kvt_service_admit(svc, &big, &adm);
    printf("big request: %s: %s\n", kvt_strerror(rc), kvt_last_error());
    kvt_request half = {.prompt = tokens, .n_prompt = 100, .max_tokens = 40};
    kvt_admission *a1 = NULL, *a2 = NULL;
    CHECK(kvt_service_admit(svc, &half, &a1));
    int rc2 = kvt_service_admit(svc, &half, &a2); /* does not fit beside a1: wait */
    printf("second half-size request: %s\n", kvt_strerror(rc2));
    kvt_service_release(svc, a1, 1);
    CHECK(kvt_service_close(svc));
    kvt_service_destroy(svc);
    return r1 == 0 && r2 == 39 && rc == KVT_ELIMIT && rc2 == KVT_EAGAIN ? 0 : 1;
}
