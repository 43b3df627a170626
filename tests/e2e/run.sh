#!/bin/sh
# run.sh: the ctest entry of the end-to-end tests of kvtier serve (the
# openai npm package: chat.mjs; the dashboard in Chromium: dashboard.mjs).
# Copies package.json, package-lock.json and the scripts into WORKDIR,
# installs the locked packages there with `npm ci` (never into the source
# tree), and runs SCRIPT (default chat.mjs). Exits 77 (ctest: skipped) with a message saying why when
# node/npm, the model or the registry is not available.
set -eu
src=$(cd "$(dirname "$0")" && pwd)
work=${1:?usage: run.sh WORKDIR [SCRIPT]}
script=${2:-chat.mjs}
: "${KVT_BIN:?KVT_BIN must name the kvtier binary}"
shared=${KVT_SHARED_DIR:-$src/../../../shared}
export KVT_MODEL="$shared/data/models/stories260K.bin" KVT_TOKENIZER="$shared/data/models/tok512.bin"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "e2e $script: skipped: node and npm are not installed (Debian: nodejs npm)"
    exit 77
fi
if [ ! -f "$KVT_MODEL" ] || [ ! -f "$KVT_TOKENIZER" ]; then
    echo "e2e $script: skipped: $KVT_MODEL or tok512.bin is missing (set KVT_SHARED_DIR)"
    exit 77
fi
mkdir -p "$work"
cp "$src/package.json" "$src/package-lock.json" "$src/$script" "$work/"
cd "$work"
if [ ! -f node_modules/.package-lock.json ] || ! cmp -s package-lock.json .installed-lock.json; then
    if ! npm ci --no-audit --no-fund --loglevel=error >npm-ci.log 2>&1; then
        cat npm-ci.log
        echo "e2e $script: skipped: npm ci could not install the locked packages (no registry access?)"
        exit 77
    fi
    cp package-lock.json .installed-lock.json
fi
exec node "$script"
