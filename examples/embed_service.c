/*
 * embed_service.c: the cache service from a scheduler's side: admit,
 * acquire, prefill, publish a prompt-boundary snapshot, decode, publish,
 * release; a second request reusing the first; budget refusals.
 * Build: cc embed_service.c $(pkg-config --cflags --libs kvtier)
 */
#include <kvtier/service.h>
#include <stdio.h>
#include <stdlib.h>

#define L 2
#define D 4
#define CHECK(x) do { int rc_ = (x); if (rc_) { fprintf(stderr, "%s: %s (%s)\n", #x, \
    kvt_strerror(rc_), kvt_last_error()); exit(1); } } while (0)

/* The model, described once: the service reads each layer's growth off it. */
static int new_caches(void *ctx, kvt_cache **caches)
{
    (void)ctx;
    int rc = 0;
    for (int l = 0; l < L && !rc; l++)
        rc = kvt_kv_create(D, 16, &caches[l]);
    return rc;
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

/* One request: prompt tokens[0..n_prompt), then n_gen generated tokens. */
static int64_t request(kvt_service *svc, int32_t *tokens, int64_t n_prompt, int64_t n_gen)
{
    kvt_request req = {.prompt = tokens, .n_prompt = n_prompt, .max_tokens = n_gen};
    kvt_admission *adm;
    CHECK(kvt_service_admit(svc, &req, &adm)); /* reserves its projected KV bytes */
    kvt_state st, snap;
    CHECK(kvt_service_acquire(svc, adm, &st)); /* longest reusable prefix, else fresh */
    int64_t reused = st.reused_tokens;
    run(st.caches, tokens, reused, n_prompt);  /* prefill only what is new */
    CHECK(kvt_state_clone(&st, &snap));        /* prompt-boundary snapshot: zero-copy */
    CHECK(kvt_service_publish(svc, adm, tokens, n_prompt, &snap));
    for (int64_t i = 0; i < n_gen; i++)        /* decode (a fake sampler) */
        tokens[n_prompt + i] = 900 + (int32_t)i;
    run(st.caches, tokens, n_prompt, n_prompt + n_gen);
    CHECK(kvt_service_publish(svc, adm, tokens, n_prompt + n_gen, &st));
    kvt_state_dispose(&st); /* no-ops here: publish took both; needed when it refuses */
    kvt_state_dispose(&snap);
    kvt_service_release(svc, adm, 1); /* 1: the generation completed */
    return reused;
}

int main(void)
{
    kvt_service_config cfg = {.n_layers = L, .new_caches = new_caches, .max_positions = 512,
                              .prompt_cache_bytes = 1 << 20, .kv_budget_bytes = 16 << 10};
    kvt_service *svc;
    CHECK(kvt_service_create(&cfg, &svc));
    int32_t tokens[512];
    for (int i = 0; i < 512; i++)
        tokens[i] = 100 + i;
    int64_t r1 = request(svc, tokens, 40, 8);
    int64_t r2 = request(svc, tokens, 40, 8); /* the same prompt: all but its last token */
    printf("request 1 reused %lld tokens, request 2 reused %lld\n", (long long)r1, (long long)r2);

    /* budget: 64 bytes of KV per token (2 layers x K and V x 4 floats); 400
     * tokens never fit in 16 KiB, and two requests of 140 do not fit at once */
    kvt_request big = {.prompt = tokens, .n_prompt = 300, .max_tokens = 100};
    kvt_admission *a0, *a1, *a2;
    int rc = kvt_service_admit(svc, &big, &a0);
    printf("big request: %s: %s\n", kvt_strerror(rc), kvt_last_error());
    kvt_request half = {.prompt = tokens, .n_prompt = 100, .max_tokens = 40};
    CHECK(kvt_service_admit(svc, &half, &a1));
    int rc2 = kvt_service_admit(svc, &half, &a2); /* retry after a release, or admit_wait */
    printf("second request of 140 tokens: %s\n", kvt_strerror(rc2));
    kvt_service_release(svc, a1, 0);
    CHECK(kvt_service_close(svc)); /* hands what it holds to the cold tier, if any */
    kvt_service_destroy(svc);
    return r1 == 0 && r2 == 39 && rc == KVT_ELIMIT && rc2 == KVT_EAGAIN ? 0 : 1;
}
