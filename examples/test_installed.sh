#!/bin/sh
# Installs a kvtier build into a temporary prefix and checks it as an
# embedder sees it: pkg-config only, no source tree.
#   test_installed.sh headers  BUILD_DIR SOURCE_DIR
#       every installed header (kvtier/*.h, kvtier/experimental/*.h) compiles
#       alone as C11 and as C++ (an experimental one only with KVT_EXPERIMENTAL,
#       and without it it refuses, saying so), and names no file an installed
#       user does not have; kvtier/kvtier.h includes every one of them and its
#       KVT_VERSION macros say the version pkg-config gives
#   test_installed.sh examples BUILD_DIR SOURCE_DIR
#       each examples/*.c builds with `cc $(pkg-config --cflags --libs
#       kvtier)` and runs without LD_LIBRARY_PATH (kvtier.pc carries the
#       rpath), then again built with ASan+UBSan, then under valgrind; and
#       the C example in README.md's "Embedding kvtier" section builds and runs
set -eu
mode=$1 build=$2 src=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvt-installed.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
pc=$(find "$tmp/prefix" -name kvtier.pc | head -n 1)
[ -n "$pc" ] || { echo "FAIL: kvtier.pc was not installed" >&2; exit 1; }
export PKG_CONFIG_PATH="$(dirname "$pc")"
unset LD_LIBRARY_PATH
CFLAGS=$(pkg-config --cflags kvtier)
LIBS=$(pkg-config --libs kvtier)
CC=${CC:-cc} CXX=${CXX:-c++}
fail=0

