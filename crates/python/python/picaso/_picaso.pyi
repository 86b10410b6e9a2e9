"""Type stubs of the picaso extension (crates/python/src/lib.rs)."""
from os import PathLike
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

__version__: str

Text = Union[str, Sequence[int]]
Path = Union[str, PathLike]
# A metadata filter: per key, a scalar to equal, or operators ("$eq", "$ne", "$gt", "$gte",
# "$lt", "$lte": a scalar; "$in", "$nin": a list of scalars; "$exists": a bool; "$contains": a
# scalar the key's list holds; "$prefix": a string the key's string starts with; "$regex": a
# pattern (Rust's regex syntax) the key's string matches somewhere; "$elemMatch":
# operators and keys one element of the key's list passes, all at once; "$not": an
# object of operators that must not all hold) and keys within the object there ({"author":
# {"name": "Ann"}}), all of which must hold; "$or" / "$and" / "$nor" in place of a key: a list of
# filters, one / all / none of which must hold.
Filter = dict[str, Any]

class Model:
    """A Mamba language model (Mamba-2 or Mamba-1) ready to score, continue states and generate."""

    @staticmethod
    def load(path: Optional[Path] = None, *, weights: str = "f32", tokenizer: Optional[Path] = None) -> "Model":
        """Loads a model folder or a Hugging Face hub id; weights "f32" or "bf16"."""
    @property
    def fingerprint(self) -> str: ...
    @property
    def arch(self) -> str: ...
    @property
    def n_params(self) -> int: ...
    @property
    def path(self) -> PathLike: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def zero_state(self) -> "State": ...
    def score(self, input: Text, state: Optional["State"] = None) -> npt.NDArray[np.float32]:
        """out[i] = log p(token[i+1] | state, token[..=i]); the first token is context.

        An empty input raises ValueError ("nothing to score")."""
    def next_logits(self, input: Text, state: Optional["State"] = None) -> npt.NDArray[np.float32]:
        """Logits of the token after `input`, continued from `state`."""
    def state(self, input: Text, start: Optional["State"] = None) -> "State":
        """The state after `input`, continued from `start`."""
    def generate(
        self,
        prompt: Text,
        state: Optional["State"] = None,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Optional[Sequence[str]] = None,
    ) -> "Generation": ...

class Generation:
    text: Optional[str]  # None when the model has no tokenizer (token ids only)
    # With stop_reason "stop": to the end of the token where the stop string begins (as `state`);
    # `text` is cut before the stop string, so decode(token_ids) may hold more than `text`.
    token_ids: list[int]
    stop_reason: str
    state: "State"
    contexts: list[dict[str, Any]]

