//! Retrieval within documents on a folder store: the ranking of those documents' contexts
//! only, also while another handle writes (each write makes readers rebuild their index, the
//! moment a reader holding it while waiting for the connection would deadlock).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use picaso_store::{NewContext, Scope, Store};

mod common;
use common::{context, info};

#[test]
fn retrieval_within_documents_holds_while_another_handle_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open_or_create(tmp.path(), &info()).unwrap();
    // Embeddings along axis 0 (a, c) and 1 (b): ties, broken by id in every search.
    let items: Vec<NewContext> = (0..3)
        .flat_map(|s| [context("a", s, 4 * s), context("b", s, 4 * s + 1), context("c", s, 4 * s + 12)])
        .collect();
    store.insert(&items).unwrap();
    let within = vec!["a".to_string(), "b".to_string()];
    let ours: Vec<i64> = ["a", "b"].iter().flat_map(|d| store.segments_of(d).unwrap().into_values()).collect();
    let query = store.embedding(store.segments_of("c").unwrap()[&0]).unwrap(); // axis 0: a's and c's first
    let want = store.search_in(&query, 4, Scope::within(&within)).unwrap();
    let everything = store.search_exact(&query, 100).unwrap();
    assert_eq!(want, everything.iter().filter(|(id, _)| ours.contains(id)).take(4).copied().collect::<Vec<_>>());

    let writer = Store::open(tmp.path()).unwrap();
    let (store, query, within, want) = (Arc::new(store), Arc::new(query), Arc::new(within), Arc::new(want));
    let (done, finished) = mpsc::channel();
    let writing = std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut seg = 0;
        while t0.elapsed() < Duration::from_secs(2) {
            let id = writer.insert(&[context("w", seg, 3)]).unwrap()[0].unwrap();
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
                assert_eq!(store.search_in(&query, 4, Scope::within(&within)).unwrap(), *want);
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
