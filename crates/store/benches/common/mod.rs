//! What the store's benchmarks share: a catalog filled with synthetic contexts.

use picaso_embed::l2_normalize;
use picaso_store::catalog::{Catalog, Row};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Contexts in a benchmark catalog.
pub const N: usize = 100_000;
/// all-MiniLM-L6-v2's embedding dimension.
pub const DIM: usize = 384;
/// Contexts per document.
pub const PER_DOC: usize = 10;

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
        let items: Vec<(String, Vec<f32>, String)> = (start..start + 1000)
            .map(|i| (format!("doc{}", i / PER_DOC), unit_vector(&mut rng), metadata(i)))
            .collect();
        let rows: Vec<Row<'_>> = items
            .iter()
            .enumerate()
            .map(|(j, (doc, embedding, metadata))| Row {
                id: None,
                doc,
                seg: ((start + j) % PER_DOC) as u32,
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
}
