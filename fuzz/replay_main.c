/*
 * replay_main.c: runs a fuzz target without libFuzzer. Each argument is a
 * file or a directory (every regular file in it, in name order); each file
 * is one input passed to LLVMFuzzerTestOneInput. This is how `make test`
 * checks the committed corpus (and every saved crash input added to it) on
 * any compiler, and how a saved input is reproduced under gdb or ASan:
 *   build/fuzz/fuzz_shard_header_replay crash-1234...
 * A failed invariant aborts (the target's FZ_CHECK); a clean run prints the
 * number of inputs and exits 0.
 */
#include "fuzz_util.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: cannot open\n", path);
        return -1;
    }
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 65536;
            uint8_t *b = realloc(buf, cap);
            if (!b)
                abort();
            buf = b;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        if (!got)
            break;
        n += got;
    }
    fclose(f);
    /* an exact-size copy, so ASan sees a read past the input's end */
    uint8_t *in = malloc(n ? n : 1);
    if (!in)
        abort();
    memcpy(in, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(in, n);
    free(in);
    return 0;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv)
{
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    long inputs = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st)) {
            fprintf(stderr, "%s: no such file or directory\n", argv[i]);
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            if (run_file(argv[i]))
                return 1;
            inputs++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d)
            return 1;
        char **names = NULL;
        size_t n = 0;
        struct dirent *de;
        while ((de = readdir(d))) {
            if (de->d_name[0] == '.')
                continue;
            names = realloc(names, (n + 1) * sizeof *names);
            if (!names || asprintf(&names[n], "%s/%s", argv[i], de->d_name) < 0)
                abort();
            n++;
        }
        closedir(d);
        qsort(names, n, sizeof *names, by_name);
        for (size_t k = 0; k < n; k++) {
            if (!stat(names[k], &st) && S_ISREG(st.st_mode)) {
                if (run_file(names[k]))
                    return 1;
                inputs++;
            }
            free(names[k]);
        }
        free(names);
    }
    printf("%ld inputs replayed, no failure\n", inputs);
    return 0;
}
