#!/usr/bin/env python3
"""Speed peer: HF transformers Mamba-1 or Mamba-2 on CPU (prefill and greedy decode tokens/s).

Prefill: one forward over `--prefill` random token ids, `use_cache=False` (no cache, "model(input_ids)")
and `use_cache=True` (also builds the recurrent cache; note config.use_cache=True makes this the
default of a bare `model(input_ids)`). Best of `--reps` after one warmup.
Decode: greedy, `--decode` new tokens after a `--prompt`-token random prompt, timed per new token
only (prompt prefill excluded), best of `--reps`. Main number: a manual loop feeding one token at a
time with `cache_params` (argmax); also reported: `model.generate` (greedy,
min_new_tokens=max_new_tokens), decode rate = decode / (t(1 + decode new tokens) - t(1 new token)).
Prints one JSON line.

Run:  /work/pyenv/venv/bin/python scripts/bench_transformers.py /work/bench/mamba2-130m-random --dtype bf16
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging


def best_time(fn, reps):
    fn()  # warmup
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()  # by model_type
    vocab = min(model.config.vocab_size, 50277)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (1, args.prefill), generator=g)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=g)

    res = {"engine": "transformers", "dtype": args.dtype, "arch": model.config.model_type}
    with torch.inference_mode():
        t_nc = best_time(lambda: model(ids, use_cache=False), args.reps)
        t_c = best_time(lambda: model(ids, use_cache=True), args.reps)
        res["prefill_tokens_per_s"] = args.prefill / t_nc
        res["prefill_tokens_per_s_use_cache"] = args.prefill / t_c

        def manual_decode():
            out = model(prompt, use_cache=True)
            cache, tok = out.cache_params, out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(args.decode):
                out = model(tok, cache_params=cache, use_cache=True)
                cache, tok = out.cache_params, out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t0

        manual_decode()
        t_dec = min(manual_decode() for _ in range(args.reps))
        res["decode_tokens_per_s"] = args.decode / t_dec

        def gen(n):
            return lambda: model.generate(prompt, do_sample=False, min_new_tokens=n, max_new_tokens=n,
                                          attention_mask=torch.ones_like(prompt), pad_token_id=1)
        t_g1 = best_time(gen(1), args.reps)
        t_gn = best_time(gen(1 + args.decode), args.reps)
        res["decode_tokens_per_s_generate"] = args.decode / (t_gn - t_g1)
    res.update(decode_method="manual loop with cache_params (argmax)", prefill_tokens=args.prefill,
               prompt_tokens=args.prompt, decode_tokens=args.decode, threads=args.threads,
               torch=torch.__version__)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
