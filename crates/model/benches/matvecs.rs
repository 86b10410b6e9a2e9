//! The decode step's matrix products at mamba2-130m's shapes: B inputs through one weight
//! matrix, with the batch-invariant kernel (`matmul_rows_t`: each row gives what it gives alone)
//! and with `matmul_t` (gemm, or AMX tiles for bf16 where the CPU has them: faster per row, but
//! for f32 its bits depend on the batch). bf16 runs on this CPU's best kernel, and beside it on
//! `vdpbf16ps` alone where that is not the best.
//!
//!     cargo bench -p picaso-model --bench matvecs

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use picaso_model::cpu::matmul::{matmul_rows_t, matmul_t, Bf16Kernel, Matrix};
use picaso_model::cpu::{on_pool, WeightDtype};

fn bench(c: &mut Criterion) {
    // in_proj of mamba2-130m (768 → 3,352: z, x, B, C, dt) and out_proj (1,536 → 768); bf16
    // with this CPU's best kernel and with the widening one (CPUs without AVX512-BF16).
    let best = Bf16Kernel::detect();
    let mut cases = vec![
        ("in_proj", 768, 3352, WeightDtype::F32, best),
        ("out_proj", 1536, 768, WeightDtype::F32, best),
        ("in_proj", 768, 3352, WeightDtype::Bf16, best),
    ];
    if best == Bf16Kernel::Tiles || best == Bf16Kernel::DotFma {
        cases.push(("in_proj", 768, 3352, WeightDtype::Bf16, Bf16Kernel::Dot));
        cases.push(("out_proj", 1536, 768, WeightDtype::Bf16, best));
        cases.push(("out_proj", 1536, 768, WeightDtype::Bf16, Bf16Kernel::Dot));
    }
    if best != Bf16Kernel::Widen {
        cases.push(("in_proj", 768, 3352, WeightDtype::Bf16, Bf16Kernel::Widen));
    }
    for (name, k, n, dtype, kernel) in cases {
        let w = weights(n * k, 0);
        let matrix = Matrix::with_kernel(w, k, dtype, kernel);
        let label =
            if dtype == WeightDtype::Bf16 { format!("{dtype:?} {}", kernel.name()) } else { format!("{dtype:?}") };
        let mut group = c.benchmark_group(format!("{name} {label}"));
        for m in [1usize, 4, 16, 32, 64, 128, 256, 512] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) / 7.0).collect();
            let mut out = vec![0.0f32; m * n];
            group.throughput(Throughput::Elements(m as u64));
            group.bench_with_input(BenchmarkId::new("rows (batch-invariant)", m), &m, |b, &m| {
                b.iter(|| matmul_rows_t(&x, m, k, &matrix, n, &mut out, false))
            });
            group.bench_with_input(BenchmarkId::new("gemm", m), &m, |b, &m| {
                b.iter(|| matmul_t(&x, m, k, &matrix, n, &mut out, false))
            });
        }
        group.finish();
    }
    step_from_memory(c);
}

/// All of a decode step's products (24 layers' in_proj and out_proj, then the tied LM head,
/// 50,280 × 768) for B sequences. The weights (0.5 GB in f32) are read from memory as in a
/// real step, not from a cache a lone matrix would fit in.
fn step_from_memory(c: &mut Criterion) {
    let (d, width, di, vocab, layers) = (768, 3352, 1536, 50_280, 24);
    let best = Bf16Kernel::detect();
    // On AMX, the tiles and `vdpbf16ps` side by side (and where batches run on FMAs, those and
    // the instruction): a decode step of one sequence reads the weights once either way, a
    // batch shows what the faster kernel saves.
    let mut cases = vec![(WeightDtype::F32, best), (WeightDtype::Bf16, best)];
    if best == Bf16Kernel::Tiles || best == Bf16Kernel::DotFma {
        cases.push((WeightDtype::Bf16, Bf16Kernel::Dot));
    }
    for (dtype, kernel) in cases {
        let layer_mats: Vec<(Matrix, Matrix)> = (0..layers)
            .map(|l| {
                (
                    Matrix::with_kernel(weights(width * d, l), d, dtype, kernel),
                    Matrix::with_kernel(weights(d * di, l + 1), di, dtype, kernel),
                )
            })
            .collect();
        let head = Matrix::with_kernel(weights(vocab * d, 7), d, dtype, kernel);
        let label =
            if dtype == WeightDtype::Bf16 { format!("{dtype:?} {}", kernel.name()) } else { format!("{dtype:?}") };
        let mut group = c.benchmark_group(format!("decode step products {label}"));
        for m in [1usize, 4, 6, 8, 16, 32] {
            let x = weights(m * di, 3);
            let (mut zx, mut h, mut logits) = (vec![0.0f32; m * width], vec![0.0f32; m * d], vec![0.0f32; m * vocab]);
            group.throughput(Throughput::Elements(m as u64));
            group.bench_with_input(BenchmarkId::new("sequences", m), &m, |b, &m| {
                // On the pool, as the engine runs a pass: each product called from outside it
                // would wait for its threads to wake (two context switches each).
                b.iter(|| {
                    on_pool(|| {
                        for (in_proj, out_proj) in &layer_mats {
                            matmul_rows_t(&x[..m * d], m, d, in_proj, width, &mut zx, false);
                            matmul_rows_t(&x, m, di, out_proj, d, &mut h, true);
                        }
                        matmul_rows_t(&h, m, d, &head, vocab, &mut logits, false);
                    })
                })
            });
        }
        group.finish();
    }
}

