/*
 * tokenizer.c: loads llama2.c tokenizer.bin vocabularies and encodes/decodes
 * text with byte-exact llama2.c run.c semantics; writes the default model's
 * byte-level vocabulary. It owns the parsed vocabulary (pieces, scores, the
 * sorted lookup index) and nothing else. It must never read outside the file
 * buffer it loaded, never trust a length from the file before checking it
 * against the bytes left, and never print: callers decide where text goes.
 */
#include "tokenizer.h"

#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define KVT__TOK_MAX_FILE ((int64_t)1 << 30)

struct kvt_tokenizer {
    int32_t vocab_size;       /* pieces, ids 0..vocab_size-1 */
    int32_t max_token_length; /* header value, bytes */
    size_t max_piece_len;     /* longest strlen(piece), bytes */
    char **vocab;             /* (vocab_size,) NUL-terminated pieces into pool */
    float *scores;            /* (vocab_size,) merge scores */
    int32_t *sorted;          /* (vocab_size,) ids sorted by strcmp(piece), then id */
    char *pool;               /* all pieces, each followed by a NUL */
    char byte_pieces[512];    /* byte b as the 1-char string at [2b] */
};

/* ---- loading ------------------------------------------------------------ */

static int read_file(const char *path, unsigned char **data, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvt__fail(-errno, "%s: cannot open tokenizer: %s", path, strerror(errno));
    int rc = 0;
    unsigned char *buf = NULL;
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        rc = kvt__fail(-errno, "%s: cannot stat tokenizer: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = kvt__fail(KVT_EFORMAT, "%s: tokenizer is not a regular file", path);
        goto fail;
    }
    if ((int64_t)st.st_size > KVT__TOK_MAX_FILE) {
        rc = kvt__fail(KVT_ETOOBIG, "%s: tokenizer file is %lld bytes, over the 1 GiB limit", path,
                       (long long)st.st_size);
        goto fail;
    }
    size_t n = (size_t)st.st_size;
    buf = kvt__malloc(n ? n : 1);
    if (!buf) {
        rc = kvt__fail(KVT_ENOMEM, "%s: no memory for %zu tokenizer bytes", path, n);
        goto fail;
    }
    if (n && fread(buf, 1, n, f) != n) {
        rc = kvt__fail(ferror(f) ? -EIO : KVT_EFORMAT, "%s: could not read %zu tokenizer bytes", path, n);
        goto fail;
    }
    fclose(f);
    *data = buf;
    *size = n;
    return 0;
fail:
    kvt__free(buf);
    fclose(f);
    return rc;
}

static int32_t rd_i32(const unsigned char *p)
{
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    int32_t s;
    memcpy(&s, &v, sizeof s);
    return s;
}

static float rd_f32(const unsigned char *p)
{
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &v, sizeof f);
    return f;
}

/* Stable merge sort of ids by strcmp(piece): equal pieces keep id order, the
 * order glibc's merge-sort qsort gives llama2.c's sorted_vocab. */
static void sort_ids(const kvt_tokenizer *t, int32_t *ids, int32_t *tmp, int32_t n)
{
    if (n < 2)
        return;
    int32_t h = n / 2;
    sort_ids(t, ids, tmp, h);
    sort_ids(t, ids + h, tmp, n - h);
    int32_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        if (strcmp(t->vocab[ids[j]], t->vocab[ids[i]]) < 0)
            tmp[k++] = ids[j++];
        else
            tmp[k++] = ids[i++];
    }
    while (i < h)
        tmp[k++] = ids[i++];
    while (j < n)
        tmp[k++] = ids[j++];
    memcpy(ids, tmp, (size_t)n * sizeof *ids);
}

