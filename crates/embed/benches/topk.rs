//! Exact top-k latency of `FlatIndex` over 100k random unit vectors of dimension 384
//! (all-MiniLM-L6-v2's), one query at a time and 16 queries per batch.
//!
//! `cargo bench -p picaso-embed --bench topk`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use picaso_embed::{l2_normalize, FlatIndex, VectorIndex};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const N: usize = 100_000;
const DIM: usize = 384;

fn unit_vectors(n: usize, rng: &mut StdRng) -> Vec<f32> {
    let mut data: Vec<f32> = (0..n * DIM).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    for row in data.chunks_exact_mut(DIM) {
        l2_normalize(row);
    }
    data
}

fn bench(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(7);
    let index = FlatIndex::from_flat(DIM, unit_vectors(N, &mut rng)).unwrap();
    let queries = unit_vectors(16, &mut rng);
    let mut group = c.benchmark_group("flat_100k_x_384");
    group.sample_size(30).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    for k in [10, 100] {
        group.throughput(Throughput::Elements(1));
        let mut q = queries.chunks_exact(DIM).cycle();
        group.bench_with_input(BenchmarkId::new("search", k), &k, |b, &k| {
            b.iter(|| black_box(index.search(black_box(q.next().unwrap()), k).unwrap()))
        });
    }
    group.throughput(Throughput::Elements(16));
    group.bench_function("search_batch_16/10", |b| {
        b.iter(|| black_box(index.search_batch(black_box(&queries), 10).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
