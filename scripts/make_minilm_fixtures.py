#!/usr/bin/env python3
"""Reference sentence embeddings from sentence-transformers' all-MiniLM-L6-v2, for picaso-embed.

Loads the model from a local folder (no network), embeds a fixed list of varied sentences
(short, long past the 256-token limit, punctuation, unicode, emoji, whitespace, empty) and writes
`expected.json` with, for every sentence, its text, the token ids sentence-transformers fed the
model (after truncation) and its L2-normalised 384-d embedding rounded to 7 significant digits.

Run:
  HF_HUB_OFFLINE=1 /work/pyenv/venv/bin/python scripts/make_minilm_fixtures.py \
      ../shared/data/all-MiniLM-L6-v2 [--out testdata/minilm]
CPU only, deterministic.
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import sentence_transformers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

LONG = " ".join(
    [
        "State-space models summarise everything they have read in a fixed-size state,",
        "which makes it possible to process a document once, store the resulting state,",
        "and reuse it later without reading the document again.",
        "PICASO composes the states of several retrieved documents with simple arithmetic,",
        "averaging over orderings so that the result does not depend on the retrieval order.",
        "A retriever first embeds every stored context with a small sentence encoder,",
        "then finds the nearest neighbours of the query by cosine similarity.",
    ]
    * 5
)

SENTENCES = [
    "The Eiffel Tower is in Paris.",
    "Hi",
    "",
    "How do state-space models compose their states?",
    "Wait... what?! (Really) -- yes; no: maybe [sic] #hashtag @user $100 50% & more.",
    "Café naïve résumé — Ångström, Straße; 東京タワーは日本にあります。",
    "I love pizza 🍕 and ice cream 🍦!!! 😀",
    "GPT-4 costs $0.03/1K tokens in 2023; π ≈ 3.14159, e^iπ = −1.",
    "   leading and trailing spaces\t\n with a tab and a newline   ",
    "Москва — столица России. Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "Pneumonoultramicroscopicsilicovolcanoconiosis supercalifragilisticexpialidocious",
    "A man is playing a guitar on the street while people walk by and a dog sleeps nearby.",
    LONG,
]


def sig7(x: float) -> float:
    return float(f"{x:.7g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="local all-MiniLM-L6-v2 folder (sentence-transformers layout)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "testdata" / "minilm")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = SentenceTransformer(str(args.model), device="cpu")
    model.eval()
    assert model.max_seq_length == 256, model.max_seq_length

    emb = model.encode(
        SENTENCES, batch_size=4, convert_to_numpy=True, normalize_embeddings=False, show_progress_bar=False
    )
    emb = np.asarray(emb, dtype=np.float64)
    # The model's own pipeline ends in a Normalize module; check it did.
    norms = np.linalg.norm(emb, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5), norms

    # Batched and single encodes agree (sentence-transformers pads batches too).
    single = np.stack([model.encode([s], convert_to_numpy=True, show_progress_bar=False)[0] for s in SENTENCES])
    cos = (emb * single).sum(1)
    assert cos.min() > 0.99999, cos

    features = model.preprocess(SENTENCES)
    ids = features["input_ids"].tolist()
    mask = features["attention_mask"].tolist()
    cases = []
    for text, row_ids, row_mask, vec in zip(SENTENCES, ids, mask, emb):
        n = int(sum(row_mask))
        cases.append({"text": text, "input_ids": row_ids[:n], "embedding": [sig7(v) for v in vec]})
    assert max(len(c["input_ids"]) for c in cases) == 256, "the long sentence must hit the 256-token limit"

    out = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "generator": "scripts/make_minilm_fixtures.py",
        "versions": {
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "max_seq_length": model.max_seq_length,
        "dim": int(emb.shape[1]),
        "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "expected.json"
    # One case per line keeps the file diffable and small.
    lines = ["{"]
    for key in ("model", "generator", "versions", "max_seq_length", "dim"):
        lines.append(f"  {json.dumps(key)}: {json.dumps(out[key], ensure_ascii=False)},")
    lines.append('  "cases": [')
    for i, case in enumerate(cases):
        sep = "," if i + 1 < len(cases) else ""
        lines.append("    " + json.dumps(case, ensure_ascii=False, separators=(",", ":")) + sep)
    lines.append("  ]")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json.loads(path.read_text(encoding="utf-8"))  # well-formed
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(cases)} cases, token counts "
          f"{[len(c['input_ids']) for c in cases]})")


if __name__ == "__main__":
    main()
