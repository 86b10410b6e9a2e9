#!/usr/bin/env python3
"""Generate small Mamba-1 reference fixtures from HF transformers for picaso's tests.

For every case in CASES this script
  1. builds a tiny random `MambaForCausalLM` (fixed seed, every parameter overwritten with
     non-trivial random values, stored as float32),
  2. writes it in HF format (`hf/config.json`, `hf/model.safetensors`) and in state-spaces /
     mamba_ssm format (`state-spaces/config.json`, `state-spaces/pytorch_model.bin`),
  3. runs the HF torch reference in float64 (see `Float64Everywhere`) on a seeded random token
     sequence and records log-probs, logits and the per-layer recurrent state (ssm state, conv
     tail, cumulative log-decay) after a short prefix, a longer prefix and the full sequence
     into `expected.safetensors` (+ a small `expected.json`),
  4. cross-checks everything against an independent, naive float64 token-by-token
     implementation and against HF decoding from the prefix caches (its own, and one rebuilt
     out of the fixture's state tensors).

Run:  /work/pyenv/venv/bin/python scripts/make_mamba1_fixtures.py [--out testdata/mamba1]
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
import transformers.models.mamba.modeling_mamba as modeling_mamba
from transformers import DynamicCache, MambaConfig, MambaForCausalLM
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
    "a": dict(
        seed=2001, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4, expand=2,
        time_step_rank=4, vocab_size=97, tie_word_embeddings=True, use_bias=False, use_conv_bias=True,
    ),
    "b": dict(
        seed=2002, hidden_size=48, state_size=10, num_hidden_layers=3, conv_kernel=3, expand=2,
        time_step_rank=5, vocab_size=101, tie_word_embeddings=False, use_bias=True, use_conv_bias=True,
    ),
    "c": dict(
        seed=2003, hidden_size=32, state_size=6, num_hidden_layers=2, conv_kernel=2, expand=1,
        time_step_rank=3, vocab_size=89, tie_word_embeddings=True, use_bias=False, use_conv_bias=False,
    ),
    # d_inner 42: not a multiple of the engine's 16-channel blocks.
    "d": dict(
        seed=2004, hidden_size=21, state_size=5, num_hidden_layers=2, conv_kernel=4, expand=2,
        time_step_rank=2, vocab_size=83, tie_word_embeddings=True, use_bias=False, use_conv_bias=True,
    ),
}


# --------------------------------------------------------------------------------------------
# torch reference path + float64 reference mode
# --------------------------------------------------------------------------------------------
KERNEL_FUNCS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba_selective_scan",
                "mamba_selective_state_update", "mamba_inner_fn")


def force_torch_path():
    """Make HF Mamba use its own pure-torch functions, even where mamba_ssm / causal_conv1d exist.

    The functions are wrapped by `use_kernel_func_from_hub_with_fallback`, which picks the CUDA
    package implementation at import time if it is installed. `MambaMixer.forward` looks them up
    as module globals, so replacing the globals by the unwrapped originals pins the torch path.
    """
    for name in KERNEL_FUNCS:
        f = getattr(modeling_mamba, name)
        f = getattr(f, "__wrapped__", f)
        assert f.__module__ == modeling_mamba.__name__, (name, f.__module__)
        setattr(modeling_mamba, name, f)


# --------------------------------------------------------------------------------------------
# model construction
# --------------------------------------------------------------------------------------------
def make_config(case: dict) -> MambaConfig:
    kw = {k: v for k, v in case.items() if k != "seed"}
    return MambaConfig(layer_norm_epsilon=1e-5, residual_in_fp32=True, **kw)


def random_value(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """Non-trivial random float32 values for the parameter called `name`."""
    normal = lambda mean, std: mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("A_log"):  # A = -exp(A_log) in [-8, -0.5], shape (d_inner, N)
        lo, hi = math.log(0.5), math.log(8.0)
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)
    if name.endswith("dt_proj.bias"):  # softplus(dt) spans ~1e-4 .. 1 -> dt over orders of magnitude
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
    if name.endswith("x_proj.weight"):
        return normal(0.0, 0.2)
    if name.endswith("dt_proj.weight"):
        return normal(0.0, 0.5)
    if name.endswith(".bias"):  # conv1d.bias, in_proj.bias, out_proj.bias
        return normal(0.0, 0.2)
    raise KeyError(f"no random rule for parameter {name}")


def build_model(config: MambaConfig, seed: int) -> MambaForCausalLM:
    torch.manual_seed(seed)
    model = MambaForCausalLM(config).eval()
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
def write_hf(model: MambaForCausalLM, out: Path):
    model.save_pretrained(out, safe_serialization=True)


def state_spaces_config(config: MambaConfig) -> dict:
    return {
        "d_model": config.hidden_size,
        "n_layer": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "ssm_cfg": {
            "layer": "Mamba1",
            "d_state": config.state_size,
            "d_conv": config.conv_kernel,
            "expand": config.expand,
            "dt_rank": config.time_step_rank,
            "conv_bias": config.use_conv_bias,
            "bias": config.use_bias,
        },
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 1,
        "tie_embeddings": config.tie_word_embeddings,
    }


def write_state_spaces(model: MambaForCausalLM, out: Path):
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
def capture_x_proj(model):
    """Forward hooks recording each layer's x_proj output ([dt_low, B, C]) of the latest forward."""
    captured, handles = {}, []
    for i, layer in enumerate(model.backbone.layers):
        def hook(_mod, _inp, output, i=i):
            captured[i] = output.detach()[0]
        handles.append(layer.mixer.x_proj.register_forward_hook(hook))
    return captured, handles


