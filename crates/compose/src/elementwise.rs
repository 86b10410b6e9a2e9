//! Composition when every state value has its own decay (Mamba-1: one decay per layer, channel
//! and state entry). There are as many weight vectors as state values, so storing them costs as
//! much memory traffic as the states themselves; here they are computed a block of values at a
//! time, in L1, and applied at once.
//!
//! Every method works in f32 on blocks of [`B`] values (fixed-width loops that vectorise): one
//! exponential per (value, context), the decay A = e^ld, then [`crate::weights_into`]'s
//! arithmetic on decays (products and sums of non-negative numbers). The weights carry a few ulp
//! of f32 where [`crate::weights_into`] (f64, then rounded) carries one.

use rayon::prelude::*;

use crate::codec::Values;
use crate::simd::prefetch_l2;
use crate::{Composition, Error, TINY_WEIGHT};

/// Values whose weights are computed together: 16 f32 (two AVX2 registers, one AVX-512), one
/// cache line per context; larger blocks spill the per-block accumulators (measured slower).
const B: usize = 16;
type Block = [f32; B];

/// How far ahead (in values) each context's streams are prefetched: 2n streams are read at
/// once, more than the hardware prefetchers follow.
const AHEAD: usize = 4 * B;

/// Prefetches the cache lines of the block of `v` that starts at `e` (in bounds or not).
#[inline(always)]
fn prefetch_block(v: &[f32], e: usize) {
    for line in (0..B).step_by(16) {
        prefetch_l2(v.as_ptr().wrapping_add(e + line).cast());
    }
}

/// The block of `v` that starts at `e` (the caller keeps whole blocks in bounds).
#[inline(always)]
fn block(v: &[f32], e: usize) -> &Block {
    v[e..e + B].try_into().expect("a whole block in bounds")
}

/// e^x of each value for x ≤ 0, within about 1 ulp, branch-free. Below −86 (near where e^x
/// leaves f32's normal range) it is e^−86 ≈ 4·10⁻³⁸: products with it are flushed as weights
/// ([`TINY_WEIGHT`] is 2⁻¹⁰⁰), and sums with 1 do not see it.
#[inline(always)]
fn exp_f32(x: &Block) -> Block {
    // ln 2 = C1 + C2 with C1 of 9 significant bits: k·C1 is exact for the k here (|k| ≤ 124).
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5·2^23: adding it rounds to an integer.
    const SHIFT: f32 = 12_582_912.0;
    // Degree-6 polynomial fitted to e^r on |r| ≤ ln2 / 2 (minimax in relative error, 2·10⁻⁹,
    // a sixtieth of an ulp): r⁶'s coefficient starts the Horner chain, then r⁵ down to 1.
    const POLY: [f32; 6] = [8.374_816e-3, 4.166_822_5e-2, 0.166_664_2, 0.499_999_9, 1.0, 1.0];
    let mut out = [0.0; B];
    for j in 0..B {
        let xc = x[j].max(-86.0);
        let shifted = xc.mul_add(std::f32::consts::LOG2_E, SHIFT);
        let k = shifted - SHIFT;
        let r = k.mul_add(-C2, k.mul_add(-C1, xc));
        let mut p: f32 = 1.383_684_6e-3;
        for c in POLY {
            p = p.mul_add(r, c);
        }
        // p·2^k: k added to p's exponent. The low bits of `shifted` (= 1.5·2^23 + k) shifted
        // up are k << 23; p is in [0.70, 1.42] and k ≥ −124, so the result stays normal.
        out[j] = f32::from_bits(p.to_bits().wrapping_add(shifted.to_bits() << 23));
    }
    out
}

/// Buffers of one task.
#[derive(Default)]
pub struct Scratch {
    /// Per context, one block's decays e^ld and weights.
    a: Vec<Block>,
    w: Vec<Block>,
    /// PICASO-S: the triangle of prefix polynomials and the suffix sums.
    prefix: Vec<Block>,
    suffix: Vec<Block>,
}

