#!/usr/bin/env python3
"""Combines the four `picaso eval wikitext` runs of scripts/retriever_ablation.sh into
results/retrievers: results.json, results.md and retrievers.png (improvement over Naive of
PICASO-R and Concat, with paired 95% intervals, and recall of the true neighbouring segment,
per retriever and k; and each retriever against MiniLM, paired over the same passages from the
runs' per-passage journals).

  /work/venv/bin/python scripts/retriever_ablation.py --runs /work/retr-runs/eval-200 --out results/retrievers
"""

import argparse
import json
import math
import statistics
from pathlib import Path

RETRIEVERS = [
    ("minilm", "dense all-MiniLM-L6-v2"),
    ("mpnet", "dense all-mpnet-base-v2"),
    ("bm25", "BM25"),
    ("hybrid", "hybrid (RRF of MiniLM and BM25, weight 0.5)"),
]
METHODS = ["picaso-r", "concat"]


def load(runs: Path):
    out = {}
    for name, label in RETRIEVERS:
        path = runs / name / "results.json"
        if path.is_file():
            out[name] = (label, json.loads(path.read_text()))
    return out


def summarise(runs):
    table = {}
    naive = set()
    for name, (label, d) in runs.items():
        r = d["report"]
        naive.add(round(r["naive_loss"], 9))
        contrast = {(c["a"], c["b"], c["k"]): c for c in r["contrasts"]}
        rows = {}
        for m in METHODS:
            rows[m] = [
                {
                    "k": k,
                    "loss": next(c["loss"] for c in r["cells"] if c["method"] == m and c["k"] == k),
                    "gain_pct_vs_naive": contrast[(m, "naive", k)]["gain_pct"],
                    "gain_pct_ci95": contrast[(m, "naive", k)]["gain_pct_ci95"],
                }
                for k in r["options"]["ks"]
            ]
        r_vs_c = [
            {"k": c["k"], "gain_pct": c["gain_pct"], "gain_pct_ci95": c["gain_pct_ci95"]}
            for c in r["contrasts"]
            if c["a"] == "picaso-r" and c["b"] == "concat"
        ]
        words = d["run"]["command"].split()
        table[name] = {
            "retriever": label,
            "model": words[words.index("--model") + 1],
            "command": d["run"]["command"],
            "wall_seconds": d["run"]["wall_seconds"],
            "passages": r["passages"],
            "passages_available": r["passages_available"],
            "naive_loss": r["naive_loss"],
            "neighbour_passages": r.get("neighbour_passages"),
            "neighbour_recall": r.get("neighbour_recall"),
            "methods": rows,
            "picaso_r_vs_concat": r_vs_c,
        }
    # Every run scored the same passages (same store order, sample and seed): one Naive loss.
    assert len(naive) <= 1, f"the runs scored different passages: naive losses {naive}"
    models = {t["model"] for t in table.values()}
    assert len(models) <= 1, f"the runs composed the states of different models: {models}"
    return table


def per_passage(path: Path):
    """The run's per-passage journal: the passages' ids (its header) and, per passage, Naive's
    loss and each (method, k)'s loss."""
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    rows = []
    for line in lines[1:]:
        p = json.loads(line)
        rows.append((p["naive"], {(c[0], c[1]): c[2] for c in p["cells"]}))
    return header["queries"], rows


def against_base(runs_dir: Path, table, base="minilm"):
    """Each retriever's gain minus `base`'s, per method and k, as % of Naive's mean loss with a
    paired 95% interval over the same passages (positive: the retriever beats `base`)."""
    if base not in table or not (runs_dir / base / "passages.jsonl").is_file():
        return {}
    queries, base_rows = per_passage(runs_dir / base / "passages.jsonl")
    naive = statistics.mean(n for n, _ in base_rows)
    out = {}
    for name in table:
        path = runs_dir / name / "passages.jsonl"
        if name == base or not path.is_file():
            continue
        q, rows = per_passage(path)
        assert q == queries and len(rows) == len(base_rows), f"{name} scored other passages than {base}"
        out[name] = {}
        for m in METHODS:
            cells = []
            for k in sorted({k for (mm, k) in base_rows[0][1] if mm == m}):
                d = [(b[1][(m, k)] - r[1][(m, k)]) for b, r in zip(base_rows, rows)]
                ci = 1.96 * statistics.stdev(d) / math.sqrt(len(d))
                cells.append({"k": k, "gain_pct": 100 * statistics.mean(d) / naive, "gain_pct_ci95": 100 * ci / naive})
            out[name][m] = cells
    return out


def gain(c, key="gain_pct"):
    """A gain and its interval, as the tables print them."""
    return f"{c[key]:+.2f} ± {c['gain_pct_ci95']:.2f}"


