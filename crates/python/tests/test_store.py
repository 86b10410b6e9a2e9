"""The store from Python: a folder, and S3 + PostgreSQL where CI's services run."""
import numpy as np
import pytest

import picaso
from conftest import store_locations

DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.\n\nIt was finished in 1889 for the World's Fair.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.\n\nIt happens in chloroplasts.",
    {"id": "volcano", "text": "A volcano is a rupture in the crust of a planet through which lava escapes."},
]


def test_store_end_to_end(model, embedder, tmp_path):
    for url, states in store_locations(tmp_path):
        calls = []
        store = picaso.Store.create(url, model, embedder=embedder, states=states)
        report = store.ingest(DOCS, progress=lambda done, total: calls.append((done, total)))
        assert report["added"] == 5 and report["skipped"] == 0 and report["tokens"] > 0
        assert calls and calls[-1] == (5, 5)
        assert store.ingest(DOCS)["skipped"] == 5  # (document, segment) pairs already there
        eiffel, plants = store.get(1)["doc"], store.get(3)["doc"]
        assert eiffel.startswith("text/") and plants.startswith("text/") and eiffel != plants
        stats = store.stats()
        assert stats["contexts"] == len(store) == 5 and stats["documents"] == 3 and stats["model"] == model.fingerprint

        hits = store.search("Where do plants make sugar?", k=2)
        assert len(hits) == 2 and hits[0]["doc"] == plants and hits[0]["score"] >= hits[1]["score"]
        assert set(hits[0]) == {"id", "score", "doc", "segment", "text", "metadata"}

        again = picaso.Store.open(url, model=model)  # the embedder the store recorded
        g = again.query("The tower in Paris was finished in", k=2, method="picaso-r", max_tokens=6)
        assert [c["doc"] for c in g.contexts][0] == eiffel and len(g.token_ids) == 6
        g.contexts[0]["doc"] = "edited"  # a Generation is immutable: each read is a copy
        assert g.contexts[0]["doc"] == eiffel

        # The store's composed state is picaso.compose of its stored states (last id nearest the prompt).
        ids = [c["id"] for c in reversed(g.contexts)]
        mine = picaso.compose([again.load_state(i) for i in ids], "picaso-r")
        np.testing.assert_array_equal(again.state(ids, "picaso-r").ssm(3), mine.ssm(3))
        assert again.get(ids[0])["text"]
        # Attribution: leave-one-out over the composed states, the context the answer owes most to first.
        at = again.attribute("The tower in Paris was finished in", " 1889 for the World's Fair.", ids=ids)
        assert at["method"] == "picaso-r" and at["answer_tokens"] > 0 and len(at["contexts"]) == 2
        drops = [c["drop"] for c in at["contexts"]]
        assert drops == sorted(drops, reverse=True)
        for c in at["contexts"]:
            assert c["drop"] == pytest.approx(at["loglik"] - c["loglik_without"])
        assert at["contexts"][0]["text"].startswith("It was finished in 1889"), at["contexts"]
        retrieved = again.attribute("Where do plants make sugar?", " In chloroplasts.", k=2, method="concat")
        assert retrieved["method"] == "concat" and {c["doc"] for c in retrieved["contexts"]} == {plants}
        with pytest.raises(ValueError, match="naive uses no context"):
            again.attribute("The tower", " is tall.", ids=ids, method="naive")
        naive = again.query("The tower", method="naive", max_tokens=4)
        assert naive.contexts == [] and naive.text == model.generate("The tower", max_tokens=4).text


