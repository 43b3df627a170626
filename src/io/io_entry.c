/*
 * io_entry.c: one coalesced restore, many waiters: each gets a zero-copy
 * clone of the shared result (io_entry.h).
 */
#include "io_entry.h"

#include "internal.h"
#include "kvtier/cache.h"

#include <stdint.h>
#include <string.h>

int kvt__entry_share(const kvt_entry *e, kvt_entry *out)
{
    int rc = kvt_entry_init(out, e->ns, e->tokens, e->n_tokens, e->n_caches, e->n_attachments);
    for (int32_t l = 0; !rc && l < e->n_caches; l++)
        rc = kvt_cache_clone(e->caches[l], &out->caches[l]);
    for (int32_t a = 0; !rc && a < e->n_attachments; a++)
        rc = e->attachments[a] ? kvt_attachment_clone(e->attachments[a], &out->attachments[a]) : 0;
    if (rc)
        kvt_entry_clear(out);
    return rc;
}

int kvt__entry_from_result(int status, kvt_io_disposition d, const void *result, kvt_entry *out)
{
    memset(out, 0, sizeof *out);
    if (!status && (d != KVT_IO_PUBLISH || !result))
        status = KVT_ECANCELED;
    return status ? status : kvt__entry_share(result, out);
}

int kvt__entry_wait(kvt_io_ticket *tk, kvt_entry *out)
{
    (void)kvt_io_run_here(tk);
    kvt_io_disposition d = KVT_IO_DISCARD;
    void *res = NULL;
    int rc = kvt_io_wait(tk, UINT64_MAX, &d, &res);
    rc = kvt__entry_from_result(rc, d, res, out);
    kvt_io_ticket_release(tk);
    return rc;
}
