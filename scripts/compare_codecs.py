#!/usr/bin/env python3
"""Fidelity of state codecs: the same WikiText run on stores that differ only in their codec.

Each argument is CODEC=FOLDER, FOLDER a `picaso eval wikitext --out` folder (its passages.jsonl,
journal.jsonl while it runs, holds every passage's losses). The runs must score the same passages (same store contents,
--sample and --seed); the first is the reference (f32). Writes OUT/results.md and
OUT/gain_share.png: per method and k, each codec's gain over Naive and its share of the
reference's gain, with 95% intervals paired over the passages (delta method for the ratio).

Usage: python scripts/compare_codecs.py --out results/state-codecs f32=DIR int8=DIR int4=DIR
(needs numpy and matplotlib)
"""
import argparse
import json
import math
import os
import sys

import numpy as np


def read_journal(folder):
    # A finished run keeps its journal as passages.jsonl; a running one as journal.jsonl.
    name = "passages.jsonl" if os.path.exists(os.path.join(folder, "passages.jsonl")) else "journal.jsonl"
    with open(os.path.join(folder, name)) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    head, rows = lines[0], lines[1:]
    naive = np.array([r["naive"] for r in rows])
    cells = {}
    for i, r in enumerate(rows):
        for method, k, loss, *_ in r["cells"]:
            cells.setdefault((method, k), np.full(len(rows), np.nan))[i] = loss
    return head, naive, cells


def mean_ci(x):
    return x.mean(), 1.96 * x.std(ddof=1) / math.sqrt(len(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+", help="CODEC=FOLDER, the reference first")
    a = ap.parse_args()
    runs = [r.split("=", 1) for r in a.runs]
    data = {c: read_journal(d) for c, d in runs}
    ref = runs[0][0]
    head = data[ref][0]
    for c, (h, naive, _) in data.items():
        if h["queries"][: len(naive)] != head["queries"][: len(naive)]:
            sys.exit(f"{c}: the runs score different passages; use the same store contents, --sample and --seed")
    n = min(len(v[1]) for v in data.values())
    methods = [m for m in head["options"]["methods"]]
    ks = head["options"]["ks"]
    lines = [
        "# State codecs: fidelity on WikiText-2",
        "",
        f"{n} passages scored by every run (`--sample {head['options']['sample']} --seed {head['options']['seed']}`), "
        f"model `{head['model']}`. Gain = (Naive − method) / Naive loss, in %; share = the codec's gain over "
        f"{ref}'s; intervals 95%, paired over the same passages. Runs: "
        + ", ".join(f"{c} `{d}`" for c, d in runs)
        + ".",
        "",
        "| method | k | codec | gain % | share of " + ref + "'s gain | loss − " + ref + "'s |",
        "|---|---|---|---|---|---|",
    ]
    shares = {}
    for m in methods:
        for k in ks:
            base_naive = data[ref][1][:n]
            base = data[ref][2][(m, k)][:n]
            g_ref = (base_naive - base) / base_naive * 100
            for c, _ in runs:
                naive, cells = data[c][1][:n], data[c][2][(m, k)][:n]
                g = (naive - cells) / naive * 100
                gm, gci = mean_ci(g)
                # share = mean(g) / mean(g_ref); delta-method interval from the paired pairs.
                mr = g_ref.mean()
                share = gm / mr
                d = (g - share * g_ref) / mr
                sci = 1.96 * d.std(ddof=1) / math.sqrt(n)
                dm, dci = mean_ci(cells - base)
                shares[(m, k, c)] = (share, sci)
                lines.append(
                    f"| {m} | {k} | {c} | {gm:+.3f} ± {gci:.3f} | {100 * share:.1f}% ± {100 * sci:.1f} | {dm:+.5f} ± {dci:.5f} |"
                )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.6), sharey=True)
    for ax, m in zip(np.atleast_1d(axes), methods):
        for c, _ in runs[1:]:
            y = [100 * shares[(m, k, c)][0] for k in ks]
            e = [100 * shares[(m, k, c)][1] for k in ks]
            ax.errorbar(ks, y, yerr=e, marker="o", capsize=3, label=c)
        ax.axhline(100, color="gray", lw=0.8)
        for level, style in ((99, ":"), (95, "--")):
            ax.axhline(level, color="gray", lw=0.8, ls=style)
        ax.set_title(m)
        ax.set_xlabel("k retrieved contexts")
        ax.set_xticks(ks)
    np.atleast_1d(axes)[0].set_ylabel(f"share of {ref}'s gain over Naive (%)")
    np.atleast_1d(axes)[0].legend()
    fig.suptitle("State codecs: gain kept against f32 states (95% paired intervals)")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "gain_share.png"), dpi=110)


if __name__ == "__main__":
    main()
