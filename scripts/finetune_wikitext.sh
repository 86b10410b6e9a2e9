#!/usr/bin/env bash
# The paper's fine-tuning on WikiText-2 train (issue: the paper's experiments again), resumable:
# every step skips what is done and the training runs resume from their checkpoints, so the
# script can be stopped at any point and run again (in the next session too).
#
#   scripts/finetune_wikitext.sh [SAMPLE]     # SAMPLE: test passages to evaluate (default 100)
#
# 1. a store of WikiText-2 *train* paragraphs cut into query/continuation halves, ingested by
#    the bundled model (RUNS/db-train): the first TRAIN_ARTICLES (120) of its 629 articles, with
#    bf16 state files (a state of the bundled model is 2.1 MiB in f32: all ~35,000 halves of the
#    split would need 37 GB of disk in bf16, 74 GB in f32);
# 2. BP2C and BPTC on it (models/training/finetune-wikitext.json: k drawn from 0..10), two
#    examples per forward pass (a batch of 8 at k = 10 in one BPTC pass would hold 24 GB);
# 3. a store of the raw *test* split (RUNS/db-test) and `eval finetuned`: zero-shot vs BPTC vs
#    BP2C on the same test passages, paired, into results/finetuned.
# RUNS defaults to /work/runs/ft-wikitext; DATA to ../shared/data (WikiText-2 and MiniLM; see
# their PROVENANCE.md).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-/work/runs/ft-wikitext}
D=${DATA:-../shared/data}
E=$D/all-MiniLM-L6-v2
SAMPLE=${1:-100}
TRAIN_ARTICLES=${TRAIN_ARTICLES:-120}
BIN=${PICASO_BIN:-target/release/picaso}
[ -x "$BIN" ] || cargo build --release -p picaso
mkdir -p "$RUNS"
# A private copy of the binary, so rebuilding target/ while the runs go on cannot touch it.
[ -x "$RUNS/picaso.bin" ] || cp "$BIN" "$RUNS/picaso.bin"
P=$RUNS/picaso.bin
train=$RUNS/wiki.train.first$TRAIN_ARTICLES.tokens
awk -v n="$TRAIN_ARTICLES" '/^ = [^=].* = $/ { a++ } a <= n' "$D/wikitext-2/wiki.train.tokens" > "$train"
$P ingest --db "$RUNS/db-train" --embedder "$E" --wikitext "$train" --segment halves --state-dtype bf16
for objective in bp2c bptc; do   # a finished run resumes to its end at once
  $P train compose --objective $objective --db "$RUNS/db-train" \
    --config models/training/finetune-wikitext.json --micro-batch 2 --out "$RUNS/$objective"
done
$P ingest --db "$RUNS/db-test" --embedder "$E" --wikitext "$D/wikitext-2/wiki.test.raw.crlf_nonempty" --segment halves
$P eval finetuned --db "$RUNS/db-test" --embedder "$E" --obqa "$D/openbookqa" \
  --models "zero-shot=models/picaso-mamba2,bptc=$RUNS/bptc/model,bp2c=$RUNS/bp2c/model" \
  --obqa-ks 10 --sample "$SAMPLE" --seed 0 --out results/finetuned
