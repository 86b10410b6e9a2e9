#!/usr/bin/env bash
# Copies the long run's latest checkpoint (weights, tokenizer, progress) into
# models/training/picaso-mamba2-v2, the snapshot scripts/train_bundled.sh warm-starts from on a
# new machine. Commit the folder afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-/work/runs/bundled-v2}
SNAPSHOT=models/training/picaso-mamba2-v2
mkdir -p "$SNAPSHOT"
cp "$RUN_DIR/checkpoint/config.json" "$RUN_DIR/checkpoint/model.safetensors" "$SNAPSHOT/"
cp "$RUN_DIR/tokenizer.json" "$SNAPSHOT/"
python3 - "$RUN_DIR/checkpoint/trainer.json" "$SNAPSHOT/progress.json" <<'PY'
import json, sys
state = json.load(open(sys.argv[1]))
json.dump({k: state.get(k, []) for k in ("config", "step", "history", "notes")}, open(sys.argv[2], "w"))
PY
echo "snapshot of step $(python3 -c "import json;print(json.load(open('$SNAPSHOT/progress.json'))['step'])") in $SNAPSHOT"
