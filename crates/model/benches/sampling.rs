//! Picking the next token from mamba2-130m's 50,280 logits, which every decode step does for
//! every sequence besides the forward pass: greedy (the benchmarks' and most servers' choice)
//! and temperature sampling with nucleus.
//!
//!     cargo bench -p picaso-model --bench sampling

use criterion::{criterion_group, criterion_main, Criterion};
use picaso_model::generate::sample;
use picaso_model::GenerateOptions;
use rand::{rngs::StdRng, SeedableRng};

fn bench(c: &mut Criterion) {
    let vocab = 50_280;
    // Deterministic, spread-out logits with the maximum late in the vocabulary.
    let logits: Vec<f32> = (0..vocab).map(|i| ((i * 7919) % 10_007) as f32 / 1000.0 - 5.0).collect();
    let mut rng = StdRng::seed_from_u64(0);
    let greedy = GenerateOptions::default();
    c.bench_function("greedy pick, 50280 logits", |b| {
        b.iter(|| sample(std::hint::black_box(&logits), vocab, &greedy, &mut rng))
    });
    let plain = GenerateOptions { temperature: 0.8, ..GenerateOptions::default() };
    c.bench_function("temperature 0.8, 50280 logits", |b| {
        b.iter(|| sample(std::hint::black_box(&logits), vocab, &plain, &mut rng))
    });
    let nucleus = GenerateOptions { temperature: 0.8, top_p: 0.9, ..GenerateOptions::default() };
    c.bench_function("temperature 0.8, top-p 0.9, 50280 logits", |b| {
        b.iter(|| sample(std::hint::black_box(&logits), vocab, &nucleus, &mut rng))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
