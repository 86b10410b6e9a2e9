#!/usr/bin/env bash
# The bundled hybrid (models/picaso-hybrid), sized to one call of a lent GPU (15 minutes of device
# time in all): seven arms of the Granite-4.0-H-shaped run file side by side (where the attention
# layers go, how many, their heads; the pure Mamba-2 + MLP stack as the reference), each from
# scratch on the same tokens, seed and warmup, holding its peak learning rate; the arms are
# compared by context use on the held-out paragraph pairs at the last step all of them reached,
# and the one that reads its context best (within 0.03 nats of the best validation loss)
# continues alone, with its optimiser state, for FINAL_MINUTES, decaying over its last quarter.
# Its weights come back in 15 MiB parts (a returned file holds at most 16 MiB).
#
#   python3 scripts/gpu_streams.py --tokens RUN/tokens.bin --out .gpu          # here
#   run (carry .gpu): OUT=$OUT scripts/gpu_hybrid.sh                            # there
#   cat FILES/model.safetensors.part-* > models/picaso-hybrid/model.safetensors  # here
#
# BASE, STEPS, ARM_MINUTES, FINAL_MINUTES and ARMS override the run file, the arms' steps and
# time limit, the final run's minutes and the arms.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT, the folder whose files come back}
BASE=${BASE:-models/training/picaso-hybrid.json}
STEPS=${STEPS:-400}
ARM_MINUTES=${ARM_MINUTES:-3.4}
FINAL_MINUTES=${FINAL_MINUTES:-4.4}
W=${WORK:-/tmp/hybrid-arms}
G=${GPU_DATA:-.gpu}
read -r -a ARMS <<< "${ARMS:-base no_attention 1_attention,_middle 1_attention,_late 4_attention 4_heads_of_128 8_kv_heads}"
ARMS=("${ARMS[@]//_/ }")
TRAIN=("$G"/a/train-a.u16.xz)
[ -e "$G/b/train-b.u16.xz" ] && TRAIN+=("$G/b/train-b.u16.xz")
export PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi") | tee "$OUT/recipe.log"
python3 scripts/gpu_recipe.py --base "$BASE" --arms "${ARMS[@]}" --steps "$STEPS" --arm-minutes "$ARM_MINUTES" \
  --arm-val-every 100 --choose best --continue-best --final-minutes "$FINAL_MINUTES" \
  --train "${TRAIN[@]}" --arm-train "${TRAIN[@]}" --val "$G/a/val.u16.xz" --pairs "$G/a/pairs.json.xz" \
  --work "$W" 2>&1 | tee -a "$OUT/recipe.log" || echo "gpu_recipe.py failed: $?" | tee -a "$OUT/recipe.log"
# at most 8 files come back: the logs and tables in one archive, the weights in parts
(cd "$W" && tar czf "$OUT/runs.tgz" --ignore-failed-read --exclude=pairs.json ./*.json ./*.log \
  export/config.json export/train-log.jsonl export/run.json 2>/dev/null) || true
[ -e "$W/export/model.safetensors" ] && split -b 15M "$W/export/model.safetensors" "$OUT/model.safetensors.part-"
ls -la "$OUT" | tee -a "$OUT/recipe.log"
