#!/usr/bin/env python3
"""Pretrains the bundled Mamba-2 on a GPU with PyTorch (how models/picaso-mamba2 was made).

picaso's own trainer (`picaso train pretrain`, CPU) is the reference; this script trains the same
architecture with the same recipe (init, AdamW, schedule, epoch sampler) where a GPU is at hand.
Its model is transformers' `Mamba2ForCausalLM` re-written around a chunked SSD scan of O(T *
chunk) memory (transformers' own reference path needs O(T * chunk * d_state) and runs out of
memory at batch 32 on an 80 GB GPU); `--check` compares the two on the CPU. The weights it
exports are in transformers' layout, which every picaso engine loads (f32 or bf16).

Tokens come from picaso's own token cache, so the text, tokenizer and held-out split are exactly
the CPU trainer's:

    picaso train pretrain --config models/training/picaso-mamba2-v2.json --out RUN \
        --corpus wikipedia:../shared/data/wikipedia-en/articles.txt.gz \
        --tokenizer models/picaso-mamba2/tokenizer.json --stop-after 0
    python3 scripts/train_gpu.py --config models/training/picaso-mamba2-v3.json \
        --tokens RUN/tokens.bin --out GPU_RUN --export MODEL_DIR

`--train/--val/--pairs` take the same streams as raw little-endian u16 files (`.xz` allowed),
which is how they travel to a machine without the corpus. The run checkpoints to
OUT/checkpoint.pt when its time budget (`--minutes`) is spent and resumes from there. `--init
MODEL_DIR` starts it from a trained model's weights (a warm start: the optimiser's moments and
the schedule start afresh, so give the run a smaller peak learning rate).
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


def read_u16(path):
    """A raw u16 stream (`gpu_streams.read_u16`), ids widened for torch's indexing."""
    from gpu_streams import read_u16 as read

    return read(path).astype(np.int64)


def read_token_cache(path):
    """picaso's OUT/tokens.bin (`gpu_streams.read_cache`), ids widened for torch's indexing."""
    from gpu_streams import read_cache

    train, val, pairs = read_cache(path)
    return train.astype(np.int64), val.astype(np.int64), pairs


def segsum(x):
    """exp(segsum(x))[..., i, j] = prod_{j < k <= i} exp(x_k): the decay from j to i (0 above the diagonal)."""
    T = x.shape[-1]
    x = x[..., None].expand(*x.shape, T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), -1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), 0), -torch.inf)


