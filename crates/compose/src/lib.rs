//! # picaso-compose
//!
//! The arithmetic of composing SSM states, with no model attached. For a diagonal SSM the state
//! after a concatenation u₁⋯uₙ is x = Σᵢ (Πⱼ>ᵢ Aⱼ) xᵢ where xᵢ is the state of uᵢ alone and Aⱼ
//! the total decay of uⱼ (PICASO, Proposition 1). Every method here is such a weighted sum
//! x = Σᵢ wᵢ xᵢ; they differ only in the weights:
//!
//! | method | weight of context k (decays A₁..Aₙ in the given order) |
//! |---|---|
//! | soup | 1/n |
//! | caso | Πⱼ>ₖ Aⱼ (the order matters) |
//! | picaso-s | (1/n) Σₘ eₘ(A without k) / C(n-1, m): the mean of CASO over all n! orders |
//! | picaso-r | (1/n) Σₘ Πⱼ₌₁..ₘ A₍ₖ₊ⱼ₎ mod n: the mean of CASO over the n rotations |
//!
//! A "decay element" is whatever shares one scalar decay: a (layer, head) for Mamba-2, a
//! (layer, channel, state) entry for Mamba-1. [`weights`] works on one element's n log-decays;
//! [`weights_per_element`] on many; [`weighted_sum_blocks`] applies per-element weights to
//! states laid out as blocks of equal size, one block per decay element. When every value has
//! its own decay (Mamba-1), [`compose_per_value`] computes the weights and applies them in one
//! pass, never storing them.
//!
//! Numerics: weights are computed in f64 from log-decays (≤ 0), only ever adding non-negative
//! terms, so decays that underflow to 0 (log-decay −1e4) and n up to hundreds give exact,
//! finite results. The paper's PICASO-R pseudo-code divides by cumulative products, which
//! underflow to 0; here PICASO-R uses the rotation recurrence R(k-1) = 1 − P + A(k)·R(k)
//! (P = product of all decays) and PICASO-S a prefix/suffix pairing of polynomial coefficients.
//!
//! ```
//! use picaso_compose::{weights, Composition};
//! let w = weights(Composition::Caso, &[(0.5f64).ln(), (0.25f64).ln()]).unwrap();
//! assert!((w[0] - 0.25).abs() < 1e-15 && w[1] == 1.0);
//! ```
#![deny(missing_docs)]

pub mod codec;
mod compressed;
mod elementwise;
mod method;
mod simd;

use rayon::prelude::*;

pub use codec::{Codec, Values};
pub use compressed::{mean_values, weighted_sum_values};
pub use elementwise::{compose_per_value, compose_per_value_values};
pub use method::{Composition, Method, UnknownMethod};
pub use simd::prefetch_l2;

/// Errors of bad composition input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Nothing to compose.
    #[error("no contexts to compose: give at least one")]
    Empty,
    /// A log-decay is NaN or positive (decays must lie in [0, 1]).
    #[error("log-decay {value:?} of context {context} is not a number <= 0 (decays must lie in [0, 1])")]
    BadLogDecay {
        /// Index of the context.
        context: usize,
        /// The offending value.
        value: f64,
    },
    /// Inputs of different sizes.
    #[error("{0}")]
    Shape(String),
    /// An input holds NaN or infinity (found because the weighted sum came out non-finite).
    #[error("an input holds a non-finite value (NaN or infinity)")]
    NonFinite,
    /// An order that is not a permutation of 0..n.
    #[error("order {order:?} is not a permutation of 0..{n}")]
    BadOrder {
        /// The order given.
        order: Vec<usize>,
        /// Number of contexts.
        n: usize,
    },
}

/// Checks that `order` is a permutation of 0..n.
pub fn check_order(order: &[usize], n: usize) -> Result<(), Error> {
    let mut seen = vec![false; n];
    let ok = order.len() == n && order.iter().all(|&i| i < n && !std::mem::replace(&mut seen[i], true));
    if ok {
        Ok(())
    } else {
        Err(Error::BadOrder { order: order.to_vec(), n })
    }
}

fn check_log_decays(log_decays: &[f64]) -> Result<(), Error> {
    if log_decays.is_empty() {
        return Err(Error::Empty);
    }
    match log_decays.iter().position(|v| v.is_nan() || *v > 0.0) {
        Some(context) => Err(Error::BadLogDecay { context, value: log_decays[context] }),
        None => Ok(()),
    }
}

