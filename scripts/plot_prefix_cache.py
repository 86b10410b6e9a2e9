#!/usr/bin/env python3
"""Plot results/prefix-cache from its committed JSON lines.

Each file is one `scripts/bench_prefix_cache.sh` run: a row per (server, workload, clients, turn)
with the time to first token (`ttft_p50_ms`) and the prompt tokens sent and prefilled. Draws
`results/prefix-cache/prefix_cache.png`: the time to first token at each turn of a one-client
conversation, per model (bundled Mamba-2, bundled hybrid, mamba2-130m shapes beside llama-server),
with and without the prefix cache (the 9a50363 reruns dashed), and the 16 agents that share a
system prompt.

    /work/plotvenv/bin/python scripts/plot_prefix_cache.py [--dir results/prefix-cache]
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PANELS = [  # (title, [(file, label suffix, dashed)])
    ("bundled Mamba-2 (17 M)", [("mamba2-bundled.jsonl", "d490c88", False), ("mamba2-bundled-9a50363.jsonl", "9a50363", True)]),
    ("bundled hybrid (Granite-4.0-H shape, 20 M)", [("hybrid-bundled.jsonl", "d490c88", False)]),
    ("mamba2-130m shapes, beside llama-server", [("mamba2-130m-vs-llama.jsonl", "d490c88", False), ("mamba2-130m-9a50363.jsonl", "9a50363", True)]),
]
COLOURS = {"picaso, prefix cache 1024 MiB": "#1f5fa8", "picaso, no prefix cache": "#8dbbe8", "llama-server, cache_prompt": "#e07b24"}


def rows(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "results/prefix-cache")
    args = ap.parse_args()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for ax, (title, files) in zip(axes.flat, PANELS):
        for name, rev, dashed in files:
            data = rows(args.dir / name)
            servers = []
            for r in data:
                if r["server"] not in servers:
                    servers.append(r["server"])
            for server in servers:
                conv = sorted((r for r in data if r["server"] == server and r["workload"] == "conversation" and r["clients"] == 1), key=lambda r: r["turn"])
                if not conv:
                    continue
                ax.plot([r["turn"] for r in conv], [r["ttft_p50_ms"] for r in conv], marker="o", markersize=4,
                        linestyle="--" if dashed else "-", color=COLOURS.get(server, "#555555"),
                        label=f"{server} ({rev})")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("conversation turn (each adds ~200 tokens of user text and a 32-token answer)", fontsize=8)
        ax.set_ylabel("time to first token, ms (log scale)", fontsize=8)
        ax.set_xticks(range(1, 11))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7.5)

    ax = axes.flat[3]
    groups = [("bundled Mamba-2", "mamba2-bundled.jsonl"), ("bundled hybrid", "hybrid-bundled.jsonl"), ("mamba2-130m", "mamba2-130m-vs-llama.jsonl")]
    servers = list(COLOURS)
    width = 0.8 / len(servers)
    for gi, (label, name) in enumerate(groups):
        agents = {r["server"]: r for r in rows(args.dir / name) if r["workload"] == "agents"}
        for si, server in enumerate(servers):
            if server not in agents:
                continue
            r = agents[server]
            x = gi - 0.4 + width * (si + 0.5)
            ax.bar(x, r["ttft_p50_ms"] / 1000, width * 0.9, color=COLOURS[server])
            ax.annotate(f"{r['ttft_p50_ms'] / 1000:.1f} s\n{r['prefilled_tokens']:,} of\n{r['prompt_tokens']:,}", (x, r["ttft_p50_ms"] / 1000),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=6.5)
    ax.set_yscale("log")
    ax.set_ylim(0.5, 3000)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g for g, _ in groups], fontsize=8)
    ax.set_ylabel("time to first token p50, s (log scale)", fontsize=8)
    ax.set_title("16 agents sharing a ~2,000-token system prompt (d490c88):\nTTFT and prompt tokens prefilled of those sent", fontsize=10)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLOURS[s]) for s in servers], labels=servers, fontsize=7.5, loc="upper left")

    fig.suptitle("Prefix cache: conversations and agents, one client per conversation (Intel Xeon, 2 vCPUs, loaded machine)", fontsize=12, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out = args.dir / "prefix_cache.png"
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main()
