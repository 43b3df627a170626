/*
 * fuzz_script.c: the chat script reader (kvt_chat_script_parse and
 * kvt_chat_script_load, engine/chat.c) on arbitrary text. Every line it
 * returns is non-empty, holds no newline, has no trailing whitespace and
 * does not start with '#'; the file loader refuses a NUL byte and otherwise
 * returns what the parser returns; the line reader (the one stdin uses)
 * consumes the whole input in lines that hold no newline and no trailing
 * whitespace, or refuses the line with the NUL byte. The lines are then
 * rendered with the chat template (kvt_chat_render), which must hold each.
 */
#include "fuzz_util.h"

#include "chat.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = fz_cstr(data, size);
    char **lines = NULL;
    int32_t n = -1;
    int rc = kvt_chat_script_parse(text, &lines, &n);
    FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "parse returned %d", rc);
    if (rc) {
        free(text);
        return 0;
    }
    for (int32_t i = 0; i < n; i++) {
        size_t l = strlen(lines[i]);
        FZ_CHECK(l > 0 && lines[i][0] != '#' && !strchr(lines[i], '\n') && !isspace((unsigned char)lines[i][l - 1]),
                 "line %d is \"%s\"", (int)i, lines[i]);
        FZ_CHECK(strstr(text, lines[i]) != NULL, "line %d is not in the text", (int)i);
    }
    char path[64];
    int fd = fz_memfile(data, size, path);
    if (fd >= 0) {
        char **l2 = NULL;
        int32_t n2 = -1;
        int rc2 = kvt_chat_script_load(path, &l2, &n2);
        if (memchr(data, '\0', size)) {
            FZ_CHECK(rc2 == KVT_EFORMAT, "a script with a NUL byte was accepted (%d)", rc2);
        } else {
            FZ_CHECK(rc2 == 0 && n2 == n, "load gave %d lines (%d), parse %d", n2, rc2, n);
            for (int32_t i = 0; i < n; i++)
                FZ_CHECK(!strcmp(l2[i], lines[i]), "line %d differs between load and parse", (int)i);
        }
        kvt_chat_script_free(l2, rc2 ? 0 : n2);
        close(fd);
    }
    FILE *f = fmemopen((void *)data, size ? size : 1, "rb");
    if (f && size) {
        char *buf = NULL;
        size_t cap = 0, used = 0, len = 0;
        int r;
        int64_t lineno = 1;
        while ((r = kvt_chat_script_read_line(f, "fuzz", lineno, &buf, &cap, &len)) == 1) {
            size_t l = strlen(buf);
            FZ_CHECK(!strchr(buf, '\n') && (l == 0 || !isspace((unsigned char)buf[l - 1])) && len >= l,
                     "line %lld is \"%s\" (%zu bytes consumed)", (long long)lineno, buf, len);
            used += len;
            lineno++;
        }
        if (memchr(data, '\0', size))
            FZ_CHECK(r == KVT_EFORMAT || r == KVT_ELIMIT, "read_line passed a NUL byte (%d)", r);
        else
            FZ_CHECK((r == 0 && used == size) || r == KVT_ELIMIT, "read_line ended with %d after %zu of %zu bytes", r,
                     used, size);
        free(buf);
    }
    if (f)
        fclose(f);
    if (n > 0) {
        char *out = NULL;
        int32_t turns = n > 64 ? 64 : n;
        rc = kvt_chat_render((const char *const *)lines, (const char *const *)lines, turns, &out);
        FZ_CHECK(rc == 0 || rc == KVT_ENOMEM, "render returned %d", rc);
        for (int32_t i = 0; out && i < turns; i++)
            FZ_CHECK(strstr(out, lines[i]) != NULL, "turn %d is missing from the render", (int)i);
        free(out);
    }
    kvt_chat_script_free(lines, n);
    free(text);
    return 0;
}
