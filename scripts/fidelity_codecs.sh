#!/usr/bin/env bash
# Fidelity of the state codecs on every WikiText-2 test passage (issue 96): the bundled model's
# WikiText experiment at k = 1..10 with states in f32, int8 and int4, then the comparison
# (results/state-codecs). Resumable: each eval keeps a journal in its --out folder and carries
# on where a killed run stopped; stores already made are reused.
#
#   scripts/fidelity_codecs.sh [MODEL] [RUN]     # defaults: models/picaso-mamba2, /work/runs/fidelity
set -euo pipefail
model=${1:-models/picaso-mamba2}
run=${2:-/work/runs/fidelity/$(basename "$model")}
bin=${PICASO_BIN:-target/release/picaso}
data=${DATA:-../shared/data/wikitext-2/wiki.test.tokens}
ks=1,2,3,4,5,6,7,8,9,10
methods=${METHODS:-concat,picaso-r,picaso-s}
mkdir -p "$run"
"$bin" eval wikitext --db "$run/f32" --data "$data" --model "$model" --out "$run/r-f32" --ks $ks --methods "$methods"
for codec in int8 int4; do
  [ -f "$run/$codec/store.sqlite" ] || "$bin" migrate --from "$run/f32" --to "$run/$codec" --state-dtype $codec
  "$bin" eval wikitext --db "$run/$codec" --model "$model" --out "$run/r-$codec" --ks $ks --methods "$methods"
done
echo "compare: python3 scripts/compare_codecs.py --out results/state-codecs f32=$run/r-f32 int8=$run/r-int8 int4=$run/r-int4"
