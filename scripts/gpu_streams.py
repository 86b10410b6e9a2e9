#!/usr/bin/env python3
"""Writes picaso's token cache as the compressed u16 streams that travel to a GPU machine.

A lent GPU machine has no corpus and takes at most 64 MiB of ignored files per call, so the
training stream goes in two halves cut at an article boundary (each .xz under the limit), with
the validation stream and the held-out paragraph pairs beside the first:

    picaso train pretrain --config models/training/gpu-streams.json --out RUN \\
        --corpus wikipedia:../shared/data/wikipedia-en/articles.txt.gz \\
        --tokenizer models/picaso-mamba2/tokenizer.json --stop-after 0
    python3 scripts/gpu_streams.py --tokens RUN/tokens.bin --out .gpu

writes .gpu/a/{train-a.u16.xz, val.u16.xz, pairs.json.xz} and .gpu/b/train-b.u16.xz, the inputs
of scripts/gpu_recipe.py and scripts/pack_neighbours.py. Articles end in token 0 (<|endoftext|>).
`--first N` keeps only about N training tokens (whole articles), all in a/, for a call whose
working tree leaves little room: the repository itself travels with every call (55 MB of it in
November 2026, of the 64 MiB a call takes).
"""
import argparse
import json
import lzma
import os
import struct

import numpy as np


def read_u16(path):
    """A raw little-endian u16 token stream (.xz allowed), read-only."""
    raw = lzma.open(path).read() if path.endswith(".xz") else open(path, "rb").read()
    return np.frombuffer(raw, dtype="<u2")


def read_cache(path):
    """picaso's OUT/tokens.bin: u64 header length, JSON header, then u32 ids (train, val, pairs)."""
    b = open(path, "rb").read()
    hl = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8 : 8 + hl])
    ids = np.frombuffer(b, dtype="<u4", offset=8 + hl)
    train, val = ids[: h["train"]], ids[h["train"] : h["train"] + h["val"]]
    at, pairs = h["train"] + h["val"], []
    for p in h["pairs"]:
        parts = []
        for n in p:
            parts.append(ids[at : at + n].tolist())
            at += n
        pairs.append(dict(zip(["previous", "random", "query", "continuation"], parts)))
    return train, val, pairs


def write_xz(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with lzma.open(path + ".tmp", "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", required=True, help="picaso's token cache (RUN/tokens.bin)")
    ap.add_argument("--out", required=True, help="folder for a/ and b/")
    ap.add_argument("--first", type=int, help="keep only the training stream's first articles, about this "
                    "many tokens (the call's working tree must stay under 64 MiB with them)")
    ap.add_argument("--val-tokens", type=int, help="keep only the validation stream's first tokens")
    a = ap.parse_args()
    train, val, pairs = read_cache(a.tokens)
    ends = np.append(np.flatnonzero(train == 0) + 1, len(train))  # an article ends after its <|endoftext|>
    if a.first:
        train = train[: int(ends[np.searchsorted(ends, a.first)])]
        cut = len(train)  # one stream, in a/
    else:
        cut = int(ends[np.searchsorted(ends, len(train) // 2)])
    if a.val_tokens:
        val = val[: a.val_tokens]
    if max(int(train.max()), int(val.max())) >= 1 << 16:
        raise SystemExit(f"{a.tokens}: token ids above 65535 do not fit u16 streams")
    print(f"{len(train):,} training tokens cut at {cut:,}; {len(val):,} validation tokens; {len(pairs)} pairs")
    write_xz(os.path.join(a.out, "a", "train-a.u16.xz"), train[:cut].astype("<u2").tobytes())
    if cut < len(train):
        write_xz(os.path.join(a.out, "b", "train-b.u16.xz"), train[cut:].astype("<u2").tobytes())
    write_xz(os.path.join(a.out, "a", "val.u16.xz"), val.astype("<u2").tobytes())
    write_xz(os.path.join(a.out, "a", "pairs.json.xz"), json.dumps(pairs).encode())


if __name__ == "__main__":
    main()
