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

# kvtier serve: the same job behind an OpenAI-compatible endpoint. A 3-turn
# chat with curl: each request re-sends the whole conversation (the reply is
# spliced back as the JSON string the server sent), and usage reports
# prompt_tokens_details.cached_tokens, the prefix the cache served.
echo
if [ -f "$shared/data/models/stories260K.bin" ] && [ -f "$shared/data/models/tok512.bin" ]; then
    serve_model="--model $shared/data/models/stories260K.bin --tokenizer $shared/data/models/tok512.bin"
    echo "== kvtier serve (stories260K) on a free loopback port, a 3-turn chat with curl"
else
    serve_model=""
    echo "== kvtier serve (built-in default model) on a free loopback port, a 3-turn chat with curl"
fi
if ! command -v curl >/dev/null 2>&1; then
    echo "   (skipped: curl is not installed)"
    exit 0
fi
# shellcheck disable=SC2086
"$KVT" serve $serve_model --port 0 2>"$dir/serve.log" &
serve_pid=$!
# the server has exited and been reaped by the time the script ends, so kill
# fails there; with set -e a failing command in the EXIT trap is the exit status
trap 'kill "$serve_pid" 2>/dev/null || true; rm -rf "$dir"' EXIT INT TERM
port=
for _ in $(seq 600); do
    if grep -q 'ready, model' "$dir/serve.log" 2>/dev/null; then
        port=$(sed -n 's|.*listening on http://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$dir/serve.log")
        break
    fi
    kill -0 "$serve_pid" 2>/dev/null || break
    sleep 0.1
done
if [ -z "$port" ]; then
    cat "$dir/serve.log"
    echo "kvtier serve did not start" >&2
    exit 1
fi
echo "   $(head -1 "$dir/serve.log" | sed 's/^kvtier serve: //')"
history=
n=0
for q in "Hello! Can you tell me a short story about a cat?" "What was the name of the cat?" "Where did the cat live?"; do
    n=$((n + 1))
    history="$history${history:+,}{\"role\":\"user\",\"content\":\"$q\"}"
    out=$(curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "{\"messages\":[$history],\"temperature\":0,\"max_tokens\":40}")
    reply=$(printf '%s' "$out" | sed -n 's/.*"message":{"role":"assistant","content":\("\([^"\\]\|\\.\)*"\)}.*/\1/p')
    cached=$(printf '%s' "$out" | sed -n 's/.*"cached_tokens":\([0-9]*\).*/\1/p')
    prompt=$(printf '%s' "$out" | sed -n 's/.*"prompt_tokens":\([0-9]*\).*/\1/p')
    ttft=$(printf '%s' "$out" | sed -n 's/.*"ttft_ms":\([0-9.]*\).*/\1/p')
    echo "   turn $n: $reply"
    echo "   turn $n: prompt_tokens $prompt, cached_tokens $cached, ttft $ttft ms"
    history="$history,{\"role\":\"assistant\",\"content\":$reply}"
done
echo "   GET /metrics (excerpt):"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^kvtier_(prefix_cache_(queries|hits)_total|cached_tokens_total)' | sed 's/^/     /'
kill -TERM "$serve_pid"
wait "$serve_pid"
echo "   $(tail -1 "$dir/serve.log" | sed 's/^kvtier serve: //')"
