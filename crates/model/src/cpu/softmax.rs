//! Log-softmax at a target, the scoring loop's inner step.

use picaso_compose::simd_fn;

use super::activations::exp;
use super::LANES;

/// log-softmax of `logits` evaluated at `target`: `logits[target] - logsumexp(logits)`, the
/// largest logit taken out first. The exponentials are [`exp`]'s (within 4·10⁻⁷ relative) summed
/// in f64, so the result is within 4·10⁻⁷ nats of an f64 exp per logit — under one ulp of the f32
/// it returns for any log-prob below −4 — at a tenth of the time (one libm call per vocabulary
/// entry and scored token was a fifth of scoring's time).
pub fn log_softmax_at(logits: &[f32], target: usize) -> f32 {
    let max = max_ignoring_nan(logits);
    ((logits[target] - max) as f64 - sum_exp_below(logits, max).ln()) as f32
}

simd_fn! {
    /// The largest value, ignoring NaN (−∞ when there is none).
    pub fn max_ignoring_nan(v: &[f32]) -> f32 {
        let pick = |m: f32, x: f32| if x > m { x } else { m };
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let chunks = v.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for (m, &x) in lanes.iter_mut().zip(chunk) {
                *m = pick(*m, x);
            }
        }
        lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &x| pick(m, x))
    }
}

simd_fn! {
    /// Σ e^(v[i] − max) in f64, for a `max` at least every value: [`exp`] in f32, 16 lanes of
    /// f64 sums.
    pub fn sum_exp_below(v: &[f32], max: f32) -> f64 {
        let mut lanes = [0.0f64; LANES];
        let chunks = v.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            let x: &[f32; LANES] = chunk.try_into().expect("a whole chunk");
            for j in 0..LANES {
                lanes[j] += exp(x[j] - max) as f64;
            }
        }
        let mut sum = 0.0;
        for lane in lanes {
            sum += lane;
        }
        for &x in tail {
            sum += exp(x - max) as f64;
        }
        sum
    }
}

simd_fn! {
    /// Replaces each value by e^(v[i] − max), for a `max` at least every value, and returns
    /// their sum in f64: a softmax's unnormalised weights. [`exp`] in f32, 16 lanes of f64 sums
    /// (libm's exp, one call per score, was most of a long prompt's attention time).
    pub fn exp_below_in_place(v: &mut [f32], max: f32) -> f64 {
        let mut lanes = [0.0f64; LANES];
        let mut chunks = v.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            let x: &mut [f32; LANES] = chunk.try_into().expect("a whole chunk");
            for j in 0..LANES {
                x[j] = exp(x[j] - max);
                lanes[j] += x[j] as f64;
            }
        }
        let mut sum = 0.0;
        for lane in lanes {
            sum += lane;
        }
        for x in chunks.into_remainder() {
            *x = exp(*x - max);
            sum += *x as f64;
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weights and their sum are e^(v − max)'s to within 4·10⁻⁷ relative, tail included.
    #[test]
    fn exp_below_in_place_is_exp_within_rounding() {
        let v: Vec<f32> = (0..37).map(|i| ((i * 7919 % 101) as f32 - 80.0) * 0.37).collect();
        let max = max_ignoring_nan(&v);
        let mut w = v.clone();
        let sum = exp_below_in_place(&mut w, max);
        let want: Vec<f64> = v.iter().map(|&x| ((x - max) as f64).exp()).collect();
        for (got, want) in w.iter().zip(&want) {
            assert!((*got as f64 - want).abs() <= 4e-7 * want, "{got} vs {want}");
        }
        let total: f64 = want.iter().sum();
        assert!((sum - total).abs() <= 4e-7 * total, "{sum} vs {total}");
    }

    #[test]
    fn log_softmax_is_within_half_a_micro_nat_of_f64() {
        // Sizes around the 16 lanes and a vocabulary's, logits from -20 to 20 and one masked.
        for n in [1, 7, 16, 17, 50_280] {
            let mut logits: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7331).sin() * 20.0).collect();
            if n > 1 {
                logits[n - 1] = f32::NEG_INFINITY;
            }
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            for target in [0, n / 3, n / 2] {
                let (want, got) = (logits[target] as f64 - lse, log_softmax_at(&logits, target) as f64);
                // 4e-7 from the exps, half an ulp of the f32 result.
                let tolerance = 4e-7 + want.abs() * f32::EPSILON as f64 / 2.0;
                assert!((got - want).abs() <= tolerance, "n {n}, target {target}: {got} against {want}");
            }
        }
        assert_eq!(log_softmax_at(&[0.5, f32::NEG_INFINITY], 1), f32::NEG_INFINITY);
        assert_eq!(log_softmax_at(&[3.0; 40], 5), -(40f32.ln()));
        assert_eq!(max_ignoring_nan(&[f32::NAN, -1.0, f32::NAN]), -1.0);
        assert_eq!(max_ignoring_nan(&[]), f32::NEG_INFINITY);
    }
}
