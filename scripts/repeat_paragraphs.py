#!/usr/bin/env python3
"""Echoes some paragraphs of a training stream: each paragraph is, with probability `--p`,
followed by an exact copy of itself. A model can predict a copy only by reading what came
before, so echoes give the copying mechanism (what "recall tokens" measure) a strong gradient;
the ablation asks whether that carries over to natural text, where the previous paragraph
shares names and terms but is never a copy. The output is cut at the last article end within
`--tokens` (default: the input's length), so an arm costs the same steps as its base.

    python3 scripts/repeat_paragraphs.py --train base2m.u16 --out rep2m.u16 --p 0.25

Input: a raw little-endian u16 stream (.xz allowed), articles ending in token 0 and paragraphs
in two newline tokens (`--para`), as scripts/pack_neighbours.py reads it.
"""
import argparse
import lzma

import numpy as np


def paragraphs(ids, eos, para):
    """(start, end) of each paragraph: it ends after the second token of its "\n\n", or after
    its article's <|endoftext|>."""
    second_newline = np.zeros(len(ids), dtype=bool)
    second_newline[1:] = (ids[1:] == para) & (ids[:-1] == para)
    ends = np.flatnonzero(second_newline | (ids == eos)) + 1
    if len(ends) == 0 or ends[-1] != len(ids):
        ends = np.append(ends, len(ids))
    starts = np.concatenate([[0], ends[:-1]])
    return [(int(s), int(e)) for s, e in zip(starts, ends) if e > s]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="u16 stream (.xz allowed)")
    ap.add_argument("--out", required=True, help="u16 stream to write")
    ap.add_argument("--p", type=float, default=0.25, help="probability that a paragraph is echoed")
    ap.add_argument("--min-tokens", type=int, default=16, help="shortest paragraph echoed")
    ap.add_argument("--max-tokens", type=int, default=400, help="longest paragraph echoed")
    ap.add_argument("--tokens", type=int, help="output length cap (default: the input's)")
    ap.add_argument("--eos", type=int, default=0)
    ap.add_argument("--para", type=int, default=199, help="the newline token (a paragraph ends in two)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    raw = lzma.open(a.train).read() if a.train.endswith(".xz") else open(a.train, "rb").read()
    ids = np.frombuffer(raw, dtype="<u2")
    cap = a.tokens or len(ids)
    rng = np.random.default_rng(a.seed)
    out, n, last_end, echoed, kept, counts = [], 0, 0, 0, 0, []
    for s, e in paragraphs(ids, a.eos, a.para):
        piece = ids[s:e]
        body_is_text = piece[-1] == a.para  # an article's final <|endoftext|> is not echoed
        parts = [piece]
        if body_is_text and a.min_tokens <= len(piece) <= a.max_tokens and rng.random() < a.p:
            parts.append(piece)
            echoed += 1
        for p in parts:
            out.append(p)
            n += len(p)
        kept += 1
        if piece[-1] == a.eos:
            last_end = len(out)
            counts.append((echoed, kept))
            if n >= cap:
                break
    stream = np.concatenate(out[:last_end] if last_end else out)
    articles = int((stream == a.eos).sum())
    if len(stream) > cap:  # the last article crossed the cap: end at the article before it
        stream = stream[: np.flatnonzero(stream[:cap] == a.eos)[-1] + 1]
        articles -= 1
    if articles:
        echoed, kept = counts[articles - 1]
    stream.astype("<u2").tofile(a.out)
    print(f"{len(stream):,} tokens ({len(ids):,} in), {echoed:,} of {kept:,} paragraphs echoed, "
          f"{articles:,} articles")


if __name__ == "__main__":
    main()
