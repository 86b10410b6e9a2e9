#!/usr/bin/env python3
"""Reorders a training stream so that related passages follow each other (in-context pretraining).

Shi et al. (ICLR 2024) pack pretraining windows with documents that retrieval finds related,
so that reading the context pays during training and not only within one document. This does it
at the grain picaso composes: every article of the stream is cut into runs of consecutive
paragraphs of about `--run-tokens` tokens; runs are linked to their nearest neighbours by
TF-IDF cosine over token ids (rare tokens: names, numbers, terms); then one greedy walk visits
every run once, always moving to the most similar run not yet visited (a random unvisited run
when none is left among the neighbours). The output is the runs in walk order: the same tokens
as the input, each once, so a trainer's epoch sampler cuts windows of related text from it and
an ablation against the original order compares the order alone.

    python3 scripts/pack_neighbours.py --tokens RUN/tokens.bin --out train-nb.u16.xz
    python3 scripts/pack_neighbours.py --train train-a.u16.xz --order-out order-a.npz
    python3 scripts/pack_neighbours.py --train train-a.u16.xz --apply order-a.npz --out arm-nb.u16

The walk's order (`--order-out`, a few hundred kB) rebuilds the packed stream from the original
one with numpy alone (`--apply`, or `packed()` from another script): that is what travels to a
GPU machine instead of a second copy of the tokens.

Input: picaso's token cache (its training part) or a raw little-endian u16 stream (.xz allowed),
articles ending in token 0 (<|endoftext|>) and paragraphs in two newline tokens (`--para`).
Prints what the walk did: how many steps stay in the article (its next run or another), move
to another article, or jump at random, and the mean similarity of a step.
"""
import argparse
import json
import lzma
import sys

import numpy as np


def read_stream(args):
    if args.tokens:
        from gpu_streams import read_cache

        return read_cache(args.tokens)[0].astype(np.uint16)
    from gpu_streams import read_u16

    return read_u16(args.train).copy()


def paragraph_ends(ids, para):
    """Positions just after each paragraph's "\n\n" (two `para` tokens in a row)."""
    return np.flatnonzero((ids[:-1] == para) & (ids[1:] == para)) + 2


def runs_of(ids, eos, para, run_tokens):
    """(start, end, article) of every run: consecutive paragraphs of one article, closed once
    they reach `run_tokens`; an article's short tail joins its last run. Runs tile the stream."""
    ends = np.flatnonzero(ids == eos) + 1  # an article ends after its <|endoftext|>
    if len(ends) == 0 or ends[-1] != len(ids):
        ends = np.append(ends, len(ids))
    pb = paragraph_ends(ids, para)
    runs, start, pi = [], 0, 0
    for art, end in enumerate(ends):
        cuts = []
        while pi < len(pb) and pb[pi] < end:
            cuts.append(pb[pi])
            pi += 1
        cuts.append(end)
        s = start
        first = len(runs)
        for c in cuts:
            if c - s >= run_tokens:
                runs.append((s, c, art))
                s = c
        if s < end:
            if len(runs) > first and end - s < run_tokens // 4:
                runs[-1] = (runs[-1][0], end, art)
            else:
                runs.append((s, end, art))
        start = end
    return np.array(runs, dtype=np.int64)


def features(ids, runs, vocab, max_df, keep, skip):
    """Rows of L2-normalised TF-IDF over token ids, each keeping its `keep` heaviest tokens
    among those in at most `max_df` of the runs (frequent tokens link everything to everything)."""
    import scipy.sparse as sp

    rows, cols, vals = [], [], []
    for r, (s, e, _) in enumerate(runs):
        t, c = np.unique(ids[s:e], return_counts=True)
        rows.append(np.full(len(t), r))
        cols.append(t)
        vals.append(c)
    tf = sp.csr_matrix((np.concatenate(vals).astype(np.float32), (np.concatenate(rows), np.concatenate(cols))),
                       shape=(len(runs), vocab))
    df = np.bincount(tf.indices, minlength=vocab)
    idf = np.log(len(runs) / np.maximum(df, 1)).astype(np.float32)
    idf[(df > max_df * len(runs)) | (df < 2)] = 0
    idf[list(skip)] = 0
    tf.data = (1 + np.log(tf.data)) * idf[tf.indices]
    tf.eliminate_zeros()
    out = []
    for r in range(tf.shape[0]):  # keep the heaviest tokens of each run
        lo, hi = tf.indptr[r], tf.indptr[r + 1]
        d, i = tf.data[lo:hi], tf.indices[lo:hi]
        if len(d) > keep:
            top = np.argpartition(-d, keep)[:keep]
            d, i = d[top], i[top]
        out.append((d / max(np.linalg.norm(d), 1e-12), i))
    indptr = np.cumsum([0] + [len(d) for d, _ in out])
    return sp.csr_matrix((np.concatenate([d for d, _ in out]), np.concatenate([i for _, i in out]), indptr),
                         shape=tf.shape)


