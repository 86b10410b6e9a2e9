#!/usr/bin/env bash
# Side-by-side speed of picaso, llama.cpp and HF transformers on the same weights, in one run.
#
#   scripts/bench_peers.sh MODEL_DIR F32.gguf BF16.gguf [ROUNDS]
#
# MODEL_DIR: an HF-format Mamba-2 folder (scripts/make_random_mamba2.py --preset 130m makes one);
# the GGUF files are the same weights converted by llama.cpp's convert_hf_to_gguf.py (see
# BENCHMARKS.md for the recipe). Engines run one after another, ROUNDS times interleaved (default
# 3), so drift on a shared machine hits all of them alike. Prints JSON lines, then a summary table
# of medians and of per-round ratios (scripts/bench_summary.py). Needs a release build:
# cargo build --release -p picaso. picaso's bf16 runs on the kernel this CPU runs best (AMX tiles
# where present, else AVX512-BF16 dot products, with batches on FMAs on Intel), as `picaso-dot`
# on `vdpbf16ps` alone (Intel CPUs with AVX512-BF16 only) and, as `picaso-widen`, on the
# widening kernel every CPU has. TRANSFORMERS=0 leaves transformers out (it needs torch; its bf16 is slow on CPUs).
set -euo pipefail
model=$1 f32=$2 bf16=$3 rounds=${4:-3}
here=$(cd "$(dirname "$0")" && pwd)
picaso=${PICASO:-$here/../target/release/picaso}
py=${PYTHON:-python3}
tag() { "$py" -c 'import json,sys; e,d,r=sys.argv[1:]; [print(json.dumps({**json.loads(l),"engine":e,"dtype":d,"round":int(r)})) for l in sys.stdin]' "$@"; }
out=$(mktemp)
for r in $(seq "$rounds"); do
  "$picaso" bench --model "$model" --weights f32 --compose-n 10 --json | tag picaso f32 "$r" | tee -a "$out"
  "$picaso" bench --model "$model" --weights bf16 --compose-n 0 --json | tag picaso bf16 "$r" | tee -a "$out"
  if grep -qw amx_bf16 /proc/cpuinfo || { grep -qw avx512_bf16 /proc/cpuinfo && grep -q GenuineIntel /proc/cpuinfo; }; then
    PICASO_BF16_KERNEL=dot "$picaso" bench --model "$model" --weights bf16 --compose-n 0 --json | tag picaso-dot bf16 "$r" | tee -a "$out"
  fi
  PICASO_BF16_KERNEL=widen "$picaso" bench --model "$model" --weights bf16 --compose-n 0 --json | tag picaso-widen bf16 "$r" | tee -a "$out"
  "$here/bench_llamacpp.sh" "$f32" | tag llama.cpp f32 "$r" | tee -a "$out"
  "$here/bench_llamacpp.sh" "$bf16" | tag llama.cpp bf16 "$r" | tee -a "$out"
  if [ "${TRANSFORMERS:-1}" != 0 ]; then
    "$py" "$here/bench_transformers.py" "$model" --dtype f32 | tag transformers f32 "$r" | tee -a "$out"
    "$py" "$here/bench_transformers.py" "$model" --dtype bf16 | tag transformers bf16 "$r" | tee -a "$out"
  fi
done
grep -m1 '^model name' /proc/cpuinfo || true
grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512f|avx512_bf16|amx_bf16|amx_tile|avx2|fma)$' | tr '\n' ' '; echo
"$py" "$here/bench_summary.py" "$out"