int kvt_tokenizer_load(const char *path, int32_t vocab_size, kvt_tokenizer **out)
{
    if (!path || !out)
        return kvt__fail(KVT_EINVAL, "kvt_tokenizer_load: NULL %s", path ? "out" : "path");
    if (vocab_size < 0)
        return kvt__fail(KVT_EINVAL, "%s: vocab_size %d is negative", path, (int)vocab_size);
    unsigned char *data = NULL;
    size_t size = 0;
    kvt_tokenizer *t = NULL;
    int32_t *tmp = NULL;
    int rc = read_file(path, &data, &size);
    if (rc)
        return rc;
    if (size < 4) {
        rc = kvt__fail(KVT_EFORMAT, "%s: not a llama2.c tokenizer file: %zu bytes, shorter than its 4-byte header", path,
                       size);
        goto fail;
    }
    int32_t max_len = rd_i32(data);
    /* First pass: count complete records and validate every length. */
    size_t off = 4, pool_bytes = 0, longest = 0;
    int64_t count = 0;
    while (off < size) {
        if (size - off < 8) {
            rc = kvt__fail(KVT_EFORMAT,
                           "%s: not a llama2.c tokenizer file (or a truncated one): truncated record for piece "
                           "%lld at byte %zu: %zu bytes left, need 8 for score and length",
                           path, (long long)count, off, size - off);
            goto fail;
        }
        int32_t len = rd_i32(data + off + 4);
        if (len < 0) {
            rc = kvt__fail(KVT_EFORMAT, "%s: not a llama2.c tokenizer file: piece %lld has negative length %d (byte %zu)", path,
                           (long long)count, (int)len, off + 4);
            goto fail;
        }
        off += 8;
        if ((size_t)len > size - off) {
            rc = kvt__fail(KVT_EFORMAT, "%s: not a llama2.c tokenizer file: piece %lld claims %d bytes but only %zu remain "
                           "(file is %zu bytes)",
                           path, (long long)count, (int)len, size - off, size);
            goto fail;
        }
        size_t slen = strnlen((const char *)data + off, (size_t)len);
        if (slen > longest)
            longest = slen;
        if (len > max_len) {
            rc = kvt__fail(KVT_EFORMAT, "%s: not a llama2.c tokenizer file: piece %lld is %d bytes but the header's "
                           "max_token_length is %d",
                           path, (long long)count, (int)len, (int)max_len);
            goto fail;
        }
        pool_bytes += (size_t)len + 1;
        off += (size_t)len;
        count++;
    }
    if (count == 0) {
        rc = kvt__fail(KVT_EFORMAT, "%s: not a llama2.c tokenizer file: it holds no pieces (file is %zu bytes)", path, size);
        goto fail;
    }
    if (vocab_size > 0 && count != vocab_size) {
        rc = kvt__fail(KVT_EFORMAT, "%s: tokenizer holds %lld pieces but the model's vocab_size is %d (the tokenizer of "
                       "another model?)", path,
                       (long long)count, (int)vocab_size);
        goto fail;
    }
    if (count > INT32_MAX) {
        rc = kvt__fail(KVT_EFORMAT, "%s: tokenizer holds %lld pieces, too many", path, (long long)count);
        goto fail;
    }
    t = kvt__calloc(1, sizeof *t);
    if (!t)
        goto oom;
    t->vocab_size = (int32_t)count;
    t->max_token_length = max_len;
    t->max_piece_len = longest;
    t->vocab = kvt__calloc((size_t)count, sizeof *t->vocab);
    t->scores = kvt__calloc((size_t)count, sizeof *t->scores);
    t->sorted = kvt__calloc((size_t)count, sizeof *t->sorted);
    t->pool = kvt__malloc(pool_bytes);
    tmp = kvt__calloc((size_t)count, sizeof *tmp);
    if (!t->vocab || !t->scores || !t->sorted || !t->pool || !tmp)
        goto oom;
    for (int i = 0; i < 256; i++) {
        t->byte_pieces[2 * i] = (char)(unsigned char)i;
        t->byte_pieces[2 * i + 1] = '\0';
    }
    off = 4;
    size_t p = 0;
    for (int32_t i = 0; i < t->vocab_size; i++) {
        t->scores[i] = rd_f32(data + off);
        int32_t len = rd_i32(data + off + 4);
        off += 8;
        memcpy(t->pool + p, data + off, (size_t)len);
        t->pool[p + (size_t)len] = '\0';
        t->vocab[i] = t->pool + p;
        p += (size_t)len + 1;
        off += (size_t)len;
        t->sorted[i] = i;
    }
    sort_ids(t, t->sorted, tmp, t->vocab_size);
    kvt__free(tmp);
    kvt__free(data);
    *out = t;
    return 0;
oom:
    rc = kvt__fail(KVT_ENOMEM, "%s: no memory for a %lld-piece vocabulary", path, (long long)count);
fail:
    kvt__free(tmp);
    kvt_tokenizer_free(t);
    kvt__free(data);
    return rc;
}

