#!/usr/bin/env python3
"""Create an HF-transformers Granite 4.0 H folder (GraniteMoeHybridForCausalLM), a Falcon-H1 one
(FalconH1ForCausalLM) or a Jamba one (JambaForCausalLM), with random weights, for speed benchmarks
against llama.cpp on the same weights.

`--preset micro-like` (2.9 B): hidden 2560, 40 layers of which 4 attention (40 query / 8 key-value
heads of 64), Mamba-2 layers of 80 heads x 64, dense SwiGLU MLP of 4096: Granite 4.0 H-Micro's
layout (3 B, dense), sizes chosen here.
`--preset 350m-like`: hidden 768, 32 layers of which 4 attention (NoPE, 12 query / 4 key-value
heads of 64) evenly spread, Mamba-2 layers of 48 heads x 32 with state 128 and 1 group, conv 4,
dense SwiGLU MLP of 2048, tied embeddings: the layout of Granite 4.0 H-350M as IBM describes it,
with sizes chosen here (the hub's config is not reachable from this machine).
`--preset falcon-h1-0.5b-like` (0.55 B): hidden 1024, 36 layers, each a Mamba-2 mixer of 24 heads x 64
(state 128, 1 group) beside RoPE attention (8 query / 2 key-value heads of 64), dense SwiGLU MLP of
2048, untied head, µP multipliers away from 1: Falcon-H1-0.5B's layout, sizes chosen here.
`--preset jamba-small-like` (0.45 B): hidden 1024, 16 layers of which 2 attention (every 8th from
layer 4: 8 query / 2 key-value heads of 128, NoPE), Mamba-1 mixers of 2048 channels (state 16,
dt_rank 64) with RMSNorms on dt, B and C, and on every 2nd layer from layer 1 4 SwiGLU experts of
2048 (top 2), a dense SwiGLU MLP of 2048 on the rest, untied head: Jamba's layout at a size that
fits this machine, sizes chosen here. The vocabulary is
the GPT-NeoX tokenizer's (50,304 rows), which `--tokenizer` copies into the folder so that
llama.cpp's convert_hf_to_gguf.py accepts it. Weights come from transformers' own init (seeded),
stored as float32 safetensors.

Run:  python scripts/make_random_granite.py --preset 350m-like \
          --tokenizer ../shared/data/gpt-neox-20b-tokenizer/tokenizer.json --out /work/bench/granite-350m-like
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import (
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    JambaConfig,
    JambaForCausalLM,
)

from make_random_mamba2 import SPECIAL, copy_tokenizer  # same tokenizer files and special ids


def layer_types(n, attention):
    at = {round((k + 0.5) * n / len(attention)) for k in range(len(attention))} if attention else set()
    return ["attention" if i in at else "mamba" for i in range(n)]


PRESETS = {
    "350m-like": dict(hidden_size=768, num_hidden_layers=32, attention=4, num_attention_heads=12,
                      num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128,
                      mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=2048,
                      intermediate_size=2048, num_local_experts=0, num_experts_per_tok=0,
                      vocab_size=50304),
    "micro-like": dict(hidden_size=2560, num_hidden_layers=40, attention=4, num_attention_heads=40,
                       num_key_value_heads=8, mamba_n_heads=80, mamba_d_head=64, mamba_d_state=128,
                       mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=4096,
                       intermediate_size=4096, num_local_experts=0, num_experts_per_tok=0,
                       vocab_size=50304),
    "falcon-h1-0.5b-like": dict(family="falcon_h1", hidden_size=1024, num_hidden_layers=36, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=64, intermediate_size=2048, mamba_d_ssm=1536,
                                mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
                                mamba_d_conv=4, mamba_rms_norm=False, vocab_size=50304, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e11},
                                embedding_multiplier=5.66, lm_head_multiplier=0.039, key_multiplier=0.39,
                                attention_out_multiplier=0.94, ssm_in_multiplier=0.25, ssm_out_multiplier=0.24,
                                ssm_multipliers=[0.35, 0.25, 0.35, 0.5, 0.35], mlp_multipliers=[0.88, 0.59]),
    "jamba-small-like": dict(family="jamba", hidden_size=1024, num_hidden_layers=16, attn_layer_period=8,
                             attn_layer_offset=4, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=2048, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                             expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                             mamba_dt_rank=64, vocab_size=50304, tie_word_embeddings=False),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="350m-like")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json to copy into the folder")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="storage of the weights (bfloat16 as the hub's checkpoints; halves a large preset)")
    args = ap.parse_args()

    p = dict(PRESETS[args.preset])
    torch.manual_seed(args.seed)
    family = p.pop("family", None)
    falcon = family == "falcon_h1"
    if falcon:
        types = ["hybrid"] * p["num_hidden_layers"]
        config = FalconH1Config(**p, **SPECIAL)
        model = FalconH1ForCausalLM(config)
    elif family == "jamba":
        config = JambaConfig(**p, **SPECIAL)
        types = config.layers_block_type
        model = JambaForCausalLM(config)
    else:
        types = layer_types(p["num_hidden_layers"], range(p.pop("attention")))
        config = GraniteMoeHybridConfig(**p, layer_types=types, position_embedding_type="nope",
                                        tie_word_embeddings=True, embedding_multiplier=12.0,
                                        attention_multiplier=1 / 64, residual_multiplier=0.22,
                                        logits_scaling=3.0, **SPECIAL)
        model = GraniteMoeHybridForCausalLM(config)
    model = model.to(getattr(torch, args.dtype)).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    if family is None:
        # The hub's spelling of the layer types ("mamba" / "attention"): transformers 5 writes its own
        # ("linear_attention" / "full_attention"), which llama.cpp's converter does not read.
        cfg_path = args.out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["layer_types"] = types
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")

    if args.tokenizer:
        copy_tokenizer(args.tokenizer, args.out)

    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        lg = model.float()(ids).logits
    assert torch.isfinite(lg).all(), "non-finite logits"
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, layer types "
          f"{''.join({'attention': 'A', 'hybrid': 'H'}.get(t, 'm') for t in types)}, logits std {lg.std():.3f}")


if __name__ == "__main__":
    main()
