"""Build a store from a list of strings, search it, and answer from composed states.

    python examples/python/build_store.py STORE_DIR [EMBEDDER_DIR]

EMBEDDER_DIR is an all-MiniLM-L6-v2 folder (default: $PICASO_EMBEDDER; users get it with
`huggingface-cli download sentence-transformers/all-MiniLM-L6-v2`).
"""
import sys

import picaso

model = picaso.Model.load()
store = picaso.Store.create(sys.argv[1], model, embedder=sys.argv[2] if len(sys.argv) > 2 else None)
docs = [
    {"id": "tower", "text": "The Eiffel Tower is in Paris.\n\nIt was finished in 1889 for the World's Fair.",
     "metadata": {"topic": "places", "url": "https://en.wikipedia.org/wiki/Eiffel_Tower"}},
    {"id": "leaf", "text": "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
     "metadata": {"topic": "science"}},
    {"id": "moon", "text": "The Moon is Earth's only natural satellite.\n\nIts surface is covered in craters.",
     "metadata": {"topic": "science", "url": "https://en.wikipedia.org/wiki/Moon"}},
]
report = store.ingest(docs, progress=lambda done, total: print(f"\r{done}/{total} contexts", end=""))
print(f" · {report}")
for hit in store.search("When was the tower finished?", k=2):
    print(f"{hit['score']:.3f}  {hit['doc']}#{hit['segment']}  {hit['text']}")
g = store.query("The Eiffel Tower was finished in", k=2, method="picaso-r", max_tokens=12)
print([(c["doc"], c["metadata"].get("url")) for c in g.contexts], g.text)
# Only the contexts whose metadata says topic = science:
print([h["doc"] for h in store.search("What is on its surface?", k=3, filter={"topic": "science"})])
print(store.stats())
