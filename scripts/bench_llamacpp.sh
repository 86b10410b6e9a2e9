#!/usr/bin/env bash
# Speed peer: llama.cpp's llama-bench on one or more GGUF files (CPU).
# Runs `llama-bench -m GGUF -p 512 -n 32 -t 2 -r 3 -o json` per file and prints one JSON line each:
#   {"engine":"llama.cpp","dtype":...,"prefill_tokens_per_s":...,"decode_tokens_per_s":...}
# (avg over the -r repetitions, as llama-bench reports; pp512 = prefill, tg32 = decode.)
# Usage: scripts/bench_llamacpp.sh [-b LLAMA_BENCH] [-t THREADS] FILE.gguf...
#   LLAMA_BENCH defaults to $LLAMA_BENCH or /work/peers/llama.cpp/build/bin/llama-bench.
set -euo pipefail
bench=${LLAMA_BENCH:-/work/peers/llama.cpp/build/bin/llama-bench}
threads=2
while getopts b:t: o; do
  case $o in b) bench=$OPTARG ;; t) threads=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { echo "usage: $0 [-b llama-bench] [-t threads] FILE.gguf..." >&2; exit 2; }
py=${PYTHON:-python3}
for gguf in "$@"; do
  "$bench" -m "$gguf" -p 512 -n 32 -t "$threads" -r 3 -o json 2>/dev/null | "$py" -c '
import json, sys
rows = json.load(sys.stdin)
res = {"engine": "llama.cpp", "dtype": rows[0]["model_type"].split()[-1].lower(), "model": sys.argv[1]}
for r in rows:
    key = "prefill_tokens_per_s" if r["n_prompt"] else "decode_tokens_per_s"
    res[key] = round(r["avg_ts"], 2)
    res[key.replace("tokens_per_s", "stddev")] = round(r["stddev_ts"], 2)
res.update(threads=rows[0]["n_threads"], build_commit=rows[0]["build_commit"])
print(json.dumps(res))' "$gguf"
done