def ssd(x, a, b, c, chunk):
    """Chunked state-space duality scan (Dao & Gu 2024), memory O(T * chunk) rather than the
    O(T * chunk * d_state) of transformers' reference path. x: (B, T, H, P) already scaled by dt,
    a: (B, T, H) = dt * A, b and c: (B, T, N) for one group shared by every head, or
    (B, T, H, N) per head (groups expanded). Returns y: (B, T, H, P)."""
    Bsz, T, H, P = x.shape
    k = T // chunk
    x, a, b, c = (t.reshape(Bsz, k, chunk, *t.shape[2:]) for t in (x, a, b, c))
    a = a.permute(0, 3, 1, 2)  # (B, H, k, l)
    a_cum = torch.cumsum(a, dim=-1)
    decay = torch.exp(segsum(a))  # (B, H, k, l, s)
    h = "" if b.dim() == 4 else "h"  # b, c: (B, k, l, N) or (B, k, l, H, N)
    g = torch.einsum(f"bkl{h}n,bks{h}n->b{h}kls", c, b)
    y = torch.einsum(f"b{h}kls,bhkls,bkshp->bklhp", g, decay, x)
    states = torch.einsum(f"bkl{h}n,bhkl,bklhp->bkhpn", b, torch.exp(a_cum[..., -1:] - a_cum), x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # (B, H, k+1, k+1)
    states = torch.einsum("bhzk,bkhpn->bzhpn", chunk_decay, states)[:, :-1]
    y = y + torch.einsum(f"bkl{h}n,bkhpn,bhkl->bklhp", c, states, torch.exp(a_cum))
    return y.reshape(Bsz, T, H, P)


def wide(dtype):
    """The accumulation dtype: f32 for bf16/f32 activations, f64 when checking in f64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(torch.nn.Module):
    """RMS norm, optionally gated and over `groups` equal parts of the last axis (the mixer's
    gated norm normalises each group of heads on its own, as transformers and mamba_ssm do)."""

    def __init__(self, d, eps=1e-5, groups=1):
        super().__init__()
        self.weight, self.eps, self.groups = torch.nn.Parameter(torch.ones(d)), eps, groups

    def forward(self, h, gate=None):
        dtype = h.dtype
        h = h.to(wide(dtype))
        if gate is not None:
            h = h * F.silu(gate.to(h.dtype))
        g = h.reshape(*h.shape[:-1], self.groups, -1)
        h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(h.shape)
        return self.weight * h.to(dtype)


class Mixer(torch.nn.Module):
    """One Mamba-2 mixer, parameters named as transformers' `Mamba2Mixer` (one group, no biases
    but the conv's, gated norm after the gate)."""

    def __init__(self, d_model, d_state, headdim, chunk, n_groups=1):
        super().__init__()
        self.intermediate_size, self.ssm_state_size, self.n_groups = 2 * d_model, d_state, n_groups
        self.num_heads, self.head_dim, self.chunk = 2 * d_model // headdim, headdim, chunk
        gn = n_groups * d_state
        di, conv_dim = self.intermediate_size, 2 * d_model + 2 * gn
        self.in_proj = torch.nn.Linear(d_model, 2 * di + 2 * gn + self.num_heads, bias=False)
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, 4, groups=conv_dim, padding=3)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.num_heads))
        self.A_log = torch.nn.Parameter(torch.zeros(self.num_heads))
        self.D = torch.nn.Parameter(torch.ones(self.num_heads))
        self.norm = RMSNorm(di, groups=n_groups)
        self.out_proj = torch.nn.Linear(di, d_model, bias=False)

    def forward(self, h):
        Bsz, T, _ = h.shape
        di, n, H, G = self.intermediate_size, self.ssm_state_size, self.num_heads, self.n_groups
        z, xbc, dt = self.in_proj(h).split([di, di + 2 * G * n, H], dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :T].transpose(1, 2))
        x, b, c = xbc.split([di, G * n, G * n], dim=-1)
        if G > 1:  # head j reads group j // (H / G)
            b, c = (t.reshape(Bsz, T, G, n).repeat_interleave(H // G, dim=2) for t in (b, c))
        acc = wide(x.dtype)
        dt = F.softplus(dt.to(acc) + self.dt_bias)
        a = -torch.exp(self.A_log.to(acc))
        x = x.to(acc).reshape(Bsz, T, H, self.head_dim)
        pad = (-T) % self.chunk
        with torch.autocast(h.device.type, enabled=False):
            xs, av, bs, cs = x * dt[..., None], dt * a, b.to(acc), c.to(acc)
            if pad:
                xs, av, bs, cs = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (xs, av, bs, cs))
            y = ssd(xs, av, bs, cs, self.chunk)[:, :T]
        y = (y + x * self.D[:, None]).reshape(Bsz, T, di)
        return self.out_proj(self.norm(y, z).to(h.dtype))


class Block(torch.nn.Module):
    def __init__(self, *args):
        super().__init__()
        self.norm, self.mixer = RMSNorm(args[0]), Mixer(*args)

    def forward(self, h):
        return h.to(wide(h.dtype)) + self.mixer(self.norm(h))


class Backbone(torch.nn.Module):
    def __init__(self, run):
        super().__init__()
        d = run["d_model"]
        self.embeddings = torch.nn.Embedding(run["vocab"], d)
        self.layers = torch.nn.ModuleList(
            [Block(d, run["d_state"], run["headdim"], run.get("chunk", 128), run.get("n_groups", 1))
             for _ in range(run["n_layer"])])
        self.norm_f = RMSNorm(d)


class Mamba2LM(torch.nn.Module):
    """Mamba-2 language model with transformers' `Mamba2ForCausalLM` parameter names and tied
    head; the forward is equal to it (checked on CPU in f32, see --check)."""

    def __init__(self, run):
        super().__init__()
        self.backbone = Backbone(run)

    def forward(self, input_ids):
        h = self.backbone.embeddings(input_ids)
        for layer in self.backbone.layers:
            h = layer(h)
        h = self.backbone.norm_f(h)
        return h.to(self.backbone.embeddings.weight.dtype) @ self.backbone.embeddings.weight.T


def hf_config(run):
    from transformers import Mamba2Config

    d, hd = run["d_model"], run["headdim"]
    return Mamba2Config(
        vocab_size=run["vocab"], hidden_size=d, num_hidden_layers=run["n_layer"], state_size=run["d_state"],
        head_dim=hd, num_heads=2 * d // hd, expand=2, n_groups=run.get("n_groups", 1), conv_kernel=4, use_bias=False,
        use_conv_bias=True, rms_norm=True, norm_before_gate=False, residual_in_fp32=True,
        tie_word_embeddings=True, layer_norm_epsilon=1e-5, time_step_limit=(0.0, float("inf")),
        chunk_size=run.get("chunk", 256),
    )


@torch.no_grad()
def init_mixer(m, run, g, out_std):
    """One Mamba-2 mixer as picaso's `init_weights_with` (crates/train/src/pretrain.rs), drawn in
    its order: in_proj normal(0, 0.02), out_proj normal(0, out_std), conv N(0, 1/d_conv), dt
    log-uniform in [1e-3, 1e-1], A in U(1, 16); `long_memory` of the heads get dt in [1e-4, 1e-3]
    and A in U(0.5, 1); `mimetic` copies B's rows of in_proj to C's."""
    init = run.get("init", {})
    m.in_proj.weight.copy_(torch.randn(m.in_proj.weight.shape, generator=g) * 0.02)
    m.out_proj.weight.copy_(torch.randn(m.out_proj.weight.shape, generator=g) * out_std)
    m.conv1d.weight.copy_(torch.randn(m.conv1d.weight.shape, generator=g) / math.sqrt(m.conv1d.weight.shape[-1]))
    m.conv1d.bias.zero_()
    m.norm.weight.fill_(1.0)
    m.D.fill_(1.0)
    h = m.num_heads
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(lo + torch.rand(h, generator=g, dtype=torch.float64) * (hi - lo))
    a = 1.0 + 15.0 * torch.rand(h, generator=g, dtype=torch.float64)
    long = min(h, round(init.get("long_memory", 0.0) * h))
    if long:
        lo, hi = math.log(1e-4), math.log(1e-3)
        dt[:long] = torch.exp(lo + torch.rand(long, generator=g, dtype=torch.float64) * (hi - lo))
        a[:long] = 0.5 + 0.5 * torch.rand(long, generator=g, dtype=torch.float64)
    m.dt_bias.copy_(torch.log(torch.expm1(dt)))  # softplus^-1
    m.A_log.copy_(torch.log(a))
    if init.get("mimetic", False):
        di, gn = m.intermediate_size, m.n_groups * m.ssm_state_size
        b0, c0 = 2 * di, 2 * di + gn
        m.in_proj.weight[c0 : c0 + gn] = m.in_proj.weight[b0 : b0 + gn]


@torch.no_grad()
def init_weights(model, run, seed):
    """picaso's `init_weights_with` in torch: normal(0, 0.02) embedding, each mixer as
    `init_mixer` with out_proj scaled by 1/sqrt(2 n_layer). A hybrid: `hybrid_lm.init_weights`."""
    g = torch.Generator().manual_seed(seed)
    if is_hybrid(run):
        from hybrid_lm import init_weights as init_hybrid

        return init_hybrid(model, run, g, init_mixer)
    L = run["n_layer"]
    model.backbone.embeddings.weight.copy_(torch.randn(model.backbone.embeddings.weight.shape, generator=g) * 0.02)
    for layer in model.backbone.layers:
        init_mixer(layer.mixer, run, g, 0.02 / math.sqrt(2 * L))
        layer.norm.weight.fill_(1.0)
    model.backbone.norm_f.weight.fill_(1.0)


def is_hybrid(run):
    return run.get("arch", "mamba2") == "granite_hybrid"


def make_model(run):
    """The run's model: transformers' `Mamba2ForCausalLM` or, with `"arch": "granite_hybrid"`,
    `GraniteMoeHybridForCausalLM` (scripts/hybrid_lm.py)."""
    if is_hybrid(run):
        from hybrid_lm import HybridLM

        return HybridLM(run)
    return Mamba2LM(run)


def model_params(run):
    """Parameter count of the run's model (tied embeddings)."""
    if is_hybrid(run):
        from hybrid_lm import params

        return params(run)
    d, n, g, L, v = run["d_model"], run["d_state"], run.get("n_groups", 1), run["n_layer"], run["vocab"]
    di, h = 2 * d, 2 * d // run["headdim"]
    conv = di + 2 * g * n
    layer = d * (2 * di + 2 * g * n + h) + conv * 4 + conv + 3 * h + di + di * d + d
    return v * d + L * layer + d


@torch.no_grad()
def check_against_transformers(run, seed=0):
    """Loads one random model into both this script's `Mamba2LM` and transformers'
    `Mamba2ForCausalLM` and compares their logits on the CPU in f64 (transformers rounds A and dt to f32) (a length that is not a
    multiple of the chunk included)."""
    if is_hybrid(run):
        from hybrid_lm import check_against_transformers as check_hybrid

        return check_hybrid(run, init_mixer, seed)
    from transformers import Mamba2ForCausalLM

    ours = Mamba2LM(run).double()
    init_weights(ours, run, seed)
    ref = Mamba2ForCausalLM(hf_config(run)).double()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    x = torch.randint(0, run["vocab"], (2, run.get("chunk", 128) + 37), generator=torch.Generator().manual_seed(seed))
    a, b = ours(x), ref(input_ids=x, use_cache=False).logits
    err = (a - b).abs().max().item()
    print(f"max |logit difference| against transformers: {err:.3e}", flush=True)
    assert err < 1e-5, err  # transformers computes A and dt in f32 even in an f64 model


def lr_at(run, step):
    """Linear warmup, then cosine decay to `min_lr` at the last step; with `decay_start` the rate
    holds at its peak until that step and the cosine runs from there (warmup-stable-decay: a run
    stopped before its decay can be continued and still end on a full decay)."""
    peak, floor, warm, total = run["lr"], run["min_lr"], run["warmup"], run["steps"]
    if step < warm:
        return peak * (step + 1) / warm
    start = max(warm, run.get("decay_start", warm))
    if step < start:
        return peak
    t = min(1.0, (step - start) / max(1, total - start))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))