def test_retrieval_within_documents(model, embedder, tmp_path):
    """`documents` limits search, query and attribution to those documents' contexts."""
    for url, states in store_locations(tmp_path):
        store = picaso.Store.create(url, model, embedder=embedder, states=states)
        store.ingest(DOCS)
        eiffel = store.get(1)["doc"]
        question = "Where do plants make sugar?"
        hits = store.search(question, k=5, documents=[eiffel, "volcano"])
        everything = store.search(question, k=5)
        assert [h["id"] for h in hits] == [h["id"] for h in everything if h["doc"] in (eiffel, "volcano")]
        assert len(hits) == 3
        g = store.query("Sugar is made", k=5, max_tokens=2, documents=["volcano"])
        assert [c["doc"] for c in g.contexts] == ["volcano"]
        at = store.attribute("Sugar is made", " in leaves.", k=5, documents=[eiffel])
        assert [c["doc"] for c in at["contexts"]] == [eiffel, eiffel]
        with pytest.raises(ValueError, match='"dogs" is not in the store'):
            store.search("x", documents=["volcano", "dogs"])
        with pytest.raises(ValueError, match="no documents"):
            store.query("x", documents=[])
        with pytest.raises(ValueError, match="naive"):
            store.query("x", method="naive", documents=["volcano"])
        with pytest.raises(ValueError, match="one or the other"):
            store.attribute("x", " y", ids=[1], documents=["volcano"])


def test_bm25_and_hybrid_retrieval(model, embedder, tmp_path):
    """`retriever` ranks by BM25 or fuses it with the dense ranking, in search, query and attribute."""
    for url, states in store_locations(tmp_path):
        store = picaso.Store.create(url, model, embedder=embedder, states=states)
        store.ingest(DOCS)
        hits = store.search("lava rupture crust", k=5, retriever="bm25")
        assert [h["doc"] for h in hits] == ["volcano"] and hits[0]["score"] > 0  # only texts sharing a term
        assert store.search("zeppelin", retriever="bm25") == []
        fused = store.search("Where is the tower with lava?", k=3, retriever="hybrid", hybrid_weight=0.5)
        assert len(fused) == 3 and "volcano" in [h["doc"] for h in fused]
        dense = store.search("Where is the tower with lava?", k=3)
        assert [h["id"] for h in store.search("Where is the tower with lava?", k=3, retriever="hybrid", hybrid_weight=1.0)] == [
            h["id"] for h in dense
        ]
        g = store.query("The lava of a volcano", k=2, max_tokens=2, retriever="bm25")
        assert [c["doc"] for c in g.contexts] == ["volcano"]
        at = store.attribute("Lava escapes through the crust", " of a planet.", k=2, retriever="hybrid")
        assert len(at["contexts"]) == 2
        with pytest.raises(ValueError, match="unknown retriever"):
            store.search("x", retriever="sparse")
        with pytest.raises(ValueError, match="between 0 and 1"):
            store.search("x", retriever="hybrid", hybrid_weight=2.0)
        with pytest.raises(ValueError, match="hybrid retrieval only"):
            store.search("x", retriever="bm25", hybrid_weight=0.5)


