"""A Granite-4.0-H-shaped hybrid language model in PyTorch, for `train_gpu.py` (run files with
`"arch": "granite_hybrid"`).

Attention layers without positional encoding (NoPE) among Mamba-2 layers, each layer followed
by a SwiGLU MLP, dense (no experts), tied embeddings. Parameters are named as transformers'
`GraniteMoeHybridForCausalLM`, so the exported folder loads there and in picaso; `--check`
compares the forward with transformers' on the CPU in f64.

Run-file keys beyond the Mamba-2 ones (d_model, n_layer, d_state, headdim, vocab, n_groups):
`attention` (the indices of the attention layers), `attn_heads`, `kv_heads`, `attn_head_dim`,
`mlp` (the MLP's intermediate size).
"""
import math

import torch
import torch.nn.functional as F

from train_gpu import RMSNorm, Mixer, wide


class Attention(torch.nn.Module):
    """Causal grouped-query attention without positions, softmax scale 1/sqrt(head_dim) (exported
    as `attention_multiplier`); names as transformers' `GraniteMoeHybridAttention`."""

    def __init__(self, d, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.q_proj = torch.nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, h):
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads  # query head j reads kv head j // rep (transformers' repeat_kv)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(torch.nn.Module):
    """SwiGLU, names as transformers' `GraniteMoeHybridMLP` (gate and up in one matrix)."""

    def __init__(self, d, inner):
        super().__init__()
        self.input_linear = torch.nn.Linear(d, 2 * inner, bias=False)
        self.output_linear = torch.nn.Linear(inner, d, bias=False)

    def forward(self, h):
        gate, up = self.input_linear(h).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class Layer(torch.nn.Module):
    def __init__(self, run, attention):
        super().__init__()
        d = run["d_model"]
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d), RMSNorm(d)
        if attention:
            self.self_attn = Attention(d, run["attn_heads"], run["kv_heads"], run["attn_head_dim"])
        else:
            self.mamba = Mixer(d, run["d_state"], run["headdim"], run.get("chunk", 128), run.get("n_groups", 1))
        self.shared_mlp = MLP(d, run["mlp"])

    def forward(self, h):
        h = h.to(wide(h.dtype))
        x = self.input_layernorm(h)
        h = h + (self.self_attn(x) if hasattr(self, "self_attn") else self.mamba(x))
        return h + self.shared_mlp(self.post_attention_layernorm(h))


class Body(torch.nn.Module):
    def __init__(self, run):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(run["vocab"], run["d_model"])
        att = set(run["attention"])
        self.layers = torch.nn.ModuleList([Layer(run, i in att) for i in range(run["n_layer"])])
        self.norm = RMSNorm(run["d_model"])


class HybridLM(torch.nn.Module):
    """`GraniteMoeHybridForCausalLM` with every multiplier 1, no experts and a tied head."""

    def __init__(self, run):
        super().__init__()
        self.model = Body(run)

    def forward(self, input_ids):
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h)
        h = self.model.norm(h)
        return h.to(self.model.embed_tokens.weight.dtype) @ self.model.embed_tokens.weight.T

    def mixers(self):
        return [layer.mamba for layer in self.model.layers if hasattr(layer, "mamba")]


def params(run):
    """Parameter count (tied embeddings)."""
    d, n, g, L, v = run["d_model"], run["d_state"], run.get("n_groups", 1), run["n_layer"], run["vocab"]
    di, h = 2 * d, 2 * d // run["headdim"]
    conv = di + 2 * g * n
    mamba = d * (2 * di + 2 * g * n + h) + conv * 4 + conv + 3 * h + di + di * d
    hd = run["attn_head_dim"]
    attn = d * hd * (2 * run["attn_heads"] + 2 * run["kv_heads"])
    mlp = 3 * d * run["mlp"] + 2 * d
    a = len(run["attention"])
    return v * d + (L - a) * mamba + a * attn + L * mlp + d


def layer_types(run):
    att = set(run["attention"])
    return ["attention" if i in att else "mamba" for i in range(run["n_layer"])]


def config(run):
    """config.json for transformers' `GraniteMoeHybridForCausalLM` (the hub's field names)."""
    d, hd = run["d_model"], run["headdim"]
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": run["vocab"], "hidden_size": d, "num_hidden_layers": run["n_layer"],
        "layer_types": layer_types(run), "position_embedding_type": "nope",
        "num_attention_heads": run["attn_heads"], "num_key_value_heads": run["kv_heads"],
        "attention_multiplier": 1.0 / math.sqrt(run["attn_head_dim"]), "attention_bias": False,
        "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
        "num_local_experts": 0, "num_experts_per_tok": 0, "intermediate_size": run["mlp"],
        "shared_intermediate_size": run["mlp"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "mamba_n_heads": 2 * d // hd, "mamba_d_head": hd, "mamba_n_groups": run.get("n_groups", 1),
        "mamba_d_state": run["d_state"], "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_chunk_size": run.get("chunk", 256), "mamba_conv_bias": True, "mamba_proj_bias": False,
        "time_step_limit": [0.0, {"__float__": "Infinity"}], "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }


@torch.no_grad()
def init_weights(model, run, g, init_mixer):
    """Embedding, projections into the residual stream N(0, 0.02); the projections out of it
    (out_proj, o_proj, the MLP's output) N(0, 0.02 / sqrt(2 n_layer)) as GPT-2 does for two
    residual branches per layer; each Mamba mixer as `train_gpu.init_weights` (dt, A, conv,
    long memory, mimetic)."""
    L = run["n_layer"]
    out_std = 0.02 / math.sqrt(2 * L)
    normal = lambda w, std: w.copy_(torch.randn(w.shape, generator=g) * std)
    normal(model.model.embed_tokens.weight, 0.02)
    for layer in model.model.layers:
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        if hasattr(layer, "self_attn"):
            a = layer.self_attn
            for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight):
                normal(w, 0.02)
            normal(a.o_proj.weight, out_std)
        else:
            init_mixer(layer.mamba, run, g, out_std)
        normal(layer.shared_mlp.input_linear.weight, 0.02)
        normal(layer.shared_mlp.output_linear.weight, out_std)
    model.model.norm.weight.fill_(1.0)


def export_names(state_dict):
    """The tensors transformers' checkpoint holds (the tied head left out)."""
    return {k: v for k, v in state_dict.items() if k != "lm_head.weight"}


@torch.no_grad()
def check_against_transformers(run, init_mixer, seed=0):
    """One random hybrid in this module and in transformers' `GraniteMoeHybridForCausalLM`,
    logits compared on the CPU in f64 (a length that is not a multiple of the chunk)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    ours = HybridLM(run).double()
    init_weights(ours, run, torch.Generator().manual_seed(seed), init_mixer)
    cfg = config(run)
    cfg["time_step_limit"] = [0.0, float("inf")]
    cfg["mamba_chunk_size"] = run.get("chunk", 128)
    for k in ("architectures", "model_type"):
        cfg.pop(k)
    ref = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**cfg)).double().eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    x = torch.randint(0, run["vocab"], (2, run.get("chunk", 128) + 37), generator=torch.Generator().manual_seed(seed))
    a, b = ours(x), ref(input_ids=x, use_cache=False).logits
    err = (a - b).abs().max().item()
    print(f"hybrid {layer_types(run)}: max |logit difference| against transformers: {err:.3e}", flush=True)
    assert err < 1e-5, err