void kvt_tokenizer_free(kvt_tokenizer *t)
{
    if (!t)
        return;
    kvt__free(t->vocab);
    kvt__free(t->scores);
    kvt__free(t->sorted);
    kvt__free(t->pool);
    kvt__free(t);
}

int32_t kvt_tokenizer_vocab_size(const kvt_tokenizer *t)
{
    return t ? t->vocab_size : 0;
}

const char *kvt_tokenizer_piece(const kvt_tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->vocab_size)
        return NULL;
    return t->vocab[id];
}

float kvt_tokenizer_score(const kvt_tokenizer *t, int32_t id)
{
    if (!t || id < 0 || id >= t->vocab_size)
        return 0.0f;
    return t->scores[id];
}

/* ---- encode ------------------------------------------------------------- */

/* Binary search with the probe order of glibc bsearch (midpoint of [l, u)),
 * so that duplicate pieces resolve to the same id as llama2.c str_lookup. */
static int32_t lookup(const kvt_tokenizer *t, const char *s)
{
    size_t l = 0, u = (size_t)t->vocab_size;
    while (l < u) {
        size_t idx = (l + u) / 2;
        int c = strcmp(s, t->vocab[t->sorted[idx]]);
        if (c < 0)
            u = idx;
        else if (c > 0)
            l = idx + 1;
        else
            return t->sorted[idx];
    }
    return -1;
}

/* Id of the merge of ids a and b, or -1; buf holds 2 * max_piece_len + 1. */
static int32_t pair_id(const kvt_tokenizer *t, int32_t a, int32_t b, char *buf)
{
    size_t la = strlen(t->vocab[a]), lb = strlen(t->vocab[b]);
    memcpy(buf, t->vocab[a], la);
    memcpy(buf + la, t->vocab[b], lb + 1);
    return lookup(t, buf);
}

static int push_byte(const kvt_tokenizer *t, unsigned char byte, int32_t *toks, int64_t *n)
{
    int32_t id = (int32_t)byte + KVT_TOKEN_BYTE0;
    if (id >= t->vocab_size)
        return kvt__fail(KVT_ERANGE, "byte 0x%02X falls back to id %d, outside the %d-piece vocabulary", byte,
                         (int)id, (int)t->vocab_size);
    toks[(*n)++] = id;
    return 0;
}

/* One candidate merge: nodes left and right (adjacent when pushed) make the
 * piece id with score. Stale once either node changed (version mismatch). */
typedef struct {
    float score;
    int32_t id;
    int64_t left, right;
    uint32_t ver_left, ver_right;
} merge_cand;

/* Heap order: higher score first, then the leftmost pair (node indices keep
 * the text order, so the smallest left index is the leftmost pair). */
static int cand_before(const merge_cand *a, const merge_cand *b)
{
    if (a->score != b->score)
        return a->score > b->score;
    return a->left < b->left;
}

static void heap_push(merge_cand *h, int64_t *n, merge_cand c)
{
    int64_t i = (*n)++;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!cand_before(&c, &h[up]))
            break;
        h[i] = h[up];
        i = up;
    }
    h[i] = c;
}