def batch_at(train, run, step, cache={}):
    """The epoch sampler: every seq_len window once per epoch, shuffled by (seed, epoch)."""
    seq, bsz = run["seq_len"], run["batch"]
    windows = (len(train) - 1) // seq
    rows = []
    for i in range(bsz):
        gidx = step * bsz + i
        epoch, pos = divmod(gidx, windows)
        if cache.get("epoch") != epoch:
            cache["epoch"], cache["order"] = epoch, np.random.default_rng([run["seed"], epoch]).permutation(windows)
        o = int(cache["order"][pos]) * seq
        rows.append(train[o : o + seq + 1])
    xy = torch.from_numpy(np.stack(rows))
    return xy[:, :-1], xy[:, 1:]


def token_losses(model, x, y):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none",
                           ignore_index=-100).view(y.shape)


@torch.no_grad()
def validate(model, val, run, dev, n=64):
    seq = run["seq_len"]
    starts = np.linspace(0, len(val) - seq - 2, n).astype(np.int64)
    xy = torch.from_numpy(np.stack([val[s : s + seq + 1] for s in starts])).to(dev)
    total = 0.0
    for i in range(0, n, 16):
        total += token_losses(model, xy[i : i + 16, :-1], xy[i : i + 16, 1:]).mean().item() * len(xy[i : i + 16])
    return total / n


