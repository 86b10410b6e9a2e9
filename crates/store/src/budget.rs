//! A state budget: a store that keeps at most N bytes of state objects, recomputes the others
//! from their stored tokens when a query needs them, and decides which to keep. Every context
//! stays in the store (text, tokens, embedding, metadata); only its state object may be absent.
//!
//! # The policy
//! Each state object has a row in the store's ledger: its bytes `b`, the prefill work `w` its
//! state saves (floating-point operations, [`Model::prefill_flops`] of its tokens), how often
//! contexts with it were retrieved (`f`), and a priority; the lowest held priority goes first.
//! The default policy, `work`, is GreedyDual-Size-Frequency (Cherkasova, 1998) with prefill work
//! as the cost, the weighing Marconi (MLSys 2025) gives hybrid prefix states (work saved per
//! byte):
//!
//! ```text
//! priority = L + (f + 0.1) · w / b
//! ```
//!
//! `L`, the store's clock, rises to the priority of each state evicted, so a state retrieved
//! often long ago ages out: a new one needs only to beat the clock plus its own density. A
//! state is admitted when it fits in what is free plus what held states of lower priority free;
//! otherwise it serves its query and is dropped. `lru` (for comparison) has priority = the tick
//! of the last retrieval and admits every recomputed state.
//!
//! # Invariants
//! - The bytes of state objects on disk never exceed the budget: objects are evicted (ledger
//!   row marked not held and committed, then the object removed) before new ones are written.
//! - No held row lacks its object: a new object is marked held only after it is written. A kill
//!   in between leaves an object that is not held (within the budget, since room was made
//!   first), which `check` reports and `--repair` removes.
//! - A recomputed state is the stored one bit for bit: its checksum must be the row's. One
//!   that differs (a model run another way than at ingest: other weights' precision, another
//!   engine) answers its query but is never stored.
//! - The ledger and the counters are in the catalog: they survive a restart.
//! - Only the store's writer (the process holding its writer lock) admits, evicts and counts;
//!   another process reading the store recomputes what it needs and changes nothing.

use std::str::FromStr;
use std::sync::Arc;

use picaso_model::{MappedState, Model};
use rayon::prelude::*;

use crate::cache::StateCache;
use crate::catalog::LedgerRow;
use crate::error::{Error, Result};
use crate::records::ContextRecord;
use crate::states::{checksum, checksum_of, key_of};
pub use crate::store::BudgetStats;
use crate::store::Store;

const BUDGET: &str = "state_budget_bytes";
const POLICY: &str = "state_budget_policy";
const CLOCK: &str = "budget_clock";
const TICK: &str = "budget_tick";
const HITS: &str = "budget_hits";
const MISSES: &str = "budget_misses";
/// Tokens per shared forward pass when recomputing (as ingest: the same passes, the same bits).
const PREFILL_TOKENS: usize = 4096;
/// The retrievals a state never retrieved counts as: enough to rank states by work per byte
/// when nothing has been retrieved yet (at ingest), too little to outrank one retrieval.
const PRIOR: f64 = 0.1;
/// Held rows read per admission, lowest priority first: more than any batch evicts.
const VICTIMS: usize = 4096;

/// Which states a budgeted store keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Prefill work saved per byte, times retrievals, plus an aging clock (GreedyDual-Size-
    /// Frequency with work as the cost).
    #[default]
    Work,
    /// Least recently retrieved goes first; every recomputed state is kept.
    Lru,
}

impl Policy {
    /// Its name, as `--state-budget-policy` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Work => "work",
            Policy::Lru => "lru",
        }
    }

    /// The priority of `row` when the store's clock is `clock`.
    pub fn priority(self, clock: f64, row: &LedgerRow) -> f64 {
        match self {
            Policy::Work => clock + (row.retrievals as f64 + PRIOR) * row.work / row.bytes.max(1) as f64,
            Policy::Lru => row.last_tick as f64,
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "work" => Ok(Policy::Work),
            "lru" => Ok(Policy::Lru),
            other => Err(format!("unknown state budget policy {other:?}; give work (the default) or lru")),
        }
    }
}

