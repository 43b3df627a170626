/*
 * tok_ref.c: llama2.c run.c encode(), written out plainly (see tok_ref.h).
 */
#include "tok_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *str;
    int id;
} ref_index;

static int ref_cmp(const void *a, const void *b)
{
    return strcmp(((const ref_index *)a)->str, ((const ref_index *)b)->str);
}

static int ref_lookup(const char *s, const ref_index *sorted, int n)
{
    ref_index key = {s, 0};
    const ref_index *r = bsearch(&key, sorted, (size_t)n, sizeof *sorted, ref_cmp);
    return r ? r->id : -1;
}

int tok_ref_encode(const kvt_tokenizer *t, const char *text, int bos, int eos, int32_t *tokens)
{
    int V = kvt_tokenizer_vocab_size(t);
    ref_index *sorted = malloc((size_t)V * sizeof *sorted);
    size_t maxlen = 0;
    for (int i = 0; i < V; i++) {
        sorted[i].str = kvt_tokenizer_piece(t, i);
        sorted[i].id = i;
        if (strlen(sorted[i].str) > maxlen)
            maxlen = strlen(sorted[i].str);
    }
    qsort(sorted, (size_t)V, sizeof *sorted, ref_cmp);
    char *buf = malloc(maxlen * 2 + 3);
    size_t len = 0;
    int n = 0;
    if (bos)
        tokens[n++] = 1;
    if (text[0])
        tokens[n++] = ref_lookup(" ", sorted, V);
    for (const char *c = text; *c; c++) {
        if ((*c & 0xC0) != 0x80)
            len = 0;
        buf[len++] = *c;
        buf[len] = '\0';
        if ((*(c + 1) & 0xC0) == 0x80 && len < 4)
            continue;
        int id = ref_lookup(buf, sorted, V);
        if (id != -1)
            tokens[n++] = id;
        else
            for (size_t i = 0; i < len; i++)
                tokens[n++] = (unsigned char)buf[i] + 3;
        len = 0;
    }
    for (;;) {
        float best = -1e10f;
        int best_id = -1, best_idx = -1;
        for (int i = 0; i < n - 1; i++) {
            sprintf(buf, "%s%s", kvt_tokenizer_piece(t, tokens[i]), kvt_tokenizer_piece(t, tokens[i + 1]));
            int id = ref_lookup(buf, sorted, V);
            if (id != -1 && kvt_tokenizer_score(t, id) > best) {
                best = kvt_tokenizer_score(t, id);
                best_id = id;
                best_idx = i;
            }
        }
        if (best_idx == -1)
            break;
        tokens[best_idx] = best_id;
        for (int i = best_idx + 1; i < n - 1; i++)
            tokens[i] = tokens[i + 1];
        n--;
    }
    if (eos)
        tokens[n++] = 2;
    free(buf);
    free(sorted);
    return n;
}