/// Weights of the n contexts (in the given order) for one decay element.
pub fn weights(method: Composition, log_decays: &[f64]) -> Result<Vec<f64>, Error> {
    check_log_decays(log_decays)?;
    let mut out = vec![0.0; log_decays.len()];
    let mut scratch = Scratch::default();
    weights_into(method, log_decays, &mut out, &mut scratch);
    Ok(out)
}

/// Reusable buffers for [`weights_into`], so per-element calls do not allocate.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    decays: Vec<f64>,
    prefix: Vec<f64>,
    suffix: Vec<f64>,
}

/// Like [`weights`] without validation or allocation (inputs must be valid log-decays ≤ 0).
pub fn weights_into(method: Composition, log_decays: &[f64], out: &mut [f64], s: &mut Scratch) {
    let n = log_decays.len();
    debug_assert_eq!(out.len(), n);
    match method {
        Composition::Soup => out.fill(1.0 / n as f64),
        Composition::Caso => {
            // w_k = exp(Σ_{j>k} a_j): a suffix sum, exact in log space.
            let mut suffix = 0.0f64;
            for k in (0..n).rev() {
                out[k] = suffix.exp();
                suffix += log_decays[k];
            }
        }
        Composition::PicasoR => picaso_r(log_decays, out, s),
        Composition::PicasoS => picaso_s(log_decays, out, s),
    }
}

/// PICASO-R: R_k = Σ_{m=0}^{n-1} Π_{j=1}^{m} A_{(k+j) mod n}, w_k = R_k / n.
///
/// R_{n-1} by Horner (all terms ≥ 0); then R_{k-1} = 1 − P + A_k·R_k walks backwards, where
/// P = Π A. A_k·R_k contains the term P exactly once, so the update only drops that term;
/// errors stay absolute O(n·ε) against R ≥ 1, and nothing is ever divided.
fn picaso_r(log_decays: &[f64], out: &mut [f64], s: &mut Scratch) {
    let n = log_decays.len();
    s.decays.clear();
    s.decays.extend(log_decays.iter().map(|a| a.exp()));
    let a = &s.decays;
    let total: f64 = log_decays.iter().sum::<f64>().exp();
    // R_{n-1} = 1 + A_0 (1 + A_1 (1 + ... (1 + A_{n-2}))).
    let mut r = 1.0;
    for k in (0..n - 1).rev() {
        r = 1.0 + a[k] * r;
    }
    out[n - 1] = r;
    for k in (1..n).rev() {
        // Clamp at the exact lower bound 1 to absorb the rounding of `a_k r - total`.
        r = (1.0 - total + a[k] * r).max(1.0);
        out[k - 1] = r;
    }
    let inv = 1.0 / n as f64;
    out.iter_mut().for_each(|w| *w *= inv);
}