/// A store's budget: at most `bytes` of state objects, kept by `policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Bytes of state objects at most.
    pub bytes: u64,
    /// Which to keep.
    pub policy: Policy,
}

impl Budget {
    /// The budget a user gives in MiB (fractions allowed): `None` for 0, which removes a budget.
    /// Refuses a size that is negative or not a number, saying so after `mib`.
    pub fn from_mib(mib: f64, policy: Policy) -> std::result::Result<Option<Self>, String> {
        if !(mib.is_finite() && mib >= 0.0) {
            return Err(format!("{mib}: give a size in MiB (0 removes the budget)"));
        }
        Ok((mib > 0.0).then_some(Budget { bytes: (mib * 1048576.0) as u64, policy }))
    }
}

/// The states of a query's contexts and how they were found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// What the store's writer has left to do for this query once it is answered (count the
    /// retrievals, admit recomputed states): run [`Deferred::finish`].
    pub deferred: Option<Deferred>,
    /// In the order asked.
    pub states: Vec<Arc<MappedState>>,
    /// From the in-memory cache.
    pub cache_hits: usize,
    /// Recomputed from their tokens.
    pub recomputed: usize,
    /// Their tokens.
    pub recomputed_tokens: usize,
    /// Bytes of state objects read from the store.
    pub bytes_read: u64,
}

/// A query's bookkeeping, left for after its answer: the retrievals to count and the states
/// recomputed for it, which the policy may keep. Holds the store's writer lock until done.
#[derive(Debug)]
pub struct Deferred {
    /// The query's contexts, one per distinct state.
    retrieved: Vec<ContextRecord>,
    hits: u64,
    misses: u64,
    /// Recomputed states with the recorded bits: the record and the file's bytes.
    recomputed: Vec<(ContextRecord, Arc<Vec<u8>>)>,
    _writer: crate::store::WriteLock,
}

impl Deferred {
    /// Counts the retrievals (each state once) and the hits and misses, then admits the
    /// recomputed states the policy keeps: one at a time per store, reading the ledger afresh,
    /// so that queries finishing together count every retrieval.
    pub fn finish(self, store: &Store) -> Result<()> {
        let _guard = store.budget_guard().write().unwrap_or_else(|p| p.into_inner());
        // The budget as it is now: it may have been changed or removed since the query read it.
        let Some(budget) = store.budget()? else { return Ok(()) };
        let mut counters = store.counters()?;
        counters.tick += 1;
        counters.hits += self.hits;
        counters.misses += self.misses;
        let sums: Vec<String> = self.retrieved.iter().map(|r| r.checksum.clone()).collect();
        // Only states still in the ledger: a context deleted since (its row gone with it) is
        // not brought back.
        let mut rows: Vec<LedgerRow> = store.catalog().ledger(&sums)?.into_iter().flatten().collect();
        for row in rows.iter_mut() {
            row.retrievals += 1;
            row.last_tick = counters.tick;
            row.priority = budget.policy.priority(counters.clock, row);
        }
        let meta = [
            (TICK, counters.tick.to_string()),
            (HITS, counters.hits.to_string()),
            (MISSES, counters.misses.to_string()),
        ];
        store.catalog().put_ledger(&rows, &meta)?;
        let candidates: Vec<(LedgerRow, Arc<Vec<u8>>)> = self
            .recomputed
            .into_iter()
            .filter_map(|(r, bytes)| {
                let row = rows.iter().find(|row| row.checksum == r.checksum)?;
                (!row.held).then(|| (row.clone(), bytes))
            })
            .collect();
        store.admit_guarded(budget, candidates, counters.clock)
    }
}

/// The budget's meta values, parsed.
struct Counters {
    clock: f64,
    tick: u64,
    hits: u64,
    misses: u64,
}

