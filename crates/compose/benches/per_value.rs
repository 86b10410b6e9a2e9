//! Composition when every state value has its own decay (Mamba-1), at mamba-130m's size: 10
//! states of 24 layers × 1536 channels × 16 state entries (590 k values and as many log-decays
//! each). Side by side in one run: reading every input once (the memory floor), the two-pass
//! path (per-element weights stored, then the weighted sum) and the fused one
//! ([`compose_per_value`]: weights computed in lanes and applied at once).
//!
//! `cargo bench -p picaso-compose --bench per_value`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use picaso_compose::{compose_per_value, lane_sum, weighted_sum_blocks, weights_per_element, Composition};
use rayon::prelude::*;

const N: usize = 10;
const LAYERS: usize = 24;
const VALUES: usize = 1536 * 16;

/// Deterministic pseudo-random values in [lo, hi).
fn values(seed: u64, len: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// Layer `l` of every context.
fn layer(x: &[Vec<Vec<f32>>], l: usize) -> Vec<&[f32]> {
    x.iter().map(|c| &c[l][..]).collect()
}

fn bench(c: &mut Criterion) {
    // Per context and layer: SSM values and log-decays (a spread like a real context's: some
    // entries forget everything, some keep nearly all).
    let ssm: Vec<Vec<Vec<f32>>> =
        (0..N).map(|i| (0..LAYERS).map(|l| values((i * LAYERS + l) as u64, VALUES, -1.0, 1.0)).collect()).collect();
    let ld: Vec<Vec<Vec<f32>>> = (0..N)
        .map(|i| (0..LAYERS).map(|l| values(1000 + (i * LAYERS + l) as u64, VALUES, -30.0, 0.0)).collect())
        .collect();
    let mut out = vec![vec![0.0f32; VALUES]; LAYERS];
    let mut ld_out = vec![vec![0.0f32; VALUES]; LAYERS];

    let mut group = c.benchmark_group("mamba1_130m_compose_10");
    group.sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    group.bench_function("read_inputs_once", |b| {
        let arrays: Vec<&[f32]> = ssm.iter().chain(&ld).flat_map(|c| c.iter().map(|v| &v[..])).collect();
        b.iter(|| black_box(arrays.par_iter().flat_map(|a| a.par_chunks(16 * 1024)).map(lane_sum).sum::<f32>()))
    });
    for method in [Composition::Soup, Composition::Caso, Composition::PicasoS, Composition::PicasoR] {
        group.bench_with_input(BenchmarkId::new("two_pass", method.name()), &method, |b, &m| {
            b.iter(|| {
                out.par_iter_mut().zip(&mut ld_out).enumerate().for_each(|(l, (o, lo))| {
                    let (x, d) = (layer(&ssm, l), layer(&ld, l));
                    let w = weights_per_element(m, &d).unwrap();
                    weighted_sum_blocks(&x, &w, 1, o).unwrap();
                    for (e, v) in lo.iter_mut().enumerate() {
                        *v = d.iter().map(|c| c[e] as f64).sum::<f64>() as f32;
                    }
                });
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("fused", method.name()), &method, |b, &m| {
            b.iter(|| {
                out.par_iter_mut().zip(&mut ld_out).enumerate().for_each(|(l, (o, lo))| {
                    compose_per_value(m, &layer(&ld, l), &layer(&ssm, l), o, lo).unwrap();
                });
                black_box(&out);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
