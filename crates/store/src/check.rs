//! Checking a whole store, and repairing it from what its catalog holds.
//!
//! Queries verify each state object as they read it, so a lost or damaged object is found only
//! when someone needs it. [`check`] reads every context's object back (present, checksum, a state
//! of the store's model summarising the context's tokens, finite values) and lists the objects
//! no context names (left by killed writes or deletes). [`repair`] recomputes the broken states
//! from the token ids the catalog keeps, so no source document is needed, and removes the
//! unnamed objects.

use std::collections::HashSet;
use std::time::Instant;

use picaso_model::{counted, Model, State};

use crate::catalog::LedgerRow;
use crate::error::{Error, Result};
use crate::records::ContextRecord;
use crate::states::{checksum, checksum_of, is_checksum, key_of, Entry, Finding};
use crate::store::{row_problem, Store};

/// Contexts whose objects are read at once: enough requests in flight for a remote store, and
/// at most ~600 MB of mamba2-130m states held while they are judged.
const PAGE: usize = 32;
/// Contexts recomputed per forward pass group when repairing.
const REPAIR_BATCH: usize = 16;
/// Tokens per forward pass when recomputing (as ingest).
const PREFILL_TOKENS: usize = 4096;

/// What is wrong with one context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    /// Its state object is gone.
    MissingState,
    /// Its state object is there, but is not the state its row records.
    DamagedState,
    /// Its catalog row is damaged: its checksum or tokens cannot be trusted, so its state
    /// cannot be recomputed from it.
    DamagedRow,
}

/// A context that cannot be used as stored.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Problem {
    /// The context.
    pub id: i64,
    /// Its document.
    pub doc: String,
    /// Its segment.
    pub seg: u32,
    /// What is wrong.
    pub kind: ProblemKind,
    /// Why, in words.
    pub detail: String,
}

/// An object in the states location that no context names.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Unreferenced {
    /// Its key (`ab/<checksum>.safetensors`).
    pub key: String,
    /// Its size.
    pub bytes: u64,
}

/// What [`check`] found (the keys of `picaso check --json`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CheckReport {
    /// Whether the objects were read and verified (false: `quick`, only their presence was).
    pub read: bool,
    /// Contexts checked.
    pub contexts: usize,
    /// Of those, the ones whose state object passed every check (`quick`: is present).
    pub sound: usize,
    /// Bytes of the sound contexts' state objects (read and verified unless `quick`).
    pub state_bytes: u64,
    /// The contexts that cannot be used, in id order.
    pub problems: Vec<Problem>,
    /// State objects no context names, in key order. They cost only space; an object written
    /// by an ingest that has not committed yet shows here too.
    pub unreferenced: Vec<Unreferenced>,
    /// Their bytes.
    pub unreferenced_bytes: u64,
    /// In a store with a state budget, what it holds against it (`None` without one).
    pub budget: Option<BudgetCheck>,
    /// Seconds the check took.
    pub seconds: f64,
}

/// A budgeted store's states against its budget.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BudgetCheck {
    /// The budget, bytes.
    pub budget_bytes: u64,
    /// Bytes of every state object in the states location: at most the budget.
    pub stored_bytes: u64,
    /// Contexts whose state is not held (recomputed when needed): not a problem.
    pub not_held: usize,
    /// Objects present that the ledger does not hold: left by an admission or an eviction that
    /// was cut short. Within the budget (room is made before a write), removed by `--repair`.
    pub unheld_objects: Vec<Unreferenced>,
}

impl CheckReport {
    /// One line for people.
    pub fn summary(&self) -> String {
        let (how, sound) = if self.read { ("read back", "sound") } else { ("only looked for", "present") };
        let mut s = format!(
            "checked {} ({:.1} MiB of states {how}) in {:.1} s: {} {sound}",
            counted(self.contexts, "context"),
            self.state_bytes as f64 / 1048576.0,
            self.seconds,
            self.sound
        );
        if let Some(b) = &self.budget {
            s += &format!(
                " ({} not held under the budget: {:.1} of {:.1} MiB stored",
                counted(b.not_held, "context"),
                b.stored_bytes as f64 / 1048576.0,
                b.budget_bytes as f64 / 1048576.0
            );
            if !b.unheld_objects.is_empty() {
                s += &format!(", {} present but not held", counted(b.unheld_objects.len(), "object"));
            }
            if b.stored_bytes > b.budget_bytes {
                s += ", OVER THE BUDGET";
            }
            s += ")";
        }
        for (kind, what) in [
            (ProblemKind::MissingState, "without their state object"),
            (ProblemKind::DamagedState, "with a damaged state object"),
            (ProblemKind::DamagedRow, "with a damaged catalog row"),
        ] {
            let n = self.problems.iter().filter(|p| p.kind == kind).count();
            if n > 0 {
                s += &format!(", {n} {what}");
            }
        }
        if !self.unreferenced.is_empty() {
            s += &format!(
                "; {} that no context names ({:.1} MiB)",
                counted(self.unreferenced.len(), "state object"),
                self.unreferenced_bytes as f64 / 1048576.0
            );
        }
        s
    }
}