impl Store {
    /// The store's state budget, if it has one.
    pub fn budget(&self) -> Result<Option<Budget>> {
        let Some(bytes) = self.catalog().meta(BUDGET)?.filter(|v| v != "none") else { return Ok(None) };
        let bytes = bytes.parse().map_err(|_| self.bad_meta(BUDGET, &bytes))?;
        let policy = match self.catalog().meta(POLICY)? {
            Some(p) => p.parse().map_err(|e: String| self.bad_meta(POLICY, &e))?,
            None => Policy::Work,
        };
        Ok(Some(Budget { bytes, policy }))
    }

    fn bad_meta(&self, key: &str, value: &str) -> Error {
        Error::Store { location: self.location().to_string(), message: format!("metadata `{key}` is {value:?}") }
    }

    fn counters(&self) -> Result<Counters> {
        let get = |k: &str| -> Result<Option<String>> { self.catalog().meta(k) };
        let num = |k: &str| -> Result<u64> {
            Ok(get(k)?.map(|v| v.parse().map_err(|_| self.bad_meta(k, &v))).transpose()?.unwrap_or(0))
        };
        let clock = get(CLOCK)?.map(|v| v.parse().map_err(|_| self.bad_meta(CLOCK, &v))).transpose()?.unwrap_or(0.0);
        Ok(Counters { clock, tick: num(TICK)?, hits: num(HITS)?, misses: num(MISSES)? })
    }

    /// The budget's totals and counters; `None` without a budget.
    pub fn budget_stats(&self) -> Result<Option<BudgetStats>> {
        let Some(budget) = self.budget()? else { return Ok(None) };
        let (held_bytes, held, tracked) = self.catalog().ledger_totals()?;
        let c = self.counters()?;
        Ok(Some(BudgetStats {
            budget_bytes: budget.bytes,
            policy: budget.policy.name(),
            held_bytes,
            held,
            tracked,
            hits: c.hits,
            misses: c.misses,
        }))
    }

    /// The smallest budget worth having for `model`: one state file (of no tokens: a hybrid's
    /// grow with their keys and values) in the store's codec.
    pub fn smallest_budget(&self, model: &Model) -> Result<u64> {
        Ok(model.zero_state().to_bytes(self.info().state_dtype)?.len() as u64)
    }

    /// Sets the store's budget (or, with `None`, removes it), as the writer. A budget on a
    /// store that keeps every state enters its states in the ledger and evicts the lowest
    /// priorities until they fit; a smaller budget evicts likewise; removing it recomputes and
    /// stores every state not held. A budget under one state of `model` is refused.
    pub fn set_budget(&self, budget: Option<Budget>, model: &Model) -> Result<()> {
        self.require_model(model)?;
        let _writer = self.lock_writes()?;
        let _guard = self.budget_guard().write().unwrap_or_else(|p| p.into_inner());
        let Some(budget) = budget else { return self.drop_budget(model) };
        let smallest = self.smallest_budget(model)?;
        if budget.bytes < smallest {
            return Err(Error::Input(format!(
                "a state budget of {} holds not even one state of this model ({} in {}): give at least {} MiB, or no budget",
                show_bytes(budget.bytes),
                show_bytes(smallest),
                self.info().state_dtype.name(),
                smallest.div_ceil(1 << 20)
            )));
        }
        // Every stored state not in the ledger yet enters it, held.
        let counters = self.counters()?;
        let mut after = 0;
        loop {
            let page = self.export(after, 1000)?;
            let Some(last) = page.last() else { break };
            after = last.0.id;
            let sums: Vec<String> = page.iter().map(|(r, _)| r.checksum.clone()).collect();
            let known = self.catalog().ledger(&sums)?;
            let mut new: Vec<LedgerRow> = Vec::new();
            for ((record, _), row) in page.iter().zip(known) {
                if row.is_none() && !new.iter().any(|r| r.checksum == record.checksum) {
                    let at = (budget.policy, counters.clock, counters.tick);
                    new.push(new_row(&record.checksum, record.state_bytes, record.n_tokens, model, true, at));
                }
            }
            self.catalog().put_ledger(&new, &[])?;
        }
        self.catalog()
            .put_ledger(&[], &[(BUDGET, budget.bytes.to_string()), (POLICY, budget.policy.name().to_string())])?;
        // Then the lowest priorities go until the rest fit.
        let (mut held, _, _) = self.catalog().ledger_totals()?;
        while held > budget.bytes {
            let mut victims = Vec::new();
            for row in self.catalog().lowest_held(VICTIMS)? {
                if held <= budget.bytes {
                    break;
                }
                held -= row.bytes;
                victims.push(row);
            }
            if victims.is_empty() {
                break;
            }
            self.evict(&mut victims, counters.clock)?;
        }
        Ok(())
    }

