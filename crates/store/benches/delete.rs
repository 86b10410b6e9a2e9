//! Removing contexts from a store of 100k contexts (embeddings of dimension 384): a hundred one
//! at a time, as `Catalog::delete` does each, against a hundred and ten thousand at once
//! (`Catalog::delete_many`). On SQLite (the folder store) each sample removes from a fresh copy
//! of the store, opened before the clock starts; `delete_many` is one transaction and one pass
//! over the in-memory index. On PostgreSQL (when `PICASO_TEST_POSTGRES` is set, as in the tests)
//! the contexts removed are put back, under their ids, before each sample; `delete_many` is a
//! transaction per 256 contexts. Every context of the bench shares one state object, so none
//! is removed there. The objects' removal is timed on its own where `PICASO_TEST_S3` names a
//! bucket: a thousand objects, a request each (`StateObjects::delete`) against S3's
//! DeleteObjects (`StateObjects::delete_many`, what a delete of many contexts calls).
//!
//! `cargo bench -p picaso-store --bench delete`

mod common;

use std::path::Path;
use std::time::Duration;

use common::{fill, insert, N};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use picaso_store::catalog::{Catalog, SqliteCatalog};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn metadata(i: usize) -> String {
    format!(r#"{{"n": {}}}"#, i % 7)
}

fn filled(dir: &Path) {
    fill(&SqliteCatalog::create(dir, common::DIM, &[]).unwrap(), metadata);
}

/// Puts back those of `ids` that are gone from a catalog [`fill`] filled from id 1.
fn put_back(catalog: &dyn Catalog, ids: &[i64]) {
    let here = catalog.exist(ids).unwrap();
    let gone: Vec<usize> = ids.iter().zip(here).filter(|(_, here)| !here).map(|(&id, _)| id as usize - 1).collect();
    let mut rng = StdRng::seed_from_u64(8);
    for chunk in gone.chunks(1000) {
        insert(catalog, chunk.iter().copied(), Some(1), &mut rng, metadata);
    }
}

/// A fresh copy of the store in `original`, opened.
fn copy_of(original: &Path) -> (tempfile::TempDir, SqliteCatalog) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(original.join("store.sqlite"), dir.path().join("store.sqlite")).unwrap();
    let catalog = SqliteCatalog::open(dir.path()).unwrap();
    (dir, catalog)
}

fn bench(c: &mut Criterion) {
    let original = tempfile::tempdir().unwrap();
    filled(original.path()); // closed: the WAL is checkpointed into store.sqlite
    let ids = |n: usize| -> Vec<i64> { (0..n).map(|i| (1 + i * (N / n)) as i64).collect() };
    let (hundred, ten_thousand) = (ids(100), ids(10_000));
    let mut group = c.benchmark_group("sqlite_100k_x_384");
    group.sample_size(10).warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(20));
    group.bench_function("delete 100, one at a time", |b| {
        b.iter_batched_ref(
            || copy_of(original.path()),
            |(_, catalog)| {
                for &id in &hundred {
                    catalog.delete(id, &mut |_| Ok(())).unwrap();
                }
            },
            BatchSize::PerIteration,
        )
    });
    group.bench_function("delete 100 at once", |b| {
        b.iter_batched_ref(
            || copy_of(original.path()),
            |(_, catalog)| assert_eq!(catalog.delete_many(&hundred, &mut |_| Ok(())).unwrap().len(), 100),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("delete 10,000 at once", |b| {
        b.iter_batched_ref(
            || copy_of(original.path()),
            |(_, catalog)| assert_eq!(catalog.delete_many(&ten_thousand, &mut |_| Ok(())).unwrap().len(), 10_000),
            BatchSize::PerIteration,
        )
    });
    group.finish();
    objects(c);
    let Some(pg) = common::postgres() else { return };
    fill(&pg, metadata);
    let mut group = c.benchmark_group("postgres_100k_x_384");
    group.sample_size(10).warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(20));
    group.bench_function("delete 100, one at a time", |b| {
        b.iter_batched(
            || put_back(&pg, &ten_thousand),
            |()| {
                for &id in &hundred {
                    pg.delete(id, &mut |_| Ok(())).unwrap();
                }
            },
            BatchSize::PerIteration,
        )
    });
    group.bench_function("delete 100 at once", |b| {
        b.iter_batched(
            || put_back(&pg, &ten_thousand),
            |()| assert_eq!(pg.delete_many(&hundred, &mut |_| Ok(())).unwrap().len(), 100),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("delete 10,000 at once", |b| {
        b.iter_batched(
            || put_back(&pg, &ten_thousand),
            |()| assert_eq!(pg.delete_many(&ten_thousand, &mut |_| Ok(())).unwrap().len(), 10_000),
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// A thousand state objects removed from S3, one request each and together.
fn objects(c: &mut Criterion) {
    let Ok(s3) = std::env::var("PICASO_TEST_S3") else { return };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let url = format!("{}/bench-delete-{}-{nanos}", s3.trim_end_matches('/'), std::process::id());
    let at = picaso_store::Location::parse("unused", Some(&url)).unwrap();
    let objects = picaso_store::states::open(&at.states.unwrap()).unwrap();
    let bodies: Vec<Vec<u8>> = (0..1_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
    let keys: Vec<String> = bodies.iter().map(|b| picaso_store::states::key_of(&picaso_store::checksum(b))).collect();
    let put_all = || {
        std::thread::scope(|s| {
            for part in 0..8 {
                let (objects, keys, bodies) = (&objects, &keys, &bodies);
                s.spawn(move || (part..keys.len()).step_by(8).for_each(|i| objects.put(&keys[i], &bodies[i]).unwrap()));
            }
        })
    };
    let mut group = c.benchmark_group("s3_state_objects");
    group.sample_size(10).warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(20));
    group.bench_function("remove 1,000, a request each", |b| {
        b.iter_batched(put_all, |()| keys.iter().for_each(|k| objects.delete(k).unwrap()), BatchSize::PerIteration)
    });
    group.bench_function("remove 1,000 together", |b| {
        b.iter_batched(put_all, |()| objects.delete_many(&keys).unwrap(), BatchSize::PerIteration)
    });
    group.finish();
    assert!(objects.keys().unwrap().is_empty());
}

criterion_group!(benches, bench);
criterion_main!(benches);