/// One decode step's causal conv of mamba2-130m's 1,792 conv channels (d_conv 4), as every
/// layer of every sequence runs it.
fn conv_step(c: &mut Criterion) {
    let (ch, k) = (1792, 4);
    let (x, wt, bias) = (weights(ch, 1), weights(k * ch, 2), weights(ch, 3));
    let mut tail = weights(ch * (k - 1), 4);
    let mut out = vec![0.0f32; ch];
    c.bench_function("conv step 1792 channels", |b| {
        b.iter(|| picaso_model::cpu::conv::conv_step_silu(&x, &wt, &bias, k, &mut tail, &mut out))
    });
}

/// One head's selective scan at mamba2-130m's shapes (headdim 64, d_state 128), from a state
/// in cache: one token (a decode step) and 32 (a short prompt).
fn scan_head(c: &mut Criterion) {
    use picaso_model::cpu::scan::ScanInputs;
    let (p_dim, n_dim) = (64, 128);
    let stride = p_dim + 2 * n_dim;
    for t in [1, 32] {
        // No exact zeros in x or B: a state value fed nothing decays into subnormals, which
        // cost ~10x (a benchmark artefact; real inputs are not exactly 0 for thousands of tokens).
        let xbc: Vec<f32> = weights(t * stride, 5).iter().map(|v| v + 1e-3).collect();
        let (dt, decay) = (vec![0.05f32; t], vec![0.97f32; t]);
        let head = ScanInputs {
            xbc: &xbc,
            stride,
            x_off: 0,
            b_off: p_dim,
            c_off: p_dim + n_dim,
            p_dim,
            n_dim,
            dt: &dt,
            decay: &decay,
            d_skip: 0.5,
            from_memory: false,
        };
        let mut s = weights(p_dim * n_dim, 6);
        let mut y = vec![0.0f32; t * p_dim];
        c.bench_function(&format!("scan head 64x128, {t} tokens"), |b| {
            b.iter(|| picaso_model::cpu::scan::scan_head(&mut s, &head, &mut y))
        });
        if t == 1 {
            // A decode step on a state held as f16: in registers, and through an f32 copy.
            use picaso_model::cpu::scan::f16::{scan_head_f16, scan_head_f16_widened};
            let mut h: Vec<half::f16> = s.iter().map(|&v| half::f16::from_f32(v)).collect();
            c.bench_function("scan head 64x128 f16, 1 token", |b| b.iter(|| scan_head_f16(&mut h, &head, &mut y)));
            c.bench_function("scan head 64x128 f16 widened, 1 token", |b| {
                b.iter(|| scan_head_f16_widened(&mut h, &head, &mut y))
            });
        }
    }
}

/// All of a decode step's scans (24 layers × 24 heads of 64 × 128) for B sequences, f32 and f16
/// states, run as the engine runs them: sequences and heads in parallel, on the pool. The states
/// (18.9 MB per sequence in f32) are read from memory as in a real step, with and without
/// prefetching them ahead (`ScanInputs::from_memory`, which the engine sets for a batch whose
/// states outgrow the cache).
fn step_scans(c: &mut Criterion) {
    use picaso_model::cpu::scan::f16::scan_head_f16;
    use picaso_model::cpu::scan::{scan_head, ScanInputs};
    let (layers, heads, p_dim, n_dim) = (24, 24, 64, 128);
    let stride = heads * p_dim + 2 * n_dim;
    let xbc: Vec<f32> = weights(stride, 5).iter().map(|v| v + 1e-3).collect();
    let (dt, decay) = ([0.05f32], [0.97f32]);
    let head = |hd: usize, from_memory: bool| ScanInputs {
        xbc: &xbc,
        stride,
        x_off: hd * p_dim,
        b_off: heads * p_dim,
        c_off: heads * p_dim + n_dim,
        p_dim,
        n_dim,
        dt: &dt,
        decay: &decay,
        d_skip: 0.5,
        from_memory,
    };
    let len = heads * p_dim * n_dim;
    let mut group = c.benchmark_group("decode step scans");
    for b in [1usize, 16] {
        let mut f32s: Vec<Vec<f32>> = (0..layers * b).map(|i| weights(len, i)).collect();
        let mut f16s: Vec<Vec<half::f16>> =
            f32s.iter().map(|s| s.iter().map(|&v| half::f16::from_f32(v)).collect()).collect();
        let mut ys = vec![vec![0.0f32; heads * p_dim]; b];
        group.throughput(Throughput::Elements(b as u64));
        for pf in [false, true] {
            let how = if pf { ", prefetched" } else { "" };
            group.bench_with_input(BenchmarkId::new(format!("f32 states{how}, sequences"), b), &b, |bench, &b| {
                bench.iter(|| scans(&mut f32s, &mut ys, b, p_dim * n_dim, |hd, s, y| scan_head(s, &head(hd, pf), y)))
            });
            group.bench_with_input(BenchmarkId::new(format!("f16 states{how}, sequences"), b), &b, |bench, &b| {
                bench
                    .iter(|| scans(&mut f16s, &mut ys, b, p_dim * n_dim, |hd, s, y| scan_head_f16(s, &head(hd, pf), y)))
            });
        }
    }
    group.finish();
}

