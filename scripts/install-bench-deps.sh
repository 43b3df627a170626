#!/bin/sh
# Installs the llama.cpp baseline of `kvtier bench engine --context-only`:
# node-llama-cpp and its prebuilt CPU binary (@node-llama-cpp/linux-x64) from
# the npm registry, exactly as bench/llamacpp/package-lock.json locks them,
# into bench/llamacpp/node_modules. Nothing else is fetched: no install
# scripts run (node-llama-cpp's postinstall could download and build
# llama.cpp), optional packages (CUDA, Vulkan and other platforms' builds) are
# left out, and the bench never installs anything at run time. Then checks
# that the prebuilt binary loads and prints what it runs on.
# Needs node >= 20 and npm (Debian 12: nodejs npm, or the machine's own).
set -eu
dir=$(cd "$(dirname "$0")/../bench/llamacpp" && pwd)
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "install-bench-deps: node and npm are needed (Debian: apt-get install nodejs npm)" >&2
    exit 1
fi
cd "$dir"
if grep -q '"resolved"' package-lock.json; then
    echo "install-bench-deps: $dir/package-lock.json names registry URLs (\"resolved\"); it must not" >&2
    exit 1
fi
npm ci --omit=optional --ignore-scripts --no-audit --no-fund --loglevel=error
node check.mjs
