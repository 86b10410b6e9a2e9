#!/usr/bin/env bash
# picaso with and without the prefix cache (and llama-server with cache_prompt, given a GGUF of
# the same weights), side by side in one run: scripts/bench_prefix_cache.py's conversations
# (1 and 8 clients, 10 turns of ~200 tokens, 32-token answers) and 16 agents sharing a
# 2,000-token system prompt, each server fresh.
#
#   scripts/bench_prefix_cache.sh MODEL_DIR [MODEL.gguf]
#
# Env: PICASO (binary, default target/release/picaso), LLAMA_SERVER (binary), EMBEDDER,
# TEXT (corpus, default WikiText-2 valid), OUT (JSON lines, appended), CLIENTS (default 1,8),
# MODES (default "1024 0": --prefix-cache-mb values; "" runs llama-server alone), PYTHON.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model=$1 gguf=${2:-}
picaso=${PICASO:-$here/../target/release/picaso}
py=${PYTHON:-python3}
embedder=${EMBEDDER:-$here/../../shared/data/all-MiniLM-L6-v2}
text=${TEXT:-$here/../../shared/data/wikitext-2/wiki.valid.tokens}
template=$here/../crates/cli/tests/fixtures/chat_tokenizer_config.json
out=${OUT:-/tmp/bench-prefix-cache.jsonl}
clients=${CLIENTS:-1,8}
tmp=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$tmp"' EXIT

# The server needs a store; one short document is enough (no request uses contexts).
mkdir -p "$tmp/docs"
echo "The Eiffel Tower is in Paris." > "$tmp/docs/a.txt"
"$picaso" ingest --db "$tmp/db" --model "$model" --embedder "$embedder" --text-dir "$tmp/docs" > /dev/null

wait_listening() { # log file → URL
  for _ in $(seq 600); do
    url=$(grep -o 'http://[0-9.:]*' "$1" | head -1 || true)
    [ -n "$url" ] && { echo "$url"; return; }
    sleep 0.2
  done
  echo "server did not start: $(cat "$1")" >&2; exit 1
}

for mb in ${MODES-1024 0}; do
  "$picaso" serve --db "$tmp/db" --model "$model" --embedder "$embedder" --chat-template "$template" \
    --addr 127.0.0.1:0 --prefix-cache-mb "$mb" > "$tmp/serve.log" 2>&1 &
  pid=$!
  url=$(wait_listening "$tmp/serve.log")
  name=$([ "$mb" = 0 ] && echo "picaso, no prefix cache" || echo "picaso, prefix cache $mb MiB")
  "$py" "$here/bench_prefix_cache.py" --url "$url" --name "$name" --text "$text" --clients "$clients" --json "$out"
  curl -s "$url/metrics" | grep -E '^picaso_(prefix_cache|batch_prefill_tokens_(sum|count))' | sed "s/^/  [$name] /"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
done

if [ -n "$gguf" ]; then
  llama=${LLAMA_SERVER:-/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
  # The same chat template as picaso's, as a Jinja file.
  "$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["chat_template"], end="")' "$template" > "$tmp/t.jinja"
  port=$((20000 + RANDOM % 20000))
  # 8 slots of 4,096 tokens: each client keeps its own slot's cache (cache_prompt).
  "$llama" -m "$gguf" --host 127.0.0.1 --port "$port" -np 8 -c 32768 --jinja --chat-template-file "$tmp/t.jinja" \
    -t "$(nproc)" > "$tmp/llama.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 0.5; done
  "$py" "$here/bench_prefix_cache.py" --url "http://127.0.0.1:$port" --name "llama-server, cache_prompt" \
    --text "$text" --clients "$clients" --cache-prompt --json "$out"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
fi
