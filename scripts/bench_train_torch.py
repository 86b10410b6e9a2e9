#!/usr/bin/env python3
"""Training-speed peer: one pretraining step of HF transformers' Mamba2ForCausalLM on CPU.

A step is what `picaso train pretrain` does: forward over a (batch, seq_len) window, mean
cross-entropy, backward, gradient clipping and an AdamW update. transformers runs its pure
PyTorch chunked scan (torch_forward; the CUDA kernels are not used on CPU). Reports tokens/s of
each timed step after two warmup steps, as one JSON line. `--bf16` runs the forward and
backward under torch.autocast(bfloat16).

Run:  /work/pyenv/venv/bin/python scripts/bench_train_torch.py --batch 4 --seq-len 1024
(scripts/bench_train.sh runs it and `step_profile` alternately on the same shapes.)
"""

import argparse
import json
import time

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM
from transformers.utils import logging


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-state", type=int, default=64)
    ap.add_argument("--headdim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()

    logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = Mamba2Config(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        num_hidden_layers=args.layers,
        state_size=args.d_state,
        head_dim=args.headdim,
        num_heads=2 * args.d_model // args.headdim,
        expand=2,
        n_groups=1,
        conv_kernel=4,
        chunk_size=args.chunk,
        tie_word_embeddings=True,
        use_bias=False,
        use_conv_bias=True,
    )
    model = Mamba2ForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(2):
        step()
    rates = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        rates.append(args.batch * args.seq_len / (time.perf_counter() - t0))
    print(
        json.dumps(
            {
                "engine": "torch " + torch.__version__ + " / transformers Mamba2ForCausalLM",
                "bf16_autocast": args.bf16,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "threads": args.threads,
                "params": sum(p.numel() for p in model.parameters()),
                "tokens_per_s": rates,
            }
        )
    )


if __name__ == "__main__":
    main()
