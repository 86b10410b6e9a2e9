//! Retrieval within documents on a folder store: the ranking of those documents' contexts
//! only, also while another handle writes (each write makes readers rebuild their index, the
//! moment a reader holding it while waiting for the connection would deadlock).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use picaso_model::{Mamba2Config, Mamba2Weights, Model};
use picaso_store::{NewContext, Store, StoreInfo};

const DIM: usize = 4;

fn model() -> &'static Model {
    static MODEL: std::sync::OnceLock<Model> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let c = Mamba2Config::tiny(2, 4);
        Model::from_weights(c.clone(), Mamba2Weights::random(&c, 5), None)
    })
}

fn info() -> StoreInfo {
    StoreInfo { fingerprint: model().fingerprint().to_string(), dim: DIM, state_dtype: Default::default() }
}

/// Context `seg` of `doc`, its embedding leaning towards axis `axis`.
fn context(doc: &str, seg: u32, axis: usize) -> NewContext {
    let m = model();
    let tokens: Vec<u32> = (0..4).map(|t| (t * 5 + seg) % 50).collect();
    let mut e = [0.2f32; DIM];
    e[axis % DIM] = 1.0 + seg as f32 * 0.01;
    let norm = e.iter().map(|v| v * v).sum::<f32>().sqrt();
    NewContext {
        doc: doc.to_string(),
        seg,
        text: format!("{doc} {seg}"),
        state: m.prefill(&tokens, &m.zero_state()).unwrap(),
        tokens,
        embedding: e.iter().map(|v| v / norm).collect(),
    }
}

#[test]
fn retrieval_within_documents_holds_while_another_handle_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open_or_create(tmp.path(), &info()).unwrap();
    let items: Vec<NewContext> =
        (0..3).flat_map(|s| [context("a", s, 0), context("b", s, 1), context("c", s, 0)]).collect();
    store.insert(&items).unwrap();
    let within = vec!["a".to_string(), "b".to_string()];
    let ours: Vec<i64> = ["a", "b"].iter().flat_map(|d| store.segments_of(d).unwrap().into_values()).collect();
    let query = store.embedding(store.segments_of("c").unwrap()[&0]).unwrap(); // nearest: c's, then a's
    let want = store.search_in(&query, 4, Some(&within)).unwrap();
    let everything = store.search_exact(&query, 100).unwrap();
    assert_eq!(want, everything.iter().filter(|(id, _)| ours.contains(id)).take(4).copied().collect::<Vec<_>>());

    let writer = Store::open(tmp.path()).unwrap();
    let (store, query, within, want) = (Arc::new(store), Arc::new(query), Arc::new(within), Arc::new(want));
    let (done, finished) = mpsc::channel();
    let writing = std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut seg = 0;
        while t0.elapsed() < Duration::from_secs(2) {
            let id = writer.insert(&[context("w", seg, 0)]).unwrap()[0].unwrap();
            writer.delete(id).unwrap();
            seg += 1;
        }
    });
    for _ in 0..2 {
        let (store, query, within, want, done) =
            (store.clone(), query.clone(), within.clone(), want.clone(), done.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(2) {
                assert_eq!(store.search_in(&query, 4, Some(&within)).unwrap(), *want);
                assert_eq!(store.search(&query, 3).unwrap().len(), 3);
            }
            done.send(()).unwrap();
        });
    }
    drop(done);
    // Threads, not a scope: a reader that hangs (a deadlock) or panics fails the test instead
    // of hanging it.
    for _ in 0..2 {
        finished.recv_timeout(Duration::from_secs(60)).expect("a reader finished: no deadlock, no failed check");
    }
    writing.join().unwrap();
}
