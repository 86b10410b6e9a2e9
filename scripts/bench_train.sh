#!/usr/bin/env bash
# Training speed, side by side in one run: picaso's trainers (the CPU fast path and the candle
# one, crates/train/examples/step_profile.rs) and PyTorch (transformers' Mamba2ForCausalLM,
# scripts/bench_train_torch.py), alternating for ROUNDS rounds on the same shapes and threads.
#
#   scripts/bench_train.sh [ROUNDS] [BATCH] [SEQ_LEN]      (default 3 4 1024)
#
# Needs a Python with torch and transformers: PYTHON=/work/pyenv/venv/bin/python by default
# (python3 -m venv /work/pyenv/venv && /work/pyenv/venv/bin/pip install torch transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
BATCH=${2:-4}
SEQ=${3:-1024}
PYTHON=${PYTHON:-/work/pyenv/venv/bin/python}
cargo build --release -q --example step_profile -p picaso-train
lscpu | grep -E "Model name|^CPU\(s\)"
for r in $(seq 1 "$ROUNDS"); do
    echo "== round $r"
    RAYON_NUM_THREADS=2 target/release/examples/step_profile "$BATCH" "$SEQ" 64
    "$PYTHON" scripts/bench_train_torch.py --batch "$BATCH" --seq-len "$SEQ" --threads 2
    "$PYTHON" scripts/bench_train_torch.py --batch "$BATCH" --seq-len "$SEQ" --threads 2 --bf16
done
