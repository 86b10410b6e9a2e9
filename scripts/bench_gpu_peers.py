#!/usr/bin/env python3
"""picaso's GPU engine beside the official mamba_ssm 2.3, interleaved round by round, on one GPU.

Run by scripts/gpu_bench.sh on a lent GPU machine (torch, Triton and einops installed; no
mamba_ssm: its PyPI sdist, fetched by gpu_bench_prepare.sh, is unpacked and put on sys.path with
an empty stand-in for the Mamba-1 CUDA extension `selective_scan_cuda` that its __init__ imports;
`causal_conv1d` is absent, so Mamba2 runs with use_mem_eff_path=False and falls back to F.conv1d
for the prefill's convolution and to torch ops for the decode step's).

Both sides run the same random weights (written once per shape by `picaso random-model`, f32,
loaded by mamba_ssm after renaming `backbone.embeddings` to `backbone.embedding`; bf16 on both
sides), and the next-token log-probs of one prompt are compared as a cross-check. Measured:
prefill tokens/s at 512 and 4,096 tokens, decode ms/token at batch 1 and 16 (mamba_ssm with CUDA
graphs, cg=True, as the paper's timings), and Concat's time to a ready state for k contexts of
256 tokens beside picaso's composition (`bench-context`). Every picaso ÷ mamba_ssm ratio is kept
under a key that names mamba_ssm. `--cpu-dry-run` runs the picaso side on the CPU engine and skips
the peer, to try the script on a machine without a GPU.
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
import types

SHAPES = {  # d_model, n_layer (mamba2-130m and mamba2-2.7b; headdim 64, d_state 128, 1 group)
    "130m": (768, 24),
    "2.7b": (2560, 64),
}
VOCAB = 50288


def random_model(binary, shape, work):
    """The folder of `shape`'s random weights (seed 0), written once."""
    out = os.path.join(work, f"random-{shape}")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        subprocess.run(["rm", "-rf", out], check=True)
        subprocess.run([binary, "random-model", "--shape", shape, "--out", out], check=True)
    return out


def picaso_bench(binary, device, model, prompt, decode_batch, repeats, graphs=True):
    """`picaso bench`; graphs=False launches each decode kernel instead of replaying the
    recorded CUDA graph (PICASO_CUDA_GRAPHS=0)."""
    cmd = [binary, "bench", "--device", device, "--model", model, "--weights", "bf16",
           "--prompt-tokens", str(prompt), "--decode-tokens", "64", "--decode-batch", str(decode_batch),
           "--compose-n", "0", "--repeats", str(repeats), "--json"]
    env = dict(os.environ, PICASO_CUDA_GRAPHS="1" if graphs else "0")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def picaso_context(binary, device, model, max_k):
    cmd = [binary, "bench-context", "--device", device, "--model", model, "--weights", "bf16",
           "--max-k", str(max_k), "--context-tokens", "256", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


class Peer:
    """mamba_ssm's MambaLMHeadModel with random bf16 weights."""

    def __init__(self, sdist, work, shape, weights):
        import torch
        src = os.path.join(work, "mamba_ssm-2.3.0")
        if not os.path.isdir(src):
            with tarfile.open(sdist) as t:
                t.extractall(work)
        sys.path.insert(0, src)
        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        d_model, n_layer = SHAPES[shape]
        cfg = MambaConfig(d_model=d_model, n_layer=n_layer, vocab_size=VOCAB, pad_vocab_size_multiple=16,
                          ssm_cfg={"layer": "Mamba2", "d_state": 128, "headdim": 64, "ngroups": 1,
                                   "use_mem_eff_path": False},
                          rms_norm=True, residual_in_fp32=True, fused_add_norm=True, tie_embeddings=True)
        torch.manual_seed(0)
        self.torch = torch
        self.model = MambaLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16).eval()
        self.same_weights = False
        try:
            from safetensors.torch import load_file
            sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v
                  for k, v in load_file(os.path.join(weights, "model.safetensors")).items()}
            missing, unexpected = self.model.load_state_dict(sd, strict=False)
            self.same_weights = not unexpected and all(k == "lm_head.weight" for k in missing)
            print("mamba_ssm loaded picaso's weights" if self.same_weights else
                  f"mamba_ssm: weights not loaded (missing {missing[:4]}, unexpected {unexpected[:4]})")
        except Exception as e:  # noqa: BLE001 (a report, not a failure: timings need no values)
            print("mamba_ssm: random init, picaso's weights not loaded:", e)

    def logprobs(self, ids):
        """log p(ids[i+1] | ids[..=i]) for one prompt, float64 on the host."""
        torch = self.torch
        with torch.inference_mode():
            x = torch.tensor([ids], device="cuda")
            logits = self.model(x).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0]
        return lp.double().cpu().tolist()

    def _ids(self, batch, n):
        return self.torch.randint(0, VOCAB, (batch, n), device="cuda")

    def _best(self, f, repeats):
        torch = self.torch
        f()
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    def prefill_tokens_per_s(self, n, repeats):
        ids = self._ids(1, n)
        with self.torch.inference_mode():
            t = self._best(lambda: self.model(ids, num_last_tokens=1), repeats)
        return n / t

    def decode_ms_per_token(self, batch, prompt, repeats, tokens=64):
        ids = self._ids(batch, prompt)
        def run(new):
            self.model.generate(ids, max_length=prompt + new, cg=True, top_k=1, eos_token_id=None)
        with self.torch.inference_mode():
            whole = self._best(lambda: run(tokens), repeats)
            first = self._best(lambda: run(1), repeats)
        return 1e3 * (whole - first) / (tokens - 1)

    def concat_ready_ms(self, k, repeats):
        return 1e3 * self._best(lambda: self.model(self._ids(1, 256 * k), num_last_tokens=1), repeats)