class State:
    """Per Mamba layer: SSM state, conv tail and log of the accumulated decay (read-only numpy
    views); per attention layer of a hybrid: keys and values (kv_heads, tokens, head_dim)."""

    @staticmethod
    def load(path: Path) -> "State": ...
    def save(self, path: Path, dtype: str = "f32") -> None: ...
    @staticmethod
    def from_arrays(
        layers: Sequence[Sequence[npt.ArrayLike]], *, fingerprint: str, n_tokens: int, position: Optional[int] = None
    ) -> "State":
        """One tuple per layer: (ssm, conv, log_decay) for a Mamba layer, (keys, values) for an attention layer."""
    @property
    def n_tokens(self) -> int: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def arch(self) -> str: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def layer_types(self) -> list[str]:
        """"mamba" or "attention" per layer of the model."""
    @property
    def position(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def layers(self) -> list[dict[str, npt.NDArray[np.float32]]]: ...
    def ssm(self, i: int) -> npt.NDArray[np.float32]: ...
    def conv(self, i: int) -> npt.NDArray[np.float32]: ...
    def log_decay(self, i: int) -> npt.NDArray[np.float32]: ...
    def keys(self, i: int) -> npt.NDArray[np.float32]: ...
    def values(self, i: int) -> npt.NDArray[np.float32]: ...

def compose(states: Sequence[State], method: str = "picaso-r", order: Optional[Sequence[int]] = None) -> State:
    """soup, caso, picaso-s or picaso-r; the last state is nearest the prompt."""

def weights(log_decays: Sequence[float], method: str = "picaso-r") -> list[float]: ...

class Store:
    """A database of states: a folder, or postgres:// metadata with states in a folder or s3://."""

    @staticmethod
    def open(url: str, *, model: Optional[Model] = None, embedder: Optional[Path] = None) -> "Store": ...
    @staticmethod
    def create(
        url: str, model: Model, *, embedder: Optional[Path] = None, states: Optional[str] = None, state_dtype: Optional[str] = None
    ) -> "Store": ...
    def ingest(
        self,
        documents: list[Union[str, dict[str, Any]]],
        *,
        segment: str = "paragraph",
        batch: int = 8,
        progress: Optional[Callable[[int, int], Any]] = None,
    ) -> dict[str, Any]:
        """Adds documents (a str's id is "text/" + a hash of its text). Segments stored with the
        same text are skipped; a document given again with other text is brought up to date, and
        a stored segment whose state file is missing is processed again. A dict document is
        {"id", "text", "metadata" (optional dict, carried by each of its contexts)}.
        {"added", "replaced", "repaired", "removed", "skipped", "relabelled", "tokens", "seconds"}."""
    def search(
        self,
        query: str,
        k: int = 4,
        *,
        documents: Optional[Sequence[str]] = None,
        filter: Optional[Filter] = None,
        retriever: str = "dense",
        hybrid_weight: Optional[float] = None,
    ) -> list[dict[str, Any]]:
        """The `k` nearest contexts, best first: {id, score, doc, segment, text, metadata} (only
        `documents`' contexts, and those whose metadata passes `filter`, when given: e.g.
        {"lang": "en", "year": {"$gte": 2020}, "tags": {"$contains": "physics"}}). `retriever`:
        "dense" (cosine of sentence embeddings), "bm25" (the contexts' text) or "hybrid"
        (reciprocal-rank fusion, the dense ranking weighted `hybrid_weight`, default 0.5)."""
    def state(self, ids: Sequence[int], method: str = "picaso-r") -> State: ...
    def query(
        self,
        prompt: str,
        k: int = 4,
        method: str = "picaso-r",
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Optional[Sequence[str]] = None,
        documents: Optional[Sequence[str]] = None,
        filter: Optional[Filter] = None,
        retriever: str = "dense",
        hybrid_weight: Optional[float] = None,
    ) -> Generation: ...
    def attribute(
        self,
        prompt: str,
        answer: str,
        ids: Optional[Sequence[int]] = None,
        k: int = 4,
        method: str = "picaso-r",
        *,
        documents: Optional[Sequence[str]] = None,
        filter: Optional[Filter] = None,
        retriever: str = "dense",
        hybrid_weight: Optional[float] = None,
    ) -> dict[str, Any]:
        """Leave-one-out attribution of `answer` to the contexts `ids` (or the `k` retrieved, from
        `documents` only when given):
        {"method", "answer_tokens", "loglik", "contexts"}, each context with "loglik_without" and
        "drop", the one the answer owes most to first."""
    def get(self, id: int) -> dict[str, Any]: ...
    def document(self, doc: str) -> list[dict[str, Any]]:
        """The contexts of document `doc`, in segment order (empty if the store holds none)."""
    def documents(self) -> list[dict[str, Any]]:
        """Every document in name order: {"id", "contexts", "tokens", "metadata"} (the metadata
        of its first context)."""
    def ids(self, *, filter: Optional[Filter] = None) -> list[int]:
        """The ids of every context, or of those whose metadata passes `filter`, ascending."""
    def why_none_match(self, filter: Filter) -> list[str]:
        """Why no context passes `filter`, as far as counting tells, one line each: how many
        contexts each of its keys passes alone (several keys), and a key tested within objects
        that holds lists, with the `$elemMatch` to give instead."""
    def delete(self, id: int) -> None: ...
    def delete_document(self, doc: str) -> int:
        """Removes every context of document `doc`; returns how many."""
    def delete_matching(self, filter: Filter) -> list[int]:
        """Removes every context whose metadata passes `filter`, all at once; returns their
        ids, ascending (empty when none passes)."""
    def load_state(self, id: int) -> State: ...
    def stats(self) -> dict[str, Any]: ...
    def check(self, *, repair: bool = False, quick: bool = False) -> dict[str, Any]:
        """Reads every state object back and verifies it (quick=True: only looks for missing
        ones); repair=True (needs the model) recomputes broken states from their rows' tokens
        and removes unnamed objects."""
    def __len__(self) -> int: ...
