#!/usr/bin/env bash
# candle's engine on a CUDA GPU (the GPU engine of issue 79 has its own script, gpu_bench.sh), in one call of a lent machine: the HF-reference tests run on the
# GPU, the CLI on the bundled model against the CPU engine (score, state, compose, continue,
# generate, the multi-token Markov property), and `picaso bench` on the GPU.
#
# Built on a machine without a GPU (BENCHMARKS.md, "The candle engine on a GPU"): CUDA 13.0 from
# PyPI (`pip download --no-deps` nvidia-cuda-nvcc, -nvvm, -cuda-crt, -cuda-runtime, -cuda-cccl,
# -cuda-nvrtc ==13.0.*, nvidia-cublas, nvidia-curand; unzip into one folder, CUDA = its
# nvidia/cu13), `lib*.so` links beside the wheels' `.so.N`, and a stub `lib/stubs/libcuda.so`
# (soname libcuda.so.1) defining the driver functions cudarc names, for the link only:
#   CUDA_ROOT=CUDA PATH=CUDA/bin:$PATH CUDA_COMPUTE_CAP=90 cargo build --release -p picaso --features candle-cuda
#   ... cargo test --release -p picaso-model --features candle-cuda --test reference --test mamba1 --no-run
# then picaso and the two test binaries, stripped, into .gpu-bin/bins.tar.xz; there, carrying .gpu-bin:
#   OUT=$OUT scripts/gpu_check.sh
# MODEL picks the model of the CLI checks (default: the bundled Mamba-2).
# TESTS (default "reference mamba1": the test binaries to run) and BENCH (default 1; 0 skips
# `picaso bench`) let gpu_bench.sh reuse the CLI checks for the GPU engine (DEVICE=cuda).
# DEVICE (default candle-cuda) names the engine under test; DEVICE=candle-cpu BIN=target/release runs
# the same checks on the CPU, to try the script without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT, the folder whose files come back}
DEVICE=${DEVICE:-candle-cuda}
BIN=${BIN:-.gpu-bin}
W=${WORK:-/tmp/gpu-check}
mkdir -p "$W" "$OUT"
exec > >(tee "$OUT/log") 2>&1

# The libraries cudarc links (cuBLAS, cuRAND, NVRTC) come from the nvidia wheels beside torch;
# the driver from the system.
if [[ $DEVICE == *cuda* ]]; then
  nvidia-smi -L
  libs=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/**/lib*.so*", recursive=True)})))')
  export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
fi
if [[ -e $BIN/bins.tar.xz ]]; then mkdir -p "$W/bin" && tar xJf "$BIN/bins.tar.xz" -C "$W/bin" && BIN=$W/bin; fi
P=$BIN/picaso
# MODEL (default: the bundled Mamba-2) is the model the CLI checks run, e.g. models/picaso-hybrid.
M=()
[[ -n ${MODEL:-} ]] && M=(--model "$MODEL")
ldd "$P" | grep "not found" && echo "libraries missing (above)"
# The test binaries find their fixtures where they were built (CARGO_MANIFEST_DIR).
built=$(grep -a -o -m1 '/[[:alnum:]/_.-]*/crates/model' "$BIN/reference" | head -1)
if [[ -n $built && ! -e $built ]]; then mkdir -p "$(dirname "${built%/crates/model}")" && ln -sfn "$PWD" "${built%/crates/model}"; fi

echo "== reference tests on $DEVICE"
for t in ${TESTS-reference mamba1}; do
  PICASO_TEST_CANDLE_DEVICE=$DEVICE "$BIN/$t" candle --test-threads 1 2>&1
done

