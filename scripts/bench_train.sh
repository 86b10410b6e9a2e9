#!/usr/bin/env bash
# Training speed, side by side in one run: picaso's trainers (the CPU fast path and the candle
# one, crates/train/examples/step_profile.rs) and PyTorch (transformers' Mamba2ForCausalLM,
# scripts/bench_train_torch.py), alternating for ROUNDS rounds on the same shapes and threads.
#
#   scripts/bench_train.sh [ROUNDS] [BATCH] [SEQ_LEN]      (default 3 4 1024)
#
# The model shape is the CPU run's (models/training/picaso-mamba2-v2.json): d_model 384, 4 layers,
# d_state 64, headdim 64, vocab 8192; override with D_MODEL, LAYERS, D_STATE, HEADDIM, VOCAB
# (the bundled model, trained on a GPU: D_MODEL=512 LAYERS=8).
#
# BF16=1 adds picaso's bf16 matrix products (AMX tiles or AVX512-BF16, where the CPU has them) and
# PyTorch under bf16 autocast. Needs a Python with torch and transformers: PYTHON=/work/pyenv/venv/bin/python by default
# (python3 -m venv /work/pyenv/venv && /work/pyenv/venv/bin/pip install torch transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
BATCH=${2:-4}
SEQ=${3:-1024}
PYTHON=${PYTHON:-/work/pyenv/venv/bin/python}
D_MODEL=${D_MODEL:-384}; LAYERS=${LAYERS:-4}; D_STATE=${D_STATE:-64}; HEADDIM=${HEADDIM:-64}; VOCAB=${VOCAB:-8192}
SHAPE=(--d-model "$D_MODEL" --layers "$LAYERS" --d-state "$D_STATE" --headdim "$HEADDIM" --vocab "$VOCAB")
cargo build --release -q --example step_profile -p picaso-train
lscpu | grep -E "Model name|^CPU\(s\)"
grep -o -m1 -E "amx_bf16|avx512_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for r in $(seq 1 "$ROUNDS"); do
    echo "== round $r"
    MATMUL=f32${BF16:+,bf16} RAYON_NUM_THREADS=2 target/release/examples/step_profile "$BATCH" "$SEQ" 64 "$D_MODEL" "$LAYERS" "$D_STATE" "$HEADDIM" "$VOCAB"
    "$PYTHON" scripts/bench_train_torch.py --batch "$BATCH" --seq-len "$SEQ" --threads 2 "${SHAPE[@]}"
    if [ -n "${BF16:-}" ]; then   # bf16 autocast: ~20x slower than f32 on CPUs without AVX512-BF16
        "$PYTHON" scripts/bench_train_torch.py --batch "$BATCH" --seq-len "$SEQ" --threads 2 "${SHAPE[@]}" --bf16
    fi
done
