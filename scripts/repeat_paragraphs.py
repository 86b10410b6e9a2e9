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

import numpy as np

from gpu_streams import read_u16
from pack_neighbours import paragraph_ends


def paragraphs(ids, eos, para):
    """(start, end) of each paragraph: it ends after its "\n\n", or after its article's
    <|endoftext|>."""
    ends = np.union1d(paragraph_ends(ids, para), np.flatnonzero(ids == eos) + 1)
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
    ids = read_u16(a.train)
    cap = a.tokens or len(ids)
    rng = np.random.default_rng(a.seed)
    # Whole articles, while they fit the cap: an article's pieces wait in `article` until its end.
    out, n, articles, echoed, kept = [], 0, 0, 0, 0
    article, article_paragraphs, article_echoes = [], 0, 0
    for s, e in paragraphs(ids, a.eos, a.para):
        piece = ids[s:e]
        article.append(piece)
        article_paragraphs += 1
        # An article's final <|endoftext|> piece is not echoed.
        if piece[-1] == a.para and a.min_tokens <= len(piece) <= a.max_tokens and rng.random() < a.p:
            article.append(piece)
            article_echoes += 1
        if piece[-1] != a.eos:
            continue
        length = sum(len(p) for p in article)
        if n + length > cap:
            break
        out += article
        n += length
        articles += 1
        echoed += article_echoes
        kept += article_paragraphs
        article, article_paragraphs, article_echoes = [], 0, 0
    if not out:
        raise SystemExit(f"{a.train}: no whole article (ending in token {a.eos}) fits in {cap:,} tokens")
    stream = np.concatenate(out)
    stream.astype("<u2").tofile(a.out)
    print(f"{len(stream):,} tokens ({len(ids):,} in), {echoed:,} of {kept:,} paragraphs echoed, "
          f"{articles:,} articles")


if __name__ == "__main__":
    main()
