"""Summarise bench_peers.sh output: median tokens/s per engine and dtype, and picaso's ratios."""
import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
by = defaultdict(lambda: defaultdict(list))
for r in rows:
    for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        if k in r:
            by[(r["engine"], r["dtype"])][k].append(r[k])
med = {key: {k: statistics.median(v) for k, v in d.items()} for key, d in by.items()}
print("| engine | weights | prefill 512 (tokens/s) | decode (tokens/s) | runs |")
print("|---|---|---|---|---|")
for (engine, dtype), m in sorted(med.items()):
    n = len(by[(engine, dtype)]["prefill_tokens_per_s"])
    print(f"| {engine} | {dtype} | {m['prefill_tokens_per_s']:.0f} | {m['decode_tokens_per_s']:.1f} | {n} |")
for dtype in ("f32", "bf16"):
    p = med.get(("picaso", dtype))
    if not p:
        continue
    for peer in ("llama.cpp", "transformers"):
        q = med.get((peer, dtype))
        if q:
            print(f"picaso/{peer} {dtype}: prefill {p['prefill_tokens_per_s'] / q['prefill_tokens_per_s']:.2f}x, "
                  f"decode {p['decode_tokens_per_s'] / q['decode_tokens_per_s']:.2f}x")
comp = [r for r in rows if r["engine"] == "picaso" and r.get("compose_into_ms")]
if comp:
    print(f"composition of {comp[0].get('compose_n', 10)} states of this model (ms, median): read", round(statistics.median(r["read_states_ms"] for r in comp), 2))
    for i, (name, _) in enumerate(comp[0]["compose_ms"]):
        fresh = statistics.median(r["compose_ms"][i][1] for r in comp)
        into = statistics.median(r["compose_into_ms"][i][1] for r in comp)
        ratio = statistics.median(r["compose_into_ms"][i][1] / r["read_states_ms"] for r in comp)
        print(f"  {name}: {fresh:.2f} fresh, {into:.2f} into a reused state ({ratio:.2f}x the read)")