def layer_dt(mixer, xdbl: torch.Tensor) -> torch.Tensor:
    """dt = softplus(dt_proj(dt_low)) incl. dt_proj.bias, shape (T, d_inner)."""
    dt_low = xdbl[:, :mixer.time_step_rank]
    return F.softplus(F.linear(dt_low, mixer.dt_proj.weight, mixer.dt_proj.bias))


def hf_run(model, tokens: torch.Tensor, cache=None):
    """One HF forward in float64 mode; returns (logits (T, V), cache, {layer: x_proj output})."""
    captured, handles = capture_x_proj(model)
    try:
        with torch.no_grad(), Float64Everywhere():
            out = model(input_ids=tokens[None], cache_params=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return out.logits[0], out.cache_params, dict(captured)


def extract_states(model, cache, xdbl: dict, tag: str) -> dict:
    """Per-layer (ssm, conv tail, log_decay) from an HF cache after a prefill of the tokens seen."""
    states = {}
    for i, layer in enumerate(model.backbone.layers):
        mixer = layer.mixer
        ssm = cache.get_recurrent_state(i)[0]  # (d_inner, N)
        conv = cache.get_conv_state(i)[0]  # (d_inner, K): last K pre-conv x inputs, oldest first
        assert ssm.shape == (mixer.intermediate_size, mixer.ssm_state_size)
        assert conv.shape == (mixer.intermediate_size, mixer.conv_kernel_size)
        A = -torch.exp(mixer.A_log)  # (d_inner, N)
        log_decay = (layer_dt(mixer, xdbl[i])[:, :, None] * A[None]).sum(0)  # (d_inner, N)
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


def hf_decode(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Feed `tokens` one at a time (HF's recurrent decode path); returns logits (T, V)."""
    logits = []
    for t in range(tokens.shape[0]):
        lg, cache, _ = hf_run(model, tokens[t:t + 1], cache=cache)
        logits.append(lg[0])
    return torch.stack(logits)


def dt_range(model, xdbl: dict) -> tuple:
    dts = torch.cat([layer_dt(l.mixer, xdbl[i]).flatten() for i, l in enumerate(model.backbone.layers)])
    return float(dts.min()), float(dts.max())


# --------------------------------------------------------------------------------------------
# independent naive reference (token-by-token recurrence, float64)
# --------------------------------------------------------------------------------------------
def naive_forward(model, tokens: torch.Tensor, snapshots: dict, init: dict | None = None, init_tag=None):
    """Straightforward streaming Mamba-1: one token at a time through all layers.

    Returns (logits (T, V), states following the fixture layout). With `init` (a fixture-style
    state dict) and `init_tag`, starts from that snapshot's conv/ssm state instead of zeros.
    """
    cfg = model.config
    N, K, R = cfg.state_size, cfg.conv_kernel, cfg.time_step_rank
    d_inner = cfg.expand * cfg.hidden_size
    eps = cfg.layer_norm_epsilon
    dtype = model.backbone.embeddings.weight.dtype
    L = cfg.num_hidden_layers
    conv_buf = [torch.zeros(d_inner, K - 1, dtype=dtype) for _ in range(L)]  # oldest first
    ssm = [torch.zeros(d_inner, N, dtype=dtype) for _ in range(L)]
    log_decay = [torch.zeros(d_inner, N, dtype=dtype) for _ in range(L)]
    if init is not None:
        conv_buf = [init[f"{init_tag}.layers.{i}.conv"].clone() for i in range(L)]
        ssm = [init[f"{init_tag}.layers.{i}.ssm"].clone() for i in range(L)]
    states, logits = {}, []
    for t, tok in enumerate(tokens.tolist()):
        h = model.backbone.embeddings.weight[tok]
        for i, layer in enumerate(model.backbone.layers):
            m = layer.mixer
            xz = F.linear(rms(h, layer.norm.weight, eps), m.in_proj.weight, m.in_proj.bias)
            x, z = xz[:d_inner], xz[d_inner:]
            window = torch.cat([conv_buf[i], x[:, None]], dim=1)  # (d_inner, K)
            conv_buf[i] = window[:, 1:]
            c = (window * m.conv1d.weight[:, 0, :]).sum(-1)
            if m.conv1d.bias is not None:
                c = c + m.conv1d.bias
            c = F.silu(c)
            xdbl = m.x_proj.weight @ c
            dt_low, B, C = xdbl[:R], xdbl[R:R + N], xdbl[R + N:]
            dt = F.softplus(m.dt_proj.weight @ dt_low + m.dt_proj.bias)  # (d_inner,)
            A = -torch.exp(m.A_log)  # (d_inner, N)
            ssm[i] = torch.exp(dt[:, None] * A) * ssm[i] + dt[:, None] * B[None, :] * c[:, None]
            log_decay[i] = log_decay[i] + dt[:, None] * A
            y = ssm[i] @ C + m.D * c
            y = y * F.silu(z)
            h = h + F.linear(y, m.out_proj.weight, m.out_proj.bias)
            for tag, n in snapshots.items():
                if n == t + 1:
                    states[f"{tag}.layers.{i}.ssm"] = ssm[i].clone()
                    states[f"{tag}.layers.{i}.conv"] = conv_buf[i].clone()
                    states[f"{tag}.layers.{i}.log_decay"] = log_decay[i].clone()
        logits.append(F.linear(rms(h, model.backbone.norm_f.weight, eps), model.lm_head.weight))
    return torch.stack(logits), states


# --------------------------------------------------------------------------------------------
# cross-checks
# --------------------------------------------------------------------------------------------
def cross_check(name, ref, model32, tokens, logits, states) -> dict:
    """Run all consistency checks; returns a dict of max abs differences (float64 unless noted)."""
    r = {}
    naive_logits, naive_states = naive_forward(ref, tokens, SNAPSHOTS)
    r["naive_vs_hf_logits"] = max_diff(naive_logits, logits)
    r["naive_vs_hf_states"] = max(max_diff(naive_states[k], v) for k, v in states.items())

    for tag in ("short", "prefix"):
        n = SNAPSHOTS[tag]
        rest = tokens[n:]
        # HF token-by-token decode (recurrent path) from its own prefill cache ...
        _, cache, _ = hf_run(ref, tokens[:n])
        r[f"decode_from_{tag}_hf_cache"] = max_diff(hf_decode(ref, rest, cache), logits[n:])
        # ... and from a cache rebuilt out of the fixture's own state tensors
        r[f"decode_from_{tag}_fixture_states"] = max_diff(
            hf_decode(ref, rest, cache_from_states(ref, states, tag)), logits[n:])
        # multi-token continuation from the fixture's state tensors (naive implementation)
        cont, _ = naive_forward(ref, rest, {}, init=states, init_tag=tag)
        r[f"naive_continue_from_{tag}_fixture_states"] = max_diff(cont, logits[n:])
        # HF multi-token continuation from a prefix cache: HF's sequential scan starts from a zero
        # SSM state (the cached recurrent state is ignored; the conv state is used), so this is
        # wrong; it equals a continuation with the SSM state reset and the conv state kept.
        _, cache, _ = hf_run(ref, tokens[:n])
        hf_cont, _, _ = hf_run(ref, rest, cache=cache)
        r[f"hf_multi_token_continue_from_{tag}_vs_full (info)"] = max_diff(hf_cont, logits[n:])
        reset = dict(states)
        reset.update({f"{tag}.layers.{i}.ssm": torch.zeros_like(states[f"{tag}.layers.{i}.ssm"])
                      for i in range(ref.config.num_hidden_layers)})
        cont_reset, _ = naive_forward(ref, rest, {}, init=reset, init_tag=tag)
        r[f"hf_multi_token_continue_from_{tag}_vs_ssm_state_reset (info)"] = max_diff(hf_cont, cont_reset)

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
    logits, _, xdbl_full = hf_run(ref, tokens)
    logprobs = torch.log_softmax(logits, dim=-1)[:-1].gather(1, tokens[1:, None])[:, 0]
    states = {}
    for tag, n in SNAPSHOTS.items():
        _, cache, xdbl = hf_run(ref, tokens[:n])
        states.update(extract_states(ref, cache, xdbl, tag))
    return logits, logprobs, states, xdbl_full


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
    logits, logprobs, states, xdbl_full = compute_expected(ref, tokens)
    dt_lo, dt_hi = dt_range(ref, xdbl_full)
    print(f"  dt over full sequence (all layers/channels) in [{dt_lo:.3e}, {dt_hi:.3e}]")
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
    info = {"dt_range_full_sequence": [dt_lo, dt_hi], "cross_checks_max_abs_diff": checks}
    write_expected(out, tokens, logits, logprobs, states, meta, info)
    return {"checks": checks}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "testdata" / "mamba1"))
    args = ap.parse_args()
    # One thread: the ops are tiny, and with 2+ threads OpenMP spin-waiting on a busy machine made
    # float64 depthwise conv1d ~250x slower (minutes instead of seconds).
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    force_torch_path()
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
