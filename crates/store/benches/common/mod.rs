//! What the store's benchmarks share: a catalog filled with synthetic contexts.

use picaso_embed::l2_normalize;
use picaso_store::catalog::{Catalog, PostgresCatalog, Row};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Contexts in a benchmark catalog.
pub const N: usize = 100_000;
/// all-MiniLM-L6-v2's embedding dimension.
pub const DIM: usize = 384;
/// Contexts per document.
pub const PER_DOC: usize = 10;

/// An empty catalog of dimension [`DIM`] in a fresh schema of the PostgreSQL database
/// `PICASO_TEST_POSTGRES` names, or None when it is not set.
pub fn postgres() -> Option<PostgresCatalog> {
    let url = std::env::var("PICASO_TEST_POSTGRES").ok()?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let sep = if url.contains('?') { '&' } else { '?' };
    let pg = PostgresCatalog::connect(&format!("{url}{sep}options=-csearch_path%3Dbench_{nanos}%2Cpublic")).unwrap();
    pg.create(DIM, &[]).unwrap();
    Some(pg)
}

/// A random unit vector of dimension [`DIM`].
pub fn unit_vector(rng: &mut StdRng) -> Vec<f32> {
    let mut v: Vec<f32> = (0..DIM).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    l2_normalize(&mut v);
    v
}

/// Fills `catalog` with [`N`] contexts, [`PER_DOC`] per document (`doc{i / PER_DOC}`), random
/// unit embeddings (seed 7) and `metadata(i)` (JSON text) for context `i`, a thousand per insert.
pub fn fill(catalog: &dyn Catalog, metadata: impl Fn(usize) -> String) {
    let mut rng = StdRng::seed_from_u64(7);
    for start in (0..N).step_by(1000) {
        insert(catalog, start..start + 1000, None, &mut rng, &metadata);
    }
}

/// Inserts contexts `indices` as [`fill`] does; with `first_id`, context `i` gets id
/// `first_id + i` (to put back contexts a benchmark removed).
pub fn insert(
    catalog: &dyn Catalog,
    indices: impl Iterator<Item = usize>,
    first_id: Option<i64>,
    rng: &mut StdRng,
    metadata: impl Fn(usize) -> String,
) {
    let items: Vec<(usize, String, Vec<f32>, String)> =
        indices.map(|i| (i, format!("doc{}", i / PER_DOC), unit_vector(rng), metadata(i))).collect();
    let rows: Vec<Row<'_>> = items
        .iter()
        .map(|(i, doc, embedding, metadata)| Row {
            id: first_id.map(|first| first + *i as i64),
            doc,
            seg: (i % PER_DOC) as u32,
            text: "a paragraph",
            tokens: &[1, 2, 3],
            embedding,
            fingerprint: "f",
            state_file: "states/01/0123456789abcdef0123456789abcdef.safetensors",
            checksum: "0123456789abcdef0123456789abcdef",
            state_bytes: 10,
            created: 0,
            metadata,
        })
        .collect();
    catalog.insert(&rows, &mut || Ok(())).unwrap();
}