def test_metadata_and_filters(model, embedder, tmp_path):
    """A document's metadata is carried by its contexts and returned with them; `filter`
    limits search, query and attribution to contexts whose metadata holds its values; new
    metadata with the same text keeps the contexts."""
    for url, states in store_locations(tmp_path):
        store = picaso.Store.create(url, model, embedder=embedder, states=states)
        store.ingest([
            {"id": "en", "text": "Plants make sugar in their leaves.\n\nLeaves are green.",
             "metadata": {"lang": "en", "year": 2024, "source": {"url": "https://a.example"}}},
            {"id": "fr", "text": "Les plantes font du sucre.", "metadata": {
                "lang": "fr", "year": 2023, "authors": [{"name": "Ann", "role": "author"}, {"name": "Bo"}]}},
            {"id": "none", "text": "Volcanoes erupt lava."},
        ])
        assert [c["metadata"] for c in store.document("en")] == [
            {"lang": "en", "year": 2024, "source": {"url": "https://a.example"}}] * 2
        assert store.document("none")[0]["metadata"] == {}
        question = "Where do plants make sugar?"
        everything = store.search(question, k=10)
        for f, n in [({"lang": "en"}, 2), ({"year": 2024.0}, 2), ({"year": 2023, "lang": "fr"}, 1),
                     ({"lang": "de"}, 0), ({"year": "2024"}, 0)]:
            hits = store.search(question, k=10, filter=f)
            assert [h["id"] for h in hits] == [h["id"] for h in everything
                                               if all(h["metadata"].get(k) == v for k, v in f.items())]
            assert len(hits) == n, f
        # Operators: ranges, lists, presence.
        for f, docs in [({"year": {"$gte": 2023, "$lt": 2024}}, ["fr"]),
                        ({"lang": {"$in": ["fr", "de"]}}, ["fr"]),
                        ({"lang": {"$ne": "en"}}, ["fr", "none"]),
                        ({"year": {"$exists": False}}, ["none"]),
                        ({"year": {"$gt": "2000"}}, []),
                        ({"lang": {"$prefix": "f"}}, ["fr"]),
                        ({"lang": {"$not": {"$prefix": "e"}}}, ["fr", "none"]),
                        ({"$nor": [{"lang": "en"}, {"year": {"$exists": False}}]}, ["fr"]),
                        ({"$or": [{"lang": "fr"}, {"year": {"$exists": False}}]}, ["fr", "none"]),
                        ({"source": {"url": {"$prefix": "https://a."}}}, ["en", "en"]),
                        ({"source": {"url": {"$exists": False}}}, ["fr", "none"]),
                        ({"authors": {"$elemMatch": {"name": "Ann", "role": "author"}}}, ["fr"]),
                        ({"authors": {"$elemMatch": {"name": "Bo", "role": "author"}}}, []),
                        ({"lang": {"$regex": "(?i)^(EN|de)$"}}, ["en", "en"])]:
            hits = store.search(question, k=10, filter=f)
            assert sorted(h["doc"] for h in hits) == docs, f
            assert [store.get(i)["doc"] for i in store.ids(filter=f)] == sorted(docs), f
        assert store.ids(filter={"authors": {"name": "Ann"}}) == []
        assert store.why_none_match({"authors": {"name": "Ann"}}) == [
            '"authors" holds a list in 1 context, and keys within objects do not enter lists: to test its '
            'elements, give {"authors":{"$elemMatch":{"name":"Ann"}}}']
        assert store.why_none_match({"lang": "fr", "year": 2024}) == [
            'contexts each key passes alone: {"lang":"fr"} 1, {"year":2024} 2']
        hits = store.search(question, k=10, filter={"lang": "en"}, documents=["fr", "en"])
        assert [h["doc"] for h in hits] == ["en", "en"]
        g = store.query("Sugar is made", k=5, max_tokens=2, filter={"lang": "fr"})
        assert [c["doc"] for c in g.contexts] == ["fr"]
        at = store.attribute("Sugar is made", " in leaves.", k=5, filter={"year": 2024})
        assert [c["doc"] for c in at["contexts"]] == ["en", "en"]
        ids = [c["id"] for c in store.document("en")]
        report = store.ingest([{"id": "en", "text": "Plants make sugar in their leaves.\n\nLeaves are green.",
                                "metadata": {"lang": "en", "year": 2025}}])
        assert (report["added"], report["relabelled"], report["skipped"]) == (0, 2, 2)
        assert [(c["id"], c["metadata"]["year"]) for c in store.document("en")] == [(i, 2025) for i in ids]
        assert {d["id"]: d["metadata"] for d in store.documents()}["en"] == {"lang": "en", "year": 2025}
        for bad, match in [({}, "empty metadata filter"), ({"a": [1]}, r"is a list.*\$in"),
                           ({"a": float("nan")}, "not JSON"), ({"a": {"$near": 1}}, "unknown operator"),
                           ({"a": {"$exists": "yes"}}, "true or false"),
                           ({"a": {"$elemMatch": 1}}, r"\$elemMatch takes an object"),
                           ({"a": {"$regex": "\\bx"}}, "word boundaries")]:
            with pytest.raises(ValueError, match=match):
                store.search("x", filter=bad)
        with pytest.raises(TypeError, match="filter must be a dict"):
            store.search("x", filter="lang=en")
        with pytest.raises(ValueError, match="naive"):
            store.query("x", method="naive", filter={"lang": "en"})
        with pytest.raises(ValueError, match="one or the other"):
            store.attribute("x", " y", ids=[1], filter={"lang": "en"})
        with pytest.raises(ValueError, match='unknown key "url".*"metadata"'):
            store.ingest([{"id": "x", "text": "Hello.", "url": "https://b.example"}])
        with pytest.raises(TypeError, match="JSON values"):
            store.ingest([{"id": "x", "text": "Hello.", "metadata": {"when": object()}}])
        # Removing by metadata: the French context goes, the others stay.
        fr = store.ids(filter={"lang": "fr"})
        before = len(store)
        assert store.delete_matching({"lang": "fr"}) == fr and len(fr) == 1
        assert store.delete_matching({"lang": "fr"}) == []
        assert len(store) == before - 1 and not store.search(question, k=10, filter={"lang": "fr"})
        with pytest.raises(ValueError, match="empty metadata filter"):
            store.delete_matching({})


