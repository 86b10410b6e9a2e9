#!/usr/bin/env bash
# Serving side by side: `picaso serve` (continuous batching) and llama.cpp's `llama-server`
# (`-np N --cont-batching`) on the same weights, interleaved per level and round, so drift on a
# shared machine hits both alike. Each level N: N streaming clients, each sending
# REQUESTS completions of 64 greedy tokens from 32-token prompts (scripts/bench_serving.py).
#
#   scripts/bench_serving.sh MODEL_DIR MODEL.gguf [ROUNDS] [LEVELS]     # e.g. 2 "1 4 16 32"
#
# MODEL_DIR: an HF-format Mamba-2 folder (`picaso random-model --shape 130m` makes one);
# MODEL.gguf: the same weights converted by llama.cpp's convert_hf_to_gguf.py (BENCHMARKS.md).
# WEIGHTS: picaso's storage of the weights, f32 (default) or bf16 (then give llama-server a bf16
# GGUF of the same weights).
# DECODE_STATES: picaso's `--decode-state` values to run, each as its own engine (default "f32";
# "f32 f16" runs both: `picaso` and `picaso-f16`).
# LLAMA_SERVER: the llama-server binary (default /work/peers/llama.cpp/build/bin/llama-server).
# Appends one JSON line per engine, level and round to OUT (default results-serving.jsonl), then
# prints the medians. Both servers get 2 threads; clients run on the same machine.
set -euo pipefail
model=$1 gguf=$2 rounds=${3:-2} levels=${4:-"1 4 16 32"}
out=${OUT:-results-serving.jsonl}
llama=${LLAMA_SERVER:-/work/peers/llama.cpp/build/bin/llama-server}
bin=${PICASO_BIN:-target/release/picaso}
requests=${REQUESTS:-2}
weights=${WEIGHTS:-f32}
decode_states=${DECODE_STATES:-f32}
cd "$(dirname "$0")/.."
db=$(mktemp -d)
trap 'rm -rf "$db"; kill $(jobs -p) 2>/dev/null || true' EXIT
# A store with one context, so the server starts (completions here use no retrieval).
printf '{"id": "d", "text": "A context."}\n' > "$db/docs.jsonl"
"$bin" ingest --db "$db/store" --model "$model" --jsonl "$db/docs.jsonl" --json > /dev/null

wait_ready() {
  for _ in $(seq 180); do curl -sf "$1/health" > /dev/null && return 0; sleep 1; done
  echo "server at $1 did not start" >&2; exit 1
}
bench() { # name url clients
  python3 scripts/bench_serving.py --url "$2" --clients "$3" --requests-per-client "$requests" \
    --max-tokens 64 --prompt-tokens 32 --name "$1" --json "$out"
}
for round in $(seq "$rounds"); do
  for n in $levels; do
    for ds in $decode_states; do
      name=picaso; [ "$ds" = f32 ] || name=picaso-$ds
      RAYON_NUM_THREADS=2 "$bin" serve --db "$db/store" --model "$model" --addr 127.0.0.1:8091 \
        --max-batch 32 --weights "$weights" --decode-state "$ds" > "$db/picaso.log" 2>&1 &
      pid=$!; wait_ready http://127.0.0.1:8091; bench "$name" http://127.0.0.1:8091 "$n"
      kill "$pid"; wait "$pid" || true
    done
    "$llama" -m "$gguf" -t 2 -np "$n" --cont-batching -c $((n * 256)) --port 8092 > "$db/llama.log" 2>&1 &
    pid=$!; wait_ready http://127.0.0.1:8092; bench llama.cpp http://127.0.0.1:8092 "$n"
    kill "$pid"; wait "$pid" || true
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = lambda xs: statistics.median(xs)
print("| clients | engine | tokens/s | llama.cpp tokens/s | ratio | ITL p50/p99 ms | llama.cpp ITL p50/p99 ms |")
print("|---:|---|---:|---:|---:|---:|---:|")
for n in sorted({r["clients"] for r in rows}):
    get = lambda e, k: med([r[k] for r in rows if r["engine"] == e and r["clients"] == n])
    l = get("llama.cpp", "tokens_per_s")
    for e in sorted({r["engine"] for r in rows if r["engine"] != "llama.cpp" and r["clients"] == n}):
        p = get(e, "tokens_per_s")
        print(f"| {n} | {e} | {p:.1f} | {l:.1f} | {p / l:.2f}× | {get(e, 'itl_p50_ms'):.1f} / {get(e, 'itl_p99_ms'):.1f}"
              f" | {get('llama.cpp', 'itl_p50_ms'):.1f} / {get('llama.cpp', 'itl_p99_ms'):.1f} |")
PY
