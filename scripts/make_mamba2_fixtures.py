#!/usr/bin/env python3
"""Generate small Mamba-2 reference fixtures from HF transformers for picaso's tests.

For every case in CASES this script
  1. builds a tiny random `Mamba2ForCausalLM` (fixed seed, every parameter overwritten with
     non-trivial random values, stored as float32),
  2. writes it in HF format (`hf/config.json`, `hf/model.safetensors`) and in state-spaces /
     mamba_ssm format (`state-spaces/config.json`, `state-spaces/pytorch_model.bin`),
  3. runs the HF torch reference in float64 (see `Float64Everywhere`) on a seeded random token
     sequence and records log-probs, logits and the per-layer recurrent state (ssm state, conv
     tail, cumulative log-decay) after a short prefix, a longer prefix and the full sequence
     into `expected.safetensors` (+ a small `expected.json`),
  4. cross-checks everything against an independent, naive float64 token-by-token
     implementation and against HF continuation from the prefix caches.

Run:  /work/pyenv/venv/bin/python scripts/make_mamba2_fixtures.py [--out testdata/mamba2]
CPU only, deterministic (re-running gives bitwise identical files).
"""

import argparse
import copy
import json
import math
from pathlib import Path

import safetensors
import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache, Mamba2Config, Mamba2ForCausalLM
from fixture_common import (
    Float64Everywhere,
    check_float64_mode,
    file_digests,
    max_diff,
    rms,
    write_expected,
)

SEQ_LEN = 37
# name -> number of tokens processed before the state snapshot
SNAPSHOTS = {"short": 2, "prefix": 13, "full": SEQ_LEN}
REF_DTYPE = torch.float64

CASES = {
    "g1": dict(
        seed=1001, hidden_size=32, expand=2, head_dim=16, num_heads=4, state_size=8, n_groups=1,
        num_hidden_layers=2, conv_kernel=4, vocab_size=97, tie_word_embeddings=True, use_bias=False,
        time_step_limit=(0.0, float("inf")), chunk_size=256,
    ),
    "g2": dict(
        seed=1002, hidden_size=48, expand=2, head_dim=12, num_heads=8, state_size=10, n_groups=2,
        num_hidden_layers=3, conv_kernel=3, vocab_size=101, tie_word_embeddings=True, use_bias=False,
        time_step_limit=(0.001, 0.25), chunk_size=16,  # 37 tokens -> 3 chunks in HF's chunked scan
    ),
    "g2-untied-bias": dict(
        seed=1003, hidden_size=48, expand=2, head_dim=12, num_heads=8, state_size=10, n_groups=2,
        num_hidden_layers=2, conv_kernel=4, vocab_size=89, tie_word_embeddings=False, use_bias=True,
        time_step_limit=(0.001, 0.25), chunk_size=8,
    ),
}


# --------------------------------------------------------------------------------------------
# float64 reference mode
# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------
# model construction
# --------------------------------------------------------------------------------------------
def make_config(case: dict) -> Mamba2Config:
    kw = {k: v for k, v in case.items() if k != "seed"}
    return Mamba2Config(layer_norm_epsilon=1e-5, use_conv_bias=True, residual_in_fp32=True, **kw)


def random_value(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """Non-trivial random float32 values for the parameter called `name`."""
    normal = lambda mean, std: mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("A_log"):  # A = -exp(A_log) in [-8, -0.5]
        lo, hi = math.log(0.5), math.log(8.0)
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)
    if name.endswith("dt_bias"):  # softplus(dt_bias) spans ~1e-4 .. 1 -> dt over orders of magnitude
        return normal(-3.0, 1.5)
    if name.endswith(".D"):
        return normal(1.0, 0.5)
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return normal(1.0, 0.2)
    if name.endswith("embeddings.weight"):
        return normal(0.0, 0.5)
    if name == "lm_head.weight":
        return normal(0.0, 0.3)
    if name.endswith("in_proj.weight"):
        return normal(0.0, 0.2)
    if name.endswith("out_proj.weight"):
        return normal(0.0, 0.15)
    if name.endswith("conv1d.weight"):
        return normal(0.0, 0.4)
    if name.endswith(".bias"):  # conv1d.bias, in_proj.bias, out_proj.bias
        return normal(0.0, 0.2)
    raise KeyError(f"no random rule for parameter {name}")


def build_model(config: Mamba2Config, seed: int) -> Mamba2ForCausalLM:
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is yielded once (as embeddings)
            p.copy_(random_value(name, p.shape, gen))
    tied = model.lm_head.weight is model.backbone.embeddings.weight
    assert tied == config.tie_word_embeddings
    return model


