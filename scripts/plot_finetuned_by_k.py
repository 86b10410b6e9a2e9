#!/usr/bin/env python3
"""Plot a `picaso eval finetuned` comparison by k from its committed results.json.

`picaso eval finetuned` writes each model's own plots into its sub-folders and, since after
results/finetuned was made, a chart of every model against the first one's Naive (which needs
the per-passage losses a report does not keep). This draws, from `results.json` alone, the
models side by side at every k: left, each model's loss (nats/token) for Naive, Concat and
PICASO-R; right, the loss reduction over the model's own Naive, in %.

    /work/plotvenv/bin/python scripts/plot_finetuned_by_k.py [--dir results/finetuned]
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COLOURS = ["#555555", "#1f5fa8", "#c9503c", "#2a9d8f", "#e07b24"]
STYLES = {"naive": ":", "concat": "--", "picaso-r": "-"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "results/finetuned")
    args = ap.parse_args()
    report = json.loads((args.dir / "results.json").read_text())
    fig, (ax_loss, ax_gain) = plt.subplots(1, 2, figsize=(13, 5))
    passages = None
    for i, m in enumerate(report["models"]):
        w = m["wikitext"]
        passages = w["passages"]
        colour = COLOURS[i % len(COLOURS)]
        methods = []
        for c in w["cells"]:
            if c["method"] not in methods:
                methods.append(c["method"])
        for method in methods:
            cells = sorted((c for c in w["cells"] if c["method"] == method), key=lambda c: c["k"])
            ks = [c["k"] for c in cells]
            style = STYLES.get(method, "-.")
            ax_loss.plot(ks, [c["loss"] for c in cells], linestyle=style, color=colour, marker="o" if method == "picaso-r" else None,
                         markersize=3, label=f"{m['name']} {method}")
            if method != "naive":
                ax_gain.plot(ks, [c["improvement_pct"] for c in cells], linestyle=style, color=colour,
                             marker="o" if method == "picaso-r" else None, markersize=3, label=f"{m['name']} {method}")
    for ax in (ax_loss, ax_gain):
        ax.set_xlabel("k retrieved contexts")
        ax.set_xticks(range(1, 11))
        ax.grid(alpha=0.3)
    ax_loss.set_ylabel("continuation loss, nats/token")
    ax_loss.set_title("Loss by k (dotted: Naive, dashed: Concat, solid: PICASO-R)", fontsize=10)
    ax_loss.legend(fontsize=7.5, ncol=3, loc="center right")
    ax_gain.set_ylabel("loss reduction over the model's own Naive, %")
    ax_gain.set_title("Gain over Naive by k (dashed: Concat, solid: PICASO-R)", fontsize=10)
    ax_gain.legend(fontsize=7.5, ncol=3, loc="lower right")
    fig.suptitle(f"WikiText-2, {passages} passages: zero-shot and fine-tuned models at every k", fontsize=12, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out = args.dir / "models_by_k.png"
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main()
