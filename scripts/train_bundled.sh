#!/usr/bin/env bash
# The CPU route to a model like the bundled one: picaso's own trainer on the v2 recipe
# (models/training/picaso-mamba2-v2.json: 6.9 M parameters, 51 M tokens, about 7 hours on two
# cores), resumable across sessions. The bundled model itself (v3, 17.4 M parameters) was trained
# on a GPU with scripts/train_gpu.py from the same tokens; see models/training/README.md.
#
#   scripts/train_bundled.sh [STOP_AFTER_STEPS]
#
# Keeps its folder outside the work tree (RUN_DIR, default /work/runs/bundled-v2) and resumes
# exactly from RUN_DIR/checkpoint when it exists (weights, AdamW moments, step, loss history).
# Data: Wikipedia articles (../shared/data/wikipedia-en/articles.txt.gz, see its PROVENANCE.md;
# WIKIPEDIA overrides the path), tokenized with the bundled model's tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-/work/runs/bundled-v2}
WIKIPEDIA=${WIKIPEDIA:-../shared/data/wikipedia-en/articles.txt.gz}
CONFIG=models/training/picaso-mamba2-v2.json
BIN=${PICASO_BIN:-target/release/picaso}
[ -x "$BIN" ] || cargo build --release -p picaso
# A private copy of the binary, so rebuilding target/ while the run goes on cannot touch it.
mkdir -p "$RUN_DIR"
cp "$BIN" "$RUN_DIR/picaso.bin"
args=(train pretrain --config "$CONFIG" --out "$RUN_DIR" --corpus "wikipedia:$WIKIPEDIA")
[ -f "$RUN_DIR/tokenizer.json" ] || args+=(--tokenizer models/picaso-mamba2/tokenizer.json)
[ -n "${1:-}" ] && args+=(--stop-after "$1")
exec "$RUN_DIR/picaso.bin" "${args[@]}"
