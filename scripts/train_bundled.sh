#!/usr/bin/env bash
# The bundled model's long pretraining run, resumable across sessions and machines.
#
#   scripts/train_bundled.sh [STOP_AFTER_STEPS]
#
# Keeps its folder outside the work tree (RUN_DIR, default /work/runs/bundled-v2) and resumes
# exactly from RUN_DIR/checkpoint when it exists (weights, AdamW moments, step, loss history).
# On a new machine (no checkpoint) it warm-starts from the latest snapshot committed to the
# repository, models/training/picaso-mamba2-v2 (weights and progress.json; the optimiser's
# moments restart at zero, which the run log records), or trains from scratch when there is
# none. Data: Wikipedia articles (../shared/data/wikipedia-en/articles.txt.gz, see its
# PROVENANCE.md; WIKIPEDIA overrides the path). `scripts/snapshot_bundled.sh` commits a snapshot.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-/work/runs/bundled-v2}
WIKIPEDIA=${WIKIPEDIA:-../shared/data/wikipedia-en/articles.txt.gz}
CONFIG=models/training/picaso-mamba2-v2.json
SNAPSHOT=models/training/picaso-mamba2-v2
BIN=${PICASO_BIN:-target/release/picaso}
[ -x "$BIN" ] || cargo build --release -p picaso
# A private copy of the binary, so rebuilding target/ while the run goes on cannot touch it.
mkdir -p "$RUN_DIR"
cp "$BIN" "$RUN_DIR/picaso.bin"
args=(train pretrain --config "$CONFIG" --out "$RUN_DIR" --corpus "wikipedia:$WIKIPEDIA")
if [ ! -f "$RUN_DIR/checkpoint/trainer.json" ] && [ -f "$SNAPSHOT/model.safetensors" ]; then
    args+=(--warm-start "$SNAPSHOT" --tokenizer "$SNAPSHOT/tokenizer.json")
elif [ -f "$SNAPSHOT/tokenizer.json" ] && [ ! -f "$RUN_DIR/tokenizer.json" ]; then
    args+=(--tokenizer "$SNAPSHOT/tokenizer.json")
fi
[ -n "${1:-}" ] && args+=(--stop-after "$1")
exec "$RUN_DIR/picaso.bin" "${args[@]}"
