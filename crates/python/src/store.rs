//! `Store`: a database of states, opened or created, ingested into, searched and queried.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use picaso_model::{GenerateOptions, Method, StateDtype};

use crate::errors::{embed_err, model_err, raise, store_err, Kind};
use crate::generation::Generation;
use crate::model::Model;
use crate::records::{documents_of, filter_from_py, metadata_from_py, metadata_to_py, record_dict};
use crate::state::State;

/// A database of states: contexts processed once, retrieved by meaning, composed at query time.
/// A folder, or postgres:// metadata with states in a folder or s3://.
#[pyclass(frozen, module = "picaso")]
pub(crate) struct Store {
    inner: Arc<picaso_store::Store>,
    model: Option<Arc<picaso_model::Model>>,
    /// Loaded when first needed (ingest, search, query), so a store opens for reading even
    /// where its embedder is not at hand.
    embedder: std::sync::OnceLock<picaso_embed::Embedder>,
    /// The embedder folder given to `open`, if any.
    embedder_dir: Option<PathBuf>,
}

fn location(url: &str, states: Option<&str>) -> PyResult<picaso_store::Location> {
    picaso_store::Location::parse(url, states).map_err(store_err)
}

/// The embedder ([`picaso_store::find_embedder`]: the folder given, `$PICASO_EMBEDDER`, the
/// store's own, the hub, the shared data folder).
fn embedder_for(given: Option<PathBuf>, store: Option<&picaso_store::Store>) -> PyResult<picaso_embed::Embedder> {
    use picaso_store::EmbedderError as E;
    picaso_store::find_embedder(given.as_deref(), store).map_err(|e| match e {
        E::Store(e) => store_err(e),
        E::NotFound(_) | E::Gone { .. } => raise(Kind::NotFound, e.to_string()),
        E::Mismatch { .. } => raise(Kind::StateMismatch, e.to_string()),
        E::Missing(_) => raise(Kind::Invalid, e.to_string()),
        E::Load { .. } => raise(Kind::Other, e.to_string()),
    })
}

#[pymethods]
impl Store {
    /// Opens an existing store. `model` is needed to ingest and query; `embedder` (an
    /// all-MiniLM-L6-v2 folder, loaded when first needed) defaults to $PICASO_EMBEDDER, the one
    /// the store recorded, the Hugging Face hub, then ../shared/data (the CLI's order).
    #[staticmethod]
    #[pyo3(signature = (url, *, model=None, embedder=None))]
    fn open(py: Python<'_>, url: &str, model: Option<&Model>, embedder: Option<PathBuf>) -> PyResult<Self> {
        let loc = location(url, None)?;
        let missing_folder = matches!(&loc.catalog, picaso_store::CatalogUrl::Sqlite(dir) if !picaso_store::catalog::SqliteCatalog::exists_at(dir));
        // A folder that holds no store is a store not found (NotFound, a FileNotFoundError).
        let store = py.detach(|| picaso_store::Store::open(loc)).map_err(|e| match missing_folder {
            true => raise(Kind::NotFound, e.to_string()),
            false => store_err(e),
        })?;
        let store = Self::new(store, model, embedder)?;
        if store.embedder_dir.is_some() {
            store.embedder()?; // an embedder named explicitly is checked at once
        }
        Ok(store)
    }