if [ "$mode" = headers ]; then
    n=0
    for h in "$tmp"/prefix/include/kvtier/*.h "$tmp"/prefix/include/kvtier/experimental/*.h; do
        [ -f "$h" ] || continue
        name=${h#"$tmp"/prefix/include/}
        n=$((n + 1))
        defs=""
        case $name in
        kvtier/experimental/*)
            # research API: refused without KVT_EXPERIMENTAL, saying why
            if $CC -std=c11 $CFLAGS -fsyntax-only -include "$name" -x c /dev/null 2>"$tmp/err"; then
                echo "FAIL: $name compiles without KVT_EXPERIMENTAL" >&2; fail=1
            elif ! grep -q KVT_EXPERIMENTAL "$tmp/err"; then
                echo "FAIL: $name refused without KVT_EXPERIMENTAL but does not say so: $(cat "$tmp/err")" >&2; fail=1
            fi
            defs=-DKVT_EXPERIMENTAL ;;
        esac
        $CC -std=c11 -Wall -Wextra -Wpedantic -Werror $CFLAGS $defs -fsyntax-only -include "$name" -x c /dev/null ||
            { echo "FAIL: $name does not compile alone as C11" >&2; fail=1; }
        $CXX -std=c++11 -Wall -Wextra -Werror $CFLAGS $defs -fsyntax-only -include "$name" -x c++ /dev/null ||
            { echo "FAIL: $name does not compile alone as C++" >&2; fail=1; }
        if grep -nE 'DESIGN\.md|[Ii]ssue [0-9]|the seeds|seeds/|src/|tests/|\.\./shared' "$h" >&2; then
            echo "FAIL: $name names a file or plan an installed user does not have (above)" >&2
            fail=1
        fi
    done
    [ "$n" -gt 0 ] || { echo "FAIL: no header installed" >&2; exit 1; }
    # the umbrella includes every stable header (and the experimental ones under KVT_EXPERIMENTAL)
    for h in "$tmp"/prefix/include/kvtier/*.h "$tmp"/prefix/include/kvtier/experimental/*.h; do
        name=${h#"$tmp"/prefix/include/}
        [ "$name" = kvtier/kvtier.h ] && continue
        grep -q "^#include \"$name\"" "$tmp/prefix/include/kvtier/kvtier.h" ||
            { echo "FAIL: kvtier/kvtier.h does not include $name" >&2; fail=1; }
    done
    # the umbrella's version macros say the installed library's version
    v=$(pkg-config --modversion kvtier)
    major=${v%%.*} rest=${v#*.}
    minor=${rest%%.*} patch=${rest#*.}
    printf '#include <kvtier/kvtier.h>\n_Static_assert(KVT_VERSION_MAJOR == %s && KVT_VERSION_MINOR == %s && KVT_VERSION_PATCH == %s, "version");\n_Static_assert(KVT_VERSION == %s, "number");\nstatic const char v[] = KVT_VERSION_STRING;\n_Static_assert(sizeof v == sizeof "%s", "string");\n' \
        "$major" "$minor" "$patch" $((major * 10000 + minor * 100 + patch)) "$v" >"$tmp/version.c"
    $CC -std=c11 -Wall -Werror $CFLAGS -fsyntax-only "$tmp/version.c" ||
        { echo "FAIL: the KVT_VERSION macros of kvtier/kvtier.h do not say $v (pkg-config)" >&2; fail=1; }
    [ "$fail" = 0 ] && echo "ok: $n installed headers compile alone as C11 and C++ and stand alone (experimental ones only with KVT_EXPERIMENTAL); KVT_VERSION says $v"
    exit $fail
fi

[ "$mode" = examples ] || { echo "usage: $0 headers|examples BUILD_DIR SOURCE_DIR" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "FAIL: valgrind is not installed (scripts/install-deps.sh)" >&2; exit 1; }
for ex in "$src"/examples/*.c; do
    name=$(basename "$ex" .c)
    args=""
    [ "$name" = embed_ssd ] && args="$tmp/ssd-$name"
    # plain: the compile line of the README
    $CC -std=c11 -Wall -Wextra -Wpedantic -Werror -o "$tmp/$name" "$ex" $CFLAGS $LIBS
    rm -rf "$tmp/ssd-$name"
    "$tmp/$name" $args || { echo "FAIL: $name exited $?" >&2; fail=1; continue; }
    # embed_ssd says "run again to resume from it": a second run on the same DIR
    if [ "$name" = embed_ssd ]; then
        "$tmp/$name" $args || { echo "FAIL: $name run again on its DIR exited $?" >&2; fail=1; continue; }
    fi
    # ASan + UBSan (leaks included)
    $CC -std=c11 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
        -o "$tmp/$name-asan" "$ex" $CFLAGS $LIBS
    rm -rf "$tmp/ssd-$name"
    ASAN_OPTIONS=detect_leaks=1 "$tmp/$name-asan" $args >/dev/null ||
        { echo "FAIL: $name under ASan+UBSan" >&2; fail=1; continue; }
    # valgrind: memory errors and leaks both fail
    rm -rf "$tmp/ssd-$name"
    valgrind -q --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,indirect,possible \
        "$tmp/$name" $args >/dev/null || { echo "FAIL: $name under valgrind" >&2; fail=1; continue; }
    echo "ok: $name (installed library, pkg-config, ASan+UBSan, valgrind)"
done
# the example printed in the README's "Embedding kvtier" section builds and runs as shown
awk '/^## Embedding kvtier/ { s = 1 } s && /^```c$/ { c = 1; next } c && /^```$/ { exit } c { print }' \
    "$src/README.md" >"$tmp/readme_example.c"
if [ ! -s "$tmp/readme_example.c" ]; then
    echo "FAIL: README.md has no C example in its Embedding kvtier section" >&2
    fail=1
elif $CC -std=c11 -Wall -Wextra -Wpedantic -Werror -o "$tmp/readme_example" "$tmp/readme_example.c" $CFLAGS $LIBS &&
    "$tmp/readme_example" >/dev/null; then
    echo "ok: the README's example ($(wc -l <"$tmp/readme_example.c") lines) builds and runs"
else
    echo "FAIL: the README's example does not build or run" >&2
    fail=1
fi
exit $fail
