//! BM25 and hybrid retrieval on a folder store and, when `PICASO_TEST_POSTGRES` is set, on a
//! PostgreSQL store (its full-text rank); and a store refusing queries embedded by another
//! encoder.

use picaso_store::{Location, NewContext, Query, Retriever, Scope, StatesUrl, Store};

mod common;
use common::{context, info};

const TEXTS: [(&str, &str); 6] = [
    ("eiffel", "The Eiffel Tower is a wrought-iron tower in Paris, finished in 1889."),
    ("eiffel", "Gustave Eiffel's company designed and built the tower for the World's Fair."),
    ("mamba", "Mamba is a state-space model whose state summarises the tokens it has read."),
    ("mamba", "A state-space model composes stored states instead of reading contexts again."),
    ("river", "The Seine river flows through Paris past the tower and Notre-Dame."),
    ("river", "Barges carry freight along the river towards the sea."),
];

/// The folder store, and a PostgreSQL one (local states folder) when configured.
fn stores(tmp: &std::path::Path) -> Vec<Store> {
    let mut v = vec![Store::open_or_create(&tmp.join("folder"), &info()).unwrap()];
    match std::env::var("PICASO_TEST_POSTGRES") {
        Ok(pg) => {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
            let schema = format!("lexical_{}_{nanos}", std::process::id());
            let sep = if pg.contains('?') { '&' } else { '?' };
            let url = format!("{pg}{sep}options=-csearch_path%3D{schema}%2Cpublic");
            let location = Location {
                catalog: picaso_store::CatalogUrl::parse(&url).unwrap(),
                states: Some(StatesUrl::Local(tmp.join("pg-states"))),
            };
            v.push(Store::open_or_create(location, &info()).unwrap());
        }
        Err(_) => {
            assert!(std::env::var("PICASO_TEST_REQUIRE_BACKENDS").is_err(), "PICASO_TEST_POSTGRES is required");
            eprintln!("note: PICASO_TEST_POSTGRES not set; folder store only");
        }
    }
    v
}

fn fill(store: &Store) -> Vec<i64> {
    let items: Vec<NewContext> = TEXTS
        .iter()
        .enumerate()
        .map(|(i, (doc, text))| NewContext { text: text.to_string(), ..context(doc, i as u32, i as u32) })
        .collect();
    store.insert(&items).unwrap().into_iter().map(Option::unwrap).collect()
}

fn ids(hits: &[(i64, f32)]) -> Vec<i64> {
    hits.iter().map(|h| h.0).collect()
}

