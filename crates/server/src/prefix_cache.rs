//! The prefix cache: the state after every prompt the server has prefilled (and after a chat's
//! first message, a system prompt others share), so a request that repeats a stored prefix
//! (the conversation so far, a shared system prompt) continues from that state and prefills
//! only the rest.
//!
//! An SSM's state is a few megabytes whatever the prefix's length (a hybrid's also holds its
//! attention layers' keys and values, which grow with it), so many prefixes fit in memory.
//!
//! * Key: where the prefix starts from (the model's fingerprint, and for a request with
//!   contexts the composition method and the context ids, in order: an [`Origin`]) and the
//!   prefix's tokens. A 128-bit hash, chained token by token and seeded per process, finds the
//!   entry; the entry's full origin and tokens are compared before it is used, so a collision
//!   (crafted or not) is a miss, never another request's state.
//! * Exact: a state continues as the uncut prompt would (the Markov property the model crate
//!   tests), so the answer is the cold run's to float rounding.
//! * Bounded: entries are counted by their bytes (state with keys and values, tokens, logits)
//!   against a budget and evicted least recently used first. Entries are shared (`Arc`): a
//!   request copies the state out, so eviction never frees one being read.
//!
//! Why LRU rather than Marconi's FLOP-aware score: on a pure SSM every entry costs the same
//! bytes, so "FLOPs saved per byte" only favours longer prefixes, which are the most
//! conversation-specific and least shared; the traffic this serves (a conversation's next
//! turn, agents re-sending one system prompt) is recency-driven, and a shared prefix is touched
//! by every request that uses it. Admission is already selective as Marconi's is: only prompt
//! ends and a chat's first message are stored, never every block.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use lru::LruCache;
use picaso_model::State;
use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// What a prefix's state starts from before its first token: the zero state of a model, or a
/// composition of contexts. Two prompts share a state only when their origins are equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The model's fingerprint.
    fingerprint: String,
    /// The composition method (empty without contexts: the zero state).
    method: String,
    /// The contexts composed, in order.
    contexts: Vec<i64>,
}

impl Origin {
    /// The origin of a prompt continuing `method`'s composition of `contexts` (none: the zero
    /// state, whatever the method) on the model with `fingerprint`.
    pub fn new(fingerprint: &str, method: &str, contexts: &[i64]) -> Self {
        let method = if contexts.is_empty() { String::new() } else { method.to_string() };
        Self { fingerprint: fingerprint.to_string(), method, contexts: contexts.to_vec() }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.fingerprint.len() + self.method.len() + 8 * self.contexts.len() + 2);
        b.extend_from_slice(self.fingerprint.as_bytes());
        b.push(0);
        b.extend_from_slice(self.method.as_bytes());
        b.push(0);
        self.contexts.iter().for_each(|id| b.extend_from_slice(&id.to_le_bytes()));
        b
    }
}

/// The metrics the cache keeps (registered by [`crate::metrics::Metrics`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct PrefixMetrics {
    /// Lookups that found a stored prefix.
    pub hits: Counter,
    /// Lookups that found none.
    pub misses: Counter,
    /// Prompt tokens not prefilled thanks to a hit.
    pub tokens_saved: Counter,
    /// States stored.
    pub stored: Counter,
    /// States evicted to stay within the budget.
    pub evictions: Counter,
    /// Bytes held.
    pub bytes: Gauge,
    /// States held.
    pub entries: Gauge,
}

/// A stored prefix.
struct Entry {
    origin: Origin,
    tokens: Vec<u32>,
    state: State,
    /// Next-token logits after the prefix, when it was a whole prompt: a request for exactly
    /// this prompt then needs no forward pass before sampling.
    logits: Option<Vec<f32>>,
    bytes: usize,
}

/// What a lookup found: `len` prompt tokens are in `state` (a copy, the caller's to advance).
pub(crate) struct Hit {
    pub len: usize,
    pub state: State,
    /// The next-token logits when `len` is the whole prompt.
    pub logits: Option<Vec<f32>>,
}