def make_tokens(vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.randint(0, vocab_size, (SEQ_LEN,), generator=gen, dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# writing the two checkpoint formats
# --------------------------------------------------------------------------------------------
def write_hf(model: Mamba2ForCausalLM, out: Path):
    model.save_pretrained(out, safe_serialization=True)


def state_spaces_config(config: Mamba2Config) -> dict:
    ssm_cfg = {
        "layer": "Mamba2",
        "d_state": config.state_size,
        "d_conv": config.conv_kernel,
        "expand": config.expand,
        "headdim": config.head_dim,
        "ngroups": config.n_groups,
    }
    lo, hi = (float(v) for v in config.time_step_limit)
    if (lo, hi) != (0.0, math.inf):
        assert math.isfinite(hi), "state-spaces dt_limit must be finite"
        ssm_cfg["dt_limit"] = [lo, hi]
    ssm_cfg.update(bias=config.use_bias, conv_bias=config.use_conv_bias, chunk_size=config.chunk_size)
    return {
        "d_model": config.hidden_size,
        "d_intermediate": 0,
        "n_layer": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "ssm_cfg": ssm_cfg,
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 1,
        "tie_embeddings": config.tie_word_embeddings,
    }


def write_state_spaces(model: Mamba2ForCausalLM, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    cfg = state_spaces_config(model.config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        k = k.replace("backbone.embeddings.weight", "backbone.embedding.weight")
        sd[k] = v.detach().to(torch.float32).contiguous().clone()  # own storage, no views
    torch.save(sd, out / "pytorch_model.bin")


# --------------------------------------------------------------------------------------------
# HF reference runs and state extraction
# --------------------------------------------------------------------------------------------
def capture_in_proj(model):
    """Forward hooks recording each layer's in_proj output (zxbcdt) of the latest forward."""
    captured, handles = {}, []
    for i, layer in enumerate(model.backbone.layers):
        def hook(_mod, _inp, output, i=i):
            captured[i] = output.detach()[0]
        handles.append(layer.mixer.in_proj.register_forward_hook(hook))
    return captured, handles


def clamped_dt(mixer, zxbcdt: torch.Tensor) -> torch.Tensor:
    """dt = clamp(softplus(dt_raw + dt_bias), time_step_limit), shape (T, H)."""
    dt_raw = zxbcdt[:, -mixer.num_heads:]
    dt = F.softplus(dt_raw + mixer.dt_bias)
    lo, hi = mixer.time_step_limit
    return torch.clamp(dt, min=lo, max=hi)


def hf_run(model, tokens: torch.Tensor, cache=None):
    """One HF forward in float64 mode; returns (logits (T, V), cache, {layer: zxbcdt})."""
    captured, handles = capture_in_proj(model)
    try:
        with torch.no_grad(), Float64Everywhere():
            out = model(input_ids=tokens[None], cache_params=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return out.logits[0], out.cache_params, dict(captured)


def extract_states(model, cache, zxbcdt: dict, tag: str) -> dict:
    """Per-layer (ssm, conv tail, log_decay) from an HF cache after a prefill of the tokens seen."""
    states = {}
    for i, layer in enumerate(model.backbone.layers):
        mixer = layer.mixer
        ssm = cache.get_recurrent_state(i)[0]  # (H, P, N)
        conv = cache.get_conv_state(i)[0]  # (conv_dim, K): last K xBC inputs, oldest first
        assert ssm.shape == (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)
        assert conv.shape == (mixer.conv_dim, mixer.conv_kernel_size)
        A = -torch.exp(mixer.A_log)
        log_decay = (clamped_dt(mixer, zxbcdt[i]) * A).sum(0)  # (H,)
        states[f"{tag}.layers.{i}.ssm"] = ssm.clone()
        states[f"{tag}.layers.{i}.conv"] = conv[:, 1:].clone()  # drop the oldest column
        states[f"{tag}.layers.{i}.log_decay"] = log_decay
    return states


def cache_from_states(model, states: dict, tag: str) -> DynamicCache:
    """Rebuild an HF cache from *our* stored tensors (zero column re-added as oldest conv input)."""
    cache = DynamicCache(config=model.config)
    for i in range(model.config.num_hidden_layers):
        conv = states[f"{tag}.layers.{i}.conv"]
        conv_k = torch.cat([torch.zeros_like(conv[:, :1]), conv], dim=1)
        cache.update_conv_state(conv_k[None].clone(), i, conv_kernel_size=model.config.conv_kernel)
        cache.update_recurrent_state(states[f"{tag}.layers.{i}.ssm"][None].clone(), i)
    return cache


def count_clamped(model, zxbcdt: dict) -> dict:
    low = high = total = 0
    for i, layer in enumerate(model.backbone.layers):
        mixer = layer.mixer
        dt = F.softplus(zxbcdt[i][:, -mixer.num_heads:] + mixer.dt_bias)
        lo, hi = mixer.time_step_limit
        low += int((dt < lo).sum())
        high += int((dt > hi).sum())
        total += dt.numel()
    return {"below_min": low, "above_max": high, "total": total}


def dt_range(model, zxbcdt: dict) -> tuple:
    dts = torch.cat([clamped_dt(l.mixer, zxbcdt[i]).flatten() for i, l in enumerate(model.backbone.layers)])
    return float(dts.min()), float(dts.max())


# --------------------------------------------------------------------------------------------
# independent naive reference (token-by-token recurrence, float64)
# --------------------------------------------------------------------------------------------
def naive_forward(model, tokens: torch.Tensor, snapshots: dict):
    """Straightforward sequential Mamba-2; returns (logits, states) following the fixture layout."""
    cfg = model.config
    H, P, N, G, K = cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups, cfg.conv_kernel
    d_inner = cfg.expand * cfg.hidden_size
    eps = cfg.layer_norm_epsilon
    lo, hi = (float(v) for v in cfg.time_step_limit)
    T = tokens.shape[0]
    x = model.backbone.embeddings.weight[tokens]
    states = {}
    for i, layer in enumerate(model.backbone.layers):
        m = layer.mixer
        zxbcdt = F.linear(rms(x, layer.norm.weight, eps), m.in_proj.weight, m.in_proj.bias)
        z, xbc, dt_raw = zxbcdt.split([d_inner, m.conv_dim, H], dim=-1)
        xpad = torch.cat([torch.zeros(K - 1, m.conv_dim, dtype=x.dtype), xbc])  # row j = token j-(K-1)
        w = m.conv1d.weight[:, 0, :]  # (conv_dim, K)
        conv = torch.stack([(xpad[t:t + K].T * w).sum(-1) for t in range(T)])
        if m.conv1d.bias is not None:
            conv = conv + m.conv1d.bias
        conv = F.silu(conv)
        xs, Bm, Cm = conv.split([d_inner, G * N, G * N], dim=-1)
        xs, Bm, Cm = xs.view(T, H, P), Bm.view(T, G, N), Cm.view(T, G, N)
        group = torch.arange(H) // (H // G)
        dt = torch.clamp(F.softplus(dt_raw + m.dt_bias), lo, hi)
        A = -torch.exp(m.A_log)
        S = torch.zeros(H, P, N, dtype=x.dtype)
        log_decay = torch.zeros(H, dtype=x.dtype)
        ys = []
        for t in range(T):
            B_t, C_t = Bm[t][group], Cm[t][group]  # (H, N)
            S = S * torch.exp(dt[t] * A)[:, None, None] + dt[t][:, None, None] * xs[t][:, :, None] * B_t[:, None, :]
            log_decay = log_decay + dt[t] * A
            ys.append(torch.einsum("hpn,hn->hp", S, C_t) + m.D[:, None] * xs[t])
            for tag, n in snapshots.items():
                if n == t + 1:
                    states[f"{tag}.layers.{i}.ssm"] = S.clone()
                    states[f"{tag}.layers.{i}.conv"] = xpad[t + 1:t + K].T.clone()
                    states[f"{tag}.layers.{i}.log_decay"] = log_decay.clone()
        y = torch.stack(ys).reshape(T, d_inner) * F.silu(z)
        y = rms(y.view(T, G, d_inner // G), 1.0, eps).reshape(T, d_inner) * m.norm.weight
        x = x + F.linear(y, m.out_proj.weight, m.out_proj.bias)
    logits = F.linear(rms(x, model.backbone.norm_f.weight, eps), model.lm_head.weight)
    return logits, states


# --------------------------------------------------------------------------------------------
# cross-checks
# --------------------------------------------------------------------------------------------
def cross_check(name, ref, model32, tokens, logits, states) -> dict:
    """Run all consistency checks; returns a dict of max abs differences (float64 unless noted)."""
    r = {}
    naive_logits, naive_states = naive_forward(ref, tokens, SNAPSHOTS)
    r["naive_vs_hf_logits"] = max_diff(naive_logits, logits)
    r["naive_vs_hf_states"] = max(max_diff(naive_states[k], v) for k, v in states.items())

    # continuation of HF from its own prefix cache (chunked path with initial state)
    for tag in ("short", "prefix"):
        n = SNAPSHOTS[tag]
        _, cache, _ = hf_run(ref, tokens[:n])
        cont, _, _ = hf_run(ref, tokens[n:], cache=cache)
        r[f"continue_from_{tag}_hf_cache"] = max_diff(cont, logits[n:])
        # continuation from a cache rebuilt out of the fixture's own state tensors
        cont2, _, _ = hf_run(ref, tokens[n:], cache=cache_from_states(ref, states, tag))
        r[f"continue_from_{tag}_fixture_states"] = max_diff(cont2, logits[n:])

    # token-by-token decode from the prefix cache (HF's recurrent path); informational:
    # HF's single-token step does not apply time_step_limit, so this differs where dt is clamped.
    n = SNAPSHOTS["prefix"]
    _, cache, _ = hf_run(ref, tokens[:n])
    step_logits = []
    for t in range(n, SEQ_LEN):
        lg, cache, _ = hf_run(ref, tokens[t:t + 1], cache=cache)
        step_logits.append(lg[0])
    step_logits = torch.stack(step_logits)
    r["decode_steps_from_prefix_vs_full (info)"] = max_diff(step_logits, logits[n:])
    # ... and it matches a chunked continuation whose dt is left unclamped after the prefix
    _, cache, _ = hf_run(ref, tokens[:n])
    limits = [layer.mixer.time_step_limit for layer in ref.backbone.layers]
    for layer in ref.backbone.layers:
        layer.mixer.time_step_limit = (0.0, math.inf)
    unclamped, _, _ = hf_run(ref, tokens[n:], cache=cache)
    for layer, lim in zip(ref.backbone.layers, limits):
        layer.mixer.time_step_limit = lim
    r["decode_steps_vs_continuation_without_dt_clamp"] = max_diff(step_logits, unclamped)

    # precision of HF without the float64 mode (informational)
    with torch.no_grad():
        r["hf_plain_double_vs_ref (info)"] = max_diff(ref(input_ids=tokens[None]).logits[0], logits)
        r["hf_float32_vs_ref (info)"] = max_diff(model32(input_ids=tokens[None]).logits[0], logits)

    for k, v in r.items():
        print(f"  [{name}] {k}: {v:.3e}")
    tol = 1e-9
    for k, v in r.items():
        if "(info)" not in k:
            assert v < tol, f"{name}: cross-check {k} failed ({v})"
    return r


# --------------------------------------------------------------------------------------------
# expected outputs
# --------------------------------------------------------------------------------------------
def compute_expected(ref, tokens):
    logits, _, zx_full = hf_run(ref, tokens)
    logprobs = torch.log_softmax(logits, dim=-1)[:-1].gather(1, tokens[1:, None])[:, 0]
    states = {}
    for tag, n in SNAPSHOTS.items():
        _, cache, zx = hf_run(ref, tokens[:n])
        states.update(extract_states(ref, cache, zx, tag))
    return logits, logprobs, states, zx_full


def make_case(name: str, case: dict, root: Path) -> dict:
    print(f"== {name}")
    out = root / name
    config = make_config(case)
    model32 = build_model(config, case["seed"])
    write_hf(model32, out / "hf")
    write_state_spaces(model32, out / "state-spaces")

    model32.requires_grad_(False)
    ref = copy.deepcopy(model32).to(REF_DTYPE)
    tokens = make_tokens(config.vocab_size, case["seed"])
    logits, logprobs, states, zx_full = compute_expected(ref, tokens)
    clamped = count_clamped(ref, zx_full)
    dt_lo, dt_hi = dt_range(ref, zx_full)
    print(f"  dt (after clamp) in [{dt_lo:.3e}, {dt_hi:.3e}]; time_step_limit={tuple(config.time_step_limit)}; "
          f"clamped dt values over full sequence (all layers/heads): {clamped}")
    checks = cross_check(name, ref, model32, tokens, logits, states)

    meta = {
        "case": name,
        "seed": case["seed"],
        "seq_len": SEQ_LEN,
        "prefix_lengths": dict(SNAPSHOTS),
        "reference_dtype": "float64 (HF torch path, float32 casts neutralised; stored as float32)",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
    }
    info = {"dt_clamped_full_sequence": clamped, "dt_range_full_sequence": [dt_lo, dt_hi],
            "cross_checks_max_abs_diff": checks}
    write_expected(out, tokens, logits, logprobs, states, meta, info)
    return {"clamped": clamped, "checks": checks}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "testdata" / "mamba2"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    check_float64_mode()
    root = Path(args.out)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"reference dtype: float64 (model.double() + Float64Everywhere); fixtures stored as float32")
    for name, case in CASES.items():
        make_case(name, case, root)
    total = 0
    for rel, digest in file_digests(root).items():
        size = (root / rel).stat().st_size
        total += size
        print(f"{size:>9}  {digest[:16]}  {rel}")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