    /// Removes the budget: every state not held is recomputed and stored.
    fn drop_budget(&self, model: &Model) -> Result<()> {
        let mut after = 0;
        loop {
            let page = self.export(after, 256)?;
            let Some(last) = page.last() else { break };
            after = last.0.id;
            let records: Vec<ContextRecord> = page.into_iter().map(|(r, _)| r).collect();
            let sums: Vec<String> = records.iter().map(|r| r.checksum.clone()).collect();
            let rows = self.catalog().ledger(&sums)?;
            let absent: Vec<&ContextRecord> = records
                .iter()
                .zip(&rows)
                .filter(|(_, row)| row.as_ref().is_some_and(|r| !r.held))
                .map(|(r, _)| r)
                .collect();
            let computed = recompute(model, &absent, self.info().state_dtype)?;
            let mut objects: Vec<(String, &[u8])> = Vec::new();
            for (record, file) in absent.iter().zip(&computed) {
                if !file.same {
                    return Err(self.not_the_stored_state(record));
                }
                objects.push((record.checksum.clone(), &file.bytes));
            }
            objects.par_iter().try_for_each(|(sum, bytes)| self.objects().put(&key_of(sum), bytes))?;
        }
        // Every state is stored again: the ledger starts afresh with the next budget.
        self.catalog().forget_ledger(None)?;
        let reset = |k: &'static str| (k, "0".to_string());
        self.catalog()
            .put_ledger(&[], &[(BUDGET, "none".to_string()), reset(CLOCK), reset(TICK), reset(HITS), reset(MISSES)])
    }

    fn not_the_stored_state(&self, record: &ContextRecord) -> Error {
        Error::Store {
            location: self.location().to_string(),
            message: format!(
                "context {} (document {:?}, segment {}): its state recomputed from its tokens is not the state stored \
                 (checksum {}): this model runs differently from the one that made the store (another weight \
                 precision or engine); recompute with the ingest's settings",
                record.id, record.doc, record.seg, record.checksum
            ),
        }
    }

    /// Removes the objects present that the ledger says are not held: what a writer killed
    /// mid-admission or mid-eviction left (its room would otherwise be counted free and the
    /// states on disk exceed the budget). Run by each new holder of the writer lock.
    pub(crate) fn sweep_unheld(&self) -> Result<()> {
        if self.budget()?.is_none() {
            return Ok(());
        }
        let _guard = self.budget_guard().write().unwrap_or_else(|p| p.into_inner());
        let sums: Vec<String> =
            self.objects().entries()?.iter().filter_map(|e| checksum_of(&e.key).map(str::to_string)).collect();
        let rows = self.catalog().ledger(&sums)?;
        let stale: Vec<String> = sums
            .iter()
            .zip(rows)
            .filter(|(_, r)| r.as_ref().is_some_and(|r| !r.held))
            .map(|(s, _)| key_of(s))
            .collect();
        self.objects().delete_many(&stale)
    }

    /// Marks `victims` not held (committed, the clock raised to their highest priority for the
    /// work policy), then removes their objects.
    fn evict(&self, victims: &mut [LedgerRow], clock: f64) -> Result<f64> {
        let clock = victims.iter().map(|v| v.priority).fold(clock, f64::max);
        for v in victims.iter_mut() {
            v.held = false;
        }
        self.catalog().put_ledger(victims, &[(CLOCK, clock.to_string())])?;
        failpoint("budget-evicted");
        let keys: Vec<String> = victims.iter().map(|v| key_of(&v.checksum)).collect();
        // A removal that fails stops the admission (its room is not free): the objects left,
        // not held, are reported by `check` and removed by `--repair`.
        self.objects().delete_many(&keys)?;
        Ok(clock)
    }

