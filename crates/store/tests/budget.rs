//! A store with a state budget: it answers every query as a store that keeps every state (the
//! same composed state, bit for bit), never holds more than its budget on disk, keeps its
//! counters across a reopen, and refuses what it cannot do.

mod common;

use common::{context, info, model};
use picaso_model::{Composition, Method, StateDtype};
use picaso_store::{prepare, Budget, Policy, Store};

/// Bytes of the state objects in a folder store's states folder.
fn stored_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    for shard in std::fs::read_dir(dir.join("states")).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(shard.path()).into_iter().flatten().flatten() {
            if f.file_name().to_string_lossy().ends_with(".safetensors") {
                total += f.metadata().unwrap().len();
            }
        }
    }
    total
}

/// A little generator of queries: ids drawn with Zipf-like weights (1/rank), a few per query.
struct Queries(u64);

impl Queries {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn ids(&mut self, n: usize, k: usize) -> Vec<i64> {
        let harmonic: f64 = (1..=n).map(|r| 1.0 / r as f64).sum();
        let mut out = Vec::new();
        while out.len() < k {
            let mut u = (self.next() % 1_000_000) as f64 / 1_000_000.0 * harmonic;
            let mut rank = 1;
            while rank < n && u > 1.0 / rank as f64 {
                u -= 1.0 / rank as f64;
                rank += 1;
            }
            let id = rank as i64;
            if !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }
}

#[test]
fn a_budgeted_store_answers_like_a_full_store() {
    let m = model();
    for policy in [Policy::Work, Policy::Lru] {
        let tmp = tempfile::tempdir().unwrap();
        let full = Store::open_or_create(tmp.path().join("full").as_path(), &info()).unwrap();
        let budgeted_dir = tmp.path().join("budgeted");
        let budgeted = Store::open_or_create(budgeted_dir.as_path(), &info()).unwrap();
        let one = budgeted.smallest_budget(m).unwrap();
        // Room for three and a half of the twenty states (a Mamba-2 state's size is fixed).
        let budget = Budget { bytes: 3 * one + one / 2, policy };
        budgeted.set_budget(Some(budget), m).unwrap();
        let items: Vec<_> = (0..20).map(|i| context(&format!("d{i}"), 0, i)).collect();
        full.insert_with(&items, Some(m)).unwrap();
        budgeted.insert_with(&items, Some(m)).unwrap();
        assert!(stored_bytes(&budgeted_dir) <= budget.bytes);
        let mut queries = Queries(7);
        let mut asked = 0;
        for q in 0..60 {
            let ids = queries.ids(20, 1 + q % 4);
            asked += ids.len() as u64;
            let method = Method::Compose(Composition::PicasoR);
            let a = prepare(&full, m, &ids, method, None).unwrap();
            let b = prepare(&budgeted, m, &ids, method, None).unwrap();
            assert_eq!(
                a.state.to_bytes(StateDtype::F32).unwrap(),
                b.state.to_bytes(StateDtype::F32).unwrap(),
                "{policy:?}: query {q} {ids:?}"
            );
            assert!(stored_bytes(&budgeted_dir) <= budget.bytes, "{policy:?}: over the budget after query {q}");
        }
        let stats = budgeted.budget_stats().unwrap().unwrap();
        assert_eq!(stats.hits + stats.misses, asked, "{stats:?}");
        assert!(stats.hits > 0 && stats.misses > 0, "{policy:?}: {stats:?}");
        assert!(stats.held_bytes <= budget.bytes && stats.held >= 2, "{stats:?}");
        assert_eq!(stats.tracked, 20);
        let report = picaso_store::check(&budgeted, false, |_, _| {}).unwrap();
        assert!(report.problems.is_empty(), "{}", report.summary());
        let b = report.budget.clone().unwrap();
        assert_eq!((b.not_held as u64, b.unheld_objects.len()), (20 - stats.held, 0), "{}", report.summary());
        assert!(b.stored_bytes <= budget.bytes);
        // The counters and the ledger survive a reopen.
        drop(budgeted);
        let again = Store::open(budgeted_dir.as_path()).unwrap();
        assert_eq!(again.budget_stats().unwrap().unwrap(), stats);
        assert_eq!(again.budget().unwrap(), Some(budget));
    }
}

/// The work policy keeps the states retrieved often: after a skewed run, the most retrieved
/// contexts are the ones held.
#[test]
fn the_work_policy_keeps_what_is_retrieved_most() {
    let m = model();
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open_or_create(tmp.path().join("s").as_path(), &info()).unwrap();
    let one = store.smallest_budget(m).unwrap();
    store.set_budget(Some(Budget { bytes: 2 * one, policy: Policy::Work }), m).unwrap();
    let items: Vec<_> = (0..10).map(|i| context(&format!("d{i}"), 0, i)).collect();
    store.insert_with(&items, Some(m)).unwrap();
    let method = Method::Compose(Composition::PicasoR);
    // Contexts 9 and 10 (the longest, held after ingest) are never asked for; 1 and 2 often.
    for q in 0..12 {
        let ids: Vec<i64> = if q % 3 == 2 { vec![3 + q % 5] } else { vec![1, 2] };
        prepare(&store, m, &ids, method, None).unwrap();
    }
    let records = store.records(&[1, 2]).unwrap();
    let sums: Vec<String> = records.iter().map(|r| r.as_ref().unwrap().checksum.clone()).collect();
    let stats = store.budget_stats().unwrap().unwrap();
    assert_eq!(stats.held, 2, "{stats:?}");
    let report = picaso_store::check(&store, false, |_, _| {}).unwrap();
    assert!(report.problems.is_empty());
    for sum in sums {
        assert!(
            tmp.path().join("s/states").join(&sum[..2]).join(format!("{sum}.safetensors")).exists(),
            "{sum} not held"
        );
    }
}

#[test]
fn budgets_refuse_what_they_cannot_do() {
    let m = model();
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open_or_create(tmp.path().join("s").as_path(), &info()).unwrap();
    let one = store.smallest_budget(m).unwrap();
    let e = store.set_budget(Some(Budget { bytes: one - 1, policy: Policy::Work }), m).unwrap_err().to_string();
    assert!(e.contains("not even one state"), "{e}");
    store.set_budget(Some(Budget { bytes: 2 * one, policy: Policy::Lru }), m).unwrap();
    let e = store.insert(&[context("d", 0, 1)]).unwrap_err().to_string();
    assert!(e.contains("state budget"), "{e}");
    // Removing the budget stores every state again.
    store.insert_with(&(0..6).map(|i| context(&format!("d{i}"), 0, i)).collect::<Vec<_>>(), Some(m)).unwrap();
    assert_eq!(store.budget_stats().unwrap().unwrap().held, 2);
    store.set_budget(None, m).unwrap();
    assert!(store.budget().unwrap().is_none());
    let report = picaso_store::check(&store, false, |_, _| {}).unwrap();
    assert_eq!((report.sound, report.problems.len()), (6, 0), "{}", report.summary());
}
