#!/usr/bin/env python3
"""llama.cpp's convert_hf_to_gguf.py for a Jamba folder whose tokenizer is the GPT-NeoX one.

llama.cpp's Jamba converter reads a SentencePiece `tokenizer.model` or a Llama BPE tokenizer, as
AI21's checkpoints ship; the random benchmark models (`make_random_granite.py --preset
jamba-small-like`) carry the GPT-NeoX BPE tokenizer, which its GPT-2 vocabulary path reads. The
tokenizer does not enter a speed benchmark (llama-bench draws random token ids); the weights are
converted as they are.

Run:  python scripts/convert_jamba_gguf.py LLAMA_CPP_DIR MODEL_DIR --outtype f32|bf16 --outfile OUT.gguf
"""
import sys
from pathlib import Path

llama = Path(sys.argv.pop(1))
sys.path.insert(0, str(llama / "gguf-py"))
sys.path.insert(0, str(llama))

import conversion.jamba  # noqa: E402

conversion.jamba.JambaModel.set_vocab = lambda self: self._set_vocab_gpt2()

import convert_hf_to_gguf  # noqa: E402

convert_hf_to_gguf.main()
