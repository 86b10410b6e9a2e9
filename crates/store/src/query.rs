//! Turning retrieved contexts into the state a prompt continues from: with no context (naive),
//! by processing their tokens (concat, the baseline), or by composing their stored states.

use std::time::Instant;

use std::sync::Arc;

use picaso_model::{compose_views, MappedState, Method, Model, State, StateView};

use crate::budget::Loaded;
use crate::cache::StateCache;
use crate::error::{Error, Result};
use crate::filter::Filter;
use crate::retriever::{Query, Retriever};
use crate::scope::Scope;
use crate::store::{Store, RETRIEVAL_ATTEMPTS};

/// The state to continue from, and what it cost.
#[derive(Debug)]
pub struct Prepared {
    /// The state after the contexts.
    pub state: State,
    /// Seconds to load the states from the store (0 for naive and concat).
    pub load_seconds: f64,
    /// Seconds to compose them, or to process the tokens for concat.
    pub compose_seconds: f64,
    /// States read from the store (cache misses).
    pub states_loaded: usize,
    /// States served from the cache.
    pub cache_hits: usize,
    /// States recomputed from their tokens (a store with a state budget that does not hold
    /// them; counted in `states_loaded` too).
    pub states_recomputed: usize,
    /// Bytes of state objects read from the store.
    pub bytes_read: u64,
    /// A budgeted store's bookkeeping for this query, when [`prepare_deferring`] left it for
    /// after the answer: run [`crate::budget::Deferred::finish`].
    pub deferred: Option<crate::budget::Deferred>,
    /// Context tokens processed by the model: concat's, or a budgeted store's recomputed
    /// states' (composition of stored states processes none).
    pub tokens_processed: usize,
}

impl Prepared {
    fn empty(state: State) -> Self {
        Self {
            state,
            load_seconds: 0.0,
            compose_seconds: 0.0,
            states_loaded: 0,
            cache_hits: 0,
            states_recomputed: 0,
            bytes_read: 0,
            deferred: None,
            tokens_processed: 0,
        }
    }

    /// Seconds since `started` spent retrieving: what the query did besides loading and
    /// composing (embedding the prompt too, when the clock started before it).
    pub fn retrieval_seconds(&self, started: Instant) -> f64 {
        (started.elapsed().as_secs_f64() - self.load_seconds - self.compose_seconds).max(0.0)
    }
}

/// A query's contexts in composition order (most relevant last), each with its retrieval score
/// (`None` when named by id).
pub type Hits = Vec<(i64, Option<f32>)>;

/// Where a query's contexts come from.
#[derive(Debug, Clone, Copy)]
pub enum Contexts<'a> {
    /// None: the query answers without context.
    Nothing,
    /// These ids, in composition order (the last nearest the prompt).
    Ids(&'a [i64]),
    /// Those a retrieval finds.
    Retrieved(Retrieval<'a>),
}

/// Finds a query's contexts and runs `work` on their ids in composition order (most relevant
/// last): usually [`prepare`], which builds the state to continue from. Returns each context
/// with its retrieval score (`None` when named by id) and what `work` made. Retrieval survives
/// a concurrent delete ([`retrieve_then`]).
pub fn gather<T>(
    store: &Store,
    contexts: Contexts<'_>,
    mut work: impl FnMut(&[i64]) -> Result<T>,
) -> Result<(Hits, T)> {
    match contexts {
        Contexts::Nothing => Ok((Vec::new(), work(&[])?)),
        Contexts::Ids(ids) => Ok((ids.iter().map(|&id| (id, None)).collect(), work(ids)?)),
        Contexts::Retrieved(what) => {
            let (hits, done) = retrieve_then(store, what, work)?;
            Ok((hits.into_iter().map(|(id, score)| (id, Some(score))).collect(), done))
        }
    }
}

/// What to retrieve: the `k` contexts a [`Retriever`] ranks highest for a query (by default
/// dense: nearest a normalised query embedding), among every context or those a [`Scope`]
/// allows ([`Store::retrieve_in`]).
#[derive(Debug, Clone, Copy)]
pub struct Retrieval<'a> {
    /// The query's embedding (normalised; empty when the retriever needs none).
    pub query: &'a [f32],
    /// How many contexts.
    pub k: usize,
    /// Which contexts may be retrieved.
    pub scope: Scope<'a>,
    /// The query's text (BM25 and hybrid retrieval).
    pub text: Option<&'a str>,
    /// Which retriever ranks the contexts.
    pub retriever: Retriever,
    /// Fingerprint of the encoder that embedded `query`, checked against the store's.
    pub encoder: Option<&'a str>,
}

