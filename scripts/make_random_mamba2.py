#!/usr/bin/env python3
"""Create an HF-transformers-format Mamba-2 model folder with random weights (for speed benchmarks).

`--preset 130m` has the shape of state-spaces/mamba2-130m (hidden 768, 24 layers, 24 heads x 64,
state 128, 1 group, conv 4, vocab 50288, tied embeddings). Weights come from transformers' own
`Mamba2ForCausalLM` init (seeded with `--seed`), stored as float32 safetensors. `--tokenizer` copies
a tokenizer.json (GPT-NeoX-20B) into the folder and writes a matching tokenizer_config.json.

Run:  /work/pyenv/venv/bin/python scripts/make_random_mamba2.py --preset 130m \
          --tokenizer ../shared/data/gpt-neox-20b-tokenizer/tokenizer.json --out /work/bench/mamba2-130m-random
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

PRESETS = {
    "130m": dict(hidden_size=768, num_hidden_layers=24, state_size=128, head_dim=64, num_heads=24,
                 expand=2, n_groups=1, conv_kernel=4, vocab_size=50288, tie_word_embeddings=True,
                 layer_norm_epsilon=1e-5),
}
# GPT-NeoX token ids: <|endoftext|> = 0 (bos/eos), <|padding|> = 1.
SPECIAL = dict(bos_token_id=0, eos_token_id=0, pad_token_id=1)


def copy_tokenizer(tokenizer: Path, out: Path):
    """Copies a GPT-NeoX tokenizer.json into `out` with a matching tokenizer_config.json (what
    transformers and llama.cpp's converter read). make_random_granite.py uses it too."""
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    tok_cfg = {"tokenizer_class": "GPTNeoXTokenizer", "bos_token": "<|endoftext|>",
               "eos_token": "<|endoftext|>", "pad_token": "<|padding|>", "unk_token": "<|endoftext|>",
               "add_bos_token": False, "add_eos_token": False, "model_max_length": 1000000000}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="130m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json to copy into the folder")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    config = Mamba2Config(**PRESETS[args.preset], **SPECIAL)
    model = Mamba2ForCausalLM(config).to(torch.float32).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)

    if args.tokenizer:
        copy_tokenizer(args.tokenizer, args.out)

    # Sanity check: activations and logits of the random model should be finite and O(1).
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    h, lg = out.hidden_states[-1], out.logits
    assert torch.isfinite(lg).all(), "non-finite logits"
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"last hidden std {h.std():.3f}, logits std {lg.std():.3f}, "
          f"top-1 prob mean {lg.softmax(-1).max(-1).values.mean():.4f}")


if __name__ == "__main__":
    main()