def gpu_bandwidth_tb_s(name):
    for key, bw in [("H200", 4.8), ("H100", 3.35), ("A100", 2.0)]:
        if key in name:
            return bw
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--picaso", required=True)
    ap.add_argument("--mamba-ssm", help="mamba_ssm-2.3.0.tar.gz (the PyPI sdist)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default="130m,2.7b")
    ap.add_argument("--work", default="/tmp/gpu-bench-peer")
    ap.add_argument("--cpu-dry-run", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    device = "cpu" if a.cpu_dry_run else "cuda"
    gpu = "none (cpu dry run)"
    if not a.cpu_dry_run:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"revision": rev or os.environ.get("PICASO_REVISION", "unknown"), "gpu": gpu, "device": device,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rounds": a.rounds,
              "peer": "mamba_ssm 2.3.0 (Triton SSD kernels; F.conv1d, no causal_conv1d; generate with cg=True)",
              "shapes": {}}
    for shape in a.shapes.split(","):
        rows = {"picaso": [], "mamba_ssm": []}
        model = random_model(a.picaso, shape, a.work)
        peer, cross = None, None
        if not a.cpu_dry_run:
            peer = Peer(a.mamba_ssm, a.work, shape, model)
            if peer.same_weights:
                ids = [(i * 2654435761 + 12345) % 50000 for i in range(64)]
                out = subprocess.run([a.picaso, "score", "--device", device, "--model", model, "--weights", "bf16",
                                      "--token-ids", ",".join(map(str, ids)), "--json"],
                                     check=True, capture_output=True, text=True).stdout
                mine, theirs = json.loads(out)["logprobs"], peer.logprobs(ids)
                cross = {"tokens": len(mine), "max_abs_logprob_diff_bf16": max(abs(x - y) for x, y in zip(mine, theirs))}
                print("picaso vs mamba_ssm, same weights:", cross, flush=True)
        # The 2.7b shapes load 10.8 GB per picaso call: one round there keeps a lent GPU's call short.
        for r in range(a.rounds if shape == "130m" else 1):
            short = picaso_bench(a.picaso, device, model, 512, 16, 2)
            long_ = picaso_bench(a.picaso, device, model, 4096, 0, 2) if not a.cpu_dry_run else None
            # What the decode step's CUDA graph saves (the 130m shapes, where launches dominate).
            eager = picaso_bench(a.picaso, device, model, 512, 16, 2, graphs=False) if shape == "130m" else None
            rows["picaso"].append({
                "prefill_512_tokens_per_s": short["prefill_tokens_per_s"],
                "prefill_4096_tokens_per_s": long_["prefill_tokens_per_s"] if long_ else None,
                "decode_ms_per_token_batch1": 1e3 / short["decode_tokens_per_s"],
                "decode_ms_per_step_batch16": 16e3 / short["batched_decode_tokens_per_s"],
                "decode_ms_per_token_batch1_no_graph": 1e3 / eager["decode_tokens_per_s"] if eager else None,
                "decode_ms_per_step_batch16_no_graph": 16e3 / eager["batched_decode_tokens_per_s"] if eager else None,
            })
            if peer is not None:
                rows["mamba_ssm"].append({
                    "prefill_512_tokens_per_s": peer.prefill_tokens_per_s(512, 2),
                    "prefill_4096_tokens_per_s": peer.prefill_tokens_per_s(4096, 2),
                    "decode_ms_per_token_batch1": peer.decode_ms_per_token(1, 16, 2),
                    "decode_ms_per_step_batch16": peer.decode_ms_per_token(16, 16, 2),
                })
            print(shape, "round", r, json.dumps({k: v[-1] for k, v in rows.items() if v}), flush=True)
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
        summary = {side: {key: med([row[key] for row in rs if row[key] is not None]) for key in rs[0]}
                   for side, rs in rows.items() if rs}
        ratios = {}
        if "mamba_ssm" in summary:
            p, m = summary["picaso"], summary["mamba_ssm"]
            for key in p:
                if p[key] and m.get(key):
                    better_high = key.startswith("prefill")
                    ratios[f"picaso_over_mamba_ssm_{key}"] = p[key] / m[key] if better_high else m[key] / p[key]
        d_model, n_layer = SHAPES[shape]
        params = n_layer * (d_model * (2 * 2 * d_model + 2 * 128 + 2 * d_model // 64) + 2 * d_model * d_model) + VOCAB * d_model
        state_bytes = n_layer * (2 * d_model // 64) * 64 * 128 * 4
        bytes_step = 2 * params + 2 * state_bytes  # bf16 weights read once; the f32 state read and written
        decode_s = summary["picaso"]["decode_ms_per_token_batch1"] / 1e3
        bw = gpu_bandwidth_tb_s(gpu)
        context = picaso_context(a.picaso, device, model, 10)
        concat_peer = {k: peer.concat_ready_ms(k, 3) for k in range(1, 11)} if peer is not None else None
        report["shapes"][shape] = {
            "rounds": rows, "median": summary, "ratios": ratios, "same_weights_check": cross,
            "decode_bytes_per_step": bytes_step,
            "decode_gb_per_s": bytes_step / decode_s / 1e9,
            "decode_fraction_of_bandwidth": (bytes_step / decode_s / 1e12 / bw) if bw else None,
            "ready_state": {"picaso_bench_context": context, "mamba_ssm_concat_ms": concat_peer},
        }
        del peer
        with open(a.out, "w") as f:  # after each shape, so a call cut short keeps what it measured
            json.dump(report, f, indent=1)
    print(json.dumps({s: v["ratios"] for s, v in report["shapes"].items()}, indent=1))


if __name__ == "__main__":
    main()