def k_table(intro, labels, ks, rows):
    """A Markdown table after its `intro`: the `labels` columns (header, alignment), then one
    column per k; each row is its label cells and its k cells."""
    head = [h for h, _ in labels] + [f"k={k}" for k in ks]
    lines = [intro, "", "| " + " | ".join(head) + " |", "|" + "".join(f"{a}|" for _, a in labels) + "---:|" * len(ks)]
    lines += ["| " + " | ".join([*label, *cells]) + " |" for label, cells in rows]
    return lines + [""]


def markdown(table, command, versus=None):
    first = next(iter(table.values()))
    sample = first["passages"] < first["passages_available"]
    md = ["# Retriever ablation: WikiText-2 raw test, k = 1..10", ""]
    md.append(
        f"{'A SAMPLE of ' if sample else 'All '}{first['passages']} of {first['passages_available']} passages "
        f"(seed 0), the model {first['model']}. Naive loss {first['naive_loss']:.4f} nats/token. "
        f"Command: `{command}` (the per-retriever commands are in results.json)."
    )
    missing = [label for name, label in RETRIEVERS if name not in table]
    if missing:
        md.append("")
        md.append(f"PARTIAL: {len(table)} of {len(RETRIEVERS)} retrievers finished; not yet run: {', '.join(missing)}.")
    md.append("")
    ks = [row["k"] for row in first["methods"]["picaso-r"]]
    by = [("retriever", "---"), ("method", "---")]
    md += k_table(
        "Improvement over Naive (% of Naive's loss, paired 95% interval over the same passages):",
        by,
        ks,
        [
            ((t["retriever"], m), [gain(c, "gain_pct_vs_naive") for c in t["methods"][m]])
            for t in table.values()
            for m in METHODS
        ],
    )
    md += k_table(
        "PICASO-R minus Concat (% of Naive's loss, paired 95% interval; negative: Concat better):",
        by[:1],
        ks,
        [((t["retriever"],), [gain(c) for c in t["picaso_r_vs_concat"]]) for t in table.values()],
    )
    md += k_table(
        "Recall of the true neighbouring segment (the segment just before the query: the second half of the "
        "previous paragraph) among the k retrieved, over the passages that have one:",
        [("retriever", "---"), ("passages", "---:")],
        ks,
        [((t["retriever"], str(t["neighbour_passages"])), [f"{r:.3f}" for _, r in t["neighbour_recall"]]) for t in table.values()],
    )
    if versus:
        md += k_table(
            "Each retriever against dense all-MiniLM-L6-v2 (its gain minus MiniLM's, % of Naive's loss, paired 95% "
            "interval over the same passages; positive: the retriever beats MiniLM):",
            by,
            ks,
            [((table[name]["retriever"], m), [gain(c) for c in by_method[m]]) for name, by_method in versus.items() for m in METHODS],
        )
    md.append("The paper's third retriever, averaged GloVe vectors, is not reachable offline here and is left out.")
    return "\n".join(md) + "\n"


def plot(table, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for i, (name, t) in enumerate(table.items()):
        for ax, m in zip(axes[:2], METHODS):
            # Offset a little per retriever, so the intervals do not hide one another.
            ks = [c["k"] + 0.08 * (i - 1.5) for c in t["methods"][m]]
            y = [c["gain_pct_vs_naive"] for c in t["methods"][m]]
            e = [c["gain_pct_ci95"] for c in t["methods"][m]]
            ax.errorbar(ks, y, yerr=e, marker="o", capsize=3, label=t["retriever"])
        ks = [k for k, _ in t["neighbour_recall"]]
        axes[2].plot(ks, [r for _, r in t["neighbour_recall"]], marker="o", label=t["retriever"])
    for ax, m in zip(axes[:2], METHODS):
        ax.set_title(f"{m}: improvement over Naive")
        ax.set_xlabel("k retrieved segments")
        ax.set_ylabel("% of Naive's loss (paired 95% CI)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
    axes[2].set_title("recall of the true neighbouring segment")
    axes[2].set_xlabel("k retrieved segments")
    axes[2].set_ylabel("recall")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    first = next(iter(table.values()))
    fig.suptitle(f"Retriever ablation, WikiText-2 raw test ({first['passages']} of {first['passages_available']} passages)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("results/retrievers"))
    ap.add_argument("--command", default="scripts/retriever_ablation.sh")
    args = ap.parse_args()
    runs = load(args.runs)
    if not runs:
        raise SystemExit(f"no finished run under {args.runs}")
    table = summarise(runs)
    versus = against_base(args.runs, table)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"command": args.command, "retrievers": table, "against_minilm": versus}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(table, args.command, versus))
    for name in table:
        # Each run's own report (every method's table, the contrasts), beside the summary.
        (args.out / "runs" / name).mkdir(parents=True, exist_ok=True)
        for f in ["results.md", "results.json"]:
            (args.out / "runs" / name / f).write_text((args.runs / name / f).read_text())
    plot(table, args.out / "retrievers.png")
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
