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
# Ratios within each round (engines of one round ran minutes apart), then their median: drift
# between rounds cancels.
by_round = defaultdict(dict)
for r in rows:
    by_round[r["round"]][(r["engine"], r["dtype"])] = r
pairs = [(("picaso", d), (peer, d)) for d in ("f32", "bf16") for peer in ("llama.cpp", "transformers", "picaso-dot", "picaso-widen")]
pairs.append((("picaso", "bf16"), ("picaso", "f32")))
for a, b in pairs:
    rounds = [(n, rr[a], rr[b]) for n, rr in sorted(by_round.items()) if a in rr and b in rr]
    if not rounds:
        continue
    print(f"{a[0]} {a[1]} / {b[0]} {b[1]}:")
    for key, label in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
        ratios = [x[key] / y[key] for _, x, y in rounds]
        per = " ".join(f"{v:.2f}" for v in ratios)
        print(f"  {label}: median {statistics.median(ratios):.2f}x (rounds: {per})")
comp = [r for r in rows if r["engine"] == "picaso" and r.get("compose_into_ms")]
if comp:
    print(f"composition of {comp[0].get('compose_n', 10)} states of this model (ms, median): read", round(statistics.median(r["read_states_ms"] for r in comp), 2))
    for i, (name, _) in enumerate(comp[0]["compose_ms"]):
        fresh = statistics.median(r["compose_ms"][i][1] for r in comp)
        into = statistics.median(r["compose_into_ms"][i][1] for r in comp)
        ratio = statistics.median(r["compose_into_ms"][i][1] / r["read_states_ms"] for r in comp)
        print(f"  {name}: {fresh:.2f} fresh, {into:.2f} into a reused state ({ratio:.2f}x the read)")
