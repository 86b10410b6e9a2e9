#!/usr/bin/env bash
# Ingest throughput (contexts/s) of several weight / kernel settings, interleaved, one new store
# per run: `picaso ingest --wikitext FILE --segment tokens:100` into a fresh folder store.
#
#   scripts/bench_ingest.sh MODEL WIKITEXT ROUNDS [SETTING...]
#
# SETTING is WEIGHTS or WEIGHTS:KERNEL, e.g. f32, bf16 (this CPU's best bf16 kernel), bf16:dot
# (PICASO_BF16_KERNEL=dot: AVX512-BF16 without AMX tiles), bf16:widen. Default: f32 bf16:dot bf16.
# Prints one JSON line per run, then the medians. Needs a release build (cargo build --release -p
# picaso); PICASO= another binary. The embedder is found as `picaso ingest` finds it.
set -euo pipefail
model=$1 text=$2 rounds=$3
shift 3
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(f32 bf16:dot bf16)
here=$(cd "$(dirname "$0")" && pwd)
picaso=${PICASO:-$here/../target/release/picaso}
out=$(mktemp)
for r in $(seq "$rounds"); do
  for s in "${settings[@]}"; do
    weights=${s%%:*}
    kernel=$([ "$s" = "$weights" ] && echo "" || echo "${s#*:}")
    db=$(mktemp -d)
    PICASO_BF16_KERNEL=$kernel "$picaso" ingest --db "$db" --model "$model" --wikitext "$text" \
      --segment tokens:100 --weights "$weights" --json |
      python3 -c 'import json,sys; d=json.load(sys.stdin); s,r=sys.argv[1:]; print(json.dumps({"setting":s,"round":int(r),"contexts":d["added"],"seconds":round(d["seconds"],3),"contexts_per_s":round(d["added"]/d["seconds"],2)}))' "$s" "$r" |
      tee -a "$out"
    rm -rf "$db"
  done
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for s in dict.fromkeys(r["setting"] for r in rows):
    v = [r["contexts_per_s"] for r in rows if r["setting"] == s]
    print(f"{s:>10}: median {statistics.median(v):.2f} contexts/s (rounds: {', '.join(f'{x:.2f}' for x in v)})")
EOF
