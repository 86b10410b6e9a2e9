#!/usr/bin/env python3
"""Draw BENCHMARKS.md's summary plots from docs/benchmarks/summary.csv.

One PNG per subject (engine, serving, composition, store, training) into docs/benchmarks/:
picaso beside its peer, one group of bars per CPU kind (or case), one panel per measurement.
The CSV holds the same figures as BENCHMARKS.md's tables, one row per bar:

    subject, panel, group, series, low, high, unit, ratio, date, revision, part

- `low`/`high`: the figure, or the range over a run's rounds (high = low for a median);
  a range is drawn solid to `low` and hatched up to `high`.
- `ratio`: printed above the group (picaso against its peer, as BENCHMARKS.md reports it).
- `part`: rows of one (panel, group, series) with different parts are stacked in one bar.
- `date`, `revision`: shown under each group.

    python3 -m venv /work/plotvenv && /work/plotvenv/bin/pip install matplotlib
    /work/plotvenv/bin/python scripts/plot_benchmark_summary.py [--csv FILE] [--out DIR]
"""

import argparse
import csv
import textwrap
from collections import OrderedDict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

TITLES = {
    "engine": "Engine: picaso vs llama.cpp, same weights, 2 threads",
    "serving": "Serving: picaso serve vs llama-server, same weights, 2 vCPUs",
    "composition": "Composition: against the read bound and against Concat",
    "store": "Store: per-query latency by backend, filtered search",
    "training": "Training: picaso's CPU trainer vs PyTorch, 2 threads",
}
NOTES = {
    "serving": "bf16 weights and f16 decode states unless the CPU's label says otherwise",
    "composition": "left: time to compose (into a reused state) vs time to read the same bytes once; "
    "right: Concat processes the tokens, PICASO-R loads and composes stored states "
    "(mamba2-130m's bars stack load, then compose)",
}

RATIOS = {
    "engine": "×: picaso's tokens/s ÷ llama.cpp's (median of per-round ratios, or each round's)",
    "serving": "×: picaso's tokens/s ÷ llama-server's; right: picaso's time to first token ÷ llama-server's",
    "composition": "×: left, time ÷ the read's; right, Concat's time ÷ PICASO-R's",
    "training": "×: picaso's tokens/s ÷ PyTorch's in the same precision (median of per-round ratios)",
}

PICASO = ["#1f5fa8", "#4f8fd6", "#8dbbe8", "#2a9d8f", "#76c7bd", "#5e60ce", "#0b3d6e"]
PEERS = ["#e07b24", "#9a9a9a", "#c9503c", "#f0b27a"]


def is_picaso(series: str) -> bool:
    s = series.lower()
    return s.startswith("picaso") or s in ("soup", "caso") or s.startswith("folder")


def load(path: Path):
    subjects = OrderedDict()
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            panels = subjects.setdefault(r["subject"], OrderedDict())
            p = panels.setdefault(r["panel"], {"groups": OrderedDict(), "series": [], "unit": r["unit"]})
            g = p["groups"].setdefault(r["group"], {"bars": OrderedDict(), "date": r["date"], "rev": r["revision"], "ratio": ""})
            if r["series"] not in p["series"]:
                p["series"].append(r["series"])
            bar = g["bars"].setdefault(r["series"], {"parts": [], "ratio": ""})
            bar["parts"].append((float(r["low"]), float(r["high"]), r["part"]))
            bar.setdefault("text", (r["low"], r["high"]))  # labels as written in the CSV
            if r["ratio"]:
                bar["ratio"] = r["ratio"]
                g["ratio"] = r["ratio"] if not g["ratio"] else "several"
    return subjects


def fmt(text: str) -> str:
    """A figure as the CSV writes it, with thousands separated."""
    whole, dot, frac = text.partition(".")
    return f"{int(whole):,}{dot}{frac}" if len(whole) > 3 else text


def colours(series):
    out, i, j = {}, 0, 0
    for s in series:
        if is_picaso(s):
            out[s] = PICASO[i % len(PICASO)]
            i += 1
        else:
            out[s] = PEERS[j % len(PEERS)]
            j += 1
    return out


LINEAR = {"training"}  # subjects drawn on a linear axis even when one bar is far smaller