echo "== the CLI on ${MODEL:-the bundled model}: $DEVICE against cpu"
CTX1="The Kestrel Line was a narrow-gauge railway built in 1887 to carry slate from the quarries at Bryn Hafod down to the harbour at Porth Wen. It ran for eleven miles along the valley of the river Alaw and closed in 1931."
CTX2="Porth Wen harbour was enlarged in 1890 to take the slate trade. Ships loaded there sailed to Liverpool and Dublin, and the harbour master kept a record of every cargo until the quarries closed."
CTX3="The quarries at Bryn Hafod employed four hundred men at their peak. The slate was split by hand in sheds beside the workings and sent down the valley by rail."
Q="The railway that carried slate down the valley of the Alaw was called"
for dev in cpu "$DEVICE"; do
  for i in 1 2 3; do
    v=CTX$i
    "$P" state "${M[@]}" --device "$dev" --text "${!v}" --out "$W/ctx$i-$dev.st" --json > /dev/null || exit 1
  done
  "$P" compose --method picaso-r --state-files "$W"/ctx{1,2,3}-"$dev".st --out "$W/comp-$dev.st" > /dev/null || exit 1
  "$P" score "${M[@]}" --device "$dev" --text "$CTX1 $CTX2 $CTX3 $Q" --json > "$W/score-$dev.json" || exit 1
  "$P" score "${M[@]}" --device "$dev" --state "$W/comp-$dev.st" --text "$Q" --json > "$W/cont-$dev.json" || exit 1
  "$P" generate "${M[@]}" --device "$dev" --state "$W/comp-$dev.st" --prompt "$Q" --max-tokens 40 --json > "$W/gen-$dev.json" || exit 1
done
# Markov on the device: a+b scored whole, and b scored from the state after a.
ids=$(python3 -c 'import json,sys; print(",".join(map(str, json.load(open(sys.argv[1]))["token_ids"])))' "$W/score-$DEVICE.json")
IFS=, read -r -a all <<< "$ids"
n=${#all[@]}; h=$((n / 2))
a=$(IFS=,; echo "${all[*]:0:h}"); b=$(IFS=,; echo "${all[*]:h}")
"$P" state "${M[@]}" --device "$DEVICE" --token-ids "$a" --out "$W/a-$DEVICE.st" > /dev/null || exit 1
"$P" score "${M[@]}" --device "$DEVICE" --state "$W/a-$DEVICE.st" --token-ids "$b" --json > "$W/markov-$DEVICE.json" || exit 1
python3 - "$W" "$DEVICE" "$h" "$OUT/check.json" <<'PY'
import json, sys
import numpy as np
from safetensors.numpy import load_file
w, dev, h, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
j = lambda name: json.load(open(f"{w}/{name}"))
def lp_diff(a, b):
    return float(np.max(np.abs(np.array(a["logprobs"]) - np.array(b["logprobs"]))))
def state_diff(a, b):
    x, y = load_file(a), load_file(b)
    return max(float(np.max(np.abs(x[k].astype(np.float64) - y[k])) / max(1e-30, float(np.max(np.abs(x[k]))))) for k in x)
r = {
    "device": dev,
    "tokens_scored": len(j(f"score-{dev}.json")["logprobs"]),
    "score_max_abs_logprob_diff": lp_diff(j("score-cpu.json"), j(f"score-{dev}.json")),
    "mean_nll": {"cpu": j("score-cpu.json")["mean_nll"], dev: j(f"score-{dev}.json")["mean_nll"]},
    "context_state_max_rel_diff": max(state_diff(f"{w}/ctx{i}-cpu.st", f"{w}/ctx{i}-{dev}.st") for i in (1, 2, 3)),
    "composed_state_max_rel_diff": state_diff(f"{w}/comp-cpu.st", f"{w}/comp-{dev}.st"),
    "continuation_max_abs_logprob_diff": lp_diff(j("cont-cpu.json"), j(f"cont-{dev}.json")),
    "generated": {"cpu": j("gen-cpu.json")["text"], dev: j(f"gen-{dev}.json")["text"]},
    "markov_max_abs_logprob_diff": float(np.max(np.abs(
        np.array(j(f"score-{dev}.json")["logprobs"][h:]) - np.array(j(f"markov-{dev}.json")["logprobs"])))),
}
r["generated_identical"] = r["generated"]["cpu"] == r["generated"][dev]
print(json.dumps(r, indent=1))
json.dump(r, open(out, "w"), indent=1)
PY

[[ ${BENCH:-1} == 0 ]] && exit 0
echo "== bench on $DEVICE"
for args in "--random 130m --prompt-tokens 512" "--random 130m --prompt-tokens 4096 --repeats 2" \
            "--random mamba1-130m --prompt-tokens 512" "--model models/picaso-mamba2 --prompt-tokens 512"; do
  echo "-- $args"
  # shellcheck disable=SC2086
  "$P" bench --device "$DEVICE" $args --decode-tokens 64 --decode-batch 16 --compose-n 0 --json | tee -a "$OUT/bench.jsonl"
done