/// Why `bytes`, found under the key of `rec`'s checksum, are not `rec`'s state; `None` if they are.
fn judge(store: &Store, rec: &ContextRecord, bytes: &[u8]) -> Option<String> {
    let found = checksum(bytes);
    if found != rec.checksum {
        return Some(format!("its bytes hash to {found}, not to the recorded {}", rec.checksum));
    }
    let state = match State::from_bytes(bytes) {
        Ok(s) => s,
        Err(e) => return Some(format!("it is not a readable state file: {e}")),
    };
    let model = &store.info().fingerprint;
    if &state.fingerprint != model {
        return Some(format!("it was made by model {}, the store's is {model}", state.fingerprint));
    }
    if state.n_tokens != rec.tokens.len() as u64 {
        return Some(format!("it summarises {} tokens, the context has {}", state.n_tokens, rec.tokens.len()));
    }
    state.check_values().err().map(|e| e.to_string())
}

/// Reads back every context's state object and lists the objects no context names.
/// `quick` reads none: it finds missing objects from the listing alone (one request per
/// 1,000 objects on S3, against a read of every byte), not damaged ones.
/// `on_progress(checked, total)` runs after each page of contexts. Contexts deleted by another
/// writer while the check runs are not reported.
pub fn check(store: &Store, quick: bool, mut on_progress: impl FnMut(usize, usize)) -> Result<CheckReport> {
    let start = Instant::now();
    // Listed before the rows are read: an object whose row commits during the check is read
    // with the later rows (ids ascend), so it is not taken for unreferenced.
    let listed = store.objects().entries()?;
    let present: HashSet<String> = if quick { listed.iter().map(|e| e.key.clone()).collect() } else { HashSet::new() };
    let total = store.len()?;
    let mut report = CheckReport { read: !quick, ..Default::default() };
    let budget = store.budget()?;
    let mut not_held_keys: HashSet<String> = HashSet::new();
    let mut named: HashSet<String> = HashSet::new();
    let mut after = i64::MIN;
    loop {
        let page = store.catalog().export(after, PAGE)?;
        let Some(last) = page.last() else { break };
        after = last.0.id;
        let mut checked = page.len();
        let mut rows = Vec::with_capacity(page.len());
        let mut problems = Vec::new();
        for (rec, _) in page {
            if is_checksum(&rec.checksum) {
                named.insert(key_of(&rec.checksum));
            }
            match row_problem(&rec) {
                None => rows.push(rec),
                Some(detail) => problems.push(problem(&rec, ProblemKind::DamagedRow, detail)),
            }
        }
        if budget.is_some() {
            // A state the budget does not hold is absent by design: it is recomputed when needed.
            let sums: Vec<String> = rows.iter().map(|r| r.checksum.clone()).collect();
            let held: Vec<bool> =
                store.catalog().ledger(&sums)?.iter().map(|l| l.as_ref().is_some_and(|l| l.held)).collect();
            let mut kept = Vec::with_capacity(rows.len());
            for (rec, held) in rows.into_iter().zip(held) {
                if held {
                    kept.push(rec);
                } else {
                    not_held_keys.insert(key_of(&rec.checksum));
                    report.budget.get_or_insert_with(BudgetCheck::default).not_held += 1;
                }
            }
            rows = kept;
        }
        let keys: Vec<String> = rows.iter().map(|r| key_of(&r.checksum)).collect();
        let judged = if quick {
            // Not listed: looked up, in case it was written after the listing.
            let unlisted: Vec<String> = keys.iter().filter(|k| !present.contains(*k)).cloned().collect();
            let there: HashSet<String> = unlisted
                .iter()
                .zip(store.objects().exist_many(&unlisted)?)
                .filter(|(_, t)| *t)
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter()
                .map(|k| if present.contains(k) || there.contains(k) { Finding::Sound } else { Finding::Missing })
                .collect()
        } else {
            store.objects().inspect_many(&keys, &|i, bytes| match judge(store, &rows[i], bytes) {
                None => Finding::Sound,
                Some(why) => Finding::Damaged(why),
            })?
        };
        let mut failed = Vec::new();
        for (rec, finding) in rows.iter().zip(judged) {
            match finding {
                Finding::Sound => {
                    report.sound += 1;
                    report.state_bytes += rec.state_bytes;
                }
                Finding::Missing => failed.push((
                    rec,
                    ProblemKind::MissingState,
                    format!("no object at {}/{}", store.states_url(), key_of(&rec.checksum)),
                )),
                Finding::Damaged(why) => failed.push((rec, ProblemKind::DamagedState, why)),
            }
        }
        if !failed.is_empty() {
            // A context deleted meanwhile (row first, then its object) is gone, not broken.
            let ids: Vec<i64> = failed.iter().map(|(r, ..)| r.id).collect();
            let sums: Vec<String> = failed.iter().map(|(r, ..)| r.checksum.clone()).collect();
            for ((rec, kind, why), there) in failed.into_iter().zip(store.catalog().exist_settled(&ids, &sums)?) {
                if there {
                    problems.push(problem(rec, kind, why));
                } else {
                    checked -= 1;
                }
            }
        }
        report.contexts += checked;
        report.problems.extend(problems);
        on_progress(report.contexts, total.max(report.contexts));
    }
    report.problems.sort_by_key(|p| p.id);
    if let Some(budget) = budget {
        let b = report.budget.get_or_insert_with(BudgetCheck::default);
        b.budget_bytes = budget.bytes;
        for Entry { key, bytes } in &listed {
            if checksum_of(key).is_none() {
                continue;
            }
            b.stored_bytes += bytes;
            // Named by a context, yet not held: a held state shares no key with an unheld one.
            if not_held_keys.contains(key) {
                b.unheld_objects.push(Unreferenced { key: key.clone(), bytes: *bytes });
            }
        }
    }
    for Entry { key, bytes } in listed {
        // Only names picaso gives: anything else is not ours.
        if checksum_of(&key).is_some() && !named.contains(&key) {
            report.unreferenced_bytes += bytes;
            report.unreferenced.push(Unreferenced { key, bytes });
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

fn problem(rec: &ContextRecord, kind: ProblemKind, detail: String) -> Problem {
    Problem { id: rec.id, doc: rec.doc.clone(), seg: rec.seg, kind, detail }
}

/// The reports as `picaso check --json` prints them (and Python's `Store.check` returns them):
/// the check's keys, with the repair's under `repair` (null without one).
pub fn report_json(found: &CheckReport, repaired: Option<&RepairReport>) -> serde_json::Value {
    let mut v = serde_json::to_value(found).expect("plain data");
    v["repair"] = serde_json::to_value(repaired).expect("plain data");
    v
}

/// What [`repair`] did (the `repair` key of `picaso check --repair --json`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RepairReport {
    /// Contexts whose state object was written again, bit for bit the recorded one.
    pub rewritten: Vec<i64>,
    /// Contexts whose recomputed state has other bits than the recorded one (it was made on a
    /// CPU whose kernels round differently, or with other `--weights`): their rows now name the
    /// new object.
    pub restated: Vec<i64>,
    /// Contexts deleted by another writer before they were repaired.
    pub gone: Vec<i64>,
    /// Unreferenced objects removed.
    pub removed_objects: usize,
    /// Their bytes.
    pub removed_bytes: u64,
    /// Problems a repair cannot fix (damaged catalog rows): delete those contexts and ingest
    /// their documents again.
    pub left: Vec<Problem>,
    /// Seconds the repair took.
    pub seconds: f64,
}

impl RepairReport {
    /// One line for people.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "repaired {} in {:.1} s ({} rewritten as recorded, {} recomputed with other bits)",
            counted(self.rewritten.len() + self.restated.len(), "context"),
            self.seconds,
            self.rewritten.len(),
            self.restated.len()
        );
        if self.removed_objects > 0 {
            s += &format!(
                ", removed {} that no context names ({:.1} MiB)",
                counted(self.removed_objects, "state object"),
                self.removed_bytes as f64 / 1048576.0
            );
        }
        if !self.gone.is_empty() {
            s += &format!(", {} deleted meanwhile", self.gone.len());
        }
        s
    }
}