    /// Creates a store for `model` (or opens it if it exists, checking that it was made with
    /// this model). `states` places state files elsewhere (a folder or s3://bucket/prefix) when
    /// `url` is postgres://; `state_dtype` "f32" (the default for a new store), "bf16", "int8"
    /// or "int4" (an existing store keeps its own; naming another is an error: convert a store
    /// with `picaso migrate --state-dtype`). `state_budget_mb` keeps at most that many MiB of
    /// state objects (recorded in the store; 0 removes a budget), by `state_budget_policy`
    /// "work" (the default) or "lru": states not held are recomputed when a query needs them.
    #[staticmethod]
    #[pyo3(signature = (url, model, *, embedder=None, states=None, state_dtype=None, state_budget_mb=None, state_budget_policy=None))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
        url: &str,
        model: &Model,
        embedder: Option<PathBuf>,
        states: Option<&str>,
        state_dtype: Option<&str>,
        state_budget_mb: Option<f64>,
        state_budget_policy: Option<&str>,
    ) -> PyResult<Self> {
        let loc = location(url, states)?;
        let want = state_dtype
            .map(|d| d.parse::<StateDtype>().map_err(|e| raise(Kind::Invalid, e.to_string())))
            .transpose()?;
        let embedder = embedder_for(embedder, None)?;
        let info = picaso_store::StoreInfo {
            fingerprint: model.inner.fingerprint().to_string(),
            dim: embedder.dim(),
            state_dtype: want.unwrap_or_default(),
        };
        let store = py.detach(|| picaso_store::Store::open_or_create(loc, &info)).map_err(store_err)?;
        if let Some(want) = want {
            store.require_state_dtype(want).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        }
        if let Some(mb) = state_budget_mb {
            let policy = state_budget_policy
                .map(|p| p.parse::<picaso_store::Policy>().map_err(|e| raise(Kind::Invalid, e)))
                .transpose()?
                .unwrap_or_default();
            let budget = picaso_store::Budget::from_mib(mb, policy)
                .map_err(|e| raise(Kind::Invalid, format!("state_budget_mb={e}")))?;
            let m = &model.inner;
            py.detach(|| store.set_budget(budget, m)).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        } else if state_budget_policy.is_some() {
            return Err(raise(Kind::Invalid, "state_budget_policy needs state_budget_mb"));
        }
        // Recorded now, so that `Store.open` finds it even before the first ingest.
        store.bind_embedder(embedder.fingerprint(), &embedder.dir().display().to_string()).map_err(store_err)?;
        let store = Self::new(store, Some(model), None)?;
        let _ = store.embedder.set(embedder);
        Ok(store)
    }

    /// Adds documents: a list of strings (one document each, paragraphs split at blank lines,
    /// its id "text/" + a hash of the text) or of dicts {"id": str, "text": str, "metadata":
    /// dict (optional: title, URL, ...; every context of the document carries it)}. One context
    /// per paragraph by default; `segment` "tokens:N" cuts runs of N tokens. Segments already
    /// stored with the same text are skipped; a document given again with other text is
    /// brought up to date (changed segments replaced, segments it no longer has removed), and a
    /// stored segment whose state file is missing is processed again ("repaired").
    /// `progress(done, total)` is called as contexts are stored; an exception it raises stops
    /// the ingest after the batch in flight (the batches stored stay: ingesting again carries on).
    /// Returns {"added", "replaced", "repaired", "removed", "skipped", "relabelled" (skipped
    /// segments that took their document's new metadata), "tokens", "seconds"}.
    #[pyo3(signature = (documents, *, segment="paragraph", batch=8, progress=None))]
    fn ingest<'py>(
        &self,
        py: Python<'py>,
        documents: &Bound<'py, PyList>,
        segment: &str,
        batch: usize,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let model = self.need_model()?;
        let docs = documents_of(documents)?;
        let segmentation = segment.parse::<picaso_store::Segmentation>().map_err(|e| raise(Kind::Invalid, e))?;
        if batch == 0 {
            return Err(raise(Kind::Invalid, "batch must be at least 1"));
        }
        if let Some(f) = &progress {
            if !f.bind(py).is_callable() {
                return Err(PyTypeError::new_err("progress must be callable: progress(done, total)"));
            }
        }
        let (store, embedder) = (&self.inner, self.embedder()?);
        let mut callback_error = None;
        // A callback that raises stops the ingest after the batch in flight (those committed
        // stay; ingesting again carries on) and its exception is raised.
        let report = py
            .detach(|| {
                picaso_store::ingest_while(store, model, embedder, &docs, segmentation, batch, |p| {
                    let Some(f) = &progress else { return true };
                    match Python::attach(|py| f.call1(py, (p.done, p.total))) {
                        Ok(_) => true,
                        Err(e) => {
                            callback_error = Some(e);
                            false
                        }
                    }
                })
            })
            .map_err(store_err)?;
        if let Some(e) = callback_error {
            return Err(e);
        }
        let d = PyDict::new(py);
        d.set_item("added", report.added())?;
        d.set_item("replaced", report.replaced)?;
        d.set_item("repaired", report.repaired)?;
        d.set_item("removed", report.removed)?;
        d.set_item("skipped", report.skipped)?;
        d.set_item("relabelled", report.relabelled)?;
        d.set_item("tokens", report.tokens)?;
        d.set_item("seconds", report.seconds)?;
        Ok(d)
    }

    /// The `k` contexts nearest to `query` by meaning, best first: dicts {id, score, doc, segment,
    /// text, metadata}. `documents` (names, as `documents()` lists them) limits the search to
    /// their contexts; `filter` (a dict) to contexts whose metadata passes it: each key's value
    /// is a scalar to equal, or operators ({"$gte": 2020, "$lt": 2025}; also $eq, $ne, $gt,
    /// $lte, $in, $nin, $exists, $contains, $prefix, $regex, $elemMatch, $not), all of which
    /// must hold, and keys within the object there ({"author": {"name": "Ann"}}); "$or", "$and"
    /// and "$nor" in place of a key combine filters. `retriever` ranks by "dense" (the
    /// default: cosine of sentence embeddings), "bm25" (the contexts' text) or "hybrid"
    /// (reciprocal-rank fusion of both, the dense ranking weighted `hybrid_weight`, 0.5 unless
    /// given); a score is then a cosine, a BM25 score or a fused reciprocal rank.
    #[pyo3(signature = (query, k=4, *, documents=None, filter=None, retriever="dense", hybrid_weight=None))]
    #[allow(clippy::too_many_arguments)]
    fn search<'py>(
        &self,
        py: Python<'py>,
        query: &str,
        k: usize,
        documents: Option<Vec<String>>,
        filter: Option<&Bound<'py, PyAny>>,
        retriever: &str,
        hybrid_weight: Option<f32>,
    ) -> PyResult<Bound<'py, PyList>> {
        let filter = filter_from_py(filter)?;
        let retriever = picaso_store::Retriever::parse(retriever, hybrid_weight).map_err(store_err)?;
        let store = &self.inner;
        let embedder = if retriever.needs_embedding() { Some(self.embedder()?) } else { None };
        let hits = py.detach(|| -> PyResult<_> {
            let q = match embedder {
                Some(e) => Some(e.embed_one(query).map_err(embed_err)?),
                None => None,
            };
            let scope = picaso_store::Scope { documents: documents.as_deref(), filter: filter.as_ref() };
            let query = picaso_store::Query {
                text: Some(query),
                embedding: q.as_deref(),
                encoder: embedder.map(|e| e.fingerprint()),
            };
            store.retrieve_records(&query, retriever, k, scope).map_err(store_err)
        })?;
        let list = PyList::empty(py);
        for (r, score) in &hits {
            list.append(record_dict(py, r, Some(*score))?)?;
        }
        Ok(list)
    }

    /// The state of the contexts with these ids, composed by `method` (picaso-r, picaso-s, caso,
    /// soup; concat processes their tokens; naive is the zero state). The last id is nearest the prompt.
    #[pyo3(signature = (ids, method="picaso-r"))]
    fn state(&self, py: Python<'_>, ids: Vec<i64>, method: &str) -> PyResult<State> {
        let model = self.need_model()?;
        let method = Method::parse_among(method, &Method::QUERY).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        let store = &self.inner;
        let prepared = py.detach(|| picaso_store::prepare(store, model, &ids, method, None)).map_err(store_err)?;
        Ok(State { inner: prepared.state })
    }

    /// Retrieves the `k` contexts nearest to `prompt`, composes their states by `method` and
    /// continues the prompt from the composed state. Returns a Generation whose `contexts` are
    /// the retrieved ones, best first. `documents` (names) retrieves only from their contexts,
    /// `filter` (a dict, as for `search`) only from contexts whose metadata passes it;
    /// `retriever` and `hybrid_weight` choose the ranking, as for `search`.
    #[pyo3(signature = (prompt, k=4, method="picaso-r", *, max_tokens=64, temperature=0.0, top_p=1.0, seed=0, stop=None, documents=None, filter=None, retriever="dense", hybrid_weight=None))]
    #[allow(clippy::too_many_arguments)]
    fn query<'py>(
        &self,
        py: Python<'py>,
        prompt: &str,
        k: usize,
        method: &str,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        seed: u64,
        stop: Option<Vec<String>>,
        documents: Option<Vec<String>>,
        filter: Option<&Bound<'py, PyAny>>,
        retriever: &str,
        hybrid_weight: Option<f32>,
    ) -> PyResult<Generation> {
        let model = self.need_model()?;
        let retriever = picaso_store::Retriever::parse(retriever, hybrid_weight).map_err(store_err)?;
        let method = Method::parse_among(method, &Method::QUERY).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        if method == Method::Naive && (documents.is_some() || filter.is_some()) {
            return Err(raise(
                Kind::Invalid,
                "method \"naive\" retrieves nothing: drop `documents` and `filter`, or pick another method",
            ));
        }
        let filter = filter_from_py(filter)?;
        let tokens = model.tokenizer().and_then(|t| t.encode(prompt)).map_err(model_err)?;
        if tokens.is_empty() {
            return Err(raise(Kind::Invalid, "the prompt must contain at least one token"));
        }
        let opts =
            GenerateOptions { max_tokens, temperature, top_p, seed, stop: stop.unwrap_or_default(), ignore_eos: false };
        opts.validate().map_err(model_err)?;
        let store = &self.inner;
        let retrieves = method != Method::Naive;
        let embedder = if retrieves && retriever.needs_embedding() { Some(self.embedder()?) } else { None };
        let (hits, g) = py.detach(|| -> PyResult<_> {
            let q = match embedder {
                Some(e) => e.embed_one(prompt).map_err(embed_err)?,
                None => Vec::new(),
            };
            let contexts = match retrieves {
                false => picaso_store::Contexts::Nothing,
                true => {
                    let mut what = picaso_store::Retrieval::new(&q, k)
                        .within(documents.as_deref())
                        .matching(filter.as_ref())
                        .by(retriever, Some(prompt));
                    if let Some(e) = embedder {
                        what = what.embedded_by(e.fingerprint());
                    }
                    picaso_store::Contexts::Retrieved(what)
                }
            };
            let (hits, prepared) =
                picaso_store::gather(store, contexts, |ids| picaso_store::prepare(store, model, ids, method, None))
                    .map_err(store_err)?;
            let g = picaso_model::generate(model, &tokens, &prepared.state, &opts, |_| true).map_err(model_err)?;
            Ok((hits, g))
        })?;
        // Composition wants the most relevant last; callers read best first.
        let mut contexts = Vec::with_capacity(hits.len());
        for (id, score) in hits.iter().rev() {
            let r = store.get(*id).map_err(store_err)?;
            contexts.push(record_dict(py, &r, *score)?.unbind());
        }
        Ok(Generation::from(model, g, contexts))
    }

    /// Which of the contexts does `answer` (continuing `prompt`) owe most to? Each context is
    /// left out in turn, the others are combined again by `method` and the answer is scored.
    /// The contexts are `ids` (the last nearest the prompt) or else the `k` retrieved for the
    /// prompt (from `documents`' contexts only, and those whose metadata matches `filter`, when
    /// given). Returns {"method", "answer_tokens",
    /// "loglik" (nats with every context), "contexts"}: each context's record with
    /// "loglik_without" and "drop" (what the answer loses without it), the one it owes most to
    /// first.
    #[pyo3(signature = (prompt, answer, ids=None, k=4, method="picaso-r", *, documents=None, filter=None, retriever="dense", hybrid_weight=None))]
    #[allow(clippy::too_many_arguments)]
    fn attribute<'py>(
        &self,
        py: Python<'py>,
        prompt: &str,
        answer: &str,
        ids: Option<Vec<i64>>,
        k: usize,
        method: &str,
        documents: Option<Vec<String>>,
        filter: Option<&Bound<'py, PyAny>>,
        retriever: &str,
        hybrid_weight: Option<f32>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let model = self.need_model()?;
        let retriever = picaso_store::Retriever::parse(retriever, hybrid_weight).map_err(store_err)?;
        let method = Method::parse_among(method, &Method::QUERY).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        if ids.is_some() && (documents.is_some() || filter.is_some()) {
            return Err(raise(
                Kind::Invalid,
                "`documents` and `filter` limit retrieval; with `ids` nothing is retrieved: give one or the other",
            ));
        }
        let filter = filter_from_py(filter)?;
        let tokenizer = model.tokenizer().map_err(model_err)?;
        let (prompt_ids, answer_ids) =
            (tokenizer.encode(prompt).map_err(model_err)?, tokenizer.encode(answer).map_err(model_err)?);
        let store = &self.inner;
        let attribute =
            |ids: &[i64]| picaso_store::attribute(store, model, ids, method, &prompt_ids, &answer_ids, None);
        let (hits, at): (Vec<(i64, Option<f32>)>, _) = match ids {
            Some(ids) => {
                let at = py.detach(|| attribute(&ids)).map_err(store_err)?;
                (ids.into_iter().map(|id| (id, None)).collect(), at)
            }
            None => {
                let embedder = if retriever.needs_embedding() { Some(self.embedder()?) } else { None };
                let q = match embedder {
                    Some(e) => py.detach(|| e.embed_one(prompt)).map_err(embed_err)?,
                    None => Vec::new(),
                };
                let mut what = picaso_store::Retrieval::new(&q, k)
                    .within(documents.as_deref())
                    .matching(filter.as_ref())
                    .by(retriever, Some(prompt));
                if let Some(e) = embedder {
                    what = what.embedded_by(e.fingerprint());
                }
                let (hits, at) =
                    py.detach(|| picaso_store::retrieve_then(store, what, attribute)).map_err(store_err)?;
                (hits.into_iter().map(|(id, score)| (id, Some(score))).collect(), at)
            }
        };
        let contexts = PyList::empty(py);
        for i in at.ranking() {
            let r = store.get(hits[i].0).map_err(store_err)?;
            let d = record_dict(py, &r, hits[i].1)?;
            d.set_item("loglik_without", at.without[i])?;
            d.set_item("drop", at.drop(i))?;
            contexts.append(d)?;
        }
        let out = PyDict::new(py);
        out.set_item("method", method.name())?;
        out.set_item("answer_tokens", at.answer_tokens)?;
        out.set_item("loglik", at.loglik)?;
        out.set_item("contexts", contexts)?;
        Ok(out)
    }

    /// The context with this id: {id, score (None), doc, segment, text}.
    fn get<'py>(&self, py: Python<'py>, id: i64) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.get(id).map_err(store_err)?;
        record_dict(py, &r, None)
    }

    /// The contexts of document `doc`, in segment order: [{id, score (None), doc, segment,
    /// text}]; empty for a document the store does not hold.
    fn document<'py>(&self, py: Python<'py>, doc: &str) -> PyResult<Bound<'py, PyList>> {
        let records = self.inner.document(doc).map_err(store_err)?;
        let list = PyList::empty(py);
        for r in &records {
            list.append(record_dict(py, r, None)?)?;
        }
        Ok(list)
    }

    /// Removes the context with this id (and its stored state unless another context shares it).
    fn delete(&self, py: Python<'_>, id: i64) -> PyResult<()> {
        let store = &self.inner;
        py.detach(|| {
            let _writer = store.lock_writes()?;
            store.delete(id)
        })
        .map_err(store_err)
    }

    /// Removes every context of document `doc`; returns how many (0 if it holds none).
    fn delete_document(&self, py: Python<'_>, doc: &str) -> PyResult<usize> {
        let store = &self.inner;
        py.detach(|| {
            let _writer = store.lock_writes()?;
            store.delete_document(doc).map(|ids| ids.len())
        })
        .map_err(store_err)
    }

    /// Removes every context whose metadata passes `filter` (as for `search`), all at once;
    /// returns their ids, ascending (empty when none passes).
    fn delete_matching(&self, py: Python<'_>, filter: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        let filter = picaso_store::Filter::new(&metadata_from_py(filter, "filter")?).map_err(store_err)?;
        let store = &self.inner;
        py.detach(|| {
            let _writer = store.lock_writes()?;
            store.delete_many(&store.matching(&filter)?)
        })
        .map_err(store_err)
    }

    /// The stored state of one context (in a store with a state budget that does not hold it,
    /// recomputed by the store's model: the same bits).
    fn load_state(&self, py: Python<'_>, id: i64) -> PyResult<State> {
        let store = &self.inner;
        let model = self.model.clone();
        let inner = py
            .detach(|| match (store.budget()?, model) {
                (Some(_), Some(model)) => {
                    let state = store.states_for(&model, &[id], None)?.states[0].view().to_state();
                    state.check_values()?;
                    Ok(state)
                }
                _ => store.load_state(id),
            })
            .map_err(store_err)?;
        Ok(State { inner })
    }

    /// Reads every context's state object back and verifies it (present, checksum, a state of
    /// the store's model over the context's tokens, finite values), and lists the state objects
    /// no context names; `quick=True` reads none and finds only missing ones (one listing).
    /// With `repair=True` (needs the store's model), recomputes each broken state from the
    /// token ids in its row and removes the unnamed objects. Returns what `picaso check
    /// --json` prints: {"read", "contexts", "sound", "state_bytes", "problems": [{"id",
    /// "doc", "seg", "kind", "detail"}], "unreferenced": [{"key", "bytes"}],
    /// "unreferenced_bytes", "seconds", "repair": None or {"rewritten", "restated", "gone",
    /// "removed_objects", "removed_bytes", "left", "seconds"}}.
    #[pyo3(signature = (*, repair=false, quick=false))]
    fn check<'py>(&self, py: Python<'py>, repair: bool, quick: bool) -> PyResult<Bound<'py, PyAny>> {
        let model = if repair { Some(self.need_model()?) } else { None };
        let store = &self.inner;
        let report = py.detach(|| -> picaso_store::Result<serde_json::Value> {
            let found = picaso_store::check(store, quick, |_, _| {})?;
            let repaired = match &model {
                Some(m) => Some(picaso_store::repair(store, m, &found, |_, _| {})?),
                None => None,
            };
            Ok(picaso_store::report_json(&found, repaired.as_ref()))
        });
        let text = report.map_err(store_err)?.to_string();
        py.import("json")?.call_method1("loads", (text,))
    }

    /// {"contexts", "documents", "tokens", "state_bytes", "state_dtype", "model", "catalog", "states",
    /// "budget"}: "budget" is None, or {"budget_bytes", "policy", "held_bytes", "held",
    /// "tracked", "hits", "misses"}.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats().map_err(store_err)?;
        let d = PyDict::new(py);
        d.set_item("contexts", s.contexts)?;
        d.set_item("documents", s.documents)?;
        d.set_item("tokens", s.tokens)?;
        d.set_item("state_bytes", s.state_bytes)?;
        d.set_item("state_dtype", s.state_dtype)?;
        d.set_item("model", s.model)?;
        d.set_item("catalog", s.catalog)?;
        d.set_item("states", s.states)?;
        match s.budget {
            None => d.set_item("budget", py.None())?,
            Some(b) => {
                let text = serde_json::to_string(&b).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
                d.set_item("budget", py.import("json")?.call_method1("loads", (text,))?)?
            }
        }
        Ok(d)
    }

    /// Every document, in name order: [{id, contexts, tokens, metadata}] (the metadata of its
    /// first context).
    fn documents<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let all = self.inner.all_documents().map_err(store_err)?;
        let list = PyList::empty(py);
        for d in all {
            let item = PyDict::new(py);
            item.set_item("metadata", metadata_to_py(py, &d.metadata)?)?;
            item.set_item("id", d.id)?;
            item.set_item("contexts", d.contexts)?;
            item.set_item("tokens", d.tokens)?;
            list.append(item)?;
        }
        Ok(list)
    }

    /// The ids of every context, or of those whose metadata passes `filter` (as for `search`),
    /// ascending (read one with `get`).
    #[pyo3(signature = (*, filter=None))]
    fn ids(&self, py: Python<'_>, filter: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<i64>> {
        let filter = filter_from_py(filter)?;
        py.detach(|| match &filter {
            None => self.inner.ids(),
            Some(f) => self.inner.matching(f),
        })
        .map_err(store_err)
    }

    /// Why no context passes `filter` (as for `search`), as far as counting tells, one line
    /// each (empty when it tells nothing): how many contexts each of its keys passes alone,
    /// when it has several; each key tested within objects that holds lists, with the
    /// `$elemMatch` that tests their elements. For when `ids(filter=...)` is empty.
    fn why_none_match(&self, py: Python<'_>, filter: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let filter = picaso_store::Filter::new(&metadata_from_py(filter, "filter")?).map_err(store_err)?;
        py.detach(|| self.inner.why_none_match(&filter)).map_err(store_err)
    }

    fn __len__(&self) -> PyResult<usize> {
        self.inner.len().map_err(store_err)
    }

    fn __repr__(&self) -> String {
        format!("Store({:?})", self.inner.location().to_string())
    }
}

impl Store {
    fn new(store: picaso_store::Store, model: Option<&Model>, embedder_dir: Option<PathBuf>) -> PyResult<Self> {
        if let Some(m) = model {
            store.require_model(&m.inner).map_err(store_err)?;
        }
        Ok(Self {
            inner: Arc::new(store),
            model: model.map(|m| m.inner.clone()),
            embedder: std::sync::OnceLock::new(),
            embedder_dir,
        })
    }

    /// The embedder, loaded on first use (see `embedder_for`).
    fn embedder(&self) -> PyResult<&picaso_embed::Embedder> {
        if let Some(e) = self.embedder.get() {
            return Ok(e);
        }
        let e = embedder_for(self.embedder_dir.clone(), Some(&self.inner))?;
        Ok(self.embedder.get_or_init(|| e))
    }

    fn need_model(&self) -> PyResult<&picaso_model::Model> {
        self.model
            .as_deref()
            .ok_or_else(|| raise(Kind::Invalid, "this store was opened without a model: pass model= to Store.open"))
    }
}