@torch.no_grad()
def context_use(model, pairs, dev):
    """Mean continuation loss with nothing, the true previous paragraph, or a paragraph of
    another document before the query (picaso's `pretrain::context_use`)."""
    seqs = []
    for p in pairs:
        for before in ([], p["previous"], p["random"]):
            t = before + p["query"] + p["continuation"]
            seqs.append((t, len(before) + len(p["query"])))
    means = []
    for i in range(0, len(seqs), 48):
        group = seqs[i : i + 48]
        T = max(len(t) for t, _ in group) - 1
        x = torch.zeros(len(group), T, dtype=torch.long)
        y = torch.full((len(group), T), -100, dtype=torch.long)
        for r, (t, first) in enumerate(group):
            n = len(t) - 1
            x[r, :n] = torch.tensor(t[:-1])
            y[r, first - 1 : n] = torch.tensor(t[first:])
        losses = token_losses(model, x.to(dev), y.to(dev))
        mask = (y != -100).to(dev)
        means += ((losses * mask).sum(1) / mask.sum(1)).tolist()
    none, prev, rand = (float(np.mean(means[k::3])) for k in range(3))
    return dict(none=none, previous=prev, random=rand, gain=(none - prev) / none, random_gain=(none - rand) / none)


@torch.no_grad()
def load_weights(model, run, folder):
    """A model folder's weights (transformers' layout, as `export` writes them; bf16 is widened)
    into `model`, refusing one of another shape: a warm start continues that model's training."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(folder, "config.json")))
    if is_hybrid(run):
        from hybrid_lm import config as hybrid_config

        want = {k: v for k, v in hybrid_config(run).items() if isinstance(v, (int, str, list)) and k != "time_step_limit"}
    else:
        want = {"hidden_size": run["d_model"], "num_hidden_layers": run["n_layer"], "state_size": run["d_state"],
                "head_dim": run["headdim"], "vocab_size": run["vocab"], "n_groups": run.get("n_groups", 1)}
    other = {k: (cfg.get(k), v) for k, v in want.items() if cfg.get(k) != v}
    if other:
        sys.exit(f"--init {folder}: its config differs from the run's (theirs, ours): {other}")
    sd = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items() if k != "lm_head.weight"}
    mine = {k for k in model.state_dict() if k != "lm_head.weight"}
    if set(sd) != mine:
        sys.exit(f"--init {folder}: tensors missing {sorted(mine - set(sd))[:4]}, unexpected {sorted(set(sd) - mine)[:4]}")
    model.load_state_dict(sd, strict=False)


def export(model, run, out, dtype, history):
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    sd = {k: v.detach().to(dt).contiguous().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    d, hd = run["d_model"], run["headdim"]
    if is_hybrid(run):
        from hybrid_lm import config as hybrid_config

        config = hybrid_config(run)
    else:
        config = {
            "architectures": ["Mamba2ForCausalLM"], "conv_kernel": 4, "expand": 2, "head_dim": hd,
            "hidden_size": d, "layer_norm_epsilon": 1e-5, "model_type": "mamba2",
            "norm_before_gate": False, "num_heads": 2 * d // hd, "num_hidden_layers": run["n_layer"], "n_groups": run.get("n_groups", 1),
            "residual_in_fp32": True, "rms_norm": True, "state_size": run["d_state"], "tie_word_embeddings": True,
            "time_step_limit": [0.0, {"__float__": "Infinity"}], "use_bias": False, "use_conv_bias": True,
            "vocab_size": run["vocab"],
        }
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
    json.dump(run, open(os.path.join(out, "run.json"), "w"), indent=1)
    with open(os.path.join(out, "train-log.jsonl"), "w") as f:
        for h in history:
            f.write(json.dumps(h) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="run file (picaso's pretrain JSON: d_model, n_layer, ...)")
    ap.add_argument("--tokens", help="picaso's token cache OUT/tokens.bin")
    ap.add_argument("--train", nargs="*", default=[], help="training stream(s), raw u16 (.xz allowed)")
    ap.add_argument("--val", help="validation stream, raw u16 (.xz allowed)")
    ap.add_argument("--pairs", help="held-out paragraph pairs (JSON) for the context-use metric")
    ap.add_argument("--out", help="run folder (checkpoint.pt); required to train")
    ap.add_argument("--minutes", type=float, default=1e9, help="stop and checkpoint after this long")
    ap.add_argument("--stop-after", type=int, help="stop and checkpoint at this step")
    ap.add_argument("--plan-minutes", type=float,
                    help="size the run (its step count, hence the lr schedule) to take this long in all, "
                         "from the speed of its first 40 steps")
    ap.add_argument("--init", help="start a new run from this model folder's weights (config.json + "
                                   "model.safetensors, e.g. models/picaso-mamba2) instead of fresh ones")
    ap.add_argument("--continue-from", help="start from another run folder's checkpoint (weights, optimiser "
                                            "moments, step, history) under this run file's schedule")
    ap.add_argument("--export", help="write the model here when the run stops")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16"], help="exported weights' dtype")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--export-only", action="store_true",
                    help="export the checkpoint in --out to --export and exit (also while the run goes on)")
    ap.add_argument("--check", action="store_true", help="compare the model with transformers' and exit")
    a = ap.parse_args()
    t0 = time.time()
    run = json.load(open(a.config))
    if a.check:
        return check_against_transformers({**run, "vocab": 512, "chunk": 16})
    if a.export_only:
        if not (a.out and a.export):
            ap.error("--export-only needs --out (the run) and --export")
        train = val = pairs = None
    elif not a.out or not (a.tokens or (a.train and a.val)):
        ap.error("training needs --out and either --tokens or --train and --val")
    elif a.tokens:
        train, val, pairs = read_token_cache(a.tokens)
    else:
        train = np.concatenate([read_u16(p) for p in a.train])
        val = read_u16(a.val)
        pairs = json.load(open(a.pairs)) if a.pairs else []
    if train is not None:
        print(f"{len(train):,} training tokens, {len(val):,} validation tokens, {len(pairs)} pairs", flush=True)
        assert train.max() < run["vocab"], "token ids exceed the vocabulary"

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(run["seed"])
    model = make_model(run)
    init_weights(model, run, run["seed"])
    if a.init and not a.continue_from and not os.path.exists(os.path.join(a.out, "checkpoint.pt")):
        load_weights(model, run, a.init)
        print(f"warm start from {a.init}", flush=True)
    model.to(dev)
    print(f"{sum(p.numel() for n, p in model.named_parameters() ):,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "lm_head.weight"]
    keep = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": run["weight_decay"]}, {"params": keep, "weight_decay": 0.0}],
                            lr=run["lr"], betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    os.makedirs(a.out, exist_ok=True)
    ckpt_path = os.path.join(a.out, "checkpoint.pt")
    step, history = 0, []
    own = os.path.exists(ckpt_path)
    source = ckpt_path if own else a.continue_from and os.path.join(a.continue_from, "checkpoint.pt")
    if source:
        ck = torch.load(source, map_location=dev)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, history = ck["step"], ck["history"]
        if own:  # this run's own schedule, as planned when it started
            run["steps"] = ck["steps"]
            if ck.get("decay_start") is not None:
                run["decay_start"] = ck["decay_start"]
        print(f"{'resumed' if own else 'continuing ' + a.continue_from} at step {step} of {run['steps']}", flush=True)
    if a.export_only:
        if step == 0:
            sys.exit(f"--export-only: no checkpoint in {a.out}")
        export(model, run, a.export, a.dtype, history)
        return print(f"step {step}: exported to {a.export}", flush=True)

    def save():
        """The checkpoint, written aside and renamed, so a reader never sees half of it."""
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), step=step, steps=run["steps"],
                        decay_start=run.get("decay_start"), history=history), ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)
        print(f"checkpoint at step {step} ({time.time() - t0:.0f} s)", flush=True)

    fwd = torch.compile(model) if a.compile else model
    tokens_per_step = run["batch"] * run["seq_len"]
    tick, tick_step = time.time(), step
    first, plan_tick = step, time.time()
    plan = a.plan_minutes is not None and not own
    if plan:
        run["steps"] = first + 10**9  # sized after the first 40 steps
    while step < min(run["steps"], a.stop_after or run["steps"]) and time.time() - t0 < a.minutes * 60:
        if plan and step == first + 40:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - plan_tick) / 40
            left = a.plan_minutes * 60 * 0.95 - (time.time() - t0)  # 5% for validation and saving
            run["steps"] = step + max(1, int(left / per_step))
            if "decay_frac" in run:  # warmup-stable-decay: the cosine over the last fraction of all steps
                run["decay_start"] = max(step, int(run["steps"] * (1 - run["decay_frac"])))
            plan = False
            print(f"{per_step * 1000:.0f} ms per step: the run is sized to {run['steps']} steps "
                  f"({run['steps'] * tokens_per_step / 1e6:.0f} M tokens)", flush=True)
        x, y = batch_at(train, run, step)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(run, step)
        accum = run.get("accum", 1)  # micro-batches per step: the same step in 1/accum the memory
        loss = 0.0
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            part = token_losses(fwd, xm, ym).mean() / accum
            part.backward()
            loss = loss + part.detach()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.get("clip", 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0 or step == run["steps"]:
            rate = (step - tick_step) * tokens_per_step / (time.time() - tick)
            tick, tick_step = time.time(), step
            rec = dict(step=step, loss=loss.item(), lr=lr_at(run, step - 1), grad_norm=gnorm.item(),
                       tokens=step * tokens_per_step, tokens_per_s=rate, seconds=time.time() - t0)
            if step % run.get("val_every", 500) == 0 or step == run["steps"]:
                model.eval()
                rec["val_loss"] = validate(model, val, run, dev)
                if pairs:
                    rec["context_use"] = context_use(model, pairs, dev)
                model.train()
            history.append(rec)
            print(json.dumps(rec), flush=True)
        if run.get("checkpoint_every") and step % run["checkpoint_every"] == 0 and step < run["steps"]:
            save()
    if step > first and not (history and history[-1]["step"] == step and "val_loss" in history[-1]):
        # stopped by --minutes or --stop-after: the run's last word is still a validation
        model.eval()
        rec = dict(step=step, loss=loss.item(), lr=lr_at(run, step - 1), tokens=step * tokens_per_step,
                   seconds=time.time() - t0, val_loss=validate(model, val, run, dev))
        if pairs:
            rec["context_use"] = context_use(model, pairs, dev)
        model.train()
        history.append(rec)
        print(json.dumps(rec), flush=True)
    save()
    if a.export:
        export(model, run, a.export, a.dtype, history)
        print(f"exported to {a.export}", flush=True)


if __name__ == "__main__":
    main()
