#!/usr/bin/env bash
# Query-time latency per backend (BENCHMARKS.md, "Backends"): the same store as a folder
# (SQLite + files) and as PostgreSQL + S3 (copied with `picaso migrate`), exact search and
# HNSW, with and without the state cache.
#
#   scripts/bench_backends.sh STORE_DIR MODEL_DIR [QUERIES]
#
# STORE_DIR: a folder store (e.g. WikiText-2 test halves: `picaso ingest --db DIR --wikitext
# wiki.test.tokens --segment halves --embedder E`); MODEL_DIR: the model that made it.
# Starts local PostgreSQL + pgvector and an S3 API with .ci/services (or uses the services the
# PICASO_TEST_* / AWS_* variables already point at).
set -euo pipefail
store=${1:?usage: $0 STORE_DIR MODEL_DIR [QUERIES]}
model=${2:?usage: $0 STORE_DIR MODEL_DIR [QUERIES]}
queries=${3:-50}
cd "$(dirname "$0")/.."
if [ -z "${PICASO_TEST_POSTGRES:-}" ]; then eval "$(.ci/services start)"; fi
cargo build --release -q -p picaso
picaso=target/release/picaso
name=bench_$(date +%s)
pg="$PICASO_TEST_POSTGRES?options=-csearch_path%3D$name%2Cpublic"
s3="$PICASO_TEST_S3/$name"
echo "== migrate $store → PostgreSQL + S3"
$picaso migrate --from "$store" --to "$pg" --to-states "$s3"
echo "== folder + SQLite"
$picaso bench-store --db "$store" --model "$model" --ks 1,5,10 --queries "$queries"
echo "== PostgreSQL (exact) + S3"
$picaso bench-store --db "$pg" --model "$model" --ks 1,5,10 --queries "$queries"
$picaso index --db "$pg" --hnsw --m 16 --ef-construction 64
echo "== PostgreSQL (HNSW m 16, ef_construction 64) + S3"
$picaso bench-store --db "$pg" --model "$model" --ks 1,5,10 --queries "$queries"
