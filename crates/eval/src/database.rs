//! The WikiText experiments' database: a store of (query, continuation) halves, and the
//! contexts' tokens and states, read from the store or recomputed with the model under test.

use std::collections::HashMap;

use picaso_model::{Model, State};
use picaso_store::Store;

use crate::methods::Context;
use crate::{Error, Result};

/// Refuses a store whose states were made by another model, unless they are recomputed.
pub fn check_model(store: &Store, model: &Model, restate: bool) -> Result<()> {
    if store.info().fingerprint != model.fingerprint() && !restate {
        return Err(Error::Input(format!(
            "{}: the store holds states of model {}, not of the given model {}; ingest with this model, or pass --restate to recompute the states from the stored tokens",
            store.location(),
            store.info().fingerprint,
            model.fingerprint()
        )));
    }
    Ok(())
}

/// Contexts loaded so far, reused across passages (retrieval returns the same ones often).
pub struct Contexts<'s> {
    store: &'s Store,
    restate: bool,
    loaded: HashMap<i64, (Vec<u32>, State)>,
}

impl<'s> Contexts<'s> {
    /// Reads from `store`; with `restate`, states are recomputed by the model from the stored
    /// tokens (to evaluate another model, e.g. a fine-tuned one, on a store ingested once).
    pub fn new(store: &'s Store, restate: bool) -> Self {
        Self { store, restate, loaded: HashMap::new() }
    }

    /// Makes sure `ids` are loaded (dropping everything first if the cache grew past `cap`).
    pub fn load(&mut self, model: &Model, ids: &[i64], cap: usize) -> Result<()> {
        if self.loaded.len() + ids.len() > cap {
            self.loaded.clear();
        }
        let mut missing: Vec<i64> = ids.iter().copied().filter(|id| !self.loaded.contains_key(id)).collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        let records = (self.store.records(&missing)?.into_iter().zip(&missing))
            .map(|(r, &id)| r.ok_or(picaso_store::Error::NotFound(id)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let states: Vec<State> = if self.restate {
            let mut states = Vec::with_capacity(missing.len());
            for r in &records {
                states.push(model.prefill(&r.tokens, &model.zero_state())?);
            }
            states
        } else {
            // Through the store's budget, if it has one: states it does not hold are recomputed.
            let loaded = self.store.states_for(model, &missing, None)?;
            let mut states = Vec::with_capacity(missing.len());
            for s in &loaded.states {
                let state = s.view().to_state();
                state.check_values()?;
                states.push(state);
            }
            states
        };
        for ((id, record), state) in missing.iter().zip(records).zip(states) {
            self.loaded.insert(*id, (record.tokens, state));
        }
        Ok(())
    }

    /// The loaded contexts `ids`, in order (call [`Contexts::load`] first).
    pub fn get(&self, ids: &[i64]) -> Vec<Context<'_>> {
        ids.iter()
            .map(|id| {
                let (tokens, state) = &self.loaded[id];
                Context { tokens, state }
            })
            .collect()
    }
}

/// How many contexts of `model` fit the experiments' 4 GiB cache (20 MiB-states of large
/// models: ~200; the bundled model's 0.5 MiB: ~8000).
pub fn cache_cap(model: &Model) -> usize {
    let bytes = model.zero_state().nbytes_f32().max(1);
    ((4usize << 30) / bytes).max(64)
}