def test_documents_are_kept_up_to_date(model, embedder, tmp_path):
    """Ingesting a document again with other text replaces its changed segments and removes
    the ones it lost; deleting a context or a document removes it from retrieval."""
    for url, states in store_locations(tmp_path):
        store = picaso.Store.create(url, model, embedder=embedder, states=states)
        store.ingest(["One text.", "Another text."])
        again = store.ingest(["One text."])
        assert (again["added"], again["replaced"], again["removed"], again["skipped"]) == (0, 0, 0, 1)
        assert len(store) == 2  # a str is named by its text: a new one adds, it never replaces
        first = {"id": "notes", "text": "Cats purr.\n\nCats sleep a lot.\n\nCats hunt mice."}
        assert store.ingest([first])["added"] == 3
        old = [c["id"] for c in store.document("notes")]
        report = store.ingest([{"id": "notes", "text": "Cats purr.\n\nCats sleep all day."}])
        counts = ("added", "replaced", "repaired", "removed", "skipped")
        assert tuple(report[k] for k in counts) == (0, 1, 0, 1, 1)
        now = store.document("notes")
        docs = store.documents()
        assert [d["id"] for d in docs] == sorted(d["id"] for d in docs) and len(docs) == 3
        assert {"id": "notes", "contexts": 2, "tokens": sum(len(model.encode(c["text"])) for c in now),
                "metadata": {}} in docs
        assert [c["text"] for c in now] == ["Cats purr.", "Cats sleep all day."]
        assert now[0]["id"] == old[0] and now[1]["id"] not in old and len(store) == 4
        for gone in old[1:]:
            with pytest.raises(ValueError, match="no context with id"):
                store.get(gone)
        fresh = model.state("Cats sleep all day.")
        np.testing.assert_array_equal(store.load_state(now[1]["id"]).ssm(0), fresh.ssm(0))

        store.delete(now[0]["id"])
        assert [c["segment"] for c in store.document("notes")] == [1]
        with pytest.raises(ValueError, match="no context with id"):
            store.delete(now[0]["id"])
        assert store.delete_document("notes") == 1 and store.document("notes") == []
        assert store.delete_document("notes") == 0
        assert all(h["doc"] != "notes" for h in store.search("cats", k=4)) and len(store) == 2
        assert store.ids() == [1, 2] and [store.get(i)["text"] for i in store.ids()] == ["One text.", "Another text."]