impl<'a> Retrieval<'a> {
    /// The `k` nearest `query` in every document.
    pub fn new(query: &'a [f32], k: usize) -> Self {
        Self { query, k, scope: Scope::all(), text: None, retriever: Retriever::Dense, encoder: None }
    }

    /// The same, ranked by `retriever`, the query's text being `text`.
    pub fn by(mut self, retriever: Retriever, text: Option<&'a str>) -> Self {
        self.retriever = retriever;
        self.text = text;
        self
    }

    /// The same, the query embedding made by the encoder of this fingerprint (refused by a
    /// store built with another).
    pub fn embedded_by(mut self, fingerprint: &'a str) -> Self {
        self.encoder = Some(fingerprint);
        self
    }

    /// The query as [`Store::retrieve_in`] takes it.
    pub fn as_query(&self) -> Query<'a> {
        let embedding = (!self.query.is_empty() || self.retriever.needs_embedding()).then_some(self.query);
        Query { text: self.text, embedding, encoder: self.encoder }
    }

    /// The same, among the contexts of `documents` only (`None`: all).
    pub fn within(mut self, documents: Option<&'a [String]>) -> Self {
        self.scope.documents = documents;
        self
    }

    /// The same, among the contexts whose metadata matches `filter` only (`None`: any).
    pub fn matching(mut self, filter: Option<&'a Filter>) -> Self {
        self.scope.filter = filter;
        self
    }
}

/// Retrieves the contexts `what` asks for and runs `work` on their ids in composition order
/// (most relevant last, nearest the prompt). Returns the hits in that order and what `work`
/// made. A context deleted by another writer between the search and the work is left out and
/// the search runs again without it, so a concurrent delete never fails a caller that named no
/// context.
pub fn retrieve_then<T>(
    store: &Store,
    what: Retrieval<'_>,
    mut work: impl FnMut(&[i64]) -> Result<T>,
) -> Result<(Vec<(i64, f32)>, T)> {
    let mut gone = Vec::new();
    loop {
        let mut hits = store.retrieve_without(&what.as_query(), what.retriever, what.k, what.scope, &gone)?;
        hits.reverse();
        let ids: Vec<i64> = hits.iter().map(|h| h.0).collect();
        match work(&ids) {
            Ok(done) => return Ok((hits, done)),
            Err(Error::NotFound(id)) if ids.contains(&id) && gone.len() < RETRIEVAL_ATTEMPTS => gone.push(id),
            Err(e) => return Err(e),
        }
    }
}

/// Builds the state for `ids` (in order: the last is nearest the prompt) with `method`, reading
/// states through `cache` when one is given. A budgeted store's bookkeeping (counting the
/// retrievals, admitting recomputed states) is done before this returns.
pub fn prepare(
    store: &Store,
    model: &Model,
    ids: &[i64],
    method: Method,
    cache: Option<&StateCache>,
) -> Result<Prepared> {
    let mut prepared = prepare_deferring(store, model, ids, method, cache)?;
    if let Some(deferred) = prepared.deferred.take() {
        deferred.finish(store)?;
    }
    Ok(prepared)
}

