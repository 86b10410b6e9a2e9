"""picaso: a database of SSM states.

Process each context once with a Mamba model, keep its state, and at query time compose the
states of the retrieved contexts (PICASO, ICLR 2025) instead of re-reading their text.

    >>> import picaso
    >>> model = picaso.Model.load("models/picaso-mamba2")          # a folder or a hub id
    >>> a = model.state("The Eiffel Tower is in Paris.\\n\\n")
    >>> b = model.state("It was finished in 1889.\\n\\n")
    >>> both = picaso.compose([a, b], method="picaso-r")           # no model work
    >>> model.generate("The tower", state=both, max_tokens=16).text

Classes: `Model` (load, score, state, generate, encode, decode), `State` (save, load, its
arrays as numpy views, from_arrays), `Generation`, `Store` (create, open, ingest, search,
query, stats). Functions: `compose`, `weights`. Errors derive from `picaso.Error`.
Interop with Hugging Face transformers: `picaso.hf` (needs torch and transformers).
"""
from ._errors import Error, InvalidArgument, NotFound, StateMismatch
from ._picaso import Generation, Model, State, Store, __version__, compose, weights

METHODS = ("soup", "caso", "picaso-s", "picaso-r")
"""Composition methods, in the order the paper introduces them."""

__all__ = [
    "Model", "State", "Generation", "Store", "compose", "weights", "METHODS",
    "Error", "InvalidArgument", "NotFound", "StateMismatch", "__version__",
]
