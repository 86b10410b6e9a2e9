#!/usr/bin/env python3
"""Plot results/finetune-lr-ablation from its committed logs.

Reads each run's `finetune.csv` (`lr0`, the zero-shot model, and one folder per peak learning
rate: step, k, seconds, step_seconds, lr, grad_norm, train_loss, val_loss) and draws
`results/finetune-lr-ablation/lr_ablation.png`: left, the validation loss (PICASO-R at k = 10 on
the held-out articles) at each validation step, beside the zero-shot model's; right, the
training loss per step, as a moving average over 10 steps (each step draws its own k, so single
steps are noisy), with the learning rate schedule below it.

    /work/plotvenv/bin/python scripts/plot_finetune_lr_ablation.py [--dir results/finetune-lr-ablation]
"""

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COLOURS = {"3e-4": "#c9503c", "1e-4": "#1f5fa8", "3e-5": "#2a9d8f"}
WINDOW = 10


def read(path: Path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def moving_average(xs, n):
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - n + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "results/finetune-lr-ablation")
    args = ap.parse_args()
    zero = [float(r["val_loss"]) for r in read(args.dir / "lr0/finetune.csv") if r["val_loss"]]
    runs = {}
    for d in sorted(args.dir.glob("lr*")):
        if d.name == "lr0" or not (d / "finetune.csv").is_file():
            continue
        runs[d.name[2:]] = read(d / "finetune.csv")
    order = [lr for lr in ("3e-4", "1e-4", "3e-5") if lr in runs] + [lr for lr in runs if lr not in COLOURS]

    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(12, 4.8))
    ax_val.axhline(zero[0], color="#555555", linestyle="--", linewidth=1.2, label=f"zero-shot ({zero[0]:.4f})")
    for lr in order:
        rows = [r for r in runs[lr] if r["val_loss"]]
        steps = [0] + [int(r["step"]) for r in rows]
        vals = [zero[0]] + [float(r["val_loss"]) for r in rows]
        change = 100 * (vals[-1] - zero[0]) / zero[0]
        ax_val.plot(steps, vals, marker="o", color=COLOURS.get(lr), label=f"peak lr {lr}: {vals[-1]:.4f} at step {steps[-1]} ({change:+.2f}%)")
        for s, v in zip(steps[1:], vals[1:]):
            ax_val.annotate(f"{v:.4f}", (s, v), xytext=(4, 4), textcoords="offset points", fontsize=7, color=COLOURS.get(lr))
    ax_val.set_xlabel("step (8 passages each)")
    ax_val.set_ylabel("validation loss, nats/token (PICASO-R, k = 10)")
    ax_val.set_title("Validation on held-out articles (50 passages)", fontsize=10)
    ax_val.set_xticks([0, 20, 40, 60])
    ax_val.grid(alpha=0.3)
    ax_val.legend(fontsize=8, loc="lower left")

    for lr in order:
        steps = [int(r["step"]) for r in runs[lr]]
        loss = [float(r["train_loss"]) for r in runs[lr]]
        ax_train.plot(steps, loss, color=COLOURS.get(lr), alpha=0.2, linewidth=0.8)
        ax_train.plot(steps, moving_average(loss, WINDOW), color=COLOURS.get(lr), linewidth=1.8, label=f"peak lr {lr}")
    ax_train.set_xlabel("step")
    ax_train.set_ylabel("training loss, nats/token")
    ax_train.set_title(f"Training loss (k drawn from 0..10 per step)\nthin: each step; thick: mean of the last {WINDOW} steps", fontsize=10)
    ax_train.grid(alpha=0.3)
    ax_train.legend(fontsize=8, loc="upper left")
    inset = ax_train.inset_axes([0.62, 0.08, 0.35, 0.28])
    for lr in order:
        inset.plot([int(r["step"]) for r in runs[lr]], [float(r["lr"]) for r in runs[lr]], color=COLOURS.get(lr))
    inset.set_yscale("log")
    inset.set_title("learning rate", fontsize=7)
    inset.tick_params(labelsize=6)

    fig.suptitle("BP2C fine-tuning learning rate: 60 steps of 8 passages, bundled model", fontsize=12, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    out = args.dir / "lr_ablation.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
