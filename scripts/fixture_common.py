"""Helpers shared by the HF reference fixture scripts (make_mamba1_fixtures.py,
make_mamba2_fixtures.py): the float64 reference mode, comparisons, and byte-deterministic
safetensors output."""

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes
from torch.overrides import TorchFunctionMode


class Float64Everywhere(TorchFunctionMode):
    """Turn every float64 -> float32 cast into a no-op.

    HF's Mamba and Mamba-2 hard-code float32 up/down-casts (`.float()`, `.to(torch.float32)`) in
    the RMSNorms, the fp32 residual, the scans and the decode steps (Mamba-2 also in the gated
    norm; Mamba-1 also on A_log, D, dt_proj.bias, B and the logits), so `model.double()` alone
    still computes part of each layer in float32. Inside this mode those casts keep float64.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            if func is torch.Tensor.float:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
                if kwargs.get("dtype") is torch.float32:
                    kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def check_float64_mode():
    with Float64Everywhere():
        t = torch.ones(3, dtype=torch.float64) / 3
        assert t.float().dtype == torch.float64
        assert t.to(torch.float32).dtype == torch.float64
        assert t.to(dtype=torch.float32).dtype == torch.float64
        assert t.to("cpu", torch.float32).dtype == torch.float64


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def deterministic_safetensors(tensors: dict, metadata: dict) -> bytes:
    """safetensors bytes with a canonical header (the library orders `__metadata__` randomly)."""
    raw = safetensors_bytes(tensors, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def write_expected(out: Path, tokens, logits, logprobs, states, meta: dict, info: dict):
    tensors = {"tokens": tokens.clone(), "logprobs": logprobs.float(), "logits": logits.float()}
    tensors.update({k: v.float().contiguous() for k, v in states.items()})
    st_meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in meta.items()}
    (out / "expected.safetensors").write_bytes(deterministic_safetensors(tensors, st_meta))
    doc = dict(meta)
    doc.update(info)
    doc["tensors"] = {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                      for k, v in sorted(tensors.items())}
    (out / "expected.json").write_text(json.dumps(doc, indent=2) + "\n")


def file_digests(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
