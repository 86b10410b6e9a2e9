#!/usr/bin/env python3
"""Writes results/state-budget/{results.md, budget.png} from `picaso bench-budget --json` output.

    picaso bench-budget --data ../shared/data/wikitext-2/wiki.train.tokens --work /tmp/bb --weights bf16 --json > bb.json
    python3 scripts/budget_report.py bb.json results/state-budget "the command line used" "revision, machine, date"
"""
import json
import os
import sys


def main():
    src, out = sys.argv[1], sys.argv[2]
    command = sys.argv[3] if len(sys.argv) > 3 else ""
    provenance = sys.argv[4] if len(sys.argv) > 4 else ""
    with open(src) as f:
        run = json.load(f)
    s, arms = run["setting"], run["arms"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench-budget.json"), "w") as f:
        json.dump(run, f, indent=1)
        f.write("\n")
    pct = lambda v: "–" if v is None else f"{100 * v:.1f}%"
    lines = [
        "# A state budget under a Zipf workload",
        "",
        f"{s['paragraphs']:,} WikiText-2 *train* paragraphs, one context each, states "
        f"{s['state_bytes_all'] / 2**20:,.0f} MiB in {s['state_dtype']}; budget "
        f"{s['budget_bytes'] / 2**20:,.0f} MiB (the states are {s['state_bytes_all'] / s['budget_bytes']:.0f}× it). "
        f"{s['queries']:,} queries drawn with Zipf({s['zipf']}) popularity from a pool of one query per paragraph "
        f"(its first 12 words), each retrieving k = {s['k']} (dense) and answered by every arm in turn; time to first "
        f"token = the state from the contexts (read, recomputed or composed; Concat: prefilled) and then the query's "
        f"tokens, to the first token's logits. Model `{s['model']}`, {s['threads']} threads.",
        "",
        "| arm | hit rate | hit rate, 2nd half | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | MiB of states read | states recomputed | context tokens prefilled |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in arms:
        lines.append(
            f"| {a['name']} | {pct(a['hit_rate'])} | {pct(a['hit_rate_second_half'])} | {a['ttft_p50_ms']:.1f} | "
            f"{a['ttft_p99_ms']:.1f} | {a['ttft_mean_ms']:.1f} | {a['bytes_read'] / 2**20:,.0f} | {a['recomputed']:,} | "
            f"{a['context_tokens']:,} |"
        )
    lines += ["", f"Command: `{command}`" + (f" ({provenance})" if provenance else ""), "", "![hit rate, time to first token and bytes read per arm](budget.png)", ""]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [a["name"] for a in arms]
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2"][: len(arms)]
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    hit = [100 * (a["hit_rate"] or 0) for a in arms]
    ax[0].bar(names, hit, color=colors)
    ax[0].set_ylabel("states found stored, %")
    ax[0].set_title("hit rate")
    x = range(len(arms))
    ax[1].bar([i - 0.2 for i in x], [a["ttft_p50_ms"] for a in arms], 0.4, label="p50", color=colors)
    ax[1].bar([i + 0.2 for i in x], [a["ttft_p99_ms"] for a in arms], 0.4, label="p99", color=colors, alpha=0.5)
    ax[1].set_xticks(list(x), names)
    ax[1].set_ylabel("ms")
    ax[1].set_title("time to first token (p50 solid, p99 light)")
    ax[2].bar(names, [a["bytes_read"] / 2**30 for a in arms], color=colors)
    ax[2].set_ylabel("GiB")
    ax[2].set_title("state bytes read")
    for a_ in ax:
        a_.tick_params(axis="x", labelrotation=20)
    fig.suptitle(
        f"{s['paragraphs']:,} contexts, budget {100 * s['budget_bytes'] / s['state_bytes_all']:.0f}% of the states, "
        f"{s['queries']:,} Zipf({s['zipf']}) queries, k = {s['k']}"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "budget.png"), dpi=110)


if __name__ == "__main__":
    main()
