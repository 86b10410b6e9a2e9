#!/usr/bin/env python3
"""How a state's values are distributed, and what each way of grouping them costs in int8/int4.

Reads f32 state files (`picaso state --out F`) and prints, per tensor kind (ssm, conv, k, v):
how far magnitudes spread between heads, within a row and between tokens, and the relative
error ||x - Q(x)|| / ||x|| of symmetric absmax quantization with one scale per

  group32  32 consecutive values of the flat tensor (what picaso stores)
  row      the innermost axis (ssm: d_state; k/v: head_dim; conv: d_conv - 1)
  head     the first axis (ssm: a head; k/v: a kv head, all its tokens)
  tensor   the whole tensor
  channel  (k/v only) one channel of one head across every token (KIVI's choice for keys)

Usage: python scripts/state_value_stats.py STATE.safetensors [...]   (needs numpy, safetensors)
"""
import sys
from collections import defaultdict

import numpy as np
from safetensors.numpy import load_file


def quantize(x, axis_groups, qmax):
    """x grouped by reshaping to (groups, size); symmetric absmax per group."""
    g = axis_groups(x)
    s = np.abs(g).max(axis=1, keepdims=True) / qmax
    s[s == 0] = 1
    return (np.clip(np.round(g / s), -qmax, qmax) * s).reshape(-1), g.reshape(-1)


def group32(x):
    flat = x.reshape(-1)
    pad = (-len(flat)) % 32
    return np.concatenate([flat, np.zeros(pad, flat.dtype)]).reshape(-1, 32)


def groupings(kind, x):
    out = {
        "group32": group32,
        "row": lambda t: t.reshape(-1, t.shape[-1]),
        "head": lambda t: t.reshape(t.shape[0], -1),
        "tensor": lambda t: t.reshape(1, -1),
    }
    if kind in ("k", "v"):  # (kv_heads, T, head_dim)
        out["channel"] = lambda t: np.transpose(t, (0, 2, 1)).reshape(-1, t.shape[1])
    return out


def main(paths):
    err = defaultdict(list)
    spread = defaultdict(list)
    for p in paths:
        for name, x in load_file(p).items():
            kind = name.rsplit(".", 1)[-1]
            if kind == "log_decay" or x.size == 0:
                continue
            x = x.astype(np.float64)
            a = np.abs(x)
            head_max = a.reshape(x.shape[0], -1).max(axis=1)
            row_max = a.reshape(-1, x.shape[-1]).max(axis=1)
            spread[kind].append(
                (
                    head_max.max() / max(head_max[head_max > 0].min(), 1e-30),
                    np.median(row_max / np.maximum(a.reshape(-1, x.shape[-1]).mean(axis=1), 1e-30)),
                    np.mean(((x - x.mean()) / x.std()) ** 4) if x.std() > 0 else 0.0,
                )
            )
            norm = np.linalg.norm(x)
            if norm == 0:
                continue
            for gname, fn in groupings(kind, x).items():
                for bits, qmax in (("int8", 127), ("int4", 7)):
                    q, orig = quantize(x, fn, qmax)
                    err[(kind, gname, bits)].append(np.linalg.norm(q - orig) / norm)
    print("kind  max/min head magnitude  median row max/mean  kurtosis   (medians over tensors)")
    for kind, rows in sorted(spread.items()):
        r = np.median(np.array(rows), axis=0)
        print(f"{kind:<5} {r[0]:>22.1f} {r[1]:>20.2f} {r[2]:>9.1f}")
    print("\nrelative error ||x - Q(x)|| / ||x|| (median over tensors)")
    for kind in sorted({k for k, _, _ in err}):
        cells = []
        for gname in ("group32", "row", "head", "tensor", "channel"):
            if (kind, gname, "int8") in err:
                e8, e4 = (np.median(err[(kind, gname, b)]) for b in ("int8", "int4"))
                cells.append(f"{gname} {e8:.4f}/{e4:.4f}")
        print(f"{kind:<5} int8/int4: " + "  ".join(cells))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
