#!/bin/sh
# make demo: runs the main job on the built-in default model.
set -eu
KVT=${1:-build/kvtier}
exec "$KVT" generate --prompt "Once upon a time" --steps 64 --temperature 0
