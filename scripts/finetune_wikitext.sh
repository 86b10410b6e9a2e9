#!/usr/bin/env bash
# The paper's fine-tuning on WikiText-2 train (issue: the paper's experiments again), resumable:
# every step skips what is done and the training runs resume from their checkpoints, so the
# script can be stopped at any point and run again (in the next session too).
#
#   scripts/finetune_wikitext.sh [SAMPLE]     # SAMPLE: test passages to evaluate (default 100; "all": every one)
#   KS=10 OUT=results/finetuned-full scripts/finetune_wikitext.sh all   # every passage, at k = 10 only
#   OBJECTIVES=bptc OUT=/tmp/finetuned-bptc scripts/finetune_wikitext.sh   # one objective only
#   MODEL=models/picaso-hybrid RUNS=/work/runs/ft-hybrid OUT=results/finetuned-hybrid \
#     KS=10 scripts/finetune_wikitext.sh all                                # the bundled hybrid
#
# 1. a store of WikiText-2 *train* paragraphs cut into query/continuation halves, ingested by
#    the bundled model (RUNS/no-unk/db): the split's 3,870 paragraphs without `<unk>`, with bf16
#    state files (a state of the bundled model is 2.1 MiB in f32). The train split is the
#    tokenized one: 79% of its paragraphs hold `<unk>`, which the raw test split never has, and
#    a model fine-tuned on them learns to write `<unk>`. (Both splits' WikiText spacing is
#    undone at ingest.) Removing `<unk>` alone did not help: at lr 3e-4, BP2C left the test
#    split ~2% worse (git history, f0d0247), because validation on held-out paragraphs of
#    the trained articles rewarded memorising them. Validation now holds out whole articles,
#    and the rate was chosen on them (results/finetune-lr-ablation);
# 2. BP2C and BPTC on it (models/training/finetune-wikitext.json: lr 1e-4, k drawn from 0..10),
#    two examples per forward pass (a batch of 8 at k = 10 in one BPTC pass would hold 24 GB);
# 3. a store of the raw *test* split (RUNS/db-test) and `eval finetuned` of Concat and PICASO-R:
#    zero-shot vs BPTC vs BP2C on the same test passages, each pair of models paired, into
#    OUT, with each objective's training log and loss curve in OUT/training-OBJECTIVE.
# RUNS defaults to /work/runs/ft-wikitext; DATA to ../shared/data (WikiText-2 and MiniLM; see
# their PROVENANCE.md); OBJECTIVES to "bp2c bptc"; OUT (the report's folder) to results/finetuned;
# MODEL (the zero-shot model that ingests the stores and is fine-tuned) to models/picaso-mamba2.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-/work/runs/ft-wikitext}
D=${DATA:-../shared/data}
E=$D/all-MiniLM-L6-v2
SAMPLE=${1:-100}
# Which passages and which k the WikiText evaluation scores (KS: comma-separated; default 1..10).
SELECT=()
[ "$SAMPLE" = all ] || SELECT+=(--sample "$SAMPLE")
[ -z "${KS:-}" ] || SELECT+=(--ks "$KS")
OBJECTIVES=${OBJECTIVES:-bp2c bptc}
OUT=${OUT:-results/finetuned}
MODEL=${MODEL:-models/picaso-mamba2}
BIN=${PICASO_BIN:-target/release/picaso}
[ -x "$BIN" ] || cargo build --release -p picaso
mkdir -p "$RUNS"
# A private copy of the binary, so rebuilding target/ while the runs go on cannot touch it.
[ -x "$RUNS/picaso.bin" ] || cp "$BIN" "$RUNS/picaso.bin"
P=$RUNS/picaso.bin
T=$RUNS/no-unk
mkdir -p "$T"
grep -v '<unk>' "$D/wikitext-2/wiki.train.tokens" > "$T/wiki.train.no-unk.tokens"   # headings kept
$P ingest --db "$T/db" --model "$MODEL" --embedder "$E" --wikitext "$T/wiki.train.no-unk.tokens" --segment halves --state-dtype bf16
MODELS=zero-shot=$MODEL
for objective in $OBJECTIVES; do   # a finished run resumes to its end at once
  $P train compose --objective $objective --db "$T/db" --model "$MODEL" \
    --config models/training/finetune-wikitext.json --micro-batch 2 --out "$T/$objective"
  MODELS="$MODELS,$objective=$T/$objective/model"
done
$P ingest --db "$RUNS/db-test" --model "$MODEL" --embedder "$E" --wikitext "$D/wikitext-2/wiki.test.raw.crlf_nonempty" --segment halves
$P eval finetuned --db "$RUNS/db-test" --embedder "$E" --obqa "$D/openbookqa" \
  --models "$MODELS" --obqa-ks 10 --methods concat,picaso-r "${SELECT[@]}" --seed 0 --out "$OUT"
for objective in $OBJECTIVES; do
  mkdir -p "$OUT/training-$objective"
  cp "$T/$objective/finetune.csv" "$T/$objective/loss.png" "$OUT/training-$objective/"
done
