#!/usr/bin/env python3
"""Create an HF-transformers-format Mamba-1 model folder with random weights (for speed benchmarks).

`--preset 130m` has the shape of state-spaces/mamba-130m-hf (hidden 768, 24 layers, state 16,
conv 4, expand 2, dt rank 48, vocab 50280, tied embeddings). Weights come from transformers' own
`MambaForCausalLM` init (seeded with `--seed`), stored as float32 safetensors.

Run:  /work/pyenv/venv/bin/python scripts/make_random_mamba1.py --preset 130m --out /work/bench/mamba1-130m-random
"""

import argparse
from pathlib import Path

import torch
from transformers import MambaConfig, MambaForCausalLM

PRESETS = {
    "130m": dict(hidden_size=768, num_hidden_layers=24, state_size=16, conv_kernel=4, expand=2,
                 time_step_rank=48, vocab_size=50280, tie_word_embeddings=True, layer_norm_epsilon=1e-5),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="130m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    config = MambaConfig(**PRESETS[args.preset], bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = MambaForCausalLM(config).to(torch.float32).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)


if __name__ == "__main__":
    main()
