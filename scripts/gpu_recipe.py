#!/usr/bin/env python3
"""Chooses the bundled model's recipe by short ablations on one GPU, then trains it.

Every arm is the base run with one change, trained side by side (one process each, same tokens,
same seed, same schedule, gradient accumulation so that all fit in the GPU's memory); each
ends with the validation loss and context use on the held-out paragraph pairs. The final run
is the base with every change that raised context use by at least `--min-gain` points without
costing more than `--max-val-loss` nats of validation loss, within the parameter budget; it is
sized to `--final-minutes` and checkpoints as it goes, then exports its weights.

    python3 scripts/gpu_recipe.py --base models/training/picaso-mamba2-v3.json \\
        --train train-a.u16.xz train-b.u16.xz --arm-train train-a.u16.xz --val val.u16.xz \\
        --pairs pairs.json.xz --work WORK --steps 500 --final-minutes 15

    # in-context pretraining and the learning rate against the base, on the same tokens:
    python3 scripts/pack_neighbours.py --train train-a.u16.xz --order-out order-a.npz
    cat train-a.u16 train-b.u16 > train.u16    # the final run's order is over both halves
    python3 scripts/pack_neighbours.py --train train.u16 --order-out order-full.npz
    python3 scripts/gpu_recipe.py ... --arm-order order-a.npz --final-order order-full.npz \\
        --arms base neighbours "lr x2" "lr /2"

Writes WORK/ablation.json (one row per arm), WORK/final.json (the chosen run), WORK/final/
(the run: checkpoint.pt, train.log) and WORK/export/ (config.json, model.safetensors,
train-log.jsonl).
"""
import argparse
import json
import lzma
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> change to the base run; each is one ingredient of the recipe list. "data":
# "neighbours" trains on the arms' tokens reordered by --arm-order (scripts/pack_neighbours.py:
# related passages follow each other). `--arms` picks some of them.
ARMS = {
    "base": {},
    "d_state 128": {"d_state": 128},
    "headdim 32": {"headdim": 32},
    "4 groups": {"n_groups": 4},
    "12 layers": {"n_layer": 12},
    "neighbours": {"data": "neighbours"},
    "lr x2": {"lr_scale": 2.0},
    "lr /2": {"lr_scale": 0.5},
    "lr x4": {"lr_scale": 4.0},
    # hybrid runs ("arch": "granite_hybrid"): which layers attend, and their heads
    "no attention": {"attention": []},
    "1 attention, middle": {"attention": [4]},
    "1 attention, late": {"attention": [6]},
    "2 attention": {"attention": [2, 6]},
    "4 attention": {"attention": [1, 3, 5, 7]},
    "4 heads of 128": {"attn_heads": 4, "kv_heads": 2, "attn_head_dim": 128},
    "8 kv heads": {"kv_heads": 8},
}
# The arms that change the architecture: a warm start (--init) cannot take them.
SHAPE = {"d_state", "headdim", "n_groups", "n_layer", "d_model", "vocab", "attention", "attn_heads", "kv_heads",
         "attn_head_dim", "mlp"}


def applied(run, change):
    """`run` with an arm's `change`: `lr_scale` multiplies the peak and final learning rates,
    `data` is not part of the run file, the rest replace the run's values."""
    out = dict(run)
    for k, v in change.items():
        if k == "lr_scale":
            out["lr"], out["min_lr"] = run["lr"] * v, run["min_lr"] * v
        elif k != "data":
            out[k] = v
    return out


def params(run):
    """Parameter count of the run's model (train_gpu.model_params)."""
    from train_gpu import model_params

    return model_params(run)


def unpack(path, out):
    """`path` (.xz allowed) as a plain file `out`, once."""
    if not os.path.exists(out):
        data = lzma.open(path).read() if path.endswith(".xz") else open(path, "rb").read()
        with open(out + ".tmp", "wb") as f:
            f.write(data)
        os.replace(out + ".tmp", out)
    return out


def packed_stream(streams, order, work, name):
    """The u16 `streams`, concatenated, with their runs in `order` (pack_neighbours.py), as a file."""
    import numpy as np

    from pack_neighbours import packed

    out = os.path.join(work, f"train-{name}-neighbours.u16")
    if not os.path.exists(out):
        ids = np.concatenate([np.fromfile(p, dtype="<u2") for p in streams])
        packed(ids, order).astype("<u2").tofile(out + ".tmp")
        os.replace(out + ".tmp", out)
    return out