/// Weights below [`TINY_WEIGHT`] as 0 (a whole block at once: a select, not masked stores).
/// Soup's and PICASO-R's weights are ≥ 1/n and never need it.
#[inline(always)]
fn flush_tiny(w: Block) -> Block {
    let tiny = TINY_WEIGHT as f32; // 2⁻¹⁰⁰, exact in f32
    w.map(|v| if v < tiny { 0.0 } else { v })
}

/// The f32 weights of one block for Soup, CASO and PICASO-S (PICASO-R's are applied as they
/// are computed, [`picaso_r_block`]): `s.w[k][j]` for context k and value j, from the block's
/// decays `s.a` as [`read_log_decays`] leaves them. Weights below [`TINY_WEIGHT`] are 0.
#[inline(always)]
fn block_weights(method: Composition, n: usize, s: &mut Scratch) {
    s.w.resize(n, [0.0; B]);
    match method {
        Composition::Soup => s.w.fill([(1.0 / n as f64) as f32; B]),
        Composition::Caso => {
            // w_k = A_{k+1}·…·A_{n-1}: products of decays, walking down from w_{n-1} = 1.
            let mut w = [1.0f32; B];
            for k in (0..n).rev() {
                s.w[k] = flush_tiny(w);
                let a = &s.a[k];
                for j in 0..B {
                    w[j] *= a[j];
                }
            }
        }
        Composition::PicasoR => unreachable!("PICASO-R's weights are applied as they are computed"),
        Composition::PicasoS => picaso_s_block(s),
    }
}