def neighbours(x, k, chunk=4096):
    """The k most similar other runs of every run (cosine), best first; -1 pads missing ones."""
    xt = x.T.tocsr()
    nb = np.full((x.shape[0], k), -1, dtype=np.int64)
    sim = np.zeros((x.shape[0], k), dtype=np.float32)
    for lo in range(0, x.shape[0], chunk):
        s = (x[lo : lo + chunk] @ xt).tocsr()
        for r in range(s.shape[0]):
            a, b = s.indptr[r], s.indptr[r + 1]
            i, d = s.indices[a:b], s.data[a:b]
            m = i != lo + r
            i, d = i[m], d[m]
            if len(d) > k:
                top = np.argpartition(-d, k)[:k]
                i, d = i[top], d[top]
            o = np.argsort(-d, kind="stable")
            nb[lo + r, : len(o)], sim[lo + r, : len(o)] = i[o], d[o]
        print(f"\rneighbours: {min(lo + chunk, x.shape[0]):,} / {x.shape[0]:,}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return nb, sim


def walk(nb, sim, seed):
    """Visits every run once: from each run to its most similar unvisited neighbour, else to
    the next unvisited run of a random permutation. Returns the order and each step's kind."""
    n = len(nb)
    seen = np.zeros(n, dtype=bool)
    order, sims, jumps = np.empty(n, dtype=np.int64), np.zeros(n, dtype=np.float32), np.zeros(n, dtype=bool)
    perm, p = np.random.default_rng(seed).permutation(n), 0
    cur = perm[0]
    for step in range(n):
        order[step] = cur
        seen[cur] = True
        if step == n - 1:
            break
        nxt = -1
        for j, s in zip(nb[cur], sim[cur]):
            if j >= 0 and not seen[j]:
                nxt, sims[step + 1] = j, s
                break
        if nxt < 0:
            while seen[perm[p]]:
                p += 1
            nxt, jumps[step + 1] = perm[p], True
        cur = nxt
    return order, sims, jumps


def packed(ids, order_file):
    """The stream `ids` with its runs in the order saved by `--order-out` (numpy only)."""
    z = np.load(order_file)
    runs = runs_of(ids, int(z["eos"]), int(z["para"]), int(z["run_tokens"]))
    order = z["order"]
    if len(order) != len(runs) or int(z["tokens"]) != len(ids):
        raise SystemExit(f"{order_file}: an order of {len(order):,} runs over {int(z['tokens']):,} tokens, "
                         f"but this stream has {len(runs):,} runs over {len(ids):,} tokens: not the stream it was made for")
    return np.concatenate([ids[runs[r, 0] : runs[r, 1]] for r in order])


def write_stream(out, path):
    data = out.astype("<u2").tobytes()
    if path.endswith(".xz"):
        data = lzma.compress(data, preset=6)
    open(path, "wb").write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="picaso's token cache (RUN/tokens.bin); its training part is used")
    src.add_argument("--train", help="a raw u16 training stream (.xz allowed)")
    ap.add_argument("--out", help="the reordered stream (u16; .xz to compress)")
    ap.add_argument("--order-out", help="save the walk's order (.npz) to rebuild the stream with --apply")
    ap.add_argument("--apply", help="rebuild the packed stream from this order (no similarity search)")
    ap.add_argument("--run-tokens", type=int, default=256, help="tokens per run of consecutive paragraphs")
    ap.add_argument("--neighbours", type=int, default=10)
    ap.add_argument("--max-df", type=float, default=0.01, help="tokens in more runs than this share are ignored")
    ap.add_argument("--keep", type=int, default=32, help="tokens kept per run")
    ap.add_argument("--eos", type=int, default=0)
    ap.add_argument("--para", type=int, default=199, help="the newline token (a paragraph ends in two)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    if not (a.out or a.order_out) or (a.apply and not a.out):
        ap.error("say where the result goes: --out (and/or --order-out without --apply)")
    ids = read_stream(a)
    if a.apply:
        write_stream(packed(ids, a.apply), a.out)
        return
    vocab = int(ids.max()) + 1
    runs = runs_of(ids, a.eos, a.para, a.run_tokens)
    lens = runs[:, 1] - runs[:, 0]
    print(f"{len(ids):,} tokens, {runs[-1, 2] + 1:,} articles, {len(runs):,} runs "
          f"(median {int(np.median(lens))} tokens)", file=sys.stderr)
    x = features(ids, runs, vocab, a.max_df, a.keep, {a.eos, a.para})
    nb, sim = neighbours(x, a.neighbours)
    order, sims, jumps = walk(nb, sim, a.seed)

    out = np.concatenate([ids[runs[r, 0] : runs[r, 1]] for r in order])
    assert len(out) == len(ids) and np.array_equal(np.bincount(out, minlength=vocab), np.bincount(ids, minlength=vocab))
    if a.out:
        write_stream(out, a.out)
    if a.order_out:
        np.savez_compressed(a.order_out, order=order.astype(np.int32), tokens=len(ids), run_tokens=a.run_tokens,
                            eos=a.eos, para=a.para)

    art = runs[order, 2]
    moved = ~jumps[1:]
    same = art[1:] == art[:-1]
    succ = (order[1:] == order[:-1] + 1) & same
    stats = dict(tokens=len(ids), runs=len(runs), articles=int(runs[-1, 2] + 1),
                 next_run_of_article=float(np.mean(moved & succ)),
                 other_run_of_article=float(np.mean(moved & same & ~succ)),
                 other_article=float(np.mean(moved & ~same)),
                 random_jump=float(np.mean(jumps[1:])),
                 mean_similarity=float(sims[1:][moved].mean()))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