def test_check_finds_a_lost_state_and_repair_recomputes_it(model, embedder, tmp_path):
    """Store.check reads every state back; repair=True recomputes lost ones from their rows' tokens."""
    store = picaso.Store.create(str(tmp_path / "db"), model, embedder=embedder)
    store.ingest(["One text.", "Another text."])
    sound = store.check()
    assert (sound["contexts"], sound["sound"], sound["problems"], sound["repair"]) == (2, 2, [], None)
    before = store.load_state(2).ssm(0)
    for f in (tmp_path / "db" / "states").glob("*/*.safetensors"):
        f.unlink()  # a disk restored without them
    found = store.check()
    assert [(p["id"], p["kind"]) for p in found["problems"]] == [(1, "missing_state"), (2, "missing_state")]
    assert store.check(quick=True)["problems"] == found["problems"] and not store.check(quick=True)["read"]
    with pytest.raises(picaso.Error, match="check --db"):
        store.load_state(2)
    fixed = store.check(repair=True)
    assert fixed["repair"]["rewritten"] == [1, 2] and fixed["repair"]["left"] == []
    np.testing.assert_array_equal(store.load_state(2).ssm(0), before)
    assert store.check()["sound"] == 2
    reader = picaso.Store.open(str(tmp_path / "db"))
    with pytest.raises(ValueError, match="opened without a model"):
        reader.check(repair=True)


def test_a_store_opened_twice_sees_every_write(model, embedder, tmp_path):
    """A second Store of the same folder (or one in another process) follows the first's
    writes: retrieval, ids and lengths are the store's now, not what was there at open."""
    for url, states in store_locations(tmp_path):
        writer = picaso.Store.create(url, model, embedder=embedder, states=states)
        writer.ingest(["Dogs bark at night."])
        reader = picaso.Store.open(url, model=model, embedder=embedder)
        assert len(reader) == 1
        writer.ingest(["Cats purr when they are content."])
        assert reader.ids() == writer.ids() and len(reader) == 2
        cat = reader.search("a purring cat", k=1)[0]
        assert cat["text"] == "Cats purr when they are content."
        writer.delete(cat["id"])
        assert cat["id"] not in reader.ids()
        assert all(h["id"] != cat["id"] for h in reader.search("a purring cat", k=2))


def test_ingest_stops_when_its_callback_raises_and_checks_its_arguments(model, embedder, tmp_path):
    url = str(tmp_path / "db")
    store = picaso.Store.create(url, model, embedder=embedder)
    with pytest.raises(TypeError, match="progress must be callable"):
        store.ingest(["Never stored."], progress=5)
    assert len(store) == 0
    calls = []

    def stop_after_two(done, total):
        calls.append(done)
        if done >= 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        store.ingest([f"Document number {i}." for i in range(10)], batch=2, progress=stop_after_two)
    assert len(store) == 2 and calls == [0, 2]  # the batch in flight, then nothing more
    assert store.ingest([f"Document number {i}." for i in range(10)], batch=2)["added"] == 8  # carries on
    # The same text twice is one document (it is named by its text).
    assert store.ingest(["Twice.", "Twice."])["added"] == 1
    # An existing store keeps its precision: naming another is an error, leaving it out opens it.
    with pytest.raises(picaso.InvalidArgument, match="keeps its states in f32"):
        picaso.Store.create(url, model, embedder=embedder, state_dtype="bf16")
    assert len(picaso.Store.create(url, model, embedder=embedder)) == 11


def test_store_errors(model, tiny, embedder, tmp_path):
    url = str(tmp_path / "db")
    with pytest.raises(picaso.NotFound, match="not a picaso store"):
        picaso.Store.open(url)  # nothing there yet
    with pytest.raises(FileNotFoundError):
        picaso.Store.open(url)
    store = picaso.Store.create(url, model, embedder=embedder)
    with pytest.raises(TypeError, match="document 0"):
        store.ingest([3])
    with pytest.raises(ValueError, match='no "text" key'):
        store.ingest([{"id": "x"}])
    with pytest.raises(ValueError, match="has no text"):
        store.ingest(["   "])
    with pytest.raises(ValueError, match="unknown method"):
        store.query("x", method="mean")
    with pytest.raises(picaso.StateMismatch):
        picaso.Store.open(url, model=tiny)
    reader = picaso.Store.open(url)
    with pytest.raises(ValueError, match="without a model"):
        reader.query("x")
    with pytest.raises(FileNotFoundError):
        picaso.Store.create(str(tmp_path / "db2"), model, embedder=str(tmp_path / "no-embedder"))
    with pytest.raises(ValueError, match="no context with id"):
        store.get(12345)