/// PICASO-S: the mean of CASO's weights over all n! orders,
/// w_k = (1/n) Σ_m e_m(A without k) / C(n-1, m), with e_m the elementary symmetric polynomials.
///
/// e(A without k) is the coefficient vector of L_k(t)·R_k(t), L_k = Π_{j<k}(1 + A_j t) and
/// R_k = Π_{j>k}(1 + A_j t). Instead of multiplying the polynomials (O(n²) per k), note
/// w_k = Σ_i L_k[i] · h_k[i] with h_k[i] = Σ_j R_k[j] c[i+j], c_m = 1 / (n C(n-1, m)), and
/// h_k = h_{k+1} + A_{k+1}·shift(h_{k+1}). So the L_k are built forwards and the h_k
/// backwards, O(n) each, O(n²) in all.
///
/// Both are kept normalised, or they leave f64's range from n ≈ 1,030 on (L_k[i] grows like
/// C(k, i) and c_m shrinks like its inverse: inf · 0 gave NaN weights): L̃_k[i] = L_k[i] / C(k, i)
/// is the mean product of i of the first k decays and g_k[i] = C(k, i)·h_k[i] ≤ 1, and their
/// recurrences mix neighbours with weights that add up to one. Every number stays in [0, 1]
/// and only non-negative numbers are added.
fn picaso_s(log_decays: &[f64], out: &mut [f64], s: &mut Scratch) {
    let n = log_decays.len();
    s.decays.clear();
    s.decays.extend(log_decays.iter().map(|a| a.exp()));
    // prefix holds L̃_0..L̃_{n-1} as a triangle: L̃_k occupies k+1 entries starting at k(k+1)/2.
    // L̃_k[i] = ((k − i) L̃_{k−1}[i] + i A_{k−1} L̃_{k−1}[i−1]) / k.
    s.prefix.clear();
    s.prefix.push(1.0);
    for k in 1..n {
        let start = (k - 1) * k / 2;
        let (a, inv) = (s.decays[k - 1], 1.0 / k as f64);
        for i in 0..=k {
            let prev = if i < k { s.prefix[start + i] } else { 0.0 };
            let shifted = if i > 0 { s.prefix[start + i - 1] } else { 0.0 };
            s.prefix.push(((k - i) as f64 * inv) * prev + (i as f64 * inv) * a * shifted);
        }
    }
    // g_{n-1}[i] = C(n-1, i) c_i = 1/n; walking k downwards,
    // g_k[i] = ((k + 1 − i) g_{k+1}[i] + (i + 1) A_{k+1} g_{k+1}[i+1]) / (k + 1) for i ≤ k.
    s.suffix.clear();
    s.suffix.resize(n, 1.0 / n as f64);
    for k in (0..n).rev() {
        if k < n - 1 {
            let (a, inv) = (s.decays[k + 1], 1.0 / (k + 1) as f64);
            for i in 0..=k {
                s.suffix[i] = ((k + 1 - i) as f64 * inv) * s.suffix[i] + ((i + 1) as f64 * inv) * a * s.suffix[i + 1];
            }
        }
        let l = &s.prefix[k * (k + 1) / 2..k * (k + 1) / 2 + k + 1];
        out[k] = l.iter().zip(&s.suffix).map(|(x, y)| x * y).sum();
    }
}

/// Weights below this are applied as 0: every composition has a term of weight ≥ 1/n (CASO's
/// last context has weight 1), so a term 2⁻¹⁰⁰ times smaller is below f32 resolution of the sum;
/// and multiplying by such weights makes subnormal floats, which run ~50× slower on x86.
pub const TINY_WEIGHT: f64 = 7.888609052210118e-31; // 2^-100

fn flush_tiny(w: f64) -> f32 {
    if w < TINY_WEIGHT {
        0.0
    } else {
        w as f32
    }
}

/// Weights for many decay elements at once (as f32; weights below [`TINY_WEIGHT`] become 0).
///
/// `log_decays[i][e]` is the log-decay of element `e` in context `i` (contexts in the given
/// order). Returns `w[e * n + i]`: element-major, contexts contiguous, as f32 ready for
/// [`weighted_sum_blocks`].
pub fn weights_per_element(method: Composition, log_decays: &[&[f32]]) -> Result<Vec<f32>, Error> {
    let n = log_decays.len();
    if n == 0 {
        return Err(Error::Empty);
    }
    let elements = log_decays[0].len();
    if let Some(i) = log_decays.iter().position(|l| l.len() != elements) {
        return Err(Error::Shape(format!(
            "context {i} has {} decay elements, context 0 has {elements}",
            log_decays[i].len()
        )));
    }
    for (i, l) in log_decays.iter().enumerate() {
        if let Some(v) = l.iter().find(|v| v.is_nan() || **v > 0.0) {
            return Err(Error::BadLogDecay { context: i, value: *v as f64 });
        }
    }
    let mut out = vec![0.0f32; elements * n];
    out.par_chunks_mut(n * 64).enumerate().for_each(|(chunk, o)| {
        let mut scratch = Scratch::default();
        let mut ld = vec![0.0f64; n];
        let mut w = vec![0.0f64; n];
        for (j, oe) in o.chunks_mut(n).enumerate() {
            let e = chunk * 64 + j;
            for (i, l) in log_decays.iter().enumerate() {
                ld[i] = l[e] as f64;
            }
            weights_into(method, &ld, &mut w, &mut scratch);
            for (dst, src) in oe.iter_mut().zip(&w) {
                *dst = flush_tiny(*src);
            }
        }
    });
    Ok(out)
}