/// [`prepare`], leaving a budgeted store's bookkeeping in [`Prepared::deferred`] for the caller
/// to finish once the query is answered (a server answers first, then writes).
pub fn prepare_deferring(
    store: &Store,
    model: &Model,
    ids: &[i64],
    method: Method,
    cache: Option<&StateCache>,
) -> Result<Prepared> {
    store.require_model(model)?;
    match method.check_among(&Method::QUERY).map_err(|e| Error::Input(e.to_string()))? {
        Method::Naive => Ok(Prepared::empty(model.zero_state())),
        Method::Concat => {
            let mut tokens = Vec::new();
            for &id in ids {
                tokens.extend(store.get(id)?.tokens);
            }
            let t0 = Instant::now();
            let state = model.prefill(&tokens, &model.zero_state())?;
            Ok(Prepared {
                compose_seconds: t0.elapsed().as_secs_f64(),
                tokens_processed: tokens.len(),
                ..Prepared::empty(state)
            })
        }
        Method::Compose(m) => {
            if ids.is_empty() {
                return Ok(Prepared::empty(model.zero_state()));
            }
            let t0 = Instant::now();
            let mut loaded = map_states(store, model, ids, cache)?;
            let load_seconds = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let views: Vec<StateView<'_>> = loaded.states.iter().map(|s| s.view()).collect();
            let state = compose_views(m, &views, None)?;
            Ok(Prepared {
                state,
                load_seconds,
                compose_seconds: t1.elapsed().as_secs_f64(),
                states_loaded: ids.len() - loaded.cache_hits,
                cache_hits: loaded.cache_hits,
                states_recomputed: loaded.recomputed,
                bytes_read: loaded.bytes_read,
                deferred: loaded.deferred.take(),
                tokens_processed: loaded.recomputed_tokens,
            })
        }
        Method::PiConcatR | Method::KvUnion | Method::PicasoRNoKv => unreachable!("not in Method::QUERY"),
    }
}

impl Store {
    /// The states of contexts `ids`, in order, read through `cache` when given; in a store with
    /// a state budget, those it does not hold are recomputed by `model` (and, as the writer,
    /// counted and perhaps admitted). What a query reads, for callers that compose themselves.
    pub fn states_for(&self, model: &Model, ids: &[i64], cache: Option<&StateCache>) -> Result<Loaded> {
        self.require_model(model)?;
        let mut loaded = map_states(self, model, ids, cache)?;
        if let Some(deferred) = loaded.deferred.take() {
            deferred.finish(self)?;
        }
        Ok(loaded)
    }
}

/// The states of `ids`, in order, and how they were found: cached states first, the misses
/// mapped together (their reads overlap) and added to the cache. In a store with a state
/// budget, those it does not hold are recomputed by `model` ([`crate::budget`]).
pub(crate) fn map_states(store: &Store, model: &Model, ids: &[i64], cache: Option<&StateCache>) -> Result<Loaded> {
    if store.budget()?.is_some() {
        let records = store.catalog().get_many(ids)?;
        return store.load_within_budget(model, &records, cache);
    }
    let mut states: Vec<Option<Arc<MappedState>>> = ids.iter().map(|&id| cache.and_then(|c| c.get(id))).collect();
    let cache_hits = states.iter().filter(|s| s.is_some()).count();
    if cache_hits > 0 {
        // A cached state outlives its row if another server deleted the context.
        let cached: Vec<i64> = ids.iter().zip(&states).filter(|(_, s)| s.is_some()).map(|(&id, _)| id).collect();
        store.require(&cached)?;
    }
    let missing: Vec<i64> = ids.iter().zip(&states).filter(|(_, s)| s.is_none()).map(|(&id, _)| id).collect();
    let mut loaded = store.map_states(&missing)?.into_iter().map(Arc::new);
    let mut bytes_read = 0;
    for (slot, &id) in states.iter_mut().zip(ids) {
        if slot.is_none() {
            let state = loaded.next().expect("one mapped state per missing id");
            bytes_read += state.nbytes() as u64;
            if let Some(c) = cache {
                c.insert(id, state.clone());
            }
            *slot = Some(state);
        }
    }
    let states = states.into_iter().map(|s| s.expect("filled above")).collect();
    Ok(Loaded { states, cache_hits, bytes_read, ..Loaded::default() })
}