    /// The states of `records` (the contexts a query needs, in order) within the budget: cached
    /// ones from `cache`, held ones read, the rest recomputed in one batched prefill. As the
    /// writer, returns in [`Loaded::deferred`] what is left to do once the query is answered:
    /// count the retrievals and admit the recomputed states the policy keeps
    /// ([`Deferred::finish`]).
    pub(crate) fn load_within_budget(
        &self,
        model: &Model,
        records: &[ContextRecord],
        cache: Option<&StateCache>,
    ) -> Result<Loaded> {
        self.require_model(model)?;
        let writer = self.lock_writes().ok();
        let mut out = Loaded::default();
        let mut states: Vec<Option<Arc<MappedState>>> =
            records.iter().map(|r| cache.and_then(|c| c.get(r.id))).collect();
        out.cache_hits = states.iter().filter(|s| s.is_some()).count();
        let sums: Vec<String> = records.iter().map(|r| r.checksum.clone()).collect();
        let wanted: Vec<usize>;
        {
            // Read under the guard: no eviction removes a held object between the ledger's
            // answer and its mapping (a mapped file stays readable once removed).
            let _guard = self.budget_guard().read().unwrap_or_else(|p| p.into_inner());
            let ledger = self.catalog().ledger(&sums)?;
            let held: Vec<usize> = (0..records.len())
                .filter(|&i| states[i].is_none() && ledger[i].as_ref().is_some_and(|r| r.held))
                .collect();
            let ids: Vec<i64> = held.iter().map(|&i| records[i].id).collect();
            match self.map_states(&ids) {
                Ok(mapped) => {
                    for (&i, state) in held.iter().zip(mapped) {
                        out.bytes_read += records[i].state_bytes;
                        states[i] = Some(Arc::new(state));
                    }
                }
                // One evicted meanwhile by another process holding the store (this guard is
                // this process's): each is mapped alone, and what is gone is recomputed.
                Err(_) => {
                    for &i in &held {
                        if let Ok(state) = self.map_state(records[i].id) {
                            out.bytes_read += records[i].state_bytes;
                            states[i] = Some(Arc::new(state));
                        }
                    }
                }
            }
            wanted = (0..records.len()).filter(|&i| states[i].is_none()).collect();
        }
        let hits = records.len() - out.cache_hits - wanted.len();
        let mut recomputed = Vec::new();
        if !wanted.is_empty() {
            let need: Vec<&ContextRecord> = wanted.iter().map(|&i| &records[i]).collect();
            let computed = recompute(model, &need, self.info().state_dtype)?;
            out.recomputed = wanted.len();
            out.recomputed_tokens = need.iter().map(|r| r.n_tokens).sum();
            for (&i, file) in wanted.iter().zip(computed) {
                let bytes = Arc::new(file.bytes);
                states[i] = Some(Arc::new(MappedState::from_buffer(ArcBytes(bytes.clone()))?));
                if file.same && !recomputed.iter().any(|(r, _): &(ContextRecord, _)| r.checksum == records[i].checksum)
                {
                    recomputed.push((records[i].clone(), bytes));
                }
            }
        }
        for (slot, r) in states.iter().zip(records) {
            if let (Some(c), Some(s)) = (cache, slot) {
                c.insert(r.id, s.clone());
            }
        }
        if let Some(writer) = writer {
            let mut retrieved: Vec<ContextRecord> = Vec::new();
            for r in records {
                if !retrieved.iter().any(|u| u.checksum == r.checksum) {
                    retrieved.push(r.clone());
                }
            }
            out.deferred = Some(Deferred {
                retrieved,
                hits: hits as u64,
                misses: out.recomputed as u64,
                recomputed,
                _writer: writer,
            });
        }
        out.states = states.into_iter().map(|s| s.expect("every state found, read or recomputed")).collect();
        Ok(out)
    }