static merge_cand heap_pop(merge_cand *h, int64_t *n)
{
    merge_cand top = h[0], last = h[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && cand_before(&h[c + 1], &h[c]))
            c++;
        if (!cand_before(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0)
        h[i] = last;
    return top;
}

/* Pushes the merge of nodes a and b if it is a piece scoring above -1e10
 * (run.c only takes scores > its initial best_score of -1e10). */
static void push_pair(const kvt_tokenizer *t, const int32_t *toks, const uint32_t *ver, int64_t a, int64_t b,
                      char *buf, merge_cand *h, int64_t *hn)
{
    int32_t id = pair_id(t, toks[a], toks[b], buf);
    if (id < 0 || !(t->scores[id] > -1e10f))
        return;
    merge_cand c = {t->scores[id], id, a, b, ver[a], ver[b]};
    heap_push(h, hn, c);
}

/* llama2.c's merge loop: while some adjacent pair concatenates to a piece,
 * merge the pair with the best score (leftmost on ties). run.c rescans every
 * pair per merge (O(n^2) lookups); this keeps the candidates in a heap over a
 * linked list of nodes, O(n log n), and picks the same pair every time: the
 * valid candidates are exactly the adjacent pairs run.c would score, ordered
 * the same way. Rewrites toks[0..*n) in place. */
static int merge_pairs(const kvt_tokenizer *t, int32_t *toks, int64_t *n_io, char *buf)
{
    int64_t n = *n_io;
    if (n < 2)
        return 0;
    int64_t *next = kvt__malloc((size_t)n * sizeof *next);
    int64_t *prev = kvt__malloc((size_t)n * sizeof *prev);
    uint32_t *ver = kvt__calloc((size_t)n, sizeof *ver);
    merge_cand *heap = kvt__malloc((size_t)(3 * n) * sizeof *heap); /* n-1 initial + 2 per merge */
    if (!next || !prev || !ver || !heap) {
        kvt__free(next);
        kvt__free(prev);
        kvt__free(ver);
        kvt__free(heap);
        return kvt__fail(KVT_ENOMEM, "kvt_tokenizer_encode: no memory to merge %lld tokens", (long long)n);
    }
    int64_t hn = 0;
    for (int64_t i = 0; i < n; i++) {
        next[i] = i + 1 < n ? i + 1 : -1;
        prev[i] = i - 1;
    }
    for (int64_t i = 0; i + 1 < n; i++)
        push_pair(t, toks, ver, i, i + 1, buf, heap, &hn);
    while (hn > 0) {
        merge_cand c = heap_pop(heap, &hn);
        if (ver[c.left] != c.ver_left || ver[c.right] != c.ver_right || next[c.left] != c.right)
            continue; /* a node changed since this pair was scored */
        toks[c.left] = c.id;
        ver[c.left]++;
        ver[c.right]++; /* dead from now on */
        next[c.left] = next[c.right];
        if (next[c.right] >= 0)
            prev[next[c.right]] = c.left;
        next[c.right] = -1;
        if (prev[c.left] >= 0)
            push_pair(t, toks, ver, prev[c.left], c.left, buf, heap, &hn);
        if (next[c.left] >= 0)
            push_pair(t, toks, ver, c.left, next[c.left], buf, heap, &hn);
    }
    int64_t m = 0;
    for (int64_t i = 0; i >= 0; i = next[i])
        toks[m++] = toks[i];
    *n_io = m;
    kvt__free(next);
    kvt__free(prev);
    kvt__free(ver);
    kvt__free(heap);
    return 0;
}

int kvt_tokenizer_encode(const kvt_tokenizer *t, const char *text, int bos, int eos, int32_t *tokens,
                         int64_t cap, int64_t *n_tokens)
{
    if (!t || !text || !tokens || !n_tokens)
        return kvt__fail(KVT_EINVAL, "kvt_tokenizer_encode: NULL argument");
    *n_tokens = 0;
    size_t text_len = strlen(text);
    size_t max_n = text_len + 3;
    int32_t *toks = kvt__malloc(max_n * sizeof *toks);
    char *buf = kvt__malloc(2 * t->max_piece_len + 8);
    int rc = 0;
    if (!toks || !buf) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_tokenizer_encode: no memory for %zu tokens", max_n);
        goto done;
    }
    if ((bos && KVT_TOKEN_BOS >= t->vocab_size) || (eos && KVT_TOKEN_EOS >= t->vocab_size)) {
        rc = kvt__fail(KVT_ERANGE, "kvt_tokenizer_encode: %s id %d is outside the %d-piece vocabulary",
                       bos && KVT_TOKEN_BOS >= t->vocab_size ? "BOS" : "EOS",
                       bos && KVT_TOKEN_BOS >= t->vocab_size ? KVT_TOKEN_BOS : KVT_TOKEN_EOS, (int)t->vocab_size);
        goto done;
    }
    int64_t n = 0;
    if (bos)
        toks[n++] = KVT_TOKEN_BOS;
    if (text[0] != '\0') {
        int32_t sp = lookup(t, " ");
        if (sp >= 0)
            toks[n++] = sp;
        else if ((rc = push_byte(t, ' ', toks, &n)))
            goto done;
    }
    /* Codepoints: a lead byte plus up to 3 continuation bytes (run.c). */
    size_t cp_len = 0;
    for (const char *c = text; *c != '\0'; c++) {
        if (((unsigned char)*c & 0xC0) != 0x80)
            cp_len = 0;
        buf[cp_len++] = *c;
        buf[cp_len] = '\0';
        if (((unsigned char)c[1] & 0xC0) == 0x80 && cp_len < 4)
            continue;
        int32_t id = lookup(t, buf);
        if (id != -1) {
            toks[n++] = id;
        } else {
            for (size_t i = 0; i < cp_len; i++)
                if ((rc = push_byte(t, (unsigned char)buf[i], toks, &n)))
                    goto done;
        }
        cp_len = 0;
    }
    if ((rc = merge_pairs(t, toks, &n, buf)))
        goto done;
    if (eos)
        toks[n++] = KVT_TOKEN_EOS;
    if (n > cap) {
        rc = kvt__fail(KVT_ERANGE, "kvt_tokenizer_encode: text encodes to %lld tokens, capacity is %lld",
                       (long long)n, (long long)cap);
        goto done;
    }
    memcpy(tokens, toks, (size_t)n * sizeof *toks);
    *n_tokens = n;
done:
    kvt__free(toks);
    kvt__free(buf);
    return rc;
}

