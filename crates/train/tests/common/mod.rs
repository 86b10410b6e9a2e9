//! What the training tests share: random tokens, central differences, a small fine-tuning set.
#![allow(dead_code)] // each test binary uses its own subset

use candle_core::{Device, Tensor, Var};
use picaso_model::Model;
use picaso_train::compose::{ContextItem, ContextState, Dataset, Example};
use rand::{Rng, SeedableRng};

/// `n` tokens below `vocab`, seeded.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// d loss / d element `i` of `var` (f64) by central differences.
pub fn numeric_grad(var: &Var, i: usize, loss: &dyn Fn() -> f64) -> f64 {
    let orig = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let eps = 1e-6 * orig[i].abs().max(1.0);
    let eval = |x: f64| {
        let mut v = orig.clone();
        v[i] = x;
        var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
        loss()
    };
    let (up, down) = (eval(orig[i] + eps), eval(orig[i] - eps));
    var.set(&Tensor::from_vec(orig, var.shape(), &Device::Cpu).unwrap()).unwrap();
    (up - down) / (2.0 * eps)
}

/// Autograd gradients against central differences at random elements.
pub struct GradCheck {
    rng: rand::rngs::StdRng,
    /// Elements checked so far.
    pub checked: usize,
}

impl GradCheck {
    pub fn new(seed: u64) -> Self {
        Self { rng: rand::rngs::StdRng::seed_from_u64(seed), checked: 0 }
    }

    /// Checks `picks` random elements of `var`'s gradient in `grads` against central
    /// differences of `loss`, to 1e-5 relative (absolute below 1e-3).
    pub fn check(
        &mut self,
        name: &str,
        var: &Var,
        grads: &candle_core::backprop::GradStore,
        picks: usize,
        loss: &dyn Fn() -> f64,
    ) {
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("{name}: no gradient"))
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        for _ in 0..picks {
            let i = self.rng.random_range(0..g.len());
            let num = numeric_grad(var, i, loss);
            let err = (g[i] - num).abs() / num.abs().max(1e-3);
            assert!(err < 1e-5, "{name}[{i}]: autograd {} vs finite differences {num} (rel {err:e})", g[i]);
            self.checked += 1;
        }
    }
}

/// Ten short contexts (states from `m`, vocabulary 48) and 12 training + 3 validation examples
/// of three contexts each.
pub fn dataset(m: &Model) -> Dataset {
    let contexts: Vec<ContextItem> = (0..10)
        .map(|i| {
            let t = tokens(4 + i % 5, 48, 100 + i as u64);
            let state = m.prefill(&t, &m.zero_state()).unwrap();
            ContextItem { tokens: t, state: ContextState::Held(Box::new(state)) }
        })
        .collect();
    let example = |i: u64| Example {
        contexts: vec![(i % 10) as usize, ((i + 3) % 10) as usize, ((i + 7) % 10) as usize],
        query: tokens(5, 48, 200 + i),
        continuation: tokens(4 + (i % 3) as usize, 48, 300 + i),
    };
    let (train, val) = ((0..12).map(example).collect(), (12..15).map(example).collect());
    Dataset { source: "generated examples".into(), contexts, train, val }
}
