#!/usr/bin/env bash
# Side-by-side speed of picaso and HF transformers on the same Mamba-1 weights, in one run.
#
#   scripts/bench_mamba1.sh MODEL_DIR [ROUNDS]
#
# MODEL_DIR: an HF-format Mamba-1 folder (scripts/make_random_mamba1.py --preset 130m makes one).
# Engines run one after another, ROUNDS times interleaved (default 3). Prints JSON lines, then the
# summary of medians (scripts/bench_summary.py), including picaso's composition of 10 states.
# Needs a release build: cargo build --release -p picaso.
set -euo pipefail
model=$1 rounds=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
picaso=${PICASO:-$here/../target/release/picaso}
py=${PYTHON:-python3}
tag() { "$py" -c 'import json,sys; e,d,r=sys.argv[1:]; [print(json.dumps({**json.loads(l),"engine":e,"dtype":d,"round":int(r)})) for l in sys.stdin]' "$@"; }
out=$(mktemp)
for r in $(seq "$rounds"); do
  "$picaso" bench --model "$model" --weights f32 --compose-n 10 --json | tag picaso f32 "$r" | tee -a "$out"
  "$picaso" bench --model "$model" --weights bf16 --compose-n 0 --json | tag picaso bf16 "$r" | tee -a "$out"
  "$py" "$here/bench_transformers.py" "$model" --dtype f32 | tag transformers f32 "$r" | tee -a "$out"
  "$py" "$here/bench_transformers.py" "$model" --dtype bf16 | tag transformers bf16 "$r" | tee -a "$out"
done
"$py" "$here/bench_summary.py" "$out"