def test_store_opens_without_its_embedder(model, embedder, tmp_path, monkeypatch):
    """Reading a store needs no embedder; search names the missing folder."""
    import pathlib

    moved = tmp_path / "minilm"
    moved.mkdir()
    for f in pathlib.Path(embedder).iterdir():
        (moved / f.name).symlink_to(f)
    url = str(tmp_path / "db")
    store = picaso.Store.create(url, model, embedder=str(moved))
    store.ingest(DOCS[:1])
    for f in moved.iterdir():
        f.unlink()
    moved.rmdir()
    monkeypatch.delenv("PICASO_EMBEDDER", raising=False)
    # Nowhere else to find it either: no shared data folder, no hub.
    monkeypatch.setenv("PICASO_SHARED_DATA", str(tmp_path / "no-shared-data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf-cache"))
    reader = picaso.Store.open(url, model=model)
    assert reader.stats()["contexts"] == 2 and reader.get(1)["doc"].startswith("text/")
    assert reader.state([1, 2]).n_tokens == reader.load_state(1).n_tokens + reader.load_state(2).n_tokens
    assert reader.query("The tower", method="naive", max_tokens=2).contexts == []
    with pytest.raises(FileNotFoundError, match="minilm: embedder folder not found"):
        reader.search("tower")
    assert picaso.Store.open(url, model=model, embedder=embedder).search("tower", k=1)[0]["id"] in (1, 2)
    # The lookup's last place, a shared data folder, holds the same embedder: found, checked, used.
    if pathlib.Path(embedder).name == "all-MiniLM-L6-v2":
        monkeypatch.setenv("PICASO_SHARED_DATA", str(pathlib.Path(embedder).parent))
        assert picaso.Store.open(url, model=model).search("tower", k=1)[0]["id"] in (1, 2)


def test_a_state_budget_answers_like_a_full_store(model, embedder, tmp_path):
    """state_budget_mb keeps at most that many MiB of states; the rest are recomputed, bit for bit."""
    texts = [f"Paragraph {i} is about the subject numbered {i}, and nothing else." for i in range(8)]
    full = picaso.Store.create(str(tmp_path / "full"), model, embedder=embedder)
    full.ingest(texts)
    one = full.stats()["state_bytes"] / 8
    with pytest.raises(ValueError, match="not even one state"):
        picaso.Store.create(str(tmp_path / "small"), model, embedder=embedder, state_budget_mb=one / 2 / 2**20)
    with pytest.raises(ValueError, match="unknown state budget policy"):
        picaso.Store.create(str(tmp_path / "x"), model, embedder=embedder, state_budget_mb=1, state_budget_policy="fifo")
    budgeted = picaso.Store.create(
        str(tmp_path / "budgeted"), model, embedder=embedder, state_budget_mb=2.5 * one / 2**20, state_budget_policy="lru"
    )
    budgeted.ingest(texts)
    b = budgeted.stats()["budget"]
    assert b["policy"] == "lru" and b["held"] == 2 and b["tracked"] == 8 and b["held_bytes"] <= b["budget_bytes"]
    assert full.stats()["budget"] is None
    for i in [1, 5, 1, 7, 3]:
        prompt = f"Tell me about subject {i}"
        assert budgeted.query(prompt, k=3, max_tokens=5).text == full.query(prompt, k=3, max_tokens=5).text
        np.testing.assert_array_equal(budgeted.load_state(i + 1).ssm(0), full.load_state(i + 1).ssm(0))
    b = budgeted.stats()["budget"]
    assert b["misses"] > 0 and b["held_bytes"] <= b["budget_bytes"]
    assert budgeted.check()["problems"] == []
