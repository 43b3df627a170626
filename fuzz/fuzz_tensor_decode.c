/*
 * fuzz_tensor_decode.c: kvt_cache_decode on untrusted cache states, the
 * step every SSD restore ends with. The first byte picks the kind (kv,
 * rotating, recurrent, qkv; attachment: the blob an entry's attachment
 * tensor becomes); the rest is the state (fz_state_read: params, tensors,
 * token ranges, owners that fit or lie around the data, or none). A state
 * that decodes must give a cache that passes fz_cache_exercise (its range,
 * readers, re-encode, trim, append); a refusal must be KVT_EFORMAT,
 * KVT_EUNSUPPORTED or KVT_ENOMEM with a message.
 */
#include "fuzz_cache_check.h"

#include <string.h>

static void blob(const kvt_cache_state *st)
{
    if (st->n_tensors < 1)
        return;
    const kvt_tensor *t = &st->tensors[0];
    char name[KVT_TENSOR_NAME_MAX + 8];
    memcpy(name, t->name, sizeof t->name);
    name[sizeof t->name] = '\0';
    kvt_attachment *a = NULL, *b = NULL;
    int rc = kvt_attachment_blob(name, t->data, t->bytes, &a);
    if (rc) {
        FZ_CHECK(rc == KVT_EINVAL || rc == KVT_ENOMEM, "blob refused with %d", rc);
        return;
    }
    size_t n = 0;
    const void *p = kvt_attachment_blob_data(a, &n);
    FZ_CHECK(n == t->bytes && (!n || !memcmp(p, t->data, n)), "blob holds other bytes");
    FZ_CHECK(!strcmp(a->name, name), "blob name");
    if (!kvt_attachment_clone(a, &b)) {
        const void *q = kvt_attachment_blob_data(b, &n);
        FZ_CHECK(q == p && n == t->bytes, "a blob clone shares its bytes");
        const void *s = NULL;
        size_t sn = 0;
        FZ_CHECK(b->ops->serialize && !b->ops->serialize(b, &s, &sn) && sn == t->bytes, "serialize");
        kvt_attachment_destroy(b);
    }
    kvt_attachment_destroy(a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size};
    kvt_cache_state st;
    int sel;
    if (fz_state_read(&in, &st, &sel)) {
        fz_state_free(&st);
        return 0;
    }
    if (sel == FZ_KIND_ATTACHMENT) {
        blob(&st);
        fz_state_free(&st);
        return 0;
    }
    kvt_cache *c = NULL;
    int rc = kvt_cache_decode(&st, &c);
    if (rc) {
        FZ_CHECK(!c, "a failed decode returned a cache");
        FZ_CHECK(rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED || rc == KVT_ENOMEM, "decode returned %d (%s)", rc,
                 kvt_last_error());
        FZ_CHECK(kvt_last_error()[0], "refusal %d without a message", rc);
    } else {
        FZ_CHECK(c && !strcmp(kvt_cache_kind(c), st.kind), "decoded kind %s", c ? kvt_cache_kind(c) : "-");
        int64_t lo, off;
        kvt_cache_range(c, &lo, &off);
        FZ_CHECK(off == st.offset, "decoded offset %lld, state says %lld", (long long)off, (long long)st.offset);
        /* the cache must not depend on the state's buffers beyond their references */
        fz_state_free(&st);
        fz_cache_exercise(c, &in);
        kvt_cache_destroy(c);
    }
    fz_state_free(&st);
    return 0;
}