/// out[e·block + j] = Σᵢ w[e·n + i] · inputs[i][e·block + j]: a weighted sum of n equally
/// sized arrays where each block of `block` values has its own weights. Multi-threaded; one
/// pass over the inputs, so it runs at memory bandwidth. Weights must be finite; a NaN or
/// infinity in any input makes the output non-finite (even under a zero weight), which is
/// checked while the output is still in cache and reported as [`Error::NonFinite`].
pub fn weighted_sum_blocks(inputs: &[&[f32]], w: &[f32], block: usize, out: &mut [f32]) -> Result<(), Error> {
    let n = inputs.len();
    check_weighted_sum(inputs.iter().map(|x| x.len()), w.len(), block, out.len())?;
    // Tasks of ~64 KiB of output: enough to amortise scheduling, small enough to balance.
    let per_task = (16 * 1024 / block).max(1) * block;
    let finite = out.par_chunks_mut(per_task).enumerate().map(|(t, o)| {
        let base = t * per_task;
        let mut finite = true;
        for (b, ob) in o.chunks_mut(block).enumerate() {
            let e = (base / block) + b;
            let we = &w[e * n..(e + 1) * n];
            let off = base + b * block;
            finite &= accumulate_block(inputs, we, off, ob);
        }
        finite
    });
    if finite.all(|f| f) {
        Ok(())
    } else {
        Err(Error::NonFinite)
    }
}

/// Refuses a weighted sum whose sizes do not fit: no input, an output that is not whole
/// blocks, an input of another length, or not one weight per (block, input).
pub(crate) fn check_weighted_sum(
    input_lens: impl ExactSizeIterator<Item = usize>,
    weights: usize,
    block: usize,
    out: usize,
) -> Result<(), Error> {
    let n = input_lens.len();
    if n == 0 {
        return Err(Error::Empty);
    }
    if block == 0 || !out.is_multiple_of(block) {
        return Err(Error::Shape(format!("output of {out} values is not a whole number of blocks of {block}")));
    }
    for (i, len) in input_lens.enumerate() {
        if len != out {
            return Err(Error::Shape(format!("input {i} has {len} values, expected {out}")));
        }
    }
    if weights != (out / block) * n {
        return Err(Error::Shape(format!("{weights} weights for {} blocks of {n} inputs", out / block)));
    }
    Ok(())
}

/// ob = Σᵢ we[i] · inputs[i][off .. off + ob.len()], streamed in cache-sized pieces.
/// Returns whether every output value is finite.
fn accumulate_block(inputs: &[&[f32]], we: &[f32], off: usize, ob: &mut [f32]) -> bool {
    const PIECE: usize = 2048;
    let mut finite = true;
    for (p, op) in ob.chunks_mut(PIECE).enumerate() {
        let start = off + p * PIECE;
        let first = &inputs[0][start..start + op.len()];
        for (o, x) in op.iter_mut().zip(first) {
            *o = we[0] * x;
        }
        for (inp, &wi) in inputs.iter().zip(we).skip(1) {
            let x = &inp[start..start + op.len()];
            for (o, v) in op.iter_mut().zip(x) {
                *o += wi * v;
            }
        }
        finite &= all_finite(op);
    }
    finite
}

/// Whether every value is finite, without a branch per value: Σ 0·x is 0 when they all are
/// and NaN otherwise (0·∞ is NaN), and unlike Σ x it cannot overflow.
pub(crate) fn all_finite(x: &[f32]) -> bool {
    let mut lanes = [0.0f32; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for i in 0..16 {
            lanes[i] += 0.0 * c[i];
        }
    }
    lanes.iter().chain(it.remainder()).fold(0.0f32, |a, v| a + 0.0 * v) == 0.0
}

/// Σ x with sixteen independent accumulators, so it vectorises (a plain f32 sum cannot).
pub fn lane_sum(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let mut it = x.chunks_exact(16);
    for c in &mut it {
        for i in 0..16 {
            lanes[i] += c[i];
        }
    }
    lanes.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

/// Elementwise mean of equally sized arrays (conv tails are averaged for every method).
pub fn mean(inputs: &[&[f32]], out: &mut [f32]) -> Result<(), Error> {
    let inputs: Vec<Values<'_>> = inputs.iter().map(|x| Values::F32(x)).collect();
    mean_values(&inputs, out)
}
