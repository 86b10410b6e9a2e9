#!/usr/bin/env bash
# The GPU engine (issue 79) on a lent GPU in one call, building nothing there: correctness
# against the CPU engine and the HF fixtures, then picaso beside mamba_ssm 2.3, interleaved
# (scripts/bench_gpu_peers.py). Results land in $OUT: gpu-bench.json (commit it under
# results/gpu/), check/check.json, the test logs and `log`.
#
#   scripts/gpu_bench_prepare.sh                  # here: builds .gpu-bench (no GPU or CUDA needed)
#   OUT=$OUT scripts/gpu_bench.sh                 # there, carrying .gpu-bench
#
# QUICK=1 measures the 130m shapes only (one round), for a call with little time left.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT, the folder whose files come back}
G=${G:-.gpu-bench}
W=${WORK:-/tmp/gpu-bench}
mkdir -p "$W/bin" "$OUT"
exec > >(tee "$OUT/log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# NVRTC and cuBLAS from the nvidia wheels beside torch; the driver from the system.
libs=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/**/lib*.so*", recursive=True)})))')
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
tar xJf "$G/bins.tar.xz" -C "$W/bin"
echo "revision $(cat "$G/revision" 2>/dev/null)"

# The 2.7b shapes' random weights (10.8 GB, about a minute of one core), written while the tests run.
mkdir -p "$W/peer"
if [[ ${QUICK:-0} != 1 && ! -e $W/peer/random-2.7b/model.safetensors ]]; then
  rm -rf "$W/peer/random-2.7b"
  "$W/bin/picaso" random-model --shape 2.7b --out "$W/peer/random-2.7b" > "$OUT/random-2.7b.log" 2>&1 &
  random_pid=$!
fi

echo "== the engines' tests on the GPU (Mamba-2, and the hybrids on their fixtures), against the CPU engine"
# The test binaries find their fixtures where they were built (CARGO_MANIFEST_DIR).
built=$(grep -a -o -m1 '/[[:alnum:]/_.-]*/crates/model' "$W/bin/model-lib" | head -1)
if [[ -n $built && ! -e $built ]]; then mkdir -p "$(dirname "${built%/crates/model}")" && ln -sfn "$PWD" "${built%/crates/model}"; fi
PICASO_TEST_GPU=cuda timeout 300 "$W/bin/model-lib" mamba2::gpu::tests granite_hybrid::gpu::tests --skip every_argument_struct \
  --test-threads 1 2>&1 | tee "$OUT/engine-tests.txt"
echo "== the HF reference tests on the GPU engine, and the bundled model through the CLI"
DEVICE=cuda BIN=$W/bin TESTS=reference BENCH=0 OUT=$OUT/check timeout 300 scripts/gpu_check.sh > /dev/null 2>&1
tail -30 "$OUT/check/log"
echo "== the bundled hybrid through the CLI on the GPU engine, against the CPU engine"
MODEL=models/picaso-hybrid DEVICE=cuda BIN=$W/bin TESTS="" BENCH=0 OUT=$OUT/check-hybrid timeout 300 scripts/gpu_check.sh > /dev/null 2>&1
tail -20 "$OUT/check-hybrid/log"

echo "== the hybrid GPU engine on Granite 4.0 H-Micro-like random weights (2.9 B), against the CPU engine on this machine"
# Random weights made in picaso (no download, no Python); figures into $OUT/hybrid-*.json.
if [[ ${QUICK:-0} != 1 ]]; then
  for dev in cuda cpu; do
    if [[ $dev == cuda ]]; then n=(--prompt-tokens 2048 --decode-tokens 128 --decode-batch 16); else n=(--prompt-tokens 256 --decode-tokens 16 --decode-batch 4 --repeats 1); fi
    timeout 240 "$W/bin/picaso" bench --random granite-micro-like --weights bf16 --device $dev --compose-n 0 "${n[@]}" --json \
      > "$OUT/hybrid-micro-$dev.json" 2> "$OUT/hybrid-micro-$dev.log"; tail -1 "$OUT/hybrid-micro-$dev.json"
  done
fi

[[ -n ${random_pid:-} ]] && wait "$random_pid"
echo "== picaso beside mamba_ssm"
if [[ ${QUICK:-0} == 1 ]]; then set -- --shapes 130m --rounds 1; else set -- --rounds 2; fi
PICASO_REVISION=$(cat "$G/revision" 2>/dev/null) python3 scripts/bench_gpu_peers.py --picaso "$W/bin/picaso" \
  --mamba-ssm "$G/mamba_ssm-2.3.0.tar.gz" --out "$OUT/gpu-bench.json" --work "$W/peer" "$@"
