#!/usr/bin/env bash
# Issue 14's capacity measurement, sized to one call of a lent GPU: v3's recipe (initialisation,
# sampler, optimiser, batch 32 x 1,024) at smaller shapes, trained from scratch side by side,
# each run sized to the same wall-clock budget (--plan-minutes: its cosine schedule ends in
# time), with the context-use check on the held-out pairs every 500 steps; each model comes back
# (15 MiB parts) to be scored here against v3 on WikiText-2 with `picaso eval context-use`.
#
#   python3 scripts/gpu_streams.py --tokens RUN/tokens.bin --out .gpu --first 16500000   # here
#   run (carry .gpu): OUT=$OUT scripts/gpu_capacity.sh                                    # there
#   cat FILES/s/model.safetensors.part-* > S/model.safetensors; cp FILES/s/config.json S/  # here
#
# SHAPES ("NAME:D_MODEL:N_LAYER ...", default "s:256:4 m:384:6"), MINUTES (each run's budget,
# default 3.9), LR (peak; the final is a tenth) and BASE (the run file the rest comes from,
# default v3's) override the arms.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?give OUT, the folder whose files come back}
SHAPES=${SHAPES:-s:256:4 m:384:6}
MINUTES=${MINUTES:-3.9}
LR=${LR:-3e-3}
BASE=${BASE:-models/training/picaso-mamba2-v3.json}
G=${GPU_DATA:-.gpu/a}
W=${WORK:-/tmp/capacity}
export PYTHONUNBUFFERED=1
mkdir -p "$W"
xz -dc "$G/pairs.json.xz" > "$W/pairs.json"
names=()
for shape in $SHAPES; do
  IFS=: read -r name d layers <<< "$shape"
  names+=("$name")
  # The base run with this shape, its learning rate, a short warmup; --plan-minutes sets the steps.
  python3 - "$BASE" "$d" "$layers" "$LR" > "$W/$name.json" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))
lr = float(sys.argv[4])
run.update(d_model=int(sys.argv[2]), n_layer=int(sys.argv[3]), lr=lr, min_lr=lr / 10, warmup=100, steps=100000)
print(json.dumps(run))
PY
  # --minutes stops (and exports) even if validation made the run late; timeout is the backstop.
  timeout "$(python3 -c "print(int($MINUTES * 60 + 60))")" python3 scripts/train_gpu.py \
    --config "$W/$name.json" --out "$W/$name" --train "$G/train-a.u16.xz" --val "$G/val.u16.xz" \
    --pairs "$W/pairs.json" --plan-minutes "$MINUTES" --minutes "$(python3 -c "print($MINUTES + 0.5)")" \
    --export "$W/$name-export" > "$W/$name.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
  mkdir -p "$OUT/$name"
  cp "$W/$name.log" "$OUT/$name/train.log"
  if [ -f "$W/$name-export/model.safetensors" ]; then
    split -b 15M "$W/$name-export/model.safetensors" "$OUT/$name/model.safetensors.part-"
    cp "$W/$name-export/config.json" "$OUT/$name/"
  fi
  grep -h "context_use\|sized\|parameters" "$W/$name.log" | cut -c1-400
done
