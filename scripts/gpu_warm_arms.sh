#!/usr/bin/env bash
# Issue 14's next ablation, sized to one call of a lent GPU (15 minutes of device time in all):
# the bundled model trained on, from its weights (warm start), for one pass over the same 8 M
# tokens of its training stream in four arms side by side: the original order (base), the
# order of scripts/pack_neighbours.py (related passages follow each other: in-context
# pretraining), and the learning rate ×2 and ÷2. Each arm ends with its validation loss and its
# context use on the 1,492 held-out paragraph pairs; the arm that reads its context best comes
# back as a model (split into 15 MiB parts, the most a returned file may hold) to be measured
# here with `picaso eval context-use`.
#
#   python3 scripts/gpu_streams.py --tokens RUN/tokens.bin --out .gpu --first 8000000   # here
#   python3 scripts/pack_neighbours.py --train .gpu/a/train-a.u16.xz --order-out .gpu/a/order-a.npz
#   run (carry .gpu): OUT=$OUT scripts/gpu_warm_arms.sh                                   # there
#   cat $FILES/model.safetensors.part-* > MODEL/model.safetensors                        # here
#
# INIT, BASE, STEPS and ARMS override the model, its run file, each arm's steps and the arms.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT, the folder whose files come back}
INIT=${INIT:-models/picaso-mamba2}
BASE=${BASE:-models/training/warm-v3.json}
STEPS=${STEPS:-240}   # 240 × 32 × 1,024 tokens: one pass over the 8 M
W=${WORK:-/tmp/warm-arms}
G=${GPU_DATA:-.gpu/a}
read -r -a ARMS <<< "${ARMS:-base neighbours lr_x2 lr_/2}"
ARMS=("${ARMS[@]//_/ }")
export PYTHONUNBUFFERED=1
python3 scripts/gpu_recipe.py --init "$INIT" --base "$BASE" --arms "${ARMS[@]}" --steps "$STEPS" \
  --train "$G/train-a.u16.xz" --arm-train "$G/train-a.u16.xz" --arm-order "$G/order-a.npz" \
  --val "$G/val.u16.xz" --pairs "$G/pairs.json.xz" --work "$W" --arms-only 2>&1 | tee "$OUT/recipe.log"
cp "$W/ablation.json" "$OUT/"
best=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(max(r, key=lambda x: x['gain'])['arm'])" "$W/ablation.json")
folder="$W/arm-$(echo "$best" | sed 's| |-|g; s|/|div|g')"
python3 scripts/train_gpu.py --config "$folder.json" --out "$folder" --export-only --export "$W/export"
split -b 15M "$W/export/model.safetensors" "$OUT/model.safetensors.part-"
cp "$W/export/config.json" "$OUT/"
echo "the best arm: $best; its model is in $OUT (config.json, model.safetensors.part-*)" | tee -a "$OUT/recipe.log"
