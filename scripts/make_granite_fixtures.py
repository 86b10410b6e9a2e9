#!/usr/bin/env python3
"""Generate small GraniteMoeHybrid (Granite 4.0 H), Bamba, Nemotron-H, Falcon-H1 and Jamba reference fixtures from HF transformers.

For every case in CASES this script
  1. builds a tiny random `GraniteMoeHybridForCausalLM` (fixed seed, every parameter overwritten
     with non-trivial random values, stored as float32; non-trivial embedding, residual,
     attention and logits multipliers), or a `BambaForCausalLM` (family "bamba": no
     multipliers, RoPE on half of each head's channels), or a `NemotronHForCausalLM` (family
     "nemotron_h": Mamba, attention and relu² MLP blocks apart, NoPE), or a `FalconH1ForCausalLM`
     (family "falcon_h1": a Mamba mixer and RoPE attention side by side in every layer, µP
     multipliers; such a layer's state is both), or a `JambaForCausalLM` (family "jamba":
     Mamba-1 mixers with RMSNorms on dt, B and C, NoPE attention, experts routed by the top-k of
     a softmax over all, unnormalised; its log-decay is per (channel, state)),
  2. writes it in HF format (`hf/config.json` with the hub's `layer_types` names
     `mamba`/`attention`, `hf/model.safetensors`),
  3. runs the HF torch reference in float64 (`Float64Everywhere`) on a seeded random token
     sequence and records log-probs, logits and every layer's state after a short prefix, a
     longer prefix and the full sequence: per Mamba layer the SSM state, conv tail and
     log-decay, per attention layer its keys and values (kv_heads, tokens, head_dim) as the
     cache holds them (RoPE already applied), named by picaso's layer index (the model's own,
     except on Nemotron-H, where picaso counts the mixer blocks: an `mlp` block joins the mixer
     block before it),
  4. records a composed continuation: three contexts each encoded alone, composed with
     PICASO-R on the Mamba layers (the mean over the n rotations of CASO), the mean of the conv
     tails and the union of the keys and values on the attention layers (contexts in order,
     each at positions 0..len-1; the query starts after the longest), then the query's
     log-probs from transformers continuing a cache that holds exactly those tensors,
  5. cross-checks HF continuation from its own prefix caches against the full run.

Run:  python scripts/make_granite_fixtures.py [--out testdata/granite]   (CPU, deterministic)
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    DynamicCache,
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
)

from fixture_common import Float64Everywhere, check_float64_mode, file_digests, max_diff, write_expected

SEQ_LEN = 37
SNAPSHOTS = {"short": 2, "prefix": 13, "full": SEQ_LEN}
CONTEXTS = [9, 6, 11]  # lengths of the composed case's contexts
QUERY = 8

BASE = dict(
    embedding_multiplier=2.5, residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=1.7,
    rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mamba_d_conv=4, mamba_expand=2,
    mamba_conv_bias=True, mamba_proj_bias=False, max_position_embeddings=512, tie_word_embeddings=True,
)
BAMBA_BASE = dict(
    rms_norm_eps=1e-5, hidden_act="silu", mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
    mamba_proj_bias=False, max_position_embeddings=512,
)
NEMOTRON_BASE = dict(
    layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", mamba_hidden_act="silu", conv_kernel=4, expand=2,
    use_conv_bias=True, attention_bias=False, mlp_bias=False, max_position_embeddings=512,
)
CASES = {
    # dense, no positional encoding (Granite 4.0 H), one group, a Mamba layer first
    "dense-nope-g1": dict(
        seed=2001, hidden_size=32, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=0, num_experts_per_tok=0,
        intermediate_size=24, shared_intermediate_size=40, position_embedding_type="nope",
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=256,
        vocab_size=97, time_step_limit=(0.0, float("inf")),
    ),
    # mixture of experts, RoPE, two groups, an attention layer first, untied head, clamped dt
    "moe-rope-g2": dict(
        seed=2002, hidden_size=48, num_hidden_layers=3, layer_types=["attention", "mamba", "mamba"],
        num_attention_heads=6, num_key_value_heads=3, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=20, shared_intermediate_size=36, position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mamba_n_heads=8, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=10, mamba_chunk_size=16,
        vocab_size=101, time_step_limit=(0.001, 0.25), tie_word_embeddings=False,
    ),
    # Bamba: attention first and last, RoPE on 6 of 12 channels per head, two groups, untied head
    "bamba-rope-g2": dict(
        family="bamba", seed=2003, hidden_size=48, num_hidden_layers=4, attn_layer_indices=[0, 3],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=28,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        mamba_n_heads=8, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=10, mamba_chunk_size=16,
        vocab_size=89, time_step_limit=(0.001, 0.25), tie_word_embeddings=False,
    ),
    # Nemotron-H: a Mamba block with no MLP after it, attention with one, a Mamba block with one,
    # a last Mamba block with none; Mamba biases (`use_bias`), two groups, untied head
    "nemotron-h-g2": dict(
        family="nemotron_h", seed=2004, hidden_size=48, layers_block_type=[
            "mamba", "attention", "mlp", "mamba", "mlp", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=40,
        mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=10, chunk_size=16, use_bias=True,
        vocab_size=83, time_step_limit=(0.001, 0.25), tie_word_embeddings=False,
    ),
    # Nemotron 3: routed experts (`moe` blocks: sigmoid router with a correction bias, 2 groups of
    # which 1 is kept, 2 of 6 relu² experts, scaled weights, a shared expert) beside an `mlp` block
    "nemotron-h-moe-g2": dict(
        family="nemotron_h", seed=2005, hidden_size=48, layers_block_type=[
            "mamba", "moe", "attention", "mlp", "mamba", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=40,
        mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=10, chunk_size=16,
        n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=20, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.5, vocab_size=79, time_step_limit=(0.0, float("inf")), tie_word_embeddings=False,
    ),
    # Nemotron 3's latent experts (`moe_latent_size`): the routed experts work in a width of 24,
    # between projections down from and back up to the hidden 48; routing unnormalised, all groups
    "nemotron-h-latent-g2": dict(
        family="nemotron_h", seed=2008, hidden_size=48, layers_block_type=[
            "mamba", "moe", "attention", "moe", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=40,
        mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=10, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, moe_latent_size=24,
        moe_shared_expert_intermediate_size=20, n_group=2, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=2.5, vocab_size=73, time_step_limit=(0.0, float("inf")), tie_word_embeddings=False,
    ),
}


FALCON_BASE = dict(
    rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mlp_bias=False, mamba_d_conv=4, mamba_expand=2,
    mamba_conv_bias=True, max_position_embeddings=512,
)
CASES.update({
    # Falcon-H1: a Mamba mixer and RoPE attention side by side in every layer; every µP
    # multiplier non-trivial; the hub's default mixer (no gated norm: y·silu(z)); a mixer width
    # (mamba_d_ssm 72) apart from expand × hidden; Mamba projection biases; untied head
    "falcon-h1-g2": dict(
        family="falcon_h1", seed=2006, hidden_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=40,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        mamba_d_ssm=72, mamba_n_heads=6, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=10, mamba_chunk_size=16,
        mamba_rms_norm=False, mamba_proj_bias=True, projectors_bias=True,
        embedding_multiplier=2.0, lm_head_multiplier=0.4, key_multiplier=0.6, attention_in_multiplier=1.3,
        attention_out_multiplier=0.8, ssm_in_multiplier=0.7, ssm_out_multiplier=0.9,
        ssm_multipliers=[0.5, 1.4, 0.8, 1.2, 0.6], mlp_multipliers=[0.9, 0.75],
        vocab_size=71, time_step_limit=(0.001, 0.25), tie_word_embeddings=False,
    ),
    # Falcon-H1 with the mixer's grouped RMSNorm before the gate (`mamba_rms_norm`,
    # `mamba_norm_before_gate`), a tied head, no biases, one kv head, heads wider than
    # hidden / heads (4 × 10 on a width of 32)
    "falcon-h1-norm-g2": dict(
        family="falcon_h1", seed=2007, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=10, intermediate_size=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16,
        mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_proj_bias=False, projectors_bias=False,
        embedding_multiplier=1.5, lm_head_multiplier=0.8, key_multiplier=1.25, attention_in_multiplier=0.9,
        attention_out_multiplier=1.1, ssm_in_multiplier=1.2, ssm_out_multiplier=0.85,
        ssm_multipliers=[1.1, 0.9, 1.3, 0.7, 1.05], mlp_multipliers=[1.2, 0.8],
        vocab_size=67, time_step_limit=(0.0, float("inf")), tie_word_embeddings=True,
    ),
})


JAMBA_BASE = dict(
    rms_norm_eps=1e-6, hidden_act="silu", mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
    max_position_embeddings=512, use_mamba_kernels=False,
)
CASES.update({
    # Jamba: Mamba-1 mixers (RMSNorms on dt, B and C) and NoPE attention every third layer from
    # layer 1; routed experts (softmax over all 4, the top 2 kept unnormalised, no shared MLP)
    # every second layer from layer 1, so one attention and one Mamba layer have them; untied head
    "jamba-moe": dict(
        family="jamba", seed=2009, hidden_size=32, num_hidden_layers=5, attn_layer_period=3, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
        mamba_d_state=8, mamba_dt_rank=5, mamba_proj_bias=False, vocab_size=61, tie_word_embeddings=False,
    ),
    # Jamba without experts (`num_experts` 1: a SwiGLU MLP after every mixer), attention first,
    # `mamba_dt_rank` "auto" (ceil(hidden / 16) = 2), projection biases, one kv head, tied head
    "jamba-dense": dict(
        family="jamba", seed=2010, hidden_size=32, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=0,
        expert_layer_period=1, expert_layer_offset=0, num_experts=1, num_experts_per_tok=1,
        num_attention_heads=4, num_key_value_heads=1, intermediate_size=40,
        mamba_d_state=6, mamba_dt_rank="auto", mamba_proj_bias=True, vocab_size=59, tie_word_embeddings=True,
    ),
})


class Float64Granite(Float64Everywhere):
    """`Float64Everywhere`, and a `dtype=torch.float32` argument of any function on float64
    input kept float64 too (eager attention's `softmax(..., dtype=torch.float32)`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
            # Nemotron 3's router casts with `.type(torch.float32)`.
            if func is torch.Tensor.type and len(args) > 1 and args[1] is torch.float32:
                return args[0]
        return super().__torch_function__(func, types, args, kwargs)


def float64_routers(model):
    """Nemotron 3's router keeps its weight and correction bias in float32 whatever the model's
    dtype: made float64 too, so the reference routes in float64."""
    for m in model.modules():
        if type(m).__name__ == "NemotronHTopkRouter":
            m.weight.data = m.weight.data.double()
            m.e_score_correction_bias.data = m.e_score_correction_bias.data.double()
    return model


def make_config(case: dict):
    kw = {k: v for k, v in case.items() if k not in ("seed", "family")}
    if case.get("family") == "bamba":
        return BambaConfig(**{**BAMBA_BASE, **kw})
    if case.get("family") == "nemotron_h":
        return NemotronHConfig(**{**NEMOTRON_BASE, **kw})
    if case.get("family") == "falcon_h1":
        return FalconH1Config(**{**FALCON_BASE, **kw})
    if case.get("family") == "jamba":
        return JambaConfig(**{**JAMBA_BASE, **kw})
    return GraniteMoeHybridConfig(**{**BASE, **kw})


def load_kw(case: dict) -> dict:
    """The eager (reference) implementations."""
    kw = {"attn_implementation": "eager"}
    if case.get("family") not in ("bamba", "falcon_h1"):
        kw["experts_implementation"] = "eager"
    return kw


def model_class(case: dict):
    family = case.get("family")
    classes = {"bamba": BambaForCausalLM, "nemotron_h": NemotronHForCausalLM, "falcon_h1": FalconH1ForCausalLM,
               "jamba": JambaForCausalLM}
    return classes.get(family, GraniteMoeHybridForCausalLM)


def random_value(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    normal = lambda mean, std: mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("A_log"):  # A = -exp(A_log) in [-8, -0.5]
        lo, hi = math.log(0.5), math.log(8.0)
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)
    if name.endswith("dt_bias"):
        return normal(-3.0, 1.5)
    if name.endswith(".D"):
        return normal(1.0, 0.5)
    if "norm" in name and name.endswith("weight"):
        return normal(1.0, 0.2)
    if name.endswith("embed_tokens.weight") or name.endswith("embeddings.weight"):
        return normal(0.0, 0.5)
    if name == "lm_head.weight":
        return normal(0.0, 0.3)
    if name.endswith("conv1d.weight"):
        return normal(0.0, 0.4)
    if name.endswith(".bias"):
        return normal(0.0, 0.2)
    if name.endswith("router.weight"):
        return normal(0.0, 0.5)
    if name.endswith("e_score_correction_bias"):
        return normal(0.0, 0.3)
    if name.endswith("weight") or name.endswith("gate_up_proj") or name.endswith("up_proj") or name.endswith("down_proj"):
        return normal(0.0, 0.2)
    raise KeyError(f"no random rule for parameter {name}")


def build_model(config, case):
    seed = case["seed"]
    torch.manual_seed(seed)
    model = model_class(case)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(random_value(name, p.shape, gen))
        for name, b in model.named_buffers():  # Nemotron 3's router correction bias
            if name.endswith("e_score_correction_bias"):
                b.copy_(random_value(name, b.shape, gen))
    return model


def hub_config(model, out: Path):
    """config.json with the hub's spellings (`layer_types` mamba/attention, as Granite 4.0 H ships)."""
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = ["mamba" if t == "linear_attention" else "attention" for t in model.config.layer_types]
    if cfg.get("position_embedding_type") in (None, "nope"):
        cfg["position_embedding_type"] = "nope"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def nemotron_hub_config(model, out: Path):
    """config.json with the hub's spelling of the blocks (`hybrid_override_pattern`, as Nemotron-H
    and Nemotron Nano 2 ship it), not transformers 5's list."""
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("layers_block_type", None)
    cfg["hybrid_override_pattern"] = model.config.hybrid_override_pattern
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def mixer(layer):
    """A layer's Mamba mixer, or None for an attention layer (Bamba's have no `mamba` at all) or a
    Nemotron-H `mlp` block."""
    if nemotron(layer):
        return layer.mixer if layer.block_type == "linear_attention" else None
    return getattr(layer, "mamba", None)


def nemotron(layer):
    return type(layer).__name__ == "NemotronHBlock"


def is_attention(layer):
    return mixer(layer) is None and (not nemotron(layer) or layer.block_type == "full_attention")


def attends(layer):
    """Whether a layer holds keys and values: an attention layer, or a Falcon-H1 layer (attention
    beside its Mamba mixer)."""
    return is_attention(layer) or type(layer).__name__ == "FalconH1DecoderLayer"


def picaso_index(model):
    """picaso's layer index of each block that holds a state (Nemotron-H's `mlp` blocks hold
    none and join the mixer block before them)."""
    out, n = {}, 0
    for i, layer in enumerate(model.model.layers):
        if mixer(layer) is not None or is_attention(layer):
            out[i] = n
            n += 1
    return out


def capture_in_proj(model):
    captured, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        if mixer(layer) is None:
            continue

        # Falcon-H1 scales in_proj's output by its µP vector before using it.
        scale = getattr(mixer(layer), "mup_vector", None)

        def hook(_m, _i, output, i=i, scale=scale):
            out = output.detach()[0]
            captured.setdefault(i, []).append(out if scale is None else out * scale[0, 0])

        # Jamba's time step is read after its RMSNorm (see `log_decay`).
        m = mixer(layer)
        handles.append((m.dt_layernorm if jamba(m) else m.in_proj).register_forward_hook(hook))
    return captured, handles


def hf_run(model, tokens, cache=None, position_ids=None):
    """One HF forward in float64 mode: (logits (T, V), cache, {layer: zxbcdt rows})."""
    if cache is not None and model.config.model_type == "jamba" and len(tokens) > 1:
        # transformers' Jamba scan ignores a cache's SSM state when it runs several tokens at once
        # (a TODO in its `mamba_scan_forward`); its one-token step reads it. So a continuation
        # from a cache runs one token at a time.
        steps = [hf_run(model, tokens[t:t + 1], cache, None if position_ids is None else position_ids[t:t + 1])
                 for t in range(len(tokens))]
        rows = {i: torch.cat([s[2][i] for s in steps]) for i in steps[0][2]}
        return torch.cat([s[0] for s in steps]), cache, rows
    captured, handles = capture_in_proj(model)
    cache = cache if cache is not None else DynamicCache(config=model.config)
    try:
        with torch.no_grad(), Float64Granite():
            kw = {} if position_ids is None else {"position_ids": position_ids[None]}
            out = model(input_ids=tokens[None], cache=cache, use_cache=True, **kw)
    finally:
        for h in handles:
            h.remove()
    return out.logits[0], cache, {i: torch.cat(v) for i, v in captured.items()}


def jamba(mixer):
    return type(mixer).__name__ == "JambaMambaMixer"


def log_decay(mixer, zxbcdt):
    if jamba(mixer):  # Mamba-1: `zxbcdt` is the normed low-rank time step; a decay per (channel, state)
        dt = F.softplus(zxbcdt @ mixer.dt_proj.weight.T + mixer.dt_proj.bias)
        return (dt[:, :, None] * -torch.exp(mixer.A_log)).sum(0)
    dt = F.softplus(zxbcdt[:, -mixer.num_heads:] + mixer.dt_bias)
    lo, hi = mixer.time_step_limit
    return (torch.clamp(dt, min=lo, max=hi) * -torch.exp(mixer.A_log)).sum(0)


def extract_states(model, cache, zxbcdt, tag):
    states = {}
    for i, layer in enumerate(model.model.layers):
        j = picaso_index(model).get(i)
        if mixer(layer) is not None:
            m = mixer(layer)
            ssm = cache.get_recurrent_state(i)[0]
            conv = cache.get_conv_state(i)[0]  # (conv_dim, K): last K inputs, oldest first
            want = (m.intermediate_size, m.ssm_state_size) if jamba(m) else (m.num_heads, m.head_dim, m.ssm_state_size)
            assert ssm.shape == want, ssm.shape
            states[f"{tag}.layers.{j}.ssm"] = ssm.clone()
            states[f"{tag}.layers.{j}.conv"] = conv[:, 1:].clone()
            states[f"{tag}.layers.{j}.log_decay"] = log_decay(m, zxbcdt[i])
        if attends(layer):
            states[f"{tag}.layers.{j}.k"] = cache.layers[i].keys[0].clone()  # (kv_heads, T, head_dim)
            states[f"{tag}.layers.{j}.v"] = cache.layers[i].values[0].clone()
    return states


def cache_from(model, parts: dict, n_tokens: int) -> DynamicCache:
    """An HF cache holding exactly `parts` (our layout): conv tails get a zero oldest column back."""
    cache = DynamicCache(config=model.config)
    K = getattr(model.config, "mamba_d_conv", None) or model.config.conv_kernel
    for i, layer in enumerate(model.model.layers):
        j = picaso_index(model).get(i)
        if mixer(layer) is not None:
            conv = parts[f"layers.{j}.conv"]
            conv_k = torch.cat([torch.zeros_like(conv[:, :1]), conv], dim=1)[None].clone()
            cache.update_conv_state(conv_k, i)
            cache.update_recurrent_state(parts[f"layers.{j}.ssm"][None].clone(), i)
            cache.layers[i].has_previous_state[0] = True
        if attends(layer):
            cache.layers[i].update(parts[f"layers.{j}.k"][None].clone(), parts[f"layers.{j}.v"][None].clone())
    assert conv_k.shape[-1] == K
    return cache


def caso(decays, ssms, order):
    """CASO of states in `order` (the last one is nearest the query): sum_i exp(sum_{j after i} log_decay_j) s_i."""
    out = torch.zeros_like(ssms[0])
    after = torch.zeros_like(decays[0])
    for i in reversed(order):
        decay = torch.exp(after)  # (H) of Mamba-2, (D, N) of Mamba-1
        out += decay.reshape(decay.shape + (1,) * (ssms[i].dim() - decay.dim())) * ssms[i]
        after = after + decays[i]
    return out


def picaso_r(states, n):
    """PICASO-R: the mean of CASO over the n rotations of the contexts' order."""
    out = {}
    for key in states[0]:
        if key.endswith(".ssm"):
            base = key[: -len(".ssm")]
            decays = [s[base + ".log_decay"] for s in states]
            ssms = [s[key] for s in states]
            rots = [[(r + j) % n for j in range(n)] for r in range(n)]
            out[key] = sum(caso(decays, ssms, o) for o in rots) / n
            out[base + ".log_decay"] = sum(decays)
        elif key.endswith(".conv"):
            out[key] = sum(s[key] for s in states) / n
        elif key.endswith(".k") or key.endswith(".v"):
            out[key] = torch.cat([s[key] for s in states], dim=1)  # union over tokens, contexts in order
    return out


def composed_case(model, tokens):
    """Contexts encoded alone, composed, and the query continued from an HF cache holding them."""
    at, contexts = 0, []
    for n in CONTEXTS:
        contexts.append(tokens[at : at + n])
        at += n
    query = tokens[at : at + QUERY]
    states = []
    for c in contexts:
        _, cache, zx = hf_run(model, c)
        s = extract_states(model, cache, zx, "x")
        states.append({k[2:]: v for k, v in s.items()})
    # A cache rebuilt from one context's own tensors continues as transformers' own cache does.
    one = cache_from(model, picaso_r(states[:1], 1), len(contexts[0]))
    n0 = len(contexts[0])
    alone, _, _ = hf_run(model, query, cache=one, position_ids=torch.arange(n0, n0 + QUERY))
    whole, _, _ = hf_run(model, torch.cat([contexts[0], query]))
    assert max_diff(alone, whole[n0:]) < 1e-9, max_diff(alone, whole[n0:])
    comp = picaso_r(states, len(states))
    cache = cache_from(model, comp, sum(CONTEXTS))
    start = max(CONTEXTS)  # RoPE: the query starts after the longest context
    logits, _, _ = hf_run(model, query, cache=cache, position_ids=torch.arange(start, start + QUERY))
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, query[1:, None])[:, 0]
    out = {f"composed.{k}": v for k, v in comp.items()}
    out["composed.query_logprobs"] = lp
    out["composed.query_logits"] = logits
    return out, query


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="testdata/granite")
    ap.add_argument("--cases", nargs="*", help="regenerate only these cases (the digests cover all)")
    a = ap.parse_args()
    check_float64_mode()
    root = Path(a.out)
    for name, case in CASES.items():
        if a.cases and name not in a.cases:
            continue
        out = root / name
        config = make_config(case)
        model32 = build_model(config, case)
        model32.save_pretrained(out / "hf", safe_serialization=True)
        (out / "hf" / "generation_config.json").unlink(missing_ok=True)
        if case.get("family") is None:
            hub_config(model32, out / "hf")
        elif case["family"] == "nemotron_h":
            nemotron_hub_config(model32, out / "hf")
        ref = float64_routers(model_class(case).from_pretrained(out / "hf", dtype=torch.float64, **load_kw(case)).eval())
        gen = torch.Generator().manual_seed(case["seed"] + 7)
        tokens = torch.randint(0, config.vocab_size, (SEQ_LEN,), generator=gen, dtype=torch.int64)
        logits, _, _ = hf_run(ref, tokens)
        logprobs = torch.log_softmax(logits, -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
        states, checks = {}, {}
        for tag, n in SNAPSHOTS.items():
            pl, cache, zx = hf_run(ref, tokens[:n])
            states.update(extract_states(ref, cache, zx, tag))
            checks[f"prefix_{tag}_logits"] = max_diff(pl, logits[:n])
            if n < SEQ_LEN:  # the Markov property in transformers itself
                # Positions given: Bamba's transformers code numbers a continuation from 0 otherwise.
                cont, _, _ = hf_run(ref, tokens[n:], cache=cache, position_ids=torch.arange(n, SEQ_LEN))
                checks[f"continue_from_{tag}"] = max_diff(cont, logits[n:])
        # How far rounding the large matrices to bf16 alone moves the log-probs: the scale
        # picaso's bf16 weights are held to (a model's sensitivity to it varies a lot).
        rounded = float64_routers(model_class(case).from_pretrained(out / "hf", dtype=torch.float64, **load_kw(case)).eval())
        with torch.no_grad():
            for pname, p in rounded.named_parameters():
                if p.dim() >= 2 and "conv1d" not in pname:
                    p.copy_(p.to(torch.bfloat16).to(torch.float64))
        rl, _, _ = hf_run(rounded, tokens)
        rlp = torch.log_softmax(rl, -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
        states["bf16_rounding_logprob_error"] = torch.tensor([max_diff(rlp, logprobs)])
        comp, query = composed_case(ref, tokens)
        states.update(comp)
        assert max(checks.values()) < 1e-9, checks
        meta = {"case": name, "transformers": transformers.__version__, "torch": torch.__version__,
                "snapshots": SNAPSHOTS, "contexts": CONTEXTS, "query": QUERY}
        write_expected(out, tokens, logits, logprobs, states, meta, {"checks": checks, "config": case})
        print(f"{name}: {json.dumps(checks)}")
    (root / "DIGESTS.json").write_text(json.dumps(file_digests(root), indent=2) + "\n")


if __name__ == "__main__":
    main()
