#!/usr/bin/env python3
"""Tiny random sentence-transformers folders and their reference embeddings, for picaso-embed.

Builds, with a fixed seed and no network:
  testdata/encoders/mpnet-mean/    a 2-layer MPNet (hidden 32) with mean pooling and Normalize,
                                   max_seq_length 300, so the long case exercises every relative
                                   position bucket (distances past 128) and the position offset;
  testdata/encoders/bert-cls/      a 2-layer BERT (hidden 32) with CLS pooling and no Normalize,
                                   max_seq_length 40 (truncation);
and `expected.json` in each with sentence-transformers' token ids and embeddings (float32 values,
printed with 9 significant digits: exact). bert-cls's file also holds the embeddings of the same
transformer under pooling `["max", "mean_sqrt_len_tokens"]` (no Normalize), and mpnet-mean's the
bucket of every relative position from -600 to 600 as HF computes it.

Run:
  /work/venv/bin/python scripts/make_encoder_fixtures.py [--out testdata/encoders]
CPU only, deterministic (running it twice gives byte-identical files).
"""

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sentence_transformers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer  # noqa: E402
from transformers import BertConfig, BertModel, BertTokenizerFast, MPNetConfig, MPNetModel, MPNetTokenizerFast  # noqa: E402

WORDS = (
    "the a an of to in on at is was it and or but not for with as by from this that which who "
    "state space model models store stored context contexts compose composed retrieval query "
    "tower paris eiffel city river bridge music guitar play played dog cat sat mat sleep "
    "one two three four five six seven eight nine ten year years time first last long short "
    "new old large small good bad high low right left world war history song album band film"
).split()
PIECES = ["##s", "##ed", "##ing", "##er", "##ly", "##tion", ".", ",", "!", "?", "'", "-", "(", ")", ":", ";", "$", "%"]
PIECES += [c for c in "abcdefghijklmnopqrstuvwxyz0123456789"] + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]

LONG = " ".join(
    ["the state space model stored the context of the eiffel tower in paris and the river bridge ."] * 20
)
SENTENCES = [
    "The Eiffel Tower is in Paris.",
    "Hi",
    "",
    "How do state-space models compose their stored contexts?",
    "Wait... what?! (Really) -- yes; no: maybe $100 50% & more.",
    "Café naïve résumé, Straße; 東京",
    "   leading and trailing spaces\t\n with a tab   ",
    "A dog sat on the mat while the band played a long song.",
    LONG,
]


def sig9(x: float) -> float:
    return float(f"{x:.9g}")


def tokenizer_files(folder: Path, cls, specials, **kwargs):
    vocab = specials + WORDS + PIECES
    vocab_file = folder / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return cls(vocab=str(vocab_file), **kwargs), len(vocab)


def randomize(model, std):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))


def st_folder(hf_dir: Path, out: Path, max_seq_length: int, pooling_mode, normalize: bool) -> SentenceTransformer:
    transformer = Transformer(str(hf_dir), max_seq_length=max_seq_length)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(str(out))
    # Keep only what a folder needs (the model card and training configs vary by version).
    for name in ["README.md", "config_sentence_transformers.json", "special_tokens_map.json", "vocab.txt"]:
        (out / name).unlink(missing_ok=True)
    # float32 weights with a canonical layout: safetensors written by torch directly.
    weights = {k: v.contiguous() for k, v in sorted(model[0].auto_model.state_dict().items()) if "position_ids" not in k}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return SentenceTransformer(str(out), device="cpu")


def encode(model, sentences):
    emb = model.encode(sentences, batch_size=4, convert_to_numpy=True, show_progress_bar=False)
    features = model.preprocess(sentences)
    ids = features["input_ids"].tolist()
    mask = features["attention_mask"].tolist()
    return [
        {"text": t, "input_ids": i[: int(sum(m))], "embedding": [sig9(float(x)) for x in e]}
        for t, i, m, e in zip(sentences, ids, mask, emb)
    ]


def write_json(path: Path, head: dict, cases: list, extra: dict):
    lines = ["{"]
    for key, value in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)},")
    for key, value in extra.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False, separators=(',', ':'))},")
    lines.append('  "cases": [')
    for i, case in enumerate(cases):
        sep = "," if i + 1 < len(cases) else ""
        lines.append("    " + json.dumps(case, ensure_ascii=False, separators=(",", ":")) + sep)
    lines.append("  ]")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json.loads(path.read_text(encoding="utf-8"))


def versions():
    return {
        "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def make_mpnet(out: Path):
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp)
        tok, n = tokenizer_files(hf, MPNetTokenizerFast, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>")
        config = MPNetConfig(
            vocab_size=n, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=304, relative_attention_num_buckets=32, layer_norm_eps=1e-5,
            pad_token_id=1, bos_token_id=0, eos_token_id=2,
        )
        model = MPNetModel(config, add_pooling_layer=False)
        randomize(model, 0.3)
        model.save_pretrained(hf, safe_serialization=True)
        tok.save_pretrained(hf)
        st = st_folder(hf, out, 300, "mean", True)
    cases = encode(st, SENTENCES)
    assert max(len(c["input_ids"]) for c in cases) == 300, "the long case must hit the limit"
    buckets = MPNetModel(config, add_pooling_layer=False).encoder.relative_position_bucket(
        torch.arange(-600, 601)[None, :]
    )[0].tolist()
    head = {"model": "tiny random MPNet, mean pooling, Normalize", "generator": "scripts/make_encoder_fixtures.py",
            "versions": versions(), "max_seq_length": st.max_seq_length, "dim": len(cases[0]["embedding"])}
    write_json(out / "expected.json", head, cases, {"buckets_from": -600, "buckets": buckets})


def make_bert(out: Path):
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp)
        tok, n = tokenizer_files(hf, BertTokenizerFast, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        config = BertConfig(
            vocab_size=n, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12,
        )
        model = BertModel(config, add_pooling_layer=False)
        randomize(model, 0.3)
        model.save_pretrained(hf, safe_serialization=True)
        tok.save_pretrained(hf)
        st = st_folder(hf, out, 40, "cls", False)
        other = SentenceTransformer(
            modules=[st[0], Pooling(32, pooling_mode=["max", "mean_sqrt_len_tokens"])], device="cpu"
        )
    cases = encode(st, SENTENCES)
    others = encode(other, SENTENCES)
    assert max(len(c["input_ids"]) for c in cases) == 40
    head = {"model": "tiny random BERT, CLS pooling, no Normalize", "generator": "scripts/make_encoder_fixtures.py",
            "versions": versions(), "max_seq_length": st.max_seq_length, "dim": len(cases[0]["embedding"])}
    write_json(out / "expected.json", head, cases,
               {"max_mean_sqrt_len_embeddings": [c["embedding"] for c in others]})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "testdata" / "encoders")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for name, make in [("mpnet-mean", make_mpnet), ("bert-cls", make_bert)]:
        out = args.out / name
        if out.exists():
            for f in sorted(out.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
        out.mkdir(parents=True, exist_ok=True)
        make(out)
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"wrote {out}: {sorted(str(f.relative_to(out)) for f in out.rglob('*') if f.is_file())}, {size} bytes")


if __name__ == "__main__":
    main()