/* ---- decode ------------------------------------------------------------- */

static int hexval(int ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

static int c_isspace(int ch)
{
    return ch == ' ' || (ch >= '\t' && ch <= '\r');
}

/* sscanf(piece, "<0x%02hhX>", &b) == 1: the literal "<0x", optional
 * whitespace, then a hex number of at most 2 characters (a sign counts
 * toward the width), truncated to a byte. The trailing ">" is not needed. */
static int parse_byte_piece(const char *piece, unsigned char *out)
{
    if (strncmp(piece, "<0x", 3) != 0)
        return 0;
    const char *p = piece + 3;
    while (c_isspace((unsigned char)*p))
        p++;
    int width = 2, neg = 0;
    if (*p == '+' || *p == '-') {
        neg = *p == '-';
        p++;
        width--;
    }
    int digits = 0;
    unsigned v = 0;
    while (width > 0 && hexval((unsigned char)*p) >= 0) {
        v = v * 16 + (unsigned)hexval((unsigned char)*p);
        p++;
        width--;
        digits++;
    }
    if (!digits)
        return 0;
    *out = (unsigned char)(neg ? 0u - v : v);
    return 1;
}

const char *kvt_tokenizer_decode(const kvt_tokenizer *t, int32_t prev, int32_t token)
{
    if (!t || token < 0 || token >= t->vocab_size)
        return NULL;
    const char *piece = t->vocab[token];
    if (prev == KVT_TOKEN_BOS && piece[0] == ' ')
        piece++;
    unsigned char b;
    if (parse_byte_piece(piece, &b))
        piece = t->byte_pieces + 2 * (size_t)b;
    return piece;
}

const char *kvt_tokenizer_printable(const char *piece)
{
    if (!piece || piece[0] == '\0')
        return "";
    if (piece[1] == '\0') {
        unsigned char b = (unsigned char)piece[0];
        int printable = b >= 0x20 && b <= 0x7E;
        if (!(printable || c_isspace(b)))
            return "";
    }
    return piece;
}

/* ---- the default vocabulary -------------------------------------------- */

static int put_piece(FILE *f, const char *s)
{
    unsigned char rec[8];
    int32_t len = (int32_t)strlen(s);
    memset(rec, 0, 4); /* score 0.0f */
    for (int i = 0; i < 4; i++)
        rec[4 + i] = (unsigned char)((uint32_t)len >> (8 * i));
    return fwrite(rec, 1, 8, f) == 8 && fwrite(s, 1, (size_t)len, f) == (size_t)len ? 0 : -1;
}

int kvt_tokenizer_write_default(const char *path, int32_t vocab_size)
{
    if (!path)
        return kvt__fail(KVT_EINVAL, "kvt_tokenizer_write_default: NULL path");
    if (vocab_size != KVT_DEFAULT_VOCAB)
        return kvt__fail(KVT_EINVAL,
                         "%s: the default tokenizer has exactly %d pieces (<unk>, BOS, EOS, 256 bytes); "
                         "vocab_size %d cannot be filled",
                         path, KVT_DEFAULT_VOCAB, (int)vocab_size);
    size_t tlen = strlen(path) + 32;
    char *tmp = kvt__malloc(tlen);
    if (!tmp)
        return kvt__fail(KVT_ENOMEM, "%s: no memory", path);
    snprintf(tmp, tlen, "%s.tmp.%ld", path, (long)getpid());
    int rc = 0;
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        rc = kvt__fail(-errno, "%s: cannot create: %s", tmp, strerror(errno));
        kvt__free(tmp);
        return rc;
    }
    unsigned char hdr[4] = {6, 0, 0, 0}; /* max_token_length: "<0x00>", "\n</s>\n" */
    int bad = fwrite(hdr, 1, 4, f) != 4;
    bad |= put_piece(f, "<unk>");
    bad |= put_piece(f, "\n<s>\n");
    bad |= put_piece(f, "\n</s>\n");
    for (int b = 0; b < 256 && !bad; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        bad |= put_piece(f, s);
    }
    if (bad || fflush(f) != 0 || fsync(fileno(f)) != 0) {
        int e = errno ? errno : EIO;
        fclose(f);
        unlink(tmp);
        rc = kvt__fail(-e, "%s: cannot write: %s", tmp, strerror(e));
        kvt__free(tmp);
        return rc;
    }
    if (fclose(f) != 0) {
        int e = errno;
        unlink(tmp);
        rc = kvt__fail(-e, "%s: cannot close: %s", tmp, strerror(e));
        kvt__free(tmp);
        return rc;
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        rc = kvt__fail(-e, "%s: cannot rename to %s: %s", tmp, path, strerror(e));
        kvt__free(tmp);
        return rc;
    }
    kvt__free(tmp);
    return 0;
}

KVT_API size_t kvt_utf8_len(const unsigned char *p, size_t left)
{
    size_t n;
    if (p[0] < 0x80)
        return 1;
    else if (p[0] >= 0xC2 && p[0] <= 0xDF)
        n = 2;
    else if (p[0] >= 0xE0 && p[0] <= 0xEF)
        n = 3;
    else if (p[0] >= 0xF0 && p[0] <= 0xF4)
        n = 4;
    else
        return 0;
    if (left < n)
        return 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    if ((p[0] == 0xE0 && p[1] < 0xA0) || (p[0] == 0xED && p[1] > 0x9F) || (p[0] == 0xF0 && p[1] < 0x90) ||
        (p[0] == 0xF4 && p[1] > 0x8F))
        return 0; /* overlong, surrogate or past U+10FFFF */
    return n;
}
