#!/bin/sh
# make demo: the main job. A scripted multi-turn chat on the built-in default
# model (created on first use; random weights, so its replies mean nothing):
# every turn re-sends the whole conversation, and the prompt cache makes it
# prefill only the new tokens. Then the same chat with the cache off, and,
# when ../shared holds it, the same with stories260K (real text).
set -eu
KVT=${1:-build/kvtier}
here=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT INT TERM
cat >"$dir/script.txt" <<'MSG'
Hello! Can you tell me a short story about a cat?
What was the name of the cat?
Where did the cat live?
What happened at the end?
Thank you, that was lovely.
MSG

echo "== kvtier chat --script (built-in default model, prompt cache on)"
echo "   replies on stdout; one line per turn on stderr"
"$KVT" chat --script "$dir/script.txt" --max-tokens 12 2>&1
echo
echo "== the same conversation with the cache off (--prompt-cache 0): every turn prefills everything"
"$KVT" chat --script "$dir/script.txt" --max-tokens 12 --prompt-cache 0 2>&1 >/dev/null

shared=${KVT_SHARED_DIR:-$here/../shared}
if [ -f "$shared/data/models/stories260K.bin" ] && [ -f "$shared/data/models/tok512.bin" ]; then
    echo
    echo "== stories260K (llama2.c TinyStories model), cache on, then a restart from the SSD tier"
    m="--model $shared/data/models/stories260K.bin --tokenizer $shared/data/models/tok512.bin"
    # shellcheck disable=SC2086
    "$KVT" chat $m --script "$dir/script.txt" --max-tokens 40 --ssd-cache "$dir/ssd" 2>&1
    echo "-- a new process on the same --ssd-cache: the history comes back from disk"
    # shellcheck disable=SC2086
    "$KVT" chat $m --script "$dir/script.txt" --max-tokens 40 --ssd-cache "$dir/ssd" 2>&1 >/dev/null
else
    echo
    echo "== (the stories260K part is skipped: $shared/data/models/stories260K.bin or tok512.bin is missing;"
    echo "   export KVT_SHARED_DIR=DIR to point at the directory that holds data/models)"
fi