    /// Admits `candidates` (rows not held, with their objects' bytes): [`Store::plan_admission`],
    /// the victims evicted, the admitted objects written, then marked held. The caller holds
    /// the budget's guard for writing.
    fn admit_guarded(&self, budget: Budget, candidates: Vec<(LedgerRow, Arc<Vec<u8>>)>, clock: f64) -> Result<()> {
        if candidates.is_empty() {
            return Ok(());
        }
        let Plan { admitted, mut victims } = self.plan_admission(budget, candidates)?;
        if !victims.is_empty() {
            self.evict(&mut victims, clock)?;
        }
        admitted.par_iter().try_for_each(|(row, bytes)| self.objects().put(&key_of(&row.checksum), bytes))?;
        failpoint("budget-written");
        let rows: Vec<LedgerRow> = admitted.iter().map(|(r, _)| LedgerRow { held: true, ..r.clone() }).collect();
        self.catalog().put_ledger(&rows, &[])
    }

    /// Which of `candidates` to admit, highest priority first, and which held states to evict
    /// for them: a candidate is admitted when it fits in what is free plus what held states of
    /// lower priority (for LRU: any) free. Decides only; the caller evicts and writes, holding
    /// the budget's guard for writing.
    pub(crate) fn plan_admission<T>(&self, budget: Budget, mut candidates: Vec<(LedgerRow, T)>) -> Result<Plan<T>> {
        candidates.sort_by(|a, b| b.0.priority.total_cmp(&a.0.priority));
        let (mut held, _, _) = self.catalog().ledger_totals()?;
        let lowest = self.catalog().lowest_held(VICTIMS)?;
        let (mut next, mut victims, mut admitted) = (0, Vec::new(), Vec::new());
        for (row, payload) in candidates {
            let mut freed = 0;
            let mut take = next;
            while held + row.bytes > budget.bytes + freed
                && take < lowest.len()
                && (budget.policy == Policy::Lru || lowest[take].priority < row.priority)
            {
                freed += lowest[take].bytes;
                take += 1;
            }
            if held + row.bytes <= budget.bytes + freed {
                victims.extend_from_slice(&lowest[next..take]);
                next = take;
                held = held + row.bytes - freed;
                admitted.push((row, payload));
            }
        }
        Ok(Plan { admitted, victims })
    }

