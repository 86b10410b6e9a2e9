//! Retrieval latency on a catalog of 100k contexts (embeddings of dimension 384,
//! all-MiniLM-L6-v2's): every context, within documents, and filtered by metadata (equality:
//! a quarter, 1/25th and 1/100th of the contexts match; a range, 1/5th; `$in`, half; `$prefix`
//! of the URL, 1/9th; `$elemMatch` of a list of 2 authors, 1/1000th; `$regex` of the title,
//! 1/1000th). On SQLite
//! a scoped search reads the scope's ids (the `(doc, seg)` index for documents, the in-memory
//! metadata columns for a filter) and ranks those rows of the in-memory index exactly; on PostgreSQL (when
//! `PICASO_TEST_POSTGRES` is set, as in the tests) one query ranks the rows its `doc = ANY` or
//! metadata condition keeps. Last, a folder store's first filter after opening, which reads its
//! metadata columns.
//!
//! `cargo bench -p picaso-store --bench scoped_search`

mod common;

use std::hint::black_box;
use std::time::Duration;

use common::{fill, unit_vector, DIM, PER_DOC};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use picaso_store::catalog::{Catalog, SqliteCatalog};
use picaso_store::{Filter, Scope};
use rand::rngs::StdRng;
use rand::SeedableRng;

const LANGS: [&str; 4] = ["en", "fr", "de", "es"];

fn filled(catalog: &dyn Catalog) {
    fill(catalog, |i| {
        serde_json::json!({
            "lang": LANGS[i % 4], "year": 2000 + (i / 4) % 25, "title": format!("Document {}", i / PER_DOC),
            "url": format!("https://example.org/{}", i / PER_DOC),
            "authors": [{"name": format!("a{}", (i / PER_DOC) % 1000), "role": "author"},
                        {"name": format!("a{}", (i / PER_DOC * 7 + 3) % 1000), "role": "editor"}],
        })
        .to_string()
    })
}

fn filter(v: serde_json::Value) -> Filter {
    Filter::new(v.as_object().unwrap()).unwrap()
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    let mut catalogs: Vec<(&str, Box<dyn Catalog>)> =
        vec![("sqlite_100k_x_384", Box::new(SqliteCatalog::create(tmp.path(), DIM, &[]).unwrap()))];
    if let Some(pg) = common::postgres() {
        catalogs.push(("postgres_100k_x_384", Box::new(pg)));
    }
    for (_, catalog) in &catalogs {
        filled(catalog.as_ref());
    }
    let query = unit_vector(&mut StdRng::seed_from_u64(11));
    let one_doc = vec!["doc4321".to_string()];
    let ten_docs: Vec<String> = (0..10).map(|i| format!("doc{}", 977 * i)).collect();
    let en = filter(serde_json::json!({"lang": "en"}));
    let year = filter(serde_json::json!({"year": 2024}));
    let both = filter(serde_json::json!({"lang": "en", "year": 2024}));
    let recent = filter(serde_json::json!({"year": {"$gte": 2020}}));
    let two_langs = filter(serde_json::json!({"lang": {"$in": ["fr", "de"]}}));
    // Documents 1, 10-19, 100-199 and 1000-1999.
    let prefix = filter(serde_json::json!({"url": {"$prefix": "https://example.org/1"}}));
    // Documents whose editor (the second author) is a7: 10 of them.
    let edited = filter(serde_json::json!({"authors": {"$elemMatch": {"name": "a7", "role": "editor"}}}));
    // Documents 10-19.
    let titled = filter(serde_json::json!({"title": {"$regex": "^Document 1[0-9]$"}}));
    let scopes: [(&str, Scope<'_>); 11] = [
        ("every context", Scope::all()),
        ("1 document", Scope::within(&one_doc)),
        ("10 documents", Scope::within(&ten_docs)),
        ("filter 1 key, 25k match", Scope::matching(&en)),
        ("filter 1 key, 4k match", Scope::matching(&year)),
        ("filter 2 keys, 1k match", Scope::matching(&both)),
        ("filter range, 20k match", Scope::matching(&recent)),
        ("filter $in, 50k match", Scope::matching(&two_langs)),
        ("filter $prefix, 11k match", Scope::matching(&prefix)),
        ("filter $elemMatch, 100 match", Scope::matching(&edited)),
        ("filter $regex, 100 match", Scope::matching(&titled)),
    ];
    for (backend, catalog) in &catalogs {
        let mut group = c.benchmark_group(*backend);
        group.sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
        for (name, scope) in scopes {
            assert_eq!(catalog.search(&query, 5, false, scope).unwrap().len(), 5, "{name}");
            group.bench_function(name, |b| {
                b.iter(|| black_box(catalog.search(black_box(&query), 5, false, scope).unwrap()))
            });
        }
        group.finish();
    }
    // A folder store reads its metadata columns at its first filter after opening (or after
    // another process commits), then keeps them.
    let mut group = c.benchmark_group("sqlite_100k_x_384");
    group.sample_size(10).warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(8));
    group.bench_function("first filter after opening", |b| {
        b.iter_batched_ref(
            || SqliteCatalog::open(tmp.path()).unwrap(),
            |catalog| black_box(catalog.search(&query, 5, false, Scope::matching(&en)).unwrap()),
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