/// PICASO-R of one block, each weight applied as it is computed (never stored):
/// R_{n-1} = 1 + A_0(1 + A_1(… (1 + A_{n-2}))) (Horner), then around the cycle
/// R_{k-1} = 1 − A_0·…·A_{n-1} + A_k R_k (each R ≥ 1), and the sum (1/n) Σ_k R_k x_k, taken
/// from the last context down. `a` holds the decays, `total` the sum of the log-decays.
#[inline(always)]
fn picaso_r_block(a: &[Block], total: &Block, x: &[Values<'_>], e: usize) -> Block {
    let n = a.len();
    let all = exp_f32(total);
    let mut r = [1.0f32; B];
    for a in a[..n - 1].iter().rev() {
        r = std::array::from_fn(|j| a[j].mul_add(r[j], 1.0));
    }
    let last = x[n - 1].block16(e);
    let mut acc: Block = std::array::from_fn(|j| r[j] * last[j]);
    for k in (1..n).rev() {
        let (a, x) = (&a[k], x[k - 1].block16(e));
        for j in 0..B {
            r[j] = a[j].mul_add(r[j], 1.0 - all[j]).max(1.0);
            acc[j] = r[j].mul_add(x[j], acc[j]);
        }
    }
    let inv = (1.0 / n as f64) as f32;
    acc.map(|v| v * inv)
}

/// Reads a block's log-decays: checks them (finite, ≤ 0) and returns their sum (in f64,
/// rounded once), or None if one is bad; for every method but Soup, also each context's decays
/// `s.a[k] = e^ld[k]` (a second loop over the block, now in L1: fused into the first, it ran
/// slower).
#[inline(always)]
fn read_log_decays(method: Composition, ld: &[&[f32]], e: usize, s: &mut Scratch) -> Option<Block> {
    let decays = method != Composition::Soup;
    if decays {
        s.a.resize(ld.len(), [0.0; B]);
    }
    // Checked cheaply: the largest log-decay must be ≤ 0 (f32 max skips NaN) and the f64 sum
    // finite (a NaN or −∞ among the terms makes it so; f32 terms cannot overflow f64).
    let mut largest = [f32::MIN; B];
    let mut sum = [-0.0f64; B];
    for l in ld {
        let l = block(l, e);
        largest = std::array::from_fn(|j| if l[j] > largest[j] { l[j] } else { largest[j] });
        sum = std::array::from_fn(|j| sum[j] + l[j] as f64);
    }
    if decays {
        for (a, l) in s.a.iter_mut().zip(ld) {
            *a = exp_f32(block(l, e));
        }
    }
    let ok = largest.iter().fold(true, |a, v| a & (*v <= 0.0)) & sum.iter().fold(true, |a, v| a & v.is_finite());
    // A sum below f32's range is held at its lowest value: e^that is 0 either way, and the
    // composed state stays one that a state file can hold.
    ok.then(|| sum.map(|v| (v as f32).max(f32::MIN)))
}

/// One block: `out[j] = Σᵢ w_i[j]·x_i[j]` (contexts in order, each product rounded, as
/// [`crate::weighted_sum_blocks`] does) and `ld_out[j] = Σᵢ ld_i[j]` (summed in f64). Returns
/// (every output is finite, every log-decay is finite and ≤ 0); on bad log-decays it stops
/// before computing weights.
#[inline(always)]
fn compose_block(
    method: Composition,
    ld: &[&[f32]],
    x: &[Values<'_>],
    e: usize,
    out: &mut Block,
    ld_out: &mut Block,
    s: &mut Scratch,
) -> (bool, bool) {
    for v in ld {
        prefetch_block(v, e + AHEAD);
    }
    for v in x {
        prefetch_l2(v.byte_address(e + AHEAD));
    }
    let Some(total) = read_log_decays(method, ld, e, s) else {
        return (true, false);
    };
    let acc = if method == Composition::PicasoR {
        picaso_r_block(&s.a, &total, x, e)
    } else {
        block_weights(method, ld.len(), s);
        let mut acc = [0.0f32; B];
        for (i, (x, w)) in x.iter().zip(&s.w).enumerate() {
            let x = x.block16(e);
            for j in 0..B {
                acc[j] = if i == 0 { w[j] * x[j] } else { acc[j] + w[j] * x[j] };
            }
        }
        acc
    };
    *out = acc;
    *ld_out = total;
    (acc.iter().fold(true, |a, v| a & v.is_finite()), true)
}

crate::simd_fn! {
    /// One task's values `[from, from + ssm_out.len())`, a block at a time (the last one
    /// padded with log-decay 0 and value 0). Returns (every output is finite, every log-decay
    /// is finite and ≤ 0).
    pub fn compose_range(
        method: Composition,
        log_decays: &[&[f32]],
        ssm: &[Values<'_>],
        from: usize,
        ssm_out: &mut [f32],
        log_decay_out: &mut [f32],
        s: &mut Scratch,
    ) -> (bool, bool) {
        let (mut finite, mut decays_ok) = (true, true);
        let full = ssm_out.len() / B * B;
        let (outs, tail_out) = ssm_out.split_at_mut(full);
        let (ld_outs, tail_ld_out) = log_decay_out.split_at_mut(full);
        for (c, (out, ld_out)) in outs.chunks_exact_mut(B).zip(ld_outs.chunks_exact_mut(B)).enumerate() {
            let (out, ld_out) = (out.try_into().expect("a whole block"), ld_out.try_into().expect("a whole block"));
            let (f, d) = compose_block(method, log_decays, ssm, from + c * B, out, ld_out, s);
            finite &= f;
            decays_ok &= d;
            if !decays_ok {
                return (finite, false);
            }
        }
        if !tail_out.is_empty() {
            let (e, m) = (from + full, tail_out.len());
            let padded = |v: Values<'_>| {
                let mut b = vec![0.0f32; B];
                v.dequantize_into(e, &mut b[..m]);
                b
            };
            let ld: Vec<Vec<f32>> = log_decays.iter().map(|v| padded(Values::F32(v))).collect();
            let x: Vec<Vec<f32>> = ssm.iter().map(|v| padded(*v)).collect();
            let (ld, x): (Vec<&[f32]>, Vec<Values<'_>>) =
                (ld.iter().map(|v| &v[..]).collect(), x.iter().map(|v| Values::F32(v)).collect());
            let (mut out, mut ld_out) = ([0.0; B], [0.0; B]);
            let (f, d) = compose_block(method, &ld, &x, 0, &mut out, &mut ld_out, s);
            tail_out.copy_from_slice(&out[..m]);
            tail_ld_out.copy_from_slice(&ld_out[..m]);
            finite &= f;
            decays_ok &= d;
        }
        (finite, decays_ok)
    }
}

/// PICASO-S's weights of one block into `s.w`, from the decays `s.a`: [`crate::weights_into`]'s
/// normalised recurrences (every number in [0, 1], so no n leaves f32's range), in f32 and a
/// block at a time. O(n²) per value, adding only non-negative numbers.
#[inline(always)]
fn picaso_s_block(s: &mut Scratch) {
    let n = s.a.len();
    // prefix: L̃_0..L̃_{n-1} as a triangle (L̃_k: k+1 entries from k(k+1)/2).
    s.prefix.clear();
    s.prefix.push([1.0; B]);
    for k in 1..n {
        let start = (k - 1) * k / 2;
        let (a, inv) = (s.a[k - 1], 1.0 / k as f32);
        for i in 0..=k {
            let (keep, take) = ((k - i) as f32 * inv, i as f32 * inv);
            let prev = if i < k { s.prefix[start + i] } else { [0.0; B] };
            let shifted = if i > 0 { s.prefix[start + i - 1] } else { [0.0; B] };
            s.prefix.push(std::array::from_fn(|j| (take * a[j]).mul_add(shifted[j], keep * prev[j])));
        }
    }
    s.suffix.clear();
    s.suffix.resize(n, [1.0 / n as f32; B]);
    for k in (0..n).rev() {
        if k < n - 1 {
            let (a, inv) = (s.a[k + 1], 1.0 / (k + 1) as f32);
            for i in 0..=k {
                let (keep, take) = ((k + 1 - i) as f32 * inv, (i + 1) as f32 * inv);
                let (v, next) = (s.suffix[i], s.suffix[i + 1]);
                s.suffix[i] = std::array::from_fn(|j| (take * a[j]).mul_add(next[j], keep * v[j]));
            }
        }
        let mut w = [0.0f32; B];
        for (x, y) in s.prefix[k * (k + 1) / 2..k * (k + 1) / 2 + k + 1].iter().zip(&s.suffix) {
            w = std::array::from_fn(|j| x[j].mul_add(y[j], w[j]));
        }
        s.w[k] = flush_tiny(w);
    }
}

/// Composes states whose every value has its own decay, without storing the weights:
/// `ssm_out[e] = Σᵢ wᵢ(e) · ssm[i][e]` with w(e) the `method`'s weights of the log-decays
/// `log_decays[·][e]` (contexts in order), and `log_decay_out[e] = Σᵢ log_decays[i][e]`, the
/// composed state's decay (summed in f64, rounded once). Agrees with
/// [`crate::weights_per_element`] then [`crate::weighted_sum_blocks`] (f64 weights) within a
/// few ulp of f32 per term: the weights are computed in f32.
pub fn compose_per_value(
    method: Composition,
    log_decays: &[&[f32]],
    ssm: &[&[f32]],
    ssm_out: &mut [f32],
    log_decay_out: &mut [f32],
) -> Result<(), Error> {
    let ssm: Vec<Values<'_>> = ssm.iter().map(|x| Values::F32(x)).collect();
    compose_per_value_values(method, log_decays, &ssm, ssm_out, log_decay_out)
}

/// [`compose_per_value`] over states in any codec, dequantized a block at a time as they are
/// read (never copied whole to f32).
pub fn compose_per_value_values(
    method: Composition,
    log_decays: &[&[f32]],
    ssm: &[Values<'_>],
    ssm_out: &mut [f32],
    log_decay_out: &mut [f32],
) -> Result<(), Error> {
    let n = log_decays.len();
    if n == 0 {
        return Err(Error::Empty);
    }
    let len = ssm_out.len();
    if ssm.len() != n {
        return Err(Error::Shape(format!("{} states for {n} log-decay arrays", ssm.len())));
    }
    if log_decay_out.len() != len {
        return Err(Error::Shape(format!("{} output log-decays for {len} state values", log_decay_out.len())));
    }
    for (i, (x, ld)) in ssm.iter().zip(log_decays).enumerate() {
        if x.len() != len || ld.len() != len {
            return Err(Error::Shape(format!(
                "context {i} has {} state values and {} log-decays, expected {len} of each",
                x.len(),
                ld.len()
            )));
        }
    }
    // Tasks of 4096 values: ~16 KiB of output each, many per core.
    const TASK: usize = 4096;
    let checks = ssm_out
        .par_chunks_mut(TASK)
        .zip(log_decay_out.par_chunks_mut(TASK))
        .enumerate()
        .map_init(Scratch::default, |s, (t, (out, ld_out))| {
            compose_range(method, log_decays, ssm, t * TASK, out, ld_out, s)
        })
        .reduce(|| (true, true), |a, b| (a.0 && b.0, a.1 && b.1));
    match checks {
        (_, false) => {
            // Rare path: name the culprit (checked in lanes above, found here).
            for (context, ld) in log_decays.iter().enumerate() {
                if let Some(v) = ld.iter().find(|v| !(v.is_finite() && **v <= 0.0)) {
                    return Err(Error::BadLogDecay { context, value: *v as f64 });
                }
            }
            Err(Error::NonFinite) // (the two checks refuse the same values)
        }
        (false, true) => Err(Error::NonFinite),
        (true, true) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_within_an_ulp_of_libm() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -100.0 {
            let got = exp_f32(&[x; B])[0] as f64;
            let want = (x as f64).exp();
            if x >= -86.0 {
                // Relative to the f32 spacing at `want` (one ulp = 2^-23 of its binade).
                let ulp = f32::EPSILON as f64 * 2f64.powi((want.log2()).floor() as i32);
                worst = worst.max((got - want).abs() / ulp);
            } else {
                assert!(got <= 4.5e-38, "exp({x}) = {got}");
            }
            x -= 0.0037;
        }
        assert!(worst <= 1.0, "worst error {worst} ulp");
        assert_eq!(exp_f32(&[0.0; B]), [1.0; B]);
        assert!(exp_f32(&[f32::MIN; B])[0] <= 4.5e-38);
    }

    /// The weights a block applies against [`crate::weights`] (f64): within a few ulp per
    /// context (each decay's exp carries one, each product or Horner step one more).
    #[test]
    fn block_weights_match_the_scalar_weights() {
        let mut rng = 12345u64;
        let mut next = || {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        for method in [Composition::Soup, Composition::Caso, Composition::PicasoS, Composition::PicasoR] {
            for n in [1usize, 2, 3, 7, 12] {
                let mut s = Scratch::default();
                // Log-decays from 0 to -1e4, including exact zeros.
                let ld: Vec<Vec<f32>> = (0..n)
                    .map(|_| {
                        (0..B)
                            .map(|_| match (next() * 4.0) as u32 {
                                0 => 0.0,
                                1 => -next() as f32 * 1e4,
                                _ => -next() as f32 * 3.0,
                            })
                            .collect()
                    })
                    .collect();
                let refs: Vec<&[f32]> = ld.iter().map(|v| &v[..]).collect();
                // Context k's weights are the composition of one-hot states (1 in context k).
                let (ones, zeros) = (vec![1.0f32; B], vec![0.0f32; B]);
                let weights: Vec<Block> = (0..n)
                    .map(|k| {
                        let x: Vec<Values<'_>> =
                            (0..n).map(|i| Values::F32(if i == k { &ones[..] } else { &zeros[..] })).collect();
                        let (mut out, mut ld_out) = ([0.0; B], [0.0; B]);
                        assert_eq!(compose_block(method, &refs, &x, 0, &mut out, &mut ld_out, &mut s), (true, true));
                        let sum: Block = std::array::from_fn(|j| ld.iter().map(|l| l[j] as f64).sum::<f64>() as f32);
                        assert_eq!(ld_out, sum);
                        out
                    })
                    .collect();
                let mut worst = 0.0f64;
                for j in 0..B {
                    let column: Vec<f64> = ld.iter().map(|l| l[j] as f64).collect();
                    let want = crate::weights(method, &column).unwrap();
                    for (k, (w, want)) in weights.iter().zip(want).enumerate() {
                        let got = w[j] as f64;
                        if want < TINY_WEIGHT * 0.99 {
                            assert_eq!(got, 0.0, "{method:?} n={n} k={k}: {got} for {want}");
                        } else if want > TINY_WEIGHT * 1.01 {
                            worst = worst.max((got - want).abs() / (want * f32::EPSILON as f64));
                        }
                    }
                }
                assert!(worst <= (n + 2) as f64, "{method:?} n={n}: {worst} ulp");
            }
        }
    }
}