    /// Adds contexts to a budgeted store (see [`Store::insert`]): their states enter the
    /// ledger, and those the policy admits are written; the others are recomputed when needed.
    /// Victims are evicted and the new rows entered (not held) before any object is written;
    /// admitted ones are marked held once written.
    pub(crate) fn insert_within_budget(
        &self,
        budget: Budget,
        model: &Model,
        rows: &[crate::catalog::Row<'_>],
        objects: &[(String, Vec<u8>)],
    ) -> Result<Vec<Option<i64>>> {
        let _writer = self.lock_writes()?;
        let _guard = self.budget_guard().write().unwrap_or_else(|p| p.into_inner());
        let budget = self.budget()?.unwrap_or(budget); // as it is now, under the guard
        let counters = self.counters()?;
        let sums: Vec<String> = objects.iter().map(|(s, _)| s.clone()).collect();
        let known = self.catalog().ledger(&sums)?;
        let mut candidates: Vec<(LedgerRow, usize)> = Vec::new();
        for (i, (row, known)) in rows.iter().zip(known).enumerate() {
            if known.is_some() || candidates.iter().any(|(c, _)| c.checksum == row.checksum) {
                continue; // the state of a context stored already (the same text)
            }
            let at = (budget.policy, counters.clock, counters.tick);
            candidates.push((new_row(row.checksum, row.state_bytes, row.tokens.len(), model, false, at), i));
        }
        let entered: Vec<LedgerRow> = candidates.iter().map(|(r, _)| r.clone()).collect();
        let Plan { admitted, mut victims } = self.plan_admission(budget, candidates)?;
        if !victims.is_empty() {
            self.evict(&mut victims, counters.clock)?;
        }
        self.catalog().put_ledger(&entered, &[])?;
        let write = |(_, i): &(LedgerRow, usize)| self.objects().put(&key_of(&objects[*i].0), &objects[*i].1);
        let ids = self.catalog().insert(rows, &mut || admitted.par_iter().try_for_each(write))?;
        failpoint("budget-written");
        // Held only if its context went in: a (doc, seg) another writer stored meanwhile
        // leaves an object no context names, removed at once (or by `check --repair`).
        let named: std::collections::HashSet<&str> =
            rows.iter().zip(&ids).filter(|(_, id)| id.is_some()).map(|(r, _)| r.checksum).collect();
        let (inserted, skipped): (Vec<_>, Vec<_>) =
            admitted.iter().partition(|(r, _)| named.contains(r.checksum.as_str()));
        let held: Vec<LedgerRow> = inserted.iter().map(|(r, _)| LedgerRow { held: true, ..r.clone() }).collect();
        self.catalog().put_ledger(&held, &[])?;
        if !skipped.is_empty() {
            let sums: Vec<String> = skipped.iter().map(|(r, _)| r.checksum.clone()).collect();
            self.catalog().forget_ledger(Some(&sums))?;
            let keys: Vec<String> = sums.iter().map(|s| key_of(s)).collect();
            let _ = self.objects().delete_many(&keys);
        }
        Ok(ids)
    }
}

/// Ends the process at once where `PICASO_FAILPOINT` names this point, as a kill would: the
/// tests cut admissions and evictions short this way and check what is left.
fn failpoint(name: &str) {
    if std::env::var_os("PICASO_FAILPOINT").is_some_and(|v| v == name) {
        std::process::abort();
    }
}

/// What an admission decided: the candidates admitted (with what they carry) and the held
/// states to evict for them.
pub(crate) struct Plan<T> {
    admitted: Vec<(LedgerRow, T)>,
    victims: Vec<LedgerRow>,
}

/// A state file recomputed from its context's tokens.
pub(crate) struct Recomputed {
    /// The file's bytes in the store's codec.
    pub bytes: Vec<u8>,
    /// Whether they are the stored state's (its checksum the row's).
    pub same: bool,
}

/// A ledger row for a state not seen before (`bytes` in the store's codec, of a context of
/// `n_tokens`), its priority under `policy` at `clock`.
fn new_row(
    checksum: &str,
    bytes: u64,
    n_tokens: usize,
    model: &Model,
    held: bool,
    at: (Policy, f64, u64),
) -> LedgerRow {
    let (policy, clock, tick) = at;
    let mut row = LedgerRow {
        checksum: checksum.to_string(),
        bytes,
        work: model.prefill_flops(n_tokens),
        retrievals: 0,
        last_tick: tick,
        priority: 0.0,
        held,
    };
    row.priority = policy.priority(clock, &row);
    row
}

/// The state files of `records` recomputed from their tokens, in `codec`. One batched prefill
/// where the engine gives each sequence the bits it gives it alone ([`Model::prefill_each`]),
/// as ingest does.
pub(crate) fn recompute(
    model: &Model,
    records: &[&ContextRecord],
    codec: picaso_model::StateDtype,
) -> Result<Vec<Recomputed>> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let tokens: Vec<&[u32]> = records.iter().map(|r| r.tokens.as_slice()).collect();
    let states = model.prefill_each(&tokens, PREFILL_TOKENS)?;
    let files = states
        .into_par_iter()
        .zip(records)
        .map(|(state, record)| {
            let bytes = state.to_bytes(codec)?;
            let same = checksum(&bytes) == record.checksum;
            Ok(Recomputed { bytes, same })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(files)
}

/// Shared bytes as a buffer a [`MappedState`] can hold.
struct ArcBytes(Arc<Vec<u8>>);

impl AsRef<[u8]> for ArcBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Bytes as MiB or KiB, for messages.
fn show_bytes(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", n as f64 / 1024.0)
    }
}