struct Inner {
    entries: LruCache<u128, Arc<Entry>>,
    /// How many entries have each length: a lookup tries these lengths, longest first.
    lengths: BTreeMap<usize, usize>,
    bytes: usize,
    /// Bumped whenever contexts are removed: a state composed before that is not stored after.
    epoch: u64,
}

/// The cache. Disabled (every lookup misses, nothing is stored) with a budget of 0.
pub(crate) struct PrefixCache {
    budget: usize,
    seed: u64,
    inner: Mutex<Inner>,
    metrics: PrefixMetrics,
}

/// Bytes an entry costs beyond its tensors (map slots, the entry itself).
const ENTRY_OVERHEAD: usize = 256;

impl PrefixCache {
    /// A cache of at most `budget` bytes.
    pub(crate) fn new(budget: usize, metrics: PrefixMetrics) -> Self {
        // Seeded per process, so prompts cannot be crafted offline to collide (a collision
        // would only be a miss: entries are compared in full).
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
                ^ (std::process::id() as u64).rotate_left(40);
        let inner = Inner { entries: LruCache::unbounded(), lengths: BTreeMap::new(), bytes: 0, epoch: 0 };
        Self { budget, seed, inner: Mutex::new(inner), metrics }
    }

    /// Whether the cache stores anything.
    pub(crate) fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Bytes held.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// The budget in bytes.
    #[cfg(test)]
    fn budget(&self) -> usize {
        self.budget
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current epoch, to pass to [`PrefixCache::insert`]: read it before composing contexts.
    pub(crate) fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// The key of every prefix of `tokens` (`keys[n]` is the first `n` tokens'), chained so all
    /// of them cost one pass.
    fn keys(&self, origin: &Origin, tokens: &[u32]) -> Vec<u128> {
        let mut keys = Vec::with_capacity(tokens.len() + 1);
        let mut h = xxh3_128_with_seed(&origin.bytes(), self.seed);
        keys.push(h);
        let mut buf = [0u8; 20];
        for t in tokens {
            buf[..16].copy_from_slice(&h.to_le_bytes());
            buf[16..].copy_from_slice(&t.to_le_bytes());
            h = xxh3_128_with_seed(&buf, self.seed);
            keys.push(h);
        }
        keys
    }

    /// The longest stored prefix of `tokens` from `origin` longer than `longer_than` tokens,
    /// as a copy of its state. A prefix
    /// of all of `tokens` counts only if its logits were stored (the batch must have the
    /// next-token logits to sample from). Counts nothing: [`PrefixCache::record`] counts a
    /// prompt's outcome once it is known (a request that waited for another's prefix may hit
    /// after a first miss).
    pub(crate) fn lookup(&self, origin: &Origin, tokens: &[u32], longer_than: usize) -> Option<Hit> {
        if !self.enabled() || tokens.is_empty() {
            return None;
        }
        let keys = self.keys(origin, tokens);
        let found = {
            let mut inner = self.lock();
            let mut found = None;
            let lengths: Vec<usize> =
                inner.lengths.range(longer_than + 1..=tokens.len()).rev().map(|(&n, _)| n).collect();
            for n in lengths {
                let Some(e) = inner.entries.peek(&keys[n]) else { continue };
                let usable = e.tokens.len() == n
                    && e.origin == *origin
                    && e.tokens[..] == tokens[..n]
                    && (n < tokens.len() || e.logits.is_some());
                if usable {
                    let e = e.clone();
                    inner.entries.promote(&keys[n]);
                    found = Some(e);
                    break;
                }
            }
            found
        };
        // Copied outside the lock; the Arc keeps the entry alive if it is evicted meanwhile.
        let e = found?;
        let logits = if e.tokens.len() == tokens.len() { e.logits.clone() } else { None };
        Some(Hit { len: e.tokens.len(), state: e.state.clone(), logits })
    }

    /// Counts a prompt that went in with `cached` tokens from the cache: a hit when any.
    pub(crate) fn record(&self, cached: usize) {
        if cached > 0 {
            self.metrics.hits.inc();
            self.metrics.tokens_saved.inc_by(cached as u64);
        } else {
            self.metrics.misses.inc();
        }
    }

    /// Stores `state`, the state after `tokens` from `origin` (with the next-token logits, if
    /// `tokens` is a whole prompt), then evicts least recently used entries down to the budget.
    /// Skipped when the entry alone is over the budget, or when its origin has contexts and
    /// some were removed since `epoch` (its composition may hold a context that is gone).
    pub(crate) fn insert(&self, origin: &Origin, tokens: &[u32], state: State, logits: Option<Vec<f32>>, epoch: u64) {
        if !self.enabled() || tokens.is_empty() {
            return;
        }
        let bytes = state.nbytes_f32()
            + 4 * (tokens.len() + logits.as_ref().map_or(0, Vec::len))
            + origin.bytes().len()
            + ENTRY_OVERHEAD;
        if bytes > self.budget {
            return;
        }
        let key = *self.keys(origin, tokens).last().expect("one key per prefix");
        let entry = Arc::new(Entry { origin: origin.clone(), tokens: tokens.to_vec(), state, logits, bytes });
        let mut evicted = Vec::new();
        {
            let mut inner = self.lock();
            if !origin.contexts.is_empty() && epoch != inner.epoch {
                return;
            }
            if let Some(old) = inner.entries.peek(&key) {
                // The same prefix stored again (two requests raced): keep one, with logits if
                // either has them.
                if old.origin == *origin
                    && old.tokens[..] == tokens[..]
                    && (old.logits.is_some() || entry.logits.is_none())
                {
                    inner.entries.promote(&key);
                    return;
                }
            }
            if let Some(old) = inner.entries.pop(&key) {
                inner.forget(&old);
                evicted.push(old);
            }
            inner.bytes += entry.bytes;
            *inner.lengths.entry(entry.tokens.len()).or_default() += 1;
            inner.entries.put(key, entry);
            self.metrics.stored.inc();
            while inner.bytes > self.budget {
                let Some((_, old)) = inner.entries.pop_lru() else { break };
                inner.forget(&old);
                self.metrics.evictions.inc();
                evicted.push(old);
            }
            self.metrics.bytes.set(inner.bytes as i64);
            self.metrics.entries.set(inner.entries.len() as i64);
        }
        // Freed outside the lock (a hybrid's long prefix is tens of megabytes).
        drop(evicted);
    }

    /// Drops every entry composed from any of `ids` (contexts removed or replaced: their ids
    /// may come back with other text), and bumps the epoch so a composition made before now is
    /// not stored after.
    pub(crate) fn forget_contexts(&self, ids: &[i64]) {
        let mut removed = Vec::new();
        {
            let mut inner = self.lock();
            inner.epoch += 1;
            let gone: Vec<u128> = (inner.entries.iter())
                .filter(|(_, e)| e.origin.contexts.iter().any(|c| ids.contains(c)))
                .map(|(k, _)| *k)
                .collect();
            for k in gone {
                if let Some(e) = inner.entries.pop(&k) {
                    inner.forget(&e);
                    removed.push(e);
                }
            }
            self.metrics.bytes.set(inner.bytes as i64);
            self.metrics.entries.set(inner.entries.len() as i64);
        }
        drop(removed);
    }
}

impl Inner {
    /// Accounts for an entry that left the map.
    fn forget(&mut self, e: &Entry) {
        self.bytes -= e.bytes;
        let n = e.tokens.len();
        if let Some(c) = self.lengths.get_mut(&n) {
            *c -= 1;
            if *c == 0 {
                self.lengths.remove(&n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picaso_model::StateShape;

    fn shape() -> StateShape {
        StateShape {
            arch: picaso_model::Arch::Mamba2,
            n_layer: 1,
            ssm: vec![2, 4, 4],
            conv: vec![16, 3],
            log_decay: vec![2],
            attention: None,
        }
    }

    /// A state that says which prefix made it (its token count and first SSM value).
    fn state(tag: f32, n: usize) -> State {
        let mut s = State::zeros(shape(), "fp");
        s.layers[0].ssm[0] = tag;
        s.n_tokens = n as u64;
        s
    }

    fn cache(budget: usize) -> PrefixCache {
        PrefixCache::new(budget, PrefixMetrics::default())
    }

    #[test]
    fn the_longest_stored_prefix_is_found_and_only_an_exact_one() {
        let c = cache(1 << 20);
        let o = Origin::new("fp", "picaso-r", &[]);
        c.insert(&o, &[1, 2], state(2.0, 2), None, 0);
        c.insert(&o, &[1, 2, 3, 4], state(4.0, 4), Some(vec![0.5; 16]), 0);
        let hit = c.lookup(&o, &[1, 2, 3, 4, 5], 0).unwrap();
        assert_eq!((hit.len, hit.state.layers[0].ssm[0], hit.logits.is_some()), (4, 4.0, false));
        // Another token in the middle: only the shorter prefix matches.
        let hit = c.lookup(&o, &[1, 2, 9, 4, 5], 0).unwrap();
        assert_eq!((hit.len, hit.state.layers[0].ssm[0]), (2, 2.0));
        // The whole prompt stored with its logits: a hit of all of it.
        let hit = c.lookup(&o, &[1, 2, 3, 4], 0).unwrap();
        assert_eq!((hit.len, hit.logits.as_deref()), (4, Some(&[0.5; 16][..])));
        // The whole prompt stored without logits: the next shorter prefix.
        assert_eq!(c.lookup(&o, &[1, 2], 0).map(|h| h.len), None);
        assert!(c.lookup(&o, &[7, 1, 2], 0).is_none());
        // Only prefixes longer than asked: none past 4 tokens, the 4-token one past 2.
        assert!(c.lookup(&o, &[1, 2, 3, 4, 5], 4).is_none());
        assert_eq!(c.lookup(&o, &[1, 2, 3, 4, 5], 2).map(|h| h.len), Some(4));
        c.record(4);
        c.record(0);
        assert_eq!((c.metrics.hits.get(), c.metrics.misses.get(), c.metrics.tokens_saved.get()), (1, 1, 4));
    }

    #[test]
    fn origins_never_share_states() {
        let c = cache(1 << 20);
        let zero = Origin::new("fp", "picaso-r", &[]);
        c.insert(&zero, &[1, 2, 3], state(1.0, 3), None, 0);
        // Without contexts the method does not matter: the zero state either way.
        assert!(c.lookup(&Origin::new("fp", "concat", &[]), &[1, 2, 3, 4], 0).is_some());
        for other in [
            Origin::new("fp2", "picaso-r", &[]),
            Origin::new("fp", "picaso-r", &[5]),
            Origin::new("fp", "soup", &[5]),
            Origin::new("fp", "picaso-r", &[5, 6]),
        ] {
            assert!(c.lookup(&other, &[1, 2, 3, 4], 0).is_none(), "{other:?}");
        }
        let composed = Origin::new("fp", "picaso-r", &[5, 6]);
        c.insert(&composed, &[1, 2, 3], state(7.0, 3), None, 0);
        assert_eq!(c.lookup(&composed, &[1, 2, 3, 4], 0).unwrap().state.layers[0].ssm[0], 7.0);
        assert!(c.lookup(&Origin::new("fp", "picaso-r", &[6, 5]), &[1, 2, 3, 4], 0).is_none(), "order matters");
    }

    /// A colliding key (forced here by writing an entry under another prefix's key) is a miss.
    #[test]
    fn a_hash_collision_is_a_miss_not_another_prompts_state() {
        let c = cache(1 << 20);
        let o = Origin::new("fp", "", &[]);
        c.insert(&o, &[1, 2, 3], state(1.0, 3), None, 0);
        let victim_key = *c.keys(&o, &[4, 5, 6]).last().unwrap();
        {
            let mut inner = c.lock();
            let (_, e) = inner.entries.pop_lru().unwrap();
            inner.entries.put(victim_key, e);
        }
        assert!(c.lookup(&o, &[4, 5, 6, 7], 0).is_none());
    }

    #[test]
    fn the_budget_holds_and_the_least_recently_used_go_first() {
        let one = state(0.0, 1).nbytes_f32() + 4 * 3 + Origin::new("fp", "", &[]).bytes().len() + ENTRY_OVERHEAD;
        let c = cache(3 * one);
        let o = Origin::new("fp", "", &[]);
        for t in 0..3u32 {
            c.insert(&o, &[t, t, t], state(t as f32, 3), None, 0);
        }
        assert_eq!(c.bytes(), 3 * one);
        // Touch the oldest, then add a fourth: the second oldest goes.
        assert!(c.lookup(&o, &[0, 0, 0, 9], 0).is_some());
        c.insert(&o, &[3, 3, 3], state(3.0, 3), None, 0);
        assert!(c.bytes() <= c.budget());
        assert!(c.lookup(&o, &[1, 1, 1, 9], 0).is_none());
        for t in [0, 2, 3] {
            assert!(c.lookup(&o, &[t, t, t, 9], 0).is_some(), "{t}");
        }
        assert_eq!((c.metrics.evictions.get(), c.metrics.entries.get()), (1, 3));
        // An entry larger than the whole budget is not stored (and evicts nothing).
        let big = cache(one - 1);
        big.insert(&o, &[1, 2, 3], state(1.0, 3), None, 0);
        assert_eq!(big.bytes(), 0);
        // A zero budget disables the cache.
        let off = cache(0);
        off.insert(&o, &[1], state(1.0, 1), None, 0);
        assert!(!off.enabled() && off.lookup(&o, &[1, 2], 0).is_none());
    }

    #[test]
    fn a_state_in_use_outlives_its_eviction() {
        let c = cache(1 << 20);
        let o = Origin::new("fp", "", &[]);
        c.insert(&o, &[1, 2], state(3.0, 2), None, 0);
        let held = c.lock().entries.peek(&c.keys(&o, &[1, 2])[2]).unwrap().clone();
        c.forget_contexts(&[]); // nothing with contexts: the entry stays
        assert_eq!(c.lock().entries.len(), 1);
        let mut inner = c.lock();
        let (_, e) = inner.entries.pop_lru().unwrap();
        inner.forget(&e);
        drop((inner, e));
        assert_eq!(held.state.layers[0].ssm[0], 3.0, "the reader's Arc keeps it");
    }

    #[test]
    fn removed_contexts_take_their_compositions_with_them() {
        let c = cache(1 << 20);
        let (a, b, zero) =
            (Origin::new("fp", "soup", &[1, 2]), Origin::new("fp", "soup", &[3]), Origin::new("fp", "", &[]));
        let epoch = c.epoch();
        for o in [&a, &b, &zero] {
            c.insert(o, &[5, 6], state(1.0, 2), None, epoch);
        }
        c.forget_contexts(&[2]);
        assert!(c.lookup(&a, &[5, 6, 7], 0).is_none());
        assert!(c.lookup(&b, &[5, 6, 7], 0).is_some() && c.lookup(&zero, &[5, 6, 7], 0).is_some());
        // A composition read before the removal is not stored after it (it may hold context 2).
        c.insert(&a, &[5, 6], state(1.0, 2), None, epoch);
        assert!(c.lookup(&a, &[5, 6, 7], 0).is_none());
        c.insert(&a, &[5, 6], state(1.0, 2), None, c.epoch());
        assert!(c.lookup(&a, &[5, 6, 7], 0).is_some());
    }
}
