#!/usr/bin/env bash
# The paper's retriever ablation on WikiText-2 raw test passages: PICASO-R and Concat at
# k = 1..10 with four retrievers — dense all-MiniLM-L6-v2, dense all-mpnet-base-v2, BM25, and
# hybrid (reciprocal-rank fusion of MiniLM and BM25, weight 0.5) — then the combined report in
# results/retrievers (scripts/retriever_ablation.py).
#
# Usage: scripts/retriever_ablation.sh [SAMPLE]    (SAMPLE passages, seed 0; "all" for every one)
#   MPNET=/work/mpnet (all-mpnet-base-v2 folder; see docs/retrievers.md to obtain it)
#   RUNS=/work/retr-runs (the two stores and the runs' folders; outside the checkout)
#   MODEL=models/picaso-mamba2 (the model whose states are composed; its stores live in RUNS)
#   OUT=results/retrievers (the combined report's folder)
#   PYTHON=python3 with matplotlib (draws retrievers.png)
# Resumable: each store's ingest skips what is stored, each eval journals every passage, and a
# finished eval (results.json present) is not run again. Two stores are ingested, one per
# encoder (a store holds the vectors of one encoder); BM25 and hybrid use the MiniLM store.
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLE=${1:-200}
D=${D:-../shared/data}
MPNET=${MPNET:-/work/mpnet}
RUNS=${RUNS:-/work/retr-runs}
MODEL=${MODEL:-models/picaso-mamba2}
BIN=${BIN:-target/release/picaso}
OUT=${OUT:-results/retrievers}
DATA=$D/wikitext-2/wiki.test.raw.crlf_nonempty
mkdir -p "$RUNS"
sample=(); [ "$SAMPLE" = all ] || sample=(--sample "$SAMPLE")
tag=$SAMPLE
run() { # NAME DB EMBEDDER RETRIEVER...
    local name=$1 db=$2 embedder=$3; shift 3
    local out=$RUNS/eval-$tag/$name
    if [ -f "$out/results.json" ]; then echo "$name: done ($out)"; return; fi
    "$BIN" eval wikitext --db "$db" --data "$DATA" --embedder "$embedder" --model "$MODEL" \
        --out "$out" --max-k 10 --methods concat,picaso-r "${sample[@]}" "$@"
}
run minilm "$RUNS/minilm.db" "$D/all-MiniLM-L6-v2" --retriever dense
run bm25 "$RUNS/minilm.db" "$D/all-MiniLM-L6-v2" --retriever bm25
run hybrid "$RUNS/minilm.db" "$D/all-MiniLM-L6-v2" --retriever hybrid --hybrid-weight 0.5
run mpnet "$RUNS/mpnet.db" "$MPNET" --retriever dense
"${PYTHON:-python3}" scripts/retriever_ablation.py --runs "$RUNS/eval-$tag" --out "$OUT" \
    --command "MODEL=$MODEL scripts/retriever_ablation.sh $SAMPLE"