def draw_panel(ax, name, p, col, linear=False):
    groups = list(p["groups"].items())
    series = p["series"]
    highs = [sum(h for _, h, _ in b["parts"]) for _, g in groups for b in g["bars"].values()]
    lows = [min(lo for lo, _, _ in b["parts"]) for _, g in groups for b in g["bars"].values()]
    log = not linear and max(highs) / max(min(lows), 1e-9) > 40
    width = 0.8 / len(series)
    for gi, (gname, g) in enumerate(groups):
        present = [s for s in series if s in g["bars"]]
        top, lines = 0.0, 0
        for si, s in enumerate(present):
            x = gi - 0.4 + width * (si + 0.5) + width * (len(series) - len(present)) / 2
            bar = g["bars"][s]
            bottom = 0.0
            for lo, hi, part in bar["parts"]:
                ax.bar(x, lo, width * 0.92, bottom=bottom, color=col[s], edgecolor="white", linewidth=0.6)
                if hi > lo:
                    ax.bar(x, hi - lo, width * 0.92, bottom=bottom + lo, color=col[s], alpha=0.45, hatch="///", edgecolor="white", linewidth=0)
                bottom += hi
            top = max(top, bottom)
            label = ""
            if len(bar["parts"]) == 1:  # a stacked bar's total is not a measured figure: no label
                lo, hi = bar["text"]
                label = fmt(lo) if lo == hi else f"{fmt(lo)}–\n{fmt(hi)}"
                lines = max(lines, label.count("\n") + 1)
            if g["ratio"] == "several" and bar["ratio"]:  # each bar its own ratio
                label = (label + "\n" if label else "") + bar["ratio"]
            if label:
                ax.annotate(label, (x, bottom), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6.5, linespacing=0.95)
        if g["ratio"] and g["ratio"] != "several":
            ax.annotate(g["ratio"], (gi, top), xytext=(0, 4 + 8 * lines), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8.5, fontweight="bold", color="#1f3f6a")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(
        [textwrap.fill(n, 18) + f"\n{g['date']}" + (f"\n{g['rev']}" if g["rev"] != g["date"] else "") for n, g in groups],
        fontsize=7, rotation=0,
    )
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylabel(p["unit"] + (" (log scale)" if log else ""), fontsize=8)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(lows) / 2, max(highs) * 12)
    else:
        ax.set_ylim(0, max(highs) * 1.3)
    ax.set_title(name, fontsize=9.5)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def plot_subject(subject, panels, out: Path):
    names = list(panels)
    sizes = [len(p["groups"]) * max(1, len(p["series"]) / 2) for p in panels.values()]
    if len(names) <= 2:  # one row, each panel as wide as its groups need
        nrows, ncols = 1, len(names)
        ratios = [max(s, 2.5) for s in sizes]
        fig, axes = plt.subplots(1, ncols, figsize=(max(10.5, 1.3 * sum(ratios) + 1.5), 5.0), squeeze=False,
                                 gridspec_kw={"width_ratios": ratios})
    else:
        ncols = 2
        nrows = (len(names) + 1) // 2
        fig, axes = plt.subplots(nrows, ncols, figsize=(1.35 * max(sizes) * ncols + 1.5, 4.4 * nrows + 0.6), squeeze=False)
    all_series = []
    for p in panels.values():
        all_series += [s for s in p["series"] if s not in all_series]
    col = colours(all_series)
    for ax, name in zip(axes.flat, names):
        draw_panel(ax, name, panels[name], col, linear=subject in LINEAR)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles = [Patch(color=col[s], label=s) for s in all_series]
    ranged = any(hi > lo for p in panels.values() for g in p["groups"].values() for b in g["bars"].values() for lo, hi, _ in b["parts"])
    if ranged:
        handles.append(Patch(facecolor="#bbbbbb", hatch="///", edgecolor="white", label="hatched: range over the run's rounds"))
    if subject in RATIOS:
        handles.append(Patch(color="none", label=RATIOS[subject]))
    ncol = 3 if fig.get_figwidth() < 12 else 4
    fig.legend(handles=handles, loc="lower center", ncol=min(ncol, len(handles)), fontsize=8, frameon=False)
    fig.suptitle(TITLES.get(subject, subject), fontsize=12, fontweight="bold")
    if subject in NOTES:
        fig.text(0.5, 0.91, textwrap.fill(NOTES[subject], 120), ha="center", va="top", fontsize=8, style="italic")
    legend_rows = (len(handles) + ncol - 1) // ncol
    fig.tight_layout(rect=(0, 0.045 * legend_rows + 0.02, 1, 0.86 if subject in NOTES else 0.92))
    path = out / f"{subject}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", type=Path, default=ROOT / "docs/benchmarks/summary.csv")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks")
    args = ap.parse_args()
    for subject, panels in load(args.csv).items():
        print(plot_subject(subject, panels, args.out))


if __name__ == "__main__":
    main()