def train(config, out, data, extra, log):
    """One train_gpu.py process on `data`'s streams, its output appended to `log`."""
    cmd = [sys.executable, os.path.join(HERE, "train_gpu.py"), "--config", config, "--out", out,
           "--train", *data["train"], "--val", data["val"], "--pairs", data["pairs"], *extra]
    if data.get("init"):
        cmd += ["--init", data["init"]]
    return subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def records(out_log):
    """A run's validation records (those with context use)."""
    recs = [json.loads(line) for line in open(out_log) if line.startswith("{")]
    return [r for r in recs if "val_loss" in r and "context_use" in r]


def rate(out_log):
    """A run's training speed at its last progress record (tokens/s), None before the first."""
    recs = [json.loads(line) for line in open(out_log) if line.startswith("{")]
    speeds = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r]
    return speeds[-1] if speeds else None


def last_record(out_log):
    return records(out_log)[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the base run (picaso's pretrain JSON)")
    ap.add_argument("--train", nargs="+", required=True, help="the final run's training streams (u16, .xz allowed)")
    ap.add_argument("--arm-train", nargs="+", required=True, help="the arms' training streams")
    ap.add_argument("--arm-order", help="pack_neighbours.py's order (.npz) over the arms' streams")
    ap.add_argument("--final-order", help="its order over the final run's streams, if the neighbours arm is kept")
    ap.add_argument("--arms", nargs="+", default=[a for a in ARMS if a != "neighbours"], choices=list(ARMS),
                    help="the arms to run (base always runs)")
    ap.add_argument("--val", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=500, help="each arm's steps (its whole schedule)")
    ap.add_argument("--accum", type=int, default=4, help="the arms' micro-batches per step")
    ap.add_argument("--min-gain", type=float, default=0.1, help="points of context gain an arm must add")
    ap.add_argument("--max-val-loss", type=float, default=0.03, help="validation loss an arm may cost")
    ap.add_argument("--max-params", type=float, default=24.5e6, help="bf16 weights <= 48 MiB")
    ap.add_argument("--final-minutes", type=float, default=15)
    ap.add_argument("--arm-minutes", type=float, help="stop an arm after this long (it still validates); the "
                                                       "arms are compared at the last step all of them validated")
    ap.add_argument("--arm-val-every", type=int, help="steps between an arm's validations (default: half its steps)")
    ap.add_argument("--choose", choices=["each", "best"], default="each",
                    help="each: the base with every arm's change that helps (changes that compose); "
                         "best: the one arm that reads its context best within --max-val-loss of the best "
                         "validation loss (alternatives, such as where a hybrid's attention layers go)")
    ap.add_argument("--continue-best", action="store_true",
                    help="the arms hold their peak learning rate (warmup-stable-decay), and the final run "
                         "continues the chosen arm's checkpoint for --final-minutes, decaying over the last "
                         "`decay_frac` (0.2) of its steps; needs --choose best")
    ap.add_argument("--skip-arms", action="store_true", help="reuse WORK/ablation.json")
    ap.add_argument("--arms-only", action="store_true", help="stop after the arms' table (no final run)")
    ap.add_argument("--init", help="warm start: every arm and the final run continue this model's training "
                                   "(its folder; --base must have its shape and a smaller learning rate)")
    a = ap.parse_args()
    if a.continue_best and a.choose != "best":
        ap.error("--continue-best continues one arm: give --choose best")
    if a.init:
        shaped = [n for n in a.arms if SHAPE & set(ARMS[n])]
        if shaped:
            ap.error(f"--init continues one model's training: the arms {shaped} change its shape")
    os.makedirs(a.work, exist_ok=True)
    plain = lambda p: unpack(p, os.path.join(a.work, os.path.basename(p).removesuffix(".xz")))
    data = {"val": plain(a.val), "pairs": plain(a.pairs), "init": a.init}
    base = json.load(open(a.base))

    table = os.path.join(a.work, "ablation.json")
    if "neighbours" in a.arms and not a.arm_order:
        ap.error("the neighbours arm needs --arm-order")
    if not a.skip_arms:
        arm_data = {**data, "train": [plain(p) for p in a.arm_train]}
        if "neighbours" in a.arms:
            nb_data = {**data, "train": [packed_stream(arm_data["train"], a.arm_order, a.work, "arms")]}
        procs = {}
        for name in ["base"] + [n for n in a.arms if n != "base"]:
            run = {**applied(base, ARMS[name]), "steps": a.steps, "accum": a.accum,
                   "warmup": base["warmup"] if a.continue_best else a.steps // 10,
                   "val_every": a.arm_val_every or a.steps // 2}
            if a.continue_best:  # the stable phase: the final run decays
                run["decay_start"] = 10**9
            folder = os.path.join(a.work, "arm-" + name.replace(" ", "-").replace("/", "div"))
            os.makedirs(folder, exist_ok=True)
            json.dump(run, open(folder + ".json", "w"))
            arm = nb_data if ARMS[name].get("data") == "neighbours" else arm_data
            extra = ["--minutes", str(a.arm_minutes)] if a.arm_minutes else []
            procs[name] = (train(folder + ".json", folder, arm, extra, folder + ".log"), folder, run)
            print(f"arm {name!r}: {params(run):,} parameters", flush=True)
        rows, done = [], {}
        for name, (p, folder, run) in procs.items():
            rc = p.wait()
            if rc != 0:
                print(f"arm {name!r} failed ({rc}); see {folder}.log", flush=True)
                continue
            done[name] = {x["step"] for x in records(folder + ".log")}
        # the last step at which every arm validated (all the same when none was stopped early)
        common_step = max(set.intersection(*done.values()), default=None) if done else None
        if common_step:
            print(f"arms compared at step {common_step}", flush=True)
        for name, (p, folder, run) in procs.items():
            if name not in done:
                continue
            r = last_record(folder + ".log")
            if common_step:  # the arms compared at one step (those stopped by --arm-minutes differ)
                r = [x for x in records(folder + ".log") if x["step"] == common_step][0]
            rows.append(dict(arm=name, change=ARMS[name], params=params(run), steps=r["step"], folder=folder,
                             tokens=r["tokens"], val_loss=r["val_loss"], tokens_per_s=rate(folder + ".log"),
                             **{k: r["context_use"][k] for k in ("none", "previous", "random", "gain", "random_gain")},
                             history=[json.loads(line) for line in open(folder + ".log")
                                      if line.startswith("{") and "val_loss" in line]))
            print(f"{name:>12}: val {r['val_loss']:.4f} · previous {100 * r['context_use']['gain']:+.2f}% · "
                  f"random {100 * r['context_use']['random_gain']:+.2f}% · {rows[-1]['tokens_per_s'] or 0:,.0f} tokens/s", flush=True)
        json.dump(rows, open(table, "w"), indent=1)
    if a.arms_only:
        return
    rows = {r["arm"]: r for r in json.load(open(table))}

    final, neighbours, start = dict(base), False, []
    if a.choose == "best":
        best_val = min(r["val_loss"] for r in rows.values())
        fit = [r for r in rows.values()
               if r["val_loss"] - best_val <= a.max_val_loss and params(applied(base, r["change"])) <= a.max_params]
        if not fit:
            sys.exit("no arm is within --max-val-loss of the best validation loss and --max-params")
        pick = max(fit, key=lambda r: r["gain"])
        final = applied(base, pick["change"])
        neighbours = pick["change"].get("data") == "neighbours"
        print(f"chosen: {pick['arm']} (previous paragraph {100 * pick['gain']:+.2f}%, val {pick['val_loss']:.4f})", flush=True)
        if a.continue_best:
            final["decay_frac"] = base.get("decay_frac", 0.2)
            start = ["--continue-from", pick["folder"]]
    else:
        ref = rows["base"]
        for name, r in rows.items():
            if name == "base":
                continue
            helps = 100 * (r["gain"] - ref["gain"]) >= a.min_gain and r["val_loss"] - ref["val_loss"] <= a.max_val_loss
            if helps and params(applied(final, r["change"])) <= a.max_params:
                final = applied(final, r["change"])
                neighbours |= r["change"].get("data") == "neighbours"
                print(f"kept: {name}", flush=True)
    final.update(val_every=1000, checkpoint_every=500, accum=1)
    json.dump(final, open(os.path.join(a.work, "final.json"), "w"))
    print(f"final run: {json.dumps(final)} ({params(final):,} parameters)", flush=True)
    if neighbours and not a.final_order:
        sys.exit("the neighbours arm was kept: give the final run's order (--final-order)")
    while not all(os.path.exists(p) for p in a.train):  # the last streams may still be on their way
        time.sleep(5)
    data["train"] = [plain(p) for p in a.train]
    if neighbours:
        data["train"] = [packed_stream(data["train"], a.final_order, a.work, "final")]
    out = os.path.join(a.work, "final")
    p = train(os.path.join(a.work, "final.json"), out, data,
              start + ["--plan-minutes", str(a.final_minutes), "--minutes", str(a.final_minutes + 0.5),
               "--export", os.path.join(a.work, "export")], os.path.join(a.work, "final.log"))
    sys.exit(p.wait())


if __name__ == "__main__":
    main()