#[test]
fn bm25_and_hybrid_retrieve_on_every_backend() {
    let tmp = tempfile::tempdir().unwrap();
    for store in stores(tmp.path()) {
        let at = store.location().to_string();
        let id = fill(&store);
        let text = |q| Query { text: Some(q), ..Default::default() };
        // Lexical: only texts sharing a term, the best first.
        let hits = store.retrieve_in(&text("state-space model states"), Retriever::Bm25, 10, Scope::all()).unwrap();
        assert_eq!(ids(&hits)[..2].iter().collect::<std::collections::BTreeSet<_>>(), [&id[2], &id[3]].into(), "{at}");
        assert!(hits.len() == 2 && hits[0].1 >= hits[1].1 && hits[1].1 > 0.0, "{at}: {hits:?}");
        let paris = store.search_text_in("Paris tower", 10, Scope::all()).unwrap();
        assert_eq!(paris.len(), 3, "{at}: three texts name Paris or the tower: {paris:?}");
        assert!(store.search_text_in("the of and", 10, Scope::all()).unwrap().is_empty(), "{at}: stop words only");
        assert!(store.search_text_in("zeppelin", 10, Scope::all()).unwrap().is_empty(), "{at}");
        // Within documents, and with a metadata filter none passes.
        let within = vec!["river".to_string()];
        assert_eq!(ids(&store.search_text_in("Paris tower", 10, Scope::within(&within)).unwrap()), [id[4]], "{at}");
        let unknown = vec!["nowhere".to_string()];
        assert!(store.search_text_in("Paris", 10, Scope::within(&unknown)).is_err(), "{at}");
        // A deleted context is gone from the text index; a new one is found at once.
        store.delete(id[4]).unwrap();
        assert_eq!(store.search_text_in("Paris tower", 10, Scope::all()).unwrap().len(), 2, "{at}");
        let added = store
            .insert(&[NewContext { text: "A zeppelin flew over Paris.".into(), ..context("air", 0, 9) }])
            .unwrap()[0]
            .unwrap();
        assert_eq!(ids(&store.search_text_in("zeppelin", 10, Scope::all()).unwrap()), [added], "{at}");

        // Hybrid: the dense ranking of the stored embedding of context 2 (axis 2) fused with
        // BM25's; weight 1 is the dense order, weight 0 BM25's (its matches only).
        let e = store.embedding(id[2]).unwrap();
        let both = |w| {
            let q = Query { text: Some("river barges freight"), embedding: Some(&e), encoder: None };
            store.retrieve_in(&q, Retriever::Hybrid { dense_weight: w }, 3, Scope::all()).unwrap()
        };
        let dense = store.search(&e, 3).unwrap();
        assert_eq!(ids(&both(1.0)), ids(&dense), "{at}");
        assert_eq!(ids(&both(0.0)), [id[5]], "{at}");
        let half = both(0.5);
        assert_eq!(half.len(), 3, "{at}");
        assert!(ids(&half).contains(&id[5]) && ids(&half).contains(&dense[0].0), "{at}: {half:?}");
        // A retriever without what it needs says so.
        let e = store.retrieve_in(&text("x"), Retriever::Dense, 3, Scope::all()).unwrap_err().to_string();
        assert!(e.contains("dense retriever needs the query's embedding"), "{e}");
    }
}

#[test]
fn a_store_refuses_queries_of_another_encoder() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open_or_create(tmp.path(), &info()).unwrap();
    fill(&store);
    store.bind_embedder("aaaa", "/models/all-MiniLM-L6-v2").unwrap();
    let e = store.embedding(store.ids().unwrap()[0]).unwrap();
    let q = |encoder| Query { text: None, embedding: Some(&e), encoder: Some(encoder) };
    assert_eq!(store.retrieve_in(&q("aaaa"), Retriever::Dense, 2, Scope::all()).unwrap().len(), 2);
    let err = store.retrieve_in(&q("bbbb"), Retriever::Dense, 2, Scope::all()).unwrap_err().to_string();
    for needle in ["bbbb", "aaaa", "/models/all-MiniLM-L6-v2", "--embedder", "new store"] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let err = store
        .retrieve_in(
            &Query { text: Some("Paris"), ..q("bbbb") },
            Retriever::Hybrid { dense_weight: 0.5 },
            2,
            Scope::all(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("bbbb"));
    // Binding another encoder to the store is refused too.
    assert!(store.bind_embedder("bbbb", "/models/all-mpnet-base-v2").is_err());
}

#[test]
fn retrievers_parse_and_refuse_bad_options() {
    assert_eq!(Retriever::parse("dense", None).unwrap(), Retriever::Dense);
    assert_eq!(Retriever::parse("bm25", None).unwrap(), Retriever::Bm25);
    assert_eq!(Retriever::parse("hybrid", None).unwrap(), Retriever::Hybrid { dense_weight: 0.5 });
    assert_eq!(Retriever::parse("hybrid", Some(0.8)).unwrap(), Retriever::Hybrid { dense_weight: 0.8 });
    for (name, w, needle) in [
        ("sparse", None, "unknown retriever"),
        ("hybrid", Some(1.5), "between 0 and 1"),
        ("hybrid", Some(f32::NAN), "between 0 and 1"),
        ("bm25", Some(0.3), "hybrid retrieval only"),
    ] {
        let e = Retriever::parse(name, w).unwrap_err().to_string();
        assert!(e.contains(needle), "{name} {w:?}: {e}");
    }
}