/// One decode step's scans of `b` sequences' states (`states`: layer after layer, `b` each, of
/// heads of `head_len` values), on the pool: sequences and heads in parallel, as the engine
/// runs them.
fn scans<S: Send>(
    states: &mut [Vec<S>],
    ys: &mut [Vec<f32>],
    b: usize,
    head_len: usize,
    scan: impl Fn(usize, &mut [S], &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    let heads = states[0].len() / head_len;
    let p_dim = ys[0].len() / heads;
    on_pool(|| {
        for layer in states.chunks_mut(b) {
            layer.par_iter_mut().zip(ys.par_iter_mut()).for_each(|(s, y)| {
                s.par_chunks_mut(head_len)
                    .zip(y.par_chunks_mut(p_dim))
                    .enumerate()
                    .for_each(|(hd, (s, y))| scan(hd, s, y))
            })
        }
    })
}

/// The peak rates of one core's multiply-add instructions, in registers (12 independent
/// chains, no memory): why batches run on FMAs where `vdpbf16ps` is slower
/// (`picaso_model::cpu::matmul::bf16_dot`). Throughput is in multiply-adds.
fn instruction_rates(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const CHAINS: usize = 12;
        const STEPS: usize = 100_000;
        #[target_feature(enable = "avx512f")]
        fn fma(x: f32) -> f32 {
            let (a, b) = (_mm512_set1_ps(x), _mm512_set1_ps(1.0 - x));
            let mut acc = [_mm512_setzero_ps(); CHAINS];
            for _ in 0..STEPS {
                for v in acc.iter_mut() {
                    *v = _mm512_fmadd_ps(a, b, *v);
                }
            }
            acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        fn fma_ymm(x: f32) -> f32 {
            let (a, b) = (_mm256_set1_ps(x), _mm256_set1_ps(1.0 - x));
            let mut acc = [_mm256_setzero_ps(); CHAINS];
            for _ in 0..STEPS {
                for v in acc.iter_mut() {
                    *v = _mm256_fmadd_ps(a, b, *v);
                }
            }
            let mut lanes = [0.0f32; 8];
            acc.iter()
                .map(|&v| {
                    // SAFETY: `lanes` holds eight f32.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
                    lanes.iter().sum::<f32>()
                })
                .sum()
        }
        #[target_feature(enable = "avx512f,avx512bf16")]
        fn dot(x: f32) -> f32 {
            let a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(x), _mm512_set1_ps(1.0 - x));
            let mut acc = [_mm512_setzero_ps(); CHAINS];
            for _ in 0..STEPS {
                for v in acc.iter_mut() {
                    *v = _mm512_dpbf16_ps(*v, a, a);
                }
            }
            acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
        }
        let mut group = c.benchmark_group("one core's multiply-adds");
        if std::arch::is_x86_feature_detected!("avx512f") {
            group.throughput(Throughput::Elements((STEPS * CHAINS * 16) as u64));
            // SAFETY: the CPU has AVX-512 F.
            group.bench_function("vfmadd231ps zmm (f32)", |b| b.iter(|| unsafe { fma(std::hint::black_box(0.5)) }));
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            group.throughput(Throughput::Elements((STEPS * CHAINS * 8) as u64));
            // SAFETY: the CPU has AVX2 and FMA.
            group.bench_function("vfmadd231ps ymm (f32)", |b| b.iter(|| unsafe { fma_ymm(std::hint::black_box(0.5)) }));
        }
        if picaso_model::cpu::matmul::bf16_dot::available() {
            group.throughput(Throughput::Elements((STEPS * CHAINS * 32) as u64));
            // SAFETY: the CPU has AVX512-BF16.
            group
                .bench_function("vdpbf16ps zmm (bf16 pairs)", |b| b.iter(|| unsafe { dot(std::hint::black_box(0.5)) }));
        }
        group.finish();
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = c;
}

/// Deterministic values in [-0.096, 0.096] (a period-97 ramp shifted by `salt`), so distinct
/// matrices differ while every run multiplies the same numbers.
fn weights(len: usize, salt: usize) -> Vec<f32> {
    (0..len).map(|i| (((i + salt) % 97) as f32 - 48.0) / 500.0).collect()
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = bench, conv_step, scan_head, step_scans, instruction_rates
}
criterion_main!(benches);
