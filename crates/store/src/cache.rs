//! An LRU cache of mapped context states with a byte budget, so that hot contexts skip opening,
//! checksumming and parsing their files, and their pages stay in memory. Shared between threads; a load runs outside the lock, so misses on
//! different contexts proceed in parallel.

use std::sync::{Arc, Mutex};

use lru::LruCache;
use picaso_model::MappedState;

use crate::error::Result;

/// Counters of a cache, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Lookups served from memory.
    pub hits: u64,
    /// Lookups that loaded the state from the store.
    pub misses: u64,
    /// States currently held.
    pub entries: usize,
    /// Their bytes.
    pub bytes: usize,
    /// The budget.
    pub budget: usize,
}

struct Inner {
    lru: LruCache<i64, Arc<MappedState>>,
    bytes: usize,
    hits: u64,
    misses: u64,
}

/// LRU cache of states keyed by context id, holding at most `budget` bytes of (f32) state.
pub struct StateCache {
    budget: usize,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for StateCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCache").field("stats", &self.stats()).finish()
    }
}

impl StateCache {
    /// A cache holding up to `budget` bytes (0 disables caching).
    pub fn new(budget: usize) -> Self {
        let inner = Inner { lru: LruCache::unbounded(), bytes: 0, hits: 0, misses: 0 };
        Self { budget, inner: Mutex::new(inner) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state of context `id` if cached (counted as a hit or a miss).
    pub fn get(&self, id: i64) -> Option<Arc<MappedState>> {
        let mut inner = self.lock();
        let found = inner.lru.get(&id).cloned();
        match found {
            Some(_) => inner.hits += 1,
            None => inner.misses += 1,
        }
        found
    }

    /// Caches `state` for context `id` if it fits the budget, evicting the least recently used.
    pub fn insert(&self, id: i64, state: Arc<MappedState>) {
        let size = state.nbytes();
        if size > self.budget {
            return;
        }
        let mut inner = self.lock();
        if let Some(old) = inner.lru.put(id, state) {
            inner.bytes -= old.nbytes();
        }
        inner.bytes += size;
        while inner.bytes > self.budget {
            match inner.lru.pop_lru() {
                Some((_, evicted)) => inner.bytes -= evicted.nbytes(),
                None => break,
            }
        }
    }

    /// The state of context `id`: from memory if present, else from `load` (then cached if it
    /// fits the budget). The flag says whether it was a hit. The load runs outside the lock.
    pub fn get_or_load(&self, id: i64, load: impl FnOnce() -> Result<MappedState>) -> Result<(Arc<MappedState>, bool)> {
        if let Some(s) = self.get(id) {
            return Ok((s, true));
        }
        let state = Arc::new(load()?);
        self.insert(id, state.clone());
        Ok((state, false))
    }

    /// Forgets context `id` (after a delete).
    pub fn remove(&self, id: i64) {
        let mut inner = self.lock();
        if let Some(old) = inner.lru.pop(&id) {
            inner.bytes -= old.nbytes();
        }
    }

    /// Current counters.
    pub fn stats(&self) -> CacheStats {
        let inner = self.lock();
        CacheStats {
            hits: inner.hits,
            misses: inner.misses,
            entries: inner.lru.len(),
            bytes: inner.bytes,
            budget: self.budget,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picaso_model::{Mamba2Config, State, StateDtype, StateShape};

    /// Writes a state whose ssm is filled with `fill` and maps it.
    fn mapped(dir: &std::path::Path, fill: f32) -> MappedState {
        let mut s = State::zeros(StateShape::of(&Mamba2Config::tiny(1, 4)), "m");
        s.layers[0].ssm.iter_mut().for_each(|x| *x = fill);
        let path = dir.join(format!("{fill}.safetensors"));
        s.save(&path, StateDtype::F32).unwrap();
        MappedState::open(&path).unwrap()
    }

    #[test]
    fn evicts_least_recently_used_within_the_budget() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let size = mapped(dir, 0.0).nbytes();
        let cache = StateCache::new(2 * size);
        let load = |v: f32| move || Ok(mapped(dir, v));
        assert!(!cache.get_or_load(1, load(1.0)).unwrap().1);
        assert!(!cache.get_or_load(2, load(2.0)).unwrap().1);
        assert!(cache.get_or_load(1, load(9.0)).unwrap().1, "1 is cached");
        cache.get_or_load(3, load(3.0)).unwrap(); // evicts 2, the least recently used
        let (s1, hit1) = cache.get_or_load(1, load(9.0)).unwrap();
        assert!(hit1 && s1.view().layers[0].ssm.to_vec()[0] == 1.0, "a hit returns the cached state, not a reload");
        assert!(!cache.get_or_load(2, load(2.0)).unwrap().1, "2 was evicted");
        let st = cache.stats();
        assert!(st.bytes <= st.budget && st.entries == 2, "{st:?}");
        assert_eq!((st.hits, st.misses), (2, 4));
    }

    #[test]
    fn zero_budget_caches_nothing_and_remove_forgets() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = StateCache::new(0);
        cache.get_or_load(1, || Ok(mapped(tmp.path(), 1.0))).unwrap();
        assert!(!cache.get_or_load(1, || Ok(mapped(tmp.path(), 1.0))).unwrap().1);
        let cache = StateCache::new(1 << 30);
        cache.get_or_load(1, || Ok(mapped(tmp.path(), 1.0))).unwrap();
        cache.remove(1);
        assert_eq!(cache.stats().bytes, 0);
        assert!(!cache.get_or_load(1, || Ok(mapped(tmp.path(), 1.0))).unwrap().1);
    }

    #[test]
    fn failed_loads_are_not_cached() {
        let cache = StateCache::new(1 << 30);
        assert!(cache.get_or_load(1, || Err(crate::Error::NotFound(1))).is_err());
        assert_eq!(cache.stats().entries, 0);
    }
}