/// Fixes what `found` (a [`check`] of this store) reports: each context without a sound state
/// object gets it back, recomputed by `model` from the token ids in its row, and the objects no
/// context names are removed (each under the lock a delete takes, so an ingest about to name
/// one is never robbed). Damaged rows are left, in [`RepairReport::left`]. Every repaired
/// context is read back and verified before this returns.
pub fn repair(
    store: &Store,
    model: &Model,
    found: &CheckReport,
    mut on_progress: impl FnMut(usize, usize),
) -> Result<RepairReport> {
    store.require_model(model)?;
    let _writer = store.lock_writes()?;
    let start = Instant::now();
    let mut out = RepairReport {
        left: found.problems.iter().filter(|p| p.kind == ProblemKind::DamagedRow).cloned().collect(),
        ..Default::default()
    };
    let broken: Vec<i64> = found.problems.iter().filter(|p| p.kind != ProblemKind::DamagedRow).map(|p| p.id).collect();
    let budgeted = store.budget()?.is_some();
    let objects = store.objects();
    for (done, chunk) in broken.chunks(REPAIR_BATCH).enumerate() {
        let mut rows = Vec::with_capacity(chunk.len());
        for &id in chunk {
            match store.get(id) {
                Ok(r) => rows.push(r),
                Err(Error::NotFound(_)) => out.gone.push(id),
                Err(e) => return Err(e),
            }
        }
        if rows.is_empty() {
            continue;
        }
        let tokens: Vec<&[u32]> = rows.iter().map(|r| r.tokens.as_slice()).collect();
        let states = model.prefill_each(&tokens, PREFILL_TOKENS)?;
        for (rec, state) in rows.iter().zip(states) {
            let bytes = state.to_bytes(store.info().state_dtype)?;
            let sum = checksum(&bytes);
            let key = key_of(&sum);
            if sum == rec.checksum {
                objects.put(&key, &bytes)?;
                out.rewritten.push(rec.id);
                continue;
            }
            let file = format!("states/{key}");
            if !store.catalog().restate(rec.id, &sum, &file, bytes.len() as u64, &mut || objects.put(&key, &bytes))? {
                out.gone.push(rec.id);
                continue;
            }
            out.restated.push(rec.id);
            if budgeted {
                // The budget's entry follows the context to its new object (held: it is written).
                let old = store.catalog().ledger(std::slice::from_ref(&rec.checksum))?.remove(0);
                if let Some(old) = old {
                    let moved = LedgerRow { checksum: sum.clone(), bytes: bytes.len() as u64, held: true, ..old };
                    store.catalog().put_ledger(&[moved], &[])?;
                }
            }
            // The old object, if damaged and no longer named, goes too.
            if store.catalog().remove_if_unreferenced(&rec.checksum, &mut |s| objects.delete(&key_of(s)))? && budgeted {
                store.catalog().forget_ledger(Some(std::slice::from_ref(&rec.checksum)))?;
            }
        }
        on_progress((done * REPAIR_BATCH + chunk.len()).min(broken.len()), broken.len());
    }
    let repaired: Vec<i64> = out.rewritten.iter().chain(&out.restated).copied().collect();
    for chunk in repaired.chunks(PAGE) {
        store.map_states(chunk)?; // read back: checksum and file verified
    }
    if let Some(budget) = &found.budget {
        // Objects an admission or eviction left behind, still not held: the ledger is read
        // under the guard admissions take, so none is being admitted meanwhile.
        let _guard = store.budget_guard().write().unwrap_or_else(|p| p.into_inner());
        for u in &budget.unheld_objects {
            let Some(sum) = checksum_of(&u.key) else { continue };
            let held = store.catalog().ledger(&[sum.to_string()])?[0].as_ref().is_some_and(|l| l.held);
            if !held {
                objects.delete(&u.key)?;
                out.removed_objects += 1;
                out.removed_bytes += u.bytes;
            }
        }
    }
    for u in &found.unreferenced {
        let Some(sum) = checksum_of(&u.key) else { continue };
        if store.catalog().remove_if_unreferenced(sum, &mut |s| objects.delete(&key_of(s)))? {
            if budgeted {
                store.catalog().forget_ledger(Some(&[sum.to_string()]))?;
            }
            out.removed_objects += 1;
            out.removed_bytes += u.bytes;
        }
    }
    out.seconds = start.elapsed().as_secs_f64();
    Ok(out)
}
