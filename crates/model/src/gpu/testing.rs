//! What the GPU engines' tests share: the device under test, and comparisons with the CPU
//! engines.

use std::sync::Arc;

use super::Gpu;
use crate::state::State;

/// The device under test: the CPU emulator, or with `PICASO_TEST_GPU=cuda` (a `cuda` build
/// on a GPU machine, as `scripts/gpu_bench.sh` runs these tests) GPU 0.
pub(crate) fn test_gpu() -> Arc<dyn Gpu> {
    match std::env::var("PICASO_TEST_GPU").as_deref() {
        #[cfg(feature = "cuda")]
        Ok("cuda") => Arc::new(super::cuda::CudaGpu::new(0).expect("GPU 0 opens")),
        Ok(other) if other != "emulator" => {
            panic!("PICASO_TEST_GPU={other}: use emulator, or cuda in a build with --features cuda")
        }
        _ => Arc::new(super::emulator::Emulator::new().expect("the GPU emulator builds (needs a C++ compiler)")),
    }
}

/// `n` token ids below `vocab`, spread by `seed`.
pub(crate) fn tokens(n: usize, vocab: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % vocab as u32).collect()
}

/// Largest |a − b| / max(1, |b|).
pub(crate) fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

/// Every part of two states within `tol` ([`rel_diff`]): positions, each SSM layer's state,
/// conv tail and log-decay, each attention layer's keys and values.
pub(crate) fn assert_states_close(gpu: &State, cpu: &State, tol: f32, at: &str) {
    assert_eq!((gpu.position, gpu.n_tokens), (cpu.position, cpu.n_tokens), "{at}: positions");
    for (l, (g, c)) in gpu.layers.iter().zip(&cpu.layers).enumerate() {
        for (name, a, b) in
            [("ssm", &g.ssm, &c.ssm), ("conv", &g.conv, &c.conv), ("log_decay", &g.log_decay, &c.log_decay)]
        {
            let d = rel_diff(a, b);
            assert!(d <= tol, "{at}: layer {l} {name} differs by {d:e} (tolerance {tol:e})");
        }
    }
    assert_eq!(gpu.attention.len(), cpu.attention.len(), "{at}: attention layers");
    for (l, (g, c)) in gpu.attention.iter().zip(&cpu.attention).enumerate() {
        for (name, a, b) in [("keys", &g.keys, &c.keys), ("values", &g.values, &c.values)] {
            assert_eq!(a.len(), b.len(), "{at}: attention layer {l} holds another number of {name}");
            let d = rel_diff(a, b);
            assert!(d <= tol, "{at}: attention layer {l} {name} differ by {d:e} (tolerance {tol:e})");
        }
    }
}
